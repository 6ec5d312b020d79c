"""Answer scoring of the NQ reader protocol, answer-string checks, and paired bootstrap.

* :func:`normalize_answer` -- SQuAD v1.1 normalisation: lowercase, drop
  ``string.punctuation``, drop the articles a/an/the, collapse whitespace.
* :func:`exact_match`, :func:`f1_score` -- maximum over the gold answers.
* :func:`has_answer` -- whether an answer occurs in a passage as a whole-token
  sequence; it reproduces the ``has_answer`` flags of ``../shared/data`` (checked
  on all 42,100 train passages).
* :func:`paired_bootstrap` -- percentile CI of the mean difference between two
  systems scored on the same examples (vectorised NumPy, seeded).
* :func:`mean_tokens`, :func:`token_ratio` -- evidence-length summaries.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import string
from typing import Callable, Iterable, Sequence

import numpy as np

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r'\b(a|an|the)\b')
_PUNCT_TABLE = str.maketrans({c: ' ' for c in string.punctuation})


def normalize_answer(s: str) -> str:
  """SQuAD normalisation: ``'The  Quick, Brown fox!'`` -> ``'quick brown fox'``."""
  s = s.lower()
  s = ''.join(ch for ch in s if ch not in _PUNCT)
  s = _ARTICLES.sub(' ', s)
  return ' '.join(s.split())


def _as_list(answers: str | Sequence[str]) -> list[str]:
  return [answers] if isinstance(answers, str) else list(answers)


def exact_match(prediction: str, answers: str | Sequence[str]) -> float:
  """1.0 when the normalised prediction equals any normalised gold answer, else 0.0."""
  pred = normalize_answer(prediction)
  return float(any(pred == normalize_answer(a) for a in _as_list(answers)))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
  if not pred_tokens or not gold_tokens:
    return float(pred_tokens == gold_tokens)
  common = collections.Counter(pred_tokens) & collections.Counter(gold_tokens)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision = same / len(pred_tokens)
  recall = same / len(gold_tokens)
  return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, answers: str | Sequence[str]) -> float:
  """Token F1 of the normalised strings, maximum over gold answers.

  An empty normalised prediction scores 1.0 only against an empty gold answer
  (SQuAD v2 convention; SQuAD v1.1 gives 0 to both-empty, which never happens with
  real gold answers).
  """
  pred = normalize_answer(prediction).split()
  return max((_f1(pred, normalize_answer(a).split()) for a in _as_list(answers)), default=0.0)


def _match_tokens(s: str) -> list[str]:
  """SQuAD normalisation with punctuation turned into spaces ("Eminem's" -> eminem s)."""
  s = s.lower().translate(_PUNCT_TABLE)
  return _ARTICLES.sub(' ', s).split()


def has_answer(text: str, answers: str | Sequence[str]) -> bool:
  """Whether any answer occurs in ``text`` as a contiguous token sequence.

  Both sides are lower-cased, punctuation becomes whitespace and a/an/the are dropped,
  so 'Brad Johnson' is found in "quarterback Brad Johnson's pass" but '2003' is not in
  '2003–04' (the en dash is not ASCII punctuation) and 'Orwell' is not in 'narrator—Orwell'.
  """
  tokens = _match_tokens(text)
  padded = ' ' + ' '.join(tokens) + ' '
  for a in _as_list(answers):
    a_tokens = _match_tokens(a)
    if a_tokens and ' ' + ' '.join(a_tokens) + ' ' in padded:
      return True
  return False


def qa_scores(predictions: Sequence[str], answers: Sequence[Sequence[str]]) -> dict[str, float]:
  """Per-example EM and F1 arrays and their means in percent.

  Returns:
    ``{'em': float %, 'f1': float %, 'n': int, 'em_per_example': [N], 'f1_per_example': [N]}``.
  """
  if len(predictions) != len(answers):
    raise ValueError(f'{len(predictions)} predictions for {len(answers)} answer lists')
  em = np.array([exact_match(p, a) for p, a in zip(predictions, answers)], dtype=np.float64)
  f1 = np.array([f1_score(p, a) for p, a in zip(predictions, answers)], dtype=np.float64)
  n = len(predictions)
  return {'em': 100.0 * em.mean() if n else 0.0, 'f1': 100.0 * f1.mean() if n else 0.0, 'n': n,
          'em_per_example': em, 'f1_per_example': f1}


# ----------------------------------------------------------------------------- bootstrap


@dataclasses.dataclass(frozen=True)
class BootstrapResult:
  """Paired bootstrap of ``mean(a) - mean(b)``.

  Attributes:
    diff: observed mean difference.
    low, high: percentile confidence interval bounds.
    confidence: e.g. 0.95.
    p_value: two-sided bootstrap p-value for 'no difference'
      (``2 * min(P*(d <= 0), P*(d >= 0))``, capped at 1).
    n: number of paired examples.
    n_resamples: bootstrap resamples.
  """
  diff: float
  low: float
  high: float
  confidence: float
  p_value: float
  n: int
  n_resamples: int

  def covers(self, value: float) -> bool:
    return self.low <= value <= self.high


def bootstrap_statistic(n: int, statistic: Callable[[np.ndarray], np.ndarray], *,
                        n_resamples: int = 10_000, confidence: float = 0.95, seed: int = 0,
                        chunk: int = 1_000) -> tuple[float, float, float]:
  """Percentile interval of a statistic over ``n`` paired examples resampled with replacement.

  Args:
    n: number of paired examples ``N``.
    statistic: maps a ``[r, N]`` block of example indices (one resample per row) to the ``[r]``
      statistics of those resamples, e.g. ``lambda idx: d[idx].mean(axis=1)``.
    n_resamples: bootstrap resamples ``R``.
    confidence: CI mass.
    seed: NumPy generator seed; the result is a pure function of the inputs and seed.
    chunk: resamples drawn per ``[chunk, N]`` index block (bounds memory).

  Returns:
    ``(low, high, p_value)``: the interval bounds and the two-sided bootstrap p-value of
    'the statistic is 0', ``2 * min(P*(s <= 0), P*(s >= 0))`` capped at 1.
  """
  if n <= 0:
    raise ValueError(f'need at least one example, got {n}')
  if not 0.0 < confidence < 1.0:
    raise ValueError(f'confidence must be in (0, 1), got {confidence}')
  rng = np.random.default_rng(seed)
  samples = np.empty(n_resamples, dtype=np.float64)
  for start in range(0, n_resamples, chunk):
    r = min(chunk, n_resamples - start)
    samples[start:start + r] = statistic(rng.integers(0, n, size=(r, n)))
  alpha = 1.0 - confidence
  low, high = np.quantile(samples, [alpha / 2, 1 - alpha / 2])
  p = min(1.0, 2.0 * min(np.mean(samples <= 0), np.mean(samples >= 0)))
  return float(low), float(high), float(p)


def paired_bootstrap(a: Sequence[float] | np.ndarray, b: Sequence[float] | np.ndarray, *,
                     n_resamples: int = 10_000, confidence: float = 0.95, seed: int = 0,
                     chunk: int = 1_000) -> BootstrapResult:
  """Percentile CI of ``mean(a - b)`` by resampling examples with replacement.

  Args:
    a, b: ``[N]`` per-example scores of two systems on the same examples (e.g. EM in {0, 1}).
    n_resamples, confidence, seed, chunk: as :func:`bootstrap_statistic`.
  """
  d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
  if d.ndim != 1 or d.size == 0:
    raise ValueError(f'a and b must be equal-length non-empty 1-D, got shape {d.shape}')
  low, high, p = bootstrap_statistic(d.size, lambda idx: d[idx].mean(axis=1), n_resamples=n_resamples,
                                     confidence=confidence, seed=seed, chunk=chunk)
  return BootstrapResult(float(d.mean()), low, high, confidence, p, d.size, n_resamples)


# ----------------------------------------------------------------------------- lengths


def mean_tokens(counts: Iterable[int]) -> float:
  """Mean evidence length (0.0 for no examples)."""
  arr = np.fromiter(counts, dtype=np.float64)
  return float(arr.mean()) if arr.size else 0.0


def token_ratio(compressed: Iterable[int], original: Iterable[int]) -> float:
  """``sum(compressed) / sum(original)``: the fraction of evidence tokens kept.

  RECOMP's "compression to 6% of the tokens" is this ratio; its inverse is the
  compression rate (e.g. 16.7x).
  """
  c = np.fromiter(compressed, dtype=np.float64)
  o = np.fromiter(original, dtype=np.float64)
  if c.shape != o.shape:
    raise ValueError(f'{c.size} compressed counts for {o.size} original counts')
  total = o.sum()
  return float(c.sum() / total) if total > 0 else 0.0
