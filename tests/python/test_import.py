"""`tensorgate models import`: models exported by `torch.onnx.export` get their manifests written
(input, splits at the modules' boundaries, freeze split, preprocessing, sha256), and every proposed
split, served by a gateway over SeaweedFS without a restart, equals onnxruntime's intermediate
output of the full model on the PIL reference preprocessing (relative L2 <= 1e-5).

torchvision and timm have no wheel for this torch here, so the models are stand-ins written with
their module names: a ResNet as torchvision names its modules (conv1, bn1, relu, maxpool,
layer1-4, avgpool, fc) and a ViT as timm does (patch_embed, blocks, norm, head), random weights."""

import io
import json
import subprocess
import tomllib
import urllib.request

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import nn

from conftest import BINARY, ort_library, run_gateway
from test_pushdown import pushdown_get, reference_preprocess, rel_l2, synthetic_photo


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))) + identity)


class ResNet(nn.Module):
    def __init__(self, widths=(16, 32, 64, 128)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        cin = widths[0]
        for i, w in enumerate(widths):
            setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, 1 if i == 0 else 2), BasicBlock(w, w, 1)))
            cin = w
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, 10)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        a = ((q @ k.transpose(-2, -1)) * self.scale).softmax(dim=-1)
        return self.proj((a @ v).transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, dim, patch):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class ViT(nn.Module):
    def __init__(self, size=224, patch=32, dim=48, depth=4, heads=4):
        super().__init__()
        self.patch_embed = PatchEmbed(dim, patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def export(model: nn.Module, path) -> None:
    torch.manual_seed(0)
    torch.onnx.export(model.eval(), torch.randn(1, 3, 224, 224), str(path), input_names=["image"],
                      output_names=["logits"], dynamic_axes={"image": {0: "batch"}}, dynamo=False)


def imported(onnx_path, name, models, *extra) -> dict:
    out = subprocess.run(
        [str(BINARY), "models", "import", str(onnx_path), "--name", name, "--out", str(models), *extra],
        capture_output=True, text=True, env={"TENSORGATE_ORT_LIBRARY": ort_library()},
    )
    assert out.returncode == 0, out.stderr
    return tomllib.loads((models / name / "manifest.toml").read_text())


def reference(onnx_path, tensor: str, x: np.ndarray) -> np.ndarray:
    m = onnx.load(str(onnx_path))
    m.graph.output.append(onnx.helper.make_empty_tensor_value_info(tensor))
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run([tensor], {"image": x})[0]


def test_exported_models_are_imported_and_every_split_serves_exactly(tmp_path, seaweed):
    torch.manual_seed(0)
    models = tmp_path / "models"
    resnet, vit = tmp_path / "resnet.onnx", tmp_path / "vit.onnx"
    export(ResNet(), resnet)
    export(ViT(), vit)
    # A timm pretrained_cfg: input 224, crop_pct 0.9, its own mean and std.
    cfg = tmp_path / "pretrained_cfg.json"
    cfg.write_text(json.dumps({"input_size": [3, 224, 224], "crop_pct": 0.9, "mean": [0.5, 0.5, 0.5],
                               "std": [0.5, 0.5, 0.5], "interpolation": "bilinear"}))
    r = imported(resnet, "my-resnet", models)
    v = imported(vit, "my-vit", models, "--preprocess-config", str(cfg))
    assert [s["name"] for s in r["splits"]] == [
        "conv1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"], r["splits"]
    assert r["freeze"] == "avgpool" and r["input"] == "image" and r["input_shape"] == [3, 224, 224]
    assert r["preprocess"]["resize_shorter"] == 256 and r["preprocess"]["crop"] == [224, 224]
    assert [s["name"] for s in v["splits"]] == [
        "patch_embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"], v["splits"]
    assert v["freeze"] == "norm" and v["preprocess"]["resize_shorter"] == 248 and v["preprocess"]["mean"] == [0.5] * 3

    env = {"TENSORGATE_MODELS_DIR": str(models)}
    with run_gateway(tmp_path, seaweed=seaweed, env=env) as (endpoint, admin, s3, pid):
        with urllib.request.urlopen(f"{admin}/v1/models") as resp:
            assert sorted(m["name"] for m in json.loads(resp.read())["models"]) == ["my-resnet", "my-vit"]
        s3.create_bucket(Bucket="imported")
        photo = synthetic_photo(300, 260, seed=5)
        buf = io.BytesIO()
        photo.save(buf, format="PNG")
        s3.put_object(Bucket="imported", Key="photo.png", Body=buf.getvalue())
        for name, path, manifest in (("my-resnet", resnet, r), ("my-vit", vit, v)):
            x = reference_preprocess(photo, name, manifest)[None]
            for split in manifest["splits"]:
                got = np.load(io.BytesIO(pushdown_get(s3, "imported", "photo.png", model=name,
                                                      split=split["name"])["Body"].read()))
                want = reference(path, split["tensor"], x)[0]
                assert got.shape == want.shape, (name, split)
                assert rel_l2(got, want) <= 1e-5, (name, split["name"], rel_l2(got, want))
