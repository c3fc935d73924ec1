"""Fuzz tests: malformed and hostile input through the real servers. Bad input never takes a service down.

Per service, hypothesis sends raw bytes (random, truncated valid messages, valid messages with unknown field
numbers, one message just over the server's receive limit) and well-formed messages with one field made hostile
(negative, huge, NaN and infinite numbers, unknown enum values, huge token lists, token ids outside the
vocabulary, corrupt group payloads): each field's edge values always, drawn ones besides. Every answer is a
success or a clean status (never UNKNOWN, INTERNAL, UNAVAILABLE or a missed deadline); an INVALID_ARGUMENT names
the field the input targeted, and a value with no meaning there (NaN, a negative count, ...) must get one;
afterwards the service still answers a normal request correctly, and the buffer still holds, byte for byte, the
groups put before the fuzzing. The engine's HTTP API gets invalid JSON, wrong types, NaN and huge lists: a 4xx
whose message names the field, never a 5xx, and it generates the same tokens afterwards.

The in-process services of this module share one uvloop event loop (the loop ``serve_until_signal`` runs them
under: NaN timeouts fail there where asyncio's loop lets them through); each example is one
``run_until_complete`` on it. The module's engine process runs offline (HF_HUB_OFFLINE): a fuzzed model_path
that looks like a Hugging Face Hub id must not wait on the network.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import re
import uuid
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import msgpack
import pytest
import torch
import uvloop
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from rollout.proxy import ProxyConfig
from sample_buffer.codec import _PREFIX, decode_group, encode_group, read_header
from sample_buffer.config import BufferConfig
from sample_buffer.deadlines import wait_for
from services.auth import AuthConfig, http_headers
from services.controller.client import ControllerClient
from services.controller.config import ControllerConfig
from services.controller.controller import MAX_VERSION
from services.controller.server import start_controller
from services.env_manager import server as env_server
from services.env_manager.config import EnvManagerConfig
from services.grpc_util import channel, start_server
from services.llm_proxy.client import ProxyClient
from services.llm_proxy.server import start_proxy
from services.pb.rollmesh.v1 import common_pb2
from services.pb.rollmesh.v1 import controller_pb2 as cpb
from services.pb.rollmesh.v1 import env_manager_pb2 as epb
from services.pb.rollmesh.v1 import llm_proxy_pb2 as pb
from services.pb.rollmesh.v1 import sample_buffer_pb2 as bpb
from services.processes import start_engine_process, stop_process
from services.sample_buffer.client import BufferClient
from services.sample_buffer.server import start_buffer_service
from services.wire_limits import PROXY_MAX_MESSAGE_BYTES, SAMPLE_BUFFER_MAX_PUT_BYTES
from tests.engines import TEST_LOAD_ROOTS
from tests.sample_buffer.helpers import make_group
from tests.services.mesh import local_mesh

OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT
# Answers a service may give to bad input. UNKNOWN / INTERNAL (an unhandled exception), UNAVAILABLE (an engine
# or backend knocked out) and DEADLINE_EXCEEDED (a hang) all fail the test.
# NOT_FOUND: an id that names nothing (an environment provider's episode).
CLEAN = {
    OK,
    INVALID,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.NOT_FOUND,
}
GRPC_DEFAULT_LIMIT = 4 << 20  # a server's receive limit unless it sets grpc.max_receive_message_length
INT32 = st.integers(-(2**31), 2**31 - 1)
INT64 = st.integers(-(2**63), 2**63 - 1)
NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])
DOUBLES, FLOATS = st.floats(), st.floats(width=32)  # any double / float32 (the proto's float fields)
# The edges always tried: NaN, +-inf, +-0, negative, the smallest and the largest magnitudes.
FLOAT32_MIN, FLOAT32_MAX = 1.401298464324817e-45, 3.4028234663852886e38  # smallest subnormal, largest normal
FLOAT_EDGES = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-7, FLOAT32_MIN, -FLOAT32_MIN, FLOAT32_MAX]
DOUBLE_EDGES = [math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e-7, 5e-324, -5e-324, 1e308]
INT32_EDGES, INT64_EDGES = [-(2**31), -1, 0, 2**31 - 1], [-(2**63), -1, 0, 2**63 - 1]
# Safetensors payloads no engine takes: a parameter in the wrong shape, one the model lacks, none.
BAD_BUCKETS = [save({"model.embed_tokens.weight": torch.zeros(2)}), save({"no.such.parameter": torch.zeros(2)}), b""]


def fuzz(max_examples: int):
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
    )


def case(values: st.SearchStrategy, build=None, edges=()) -> tuple:
    """One field's hostile values: drawn ones, and ``edges`` that are always tried; ``build`` makes a value into
    what the test sends."""
    return values, build or (lambda v: v), list(edges)


def fuzz_each(cases: dict[str, tuple], run_one, max_examples: int) -> None:
    """``run_one(name, build(value))`` on every edge and ``max_examples`` drawn values of each case: every field
    gets its share."""
    for name, (values, build, edges) in cases.items():

        def run(drawn):
            name, build, value = drawn
            run_one(name, build(value))

        for edge in edges:
            run = example(drawn=(name, build, edge))(run)
        fuzz(max_examples)(given(drawn=st.tuples(st.just(name), st.just(build), values))(run))()


def bad_timeout(value: float) -> bool:
    """A timeout no service can honour: NaN, infinite or negative (SampleBuffer.Get takes a negative one as 0)."""
    return not math.isfinite(value) or value < 0


class Loop:
    """The module's event loop: the services live on it, ``run`` drives one coroutine to completion."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()

    def run(self, coro, timeout_s: float = 120.0):
        return self.loop.run_until_complete(wait_for(coro, timeout_s))

    def close(self) -> None:
        async def cancel_the_rest():
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.loop.run_until_complete(cancel_the_rest())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


@pytest.fixture(scope="module")
def aio():
    loop = Loop()
    yield loop
    loop.close()


# ---------------------------------------------------------------------------------------------- gRPC helpers
async def call(ch: grpc.aio.Channel, method: str, raw: bytes, timeout_s: float = 60.0):
    """One unary call with raw request bytes (no serializer): (code, details, response bytes)."""
    try:
        return OK, "", await ch.unary_unary(method)(raw, timeout=timeout_s)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or "", b""


