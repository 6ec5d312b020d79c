"""RECOMP's extractive compressor: label sentences with the reader, train a dual encoder.

RECOMP §3.1 / Fig. 2 and 6: for each question ``x`` with candidate sentences
``s_j`` (the top-20 sentences of the top-5 documents, title-prefixed), the
reader scores every candidate prepended to the input; the best candidate is the
positive ``p``; the negatives ``N`` are up to five candidates that score below
the positive by a margin ``epsilon`` and that the *current* encoder ranks
highest (hard negatives). A dual encoder is then trained with the contrastive
loss ``-log e^{sim(x,p)} / (e^{sim(x,p)} + sum_{n in N} e^{sim(x,n)})``
(:func:`recomp_jax.training.losses.contrastive_loss`, here with in-batch negatives too).

Labelling signals (``signal``):
  * ``'loglik'``: ``log p_M(y | [s_j; x])`` of the first gold answer (paper
    Fig. 2; the NQ protocol notes its argmax matches the EM oracle);
  * ``'em'``: the reader's greedy answer is exact-match correct with ``s_j``
    prepended (paper Fig. 6); ties among correct sentences are broken by
    log-likelihood, and examples with no correct sentence are dropped.
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from recomp_jax.data.schema import Example, FilterReport, Passage
from recomp_jax.data.sentences import build_candidates
from recomp_jax.evaluation import qa_metrics
from recomp_jax.models.dual_encoder import Encoder
from recomp_jax.reader import prompts
# The labels and the ranking are shared with the other systems: they live in the reader and
# retrieval layers and are re-exported here as the extractive method's own steps.
from recomp_jax.reader.candidate_scores import candidate_suffix, em_labels, loglik_labels  # noqa: F401
from recomp_jax.retrieval.sentence_ranking import (compress, evidence_per_question,  # noqa: F401
                                                   rank_candidates, top_k_evidence)
from recomp_jax.training import losses


def text_id(text: str) -> int:
  """A stable non-negative 31-bit id of a text (for duplicate-aware contrastive masks)."""
  return zlib.crc32(text.encode('utf-8')) & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class TrainingPair:
  """One contrastive example: a question, its positive and hard negatives (texts)."""
  id: str
  question: str
  positive: str
  negatives: tuple[str, ...]


def select_pair(example_id: str, question: str, candidates: Sequence[str], loglik: Sequence[float],
                encoder_scores: Sequence[float], *, signal: str = 'loglik',
                em: Sequence[float] | None = None, epsilon: float = 0.0, num_negatives: int = 5,
                report: FilterReport | None = None) -> TrainingPair | None:
  """Positive = best candidate by the reader; negatives = top encoder-scored worse candidates.

  Returns ``None`` (and counts the reason in ``report``) when there is no
  candidate, no positive (``'em'``: no correct sentence) or no negative.
  """
  report = report if report is not None else FilterReport('pairs')
  if not candidates:
    report.drop('no_candidates', example_id)
    return None
  loglik = np.asarray(loglik, np.float64)
  if signal == 'loglik':
    positive = int(np.argmax(loglik))
    worse = loglik < loglik[positive] - epsilon
  elif signal == 'em':
    if em is None:
      raise ValueError("signal='em' needs the em labels")
    correct = np.asarray(em) > 0
    if not correct.any():
      report.drop('no_correct_candidate', example_id)
      return None
    positive = int(np.argmax(np.where(correct, loglik, -np.inf)))
    worse = (~correct) & (loglik < loglik[positive] - epsilon)
  else:
    raise ValueError(f"signal must be 'loglik' or 'em', got {signal!r}")
  worse[positive] = False
  same_text = np.array([c == candidates[positive] for c in candidates])
  worse &= ~same_text
  if not worse.any():
    report.drop('no_negative', example_id)
    return None
  order = np.argsort(-np.asarray(encoder_scores, np.float64), kind='stable')
  negatives = [candidates[j] for j in order if worse[j]][:num_negatives]
  report.keep()
  return TrainingPair(example_id, question, candidates[positive], tuple(negatives))


def _slotted_arrays(tokenizer, questions: Sequence[str], rows: Sequence[Sequence[str]], slots: int, *,
                    max_query_length: int, max_passage_length: int) -> tuple[dict[str, np.ndarray], list[str]]:
  """Questions ``[N, Lq]`` and ``slots`` passages per question ``[N, P, Lp]``, padded to the longest.

  Returns the arrays (``query_ids/query_mask``, ``passage_ids/passage_mask``,
  ``passage_valid [N, P]``) and the flat passage texts with '' in empty slots.
  """
  q = tokenizer(list(questions), padding='longest', truncation=True, max_length=max_query_length,
                return_tensors='np')
  texts, valid = [], []
  for row in rows:
    valid.append([True] * len(row) + [False] * (slots - len(row)))
    texts.extend(list(row) + [''] * (slots - len(row)))
  enc = tokenizer(texts, padding='longest', truncation=True, max_length=max_passage_length,
                  return_tensors='np')
  n = len(rows)
  return {
      'query_ids': q['input_ids'].astype(np.int32),
      'query_mask': q['attention_mask'].astype(np.int32),
      'passage_ids': enc['input_ids'].reshape(n, slots, -1).astype(np.int32),
      'passage_mask': enc['attention_mask'].reshape(n, slots, -1).astype(np.int32),
      'passage_valid': np.asarray(valid, bool),
  }, texts


def _encode_slots(model, batch) -> tuple[jax.Array, jax.Array]:
  """Query ``[B, D]`` and passage ``[B, P, D]`` embeddings of a :func:`_slotted_arrays` batch."""
  batch_size, slots, length = batch['passage_ids'].shape
  q = model.encode_queries(batch['query_ids'], batch['query_mask'])  # [B, D]
  p = model.encode_passages(batch['passage_ids'].reshape(batch_size * slots, length),
                            batch['passage_mask'].reshape(batch_size * slots, length))
  return q, p.reshape(batch_size, slots, -1)  # [B, P, D]


def _num_tokens(batch) -> jax.Array:
  return (jnp.sum(batch['query_mask']) + jnp.sum(batch['passage_mask'])).astype(jnp.float32)


def pair_arrays(pairs: Sequence[TrainingPair], tokenizer, *, num_negatives: int,
                max_query_length: int, max_passage_length: int) -> dict[str, np.ndarray]:
  """Tokenised, padded arrays for :func:`contrastive_loss_fn`.

  Every row is padded to the longest text of its kind (at most ``max_*_length`` tokens),
  so one compiled shape serves the whole run without padding short sentences to the limit.

  Returns:
    ``query_ids/query_mask [N, Lq]``, ``passage_ids/passage_mask [N, P, Lp]``
    (slot 0 the positive, ``P = 1 + num_negatives``), ``passage_valid [N, P]``,
    ``query_key [N]`` and ``passage_key [N, P]`` (text ids for duplicate masks).
  """
  slots = 1 + num_negatives
  arrays, texts = _slotted_arrays(tokenizer, [p.question for p in pairs],
                                  [[p.positive, *p.negatives] for p in pairs], slots,
                                  max_query_length=max_query_length, max_passage_length=max_passage_length)
  arrays['query_key'] = np.asarray([text_id(p.question) for p in pairs], np.int32)
  arrays['passage_key'] = np.asarray([text_id(t) for t in texts], np.int32).reshape(len(pairs), slots)
  return arrays


def contrastive_loss_fn(*, temperature: float, similarity: str):
  """``(dual_encoder, batch, rng) -> (loss, aux)`` for :func:`recomp_jax.training.loop.train`."""

  def loss_fn(model, batch, rng):
    del rng  # encoders are trained without dropout: deterministic, exactly resumable steps
    q, p = _encode_slots(model, batch)  # [B, D], [B, P, D]
    loss, metrics = losses.contrastive_loss(
        q, p, batch['passage_valid'], temperature=temperature, similarity=similarity,
        query_ids=batch['query_key'], passage_ids=batch['passage_key'])
    metrics['num_tokens'] = _num_tokens(batch)
    return loss, metrics

  return loss_fn


@dataclasses.dataclass(frozen=True)
class ListwiseExample:
  """One question with its candidates and the reader's log-likelihood of each (listwise objective)."""
  id: str
  question: str
  candidates: tuple[str, ...]
  loglik: tuple[float, ...]


