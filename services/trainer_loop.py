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
import json
import logging
import shutil
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from services.pb.rollmesh.v1 import controller_pb2 as cpb

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


class TrainerLoop:
    def __init__(self, loop_cfg: TrainLoopConfig, engine, buffer, controller, proxy, *, groups_per_step: int,
                 max_staleness: int) -> None:  # fmt: skip
        self.cfg, self.engine = loop_cfg, engine
        self.buffer, self.controller, self.proxy = buffer, controller, proxy
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.run_dir = Path(loop_cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"

    def resume(self) -> bool:
        from trainer.checkpoint import latest_checkpoint, load_checkpoint

        ckpt = latest_checkpoint(self.run_dir / "checkpoints")
        if ckpt is None:
            return False
        load_checkpoint(self.engine, ckpt)
        log.info("resumed from %s (step %d, version %d)", ckpt, self.engine.step, self.engine.version)
        return True

    async def step(self) -> dict | None:
        """One training step; None when no full batch arrived in time."""
        from trainer.batch import batch_from_groups

        t0 = time.perf_counter()
        version = self.engine.version
        deadline = t0 + self.cfg.get_timeout_s
        batch_ids, groups = [], []
        while len(groups) < self.groups_per_step and time.perf_counter() < deadline:
            wait = deadline - time.perf_counter()
            batch = await self.buffer.get(self.groups_per_step - len(groups), version, self.max_staleness, wait)
            if batch.dropped_stale:
                req = cpb.ReleaseRequest(client_id="trainer", num_dropped=batch.dropped_stale)
                await self.controller.Release(req, timeout=30)
            if batch.batch_id:
                batch_ids.append(batch.batch_id)
                groups += batch.decode()
        if len(groups) < self.groups_per_step:
            log.warning(
                "only %d of %d groups arrived in %.0fs", len(groups), self.groups_per_step, self.cfg.get_timeout_s
            )
            return None  # the unacked ones are handed out again after the visibility timeout
        t_get = time.perf_counter()
        metrics = await asyncio.to_thread(self.engine.train_step, batch_from_groups(groups))
        for batch_id in batch_ids:
            await self.buffer.ack(batch_id)
        t_train = time.perf_counter()
        self.publish_times: dict[str, float] = {}
        published = await self.publish()
        t_pub = time.perf_counter()
        starts = [t.start_version for g in groups for t in g.trajectories]
        metrics |= {
            "step": self.engine.step,
            "version": self.engine.version,
            "published": published,
            "staleness_max": max(version - s for s in starts),
            "staleness_mean": sum(version - s for s in starts) / len(starts),
            "time_get_s": t_get - t0,
            "time_train_s": t_train - t_get,
            "time_publish_s": t_pub - t_train,
            **self.publish_times,
            "wall": time.time(),
        }
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        every = self.cfg.checkpoint_every
        if every and (self.engine.step % every == 0 or self.engine.step >= self.cfg.steps):
            from trainer.checkpoint import save_checkpoint

            save_checkpoint(self.engine, self.run_dir / "checkpoints", keep_last=2)
        return metrics

    async def publish(self) -> bool:
        """Export the new weights and move every engine to them; roll back on any failure."""
        version = self.engine.version
        t0 = time.perf_counter()
        out = self.engine.export(self.run_dir / "weights" / f"v{version}")
        t1 = time.perf_counter()
        begin = await self.controller.BeginUpdate(
            cpb.BeginUpdateRequest(new_version=version, timeout_s=self.cfg.publish_timeout_s * 2), timeout=60
        )
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
        if ok:
            req = cpb.CommitUpdateRequest(update_id=begin.update_id, version=version, model_path=str(out))
            await self.controller.CommitUpdate(req, timeout=60)
            self.publish_times["time_resume_s"] = time.perf_counter() - t3
            self._prune_weights()
            return True
        log.error("publishing v%d failed: %s", version, reason)
        await self.controller.AbortUpdate(cpb.AbortUpdateRequest(update_id=begin.update_id, reason=reason), timeout=60)
        return False

    def _prune_weights(self) -> None:
        dirs = sorted((self.run_dir / "weights").glob("v*"), key=lambda p: int(p.name[1:].split(".")[0]))
        for old in dirs[: -self.cfg.keep_weight_versions]:
            shutil.rmtree(old, ignore_errors=True)
