"""Rollout workflows (issue 65): a function the user writes that is the episode, over a context that
keeps token-in/token-out, run against the real embedded engine."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from rollout.chat_turns import Conversation
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.envs.base import StepResult
from rollout.episode import EpisodeConfig, run_trajectories
from rollout.ports import Generation
from sample_buffer.trajectory import FinishReason

FNS = "tests.rollout.workflow_fns"


class Scored:
    """Single-step: the answer's score is its length's parity (any answer can be scored); a step
    on 'slow' takes longer than any deadline these tests set."""

    name = "scored"

    def __init__(self) -> None:
        self.actions: list[str] = []

    def reset(self, seed):
        return f"Count to {seed + 3}."

    def step(self, action):
        self.actions.append(action)
        if action == "slow":
            time.sleep(2.0)
        return StepResult(None, float(len(action) % 2), True)


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = EmbeddedEngine(EngineConfig(model_path=tiny_model, num_threads=1)).start()
    yield eng
    eng.shutdown()


def _run(engine, tiny_model, workflow: str, row=None, reward_fn=None, every=False, **config):
    """The episode's trajectory (``every``: all it returned) and the engine's generations, in order."""
    tok = AutoTokenizer.from_pretrained(tiny_model)
    made: list[Generation] = []

    async def generate(input_ids, sampling, trajectory_id, timeout_s):
        out = await asyncio.wrap_future(engine.submit(f"{trajectory_id}-{len(made)}", input_ids, sampling))
        gen = Generation(
            out.output_ids, out.behavior_logprobs, out.token_versions, FinishReason.of_engine(out.finish_reason["type"])
        )
        gen.request_id, gen.prompt = trajectory_id, list(input_ids)  # which thread asked, for the branch test
        made.append(gen)
        return gen

    cfg = EpisodeConfig(
        workflow={"type": "custom", "path": f"{FNS}:{workflow}"},
        sampling={"max_new_tokens": 12, "ignore_eos": True},
        **config,
    )
    env = Scored()
    ids = {"trajectory_id": "g/0", "group_id": "g", "prompt_id": "p"}
    out = asyncio.run(run_trajectories(env, 0, generate, tok, cfg, row=row, reward_fn=reward_fn, **ids))
    return (out if every else out[0]), made, env, tok


def test_a_users_workflow_is_the_episode_token_in_token_out(engine, tiny_model):
    """Answer, critique, answer again: two turns whose trained tokens are exactly what the engine made
    (with its log-probs and versions), the critique rendered by the chat template between them, and the
    reward the environment's score of the last answer."""
    traj, made, env, tok = _run(engine, tiny_model, "retry_with_critique")
    assert traj.finish_reason == FinishReason.STOP and len(made) == 2
    first, second = made
    starts = traj.metadata["turn_starts"]
    chat = Conversation(tok, "Count to 3.")
    prompt = chat.prompt_ids()
    critique = chat.next_turn(
        first.output_ids, first.finish_reason == FinishReason.STOP, "user", "Check your answer, then give it again."
    )
    assert list(traj.token_ids) == prompt + first.output_ids + critique + second.output_ids
    assert starts == [len(prompt), len(prompt) + len(first.output_ids) + len(critique)]
    trained = [t for t, m in zip(traj.token_ids, traj.loss_mask) if m]
    assert trained == first.output_ids + second.output_ids  # never re-tokenized
    assert list(traj.behavior_logprobs) == first.behavior_logprobs + second.behavior_logprobs
    assert len(traj.token_versions) == len(trained)
    assert env.actions == [tok.decode(second.output_ids, skip_special_tokens=True)]
    assert traj.reward == float(len(env.actions[0]) % 2)
    assert traj.metadata["critique_turns"] == 1 and traj.metadata["env"] == "scored"


