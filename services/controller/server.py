"""gRPC AsyncController service: a thin adapter over ``AsyncController``."""

from __future__ import annotations

import asyncio
import logging

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from services.auth import AuthConfig
from services.controller.config import ControllerConfig
from services.controller.controller import AsyncController, BufferCount, RestoreError
from services.controller.errors import UpdateConflict
from services.grpc_util import serve_until_signal, start_server, unary_service
from services.llm_proxy.client import ProxyClient
from services.mesh_config import MeshConfig
from services.metrics import serve_metrics
from services.pb.rollmesh.v1 import controller_pb2 as pb
from services.pb.rollmesh.v1 import llm_proxy_pb2
from services.sample_buffer.client import BufferClient

log = logging.getLogger(__name__)
SERVICE = "rollmesh.v1.AsyncController"
INT32_MAX = (1 << 31) - 1


class ProxyControl:
    """The three LLMProxy calls the controller makes, each failing loudly."""

    _MODES = {"continue": llm_proxy_pb2.SUSPEND_MODE_CONTINUE, "in_place": llm_proxy_pb2.SUSPEND_MODE_IN_PLACE}

    def __init__(self, client: ProxyClient, timeout_s: float, mode: str = "continue", adapter: bool = False) -> None:
        self.client, self.timeout_s, self.mode = client, timeout_s, self._MODES[mode]
        self.adapter = adapter  # the versions' directories are LoRA adapters the engines serve by name

    async def suspend(self) -> None:
        await self.client.suspend(self.mode, timeout_s=self.timeout_s)

    async def resume(self) -> None:
        await self.client.resume(timeout_s=self.timeout_s)

    async def served_versions(self) -> list[int]:
        """The proxy's version and that of every engine in rotation."""
        stats = await self.client.stats()
        return [stats.weight_version, *(e.weight_version for e in stats.engines if e.healthy)]

    async def update_weights(self, model_path: str, version: int) -> None:
        res = await self.client.update_weights(model_path, version, timeout_s=self.timeout_s, adapter=self.adapter)
        if not res.success:
            raise RuntimeError("; ".join(f"{e.engine}: {e.message}" for e in res.engines if not e.success))


class _ControllerCollector:
    def __init__(self, ctl: AsyncController) -> None:
        self.ctl = ctl

    def collect(self):
        ctl, c = self.ctl, self.ctl.counters
        for name, doc, value in [
            ("rollmesh_controller_policy_version", "Current policy version", ctl.version),
            (
                "rollmesh_controller_async_ratio_versions",
                "Staleness bound: versions a sample may lag",
                ctl.config.async_ratio,
            ),
            (
                "rollmesh_controller_groups_per_step_groups",
                "Groups the trainer consumes per step",
                ctl.config.groups_per_step,
            ),
            ("rollmesh_controller_in_flight_groups", "Admitted groups not finished", ctl.in_flight),
            ("rollmesh_controller_buffered_groups", "Groups the SampleBuffer held when last asked", ctl.buffered),
            ("rollmesh_controller_admission_capacity_groups", "Slots free under the staleness bound", ctl.capacity()),
            ("rollmesh_controller_suspended", "1 during a weight update", float(ctl._update is not None)),
        ]:
            yield GaugeMetricFamily(name, doc, value=value)
        for name, doc, value in [
            ("rollmesh_controller_admitted_groups", "Admission slots granted", c["admitted"]),
            ("rollmesh_controller_admit_refused_groups", "Admission slots asked for and refused", c["admit_refused"]),
            ("rollmesh_controller_finished_groups", "Admitted groups that ended in the buffer", ctl.finished),
            (
                "rollmesh_controller_lease_expired_groups",
                "Admission slots of EnvManagers that stopped reporting (controller.holder_lease_s), returned",
                c["lease_expired"],
            ),
            (
                "rollmesh_controller_lease_returned_groups",
                "Groups in flight reported by an EnvManager after its lease "
                "expired (it was cut off, not dead: admission briefly ran over the bound)",
                c["lease_returned"],
            ),
            (
                "rollmesh_controller_buffer_lost_groups",
                "Groups the SampleBuffer held when it lost its state (in-memory backend restarted)",
                c["buffer_lost"],
            ),
            (
                "rollmesh_controller_buffer_poll_failures",
                "Questions to the SampleBuffer that failed",
                c["buffer_poll_failures"],
            ),
            (
                "rollmesh_controller_reconciles",
                "Times engines found at another version got the committed weights",
                c["reconciles"],
            ),
            (
                "rollmesh_controller_released_unused_groups",
                "Admitted slots given back unused (failed, filtered)",
                c["released"],
            ),
            (
                "rollmesh_controller_dropped_stale_groups",
                "Finished groups the buffer dropped as too stale",
                c["dropped"],
            ),
            (
                "rollmesh_controller_weight_update_duration_seconds",
                "Time spent suspended in weight updates",
                c["update_seconds_total"],
            ),
            (
                "rollmesh_controller_restore_failures",
                "Rollbacks that could not restore the previous weights",
                c["restore_failures"],
            ),
            ("rollmesh_controller_resume_failures", "Resumes of the LLMProxy that failed", c["resume_failures"]),
            (
                "rollmesh_controller_holder_resyncs",
                "Holder reports that corrected the controller's count (a restart on either side)",
                c["holder_resyncs"],
            ),
        ]:
            yield CounterMetricFamily(name, doc, value=value)
        updates = CounterMetricFamily(
            "rollmesh_controller_weight_updates", "Weight updates, by result", labels=["result"]
        )
        for result in ("committed", "aborted", "timed_out"):
            updates.add_metric([result], c[f"updates_{result}"])
        yield updates


