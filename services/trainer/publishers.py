"""Weight transports: implementations of the training loop's ``WeightPublisher`` port.

``disk`` (the default): every rank joins the export, rank 0 writes a Hugging Face directory
under ``RUN_DIR/weights/v<version>``, and the LLMProxy has every engine load it
(``/update_weights_from_disk``). The directory is also the restore point the controller rolls
back to and what an engine that rejoins is brought up to.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc

from services.convert import project_error
from services.llm_proxy.client import ProxyClient
from trainer.ports import PublishError


class DiskPublisher:
    def __init__(self, proxy: ProxyClient | None, run_dir: str | Path, keep_versions: int = 2) -> None:
        self.proxy, self.weights_dir, self.keep = proxy, Path(run_dir) / "weights", keep_versions
        self._path = ""

    def export(self, engine, version: int) -> str:
        out = engine.export(self.weights_dir / f"v{version}")  # every rank gathers, rank 0 writes
        self._path = "" if out is None else str(out)
        return self._path

    async def load(self, version: int, timeout_s: float) -> None:
        try:
            res = await self.proxy.update_weights(self._path, version, timeout_s=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise PublishError(f"LLMProxy: {project_error(e)}") from None
        if not res.success:
            raise PublishError("; ".join(f"{e.engine}: {e.message}" for e in res.engines if not e.success))

    def committed(self, version: int) -> None:
        dirs = sorted(self.weights_dir.glob("v*"), key=lambda p: int(p.name[1:].split(".")[0]))
        for old in dirs[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