@pytest.mark.parametrize(
    ("workflow", "why"),
    [
        ("raises", "RuntimeError: the user's bug"),
        ("returns_nothing", "not a Trajectory"),
        ("forges_tokens", "token_ids: not the tokens its thread recorded"),
        ("nan_reward", "reward: nan is not a finite number"),
        ("returns_a_thread_twice", "returned twice"),
        ("scores_itself", "ctx.score: this task has no reward function"),
    ],
)
def test_a_workflow_that_breaks_a_rule_ends_its_episode_as_a_workflow_error(engine, tiny_model, caplog, workflow, why):
    """Nothing of it is trained (env_error), the traceback is in the log, and the next episode runs."""
    with caplog.at_level(logging.WARNING, logger="rollout.episode"):
        traj, made, _, _ = _run(engine, tiny_model, workflow, row=ROW)
    assert traj.finish_reason == FinishReason.ENV_ERROR and len(made) == 1
    assert traj.metadata["error_kind"] == "workflow" and why in traj.metadata["error"], traj.metadata
    assert list(traj.token_ids) == [] and not any(traj.loss_mask)
    assert f"workflow {FNS}:{workflow} failed" in caplog.text and "Traceback" in caplog.text
    again, _, _, _ = _run(engine, tiny_model, "retry_with_critique")
    assert again.finish_reason == FinishReason.STOP


ROW = {"prompt": "Say seven.", "answer": "seven"}


class Recording:
    """A task's reward: 1 for an answer of odd length; records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def __call__(self, response: str, answer: str) -> float:
        self.calls.append((response, answer))
        return float(len(response) % 2)


def test_a_workflow_scores_with_the_tasks_reward_and_reads_its_row(engine, tiny_model):
    """``ctx.row`` is the dataset row; ``ctx.score(text)`` asks the task's own reward against the row's
    answer, as the environment's step would, and nothing steps the environment."""
    reward = Recording()
    traj, made, env, tok = _run(engine, tiny_model, "scores_itself", row=ROW, reward_fn=reward)
    text = tok.decode(made[0].output_ids, skip_special_tokens=True)
    assert reward.calls == [(text, "seven")] and env.actions == []
    assert traj.reward == float(len(text) % 2) and traj.metadata["scored"] == "ctx"
    assert list(traj.token_ids) == Conversation(tok, "Say seven.").prompt_ids() + made[0].output_ids


def test_an_episode_returns_its_branches_each_its_own_request_and_trajectory(engine, tiny_model):
    """Two sub-agents asked at once beside the episode's thread: three trajectories, ids g/0, g/0.1 and
    g/0.2, each with the tokens its own request got from the engine and its own score."""
    reward = Recording()
    trajs, made, _, tok = _run(engine, tiny_model, "branches", row=ROW, reward_fn=reward, every=True)
    assert [t.trajectory_id for t in trajs] == ["g/0", "g/0.1", "g/0.2"]
    assert {t.group_id for t in trajs} == {"g"} and [t.metadata["branch"] for t in trajs] == [0, 1, 2]
    by_request = {g.request_id: g for g in made}
    assert sorted(by_request) == ["g/0", "g/0.1", "g/0.2"]  # one request each: none shares an id in flight
    for t in trajs:
        gen = by_request[t.trajectory_id]
        assert list(t.token_ids) == gen.prompt + gen.output_ids
        assert [x for x, m in zip(t.token_ids, t.loss_mask) if m] == gen.output_ids
        assert list(t.behavior_logprobs) == gen.behavior_logprobs
        assert t.reward == float(len(tok.decode(gen.output_ids, skip_special_tokens=True)) % 2)
    assert Conversation(tok, "Say seven. (sub-agent 2)").prompt_ids() == by_request["g/0.2"].prompt


def test_a_deadline_a_workflow_lets_through_ends_the_episode_with_what_it_generated(engine, tiny_model):
    traj, made, _, _ = _run(engine, tiny_model, "steps_too_long", step_timeout_s=0.5)
    assert traj.finish_reason == FinishReason.TIMEOUT and traj.metadata["timeout"] == "step"
    assert [t for t, m in zip(traj.token_ids, traj.loss_mask) if m] == made[0].output_ids


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("no_such_module_here:fn", "cannot import"),
        (f"{FNS}:missing", "cannot import"),
        (f"{FNS}:not_async", "not an async function"),
        (f"{FNS}:two_args", "does not take one argument"),
        ("just_a_name", "expected 'module:function'"),
    ],
)
def test_a_workflow_path_that_cannot_run_is_refused_at_load_naming_the_key(path, says):
    with pytest.raises(ValidationError) as e:
        EpisodeConfig(workflow={"type": "custom", "path": path})
    assert "workflow.custom.path" in str(e.value) and says in str(e.value)


def test_the_default_workflow_is_the_environments_episode():
    assert EpisodeConfig().workflow.type == "env"
    with pytest.raises(ValidationError, match="workflow"):
        EpisodeConfig(workflow={"type": "nope"})
