"""Reader scoring: teacher-forced ``log p(target | context)`` and exact match of greedy answers.

Log-likelihood (RECOMP's labelling signal, the NQ protocol's `` {answer}`` after
``Answer:``) is computed by one sharded, jitted function per batch shape:

* the transformer body runs over the whole (context, target) sequence, but the
  output head runs only at the ``A`` target positions, in vocabulary chunks
  (:func:`target_log_probs`: a ``fori_loop`` over ``[C, D]`` slices of the
  head with a running max / sum-of-exponentials, plus the target logit
  gathered directly), so a 262k vocabulary never materialises
  ``[B, T, V]`` logits; Gemma's final logit soft-cap is applied per chunk
  before the log-sum-exp;
* lengths are padded to buckets (:data:`LENGTH_BUCKETS`,
  :data:`TARGET_BUCKETS` via :func:`recomp_jax.data.buckets.bucket_length`), the
  batch to a fixed size, so a run compiles a handful of programs;
* with a mesh, the batch's leading axis is split over ``('data', 'fsdp')``
  (:func:`recomp_jax.sharding.batch_sharding`), the parameters follow the
  logical-axis rules (:func:`recomp_jax.sharding.place_on_mesh`) and the small
  per-example results are gathered to every device (every process passes the
  same examples and reads every score).

:class:`CausalScorer` (Gemma) scores ``BOS + context`` followed by the
target's tokens (no special tokens), right-padded. Its shared-prefix path
(:meth:`CausalScorer.score_with_shared_prefix`) encodes a prefix (few-shot
block, instructions) once into a batch-1 KV cache, tiles it to the candidate
batch and appends each candidate (suffix + target) as one more cached prefill:
the prefix costs one forward pass, not one per candidate. The prefix is
left-padded to its bucket (padding slots are masked and positions count real
tokens only), so real tokens stay contiguous and the continuation is exact
also across sliding-window boundaries (the ring buffer of a sliding layer
always holds the last ``window`` indices a chunk query can see).

:class:`Seq2SeqScorer` (T5) encodes the context and scores the decoder labels
(target tokens, plus EOS by default).

Exact match: :func:`answer_and_score` runs a batched greedy generator (Gemma:
:class:`recomp_jax.models.generation.GemmaGenerator`; T5:
:class:`recomp_jax.models.generation.T5Generator`) with the protocol's 12 new tokens cut at the first
newline, and scores with SQuAD normalisation (:func:`recomp_jax.evaluation.qa_metrics.qa_scores`).

Shapes: ``B`` batch, ``T`` sequence (or chunk) length, ``A`` target slots,
``P`` prefix length, ``D`` embed, ``V`` vocab, ``C`` vocabulary chunk.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recomp_jax import sharding
from recomp_jax.data.buckets import TARGET_BUCKETS, bucket_length, pad_rows
from recomp_jax.models.gemma import DecodeCache, GemmaModel
from recomp_jax.models.t5 import T5Model

# Sequence-length buckets (<= 12.5% padding above 256 tokens); targets use data.buckets.TARGET_BUCKETS.
LENGTH_BUCKETS = (16, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 384, 448, 512, 576, 640, 768,
                  896, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096)
DEFAULT_VOCAB_CHUNK = 16384
# Bytes of gathered KV cache one corpus-scoring call may hold: every continuation row carries a
# copy of its query's cache (score_ids_after_queries), 216 MB a row for Gemma 3 270M at 32k tokens.
CONTINUATION_CACHE_BYTES = 2 << 30


# ----------------------------------------------------------------------------- chunked head


@dataclasses.dataclass(frozen=True)
class OutputHead:
  """A model's output projection, as the chunked head needs it (built inside a trace).

  Attributes:
    weight: ``[V, D]`` (``vocab_major``, a tied embedding) or ``[D, V]`` (an ``lm_head`` kernel).
    vocab_major: layout of ``weight``.
    hidden_scale: multiplies the hidden states first (T5 v1.0: ``D ** -0.5``), or None.
    softcap: final logit soft-cap ``cap * tanh(logits / cap)`` (Gemma 2/3), or None.
    dtype: compute dtype of the matmul (accumulation is always float32).
  """
  weight: jax.Array
  vocab_major: bool
  hidden_scale: float | None
  softcap: float | None
  dtype: Any

  @property
  def vocab_size(self) -> int:
    return self.weight.shape[0 if self.vocab_major else 1]


def output_head(model: nnx.Module) -> OutputHead:
  """The :class:`OutputHead` of a :class:`GemmaModel` or a :class:`T5Model` with a decoder."""
  if isinstance(model, GemmaModel):
    if model.lm_head is None:
      weight, vocab_major = model.embedder.embedding[...], True
    else:
      weight, vocab_major = model.lm_head.kernel[...], False
    return OutputHead(weight, vocab_major, None, model.config.final_logit_softcapping, model.dtype)
  if isinstance(model, T5Model):
    if model.decoder is None:
      raise ValueError('this T5 model is encoder-only (T5EncoderModel): it has no output head')
    if model.lm_head is None:
      weight, vocab_major = model.shared.embedding[...], True
    else:
      weight, vocab_major = model.lm_head.kernel[...], False
    scale = model.config.d_model ** -0.5 if model.config.scale_decoder_outputs else None
    return OutputHead(weight, vocab_major, scale, None, model.dtype)
  raise TypeError(f'no output head known for {type(model).__name__}')


def _softcap(logits: jax.Array, cap: float | None) -> jax.Array:
  return logits if cap is None else jnp.tanh(logits / cap) * cap


def target_log_probs(hidden: jax.Array, targets: jax.Array, head: OutputHead, *,
                     vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> jax.Array:
  """``log softmax(head(hidden))[targets]`` without materialising ``[B, A, V]`` logits.

  The vocabulary is visited in ``V // C`` chunks of ``C`` rows (a
  ``fori_loop``; a remainder chunk runs once after it) keeping a running
  maximum ``m`` and ``s = sum exp(logits - m)``; the target's logit is one
  gathered row per token. Peak memory is ``[B, A, C]``.

  Args:
    hidden: ``[B, A, D]`` final hidden states of the positions predicting each target.
    targets: ``[B, A]`` int target token ids.
    head: from :func:`output_head`.
    vocab_chunk: ``C``.
  Returns:
    ``[B, A]`` float32 log-probabilities.
  """
  if head.hidden_scale is not None:
    hidden = hidden * head.hidden_scale
  h = hidden.astype(head.dtype)                                        # [B, A, D]
  vocab = head.vocab_size
  chunk = max(1, min(int(vocab_chunk), vocab))
  num_full = vocab // chunk
  axis = 0 if head.vocab_major else 1
  matmul = 'BAD,VD->BAV' if head.vocab_major else 'BAD,DV->BAV'

  def logits_of(weight_chunk):                                        # [C, D] or [D, C]
    logits = jnp.einsum(matmul, h, weight_chunk.astype(head.dtype),
                        preferred_element_type=jnp.float32)           # [B, A, C]
    return _softcap(logits, head.softcap)

  def accumulate(carry, logits):
    running_max, sum_exp = carry                                      # [B, A] each
    new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
    sum_exp = (sum_exp * jnp.exp(running_max - new_max)
               + jnp.sum(jnp.exp(logits - new_max[..., None]), axis=-1))
    return new_max, sum_exp

  def body(i, carry):
    weight_chunk = jax.lax.dynamic_slice_in_dim(head.weight, i * chunk, chunk, axis=axis)
    return accumulate(carry, logits_of(weight_chunk))

  shape = targets.shape
  carry = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32))
  carry = jax.lax.fori_loop(0, num_full, body, carry)
  if num_full * chunk < vocab:
    tail = jax.lax.slice_in_dim(head.weight, num_full * chunk, vocab, axis=axis)
    carry = accumulate(carry, logits_of(tail))
  running_max, sum_exp = carry
  log_z = running_max + jnp.log(sum_exp)                              # [B, A]

  targets = targets.astype(jnp.int32)
  if head.vocab_major:
    rows = jnp.take(head.weight, targets, axis=0).astype(head.dtype)  # [B, A, D]
    picked = jnp.einsum('BAD,BAD->BA', h, rows, preferred_element_type=jnp.float32)
  else:
    cols = jnp.take(head.weight, targets, axis=1).astype(head.dtype)  # [D, B, A]
    picked = jnp.einsum('BAD,DBA->BA', h, cols, preferred_element_type=jnp.float32)
  return _softcap(picked, head.softcap) - log_z


# ----------------------------------------------------------------------------- pure scoring fns


class LogLikelihood(NamedTuple):
  """Per-example target log-likelihoods (a pytree).

  Attributes:
    total: ``[B]`` float32 sum of ``log p`` over the target tokens.
    token_log_probs: ``[B, A]`` float32 per target token (0 in padding slots).
    num_tokens: ``[B]`` int32 number of target tokens.
  """
  total: jax.Array
  token_log_probs: jax.Array
  num_tokens: jax.Array


def _log_likelihood(hidden: jax.Array, predict_index: jax.Array, target_ids: jax.Array,
                    target_mask: jax.Array, head: OutputHead, vocab_chunk: int) -> LogLikelihood:
  """Gathers ``hidden [B, T, D]`` at ``predict_index [B, A]`` and scores ``target_ids [B, A]``."""
  h = jnp.take_along_axis(hidden, predict_index[..., None].astype(jnp.int32), axis=1)  # [B, A, D]
  h = sharding.with_logical_constraint(h, ('batch', None, 'embed'))
  mask = target_mask.astype(bool)
  log_probs = jnp.where(mask, target_log_probs(h, target_ids, head, vocab_chunk=vocab_chunk), 0.0)
  return LogLikelihood(jnp.sum(log_probs, axis=-1), log_probs,
                       jnp.sum(mask, axis=-1, dtype=jnp.int32))


def causal_log_likelihood(model: GemmaModel, input_ids: jax.Array, attention_mask: jax.Array,
                          predict_index: jax.Array, target_ids: jax.Array, target_mask: jax.Array,
                          *, vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> LogLikelihood:
  """Teacher-forced target log-likelihood of a decoder-only LM.

  Args:
    model: a causal :class:`GemmaModel`.
    input_ids: ``[B, T]`` context then target tokens, padded (any side).
    attention_mask: ``[B, T]`` 1 = real token.
    predict_index: ``[B, A]`` index ``t`` whose hidden state predicts each target
      token (the token at ``t + 1``).
    target_ids: ``[B, A]`` target token ids.
    target_mask: ``[B, A]`` 1 = a real target token.
    vocab_chunk: rows of the head per chunk.
  """
  hidden = model.hidden_states(input_ids, attention_mask)                       # [B, T, D]
  return _log_likelihood(hidden, predict_index, target_ids, target_mask, output_head(model),
                         vocab_chunk)


def seq2seq_log_likelihood(model: T5Model, input_ids: jax.Array, attention_mask: jax.Array,
                           labels: jax.Array, label_mask: jax.Array, *,
                           vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> LogLikelihood:
  """Teacher-forced log-likelihood of decoder ``labels [B, A]`` given encoder ``input_ids [B, S]``.

  The decoder reads ``[decoder_start] + labels[:-1]``; ``label_mask [B, A]`` marks real labels
  (right-padded).
  """
  start = jnp.full(labels[:, :1].shape, model.config.decoder_start_token_id, labels.dtype)
  decoder_ids = jnp.concatenate([start, labels[:, :-1]], axis=1)                 # [B, A]
  decoder_mask = jnp.concatenate([jnp.ones_like(label_mask[:, :1]), label_mask[:, :-1]], axis=1)
  encoded = model.encode(input_ids, attention_mask)                              # [B, S, D]
  hidden = model.decode_hidden(decoder_ids, encoded, attention_mask, decoder_mask)  # [B, A, D]
  index = jnp.broadcast_to(jnp.arange(labels.shape[1], dtype=jnp.int32), labels.shape)
  return _log_likelihood(hidden, index, labels, label_mask, output_head(model), vocab_chunk)


class PrefixState(NamedTuple):
  """A prompt prefix encoded once: its batch-1 KV cache and its last hidden state ``[1, D]``."""
  cache: DecodeCache
  last_hidden: jax.Array


def encode_prefix(model: GemmaModel, prefix_ids: jax.Array, prefix_mask: jax.Array,
                  capacity: int, slack: int = 0) -> PrefixState:
  """Prefills ``prefix_ids [1, P]`` (left-padded, ``prefix_mask [1, P]``) into a cache of ``capacity``
  (sliding layers' rings with ``slack`` extra slots), a long prefix chunk by chunk."""
  cache = model.init_cache(prefix_ids.shape[0], capacity, ring_slack=slack)
  last, cache = model.prefill_in_chunks(prefix_ids, prefix_mask, cache)
  return PrefixState(cache, last)


def _batch_constrained(cache: DecodeCache) -> DecodeCache:
  """Shards every per-row cache leaf on its leading axis (no-op without a mesh)."""
  def one(x):
    return x if x.ndim == 0 else sharding.with_logical_constraint(x, ('batch',) + (None,) * (x.ndim - 1))
  return jax.tree.map(one, cache)


def continuation_log_likelihood(model: GemmaModel, prefix: PrefixState, input_ids: jax.Array,
                                attention_mask: jax.Array, predict_index: jax.Array,
                                target_ids: jax.Array, target_mask: jax.Array,
                                prefix_rows: jax.Array | None = None, *,
                                vocab_chunk: int = DEFAULT_VOCAB_CHUNK) -> LogLikelihood:
  """Target log-likelihood of ``B`` continuations of ``G`` encoded prefixes.

  Args:
    model: a causal :class:`GemmaModel`.
    prefix: from :func:`encode_prefix` with ``G`` rows. Without ``prefix_rows`` each row is
      repeated ``R = B // G`` times here, so rows ``g * R ... g * R + R - 1`` continue prefix ``g``.
    input_ids: ``[B, T]`` suffix then target tokens, right-padded.
    attention_mask: ``[B, T]`` 1 = real token.
    predict_index: ``[B, A]`` index into ``[prefix's last token, chunk tokens 0..T-1]``
      of the hidden state predicting each target token: a target at chunk index
      ``j`` has ``predict_index = j``.
    target_ids, target_mask: ``[B, A]``.
    prefix_rows: ``[B]`` int, the prefix each row continues (any number of rows per prefix),
      in place of the ``R`` repeats.
  """
  batch, groups = input_ids.shape[0], prefix.last_hidden.shape[0]
  if prefix_rows is None:
    if batch % groups:
      raise ValueError(f'{batch} continuation rows do not divide over {groups} prefixes')
    prefix_rows = jnp.repeat(jnp.arange(groups, dtype=jnp.int32), batch // groups)
  cache = _batch_constrained(prefix.cache.take(prefix_rows))
  hidden, _ = model.prefill(input_ids, attention_mask, cache, return_hidden=True)  # [B, T, D]
  last = jnp.take(prefix.last_hidden, prefix_rows, axis=0)[:, None].astype(hidden.dtype)
  hidden = jnp.concatenate([last, hidden], axis=1)                                 # [B, 1+T, D]
  return _log_likelihood(hidden, predict_index, target_ids, target_mask, output_head(model),
                         vocab_chunk)


def extend_prefix(model: GemmaModel, prefix: PrefixState, input_ids: jax.Array,
                  attention_mask: jax.Array) -> PrefixState:
  """``G`` continuations of one encoded prefix, each kept as a prefix of its own.

  Args:
    prefix: a batch-1 :class:`PrefixState` whose cache has ring slack for the padding of
      ``input_ids`` (:meth:`GemmaModel.init_cache`'s ``ring_slack``).
    input_ids, attention_mask: ``[G, T]`` left-padded continuations (e.g. one query each after
      a corpus shared by all).
  Returns:
    a ``G``-row :class:`PrefixState` for :func:`continuation_log_likelihood`.
  """
  cache = _batch_constrained(prefix.cache.take(jnp.zeros((input_ids.shape[0],), jnp.int32)))
  hidden, cache = model.prefill(input_ids, attention_mask, cache, return_hidden=True)  # [G, T, D]
  return PrefixState(cache, hidden[:, -1])


# ----------------------------------------------------------------------------- jitted entry points


def _replicated(tree):
  """Gathers the (small) per-example results onto every device, so every process can read them."""
  if jax.sharding.get_abstract_mesh().empty:
    return tree
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec()),
                      tree)


