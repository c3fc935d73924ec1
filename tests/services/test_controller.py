"""The AsyncController over gRPC, driving a real LLMProxy in front of a real engine process."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from rollout.proxy import ProxyConfig
from sample_buffer.config import BufferConfig
from sample_buffer.deadlines import wait_for
from services.controller.client import ControllerClient
from services.controller.config import ControllerConfig
from services.controller.controller import AsyncController, RestoreError
from services.controller.server import BufferCounts, start_controller
from services.grpc_util import channel as grpc_channel
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import engine_client, start_proxy
from services.pb.rollmesh.v1 import controller_pb2 as pb
from services.pb.rollmesh.v1 import controller_pb2_grpc
from services.sample_buffer.client import BufferClient
from services.sample_buffer.server import start_buffer_service
from tests.sample_buffer.helpers import make_group
from tests.services.mesh import local_mesh
from tests.services.proxy_waits import decoding


def run(scenario, engine_url: str, model_path: str, **cfg):
    async def main():
        proxy_server, proxy = await start_proxy(ProxyConfig(engine_urls=[engine_url], port=0, metrics_port=0))
        config = ControllerConfig(initial_model_path=model_path, port=0, metrics_port=0, **cfg)
        try:
            server, ctl, proxy_client = await start_controller(config, f"127.0.0.1:{proxy_server.bound_port}")
            channel = grpc_channel(f"127.0.0.1:{server.bound_port}")
            stub = controller_pb2_grpc.AsyncControllerStub(channel)
            gen = ProxyClient(f"127.0.0.1:{proxy_server.bound_port}")
            try:
                return await scenario(stub, gen, proxy)
            finally:
                await gen.close()
                await channel.close()
                await server.stop(0)
                await ctl.close()
                await proxy_client.close()
        finally:  # also when the controller does not start
            await proxy_server.stop(0)
            await proxy.close()

    return asyncio.run(main())


# Nearly the tiny model's context (1024): about a second on a quiet machine, so an update begun a
# few tokens in lands mid-request (see tests/services/proxy_waits.py).
LONG = 1000


@pytest.fixture
def engine(make_engine_process):
    return make_engine_process()[1]


def test_admission_follows_the_async_ratio(engine, tiny_model, tiny_model_b):
    async def scenario(stub, gen, proxy):
        first = await stub.Admit(pb.AdmitRequest(num_groups=10))
        await stub.Release(pb.ReleaseRequest(num_groups=1, num_finished=3))
        again = await stub.Admit(pb.AdmitRequest(num_groups=10))
        update = await stub.BeginUpdate(pb.BeginUpdateRequest(new_version=1))
        await stub.CommitUpdate(pb.CommitUpdateRequest(update_id=update.update_id, version=1, model_path=tiny_model))
        after = await stub.Admit(pb.AdmitRequest(num_groups=10))
        # The trainer reports 2 finished groups the buffer dropped as too stale: 2 slots return.
        await stub.Release(pb.ReleaseRequest(num_dropped=2))
        refilled = await stub.Admit(pb.AdmitRequest(num_groups=10))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Release(pb.ReleaseRequest(num_finished=99))
        with pytest.raises(grpc.aio.AioRpcError) as e2:
            await stub.Release(pb.ReleaseRequest(num_dropped=99))
        return first, again, after, refilled, e.value, e2.value

    first, again, after, refilled, err, err2 = run(scenario, engine, tiny_model, async_ratio=1, groups_per_step=2)
    assert (first.num_admitted, first.version, first.capacity) == (4, 0, 0)  # (1 + 0 + 1) x 2
    assert again.num_admitted == 1  # 4 slots - 3 finished: a released slot returns, a finished one does not
    assert (after.num_admitted, after.version) == (2, 1)  # one more version, one more batch
    assert refilled.num_admitted == 2
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds" in err.details()
    assert err2.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_dropped" in err2.details()


def test_update_protocol_continues_generation_under_new_weights(engine, tiny_model, tiny_model_b):
    async def scenario(stub, gen, proxy):
        events = []

        async def watch():
            async for ev in stub.WatchVersion(pb.WatchVersionRequest()):
                events.append((ev.version, ev.suspended))
                if ev.version == 1 and not ev.suspended:
                    return

        watcher = asyncio.create_task(watch())
        long = asyncio.create_task(gen.generate([1, 30, 31], LONG, temperature=0.0, ignore_eos=True))
        await decoding(proxy)
        update = await stub.BeginUpdate(pb.BeginUpdateRequest(new_version=1, timeout_s=30))
        suspended = proxy.suspended
        pushed = await gen.update_weights(tiny_model_b, 1)  # the trainer's push, through the proxy
        with pytest.raises(grpc.aio.AioRpcError) as conflict:
            await stub.BeginUpdate(pb.BeginUpdateRequest(new_version=2))
        committed = await stub.CommitUpdate(
            pb.CommitUpdateRequest(update_id=update.update_id, version=1, model_path=tiny_model_b)
        )
        out = await long
        await wait_for(watcher, 10)
        return suspended, pushed, conflict.value, committed, out, events, proxy.suspended

    suspended, pushed, conflict, committed, out, events, still = run(scenario, engine, tiny_model)
    assert suspended and pushed.success and committed.version == 1 and not still
    assert conflict.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert out.num_segments == 2 and set(out.token_versions) == {0, 1} and len(out.output_ids) == LONG
    assert events[0] == (0, False) and (0, True) in events and events[-1] == (1, False)


def test_in_place_suspend_keeps_requests_inside_the_engine_across_an_update(engine, tiny_model, tiny_model_b):
    """suspend_mode in_place: the engine pauses with the request and its KV inside, loads the new
    weights and goes on decoding; the proxy never re-submits (one segment), versions still switch."""

    async def scenario(stub, gen, proxy):
        long = asyncio.create_task(gen.generate([1, 30, 31], LONG, temperature=0.0, ignore_eos=True))
        await decoding(proxy)
        update = await stub.BeginUpdate(pb.BeginUpdateRequest(new_version=1, timeout_s=30))
        in_flight_while_suspended = len(proxy.in_flight)
        pushed = await gen.update_weights(tiny_model_b, 1)
        await stub.CommitUpdate(pb.CommitUpdateRequest(update_id=update.update_id, version=1, model_path=tiny_model_b))
        return in_flight_while_suspended, pushed, await long

    in_flight, pushed, out = run(scenario, engine, tiny_model, suspend_mode="in_place")
    assert in_flight == 1 and pushed.success
    assert out.num_segments == 1 and len(out.output_ids) == LONG
    versions = list(out.token_versions)
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)  # switched once, mid-request


def test_an_update_that_is_never_committed_rolls_back(engine, tiny_model, tiny_model_b):
    async def scenario(stub, gen, proxy):
        before = await gen.generate([1, 50, 51], 12, temperature=0.0, ignore_eos=True)
        update = await stub.BeginUpdate(pb.BeginUpdateRequest(new_version=1, timeout_s=0.5))
        await gen.update_weights(tiny_model_b, 1)  # half done, then the trainer "dies"
        await asyncio.sleep(1.5)
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stub.CommitUpdate(pb.CommitUpdateRequest(update_id=update.update_id, version=1))
        after = await gen.generate([1, 50, 51], 12, temperature=0.0, ignore_eos=True)
        admit = await stub.Admit(pb.AdmitRequest(num_groups=1))
        return before, after, late.value, admit, proxy.suspended

    before, after, late, admit, suspended = run(scenario, engine, tiny_model)
    assert late.code() == grpc.StatusCode.FAILED_PRECONDITION and "rolled back" in late.details()
    assert not suspended and admit.version == 0
    assert list(after.output_ids) == list(before.output_ids)  # the old weights are back
    assert after.weight_version == 0


def test_bad_requests(engine, tiny_model):
    async def scenario(stub, gen, proxy):
        codes = []
        for call in (
            stub.BeginUpdate(pb.BeginUpdateRequest(new_version=0)),
            stub.Admit(pb.AdmitRequest(num_groups=-1)),
            stub.CommitUpdate(pb.CommitUpdateRequest(update_id="nope", version=1)),
            stub.AbortUpdate(pb.AbortUpdateRequest(update_id="nope")),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call
            codes.append(e.value.code())
        return codes

    codes = run(scenario, engine, tiny_model)
    assert codes == [grpc.StatusCode.INVALID_ARGUMENT] * 2 + [grpc.StatusCode.FAILED_PRECONDITION] * 2


def test_a_restarted_controller_restores_its_version_and_the_engines_weights(
    engine, tiny_model, tiny_model_b, tmp_path
):
    """The committed version survives the controller: a new one reads it, brings the engine
    (here restarted at the initial weights, as after a full stop) to its weights before serving,
    and admits under that version's bound."""
    state = tmp_path / "controller.json"

    async def first(stub, gen, proxy):
        update = await stub.BeginUpdate(pb.BeginUpdateRequest(new_version=3))
        await stub.CommitUpdate(pb.CommitUpdateRequest(update_id=update.update_id, version=3, model_path=tiny_model_b))

    async def second(stub, gen, proxy):
        out = await gen.generate([1, 30, 31], 4, temperature=0.0)
        return out, await stub.Admit(pb.AdmitRequest(num_groups=100))

    run(first, engine, tiny_model, state_path=str(state), groups_per_step=2)
    saved = state.read_text()
    asyncio.run(engine_client(engine).update_weights_from_disk(tiny_model, 0))  # the engine starts afresh
    out, admitted = run(second, engine, tiny_model, state_path=str(state), groups_per_step=2)
    assert '"version": 3' in saved and tiny_model_b in saved
    assert out.weight_version == 3 and set(out.token_versions) == {3}
    # Version 3 under async_ratio 1: (1 + 3 + 1) x 2 slots minus the 3 x 2 groups consumed.
    assert admitted.version == 3 and admitted.num_admitted == 4

    state.write_text("{not json")
    with pytest.raises(RestoreError, match="controller.json: not a controller state"):
        run(second, engine, tiny_model, state_path=str(state))


