//! A Parquet output: the source's other columns copied as encoded chunks, the features in
//! place of the input column, in the source's row groups ([`write`]).
//!
//! Its outline (`super::outline`) goes through the same writer ([`OutputWriter`]), and the
//! features column is written so that
//! its bytes' layout depends on the row count and the row length only, never on the values:
//! uncompressed, `PLAIN`, no dictionary, no statistics. Its chunk is encoded apart
//! ([`features_chunk`]) and spliced in as the kept chunks are, so a row group's bytes are the same
//! in the whole output and in an output of that group alone (`row-groups`).

use std::io::Write;
use std::sync::Arc;

use bytes::Bytes;
use parquet::basic::{Compression, Encoding, LogicalType, Repetition, Type as Physical};
use parquet::column::writer::{ColumnCloseResult, ColumnWriter, get_column_writer, get_typed_column_writer_mut};
use parquet::data_type::{ByteArray, FixedLenByteArray, FixedLenByteArrayType, FloatType};
use parquet::file::metadata::{ColumnChunkMetaData, KeyValue};
use parquet::file::properties::{EnabledStatistics, WriterProperties, WriterPropertiesPtr};
use parquet::file::reader::ChunkReader;
use parquet::file::writer::{SerializedFileWriter, SerializedPageWriter, TrackedWrite};
use parquet::schema::types::{ColumnDescPtr, ColumnPath, SchemaDescriptor, Type, TypePtr};

use super::super::error::PushdownError;
use super::super::spec::Dtype;
use super::layout::{FEATURES_COLUMN, LIST_ELEMENT, LIST_GROUP, WRITE_VALUES};
use super::source::Source;

/// One row group's columns but the input one, encoded as the source holds them.
#[derive(Debug)]
pub(super) struct KeptGroup {
    /// The bytes read that hold the chunks.
    pub(super) source: Source,
    pub(super) rows: usize,
    pub(super) chunks: Vec<ColumnChunkMetaData>,
}

/// A Parquet source's columns but the input one, as encoded chunks, in its row groups: what a
/// Parquet output ([`write`]) keeps.
#[derive(Debug)]
pub struct Kept {
    /// The schema's root name and its columns but the input one, as the source describes them.
    pub(super) name: String,
    pub(super) roots: Vec<TypePtr>,
    /// The source's key-value metadata.
    pub(super) metadata: Vec<KeyValue>,
    pub(super) groups: Vec<KeptGroup>,
    /// The input column, which the output leaves out.
    pub(super) column: String,
    /// Whether these are every row group's (the whole file's output, whose footer is padded:
    /// [`FOOTER_PADDING`]).
    pub(super) whole: bool,
}

/// What the output's `tensorgate` metadata entry says of its features.
#[derive(Debug, serde::Serialize)]
pub struct Provenance<'a> {
    pub(crate) model: &'a str,
    pub(crate) split: &'a str,
    /// One row's feature shape (the column holds it flattened, row-major).
    pub(crate) shape: &'a [usize],
    pub(crate) dtype: &'a str,
    /// The input column.
    pub(crate) column: &'a str,
}

/// A Parquet output: `kept`'s columns, copied as they are encoded, then the features (`rows x
/// per-row values`, row-major) as a list column [`FEATURES_COLUMN`] of `f32` or `f16` (each row's
/// list as long as the per-row values), in the source's row groups. The file's key-value
/// metadata is kept, without the source's Arrow schema (the columns changed), with Hugging Face
/// `datasets`' feature description updated (the input column gone, the features added as a
/// sequence of that length) and a `tensorgate` entry naming the model, the split and the feature
/// shape.
///
/// # Errors
/// `Internal` if the row counts disagree (a bug) or a kept chunk lies outside the bytes read;
/// `InvalidArgument` for `bf16`.
pub fn write(
    kept: &Kept,
    features: &[f32],
    shape: &[usize],
    dtype: Dtype,
    model: (&str, &str),
) -> Result<Vec<u8>, PushdownError> {
    let rows = shape.first().copied().unwrap_or(0);
    let per = shape[1..].iter().product::<usize>();
    if per == 0
        || features.len() != rows.saturating_mul(per)
        || kept.groups.iter().map(|g| g.rows).sum::<usize>() != rows
    {
        return Err(internal(&format!("{} feature values for {rows} rows of {per}", features.len())));
    }
    let mut out = OutputWriter::new(kept, &shape[1..], dtype, model, Vec::new())?;
    let mut done = 0usize;
    for group in kept.groups.iter().filter(|g| g.rows > 0) {
        let values = &features[done * per..(done + group.rows) * per];
        let (chunk, close) = out.features_chunk(group.rows, Some(values), Vec::new())?;
        out.group(&group.source, &group.chunks, group.rows, (&Bytes::from(chunk), close))?;
        done += group.rows;
    }
    out.finish()
}

