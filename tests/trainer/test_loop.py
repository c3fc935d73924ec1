"""The training loop in-process: the in-memory buffer, the plain controller, the simulated
engine and a scripted weight publisher. No sockets, no model: each test runs in milliseconds.
The same loop runs against real services in tests/services/test_trainer_loop.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from sample_buffer.codec import CodecError, encode_group
from sample_buffer.config import BufferConfig
from sample_buffer.memory import MemoryBuffer
from services.controller.config import ControllerConfig
from services.controller.controller import AsyncController
from tests.sample_buffer.helpers import make_group
from trainer.config import TrainLoopConfig
from trainer.loop import StalenessMismatch, TrainLoop
from trainer.ports import PublishError, TrainObserver, TransientError
from trainer.sim import SimTrainEngine, SimTrainerConfig


class Publisher:
    """Records what it was asked to move; ``fail`` makes ``load`` raise like a refusing engine."""

    def __init__(self, fail: bool = False) -> None:
        self.fail, self.exported, self.loaded, self.committed_versions = fail, [], [], []

    def export(self, engine, version: int) -> str:
        self.exported.append(version)
        return f"mem://v{version}"

    async def load(self, version: int, timeout_s: float) -> None:
        if self.fail:
            raise PublishError("engine-0: cannot load weights")
        self.loaded.append(version)

    def committed(self, version: int) -> None:
        self.committed_versions.append(version)


class Recorder(TrainObserver):
    def __init__(self) -> None:
        self.steps, self.failures, self.events = [], [], []

    def step_done(self, metrics, staleness):
        self.steps.append((metrics, staleness))
        self.events.append(f"line {metrics['step']}")

    def checkpoint_done(self, seconds):
        self.events.append("checkpoint")

    def update_failed(self, cause):
        self.failures.append(cause)


class BrokenEngine(SimTrainEngine):
    def train_step(self, batch):
        raise ValueError("groups: no trajectories to train on")


def make(tmp_path, *, fail=False, groups_per_step=2, async_ratio=1, engine_cls=SimTrainEngine, **buffer):
    ctl = AsyncController(ControllerConfig(async_ratio=async_ratio, groups_per_step=groups_per_step))
    buf = MemoryBuffer(BufferConfig(filter_zero_variance=False, **buffer))
    cfg = TrainLoopConfig(steps=5, run_dir=str(tmp_path), checkpoint_every=0, get_timeout_s=0.2)
    loop = TrainLoop(
        cfg,
        engine_cls(SimTrainerConfig(time_scale=1e6)),
        source=buf,
        control=ctl,
        publisher=Publisher(fail),
        groups_per_step=groups_per_step,
        max_staleness=async_ratio,
        observer=Recorder(),
    )
    return loop, ctl, buf


def test_a_step_gets_trains_acks_and_publishes(tmp_path):
    async def main():
        loop, ctl, buf = make(tmp_path)
        await loop.join()
        await ctl.admit(2)
        for g in ("a", "b"):
            await buf.put(make_group(g))
        await ctl.release(finished=2)
        metrics = await loop.step()
        return loop, ctl, metrics, await buf.stats()

    loop, ctl, m, stats = asyncio.run(main())
    assert (m["step"], m["version"], m["published"], m["staleness_max"]) == (1, 1, True, 0)
    assert ctl.version == 1 and ctl.model_path == "mem://v1"  # committed: the restore point moves on
    assert loop.publisher.loaded == [1] and loop.publisher.committed_versions == [1]
    assert stats["consumed"] == 2  # acked
    assert len(loop.observer.steps) == 1 and loop.observer.steps[0][1] == [0, 0, 0, 0]


def test_a_step_reports_its_episodes_turns_and_turns_over_target(tmp_path):
    async def main():
        loop, ctl, buf = make(tmp_path)
        await loop.join()
        await ctl.admit(2)
        for g, turns, over in (("a", [0, 10, 20], 1), ("b", [0], 0)):  # 3 + 3 turns, 2 + 0 over target
            group = make_group(g)
            for t in group.trajectories:
                t.metadata |= {"turn_starts": turns, "turns_over_target": over}
            await buf.put(group)
        await ctl.release(finished=2)
        return await loop.step()

    m = asyncio.run(main())
    assert m["turns_mean"] == pytest.approx(2.0)  # (3 + 3 + 1 + 1) / 4 episodes
    assert m["tokens_per_turn"] == pytest.approx(4 * 6 / 8)  # 6 generated tokens in each of 4 episodes
    assert m["turns_over_target_share"] == pytest.approx(2 / 8)


def test_a_steps_line_is_written_before_its_checkpoint(tmp_path, monkeypatch):
    """A trainer killed between the two must not leave a checkpointed step without a line (its
    groups trained but missing from the curve); a line without a checkpoint goes to lost_steps."""
    import trainer.loop

    async def main():
        loop, ctl, buf = make(tmp_path)
        loop.config.checkpoint_every = 2
        saved = loop.observer.events.append
        monkeypatch.setattr(trainer.loop, "save_checkpoint", lambda engine, _, keep_last: saved(f"save {engine.step}"))
        await loop.join()
        for step in range(2):
            await ctl.admit(2)
            for g in ("a", "b"):
                await buf.put(make_group(f"{g}{step}"))
            await ctl.release(finished=2)
            assert await loop.step() is not None
        return loop

    loop = asyncio.run(main())
    assert loop.observer.events == ["line 1", "line 2", "save 2", "checkpoint"]


def test_a_failed_publish_rolls_back_and_is_counted(tmp_path):
    async def main():
        loop, ctl, _ = make(tmp_path, fail=True)
        loop.engine.version = 1
        return await loop.publish(), loop, ctl

    ok, loop, ctl = asyncio.run(main())
    assert not ok and ctl.version == 0 and ctl._update is None  # rolled back, generation resumed
    assert ctl.counters["updates_aborted"] == 1 and loop.observer.failures == ["load"]
    assert loop.publisher.committed_versions == []


def test_stale_groups_are_dropped_and_their_slots_released(tmp_path):
    async def main():
        loop, ctl, buf = make(tmp_path, groups_per_step=1)
        await ctl.admit(1)
        await buf.put(make_group("old", version=0))
        await ctl.release(finished=1)
        loop.engine.version = 3  # two versions past the bound of 1
        before = ctl.capacity()
        metrics = await loop.step()  # nothing fresh arrives within get_timeout_s
        return metrics, before, ctl.capacity(), ctl.counters["dropped"], await buf.stats()

    metrics, before, after, reported, stats = asyncio.run(main())
    assert metrics is None and stats["dropped_stale"] == 1 and reported == 1
    assert after == before + 1  # a controller counting alone gets the slot back from the report


def test_a_batch_that_cannot_be_trained_is_not_acked(tmp_path):
    async def main():
        loop, _, buf = make(tmp_path, engine_cls=BrokenEngine, visibility_timeout_s=0.05)
        for g in ("a", "b"):
            await buf.put(make_group(g))
        with pytest.raises(ValueError, match="groups"):
            await loop.step()
        await asyncio.sleep(0.1)  # past the visibility timeout: handed out again
        again = await buf.get(2, version=0, max_staleness=1, timeout_s=0.5)
        return again, await buf.stats()

    again, stats = asyncio.run(main())
    assert len(again.groups) == 2 and stats["consumed"] == 0 and stats["redelivered"] == 2


def test_corrupt_bytes_never_reach_the_trainer(tmp_path):
    async def main():
        _, _, buf = make(tmp_path)
        good = encode_group(make_group("a"))
        with pytest.raises(CodecError):
            await buf.put_many([good, good[:-7]])  # truncated body: refused where it enters
        return await buf.stats()

    assert asyncio.run(main())["put"] == 0  # nothing of the call stored


def test_the_trainer_refuses_a_bound_other_than_the_controllers(tmp_path):
    loop, _, _ = make(tmp_path)
    loop.max_staleness = 2
    with pytest.raises(StalenessMismatch, match="async_ratio"):
        asyncio.run(loop.join())


def test_a_trainer_behind_the_controller_goes_on_from_its_version(tmp_path):
    """The trainer died after publishing versions its checkpoint does not hold: it follows the
    controller, and its next publish is the controller's version + 1 (never refused as old)."""

    async def main():
        loop, ctl, buf = make(tmp_path)
        ctl.version = 7
        await loop.join()
        await ctl.admit(2)
        for g in ("a", "b"):
            await buf.put(make_group(g, version=7))
        await ctl.release(finished=2)
        return loop, await loop.step(), ctl

    loop, m, ctl = asyncio.run(main())
    assert loop.publisher.loaded == [8] and m["published"] and ctl.version == 8


