"""Name → object lookup shared by rollout's registries: a registered name, or ``module:attr``."""

from __future__ import annotations

import importlib


def resolve(field: str, name: str, registry: dict, attr_kind: str = "function"):
    """``registry[name]``, or ``attr`` of an importable ``module`` for ``module:attr``; otherwise a
    ValueError naming ``field`` and the choices."""
    if name in registry:
        return registry[name]
    if ":" in name:
        module, attr = name.split(":", 1)
        return getattr(importlib.import_module(module), attr)
    raise ValueError(f"{field}: unknown {name!r}; choose from {sorted(registry)} or 'module:{attr_kind}'")
