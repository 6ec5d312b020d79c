"""Gemma 1, 2 and 3 (text) decoder-only language models with a KV cache.

One implementation covers the three generations; the differences are config
switches (Hugging Face ``model_type`` ``gemma`` / ``gemma2`` / ``gemma3_text``):

============================  =========  ==========  ===============
feature                       Gemma 1    Gemma 2     Gemma 3
============================  =========  ==========  ===============
attention scale               ``H^-.5``  ``q^-.5``   ``q^-.5``  (q = ``query_pre_attn_scalar``)
sandwich norms (post-attn /   no         yes         yes
pre- and post-FFW)
sliding-window layers         none       alternate   ``layer_types`` (5 local : 1 global)
attention logit soft-cap      no         yes         no
final logit soft-cap          no         yes         optional
QK-norm                       no         no          yes
RoPE base local / global      same       same        different (+ linear scaling)
============================  =========  ==========  ===============

Shapes: ``B`` batch, ``T`` query length, ``S`` key length, ``C`` cache
capacity, ``R`` ring-buffer length, ``D`` embed, ``N`` query heads, ``K`` kv
heads, ``H`` head dim, ``F`` mlp, ``V`` vocab.

Token *indices* count every token fed to the model, padding included (they
are cache slots); *positions* count real tokens only and drive RoPE (left
padding: ``positions = cumsum(mask) - 1``, as in Hugging Face ``generate``).
Causality and the sliding window are defined on indices, like Hugging Face's
masks: a sliding layer lets index ``i`` see index ``j`` iff
``0 <= i - j < sliding_window``.

Caching (:class:`DecodeCache`): global layers keep ``C`` slots (slot = index);
sliding layers keep a ring of ``R = min(sliding_window, C)`` slots (slot =
index mod ``R``), which always holds every key a new query can see.
:meth:`GemmaModel.prefill` appends a chunk of tokens to a cache (fresh or not,
so a shared prefix can be encoded once and continued many times) and
:meth:`GemmaModel.decode_step` appends one token: the chunk attends to the
cache as it was plus itself in one softmax, then is written in place.
Decoding loops live in :mod:`recomp_jax.models.gemma_decoding`.

Matmuls accumulate in float32 (:func:`_matmul`); with ``dtype=bfloat16`` they
take bf16 operands, which on XLA:CPU roughly halves the memory traffic of
decoding (the tied ``[V, D]`` head dominates small models).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recomp_jax.models import layers
from recomp_jax.pretrained.hf import WeightSpec, linear, reshaped
from recomp_jax.pretrained.spec import ModelFamily

SLIDING = 'sliding_attention'
FULL = 'full_attention'
_MODEL_TYPES = ('gemma', 'gemma2', 'gemma3_text')
# Tokens per prefill call of a long prompt (GemmaModel.prefill_in_chunks): a corpus in context.
PREFILL_CHUNK = 2048
_ARCHITECTURES = {'gemma': 'GemmaForCausalLM', 'gemma2': 'Gemma2ForCausalLM',
                  'gemma3_text': 'Gemma3ForCausalLM'}


# ----------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
  """Architecture of a Gemma 1/2/3 text model (fields follow Hugging Face names).

  ``rope_theta`` / ``rope_scaling_factor`` configure RoPE on full-attention
  layers, ``rope_local_theta`` / ``rope_local_scaling_factor`` on sliding
  layers (equal to the global ones before Gemma 3). A scaling factor other
  than 1 is Hugging Face's ``linear`` RoPE type (frequencies divided by it).
  ``query_pre_attn_scalar=None`` means the Gemma 1 scale ``head_dim ** -0.5``.
  """
  model_type: str = 'gemma3_text'
  vocab_size: int = 262144
  hidden_size: int = 640
  intermediate_size: int = 2048
  num_layers: int = 18
  num_heads: int = 4
  num_kv_heads: int = 1
  head_dim: int = 256
  hidden_activation: str = 'gelu_pytorch_tanh'
  rms_norm_eps: float = 1e-6
  layer_types: tuple[str, ...] = ()
  sliding_window: int | None = 512
  query_pre_attn_scalar: float | None = 256
  attn_logit_softcapping: float | None = None
  final_logit_softcapping: float | None = None
  rope_theta: float = 1_000_000.0
  rope_scaling_factor: float = 1.0
  rope_local_theta: float = 10_000.0
  rope_local_scaling_factor: float = 1.0
  attention_bias: bool = False
  use_bidirectional_attention: bool = False
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 32768
  bos_token_id: int | None = 2
  eos_token_id: tuple[int, ...] = (1,)
  pad_token_id: int | None = 0

  def __post_init__(self):
    if self.model_type not in _MODEL_TYPES:
      raise ValueError(f'model_type must be one of {_MODEL_TYPES}, got {self.model_type!r}')
    if not self.layer_types:
      object.__setattr__(self, 'layer_types', _default_layer_types(self.model_type, self.num_layers))
    object.__setattr__(self, 'layer_types', tuple(self.layer_types))
    if isinstance(self.eos_token_id, int):
      object.__setattr__(self, 'eos_token_id', (self.eos_token_id,))
    object.__setattr__(self, 'eos_token_id', tuple(self.eos_token_id or ()))
    if len(self.layer_types) != self.num_layers:
      raise ValueError(f'layer_types has {len(self.layer_types)} entries for {self.num_layers} layers')
    unknown = set(self.layer_types) - {SLIDING, FULL}
    if unknown:
      raise ValueError(f'unsupported layer types {sorted(unknown)}; known: {SLIDING!r}, {FULL!r}')
    if SLIDING in self.layer_types and not self.sliding_window:
      raise ValueError('sliding_attention layers need a sliding_window')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}')
    layers.activation(self.hidden_activation)  # fails early on an unknown activation

  @property
  def sandwich_norms(self) -> bool:
    """Gemma 2/3: norms after attention and around the feed-forward block."""
    return self.model_type != 'gemma'

  @property
  def qk_norm(self) -> bool:
    return self.model_type == 'gemma3_text'

  @property
  def attention_scale(self) -> float:
    if self.query_pre_attn_scalar is None:
      return self.head_dim ** -0.5
    return float(self.query_pre_attn_scalar) ** -0.5

  def is_sliding(self, layer: int) -> bool:
    return self.layer_types[layer] == SLIDING

  def rope_frequencies(self, sliding: bool) -> np.ndarray:
    """``[H/2]`` RoPE inverse frequencies for a sliding (local) or full (global) layer."""
    if sliding:
      return layers.rope_inverse_frequencies(self.head_dim, self.rope_local_theta,
                                             self.rope_local_scaling_factor)
    return layers.rope_inverse_frequencies(self.head_dim, self.rope_theta, self.rope_scaling_factor)

  @classmethod
  def from_hf(cls, hf: dict) -> 'GemmaConfig':
    """Reads a Hugging Face ``config.json`` dict (transformers v4 or v5 layout).

    ``model_type: gemma3`` (multimodal) configs are reduced to their text part.
    """
    hf = dict(hf)
    model_type = hf.get('model_type')
    if model_type == 'gemma3':
      text = dict(hf.get('text_config') or {})
      for key in ('bos_token_id', 'eos_token_id', 'pad_token_id', 'tie_word_embeddings'):
        if key not in text and key in hf:
          text[key] = hf[key]
      hf, model_type = text, 'gemma3_text'
    if model_type not in _MODEL_TYPES:
      raise ValueError(f'not a Gemma text config: model_type={model_type!r}')
    num_layers = int(hf['num_hidden_layers'])
    num_heads = int(hf['num_attention_heads'])
    head_dim = int(hf.get('head_dim') or hf['hidden_size'] // num_heads)
    gemma2_defaults = model_type == 'gemma2'
    if model_type == 'gemma':
      activation = hf.get('hidden_act') or hf.get('hidden_activation') or 'gelu_pytorch_tanh'
      if activation == 'gelu':  # legacy Gemma 1 value meaning the tanh approximation (as in HF)
        activation = 'gelu_pytorch_tanh'
      layer_types = (FULL,) * num_layers
      sliding_window, scalar = None, None
    else:
      activation = hf.get('hidden_activation') or hf.get('hidden_act') or 'gelu_pytorch_tanh'
      layer_types = hf.get('layer_types')
      if not layer_types:
        pattern = 2 if model_type == 'gemma2' else int(
            hf.get('sliding_window_pattern') or hf.get('_sliding_window_pattern') or 6)
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
      sliding_window = hf.get('sliding_window', 4096)
      scalar = hf.get('query_pre_attn_scalar', 256)
    if hf.get('use_bidirectional_attention') and model_type != 'gemma3_text':
      raise ValueError(f'use_bidirectional_attention is only supported for gemma3_text, not {model_type}')
    (theta, factor), (local_theta, local_factor) = _rope_from_hf(hf, model_type)
    eos = hf.get('eos_token_id', 1)
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
    return cls(
        model_type=model_type,
        vocab_size=int(hf['vocab_size']),
        hidden_size=int(hf['hidden_size']),
        intermediate_size=int(hf['intermediate_size']),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get('num_key_value_heads') or num_heads),
        head_dim=head_dim,
        hidden_activation=activation,
        rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
        layer_types=tuple(layer_types),
        sliding_window=None if sliding_window is None else int(sliding_window),
        query_pre_attn_scalar=scalar,
        attn_logit_softcapping=hf.get('attn_logit_softcapping', 50.0 if gemma2_defaults else None),
        final_logit_softcapping=hf.get('final_logit_softcapping', 30.0 if gemma2_defaults else None),
        rope_theta=theta,
        rope_scaling_factor=factor,
        rope_local_theta=local_theta,
        rope_local_scaling_factor=local_factor,
        attention_bias=bool(hf.get('attention_bias', False)),
        use_bidirectional_attention=bool(hf.get('use_bidirectional_attention') or False),
        tie_word_embeddings=bool(hf.get('tie_word_embeddings', True)),
        max_position_embeddings=int(hf.get('max_position_embeddings') or 8192),
        bos_token_id=hf.get('bos_token_id', 2),
        eos_token_id=eos,
        pad_token_id=hf.get('pad_token_id', 0),
    )

  def to_hf(self) -> dict:
    """A transformers 5.x ``config.json`` dict for the matching ``*ForCausalLM``."""
    def rope(theta, factor):
      if factor == 1.0:
        return {'rope_type': 'default', 'rope_theta': theta}
      return {'rope_type': 'linear', 'rope_theta': theta, 'factor': factor}

    out = {
        'architectures': [_ARCHITECTURES[self.model_type]],
        'model_type': self.model_type,
        'vocab_size': self.vocab_size,
        'hidden_size': self.hidden_size,
        'intermediate_size': self.intermediate_size,
        'num_hidden_layers': self.num_layers,
        'num_attention_heads': self.num_heads,
        'num_key_value_heads': self.num_kv_heads,
        'head_dim': self.head_dim,
        'rms_norm_eps': self.rms_norm_eps,
        'max_position_embeddings': self.max_position_embeddings,
        'attention_bias': self.attention_bias,
        'tie_word_embeddings': self.tie_word_embeddings,
        'bos_token_id': self.bos_token_id,
        'eos_token_id': (self.eos_token_id[0] if len(self.eos_token_id) == 1
                         else list(self.eos_token_id) or None),
        'pad_token_id': self.pad_token_id,
    }
    if self.model_type == 'gemma':
      out['hidden_act'] = self.hidden_activation
      out['rope_parameters'] = rope(self.rope_theta, self.rope_scaling_factor)
      return out
    out.update({
        'hidden_activation': self.hidden_activation,
        'layer_types': list(self.layer_types),
        'sliding_window': self.sliding_window,
        'query_pre_attn_scalar': self.query_pre_attn_scalar,
        'attn_logit_softcapping': self.attn_logit_softcapping,
        'final_logit_softcapping': self.final_logit_softcapping,
    })
    if self.model_type == 'gemma2':
      out['rope_parameters'] = rope(self.rope_theta, self.rope_scaling_factor)
    else:
      out['rope_parameters'] = {FULL: rope(self.rope_theta, self.rope_scaling_factor),
                                SLIDING: rope(self.rope_local_theta, self.rope_local_scaling_factor)}
      out['use_bidirectional_attention'] = self.use_bidirectional_attention
    return out


def _default_layer_types(model_type: str, num_layers: int) -> tuple[str, ...]:
  if model_type == 'gemma':
    return (FULL,) * num_layers
  pattern = 2 if model_type == 'gemma2' else 6
  return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def _rope_params(params: dict | None, default_theta: float) -> tuple[float, float]:
  """``(theta, linear_scaling_factor)`` from one Hugging Face RoPE parameter dict."""
  params = params or {}
  rope_type = params.get('rope_type', params.get('type', 'default'))
  theta = float(params.get('rope_theta') or default_theta)
  if rope_type == 'default':
    return theta, 1.0
  if rope_type == 'linear':
    return theta, float(params['factor'])
  raise ValueError(f'unsupported RoPE type {rope_type!r} for Gemma (supported: default, linear)')


def _rope_from_hf(hf: dict, model_type: str) -> tuple[tuple[float, float], tuple[float, float]]:
  """``((global theta, factor), (local theta, factor))`` from v5 ``rope_parameters`` or v4 fields."""
  params = dict(hf.get('rope_parameters') or {})
  scaling = hf.get('rope_scaling')
  if model_type != 'gemma3_text':
    if params.keys() & {FULL, SLIDING}:
      params = params.get(FULL) or params.get(SLIDING) or {}
    params = dict(params, **(scaling or {}))
    params.setdefault('rope_theta', hf.get('rope_theta', 10_000.0))
    glob = _rope_params(params, 10_000.0)
    return glob, glob
  if params.keys() & {FULL, SLIDING}:
    full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
  else:  # flat (v4-style) parameters describe the global layers
    full, local = params, {}
  if scaling:
    full.update(scaling)
  full.setdefault('rope_theta', hf.get('rope_theta', 1_000_000.0))
  local.setdefault('rope_theta', hf.get('rope_local_base_freq', 10_000.0))
  return _rope_params(full, 1_000_000.0), _rope_params(local, 10_000.0)


# ----------------------------------------------------------------------------
# Cache
# ----------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['keys', 'values', 'valid', 'length', 'next_position'],
                   meta_fields=['fresh'])
@dataclasses.dataclass(frozen=True)
class DecodeCache:
  """Keys and values of every layer plus the bookkeeping the masks need.

  Attributes:
    keys: per layer ``[B, K, S, H]``; values: ``[B, K, H, S]``. ``S = C`` for
      global layers (slot = token index) and ``S = R`` for sliding layers (a
      ring, slot = index mod R). These layouts feed both attention matmuls
      without relayout copies.
    valid: ``[B, C]`` bool, token index ``i`` of row ``b`` is a real token.
    length: ``[]`` int32, number of token indices written (same for every row).
    next_position: ``[B]`` int32, RoPE position of each row's next real token.
    fresh: static; True only for an untouched cache from
      :meth:`GemmaModel.init_cache` (prefill then attends within the chunk only).
  """
  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]
  valid: jax.Array
  length: jax.Array
  next_position: jax.Array
  fresh: bool = False

  @property
  def capacity(self) -> int:
    return self.valid.shape[1]

  def take(self, rows: jax.Array) -> 'DecodeCache':
    """The cache rows ``rows [B]`` (int, repeats allowed): row ``b`` of the result is row
    ``rows[b]`` of this cache (many continuations of ``G`` prefixes, any number each; all
    zeros: a batch-1 shared prefix becomes ``B`` rows)."""
    def take(x):
      return jnp.take(x, rows, axis=0)
    return DecodeCache(tuple(map(take, self.keys)), tuple(map(take, self.values)), take(self.valid),
                       self.length, take(self.next_position), self.fresh)


def _slot_indices(length: jax.Array, size: int) -> jax.Array:
  """``[size]`` token index held by each slot after ``length`` writes (< 0: never written).

  Slot ``s`` holds the latest index ``i < length`` with ``i % size == s``; for a
  global cache (``size = C >= length``) that is ``s`` itself when ``s < length``.
  """
  slots = jnp.arange(size, dtype=jnp.int32)
  return length - 1 - jnp.mod(length - 1 - slots, size)


def _history_mask(valid: jax.Array, length: jax.Array, size: int, q_pos: jax.Array,
                  window: int | None) -> jax.Array:
  """``[B, 1, T, size]``: which cached slots the chunk's queries (RoPE positions ``q_pos [B, T]``) may see.

  Every cached index is before the queries (causal); a slot must hold a real
  token and, for sliding layers, a token less than ``window`` *positions* back.
  Positions, not token indices, set the window, so padding between a cached
  prefix and a left-padded chunk (generation from a shared prefix) does not
  shrink it; without such a gap the two agree.
  """
  idx = _slot_indices(length, size)
  safe = jnp.maximum(idx, 0)
  ok = (idx >= 0)[None, :] & jnp.take(valid, safe, axis=1)                # [B, size]
  mask = ok[:, None, None, :]
  if window is not None:
    positions = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1                 # [B, C]
    k_pos = jnp.take(positions, safe, axis=1)                                   # [B, size]
    mask = mask & ((q_pos[:, :, None] - k_pos[:, None, :]) < window)[:, None]
  return mask


def _write(buffer: jax.Array, new: jax.Array, start: jax.Array, *, ring: bool,
           axis: int) -> jax.Array:
  """Stores ``new`` (``buffer``'s layout, ``T`` slots) at token indices ``start .. start+T-1``.

  ``axis`` is the slot axis; a ring buffer (``ring=True``) wraps around and
  keeps only the last ``S`` tokens of a chunk longer than itself.
  """
  new = new.astype(buffer.dtype)
  size, chunk = buffer.shape[axis], new.shape[axis]
  if not ring or chunk == 1:
    index = [0] * buffer.ndim
    index[axis] = jnp.mod(start, size) if ring else start
    return jax.lax.dynamic_update_slice(buffer, new, tuple(index))
  keep = min(chunk, size)
  slots = jnp.mod(start + jnp.arange(chunk - keep, chunk, dtype=jnp.int32), size)
  tail = jax.lax.slice_in_dim(new, chunk - keep, chunk, axis=axis)
  where = (slice(None),) * axis + (slots,)
  return buffer.at[where].set(tail, unique_indices=True, mode='promise_in_bounds')


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
               cached: tuple[jax.Array, jax.Array, jax.Array] | None = None, *,
               scale: float, softcap: float | None) -> jax.Array:
  """Grouped-query attention of a chunk over (optionally) the cache and itself, one softmax.

  The cache is only read, never concatenated with the chunk, so a decode step
  makes one pass over it and the cache update that follows stays in place.
  Logits, softmax and both products accumulate in float32.

  Args:
    q: ``[B, T, N, H]`` chunk queries.
    k, v: ``[B, T, K, H]`` chunk keys / values.
    mask: ``[B, 1, T, T]`` visible chunk tokens.
    cached: ``(keys [B, K, S, H], values [B, K, H, S], mask [B, 1, T, S])`` of
      the cache before this chunk.
  Returns:
    ``[B, T, N, H]``.
  """
  batch, chunk, heads, head_dim = q.shape
  kv_heads = k.shape[2]
  dtype, f32 = q.dtype, jnp.float32
  q = (q * jnp.asarray(scale, dtype)).reshape(batch, chunk, kv_heads, heads // kv_heads, head_dim)
  logits = [jnp.einsum('btkgh,bukh->bkgtu', q, k.astype(dtype), preferred_element_type=f32)]
  masks = [jnp.broadcast_to(mask, (batch, 1, chunk, chunk))]
  if cached is not None:
    cached_k, cached_v, cached_mask = cached
    logits.insert(0, jnp.einsum('btkgh,bksh->bkgts', q, cached_k.astype(dtype),
                                preferred_element_type=f32))
    masks.insert(0, jnp.broadcast_to(cached_mask, (batch, 1, chunk, cached_k.shape[2])))
  logits = jnp.concatenate(logits, axis=-1) if len(logits) > 1 else logits[0]
  visible = jnp.concatenate(masks, axis=-1) if len(masks) > 1 else masks[0]
  if softcap is not None:
    logits = jnp.tanh(logits / softcap) * softcap
  logits = jnp.where(visible[:, :, None], logits, jnp.finfo(f32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(dtype)
  out = jnp.einsum('bkgtu,bukh->btkgh', probs[..., -chunk:], v.astype(dtype),
                   preferred_element_type=f32)
  if cached is not None:
    out = out + jnp.einsum('bkgts,bkhs->btkgh', probs[..., :-chunk], cached_v.astype(dtype),
                           preferred_element_type=f32)
  return out.astype(dtype).reshape(batch, chunk, heads, head_dim)


# ----------------------------------------------------------------------------
# Modules
# ----------------------------------------------------------------------------


def _segment_start_values(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
  """``[B, T]``: at every token, ``values`` at the first token of its segment.

  Segments are contiguous runs of one id; the value is carried forward from each run's
  start with a running maximum of start indices.
  """
  t = segment_ids.shape[1]
  index = jnp.arange(t, dtype=jnp.int32)[None, :]
  previous = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  start_index = jax.lax.cummax(jnp.where(segment_ids != previous, index, 0), axis=1)
  return jnp.take_along_axis(values, start_index, axis=1)


def _rotate(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """RoPE ("rotate half" layout) with precomputed ``sin, cos [B, T, H/2]``; ``x [B, T, N, H]``."""
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  sin, cos = sin[:, :, None, :], cos[:, :, None, :]
  out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return out.astype(x.dtype)


def _rope_table(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """``positions [B, T] -> (sin, cos) [B, T, H/2]`` in float32."""
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  return jnp.sin(angles), jnp.cos(angles)


def _matmul(x: jax.Array, w: jax.Array, contract: int, dtype, *, w_last: bool = False
            ) -> jax.Array:
  """Contracts the last ``contract`` axes of ``x`` with the first (``w_last``: last) ones of ``w``.

  Accumulates in float32 and returns ``dtype``. For reduced-precision inputs a
  single row is padded to two: XLA:CPU runs bf16 x bf16 -> f32 products with
  at least two rows on its fast GEMM kernels and everything else on a far slower
  fallback (the padding costs nothing elsewhere; benchmarks/ measure the paths).
  """
  x, w = x.astype(dtype), w.astype(dtype)
  lead = x.shape[:x.ndim - contract]
  pad = math.prod(lead) == 1 and jnp.dtype(dtype) != jnp.float32
  if pad:
    x = jnp.concatenate([x, jnp.zeros_like(x)], axis=0)
  w_axes = tuple(range(w.ndim - contract, w.ndim)) if w_last else tuple(range(contract))
  dims = ((tuple(range(x.ndim - contract, x.ndim)), w_axes), ((), ()))
  y = jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.float32)
  if pad:
    y = y[:1]
  return y.astype(dtype)


def _dense(layer: layers.DenseGeneral, x: jax.Array) -> jax.Array:
  """``layer(x)`` through :func:`_matmul` (float32 accumulation)."""
  y = _matmul(x, layer.kernel[...], len(layer.in_features), layer.dtype)
  if layer.bias is not None:
    y = y + layer.bias[...].astype(layer.dtype)
  return y


def _norm(config: GemmaConfig, features: int, *, dtype, param_dtype, rngs,
          axes=('norm',)) -> layers.RMSNorm:
  return layers.RMSNorm(features, eps=config.rms_norm_eps, scale_plus_one=True, axes=axes,
                        dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class GemmaAttention(nnx.Module):
  """Grouped-query self-attention projections (the attention itself is done by the model).

  ``q_proj``: ``[D, N, H]``, ``k_proj`` / ``v_proj``: ``[D, K, H]``, ``o_proj``:
  ``[N, H, D]``; Gemma 3 adds ``q_norm`` / ``k_norm`` over ``H``.
  """

  def __init__(self, config: GemmaConfig, *, dtype, param_dtype, rngs):
    d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    kw = dict(use_bias=config.attention_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = layers.DenseGeneral((d,), (n, h), axes=('embed', 'heads', 'head_dim'), **kw)
    self.k_proj = layers.DenseGeneral((d,), (k, h), axes=('embed', 'kv_heads', 'head_dim'), **kw)
    self.v_proj = layers.DenseGeneral((d,), (k, h), axes=('embed', 'kv_heads', 'head_dim'), **kw)
    self.o_proj = layers.DenseGeneral((n, h), (d,), axes=('heads', 'head_dim', 'embed'), **kw)
    if config.qk_norm:
      norm = functools.partial(_norm, config, h, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                               axes=('head_dim',))
      self.q_norm, self.k_norm = norm(), norm()
    else:
      self.q_norm = self.k_norm = None

  def qkv(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``x [B, T, D]``, ``rope = (sin, cos) [B, T, H/2]`` -> ``q [B, T, N, H]``, ``k, v [B, T, K, H]``."""
    q, k, v = _dense(self.q_proj, x), _dense(self.k_proj, x), _dense(self.v_proj, x)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    return _rotate(q, *rope), _rotate(k, *rope), v


class GemmaMLP(nnx.Module):
  """GeGLU feed-forward: ``down(act(gate(x)) * up(x))``, ``[B, T, D] -> [B, T, D]``."""

  def __init__(self, config: GemmaConfig, *, dtype, param_dtype, rngs):
    d, f = config.hidden_size, config.intermediate_size
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.gate_proj = layers.DenseGeneral((d,), (f,), axes=('embed', 'mlp'), **kw)
    self.up_proj = layers.DenseGeneral((d,), (f,), axes=('embed', 'mlp'), **kw)
    self.down_proj = layers.DenseGeneral((f,), (d,), axes=('mlp', 'embed'), **kw)
    self.act = config.hidden_activation

  def __call__(self, x: jax.Array) -> jax.Array:
    gate = layers.activation(self.act)(_dense(self.gate_proj, x))
    return _dense(self.down_proj, gate * _dense(self.up_proj, x))


class GemmaBlock(nnx.Module):
  """One decoder layer. ``attend`` maps ``(q, k, v)`` to attention outputs ``[B, T, N, H]``.

  Gemma 1: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; Gemma 2/3 also
  normalise each branch's output (``post_attn_norm`` / ``post_ffw_norm``).
  """

  def __init__(self, config: GemmaConfig, *, dtype, param_dtype, rngs):
    norm = functools.partial(_norm, config, config.hidden_size, dtype=dtype,
                             param_dtype=param_dtype, rngs=rngs)
    self.pre_attn_norm = norm()
    self.attn = GemmaAttention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_attn_norm = norm() if config.sandwich_norms else None
    self.pre_ffw_norm = norm()
    self.mlp = GemmaMLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.post_ffw_norm = norm() if config.sandwich_norms else None

  def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array], attend) -> jax.Array:
    """``x [B, T, D] -> [B, T, D]``."""
    q, k, v = self.attn.qkv(self.pre_attn_norm(x), rope)
    h = _dense(self.attn.o_proj, attend(q, k, v))
    if self.post_attn_norm is not None:
      h = self.post_attn_norm(h)
    x = x + h
    h = self.mlp(self.pre_ffw_norm(x))
    if self.post_ffw_norm is not None:
      h = self.post_ffw_norm(h)
    return x + h


