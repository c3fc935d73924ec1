"""The Tinker API's protobuf, both ways, against the SDK's own encoder and decoders."""

from __future__ import annotations

import numpy as np
import pytest

from services.tinker import wire

tinker = pytest.importorskip("tinker", reason="the tinker SDK is a dev dependency (make setup installs it)")
from tinker import types  # noqa: E402
from tinker.proto import request_conv, response_conv  # noqa: E402


def _request(data, loss_fn="ppo", config=None) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="m",
        seq_id=3,
    )
    return request_conv.forward_backward_request_to_proto(req).SerializeToString()


def test_a_request_the_sdk_encodes_reads_back_dense_and_sparse():
    import torch

    top = torch.zeros(8, 6, dtype=torch.long)
    top[1, 2], top[6, 0] = 7, 9  # mostly zeros: the SDK sends it as CSR
    sparse = types.TensorData.from_torch_sparse(top)
    assert sparse.sparse_crow_indices is not None
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "advantages": [0.0, 0.5, 0.5, -1.0]},
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(8))),
            loss_fn_inputs={"target_tokens": sparse},
        ),
    ]
    got = wire.read_forward_backward(_request(data, config={"clip_low_threshold": 0.7}))
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("m", 3, "ppo", False)
    assert got.config == {"clip_low_threshold": pytest.approx(0.7)}
    np.testing.assert_array_equal(got.data[0].tokens, [5, 6, 7, 8])
    np.testing.assert_array_equal(got.data[0].inputs["target_tokens"], [6, 7, 8, 9])
    np.testing.assert_allclose(got.data[0].inputs["advantages"], [0.0, 0.5, 0.5, -1.0])
    np.testing.assert_array_equal(got.data[1].inputs["target_tokens"], top.numpy())


def test_results_read_back_with_the_sdks_decoders():
    lps = [np.array([-1.0, -2.5], np.float32), np.array([-0.25], np.float32)]
    out = response_conv.deserialize_forward_backward_output(wire.forward_backward_output(lps, {"loss:sum": 3.75}))
    assert out.metrics == {"loss:sum": 3.75}
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.5], [-0.25]]
    seqs = [wire.Sequence([4, 2], [-0.5, -0.125], True), wire.Sequence([9], [-3.0], False)]
    res = response_conv.deserialize_sample_response(wire.sample_response(seqs, np.array([np.nan, -1.5])))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in res.sequences] == [
        ([4, 2], [-0.5, -0.125], "stop"),
        ([9], [-3.0], "length"),
    ]
    assert res.prompt_logprobs == [None, -1.5]


def test_malformed_requests_name_the_field():
    pb = wire.pb()
    with pytest.raises(wire.WireError, match="body"):
        wire.read_forward_backward(b"\xff\xff\xff")
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = b"\x01\x00\x00"  # 3 bytes: not int32s
    with pytest.raises(wire.WireError, match=r"data\[0\].model_input\[0\]"):
        wire.read_forward_backward(msg.SerializeToString())
    d.model_input[0].encoded_text.tokens = np.array([1, 2], "<i4").tobytes()
    t = d.loss_fn_inputs["weights"]
    t.dtype, t.dense = pb.DTYPE_FLOAT32, np.ones(3, "<f4").tobytes()
    t.shape.extend([2])  # 3 values, a shape of 2
    with pytest.raises(wire.WireError, match=r"data\[0\].loss_fn_inputs.weights"):
        wire.read_forward_backward(msg.SerializeToString())
    del t.shape[:]
    t.shape.extend([2, 10**8])  # a few bytes declaring 800 MB: refused before anything is allocated
    t.ClearField("dense")
    with pytest.raises(wire.WireError, match="at most 1024 values per position"):
        wire.read_forward_backward(msg.SerializeToString())
    del t.shape[:]
    t.shape.extend([2, 2])
    t.sparse_csr.crow_indices = np.array([0, 5, 5], "<i8").tobytes()
    t.sparse_csr.col_indices = np.array([0], "<i8").tobytes()
    t.sparse_csr.values = np.ones(1, "<f4").tobytes()
    with pytest.raises(wire.WireError, match="crow_indices"):
        wire.read_forward_backward(msg.SerializeToString())


def _sparse_datum(tokens: int, cols: int):
    """A datum of ``tokens`` tokens with two sparse [tokens, cols] inputs of one value each: a few bytes
    on the wire, ``tokens`` × ``cols`` values each once dense."""
    pb = wire.pb()
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=1, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.zeros(tokens, "<i4").tobytes()
    for name in ("target_tokens", "weights"):
        t = d.loss_fn_inputs[name]
        t.dtype = pb.DTYPE_FLOAT32
        t.shape.extend([tokens, cols])
        crow = np.ones(tokens + 1, "<i8")
        crow[0] = 0
        t.sparse_csr.crow_indices = crow.tobytes()
        t.sparse_csr.col_indices = np.zeros(1, "<i8").tobytes()
        t.sparse_csr.values = np.ones(1, "<f4").tobytes()
    return msg


