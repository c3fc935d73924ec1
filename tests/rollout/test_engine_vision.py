"""The embedded engine serving vision-language models (tiny random Qwen2-VL and LLaVA, built by
``rollmesh init-model --arch qwen2-vl|llava``) against transformers.

Images come as SGLang's ``image_data`` with one placeholder per image in the prompt (``<|image_pad|>``,
``<image>``); the engine expands it to the image's tokens, runs the vision tower at prefill and, for
Qwen2-VL, numbers positions in 3-D. Greedy output equals ``generate`` and log-probs equal a teacher-forced forward, with
image and text-only requests batched together and rows joining mid-run; a weight update (the vision
tower's included) re-prefills the images; bad images are refused by name and the engine keeps serving.
"""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from rollout.engines.contract import EngineError
from rollout.engines.embedded.config import EngineConfig
from rollout.engines.embedded.engine import EmbeddedEngine
from rollout.sampling import SamplingParams
from trainer.tiny_model import TinyModelConfig, build_tiny_model

T = 120


def _encoded(fmt: str, size=(8, 8)) -> str:
    """Bare base64 of a 1-bit image in ``fmt`` (a large one stays small encoded)."""
    buf = io.BytesIO()
    Image.new("1", size).save(buf, format=fmt)
    return base64.b64encode(buf.getvalue()).decode()


def jpeg(width: int, height: int, seed: int) -> str:
    """Bare base64 (SGLang's other spelling) of a JPEG: it starts with "/9j/", like a path."""
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return base64.b64encode(buf.getvalue()).decode()


