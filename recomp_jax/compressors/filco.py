"""FILCO (Wang et al., 2023): filter retrieved passages to the one sentence that helps.

§2.2, the three measures that pick the silver context ``t_silver`` of a training example
(one best sentence, "as it outperforms multi-span filtering"):

* **STRINC** (:func:`strinc`): whether a sentence contains the output string; the first
  such sentence in ranked order (passage rank, then reading order) is selected;
* **LEXICAL** (:func:`unigram_f1`): word-unigram F1 between the sentence and the output
  (the query, for fact verification); the best sentence with F1 above ``λ = 0.5``;
* **CXMI** (:func:`cxmi_scores`): ``log p(o | t ⊕ q) − log p(o | q)`` under the generator
  (here: the run's reader, through the sharded scorer the extractive labelling uses,
  :func:`recomp_jax.reader.candidate_scores.loglik_labels`), in log space; the best
  sentence above ``λ = 0`` (the paper's ratio ``p(o|t⊕q) / p(o|q)`` above 1).

A question with no sentence passing the measure (the output occurs nowhere, no sentence,
no answer) gets the empty context: the filter model learns to output nothing and the
generator then reads the question alone. Such questions are counted, never dropped.

§2.3-2.4: the filter model ``M_ctx`` learns ``q ⊕ P -> t_silver``
(:func:`filter_prompt`); the generator ``M_gen`` learns ``t ⊕ q -> o`` on the silver
context (:func:`generator_prompt`) and at test time reads the filter model's *own*
predictions. §4.2's PSG baseline keeps or drops whole passages
(:func:`passage_prompt`, a yes/no decision per passage).

Beyond the paper, :func:`ranked_filter` decodes the filter model under the constraint its
training targets obey (one sentence of the passages, or nothing): every such output is
scored whole and the most likely is kept, where free decoding may drift from the passage or
commit to a wrong sentence on its first token. The pipeline reports both.

Variants (``filco.variant``): ``'paper'`` (default) is the above. ``'released'`` is what the
authors' code (github.com/zorazrw/filco) computes instead, offered for comparison:

* STRINC is a case-insensitive raw substring test (``'art' in 'party'`` passes) and *every*
  sentence containing the answer is kept, joined by spaces;
* the "unigram F1" is computed over the *characters* of the normalised strings;
* exact match keeps punctuation (its normalisation drops only case, articles and spacing);
* CXMI is ``sigmoid(-log(prod p_base / prod p_ctx))`` from raw probability products
  (which underflow to ``nan`` for long outputs) and the top sentence of every passage is
  kept when its score is ``>= 0``, a threshold that never filters;
* LEXICAL scores a sentence against *every* gold answer and keeps the best (``calc_unigram_f1``
  of ``eval.py``), where the paper compares with the output;
* a generator whose filtered context is empty reads the top-1 passage's text instead
  (``get_example_io`` of ``get_inputs.py`` falls back to ``get_context``, one passage, no title):
  :func:`filtered_context`.

The first release's STRINC selection tested ``is True`` on a float and so never selected a
sentence; its commit f2e60f2 ("fix strinc processing") fixed that, and the variant follows the
fixed code.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Sequence

import numpy as np

from recomp_jax.data.schema import Example, Passage
from recomp_jax.data.sentences import split_sentences
from recomp_jax.evaluation import qa_metrics
from recomp_jax.reader import Reader, prompts
from recomp_jax.reader.candidate_scores import loglik_labels
from recomp_jax.training.finetune import fit_prompt

MEASURES = ('strinc', 'lexical', 'cxmi')
VARIANTS = ('paper', 'released')
LEXICAL_THRESHOLD = 0.5  # §2.2, footnote 3
CXMI_THRESHOLD = 0.0  # log space: the paper's ratio above 1 (footnote 4)

# The filter model's input (q ⊕ P) and the PSG model's per-passage decision.
FILTER_PROMPT = 'Question: {query}\nPassage: {passage}\nMost helpful sentence:'
PASSAGE_PROMPT = 'Question: {query}\nPassage: {passage}\nDoes the passage help answer the question?'
KEEP_WORD, DROP_WORD = ' yes', ' no'


def _check_variant(variant: str) -> None:
  if variant not in VARIANTS:
    raise ValueError(f'filco variant must be one of {VARIANTS}, got {variant!r}')


# ----------------------------------------------------------------------------- text measures


def _released_normalize(text: str) -> str:
  """The released code's normalisation: lower case, articles dropped, spacing fixed (punctuation kept)."""
  text = re.sub(r'\b(a|an|the)\b', ' ', text.lower())
  return ' '.join(text.split())


