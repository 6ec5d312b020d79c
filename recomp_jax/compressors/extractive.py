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
import zlib
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from recomp_jax.data.schema import FilterReport, Passage
from recomp_jax.data.sentences import build_candidates
from recomp_jax.models.dual_encoder import Encoder
from recomp_jax.reader import prompts
from recomp_jax.training import losses


def text_id(text: str) -> int:
  """A stable non-negative 31-bit id of a text (for duplicate-aware contrastive masks)."""
  return zlib.crc32(text.encode('utf-8')) & 0x7FFFFFFF


def candidate_suffix(candidate: str, question: str) -> str:
  """The part of the reader prompt after the shared few-shot prefix."""
  return prompts.build_prompt(question, candidate)[len(prompts.FEW_SHOT_PREFIX):]


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
    suffixes.append(prompts.build_prompt(question)[len(prompts.FEW_SHOT_PREFIX):])
    targets.append(target)
    owners.append(i)
  scores = reader.loglik(prompts.FEW_SHOT_PREFIX, suffixes, targets)
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
      flat_prompts.append(prompts.build_prompt(question, cand))
      flat_answers.append(answers[i])
      owners.append(i)
  scores = reader.exact_match(flat_prompts, flat_answers, max_new_tokens=max_new_tokens)
  out = [[] for _ in questions]
  for owner, em in zip(owners, scores['em_per_example'].tolist()):
    out[owner].append(float(em))
  return out


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


__all__ = ['ListwiseExample', 'TrainingPair', 'candidate_suffix', 'compress', 'contrastive_loss_fn',
           'count_truncated', 'em_labels', 'evidence_per_question', 'listwise_arrays', 'listwise_loss_fn', 'loglik_labels',
           'pair_arrays', 'rank_candidates', 'reranked_accuracy', 'select_pair', 'text_id',
           'top_k_evidence', 'SentenceCompressor', 'export_spec', 'load']
