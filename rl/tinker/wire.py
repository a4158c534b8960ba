"""The protobuf messages of the Tinker protocol that travel as `application/x-protobuf`, read and written by hand.

The `tinker` SDK (0.38.0) posts `forward_backward` bodies as a protobuf `ForwardBackwardRequest` and asks
for `ForwardBackwardOutput` and `SampleResponse` results as protobuf (its `Accept` header); every other
route is JSON. The schema is the SDK's `tinker_public` package (field numbers below). Only the fields
this service reads or writes are handled; a field it does not know is skipped, as protobuf requires.

Wire format (protobuf encoding reference, developers.google.com/protocol-buffers/docs/encoding): each
field is a varint key `(number << 3) | wire_type`, then a varint (type 0), 8 bytes (type 1), a
varint length and that many bytes (type 2: strings, bytes, messages, packed repeats) or 4 bytes
(type 5). Maps are repeated entry messages with the key as field 1 and the value as field 2.

What this module does not do: validate meaning (shapes, token ranges, loss names: rl/tinker/records.py
and the service do), or decompress bodies (the app does).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAX_DEPTH = 8  # the schema nests 4 deep; a deeper message is malformed


class WireError(ValueError):
    """A body that is not a well-formed message of the expected type."""


# ----------------------------------------------------------------------------- decoding
def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if i >= len(buf):
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, i
        shift += 7
        if shift > 63:
            raise WireError("varint longer than 10 bytes")


def fields(data: bytes | memoryview) -> dict[int, list[int | memoryview]]:
    """Field number -> its values in order: ints for varint / fixed fields, memoryviews for length-delimited ones."""
    buf = memoryview(data)
    out: dict[int, list[int | memoryview]] = {}
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        num, wt = key >> 3, key & 7
        if num == 0:
            raise WireError("field number 0")
        if wt == 0:
            v, i = _varint(buf, i)
        elif wt == 1:
            if i + 8 > len(buf):
                raise WireError("truncated 64-bit field")
            v, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wt == 2:
            n, i = _varint(buf, i)
            if i + n > len(buf):
                raise WireError(f"field {num}: length {n} runs past the end of the message")
            v, i = buf[i:i + n], i + n
        elif wt == 5:
            if i + 4 > len(buf):
                raise WireError("truncated 32-bit field")
            v, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise WireError(f"field {num}: unsupported wire type {wt}")
        out.setdefault(num, []).append(v)
    return out


def _one(f: dict, num: int, default=None):
    vals = f.get(num)
    return vals[-1] if vals else default  # protobuf: the last occurrence of a scalar wins


def _bytes(f: dict, num: int) -> bytes:
    v = _one(f, num, b"")
    if isinstance(v, int):
        raise WireError(f"field {num}: expected bytes")
    return bytes(v)


def _str(f: dict, num: int) -> str:
    try:
        return _bytes(f, num).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"field {num}: not UTF-8") from None


def _int(f: dict, num: int, bits: int = 64) -> int:
    v = _one(f, num, 0)
    if not isinstance(v, int):
        raise WireError(f"field {num}: expected an integer")
    v &= (1 << 64) - 1
    v = v - (1 << 64) if v >> 63 else v  # int32 / int64 negatives travel as 64-bit two's complement
    if bits == 32 and not -(1 << 31) <= v < (1 << 31):
        raise WireError(f"field {num}: {v} does not fit int32")
    return v


def _double(raw: int | memoryview) -> float:
    if not isinstance(raw, int):
        raise WireError("expected a double")
    return struct.unpack("<d", raw.to_bytes(8, "little"))[0]


def _packed_int64(f: dict, num: int) -> list[int]:
    out: list[int] = []
    for v in f.get(num, []):
        if isinstance(v, int):  # unpacked encoding
            out.append(v - (1 << 64) if v >> 63 else v)
            continue
        j, buf = 0, v
        while j < len(buf):
            x, j = _varint(buf, j)
            out.append(x - (1 << 64) if x >> 63 else x)
    return out


def _map(f: dict, num: int) -> list[tuple[str, int | memoryview | None]]:
    out = []
    for entry in f.get(num, []):
        if isinstance(entry, int):
            raise WireError(f"field {num}: map entry is not a message")
        e = fields(entry)
        out.append((_str(e, 1), _one(e, 2)))
    return out


# Proto DType enum -> numpy dtype of the bytes on the wire.
_DTYPES = {1: np.dtype("<f4"), 2: np.dtype("<i8"), 3: np.dtype("<i4")}


@dataclass(frozen=True)
class WireTensor:
    """A decoded `Tensor`: dense values (sparse CSR expanded, missing cells 0) and the declared shape."""

    values: np.ndarray
    shape: tuple[int, ...]


def _tensor(raw: memoryview, max_elems: int) -> WireTensor:
    f = fields(raw)
    code = _int(f, 3)
    dt = _DTYPES.get(code)
    if dt is None:
        raise WireError(f"tensor dtype {code} is not float32 / int64 / int32")
    shape = tuple(_packed_int64(f, 4))
    if any(s < 0 for s in shape):
        raise WireError(f"negative tensor shape {shape}")
    size = int(np.prod(shape)) if shape else None
    if size is not None and size > max_elems:
        raise WireError(f"tensor of {size} elements is over the limit of {max_elems}")
    if 2 in f:  # sparse CSR: values + row pointers + column indices of a 2-D tensor
        csr = fields(_one(f, 2))
        if len(shape) != 2:
            raise WireError("a sparse tensor needs a 2-D shape")
        vals = np.frombuffer(_bytes(csr, 1), dtype=dt)
        crow = np.frombuffer(_bytes(csr, 2), dtype="<i8")
        col = np.frombuffer(_bytes(csr, 3), dtype="<i8")
        if len(crow) != shape[0] + 1 or len(col) != len(vals) or (len(crow) and (crow[0] != 0 or crow[-1] != len(vals))) \
                or np.any(np.diff(crow) < 0) or np.any((col < 0) | (col >= max(shape[1], 1))):
            raise WireError("inconsistent sparse CSR tensor")
        dense = np.zeros(shape, dtype=dt)
        rows = np.repeat(np.arange(shape[0]), np.diff(crow))
        dense[rows, col] = vals
        return WireTensor(dense.reshape(-1), shape)
    data = _bytes(f, 1)
    if len(data) % dt.itemsize:
        raise WireError(f"tensor bytes ({len(data)}) are not a multiple of {dt.itemsize}")
    vals = np.frombuffer(data, dtype=dt)
    if len(vals) > max_elems:
        raise WireError(f"tensor of {len(vals)} elements is over the limit of {max_elems}")
    if size is not None and size != len(vals):
        raise WireError(f"tensor shape {list(shape)} holds {size} values but {len(vals)} were sent")
    return WireTensor(vals, shape or (len(vals),))


@dataclass(frozen=True)
class WireDatum:
    tokens: np.ndarray  # int64 [N]: the model input's text chunks, concatenated
    inputs: tuple[tuple[str, WireTensor], ...]  # loss_fn_inputs by name
    non_text_chunks: int  # image / audio chunks (refused by the service)


@dataclass(frozen=True)
class WireForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: tuple[tuple[str, float | str], ...]
    forward_only: bool
    data: tuple[WireDatum, ...]


def decode_forward_backward(body: bytes, max_datums: int, max_elems: int) -> WireForwardBackward:
    """A `ForwardBackwardRequest` body; WireError when malformed or over the size limits."""
    f = fields(body)
    raw_data = f.get(3, [])
    if len(raw_data) > max_datums:
        raise WireError(f"{len(raw_data)} datums in one request; the limit is {max_datums}")
    data = []
    for raw in raw_data:
        if isinstance(raw, int):
            raise WireError("datum is not a message")
        d = fields(raw)
        toks: list[np.ndarray] = []
        other = 0
        for chunk in d.get(1, []):
            if isinstance(chunk, int):
                raise WireError("chunk is not a message")
            c = fields(chunk)
            if 1 in c:
                t = _bytes(fields(_one(c, 1)), 1)
                if len(t) % 4:
                    raise WireError("encoded_text tokens are not int32")
                toks.append(np.frombuffer(t, dtype="<i4").astype(np.int64))
            else:
                other += 1
        tokens = np.concatenate(toks) if toks else np.zeros(0, dtype=np.int64)
        if len(tokens) > max_elems:
            raise WireError(f"model input of {len(tokens)} tokens is over the limit of {max_elems}")
        inputs = []
        for name, raw_t in _map(d, 2):
            if raw_t is None or isinstance(raw_t, int):
                raise WireError(f"loss_fn_inputs[{name!r}] is not a tensor")
            inputs.append((name, _tensor(raw_t, max_elems)))
        data.append(WireDatum(tokens, tuple(inputs), other))
    config: dict[str, float | str] = {}
    for k, v in _map(f, 5):
        config[k] = _double(v if v is not None else 0)
    for k, v in _map(f, 7):  # v2 wins where both are set (the SDK writes both for numbers)
        if v is None or isinstance(v, int):
            raise WireError(f"loss_fn_config[{k!r}] is not a value message")
        lv = fields(v)
        config[k] = _str(lv, 2) if 2 in lv else _double(_one(lv, 1, 0))
    return WireForwardBackward(model_id=_str(f, 1), seq_id=_int(f, 2, 32), loss_fn=_str(f, 4),
                               loss_fn_config=tuple(config.items()), forward_only=bool(_int(f, 6)), data=tuple(data))


# ----------------------------------------------------------------------------- encoding
def _enc_varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(num: int, wt: int) -> bytes:
    return _enc_varint((num << 3) | wt)


def _len_field(num: int, payload: bytes) -> bytes:
    return _key(num, 2) + _enc_varint(len(payload)) + payload


def _int_field(num: int, v: int) -> bytes:
    return _key(num, 0) + _enc_varint(int(v)) if v else b""  # proto3: a zero scalar is not written


def _packed_field(num: int, values: list[int]) -> bytes:
    return _len_field(num, b"".join(_enc_varint(v) for v in values)) if values else b""


def _double_entry(key: str, value: float) -> bytes:
    return _len_field(1, key.encode()) + _key(2, 1) + struct.pack("<d", float(value))


_OUT_DTYPES = {np.dtype("float32"): 1, np.dtype("int64"): 2}


def _batched(arrays: list[np.ndarray]) -> bytes:
    """A `BatchedTensor` of one field over the datums: concatenated bytes, byte offsets [n + 1], no trailing dims."""
    dt = arrays[0].dtype
    code = _OUT_DTYPES[dt]
    offsets = np.zeros(len(arrays) + 1, dtype="<i8")
    offsets[1:] = np.cumsum([a.nbytes for a in arrays])
    data = b"".join(np.ascontiguousarray(a, dtype=dt.newbyteorder("<")).tobytes() for a in arrays)
    return _len_field(1, data) + _len_field(2, offsets.tobytes()) + _int_field(3, code)


def encode_forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: one ArrayRecord holding every datum's 1-D output arrays (float32 / int64), and the metrics."""
    body = _len_field(1, b"ArrayRecord")
    record = _len_field(1, b"ArrayRecord") + _int_field(3, len(outputs))
    names = list(outputs[0]) if outputs else []
    for name in names:
        entry = _len_field(1, name.encode()) + _len_field(2, _batched([o[name] for o in outputs]))
        record += _len_field(2, entry)
    body += _len_field(2, record)
    for k, v in metrics.items():
        body += _len_field(3, _double_entry(k, v))
    return body


@dataclass(frozen=True)
class WireSequence:
    tokens: np.ndarray  # int
    logprobs: np.ndarray  # float
    stop: bool  # True: ended on a stop token / string; False: max_tokens


def encode_sample_response(sequences: list[WireSequence], prompt_logprobs: np.ndarray | None) -> bytes:
    """A `SampleResponse`: the sequences (int32 tokens, float32 logprobs) and, when asked, the prompt's logprobs
    (float32, NaN where none is defined: the first token)."""
    body = b""
    for s in sequences:
        seq = _int_field(1, 0 if s.stop else 1) + _len_field(2, np.asarray(s.tokens, dtype="<i4").tobytes())
        seq += _len_field(3, np.asarray(s.logprobs, dtype="<f4").tobytes())
        body += _len_field(1, seq)
    if prompt_logprobs is not None:
        body += _len_field(2, np.asarray(prompt_logprobs, dtype="<f4").tobytes())
    return body