def strinc(sentence: str, outputs: Sequence[str], variant: str = 'paper') -> bool:
  """Whether ``sentence`` contains any of ``outputs``.

  paper: as a whole-token sequence after SQuAD normalisation
  (:func:`recomp_jax.evaluation.qa_metrics.has_answer`); released: a case-insensitive raw
  substring.
  """
  _check_variant(variant)
  if variant == 'released':
    return any(o.lower() in sentence.lower() for o in outputs)
  return qa_metrics.has_answer(sentence, list(outputs))


def _f1_counts(pred: Sequence[str], gold: Sequence[str]) -> float:
  if not pred or not gold:
    return 0.0
  same = sum((collections.Counter(pred) & collections.Counter(gold)).values())
  if same == 0:
    return 0.0
  p, r = same / len(pred), same / len(gold)
  return 2 * p * r / (p + r)


def unigram_f1(text: str, references: Sequence[str], variant: str = 'paper') -> float:
  """Unigram F1 of ``text`` against the best of ``references`` (0 for empty text).

  paper: over SQuAD-normalised *words*; released: over the *characters* of its normalised
  strings (spaces included), so 'cat' and 'act' score 1.0.
  """
  _check_variant(variant)
  if variant == 'released':
    return max((_f1_counts(list(_released_normalize(text)), list(_released_normalize(r)))
                for r in references), default=0.0)
  words = qa_metrics.normalize_answer(text).split()
  return max((_f1_counts(words, qa_metrics.normalize_answer(r).split()) for r in references), default=0.0)


def unigram_precision(context: str, output: str) -> float:
  """Table 3's precision of the output in the context: the share of the context's
  normalised words that are output words (0 for an empty context)."""
  words = qa_metrics.normalize_answer(context).split()
  gold = qa_metrics.normalize_answer(output).split()
  if not words or not gold:
    return 0.0
  same = sum((collections.Counter(words) & collections.Counter(gold)).values())
  return same / len(words)


def released_exact_match(prediction: str, answers: Sequence[str]) -> float:
  """The released code's EM: normalised without removing punctuation ('U.S.' != 'US')."""
  pred = _released_normalize(prediction)
  return float(any(pred == _released_normalize(a) for a in answers))


def cxmi_from_logliks(context_loglik: Sequence[float] | np.ndarray, base_loglik: float,
                      variant: str = 'paper') -> np.ndarray:
  """``[S]`` CXMI per sentence from ``log p(o | t ⊕ q)`` and ``log p(o | q)``.

  paper: the difference of log-likelihoods; released: ``sigmoid(-log(prod p_base /
  prod p_ctx))`` from raw probability products (``nan`` when both underflow).
  """
  _check_variant(variant)
  ctx = np.asarray(context_loglik, np.float64)
  if variant == 'paper':
    return ctx - base_loglik
  with np.errstate(divide='ignore', invalid='ignore', over='ignore', under='ignore'):
    ratio = np.exp(base_loglik) / np.exp(ctx)
    diff = -np.log(ratio)
    return 1.0 / (1.0 + np.exp(-diff))


# ----------------------------------------------------------------------------- selection


def passage_sentences(passages: Sequence[Passage]) -> list[list[str]]:
  """The sentences of each passage's text, in reading order (``[P][S_p]``)."""
  return [split_sentences(p.text) for p in passages]


def canonical_output(answers: Sequence[str], passages: Sequence[Passage]) -> str:
  """The output ``o`` of a QA example: the first gold answer found in the passages (in rank
  order), else the first gold answer ('' without answers)."""
  for p in passages:
    for a in answers:
      if qa_metrics.has_answer(p.text, [a]):
        return a
  return answers[0] if answers else ''


@dataclasses.dataclass(frozen=True)
class Selection:
  """A silver context: the chosen sentences' ``(passage, sentence)`` indices and text."""
  indices: tuple[tuple[int, int], ...]
  text: str

  @property
  def empty(self) -> bool:
    return not self.indices


EMPTY = Selection((), '')


