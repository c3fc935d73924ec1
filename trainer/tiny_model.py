"""A tiny Qwen2-architecture causal LM (or a Qwen3-MoE or Qwen2-VL one), built locally so nothing is downloaded.

The output is a standard Hugging Face directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` with a chat template), so every engine and the
trainer load it with ``from_pretrained`` exactly as they would load a real checkpoint.

The tokenizer is byte level with no merges: one token per byte plus the chat special tokens (and,
for Qwen2-VL, its vision tokens; the image processor's ``preprocessor_config.json`` beside them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2-VL's: an image is <|vision_start|><|image_pad|>...<|vision_end|>, one pad per merged patch.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LLAVA_IMAGE_TOKEN = "<image>"  # LLaVA's: one per patch
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# Qwen's ChatML layout; ``add_generation_prompt`` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


VISION_ARCHS = ("qwen2-vl", "llava")  # the archs with a vision tower


class TinyModelConfig(BaseModel):
    """Shape of the tiny model. Defaults give about 0.9 M parameters."""

    model_config = ConfigDict(extra="forbid")

    arch: Literal["qwen2", "qwen3-moe", "qwen2-vl", "llava"] = Field(
        "qwen2",
        description="qwen2 (dense), qwen3-moe: every layer's MLP a mixture of experts, qwen2-vl: the "
        "dense decoder with Qwen2-VL's vision tower and 3-D rotary positions, or llava: a CLIP vision "
        "tower and a projector in front of a Llama decoder.",
    )
    hidden_size: int = Field(128, ge=16, description="Width of the residual stream.")
    intermediate_size: int = Field(384, ge=16, description="Width of the MLP.")
    num_hidden_layers: int = Field(4, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, description="Key/value heads (GQA).")
    max_position_embeddings: int = Field(1024, ge=32, description="Context length in tokens.")
    vocab_size: int | None = Field(
        None,
        ge=1,
        description="Rows of the embedding; default: the tokenizer's. Larger only shapes the model "
        "like a real one (its tokens past the tokenizer's are never produced by it).",
    )
    num_experts: int = Field(8, ge=2, description="qwen3-moe: experts per layer.")
    num_experts_per_tok: int = Field(2, ge=1, description="qwen3-moe: experts each token is routed to (top-k).")
    moe_intermediate_size: int = Field(
        96, ge=8, description="qwen3-moe: width of each expert's MLP (8 × 96 × top-2: about the dense MLP's work)."
    )
    vision_depth: int = Field(2, ge=1, description="qwen2-vl: vision transformer blocks.")
    vision_embed_dim: int = Field(32, ge=8, description="qwen2-vl: width of the vision tower.")
    patch_size: int = Field(
        4,
        ge=1,
        description="Vision models: pixels per patch side (the real ones' 14; 4 suits images of tens of pixels).",
    )
    image_max_pixels: int = Field(
        64 * 64, ge=64, description="qwen2-vl: larger images are resized down to about this many pixels."
    )
    image_size: int = Field(
        28, ge=4, description="llava: every image is resized and cropped to this square (one token per patch)."
    )
    seed: int = Field(0, description="Seed of the random initialisation.")
    digit_prior_steps: int = Field(
        0, ge=0, description="Steps of format-only warm-up (answer with one digit; see trainer/format_prior.py)."
    )
    glyph_prior_steps: int = Field(
        0,
        ge=0,
        description="Vision models: steps of learning to name the letter in a picture, before the digit "
        "prior: a tower that reads shapes, as a pretrained one does, and knows no digit (trainer/format_prior.py).",
    )

    @model_validator(mode="after")
    def _glyphs_need_eyes(self) -> TinyModelConfig:
        if self.glyph_prior_steps and self.arch not in VISION_ARCHS:
            raise ValueError(f"glyph_prior_steps: arch {self.arch} has no vision tower to teach")
        return self


def build_tokenizer(vision: bool = False):
    """A byte-level BPE tokenizer with no merges, built with the ``tokenizers`` library (``vision``:
    with Qwen2-VL's vision tokens after the chat ones).

    It has the same pipeline as Qwen2's tokenizer (ByteLevel, digits split one by one), which
    matters because ``AutoTokenizer`` rebuilds a Qwen2 tokenizer from ``tokenizer.json``'s
    vocab and merges. With no merges every byte is one token: digits and single characters
    are single tokens, which the quickstart's verifiable tasks rely on.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda c: _byte_of(c))
    special = SPECIAL_TOKENS + (VISION_TOKENS if vision else [])
    vocab = {tok: i for i, tok in enumerate(special + byte_chars)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(special)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def _byte_of(char: str) -> int:
    """The byte a ByteLevel alphabet character stands for (GPT-2's bytes_to_unicode inverse)."""
    code = ord(char)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def build_tiny_model(out_dir: str | Path, cfg: TinyModelConfig | None = None, pictures=None) -> Path:
    """Write a randomly initialised tiny Qwen2 (or Qwen3-MoE, or Qwen2-VL) model and its tokenizer to
    ``out_dir``. ``pictures``: ``(glyph, rng) -> (png, question)``, the pictures of a vision-language
    model's priors (``rollout/envs/digit_pictures.py``'s, passed by ``rollmesh init-model``)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3MoeConfig

    cfg = cfg or TinyModelConfig()
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ValueError(
            f"hidden_size={cfg.hidden_size} must be a multiple of num_attention_heads={cfg.num_attention_heads}"
        )
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} must be a multiple of "
            f"num_key_value_heads={cfg.num_key_value_heads}"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vision = cfg.arch in VISION_ARCHS
    tokenizer = build_tokenizer(cfg.arch == "qwen2-vl")
    if cfg.arch == "llava":
        tokenizer.add_special_tokens({"additional_special_tokens": [LLAVA_IMAGE_TOKEN]})
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    if cfg.vocab_size is not None and cfg.vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size={cfg.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds num_experts={cfg.num_experts}")
    moe = (
        dict(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=True,
            head_dim=cfg.hidden_size // cfg.num_attention_heads,
        )
        if cfg.arch == "qwen3-moe"
        else {}
    )
    text = dict(
        **moe,
        vocab_size=cfg.vocab_size or len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    if cfg.arch == "qwen2-vl":
        hf_cfg = _qwen2_vl_config(cfg, text, tokenizer)
    elif cfg.arch == "llava":
        hf_cfg = _llava_config(cfg, text, tokenizer)
    else:
        hf_cfg = (Qwen3MoeConfig if cfg.arch == "qwen3-moe" else Qwen2Config)(**text)
    torch.manual_seed(cfg.seed)
    if vision:
        from transformers import AutoModelForImageTextToText

        model = AutoModelForImageTextToText.from_config(hf_cfg)
    else:
        model = AutoModelForCausalLM.from_config(hf_cfg)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    if vision:  # the image processor first: the prior's pictures go through it
        (_qwen2_vl_image_processor if cfg.arch == "qwen2-vl" else _llava_image_processor)(cfg).save_pretrained(out)
    seeing = {}
    if vision and (cfg.digit_prior_steps or cfg.glyph_prior_steps):
        from sample_buffer.vision import Vision

        seeing = {"vision": Vision(out, hf_cfg), "pictures": pictures}
    if cfg.glyph_prior_steps:
        from trainer.format_prior import prime_glyph_reading

        prime_glyph_reading(model, tokenizer, cfg.glyph_prior_steps, seed=cfg.seed, **seeing)
    if cfg.digit_prior_steps:
        from trainer.format_prior import prime_digit_format

        prime_digit_format(model, tokenizer, cfg.digit_prior_steps, seed=cfg.seed, **seeing)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


MERGE_SIZE = 2  # Qwen2-VL merges 2 × 2 patches into one image token


def _qwen2_vl_config(cfg: TinyModelConfig, text: dict, tokenizer):
    from transformers import Qwen2VLConfig

    head_dim = cfg.hidden_size // cfg.num_attention_heads
    if head_dim % 8:
        raise ValueError(f"qwen2-vl: hidden_size / num_attention_heads = {head_dim} must be a multiple of 8")
    # 3-D rotary positions: of the head's rotary pairs, a quarter turn with time, 3/8 each with height, width
    half = head_dim // 2
    section = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]
    text = {k: v for k, v in text.items() if k != "torch_dtype"}
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section}
    ids = tokenizer.convert_tokens_to_ids
    return Qwen2VLConfig(
        text_config=text,
        vision_config=dict(
            depth=cfg.vision_depth,
            embed_dim=cfg.vision_embed_dim,
            hidden_size=cfg.hidden_size,
            num_heads=max(1, cfg.vision_embed_dim // 16),
            mlp_ratio=2,
            patch_size=cfg.patch_size,
            spatial_merge_size=MERGE_SIZE,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
        torch_dtype="float32",
    )


def _qwen2_vl_image_processor(cfg: TinyModelConfig):
    # The PIL implementation: it needs no torchvision, and AutoImageProcessor picks it where torchvision is absent.
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    unit = cfg.patch_size * MERGE_SIZE
    return Qwen2VLImageProcessorPil(
        patch_size=cfg.patch_size,
        temporal_patch_size=2,
        merge_size=MERGE_SIZE,
        size={"shortest_edge": unit * unit, "longest_edge": cfg.image_max_pixels},
    )


def count_parameters(model) -> int:
    """Unique parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


# Shapes of real models, randomly initialised (nothing is downloaded): for benchmarks on a GPU.
SHAPES = {
    "tiny": TinyModelConfig(),
    "qwen2-0.5b": TinyModelConfig(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        vocab_size=151936,
    ),
    # Qwen3-30B-A3B's routing (top-8 of many experts per token, every layer MoE) at about 1 B parameters.
    "qwen3-moe-small": TinyModelConfig(
        arch="qwen3-moe",
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=256,
        max_position_embeddings=4096,
        vocab_size=151936,
    ),
}


def _llava_config(cfg: TinyModelConfig, text: dict, tokenizer):
    from transformers import LlavaConfig

    if cfg.image_size % cfg.patch_size:
        raise ValueError(f"llava: image_size {cfg.image_size} must be a multiple of patch_size {cfg.patch_size}")
    text = {k: v for k, v in text.items() if k != "torch_dtype"} | {"model_type": "llama"}
    return LlavaConfig(
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=cfg.vision_embed_dim,
            intermediate_size=2 * cfg.vision_embed_dim,
            num_hidden_layers=cfg.vision_depth,
            num_attention_heads=max(1, cfg.vision_embed_dim // 16),
            image_size=cfg.image_size,
            patch_size=cfg.patch_size,
        ),
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        vision_feature_select_strategy="default",  # the patches' features, not the CLS token's
        vision_feature_layer=-1,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )


def _llava_image_processor(cfg: TinyModelConfig):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    side = cfg.image_size
    return CLIPImageProcessorPil(size={"shortest_edge": side}, crop_size={"height": side, "width": side})
