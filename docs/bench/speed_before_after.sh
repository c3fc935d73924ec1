#!/bin/bash
# Issue 61's "nothing else slower": the benches it names, side by side on two commits, alternating, on
# one quiet machine. before: 4a9fd4d (the commit before issue 61's first change); after: the commit given.
# Usage: git worktree add /tmp/before 4a9fd4d; git worktree add /tmp/after HEAD;
#        ln -s $PWD/models /tmp/before/models; ln -s $PWD/models /tmp/after/models
#        bash docs/bench/speed_before_after.sh
PY=/work/main/.venv/bin/python
out=${OUT:-docs/bench/speed_before_after.jsonl}; out=$(realpath -m $out)
: > $out
run() { # side, name, args...
  side=$1; name=$2; shift 2
  cd /tmp/$side
  line=$(timeout 1500 $PY -m services.cli bench "$@" 2>/tmp/sp_${side}_${name}.err | tail -1)
  echo "{\"side\": \"$side\", \"bench\": \"$name\", \"result\": ${line:-null}}" >> $out
}
for i in 1 2; do
  run before engine engine --no-vllm --json
  run after engine engine --no-vllm --json
done
run before chaos chaos --json
run after chaos chaos --json
run before gateway gateway --json
run after gateway gateway --json
run before async async --scenario sync_batch --scenario async_2 --json
run after async async --scenario sync_batch --scenario async_2 --json
echo '"done"' >> $out
