"""MoE routing as a trajectory carries it: SGLang's encoding read and written, continuations replacing,
refused where it enters when it cannot be a trajectory's, and through the codec unchanged."""

from __future__ import annotations

import base64

import msgpack
import numpy as np
import pytest

from sample_buffer import routing
from sample_buffer.codec import CodecError, decode_group, encode_group
from sample_buffer.trajectory import Group, Trajectory, TrajectoryError


def traj(**kw) -> Trajectory:
    base = dict(
        trajectory_id="g/0",
        group_id="g",
        prompt_id="p",
        token_ids=[1, 2, 3, 4, 5],
        loss_mask=[0, 0, 1, 1, 1],
        behavior_logprobs=[-0.5, -1.0, -0.1],
        token_versions=[0, 0, 0],
        reward=1.0,
        start_version=0,
    )
    return Trajectory(**(base | kw))


def test_sglangs_encoding_round_trips_and_is_stored_narrow():
    ids = np.array([[[0, 7], [3, 1]], [[255, 2], [4, 4]], [[9, 8], [6, 5]]], dtype=np.int32)  # 3 positions
    b64 = base64.b64encode(ids.astype("<i4").tobytes()).decode()
    stored = routing.decode_sglang(b64, positions=3)
    assert stored.dtype == np.uint8 and stored.shape == (3, 4) and (stored.reshape(3, 2, 2) == ids).all()
    assert routing.encode_sglang(stored) == b64
    wide = routing.compact(np.array([[0, 300]]), 2)
    assert wide.dtype == np.uint16
    assert routing.decode_sglang("", positions=12) is None  # aborted before its first forward: nothing routed


@pytest.mark.parametrize(
    "b64, positions, says",
    [
        ("!!", 1, "not base64"),
        (base64.b64encode(b"abc").decode(), 1, "not int32 ids"),
        (base64.b64encode(np.arange(5, dtype="<i4").tobytes()).decode(), 2, "not 2 positions"),
        (base64.b64encode(np.array([-1, 2], dtype="<i4").tobytes()).decode(), 1, "negative"),
        (base64.b64encode(np.array([70000, 2], dtype="<i4").tobytes()).decode(), 1, "16 bits"),
        (base64.b64encode(np.arange(2, dtype="<i4").tobytes()).decode(), 0, "no forwarded position"),
        (base64.b64encode(np.arange(3, dtype="<i4").tobytes()).decode(), 2, "not 2 positions"),
    ],
)
def test_bad_routing_from_an_engine_is_refused_naming_the_field(b64, positions, says):
    with pytest.raises(routing.RoutingError, match=f"routed_experts: .*{says}"):
        routing.decode_sglang(b64, positions)


def test_a_continuation_s_routing_replaces_the_rows_it_forwarded_again():
    first = np.full((4, 2), 1, dtype=np.uint8)
    again = np.full((7, 2), 2, dtype=np.uint8)  # the whole longer context, forwarded again (new weights)
    assert routing.latest(first, again).tolist() == [[2, 2]] * 7
    tail = np.full((3, 2), 3, dtype=np.uint16)  # asked from position 4 (routed_experts_start_len)
    assert routing.latest(first, tail, start=4).tolist() == [[1, 1]] * 4 + [[3, 3]] * 3
    assert routing.latest(first, None) is first and routing.latest(None, again) is again
    assert routing.latest(first, np.zeros((0, 1), dtype=np.uint8)) is first  # aborted before any forward
    with pytest.raises(routing.RoutingError, match="positions 4..4 are missing"):
        routing.latest(first, tail, start=5)
    with pytest.raises(routing.RoutingError, match="another model"):
        routing.latest(first, np.zeros((9, 3), dtype=np.uint8), start=2)


@pytest.mark.parametrize(
    "experts, says",
    [
        (np.zeros((5, 4), dtype=np.uint8), "5 positions for 5 tokens"),  # the last token is never forwarded
        (np.zeros((4, 4), dtype=np.int32), "uint8 or uint16"),
        (np.zeros(4, dtype=np.uint8), "uint8 or uint16"),
    ],
)
def test_routing_that_cannot_be_the_trajectorys_is_refused(experts, says):
    with pytest.raises(TrajectoryError, match=f"routed_experts: .*{says}"):
        traj(routed_experts=experts)


def test_routing_goes_through_the_codec_unchanged_and_old_groups_read_without_it():
    experts = np.arange(16, dtype=np.uint16).reshape(4, 4) * 1000
    g = Group("g", "p", [traj(routed_experts=experts), traj(trajectory_id="g/1")])
    for compress in (False, True):
        back = decode_group(encode_group(g, compress=compress))
        assert (back.trajectories[0].routed_experts == experts).all()
        assert back.trajectories[0].routed_experts.dtype == np.uint16
        assert back.trajectories[1].routed_experts is None


def test_corrupt_routing_in_a_group_is_a_codec_error():
    raw = encode_group(Group("g", "p", [traj(routed_experts=np.zeros((4, 2), dtype=np.uint8))]))
    prefix_len = 6 + int.from_bytes(raw[2:6], "little")
    rows = msgpack.unpackb(raw[prefix_len:])
    for bad, says in (
        ([rows[0][11][0], 3, 1], "whole rows"),
        ([rows[0][11][0], 2, 4], "itemsize 4"),
        ([rows[0][11][0][:-1], 1, 2], "whole rows"),  # an odd byte count of 2-byte ids
    ):
        rows[0][11] = bad
        with pytest.raises(CodecError, match=says):
            decode_group(raw[:prefix_len] + msgpack.packb(rows))
