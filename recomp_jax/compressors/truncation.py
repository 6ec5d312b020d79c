"""Length-matched truncation, the baseline a compressor must beat at equal evidence length: the
top documents cut after ``k`` reader tokens, ``k`` a trained run's mean (:func:`matched_tokens`).
"""

import json
from typing import Sequence

from recomp_jax.data.schema import Passage
from recomp_jax.evaluation.rows import in_rank_order, truncate  # also every system's truncation row
from recomp_jax.pretrained import load_tokenizer


class TruncationCompressor:
  """``compress(questions, documents)``: the first ``k`` tokens of each question's top documents."""

  def __init__(self, tokenizer, *, k: int, top_docs: int):
    self.tokenizer, self.k, self.top_docs = tokenizer, k, top_docs

  def compress(self, questions: Sequence[str], documents: Sequence[Sequence[Passage]]) -> list[str]:
    del questions  # truncation reads the documents only
    return [truncate(self.tokenizer, in_rank_order(list(d)[:self.top_docs]), self.k) for d in documents]


def load(spec: dict) -> TruncationCompressor:
  """The compressor of a ``compressor.json`` (``tokenizer``: the reader's tokenizer directory)."""
  return TruncationCompressor(load_tokenizer(spec['tokenizer']), k=spec['k'], top_docs=spec['top_docs'])


def matched_tokens(results_path: str, row: str = 'trained') -> int:
  """The mean evidence tokens of ``row`` in a ``results.json``, rounded: the ``k`` that matches it."""
  with open(results_path, encoding='utf-8') as f:
    rows = {r['key']: r for r in json.load(f)['rows']}
  if row not in rows:
    raise ValueError(f'{results_path}: no row {row!r} (rows: {", ".join(rows)})')
  return max(int(round(rows[row]['tokens'])), 1)


__all__ = ['TruncationCompressor', 'in_rank_order', 'load', 'matched_tokens', 'truncate']
