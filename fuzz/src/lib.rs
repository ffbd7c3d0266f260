//! The fuzz targets, one function each, every one a parser that sees client or store bytes. The
//! binaries in `src/bin/` hand each to AFL++; `tests/corpus.rs` replays the committed corpora and
//! the crashes found so far through them without AFL.
//!
//! A target may only fail by panicking (what AFL counts as a crash): every `Err` the parser
//! returns is a correct answer to bad input. Where a parser's output can be checked cheaply
//! (round trips, lengths), the target asserts it.

use std::collections::HashMap;
use std::convert::Infallible;

use bytes::Bytes;
use futures_util::{FutureExt, StreamExt};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use http_body::Frame;
use tensorgate::pushdown::manifest::Layout;
use tensorgate::pushdown::manifest::{Channels, Preprocess};
use tensorgate::pushdown::preprocess;
use tensorgate::pushdown::spec::{Dtype, RowGroups};
use tensorgate::pushdown::{prefix, shard, spec, table, tensor, text};
use tensorgate::s3::checksum::Algorithm;
use tensorgate::s3::credentials::{CredentialStore, SecretKey};
use tensorgate::s3::sigv4::chunked::{self, ChunkSigner, ChunkedMode};
use tensorgate::s3::{form, post_policy, route, sigv4};
use time::OffsetDateTime;

/// The targets by name, for the binaries and the corpus replay.
pub const TARGETS: &[(&str, fn(&[u8]))] = &[
    ("sigv4", sigv4_request),
    ("aws_chunked", aws_chunked),
    ("route", route_request),
    ("spec", pushdown_spec),
    ("shard", webdataset_shard),
    ("parquet", parquet_table),
    ("npy", npy_round_trip),
    ("image", image_preprocess),
    ("disk_entry", disk_entry),
    ("prefix", onnx_prefix),
    ("post_form", post_form),
    ("fs_listing", fs_listing),
    ("text", text_rows),
    ("alias_listing", alias_listing),
];

/// The access key and secret the request targets authenticate against (the seeds are signed with
/// them): AWS's documentation example pair.
pub const ACCESS_KEY: &str = "AKIDEXAMPLE";
pub const SECRET_KEY: &str = "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY";
/// The clock the request targets run at: 2026-01-01T00:00:00Z (the seeds are dated then).
pub const NOW_UNIX: i64 = 1_767_225_600;

fn creds() -> CredentialStore {
    let mut c = CredentialStore::default();
    c.insert(ACCESS_KEY.to_owned(), SecretKey::new(SECRET_KEY.to_owned()));
    c
}

fn now() -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp(NOW_UNIX).expect("valid time")
}

/// `METHOD URI\nname: value\n...`: the request line and headers (lines that are not valid header
/// names or values are skipped; a blank line ends the headers).
struct Request {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
}

fn request(data: &[u8]) -> Option<Request> {
    let head = data.windows(2).position(|w| w == b"\n\n").map_or(data, |i| &data[..i]);
    let mut lines = head.split(|&b| b == b'\n');
    let first = std::str::from_utf8(lines.next()?).ok()?;
    let (method, uri) = first.split_once(' ')?;
    let method = Method::from_bytes(method.as_bytes()).ok()?;
    let uri: Uri = uri.parse().ok()?;
    let mut headers = HeaderMap::new();
    for line in lines {
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(&line[..colon]), HeaderValue::from_bytes(line[colon + 1..].trim_ascii()))
        else {
            continue;
        };
        headers.append(name, value);
    }
    Some(Request { method, uri, headers })
}

/// SigV4 and SigV2 verification of a request: headers, presigned queries, dates, scopes.
pub fn sigv4_request(data: &[u8]) {
    let Some(r) = request(data) else { return };
    let host = r.headers.get(http::header::HOST).and_then(|h| h.to_str().ok()).map(str::to_owned);
    let vhost = host.as_deref().and_then(|h| h.split('.').next());
    let creds = creds();
    for anonymous in [false, true] {
        let _ = sigv4::verify::verify(&r.method, &r.uri, vhost, &r.headers, &creds, anonymous, now());
    }
}