/// An output being written: the file writer, and how its features column is encoded.
pub(super) struct OutputWriter<W: Write + Send> {
    writer: SerializedFileWriter<W>,
    features: ColumnDescPtr,
    props: WriterPropertiesPtr,
    levels: Levels,
    dtype: Dtype,
}

impl<W: Write + Send> OutputWriter<W> {
    /// A writer of `kept`'s columns and features of one row's `shape`, into `sink`.
    pub(super) fn new(
        kept: &Kept,
        shape: &[usize],
        dtype: Dtype,
        model: (&str, &str),
        sink: W,
    ) -> Result<Self, PushdownError> {
        let per = shape.iter().product::<usize>();
        let schema = Arc::new(output_schema(kept, dtype)?);
        let provenance =
            Provenance { model: model.0, split: model.1, shape, dtype: dtype.name(), column: &kept.column };
        let path = ColumnPath::new(vec![FEATURES_COLUMN.into(), LIST_GROUP.into(), LIST_ELEMENT.into()]);
        let props = Arc::new(
            WriterProperties::builder()
                .set_key_value_metadata(Some(output_metadata(kept, &provenance, dtype)))
                .set_compression(Compression::SNAPPY)
                // The features' layout follows from the rows alone (module docs). Feature
                // values rarely repeat or compress (a dictionary would be tried, then written
                // beside the plain pages it falls back to).
                .set_column_compression(path.clone(), Compression::UNCOMPRESSED)
                .set_column_dictionary_enabled(path.clone(), false)
                .set_column_encoding(path.clone(), Encoding::PLAIN)
                .set_column_statistics_enabled(path, EnabledStatistics::None)
                .build(),
        );
        let descr = SchemaDescriptor::new(schema.clone());
        let features = descr.column(descr.num_columns() - 1);
        let writer = SerializedFileWriter::new(sink, schema, props.clone()).map_err(|e| internal(&e))?;
        Ok(Self { writer, features, props, levels: Levels::new(per.max(1)), dtype })
    }

    /// Bytes written so far.
    pub(super) fn position(&self) -> u64 {
        self.writer.bytes_written() as u64
    }

    /// The features column's chunk of `rows` rows of `values` (zeros when `None`), encoded into
    /// `sink` (its offsets from the sink's start).
    pub(super) fn features_chunk<S: Write + Send>(
        &self,
        rows: usize,
        values: Option<&[f32]>,
        sink: S,
    ) -> Result<(S, ColumnCloseResult), PushdownError> {
        let mut tracked = TrackedWrite::new(sink);
        let close = {
            let pages = Box::new(SerializedPageWriter::new(&mut tracked));
            let mut col = get_column_writer(self.features.clone(), self.props.clone(), pages);
            self.levels.write(&mut col, rows, values, self.dtype)?;
            col.close().map_err(|e| internal(&e))?
        };
        Ok((tracked.into_inner().map_err(|e| internal(&e))?, close))
    }

