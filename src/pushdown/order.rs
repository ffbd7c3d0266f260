//! Arrival numbers in the order a client sent its requests (ADR 0021).
//!
//! A request's arrival number places its samples in the preprocessing slots, the engine queues
//! and the inference slots ([`super::queue::Place`]). The gateway numbered requests when it got to
//! them, and a client that sends shards 0-3 a few milliseconds apart on four connections had them
//! numbered in the order the runtime polled the connections (on one core, the most recently woken
//! first: 0, 3, 2, 1). The client then waited for shard 1, computed last.
//!
//! A client that knows its order says so: `seq=<stream>.<n>` (header `x-tensorgate-seq` or query
//! `tensorgate-seq`), `n` counting its requests from 0 within a stream it names at random. When
//! request `n` arrives before some of `0..n` that the stream has not sent yet, the gateway takes
//! numbers for those first and keeps them: each takes its own when it arrives. So a stream's
//! requests are numbered in its order, and every number is still taken when the stream's requests
//! arrive, among other clients' numbers, so no stream goes ahead of requests that arrived before
//! it. Pure bookkeeping under one short lock: no IO, no CPU work.
//!
//! A stream names no tenant and needs no identity: in transparent mode it is read before the store
//! has accepted the request. A client that guesses another's stream can at most move that stream's
//! numbers among themselves. The map is bounded ([`MAX_STREAMS`], [`MAX_RESERVED`]): past the
//! bound a request is numbered as it arrives, as without `seq`. A held number is given only while
//! it is recent ([`HOLD_WINDOW`]): a stream cannot bank numbers and later put requests ahead of
//! many that arrived before them.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, PoisonError};

/// Streams remembered at once; the least recently used is forgotten first. A loader names one
/// per epoch and rank, so a node sees far fewer at once; a forgotten stream's requests are
/// numbered as they arrive.
pub(crate) const MAX_STREAMS: usize = 1024;
/// How recent a held number must be to be given: at most this many numbers taken after it. A
/// loader's skipped requests arrive milliseconds after the request that skipped them (a few
/// other requests' numbers apart on a busy node); a request whose held number is older takes a
/// new one. So a request goes ahead of at most this many that arrived before it.
pub(crate) const HOLD_WINDOW: u64 = 256;
/// Numbers a stream may hold for requests it has not sent yet: a loader has its prefetch depth
/// (a few requests) in flight. Past it, a request that skips ahead takes no numbers for those it
/// skipped, and the oldest held numbers are given up.
pub(crate) const MAX_RESERVED: u64 = 64;
/// Longest stream name (a loader sends 16 hex digits).
pub(crate) const MAX_STREAM_NAME: usize = 64;

/// Where a request stands in its client's order: the `n`th request of `stream`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Seq {
    pub(crate) stream: String,
    pub(crate) n: u64,
}

impl Seq {
    /// `<stream>.<n>`: a stream name of ASCII letters, digits, `-` and `_` (at most
    /// [`MAX_STREAM_NAME`]), and a whole number.
    #[must_use]
    pub(crate) fn parse(value: &str) -> Option<Self> {
        let (stream, n) = value.rsplit_once('.')?;
        let name_ok = !stream.is_empty()
            && stream.len() <= MAX_STREAM_NAME
            && stream.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        let n = n.parse::<u64>().ok().filter(|_| name_ok)?;
        Some(Self { stream: stream.to_owned(), n })
    }
}

impl std::fmt::Display for Seq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.stream, self.n)
    }
}

/// Hands out arrival numbers.
#[derive(Debug, Default)]
pub(crate) struct Arrivals {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next: u64,
    streams: HashMap<String, ClientStream>,
}

#[derive(Debug, Default)]
struct ClientStream {
    /// One past the highest `n` seen.
    seen: u64,
    /// Numbers held for requests not yet arrived, by `n`.
    held: BTreeMap<u64, u64>,
    /// The number taken when the stream was last used (which stream is forgotten first).
    used: u64,
}

impl Arrivals {
    /// The arrival number of a request that arrives now, at `seq` in its client's order if it
    /// names one.
    pub(crate) fn number(&self, seq: Option<&Seq>) -> u64 {
        let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(seq) = seq else { return take(&mut g.next) };
        if !g.streams.contains_key(&seq.stream) && g.streams.len() >= MAX_STREAMS {
            // At the bound (checked only when a new stream comes): forget the least recently used.
            let oldest = g.streams.iter().min_by_key(|(_, s)| s.used).map(|(name, _)| name.clone());
            if let Some(oldest) = oldest {
                g.streams.remove(&oldest);
            }
        }
        let Inner { next, streams } = &mut *g;
        let stream = streams.entry(seq.stream.clone()).or_default();
        stream.used = *next;
        if let Some(held) = stream.held.remove(&seq.n)
            && *next - held <= HOLD_WINDOW
        {
            return held;
        }
        if seq.n >= stream.seen {
            // The requests this one skipped have not arrived: theirs come first.
            if seq.n - stream.seen <= MAX_RESERVED {
                for skipped in stream.seen..seq.n {
                    stream.held.insert(skipped, take(next));
                }
                while stream.held.len() as u64 > MAX_RESERVED {
                    stream.held.pop_first();
                }
            }
            // Saturating: a client may send the largest `n` there is.
            stream.seen = seq.n.saturating_add(1);
        }
        take(next)
    }
}

