"""The training loop: get → train → ack → publish → checkpoint, a plain object over three ports.

    batch = source.get(groups_per_step, version, max_staleness=async_ratio)
    metrics = engine.train_step(batch_from_groups(groups))
    source.ack(batch_id)
    publish: publisher.export → control.begin_update (suspend) → publisher.load → commit (resume)
    checkpoint every k steps

Under torchrun rank 0 alone talks to the mesh; it broadcasts each step's encoded groups, every
rank trains on its share of whole groups (FSDP2 averages the gradients), and every rank takes
part in exporting and checkpointing. Ports (``trainer/ports.py``): ``SampleSource`` (the
SampleBuffer), ``VersionControl`` (the AsyncController), ``WeightPublisher`` (a weight
transport). Nothing here knows about sockets.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from sample_buffer.codec import decode_group
from trainer.batch import batch_from_groups, domain_stats, episode_stats
from trainer.checkpoint import load_checkpoint, save_checkpoint
from trainer.config import TrainLoopConfig
from trainer.durable import latest_checkpoint
from trainer.ports import EngineMemory, SampleSource, TrainObserver, TransientError, VersionControl, WeightPublisher

log = logging.getLogger(__name__)
MAX_PUBLISH_RETRY_S = 8.0  # a failed publish is tried again after 0.5 s, doubling up to this
# KL(μ ‖ π_prox) over stale tokens past which a step warns: on the quickstart it stayed under 0.3 nats
# while runs learned and went to 1-13 nats after the one-step policy jumps that preceded every
# collapse measured (docs/losses.md#staleness).
STALE_KL_WARNING = 1.0


class StalenessMismatch(ValueError):
    """The trainer and the controller disagree on the staleness bound or the step size."""


async def _retried(what: str, call, deadline: float):
    """``await call()``, again every second while it raises ``TransientError`` (a service that
    restarts is back within seconds) until ``deadline`` (``time.monotonic()``), then the error."""
    while True:
        try:
            return await call()
        except TransientError as e:
            if time.monotonic() >= deadline:
                raise
            log.warning("%s: %s; retrying in 1 s", what, e)
            await asyncio.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


class TrainLoop:
    def __init__(
        self,
        config: TrainLoopConfig,
        engine,
        *,
        source: SampleSource | None,
        control: VersionControl | None,
        publisher: WeightPublisher,
        groups_per_step: int,
        max_staleness: int,
        observer: TrainObserver | None = None,
        rank: int = 0,
        world: int = 1,
        memory: EngineMemory | None = None,
    ) -> None:
        if groups_per_step < world:
            raise ValueError(f"controller.groups_per_step ({groups_per_step}) must be >= the {world} trainer ranks")
        self.config, self.engine, self.publisher = config, engine, publisher
        self.source, self.control = source, control  # rank 0 only
        self.memory = memory  # rank 0, colocated engines only: they free the GPUs while this trains
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.observer = observer or TrainObserver()
        self.rank, self.world = rank, world
        self.run_dir = Path(config.run_dir)
        self.publish_times: dict[str, float] = {}
        self._unpublished = False  # the engines do not serve this trainer's version yet
        self._begun = False  # this process has begun an update (its first supersedes a dead predecessor's)
        self.served_version: int | None = None  # what the engines serve, as of join and the last publish
        self._publish_failures = 0  # in a row: the wait before trying again doubles
        self._dropped_stale = 0
        self._warned_at = -(10**9)  # the step of the last staleness warning (one in 20 steps at most)

    # ------------------------------------------------------------------ the loop
    async def step(self) -> dict | None:
        """One training step; None when no full batch arrived in time."""
        if self._unpublished and not await self._publish():
            await self._ask_served_version()  # a commit whose reply was lost did move the engines
            if self._too_far_ahead():
                # Whatever the engines make now is staler than the bound: a get would wait out its
                # whole timeout for groups the buffer drops, and each step trained meanwhile widens the gap.
                await asyncio.sleep(min(MAX_PUBLISH_RETRY_S, 0.5 * 2 ** min(self._publish_failures - 1, 8)))
                return None
        t0, version = time.perf_counter(), self.engine.version
        fetched = self._from_rank0(await self._get_and_free(version) if self.rank == 0 else None)  # get
        if fetched is None:
            return None
        encoded, batch_ids = fetched
        # Rank 0 decodes every group once (its metrics cover the whole batch), the others only their
        # share; the buffer validated each group when it was put, so decoding does not again.
        share = encoded if self.rank == 0 else encoded[self.rank :: self.world]
        decoded = [decode_group(g, validate=False) for g in share]
        mine = decoded[:: self.world] if self.rank == 0 else decoded  # whole groups per rank
        t_get = time.perf_counter()
        try:
            metrics = await asyncio.to_thread(self.engine.train_step, batch_from_groups(mine))  # train
        finally:  # colocated engines take their memory back (and generate again) whatever happened
            if self.memory is not None and self.rank == 0:
                await self._colocated("restore", self.memory.restore)
        for batch_id in batch_ids if self.rank == 0 else ():
            await self._ack(batch_id)  # ack
        t_train = time.perf_counter()
        published = await self._publish()  # publish
        t_pub = time.perf_counter()
        try:
            if self.rank == 0:
                staleness = [version - t.start_version for g in decoded for t in g.trajectories]
                metrics |= (
                    {
                        "step": self.engine.step,
                        "version": self.engine.version,
                        "published": published,
                        "staleness_max": max(staleness),
                        "staleness_mean": sum(staleness) / len(staleness),
                        "time_get_s": t_get - t0,
                        "time_train_s": t_train - t_get,
                        "time_publish_s": t_pub - t_train,
                        **self.publish_times,
                        "wall": time.time(),
                        "group_ids": [g.group_id for g in decoded],  # which groups this step consumed (audits, chaos)
                        # what they were: which prompt, sampled at which version, scored how (data-bias audits)
                        "group_prompts": [g.prompt_id for g in decoded],
                        "group_versions": [g.start_version for g in decoded],
                        "group_rewards": [round(sum(g.rewards) / len(g.rewards), 4) for g in decoded],
                        "dropped_stale": self._dropped_stale,
                    }
                    | episode_stats(decoded)
                    | domain_stats(decoded, version)
                )
                # The step's line before its checkpoint: a trainer killed between the two leaves a line
                # that a resume moves to lost_steps.jsonl; the other order would leave a checkpointed
                # step with no line, its groups trained but missing from the curve.
                self._dropped_stale = 0  # counted since the last step line, timed-out waits included
                self._warn_if_far(metrics)
                self.observer.step_done(metrics, staleness)
        finally:  # every rank checkpoints, whatever rank 0's report did: the save is collective
            t_ckpt = time.perf_counter()
            if self._checkpoint_if_due() and self.rank == 0:  # checkpoint
                self.observer.checkpoint_done(time.perf_counter() - t_ckpt)
        return metrics

    async def _get_and_free(self, version: int):
        """Rank 0's get; colocated engines then give the GPUs back before any rank trains."""
        fetched = await self._get(version)
        if fetched is not None and self.memory is not None:
            await self._colocated("release", self.memory.release)
        return fetched

    async def _colocated(self, what: str, call) -> None:
        # A failure is reported and the step goes on: at worst the engines keep their memory while
        # this trains (slower, or out of memory), and the LLMProxy's lease takes it back.
        try:
            await call()
        except Exception as e:
            log.warning("colocated engines: %s failed: %s", what, e)
            self.observer.update_failed(what)

    async def publish(self) -> bool:
        """Move every engine to the new weights; on any failure roll back and return False.

        Every failure is logged and counted by cause (export, begin, load, commit); generation
        goes on at the previous version and the next step publishes again before it gets samples.
        While that keeps failing, steps go on only as long as the engines' samples are fresh enough
        for the trainer's version; past that the step waits and publishes again (``step``).
        """
        version, t0 = self.engine.version, time.perf_counter()
        self.publish_times = {}
        try:
            location = self.publisher.export(self.engine, version)  # every rank gathers
        except Exception as e:
            return self._failed("export", version, e)
        if self.rank != 0:
            return True  # rank 0 alone moves the engines
        t1 = time.perf_counter()
        try:
            # This process's first update supersedes any still in progress: only a trainer that died
            # mid-update (this one's predecessor) can have left one, and its watchdog takes minutes.
            update_id = await self.control.begin_update(
                version, timeout_s=self.config.publish_timeout_s * 2, supersede=not self._begun
            )
        except Exception as e:  # generation was not suspended (or the controller's watchdog resumes it)
            return self._failed("begin", version, e)
        self._begun = True
        t2 = time.perf_counter()
        try:
            await self.publisher.load(version, self.config.publish_timeout_s)
        except Exception as e:  # any failure rolls back: generation never stays suspended
            await self._abort_update(update_id, f"{type(e).__name__}: {e}")
            return self._failed("load", version, e)
        t3 = time.perf_counter()
        # Where an update spends its time: export, suspend (generation stops), load, commit + resume.
        self.publish_times = {"time_export_s": t1 - t0, "time_suspend_s": t2 - t1, "time_load_s": t3 - t2}
        self.publish_times |= getattr(self.publisher, "stats", {})  # what a transport counts (bytes, deltas)
        try:
            await self.control.commit_update(update_id, version, location)
        except Exception as e:
            await self._abort_update(update_id, f"commit failed: {e}")
            return self._failed("commit", version, e)
        self.publish_times["time_resume_s"] = time.perf_counter() - t3
        self.observer.update_done(time.perf_counter() - t0, location)
        self.publisher.committed(version)
        return True

    # ------------------------------------------------------------------ start
    def resume(self) -> bool:
        """Load the newest complete checkpoint of the run directory, if there is one."""
        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        if ckpt is None:
            return False
        load_checkpoint(self.engine, ckpt)
        log.info("resumed from %s (step %d, version %d)", ckpt, self.engine.step, self.engine.version)
        return True

    async def join(self, wait_s: float = 120.0) -> None:
        """Before the first step (every rank): check the staleness bound against the controller's
        and agree with it on the version (rank 0 then takes back from the buffer what a dead predecessor
        held). A controller that is not up yet is waited for up to ``wait_s``.

        Another bound would drop samples as stale (trainer stricter) or train staler than promised
        (controller stricter): refused. Another version follows a restart. A controller ahead of
        this trainer's checkpoint (the trainer died after publishing newer versions) is followed:
        training goes on from the checkpoint's weights, numbered from the controller's version, and
        the next publish sends them. A controller behind (it started afresh, or the checkpoint's own
        publish failed) gets the checkpoint's weights now, before any step trains.
        """
        theirs = self._from_rank0(await self._rank0_start(wait_s) if self.rank == 0 else None)
        mine = self.engine.version
        self.served_version = theirs
        if theirs > mine:
            log.warning(
                "the controller is at version %d, this checkpoint at %d: going on from the checkpoint's "
                "weights as version %d",
                theirs,
                mine,
                theirs,
            )
            self.engine.version = theirs
        elif theirs < mine:
            log.info("the controller is at version %d: publishing this checkpoint's version %d", theirs, mine)
            if not await self._publish():
                log.warning("publishing version %d failed; the first step publishes again", mine)

    async def _rank0_start(self, wait_s: float) -> int:
        version = await self._controller_version(wait_s)
        await self._requeue_predecessors_batches()
        return version

    async def _requeue_predecessors_batches(self) -> None:
        """A trainer is its run's one consumer: batches handed out before it started were a dead
        predecessor's. They go back now; at their visibility timeout (minutes) they would too, but the
        controller counts them as made, so nothing new was generated meanwhile. Only a speed-up: a
        buffer that cannot answer within a step's get timeout leaves them to that timeout."""
        try:
            n = await _retried("requeue", self.source.requeue, time.monotonic() + self.config.get_timeout_s)
        except Exception as e:
            log.warning("requeueing a previous trainer's unacked batches: %s; they return at the visibility timeout", e)
            return
        if n:
            log.warning("%d groups handed out to a previous trainer and never acked are back in the buffer", n)

    async def _controller_version(self, wait_s: float) -> int:
        limits = await _retried("waiting for the controller", self.control.limits, time.monotonic() + wait_s)
        if (limits.async_ratio, limits.groups_per_step) != (self.max_staleness, self.groups_per_step):
            raise StalenessMismatch(
                f"controller.async_ratio / groups_per_step: the controller admits under {limits.async_ratio} / "
                f"{limits.groups_per_step}, this trainer was configured with {self.max_staleness} / "
                f"{self.groups_per_step}"
            )
        return limits.version

    # ------------------------------------------------------------------ the stages' details
    async def _get(self, version: int) -> tuple[list[bytes], list[str]] | None:
        """Rank 0: encoded groups for one step and their batch ids; None when too few arrived."""
        deadline = time.monotonic() + self.config.get_timeout_s
        batch_ids, groups = [], []
        while len(groups) < self.groups_per_step and time.monotonic() < deadline:

            def get(want=self.groups_per_step - len(groups)):
                return self.source.get(want, version, self.max_staleness, deadline - time.monotonic())

            try:  # a restarting buffer is waited for within this step's deadline
                batch = await _retried("get", get, deadline)
            except TransientError:
                break
            self._dropped_stale += batch.dropped_stale
            if batch.dropped_stale:  # never trained: reported for the controller's counts
                try:
                    await self.control.release(dropped=batch.dropped_stale)
                except TransientError as e:  # admission follows the buffer itself: a lost report costs nothing
                    log.warning("reporting %d stale groups: %s", batch.dropped_stale, e)
            if batch.batch_id:
                batch_ids.append(batch.batch_id)
                groups += batch.groups
        if len(groups) < self.groups_per_step:
            log.warning(
                "only %d of %d groups arrived in %.0fs", len(groups), self.groups_per_step, self.config.get_timeout_s
            )
            return None  # the unacked ones are handed out again after the visibility timeout
        return groups, batch_ids

    async def _ack(self, batch_id: str) -> None:
        """Ack through a buffer restart: an unacked batch would be handed out again and trained twice."""
        await _retried("ack", lambda: self.source.ack(batch_id), time.monotonic() + self.config.get_timeout_s)

    def _from_rank0(self, obj):
        """``obj`` as rank 0 has it, on every rank (no-op in a single process)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _warn_if_far(self, metrics: dict) -> None:
        kl = metrics.get("kl_behavior_stale", 0.0)
        if kl > STALE_KL_WARNING and metrics["step"] - self._warned_at >= 20:
            self._warned_at = metrics["step"]
            log.warning(
                "step %d: stale samples are %.2f nats (KL(μ ‖ π_prox)) from the policy they train: it moved that far "
                "in %.1f versions. Such jumps preceded every collapse measured under staleness; set "
                "trainer.max_step_kl, or lower trainer.lr or controller.async_ratio (docs/losses.md#staleness)",
                metrics["step"],
                kl,
                metrics["staleness_mean"],
            )

    def _checkpoint_if_due(self) -> bool:
        every = self.config.checkpoint_every
        if every and (self.engine.step % every == 0 or self.engine.step >= self.config.steps):
            save_checkpoint(self.engine, self.run_dir / "checkpoints", keep_last=2)
            return True
        return False

    async def _publish(self) -> bool:
        """``publish``, remembering on every rank whether it failed: a failed publish is tried again
        before the next step gets samples."""
        ok = self._from_rank0(await self.publish())
        self._unpublished = not ok
        self._publish_failures = 0 if ok else self._publish_failures + 1
        if ok:
            self.served_version = self.engine.version
        return ok

    async def _ask_served_version(self) -> None:
        """Take the controller's version as what the engines serve (every rank, from rank 0's
        answer). If it is already this trainer's, the last publish did commit (its reply was lost:
        a retry would be refused as not newer) and nothing is left to publish."""
        theirs = None
        if self.rank == 0:
            try:
                theirs = (await self.control.limits()).version
            except Exception as e:  # the controller is down: the next step asks again
                log.warning("asking the controller for its version: %s", e)
        theirs = self._from_rank0(theirs)
        if theirs is not None:
            self.served_version = theirs
            if theirs >= self.engine.version:
                self._unpublished = False

    def _too_far_ahead(self) -> bool:
        """Would the buffer drop as stale every sample of the version the engines serve?"""
        return self.served_version is not None and self.engine.version - self.served_version > self.max_staleness

    def _failed(self, cause: str, version: int, error) -> bool:
        log.error("publishing v%d failed at %s: %s", version, cause, error)
        self.observer.update_failed(cause)
        return False

    async def _abort_update(self, update_id: str, reason: str) -> None:
        try:
            await self.control.abort_update(update_id, reason)
        except Exception as e:  # the controller's watchdog aborts an update nobody commits
            log.error("abort_update failed (the controller's watchdog will roll back): %s", e)
