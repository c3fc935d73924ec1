"""The rollout loop in-process: the plain controller, the in-memory buffer, a scripted engine.

No sockets and no model: each test runs in well under a second. The same loop runs against
real services in tests/services/test_env_manager.py.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import threading
import time
from collections import Counter

import pytest

from rollout.config import RolloutConfig
from rollout.envs.base import StepResult
from rollout.loop import RolloutLoop
from rollout.ports import Generation, RolloutObserver, TransientError
from sample_buffer.config import BufferConfig
from sample_buffer.memory import MemoryBuffer
from sample_buffer.trajectory import FinishReason
from services.controller.config import ControllerConfig
from services.controller.controller import AsyncController

ROWS = [{"prompt": f"q{i}", "answer": "7"} for i in range(10)]


class CharTokenizer:
    """One token per character: enough to render a prompt and decode a scripted answer."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = "".join(m["content"] for m in messages)  # a template that only joins the turns
        return self.encode(text) if tokenize else text

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


class ScriptedEngine:
    """Answers ``reply(request_id)`` at the controller's current version. ``transient`` calls fail
    with a ``TransientError`` first; a request id in ``held`` waits until it is aborted."""

    def __init__(
        self,
        controller: AsyncController,
        reply=lambda rid: "7",
        transient: int = 0,
        error=None,
        fails=lambda rid: False,
        hold=lambda rid: False,
    ):
        self.controller, self.reply, self.transient, self.error = controller, reply, transient, error
        self.fails = fails  # request ids that raise a (non-transient) error
        self.hold = hold  # request ids that wait until they are aborted
        self.held: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []
        self.calls = 0

    async def generate(self, input_ids, sampling, *, request_id, route, timeout_s) -> Generation:
        self.calls += 1
        if self.error is not None:
            raise self.error
        if self.fails(request_id):
            raise RuntimeError(f"{request_id}: engine failed")
        if self.transient:
            self.transient -= 1
            raise TransientError("UNAVAILABLE", "no engine in rotation")
        version = self.controller.version
        if self.hold(request_id):
            self.held.setdefault(request_id, asyncio.Event())
        if request_id in self.held:
            await self.held[request_id].wait()
            return Generation([ord("7")], [-0.1], [version], FinishReason.ABORT)
        text = self.reply(request_id)
        return Generation([ord(c) for c in text], [-0.5] * len(text), [version] * len(text), FinishReason.STOP)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if request_id in self.held:
            self.held[request_id].set()