def check(
    code: grpc.StatusCode,
    details: str,
    field: str | tuple[str, ...] | None = None,
    what: object = "",
    refuse: bool = False,
) -> None:
    """A clean answer; an INVALID_ARGUMENT says what is wrong and, where the input targeted one, names the field.
    ``refuse``: the value has no meaning there (NaN, a negative count, ...), so it must be an INVALID_ARGUMENT."""
    assert code in CLEAN, f"{what}: {code.name}: {details}"
    assert code == INVALID or not refuse, f"{what}: {code.name}, not refused"
    if code == INVALID:
        assert details, f"{what}: INVALID_ARGUMENT without details"
        names = (field,) if isinstance(field, str) else field or ()
        assert not names or any(n in details for n in names), f"{what}: {details!r} does not name {names}"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def _record(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def unknown_field(cls) -> st.SearchStrategy[tuple[int, bytes]]:
    """(number, one encoded field the message type does not define), in any wire type."""
    known = {f.number for f in cls.DESCRIPTOR.fields}
    payload = st.one_of(
        st.integers(0, 2**64 - 1).map(lambda v: (0, _varint(v))),
        st.binary(min_size=8, max_size=8).map(lambda b: (1, b)),
        st.binary(max_size=32).map(lambda b: (2, _varint(len(b)) + b)),
        st.binary(min_size=4, max_size=4).map(lambda b: (5, b)),
    )
    number = st.integers(1, 2**29 - 1).filter(lambda n: n not in known)
    return st.tuples(number, payload).map(lambda t: (t[0], _record(t[0], *t[1])))


@st.composite
def raw_requests(draw, valid) -> tuple[bytes, str | None]:
    """Bytes for a method taking ``type(valid)``, and the detail an INVALID_ARGUMENT must then carry (None: the
    bytes may even be a valid request)."""
    cls, base = type(valid), valid.SerializeToString()
    name = cls.DESCRIPTOR.name
    kind = draw(st.sampled_from(["random", "truncated", "tail", "unknown", "nested"]))
    if kind == "random":
        return draw(st.binary(max_size=256)), None
    if kind == "truncated":
        return base[: draw(st.integers(0, max(len(base) - 1, 0)))], None
    if kind == "tail":
        return base + draw(st.binary(min_size=1, max_size=16)), None
    nested = [f for f in cls.DESCRIPTOR.fields if f.message_type is not None and not f.is_repeated]
    if kind == "nested" and nested:  # an unknown field inside a sub-message
        f = draw(st.sampled_from(nested))
        number, extra = draw(unknown_field(type(getattr(valid, f.name))))
        raw = base + _record(f.number, 2, _varint(len(extra)) + extra)
        return raw, f"{name}.{f.name}: unknown field number {number}"
    number, extra = draw(unknown_field(cls))
    return base + extra, f"{name}: unknown field number {number}"


def waits_long(cls, raw: bytes) -> bool:
    """A well-formed request asking to wait longer than a test call: not hostile, just slow."""
    try:
        msg = cls.FromString(raw)
    except Exception:
        return False
    timeout = getattr(msg, "timeout_s", 0.0)
    return math.isfinite(timeout) and timeout > 5


async def raw_call(ch, service: str, method: str, raw: bytes, expect: str | None, undo=None) -> tuple:
    """``undo(response bytes)``: what to do after a success (resume, stop, ...), first, so that a failed check
    leaves nothing behind for the next example."""
    code, details, out = await call(ch, f"/rollmesh.v1.{service}/{method}", raw)
    if code == OK and undo is not None:
        await undo(out)
    check(code, details, what=f"{method} {raw[:80]!r}")
    if expect is not None:
        assert code == INVALID and expect in details, f"{method}: {code.name} {details!r}, expected {expect!r}"
    return code, out


async def assert_oversized_refused(ch, service: str, method: str, limit: int, field_number: int) -> None:
    """One length-delimited field just big enough to put the message over the server's receive limit."""
    n = limit + 1
    raw = _record(field_number, 2, _varint(n) + bytes(n))
    code, details, _ = await call(ch, f"/rollmesh.v1.{service}/{method}", raw)
    del raw
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details, (code, details)


def fuzz_unary_methods(aio, ch, service: str, methods: dict, max_examples: int, undo=None, after=None) -> None:
    """Malformed bytes for each unary method of ``methods`` (name: a valid request), ``max_examples`` in all.
    ``undo(method)``: the ``raw_call`` undo for that method (or None); ``after(method, code, response)``: more
    checks on what came back."""

    @fuzz(max_examples)
    @given(data=st.data())
    def run(data):
        method = data.draw(st.sampled_from(sorted(methods)))
        valid = methods[method]
        raw, expect = data.draw(raw_requests(valid))
        assume(not waits_long(type(valid), raw))
        code, out = aio.run(raw_call(ch, service, method, raw, expect, undo(method) if undo else None))
        if after is not None:
            after(method, code, out)

    run()


# ---------------------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def engine(tiny_model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        proc, url = start_engine_process(tiny_model, extra=TEST_LOAD_ROOTS)
    info = get(url, "/model_info").json()
    yield SimpleNamespace(url=url, vocab=info["vocab_size"], context=info["max_context_length"])
    stop_process(proc)
    _http().close()
    _http.cache_clear()


@pytest.fixture(scope="module")
def model_paths(tiny_model, tmp_path_factory) -> list[str]:
    """Directories an update may be pointed at: none, a file, empty, a config without weights, corrupt ones."""
    root = tmp_path_factory.mktemp("models")
    config = (Path(tiny_model) / "config.json").read_text()
    paths = {
        "empty": root / "empty",
        "config_only": root / "config_only",
        "garbage": root / "garbage",
        "bad_config": root / "bad_config",
    }
    for p in paths.values():
        p.mkdir()
    (paths["config_only"] / "config.json").write_text(config)
    (paths["garbage"] / "config.json").write_text(config)
    (paths["garbage"] / "model.safetensors").write_bytes(b"\x07" * 64)
    (paths["bad_config"] / "config.json").write_text('{"model_type": "qwen2", "vocab_size": "many"}')
    (root / "file").write_text("not a model")
    return [tiny_model, "", str(root / "missing"), str(root / "file"), *map(str, paths.values()), "..", "\x00"]


def model_path_values(paths: list[str]) -> st.SearchStrategy[str]:
    # Absolute: a relative name could be a Hub id (offline here, but it is not what is being fuzzed).
    return st.one_of(st.sampled_from(paths), st.text(max_size=40).map(lambda t: "/" + t))


# ---------------------------------------------------------------------------------------------- LLMProxy
GREEDY_PROMPT = [1, 40, 41]


@pytest.fixture(scope="module")
def proxy(aio, engine):
    async def start():
        config = ProxyConfig(engine_urls=[engine.url], port=0, metrics_port=0, health_check_interval_s=0.2)
        server, core = await start_proxy(config)
        address = f"127.0.0.1:{server.bound_port}"
        ns = SimpleNamespace(
            server=server, core=core, address=address, channel=channel(address), client=ProxyClient(address)
        )
        ns.reference = list((await greedy(ns.client)).output_ids)
        return ns

    async def stop(ns):
        await ns.client.close()
        await ns.channel.close()
        await ns.server.stop(0)
        await ns.core.close()

    ns = aio.run(start())
    yield ns
    aio.run(stop(ns))


async def greedy(client: ProxyClient) -> pb.GenerateResponse:
    return await client.generate(GREEDY_PROMPT, 8, temperature=0.0, ignore_eos=True, timeout_s=60)


async def proxy_serves(px) -> None:
    """Engines a too-short control timeout took out of rotation are back after a few health checks; then the
    proxy generates what it generated before the fuzzing."""
    for _ in range(100):
        if all(e.healthy for e in (await px.client.stats()).engines):
            break
        await asyncio.sleep(0.1)
    assert all(e.healthy for e in (await px.client.stats()).engines)
    await px.client.resume(timeout_s=10)
    res = await greedy(px.client)
    assert list(res.output_ids) == px.reference and res.finish_reason == common_pb2.FINISH_REASON_LENGTH


PROXY_METHODS = {
    "Generate": pb.GenerateRequest(
        input_ids=GREEDY_PROMPT, timeout_s=30, sampling_params=pb.SamplingParams(max_new_tokens=2, temperature=0.0)
    ),
    "Abort": pb.AbortRequest(request_id="nobody"),
    "Suspend": pb.SuspendRequest(mode=pb.SUSPEND_MODE_IN_PLACE, timeout_s=5),
    "Resume": pb.ResumeRequest(timeout_s=5),
    "UpdateWeights": pb.UpdateWeightsRequest(model_path="/nonexistent/model", weight_version=1, timeout_s=5),
    "UpdateWeightsBucket": pb.WeightBucket(weight_version=1, index=0, safetensors=b"\x07" * 8, timeout_s=5),
    "Stats": pb.StatsRequest(),
}


def test_llm_proxy_answers_malformed_bytes_cleanly(aio, proxy):
    def undo(method):
        return (lambda out: proxy.client.resume(timeout_s=10)) if method == "Suspend" else None

    fuzz_unary_methods(aio, proxy.channel, "LLMProxy", PROXY_METHODS, 40, undo)
    # Weight buckets arrive in pieces: no message to the proxy is larger than PROXY_MAX_MESSAGE_BYTES.
    limit = PROXY_MAX_MESSAGE_BYTES
    aio.run(assert_oversized_refused(proxy.channel, "LLMProxy", "UpdateWeightsBucket", limit, field_number=3))
    aio.run(proxy_serves(proxy))


def generate_request(field: str, value, ids=GREEDY_PROMPT, max_new_tokens: int = 2) -> pb.GenerateRequest:
    """A valid small request with ``field`` set to ``value``."""
    req = pb.GenerateRequest(
        input_ids=ids, timeout_s=30, sampling_params=pb.SamplingParams(max_new_tokens=max_new_tokens)
    )
    sp = req.sampling_params  # the request's own (a message given to a constructor is copied)
    if field == "input_ids":
        del req.input_ids[:]
        req.input_ids.extend(value)
    elif field == "sampling_params.stop_token_ids":
        sp.stop_token_ids.extend(value)
    elif field.startswith("sampling_params."):
        setattr(sp, field.split(".")[1], value)
    else:
        setattr(req, field, value)
    return req


def generate_cases(vocab: int, context: int) -> dict[str, tuple]:
    token = st.integers(0, vocab - 1)
    outside = st.one_of(st.integers(-(2**31), -1), st.integers(vocab, 2**31 - 1))
    hostile = {  # field: (drawn values, edges)
        "input_ids": (
            st.one_of(
                st.tuples(st.lists(token, max_size=4), outside, st.lists(INT32, max_size=4)).map(
                    lambda t: [*t[0], t[1], *t[2]]
                ),
                st.integers(context, 100_000).map(lambda n: [1] * n),  # more than the model's context
            ),
            [[], [vocab], [-1], [2**31 - 1], [1] * context],
        ),
        "sampling_params.max_new_tokens": (
            st.one_of(st.integers(-(2**31), 0), st.integers(context, 2**31 - 1)),
            [0, -1, -(2**31), context, 2**31 - 1],
        ),
        "sampling_params.temperature": (FLOATS, FLOAT_EDGES),
        "sampling_params.top_p": (FLOATS, FLOAT_EDGES),
        "sampling_params.top_k": (INT32, INT32_EDGES),
        "sampling_params.stop_token_ids": (st.lists(INT32, min_size=1, max_size=20), [[-1], [vocab], [2**31 - 1]]),
        "sampling_params.sampling_seed": (INT64, INT64_EDGES),
        "timeout_s": (DOUBLES, DOUBLE_EDGES),
        "request_id": (st.text(max_size=200), ["\x00" * 1000]),
        "route": (st.text(max_size=200), ["x" * 10_000]),
    }
    base = st.tuples(st.lists(token, min_size=1, max_size=8), st.integers(1, 2))  # prompt, max_new_tokens
    return {
        field: case(
            st.tuples(values, base),
            lambda v, f=field: generate_request(f, v[0], *v[1]),
            [(e, (GREEDY_PROMPT, 2)) for e in edges],
        )
        for field, (values, edges) in hostile.items()
    }


def must_refuse_generate(req: pb.GenerateRequest, field: str, vocab: int) -> bool:
    sp = req.sampling_params
    return {
        "input_ids": True,  # every hostile list drawn is empty, outside the vocabulary or beyond the context
        "sampling_params.max_new_tokens": True,  # <= 0, or no room left in the context
        "sampling_params.temperature": not sp.temperature >= 0,  # NaN too
        "sampling_params.top_p": not 0 < sp.top_p <= 1,
        "sampling_params.stop_token_ids": any(not 0 <= t < vocab for t in sp.stop_token_ids),
        "timeout_s": bad_timeout(req.timeout_s),
    }.get(field, False)


def test_llm_proxy_generate_with_hostile_values(aio, proxy, engine):
    async def one(req, field):
        code, details, out = await call(proxy.channel, "/rollmesh.v1.LLMProxy/Generate", req.SerializeToString())
        check(
            code,
            details,
            field,
            what=f"{field}: {str(req)[:300]}",
            refuse=must_refuse_generate(req, field, engine.vocab),
        )
        if code == OK:
            res = pb.GenerateResponse.FromString(out)
            assert len(res.output_ids) <= req.sampling_params.max_new_tokens
            assert all(0 <= t < engine.vocab for t in res.output_ids)
            assert len(res.behavior_logprobs) == len(res.output_ids) == len(res.token_versions)
            assert all(math.isfinite(lp) and lp <= 0 for lp in res.behavior_logprobs)
            assert not req.request_id or res.request_id == req.request_id
            # Nobody aborts here, and two tokens take milliseconds: an abort is an engine error, a missed 30 s
            # deadline a request the engine lost.
            ended = {common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH}
            if field == "timeout_s":
                ended.add(common_pb2.FINISH_REASON_TIMEOUT)
            assert res.finish_reason in ended, res

    fuzz_each(generate_cases(engine.vocab, engine.context), lambda field, req: aio.run(one(req, field)), 2)
    aio.run(proxy_serves(proxy))


def proxy_control_cases(paths: list[str]) -> dict[str, tuple]:
    """Suspend / Resume / Abort / UpdateWeights / UpdateWeightsBucket, each with one field made hostile."""
    valid_model, bucket = paths[0], st.one_of(st.binary(max_size=64), st.sampled_from(BAD_BUCKETS))
    modes = sorted(pb.SuspendMode.values())
    return {
        "Suspend.mode": case(INT32, lambda m: pb.SuspendRequest(mode=m, timeout_s=5), [-1, len(modes), *INT32_EDGES]),
        "Suspend.timeout_s": case(
            st.tuples(st.sampled_from(modes), DOUBLES),
            lambda v: pb.SuspendRequest(mode=v[0], timeout_s=v[1]),
            [(pb.SUSPEND_MODE_CONTINUE, t) for t in DOUBLE_EDGES],
        ),
        "Resume.timeout_s": case(DOUBLES, lambda t: pb.ResumeRequest(timeout_s=t), DOUBLE_EDGES),
        "Abort.request_id": case(
            st.tuples(st.text(max_size=50), st.booleans()),
            lambda v: pb.AbortRequest(request_id=v[0], abort_all=v[1]),
            [("", False), ("", True)],
        ),
        "UpdateWeights.model_path": case(
            model_path_values(paths),
            lambda p: pb.UpdateWeightsRequest(model_path=p, weight_version=7, timeout_s=30),
            paths,
        ),
        "UpdateWeights.weight_version": case(
            INT64,
            lambda v: pb.UpdateWeightsRequest(model_path=valid_model, weight_version=v, timeout_s=30),
            INT64_EDGES,
        ),
        "UpdateWeights.timeout_s": case(
            DOUBLES,
            lambda t: pb.UpdateWeightsRequest(model_path="/nonexistent", weight_version=7, timeout_s=t),
            DOUBLE_EDGES,
        ),
        "UpdateWeightsBucket.index": case(
            st.tuples(INT32, bucket),
            lambda v: pb.WeightBucket(weight_version=7, index=v[0], safetensors=v[1], timeout_s=30),
            [(i, b"") for i in INT32_EDGES],
        ),
        "UpdateWeightsBucket.safetensors": case(
            st.tuples(bucket, st.booleans()),
            lambda v: pb.WeightBucket(
                weight_version=7, safetensors=v[0], final=v[1], restore_path=valid_model, timeout_s=30
            ),
            [(b, True) for b in BAD_BUCKETS],
        ),
        "UpdateWeightsBucket.restore_path": case(
            model_path_values(paths),
            lambda p: pb.WeightBucket(weight_version=7, final=True, restore_path=p, timeout_s=30),
            ["", "\x00"],
        ),
        "UpdateWeightsBucket.weight_version": case(
            INT64, lambda v: pb.WeightBucket(weight_version=v, timeout_s=30), INT64_EDGES
        ),
        "UpdateWeightsBucket.timeout_s": case(
            DOUBLES, lambda t: pb.WeightBucket(weight_version=7, timeout_s=t), DOUBLE_EDGES
        ),
    }


def must_refuse_control(method: str, req, field: str, under_way) -> bool:
    """``under_way``: the proxy's in-memory update in progress (bucket 0 of one may have been accepted)."""
    if field == "timeout_s":
        return bad_timeout(req.timeout_s)
    if field == "index":  # bucket 0 starts an update; any other must continue the one under way
        return req.index != 0 and not (
            under_way and (under_way.version, under_way.next_index) == (req.weight_version, req.index)
        )
    return {
        "mode": method == "Suspend" and req.mode not in pb.SuspendMode.values(),
        "request_id": method == "Abort" and not req.request_id and not req.abort_all,
        "model_path": not getattr(req, "model_path", True),
        "restore_path": method == "UpdateWeightsBucket" and req.final and not req.restore_path,
    }.get(field, False)


def test_llm_proxy_control_and_weight_updates_with_hostile_values(aio, proxy, model_paths):
    async def one(name: str, req):
        method, field = name.split(".")
        refuse = must_refuse_control(method, req, field, proxy.core.updates.bucket_update)
        code, details, out = await call(proxy.channel, f"/rollmesh.v1.LLMProxy/{method}", req.SerializeToString())
        if code == OK and method == "Suspend":
            await proxy.client.resume(timeout_s=10)  # first: a failed check must not leave the proxy suspended
        check(code, details, field, what=f"{method} {str(req)[:300]}", refuse=refuse)
        if code == OK and method.startswith("UpdateWeights"):
            res = pb.UpdateWeightsResponse.FromString(out)
            assert res.engines and all(e.success or e.message for e in res.engines)

    fuzz_each(proxy_control_cases(model_paths), lambda name, req: aio.run(one(name, req)), max_examples=3)
    aio.run(proxy_serves(proxy))


# ---------------------------------------------------------------------------------------------- SampleBuffer
VISIBILITY_S = 0.3  # groups a fuzzed Get takes come back after this
# Stored before the fuzzing and checked byte for byte after it. At the newest version a trajectory can record
# (token versions are int32), so no Get of a trainer at a version the mesh can reach drops them as stale.
KEPT_VERSION = 2**31 - 1


@pytest.fixture(scope="module", params=["memory", "redis"])
def buffer(request, aio):
    extra = {}
    if request.param == "redis":
        extra = {"redis_url": request.getfixturevalue("redis_server").url, "key_prefix": f"fuzz:{uuid.uuid4().hex}"}
    config = BufferConfig(backend=request.param, port=0, metrics_port=0, visibility_timeout_s=VISIBILITY_S, **extra)

    async def start():
        server, core, refresh = await start_buffer_service(config)
        address = f"127.0.0.1:{server.bound_port}"
        ns = SimpleNamespace(
            server=server, core=core, refresh=refresh, channel=channel(address), client=BufferClient(address)
        )
        ns.kept = {f"kept-{i}": encode_group(make_group(f"kept-{i}", version=KEPT_VERSION)) for i in range(3)}
        assert all(r.accepted for r in await ns.client.put_many(list(ns.kept.values())))
        return ns

    async def stop(ns):
        ns.refresh.cancel()
        await ns.client.close()
        await ns.channel.close()
        await ns.server.stop(0)
        await ns.core.close()

    ns = aio.run(start())
    yield ns
    aio.run(stop(ns))


async def kept_groups_intact(buf) -> None:
    """Every group stored before the fuzzing comes back, byte for byte; nothing stored turned out corrupt."""
    await asyncio.sleep(VISIBILITY_S)
    found: dict[str, bytes] = {}
    for _ in range(20):
        batch = await buf.client.get(100_000, version=KEPT_VERSION, max_staleness=2**62, timeout_s=0.5)
        found |= {read_header(d).group_id: d for d in batch.groups}
        if buf.kept.keys() <= found.keys():
            break
    for gid, data in buf.kept.items():
        assert found.get(gid) == data, f"{gid} lost or changed"
    assert (await buf.client.stats()).dropped_by_reason["corrupt"] == 0


BUFFER_METHODS = {
    "Put": bpb.PutRequest(groups=[encode_group(make_group("raw", version=3))], timeout_s=1),
    "Get": bpb.GetRequest(num_groups=1, version=3, max_staleness=1, timeout_s=0.01),
    "Ack": bpb.AckRequest(batch_id="nobody"),
    "Requeue": bpb.RequeueRequest(),
    "Stats": bpb.BufferStatsRequest(),
}


def test_sample_buffer_answers_malformed_bytes_cleanly(aio, buffer):
    def after(method, code, out):
        if code == OK and method == "Ack":
            assert bpb.AckResponse.FromString(out).num_acked == 0  # no batch of that id was handed out

    fuzz_unary_methods(aio, buffer.channel, "SampleBuffer", BUFFER_METHODS, 30, after=after)
    aio.run(
        assert_oversized_refused(buffer.channel, "SampleBuffer", "Put", SAMPLE_BUFFER_MAX_PUT_BYTES, field_number=1)
    )
    aio.run(kept_groups_intact(buffer))


# msgpack values of every kind, out-of-range and non-finite numbers included.
MSGPACK_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(-3, 3), max_size=2),
)
HEADER_KEYS = ["g", "p", "v", "r", "n", "t"]


