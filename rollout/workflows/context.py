"""What a rollout workflow is handed: ``EpisodeContext`` (the episode's ids, its environment, the
policy, its budgets) and ``Thread`` (one conversation with the policy, token-in/token-out, that
becomes one trajectory).

A thread's tokens are what the engines produced, never re-tokenized: a generated turn is appended as
its token ids with their log-probs and weight versions, and a later message is rendered as the text
the chat template adds for it (``rollout/chat_turns.py``). Everything that ends an episode early (a
deadline, an environment that failed, a prompt past the model's context) raises ``Ended`` with the
finish reason; the episode's runner turns it into the trajectory's end.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time

from rollout.budgets import EpisodeClock
from rollout.chat_turns import Conversation
from rollout.env_calls import env_call, env_error
from rollout.envs.base import Observation
from rollout.ports import Generation
from rollout.sampling import SamplingParams
from sample_buffer import routing
from sample_buffer.trajectory import FinishReason, Trajectory
from sample_buffer.vision import MAX_IMAGES, MAX_REQUEST_IMAGE_BYTES, VisionError, content_hash

log = logging.getLogger(__name__)
ENDS_EPISODE = (FinishReason.TIMEOUT, FinishReason.ABORT)
# How engines say a prompt (with the tokens asked for) does not fit: the embedded engine ("fills / exceeds
# the model's context"), vLLM ("maximum context length"), SGLang ("longer than the model's context length").
_CONTEXT_FULL = re.compile(r"model's context|context length", re.IGNORECASE)


class Ended(Exception):
    """The episode ends here, for this reason; ``why`` goes into the trajectory's metadata."""

    def __init__(self, finish: FinishReason, **why) -> None:
        super().__init__(finish)
        self.finish, self.why = finish, why


class WorkflowError(ValueError):
    """A workflow broke a rule (no trajectory, tokens the engines did not make, a reward that is not
    a number): its episode ends as ``env_error`` of kind ``workflow``."""


def observation_text(obs, vision) -> tuple[str, tuple[bytes, ...]]:
    """An environment's observation as text with one placeholder per image first (as vision-language
    chat templates put them), and its images."""
    if not isinstance(obs, Observation):
        return obs, ()
    text, images = obs.text, tuple(obs.images)
    if images and vision is None:
        raise Ended(
            FinishReason.ENV_ERROR, error="the environment sent images to a text-only model", error_kind="images"
        )
    return (vision.placeholder * len(images) + text if images else text), images


async def expanded(vision, ids: list[int], images: tuple[bytes, ...], before: tuple[bytes, ...] = ()) -> list[int]:
    """``ids`` (a turn with one placeholder per image) with each expanded to its image's tokens,
    the images decoded off the event loop. A ``VisionError`` where the text itself holds a
    placeholder (they no longer match), or where the conversation's images (``before``: earlier
    turns', which every request carries again) outgrow a request's limits."""
    if vision is None:
        return ids
    if (n := ids.count(vision.image_token_id)) != len(images):
        raise VisionError("images", f"{n} image placeholders for {len(images)} images")
    if not images:
        return ids
    shown = (*before, *images)
    if len(shown) > MAX_IMAGES:
        raise VisionError("images", f"{len(shown)} images in the conversation; a request carries at most {MAX_IMAGES}")
    if (size := sum(map(len, shown))) > MAX_REQUEST_IMAGE_BYTES:
        raise VisionError(
            "images", f"{size} bytes of images in the conversation; a request carries {MAX_REQUEST_IMAGE_BYTES}"
        )
    measured = await asyncio.to_thread(vision.measure, list(images), "images")
    return vision.expand(ids, [m.tokens for m in measured], "images")


