"""Routing to the owner of an object in a tensorgate cluster (docs/SCALING.md): the same rendezvous
(HRW) order the gateways compute, so each request goes straight to the member whose cache holds the
object's features, and the next members in that order when it fails."""

from __future__ import annotations

import hashlib
import json
import time
import urllib.error
import urllib.request

#: The hashing this module implements (a cluster announcing another is not routed).
HASHING = "hrw-sha256-v1"


def score(member: str, bucket: str, key: str) -> int:
    """A member's rendezvous score for an object: SHA-256(id NUL bucket NUL key), first 8 bytes."""
    digest = hashlib.sha256(b"\0".join((member.encode(), bucket.encode(), key.encode()))).digest()
    return int.from_bytes(digest[:8], "big")


def rank(ids: list[str], bucket: str, key: str) -> list[str]:
    """Members in ownership order for an object: the owner first (ties: the smaller id)."""
    return sorted(ids, key=lambda m: (-score(m, bucket, key), m))


class Membership:
    """The cluster as a gateway's `/v1/cluster` reports it, refreshed at most every `refresh`
    seconds (and at once after a member failed). Empty for a single gateway (`404`)."""

    def __init__(self, admin: str, refresh: float = 5.0, timeout: float = 5.0):
        self.admin, self.refresh, self.timeout = admin, refresh, timeout
        self._members: list[dict] = []
        self._at = float("-inf")

    def members(self, force: bool = False) -> list[dict]:
        if force or time.monotonic() - self._at > self.refresh:
            self._members, self._at = self._fetch(), time.monotonic()
        return self._members

    def _fetch(self) -> list[dict]:
        try:
            with urllib.request.urlopen(f"{self.admin}/v1/cluster", timeout=self.timeout) as r:
                report = json.load(r)
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return []  # not a cluster
            return self._members  # keep what was known
        except OSError:
            return self._members
        if report.get("hashing") != HASHING:
            return []
        return report.get("members", [])

    def order(self, bucket: str, key: str) -> list[dict]:
        """The ready members in ownership order for `bucket/key`."""
        ready = {m["id"]: m for m in self.members() if m.get("state") == "ready"}
        return [ready[i] for i in rank(list(ready), bucket, key)]
