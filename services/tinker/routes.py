"""The Tinker SDK's REST routes, by concern: the client's bootstrap and sessions, training (and the
REST client's runs and checkpoints), sampling and results. Most calls start work and answer a
request id at once (``Calls.future``); the client then long-polls ``retrieve_future``."""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request
from fastapi.responses import Response

from services.tinker import wire
from services.tinker.errors import TinkerError, user_error
from services.tinker.service import TinkerService

log = logging.getLogger(__name__)
API = "/api/v1"
PROTO = "application/x-protobuf"


class Calls:
    """What every route shares: the service, JSON bodies, and starting work as a future."""

    def __init__(self, service: TinkerService, max_body_bytes: int) -> None:
        self.service, self.max_body_bytes = service, max_body_bytes
        self.counts = service.counts

    async def body(self, request: Request) -> dict:
        try:
            data = json.loads(await request.body() or b"{}")
        except ValueError as e:
            raise TinkerError("body", f"malformed JSON: {e}") from None
        if not isinstance(data, dict):
            raise TinkerError("body", "a JSON object")
        return data

    def future(self, request: Request, route: str, make, proto: bool = False, samples: int = 0) -> dict:
        """Start ``make()``'s work and answer its request id. A call sent again with its idempotency key
        (the SDK retries a POST whose answer it lost) gets the first one's answer, and runs once."""
        owner, key = request.state.owner, request.headers.get("x-idempotency-key")
        if key and (seen := self.service.answered(owner, key)) is not None:
            return seen
        self.service.check_room(owner)
        work = make()
        self.counts[(route, "accepted")] += 1
        answer = {"request_id": self.service.submit(owner, self._counted(route, work), proto)}
        if samples:  # asample: an id per sample, which the SDK puts on its sequences
            answer["sample_sequence_ids"] = [f"{answer['request_id']}:{i}" for i in range(samples)]
        if key:
            self.service.remember(owner, key, answer)
        return answer

    async def _counted(self, route: str, work):
        try:
            result = await work
        except Exception as e:
            self.counts[(route, "error")] += 1
            if user_error(e) is None:
                log.exception("%s failed", route)
            raise
        self.counts[(route, "ok")] += 1
        return result


def session_router(calls: Calls) -> APIRouter:
    router, service = APIRouter(), calls.service

    @router.post(f"{API}/client/config")
    async def client_config():
        # a static key (no JWT exchange), protobuf uncompressed. The SDK's own transport (pyqwest), as its
        # default: over httpx, a cookbook run lost one poll's answer each step and waited 45 s for its timeout.
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False}

    @router.post(f"{API}/client/dynamic_config")
    async def dynamic_config():
        return {}

    @router.get(f"{API}/healthz")
    async def healthz():
        return {"status": "ok"}

    @router.get("/health")
    async def health():
        return {"status": "ok"}

    @router.get(f"{API}/get_server_capabilities")
    async def capabilities():
        return {"supported_models": [{"model_name": service.base_model, "trainable": True, "sampleable": True}]}

    @router.post(f"{API}/create_session")
    async def create_session(request: Request):
        await calls.body(request)
        return {"session_id": service.create_session(request.state.owner), "type": "create_session"}

    @router.post(f"{API}/session_heartbeat")
    async def heartbeat(request: Request):
        b = await calls.body(request)
        service.heartbeat(request.state.owner, str(b.get("session_id", "")))
        return {"type": "session_heartbeat"}

    @router.post(f"{API}/sessions/{{sid}}/finish")
    async def finish(sid: str, request: Request):
        await service.finish_session(request.state.owner, sid)
        return {}

    @router.post(f"{API}/telemetry")
    async def telemetry():
        return {"status": "accepted"}  # nothing is sent anywhere

    return router


