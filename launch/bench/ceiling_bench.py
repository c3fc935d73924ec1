"""``rollmesh bench ceiling``: the zero-overhead admission model (``rollout/engines/sim/ceiling.py``)
swept over step sizes and async ratios for a run config's workload."""

from __future__ import annotations

from launch.bench import BadOption
from rollout.engines.sim.ceiling import SHAPE, sweep
from rollout.engines.sim.config import SimEngineConfig
from trainer.sim import SimTrainerConfig


def plan(
    cfg,
    groups_per_step: list[int],
    async_ratios: list[int],
    engines: int | None = None,
    target: float = 0.85,
    progress=print,
) -> dict:
    """``rollmesh bench ceiling``: the sweep for a run config's workload (or the simulator's defaults,
    the shape ``bench async`` uses), and per step size the smallest async_ratio reaching ``target``."""
    if not groups_per_step or min(groups_per_step) < 1 or not async_ratios or min(async_ratios) < 0:
        raise BadOption("groups_per_step: each >= 1; async_ratio: each >= 0")
    sim, trainer, shape = SimEngineConfig(), SimTrainerConfig(), dict(SHAPE)
    if cfg is not None:  # a loaded run config (launch.config.RollmeshConfig)
        sim = cfg.engine if isinstance(cfg.engine, SimEngineConfig) else sim
        trainer = cfg.trainer if isinstance(cfg.trainer, SimTrainerConfig) else trainer
        shape = {
            "engines": cfg.run.num_engines,
            "max_running": cfg.engine.max_running_requests,
            "group_size": cfg.env_manager.group_size,
            "max_new_tokens": cfg.env_manager.episode.sampling.max_new_tokens,
        }
    if engines is not None:
        shape["engines"] = engines

    def show(r: dict) -> None:
        progress(
            f"groups/step {r['groups_per_step']:4d} ({r['step_vs_slots']:.2g}x the engines' slots)  "
            f"async_ratio {r['async_ratio']}: {r['step_s']:7.1f} s/step  efficiency {r['efficiency']:.3f}  "
            f"engines {r['engine_occupancy']:.0%} full  speedup vs sync {r['speedup_vs_sync']:.2f}  "
            f"trained tokens vs sync {r['trained_tokens_vs_sync']:.2f}"
        )

    rows = sweep(sim, trainer, groups_per_step=groups_per_step, async_ratios=async_ratios, progress=show, **shape)
    out: dict = {"played": {f"gps{r['groups_per_step']}_async{r['async_ratio']}": r for r in rows}, **shape}
    for gps in groups_per_step:
        mine = [r for r in rows if r["groups_per_step"] == gps]
        enough = [r["async_ratio"] for r in mine if r["efficiency"] >= target]
        out[f"needed_async_ratio_gps{gps}"] = min(enough) if enough else None
        for r in mine:
            out[f"efficiency_gps{gps}_async{r['async_ratio']}"] = round(r["efficiency"], 3)
    return out
