//! S3 XML bodies the gateway writes itself (only `<Error>`; everything else comes from the backend).
//!
//! Format: <https://docs.aws.amazon.com/AmazonS3/latest/API/ErrorResponses.html#RESTErrorResponses>

use serde::Serialize;

#[derive(Debug, Serialize)]
#[serde(rename = "Error", rename_all = "PascalCase")]
struct ErrorXml<'a> {
    code: &'a str,
    message: &'a str,
    resource: &'a str,
    request_id: &'a str,
}

/// Renders an S3 `<Error>` document.
#[must_use]
pub(crate) fn error_body(code: &str, message: &str, resource: &str, request_id: &str) -> String {
    let doc = ErrorXml { code, message, resource, request_id };
    let mut out = String::from(r#"<?xml version="1.0" encoding="UTF-8"?>"#);
    // Serializing a struct of strings into a String cannot fail.
    quick_xml::se::to_writer(&mut out, &doc).expect("error XML serializes");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_error_xml_with_escaping() {
        assert_eq!(
            error_body("NoSuchKey", "key <a&b> missing", "/b/k", "r1"),
            r#"<?xml version="1.0" encoding="UTF-8"?><Error><Code>NoSuchKey</Code><Message>key &lt;a&amp;b&gt; missing</Message><Resource>/b/k</Resource><RequestId>r1</RequestId></Error>"#
        );
    }
}
