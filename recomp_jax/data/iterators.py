"""Deterministic, resumable minibatch iterators over in-memory arrays.

They implement :class:`recomp_jax.training.loop.ResumableIterator` (the loop saves and
restores their position with its checkpoints); :mod:`recomp_jax.data.tf_input` streams in
the same order. The loop re-exports them, so ``loop.ArrayIterator`` keeps working.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np


def epoch_order(seed: int, epoch: int, num_examples: int, shuffle: bool = True) -> np.ndarray:
  """``[num_examples]``: the order examples are read in ``epoch`` (same on every process)."""
  if not shuffle:
    return np.arange(num_examples)
  return np.random.default_rng([seed, epoch]).permutation(num_examples)


class EpochBatchPosition:
  """The saved position ``(epoch, batch)`` of an iterator with ``seed``, ``num_examples`` and
  ``batch_size``; restoring checks that these three match."""

  epoch: int
  batch: int
  seed: int
  num_examples: int
  batch_size: int

  def get_state(self) -> dict:
    return {'epoch': self.epoch, 'batch': self.batch, 'seed': self.seed,
            'num_examples': self.num_examples, 'batch_size': self.batch_size}

  def set_state(self, state: Mapping[str, Any]) -> None:
    for key in ('seed', 'num_examples', 'batch_size'):
      if key in state and state[key] != getattr(self, key):
        raise ValueError(f'iterator state was saved with {key}={state[key]}, '
                         f'this iterator has {getattr(self, key)}')
    self.epoch, self.batch = int(state['epoch']), int(state['batch'])


class ArrayIterator(EpochBatchPosition):
  """Deterministic, epoch-shuffled minibatches over in-memory arrays; resumable.

  Epoch ``e`` visits the examples in the order
  ``np.random.default_rng([seed, e]).permutation(N)``; a global batch is the
  next ``batch_size`` of them and each process yields its own contiguous
  ``batch_size / process_count`` rows. The position is ``(epoch, batch)``.

  Args:
    arrays: name -> ``[N, ...]`` array (a single array is also accepted).
    batch_size: the *global* batch size.
    seed: shuffling seed.
    shuffle: shuffle every epoch (else the natural order).
    num_epochs: stop after this many epochs (``None``: forever).
    drop_remainder: drop the last incomplete batch of an epoch (keeps one
      static shape); with False the last batch is smaller.
    process_index, process_count: this process's slot (default: JAX's).
  """

  def __init__(self, arrays: Mapping[str, np.ndarray] | np.ndarray, batch_size: int, *,
               seed: int = 0, shuffle: bool = True, num_epochs: int | None = None,
               drop_remainder: bool = True, process_index: int | None = None,
               process_count: int | None = None):
    self._single = not isinstance(arrays, Mapping)
    self.arrays = {'x': np.asarray(arrays)} if self._single else {k: np.asarray(v) for k, v in arrays.items()}
    sizes = {len(v) for v in self.arrays.values()}
    if len(sizes) != 1:
      raise ValueError(f'arrays have different lengths: { {k: len(v) for k, v in self.arrays.items()} }')
    self.num_examples = sizes.pop()
    self.process_index = jax.process_index() if process_index is None else process_index
    self.process_count = jax.process_count() if process_count is None else process_count
    if batch_size % self.process_count:
      raise ValueError(f'global batch size {batch_size} is not divisible by {self.process_count} processes')
    if batch_size > self.num_examples:
      raise ValueError(f'batch size {batch_size} exceeds the {self.num_examples} examples')
    self.batch_size = batch_size
    self.seed = seed
    self.shuffle = shuffle
    self.num_epochs = num_epochs
    self.drop_remainder = drop_remainder
    self.epoch = 0
    self.batch = 0
    self._order: np.ndarray | None = None
    self._order_epoch = -1

  @property
  def batches_per_epoch(self) -> int:
    full, rest = divmod(self.num_examples, self.batch_size)
    return full + (1 if rest and not self.drop_remainder else 0)

  def _epoch_order(self) -> np.ndarray:
    if self._order_epoch != self.epoch:
      self._order = epoch_order(self.seed, self.epoch, self.num_examples, self.shuffle)
      self._order_epoch = self.epoch
    return self._order

  def __iter__(self) -> 'ArrayIterator':
    return self

  def __next__(self) -> Any:
    if self.batch >= self.batches_per_epoch:
      self.epoch, self.batch = self.epoch + 1, 0
    if self.num_epochs is not None and self.epoch >= self.num_epochs:
      raise StopIteration
    indices = self._epoch_order()[self.batch * self.batch_size:(self.batch + 1) * self.batch_size]
    local = np.array_split(indices, self.process_count)[self.process_index]
    self.batch += 1
    out = {k: v[local] for k, v in self.arrays.items()}
    return out['x'] if self._single else out
