"""Running frozen layers on the compute tier: the suffix between a split and the freeze split,
and the baseline (raw images decoded here, or texts tokenized here, every frozen layer run here)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort

NO_PUSHDOWN = "none"


def cache_dir() -> Path:
    """Where suffix graphs are kept (`TENSORGATE_CACHE_DIR`, else ~/.cache/tensorgate)."""
    return Path(os.environ.get("TENSORGATE_CACHE_DIR") or Path.home() / ".cache" / "tensorgate")


def graph(client, info: dict, split: str, to: str) -> bytes:
    """The ONNX graph of model `info` (an entry of `client.models()`) from `split` (or "input") to
    `to`, downloaded once per model version and kept on disk: the compute tier holds its model's
    layers, they are not data to move per epoch."""
    return _kept(info, f"{split}-{to}.onnx", lambda: client.suffix_graph(info["name"], split, to))


def tokenizer(client, info: dict):
    """A text model's tokenizer as the gateway runs it (`tokenizers.Tokenizer`; the file kept on
    disk as the graphs are). Needs `tokenizers` (`pip install tokenizers`)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_kept(info, "tokenizer.json", lambda: client.tokenizer(info["name"])).decode())


def _kept(info: dict, name: str, download) -> bytes:
    path = cache_dir() / f"{info['name']}-{info['sha256'][:16]}-{name}"
    if path.exists():
        return path.read_bytes()
    data = download()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(data)
    tmp.replace(path)
    return data


def prefetch_graphs(client, model: str) -> None:
    """Downloads every suffix graph a plan could need (each candidate split and the baseline)."""
    info = client.models()[model]
    names = [s["name"] for s in info["splits"]]
    for split in names[: names.index(info["freeze"])] + ["input"]:
        graph(client, info, split, info["freeze"])


#: Sessions by (model digest, from, to, threads, providers): creating one is the expensive part.
_SESSIONS: dict = {}


class SuffixRunner:
    """Runs `model`'s frozen layers from `split` to the freeze split (`to`) with onnxruntime, on
    features the gateway computed up to `split`. Identity when `split` is the freeze split.
    `split="none"` runs the whole frozen prefix on preprocessed inputs (see `preprocess`), or, for
    a text model, on texts (an array of `str`), tokenized here with the gateway's tokenizer. A
    text model's suffix from a sequence split (`layer*`) would need the attention mask, which
    pushdown outputs do not carry: refused."""

    def __init__(self, client, model: str, split: str, to: str | None = None, *, threads: int = 1,
                 providers: list[str] | None = None):
        info = client.models()[model]
        self.model, self.split, self.to = model, split, to or info["freeze"]
        self.info = info
        self.session = None
        self.tokenizer = None
        if info.get("text") and split not in (self.to, NO_PUSHDOWN):
            raise ValueError(f"{model}: a suffix from {split} needs the attention mask, which pushdown outputs "
                             f"do not carry; push down to {self.to} or read the texts ({NO_PUSHDOWN!r})")
        if info.get("text") and split == NO_PUSHDOWN:
            self.tokenizer = tokenizer(client, info)
        if split != self.to:
            key = (info["sha256"], split, self.to, threads, tuple(providers or ()))
            if key not in _SESSIONS:  # the profiler's sessions serve the loader afterwards
                onnx = graph(client, info, "input" if split == NO_PUSHDOWN else split, self.to)
                opts = ort.SessionOptions()
                opts.intra_op_num_threads = threads
                _SESSIONS[key] = ort.InferenceSession(onnx, opts, providers=providers or ["CPUExecutionProvider"])
            self.session = _SESSIONS[key]
            self.input = self.session.get_inputs()[0].name

    def __call__(self, features: np.ndarray) -> np.ndarray:
        if self.session is None:
            return features
        if self.tokenizer is not None:
            enc = self.tokenizer.encode_batch([str(t) for t in features])
            feed = {self.info["input"]: np.array([e.ids for e in enc], np.int64),
                    self.info["text"]["mask"]: np.array([e.attention_mask for e in enc], np.int64)}
            names = {i.name for i in self.session.get_inputs()}
            return self.session.run(None, {k: v for k, v in feed.items() if k in names})[0]
        return self.session.run(None, {self.input: np.ascontiguousarray(features, dtype=np.float32)})[0]


def _evaluate(img, p: dict):
    """The manifest's evaluation transform on a PIL image: Pillow's bilinear resize of the shorter
    side, then the centre crop."""
    from PIL import Image

    w, h = img.size
    s = p["resize_shorter"]
    if s:
        w, h = (s, s * h // w) if w <= h else (s * w // h, s)
        img = img.resize((w, h), Image.BILINEAR)
    ch, cw = p["crop"]
    top, left = round((h - ch) / 2), round((w - cw) / 2)
    return img.crop((left, top, left + cw, top + ch))


def preprocess(jpeg: bytes, info: dict, augment=None, key: str = "") -> np.ndarray:
    """Decodes and preprocesses one image as the gateway does (Pillow's bilinear resize, center
    crop, scale, mean/std; the model's channel order and layout): the baseline's compute-tier
    work. With `augment` (`tensorgate.augment.Augment`), sample `key`'s draw in place of the
    resize and crop, as the gateway applies it. Needs Pillow (`pip install tensorgate[images]`)."""
    from PIL import Image

    p = info["preprocess"]
    img = Image.open(io.BytesIO(jpeg)).convert("RGB")
    if augment is None:
        img = _evaluate(img, p)
    else:
        img, _ = augment.apply(img, key, size=tuple(p["crop"]), evaluate=lambda i: _evaluate(i, p))
    a = np.asarray(img, dtype=np.float32)
    if p.get("channels", "rgb").lower() == "bgr":
        a = a[..., ::-1]
    a = (a * np.float32(p["scale"]) - np.array(p["mean"], np.float32)) / np.array(p["std"], np.float32)
    return np.ascontiguousarray(a.transpose(2, 0, 1) if info["layout"] == "NCHW" else a)