def select(sentences: Sequence[Sequence[str]], scores: Sequence[Sequence[float]], measure: str,
           variant: str = 'paper', threshold: float | None = None) -> Selection:
  """The silver context from per-sentence scores (``[P][S_p]``, passages in rank order).

  paper: STRINC takes the first sentence scoring 1; LEXICAL and CXMI take the best
  sentence scoring strictly above ``threshold`` (default: λ of the measure). released:
  STRINC keeps every sentence scoring 1; LEXICAL and CXMI the top sentence of every
  passage scoring ``>= threshold`` (default 0); kept sentences are joined by spaces.
  """
  _check_variant(variant)
  if measure not in MEASURES:
    raise ValueError(f'filco measure must be one of {MEASURES}, got {measure!r}')
  flat = [(i, j, float(s)) for i, row in enumerate(scores) for j, s in enumerate(row)]
  if variant == 'released':
    threshold = 0.0 if threshold is None else threshold
    if measure == 'strinc':
      chosen = [(i, j) for i, j, s in flat if s >= 1.0]
    else:
      chosen = []
      for i, row in enumerate(scores):
        if len(row):
          j = int(np.argmax(np.nan_to_num(np.asarray(row, np.float64), nan=-np.inf)))
          if row[j] >= threshold:
            chosen.append((i, j))
  elif measure == 'strinc':
    chosen = next(([(i, j)] for i, j, s in flat if s >= 1.0), [])
  else:
    if threshold is None:
      threshold = LEXICAL_THRESHOLD if measure == 'lexical' else CXMI_THRESHOLD
    above = [(s, -i, -j) for i, j, s in flat if s > threshold and not math.isnan(s)]
    chosen = []
    if above:
      _, i, j = max(above)  # ties: the earlier passage, then the earlier sentence
      chosen = [(-i, -j)]
  if not chosen:
    return EMPTY
  return Selection(tuple(chosen), ' '.join(sentences[i][j] for i, j in chosen))


def text_scores(sentences: Sequence[Sequence[str]], output: str, answers: Sequence[str], measure: str,
                variant: str = 'paper', *, lexical_reference: str | None = None) -> list[list[float]]:
  """``[P][S_p]`` STRINC (0/1, any gold answer) or LEXICAL scores.

  LEXICAL is the F1 against ``output``, or against ``lexical_reference`` when given: §2.2
  compares with the query for fact verification, whose output (a label) is in no passage.
  """
  if measure == 'strinc':
    return [[float(strinc(s, answers, variant)) for s in row] for row in sentences]
  if measure == 'lexical':
    if variant == 'released' and lexical_reference is None:  # the best of every gold answer
      references = [a for a in answers if a]
      return [[unigram_f1(s, references, variant) if references else 0.0 for s in row] for row in sentences]
    reference = output if lexical_reference is None else lexical_reference
    return [[unigram_f1(s, [reference], variant) if reference else 0.0 for s in row] for row in sentences]
  raise ValueError(f'text_scores computes strinc or lexical, not {measure!r}')


def cxmi_scores(reader, questions: Sequence[str], sentences: Sequence[Sequence[Sequence[str]]],
                outputs: Sequence[str], variant: str = 'paper') -> list[list[list[float]]]:
  """``[Q][P][S_p]`` CXMI of every sentence of every question, with the run's reader.

  One batched call of :func:`recomp_jax.reader.candidate_scores.loglik_labels` (the sharded
  scorer, few-shot prefix encoded once) gives ``log p(o | t ⊕ q)`` per sentence and
  ``log p(o | q)`` once per question. A question without an output scores nothing.
  """
  todo = [i for i, o in enumerate(outputs) if o]
  flat = [[s for row in sentences[i] for s in row] for i in todo]
  labels = loglik_labels(reader, [questions[i] for i in todo], flat, [[outputs[i]] for i in todo]) if todo else []
  out: list[list[list[float]]] = [[[0.0] * len(row) for row in q] for q in sentences]
  for i, record in zip(todo, labels):
    values = cxmi_from_logliks(record['loglik'], record['none_loglik'], variant)
    k = 0
    for p, row in enumerate(sentences[i]):
      out[i][p] = [float(v) for v in values[k:k + len(row)]]
      k += len(row)
  return out


# ----------------------------------------------------------------------------- constrained decoding


