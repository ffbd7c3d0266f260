//! Browser-based uploads: S3's `POST Object` with an HTML form (`multipart/form-data`).
//!
//! Specs: <https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-UsingHTTPPOST.html> (the form),
//! <https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-HTTPPOSTConstructPolicy.html> (the policy),
//! <https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-authentication-HTTPPOST.html> (SigV4) and
//! the legacy SigV2 form (`AWSAccessKeyId`, `signature` = base64 HMAC-SHA1 of the policy).
//!
//! Pure: the caller parses the multipart body, hands over the fields that came before the `file`
//! part as a [`PostForm`], and passes the clock. [`authorize`] checks the signature and the policy
//! and yields the object key; [`check_length`] checks the file's size against the policy's
//! `content-length-range`; [`object_headers`] gives the headers the `PutObject` carries;
//! [`success_xml`] and [`redirect_location`] build the response.
//!
//! Choices where S3 and the Ceph s3-tests suite (the acceptance test) leave room:
//! - Form field names are matched case-insensitively (and lowercased); a name sent twice is
//!   refused, so the policy can never check one value while the object is stored with another.
//! - The path's bucket is an implicit input: every signed policy needs a `bucket` condition (as on
//!   S3: "Extra input fields: bucket"), and a `bucket` form field never overrides the path.
//! - A condition on a field the form lacks sees the empty string: `["starts-with", "$f", ""]`
//!   passes, `["starts-with", "$f", "x"]` fails (s3-tests expects both).
//! - Conditions on `key` are satisfied by the key with `${filename}` substituted or by the key as
//!   sent (boto3 signs `starts-with` prefixes of the former; hand-written policies often sign the
//!   latter with `eq`).
//! - Exempt from "Extra input fields": the signature fields, `policy`, `file`, `x-ignore-*` and
//!   `x-amz-checksum-*` (s3-tests posts a checksum its policy does not mention and expects success;
//!   a checksum can only make an upload fail).
//! - `expiration` must be ISO 8601 in UTC (`2026-12-01T12:00:00.000Z`, fraction optional); a space
//!   separator or an offset is an invalid policy (s3-tests expects 400 for Python's `str(datetime)`).

use std::borrow::Cow;
use std::collections::HashSet;
use std::fmt;

use base64::Engine;
use base64::alphabet;
use base64::engine::{DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig};
use serde::Deserialize;
use serde_json::Value;
use subtle::ConstantTimeEq;
use time::format_description::well_known::Rfc3339;
use time::{OffsetDateTime, PrimitiveDateTime, format_description::BorrowedFormatItem, macros::format_description};

use super::authority::{Authenticated, Authority};
use super::credentials::CredentialStore;
use super::sigv2;
use super::sigv4::verify::Identity;
use super::sigv4::{ALGORITHM, signature, signing_key, uri_encode};

/// Largest policy document accepted, decoded. The document is decoded and parsed into a JSON tree
/// in memory, so it is bounded on its own (the caller bounds each field). Real policies are a few
/// hundred bytes to a few KiB; 20 KiB is also the size S3 allows for all the form fields before the
/// file, so no policy S3 would take is refused.
pub(crate) const MAX_POLICY_BYTES: usize = 20 * 1024;
/// Most conditions in one policy. Each is checked against the form; real policies have a dozen.
pub(crate) const MAX_CONDITIONS: usize = 256;
/// Most form fields before the `file` part (each becomes at most one header).
pub(crate) const MAX_FORM_FIELDS: usize = 256;
/// Longest object key S3 accepts, in bytes of UTF-8.
pub(crate) const MAX_KEY_BYTES: usize = 1024;

/// The placeholder in `key` replaced by the uploaded file's name.
const FILENAME_VAR: &str = "${filename}";

/// `x-amz-date`: `YYYYMMDDTHHMMSSZ`.
const AMZ_DATE_FORMAT: &[BorrowedFormatItem<'static>] =
    format_description!("[year][month][day]T[hour][minute][second]Z");

/// Standard base64 that accepts the policy with or without `=` padding.
const POLICY_BASE64: GeneralPurpose = GeneralPurpose::new(
    &alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Form fields stored with the object under their own name.
const OBJECT_FIELDS: &[&str] = &[
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "content-md5",
    "content-type",
    "expires",
    "x-amz-server-side-encryption",
    "x-amz-storage-class",
    "x-amz-website-redirect-location",
];
/// Prefixes of form fields stored with the object under their own name.
const OBJECT_FIELD_PREFIXES: &[&str] = &["x-amz-meta-", "x-amz-server-side-encryption-", "x-amz-checksum-"];

/// Why a POST upload is refused (S3 codes in `crate::error`); the
/// `Display` text is the S3 message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PostError {
    /// A required field is missing, or a field is malformed or repeated.
    #[error("{0}")]
    InvalidArgument(String),
    /// Anonymous uploads are off, the policy has expired, or the form does not satisfy it.
    #[error("{0}")]
    AccessDenied(String),
    /// The access key is not in the gateway's credentials.
    #[error("The AWS access key Id you provided does not exist in our records.")]
    InvalidAccessKeyId,
    /// The signature does not match the policy under the access key's secret.
    #[error("The request signature we calculated does not match the signature you provided.")]
    SignatureDoesNotMatch,
    /// The policy is not base64, not JSON, too large, or not a valid policy document.
    #[error("{0}")]
    InvalidPolicyDocument(String),
    /// The file is smaller than the policy's `content-length-range` allows.
    #[error("Your proposed upload is smaller than the minimum allowed size")]
    EntityTooSmall,
    /// The file is larger than the policy's `content-length-range` allows.
    #[error("Your proposed upload exceeds the maximum allowed size")]
    EntityTooLarge,
    /// The key is longer than [`MAX_KEY_BYTES`].
    #[error("Your key is too long")]
    KeyTooLong,
    /// The `tagging` field is not a `<Tagging>` document.
    #[error("The XML you provided was not well-formed or did not validate against our published schema")]
    MalformedXml,
}

/// The form fields of a POST upload that came before the `file` part.
#[derive(Debug, Clone, Default)]
pub struct PostForm {
    /// `(lowercased name, value)` in the order sent.
    fields: Vec<(String, String)>,
}

impl PostForm {
    /// Collects the fields as `(name, value)` in the order sent, lowercasing names (S3 matches form
    /// field names case-insensitively, and stores `x-amz-meta-*` names in lower case).
    ///
    /// # Errors
    /// [`PostError::InvalidArgument`] for more than [`MAX_FORM_FIELDS`] fields or a name sent twice.
    pub fn new(fields: Vec<(String, String)>) -> Result<Self, PostError> {
        if fields.len() > MAX_FORM_FIELDS {
            return Err(PostError::InvalidArgument(format!("a POST form may carry at most {MAX_FORM_FIELDS} fields")));
        }
        let mut out: Vec<(String, String)> = Vec::with_capacity(fields.len());
        for (mut name, value) in fields {
            name.make_ascii_lowercase();
            if out.iter().any(|(n, _)| *n == name) {
                return Err(PostError::InvalidArgument(format!("the form field '{name}' appears more than once")));
            }
            out.push((name, value));
        }
        Ok(Self { fields: out })
    }

    /// The value of field `name`, in any case.
    #[must_use]
    pub(crate) fn get(&self, name: &str) -> Option<&str> {
        self.fields.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// `(lowercased name, value)` pairs in the order sent.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.fields.iter().map(|(n, v)| (n.as_str(), v.as_str()))
    }
}

/// What to answer after the object is stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SuccessAction {
    /// `success_action_redirect` (or the legacy `redirect`): `303 See Other` to
    /// [`redirect_location`] of this URL. Only absolute `http`/`https` URLs are taken; anything
    /// else is ignored, as S3 does, and the status applies.
    Redirect(String),
    /// `success_action_status`: `200` or `204` with an empty body, or `201` with [`success_xml`].
    /// Any other value, or none, is `204`.
    Status(u16),
}

