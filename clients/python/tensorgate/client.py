"""The client: pushdown GETs through boto3 (SigV4 intact) and the gateway's admin API."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass

import boto3
from botocore.config import Config

from .codec import Features, decode


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


class Client:
    """A tensorgate client. `endpoint` is the gateway's S3 address, `admin` its admin address
    (for models, suffix graphs and plans); `s3` may be any boto3 S3 client for the gateway."""

    def __init__(self, endpoint: str, access_key: str, secret_key: str, *, admin: str | None = None,
                 region: str = "us-east-1", s3=None, max_pool_connections: int = 32):
        self.endpoint, self.admin = endpoint, admin
        self.s3 = s3 or boto3.session.Session().client(
            "s3", endpoint_url=endpoint, aws_access_key_id=access_key, aws_secret_access_key=secret_key,
            region_name=region,
            config=Config(s3={"addressing_style": "path"}, max_pool_connections=max_pool_connections,
                          retries={"max_attempts": 5, "mode": "adaptive"}),
        )
        # Pushdown fields travel in the operation context and become signed x-tensorgate-* headers,
        # so concurrent calls with different fields share one (thread-safe) boto3 client.
        self.s3.meta.events.register("provide-client-params.s3.GetObject", _stash_fields)
        self.s3.meta.events.register("before-sign.s3.GetObject", _add_headers)

    def get(self, bucket: str, key: str, model: str | None = None, split: str | None = None, *,
            batch: int | None = None, dtype: str | None = None, fmt: str | None = None,
            range: str | None = None) -> Fetch:
        """GETs `bucket/key`; with a model and split, the pushdown output (decoded), else raw bytes
        (returned in `result.features` as a uint8 array)."""
        fields = {}
        if model:
            fields = {"model": model, "split": split or "auto"}
            for k, v in (("batch", batch), ("dtype", dtype), ("format", fmt)):
                if v is not None:
                    fields[k] = v
        t0 = time.perf_counter()
        extra = {"Range": range} if range else {}
        resp = self.s3.get_object(Bucket=bucket, Key=key, TensorgateFields=fields, **extra)
        t1 = time.perf_counter()
        body = resp["Body"].read()
        t2 = time.perf_counter()
        headers = resp["ResponseMetadata"]["HTTPHeaders"]
        if model and "x-tensorgate-split" in headers:
            result = decode(body, resp.get("ContentType"))
        else:
            import numpy as np

            result = Features(features=np.frombuffer(body, dtype=np.uint8))
        return Fetch(result, len(body), t2 - t0, t2 - t1, headers.get("x-tensorgate-split"),
                     headers.get("x-tensorgate-cache"), headers.get("x-tensorgate-plan"))

    def features(self, bucket: str, key: str, model: str, split: str, **kw) -> Features:
        """The decoded pushdown output of one object."""
        return self.get(bucket, key, model, split, **kw).result

    def list_keys(self, bucket: str, prefix: str = "", suffix: str = "") -> list[str]:
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

    def _admin(self, path: str, body: dict | None = None) -> bytes:
        if not self.admin:
            raise ValueError("this client has no admin address (Client(..., admin=...))")
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.admin + path, data=data,
                                     headers={"content-type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{path}: {e.code} {e.read().decode(errors='replace')}") from None

    def models(self) -> dict[str, dict]:
        """Every model the gateway serves, by name (splits in order, freeze split, preprocessing)."""
        return {m["name"]: m for m in json.loads(self._admin("/v1/models"))["models"]}

    def suffix_graph(self, model: str, split: str, to: str | None = None) -> bytes:
        """ONNX bytes of the frozen layers from `split` (or "input") to `to` (default: freeze)."""
        q = f"from={split}" + (f"&to={to}" if to else "")
        return self._admin(f"/v1/models/{model}/suffix?{q}")

    def storage(self, model: str) -> dict:
        """The storage side's cost-model terms for `model`: per candidate split, seconds and bytes
        per sample and the output shape."""
        return json.loads(self._admin(f"/v1/storage?model={model}"))

    def plan(self, model: str, profile: dict) -> dict:
        """Asks the gateway's planner; returns {"plan": {"chosen", "candidates"}, "storage": ...}."""
        return json.loads(self._admin("/v1/plan", {"model": model, "profile": profile}))


def _stash_fields(params, context, **_):
    fields = params.pop("TensorgateFields", None)
    if fields:
        context["tensorgate"] = fields


def _add_headers(request, **_):
    for k, v in request.context.get("tensorgate", {}).items():
        request.headers[f"x-tensorgate-{k}"] = str(v)
