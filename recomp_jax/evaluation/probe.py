"""Reader EM / F1 on a few dev questions while a compressor trains (a TensorBoard probe).

A training stage selects its best checkpoint by its own dev signal (the extractive
compressor by the reader's log-likelihood of its top sentence, the fine-tuned models by
dev loss); what a researcher watches is whether the *reader* answers better. A
:class:`QaProbe` answers that at every evaluation: the current model's evidence for the
first ``n`` dev questions goes through the run's reader under the reader prompt protocol,
and ``qa_em`` / ``qa_f1`` (%) and ``qa_evidence_tokens`` join the stage's ``eval/*``
scalars. The probe only monitors: it never changes which checkpoint is kept, so it is not
part of any stage fingerprint.

Greedy decoding is deterministic, so answers are memoised per prompt: an evaluation whose
evidence did not change costs no generation.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from recomp_jax.data.schema import Example
from recomp_jax.evaluation import qa_metrics


class QaProbe:
  """EM / F1 of ``reader`` on fixed dev questions, given the evidence a model produces for them.

  Args:
    reader: a :class:`recomp_jax.reader.Reader` (or a zero-argument function returning one,
      called at the first evaluation, so a run with the probe off never loads it).
    examples: the probe questions (their ``question`` and gold ``answers``).
    build_prompt: ``(question, evidence) -> prompt`` (default: the reader's protocol prompt,
      :meth:`recomp_jax.reader.Reader.prompt`).
  """

  def __init__(self, reader, examples: Sequence[Example], *,
               build_prompt: Callable[[str, str], str] | None = None):
    self._reader = reader
    self.examples = list(examples)
    self._build_prompt = build_prompt
    self._answers: dict[str, str] = {}
    self.generated = 0  # prompts sent to the reader so far (memo misses)

  def __len__(self) -> int:
    return len(self.examples)

  @property
  def reader(self):
    if callable(self._reader) and not hasattr(self._reader, 'answer'):
      self._reader = self._reader()
    return self._reader

  def __call__(self, evidence: Sequence[str]) -> dict[str, float]:
    """Scores one evaluation.

    Args:
      evidence: ``[n]`` evidence text per probe question, in :attr:`examples` order.

    Returns:
      ``{'qa_em': %, 'qa_f1': %, 'qa_evidence_tokens': mean reader tokens of the evidence}``.
    """
    if len(evidence) != len(self.examples):
      raise ValueError(f'{len(evidence)} evidence texts for {len(self.examples)} probe questions')
    build = self._build_prompt or self.reader.prompt
    texts = [build(e.question, ev) for e, ev in zip(self.examples, evidence)]
    missing = list(dict.fromkeys(t for t in texts if t not in self._answers))
    if missing:
      self._answers.update(zip(missing, self.reader.answer(missing)))
      self.generated += len(missing)
    scores = qa_metrics.qa_scores([self._answers[t] for t in texts], [e.answers for e in self.examples])
    tokens = [self.reader.count_tokens(ev) for ev in evidence]
    return {'qa_em': float(scores['em']), 'qa_f1': float(scores['f1']),
            'qa_evidence_tokens': float(np.mean(tokens)) if tokens else 0.0}


def probe_examples(examples: Sequence[Example], n: int) -> list[Example]:
  """The first ``n`` examples (0: none): the probe's questions, fixed for a whole run."""
  return list(examples[:max(int(n), 0)])


__all__ = ['QaProbe', 'probe_examples']
