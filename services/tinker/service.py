"""What the Tinker API's calls do, without HTTP: sessions, training models (one LoRA adapter each
on the shared base, ``trainer/adapter_pool.py``), saved weights, sampling sessions (adapters the
engine serves per request) and the futures clients poll.

Order: a training model's calls carry ``seq_id`` 1, 2, 3 ... (its creation is 0) and the SDK sends
the chunks of one call at once, the first last; each call waits for the one before it
(``order_timeout_s``) and all training runs on one thread (the base model is shared).

Isolation: every session, model, sampler and saved weight belongs to the key that made it; another
key's id is answered as unknown. Saved weights live under ``root/MODEL/KIND/NAME`` with the owning
key's name in ``root/MODEL/owner``, so a restarted service still knows whose they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import re
import time
import uuid
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sample_buffer.deadlines import wait_for
from services.tinker import wire
from services.tinker.checkpoints import CHECKPOINT_KINDS, EXPIRES, Checkpoints
from services.tinker.config import TinkerConfig
from services.tinker.errors import TinkerError, json_object, string_id, unknown
from services.tinker.sampling import Sampler, Sampling
from trainer.adapter_pool import AdamParams, AdapterPool
from trainer.lora import LoraConfig

log = logging.getLogger(__name__)
NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
KINDS = ("weights", "sampler_weights")


def _ttl(body: dict) -> float | None:
    ttl = body.get("ttl_seconds")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int | float) or not ttl > 0):
        raise TinkerError("ttl_seconds", f"{ttl!r}: a number of seconds above 0, or null (kept until deleted)")
    return ttl


def _expires(d: Path, ttl: float | None) -> None:
    if ttl is not None:
        (d / EXPIRES).write_text(repr(time.time() + ttl))


@dataclass
class Model:
    id: str
    owner: str
    session: str
    adapter: str  # its name in the pool
    lora: LoraConfig
    next_seq: int = 1
    claimed: set[int] = field(default_factory=set)  # seq ids a call holds (a second call with one is refused)
    broken: str = ""  # why no call can run any more (a call before them never came)
    turn: asyncio.Condition = field(default_factory=asyncio.Condition)
    ephemeral: itertools.count = field(default_factory=itertools.count)


@dataclass
class Result:
    owner: str
    future: asyncio.Future
    proto: bool  # the SDK takes this result as protobuf only


class TinkerService(Sampling, Checkpoints):
    def __init__(
        self,
        config: TinkerConfig,
        pool: AdapterPool,
        engine,
        model_path: str,
        arch: str,
        lm_head: bool = True,
        max_rank: int | None = None,
    ) -> None:
        """``engine``: a client of the engine serving ``model_path`` (the control token); ``lm_head``:
        whether it serves adapters of the output layer (``train_unembed``); ``max_rank``: the largest
        adapter rank it serves (vLLM's ``engine.max_lora_rank``), None: any."""
        self.config, self.pool, self.engine, self.lm_head = config, pool, engine, lm_head
        self.max_rank = max_rank
        self.model_path = str(Path(model_path).resolve())
        self.base_model = config.base_model or self.model_path
        self.arch = arch
        self.root = Path(config.root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.sessions: dict[str, str] = {}  # session id -> owner
        self.seen: dict[str, float] = {}  # session id -> when it was last heard from (monotonic)
        self.session_seq: Counter[str] = Counter()  # sampling_session_seq_id fallbacks
        self.models: dict[str, Model] = {}
        self.samplers: dict[str, Sampler] = {}
        self.results: OrderedDict[str, Result] = OrderedDict()
        self._running: Counter[str] = Counter()  # calls started and not yet finished, by key
        self._answers: OrderedDict[tuple[str, str], dict] = OrderedDict()  # (key owner, idempotency key) -> answer
        self._trainer = ThreadPoolExecutor(1, thread_name_prefix="tinker-train")
        self._adapters = itertools.count()
        self._loaded: OrderedDict[Path, str] = OrderedDict()  # weights dir -> engine adapter name (LRU)
        self._busy: Counter[str] = Counter()  # engine adapter name -> samples in flight
        self._load_lock = asyncio.Lock()
        self._idle = asyncio.Condition()  # notified when a sample releases its adapter
        self._pending: Counter[str] = Counter()  # models being created, per key
        self._creating: set[str] = set()
        self.counts: Counter[tuple[str, str]] = Counter()
        self.trained_tokens = 0
        self.sampled_tokens = 0

    # ------------------------------------------------------------------ futures
    def submit(self, owner: str, work, proto: bool = False) -> str:
        """Start ``work`` (a coroutine) and return the id its result is fetched by."""
        rid = uuid.uuid4().hex
        fut = asyncio.ensure_future(work)
        self.results[rid] = Result(owner, fut, proto)
        self._running[owner] += 1
        fut.add_done_callback(lambda _: self._running.subtract([owner]))
        while len(self.results) > self.config.keep_results:
            old, r = next(iter(self.results.items()))
            if not r.future.done():
                break  # never drop what is still running
            del self.results[old]
        return rid

    def check_room(self, owner: str) -> None:
        """Refuse (429) a call of a key whose calls running fill its share: each holds its data (a
        forward_backward's up to the body limit) until it has run."""
        if self._running[owner] >= self.config.max_calls_in_flight_per_key:
            raise TinkerError(
                "request",
                f"{self._running[owner]} calls of this key are running (tinker.max_calls_in_flight_per_key: "
                f"{self.config.max_calls_in_flight_per_key}); retry once some have finished",
                status=429,
            )

    def answered(self, owner: str, key: str) -> dict | None:
        """The answer already given to the call with idempotency ``key``, if any."""
        return self._answers.get((owner, key))

    def remember(self, owner: str, key: str, answer: dict) -> None:
        self._answers[(owner, key)] = answer
        while len(self._answers) > self.config.keep_results:
            self._answers.popitem(last=False)

    async def retrieve(self, owner: str, rid: str, hold_s: float) -> Result | None:
        """The finished result of ``rid``; None if it is not done within ``hold_s``."""
        r = self.results.get(rid)
        if r is None or r.owner != owner:
            raise unknown("request_id", rid)
        try:
            await wait_for(asyncio.shield(r.future), hold_s)
        except TimeoutError:
            return None
        except Exception:  # noqa: BLE001 (the result is the error; it is answered to the client)
            pass
        self.results.move_to_end(rid)
        return r

    # ------------------------------------------------------------------ sessions
    def create_session(self, owner: str) -> str:
        sid = str(uuid.uuid4())
        self.sessions[sid] = owner
        self.seen[sid] = time.monotonic()
        return sid

    def _session(self, owner: str, sid: str) -> str:
        if self.sessions.get(string_id("session_id", sid)) != owner:
            raise unknown("session_id", sid)
        return sid

    def heartbeat(self, owner: str, sid: str) -> None:
        self.seen[self._session(owner, sid)] = time.monotonic()

    async def expire(self, now: float | None = None) -> list[str]:
        """Finish the sessions not heard from (no heartbeat: the SDK sends one every 10 s) for
        ``session_idle_s``: a client that died without closing gives its adapters back."""
        now = time.monotonic() if now is None else now
        idle = [sid for sid, t in self.seen.items() if now - t > self.config.session_idle_s]
        for sid in idle:
            log.info(
                "session %s of %s: no heartbeat for %.0f s, finished", sid, self.sessions[sid], now - self.seen[sid]
            )
            await self.finish_session(self.sessions[sid], sid)
        await self._expire_checkpoints()
        return idle

    async def _expire_checkpoints(self) -> None:
        """Delete the saved weights whose ``ttl_seconds`` has passed (sampler weights a sample is
        using wait for the next round)."""
        now = time.time()
        for stamp in self.root.glob(f"*/*/*/{EXPIRES}"):
            d = stamp.parent
            try:
                due = float(stamp.read_text()) <= now
            except (OSError, ValueError):  # deleted meanwhile, or being written
                continue
            if d.parent.name in CHECKPOINT_KINDS and due:
                try:
                    await self._remove(d)
                    log.info("%s/%s/%s: its ttl_seconds passed, deleted", d.parent.parent.name, d.parent.name, d.name)
                except TinkerError:  # in use now
                    continue

    async def finish_session(self, owner: str, sid: str) -> None:
        """Frees what the session held: its models' adapters (saved weights stay on disk)."""
        self._session(owner, sid)
        for m in [m for m in self.models.values() if m.session == sid]:
            await self._train(self.pool.remove, m.adapter)
            del self.models[m.id]
        for s in [s for s in self.samplers.values() if s.id.startswith(sid + ":")]:
            del self.samplers[s.id]
        del self.sessions[sid]
        self.seen.pop(sid, None)
        self.session_seq.pop(sid, None)

    # ------------------------------------------------------------------ models
    def _check_base(self, base_model: str | None) -> None:
        if base_model is None:
            return
        if not isinstance(base_model, str):
            raise TinkerError("base_model", f"{base_model!r}: a model name")
        if base_model != self.base_model and str(Path(base_model).resolve()) != self.model_path:
            raise TinkerError("base_model", f"{base_model!r} is not served here (served: {self.base_model!r})")

    def _lora(self, cfg: dict) -> tuple[LoraConfig, int | None]:
        rank = cfg.get("rank", 32)
        if not isinstance(rank, int) or not 1 <= rank <= 1024:
            raise TinkerError("lora_config.rank", f"{rank!r}: an integer in [1, 1024]")
        if self.max_rank is not None and rank > self.max_rank:  # else it trains, and its sampler fails to load
            raise TinkerError(
                "lora_config.rank",
                f"{rank} is over the largest the engine serves ({self.max_rank}: engine.max_lora_rank)",
            )
        if cfg.get("train_unembed", True) and not self.lm_head:
            raise TinkerError(
                "lora_config.train_unembed",
                "this service samples with vLLM, which serves no adapter of the output layer: "
                "create the model with train_unembed=False",
            )
        targets = self.pool.targets(
            cfg.get("train_attn", True), cfg.get("train_mlp", True), cfg.get("train_unembed", True)
        )
        if not targets:
            raise TinkerError("lora_config", "train_attn, train_mlp and train_unembed are all off: nothing to train")
        # alpha = 32 whatever the rank (Tinker's convention: a rank change keeps the step size per factor)
        return LoraConfig(rank=rank, alpha=32.0, target_modules=targets), cfg.get("seed")

    def _new_model(self, owner: str, sid: str, seq: int, lora: LoraConfig) -> Model:
        self._session(owner, sid)
        mid = f"{sid}:train:{seq}"
        if mid in self.models:
            raise TinkerError("model_seq_id", f"{seq} is taken in this session")
        if sum(m.owner == owner for m in self.models.values()) + self._pending[owner] >= self.config.max_models_per_key:
            raise TinkerError("", f"this key holds {self.config.max_models_per_key} models (tinker.max_models_per_key)")
        if mid in self._creating:
            raise TinkerError("model_seq_id", f"{seq} is being created in this session")
        model = Model(mid, owner, sid, f"m{next(self._adapters)}", lora)
        self._creating.add(mid)
        self._pending[owner] += 1
        (self.root / mid).mkdir(parents=True, exist_ok=True)
        (self.root / mid / "owner").write_text(owner)
        return model

    def create_model(self, owner: str, body: dict):
        """Checks the call now (a bad one is answered 400) and returns the work to run."""
        self._check_base(body.get("base_model"))
        _adamw_only(body.get("optimizer_config"))
        lora, seed = self._lora(json_object(body, "lora_config"))
        model = self._new_model(owner, str(body.get("session_id", "")), _int(body, "model_seq_id"), lora)

        async def create() -> dict:
            async with self._created(model):
                await self._train(self.pool.add, model.adapter, lora, seed)
                self.models[model.id] = model
            log.info("model %s (%s): rank %d on %s", model.id, owner, lora.rank, lora.target_modules)
            return {"model_id": model.id, "type": "create_model"}

        return create()

    @contextlib.asynccontextmanager
    async def _created(self, m: Model):
        """A model being made counts against its key's limit (and holds its id) until it is made or not."""
        try:
            yield
        finally:
            self._creating.discard(m.id)
            self._pending[m.owner] -= 1

    def model(self, owner: str, mid: str) -> Model:
        m = self.models.get(string_id("model_id", mid))
        if m is None or m.owner != owner:
            raise unknown("model_id", mid)
        return m

    def info(self, owner: str, mid: str) -> dict:
        m = self.model(owner, mid)
        data = {"arch": self.arch, "model_name": self.base_model, "tokenizer_id": self.model_path}
        return {
            "type": "get_info",
            "model_id": m.id,
            "model_data": data,
            "is_lora": True,
            "lora_rank": m.lora.rank,
            "model_name": self.base_model,
        }

    async def unload_model(self, owner: str, mid: str) -> dict:
        m = self.model(owner, mid)
        await self._train(self.pool.remove, m.adapter)
        del self.models[mid]
        return {"model_id": mid, "type": "unload_model"}

    async def _train(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._trainer, fn, *args)

    async def _in_order(self, m: Model, seq: int, fn, *args):
        """Run ``fn(*args)`` on the training thread once every call of ``m`` before ``seq`` has run."""
        async with m.turn:
            if seq in m.claimed or seq < m.next_seq:
                raise TinkerError("seq_id", f"{seq} was used already (next: {m.next_seq})")
            m.claimed.add(seq)
            try:
                await wait_for(m.turn.wait_for(lambda: m.next_seq >= seq or m.broken), self.config.order_timeout_s)
            except TimeoutError:
                m.broken = f"call {m.next_seq} never came ({self.config.order_timeout_s} s); create a new client"
                m.turn.notify_all()
            if m.broken:
                raise TinkerError("seq_id", f"{seq}: {m.broken}", "server")
        try:
            return await self._train(fn, *args)
        finally:
            async with m.turn:
                m.claimed.discard(seq)
                m.next_seq = seq + 1
                m.turn.notify_all()

    def _checked(self, m: Model, body: dict, check):
        seq = _int(body, "seq_id")
        return seq, self.checked_call(m, seq, check)

    def checked_call(self, m: Model, seq: int, check):
        """``check()``'s result; if it refuses call ``seq`` (a 400 now), the call's turn still passes, so
        the calls numbered after it do not wait for one that will never run."""
        try:
            return check()
        except (TinkerError, wire.WireError):
            asyncio.ensure_future(self._pass_turn(m, seq))
            raise

    async def _pass_turn(self, m: Model, seq: int) -> None:
        try:
            await self._in_order(m, seq, _nothing)
        except TinkerError:
            pass  # its number was taken or the model is broken: nothing waits on this one

    async def forward_backward(self, owner: str, req: wire.ForwardBackwardRequest) -> bytes:
        m = self.model(owner, req.model_id)
        outs, loss = await self._in_order(
            m,
            req.seq_id,
            self.pool.forward_backward,
            m.adapter,
            req.data,
            req.loss_fn,
            req.config,
            not req.forward_only,
        )
        self.trained_tokens += sum(len(d.tokens) for d in req.data)
        return wire.forward_backward_output(outs, {"loss:sum": loss})

    def optim_step(self, owner: str, body: dict):
        m = self.model(owner, body.get("model_id", ""))
        seq, adam = self._checked(m, body, lambda: _adam(body.get("adam_params")))

        async def step() -> dict:
            metrics = await self._in_order(m, seq, self.pool.optim_step, m.adapter, adam)
            # JSON takes no NaN or inf (the SDK's parser refuses them): a diverged number is left out
            return {"metrics": {k: v for k, v in metrics.items() if np.isfinite(v)}, "type": "optim_step"}

        return step()

    # ------------------------------------------------------------------ weights
    def _dir(self, mid: str, kind: str, name: str, overwrite: bool | None = None) -> Path:
        """Where ``name`` of ``kind`` lives; ``overwrite`` False: refused if it exists (None: not asked)."""
        if not NAME.fullmatch(name) or set(name) == {"."}:
            raise TinkerError("path", f"{name!r}: a name of letters, digits, '.', '_' and '-' (at most 128)")
        d = self.root / mid / kind / name
        if overwrite is False and d.exists():
            raise TinkerError("path", f"{name!r} is saved already; choose another name")
        return d

    def _parse(self, owner: str, path: str, kind: str) -> Path:
        """A ``tinker://MODEL/KIND/NAME`` path this key saved, as its directory."""
        path = string_id("path", path)  # (a JSON body's model_path may be anything)
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] != kind:
            raise TinkerError("path", f"{path!r} is not a tinker://MODEL_ID/{kind}/NAME path")
        mid, _, name = parts
        if not self._owns(owner, mid):
            raise TinkerError("path", f"{path!r}: no such weights of this key", status=404)
        d = self._dir(mid, kind, name)
        if not (d / "adapter_config.json").is_file():
            raise TinkerError("path", f"{path!r}: no such weights of this key", status=404)
        return d

    def save_weights(self, owner: str, body: dict):
        m = self.model(owner, body.get("model_id", ""))
        name = str(body.get("path") or "")
        check = lambda: (self._dir(m.id, "weights", name, body.get("overwrite", False)), _ttl(body))  # noqa: E731
        seq, (d, ttl) = self._checked(m, body, check)

        async def save() -> dict:
            await self._in_order(m, seq, self.pool.save_state, m.adapter, d)
            _expires(d, ttl)
            return {"path": f"tinker://{m.id}/weights/{name}", "type": "save_weights"}

        return save()

    def save_weights_for_sampler(self, owner: str, body: dict):
        m = self.model(owner, body.get("model_id", ""))
        name = body.get("path")
        ephemeral = name is None
        if ephemeral:  # save_weights_and_get_sampling_client: a sampler of these weights, no name to keep
            name = f"ephemeral-{next(m.ephemeral)}"
        # never over weights an engine may hold under their old contents: a name is saved once
        check = lambda: (self._dir(m.id, "sampler_weights", str(name), overwrite=False), _ttl(body))  # noqa: E731
        seq, (d, ttl) = self._checked(m, body, check)
        path = f"tinker://{m.id}/sampler_weights/{name}"

        async def save() -> dict:
            await self._in_order(m, seq, self.pool.save_adapter, m.adapter, d)
            _expires(d, ttl)
            if not ephemeral:
                return {"path": path, "type": "save_weights_for_sampler"}
            sid = self._new_sampler(owner, m.session, body.get("sampling_session_seq_id"), d, path)
            return {"sampling_session_id": sid, "type": "save_weights_for_sampler"}

        return save()

    def load_weights(self, owner: str, body: dict):
        d = self._parse(owner, str(body.get("path", "")), "weights")
        optimizer = bool(body.get("optimizer", False))
        if "model_id" in body:  # the deprecated form: into an existing model
            m = self.model(owner, body["model_id"])

            seq = _int(body, "seq_id")

            async def into() -> dict:
                await self._in_order(m, seq, self._replace, m, d, optimizer)
                return {"model_id": m.id, "path": body["path"], "type": "load_weights"}

            return into()
        self._check_base(body.get("base_model"))
        lora = LoraConfig(rank=1, target_modules=self.pool.targets(True, False, False))  # replaced by the saved one
        m = self._new_model(owner, str(body.get("session_id", "")), _int(body, "model_seq_id"), lora)

        async def create() -> dict:
            async with self._created(m):
                try:
                    m.lora = await self._train(self.pool.load_state, m.adapter, d, optimizer)
                except ValueError as e:
                    raise TinkerError("path", str(e)) from None
                self.models[m.id] = m
            return {"model_id": m.id, "path": body["path"], "type": "load_weights"}

        return create()

    def _replace(self, m: Model, d: Path, optimizer: bool) -> None:
        self.pool.remove(m.adapter)
        try:
            m.lora = self.pool.load_state(m.adapter, d, optimizer)
        except ValueError as e:  # the model has no adapter now: its client is poisoned anyway (the SDK's rule)
            raise TinkerError("path", str(e)) from None

    async def close(self) -> None:
        self._trainer.shutdown(wait=False, cancel_futures=True)


def _nothing() -> None:
    return None


def _int(body: dict, key: str) -> int:
    v = body.get(key, 0)
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**31:
        raise TinkerError(key, f"{v!r}: an integer in [0, 2^31)")
    return v


def _adamw_only(optimizer) -> None:
    if optimizer is not None and (not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw"):
        raise TinkerError("optimizer_config.type", f"{optimizer!r}: AdamW only (adamw)")


def _adam(p) -> AdamParams:
    if not isinstance(p, dict):
        raise TinkerError("adam_params", "required (an object: learning_rate, beta1, beta2, eps, weight_decay)")
    out = AdamParams()
    for key in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm"):
        if key in p:
            v = p[key]
            if not isinstance(v, int | float) or isinstance(v, bool) or not np.isfinite(v) or v < 0:
                raise TinkerError(f"adam_params.{key}", f"{v!r}: a finite number ≥ 0")
            setattr(out, key, float(v))
    if not (out.beta1 < 1 and out.beta2 < 1):
        raise TinkerError("adam_params.beta1", "betas below 1")
    return out
