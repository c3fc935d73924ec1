"""Which experts each token was routed to in the engine: what a trajectory carries for routing replay.

A mixture-of-experts layer sends each token to its ``top_k`` experts. The engine and the trainer
compute the router's logits with different kernels and precisions, so they can pick different
experts for the same token; the log-prob the engine reported (μ) and the one the trainer computes
(π) then come from different networks. Rollout routing replay (R3: "Stabilizing MoE RL by aligning
training and inference routers") records the engine's choices and has the trainer use them.

A trajectory keeps them as a 2-D array ``[P, L·K]`` in SGLang's layout (``meta_info.routed_experts``
of ``--enable-return-routed-experts``): row p holds, for the token at position p, ``K`` (top_k)
expert ids for each of the model's ``L`` decoder layers, layer-major, a dense layer's left 0. Only
positions a forward pass has seen have a row: a complete trajectory has ``P = len(token_ids) - 1``
(the last token was sampled, never fed back; nothing trains on what it would predict). Ids are
stored in the narrowest unsigned type that holds them (uint8 up to 256 experts, uint16 beyond):
Qwen3-30B-A3B's 48 layers × top-8 cost 384 bytes per token, not the 1,536 of SGLang's int32.
"""

from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass

import numpy as np

ROUTING_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))
_LAYER = re.compile(r"\.layers\.(\d+)\.")


class RoutingError(ValueError):
    """Routing that does not fit its trajectory or model; the message names the field."""


def routing_dtype(max_id: int) -> np.dtype:
    """The narrowest stored type for expert ids up to ``max_id``."""
    if max_id < 256:
        return ROUTING_DTYPES[0]
    if max_id < 65536:
        return ROUTING_DTYPES[1]
    raise RoutingError(f"routed_experts: expert id {max_id} does not fit 16 bits")


