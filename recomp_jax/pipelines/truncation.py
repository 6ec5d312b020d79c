"""The truncation baseline: no stages of its own; the evaluate stage reads the shared rows and
``truncated``, the top documents cut to ``k`` tokens."""

from __future__ import annotations

import os
from typing import Sequence

from recomp_jax.compressors import truncation
from recomp_jax.compressors.base import Context, Handoff, System
from recomp_jax.config_fields import Field
from recomp_jax.data.schema import Example
from recomp_jax.evaluation import rows as rows_lib
from recomp_jax.evaluation.rows import Row
from recomp_jax.pipelines import shared

ROW_KEYS = ('none', 'top1', 'top5', 'truncated')
FIELDS = (
    Field('truncation.tokens', 48, 'k: reader tokens kept (unless match_results is set)', minimum=1),
    Field('truncation.match_results', '', "a results file whose match_row's mean evidence tokens set k"),
    Field('truncation.match_row', 'trained', 'the row of match_results that k matches'),
)


def budget(config) -> int:
  """``k``: matched to the named results file's row, else ``truncation.tokens``."""
  t = config.truncation
  return truncation.matched_tokens(t.match_results, t.match_row) if t.match_results else int(t.tokens)


class TruncationSystem(System):
  """The first ``k`` tokens of the top documents (no training)."""

  name = 'truncation'
  row_keys = ROW_KEYS
  code = ('recomp_jax.compressors.truncation',)
  compared_rows = ('truncated',)
  fields = FIELDS

  def validate(self, config) -> None:
    shared.requested_rows(config, ROW_KEYS)

  def stages(self, ctx: Context) -> Handoff:
    return Handoff()

  def evaluation_inputs(self, ctx: Context) -> dict:
    return {'tokens': budget(ctx.config), 'top_docs': ctx.config.candidates.top_docs}

  def rows(self, ctx: Context, examples: Sequence[Example], directory: str) -> list[Row]:
    keys = shared.requested_rows(ctx.config, ROW_KEYS)
    out = rows_lib.shared_rows(keys, examples)
    if 'truncated' in keys:
      tokenizer, k = ctx.resources.reader.tokenizer, budget(ctx.config)
      compressor = truncation.TruncationCompressor(tokenizer, k=k, top_docs=ctx.config.candidates.top_docs)
      out.append(Row('truncated', 'truncated', lambda: compressor.compress([e.question for e in examples],
                                                                           [e.ctxs for e in examples])))
    return out

  def row_name(self, key: str, config) -> str:
    if key == 'truncated':
      return f'first {budget(config)} tokens of the top-{config.candidates.top_docs} documents'
    return rows_lib.SHARED_ROW_NAMES[key]

  def export(self, ctx: Context, directory: str) -> dict:
    tokenizer_dir = os.path.join(directory, 'tokenizer')
    ctx.resources.reader.tokenizer.save_pretrained(tokenizer_dir)  # k counts the reader's tokens
    return {'system': 'truncation', 'tokenizer': tokenizer_dir, 'k': budget(ctx.config),
            'top_docs': ctx.config.candidates.top_docs}

  def notes(self, config, summaries: dict) -> list[str]:
    source = (f'the mean evidence tokens of row {config.truncation.match_row!r} in '
              f'{config.truncation.match_results}' if config.truncation.match_results else 'truncation.tokens')
    return [f'Truncation budget k = {budget(config)} reader tokens, from {source}.']