def _unpack(data: bytes) -> tuple[dict, list]:
    _, _, hlen = _PREFIX.unpack_from(data)
    return msgpack.unpackb(data[_PREFIX.size : _PREFIX.size + hlen]), msgpack.unpackb(data[_PREFIX.size + hlen :])


def _pack(header, body, flags: int = 0) -> bytes:
    h = msgpack.packb(header)
    return _PREFIX.pack(1, flags, len(h)) + h + msgpack.packb(body)


# How a group's bytes get damaged; the damage of the ``ALWAYS_INVALID`` kinds never leaves a valid group.
CORRUPTIONS = [
    "random",
    "truncated",
    "flipped",
    "tail",
    "prefix",
    "header",
    "header_number",
    "body",
    "body_number",
    "disagree",
    "not_zlib",
    "empty",
]
ALWAYS_INVALID = {"truncated", "header_number", "body_number", "disagree", "not_zlib", "empty"}


@st.composite
def corrupt_group(draw, kind: str) -> bytes:
    group = make_group(f"fz-{draw(st.integers(0, 10**6))}", version=draw(st.integers(0, 5)))
    good = encode_group(group, compress=draw(st.booleans()))
    header, body = _unpack(encode_group(group))
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "truncated":
        return good[: draw(st.integers(0, len(good) - 1))]
    if kind == "flipped":
        flips = st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)), min_size=1, max_size=4)
        data = bytearray(good)
        for i, v in draw(flips):
            data[i] ^= v
        return bytes(data)
    if kind == "tail":
        return good + draw(st.binary(min_size=1, max_size=32))
    if kind == "prefix":  # format version, flags, header length
        version, flags, hlen = draw(st.integers(0, 255)), draw(st.integers(0, 255)), draw(st.integers(0, 2**32 - 1))
        return _PREFIX.pack(version, flags, hlen) + good[_PREFIX.size :]
    if kind == "header":  # a value of any type, or none
        key = draw(st.sampled_from(HEADER_KEYS))
        if draw(st.booleans()):
            header[key] = draw(MSGPACK_VALUES)
        else:
            del header[key]
        return _pack(draw(st.one_of(st.just(header), MSGPACK_VALUES)), body)
    if kind == "header_number":  # NaN or infinity where the header holds a version, a count or rewards
        key, value = draw(st.sampled_from(["v", "n", "r"])), draw(NON_FINITE)
        header[key] = [value] * len(body) if key == "r" else value
        return _pack(header, body)
    if kind == "body":
        row, col = draw(st.integers(0, len(body) - 1)), draw(st.integers(0, 11))
        if col == 11:
            body[row] = body[row][: draw(st.integers(0, 10))]  # a row cut short
        else:
            body[row][col] = draw(MSGPACK_VALUES)
        return _pack(header, draw(st.one_of(st.just(body), MSGPACK_VALUES)))
    if kind == "body_number":  # NaN or infinity as a trajectory's reward or start version
        body[draw(st.integers(0, len(body) - 1))][draw(st.sampled_from([6, 7]))] = draw(NON_FINITE)
        return _pack(header, body)
    if kind == "disagree":  # a header that disagrees with the trajectories it describes
        if draw(st.booleans()):
            header["v"] += draw(st.integers(1, 2**31)) * draw(st.sampled_from([1, -1]))
        else:
            rewards = st.lists(st.floats(allow_nan=False), min_size=len(body), max_size=len(body))
            header["r"] = draw(rewards.filter(lambda r: r != header["r"]))
        return _pack(header, body)
    if kind == "empty":  # no trajectories, and a header that agrees
        return _pack({**header, "n": 0, "r": []}, [])
    return _pack(header, body, flags=1)  # says zlib, is not


