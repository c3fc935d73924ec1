#!/bin/bash
# Issue 65 part 2 (the default episodes rewritten as a workflow): the rollout loop's CPU per episode
# before (9202715) and after, alternating, five pairs a round (two rounds in the .jsonl), on one quiet machine.
# Usage: git worktree add /tmp/ep_before 9202715; git worktree add /tmp/ep_after NEW
#        bash docs/bench/episode_before_after.sh
PY=${PY:-$PWD/.venv/bin/python}
script=$(realpath docs/bench/episode_overhead.py); model=$(realpath models/tiny-digits)
out=${OUT:-docs/bench/episode_before_after.jsonl}; out=$(realpath -m $out)
: > $out
for i in 1 2 3 4 5; do
  for side in before after; do
    line=$(cd /tmp/ep_$side && PYTHONPATH=. timeout 300 $PY $script --tokenizer $model | tail -1)
    echo "{\"side\": \"$side\", \"result\": ${line:-null}}" >> $out
  done
done