class GroupedEngine(ScriptedEngine):
    """Also takes a group's samples in one call, as the LLMProxy's GenerateGroup: each sample answered
    as ``generate`` answers it, all of them once the last is done."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.group_calls: list[list[str]] = []

    async def generate_group(self, input_ids, sampling, *, request_ids, route, timeout_s) -> list[Generation]:
        self.group_calls.append(list(request_ids))
        if self.transient:  # the whole call fails, as the LLMProxy's does
            self.transient -= 1
            raise TransientError("UNAVAILABLE", "no engine in rotation")
        assert route == request_ids[0].rsplit("/", 1)[0]  # the group's own route: one engine
        one = functools.partial(ScriptedEngine.generate, self, input_ids, sampling, route=route, timeout_s=timeout_s)
        return list(await asyncio.gather(*(one(request_id=rid) for rid in request_ids)))


class Recorder(RolloutObserver):
    def __init__(self) -> None:
        self.outcomes: list[str] = []
        self.retries: list[str] = []
        self.dropped: list[str] = []
        self.dropped_tokens: list[int] = []

    def group_ended(self, outcome, trajectories, seconds, domain=""):
        self.outcomes.append(str(outcome))

    def generate_retried(self, code):
        self.retries.append(code)

    def member_dropped(self, cause, tokens=0):
        self.dropped.append(cause)
        self.dropped_tokens.append(tokens)


def make_loop(
    engine_kw=None,
    *,
    async_ratio=0,
    groups_per_step=2,
    filter_zero_variance=False,
    capacity=4096,
    put_timeout_s=30.0,
    grouped=False,
    **cfg,
):
    controller = AsyncController(ControllerConfig(async_ratio=async_ratio, groups_per_step=groups_per_step))
    buffer = MemoryBuffer(
        BufferConfig(filter_zero_variance=filter_zero_variance, capacity_groups=capacity, put_timeout_s=put_timeout_s)
    )
    engine = (GroupedEngine if grouped else ScriptedEngine)(controller, **(engine_kw or {}))
    cfg = {"group_size": 2, "num_workers": 4, "reward": "exact_match", "admit_poll_s": 0.005, **cfg}
    config = RolloutConfig(**cfg)
    loop = RolloutLoop(
        config,
        rows=ROWS,
        tokenizer=CharTokenizer(),
        reward_fn=lambda r, a: float(r == a),
        admission=controller,
        engine=engine,
        sink=buffer,
        observer=Recorder(),
    )
    return loop, controller, buffer, engine


async def until(pred, timeout_s: float = 2.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("scheduling", ["queue", "batch"])
def test_admission_stops_at_the_bound_and_every_slot_is_accounted(scheduling):
    async def main():
        loop, ctl, buffer, _ = make_loop(scheduling=scheduling)
        await loop.start()
        await until(lambda: loop.counters["groups_put"] >= 2)
        await asyncio.sleep(0.05)  # room for a (wrong) third group
        await loop.stop()
        batch = await buffer.get(10, version=0, max_staleness=0, timeout_s=0)
        return loop, ctl, batch.decode()

    loop, ctl, groups = asyncio.run(main())
    assert loop.counters["groups_put"] == 2 and len(groups) == 2  # async_ratio 0: one step, no more
    assert ctl.in_flight == 0 and ctl.finished == 2
    for g in groups:
        assert [t.reward for t in g.trajectories] == [1.0, 1.0]
        assert all(t.finish_reason == FinishReason.STOP and t.start_version == 0 for t in g.trajectories)
    assert loop.counters["trajectories_put"] == 4


def test_filtered_groups_give_their_slots_back():
    """Every answer right: zero reward variance, the buffer filters every group. Their slots come
    back, so the loop goes on well past one step's worth of groups."""

    async def main():
        loop, ctl, buffer, _ = make_loop(filter_zero_variance=True)
        await loop.start()
        await until(lambda: loop.counters["groups_filtered"] >= 10)
        await loop.stop()
        return loop, ctl, await buffer.stats()

    loop, ctl, stats = asyncio.run(main())
    assert loop.counters["groups_put"] == 0 and stats["dropped_filtered"] >= 10
    assert ctl.finished == 0 and ctl.in_flight == 0  # released unused, not finished


def test_transient_generate_failures_are_retried_and_others_fail_the_group():
    async def main():
        loop, ctl, buffer, engine = make_loop({"transient": 2})
        assert await loop.admit(1) == 1
        outcomes = await loop.run_admitted(1)
        retries = list(loop.observer.retries)
        engine.error = ValueError("input_ids: must not be empty")
        assert await loop.admit(1) == 1
        failed = await loop.run_admitted(1)
        return outcomes, retries, failed, engine.calls, loop, ctl

    outcomes, retries, failed, calls, loop, ctl = asyncio.run(main())
    assert outcomes == ["put"] and retries == ["UNAVAILABLE", "UNAVAILABLE"]
    assert failed == ["failed"] and loop.counters["groups_failed"] == 1
    assert ctl.in_flight == 0 and ctl.finished == 1  # the failed group's slot came back
    assert calls == 2 + 2 + 2  # two retried, two answered, two failing members (not retried)


