"""A real SLURM cluster on this machine for the launcher's tests: munged, slurmctld and one slurmd per
node (Debian's slurm-wlm, built with multiple slurmd per host), every file under one private folder.

Each node gets its own loopback address (127.0.0.1, 127.0.0.2, ...) as its ``NodeAddr``, so that a
service placed on the second node binds and is dialled at an address the first node's services do
not share. Started by hand in the foreground (no systemd), stopped by PID; nothing outside the
folder is touched (the munge socket, keys, state and logs all live in it).
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
from pathlib import Path


def pids_with(needle: str) -> list[int]:
    """Live processes whose command line holds ``needle``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and needle.encode() in (proc / "cmdline").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    def __init__(self, folder: Path, nodes: int = 2, cpus: int = 2) -> None:
        missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch") if shutil.which(b) is None]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not installed: `make test` installs slurm-wlm (Debian)")
        self.dir, self.cpus = folder, cpus
        self.nodes = [(f"n{i}", f"127.0.0.{i + 1}") for i in range(nodes)]
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(folder / "slurm.conf"))

    def _write(self) -> None:
        d, host = self.dir, socket.gethostname()
        for sub in ("munge", "state", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        d.chmod(0o755)  # munged refuses a socket folder others could write
        (d / "munge").chmod(0o755)
        key = d / "munge" / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        mem = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**20 // len(self.nodes) - 512
        lines = [
            "ClusterName=rmtest",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={d / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmdSpoolDir={d / 'state'}/slurmd-%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}",
            f"SlurmdPidFile={d / 'state'}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "ReturnToService=2",
            "MpiDefault=none",
            "KillWait=10",  # scancel: SIGTERM, then SIGKILL this many seconds later
            "MinJobAge=600",  # a finished job stays in `scontrol show job` for the test to read
        ]
        for name, addr in self.nodes:
            lines.append(
                f"NodeName={name} NodeHostname={host} NodeAddr={addr} Port={_free_port()} "
                f"CPUs={self.cpus} RealMemory={mem} State=UNKNOWN"
            )
        lines.append(f"PartitionName=debug Nodes={','.join(n for n, _ in self.nodes)} Default=YES State=UP")
        (d / "slurm.conf").write_text("\n".join(lines) + "\n")

    def start(self, timeout_s: float = 30.0) -> SlurmCluster:
        self._write()
        d = self.dir
        munge = [
            "munged",
            "--foreground",
            "--force",
            f"--socket={d / 'munge' / 'munge.socket'}",
            f"--key-file={d / 'munge' / 'munge.key'}",
            f"--pid-file={d / 'munge' / 'munged.pid'}",
            f"--log-file={d / 'log' / 'munged.log'}",
            f"--seed-file={d / 'munge' / 'seed'}",
        ]
        self._spawn(munge, "munged")
        self._spawn(["slurmctld", "-D", "-f", str(d / "slurm.conf")], "slurmctld")
        for name, _ in self.nodes:
            self._spawn(["slurmd", "-D", "-N", name, "-f", str(d / "slurm.conf")], f"slurmd-{name}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False).stdout.split()
            if states.count("idle") == len(self.nodes):
                return self
            for p in self.procs:
                if p.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}: see {d / 'log'}")
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"SLURM nodes not idle within {timeout_s:g}s: {states}; see {d / 'log'}")

    def _spawn(self, cmd: list[str], name: str) -> None:
        out = open(self.dir / "log" / f"{name}.out", "ab")  # noqa: SIM115 (the daemon's, closed with it)
        self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env))

    def run(self, *cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr}")
        return done

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, ExitCode, NodeList, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """The job's fields once it has ended; TimeoutError (after cancelling it) if it has not in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job["JobState"] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                return job
            time.sleep(1)
        self.run("scancel", job_id, check=False)
        raise TimeoutError(f"job {job_id} still {job['JobState']} after {timeout_s:g}s (cancelled)")

    def steps(self, job_id: str) -> list[dict[str, str]]:
        """The job's running steps (``scontrol show step``): StepId, Name, NodeList, ..."""
        out = self.run("scontrol", "show", "step", "--oneliner", job_id, check=False).stdout
        return [
            dict(f.split("=", 1) for f in line.split() if "=" in f)
            for line in out.splitlines()
            if line.startswith("StepId=")
        ]

    def cancel_all(self, needle: str, timeout_s: float = 60.0) -> None:
        """Cancel every job, then wait until no process whose command line holds ``needle`` (the
        tests' folder) is left but the cluster's own daemons: stopping slurmd would leave its steps'
        processes running."""
        if self.procs:
            for job in self.run("squeue", "--noheader", "--format=%i", check=False).stdout.split():
                self.run("scancel", "--full", job, check=False)
        daemons = {p.pid for p in self.procs}

        def left() -> list[int]:
            return [pid for pid in pids_with(needle) if pid not in daemons]

        deadline = time.monotonic() + timeout_s
        while left() and time.monotonic() < deadline:
            time.sleep(0.5)
        for pid in left():  # what Slurm did not end in time
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs = []
