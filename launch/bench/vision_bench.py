"""`rollmesh bench vision`: what images cost the mesh's data path, side by side with text alone.

Groups of a vision-language task through the gRPC SampleBuffer backed by Redis (``bench buffer``'s
setup), once text-only and once with each prompt showing one picture: bytes per group, groups per
second, and what a design that copied the picture into every trajectory would carry instead (the
group keeps each image once, referenced by content hash from its trajectories).
"""

from __future__ import annotations

import io


def noise_png(side: int, seed: int = 0) -> bytes:
    """A PNG of random pixels: as large as a picture of that side gets (noise does not compress)."""
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((side, side, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def run(groups: int = 2000, group_size: int = 8, tokens: int = 512, image_side: int = 448, progress=print) -> dict:
    from launch.bench.buffer_bench import run as through_buffer

    image = noise_png(image_side)
    progress(f"text only: {groups} groups of {group_size} × {tokens} tokens")
    text = through_buffer(groups, group_size, tokens)
    progress(f"with a {image_side}×{image_side} picture ({len(image)} bytes) in every prompt")
    seen = through_buffer(groups, group_size, tokens, images=(image,))
    copied = text["payload_bytes"] + group_size * len(image)
    return {
        "groups": groups,
        "group_size": group_size,
        "tokens": tokens,
        "image_bytes": len(image),
        "text_bytes_per_group": text["payload_bytes"],
        "image_bytes_per_group": seen["payload_bytes"],
        "copied_per_trajectory_bytes": copied,
        "bytes_saved_vs_copies": round(copied / seen["payload_bytes"], 2),
        "text_groups_per_s": text["groups_per_s"],
        "image_groups_per_s": seen["groups_per_s"],
        "image_mb_per_s": seen["mb_per_s"],
        "throughput_ratio": round(seen["groups_per_s"] / text["groups_per_s"], 3),
    }
