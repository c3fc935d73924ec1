"""Images in prompts: what an image is on the wire, how a prompt's image placeholders expand, and
which model class a checkpoint loads with. The engines, the rollout and the trainer all use these,
so the token ids a trajectory records are the ones the engine consumed.

An image travels as SGLang's ``image_data`` item: a data URL (``data:image/png;base64,...``) or bare
base64 of an encoded image (PNG, JPEG, WebP, GIF). URLs and paths are refused: nothing downloads,
and nothing is read from where a caller points. Its size is checked before it is decoded (bytes),
and again from its header before its pixels are (width × height).

A prompt holds one placeholder token per image, where the image goes, as SGLang and vLLM take it
(``<|vision_start|><|image_pad|><|vision_end|>`` for Qwen2-VL, ``<image>`` for LLaVA); the model's
processor says how many tokens the image becomes, and ``expand`` repeats the placeholder that many
times: the ids the language model reads.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

MAX_IMAGE_BYTES = 4 << 20  # an encoded image, as sent
MAX_REQUEST_IMAGE_BYTES = 6 << 20  # a request's images together: within the LLMProxy's 8 MiB message beside the ids
MAX_IMAGE_PIXELS = 4096 * 4096  # width × height, read from the header before the pixels are decoded
MAX_REQUEST_PIXELS = 4 * MAX_IMAGE_PIXELS  # a request's images together: 16 small solid-colour PNGs decode huge
MAX_IMAGES = 16  # per request
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what is decoded; Pillow's other formats (EPS runs Ghostscript) are not


class VisionError(ValueError):
    """Bad image input; the message names the field, as the engines' errors do."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def image_bytes(item: str, field: str = "image_data", max_bytes: int = MAX_IMAGE_BYTES) -> bytes:
    """The encoded image an ``image_data`` item carries (a data URL or bare base64)."""
    if not isinstance(item, str):
        raise VisionError(field, f"an image is a base64 string or a data URL, got {type(item).__name__}")
    if item.startswith("data:"):
        head, sep, item = item.partition(",")
        if not sep or not head.endswith(";base64") or not head[5:].startswith("image/"):
            raise VisionError(field, f"a data URL must be data:image/<type>;base64,..., got {head[:40]!r}")
    elif item.startswith(("http://", "https://", "file:")):  # a path is not base64: refused below, never opened
        raise VisionError(field, "URLs are refused: send the image itself (base64 or a data URL)")
    if len(item) > 4 * (max_bytes // 3 + 1):  # before decoding: base64 is 4/3 of the bytes
        raise VisionError(field, f"image over {max_bytes} bytes")
    try:
        return base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError) as e:
        raise VisionError(field, f"not base64: {e}") from None


def _header(raw: bytes, field: str, max_pixels: int):
    """The image opened, its header read (nothing decoded yet), its size checked."""
    from PIL import Image

    try:
        img = Image.open(io.BytesIO(raw), formats=FORMATS)
        width, height = img.size
    except Exception as e:  # whatever Pillow raises on bytes that are not an image of FORMATS
        raise VisionError(field, f"not a readable {'/'.join(FORMATS)} image: {type(e).__name__}: {e}") from None
    if width * height > max_pixels:
        raise VisionError(field, f"image of {width}×{height} pixels is over {max_pixels}")
    return img


def check_image(raw: bytes, field: str = "image_data") -> bytes:
    """``raw`` if its header reads as an image of a decoded format within the pixel limit (no pixel decoded)."""
    _header(raw, field, MAX_IMAGE_PIXELS)
    return raw


def open_images(raws: list[bytes], field: str = "image_data", max_pixels: int = MAX_IMAGE_PIXELS) -> list:
    """RGB PIL images from encoded bytes. Every header is read and the sizes checked (each, and all
    together) before any pixel is decoded; corrupt data or too many pixels is a ``VisionError``."""
    headers = [_header(r, f"{field}[{i}]", max_pixels) for i, r in enumerate(raws)]
    total = sum(img.size[0] * img.size[1] for img in headers)
    if total > MAX_REQUEST_PIXELS:
        raise VisionError(field, f"{total} pixels in {len(raws)} images; at most {MAX_REQUEST_PIXELS} per request")
    out = []
    for i, img in enumerate(headers):
        try:
            img.load()
            out.append(img.convert("RGB"))
        except Exception as e:  # truncated or corrupt past the header
            raise VisionError(f"{field}[{i}]", f"not a readable image: {type(e).__name__}: {e}") from None
    return out


_MAGIC = ((b"\x89PNG", "png"), (b"\xff\xd8", "jpeg"), (b"GIF8", "gif"), (b"RIFF", "webp"))


def data_url(raw: bytes) -> str:
    """Encoded image bytes as a data URL, its type read from the bytes' signature (PNG if unknown)."""
    kind = next((k for magic, k in _MAGIC if raw.startswith(magic)), "png")
    return f"data:image/{kind};base64," + base64.b64encode(raw).decode()


def content_hash(raw: bytes) -> str:
    """An image's identity where trajectories reference it: the sha256 of its encoded bytes."""
    return hashlib.sha256(raw).hexdigest()


def is_vision_model(model_dir: str | Path) -> bool:
    """Whether a checkpoint's ``config.json`` describes a vision-language model."""
    path = Path(model_dir) / "config.json"
    return path.exists() and "vision_config" in json.loads(path.read_text())


