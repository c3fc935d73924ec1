"""Compact binary encoding of a ``Group``: what travels over gRPC and sits in Redis.

Layout: ``[format version: 1 byte][flags: 1 byte][header length: u32 LE][header][body]``.
The header is a small msgpack map (group id, prompt id, start version, rewards, size, domain) so the
buffer can apply freshness and filtering without decoding the trajectories. The body is msgpack
with every array as raw little-endian bytes, optionally zlib-compressed (flag bit 0). Encoding
is a handful of memory copies; the same bytes go from the EnvManager to Redis to the trainer.
"""

from __future__ import annotations

import struct
import time
import zlib
from dataclasses import dataclass

import msgpack
import numpy as np

from sample_buffer import routing
from sample_buffer.trajectory import DOMAIN_NAME, MAX_TEACHER_TOP_K, Group, Trajectory, TrajectoryError

FORMAT_VERSION = 1
_FLAG_ZLIB = 1
_PREFIX = struct.Struct("<BBI")
# A compressed body inflates at most this much, and never beyond MAX_BODY_BYTES: token ids, masks
# and log-probs compress 2-5x at level 1, while a zlib bomb does 1000x (611 KB on the wire took the
# buffer to 2.7 GB before this bound).
MAX_INFLATION = 64
MAX_BODY_BYTES = 256 << 20


class CodecError(ValueError):
    """Bytes that are not an encoded group of a known format version."""


@dataclass(frozen=True)
class GroupHeader:
    group_id: str
    prompt_id: str
    start_version: int
    rewards: tuple[float, ...]
    size: int
    created_unix_s: float  # when the group was encoded: its age in the buffer is measured from here
    domain: str = ""  # the task domain ("": a run of one task); the buffer assembles batches by it
    images: int = 0  # distinct images its trajectories reference (vision-language prompts)
    taught: bool = False  # a teacher scored its tokens: the zero-variance filter keeps it


def _arr(a: np.ndarray | None, dtype) -> bytes | None:
    return None if a is None else np.ascontiguousarray(a, dtype=np.dtype(dtype).newbyteorder("<")).tobytes()


def _routing(a: np.ndarray | None) -> list | None:
    return None if a is None else [_arr(a, a.dtype), a.shape[1], a.dtype.itemsize]


def _routing_of(field) -> np.ndarray | None:
    """``[bytes, width, itemsize]`` back as the ``[P, width]`` array (``sample_buffer/routing.py``)."""
    if field is None:
        return None
    data, width, itemsize = field
    return routing.from_bytes(data, width, itemsize)  # RoutingError is a ValueError: corrupt


def _top(t: Trajectory) -> list | None:
    """A teacher's top-k tables as ``[ids, log-probs, k]``."""
    if t.teacher_top_ids is None:
        return None
    return [_arr(t.teacher_top_ids, np.int32), _arr(t.teacher_top_logprobs, np.float32), t.teacher_top_ids.shape[1]]


def _top_of(field) -> tuple[np.ndarray | None, np.ndarray | None]:
    if field is None:
        return None, None
    ids, lps, k = field
    ids, lps = np.frombuffer(ids, dtype="<i4"), np.frombuffer(lps, dtype="<f4")
    if not isinstance(k, int) or not 1 <= k <= MAX_TEACHER_TOP_K or len(ids) % k or len(ids) != len(lps):
        raise CodecError(f"teacher top-k: {len(ids)} ids and {len(lps)} log-probs are no table of {k} a row")
    return ids.reshape(-1, k), lps.reshape(-1, k)


def _optional(t: Trajectory) -> list:
    """A row's trailing fields, each written only where it or a later one is present: [routing,
    images, teacher log-probs, teacher top-k]."""
    fields = [_routing(t.routed_experts), list(t.images), _arr(t.teacher_logprobs, np.float32), _top(t)]
    present = [t.routed_experts is not None, bool(t.images), t.teacher_logprobs is not None]
    present.append(t.teacher_top_ids is not None)
    return fields[: max((i + 1 for i, p in enumerate(present) if p), default=0)]


def encode_group(group: Group, compress: bool = False) -> bytes:
    header = msgpack.packb(
        {
            "g": group.group_id,
            "p": group.prompt_id,
            "v": group.start_version,
            "r": group.rewards,
            "n": len(group.trajectories),
            "t": time.time(),
        }
        | ({"d": group.domain} if group.domain else {})  # written only where there is one: old bytes read alike
        | ({"i": len(group.images)} if group.images else {})  # the body is then [rows, images]: a reader
        # older than images refuses such a group as corrupt (by name), never misreads it
        | ({"k": 1} if group.taught else {})
    )
    rows = [
        [
            t.trajectory_id,
            t.prompt_id,
            _arr(t.token_ids, np.int32),
            _arr(t.loss_mask, np.int8),
            _arr(t.behavior_logprobs, np.float32),
            _arr(t.token_versions, np.int32),
            t.reward,
            t.start_version,
            t.finish_reason,
            _arr(t.token_rewards, np.float32),
            t.metadata,
        ]
        + _optional(t)  # old readers never see these
        for t in group.trajectories
    ]
    body = msgpack.packb([rows, group.images] if group.images else rows)
    flags = 0
    if compress:
        body, flags = zlib.compress(body, 1), _FLAG_ZLIB
    return _PREFIX.pack(FORMAT_VERSION, flags, len(header)) + header + body


