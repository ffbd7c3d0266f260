//! A pushdown's source, read from the store as one typed step: what a read asks for
//! ([`SourceRead`]: a range, and the version it must or must not be) and what the store answered
//! ([`SourceOutcome`]). Whole-object reads, a cached output's revalidation and the Parquet
//! tail-then-span read of `row-groups` all go through [`SourceReader::read`]; how a read becomes
//! headers ([`SourceRead::headers`]) and how an answer becomes an outcome ([`SourceOutcome::of`])
//! are pure.

use std::time::Instant;

use http::{HeaderMap, HeaderValue, Method, Response, StatusCode};

use crate::backend::{Backend, ForwardPayload, ForwardRequest};
use crate::body::Body;
use crate::error::GatewayError;
use crate::pushdown::PushdownError;
use crate::s3::authority::Authority;
use crate::s3::route::{S3Op, Target};

/// Which bytes of the source a read asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SourceRange {
    /// The whole object, or what the caller's own signed `Range` asks for.
    Whole,
    /// The last `n` bytes (a Parquet file's footer, and the row groups before it).
    Tail(u64),
    /// Bytes `start..end`.
    Span { start: u64, end: u64 },
}

/// One read of the source. The conditions are unsigned and outside the caller's signature, where
/// every store accepts them.
#[derive(Debug, Clone, Copy)]
pub(super) struct SourceRead<'a> {
    pub(crate) range: SourceRange,
    /// Only this version (`If-Match`): a span must come from the version its footer came from.
    pub(crate) if_match: Option<&'a str>,
    /// Not this version (`If-None-Match`): a cached output's source, revalidated. Left out when
    /// the caller sent its own, which refers to the output.
    pub(crate) if_none_match: Option<&'a str>,
    /// Not changed since (`If-Unmodified-Since`): the version a store's answer allowed without
    /// naming it ([`Pin`]).
    pub(crate) if_unmodified_since: Option<&'a str>,
}

impl SourceRead<'_> {
    /// The whole source (or the caller's signed range), unconditionally.
    pub(super) const WHOLE: Self =
        Self { range: SourceRange::Whole, if_match: None, if_none_match: None, if_unmodified_since: None };

    /// `base` (the request's forwarded headers) with this read's range and conditions, and which
    /// conditions were added (an answer to a condition the caller set is the caller's).
    pub(super) fn headers(&self, base: &HeaderMap) -> Result<(HeaderMap, Asked), PushdownError> {
        let mut h = base.clone();
        let mut asked = Asked::default();
        let value = |s: String| HeaderValue::from_str(&s).map_err(|e| PushdownError::Internal(e.to_string()));
        match self.range {
            SourceRange::Whole => {}
            SourceRange::Tail(n) => {
                h.insert(http::header::RANGE, value(format!("bytes=-{n}"))?);
            }
            SourceRange::Span { start, end } => {
                h.insert(http::header::RANGE, value(format!("bytes={start}-{}", end.saturating_sub(1)))?);
            }
        }
        if let Some(etag) = self.if_match.filter(|e| !e.is_empty()) {
            h.insert(http::header::IF_MATCH, value(etag.to_owned())?);
            asked.matching = true;
        }
        if let Some(at) = self.if_unmodified_since {
            h.insert(http::header::IF_UNMODIFIED_SINCE, value(at.to_owned())?);
            asked.matching = true;
        }
        if let Some(etag) = self.if_none_match
            && !h.contains_key(http::header::IF_NONE_MATCH)
            && let Ok(v) = HeaderValue::from_str(etag)
        {
            h.insert(http::header::IF_NONE_MATCH, v);
            asked.unchanged = true;
        }
        Ok((h, asked))
    }
}

/// The version of a source that the store let a caller read, as the gateway's later reads for
/// that caller pin it: its ETag, or, where the store's answer named none (a `416` to the caller's
/// own signed `Range`), the time of that answer (`If-Unmodified-Since`).
#[derive(Debug, Clone, Default)]
pub(super) struct Pin {
    etag: String,
    at: Option<String>,
}

impl Pin {
    /// The version `accepted` answered for: `None` when its answer names neither.
    pub(super) fn of(accepted: &SourceBody) -> Option<Self> {
        let at = accepted.header(&http::header::DATE).filter(|_| accepted.etag.is_empty()).map(str::to_owned);
        (!accepted.etag.is_empty() || at.is_some()).then(|| Self { etag: accepted.etag.clone(), at })
    }

    /// A read of `range` of this version.
    pub(super) fn read(&self, range: SourceRange) -> SourceRead<'_> {
        SourceRead {
            range,
            if_match: Some(self.etag.as_str()).filter(|e| !e.is_empty()),
            if_unmodified_since: self.at.as_deref(),
            ..SourceRead::WHOLE
        }
    }
}

/// The conditions a read added itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Asked {
    pub(crate) matching: bool,
    pub(crate) unchanged: bool,
}