    /// One row group of `rows` rows: the kept `chunks`, read from `kept` at their offsets, then
    /// the features chunk (`features`: where its bytes are read from, and its description).
    /// Returns the group's bytes `[start, end)` in the output.
    pub(super) fn group<K: ChunkReader, F: ChunkReader>(
        &mut self,
        kept: &K,
        chunks: &[ColumnChunkMetaData],
        rows: usize,
        features: (&F, ColumnCloseResult),
    ) -> Result<(u64, u64), PushdownError> {
        let start = self.position();
        let mut rg = self.writer.next_row_group().map_err(|e| internal(&e))?;
        for chunk in chunks {
            let close = ColumnCloseResult {
                bytes_written: u64::try_from(chunk.compressed_size()).unwrap_or(0),
                rows_written: rows as u64,
                metadata: chunk.clone(),
                bloom_filter: None,
                column_index: None,
                offset_index: None,
            };
            rg.append_column(kept, close).map_err(|e| internal(&e))?;
        }
        rg.append_column(features.0, features.1).map_err(|e| internal(&e))?;
        rg.close().map_err(|e| internal(&e))?;
        Ok((start, self.position()))
    }

    pub(super) fn finish(self) -> Result<W, PushdownError> {
        self.writer.into_inner().map_err(|e| internal(&e))
    }
}

fn internal(e: &dyn std::fmt::Display) -> PushdownError {
    PushdownError::Internal(format!("writing the Parquet output: {e}"))
}

/// The kept columns' schema with the features column after them: a list of `f32`, or of
/// `f16` as 2-byte fixed-length values (Parquet's `Float16`).
fn output_schema(kept: &Kept, dtype: Dtype) -> Result<Type, PushdownError> {
    let element = match dtype {
        Dtype::F32 => Type::primitive_type_builder(LIST_ELEMENT, Physical::FLOAT),
        Dtype::F16 => Type::primitive_type_builder(LIST_ELEMENT, Physical::FIXED_LEN_BYTE_ARRAY)
            .with_length(2)
            .with_logical_type(Some(LogicalType::Float16)),
        Dtype::Bf16 => {
            return Err(PushdownError::InvalidArgument {
                field: "dtype".into(),
                message: "bf16 has no Parquet encoding: use format=safetensors".into(),
            });
        }
    };
    let element = element.with_repetition(Repetition::REQUIRED).build().map_err(|e| internal(&e))?;
    let list = Type::group_type_builder(LIST_GROUP)
        .with_repetition(Repetition::REPEATED)
        .with_fields(vec![Arc::new(element)])
        .build()
        .map_err(|e| internal(&e))?;
    let column = Type::group_type_builder(FEATURES_COLUMN)
        .with_repetition(Repetition::REQUIRED)
        .with_logical_type(Some(LogicalType::List))
        .with_fields(vec![Arc::new(list)])
        .build()
        .map_err(|e| internal(&e))?;
    let mut fields = kept.roots.clone();
    fields.push(Arc::new(column));
    Type::group_type_builder(&kept.name).with_fields(fields).build().map_err(|e| internal(&e))
}

/// The source's key-value metadata without its Arrow schema (which no longer matches) and with
/// Hugging Face's features entry updated for the new column, then this output's provenance.
fn output_metadata(kept: &Kept, provenance: &Provenance<'_>, dtype: Dtype) -> Vec<KeyValue> {
    let mut metadata: Vec<KeyValue> = kept
        .metadata
        .iter()
        .filter(|kv| !matches!(kv.key.as_str(), "ARROW:schema" | "tensorgate" | PADDING_KEY))
        .cloned()
        .collect();
    if let Some(at) = metadata.iter().position(|kv| kv.key == HF_METADATA) {
        match metadata[at].value.as_deref().and_then(|hf| hf_features(hf, &kept.column, item_name(dtype))) {
            Some(updated) => metadata[at].value = Some(updated),
            None => {
                metadata.remove(at);
            }
        }
    }
    metadata.push(KeyValue::new("tensorgate".to_owned(), serde_json::to_string(provenance).expect("serializable")));
    if kept.whole {
        metadata.push(KeyValue::new(PADDING_KEY.to_owned(), " ".repeat(FOOTER_PADDING)));
    }
    metadata
}