/// `aws-chunked` decoding: first byte picks the variant (signed or not, trailer or not, which
/// trailing checksum the gateway checks), the next two the frame size the body arrives in, the
/// next four `x-amz-decoded-content-length`; the rest is the body.
pub fn aws_chunked(data: &[u8]) {
    let [flags, f0, f1, l0, l1, l2, l3, body @ ..] = data else { return };
    let signer = (flags & 1 != 0).then(|| ChunkSigner {
        key: sigv4::signing_key(SECRET_KEY.as_bytes(), "20260101", "us-east-1", "s3"),
        amz_date: "20260101T000000Z".to_owned(),
        scope: sigv4::scope("20260101", "us-east-1", "s3"),
        seed_signature: "0".repeat(64),
    });
    let mode = ChunkedMode {
        signer,
        trailer: flags & 2 != 0,
        decoded_length: u64::from(u32::from_le_bytes([*l0, *l1, *l2, *l3])),
    };
    const ALGORITHMS: [&str; 5] = [
        "x-amz-checksum-crc32",
        "x-amz-checksum-crc32c",
        "x-amz-checksum-crc64nvme",
        "x-amz-checksum-sha1",
        "x-amz-checksum-sha256",
    ];
    let checksum = ALGORITHMS.get(usize::from(flags >> 2) % 8).and_then(|n| Algorithm::from_header(n));
    let frame = usize::from(u16::from_le_bytes([*f0, *f1])).max(1);
    let frames: Vec<Result<Frame<Bytes>, Infallible>> =
        body.chunks(frame).map(|c| Ok(Frame::data(Bytes::copy_from_slice(c)))).collect();
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
    let mut decoded = std::pin::pin!(chunked::decode(body, mode.clone(), checksum));
    let mut total = 0u64;
    let mut failed = false;
    // Every frame is ready, so the stream never waits.
    while let Some(item) = decoded.next().now_or_never().expect("an in-memory body never pends") {
        match item {
            Ok(b) => total += b.len() as u64,
            Err(_) => {
                failed = true;
                break;
            }
        }
    }
    // Whatever was accepted whole has exactly the declared length.
    assert!(failed || total == mode.decoded_length, "decoded {total} bytes of {}", mode.decoded_length);
}

/// Addressing and operation classification: `host\npath\nquery\nmethod\ncopy-source`.
pub fn route_request(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let mut parts = text.split('\n');
    let (host, path) = (parts.next(), parts.next().unwrap_or("/"));
    let query = parts.next().filter(|q| !q.is_empty());
    let method = Method::from_bytes(parts.next().unwrap_or("GET").as_bytes()).unwrap_or(Method::GET);
    let domains = ["s3.example.com".to_owned(), "localhost".to_owned()];
    if let Ok(target) = route::resolve(host.filter(|h| !h.is_empty()), path, &domains) {
        let mut headers = HeaderMap::new();
        if let Some(src) = parts.next().and_then(|s| HeaderValue::from_str(s).ok()) {
            let _ = route::copy_source(src.to_str().unwrap_or_default());
            headers.insert("x-amz-copy-source", src);
        }
        let _ = route::classify(&method, &target, query, &headers);
        let _ = target.resource();
    }
}

/// The pushdown trigger: headers and query of a GET.
pub fn pushdown_spec(data: &[u8]) {
    let Some(r) = request(data) else { return };
    let _ = spec::parse(&r.headers, r.uri.query());
}

/// WebDataset tar shards; what reads is written back as a `format=tar` output (each input
/// replaced by a `.npy`), which reads again to the same keys and other members.
pub fn webdataset_shard(data: &[u8]) {
    let archive = Bytes::copy_from_slice(data);
    if let Ok(samples) = shard::read(&archive) {
        assert!(!samples.is_empty() && samples.len() <= shard::MAX_SAMPLES);
        let rows = samples.iter().map(|s| (s.key.as_str(), b"features".to_vec(), s.others.as_slice()));
        let Ok(written) = shard::write(rows, 0) else { return };
        let again = shard::read(&Bytes::from(written)).expect("a written shard reads back");
        assert_eq!(again.len(), samples.len());
        for (a, b) in again.iter().zip(&samples) {
            assert_eq!((&a.key, &a.others, a.label), (&b.key, &b.others, b.label));
        }
    }
}

