//! A shard's output streamed while it is computed (ADR 0031): what the request path hands a job
//! ([`Streaming`]) to hear of the output's layout once the shard is parsed, before any feature
//! is computed, and of its bytes in order as each sample's are ready.

use std::any::Any;

use bytes::Bytes;

use super::error::PushdownError;

/// Asked once, when the client went away: a hold the job keeps while it goes on into the cache
/// (the request path's admission place), or `None` to stop.
pub(crate) type WentAway = Box<dyn FnOnce() -> Option<Box<dyn Any + Send>> + Send + Sync>;

/// What a shard's output is before its features are: enough for a response's headers.
#[derive(Debug)]
pub(crate) struct Laid {
    /// The whole output's length.
    pub(crate) len: u64,
    /// The features' stacked shape.
    pub(crate) shape: Vec<usize>,
    pub(crate) content_type: &'static str,
    /// The source's bytes the output is computed from.
    pub(crate) source_bytes: u64,
}

/// Where a job's output goes while it is computed. Only a shard's output is laid out before it
/// is computed; any other job drops this unused, and its output is answered whole.
pub(crate) struct Streaming {
    /// Told the layout once the shard is parsed.
    pub(crate) laid: Box<dyn FnOnce(Laid) + Send + Sync>,
    /// The output's bytes in order from its first; `None` for a `HEAD`, whose job ends
    /// ([`PushdownError::Unwanted`]) once the layout is told.
    pub(crate) bytes: Option<tokio::sync::mpsc::UnboundedSender<Bytes>>,
    /// Asked once, when the receiver of `bytes` went away.
    pub(crate) went_away: WentAway,
}

impl std::fmt::Debug for Streaming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streaming").field("head_only", &self.bytes.is_none()).finish_non_exhaustive()
    }
}

/// The sending side of a [`Streaming`] inside the job.
pub(super) struct Sender {
    bytes: Option<tokio::sync::mpsc::UnboundedSender<Bytes>>,
    went_away: Option<WentAway>,
    /// What `went_away` gave: held until the job ends.
    kept: Option<Box<dyn Any + Send>>,
}

impl Sender {
    /// Tells the layout; `None` when nobody wants the bytes (a `HEAD`).
    pub(super) fn start(streaming: Streaming, laid: Laid) -> Option<Self> {
        (streaming.laid)(laid);
        let bytes = streaming.bytes?;
        Some(Self { bytes: Some(bytes), went_away: Some(streaming.went_away), kept: None })
    }

    /// Sends the next bytes of the output. After the receiver went away the job goes on
    /// unheard, keeping what `went_away` gave, or stops (`Unwanted`) if it gave nothing.
    pub(super) fn send(&mut self, bytes: Bytes) -> Result<(), PushdownError> {
        if let Some(tx) = &self.bytes
            && tx.send(bytes).is_err()
        {
            self.bytes = None;
            self.kept = self.went_away.take().and_then(|f| f());
            if self.kept.is_none() {
                return Err(PushdownError::Unwanted);
            }
        }
        Ok(())
    }
}
