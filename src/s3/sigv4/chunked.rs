//! Decoding of `aws-chunked` request bodies (`Content-Encoding: aws-chunked`).
//!
//! Spec: <https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-streaming.html> and
//! <https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-streaming-trailers.html>.
//!
//! Wire form: `hex-size[;chunk-signature=sig]\r\n<data>\r\n` repeated, a zero-size chunk, then
//! (for the `-TRAILER` variants) trailer lines `name:value\r\n`, then `\r\n`. Signed chunks chain:
//! each signature covers the previous one, so a chunk cannot be dropped, reordered or altered.
//!
//! A chunk is buffered whole and verified before a single byte of it is passed on, so unverified data
//! never reaches the backend; [`MAX_CHUNK_SIZE`] bounds that buffer. The buffer keeps the body's
//! frames as they came ([`Pending`]), so a chunk's data is passed on as slices of them, not copied;
//! only short frames are copied together.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use futures_util::Stream;
use http_body::Body;
use http_body_util::BodyExt;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::{chunk_string_to_sign, signature, trailer_string_to_sign};
use crate::body::BodyError;
use crate::s3::checksum::{Algorithm, Hasher};

/// Largest chunk accepted. AWS SDKs send 64 KiB chunks; S3 itself documents no upper bound, but a
/// chunk is held in memory until its signature is checked, so an unbounded one would let a client
/// make the gateway buffer gigabytes. 16 MiB is 256x what SDKs send.
pub(crate) const MAX_CHUNK_SIZE: usize = 16 * 1024 * 1024;
/// Longest chunk-header or trailer line (`hex;chunk-signature=<64 hex>` is under 100 bytes).
const MAX_LINE: usize = 4096;
/// Largest trailer section (S3 trailers carry one checksum header, tens of bytes).
const MAX_TRAILER: usize = 16 * 1024;

/// What a chunk signature chain needs: the seed signature and how to sign the next link.
#[derive(Clone)]
pub struct ChunkSigner {
    pub key: [u8; 32],
    pub amz_date: String,
    pub scope: String,
    pub seed_signature: String,
}

impl std::fmt::Debug for ChunkSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChunkSigner").field("scope", &self.scope).finish_non_exhaustive()
    }
}

/// Which `aws-chunked` variant the request declared.
#[derive(Debug, Clone)]
pub struct ChunkedMode {
    /// `Some` for `STREAMING-AWS4-HMAC-SHA256-PAYLOAD[-TRAILER]`.
    pub signer: Option<ChunkSigner>,
    /// The body ends with trailer lines (`*-TRAILER` variants).
    pub trailer: bool,
    /// `x-amz-decoded-content-length`: the decoded length must equal it exactly.
    pub decoded_length: u64,
}

/// Frames shorter than this are copied together instead of kept. A kept frame keeps its whole read
/// buffer alive (up to `crate::edge::IO_BUFFER_BYTES` plus what the buffer held before), so
/// keeping only frames of at least half of one bounds what pending bytes hold to about twice their
/// size, as a growing copy would; and a client that sends a byte per packet costs copies, not a
/// 32-byte handle per byte.
pub(crate) const KEEP_FRAMES_FROM: usize = 32 * 1024;

/// Body bytes received and not decoded yet: the frames they arrived in, then short frames copied
/// together in `tail`.
#[derive(Default)]
struct Pending {
    frames: VecDeque<Bytes>,
    tail: BytesMut,
    len: usize,
}

impl Pending {
    fn push(&mut self, frame: Bytes) {
        self.len += frame.len();
        if frame.len() >= KEEP_FRAMES_FROM {
            self.seal();
            self.frames.push_back(frame);
        } else {
            self.tail.extend_from_slice(&frame);
            if self.tail.len() >= KEEP_FRAMES_FROM {
                self.seal();
            }
        }
    }

    /// Moves the copied bytes behind the kept frames.
    fn seal(&mut self) {
        if !self.tail.is_empty() {
            self.frames.push_back(self.tail.split().freeze());
        }
    }

    /// Where the first CRLF starts, looking at the first `limit` bytes only.
    fn crlf(&self, limit: usize) -> Option<usize> {
        let mut prev = 0u8;
        let bytes = self.frames.iter().map(|f| &f[..]).chain([&self.tail[..]]).flat_map(|f| f.iter().copied());
        for (i, b) in bytes.take(limit).enumerate() {
            if prev == b'\r' && b == b'\n' {
                return Some(i - 1);
            }
            prev = b;
        }
        None
    }

