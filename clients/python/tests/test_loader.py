"""Unit tests of the loader's pure parts (turn-taking, the link probe's stopping rule, the link
rate): no gateway, no store, no network."""

import threading

import pytest


def test_turns_start_in_order_width_at_a_time():
    from tensorgate.loader import _Turns

    turns = _Turns(2)
    started = []

    def go(i):
        turns.wait(i)
        started.append(i)

    late = threading.Thread(target=go, args=(2,))
    late.start()
    for i in (0, 1):
        turns.wait(i)  # within the width: no waiting
    turns.done(1)  # out of order: shard 0 still runs, so shard 2 may not start
    late.join(0.2)
    assert late.is_alive() and started == []
    turns.done(0)
    late.join(10)
    assert started == [2] and turns.next == 2


def _timeline(rate: float, secs: float, stall_at: float | None = None, stall: float = 0.0, chunk: int = 16 << 10):
    """Reads of `chunk` bytes from a link of `rate` bytes/s, each waiting for its bytes, with one
    stall of `stall` seconds starting at `stall_at` (a fresh connection's loss recovery)."""
    reads, t, n = [], 0.0, 0
    while t < secs:
        took = chunk / rate + (stall if stall_at is not None and t <= stall_at < t + chunk / rate else 0.0)
        reads.append((t, t + took, n, n + chunk))
        t, n = t + took, n + chunk
    return reads


def _probe(reads: list) -> tuple[float, float]:
    """What `Client.probe` would stop at and report on `reads`: (rate, seconds read)."""
    from tensorgate.client import PROBE_MAX_SECS, PROBE_MIN_SECS, link_probe_rate, probe_settled

    window = next(reads[: i + 1] for i in range(len(reads))
                  if probe_settled(reads[: i + 1], 128 << 10, PROBE_MIN_SECS, PROBE_MAX_SECS) or i == len(reads) - 1)
    return link_probe_rate(window), window[-1][1]


def test_the_link_probe_stops_once_a_steady_link_has_shown_its_rate():
    rate, secs = _probe(_timeline(1e6, 2.0))
    assert rate == pytest.approx(1e6, rel=0.01) and secs < 0.25


def test_the_link_probe_reads_on_past_a_stall_until_the_rate_settles():
    # A 0.1 s stall 0.05 s in: over the first 0.15 s the link looks at half its rate.
    reads = _timeline(1.2e6, 2.0, stall_at=0.05, stall=0.1)
    rate, secs = _probe(reads)
    from tensorgate.client import link_probe_rate

    # The rule before: stop at 128 KiB and 0.15 s.
    i = next(i for i, r in enumerate(reads) if r[3] >= 128 << 10 and r[1] >= 0.15)
    assert link_probe_rate(reads[: i + 1]) < 0.6 * 1.2e6
    assert rate > 0.8 * 1.2e6 and secs > 0.5


def test_the_link_probe_of_a_fast_link_stops_at_its_minimum():
    reads = [(i * 1e-4, i * 1e-4 + 5e-5, i * 16384, (i + 1) * 16384) for i in range(4000)]  # no read waits
    rate, secs = _probe(reads)
    assert 0.15 <= secs < 0.16 and rate == pytest.approx(16384 / 1e-4, rel=0.01)


def test_link_rate_counts_overlapping_transfers_once():
    from types import SimpleNamespace

    from tensorgate.loader import link_rate

    def f(a, b, n):
        return SimpleNamespace(body_started=a, body_ended=b, bytes=n)

    assert link_rate([f(0, 1, 100), f(0, 1, 100)]) == 200  # two flows sharing the link
    assert link_rate([f(0, 1, 100), f(2, 3, 100)]) == 100  # idle time between is not the link's
    assert link_rate([f(0, 2, 100), f(1, 3, 100)]) == pytest.approx(200 / 3)
    assert link_rate([f(1, 1, 0)]) is None
