"""Async client for SGLang's HTTP API (and the embedded engine, which speaks the same subset).

It works unchanged against a real SGLang server: it only sends SGLang's field names and reads
``meta_info`` defensively (``output_token_weight_versions`` is a rollmesh extension that SGLang
does not send; ``weight_version`` is then used for every token). Where SGLang answers differently
from the embedded engine it follows SGLang's ``http_server.py``: ``/health`` and
``/abort_request`` answer 200 with an empty body; ``/update_weights_from_disk`` does not return
the version, so the client confirms it from the model info; older releases serve the model info
at ``/get_model_info`` only. No ``import sglang`` here.

It uses aiohttp rather than httpx: with hundreds of concurrent requests httpx's connection pool
costs ~9 ms of CPU per request on this project's 2-core machines, aiohttp ~0.5 ms.

Errors are split by what the caller should do: ``EngineRejected`` (HTTP 4xx: the request is bad,
do not retry) and ``EngineUnavailable`` (connection refused, timeout, 5xx: try another engine).
"""

from __future__ import annotations

import json
import ssl
from dataclasses import dataclass

import aiohttp

from rollout.sampling import SamplingParams
from sample_buffer.trajectory import FINISH_REASONS, FinishReason


class EngineRejected(ValueError):
    """The engine answered 4xx: the request itself is wrong. ``field`` names the input when known."""

    def __init__(self, message: str, field: str = "", status: int = 400) -> None:
        super().__init__(message)
        self.field, self.status = field, status


class EngineUnavailable(ConnectionError):
    """The engine did not answer in time or failed: the request may succeed elsewhere."""


@dataclass
class EngineResult:
    output_ids: list[int]
    behavior_logprobs: list[float]
    token_versions: list[int]
    finish_reason: FinishReason
    weight_version: int
    prompt_tokens: int
    e2e_latency_s: float
    queue_time_s: float | None = None  # rollmesh engines report these; a stock SGLang server may not
    ttft_s: float | None = None


