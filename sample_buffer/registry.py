"""Name → object lookup, the one resolver every registry uses (environments, rewards, losses,
advantage estimators): a registered name, or ``module:attr`` of the user's own.

It lives beside the data model because both loops import it and neither may import the other.
Configs call it in their validators, so a misspelled name fails when the config is loaded,
before any process starts.
"""

from __future__ import annotations

import importlib


def resolve(field: str, name: str, registry: dict, attr_kind: str = "function"):
    """``registry[name]``, or ``attr`` of an importable ``module`` for ``module:attr``; otherwise a
    ValueError naming ``field``, the value and the choices."""
    if name in registry:
        return registry[name]
    if ":" in name:
        module, attr = name.split(":", 1)
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{field}: cannot import {name!r}: {e}") from None
    raise ValueError(f"{field}: unknown {name!r}; choose from {sorted(registry)} or 'module:{attr_kind}'")