def test_a_restarted_trainer_supersedes_the_update_its_predecessor_left_in_progress(tmp_path):
    """The trainer died between BeginUpdate and CommitUpdate (chaos run: its successor was refused
    "update ... is in progress" for the 240 s of the dead one's watchdog). The successor's first
    update rolls that one back and goes through at once; a second concurrent begin is still refused."""
    from services.controller.errors import UpdateConflict

    async def main():
        loop, ctl, buf = make(tmp_path)
        orphan = await ctl.begin_update(1, timeout_s=600)  # the dead trainer's
        await loop.join()
        await ctl.admit(2)
        for g in ("a", "b"):
            await buf.put(make_group(g))
        await ctl.release(finished=2)
        m = await loop.step()
        mine = await ctl.begin_update(2, timeout_s=600)
        with pytest.raises(UpdateConflict, match="is in progress"):
            await ctl.begin_update(3)  # only a process's first update supersedes
        with pytest.raises(UpdateConflict, match="not in progress"):
            await ctl.commit_update(orphan, 1)  # rolled back: its id is gone
        await ctl.abort_update(mine)
        return m, ctl

    m, ctl = asyncio.run(main())
    assert m["published"] and ctl.version == 1
    assert ctl.counters["updates_superseded"] == 1 and ctl.counters["updates_aborted"] == 2