def listwise_arrays(examples: Sequence[ListwiseExample], tokenizer, *, max_candidates: int,
                    max_query_length: int, max_passage_length: int) -> dict[str, np.ndarray]:
  """Tokenised arrays for :func:`listwise_loss_fn` (the first ``max_candidates`` of each question).

  Returns:
    ``query_ids/query_mask [N, Lq]``, ``passage_ids/passage_mask [N, C, Lp]``,
    ``passage_valid [N, C]`` and ``teacher [N, C]`` float32 log-likelihoods (0 in empty slots).
  """
  c = max_candidates
  arrays, _ = _slotted_arrays(tokenizer, [e.question for e in examples],
                              [e.candidates[:c] for e in examples], c,
                              max_query_length=max_query_length, max_passage_length=max_passage_length)
  arrays['teacher'] = np.asarray([list(e.loglik[:c]) + [0.0] * (c - len(e.loglik[:c])) for e in examples],
                                 np.float32)
  return arrays


def listwise_loss_fn(*, temperature: float, teacher_temperature: float, similarity: str):
  """``(dual_encoder, batch, rng) -> (loss, aux)``: KL to the reader over each question's candidates."""

  def loss_fn(model, batch, rng):
    del rng
    q, p = _encode_slots(model, batch)  # [B, D], [B, C, D]
    if similarity == 'cosine':
      q = q / jnp.maximum(jnp.linalg.norm(q, axis=-1, keepdims=True), 1e-12)
      p = p / jnp.maximum(jnp.linalg.norm(p, axis=-1, keepdims=True), 1e-12)
    scores = jnp.einsum('bd,bcd->bc', q, p)  # [B, C]
    loss, metrics = losses.listwise_distillation_loss(
        scores, batch['teacher'], batch['passage_valid'], temperature=temperature,
        teacher_temperature=teacher_temperature)
    metrics['num_tokens'] = _num_tokens(batch)
    return loss, metrics

  return loss_fn


