"""The reader's scores of candidate evidence: one row per (question, candidate sentence).

RECOMP's extractive labels (§3.1, Fig. 2 and 6), the abstractive system's reader-sentence
targets and FILCO's CXMI all ask the same question of the reader: how likely is the gold
answer (or is the greedy answer correct) with this candidate prepended? Every row shares the
few-shot prefix (the reader's ``few_shot``), which :meth:`recomp_jax.reader.Reader.loglik`
encodes once per call.
"""

from __future__ import annotations

from typing import Sequence

from recomp_jax.reader import prompts


def candidate_suffix(candidate: str, question: str) -> str:
  """The part of the reader prompt after the shared few-shot prefix (whichever that is)."""
  return prompts.build_prompt(question, candidate, few_shot='')


def loglik_labels(reader, questions: Sequence[str], candidates: Sequence[Sequence[str]],
                  answers: Sequence[Sequence[str]]) -> list[dict]:
  """Reader log-likelihood of the first gold answer with each candidate (and with none).

  All rows share the few-shot prefix, which ``reader`` (a :class:`recomp_jax.reader.Reader`)
  encodes once per call.

  Returns:
    per question ``{'loglik': [n_candidates] floats, 'none_loglik': float}``.
  """
  suffixes, targets, owners = [], [], []
  for i, (question, cands, golds) in enumerate(zip(questions, candidates, answers)):
    target = prompts.answer_target(golds[0])
    for cand in cands:
      suffixes.append(candidate_suffix(cand, question))
      targets.append(target)
      owners.append(i)
    suffixes.append(prompts.build_prompt(question, few_shot=''))
    targets.append(target)
    owners.append(i)
  scores = reader.loglik(reader.few_shot, suffixes, targets)
  out = [{'loglik': []} for _ in questions]
  per_question = [[] for _ in questions]
  for owner, value in zip(owners, scores):
    per_question[owner].append(float(value))
  for record, values in zip(out, per_question):
    record['loglik'], record['none_loglik'] = values[:-1], values[-1]
  return out


def em_labels(reader, questions: Sequence[str], candidates: Sequence[Sequence[str]],
              answers: Sequence[Sequence[str]], *, max_new_tokens: int | None = None
              ) -> list[list[float]]:
  """Exact match (any gold answer) of the reader's greedy answer with each candidate (Fig. 6).

  ``max_new_tokens`` None uses the reader's own limit (``config.reader.max_new_tokens``).
  """
  flat_prompts, flat_answers, owners = [], [], []
  for i, (question, cands) in enumerate(zip(questions, candidates)):
    for cand in cands:
      flat_prompts.append(reader.prompt(question, cand))
      flat_answers.append(answers[i])
      owners.append(i)
  scores = reader.exact_match(flat_prompts, flat_answers, max_new_tokens=max_new_tokens)
  out = [[] for _ in questions]
  for owner, em in zip(owners, scores['em_per_example'].tolist()):
    out[owner].append(float(em))
  return out


__all__ = ['candidate_suffix', 'em_labels', 'loglik_labels']
