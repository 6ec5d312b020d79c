"""Bucketed static shapes: padded lengths come from a short list, so jitted functions compile
a bounded number of times whatever the input lengths."""

from __future__ import annotations

from typing import Sequence

import numpy as np


LENGTH_BUCKETS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
                  6144, 8192)
# Lengths of short target spans (answers, summaries): powers of two.
TARGET_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024)


def bucket_length(length: int, buckets: Sequence[int] = LENGTH_BUCKETS) -> int:
  """Smallest bucket >= ``length`` (multiples of the largest beyond it): bounds recompiles.

  The default buckets grow by 1.5x / 1.33x steps, so padding wastes at most a third
  of a batch's tokens while the number of compiled shapes stays logarithmic.
  """
  for b in buckets:
    if length <= b:
      return b
  top = buckets[-1]
  return -(-length // top) * top


def pad_rows(rows: Sequence[Sequence[int]], length: int, pad_id: int, *,
             left: bool = False) -> tuple[np.ndarray, np.ndarray]:
  """Ragged int rows -> ``ids, mask [len(rows), length]`` padded on the right (or left)."""
  ids = np.full((len(rows), length), pad_id, np.int32)
  mask = np.zeros((len(rows), length), np.int32)
  for i, row in enumerate(rows):
    n = len(row)
    span = slice(length - n, length) if left else slice(0, n)
    ids[i, span] = row
    mask[i, span] = 1
  return ids, mask