def count_truncated(tokenizer, texts: Sequence[str], max_length: int) -> int:
  """How many ``texts`` exceed ``max_length`` tokens (special tokens included): encoder truncation."""
  if not texts:
    return 0
  lengths = [len(ids) for ids in tokenizer(list(texts), add_special_tokens=True)['input_ids']]
  return int(sum(n > max_length for n in lengths))


def reranked_accuracy(scores: Iterable[np.ndarray], loglik: Iterable[Sequence[float]]) -> dict:
  """How well an encoder's ranking agrees with the reader's labels (checkpoint selection).

  Returns ``{'top1_is_best': fraction whose top candidate is the reader's best,
  'top1_loglik': mean reader log-likelihood of the encoder's top candidate}``.
  """
  hits, values = [], []
  for s, ll in zip(scores, loglik):
    if len(ll) == 0:
      continue
    top = int(np.argmax(s))
    hits.append(float(top == int(np.argmax(ll))))
    values.append(float(ll[top]))
  return {'top1_is_best': float(np.mean(hits)) if hits else 0.0,
          'top1_loglik': float(np.mean(values)) if values else 0.0}


def above_threshold(candidates: Sequence[str], scores: np.ndarray, threshold: float,
                    max_sentences: int) -> str:
  """Evidence of the candidates scoring at least ``threshold`` (at most ``max_sentences``; '' if none)."""
  order = [j for j in np.argsort(-np.asarray(scores), kind='stable') if scores[j] >= threshold]
  return prompts.format_sentences([candidates[j] for j in order[:max_sentences]])


def tune_threshold(reader, examples: Sequence[Example], candidates: Sequence[Sequence[str]],
                   scores: Sequence[np.ndarray], *, max_sentences: int,
                   quantiles: Sequence[float] = (0.1, 0.25, 0.5, 0.75, 0.9)) -> dict:
  """Chooses the score threshold with the best reader EM on dev (ties: fewer evidence tokens).

  Candidate thresholds are quantiles of the dev questions' top-1 scores, so that from
  about 90% to about 10% of the questions keep at least one sentence.

  Returns ``{'threshold', 'table': [{'threshold', 'quantile', 'em', 'tokens', 'empty_percent'}]}``.
  """
  top1 = np.array([float(np.max(s)) for s in scores if len(s)])
  thresholds = [float(np.quantile(top1, q)) if len(top1) else 0.0 for q in quantiles]
  evidence = [[above_threshold(c, s, t, max_sentences) if len(c) else ''
               for c, s in zip(candidates, scores)] for t in thresholds]
  # Neighbouring thresholds mostly give a question the same evidence: answer each prompt once.
  prompt_of = lambda e, ev: reader.prompt(e.question, ev)
  unique = sorted({prompt_of(e, ev) for row in evidence for e, ev in zip(examples, row)})
  answer = dict(zip(unique, reader.answer(unique)))
  table = []
  for q, t, row in zip(quantiles, thresholds, evidence):
    predictions = [answer[prompt_of(e, ev)] for e, ev in zip(examples, row)]
    result = qa_metrics.qa_scores(predictions, [e.answers for e in examples])
    table.append({'threshold': t, 'quantile': q, 'em': result['em'],
                  'tokens': float(np.mean([reader.count_tokens(ev) for ev in row])),
                  'empty_percent': 100.0 * float(np.mean([ev == '' for ev in row]))})
  best = max(table, key=lambda r: (r['em'], -r['tokens']))
  return {'threshold': best['threshold'], 'table': table}


