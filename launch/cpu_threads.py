"""How many torch threads each process of a local mesh gets, when its config leaves it to us.

torch's default takes every core in every process. `bench engine` on the tiny model, with torch's
default, was reported at 90 tokens/s beside one busy process against 3,146 on a quiet machine
(issue 32; the likely cause, OpenMP threads spinning while waiting for a teammate whose core is
taken, is not verified yet), and the quickstart measured 2.0 s against 0.3 s per train step with
engine and trainer at every core each. So `rollmesh run` divides the cores it may use among the
torch processes it starts (embedded engines and trainer ranks) wherever a section's `num_threads`
is 0, and says what it chose; a number set in the config is kept.
"""

from __future__ import annotations

import os

from services.engine.backends import backend


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask: a container's or taskset's limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def threads_each(cores: int, processes: int) -> int:
    """An equal share of ``cores`` for each of ``processes``, at least one thread."""
    return max(1, cores // max(1, processes))


def thread_overrides(cfg, cores: int) -> tuple[list[str], str]:
    """``--set`` overrides giving each torch process of ``cfg``'s local mesh its share of ``cores``
    (only sections whose ``num_threads`` is 0), and a line saying what was chosen."""
    engines = cfg.run.num_engines if backend(cfg.engine).torch_threads else 0
    ranks = cfg.run.trainer_procs if cfg.trainer.type == "fsdp" else 0
    share = threads_each(cores, engines + ranks)
    overrides, chosen = [], []
    for section, count in (("engine", engines), ("trainer", ranks)):
        if not count:
            continue
        if getattr(cfg, section).num_threads == 0:
            overrides.append(f"{section}.num_threads={share}")
            chosen.append(f"{section} {share}")
        else:
            chosen.append(f"{section} {getattr(cfg, section).num_threads} (config)")
    if not chosen:
        return [], ""
    return overrides, (
        f"torch threads per process: {', '.join(chosen)} ({cores} cores, {engines} engine(s) and "
        f"{ranks} trainer rank(s))"
    )
