//! Object listings (`ListObjects`, `ListObjectsV2`) as an alias bucket answers them: the store's
//! listing with each entry's `Size` and `ETag` replaced by its pushdown output's, so that readers
//! which size a file from a listing (`pyarrow.dataset`, `s3fs` after a glob, Polars) read the
//! output's bytes. Pure: XML in, XML out.
//!
//! Format: <https://docs.aws.amazon.com/AmazonS3/latest/API/API_ListObjectsV2.html>

use std::collections::HashMap;

use quick_xml::events::{BytesText, Event};
use quick_xml::{Reader, Writer};

/// A listing the gateway cannot read: the store answered something that is not S3's XML.
#[derive(Debug, thiserror::Error)]
#[error("the store's listing is not readable XML: {0}")]
pub struct ListingError(String);

/// What replaces an entry's `Size` and `ETag`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    pub size: u64,
    pub etag: String,
}

/// The keys of a listing's `Contents` entries, as listed (percent-encoded when the listing says
/// `<EncodingType>url</EncodingType>`) and decoded.
///
/// # Errors
/// A body that is not well-formed XML.
pub fn keys(xml: &[u8]) -> Result<Vec<(String, String)>, ListingError> {
    let mut reader = Reader::from_reader(xml);
    let (mut path, mut raw, mut url) = (Vec::<Vec<u8>>::new(), Vec::new(), false);
    loop {
        match reader.read_event().map_err(|e| ListingError(e.to_string()))? {
            Event::Start(e) => path.push(e.local_name().as_ref().to_vec()),
            Event::End(_) => {
                path.pop();
            }
            Event::Text(t) => {
                let text = t.unescape().map_err(|e| ListingError(e.to_string()))?;
                match path.iter().map(Vec::as_slice).collect::<Vec<_>>()[..] {
                    [_, b"Contents", b"Key"] => raw.push(text.into_owned()),
                    [_, b"EncodingType"] => url = text.trim() == "url",
                    _ => {}
                }
            }
            Event::Eof if path.is_empty() => break,
            Event::Eof => return Err(ListingError("the document ends inside an element".into())),
            _ => {}
        }
    }
    Ok(raw
        .into_iter()
        .map(|k| {
            let decoded = if url { crate::s3::sigv4::uri_decode(&k) } else { k.clone() };
            (k, decoded)
        })
        .collect())
}

/// The listing with the `Size` and `ETag` of each entry whose (listed) key `outputs` holds
/// replaced; everything else as the store wrote it.
///
/// # Errors
/// A body that is not well-formed XML.
pub fn rewrite(xml: &[u8], outputs: &HashMap<String, Output>) -> Result<Vec<u8>, ListingError> {
    let bad = |e: &dyn std::fmt::Display| ListingError(e.to_string());
    let mut reader = Reader::from_reader(xml);
    let mut writer = Writer::new(Vec::with_capacity(xml.len()));
    // The events of the `Contents` entry being read: its key may come after its size.
    let mut entry: Option<Vec<Event<'static>>> = None;
    let mut depth = 0usize;
    loop {
        let event = reader.read_event().map_err(|e| bad(&e))?.into_owned();
        match &event {
            Event::Eof if depth == 0 && entry.is_none() => break,
            Event::Eof => return Err(ListingError("the document ends inside an element".into())),
            Event::Start(e) if depth == 1 && e.local_name().as_ref() == b"Contents" => entry = Some(Vec::new()),
            _ => {}
        }
        match &event {
            Event::Start(_) => depth += 1,
            Event::End(_) => depth = depth.saturating_sub(1),
            _ => {}
        }
        let Some(events) = entry.as_mut() else {
            writer.write_event(event).map_err(|e| bad(&e))?;
            continue;
        };
        let closes = matches!(&event, Event::End(_)) && depth == 1;
        events.push(event);
        if closes {
            let events = entry.take().unwrap_or_default();
            for event in replaced(events, outputs)? {
                writer.write_event(event).map_err(|e| bad(&e))?;
            }
        }
    }
    Ok(writer.into_inner())
}

/// One `Contents` entry's events with its `Size` and `ETag` texts replaced, when `outputs` has
/// its key.
fn replaced(
    events: Vec<Event<'static>>,
    outputs: &HashMap<String, Output>,
) -> Result<Vec<Event<'static>>, ListingError> {
    let mut child: Option<Vec<u8>> = None;
    let mut key = None;
    for event in &events {
        match event {
            Event::Start(e) => child = Some(e.local_name().as_ref().to_vec()),
            Event::Text(t) if child.as_deref() == Some(b"Key") => {
                key = Some(t.unescape().map_err(|e| ListingError(e.to_string()))?.into_owned());
            }
            Event::End(_) => child = None,
            _ => {}
        }
    }
    let Some(output) = key.and_then(|k| outputs.get(&k)) else { return Ok(events) };
    let size = output.size.to_string();
    let mut child: Option<Vec<u8>> = None;
    Ok(events
        .into_iter()
        .map(|event| match &event {
            Event::Start(e) => {
                child = Some(e.local_name().as_ref().to_vec());
                event
            }
            Event::End(_) => {
                child = None;
                event
            }
            Event::Text(_) => match child.as_deref() {
                Some(b"Size") => Event::Text(BytesText::new(&size).into_owned()),
                Some(b"ETag") => Event::Text(BytesText::new(&output.etag).into_owned()),
                _ => event,
            },
            _ => event,
        })
        .collect())
}

