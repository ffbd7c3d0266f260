"""The client: pushdown GETs through boto3 (SigV4 intact) and the gateway's admin API."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

import boto3
import botocore.exceptions
from botocore.config import Config

from .augment import Augment, Drawn
from .cluster import Membership
from .codec import Features, decode
from .wds import decode_features as decode_tar


#: A read of the link probe that takes longer than this waited for the network.
PROBE_WAIT_SECS = 0.002
#: The link probe measures over at least this long from its first read that waited...
PROBE_MIN_SECS = 0.15
#: ...until the rate over the second half of that window agrees with the whole window's within
#: this fraction: a slow link shaped with small buffers (a token bucket at 10-25 Mbit/s) stalls a
#: single fresh connection for tens to hundreds of ms at a time while its window grows, and a
#: window of 0.15 s then read it 25-30% low (bench/repro/probe.py); a steady link agrees at once...
PROBE_AGREE = 0.05
#: ...or until this long, whichever comes first (a link that never settles is read for 0.6 s).
PROBE_MAX_SECS = 0.6


def _first_wait(reads: list) -> int | None:
    return next((i for i, r in enumerate(reads) if r[1] - r[0] > PROBE_WAIT_SECS), None)


def _rate(reads: list) -> float:
    """Bytes/s from the first of `reads` starting to the last ending."""
    span = reads[-1][1] - reads[0][0]
    return (reads[-1][3] - reads[0][2]) / span if span > 0 else float("inf")


def probe_settled(reads: list, min_bytes: int, min_secs: float, max_secs: float) -> bool:
    """Whether the link probe can stop after `reads` ((started, ended, bytes before, bytes after),
    seconds from the first read). A link's start is not its rate: data that queued in socket buffers
    while the response headers were parsed arrives at memory speed, and a token bucket lets a burst
    through at line speed. So the window starts at the first read that had to wait for the network;
    when none has (a fast link), the probe stops after `min_bytes` and `min_secs`."""
    if reads[-1][3] < min_bytes:
        return False
    first = _first_wait(reads)
    if first is None:
        return reads[-1][1] >= min_secs
    window = reads[first:]
    span = window[-1][1] - window[0][0]
    if span < min_secs:
        return False
    if span >= max_secs:
        return True
    half = [r for r in window if r[0] >= window[0][0] + span / 2]
    return len(half) > 1 and abs(_rate(half) / _rate(window) - 1) <= PROBE_AGREE


def link_probe_rate(reads: list) -> float:
    """The link's rate over the probe's `reads`: from the first read that waited for the network
    to the end; when none did (a fast link), over the second half of the bytes."""
    if not reads:
        return 1e10
    first = _first_wait(reads)
    if first is None:
        first = next(i for i, r in enumerate(reads) if r[3] >= reads[-1][3] / 2)
    window = reads[first:]
    rate = _rate(window)
    return rate if rate != float("inf") else reads[-1][3] / max(reads[-1][1], 1e-9)


@dataclass
class Fetch:
    """One pushdown GET as the client saw it: what came back and how long the transfer took
    (body read after the response headers arrived, so the storage node's compute is excluded)."""

    result: Features
    bytes: int
    seconds: float
    transfer_seconds: float
    split: str | None
    cache: str | None
    plan: str | None
    #: `time.perf_counter()` when the body started and finished arriving (for the aggregate rate of
    #: transfers that overlap).
    body_started: float = 0.0
    body_ended: float = 0.0
    #: The response's ETag, and whether it was `304 Not Modified` (the caller's copy is current;
    #: `result` is then empty).
    etag: str | None = None
    not_modified: bool = False
    #: In a cluster: the member that computed the output (`x-tensorgate-computed-by`).
    computed_by: str | None = None
    #: What an augmented single image drew (`x-tensorgate-augmented`, `tensorgate.augment.Drawn`).
    augmented: Drawn | None = None


@dataclass(frozen=True)
class Endpoint:
    """Where a gateway is and how to sign for it: plain values, so that a dataset holding one can
    be pickled into `DataLoader` workers (each builds its own `Client` with `connect()`)."""

    endpoint: str
    access_key: str
    secret_key: str
    admin: str | None = None
    region: str = "us-east-1"
    max_pool_connections: int = 32
    route: bool = False

    def connect(self) -> "Client":
        return Client(self.endpoint, self.access_key, self.secret_key, admin=self.admin, region=self.region,
                      max_pool_connections=self.max_pool_connections, route=self.route)


class Client:
    """A tensorgate client. `endpoint` is the gateway's S3 address, `admin` its admin address
    (for models, suffix graphs and plans); `s3` may be any boto3 S3 client for the gateway.

    `route=True` (a cluster, docs/SCALING.md): every GET goes to the object's owner among the
    members `admin`'s `/v1/cluster` lists, in the gateways' own rendezvous order, then to the next
    members when one fails (connection error or `5xx`; membership is then re-read), and last to
    `endpoint`. Other calls go to `endpoint`."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str, *, admin: str | None = None,
                 region: str = "us-east-1", s3=None, max_pool_connections: int = 32, route: bool = False):
        self.endpoint, self.admin = endpoint, admin
        #: The plain settings this client was made from (what datasets carry into workers).
        self.config = Endpoint(endpoint, access_key, secret_key, admin, region, max_pool_connections, route)
        # Sent with plans: the gateway does not count this tenant's own requests as load.
        self.tenant = access_key
        self.s3 = s3 or self._boto(endpoint, retries=5)
        self.membership = Membership(admin) if route and admin else None
        self._members: dict[str, object] = {}  # member S3 URL -> boto3 client

    def _boto(self, endpoint: str, retries: int, connect_timeout: float = 60):
        cfg = self.config
        s3 = boto3.session.Session().client(
            "s3", endpoint_url=endpoint, aws_access_key_id=cfg.access_key, aws_secret_access_key=cfg.secret_key,
            region_name=cfg.region,
            # SigV4 also for presigned URLs (SigV2 would leave the trigger parameters unsigned).
            config=Config(s3={"addressing_style": "path"}, signature_version="s3v4",
                          max_pool_connections=cfg.max_pool_connections, connect_timeout=connect_timeout,
                          retries={"max_attempts": retries, "mode": "adaptive"}),
        )
        # Pushdown fields travel in the operation context and become signed x-tensorgate-* headers,
        # so concurrent calls with different fields share one (thread-safe) boto3 client.
        s3.meta.events.register("provide-client-params.s3.GetObject", _stash_fields)
        s3.meta.events.register("before-sign.s3.GetObject", _add_headers)
        s3.meta.events.register("before-send.s3.GetObject", _sending.fire)
        return s3

    def _targets(self, bucket: str, key: str) -> list:
        """Where a GET of `bucket/key` goes, in order (`endpoint` alone without routing)."""
        if self.membership is None:
            return [self.s3]
        out = []
        for m in self.membership.order(bucket, key):
            if m["s3"] not in self._members:
                # One attempt, a short connect: a dead member hands over to the next at once.
                self._members[m["s3"]] = self._boto(m["s3"], retries=1, connect_timeout=2)
            out.append(self._members[m["s3"]])
        return out + [self.s3]

    def _get_object(self, bucket: str, key: str, **kw):
        targets = self._targets(bucket, key)
        for i, s3 in enumerate(targets):
            try:
                return s3.get_object(Bucket=bucket, Key=key, **kw)
            except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError,
                    botocore.exceptions.ClientError) as e:
                status = getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                last = i == len(targets) - 1
                if last or (isinstance(e, botocore.exceptions.ClientError) and status < 500):
                    raise
                self.membership.members(force=True)

    def get(self, bucket: str, key: str, model: str | None = None, split: str | None = None, *,
            batch: int | None = None, dtype: str | None = None, fmt: str | None = None,
            range: str | None = None, if_none_match: str | None = None, before_body=None,
            before_send=None, raw: bool = False, column: str | None = None,
            row_groups: str | None = None, seq: str | None = None, augment: Augment | None = None) -> Fetch:
        """GETs `bucket/key`; with a model and split, the pushdown output (decoded), else raw bytes
        (returned in `result.features` as a uint8 array). With `if_none_match` (an ETag from an
        earlier response), an unchanged output comes back as `not_modified` with no body.
        `before_body()`, if given, is called when the headers are in and before the body is read
        (a loader orders its transfers with it); `before_send()`, once, when the request is signed
        and about to go out, or has failed before that (a loader sends its requests in order with
        it, so the gateway computes them in that order). `raw=True` returns the body undecoded (as
        uint8), e.g. a byte range of an output. `column`: a Parquet file's input column; `row_groups`:
        some of its row groups (`"3"` or `"3-5"`), read by the gateway by ranges. `seq`: where this
        request stands in its caller's order, `"<stream>.<n>"` (n from 0 within a stream named at
        random): the gateway computes a stream's requests in that order, however their connections
        reach it (ADR 0021). `augment`: random crops and flips drawn from its seed per sample
        (`tensorgate.augment`, ADR 0032); `result.augmented` is what a single image drew."""
        fields = _fields(model, split, batch=batch, dtype=dtype, format=fmt, column=column,
                         **{"row-groups": row_groups}, seq=seq, **(augment.fields() if augment else {}))
        t0 = time.perf_counter()
        extra = {"Range": range} if range else {}
        if if_none_match:
            extra["IfNoneMatch"] = if_none_match
        try:
            _sending.hook = before_send
            resp = self._get_object(bucket, key, TensorgateFields=fields, **extra)
        except botocore.exceptions.ClientError as e:
            meta = e.response.get("ResponseMetadata", {})
            if meta.get("HTTPStatusCode") != 304:
                raise
            t = time.perf_counter()
            h = meta.get("HTTPHeaders", {})
            return Fetch(Features(features=None), 0, t - t0, 0.0, h.get("x-tensorgate-split"),
                         h.get("x-tensorgate-cache"), None, t, t, h.get("etag"), True)
        finally:
            _sending.fire()  # a request that failed before it went out still passes its turn
        if before_body:
            before_body()
        t1 = time.perf_counter()
        body = resp["Body"].read()
        t2 = time.perf_counter()
        headers = resp["ResponseMetadata"]["HTTPHeaders"]
        # `x-tensorgate-split: none`: split=auto was planned as no pushdown, the body is the object.
        if model and not raw and headers.get("x-tensorgate-split", "none") != "none":
            if (resp.get("ContentType") or "").startswith("application/x-tar"):
                result = decode_tar(body, headers.get("x-tensorgate-split"), model)
            else:
                result = decode(body, resp.get("ContentType"))
        else:
            import numpy as np

            result = Features(features=np.frombuffer(body, dtype=np.uint8))
        return Fetch(result, len(body), t2 - t0, t2 - t1, headers.get("x-tensorgate-split"),
                     headers.get("x-tensorgate-cache"), headers.get("x-tensorgate-plan"), t1, t2, headers.get("etag"),
                     computed_by=headers.get("x-tensorgate-computed-by"),
                     augmented=Drawn.parse(headers["x-tensorgate-augmented"]) if "x-tensorgate-augmented" in headers
                     else None)

    def probe(self, bucket: str, key: str, *, max_bytes: int = 4 << 20, min_bytes: int = 128 << 10,
              min_secs: float = PROBE_MIN_SECS, max_secs: float = PROBE_MAX_SECS,
              chunk: int = 16 << 10) -> tuple[bytes, float]:
        """Reads the start of raw object `key` to measure the link: returns the bytes read and the
        link's sustained rate (bytes/s), as `link_probe_rate` reads it from the reads' timeline.
        Stops once that rate has settled (`probe_settled`), or at `max_bytes` (a fast link reaches
        it in milliseconds)."""
        resp = self.s3.get_object(Bucket=bucket, Key=key, Range=f"bytes=0-{max_bytes - 1}")
        body, got, reads = resp["Body"], [], []  # reads: (started, ended, bytes before, bytes after)
        t0 = time.perf_counter()
        n = 0
        try:
            while n < max_bytes:
                a = time.perf_counter()
                data = body.read(chunk)
                if not data:
                    break
                got.append(data)
                reads.append((a - t0, time.perf_counter() - t0, n, n + len(data)))
                n += len(data)
                if probe_settled(reads, min_bytes, min_secs, max_secs):
                    break
        finally:
            body.close()
        return b"".join(got), link_probe_rate(reads)

    def features(self, bucket: str, key: str, model: str, split: str, **kw) -> Features:
        """The decoded pushdown output of one object."""
        return self.get(bucket, key, model, split, **kw).result

    def presign(self, bucket: str, key: str, model: str | None = None, split: str | None = None, *,
                fmt: str | None = None, dtype: str | None = None, batch: int | None = None,
                expires: int = 3600) -> str:
        """A presigned GET URL for `bucket/key`; with a model and split, a query-trigger pushdown
        (`tensorgate-model=...&tensorgate-split=...`, signed with the rest of the query), so that
        any HTTP reader (webdataset, curl, a browser) gets the features."""
        fields = _fields(model, split, format=fmt, dtype=dtype, batch=batch)
        params = {"Bucket": bucket, "Key": key, **({"TensorgateFields": fields} if fields else {})}
        return self.s3.generate_presigned_url("get_object", Params=params, ExpiresIn=expires)

    def urls(self, bucket: str, pattern: str, model: str | None = None, split: str | None = None, *,
             fmt: str | None = "tar", expires: int = 3600, **kw) -> list[str]:
        """Presigned pushdown URLs for a brace pattern of keys (`"train/{000..099}.tar"`, the
        WebDataset shard-list convention), in pattern order: `webdataset.WebDataset(urls)` then
        reads features instead of images. `fmt` defaults to `tar` (WebDataset's own layout)."""
        from braceexpand import braceexpand

        return [self.presign(bucket, k, model, split, fmt=fmt if model else None, expires=expires, **kw)
                for k in braceexpand(pattern)]

    def list_keys(self, bucket: str, prefix: str = "", suffix: str | tuple[str, ...] = "") -> list[str]:
        keys = []
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", []) if o["Key"].endswith(suffix)]
        return sorted(keys)

    def sizes(self, bucket: str, prefix: str = "") -> dict[str, int]:
        """Object sizes under a prefix, by key."""
        out = {}
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out.update({o["Key"]: o["Size"] for o in page.get("Contents", [])})
        return out

    # --- admin API -------------------------------------------------------------------------------

    def _admin(self, path: str, body: dict | None = None, proven: bool = False) -> bytes:
        """An admin API call; `proven` reads (graphs, tokenizers, plans) carry a proof of this
        client's key in `x-tensorgate-proof`."""
        if not self.admin:
            raise ValueError("this client has no admin address (Client(..., admin=...))")
        data = json.dumps(body).encode() if body is not None else None
        headers = {"content-type": "application/json"} if data else {}
        if proven:
            headers["x-tensorgate-proof"] = self.proof()
        req = urllib.request.Request(self.admin + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{path}: {e.code} {e.read().decode(errors='replace')}") from None

    def models(self) -> dict[str, dict]:
        """Every model the gateway serves, by name (splits in order, freeze split, preprocessing)."""
        return {m["name"]: m for m in json.loads(self._admin("/v1/models"))["models"]}

    def tokenizer(self, model: str) -> bytes:
        """A text model's `tokenizer.json` as the gateway runs it (truncation and padding to the
        model's length): the no-pushdown baseline tokenizes with exactly this."""
        return self._admin(f"/v1/models/{model}/tokenizer", proven=True)

    def suffix_graph(self, model: str, split: str, to: str | None = None) -> bytes:
        """ONNX bytes of the frozen layers from `split` (or "input") to `to` (default: freeze)."""
        q = f"from={split}" + (f"&to={to}" if to else "")
        return self._admin(f"/v1/models/{model}/suffix?{q}", proven=True)

    def storage(self, model: str, dtype: str | None = None) -> dict:
        """The storage side's cost-model terms for `model`: per candidate split, seconds and bytes
        per sample (of `dtype` outputs, default f32) and the output shape."""
        q = urllib.parse.urlencode({"model": model, "tenant": self.tenant, **({"dtype": dtype} if dtype else {})})
        return json.loads(self._admin(f"/v1/storage?{q}"))

    def plan(self, model: str, profile: dict, dtype: str | None = None) -> dict:
        """Asks the gateway's planner, for outputs of `dtype` (default f32); returns
        {"plan": {"chosen", "candidates"}, "storage": ...}."""
        return json.loads(self._admin("/v1/plan", {"model": model, "profile": profile, "tenant": self.tenant,
                                                   "proof": self.proof(), **({"dtype": dtype} if dtype else {})}))

    def proof(self, expires: int = 300) -> str:
        """A presigned `GET /` (ListBuckets) URL signed with this client's key: what the admin API
        asks of a call that changes something (the gateway, or in transparent mode the store,
        checks it; docs/planner.md)."""
        return self.s3.generate_presigned_url("list_buckets", ExpiresIn=expires)


def _fields(model: str | None, split: str | None, **optional) -> dict:
    """The pushdown fields of a request (none without a model; `split` defaults to `auto`)."""
    if not model:
        return {}
    return {"model": model, "split": split or "auto", **{k: v for k, v in optional.items() if v is not None}}


class _SendHook(threading.local):
    """The `before_send` of the `Client.get` running in this thread, for botocore's
    `before-send` event (which carries no call context); fired once."""

    hook = None

    def fire(self, **_):
        hook, self.hook = self.hook, None
        if hook:
            hook()


_sending = _SendHook()


def _stash_fields(params, context, **_):
    fields = params.pop("TensorgateFields", None)
    if fields:
        context["tensorgate"] = fields


def _add_headers(request, **_):
    fields = request.context.get("tensorgate", {})
    if not fields:
        return
    if request.context.get("is_presign_request"):  # query triggers, signed with the URL
        q = urllib.parse.urlencode({f"tensorgate-{k}": str(v) for k, v in fields.items()}, quote_via=urllib.parse.quote)
        request.url += ("&" if "?" in request.url else "?") + q
        return
    for k, v in fields.items():
        request.headers[f"x-tensorgate-{k}"] = str(v)

