//! Texts as a text encoder's inputs (issue 31): Hugging Face's `tokenizers` crate (what the Python
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
pub const MAX_TEXT_BYTES: usize = 1024 * 1024;

/// The JSON Lines field (and Parquet column) of the texts when the request names none.
pub const DEFAULT_FIELD: &str = "text";

/// Ids from this on are not exact in `f32`.
const MAX_EXACT_ID: u32 = 1 << 24;

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
    /// Reads `tokenizer.json` and sets its truncation and padding to `len` tokens (its own pad
    /// token and truncation strategy kept).
    ///
    /// # Errors
    /// An unreadable file or a tokenizer that cannot truncate to `len`.
    pub fn from_file(path: &std::path::Path, len: usize) -> Result<Self, String> {
        let mut tokenizer = Tokenizer::from_file(path).map_err(|e| e.to_string())?;
        let mut truncation = tokenizer.get_truncation().cloned().unwrap_or_default();
        truncation.max_length = len;
        tokenizer.with_truncation(Some(truncation)).map_err(|e| e.to_string())?;
        let mut padding = tokenizer.get_padding().cloned().unwrap_or_default();
        padding.strategy = PaddingStrategy::Fixed(len);
        tokenizer.with_padding(Some(padding));
        Ok(Self { tokenizer, len })
    }

    /// Tokens per text.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
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
    pub key: String,
    pub text: String,
    pub label: Option<i64>,
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

#[cfg(test)]
mod tests {
    use super::*;

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
        assert!(is_jsonl(b" \n{\"text\": 1}") && !is_jsonl(b"plain {text}"));
        assert!(plain(b"\xff\xfe").is_err());
    }
}
