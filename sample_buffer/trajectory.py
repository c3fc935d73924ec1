"""Trajectories and groups: what rollout hands to training, validated on construction.

Arrays are numpy so that encoding is a memory copy, not a per-token Python loop. Per-token
fields come in two lengths: ``token_ids``/``loss_mask``/``token_rewards`` cover the whole
sequence; ``behavior_logprobs``/``token_versions``/``teacher_logprobs`` cover only the generated
tokens (where ``loss_mask`` is 1), in order.
"""

from __future__ import annotations

import re
from dataclasses import InitVar, dataclass, field
from enum import StrEnum

import numpy as np

from sample_buffer import routing as routing_ids
from sample_buffer.grammars import GRAMMAR_FIELDS, MAX_GRAMMAR_CHARS
from sample_buffer.vision import MAX_IMAGE_BYTES, content_hash

_HASH = re.compile(r"[0-9a-f]{64}")


class FinishReason(StrEnum):
    """Why a generation or an episode ended: one spelling from the engine's response to the
    trainer's batch (``services/convert.py`` maps it to and from the proto enum)."""

    STOP = "stop"  # EOS or a stop token; for an episode: the environment said done
    LENGTH = "length"  # max_new_tokens or the model's context
    ABORT = "abort"  # aborted by a caller (a stale group, a weight update in abort mode)
    TIMEOUT = "timeout"  # missed a generation or environment-step deadline
    ERROR = "error"  # the engine failed
    ENV_ERROR = "env_error"  # the environment failed

    @classmethod
    def of_engine(cls, value: str | None) -> FinishReason:
        """An engine's finish reason as ours; one we do not know (a newer engine's) is an ERROR."""
        return cls(value) if value in cls._value2member_map_ else cls.ERROR


FINISH_REASONS = frozenset(FinishReason)


class PutRefusal(StrEnum):
    """Why the buffer did not store a group (``PutResult.reason``; the same strings on the wire)."""

    FILTERED = "filtered"  # a filter found no learning signal in it (zero variance)
    FULL = "full"  # the buffer stayed at capacity for the whole put timeout


# A domain's name: it becomes a Redis key and a Prometheus label, so a short plain word ("": none).
DOMAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{0,64}")


class TrajectoryError(ValueError):
    """A trajectory or group that breaks the data model; the message names the field."""


def _array(name: str, value, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype=dtype)
    if arr.ndim != 1:
        raise TrajectoryError(f"{name}: expected a 1-D sequence, got shape {arr.shape}")
    return arr


MAX_TEACHER_TOP_K = 64  # a teacher's most likely tokens a position (the engines' MAX_TOP_LOGPROBS)


def _table(name: str, value, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype=dtype)
    if arr.ndim != 2:
        raise TrajectoryError(f"{name}: expected a [tokens, k] table, got shape {arr.shape}")
    return arr


def _check_logprobs(name: str, values: np.ndarray, g: int) -> None:
    """One log-prob per generated token, each finite and <= 0."""
    if len(values) != g:
        raise TrajectoryError(f"{name}: length {len(values)} != generated tokens {g}")
    # max() is NaN if any is NaN, so one reduction checks both "finite" and "<= 0" (-inf fails below).
    if g and not (values.max() <= 0 and np.isfinite(values.min())):
        raise TrajectoryError(f"{name}: log-probs must be finite and <= 0")


