"""A latency simulator with the embedded engine's API: time comes from a model, not a GPU.

``rollout.engines.sim.engine.SimEngine`` is the engine; the config is importable on its own
(the embedded engine's config refers to it).
"""

from rollout.engines.sim.config import LengthModel, SimEngineConfig

__all__ = ["LengthModel", "SimEngineConfig"]
