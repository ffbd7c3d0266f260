"""Text encoders (ADR 0017): all-MiniLM-L6-v2 with its trained weights, its texts tokenized by the
gateway (Hugging Face's `tokenizers` crate) from a plain text object, JSON Lines and a Parquet
text column, pushed down at the embeddings (a prefix without the attention mask), two encoder
layers, the pooled output and the sentence embedding:
every output equal to Python `tokenizers` + onnxruntime on the same ONNX file (relative L2 at
most 1e-5); bad inputs get a clear 4xx."""

import io
import json

import numpy as np
import onnx
import onnxruntime as ort
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from conftest import ROOT, metric
from test_parquet import assert_refused, parquet_bytes, safetensors_of
from test_pushdown import pushdown_get, rel_l2

MODEL = ROOT / "models" / "minilm"
SPLITS = ["embeddings", "layer2", "layer4", "pool", "embedding"]
TEXTS = [
    "A man is playing a guitar.",
    "Someone plays an acoustic guitar on a stage in front of a small crowd.",
    "The stock market fell sharply today.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein — naïve café façade, 東京.",
    "",
    # Longer than the model's 128 tokens: truncated, as the tokenizer file says.
    " ".join(f"word{i} and more words about item {i}" for i in range(60)),
] + [f"sentence number {i} talks about topic {i % 7} in some detail." for i in range(14)]


@pytest.fixture(scope="module")
def reference():
    """`texts` -> {split: outputs}: Python `tokenizers` with the model's tokenizer.json, then
    onnxruntime on the model with the split tensors exposed."""
    model = onnx.load(MODEL / "model.onnx")
    for name in SPLITS:
        if name not in [o.name for o in model.graph.output]:
            model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString())
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))

    def run(texts: list[str]) -> dict[str, np.ndarray]:
        enc = tokenizer.encode_batch(texts)
        feed = {"input_ids": np.array([e.ids for e in enc], np.int64),
                "attention_mask": np.array([e.attention_mask for e in enc], np.int64)}
        return dict(zip(SPLITS, session.run(SPLITS, feed)))

    return run


def test_a_plain_text_object_gives_the_references_outputs_at_each_split(s3, bucket, reference):
    text = TEXTS[1]
    s3.put_object(Bucket=bucket, Key="note.txt", Body=text.encode())
    want = reference([text])
    for split in SPLITS:
        got = pushdown_get(s3, bucket, "note.txt", model="minilm", split=split)
        y = np.load(io.BytesIO(got["Body"].read()))
        assert y.shape == want[split].shape[1:], split
        err = rel_l2(y, want[split][0])
        print(f"text, {split}: rel L2 {err:.1e}")
        assert err <= 1e-5, split


def test_json_lines_and_a_parquet_text_column_give_every_rows_outputs(s3, bucket, reference):
    want = reference(TEXTS)
    labels = [i % 3 for i in range(len(TEXTS))]
    lines = "\n".join(json.dumps({"id": f"doc-{i}", "text": t, "label": l}) for i, (t, l) in enumerate(zip(TEXTS, labels)))
    s3.put_object(Bucket=bucket, Key="docs.jsonl", Body=lines.encode())
    table = pa.table({"label": pa.array(labels, pa.int64()), "text": pa.array(TEXTS),
                      "source": pa.array([f"s{i}" for i in range(len(TEXTS))])})
    s3.put_object(Bucket=bucket, Key="docs.parquet", Body=parquet_bytes(table, row_group_size=8))
    # An `id` column keys the rows as JSON Lines' `id` field does (else a row's number in its file).
    ids = table.append_column("id", pa.array([f"doc-{i}" for i in range(len(TEXTS))]))
    s3.put_object(Bucket=bucket, Key="docs-id.parquet", Body=parquet_bytes(ids, row_group_size=8))
    from tensorgate.table import decode_table

    assert decode_table(parquet_bytes(ids), {"text": {"length": 128}}).keys == [f"doc-{i}" for i in range(len(TEXTS))]
    for key in ("docs.jsonl", "docs.parquet", "docs-id.parquet"):
        for split in ("layer4", "embedding"):
            got = pushdown_get(s3, bucket, key, model="minilm", split=split)
            tensors, meta = safetensors_of(got["Body"].read())
            assert rel_l2(tensors["features"], want[split]) <= 1e-5, (key, split)
            assert tensors["labels"].tolist() == labels
            keys = json.loads(meta["keys"])
            assert keys == ([str(i) for i in range(len(TEXTS))] if key == "docs.parquet"
                            else [f"doc-{i}" for i in range(len(TEXTS))])
    # Parquet out: the other columns kept, the sentence embeddings added, the row groups kept.
    got = pushdown_get(s3, bucket, "docs.parquet", model="minilm", split="embedding", format="parquet", dtype="f16")
    out = pq.ParquetFile(io.BytesIO(got["Body"].read()))
    assert out.metadata.num_row_groups == 3
    read = out.read()
    assert read.select(["label", "source"]).equals(table.select(["label", "source"]))
    emb = np.array(read.column("features").to_pylist(), dtype=np.float32)
    assert rel_l2(emb, want["embedding"]) <= 1e-3  # f16 on the wire