def test_holders_report_their_groups_in_flight_so_no_restart_leaks_or_refuses_a_slot(engine, tiny_model):
    """An EnvManager (a named holder) reports its groups in flight on every call. Its restarted
    successor reports 0: the slots of the groups that died with it return at once. A restarted
    controller takes the holders' finished groups and counts from their reports."""

    async def main():
        async with local_mesh(engine, tiny_model, async_ratio=1, groups_per_step=2) as mesh:
            address = mesh.controller_client.address
            first = ControllerClient(address, holder="env:1")
            assert (await first.admit(3)).num_groups == 3  # (1 + 0 + 1) x 2 = 4 slots
            assert (await mesh.buffer_client.put(make_group("g1"))).accepted
            await first.release(finished=1)
            assert first.held == 2 and mesh.controller.in_flight == 2
            await asyncio.sleep(1.2)  # the controller has asked the buffer since: it holds the group
            # the EnvManager is killed with 2 groups in flight; its successor has the same name
            second = ControllerClient(address, holder="env:1")
            granted = (await second.admit(4)).num_groups
            resyncs = mesh.controller.counters["holder_resyncs"]
            for c in (first, second):
                await c.close()
            return granted, resyncs

    granted, resyncs = asyncio.run(main())
    assert granted == 3 and resyncs == 1  # 4 slots - 1 finished; without the report only 1

    async def restarted_controller():
        ctl = AsyncController(ControllerConfig(async_ratio=1, groups_per_step=2, initial_model_path=tiny_model))
        # groups admitted by its predecessor finish: accepted and counted, not INVALID_ARGUMENT
        await ctl.release(finished=1, holder="env:1", held=2)
        with pytest.raises(ValueError, match="exceeds"):  # an anonymous caller is still checked
            await ctl.release(finished=1)
        with pytest.raises(ValueError, match="held"):
            await ctl.admit(1, holder="env:1", held=-1)
        return ctl.finished, ctl.in_flight, ctl.capacity()

    assert asyncio.run(restarted_controller()) == (1, 2, 1)


