"""RECOMP's abstractive compressor: the critic that turns teacher summaries into targets.

The compressor is distilled from a teacher LLM's query-focused summaries
(:mod:`recomp_jax.teacher`), filtered by what the summaries do for the reader
(RECOMP §3.2):

* QA (Fig. 7): with ``vs`` the reader's exact match given the summary and ``vd`` without
  retrieval, the target is the summary when ``vs >= vd`` and the empty summary when
  ``vs < vd`` (selective augmentation: prepend nothing). The paper also "filters out
  examples where prepending the summary does not lead to performance improvement"; an
  example where both are wrong gives no signal either way, so it is dropped (counted).
* LM (Fig. 3): the best of several prompts' summaries by the reader's score of the
  continuation, or the empty summary if it is worse than no retrieval.

Beyond the paper, ``n`` teacher samples per example can be judged: the best by
exact match, ties broken by the log-likelihood of the first gold answer (``n=1`` is
the paper). A teacher failure (error, refusal, empty completion) never becomes a
target: that example is dropped and counted.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from recomp_jax.data.schema import FilterReport
from recomp_jax.reader import prompts

KEEP, EMPTY, FILTERED = 'summary', 'empty', 'filtered'


def qa_decision(summary_em: float, none_em: float) -> str:
  """Fig. 7's rule for one example: ``'summary'``, ``'empty'`` or ``'filtered'``."""
  if summary_em < none_em:
    return EMPTY
  if summary_em == 0 and none_em == 0:
    return FILTERED
  return KEEP


def lm_decision(best_score: float, none_score: float) -> str:
  """Fig. 3's rule: the best summary unless it scores below no retrieval (higher is better)."""
  return EMPTY if best_score < none_score else KEEP


@dataclasses.dataclass(frozen=True)
class Target:
  """The critic's verdict for one example.

  Attributes:
    decision: ``'summary'`` (train on ``text``), ``'empty'`` (train on the empty
      summary) or ``'filtered'`` (not a training example).
    text: the target summary ('' for ``'empty'`` and ``'filtered'``).
    sample: which teacher sample was chosen (-1: none).
    summary_em, none_em: the reader's exact match with the chosen summary / without retrieval.
  """
  decision: str
  text: str
  sample: int
  summary_em: float
  none_em: float


def critic_qa(reader, questions: Sequence[str], answers: Sequence[Sequence[str]],
              summaries: Sequence[Sequence[str | None]], *,
              report: FilterReport | None = None, ids: Sequence[str] | None = None) -> list[Target]:
  """Fig. 7 over a batch: the reader answers with each summary and with none.

  Args:
    reader: a :class:`recomp_jax.reader.Reader` (``exact_match``, ``loglik``).
    questions, answers: per example.
    summaries: per example, the teacher's samples (None = that sample failed).
    report: counts of dropped examples by reason (``teacher_failed``, ``both_wrong``).
    ids: example ids for the report (default: positions).
  Returns:
    one :class:`Target` per example, in order.
  """
  report = report if report is not None else FilterReport('critic')
  ids = list(ids) if ids is not None else [str(i) for i in range(len(questions))]
  rows, owners = [], []
  for i, samples in enumerate(summaries):
    for j, text in enumerate(samples):
      if text:
        rows.append((i, j, prompts.build_prompt(questions[i], text)))
        owners.append(i)
  none_prompts = [prompts.build_prompt(q) for q in questions]
  scored = reader.exact_match(none_prompts + [p for _, _, p in rows],
                              list(answers) + [answers[i] for i in owners])
  em = np.asarray(scored['em_per_example'], np.float64)
  none_em, summary_em = em[:len(questions)], em[len(questions):]
  loglik = np.zeros(len(rows))
  multi = {i for i, count in collections.Counter(owners).items() if count > 1}
  if multi:  # tie-break between samples by the log-likelihood of the first gold answer
    picked = [k for k, (i, _, _) in enumerate(rows) if i in multi]
    values = reader.loglik(prompts.FEW_SHOT_PREFIX,
                           [rows[k][2][len(prompts.FEW_SHOT_PREFIX):] for k in picked],
                           [prompts.answer_target(answers[rows[k][0]][0]) for k in picked])
    loglik[picked] = np.asarray(values, np.float64)
  best: dict[int, int] = {}
  for k, (i, _, _) in enumerate(rows):
    if i not in best or (summary_em[k], loglik[k]) > (summary_em[best[i]], loglik[best[i]]):
      best[i] = k
  targets = []
  for i in range(len(questions)):
    if i not in best:
      report.drop('teacher_failed', ids[i])
      targets.append(Target(FILTERED, '', -1, 0.0, float(none_em[i])))
      continue
    k = best[i]
    decision = qa_decision(float(summary_em[k]), float(none_em[i]))
    if decision == FILTERED:
      report.drop('both_wrong', ids[i])
    else:
      report.keep()
    targets.append(Target(decision, summaries[i][rows[k][1]] if decision == KEEP else '',
                          rows[k][1], float(summary_em[k]), float(none_em[i])))
  return targets


def table5(targets: Sequence[Target]) -> dict:
  """RECOMP Table 5's columns: % of examples filtered and % of kept targets that are empty."""
  n = len(targets)
  kept = [t for t in targets if t.decision != FILTERED]
  return {'n': n, 'filtered_percent': 100.0 * (n - len(kept)) / n if n else 0.0,
          'empty_percent': 100.0 * sum(t.decision == EMPTY for t in kept) / len(kept) if kept else 0.0,
          'kept': len(kept)}


__all__ = ['EMPTY', 'FILTERED', 'KEEP', 'Target', 'critic_qa', 'lm_decision', 'qa_decision', 'table5']
