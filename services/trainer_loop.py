"""The trainer process: get fresh groups → train one step → ack → publish weights → checkpoint.

This is the loop ARCHITECTURE.md names (admit → generate → reward → put happen in the EnvManager):

    batch = buffer.get(groups_per_step, version, max_staleness=async_ratio)
    metrics = engine.train_step(batch_from_groups(batch.decode()))
    buffer.ack(batch.batch_id)
    publish(engine.version)    # controller.BeginUpdate → proxy.UpdateWeights → CommitUpdate / AbortUpdate
    checkpoint every k steps

On restart it resumes from the newest complete checkpoint and the run continues.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.metrics_log import MetricsLog, TrackingConfig
from services.pb.rollmesh.v1 import controller_pb2 as cpb
from services.trainer_metrics import TrainerMetrics

log = logging.getLogger(__name__)


class TrainLoopConfig(BaseModel):
    """The trainer process around the training engine."""

    model_config = ConfigDict(extra="forbid")

    steps: int = Field(100, ge=1, description="Optimizer steps of the run.")
    run_dir: str = Field("runs/default", description="Checkpoints, exported weights and metrics.jsonl go here.")
    checkpoint_every: int = Field(20, ge=0, description="Checkpoint every k steps and at the end; 0 = never.")
    get_timeout_s: float = Field(120.0, gt=0, description="How long one Get waits for a full batch.")
    publish_timeout_s: float = Field(120.0, gt=0, description="Deadline of one weight update on the engines.")
    keep_weight_versions: int = Field(2, ge=1, description="Exported weight directories kept on disk.")
    metrics_host: str = Field("127.0.0.1", description="Address the Prometheus /metrics endpoint binds.")
    metrics_port: int = Field(9105, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it.")
    tracking: TrackingConfig = Field(
        default_factory=TrackingConfig, description="Also log metrics to TensorBoard / Weights & Biases."
    )


class TrainerLoop:
    """One trainer process, or one rank under torchrun.

    Under torchrun rank 0 alone talks to the mesh (buffer, controller, LLMProxy) and writes the
    metrics; it broadcasts each step's encoded groups, every rank trains on its share of whole
    groups (FSDP2 averages the gradients), every rank takes part in exporting and checkpointing.
    """

    def __init__(self, loop_cfg: TrainLoopConfig, engine, buffer, controller, proxy, *, groups_per_step: int,
                 max_staleness: int, rank: int = 0, world: int = 1) -> None:  # fmt: skip
        if groups_per_step < world:
            raise ValueError(f"controller.groups_per_step ({groups_per_step}) must be >= the {world} trainer ranks")
        self.cfg, self.engine = loop_cfg, engine
        self.buffer, self.controller, self.proxy = buffer, controller, proxy
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.rank, self.world = rank, world
        self.run_dir = Path(loop_cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.metrics_log = (
            MetricsLog(self.metrics_path, loop_cfg.tracking, self.run_dir.name, self.run_dir) if rank == 0 else None
        )
        self.prom = TrainerMetrics()
        self.publish_times: dict[str, float] = {}

    def resume(self) -> bool:
        from trainer.checkpoint import latest_checkpoint, load_checkpoint

        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        if ckpt is None:
            return False
        load_checkpoint(self.engine, ckpt)
        log.info("resumed from %s (step %d, version %d)", ckpt, self.engine.step, self.engine.version)
        return True

    async def _fetch(self, version: int) -> tuple[list[bytes], list[str]] | None:
        """Rank 0: encoded groups for one step and their batch ids; None when too few arrived."""
        deadline = time.perf_counter() + self.cfg.get_timeout_s
        batch_ids, groups = [], []
        while len(groups) < self.groups_per_step and time.perf_counter() < deadline:
            wait = deadline - time.perf_counter()
            batch = await self.buffer.get(self.groups_per_step - len(groups), version, self.max_staleness, wait)
            if batch.dropped_stale:
                req = cpb.ReleaseRequest(client_id="trainer", num_dropped=batch.dropped_stale)
                await self.controller.Release(req, timeout=30)
            if batch.batch_id:
                batch_ids.append(batch.batch_id)
                groups += batch.groups
        if len(groups) < self.groups_per_step:
            log.warning(
                "only %d of %d groups arrived in %.0fs", len(groups), self.groups_per_step, self.cfg.get_timeout_s
            )
            return None  # the unacked ones are handed out again after the visibility timeout
        return groups, batch_ids

    def _from_rank0(self, obj):
        """``obj`` as rank 0 has it, on every rank (no-op in a single process)."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    async def step(self) -> dict | None:
        """One training step; None when no full batch arrived in time."""
        from sample_buffer.codec import decode_group
        from trainer.batch import batch_from_groups

        t0 = time.perf_counter()
        version = self.engine.version
        fetched = self._from_rank0(await self._fetch(version) if self.rank == 0 else None)
        if fetched is None:
            return None
        encoded, batch_ids = fetched
        # Rank 0 decodes every group (its metrics cover the whole batch), the others only their share.
        decoded = [decode_group(g) for g in (encoded if self.rank == 0 else encoded[self.rank :: self.world])]
        groups = decoded[:: self.world] if self.rank == 0 else decoded  # whole groups per rank
        t_get = time.perf_counter()
        metrics = await asyncio.to_thread(self.engine.train_step, batch_from_groups(groups))
        if self.rank == 0:
            for batch_id in batch_ids:
                await self.buffer.ack(batch_id)
        t_train = time.perf_counter()
        self.publish_times = {}
        published = await self.publish()
        t_pub = time.perf_counter()
        every = self.cfg.checkpoint_every
        if every and (self.engine.step % every == 0 or self.engine.step >= self.cfg.steps):
            from trainer.checkpoint import save_checkpoint

            save_checkpoint(self.engine, self.run_dir / "checkpoints", keep_last=2)
        if self.rank != 0:
            return metrics
        staleness = [version - t.start_version for g in decoded for t in g.trajectories]
        metrics |= {
            "step": self.engine.step,
            "version": self.engine.version,
            "published": published,
            "staleness_max": max(staleness),
            "staleness_mean": sum(staleness) / len(staleness),
            "time_get_s": t_get - t0,
            "time_train_s": t_train - t_get,
            "time_publish_s": t_pub - t_train,
            "time_checkpoint_s": time.perf_counter() - t_pub,
            **self.publish_times,
            "wall": time.time(),
        }
        self.metrics_log.write(metrics)
        self.prom.observe_step(metrics, staleness)
        return metrics

    async def publish(self) -> bool:
        """Export the new weights and move every engine to them; roll back on any failure.

        Every failure is logged and counted by cause (export, begin, load, commit); generation
        goes on at the previous version and the next step publishes again.
        """
        version = self.engine.version
        t0 = time.perf_counter()
        try:
            out = self.engine.export(self.run_dir / "weights" / f"v{version}")  # every rank gathers, rank 0 writes
        except Exception as e:
            return self._failed("export", version, e)
        if self.rank != 0:
            return True  # rank 0 alone moves the engines to the new weights
        t1 = time.perf_counter()
        try:
            begin = await self.controller.BeginUpdate(
                cpb.BeginUpdateRequest(new_version=version, timeout_s=self.cfg.publish_timeout_s * 2), timeout=60
            )
        except Exception as e:  # generation was not suspended (or the controller's watchdog resumes it)
            return self._failed("begin", version, e)
        t2 = time.perf_counter()
        try:
            res = await self.proxy.update_weights(str(out), version, timeout_s=self.cfg.publish_timeout_s)
            ok = res.success
            reason = "; ".join(e.message for e in res.engines if not e.success)
        except Exception as e:  # any failure rolls back: generation never stays suspended
            ok, reason = False, f"{type(e).__name__}: {e}"
        t3 = time.perf_counter()
        # Where a weight update spends its time: export, suspend (generation stops), load on the
        # engines, commit + resume (generation continues).
        self.publish_times = {"time_export_s": t1 - t0, "time_suspend_s": t2 - t1, "time_load_s": t3 - t2}
        if not ok:
            await self._abort_update(begin.update_id, reason)
            return self._failed("load", version, reason)
        try:
            req = cpb.CommitUpdateRequest(update_id=begin.update_id, version=version, model_path=str(out))
            await self.controller.CommitUpdate(req, timeout=60)
        except Exception as e:
            await self._abort_update(begin.update_id, f"commit failed: {e}")
            return self._failed("commit", version, e)
        self.publish_times["time_resume_s"] = time.perf_counter() - t3
        self.prom.update_seconds.observe(time.perf_counter() - t0)
        self.prom.update_bytes.inc(_dir_bytes(out))
        self._prune_weights()
        return True

    def _failed(self, cause: str, version: int, error) -> bool:
        log.error("publishing v%d failed at %s: %s", version, cause, error)
        self.prom.update_failures.labels(cause).inc()
        return False

    async def _abort_update(self, update_id: str, reason: str) -> None:
        try:
            await self.controller.AbortUpdate(cpb.AbortUpdateRequest(update_id=update_id, reason=reason), timeout=60)
        except Exception as e:  # the controller's watchdog aborts an update nobody commits
            log.error("AbortUpdate failed (the controller's watchdog will roll back): %s", e)

    def close(self) -> None:
        if self.metrics_log is not None:
            self.metrics_log.close()

    def _prune_weights(self) -> None:
        dirs = sorted((self.run_dir / "weights").glob("v*"), key=lambda p: int(p.name[1:].split(".")[0]))
        for old in dirs[: -self.cfg.keep_weight_versions]:
            shutil.rmtree(old, ignore_errors=True)


def _dir_bytes(path) -> int:
    """Size of an exported weight directory (0 for an engine that exports nothing)."""
    p = Path(path) if path is not None else None
    if p is None or not p.exists():
        return 0
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
