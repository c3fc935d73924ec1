"""A format-only prior for the tiny model: answer with one digit, then end the turn.

A pretrained LLM arrives knowing the answer format; a randomly initialised one spends most of a
short RL budget discovering that digits exist, and policy gradient over a 259-token vocabulary
tends to collapse onto whichever digit it found first. This short supervised warm-up teaches
the format and nothing else: prompts are random strings and the target digit is drawn
independently of the prompt, so the prompt carries zero information about the label and the
primed model is still at chance (about 0.1) on any digit task. A vision-language model is primed
on pictures of digits (the caller's ``pictures``: ``rollout/envs/digit_pictures.py`` draws them for
``rollmesh init-model``) whose target is drawn apart from the picture: it learns that a picture's
answer is one digit, not which.

A real vision-language model's tower arrives pretrained: it sees strokes and shapes. A tiny random
one does not, and policy gradient alone, about 13 right answers in 128 at chance, moved it too
slowly (docs/vision.md). ``prime_glyph_reading`` first teaches the tiny tower to read letters, which
are not digits: the model still answers digit pictures at chance, but what it sees carries their shape.
"""

from __future__ import annotations

import random
import string

import torch

from sample_buffer.vision import data_url, image_bytes


def random_prompt(rng: random.Random) -> str:
    """A few letters with one digit among them: shaped like the quickstart's prompts. The label is
    drawn independently, so this teaches that an answer is one digit, not which one."""
    letters = [rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 5))]
    letters.insert(rng.randint(0, len(letters)), str(rng.randint(0, 9)))
    return "".join(letters)


def prime_digit_format(
    model, tokenizer, steps: int, seed: int = 0, batch: int = 64, lr: float = 1e-3, vision=None, pictures=None
) -> float:
    """Train ``model`` for ``steps`` on chat-rendered random prompts -> one random digit.

    No end-of-turn token is trained after the digit: with tied embeddings that pulled every
    digit's embedding towards EOS and left RL unable to learn to copy digits (measured: held-out
    stuck at 0.12 vs 0.7 after 200 steps). Tasks using this prior answer in one token
    (``max_new_tokens: 1``).

    ``vision``: the model's ``sample_buffer.vision.Vision``, and ``pictures``: ``(glyph, rng) ->
    (png bytes, question)``: prompts are then a picture and its question.

    Returns the last loss (about ln 10 + small when the format is learned and nothing else).
    """
    if vision is not None and pictures is None:
        raise ValueError("digit_prior_steps: a vision-language model is primed on pictures; none were given")
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)]

    def example(rng: random.Random) -> tuple[str, str | None, int]:
        if vision is None:
            return random_prompt(rng), None, rng.choice(digits)
        png, question = pictures(str(rng.randint(0, 9)), rng)  # drawn apart from the target: no information
        return question, data_url(png), rng.choice(digits)

    groups = [{"params": list(model.parameters()), "lr": lr}]
    return _supervise(model, tokenizer, steps, example, groups, random.Random(seed), batch, vision)


def prime_glyph_reading(
    model, tokenizer, steps: int, vision, pictures, seed: int = 0, batch: int = 64, lr: float = 3e-4, vision_lr=3e-3
) -> float:
    """Train a vision-language ``model`` for ``steps`` to name the letter in a picture (a-z, drawn as
    ``pictures(letter, rng)`` draws them): its tower learns to read strokes, as a pretrained one
    arrives knowing, and nothing about digits. The tower at ``vision_lr``, the rest at ``lr``: at one
    rate the language model settled on the labels' marginal before the tower's signal reached it.
    Returns the last loss (ln 26 = 3.26 at chance)."""
    from trainer.vision_inputs import split_vision_parameters

    letters = string.ascii_lowercase

    def example(rng: random.Random) -> tuple[str, str | None, int]:
        letter = rng.choice(letters)
        png, question = pictures(letter, rng)
        return question, data_url(png), tokenizer.convert_tokens_to_ids(letter)

    tower, language = split_vision_parameters(model)
    groups = [{"params": tower, "lr": vision_lr}, {"params": language, "lr": lr}]
    return _supervise(model, tokenizer, steps, example, groups, random.Random(seed), batch, vision)


def _supervise(model, tokenizer, steps: int, example, groups: list[dict], rng: random.Random, batch: int, vision):
    """``steps`` of AdamW on batches of ``example(rng) -> (text, picture data URL or None, target)``:
    the chat-rendered prompt (its picture's placeholder first), then the one target token."""
    pad = tokenizer.pad_token_id
    opt = torch.optim.AdamW(groups)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        rows, labels, drawn = [], [], []
        for _ in range(batch):
            text, picture, target = example(rng)
            if picture is not None:
                drawn.append(picture)
                text = vision.placeholder + text
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            if picture is not None:
                ids = vision.prompt(ids, [picture]).input_ids
            rows.append(ids + [target])
            labels.append([-100] * len(ids) + [target])
        width = max(map(len, rows))
        # Right padding: positions are plain 0..n-1 and padded labels are ignored.
        x = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
        y = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
        mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]).long()
        loss = model(input_ids=x, attention_mask=mask, labels=y, **_pixels(vision if drawn else None, drawn, x)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


def _pixels(vision, pictures: list[str], ids: torch.Tensor) -> dict:
    """The batch's pictures for the vision tower (Qwen2-VL also wants where they stand, for its positions)."""
    if vision is None:
        return {}
    out = vision.pixels([image_bytes(x) for x in pictures])
    if "image_grid_thw" in out:
        out["mm_token_type_ids"] = (ids == vision.image_token_id).int()
    return out
