"""The LLMProxy: one front door to a pool of inference engines.

A request passes the *suspend gate*, is routed to an engine and generated there. If the engine
fails (connection refused, timeout, 5xx) it is taken out of rotation and the request is retried
on another engine; the health loop puts it back once ``/health`` answers and its weights match.

Suspension modes decide what happens to in-flight generations during a weight update:
``continue`` aborts them at the engines, keeps the partial tokens here and, after ``resume``,
re-submits prompt + partial tokens so they finish under the new weights (abort-and-continue:
the re-prefill costs little next to waiting for the longest generation to drain); ``abort``
returns them to the caller as aborted; ``in_place`` pauses the engines with requests inside.
Every token keeps the weight version that produced it.

Several training runs can share the engines, each in a lane of its own (``rollout/proxy/lanes.py``):
its requests are served with its LoRA adapter, and its suspend and updates touch only them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np

from rollout.engines.contract import MAX_SAMPLES
from rollout.engines.http_engine import EngineRejected, EngineUnavailable, OnTokens, int_version
from rollout.engines.sglang.client import SGLangClient
from rollout.proxy.config import ProxyConfig
from rollout.proxy.lanes import ADAPTER_NAME, Lane, SuspendMode
from rollout.proxy.router import EngineSlot, Router
from rollout.sampling import SamplingParams
from sample_buffer import routing
from sample_buffer.trajectory import FinishReason
from sample_buffer.vision import MAX_IMAGE_BYTES, MAX_IMAGES, data_url

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # OpenAI's bound, and vLLM's default --max-logprobs
_ENGINE_PAUSE_MODE = {"continue": "abort", "abort": "abort", "in_place": "in_place"}
# What a WeightBucket's bytes hold ("" is safetensors).
BUCKET_FORMATS = (
    "",
    "safetensors",
    "safetensors_delta",
    "safetensors_adapter",
    "tensor_handles",
    "tensor_handles_adapter",
)
# Formats whose final bucket carries the checksum of the weights the update makes.
CHECKED_FORMATS = ("safetensors_delta", "safetensors_adapter", "tensor_handles_adapter")


class RequestInvalid(ValueError):
    """Bad input; ``field`` names it. Maps to HTTP 400 / gRPC INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class NoEngineAvailable(RuntimeError):
    """Every engine is out of rotation (or failed this request)."""


@dataclass
class ProxyRequest:
    input_ids: list[int]
    sampling_params: SamplingParams
    request_id: str = ""
    route: str = ""  # affinity key: requests that share it go to one engine (an episode's turns, a group)
    timeout_s: float = 0.0
    top_logprobs: int = 0  # the most likely tokens to report at each position (0: none)
    return_routed_experts: bool = False  # an MoE model's experts per position (routing replay)
    images: tuple[bytes, ...] = ()  # a vision-language prompt's encoded images, one placeholder each in input_ids


@dataclass
class ProxyResult:
    request_id: str
    output_ids: list[int] = field(default_factory=list)
    behavior_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = FinishReason.ABORT
    weight_version: int = 0
    engine: str = ""
    prompt_tokens: int = 0
    e2e_latency_s: float = 0.0
    num_segments: int = 0
    queue_time_s: float = 0.0  # waiting at the suspend gate, plus the engine's queue for the first segment
    ttft_s: float | None = None  # arrival → first token, when the engine reports its own TTFT
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token, when asked
    # when asked: [positions, layers × top_k], each position's from the latest segment that forwarded it
    routed_experts: np.ndarray | None = None


@dataclass
class _InFlight:
    request: ProxyRequest
    result: ProxyResult
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    on_tokens: OnTokens | None = None
    streamed: int = 0  # tokens handed to on_tokens
    lane: Lane | None = None  # whose request it is (set by ``generate``)
    slot: EngineSlot | None = None
    engine_rid: str = ""
    t0: float = field(default_factory=time.perf_counter)

    @cached_property
    def image_data(self) -> list[str]:
        """The images as the engines' ``image_data`` (data URLs), encoded once for every segment."""
        return [data_url(x) for x in self.request.images]


@dataclass
class _BucketUpdate:
    version: int
    slots: list[EngineSlot]  # the engines in rotation when bucket 0 arrived
    next_index: int = 0


@dataclass
class _GroupPlan:
    """A weight-update group the trainer hosts: its members and their joins (answered once every
    rank, the trainer's included, has joined)."""

    name: str
    slots: list[EngineSlot]
    joined: asyncio.Task


def _group_ranks(slot: EngineSlot, info) -> int:
    """The ranks an engine takes in a weight-update group: its tensor-parallel size. An engine
    whose server info cannot be read counts as one (its join then fails or times out, and the
    update with it)."""
    try:
        if isinstance(info, BaseException):
            raise ValueError(info)
        return max(1, int(info.get("tp_size", 1)))
    except (TypeError, ValueError) as e:
        log.warning("engine %s: no tensor-parallel size (%s); counting 1 rank", slot.name, e)
        return 1


def _check_timeout(timeout_s: float) -> None:
    # Infinity made aiohttp raise OverflowError (an UNKNOWN status, or an engine taken out of rotation after a
    # pause it could not send); NaN made asyncio's wait_for raise and switched aiohttp's timeout off.
    if not 0 <= timeout_s < math.inf:
        raise RequestInvalid("timeout_s", f"must be a finite number >= 0 (0 = the default), got {timeout_s}")


def _validate(req: ProxyRequest) -> None:
    if not req.input_ids:
        raise RequestInvalid("input_ids", "must not be empty")
    if any(t < 0 for t in req.input_ids):
        raise RequestInvalid("input_ids", "token ids must be >= 0")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise RequestInvalid("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}")
    if len(req.images) > MAX_IMAGES:
        raise RequestInvalid("images", f"{len(req.images)} images; at most {MAX_IMAGES} per request")
    for i, image in enumerate(req.images):  # what the image is, the engine checks; its size, here
        if not 0 < len(image) <= MAX_IMAGE_BYTES:
            raise RequestInvalid(f"images[{i}]", f"an encoded image of 1 to {MAX_IMAGE_BYTES} bytes, got {len(image)}")
    _check_timeout(req.timeout_s)


# Why an engine failed a weight update (the ``cause`` label of the failure counter).
_UPDATE_FAILURE_CAUSES = {
    EngineUnavailable: "unavailable",
    EngineRejected: "rejected",
    TimeoutError: "timeout",
    ValueError: "bad_response",
}


def _root(run: str, folder: str) -> Path:
    """A shared run's adapter folder, resolved once (it must exist: the pool's operator makes it)."""
    try:
        return Path(folder).resolve(strict=True)
    except OSError as e:
        raise ValueError(f"proxy.runs.{run}.adapter_root: {folder} is not a folder here ({e})") from None


