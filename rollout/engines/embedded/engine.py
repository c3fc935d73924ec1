"""The embedded engine's core: a scheduler thread running continuous batching over a HF model.

Requests arrive from any thread (``submit``) and are answered through ``concurrent.futures``.
One background thread owns the model and the running batch; each loop iteration it applies
commands (new requests, aborts, pause/continue, weight swaps), admits waiting requests with one
batched prefill, and advances every running request by one token. A request leaves the batch
the moment it finishes, so a long generation never holds back short ones.

Weight updates swap weights between two steps and *retract* every running request: its cache
is dropped and it is re-prefilled (prompt + tokens so far) under the new weights, so no KV
computed under old weights is ever reused (``updates.py``). Each generated token records the
weight version that produced it.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from rollout.engines.contract import MAX_TOP_LOGPROBS, EngineError, GenerateOutput, PauseMode
from rollout.engines.embedded.attention import AttentionLayout, UnsupportedModel
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.grammar import Grammars
from rollout.engines.embedded.kv_slots import KVSlots
from rollout.engines.embedded.lora import Adapters
from rollout.engines.embedded.routing import RoutingCapture
from rollout.engines.embedded.sampling import sample_next_tokens, top_logprobs
from rollout.engines.embedded.scoring import ScoreJob, chunks, score_batch
from rollout.engines.embedded.updates import EngineUpdates
from rollout.engines.embedded.weights import weights_checksum
from rollout.engines.scheduler import SchedulerCommands
from rollout.sampling import SamplingParams
from sample_buffer.grammars import stop_token_ids
from sample_buffer.routing import routers_of, routing_dtype
from sample_buffer.vision import Vision, VisionError, VisionPrompt, is_vision_model, model_class

log = logging.getLogger(__name__)


MEMORY_TAGS = ("weights", "kv_cache")  # what /release_memory_occupation can give back (SGLang's tags)


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    future: Future
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    on_token: Callable[[int, float, int], None] | None = None  # streaming: called from the scheduler thread
    top_n: int = 0  # the most likely tokens to report at each position (OpenAI's top_logprobs)
    t0: float = field(default_factory=time.perf_counter)
    t_admit: float = 0.0
    t_first: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tops: list[list[tuple[int, float]]] = field(default_factory=list)
    routing: bool = False  # record each forwarded position's experts (SGLang's return_routed_experts)
    experts: list[np.ndarray] = field(default_factory=list)  # [n, layers × top_k] chunks, in position order
    routed: int = 0  # positions recorded so far
    vision: VisionPrompt | None = None  # its images, processed; ``prompt`` holds their expanded placeholders
    mrope: torch.Tensor | None = None  # Qwen2-VL: the prompt's 3-D rotary positions [3, len(prompt)] ...
    rope_delta: int = 0  # ... and what a later token's position adds to its index
    lora: str | None = None  # the adapter it is generated with (SGLang's lora_path: its name)
    matcher: object = None  # constrained decoding: its grammar's state (xgrammar's GrammarMatcher)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.output_ids

    def positions3(self, n: int) -> torch.Tensor:
        """3-D rotary positions of the first ``n`` context tokens: the prompt's, then text positions
        continuing after its largest (every axis alike), as Qwen2-VL numbers generated tokens."""
        head = self.mrope[:, : min(n, len(self.prompt))]
        if n <= len(self.prompt):
            return head
        tail = torch.arange(len(self.prompt), n) + self.rope_delta
        return torch.cat([head, tail[None].expand(3, -1)], dim=1)

    def route_prefill(self, rows: np.ndarray) -> None:
        """Experts of every position of the context just prefilled: they replace any recorded before (a
        request re-prefilled after a weight update samples from then on with this forward's routing)."""
        self.experts, self.routed = [rows], len(rows)

    def route_decode(self, row: np.ndarray) -> None:
        """Experts of the position just fed in (the last token), one row."""
        self.experts.append(row[None])
        self.routed += 1


class EmbeddedEngine(EngineUpdates, SchedulerCommands):
    """Continuous-batching generation over any local Hugging Face causal LM."""

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoConfig

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        log.info(
            "torch threads: %d (%s)",
            torch.get_num_threads(),
            "engine.num_threads" if config.num_threads else "torch's default: every core",
        )
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
        self.dtype = getattr(torch, config.dtype)
        try:
            self.hf_config = AutoConfig.from_pretrained(config.model_path, local_files_only=True)
        except (OSError, ValueError) as e:
            raise UnsupportedModel(f"{config.model_path}: no model config transformers can read: {e}") from None
        text = self.hf_config.get_text_config()
        self.vocab_size = int(text.vocab_size)
        self.max_context = int(getattr(text, "max_position_embeddings", 2048))
        self.eos_ids = stop_token_ids(config.model_path)
        layout = AttentionLayout.of(self.hf_config, config.model_path)  # refuses what it cannot serve, unloaded
        self.model = self._load(config.model_path)
        self.capture = RoutingCapture(self.model) if routers_of(self.model) else None  # MoE: experts per token
        # A vision-language model: images in SGLang's image_data; Qwen2-VL's rotary positions are 3-D
        self.vision = Vision(config.model_path, self.hf_config) if is_vision_model(config.model_path) else None
        self._mrope = self.vision is not None and hasattr(self.model.model, "get_rope_index")
        self.layout = dataclasses.replace(layout, eager=self.model.config._attn_implementation == "eager")
        # Only the last position's logits are needed; a prefill's whole [rows, length, vocab] is GBs.
        forward = inspect.signature(self.model.forward).parameters
        self._keep_last = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"  # transformers' newer name
        self.weight_version = 0
        self.checksum = weights_checksum(self.model.state_dict())
        self.model_path = config.model_path
        self.adapters = Adapters(self.model)  # LoRA adapters served per request
        self._grammars: Grammars | None = None  # made at the first constrained request (``grammars``)
        self._grammars_lock = threading.Lock()
        self._adapter_base: dict[str, torch.Tensor] = {}  # adapter-only updates: base weights, as the files hold them

        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Scores waiting for the scheduler thread (``score``): taken all at once, batched
        self._scores: list[tuple[ScoreJob, Future]] = []
        self._score_lock = threading.Lock()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._batch = self._new_batch()
        self._rids: set[str] = set()
        self._paused = False
        self._released: set[str] = set()  # memory given back: "weights" and/or "kv_cache" (colocated)
        self._staged: dict[str, torch.Tensor] = {}  # buckets of an update in progress ...
        self._staged_key: object = None  # ... and the update they belong to (its version, by default)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._sampler = torch.Generator(device=self.device).manual_seed(config.seed)
        self.counters = collections.Counter()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> EmbeddedEngine:
        self._thread.start()
        return self

    def _load(self, path: str) -> torch.nn.Module:
        auto = model_class(path)  # a vision-language model loads with its vision tower
        try:
            model = auto.from_pretrained(path, dtype=self.dtype, attn_implementation="sdpa", local_files_only=True)
        except ValueError as e:
            if "attention implementation" not in str(e):  # no SDPA for this architecture: eager is slower, works
                raise UnsupportedModel(f"{path}: not a causal LM transformers can load ({e})") from None
            model = auto.from_pretrained(path, dtype=self.dtype, attn_implementation="eager", local_files_only=True)
        return model.to(self.device).eval()

    def _new_batch(self) -> KVSlots:
        layers = int(self.hf_config.get_text_config().num_hidden_layers)
        return KVSlots(self.layout, layers, self.config.max_running_requests, self.max_context, self.device)

    @property
    def grammars(self) -> Grammars:
        """The grammars of this model's tokenizer (``grammar.py``); made once, on first use."""
        with self._grammars_lock:
            if self._grammars is None:
                from transformers import AutoTokenizer

                try:
                    tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
                except (OSError, ValueError) as e:
                    raise EngineError("sampling_params", f"no tokenizer to build a grammar's mask with: {e}") from None
                self._grammars = Grammars(tokenizer, self.vocab_size, sorted(self.eos_ids))
            return self._grammars

    # ----------------------------------------------------------------- public API (any thread)
    def _check_ids(self, input_ids: list[int]) -> None:
        if not input_ids:
            raise EngineError("input_ids", "must not be empty")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError("input_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def validate(self, input_ids: list[int], params: SamplingParams) -> None:
        self._check_ids(input_ids)
        if params.max_new_tokens <= 0:
            raise EngineError("sampling_params.max_new_tokens", f"must be >= 1, got {params.max_new_tokens}")
        if len(input_ids) >= self.max_context:  # no max_new_tokens would fit: the prompt is at fault
            raise EngineError(
                "input_ids", f"prompt of {len(input_ids)} tokens fills the model's context of {self.max_context} tokens"
            )
        if len(input_ids) + params.max_new_tokens > self.max_context:
            raise EngineError(
                "sampling_params.max_new_tokens",
                f"prompt ({len(input_ids)}) + max_new_tokens ({params.max_new_tokens}) exceeds the "
                f"model's context of {self.max_context} tokens",
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise EngineError("sampling_params.stop_token_ids", f"token id {bad[0]} is outside the vocabulary")
        # Each becomes a torch int64 (a seed may also be a uint64): a larger one failed the whole batch.
        if not -(1 << 63) <= params.top_k < 1 << 63:
            raise EngineError("sampling_params.top_k", f"must fit in 64 bits, got {params.top_k}")
        if params.sampling_seed is not None and not -(1 << 63) <= params.sampling_seed < 1 << 64:
            raise EngineError("sampling_params.sampling_seed", f"must fit in 64 bits, got {params.sampling_seed}")
        if params.grammar() is not None and (params.ignore_eos or not self.eos_ids):
            raise EngineError(
                "sampling_params.ignore_eos" if params.ignore_eos else f"sampling_params.{params.grammar()[0]}",
                "a grammar ends the answer at an end-of-sequence token"
                + (": ignore_eos cannot be honoured with it" if params.ignore_eos else ", and this model names none"),
            )

    def submit(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        on_token: Callable[[int, float, int], None] | None = None,
        top_logprobs_num: int = 0,
        return_routed_experts: bool = False,
        image_data: list[str] | None = None,
        lora: str | None = None,
    ) -> Future:
        """Queue a generation; the future resolves to a ``GenerateOutput``. ``on_token(token,
        logprob, version)`` is called for each token as it is generated (in the scheduler thread:
        it must only hand the token over). ``top_logprobs_num``: also report that many most likely
        tokens at each position; ``return_routed_experts``: the experts of every forwarded position
        (an MoE model's; ``GenerateOutput.routed_experts``); ``image_data``: a vision-language model's
        images (``sample_buffer.vision``), one placeholder token for each in ``input_ids``, which the
        engine expands (the answer's ``prompt_tokens`` counts the expanded prompt); ``lora``: the
        loaded adapter to generate with (its tokens report the adapter's version)."""
        if lora is not None and lora not in self.adapters.by_name:
            raise EngineError("lora_path", f"no adapter named {lora!r} is loaded (/load_lora_adapter first)")
        vision = self._vision_prompt(input_ids, image_data or [])
        if vision is not None:
            input_ids = vision.input_ids
        self.validate(input_ids, params)
        if return_routed_experts and self.capture is None:
            raise EngineError(
                "return_routed_experts", f"{self.hf_config.model_type} has no mixture-of-experts layers to report"
            )
        if not 0 <= top_logprobs_num <= min(MAX_TOP_LOGPROBS, self.vocab_size):
            limit = min(MAX_TOP_LOGPROBS, self.vocab_size)
            raise EngineError("top_logprobs_num", f"must be in [0, {limit}], got {top_logprobs_num}")
        fut: Future = Future()
        gen = None
        if params.sampling_seed is not None:
            gen = torch.Generator(device=self.device).manual_seed(params.sampling_seed)
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_ids)
        matcher = self.grammars.matcher(params) if params.grammar() is not None else None
        req = _Request(
            rid,
            list(input_ids),
            params,
            fut,
            gen,
            stop,
            on_token,
            top_n=top_logprobs_num,
            routing=return_routed_experts,
            vision=vision,
            lora=lora,
            matcher=matcher,
        )
        if self._mrope:  # in the caller's thread: index arithmetic only, no weights
            req.mrope, req.rope_delta = self._rope_index(req)
        self._commands.put(lambda: self._enqueue(req))
        return fut

    def score(self, input_ids: list[int], start: int, top_k: int = 0) -> Future:
        """The log-prob this model gives each token of ``input_ids`` from position ``start`` on, at
        temperature 1 (``scoring.py``; None for position 0), and with ``top_k`` each position's most
        likely tokens: a teacher's answer in on-policy distillation. Runs in the scheduler thread
        between two steps, at the weights then served."""
        self._check_ids(input_ids)
        if len(input_ids) > self.max_context:
            raise EngineError("input_ids", f"{len(input_ids)} tokens exceed the model's context of {self.max_context}")
        if not 0 <= start < len(input_ids):
            raise EngineError("logprob_start_len", f"must be in [0, {len(input_ids)}) for this prompt, got {start}")
        if self.vision is not None:
            raise EngineError(
                "input_ids", f"{self.hf_config.model_type}: scoring a vision-language prompt is not built"
            )

        if not 0 <= top_k <= min(MAX_TOP_LOGPROBS, self.vocab_size):
            limit = min(MAX_TOP_LOGPROBS, self.vocab_size)
            raise EngineError("top_logprobs_num", f"must be in [0, {limit}], got {top_k}")

        future: Future = Future()
        with self._score_lock:
            if self._stop.is_set():
                raise RuntimeError("the engine is shutting down")
            self._scores.append((ScoreJob(tuple(input_ids), start, top_k), future))
        self._commands.put(self._score_waiting)
        return future

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._score_lock:  # no score is queued from now on
            self._stop.set()
        super().shutdown(timeout_s)
        with self._score_lock:  # scores the scheduler thread never took: their callers are told
            waiting, self._scores = self._scores, []
        for _, future in waiting:
            if not future.done():
                future.set_exception(RuntimeError("engine shut down"))

    def _score_waiting(self) -> None:
        """Every score waiting, in batched forwards (``scoring.py``), each distinct sequence once. The
        first of the commands queued with them takes them all; the others find none."""
        with self._score_lock:
            waiting, self._scores = self._scores, []
        if not waiting:
            return
        futures: dict[ScoreJob, list[Future]] = {}
        for job, future in waiting:
            if future.set_running_or_notify_cancel():
                futures.setdefault(job, []).append(future)
        for batch in chunks(list(futures), self.config.max_prefill_tokens, self.vocab_size):
            try:
                self.adapters.select([None] * len(batch), self.device)  # the base model: a teacher has none
                results = score_batch(self.model, batch, self.device, bool(self._keep_last))
            except Exception as e:  # the batch's callers get the error; the engine goes on
                for job in batch:
                    for f in futures[job]:
                        f.set_exception(e)
                continue
            self.counters["score_batches"] += 1
            for job, result in zip(batch, results, strict=True):
                self.counters["scored_tokens"] += len(job.input_ids) - job.start
                for f in futures[job]:
                    f.set_result(result)

    def _vision_prompt(self, input_ids: list[int], images: list[str]) -> VisionPrompt | None:
        if self.vision is None:
            if images:
                raise EngineError("image_data", f"{self.hf_config.model_type} has no vision tower to see images")
            return None
        try:
            return self.vision.prompt(input_ids, images) if images or self.vision.image_token_id in input_ids else None
        except VisionError as e:
            raise EngineError(e.field, str(e).removeprefix(f"{e.field}: ")) from None

    def _rope_index(self, req: _Request) -> tuple[torch.Tensor, int]:
        ids = torch.tensor([req.prompt])
        v = req.vision
        kinds = (ids == self.vision.image_token_id).int()
        grid = None if v is None else v.image_grid_thw
        if grid is None:  # text only: the plain positions
            return torch.arange(len(req.prompt))[None].expand(3, -1), 0
        pos, delta = self.model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid)
        return pos[:, 0].cpu(), int(delta.reshape(-1)[0])

    def release_memory(self, tags: list[str] | None = None) -> Future:
        """Give back the GPU memory of ``tags`` (default both: "weights" move to host memory, the KV
        cache is dropped) while a colocated trainer trains; generation must be paused."""
        tags = self._memory_tags(tags)
        return self._call(lambda: self._release(tags))

    def resume_memory(self, tags: list[str] | None = None) -> Future:
        """Take the memory of ``tags`` again (weights back on the device; the KV cache regrows)."""
        tags = self._memory_tags(tags)
        return self._call(lambda: self._take_back(tags))

    @staticmethod
    def _memory_tags(tags: list[str] | None) -> set[str]:
        tags = set(tags or MEMORY_TAGS)
        if not tags <= set(MEMORY_TAGS):
            raise EngineError("tags", f"must be among {list(MEMORY_TAGS)}, got {sorted(tags - set(MEMORY_TAGS))}")
        return tags

    def info(self) -> dict:
        return {
            "model_path": self.model_path,
            "served_model_name": self.config.served_model_name or self.config.model_path,
            "weight_version": str(self.weight_version),
            "weights_checksum": self.checksum,
            "is_generation": True,
            "vocab_size": self.vocab_size,
            "max_context_length": self.max_context,
            "device": str(self.device),
            "memory_released": sorted(self._released),
            "lora_adapters": sorted(self.adapters.by_name.copy()),  # (rollmesh's: SGLang reports none)
        }

    # ----------------------------------------------------------------- scheduler thread
    def _loop(self) -> None:
        while not self._stop.is_set():
            busy = bool(self._running or self._waiting) and not self._paused
            try:
                cmd = self._commands.get(timeout=None if not busy else 0) if busy else self._commands.get(True, 0.5)
                cmd()
                while True:  # drain everything that arrived during the last step
                    self._commands.get_nowait()()
            except queue.Empty:
                pass
            if self._paused or self._stop.is_set():
                continue
            try:
                with torch.inference_mode():
                    self._admit()
                    if self._running:
                        self._decode_step()
            except Exception as e:  # a model failure must not kill the server: fail the batch
                log.exception("engine step failed")
                for req in list(self._running):
                    self._finish(req, {"type": "abort", "message": f"engine error: {e}"})
                self._running = []
                self._batch.clear()
                self.counters["step_errors"] += 1

    def _enqueue(self, req: _Request) -> None:
        if req.rid in self._rids:
            req.future.set_exception(EngineError("rid", f"request {req.rid!r} is already in flight"))
            return
        if req.lora is not None and req.lora not in self.adapters.by_name:  # unloaded since it was checked
            req.future.set_exception(EngineError("lora_path", f"no adapter named {req.lora!r} is loaded"))
            return
        self._rids.add(req.rid)
        self._waiting.append(req)
        self.counters["requests"] += 1

    def _admit(self) -> None:
        room = self.config.max_running_requests - len(self._running)
        if room <= 0 or not self._waiting:
            return
        group: list[_Request] = []
        while self._waiting and len(group) < room:
            width = max([len(r.context) for r in group] + [len(self._waiting[0].context)])
            if group and width * (len(group) + 1) > self.config.max_prefill_tokens:
                break
            group.append(self._waiting.popleft())
        now = time.perf_counter()
        for r in group:
            r.t_admit = r.t_admit or now  # a retracted request keeps its first admission
        # A context admitted more than once (a group's samples of one prompt) is forwarded once: its
        # copies take the first one's cache rows and last logits, and sample on their own.
        unique, copies, source = self._shared(group)
        group, first_slot = unique + copies, self._batch.n
        try:
            ids, positions, masks = self._batch.prefill([r.context for r in unique], self.dtype)
            self.adapters.select([r.lora for r in unique], self.device)
            out = self.model(
                input_ids=ids,
                position_ids=self._prefill_positions(unique, positions),
                attention_mask=masks,
                **{self._cache_arg: self._batch.cache},
                use_cache=True,
                **self._pixels(unique),
                **self._keep_last,
            )
            self.counters["prefill_tokens"] += sum(len(r.context) for r in unique)
            self.counters["prefill_shared_tokens"] += sum(len(r.context) for r in copies)
            self.counters["prefill_batches"] += 1
            last = out.logits[:, -1]
            if copies:
                self._batch.repeat([first_slot + i for i in source[len(unique) :]])
                last = last.index_select(0, torch.tensor(source, device=last.device))
            last = self._constrained(last, group)
            tokens, logprobs = sample_next_tokens(
                last, [r.params for r in group], [r.generator for r in group], self._sampler
            )
            tops = top_logprobs(last, [r.params for r in group], [r.top_n for r in group])
            if self.capture is not None and any(r.routing for r in group):
                experts = self.capture.take(*ids.shape)  # rows left-padded: a context ends in the last column
                for i, r in enumerate(group):
                    if r.routing:
                        r.route_prefill(experts[source[i], ids.shape[1] - len(r.context) :])
        except Exception:
            # Out of the queue, not yet running: the loop's handler fails only the running batch, so
            # these would never be answered (their callers hung). They fail with it.
            self._running += group
            raise
        self._running += group
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        first = len(self._running) - len(group)
        self._leave({first + i for i, r in enumerate(group) if self._append(r, tokens[i], logprobs[i], tops[i])})

    def _shared(self, group: list[_Request]) -> tuple[list[_Request], list[_Request], list[int]]:
        """``group`` split into the requests whose context is new and the copies of one of those; and for
        each of ``unique + copies``, the row of the prefill it takes its cache from. A copy has the same
        context and adapter; a prompt with images is never shared (its pixels are its own)."""
        first: dict[tuple, int] = {}
        unique: list[_Request] = []
        copies: list[tuple[_Request, int]] = []
        for r in group:
            key = (tuple(r.context), r.lora) if r.vision is None else (id(r),)
            if key in first:
                copies.append((r, first[key]))
            else:
                first[key] = len(unique)
                unique.append(r)
        return unique, [r for r, _ in copies], list(range(len(unique))) + [i for _, i in copies]

    def _prefill_positions(self, group: list[_Request], positions: torch.Tensor) -> torch.Tensor:
        """The group's rotary positions: the batch's [B, T] (left-padded), or Qwen2-VL's [3, B, T]."""
        if not self._mrope:
            return positions
        out = torch.zeros(3, *positions.shape, dtype=torch.long)
        for i, r in enumerate(group):
            n = len(r.context)
            out[:, i, positions.shape[1] - n :] = r.positions3(n)
        return out.to(self.device)

    def _pixels(self, group: list[_Request]) -> dict:
        """The group's images for the vision tower, run once per image at prefill (a re-prefill after
        a weight update runs it again: the tower's weights may have changed)."""
        seen = [r.vision for r in group if r.vision is not None]
        if not seen:
            return {}
        out = {"pixel_values": torch.cat([v.pixel_values for v in seen]).to(self.device, self.dtype)}
        if seen[0].image_grid_thw is not None:
            out["image_grid_thw"] = torch.cat([v.image_grid_thw for v in seen]).to(self.device)
        return out

    def _decode_step(self) -> None:
        ids, positions, masks = self._batch.decode([r.output_ids[-1] for r in self._running], self.dtype)
        if self._mrope:  # every axis alike after the prompt, shifted by each row's delta
            delta = torch.tensor([r.rope_delta for r in self._running], device=positions.device)
            positions = (positions + delta[:, None])[None].expand(3, -1, -1)
        self.adapters.select([r.lora for r in self._running], self.device)
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=masks,
            **{self._cache_arg: self._batch.cache},
            use_cache=True,
        )
        self._batch.advance()
        if self.capture is not None and any(r.routing for r in self._running):
            experts = self.capture.take(len(self._running), 1)
            for i, r in enumerate(self._running):
                if r.routing:
                    r.route_decode(experts[i, 0])
        last = self._constrained(out.logits[:, -1], self._running)
        tokens, logprobs = sample_next_tokens(
            last, [r.params for r in self._running], [r.generator for r in self._running], self._sampler
        )
        tops = top_logprobs(last, [r.params for r in self._running], [r.top_n for r in self._running])
        tokens, logprobs = tokens.tolist(), logprobs.tolist()
        self._leave({i for i, r in enumerate(self._running) if self._append(r, tokens[i], logprobs[i], tops[i])})
        self.counters["decode_steps"] += 1

    def _constrained(self, logits: torch.Tensor, rows: list[_Request]) -> torch.Tensor:
        """``logits`` with each constrained row masked to what its grammar allows next: what it samples
        from and reports the log-probs of (μ is the masked distribution)."""
        if all(r.matcher is None for r in rows):
            return logits
        self.counters["constrained_tokens"] += sum(r.matcher is not None for r in rows)
        return self.grammars.masked(logits, [r.matcher for r in rows])

    def _leave(self, rows: set[int]) -> None:
        """Running rows ``rows`` leave the batch (finished or aborted); their slots are refilled."""
        if rows:
            self._running = [self._running[i] for i in self._batch.release(rows)]

    def _append(self, req: _Request, token: int, logprob: float, top: list[tuple[int, float]]) -> bool:
        """Record a generated token; finish the request and return True if it is done."""
        if not req.output_ids:
            req.t_first = time.perf_counter()
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        if req.top_n:
            req.tops.append(top)
        version = self.weight_version if req.lora is None else self.adapters.by_name[req.lora].version
        req.versions.append(version)
        if req.on_token is not None:
            req.on_token(token, logprob, version)
        self.counters["generated_tokens"] += 1
        if req.matcher is not None and not req.matcher.accept_token(token):  # the mask allowed it: a bug if so
            self._finish(req, {"type": "abort", "message": f"token {token} is outside the request's grammar"})
            return True
        if token in req.stop_ids:
            self._finish(req, {"type": "stop", "matched": token})
        elif len(req.output_ids) >= req.params.max_new_tokens or len(req.context) >= self.max_context:
            self._finish(req, {"type": "length", "length": len(req.output_ids)})
        else:
            return False
        return True

    def _finish(self, req: _Request, reason: dict) -> None:
        self._rids.discard(req.rid)
        self.counters[f"finished_{reason['type']}"] += 1
        if req.future.done():
            return
        req.future.set_result(
            GenerateOutput(
                rid=req.rid,
                output_ids=list(req.output_ids),
                behavior_logprobs=list(req.logprobs),
                token_versions=list(req.versions),
                finish_reason=reason,
                prompt_tokens=len(req.prompt),
                weight_version=self.weight_version,
                e2e_latency_s=time.perf_counter() - req.t0,
                queue_time_s=max(0.0, (req.t_admit or time.perf_counter()) - req.t0),
                ttft_s=max(0.0, req.t_first - req.t0) if req.t_first else 0.0,
                top_logprobs=list(req.tops),
                routed_experts=_joined(req.experts, self.capture) if req.routing else None,
            )
        )

    def _abort(self, rid: str | None, abort_all: bool) -> int:
        victims = [r for r in self._running + list(self._waiting) if abort_all or r.rid == rid]
        if not victims:
            return 0
        gone = {id(r) for r in victims}
        self._leave({i for i, r in enumerate(self._running) if id(r) in gone})
        self._waiting = collections.deque(r for r in self._waiting if id(r) not in gone)
        for r in victims:
            self._finish(r, {"type": "abort", "message": "aborted by request"})
        return len(victims)

    def _retract_running(self) -> int:
        """Drop the running batch's cache and queue its requests first, to be re-prefilled."""
        n = len(self._running)
        self._waiting.extendleft(reversed(self._running))
        self._running = []
        self._batch.clear()
        return n

    def _pause(self, mode: PauseMode) -> int:
        if mode not in ("abort", "retract", "in_place"):
            raise EngineError("mode", f"must be one of abort, retract, in_place; got {mode!r}")
        self._paused = True
        if mode == "abort":
            return self._abort(None, abort_all=True)
        if mode == "retract":
            return self._retract_running()
        return len(self._running)

    def _resume(self) -> None:
        if "weights" in self._released:
            raise EngineError("memory", "the weights are released: /resume_memory_occupation first")
        self._paused = False

    def _release(self, tags: set[str]) -> dict:
        if not self._paused:
            raise EngineError("memory", "generation is running: /pause_generation first (its requests would be lost)")
        if "kv_cache" in tags:
            self._retract_running()
            self._batch = self._new_batch()  # the old cache's tensors go; a new one grows as needed
        if "weights" in tags and self.device.type == "cuda":
            self.model.to("cpu")  # a host copy, so nothing has to be sent again to take them back
        self._released |= tags
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"memory_released": sorted(self._released)}

    def _take_back(self, tags: set[str]) -> dict:
        if "weights" in tags and "weights" in self._released and self.device.type == "cuda":
            self.model.to(self.device)
        self._released -= tags
        return {"memory_released": sorted(self._released)}


def _joined(chunks: list[np.ndarray], capture: RoutingCapture) -> np.ndarray:
    if not chunks:  # aborted before its first forward
        return np.zeros((0, capture.width), dtype=routing_dtype(capture.num_experts - 1))
    return np.concatenate(chunks)
