//! A source object as the samples a job runs: an image, a `.npy` tensor or batch, a WebDataset
//! shard, a Parquet file's rows or texts, with what decoding them will cost, known before it is
//! paid.

use bytes::Bytes;

use super::augment::{Augment, Drawn};
use super::error::PushdownError;
use super::registry::Model;
use super::{decode, manifest, preprocess, shard, spec, table, tensor, text};

/// What a pushdown computes from.
pub(super) enum JobInput {
    /// The whole object.
    Object(Bytes),
    /// Row groups of a Parquet file read by ranges, and its checked footer.
    Table(table::Source, Box<table::Footer>),
}

/// What the object held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// One sample: the output has no batch dimension.
    Single,
    /// A `.npy` with a leading batch dimension.
    Batch,
    /// A WebDataset shard.
    Shard,
    /// A Parquet file's rows ([`table`]).
    Table,
}

impl Kind {
    /// Many samples with keys (and labels): safetensors by default, keys in its metadata.
    pub(super) fn keyed(self) -> bool {
        matches!(self, Self::Shard | Self::Table)
    }
}

/// A sample's model input: ready, or an image still to preprocess.
pub(super) enum Item {
    Ready(Vec<f32>),
    Image(Bytes),
}

pub(super) struct Parsed {
    pub(super) kind: Kind,
    pub(super) items: Vec<Item>,
    pub(super) keys: Vec<String>,
    pub(super) labels: Option<Vec<i64>>,
    /// A shard's samples' other members (`format=tar` writes them back).
    pub(super) others: Vec<Vec<(String, Bytes)>>,
    /// A Parquet file whose rows are still to decode, once the governor holds what that takes.
    pub(super) table: Option<table::Footer>,
    /// A Parquet file's other columns, for a Parquet output.
    pub(super) kept: Option<table::Kept>,
    /// `items[j]` is the source's sample `order[j]` ([`Self::put_in_engine_order`]).
    pub(super) order: Vec<usize>,
    /// What each sample drew, in source order, when the request is augmented ([`plan_images`]).
    pub(super) drawn: Vec<Option<Drawn>>,
}

impl Parsed {
    /// Unkeyed samples of `kind`.
    fn of(kind: Kind, items: Vec<Item>) -> Self {
        Self {
            kind,
            items,
            keys: Vec::new(),
            labels: None,
            others: Vec::new(),
            table: None,
            kept: None,
            drawn: Vec::new(),
            order: Vec::new(),
        }
    }

    /// A Parquet file's rows: still to decode with `footer`, or none yet.
    pub(super) fn table(footer: Option<table::Footer>) -> Self {
        Self { table: footer, ..Self::of(Kind::Table, Vec::new()) }
    }

    /// Puts the samples in the order they go to the engine: a text model's shortest first (a
    /// stable sort by attended tokens), so that a batch holds texts of like lengths and runs at
    /// its longest (`engine::feed`); any other model's in source order. A pass over every row: on
    /// the blocking thread that parsed them.
    pub(super) fn put_in_engine_order(&mut self, text_model: bool) {
        let mut order: Vec<usize> = (0..self.items.len()).collect();
        if text_model {
            order.sort_by_cached_key(|&i| match &self.items[i] {
                Item::Ready(row) => text::attended(row),
                Item::Image(_) => 0,
            });
            let mut items: Vec<Option<Item>> = std::mem::take(&mut self.items).into_iter().map(Some).collect();
            self.items = order.iter().filter_map(|&i| items[i].take()).collect();
        }
        self.order = order;
    }
}

/// A model's split by name (or index), or the error naming the splits it has.
pub(super) fn split_def<'a>(model: &'a Model, name: &str) -> Result<&'a manifest::SplitDef, PushdownError> {
    model.split(name).ok_or_else(|| PushdownError::UnknownSplit {
        model: model.manifest.name.clone(),
        split: name.to_owned(),
        known: model.split_names().join(", "),
    })
}

pub(super) fn no_preprocess(model: &str) -> PushdownError {
    PushdownError::Unsupported(format!("model {model} has no [preprocess] in its manifest: send .npy tensors"))
}

pub(super) fn name_sample(e: PushdownError, key: Option<&String>) -> PushdownError {
    match (e, key) {
        (PushdownError::BadInput(m), Some(k)) => PushdownError::BadInput(format!("sample {k:?}: {m}")),
        (e, _) => e,
    }
}

/// What one item's preprocessing takes: its scratch reservation (from its image header), and
/// what it drew when the request is augmented ([`super::augment`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Planned {
    pub(super) scratch: u64,
    pub(super) drawn: Option<Drawn>,
}

/// What `plans` (in engine order, `order`) drew, in source order.
pub(super) fn drawn_in_source_order(plans: &[Planned], order: &[usize]) -> Vec<Option<Drawn>> {
    let mut drawn = vec![None; plans.len()];
    for (plan, &i) in plans.iter().zip(order) {
        drawn[i] = plan.drawn;
    }
    drawn
}