def test_admission_counts_the_groups_the_buffer_holds_so_a_restart_does_not_over_admit(engine, tiny_model):
    """Finished groups waiting in the buffer take admission slots. The controller asks the buffer
    rather than keeping its own tally, so a restarted controller (which kept nothing) admits
    none while they wait, and a slot returns when the trainer consumes or drops a group even if
    nobody reports it."""

    async def main():
        async with local_mesh(engine, tiny_model, async_ratio=1, groups_per_step=2) as mesh:
            client = ControllerClient(mesh.controller_client.address, holder="env:1")
            assert (await client.admit(4)).num_groups == 4  # (1 + 0 + 1) x 2
            for i in range(4):
                assert (await mesh.buffer_client.put(make_group(f"g{i}"))).accepted
            await client.release(finished=4)
            await client.close()
            buffer = BufferCounts(BufferClient(mesh.buffer_client.address))
            cfg = ControllerConfig(async_ratio=1, groups_per_step=2, initial_model_path=tiny_model, buffer_poll_s=0.1)
            restarted = AsyncController(cfg, buffer=buffer).start()
            try:
                await asyncio.sleep(0.5)
                full = restarted.capacity(), restarted.buffered
                batch = await mesh.buffer_client.get(2, 0, 1, 5.0)  # the trainer takes a step's groups
                await mesh.buffer_client.ack(batch.batch_id)
                await asyncio.sleep(0.5)
                return full, restarted.capacity()
            finally:
                await restarted.close()
                await buffer.close()

    (capacity, buffered), after_a_step = asyncio.run(main())
    assert (capacity, buffered) == (0, 4)  # a tally restored from the version alone would admit 4 more
    assert after_a_step == 2  # consumed and gone from the buffer: those slots free up before the next version