/// A listing query with `max-keys` at most `cap` (added when absent): every entry of an alias
/// listing may cost a pushdown, so a page is bounded; clients follow `IsTruncated` as for any
/// store's page limit.
#[must_use]
pub(crate) fn capped_page(query: Option<&str>, cap: usize) -> String {
    let mut seen = false;
    let mut pairs: Vec<String> = query
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some(("max-keys", v)) => {
                seen = true;
                let n = v.parse::<usize>().map_or(cap, |n| n.min(cap));
                format!("max-keys={n}")
            }
            _ => p.to_owned(),
        })
        .collect();
    if !seen {
        pairs.push(format!("max-keys={cap}"));
    }
    pairs.join("&")
}

#[cfg(test)]
mod tests {
    use super::*;

    const V2: &str = r#"<?xml version="1.0" encoding="UTF-8"?>
<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><Prefix></Prefix><KeyCount>2</KeyCount><MaxKeys>1000</MaxKeys><EncodingType>url</EncodingType><IsTruncated>false</IsTruncated><Contents><Key>a%20b.parquet</Key><LastModified>2026-12-04T00:00:00.000Z</LastModified><ETag>&quot;src1&quot;</ETag><Size>100</Size><StorageClass>STANDARD</StorageClass></Contents><Contents><Size>7</Size><ETag>"src2"</ETag><Key>README.md</Key></Contents><CommonPrefixes><Prefix>dir/</Prefix></CommonPrefixes></ListBucketResult>"#;

    #[test]
    fn keys_are_listed_and_decoded_when_the_listing_is_url_encoded() {
        assert_eq!(
            keys(V2.as_bytes()).expect("keys"),
            [("a%20b.parquet".to_owned(), "a b.parquet".to_owned()), ("README.md".to_owned(), "README.md".to_owned())]
        );
        let plain = V2.replace("<EncodingType>url</EncodingType>", "");
        assert_eq!(keys(plain.as_bytes()).expect("keys")[0].1, "a%20b.parquet");
    }

    #[test]
    fn sizes_and_etags_are_replaced_for_the_entries_given_whatever_their_order() {
        let outputs = HashMap::from([
            ("a%20b.parquet".to_owned(), Output { size: 12_345, etag: "\"out1\"".into() }),
            ("README.md".to_owned(), Output { size: 8, etag: "\"out2\"".into() }),
        ]);
        let out = String::from_utf8(rewrite(V2.as_bytes(), &outputs).expect("rewrite")).expect("utf-8");
        assert!(out.contains("<Key>a%20b.parquet</Key><LastModified>2026-12-04T00:00:00.000Z</LastModified><ETag>&quot;out1&quot;</ETag><Size>12345</Size>"), "{out}");
        assert!(out.contains("<Size>8</Size><ETag>&quot;out2&quot;</ETag><Key>README.md</Key>"), "{out}");
        assert!(out.contains("<CommonPrefixes><Prefix>dir/</Prefix></CommonPrefixes>"));
        // An entry not given keeps the store's size and ETag.
        let one = HashMap::from([("README.md".to_owned(), Output { size: 8, etag: "\"o\"".into() })]);
        let out = String::from_utf8(rewrite(V2.as_bytes(), &one).expect("rewrite")).expect("utf-8");
        assert!(out.contains("<ETag>&quot;src1&quot;</ETag><Size>100</Size>"), "{out}");
        assert!(rewrite(b"<a><b></a>", &one).is_err());
        // A listing cut short is refused, not answered without its last entry.
        let cut = &V2.as_bytes()[..V2.find("<CommonPrefixes>").expect("in the listing") - 20];
        assert!(keys(cut).is_err() && rewrite(cut, &one).is_err());
    }

    #[test]
    fn a_page_is_capped() {
        assert_eq!(capped_page(None, 100), "max-keys=100");
        assert_eq!(capped_page(Some("list-type=2&max-keys=1000"), 100), "list-type=2&max-keys=100");
        assert_eq!(capped_page(Some("list-type=2&max-keys=5&prefix=x"), 100), "list-type=2&max-keys=5&prefix=x");
        assert_eq!(capped_page(Some("max-keys=junk"), 100), "max-keys=100");
    }
}