@st.composite
def put_with(draw, kind: str) -> tuple[bpb.PutRequest, bool]:
    """(a Put of damaged groups, with or beside a valid one; whether it must be refused)."""
    valid = encode_group(make_group(f"ok-{draw(st.integers(0, 10**6))}", version=draw(st.integers(0, 5))))
    groups = draw(st.lists(corrupt_group(kind), min_size=1, max_size=2))
    if draw(st.booleans()):
        groups.insert(draw(st.integers(0, len(groups))), valid)
    return bpb.PutRequest(groups=groups, timeout_s=1), kind in ALWAYS_INVALID


def buffer_cases() -> dict[str, tuple]:
    """Each case makes (request, whether it must be refused)."""
    valid = encode_group(make_group("ok-timeout", version=2))
    small = {"num_groups": 2, "version": 3, "max_staleness": 1, "timeout_s": 0.01}
    # version: no trainer is at a version newer than a token can record (see KEPT_VERSION). timeout_s: a
    # long one is a valid request to wait.
    hostile = {
        "num_groups": (INT32, INT32_EDGES),
        "version": (st.integers(-(2**63), KEPT_VERSION), [-(2**63), -1, KEPT_VERSION]),
        "max_staleness": (INT64, INT64_EDGES),
        "timeout_s": (st.one_of(NON_FINITE, st.floats(max_value=0.05)), [t for t in DOUBLE_EDGES if t != 1e308]),
    }

    def get(kw: dict) -> tuple:
        kw = {**small, **kw}
        refuse = kw["num_groups"] < 1 or kw["max_staleness"] < 0 or not math.isfinite(kw["timeout_s"])
        return bpb.GetRequest(**kw), refuse

    cases = {f"Put.groups.{kind}": case(put_with(kind)) for kind in CORRUPTIONS}
    cases["Put.timeout_s"] = case(
        st.one_of(NON_FINITE, st.floats(max_value=-1e-300), st.floats(0, 1)),
        lambda t: (bpb.PutRequest(groups=[valid], timeout_s=t), bad_timeout(t)),
        DOUBLE_EDGES,
    )
    cases |= {
        f"Get.{field}": case(values.map(lambda v, f=field: {f: v}), get, [{field: e} for e in edges])
        for field, (values, edges) in hostile.items()
    }
    cases["Ack.batch_id"] = case(
        st.text(max_size=40), lambda b: (bpb.AckRequest(batch_id=b), not b), ["", "\x00", "x" * 1000]
    )
    return cases


