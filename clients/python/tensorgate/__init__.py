"""Compute-tier client for tensorgate (https://github.com/tensorgate): pushdown GETs through boto3,
WebDataset shard loaders that overlap storage-side inference with training, the frozen-layer
suffix runner, and the split planner's profile and plan calls."""

from .codec import Features, decode
from .client import Client
from .loader import ShardLoader
from .suffix import SuffixRunner
from .profiler import profile, plan

__all__ = ["Client", "Features", "ShardLoader", "SuffixRunner", "decode", "plan", "profile"]
__version__ = "0.1.0"
