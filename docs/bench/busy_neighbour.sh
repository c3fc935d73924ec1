#!/bin/bash
# `rollmesh bench engine` (tiny model, no vLLM, 64 prompts) on a quiet machine and beside a busy
# neighbour: a spinning Python process, or a torch process with all cores' threads (what another
# engine or trainer is). Each row: the bench's torch threads default (every core) or 1
# (OMP_NUM_THREADS=1, what `rollmesh run` gives each of two torch processes on two cores).
# Prints "label embedded_tokens_per_s hf_generate_tokens_per_s" lines, then one JSON line.
# Run from the checkout's root after `make setup model`; about 5 minutes on 2 cores.
set -u
declare -A result
pids=()
trap 'kill "${pids[@]}" 2>/dev/null' EXIT  # no neighbour outlives the script
bench() {  # label, env assignments...
  local label=$1; shift
  local line; line=$(env "$@" .venv/bin/rollmesh bench engine --no-vllm --num-prompts 64 --json 2>/dev/null | tail -1)
  result[$label]=$(echo "$line" | python3 -c 'import json,sys; d=json.loads(sys.stdin.read()); print(d["embedded_tokens_per_s"], d["hf_generate_tokens_per_s"])')
  echo "$label ${result[$label]}"
}
neighbour() {  # env assignments...; starts it and prints its pid
  env "$@" .venv/bin/python -c '
import torch, time
a = torch.randn(256, 256)
while True:
    for _ in range(50):
        a = torch.tanh(a @ a)
    time.sleep(0.001)' >/dev/null 2>&1 & echo $!  # its output not in \$(...), which would wait for it
}
bench quiet_default
bench quiet_1thread OMP_NUM_THREADS=1
python3 -c "while True: pass" & pid=$!; pids+=("$pid")  # one core kept busy
bench spinning_default; bench spinning_1thread OMP_NUM_THREADS=1; kill $pid
pid=$(neighbour); pids+=("$pid"); sleep 3
bench torch_default; bench torch_1thread OMP_NUM_THREADS=1; kill $pid
pid=$(neighbour OMP_NUM_THREADS=1); pids+=("$pid"); sleep 3
bench torch1_default; bench torch1_1thread OMP_NUM_THREADS=1; kill $pid
python3 - "$(declare -p result)" <<'PY'
import json, re, sys
pairs = re.findall(r'\[(\w+)\]="([\d.]+) ([\d.]+)"', sys.argv[1])
print(json.dumps({k: {"embedded_tokens_per_s": float(e), "hf_generate_tokens_per_s": float(g)} for k, e, g in pairs}))
PY