/// The levels of a write's rows of `per` values: every value present; a row's first value
/// starts its list, the others continue it.
struct Levels {
    per: usize,
    rows_per_write: usize,
    defs: Vec<i16>,
    reps: Vec<i16>,
}

impl Levels {
    fn new(per: usize) -> Self {
        let rows_per_write = (WRITE_VALUES / per).max(1);
        let defs = vec![1i16; rows_per_write * per];
        let reps = (0..rows_per_write * per).map(|i| i16::from(i % per > 0)).collect();
        Self { per, rows_per_write, defs, reps }
    }

    /// Writes `rows` rows of `values` (zeros when `None`) a slice of whole rows at a time: the
    /// levels (and, for f16, a handle per value) beside the features stay bounded, whatever the
    /// group's size.
    fn write(
        &self,
        col: &mut ColumnWriter<'_>,
        rows: usize,
        values: Option<&[f32]>,
        dtype: Dtype,
    ) -> Result<(), PushdownError> {
        let zeros = if values.is_none() { vec![0f32; rows.min(self.rows_per_write) * self.per] } else { Vec::new() };
        let mut done = 0usize;
        while done < rows {
            let n = (rows - done).min(self.rows_per_write);
            let slice = match values {
                Some(v) => &v[done * self.per..(done + n) * self.per],
                None => &zeros[..n * self.per],
            };
            let (defs, reps) = (&self.defs[..slice.len()], &self.reps[..slice.len()]);
            let written = if dtype == Dtype::F16 {
                let buf =
                    Bytes::from(slice.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect::<Vec<u8>>());
                let halves: Vec<FixedLenByteArray> = (0..slice.len())
                    .map(|i| FixedLenByteArray::from(ByteArray::from(buf.slice(2 * i..2 * i + 2))))
                    .collect();
                get_typed_column_writer_mut::<FixedLenByteArrayType>(col).write_batch(&halves, Some(defs), Some(reps))
            } else {
                get_typed_column_writer_mut::<FloatType>(col).write_batch(slice, Some(defs), Some(reps))
            };
            written.map_err(|e| internal(&e))?;
            done += n;
        }
        Ok(())
    }
}

/// What a whole file's output adds to its footer (an entry [`PADDING_KEY`] of spaces), so that
/// a reader's first read of its end holds nothing but footer: pyarrow reads a file's last 64 KiB
/// (its `footer_read_size`) before it parses the footer, and bytes of row groups in that read
/// would be computed before the footer is answered. With the padding, the footer read is
/// answered from the outline alone, whatever the file's size (ADR 0030).
pub(super) const FOOTER_PADDING: usize = 64 * 1024;

/// The key-value entry that pads a whole file's footer ([`FOOTER_PADDING`]).
pub(super) const PADDING_KEY: &str = "tensorgate.footer_padding";

/// Hugging Face `datasets`' entry in a Parquet file's key-value metadata: `{"info": {"features":
/// {column: feature}}}`, which `datasets` reads the columns' types from.
pub(super) const HF_METADATA: &str = "huggingface";

/// `datasets`' value type of the features.
pub(super) fn item_name(dtype: Dtype) -> &'static str {
    if dtype == Dtype::F16 { "float16" } else { "float32" }
}

/// `datasets`' feature description with the input column gone and the features added as a
/// sequence of `item` values (the `Sequence` spelling, which `datasets` reads from 2.x to 5.x;
/// without a length, as the column's Parquet type has none: `datasets` takes a description only
/// where its Arrow type is the column's); `None` when the entry is not in that shape (then it is
/// left out, and `datasets` reads the columns' types from the Parquet schema).
pub(super) fn hf_features(entry: &str, input: &str, item: &str) -> Option<String> {
    let mut doc: serde_json::Value = serde_json::from_str(entry).ok()?;
    let features = doc.get_mut("info")?.get_mut("features")?.as_object_mut()?;
    features.remove(input);
    features.insert(
        FEATURES_COLUMN.to_owned(),
        serde_json::json!({"feature": {"dtype": item, "_type": "Value"}, "_type": "Sequence"}),
    );
    serde_json::to_string(&doc).ok()
}
