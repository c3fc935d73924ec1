"""Attacks from issue 34, reproduced against real service processes: each is refused with a clear
status, in bounded memory, and the service goes on serving."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import zlib
from pathlib import Path

import grpc
import msgpack
import pytest

from sample_buffer.codec import _PREFIX, FORMAT_VERSION, MAX_INFLATION, CodecError, decode_group, encode_group
from services.auth import AuthConfig, grpc_sync_channel
from services.pb.rollmesh.v1 import sample_buffer_pb2 as pb
from services.pb.rollmesh.v1 import sample_buffer_pb2_grpc
from services.processes import start_service_process, stop_process
from tests.sample_buffer.helpers import make_group

MiB = 1 << 20
TOKEN = [("authorization", AuthConfig().bearer())]


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM in /proc/{pid}/status")


def raw_put(size: int) -> bytes:
    """A serialized PutRequest holding one ``size``-byte group (field 1, length-delimited)."""
    prefix, n = b"\x0a", size
    while True:
        prefix += bytes([(n & 0x7F) | (0x80 if n > 0x7F else 0)])
        n >>= 7
        if not n:
            return prefix + bytes(size)


@pytest.fixture(scope="module")
def buffer_process():
    proc, address = start_service_process("sample-buffer", "buffer", ["backend=memory", "metrics_port=0"])
    yield proc, address
    stop_process(proc)


def test_a_huge_message_without_a_token_is_refused_before_it_is_received(buffer_process):
    """One 200 MiB Put took the buffer from 90 MB to 709 MB before UNAUTHENTICATED, four at once to
    1.9 GB. Now the refusal comes from the metadata and the message is never read."""
    proc, address = buffer_process
    body = raw_put(200 * MiB)
    before = peak_rss_mb(proc.pid)

    def unauthenticated_put() -> grpc.StatusCode:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 * MiB)]) as ch:
            try:
                ch.unary_unary("/rollmesh.v1.SampleBuffer/Put")(body, timeout=60)
            except grpc.RpcError as e:
                return e.code()
        return grpc.StatusCode.OK

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: unauthenticated_put(), range(4)))
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4
    grown = peak_rss_mb(proc.pid) - before
    assert grown < 50, f"the buffer's peak memory grew {grown:.0f} MiB for refused calls"
    with grpc_sync_channel(address, AuthConfig()) as ch:  # and it goes on serving
        stats = sample_buffer_pb2_grpc.SampleBufferStub(ch).Stats(pb.BufferStatsRequest(), timeout=10, metadata=TOKEN)
        assert stats.depth == 0


def test_authenticated_puts_are_received_a_bounded_number_at_a_time():
    """A token holder's burst of large Puts: one is received at a time here (max_concurrent_puts 1),
    the others are not read while they wait, and give up with RESOURCE_EXHAUSTED at their deadline."""
    proc, address = start_service_process(
        "sample-buffer",
        "buffer",
        [
            "backend=memory",
            "metrics_port=0",
            "capacity_groups=1",
            "max_concurrent_puts=1",
            "filter_zero_variance=false",
        ],
    )
    try:
        with grpc_sync_channel(address, AuthConfig()) as ch:
            stub = sample_buffer_pb2_grpc.SampleBufferStub(ch)
            group = encode_group(make_group("full"))
            assert stub.Put(pb.PutRequest(groups=[group]), timeout=10, metadata=TOKEN).results[0].accepted
            # The buffer is full: this put holds the one slot while it waits for room.
            holding = stub.Put.future(pb.PutRequest(groups=[group], timeout_s=30), timeout=40, metadata=TOKEN)
            body = raw_put(50 * MiB)
            before = peak_rss_mb(proc.pid)

            def big_put() -> tuple:
                with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 * MiB)]) as c:
                    try:
                        c.unary_unary("/rollmesh.v1.SampleBuffer/Put")(body, timeout=3, metadata=TOKEN)
                    except grpc.RpcError as e:
                        return e.code(), e.details()
                return grpc.StatusCode.OK, ""

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                results = list(pool.map(lambda _: big_put(), range(6)))
            grown = peak_rss_mb(proc.pid) - before
            for code, details in results:
                assert code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED), details
            assert any("receive slot" in d for _, d in results), results
            assert grown < 50, f"the buffer's peak memory grew {grown:.0f} MiB for puts it never read"
            # The holder gets its answer once there is room; the buffer goes on serving.
            batch = stub.Get(pb.GetRequest(num_groups=1, timeout_s=5), timeout=10, metadata=TOKEN)
            stub.Ack(pb.AckRequest(batch_id=batch.batch_id), timeout=10, metadata=TOKEN)
            assert holding.result(timeout=40).results[0].accepted
    finally:
        stop_process(proc)


def zlib_bomb(inflated: int) -> bytes:
    """An encoded group whose compressed body inflates to ``inflated`` zero bytes."""
    header = msgpack.packb({"g": "bomb", "p": "p", "v": 0, "r": [0.0, 1.0], "n": 2, "t": 0.0})
    body = zlib.compress(bytes(inflated), 9)
    return _PREFIX.pack(FORMAT_VERSION, 1, len(header)) + header + body


def test_a_zlib_bomb_is_refused_without_inflating_it():
    """611 KB on the wire took the buffer to 2.7 GB and blocked it 14 s: decompression is bounded."""
    code = (
        "import resource, sys\n"
        "from tests.services.test_hostile_input import zlib_bomb\n"
        "from sample_buffer.codec import CodecError, decode_group\n"
        "bomb = zlib_bomb(2 << 30)\n"
        "start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n"
        "    decode_group(bomb)\n"
        "except CodecError as e:\n"
        "    print(len(bomb), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - start, e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    size, grown_kb, message = out.stdout.split(" ", 2)
    assert int(size) < 3 * MiB and "inflates past" in message, out.stdout + out.stderr
    assert int(grown_kb) < 50 * 1024, f"decoding the bomb grew memory by {int(grown_kb) >> 10} MiB"


def test_a_compressed_group_within_the_bound_still_decodes():
    group = make_group("g", rewards=(0.0, 1.0, 0.5, 0.25), gen_len=512)
    data = encode_group(group, compress=True)
    assert decode_group(data).trajectories[3].token_ids.tolist() == group.trajectories[3].token_ids.tolist()
    with pytest.raises(CodecError, match=f"{MAX_INFLATION}x"):
        decode_group(zlib_bomb(64 * MiB))


def test_the_buffer_refuses_a_bomb_naming_the_field_and_keeps_serving(buffer_process):
    _, address = buffer_process
    with grpc_sync_channel(address, AuthConfig()) as ch:
        stub = sample_buffer_pb2_grpc.SampleBufferStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Put(pb.PutRequest(groups=[zlib_bomb(512 * MiB)]), timeout=30, metadata=TOKEN)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "groups" in err.value.details()
        assert "inflates past" in err.value.details()
        fine = encode_group(make_group("fine"), compress=True)
        ok = stub.Put(pb.PutRequest(groups=[fine]), timeout=30, metadata=TOKEN)
        assert ok.results[0].accepted


def test_an_engine_refuses_a_body_over_its_limit_declared_or_chunked(engine_url):
    """16 MiB for every route of the embedded engine but the weight bucket's (1 GiB): a body over it
    gets 413 naming the body, whether it declared its length or not; the engine goes on serving."""
    import httpx

    from services.auth import http_headers
    from services.wire_limits import ENGINE_MAX_BODY_BYTES

    headers = {**http_headers(AuthConfig()), "content-type": "application/json"}
    body = b" " * (ENGINE_MAX_BODY_BYTES + 1)

    def chunks():
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]

    with httpx.Client(base_url=engine_url, headers=headers, timeout=60) as c:
        declared = c.post("/generate", content=body)
        chunked = c.post("/generate", content=chunks())
        bucket = c.post("/update_weights_from_safetensors", params={"weight_version": 1}, content=body)
        ok = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
    assert declared.status_code == 413 and declared.json()["field"] == "body", declared.text
    assert chunked.status_code == 413 and "over this route's" in chunked.json()["message"], chunked.text
    assert bucket.status_code == 400, (
        bucket.text
    )  # read in full (a bucket may be 1 GiB), then refused as no safetensors
    assert ok.status_code == 200 and ok.json()["output_ids"]
