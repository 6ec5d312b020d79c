"""Candidate sentences ranked by a dual encoder, and the top ``k`` of them as evidence.

The extractive compressor at inference (RECOMP §3.1), the off-the-shelf encoder rows of every
system, the shared head's dense re-ranking of given documents and the LM task's sentence row
all rank one question's candidates by the encoder's similarity to the question.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from recomp_jax.reader import prompts


def rank_candidates(encoder, questions: Sequence[str],
                    candidates: Sequence[Sequence[str]]) -> list[np.ndarray]:
  """Encoder similarity of every candidate to its question: per question ``[n_candidates]``."""
  q = encoder.encode_queries(list(questions))
  flat = [c for cands in candidates for c in cands]
  s = encoder.encode_passages(flat) if flat else np.zeros((0, q.shape[1]), np.float32)
  out, start = [], 0
  for i, cands in enumerate(candidates):
    out.append(s[start:start + len(cands)] @ q[i])
    start += len(cands)
  return out


def top_k_evidence(candidates: Sequence[str], scores: np.ndarray, k: int) -> str:
  """The ``k`` best candidates as evidence, best last (closest to the question)."""
  order = np.argsort(-np.asarray(scores), kind='stable')[:k]
  return prompts.format_sentences([candidates[j] for j in order])


def evidence_per_question(candidates: Sequence[Sequence[str]], scores: Sequence[np.ndarray], k: int) -> list[str]:
  """Per question, its ``k`` best-scoring candidates as evidence (``''`` for a question without candidates)."""
  return [top_k_evidence(c, s, k) if len(c) else '' for c, s in zip(candidates, scores)]


def compress(encoder, questions: Sequence[str], candidates: Sequence[Sequence[str]], k: int = 1) -> list[str]:
  """The compressor at inference: per question, its ``k`` best candidate sentences as evidence.

  ``candidates[i]`` are the title-prefixed sentences of question ``i``'s retrieved documents
  (every sentence at inference); a question without candidates gets ``''``.
  """
  return evidence_per_question(candidates, rank_candidates(encoder, questions, candidates), k)


__all__ = ['compress', 'evidence_per_question', 'rank_candidates', 'top_k_evidence']