/// The source's bytes as the store answered a read.
#[derive(Debug)]
pub(super) struct SourceBody {
    pub(crate) resp: Response<Body>,
    /// The version read (empty when the store named none).
    pub(crate) etag: String,
    /// When the read was sent (the request's fetch time starts here).
    pub(crate) started: Instant,
    /// `Content-Range` of a partial answer: (first, last, length).
    pub(crate) content_range: Option<(u64, u64, u64)>,
    /// Read with the gateway's key for a caller the store accepted ([`Pin`]): nothing is left
    /// to read for that caller.
    pub(crate) delegated: bool,
}

impl SourceBody {
    /// The store sent only part of the object (a `206` that does not cover every byte).
    pub(super) fn partial(&self) -> bool {
        self.resp.status() == StatusCode::PARTIAL_CONTENT && !self.content_range.is_some_and(whole_object)
    }

    pub(super) fn header(&self, name: &http::HeaderName) -> Option<&str> {
        self.resp.headers().get(name).and_then(|v| v.to_str().ok())
    }
}

/// What the store answered a [`SourceRead`].
#[derive(Debug)]
pub(super) enum SourceOutcome {
    /// The bytes asked for.
    Body(SourceBody),
    /// `304` to the read's own `If-None-Match`: the version it named is still the store's.
    NotModified(Response<Body>),
    /// `412` to the read's own `If-Match`: the object changed since that version.
    Changed(Response<Body>),
    /// Any other answer (`403`, `404`, a `304` to the caller's own condition): the store's say,
    /// passed to the caller as it is.
    Refused(Response<Body>),
}

impl SourceOutcome {
    /// The store's answer, whatever it was.
    pub(super) fn into_response(self) -> Response<Body> {
        match self {
            Self::Body(SourceBody { resp, .. })
            | Self::NotModified(resp)
            | Self::Changed(resp)
            | Self::Refused(resp) => resp,
        }
    }

    /// Classifies the store's answer to a read that added `asked` (pure).
    pub(super) fn of(resp: Response<Body>, asked: Asked, started: Instant) -> Self {
        match resp.status() {
            StatusCode::NOT_MODIFIED if asked.unchanged => Self::NotModified(resp),
            StatusCode::PRECONDITION_FAILED if asked.matching => Self::Changed(resp),
            s if s.is_success() => {
                let header = |name| resp.headers().get(name).and_then(|v: &HeaderValue| v.to_str().ok());
                let etag = header(&http::header::ETAG).unwrap_or_default().to_owned();
                let content_range = header(&http::header::CONTENT_RANGE).and_then(parse_content_range);
                Self::Body(SourceBody { resp, etag, started, content_range, delegated: false })
            }
            _ => Self::Refused(resp),
        }
    }
}

/// Reads one request's source: the same target, query, method and authority for every read.
#[derive(Debug)]
pub(super) struct SourceReader<'g> {
    pub(crate) backend: &'g Backend,
    /// The caller's own in transparent mode (it signed it), else `GET`.
    pub(crate) method: Method,
    pub(crate) target: Target,
    pub(crate) query: Option<String>,
    /// What every read starts from ([`SourceRead::headers`] adds its range and conditions).
    pub(crate) headers: HeaderMap,
    pub(crate) authority: Authority,
}

impl SourceReader<'_> {
    /// A `416` or `412` answer to the caller's own signed request (transparent mode) read as a
    /// body of no bytes (`Body`, else `Refused`), where it answers the `Range` or `If-Match` the caller signed: both refer
    /// to the output, and the store authorized the caller before it evaluated them
    /// ([`crate::s3::authority::Authenticated::store_accepted`]). The gateway evaluates them on
    /// the output itself. Any other answer is the store's, as it is.
    pub(super) fn conditions_only(&self, resp: Response<Body>) -> SourceOutcome {
        let signed = |name| matches!(self.authority, Authority::Caller(_)) && self.headers.contains_key(name);
        let only = match resp.status() {
            StatusCode::RANGE_NOT_SATISFIABLE => signed(http::header::RANGE),
            // If-Unmodified-Since refers to the source's time, which the output shares: its 412 stands.
            StatusCode::PRECONDITION_FAILED => {
                signed(http::header::IF_MATCH) && !signed(http::header::IF_UNMODIFIED_SINCE)
            }
            _ => false,
        };
        if only {
            SourceOutcome::Body(SourceBody {
                resp,
                etag: String::new(),
                started: Instant::now(),
                content_range: None,
                delegated: false,
            })
        } else {
            SourceOutcome::Refused(resp)
        }
    }

    /// Sends `read` to the store.
    ///
    /// # Errors
    /// The store could not be asked (`crate::backend` errors), or a condition is not a header value.
    pub(super) async fn read(&self, read: SourceRead<'_>) -> Result<SourceOutcome, GatewayError> {
        let (headers, asked) = read.headers(&self.headers)?;
        let started = Instant::now();
        let resp = self
            .backend
            .send(ForwardRequest {
                op: S3Op::GetObject,
                method: self.method.clone(),
                target: self.target.clone(),
                query: self.query.clone(),
                headers,
                body: Body::empty(),
                payload: ForwardPayload::Empty,
                authority: self.authority.clone(),
                expect_continue: false,
            })
            .await?;
        Ok(SourceOutcome::of(resp, asked, started))
    }
}

