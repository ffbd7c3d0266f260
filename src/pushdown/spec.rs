//! The pushdown request: which model, split, output format, dtype, storage batch, Parquet input
//! column and Parquet row groups a GET asks for, where it stands in its client's order, and its
//! random augmentation ([`super::augment`]), from request headers (`x-tensorgate-*`) or query
//! parameters (`tensorgate-*`). Pure. Bad values name the field; docs/pushdown.md is the contract.

use http::HeaderMap;

use super::augment::Augment;
use super::error::PushdownError;
use super::order::Seq;

pub(crate) const HEADER_PREFIX: &str = "x-tensorgate-";
pub(crate) const QUERY_PREFIX: &str = "tensorgate-";
/// Largest storage batch a request may ask for (HAPI's logged training batches reach 8,000).
pub(crate) const MAX_STORAGE_BATCH: usize = 65_536;
/// Longest Parquet column name a request may name (names of datasets' columns are words).
pub(crate) const MAX_COLUMN_NAME: usize = 256;
/// Highest row-group index a request may name: Parquet stores a file's row-group count as an
/// `i32`, and a footer of [`super::table::MAX_FOOTER_BYTES`] describes far fewer groups.
pub(crate) const MAX_ROW_GROUP: usize = i32::MAX as usize;

/// Output container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Format {
    Npy,
    Safetensors,
    /// A WebDataset shard (tar) of per-sample `.npy` features beside the shard's other members:
    /// for shards only.
    Tar,
    /// A Parquet file: the source's columns but the input one, and the features as a
    /// list column (`features`; each row's shape is in the `tensorgate` metadata entry, ADR 0022),
    /// in the source's row groups: for Parquet sources only.
    Parquet,
}

/// Output element type (also what a plan request sizes outputs by: `"f32"`, `"f16"`, `"bf16"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    #[default]
    F32,
    F16,
    Bf16,
}

impl Dtype {
    /// Bytes per element.
    #[must_use]
    pub(crate) fn size(self) -> usize {
        if self == Self::F32 { 4 } else { 2 }
    }

    #[must_use]
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
        }
    }
}

/// What a pushdown GET asks for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PushdownSpec {
    pub(crate) model: String,
    /// A split name from the manifest, or `none` for the raw object.
    pub(crate) split: String,
    /// `None`: `.npy` for one sample or a batch (safetensors if `bf16`), safetensors for shards.
    pub(crate) format: Option<Format>,
    pub(crate) dtype: Dtype,
    /// Most samples of this request in flight at once on the storage node (HAPI's storage-side
    /// batch): an upper bound the memory governor may lower, never raise. Does not change the
    /// output.
    pub(crate) batch: Option<usize>,
    /// The input column of a Parquet source (default `image`, as Hugging Face `datasets` names
    /// it); refused for other sources.
    pub(crate) column: Option<String>,
    /// Some row groups of a Parquet source instead of the whole file: the gateway reads the
    /// footer and those groups' bytes with ranged reads, so a file of any size is pushed down a
    /// few row groups at a time (each its own cached output). Refused for other sources.
    pub(crate) row_groups: Option<RowGroups>,
    /// Where the request stands in its client's order (`seq=<stream>.<n>`): its samples are
    /// computed in that order among the stream's requests (`super::order`). Does not change the
    /// output.
    pub(crate) seq: Option<Seq>,
    /// Random augmentation drawn from a seed per sample (`augment` and `seed`; ADR 0032).
    pub(crate) augment: Option<Augment>,
}

/// Row groups `first..=last` of a Parquet file (`row-groups=3` or `row-groups=3-5`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowGroups {
    pub first: usize,
    pub last: usize,
}

impl RowGroups {
    /// The indices, in file order.
    #[must_use]
    pub(crate) fn indices(self) -> std::ops::RangeInclusive<usize> {
        self.first..=self.last
    }

    fn parse(value: &str) -> Option<Self> {
        let index = |v: &str| v.parse::<usize>().ok().filter(|i| *i <= MAX_ROW_GROUP);
        let (first, last) = match value.split_once('-') {
            Some((a, b)) => (index(a)?, index(b)?),
            None => (index(value)?, index(value)?),
        };
        (first <= last).then_some(Self { first, last })
    }
}

impl std::fmt::Display for RowGroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.first == self.last { write!(f, "{}", self.first) } else { write!(f, "{}-{}", self.first, self.last) }
    }
}

