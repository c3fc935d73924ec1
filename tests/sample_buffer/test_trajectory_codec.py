import struct

import msgpack
import numpy as np
import pytest

from sample_buffer.codec import CodecError, decode_group, encode_group, read_header
from sample_buffer.trajectory import Group, Trajectory, TrajectoryError
from tests.sample_buffer.helpers import make_group


def traj(**kw):
    base = dict(
        trajectory_id="t",
        group_id="g",
        prompt_id="p",
        token_ids=[1, 2, 3, 4],
        loss_mask=[0, 0, 1, 1],
        behavior_logprobs=[-0.5, -1.0],
        token_versions=[3, 4],
        reward=1.0,
        start_version=3,
    )
    return Trajectory(**(base | kw))


def _top(ids, lps) -> dict:
    return {"teacher_logprobs": [-1.0, -1.0], "teacher_top_ids": ids, "teacher_top_logprobs": lps}


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"loss_mask": [0, 1, 1]}, "loss_mask"),
        ({"loss_mask": [0, 2, 1, 1], "behavior_logprobs": [-1.0, -1.0, -1.0]}, "loss_mask"),
        ({"behavior_logprobs": [-0.5]}, "behavior_logprobs"),
        ({"behavior_logprobs": [-0.5, 0.1]}, "behavior_logprobs"),
        ({"behavior_logprobs": [-0.5, float("nan")]}, "behavior_logprobs"),
        ({"teacher_logprobs": [-0.5]}, "teacher_logprobs"),  # fewer than the generated tokens
        ({"teacher_logprobs": [-0.5, 0.2]}, "teacher_logprobs"),
        ({"teacher_logprobs": [float("-inf"), -1.0]}, "teacher_logprobs"),
        ({"teacher_logprobs": [-1.0, -1.0], "teacher_top_ids": [[1], [2]]}, "both or neither"),
        ({"teacher_top_ids": [[1], [2]], "teacher_top_logprobs": [[-1.0], [-1.0]]}, "both or neither"),
        (_top([[1, 2]], [[-1.0, -2.0]]), r"one row of k in \[1, 64\] a generated token"),
        (_top([[1], [2]], [[-1.0, -2.0], [-1.0, -2.0]]), "one row of k in"),
        (_top([[1] * 65] * 2, [[-1.0] * 65] * 2), "one row of k in"),
        (_top([[1, -2], [2, 3]], [[-1.0, -2.0], [-1.0, -2.0]]), "teacher_top_ids: token ids must be >= 0"),
        (_top([[1, 2], [2, 3]], [[-1.0, 0.5], [-1.0, -2.0]]), "teacher_top_logprobs: log-probs must be finite"),
        (_top([1, 2], [-1.0, -2.0]), r"teacher_top_ids: expected a \[tokens, k\] table"),
        ({"token_versions": [3]}, "token_versions"),
        ({"start_version": 2}, "start_version"),
        ({"token_rewards": [0.0]}, "token_rewards"),
        ({"reward": float("inf")}, "reward"),
        ({"finish_reason": "bored"}, "finish_reason"),
        ({"metadata": {"turn_temperatures": [0.7]}}, "metadata.turn_starts"),
        ({"metadata": {"turn_starts": [2, 9], "turn_temperatures": [0.7, 1.0]}}, "metadata.turn_starts"),
        ({"metadata": {"turn_starts": [2], "turn_temperatures": [0.7, 1.0]}}, "metadata.turn_temperatures"),
        ({"metadata": {"turn_starts": [2], "turn_temperatures": [float("nan")]}}, "metadata.turn_temperatures"),
        ({"metadata": {"turn_starts": [2], "turn_temperatures": ["hot"]}}, "metadata.turn_temperatures"),
        ({"metadata": {"turn_starts": [3, 2], "turn_temperatures": [0.7, 1.0]}}, "metadata.turn_starts"),
        ({"metadata": "turn_temperatures"}, "metadata"),
    ],
)
def test_invalid_trajectories_name_the_field(kw, field):
    with pytest.raises(TrajectoryError, match=field):
        traj(**kw)


def test_codec_round_trip_is_exact():
    g = make_group("g1", version=7, rewards=(0.0, 0.5, 1.0))
    g.trajectories[0].token_rewards = np.arange(10, dtype=np.float32)
    for compress in (False, True):
        data = encode_group(g, compress=compress)
        h = read_header(data)
        assert (h.group_id, h.start_version, h.rewards, h.size) == ("g1", 7, (0.0, 0.5, 1.0), 3)
        back = decode_group(data)
        assert back.group_id == "g1" and back.prompt_id == g.prompt_id
        for a, b in zip(g.trajectories, back.trajectories):
            for f in ("token_ids", "loss_mask", "behavior_logprobs", "token_versions"):
                assert np.array_equal(getattr(a, f), getattr(b, f)), f
            assert (a.reward, a.start_version, a.metadata, a.trajectory_id) == (
                b.reward,
                b.start_version,
                b.metadata,
                b.trajectory_id,
            )
        assert np.array_equal(back.trajectories[0].token_rewards, np.arange(10))


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "too short"),
        (b"\x07\x00\x00\x00\x00\x00", "unknown group format version 7"),
        (b"\x01\x00\xff\x00\x00\x00abc", "runs past the end"),
        (b"\x01\x00\x03\x00\x00\x00\xc1\xc1\xc1", "corrupt group header"),
    ],
)
def test_bad_bytes_give_clear_errors(data, message):
    with pytest.raises(CodecError, match=message):
        decode_group(data)