def test_a_restarted_trainer_takes_back_the_batch_its_predecessor_died_holding(tmp_path):
    """Chaos run: the trainer killed just after its get waited the buffer's visibility timeout (2 min),
    the controller admitting nothing new meanwhile (those groups were made). Its successor requeues
    them as it joins and trains them at once."""

    async def main():
        loop, ctl, buf = make(tmp_path, visibility_timeout_s=3600)
        await ctl.admit(2)
        for g in ("a", "b"):
            await buf.put(make_group(g))
        await ctl.release(finished=2)
        await buf.get(2, 0, 1, timeout_s=1)  # the dead trainer's, unacked
        await loop.join()
        return await loop.step(), await buf.stats()

    m, stats = asyncio.run(main())
    assert m is not None and m["group_ids"] == ["a", "b"] and m["published"]
    assert stats["consumed"] == 2 and stats["redelivered"] == 2


def test_a_buffer_that_cannot_requeue_leaves_the_batch_to_its_visibility_timeout(tmp_path, caplog):
    """An older buffer without Requeue, or one down past a step's get timeout: the trainer starts anyway."""

    async def main():
        loop, ctl, buf = make(tmp_path)

        async def unimplemented():
            raise RuntimeError("UNIMPLEMENTED: Method not found: Requeue")

        buf.requeue = unimplemented
        await loop.join()
        return loop

    loop = asyncio.run(main())
    assert loop.served_version == 0 and "return at the visibility timeout" in caplog.text


def test_a_trainer_ahead_of_the_controller_publishes_its_checkpoint_before_training(tmp_path):
    """A fresh controller (version 0) under a trainer resumed at version 5: the engines get the
    checkpoint's weights before any step, so no step trains on the initial model's samples."""

    async def main():
        loop, ctl, _ = make(tmp_path)
        loop.engine.version = 5
        await loop.join()
        return loop, ctl

    loop, ctl = asyncio.run(main())
    assert loop.publisher.loaded == [5] and ctl.version == 5 and ctl.model_path == "mem://v5"
    assert loop.engine.version == 5 and loop.engine.step == 0