class GemmaModel(layers.LayerExecution, nnx.Module):
  """Gemma 1/2/3 causal LM: token ids -> logits, with cached prefill / decode steps.

  Parameters: ``embedder.embedding [V, D]`` (also the output head when tied,
  else ``lm_head.kernel [D, V]``), ``layers[i]`` (:class:`GemmaBlock`),
  ``final_norm``.

  ``set_layer_execution(scan_layers=, remat=)`` (:func:`layers.run_layers`) applies to the
  uncached forward (:meth:`hidden_states`, used by training and scoring): scanned, sliding
  and full layers share one body that selects its mask and RoPE table by a per-layer flag.
  The cached prefill / decode steps keep the loop (sliding layers hold smaller ring caches).
  """

  def __init__(self, config: GemmaConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs | None):
    self.config = config
    self.dtype = dtype
    d = config.hidden_size
    self.embedder = layers.Embed(config.vocab_size, d, dtype=dtype, param_dtype=param_dtype,
                                 rngs=rngs)
    self.layers = nnx.List([GemmaBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.final_norm = _norm(config, d, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    if config.tie_word_embeddings:
      self.lm_head = None
    else:
      self.lm_head = layers.DenseGeneral((d,), (config.vocab_size,), axes=('embed', 'vocab'),
                                         dtype=dtype, param_dtype=param_dtype, rngs=rngs)

  # -- pieces -----------------------------------------------------------------

  def embed(self, input_ids: jax.Array) -> jax.Array:
    """``[B, T]`` ids -> ``[B, T, D]``, scaled by ``sqrt(D)`` in the compute dtype (as HF)."""
    return self.embedder(input_ids) * jnp.asarray(math.sqrt(self.config.hidden_size), self.dtype)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """``[..., D]`` final hidden states -> ``[..., V]`` logits (final soft-cap applied)."""
    if self.lm_head is None:
      logits = _matmul(hidden, self.embedder.embedding[...], 1, self.dtype, w_last=True)
    else:
      logits = _dense(self.lm_head, hidden)
    cap = self.config.final_logit_softcapping
    if cap is not None:
      logits = (jnp.tanh(logits.astype(jnp.float32) / cap) * cap).astype(logits.dtype)
    return logits

  def _rope_tables(self, positions: jax.Array) -> dict[bool, tuple[jax.Array, jax.Array]]:
    """``{is_sliding: (sin, cos) [B, T, H/2]}`` for the layer kinds present."""
    kinds = {self.config.is_sliding(i) for i in range(self.config.num_layers)}
    return {s: _rope_table(positions, self.config.rope_frequencies(s)) for s in kinds}

  def _attend(self, q, k, v, mask, cached=None) -> jax.Array:
    return _attention(q, k, v, mask, cached, scale=self.config.attention_scale,
                      softcap=self.config.attn_logit_softcapping)

  def _chunk_masks(self, valid: jax.Array, segment_ids: jax.Array | None = None
                   ) -> dict[bool, jax.Array]:
    """``{is_sliding: [B, 1, T, T]}`` masks of a chunk attending to itself (``valid [B, T]``).

    Sliding windows count real tokens (positions), like :func:`_history_mask`, so
    padding inside a row does not narrow them; with padding only at the ends this
    is the usual index window. ``segment_ids [B, T]`` (packed rows) also keeps each
    token's attention inside its own segment.
    """
    t = valid.shape[1]
    q_idx = jnp.arange(t)[:, None]
    k_idx = jnp.arange(t)[None, :]
    window = self.config.sliding_window
    pos = jnp.cumsum(valid, axis=1, dtype=jnp.int32)                            # [B, T]
    distance = pos[:, :, None] - pos[:, None, :]                                 # [B, T, T]
    if self.config.use_bidirectional_attention:
      full = jnp.ones((t, t), bool)
      local = jnp.abs(distance) < (window // 2 + 1 if window else t + 1)
    else:
      full = k_idx <= q_idx
      local = full[None] & (distance < window) if window else full[None]
    key_ok = valid[:, None, None, :]
    if segment_ids is not None:
      key_ok = key_ok & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]
    return {False: key_ok & full[None, None], True: key_ok & local[:, None]}

  # -- uncached forward ---------------------------------------------------------

  def hidden_states(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
                    positions: jax.Array | None = None, segment_ids: jax.Array | None = None
                    ) -> jax.Array:
    """Final-normed hidden states ``[B, T, D]``.

    Args:
      input_ids: ``[B, T]`` int token ids.
      attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding (any side).
      positions: ``[B, T]`` RoPE positions; default ``cumsum(mask) - 1``, restarted at
        each segment when ``segment_ids`` is given.
      segment_ids: ``[B, T]`` for packed rows (several sequences, each contiguous, one
        after another): 1, 2, ... per sequence, 0 on padding. A token attends only within
        its segment, so each sequence gets the states it would get alone in its own row.
    """
    if attention_mask is None:
      attention_mask = (jnp.ones(input_ids.shape, jnp.int32) if segment_ids is None
                        else (segment_ids > 0).astype(jnp.int32))
    valid = attention_mask.astype(bool)
    if positions is None:
      positions = jnp.maximum(jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1, 0)
      if segment_ids is not None:
        positions = positions - _segment_start_values(positions, segment_ids)
    masks = self._chunk_masks(valid, segment_ids)
    ropes = self._rope_tables(positions)
    sliding = np.array([self.config.is_sliding(i) for i in range(self.config.num_layers)])

    def body(block, x, layer_is_sliding):
      if len(ropes) == 1 or isinstance(layer_is_sliding, np.bool_):  # the kind is known here
        kind = bool(layer_is_sliding) if len(ropes) > 1 else next(iter(ropes))
        mask, rope = masks[kind], ropes[kind]
      else:  # scanned: sliding and full layers share one body, so select this layer's kind
        mask = jnp.where(layer_is_sliding, masks[True], masks[False])
        rope = tuple(jnp.where(layer_is_sliding, a, b) for a, b in zip(ropes[True], ropes[False]))
      return block(x, rope, lambda q, k, v: self._attend(q, k, v, mask))

    x = layers.run_layers(self.layers, body, self.embed(input_ids), sliding,
                          scan=self.scan_layers, remat=self.remat)
    return self.final_norm(x)

  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               positions: jax.Array | None = None, segment_ids: jax.Array | None = None
               ) -> jax.Array:
    """``[B, T]`` ids (and mask, or packed ``segment_ids``) -> ``[B, T, V]`` logits."""
    return self.logits(self.hidden_states(input_ids, attention_mask, positions, segment_ids))

  # -- cached forward -----------------------------------------------------------

  def ring_size(self, capacity: int, slack: int = 0) -> int:
    """Slots of a sliding layer's ring: the window plus ``slack`` (at most ``capacity``)."""
    if not self.config.sliding_window:
      return capacity
    return min(self.config.sliding_window + slack, capacity)

  def init_cache(self, batch: int, capacity: int, dtype=None, *, ring_slack: int = 0) -> DecodeCache:
    """An empty cache for ``batch`` rows and up to ``capacity`` token indices (padding included).

    ``ring_slack``: extra ring slots for sliding layers, needed when up to that many
    padding indices may sit between tokens still inside the window (a shared prefix
    followed by left-padded continuations); 0 when padding is only on the left.
    """
    if self.config.use_bidirectional_attention:
      raise ValueError('bidirectional Gemma models have no causal KV cache')
    cfg = self.config
    dtype = dtype or self.dtype
    slots = [self.ring_size(capacity, ring_slack) if cfg.is_sliding(i) else capacity
             for i in range(cfg.num_layers)]
    k, h = cfg.num_kv_heads, cfg.head_dim
    return DecodeCache(
        keys=tuple(jnp.zeros((batch, k, s, h), dtype) for s in slots),
        values=tuple(jnp.zeros((batch, k, h, s), dtype) for s in slots),
        valid=jnp.zeros((batch, capacity), bool),
        length=jnp.zeros((), jnp.int32),
        next_position=jnp.zeros((batch,), jnp.int32),
        fresh=True)

  def prefill(self, input_ids: jax.Array, attention_mask: jax.Array | None, cache: DecodeCache, *,
              return_hidden: bool = False) -> tuple[jax.Array, DecodeCache]:
    """Appends a chunk of ``T`` tokens to ``cache``.

    Args:
      input_ids: ``[B, T]`` ids; ``cache.length + T`` must not exceed the capacity.
      attention_mask: ``[B, T]`` 1 = real token (left padding for generation).
      cache: from :meth:`init_cache` or a previous prefill / decode step.
      return_hidden: return all hidden states instead of the last logits.
    Returns:
      ``(logits [B, V] of the chunk's last token, or hidden [B, T, D], cache)``.
    """
    cfg = self.config
    chunk = input_ids.shape[1]
    if attention_mask is None:
      attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    chunk_valid = attention_mask.astype(bool)
    start = cache.length
    positions = jnp.maximum(
        cache.next_position[:, None] + jnp.cumsum(chunk_valid, axis=1, dtype=jnp.int32) - 1, 0)
    chunk_masks = self._chunk_masks(chunk_valid)
    sizes = {cfg.is_sliding(i): keys.shape[2] for i, keys in enumerate(cache.keys)}
    if not cache.fresh:
      cached_masks = {s: _history_mask(cache.valid, start, sizes[s], positions,
                                       cfg.sliding_window if s else None) for s in sizes}
    ropes = self._rope_tables(positions)
    keys, values = list(cache.keys), list(cache.values)
    x = self.embed(input_ids)
    for i, block in enumerate(self.layers):
      sliding = cfg.is_sliding(i)

      def attend(q, k, v, i=i, sliding=sliding):
        cached = None if cache.fresh else (keys[i], values[i], cached_masks[sliding])
        out = self._attend(q, k, v, chunk_masks[sliding], cached)
        keys[i] = _write(keys[i], jnp.transpose(k, (0, 2, 1, 3)), start, ring=sliding, axis=2)
        values[i] = _write(values[i], jnp.transpose(v, (0, 2, 3, 1)), start, ring=sliding, axis=3)
        return out

      x = block(x, ropes[sliding], attend)
    hidden = self.final_norm(x)
    new_cache = DecodeCache(
        tuple(keys), tuple(values),
        jax.lax.dynamic_update_slice(cache.valid, chunk_valid, (0, start)), start + chunk,
        cache.next_position + jnp.sum(chunk_valid, axis=1, dtype=jnp.int32), fresh=False)
    if return_hidden:
      return hidden, new_cache
    return self.logits(hidden[:, -1]), new_cache

  def prefill_in_chunks(self, input_ids: jax.Array, attention_mask: jax.Array, cache: DecodeCache, *,
                        chunk: int | None = None) -> tuple[jax.Array, DecodeCache]:
    """:meth:`prefill` of a long ``[B, T]`` prompt ``chunk`` tokens at a time -> ``(hidden [B, D] of
    the last token, cache)``.

    One prefill materialises ``[B, N, T, T]`` attention logits: 16 GiB in float32 for Gemma 3
    270M's 4 heads at a 32k-token corpus. In chunks each holds ``[B, N, chunk, S + chunk]``
    over the cache written so far. The first chunk takes ``T mod chunk`` tokens (the left
    padding sits there); the rest are one ``lax.scan`` (one compiled body whatever ``T``).
    Equal to one :meth:`prefill`: the later chunks attend to the cache through the same masks
    as a continuation does. ``T <= chunk`` is a plain prefill. ``chunk`` None: :data:`PREFILL_CHUNK`.
    """
    chunk = chunk or PREFILL_CHUNK
    batch, length = input_ids.shape
    if length <= chunk:
      hidden, cache = self.prefill(input_ids, attention_mask, cache, return_hidden=True)
      return hidden[:, -1], cache
    rest = (length - 1) // chunk
    first = length - rest * chunk
    hidden, cache = self.prefill(input_ids[:, :first], attention_mask[:, :first], cache, return_hidden=True)

    def split(x):  # [B, rest * chunk] -> [rest, B, chunk]
      return x[:, first:].reshape(batch, rest, chunk).transpose(1, 0, 2)

    def body(cache, xs):
      hidden, cache = self.prefill(xs[0], xs[1], cache, return_hidden=True)
      return cache, hidden[:, -1]

    cache, lasts = jax.lax.scan(body, cache, (split(input_ids), split(attention_mask)))
    return lasts[-1], cache

  def decode_step(self, tokens: jax.Array, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
    """Appends one real token per row: ``tokens [B]`` -> ``(logits [B, V], cache)``."""
    return self.prefill(tokens[:, None], None, cache)


# ----------------------------------------------------------------------------
# Checkpoint mapping
# ----------------------------------------------------------------------------


def weight_specs(config: GemmaConfig) -> list[WeightSpec]:
  """Hugging Face ``*ForCausalLM`` tensor names <-> our parameters.

  Gemma 1's ``post_attention_layernorm`` is the pre-feed-forward norm; in Gemma
  2/3 it normalises the attention output. A tied ``lm_head.weight`` is not
  stored by ``save_pretrained`` (and ignored if present).
  """
  d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
  f, v = config.intermediate_size, config.vocab_size
  specs = [WeightSpec('model.embed_tokens.weight', ('embedder', 'embedding'))]
  for i in range(config.num_layers):
    hf, ours = f'model.layers.{i}.', ('layers', i)
    attn, mlp = ours + ('attn',), ours + ('mlp',)
    projections = [('q_proj', (d,), (n, h)), ('k_proj', (d,), (k, h)), ('v_proj', (d,), (k, h)),
                   ('o_proj', (n, h), (d,))]
    for name, in_shape, out_shape in projections:
      specs.append(linear(f'{hf}self_attn.{name}.weight', attn + (name, 'kernel'), in_shape,
                          out_shape))
      if config.attention_bias:
        specs.append(reshaped(f'{hf}self_attn.{name}.bias', attn + (name, 'bias'), out_shape,
                              (math.prod(out_shape),)))
    if config.qk_norm:
      specs += [WeightSpec(f'{hf}self_attn.q_norm.weight', attn + ('q_norm', 'scale')),
                WeightSpec(f'{hf}self_attn.k_norm.weight', attn + ('k_norm', 'scale'))]
    specs.append(WeightSpec(f'{hf}input_layernorm.weight', ours + ('pre_attn_norm', 'scale')))
    if config.sandwich_norms:
      specs += [
          WeightSpec(f'{hf}post_attention_layernorm.weight', ours + ('post_attn_norm', 'scale')),
          WeightSpec(f'{hf}pre_feedforward_layernorm.weight', ours + ('pre_ffw_norm', 'scale')),
          WeightSpec(f'{hf}post_feedforward_layernorm.weight', ours + ('post_ffw_norm', 'scale')),
      ]
    else:
      specs.append(WeightSpec(f'{hf}post_attention_layernorm.weight', ours + ('pre_ffw_norm', 'scale')))
    specs += [linear(f'{hf}mlp.gate_proj.weight', mlp + ('gate_proj', 'kernel'), (d,), (f,)),
              linear(f'{hf}mlp.up_proj.weight', mlp + ('up_proj', 'kernel'), (d,), (f,)),
              linear(f'{hf}mlp.down_proj.weight', mlp + ('down_proj', 'kernel'), (f,), (d,))]
  specs.append(WeightSpec('model.norm.weight', ('final_norm', 'scale')))
  if not config.tie_word_embeddings:
    specs.append(linear('lm_head.weight', ('lm_head', 'kernel'), (d,), (v,)))
  return specs


def build(config: GemmaConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
          rngs: nnx.Rngs | None) -> GemmaModel:
  return GemmaModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


FAMILY = ModelFamily(
    name='gemma',
    config_from_hf=GemmaConfig.from_hf,
    config_to_hf=GemmaConfig.to_hf,
    build=build,
    weight_specs=weight_specs,
    ignore=(r'^lm_head\.weight$', r'rotary_emb\.inv_freq$'),
)

__all__ = ['DecodeCache', 'FAMILY', 'FULL', 'GemmaAttention', 'GemmaBlock', 'GemmaConfig',
           'GemmaMLP', 'GemmaModel', 'SLIDING', 'build', 'weight_specs']
