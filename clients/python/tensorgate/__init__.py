"""Compute-tier client for tensorgate (https://github.com/tensorgate): pushdown GETs through boto3,
WebDataset shard loaders that overlap storage-side inference with training, the frozen-layer
suffix runner, the split planner's profile and plan calls, PyTorch datasets (`tensorgate.data`),
and the random augmentation both sides draw alike (`tensorgate.augment`)."""

from .augment import Augment
from .codec import Features, decode
from .client import Client, Endpoint
from .loader import ShardLoader
from .suffix import SuffixRunner
from .profiler import profile, plan

__version__ = "0.1.0"
__all__ = ["Augment", "Client", "Endpoint", "Features", "MemberDataset", "ObjectDataset", "ShardDataset", "ShardLoader",
           "SuffixRunner", "decode", "plan", "profile"]


def __getattr__(name):  # the datasets import torch: only when asked for
    if name in ("ShardDataset", "ObjectDataset", "MemberDataset"):
        from . import data

        return getattr(data, name)
    raise AttributeError(name)