@dataclass
class Trajectory:
    trajectory_id: str
    group_id: str
    prompt_id: str
    token_ids: np.ndarray  # [T] int32, prompt + generated + environment tokens
    loss_mask: np.ndarray  # [T] int8, 1 on tokens the policy generated
    behavior_logprobs: np.ndarray  # [G] float32, G = loss_mask.sum(): the engine's log-probs
    token_versions: np.ndarray  # [G] int32, policy version that generated each token
    reward: float
    start_version: int  # version at the first generated token
    finish_reason: FinishReason = FinishReason.STOP
    token_rewards: np.ndarray | None = None  # [T] float32, optional
    metadata: dict = field(default_factory=dict)  # env name, turn boundaries
    # [P, layers × top_k] uint8/uint16: the engine's experts for each forwarded position (MoE routing
    # replay; ``sample_buffer/routing.py``). None: not recorded (a dense model, or replay off).
    routed_experts: np.ndarray | None = None
    # A vision-language prompt's images: each one's content hash (``sample_buffer/vision.py``), in the
    # order their expanded placeholders stand in ``token_ids``; the bytes are the group's (``Group.images``).
    images: tuple[str, ...] = ()
    # [G] float32: a teacher's log-prob of each generated token (on-policy distillation,
    # ``trainer/distillation.py``); None: no teacher scored it.
    teacher_logprobs: np.ndarray | None = None
    # [G, k] int32 and float32: the teacher's k most likely tokens at each generated token's position and
    # their log-probs, most likely first (the top-k forward KL, ``trainer/distillation.py``); None: not asked.
    teacher_top_ids: np.ndarray | None = None
    teacher_top_logprobs: np.ndarray | None = None
    # False skips the checks of ``validate`` for bytes already checked where they entered the buffer.
    check: InitVar[bool] = True

    def __post_init__(self, check: bool = True) -> None:
        self.token_ids = _array("token_ids", self.token_ids, np.int32)
        self.loss_mask = _array("loss_mask", self.loss_mask, np.int8)
        self.behavior_logprobs = _array("behavior_logprobs", self.behavior_logprobs, np.float32)
        self.token_versions = _array("token_versions", self.token_versions, np.int32)
        if self.token_rewards is not None:
            self.token_rewards = _array("token_rewards", self.token_rewards, np.float32)
        if self.teacher_logprobs is not None:
            self.teacher_logprobs = _array("teacher_logprobs", self.teacher_logprobs, np.float32)
        if self.teacher_top_ids is not None:
            self.teacher_top_ids = _table("teacher_top_ids", self.teacher_top_ids, np.int32)
        if self.teacher_top_logprobs is not None:
            self.teacher_top_logprobs = _table("teacher_top_logprobs", self.teacher_top_logprobs, np.float32)
        self.reward, self.start_version = float(self.reward), int(self.start_version)
        if self.finish_reason not in FINISH_REASONS:
            raise TrajectoryError(f"finish_reason: {self.finish_reason!r} is not one of {sorted(FINISH_REASONS)}")
        self.finish_reason = FinishReason(self.finish_reason)
        if check:
            self.validate()

    def _check_teacher_top(self, g: int) -> None:
        ids, lps = self.teacher_top_ids, self.teacher_top_logprobs
        if ids is None and lps is None:
            return
        if ids is None or lps is None or self.teacher_logprobs is None:
            raise TrajectoryError("teacher_top_ids and teacher_top_logprobs: both or neither, with teacher_logprobs")
        if ids.shape != lps.shape or len(ids) != g or not 1 <= ids.shape[1] <= MAX_TEACHER_TOP_K:
            raise TrajectoryError(
                f"teacher_top_ids {ids.shape} and teacher_top_logprobs {lps.shape}: one row of k in "
                f"[1, {MAX_TEACHER_TOP_K}] a generated token ({g})"
            )
        if ids.size and ids.min() < 0:
            raise TrajectoryError("teacher_top_ids: token ids must be >= 0")
        if lps.size and not (lps.max() <= 0 and np.isfinite(lps.min())):
            raise TrajectoryError("teacher_top_logprobs: log-probs must be finite and <= 0")

    @property
    def num_generated(self) -> int:
        return int(self.loss_mask.sum())

    def validate(self) -> None:
        t = len(self.token_ids)
        if not self.trajectory_id or not self.group_id:
            raise TrajectoryError("trajectory_id and group_id must be non-empty")
        if len(self.loss_mask) != t:
            raise TrajectoryError(f"loss_mask: length {len(self.loss_mask)} != token_ids length {t}")
        if t and (self.loss_mask.min() < 0 or self.loss_mask.max() > 1):  # min/max: ~10x cheaper than isin
            raise TrajectoryError("loss_mask: values must be 0 or 1")
        g = self.num_generated
        _check_logprobs("behavior_logprobs", self.behavior_logprobs, g)
        if len(self.token_versions) != g:
            raise TrajectoryError(f"token_versions: length {len(self.token_versions)} != generated tokens {g}")
        if g and int(self.token_versions[0]) != self.start_version:
            raise TrajectoryError(
                f"start_version: {self.start_version} != version of the first generated token "
                f"{int(self.token_versions[0])}"
            )
        if self.teacher_logprobs is not None:
            _check_logprobs("teacher_logprobs", self.teacher_logprobs, g)
        self._check_teacher_top(g)
        if self.token_rewards is not None and len(self.token_rewards) != t:
            raise TrajectoryError(f"token_rewards: length {len(self.token_rewards)} != token_ids length {t}")
        if not np.isfinite(self.reward):
            raise TrajectoryError(f"reward: must be finite, got {self.reward}")
        if not isinstance(self.metadata, dict):
            raise TrajectoryError(f"metadata: a map expected, got {type(self.metadata).__name__}")
        if "turn_temperatures" in self.metadata:
            self._check_turns(t)
        if "turn_grammars" in self.metadata:
            self._check_grammars()
        if self.routed_experts is not None:
            try:
                routing_ids.check(self.routed_experts, t)
            except routing_ids.RoutingError as e:
                raise TrajectoryError(str(e)) from None
        if not isinstance(self.images, tuple) or not all(
            isinstance(h, str) and _HASH.fullmatch(h) for h in self.images
        ):
            raise TrajectoryError("images: a tuple of sha256 content hashes (64 hex digits) expected")

    def _check_turns(self, t: int) -> None:
        """The trainer reads each turn's tokens' temperature from these two (``trainer/batch.py``)."""
        starts, temps = self.metadata.get("turn_starts"), self.metadata["turn_temperatures"]
        ints = isinstance(starts, list) and all(
            isinstance(s, int | np.integer) and not isinstance(s, bool) for s in starts
        )
        if not ints or not all(0 <= a <= b <= t for a, b in zip(starts, [*starts[1:], t], strict=True)):
            raise TrajectoryError(
                f"metadata.turn_starts: token positions in [0, {t}], in order, must go with turn_temperatures"
            )
        if not isinstance(temps, list) or len(temps) != len(starts):
            raise TrajectoryError(f"metadata.turn_temperatures: one per turn_starts ({len(starts)}) expected")
        if not all(type(x) in (int, float) and 0 <= x < float("inf") for x in temps):
            raise TrajectoryError("metadata.turn_temperatures: finite numbers >= 0 expected")

    def _check_grammars(self) -> None:
        """A turn's grammar, null where it was free: the trainer masks π as the engine masked μ
        (``trainer/grammar_masks.py``)."""
        grammars, starts = self.metadata["turn_grammars"], self.metadata.get("turn_starts")
        if not isinstance(grammars, list) or not isinstance(starts, list) or len(grammars) != len(starts):
            raise TrajectoryError("metadata.turn_grammars: one per turn_starts expected")
        for g in grammars:
            ok = g is None or (
                isinstance(g, list | tuple)
                and len(g) == 2
                and g[0] in GRAMMAR_FIELDS
                and isinstance(g[1], str)
                and len(g[1]) <= MAX_GRAMMAR_CHARS
            )
            if not ok:
                raise TrajectoryError(
                    f"metadata.turn_grammars: null or [field, text] (field one of {', '.join(GRAMMAR_FIELDS)}, "
                    f"text at most {MAX_GRAMMAR_CHARS} characters) expected"
                )


