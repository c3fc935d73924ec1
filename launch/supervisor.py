"""Keeping `rollmesh run`'s processes alive: a service that exits is started again, with backoff.

A restarted service comes back on the same command line, so on the same port: the others'
gRPC channels and the LLMProxy's health loop find it again without being told. What each
service holds after a restart is in docs/architecture.md ("Restarts").
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

from services.auth import Role, environment_of

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)  # before the 1st, 2nd, ... restart; the last repeats


class GaveUp(RuntimeError):
    """A service exited more often than ``run.max_restarts`` allows."""


@dataclass
class Supervised:
    name: str
    proc: subprocess.Popen
    log_path: Path | None = None
    finishes: bool = False  # exit code 0 means its work is done (the trainer), not that it died
    env: dict[str, str] = field(default_factory=dict)  # what it was started with beyond ours (its GPUs)
    roles: frozenset[Role] = frozenset(Role)  # whose tokens it holds (services/auth.py); the others' are not passed on
    restart_args: list[str] | None = None  # the command a restart runs; default: the first one's
    restarts: int = 0
    _due: float | None = field(default=None, repr=False)  # when the pending restart starts

    def check(self, max_restarts: int, report: Callable[[str], None]) -> None:
        """Start the process again if it has exited: after a backoff, at most ``max_restarts`` times."""
        if self.proc.poll() is None or (self.finishes and self.proc.returncode == 0):
            return
        if self._due is None:
            if self.restarts >= max_restarts:
                raise GaveUp(
                    f"{self.name} exited with code {self.proc.returncode} after {self.restarts} restarts"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            delay = BACKOFF_S[min(self.restarts, len(BACKOFF_S) - 1)]
            report(f"{self.name} exited with code {self.proc.returncode}: restart {self.restarts + 1} in {delay:g} s")
            self._due = time.monotonic() + delay
        elif time.monotonic() >= self._due:
            out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115 (the process's)
            self.proc = subprocess.Popen(
                self.restart_args or self.proc.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(environment_of(self.roles), PYTHONUNBUFFERED="1", **self.env),
            )
            self.restarts += 1
            self._due = None


class RestartsCollector:
    """``rollmesh_service_restarts_total{service}``, read from the supervised processes at scrape time."""

    def __init__(self, services: list[Supervised]) -> None:
        self.services = services

    def collect(self):
        family = CounterMetricFamily(
            "rollmesh_service_restarts", "Times `rollmesh run` restarted a service", labels=["service"]
        )
        for s in self.services:
            family.add_metric([s.name], s.restarts)
        yield family
