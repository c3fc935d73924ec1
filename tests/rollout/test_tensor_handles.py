"""Tensor handles (SGLang's /update_weights_from_tensor payloads) for CPU tensors: rollmesh's own
shared-memory segments, exact round trips, and references that may name nothing else."""

from __future__ import annotations

import base64
import io
import pickle
from pathlib import Path

import pytest
import torch

from rollout.engines import tensor_handles as th


def _payload(items) -> str:
    buf = io.BytesIO()
    pickle.Pickler(buf, pickle.HIGHEST_PROTOCOL).dump(items)
    return base64.b64encode(buf.getvalue()).decode()


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
    "args, error",
    [
        (("..//etc/passwd", 0, "float32", (1,)), "not a rollmesh weight segment"),
        (("torch_12345_678", 0, "float32", (1,)), "not a rollmesh weight segment"),
        ((None, 0, "int64", (1,)), "dtype 'int64'"),
        ((None, 0, "float32", (10**6,)), "lie outside"),
        ((None, -8, "float32", (1,)), "lie outside"),
        ((None, 0, "float32", (2, -1)), "not a tuple of sizes"),
    ],
)
def test_a_reference_names_only_bytes_inside_a_rollmesh_segment(args, error):
    handles = th.dumps([("w", torch.ones(4))])
    try:
        segment = args[0] if args[0] is not None else handles.segment.name
        ref = th._SegmentRef(segment, 0, torch.float32, (1,))
        ref.args = (segment, *args[1:])
        with pytest.raises(ValueError, match=error):
            th.loads(_payload([("w", ref)]))
    finally:
        handles.close()


def test_a_payload_of_anything_but_tensor_pairs_is_refused():
    with pytest.raises(ValueError, match="list of \\(name, tensor\\) pairs"):
        th.loads(_payload({"w": 1}))
    with pytest.raises(ValueError, match="not a tensor-handle payload"):
        th.loads("not base64!")


class _SetsStorageState:
    """Pickles as BUILD on torch's storage class: setting its attributes for the whole process."""

    def __reduce__(self):
        return (torch.Size, ((),), {"tolist": torch.Size})


def test_a_payload_cannot_change_torch_classes_or_bring_sparse_tensors():
    # BUILD with a state: what replaced UntypedStorage.tolist with torch.Size, process-wide.
    build = pickle.dumps([("w", _SetsStorageState())], protocol=pickle.HIGHEST_PROTOCOL)
    with pytest.raises(ValueError, match="opcode BUILD"):
        th.loads(base64.b64encode(build).decode())
    assert torch.UntypedStorage.tolist is not torch.Size
    # A sparse tensor whose index lies past its shape: never built.
    sparse = torch.sparse_coo_tensor(torch.tensor([[1]]), torch.tensor([1.0]), (4,))
    with pytest.raises(ValueError, match="not part of a tensor handle"):
        th.loads(_payload([("w", sparse)]))


class _CallsAClass:
    def __reduce__(self):
        return (torch.UntypedStorage, (10**12,))  # a terabyte, if it were called


def test_only_the_rebuild_functions_may_be_called():
    with pytest.raises(ValueError, match="is not part of a tensor handle"):
        th.loads(_payload([("w", _CallsAClass())]))


def test_a_cuda_tensors_reduction_names_only_what_is_allowed():
    """What torch's ForkingPickler writes for a CUDA tensor (its rebuild function, the storage class,
    Size, dtype) must all pass find_class; run here without a GPU by reading the reduction's names."""
    from torch.multiprocessing import reductions

    src = Path(reductions.__file__).read_text()
    body = src[src.index("def reduce_tensor") : src.index("def rebuild_nested_tensor")]
    assert "rebuild_cuda_tensor" in body and "_typed_storage()" in body and "type(storage)," in body
    for module, name in [
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("torch.storage", "TypedStorage"),
        ("torch", "Size"),
        ("torch", "float32"),
        ("torch.nn.parameter", "Parameter"),
    ]:
        th._TensorsOnly(io.BytesIO(b"")).find_class(module, name)
