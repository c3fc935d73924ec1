"""LLM as judge: a judge model, served through an LLMProxy (the mesh's own or another), reads the
answer beside the reference, and its verdict is the reward.

The judge's prompt is ``template`` with ``{response}`` and ``{answer}`` filled in, rendered with
the judge model's chat template; its generation is greedy by default and bounded by
``max_new_tokens`` and ``timeout_s``; the verdict is the first group of ``verdict_pattern`` in its
text, mapped to a score by ``scores``. A judge that times out, fails or gives no verdict costs
that one score (0), counted by cause. The judge's calls go through the ``Generate`` port with
request ids of their own (``judge-...``) and only a number comes back, so they never become part
of a trajectory, and they take no admission slot.

Rewards are called from the environment's step, in a thread; the judge's generation runs on the
event loop that owns the proxy client, and the calling thread waits for it. Calling it on that
loop's own thread would deadlock, so it raises instead.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
import uuid
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout.chat_turns import render_prompt
from rollout.ports import Generate
from rollout.sampling import SamplingParams
from sample_buffer.trajectory import FinishReason

DEFAULT_TEMPLATE = (
    "Reference answer: {answer}\nStudent answer: {response}\n"
    "Does the student answer state the same final result as the reference? "
    "Reply with 'Verdict: correct' or 'Verdict: incorrect'."
)
FAILURE_CAUSES = ("timeout", "error", "unparsed")
GRACE_S = 2.0  # past the generation's own deadline, for its answer to come back


class JudgeRewardConfig(BaseModel):
    """``reward: {type: judge, ...}``: a judge model's verdict is the reward."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["judge"] = Field("judge", description="Selects the LLM judge.")
    proxy: str | None = Field(
        None, description="host:port of the judge's LLMProxy; null: the mesh's own (the policy judges itself)."
    )
    tokenizer_path: str | None = Field(None, description="The judge model's tokenizer; null: the task's.")
    template: str = Field(DEFAULT_TEMPLATE, description="The judge's prompt, with {response} and {answer}.")
    verdict_pattern: str = Field(
        r"(?i)verdict\s*:\s*(correct|incorrect)",
        description="A regular expression; its first group in the judge's text is the verdict.",
    )
    scores: dict[str, float] = Field(
        default_factory=lambda: {"correct": 1.0, "incorrect": 0.0},
        description="Score of each verdict (matched lower-cased); a verdict not listed scores 0 as unparsed.",
    )
    max_new_tokens: int = Field(32, ge=1, description="The judge's answer, tokens.")
    temperature: float = Field(0.0, ge=0, description="The judge's sampling temperature (0: greedy).")
    timeout_s: float = Field(
        20.0,
        gt=0,
        description="One verdict, s (a wait for a free call included); past it the answer scores 0 "
        "(timeout). With its grace it must fit in episode.step_timeout_s.",
    )
    max_concurrent: int = Field(8, ge=1, description="Judge calls in flight at once; more wait.")

    @field_validator("template")
    @classmethod
    def _fields(cls, template: str) -> str:
        if "{response}" not in template:
            raise ValueError("must contain {response}")
        try:
            template.format(response="", answer="")  # another {field} fails at load, not mid-run
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"only {{response}} and {{answer}} are filled in (double other braces): {e!r}") from None
        return template

    @field_validator("verdict_pattern")
    @classmethod
    def _one_group(cls, pattern: str) -> str:
        if re.compile(pattern).groups < 1:
            raise ValueError(f"needs a group that captures the verdict, got {pattern!r}")
        return pattern

    def max_seconds(self) -> float:
        """The longest one score can take."""
        return self.timeout_s + GRACE_S

    def build(self, judge=None, **_):
        """The reward; ``judge(config)`` builds it where a proxy can be reached (the EnvManager)."""
        if judge is None:
            raise ValueError(
                "reward.type judge needs an LLMProxy to reach the judge: it runs in the EnvManager "
                "or a reward service; elsewhere (an environment provider, a held-out evaluation) "
                "host it in `rollmesh serve reward` and name that with {type: service}"
            )
        return judge(self)


def parse_verdict(text: str, pattern: str, scores: dict[str, float]) -> float | None:
    """The score of the first verdict in ``text``, or None when there is none it knows."""
    m = re.search(pattern, text)
    if not m:
        return None
    return {k.lower(): v for k, v in scores.items()}.get(m.group(1).strip().lower())


class JudgeReward:
    def __init__(
        self, config: JudgeRewardConfig, generate: Generate, tokenizer, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.config, self.generate, self.tokenizer, self.loop = config, generate, tokenizer, loop
        self.failures: Counter[str] = Counter(dict.fromkeys(FAILURE_CAUSES, 0))
        self.calls = 0
        self._slots = threading.BoundedSemaphore(config.max_concurrent)
        self._lock = threading.Lock()

    def __call__(self, response: str, answer: str) -> float:
        return self.scored(response, answer)[0]

    def scored(self, response: str, answer: str, timeout_s: float | None = None) -> tuple[float, str]:
        """The score and, when the judge gave none, the cause of its 0 ("" otherwise). ``timeout_s``:
        the caller's own bound, when shorter than the judge's."""
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:  # no loop runs in this thread: the normal case (an environment's step thread)
            on_loop = False
        if on_loop:
            raise RuntimeError("the judge reward waits for its event loop: call it from another thread")
        c = self.config
        limit = c.timeout_s if timeout_s is None else min(timeout_s, c.timeout_s)
        deadline = time.monotonic() + limit
        if not self._slots.acquire(timeout=limit):
            return self._failed("timeout")
        try:
            with self._lock:
                self.calls += 1
            left = max(0.01, deadline - time.monotonic())
            fut = asyncio.run_coroutine_threadsafe(self._verdict(response, answer, left), self.loop)
            try:
                text = fut.result(timeout=left + GRACE_S)  # the generation has its own deadline inside
            except TimeoutError:
                fut.cancel()
                return self._failed("timeout")
            except Exception:
                return self._failed("error")
        finally:
            self._slots.release()
        if isinstance(text, FinishReason):
            return self._failed("timeout" if text == FinishReason.TIMEOUT else "error")
        score = parse_verdict(text, c.verdict_pattern, c.scores)
        return self._failed("unparsed") if score is None else (score, "")

    async def _verdict(self, response: str, answer: str, timeout_s: float) -> str | FinishReason:
        """The judge's text, or the finish reason of a generation that did not end (timeout, abort, error)."""
        c = self.config
        prompt = render_prompt(self.tokenizer, c.template.format(response=response, answer=answer))
        rid = f"judge-{uuid.uuid4().hex[:12]}"
        sampling = SamplingParams(max_new_tokens=c.max_new_tokens, temperature=c.temperature)
        gen = await self.generate.generate(prompt, sampling, request_id=rid, route=rid, timeout_s=timeout_s)
        if gen.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return gen.finish_reason
        return self.tokenizer.decode(gen.output_ids, skip_special_tokens=True)

    def _failed(self, cause: str) -> tuple[float, str]:
        with self._lock:
            self.failures[cause] += 1
        return 0.0, cause