def ranked_filter(model, prompts_text: Sequence[str], sentences: Sequence[Sequence[Sequence[str]]]
                  ) -> list[list[float]]:
  """The filter model's score of every output it was trained to give: nothing, or one sentence.

  Each candidate is a target the filter model was trained on: ``''`` (the empty context) and
  ``' ' + sentence`` for every sentence (``sentences[i]`` is ``[P][S_p]``). Its score is
  ``log p(candidate ⊕ EOS | prompt_i)`` under ``model`` (a :class:`recomp_jax.reader.Reader`
  around the fine-tuned filter model), each prompt encoded once and its candidates scored
  as continuations (:meth:`~recomp_jax.reader.Reader.output_loglik_per_prompt`).
  :func:`ranked_context` turns the scores into a context.

  Returns:
    per example ``[1 + S]`` floats: the empty context's score, then each sentence in passage
    and reading order.
  """
  if len(prompts_text) != len(sentences):
    raise ValueError(f'{len(prompts_text)} prompts for {len(sentences)} sentence lists')
  candidates = [[''] + [' ' + s for row in rows for s in row] for rows in sentences]
  return [np.asarray(scores, np.float64).tolist()
          for scores in model.output_loglik_per_prompt(list(prompts_text), candidates)]


def ranked_context(loglik: Sequence[float], sentences: Sequence[Sequence[str]], *, keep: int,
                   allow_empty: bool) -> str:
  """A context from :func:`ranked_filter`'s scores (``loglik``: the empty context first, then
  each sentence of ``sentences [P][S_p]`` in order).

  The ``keep`` most likely sentences, joined in reading order; with ``allow_empty``, nothing
  when the empty context is the most likely output of all (``keep=1, allow_empty=True`` is the
  filter model's exact most likely output over the candidates). Ties go to the earlier
  sentence, and to the empty context before any sentence.
  """
  if keep < 1:
    raise ValueError(f'filco.ranked_sentences must be at least 1, got {keep}')
  where = [(p, j) for p, row in enumerate(sentences) for j in range(len(row))]
  if len(loglik) != 1 + len(where):
    raise ValueError(f'{len(loglik)} scores for the empty context and {len(where)} sentences')
  scores = np.asarray(loglik, np.float64)
  if not where or (allow_empty and int(np.argmax(scores)) == 0):
    return ''
  best = sorted(np.argsort(-scores[1:], kind='stable')[:keep].tolist())
  return ' '.join(sentences[where[i][0]][where[i][1]] for i in best)


# ----------------------------------------------------------------------------- model inputs


def passages_text(passages: Sequence[Passage]) -> str:
  """``P`` in the filter model's input: ``'{title}\\n{text}'`` per passage, best first."""
  return '\n'.join(f'{p.title}\n{p.text}' for p in passages)


def filter_prompt(question: str, passages_str: str) -> str:
  """:data:`FILTER_PROMPT` filled in (literal braces in the texts are left alone)."""
  return prompts.fill(FILTER_PROMPT, passage=passages_str, query=question)


def passage_prompt(question: str, passage: Passage) -> str:
  """The PSG model's input for one passage (it answers :data:`KEEP_WORD` or :data:`DROP_WORD`)."""
  return prompts.fill(PASSAGE_PROMPT, passage=f'{passage.title}\n{passage.text}', query=question)


def filtered_context(context: str, passages: Sequence[Passage], variant: str = 'paper') -> str:
  """What a generator reads for a filtered context. paper: the context itself ('' = the question
  alone). released: an empty context becomes the top-1 passage's text, without its title."""
  _check_variant(variant)
  if variant == 'released' and not context.strip():
    return passages[0].text if passages else ''
  return context


def generator_prompt(question: str, context: str) -> str:
  """``t ⊕ q`` for the generator: the reader protocol's prompt without its few-shot block
  (the generator is fine-tuned; an empty context gives the question alone)."""
  return prompts.build_prompt(question, context, few_shot='')


def filter_input(tokenizer, question: str, passages, budget: int) -> tuple[str, bool]:
  """``q ⊕ P`` for the filter model, the passages cut at their end to fit ``budget`` tokens."""
  return fit_prompt(tokenizer, lambda docs: filter_prompt(question, docs), passages_text(passages), budget)


class FilterCompressor:
  """``compress(questions, documents)``: the filter model's context ``t`` of each question's top
  passages (greedy; '' when it writes nothing), as FILCO's test rows compute it."""

  def __init__(self, model_dir: str, *, top_docs: int, max_source_length: int, max_new_tokens: int,
               batch_size: int = 8):
    self.reader = Reader(model_dir, generate_batch_size=batch_size, max_new_tokens=max_new_tokens)
    self.top_docs, self.max_source_length = top_docs, max_source_length

  def compress(self, questions: Sequence[str], documents: Sequence[Sequence[Passage]]) -> list[str]:
    inputs = [filter_input(self.reader.tokenizer, q, list(d)[:self.top_docs], self.max_source_length)[0]
              for q, d in zip(questions, documents)]
    return self.reader.answer(inputs)