def test_a_transient_failure_past_the_deadline_fails_the_group():
    async def main():
        loop, _, _, _ = make_loop({"transient": 10**6}, episode={"generation_timeout_s": 0.5})
        assert await loop.admit(1) == 1
        t0 = time.monotonic()
        outcomes = await loop.run_admitted(1)
        return outcomes, time.monotonic() - t0

    outcomes, seconds = asyncio.run(main())
    # Backoff 0.1, 0.2 s, then the next 0.4 s wait would pass the deadline: it gives up, never past it.
    assert outcomes == ["failed"] and 0.25 < seconds < 0.6


def test_a_group_that_outlives_the_bound_is_aborted_never_put_and_its_slot_returned():
    """async_ratio 0: member 0 finishes at v0, member 1 is still generating when v1 is committed.
    The group can never be trained on: member 1's generation is aborted, nothing is put."""

    async def main():
        loop, ctl, buffer, engine = make_loop(groups_per_step=1)
        loop.sampler._orders[""] = [3] * len(ROWS)  # every group is prompt p3: its second member is the held one
        engine.held["p3-0/1"] = asyncio.Event()
        await loop.start()
        await until(lambda: any(s.finished_starts for s in loop._rolling.values()))
        update = await ctl.begin_update(1)
        await ctl.commit_update(update, 1)
        await until(lambda: loop.counters["groups_put"] >= 1)  # the slot came back: a fresh group at v1
        await loop.stop()
        batch = await buffer.get(10, version=1, max_staleness=0, timeout_s=0)
        return loop, engine, batch.decode()

    loop, engine, groups = asyncio.run(main())
    assert engine.aborted == ["p3-0/1"]
    assert loop.counters["groups_stale"] == 1 and loop.observer.outcomes[0] == "stale"
    # Fresh groups at v1 (which of them is put first is theirs to race), none of the stale one's members.
    assert groups and all(g.start_version == 1 and g.group_id != "p3-0" for g in groups)


def test_stop_with_drain_lets_groups_in_flight_end():
    async def main():
        loop, ctl, _, engine = make_loop()
        engine.held["p0-0/0"] = asyncio.Event()
        loop.sampler._orders[""] = [0] * len(ROWS)
        await loop.start()
        await until(lambda: loop.running_episodes >= 1)
        asyncio.get_running_loop().call_later(0.05, engine.held["p0-0/0"].set)
        abandoned = await loop.stop(drain=True, timeout_s=2.0)
        return abandoned, ctl

    abandoned, ctl = asyncio.run(main())
    assert abandoned == 0 and ctl.in_flight == 0


class _WatchThatSwallowsCancel:
    """The controller, but its version stream answers a cancel with an error of its own, as a
    cancelled gRPC stream may."""

    def __init__(self, controller: AsyncController) -> None:
        self.controller, self.watching, self.swallow = controller, 0, True

    def __getattr__(self, name):  # admit, release: the controller's own
        return getattr(self.controller, name)

    async def watch_versions(self):
        self.watching += 1
        yield self.controller.version
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if not self.swallow:
                raise
            raise RuntimeError("the stream was cancelled") from None


def test_stopping_ends_the_version_watch_even_when_the_cancel_comes_back_as_an_error():
    """The loop that follows the controller's version watches again after a failed stream; a stop
    whose cancel reached it as the stream's error had it watch again for ever, and stop never returned."""

    async def main():
        loop, ctl, _, _ = make_loop()
        loop.admission = watch = _WatchThatSwallowsCancel(ctl)
        await loop.start()
        await until(lambda: watch.watching >= 1)
        await asyncio.sleep(0.05)  # inside the stream's wait
        stopping = asyncio.create_task(loop.stop())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        watch.swallow = False  # a loop that took the error for a failure ends at its next cancel
        if not done:
            for t in loop._tasks:
                t.cancel()
            await stopping
        return stopping in done, watch.watching

    assert asyncio.run(main()) == (True, 1)


