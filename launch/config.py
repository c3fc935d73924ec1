"""The run config: one typed section per component, loaded from YAML with dotted overrides.

``load_config("run.yaml", ["engine.port=30001", "proxy.engine_urls=[http://a:1]"])`` reads the
file, applies each override (values parsed as YAML scalars/lists), and validates. Unknown keys
are errors that name the key, so a renamed option fails loudly instead of being ignored.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from launch.device_map import DeviceMapConfig, check_shape, gpus_per_engine
from launch.teachers import TeacherConfig
from rollout.engines.embedded.config import EngineConfig
from rollout.proxy.config import ProxyConfig
from sample_buffer.config import BufferConfig
from services.auth import AuthConfig
from services.controller.config import ControllerConfig
from services.engine.backends import ENGINE_APIS, EngineVariant, backend
from services.env_manager.config import EnvManagerConfig
from services.env_provider.config import EnvProviderConfig
from services.gateway.config import GatewayConfig
from services.mesh_config import MeshConfig
from services.reward.config import RewardServiceConfig
from services.tinker.config import TinkerConfig
from services.trainer.config import TrainerProcessConfig
from trainer.config import TrainerConfig
from trainer.variants import TrainerVariant


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


class RunConfig(BaseModel):
    """What `rollmesh run` starts on this machine."""

    model_config = ConfigDict(extra="forbid")

    num_engines: int = Field(
        1,
        ge=0,
        description="Engine processes behind the LLMProxy. 0: start neither engines nor a proxy, and use the "
        "LLMProxy at mesh.proxy, whose proxy.runs knows this run by its tokens (docs/shared-pool.md).",
    )
    rollout: Literal["env_manager", "gateway"] = Field(
        "env_manager",
        description="Who makes the rollouts: the EnvManager running episodes, or external agents through the "
        "agent gateway (on gateway.port; its keys: gateway.api_keys_path, else one issued to RUN_DIR/agent.key).",
    )
    heldout_path: str | None = Field(None, description="JSONL evaluated greedily at the end (accuracy).")
    heldout_episodes: int = Field(
        0,
        ge=0,
        description="A remote environment's held-out set: this many greedy episodes on the seeds after "
        "env_manager.env.num_seeds (never trained on), before and after training; success is reward >= 1.",
    )
    eval_every: int = Field(
        0,
        ge=0,
        description="Also score the held-out set(s) every this many steps, while training goes on (0: before and "
        "after only); each score is printed and appended to RUN_DIR/heldout.jsonl.",
    )
    heldout_timeout_s: float = Field(
        600.0, gt=0, description="How long one held-out answer may take; one that does not come counts as wrong."
    )
    startup_timeout_s: float = Field(180.0, gt=0, description="How long each service may take to become healthy.")
    trainer_procs: int = Field(
        1, ge=1, description="Trainer ranks: more than 1 runs the trainer under torchrun (FSDP2; gloo on CPU)."
    )
    max_restarts: int = Field(
        5, ge=0, description="Times a service (or the trainer) that exits is started again before the run gives up."
    )


class SlurmConfig(BaseModel):
    """`rollmesh launch slurm`: the batch job the mesh runs in (launch/slurm.py)."""

    model_config = ConfigDict(extra="forbid")

    job_name: str = Field("rollmesh", description="The job's name (squeue, sacct).")
    partition: str | None = Field(None, description="The partition to submit to; none: the cluster's default.")
    time_limit: str | None = Field(
        None, description="The job's time limit in Slurm's format (1-00:00:00); none: the partition's."
    )
    engine_nodes: int = Field(
        0,
        ge=0,
        description="Nodes of their own for the engines (run.num_engines spread over them, each taking its "
        "node's GPUs in turn); 0: one node runs everything.",
    )
    gpus_per_node: int = Field(0, ge=0, description="GPUs the job asks of each node (--gres=gpu:N); 0: none.")
    sbatch_args: list[str] = Field(
        default_factory=list, description="More sbatch options, each as one argument (--account=X, --qos=Y)."
    )
    submit_timeout_s: float = Field(60.0, gt=0, description="How long sbatch may take to answer.")

    @field_validator("time_limit", mode="before")
    @classmethod
    def _quoted(cls, value):
        if isinstance(value, int):  # YAML 1.1 reads 2:00:00 as 7200 and 120 as a number
            raise ValueError(f"write it as a quoted string in Slurm's format ('2:00:00', '1-00:00:00'), got {value}")
        return value


CONTROLLER_STATE = "controller.json"  # in the run directory: the controller's version across restarts


class RollmeshConfig(BaseModel):
    """Everything one rollmesh run needs; each section configures one component.

    A value several components share is written once at the top (``model_path``) or in ``mesh``
    (addresses) and propagated; a section may still override the model path where it differs
    (e.g. a tokenizer in another directory)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(
        "models/tiny",
        description="The policy's Hugging Face directory: what the engines serve at version 0 (and roll back to), "
        "what the trainer starts from, whose tokenizer renders prompts.",
    )
    mesh: MeshConfig = Field(default_factory=MeshConfig, description="Addresses of the services.")
    auth: AuthConfig = Field(
        default_factory=AuthConfig, description="The token (and TLS) every service checks and every client sends."
    )
    engine: EngineVariant = Field(
        default_factory=EngineConfig,
        description="The engine server, by `type`: embedded (default), vllm, sglang or sim (the latency simulator); "
        "services/engine/backends.py lists them.",
    )
    proxy: ProxyConfig = Field(default_factory=ProxyConfig, description="The LLMProxy in front of the engines.")
    buffer: BufferConfig = Field(
        default_factory=BufferConfig, description="The SampleBuffer between rollout and training."
    )
    controller: ControllerConfig = Field(
        default_factory=ControllerConfig, description="The AsyncController: version, admission, weight updates."
    )
    env_manager: EnvManagerConfig = Field(default_factory=EnvManagerConfig, description="The EnvManager pool.")
    env_provider: EnvProviderConfig = Field(
        default_factory=EnvProviderConfig,
        description="`rollmesh serve env-provider`: an environment hosted for remote EnvManagers (env.type remote).",
    )
    trainer: TrainerVariant = Field(
        default_factory=TrainerConfig, description="The training engine: fsdp (default) or sim (`type: sim`)."
    )
    gateway: GatewayConfig = Field(
        default_factory=GatewayConfig, description="The OpenAI-compatible gateway for external agents."
    )
    tinker: TinkerConfig = Field(
        default_factory=TinkerConfig,
        description="`rollmesh serve tinker`: the Tinker training API (LoRA clients on model_path) for the tinker SDK.",
    )
    reward_service: RewardServiceConfig = Field(
        default_factory=RewardServiceConfig,
        description="`rollmesh serve reward`: one verifier pool for the mesh; `rollmesh run` starts it when "
        "env_manager.reward is {type: service} with no address.",
    )
    train_loop: TrainerProcessConfig = Field(
        default_factory=TrainerProcessConfig, description="The training loop and the trainer process around it."
    )
    teachers: list[TeacherConfig] = Field(
        default_factory=list,
        description="On-policy distillation: teacher models, each behind engines (the engine section's type and "
        "settings, its own model_path) and an LLMProxy of its own; a task names one as its teacher "
        "(env_manager.teacher, or a domain's). The student's tokenizer is required (checked before the run).",
    )
    run: RunConfig = Field(default_factory=RunConfig, description="`rollmesh run`: how the local mesh is laid out.")
    slurm: SlurmConfig = Field(
        default_factory=SlurmConfig, description="`rollmesh launch slurm`: the mesh as a SLURM batch job."
    )
    devices: DeviceMapConfig = Field(
        default_factory=DeviceMapConfig, description="Which GPUs serve engines and which train (device_map.py)."
    )

    @model_validator(mode="after")
    def _propagate_model_path(self) -> RollmeshConfig:
        for section, key in (
            ("engine", "model_path"),
            ("trainer", "model_path"),
            ("controller", "initial_model_path"),
            ("env_manager", "tokenizer_path"),
        ):
            part = getattr(self, section)
            if key in type(part).model_fields and getattr(part, key) is None:
                setattr(part, key, self.model_path)
        if self.controller.state_path is None:  # the run directory has one owner: train_loop
            self.controller.state_path = str(Path(self.train_loop.run_dir) / CONTROLLER_STATE)
        if "load_roots" in type(self.engine).model_fields and not self.engine.load_roots:  # where disk exports go
            self.engine.load_roots = [str(Path(self.train_loop.run_dir) / "weights")]
        return self

    def _check_served_adapter(self, engine, lora) -> None:
        """The engines can serve this policy's adapter by name (disk with adapter: true)."""
        if not engine.serves_adapters:
            raise ValueError(
                f"train_loop.publisher.adapter: engine.type {self.engine.type!r} serves no LoRA adapters "
                "(embedded and vllm do)"
            )
        if not engine.adapts_lm_head and "lm_head" in lora.target_modules:
            raise ValueError(f"trainer.lora.target_modules: engine.type {self.engine.type!r} adapts no lm_head")
        slots = getattr(self.engine, "max_loaded_loras", None)
        if slots is not None and slots < 2:  # the new version loads before the old one goes
            raise ValueError("engine.max_loaded_loras: at least 2 to serve an adapter that is updated (old and new)")
        rank = getattr(self.engine, "max_lora_rank", None)
        if rank is not None and lora.rank > rank:
            raise ValueError(f"trainer.lora.rank: {lora.rank} is over engine.max_lora_rank {rank}")

    @model_validator(mode="after")
    def _buckets_need_weights(self) -> RollmeshConfig:
        publisher, engine = self.train_loop.publisher, backend(self.engine)
        kind = publisher.type
        if publisher.sends_tensors and self.trainer.type == "sim":
            raise ValueError(
                f"train_loop.publisher: {kind} sends real weights; the simulated trainer has none (use type: disk)"
            )
        if kind not in engine.transports:
            raise ValueError(
                f"train_loop.publisher: engine.type {self.engine.type!r} receives weights by "
                f"{' or '.join(sorted(engine.transports))}, not {kind}"
            )
        fields = type(publisher).model_fields
        if "encoding" in fields:  # tensor handles (ipc), written as this engine reads them
            publisher.encoding = engine.handle_encoding
        served = kind == "disk" and publisher.adapter  # an adapter the engines serve by name, not merge
        for partial in ("delta", "adapter"):  # updates that send less than every weight
            if not getattr(publisher, partial, False) or served:
                continue
            if not engine.applies_deltas:
                raise ValueError(
                    f"train_loop.publisher.{partial}: engine.type {self.engine.type!r} applies no {partial} updates "
                    "(embedded engines do)"
                )
            publisher._engine_dtype = self.engine.dtype  # made (and checked) in the dtype the engines hold
        if getattr(publisher, "adapter", False):
            lora = getattr(self.trainer, "lora", None)
            if lora is None:
                raise ValueError("train_loop.publisher.adapter: the policy must train LoRA adapters (trainer.lora)")
            if served:
                self._check_served_adapter(engine, lora)
            elif self.trainer.dtype != "float32":  # the engines merge from the float32 upcast of their files
                raise ValueError("train_loop.publisher.adapter: needs trainer.dtype float32 (the merge's base)")
            elif getattr(publisher, "delta", False):
                raise ValueError("train_loop.publisher: adapter or delta, not both (an adapter update is smaller)")
        self.controller._adapter_updates = served
        if "master_address" in fields and publisher.master_address not in self.proxy.weight_group_hosts:
            self.proxy.weight_group_hosts.append(publisher.master_address)  # the one place it is said
        if self.devices.placement == "colocated" and not engine.releases_memory:
            raise ValueError(
                f"devices.placement: colocated engines release their memory while the trainer trains; "
                f"engine.type {self.engine.type!r} does not"
            )
        return self

    @model_validator(mode="after")
    def _proxy_speaks_the_engines_api(self) -> RollmeshConfig:
        # engine.type owns the choice; proxy.engine_api is there for a proxy in front of engines
        # that no run config describes (and must not contradict one that does).
        if "engine" not in self.model_fields_set:
            return self
        api = backend(self.engine).api
        if "engine_api" in self.proxy.model_fields_set and self.proxy.engine_api != api:
            raise ValueError(
                f"proxy.engine_api: {self.proxy.engine_api!r} but engine.type {self.engine.type!r} "
                f"speaks {api!r} (leave proxy.engine_api out)"
            )
        self.proxy.engine_api = api
        return self

    @model_validator(mode="after")
    def _replay_has_routing_recorded(self) -> RollmeshConfig:
        # trainer.moe.routing owns the choice: the rollout records routing and the engines send it
        moe = getattr(self.trainer, "moe", None)  # the simulated trainer has no model, no MoE
        if moe is None or moe.routing != "replay":
            return self
        settings = backend(self.engine).routing_settings
        if settings is None:
            raise ValueError(
                f"trainer.moe.routing: replay needs the experts each token was routed to; engine.type "
                f"{self.engine.type!r} does not report them (embedded and sglang do)"
            )
        if self.run.rollout != "env_manager":
            raise ValueError(
                "trainer.moe.routing: replay records routing in the EnvManager's episodes, not the gateway's"
            )
        for key, value in settings:
            setattr(self.engine, key, value)
        self.env_manager.return_routed_experts = True
        return self

    @model_validator(mode="after")
    def _a_group_is_one_request(self) -> RollmeshConfig:
        """A group's samples as one request where one engine samples them at once (prompt replication
        spreads them where there are several engines, or where the engine samples one a request)."""
        em, samples_n = self.env_manager, backend(self.engine).samples_n
        if em.replicate_prompts is None:
            em.replicate_prompts = self.run.num_engines != 1 or not samples_n
        elif em.replicate_prompts is False and not samples_n:
            raise ValueError(
                f"env_manager.replicate_prompts: false sends a group's samples as one request of n, which "
                f"rollmesh's client for engine.type {self.engine.type!r} does not send (its prefix cache "
                "shares the prompt among n requests): leave it unset or set it true"
            )
        return self

    @model_validator(mode="after")
    def _devices_fit_the_run(self) -> RollmeshConfig:
        check_shape(self.devices, self.run.num_engines, gpus_per_engine(self.engine), self.run.trainer_procs)
        if self.devices.placement != "none" and not backend(self.engine).uses_gpu:
            raise ValueError(f"devices.placement: engine.type {self.engine.type!r} uses no GPU (use placement: none)")
        if self.devices.placement == "colocated":
            if not self.train_loop.publisher.colocates:
                raise ValueError(
                    f"train_loop.publisher: {self.train_loop.publisher.type} puts the trainer and an "
                    "engine on one GPU as two ranks, which NCCL refuses; colocated engines take ipc (or "
                    "disk)"
                )
            for key, value in backend(self.engine).colocated_settings:  # e.g. SGLang's memory saver
                setattr(self.engine, key, value)
        return self

    @model_validator(mode="after")
    def _batches_by_domain(self) -> RollmeshConfig:
        domains = self.env_manager.domains if self.buffer.by_domain else []
        weights = {d.name: d.weight for d in domains if d.weight > 0}
        if "domain_weights" in self.buffer.model_fields_set and self.buffer.domain_weights != weights:
            raise ValueError(
                f"buffer.domain_weights: {self.buffer.domain_weights} but env_manager.domains weigh {weights}; "
                "leave it out (the run config sets it from the domains)"
            )
        self.buffer.domain_weights = weights
        if "domain_wait_s" not in self.buffer.model_fields_set:  # within a step's wait, whatever that is
            self.buffer.domain_wait_s = self.train_loop.get_timeout_s / 2
        if weights and self.buffer.domain_wait_s >= self.train_loop.get_timeout_s:
            raise ValueError(
                f"buffer.domain_wait_s ({self.buffer.domain_wait_s:g} s) must be shorter than train_loop."
                f"get_timeout_s ({self.train_loop.get_timeout_s:g} s): a batch would time out before other "
                "domains fill a slow one's slots"
            )
        return self

    @model_validator(mode="after")
    def _the_reward_service_answers_in_time(self) -> RollmeshConfig:
        service = self.reward_service
        for i, d in enumerate(self.env_manager.task_domains()):
            reward, key = d.reward, f"env_manager.domains[{i}].reward" if d.name else "env_manager.reward"
            if isinstance(reward, str) or reward.type != "service" or reward.address is not None:
                continue  # not the mesh's own service: its bound is not known here
            if service.timeout_s > reward.timeout_s:
                raise ValueError(
                    f"{key}.timeout_s ({reward.timeout_s:g} s) is shorter than a score of the "
                    f"mesh's reward service may take (reward_service.timeout_s: {service.timeout_s:g} s), so "
                    "scores it would still finish are cut: raise the first (within env_manager.episode."
                    "step_timeout_s) or lower the second"
                )
        return self

    @model_validator(mode="after")
    def _heldout_sets_by_domain(self) -> RollmeshConfig:
        if self.run.heldout_path and any(d.heldout_path for d in self.env_manager.domains):
            raise ValueError(
                "run.heldout_path: with domains, each domain's held-out set is env_manager.domains[i].heldout_path "
                "(scored with its own reward)"
            )
        return self

    @model_validator(mode="after")
    def _heldout_episodes_need_seeds(self) -> RollmeshConfig:
        if self.run.heldout_episodes and self.env_manager.env.type != "remote":
            raise ValueError(
                "run.heldout_episodes: held-out seeds are a remote environment's (env_manager.env.type "
                "remote); a local task's held-out set is run.heldout_path"
            )
        return self

    @model_validator(mode="after")
    def _lease_outlasts_heartbeats(self) -> RollmeshConfig:
        # A lease of one heartbeat would expire a live EnvManager whose report was a moment late.
        if self.controller.holder_lease_s < 3 * self.env_manager.heartbeat_s:
            raise ValueError(
                f"controller.holder_lease_s ({self.controller.holder_lease_s:g}) must be at least 3 x "
                f"env_manager.heartbeat_s ({self.env_manager.heartbeat_s:g})"
            )
        return self

    @model_validator(mode="after")
    def _teachers_are_named_and_served(self) -> RollmeshConfig:
        """Each task's teacher is one of ``teachers`` (a mesh's whose addresses are given: any name it
        has), every teacher distinct; teachers' engines are not placed on GPUs yet."""
        names = [t.name for t in self.teachers]
        if len(set(names)) != len(names):
            raise ValueError(f"teachers: each name once, got {names}")
        known = set(names) | set(self.mesh.teachers)
        for d in self.env_manager.task_domains():
            if d.teacher is not None and d.teacher not in known:
                where = f"env_manager.domains[{d.name}].teacher" if d.name else "env_manager.teacher"
                raise ValueError(f"{where}: no teacher {d.teacher!r} (teachers: {sorted(known)})")
        if self.teachers and self.devices.placement != "none":
            raise ValueError("teachers: their engines are not placed on GPUs yet (devices.placement: none)")
        if self.teachers and not hasattr(ENGINE_APIS[backend(self.engine).api], "score"):
            raise ValueError(
                f"teachers: engine.type {self.engine.type!r} does not score given tokens yet (embedded and sglang do)"
            )
        if self.teachers and self.run.rollout != "env_manager":
            raise ValueError("teachers: the EnvManager's groups are scored by teachers, not the gateway's sessions")
        return self


