"""The quickstart's idea with pixels: a small picture of one digit, and the question "which digit?".

Each picture draws its digit dark on light, in two sizes, regular or bold, near the centre (up to
2 pixels off each way), in random shades, with light pixel noise or none and, half the time, a
short stroke of clutter: a model must read the digit's shape, not its bytes. (A first set, with
four sizes anywhere in the picture, both polarities and heavier noise, took a small CNN 400
supervised steps to reach 0.64, and the tiny tower none to leave chance.) Rows carry the
picture as a PNG data URL in ``images`` (``rollout/envs/single_turn.py`` shows it to the model);
the same seed makes the same rows, another seed others (a held-out set: pictures never trained on).
"""

from __future__ import annotations

import io
import random

from sample_buffer.vision import data_url

SIDE = 28  # pixels a side, as MNIST's
QUESTION = "Which digit?"  # short: the answer's attention is not spread over many words
LETTER_QUESTION = "Which letter?"  # a glyph prior's (trainer/format_prior.py): shapes, never digits
FONT_SIZES = (21, 24)
STROKES = (0, 1)  # regular and bold
JITTER = 2  # pixels the digit may stand off the centre, each way
NOISE = (0, 8)  # standard deviations of the pixel noise


def picture(digit: int | str, rng: random.Random) -> bytes:
    """One PNG of ``digit`` (or of any one character), its style drawn from ``rng``."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default(size=rng.choice(FONT_SIZES))
    stroke = rng.choice(STROKES)
    ink, paper = rng.randint(0, 80), rng.randint(170, 255)
    img = Image.new("L", (SIDE, SIDE), paper)
    draw = ImageDraw.Draw(img)
    left, top, right, bottom = draw.textbbox((0, 0), str(digit), font=font, stroke_width=stroke)
    w, h = right - left, bottom - top
    x = (SIDE - w) // 2 - left + rng.randint(-JITTER, JITTER)
    y = (SIDE - h) // 2 - top + rng.randint(-JITTER, JITTER)
    draw.text((x, y), str(digit), fill=ink, font=font, stroke_width=stroke, stroke_fill=ink)
    if rng.random() < 0.5:  # clutter: a short stroke that is not the digit
        x0, y0 = rng.randint(0, SIDE - 1), rng.randint(0, SIDE - 1)
        draw.line((x0, y0, x0 + rng.randint(-5, 5), y0 + rng.randint(-5, 5)), fill=ink, width=1)
    noise = np.random.default_rng(rng.getrandbits(32)).normal(0, rng.choice(NOISE), (SIDE, SIDE))
    pixels = np.clip(np.asarray(img, dtype=np.float32) + noise, 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "L").convert("RGB").save(out, format="PNG")
    return out.getvalue()


def prior_prompt(glyph: str, rng: random.Random) -> tuple[bytes, str]:
    """A picture of ``glyph`` (a digit or a letter) and its question, for a vision-language model's
    priors (``trainer/format_prior.py``)."""
    return picture(glyph, rng), QUESTION if glyph.isdigit() else LETTER_QUESTION


def digit_picture_rows(size: int, seed: int) -> list[dict]:
    """``size`` rows ``{"prompt", "answer", "images", "task"}``, the digits balanced."""
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        digit = i % 10
        rows.append(
            {
                "prompt": QUESTION,
                "answer": str(digit),
                "images": [data_url(picture(digit, rng))],
                "task": "digit_pictures",
            }
        )
    rng.shuffle(rows)
    return rows
