"""`make gpu-check` (`rollmesh bench gpu`): rollmesh's GPU path measured in one run, one JSON line.

On a machine with a CUDA GPU, on a randomly initialised model of Qwen2-0.5B's shape (nothing is
downloaded):

- ``trainer``: GRPO steps in bfloat16 mixed precision (float32 master weights): tokens/s, MFU
  against the GPU's dense bf16 peak, peak memory (``bench trainer``). With one GPU the trainer is
  one process with ``torch.autocast``, as ``rollmesh run`` runs it there; FSDP2 shards over the
  ranks of ``torchrun`` when there are several.
- ``engine``: the embedded engine served on CUDA (bfloat16) against ``transformers`` ``generate``
  in static batches on the same prompts and response lengths (``bench engine``), with each one's
  log-prob mismatch against a teacher-forced forward.
- ``weights``: updates of that model through the LLMProxy into an engine on the GPU (``bench
  weights``): ``disk`` (the baseline), ``ipc_cuda`` (CUDA IPC handles to the trainer's memory) and,
  with two GPUs or more, ``collective_nccl`` (the engine on the second GPU: NCCL refuses two ranks of
  one group on one GPU). Each reports seconds, GB/s and whether the engine's checksum equals the
  trainer's.
- ``moe``: routing replay on a random Qwen3-MoE of about 1 B parameters (64 experts, top-8, 16 layers):
  the embedded engine in bfloat16 on CUDA samples with its routing recorded; the float32 trainer's
  log-prob mismatch against it with free and with replayed routing, and how often the two route a
  token differently (``bench moe``).

A section that fails is reported with its error and the others still run; the command then exits 1.
Without CUDA it exits 2 at once.
"""

from __future__ import annotations

import tempfile
import time
import traceback
from pathlib import Path


class NoCuda(RuntimeError):
    """No CUDA device is visible to torch."""


def _section(name: str, fn, progress) -> dict:
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # one section's failure is its result; the others still run
        progress(f"{name} failed:\n{traceback.format_exc()}")
        out = {"error": f"{type(e).__name__}: {e}"[:2000]}
    out["section_wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def run(steps: int = 5, num_prompts: int = 256, max_new_tokens: int = 128, progress=print) -> dict:
    import torch

    from launch.bench import BadOption, engine_bench, trainer_bench, weights_bench
    from trainer.tiny_model import SHAPES, build_tiny_model

    if not torch.cuda.is_available():
        raise NoCuda(f"no CUDA device visible to torch {torch.__version__} (built with CUDA {torch.version.cuda})")
    for name, value in (("steps", steps), ("num-prompts", num_prompts), ("max-new-tokens", max_new_tokens)):
        if value < 1:
            raise BadOption(f"--{name}: must be >= 1, got {value}")
    gpus = torch.cuda.device_count()
    t0 = time.perf_counter()
    out: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "shape": "qwen2-0.5b",
    }
    with tempfile.TemporaryDirectory(prefix="rollmesh-gpu-check-") as tmp:
        progress("building a random qwen2-0.5b-shaped model")
        model = str(build_tiny_model(Path(tmp) / "model", SHAPES["qwen2-0.5b"]))

        def trainer() -> dict:
            r = trainer_bench.run(model, steps=steps, device="cuda", mixed_precision=True, progress=progress)
            torch.cuda.empty_cache()
            keep = (
                "params_m",
                "device",
                "tokens_per_step",
                "packed_s_per_step",
                "train_tokens_per_s",
                "unpacked_tokens_per_s",
                "packing_speedup",
                "mfu",
                "peak_gpu_mem_gb",
            )
            return {"fsdp2_ranks": 1, "precision": "bf16 autocast, fp32 master weights", **{k: r[k] for k in keep}}

        def engine() -> dict:
            return engine_bench.run(
                model,
                num_prompts,
                max_new_tokens,
                batch_size=64,
                vllm=False,
                progress=progress,
                device="cuda",
                dtype="bfloat16",
            )

        def weights() -> dict:
            transports = ("disk", "ipc_cuda") + (("collective_nccl",) if gpus >= 2 else ())
            env = {"CUDA_VISIBLE_DEVICES": "1"} if gpus >= 2 else None  # the engine beside the trainer's GPU 0
            r = weights_bench.run(
                model_path=model, engines=1, repeats=2, transports=transports, engine_env=env, progress=progress
            )
            if gpus < 2:
                r["collective_nccl"] = "not run: NCCL needs the trainer and the engine on different GPUs (2+)"
            return r

        def moe() -> dict:
            from launch.bench.moe_bench import mismatch

            progress("building a random qwen3-moe-small-shaped model")
            moe_model = str(build_tiny_model(Path(tmp) / "moe", SHAPES["qwen3-moe-small"]))
            r = mismatch(moe_model, "bfloat16", num_prompts=64, max_new_tokens=64, device="cuda", progress=progress)
            torch.cuda.empty_cache()
            return {"shape": "qwen3-moe-small", **r}

        sections = (("trainer", trainer), ("engine", engine), ("weights", weights), ("moe", moe))
        for name, fn in sections:
            progress(f"== {name}")
            out[name] = _section(name, fn, progress)
    out["failed_sections"] = [k for k, _ in sections if "error" in out[k]]
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out