def test_a_failed_publish_is_retried_and_no_step_trains_past_the_bound(tmp_path):
    """Publishes fail while the only engine is down. Under async_ratio 1 the trainer trains on
    while the engines' samples are still fresh enough for it; once it is two versions ahead, a step
    does not get samples (the buffer would drop every one as stale, after waiting out the get
    timeout): it waits and publishes again. Once the engine is back, the next step publishes first
    and trains."""

    async def main():
        loop, ctl, buf = make(tmp_path)
        await loop.join()
        loop.publisher.fail = True
        for g in ("a", "b", "c", "d", "e", "f"):
            await buf.put(make_group(g, version=0))
        await ctl.release(finished=6, holder="env-0")  # as an EnvManager reports its finished groups
        ahead = [await loop.step(), await loop.step()]  # versions 0 → 1 → 2, none published
        t0 = time.monotonic()
        blocked = await loop.step()  # two ahead: no get, the publish is tried again after a wait
        waited, stats = time.monotonic() - t0, await buf.stats()
        loop.publisher.fail = False  # the engine is back
        for g in ("g", "h"):
            await buf.put(make_group(g, version=2))
        await ctl.release(finished=2, holder="env-0")
        return ahead, blocked, waited, stats, await loop.step(), ctl, loop

    ahead, blocked, waited, stats, m, ctl, loop = asyncio.run(main())
    assert [x["version"] for x in ahead] == [1, 2] and not any(x["published"] for x in ahead)
    assert blocked is None and waited >= 0.5
    assert stats["depth"] == 2 and stats["dropped_stale"] == 0  # e, f were not even asked for
    assert loop.publisher.loaded[:1] == [2] and ctl.version == 3  # v2 first, then the step's v3
    assert m["step"] == 3 and m["published"] and m["staleness_max"] == 0
    assert loop.observer.failures == ["load"] * 4


class LostCommitReply:
    """The controller, except that the first commit's reply never arrives: the commit happened."""

    def __init__(self, ctl: AsyncController) -> None:
        self.ctl, self.lost = ctl, False

    def __getattr__(self, name):
        return getattr(self.ctl, name)

    async def commit_update(self, update_id, version, model_path=""):
        result = await self.ctl.commit_update(update_id, version, model_path)
        if not self.lost:
            self.lost = True
            raise TransientError("UNAVAILABLE", "the reply was lost")
        return result


def test_a_commit_whose_reply_was_lost_does_not_stall_the_trainer(tmp_path):
    """The commit went through but the trainer heard an error. Publishing the same version again
    is refused (not newer); the trainer learns the controller's version instead and trains on,
    even under async_ratio 0 where one unpublished version is already too far ahead."""

    async def main():
        loop, ctl, buf = make(tmp_path, async_ratio=0)
        loop.control = LostCommitReply(ctl)
        await loop.join()
        for g in ("a", "b", "c", "d"):
            await buf.put(make_group(g, version=0))
        await ctl.release(finished=2, holder="env-0")
        first = await loop.step()  # trains v0 → v1; the commit of v1 lands, its reply does not
        for g in ("c2", "d2"):
            await buf.put(make_group(g, version=1))
        await ctl.release(finished=2, holder="env-0")
        return first, await loop.step(), ctl

    first, second, ctl = asyncio.run(main())
    assert first["published"] is False and ctl.version >= 1
    assert second is not None and second["step"] == 2 and second["published"] and ctl.version == 2


class DriftingEngine(SimTrainEngine):
    def train_step(self, batch):
        return super().train_step(batch) | {"kl_behavior_stale": 2.5}


def test_a_step_names_its_groups_and_warns_once_when_stale_samples_are_far_from_the_policy(tmp_path, caplog):
    async def main():
        loop, ctl, buf = make(tmp_path, engine_cls=DriftingEngine)
        await loop.join()
        lines = []
        for step in range(2):
            await ctl.admit(2)
            for g in ("a", "b"):
                await buf.put(make_group(f"{g}{step}"))
            await ctl.release(finished=2)
            lines.append(await loop.step())
        return lines

    with caplog.at_level("WARNING", logger="trainer.loop"):
        first, second = asyncio.run(main())
    assert first["group_ids"] == ["a0", "b0"] and len(first["group_prompts"]) == 2
    assert first["group_versions"] == [0, 0] and all(0 <= r <= 1 for r in first["group_rewards"])
    assert first["dropped_stale"] == 0 and second["group_ids"] == ["a1", "b1"]
    warned = [r.getMessage() for r in caplog.records if "nats (KL(μ ‖ π_prox))" in r.getMessage()]
    assert len(warned) == 1 and "step 1: stale samples are 2.50 nats" in warned[0]
