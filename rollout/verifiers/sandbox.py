"""Run an untrusted program: its own process, no network, no view of the machine's files, limits
on CPU time, memory, processes, file size and output, killed at its deadline.

The isolation is bubblewrap (Debian's ``bubblewrap``), started as an unprivileged uid so that it
builds its namespaces from a user namespace, which needs no privileges beyond what a CI machine
gives a normal user. Inside: an empty network namespace (no interface but a loopback that is
down), its own pid, ipc and uts namespaces, a filesystem holding only ``/usr`` read-only and
a small tmpfs as scratch (``/box``, also ``/tmp``), the program on stdin; no ``/etc``, ``/home``,
``/root``, nor the project. Outside, ``prlimit`` sets the rlimits before bubblewrap starts, so they
hold for everything inside: CPU seconds, address space, open files, file size and processes. The
process limit counts per uid, so each concurrent run gets a uid of its own (``uid_base + slot``),
held machine-wide by a lock file while it runs (another process's sandbox waits for it); after
the run every process of that uid is killed, so nothing the program detached outlives it. setpriv
sets no-new-privs: nothing it execs gains privileges.
The wall-clock deadline and the output cap are enforced here: the whole process group is killed,
and bubblewrap's ``--die-with-parent`` takes the pid namespace down with it. The program runs as
the namespace's pid 1 (``--as-pid-1``): bubblewrap's own init would be left a zombie of the
machine's pid 1 after each run, which in a container often reaps nothing, and the zombies count
against the slot's process limit until no sandbox can start.

What it does not protect against: the kernel is shared (no seccomp filter beyond bubblewrap's),
there is no CPU or memory cgroup (RLIMIT_AS bounds each process's address space, not the run's
total), and what is in ``/usr`` is readable. ``isolation: none`` keeps the rlimits, the uid, the
deadline and the output cap but none of the namespaces: for machines without user namespaces,
and said so in a warning.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

# Why a run ended, as counted: ``ok`` and ``error`` are the program's own exit (zero or not).
# ``sandbox``: the sandbox itself could not start (counted apart: not the program's fault).
# ``busy``: no slot came free within the run's timeout (the program never ran).
OUTCOMES = ("ok", "error", "timeout", "memory", "output", "killed", "sandbox", "busy")
_START_TRIES = 4  # bubblewrap's start can fail for a moment while a killed run's processes exit


class SandboxUnavailable(RuntimeError):
    """The isolation asked for cannot be set up on this machine."""


class SandboxConfig(BaseModel):
    """Limits of one sandboxed run (``rollout/verifiers/sandbox.py``)."""

    model_config = ConfigDict(extra="forbid")

    isolation: Literal["bwrap", "none"] = Field(
        "bwrap",
        description="bwrap: namespaces (no network, only /usr read-only, own pids) via bubblewrap (Debian: "
        "apt-get install bubblewrap); none: only the rlimits, an unprivileged uid, the deadline and the output "
        "cap (for machines without user namespaces; a warning says so).",
    )
    python: str = Field(
        "/usr/bin/python3",
        description="The interpreter inside the sandbox; it must live under /usr (the only tree mounted).",
    )
    memory_mb: int = Field(512, ge=16, description="Address-space limit of each process, MiB.")
    max_processes: int = Field(16, ge=1, description="Processes (and threads) the run may have at once.")
    max_output_bytes: int = Field(
        64 * 1024, ge=1024, description="stdout + stderr kept; a run printing more is killed (outcome output)."
    )
    scratch_mb: int = Field(16, ge=1, description="Size of the writable tmpfs scratch (/box, and /tmp), MiB.")
    max_file_mb: int = Field(8, ge=1, description="Largest file the run may write, MiB (RLIMIT_FSIZE).")
    max_open_files: int = Field(64, ge=8, description="Open file descriptors per process (RLIMIT_NOFILE).")
    max_concurrent: int = Field(2, ge=1, description="Runs at once; another call waits for a free slot.")
    uid_base: int = Field(
        60000,
        ge=1000,
        description="Runs use uids uid_base .. uid_base + max_concurrent - 1 (unprivileged, one per slot: the "
        "process limit counts per uid). Only used when started as root; otherwise the caller's uid.",
    )


@dataclass
class RunResult:
    outcome: str  # one of OUTCOMES
    exit_code: int | None
    seconds: float  # wall clock, start to end
    stdout: str
    stderr: str


class Sandbox:
    """``run(program, timeout_s)`` runs Python source in a fresh sandbox and says how it ended.
    Thread-safe; at most ``config.max_concurrent`` runs at once."""

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        c = self.config
        if not (os.path.isabs(c.python) and c.python.startswith("/usr/") and os.access(c.python, os.X_OK)):
            raise SandboxUnavailable(f"sandbox.python: {c.python!r} must be an executable under /usr")
        # Absolute paths: the run's PATH is not the caller's.
        self._tools = {tool: shutil.which(tool) for tool in ("prlimit", "setpriv", "bwrap")}
        missing = [tool for tool in ("prlimit", "setpriv") if self._tools[tool] is None]
        if missing:
            raise SandboxUnavailable(f"{missing[0]} (util-linux) is not on PATH")
        if c.isolation == "bwrap" and self._tools["bwrap"] is None:
            raise SandboxUnavailable(
                "sandbox.isolation: bwrap needs bubblewrap (Debian: apt-get install bubblewrap); "
                "isolation: none runs programs with rlimits only"
            )
        if c.isolation == "none":
            log.warning("sandbox: isolation none: programs see the network and the machine's files (rlimits only)")
        self._own_uids = os.geteuid() == 0
        if not self._own_uids:  # the limit would count the caller's own processes and threads too
            log.warning("sandbox: not root, so runs share the caller's uid and have no process limit")
        self._slots: list[int] = list(range(c.max_concurrent))
        self._free = threading.Condition()
        self.counts: dict[str, int] = dict.fromkeys(OUTCOMES, 0)
        check = self.run("print(6 * 7)", timeout_s=10)
        if check.outcome != "ok" or check.stdout.strip() != "42":
            raise SandboxUnavailable(f"sandbox: a test program did not run ({check.outcome}): {check.stderr[-500:]}")
        self.counts[check.outcome] -= 1  # the check is not an answer's run

    # ------------------------------------------------------------------ a run
    def run(self, program: str, timeout_s: float) -> RunResult:
        """Run ``program``; the whole call (a wait for a free slot included) ends within about
        ``timeout_s`` plus the few seconds a killed run takes to be gone."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s: must be > 0, got {timeout_s}")
        deadline = time.monotonic() + timeout_s
        with self._free:
            if not self._free.wait_for(lambda: self._slots, timeout=timeout_s):
                result = RunResult("busy", None, timeout_s, "", f"no free sandbox slot within {timeout_s:g} s")
                self.counts["busy"] += 1
                return result
            slot = self._slots.pop()
        try:
            held = _hold_uid(self.config.uid_base + slot, deadline) if self._own_uids else -1
        except OSError as e:  # /run not writable (a read-only container root): the run cannot be held
            held, why = None, f"cannot hold uid {self.config.uid_base + slot}: {e}"
        else:
            why = f"uid {self.config.uid_base + slot} stayed in use by another process for {timeout_s:g} s"
        if held is None:
            with self._free:
                self._slots.append(slot)
                self._free.notify()
                self.counts["busy"] += 1
            return RunResult("busy", None, timeout_s, "", why)
        try:
            for attempt in range(_START_TRIES):
                result = self._run(program, max(0.01, deadline - time.monotonic()), slot)
                # Retried within the same deadline: a program that only pretends bubblewrap failed
                # gets no more time than it had.
                if result.outcome != "sandbox" or deadline - time.monotonic() < 0.1:
                    break
                time.sleep(0.05 * 2**attempt)  # a killed run's processes still count against the uid
            if result.outcome == "sandbox":
                log.warning("sandbox: could not start: %s", result.stderr.strip()[-300:])
        finally:
            if held >= 0:
                os.close(held)  # the uid is free for any process again
            with self._free:
                self._slots.append(slot)
                self._free.notify()
        with self._free:
            self.counts[result.outcome] += 1
        return result

    def _run(self, program: str, timeout_s: float, slot: int) -> RunResult:
        c = self.config
        uid = c.uid_base + slot if self._own_uids else None
        # setpriv drops the uid (Popen(user=...) would fork rather than vfork, and gRPC's fork
        # handlers log a line for every run) and ties the run to its caller: if the caller dies,
        # the run is killed, and bubblewrap takes its namespace down with it.
        who = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"] if uid is not None else []
        # --no-new-privs: nothing the program execs (a setuid binary in /usr) gains privileges.
        argv = [self._tools["setpriv"], "--pdeathsig=KILL", "--no-new-privs", *who, "--", *self._argv(timeout_s)]
        with tempfile.TemporaryDirectory(prefix="rollmesh-sbx-") as tmp:  # the cwd (isolation none: scratch)
            if uid is not None:
                os.chown(tmp, uid, uid)
            t0 = time.monotonic()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=tmp,
                env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                start_new_session=True,
            )
            # The program comes on stdin, not as a file it could read back (the code reward's end
            # marker is in it). Python reads all of it before running any, so nothing is printed
            # before the write ends; a thread, so a sandbox that never reads cannot hold this one.
            threading.Thread(target=_feed, args=(proc.stdin, program.encode()), daemon=True).start()
            out, err, cut = _collect(proc, t0 + timeout_s, c.max_output_bytes)
            seconds = time.monotonic() - t0
            if uid is not None:
                # Every process of the slot's uid goes, not only the run's group: a program that
                # detached (setsid, then a double fork) outlived its run and could watch and signal
                # the next answer's run in this slot. The uid is the slot's alone.
                _kill_uid(uid)
                _wait_gone(uid, timeout_s=5.0)
        stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
        return RunResult(_outcome(proc.returncode, cut, stderr), proc.returncode, seconds, stdout, stderr)

    def _argv(self, timeout_s: float) -> list[str]:
        c = self.config
        mib = 1024 * 1024
        nproc = [f"--nproc={c.max_processes}"] if self._own_uids else []
        limits = [
            self._tools["prlimit"],
            f"--cpu={math.ceil(timeout_s) + 1}",
            f"--as={c.memory_mb * mib}",
            *nproc,
            f"--fsize={c.max_file_mb * mib}",
            f"--nofile={c.max_open_files}",
            "--core=0",
            "--",
        ]
        # Isolated (no site-packages, no user paths, no .pyc writes), the program from stdin.
        run = [c.python, "-I", "-S", "-B", "-"]
        if c.isolation == "none":
            return [*limits, *run]
        scratch = str(c.scratch_mb * mib)
        bwrap = [
            self._tools["bwrap"],
            "--unshare-all",
            "--die-with-parent",
            "--new-session",
            "--as-pid-1",
            "--ro-bind",
            "/usr",
            "/usr",
            "--symlink",
            "usr/lib",
            "/lib",
            "--symlink",
            "usr/lib64",
            "/lib64",
            "--symlink",
            "usr/bin",
            "/bin",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            # bubblewrap's /dev is a tmpfs of no set size (half the RAM) with a writable /dev/shm
            "--size",
            scratch,
            "--tmpfs",
            "/dev/shm",
            "--remount-ro",
            "/dev",
            "--size",
            scratch,
            "--tmpfs",
            "/tmp",
            "--size",
            scratch,
            "--tmpfs",
            "/box",
            "--chdir",
            "/box",
            "--remount-ro",
            "/",  # the root is bubblewrap's own tmpfs: unbounded if left writable
            "--clearenv",
            "--setenv",
            "PATH",
            "/usr/bin",
            "--setenv",
            "HOME",
            "/box",
            "--setenv",
            "LANG",
            "C.UTF-8",
            "--",
        ]
        return [*limits, *bwrap, *run]