@dataclass
class Group:
    """The trajectories of one prompt, handed to training together (GRPO needs whole groups)."""

    group_id: str
    prompt_id: str
    trajectories: list[Trajectory]
    domain: str = ""  # the task domain it was sampled from ("": a run of one task)
    # Every image its trajectories reference, once (replicas of a prompt share its images): hash -> bytes
    images: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not DOMAIN_NAME.fullmatch(self.domain):
            raise TrajectoryError(f"domain: {self.domain!r} is not a domain name ({DOMAIN_NAME.pattern})")
        if not self.trajectories:
            raise TrajectoryError(f"group {self.group_id!r}: has no trajectories")
        for t in self.trajectories:
            if t.group_id != self.group_id:
                raise TrajectoryError(f"group {self.group_id!r}: holds trajectory of group {t.group_id!r}")
        if self.images or any(t.images for t in self.trajectories):
            self._check_images()
        if len({t.teacher_logprobs is None for t in self.trajectories}) > 1:  # one teacher scores a group
            raise TrajectoryError(f"group {self.group_id!r}: teacher_logprobs on every trajectory or on none")
        if len({None if t.teacher_top_ids is None else t.teacher_top_ids.shape[1] for t in self.trajectories}) > 1:
            raise TrajectoryError(f"group {self.group_id!r}: teacher_top_ids of one k on every trajectory or on none")

    @property
    def taught(self) -> bool:
        """Whether a teacher scored its tokens (on-policy distillation): a signal even where the
        rewards are all equal."""
        return self.trajectories[0].teacher_logprobs is not None

    def _check_images(self) -> None:
        if not isinstance(self.images, dict) or not all(isinstance(h, str) for h in self.images):
            raise TrajectoryError("images: a map of content hash (a string) to encoded bytes expected")
        wanted = {h for t in self.trajectories for h in t.images}
        if missing := wanted - set(self.images):
            raise TrajectoryError(f"images: {len(missing)} referenced image(s) missing, e.g. {min(missing)[:12]}")
        if unused := set(self.images) - wanted:
            raise TrajectoryError(f"images: {len(unused)} image(s) no trajectory references, e.g. {min(unused)[:12]}")
        for h, data in self.images.items():
            if not isinstance(data, bytes) or len(data) > MAX_IMAGE_BYTES:
                raise TrajectoryError(f"images[{h[:12]}]: encoded image bytes of at most {MAX_IMAGE_BYTES} expected")
            if content_hash(data) != h:
                raise TrajectoryError(f"images[{h[:12]}]: the bytes do not hash to their key")

    @property
    def start_version(self) -> int:
        """The oldest member's version: a group is as stale as its stalest sample."""
        return min(t.start_version for t in self.trajectories)

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]
