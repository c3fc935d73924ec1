"""A Docker engine of the test's own, and the images no registry here serves, built from Debian.

``DockerDaemon`` starts ``dockerd`` by hand with everything under one folder (socket, images,
state) and with the host's network left alone: no iptables rules, no docker0 bridge, no IP
forwarding; its containers use the host's network (``network_mode: host``). Stopped by PID.

``debian_base`` makes the base image with ``debootstrap`` (Debian 12, whose Python 3.11 takes the
same torch wheel as this machine) from the mirror apt uses here, and ``docker import``s it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

DEBIAN_SUITE = "bookworm"


class DockerDaemon:
    def __init__(self, folder: Path) -> None:
        missing = [b for b in ("dockerd", "docker", "docker-compose", "debootstrap") if shutil.which(b) is None]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not installed: `make deploy-test` installs them (Debian)")
        self.dir = folder
        self.socket = folder / "docker.sock"
        self.proc: subprocess.Popen | None = None
        self.env = dict(os.environ, DOCKER_HOST=f"unix://{self.socket}")

    def start(self, timeout_s: float = 60.0) -> DockerDaemon:
        d = self.dir
        cmd = ["dockerd", "--iptables=false", "--ip6tables=false", "--bridge=none", "--ip-forward=false"]
        cmd += ["--ip-masq=false", f"--host=unix://{self.socket}", f"--data-root={d / 'data'}"]
        cmd += [f"--exec-root={d / 'exec'}", f"--pidfile={d / 'docker.pid'}"]
        log = open(d / "dockerd.log", "ab")  # noqa: SIM115 (the daemon's, closed with it)
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"dockerd exited with {self.proc.returncode}: {(d / 'dockerd.log').read_text()[-2000:]}"
                )
            if self.run("docker", "version", check=False, timeout=10).returncode == 0:
                return self
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"dockerd did not answer within {timeout_s:g}s; see {d / 'dockerd.log'}")

    def run(self, *cmd: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=timeout, **kw)
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        return done

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()  # it stops its containers and unmounts their layers
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for path in reversed(self.mounts()):  # what it leaves mounted (its default netns handle)
            subprocess.run(["umount", path], capture_output=True, timeout=30)

    def mounts(self) -> list[str]:
        """Mount points under this daemon's folder, in mount order."""
        with open("/proc/mounts") as f:
            points = [line.split()[1] for line in f]
        return [p for p in points if p.startswith(str(self.dir) + "/")]


def debian_mirror() -> str:
    """The Debian mirror apt is configured with here (deb822 or one-line sources)."""
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        try:
            text = path.read_text()
        except OSError:
            continue
        for url in re.findall(r"(?:URIs:\s*|^deb\s+(?:\[[^\]]*\]\s+)?)(\S+/debian)\s*$", text, re.M):
            return url
    return "http://deb.debian.org/debian"


def debian_base(docker: DockerDaemon, folder: Path, tag: str = f"local/debian:{DEBIAN_SUITE}") -> str:
    """``tag``: a minimal Debian made by debootstrap in ``folder`` and imported (about 40 s)."""
    root = folder / "rootfs"
    done = subprocess.run(
        ["debootstrap", "--variant=minbase", DEBIAN_SUITE, str(root), debian_mirror()],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise RuntimeError(f"debootstrap failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    try:
        docker.run("docker", "import", "-", tag, stdin=tar.stdout, timeout=300)
    finally:
        tar.kill()
        tar.wait(60)
        shutil.rmtree(root)
    return tag