    /// Moves the first `n` bytes (at most `len`) to `out`, as slices of the frames.
    fn take(&mut self, mut n: usize, out: &mut VecDeque<Bytes>) {
        debug_assert!(n <= self.len);
        self.seal();
        self.len -= n.min(self.len);
        while n > 0 {
            let Some(front) = self.frames.front_mut() else { break };
            if front.len() <= n {
                n -= front.len();
                out.extend(self.frames.pop_front());
            } else {
                out.push_back(front.split_to(n));
                n = 0;
            }
        }
    }

    /// The first `n` bytes (at most `len`), copied: for lines and separators, which are short.
    fn take_copied(&mut self, n: usize) -> Vec<u8> {
        let mut pieces = VecDeque::new();
        self.take(n, &mut pieces);
        pieces.iter().flat_map(|p| p.iter().copied()).collect()
    }
}

struct Decoder<B> {
    body: B,
    /// The trailing checksum the gateway must check itself (the store will not see the trailer).
    checksum: Option<(Algorithm, Hasher)>,
    pending: Pending,
    /// A verified chunk's data, passed on a piece at a time.
    ready: VecDeque<Bytes>,
    eof: bool,
    mode: ChunkedMode,
    prev_signature: String,
    decoded: u64,
    done: bool,
}

/// Decodes (and for signed variants verifies) an `aws-chunked` body into the payload bytes. With
/// `checksum`, the trailer must carry that checksum and it must match the decoded bytes (for
/// stores that never see the trailer).
pub fn decode<B>(
    body: B,
    mode: ChunkedMode,
    checksum: Option<Algorithm>,
) -> impl Stream<Item = Result<Bytes, BodyError>> + Send + 'static
where
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let prev_signature = mode.signer.as_ref().map(|s| s.seed_signature.clone()).unwrap_or_default();
    let checksum = checksum.map(|a| (a, a.hasher()));
    let dec = Decoder {
        body,
        checksum,
        pending: Pending::default(),
        ready: VecDeque::new(),
        eof: false,
        mode,
        prev_signature,
        decoded: 0,
        done: false,
    };
    futures_util::stream::unfold(dec, |mut dec| async move {
        if let Some(piece) = dec.ready.pop_front() {
            return Some((Ok(piece), dec));
        }
        if dec.done {
            return None;
        }
        match dec.next_chunk().await {
            Ok(true) => dec.ready.pop_front().map(|piece| (Ok(piece), dec)),
            Ok(false) => None,
            Err(e) => {
                dec.done = true;
                Some((Err(e), dec))
            }
        }
    })
}

