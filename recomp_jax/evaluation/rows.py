"""Evaluation rows: evidence -> the reader's EM / F1 / tokens per question, for every system.

A row is one way of choosing the evidence the reader sees (no retrieval, the top-1
document, a trained compressor's output, ...). :func:`evaluate_rows` reads every row with
the one :class:`recomp_jax.reader.Reader` under the reader prompt protocol and appends one
record per row to a resumable JSONL (a killed evaluation keeps its finished rows);
:func:`aggregate_rows` folds per-seed rows (``key@seed``) into one row of the results
schema; :func:`bootstrap_rows` compares the trained row (each of a system's compared rows)
with every other row.

The rows every system shares (:data:`SHARED_ROW_KEYS`) are built here by
:func:`shared_evidence`, and the length-matched truncation row by :func:`truncation_row`; a
system adds its own (:meth:`recomp_jax.compressors.base.System.rows`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import numpy as np
from absl import logging

from recomp_jax.data.schema import Example
from recomp_jax.data.sentences import format_candidate, split_sentences
from recomp_jax.evaluation import qa_metrics
from recomp_jax.stages import ResumableJsonl
from recomp_jax.reader import prompts

SHARED_ROW_KEYS = ('none', 'top1', 'top5', 'lead', 'gold')
SHARED_ROW_NAMES = {
    'none': 'no retrieval',
    'top1': 'top-1 document',
    'top5': 'top-5 documents',
    'lead': 'lead sentence of the top-1 document',
    'gold': 'gold passage(s)',
    'truncation': "truncation: the top documents cut to the trained row's mean evidence tokens",
}
TRUNCATION = 'truncation'


@dataclasses.dataclass(frozen=True)
class Row:
  """One evaluation row.

  Attributes:
    row_id: ``key``, or ``key@seed`` for a row evaluated once per training seed.
    key: the row key of the results schema (``'top1'``, ``'trained'``, ...).
    evidence: builds the evidence text per test example (``None``: the row does not score
      that example); called only when the row is not already in the results file.
    reader: builds the reader of this row (a fine-tuned generator, FILCO's ``M_gen``);
      ``None`` = the run's reader.
    prompt: ``(question, evidence) -> prompt`` for this row's reader; ``None`` = the reader
      protocol's prompt with the reader's in-context examples (:meth:`recomp_jax.reader.Reader.prompt`).
    matches: a length-matched row: the key of the row (read earlier in the same evaluation,
      every seed of it) whose mean evidence tokens this row matches; ``evidence`` is then
      called with that mean, rounded (at least 1).
  """
  row_id: str
  key: str
  evidence: Callable[..., list[str | None]]
  reader: Callable[[], object] | None = None
  prompt: Callable[[str, str], str] | None = None
  matches: str | None = None


def lead_sentence(example: Example) -> str:
  """The first sentence of the top-1 document as a candidate string ('' without documents)."""
  if not example.ctxs:
    return ''
  sentences = split_sentences(example.ctxs[0].text)
  return format_candidate(example.ctxs[0].title, sentences[0]) if sentences else ''


def gold_passages(example: Example):
  """The gold evidence of an example, or None when the protocol skips it.

  Every retrieved passage flagged ``is_gold`` (HotpotQA: both supporting paragraphs), in
  retrieval order; with no flags at all, the example's ``gold_ctx``. An example whose
  flags are all false (NQ: gold passage not retrieved) is not scored by the gold row
  (NQ reader protocol).
  """
  flagged = [p for p in example.ctxs if p.is_gold]
  if flagged:
    return flagged
  if any(p.is_gold is not None for p in example.ctxs) or example.gold_ctx is None:
    return None
  return [example.gold_ctx]


def shared_evidence(key: str, examples: Sequence[Example]) -> list[str | None]:
  """Evidence per example for a row every system reports (:data:`SHARED_ROW_KEYS`)."""
  if key == 'none':
    return [''] * len(examples)
  if key == 'top1':
    return [prompts.format_documents(e.ctxs[:1]) for e in examples]
  if key == 'top5':
    return [prompts.format_documents(e.ctxs[:5]) for e in examples]
  if key == 'lead':
    return [lead_sentence(e) for e in examples]
  if key == 'gold':
    out = []
    for e in examples:
      gold = gold_passages(e)
      out.append(None if gold is None else prompts.format_documents(gold))
    return out
  raise ValueError(f'unknown shared row {key!r}; shared rows: {", ".join(SHARED_ROW_KEYS)}')


def truncate(tokenizer, text: str, k: int) -> str:
  """The first ``k`` tokens of ``text`` under ``tokenizer``, decoded (``text`` itself when shorter)."""
  ids = tokenizer(text, add_special_tokens=False)['input_ids']
  return text if len(ids) <= k else tokenizer.decode(ids[:k]).rstrip()


def in_rank_order(passages: Sequence) -> str:
  """``'{title}\n{text}'`` blocks best first, so the first ``k`` tokens are the top document's start
  (the reader's own format, :func:`recomp_jax.reader.prompts.format_documents`, puts the best last)."""
  return '\n'.join(f'{p.title}\n{p.text}' for p in passages)


def truncated_documents(tokenizer, examples: Sequence[Example], *, k: int, top_docs: int) -> list[str]:
  """Per example, the first ``k`` reader tokens of its top ``top_docs`` documents, best first."""
  return [truncate(tokenizer, in_rank_order(e.ctxs[:top_docs]), k) for e in examples]


def truncation_row(examples: Sequence[Example], tokenizer, *, top_docs: int, matches: str = 'trained') -> Row:
  """The length-matched truncation baseline of a system's table: the top documents cut to the mean
  evidence tokens of row ``matches`` (every seed of it), which :func:`evaluate_rows` reads first.
  A compressor that does not beat it spends its compute for nothing."""
  return Row(TRUNCATION, TRUNCATION, lambda k: truncated_documents(tokenizer, examples, k=k, top_docs=top_docs),
             matches=matches)


def shared_rows(keys: Sequence[str], examples: Sequence[Example]) -> list[Row]:
  """:class:`Row` objects for the shared keys among ``keys``."""
  return [Row(k, k, lambda k=k: shared_evidence(k, examples)) for k in keys if k in SHARED_ROW_KEYS]


def evaluate_rows(reader, examples: Sequence[Example], rows: Sequence[Row], out_path: str) -> dict[str, dict]:
  """Reads every row's evidence with ``reader`` (or the row's own); one record per row appended to ``out_path``.

  Rows already in ``out_path`` are skipped (resume). A record holds the row's EM / F1 (%),
  mean evidence tokens under the reader's tokenizer, ``n`` (questions scored) and the
  per-question ids, predictions, evidence, EM, F1 and tokens.

  Returns:
    ``{row_id: record}`` for every row of ``rows``.
  """
  done = ResumableJsonl(out_path, key='row')
  for row in rows:
    if row.row_id in done:
      continue
    start = time.time()
    if row.matches is None:
      evidence = row.evidence()
    else:
      matched = [rec['tokens'] for rid, rec in done.records.items() if rid.split('@')[0] == row.matches]
      if not matched:
        raise ValueError(f'row {row.row_id!r} matches the tokens of row {row.matches!r}, which is not '
                         'evaluated before it')
      evidence = row.evidence(max(int(round(float(np.mean(matched)))), 1))
    keep = [i for i, ev in enumerate(evidence) if ev is not None]
    row_reader = row.reader() if row.reader is not None else reader
    build = row.prompt or row_reader.prompt
    reader_prompts = [build(examples[i].question, evidence[i]) for i in keep]
    scores = row_reader.exact_match(reader_prompts, [examples[i].answers for i in keep])
    tokens = [row_reader.count_tokens(evidence[i]) for i in keep]
    done.append({'row': row.row_id, 'key': row.key, 'n': len(keep), 'ids': [examples[i].id for i in keep],
                 'em': scores['em'], 'f1': scores['f1'],
                 'em_per_example': scores['em_per_example'].tolist(),
                 'f1_per_example': scores['f1_per_example'].tolist(),
                 'tokens_per_example': tokens, 'tokens': float(np.mean(tokens)) if tokens else 0.0,
                 'predictions': scores['predictions'], 'evidence': [evidence[i] for i in keep],
                 'seconds': time.time() - start})
    logging.info('row %-22s EM %5.1f F1 %5.1f tokens %6.1f (%.0fs)', row.row_id, scores['em'], scores['f1'],
                 float(np.mean(tokens)) if tokens else 0.0, time.time() - start)
  done.close()
  return {row.row_id: done.records[row.row_id] for row in rows}


def table_order(row_ids, row_keys: Sequence[str]) -> list[str]:
  """Row ids (``key`` or ``key@seed``) in ``row_keys`` order, then by id; unknown keys last."""
  def rank(row_id: str):
    key = row_id.split('@')[0]
    return (row_keys.index(key) if key in row_keys else len(row_keys), row_id)
  return sorted(row_ids, key=rank)


def aggregate_rows(records: dict[str, dict], row_keys: Sequence[str], name: Callable[[str], str],
                   out_key: Callable[[str], str] = lambda key: key) -> tuple[list[dict], dict[str, dict]]:
  """Schema rows, in ``row_keys`` order, with per-seed rows (``key@seed``) folded into one row.

  A folded row's EM/F1 are the means over seeds of its per-question scores (fractional per
  question), so its paired bootstrap compares the seed average; ``em_per_seed`` keeps each
  seed's EM. ``name(key)`` is the row's display name, ``out_key(key)`` its key in the file.

  Returns:
    ``(rows, per_example)``: the schema rows, and per output key ``{'ids', 'em', 'f1'}``
    arrays of the per-question scores (0-1) for :func:`bootstrap_rows`.
  """
  rows, per_example = [], {}
  for key in row_keys:
    seeded = sorted(((int(r.split('@')[1]), rec) for r, rec in records.items()
                     if r.split('@')[0] == key and '@' in r), key=lambda x: x[0])
    if seeded:
      seed_records = [rec for _, rec in seeded]
      ids = seed_records[0]['ids']
      if any(r['ids'] != ids for r in seed_records):
        raise RuntimeError(f'{key} rows of different seeds scored different questions')
      em = np.mean([r['em_per_example'] for r in seed_records], axis=0)
      f1 = np.mean([r['f1_per_example'] for r in seed_records], axis=0)
      rows.append({'key': out_key(key), 'name': name(key), 'em': 100.0 * float(em.mean()),
                   'f1': 100.0 * float(f1.mean()),
                   'tokens': float(np.mean([r['tokens'] for r in seed_records])), 'n': len(ids),
                   'seeds': [s for s, _ in seeded],
                   'em_per_seed': [r['em'] for r in seed_records],
                   'f1_per_seed': [r['f1'] for r in seed_records]})
      per_example[out_key(key)] = {'ids': ids, 'em': em, 'f1': f1}
    elif key in records and records[key]['n'] > 0:
      r = records[key]
      rows.append({'key': out_key(key), 'name': name(key), 'em': r['em'], 'f1': r['f1'],
                   'tokens': r['tokens'], 'n': r['n']})
      per_example[out_key(key)] = {'ids': r['ids'], 'em': np.asarray(r['em_per_example']),
                                   'f1': np.asarray(r['f1_per_example'])}
  return rows, per_example


def bootstrap_rows(per_example: dict[str, dict], metric: str, seed: int,
                   compared: Sequence[str] = ('trained',)) -> list[dict]:
  """Paired bootstrap of each ``compared`` row minus every other row, on the questions both
  scored (a pair of compared rows once, in ``compared`` order)."""
  out = []
  done = set()
  for key_a in compared:
    if key_a not in per_example:
      continue
    done.add(key_a)
    a = per_example[key_a]
    index_a = {q: i for i, q in enumerate(a['ids'])}
    for key, b in per_example.items():
      if key in done:
        continue
      shared = [(index_a[q], j) for j, q in enumerate(b['ids']) if q in index_a]
      if not shared:
        continue
      ia, ib = map(list, zip(*shared))
      result = qa_metrics.paired_bootstrap(a[metric][ia], b[metric][ib], seed=seed)
      out.append({'a': key_a, 'b': key, 'metric': metric, 'delta': 100 * result.diff,
                  'lo': 100 * result.low, 'hi': 100 * result.high, 'p_value': result.p_value,
                  'n': len(shared)})
  return out