def test_a_group_the_full_buffer_cannot_take_fails_and_gives_its_slot_back():
    async def main():
        loop, ctl, _, _ = make_loop(async_ratio=1, capacity=1, put_timeout_s=0.05)
        assert await loop.admit(2) == 2
        outcomes = await loop.run_admitted(2)
        return sorted(outcomes), ctl

    outcomes, ctl = asyncio.run(main())
    assert outcomes == ["failed", "put"]
    assert ctl.finished == 1 and ctl.in_flight == 0  # only the stored group keeps its slot


def test_a_loop_started_elsewhere_in_the_order_does_not_replay_its_predecessors_prompts():
    """A restarted EnvManager starts at another place in the same shuffled order (``first_prompt``),
    so the prompts its predecessor just ran are not run again first."""

    async def prompts(first_prompt: int) -> list[str]:
        loop, ctl, buffer, _ = make_loop(async_ratio=1, groups_per_step=2)
        loop.first_prompt = first_prompt
        for _ in range(3):
            await loop.run_group()
        batch = await buffer.get(3, version=0, max_staleness=1, timeout_s=0)
        return [g.prompt_id for g in batch.decode()]

    first, restarted = asyncio.run(prompts(0)), asyncio.run(prompts(3))
    assert len(set(first)) == 3 and not set(first) & set(restarted)


# What an environment does to its episode, by member index (the trajectory id's last part).
ENV_FAULTS: dict[str, str] = {}
RELEASE_HUNG = threading.Event()  # set at the end of a test: the hung threads return


class FaultyEnv:
    """The single-turn task, except that member ``i`` misbehaves as ``ENV_FAULTS[str(i)]`` says:
    ``hang`` (a synchronous step that never returns by itself), ``raise`` (the step raises),
    ``reset`` (reset raises)."""

    name = "faulty"
    counter = itertools.count()

    def __init__(self, rows, reward_fn):
        self.rows, self.reward_fn = rows, reward_fn
        self.fault = ENV_FAULTS.get(str(next(self.counter) % 3))

    def reset(self, seed):
        if self.fault == "reset":
            raise ConnectionError("provider refused the reset")
        self.row = self.rows[seed]
        return self.row["prompt"]

    def step(self, action):
        if self.fault == "hang":
            RELEASE_HUNG.wait(30)
        if self.fault == "raise":
            raise ValueError("observation: not UTF-8")
        return StepResult(None, self.reward_fn(action, self.row["answer"]), True)


def _faulty_loop(faults: dict[str, str], **cfg):
    ENV_FAULTS.clear()
    ENV_FAULTS.update(faults)
    FaultyEnv.counter = itertools.count()
    RELEASE_HUNG.clear()
    env = {"type": "custom", "cls": "tests.rollout.test_loop:FaultyEnv"}
    return make_loop(async_ratio=20, group_size=3, env=env, episode={"step_timeout_s": 0.3}, **cfg)


def test_one_failing_member_never_sinks_its_group():
    """Member 0's generation raises in every group: each group is put with its other two members,
    and each dropped member is counted by cause."""

    async def main():
        loop, ctl, buffer, _ = make_loop({"fails": lambda rid: rid.endswith("/0")}, async_ratio=3, group_size=3)
        assert await loop.admit(4) == 4
        outcomes = await loop.run_admitted(4)
        batch = await buffer.get(4, version=0, max_staleness=3, timeout_s=0)
        return outcomes, batch.decode(), loop, ctl

    outcomes, groups, loop, ctl = asyncio.run(main())
    assert outcomes == ["put"] * 4 and ctl.finished == 4 and ctl.in_flight == 0
    assert all(sorted(t.trajectory_id[-1] for t in g.trajectories) == ["1", "2"] for g in groups)
    assert loop.counters["members_dropped_raised"] == 4 and loop.observer.dropped == ["raised"] * 4


