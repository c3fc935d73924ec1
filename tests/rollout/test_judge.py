"""The LLM judge as a plain object over the ``Generate`` port (a scripted judge model answers):
the verdict is parsed into the score, and a judge that times out, fails or says nothing it knows
costs that one score, counted. The judge against a real LLMProxy: tests/services/test_env_manager.py."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import ValidationError

from rollout.config import RolloutConfig
from rollout.ports import Generation
from rollout.verifiers.judge import GRACE_S, JudgeReward, JudgeRewardConfig, parse_verdict
from sample_buffer.trajectory import FinishReason


class ByteTokenizer:
    """Renders a chat as its text's bytes; decodes bytes back."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        return list(messages[-1]["content"].encode())

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode()


class ScriptedJudge:
    """Answers 'Verdict: correct' when the prompt's student answer equals its reference."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode, self.prompts, self.request_ids = mode, [], []

    async def generate(self, input_ids, sampling, *, request_id, route, timeout_s, **_):
        text = bytes(input_ids).decode()
        self.prompts.append(text)
        self.request_ids.append(request_id)
        if self.mode == "error":
            raise RuntimeError("the judge's engine fell over")
        if self.mode == "timeout":
            return Generation([], [], [], FinishReason.TIMEOUT)
        if self.mode == "slow":  # never answers within the judge's deadline
            await asyncio.sleep(30)
        if self.mode == "mumble":
            return Generation(list(b"hmm"), [0.0] * 3, [0] * 3, FinishReason.LENGTH)
        ref, said = text.split("R=")[1].split(";")[0], text.split("S=")[1].split(";")[0]
        out = f"Verdict: {'correct' if ref == said else 'incorrect'}".encode()
        return Generation(list(out), [0.0] * len(out), [0] * len(out), FinishReason.STOP)


def judge_on_a_loop(mode: str = "ok", **cfg):
    """A JudgeReward whose generations run on an event loop in a thread of their own, as in the EnvManager."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    port = ScriptedJudge(mode)
    config = JudgeRewardConfig(template="R={answer}; S={response};", **cfg)
    return JudgeReward(config, port, ByteTokenizer(), loop), port, loop


def test_the_verdict_is_the_score():
    judge, port, loop = judge_on_a_loop()
    try:
        with ThreadPoolExecutor(4) as ex:  # as environments' step threads call it
            scores = list(ex.map(judge, ["7", "8", "7", "x"], ["7", "7", "7", "7"]))
    finally:
        loop.call_soon_threadsafe(loop.stop)
    assert scores == [1.0, 0.0, 1.0, 0.0] and judge.calls == 4
    assert port.prompts[0] in ("R=7; S=7;", "R=7; S=8;", "R=7; S=x;")  # the template, filled in
    assert all(r.startswith("judge-") for r in port.request_ids) and len(set(port.request_ids)) == 4
    assert dict(judge.failures) == {"timeout": 0, "error": 0, "unparsed": 0}


@pytest.mark.parametrize("mode", ["timeout", "slow", "error", "mumble"])
def test_a_judge_that_fails_costs_one_score_counted(mode):
    judge, _, loop = judge_on_a_loop(mode, timeout_s=0.5)
    try:
        t0 = time.monotonic()
        assert judge("7", "7") == 0.0
        assert time.monotonic() - t0 < 0.5 + GRACE_S + 1  # a judge that never answers is not waited for
    finally:
        loop.call_soon_threadsafe(loop.stop)
    cause = {"timeout": "timeout", "slow": "timeout", "error": "error", "mumble": "unparsed"}[mode]
    assert judge.failures[cause] == 1 and sum(judge.failures.values()) == 1


def test_calling_the_judge_on_its_own_loop_raises_instead_of_deadlocking():
    async def main():
        judge = JudgeReward(JudgeRewardConfig(), ScriptedJudge(), ByteTokenizer(), asyncio.get_running_loop())
        with pytest.raises(RuntimeError, match="another thread"):
            judge("7", "7")

    asyncio.run(main())


def test_verdicts_parse_and_bad_configs_fail_at_load():
    scores = {"correct": 1.0, "incorrect": 0.0, "partly": 0.5}
    pattern = JudgeRewardConfig().verdict_pattern
    assert parse_verdict("Thinking... Verdict: Correct.", pattern, scores) == 1.0
    assert parse_verdict("verdict:incorrect", pattern, scores) == 0.0
    assert parse_verdict("no idea", pattern, scores) is None
    assert parse_verdict("Grade: partly", r"Grade: (\w+)", scores) == 0.5
    with pytest.raises(ValidationError, match="response"):
        JudgeRewardConfig(template="just {answer}")
    with pytest.raises(ValidationError, match="group"):
        JudgeRewardConfig(verdict_pattern="Verdict: correct")
    with pytest.raises(ValidationError, match="question"):
        JudgeRewardConfig(template="{question} {response}")
    cfg = RolloutConfig(reward={"type": "judge", "proxy": "127.0.0.1:1", "max_new_tokens": 8})
    assert isinstance(cfg.reward, JudgeRewardConfig) and cfg.reward.max_new_tokens == 8
    with pytest.raises(ValueError, match="needs an LLMProxy"):
        cfg.env_factory()  # outside the EnvManager no judge can be reached
    with pytest.raises(ValidationError, match="step_timeout_s"):  # the step would be cut before its verdict
        RolloutConfig(reward={"type": "judge", "timeout_s": 40}, episode={"step_timeout_s": 30})