@functools.partial(jax.jit, static_argnames=('graphdef', 'vocab_chunk'))
def _causal_jit(graphdef, state, batch, *, vocab_chunk):
  return _replicated(causal_log_likelihood(nnx.merge(graphdef, state), **batch,
                                           vocab_chunk=vocab_chunk))


@functools.partial(jax.jit, static_argnames=('graphdef', 'vocab_chunk'))
def _seq2seq_jit(graphdef, state, batch, *, vocab_chunk):
  return _replicated(seq2seq_log_likelihood(nnx.merge(graphdef, state), **batch,
                                            vocab_chunk=vocab_chunk))


@functools.partial(jax.jit, static_argnames=('graphdef', 'capacity'))
def _prefix_jit(graphdef, state, prefix_ids, prefix_mask, *, capacity):
  return encode_prefix(nnx.merge(graphdef, state), prefix_ids, prefix_mask, capacity)


@functools.partial(jax.jit, static_argnames=('graphdef', 'capacity', 'slack'))
def _slack_prefix_jit(graphdef, state, prefix_ids, prefix_mask, *, capacity, slack):
  return encode_prefix(nnx.merge(graphdef, state), prefix_ids, prefix_mask, capacity, slack)


@functools.partial(jax.jit, static_argnames=('graphdef',))
def _extend_jit(graphdef, state, prefix, input_ids, attention_mask):
  return extend_prefix(nnx.merge(graphdef, state), prefix, input_ids, attention_mask)


