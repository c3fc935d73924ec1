"""gRPC client of the EnvManager: `rollmesh run` holds the workers back while it measures the
untrained policy (Start after), stops them before the final evaluation (Stop) and reports what
they did (Stats)."""

from __future__ import annotations

import grpc

from services.auth import AuthConfig
from services.convert import project_error
from services.grpc_util import channel
from services.pb.rollmesh.v1 import env_manager_pb2 as pb
from services.pb.rollmesh.v1 import env_manager_pb2_grpc


class EnvManagerClient:
    def __init__(self, address: str, timeout_s: float = 30.0, auth: AuthConfig | None = None) -> None:
        self.address, self.timeout_s = address, timeout_s
        self._channel = channel(address, auth=auth)
        self.stub = env_manager_pb2_grpc.EnvManagerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method, request, timeout_s: float):
        try:
            return await method(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise project_error(e) from None

    async def start(self, num_workers: int = 0) -> None:
        """Start the workers (``0``: as many as configured); a no-op when they already run."""
        await self._call(self.stub.Start, pb.StartRequest(num_workers=num_workers), self.timeout_s)

    async def stop(self, drain: bool = False, timeout_s: float = 0.0) -> int:
        """Stop admitting; with ``drain``, let the groups in flight end (at most ``timeout_s``, 0: their
        own deadlines). Returns the episodes abandoned."""
        res = await self._call(
            self.stub.Stop, pb.StopRequest(drain=drain, timeout_s=timeout_s), timeout_s + self.timeout_s
        )
        return res.episodes_abandoned

    async def stats(self) -> dict:
        """Workers, episodes and groups so far, and failures by reason (only those that happened)."""
        res = await self._call(self.stub.Stats, pb.EnvStatsRequest(), self.timeout_s)
        return {
            "running": res.running,
            "workers": res.workers,
            "episodes_running": res.episodes_running,
            "episodes_finished": res.episodes_finished,
            "trajectories_put": res.trajectories_put,
            "groups_put": res.groups_put,
            "failures_by_reason": dict(res.failures_by_reason),
        }