def test_sample_buffer_with_hostile_values_and_corrupt_groups(aio, buffer):
    async def put(req, field, refuse):
        before = (await buffer.client.stats()).put_total
        code, details, out = await call(buffer.channel, "/rollmesh.v1.SampleBuffer/Put", req.SerializeToString())
        check(code, details, field, what=f"Put {[g[:60] for g in req.groups]} {req.timeout_s}", refuse=refuse)
        after = (await buffer.client.stats()).put_total
        if code == OK:
            results = bpb.PutResponse.FromString(out).results
            assert len(results) == len(req.groups) and after - before == sum(r.accepted for r in results)
        else:
            assert after == before, "a refused Put stored something"

    async def get(req, field, refuse):
        code, details, out = await call(buffer.channel, "/rollmesh.v1.SampleBuffer/Get", req.SerializeToString())
        check(code, details, field, what=str(req), refuse=refuse)
        for data in bpb.GetResponse.FromString(out).groups if code == OK else []:
            group = decode_group(data)  # only groups that were checked on the way in are handed out
            assert group.group_id not in buffer.kept or buffer.kept[group.group_id] == data

    async def ack(req, field, refuse):
        code, details, out = await call(buffer.channel, "/rollmesh.v1.SampleBuffer/Ack", req.SerializeToString())
        check(code, details, field, what=repr(req.batch_id), refuse=refuse)
        assert code != OK or bpb.AckResponse.FromString(out).num_acked == 0  # no batch of that id was handed out

    def one(name: str, built: tuple) -> None:
        method, field = name.split(".")[:2]
        request, refuse = built
        aio.run({"Put": put, "Get": get, "Ack": ack}[method](request, field, refuse))

    fuzz_each(buffer_cases(), one, max_examples=4)
    aio.run(kept_groups_intact(buffer))


# ---------------------------------------------------------------------------------------------- AsyncController
@pytest.fixture(scope="module")
def controller(aio, proxy, tiny_model):
    async def start():
        config = ControllerConfig(port=0, metrics_port=0, initial_model_path=tiny_model, update_timeout_s=30)
        server, core, proxy_client = await start_controller(config, proxy.address)
        address = f"127.0.0.1:{server.bound_port}"
        return SimpleNamespace(
            server=server,
            core=core,
            proxy_client=proxy_client,
            channel=channel(address),
            client=ControllerClient(address),
            model=tiny_model,
        )

    async def stop(ns):
        await ns.client.close()
        await ns.channel.close()
        await ns.server.stop(0)
        await ns.core.close()
        await ns.proxy_client.close()

    ns = aio.run(start())
    yield ns
    aio.run(stop(ns))


async def controller_call(ctl, method: str, req, field=None, refuse: bool = False, undo=None):
    """``undo(code, response bytes)`` runs before the checks: a failed one must leave no update under way."""
    code, details, out = await call(ctl.channel, f"/rollmesh.v1.AsyncController/{method}", req.SerializeToString())
    if undo is not None:
        await undo(code, out)
    check(code, details, field, what=f"{method} {str(req)[:200]}", refuse=refuse)
    return code, out


async def current_version(ctl) -> int:
    code, out = await controller_call(ctl, "Admit", cpb.AdmitRequest(num_groups=0))
    assert code == OK
    return cpb.AdmitResponse.FromString(out).version


async def end_update(ctl, update_id: str, commit_version: int | None = None) -> None:
    """Commit (at ``commit_version``) or abort an update; the watchdog may have rolled it back already."""
    if commit_version is not None:
        req = cpb.CommitUpdateRequest(update_id=update_id, version=commit_version, model_path=ctl.model)
        code, _ = await controller_call(ctl, "CommitUpdate", req)
    else:
        code, _ = await controller_call(ctl, "AbortUpdate", cpb.AbortUpdateRequest(update_id=update_id))
    assert code in (OK, grpc.StatusCode.FAILED_PRECONDITION)


