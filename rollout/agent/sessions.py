"""Agent sessions: an external agent's run becomes trained trajectories.

A plain object over the rollout loop's ports (``Admission``, ``Generate``, ``SampleSink``); the
gateway (``services/gateway/``) is its HTTP face. The life of a session:

1. **create**: the session joins its group (``group``; a new one is admitted through the
   AsyncController like any group, so the staleness bound holds for agents too, and waits for a
   slot up to ``admit_timeout_s``);
2. **chat**: each request is rendered through the session's prefix tree
   (``rollout/agent/prefix_tree.py``) and generated through the LLMProxy, behind its suspend gate;
3. **reward**, then **end**: once all ``group_size`` sessions of a group have ended, each
   generation tip of each session becomes a trajectory with its session's reward, and the group
   goes to the SampleBuffer. A group unused for ``idle_s`` is abandoned (slot released unused):
   rewards for half a group would bias its advantages.

Sessions belong to the key that created them: another key gets ``NotFound``, as if there were none.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from rollout.agent.messages import ParsedReply, conversation_keys, parse_tool_calls
from rollout.agent.prefix_tree import Prepared, PromptNode, SessionTree, trajectory_path
from rollout.agent.render import TemplateRenderer
from rollout.ports import Admission, Generate, Generation, GroupOutcome, SampleSink
from rollout.sampling import SamplingParams
from sample_buffer.trajectory import FinishReason, Group, Trajectory

log = logging.getLogger(__name__)


class SessionsConfig(BaseModel):
    """How agent sessions are admitted, kept and turned into groups."""

    model_config = ConfigDict(extra="forbid")

    admit_timeout_s: float = Field(
        30.0, gt=0, description="A new group waits this long for an admission slot, then is refused (503)."
    )
    idle_s: float = Field(
        600.0,
        gt=0,
        description="A group none of whose sessions was used (created, asked, ended) for this long is "
        "abandoned, its slot released: an agent that died, or a group that never got all its sessions.",
    )
    max_group_size: int = Field(64, ge=1, description="Sessions per group at most.")
    max_open_groups_per_key: int = Field(
        256, ge=1, description="Groups one key may hold open (each holds an admission slot); more are refused (429)."
    )
    request_timeout_s: float = Field(300.0, gt=0, description="Deadline of one generation (suspension included).")
    max_session_tokens: int = Field(
        262_144,
        ge=1,
        description="Tokens one session's tree may hold (its prompts and answers, each once); a request whose "
        "new prompt tokens and max_tokens × n would pass it is refused (400, param session).",
    )
    max_key_tokens: int = Field(
        4_194_304,
        ge=1,
        description="Tokens the open sessions of one key may hold together; past it a request is refused (429) "
        "until some of its groups end.",
    )


class SessionError(Exception):
    """A request the gateway cannot serve: ``status`` is its HTTP status (the class's unless given),
    ``param`` the field, ``code`` OpenAI's error code."""

    status = 400

    def __init__(
        self, message: str, param: str | None = None, *, status: int | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.param, self.code = param, code
        if status is not None:
            self.status = status


class NotFound(SessionError):
    status = 404


class Conflict(SessionError):
    status = 409


class NoSlot(SessionError):
    status = 503


class TooMany(SessionError):
    status = 429


class Cut(SessionError):
    """A generation the engine did not finish (its deadline, or an abort): not answered, not recorded."""

    status = 503


@dataclass
class Session:
    session_id: str
    owner: str
    group: _Group
    tree: SessionTree
    reward: float | None = None
    ended: bool = False
    requests: int = 0
    in_flight: int = 0  # requests being generated: the session cannot end under them


@dataclass
class _Group:
    group_id: str
    owner: str
    size: int
    sessions: list[Session] = field(default_factory=list)
    admitted: bool = False
    ready: asyncio.Future | None = None  # set once the group's admission is decided
    closed: bool = False  # put, or given up: no session may join or end any more
    last_used: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Choice:
    """One answer: what the engine generated (cut at a stop string), as text and as a message."""

    generation: Generation
    text: str
    message: dict
    finish_reason: str  # OpenAI's: stop, length, tool_calls


@dataclass(frozen=True)
class ChatResult:
    choices: list[Choice]
    prompt_tokens: int
    rendered_tokens: int
    reused_tokens: int


class AgentSessions:
    def __init__(
        self,
        config: SessionsConfig,
        renderer: TemplateRenderer,
        engine: Generate,
        *,
        admission: Admission,
        sink: SampleSink,
    ) -> None:
        self.config, self.renderer, self.engine = config, renderer, engine
        self.admission, self.sink = admission, sink
        self.sessions: dict[str, Session] = {}
        self.groups: dict[str, _Group] = {}
        self.counters: Counter[str] = Counter()
        self.held: Counter[str] = Counter()  # tokens in each key's open sessions' trees

    # ------------------------------------------------------------------ lifecycle
    async def create(self, owner: str, group_id: str | None = None, group_size: int = 1) -> Session:
        """A new session in ``group_id`` (a new group of one when None)."""
        if not 1 <= group_size <= self.config.max_group_size:
            raise SessionError(
                f"group_size: must be in [1, {self.config.max_group_size}], got {group_size}", "group_size"
            )
        group_id = group_id or f"agent-{uuid.uuid4().hex[:12]}"
        group = self.groups.get(group_id)
        if group is None:
            if sum(g.owner == owner for g in self.groups.values()) >= self.config.max_open_groups_per_key:
                raise TooMany(
                    f"group: this key holds {self.config.max_open_groups_per_key} open groups; end some first"
                )
            group = self.groups[group_id] = _Group(group_id, owner, group_size)
            group.ready = asyncio.get_running_loop().create_future()
            try:
                await self._admit()
            except BaseException as e:
                del self.groups[group_id]
                group.ready.set_exception(e if isinstance(e, SessionError) else NoSlot(f"admission failed: {e}"))
                group.ready.exception()  # retrieved: no warning where no other session waited
                raise
            group.admitted = True
            group.ready.set_result(None)
        else:
            self._check_join(group, owner, group_size)
            await asyncio.shield(group.ready)  # a session joining while its group waits for a slot waits too
            self._check_join(group, owner, group_size)
        session = Session(f"sess-{uuid.uuid4().hex}", owner, group, SessionTree(self.renderer))
        group.sessions.append(session)
        group.last_used = time.monotonic()
        self.sessions[session.session_id] = session
        self.counters["sessions_created"] += 1
        return session

    @staticmethod
    def _check_join(group: _Group, owner: str, group_size: int) -> None:
        if group.owner != owner:  # said as for a full group: another key's group ids are not disclosed
            raise Conflict(f"group: {group.group_id!r} cannot be joined", "group")
        if group.size != group_size:
            raise Conflict(
                f"group_size: group {group.group_id!r} was created with {group.size}, got {group_size}", "group_size"
            )
        if group.closed or len(group.sessions) >= group.size:
            raise Conflict(f"group: {group.group_id!r} already has its {group.size} sessions", "group")

    async def _admit(self) -> None:
        deadline = time.monotonic() + self.config.admit_timeout_s
        while True:
            try:
                if (await self.admission.admit(1)).num_groups:
                    return
            except Exception as e:  # the controller restarts: keep asking until the deadline
                log.warning("admit: %s", e)
            if time.monotonic() >= deadline:
                self.counters["admit_refused"] += 1
                raise NoSlot("no rollout slot under the staleness bound (async_ratio) in time; retry later")
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def get(self, session_id: str, owner: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:  # another key's session is not even said to exist
            raise NotFound(f"session: no session {session_id!r}", "session")
        return session

    def set_reward(self, session: Session, reward: float) -> None:
        if session.ended:
            raise Conflict(f"session: {session.session_id!r} has ended", "session")
        session.reward = float(reward)

    async def end(self, session: Session, reward: float | None = None) -> str:
        """End a session; returns what became of its group: ``waiting`` (for its other sessions),
        ``put``, ``filtered``, ``failed`` (the buffer stayed full) or ``empty`` (nothing generated)."""
        if session.ended:
            raise Conflict(f"session: {session.session_id!r} has ended", "session")
        if session.in_flight:
            raise Conflict(f"session: {session.session_id!r} has a request being generated; end it after", "session")
        if reward is not None:
            session.reward = float(reward)
        if session.reward is None:
            raise SessionError(
                "reward: a session ends with its reward (POST .../reward, or reward in this body)", "reward"
            )
        session.ended = True
        self.counters["sessions_ended"] += 1
        group = session.group
        group.last_used = time.monotonic()
        if len(group.sessions) < group.size or not all(s.ended for s in group.sessions):
            return "waiting"
        return await self._finish(group)

    async def abandon(self, session: Session) -> None:
        """Give up a session's group (a member failed, so no reward is right for it): none of it is
        trained, its slot is released unused, and its sessions are gone."""
        group = session.group
        if group.closed:
            raise Conflict(f"session: the group of {session.session_id!r} has ended", "session")
        if any(s.in_flight for s in group.sessions):
            raise Conflict(f"session: the group of {session.session_id!r} has a request being generated", "session")
        group.closed = True
        self._forget(group)
        self.counters["groups_abandoned"] += 1
        await asyncio.shield(self._release(unused=1))

    async def _finish(self, group: _Group) -> GroupOutcome:
        """Put the ended group; its slot is released exactly once whatever happens (finished if the
        buffer kept it, else unused). A group that cannot be stored is lost, and counted."""
        group.closed = True
        self._forget(group)
        outcome, stored = GroupOutcome.FAILED, 0
        try:
            trajectories = [t for s in group.sessions for t in self.trajectories(s)]
            if not trajectories:
                outcome = GroupOutcome.EMPTY
                return outcome
            images = _images_of(group.sessions)
            result = await self.sink.put(Group(group.group_id, group.group_id, trajectories, images=images))
            outcome = GroupOutcome.of_put(result)
            stored = len(trajectories) if result.accepted else 0
            return outcome
        except Exception as e:  # a trajectory the codec refuses, the buffer away or too slow
            log.error("group %s not stored: %s: %s", group.group_id, type(e).__name__, e)
            raise SessionError(
                f"session: the group could not be stored ({type(e).__name__}: {e}); it is lost", "session"
            ) from None
        finally:
            self.counters[f"groups_{outcome}"] += 1
            self.counters["trajectories_put"] += stored
            await asyncio.shield(self._release(**({"finished": 1} if outcome is GroupOutcome.PUT else {"unused": 1})))

    def _forget(self, group: _Group) -> None:
        self.groups.pop(group.group_id, None)
        for s in group.sessions:
            if self.sessions.pop(s.session_id, None) is not None:
                self.held[s.owner] -= s.tree.tokens

    async def _release(self, **n) -> None:
        try:
            await self.admission.release(**n)
        except Exception as e:  # the controller restarts; its lease accounting recovers the slot
            log.warning("release %s: %s", n, e)

    async def expire_idle(self) -> int:
        """Abandon groups unused for ``idle_s`` (no request in flight); returns how many."""
        now, n = time.monotonic(), 0
        for group in list(self.groups.values()):
            if group.closed or not group.admitted or any(s.in_flight for s in group.sessions):
                continue
            if now - group.last_used > self.config.idle_s:
                group.closed = True
                self._forget(group)
                await self._release(unused=1)
                self.counters["groups_abandoned"] += 1
                n += 1
        return n

    # ------------------------------------------------------------------ requests
    def trajectories(self, session: Session) -> list[Trajectory]:
        """One trajectory per generation tip of the session's tree, each with the session's reward."""
        out = []
        for i, tip in enumerate(session.tree.tips()):
            p = trajectory_path(tip)
            out.append(
                Trajectory(
                    trajectory_id=f"{session.session_id}/{i}",
                    group_id=session.group.group_id,
                    prompt_id=session.group.group_id,
                    token_ids=p.token_ids,
                    loss_mask=p.loss_mask,
                    behavior_logprobs=p.behavior_logprobs,
                    token_versions=p.token_versions,
                    reward=session.reward or 0.0,
                    start_version=p.token_versions[0] if p.token_versions else 0,
                    finish_reason=p.finish_reason,
                    images=tuple(im.hash for im in p.images),
                    metadata={
                        "env": "agent",
                        "session": session.session_id,
                        "branch": i,
                        "turn_starts": p.turn_starts,
                        "turn_temperatures": p.turn_temperatures,
                        **p.grammar_metadata(),
                    },
                )
            )
        return out

    def prepare(self, session: Session | None, messages: list[dict], tools: list | None) -> Prepared:
        """The prompt for a request: through the session's tree, or rendered whole outside a session."""
        if session is None:
            r = self.renderer.whole(messages, tools)
            return Prepared(PromptNode.of("", None, r), r.ids, len(r.ids), 0)
        self._touch(session)
        return session.tree.prepare(messages, tools)

    def prepare_text(self, session: Session | None, prompt: str | list[int]) -> Prepared:
        """A raw completion's prompt: text (tokenized as the tokenizer does, special tokens added)
        or token ids, taken as they are."""
        tok = self.renderer.tokenizer
        if isinstance(prompt, str):
            ids = list(tok.encode(prompt))
        else:
            ids = list(prompt)
            if bad := [t for t in ids if not 0 <= t < len(tok)]:
                raise SessionError(f"prompt: token id {bad[0]} is not in the vocabulary (0..{len(tok) - 1})", "prompt")
        if session is None:
            return Prepared(PromptNode("", None, ids, ""), ids, len(ids), 0)
        self._touch(session)
        return session.tree.prepare_ids(ids)

    def _touch(self, session: Session) -> None:
        if session.ended:
            raise Conflict(f"session: {session.session_id!r} has ended", "session")
        session.group.last_used = time.monotonic()

    async def chat(
        self,
        session: Session | None,
        messages: list[dict] | None,
        tools: list | None,
        prepared: Prepared,
        sampling: list[SamplingParams],
        stop: list[str],
        top_logprobs: int = 0,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> ChatResult:
        """Generate one choice per ``sampling`` for ``prepared`` and record them in the session's
        tree. Tool calls are read out of the answers only where ``tools`` were offered. A
        generation cut by its deadline or an abort raises ``Cut``: nothing of the request is
        recorded, since the agent gets no answer to continue from. ``on_tokens(choice, ids)``
        streams: each choice's new tokens as the engine makes them."""
        if session is not None:
            self._check_room(session, prepared, sampling)
        route = session.session_id if session is not None else uuid.uuid4().hex
        input_ids, images = prepared.request()
        if (vision := self.renderer.vision) is not None:  # a placeholder is input only: one sampled ends the answer
            token = vision.image_token_id
            sampling = [p.model_copy(update={"stop_token_ids": [*p.stop_token_ids, token]}) for p in sampling]

        async def one(i: int, params: SamplingParams) -> Generation:
            stream = None if on_tokens is None else functools.partial(on_tokens, i)
            return await self.engine.generate(
                input_ids,
                params,
                request_id=uuid.uuid4().hex,
                route=route,
                timeout_s=self.config.request_timeout_s,
                top_logprobs=top_logprobs,
                on_tokens=stream,
                **({"images": images} if images else {}),
            )

        if session is not None:
            session.in_flight += 1
        try:
            generations = await asyncio.gather(*(one(i, p) for i, p in enumerate(sampling)))
        finally:
            if session is not None:
                session.in_flight -= 1
        if cut := [
            g.finish_reason for g in generations if g.finish_reason in (FinishReason.TIMEOUT, FinishReason.ABORT)
        ]:
            self.counters["generations_cut"] += 1
            raise Cut(f"the generation was cut ({cut[0]}: its deadline, or a weight update); retry")
        choices = [self._choice(g, stop, bool(tools)) for g in generations]
        if session is not None:
            session.requests += 1
            session.group.last_used = time.monotonic()
            before = session.tree.tokens
            for c, params in zip(choices, sampling, strict=True):
                key = None if messages is None else conversation_keys([*messages, c.message], tools)[-1]
                session.tree.record(prepared.node, c.generation, key, params.temperature, params.grammar())
            if session.session_id in self.sessions:  # not forgotten while it generated
                self.held[session.owner] += session.tree.tokens - before
        self.counters["tokens_rendered"] += prepared.rendered
        self.counters["tokens_reused"] += prepared.reused
        return ChatResult(choices, len(prepared.input_ids), prepared.rendered, prepared.reused)

    def _check_room(self, session: Session, prepared: Prepared, sampling: list[SamplingParams]) -> None:
        """Refuse a request that could take its session's tree or its key past their tokens: its new
        prompt tokens (none when the prompt is known) and every choice at its max_tokens."""
        new = prepared.rendered + sum(p.max_new_tokens for p in sampling)
        cap = self.config.max_session_tokens
        if session.tree.tokens + new > cap:
            raise SessionError(
                f"session: it holds {session.tree.tokens} tokens; this request's {new} (prompt and max_tokens × n) "
                f"would pass its {cap}",
                "session",
            )
        cap = self.config.max_key_tokens
        if self.held[session.owner] + new > cap:
            raise TooMany(
                f"session: this key's open sessions hold {self.held[session.owner]} tokens; this request's {new} "
                f"would pass the key's {cap} (end some groups first)",
                "session",
            )

    def _choice(self, gen: Generation, stop: list[str], tools: bool) -> Choice:
        if self.renderer.vision is not None and self.renderer.vision.image_token_id in gen.output_ids:
            # A sampled image placeholder has no image: no forward could read it. The answer ends before it.
            gen = cut_at(gen, gen.output_ids.index(self.renderer.vision.image_token_id))
            self.counters["image_placeholders_cut"] += 1
        gen, text, hit = cut_at_stop(self.renderer.tokenizer, gen, stop)
        parsed = parse_tool_calls(text) if tools else ParsedReply(text, [])
        if parsed.tool_calls:
            reason = "tool_calls"
        else:
            reason = "length" if gen.finish_reason == FinishReason.LENGTH and not hit else "stop"
        return Choice(gen, text, parsed.message(), reason)


def _images_of(sessions: list[Session]) -> dict[str, bytes]:
    """Every image a group's trajectories show, once (sessions shown the same picture share it)."""
    return {im.hash: im.raw for s in sessions for tip in s.tree.tips() for im in trajectory_path(tip).images}


def cut_at_stop(tokenizer, gen: Generation, stop: list[str]) -> tuple[Generation, str, bool]:
    """The generation up to the first stop string (OpenAI's ``stop``: the text ends before it, the
    tokens at the one that completed it). Returns (generation, text, whether a stop string was hit)."""
    text = tokenizer.decode(gen.output_ids, skip_special_tokens=True)
    found = [(text.find(s), s) for s in stop if s and s in text]
    if not found:
        return gen, text, False
    at, hit = min(found)
    # The shortest token prefix whose text reaches the stop string's end, found by bisection: trying
    # every prefix decoded O(n²) tokens on the event loop (2 s for a 4,096-token answer).
    lo, hi = 1, len(gen.output_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(gen.output_ids[:mid], skip_special_tokens=True)) >= at + len(hit):
            hi = mid
        else:
            lo = mid + 1
    return cut_at(gen, lo), text[:at], True


def cut_at(gen: Generation, k: int) -> Generation:
    """The generation's first ``k`` tokens, as stopped there."""
    return Generation(
        gen.output_ids[:k], gen.behavior_logprobs[:k], gen.token_versions[:k], FinishReason.STOP, gen.top_logprobs[:k]
    )