def test_corrupt_body_is_a_codec_error():
    data = encode_group(make_group("g2"))
    with pytest.raises(CodecError, match="corrupt group body"):
        decode_group(data[:-7])


def _reencode(data: bytes, header=None, body=None) -> bytes:
    """The group's bytes with its header and/or body replaced (msgpack, as the codec writes them)."""
    _, _, hlen = struct.unpack_from("<BBI", data)
    h, b = msgpack.unpackb(data[6 : 6 + hlen]), msgpack.unpackb(data[6 + hlen :])
    h, b = header(h) if header else h, body(b) if body else b
    packed = msgpack.packb(h)
    return struct.pack("<BBI", 1, 0, len(packed)) + packed + msgpack.packb(b)


def _set(container, key, value):
    container[key] = value
    return container


@pytest.mark.parametrize(
    "header, body, message",
    [
        # Numbers Python cannot make an int of: OverflowError, not a ValueError (it escaped the codec's errors).
        (lambda h: _set(h, "v", float("inf")), None, "corrupt group header"),
        (None, lambda b: [_set(r, 7, float("inf")) for r in b], "corrupt group body"),
        (lambda h: _set(h, "n", 0), lambda b: [], "has no trajectories"),
        # A header the buffer would sort and filter by, disagreeing with the trajectories.
        (lambda h: _set(h, "v", h["v"] + 5), None, "disagrees with its trajectories"),
        (lambda h: _set(h, "r", [1.0, 1.0]), None, "disagrees with its trajectories"),
    ],
)
def test_corrupt_groups_are_codec_errors(header, body, message):
    data = _reencode(encode_group(make_group("g3", version=2, rewards=(0.0, 1.0))), header, body)
    with pytest.raises(CodecError, match=message):
        decode_group(data)


def test_a_groups_start_version_is_its_oldest_members():
    members = [
        traj(trajectory_id="a", group_id="z", start_version=5, token_versions=[5, 5]),
        traj(trajectory_id="b", group_id="z", start_version=3, token_versions=[3, 4]),
    ]
    assert Group("z", "p", members).start_version == 3  # a group is as stale as its stalest member


def _with_images(group: Group, per_traj: list[list[bytes]]) -> Group:
    from sample_buffer.vision import content_hash

    images = {content_hash(b): b for bs in per_traj for b in bs}
    trajs = [
        Trajectory(**{**t.__dict__, "images": tuple(content_hash(b) for b in bs)})
        for t, bs in zip(group.trajectories, per_traj)
    ]
    return Group(group.group_id, group.prompt_id, trajs, group.domain, images)


def test_images_travel_once_per_group_and_come_back_exactly():
    cat, dog = b"\x89PNG cat" * 500, b"\x89PNG dog" * 300
    # two replicas of one prompt share its image; a third trajectory has two; the fourth none
    group = _with_images(make_group("img", rewards=(0.0, 1.0, 0.5, 0.2)), [[cat], [cat], [cat, dog], []])
    data = encode_group(group)
    assert data.count(cat) == 1 and data.count(dog) == 1  # each image's bytes once, its hash per reference
    back = decode_group(data)
    assert back.images == group.images and [t.images for t in back.trajectories] == [
        t.images for t in group.trajectories
    ]
    assert read_header(data).images == 2 and read_header(encode_group(make_group("plain"))).images == 0
    assert decode_group(encode_group(group, compress=True)).images == group.images


def test_images_that_do_not_fit_their_group_are_refused_by_name():
    from sample_buffer.vision import content_hash

    base = make_group("bad", rewards=(0.0, 1.0))
    cat = b"cat"
    with pytest.raises(TrajectoryError, match="images: 1 referenced image"):
        Group(base.group_id, base.prompt_id, _with_images(base, [[cat], []]).trajectories, "", {})
    with pytest.raises(TrajectoryError, match="images: 1 image.* no trajectory references"):
        Group(base.group_id, base.prompt_id, base.trajectories, "", {content_hash(cat): cat})
    with pytest.raises(TrajectoryError, match="do not hash to their key"):
        Group(
            base.group_id, base.prompt_id, _with_images(base, [[cat], []]).trajectories, "", {content_hash(cat): b"dog"}
        )
    with pytest.raises(TrajectoryError, match="images: a tuple of sha256"):
        Trajectory(**{**base.trajectories[0].__dict__, "images": ("not-a-hash",)})
    # bytes altered on the way: the group does not decode
    data = encode_group(_with_images(base, [[cat], [cat]]))
    with pytest.raises(CodecError, match="do not hash to their key"):
        decode_group(data.replace(b"cat", b"dog"))


