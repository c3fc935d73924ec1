"""Configuration of the SampleBuffer."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlparse

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sample_buffer.trajectory import DOMAIN_NAME


class BufferConfig(BaseModel):
    """Where trajectories wait between rollout and training, and the rules they wait under."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["memory", "redis"] = Field(
        "memory",
        description="'memory' (the embedded default) keeps groups in the service's process; 'redis' is durable "
        "and what deployments use.",
    )
    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        description="Redis server (redis backend); rediss:// for TLS. No password here: a URL is printed and logged.",
    )
    redis_username: str | None = Field(None, description="Redis ACL user (none: the default user).")
    redis_ca_path: str | None = Field(
        None,
        description="rediss://: the CA certificate (PEM) Redis's certificate must chain to, its host name checked "
        "(none: the system's roots).",
    )
    redis_password_env: str = Field(
        "ROLLMESH_REDIS_PASSWORD",
        description="Environment variable holding Redis's password (requirepass, or the ACL user's); unset: none.",
    )
    key_prefix: str = Field("rollmesh:default", description="Prefix of every Redis key: one per run shares a Redis.")
    capacity_groups: int = Field(
        4096, ge=1, description="Groups held at most, handed-out-but-unacked included; put waits beyond it."
    )
    visibility_timeout_s: float = Field(
        120.0,
        gt=0,
        description="A batch not acked within this is handed out again (its consumer died; a trainer that starts "
        "takes back its predecessor's at once).",
    )
    put_timeout_s: float = Field(
        30.0, ge=0, description="How long put waits on a full buffer when the caller gives none."
    )
    max_concurrent_puts: int = Field(
        8,
        ge=1,
        description="Puts received at once (each at most 64 MiB on the wire); more wait for a slot within their "
        "deadline: what a burst of puts holds in memory is bounded.",
    )
    filter_zero_variance: bool = Field(
        True, description="Drop groups whose rewards are all equal (DAPO dynamic sampling: no learning signal)."
    )
    by_domain: bool = Field(
        True,
        description="With env_manager.domains: assemble each batch by the domains' weights. false: oldest first "
        "whatever the domain; a step never waits for a slow domain, and the shares drift (`rollmesh bench "
        "domains` measures both).",
    )
    domain_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Assemble each batch by task domain: each domain's share of a batch's groups follows its "
        "weight (normalised to sum 1). Set from env_manager.domains by the run config (by_domain); empty: one "
        "queue, oldest first.",
    )
    domain_wait_s: float = Field(
        60.0,
        gt=0,
        description="How long a batch waits for a domain's groups before other domains fill its slots "
        "(counted per domain as substituted): a domain with nothing to give (its reward down, every group "
        "filtered) slows training, never stops it. Unless written: half of train_loop.get_timeout_s.",
    )
    redis_timeout_s: float = Field(10.0, gt=0, description="Timeout of one Redis command.")
    host: str = Field("127.0.0.1", description="Address the gRPC service binds.")
    port: int = Field(50052, ge=0, le=65535, description="gRPC port of the service.")
    metrics_port: int = Field(9102, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it.")

    @field_validator("domain_weights")
    @classmethod
    def _domains_named_and_weighed(cls, weights: dict[str, float]) -> dict[str, float]:
        if bad := [d for d in weights if not d or not DOMAIN_NAME.fullmatch(d)]:
            raise ValueError(f"{bad[0]!r} is not a domain name ({DOMAIN_NAME.pattern}, not empty)")
        if weights and (min(weights.values()) < 0 or sum(weights.values()) <= 0):
            raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
        return weights

    @field_validator("redis_url")
    @classmethod
    def _no_password_in_the_url(cls, url: str) -> str:
        parsed = urlparse(url)
        if parsed.scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"scheme {parsed.scheme!r}: expected redis://, rediss:// (TLS) or unix://")
        if parsed.password or "password=" in parsed.query:
            raise ValueError("carries a password: put it in the environment variable redis_password_env names")
        return url