async def controller_serves(ctl) -> None:
    version = await current_version(ctl)
    admitted = await ctl.client.admit(1)
    assert admitted.version == version and 0 <= admitted.num_groups <= 1
    await ctl.client.release(unused=admitted.num_groups)
    if version < MAX_VERSION:  # a fuzzed update may have committed the last version there is
        update_id = await ctl.client.begin_update(version + 1, timeout_s=30)
        assert await ctl.client.commit_update(update_id, version + 1, ctl.model) == version + 1
        assert (await ctl.client.limits()).version == version + 1
    assert not ctl.core.counters["resume_failures"]


CONTROLLER_METHODS = {
    "Admit": cpb.AdmitRequest(num_groups=1),
    "Release": cpb.ReleaseRequest(num_groups=0),
    "BeginUpdate": cpb.BeginUpdateRequest(timeout_s=5),  # new_version 0: never a new one
    "CommitUpdate": cpb.CommitUpdateRequest(update_id="nobody", version=1, model_path="/nonexistent"),
    "AbortUpdate": cpb.AbortUpdateRequest(update_id="nobody", reason="fuzz"),
}


def test_async_controller_answers_malformed_bytes_cleanly(aio, controller):
    async def watch(raw: bytes, expect: str | None):
        stream = controller.channel.unary_stream("/rollmesh.v1.AsyncController/WatchVersion")(raw, timeout=30)
        try:
            first = await stream.read()
            assert first is not grpc.aio.EOF and expect is None
        except grpc.aio.AioRpcError as e:
            check(e.code(), e.details() or "", what=f"WatchVersion {raw[:80]!r}")
            assert expect is None or (e.code() == INVALID and expect in (e.details() or ""))
        finally:
            stream.cancel()

    @fuzz(30)
    @given(data=st.data())
    def run(data):
        method = data.draw(st.sampled_from([*sorted(CONTROLLER_METHODS), "WatchVersion"]))
        valid = CONTROLLER_METHODS.get(method, cpb.WatchVersionRequest())
        raw, expect = data.draw(raw_requests(valid))
        if method == "WatchVersion":
            aio.run(watch(raw, expect))
            return

        def undo(out):
            return end_update(controller, cpb.BeginUpdateResponse.FromString(out).update_id)

        aio.run(
            raw_call(
                controller.channel, "AsyncController", method, raw, expect, undo if method == "BeginUpdate" else None
            )
        )

    run()
    aio.run(assert_oversized_refused(controller.channel, "AsyncController", "AbortUpdate", GRPC_DEFAULT_LIMIT, 2))
    aio.run(controller_serves(controller))


async def begin_next(ctl) -> tuple[str, int]:
    """An update to the next version: (its id, that version)."""
    version = await current_version(ctl) + 1
    assert version <= MAX_VERSION, "no version left to update to"
    code, out = await controller_call(ctl, "BeginUpdate", cpb.BeginUpdateRequest(new_version=version))
    assert code == OK
    return cpb.BeginUpdateResponse.FromString(out).update_id, version


async def admit(ctl, n: int) -> None:
    code, out = await controller_call(ctl, "Admit", cpb.AdmitRequest(num_groups=n), "num_groups", refuse=n < 0)
    if code == OK:
        res = cpb.AdmitResponse.FromString(out)
        assert 0 <= res.num_admitted <= n and res.capacity >= 0


async def release(ctl, unused: int, finished: int, dropped: int) -> None:
    core = ctl.core  # in this process: what the controller holds decides what it must refuse
    too_many = unused + finished > core.in_flight or dropped > core.finished + finished
    refuse = min(unused, finished, dropped) < 0 or too_many
    req = cpb.ReleaseRequest(num_groups=unused, num_finished=finished, num_dropped=dropped)
    await controller_call(ctl, "Release", req, ("num_groups", "num_finished", "num_dropped"), refuse=refuse)


async def begin(ctl, new_version: int | None, timeout: float, commit: bool) -> None:
    """An update to ``new_version`` (None: the next one) with ``timeout``; then committed or aborted."""
    current = await current_version(ctl)
    new_version = current + 1 if new_version is None else new_version
    field = "new_version" if not current < new_version <= MAX_VERSION else "timeout_s"
    refuse = field == "new_version" or bad_timeout(timeout)

    async def end(code, out):
        if code == OK:  # the last version is left for the end of the test: later cases need one more
            at = new_version if commit and new_version < MAX_VERSION else None
            await end_update(ctl, cpb.BeginUpdateResponse.FromString(out).update_id, at)

    req = cpb.BeginUpdateRequest(new_version=new_version, timeout_s=timeout)
    await controller_call(ctl, "BeginUpdate", req, field, refuse=refuse, undo=end)


async def commit(ctl, version: int | None, model_path: str | None, update_id: str | None) -> None:
    """Commit an update under way at ``version`` (None: its own) to ``model_path``, or one that is not."""
    uid, new_version = (update_id, None) if update_id is not None else await begin_next(ctl)
    version = new_version if version is None else version
    req = cpb.CommitUpdateRequest(update_id=uid, version=version, model_path=model_path or ctl.model)

    async def end(code, out):
        if update_id is None and code != OK:  # the update begun here is still under way
            await end_update(ctl, uid)

    refuse = update_id is None and version != new_version
    code, _ = await controller_call(ctl, "CommitUpdate", req, "version", refuse=refuse, undo=end)
    assert update_id is None or code == grpc.StatusCode.FAILED_PRECONDITION  # no update of that id


async def abort(ctl, reason: str, update_id: str | None) -> None:
    uid = update_id if update_id is not None else (await begin_next(ctl))[0]
    code, _ = await controller_call(ctl, "AbortUpdate", cpb.AbortUpdateRequest(update_id=uid, reason=reason))
    assert code == (OK if update_id is None else grpc.StatusCode.FAILED_PRECONDITION)


def controller_cases() -> dict[str, tuple]:
    """Each case makes a coroutine function of the controller, one field hostile."""
    text = st.text(max_size=40)
    return {
        "Admit.num_groups": case(INT32, lambda n: lambda ctl: admit(ctl, n), INT32_EDGES),
        "Release": case(
            st.tuples(INT32, INT32, INT32),
            lambda t: lambda ctl: release(ctl, *t),
            [(-1, 0, 0), (0, -1, 0), (0, 0, -1), (2**31 - 1, 0, 0), (0, 0, 2**31 - 1)],
        ),
        # committed at that version or aborted (the last version there is is kept for the end of the test)
        "BeginUpdate.new_version": case(
            st.tuples(INT64, st.booleans()),
            lambda t: lambda ctl: begin(ctl, t[0], 5, t[1]),
            [(v, False) for v in [*INT64_EDGES, MAX_VERSION + 1]],
        ),
        "BeginUpdate.timeout_s": case(
            st.tuples(st.one_of(DOUBLES, st.floats(0.01, 0.3)), st.booleans()),
            lambda t: lambda ctl: begin(ctl, None, *t),
            [(t, False) for t in DOUBLE_EDGES],
        ),
        "CommitUpdate.version": case(INT64, lambda v: lambda ctl: commit(ctl, v, None, None), INT64_EDGES),
        "CommitUpdate.model_path": case(text, lambda p: lambda ctl: commit(ctl, None, p, None), ["\x00"]),
        "CommitUpdate.update_id": case(text, lambda u: lambda ctl: commit(ctl, None, None, u), ["", "x" * 1000]),
        "AbortUpdate.reason": case(text, lambda r: lambda ctl: abort(ctl, r, None), [""]),
        "AbortUpdate.update_id": case(text, lambda u: lambda ctl: abort(ctl, "fuzz", u), [""]),
    }


def test_async_controller_with_hostile_values(aio, controller):
    fuzz_each(controller_cases(), lambda name, op: aio.run(op(controller)), max_examples=4)
    # The last version there is: admission (which grows with the version) still answers.
    if aio.run(current_version(controller)) < MAX_VERSION:
        aio.run(begin(controller, MAX_VERSION, 30, commit=True))
    aio.run(admit(controller, 2**31 - 1))
    aio.run(controller_serves(controller))