/// Each item's [`Planned`], from its image header (read once, on a blocking thread). Refuses a
/// request whose images would decode and resample more than `limit` pixels in all, before any
/// is decoded. An augmented request's samples draw from its seed and their keys (the object's
/// key, `object`, for a single image).
pub(super) fn plan_images(
    parsed: &Parsed,
    manifest: &manifest::Manifest,
    (max_image, limit): (u64, u64),
    (augment, object): (Option<&Augment>, &str),
) -> Result<Vec<Planned>, PushdownError> {
    if augment.is_some() && parsed.items.iter().any(|i| matches!(i, Item::Ready(_))) {
        return Err(PushdownError::InvalidArgument {
            field: "augment".into(),
            message: "applies to images; this object's samples are tensors or texts".into(),
        });
    }
    let resize = manifest.preprocess.as_ref().and_then(|p| p.resize_shorter);
    let input = manifest.preprocess.as_ref().map_or([0, 0], |p| p.crop);
    let plans: Vec<(preprocess::Cost, Option<Drawn>)> = parsed
        .items
        .iter()
        .enumerate()
        .map(|(j, item)| match (item, augment) {
            (Item::Image(bytes), None) => (preprocess::cost(bytes, resize, max_image), None),
            (Item::Image(bytes), Some(a)) => {
                let Ok(head) = decode::header(bytes) else { return Default::default() };
                let i = parsed.order.get(j).copied().unwrap_or(j);
                let key = parsed.keys.get(i).map_or(object, String::as_str);
                let drawn = a.draw(key, head.width, head.height);
                let crop = drawn.crop.map(|b| (b, input));
                (preprocess::head_cost(&head, resize, crop, max_image), Some(drawn))
            }
            (Item::Ready(_), _) => Default::default(),
        })
        .collect();
    let total = plans.iter().map(|(c, _)| c.pixels).fold(0u64, u64::saturating_add);
    if total > limit {
        return Err(PushdownError::BadInput(format!(
            "the object's images decode and resize to {total} pixels in all, more than the limit of {limit} \
             (pushdown.max_request_pixels)"
        )));
    }
    Ok(plans.into_iter().map(|(c, drawn)| Planned { scratch: c.scratch_bytes, drawn }).collect())
}

/// Reads an object into model inputs (images are left encoded; see [`Pushdown::compute`]; texts
/// are tokenized here, on the blocking thread that parses).
/// `table`: the object as a Parquet file, when it is one.
pub(super) fn parse(
    object: &Bytes,
    table: Option<&table::Source>,
    model: &Model,
    source: &SourceLimits,
) -> Result<Parsed, PushdownError> {
    let manifest = &model.manifest;
    let lines = model.tokenizer.is_some() && text::is_jsonl(object);
    check_fields(source, table.is_some(), lines)?;
    if let Some(table) = table {
        if manifest.preprocess.is_none() && model.tokenizer.is_none() {
            return Err(no_preprocess(&manifest.name));
        }
        let footer = table::Footer::read(table, source.reading(model.tokenizer.is_some()))?;
        return Ok(Parsed::table(Some(footer)));
    }
    if let Some(encoder) = &model.tokenizer {
        if lines {
            let rows = text::jsonl_rows(object, source.column.as_deref())?;
            let items = rows
                .iter()
                .map(|r| encoder.encode(&r.text).map(Item::Ready).map_err(|e| name_sample(e, Some(&r.key))))
                .collect::<Result<Vec<_>, _>>()?;
            let labels = rows.iter().map(|r| r.label).collect();
            let keys = rows.into_iter().map(|r| r.key).collect();
            return Ok(Parsed {
                keys,
                labels,
                others: vec![Vec::new(); items.len()],
                ..Parsed::of(Kind::Table, items)
            });
        }
        // Token rows as `.npy` (`[2, L]` or `[N, 2, L]`) are the model's input as they are.
        if !object.starts_with(b"\x93NUMPY") {
            let row = encoder.encode(&text::plain(object)?)?;
            return Ok(Parsed::of(Kind::Single, vec![Item::Ready(row)]));
        }
    }
    if preprocess::is_image(object) {
        if manifest.preprocess.is_none() {
            return Err(no_preprocess(&manifest.name));
        }
        return Ok(Parsed::of(Kind::Single, vec![Item::Image(object.clone())]));
    }
    if object.starts_with(b"\x93NUMPY") {
        let (batched, samples) = npy_samples(object, &manifest.input_shape)?;
        let kind = if batched { Kind::Batch } else { Kind::Single };
        return Ok(Parsed::of(kind, samples.into_iter().map(Item::Ready).collect()));
    }
    if shard::is_tar(object) {
        return parse_shard(object, manifest);
    }
    Err(PushdownError::Unsupported(
        "the object is not a JPEG or PNG image, a .npy tensor, a WebDataset tar shard or a Parquet file".into(),
    ))
}