def export_spec(model_dir: str, *, top_docs: int, max_source_length: int, max_new_tokens: int,
                batch_size: int) -> dict:
  """The ``compressor.json`` fields of a trained FILCO filter model (see :func:`load`)."""
  return {'system': 'filco', 'model': model_dir, 'top_docs': top_docs, 'max_source_length': max_source_length,
          'max_new_tokens': max_new_tokens, 'batch_size': batch_size}


def load(spec: dict) -> FilterCompressor:
  """The compressor an :func:`export_spec` describes (paths already resolved)."""
  return FilterCompressor(spec['model'], top_docs=spec['top_docs'], max_source_length=spec['max_source_length'],
                          max_new_tokens=spec['max_new_tokens'], batch_size=spec['batch_size'])


def silver_records(reader, examples: Sequence[Example], *, top_docs: int, measure: str, variant: str,
                   threshold: float | None, lexical_against: str = 'output') -> list[dict]:
  """One record per example: sentences ``[P][S]``, scores, ``t_silver`` and PSG labels ``[P]``.

  ``lexical_against``: ``'output'`` or ``'query'`` (fact verification: LEXICAL compares
  sentences with the claim, §2.2).
  """
  if lexical_against not in ('output', 'query'):
    raise ValueError(f"lexical_against must be 'output' or 'query', got {lexical_against!r}")
  passages = [e.ctxs[:top_docs] for e in examples]
  sentences = [passage_sentences(p) for p in passages]
  outputs = [canonical_output(e.answers, p) for e, p in zip(examples, passages)]
  if measure == 'cxmi':
    scores = cxmi_scores(reader, [e.question for e in examples], sentences, outputs, variant)
  else:
    scores = [text_scores(s, o, e.answers, measure, variant,
                                lexical_reference=e.question if lexical_against == 'query' else None)
              for s, o, e in zip(sentences, outputs, examples)]
  out = []
  for e, sents, score, o in zip(examples, sentences, scores, outputs):
    chosen = select(sents, score, measure, variant, threshold)
    single = [select([row], [row_scores], measure, variant, threshold)
              for row, row_scores in zip(sents, score)]
    out.append({'id': e.id, 'output': o, 'sentences': sents, 'scores': score, 'silver': chosen.text,
                'silver_indices': [list(ix) for ix in chosen.indices],
                'psg_keep': [not s.empty for s in single]})
  return out


def keep_threshold(margins: Sequence[float], labels: Sequence[bool]) -> tuple[float, float | None]:
  """The threshold ``t`` (keep a passage when its margin ``>= t``) with the best F1 of the kept
  passages against ``labels``, and that F1.

  Candidates are the margins themselves; among equal F1 the highest ``t`` wins (fewest kept).
  With no positive label F1 is undefined: ``(0.0, None)``, the model's own yes-vs-no.

  Args:
    margins: ``[N]`` log-odds of keeping, one per passage.
    labels: ``[N]`` the silver keep labels of the same passages.
  """
  m, y = np.asarray(margins, np.float64), np.asarray(labels, bool)
  if m.shape != y.shape:
    raise ValueError(f'{m.shape[0]} margins for {y.shape[0]} labels')
  if not y.any():
    return 0.0, None
  order = np.argsort(-m, kind='stable')
  m, y = m[order], y[order]
  true_pos = np.cumsum(y)
  last = np.r_[m[1:] != m[:-1], True]  # a threshold keeps every passage tied with it
  kept = np.arange(1, len(m) + 1)[last]
  f1 = 2.0 * true_pos[last] / (kept + y.sum())
  best = int(np.argmax(f1))  # the first maximum: the highest threshold
  return float(m[last][best]), float(f1[best])

__all__ = ['filtered_context', 'FilterCompressor', 'export_spec', 'filter_input', 'keep_threshold', 'load', 'silver_records', 'CXMI_THRESHOLD', 'EMPTY', 'LEXICAL_THRESHOLD', 'MEASURES', 'Selection', 'VARIANTS',
           'canonical_output', 'cxmi_from_logliks', 'cxmi_scores', 'filter_prompt', 'generator_prompt',
           'passage_prompt', 'passage_sentences', 'passages_text', 'ranked_context', 'ranked_filter',
           'released_exact_match',
           'select', 'strinc',
           'text_scores', 'unigram_f1', 'unigram_precision']
