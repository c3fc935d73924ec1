#!/bin/bash
# Issue 61's "nothing else slower": the benches it names, side by side on two commits, alternating, on
# one machine. before: 4a9fd4d (the commit before issue 61's first change, and before issue 62's);
# after: 8ffa9b8 (both issues' changes). Results: docs/bench/speed_before_after.jsonl (a line a run;
# "rerun" marks the later pairs: the first gateway and async pairs had a test run beside them).
# Usage: git worktree add /tmp/before 4a9fd4d; git worktree add /tmp/after 8ffa9b8;
#        ln -s $PWD/models /tmp/before/models; ln -s $PWD/models /tmp/after/models
#        bash docs/bench/speed_before_after.sh
PY=/work/main/.venv/bin/python
out=${OUT:-docs/bench/speed_before_after.jsonl}; out=$(realpath -m $out)
: > $out
run() { # side, name, rerun, args...
  side=$1; name=$2; rerun=$3; shift 3
  cd /tmp/$side
  line=$(timeout 1500 $PY -m services.cli bench "$@" 2>/tmp/sp_${side}_${name}.err | tail -1)
  echo "{\"side\": \"$side\", \"bench\": \"$name\", \"rerun\": $rerun, \"result\": ${line:-null}}" >> $out
}
for i in 1 2; do
  run before engine 0 engine --no-vllm --json
  run after engine 0 engine --no-vllm --json
done
run before chaos 0 chaos --json
run after chaos 0 chaos --json
run before gateway 0 gateway --json
run after gateway 0 gateway --json
run before async 0 async --scenario sync_batch --scenario async_2 --json
run after async 0 async --scenario sync_batch --scenario async_2 --json
run before gateway 1 gateway --json
run after gateway 1 gateway --json
run after gateway 2 gateway --json
run before gateway 2 gateway --json
run before async 2 async --scenario async_2 --json
run after async 2 async --scenario async_2 --json
run after async 3 async --scenario async_2 --json
run before async 3 async --scenario async_2 --json