class EpisodeContext:
    """One episode's ids, environment, policy and budgets. ``seed`` is the dataset row the
    environment is reset to; ``config`` the episode section (``EpisodeConfig``)."""

    def __init__(
        self,
        env,
        seed,
        generate,
        tokenizer,
        config,
        ids: dict,
        observer,
        *,
        vision=None,
        image_store=None,
        barrier=None,
        row: dict | None = None,
        reward_fn=None,
    ) -> None:
        self.env, self.seed, self.tokenizer, self.config, self.ids = env, seed, tokenizer, config, ids
        self.observer, self.vision = observer, vision
        self.row = row  # the dataset row the episode is reset to (None: a remote provider's, which it keeps)
        self._reward_fn = reward_fn  # the task's reward, as its environment scores with it
        self.barrier = barrier  # batch rollout: every episode's turns in step (the env workflow waits at it)
        self.image_store = {} if image_store is None else image_store
        self._generate = generate
        self.started = time.monotonic()
        self.clock = EpisodeClock(config.step_timeout_s, config.generation_timeout_s, None, self.started)
        self.threads: list[Thread] = []  # what a custom workflow's trajectory must be one of
        self._generate_s: float | None = None  # the latest generation's, reported with the step that follows
        self.budget = "generation"  # the budget that bounded the latest generation

    @property
    def trajectory_id(self) -> str:
        return self.ids["trajectory_id"]

    # ------------------------------------------------------------------ the environment
    async def reset(self):
        """The environment's first observation. Its budgets (a remote one's are known once it is
        reset) then bound the episode, within the config's limits."""
        try:
            obs = await env_call(self.env.reset, self.seed, self.config.step_timeout_s)
        except TimeoutError:
            raise Ended(FinishReason.TIMEOUT, timeout="reset") from None
        except Exception as e:
            log.warning("%s: reset failed: %s: %s", self.trajectory_id, type(e).__name__, e)
            raise Ended(FinishReason.ENV_ERROR, **env_error(e)) from None
        budgets = getattr(self.env, "budgets", None)
        self.clock = EpisodeClock(self.config.step_timeout_s, self.config.generation_timeout_s, budgets, self.started)
        return obs

    async def step(self, action: str):
        """The environment's answer to ``action``, within the step's budget."""
        timeout_s, budget = self.clock.step()
        t_step = time.monotonic()
        try:
            if timeout_s <= 0:
                raise TimeoutError(budget)
            return await env_call(self.env.step, action, timeout_s)
        except TimeoutError:  # the provider's own deadline too (ProviderTimeout)
            raise Ended(FinishReason.TIMEOUT, timeout=budget) from None
        except Exception as e:  # the environment's fault, not the policy's: the member is not trained
            log.warning("%s: step failed: %s: %s", self.trajectory_id, type(e).__name__, e)
            raise Ended(FinishReason.ENV_ERROR, **env_error(e)) from None
        finally:
            self.report_turn(time.monotonic() - t_step)

    def report_turn(self, step_s: float | None) -> None:
        if self._generate_s is not None:
            report(self.observer.turn, self.env.name, self._generate_s, step_s)
            self._generate_s = None

    async def score(self, response: str, answer=None) -> float:
        """The task's reward for ``response`` (against ``answer``, default the row's), computed as the
        environment's step computes it (the reward workers, the sandbox, the judge or the reward service
        the config names), within the step's budget."""
        if self._reward_fn is None:
            raise WorkflowError("ctx.score: this task has no reward function here (a remote provider scores in step)")
        if answer is None:
            if self.row is None or "answer" not in self.row:
                raise WorkflowError("ctx.score: no answer given, and the dataset row has none")
            answer = self.row["answer"]
        timeout_s, budget = self.clock.step()
        try:
            if timeout_s <= 0:
                raise TimeoutError(budget)
            reward = await env_call(lambda r: self._reward_fn(r, answer), response, timeout_s)
        except TimeoutError:
            raise Ended(FinishReason.TIMEOUT, timeout=budget) from None
        except Exception as e:  # the verifier's fault, as in an environment's step: not trained on
            log.warning("%s: scoring failed: %s: %s", self.trajectory_id, type(e).__name__, e)
            raise Ended(FinishReason.ENV_ERROR, **env_error(e)) from None
        return float(reward)

    # ------------------------------------------------------------------ the policy
    def sampling(self, sampling: SamplingParams | None = None) -> SamplingParams:
        """``sampling`` (default: the episode section's) within the episode's budgets; a
        vision-language policy's image placeholder ends a turn (it is input only)."""
        params = self.clock.sampling(sampling or self.config.sampling)
        if self.vision is not None:
            params = params.model_copy(update={"stop_token_ids": [*params.stop_token_ids, self.vision.image_token_id]})
        return params

    async def generate(
        self, ids: list[int], sampling: SamplingParams, images: tuple[bytes, ...] = (), request_id: str | None = None
    ) -> Generation:
        """One generation through the LLMProxy within the generation's budget; recorded. ``request_id``:
        the thread's (default: the episode's first, its trajectory id)."""
        timeout_s, budget = self.clock.generation()
        if timeout_s <= 0:
            raise Ended(FinishReason.TIMEOUT, timeout=budget)
        t_gen = time.monotonic()
        try:
            with_images = {"images": images} if images else {}
            gen = await self._generate(ids, sampling, request_id or self.trajectory_id, timeout_s, **with_images)
        except ValueError as e:
            if not _CONTEXT_FULL.search(str(e)):  # a request the config made wrong: not this episode's
                raise
            # The engine refused the turn: the conversation outgrew the model's context.
            log.warning("%s: generation refused: %s", self.trajectory_id, e)
            raise Ended(FinishReason.ENV_ERROR, error=str(e)[:500], error_kind="context") from None
        self._generate_s = time.monotonic() - t_gen
        self.budget = budget  # which budget bounded it: a timeout's trajectory names it
        return gen

    async def chat(self, observation) -> Thread:
        """A conversation opened by ``observation`` (text, or an ``Observation`` with images) as its
        first user message, or by a list of chat messages (a system prompt, few-shot turns, then the
        user's), rendered with the chat template."""
        if isinstance(observation, list):
            text, images = observation, ()
        else:
            text, images = observation_text(observation, self.vision)
        try:
            chat = Conversation(self.tokenizer, text)
        except ValueError as e:
            raise WorkflowError(str(e)) from None
        sent = chat.prompt_ids()  # the conversation as the engines take it: one placeholder per image
        try:  # what the model reads (and the engine consumes): each placeholder expanded to its image's tokens
            tokens = await expanded(self.vision, sent, images)
        except VisionError as e:
            raise Ended(FinishReason.ENV_ERROR, error=str(e)[:500], error_kind="images") from None
        self.image_store.update({content_hash(x): x for x in images})
        return self._opened(Thread(self, tokens, list(sent), images, chat))

    def thread(self, prompt_ids: list[int]) -> Thread:
        """A thread over prompt token ids the workflow rendered itself (no chat template)."""
        return self._opened(Thread(self, list(prompt_ids), list(prompt_ids), (), None))

    def _opened(self, thread: Thread) -> Thread:
        """The episode's first thread is its trajectory id; each later one (a branch, a sub-agent) is
        ``<id>.<k>``: its own request at the engines and its own trajectory, in the same group."""
        k = len(self.threads)
        thread.trajectory_id = self.trajectory_id if k == 0 else f"{self.trajectory_id}.{k}"
        self.threads.append(thread)
        return thread