def oracle_em_choice(reader, examples: Sequence[Example], candidates: dict[str, list[str]], labels: dict[str, dict],
                     *, max_candidates: int = 0) -> list[dict]:
  """Per question, the highest-log-likelihood candidate that makes the reader exact-match correct.

  Candidates are read in decreasing log-likelihood order (``labels[id]['loglik']``), in rounds
  over all unresolved questions (1, 1, 2, 4, ... candidates per question), so a question stops
  as soon as a correct candidate is found: the first correct one is the LL tie-break winner.
  ``max_candidates`` > 0 bounds the candidates tried per question (an approximation).

  Returns:
    per question ``{'choice': candidate index (-1: none correct), 'tried': candidates read}``.
  """
  order = {e.id: np.argsort(-np.asarray(labels[e.id]['loglik']), kind='stable').tolist()
           for e in examples}
  if max_candidates:
    order = {i: o[:max_candidates] for i, o in order.items()}
  tried = {e.id: 0 for e in examples}
  choice = {e.id: -1 for e in examples}
  for round_index in itertools.count():
    width = 1 if round_index < 2 else 2 ** (round_index - 1)
    open_ = [e for e in examples if choice[e.id] < 0 and tried[e.id] < len(order[e.id])]
    if not open_:
      break
    batch_prompts, batch_answers, owners = [], [], []
    for e in open_:
      for j in order[e.id][tried[e.id]:tried[e.id] + width]:
        batch_prompts.append(reader.prompt(e.question, candidates[e.id][j]))
        batch_answers.append(e.answers)
        owners.append((e.id, j))
      tried[e.id] = min(tried[e.id] + width, len(order[e.id]))
    em = reader.exact_match(batch_prompts, batch_answers)['em_per_example']
    for (eid, j), correct in zip(owners, em):
      if correct and choice[eid] < 0:
        choice[eid] = j  # owners are in LL order per question: the first hit wins
  return [{'choice': int(choice[e.id]), 'tried': int(tried[e.id])} for e in examples]


class SentenceCompressor:
  """``compress(questions, documents)``: the ``k`` candidate sentences of the top documents the
  encoder ranks first, candidates built as the pipeline's ``candidates`` stage builds them."""

  def __init__(self, encoder, *, k: int, top_docs: int, max_candidates: int | None):
    self.encoder, self.k, self.top_docs, self.max_candidates = encoder, k, top_docs, max_candidates

  def compress(self, questions: Sequence[str], documents: Sequence[Sequence[Passage]]) -> list[str]:
    candidates = [[c.text for c in build_candidates(list(d), top_docs=self.top_docs, max_candidates=self.max_candidates)]
                  for d in documents]
    return compress(self.encoder, questions, candidates, self.k)


def export_spec(encoder_dir: str, *, k: int, top_docs: int, max_candidates: int, pooling: str,
                normalize: bool, max_length: int) -> dict:
  """The ``compressor.json`` fields of a trained extractive compressor (see :func:`load`)."""
  return {'system': 'extractive', 'encoder': encoder_dir, 'k': k, 'top_docs': top_docs,
          'max_candidates': max_candidates, 'pooling': pooling, 'normalize': normalize, 'max_length': max_length}


def load(spec: dict) -> SentenceCompressor:
  """The compressor an :func:`export_spec` describes (paths already resolved)."""
  kwargs = {'pooling': spec['pooling']} if spec['pooling'] else {}
  encoder = Encoder.from_pretrained(spec['encoder'], max_length=spec['max_length'] or None,
                                    normalize=bool(spec['normalize']), **kwargs)
  return SentenceCompressor(encoder, k=spec['k'], top_docs=spec['top_docs'], max_candidates=spec['max_candidates'] or None)


__all__ = ['ListwiseExample', 'TrainingPair', 'above_threshold', 'candidate_suffix', 'oracle_em_choice', 'tune_threshold', 'compress', 'contrastive_loss_fn',
           'count_truncated', 'em_labels', 'evidence_per_question', 'listwise_arrays', 'listwise_loss_fn', 'loglik_labels',
           'pair_arrays', 'rank_candidates', 'reranked_accuracy', 'select_pair', 'text_id',
           'top_k_evidence', 'SentenceCompressor', 'export_spec', 'load']
