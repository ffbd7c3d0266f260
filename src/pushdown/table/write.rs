//! A Parquet output: the source's other columns copied as encoded chunks, the features in
//! place of the input column, in the source's row groups ([`write`]).

use std::sync::Arc;

use bytes::Bytes;
use parquet::basic::{Compression, LogicalType, Repetition, Type as Physical};
use parquet::column::writer::ColumnCloseResult;
use parquet::data_type::{ByteArray, FixedLenByteArray, FixedLenByteArrayType, FloatType};
use parquet::file::metadata::{ColumnChunkMetaData, KeyValue};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::{SerializedColumnWriter, SerializedFileWriter};
use parquet::schema::types::{ColumnPath, Type, TypePtr};

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
/// list as long as the per-row values), in the source's row groups, Snappy pages. The file's
/// key-value metadata is kept, without the source's Arrow schema (the columns changed), with
/// Hugging Face `datasets`' feature description updated (the input column gone, the features
/// added as a sequence of that length) and a `tensorgate` entry naming the model, the split and
/// the feature shape.
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
    let schema = output_schema(kept, dtype)?;
    let provenance =
        Provenance { model: model.0, split: model.1, shape: &shape[1..], dtype: dtype.name(), column: &kept.column };
    let props = WriterProperties::builder()
        .set_key_value_metadata(Some(output_metadata(kept, &provenance, dtype)))
        // Feature values rarely repeat: a dictionary would be tried, then written beside the
        // plain pages it falls back to.
        .set_column_dictionary_enabled(
            ColumnPath::new(vec![FEATURES_COLUMN.into(), LIST_GROUP.into(), LIST_ELEMENT.into()]),
            false,
        )
        .set_compression(Compression::SNAPPY)
        .build();
    let mut writer =
        SerializedFileWriter::new(Vec::new(), Arc::new(schema), Arc::new(props)).map_err(|e| internal(&e))?;
    let levels = Levels::new(per);
    let mut done = 0usize;
    for group in kept.groups.iter().filter(|g| g.rows > 0) {
        let mut rg = writer.next_row_group().map_err(|e| internal(&e))?;
        for chunk in &group.chunks {
            let close = ColumnCloseResult {
                bytes_written: u64::try_from(chunk.compressed_size()).unwrap_or(0),
                rows_written: group.rows as u64,
                metadata: chunk.clone(),
                bloom_filter: None,
                column_index: None,
                offset_index: None,
            };
            rg.append_column(&group.source, close).map_err(|e| internal(&e))?;
        }
        let mut col = rg.next_column().map_err(|e| internal(&e))?.ok_or_else(|| internal(&"no features column"))?;
        levels.write(&mut col, &features[done * per..(done + group.rows) * per], dtype)?;
        col.close().map_err(|e| internal(&e))?;
        rg.close().map_err(|e| internal(&e))?;
        done += group.rows;
    }
    writer.into_inner().map_err(|e| internal(&e))
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
    let mut metadata: Vec<KeyValue> =
        kept.metadata.iter().filter(|kv| !matches!(kv.key.as_str(), "ARROW:schema" | "tensorgate")).cloned().collect();
    if let Some(at) = metadata.iter().position(|kv| kv.key == HF_METADATA) {
        match metadata[at].value.as_deref().and_then(|hf| hf_features(hf, &kept.column, item_name(dtype))) {
            Some(updated) => metadata[at].value = Some(updated),
            None => {
                metadata.remove(at);
            }
        }
    }
    metadata.push(KeyValue::new("tensorgate".to_owned(), serde_json::to_string(provenance).expect("serializable")));
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

    /// Writes a group's `features` as whole rows, a slice at a time: the levels (and, for f16, a
    /// handle per value) beside the features stay bounded, whatever the group's size.
    fn write(&self, col: &mut SerializedColumnWriter<'_>, features: &[f32], dtype: Dtype) -> Result<(), PushdownError> {
        for slice in features.chunks(self.rows_per_write * self.per) {
            let (defs, reps) = (&self.defs[..slice.len()], &self.reps[..slice.len()]);
            let written = if dtype == Dtype::F16 {
                let buf =
                    Bytes::from(slice.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect::<Vec<u8>>());
                let halves: Vec<FixedLenByteArray> = (0..slice.len())
                    .map(|i| FixedLenByteArray::from(ByteArray::from(buf.slice(2 * i..2 * i + 2))))
                    .collect();
                col.typed::<FixedLenByteArrayType>().write_batch(&halves, Some(defs), Some(reps))
            } else {
                col.typed::<FloatType>().write_batch(slice, Some(defs), Some(reps))
            };
            written.map_err(|e| internal(&e))?;
        }
        Ok(())
    }
}

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