def _taught(group: Group, seed: int = 0) -> Group:
    rng = np.random.default_rng(seed)
    trajs = [
        Trajectory(**{**t.__dict__, "teacher_logprobs": -rng.random(t.num_generated) * 3}) for t in group.trajectories
    ]
    return Group(group.group_id, group.prompt_id, trajs, group.domain, group.images)


def test_teacher_log_probs_travel_exactly_and_the_header_says_the_group_is_taught():
    group = _taught(make_group("opd", rewards=(1.0, 1.0, 0.0)))
    group.trajectories[1].routed_experts = None  # a row with no routing and no images still carries them
    for compress in (False, True):
        data = encode_group(group, compress=compress)
        back = decode_group(data)
        assert read_header(data).taught and back.taught
        for a, b in zip(group.trajectories, back.trajectories, strict=True):
            assert b.teacher_logprobs.dtype == np.float32 and np.array_equal(a.teacher_logprobs, b.teacher_logprobs)
    plain = encode_group(make_group("plain"))
    assert not read_header(plain).taught and decode_group(plain).trajectories[0].teacher_logprobs is None
    # With images (the field after them) the row's trailing fields keep their places.
    cat = b"\x89PNG cat"
    mixed = _taught(_with_images(make_group("both"), [[cat], []]))
    back = decode_group(encode_group(mixed))
    assert back.trajectories[0].images == mixed.trajectories[0].images
    assert np.array_equal(back.trajectories[1].teacher_logprobs, mixed.trajectories[1].teacher_logprobs)


def _topped(group: Group, k: int, seed: int = 0) -> Group:
    rng = np.random.default_rng(seed)
    trajs = [
        Trajectory(
            **{
                **t.__dict__,
                "teacher_top_ids": rng.integers(0, 1000, (t.num_generated, k)),
                "teacher_top_logprobs": -rng.random((t.num_generated, k)) * 3,
            }
        )
        for t in group.trajectories
    ]
    return Group(group.group_id, group.prompt_id, trajs, group.domain, group.images)


def test_a_teachers_top_k_travels_exactly_and_a_corrupt_table_is_refused():
    group = _topped(_taught(make_group("top", rewards=(1.0, 0.0))), k=3)
    for compress in (False, True):
        back = decode_group(encode_group(group, compress=compress))
        for a, b in zip(group.trajectories, back.trajectories, strict=True):
            assert b.teacher_top_ids.dtype == np.int32 and np.array_equal(a.teacher_top_ids, b.teacher_top_ids)
            assert b.teacher_top_logprobs.dtype == np.float32
            assert np.array_equal(a.teacher_top_logprobs, b.teacher_top_logprobs)
    assert decode_group(encode_group(_taught(make_group("no-top")))).trajectories[0].teacher_top_ids is None
    with pytest.raises(TrajectoryError, match="teacher_top_ids of one k on every trajectory"):
        Group("top", "p", [_topped(group, 2).trajectories[0], group.trajectories[1]])
    # A table whose length is no multiple of its k: a clear error, not a reshape's.
    data = encode_group(group)
    prefix, (_, hlen) = struct.Struct("<BBI"), struct.unpack_from("<BI", data, 1)
    rows = msgpack.unpackb(data[prefix.size + hlen :])
    rows[0][14][2] = 5
    body = msgpack.packb(rows)
    with pytest.raises(CodecError, match="no table of 5 a row"):
        decode_group(data[: prefix.size + hlen] + body)


def test_a_group_is_taught_whole_or_not_at_all_and_its_header_must_agree():
    group = _taught(make_group("half", rewards=(0.0, 1.0)))
    with pytest.raises(TrajectoryError, match="teacher_logprobs on every trajectory or on none"):
        Group("half", group.prompt_id, [group.trajectories[0], make_group("half").trajectories[1]])
    data = encode_group(group)
    prefix, (flags, hlen) = struct.Struct("<BBI"), struct.unpack_from("<BI", data, 1)
    header = msgpack.unpackb(data[prefix.size : prefix.size + hlen])
    del header["k"]  # a header that hides the teacher: the filter would judge the group on rewards alone
    forged = msgpack.packb(header)
    with pytest.raises(CodecError, match="taught"):
        decode_group(prefix.pack(1, flags, len(forged)) + forged + data[prefix.size + hlen :])
