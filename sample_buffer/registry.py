"""Name → object lookup, the one resolver every registry uses (environments, rewards, losses,
advantage estimators): a registered name, or ``module:attr`` of the user's own.

It lives beside the data model because both loops import it and neither may import the other.
Configs call it in their validators, so a misspelled name fails when the config is loaded,
before any process starts.
"""

from __future__ import annotations

import importlib
from typing import Annotated, Union

from pydantic import Discriminator, Tag


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


def tagged_union(*models, default: str):
    """A pydantic union of ``models`` chosen by their ``type`` field, ``default`` when a section
    leaves ``type`` out: ``engine: {port: 1}`` is the embedded engine, ``{type: sim}`` the simulator.
    A misspelled type or a key of another variant fails at load, naming the key."""

    def tag(value):
        return value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)

    tagged = tuple(Annotated[m, Tag(m.model_fields["type"].default)] for m in models)
    return Annotated[Union[tagged], Discriminator(tag)]  # noqa: UP007 (a runtime tuple of members)
