"""Configuration of the agent gateway: where it serves, whose keys it takes, and its limits."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rollout.agent.sessions import SessionsConfig
from services.gateway.keys import read_key_file


class GatewayConfig(BaseModel):
    """An OpenAI-compatible front door for external agents (``services/gateway/``)."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address the gateway binds.")
    port: int = Field(8070, ge=0, le=65535, description="HTTP port (0: pick a free one).")
    model_name: str = Field("rollmesh-policy", description="The model's name in /v1/models and in answers.")
    tokenizer_path: str | None = Field(None, description="Tokenizer and chat template (None: the run's model_path).")
    chat_template_path: str | None = Field(
        None, description="A Jinja chat template used instead of the tokenizer's (e.g. one that renders tools)."
    )
    api_keys_path: str | None = Field(
        None,
        description='JSON file {"name": "sha256:<hex>", ...} of key hashes (`rollmesh gateway-key FILE NAME` issues '
        "one); each key's sessions are its own. Read again when it changes: a deleted key stops working. "
        "The mesh token is never a key.",
    )
    max_concurrent_requests: int = Field(64, ge=1, description="Requests in flight per key; more get 429.")
    max_messages: int = Field(512, ge=1, description="Messages in one request at most (400 beyond).")
    max_request_bytes: int = Field(4 * 2**20, ge=1, description="Largest request body (413 beyond).")
    max_prompt_tokens: int = Field(32_768, ge=1, description="Longest rendered prompt, in tokens (400 beyond).")
    max_completion_tokens: int = Field(4096, ge=1, description="Largest max_tokens a request may ask for.")
    default_max_tokens: int = Field(512, ge=1, description="max_tokens of a request that names none.")
    max_n: int = Field(16, ge=1, description="Choices per request at most.")
    sessions: SessionsConfig = Field(default_factory=SessionsConfig, description="Sessions, groups and admission.")

    @field_validator("api_keys_path", "chat_template_path")
    @classmethod
    def _exists(cls, path: str | None) -> str | None:
        if path is not None and not Path(path).is_file():
            raise ValueError(f"no file {path}")
        return path

    @field_validator("api_keys_path")
    @classmethod
    def _hashed_keys(cls, path: str | None) -> str | None:
        if path is not None:
            read_key_file(path)  # refused at load: a file of plain keys, or not a mapping
        return path