def _variant_tags(model: type[BaseModel]) -> set[str]:
    """Every ``type`` tag of every typed union under ``model``."""
    import typing

    tags, todo, seen = set(), [model], set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if "type" in m.model_fields and isinstance(m.model_fields["type"].default, str):
            tags.add(m.model_fields["type"].default)
        for f in m.model_fields.values():
            stack = [f.annotation]
            while stack:
                a = stack.pop()
                if isinstance(a, type) and issubclass(a, BaseModel):
                    todo.append(a)
                stack.extend(typing.get_args(a))
    return tags


_TAGS = _variant_tags(RollmeshConfig)


def apply_override(data: dict, override: str) -> None:
    """Apply one ``a.b.c=value`` override to a nested dict in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected KEY=VALUE, e.g. engine.port=30001")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {override!r}: empty key segment")
    node = data
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {p!r} is not a section")
    node[parts[-1]] = yaml.safe_load(raw) if raw.strip() else ""


def _key(loc: tuple, data) -> tuple[str, str]:
    """The dotted key of an error's location in ``data``, and the variant it was read as: pydantic
    puts a tagged union's tag in the location (``engine.embedded.port``); the user wrote ``engine.port``."""
    parts, variant, node = [], "", data
    for p in loc:
        if isinstance(node, dict) and isinstance(p, str) and p not in node and p in _TAGS:
            variant = f" (type {p})"  # the variant the section was read as, not a key the user wrote
            continue
        parts.append(str(p))
        node = node.get(p) if isinstance(node, dict) else None
    return ".".join(parts), variant