def png(width: int, height: int, seed: int) -> str:
    pixels = (np.random.default_rng(seed).random((height, width, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _build(out, arch: str, seed: int = 0) -> str:
    path = build_tiny_model(out, TinyModelConfig(arch=arch, hidden_size=64, num_hidden_layers=2, seed=seed))
    model = AutoModelForImageTextToText.from_pretrained(path)
    with torch.no_grad():  # random init is near-uniform; larger weights make greedy choices clear
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["qwen2-vl", "llava"])
def vl(request, tmp_path_factory):
    path = _build(tmp_path_factory.mktemp(request.param), request.param)
    engine = EmbeddedEngine(EngineConfig(model_path=path, max_running_requests=3)).start()
    hf = AutoModelForImageTextToText.from_pretrained(path, attn_implementation="sdpa").eval()
    yield path, engine, hf
    engine.shutdown()


class Reference:
    """What transformers does with the same prompt and images, expanded here independently of the engine."""

    def __init__(self, path: str, hf) -> None:
        self.hf, self.tok = hf, AutoTokenizer.from_pretrained(path)
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.qwen = hf.config.model_type == "qwen2_vl"
        self.pad = self.tok.convert_tokens_to_ids("<|image_pad|>" if self.qwen else "<image>")

    def prompt(self, text: str) -> list[int]:
        """``text`` with each {IMG} the model's image placeholder."""
        return self.tok.encode(
            text.replace(IMG, "<|vision_start|><|image_pad|><|vision_end|>" if self.qwen else "<image>")
        )

    def inputs(self, ids: list[int], images: list[str]) -> dict:
        if not images:
            return {"input_ids": torch.tensor([ids])}
        raw = [base64.b64decode(x.partition(",")[2] if x.startswith("data:") else x) for x in images]
        pil = [Image.open(io.BytesIO(r)).convert("RGB") for r in raw]
        px = self.processor(images=pil, return_tensors="pt")
        if self.qwen:  # merged 2 × 2 patches
            counts = iter((px["image_grid_thw"].prod(-1) // 4).tolist())
        else:  # a token per patch of the square image
            side = self.hf.config.vision_config.image_size // self.hf.config.vision_config.patch_size
            counts = iter([side * side] * len(images))
        expanded = [t for x in ids for t in ([x] * next(counts) if x == self.pad else [x])]
        input_ids = torch.tensor([expanded])
        if not self.qwen:
            return {"input_ids": input_ids, "pixel_values": px["pixel_values"]}
        return {
            "input_ids": input_ids,
            "pixel_values": px["pixel_values"],
            "image_grid_thw": px["image_grid_thw"],
            "mm_token_type_ids": (input_ids == self.pad).int(),
        }

    def generate(self, ids, images, n: int) -> list[int]:
        x = self.inputs(ids, images)
        out = self.hf.generate(**x, max_new_tokens=n, do_sample=False, pad_token_id=0)
        return out[0, x["input_ids"].shape[1] :].tolist()

    def logprobs(self, ids, images, output: list[int], temperature: float = 1.0) -> torch.Tensor:
        x = self.inputs(ids, images)
        p = x["input_ids"].shape[1]
        x["input_ids"] = torch.cat([x["input_ids"], torch.tensor([output])], 1)
        if "mm_token_type_ids" in x:
            x["mm_token_type_ids"] = (x["input_ids"] == self.pad).int()
        with torch.no_grad():
            logits = self.hf(**x).logits[0].float()
        lp = torch.log_softmax(logits / temperature, -1)[p - 1 : -1]
        return lp.gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


IMG = "{IMG}"
CASES = [  # (prompt text, images): two images, one, none, one of another size
    (f"<|im_start|>user\n{IMG}{IMG}which digits?<|im_end|>\n<|im_start|>assistant\n", [png(28, 28, 1), png(40, 24, 2)]),
    (f"<|im_start|>user\n{IMG}which digit?<|im_end|>\n<|im_start|>assistant\n", [png(32, 32, 3)]),
    ("<|im_start|>user\nno image here<|im_end|>\n<|im_start|>assistant\n", []),
    (f"<|im_start|>user\nlook: {IMG} now<|im_end|>\n<|im_start|>assistant\n", [png(64, 48, 4)]),
    (f"<|im_start|>user\n{IMG} a photo<|im_end|>\n<|im_start|>assistant\n", [jpeg(30, 30, 5)]),  # bare base64 of a JPEG
]


def test_greedy_equals_generate_with_image_and_text_requests_batched_together(vl):
    path, engine, hf = vl
    ref = Reference(path, hf)
    prompts = [ref.prompt(text) for text, _ in CASES]
    # 3 running slots for 4 requests: the last joins a batch in progress, into a slot freed mid-run
    futs = [
        engine.submit(
            f"g{i}", p, SamplingParams(max_new_tokens=12 + 4 * i, temperature=0, ignore_eos=True), image_data=im
        )
        for i, (p, (_, im)) in enumerate(zip(prompts, CASES))
    ]
    for i, (p, (_, im), f) in enumerate(zip(prompts, CASES, futs)):
        out = f.result(T)
        assert out.output_ids == ref.generate(p, im, 12 + 4 * i), f"case {i}"
        expanded = ref.inputs(p, im)["input_ids"].shape[1]
        assert out.prompt_tokens == expanded and (expanded > len(p)) == bool(im)  # the expanded prompt, counted
        tf = ref.logprobs(p, im, out.output_ids)
        assert (tf - torch.tensor(out.behavior_logprobs)).abs().max().item() <= 1e-4, f"case {i}"


def test_sampled_logprobs_equal_a_teacher_forced_forward_while_rows_leave_and_abort(vl):
    path, engine, hf = vl
    ref = Reference(path, hf)
    prompts = [ref.prompt(text) for text, _ in CASES]
    futs = [
        engine.submit(
            f"s{i}",
            p,
            SamplingParams(max_new_tokens=8 + 7 * i, temperature=0.8, ignore_eos=True, sampling_seed=i),
            image_data=im,
        )
        for i, (p, (_, im)) in enumerate(zip(prompts, CASES))
    ]
    long = engine.submit(
        "long", prompts[1], SamplingParams(max_new_tokens=300, ignore_eos=True), image_data=CASES[1][1]
    )
    for p, (_, im), f in zip(prompts, CASES, futs):
        out = f.result(T)
        assert (ref.logprobs(p, im, out.output_ids, 0.8) - torch.tensor(out.behavior_logprobs)).abs().max() <= 1e-4
    assert engine.abort("long").result(T) == 1
    partial = long.result(T)
    assert partial.finish_reason["type"] == "abort" and 0 < len(partial.output_ids) < 300
    tf = ref.logprobs(prompts[1], CASES[1][1], partial.output_ids)
    assert (tf - torch.tensor(partial.behavior_logprobs)).abs().max().item() <= 1e-4


def test_a_weight_update_reprefills_the_images_with_the_new_vision_tower(vl, tmp_path):
    path, engine, hf = vl
    other = _build(tmp_path / "b", hf.config.model_type.replace("_", "-"), seed=1)
    hf_b = AutoModelForImageTextToText.from_pretrained(other, attn_implementation="sdpa").eval()
    ref_a, ref_b = Reference(path, hf), Reference(other, hf_b)
    text, images = CASES[0]
    prompt = ref_a.prompt(text)
    seen = threading.Semaphore(0)
    fut = engine.submit(
        "span",
        prompt,
        SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True),
        on_token=lambda *_: seen.release(),
        image_data=images,
    )
    for _ in range(5):  # some tokens from the old weights first
        assert seen.acquire(timeout=T)
    engine.pause("retract").result(T)  # the running request goes back to the queue, to be prefilled again
    engine.load_weights_from_disk(other, 5).result(T)
    engine.resume().result(T)
    out = fut.result(T)
    k = out.token_versions.index(5)  # the first token the new weights sampled
    assert set(out.token_versions[:k]) == {0} and set(out.token_versions[k:]) == {5}
    # every token from the update on: the new weights' greedy continuation of the whole context, images included
    assert out.output_ids[k:] == ref_b.generate(prompt + out.output_ids[:k], images, len(out.output_ids) - k)
    tf = ref_b.logprobs(prompt, images, out.output_ids)[k:]
    assert (tf - torch.tensor(out.behavior_logprobs[k:])).abs().max().item() <= 1e-4
    engine.load_weights_from_disk(path, 6).result(T)  # back, for the other tests


@pytest.mark.parametrize(
    "images, says",
    [
        ([png(28, 28, 0), png(28, 28, 1)], "image_data: 2 images for 1 image placeholders"),
        ([], "image_data: 0 images for 1 image placeholders"),
        (["data:text/plain;base64,aGVsbG8="], "image_data[0]: a data URL must be data:image/"),
        (["https://example.com/cat.png"], "image_data[0]: URLs are refused"),
        (["/etc/passwd"], "image_data[0]: not base64"),  # a path is never opened
        ([base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode()], "image_data[0]: not a readable"),
        ([_encoded("BMP")], "image_data[0]: not a readable PNG/JPEG/WEBP/GIF image"),  # Pillow's other formats
        ([_encoded("PNG", (4097, 4096))], "image_data[0]: image of 4097×4096 pixels is over"),
        ([_encoded("PNG", (4096, 4096))] * 5, "image_data: 83886080 pixels in 5 images; at most"),  # 5 placeholders
        (["%%%"], "image_data[0]: not base64"),
    ],
)
def test_bad_images_are_refused_by_name_and_the_engine_keeps_serving(vl, images, says):
    """Sizes are read from the headers: the oversized ones above are refused before any pixel is decoded."""
    path, engine, hf = vl
    ref = Reference(path, hf)
    prompt = bad = ref.prompt(CASES[1][0])
    if len(images) == 5:  # as many placeholders as images: the sizes are what is wrong
        bad = ref.prompt(CASES[1][0].replace(IMG, IMG * 5))
    with pytest.raises(EngineError) as err:
        engine.submit("bad", bad, SamplingParams(max_new_tokens=2), image_data=images)
    assert str(err.value).startswith(says), str(err.value)
    ok = engine.submit(
        "ok", prompt, SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True), image_data=CASES[1][1]
    )
    assert ok.result(T).output_ids == ref.generate(prompt, CASES[1][1], 3)


def test_a_text_only_model_refuses_images_by_name(tiny_model):
    engine = EmbeddedEngine(EngineConfig(model_path=tiny_model, max_running_requests=2)).start()
    try:
        with pytest.raises(EngineError, match="image_data: qwen2 has no vision tower"):
            engine.submit("x", [5, 6, 7], SamplingParams(max_new_tokens=2), image_data=[png(8, 8, 0)])
    finally:
        engine.shutdown()
