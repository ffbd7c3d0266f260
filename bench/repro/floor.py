"""The storage core's floor for one augmented epoch (ADR 0032): on this core, each stage alone,
the same libraries the gateway uses: Pillow's decode, the augmented preprocessing (the client's
draws, PIL's crop + bilinear resize + flip, normalisation: `tensorgate.suffix.preprocess`) and
onnxruntime on the prefix at its best batch size. Prints one JSON line: images/s and the stages.

Run (by `run.py --mode augment`, inside the storage tier): floor.py MODEL SPLIT IMAGES SEED EPOCH"""

import io
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "repro"))
sys.path.insert(0, str(ROOT / "clients" / "python"))
import dataset  # noqa: E402
from pushdown import best_inference, per_item  # noqa: E402
from run import model_info  # noqa: E402

from tensorgate import Augment  # noqa: E402
from tensorgate.suffix import preprocess  # noqa: E402


def main() -> None:
    model, split, n, seed, epoch = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    items = [(key, jpg) for key, _, jpg in dataset.samples(n)]
    aug, info = Augment(seed=seed).for_epoch(epoch), model_info(model)
    dec = per_item(lambda kv: Image.open(io.BytesIO(kv[1])).convert("RGB").load(), items)
    both = per_item(lambda kv: preprocess(kv[1], info, aug, kv[0]), items)
    xs = np.stack([preprocess(j, info, aug, k) for k, j in items[:32]]).astype(np.float32)
    best = best_inference(model, split, xs)
    print(json.dumps({"images_per_sec": 1 / (both + best[0]), "decode_secs": dec, "preprocess_secs": both - dec,
                      "inference_secs": best[0], "batch": best[1]}))


if __name__ == "__main__":
    main()
