"""Pure, jittable training losses of the five systems.

Every loss returns ``(loss, metrics)`` where ``loss`` is a scalar and
``metrics`` a dict of scalars; nothing here touches Python state, so each
function can sit inside a jitted, sharded train step.

=========================  ==================================================
:func:`contrastive_loss`    RECOMP extractive compressor (DPR-style InfoNCE)
:func:`listwise_distillation_loss`  extractive compressor, beyond the paper: KL to the reader
:func:`seq2seq_loss`        RECOMP abstractive compressor, FILCO filter/generator
:func:`knowledge_injection_loss`  K-COMP causal-mask knowledge injection (and ``_at``: compact)
:func:`orpo_loss`           CoLoR: ORPO with a length regulariser
=========================  ==================================================
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -1e30

# The aux key of a loss that is a mean over items (target tokens, sequences): how many items
# the loss averages. The training loop weights microbatches and evaluation batches by it, so
# an accumulated or batched loss (and its gradient) is that of the whole batch.
LOSS_WEIGHT = 'loss_weight'


def _at_least_f32(x: jax.Array) -> jax.Array:
  """Upcasts bf16/fp16 to float32; float64 (tests under ``jax.enable_x64``) stays."""
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def token_log_probs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """``log p(targets)`` per position, in at least float32.

  Args:
    logits: ``[..., V]``.
    targets: ``[...]`` int token ids.
  Returns:
    ``[...]`` float32 log-probabilities.
  """
  logits = _at_least_f32(logits)
  log_z = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - log_z


def _reduce(per_token: jax.Array, mask: jax.Array, reduction: str) -> tuple[jax.Array, jax.Array]:
  """``[B, T]`` weighted token losses -> (scalar loss, its :data:`LOSS_WEIGHT`).

  ``'token_mean'`` divides by the number of target tokens, ``'sequence_sum'`` by the batch size;
  the weight is that divisor (0 for a batch without target tokens, whose loss is 0).
  """
  if reduction == 'token_mean':
    count = jnp.sum(mask)
    return jnp.sum(per_token) / jnp.maximum(count, 1.0), count
  if reduction == 'sequence_sum':
    return jnp.sum(per_token) / per_token.shape[0], jnp.asarray(per_token.shape[0], jnp.float32)
  raise ValueError(f"reduction must be 'token_mean' or 'sequence_sum', got {reduction!r}")


def contrastive_loss(query_emb: jax.Array, passage_emb: jax.Array, passage_mask: jax.Array, *,
                     temperature: float = 1.0, similarity: str = 'dot',
                     in_batch_negatives: bool = True, query_ids: jax.Array | None = None,
                     passage_ids: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """InfoNCE over one positive and up to ``P - 1`` hard negatives per query (RECOMP eq. 1).

  RECOMP §3.1 trains the extractive compressor with the DPR objective
  ``-log e^{sim(x, p)} / (e^{sim(x, p)} + sum_{n in N} e^{sim(x, n)})`` where
  the negatives ``N`` are the query's hard negatives and, with
  ``in_batch_negatives``, every other query's passages. Scores are
  ``sim / temperature`` with ``sim`` the dot product or cosine.

  A candidate is never used as a false negative when it is the same text as the
  query's positive (``passage_ids`` equal) or the positive of another copy of
  the same query (``query_ids`` equal).

  Args:
    query_emb: ``[B, D]``.
    passage_emb: ``[B, P, D]``; slot 0 of each row is the positive.
    passage_mask: ``[B, P]`` bool/0-1, which slots hold a real passage.
    temperature: softmax temperature.
    similarity: ``'dot'`` or ``'cosine'``.
    in_batch_negatives: also contrast against the other rows' passages.
    query_ids: ``[B]`` ints identifying the query text (optional).
    passage_ids: ``[B, P]`` ints identifying the passage text (optional).
  Returns:
    (mean loss over queries, ``{'accuracy', 'num_candidates'}``).
  """
  batch, slots, dim = passage_emb.shape
  q = _at_least_f32(query_emb)
  p = _at_least_f32(passage_emb).reshape(batch * slots, dim)
  if similarity == 'cosine':
    q = q / jnp.maximum(jnp.linalg.norm(q, axis=-1, keepdims=True), 1e-12)
    p = p / jnp.maximum(jnp.linalg.norm(p, axis=-1, keepdims=True), 1e-12)
  elif similarity != 'dot':
    raise ValueError(f"similarity must be 'dot' or 'cosine', got {similarity!r}")
  scores = (q @ p.T) / temperature  # [B, B*P]

  rows = jnp.arange(batch)[:, None]
  owner = jnp.arange(batch * slots)[None, :] // slots  # [1, B*P]
  slot = jnp.arange(batch * slots)[None, :] % slots
  target = rows * slots  # [B, 1]
  is_target = jnp.arange(batch * slots)[None, :] == target
  valid = passage_mask.reshape(1, batch * slots).astype(bool)
  if not in_batch_negatives:
    valid = valid & (owner == rows)
  false_negative = jnp.zeros_like(is_target)
  if passage_ids is not None:
    flat_ids = passage_ids.reshape(1, batch * slots)
    false_negative = false_negative | (flat_ids == passage_ids[:, :1])
  if query_ids is not None:
    same_query = query_ids[:, None] == query_ids[owner[0]][None, :]
    false_negative = false_negative | (same_query & (slot == 0))
  keep = (valid & ~false_negative) | is_target
  scores = jnp.where(keep, scores, _NEG_INF)
  log_probs = jax.nn.log_softmax(scores, axis=-1)
  loss = -jnp.mean(jnp.take_along_axis(log_probs, target, axis=-1))
  accuracy = jnp.mean((jnp.argmax(scores, axis=-1) == target[:, 0]).astype(jnp.float32))
  metrics = {'accuracy': accuracy, 'num_candidates': jnp.mean(jnp.sum(keep, axis=-1))}
  return loss, metrics


def listwise_distillation_loss(scores: jax.Array, teacher_scores: jax.Array, valid: jax.Array, *,
                               temperature: float = 1.0, teacher_temperature: float = 1.0
                               ) -> tuple[jax.Array, dict]:
  """KL from the reader's distribution over a question's candidates to the encoder's.

  Beyond RECOMP (which trains on one positive and hard negatives): the encoder's softmax
  over all candidates of a question, ``q = softmax(scores / temperature)``, is pulled
  towards the reader's, ``p = softmax(teacher_scores / teacher_temperature)`` (teacher
  scores are the reader's log-likelihoods of the gold answer with each candidate):
  ``loss = mean_b KL(p_b || q_b) = sum_c p (log p - log q)``.

  Args:
    scores: ``[B, C]`` encoder similarities.
    teacher_scores: ``[B, C]`` reader log-likelihoods.
    valid: ``[B, C]`` which candidate slots are real; rows need at least one.
    temperature, teacher_temperature: softmax temperatures.
  Returns:
    (mean KL over rows, ``{'top1_agreement': argmax q == argmax p, 'teacher_entropy'}``).
  """
  valid = valid.astype(bool)
  s = jnp.where(valid, _at_least_f32(scores) / temperature, _NEG_INF)
  t = jnp.where(valid, _at_least_f32(teacher_scores) / teacher_temperature, _NEG_INF)
  log_q = jax.nn.log_softmax(s, axis=-1)
  log_p = jax.nn.log_softmax(t, axis=-1)
  p = jnp.where(valid, jnp.exp(log_p), 0.0)
  kl = jnp.sum(jnp.where(valid, p * (log_p - log_q), 0.0), axis=-1)  # [B]
  agreement = (jnp.argmax(s, axis=-1) == jnp.argmax(t, axis=-1)).astype(jnp.float32)
  entropy = -jnp.sum(jnp.where(valid, p * log_p, 0.0), axis=-1)
  return jnp.mean(kl), {'top1_agreement': jnp.mean(agreement), 'teacher_entropy': jnp.mean(entropy)}


def seq2seq_loss(logits: jax.Array, targets: jax.Array, mask: jax.Array, *,
                 label_smoothing: float = 0.0, reduction: str = 'token_mean') -> tuple[jax.Array, dict]:
  """Teacher-forced cross-entropy of a decoder's targets, padding masked.

  ``loss = -sum_t m_t [(1 - eps) log p(y_t) + eps * mean_v log p(v)] / norm``
  with ``norm`` the number of target tokens (``'token_mean'``) or the batch
  size (``'sequence_sum'``: per-sequence sums averaged over the batch). An
  empty target (only EOS) is a valid one-token example: RECOMP's selective
  augmentation teaches the compressor to output nothing.

  Args:
    logits: ``[B, T, V]`` decoder logits aligned with ``targets``.
    targets: ``[B, T]`` target ids.
    mask: ``[B, T]`` 1 for real target tokens (EOS included), 0 for padding.
    label_smoothing: ``eps`` above.
    reduction: ``'token_mean'`` or ``'sequence_sum'``.
  Returns:
    (loss, ``{'nll_token_mean', 'nll_sequence_sum', 'accuracy', 'num_tokens', LOSS_WEIGHT}``).
  """
  mask = mask.astype(jnp.float32)
  logits = _at_least_f32(logits)
  log_p = jax.nn.log_softmax(logits, axis=-1)
  nll = -jnp.take_along_axis(log_p, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
  per_token = nll
  if label_smoothing:
    per_token = (1.0 - label_smoothing) * nll - label_smoothing * jnp.mean(log_p, axis=-1)
  loss, weight = _reduce(per_token * mask, mask, reduction)
  num_tokens = jnp.sum(mask)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * mask
  metrics = {
      'nll_token_mean': jnp.sum(nll * mask) / jnp.maximum(num_tokens, 1.0),
      'nll_sequence_sum': jnp.sum(nll * mask) / nll.shape[0],
      'accuracy': jnp.sum(correct) / jnp.maximum(num_tokens, 1.0),
      'num_tokens': num_tokens,
      LOSS_WEIGHT: weight,
  }
  return loss, metrics


# Segment ids of knowledge_injection_loss.
PROMPT_SEGMENT, KNOWLEDGE_SEGMENT, SUMMARY_SEGMENT = 0, 1, 2


def knowledge_injection_loss(logits: jax.Array, tokens: jax.Array, segment_ids: jax.Array, *,
                             knowledge_weight: float = 1.0, summary_weight: float = 1.0,
                             reduction: str = 'token_mean') -> tuple[jax.Array, dict]:
  """K-COMP's causal-mask knowledge-injection objective for a decoder-only LM.

  K-COMP (§3) maximises ``log P(E, D | P, q_m) + log P(s | E, D, P, q_m)``:
  given the passages ``P`` and the question with its entities masked
  (``q_m``), the model writes the entities with their descriptions
  (``E, D``: ``entity: description<eom>``) and then the summary ``s``. Prompt
  tokens carry no loss; the two target parts can be weighted separately
  (1, 1 gives the paper's objective).

  Args:
    logits: ``[B, T, V]`` logits at every position of ``tokens`` (position t
      predicts token t + 1).
    tokens: ``[B, T]`` the whole sequence: prompt, knowledge, summary, padding.
    segment_ids: ``[B, T]`` per token: 0 prompt or padding, 1 entity and
      description part, 2 summary part.
    knowledge_weight, summary_weight: weights of the two target parts.
    reduction: ``'token_mean'`` (over target tokens) or ``'sequence_sum'``.
  Returns:
    (loss, ``{'nll_knowledge', 'nll_summary', 'num_tokens', LOSS_WEIGHT}``) with
    per-token mean NLL of each part.
  """
  return knowledge_injection_loss_at(logits[:, :-1], tokens[:, 1:], segment_ids[:, 1:],
                                     knowledge_weight=knowledge_weight, summary_weight=summary_weight,
                                     reduction=reduction)


def knowledge_injection_loss_at(logits: jax.Array, target_ids: jax.Array, target_segments: jax.Array, *,
                                knowledge_weight: float = 1.0, summary_weight: float = 1.0,
                                reduction: str = 'token_mean') -> tuple[jax.Array, dict]:
  """:func:`knowledge_injection_loss` on logits already aligned with the tokens they predict.

  Args:
    logits: ``[B, A, V]`` the logits predicting ``target_ids`` (e.g. the head run only at the
      target positions, :func:`recomp_jax.training.recipes.knowledge_injection_loss_fn`).
    target_ids: ``[B, A]``.
    target_segments: ``[B, A]`` the segment of each predicted token (0: no loss).
  """
  log_p = token_log_probs(logits, target_ids)  # [B, A]
  seg = target_segments
  is_knowledge = (seg == KNOWLEDGE_SEGMENT).astype(jnp.float32)
  is_summary = (seg == SUMMARY_SEGMENT).astype(jnp.float32)
  weights = knowledge_weight * is_knowledge + summary_weight * is_summary
  mask = is_knowledge + is_summary
  loss, weight = _reduce(-log_p * weights, mask, reduction)
  metrics = {
      'nll_knowledge': -jnp.sum(log_p * is_knowledge) / jnp.maximum(jnp.sum(is_knowledge), 1.0),
      'nll_summary': -jnp.sum(log_p * is_summary) / jnp.maximum(jnp.sum(is_summary), 1.0),
      'num_tokens': jnp.sum(mask),
      LOSS_WEIGHT: weight,
  }
  return loss, metrics


def log1mexp(x: jax.Array) -> jax.Array:
  """``log(1 - exp(x))`` for ``x < 0``, stable near 0 and for very negative ``x``."""
  x = jnp.minimum(x, -1e-7)
  return jnp.where(x > -0.6931471805599453, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def orpo_loss(chosen_log_probs: jax.Array, chosen_mask: jax.Array, rejected_log_probs: jax.Array,
              rejected_mask: jax.Array, *, orpo_lambda: float = 0.1, length_mode: str = 'paper',
              chosen_length: jax.Array | None = None,
              rejected_length: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """ORPO with CoLoR's length regulariser.

  With ``log P(y|x)`` the token-averaged log-likelihood and
  ``log odds(y) = log P - log(1 - P)`` (computed with :func:`log1mexp`),
  ``r = log odds(y_w) - log odds(y_l)`` and ``L_OR = -log sigmoid(r)``:

  * ``length_mode='paper'`` (CoLoR eq. 2, the default):
    ``L = L_SFT(y_w) + lambda * L_OR * max(|y_l| - |y_w|, 0)``. The paper assumes the rejected
    response is always the longer one; when it is not (a short candidate that failed), the
    unclamped factor would be negative and reward the model for preferring the *rejected*
    response, so the factor is clamped at 0 (that pair trains the SFT term only). CoLoR's
    pipeline drops such pairs before training and counts them;
  * ``length_mode='released_code'`` (the authors' released code scales the
    log-odds *inside* the sigmoid):
    ``L = L_SFT + lambda * -log sigmoid(r * max(0.1 * (|y_l| - |y_w|), 1))``;
  * ``length_mode='none'``: plain ORPO, ``L = L_SFT + lambda * L_OR``.

  ``L_SFT`` is the chosen response's token-mean negative log-likelihood, averaged over pairs (ORPO
  paper eq. 6). TRL's ``ORPOTrainer`` takes one token mean over all chosen tokens of the batch
  instead; the two agree when the chosen responses have equal lengths, and the odds-ratio term
  equals TRL's ``odds_ratio_loss`` exactly (``tests/test_losses.py``).

  Args:
    chosen_log_probs, rejected_log_probs: ``[B, Tw]`` / ``[B, Tl]`` per-token
      log-probabilities of the responses (see :func:`token_log_probs`).
    chosen_mask, rejected_mask: ``[B, Tw]`` / ``[B, Tl]`` 1 on response tokens.
    orpo_lambda: ``lambda``.
    length_mode: ``'paper'``, ``'released_code'`` or ``'none'``.
    chosen_length, rejected_length: ``[B]`` lengths ``|y|``; default: the
      number of response tokens.
  Returns:
    (batch-mean loss, ``{'sft', 'odds_ratio_loss', 'log_odds_ratio',
    'preference_accuracy'}``).
  """
  chosen_mask = chosen_mask.astype(jnp.float32)
  rejected_mask = rejected_mask.astype(jnp.float32)
  n_w = jnp.maximum(jnp.sum(chosen_mask, axis=-1), 1.0)
  n_l = jnp.maximum(jnp.sum(rejected_mask, axis=-1), 1.0)
  avg_w = jnp.sum(_at_least_f32(chosen_log_probs) * chosen_mask, axis=-1) / n_w  # [B]
  avg_l = jnp.sum(_at_least_f32(rejected_log_probs) * rejected_mask, axis=-1) / n_l
  log_odds = (avg_w - log1mexp(avg_w)) - (avg_l - log1mexp(avg_l))  # [B]
  len_w = jnp.sum(chosen_mask, axis=-1) if chosen_length is None else chosen_length
  len_l = jnp.sum(rejected_mask, axis=-1) if rejected_length is None else rejected_length
  length_gap = (len_l - len_w).astype(jnp.float32)
  if length_mode == 'paper':
    odds_loss = -jax.nn.log_sigmoid(log_odds) * jnp.maximum(length_gap, 0.0)
  elif length_mode == 'released_code':
    odds_loss = -jax.nn.log_sigmoid(log_odds * jnp.maximum(0.1 * length_gap, 1.0))
  elif length_mode == 'none':
    odds_loss = -jax.nn.log_sigmoid(log_odds)
  else:
    raise ValueError(f"length_mode must be 'paper', 'released_code' or 'none', got {length_mode!r}")
  sft = -avg_w
  loss = jnp.mean(sft + orpo_lambda * odds_loss)
  metrics = {
      'sft': jnp.mean(sft),
      'odds_ratio_loss': jnp.mean(odds_loss),
      'log_odds_ratio': jnp.mean(log_odds),
      'preference_accuracy': jnp.mean((log_odds > 0).astype(jnp.float32)),
  }
  return loss, metrics