def test_a_sparse_body_is_bounded_by_the_values_it_makes_and_the_models_positions():
    """A 4 MB body of two sparse [100000, 1024] inputs once took 800 MB; now it is refused before
    anything dense is allocated: by the model's positions, and by the values a body may make."""
    msg = _sparse_datum(100_000, 1024)
    with pytest.raises(wire.WireError, match=r"data\[0\].model_input: 100000 tokens, the model takes 2048 at most"):
        wire.read_forward_backward(msg, max_tokens=2048, max_values=2**20)
    with pytest.raises(wire.WireError, match=r"data\[0\].loss_fn_inputs.\w+: 102400000 values once read"):
        wire.read_forward_backward(msg, max_tokens=None, max_values=64 * 2**20)
    small = _sparse_datum(4, 8)  # 2 × 32 values: within a budget of 64, not of 63
    assert wire.read_forward_backward(small, max_tokens=4, max_values=64).data[0].inputs["weights"].shape == (4, 8)
    with pytest.raises(wire.WireError, match=r"loss_fn_inputs.\w+: 32 values once read"):
        wire.read_forward_backward(small, max_tokens=4, max_values=63)


# ---------------------------------------------------------------- fuzzed bodies
def _hostile_tensor(draw, t, rows: int) -> None:
    """``t`` (a Tensor message) filled the way a hostile client might: any dtype code, a shape that
    may lie (negative, huge, the wrong rank or rows), dense or CSR bytes of any length."""
    from hypothesis import strategies as st

    t.dtype = draw(st.sampled_from([0, 1, 2, 3, 4, 9]))
    dims = st.one_of(st.integers(-3, 8), st.just(rows), st.integers(2**20, 2**62))
    t.shape.extend(draw(st.lists(dims, max_size=3)))
    if draw(st.booleans()):
        t.dense = draw(st.binary(max_size=96))
    else:
        csr = t.sparse_csr
        ints = st.lists(st.integers(-4, 2**62), max_size=10).map(lambda v: np.array(v, "<i8").tobytes())
        csr.crow_indices = draw(st.one_of(ints, st.binary(max_size=40)))
        csr.col_indices = draw(st.one_of(ints, st.binary(max_size=40)))
        csr.values = draw(st.binary(max_size=40))


def test_hostile_forward_backward_bodies_are_read_within_bounds_or_refused_by_field():
    """Fuzzed (hypothesis): messages with any dtype, lying shapes, ragged CSR and odd byte counts,
    and byte-level damage to a valid body. Each is read, within the limits it was given (tokens a
    datum, values once dense, memory), or refused with a ``WireError`` that names its field: never
    another exception."""
    import tracemalloc

    from hypothesis import given
    from hypothesis import strategies as st

    from tests.services.test_fuzz import fuzz

    pb, max_tokens, max_values = wire.pb(), 64, 4096
    numbers = st.floats(allow_nan=True, allow_infinity=True)

    def message(draw) -> bytes:
        msg = pb.ForwardBackwardRequest(
            model_id=draw(st.text(max_size=8)), seq_id=draw(st.integers(-(2**31), 2**31 - 1))
        )
        msg.loss_fn = draw(st.sampled_from(["cross_entropy", "ppo", "gspo", "", "x"]))
        for k, v in draw(st.dictionaries(st.text(max_size=12), numbers, max_size=3)).items():
            msg.loss_fn_config[k] = v
        for _ in range(draw(st.integers(0, 3))):
            d = msg.data.add()
            rows = 0
            for _ in range(draw(st.integers(0, 3))):
                c = d.model_input.add()
                if draw(st.integers(0, 5)) == 0:
                    c.image.data = b"\x89PNG"
                else:
                    c.encoded_text.tokens = draw(st.binary(max_size=300))
                    rows += len(c.encoded_text.tokens) // 4
            for name in draw(
                st.lists(st.sampled_from(["target_tokens", "weights", "logprobs", "zz"]), max_size=3, unique=True)
            ):
                _hostile_tensor(draw, d.loss_fn_inputs[name], rows)
        raw = msg.SerializeToString()
        if raw and draw(st.integers(0, 3)) == 0:  # damaged on the wire: a byte changed, or cut short
            i = draw(st.integers(0, len(raw) - 1))
            raw = raw[:i] + bytes([draw(st.integers(0, 255))]) + raw[i + 1 :] if draw(st.booleans()) else raw[:i]
        return raw

    @fuzz(400)
    @given(data=st.data())
    def run(data):
        raw = message(data.draw)
        tracemalloc.start()
        try:
            req = wire.read_forward_backward(raw, max_tokens, max_values)
        except wire.WireError as e:
            assert e.field and str(e).startswith(e.field + ": "), repr(e)
            return
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 2**20 + 16 * len(raw), f"{peak} bytes for a body of {len(raw)}"
        values = 0
        for d in req.data:
            assert d.tokens.ndim == 1 and len(d.tokens) <= max_tokens
            for a in d.inputs.values():  # a shape, where given, had the datum's rows
                assert a.ndim == 1 or (a.ndim == 2 and a.shape[0] == len(d.tokens)), a.shape
                values += a.size
        assert values <= max_values + len(raw) // 4, values  # the shapeless (1-D) ones are the body's own

    run()