/// Parquet files: the footer, then the rows (every column kept, as for a Parquet output), as
/// many as the footer states; a file that decodes is written back with a feature per row, the
/// output reads back with as many rows, and its outline from the footer alone is its layout.
pub fn parquet_table(data: &[u8]) {
    let object = Bytes::copy_from_slice(data);
    if !table::is_parquet(&object) {
        return;
    }
    let text = data.len() % 2 == 1;
    let whole = table::Source::whole(object.clone());
    let want = table::Reading { max_decoded: 1 << 24, keep: true, text, ..table::Reading::default() };
    let Ok(footer) = table::Footer::read(&whole, want) else { return };
    let claimed = footer.row_count();
    assert!(claimed <= shard::MAX_SAMPLES);
    if let Ok((rows, kept)) = footer.rows(&whole) {
        assert_eq!(rows.len(), claimed);
        let kept = kept.expect("kept columns");
        let out = table::write(&kept, &vec![0.5; claimed * 2], &[claimed, 2], Dtype::F16, ("m", "s"))
            .expect("decoded rows write back");
        // The outline, from the footer alone, is the written output's layout.
        if let Ok(outline) = table::outline(&footer, &[2], Dtype::F16, ("m", "s")) {
            assert_eq!(outline.len, out.len() as u64);
            assert_eq!(&out[out.len() - outline.tail.len()..], &outline.tail[..]);
        }
        let out = table::Source::whole(Bytes::from(out));
        let want =
            table::Reading { column: Some(table::FEATURES_COLUMN), max_decoded: 1 << 26, ..table::Reading::default() };
        let back = table::Footer::read(&out, want);
        // The features column is not an image column: the output's footer reads, the column is refused.
        assert!(back.is_err_and(|e| e.to_string().contains("not encoded images")));
    }
    // As a ranged read sees the file: its tail, then only the span the footer gives for row group 0.
    let len = object.len() as u64;
    let tail_at = len.saturating_sub(table::TAIL_BYTES);
    let tail = table::Source::piece(len, tail_at, object.slice(usize::try_from(tail_at).unwrap_or(0)..));
    let first = RowGroups { first: 0, last: 0 };
    let want = table::Reading { max_decoded: 1 << 24, text, row_groups: Some(first), ..table::Reading::default() };
    let Ok(footer) = table::Footer::read(&tail, want) else { return };
    let Ok((start, end)) = footer.span() else { return };
    assert!(start < end && end <= len);
    let span = object.slice(usize::try_from(start).unwrap_or(0)..usize::try_from(end).unwrap_or(0));
    let span = table::Source::piece(len, start, span);
    let claimed = footer.row_count();
    if let Ok((rows, _)) = footer.rows(&span) {
        assert_eq!(rows.len(), claimed);
    }
}

/// A text model's inputs: JSON Lines (or a plain text) through a BERT-style tokenizer, every row
/// encoded to exactly `2 x L` values, ids within the vocabulary and a 0/1 mask.
pub fn text_rows(data: &[u8]) {
    static ENCODER: std::sync::OnceLock<text::Encoder> = std::sync::OnceLock::new();
    const LEN: usize = 16;
    let encoder =
        ENCODER.get_or_init(|| text::Encoder::from_json(&text::tiny_wordpiece_json(), LEN).expect("tokenizer"));
    let texts = if text::is_jsonl(data) {
        text::jsonl_rows(data, None).map(|rows| rows.into_iter().map(|r| r.text).collect()).unwrap_or_default()
    } else {
        text::plain(data).map(|t| vec![t]).unwrap_or_default()
    };
    for t in texts {
        if let Ok(row) = encoder.encode(&t) {
            assert_eq!(row.len(), 2 * LEN);
            assert!(row[..LEN].iter().all(|&id| (0.0..100.0).contains(&id)));
            assert!(row[LEN..].iter().all(|&m| m == 0.0 || m == 1.0));
        }
    }
}

/// A store's listing as an alias bucket answers it: the keys read, every entry's size and ETag
/// replaced, and the result reads back with the same keys.
pub fn alias_listing(data: &[u8]) {
    use tensorgate::s3::listing;
    let Ok(keys) = listing::keys(data) else { return };
    let outputs =
        keys.iter().map(|(listed, _)| (listed.clone(), listing::Output { size: 42, etag: "\"e\"".into() })).collect();
    if let Ok(out) = listing::rewrite(data, &outputs) {
        assert_eq!(listing::keys(&out).expect("a rewritten listing reads"), keys);
    }
}

/// `.npy` in; `.npy` and safetensors out, read back.
pub fn npy_round_trip(data: &[u8]) {
    let Ok(t) = tensor::read_npy(data) else { return };
    assert_eq!(t.shape.iter().product::<usize>(), t.data.len());
    let back = tensor::read_npy(&tensor::write_npy(&t, Dtype::F32)).expect("our own .npy reads back");
    assert_eq!(back.shape, t.shape);
    assert!(back.data.iter().zip(&t.data).all(|(a, b)| a.to_bits() == b.to_bits()), "f32 .npy round trip");
    let _ = tensor::read_npy(&tensor::write_npy(&t, Dtype::F16)).expect("f16 .npy reads back");
    let labels: Vec<i64> = (0..t.shape.first().copied().unwrap_or(0).min(64) as i64).collect();
    // Metadata values as they come from object keys: any string.
    let key = String::from_utf8_lossy(&data[data.len().saturating_sub(16)..]).into_owned();
    let metadata = HashMap::from([("keys".to_owned(), serde_json::to_string(&[key]).expect("json"))]);
    for dtype in [Dtype::F32, Dtype::F16, Dtype::Bf16] {
        let Ok(st) = tensor::write_safetensors(&[("features", &t)], Some(&labels), dtype, metadata.clone()) else {
            continue;
        };
        let parsed = safetensors::SafeTensors::deserialize(&st).expect("our own safetensors reads back");
        assert_eq!(parsed.tensor("features").expect("features").shape(), t.shape.as_slice());
    }
}

