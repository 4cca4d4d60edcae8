"""Snapshot metadata as bytes that can travel between ranks without trust: JSON, never pickle.

The metadata (iteration, generation, coordinates, scheduler, RNG states, param groups) goes
with every replica to a peer and back in a recovery. Decoding it must never run code, whatever
arrives: it is JSON, with the values JSON lacks tagged — tensors and numpy arrays as their raw
bytes with dtype and shape, tuples as tuples, dicts with keys other than strings as pairs.
Floats round-trip exactly (Python writes the shortest repr that reads back to the same bits).
Anything malformed raises MetadataError naming what is wrong.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import torch

from ..errors import DeadpoolError

TAG = "__t"
# The dtypes metadata holds (RNG states are uint8 tensors; a fused Adam's step, a loss scale
# are floats or ints). Nothing else is decoded.
_TORCH_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )  # fmt: skip
}
_NUMPY_KINDS = "biuf"  # bool, signed, unsigned, float: never object arrays


class MetadataError(DeadpoolError):
    """Metadata bytes that are not what `encode` writes."""


def encode(value: Any) -> bytes:
    return json.dumps(_to_doc(value), separators=(",", ":"), allow_nan=True).encode()


def decode(blob: bytes) -> Any:
    try:
        doc = json.loads(blob)
    except (ValueError, UnicodeDecodeError) as err:
        raise MetadataError(f"metadata is not JSON: {err}") from None
    return _from_doc(doc)


def _raw(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _to_doc(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if str(t.dtype).removeprefix("torch.") not in _TORCH_DTYPES:
            raise MetadataError(f"metadata cannot hold a {t.dtype} tensor")
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "data": _raw(raw)}  # fmt: skip
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NUMPY_KINDS:
            raise MetadataError(f"metadata cannot hold a numpy array of {value.dtype}")
        a = np.ascontiguousarray(value)
        return {TAG: "ndarray", "dtype": a.dtype.str, "shape": list(a.shape),
                "data": _raw(a.tobytes())}  # fmt: skip
    if isinstance(value, np.generic):
        return _to_doc(value.item())
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [_to_doc(v) for v in value]}
    if isinstance(value, list):
        return [_to_doc(v) for v in value]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: _to_doc(v) for k, v in value.items()}
        return {TAG: "dict", "items": [[_to_doc(k), _to_doc(v)] for k, v in value.items()]}
    raise MetadataError(f"metadata cannot hold a {type(value).__name__}")


def _bytes(doc: dict, what: str) -> bytes:
    try:
        return base64.b64decode(doc["data"], validate=True)
    except (KeyError, TypeError, ValueError) as err:
        raise MetadataError(f"{what} has no valid data: {err}") from None


def _shape(doc: dict, what: str) -> tuple[int, ...]:
    shape = doc.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise MetadataError(f"{what} has shape {shape!r}, not a list of sizes")
    return tuple(shape)


def _from_doc(doc: Any) -> Any:
    if isinstance(doc, list):
        return [_from_doc(v) for v in doc]
    if not isinstance(doc, dict):
        return doc
    tag = doc.get(TAG)
    if tag is None:
        return {k: _from_doc(v) for k, v in doc.items()}
    if tag == "tuple":
        return tuple(_from_doc(v) for v in _items(doc))
    if tag == "dict":
        pairs = _items(doc)
        if not all(isinstance(p, list) and len(p) == 2 for p in pairs):
            raise MetadataError("a tagged dict holds something other than key/value pairs")
        return {_hashable(_from_doc(k)): _from_doc(v) for k, v in pairs}
    if tag == "tensor":
        dtype = _TORCH_DTYPES.get(doc.get("dtype"))
        if dtype is None:
            raise MetadataError(
                f"tensor of dtype {doc.get('dtype')!r}; valid: {sorted(_TORCH_DTYPES)}"
            )
        shape, raw = _shape(doc, "tensor"), _bytes(doc, "tensor")
        expected = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        if len(raw) != expected:
            raise MetadataError(
                f"tensor {doc['dtype']}{list(shape)} needs {expected} bytes, has {len(raw)}"
            )
        if not raw:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape)
    if tag == "ndarray":
        try:
            dtype = np.dtype(doc.get("dtype"))
        except TypeError as err:
            raise MetadataError(f"numpy dtype {doc.get('dtype')!r}: {err}") from None
        if dtype.kind not in _NUMPY_KINDS:
            raise MetadataError(f"numpy dtype {dtype} is not a number type")
        shape, raw = _shape(doc, "array"), _bytes(doc, "array")
        if len(raw) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
            raise MetadataError(f"array {dtype}{list(shape)} does not match its {len(raw)} bytes")
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    raise MetadataError(f"unknown tag {tag!r}")


def _items(doc: dict) -> list:
    items = doc.get("items")
    if not isinstance(items, list):
        raise MetadataError(f"a tagged {doc.get(TAG)} has no item list")
    return items


def _hashable(key: Any) -> Any:
    try:
        hash(key)
    except TypeError:
        raise MetadataError(f"a dict key of type {type(key).__name__}") from None
    return key