def test_hung_env_steps_time_out_without_starving_the_others():
    """A synchronous step that hangs is cut at step_timeout_s and its member dropped. Sixteen hung
    steps at once are more than a shared thread pool holds (asyncio.to_thread's, min(32, cores + 4)
    threads): the other members' steps must still run, so every group is put with two members."""

    async def main():
        loop, ctl, buffer, _ = _faulty_loop({"0": "hang"})
        assert await loop.admit(16) == 16
        t0 = time.monotonic()
        outcomes = await loop.run_admitted(16)
        seconds = time.monotonic() - t0
        batch = await buffer.get(16, version=0, max_staleness=20, timeout_s=0)
        return outcomes, seconds, batch.decode(), loop

    try:
        outcomes, seconds, groups, loop = asyncio.run(main())
    finally:
        RELEASE_HUNG.set()
    assert outcomes == ["put"] * 16 and seconds < 2.0  # each hang costs its deadline (0.3 s), in parallel
    assert all(len(g.trajectories) == 2 for g in groups)
    assert loop.counters["members_dropped_timeout"] == 16


def test_env_errors_are_dropped_and_a_group_left_too_small_fails():
    """A step that raises, or a reset that raises, ends that member as env_error, and it is left
    out. With members 0 and 1 both failing, one member is left: below min_group_members (2), the
    group is not put and its slot comes back."""

    async def main():
        loop, ctl, buffer, _ = _faulty_loop({"0": "raise"})
        assert await loop.admit(2) == 2
        kept = await loop.run_admitted(2)
        counters = dict(loop.counters)
        loop2, ctl2, _, _ = _faulty_loop({"0": "raise", "1": "reset"})
        assert await loop2.admit(2) == 2
        too_few = await loop2.run_admitted(2)
        return kept, counters, too_few, loop2, ctl2

    kept, counters, too_few, loop2, ctl2 = asyncio.run(main())
    assert kept == ["put", "put"] and counters["members_dropped_env_error"] == 2
    assert too_few == ["failed", "failed"] and loop2.counters["groups_too_few_members"] == 2
    assert loop2.counters["members_dropped_env_error"] == 4 and ctl2.in_flight == 0 and ctl2.finished == 0


@pytest.mark.parametrize("policy, kept", [("drop", 2), ("keep_timeouts", 3)])
def test_a_timed_out_member_is_dropped_or_kept_as_configured(policy, kept):
    """keep_timeouts trains a member that generated and then missed its step's deadline, with the
    reward it has (0) and finish_reason timeout; drop leaves it out."""

    async def main():
        loop, _, buffer, _ = _faulty_loop({"0": "hang"}, faulty_members=policy)
        assert await loop.admit(1) == 1
        await loop.run_admitted(1)
        return (await buffer.get(1, version=0, max_staleness=20, timeout_s=0)).decode()

    try:
        (group,) = asyncio.run(main())
    finally:
        RELEASE_HUNG.set()
    assert len(group.trajectories) == kept
    timed_out = [t for t in group.trajectories if t.finish_reason == FinishReason.TIMEOUT]
    assert len(timed_out) == kept - 2 and all(t.reward == 0.0 and t.num_generated == 1 for t in timed_out)