/// An upload the form is allowed to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Authorized {
    /// Who signed the policy, or [`Identity::Anonymous`] for an unsigned form.
    pub(crate) identity: Identity,
    /// What the store request may carry: the store's key only for a verified signer.
    pub(crate) authority: Authority,
    /// The object key, with `${filename}` replaced by the file part's name.
    pub(crate) key: String,
    /// `(min, max)` bytes from the policy's `content-length-range`; check with [`check_length`].
    pub content_length_range: Option<(u64, u64)>,
    /// The response once the object is stored.
    pub(crate) success: SuccessAction,
}

/// Checks a POST upload's form: its signature (SigV4 or SigV2) and policy, or, for a form with
/// neither, whether anonymous uploads are allowed (the backend's bucket ACL then decides).
/// `bucket` is the bucket from the request path; `filename` the `file` part's filename, for
/// `${filename}` in `key`; `now` the gateway's clock.
///
/// # Errors
/// Any [`PostError`] but the two of [`check_length`]; the upload must then be refused.
pub fn authorize(
    form: &PostForm,
    bucket: &str,
    filename: Option<&str>,
    creds: &CredentialStore,
    allow_anonymous: bool,
    now: OffsetDateTime,
) -> Result<Authorized, PostError> {
    let mode = auth_mode(form)?;
    let identity = match mode {
        AuthMode::Anonymous if allow_anonymous => Identity::Anonymous,
        AuthMode::Anonymous => return Err(PostError::AccessDenied("Access Denied".to_owned())),
        AuthMode::V2 => verify_v2(form, creds)?,
        AuthMode::V4 => verify_v4(form, creds)?,
    };
    let raw_key = form.get("key").ok_or_else(|| missing_field("key"))?;
    let key = substitute_filename(raw_key, filename);
    if key.is_empty() {
        return Err(PostError::InvalidArgument("User key must have a length greater than 0.".to_owned()));
    }
    if key.len() > MAX_KEY_BYTES {
        return Err(PostError::KeyTooLong);
    }
    let content_length_range = if mode == AuthMode::Anonymous {
        None
    } else {
        // Both signed modes required the field; the signature covered it as sent.
        let policy = parse_policy(form.get("policy").unwrap_or_default())?;
        if policy.expiration <= now {
            return Err(PostError::AccessDenied("Invalid according to Policy: Policy expired.".to_owned()));
        }
        let inputs = Inputs { form, bucket, raw_key, key: &key };
        check_conditions(&policy.conditions, &inputs)?
    };
    let authority = match &identity {
        Identity::Anonymous => Authority::Anonymous,
        Identity::AccessKey(k) | Identity::Claimed(k) => Authority::Gateway(Authenticated::new(k)),
    };
    Ok(Authorized { identity, authority, key, content_length_range, success: success_action(form) })
}

/// Checks the file's length against the policy's `content-length-range` (inclusive bounds).
///
/// # Errors
/// [`PostError::EntityTooSmall`] or [`PostError::EntityTooLarge`].
pub fn check_length(range: Option<(u64, u64)>, len: u64) -> Result<(), PostError> {
    match range {
        Some((min, _)) if len < min => Err(PostError::EntityTooSmall),
        Some((_, max)) if len > max => Err(PostError::EntityTooLarge),
        _ => Ok(()),
    }
}

/// The headers the `PutObject` to the store carries, in form order, as `(lowercase name, value)`:
/// `cache-control`, `content-disposition`, `content-encoding`, `content-language`, `content-md5`,
/// `content-type`, `expires`, `x-amz-meta-*`, `x-amz-acl` (from `acl`), `x-amz-storage-class`,
/// `x-amz-server-side-encryption*`, `x-amz-website-redirect-location`, `x-amz-checksum-*`, and
/// `x-amz-tagging` converted from the `tagging` field's `<Tagging>` XML to `k=v&..` (each part
/// URI-encoded; the store validates the tags). Never the policy, signature or credential fields.
/// Empty fields are left out, except `x-amz-meta-*` (empty metadata is valid). Values may hold
/// UTF-8 (browsers send it): build them with `HeaderValue::from_bytes`.
///
/// # Errors
/// [`PostError::MalformedXml`] for a bad `tagging` document; [`PostError::InvalidArgument`] for a
/// name or value that cannot be a header (control characters).
pub fn object_headers(form: &PostForm) -> Result<Vec<(String, String)>, PostError> {
    let mut out = Vec::new();
    for (name, value) in form.iter() {
        let (header, value) = match name {
            "acl" => ("x-amz-acl".to_owned(), value.to_owned()),
            "tagging" => match tagging_header(value)? {
                Some(tags) => ("x-amz-tagging".to_owned(), tags),
                None => continue,
            },
            n if is_object_field(n) => (n.to_owned(), value.to_owned()),
            _ => continue,
        };
        if value.is_empty() && !header.starts_with("x-amz-meta-") {
            continue;
        }
        if http::HeaderName::from_bytes(header.as_bytes()).is_err()
            || http::HeaderValue::from_bytes(value.as_bytes()).is_err()
        {
            return Err(PostError::InvalidArgument(format!("the form field '{name}' cannot be stored as a header")));
        }
        out.push((header, value));
    }
    Ok(out)
}

/// The `<PostResponse>` body of a `201` answer. `etag` as in the `ETag` header (quoted);
/// `location` the object's URL.
#[must_use]
pub(crate) fn success_xml(location: &str, bucket: &str, key: &str, etag: &str) -> String {
    let mut out = String::from(r#"<?xml version="1.0" encoding="UTF-8"?><PostResponse>"#);
    for (tag, value) in [("Location", location), ("Bucket", bucket), ("Key", key), ("ETag", etag)] {
        out.push('<');
        out.push_str(tag);
        out.push('>');
        out.push_str(&xml_text(value));
        out.push_str("</");
        out.push_str(tag);
        out.push('>');
    }
    out.push_str("</PostResponse>");
    out
}

/// The `Location` of a `303` answer: `base` with `bucket`, `key` and `etag` (as in the `ETag`
/// header, quoted) appended to its query, each URI-encoded, before any `#fragment`.
#[must_use]
pub(crate) fn redirect_location(base: &str, bucket: &str, key: &str, etag: &str) -> String {
    let (head, fragment) = base.find('#').map_or((base, ""), |i| base.split_at(i));
    let sep = if !head.contains('?') {
        "?"
    } else if head.ends_with('?') || head.ends_with('&') {
        ""
    } else {
        "&"
    };
    format!("{head}{sep}bucket={}&key={}&etag={}{fragment}", uri_encode(bucket), uri_encode(key), uri_encode(etag))
}

/// `success_action_redirect` (or `redirect`) if it is an absolute `http`/`https` URL, else
/// `success_action_status`.
fn success_action(form: &PostForm) -> SuccessAction {
    let redirect =
        ["success_action_redirect", "redirect"].into_iter().filter_map(|f| form.get(f)).find(|u| is_http_url(u));
    if let Some(url) = redirect {
        return SuccessAction::Redirect(url.to_owned());
    }
    match form.get("success_action_status").map(str::trim) {
        Some("200") => SuccessAction::Status(200),
        Some("201") => SuccessAction::Status(201),
        _ => SuccessAction::Status(204),
    }
}

fn is_http_url(s: &str) -> bool {
    s.parse::<http::Uri>().is_ok_and(|u| matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some())
}

/// How the form authenticates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AuthMode {
    Anonymous,
    V2,
    V4,
}