def test_texts_run_in_batches_cut_to_their_longest_text_where_the_output_is_pooled(s3, bucket, gateway, reference):
    """Length bucketing (ADR 0017): texts go to the engine shortest first and a batch runs at its
    longest text rounded up to 8 tokens where padding cannot reach the output (`pool`); sequence
    outputs (`layer2`) keep the model's 128. Both equal the reference, which pads to 128; the
    token counters say what ran."""
    admin = gateway[1]
    short = [f"a cat {i}." for i in range(24)]
    long = [" ".join(["storage"] * (60 + i)) + "." for i in range(24)]
    texts = [t for pair in zip(short, long) for t in pair]  # interleaved: the order is the gateway's job
    s3.put_object(Bucket=bucket, Key="mixed.jsonl", Body="\n".join(json.dumps({"text": t}) for t in texts).encode())
    want = reference(texts)
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    lengths = [sum(e.attention_mask) for e in tokenizer.encode_batch(texts)]
    assert max(lengths) < 100 < 128
    attended = sum(lengths)

    def tokens(split: str, kind: str) -> float:
        return metric(admin, f'tensorgate_pushdown_tokens_total{{model="minilm",split="{split}",kind="{kind}"}}')

    for split in ("pool", "layer2"):
        before = tokens(split, "attended"), tokens(split, "padding")
        got = pushdown_get(s3, bucket, "mixed.jsonl", model="minilm", split=split)
        tensors, _ = safetensors_of(got["Body"].read())
        assert rel_l2(tensors["features"], want[split]) <= 1e-5, split
        ran = tokens(split, "attended") - before[0], tokens(split, "padding") - before[1]
        assert ran[0] == attended, split
        if split == "layer2":
            assert ran[1] == len(texts) * 128 - attended
        else:
            # Every batch ran at most at the longest text rounded up to 8, never at 128.
            assert ran[1] <= len(texts) * -(-max(lengths) // 8) * 8 - attended
            print(f"pool: {ran[1]:.0f} padding tokens; at 128: {len(texts) * 128 - attended}")


def test_bad_text_inputs_get_a_clear_error(s3, bucket):
    cases = [
        ("bad.jsonl", b'{"text": "fine"}\n{"text": 5}\n', {}, 400, "line 2: no string field"),
        ("other-field.jsonl", b'{"body": "x"}\n', {}, 400, "no string field \"text\""),
        ("huge.txt", b"a " * (600 * 1024), {}, 400, "at most 1048576"),
        ("latin1.txt", "caf\xe9".encode("latin-1"), {}, 400, "UTF-8"),
        ("numbers.parquet", parquet_bytes(pa.table({"text": pa.array([1, 2])})), {}, 400, "not texts"),
        ("words.txt", b"plain words", {"column": "text"}, 400, "neither"),
    ]
    assert_refused(s3, bucket, "minilm", cases)