def test_redundant_members_fill_a_group_without_waiting_for_the_slowest():
    """group_size 2 + 2 redundant: members 1 and 3 of every group never finish on their own (a
    fail-stop engine or environment). Each group is put with members 0 and 2; 1 and 3 are aborted
    at the engine and counted as redundant, with what they had generated."""

    async def main():
        hold = lambda rid: rid[-1] in "13"  # noqa: E731
        loop, ctl, buffer, engine = make_loop(
            {"hold": hold, "reply": lambda rid: "7" if rid[-1] == "0" else "1"}, redundant_members=2, group_size=2
        )
        answer = engine.generate

        async def generate(input_ids, sampling, *, request_id, **kw):
            if request_id[-1] in "02":  # answered once the slow two generate: each has a token to lose
                gid = request_id.rsplit("/", 1)[0]
                await until(lambda: {f"{gid}/1", f"{gid}/3"} <= engine.held.keys())
            return await answer(input_ids, sampling, request_id=request_id, **kw)

        engine.generate = generate
        await loop.start()
        await until(lambda: loop.counters["groups_put"] >= 2)
        await loop.stop()
        batch = await buffer.get(10, version=0, max_staleness=0, timeout_s=0)
        return loop, ctl, engine, batch.decode()

    loop, ctl, engine, groups = asyncio.run(main())
    assert len(groups) == 2 and ctl.in_flight == 0
    for g in groups:
        assert [t.trajectory_id[-1] for t in g.trajectories] == ["0", "2"]
        assert [t.reward for t in g.trajectories] == [1.0, 0.0]
        assert {f"{g.group_id}/1", f"{g.group_id}/3"} <= set(engine.aborted)
    assert loop.counters["members_dropped_redundant"] == 4
    # what each had generated when aborted (the scripted engine answers an abort with one token)
    assert loop.observer.dropped == ["redundant"] * 4 and loop.observer.dropped_tokens == [1] * 4


def test_a_workflows_branches_go_into_the_group_and_are_aborted_with_it():
    """A workflow that makes three trajectories an episode (``tests.rollout.workflow_fns:branches``):
    each put group holds every usable member's three, scored by the task's reward. With a redundant
    member, a member whose sub-agent never answers is not waited for: its branch's request is aborted
    at the engine with the group's, and none of its trajectories is put."""
    workflow = {"type": "custom", "path": "tests.rollout.workflow_fns:branches"}

    async def main():
        hold = lambda rid: rid.endswith("/2.1")  # noqa: E731  member 2's first sub-agent hangs
        loop, ctl, buffer, engine = make_loop(
            {"hold": hold, "reply": lambda rid: "7" if rid.endswith(".2") else "1"},
            redundant_members=1,
            group_size=2,
            grouped=True,
            episode={"workflow": workflow},
        )
        await loop.start()
        await until(lambda: loop.counters["groups_put"] >= 2)
        await loop.stop()
        batch = await buffer.get(10, version=0, max_staleness=0, timeout_s=0)
        return loop, ctl, engine, batch.decode()

    loop, ctl, engine, groups = asyncio.run(main())
    assert len(groups) == 2 and ctl.in_flight == 0
    for g in groups:
        ids = [t.trajectory_id.removeprefix(f"{g.group_id}/") for t in g.trajectories]
        assert ids == ["0", "0.1", "0.2", "1", "1.1", "1.2"]
        assert [t.reward for t in g.trajectories] == [0.0, 0.0, 1.0] * 2  # exact_match against "7"
        assert f"{g.group_id}/2.1" in engine.aborted
    assert loop.counters["trajectories_put"] == 12


def test_redundant_members_cover_for_failed_ones():
    """A member whose generation fails does not count toward the group: the redundant one takes its place."""

    async def main():
        loop, ctl, buffer, engine = make_loop(
            {"fails": lambda rid: rid[-1] == "0"}, redundant_members=1, group_size=2, filter_zero_variance=False
        )
        answer, failing = engine.generate, set()

        async def generate(input_ids, sampling, *, request_id, **kw):
            gid, member = request_id.rsplit("/", 1)
            if member == "0":
                failing.add(gid)
            else:  # answered once member 0 has failed: the group cannot fill without its redundant one
                await until(lambda: gid in failing)
            return await answer(input_ids, sampling, request_id=request_id, **kw)

        engine.generate = generate
        await loop.start()
        await until(lambda: loop.counters["groups_put"] >= 2)
        await loop.stop()
        batch = await buffer.get(10, version=0, max_staleness=0, timeout_s=0)
        return loop, batch.decode()

    loop, groups = asyncio.run(main())
    assert [[t.trajectory_id[-1] for t in g.trajectories] for g in groups] == [["1", "2"]] * 2
    assert loop.counters["members_dropped_raised"] == 2 and loop.counters["members_dropped_redundant"] == 0