fn auth_mode(form: &PostForm) -> Result<AuthMode, PostError> {
    let has = |name: &str| form.get(name).is_some();
    let v4 = has("x-amz-algorithm") || has("x-amz-credential") || has("x-amz-signature");
    let v2 = has("awsaccesskeyid") || has("signature");
    match (v4, v2) {
        (true, true) => Err(PostError::InvalidArgument(
            "Only one auth mechanism allowed: either x-amz-signature (SigV4) or signature (SigV2)".to_owned(),
        )),
        (true, false) => Ok(AuthMode::V4),
        (false, true) => Ok(AuthMode::V2),
        // A policy nobody signed.
        (false, false) if has("policy") => Err(missing_field("AWSAccessKeyId")),
        (false, false) => Ok(AuthMode::Anonymous),
    }
}

fn missing_field(name: &str) -> PostError {
    PostError::InvalidArgument(format!(
        "Bucket POST must contain a field named '{name}'.  If it is specified, please check the order of the fields."
    ))
}

fn verify_v2(form: &PostForm, creds: &CredentialStore) -> Result<Identity, PostError> {
    let access_key = form.get("awsaccesskeyid").ok_or_else(|| missing_field("AWSAccessKeyId"))?;
    let sent = form.get("signature").ok_or_else(|| missing_field("Signature"))?;
    let policy = form.get("policy").ok_or_else(|| missing_field("Policy"))?;
    let secret = creds.get(access_key).ok_or(PostError::InvalidAccessKeyId)?;
    check_signature(&sigv2::signature(secret.expose().as_bytes(), policy), sent)?;
    Ok(Identity::AccessKey(access_key.to_owned()))
}

fn verify_v4(form: &PostForm, creds: &CredentialStore) -> Result<Identity, PostError> {
    let field = |name: &str| form.get(name).ok_or_else(|| missing_field(name));
    let algorithm = field("x-amz-algorithm")?;
    let credential = field("x-amz-credential")?;
    let amz_date = field("x-amz-date")?;
    let sent = field("x-amz-signature")?;
    let policy = field("policy")?;
    if algorithm != ALGORITHM {
        return Err(PostError::InvalidArgument(format!("unsupported x-amz-algorithm '{algorithm}': use {ALGORITHM}")));
    }
    let Some((access_key, date, region)) = parse_credential(credential) else {
        return Err(PostError::InvalidArgument(format!(
            "invalid x-amz-credential '{credential}': expected <key>/<yyyymmdd>/<region>/s3/aws4_request"
        )));
    };
    // Informational for POST (the policy's expiration bounds the form's life), but S3 requires it
    // well-formed.
    if PrimitiveDateTime::parse(amz_date, AMZ_DATE_FORMAT).is_err() {
        return Err(PostError::InvalidArgument(format!("invalid x-amz-date '{amz_date}'")));
    }
    let secret = creds.get(access_key).ok_or(PostError::InvalidAccessKeyId)?;
    let key = signing_key(secret.expose().as_bytes(), date, region, "s3");
    check_signature(&signature(&key, policy), sent)?;
    Ok(Identity::AccessKey(access_key.to_owned()))
}

/// `(access key, date, region)` from `AK/yyyymmdd/region/s3/aws4_request`.
fn parse_credential(s: &str) -> Option<(&str, &str, &str)> {
    let mut it = s.splitn(5, '/');
    let (access_key, date, region, service, terminator) = (it.next()?, it.next()?, it.next()?, it.next()?, it.next()?);
    let ok = !access_key.is_empty()
        && date.len() == 8
        && date.bytes().all(|b| b.is_ascii_digit())
        && !region.is_empty()
        && service == "s3"
        && terminator == "aws4_request";
    ok.then_some((access_key, date, region))
}

fn check_signature(expected: &str, sent: &str) -> Result<(), PostError> {
    if bool::from(expected.as_bytes().ct_eq(sent.as_bytes())) { Ok(()) } else { Err(PostError::SignatureDoesNotMatch) }
}

/// `key` with every `${filename}` replaced by the last path component of `filename` (old browsers
/// send the full client path, with `\` on Windows).
fn substitute_filename(key: &str, filename: Option<&str>) -> String {
    if !key.contains(FILENAME_VAR) {
        return key.to_owned();
    }
    let name = filename.map_or("", |f| f.rfind(['/', '\\']).map_or(f, |i| &f[i + 1..]));
    key.replace(FILENAME_VAR, name)
}

/// A decoded policy document.
#[derive(Debug)]
struct Policy {
    expiration: OffsetDateTime,
    conditions: Vec<Condition>,
}

/// One policy condition; field names lowercased, without the `$`.
#[derive(Debug)]
enum Condition {
    Eq { field: String, value: String },
    StartsWith { field: String, prefix: String },
    LengthRange { min: u64, max: u64 },
}

impl fmt::Display for Condition {
    /// The condition in the policy's JSON syntax, for error messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Eq { field, value } => {
                write!(f, "[\"eq\", {}, {}]", Value::from(format!("${field}")), Value::from(value.as_str()))
            }
            Self::StartsWith { field, prefix } => {
                write!(f, "[\"starts-with\", {}, {}]", Value::from(format!("${field}")), Value::from(prefix.as_str()))
            }
            Self::LengthRange { min, max } => write!(f, "[\"content-length-range\", {min}, {max}]"),
        }
    }
}

fn invalid_policy(msg: &str) -> PostError {
    PostError::InvalidPolicyDocument(format!("Invalid Policy: {msg}"))
}

/// Decodes and parses the `policy` field. Top-level names are case-sensitive (`EXPIRATION` is not
/// `expiration`); other top-level names are ignored.
fn parse_policy(encoded: &str) -> Result<Policy, PostError> {
    // Some encoders (Ruby's `Base64.encode64`, MIME) wrap lines; the signature covered the field as
    // sent, so the whitespace is dropped only for decoding.
    let compact: Vec<u8> = encoded.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    let too_large = || invalid_policy(&format!("the policy is larger than {MAX_POLICY_BYTES} bytes."));
    if compact.len() > MAX_POLICY_BYTES.div_ceil(3) * 4 {
        return Err(too_large());
    }
    let json =
        POLICY_BASE64.decode(compact.as_slice()).map_err(|_| invalid_policy("the policy is not valid base64."))?;
    if json.len() > MAX_POLICY_BYTES {
        return Err(too_large());
    }
    let doc: Value = serde_json::from_slice(&json).map_err(|_| invalid_policy("Invalid JSON."))?;
    let Value::Object(doc) = doc else {
        return Err(invalid_policy("the policy must be a JSON object."));
    };
    let expiration = match doc.get("expiration") {
        None => return Err(invalid_policy("Policy missing expiration.")),
        Some(Value::String(s)) => {
            parse_expiration(s).ok_or_else(|| invalid_policy(&format!("Invalid 'expiration' value: '{s}'")))?
        }
        Some(other) => return Err(invalid_policy(&format!("Invalid 'expiration' value: {other}"))),
    };
    let conditions = match doc.get("conditions") {
        None => return Err(invalid_policy("Policy missing conditions.")),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(invalid_policy("'conditions' must be a list.")),
    };
    if conditions.len() > MAX_CONDITIONS {
        return Err(invalid_policy(&format!("a policy may have at most {MAX_CONDITIONS} conditions.")));
    }
    let conditions = conditions.iter().map(parse_condition).collect::<Result<Vec<_>, _>>()?;
    Ok(Policy { expiration, conditions })
}