impl<B> Decoder<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    /// Reads one more frame of the body into `pending`; `false` at end of body.
    async fn fill(&mut self) -> Result<bool, BodyError> {
        while !self.eof {
            match self.body.frame().await {
                None => self.eof = true,
                Some(Err(e)) => return Err(BodyError::read(e.into())),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data()
                        && !data.is_empty()
                    {
                        self.pending.push(data);
                        return Ok(true);
                    }
                }
            }
        }
        Ok(false)
    }

    /// The next line, without its CRLF; longer than `max` is refused.
    async fn line(&mut self, max: usize) -> Result<Vec<u8>, BodyError> {
        loop {
            if let Some(pos) = self.pending.crlf(max + 2) {
                let line = self.pending.take_copied(pos);
                self.pending.take_copied(2);
                return Ok(line);
            }
            if self.pending.len > max {
                return Err(BodyError::Malformed("aws-chunked line too long"));
            }
            if !self.fill().await? {
                return Err(BodyError::Incomplete);
            }
        }
    }

    /// Waits until `n` bytes are pending.
    async fn want(&mut self, n: usize) -> Result<(), BodyError> {
        while self.pending.len < n {
            if !self.fill().await? {
                return Err(BodyError::Incomplete);
            }
        }
        Ok(())
    }

    /// The next `n` bytes, copied (short separators).
    async fn exact(&mut self, n: usize) -> Result<Vec<u8>, BodyError> {
        self.want(n).await?;
        Ok(self.pending.take_copied(n))
    }

    /// Decodes and verifies the next chunk into `ready`; `false` after the last one (the body
    /// and its trailer checked).
    async fn next_chunk(&mut self) -> Result<bool, BodyError> {
        let header = self.line(MAX_LINE).await?;
        let header = std::str::from_utf8(&header).map_err(|_| BodyError::Malformed("chunk header is not UTF-8"))?;
        let (size_hex, ext) = header.split_once(';').unwrap_or((header, ""));
        let size = usize::from_str_radix(size_hex.trim(), 16).map_err(|_| BodyError::Malformed("bad chunk size"))?;
        if size > MAX_CHUNK_SIZE {
            return Err(BodyError::ChunkTooLarge);
        }
        self.want(size).await?;
        let mut data = VecDeque::new();
        self.pending.take(size, &mut data);
        if size > 0 && self.exact(2).await? != b"\r\n" {
            return Err(BodyError::Malformed("chunk data not followed by CRLF"));
        }
        if let Some(signer) = &self.mode.signer {
            let sent =
                ext.trim().strip_prefix("chunk-signature=").ok_or(BodyError::Malformed("missing chunk-signature"))?;
            let mut digest = Sha256::new();
            data.iter().for_each(|piece| digest.update(piece));
            let chunk_sha256 = super::hex32(&digest.finalize().into());
            let sts = chunk_string_to_sign(&signer.amz_date, &signer.scope, &self.prev_signature, &chunk_sha256);
            let expected = signature(&signer.key, &sts);
            if !bool::from(expected.as_bytes().ct_eq(sent.as_bytes())) {
                return Err(BodyError::ChunkSignature);
            }
            self.prev_signature = expected;
        }
        if size == 0 {
            self.finish().await?;
            return Ok(false);
        }
        self.decoded += size as u64;
        if self.decoded > self.mode.decoded_length {
            return Err(BodyError::LengthMismatch);
        }
        if let Some((_, h)) = &mut self.checksum {
            data.iter().for_each(|piece| h.update(piece));
        }
        self.ready = data;
        Ok(true)
    }

    /// Reads the trailer section (if any) and the final CRLF, and checks the totals.
    async fn finish(&mut self) -> Result<(), BodyError> {
        if self.mode.trailer {
            let mut canonical = String::new();
            let mut sent_signature = None;
            let mut sent_checksum = None;
            loop {
                let line = self.line(MAX_LINE).await?;
                if line.is_empty() {
                    break;
                }
                let line = std::str::from_utf8(&line).map_err(|_| BodyError::Malformed("trailer is not UTF-8"))?;
                let (name, value) = line.split_once(':').ok_or(BodyError::Malformed("trailer line without ':'"))?;
                if name.trim().eq_ignore_ascii_case("x-amz-trailer-signature") {
                    sent_signature = Some(value.trim().to_owned());
                } else {
                    if self.checksum.as_ref().is_some_and(|(a, _)| name.trim().eq_ignore_ascii_case(a.header_name())) {
                        sent_checksum = Some(value.trim().to_owned());
                    }
                    canonical.push_str(&name.trim().to_ascii_lowercase());
                    canonical.push(':');
                    canonical.push_str(value.trim());
                    canonical.push('\n');
                }
                if canonical.len() > MAX_TRAILER {
                    return Err(BodyError::Malformed("trailer section too large"));
                }
            }
            if let Some(signer) = &self.mode.signer {
                let sent = sent_signature.ok_or(BodyError::Malformed("missing x-amz-trailer-signature"))?;
                let digest = super::hex32(&Sha256::digest(canonical.as_bytes()).into());
                let sts = trailer_string_to_sign(&signer.amz_date, &signer.scope, &self.prev_signature, &digest);
                let expected = signature(&signer.key, &sts);
                if !bool::from(expected.as_bytes().ct_eq(sent.as_bytes())) {
                    return Err(BodyError::ChunkSignature);
                }
            }
            if let Some((alg, hasher)) = self.checksum.take() {
                let sent =
                    sent_checksum.ok_or(BodyError::Malformed("the trailer lacks the checksum x-amz-trailer names"))?;
                if hasher.finalize_base64() != sent {
                    return Err(BodyError::ChecksumMismatch(alg.header_name()));
                }
            }
        } else {
            // Signed variant without trailer: the zero chunk is followed by one empty line. Some
            // encoders omit it; accept either. Its CRLF may come in frames of its own: read to the
            // end, or until more than a CRLF is pending.
            while self.pending.len < 3 && self.fill().await? {}
            let rest = if self.pending.len > 2 { None } else { Some(self.pending.take_copied(self.pending.len)) };
            if !rest.is_some_and(|r| r.is_empty() || r == b"\r\n") {
                return Err(BodyError::Malformed("data after the final chunk"));
            }
        }
        if self.decoded != self.mode.decoded_length {
            return Err(BodyError::LengthMismatch);
        }
        self.done = true;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The signed-chunk vector is the 66560-byte example from the S3 streaming documentation.
    use futures_util::StreamExt;
    use http_body_util::Full;

    use super::super::{scope, signing_key, tests::SECRET};
    use super::*;

    fn doc_signer() -> ChunkSigner {
        ChunkSigner {
            key: signing_key(SECRET.as_bytes(), "20130524", "us-east-1", "s3"),
            amz_date: "20130524T000000Z".into(),
            scope: scope("20130524", "us-east-1", "s3"),
            seed_signature: "4f232c4386841ef735655705268965c44a0e4690baa4adea153f7db9fa80a0a9".into(),
        }
    }

    fn doc_body(tamper: bool) -> Bytes {
        let mut b = Vec::new();
        b.extend_from_slice(
            b"10000;chunk-signature=ad80c730a21e5b8d04586a2213dd63b9a0e99e0e2307b0ade35a65485a288648\r\n",
        );
        let mut first = vec![b'a'; 65536];
        if tamper {
            first[100] = b'b';
        }
        b.extend_from_slice(&first);
        b.extend_from_slice(
            b"\r\n400;chunk-signature=0055627c9e194cb4542bae2aa5492e3c1575bbb81b612b7d234b86a503ef5497\r\n",
        );
        b.extend_from_slice(&[b'a'; 1024]);
        b.extend_from_slice(
            b"\r\n0;chunk-signature=b6c6ea8a5354eaf15b3cb7646744f4275b71ea724fed81ceb9323e279d449df9\r\n\r\n",
        );
        Bytes::from(b)
    }

    async fn run(body: Bytes, mode: ChunkedMode) -> Result<Vec<u8>, BodyError> {
        run_checked(body, mode, None).await
    }

    async fn run_checked(body: Bytes, mode: ChunkedMode, sum: Option<Algorithm>) -> Result<Vec<u8>, BodyError> {
        let mut s = std::pin::pin!(decode(Full::new(body), mode, sum));
        let mut out = Vec::new();
        while let Some(item) = s.next().await {
            out.extend_from_slice(&item?);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn signed_chunks_from_the_documentation_verify() {
        let mode = ChunkedMode { signer: Some(doc_signer()), trailer: false, decoded_length: 66560 };
        let out = run(doc_body(false), mode).await.expect("valid");
        assert_eq!(out, vec![b'a'; 66560]);
    }

    /// The body as a stream of `size`-byte frames, as a client's packets may split it.
    fn framed(body: &Bytes, size: usize) -> impl Body<Data = Bytes, Error = std::convert::Infallible> + Unpin + use<> {
        let frames: Vec<_> = (0..body.len())
            .step_by(size)
            .map(|at| Ok(http_body::Frame::data(body.slice(at..(at + size).min(body.len())))))
            .collect();
        http_body_util::StreamBody::new(futures_util::stream::iter(frames))
    }

    #[test]
    fn short_frames_are_copied_together_and_long_ones_kept() {
        let mut p = Pending::default();
        for _ in 0..100_000 {
            p.push(Bytes::from_static(b"a"));
        }
        assert!(p.frames.len() <= 100_000 / KEEP_FRAMES_FROM + 1, "{} frames", p.frames.len());
        let long = Bytes::from(vec![b'b'; KEEP_FRAMES_FROM]);
        p.push(long.clone());
        let mut out = VecDeque::new();
        p.take(100_000 + KEEP_FRAMES_FROM, &mut out);
        assert_eq!(out.back().map(|b| b.as_ptr()), Some(long.as_ptr()), "a long frame is passed on as it came");
        assert_eq!(out.iter().map(Bytes::len).sum::<usize>(), 100_000 + KEEP_FRAMES_FROM);
        assert_eq!(p.len, 0);
    }

    #[tokio::test]
    async fn frames_split_anywhere_decode_alike_and_long_ones_are_passed_on_uncopied() {
        for size in [1, 2, 3, 5, 89, 4096, KEEP_FRAMES_FROM, 65536, 65537, 1 << 20] {
            for tamper in [false, true] {
                let body = doc_body(tamper);
                let mode = ChunkedMode { signer: Some(doc_signer()), trailer: false, decoded_length: 66560 };
                let mut s = std::pin::pin!(decode(framed(&body, size), mode, None));
                let (mut out, mut result, mut copied) = (Vec::new(), Ok(()), 0);
                while let Some(item) = s.next().await {
                    match item {
                        Ok(piece) => {
                            let at = (piece.as_ptr() as usize).wrapping_sub(body.as_ptr() as usize);
                            if at + piece.len() > body.len() {
                                copied += piece.len();
                            }
                            out.extend_from_slice(&piece);
                        }
                        Err(e) => result = Err(e),
                    }
                }
                if tamper {
                    assert!(matches!(result, Err(BodyError::ChunkSignature)), "frame size {size}");
                    assert!(out.is_empty(), "frame size {size}: unverified bytes passed on");
                } else {
                    assert!(result.is_ok(), "frame size {size}: {result:?}");
                    assert_eq!(out, vec![b'a'; 66560], "frame size {size}");
                    // Long frames are passed on as slices; only a short last frame is copied.
                    if size >= KEEP_FRAMES_FROM {
                        assert!(copied < KEEP_FRAMES_FROM, "frame size {size}: {copied} bytes copied");
                    }
                }
            }
        }
    }

    #[tokio::test]
    async fn a_tampered_chunk_is_refused() {
        let mode = ChunkedMode { signer: Some(doc_signer()), trailer: false, decoded_length: 66560 };
        assert!(matches!(run(doc_body(true), mode).await, Err(BodyError::ChunkSignature)));
    }

    #[tokio::test]
    async fn wrong_decoded_length_is_refused() {
        let mode = ChunkedMode { signer: Some(doc_signer()), trailer: false, decoded_length: 66561 };
        assert!(matches!(run(doc_body(false), mode).await, Err(BodyError::LengthMismatch)));
    }

    #[tokio::test]
    async fn unsigned_with_trailer() {
        let body = Bytes::from_static(b"5\r\nhello\r\n6\r\n world\r\n0\r\nx-amz-checksum-crc32:DUoRhQ==\r\n\r\n");
        let mode = ChunkedMode { signer: None, trailer: true, decoded_length: 11 };
        assert_eq!(run(body, mode).await.expect("valid"), b"hello world");
    }

    #[tokio::test]
    async fn trailing_checksums_are_checked_when_asked() {
        let body =
            |sum: &str| Bytes::from(format!("5\r\nhello\r\n8\r\n trailer\r\n0\r\nx-amz-checksum-crc32:{sum}\r\n\r\n"));
        let mode = ChunkedMode { signer: None, trailer: true, decoded_length: 13 };
        let crc = Some(Algorithm::Crc32);
        assert_eq!(run_checked(body("WzGbuw=="), mode.clone(), crc).await.expect("valid"), b"hello trailer");
        let r = run_checked(body("WzGbuA=="), mode.clone(), crc).await;
        assert!(matches!(r, Err(BodyError::ChecksumMismatch("x-amz-checksum-crc32"))));
        // A trailer without the announced checksum is refused too.
        let r = run_checked(body("WzGbuw=="), mode, Some(Algorithm::Sha256)).await;
        assert!(matches!(r, Err(BodyError::Malformed(_))));
    }

    #[tokio::test]
    async fn what_follows_the_final_chunk_is_a_crlf_or_nothing() {
        // Found by the fuzz smoke (fuzz/regressions/aws_chunked/): a lone byte after the final
        // chunk once panicked the decoder.
        let mode = ChunkedMode { signer: None, trailer: false, decoded_length: 5 };
        for (tail, ok) in [(&b""[..], true), (b"\r\n", true), (b"\r", false), (b"\n", false), (b"\r\nx", false)] {
            let body = Bytes::from([&b"5\r\nhello\r\n0\r\n"[..], tail].concat());
            for size in [1, 2, 64] {
                let r = run_frames(&body, size, mode.clone()).await;
                assert_eq!(r.is_ok(), ok, "tail {tail:?}, frames of {size}: {r:?}");
            }
        }
    }

    async fn run_frames(body: &Bytes, size: usize, mode: ChunkedMode) -> Result<Vec<u8>, BodyError> {
        let mut s = std::pin::pin!(decode(framed(body, size), mode, None));
        let mut out = Vec::new();
        while let Some(item) = s.next().await {
            out.extend_from_slice(&item?);
        }
        Ok(out)
    }

    #[tokio::test]
    async fn truncated_and_oversized_bodies_are_refused() {
        let mode = ChunkedMode { signer: None, trailer: true, decoded_length: 11 };
        let r = run(Bytes::from_static(b"5\r\nhel"), mode.clone()).await;
        assert!(matches!(r, Err(BodyError::Incomplete)));
        let r = run(Bytes::from_static(b"ffffffff\r\n"), mode).await;
        assert!(matches!(r, Err(BodyError::ChunkTooLarge)));
    }
}
