"""Tensor handles (the ``ipc`` transport's /update_weights_from_tensor payloads): rollmesh's own
format, read by code (no unpickler): exact round trips, every field checked, references that may
name only bytes inside a rollmesh segment, shapes checked against the receiver before any mapping."""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path

import pytest
import torch

from rollout.engines import tensor_handles as th


def _doc(payload: str) -> dict:
    return json.loads(base64.b64decode(payload))


def _payload(doc) -> str:
    return base64.b64encode(json.dumps(doc).encode()).decode()


def test_cpu_tensors_round_trip_exactly_and_the_segment_goes_with_close():
    # float32, bfloat16, a scalar, an empty tensor and a non-contiguous view
    named = [
        ("w", torch.randn(3, 5)),
        ("b", torch.randn(7).to(torch.bfloat16)),
        ("s", torch.tensor(2.5)),
        ("e", torch.empty(0, 4)),
        ("t", torch.randn(4, 6).t()),
    ]
    strategy = torch.multiprocessing.get_sharing_strategy()
    handles = th.dumps(named)
    segment = Path("/dev/shm") / handles.segment.name
    assert segment.exists()
    got = th.loads(handles.payload)
    assert list(got) == [n for n, _ in named]
    for name, t in named:
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t)
    got["w"].add_(1.0)  # copy-on-write: the receiver's view never changes the sender's bytes
    assert torch.equal(th.loads(handles.payload)["w"], named[0][1])
    handles.close()
    assert not segment.exists()
    assert torch.multiprocessing.get_sharing_strategy() == strategy  # nothing global changed, no manager forked


@pytest.mark.parametrize(
    "change, error",
    [
        ({"shm": {"segment": "..//etc/passwd", "offset": 0}}, "not a rollmesh weight segment"),
        ({"shm": {"segment": "torch_12345_678", "offset": 0}}, "not a rollmesh weight segment"),
        ({"shm": {"segment": "rollmesh_w_0123456789abcdef", "offset": 0}}, "No such file"),
        ({"dtype": "int64"}, "dtype: 'int64'"),
        ({"shape": [10**6]}, "lie outside"),
        ({"storage_offset": 10**6}, "lie outside"),
        ({"stride": [10**6]}, "lie outside"),
        ({"shm": {"segment": None, "offset": -8}}, "shm.offset: expected an integer >= 0"),
        ({"shape": [2, -1], "stride": [1, 1]}, "shape: expected a list of integers >= 0"),
        ({"stride": [1, 1]}, "2 strides for 1 dimensions"),
        ({"layout": "sparse_coo"}, "unknown field 'layout'"),
        ({"cuda": {}}, "expected one storage, shm or cuda"),
        ({"name": 7}, "name: expected a parameter name"),
    ],
)
def test_a_reference_names_only_bytes_inside_a_rollmesh_segment(change, error):
    handles = th.dumps([("w", torch.ones(4))])
    try:
        doc = _doc(handles.payload)
        shm = change.get("shm")
        if shm is not None and shm["segment"] is None:
            shm["segment"] = handles.segment.name
        doc["tensors"][0] |= change
        with pytest.raises(ValueError, match=error):
            th.loads(_payload(doc))
    finally:
        handles.close()


def test_anything_but_the_format_is_refused_pickles_included():
    pickled = base64.b64encode(pickle.dumps([("w", torch.ones(2))])).decode()
    for payload, error in [
        (pickled, "not a tensor-handle payload"),  # never unpickled
        ("not base64!", "not a tensor-handle payload"),
        (_payload({"format": "other/1", "tensors": []}), "expected {format: 'rollmesh_tensors/1'"),
        (_payload([1, 2]), "expected {format"),
        (_payload({"format": th.FORMAT, "tensors": [1]}), r"tensors\[0\]: expected an object"),
    ]:
        with pytest.raises(ValueError, match=error):
            th.loads(payload)
    handles = th.dumps([("w", torch.ones(2))])
    try:
        doc = _doc(handles.payload)
        doc["tensors"].append(doc["tensors"][0])
        with pytest.raises(ValueError, match="a name is given twice"):
            th.loads(_payload(doc))
    finally:
        handles.close()


def test_the_receiver_checks_names_and_shapes_before_mapping_anything():
    handles = th.dumps([("w", torch.ones(4))])
    seen = {}

    def check(tensors):
        seen.update(tensors)
        raise ValueError("tensors: 'w' has shape (4,), the model's is (5,)")

    try:
        doc = _doc(handles.payload)
        doc["tensors"][0]["shm"]["segment"] = "rollmesh_w_ffffffffffffffff"  # would fail if it were mapped
        with pytest.raises(ValueError, match="the model's is"):
            th.loads(_payload(doc), check=check)
        assert seen["w"].device.type == "meta" and seen["w"].shape == (4,) and seen["w"].dtype == torch.float32
    finally:
        handles.close()