@functools.partial(jax.jit, static_argnames=('graphdef', 'vocab_chunk'))
def _continuation_jit(graphdef, state, prefix, batch, *, vocab_chunk):
  return _replicated(continuation_log_likelihood(nnx.merge(graphdef, state), prefix, **batch,
                                                 vocab_chunk=vocab_chunk))


# ----------------------------------------------------------------------------- host-side batching


@dataclasses.dataclass
class Scores:
  """Host-side results for ``N`` examples, in input order.

  Attributes:
    total: ``[N]`` float32 sum of target-token log-probabilities.
    num_tokens: ``[N]`` int number of target tokens.
    token_log_probs: ``N`` arrays ``[num_tokens[i]]`` of per-token log-probabilities.
  """
  total: np.ndarray
  num_tokens: np.ndarray
  token_log_probs: list[np.ndarray]

  @property
  def mean(self) -> np.ndarray:
    """``[N]`` per-token mean log-probability (0 for an empty target)."""
    return self.total / np.maximum(self.num_tokens, 1)

  def reduce(self, reduction: str) -> np.ndarray:
    if reduction == 'sum':
      return self.total
    if reduction == 'mean':
      return self.mean
    raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")


def _targets(targets: Sequence[Sequence[int]], starts: Sequence[int], slots: int
             ) -> dict[str, np.ndarray]:
  """``predict_index / target_ids / target_mask [B, slots]``: target ``k`` of row ``i`` is
  predicted by hidden state ``starts[i] + k``."""
  index = np.zeros((len(targets), slots), np.int32)
  ids, mask = pad_rows(targets, slots, 0)
  for i, (target, start) in enumerate(zip(targets, starts)):
    index[i, :len(target)] = start + np.arange(len(target))
  return {'predict_index': index, 'target_ids': ids, 'target_mask': mask}