def _feed(pipe, data: bytes) -> None:
    try:
        pipe.write(data)
        pipe.close()
    except OSError:  # the sandbox ended (or never started) before reading it all: its outcome says why
        pass


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, str]:
    """Read both pipes until the program ends, its deadline passes (``timeout``) or it prints more
    than ``cap`` bytes (``output``); in the two last cases its process group is killed."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for pipe in bufs:
        sel.register(pipe, selectors.EVENT_READ)
    cut = ""
    try:
        while sel.get_map() and not cut:
            left = deadline - time.monotonic()
            if left <= 0:
                cut = "timeout"
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                bufs[key.fileobj] += chunk
                if sum(map(len, bufs.values())) > cap:
                    cut = "output"
    finally:
        sel.close()
        if cut:
            _kill_group(proc)
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()) if not cut else 5)
        except subprocess.TimeoutExpired:  # the pipes closed but the program lives on (it closed them)
            cut = "timeout"
            _kill_group(proc)
            proc.wait(5)
        for pipe in bufs:
            pipe.close()
    out, err = bytes(bufs[proc.stdout][:cap]), bytes(bufs[proc.stderr][:cap])
    return out, err, cut


# One lock file per uid, in a directory only root writes: a slot's uid is held by one run on the whole
# machine, whatever process runs it (two reward workers' sandboxes share uid_base). So killing every
# process of the uid after a run kills nothing of anyone else's, and no two runs share a process limit.
UID_LOCKS = "/run/rollmesh-sandbox"


def _hold_uid(uid: int, deadline: float) -> int | None:
    """A descriptor holding ``uid`` exclusively (closing it lets go); None if still held at ``deadline``."""
    os.makedirs(UID_LOCKS, mode=0o700, exist_ok=True)
    fd = os.open(f"{UID_LOCKS}/{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.01)


def _pids_of(uid: int) -> list[int]:
    """Processes whose real or effective uid is ``uid``, read from their status: the owner of
    ``/proc/<pid>`` is root for a process that made itself non-dumpable."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/status") as f:
                    line = next(x for x in f if x.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if str(uid) in line.split()[1:3]:
                pids.append(int(pid))
    return pids


def _kill_uid(uid: int) -> None:
    for pid in _pids_of(uid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_gone(uid: int, timeout_s: float) -> None:
    """Until no process of ``uid`` is left: a killed pid namespace empties asynchronously."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _pids_of(uid):
            return
        time.sleep(0.02)
    log.warning("sandbox: processes of uid %d outlived their run by %g s", uid, timeout_s)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _outcome(code: int | None, cut: str, stderr: str) -> str:
    if cut:
        return cut
    if code == 0:
        return "ok"
    if code is not None and (code < 0 or code > 128):  # a signal (bubblewrap reports 128 + signal)
        sig = -code if code < 0 else code - 128
        return "timeout" if sig in (signal.SIGXCPU, signal.SIGKILL) else "killed"  # the CPU limit sends these
    if code == 1 and stderr.startswith("bwrap:"):  # bubblewrap's own failure, before the program ran
        return "sandbox"
    if "MemoryError" in stderr[-2000:]:
        return "memory"
    return "error"