/// A `206`'s `Content-Range` (`bytes a-b/n`): `(a, b, n)`, with `a <= b < n`.
fn parse_content_range(v: &str) -> Option<(u64, u64, u64)> {
    let (range, total) = v.strip_prefix("bytes ")?.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let (a, b, n) = (a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?, total.trim().parse::<u64>().ok()?);
    (a <= b && b < n).then_some((a, b, n))
}

/// Whether a `206`'s range covers all `n` bytes of the object.
fn whole_object((a, b, n): (u64, u64, u64)) -> bool {
    a == 0 && b.checked_add(1) == Some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&str, &str)]) -> Response<Body> {
        let mut b = Response::builder().status(status);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(Body::empty()).expect("response")
    }

    #[test]
    fn a_read_becomes_its_range_and_the_conditions_it_adds() {
        let mut base = HeaderMap::new();
        base.insert(http::header::HOST, HeaderValue::from_static("store"));
        let (h, asked) = SourceRead::WHOLE.headers(&base).expect("headers");
        assert_eq!((h.len(), asked), (1, Asked::default()));
        let tail = SourceRead { range: SourceRange::Tail(65536), if_none_match: Some("\"v1\""), ..SourceRead::WHOLE };
        let (h, asked) = tail.headers(&base).expect("headers");
        assert_eq!(h[http::header::RANGE], "bytes=-65536");
        assert_eq!(h[http::header::IF_NONE_MATCH], "\"v1\"");
        assert_eq!(asked, Asked { matching: false, unchanged: true });
        let span = SourceRead {
            range: SourceRange::Span { start: 4, end: 100 },
            if_match: Some("\"v1\""),
            ..SourceRead::WHOLE
        };
        let (h, asked) = span.headers(&base).expect("headers");
        assert_eq!(
            (h[http::header::RANGE].to_str().ok(), h[http::header::IF_MATCH].to_str().ok()),
            (Some("bytes=4-99"), Some("\"v1\""))
        );
        assert!(asked.matching && !asked.unchanged);
        // The caller's own If-None-Match refers to the output: it stays, and its 304 is the caller's.
        base.insert(http::header::IF_NONE_MATCH, HeaderValue::from_static("\"output\""));
        let (h, asked) = tail.headers(&base).expect("headers");
        assert_eq!((h[http::header::IF_NONE_MATCH].to_str().ok(), asked.unchanged), (Some("\"output\""), false));
        // A store that named no version: no If-Match.
        let (h, _) = SourceRead { if_match: Some(""), ..span }.headers(&HeaderMap::new()).expect("headers");
        assert!(!h.contains_key(http::header::IF_MATCH));
    }

    #[test]
    fn answers_are_classified_by_the_conditions_the_read_added() {
        let now = Instant::now();
        let unchanged = Asked { unchanged: true, ..Asked::default() };
        let matching = Asked { matching: true, ..Asked::default() };
        assert!(matches!(SourceOutcome::of(answer(304, &[]), unchanged, now), SourceOutcome::NotModified(_)));
        assert!(matches!(SourceOutcome::of(answer(304, &[]), Asked::default(), now), SourceOutcome::Refused(_)));
        assert!(matches!(SourceOutcome::of(answer(412, &[]), matching, now), SourceOutcome::Changed(_)));
        assert!(matches!(SourceOutcome::of(answer(412, &[]), unchanged, now), SourceOutcome::Refused(_)));
        assert!(matches!(SourceOutcome::of(answer(403, &[]), unchanged, now), SourceOutcome::Refused(_)));
        let SourceOutcome::Body(b) =
            SourceOutcome::of(answer(206, &[("etag", "\"v2\""), ("content-range", "bytes 10-19/20")]), matching, now)
        else {
            panic!("a body")
        };
        assert_eq!((b.etag.as_str(), b.content_range, b.partial()), ("\"v2\"", Some((10, 19, 20)), true));
        // A 206 with every byte (`bytes=0-`, or a block larger than the object) is the whole source.
        let SourceOutcome::Body(b) =
            SourceOutcome::of(answer(206, &[("content-range", "bytes 0-19/20")]), Asked::default(), now)
        else {
            panic!("a body")
        };
        assert!(!b.partial() && b.etag.is_empty());
    }

    #[test]
    fn a_content_range_covering_every_byte_is_the_whole_object() {
        let whole = |v: &str| parse_content_range(v).is_some_and(whole_object);
        assert!(whole("bytes 0-99/100"));
        assert!(whole("bytes 0-0/1"));
        assert!(!whole("bytes 0-9/100"));
        assert!(!whole("bytes 1-99/100"));
        assert!(!whole("bytes 0-99/*"));
        assert!(!whole("bytes */100"));
        assert!(!whole("bytes 0-18446744073709551615/0"));
        assert_eq!(parse_content_range("bytes 90-99/100"), Some((90, 99, 100)));
        assert_eq!(parse_content_range("bytes 9-0/100"), None);
    }
}
