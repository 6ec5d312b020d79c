"""TensorBoard scalars and text without TensorFlow or torch, and small metric helpers.

:class:`MetricWriter` writes TensorBoard event files with the numpy-only writer shipped
with the ``tensorboard`` package and is a no-op on every process but 0, so the training
loop can call it unconditionally.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
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
  """Scalar and text summaries to ``logdir`` (TensorBoard event files), written by process 0 only.

  Events are built from TensorBoard's own protos and written by its ``EventFileWriter``
  (numpy only: no TensorFlow, no torch). Scalars show in the scalars tab, text (markdown,
  e.g. the results table) in the text tab.

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
      from tensorboard.summary.writer.event_file_writer import EventFileWriter
      os.makedirs(self.logdir, exist_ok=True)
      self._writer = EventFileWriter(self.logdir)

  def _emit(self, step: int, tag: str, plugin: str, data_class: int, tensor) -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name=plugin), data_class=data_class)
    event = event_pb2.Event(wall_time=time.time(), step=int(step))
    event.summary.value.add(tag=tag, tensor=tensor, metadata=metadata)
    self._writer.add_event(event)

  def write_scalars(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes every numeric scalar in ``scalars`` (finite or not) at ``step``."""
    if self._writer is None:
      return
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, types_pb2
    for tag, value in scalars.items():
      tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[float(np.asarray(value))])
      self._emit(step, tag, 'scalars', summary_pb2.DATA_CLASS_SCALAR, tensor)

  def write_text(self, step: int, texts: Mapping[str, str]) -> None:
    """Writes markdown ``texts`` (``tag -> text``) at ``step`` for TensorBoard's text tab."""
    if self._writer is None:
      return
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, types_pb2
    for tag, text in texts.items():
      tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[str(text).encode('utf-8')])
      self._emit(step, tag, 'text', summary_pb2.DATA_CLASS_TENSOR, tensor)

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


def _tensor_events(logdir: str | os.PathLike, plugin: str) -> dict[str, list]:
  """``tag -> [TensorEvent, ...]`` of one TensorBoard plugin's summaries in ``logdir``."""
  _tensorboard_without_tensorflow()
  from tensorboard.backend.event_processing import event_accumulator
  accumulator = event_accumulator.EventAccumulator(os.fspath(logdir), size_guidance={'tensors': 0})
  accumulator.Reload()
  return {tag: accumulator.Tensors(tag) for tag in accumulator.Tags().get('tensors', [])
          if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == plugin}


def read_scalars(logdir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
  """``tag -> [(step, value), ...]`` from the event files in ``logdir`` (for tests and notebooks)."""
  return {tag: [(e.step, float(np.asarray(_tensor_value(e.tensor_proto)))) for e in events]
          for tag, events in _tensor_events(logdir, 'scalars').items()}


def read_text(logdir: str | os.PathLike) -> dict[str, list[tuple[int, str]]]:
  """``tag -> [(step, markdown), ...]`` of the text summaries in ``logdir``."""
  return {tag: [(e.step, e.tensor_proto.string_val[0].decode('utf-8')) for e in events]
          for tag, events in _tensor_events(logdir, 'text').items()}


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