/// ISO 8601 in UTC with a `T` separator and a `Z` zone, fraction optional. RFC 3339 parsing alone
/// would also take a space separator and numeric offsets.
fn parse_expiration(s: &str) -> Option<OffsetDateTime> {
    if s.as_bytes().get(10) != Some(&b'T') || !s.ends_with('Z') {
        return None;
    }
    OffsetDateTime::parse(s, &Rfc3339).ok()
}

fn parse_condition(c: &Value) -> Result<Condition, PostError> {
    match c {
        Value::Object(map) => {
            // `{"field": "value"}`: exactly one property, a string.
            let mut entries = map.iter();
            match (entries.next(), entries.next()) {
                (Some((field, Value::String(value))), None) => {
                    Ok(Condition::Eq { field: field.to_ascii_lowercase(), value: value.clone() })
                }
                _ => Err(invalid_policy(&format!(
                    "Invalid Simple-Condition: Simple-Conditions must have exactly one property specified: {c}"
                ))),
            }
        }
        Value::Array(items) => {
            parse_list_condition(items).ok_or_else(|| invalid_policy(&format!("Invalid Condition: {c}")))
        }
        _ => Err(invalid_policy(&format!("Invalid Condition: {c}"))),
    }
}

/// `["eq", "$field", "value"]`, `["starts-with", "$field", "prefix"]` or
/// `["content-length-range", min, max]`; the operator in any case, bounds as integers or strings.
fn parse_list_condition(items: &[Value]) -> Option<Condition> {
    let Some(Value::String(op)) = items.first() else { return None };
    let op = op.to_ascii_lowercase();
    match (op.as_str(), items) {
        ("eq" | "starts-with", [_, Value::String(field), Value::String(value)]) => {
            let field = field.strip_prefix('$')?.to_ascii_lowercase();
            let value = value.clone();
            Some(if op == "eq" {
                Condition::Eq { field, value }
            } else {
                Condition::StartsWith { field, prefix: value }
            })
        }
        ("content-length-range", [_, min, max]) => {
            let (min, max) = (length_bound(min)?, length_bound(max)?);
            (min <= max).then_some(Condition::LengthRange { min, max })
        }
        _ => None,
    }
}

fn length_bound(v: &Value) -> Option<u64> {
    match v {
        Value::Number(n) => n.as_u64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    }
}

/// What conditions are checked against.
struct Inputs<'a> {
    form: &'a PostForm,
    /// From the request path.
    bucket: &'a str,
    /// `key` as sent.
    raw_key: &'a str,
    /// `key` with `${filename}` substituted.
    key: &'a str,
}

impl<'a> Inputs<'a> {
    /// The values a condition on `field` may be satisfied by; a missing field is empty.
    fn values(&self, field: &str) -> [Option<&'a str>; 2] {
        match field {
            "bucket" => [Some(self.bucket), None],
            "key" => [Some(self.key), Some(self.raw_key)],
            other => [Some(self.form.get(other).unwrap_or_default()), None],
        }
    }
}

/// Checks every condition, then that every input is covered by one. Returns the
/// `content-length-range` (the intersection, if several are given).
fn check_conditions(conditions: &[Condition], inputs: &Inputs<'_>) -> Result<Option<(u64, u64)>, PostError> {
    let mut covered: HashSet<&str> = HashSet::new();
    let mut range: Option<(u64, u64)> = None;
    for c in conditions {
        let ok = match c {
            Condition::Eq { field, value } => {
                covered.insert(field.as_str());
                inputs.values(field).into_iter().flatten().any(|v| v == value.as_str())
            }
            Condition::StartsWith { field, prefix } => {
                covered.insert(field.as_str());
                inputs.values(field).into_iter().flatten().any(|v| starts_with(field, v, prefix))
            }
            Condition::LengthRange { min, max } => {
                range = Some(range.map_or((*min, *max), |(lo, hi)| (lo.max(*min), hi.min(*max))));
                true
            }
        };
        if !ok {
            return Err(PostError::AccessDenied(format!("Invalid according to Policy: Policy Condition failed: {c}")));
        }
    }
    let extra = std::iter::once("bucket")
        .chain(inputs.form.iter().map(|(name, _)| name))
        .find(|name| !is_exempt(name) && !covered.contains(name));
    if let Some(name) = extra {
        return Err(PostError::AccessDenied(format!("Invalid according to Policy: Extra input fields: {name}")));
    }
    Ok(range)
}

/// `starts-with`; an empty prefix matches anything. `content-type` may be a comma-separated list,
/// each entry of which must start with the prefix.
fn starts_with(field: &str, value: &str, prefix: &str) -> bool {
    if prefix.is_empty() {
        return true;
    }
    if field == "content-type" {
        value.split(',').all(|v| v.trim_start().starts_with(prefix))
    } else {
        value.starts_with(prefix)
    }
}

/// Fields no condition needs to cover.
fn is_exempt(name: &str) -> bool {
    matches!(name, "policy" | "signature" | "awsaccesskeyid" | "x-amz-signature" | "file")
        || name.starts_with("x-ignore-")
        || name.starts_with("x-amz-checksum-")
}

fn is_object_field(name: &str) -> bool {
    OBJECT_FIELDS.contains(&name) || OBJECT_FIELD_PREFIXES.iter().any(|p| name.len() > p.len() && name.starts_with(p))
}

#[derive(Debug, Deserialize)]
struct TaggingXml {
    #[serde(rename = "TagSet")]
    tag_set: TagSetXml,
}

#[derive(Debug, Deserialize)]
struct TagSetXml {
    #[serde(rename = "Tag", default)]
    tags: Vec<TagXml>,
}

#[derive(Debug, Deserialize)]
struct TagXml {
    #[serde(rename = "Key")]
    key: String,
    #[serde(rename = "Value")]
    value: String,
}

/// `<Tagging><TagSet><Tag><Key>k</Key><Value>v</Value></Tag>..</TagSet></Tagging>` as an
/// `x-amz-tagging` value; `None` for an empty field or tag set.
fn tagging_header(xml: &str) -> Result<Option<String>, PostError> {
    if xml.trim().is_empty() {
        return Ok(None);
    }
    let doc: TaggingXml = quick_xml::de::from_str(xml).map_err(|_| PostError::MalformedXml)?;
    let pairs: Vec<String> =
        doc.tag_set.tags.iter().map(|t| format!("{}={}", uri_encode(&t.key), uri_encode(&t.value))).collect();
    Ok((!pairs.is_empty()).then(|| pairs.join("&")))
}

/// XML text content, escaped.
fn xml_text(s: &str) -> Cow<'_, str> {
    quick_xml::escape::partial_escape(s)
}

#[cfg(test)]
mod tests {
    /// The status and code a client sees, through the gateway's one error mapping.
    trait Code {
        fn s3_code(&self) -> (u16, &'static str);
    }

    impl Code for PostError {
        fn s3_code(&self) -> (u16, &'static str) {
            let spec = crate::error::GatewayError::from(self.clone()).spec();
            (spec.status.as_u16(), spec.code)
        }
    }

    use time::macros::datetime;

    use super::*;
    use crate::s3::credentials::SecretKey;

