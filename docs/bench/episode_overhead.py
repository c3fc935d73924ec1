"""The rollout loop's own CPU per episode: the EnvManager's loop, episodes and environment against an
engine that answers at once (no model), so what is timed is rollmesh's Python per episode and per
group: admission, rendering, the episode's turns, the reward, the put. Issue 65 part 2 rewrote the
episode as a workflow over a context; this measures both sides with the same script.

    PYTHONPATH=CHECKOUT python docs/bench/episode_overhead.py [--groups 400] [--turns 1]

JSON last line: CPU and wall milliseconds per episode, single-turn and three-turn.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from transformers import AutoTokenizer

from rollout.config import RolloutConfig
from rollout.loop import RolloutLoop
from rollout.ports import Generation
from sample_buffer.config import BufferConfig
from sample_buffer.memory import MemoryBuffer
from sample_buffer.trajectory import FinishReason
from services.controller.config import ControllerConfig
from services.controller.controller import AsyncController


class InstantEngine:
    """Eight tokens at the controller's version, at once; ``answer`` decides whether they are right."""

    def __init__(self, controller, answer_ids: list[int]) -> None:
        self.controller, self.answer_ids = controller, answer_ids

    async def generate(self, input_ids, sampling, *, request_id, route, timeout_s, **_) -> Generation:
        v = self.controller.version
        ids = self.answer_ids
        return Generation(list(ids), [-0.5] * len(ids), [v] * len(ids), FinishReason.STOP)

    async def abort(self, request_id: str) -> None:
        pass


async def measure(tokenizer_path: str, groups: int, turns: int) -> dict:
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    rows = [{"prompt": f"Which digit is hidden in a{i % 10}bcd?", "answer": str(i % 10)} for i in range(100)]
    controller = AsyncController(ControllerConfig(async_ratio=10**6, groups_per_step=8))
    buffer = MemoryBuffer(BufferConfig(filter_zero_variance=False, capacity_groups=10**6))
    # a wrong answer with tries = turns: every episode takes all its turns
    env = {"type": "single_turn", "tries": turns} if turns > 1 else {"type": "single_turn"}
    config = RolloutConfig(
        group_size=8, num_workers=16, reward="exact_match", admit_poll_s=0.005, env=env, episode={"max_turns": turns}
    )
    engine = InstantEngine(controller, tok.encode("wrong", add_special_tokens=False)[:8])
    loop = RolloutLoop(
        config, rows=rows, tokenizer=tok, reward_fn=lambda r, a: float(r == a), admission=controller,
        engine=engine, sink=buffer,
    )  # fmt: skip
    c0, w0 = time.process_time(), time.perf_counter()
    await loop.start()
    while loop.counters["groups_put"] < groups:
        await asyncio.sleep(0.01)
    await loop.stop()
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    episodes = loop.counters["trajectories_put"]
    return {
        "episodes": episodes,
        "cpu_ms_per_episode": 1e3 * cpu / episodes,
        "wall_ms_per_episode": 1e3 * wall / episodes,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--tokenizer", default="models/tiny-digits")
    args = ap.parse_args()
    out = {f"turns_{n}": asyncio.run(measure(args.tokenizer, args.groups, n)) for n in (1, 3)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