def test_redundant_members_under_batch_scheduling():
    """Batch rollout waits for every live episode at each turn: the redundant ones are parties too.
    Member 2 of each group is slow to generate; no group may be scored before it arrives (counted
    short, the barrier opened for members 0 and 1, which filled their group without it)."""

    async def main():
        loop, ctl, buffer, engine = make_loop(
            {"hold": lambda rid: rid.endswith("/2")}, redundant_members=1, group_size=2, scheduling="batch"
        )
        await loop.start()
        await until(lambda: len(engine.held) >= 2)  # both groups of the step are waiting on member 2
        await asyncio.sleep(0.1)
        before = loop.counters["groups_put"] + loop.counters["groups_filtered"]
        for event in engine.held.values():
            event.set()
        await until(lambda: loop.counters["trajectories"] >= 4)
        await loop.stop()
        return before

    assert asyncio.run(main()) == 0


def test_tail_batching_defers_the_long_tail_to_a_long_round_and_trains_it():
    """Steps of 2 groups, 2 prompts more per short round. Prompts 2 and 3 are slow the first time
    (held until aborted): the first short round ends with prompts 0 and 1 (its only fast ones, so no
    third can race them for the quota), 2 and 3 are aborted and queued, and with 2 gathered a long
    round runs them to their end. Every step is a full one, at v0 then v1..."""
    slow, first = {2, 3}, {}

    def hold(rid: str) -> bool:
        gid = rid.rsplit("/", 1)[0]
        row = int(gid[1:].split("-")[0])
        return row in slow and first.setdefault(row, gid) == gid

    async def main():
        loop, ctl, buffer, engine = make_loop(
            {"hold": hold}, scheduling="tail", groups_per_step=2, tail_batching={"redundant_prompts": 2}
        )
        loop.sampler._orders[""] = list(range(len(ROWS)))  # prompts in order: 2 and 3 come in the first round
        await loop.start()
        trained = []
        for version in range(5):  # the trainer: a step of 2 groups, then a new version
            batch = await buffer.get(2, version=version, max_staleness=0, timeout_s=2)
            trained.append([g.prompt_id for g in batch.decode()])
            await buffer.ack(batch.batch_id)
            update = await ctl.begin_update(version + 1)
            await ctl.commit_update(update, version + 1)
        await loop.stop()
        return loop, ctl, engine, trained

    loop, ctl, engine, trained = asyncio.run(main())
    assert all(len(step) == 2 for step in trained)  # every step full
    assert set(trained[0]) == {"p0", "p1"}  # the first short round: its fast prompts
    assert {"p2", "p3"} in [set(step) for step in trained]  # the long tail is trained, together, in a long round
    assert loop.counters["tail_prompts_deferred"] >= 2 and loop.counters["tail_long_rounds"] >= 1
    assert {a.split("-")[0] for a in engine.aborted} >= {"p2", "p3"}  # aborted at the engine, not left running


def test_while_admission_is_refused_one_worker_asks_and_the_others_wait_for_it():
    """Eight workers, one step's two groups put: every Admit is refused from then on. One worker
    asks again every admit_poll_s; each other worker is refused once and then waits for the asker
    (the controller saw 8 x more refused calls when each polled on its own). A new version frees
    slots: the waiters are let in, and the next step's groups are put."""

    async def main():
        loop, ctl, buffer, _ = make_loop(num_workers=8, admit_poll_s=0.01)
        refused_by: Counter = Counter()
        admit = ctl.admit

        async def counting_admit(num_groups, *args, **kw):
            admitted = await admit(num_groups, *args, **kw)
            if not admitted.num_groups:
                refused_by[asyncio.current_task().get_name()] += 1
            return admitted

        ctl.admit = counting_admit
        await loop.start()
        await until(lambda: loop.counters["groups_put"] >= 2 and sum(refused_by.values()) >= 40)
        polls = dict(refused_by)
        update = await ctl.begin_update(1)
        await ctl.commit_update(update, 1)
        await until(lambda: loop.counters["groups_put"] >= 4)
        await loop.stop()
        return polls, loop.counters["groups_put"]

    polls, put = asyncio.run(main())
    counts = sorted(polls.values())
    assert counts[-1] >= 30, polls  # the asker
    assert all(n <= 2 for n in counts[:-1]), polls  # the rest: refused once (twice if a wait ran out)
    assert put == 4


