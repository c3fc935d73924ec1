#!/bin/sh
# The staleness study of docs/losses.md#staleness: decoupled PPO on the quickstart, 3 seeds per cell.
# About 20-25 min per command on 2 cores; each writes OUT/offpolicy.json and every run's metrics.
set -e
rollmesh bench offpolicy --loss decoupled_ppo --ratio 0 --ratio 2 --seeds 3 --audit --out runs/staleness-lr1e-3 --json
rollmesh bench offpolicy --loss decoupled_ppo --ratio 0 --ratio 2 --lr 5e-4 --seeds 3 --audit --out runs/staleness-lr5e-4 --json
rollmesh bench offpolicy --loss decoupled_ppo --ratio 8 --ratio 2 --seeds 3 --audit --out runs/staleness-ratio8 --json
rollmesh bench offpolicy --loss decoupled_ppo/trust --ratio 8 --ratio 2 --ratio 0 --seeds 3 --audit --out runs/staleness-trust --json
# The math example's per-step policy movement (15 steps, one seed per ratio):
rollmesh bench offpolicy --example smollm2-math --loss decoupled_ppo --ratio 0 --ratio 2 --steps 15 --audit --out runs/staleness-math --json
# The math example, 3 seeds per ratio (40 steps, ~50 min a run on 2 cores). All three seeds at ratios 0 and 2
# are measured (docs/bench/staleness.jsonl, their steps in docs/bench/staleness-math/); one command per seed:
# (seed 0 at ratio 2: rollmesh bench offpolicy --example smollm2-math --loss decoupled_ppo --ratio 2 --seeds 1 --audit)
# (seed 1: rollmesh bench offpolicy --example smollm2-math --loss decoupled_ppo --ratio 0 --ratio 2 --first-seed 1 --seeds 1 --audit)
rollmesh bench offpolicy --example smollm2-math --loss decoupled_ppo --ratio 0 --ratio 2 --first-seed 2 --seeds 1 --audit --out runs/staleness-math-s2 --json