def test_cuda_entries_are_read_field_by_field(monkeypatch):
    """A CUDA IPC entry (the fields of UntypedStorage._share_cuda_), parsed without a GPU (one is
    pretended): what torch would take unchecked is checked first; mapping it is `make gpu-check`'s
    ipc part."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cuda = {
        "device": 0,
        "handle": base64.b64encode(b"h" * 64).decode(),
        "size": 16,
        "offset": 0,
        "ref_counter": base64.b64encode(b"/torch_123_456_0").decode(),
        "ref_counter_offset": 0,
        "event": base64.b64encode(b"e" * 64).decode(),
        "event_sync": True,
    }
    entry = {"name": "w", "dtype": "float32", "shape": [4], "stride": [1], "storage_offset": 0, "cuda": cuda}
    (ref,) = th.describe(_payload({"format": th.FORMAT, "tensors": [entry]}))
    assert ref.cuda == (0, b"h" * 64, 16, 0, b"/torch_123_456_0", 0, b"e" * 64, True)
    assert ref.nbytes_spanned() == 16
    for framed in (b"\x02c" + b"h" * 64, b"\x02e" + b"h" * 300):  # torch >= 2.3: cudaMalloc, expandable segment
        (ref,) = th.describe(
            _payload(
                {
                    "format": th.FORMAT,
                    "tensors": [{**entry, "cuda": {**cuda, "handle": base64.b64encode(framed).decode()}}],
                }
            )
        )
        assert ref.cuda[1] == framed
    b64 = base64.b64encode
    for field, value, error in [
        ("handle", "!!", "cuda.handle: expected base64"),
        ("handle", b64(b"h" * 63).decode(), "cuda.handle: neither a 64-byte CUDA IPC handle"),
        ("handle", b64(b"\x02c" + b"h" * 63).decode(), "cuda.handle: neither"),  # torch's framing, short
        ("handle", b64(b"\x02x" + b"h" * 64).decode(), "cuda.handle: neither"),  # an unknown kind
        ("handle", b64(b"\x02e" + b"h" * 65536).decode(), "cuda.handle: neither"),  # past the bound
        ("handle", b64(b"\x02e" + b"h" * 10).decode(), "cuda.handle: neither"),  # no handle in it
        ("handle", b64(b"\x09c" + b"h" * 64).decode(), "cuda.handle: neither"),  # a framing torch never wrote
        ("event", b64(b"e" * 65).decode(), "cuda.event: a CUDA IPC event handle is 64 bytes"),
        ("ref_counter", b64(b"/etc/passwd").decode(), "not a torch reference-counter name"),
        ("ref_counter_offset", 10_000, "ref_counter_offset: at most 9999"),  # torch decrements it unchecked
        ("device", 1, "no CUDA device 1 here"),
        ("device", -1, "cuda.device: expected an integer >= 0"),
        ("event_sync", 1, "cuda.event_sync: expected true or false"),
        ("extra", 1, "cuda: expected the fields"),
    ]:
        bad = {**entry, "cuda": {**cuda, field: value}}
        with pytest.raises(ValueError, match=error):
            th.describe(_payload({"format": th.FORMAT, "tensors": [bad]}))


def test_a_segment_name_that_is_a_link_or_a_huge_shape_is_refused_cleanly(tmp_path):
    handles = th.dumps([("w", torch.ones(4))])
    link = Path("/dev/shm/rollmesh_w_" + "a" * 16)
    try:
        link.symlink_to(Path("/dev/shm") / handles.segment.name)
        doc = _doc(handles.payload)
        doc["tensors"][0]["shm"]["segment"] = link.name
        with pytest.raises(ValueError, match="Too many levels of symbolic links"):
            th.loads(_payload(doc))
        doc = _doc(handles.payload)
        doc["tensors"][0] |= {"shape": [2**62, 2**62], "stride": [1, 1]}  # checked against the model as meta
        with pytest.raises(ValueError, match="tensor handle"):
            th.loads(_payload(doc), check=lambda tensors: None)
    finally:
        link.unlink(missing_ok=True)
        handles.close()


def test_sglangs_encoding_is_for_cuda_tensors_only():
    with pytest.raises(ValueError, match="SGLang takes CUDA tensors by handle"):
        th.dumps([("w", torch.ones(2))], "sglang")
    with pytest.raises(ValueError, match="encoding 'other'"):
        th.dumps([("w", torch.ones(2))], "other")
