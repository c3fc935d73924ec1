"""Checkpoints with torch.distributed.checkpoint: model, optimizer, scheduler, RNG, step, version
(a LoRA policy: its adapters and their optimizer state, and the adapters in PEFT's format).

A checkpoint is written into ``step_N.partial`` and renamed to ``step_N`` only after every rank
finished and rank 0 wrote the ``COMPLETE`` marker, so a crash mid-write never leaves something
``latest`` would pick; it is flushed to the device before the rename (``trainer/durable.py``).
Works single-process and under FSDP2 (each rank writes its shards).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

# (the marker and `latest_checkpoint` live in trainer/durable.py, without torch: `rollmesh run` reads run directories)
from trainer.checkpoint_reader import SafePlanner, SafeReader
from trainer.durable import MARKER, swap_in
from trainer.export import export_adapter


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _options(engine) -> StateDictOptions | None:
    """LoRA: the adapters and their optimizer state only; the frozen base comes from model_path."""
    if engine.config.lora is None:
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def save_checkpoint(engine, root: str | Path, keep_last: int | None = None) -> Path:
    root = Path(root)
    final = root / f"step_{engine.step}"
    tmp = root / f"step_{engine.step}.partial"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=_options(engine))
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "state"))
    if engine.config.lora is not None:  # the adapters alone, loadable by PEFT (the base is model_path)
        export_adapter(engine.model, tmp / "adapter")
    extra = {
        "step": engine.step,
        "version": engine.version,
        "scheduler": engine.scheduler.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    torch.save(extra, tmp / f"extra_rank{_rank()}.pt")
    if engine.critic is not None:
        c_sd, co_sd = get_state_dict(engine.critic, engine.critic_optimizer)
        dcp.save({"model": c_sd, "optim": co_sd}, checkpoint_id=str(tmp / "critic"))
    _barrier()
    if _rank() == 0:
        (tmp / MARKER).write_text(f"step {engine.step}\n")
        swap_in(tmp, final)  # flushed, and a complete checkpoint of this step at every moment
        if keep_last:
            done = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / MARKER).exists()]
            done.sort(key=lambda p: int(p.name[5:]))
            for old in done[:-keep_last]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _load(state: dict, where: Path) -> None:
    """``dcp.load`` that runs no code from the checkpoint (trainer/checkpoint_reader.py)."""
    reader = SafeReader(where)
    reader.read_metadata()  # a hostile file refused here, by name, not inside DCP's gathered exception
    dcp.load(state, storage_reader=reader, planner=SafePlanner())


def load_checkpoint(engine, path: str | Path) -> None:
    path = Path(path)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER} marker)")
    opts = _options(engine)
    model_sd, optim_sd = get_state_dict(engine.model, engine.optimizer, options=opts)
    state = {"model": model_sd, "optim": optim_sd}
    _load(state, path / "state")
    set_state_dict(
        engine.model, engine.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=opts
    )
    if engine.critic is not None:
        c_sd, co_sd = get_state_dict(engine.critic, engine.critic_optimizer)
        cstate = {"model": c_sd, "optim": co_sd}
        _load(cstate, path / "critic")
        set_state_dict(
            engine.critic, engine.critic_optimizer, model_state_dict=cstate["model"], optim_state_dict=cstate["optim"]
        )
    # weights_only: tensors and plain values, never objects: a file another process could write (a
    # shared runs volume) must not run code in the trainer at resume.
    extra = torch.load(path / f"extra_rank{_rank()}.pt", weights_only=True)
    engine.step, engine.version = extra["step"], extra["version"]
    engine.scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng_cpu"])
    if extra["rng_cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(extra["rng_cuda"])
