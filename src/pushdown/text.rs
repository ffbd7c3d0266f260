//! Texts as a text encoder's inputs (ADR 0017): Hugging Face's `tokenizers` crate (what the Python
//! package wraps) with the model's `tokenizer.json`, truncated and padded to the model's length
//! `L`, each text a row `[ids; L] ++ [mask; L]` of `f32` (exact for ids below 2^24) that the engine
//! feeds as the model's two int64 inputs. And the text sources besides Parquet: a plain UTF-8
//! object is one text; JSON Lines are one text per line. Pure.

use tokenizers::{PaddingStrategy, Tokenizer};

use super::error::PushdownError;
use super::shard::MAX_SAMPLES;

/// Longest text encoded: tokenizing is linear in the text, and a text encoder reads at most a
/// few hundred tokens of it (a token is a few bytes); longer rows are refused, not cut, so that
/// what is encoded is what the caller's own tokenizer would see.
pub(crate) const MAX_TEXT_BYTES: usize = 1024 * 1024;

/// The JSON Lines field (and Parquet column) of the texts when the request names none.
pub(crate) const DEFAULT_FIELD: &str = "text";

/// Ids from this on are not exact in `f32`.
const MAX_EXACT_ID: u32 = 1 << 24;

/// A batch of texts runs at its longest text's length rounded up to a multiple of this (where
/// the prefix allows: `engine`): the matrix kernels work in blocks of 4 to 16 rows, and few
/// distinct lengths keep runs alike; a text is never padded by more than 7 tokens for it.
pub(crate) const LENGTH_STEP: usize = 8;

/// The attended tokens of a text row (`[ids; L] ++ [mask; L]`): up to its last attended one, so
/// a right-padded row's length without its padding (a left-padded row counts whole).
#[must_use]
pub(crate) fn attended(row: &[f32]) -> usize {
    let mask = &row[row.len() / 2..];
    mask.iter().rposition(|&m| m != 0.0).map_or(0, |last| last + 1)
}

/// The length a batch of text rows of `len` tokens runs at when its padding may be cut: its
/// longest row's [`attended`] tokens rounded up to [`LENGTH_STEP`], at most `len`, at least 1.
#[must_use]
pub(crate) fn batch_length(data: &[f32], len: usize) -> usize {
    let longest = data.chunks_exact(2 * len).map(attended).max().unwrap_or(0);
    longest.max(1).next_multiple_of(LENGTH_STEP).min(len)
}

/// A model's tokenizer, set to its length.
pub struct Encoder {
    tokenizer: Tokenizer,
    len: usize,
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoder").field("len", &self.len).finish_non_exhaustive()
    }
}

impl Encoder {
    /// A tokenizer given as `tokenizer.json`'s text, its truncation and padding set to `len`
    /// tokens (its own pad token and truncation strategy kept).
    ///
    /// # Errors
    /// Text that is not a tokenizer, or one that cannot truncate to `len`.
    pub fn from_json(json: &str, len: usize) -> Result<Self, String> {
        Self::new(json.parse::<Tokenizer>().map_err(|e| e.to_string())?, len)
    }

    fn new(mut tokenizer: Tokenizer, len: usize) -> Result<Self, String> {
        let mut truncation = tokenizer.get_truncation().cloned().unwrap_or_default();
        truncation.max_length = len;
        tokenizer.with_truncation(Some(truncation)).map_err(|e| e.to_string())?;
        let mut padding = tokenizer.get_padding().cloned().unwrap_or_default();
        padding.strategy = PaddingStrategy::Fixed(len);
        tokenizer.with_padding(Some(padding));
        Ok(Self { tokenizer, len })
    }

    /// The tokenizer as `tokenizer.json` text, with the truncation and padding to `L` that the
    /// gateway uses: the compute tier's baseline tokenizes with exactly this.
    ///
    /// # Errors
    /// A tokenizer that does not serialize (not one read from a file).
    pub(crate) fn to_json(&self) -> Result<String, String> {
        self.tokenizer.to_string(false).map_err(|e| e.to_string())
    }