    /// The example credentials of the S3 documentation.
    const AWS_AK: &str = "AKIAIOSFODNN7EXAMPLE";
    const AWS_SECRET: &str = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY";
    /// The policy of "Example: Browser-Based Upload using HTTP POST (Using AWS Signature Version 4)"
    /// (S3 API reference, sigv4-post-example), base64 as printed there: expiration
    /// 2015-12-30T12:00:00.000Z, bucket `sigv4examplebucket`, key starting `user/user1/`, acl
    /// `public-read`, a `success_action_redirect`, `image/` content type, `x-amz-meta-uuid`,
    /// SSE AES256, any `x-amz-meta-tag`, and the credential, algorithm and date fields.
    const AWS_POLICY_B64: &str = concat!(
        "eyAiZXhwaXJhdGlvbiI6ICIyMDE1LTEyLTMwVDEyOjAwOjAwLjAwMFoiLA0KICAiY29uZGl0aW9ucyI6IFsNCiAgICB7ImJ1Y2tl",
        "dCI6ICJzaWd2NGV4YW1wbGVidWNrZXQifSwNCiAgICBbInN0YXJ0cy13aXRoIiwgIiRrZXkiLCAidXNlci91c2VyMS8iXSwNCiAg",
        "ICB7ImFjbCI6ICJwdWJsaWMtcmVhZCJ9LA0KICAgIHsic3VjY2Vzc19hY3Rpb25fcmVkaXJlY3QiOiAiaHR0cDovL3NpZ3Y0ZXhh",
        "bXBsZWJ1Y2tldC5zMy5hbWF6b25hd3MuY29tL3N1Y2Nlc3NmdWxfdXBsb2FkLmh0bWwifSwNCiAgICBbInN0YXJ0cy13aXRoIiwg",
        "IiRDb250ZW50LVR5cGUiLCAiaW1hZ2UvIl0sDQogICAgeyJ4LWFtei1tZXRhLXV1aWQiOiAiMTQzNjUxMjM2NTEyNzQifSwNCiAg",
        "ICB7IngtYW16LXNlcnZlci1zaWRlLWVuY3J5cHRpb24iOiAiQUVTMjU2In0sDQogICAgWyJzdGFydHMtd2l0aCIsICIkeC1hbXot",
        "bWV0YS10YWciLCAiIl0sDQoNCiAgICB7IngtYW16LWNyZWRlbnRpYWwiOiAiQUtJQUlPU0ZPRE5ON0VYQU1QTEUvMjAxNTEyMjkv",
        "dXMtZWFzdC0xL3MzL2F3czRfcmVxdWVzdCJ9LA0KICAgIHsieC1hbXotYWxnb3JpdGhtIjogIkFXUzQtSE1BQy1TSEEyNTYifSwN",
        "CiAgICB7IngtYW16LWRhdGUiOiAiMjAxNTEyMjlUMDAwMDAwWiIgfQ0KICBdDQp9"
    );
    /// The signature that page gives for it.
    const AWS_SIGNATURE: &str = "8afdbf4008c03f22c2cd3cdb72e4afbb1f6a588f3255ac628749a66d7f09699e";
    const AWS_REDIRECT: &str = "http://sigv4examplebucket.s3.amazonaws.com/successful_upload.html";

    const NOW: OffsetDateTime = datetime!(2026-06-01 12:00 UTC);

    fn store() -> CredentialStore {
        let mut s = CredentialStore::default();
        s.insert(AWS_AK.into(), SecretKey::new(AWS_SECRET.into()));
        s.insert("AKID".into(), SecretKey::new("SECRET".into()));
        s
    }

    fn owned(fields: &[(&str, &str)]) -> Vec<(String, String)> {
        fields.iter().map(|(n, v)| ((*n).to_owned(), (*v).to_owned())).collect()
    }

    fn form(fields: &[(&str, &str)]) -> PostForm {
        PostForm::new(owned(fields)).expect("form")
    }

    fn b64(s: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(s)
    }