/// Image decode and preprocessing (resize, crop, normalize), under a small pixel limit so that
/// the fuzzer spends its time in the parsers rather than in large resamples.
pub fn image_preprocess(data: &[u8]) {
    // Small enough that an input the instrumented build takes over a second on is slow parsing,
    // not a legitimately large resample.
    const MAX_PIXELS: u64 = 1 << 18;
    let p = Preprocess {
        resize_shorter: Some(12),
        crop: [8, 8],
        scale: 1.0 / 255.0,
        mean: [0.5; 3],
        std: [0.25; 3],
        channels: Channels::Rgb,
    };
    // Buffers kept across inputs, as the gateway keeps them across images: whatever an earlier
    // input left in them, the result is the one fresh buffers give.
    static POOL: std::sync::LazyLock<preprocess::ScratchPool> = std::sync::LazyLock::new(Default::default);
    let scratch = preprocess::cost(data, p.resize_shorter, MAX_PIXELS).scratch_bytes;
    let mut kept = POOL.take();
    let result = preprocess::image_to_input_with(data, &p, Layout::Nchw, MAX_PIXELS, None, &mut kept);
    POOL.give(kept);
    match result {
        Ok(out) => {
            assert_eq!(out.len(), 3 * 8 * 8);
            assert!(scratch > 0, "a decodable image has a scratch reservation");
            let fresh =
                preprocess::image_to_input(data, &p, Layout::Nchw, MAX_PIXELS).expect("fresh buffers decode it");
            assert_eq!(out, fresh, "kept buffers give what fresh ones give");
            POOL.give_floats(out);
        }
        Err(_) => {}
    }
}

/// The disk cache's entry files.
pub fn disk_entry(data: &[u8]) {
    if let Ok((_, cached)) = tensorgate::cache::disk::parse_entry(data) {
        assert!(cached.body.len() <= data.len());
    }
}

/// The ONNX prefix cut: tensor names, then a cut, an extraction and an exposure at one of them
/// (the first byte picks which).
pub fn onnx_prefix(data: &[u8]) {
    let [pick, model @ ..] = data else { return };
    let _ = prefix::has_external_data(model);
    let Ok(names) = prefix::tensor_names(model) else { return };
    let Some(name) = names.get(usize::from(*pick) % names.len().max(1)) else { return };
    if let Ok(cut) = prefix::cut(model, &[name]) {
        // A cut model is itself a model the cutter reads.
        prefix::tensor_names(&cut).expect("a cut model parses");
    }
    let _ = prefix::expose(model, &[name]);
    if let Some(first) = names.first() {
        let _ = prefix::extract(model, &[first], &[name]);
    }
}

/// POST Object forms: `content-type\nbody`; the form head, then its policy checked.
pub fn post_form(data: &[u8]) {
    let Some(nl) = data.iter().position(|&b| b == b'\n') else { return };
    let Ok(content_type) = std::str::from_utf8(&data[..nl]) else { return };
    let Some(boundary) = form::boundary(content_type) else { return };
    let body = &data[nl + 1..];
    let Ok(Some(head)) = form::parse_head(body, &boundary, 64 * 1024) else { return };
    assert!(head.file_start <= body.len());
    let Ok(f) = post_policy::PostForm::new(head.fields) else { return };
    let _ = post_policy::object_headers(&f);
    if let Ok(ok) = post_policy::authorize(&f, "bucket", head.filename.as_deref(), &creds(), true, now()) {
        let _ = post_policy::check_length(ok.content_length_range, 10);
    }
}

/// The `fs` backend's listing mending: a client's query (first line), then a listing as `s3s-fs`
/// writes it, whose keys the client chose (the rest): parsed, then every entry completed, names
/// encoded and common prefixes finished, without panicking.
pub fn fs_listing(data: &[u8]) {
    use tensorgate::backend::fs::listing;
    let Ok(text) = std::str::from_utf8(data) else { return };
    let (query, xml) = text.split_once('\n').unwrap_or((text, ""));
    let Ok((_, asked)) = listing::Asked::parse(query) else { return };
    let Ok(missing) = listing::keys_without_etag(xml.as_bytes()) else { return };
    let etags: HashMap<String, String> = missing.into_iter().map(|k| (k, "\"0\"".to_owned())).collect();
    let _ = listing::complete(xml.as_bytes(), &etags, &asked);
}