def training_router(calls: Calls) -> APIRouter:
    router, service = APIRouter(), calls.service

    @router.post(f"{API}/create_model")
    async def create_model(request: Request):
        b = await calls.body(request)
        return calls.future(request, "create_model", lambda: service.create_model(request.state.owner, b))

    @router.post(f"{API}/get_info")
    async def get_info(request: Request):
        return service.info(request.state.owner, str((await calls.body(request)).get("model_id", "")))

    @router.post(f"{API}/unload_model")
    async def unload_model(request: Request):
        b = await calls.body(request)
        return calls.future(
            request, "unload_model", lambda: service.unload_model(request.state.owner, str(b.get("model_id", "")))
        )

    @router.post(f"{API}/forward_backward")
    async def forward_backward(request: Request):
        if request.headers.get("content-encoding", "identity") != "identity":
            raise TinkerError("content-encoding", "compressed bodies are not taken (client/config says so)")
        service.check_room(request.state.owner)  # before its body (up to calls.max_body_bytes) is read
        msg = wire.parse_forward_backward(await request.body())
        m = service.model(request.state.owner, msg.model_id)  # an unknown model: 404 now, not in a future
        limits = (service.pool.max_positions, calls.max_body_bytes // 4)  # the values of a dense float32 body at most
        req = service.checked_call(m, int(msg.seq_id), lambda: wire.read_forward_backward(msg, *limits))
        return calls.future(
            request, "forward_backward", lambda: service.forward_backward(request.state.owner, req), proto=True
        )

    @router.post(f"{API}/optim_step")
    async def optim_step(request: Request):
        b = await calls.body(request)
        return calls.future(request, "optim_step", lambda: service.optim_step(request.state.owner, b))

    @router.post(f"{API}/save_weights")
    async def save_weights(request: Request):
        b = await calls.body(request)
        return calls.future(request, "save_weights", lambda: service.save_weights(request.state.owner, b))

    @router.post(f"{API}/save_weights_for_sampler")
    async def save_for_sampler(request: Request):
        b = await calls.body(request)
        return calls.future(
            request, "save_weights_for_sampler", lambda: service.save_weights_for_sampler(request.state.owner, b)
        )

    @router.post(f"{API}/load_weights")
    async def load_weights(request: Request):
        b = await calls.body(request)
        return calls.future(request, "load_weights", lambda: service.load_weights(request.state.owner, b))

    # the REST client: runs and checkpoints
    @router.get(f"{API}/training_runs/{{run_id}}")
    async def training_run(run_id: str, request: Request):
        return service.training_run(request.state.owner, run_id)

    @router.get(f"{API}/training_runs/{{run_id}}/checkpoints")
    async def list_checkpoints(run_id: str, request: Request):
        return service.checkpoints(request.state.owner, run_id)

    @router.delete(f"{API}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request):
        await service.delete_checkpoint(request.state.owner, run_id, checkpoint_id)
        return None

    @router.post(f"{API}/weights_info")
    async def weights_info(request: Request):
        return service.weights_info(request.state.owner, await calls.body(request))

    return router


def sampling_router(calls: Calls) -> APIRouter:
    router, service = APIRouter(), calls.service

    @router.post(f"{API}/create_sampling_session")
    async def create_sampling_session(request: Request):
        sid = service.create_sampling_session(request.state.owner, await calls.body(request))
        return {"sampling_session_id": sid, "type": "create_sampling_session"}

    @router.get(f"{API}/samplers/{{sampler_id}}")
    async def get_sampler(sampler_id: str, request: Request):
        return service.sampler_info(request.state.owner, sampler_id)

    @router.post(f"{API}/asample")
    async def asample(request: Request):
        b = await calls.body(request)
        make = lambda: service.sample(request.state.owner, b)  # noqa: E731
        return calls.future(request, "asample", make, proto=True, samples=b.get("num_samples", 1))

    # results
    @router.post(f"{API}/retrieve_future")
    async def retrieve_future(request: Request):
        rid = str((await calls.body(request)).get("request_id", ""))
        r = await service.retrieve(request.state.owner, rid, service.config.poll_hold_s)
        if r is None:
            return {"type": "try_again", "request_id": rid, "queue_state": "active"}
        e = r.future.exception()
        if e is not None:
            refused = user_error(e)
            if refused is None:
                return {"error": f"internal error: {type(e).__name__}: {e}", "category": "server"}
            return {"error": str(refused), "category": refused.category}
        result = r.future.result()
        return Response(result, media_type=PROTO) if r.proto else result

    return router