    /// One text as a model input row (`2 x L` values: ids, then the attention mask).
    ///
    /// # Errors
    /// `BadInput` for a text over [`MAX_TEXT_BYTES`] or one the tokenizer refuses.
    pub fn encode(&self, text: &str) -> Result<Vec<f32>, PushdownError> {
        if text.len() > MAX_TEXT_BYTES {
            return Err(PushdownError::BadInput(format!(
                "a text of {} bytes; at most {MAX_TEXT_BYTES} are encoded",
                text.len()
            )));
        }
        let encoding =
            self.tokenizer.encode(text, true).map_err(|e| PushdownError::BadInput(format!("cannot tokenize: {e}")))?;
        let (ids, mask) = (encoding.get_ids(), encoding.get_attention_mask());
        if ids.len() != self.len || mask.len() != self.len {
            return Err(PushdownError::Internal(format!("the tokenizer gave {} tokens, not {}", ids.len(), self.len)));
        }
        if ids.iter().any(|&id| id >= MAX_EXACT_ID) {
            return Err(PushdownError::Internal("a token id beyond 2^24 (not exact as f32)".into()));
        }
        Ok(ids.iter().chain(mask).map(|&v| v as f32).collect())
    }
}

/// One text of a source, with its key and label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextRow {
    pub(crate) key: String,
    pub text: String,
    pub(crate) label: Option<i64>,
}

/// Whether a text model's source is JSON Lines (its first non-blank byte opens an object).
#[must_use]
pub fn is_jsonl(object: &[u8]) -> bool {
    object.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'{')
}

/// A plain text object: one text, keyed `0`.
///
/// # Errors
/// `BadInput` for bytes that are not UTF-8.
pub fn plain(object: &[u8]) -> Result<String, PushdownError> {
    String::from_utf8(object.to_vec())
        .map_err(|e| PushdownError::BadInput(format!("a text model's input is UTF-8 text, JSON Lines or Parquet: {e}")))
}

/// The rows of JSON Lines: per non-blank line an object whose `field` (default [`DEFAULT_FIELD`])
/// is a string; its key is its `id` (a string or an integer) else its line's row number, its
/// label an integer `label`.
///
/// # Errors
/// `BadInput` naming the line for a line that is not such an object, or more than
/// [`MAX_SAMPLES`] rows.
pub fn jsonl_rows(object: &[u8], field: Option<&str>) -> Result<Vec<TextRow>, PushdownError> {
    let field = field.unwrap_or(DEFAULT_FIELD);
    let mut rows = Vec::new();
    for (n, line) in object.split(|b| *b == b'\n').enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if rows.len() == MAX_SAMPLES {
            return Err(PushdownError::BadInput(format!(
                "more than {MAX_SAMPLES} rows; a pushdown reads at most that"
            )));
        }
        let bad = |what: String| PushdownError::BadInput(format!("line {}: {what}", n + 1));
        let value: serde_json::Map<String, serde_json::Value> =
            serde_json::from_slice(line).map_err(|e| bad(format!("not a JSON object: {e}")))?;
        let text = value
            .get(field)
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| bad(format!("no string field {field:?}")))?;
        let key = match value.get("id") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Number(v)) if v.is_i64() || v.is_u64() => v.to_string(),
            _ => rows.len().to_string(),
        };
        let label = value.get("label").and_then(serde_json::Value::as_i64);
        rows.push(TextRow { key, text: text.to_owned(), label });
    }
    if rows.is_empty() {
        return Err(PushdownError::BadInput("the JSON Lines object has no rows".into()));
    }
    Ok(rows)
}

