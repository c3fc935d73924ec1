"""Configuration of the Tinker-compatible training service (``rollmesh serve tinker``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.gateway.keys import read_key_file


class TinkerConfig(BaseModel):
    """Where the Tinker API is served, whose keys it takes, and what it holds."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address the HTTP server binds.")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port (0: any free one, printed at start).")
    api_keys_path: str | None = Field(
        None,
        description='JSON file {"name": "sha256:<hex>", ...} of key hashes (`rollmesh gateway-key FILE NAME '
        "--tinker` issues a key the SDK accepts, tml-...). Each key's sessions, models and weights are its "
        "own. Read again when it changes. The mesh token is never a key.",
    )
    root: str = Field(
        "runs/tinker",
        description="Directory of the clients' saved states and sampler weights (tinker://MODEL/KIND/NAME lives at "
        "ROOT/MODEL/KIND/NAME); the engine loads adapters from here only.",
    )
    base_model: str | None = Field(
        None,
        description="The name clients create models of (create_lora_training_client(base_model)); default: the "
        "run's model_path as an absolute path, which the SDK's and the cookbook's get_tokenizer load offline.",
    )
    engine_url: str | None = Field(
        None,
        description="An engine of engine.type already serving model_path with `root` among its load_roots and "
        "LoRA on (its API takes the control token); none: the service starts one of model_path itself (engine.type "
        "embedded or vllm; its other engine settings are the defaults).",
    )
    max_loaded_adapters: int = Field(
        8, ge=1, description="Sampler weights the engine holds at once; the least recently used is unloaded first."
    )
    session_idle_s: float = Field(
        600.0,
        ge=30,
        description="A session not heard from for this long (the SDK sends a heartbeat every 10 s) is finished: its "
        "training models' adapters are freed (saved weights stay on disk).",
    )
    max_models_per_key: int = Field(8, ge=1, description="Training models one key may hold at once.")
    micro_batch_tokens: int = Field(
        1024,
        ge=64,
        description="Padded tokens per forward/backward pass; a call's data is split into such passes (the logits "
        "of a pass are tokens × vocabulary floats; a single longer datum is one pass of its own).",
    )
    default_max_tokens: int = Field(256, ge=1, description="A sample's max_tokens when the client sets none.")
    poll_hold_s: float = Field(
        20.0,
        gt=0,
        le=40,
        description="How long a retrieve_future waits for its result before 'try again' (the SDK "
        "polls again at once and gives up on one poll after 45 s).",
    )
    order_timeout_s: float = Field(
        300.0, gt=0, description="How long a training call waits for the calls its seq_id says come first."
    )
    generate_timeout_s: float = Field(300.0, gt=0, description="Deadline of one sample on the engine.")
    max_body_bytes: int = Field(
        256 * 2**20,
        ge=1024,
        description="Largest request body accepted (413 beyond); a forward_backward's tensors may hold as many "
        "values once read as this many bytes of float32 could (a sparse input is refused past it).",
    )
    max_calls_in_flight_per_key: int = Field(
        32,
        ge=1,
        description="Calls of one key started and not yet finished (each holds its data until it runs); more are "
        "refused with 429 before their body is read.",
    )
    keep_results: int = Field(4096, ge=16, description="Finished results kept for clients to fetch (oldest dropped).")

    @field_validator("api_keys_path")
    @classmethod
    def _hashed_keys(cls, path: str | None) -> str | None:
        if path is not None:
            read_key_file(path)  # refused at load: a file of plain keys, or not a mapping
        return path