# ---------------------------------------------------------------------------------------------- EnvManager
@pytest.fixture(scope="module")
def env_manager(aio, engine, tiny_model):
    # Its own mesh; a generous async_ratio, so admission never runs dry while nobody trains.
    mesh_cm = local_mesh(engine.url, tiny_model, {"filter_zero_variance": False}, async_ratio=10_000)

    # The proxy's fuzzing left the engine at some int64 version: one no trajectory can record (int32).
    reset = post(engine.url, "/update_weights_from_disk", {"model_path": tiny_model, "weight_version": "0"})
    assert reset.status_code == 200, reset.text

    async def start():
        mesh = await mesh_cm.__aenter__()
        config = EnvManagerConfig(
            tokenizer_path=tiny_model, group_size=2, num_workers=2, episode={"sampling": {"max_new_tokens": 2}}
        )
        loop = env_server.build_loop(config, mesh.proxy_client, mesh.buffer_client, mesh.controller_client)
        server = await start_server(env_server.build_handler(loop), env_server.SERVICE, "127.0.0.1", 0)
        return SimpleNamespace(mesh=mesh, loop=loop, server=server, channel=channel(f"127.0.0.1:{server.bound_port}"))

    async def stop(ns):
        await ns.loop.stop()
        await ns.channel.close()
        await ns.server.stop(0)
        await mesh_cm.__aexit__(None, None, None)

    ns = aio.run(start())
    yield ns
    aio.run(stop(ns))


async def env_call(env, method: str, req, field=None, refuse: bool = False):
    code, details, out = await call(env.channel, f"/rollmesh.v1.EnvManager/{method}", req.SerializeToString())
    check(code, details, field, what=f"{method} {str(req)[:200]}", refuse=refuse)
    return code, out


async def env_stats(env) -> epb.EnvStats:
    code, out = await env_call(env, "Stats", epb.EnvStatsRequest())
    assert code == OK
    return epb.EnvStats.FromString(out)


async def env_stop(env) -> None:
    code, _ = await env_call(env, "Stop", epb.StopRequest(drain=False))
    assert code == OK and not (await env_stats(env)).running


async def env_serves(env) -> None:
    """It starts, fills the buffer, and stops."""
    before = (await env_stats(env)).groups_put
    code, _ = await env_call(env, "Start", epb.StartRequest(num_workers=2))
    assert code == OK
    for _ in range(300):
        stats = await env_stats(env)
        if stats.groups_put > before:
            break
        await asyncio.sleep(0.1)
    assert stats.running and stats.workers == 2 and stats.groups_put > before
    code, _ = await env_call(env, "Stop", epb.StopRequest(drain=True, timeout_s=30))
    assert code == OK and not (await env_stats(env)).running


ENV_METHODS = {
    "Start": epb.StartRequest(num_workers=1),
    "Stop": epb.StopRequest(drain=True, timeout_s=1),
    "Stats": epb.EnvStatsRequest(),
}


def test_env_manager_answers_malformed_bytes_cleanly(aio, env_manager):
    def undo(method):
        return (lambda out: env_stop(env_manager)) if method == "Start" else None

    fuzz_unary_methods(aio, env_manager.channel, "EnvManager", ENV_METHODS, 20, undo)
    aio.run(assert_oversized_refused(env_manager.channel, "EnvManager", "Start", GRPC_DEFAULT_LIMIT, 1))
    aio.run(env_serves(env_manager))


def test_env_manager_with_hostile_values(aio, env_manager):
    async def start(n: int):
        req = epb.StartRequest(num_workers=n).SerializeToString()
        code, details, _ = await call(env_manager.channel, "/rollmesh.v1.EnvManager/Start", req)
        if code == OK:
            await env_stop(env_manager)  # first: a failed check must leave no workers running
        check(code, details, "num_workers", what=f"num_workers={n}", refuse=not 0 <= n <= env_server.MAX_WORKERS)

    async def stop(drain: bool, timeout: float, running: bool):
        if running:  # a drain only waits (and only then reads the timeout) with workers running
            assert (await env_call(env_manager, "Start", epb.StartRequest(num_workers=1)))[0] == OK
        req = epb.StopRequest(drain=drain, timeout_s=timeout)
        await env_call(env_manager, "Stop", req, "timeout_s", refuse=bad_timeout(timeout))
        await env_stop(env_manager)

    # num_workers: anything outside the few a test can afford to start (each is a worker asking for groups).
    too_many = st.integers(env_server.MAX_WORKERS + 1, 2**31 - 1)
    timeouts = st.one_of(NON_FINITE, st.floats(max_value=-1e-300), st.floats(0, 0.2))
    cases = {
        "Start.num_workers": case(
            st.one_of(st.integers(-(2**31), -1), st.integers(0, 2), too_many),
            start,
            [-(2**31), -1, 0, env_server.MAX_WORKERS + 1, 2**31 - 1],
        ),
        "Stop.timeout_s": case(
            st.tuples(st.booleans(), timeouts, st.booleans()),
            lambda t: stop(*t),
            [(True, t, True) for t in [math.nan, math.inf, -math.inf, -1.0, 5e-324]],
        ),
    }
    fuzz_each(cases, lambda name, coro: aio.run(coro), max_examples=8)
    aio.run(env_serves(env_manager))


# ---------------------------------------------------------------------------------------------- engine HTTP
@functools.cache
def _http() -> httpx.Client:
    """The one client of every HTTP request here: headers they all need (a token) go here. One connection for
    all (a new client per request costs ~50 ms)."""
    return httpx.Client(timeout=60, headers={"content-type": "application/json", **http_headers(AuthConfig())})


def post(url: str, path: str, body, params: dict | None = None) -> httpx.Response:
    """``body``: bytes as they are, anything else as JSON with NaN and Infinity allowed (httpx's own encoder
    refuses them)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return _http().post(url + path, content=content, params=params)


def get(url: str, path: str) -> httpx.Response:
    return _http().get(url + path)


TYPE_NAMES = {"str", "int", "float", "bool", "bytes", "list", "dict"}  # how pydantic locates union members
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def http_bodies(model: str) -> dict[str, dict]:
    return {
        "/generate": {
            "input_ids": [1, 40, 41],
            "return_logprob": True,
            "stream": False,
            "sampling_params": {
                "max_new_tokens": 2,
                "temperature": 0.0,
                "top_p": 1.0,
                "top_k": -1,
                "stop_token_ids": [],
                "ignore_eos": True,
                "sampling_seed": 1,
            },
        },
        "/abort_request": {"rid": "nobody", "abort_all": False},
        "/pause_generation": {"mode": "in_place"},
        "/update_weights_from_disk": {"model_path": model, "weight_version": "3", "abort_all_requests": False},
    }


def _is_json_object(data: bytes) -> bool:
    try:
        return isinstance(json.loads(data), dict)
    except ValueError:
        return False


def _paths(body: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in body.items():
        out.append(prefix + k)
        if isinstance(v, dict):
            out += _paths(v, prefix + k + ".")
    return out


JSON_ROUTES = ["/generate", "/abort_request", "/pause_generation", "/update_weights_from_disk"]
NUMBER_PATHS = {
    "/generate": [
        "input_ids",
        "sampling_params.max_new_tokens",
        "sampling_params.temperature",
        "sampling_params.top_p",
        "sampling_params.top_k",
        "sampling_params.sampling_seed",
    ],
    "/update_weights_from_disk": ["weight_version"],
}
NUMBER_EDGES = [math.nan, math.inf, -math.inf, 2**70, -(2**70), FLOAT32_MIN, 1e308]


def number_in(route: str, path: str, value, model: str) -> tuple:
    """(body, params, field): ``route``'s valid body with ``value`` at ``path`` (in the list for input_ids)."""
    body = http_bodies(model)[route]
    *parents, leaf = path.split(".")
    target = body
    for p in parents:
        target = target[p]
    target[leaf] = [value] if leaf == "input_ids" else value
    return body, None, parents[0] if parents else leaf