@pytest.mark.parametrize("replicate", [False, True, None])
def test_a_groups_samples_go_as_one_request_unless_its_prompt_is_replicated(replicate):
    """replicate_prompts false (or unset, outside a run): a group's members ask the same first turn,
    and it goes as one request of n samples on the group's route; true: n requests of their own. Every
    member gets its own answer either way, and the slots are accounted alike."""

    async def main():
        reply = lambda rid: "7" if rid[-1] in "02" else "1"  # noqa: E731
        loop, ctl, buffer, engine = make_loop(
            {"reply": reply}, grouped=True, group_size=4, async_ratio=3, replicate_prompts=replicate
        )
        assert await loop.admit(3) == 3
        outcomes = await loop.run_admitted(3)
        batch = await buffer.get(3, version=0, max_staleness=3, timeout_s=0)
        return outcomes, batch.decode(), engine, ctl

    outcomes, groups, engine, ctl = asyncio.run(main())
    assert outcomes == ["put"] * 3 and ctl.finished == 3 and ctl.in_flight == 0
    for g in groups:
        assert [t.reward for t in g.trajectories] == [1.0, 0.0, 1.0, 0.0]
    assert engine.calls == 12  # every sample answered once
    if replicate:
        assert engine.group_calls == []
    else:  # one call a group, its members in the order they asked
        want = [[f"{g.group_id}/{i}" for i in range(4)] for g in groups]
        assert sorted(sorted(c) for c in engine.group_calls) == sorted(want)


def test_a_member_that_ends_before_asking_is_not_waited_for_and_the_rest_go_together():
    """Member 1 of every group fails its reset (env_error): the group's request is sent once the other
    two have asked, as one request of their two samples."""

    async def main():
        loop, ctl, buffer, engine = _faulty_loop({"1": "reset"}, grouped=True)
        assert await loop.admit(2) == 2
        outcomes = await loop.run_admitted(2)
        return outcomes, engine, loop

    outcomes, engine, loop = asyncio.run(main())
    assert outcomes == ["put", "put"] and loop.counters["members_dropped_env_error"] == 2
    assert sorted(len(c) for c in engine.group_calls) == [2, 2]
    assert all(not rid.endswith("/1") for call in engine.group_calls for rid in call)


def test_a_groups_request_is_retried_on_a_transient_failure_and_redundant_members_go_alone():
    async def main():
        loop, _, _, engine = make_loop({"transient": 2}, grouped=True, group_size=3)
        assert await loop.admit(1) == 1
        outcomes = await loop.run_admitted(1)
        retries = list(loop.observer.retries)
        redundant, _, _, alone = make_loop(grouped=True, group_size=2, redundant_members=1)
        assert await redundant.admit(1) == 1
        return outcomes, retries, engine, await redundant.run_admitted(1), alone

    outcomes, retries, engine, redundant, alone = asyncio.run(main())
    assert outcomes == ["put"] and retries == ["UNAVAILABLE", "UNAVAILABLE"]
    assert len(engine.group_calls) == 3 and engine.calls == 3  # two failed tries, then three samples
    # A group's request answers when its last sample ends; redundant rollout must not wait for it.
    # Its members go one by one: the two the group keeps, and the redundant one unless the group was
    # full before that one's task ran (it is then cancelled unsent: a loaded machine's schedule).
    assert redundant == ["put"] and alone.group_calls == [] and 2 <= alone.calls <= 3
