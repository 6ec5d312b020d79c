"""Where a compressor wins and loses: per-question analysis of a finished run's workdir.

    python -m recomp_jax.evaluation.analysis WORKDIR [--baseline top1]

Reads ``WORKDIR/predictions.jsonl`` (one line per question and row, written by the runner),
the test questions' answers and documents (``stages/retrieve/test.jsonl``) and their
candidate sentences (``stages/candidates/test.jsonl``), and prints a markdown table that
separates the compressor's two ways of failing:

* *selection*: the evidence does not contain a gold answer (``has_answer``: token match
  after SQuAD normalisation) although some candidate sentence does;
* *reading*: the evidence contains a gold answer and the reader still answers wrongly.

For each row: how often its evidence contains an answer, EM when it does and when it does
not, and per-question wins / losses (EM) against the baseline row. The ceiling of any
sentence selector is the share of questions with an answer in some candidate.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Iterator

from recomp_jax.data.formats import iter_jsonl
from recomp_jax.evaluation.qa_metrics import has_answer


def _jsonl(path: str) -> Iterator[dict]:
  """Records of a JSONL file; a bad line is a ``DataError`` naming file and line."""
  return (record for _, record in iter_jsonl(path))


def analyse(workdir: str, baseline: str = 'top1') -> dict:
  """Per-row statistics of ``workdir`` (see the module docstring).

  Returns ``{'n', 'answer_in_top1_document', 'answer_in_some_candidate', 'rows': [...]}``
  with fractions in ``[0, 1]``; each row: ``row, n, answer_in_evidence,
  em_with_answer, em_without_answer, wins, losses`` (vs ``baseline``).
  """
  stages = os.path.join(workdir, 'stages')
  predictions = collections.defaultdict(dict)
  for record in _jsonl(os.path.join(workdir, 'predictions.jsonl')):
    predictions[record['row']][record['id']] = record
  if baseline not in predictions:
    raise ValueError(f'{workdir}/predictions.jsonl has no {baseline!r} row '
                     f'(rows: {", ".join(sorted(predictions))})')
  questions = {q['id']: q for q in _jsonl(os.path.join(stages, 'retrieve', 'test.jsonl'))}
  candidates = {q['id']: q['candidates'] for q in _jsonl(os.path.join(stages, 'candidates', 'test.jsonl'))}
  ids = [i for i in predictions[baseline] if i in questions]
  if not ids:
    raise ValueError(f'{workdir}: no question of predictions.jsonl is in stages/retrieve/test.jsonl')
  answers = {i: questions[i]['answers'] for i in ids}
  in_top1 = [i for i in ids if questions[i]['ctxs'] and has_answer(questions[i]['ctxs'][0]['text'], answers[i])]
  in_candidates = [i for i in ids if any(has_answer(c, answers[i]) for c in candidates.get(i, ()))]
  base = predictions[baseline]
  rows = []
  for row, by_id in predictions.items():
    shared = [i for i in ids if i in by_id]
    if not shared:
      continue
    contains = {i for i in shared if has_answer(by_id[i]['evidence'], answers[i])}
    em = lambda group: (sum(by_id[i]['em'] for i in group) / len(group)) if group else float('nan')  # noqa: E731
    rows.append({'row': row, 'n': len(shared), 'answer_in_evidence': len(contains) / len(shared),
                 'em_with_answer': em(contains),
                 'em_without_answer': em([i for i in shared if i not in contains]),
                 'wins': sum(by_id[i]['em'] > base[i]['em'] for i in shared),
                 'losses': sum(by_id[i]['em'] < base[i]['em'] for i in shared)})
  return {'n': len(ids), 'baseline': baseline, 'answer_in_top1_document': len(in_top1) / len(ids),
          'answer_in_some_candidate': len(in_candidates) / len(ids), 'rows': rows}


def extra_table(result: dict) -> dict:
  """:func:`analyse`'s result as a ``results.json`` extra table (``{title, header, rows}``, percentages)."""
  pct = lambda x: '-' if x != x else 100.0 * x  # noqa: E731  (NaN -> '-')
  return {'title': (f"Where the evidence fails, per question ({result['n']} test questions; a gold answer "
                    f"is in the top-1 document for {100 * result['answer_in_top1_document']:.1f}% and in "
                    f"some candidate sentence for {100 * result['answer_in_some_candidate']:.1f}%)"),
          'header': ['row', 'answer in evidence (%)', 'EM, answer in evidence', 'EM, answer not in evidence',
                     f"wins vs {result['baseline']}", f"losses vs {result['baseline']}"],
          'rows': [[r['row'], pct(r['answer_in_evidence']), pct(r['em_with_answer']),
                    pct(r['em_without_answer']), r['wins'], r['losses']] for r in result['rows']]}


def markdown(result: dict) -> str:
  """The table :func:`analyse` describes, with percentages."""
  pct = lambda x: '-' if x != x else f'{100 * x:.1f}'  # noqa: E731  (NaN -> '-')
  lines = [f"{result['n']} test questions: a gold answer is in the top-1 document for "
           f"{pct(result['answer_in_top1_document'])}% and in some candidate sentence for "
           f"{pct(result['answer_in_some_candidate'])}% (the ceiling of sentence selection).", '',
           f"| row | n | answer in evidence (%) | EM, answer in evidence | EM, answer not in evidence "
           f"| wins vs {result['baseline']} | losses vs {result['baseline']} |",
           '|---|---|---|---|---|---|---|']
  for r in result['rows']:
    lines.append(f"| {r['row']} | {r['n']} | {pct(r['answer_in_evidence'])} | {pct(r['em_with_answer'])} | "
                 f"{pct(r['em_without_answer'])} | {r['wins']} | {r['losses']} |")
  return '\n'.join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('workdir')
  parser.add_argument('--baseline', default='top1', help='row to count wins and losses against')
  args = parser.parse_args(argv)
  try:
    print(markdown(analyse(args.workdir, args.baseline)))
  except (OSError, ValueError, KeyError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  sys.exit(main())
