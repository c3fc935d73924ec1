#!/bin/bash
# Side-by-side benches of two commits (issue 33: 3fd436e, before the registries, and 4531697), alternating, on one quiet machine.
# Usage: git worktree add /tmp/before OLD; git worktree add /tmp/after NEW; ln -s $PWD/models /tmp/{before,after}/models; bash docs/bench/refactor_before_after.sh
PY=/work/main/.venv/bin/python
out=${OUT:-docs/bench/refactor_before_after.jsonl}; out=$(realpath -m $out)
: > $out
run() { # side, name, args...
  side=$1; name=$2; shift 2
  cd /tmp/$side
  line=$(timeout 900 $PY -m services.cli bench "$@" 2>/tmp/ab_${side}_${name}.err | tail -1)
  echo "{\"side\": \"$side\", \"bench\": \"$name\", \"result\": ${line:-null}}" >> $out
}
for i in 1 2; do
  run before engine engine --no-vllm --num-prompts 64 --json
  run after engine engine --no-vllm --num-prompts 64 --json
done
for i in 1 2; do
  run before async async --scenario async_2 --no-agentic --json
  run after async async --scenario async_2 --no-agentic --json
done
run before weights weights --json
run after weights weights --json
echo done >> $out
