"""Readers and writers of the JSONL files the shared stages hand to every system.

A stage's per-split file ``<stage dir>/<split>.jsonl`` holds one record per question, keyed by
its ``id``; the ``retrieve`` stage's files hold whole :class:`~recomp_jax.data.schema.Example`
records (DPR layout). Systems read them through these functions (and
:class:`recomp_jax.compressors.base.Context`), never by opening the files themselves, so that a
damaged line is always a :class:`~recomp_jax.data.schema.DataError` naming file and line.
"""

from __future__ import annotations

import os
from typing import Sequence

from recomp_jax import sharding
from recomp_jax.data import formats
from recomp_jax.data.schema import DataError, Example


def write_examples(path: str, examples: Sequence[Example]) -> None:
  """Writes a stage's examples (in a multi-process run, process 0 writes)."""
  if sharding.is_main_process():
    formats.write_examples(path, examples)


def read_examples(path: str) -> list[Example]:
  """Every example of a stage's DPR-layout JSONL file, in file order."""
  return list(formats.read_examples(path, 'dpr'))


def load_labels(directory: str, split: str) -> dict[str, dict]:
  """A stage's records of ``split`` (``<directory>/<split>.jsonl``) by their ``id``.

  Raises:
    DataError: a damaged line, or a record without an ``id``; the message names file and line.
  """
  path = os.path.join(directory, f'{split}.jsonl')
  out = {}
  for lineno, record in formats.iter_jsonl(path):
    if not isinstance(record, dict) or 'id' not in record:
      raise DataError(path, lineno, 'id', 'missing (every stage record has one)')
    out[record['id']] = record
  return out


def load_candidates(directory: str, split: str) -> dict[str, list[str]]:
  """The candidates stage's sentences of ``split`` by question id (see :func:`load_labels`)."""
  return {i: r['candidates'] for i, r in load_labels(directory, split).items()}


__all__ = ['load_candidates', 'load_labels', 'read_examples', 'write_examples']