def build_metrics(ctl: AsyncController) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(_ControllerCollector(ctl))
    return r


def build_handler(ctl: AsyncController) -> grpc.GenericRpcHandler:
    async def guarded(ctx, coro):
        try:
            return await coro
        except ValueError as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except UpdateConflict as e:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            await ctx.abort(grpc.StatusCode.UNAVAILABLE, f"LLMProxy did not answer: {e}")

    async def admit(req: pb.AdmitRequest, ctx) -> pb.AdmitResponse:
        a = await guarded(ctx, ctl.admit(req.num_groups, req.holder, req.held))
        # Without a buffer to ask, (async_ratio + version + 1) x groups_per_step - ... grows with the version:
        # past 2**31 - 1 it did not fit the int32 field, and every Admit failed with UNKNOWN.
        return pb.AdmitResponse(
            num_admitted=a.num_groups,
            version=a.version,
            capacity=min(ctl.capacity(), INT32_MAX),
            async_ratio=a.async_ratio,
            groups_per_step=ctl.config.groups_per_step,
        )

    async def release(req: pb.ReleaseRequest, ctx) -> pb.ReleaseResponse:
        await guarded(
            ctx,
            ctl.release(
                unused=req.num_groups,
                finished=req.num_finished,
                dropped=req.num_dropped,
                holder=req.holder,
                held=req.held,
            ),
        )
        return pb.ReleaseResponse()

    async def begin(req: pb.BeginUpdateRequest, ctx) -> pb.BeginUpdateResponse:
        update_id = await guarded(ctx, ctl.begin_update(req.new_version, req.timeout_s, req.supersede))
        return pb.BeginUpdateResponse(update_id=update_id)

    async def commit(req: pb.CommitUpdateRequest, ctx) -> pb.CommitUpdateResponse:
        version = await guarded(ctx, ctl.commit_update(req.update_id, req.version, req.model_path))
        return pb.CommitUpdateResponse(version=version)

    async def abort(req: pb.AbortUpdateRequest, ctx) -> pb.AbortUpdateResponse:
        return pb.AbortUpdateResponse(version=await guarded(ctx, ctl.abort_update(req.update_id, req.reason)))

    async def watch(req: pb.WatchVersionRequest, ctx):
        async for version, suspended in ctl.watch():
            yield pb.VersionEvent(version=version, suspended=suspended)

    return unary_service(
        SERVICE,
        {
            "Admit": (pb.AdmitRequest, admit),
            "Release": (pb.ReleaseRequest, release),
            "BeginUpdate": (pb.BeginUpdateRequest, begin),
            "CommitUpdate": (pb.CommitUpdateRequest, commit),
            "AbortUpdate": (pb.AbortUpdateRequest, abort),
        },
        streams={"WatchVersion": (pb.WatchVersionRequest, watch)},
    )


class BufferCounts:
    """The SampleBuffer's numbers admission needs, from its Stats."""

    def __init__(self, client: BufferClient) -> None:
        self.client = client

    async def count(self) -> BufferCount:
        stats = await self.client.stats()
        return BufferCount(held=stats.depth + stats.in_flight, stored_total=stats.put_total)

    async def close(self) -> None:
        await self.client.close()


class _Clients:
    def __init__(self, *clients) -> None:
        self.clients = [c for c in clients if c is not None]

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients))


async def start_controller(
    config: ControllerConfig, proxy_address: str, auth: AuthConfig | None = None, buffer_address: str | None = None
):
    """Start the controller and its gRPC server; returns (server, controller, its clients: ``close()``).
    Without ``buffer_address`` admission counts finished groups itself (tests of the protocol)."""
    proxy_client = ProxyClient(proxy_address, timeout_s=config.control_timeout_s, auth=auth)
    buffer = BufferCounts(BufferClient(buffer_address, config.control_timeout_s, auth)) if buffer_address else None
    clients = _Clients(proxy_client, buffer)
    ctl = AsyncController(
        config,
        ProxyControl(proxy_client, config.control_timeout_s, config.suspend_mode, config._adapter_updates),
        buffer,
    )
    try:
        await ctl.restore()  # before serving: nothing is admitted until the engines serve the saved version
    except BaseException:
        await clients.close()
        raise
    ctl.start()
    server = await start_server(build_handler(ctl), SERVICE, config.host, config.port, auth=auth)
    serve_metrics(build_metrics(ctl), config.host, config.metrics_port, "AsyncController")
    return server, ctl, clients


def serve(config: ControllerConfig, auth: AuthConfig, mesh: MeshConfig) -> None:
    """The controller's section, and the mesh's addresses (the LLMProxy's and the SampleBuffer's)."""

    async def start():
        try:
            server, ctl, clients = await start_controller(config, mesh.proxy, auth, mesh.buffer)
        except RestoreError as e:
            log.error("%s", e)
            raise SystemExit(1) from None
        log.info("AsyncController serving on %s:%d", config.host, server.bound_port)

        async def cleanup() -> None:
            await ctl.close()
            await clients.close()

        return server, cleanup

    serve_until_signal(start)
