"""The Tinker REST client's runs and checkpoints: a run (a training model's id) is its key's by the
owner file beside its saved weights, so it outlives the model and the service; listing, reading
and deleting saved states and sampler weights."""

from __future__ import annotations

import json
import logging
import shutil
from datetime import UTC, datetime
from pathlib import Path

from services.tinker.errors import TinkerError, unknown

log = logging.getLogger(__name__)
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler"}  # tinker://RUN/KIND/NAME: the SDK's types


EXPIRES = "expires_at"  # beside saved weights with a ttl_seconds: when they go (Unix time)


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat()


def _saved_rank(run: Path, saved: list[dict]) -> int | None:
    """The rank of a run whose model is gone, from its last saved adapter's config."""
    if not saved:
        return None
    name = saved[-1]["checkpoint_id"]
    return json.loads((run / name / "adapter_config.json").read_text()).get("r")


class Checkpoints:
    """Mixin of ``TinkerService`` (its root, models, engine and adapter table)."""

    def _owns(self, owner: str, run_id: str) -> bool:
        """Whether training run ``run_id`` (a model id) is this key's: its saved weights outlive the
        model (and the service: the owner is written beside them)."""
        owner_file = self.root / run_id / "owner"
        return (
            "/" not in run_id
            and run_id not in ("", ".", "..")
            and owner_file.is_file()
            and owner_file.read_text() == owner
        )

    def _run(self, owner: str, run_id: str) -> Path:
        if not self._owns(owner, run_id):
            raise unknown("training_run_id", run_id)
        return self.root / run_id

    def checkpoints(self, owner: str, run_id: str) -> dict:
        """``CheckpointsListResponse``: the run's saved states and sampler weights, oldest first."""
        return {"checkpoints": self._saved(self._run(owner, run_id), run_id)}

    def _saved(self, run: Path, run_id: str) -> list[dict]:
        found = []
        for kind, ctype in CHECKPOINT_KINDS.items():
            for config in (run / kind).glob("*/adapter_config.json"):
                d = config.parent
                found.append(
                    {
                        "checkpoint_id": f"{kind}/{d.name}",
                        "checkpoint_type": ctype,
                        "time": _iso(config.stat().st_mtime),
                        "tinker_path": f"tinker://{run_id}/{kind}/{d.name}",
                        "size_bytes": sum(f.stat().st_size for f in d.rglob("*") if f.is_file()),
                        "expires_at": _iso(float((d / EXPIRES).read_text())) if (d / EXPIRES).is_file() else None,
                    }
                )
        return sorted(found, key=lambda c: (c["time"], c["checkpoint_id"]))

    def training_run(self, owner: str, run_id: str) -> dict:
        """``TrainingRun``: what the run is and its last checkpoints (the cookbook reads it on resume)."""
        run = self._run(owner, run_id)
        saved = self._saved(run, run_id)
        last = {
            t: next((c for c in reversed(saved) if c["checkpoint_type"] == t), None) for t in ("training", "sampler")
        }
        m = self.models.get(run_id)
        rank = m.lora.rank if m is not None else _saved_rank(run, saved)
        touched = max([run.stat().st_mtime, *(datetime.fromisoformat(c["time"]).timestamp() for c in saved)])
        return {
            "training_run_id": run_id,
            "base_model": self.base_model,
            "model_owner": owner,
            "is_lora": True,
            "corrupted": bool(m is not None and m.broken),
            "lora_rank": rank,
            "last_request_time": _iso(touched),
            "last_checkpoint": last["training"],
            "last_sampler_checkpoint": last["sampler"],
        }

    def weights_info(self, owner: str, body: dict) -> dict:
        """``WeightsInfoResponse`` of a ``tinker://`` path of this key."""
        path = str(body.get("tinker_path") or "")
        kind = path.removeprefix("tinker://").split("/")[1] if path.count("/") == 4 else ""
        if kind not in CHECKPOINT_KINDS:
            raise TinkerError("tinker_path", f"{path!r} is not a tinker://MODEL_ID/(weights|sampler_weights)/NAME path")
        d = self._parse(owner, path, kind)
        rank = json.loads((d / "adapter_config.json").read_text()).get("r")
        return {"base_model": self.base_model, "is_lora": True, "lora_rank": rank}

    async def delete_checkpoint(self, owner: str, run_id: str, checkpoint_id: str) -> None:
        """Remove a saved state or sampler weights; sampler weights the engine holds are unloaded first
        (refused while a sample uses them)."""
        kind = checkpoint_id.split("/", 1)[0]
        if kind not in CHECKPOINT_KINDS:
            raise TinkerError("checkpoint_id", f"{checkpoint_id!r}: weights/NAME or sampler_weights/NAME")
        self._run(owner, run_id)
        await self._remove(self._parse(owner, f"tinker://{run_id}/{checkpoint_id}", kind))
        log.info("deleted %s/%s (%s)", run_id, checkpoint_id, owner)

    async def _remove(self, d: Path) -> None:
        async with self._load_lock:
            name = self._loaded.get(d)
            if name is not None:
                if self._busy[name]:
                    raise TinkerError("checkpoint_id", "a sample is using these weights now; try again", status=409)
                await self.engine.unload_lora_adapter(name)
                self._busy.pop(self._loaded.pop(d), None)
            shutil.rmtree(d)
