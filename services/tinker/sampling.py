"""Tinker's sampling: sampling sessions over a saved adapter (or the base model), and samples the
engine generates with that adapter by name (SGLang's ``lora_path``), many clients' in one
continuous batch. Adapters are loaded on first use and the least recently used idle one unloaded
to make room (``max_loaded_adapters``); one a sample holds is never unloaded under it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from rollout.sampling import SamplingParams
from sample_buffer.deadlines import wait_for
from sample_buffer.trajectory import FinishReason
from services.tinker import wire
from services.tinker.errors import TinkerError, json_object, string_id, unknown


@dataclass
class Sampler:
    id: str
    owner: str
    weights: Path | None  # a PEFT adapter directory; None: the base model
    model_path: str | None  # its tinker:// path, when it has one


def prompt_tokens(prompt, vocab: int) -> list[int]:
    """A ``ModelInput``'s tokens (text chunks only)."""
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise TinkerError("prompt", "a ModelInput: {chunks: [{type: encoded_text, tokens: [...]}]}")
    tokens: list[int] = []
    for i, c in enumerate(prompt["chunks"]):
        if not isinstance(c, dict) or c.get("type", "encoded_text") != "encoded_text":
            kind = c.get("type") if isinstance(c, dict) else type(c).__name__
            raise TinkerError(f"prompt.chunks[{i}]", f"{kind} chunks are not served (text)")
        t = c.get("tokens")
        if not isinstance(t, list) or not all(isinstance(x, int) and 0 <= x < vocab for x in t):
            raise TinkerError(f"prompt.chunks[{i}].tokens", f"token ids in [0, {vocab})")
        tokens += t
    if not tokens:
        raise TinkerError("prompt", "no tokens")
    return tokens