def _batches(lengths: Sequence[int], batch_size: int) -> list[np.ndarray]:
  """Example indices sorted by length (longest first), cut into batches."""
  order = np.argsort(-np.asarray(lengths), kind='stable')
  return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def _fill(rows: list, batch_size: int) -> list:
  """Pads a short last batch with repeats of its last row (one compiled batch size)."""
  return rows + [rows[-1]] * (batch_size - len(rows))


def _collect(results: list[tuple[np.ndarray, LogLikelihood]], n: int) -> Scores:
  total = np.zeros((n,), np.float32)
  num_tokens = np.zeros((n,), np.int32)
  per_token: list[np.ndarray | None] = [None] * n
  for index, ll in results:
    ll = jax.device_get(ll)
    k = len(index)
    total[index] = ll.total[:k]
    num_tokens[index] = ll.num_tokens[:k]
    for row, i in enumerate(index):
      per_token[i] = np.asarray(ll.token_log_probs[row, :ll.num_tokens[row]], np.float32)
  return Scores(total, num_tokens, per_token)


class _Scorer:
  """Batching, bucketing and mesh placement shared by the two scorers."""

  def __init__(self, model: nnx.Module, tokenizer, *, batch_size: int, mesh, vocab_chunk: int,
               length_buckets: Sequence[int], target_buckets: Sequence[int]):
    self.model = model
    self.tokenizer = tokenizer
    self.batch_size = int(batch_size)
    self.mesh = mesh
    self.vocab_chunk = int(vocab_chunk)
    self.length_buckets = tuple(length_buckets)
    self.target_buckets = tuple(target_buckets)
    if mesh is not None:
      shards = sharding.batch_shards(mesh)
      if self.batch_size % shards:
        raise ValueError(f'batch_size={batch_size} is not a multiple of the {shards} batch shards '
                         f'of mesh {dict(mesh.shape)}')
      sharding.place_on_mesh(model, mesh)
    pad = getattr(tokenizer, 'pad_token_id', None) if tokenizer is not None else None
    self.pad_id = int(pad if pad is not None else 0)

  def _length(self, n: int) -> int:
    return bucket_length(max(n, 1), self.length_buckets)

  def _slots(self, n: int) -> int:
    return bucket_length(max(n, 1), self.target_buckets)

  def _put(self, batch):
    """Numpy batch -> device arrays; with a mesh, split over the batch axes ``('data', 'fsdp')``.

    Every process holds the same examples and passes the whole (global) batch; each
    device takes its rows of it.
    """
    if self.mesh is None:
      return jax.tree.map(jnp.asarray, batch)
    spec = sharding.batch_sharding(self.mesh)
    return jax.tree.map(lambda x: jax.make_array_from_callback(x.shape, spec, lambda i: x[i]), batch)

  def _run(self, fn: Callable, *args, **kwargs):
    if self.mesh is None:
      return fn(*args, **kwargs)
    with sharding.use_mesh(self.mesh):
      return fn(*args, **kwargs)

  def _encode(self, texts: Sequence[str], special: bool) -> list[list[int]]:
    if not texts:
      return []
    return [list(ids) for ids in self.tokenizer(list(texts), add_special_tokens=special)['input_ids']]

  @staticmethod
  def _check_lengths(a: Sequence, b: Sequence, what: str) -> None:
    if len(a) != len(b):
      raise ValueError(f'{len(a)} {what} for {len(b)} targets')


