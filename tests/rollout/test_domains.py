"""Several task domains in one rollout loop (in-process: the plain controller, the in-memory buffer,
a scripted engine): each domain's rows, group size and sampling, shares by weight, and the boost of a
domain whose groups are filtered."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from rollout.config import RolloutConfig
from rollout.domains import Domain
from rollout.loop import RolloutLoop
from sample_buffer.config import BufferConfig
from sample_buffer.memory import MemoryBuffer
from services.controller.config import ControllerConfig
from services.controller.controller import AsyncController
from tests.rollout.test_loop import CharTokenizer, ScriptedEngine, until


def _dataset(tmp_path, name: str, answer: str) -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{name} q{i}", "answer": answer}) + "\n" for i in range(6)))
    return str(path)


def _domains(config: RolloutConfig) -> list[Domain]:
    out = []
    for d in config.task_domains():
        rows, _, build = d.env_factory()
        out.append(
            Domain(d.name, d.weight, rows, lambda _, b=build: b(), config.episode_of(d), config.group_size_of(d))
        )
    return out


class RecordingEngine(ScriptedEngine):
    """Also keeps each request's sampling."""

    def __init__(self, controller, **kw):
        super().__init__(controller, **kw)
        self.max_new_tokens: dict[str, int] = {}

    async def generate(self, input_ids, sampling, *, request_id, route, timeout_s):
        self.max_new_tokens[request_id] = sampling.max_new_tokens
        return await super().generate(input_ids, sampling, request_id=request_id, route=route, timeout_s=timeout_s)


def _run(config: RolloutConfig, reply, groups: int, filter_zero_variance=False):
    async def main():
        controller = AsyncController(ControllerConfig(async_ratio=100, groups_per_step=1))
        buffer = MemoryBuffer(BufferConfig(filter_zero_variance=filter_zero_variance))
        engine = RecordingEngine(controller, reply=reply)
        loop = RolloutLoop(
            config,
            tokenizer=CharTokenizer(),
            admission=controller,
            engine=engine,
            sink=buffer,
            domains=_domains(config),
        )
        await loop.start()
        await until(lambda: loop.counters["groups_put"] >= groups, timeout_s=20)
        await loop.stop()
        batch = await buffer.get(1000, version=0, max_staleness=100, timeout_s=0)
        return loop, engine, batch.decode()

    return asyncio.run(main())


def test_each_domain_runs_its_own_rows_group_size_and_sampling_and_the_groups_say_their_domain(tmp_path):
    config = RolloutConfig(
        num_workers=3,
        admit_poll_s=0.005,
        domains=[
            {"name": "math", "dataset_path": _dataset(tmp_path, "math", "7"), "weight": 0.5, "reward": "exact_match"},
            {"name": "code", "dataset_path": _dataset(tmp_path, "code", "7"), "weight": 0.3, "group_size": 3},
            {
                "name": "chat",
                "dataset_path": _dataset(tmp_path, "chat", "7"),
                "weight": 0.2,
                "episode": {"sampling": {"max_new_tokens": 5}},
            },
        ],
        group_size=2,
    )
    loop, engine, groups = _run(config, reply=lambda rid: "7" if rid.endswith("/0") else "8", groups=30)
    by_domain = {d: [g for g in groups if g.domain == d] for d in ("math", "code", "chat")}
    assert all(by_domain.values())
    for name, gs in by_domain.items():
        assert all(g.prompt_id.startswith(f"{name}/p") for g in gs)
        assert {len(g.trajectories) for g in gs} == {3 if name == "code" else 2}
    chat_requests = {rid: n for rid, n in engine.max_new_tokens.items() if rid.startswith("chat-")}
    assert chat_requests and set(chat_requests.values()) == {5}
    assert set(n for rid, n in engine.max_new_tokens.items() if not rid.startswith("chat-")) == {128}
    drawn = loop.sampler._drawn
    total = sum(drawn.values())
    for name, w in {"math": 0.5, "code": 0.3, "chat": 0.2}.items():  # every group put: drawn by weight alone
        assert abs(drawn[name] - w * total) < 1


def test_a_domain_whose_groups_are_filtered_is_drawn_more_often_up_to_its_bound(tmp_path):
    """'easy' always answers right (all rewards 1: filtered); it is drawn more than its weight, at
    most domain_oversampling times as often as weight alone would, and 'hard' still fills the buffer."""
    config = RolloutConfig(
        num_workers=2,
        admit_poll_s=0.005,
        group_size=2,
        domain_oversampling=3,
        domains=[
            {"name": "hard", "dataset_path": _dataset(tmp_path, "hard", "7"), "weight": 0.5},
            {"name": "easy", "dataset_path": _dataset(tmp_path, "easy", "7"), "weight": 0.5},
        ],
    )
    reply = lambda rid: "7" if rid.startswith("easy-") or rid.endswith("/0") else "8"  # noqa: E731
    loop, _, groups = _run(config, reply, groups=40, filter_zero_variance=True)
    assert Counter(g.domain for g in groups) == {"hard": len(groups)}
    drawn = loop.sampler._drawn
    share = drawn["easy"] / (drawn["easy"] + drawn["hard"])
    assert 0.5 < share <= 0.75 + 0.05  # the bound: 3 x 0.5 against 0.5
    assert loop.sampler.put_rate["easy"] < 0.2 and loop.sampler.put_rate["hard"] == 1.0


def test_a_run_without_domains_rolls_out_its_one_task_as_before(tmp_path):
    config = RolloutConfig(num_workers=2, admit_poll_s=0.005, group_size=2, dataset_path=_dataset(tmp_path, "t", "7"))
    [only] = config.task_domains()
    assert only.name == "" and only.dataset_path == config.dataset_path
    _, _, groups = _run(config, reply=lambda rid: "7", groups=4)
    assert {g.domain for g in groups} == {""} and all(g.prompt_id.startswith("p") for g in groups)


def test_a_domain_may_make_its_rows_at_start_up_as_make_dataset_does(tmp_path):
    from rollout.envs.generated import generate_rows

    config = RolloutConfig(
        domains=[
            {"name": "code", "generate": {"task": "code_tasks", "size": 12, "seed": 3}},
            {"name": "format", "generate": {"task": "word_count", "size": 7}},
        ]
    )
    rows = {d.name: d.env_factory()[0] for d in config.task_domains()}
    assert rows["code"] == generate_rows("code_tasks", 12, 3) and len(rows["format"]) == 7
    with pytest.raises(ValueError, match="generate: rows are made or read, not both"):
        RolloutConfig(domains=[{"name": "a", "dataset_path": "x.jsonl", "generate": {"task": "word_count"}}])
