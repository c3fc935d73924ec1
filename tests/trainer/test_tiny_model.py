"""`rollmesh init-model` writes a standard HF directory that plain transformers loads."""

import json
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from launch.cli import app
from trainer.tiny_model import count_parameters


def test_init_model_loads_with_plain_transformers(tmp_path):
    out = tmp_path / "m"
    res = CliRunner().invoke(app, ["init-model", "--out", str(out), "--seed", "3"])
    assert res.exit_code == 0, res.output
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).exists(), f
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert 0.5e6 <= count_parameters(model) <= 5e6
    text = tok.apply_chat_template(
        [{"role": "user", "content": "7+2= ?\nok"}], tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>user\n7+2= ?\nok<|im_end|>\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text).input_ids
    assert tok.decode(ids) == text  # lossless round trip, whitespace included
    digits = [tok(str(d)).input_ids for d in range(10)]
    assert all(len(d) == 1 for d in digits) and len({d[0] for d in digits}) == 10  # one token per digit
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id


def test_init_model_builds_a_vision_language_model_plain_transformers_loads_with_its_image_processor(tmp_path):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    out = tmp_path / "vl"
    res = CliRunner().invoke(app, ["init-model", "--out", str(out), "--arch", "qwen2-vl"])
    assert res.exit_code == 0, res.output
    model = AutoModelForImageTextToText.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "qwen2_vl" and count_parameters(model) < 2e6
    assert model.config.image_token_id == tok.convert_tokens_to_ids("<|image_pad|>")
    assert all(len(tok(str(d)).input_ids) == 1 for d in range(10))  # digits stay one token each
    pixels = AutoImageProcessor.from_pretrained(out)(images=[Image.new("RGB", (28, 28))], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [[1, 8, 8]]  # 28 px → 32: 8 patches of 4 a side, 16 tokens


def test_init_model_is_seeded(tmp_path):
    runner = CliRunner()
    for name, seed in (("a", 5), ("b", 5), ("c", 6)):
        assert runner.invoke(app, ["init-model", "--out", str(tmp_path / name), "--seed", str(seed)]).exit_code == 0
    w = {n: AutoModelForCausalLM.from_pretrained(tmp_path / n).model.embed_tokens.weight for n in "abc"}
    assert torch.equal(w["a"], w["b"]) and not torch.equal(w["a"], w["c"])


def test_cli_rejects_bad_config_clearly(tmp_path):
    res = CliRunner().invoke(app, ["serve", "engine", "--set", "engine.nonsense=1"])
    assert res.exit_code == 2 and "unknown key 'engine.nonsense'" in res.output


def test_a_glyph_prior_builds_before_the_digit_prior_and_needs_a_vision_tower(tmp_path):
    """`--glyph-prior-steps`: a vision-language model is taught to name the letter in a picture (its
    tower learns shapes; no digit is ever shown), then the digit prior teaches the answer's format;
    how well it reads is measured in docs/vision.md, not here. A text-only model has no tower to
    teach: refused, by name."""
    from rollout.envs.digit_pictures import LETTER_QUESTION, prior_prompt
    from trainer.tiny_model import TinyModelConfig

    rng = random.Random(0)
    assert prior_prompt("q", rng)[1] == LETTER_QUESTION and prior_prompt("7", rng)[1] != LETTER_QUESTION
    vl = ["init-model", "--out", str(tmp_path / "vl"), "--arch", "qwen2-vl", "--glyph-prior-steps", "2"]
    res = CliRunner().invoke(app, [*vl, "--digit-prior-steps", "2"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(app, ["init-model", "--out", str(tmp_path / "t"), "--glyph-prior-steps", "2"])
    assert res.exit_code == 2 and "glyph_prior_steps: arch qwen2 has no vision tower" in res.output
    with pytest.raises(ValueError, match="glyph_prior_steps"):
        TinyModelConfig(glyph_prior_steps=1)
