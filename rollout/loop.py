"""The rollout loop: admit → generate → reward → put, a plain object over three ports.

``run_group`` is the loop for one admitted prompt: its ``group_size`` episodes run as
independent requests (prompt replication), each is scored by its environment the moment it
ends (the reward is computed in the env step), and the group goes to the buffer when its last
member is scored. *How many* groups are admitted at once, and when, is a scheduling strategy
(``rollout/scheduling.py``): queue scheduling admits one group per worker as soon as the last
one ended; batch scheduling admits a whole step and waits for it.

The loop also follows the policy version: a group that can no longer be trained on (a finished
member is older than the bound allows) is stopped at once, its generations aborted and its slot
returned, instead of finishing only to be dropped by the buffer.

Ports (``rollout/ports.py``): ``Admission`` (the AsyncController), ``Generate`` (the LLMProxy),
``SampleSink`` (the SampleBuffer). Nothing here knows about sockets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.admission import RefusalGate, group_is_stale
from rollout.config import RolloutConfig
from rollout.domains import Domain, DomainSampler, Pick
from rollout.envs.base import Env
from rollout.episode import run_trajectories
from rollout.ports import Admission, Generate, Generation, GroupOutcome, RolloutObserver, SampleSink, TransientError
from rollout.sampling import SamplingParams
from rollout.scheduling import Scheduling, Seats, make_scheduling
from rollout.teachers import TeacherFailed, teach
from rollout.turn_barrier import TurnBarrier
from sample_buffer.errors import raise_if_cancelled
from sample_buffer.trajectory import FinishReason, Group, Trajectory

log = logging.getLogger(__name__)


# Why a member is left out of its group: a fault, or the group filled first (redundant rollout).
DROP_CAUSES = ("timeout", "env_error", "raised", "redundant", "image_token")


async def _one(generation) -> list[Generation]:
    """One awaited generation, as the one-element list ``RolloutLoop._retried`` takes."""
    return [await generation]


def _retrieve(task: asyncio.Task) -> None:
    """A cancelled member's end is nobody's business; reading it keeps asyncio from warning."""
    if not task.cancelled():
        task.exception()


@dataclass
class _FirstTurns:
    """A group's first generations, gathered until every member has asked (or ended without asking):
    the members that ask the same are sent as one request of n samples (``replicate_prompts`` false),
    any other alone. Every later turn goes alone."""

    waiting_for: int  # members that have neither asked nor ended
    asks: dict[str, tuple[list[int], SamplingParams, float, asyncio.Future]] = field(default_factory=dict)
    alone: set[str] = field(default_factory=set)  # members whose first call went alone (images)

    def settled(self, tid: str) -> bool:
        return tid in self.asks or tid in self.alone


@dataclass
class _GroupState:
    """A group being rolled out, as far as staleness is concerned."""

    running: set[str]  # trajectory (= request) ids still generating
    pick: Pick | None = None  # the prompt
    finished_starts: list[int] = field(default_factory=list)  # start versions of finished members
    tokens: dict[str, int] = field(default_factory=dict)  # generated so far, by member
    stale: bool = False
    images: dict[str, bytes] = field(default_factory=dict)  # the members' images, by content hash
    first_turns: _FirstTurns | None = None  # while the members' first generations are gathered


class RolloutLoop:
    def __init__(
        self,
        config: RolloutConfig,
        *,
        tokenizer,
        admission: Admission,
        engine: Generate,
        sink: SampleSink,
        observer: RolloutObserver | None = None,
        scheduling: Scheduling | None = None,
        id_prefix: str = "",
        first_prompt: int = 0,
        make_env: Callable[[str], Env] | None = None,
        domains: list[Domain] | None = None,
        rows: list[dict] | None = None,
        reward_fn=None,
        vision=None,
    ) -> None:
        """``id_prefix`` starts every group id: a process's own (random) one keeps ids unique when
        a restarted loop counts from 0 again. ``first_prompt``: where in the shuffled order this
        loop starts; a restarted (or a second) EnvManager that started at 0 would replay the
        prompts its predecessor just ran. ``make_env(episode_id)``: one environment per episode;
        default: the config's environment (a remote one is built over the EnvManager's provider
        pool and passed in here). ``domains``: several tasks (``rollout/domains.py``); default: the
        one task of ``rows``, ``reward_fn`` and ``make_env``. ``vision``: a vision-language model's
        ``sample_buffer.vision.Vision``, for environments that show images."""
        if domains is None:
            rows = rows or []
            make_env = make_env or (lambda _: config.env.build(rows, reward_fn))
            domains = [Domain("", 1.0, rows, make_env, config.episode, config.group_size, reward_fn)]
        self.domains = {d.name: d for d in domains}
        self.sampler = DomainSampler(domains, config.seed, config.domain_oversampling)
        self.config, self.tokenizer, self.vision = config, tokenizer, vision
        self.id_prefix, self.first_prompt = id_prefix, first_prompt
        self.admission, self.engine, self.sink = admission, engine, sink
        self.observer = observer or RolloutObserver()
        self.scheduling = scheduling or make_scheduling(config)
        self.counters: Counter[str] = Counter()
        self.running = False  # admitting new groups
        self.running_episodes = 0
        self.version, self.async_ratio = 0, None  # the controller's, from WatchVersion and Admit
        self._rolling: dict[str, _GroupState] = {}
        self._tasks: list[asyncio.Task] = []
        self._stopped = False
        self._refusals = RefusalGate()
        # One request a group (its prompt's prefill shared) where the engine takes one; the members as
        # requests of their own where the prompt is replicated, routing is asked, or redundant members
        # must not wait for the slowest (a group's request answers when its last sample ends).
        self._group_requests = (
            not config.replicate_prompts
            and not config.return_routed_experts
            and not config.redundant_members
            and hasattr(engine, "generate_group")
        )
        self._sending: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ the loop
    def next_row(self) -> Pick:
        """The next prompt: a domain by weighted turns, then its rows in a shuffled order, round after round."""
        self.counters["prompts_drawn"] += 1
        return self.sampler.next(self.first_prompt)

    def members(self, pick: Pick) -> int:
        """Episodes a group of this prompt runs (redundant ones included)."""
        return self.domains[pick.domain].group_size + self.config.redundant_members

    async def run_group(
        self, barrier: TurnBarrier | None = None, row: Pick | None = None, seats: Seats | None = None
    ) -> GroupOutcome:
        """One admitted group, start to end; returns what became of it. ``row``: the prompt (default:
        the next one); ``seats``: the group is put only if it gets one (tail batching's quota)."""
        n, t0 = self.counters["groups_started"], time.monotonic()
        self.counters["groups_started"] += 1
        pick = self.next_row() if row is None else row
        domain = self.domains[pick.domain]
        named = f"{domain.name}-" if domain.name else ""
        gid = f"{self.id_prefix}{named}p{pick.row}-{n}"
        size = self.members(pick)
        state = self._rolling[gid] = _GroupState(running={f"{gid}/{i}" for i in range(size)}, pick=pick)
        if self._group_requests and size > 1:
            state.first_turns = _FirstTurns(waiting_for=size)
        try:  # generate → reward, every episode on its own, scored by its env the moment it ends
            members = await self._first_members(domain, pick.row, gid, state, size, barrier)
        finally:
            del self._rolling[gid]
        trajectories = [t for member in members for t in member]  # a member's branches beside it
        if state.stale:  # never put: the buffer would only drop it
            return self._ended(GroupOutcome.STALE, trajectories, t0, domain.name)
        if len(members) < min(self.config.min_group_members, domain.group_size):
            log.warning("group %s: %d of %d members usable: not put", gid, len(members), size)
            self.counters["groups_too_few_members"] += 1
            return self._ended(GroupOutcome.FAILED, trajectories, t0, domain.name)
        if domain.teacher is not None:  # the moment its last member ended, as its rewards were
            try:
                trajectories = await teach(
                    domain.teacher, trajectories, gid, self.config.teacher_timeout_s, self.config.teacher_top_k
                )
            except TeacherFailed as e:
                log.warning("group %s: the teacher failed (%s): not put", gid, e)
                self.counters["groups_teacher_error"] += 1
                return self._ended(GroupOutcome.FAILED, trajectories, t0, domain.name)
        if seats is not None and not await seats.take():
            return self._ended(GroupOutcome.SURPLUS, trajectories, t0, domain.name)
        accepted = False
        try:
            images = {h: state.images[h] for t in trajectories for h in t.images}  # each once, the members' own
            group = Group(gid, domain.prompt_id(pick.row), trajectories, domain.name, images)
            result = await self.sink.put(group)  # put
            accepted = result.accepted
        finally:
            if seats is not None:
                await asyncio.shield(seats.done(accepted))
        outcome = GroupOutcome.of_put(result)
        if outcome is GroupOutcome.FAILED:  # the buffer stayed full: not stored
            log.error("group %s not stored: %s", gid, result.reason)
        return self._ended(outcome, trajectories, t0, domain.name)

    async def run_admitted(
        self, num_groups: int, barrier: TurnBarrier | None = None, rows: list[Pick] | None = None
    ) -> list[GroupOutcome]:
        """Run ``num_groups`` admitted groups at once (of ``rows``, default the next prompts) and hand
        their slots back: a group in the buffer keeps its slot as finished; any other returns it unused
        (a filtered group's slot must come back, or dynamic filtering would use up the staleness budget
        and starve the trainer)."""
        rows = rows or [None] * num_groups
        ended: list[GroupOutcome] = []

        async def one(row: Pick | None) -> GroupOutcome:
            ended.append(outcome := await self.run_group_safely(barrier, row))
            return outcome

        try:
            outcomes = await asyncio.gather(*(one(row) for row in rows))
        except asyncio.CancelledError:  # stopped: a group already in the buffer keeps its slot as finished
            put = ended.count(GroupOutcome.PUT)
            await self.release(unused=num_groups - put, finished=put)
            raise
        put = outcomes.count(GroupOutcome.PUT)
        await self.release(unused=num_groups - put, finished=put)
        return outcomes

    async def admit(self, num_groups: int) -> int:
        """Slots granted now (0 after a short wait when refused, or while the controller is away).
        While refused, one worker asks again and the others wait for it (``RefusalGate``)."""
        await self._refusals.wait_turn()
        try:
            admitted = await self.admission.admit(num_groups)
        except Exception as e:  # the controller restarts or is gone: wait, never let a worker die
            raise_if_cancelled()  # (but a stopped one goes)
            log.warning("admit: %s; retrying in 1 s", e)
            await asyncio.sleep(1.0)
            return 0
        self.async_ratio = admitted.async_ratio
        if admitted.num_groups and self._stopped:  # stopped while asking: the slots go back unused
            await self.release(unused=admitted.num_groups)
            return 0
        if admitted.num_groups == 0:
            self._refusals.refused()
            await asyncio.sleep(self.config.admit_poll_s)
        else:
            self._refusals.granted()
        return admitted.num_groups

    # ------------------------------------------------------------------ lifecycle
    async def start(self, num_workers: int = 0) -> None:
        if self.running:
            return
        self.running, self._stopped = True, False
        work = self.scheduling.run(self, num_workers or self.config.num_workers)
        self._tasks = [asyncio.create_task(work), asyncio.create_task(self._follow_versions())]

    async def stop(self, drain: bool = False, timeout_s: float = 0.0) -> int:
        """Stop admitting; with ``drain``, let the groups in flight end for up to ``timeout_s`` (0: until
        they end, each bounded by its episodes' deadlines). Returns the episodes abandoned (still
        running when the workers were cancelled)."""
        self.running, self._stopped = False, True
        self._refusals.open()
        if drain and self._tasks:
            await asyncio.wait(self._tasks[:1], timeout=timeout_s or None)
        abandoned = self.running_episodes
        for t in [*self._tasks, *self._sending]:  # a gathered group's request goes with its members
            t.cancel()
        await asyncio.gather(*self._tasks, *self._sending, return_exceptions=True)
        self._tasks = []
        return abandoned

    @property
    def workers(self) -> int:
        return self.scheduling.workers if self._tasks else 0

    # ------------------------------------------------------------------ the stages' details
    async def _episode(
        self, domain: Domain, row: int, gid: str, i: int, state: _GroupState, barrier
    ) -> list[Trajectory]:
        """One member's episode: its trajectory, and its branches' where a workflow makes several."""
        tid = f"{gid}/{i}"
        env = domain.make_env(tid)
        self.running_episodes += 1
        try:
            made = await run_trajectories(
                env,
                row,
                self.generate,
                self.tokenizer,
                domain.episode,
                trajectory_id=tid,
                group_id=gid,
                prompt_id=domain.prompt_id(row),
                barrier=barrier,
                observer=self.observer,
                domain=domain.name,
                vision=self.vision,
                image_store=state.images,
                row=domain.rows[row] if row < len(domain.rows) else None,
                reward_fn=domain.reward_fn,
            )
        finally:
            self.running_episodes -= 1
            state.running.discard(tid)
            state.running.difference_update([b for b in state.running if b.startswith(f"{tid}.")])
            turns = state.first_turns
            if turns is not None and not turns.settled(tid):  # ended without asking: not waited for
                turns.waiting_for -= 1
                self._send_first_turns(gid, state)
        starts = [t.start_version for t in made if len(t.token_versions)]
        if starts:
            state.finished_starts += starts
            await self._abort_stale_groups()  # a finished member may reveal the group is already too old
        return made

    async def generate(
        self, ids: list[int], sampling: SamplingParams, tid: str, timeout_s: float, images: tuple[bytes, ...] = ()
    ) -> Generation:
        """Through the ``Generate`` port, retrying transient failures with backoff until the
        generation's deadline. The request id is the trajectory id (one request at a time per
        trajectory); without prompt replication the route is the group, so a prompt's samples
        share an engine."""
        gid, member = tid.rsplit("/", 1)
        state = self._rolling.get(gid)
        turns = state.first_turns if state is not None else None
        if "." in member:  # a branch's thread (``<member>.<k>``): its own request, always alone
            turns = None
            if state is not None:
                state.running.add(tid)  # aborted with its group
        if turns is not None and not turns.settled(tid):
            turns.waiting_for -= 1
            if not images:  # gathered: answered once every member has asked
                asked = asyncio.get_running_loop().create_future()
                turns.asks[tid] = (ids, sampling, time.monotonic() + timeout_s, asked)
                self._send_first_turns(gid, state)
                return await asked
            turns.alone.add(tid)
            self._send_first_turns(gid, state)
        route = tid if self.config.replicate_prompts else gid
        extra = {"return_routed_experts": True} if self.config.return_routed_experts else {}
        extra |= {"images": images} if images else {}

        def call(left: float):
            return self.engine.generate(ids, sampling, request_id=tid, route=route, timeout_s=left, **extra)

        (gen,) = await self._retried(lambda left: _one(call(left)), gid, [tid], time.monotonic() + timeout_s)
        return gen

    async def _retried(self, call, gid: str, tids: list[str], deadline: float) -> list[Generation]:
        """``call(seconds left)``, the generations of ``tids``, retried on a ``TransientError`` with
        backoff while the next try would start before ``deadline``; each member's tokens are counted
        in its group (what a member cancelled later will have cost)."""
        delay = 0.1
        while True:
            try:
                gens = await call(max(0.001, deadline - time.monotonic()))
                break
            except TransientError as e:
                if deadline - time.monotonic() - delay <= 0:  # the next try would start past the deadline
                    raise
                self.observer.generate_retried(e.code)
                await asyncio.sleep(delay)
                delay = min(5.0, 2 * delay)
        state = self._rolling.get(gid)
        if state is not None:
            for tid, gen in zip(tids, gens, strict=True):
                state.tokens[tid] = state.tokens.get(tid, 0) + len(gen.output_ids)
        return gens

    def _send_first_turns(self, gid: str, state: _GroupState) -> None:
        """Once no member is still to ask: the asks with the same prompt and sampling go as one request
        of n samples, the rest alone (each answer to its member's waiting call)."""
        turns = state.first_turns
        if turns is None or turns.waiting_for > 0:
            return
        state.first_turns = None  # every later call goes alone
        alike: dict[tuple, list[str]] = {}
        for tid, (ids, sampling, _, _) in turns.asks.items():
            alike.setdefault((tuple(ids), sampling.model_dump_json()), []).append(tid)
        for tids in alike.values():
            task = asyncio.create_task(self._send(gid, {t: turns.asks[t] for t in tids}))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, gid: str, asks: dict) -> None:
        """One gathered request: its answers (or its failure) handed to the members that asked."""
        tids = list(asks)
        ids, sampling, _, _ = asks[tids[0]]
        deadline = min(a[2] for a in asks.values())
        try:
            if len(tids) == 1:
                gens = [await self.generate(ids, sampling, tids[0], max(0.001, deadline - time.monotonic()))]
            else:

                def call(left: float):
                    return self.engine.generate_group(ids, sampling, request_ids=tids, route=gid, timeout_s=left)

                gens = await self._retried(call, gid, tids, deadline)
        except Exception as e:  # each member's call raises it, in its own episode
            for _, _, _, asked in asks.values():
                if not asked.done():
                    asked.set_exception(e)
            return
        except asyncio.CancelledError:  # the loop stopped: so do the members' calls
            for _, _, _, asked in asks.values():
                asked.cancel()
            raise
        for tid, gen in zip(tids, gens, strict=True):
            if not (asked := asks[tid][3]).done():
                asked.set_result(gen)

    async def _first_members(
        self, domain: Domain, row: int, gid: str, state: _GroupState, size: int, barrier
    ) -> list[list[Trajectory]]:
        """Run ``size`` episodes and return the first ``group_size`` to end usable, each as its
        trajectories (redundant rollout: the rest are cancelled the moment the group is full, so a
        fail-slow or fail-stop environment cannot hold it). One member's failure never sinks the group:
        it is left out and counted (``RolloutConfig.faulty_members``); so is a branch's."""
        tasks = [asyncio.create_task(self._episode(domain, row, gid, i, state, barrier)) for i in range(size)]
        kept: dict[int, list[Trajectory]] = {}
        pending = set(tasks)
        try:
            while pending and len(kept) < domain.group_size:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=tasks.index):  # ended together: the lower index first
                    if isinstance(error := task.exception(), BaseException):
                        self._usable(gid, error)
                        continue
                    usable = [t for t in task.result() if self._usable(gid, t)]
                    if not usable:
                        continue
                    if len(kept) < domain.group_size:
                        kept[tasks.index(task)] = usable
                    else:  # ended in the same instant as the one that filled the group
                        self._dropped("redundant", sum(t.num_generated for t in usable))
        except asyncio.CancelledError:  # the group itself is cancelled: so are its episodes
            for task in pending:
                task.cancel()
            raise
        if pending:  # the group is full: the slowest members are not waited for
            await asyncio.gather(*(self.engine.abort(t) for t in state.running), return_exceptions=True)
            for task in pending:
                task.cancel()
                task.add_done_callback(_retrieve)
                self._dropped("redundant", state.tokens.get(f"{gid}/{tasks.index(task)}", 0))
        return [kept[i] for i in sorted(kept)]  # in member order, as before

    def _usable(self, gid: str, member: Trajectory | BaseException) -> bool:
        """Whether a member that ended is trained on; the others are counted as
        ``members_dropped_<cause>``."""
        if isinstance(member, BaseException):
            log.warning("group %s: an episode failed: %s: %s", gid, type(member).__name__, member)
            cause = "raised"
        elif member.finish_reason == FinishReason.ENV_ERROR:
            cause = "env_error"
        elif member.metadata.get("error_kind") == "image_token":  # its tokens cannot be forwarded with its images
            cause = "image_token"
        elif member.finish_reason == FinishReason.TIMEOUT and not (
            self.config.faulty_members == "keep_timeouts" and member.num_generated
        ):
            cause = "timeout"
        else:
            return True
        self._dropped(cause, 0 if isinstance(member, BaseException) else member.num_generated)
        return False

    def _dropped(self, cause: str, tokens: int) -> None:
        self.counters[f"members_dropped_{cause}"] += 1
        self.counters[f"tokens_dropped_{cause}"] += tokens
        try:
            self.observer.member_dropped(cause, tokens)
        except Exception:
            log.exception("recording a dropped member failed")

    async def run_group_safely(self, barrier=None, row: Pick | None = None, seats: Seats | None = None) -> GroupOutcome:
        pick = self.next_row() if row is None else row  # drawn here: a failure is its domain's
        try:
            return await self.run_group(barrier, pick, seats)
        except Exception:  # one failed group must not stop the pool: logged, counted, its slot returned
            raise_if_cancelled()  # the pool is stopping: the worker goes with it
            log.exception("group failed")
            return self._ended(GroupOutcome.FAILED, [], None, pick.domain)

    def _ended(
        self, outcome: GroupOutcome, trajectories: list[Trajectory], t0: float | None, domain: str
    ) -> GroupOutcome:
        self.counters[f"groups_{outcome}"] += 1
        if outcome in (GroupOutcome.PUT, GroupOutcome.FILTERED, GroupOutcome.FAILED, GroupOutcome.STALE):
            self.sampler.ended(domain, outcome is GroupOutcome.PUT)
        for t in trajectories:
            self.counters[f"finish_{t.finish_reason}"] += 1
        self.counters["trajectories"] += len(trajectories)
        if outcome is GroupOutcome.PUT:
            self.counters["trajectories_put"] += len(trajectories)
        try:  # a metrics fault must not turn a group that is in the buffer into a failed one
            self.observer.group_ended(outcome, trajectories, 0.0 if t0 is None else time.monotonic() - t0, domain)
        except Exception:
            log.exception("recording the end of a group failed")
        return outcome

    async def abort_groups(self, rows: set[Pick]) -> None:
        """Abort the generations of the groups rolling out ``rows`` (their tasks are cancelled by the caller)."""
        running = [tid for state in self._rolling.values() if state.pick in rows for tid in state.running]
        await asyncio.gather(*(self.engine.abort(tid) for tid in running), return_exceptions=True)

    async def release(self, unused: int = 0, finished: int = 0) -> None:
        """Hand slots back; a worker cancelled meanwhile waits for it to be done before it goes."""
        handed = asyncio.ensure_future(self.admission.release(unused=unused, finished=finished))
        try:
            try:
                await asyncio.shield(handed)
            except asyncio.CancelledError:
                await handed
                raise
        except Exception as e:  # counted; the slots stay taken until the controller restarts
            log.error("release(unused=%d, finished=%d) failed: %s", unused, finished, e)
            self.counters["release_failures"] += 1

    async def _follow_versions(self) -> None:
        """Follow the controller's version; at each new one, stop rolling out groups that can no
        longer be trained on (their slots go back to admission, their engines to fresh work)."""
        while True:
            try:
                async for version in self.admission.watch_versions():
                    self.version = max(self.version, version)
                    await self._abort_stale_groups()
            except Exception as e:  # the controller restarted or is gone: follow again, never stop
                raise_if_cancelled()  # (unless the loop is stopping)
                log.warning("watching versions: %s; retrying in 1 s", e)
            await asyncio.sleep(1.0)

    async def _abort_stale_groups(self) -> None:
        if self.async_ratio is None:
            return
        for gid, state in list(self._rolling.items()):
            if not state.stale and group_is_stale(state.finished_starts, self.version, self.async_ratio):
                state.stale = True
                log.info(
                    "group %s is staler than the bound at v%d: aborting %d generations",
                    gid,
                    self.version,
                    len(state.running),
                )
                await asyncio.gather(*(self.engine.abort(tid) for tid in state.running), return_exceptions=True)