/// `query` without its trigger parameters, their names read as [`parse`] reads them (percent-
/// decoded); `None` when nothing is left. What a pushdown forwards to the store or a peer.
#[must_use]
pub(crate) fn without_trigger_params(query: &str) -> Option<String> {
    let kept: Vec<&str> = query
        .split('&')
        .filter(|p| {
            !p.is_empty()
                && !crate::s3::sigv4::uri_decode(p.split('=').next().unwrap_or_default()).starts_with(QUERY_PREFIX)
        })
        .collect();
    (!kept.is_empty()).then(|| kept.join("&"))
}

/// Removes the trigger headers (`x-tensorgate-*`), which name the output, not the source object.
pub(crate) fn remove_trigger_headers(headers: &mut HeaderMap) {
    let names: Vec<http::HeaderName> =
        headers.keys().filter(|n| n.as_str().starts_with(HEADER_PREFIX)).cloned().collect();
    for name in names {
        headers.remove(name);
    }
}

/// Whether a request names any pushdown field (a header or query parameter), valid or not.
#[must_use]
pub(crate) fn names_fields(headers: &HeaderMap, query: Option<&str>) -> bool {
    headers.keys().any(|n| n.as_str().starts_with(HEADER_PREFIX))
        || query.is_some_and(|q| q.split('&').any(|p| is_field_param(p.split('=').next().unwrap_or_default())))
}

/// Whether a query parameter's name, percent-decoded, starts with [`QUERY_PREFIX`]: told without
/// decoding it into a new string (every request's parameters are looked at).
fn is_field_param(raw_name: &str) -> bool {
    let mut decoded = percent_encoding::percent_decode_str(raw_name);
    QUERY_PREFIX.bytes().all(|b| decoded.next() == Some(b))
}

/// Reads the spec from headers, then query parameters (a field may come from either, not both).
/// `Ok(None)`: not a pushdown request.
///
/// # Errors
/// An unknown field, a repeated field or a bad value, naming the field.
pub fn parse(headers: &HeaderMap, query: Option<&str>) -> Result<Option<PushdownSpec>, PushdownError> {
    let mut fields: Vec<(String, String)> = Vec::new();
    for (name, value) in headers {
        if let Some(field) = name.as_str().strip_prefix(HEADER_PREFIX) {
            let v = value.to_str().map_err(|_| invalid(field, "is not visible ASCII"))?;
            fields.push((field.to_owned(), v.trim().to_owned()));
        }
    }
    for pair in query.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        if !is_field_param(k) {
            continue;
        }
        let k = crate::s3::sigv4::uri_decode(k);
        if let Some(field) = k.strip_prefix(QUERY_PREFIX) {
            fields.push((field.to_owned(), crate::s3::sigv4::uri_decode(v)));
        }
    }
    if fields.is_empty() {
        return Ok(None);
    }
    let (mut model, mut split, mut format, mut dtype, mut batch, mut column, mut row_groups, mut seq) =
        (None, None, None, None, None, None, None, None);
    let (mut augment, mut seed) = (None, None);
    for (field, value) in fields {
        let slot = match field.as_str() {
            "model" => &mut model,
            "split" => &mut split,
            "format" => &mut format,
            "dtype" => &mut dtype,
            "batch" => &mut batch,
            "column" => &mut column,
            "row-groups" => &mut row_groups,
            "seq" => &mut seq,
            "augment" => &mut augment,
            "seed" => &mut seed,
            _ => {
                return Err(invalid(
                    &field,
                    "is not a pushdown field (model, split, format, dtype, batch, column, row-groups, seq, augment, seed)",
                ));
            }
        };
        if slot.replace(value).is_some() {
            return Err(invalid(&field, "is given more than once"));
        }
    }
    let model = model.filter(|m| !m.is_empty()).ok_or_else(|| invalid("model", "is required"))?;
    let split = split.filter(|s| !s.is_empty()).ok_or_else(|| invalid("split", "is required"))?;
    let format = match format.as_deref() {
        None => None,
        Some("npy") => Some(Format::Npy),
        Some("safetensors") => Some(Format::Safetensors),
        Some("tar") => Some(Format::Tar),
        Some("parquet") => Some(Format::Parquet),
        Some(other) => return Err(invalid("format", &format!("{other:?} is not npy, safetensors, tar or parquet"))),
    };
    let dtype = match dtype.as_deref() {
        None | Some("f32") => Dtype::F32,
        Some("f16") => Dtype::F16,
        Some("bf16") => Dtype::Bf16,
        Some(other) => return Err(invalid("dtype", &format!("{other:?} is not f32, f16 or bf16"))),
    };
    if matches!(format, Some(Format::Npy | Format::Tar | Format::Parquet)) && dtype == Dtype::Bf16 {
        return Err(invalid("dtype", "bf16 has no .npy or Parquet encoding: use format=safetensors"));
    }
    let batch = match batch.as_deref() {
        None => None,
        Some(b) => match b.parse::<usize>() {
            Ok(n) if (1..=MAX_STORAGE_BATCH).contains(&n) => Some(n),
            _ => return Err(invalid("batch", &format!("{b:?} is not a whole number from 1 to {MAX_STORAGE_BATCH}"))),
        },
    };
    let column = match column {
        Some(c) if c.is_empty() || c.len() > MAX_COLUMN_NAME => {
            return Err(invalid("column", &format!("is empty or longer than {MAX_COLUMN_NAME} bytes")));
        }
        c => c,
    };
    let row_groups = match row_groups.as_deref() {
        None => None,
        Some(v) => Some(RowGroups::parse(v).ok_or_else(|| {
            invalid("row-groups", &format!("{v:?} is not a row-group index or a range of them (3, or 3-5)"))
        })?),
    };
    let seq = match seq.as_deref() {
        None => None,
        Some(v) => Some(Seq::parse(v).ok_or_else(|| {
            invalid(
                "seq",
                &format!(
                    "{v:?} is not <stream>.<n>: a stream name of letters, digits, - and _ (at most {} bytes) and a whole number",
                    super::order::MAX_STREAM_NAME
                ),
            )
        })?),
    };
    let augment = Augment::parse(augment.as_deref(), seed.as_deref()).map_err(|(f, m)| invalid(f, &m))?;
    Ok(Some(PushdownSpec { model, split, format, dtype, batch, column, row_groups, seq, augment }))
}

