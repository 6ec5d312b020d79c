"""TensorBoard scalars without TensorFlow or torch, and small metric helpers.

:class:`MetricWriter` uses ``tensorboard.summary.Writer`` (the numpy-only
writer shipped with the ``tensorboard`` package) and is a no-op on every
process but 0, so the training loop can call it unconditionally.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import types
from typing import Any, Mapping

import jax
import numpy as np

logger = logging.getLogger(__name__)


def _tensorboard_without_tensorflow() -> None:
  """Makes TensorBoard use its own TF stub even when TensorFlow is installed (the ``[tf]`` extra).

  TensorBoard's event writer resolves ``tensorboard.compat.tf`` to the real TensorFlow when
  it can be imported, which loads ~1 GB and TensorFlow's thread pools into every training
  process. An importable ``tensorboard.compat.notf`` is TensorBoard's own switch for the stub.
  A process that already imported TensorFlow keeps it.
  """
  if 'tensorflow' not in sys.modules:
    sys.modules.setdefault('tensorboard.compat.notf', types.ModuleType('tensorboard.compat.notf'))


class MetricWriter:
  """Scalar summaries to ``logdir`` (TensorBoard event files), written by process 0 only.

  Args:
    logdir: the TensorBoard run directory.
    enabled: write or not; default: only on ``jax.process_index() == 0``.
  """

  def __init__(self, logdir: str | os.PathLike, *, enabled: bool | None = None):
    self.logdir = os.fspath(logdir)
    self.enabled = jax.process_index() == 0 if enabled is None else enabled
    self._writer = None
    if self.enabled:
      _tensorboard_without_tensorflow()
      from tensorboard.summary import Writer  # numpy-only event writer
      os.makedirs(self.logdir, exist_ok=True)
      self._writer = Writer(self.logdir)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes every finite-or-not numeric scalar in ``scalars`` at ``step``."""
    if self._writer is None:
      return
    for tag, value in scalars.items():
      value = float(np.asarray(value))
      self._writer.add_scalar(tag, value, step=int(step))

  def flush(self) -> None:
    if self._writer is not None:
      self._writer.flush()

  def close(self) -> None:
    if self._writer is not None:
      self._writer.close()
      self._writer = None

  def __enter__(self) -> 'MetricWriter':
    return self

  def __exit__(self, *exc) -> None:
    self.close()


class MeanAccumulator:
  """Running means of scalar metrics over a logging interval (host side)."""

  def __init__(self):
    self._sums: dict[str, float] = {}
    self._counts: dict[str, int] = {}

  def add(self, metrics: Mapping[str, Any]) -> None:
    for name, value in metrics.items():
      value = float(np.asarray(value))
      self._sums[name] = self._sums.get(name, 0.0) + value
      self._counts[name] = self._counts.get(name, 0) + 1

  def result(self) -> dict[str, float]:
    return {name: self._sums[name] / self._counts[name] for name in self._sums}

  def reset(self) -> None:
    self._sums.clear()
    self._counts.clear()

  def __len__(self) -> int:
    return max(self._counts.values(), default=0)


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
  """``tag -> [(step, value), ...]`` from the event files in ``logdir`` (for tests and notebooks)."""
  _tensorboard_without_tensorflow()
  from tensorboard.backend.event_processing import event_accumulator
  accumulator = event_accumulator.EventAccumulator(os.fspath(logdir), size_guidance={'tensors': 0})
  accumulator.Reload()
  out: dict[str, list[tuple[int, float]]] = {}
  for tag in accumulator.Tags().get('tensors', []):
    out[tag] = [(event.step, float(np.asarray(_tensor_value(event.tensor_proto))))
                for event in accumulator.Tensors(tag)]
  return out


def _tensor_value(proto) -> float:
  if proto.float_val:
    return proto.float_val[0]
  if proto.double_val:
    return proto.double_val[0]
  from tensorboard.util import tensor_util
  return float(tensor_util.make_ndarray(proto))


def format_metrics(metrics: Mapping[str, float], keys: tuple[str, ...] | None = None) -> str:
  """``'loss=1.234 lr=1e-04'`` style string for progress bars and logs."""
  items = metrics.items() if keys is None else ((k, metrics[k]) for k in keys if k in metrics)
  parts = []
  for name, value in items:
    value = float(value)
    parts.append(f'{name}={value:.4g}' if math.isfinite(value) else f'{name}={value}')
  return ' '.join(parts)
