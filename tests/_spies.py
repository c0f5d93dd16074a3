"""Test helpers that watch how a function is called."""
from __future__ import annotations


class Spy:
    """``fn`` that records the batch size (first dimension of the first argument) of every call."""

    def __init__(self, fn):
        self.fn, self.batches = fn, []

    def __call__(self, x):
        self.batches.append(int(x.shape[0]))
        return self.fn(x)
