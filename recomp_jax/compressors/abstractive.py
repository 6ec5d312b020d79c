"""RECOMP's abstractive compressor: the critic that turns teacher summaries into targets.

The compressor is distilled from a teacher LLM's query-focused summaries
(:mod:`recomp_jax.teacher`), filtered by what the summaries do for the reader
(RECOMP §3.2):

* QA (Fig. 7): with ``vs`` the reader's exact match given the summary and ``vd`` without
  retrieval, the target is the summary when ``vs >= vd`` and the empty summary when
  ``vs < vd`` (selective augmentation: prepend nothing). The paper also "filters out
  examples where prepending the summary does not lead to performance improvement"; an
  example where both are wrong gives no signal either way, so it is dropped (counted).
  Beyond the paper, ``both_wrong='loglik'`` decides those examples by the reader's
  log-likelihood of the first gold answer instead (summary if it is not below no retrieval,
  else empty): with a weak reader (the 270M Gemma answers most NQ questions wrongly either
  way) the paper's rule leaves almost no training targets.
* LM (Fig. 3): the best of several prompts' summaries by the reader's score of the
  continuation, or the empty summary if it is worse than no retrieval.

Beyond the paper, ``n`` teacher samples per example can be judged: the best by
exact match, ties broken by the log-likelihood of the first gold answer (``n=1`` is
the paper). A teacher failure (error, refusal, empty completion) never becomes a
target: that example is dropped and counted.

Also beyond the paper, :func:`reader_best_sentences` gives the critic another candidate
target when no teacher can summarise (the PyPI Gemma 3 270M base model rarely puts a gold
answer in its NQ summaries: docs/results/abstractive.md): the sentence of the top documents
under which the reader gives the first gold answer the highest log-likelihood, i.e. the positive
of the extractive compressor's labelling (RECOMP §3.1). The compressor then learns a
reader-distilled, one-sentence summary; the critic keeps or empties it by Fig. 7's rule.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Sequence

import numpy as np

from recomp_jax.data.schema import FilterReport, Passage
from recomp_jax.models import generation
from recomp_jax.pretrained import load_pretrained
from recomp_jax.reader import candidate_scores, prompts
from recomp_jax.training.finetune import fit_prompt
from recomp_jax.training.objectives import is_seq2seq

KEEP, EMPTY, FILTERED = 'summary', 'empty', 'filtered'

# The compressor's input (RECOMP §3.2, the T5 compressor's): documents in retrieval order.
COMPRESSOR_PROMPT = 'Question: {query}\n Document: {docs}\n Summary:'


def documents_text(passages: Sequence[Passage]) -> str:
  """The ``{docs}`` of the teacher and compressor prompts: ``'{title}\n{text}'`` per
  document, best first, joined by newlines."""
  return '\n'.join(f'{p.title}\n{p.text}' for p in passages)


def compressor_prompt(question: str, docs: str) -> str:
  """:data:`COMPRESSOR_PROMPT` filled in (the literal braces of the texts stay as they are)."""
  return prompts.fill(COMPRESSOR_PROMPT, docs=docs, query=question)


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


BOTH_WRONG = ('drop', 'loglik')


def critic_qa(reader, questions: Sequence[str], answers: Sequence[Sequence[str]],
              summaries: Sequence[Sequence[str | None]], *,
              report: FilterReport | None = None, ids: Sequence[str] | None = None,
              both_wrong: str = 'drop') -> list[Target]:
  """Fig. 7 over a batch: the reader answers with each summary and with none.

  Args:
    reader: a :class:`recomp_jax.reader.Reader` (``prompt``, ``few_shot``, ``exact_match``, ``loglik``).
    questions, answers: per example.
    summaries: per example, the teacher's samples (None = that sample failed).
    report: counts of dropped examples by reason (``teacher_failed``, ``both_wrong``).
    ids: example ids for the report (default: positions).
    both_wrong: ``'drop'`` (the paper) or ``'loglik'``: when the reader is wrong with the
      summary and without retrieval, keep the summary if the gold answer's log-likelihood
      with it is not below that without retrieval, else the empty summary.
  Returns:
    one :class:`Target` per example, in order.
  """
  report = report if report is not None else FilterReport('critic')
  ids = list(ids) if ids is not None else [str(i) for i in range(len(questions))]
  rows, owners = [], []
  for i, samples in enumerate(summaries):
    for j, text in enumerate(samples):
      if text:
        rows.append((i, j, reader.prompt(questions[i], text)))
        owners.append(i)
  none_prompts = [reader.prompt(q) for q in questions]
  prefix = len(reader.few_shot)
  scored = reader.exact_match(none_prompts + [p for _, _, p in rows],
                              list(answers) + [answers[i] for i in owners])
  em = np.asarray(scored['em_per_example'], np.float64)
  none_em, summary_em = em[:len(questions)], em[len(questions):]
  loglik = np.zeros(len(rows))
  multi = {i for i, count in collections.Counter(owners).items() if count > 1}
  if multi:  # tie-break between samples by the log-likelihood of the first gold answer
    picked = [k for k, (i, _, _) in enumerate(rows) if i in multi]
    values = reader.loglik(reader.few_shot, [rows[k][2][prefix:] for k in picked],
                           [prompts.answer_target(answers[rows[k][0]][0]) for k in picked])
    loglik[picked] = np.asarray(values, np.float64)
  best: dict[int, int] = {}
  for k, (i, _, _) in enumerate(rows):
    if i not in best or (summary_em[k], loglik[k]) > (summary_em[best[i]], loglik[best[i]]):
      best[i] = k
  by_loglik: dict[int, str] = {}
  if both_wrong == 'loglik':
    undecided = [i for i, k in best.items() if summary_em[k] == 0 and none_em[i] == 0]
    if undecided:
      values = np.asarray(reader.loglik(
          reader.few_shot,
          [rows[best[i]][2][prefix:] for i in undecided] + [none_prompts[i][prefix:] for i in undecided],
          [prompts.answer_target(answers[i][0]) for i in undecided] * 2), np.float64)
      for i, with_summary, without in zip(undecided, values[:len(undecided)], values[len(undecided):]):
        by_loglik[i] = KEEP if with_summary >= without else EMPTY
  elif both_wrong != 'drop':
    raise ValueError(f'both_wrong must be one of {BOTH_WRONG}, got {both_wrong!r}')
  targets = []
  for i in range(len(questions)):
    if i not in best:
      report.drop('teacher_failed', ids[i])
      targets.append(Target(FILTERED, '', -1, 0.0, float(none_em[i])))
      continue
    k = best[i]
    decision = by_loglik.get(i) or qa_decision(float(summary_em[k]), float(none_em[i]))
    if decision == FILTERED:
      report.drop('both_wrong', ids[i])
    else:
      report.keep()
    targets.append(Target(decision, summaries[i][rows[k][1]] if decision == KEEP else '',
                          rows[k][1], float(summary_em[k]), float(none_em[i])))
  return targets


def critic_lm(reader, prefixes: Sequence[str], continuations: Sequence[str],
              summaries: Sequence[Sequence[str | None]]) -> list[Target]:
  """Fig. 3 over a batch (language modelling): the best summary by the reader's
  log-likelihood of the gold continuation, or the empty summary when even the best
  scores below no retrieval.

  Args:
    reader: a :class:`recomp_jax.reader.Reader`.
    prefixes: per example, the text the reader continues (the LM input ``x``).
    continuations: per example, the gold continuation ``y`` that is scored.
    summaries: per example, one summary per teacher prompt (or sample); None = failed.
  Returns:
    one :class:`Target` per example (``summary_em`` / ``none_em`` hold the summed
    log-likelihoods here); an example whose summaries all failed is ``'filtered'``.
  """
  rows = [(i, j, f'{text}\n\n{prefixes[i]}') for i, samples in enumerate(summaries)
          for j, text in enumerate(samples) if text]
  texts = list(prefixes) + [r[2] for r in rows]
  targets_ = list(continuations) + [continuations[i] for i, _, _ in rows]
  scores = np.asarray(reader.loglik('', texts, targets_), np.float64)
  none, with_summary = scores[:len(prefixes)], scores[len(prefixes):]
  per_example: list[list[float | None]] = [[None] * len(samples) for samples in summaries]
  for k, (i, j, _) in enumerate(rows):
    per_example[i][j] = float(with_summary[k])
  return [critic_lm_scored(samples, sample_scores, float(n))
          for samples, sample_scores, n in zip(summaries, per_example, none)]


def critic_lm_scored(summaries: Sequence[str | None], scores: Sequence[float | None], none_score: float) -> Target:
  """Fig. 3 for one example whose reader scores are known: the best summary (the first of equals)
  by its score, or the empty summary when it scores below no retrieval; ``'filtered'`` when every
  summary failed (None or '').

  Args:
    summaries: the candidate summaries (teacher prompts or samples); None = failed.
    scores: the reader's log-likelihood of the gold continuation with each summary prepended
      (None where the summary failed).
    none_score: the same without retrieval.
  """
  ok = [j for j, text in enumerate(summaries) if text and scores[j] is not None]
  if not ok:
    return Target(FILTERED, '', -1, float('-inf'), float(none_score))
  best = max(ok, key=lambda j: (scores[j], -j))
  decision = lm_decision(float(scores[best]), float(none_score))
  return Target(decision, summaries[best] if decision == KEEP else '', best, float(scores[best]), float(none_score))


TARGET_SOURCES = ('teacher', 'reader_sentence')


def reader_best_sentences(reader, questions: Sequence[str], candidates: Sequence[Sequence[str]],
                          answers: Sequence[Sequence[str]]) -> list[dict]:
  """Beyond the paper: per question, the candidate sentence the reader finds most useful.

  Each candidate is scored as in the extractive labelling
  (:func:`recomp_jax.reader.candidate_scores.loglik_labels`: log p(first gold answer |
  candidate, question) under the few-shot reader prompt) and the best one (the first of
  equals) is the question's target for the critic, in place of a teacher summary.

  Returns:
    per question ``{'sentence': str | None, 'loglik': float | None, 'none_loglik': float,
    'candidates': int}``; ``sentence`` is None when the question has no candidate.
  """
  labels = candidate_scores.loglik_labels(reader, questions, candidates, answers)
  out = []
  for cands, label in zip(candidates, labels):
    best = int(np.argmax(label['loglik'])) if len(cands) else -1
    out.append({'sentence': cands[best] if best >= 0 else None,
                'loglik': float(label['loglik'][best]) if best >= 0 else None,
                'none_loglik': float(label['none_loglik']), 'candidates': len(cands)})
  return out


def oracle_choice(summary_em: float, none_em: float) -> bool:
  """A.5's oracle: prepend the teacher summary (True) or nothing (False), chosen with the
  gold answer by the critic's rule (the summary unless it does worse than nothing)."""
  return summary_em >= none_em


