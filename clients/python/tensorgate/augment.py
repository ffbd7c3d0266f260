"""Random augmentation owned by the client (ADR 0032): the same draws the gateway makes.

A pushdown request may name torchvision's `RandomResizedCrop` and `RandomHorizontalFlip` and a
seed (`Augment.fields()`); the gateway crops, resizes and flips each image as the sample's draws
say. The draws depend only on the seed, the sample's key and the image's size, so this module
computes the same boxes and flips on the client: a trainer without pushdown (the reference
pipeline, `Augment.apply` on a PIL image), any DDP rank or worker, and a resumed epoch all see
the same samples. `Augment.for_epoch(e)` derives an epoch's seed, so every epoch draws anew.

The generator (the gateway's `src/pushdown/augment.rs` states the same):
- a sample's stream is the first 8 bytes (big-endian) of
  SHA-256(`tensorgate-augment-v1` NUL seed-in-decimal NUL key); the key is the object's key for a
  single image, the sample's key (`__key__`) in a shard or Parquet file;
- draw `n` is SplitMix64's output function of `stream + (n + 1) * 0x9E3779B97F4A7C15` (mod 2^64);
- a uniform number in [0, 1) is a draw's top 53 bits times 2^-53; a whole number in [0, m) is
  `(draw * m) >> 64`;
- `RandomResizedCrop`'s try t (0 to 9) uses draws 2t (scale) and 2t + 1 (log ratio), the box's top
  and left draws 20 and 21 (torchvision's `get_params`, its ten tries and its centre-crop
  fallback); the flip is draw 63 < p.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_TRIES, _TOP, _LEFT, _FLIP = 10, 20, 21, 63


def _splitmix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class Draws:
    """One sample's counter-based stream."""

    def __init__(self, seed: int, key: str):
        digest = hashlib.sha256(b"tensorgate-augment-v1\0" + str(seed).encode() + b"\0" + key.encode()).digest()
        self.stream = int.from_bytes(digest[:8], "big")

    def draw(self, n: int) -> int:
        return _splitmix((self.stream + (n + 1) * _GOLDEN) & _MASK)

    def uniform(self, n: int) -> float:
        return (self.draw(n) >> 11) * (1.0 / (1 << 53))

    def uniform_in(self, n: int, low: float, high: float) -> float:
        return low + (high - low) * self.uniform(n)

    def below(self, n: int, m: int) -> int:
        return (self.draw(n) * m) >> 64


@dataclass(frozen=True)
class Drawn:
    """What one sample drew: its crop box `(top, left, height, width)` (or None) and its flip."""

    box: tuple[int, int, int, int] | None
    flip: bool

    @classmethod
    def parse(cls, header: str) -> "Drawn":
        """From a response's `x-tensorgate-augmented` (`top,left,height,width,flip`)."""
        *box, flip = header.split(",")
        return cls(None if box[0] == "" else tuple(int(v) for v in box), flip == "1")


@dataclass(frozen=True)
class Augment:
    """`RandomResizedCrop(scale, ratio)` (when `crop`) then `RandomHorizontalFlip(p)` (when
    `flip` is not None), drawn from `seed`. torchvision's defaults."""

    seed: int
    crop: bool = True
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0)
    flip: float | None = 0.5

    @classmethod
    def from_torchvision(cls, transforms, seed: int) -> "Augment":
        """From torchvision transforms (a list, or a `Compose`): a `RandomResizedCrop` and/or a
        `RandomHorizontalFlip`, in that order; other transforms (`ToTensor`, `Normalize`) are the
        model's manifest's and are skipped. Raises on a crop with other than bilinear
        interpolation or a transform the gateway does not apply."""
        from torchvision import transforms as T
        from torchvision.transforms import InterpolationMode

        ts = list(getattr(transforms, "transforms", transforms))
        crop, flip, kw = False, None, {}
        for t in ts:
            name = type(t).__name__
            if name == "RandomResizedCrop":
                if t.interpolation != InterpolationMode.BILINEAR:
                    raise ValueError("the gateway resizes bilinearly (with antialiasing)")
                crop, kw = True, {"scale": tuple(t.scale), "ratio": tuple(t.ratio)}
            elif name == "RandomHorizontalFlip":
                flip = float(t.p)
            elif not isinstance(t, (T.ToTensor, T.Normalize, T.PILToTensor, T.ConvertImageDtype)):
                raise ValueError(f"{name} is not applied by the gateway (RandomResizedCrop, RandomHorizontalFlip)")
        return cls(seed=seed, crop=crop, flip=flip, **kw)

    def for_epoch(self, epoch: int) -> "Augment":
        """The augmentation of epoch `epoch`: its own seed, derived from this one."""
        return replace(self, seed=_splitmix((self.seed + (epoch + 1) * _GOLDEN) & _MASK))

    def spec(self) -> str:
        """The request's `augment` field."""
        ops = []
        if self.crop:
            ops.append(f"RandomResizedCrop(scale={_num(self.scale[0])}:{_num(self.scale[1])},"
                       f"ratio={_num(self.ratio[0])}:{_num(self.ratio[1])})")
        if self.flip is not None:
            ops.append(f"RandomHorizontalFlip(p={_num(self.flip)})")
        return ";".join(ops)

    def fields(self) -> dict[str, str]:
        """The request fields (`augment`, `seed`)."""
        return {"augment": self.spec(), "seed": str(self.seed)}

    def draw(self, key: str, width: int, height: int) -> Drawn:
        """What sample `key` of an image `width` x `height` draws."""
        d = Draws(self.seed, key)
        box = self._place(d, width, height) if self.crop else None
        return Drawn(box, self.flip is not None and d.uniform(_FLIP) < self.flip)

    def _place(self, d: Draws, width: int, height: int) -> tuple[int, int, int, int]:
        area = float(width) * float(height)
        log0, log1 = math.log(self.ratio[0]), math.log(self.ratio[1])
        for t in range(_TRIES):
            target = area * d.uniform_in(2 * t, *self.scale)
            aspect = math.exp(d.uniform_in(2 * t + 1, log0, log1))
            w = round(math.sqrt(target * aspect))
            h = round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                top = d.below(_TOP, height - h + 1)
                left = d.below(_LEFT, width - w + 1)
                return top, left, h, w
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, min(height, round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            w, h = min(width, round(height * self.ratio[1])), height
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def apply(self, image, key: str, size: tuple[int, int] | None = None, evaluate=None):
        """The reference pipeline on a PIL image: torchvision's functional `resized_crop`
        (bilinear, antialiased) to `size` `(height, width)` with this sample's box, or without a
        crop the evaluation transform `evaluate` (resize and centre crop); then `hflip` if drawn.
        Returns the image and what was drawn."""
        from PIL import Image

        drawn = self.draw(key, image.width, image.height)
        if drawn.box is not None:
            top, left, h, w = drawn.box
            image = image.crop((left, top, left + w, top + h)).resize((size[1], size[0]), Image.BILINEAR)
        elif evaluate is not None:
            image = evaluate(image)
        if drawn.flip:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        return image, drawn


def _num(x: float) -> str:
    """A number as the gateway reads it back exactly (shortest round-trip form)."""
    return repr(float(x)) if x != int(x) else str(int(x))