def test_engines_found_at_another_version_get_the_committed_weights(engine, tiny_model, tiny_model_b):
    """A restarted LLMProxy has no record of the last update; an engine that restarted too serves
    its initial weights. The controller notices within reconcile_s and sends the committed ones."""

    async def main():
        first, proxy = await start_proxy(ProxyConfig(engine_urls=[engine], port=0, metrics_port=0))
        address = f"127.0.0.1:{first.bound_port}"
        config = ControllerConfig(initial_model_path=tiny_model, port=0, metrics_port=0, reconcile_s=0.5)
        server, ctl, clients = await start_controller(config, address)
        update = await ctl.begin_update(3)
        await ctl.proxy.update_weights(tiny_model_b, 3)
        await ctl.commit_update(update, 3, tiny_model_b)
        await first.stop(0)  # the proxy dies, the engine comes back at its initial weights
        await proxy.close()
        await engine_client(engine).update_weights_from_disk(tiny_model, 0)
        second, proxy = await start_proxy(ProxyConfig(engine_urls=[engine], port=first.bound_port, metrics_port=0))
        gen = ProxyClient(address)
        try:
            await asyncio.sleep(3.0)
            out = await gen.generate([1, 30, 31], 4, temperature=0.0)
            return out, ctl.counters["reconciles"]
        finally:
            await gen.close()
            await server.stop(0)
            await ctl.close()
            await clients.close()
            await second.stop(0)
            await proxy.close()

    out, reconciles = asyncio.run(main())
    assert reconciles == 1 and out.weight_version == 3 and set(out.token_versions) == {3}


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_a_buffer_that_restarts_without_its_groups_is_counted_as_losing_them(backend, redis_server):
    """The in-memory buffer keeps nothing across a restart; the controller notices (the buffer's
    total of stored groups went down), counts the groups it held as lost and frees their slots.
    Redis keeps them: the same restart loses nothing."""
    extra = {"redis_url": redis_server.url, "key_prefix": f"lost:{uuid.uuid4().hex}"} if backend == "redis" else {}

    async def main():
        cfg = BufferConfig(backend=backend, port=0, metrics_port=0, filter_zero_variance=False, **extra)
        server, buf, refresh = await start_buffer_service(cfg)
        address = f"127.0.0.1:{server.bound_port}"
        counts = BufferCounts(BufferClient(address))
        ctl = AsyncController(ControllerConfig(groups_per_step=2, buffer_poll_s=0.1), buffer=counts).start()
        client = BufferClient(address)
        try:
            for i in range(3):
                assert (await client.put(make_group(f"g{i}"))).accepted
            await asyncio.sleep(0.5)
            before = ctl.buffered
            await server.stop(0)  # the buffer dies and comes back on its port
            refresh.cancel()
            await buf.close()
            server, buf, refresh = await start_buffer_service(cfg.model_copy(update={"port": server.bound_port}))
            await asyncio.sleep(1.0)
            return before, ctl.buffered, ctl.counters["buffer_lost"]
        finally:
            await client.close()
            await ctl.close()
            await counts.close()
            refresh.cancel()
            await server.stop(0)
            await buf.close()

    before, after, lost = asyncio.run(main())
    assert before == 3
    assert (after, lost) == ((0, 3) if backend == "memory" else (3, 0))


