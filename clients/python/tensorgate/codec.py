"""Decoding pushdown responses: `.npy` (one tensor) and safetensors (features, labels, keys)."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field

import numpy as np

from .augment import Drawn

_SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "BF16": None}


@dataclass
class Features:
    """A decoded response: `features` `[N, ...]` (or one sample's tensor), optional `labels` and
    sample `keys`, and the split and model that produced them."""

    features: np.ndarray
    labels: np.ndarray | None = None
    keys: list[str] = field(default_factory=list)
    split: str | None = None
    model: str | None = None
    #: What each sample of an augmented request drew (`tensorgate.augment.Drawn`), in order.
    augmented: list = field(default_factory=list)


def _bf16_to_f32(raw: bytes) -> np.ndarray:
    return (np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def array(chunk: bytes, dtype: str) -> np.ndarray:
    """A flat array from a safetensors tensor's bytes and dtype name (bf16 widened to f32)."""
    if dtype == "BF16":
        return _bf16_to_f32(chunk)
    return np.frombuffer(chunk, dtype=_SAFETENSORS_DTYPES[dtype])


def read_safetensors(raw: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """All tensors (bf16 widened to f32) and the metadata of a safetensors buffer."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = memoryview(raw)[8 + n :]
    meta = header.pop("__metadata__", {}) or {}
    out = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        out[name] = array(bytes(data[start:end]), info["dtype"]).reshape(info["shape"])
    return out, meta


def decode(body: bytes, content_type: str | None = None) -> Features:
    """Decodes a pushdown response body."""
    if (content_type or "").startswith("application/x-npy") or body[:6] == b"\x93NUMPY":
        return Features(features=np.load(io.BytesIO(body), allow_pickle=False))
    tensors, meta = read_safetensors(body)
    keys = json.loads(meta["keys"]) if "keys" in meta else []
    augmented = [Drawn.parse(d) for d in json.loads(meta["augmented"])] if "augmented" in meta else []
    return Features(
        features=tensors["features"],
        labels=tensors.get("labels"),
        keys=keys,
        split=meta.get("split"),
        model=meta.get("model"),
        augmented=augmented,
    )
