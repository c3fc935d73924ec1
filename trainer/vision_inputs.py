"""A vision-language policy's forward inputs beyond token ids: each image's pixels for its vision
tower and, for Qwen2-VL, the 3-D rotary positions of each sequence.

The pixels come from the trajectory's own image bytes through the model's image processor, as the
engine made them (``sample_buffer/vision.py``), so the trainer's forward over the recorded tokens
is the engine's: the log-probs equal the engine's (``tests/trainer/test_vision_trainer.py``). A
sequence's positions are computed on it alone, so packing several in a row keeps each one's own;
the vision tower sees the images in the order their placeholders stand in the packed ids.
"""

from __future__ import annotations

import torch

from sample_buffer.vision import Vision, content_hash

_CACHE_BYTES = 1 << 30  # pixels kept between forwards (a step forwards each image several times)


class VisionInputs:
    def __init__(self, model, model_path: str) -> None:
        self.vision = Vision(model_path, model.config)
        self.mrope = hasattr(model.model, "get_rope_index")  # Qwen2-VL; LLaVA's positions are 1-D
        self._pixels: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._cached_bytes = 0

    def _of(self, raw: bytes) -> tuple[torch.Tensor, torch.Tensor | None]:
        key = content_hash(raw)
        if key not in self._pixels:
            px = self.vision.pixels([raw])
            size = px["pixel_values"].numel() * px["pixel_values"].element_size()
            if self._cached_bytes + size > _CACHE_BYTES:  # a new step's images: start over
                self._pixels.clear()
                self._cached_bytes = 0
            self._pixels[key] = (px["pixel_values"], px.get("image_grid_thw"))
            self._cached_bytes += size
        return self._pixels[key]

    def _positions(self, model, seq, grids: list[torch.Tensor]) -> torch.Tensor:
        """[3, n]: Qwen2-VL's rotary positions of one sequence, its images' grids in order."""
        ids = torch.as_tensor(seq, dtype=torch.long)[None]
        if not grids:
            return torch.arange(ids.shape[1])[None].expand(3, -1)
        kinds = (ids == self.vision.image_token_id).int()
        grid = torch.cat(grids)
        expected = sum(self.vision.tokens_per_image({"image_grid_thw": grid}))
        if int(kinds.sum()) != expected:  # a sampled placeholder: the rollout drops such members
            raise ValueError(f"a sequence holds {int(kinds.sum())} image tokens, its images make {expected}")
        pos, _ = model.model.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=grid)
        return pos[:, 0].cpu()

    def inputs(self, model, seqs: list, images: list, places: dict, shape, device, dtype) -> dict:
        """Extra forward inputs for ``seqs`` laid out in ids of ``shape`` [rows, columns], sequence i
        from ``places[i]`` = (row, column) on, with ``images[i]`` its encoded images. Empty when
        none of them has an image (text alone needs nothing more)."""
        if not any(images):
            return {}
        order = sorted(places, key=lambda i: places[i])  # how the images' placeholders come in the ids
        pixels = {i: [self._of(raw) for raw in images[i]] for i in order}
        out = {"pixel_values": torch.cat([p for i in order for p, _ in pixels[i]]).to(device, dtype)}
        if self.mrope:
            grids = {i: [g for _, g in pixels[i]] for i in order}
            out["image_grid_thw"] = torch.cat([g for i in order for g in grids[i]]).to(device)
            positions = torch.zeros(3, *shape, dtype=torch.long)
            for i in order:
                r, c = places[i]
                positions[:, r, c : c + len(seqs[i])] = self._positions(model, seqs[i], grids[i])
            out["position_ids"] = positions.to(device)
        return out


def split_vision_parameters(model) -> tuple[list, list]:
    """(the vision tower's and projector's parameters, the language model's): everything of a
    vision-language model outside its ``language_model`` and ``lm_head`` sees pixels first."""
    tower, language = [], []
    for name, p in model.named_parameters():
        (language if ".language_model." in f".{name}" or name.startswith("lm_head") else tower).append(p)
    if not tower or not language:  # another layout than Qwen2-VL's and LLaVA's: say so, do not guess
        raise ValueError("trainer.vision_lr: this model's vision tower is not found apart from its language_model")
    return tower, language