def test_an_env_manager_that_never_comes_back_loses_its_slots_after_its_lease(engine, tiny_model):
    """Slots follow their holder's reports. One that keeps reporting (``keep_lease``, as every
    EnvManager does) keeps its slots however long its episodes run; one that dies and never comes
    back under its name loses them after ``holder_lease_s``, and they are counted."""

    async def main():
        async with local_mesh(engine, tiny_model, async_ratio=1, groups_per_step=2, holder_lease_s=1.0) as mesh:
            alive = ControllerClient(mesh.controller_client.address, holder="env:alive")
            dead = ControllerClient(mesh.controller_client.address, holder="env:dead")
            other = ControllerClient(mesh.controller_client.address, holder="env:other")
            lease = asyncio.create_task(alive.keep_lease(0.2))
            try:
                granted = (await alive.admit(2)).num_groups, (await dead.admit(2)).num_groups
                await dead.close()  # dies with its 2 groups in flight
                full = (await other.admit(1)).num_groups
                await asyncio.sleep(1.5)  # past the lease: alive reported meanwhile, dead did not
                after = (await other.admit(4)).num_groups
                holders = dict(mesh.controller.holders)
                back = ControllerClient(mesh.controller_client.address, holder="env:dead")  # only cut off
                back.held = 2
                await back.admit(0)
                await back.close()
                counters = mesh.controller.counters
                return granted, full, after, holders, counters["lease_expired"], counters["lease_returned"]
            finally:
                lease.cancel()
                await alive.close()
                await other.close()

    granted, full, after, holders, expired, returned = asyncio.run(main())
    assert granted == (2, 2) and full == 0  # (1 + 0 + 1) x 2 = 4 slots, all held
    assert after == 2 and expired == 2  # the dead holder's two came back, the live one's did not
    assert holders == {"env:alive": 2, "env:other": 2}
    assert returned == 2  # a holder that reports after its lease ran out was cut off: counted apart


class _CallThatSwallowsCancel:
    """A proxy whose calls answer a cancel with an error of their own, as a cancelled RPC may."""

    def __init__(self) -> None:
        self.calls, self.swallow = 0, True

    async def served_versions(self) -> list[int]:
        self.calls += 1
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if not self.swallow:
                raise
            raise RuntimeError("the call was cancelled") from None
        return [0]


def test_closing_ends_the_reconcile_loop_even_when_the_cancel_comes_back_as_an_error():
    async def main():
        proxy = _CallThatSwallowsCancel()
        ctl = AsyncController(ControllerConfig(reconcile_s=0.01), proxy=proxy).start()
        while proxy.calls == 0:  # the loop is inside the call
            await asyncio.sleep(0.01)
        closing = asyncio.create_task(ctl.close())
        done, _ = await asyncio.wait({closing}, timeout=10)
        proxy.swallow = False  # a loop that caught the error and went on ends at its next cancel
        if not done:
            closing.cancel()
        return closing in done, proxy.calls, ctl.counters["reconcile_failures"]

    assert asyncio.run(main()) == (True, 1, 0)