class CausalScorer(_Scorer):
  """``log p(target | context)`` under a causal (decoder-only) LM, from strings.

  The context is tokenised with the tokenizer's special tokens (BOS for Gemma),
  the target without, and appended right after (the NQ protocol scores
  `` {answer}`` after ``'...\\nAnswer:'``). Examples are sorted by length,
  right-padded to a length bucket and run in batches of ``batch_size`` (the
  last one filled with repeats).

  Args:
    model: a causal :class:`GemmaModel` (float32 or bfloat16 compute).
    tokenizer: a Hugging Face tokenizer (``tokenizer(texts, add_special_tokens=...)``).
    batch_size: rows per compiled call; a multiple of the mesh's batch shards.
    mesh: optional :func:`recomp_jax.sharding.make_mesh` mesh; the model is placed
      on it in place (:func:`recomp_jax.sharding.place_on_mesh`) and each batch is
      split over its ``('data', 'fsdp')`` axes.
    vocab_chunk: vocabulary rows per head chunk.
    length_buckets, target_buckets: padded lengths of sequences and targets.
  """

  def __init__(self, model: GemmaModel, tokenizer=None, *, batch_size: int = 16, mesh=None,
               vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
               length_buckets: Sequence[int] = LENGTH_BUCKETS,
               target_buckets: Sequence[int] = TARGET_BUCKETS):
    if getattr(model.config, 'use_bidirectional_attention', False):
      raise ValueError('a bidirectional Gemma is not a causal LM; it cannot score continuations')
    super().__init__(model, tokenizer, batch_size=batch_size, mesh=mesh, vocab_chunk=vocab_chunk,
                     length_buckets=length_buckets, target_buckets=target_buckets)

  # -- full strings --------------------------------------------------------------

  def score(self, contexts: Sequence[str], targets: Sequence[str], *,
            reduction: str = 'sum') -> np.ndarray:
    """``[N]`` float32 ``log p(target_i | context_i)`` summed (or ``'mean'``) over target tokens."""
    return self.score_details(contexts, targets).reduce(reduction)

  def score_details(self, contexts: Sequence[str], targets: Sequence[str]) -> Scores:
    """Like :meth:`score`, with per-token log-probabilities and token counts."""
    self._check_lengths(contexts, targets, 'contexts')
    return self.score_ids(self._encode(contexts, True), self._encode(targets, False))

  def score_ids(self, context_ids: Sequence[Sequence[int]],
                target_ids: Sequence[Sequence[int]]) -> Scores:
    """Token-level :meth:`score_details`: ``context_ids`` already include BOS."""
    self._check_lengths(context_ids, target_ids, 'contexts')
    if any(len(c) == 0 for c in context_ids):
      raise ValueError('every context needs at least one token (BOS) to predict the target from')
    graphdef, state = nnx.split(self.model)
    lengths = [len(c) + len(t) for c, t in zip(context_ids, target_ids)]
    results = []
    for index in _batches(lengths, self.batch_size):
      rows = _fill(list(index), self.batch_size)
      contexts = [list(context_ids[i]) for i in rows]
      targets = [list(target_ids[i]) for i in rows]
      ids, mask = pad_rows([c + t for c, t in zip(contexts, targets)],
                            self._length(max(lengths[i] for i in rows)), self.pad_id)
      batch = {'input_ids': ids, 'attention_mask': mask,
               **_targets(targets, [len(c) - 1 for c in contexts],
                          self._slots(max(len(t) for t in targets)))}
      out = self._run(_causal_jit, graphdef, state, self._put(batch), vocab_chunk=self.vocab_chunk)
      results.append((index, out))
    return _collect(results, len(context_ids))

  # -- shared prefix -------------------------------------------------------------

  def score_with_shared_prefix(self, prefix: str, suffixes: Sequence[str], targets: Sequence[str],
                               *, reduction: str = 'sum') -> np.ndarray:
    """``[N]`` ``log p(target_i | prefix + suffix_i)``, encoding ``prefix`` once.

    ``prefix`` is tokenised with special tokens (BOS), suffixes and targets
    without, so the result equals :meth:`score` on ``prefix + suffix_i``
    whenever the tokenizer splits the joined string at the prefix boundary
    too (e.g. a prefix ending in ``'\\n\\n'`` for Gemma).
    """
    return self.score_details_with_shared_prefix(prefix, suffixes, targets).reduce(reduction)

  def score_details_with_shared_prefix(self, prefix: str, suffixes: Sequence[str],
                                       targets: Sequence[str]) -> Scores:
    self._check_lengths(suffixes, targets, 'suffixes')
    return self.score_ids_with_shared_prefix(self._encode([prefix], True)[0],
                                             self._encode(suffixes, False),
                                             self._encode(targets, False))

  def score_ids_with_shared_prefix(self, prefix_ids: Sequence[int],
                                   suffix_ids: Sequence[Sequence[int]],
                                   target_ids: Sequence[Sequence[int]]) -> Scores:
    """Token-level shared-prefix scoring (``prefix_ids`` include BOS).

    The prefix is left-padded to its bucket and prefilled once into a batch-1
    cache sized for the longest candidate; each batch of candidates (suffix +
    target, right-padded to a chunk bucket) is one more prefill on the tiled
    cache, and the head runs at the target positions only.
    """
    self._check_lengths(suffix_ids, target_ids, 'suffixes')
    if not prefix_ids:
      raise ValueError('the shared prefix is empty; use score_ids')
    if not suffix_ids:
      return Scores(np.zeros((0,), np.float32), np.zeros((0,), np.int32), [])
    graphdef, state = nnx.split(self.model)
    lengths = [len(s) + len(t) for s, t in zip(suffix_ids, target_ids)]
    prefix_len = self._length(len(prefix_ids))
    capacity = prefix_len + self._length(max(lengths))
    ids, mask = pad_rows([list(prefix_ids)], prefix_len, self.pad_id, left=True)
    if self.mesh is not None:
      replicated = sharding.replicated(self.mesh)
      ids, mask = (jax.make_array_from_callback(x.shape, replicated, lambda i, x=x: x[i])
                   for x in (ids, mask))
    prefix = self._run(_prefix_jit, graphdef, state, ids, mask, capacity=capacity)
    results = []
    for index in _batches(lengths, self.batch_size):
      rows = _fill(list(index), self.batch_size)
      suffixes = [list(suffix_ids[i]) for i in rows]
      targets = [list(target_ids[i]) for i in rows]
      chunk_ids, chunk_mask = pad_rows([s + t for s, t in zip(suffixes, targets)],
                                        self._length(max(lengths[i] for i in rows)), self.pad_id)
      batch = {'input_ids': chunk_ids, 'attention_mask': chunk_mask,
               **_targets(targets, [len(s) for s in suffixes],
                          self._slots(max(len(t) for t in targets)))}
      out = self._run(_continuation_jit, graphdef, state, prefix, self._put(batch),
                      vocab_chunk=self.vocab_chunk)
      results.append((index, out))
    return _collect(results, len(suffix_ids))

  def score_ids_with_prefixes(self, prefix_ids: Sequence[Sequence[int]], owners: Sequence[int],
                              suffix_ids: Sequence[Sequence[int]],
                              target_ids: Sequence[Sequence[int]]) -> Scores:
    """Many candidates for each of many prefixes: candidate ``i`` is ``log p(target_i |
    prefix_{owners[i]} + suffix_i)``, each prefix encoded once (``prefix_ids`` include BOS).

    The batched form of :meth:`score_ids_with_shared_prefix` (e.g. every sentence a filter
    model could write after its own prompt). Prefixes are taken longest first, in windows of
    at most ``batch_size``: a window's prefixes are left-padded to the bucket of its longest
    and prefilled in one call (``G`` slots, a power of two, :func:`prefix_slots`); then every
    candidate of the window, sorted by length, runs in calls of ``batch_size`` rows, each row
    gathering its own prefix's cache. So rows of one call pad to similar lengths whatever
    prefix they continue, and a prefix with 3 candidates costs no more rows than 3. Every
    cache holds the longest candidate of the run (one cache length: fewer compiled shapes).
    With a mesh, the ``G`` prefixes are split over the batch axes when they divide evenly
    (else each device prefills all of them); the rows always are.
    """
    self._check_lengths(suffix_ids, target_ids, 'suffixes')
    self._check_lengths(owners, target_ids, 'owners')
    if not target_ids:
      return Scores(np.zeros((0,), np.float32), np.zeros((0,), np.int32), [])
    if any(not 0 <= g < len(prefix_ids) for g in owners):
      raise ValueError(f'owners must index the {len(prefix_ids)} prefixes')
    if any(len(prefix_ids[g]) == 0 for g in set(owners)):
      raise ValueError('every prefix needs at least one token (BOS)')
    lengths = [len(a) + len(t) for a, t in zip(suffix_ids, target_ids)]
    members: dict[int, list[int]] = {}
    for i, g in enumerate(owners):
      members.setdefault(int(g), []).append(i)
    used = sorted(members, key=lambda g: -len(prefix_ids[g]))
    row_capacity = self._length(max(lengths))
    graphdef, state = nnx.split(self.model)
    results = []
    for start in range(0, len(used), self.batch_size):
      window = used[start:start + self.batch_size]
      slots = prefix_slots(len(window), self.batch_size)
      prefix_len = self._length(len(prefix_ids[window[0]]))
      ids, mask = pad_rows([list(prefix_ids[g]) for g in _fill(window, slots)], prefix_len, self.pad_id, left=True)
      if self.mesh is not None and slots % sharding.batch_shards(self.mesh) == 0:
        ids, mask = self._put((ids, mask))  # each device prefills its share of the prefixes
      elif self.mesh is not None:
        replicated = sharding.replicated(self.mesh)
        ids, mask = (jax.make_array_from_callback(x.shape, replicated, lambda i, x=x: x[i])
                     for x in (ids, mask))
      prefix = self._run(_prefix_jit, graphdef, state, ids, mask, capacity=prefix_len + row_capacity)
      slot = {g: k for k, g in enumerate(window)}
      candidates = [i for g in window for i in members[g]]
      for order in _batches([lengths[i] for i in candidates], self.batch_size):
        index = np.asarray([candidates[j] for j in order])
        rows = _fill(index.tolist(), self.batch_size)
        suffixes = [list(suffix_ids[i]) for i in rows]
        targets = [list(target_ids[i]) for i in rows]
        chunk_ids, chunk_mask = pad_rows([a + t for a, t in zip(suffixes, targets)],
                                          self._length(max(lengths[i] for i in rows)), self.pad_id)
        batch = {'input_ids': chunk_ids, 'attention_mask': chunk_mask,
                 'prefix_rows': np.asarray([slot[owners[i]] for i in rows], np.int32),
                 **_targets(targets, [len(a) for a in suffixes], self._slots(max(len(t) for t in targets)))}
        out = self._run(_continuation_jit, graphdef, state, prefix, self._put(batch),
                        vocab_chunk=self.vocab_chunk)
        results.append((index, out))
    return _collect(results, len(target_ids))


  def rows_within_cache_budget(self, capacity: int, slack: int) -> int:
    """Rows per call of :meth:`score_ids_after_queries` for a cache of ``capacity`` token indices:
    ``batch_size``, halved while the rows' copies of the cache exceed :data:`CONTINUATION_CACHE_BYTES`
    (never below the mesh's batch shards). For Gemma 3 270M at 32 rows: a 2k-token corpus keeps 32, 8k 16, 32k 8."""
    shapes = jax.eval_shape(lambda: self.model.init_cache(1, capacity, ring_slack=slack))  # nothing allocated
    row_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    floor = sharding.batch_shards(self.mesh) if self.mesh is not None else 1
    rows = self.batch_size
    while rows * row_bytes > CONTINUATION_CACHE_BYTES and rows % 2 == 0 and (rows // 2) % floor == 0:
      rows //= 2
    return rows

  def score_ids_after_queries(self, prefix_ids: Sequence[int], query_ids: Sequence[Sequence[int]],
                              owners: Sequence[int], target_ids: Sequence[Sequence[int]]) -> Scores:
    """Two levels of sharing: candidate ``i`` is ``log p(target_i | prefix + query_{owners[i]})``.

    The prefix (e.g. a corpus in context, BOS included) is prefilled once; each window of
    ``batch_size`` queries is left-padded to its bucket and prefilled on the tiled prefix
    cache once (:func:`extend_prefix`); then every candidate of the window (e.g. each passage
    ID a query could name), sorted by length, runs in calls of ``batch_size`` rows that gather
    their query's cache. So a query with ``N`` candidates costs its own tokens once plus the
    ``N`` short targets, not ``N`` copies of itself, and the prefix is never re-encoded.
    Equal to :meth:`score_ids` on the concatenations: RoPE positions count real tokens only
    and the sliding layers' rings get slack for the padding between prefix and query.
    """
    self._check_lengths(owners, target_ids, 'owners')
    if not target_ids:
      return Scores(np.zeros((0,), np.float32), np.zeros((0,), np.int32), [])
    if not prefix_ids:
      raise ValueError('the shared prefix is empty (it needs at least BOS)')
    if any(not 0 <= g < len(query_ids) for g in owners):
      raise ValueError(f'owners must index the {len(query_ids)} queries')
    if any(len(query_ids[g]) == 0 for g in set(owners)):
      raise ValueError('every scored query needs at least one token')
    members: dict[int, list[int]] = {}
    for i, g in enumerate(owners):
      members.setdefault(int(g), []).append(i)
    used = sorted(members, key=lambda g: -len(query_ids[g]))
    query_len = self._length(max(len(query_ids[g]) for g in used))
    target_len = self._length(max(len(t) for t in target_ids))
    prefix_len = self._length(len(prefix_ids))
    graphdef, state = nnx.split(self.model)
    ids, mask = pad_rows([list(prefix_ids)], prefix_len, self.pad_id, left=True)
    if self.mesh is not None:
      replicated = sharding.replicated(self.mesh)
      ids, mask = (jax.make_array_from_callback(x.shape, replicated, lambda i, x=x: x[i]) for x in (ids, mask))
    capacity = prefix_len + query_len + target_len
    prefix = self._run(_slack_prefix_jit, graphdef, state, ids, mask, capacity=capacity, slack=query_len)
    batch_size = self.rows_within_cache_budget(capacity, query_len)
    results = []
    for start in range(0, len(used), batch_size):
      window = used[start:start + batch_size]
      slots = prefix_slots(len(window), batch_size)
      q_ids, q_mask = pad_rows([list(query_ids[g]) for g in _fill(window, slots)], query_len, self.pad_id,
                               left=True)
      if self.mesh is not None and slots % sharding.batch_shards(self.mesh) == 0:
        q_ids, q_mask = self._put((q_ids, q_mask))
      elif self.mesh is not None:
        replicated = sharding.replicated(self.mesh)
        q_ids, q_mask = (jax.make_array_from_callback(x.shape, replicated, lambda i, x=x: x[i])
                         for x in (q_ids, q_mask))
      extended = self._run(_extend_jit, graphdef, state, prefix, q_ids, q_mask)
      slot = {g: k for k, g in enumerate(window)}
      candidates = [i for g in window for i in members[g]]
      for order in _batches([len(target_ids[i]) for i in candidates], batch_size):
        index = np.asarray([candidates[j] for j in order])
        rows = _fill(index.tolist(), batch_size)
        targets = [list(target_ids[i]) for i in rows]
        chunk_ids, chunk_mask = pad_rows(targets, self._length(max(len(t) for t in targets)), self.pad_id)
        batch = {'input_ids': chunk_ids, 'attention_mask': chunk_mask,
                 'prefix_rows': np.asarray([slot[owners[i]] for i in rows], np.int32),
                 **_targets(targets, [0] * len(targets), self._slots(max(len(t) for t in targets)))}
        out = self._run(_continuation_jit, graphdef, state, extended, self._put(batch),
                        vocab_chunk=self.vocab_chunk)
        results.append((index, out))
    return _collect(results, len(target_ids))


def prefix_slots(groups: int, batch_size: int) -> int:
  """Prefixes a compiled call holds for ``groups`` real ones: the next power of two (at most
  ``batch_size``), so a run compiles a handful of prefix counts."""
  slots = 1
  while slots < groups:
    slots *= 2
  return min(slots, batch_size)


class Seq2SeqScorer(_Scorer):
  """``log p(target | context)`` under an encoder-decoder (T5), from strings.

  The encoder reads the context tokenised with special tokens (T5 appends
  EOS); the decoder labels are the target's tokens followed by EOS when
  ``add_eos`` (the usual T5 training target), or the bare tokens.

  Args: as :class:`CausalScorer`, plus ``add_eos``.
  """

  def __init__(self, model: T5Model, tokenizer=None, *, batch_size: int = 16, mesh=None,
               add_eos: bool = True, vocab_chunk: int = DEFAULT_VOCAB_CHUNK,
               length_buckets: Sequence[int] = LENGTH_BUCKETS,
               target_buckets: Sequence[int] = TARGET_BUCKETS):
    if model.decoder is None:
      raise ValueError('this T5 model is encoder-only (T5EncoderModel): it cannot score targets')
    super().__init__(model, tokenizer, batch_size=batch_size, mesh=mesh, vocab_chunk=vocab_chunk,
                     length_buckets=length_buckets, target_buckets=target_buckets)
    self.add_eos = add_eos
    self.pad_id = int(model.config.pad_token_id)
    self.eos_id = int(model.config.eos_token_ids[0])

  def score(self, contexts: Sequence[str], targets: Sequence[str], *,
            reduction: str = 'sum') -> np.ndarray:
    """``[N]`` float32 ``log p(labels_i | context_i)`` summed (or ``'mean'``) over label tokens."""
    return self.score_details(contexts, targets).reduce(reduction)

  def score_details(self, contexts: Sequence[str], targets: Sequence[str]) -> Scores:
    self._check_lengths(contexts, targets, 'contexts')
    labels = self._encode(targets, False)
    if self.add_eos:
      labels = [t + [self.eos_id] for t in labels]
    return self.score_ids(self._encode(contexts, True), labels)

  def score_ids(self, context_ids: Sequence[Sequence[int]],
                label_ids: Sequence[Sequence[int]]) -> Scores:
    """Token-level scoring: encoder ids (EOS included) and decoder labels as given."""
    self._check_lengths(context_ids, label_ids, 'contexts')
    graphdef, state = nnx.split(self.model)
    lengths = [len(c) for c in context_ids]
    results = []
    for index in _batches(lengths, self.batch_size):
      rows = _fill(list(index), self.batch_size)
      ids, mask = pad_rows([context_ids[i] for i in rows],
                            self._length(max(lengths[i] for i in rows)), self.pad_id)
      labels, label_mask = pad_rows([label_ids[i] for i in rows],
                                     self._slots(max(len(label_ids[i]) for i in rows)), self.pad_id)
      batch = {'input_ids': ids, 'attention_mask': mask, 'labels': labels, 'label_mask': label_mask}
      out = self._run(_seq2seq_jit, graphdef, state, self._put(batch), vocab_chunk=self.vocab_chunk)
      results.append((index, out))
    return _collect(results, len(context_ids))


__all__ = ['CausalScorer', 'DEFAULT_VOCAB_CHUNK', 'LENGTH_BUCKETS',
           'LogLikelihood', 'OutputHead', 'PrefixState', 'Scores',
           'Seq2SeqScorer', 'TARGET_BUCKETS', 'causal_log_likelihood',
           'continuation_log_likelihood', 'encode_prefix', 'extend_prefix', 'output_head', 'prefix_slots',
           'seq2seq_log_likelihood', 'target_log_probs']
