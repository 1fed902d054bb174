"""Data: samples (token ids + loss mask), and deterministic batching over epochs."""

from dflash.data.batching import BatchPlan, Sample, collate
from dflash.data.synthetic import synthesize

__all__ = ["BatchPlan", "Sample", "collate", "synthesize"]