fn take(next: &mut u64) -> u64 {
    let n = *next;
    *next += 1;
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(stream: &str, n: u64) -> Seq {
        Seq { stream: stream.into(), n }
    }

    #[test]
    fn parses_a_stream_and_a_count() {
        assert_eq!(Seq::parse("a1b2.7"), Some(seq("a1b2", 7)));
        assert_eq!(Seq::parse("job-rank-0_x.12"), Some(seq("job-rank-0_x", 12)));
        for bad in
            ["", ".3", "a.", "a.-1", "a.x", "a b.1", "a.b.1", "a", &format!("{}.1", "a".repeat(MAX_STREAM_NAME + 1))]
        {
            assert_eq!(Seq::parse(bad), None, "{bad:?}");
        }
        assert_eq!(seq("s", 3).to_string(), "s.3");
    }

    #[test]
    fn a_streams_requests_are_numbered_in_its_order_whatever_order_they_arrive_in() {
        let a = Arrivals::default();
        let order = [0, 3, 2, 1].map(|n| (n, a.number(Some(&seq("s", n)))));
        let mut by_n = order;
        by_n.sort_by_key(|(n, _)| *n);
        let numbers: Vec<u64> = by_n.iter().map(|(_, k)| *k).collect();
        assert!(numbers.is_sorted(), "{order:?}");
        // Every number was taken when the stream's requests arrived: the next one is after them.
        assert_eq!(a.number(None), 4);
    }

    #[test]
    fn a_stream_goes_ahead_of_no_request_that_arrived_before_it() {
        let a = Arrivals::default();
        let s2 = a.number(Some(&seq("s", 2)));
        let other = a.number(None);
        let s0 = a.number(Some(&seq("s", 0)));
        let s1 = a.number(Some(&seq("s", 1)));
        assert!(s0 < s1 && s1 < s2 && s2 < other, "{s0} {s1} {s2} {other}");
        let first = a.number(None);
        let late = a.number(Some(&seq("t", 0)));
        assert!(first < late);
    }

    #[test]
    fn streams_do_not_share_numbers_and_repeats_get_new_ones() {
        let a = Arrivals::default();
        let x = [a.number(Some(&seq("x", 1))), a.number(Some(&seq("y", 1)))];
        let x0 = a.number(Some(&seq("x", 0)));
        let y0 = a.number(Some(&seq("y", 0)));
        assert!(x0 < x[0] && y0 < x[1] && x0 != y0);
        // A retry of a request already numbered is numbered as it arrives.
        let again = a.number(Some(&seq("x", 0)));
        assert!(again > y0);
    }

    #[test]
    fn a_held_number_is_given_only_while_recent() {
        let a = Arrivals::default();
        let s1 = a.number(Some(&seq("s", 1)));
        for _ in 0..=HOLD_WINDOW {
            a.number(None);
        }
        // Held longer than the window: a new number, behind the requests that came meanwhile.
        let s0 = a.number(Some(&seq("s", 0)));
        assert!(s0 > s1 + HOLD_WINDOW, "{s0} {s1}");
        let t1 = a.number(Some(&seq("t", 1)));
        a.number(None);
        let t0 = a.number(Some(&seq("t", 0)));
        assert!(t0 < t1, "{t0} {t1}");
    }

    #[test]
    fn the_stream_forgotten_is_the_least_recently_used() {
        let a = Arrivals::default();
        let mut busy = 0;
        for i in 0..MAX_STREAMS + 10 {
            if i % 100 == 0 {
                a.number(Some(&seq("busy", busy)));
                busy += 1;
            }
            a.number(Some(&seq(&format!("n{i}"), 0)));
        }
        let g = a.inner.lock().unwrap();
        assert_eq!(g.streams.len(), MAX_STREAMS);
        assert!(g.streams.contains_key("busy") && !g.streams.contains_key("n0"));
    }

    #[test]
    fn what_a_stream_holds_is_bounded() {
        let a = Arrivals::default();
        // A skip past the bound holds nothing.
        let far = a.number(Some(&seq("s", MAX_RESERVED + 1)));
        assert_eq!(far, 0);
        let early = a.number(Some(&seq("s", 0)));
        assert!(early > far);
        // Skips within the bound, one after another, hold at most MAX_RESERVED numbers.
        for step in 1..=4 {
            a.number(Some(&seq("t", step * MAX_RESERVED)));
        }
        let g = a.inner.lock().unwrap();
        assert_eq!(g.streams["t"].held.len() as u64, MAX_RESERVED);
        assert!(g.streams["t"].held.contains_key(&(4 * MAX_RESERVED - 1)));
        drop(g);
        // The largest `n` a client can send is numbered, not an overflow.
        let last = a.number(Some(&seq("max", u64::MAX)));
        assert!(a.number(Some(&seq("max", u64::MAX))) > last);
        // Streams past MAX_STREAMS forget the least recently used.
        for i in 0..=MAX_STREAMS {
            a.number(Some(&seq(&format!("n{i}"), 0)));
        }
        let g = a.inner.lock().unwrap();
        assert_eq!(g.streams.len(), MAX_STREAMS);
        assert!(!g.streams.contains_key("s") && g.streams.contains_key(&format!("n{MAX_STREAMS}")));
    }
}