def selective_augmentation_f1(predicted_empty: Sequence[bool], oracle_empty: Sequence[bool]) -> dict:
  """A.5.2: selective augmentation as binary classification, "empty" the positive class.

  Returns ``{'f1', 'precision', 'recall', 'oracle_empty_rate', 'random_f1'}``;
  ``random_f1`` is the expected F1 of outputting empty at random at the oracle's rate
  (precision and recall both equal that rate).
  """
  p = np.asarray(predicted_empty, bool)
  o = np.asarray(oracle_empty, bool)
  tp = float(np.sum(p & o))
  precision = tp / p.sum() if p.sum() else 0.0
  recall = tp / o.sum() if o.sum() else 0.0
  f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
  rate = float(o.mean()) if len(o) else 0.0
  return {'f1': f1, 'precision': precision, 'recall': recall, 'oracle_empty_rate': rate,
          'random_f1': rate}


STOPWORDS = frozenset("""a an and are as at be been but by can did do does for from had has have he her
his how i if in into is it its may more most no not of on or our she so such than that the their them
then there these they this those to was we were what when where which while who whom whose why will
with would you your also about after all any because before between both during each few other over
same some only own under until up very""".split())


def content_words(text: str) -> list[str]:
  """Lower-cased word tokens of ``text`` that are not stopwords (numbers count as words)."""
  return [w for w in re.findall(r"[\w']+", text.lower()) if w not in STOPWORDS]


