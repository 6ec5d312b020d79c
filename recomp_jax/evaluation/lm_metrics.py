"""Perplexity of WikiText windows with evidence prepended (the RECOMP language-modelling rows).

A row of the language-modelling task is one way of choosing the evidence put before each
window's prefix (nothing, the top-1 retrieved passage, a compressor's summary, ...). Its
number is the perplexity of the windows' scored tokens,

    ppl = exp(-sum_w log p(target_w | BOS, evidence_w, separator, prefix_w) / sum_w |target_w|),

pooled over all windows as In-Context RALM and RECOMP report it (not a mean of per-window
perplexities). The reader scores token ids, so the scored tokens are exactly those of
:func:`recomp_jax.data.wikitext.make_windows`; the evidence and separator are encoded apart
from the prefix.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from recomp_jax.data.wikitext import LMWindow
from recomp_jax.evaluation import qa_metrics

EVIDENCE_SEPARATOR = '\n\n'


def context_ids(tokenizer, evidence: str, prefix_ids: Sequence[int], *, max_context_tokens: int,
                separator: str = EVIDENCE_SEPARATOR) -> tuple[list[int], int]:
  """``BOS + ids(evidence) + ids(separator) + prefix`` (no evidence: ``BOS + prefix``).

  The prefix is the text being modelled and is kept whole; evidence that does not fit in
  ``max_context_tokens`` loses its beginning (documents are formatted best last, so the
  least relevant text goes first).

  Returns:
    ``(ids, evidence_tokens)``: the context, and how many evidence tokens it holds (the
    separator not counted).

  Raises:
    ValueError: when the prefix alone does not fit.
  """
  bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
  prefix = list(prefix_ids)
  if len(bos) + len(prefix) > max_context_tokens:
    raise ValueError(f'a prefix of {len(prefix)} tokens does not fit in a context of {max_context_tokens} '
                     'tokens (lm.max_prefix_tokens must be below lm.max_context_tokens)')
  if not evidence:
    return bos + prefix, 0
  sep = list(tokenizer(separator, add_special_tokens=False)['input_ids'])
  room = max_context_tokens - len(bos) - len(sep) - len(prefix)
  kept = list(tokenizer(evidence, add_special_tokens=False)['input_ids'])[-room:] if room > 0 else []
  if not kept:
    return bos + prefix, 0
  return bos + kept + sep + prefix, len(kept)


@dataclasses.dataclass
class WindowScores:
  """Per-window results of one row.

  Attributes:
    loglik: ``[N]`` summed log-probability of each window's target tokens.
    num_tokens: ``[N]`` target tokens per window.
    evidence_tokens: ``[N]`` evidence tokens in each context (after any cut; 0 for none).
  """
  loglik: np.ndarray
  num_tokens: np.ndarray
  evidence_tokens: np.ndarray

  @property
  def perplexity(self) -> float:
    return perplexity(self.loglik, self.num_tokens)


def score_windows(reader, windows: Sequence[LMWindow], evidence: Sequence[str], *,
                  max_context_tokens: int) -> WindowScores:
  """Scores every window's target tokens after its evidence and prefix with ``reader`` (a
  causal :class:`recomp_jax.reader.Reader`), batched through its sharded scorer."""
  if len(windows) != len(evidence):
    raise ValueError(f'{len(windows)} windows for {len(evidence)} evidence strings')
  if reader.is_seq2seq:
    raise ValueError('language-modelling perplexity needs a causal reader (Gemma), not a T5')
  contexts, lengths = [], []
  for w, e in zip(windows, evidence):
    ids, n = context_ids(reader.tokenizer, e, w.prefix_ids, max_context_tokens=max_context_tokens)
    contexts.append(ids)
    lengths.append(n)
  scores = reader.scorer.score_ids(contexts, [list(w.target_ids) for w in windows])
  return WindowScores(np.asarray(scores.total, np.float64), np.asarray(scores.num_tokens, np.int64),
                      np.asarray(lengths, np.int64))


def score_candidates(reader, windows: Sequence[LMWindow], candidates: Sequence[Sequence[str]], *,
                     max_context_tokens: int) -> list[WindowScores]:
  """Every candidate evidence of every window, scored in one batched call (RECOMP §3.1's LM
  labels and the sentence rows' choices read the same numbers).

  Args:
    candidates: per window its candidate evidence strings; a window without any is scored
      once with no evidence (``''``), so its choice is "nothing".

  Returns:
    One :class:`WindowScores` per window holding ``[C_w]`` arrays, ``C_w = max(1, len(candidates[w]))``.
  """
  if len(windows) != len(candidates):
    raise ValueError(f'{len(windows)} windows for {len(candidates)} candidate lists')
  flat_windows, flat_evidence, sizes = [], [], []
  for w, cands in zip(windows, candidates):
    cands = list(cands) or ['']
    flat_windows += [w] * len(cands)
    flat_evidence += cands
    sizes.append(len(cands))
  flat = score_windows(reader, flat_windows, flat_evidence, max_context_tokens=max_context_tokens)
  out, start = [], 0
  for n in sizes:
    part = slice(start, start + n)
    out.append(WindowScores(flat.loglik[part], flat.num_tokens[part], flat.evidence_tokens[part]))
    start += n
  return out


def perplexity(loglik: Sequence[float] | np.ndarray, num_tokens: Sequence[int] | np.ndarray) -> float:
  """Pooled perplexity ``exp(-sum(loglik) / sum(num_tokens))``."""
  total = float(np.sum(num_tokens))
  if total <= 0:
    raise ValueError('perplexity of no tokens')
  return float(np.exp(-float(np.sum(loglik)) / total))


@dataclasses.dataclass(frozen=True)
class PerplexityBootstrap:
  """``ppl(a) - ppl(b)`` and its percentile interval over resampled windows (lower ppl is better)."""
  delta: float
  lo: float
  hi: float
  p_value: float
  n: int


def paired_bootstrap_perplexity(a_loglik, b_loglik, num_tokens, *, n_resamples: int = 10_000,
                                confidence: float = 0.95, seed: int = 0,
                                chunk: int = 1_000) -> PerplexityBootstrap:
  """Resamples windows with replacement (both rows the same windows) and recomputes each
  row's pooled perplexity: the interval of ``ppl(a) - ppl(b)``; ``p_value`` is the two-sided
  share of resamples on the other side of 0."""
  a = np.asarray(a_loglik, np.float64)
  b = np.asarray(b_loglik, np.float64)
  t = np.asarray(num_tokens, np.float64)
  if not a.shape == b.shape == t.shape or a.ndim != 1 or a.size == 0:
    raise ValueError(f'need three equal-length non-empty 1-D arrays, got {a.shape}, {b.shape}, {t.shape}')

  def ppl_difference(idx: np.ndarray) -> np.ndarray:  # idx: [r, N] -> [r]
    tokens = np.maximum(t[idx].sum(axis=1), 1.0)
    return np.exp(-a[idx].sum(axis=1) / tokens) - np.exp(-b[idx].sum(axis=1) / tokens)

  lo, hi, p = qa_metrics.bootstrap_statistic(a.size, ppl_difference, n_resamples=n_resamples,
                                             confidence=confidence, seed=seed, chunk=chunk)
  return PerplexityBootstrap(perplexity(a, t) - perplexity(b, t), float(lo), float(hi), float(p), int(a.size))


__all__ = ['EVIDENCE_SEPARATOR', 'PerplexityBootstrap', 'WindowScores', 'context_ids',
           'paired_bootstrap_perplexity', 'perplexity', 'score_windows']
