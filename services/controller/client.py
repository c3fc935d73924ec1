"""Async gRPC client of the AsyncController: the rollout loop's ``Admission`` port and the
training loop's ``VersionControl`` port. gRPC errors become the project's own
(``services/convert.project_error``): a controller that is restarting or unreachable raises
``TransientError``, bad input ``ValueError``, an update no longer in progress ``UpdateConflict``."""

from __future__ import annotations

import asyncio
import logging

import grpc

from rollout.ports import Admitted
from sample_buffer.errors import raise_if_cancelled
from services.auth import AuthConfig
from services.convert import project_error
from services.grpc_util import channel
from services.pb.rollmesh.v1 import controller_pb2 as pb
from services.pb.rollmesh.v1 import controller_pb2_grpc
from trainer.ports import Limits

log = logging.getLogger(__name__)


class ControllerClient:
    def __init__(self, address: str, timeout_s: float = 30.0, auth: AuthConfig | None = None, holder: str = "") -> None:
        """``holder``: this admitter's name, the same after a restart (an EnvManager's host:port): it
        reports its groups in flight on every call, so restarts on either side lose no slot."""
        self.address, self.timeout_s = address, timeout_s
        self.holder, self.held = holder, 0
        # One admission call at a time: a report overtaken by a grant it did not count would make
        # the controller's count too low (over-admission), so reports must arrive in order.
        self._in_order = asyncio.Lock()
        self._channel = channel(address, auth=auth)
        self.stub = controller_pb2_grpc.AsyncControllerStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method, request, timeout_s: float | None = None):
        try:
            return await method(request, timeout=timeout_s or self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise project_error(e) from None

    # ------------------------------------------------------------------ admission (rollout)
    async def admit(self, num_groups: int) -> Admitted:
        async with self._in_order:
            req = pb.AdmitRequest(num_groups=num_groups, holder=self.holder, held=self.held)
            res = await self._call(self.stub.Admit, req)
            self.held += res.num_admitted
        return Admitted(res.num_admitted, res.version, res.async_ratio)

    async def release(self, *, unused: int = 0, finished: int = 0, dropped: int = 0) -> None:
        async with self._in_order:
            # Counted before the call: a release the controller never hears of is corrected by the next report.
            self.held = max(0, self.held - unused - finished)
            req = pb.ReleaseRequest(
                num_groups=unused, num_finished=finished, num_dropped=dropped, holder=self.holder, held=self.held
            )
            await self._call(self.stub.Release, req)

    async def keep_lease(self, every_s: float) -> None:
        """Report this holder's count every ``every_s`` (run as a task): a holder whose workers are
        all busy with long episodes makes no other call, and the controller frees the slots of one
        silent for ``holder_lease_s``. A failed report is logged; the next one may get through."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.admit(0)
            except Exception as e:
                raise_if_cancelled()
                log.warning("lease report to the controller failed: %s", e)

    async def watch_versions(self):
        try:
            async for event in self.stub.WatchVersion(pb.WatchVersionRequest()):
                yield event.version
        except grpc.aio.AioRpcError as e:
            raise project_error(e) from None

    # ------------------------------------------------------------------ versions (trainer)
    async def limits(self) -> Limits:
        res = await self._call(self.stub.Admit, pb.AdmitRequest(num_groups=0))
        return Limits(res.async_ratio, res.groups_per_step, res.version)

    async def begin_update(self, new_version: int, timeout_s: float, supersede: bool = False) -> str:
        req = pb.BeginUpdateRequest(new_version=new_version, timeout_s=timeout_s, supersede=supersede)
        return (await self._call(self.stub.BeginUpdate, req, 60)).update_id

    async def commit_update(self, update_id: str, version: int, model_path: str) -> int:
        req = pb.CommitUpdateRequest(update_id=update_id, version=version, model_path=model_path)
        return (await self._call(self.stub.CommitUpdate, req, 60)).version

    async def abort_update(self, update_id: str, reason: str) -> int:
        req = pb.AbortUpdateRequest(update_id=update_id, reason=reason)
        return (await self._call(self.stub.AbortUpdate, req, 60)).version
