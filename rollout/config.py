"""Configuration of the rollout loop: what one pool of workers rolls out, and how."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rollout.envs.base import Env
from rollout.envs.config import EnvConfig, SingleTurnEnvConfig
from rollout.envs.single_turn import load_jsonl
from rollout.episode import EpisodeConfig
from rollout.reward_pool import RewardPool
from rollout.rewards import build_reward, resolve_reward
from rollout.verifiers.code import CodeRewardConfig
from rollout.verifiers.judge import JudgeRewardConfig
from rollout.verifiers.service import ServiceRewardConfig

# A reward in config: a function's name, or a typed variant chosen by its 'type'.
RewardVariant = Annotated[CodeRewardConfig | JudgeRewardConfig | ServiceRewardConfig, Field(discriminator="type")]
RewardSpec = str | RewardVariant


class RewardWorkersConfig(BaseModel):
    """Where the reward function runs (``rollout/reward_pool.py``)."""

    model_config = ConfigDict(extra="forbid")

    workers: int = Field(
        0,
        ge=0,
        description="Worker processes scoring answers, and so how many are scored at once (0: in the "
        "environment's own process, as a plain call). Use them for a CPU-heavy verifier (math-verify, a "
        "parser): in-process it holds the GIL and stalls the EnvManager's event loop.",
    )
    timeout_s: float = Field(
        30.0, gt=0, description="A score taking longer is cut: its worker is killed and replaced, the answer scores 0."
    )


class TaskConfig(BaseModel):
    """What an episode is: the environment, its dataset and its reward (an EnvManager's pool and an
    environment provider both read these)."""

    model_config = ConfigDict(extra="forbid")

    dataset_path: str = Field("examples/find_digit_train.jsonl", description="JSONL rows with 'prompt' and 'answer'.")
    env: EnvConfig = Field(
        default_factory=SingleTurnEnvConfig,
        description="The environment, a typed variant chosen by 'type' (single_turn | sim | calculator | gem | "
        "custom | remote) with its own arguments.",
    )
    reward: RewardSpec = Field(
        "exact_match",
        description="Reward function: a name in rollout.rewards (exact_match, digit_answer, math_verify, ...) or "
        "'module:function'; or a typed variant: {type: code, sandbox: {...}, timeout: {...}} runs the answer "
        "against the task's tests in a sandbox (rollout/verifiers/code.py); {type: judge, ...} asks a judge model "
        "through an LLMProxy (rollout/verifiers/judge.py); {type: service} sends each answer to a reward service "
        "(`rollmesh serve reward`, rollout/verifiers/service.py) that scores with any of these.",
    )
    reward_workers: RewardWorkersConfig = Field(
        default_factory=lambda: RewardWorkersConfig(),
        description="Score in worker processes (a verifier that hangs or crashes costs one score, 0, counted).",
    )

    @field_validator("reward")
    @classmethod
    def _reward_exists(cls, reward: RewardSpec) -> RewardSpec:
        if isinstance(reward, str):
            resolve_reward(reward)  # a misspelled reward fails when the config is loaded
        return reward

    @model_validator(mode="after")
    def _workers_for_functions(self) -> TaskConfig:
        if self.reward_workers.workers and not isinstance(self.reward, str):
            raise ValueError(
                f"reward_workers.workers: the {self.reward.type} reward scores each answer outside this process "
                "already (workers would split a code reward's timeout anchors); set it to 0"
            )
        return self

    def env_factory(self, **ports) -> tuple[list[dict], Callable, Callable[[], Env]]:
        """The dataset's rows, the reward function and a builder of one environment; building one
        now, so a custom environment's constructor fails at start-up rather than mid-run. ``ports``:
        what a reward variant needs from the mesh (``judge``: a builder of the LLM judge;
        ``reward_service``: of a reward service's client)."""
        rows, reward_fn = load_jsonl(self.dataset_path), build_reward(self.reward, **ports)
        self.env.build(rows, reward_fn)
        if self.reward_workers.workers:
            reward_fn = RewardPool(self.reward, self.reward_workers.workers, self.reward_workers.timeout_s)
        return rows, reward_fn, lambda: self.env.build(rows, reward_fn)


class TailBatchingConfig(BaseModel):
    """RollPacker's tail batching (``rollout/scheduling.py: TailScheduling``)."""

    model_config = ConfigDict(extra="forbid")

    redundant_prompts: int = Field(
        4,
        ge=0,
        description="Prompts (groups of group_size episodes) a short round launches beyond the step's "
        "groups (controller.groups_per_step). The round ends when the step's groups are in; the prompts "
        "still generating (as many as this, at most) wait for a long round, which runs once a step's worth "
        "has gathered. More: shorter short rounds, more long rounds.",
    )


class RolloutConfig(TaskConfig):
    """A pool of workers running episodes of one task through the LLMProxy."""

    tokenizer_path: str | None = Field(
        None, description="Tokenizer (HF directory) that renders prompts; default: the run's model_path."
    )
    group_size: int = Field(8, ge=1, description="Trajectories per prompt (GRPO group); n independent requests.")
    num_workers: int = Field(8, ge=1, description="Groups (prompts) in flight at once in this pool.")
    scheduling: Literal["queue", "batch", "tail"] = Field(
        "queue",
        description="queue: each group is scored and put the moment it ends, and its worker takes the next "
        "prompt. batch (the synchronous baseline): admit a step's groups, generate all, then score all, "
        "then put all. tail (RollPacker's tail batching, for async_ratio 0): short rounds launch more prompts "
        "than a step needs and stop once the step's groups are in; the unfinished prompts run together in a "
        "long round later (tail_batching).",
    )
    tail_batching: TailBatchingConfig = Field(
        default_factory=lambda: TailBatchingConfig(), description="Tail batching's knobs (scheduling: tail)."
    )
    replicate_prompts: bool = Field(
        True,
        description="Send a prompt's n samples as n independently routed requests; false keeps them on one "
        "engine, like a single request with n samples.",
    )
    seed: int = Field(0, description="Prompts are visited in a shuffled order drawn from this seed.")
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig, description="Per-episode limits and sampling.")
    admit_poll_s: float = Field(0.05, gt=0, description="Wait before asking again when admission is refused.")
    faulty_members: Literal["drop", "keep_timeouts"] = Field(
        "drop",
        description="What becomes of a member that did not end normally. drop: members that timed out (a "
        "generation, reset or step deadline), whose environment failed (env_error) or whose episode raised "
        "are left out and the group trains on the rest (ROLL's choice: a cut trajectory's reward says "
        "nothing about its answer). keep_timeouts: a timed-out member that generated tokens is trained "
        "with the reward it has so far (usually 0: a penalty for being slow, as in peers that keep "
        "truncated responses); env errors and raised episodes are always left out. Counted by cause.",
    )
    redundant_members: int = Field(
        0,
        ge=0,
        description="Redundant rollout (ROLL Flash): run group_size + this many episodes per group and keep the "
        "first group_size to end usable; the rest are cancelled (counted as members_dropped_redundant). Fail-slow "
        "and fail-stop environments then cannot hold a group, at the price of a bias toward episodes that end "
        "sooner (rollmesh_env_member_generated_tokens shows kept against cancelled).",
    )
    min_group_members: int = Field(
        2,
        ge=1,
        description="A group left with fewer members than this (at most group_size) is not put: it fails and "
        "its slot goes back. GRPO's baseline needs two.",
    )

    @model_validator(mode="after")
    def _reward_fits_its_step(self) -> RolloutConfig:
        step_s = self.episode.step_timeout_s
        if not isinstance(self.reward, str) and self.reward.max_seconds() >= step_s:
            raise ValueError(
                f"reward: a {self.reward.type} score can take {self.reward.max_seconds():g} s, not less "
                f"than episode.step_timeout_s ({step_s:g} s): the step would be cut before its score "
                "(lower the reward's timeout or raise the step's)"
            )
        return self

    @model_validator(mode="after")
    def _turns_for_every_try(self) -> RolloutConfig:
        tries = getattr(self.env, "tries", 1)
        if tries > self.episode.max_turns:
            raise ValueError(
                f"env.tries: {tries} answers need episode.max_turns >= {tries}, got {self.episode.max_turns}"
            )
        return self