HTTP_KINDS = ["truncated", "not_json", "value", "missing", "unknown"]
MUST_FAIL = {"truncated", "not_json", "unknown", "huge"}  # always a 4xx


@st.composite
def http_requests(draw, route: str, kind: str, vocab: int, context: int, model_paths: list[str]):
    """(body, query params, the field a 4xx must name) for ``route``, damaged the ``kind`` way."""
    if route == "/update_weights_from_safetensors":
        body = draw(st.one_of(st.binary(max_size=64), st.sampled_from(BAD_BUCKETS)))
        version = st.one_of(st.integers(-(2**70), 2**70).map(str), st.text(max_size=8))
        final = st.one_of(st.sampled_from(["true", "false"]), st.text(max_size=5))
        params = {"weight_version": draw(st.one_of(st.none(), version)), "final": draw(st.one_of(st.none(), final))}
        params = {k: v for k, v in params.items() if v is not None}
        return body, params, ("body", "tensors", "weight_version", "final")
    body = http_bodies(model_paths[0])[route]
    if kind == "truncated":  # a prefix of a JSON object is never JSON
        text = json.dumps(body)
        return text[: draw(st.integers(0, len(text) - 1))].encode(), None, "body"
    if kind == "not_json":  # anything but a JSON object
        data = st.one_of(
            st.binary(max_size=40),
            st.text(max_size=40).map(str.encode),
            JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        )
        return draw(data.filter(lambda b: not _is_json_object(b))), None, "body"
    if kind == "unknown":
        if route == "/generate":  # at the top level ignored, as SGLang ignores it; not in sampling_params
            from services.engine.sglang_fields import DEFAULT_ONLY_SAMPLING, INERT_SAMPLING

            taken = {*body["sampling_params"], *INERT_SAMPLING, *DEFAULT_ONLY_SAMPLING}
            key = draw(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda k: k not in taken))
            return (
                {**body, "sampling_params": {**body["sampling_params"], key: draw(JSON_VALUES)}},
                None,
                "sampling_params",
            )
        key = draw(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda k: k not in body))
        return {**body, key: draw(JSON_VALUES)}, None, key
    if kind == "huge":  # token lists longer than the context, in and out of the vocabulary
        ids = [draw(st.integers(0, 2 * vocab))] * draw(st.integers(context, 50_000))
        return {**body, "input_ids": ids}, None, "input_ids"
    # Without sampling_params (or its max_new_tokens) a generation is 128 tokens long: valid, just slow.
    long = {"sampling_params", "sampling_params.max_new_tokens"} if kind == "missing" else set()
    path = draw(st.sampled_from([p for p in _paths(body) if p not in long]))
    *parents, leaf = path.split(".")
    target = body
    for p in parents:
        target = target[p]
    if kind == "missing":
        del target[leaf]
    elif route == "/update_weights_from_disk" and leaf == "model_path" and draw(st.booleans()):
        target[leaf] = draw(st.sampled_from(model_paths))
    else:  # a value of any type: NaN, infinity, huge numbers, lists, objects
        target[leaf] = draw(JSON_VALUES)
    return body, None, path.split(".")[0]


def test_engine_http_answers_bad_json_and_hostile_values_with_a_4xx_naming_the_field(engine, model_paths):
    def greedy_ids():
        r = post(
            engine.url,
            "/generate",
            http_bodies("")["/generate"]
            | {"sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}},
        )
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    def one(name: str, case) -> None:
        route, kind = name.split(" ")
        body, params, field = case
        r = post(engine.url, route, body, params)
        what = f"{route} {kind} {str(body)[:200]} {params}: HTTP {r.status_code} {r.text[:300]}"
        assert r.status_code == 200 or 400 <= r.status_code < 500, what
        assert r.status_code != 200 or kind not in MUST_FAIL, what
        if r.status_code != 200:
            err = r.json()
            names = (field,) if isinstance(field, str) else field
            assert err["message"].startswith(err["field"] + ": "), what
            assert any(err["field"] == n or err["field"].startswith((n + ".", n + "[")) for n in names), what
            assert not set(re.split(r"[.\[\]]", err["field"])) & TYPE_NAMES, f"a type name is not a field: {what}"
        elif route == "/generate":
            outs = r.json() if isinstance(r.json(), list) else [r.json()]
            assert all(0 <= t < engine.vocab for o in outs for t in o["output_ids"]), what
        elif route == "/pause_generation":
            assert post(engine.url, "/continue_generation", {}).status_code == 200

    reference = greedy_ids()
    routes = [(r, k) for r in JSON_ROUTES for k in HTTP_KINDS] + [("/generate", "huge")]
    cases = {f"{r} {k}": case(http_requests(r, k, engine.vocab, engine.context, model_paths)) for r, k in routes}
    cases["/update_weights_from_safetensors bytes"] = case(
        http_requests("/update_weights_from_safetensors", "bytes", engine.vocab, engine.context, model_paths)
    )
    for route, paths in NUMBER_PATHS.items():  # NaN, infinities, out-of-range and tiny numbers in every numeric field
        edges = [(p, v) for p in paths for v in NUMBER_EDGES]
        numbers = st.tuples(st.sampled_from(paths), st.one_of(st.floats(), st.integers(-(2**80), 2**80)))
        cases[f"{route} numbers"] = case(numbers, lambda v, r=route: number_in(r, *v, model_paths[0]), edges)
    fuzz_each(cases, one, max_examples=3)
    assert get(engine.url, "/health").status_code == 200
    assert greedy_ids() == reference


# ---------------------------------------------------------------------------------------------- an env provider
def test_env_provider_answers_malformed_bytes_cleanly(aio):
    """The provider's gRPC server over its sessions (the test's scripted environment), fuzzed; it then
    runs an episode as before."""
    from services.env_provider import server as provider_server
    from services.env_provider.sessions import ProviderSessions
    from services.pb.rollmesh.v1 import env_provider_pb2 as ppb
    from tests.services.provider_envs import ScriptEnv

    sessions = ProviderSessions(
        ScriptEnv, "script", max_sessions=100_000, step_timeout_s=5.0, session_idle_s=600, max_action_chars=65_536
    )

    async def start():
        server = await start_server(provider_server.grpc_handler(sessions), provider_server.SERVICE, "127.0.0.1", 0)
        return server, channel(f"127.0.0.1:{server.bound_port}")

    server, ch = aio.run(start())
    try:
        aio.run(sessions.reset("fuzzed", 0))
        methods = {
            "Describe": ppb.DescribeRequest(),
            "Reset": ppb.ResetRequest(seed=1, episode_id="e1"),
            "Step": ppb.StepRequest(episode_id="fuzzed", action="a", request_id="r", timeout_s=1.0),
            "Close": ppb.CloseRequest(episode_id="nobody"),
        }
        fuzz_unary_methods(aio, ch, "EnvProvider", methods, 30)

        async def episode():
            code, out = await raw_call(
                ch, "EnvProvider", "Reset", ppb.ResetRequest(seed=4, episode_id="after").SerializeToString(), None
            )
            first = ppb.ResetResponse.FromString(out).observation
            code, out = await raw_call(
                ch, "EnvProvider", "Step", ppb.StepRequest(episode_id="after", action="x").SerializeToString(), None
            )
            return first, ppb.StepResponse.FromString(out)

        first, step = aio.run(episode())
        assert first == "start 4" and (step.observation, step.role) == ("echo x", "tool")
    finally:
        aio.run(ch.close())
        aio.run(server.stop(0))