class Thread:
    """One conversation's tokens so far: what the model read (image placeholders expanded), what the
    engines are sent (one placeholder per image), which tokens are the policy's, their log-probs,
    versions and experts, the images, and where each generated turn starts."""

    def __init__(self, ctx: EpisodeContext, tokens, sent, images, chat: Conversation | None) -> None:
        self.ctx, self.tokens, self.sent, self.images, self.chat = ctx, tokens, sent, images, chat
        self.mask = [0] * len(tokens)
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turns: list[int] = []
        self.temperatures: list[float] = []
        self.grammars: list = []
        # MoE routing replay: each forwarded position's experts, from the latest turn (whose forward the newest
        # tokens came from); a turn without them (not asked, or not sent) leaves the trajectory without any
        self.experts, self.turn_without_routing = None, False
        self.last: Generation | None = None
        self.trajectory_id = ctx.trajectory_id  # set by the context that opens it

    async def generate(self, sampling: SamplingParams | None = None) -> Generation:
        """The policy's next turn, appended (trained on). A generation cut by the episode's deadline
        or aborted is kept, then ends the episode (``Ended``)."""
        ctx = self.ctx
        params = ctx.sampling(sampling)
        gen = await ctx.generate(self.sent if self.images else self.tokens, params, self.images, self.trajectory_id)
        self.turns.append(len(self.tokens))
        self.temperatures.append(params.temperature)
        self.grammars.append(params.grammar())
        self.tokens += gen.output_ids
        self.sent += gen.output_ids
        self.mask += [1] * len(gen.output_ids)
        self.logprobs += gen.behavior_logprobs
        self.versions += gen.token_versions
        self.last = gen
        if gen.routed_experts is None:
            self.turn_without_routing = True
        else:
            try:
                self.experts = routing.latest(self.experts, gen.routed_experts)
            except routing.RoutingError as e:  # another width than the turn before: not this run's model
                log.warning("%s: %s; its routing is dropped", ctx.trajectory_id, e)
                self.turn_without_routing = True
        vision = ctx.vision
        if vision is not None and vision.image_token_id in gen.output_ids:  # no forward reads it as text
            raise Ended(FinishReason.ERROR, error="sampled an image placeholder", error_kind="image_token")
        if gen.finish_reason in ENDS_EPISODE:
            ctx.report_turn(None)
            timed_out = gen.finish_reason == FinishReason.TIMEOUT
            raise Ended(gen.finish_reason, **({"timeout": ctx.budget} if timed_out else {}))
        return gen

    def text(self, gen: Generation | None = None) -> str:
        """A generation's text (default: the latest)."""
        gen = gen or self.last
        return "" if gen is None else self.ctx.tokenizer.decode(gen.output_ids, skip_special_tokens=True)

    async def add(self, role: str, content, images: tuple[bytes, ...] = ()) -> None:
        """A message after the policy's turn (``role`` user or tool; ``content`` text or an
        ``Observation``), as the next turn's prompt tokens (not trained on)."""
        if self.chat is None or self.last is None:
            raise WorkflowError("Thread.add: a message follows a generated turn of a chat thread (ctx.chat)")
        text, shown = observation_text(content, self.ctx.vision)
        shown = shown or tuple(images)
        gen = self.last
        try:
            next_turn = self.chat.next_turn(gen.output_ids, gen.finish_reason == FinishReason.STOP, role, text)
        except Exception as e:  # a role the chat does not have, a template that refuses the turn
            raise Ended(FinishReason.ENV_ERROR, **env_error(e)) from None
        try:  # the turn's images (a screenshot after an action) expanded as the first turn's
            seen = await expanded(self.ctx.vision, next_turn, shown, self.images)
        except VisionError as e:
            raise Ended(FinishReason.ENV_ERROR, error=str(e)[:500], error_kind="images") from None
        self.images += shown
        self.ctx.image_store.update({content_hash(x): x for x in shown})
        self.tokens += seen
        self.sent += next_turn
        self.mask += [0] * len(seen)
        self.last = None

    def extend(self, ids: list[int]) -> None:
        """Prompt tokens the workflow rendered itself, appended (not trained on)."""
        self.tokens += ids
        self.sent += ids
        self.mask += [0] * len(ids)

    def trajectory(self, reward: float, finish: FinishReason = FinishReason.STOP, **metadata) -> Trajectory:
        if not math.isfinite(reward):
            raise WorkflowError(f"reward: {reward!r} is not a finite number")
        # every turn's, if any had one; none generated: the episode's own (as a turn would have had)
        grammars = self.grammars if any(self.grammars) else None
        if grammars is None and not self.turns and self.ctx.sampling().grammar() is not None:
            grammars = []
        return Trajectory(
            **{**self.ctx.ids, "trajectory_id": self.trajectory_id},
            token_ids=self.tokens,
            loss_mask=self.mask,
            behavior_logprobs=self.logprobs,
            token_versions=self.versions,
            reward=reward,
            start_version=self.versions[0] if self.versions else 0,
            finish_reason=finish,
            routed_experts=None if self.turn_without_routing else self.experts,
            images=tuple(content_hash(x) for x in self.images),
            metadata={
                "env": self.ctx.env.name,
                "turn_starts": self.turns,
                # the temperature each turn was sampled at: μ is at it, so the trainer's π must be too
                "turn_temperatures": self.temperatures,
                # and under its grammar, if any: μ is the masked distribution's, so the trainer masks π too
                **(
                    {"turn_grammars": [None if g is None else list(g) for g in grammars]}
                    if grammars is not None
                    else {}
                ),
                **metadata,
                **({} if self.chat is None or self.chat.exact else {"chat_render": "alone"}),
            },
        )


def report(hook, *args) -> None:
    """A metrics fault is logged, never the end of an episode."""
    try:
        hook(*args)
    except Exception:
        log.exception("reporting to the rollout observer failed")
