from pathlib import Path

import pytest

from services.config import ConfigError, RollmeshConfig, load_config


def test_defaults_and_overrides():
    cfg = load_config(None, ["engine.port=30123", "proxy.engine_urls=[http://a:1, http://b:2]", "run_name=x"])
    assert cfg.engine.port == 30123
    assert cfg.proxy.engine_urls == ["http://a:1", "http://b:2"]
    assert cfg.run_name == "x"


def test_unknown_key_is_an_error_naming_it(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("engine:\n  max_runing_requests: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'engine.max_runing_requests'"):
        load_config(p)
    with pytest.raises(ConfigError, match="unknown key 'proxy.nope'"):
        load_config(None, ["proxy.nope=1"])


def test_bad_values_name_the_field():
    with pytest.raises(ConfigError, match="engine.max_running_requests"):
        load_config(None, ["engine.max_running_requests=0"])
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(None, ["engine.port"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent.yaml")


@pytest.mark.parametrize("path", sorted(Path("examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_parses(path):
    assert isinstance(load_config(path), RollmeshConfig)


def test_every_config_field_is_documented():
    from pydantic import BaseModel

    def walk(cls):
        for name, f in cls.model_fields.items():
            assert f.description, f"{cls.__name__}.{name} has no description"
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann)

    walk(RollmeshConfig)
