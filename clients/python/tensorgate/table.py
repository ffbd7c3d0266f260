"""Parquet datasets on the compute side (ADR 0016): a Parquet file in Hugging Face `datasets`'
layout is a shard whose rows are samples. Its row count comes from its footer (two ranged reads),
and a raw file is decoded here as the gateway would for the no-pushdown baseline. Needs pyarrow
(`pip install pyarrow`) for the baseline and the counts; pushdowns of Parquet files need nothing
more than any other shard."""

from __future__ import annotations

import io

import numpy as np

from .codec import Features
from .suffix import preprocess

#: Parquet's magic, at both ends of a file.
MAGIC = b"PAR1"
#: The image column when none is named (the gateway's default, `datasets`' usual name).
DEFAULT_COLUMN = "image"
#: A text model's column when none is named (the gateway's default).
DEFAULT_TEXT_COLUMN = "text"
#: Names one row group of a Parquet file as a shard of its own (`ShardDataset(row_groups=True)`):
#: `"<key>#row-group=<n>"`, fetched with the gateway's `row-groups` field.
ROW_GROUP_MARK = "#row-group="


def row_group_unit(key: str, group: int) -> str:
    """The shard name of row group `group` of Parquet file `key`."""
    return f"{key}{ROW_GROUP_MARK}{group}"


def split_unit(unit: str) -> tuple[str, int | None]:
    """A shard name as (object key, row group), the row group `None` for a whole object."""
    key, mark, group = unit.rpartition(ROW_GROUP_MARK)
    if mark and key and group.isdigit():
        return key, int(group)
    return unit, None


def is_parquet(raw: bytes) -> bool:
    return len(raw) >= 12 and raw[:4] == MAGIC and raw[-4:] == MAGIC


class RangedObject(io.RawIOBase):
    """A stored object as a read-only, seekable file whose reads are ranged GETs: pyarrow reads a
    Parquet file's footer and the column chunks it needs through it, nothing else."""

    def __init__(self, client, bucket: str, key: str):
        self.s3, self.bucket, self.key = client.s3, bucket, key
        self.size = client.s3.head_object(Bucket=bucket, Key=key)["ContentLength"]
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence] + offset
        return self.pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.size - self.pos)
        if n <= 0:
            return 0
        data = self.s3.get_object(Bucket=self.bucket, Key=self.key, Range=f"bytes={self.pos}-{self.pos + n - 1}")[
            "Body"].read()
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def first_rows(client, bucket: str, key: str, info: dict, column: str | None, n: int) -> tuple[bytes, int, int]:
    """The first `n` rows of a stored Parquet file (its input column and `label`) as a small
    Parquet file, read by ranges (the footer, then the first row group's chunks of those columns);
    and the file's rows and bytes. The planner's profile decodes them for the baseline's cost."""
    import pyarrow.parquet as pq

    obj = RangedObject(client, bucket, key)
    pf = pq.ParquetFile(obj)
    name = column or (DEFAULT_TEXT_COLUMN if info.get("text") else DEFAULT_COLUMN)
    columns = [c for c in (name, "label") if c in pf.schema_arrow.names]
    out = io.BytesIO()
    pq.write_table(pf.read_row_group(0, columns=columns).slice(0, n), out)
    return out.getvalue(), pf.metadata.num_rows, obj.size


def _metadata(client, bucket: str, key: str):
    """A stored Parquet file's footer: one ranged read of its last 8 bytes (the footer's
    length), one of the footer."""
    import pyarrow.parquet as pq

    tail = client.s3.get_object(Bucket=bucket, Key=key, Range="bytes=-8")["Body"].read()
    if len(tail) != 8 or tail[4:] != MAGIC:
        raise ValueError(f"{bucket}/{key} is not a Parquet file")
    n = int.from_bytes(tail[:4], "little")
    footer = client.s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=-{n + 8}")["Body"].read()
    # The footer alone, framed as a file: its metadata does not need the pages.
    return pq.read_metadata(io.BytesIO(MAGIC + footer))