def decode_sglang(b64: str, positions: int) -> np.ndarray | None:
    """SGLang's ``meta_info.routed_experts`` (base64 of little-endian int32, ``[positions, layers,
    top_k]`` flattened, no shape sent) as the stored ``[positions, layers × top_k]`` array; None when
    it holds no ids (a request aborted before its first forward: nothing was routed)."""
    try:
        raw = base64.b64decode(b64, validate=True)
    except (ValueError, TypeError) as e:
        raise RoutingError(f"routed_experts: not base64: {e}") from None
    if len(raw) % 4:
        raise RoutingError(f"routed_experts: {len(raw)} bytes are not int32 ids")
    ids = np.frombuffer(raw, dtype="<i4")
    if not ids.size:
        return None
    if positions <= 0:
        raise RoutingError(f"routed_experts: {ids.size} ids for no forwarded position")
    if ids.size % positions:
        raise RoutingError(f"routed_experts: {ids.size} ids are not {positions} positions × layers × top_k")
    return compact(ids, ids.size // positions)


def decode_vllm(b64: str, positions: int) -> np.ndarray | None:
    """vLLM's ``routed_experts`` (``--enable-return-routed-experts``: base64 of a ``.npy`` array
    ``[positions, layers, top_k]``, uint8, uint16 or int32, every decoder layer) as the stored
    ``[positions, layers × top_k]`` array; None when it holds no position. Read without pickle: the
    header's shape must match its bytes, or numpy refuses."""
    try:
        arr = np.load(io.BytesIO(base64.b64decode(b64, validate=True)), allow_pickle=False)
    except (ValueError, TypeError, OSError, EOFError) as e:
        raise RoutingError(f"routed_experts: not a base64 .npy array: {e}") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive
        raise RoutingError("routed_experts: a single .npy array expected, got an archive")
    if arr.ndim != 3 or arr.dtype.kind not in "iu":
        raise RoutingError(
            f"routed_experts: a [positions, layers, top_k] integer array expected, got {arr.shape} {arr.dtype}"
        )
    if not len(arr):
        return None
    if len(arr) != positions:
        raise RoutingError(f"routed_experts: {len(arr)} positions, the tokens forwarded are {positions}")
    return compact(arr, arr.shape[1] * arr.shape[2])


def encode_sglang(routing: np.ndarray) -> str:
    """The stored array as SGLang sends it."""
    return base64.b64encode(routing.astype("<i4").tobytes()).decode()


def from_bytes(data: bytes, width: int, itemsize: int) -> np.ndarray:
    """The stored array from its wire form (the codec's, the LLMProxy's): little-endian unsigned ids
    of ``itemsize`` bytes, ``width`` per position."""
    if itemsize not in (1, 2) or width <= 0:
        raise RoutingError(f"routed_experts: itemsize {itemsize} (1 or 2) and {width} ids per position (> 0)")
    if len(data) % (itemsize * width):
        raise RoutingError(f"routed_experts: {len(data)} bytes are not whole rows of {width} × {itemsize}-byte ids")
    return np.frombuffer(data, dtype="<u1" if itemsize == 1 else "<u2").reshape(-1, width)


def compact(ids: np.ndarray, width: int) -> np.ndarray:
    """Expert ids from an engine (any integer array, ``width`` = layers × top_k per token) as the
    stored ``[P, width]`` array; refuses negative ids and a length that is not whole rows."""
    flat = np.asarray(ids).reshape(-1)
    if width <= 0 or flat.size % width:
        raise RoutingError(f"routed_experts: {flat.size} ids are not whole rows of {width} (layers × top_k)")
    if not flat.size:
        return np.zeros((0, width), dtype=ROUTING_DTYPES[0])
    lo, hi = int(flat.min()), int(flat.max())
    if lo < 0:
        raise RoutingError(f"routed_experts: expert id {lo} is negative")
    return flat.astype(routing_dtype(hi)).reshape(-1, width)


def check(routing: np.ndarray, num_tokens: int) -> None:
    """A trajectory's routing fits its tokens: 2-D, a stored dtype, at most one row per token but the last."""
    if routing.ndim != 2 or routing.dtype not in ROUTING_DTYPES:
        raise RoutingError(
            f"routed_experts: a [positions, layers × top_k] array of uint8 or uint16 expected, "
            f"got shape {routing.shape} {routing.dtype}"
        )
    if len(routing) > max(num_tokens - 1, 0):
        raise RoutingError(
            f"routed_experts: {len(routing)} positions for {num_tokens} tokens (at most {max(num_tokens - 1, 0)}: "
            "the last token is never forwarded)"
        )


def latest(have: np.ndarray | None, new: np.ndarray | None, start: int = 0) -> np.ndarray | None:
    """Routing of a context that was forwarded again: each position's from the latest forward.

    A continuation (a generation resumed after a weight update, an episode's next turn) re-forwards the
    earlier tokens, and every token it samples from then on comes from that forward, its routing of
    the earlier positions included: those rows replace the earlier ones, so the newest tokens' μ is
    reproduced exactly (the older tokens are stale, their π moved anyway). ``new``'s first row is
    position ``start`` (SGLang's ``routed_experts_start_len``): rows before it are kept. No rows (a
    segment aborted before its first forward) change nothing."""
    if new is None or not len(new):
        return have
    held = 0 if have is None else len(have)
    if start > held:
        raise RoutingError(f"routed_experts: positions {held}..{start - 1} are missing (rows begin at {start})")
    if not start:
        return new
    if new.shape[1] != have.shape[1]:
        raise RoutingError(f"routed_experts: {new.shape[1]} ids per token after {have.shape[1]} (another model?)")
    dtype = max(have.dtype, new.dtype, key=lambda d: d.itemsize)
    return np.concatenate([have[:start].astype(dtype, copy=False), new.astype(dtype, copy=False)])


def check_model(routing: np.ndarray, layers: int, top_k: int, num_experts: int) -> None:
    """``routing`` fits a model of ``layers`` decoder layers routing each token to ``top_k`` of
    ``num_experts`` experts (the trainer's check, where the model is known)."""
    if routing.shape[1] != layers * top_k:
        raise RoutingError(
            f"routed_experts: {routing.shape[1]} ids per token; the model has {layers} layers × top-{top_k}"
        )
    if routing.size and int(routing.max()) >= num_experts:
        raise RoutingError(f"routed_experts: expert id {int(routing.max())} >= the model's {num_experts} experts")


@dataclass(frozen=True)
class MoEShape:
    layers: int  # decoder layers (SGLang's routing layout has top_k ids for each)
    moe_layers: tuple[int, ...]  # those with a router
    top_k: int
    num_experts: int

    @property
    def width(self) -> int:
        return self.layers * self.top_k


def routers_of(model) -> dict:
    """A transformers model's MoE routers (modules named ``*TopKRouter``: Qwen2-MoE, Qwen3-MoE, Mixtral,
    OLMoE, ...) by decoder layer index; empty for a dense model."""
    out = {}
    for name, m in model.named_modules():
        if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k"):
            layer = _LAYER.search(f".{name}.")
            if layer is None:
                raise ValueError(f"router {name!r} is not inside a decoder layer (model.layers.N)")
            out[int(layer.group(1))] = m
    return out


def moe_shape(model) -> MoEShape | None:
    """The routing layout of a transformers model (a torch module; None: dense)."""
    routers = routers_of(model)
    if not routers:
        return None
    first = next(iter(routers.values()))
    layers = int(model.config.get_text_config().num_hidden_layers)
    return MoEShape(layers, tuple(sorted(routers)), int(first.top_k), int(first.num_experts))
