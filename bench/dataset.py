"""Synthetic labeled ImageNet-like data for benchmarks and examples.

Each sample is a 500x375 photo-like picture (noisy gradients and ellipses, never a flat colour)
whose class decides the palette and orientation, so a linear head on frozen features can learn it.
JPEGs come out at about 110 kB (quality 96), the ImageNet average. Samples pack into WebDataset
shards (`<key>.jpg` + `<key>.cls`) or into tensor shards of preprocessed inputs (`<key>.npy`),
the "baseline tensors" variant.

Texts (for text encoders): labeled sentences of 8 to 60 words whose topic is the class, mixed
with common words and a few words of other topics, in Parquet files as Hugging Face `datasets`
writes a text dataset (a `text` and a `label` column).

Run `python bench/dataset.py OUT_DIR N [PER_SHARD]` to write shards to a directory.
"""

import io
import sys
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

WIDTH, HEIGHT = 500, 375
QUALITY = 96


def photo(seed: int, label: int, classes: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    angle = np.pi * label / classes
    yy, xx = np.mgrid[0:HEIGHT, 0:WIDTH].astype(np.float32)
    t = (np.cos(angle) * xx / WIDTH + np.sin(angle) * yy / HEIGHT + 1) / 2
    hue = np.array([np.cos(2 * np.pi * label / classes), np.cos(2 * np.pi * (label / classes + 1 / 3)), np.cos(2 * np.pi * (label / classes + 2 / 3))])
    base = 128 + 90 * hue[None, None, :] * (t[..., None] - 0.5) * 2
    base += rng.normal(0, 14, base.shape)
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
    d = ImageDraw.Draw(img)
    for _ in range(14):
        x0, y0 = int(rng.integers(0, WIDTH - 40)), int(rng.integers(0, HEIGHT - 40))
        colour = np.clip(128 + 120 * hue + rng.normal(0, 40, 3), 0, 255).astype(int)
        d.ellipse([x0, y0, x0 + int(rng.integers(20, 140)), y0 + int(rng.integers(20, 140))], fill=tuple(int(v) for v in colour))
    return img


def jpeg(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=QUALITY)
    return buf.getvalue()


def samples(n: int, classes: int = 10, seed: int = 0):
    """[(key, label, jpeg bytes)], labels balanced and interleaved."""
    return [(f"{i:06d}", i % classes, jpeg(photo(seed * 1_000_003 + i, i % classes, classes))) for i in range(n)]


def tar_of(members) -> bytes:
    """A tar of `(name, bytes)` members (USTAR), in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def image_shards(items, per_shard: int) -> list[bytes]:
    """WebDataset shards of JPEG samples with labels."""
    out = []
    for s in range(0, len(items), per_shard):
        members = []
        for key, label, data in items[s : s + per_shard]:
            members += [(f"{key}.jpg", data), (f"{key}.cls", str(label).encode())]
        out.append(tar_of(members))
    return out


def tensor_shards(items, per_shard: int, preprocess) -> list[bytes]:
    """The same samples preprocessed to model inputs (`preprocess(jpeg) -> ndarray`), as .npy."""
    out = []
    for s in range(0, len(items), per_shard):
        members = []
        for key, label, data in items[s : s + per_shard]:
            buf = io.BytesIO()
            np.save(buf, preprocess(data))
            members += [(f"{key}.npy", buf.getvalue()), (f"{key}.cls", str(label).encode())]
        out.append(tar_of(members))
    return out


TOPICS = [
    "storage disk bucket object replica volume node cluster erasure cache network server".split(),
    "football goal match player team coach league season stadium referee score fans".split(),
    "recipe flour oven butter sugar bake dough kitchen salt pepper soup dinner".split(),
    "planet orbit telescope galaxy star comet moon astronaut rocket nebula space sky".split(),
    "election vote parliament minister law policy campaign senate court debate party tax".split(),
    "guitar piano concert song band melody drum album singer chorus stage rhythm".split(),
]
COMMON = "the a of and with on in today about very some this that was is for it they we".split()


def sentences(n: int, classes: int = 4, seed: int = 0):
    """[(key, label, text)], labels balanced and interleaved: half common words, most of the rest
    from the class's topic, one word in ten from another topic."""
    assert classes <= len(TOPICS)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        label, words = i % classes, []
        for _ in range(int(rng.integers(8, 61))):
            r = rng.random()
            pool = COMMON if r < 0.5 else TOPICS[label] if r < 0.9 else TOPICS[int(rng.integers(0, classes))]
            words.append(str(rng.choice(pool)))
        out.append((f"{i:06d}", label, " ".join(words).capitalize() + "."))
    return out


def text_shards(items, per_shard: int, row_group: int = 32) -> list[bytes]:
    """Parquet files of `text` and `label` columns (`datasets`' layout), row groups of `row_group`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = []
    for s in range(0, len(items), per_shard):
        part = items[s : s + per_shard]
        table = pa.table({"text": [t for _, _, t in part], "label": pa.array([l for _, l, _ in part], pa.int64())})
        buf = io.BytesIO()
        pq.write_table(table, buf, row_group_size=row_group)
        out.append(buf.getvalue())
    return out


if __name__ == "__main__":
    out, n = Path(sys.argv[1]), int(sys.argv[2])
    per = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    out.mkdir(parents=True, exist_ok=True)
    items = samples(n)
    for i, shard in enumerate(image_shards(items, per)):
        (out / f"shard-{i:05d}.tar").write_bytes(shard)
    print(f"{n} samples, mean JPEG {np.mean([len(d) for _, _, d in items]) / 1e3:.0f} kB, {len(range(0, n, per))} shards in {out}")
