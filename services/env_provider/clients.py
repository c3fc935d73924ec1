"""Clients of environment providers, one per protocol, each implementing the rollout loop's
``ProviderClient`` port (``rollout/envs/remote.py``): failures become ``ProviderError`` with
their kind, so the pool decides alike what to retry, whatever the wire.

- ``grpc``: rollmesh's ``EnvProvider`` service (one channel per provider, calls multiplexed).
- ``http``: the same over REST, OpenEnv's routes with sessions keyed by ``episode_id`` (one
  aiohttp session per provider: a pool of keep-alive connections).
- ``openenv``: OpenEnv's WebSocket protocol (``/ws``; one connection per episode), which any
  server built with ``openenv-core`` speaks unchanged.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc

from rollout.budgets import Budgets
from rollout.envs.remote import Observation, ProviderError, ProviderInfo, ProviderTimeout, RemoteEnvConfig
from sample_buffer.deadlines import wait_for
from sample_buffer.vision import MAX_IMAGES, VisionError, image_bytes
from services.auth import AuthConfig, AuthError, Role, http_headers, provider_auth
from services.grpc_util import channel
from services.pb.rollmesh.v1 import env_provider_pb2 as pb
from services.pb.rollmesh.v1 import env_provider_pb2_grpc as pb_grpc
from services.wire_limits import PROVIDER_MAX_ANSWER_BYTES

# A provider that answers at all answers in time; these mean it is not there (or no longer).
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN}
_WS_GONE = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.ERROR)


def _role(value: str) -> str:
    return value or "user"


def _info(raw: str) -> dict:
    try:
        info = json.loads(raw) if raw else {}
    except ValueError:
        raise ProviderError("garbage", f"info_json is not JSON: {raw[:80]!r}") from None
    if not isinstance(info, dict):
        raise ProviderError("garbage", "info_json is not a JSON object")
    return info


class GrpcProviderClient:
    def __init__(self, address: str, config: RemoteEnvConfig, auth: AuthConfig) -> None:
        self.address, self.config = address, config
        self._channel = channel(address, [("grpc.max_receive_message_length", PROVIDER_MAX_ANSWER_BYTES)], auth)
        self._stub = pb_grpc.EnvProviderStub(self._channel)

    async def _call(self, method: str, request, timeout_s: float):
        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:  # the provider's environment, or no answer at all
                error = ProviderTimeout if e.details() and e.details().startswith("timeout_s:") else TimeoutError
                raise error(f"{self.address}: {method}: {e.details()}") from None
            if code in _UNREACHABLE:
                raise ProviderError("unreachable", f"{self.address}: {method}: {e.details()}") from None
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ProviderError("busy", f"{self.address}: {e.details()}", retryable=True) from None
            if code == grpc.StatusCode.INTERNAL:  # an answer grpc could not even parse
                raise ProviderError("garbage", f"{self.address}: {method}: {e.details()}") from None
            raise ProviderError("refused", f"{self.address}: {method}: {code.name}: {e.details()}") from None

    async def describe(self, timeout_s: float) -> ProviderInfo:
        r = await self._call("Describe", pb.DescribeRequest(), timeout_s)
        b = r.budgets
        declared = {
            k: v
            for k, v in (
                ("step_s", b.step_s),
                ("generation_s", b.generation_s),
                ("generation_tokens", b.generation_tokens),
                ("episode_s", b.episode_s),
            )
            if v
        }
        return ProviderInfo(name=r.name, idempotent_steps=r.idempotent_steps, budgets=_budgets(declared))

    async def reset(self, episode_id: str, seed: int, timeout_s: float) -> Observation:
        r = await self._call(
            "Reset", pb.ResetRequest(env_name=self.config.env_name, seed=seed, episode_id=episode_id), timeout_s
        )
        return Observation(r.observation, _role(r.role), info=_info(r.info_json), images=tuple(r.images))

    async def step(self, episode_id: str, action: str, request_id: str, timeout_s: float) -> Observation:
        req = pb.StepRequest(episode_id=episode_id, action=action, request_id=request_id, timeout_s=timeout_s)
        r = await self._call("Step", req, timeout_s)
        return Observation(r.observation, _role(r.role), r.reward, r.done, _info(r.info_json), tuple(r.images))

    async def close_episode(self, episode_id: str, timeout_s: float) -> None:
        await self._call("Close", pb.CloseRequest(episode_id=episode_id), timeout_s)

    async def healthy(self, timeout_s: float) -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            stub = health_pb2_grpc.HealthStub(self._channel)
            r = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    async def aclose(self) -> None:
        await self._channel.close()


class _HttpBase:
    """What the REST and WebSocket clients share: one aiohttp session per provider, OpenEnv's
    answer ``{observation, reward, done}`` read strictly."""

    def __init__(self, address: str, config: RemoteEnvConfig, auth: AuthConfig) -> None:
        self.address, self.config = address.rstrip("/"), config
        self._headers, self._ssl = http_headers(auth, Role.DATA), auth.client_ssl()
        fmt, act = config.observation_format, config.action_format
        self._format = function_at(fmt, "env.observation_format") if fmt else None
        self._to_action = function_at(act, "env.action_format") if act else None
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:  # made lazily: it must be made on the running loop
            self._session = aiohttp.ClientSession(
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=0, ssl=self._ssl if self._ssl is not None else True),
            )
        return self._session

    def _action(self, text: str) -> dict:
        """The action the environment takes: ``{action_key: text}``, or what ``env.action_format`` makes
        of the text (its fields, or the value of action_key); its ValueError: no valid action."""
        if self._to_action is None:
            return {self.config.action_key: text}
        try:
            value = self._to_action(text)
        except ValueError as e:  # the text says no action: the policy's mistake
            raise ProviderError("invalid_action", f"env.action_format: {e}") from None
        except Exception as e:  # the formatter's own bug: the episode's error, named
            raise ProviderError("action", f"env.action_format raised {type(e).__name__}: {e}") from None
        action = value if isinstance(value, dict) else {self.config.action_key: value}
        try:
            json.dumps(action)
        except (TypeError, ValueError) as e:
            raise ProviderError("action", f"env.action_format: not JSON: {e}") from None
        return action

    async def _json(self, method: str, path: str, timeout_s: float, body: dict | None = None, params=None) -> dict:
        url = self.address + path
        try:
            async with self.session.request(
                method, url, json=body, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as r:
                raw = await r.read()
        except TimeoutError:
            raise TimeoutError(f"{url}: no answer in {timeout_s:g} s") from None
        except aiohttp.ClientError as e:
            raise ProviderError("unreachable", f"{url}: {type(e).__name__}: {e}") from None
        try:
            data = json.loads(raw.decode("utf-8")) if raw else {}
        except (UnicodeDecodeError, ValueError):
            raise ProviderError("garbage", f"{url}: HTTP {r.status}, not a JSON body: {raw[:80]!r}") from None
        if r.status == 504 and isinstance(data, dict) and data.get("field") == "timeout_s":  # the provider's env
            raise ProviderTimeout(f"{url}: {_message(data)}")
        if r.status == 503:
            raise ProviderError("busy", f"{url}: {_message(data)}", retryable=True)
        if r.status > 500:  # 502/504 from a gateway: the provider is not answering (500: its environment raised)
            raise ProviderError("unreachable", f"{url}: HTTP {r.status}: {_message(data)}")
        if r.status == 422 and path == "/step" and _action_invalid(data):
            raise ProviderError("invalid_action", f"{url}: {_message(data)}")
        if r.status >= 400:
            raise ProviderError("refused", f"{url}: HTTP {r.status}: {_message(data)}")
        if not isinstance(data, dict):
            raise ProviderError("garbage", f"{url}: the answer is not a JSON object")
        return data

    def _observation(self, data: dict) -> Observation:
        """OpenEnv's ``{observation: {...}, reward, done}``: the text is ``observation_key``."""
        obs, reward, done = data.get("observation"), data.get("reward"), data.get("done", False)
        if not isinstance(obs, dict):
            raise ProviderError("garbage", f"{self.address}: 'observation' is not an object: {str(obs)[:80]!r}")
        if not isinstance(done, bool) or not (reward is None or isinstance(reward, int | float)):
            raise ProviderError("garbage", f"{self.address}: 'done' or 'reward' has the wrong type")
        content = self._text(obs)
        if content is None and done:  # a last observation needs no text (OpenEnv's end their fields with null)
            content = ""
        elif content is None:
            keys = self.config.observation_key
            named = [keys] if isinstance(keys, str) else keys
            # A field that is there but not text (or a formatter's answer) is the observation's fault;
            # only a contract without the field at all is the provider's (out of rotation).
            kind = "observation" if self._format is not None or any(k in obs for k in named) else "garbage"
            raise ProviderError(
                kind,
                f"{self.address}: no text in the observation's {keys!r} "
                f"(its fields: {sorted(obs)}; env.observation_key or env.observation_format says what to show)",
            )
        role = obs.get("role") or "user"
        info = obs.get("info") if isinstance(obs.get("info"), dict) else {}
        return Observation(content, role, float(reward or 0.0), done, info, self._images(obs))

    def _images(self, obs: dict) -> tuple[bytes, ...]:
        """The observation's images (``image_key``): data URLs or base64, decoded; a URL is refused."""
        key, value = self.config.image_key, obs.get(self.config.image_key)
        items = [] if value is None else [value] if isinstance(value, str) else value
        if not isinstance(items, list) or len(items) > MAX_IMAGES:
            raise ProviderError("observation", f"{key}: a data URL or a list of at most {MAX_IMAGES} of them")
        try:
            return tuple(image_bytes(x, f"{key}[{i}]") for i, x in enumerate(items))
        except VisionError as e:
            raise ProviderError("observation", str(e)) from None

    def _text(self, obs: dict) -> str | None:
        """The text the model sees: the formatter's, or the first of the keys that holds any."""
        if self._format is not None:
            try:
                text = self._format(obs)
            except Exception as e:  # the formatter is the run's code: its failure is the episode's
                raise ProviderError("observation", f"env.observation_format raised {type(e).__name__}: {e}") from None
            return text if isinstance(text, str) else None
        keys = self.config.observation_key
        texts = [_as_text(obs.get(key)) for key in ([keys] if isinstance(keys, str) else keys)]
        # The first that holds text; else an empty one, which the episode then refuses as empty.
        return next((t for t in texts if t), next((t for t in texts if t is not None), None))

    async def healthy(self, timeout_s: float) -> bool:
        try:
            async with self.session.get(self.address + "/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _budgets(declared) -> Budgets | None:
    """A provider's declared budgets; ones that do not parse are the provider's bug (garbage)."""
    if not declared:
        return None
    try:
        return Budgets.model_validate(declared)
    except ValueError as e:
        raise ProviderError("garbage", f"budgets: {e}") from None


_REQUEST_PARTS = frozenset({"body", "query", "path", "header", "cookie"})  # FastAPI's, not an action's fields


def _action_invalid(data) -> bool:
    """OpenEnv's 422 for an action its class does not validate (pydantic's errors, located in the
    action's fields), not FastAPI's for a malformed request (located in ``body``): the first is the
    policy's answer, the second would be this client's bug."""
    errors = data.get("detail") if isinstance(data, dict) else None
    return (
        isinstance(errors, list)
        and bool(errors)
        and all(isinstance(e, dict) and (e.get("loc") or ["body"])[0] not in _REQUEST_PARTS for e in errors)
    )


def _message(data) -> str:
    if isinstance(data, dict):
        return str(data.get("message") or data.get("detail") or data)[:300]
    return str(data)[:300]


class HttpProviderClient(_HttpBase):
    """REST with sessions keyed by ``episode_id`` (rollmesh's provider and any server that keys them alike)."""

    async def describe(self, timeout_s: float) -> ProviderInfo:
        data = await self._json("GET", "/metadata", timeout_s)
        return ProviderInfo(
            name=str(data.get("name", "")),
            idempotent_steps=data.get("idempotent_steps") is True,
            budgets=_budgets(data.get("budgets")),
        )

    async def reset(self, episode_id: str, seed: int, timeout_s: float) -> Observation:
        body = {"seed": seed, "episode_id": episode_id}
        return self._observation(await self._json("POST", "/reset", timeout_s, body))

    async def step(self, episode_id: str, action: str, request_id: str, timeout_s: float) -> Observation:
        body = {
            "action": self._action(action),
            "episode_id": episode_id,
            "request_id": request_id,
            "timeout_s": timeout_s,
        }
        return self._observation(await self._json("POST", "/step", timeout_s, body))

    async def close_episode(self, episode_id: str, timeout_s: float) -> None:
        await self._json("POST", "/close", timeout_s, {"episode_id": episode_id})


class _Socket:
    """One episode's WebSocket, read all the time by a task of its own: aiohttp answers the
    server's keepalive pings only while something reads, and an episode reads nothing while the
    policy generates, often for longer than a server waits for its pong (uvicorn: 20 + 20 s), so
    without a reader the server drops the connection mid-episode."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.replies: asyncio.Queue[aiohttp.WSMessage] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            message = await self.ws.receive()  # pings are answered in here
            self.replies.put_nowait(message)
            if message.type in _WS_GONE:
                return

    async def close(self) -> None:
        self._reader.cancel()
        if not self.ws.closed:
            await self.ws.close()


def _as_text(value) -> str | None:
    """A field's text: a string, or a list of messages (dicts with ``content``, or strings)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = [m.get("content") if isinstance(m, dict) else m for m in value]
        if parts and all(isinstance(p, str) for p in parts):
            return "\n".join(parts)
    return None


def function_at(path: str, field: str):
    """``module:function`` of the run's config (never a caller's), imported once; a ValueError
    naming ``field`` if it does not import or is no function."""
    import importlib

    module, _, name = path.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name) if name else None
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{field}: {path!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{field}: {path!r} is not 'module:function'")
    return fn


class OpenEnvClient(_HttpBase):
    """OpenEnv's WebSocket sessions: each episode is one connection to ``/ws``, its messages
    ``{type: reset|step|close, data}`` answered by ``{type: observation|error, data}``."""

    def __init__(self, address: str, config: RemoteEnvConfig, auth: AuthConfig) -> None:
        super().__init__(address, config, auth)
        self._sockets: dict[str, _Socket] = {}

    async def describe(self, timeout_s: float) -> ProviderInfo:
        # OpenEnv's /metadata names the environment; it promises nothing about repeated steps.
        try:
            data = await self._json("GET", "/metadata", timeout_s)
        except ProviderError as e:
            if e.kind != "refused":  # an OpenEnv server without /metadata is still one
                raise
            data = {}
        return ProviderInfo(
            name=str(data.get("name", "")), idempotent_steps=False, budgets=_budgets(data.get("budgets"))
        )

    async def _send(self, episode_id: str, message: dict, timeout_s: float) -> dict:
        sock = self._sockets.get(episode_id)
        if sock is None:
            raise ProviderError("refused", f"{self.address}: episode {episode_id!r} has no open session")
        if sock.ws.closed:  # the server closed it: it died, or dropped the session
            await self._drop(episode_id)
            raise ProviderError("unreachable", f"{self.address}/ws: the session of {episode_id!r} was closed")
        try:
            await sock.ws.send_str(json.dumps(message))
            reply = await wait_for(sock.replies.get(), timeout_s)
        except TimeoutError:
            await self._drop(episode_id)  # an answer arriving later would be read as the next one's
            raise TimeoutError(f"{self.address}/ws: no answer in {timeout_s:g} s") from None
        except (aiohttp.ClientError, ConnectionError) as e:
            await self._drop(episode_id)
            raise ProviderError("unreachable", f"{self.address}/ws: {type(e).__name__}: {e}") from None
        if reply.type != aiohttp.WSMsgType.TEXT:
            await self._drop(episode_id)
            kind = "unreachable" if reply.type in _WS_GONE else "garbage"
            raise ProviderError(kind, f"{self.address}/ws: {reply.type.name} instead of an answer")
        try:
            data = json.loads(reply.data)
        except ValueError:
            raise ProviderError("garbage", f"{self.address}/ws: not JSON: {reply.data[:80]!r}") from None
        if not isinstance(data, dict) or data.get("type") not in ("observation", "error", "state"):
            raise ProviderError("garbage", f"{self.address}/ws: not an OpenEnv message: {str(data)[:80]!r}")
        if data["type"] == "error":
            error = data.get("data") if isinstance(data.get("data"), dict) else {}
            if error.get("code") == "TIMEOUT":  # rollmesh's provider: its environment missed the deadline
                await self._drop(episode_id)
                raise ProviderTimeout(f"{self.address}/ws: {_message(error)}")
            if error.get("code") == "VALIDATION_ERROR" and message["type"] == "step":  # (this client's are valid)
                errors = str(error.get("errors"))[:300]  # the action's fields its class refused
                raise ProviderError("invalid_action", f"{self.address}/ws: {_message(error)}: {errors}")
            if error.get("code") == "CAPACITY_REACHED":  # OpenEnv's: every session taken; the episode waits
                await self._drop(episode_id)
                raise ProviderError("busy", f"{self.address}/ws: {_message(error)}", retryable=True)
            raise ProviderError("refused", f"{self.address}/ws: {_message(error)}")
        return data.get("data") if isinstance(data.get("data"), dict) else {}

    async def reset(self, episode_id: str, seed: int, timeout_s: float) -> Observation:
        await self._drop(episode_id)
        try:
            ws = await self.session.ws_connect(
                self.address + "/ws",
                timeout=aiohttp.ClientWSTimeout(ws_close=min(timeout_s, 5.0)),
                max_msg_size=16 * 1024 * 1024,
            )
            self._sockets[episode_id] = _Socket(ws)
        except aiohttp.WSServerHandshakeError as e:
            kind = "refused" if e.status in (401, 403) else "unreachable"
            raise ProviderError(kind, f"{self.address}/ws: handshake refused (HTTP {e.status})") from None
        except (aiohttp.ClientError, ConnectionError) as e:
            raise ProviderError("unreachable", f"{self.address}/ws: {type(e).__name__}: {e}") from None
        return self._observation(await self._send(episode_id, {"type": "reset", "data": {"seed": seed}}, timeout_s))

    async def step(self, episode_id: str, action: str, request_id: str, timeout_s: float) -> Observation:
        message = {"type": "step", "data": self._action(action)}
        return self._observation(await self._send(episode_id, message, timeout_s))

    async def close_episode(self, episode_id: str, timeout_s: float) -> None:
        sock = self._sockets.get(episode_id)
        if sock is not None and not sock.ws.closed:
            try:
                await wait_for(sock.ws.send_str(json.dumps({"type": "close"})), timeout_s)
            except (TimeoutError, aiohttp.ClientError, ConnectionError):
                pass
        await self._drop(episode_id)

    async def _drop(self, episode_id: str) -> None:
        sock = self._sockets.pop(episode_id, None)
        if sock is not None:
            await sock.close()

    async def aclose(self) -> None:
        for k in list(self._sockets):
            await self._drop(k)
        await super().aclose()


# The env protocols (rollout/envs/remote.py's EnvProtocol, env.protocol in a run config), each
# with its client. Adding one: its name there, its client here (a RemoteEnv port), tests.
CLIENTS = {"grpc": GrpcProviderClient, "http": HttpProviderClient, "openenv": OpenEnvClient}


def build_pool(config: RemoteEnvConfig, auth: AuthConfig):
    """The providers of ``config``, called with their own token (``env.token_env``), never the mesh's."""
    from rollout.envs.remote import ProviderPool

    try:
        auth = provider_auth(auth, config.token_env)
    except AuthError as e:
        raise ValueError(str(e)) from None
    return ProviderPool([CLIENTS[config.protocol](a, config, auth) for a in config.addresses], config)