impl PushdownSpec {
    /// The spec as request fields (name without prefix, value), as `parse` reads them back.
    #[must_use]
    pub(crate) fn fields(&self) -> Vec<(&'static str, String)> {
        let mut out =
            vec![("model", self.model.clone()), ("split", self.split.clone()), ("dtype", self.dtype.name().into())];
        if let Some(f) = self.format {
            out.push(("format", f.name().into()));
        }
        if let Some(b) = self.batch {
            out.push(("batch", b.to_string()));
        }
        if let Some(c) = &self.column {
            out.push(("column", c.clone()));
        }
        if let Some(g) = self.row_groups {
            out.push(("row-groups", g.to_string()));
        }
        if let Some(q) = &self.seq {
            out.push(("seq", q.to_string()));
        }
        if let Some(a) = &self.augment {
            out.push(("augment", a.to_string()));
            out.push(("seed", a.seed.to_string()));
        }
        out
    }
}

impl Format {
    #[must_use]
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Npy => "npy",
            Self::Safetensors => "safetensors",
            Self::Tar => "tar",
            Self::Parquet => "parquet",
        }
    }
}

fn invalid(field: &str, message: &str) -> PushdownError {
    PushdownError::InvalidArgument { field: field.to_owned(), message: message.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs.iter().map(|(k, v)| (k.parse().expect("name"), v.parse().expect("value"))).collect()
    }

    #[test]
    fn headers_and_query_give_the_same_spec() {
        let a = parse(&h(&[("x-tensorgate-model", "tiny-cnn"), ("x-tensorgate-split", "stem")]), None).expect("ok");
        let b =
            parse(&HeaderMap::new(), Some("tensorgate-model=tiny-cnn&tensorgate-split=stem&versionId=1")).expect("ok");
        assert_eq!(a, b);
        let spec = a.expect("spec");
        assert_eq!((spec.format, spec.dtype, spec.batch), (None, Dtype::F32, None));
        let b =
            parse(&h(&[("x-tensorgate-model", "m"), ("x-tensorgate-split", "s"), ("x-tensorgate-batch", "256")]), None);
        assert_eq!(b.expect("ok").expect("spec").batch, Some(256));
        assert_eq!(parse(&HeaderMap::new(), Some("list-type=2")).expect("ok"), None);
    }

    #[test]
    fn row_groups_are_one_index_or_a_range_and_round_trip() {
        for (value, first, last) in [("3", 3, 3), ("3-5", 3, 5), ("0-0", 0, 0)] {
            let spec = parse(
                &h(&[("x-tensorgate-model", "m"), ("x-tensorgate-split", "s"), ("x-tensorgate-row-groups", value)]),
                None,
            )
            .expect("ok")
            .expect("spec");
            assert_eq!(spec.row_groups, Some(RowGroups { first, last }));
            let (_, back) = spec.fields().into_iter().find(|(k, _)| *k == "row-groups").expect("a field");
            assert_eq!(RowGroups::parse(&back), spec.row_groups);
        }
    }

    #[test]
    fn the_clients_order_round_trips_and_is_not_part_of_the_output() {
        let spec = parse(&HeaderMap::new(), Some("tensorgate-model=m&tensorgate-split=s&tensorgate-seq=ab12.3"))
            .expect("ok")
            .expect("spec");
        assert_eq!(spec.seq, Some(Seq { stream: "ab12".into(), n: 3 }));
        let (_, back) = spec.fields().into_iter().find(|(k, _)| *k == "seq").expect("a field");
        assert_eq!(Seq::parse(&back), spec.seq);
    }

    #[test]
    fn triggers_are_removed_by_their_decoded_names() {
        let q = "tensorgate-model=m&versionId=1&tensorgate%2Dsplit=s&tensorgate%2dformat=tar&&partNumber=2";
        assert!(parse(&HeaderMap::new(), Some(q)).expect("parsed").is_some());
        assert_eq!(without_trigger_params(q).as_deref(), Some("versionId=1&partNumber=2"));
        assert_eq!(without_trigger_params("tensorgate-model=m&tensorgate-split=s"), None);
        let mut headers = h(&[("x-tensorgate-model", "m"), ("x-amz-date", "d"), ("X-Tensorgate-Split", "s")]);
        remove_trigger_headers(&mut headers);
        assert_eq!(headers.keys().map(http::HeaderName::as_str).collect::<Vec<_>>(), ["x-amz-date"]);
    }

    #[test]
    fn bad_values_name_the_field() {
        let cases = [
            (h(&[("x-tensorgate-model", "m")]), "split"),
            (h(&[("x-tensorgate-model", "m"), ("x-tensorgate-split", "s"), ("x-tensorgate-dtype", "f64")]), "dtype"),
            (h(&[("x-tensorgate-model", "m"), ("x-tensorgate-split", "s"), ("x-tensorgate-colour", "red")]), "colour"),
            (h(&[("x-tensorgate-model", "m"), ("x-tensorgate-split", "s"), ("x-tensorgate-batch", "0")]), "batch"),
            (h(&[("x-tensorgate-model", "m"), ("x-tensorgate-split", "s"), ("x-tensorgate-column", "")]), "column"),
            (h(&[("x-tensorgate-model", "m"), ("x-tensorgate-split", "s"), ("x-tensorgate-seq", "7")]), "seq"),
            (
                h(&[
                    ("x-tensorgate-model", "m"),
                    ("x-tensorgate-split", "s"),
                    ("x-tensorgate-format", "npy"),
                    ("x-tensorgate-dtype", "bf16"),
                ]),
                "dtype",
            ),
        ];
        for (headers, field) in cases {
            match parse(&headers, None) {
                Err(PushdownError::InvalidArgument { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{field}: {other:?}"),
            }
        }
        let spec = parse(&HeaderMap::new(), Some("tensorgate-model=m&tensorgate-split=s&tensorgate-column=my%20img"))
            .expect("ok")
            .expect("spec");
        assert_eq!(spec.column.as_deref(), Some("my img"));
        assert!(spec.fields().contains(&("column", "my img".to_owned())));
        for bad in ["", "x", "5-3", "-1", "1-", "99999999999"] {
            let got = parse(
                &HeaderMap::new(),
                Some(&format!("tensorgate-model=m&tensorgate-split=s&tensorgate-row-groups={bad}")),
            );
            assert!(
                matches!(got, Err(PushdownError::InvalidArgument { field, .. }) if field == "row-groups"),
                "{bad:?}"
            );
        }
        let dup = parse(&h(&[("x-tensorgate-model", "m")]), Some("tensorgate-model=n&tensorgate-split=s"));
        assert!(matches!(dup, Err(PushdownError::InvalidArgument { field, .. }) if field == "model"));
    }
}
