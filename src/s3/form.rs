//! `multipart/form-data` bodies of POST Object (browser uploads), up to the file part: the form
//! fields that carry the policy and its signature come first, then the file, which is streamed and
//! never parsed here. Pure: the caller feeds the body's first bytes.
//!
//! Spec: RFC 7578 (form-data) over RFC 2046 (multipart); S3 takes the fields before the file part
//! and ignores anything after it. This gateway requires the file part to be the last one, which
//! is how browsers and HTTP libraries send forms; a body with parts after the file is refused
//! before anything is stored.

/// The fields of a form before its file part.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FormHead {
    /// `(name, value)` in form order.
    pub fields: Vec<(String, String)>,
    /// The file part's `filename` parameter.
    pub filename: Option<String>,
    /// Offset of the file's first byte in the body.
    pub file_start: usize,
}

/// Why a form body is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormError {
    #[error("the body of your POST request is not well-formed multipart/form-data: {0}")]
    Malformed(&'static str),
    #[error("POST requires exactly one file upload per request")]
    NoFile,
    #[error("the form fields before the file exceed {0} bytes")]
    TooLarge(usize),
}

/// Name of the part that carries the object's data.
const FILE_FIELD: &str = "file";

/// The boundary of a `multipart/form-data` content type.
#[must_use]
pub fn boundary(content_type: &str) -> Option<String> {
    let (mime, params) = content_type.split_once(';')?;
    if !mime.trim().eq_ignore_ascii_case("multipart/form-data") {
        return None;
    }
    param(params, "boundary").filter(|b| !b.is_empty() && b.len() <= 70)
}

/// What ends the body after the file part: `CRLF--boundary--CRLF`.
#[must_use]
pub(crate) fn closing_delimiter(boundary: &str) -> Vec<u8> {
    format!("\r\n--{boundary}--\r\n").into_bytes()
}

/// Parses the body's first bytes up to the start of the file part. `Ok(None)`: more bytes are
/// needed; the caller stops feeding at `max` bytes.
///
/// # Errors
/// A malformed body, no file part, or fields over `max` bytes.
pub fn parse_head(buf: &[u8], boundary: &str, max: usize) -> Result<Option<FormHead>, FormError> {
    let dash = format!("--{boundary}");
    let delimiter = format!("\r\n--{boundary}");
    let Some(first) = find(buf, dash.as_bytes()) else {
        return need_more(buf, max);
    };
    let mut pos = first + dash.len();
    let mut fields = Vec::new();
    loop {
        // After a delimiter: `--` closes the body, CRLF opens a part.
        let Some(after) = buf.get(pos..pos + 2) else { return need_more(buf, max) };
        if after == b"--" {
            return Err(FormError::NoFile);
        }
        if after != b"\r\n" {
            return Err(FormError::Malformed("a boundary is not followed by CRLF"));
        }
        pos += 2;
        let Some(end) = find(&buf[pos..], b"\r\n\r\n") else { return need_more(buf, max) };
        let headers = std::str::from_utf8(&buf[pos..pos + end]).map_err(|_| FormError::Malformed("part headers"))?;
        pos += end + 4;
        let (name, filename) = disposition(headers)?;
        if name.eq_ignore_ascii_case(FILE_FIELD) {
            // The bound holds however the bytes arrived (one large read may hold them all).
            if pos > max {
                return Err(FormError::TooLarge(max));
            }
            return Ok(Some(FormHead { fields, filename, file_start: pos }));
        }
        let Some(len) = find(&buf[pos..], delimiter.as_bytes()) else { return need_more(buf, max) };
        let value =
            std::str::from_utf8(&buf[pos..pos + len]).map_err(|_| FormError::Malformed("a field is not UTF-8"))?;
        fields.push((name, value.to_owned()));
        pos += len + delimiter.len();
    }
}

fn need_more(buf: &[u8], max: usize) -> Result<Option<FormHead>, FormError> {
    if buf.len() >= max { Err(FormError::TooLarge(max)) } else { Ok(None) }
}

/// `(name, filename)` from a part's `Content-Disposition: form-data; name="..."[; filename="..."]`.
fn disposition(headers: &str) -> Result<(String, Option<String>), FormError> {
    let value = headers
        .split("\r\n")
        .find_map(|line| {
            let (k, v) = line.split_once(':')?;
            k.trim().eq_ignore_ascii_case("content-disposition").then_some(v)
        })
        .ok_or(FormError::Malformed("a part has no Content-Disposition"))?;
    let (kind, params) = value.split_once(';').ok_or(FormError::Malformed("Content-Disposition has no name"))?;
    if !kind.trim().eq_ignore_ascii_case("form-data") {
        return Err(FormError::Malformed("a part is not form-data"));
    }
    let name = param(params, "name").ok_or(FormError::Malformed("Content-Disposition has no name"))?;
    Ok((name, param(params, "filename")))
}