def faithfulness_aid(summary: str, documents: str) -> float | None:
  """Share of the summary's content words that occur in the documents (None for an empty
  summary): a cheap flag for hallucinated content, not a faithfulness judgement."""
  words = content_words(summary)
  if not words:
    return None
  vocabulary = set(content_words(documents))
  return sum(w in vocabulary for w in words) / len(words)


def table5(targets: Sequence[Target]) -> dict:
  """RECOMP Table 5's columns: % of examples filtered and % of kept targets that are empty."""
  n = len(targets)
  kept = [t for t in targets if t.decision != FILTERED]
  return {'n': n, 'filtered_percent': 100.0 * (n - len(kept)) / n if n else 0.0,
          'empty_percent': 100.0 * sum(t.decision == EMPTY for t in kept) / len(kept) if kept else 0.0,
          'kept': len(kept)}


# ----------------------------------------------------------------------------- inference


def fit_documents(tokenizer, question: str, passages, budget: int) -> tuple[str, bool]:
  """The compressor prompt of ``question`` over ``passages`` in at most ``budget`` tokens.

  When too long, the documents text loses its end (the question, at the start, is kept).
  Returns ``(prompt, truncated)``; the same cut is made in training and at inference.
  """
  return fit_prompt(tokenizer, lambda docs: compressor_prompt(question, docs),
                    documents_text(passages), budget)


