"""`rollmesh init-model --from`: a packaged GGUF becomes a HF directory that answers, or a clear error."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from trainer import packaged_models
from trainer.packaged_models import PACKAGED, ConversionError, PackagedModel, check_generates, convert


def test_the_converted_smollm2_is_a_llama_with_its_chat_template_that_answers(smollm2):
    from pathlib import Path

    config = json.loads((Path(smollm2) / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert "quantization_config" not in config  # plain float32 weights (vLLM refuses "gguf")
    assert "<|im_start|>" in (Path(smollm2) / "chat_template.jinja").read_text()
    assert "Apache-2.0" in (Path(smollm2) / "LICENCE.txt").read_text()
    answer = check_generates(Path(smollm2))
    assert "17" in answer and "25" in answer, answer  # it restates the sum (and gets it wrong: 32)


@pytest.fixture
def bad_package(tmp_path, monkeypatch):
    """A package on the path whose 'GGUF' is not one."""
    pkg = tmp_path / "rollmesh_bad_gguf"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "broken.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(
        PACKAGED, "broken", PackagedModel("rollmesh_bad_gguf", "pip install nothing", "broken.gguf", "-")
    )
    monkeypatch.setitem(PACKAGED, "absent", PackagedModel("rollmesh_not_installed", "pip install it", "x.gguf", "-"))


def test_a_gguf_that_does_not_convert_or_a_missing_package_is_a_clear_error(bad_package, tmp_path):
    with pytest.raises(ConversionError, match=r"broken\.gguf: does not convert"):
        convert("broken", tmp_path / "out", progress=lambda _: None)
    with pytest.raises(ConversionError, match=r"rollmesh_not_installed is not installed; set-up runs `pip install it`"):
        packaged_models.gguf_path("absent")
    with pytest.raises(ConversionError, match="unknown model 'nope'; packaged: smollm2-135m-instruct"):
        packaged_models.gguf_path("nope")


def test_the_cli_refuses_an_unknown_model_with_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "launch.cli", "init-model", "--from", "gpt-9", "--out", str(tmp_path / "m")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "unknown model 'gpt-9'" in proc.stderr, proc.stderr
    assert not (tmp_path / "m").exists()