/// A `;`-separated parameter, quoted (with `\"` escapes) or not.
fn param(params: &str, wanted: &str) -> Option<String> {
    let mut rest = params;
    while !rest.is_empty() {
        rest = rest.trim_start_matches([';', ' ', '\t']);
        let (key, after) = rest.split_once('=')?;
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = quoted.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '\\' => out.extend(chars.next().map(|(_, c)| c)),
                    '"' => {
                        end = Some(i + 1);
                        break;
                    }
                    c => out.push(c),
                }
            }
            (out, &quoted[end?..])
        } else {
            let end = after.find(';').unwrap_or(after.len());
            (after[..end].trim().to_owned(), &after[end..])
        };
        if key.trim().eq_ignore_ascii_case(wanted) {
            return Some(value);
        }
        rest = next;
    }
    None
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body as Python's `requests` sends `files=` (every part with a filename).
    fn body(parts: &[(&str, &str)], file: &str) -> Vec<u8> {
        let mut b = Vec::new();
        for (k, v) in parts {
            b.extend_from_slice(
                format!("--XyZ\r\nContent-Disposition: form-data; name=\"{k}\"; filename=\"{k}\"\r\n\r\n{v}\r\n")
                    .as_bytes(),
            );
        }
        b.extend_from_slice(
            b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a \\\"b\\\".txt\"\r\n",
        );
        b.extend_from_slice(b"Content-Type: text/plain\r\n\r\n");
        b.extend_from_slice(file.as_bytes());
        b.extend_from_slice(&closing_delimiter("XyZ"));
        b
    }

    #[test]
    fn fields_before_the_file_and_where_it_starts() {
        let b =
            body(&[("key", "up/${filename}"), ("Content-Type", "text/plain"), ("x-amz-meta-multi", "a\r\nb")], "bar");
        let head = parse_head(&b, "XyZ", 1 << 16).expect("valid").expect("complete");
        assert_eq!(
            head.fields,
            [
                ("key".to_owned(), "up/${filename}".to_owned()),
                ("Content-Type".to_owned(), "text/plain".to_owned()),
                ("x-amz-meta-multi".to_owned(), "a\r\nb".to_owned())
            ]
        );
        assert_eq!(head.filename.as_deref(), Some("a \"b\".txt"));
        assert_eq!(&b[head.file_start..head.file_start + 3], b"bar");
        assert_eq!(b.len() - head.file_start - closing_delimiter("XyZ").len(), 3);
    }

    #[test]
    fn partial_bodies_ask_for_more_and_bad_ones_are_refused() {
        let b = body(&[("key", "k")], "data");
        for cut in [0, 5, 20, 60] {
            assert_eq!(parse_head(&b[..cut], "XyZ", 1 << 16), Ok(None), "cut at {cut}");
        }
        assert_eq!(parse_head(&b[..60], "XyZ", 60), Err(FormError::TooLarge(60)));
        // Complete fields over the bound are refused too, not only ones still arriving.
        assert_eq!(parse_head(&b, "XyZ", 60), Err(FormError::TooLarge(60)));
        let no_file = b"--XyZ\r\nContent-Disposition: form-data; name=\"key\"\r\n\r\nk\r\n--XyZ--\r\n";
        assert_eq!(parse_head(no_file, "XyZ", 1 << 16), Err(FormError::NoFile));
        let junk = b"--XyZ\r\nX-Other: 1\r\n\r\nk\r\n--XyZ--\r\n";
        assert!(matches!(parse_head(junk, "XyZ", 1 << 16), Err(FormError::Malformed(_))));
    }

    #[test]
    fn boundaries_from_content_types() {
        assert_eq!(boundary("multipart/form-data; boundary=abc").as_deref(), Some("abc"));
        assert_eq!(boundary("Multipart/Form-Data; charset=utf-8; boundary=\"a b\"").as_deref(), Some("a b"));
        assert_eq!(boundary("application/x-www-form-urlencoded"), None);
        assert_eq!(boundary("multipart/form-data"), None);
    }
}