class Sampling:
    """Mixin of ``TinkerService`` (its engine, pool, sessions, samplers and adapter table)."""

    def _new_sampler(self, owner: str, sid: str, seq, weights: Path | None, path: str | None) -> str:
        self._session(owner, sid)
        if seq is None:
            seq = self.session_seq[sid]
        if not isinstance(seq, int) or isinstance(seq, bool) or not 0 <= seq < 2**31:
            raise TinkerError("sampling_session_seq_id", f"{seq!r}: an integer in [0, 2^31)")
        self.session_seq[sid] = max(self.session_seq[sid], seq + 1)
        sampler_id = f"{sid}:sample:{seq}"
        self.samplers[sampler_id] = Sampler(sampler_id, owner, weights, path)
        return sampler_id

    def create_sampling_session(self, owner: str, body: dict) -> str:
        path = body.get("model_path")
        weights = self._parse(owner, path, "sampler_weights") if path else None
        if path is None:
            self._check_base(body.get("base_model"))
        return self._new_sampler(owner, body.get("session_id", ""), body.get("sampling_session_seq_id"), weights, path)

    def sampler(self, owner: str, sampler_id: str) -> Sampler:
        s = self.samplers.get(string_id("sampling_session_id", sampler_id))
        if s is None or s.owner != owner:
            raise unknown("sampling_session_id", sampler_id)
        return s

    def sampler_info(self, owner: str, sampler_id: str) -> dict:
        s = self.sampler(owner, sampler_id)
        return {"sampler_id": s.id, "base_model": self.base_model, "model_path": s.model_path}

    def sample(self, owner: str, body: dict):
        """Everything a sample needs, checked before it is accepted (a 400 names what is wrong); the work."""
        if "sampling_session_id" in body:
            s = self.sampler(owner, body["sampling_session_id"])
        elif body.get("model_path"):
            s = Sampler("", owner, self._parse(owner, body["model_path"], "sampler_weights"), body["model_path"])
        else:
            self._check_base(body.get("base_model"))
            s = Sampler("", owner, None, None)
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or not 1 <= n <= 128:
            raise TinkerError("num_samples", f"{n!r}: an integer in [1, 128]")
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise TinkerError(key, "not served yet")
        if body.get("target_prompt_logprobs") is not None:
            raise TinkerError("target_prompt_logprobs", "not served yet")
        tokens = prompt_tokens(body.get("prompt"), self.pool.vocab_size)
        params = self._sampling_params(json_object(body, "sampling_params"))
        return self._sample(s, tokens, params, n, bool(body.get("prompt_logprobs")))

    def _sampling_params(self, p: dict) -> SamplingParams:
        stop = p.get("stop")
        if isinstance(stop, str) or (isinstance(stop, list) and any(isinstance(x, str) for x in stop)):
            raise TinkerError("sampling_params.stop", "stop strings are not served yet: give stop token ids")
        if stop is not None and not (isinstance(stop, list) and all(isinstance(x, int) for x in stop)):
            raise TinkerError("sampling_params.stop", f"{stop!r}: a list of token ids")
        max_tokens = p.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or not 1 <= max_tokens <= 1 << 16):
            raise TinkerError("sampling_params.max_tokens", f"{max_tokens!r}: an integer in [1, 65536]")
        try:
            return SamplingParams(
                max_new_tokens=max_tokens or self.config.default_max_tokens,
                temperature=p.get("temperature", 1.0),
                top_p=p.get("top_p", 1.0),
                top_k=p.get("top_k", -1),
                # omitted: end at EOS; a list: at those tokens only ([]: run to max_tokens)
                stop_token_ids=stop or [],
                ignore_eos=stop is not None,
                sampling_seed=p.get("seed"),
            )
        except ValueError as e:
            err = e.errors()[0] if hasattr(e, "errors") else {"loc": (), "msg": str(e)}
            where = ".".join(str(x) for x in err["loc"])
            raise TinkerError(f"sampling_params.{where}", err["msg"]) from None

    async def _sample(self, s: Sampler, tokens: list[int], params: SamplingParams, n: int, prompt_lp: bool) -> bytes:
        seed = params.sampling_seed
        async with self._adapter(s.weights) as lora:
            # every request ends (or fails) before the adapter is let go: none still uses it when unloaded
            results = await asyncio.gather(
                *(
                    self.engine.generate(
                        tokens,
                        params.model_copy(update={"sampling_seed": None if seed is None else seed + i}),
                        timeout_s=self.config.generate_timeout_s,
                        lora_path=lora,
                    )
                    for i in range(n)
                ),
                return_exceptions=True,
            )
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        ended = {r.finish_reason for r in results} - {FinishReason.STOP, FinishReason.LENGTH}
        if ended:  # cut short by the engine: not a sample the client may train on as if complete
            raise TinkerError("", f"the engine ended a sample early ({sorted(ended)[0]}); sample again", "server")
        seqs = [wire.Sequence(r.output_ids, r.behavior_logprobs, r.finish_reason is FinishReason.STOP) for r in results]
        self.sampled_tokens += sum(len(r.output_ids) for r in results)
        scores = await self._train(self.pool.score, tokens, s.weights) if prompt_lp else None
        return wire.sample_response(seqs, scores)

    def _adapter(self, weights: Path | None):
        return _Using(self, weights)

    async def _acquire(self, weights: Path | None) -> str | None:
        """The engine's name of the adapter in ``weights`` (loaded now if it is not; the least
        recently used idle one unloaded to make room, waiting for one to be idle), held until
        ``_release``."""
        if weights is None:
            return None
        deadline = asyncio.get_running_loop().time() + self.config.generate_timeout_s
        async with self._load_lock:
            name = self._loaded.get(weights)
            while name is None and len(self._loaded) >= self.config.max_loaded_adapters:
                idle = next((d for d, a in self._loaded.items() if not self._busy[a]), None)
                if idle is not None:
                    await self.engine.unload_lora_adapter(self._loaded[idle])
                    self._busy.pop(self._loaded.pop(idle), None)  # forgotten once the engine let it go
                    continue
                async with self._idle:  # every one is sampling: wait for one to end
                    left = deadline - asyncio.get_running_loop().time()
                    try:
                        await wait_for(self._idle.wait(), max(left, 0.01))
                    except TimeoutError:
                        raise TinkerError("", "every loaded adapter stayed in use; try again", "server", 503) from None
            if name is None:
                name = f"a{next(self._adapters)}"
                await self.engine.load_lora_adapter(name, str(weights))
                self._loaded[weights] = name
            self._loaded.move_to_end(weights)
            self._busy[name] += 1
            return name

    async def _release(self, name: str | None) -> None:
        if name is not None:
            self._busy[name] -= 1
            async with self._idle:
                self._idle.notify_all()


class _Using:
    def __init__(self, service: Sampling, weights: Path | None) -> None:
        self.service, self.weights, self.name = service, weights, None

    async def __aenter__(self) -> str | None:
        self.name = await self.service._acquire(self.weights)
        return self.name

    async def __aexit__(self, *exc) -> None:
        await self.service._release(self.name)