def _done(slot: EngineSlot, version: int) -> dict:
    return {"engine": slot.name, "success": True, "weight_version": version, "message": "", "cause": ""}


_NO_ENGINE = {
    "engine": "",
    "success": False,
    "weight_version": -1,
    "message": "no engine in rotation",
    "cause": "no_engine",
}
UPDATE_FAILURE_CAUSES = ("unavailable", "rejected", "timeout", "bad_response", "version_mismatch", "no_engine")


class LLMProxy:
    def __init__(self, config: ProxyConfig, client_factory=SGLangClient) -> None:
        self.config = config
        slots = [EngineSlot(name=f"engine-{i}", url=u) for i, u in enumerate(config.engine_urls)]
        self.router = Router(slots, config.affinity_capacity)
        self.clients = {s.name: client_factory(s.url, timeout_s=config.request_timeout_s) for s in slots}
        self.base = Lane("")  # the run that owns the engines' weights
        self.lanes = {
            "": self.base,
            **{name: Lane(name, root=_root(name, r.adapter_root)) for name, r in config.runs.items()},
        }
        self._stale: dict[str, set[str]] = {}  # engine → adapters to unload (in use, or its unload failed)
        self._loading: set[str] = set()  # adapters being loaded: never stale
        self._look_again: set[str] = set()  # engines to list the adapters of at the next health round
        self._slot_locks = {s.name: asyncio.Lock() for s in slots}  # one adapter chore per engine at a time
        self._tidying: dict[str, asyncio.Task] = {}  # the health loop's, per engine
        # by (run, request id): one run's ids never meet another's (nor tell it which are in flight)
        self._in_flight: dict[tuple[str, str], _InFlight] = {}
        self._last_update: tuple[str, int] | None = None  # (model_path, version) every engine should serve
        self._bucket_update: _BucketUpdate | None = None  # an in-memory update under way
        self._group: _GroupPlan | None = None  # the collective transport's group, once planned
        self._lease: asyncio.Task | None = None  # colocated: ends a memory release the trainer never ended
        self.counters: Counter[str] = Counter()
        self._seq = itertools.count()
        self._health_task: asyncio.Task | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> LLMProxy:
        await self.check_health()
        # A proxy (re)started in front of engines that were updated before serves their version.
        await asyncio.gather(*(self._read_version(s) for s in self.router.engines if s.healthy))
        versions = {s.weight_version for s in self.router.engines if s.healthy}
        if len(versions) == 1:
            self.weight_version = versions.pop()
        # what a predecessor proxy loaded for its lanes is no lane's now
        await asyncio.gather(*(self._tidy(s, sweep=True) for s in self.router.engines if s.healthy))
        self._health_task = asyncio.create_task(self._health_loop())
        return self

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
        await asyncio.gather(*(c.close() for c in self.clients.values()), return_exceptions=True)

    @property
    def suspended(self) -> bool:
        return self.base.suspended

    @property
    def weight_version(self) -> int:
        """The proxy's own run's version."""
        return self.base.version

    @weight_version.setter
    def weight_version(self, version: int) -> None:
        self.base.version = version

    def lane(self, run: str) -> Lane:
        """``run``'s lane ("": the proxy's own); ``RequestInvalid`` naming ``run`` for one it does not serve."""
        lane = self.lanes.get(run)
        if lane is None:
            raise RequestInvalid("run", f"{run!r} is not one of proxy.runs {sorted(self.lanes)[1:]}")
        return lane

    def owns_weights(self, run: str, what: str) -> None:
        """Refuse ``what`` (a call that changes the engines themselves: their weights, memory or
        groups) to a run that shares them."""
        if run:
            raise RequestInvalid(
                "run",
                f"{run!r} shares this proxy's engines: {what} would change them for every run; a shared run "
                "publishes its adapter (train_loop.publisher: {type: disk, adapter: true})",
            )

    # ------------------------------------------------------------------ generate
    async def generate(self, req: ProxyRequest, on_tokens: OnTokens | None = None, run: str = "") -> ProxyResult:
        """Generate ``req`` for ``run`` (its lane's gate and adapter). ``on_tokens`` streams it: each
        piece of new tokens is handed over as the engine makes it, across weight updates. An engine
        that fails after handing some over ends the request as aborted (a retry elsewhere would
        hand tokens over again)."""
        _validate(req)
        lane = self.lane(run)
        req.request_id = req.request_id or uuid.uuid4().hex
        key = (lane.name, req.request_id)
        if key in self._in_flight:
            raise RequestInvalid("request_id", f"{req.request_id!r} is already in flight")
        fl = _InFlight(req, ProxyResult(request_id=req.request_id), on_tokens=on_tokens, lane=lane)
        deadline = fl.t0 + (req.timeout_s or self.config.request_timeout_s)
        self._in_flight[key] = fl
        self.counters["requests"] += 1
        lane.requests += 1
        await self._served(fl, deadline)
        return fl.result

    async def _served(self, fl: _InFlight, deadline: float, first: tuple | None = None) -> None:
        """``fl`` (registered in flight) run to its end, then out of flight and counted by how it ended."""
        try:
            await self._run(fl, deadline, first)
        finally:
            del self._in_flight[(fl.lane.name, fl.request.request_id)]
        fl.result.e2e_latency_s = time.perf_counter() - fl.t0
        self.counters[f"finished_{fl.result.finish_reason}"] += 1

    async def generate_group(self, req: ProxyRequest, request_ids: list[str], run: str = "") -> list[ProxyResult]:
        """``len(request_ids)`` samples of ``req``'s prompt, each in flight under its own id (``abort``
        takes one): one engine call for all of them where the engine samples a prompt ``n`` times in
        one request (its prefill shared), then each on its own like ``generate`` (a sample cut by a
        weight update continues alone; a failed engine's samples are retried one by one)."""
        _validate(req)
        if not request_ids or len(set(request_ids)) != len(request_ids) or not all(request_ids):
            raise RequestInvalid("request_ids", "one distinct, non-empty id per sample")
        if len(request_ids) > MAX_SAMPLES:
            raise RequestInvalid("request_ids", f"{len(request_ids)} samples; at most {MAX_SAMPLES} a request")
        if req.top_logprobs or req.return_routed_experts or req.images:
            raise RequestInvalid("request_ids", "a group's samples take no top_logprobs, routed experts or images")
        lane = self.lane(run)
        taken = [rid for rid in request_ids if (lane.name, rid) in self._in_flight]
        if taken:
            raise RequestInvalid("request_ids", f"{taken[0]!r} is already in flight")
        flights = [
            _InFlight(replace(req, request_id=rid), ProxyResult(request_id=rid), lane=lane) for rid in request_ids
        ]
        deadline = flights[0].t0 + (req.timeout_s or self.config.request_timeout_s)
        for fl in flights:
            self._in_flight[(lane.name, fl.request.request_id)] = fl
        self.counters["requests"] += len(flights)
        self.counters["group_requests"] += 1
        lane.requests += len(flights)
        try:
            firsts = await self._first_segment(flights, deadline)
        except BaseException:
            for fl in flights:
                del self._in_flight[(lane.name, fl.request.request_id)]
            raise
        await asyncio.gather(*(self._served(fl, deadline, first) for fl, first in zip(flights, firsts)))
        return [fl.result for fl in flights]

    async def _first_segment(self, flights: list[_InFlight], deadline: float) -> list[tuple | None]:
        """The group's first engine call, shared; for each sample, what ``_run`` continues from (None:
        nothing yet, it starts on its own: no engine samples n at once here, or the engine failed)."""
        nothing: list[tuple | None] = [None] * len(flights)
        head = flights[0]
        if not await self._wait_open(head, deadline):
            return nothing  # each sample's own wait ends it (aborted, or at the deadline)
        slot = self.router.pick(head.request.route, frozenset())
        client = self.clients.get(slot.name) if slot is not None else None
        # A run's own lane, or an adapter (each token's version is theirs: ``_call_engine``): a sample a call.
        own = head.lane is not self.base or head.lane.adapter is not None
        if client is None or not hasattr(client, "generate_samples") or own:
            return nothing
        epochs, t_call = (self.base.epoch, head.lane.epoch), time.perf_counter()
        try:
            outs = await self._call_engine_samples(flights, slot, deadline)
        except EngineUnavailable as e:
            self._take_out(slot, str(e))
            return nothing
        except EngineRejected as e:
            field = e.field or "input_ids"
            raise RequestInvalid(field, str(e).removeprefix(f"{field}: ")) from e
        return [(slot, out, t_call, epochs) for out in outs]

    async def _call_engine_samples(self, flights: list[_InFlight], slot: EngineSlot, deadline: float) -> list:
        """One engine call for every sample of ``flights`` (``_call_engine``'s bookkeeping, per sample);
        on the deadline each is aborted there and its partial output taken back (None: not in time)."""
        req = flights[0].request
        rid = f"{req.request_id}#{next(self._seq)}"  # sample i's at the engine: SGLang's f"{rid}_{i}"
        for i, fl in enumerate(flights):
            fl.engine_rid = f"{rid}_{i}"
        cost = (len(req.input_ids) + req.sampling_params.max_new_tokens) * len(flights)
        client = self.clients[slot.name]

        def call(timeout_s: float):
            return client.generate_samples(req.input_ids, req.sampling_params, rid, len(flights), timeout_s)

        outs = await self._on_engine_until(flights, slot, cost, call, deadline)
        return [None] * len(flights) if outs is None else outs

    async def _on_engine_until(self, flights: list[_InFlight], slot: EngineSlot, cost: int, call, deadline: float):
        """``call(timeout_s)``, one engine call for ``flights``, with its load on ``slot`` counted while it
        runs. On the deadline they are aborted there and the partial output taken back within
        ``abort_grace_s``; None if it does not come."""
        for fl in flights:
            fl.slot = slot
        slot.in_flight += len(flights)
        slot.outstanding_tokens += cost
        slot.requests_total += 1
        grace = self.config.abort_grace_s
        remaining = max(0.001, deadline - time.perf_counter())
        task = asyncio.ensure_future(call(remaining + grace))
        try:
            done, _ = await asyncio.wait([task], timeout=remaining)
            if not done:
                self.counters["deadline_aborts"] += 1
                await self._abort_at_engines(flights, grace)
                done, _ = await asyncio.wait([task], timeout=grace)
                if not done:
                    task.cancel()
                    return None
            return task.result()
        finally:
            slot.in_flight -= len(flights)
            slot.outstanding_tokens -= cost
            for fl in flights:
                fl.slot = None

    async def _run(self, fl: _InFlight, deadline: float, first: tuple | None = None) -> None:
        """Generate ``fl`` to its end, segment after segment; ``first``: a segment already called
        (``generate_group``'s shared one: its slot, output, start and the epochs it began at)."""
        res = fl.result
        failed: set[str] = set()
        while True:
            if first is not None:
                (slot, out, t_call, epochs), first = first, None
                if out is None:  # the shared call's deadline passed without the partial back
                    res.finish_reason = FinishReason.TIMEOUT
                    return
            else:
                got = await self._segment(fl, deadline, failed)
                if got is None:
                    return
                slot, out, t_call, epochs = got
            if self._absorb(fl, slot, out, t_call, epochs, deadline):
                return

    async def _segment(self, fl: _InFlight, deadline: float, failed: set[str]) -> tuple | None:
        """One engine call for the rest of ``fl`` (retried on other engines); None when the request
        ended without one (its finish reason set)."""
        req, res = fl.request, fl.result
        while True:
            if not await self._wait_open(fl, deadline):
                res.finish_reason = FinishReason.ABORT if fl.aborted.is_set() else FinishReason.TIMEOUT
                return None
            slot = self.router.pick(req.route, frozenset(failed))
            if slot is None:
                if res.output_ids:  # keep what was generated; the caller decides
                    res.finish_reason = FinishReason.ABORT
                    return None
                raise NoEngineAvailable(f"no engine in rotation ({len(failed)} failed this request)")
            left = req.sampling_params.max_new_tokens - len(res.output_ids)
            params = req.sampling_params.model_copy(update={"max_new_tokens": left})
            epochs = (self.base.epoch, fl.lane.epoch)
            t_call = time.perf_counter()
            try:
                out = await self._call_engine(fl, slot, req.input_ids + res.output_ids, params, deadline)
            except EngineUnavailable as e:
                self._take_out(slot, str(e))
                failed.add(slot.name)
                if fl.streamed > len(res.output_ids):  # the caller has tokens of the failed segment
                    res.finish_reason = FinishReason.ABORT
                    return
                if len(failed) > self.config.max_retries:
                    raise NoEngineAvailable(f"{len(failed)} engines failed this request; last: {e}") from e
                self.counters["retries"] += 1
                fl.lane.retries += 1
                continue
            except EngineRejected as e:
                field = e.field or "input_ids"
                raise RequestInvalid(field, str(e).removeprefix(f"{field}: ")) from e
            if out is None:  # deadline passed and the engine did not give the partial back in time
                res.finish_reason = FinishReason.TIMEOUT
                return None
            return slot, out, t_call, epochs

    def _absorb(self, fl: _InFlight, slot: EngineSlot, out, t_call: float, epochs: tuple, deadline: float) -> bool:
        """Add one segment's output to ``fl``'s result; True when the request is done (its finish
        reason set), False when a suspend in continue mode cut it and it goes on after resume."""
        req, res = fl.request, fl.result
        max_new = req.sampling_params.max_new_tokens
        if res.num_segments == 0:
            # the engine's count: a vision-language prompt's placeholders expanded (later segments'
            # prompts hold the output so far)
            res.prompt_tokens = out.prompt_tokens or len(req.input_ids)
            res.queue_time_s += out.queue_time_s or 0.0
            if out.ttft_s is not None and out.output_ids:
                res.ttft_s = t_call - fl.t0 + out.ttft_s
        res.num_segments += 1
        res.output_ids += out.output_ids
        res.behavior_logprobs += out.behavior_logprobs
        res.token_versions += out.token_versions
        res.top_logprobs += out.top_logprobs
        try:  # a continuation re-forwards the earlier tokens under the new weights: its routing replaces theirs
            res.routed_experts = routing.latest(res.routed_experts, out.routed_experts, out.routed_experts_start)
        except routing.RoutingError as e:
            log.warning("request %s: %s; its routing is dropped", req.request_id, e)
            self.counters["routing_dropped"] += 1
            res.routed_experts = None  # incomplete: the trainer drops the trajectory rather than guess
            req.return_routed_experts = False  # and no later segment fills it in
        res.weight_version, res.engine = out.weight_version, slot.name
        if out.finish_reason != FinishReason.ABORT:
            res.finish_reason = out.finish_reason
            return True
        if fl.aborted.is_set() or time.perf_counter() >= deadline:
            res.finish_reason = FinishReason.ABORT if fl.aborted.is_set() else FinishReason.TIMEOUT
            return True
        cut = self._cut_by(fl.lane, epochs)
        if not cut or any(lane.mode != "continue" for lane in cut):
            res.finish_reason = FinishReason.ABORT  # aborted at the engine by someone else, or abort mode
            return True
        if len(res.output_ids) >= max_new:
            res.finish_reason = FinishReason.LENGTH
            return True
        return False  # suspended in "continue" mode: it goes on from the partial tokens after resume

    def _cut_by(self, lane: Lane, epochs: tuple[int, int]) -> list[Lane]:
        """The lanes whose suspends cut a segment begun at ``epochs``: the proxy's own (it pauses
        every engine) and the request's (none: someone else aborted it)."""
        # (an in-place pause of the proxy's own holds requests inside the engines: it cuts none)
        cut = [self.base] if self.base.epoch != epochs[0] and self.base.mode != "in_place" else []
        return cut + [lane] if lane is not self.base and lane.epoch != epochs[1] else cut

    async def _wait_open(self, fl: _InFlight, deadline: float) -> bool:
        """Wait until neither the proxy's gate nor the request's lane's is closed."""
        t0 = time.perf_counter()
        try:
            while not fl.aborted.is_set():
                closed = next((g for g in (self.base.gate, fl.lane.gate) if not g.is_set()), None)
                remaining = deadline - time.perf_counter()
                if closed is None or remaining <= 0:
                    return closed is None
                waiters = [asyncio.ensure_future(closed.wait()), asyncio.ensure_future(fl.aborted.wait())]
                try:
                    await asyncio.wait(waiters, timeout=remaining, return_when="FIRST_COMPLETED")
                finally:
                    for w in waiters:
                        w.cancel()
            return False
        finally:
            fl.result.queue_time_s += time.perf_counter() - t0

    async def _call_engine(self, fl: _InFlight, slot: EngineSlot, ids: list[int], params: dict, deadline: float):
        """One engine call. On the deadline, abort it there and take the partial output back."""
        fl.engine_rid = f"{fl.request.request_id}#{next(self._seq)}"
        client = self.clients[slot.name]
        extra = {"top_logprobs": fl.request.top_logprobs} if fl.request.top_logprobs else {}
        if fl.request.return_routed_experts:  # every position: a continuation's forward routes them anew
            extra["return_routed_experts"] = True
        if fl.request.images:  # a continuation sends them again: its prompt's placeholders are expanded anew
            extra["image_data"] = fl.image_data
        lane, adapter, version = fl.lane, fl.lane.adapter, fl.lane.version  # what this segment is served with
        if adapter is not None:
            extra["lora_path"] = adapter
        if fl.on_tokens is not None:

            def on_tokens(new: list[int]) -> None:
                fl.streamed += len(new)
                fl.on_tokens(new)

            extra["on_tokens"] = on_tokens

        def call(timeout_s: float):
            return client.generate(ids, params, rid=fl.engine_rid, timeout_s=timeout_s, **extra)

        out = await self._on_engine_until([fl], slot, len(ids) + params.max_new_tokens, call, deadline)
        if out is not None and (lane is not self.base or adapter is not None):
            # A lane's version is its run's, whatever the base weights' (vLLM reports no adapter's)
            out.token_versions, out.weight_version = [version] * len(out.output_ids), version
        return out

    # ------------------------------------------------------------------ control
    async def abort(self, request_id: str = "", abort_all: bool = False, run: str = "") -> int:
        """Abort a request of ``run``'s, or all of them (the proxy's own run: every run's)."""
        lane = self.lane(run)
        victims = [
            f
            for (owner, rid), f in self._in_flight.items()
            if (abort_all and (lane is self.base or f.lane is lane)) or (rid == request_id and owner == lane.name)
        ]
        for fl in victims:
            fl.aborted.set()
        await self._abort_at_engines(victims, self.config.control_timeout_s)
        return len(victims)

    async def _abort_at_engines(self, flights: list[_InFlight], timeout: float) -> None:
        """Abort the engine calls of ``flights`` (one whose abort fails ends at its deadline)."""
        calls = [
            self.clients[f.slot.name].abort(f.engine_rid, timeout_s=timeout) for f in flights if f.slot is not None
        ]
        await asyncio.gather(*calls, return_exceptions=True)

    async def suspend(self, mode: SuspendMode = "continue", timeout_s: float = 0.0, run: str = "") -> int:
        if mode not in _ENGINE_PAUSE_MODE:
            raise RequestInvalid("mode", f"must be one of {sorted(_ENGINE_PAUSE_MODE)}, got {mode!r}")
        _check_timeout(timeout_s)
        lane = self.lane(run)
        if lane is not self.base:
            return await self._suspend_lane(lane, mode, timeout_s)
        lane.mode = mode
        lane.epoch += 1
        lane.gate.clear()
        n = len(self._in_flight)
        timeout = timeout_s or self.config.control_timeout_s
        await self._fan_out(lambda c: c.pause(_ENGINE_PAUSE_MODE[mode], timeout_s=timeout), "pause")
        self.counters["suspends"] += 1
        return n

    async def _suspend_lane(self, lane: Lane, mode: SuspendMode, timeout_s: float) -> int:
        """Stop one run's requests, no other's: close its gate and abort its engine calls (``continue``
        re-submits them after ``resume``, with the adapter it then has)."""
        if mode == "in_place":
            raise RequestInvalid(
                "mode",
                f"run {lane.name!r} shares its engines: they pause every request or none (SGLang, vLLM), so a "
                "shared run suspends in continue or abort mode (controller.suspend_mode)",
            )
        lane.mode = mode
        lane.epoch += 1
        lane.gate.clear()
        mine = [f for f in self._in_flight.values() if f.lane is lane]
        timeout = timeout_s or self.config.control_timeout_s
        await self._abort_at_engines(mine, timeout)
        self.counters["suspends"] += 1
        return len(mine)

    async def resume(self, timeout_s: float = 0.0, run: str = "") -> None:
        _check_timeout(timeout_s)
        lane = self.lane(run)
        if lane is not self.base:
            lane.gate.set()
            return
        if self._lease is not None:  # the update that follows a memory release resumes: the lease is done
            self._lease.cancel()
            self._lease = None
        timeout = timeout_s or self.config.control_timeout_s
        await self._fan_out(lambda c: c.resume(timeout_s=timeout), "resume")
        self.base.gate.set()

    # ------------------------------------------------------------------ colocated engines
    async def release_memory(self, tags: list[str], lease_s: float, timeout_s: float = 0.0) -> tuple[bool, list[dict]]:
        """Suspend generation (``continue``: partial tokens are kept) and have every engine in
        rotation give back its GPU memory of ``tags`` while a colocated trainer trains. Past
        ``lease_s`` without ``resume_memory`` (a trainer that died), the proxy takes the memory
        back and resumes generation itself: the lease must outlast a step's training."""
        if not lease_s > 0 or not math.isfinite(lease_s):
            raise RequestInvalid("lease_s", f"must be a positive number of seconds, got {lease_s}")
        bad = [t for t in tags if t not in ("weights", "kv_cache")]
        if bad:
            raise RequestInvalid("tags", f"must be weights or kv_cache, got {bad[0]!r}")
        _check_timeout(timeout_s)
        timeout = timeout_s or self.config.update_weights_timeout_s
        await self.suspend("continue", timeout_s)
        if self._lease is not None:
            self._lease.cancel()
        self._lease = asyncio.ensure_future(self._lease_ends(lease_s, tags))
        self.counters["memory_releases"] += 1
        return await self._on_engines(lambda c: c.release_memory_occupation(tags or None, timeout_s=timeout), timeout)

    async def resume_memory(self, tags: list[str], timeout_s: float = 0.0) -> tuple[bool, list[dict]]:
        """Every engine in rotation takes its memory of ``tags`` back, and generation resumes (with
        the weights it had: the weight update that follows suspends it as any other). Resuming at
        once means no failure after this point can leave generation stopped."""
        _check_timeout(timeout_s)
        timeout = timeout_s or self.config.update_weights_timeout_s
        res = await self._on_engines(lambda c: c.resume_memory_occupation(tags or None, timeout_s=timeout), timeout)
        await self.resume(timeout_s)
        return res

    async def _lease_ends(self, lease_s: float, tags: list[str]) -> None:
        await asyncio.sleep(lease_s)
        self._lease = None  # (resume would cancel this very task)
        log.warning("colocated engines released for %.0f s with no resume: taking their memory back", lease_s)
        self.counters["memory_lease_expired"] += 1
        await self.resume_memory(tags)

    async def _on_engines(self, call, timeout: float) -> tuple[bool, list[dict]]:
        slots = [s for s in self.router.engines if s.healthy]
        results = await asyncio.gather(*(self._engine_update(s, -1, False, timeout, call) for s in slots))
        ok = bool(slots) and all(r["success"] for r in results)
        return ok, (list(results) if slots else [_NO_ENGINE])

    async def update_weights(
        self, model_path: str, version: int, timeout_s: float = 0.0, run: str = "", adapter: bool = False
    ) -> tuple[bool, list[dict]]:
        """Load ``model_path`` on every engine in rotation; succeed only if all confirm ``version``.
        ``adapter``: it is a LoRA adapter (PEFT's directory) the engines serve by name to ``run``'s
        requests, over unchanged base weights; a run that shares the engines publishes nothing else.

        Engines out of rotation are brought to this version before they rejoin (health loop).
        """
        if not model_path:
            raise RequestInvalid("model_path", "must not be empty")
        _check_timeout(timeout_s)
        timeout = timeout_s or self.config.update_weights_timeout_s
        lane = self.lane(run)
        if adapter:
            async with lane.updating:  # two at once could end on the older one
                return await self._update_adapter(lane, model_path, version, timeout)
        self.owns_weights(run, "a full-weight update")
        self._bucket_update = None  # a whole directory supersedes an in-memory update under way
        slots = [s for s in self.router.engines if s.healthy]
        results = await asyncio.gather(*(self._load_from_disk(s, model_path, version, timeout) for s in slots))
        return await self._updated(slots, list(results), model_path, version)

    # ------------------------------------------------------------------ adapters
    def _rooted(self, lane: Lane, path: str) -> str:
        """``path`` resolved, if it is an existing folder below a shared run's own folder (resolved
        once, at start: a link the run puts in place of its folder later leads nowhere else)."""
        if lane.root is None:
            return path
        try:
            resolved = Path(path).resolve(strict=True) if Path(path).is_absolute() else None
        except OSError:
            resolved = None
        if resolved is None or not resolved.is_relative_to(lane.root):
            raise RequestInvalid(
                "model_path",
                f"must be an existing absolute path below run {lane.name}'s folder {lane.root} "
                f"(proxy.runs.{lane.name}.adapter_root)",
            )
        return str(resolved)  # the engines get no link to follow

    async def _update_adapter(self, lane: Lane, path: str, version: int, timeout: float) -> tuple[bool, list[dict]]:
        """Every engine in rotation loads the adapter in ``path`` under a new name; once all have (and
        any engine that joined meanwhile), the lane's requests use it and its previous adapter is
        unloaded. Version 0 is the base weights (a new LoRA policy computes what its base does): the
        lane's adapter is dropped. A failure unloads what was loaded and leaves the lane as it was."""
        name = lane.adapter_name(version) if version else None
        slots = [s for s in self.router.engines if s.healthy]
        if name is None:
            results = [_done(s, version) for s in slots]
        else:
            path = self._rooted(lane, path)
            self._loading.add(name)
            try:
                results = list(
                    await asyncio.gather(*(self._load_adapter(s, name, path, version, timeout) for s in slots))
                )
                ok, results = self._outcome(slots, results)
                late = [s for s in self.router.engines if s.healthy and s not in slots] if ok else []
                for s, r in zip(
                    late, await asyncio.gather(*(self._load_adapter(s, name, path, version, timeout) for s in late))
                ):
                    if not r["success"]:
                        self._take_out(s, f"cannot load adapter {name}: {r['message']}")
            except BaseException:  # cancelled midway: any engine may hold it
                self._mark_stale(name, slots)
                raise
            finally:
                self._loading.discard(name)
            if not ok:  # where it loaded, and where a load that timed out here may still land
                maybe = [s for s, r in zip(slots, results) if r["success"] or r["cause"] in ("timeout", "unavailable")]
                await self._unload(name, maybe)
                return ok, results
        await self._swap_adapter(lane, name, path, version)
        self.counters["weight_updates"] += 1
        return True, results

    async def _swap_adapter(self, lane: Lane, name: str | None, path: str, version: int) -> None:
        """Serve ``name`` (None: the base weights) to ``lane`` from now on; unload its previous one.
        An engine away now gets it when it rejoins."""
        old, lane.adapter, lane.path, lane.version = lane.adapter, name, path, version
        lane.held = {s.name: version for s in self.router.engines if s.healthy}
        if old is not None:
            await self._unload(old, self.router.engines)

    async def _load_adapter(self, slot: EngineSlot, name: str, path: str, version: int, timeout: float) -> dict:
        """One engine's load of a lane's adapter, as ``_engine_update`` reports any engine's part."""
        res = await self._engine_update(
            slot, -1, False, timeout, lambda c: c.load_lora_adapter(name, path, timeout_s=timeout)
        )
        res["weight_version"] = version if res["success"] else -1  # the lane's, not the base weights'
        return res

    def _mark_stale(self, name: str, slots: list[EngineSlot]) -> None:
        """``name`` is to be unloaded from those of ``slots`` in rotation (one away is swept when it
        comes back)."""
        for s in slots:
            if s.healthy:
                self._stale.setdefault(s.name, set()).add(name)

    async def _unload(self, name: str, slots: list[EngineSlot]) -> None:
        """Unload adapter ``name`` from ``slots``; what an engine keeps is unloaded later."""
        self._mark_stale(name, slots)
        await asyncio.gather(*(self._tidy(s) for s in slots if s.healthy))

    async def _tidy(self, slot: EngineSlot, sweep: bool = False) -> None:
        """Unload what ``slot`` should not hold: the adapters marked stale, and with ``sweep`` (or
        after a refusal) every lane's adapter it lists that no lane serves now (a predecessor
        proxy's, one loaded while it was away, one a request was still using)."""
        async with self._slot_locks[slot.name]:
            await self._tidy_locked(slot, sweep)

    async def _tidy_locked(self, slot: EngineSlot, sweep: bool) -> None:
        if sweep or slot.name in self._look_again:
            self._look_again.discard(slot.name)
            try:
                names = await self.clients[slot.name].lora_adapters(self.config.control_timeout_s)
            except (EngineUnavailable, EngineRejected, ValueError) as e:
                log.debug("engine %s: cannot list its adapters (%s)", slot.name, e)
                names = []
                if not sweep:
                    self._look_again.add(slot.name)
            current = {lane.adapter for lane in self.lanes.values()} | self._loading
            stale = {n for n in names if ADAPTER_NAME.match(n) and n not in current}
            self._stale.setdefault(slot.name, set()).update(stale)
        stale = self._stale.get(slot.name, set())
        for name in sorted(stale):
            try:
                await self.clients[slot.name].unload_lora_adapter(name, timeout_s=self.config.control_timeout_s)
            except EngineRejected as e:  # still in use (or not there): its list tells, next round
                log.debug("engine %s: adapter %s not unloaded yet (%s)", slot.name, name, e)
                self.counters["adapter_unloads_refused"] += 1
                self._look_again.add(slot.name)
            except (EngineUnavailable, TimeoutError) as e:
                log.info("engine %s: unloading adapter %s later (%s)", slot.name, name, e)
                continue
            stale.discard(name)

    async def update_weights_bucket(
        self,
        version: int,
        index: int,
        data: bytes | bytearray,
        final: bool,
        restore_path: str,
        timeout_s: float = 0.0,
        fmt: str = "",
        base_version: int = 0,
        checksum: str = "",
    ) -> tuple[bool, list[dict]]:
        """Forward one bucket of an in-memory update (``http_buckets``) to every engine taking part.

        Bucket 0 starts the update: the engines in rotation then take part. The final bucket makes
        them apply it and, like ``update_weights``, succeeds only if every engine in rotation
        confirms ``version``; an engine that came into rotation midway loads ``restore_path``
        instead. Any failure ends the update: the caller rolls back and starts again from bucket 0.
        ``fmt``: what ``data`` holds, safetensors bytes (default), a delta in safetensors against
        ``base_version`` whose result has ``checksum`` (``safetensors_delta``), a LoRA policy's
        factors whose result has ``checksum`` (``safetensors_adapter``), or ``tensor_handles`` (``ipc``;
        ``tensor_handles_adapter``: handles to those factors).
        """
        if fmt not in BUCKET_FORMATS:
            raise RequestInvalid("format", f"must be one of {', '.join(BUCKET_FORMATS[1:])}, got {fmt!r}")
        if fmt in CHECKED_FORMATS and final and not checksum:
            raise RequestInvalid("checksum", f"a {fmt} update's final bucket carries the checksum of the result")

        def send(c, timeout: float):
            if fmt.startswith("tensor_handles"):
                extra = {"adapter": True, "checksum": checksum} if fmt == "tensor_handles_adapter" else {}
                payload = data.decode("ascii")
                return c.update_weights_from_tensor(payload, version if final else None, timeout_s=timeout, **extra)
            if fmt == "safetensors_delta":
                return c.update_weights_from_safetensors(
                    data, version, final, timeout_s=timeout, base_version=base_version, checksum=checksum
                )
            if fmt == "safetensors_adapter":
                return c.update_weights_from_safetensors(
                    data, version, final, timeout_s=timeout, adapter=True, checksum=checksum
                )
            return c.update_weights_from_safetensors(data, version, final, timeout_s=timeout)

        return await self._bucket(version, index, final, restore_path, timeout_s, send, "")

    async def init_weights_group(
        self, master_address: str, master_port: int, group_name: str, backend: str, timeout_s: float = 0.0
    ) -> tuple[int, list[str]]:
        """Plan a weight-update group hosted by the trainer (rank 0) at ``master_address:master_port``
        over the engines in rotation, each taking as many ranks as its tensor-parallel size, and
        start their joins. Returns the group's world size (for the trainer's own join, which
        completes the group) and its engines."""
        if not master_address:
            raise RequestInvalid("master_address", "must not be empty")
        if master_address not in self.config.weight_group_hosts:  # the group's store is not authenticated
            raise RequestInvalid(
                "master_address",
                f"{master_address!r} is not one of proxy.weight_group_hosts {self.config.weight_group_hosts}",
            )
        if not 1 <= master_port <= 65535:
            raise RequestInvalid("master_port", f"must be in [1, 65535], got {master_port}")
        if not group_name:
            raise RequestInvalid("group_name", "must not be empty")
        if backend not in ("gloo", "nccl"):
            raise RequestInvalid("backend", f"must be gloo or nccl, got {backend!r}")
        _check_timeout(timeout_s)
        timeout = timeout_s or self.config.update_weights_timeout_s
        if self._group is not None:
            self._group.joined.cancel()
        slots = [s for s in self.router.engines if s.healthy]
        if not slots:
            raise RequestInvalid("engines", "no engine in rotation to join a weight-update group")
        infos = await asyncio.gather(
            *(self.clients[s.name].server_info(self.config.control_timeout_s) for s in slots), return_exceptions=True
        )
        ranks = [_group_ranks(s, i) for s, i in zip(slots, infos)]
        offsets = list(itertools.accumulate([1, *ranks]))
        world = offsets[-1]
        joins = [
            self._engine_update(
                s,
                -1,
                False,
                timeout,
                lambda c, off=off: c.init_weights_update_group(
                    master_address, master_port, off, world, group_name, backend, timeout_s=timeout
                ),
            )
            for s, off in zip(slots, offsets)
        ]
        self._group = _GroupPlan(group_name, slots, asyncio.ensure_future(asyncio.gather(*joins)))
        return world, [s.name for s in slots]

    async def update_weights_distributed(
        self,
        version: int,
        index: int,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        final: bool,
        restore_path: str,
        checksum: str,
        timeout_s: float = 0.0,
        adapter: bool = False,
        result_checksum: str = "",
    ) -> tuple[bool, list[dict]]:
        """One bucket of a collective update (the ``collective`` transport): every engine of the
        group receives the tensors the trainer broadcasts. Like ``update_weights_bucket``, and
        each engine's ``checksum`` of what it received must match the trainer's where it reports one.
        ``adapter``: the tensors are a LoRA policy's factors, and the final bucket's result must have
        ``result_checksum``."""
        if not names or not len(names) == len(dtypes) == len(shapes):
            raise RequestInvalid("tensors", "at least one tensor, each with a name, a dtype and a shape")
        if adapter and final and not result_checksum:
            raise RequestInvalid(
                "result_checksum", "an adapter update's final bucket carries the checksum of the result"
            )
        group = self._group
        if group is None:
            raise RequestInvalid("group_name", "no weight-update group: InitWeightsGroup first")
        _check_timeout(timeout_s)
        timeout = timeout_s or self.config.update_weights_timeout_s
        if index == 0:  # the trainer joined, so every engine's join is answering now
            try:
                if group.joined.cancelled():  # superseded by a newer InitWeightsGroup
                    raise TimeoutError
                joined = await asyncio.wait_for(asyncio.shield(group.joined), timeout)
            except TimeoutError:
                joined = [
                    {
                        "engine": s.name,
                        "success": False,
                        "weight_version": s.weight_version,
                        "cause": "timeout",
                        "message": "did not join the weight-update group",
                    }
                    for s in group.slots
                ]
            ok, results = self._outcome(group.slots, list(joined))
            if not ok:
                self._group = None
                return ok, results

        def send(c, timeout: float):
            extra = {"adapter": True, "checksum": result_checksum} if adapter else {}
            return c.update_weights_from_distributed(
                names, dtypes, shapes, group.name, version if final else None, timeout_s=timeout, **extra
            )

        return await self._bucket(version, index, final, restore_path, timeout_s, send, checksum, group.slots)

    async def _bucket(
        self,
        version: int,
        index: int,
        final: bool,
        restore_path: str,
        timeout_s: float,
        send,
        checksum: str,
        members: list[EngineSlot] | None = None,
    ) -> tuple[bool, list[dict]]:
        """One bucket of an update that travels in pieces: ``send(client, timeout)`` forwards it to
        every engine taking part (``members``, default: those in rotation at bucket 0)."""
        _check_timeout(timeout_s)
        if index == 0:
            self._bucket_update = _BucketUpdate(version, members or [s for s in self.router.engines if s.healthy])
        update = self._bucket_update
        if update is None or update.version != version or update.next_index != index:
            expected = "0" if update is None else f"{update.next_index} of version {update.version}"
            raise RequestInvalid(
                "index",
                f"bucket {index} of version {version} does not continue the update under "
                f"way (expected bucket {expected})",
            )
        if final and not restore_path:
            raise RequestInvalid("restore_path", "the final bucket must name a directory holding the version")
        timeout = timeout_s or self.config.update_weights_timeout_s
        calls = [self._engine_update(s, version, final, timeout, lambda c: send(c, timeout)) for s in update.slots]
        results = list(await asyncio.gather(*calls))
        for r in results:
            got = r.pop("received_checksum", checksum)
            if r["success"] and checksum and got != checksum:
                r.update(success=False, cause="checksum", message="received bytes differ from the trainer's")
        update.next_index += 1
        if not final:
            ok, results = self._outcome(update.slots, results)
            if not ok:
                self._bucket_update = None
            return ok, results
        self._bucket_update = None
        late = [s for s in self.router.engines if s.healthy and s not in update.slots]
        results += await asyncio.gather(*(self._load_from_disk(s, restore_path, version, timeout) for s in late))
        return await self._updated(update.slots + late, results, restore_path, version)

    async def _updated(
        self, slots: list[EngineSlot], results: list[dict], path: str, version: int
    ) -> tuple[bool, list[dict]]:
        """The end of a full-weight update: ``version`` is the mesh's only if every engine confirmed
        it, and the proxy's own requests are served by these weights, with no adapter."""
        ok, results = self._outcome(slots, results)
        if ok:
            self._last_update = (path, version)
            self.weight_version = version
            self.counters["weight_updates"] += 1
            if self.base.adapter is not None:
                async with self.base.updating:  # not racing an adapter update of its own
                    await self._swap_adapter(self.base, None, "", version)
        return ok, results

    def _outcome(self, slots: list[EngineSlot], results: list[dict]) -> tuple[bool, list[dict]]:
        """Whether every engine taking part succeeded (none taking part is a failure), counted."""
        ok = bool(slots) and all(r["success"] for r in results)
        if not ok:
            self.counters["weight_update_failures"] += 1
        return ok, (results if slots else [_NO_ENGINE])

    def _load_from_disk(self, slot: EngineSlot, path: str, version: int, timeout: float):
        return self._engine_update(
            slot, version, True, timeout, lambda c: c.update_weights_from_disk(path, version, timeout_s=timeout)
        )

    async def _engine_update(self, slot: EngineSlot, version: int, applies: bool, timeout: float, call) -> dict:
        """One engine's part of an update; ``applies``: the call must leave it serving ``version``."""
        try:
            res = await asyncio.wait_for(call(self.clients[slot.name]), timeout)
            got = int(res.get("weight_version", -1)) if applies else slot.weight_version
            slot.weight_version = got
            ok = got == version or not applies
            msg = res.get("message", "") if ok else f"engine reports version {got}, expected {version}"
            cause = "" if ok else "version_mismatch"
            if ok and "received_checksum" in res:  # a collective bucket's, compared by ``_bucket``
                return {
                    "engine": slot.name,
                    "success": ok,
                    "weight_version": got,
                    "message": msg,
                    "cause": cause,
                    "received_checksum": res["received_checksum"],
                }
        except (EngineUnavailable, EngineRejected, TimeoutError, ValueError) as e:
            ok, got, msg = False, slot.weight_version, f"{type(e).__name__}: {e}"
            cause = _UPDATE_FAILURE_CAUSES.get(type(e), "error")
        return {"engine": slot.name, "success": ok, "weight_version": got, "message": msg, "cause": cause}

    async def _fan_out(self, call, what: str) -> None:
        slots = [s for s in self.router.engines if s.healthy]
        results = await asyncio.gather(*(call(self.clients[s.name]) for s in slots), return_exceptions=True)
        for s, r in zip(slots, results):
            if isinstance(r, Exception):
                self._take_out(s, f"{what} failed: {r}")

    # ------------------------------------------------------------------ health
    def _take_out(self, slot: EngineSlot, why: str) -> None:
        if slot.healthy:
            log.warning("engine %s (%s) out of rotation: %s", slot.name, slot.url, why)
        slot.healthy = False
        for lane in self.lanes.values():  # it may come back without them (a restarted engine)
            lane.held.pop(slot.name, None)
        slot.failures_total += 1
        self.counters["engine_failures"] += 1

    async def _read_version(self, slot: EngineSlot) -> None:
        try:
            info = await self.clients[slot.name].model_info(self.config.health_check_timeout_s)
            slot.weight_version = int_version(info.get("weight_version"))
        except (EngineUnavailable, EngineRejected, ValueError) as e:
            self._take_out(slot, f"model info failed: {e}")

    async def check_health(self) -> None:
        await asyncio.gather(*(self._probe(s) for s in self.router.engines))

    async def _probe(self, slot: EngineSlot) -> None:
        client = self.clients[slot.name]
        if not await client.health(self.config.health_check_timeout_s):
            slot.failed_probes += 1
            if slot.healthy and slot.failed_probes >= self.config.health_failures_to_remove:
                self._take_out(slot, f"{slot.failed_probes} health checks failed in a row")
            return
        slot.failed_probes = 0
        if slot.healthy:
            chore = self._tidying.get(slot.name)
            if (self._stale.get(slot.name) or slot.name in self._look_again) and (chore is None or chore.done()):
                self._tidying[slot.name] = asyncio.ensure_future(self._tidy(slot))  # never holding up the round
            return
        try:  # rejoin only at the mesh's weight version, and in the mesh's suspend state
            info = await client.model_info(self.config.health_check_timeout_s)
            slot.weight_version = int_version(info.get("weight_version"))
            if self._last_update and slot.weight_version != self._last_update[1]:
                res = await self._load_from_disk(slot, *self._last_update, self.config.update_weights_timeout_s)
                if not res["success"]:
                    return
            if not await self._reload_adapters(slot):
                return
            if self.suspended:
                await client.pause(_ENGINE_PAUSE_MODE[self.base.mode], timeout_s=self.config.control_timeout_s)
            else:
                await client.resume(timeout_s=self.config.control_timeout_s)
        except (EngineUnavailable, EngineRejected, ValueError):
            return
        log.info("engine %s (%s) back in rotation", slot.name, slot.url)
        slot.healthy = True

    async def _reload_adapters(self, slot: EngineSlot) -> bool:
        """Bring a rejoining engine every lane's adapter (one that restarted has none; one that only
        missed health checks holds them already: unloaded first), having unloaded the ones it
        holds that no lane serves. False when a load fails, or a lane's adapter changed meanwhile
        (the next health round tries again)."""
        async with self._slot_locks[slot.name]:
            self._stale.pop(slot.name, None)  # what it holds is listed now
            await self._tidy_locked(slot, sweep=True)
            for lane in self.lanes.values():
                adapter, path, version = lane.adapter, lane.path, lane.version
                if adapter is None or lane.held.get(slot.name) == version:
                    continue
                with contextlib.suppress(EngineUnavailable, EngineRejected, TimeoutError):
                    await self.clients[slot.name].unload_lora_adapter(adapter, timeout_s=self.config.control_timeout_s)
                timeout = self.config.update_weights_timeout_s
                if not (await self._load_adapter(slot, adapter, path, version, timeout))["success"]:
                    return False
                if lane.adapter != adapter:  # updated while this one loaded: what it got is stale already
                    self._stale.setdefault(slot.name, set()).add(adapter)
                    return False
                lane.held[slot.name] = version
            return True

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_s)
            try:
                await self.check_health()
            except Exception:  # the loop must outlive any single probe
                log.exception("health check round failed")

    def stats(self, run: str = "") -> dict:
        """As ``run`` sees it: its lane's gate, requests and version, and each engine's version of
        its policy (for a lane with an adapter, the adapter's version the engine holds, -1: none)."""
        lane = self.lane(run)
        engines = [vars(s).copy() for s in self.router.engines]
        if lane is not self.base or lane.adapter is not None:
            for e in engines:
                e["weight_version"] = lane.held.get(e["name"], -1) if lane.adapter else lane.version
        if lane is self.base:
            return {
                "suspended": self.suspended,
                "in_flight": len(self._in_flight),
                "requests_total": self.counters["requests"],
                "retries_total": self.counters["retries"],
                "weight_version": lane.version,
                "engines": engines,
            }
        mine = [f for f in self._in_flight.values() if f.lane is lane]
        for e in engines:  # a shared run sees its own requests on each engine, not the others' load
            e |= {"url": "", "outstanding_tokens": 0, "requests_total": 0}
            e["in_flight"] = sum(f.slot is not None and f.slot.name == e["name"] for f in mine)
        return {
            "suspended": self.suspended or lane.suspended,
            "in_flight": len(mine),
            "requests_total": lane.requests,
            "retries_total": lane.retries,
            "weight_version": lane.version,
            "engines": engines,
        }