/// A small BERT-style WordPiece tokenizer (letters, digits and a few word pieces; Bert
/// normalizer and pre-tokenizer, `[CLS] .. [SEP]`) as `tokenizer.json` text, for tests and the
/// fuzz target, which must not depend on a downloaded model.
#[doc(hidden)]
#[must_use]
pub fn tiny_wordpiece_json() -> String {
    let mut vocab = serde_json::Map::new();
    let pieces = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "the", "a", "##s", "##ing", "cat", "play"];
    let chars = ('a'..='z').chain('0'..='9').map(String::from);
    let subwords = ('a'..='z').chain('0'..='9').map(|c| format!("##{c}"));
    for token in pieces.iter().map(|p| (*p).to_owned()).chain(chars).chain(subwords) {
        let id = vocab.len();
        vocab.entry(token).or_insert_with(|| id.into());
    }
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
                           "normalized": false, "special": true})
    };
    let token = |id: &str| serde_json::json!({"SpecialToken": {"id": id, "type_id": 0}});
    let sequence = |id: &str, type_id: u32| serde_json::json!({"Sequence": {"id": id, "type_id": type_id}});
    serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "[PAD]"), special(1, "[UNK]"), special(2, "[CLS]"), special(3, "[SEP]")],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": {"type": "TemplateProcessing",
            "single": [token("[CLS]"), sequence("A", 0), token("[SEP]")],
            "pair": [token("[CLS]"), sequence("A", 0), token("[SEP]"), sequence("B", 1), token("[SEP]")],
            "special_tokens": {"[CLS]": {"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]},
                               "[SEP]": {"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}},
        "decoder": null,
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab}
    })
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_become_ids_and_a_mask_truncated_and_padded_to_the_length() {
        let encoder = Encoder::from_json(&tiny_wordpiece_json(), 6).expect("tokenizer");
        assert_eq!(encoder.len, 6);
        // [CLS] the cat ##s [SEP] [PAD]: ids, then the mask.
        let row = encoder.encode("The cats").expect("encoded");
        assert_eq!(row, [2.0, 4.0, 8.0, 6.0, 3.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]);
        // Truncated to 6 tokens, [SEP] kept.
        let row = encoder.encode("a a a a a a a a").expect("encoded");
        assert_eq!(&row[..6], [2.0, 5.0, 5.0, 5.0, 5.0, 3.0]);
        assert!(row[6..].iter().all(|&m| m == 1.0));
        assert_eq!(encoder.encode("").expect("empty")[..3], [2.0, 3.0, 0.0]);
        let long = "a ".repeat(MAX_TEXT_BYTES / 2 + 1);
        assert!(encoder.encode(&long).expect_err("too long").to_string().contains("at most"));
    }

    #[test]
    fn a_batch_runs_at_its_longest_text_rounded_up_and_never_past_the_length() {
        let row = |len: usize, used: usize| -> Vec<f32> {
            (0..len)
                .map(|i| if i < used { 7.0 } else { 0.0 })
                .chain((0..len).map(|i| f32::from(u8::from(i < used))))
                .collect()
        };
        assert_eq!(attended(&row(16, 5)), 5);
        assert_eq!(attended(&row(16, 0)), 0);
        // Left padding: counted whole (its positions would shift if cut).
        let left: Vec<f32> = [0.0, 0.0, 5.0, 6.0, 0.0, 0.0, 1.0, 1.0].into();
        assert_eq!(attended(&left), 4);
        let batch = [row(32, 5), row(32, 11), row(32, 3)].concat();
        assert_eq!(batch_length(&batch, 32), 16);
        assert_eq!(batch_length(&row(32, 30), 32), 32);
        assert_eq!(batch_length(&row(12, 11), 12), 12);
        assert_eq!(batch_length(&row(32, 0), 32), LENGTH_STEP);
    }

    #[test]
    fn json_lines_give_texts_keys_and_labels_and_bad_lines_are_named() {
        let rows =
            jsonl_rows(b"{\"text\": \"a b\", \"label\": 2, \"id\": \"x\"}\n\n{\"text\": \"c\", \"id\": 7}\r\n", None)
                .expect("rows");
        assert_eq!(
            rows,
            [
                TextRow { key: "x".into(), text: "a b".into(), label: Some(2) },
                TextRow { key: "7".into(), text: "c".into(), label: None },
            ]
        );
        let rows = jsonl_rows(b"{\"body\": \"q\"}\n", Some("body")).expect("named field");
        assert_eq!(rows[0].key, "0");
        let err = |o: &[u8]| jsonl_rows(o, None).expect_err("refused").to_string();
        assert!(err(b"{\"text\": \"a\"}\n{\"text\": 3}\n").contains("line 2: no string field \"text\""));
        assert!(err(b"{\"text\": \"a\"}\nnot json\n").contains("line 2: not a JSON object"));
        assert!(err(b"  \n").contains("no rows"));
        let many = b"{\"text\": \"a\"}\n".repeat(MAX_SAMPLES + 1);
        assert!(err(&many).contains("more than 10000 rows"));
        assert!(is_jsonl(b" \n{\"text\": 1}") && !is_jsonl(b"plain {text}"));
        assert!(plain(b"\xff\xfe").is_err());
    }
}
