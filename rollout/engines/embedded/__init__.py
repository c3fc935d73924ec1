"""The embedded inference engine: continuous batching on torch + transformers (CPU or one GPU)."""

from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine, EngineError, GenerateOutput
from rollout.sampling import SamplingParams

__all__ = ["EmbeddedEngine", "EngineConfig", "EngineError", "GenerateOutput", "SamplingParams"]