    /// A policy document expiring in 2030 with `conditions` (the inside of the JSON list).
    fn policy(conditions: &str) -> String {
        format!(r#"{{"expiration": "2030-01-01T00:00:00Z", "conditions": [{conditions}]}}"#)
    }

    /// `fields` plus a SigV2 signature (by `AKID`) of `policy_json`.
    fn v2_form(policy_json: &str, fields: &[(&str, &str)]) -> PostForm {
        let encoded = b64(policy_json);
        let sig = sigv2::signature(b"SECRET", &encoded);
        let mut all = owned(fields);
        all.extend(owned(&[("AWSAccessKeyId", "AKID"), ("policy", encoded.as_str()), ("signature", sig.as_str())]));
        PostForm::new(all).expect("form")
    }

    fn auth(form: &PostForm, filename: Option<&str>) -> Result<Authorized, PostError> {
        authorize(form, "b", filename, &store(), false, NOW)
    }

    /// The conditions s3-tests' `test_post_object_authenticated_request` signs, for bucket `b`.
    const S3TESTS_CONDITIONS: &str = r#"{"bucket": "b"}, ["starts-with", "$key", "foo"], {"acl": "private"},
        ["starts-with", "$Content-Type", "text/plain"], ["content-length-range", 0, 1024]"#;
    const S3TESTS_FIELDS: &[(&str, &str)] = &[("key", "foo.txt"), ("acl", "private"), ("Content-Type", "text/plain")];

    fn denied_because(r: &Result<Authorized, PostError>, needle: &str) {
        match r {
            Err(PostError::AccessDenied(msg)) => assert!(msg.contains(needle), "{msg}"),
            other => panic!("expected AccessDenied ({needle}), got {other:?}"),
        }
    }

    #[test]
    fn documented_sigv4_example_is_accepted() {
        // Independent vector: the signing key chain over the documented policy gives the documented
        // signature.
        let key = signing_key(AWS_SECRET.as_bytes(), "20151229", "us-east-1", "s3");
        assert_eq!(signature(&key, AWS_POLICY_B64), AWS_SIGNATURE);

        let f = form(&[
            ("key", "user/user1/${filename}"),
            ("acl", "public-read"),
            ("success_action_redirect", AWS_REDIRECT),
            ("Content-Type", "image/jpeg"),
            ("x-amz-meta-uuid", "14365123651274"),
            ("x-amz-server-side-encryption", "AES256"),
            ("X-Amz-Credential", "AKIAIOSFODNN7EXAMPLE/20151229/us-east-1/s3/aws4_request"),
            ("X-Amz-Algorithm", "AWS4-HMAC-SHA256"),
            ("X-Amz-Date", "20151229T000000Z"),
            ("x-amz-meta-tag", ""),
            ("Policy", AWS_POLICY_B64),
            ("X-Amz-Signature", AWS_SIGNATURE),
        ]);
        let at = datetime!(2015-12-29 12:00 UTC);
        let ok = authorize(&f, "sigv4examplebucket", Some("MyPhoto.jpg"), &store(), false, at).expect("valid");
        assert_eq!(
            ok,
            Authorized {
                identity: Identity::AccessKey(AWS_AK.to_owned()),
                authority: Authority::Gateway(Authenticated::new(AWS_AK)),
                key: "user/user1/MyPhoto.jpg".to_owned(),
                content_length_range: None,
                success: SuccessAction::Redirect(AWS_REDIRECT.to_owned()),
            }
        );
        assert_eq!(
            object_headers(&f).expect("headers"),
            owned(&[
                ("x-amz-acl", "public-read"),
                ("content-type", "image/jpeg"),
                ("x-amz-meta-uuid", "14365123651274"),
                ("x-amz-server-side-encryption", "AES256"),
                ("x-amz-meta-tag", ""),
            ])
        );

        let late = datetime!(2015-12-30 12:00 UTC);
        denied_because(&authorize(&f, "sigv4examplebucket", Some("a.jpg"), &store(), false, late), "Policy expired");
        let wrong_bucket = authorize(&f, "other", Some("a.jpg"), &store(), false, at);
        denied_because(&wrong_bucket, "Policy Condition failed");
    }

    #[test]
    fn sigv4_vector_computed_with_python_hmac() {
        // python3: k = HMAC chain of "AWS4SECRET" over 20290101, eu-west-1, s3, aws4_request;
        // hmac.new(k, base64(doc), sha256).hexdigest()
        let doc = concat!(
            r#"{"expiration": "2030-01-01T00:00:00.000Z", "conditions": [{"bucket": "photos"}, "#,
            r#"["starts-with", "$key", "user/"], ["content-length-range", 1, 1048576], "#,
            r#"{"x-amz-algorithm": "AWS4-HMAC-SHA256"}, "#,
            r#"{"x-amz-credential": "AKID/20290101/eu-west-1/s3/aws4_request"}, "#,
            r#"{"x-amz-date": "20290101T000000Z"}]}"#
        );
        let sig = "9b8395f93ea2171fc049569118dbb90693048d83b2e4dbc4d748f45ce38d7265";
        let encoded = b64(doc);
        let fields = [
            ("key", "user/cat.png"),
            ("x-amz-algorithm", "AWS4-HMAC-SHA256"),
            ("x-amz-credential", "AKID/20290101/eu-west-1/s3/aws4_request"),
            ("x-amz-date", "20290101T000000Z"),
            ("policy", encoded.as_str()),
            ("x-amz-signature", sig),
        ];
        let ok = authorize(&form(&fields), "photos", None, &store(), false, NOW).expect("valid");
        assert_eq!(ok.identity, Identity::AccessKey("AKID".to_owned()));
        assert_eq!(ok.content_length_range, Some((1, 1_048_576)));
        assert_eq!(ok.success, SuccessAction::Status(204));

        let mut bad = fields;
        bad[5].1 = "9b8395f93ea2171fc049569118dbb90693048d83b2e4dbc4d748f45ce38d7266";
        assert_eq!(authorize(&form(&bad), "photos", None, &store(), false, NOW), Err(PostError::SignatureDoesNotMatch));
        let mut bad = fields;
        bad[1].1 = "AWS4-ECDSA-P256-SHA256";
        assert!(matches!(
            authorize(&form(&bad), "photos", None, &store(), false, NOW),
            Err(PostError::InvalidArgument(_))
        ));
        let mut bad = fields;
        bad[2].1 = "AKID/20290101/eu-west-1/iam/aws4_request";
        assert!(matches!(
            authorize(&form(&bad), "photos", None, &store(), false, NOW),
            Err(PostError::InvalidArgument(_))
        ));
    }

    #[test]
    fn sigv2_vector_computed_with_python_hmac() {
        // python3: base64.b64encode(hmac.new(b"SECRET", base64(doc), sha1).digest())
        let doc = concat!(
            r#"{"expiration": "2030-01-01T00:00:00.000Z", "conditions": [{"bucket": "photos"}, "#,
            r#"["starts-with", "$key", "user/"], ["content-length-range", 1, 1048576]]}"#
        );
        let encoded = b64(doc);
        let sig = "1XZRdhzT4MexhgZ509y2VF/klv4=";
        let fields = [("key", "user/a"), ("AWSAccessKeyId", "AKID"), ("policy", encoded.as_str()), ("signature", sig)];
        let ok = authorize(&form(&fields), "photos", None, &store(), false, NOW).expect("valid");
        assert_eq!(ok.identity, Identity::AccessKey("AKID".to_owned()));
        assert_eq!(ok.key, "user/a");
    }

    #[test]
    fn sigv2_as_s3_tests_sends_it() {
        let f = v2_form(&policy(S3TESTS_CONDITIONS), S3TESTS_FIELDS);
        let ok = auth(&f, Some("file")).expect("valid");
        assert_eq!(ok.identity, Identity::AccessKey("AKID".to_owned()));
        assert_eq!(ok.key, "foo.txt");
        assert_eq!(ok.content_length_range, Some((0, 1024)));
        assert_eq!(ok.success, SuccessAction::Status(204));
        // Without Content-Type the starts-with "text/plain" condition sees "" and fails.
        let f = v2_form(&policy(S3TESTS_CONDITIONS), &[("key", "foo.txt"), ("acl", "private")]);
        denied_because(&auth(&f, None), "Policy Condition failed");
        // The ignored-field prefix and checksums need no condition.
        let mut fields = S3TESTS_FIELDS.to_vec();
        fields.extend([
            ("x-ignore-foo", "bar"),
            ("x-amz-checksum-sha256", "aTL9MeXa9HObn6eP93eygxsJlcwdCwCTysgGAZAgE7w="),
        ]);
        assert!(auth(&v2_form(&policy(S3TESTS_CONDITIONS), &fields), None).is_ok());
    }

    #[test]
    fn tampering_and_unknown_keys_are_refused() {
        let encoded = b64(&policy(S3TESTS_CONDITIONS));
        let sig = sigv2::signature(b"SECRET", &encoded);
        let signed = |access_key: &str, p: &str, sig: &str| {
            let mut fields = S3TESTS_FIELDS.to_vec();
            fields.extend([("AWSAccessKeyId", access_key), ("policy", p), ("signature", sig)]);
            auth(&form(&fields), None)
        };
        assert!(signed("AKID", &encoded, &sig).is_ok());
        // Another policy under the first one's signature.
        let other = b64(&policy(r#"{"bucket": "b"}, ["starts-with", "$key", ""]"#));
        assert_eq!(signed("AKID", &other, &sig), Err(PostError::SignatureDoesNotMatch));
        // A reversed signature, as s3-tests sends.
        let reversed: String = sig.chars().rev().collect();
        assert_eq!(signed("AKID", &encoded, &reversed), Err(PostError::SignatureDoesNotMatch));
        assert_eq!(signed("DIKA", &encoded, &sig), Err(PostError::InvalidAccessKeyId));
        assert_eq!(PostError::InvalidAccessKeyId.s3_code(), (403, "InvalidAccessKeyId"));
        assert_eq!(PostError::SignatureDoesNotMatch.s3_code(), (403, "SignatureDoesNotMatch"));
    }

    #[test]
    fn expired_policy_is_denied() {
        let doc = r#"{"expiration": "2026-06-01T12:00:00.000Z", "conditions": [{"bucket": "b"}, {"key": "k"}]}"#;
        let f = v2_form(doc, &[("key", "k")]);
        let r = auth(&f, None);
        assert_eq!(r.as_ref().map_err(PostError::s3_code), Err((403, "AccessDenied")));
        denied_because(&r, "Policy expired");
        let before = authorize(&f, "b", None, &store(), false, datetime!(2026-06-01 11:59:59 UTC));
        assert!(before.is_ok());
    }

    #[test]
    fn extra_fields_are_denied() {
        let mut fields = S3TESTS_FIELDS.to_vec();
        fields.push(("x-amz-meta-foo", "barclamp"));
        denied_because(
            &auth(&v2_form(&policy(S3TESTS_CONDITIONS), &fields), None),
            "Extra input fields: x-amz-meta-foo",
        );
        // The path's bucket is an input that needs a condition.
        let no_bucket = r#"["starts-with", "$key", "foo"], {"acl": "private"}, ["starts-with", "$Content-Type", ""]"#;
        denied_because(&auth(&v2_form(&policy(no_bucket), S3TESTS_FIELDS), None), "Extra input fields: bucket");
        // Covered by a condition, the field passes and is stored.
        let conditions = format!(r#"{S3TESTS_CONDITIONS}, ["starts-with", "$x-amz-meta-foo", "bar"]"#);
        let f = v2_form(&policy(&conditions), &fields);
        assert!(auth(&f, None).is_ok());
        assert!(object_headers(&f).expect("headers").contains(&("x-amz-meta-foo".to_owned(), "barclamp".to_owned())));
    }

    #[test]
    fn failed_conditions_are_denied() {
        let mut fields = S3TESTS_FIELDS.to_vec();
        fields.push(("x-amz-meta-foo", "barclamp"));
        let eq = format!(r#"{S3TESTS_CONDITIONS}, ["eq", "$x-amz-meta-foo", ""]"#);
        let r = auth(&v2_form(&policy(&eq), &fields), None);
        denied_because(&r, r#"Policy Condition failed: ["eq", "$x-amz-meta-foo", ""]"#);
        let prefix =
            r#"{"bucket": "b"}, ["starts-with", "$key", "bar"], {"acl": "private"}, {"content-type": "text/plain"}"#;
        denied_because(&auth(&v2_form(&policy(prefix), S3TESTS_FIELDS), None), r#"["starts-with", "$key", "bar"]"#);
        // A condition on a missing field: an empty prefix passes, any other fails.
        let missing = format!(r#"{S3TESTS_CONDITIONS}, ["starts-with", "$x-amz-server-side-encryption", ""]"#);
        assert!(auth(&v2_form(&policy(&missing), S3TESTS_FIELDS), None).is_ok());
        let missing = format!(r#"{S3TESTS_CONDITIONS}, ["starts-with", "$x-amz-meta-foo", "bar"]"#);
        denied_because(&auth(&v2_form(&policy(&missing), S3TESTS_FIELDS), None), "Policy Condition failed");
        // Content-Type lists: every entry must match.
        let ct = r#"{"bucket": "b"}, {"key": "k"}, ["starts-with", "$Content-Type", "image/"]"#;
        assert!(auth(&v2_form(&policy(ct), &[("key", "k"), ("content-type", "image/png, image/gif")]), None).is_ok());
        let mixed = v2_form(&policy(ct), &[("key", "k"), ("content-type", "image/png,text/html")]);
        denied_because(&auth(&mixed, None), "Policy Condition failed");
    }

    #[test]
    fn content_length_range() {
        assert_eq!(check_length(Some((512, 1000)), 3), Err(PostError::EntityTooSmall));
        assert_eq!(check_length(Some((0, 0)), 3), Err(PostError::EntityTooLarge));
        assert_eq!(check_length(Some((0, 1024)), 1024), Ok(()));
        assert_eq!(check_length(Some((3, 3)), 3), Ok(()));
        assert_eq!(check_length(None, u64::MAX), Ok(()));
        assert_eq!(PostError::EntityTooSmall.s3_code(), (400, "EntityTooSmall"));
        assert_eq!(PostError::EntityTooLarge.s3_code(), (400, "EntityTooLarge"));
        // Bounds as strings; several ranges intersect.
        let c =
            r#"{"bucket": "b"}, {"key": "k"}, ["content-length-range", "10", "100"], ["content-length-range", 0, 50]"#;
        assert_eq!(
            auth(&v2_form(&policy(c), &[("key", "k")]), None).expect("valid").content_length_range,
            Some((10, 50))
        );
        // Missing, negative or reversed bounds are an invalid policy.
        for bad in [
            r#"["content-length-range", 0]"#,
            r#"["content-length-range", -1, 0]"#,
            r#"["content-length-range", 5, 1]"#,
        ] {
            let c = format!(r#"{{"bucket": "b"}}, {{"key": "k"}}, {bad}"#);
            let r = auth(&v2_form(&policy(&c), &[("key", "k")]), None);
            assert!(matches!(r, Err(PostError::InvalidPolicyDocument(_))), "{bad}: {r:?}");
        }
    }

    #[test]
    fn filename_substitution() {
        let f = v2_form(
            &policy(S3TESTS_CONDITIONS),
            &[("key", "${filename}"), ("acl", "private"), ("Content-Type", "text/plain")],
        );
        assert_eq!(auth(&f, Some("foo.txt")).expect("valid").key, "foo.txt");
        // The starts-with "foo" condition is checked against the substituted key.
        denied_because(&auth(&f, Some("bar.txt")), "Policy Condition failed");
        assert_eq!(auth(&f, Some(r"C:\Users\me\foo.png")).expect("valid").key, "foo.png");
        assert_eq!(auth(&f, Some("dir/foo.gif")).expect("valid").key, "foo.gif");
        assert!(matches!(auth(&f, None), Err(PostError::InvalidArgument(_))));
        // An eq condition on the key as sent also holds.
        let c = r#"{"bucket": "b"}, {"key": "up/${filename}"}"#;
        assert_eq!(
            auth(&v2_form(&policy(c), &[("key", "up/${filename}")]), Some("x.bin")).expect("valid").key,
            "up/x.bin"
        );
        // A key is required.
        let r = auth(&v2_form(&policy(r#"{"bucket": "b"}"#), &[]), None);
        assert_eq!(r.map_err(|e| e.s3_code()), Err((400, "InvalidArgument")));
        let long = "k".repeat(MAX_KEY_BYTES + 1);
        let f = v2_form(&policy(r#"{"bucket": "b"}, ["starts-with", "$key", ""]"#), &[("key", long.as_str())]);
        assert_eq!(auth(&f, None), Err(PostError::KeyTooLong));
    }

    #[test]
    fn anonymous_uploads_and_half_signed_forms() {
        let f = form(&[("key", "foo.txt"), ("acl", "public-read"), ("Content-Type", "text/plain")]);
        let ok = authorize(&f, "b", None, &store(), true, NOW).expect("anonymous allowed");
        assert_eq!(ok.identity, Identity::Anonymous);
        assert_eq!(ok.content_length_range, None);
        assert_eq!(ok.key, "foo.txt");
        let denied = authorize(&f, "b", None, &store(), false, NOW);
        assert_eq!(denied.map_err(|e| e.s3_code()), Err((403, "AccessDenied")));

        // A policy without a signature (s3-tests: 400), a signature without a policy.
        let encoded = b64(&policy(S3TESTS_CONDITIONS));
        for fields in [
            vec![("key", "foo.txt"), ("AWSAccessKeyId", "AKID"), ("policy", encoded.as_str())],
            vec![("key", "foo.txt"), ("policy", encoded.as_str())],
            vec![("key", "foo.txt"), ("AWSAccessKeyId", "AKID"), ("signature", "c2ln")],
            vec![("key", "k"), ("x-amz-signature", "00"), ("signature", "c2ln"), ("policy", encoded.as_str())],
        ] {
            let r = authorize(&form(&fields), "b", None, &store(), true, NOW);
            assert_eq!(r.map_err(|e| e.s3_code()), Err((400, "InvalidArgument")), "{fields:?}");
        }
    }

    #[test]
    fn field_names_are_case_insensitive() {
        let conditions = r#"{"bUcKeT": "b"}, ["StArTs-WiTh", "$KeY", "foo"], {"AcL": "private"},
            ["StArTs-WiTh", "$CoNtEnT-TyPe", "text/plain"], ["content-length-range", 0, 1024]"#;
        let encoded = b64(&policy(conditions));
        let sig = sigv2::signature(b"SECRET", &encoded);
        let f = form(&[
            ("kEy", "foo.txt"),
            ("AWSAccessKeyId", "AKID"),
            ("aCl", "private"),
            ("signature", sig.as_str()),
            ("pOLICy", encoded.as_str()),
            ("Content-Type", "text/plain"),
        ]);
        assert_eq!(f.get("KEY"), Some("foo.txt"));
        assert_eq!(f.iter().next(), Some(("key", "foo.txt")));
        assert!(auth(&f, None).is_ok());
        // Names sent twice, in any case, are refused.
        let dup = PostForm::new(owned(&[("key", "a"), ("KEY", "b")]));
        assert!(matches!(dup, Err(PostError::InvalidArgument(_))));
        // The policy's own top-level names are case-sensitive.
        for doc in [
            r#"{"expiration": "2030-01-01T00:00:00Z", "CONDITIONS": [{"bucket": "b"}]}"#,
            r#"{"EXPIRATION": "2030-01-01T00:00:00Z", "conditions": [{"bucket": "b"}]}"#,
        ] {
            let r = auth(&v2_form(doc, &[("key", "k")]), None);
            assert_eq!(r.map_err(|e| e.s3_code()), Err((400, "InvalidPolicyDocument")), "{doc}");
        }
    }

    #[test]
    fn invalid_policy_documents() {
        let cases = [
            r#"{"expiration": "2030-01-01 00:00:00.123456+00:00", "conditions": [{"bucket": "b"}]}"#.to_owned(),
            r#"{"expiration": "2030-01-01T00:00:00+01:00", "conditions": [{"bucket": "b"}]}"#.to_owned(),
            r#"{"expiration": 1893456000, "conditions": [{"bucket": "b"}]}"#.to_owned(),
            r#"{"expiration": "2030-01-01T00:00:00Z", "conditions": {"bucket": "b"}}"#.to_owned(),
            policy("{}"),
            policy(r#"{"bucket": "b", "key": "k"}"#),
            policy(r#"{"bucket": 5}"#),
            policy(r#"["eq", "key", "k"]"#),
            policy(r#"["ends-with", "$key", "k"]"#),
            policy(r#"["eq", "$key"]"#),
            policy("5"),
            "not json".to_owned(),
            "[1, 2]".to_owned(),
            format!(
                r#"{{"expiration": "2030-01-01T00:00:00Z", "conditions": [], "pad": "{}"}}"#,
                "x".repeat(MAX_POLICY_BYTES)
            ),
        ];
        for doc in &cases {
            let r = auth(&v2_form(doc, &[("key", "k")]), None);
            assert_eq!(r.map_err(|e| e.s3_code()), Err((400, "InvalidPolicyDocument")), "{doc:.80}");
        }
        // Not base64 (signed as sent, so the signature matches).
        let sig = sigv2::signature(b"SECRET", "!!!");
        let f = form(&[("key", "k"), ("AWSAccessKeyId", "AKID"), ("policy", "!!!"), ("signature", sig.as_str())]);
        assert!(matches!(auth(&f, None), Err(PostError::InvalidPolicyDocument(_))));
        // Wrapped base64 without padding is fine.
        let encoded = b64(&policy(r#"{"bucket": "b"}, {"key": "k"}"#));
        let (head, tail) = encoded.split_at(20);
        let wrapped = format!("{head}\n{}", tail.trim_end_matches('='));
        let sig = sigv2::signature(b"SECRET", &wrapped);
        let f = form(&[
            ("key", "k"),
            ("AWSAccessKeyId", "AKID"),
            ("policy", wrapped.as_str()),
            ("signature", sig.as_str()),
        ]);
        assert!(auth(&f, None).is_ok());
    }

    #[test]
    fn success_actions() {
        let conditions =
            r#"{"bucket": "b"}, ["starts-with", "$key", ""], ["starts-with", "$success_action_status", ""]"#;
        let status = |v: &str| {
            let f = v2_form(&policy(conditions), &[("key", "k"), ("success_action_status", v)]);
            auth(&f, None).expect("valid").success
        };
        assert_eq!(status("201"), SuccessAction::Status(201));
        assert_eq!(status("200"), SuccessAction::Status(200));
        assert_eq!(status("404"), SuccessAction::Status(204));
        let f = form(&[("key", "k"), ("success_action_redirect", "not a url"), ("redirect", "https://h/done")]);
        let ok = authorize(&f, "b", None, &store(), true, NOW).expect("valid");
        assert_eq!(ok.success, SuccessAction::Redirect("https://h/done".to_owned()));
        let f = form(&[("key", "k"), ("success_action_redirect", "/relative"), ("success_action_status", "201")]);
        assert_eq!(authorize(&f, "b", None, &store(), true, NOW).expect("valid").success, SuccessAction::Status(201));
    }

    #[test]
    fn object_headers_and_tagging() {
        let f = form(&[
            ("key", "k"),
            ("policy", "p"),
            ("signature", "s"),
            ("AWSAccessKeyId", "AKID"),
            ("x-amz-credential", "c"),
            ("success_action_status", "201"),
            ("Cache-Control", "no-cache"),
            ("Content-Type", ""),
            ("X-Amz-Meta-Name", "zoë"),
            ("x-amz-storage-class", "STANDARD_IA"),
            ("x-amz-server-side-encryption-customer-algorithm", "AES256"),
            ("x-amz-checksum-sha256", "aTL9MeXa9HObn6eP93eygxsJlcwdCwCTysgGAZAgE7w="),
            (
                "tagging",
                "<Tagging><TagSet><Tag><Key>0</Key><Value>0</Value></Tag><Tag><Key>a b</Key><Value>&amp;</Value></Tag>\
                 </TagSet></Tagging>",
            ),
            ("x-amz-meta-", "nameless"),
        ]);
        assert_eq!(
            object_headers(&f).expect("headers"),
            owned(&[
                ("cache-control", "no-cache"),
                ("x-amz-meta-name", "zoë"),
                ("x-amz-storage-class", "STANDARD_IA"),
                ("x-amz-server-side-encryption-customer-algorithm", "AES256"),
                ("x-amz-checksum-sha256", "aTL9MeXa9HObn6eP93eygxsJlcwdCwCTysgGAZAgE7w="),
                ("x-amz-tagging", "0=0&a%20b=%26"),
            ])
        );
        let bad = form(&[("tagging", "<Tagging><TagSet><Tag><Key>k</Key>")]);
        assert_eq!(object_headers(&bad), Err(PostError::MalformedXml));
        let empty = form(&[("tagging", "<Tagging><TagSet></TagSet></Tagging>")]);
        assert_eq!(object_headers(&empty), Ok(vec![]));
        let control = form(&[("x-amz-meta-a", "line\r\nx-evil: 1")]);
        assert!(matches!(object_headers(&control), Err(PostError::InvalidArgument(_))));
    }

    #[test]
    fn success_xml_is_escaped() {
        assert_eq!(
            success_xml("http://h/b/a%26b", "b", "a&b<c>", "\"0123\""),
            concat!(
                r#"<?xml version="1.0" encoding="UTF-8"?><PostResponse><Location>http://h/b/a%26b</Location>"#,
                r#"<Bucket>b</Bucket><Key>a&amp;b&lt;c&gt;</Key><ETag>"0123"</ETag></PostResponse>"#
            )
        );
    }

    #[test]
    fn redirect_location_is_encoded() {
        // The exact form s3-tests expects.
        assert_eq!(
            redirect_location("http://h:8000/b", "b", "foo.txt", "\"abc\""),
            "http://h:8000/b?bucket=b&key=foo.txt&etag=%22abc%22"
        );
        assert_eq!(
            redirect_location("https://h/done?x=1#top", "b", "a b/c&d", "\"e\""),
            "https://h/done?x=1&bucket=b&key=a%20b%2Fc%26d&etag=%22e%22#top"
        );
        assert_eq!(redirect_location("https://h/?", "b", "k", "e"), "https://h/?bucket=b&key=k&etag=e");
    }
}