def vision_of(model_dir: str | Path) -> Vision | None:
    """A checkpoint's image processing and placeholder rule; None for a text-only model."""
    if not is_vision_model(model_dir):
        return None
    from transformers import AutoConfig

    return Vision(model_dir, AutoConfig.from_pretrained(str(model_dir), local_files_only=True))


def model_class(model_dir: str | Path):
    """The transformers auto class a checkpoint loads with: image-text-to-text for a vision-language
    model (its ``lm_head`` over the language model, the vision tower beside it), causal LM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(model_dir) else AutoModelForCausalLM


@dataclass(frozen=True)
class VisionPrompt:
    """A prompt with its images, as the language model reads it."""

    input_ids: list[int]  # placeholders expanded
    pixel_values: object  # torch.Tensor: what the vision tower takes, every image's rows concatenated
    image_grid_thw: object | None  # torch.Tensor [images, 3] (Qwen2-VL), None (LLaVA)
    hashes: tuple[str, ...]  # each image's content hash, in prompt order


@dataclass(frozen=True)
class PromptImage:
    """An image measured for a prompt: its bytes, its content hash and how many tokens it becomes."""

    raw: bytes
    hash: str
    tokens: int


class Vision:
    """A vision-language checkpoint's image processor and placeholder rule."""

    def __init__(self, model_dir: str | Path, hf_config) -> None:
        from transformers import AutoImageProcessor

        self.kind = hf_config.model_type
        if self.kind not in ("qwen2_vl", "llava"):  # the families tested (tests/rollout/test_engine_vision.py)
            raise VisionError("model_path", f"{self.kind}: images are served for qwen2_vl and llava")
        self.image_token_id = int(hf_config.image_token_id if self.kind != "llava" else hf_config.image_token_index)
        self.processor = AutoImageProcessor.from_pretrained(str(model_dir))
        self.merge = int(getattr(self.processor, "merge_size", 1) or 1)  # Qwen2-VL: patches merged per side
        self.patch = int(hf_config.vision_config.patch_size)  # LLaVA: one token per patch
        # What stands for one image in a prompt's text, before expansion
        self.placeholder = "<image>" if self.kind == "llava" else "<|vision_start|><|image_pad|><|vision_end|>"

    def tokens_per_image(self, inputs: dict) -> list[int]:
        """How many placeholder tokens each image becomes."""
        if self.kind == "llava":  # the "default" feature strategy: the patches, not the CLS token
            pixels = inputs["pixel_values"]
            return [(pixels.shape[-2] // self.patch) * (pixels.shape[-1] // self.patch)] * pixels.shape[0]
        return [int(t * h * w) // (self.merge**2) for t, h, w in inputs["image_grid_thw"].tolist()]

    def prompt(self, input_ids: list[int], images: list[str], field: str = "image_data") -> VisionPrompt:
        """``input_ids`` with one placeholder per image, expanded; the images decoded and processed."""
        if len(images) > MAX_IMAGES:
            raise VisionError(field, f"{len(images)} images; at most {MAX_IMAGES} per request")
        self._check_placeholders(input_ids, len(images), field)  # before anything is decoded
        raw = [image_bytes(x, f"{field}[{i}]") for i, x in enumerate(images)]
        inputs = self.pixels(raw, field)
        ids = self.expand(input_ids, self.tokens_per_image(inputs), field)
        return VisionPrompt(
            ids, inputs["pixel_values"], inputs.get("image_grid_thw"), tuple(content_hash(r) for r in raw)
        )

    def measure(self, raw: list[bytes], field: str = "image_data") -> list[PromptImage]:
        """Encoded images decoded once, to learn how many tokens each becomes (``expand`` then needs
        no pixels: the agent gateway measures a request's images off its event loop)."""
        if len(raw) > MAX_IMAGES:
            raise VisionError(field, f"{len(raw)} images; at most {MAX_IMAGES} per request")
        counts = self.tokens_per_image(self.pixels(raw, field))
        return [PromptImage(r, content_hash(r), n) for r, n in zip(raw, counts, strict=True)]

    def expand(self, input_ids: list[int], counts: list[int], field: str = "image_data") -> list[int]:
        """``input_ids`` with its k-th image placeholder repeated ``counts[k]`` times."""
        self._check_placeholders(input_ids, len(counts), field)
        sizes, ids = iter(counts), []
        for t in input_ids:
            ids += [t] * next(sizes) if t == self.image_token_id else [t]
        return ids

    def _check_placeholders(self, input_ids: list[int], images: int, field: str) -> None:
        placeholders = sum(1 for t in input_ids if t == self.image_token_id)
        if placeholders != images:
            raise VisionError(
                field,
                f"{images} images for {placeholders} image placeholders (token {self.image_token_id}) in "
                "input_ids: one placeholder per image",
            )

    def pixels(self, raw: list[bytes], field: str = "image_data") -> dict:
        """Encoded images → what the vision tower takes: ``pixel_values`` (and Qwen2-VL's
        ``image_grid_thw``), the same for the engine and the trainer."""
        images = open_images(raw, field)
        try:
            return dict(self.processor(images=images, return_tensors="pt"))
        except ValueError as e:  # what the processor cannot take (Qwen2-VL: an aspect ratio over 200)
            raise VisionError(field, f"the image processor refused it: {e}") from None
