"""Every ``rollmesh serve NAME`` hands its service its own typed section and the few values it shares
with the run, never the whole run config (issue 64): what a service reads is in its signature."""

from __future__ import annotations

import importlib
import inspect
import typing

import pytest
from pydantic import BaseModel

from launch.commands.serve import SERVICES
from launch.config import RollmeshConfig


def _hints(fn) -> dict:
    try:
        return typing.get_type_hints(fn)
    except NameError:  # a name imported only for type checkers: check what resolves
        return {}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_a_service_takes_its_section_and_what_it_shares_never_the_whole_config(name):
    module, args, _ = SERVICES[name]
    serve = importlib.import_module(module).serve
    cfg = RollmeshConfig(model_path="models/tiny")
    values = args(cfg)
    bound = inspect.signature(serve).bind(*values)  # the table's values fit the signature, by position
    assert not any(isinstance(v, RollmeshConfig) for v in values)
    section = values[0]
    assert isinstance(section, BaseModel) and section in [getattr(cfg, f) for f in RollmeshConfig.model_fields]
    assert any(v is cfg.auth for v in values)  # the credentials, the same for every service
    hints = _hints(serve)
    for param, value in bound.arguments.items():  # each typed parameter gets a value of its type
        hint = hints.get(param)
        if isinstance(hint, type):
            assert isinstance(value, hint), (name, param, type(value))