def format_validation_error(err: ValidationError, data=None) -> str:
    lines = []
    for e in err.errors():
        key, variant = _key(e["loc"], data)
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown key {key!r}{variant}")
        elif e["type"] == "union_tag_invalid":  # a misspelled variant: name the choices
            lines.append(f"{key}.type: unknown {e['ctx']['tag']!r}; choose from {e['ctx']['expected_tags']}")
        else:
            lines.append(f"{key}{variant}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


# Keys renamed for one spelling per concept across engines and sections. An old key is refused with
# its new name (not the bare "extra field" every misspelling gets): a config that used it still runs
# after one edit, and never silently loses the value.
RENAMED = {
    "engine.max_num_seqs": "engine.max_running_requests",
    "engine.max_model_len": "engine.context_length",
    "env_manager.put_timeout_s": "buffer.put_timeout_s",
    "gateway.sessions.put_timeout_s": "buffer.put_timeout_s",
}


def _refuse_renamed(data: dict, where: str) -> None:
    for old, new in RENAMED.items():
        *parents, key = old.split(".")
        node = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and key in node:
            raise ConfigError(f"{where}: {old} was renamed: write {new}")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None, cls=RollmeshConfig) -> Any:
    """Load ``cls`` from a YAML file (or defaults when ``path`` is None) plus overrides."""
    data: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        data = loaded
    for o in overrides or []:
        alone: dict = {}
        apply_override(alone, o)  # what this override sets, however it is spelt
        if isinstance(alone.get("auth"), dict) and "token" in alone["auth"]:
            # Copied onto every child's command line, where every user of the host reads it (ps).
            raise ConfigError(
                "auth.token: not on the command line (every process's argv is visible in ps); "
                "set $ROLLMESH_TOKEN or write it in the config file"
            )
        apply_override(data, o)
    _refuse_renamed(data, str(path or "config"))
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"{path or 'config'}: {format_validation_error(e, data)}") from None
