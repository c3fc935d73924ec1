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
from rollout.episode import EpisodeConfig, run_episode
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


def _run(engine, tiny_model, workflow: str, **config):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    made: list[Generation] = []

    async def generate(input_ids, sampling, trajectory_id, timeout_s):
        out = await asyncio.wrap_future(engine.submit(f"{trajectory_id}-{len(made)}", input_ids, sampling))
        gen = Generation(
            out.output_ids, out.behavior_logprobs, out.token_versions, FinishReason.of_engine(out.finish_reason["type"])
        )
        made.append(gen)
        return gen

    cfg = EpisodeConfig(
        workflow={"type": "custom", "path": f"{FNS}:{workflow}"},
        sampling={"max_new_tokens": 12, "ignore_eos": True},
        **config,
    )
    env = Scored()
    traj = asyncio.run(run_episode(env, 0, generate, tok, cfg, trajectory_id="g/0", group_id="g", prompt_id="p"))
    return traj, made, env, tok


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
        ("forges_tokens", "token_ids: not the tokens a thread of this episode recorded"),
        ("nan_reward", "reward: nan is not a finite number"),
    ],
)
def test_a_workflow_that_breaks_a_rule_ends_its_episode_as_a_workflow_error(engine, tiny_model, caplog, workflow, why):
    """Nothing of it is trained (env_error), the traceback is in the log, and the next episode runs."""
    with caplog.at_level(logging.WARNING, logger="rollout.episode"):
        traj, made, _, _ = _run(engine, tiny_model, workflow)
    assert traj.finish_reason == FinishReason.ENV_ERROR and len(made) == 1
    assert traj.metadata["error_kind"] == "workflow" and why in traj.metadata["error"], traj.metadata
    assert list(traj.token_ids) == [] and not any(traj.loss_mask)
    assert f"workflow {FNS}:{workflow} failed" in caplog.text and "Traceback" in caplog.text
    again, _, _, _ = _run(engine, tiny_model, "retry_with_critique")
    assert again.finish_reason == FinishReason.STOP


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