def _split(data: bytes) -> tuple[int, bytes, memoryview]:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CodecError(f"expected bytes, got {type(data).__name__}")
    if len(data) < _PREFIX.size:
        raise CodecError(f"payload of {len(data)} bytes is too short to be an encoded group")
    version, flags, hlen = _PREFIX.unpack_from(data)
    if version != FORMAT_VERSION:
        raise CodecError(f"unknown group format version {version} (this build reads {FORMAT_VERSION})")
    if _PREFIX.size + hlen > len(data):
        raise CodecError(f"header length {hlen} runs past the end of the {len(data)}-byte payload")
    view = memoryview(data)
    return flags, bytes(view[_PREFIX.size : _PREFIX.size + hlen]), view[_PREFIX.size + hlen :]


def read_header(data: bytes) -> GroupHeader:
    """The group's header without decoding its trajectories."""
    _, header, _ = _split(data)
    try:
        h = msgpack.unpackb(header)
        rewards = tuple(float(r) for r in h["r"])
        domain = str(h.get("d", ""))
        if not DOMAIN_NAME.fullmatch(domain):  # it names a Redis key and a metric's label
            raise ValueError(f"domain {domain[:80]!r} is not a domain name")
        return GroupHeader(
            str(h["g"]),
            str(h["p"]),
            int(h["v"]),
            rewards,
            int(h["n"]),
            float(h["t"]),
            domain,
            int(h.get("i", 0)),
            bool(h.get("k", 0)),
        )
    except (ValueError, KeyError, TypeError, OverflowError, AttributeError, msgpack.UnpackException) as e:
        raise CodecError(f"corrupt group header: {type(e).__name__}: {e}") from None


def _inflate(body: memoryview) -> bytes:
    """The body decompressed, refused as soon as it grows past its bound (never inflated in full)."""
    limit = min(MAX_INFLATION * len(body), MAX_BODY_BYTES)
    inflater = zlib.decompressobj()
    raw = inflater.decompress(body, limit)
    if inflater.unconsumed_tail or not inflater.eof:
        raise CodecError(
            f"compressed body of {len(body)} bytes inflates past {limit} bytes ({MAX_INFLATION}x, at most "
            f"{MAX_BODY_BYTES >> 20} MiB) or is truncated: refused"
        )
    return raw


def decode_group(data: bytes, validate: bool = True) -> Group:
    """The group back; ``validate=False`` skips the trajectories' checks (the buffer checked these
    bytes when they were put, so the trainer does not again)."""
    flags, _, body = _split(data)
    head = read_header(data)
    try:
        raw = _inflate(body) if flags & _FLAG_ZLIB else body
        rows, images = msgpack.unpackb(raw), {}
        if head.images:
            rows, images = rows
            if not isinstance(images, dict) or len(images) != head.images:
                raise CodecError(f"group {head.group_id!r}: header says {head.images} images, body has another count")
        trajs = [
            Trajectory(
                trajectory_id=r[0],
                group_id=head.group_id,
                prompt_id=r[1],
                token_ids=np.frombuffer(r[2], dtype="<i4"),
                loss_mask=np.frombuffer(r[3], dtype="<i1"),
                behavior_logprobs=np.frombuffer(r[4], dtype="<f4"),
                token_versions=np.frombuffer(r[5], dtype="<i4"),
                reward=r[6],
                start_version=r[7],
                finish_reason=r[8],
                token_rewards=None if r[9] is None else np.frombuffer(r[9], dtype="<f4"),
                metadata=r[10],
                routed_experts=_routing_of(r[11]) if len(r) > 11 else None,
                images=tuple(r[12]) if len(r) > 12 else (),
                teacher_logprobs=np.frombuffer(r[13], dtype="<f4") if len(r) > 13 and r[13] is not None else None,
                teacher_top_ids=(top := _top_of(r[14] if len(r) > 14 else None))[0],
                teacher_top_logprobs=top[1],
                check=validate,
            )
            for r in rows
        ]
    except CodecError:
        raise
    except TrajectoryError as e:
        raise CodecError(f"decoded group {head.group_id!r} is invalid: {e}") from None
    except (ValueError, TypeError, IndexError, OverflowError, zlib.error, msgpack.UnpackException) as e:
        raise CodecError(f"corrupt group body: {type(e).__name__}: {e}") from None
    if len(trajs) != head.size:
        raise CodecError(f"group {head.group_id!r}: header says {head.size} trajectories, body has {len(trajs)}")
    try:
        group = Group(head.group_id, head.prompt_id, trajs, head.domain, images)
    except TrajectoryError as e:  # no trajectories
        raise CodecError(f"decoded group {head.group_id!r} is invalid: {e}") from None
    # The buffer sorts and filters on the header alone: one that disagrees with the trajectories would
    # pass a stale group as fresh, or a group without learning signal through the filter.
    if validate and (head.start_version, head.rewards, head.taught) != (
        group.start_version,
        tuple(group.rewards),
        group.taught,
    ):
        raise CodecError(
            f"group {head.group_id!r}: header (start_version {head.start_version}, rewards "
            f"{list(head.rewards)}, taught {head.taught}) disagrees with its trajectories ({group.start_version}, "
            f"{group.rewards}, {group.taught})"
        )
    return group
