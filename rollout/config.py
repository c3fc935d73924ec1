"""Configuration of the rollout loop: what one pool of workers rolls out, and how."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rollout.envs.base import Env
from rollout.envs.config import EnvConfig, SingleTurnEnvConfig
from rollout.envs.generated import GeneratedDataset
from rollout.envs.single_turn import images_of_rows, load_jsonl
from rollout.episode import EpisodeConfig
from rollout.reward_pool import RewardPool
from rollout.rewards import build_reward, resolve_reward
from rollout.verifiers.code import CodeRewardConfig
from rollout.verifiers.judge import JudgeRewardConfig
from rollout.verifiers.service import ServiceRewardConfig
from sample_buffer.trajectory import DOMAIN_NAME

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
    generate: GeneratedDataset | None = Field(
        None,
        description="Instead of dataset_path: rows made at start-up as `rollmesh make-dataset` makes them "
        "({task: chain_sum, size: 1000, seed: 0, params: {max_terms: 2}}; code_tasks, word_count, humaneval).",
    )
    env: EnvConfig = Field(
        default_factory=SingleTurnEnvConfig,
        description="The environment, a typed variant chosen by 'type' (single_turn | sim | calculator | gem | "
        "custom | remote | verifiers) with its own arguments.",
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
    teacher: str | None = Field(
        None,
        description="On-policy distillation: the teacher (a name in the mesh's teachers, mesh.teachers) that scores "
        "every token of this task's groups the moment the group ends (rollout/teachers.py); the trainer mixes its "
        "log-probs into the advantage (trainer.distill). None: rewards alone.",
    )

    @field_validator("reward")
    @classmethod
    def _reward_exists(cls, reward: RewardSpec) -> RewardSpec:
        if isinstance(reward, str):
            resolve_reward(reward)  # a misspelled reward fails when the config is loaded
        return reward

    @model_validator(mode="after")
    def _one_dataset(self) -> TaskConfig:
        if self.generate is not None and "dataset_path" in self.model_fields_set and self.dataset_path:
            raise ValueError("generate: rows are made or read, not both (leave dataset_path out)")
        return self

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
        rows = self.generate.rows() if self.generate else load_jsonl(self.dataset_path)
        if isinstance(self.env, SingleTurnEnvConfig):  # a row's broken picture stops the start, naming the row
            images_of_rows(rows)
        reward_fn = build_reward(self.reward, **ports)
        self.env.build(rows, reward_fn)
        if self.reward_workers.workers:
            reward_fn = RewardPool(self.reward, self.reward_workers.workers, self.reward_workers.timeout_s)
        return rows, reward_fn, lambda: self.env.build(rows, reward_fn)


TASK_KEYS = ("dataset_path", "generate", "env", "reward", "reward_workers", "teacher")  # what a domain says for itself


class DomainConfig(TaskConfig):
    """One task domain of a multi-domain run (ROLL's multi-domain RLVR): its own dataset, environment and
    reward, its share of the trained groups, its own sampling and held-out set."""

    name: str = Field(
        ...,
        min_length=1,
        pattern=f"^{DOMAIN_NAME.pattern}$",
        description="The domain's name in metrics, labels and logs (letters, digits, '_', '.', '-'; at most 64).",
    )
    weight: float = Field(
        1.0,
        ge=0,
        description="Its share of every training batch, against the other domains' weights (normalised to sum "
        "1); 0: held-out evaluation only, never trained.",
    )
    dataset_path: str | None = Field(  # type: ignore[assignment]  # required here, by the validator below
        None, description="JSONL rows with 'prompt' and 'answer' (a remote environment's domain has none)."
    )
    group_size: int | None = Field(None, ge=1, description="Trajectories per prompt here (default: the pool's).")
    episode: dict[str, Any] = Field(
        default_factory=dict,
        description="This domain's changes to the pool's episode section, merged key by key (e.g. {sampling: "
        "{max_new_tokens: 512, temperature: 0.7}, max_turns: 3, step_timeout_s: 60}).",
    )
    heldout_path: str | None = Field(
        None,
        description="JSONL scored greedily with this domain's reward before and after training (its own table).",
    )

    @model_validator(mode="after")
    def _heldout_of_prompts(self) -> DomainConfig:
        if self.heldout_path and self.env.type == "remote":
            raise ValueError(
                f"domain {self.name!r}: heldout_path is a JSONL of prompts; a remote environment's held-out "
                "episodes are not scored per domain yet"
            )
        return self

    @model_validator(mode="after")
    def _has_data(self) -> DomainConfig:
        if self.dataset_path is None and self.generate is None and self.env.type != "remote":
            raise ValueError(
                f"domain {self.name!r}: dataset_path is missing (a JSONL of 'prompt' and 'answer' rows; or generate)"
            )
        return self


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
    replicate_prompts: bool | None = Field(
        None,
        description="true: a prompt's n samples go as n independently routed requests (spread over the "
        "engines); false: as one request of n samples on one engine, the prompt's prefill shared (a group's "
        "members whose first turn asks the same). None: true where the run has several engines or its engine "
        "samples no n at once (vLLM), false otherwise (a pool outside a run: false).",
    )
    seed: int = Field(0, description="Prompts are visited in a shuffled order drawn from this seed.")
    return_routed_experts: bool = Field(
        False,
        description="Record each token's MoE experts in the trajectories (routing replay). Set from "
        "trainer.moe.routing: replay in a run config; write it only for a pool outside one.",
    )
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig, description="Per-episode limits and sampling.")
    admit_poll_s: float = Field(
        0.05,
        gt=0,
        description="Wait before asking again when admission is refused (one worker asks again; the others wait "
        "for its answer, each at most 1 s).",
    )
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
    teacher_timeout_s: float = Field(
        60.0,
        gt=0,
        description="On-policy distillation: how long a group's teacher call (every member scored at once) may "
        "take; a group whose teacher fails or is late is not put (counted: groups_teacher_error).",
    )
    teacher_top_k: int = Field(
        0,
        ge=0,
        le=64,
        description="On-policy distillation: also ask the teacher for its this many most likely tokens at every "
        "generated position, for the top-k forward KL (trainer.distill.top_k_coef); 0: the sampled tokens' "
        "log-probs alone.",
    )

    domains: list[DomainConfig] = Field(
        default_factory=list,
        description="Several task domains in one run (math, code, judged chat, ...), each with its dataset, "
        "environment, reward, sampling and weight; then dataset_path, env, reward and reward_workers are "
        "written in each domain, not here. Empty: one task, the keys above (docs/domains.md).",
    )
    domain_oversampling: float = Field(
        4.0,
        ge=1,
        description="A domain whose groups are often not put (filtered as all-equal, failed, stale) is drawn more "
        "often, by its measured put rate, so its share of the buffer follows its weight (DAPO's dynamic "
        "sampling, per domain); at most this many times its weight. 1: prompts drawn by weight alone.",
    )

    def task_domains(self) -> list[DomainConfig]:
        """The domains this pool rolls out: those configured, or the one task of the keys above (named '')."""
        if self.domains:
            return self.domains
        implicit = DomainConfig.model_construct(
            name="",
            weight=1.0,
            group_size=None,
            episode={},
            heldout_path=None,
            **{k: getattr(self, k) for k in TASK_KEYS},
        )  # built from validated parts: a '' name is the implicit domain's alone
        return [implicit]

    def episode_of(self, domain: DomainConfig) -> EpisodeConfig:
        """The pool's episode section with the domain's changes merged in."""
        if not domain.episode:
            return self.episode
        return EpisodeConfig.model_validate(_merged(self.episode.model_dump(), domain.episode))

    def group_size_of(self, domain: DomainConfig) -> int:
        return domain.group_size or self.group_size

    @model_validator(mode="after")
    def _domains_fit_together(self) -> RolloutConfig:
        if not self.domains:
            return self
        if written := [k for k in TASK_KEYS if k in self.model_fields_set]:
            raise ValueError(f"{', '.join(written)}: with domains, each domain says its own (domains[i].{written[0]})")
        names = [d.name for d in self.domains]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"domains: the name {dup[0]!r} is used twice")
        if sum(d.weight for d in self.domains) <= 0:
            raise ValueError("domains[*].weight: at least one domain must have a positive weight")
        for i, d in enumerate(self.domains):
            try:
                self.episode_of(d)
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(x) for x in err["loc"])
                raise ValueError(f"domains[{i}] ({d.name}).episode.{where}: {err['msg']}") from None
        return self

    @model_validator(mode="after")
    def _reward_fits_its_step(self) -> RolloutConfig:
        for d in self.task_domains():
            step_s, where = self.episode_of(d).step_timeout_s, f"domain {d.name!r}: " if d.name else ""
            if not isinstance(d.reward, str) and d.reward.max_seconds() >= step_s:
                raise ValueError(
                    f"{where}reward: a {d.reward.type} score can take {d.reward.max_seconds():g} s, not less "
                    f"than episode.step_timeout_s ({step_s:g} s): the step would be cut before its score "
                    "(lower the reward's timeout or raise the step's)"
                )
        return self

    @model_validator(mode="after")
    def _turns_for_every_try(self) -> RolloutConfig:
        for d in self.task_domains():
            tries, turns = getattr(d.env, "tries", 1), self.episode_of(d).max_turns
            if tries > turns:
                where = f"domain {d.name!r}: " if d.name else ""
                raise ValueError(f"{where}env.tries: {tries} answers need episode.max_turns >= {tries}, got {turns}")
        return self


def _merged(base: dict, changes: dict) -> dict:
    """``base`` with ``changes`` applied, nested sections key by key."""
    out = dict(base)
    for k, v in changes.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out
