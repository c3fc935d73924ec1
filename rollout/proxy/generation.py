"""Generation: a request from the suspend gate to its end, segment after segment.

A request waits at its lane's gate (and the proxy's), is routed to an engine and generated
there. An engine that fails (connection refused, timeout, 5xx) is taken out of rotation and the
request retried on another. A suspend in ``continue`` mode cuts a segment: after ``resume`` the
request is re-submitted as prompt + partial tokens and finishes under the new weights
(abort-and-continue); every token keeps the weight version that produced it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import replace

from rollout.engines.contract import MAX_SAMPLES
from rollout.engines.http_engine import EngineRejected, EngineUnavailable, OnTokens
from rollout.proxy.lanes import Lane
from rollout.proxy.pool import EnginePool
from rollout.proxy.request import (
    InFlight,
    NoEngineAvailable,
    ProxyRequest,
    ProxyResult,
    RequestInvalid,
    validate,
)
from rollout.proxy.router import EngineSlot
from sample_buffer import routing
from sample_buffer.trajectory import FinishReason

log = logging.getLogger(__name__)


class Generation:
    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool
        self._seq = itertools.count()  # a fresh engine-side id for every engine call

    async def generate(self, req: ProxyRequest, on_tokens: OnTokens | None = None, run: str = "") -> ProxyResult:
        """Generate ``req`` for ``run`` (its lane's gate and adapter). ``on_tokens`` streams it: each
        piece of new tokens is handed over as the engine makes it, across weight updates. An engine
        that fails after handing some over ends the request as aborted (a retry elsewhere would
        hand tokens over again)."""
        validate(req)
        lane = self.pool.lane(run)
        req.request_id = req.request_id or uuid.uuid4().hex
        key = (lane.name, req.request_id)
        if key in self.pool.in_flight:
            raise RequestInvalid("request_id", f"{req.request_id!r} is already in flight")
        fl = InFlight(req, ProxyResult(request_id=req.request_id), on_tokens=on_tokens, lane=lane)
        deadline = fl.t0 + (req.timeout_s or self.pool.config.request_timeout_s)
        self.pool.in_flight[key] = fl
        self.pool.counters["requests"] += 1
        lane.requests += 1
        await self._served(fl, deadline)
        return fl.result

    async def _served(self, fl: InFlight, deadline: float, first: tuple | None = None) -> None:
        """``fl`` (registered in flight) run to its end, then out of flight and counted by how it ended."""
        try:
            await self._run(fl, deadline, first)
        finally:
            del self.pool.in_flight[(fl.lane.name, fl.request.request_id)]
        fl.result.e2e_latency_s = time.perf_counter() - fl.t0
        self.pool.counters[f"finished_{fl.result.finish_reason}"] += 1

    async def generate_group(self, req: ProxyRequest, request_ids: list[str], run: str = "") -> list[ProxyResult]:
        """``len(request_ids)`` samples of ``req``'s prompt, each in flight under its own id (``abort``
        takes one): one engine call for all of them where the engine samples a prompt ``n`` times in
        one request (its prefill shared), then each on its own like ``generate`` (a sample cut by a
        weight update continues alone; a failed engine's samples are retried one by one)."""
        validate(req)
        if not request_ids or len(set(request_ids)) != len(request_ids) or not all(request_ids):
            raise RequestInvalid("request_ids", "one distinct, non-empty id per sample")
        if len(request_ids) > MAX_SAMPLES:
            raise RequestInvalid("request_ids", f"{len(request_ids)} samples; at most {MAX_SAMPLES} a request")
        if req.top_logprobs or req.return_routed_experts or req.images:
            raise RequestInvalid("request_ids", "a group's samples take no top_logprobs, routed experts or images")
        lane = self.pool.lane(run)
        taken = [rid for rid in request_ids if (lane.name, rid) in self.pool.in_flight]
        if taken:
            raise RequestInvalid("request_ids", f"{taken[0]!r} is already in flight")
        flights = [
            InFlight(replace(req, request_id=rid), ProxyResult(request_id=rid), lane=lane) for rid in request_ids
        ]
        deadline = flights[0].t0 + (req.timeout_s or self.pool.config.request_timeout_s)
        for fl in flights:
            self.pool.in_flight[(lane.name, fl.request.request_id)] = fl
        self.pool.counters["requests"] += len(flights)
        self.pool.counters["group_requests"] += 1
        lane.requests += len(flights)
        try:
            firsts = await self._first_segment(flights, deadline)
        except BaseException:
            for fl in flights:
                del self.pool.in_flight[(lane.name, fl.request.request_id)]
            raise
        await asyncio.gather(*(self._served(fl, deadline, first) for fl, first in zip(flights, firsts)))
        return [fl.result for fl in flights]

    async def _first_segment(self, flights: list[InFlight], deadline: float) -> list[tuple | None]:
        """The group's first engine call, shared; for each sample, what ``_run`` continues from (None:
        nothing yet, it starts on its own: no engine samples n at once here, or the engine failed)."""
        nothing: list[tuple | None] = [None] * len(flights)
        head = flights[0]
        if not await self._wait_open(head, deadline):
            return nothing  # each sample's own wait ends it (aborted, or at the deadline)
        slot = self.pool.router.pick(head.request.route, frozenset())
        client = self.pool.clients.get(slot.name) if slot is not None else None
        # A run's own lane, or an adapter (each token's version is theirs: ``_call_engine``): a sample a call.
        own = head.lane is not self.pool.base or head.lane.adapter is not None
        if client is None or not hasattr(client, "generate_samples") or own:
            return nothing
        epochs, t_call = (self.pool.base.epoch, head.lane.epoch), time.perf_counter()
        try:
            outs = await self._call_engine_samples(flights, slot, deadline)
        except EngineUnavailable as e:
            self.pool.take_out(slot, str(e))
            return nothing
        except EngineRejected as e:
            field = e.field or "input_ids"
            raise RequestInvalid(field, str(e).removeprefix(f"{field}: ")) from e
        return [(slot, out, t_call, epochs) for out in outs]

    async def _call_engine_samples(self, flights: list[InFlight], slot: EngineSlot, deadline: float) -> list:
        """One engine call for every sample of ``flights`` (``_call_engine``'s bookkeeping, per sample);
        on the deadline each is aborted there and its partial output taken back (None: not in time)."""
        req = flights[0].request
        rid = f"{req.request_id}#{next(self._seq)}"  # sample i's at the engine: SGLang's f"{rid}_{i}"
        for i, fl in enumerate(flights):
            fl.engine_rid = f"{rid}_{i}"
        cost = (len(req.input_ids) + req.sampling_params.max_new_tokens) * len(flights)
        client = self.pool.clients[slot.name]

        def call(timeout_s: float):
            return client.generate_samples(req.input_ids, req.sampling_params, rid, len(flights), timeout_s)

        outs = await self._on_engine_until(flights, slot, cost, call, deadline)
        return [None] * len(flights) if outs is None else outs

    async def _on_engine_until(self, flights: list[InFlight], slot: EngineSlot, cost: int, call, deadline: float):
        """``call(timeout_s)``, one engine call for ``flights``, with its load on ``slot`` counted while it
        runs. On the deadline they are aborted there and the partial output taken back within
        ``abort_grace_s``; None if it does not come."""
        for fl in flights:
            fl.slot = slot
        slot.in_flight += len(flights)
        slot.outstanding_tokens += cost
        slot.requests_total += 1
        grace = self.pool.config.abort_grace_s
        remaining = max(0.001, deadline - time.perf_counter())
        task = asyncio.ensure_future(call(remaining + grace))
        try:
            done, _ = await asyncio.wait([task], timeout=remaining)
            if not done:
                self.pool.counters["deadline_aborts"] += 1
                await self.pool.abort_at_engines(flights, grace)
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

    async def _run(self, fl: InFlight, deadline: float, first: tuple | None = None) -> None:
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

    async def _segment(self, fl: InFlight, deadline: float, failed: set[str]) -> tuple | None:
        """One engine call for the rest of ``fl`` (retried on other engines); None when the request
        ended without one (its finish reason set)."""
        req, res = fl.request, fl.result
        while True:
            if not await self._wait_open(fl, deadline):
                res.finish_reason = FinishReason.ABORT if fl.aborted.is_set() else FinishReason.TIMEOUT
                return None
            slot = self.pool.router.pick(req.route, frozenset(failed))
            if slot is None:
                if res.output_ids:  # keep what was generated; the caller decides
                    res.finish_reason = FinishReason.ABORT
                    return None
                raise NoEngineAvailable(f"no engine in rotation ({len(failed)} failed this request)")
            left = req.sampling_params.max_new_tokens - len(res.output_ids)
            params = req.sampling_params.model_copy(update={"max_new_tokens": left})
            epochs = (self.pool.base.epoch, fl.lane.epoch)
            t_call = time.perf_counter()
            try:
                out = await self._call_engine(fl, slot, req.input_ids + res.output_ids, params, deadline)
            except EngineUnavailable as e:
                self.pool.take_out(slot, str(e))
                failed.add(slot.name)
                if fl.streamed > len(res.output_ids):  # the caller has tokens of the failed segment
                    res.finish_reason = FinishReason.ABORT
                    return
                if len(failed) > self.pool.config.max_retries:
                    raise NoEngineAvailable(f"{len(failed)} engines failed this request; last: {e}") from e
                self.pool.counters["retries"] += 1
                fl.lane.retries += 1
                continue
            except EngineRejected as e:
                field = e.field or "input_ids"
                raise RequestInvalid(field, str(e).removeprefix(f"{field}: ")) from e
            if out is None:  # deadline passed and the engine did not give the partial back in time
                res.finish_reason = FinishReason.TIMEOUT
                return None
            return slot, out, t_call, epochs

    def _absorb(self, fl: InFlight, slot: EngineSlot, out, t_call: float, epochs: tuple, deadline: float) -> bool:
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
            self.pool.counters["routing_dropped"] += 1
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
        cut = [self.pool.base] if self.pool.base.epoch != epochs[0] and self.pool.base.mode != "in_place" else []
        return cut + [lane] if lane is not self.pool.base and lane.epoch != epochs[1] else cut

    async def _wait_open(self, fl: InFlight, deadline: float) -> bool:
        """Wait until neither the proxy's gate nor the request's lane's is closed."""
        t0 = time.perf_counter()
        try:
            while not fl.aborted.is_set():
                closed = next((g for g in (self.pool.base.gate, fl.lane.gate) if not g.is_set()), None)
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

    async def _call_engine(self, fl: InFlight, slot: EngineSlot, ids: list[int], params: dict, deadline: float):
        """One engine call. On the deadline, abort it there and take the partial output back."""
        fl.engine_rid = f"{fl.request.request_id}#{next(self._seq)}"
        client = self.pool.clients[slot.name]
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
        if out is not None and (lane is not self.pool.base or adapter is not None):
            # A lane's version is its run's, whatever the base weights' (vLLM reports no adapter's)
            out.token_versions, out.weight_version = [version] * len(out.output_ids), version
        return out

    async def abort(self, request_id: str = "", abort_all: bool = False, run: str = "") -> int:
        """Abort a request of ``run``'s, or all of them (the proxy's own run: every run's)."""
        lane = self.pool.lane(run)
        victims = [
            f
            for (owner, rid), f in self.pool.in_flight.items()
            if (abort_all and (lane is self.pool.base or f.lane is lane)) or (rid == request_id and owner == lane.name)
        ]
        for fl in victims:
            fl.aborted.set()
        await self.pool.abort_at_engines(victims, self.pool.config.control_timeout_s)
        return len(victims)