class Compressor:
  """A trained abstractive compressor at inference: question + documents -> summary ('' = nothing).

  Greedy decoding up to ``max_new_tokens``; generation ends at EOS (an immediate EOS is the
  empty summary of selective augmentation). ``empty_threshold`` 0 is the paper's plain greedy
  decoding; above 0 the summary is empty iff the model's probability of stopping at once is at
  least that (:class:`recomp_jax.models.generation.SamplingConfig`): a small compressor trained
  with a third of its targets empty otherwise writes nothing for every question, because no
  single first word is as likely as stopping.
  """

  def __init__(self, model, tokenizer, *, max_source_length: int, max_new_tokens: int, batch_size: int = 8,
               empty_threshold: float = 0.0, top_docs: int | None = None):
    cls = generation.T5Generator if is_seq2seq(model) else generation.GemmaGenerator
    self.tokenizer = tokenizer
    self.generator = cls(model, tokenizer, batch_size=batch_size)
    self.max_source_length = max_source_length
    self.max_new_tokens = max_new_tokens
    self.empty_threshold = empty_threshold
    self.top_docs = top_docs  # None: every passage it is given (the pipeline cuts them itself)

  @classmethod
  def load(cls, directory: str, **kwargs) -> 'Compressor':
    pretrained = load_pretrained(directory)
    return cls(pretrained.model, pretrained.tokenizer(), **kwargs)

  def compress(self, questions: Sequence[str], passages: Sequence[Sequence[Passage]]) -> list[str]:
    """One summary per question of its passages ('' = the compressor chose to say nothing)."""
    inputs = [fit_documents(self.tokenizer, q, list(p)[:self.top_docs], self.max_source_length)[0]
              for q, p in zip(questions, passages)]
    texts = self.generator(inputs, max_new_tokens=self.max_new_tokens, stop_strings=(),
                           empty_threshold=self.empty_threshold)
    return [t.strip() for t in texts]


def export_spec(model_dir: str, *, top_docs: int, max_source_length: int, max_new_tokens: int,
                empty_threshold: float, batch_size: int) -> dict:
  """The ``compressor.json`` fields of a trained abstractive compressor (see :func:`load`)."""
  return {'system': 'abstractive', 'model': model_dir, 'top_docs': top_docs, 'max_source_length': max_source_length,
          'max_new_tokens': max_new_tokens, 'empty_threshold': empty_threshold, 'batch_size': batch_size}


def load(spec: dict) -> 'Compressor':
  """The compressor an :func:`export_spec` describes (paths already resolved)."""
  return Compressor.load(spec['model'], max_source_length=spec['max_source_length'],
                         max_new_tokens=spec['max_new_tokens'], empty_threshold=spec['empty_threshold'],
                         top_docs=spec['top_docs'], batch_size=spec['batch_size'])


__all__ = ['COMPRESSOR_PROMPT', 'EMPTY', 'FILTERED', 'KEEP', 'STOPWORDS', 'Target', 'compressor_prompt',
           'BOTH_WRONG', 'content_words', 'critic_lm', 'critic_lm_scored', 'critic_qa', 'documents_text', 'faithfulness_aid', 'lm_decision',
           'oracle_choice', 'qa_decision', 'reader_best_sentences', 'selective_augmentation_f1', 'TARGET_SOURCES',
           'table5', 'Compressor', 'export_spec', 'fit_documents', 'load']
