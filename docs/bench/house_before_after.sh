#!/bin/bash
# Side-by-side benches of two commits (issue 64, the house: 5cb3dd8 before the launch/ move and the
# splits, and the commit after them), alternating, on one quiet machine.
# Usage: git worktree add /tmp/before 5cb3dd8; git worktree add /tmp/after NEW
#        ln -s $PWD/models /tmp/before/models; ln -s $PWD/models /tmp/after/models; make model
#        bash docs/bench/house_before_after.sh
# The CLI moved in between: services.cli before, launch.cli after.
PY=${PY:-/work/main/.venv/bin/python}
out=${OUT:-docs/bench/house_before_after.jsonl}; out=$(realpath -m $out)
: > $out
run() { # side, name, args...
  side=$1; name=$2; shift 2
  cd /tmp/$side
  cli=launch.cli; [ -f launch/cli.py ] || cli=services.cli
  line=$(timeout 900 $PY -m $cli bench "$@" 2>/tmp/house_${side}_${name}.err | tail -1)
  echo "{\"side\": \"$side\", \"bench\": \"$name\", \"result\": ${line:-null}}" >> $out
}
for i in 1 2; do
  run before engine engine --no-vllm --num-prompts 64 --json
  run after engine engine --no-vllm --num-prompts 64 --json
  run before proxy proxy --json
  run after proxy proxy --json
  run before async async --scenario async_2 --no-agentic --json
  run after async async --scenario async_2 --no-agentic --json
  run before weights weights --json
  run after weights weights --json
done
echo done >> $out