def int_version(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1  # SGLang's default version string is "default"


def _finish_reason(value: str) -> FinishReason:
    return FinishReason(value) if value in FINISH_REASONS else FinishReason.ERROR


def parse_generate_response(body: dict) -> EngineResult:
    meta = body.get("meta_info", {})
    ids = list(body.get("output_ids", []))
    triples = meta.get("output_token_logprobs") or []
    version = int_version(meta.get("weight_version"))
    versions = meta.get("output_token_weight_versions") or [version] * len(ids)
    finish = meta.get("finish_reason") or {"type": "abort"}
    return EngineResult(
        output_ids=ids,
        behavior_logprobs=[float(t[0]) for t in triples],
        token_versions=[int(v) for v in versions],
        finish_reason=_finish_reason(finish.get("type", "abort") if isinstance(finish, dict) else str(finish)),
        weight_version=version,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        e2e_latency_s=float(meta.get("e2e_latency", 0.0)),
        queue_time_s=float(meta["queue_time"]) if "queue_time" in meta else None,
        ttft_s=float(meta["ttft"]) if "ttft" in meta else None,
    )


# SGLang's server and the embedded engine's both run on uvicorn, which closes a keep-alive connection
# idle for 5 s; aiohttp would keep it pooled for 15 s and could reuse a socket the server has just
# closed ("Server disconnected", "Can not write request body"), which takes a healthy engine out of
# rotation. Dropping idle connections first closes that race.
KEEPALIVE_S = 4.0


class SGLangClient:
    """One engine server. Every call has a timeout; none retries (the proxy decides that)."""

    def __init__(self, base_url: str, timeout_s: float = 60.0, max_connections: int = 0,
                 headers: dict[str, str] | None = None, ssl_context: ssl.SSLContext | None = None) -> None:  # fmt: skip
        """``headers`` go with every request (``Authorization: Bearer ...``: SGLang's ``--api-key``
        and rollmesh engines check it); ``ssl_context``: the one that trusts an https engine."""
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._max_connections = max_connections  # 0 = unbounded
        self._headers = headers or {}
        self._ssl = ssl_context
        self._session: aiohttp.ClientSession | None = None
        self._model_info_path = "/model_info"

    def _http(self) -> aiohttp.ClientSession:
        # Created on first use, inside the event loop that will run the requests.
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=KEEPALIVE_S,
                                             ssl=self._ssl or True)  # fmt: skip
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def _request(self, method: str, path: str, timeout_s: float | None,
                       session: aiohttp.ClientSession | None = None, **kwargs) -> dict:  # fmt: skip
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        try:
            async with (session or self._http()).request(method, url, timeout=timeout, **kwargs) as r:
                text = await r.text()
                status = r.status
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise EngineUnavailable(f"{url}: {type(e).__name__}: {e}") from e
        if 400 <= status < 500:
            try:
                body = json.loads(text)
            except ValueError:
                body = {}
            raise EngineRejected(body.get("message", text), body.get("field", ""), status)
        if status >= 500:
            raise EngineUnavailable(f"{url}: HTTP {status}: {text[:200]}")
        if not text.strip():
            return {}  # SGLang's /health and /abort_request: 200, no body
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if not isinstance(body, dict):  # not an engine we can speak with: take it out of rotation
            raise EngineUnavailable(f"{url}: HTTP {status} with a body that is not a JSON object: {text[:200]!r}")
        return body

    async def _post(self, path: str, timeout_s: float | None = None, **kwargs) -> dict:
        return await self._request("POST", path, timeout_s, **kwargs)

    async def _get(self, path: str, timeout_s: float | None = None) -> dict:
        return await self._request("GET", path, timeout_s)

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: SamplingParams | dict,
        rid: str | None = None,
        return_logprob: bool = True,
        timeout_s: float | None = None,
    ) -> EngineResult:
        if isinstance(sampling_params, SamplingParams):  # SGLang's names, every value sent: a server never
            sampling_params = sampling_params.model_dump(exclude_none=True)  # substitutes its own defaults
        payload = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": return_logprob}
        if rid is not None:
            payload["rid"] = rid
        return parse_generate_response(await self._post("/generate", timeout_s, json=payload))

    async def abort(self, rid: str | None = None, abort_all: bool = False, timeout_s: float = 5.0) -> dict:
        return await self._post("/abort_request", timeout_s, json={"rid": rid or "", "abort_all": abort_all})

    async def pause(self, mode: str = "abort", timeout_s: float = 10.0) -> dict:
        return await self._post("/pause_generation", timeout_s, json={"mode": mode})

    async def resume(self, timeout_s: float = 10.0) -> dict:
        return await self._post("/continue_generation", timeout_s, json={})

    async def update_weights_from_disk(self, model_path: str, weight_version: int, timeout_s: float = 120.0) -> dict:
        """Returns the engine's answer with ``weight_version`` the version it now serves (an int;
        -1 when it names none): SGLang's answer lacks it, so it is read back from the model info."""
        body = {"model_path": model_path, "weight_version": str(weight_version)}
        res = await self._post("/update_weights_from_disk", timeout_s, json=body)
        if "weight_version" not in res:
            res["weight_version"] = (await self.model_info(min(timeout_s, 10.0))).get("weight_version")
        res["weight_version"] = int_version(res["weight_version"])
        return res

    async def update_weights_from_safetensors(
        self, data: bytes, weight_version: int, final: bool, timeout_s: float = 120.0
    ) -> dict:
        """One bucket of named tensors as safetensors bytes (rollmesh extension); ``final`` applies
        every bucket of ``weight_version`` sent so far."""
        params = {"final": str(final).lower(), "weight_version": weight_version}
        # A fresh connection for each bucket: writing hundreds of MB into a pooled socket that the
        # server closed while the caller's loop was busy fails midway with a broken pipe (seen with
        # 256 MiB buckets through the proxy); one connect costs nothing next to the transfer.
        connector = aiohttp.TCPConnector(force_close=True, ssl=self._ssl or True)
        async with aiohttp.ClientSession(connector=connector, headers=self._headers) as session:
            return await self._request("POST", "/update_weights_from_safetensors", timeout_s, session=session,
                                       params=params, data=data)  # fmt: skip

    async def update_weights_from_tensors(
        self, buckets: list[dict], weight_version: int, timeout_s: float = 120.0
    ) -> dict:
        """Send buckets of named CPU tensors in order; the last applies them."""
        from safetensors.torch import save

        if not buckets:
            raise ValueError("buckets: at least one bucket of tensors is needed")
        res: dict = {}
        for i, bucket in enumerate(buckets):
            data = save({k: v.contiguous() for k, v in bucket.items()})
            res = await self.update_weights_from_safetensors(data, weight_version, i == len(buckets) - 1, timeout_s)
        return res

    async def model_info(self, timeout_s: float = 5.0) -> dict:
        try:
            return await self._get(self._model_info_path, timeout_s)
        except EngineRejected as e:
            if e.status != 404 or self._model_info_path == "/get_model_info":
                raise
        self._model_info_path = "/get_model_info"  # an older SGLang: remembered for next time
        return await self._get(self._model_info_path, timeout_s)

    async def health(self, timeout_s: float = 2.0) -> bool:
        try:
            await self._get("/health", timeout_s)
            return True
        except (EngineUnavailable, EngineRejected):
            return False