def row_count(client, bucket: str, key: str) -> int:
    """The rows of a stored Parquet file, from its footer."""
    return _metadata(client, bucket, key).num_rows


def row_group_counts(client, bucket: str, key: str) -> list[int]:
    """The rows of each row group of a stored Parquet file, from its footer."""
    md = _metadata(client, bucket, key)
    return [md.row_group(i).num_rows for i in range(md.num_row_groups)]


def one_row_group(source, group: int) -> tuple[bytes, int]:
    """Row group `group` of a Parquet file (its bytes, or a file such as `RangedObject`, which
    then reads the footer and that group's column chunks only) as a Parquet file of its own, and
    the number of its first row in the whole file."""
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source)
    if not 0 <= group < pf.metadata.num_row_groups:
        raise ValueError(f"the Parquet file has {pf.metadata.num_row_groups} row groups, not {group + 1}")
    first = sum(pf.metadata.row_group(i).num_rows for i in range(group))
    out = io.BytesIO()
    pq.write_table(pf.read_row_group(group), out)
    return out.getvalue(), first


def decode_table(raw: bytes, info: dict, column: str | None = None, first_row: int = 0, augment=None) -> Features:
    """A raw Parquet file decoded here (the baseline): every row's image preprocessed as the
    gateway would (`info` is the model's `/v1/models` entry), keys from the image's `path`, else
    an `id` column (strings or integers), else the row number (counted from `first_row`: a row
    group's place in its file), labels from an integer `label` column. For a text model, the
    rows' texts (an array of `str`, which `SuffixRunner("none")` tokenizes), keyed the same way."""
    import pyarrow.parquet as pq
    import pyarrow.types as pat

    name = column or (DEFAULT_TEXT_COLUMN if info.get("text") else DEFAULT_COLUMN)
    table = pq.read_table(io.BytesIO(raw))
    if name not in table.column_names:
        raise ValueError(f"the Parquet file has no column {name!r}; its columns: {', '.join(table.column_names)}")
    col = table.column(name).combine_chunks()
    if info.get("text"):
        if not (pat.is_string(col.type) or pat.is_large_string(col.type)) or col.null_count:
            raise ValueError(f"column {name!r} is not a column of texts")
        return Features(features=np.array(col.to_pylist(), dtype=object), labels=_labels(table, name),
                        keys=_keys(table, name, [None] * len(col), first_row))
    if pat.is_struct(col.type):
        images, paths = col.field("bytes").to_pylist(), col.field("path").to_pylist() if any(
            f.name == "path" for f in col.type) else [None] * len(col)
    else:
        images, paths = col.to_pylist(), [None] * len(col)
    keys = _keys(table, name, paths, first_row)
    if any(b is None for b in images):
        raise ValueError(f"row {images.index(None)} has no image")
    feats = np.stack([preprocess(b, info, augment, k) for b, k in zip(images, keys)])
    return Features(features=feats, labels=_labels(table, name), keys=keys)


def _keys(table, column: str, paths: list, first_row: int) -> list[str]:
    """Each row's key as the gateway gives it: its image's path, else its `id` (a string or integer
    column other than the input), else its number in the file."""
    import pyarrow.types as pat

    ids = [None] * len(paths)
    if "id" in table.column_names and column != "id":
        kind = table.column("id").type
        if pat.is_integer(kind) or pat.is_string(kind) or pat.is_large_string(kind):
            ids = table.column("id").to_pylist()
    return [p if p is not None else str(k) if k is not None else str(first_row + i)
            for i, (p, k) in enumerate(zip(paths, ids))]


def _labels(table, column: str) -> np.ndarray | None:
    """An integer `label` column without nulls (other than the input column), as the gateway reads it."""
    import pyarrow.types as pat

    if "label" in table.column_names and column != "label" and pat.is_integer(table.column("label").type):
        values = table.column("label").to_pylist()
        if all(v is not None for v in values):
            return np.array(values, dtype=np.int64)
    return None
