#!/bin/bash
# Side-by-side benches of two commits (issue 34: d72294c, one token and unary Puts, and the role tokens,
# gated Puts and bucket pieces after it), alternating, on one quiet machine.
# Usage: git worktree add /tmp/before d72294c; git worktree add /tmp/after HEAD;
#        ln -s $PWD/models /tmp/before/models; ln -s $PWD/models /tmp/after/models
#        bash docs/bench/security_before_after.sh
PY=/work/main/.venv/bin/python
out=${OUT:-docs/bench/security_before_after.jsonl}; out=$(realpath -m $out)
: > $out
run() { # side, name, args...
  side=$1; name=$2; shift 2
  cd /tmp/$side
  line=$(timeout 900 $PY -m services.cli bench "$@" 2>/tmp/ab_${side}_${name}.err | tail -1)
  echo "{\"side\": \"$side\", \"bench\": \"$name\", \"result\": ${line:-null}}" >> $out
}
for i in 1 2; do
  run before buffer buffer --groups 4000 --json
  run after buffer buffer --groups 4000 --json
  run before proxy proxy --json
  run after proxy proxy --json
done
run before weights weights --json
run after weights weights --json
echo done >> $out