/// `row-groups` and `column` name what only some sources have: refused for the others.
fn check_fields(source: &SourceLimits, table: bool, lines: bool) -> Result<(), PushdownError> {
    if source.row_groups.is_some() && !table {
        return Err(PushdownError::InvalidArgument {
            field: "row-groups".into(),
            message: "names row groups of a Parquet file; this object is not one".into(),
        });
    }
    if source.column.is_some() && !table && !lines {
        return Err(PushdownError::InvalidArgument {
            field: "column".into(),
            message: "names a Parquet file's input column (or a text model's JSON Lines field); this object is \
                      neither"
                .into(),
        });
    }
    Ok(())
}

/// A WebDataset shard's samples: each an image or a one-sample `.npy`, keyed, with its label and
/// its other members.
fn parse_shard(object: &Bytes, manifest: &manifest::Manifest) -> Result<Parsed, PushdownError> {
    let samples = shard::read(object)?;
    let mut items = Vec::with_capacity(samples.len());
    let mut keys = Vec::with_capacity(samples.len());
    let mut others = Vec::with_capacity(samples.len());
    let labels = samples.iter().map(|s| s.label).collect::<Option<Vec<i64>>>();
    for s in samples {
        items.push(match s.input {
            shard::SampleInput::Image(b) => {
                if manifest.preprocess.is_none() {
                    return Err(no_preprocess(&manifest.name));
                }
                Item::Image(b)
            }
            shard::SampleInput::Npy(b) => {
                let (batched, mut v) =
                    npy_samples(&b, &manifest.input_shape).map_err(|e| name_sample(e, Some(&s.key)))?;
                if batched || v.len() != 1 {
                    return Err(PushdownError::BadInput(format!(
                        "sample {:?}: a shard's .npy must hold one sample",
                        s.key
                    )));
                }
                Item::Ready(v.remove(0))
            }
        });
        keys.push(s.key);
        others.push(s.others);
    }
    Ok(Parsed { keys, labels, others, ..Parsed::of(Kind::Shard, items) })
}

/// What parsing a source may take beside the source: a Parquet input column (`column`), the
/// most bytes its decoded columns may hold (`pushdown.max_object_bytes`), and whether its other
/// columns are decoded too (a Parquet output).
pub(super) struct SourceLimits {
    pub(super) column: Option<String>,
    pub(super) max_decoded: u64,
    pub(super) keep_columns: bool,
    /// Some row groups of a Parquet file (`row-groups`).
    pub(super) row_groups: Option<spec::RowGroups>,
}

impl SourceLimits {
    /// What a Parquet file is read for; `text`: by a text model.
    pub(super) fn reading(&self, text: bool) -> table::Reading<'_> {
        table::Reading {
            column: self.column.as_deref(),
            max_decoded: self.max_decoded,
            keep: self.keep_columns,
            text,
            row_groups: self.row_groups,
            by_group: false,
        }
    }
}

/// Rows of a Parquet file (a row group's) as the items, keys and labels of samples: encoded
/// images, or texts tokenized here by a text model's `encoder`.
pub(super) fn table_rows(rows: Vec<table::Row>, encoder: Option<&text::Encoder>) -> Result<Parsed, PushdownError> {
    let mut parsed = Parsed::table(None);
    parsed.labels = rows.iter().map(|r| r.label).collect();
    parsed.keys = rows.iter().map(|r| r.key.clone()).collect();
    parsed.items = match encoder {
        None => rows.into_iter().map(|r| Item::Image(r.input)).collect(),
        Some(encoder) => rows
            .into_iter()
            .map(|r| {
                let text = std::str::from_utf8(&r.input)
                    .map_err(|e| PushdownError::BadInput(format!("row {:?} is not UTF-8: {e}", r.key)))?;
                encoder.encode(text).map(Item::Ready).map_err(|e| name_sample(e, Some(&r.key)))
            })
            .collect::<Result<_, _>>()?,
    };
    Ok(parsed)
}

/// Splits a `.npy` into per-sample inputs; `true` if it carried a batch dimension.
pub(super) fn npy_samples(object: &[u8], sample_shape: &[usize]) -> Result<(bool, Vec<Vec<f32>>), PushdownError> {
    let t = tensor::read_npy(object)?;
    let per: usize = sample_shape.iter().product();
    if t.shape == sample_shape {
        Ok((false, vec![t.data]))
    } else if t.shape.len() == sample_shape.len() + 1 && t.shape[1..] == *sample_shape && t.shape[0] > 0 {
        Ok((true, t.data.chunks_exact(per).map(<[f32]>::to_vec).collect()))
    } else {
        Err(PushdownError::BadInput(format!(
            "tensor shape {:?} is neither {sample_shape:?} nor [N, ...] of it",
            t.shape
        )))
    }
}
