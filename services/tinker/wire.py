"""The Tinker API's binary messages, both ways: a ``forward_backward`` request (protobuf, the
schema the ``tinker`` package ships) into the trainer's ``Datum`` s, and the results the SDK
takes only as protobuf (``ForwardBackwardOutput``, ``SampleResponse``).

Every decode checks what it reads (dtype, shape, byte counts) and raises ``WireError`` naming
the field, so a malformed request is a 400 and never a half-read one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.adapter_pool import Datum


class WireError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def pb():
    """The SDK's generated messages (the ``tinker`` package: ``pip install rollmesh[tinker]``)."""
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclass
class ForwardBackwardRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[Datum]


def _dtype(code: int, field: str):
    p = pb()
    kinds = {p.DTYPE_FLOAT32: np.float32, p.DTYPE_INT64: np.int64, p.DTYPE_INT32: np.int32}
    if code not in kinds:
        raise WireError(field, f"dtype {code} is not served (float32, int64, int32)")
    return kinds[code]


def _array(raw: bytes, dtype, field: str, count: int | None = None) -> np.ndarray:
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise WireError(field, f"{len(raw)} bytes is not a whole number of {np.dtype(dtype).name} values")
    a = np.frombuffer(raw, dtype=np.dtype(dtype).newbyteorder("<"))
    if count is not None and a.size != count:
        raise WireError(field, f"{a.size} values, the shape says {count}")
    return a


MAX_PER_POSITION = 1024  # K of a [N, K] input (top-K distillation targets)


class Cells:
    """The values a request's tensors may take once read. A sparse tensor's values are few on the
    wire and many once dense ([N, K] zeros but for them): a 4 MB body named two [100000, 1024] inputs
    and took 800 MB. A request may hold as many as its body limit could carry densely, no more."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def take(self, n: int, field: str) -> None:
        if n > self.left:
            raise WireError(field, f"{n} values once read, over the {self.left} the request has left")
        self.left -= n


def tensor(msg, field: str, rows: int | None = None, cells: Cells | None = None) -> np.ndarray:
    """A ``Tensor`` message (dense or CSR; an empty shape: 1-D) as an array. ``rows``: the length its
    first dimension must have (the datum's tokens); ``cells``: the request's budget of values. Both
    are checked before anything is allocated."""
    dtype = _dtype(msg.dtype, field)
    shape = [int(s) for s in msg.shape]
    if any(s < 0 for s in shape) or len(shape) > 2:
        raise WireError(field, f"shape {shape}: 1-D or 2-D tensors only")
    if rows is not None and shape and shape[0] != rows:
        raise WireError(field, f"shape {shape} for {rows} input tokens")
    if len(shape) == 2 and shape[1] > MAX_PER_POSITION:
        raise WireError(field, f"shape {shape}: at most {MAX_PER_POSITION} values per position")
    if cells is not None and shape:
        cells.take(int(np.prod(shape)), field)
    if msg.WhichOneof("encoding") == "sparse_csr":
        if len(shape) != 2:
            raise WireError(field, "a sparse tensor needs a 2-D shape")
        csr = msg.sparse_csr
        rows, cols = shape
        crow = _array(csr.crow_indices, np.int64, field + ".crow_indices", rows + 1)
        col = _array(csr.col_indices, np.int64, field + ".col_indices")
        val = _array(csr.values, dtype, field + ".values", col.size)
        if crow[0] != 0 or crow[-1] != col.size or np.any(np.diff(crow) < 0):
            raise WireError(field + ".crow_indices", "not the row offsets of the values")
        if col.size and (col.min() < 0 or col.max() >= cols):
            raise WireError(field + ".col_indices", f"a column outside [0, {cols})")
        out = np.zeros(shape, dtype=dtype)
        out[np.repeat(np.arange(rows), np.diff(crow)), col] = val
        return out
    data = _array(msg.dense, dtype, field, int(np.prod(shape)) if shape else None)
    return data.reshape(shape) if shape else data.copy()


def parse_forward_backward(raw: bytes):
    """The message, its model and call number read; its data not yet (``read_forward_backward``)."""
    from google.protobuf.message import DecodeError

    msg = pb().ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except DecodeError as e:
        raise WireError("body", f"not a ForwardBackwardRequest: {e}") from None
    return msg


def read_forward_backward(
    raw_or_msg, max_tokens: int | None = None, max_values: int | None = None
) -> ForwardBackwardRequest:
    """The request's data. ``max_tokens``: a datum's most tokens (the model's positions);
    ``max_values``: the most values its tensors may hold once read (``Cells``)."""
    msg = parse_forward_backward(raw_or_msg) if isinstance(raw_or_msg, bytes) else raw_or_msg
    cells = None if max_values is None else Cells(max_values)
    config = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "number":
            config[k] = float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        chunks = []
        for j, c in enumerate(d.model_input):
            if c.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"data[{i}].model_input[{j}]", f"{c.WhichOneof('chunk')} chunks are not served (text)")
            chunks.append(_array(c.encoded_text.tokens, np.int32, f"data[{i}].model_input[{j}]"))
        n = sum(c.size for c in chunks)  # views of the body: nothing allocated yet
        if max_tokens is not None and n > max_tokens:
            raise WireError(f"data[{i}].model_input", f"{n} tokens, the model takes {max_tokens} at most")
        tokens = np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, np.int64)
        inputs = {
            k: tensor(t, f"data[{i}].loss_fn_inputs.{k}", len(tokens), cells) for k, t in d.loss_fn_inputs.items()
        }
        data.append(Datum(tokens, inputs))
    return ForwardBackwardRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """Every datum's ``logprobs`` in one record (their bytes one after the other, with offsets)."""
    p = pb()
    out = p.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    rec = out.loss_fn_outputs.add()
    rec.type_tag = "ArrayRecord"
    rec.num_datums = len(logprobs)
    field = rec.fields["logprobs"]
    field.dtype = p.DTYPE_FLOAT32
    arrays = [np.ascontiguousarray(a, dtype="<f4") for a in logprobs]
    trailing = {a.shape[1:] for a in arrays}
    if len(trailing) > 1:  # one record has one trailing shape (the pool refuses a call mixing them)
        raise ValueError(f"logprobs of shapes {sorted(trailing)} in one call")
    if trailing and (shape := trailing.pop()):
        field.trailing_shape.extend(shape)
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype("<i8").tobytes()
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # False: it ran out of max_tokens


def sample_response(seqs: list[Sequence], prompt_logprobs: np.ndarray | None = None) -> bytes:
    p = pb()
    out = p.SampleResponse()
    for s in seqs:
        q = out.sequences.add()
        q.stop_reason = p.STOP_REASON_STOP if s.stopped else p.STOP_REASON_LENGTH
        q.tokens = np.asarray(s.tokens, dtype="<i4").tobytes()
        q.logprobs = np.asarray(s.logprobs, dtype="<f4").tobytes()
    if prompt_logprobs is not None:  # NaN where there is none (the first token): the SDK reads None
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype="<f4").tobytes()
    return out.SerializeToString()
