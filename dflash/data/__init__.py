"""Data: samples (token ids + loss mask), chat datasets, and deterministic batching over epochs."""

from dflash.data.batching import BatchPlan, Sample, collate
from dflash.data.synthetic import synthesize
from dflash.data.tokenize import load_samples

__all__ = ["BatchPlan", "Sample", "collate", "load_samples", "synthesize"]
