//! Alias buckets' listings ([`super::AliasBucket`]): the store's listing of the real bucket, with
//! each entry's size and ETag its output's ([`crate::s3::listing`]), found with a `HEAD` pushdown
//! per entry through the cache (computed once, then served from the cache to the reads that
//! follow). Readers that size a file from a listing (`pyarrow.dataset`, `s3fs` after a glob,
//! Polars) then read the output's bytes.

use std::collections::HashMap;

use futures_util::{StreamExt, TryStreamExt};
use http::{HeaderValue, Method, Request, Response};
use http_body_util::BodyExt;

use super::{AliasBucket, Caller, Gateway};
use crate::body::Body;
use crate::error::GatewayError;
use crate::pushdown::PushdownError;
use crate::s3::listing::{self, Output};
use crate::s3::route::Target;

/// Most entries of one alias listing page: each may cost a pushdown before the page is answered
/// (a few seconds for a Parquet file of 10,000 rows), and clients page on as for any store's
/// limit (`IsTruncated`).
const ALIAS_LISTING_PAGE: usize = 100;

/// Entries of one listing whose outputs are found at once: the pushdowns share the node with all
/// other requests (the memory governor bounds what they hold, this bounds one listing's claim).
const ALIAS_LISTING_CONCURRENCY: usize = 4;

/// Largest listing body read: a page of [`ALIAS_LISTING_PAGE`] entries with keys of 1,024
/// bytes, owners and checksums is well under this.
const MAX_LISTING_BYTES: usize = 4 * 1024 * 1024;

impl Gateway {
    /// The store query of an alias listing: the caller's, with its page capped at
    /// [`ALIAS_LISTING_PAGE`] entries.
    pub(super) fn alias_listing_query(query: Option<&str>) -> String {
        listing::capped_page(crate::backend::forwarded_query(query).as_deref(), ALIAS_LISTING_PAGE)
    }

    /// The store's listing `resp` of `alias`'s real bucket, with its entries' sizes and ETags
    /// their outputs'. Entries whose output is refused (an object that is not a model input)
    /// keep the store's; a server error for any entry fails the listing (`503`), so that no
    /// reader sizes an output wrongly.
    pub(super) async fn alias_listing(
        &self,
        resp: Response<Body>,
        alias: &AliasBucket,
        caller: Caller<'_>,
    ) -> Result<Response<Body>, GatewayError> {
        if !resp.status().is_success() {
            return Ok(resp);
        }
        let (mut head, body) = resp.into_parts();
        let unreadable = |e: &dyn std::fmt::Display| PushdownError::Unavailable(format!("the store's listing: {e}"));
        let xml = http_body_util::Limited::new(body, MAX_LISTING_BYTES)
            .collect()
            .await
            .map_err(|e| unreadable(&e))?
            .to_bytes();
        let keys = listing::keys(&xml).map_err(|e| unreadable(&e))?;
        let outputs: HashMap<String, Output> = futures_util::stream::iter(keys)
            .map(|(listed, key)| async move {
                Ok::<_, GatewayError>(self.output_of(alias, key, caller).await?.map(|o| (listed, o)))
            })
            .buffer_unordered(ALIAS_LISTING_CONCURRENCY)
            .try_filter_map(|o| async move { Ok(o) })
            .try_collect()
            .await?;
        let body = listing::rewrite(&xml, &outputs).map_err(|e| unreadable(&e))?;
        head.headers.remove(http::header::TRANSFER_ENCODING);
        head.headers.insert(http::header::CONTENT_LENGTH, HeaderValue::from(body.len()));
        Ok(Response::from_parts(head, Body::from(body)))
    }

    /// The output's size and ETag for `key` of `alias`'s real bucket, as a `HEAD` of the alias
    /// answers them; `None` when the pushdown is refused or planned as none (the entry keeps the
    /// store's).
    async fn output_of(
        &self,
        alias: &AliasBucket,
        key: String,
        caller: Caller<'_>,
    ) -> Result<Option<Output>, GatewayError> {
        let Some(job) = self.prepare(alias.spec.clone(), caller.tenant).await? else { return Ok(None) };
        let (parts, ()) = Request::builder()
            .method(Method::HEAD)
            .uri("/")
            .body(())
            .map_err(|e| PushdownError::Internal(e.to_string()))?
            .into_parts();
        let target = Target { bucket: Some(alias.target.clone()), key: Some(key.clone()), virtual_host: false };
        let resp = match self.pushdown_phase(&parts, target, job, caller, false).await {
            Ok(resp) => resp,
            Err(e) if e.spec().status.is_client_error() => return Ok(None),
            Err(e) => return Err(e),
        };
        if resp.status().is_server_error() {
            return Err(PushdownError::Unavailable(format!(
                "the output of {key:?}: the store answered {}",
                resp.status()
            ))
            .into());
        }
        let header = |name| resp.headers().get(name).and_then(|v| v.to_str().ok());
        let size = header(http::header::CONTENT_LENGTH).and_then(|v| v.parse().ok());
        Ok(match (resp.status().is_success(), size, header(http::header::ETAG)) {
            (true, Some(size), Some(etag)) => Some(Output { size, etag: etag.to_owned() }),
            _ => None,
        })
    }
}
