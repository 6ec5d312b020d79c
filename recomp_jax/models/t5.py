"""T5 encoder-decoder (v1.0 / t5-small..large, v1.1, Flan-T5) in Flax NNX.

Matches Hugging Face ``T5ForConditionalGeneration`` (and ``T5EncoderModel``):
pre-RMSNorm blocks with a plain ``x * w`` scale, no biases, no attention
scaling (T5 folds ``1/sqrt(H)`` into the query init), one learned relative
position bias per stack (bidirectional buckets in the encoder, causal in the
decoder) computed once and shared by every layer, cross-attention in the
decoder, a ReLU (v1.0) or gated-GELU (v1.1 / Flan) feed-forward, and final
norms. The v1.0 head is the shared embedding applied to the decoder output
scaled by ``D ** -0.5``; v1.1 has an untied ``lm_head`` and no scaling.

Generation (:func:`generate`) runs the whole encoder + token loop in one
``jax.jit``: cross-attention keys/values are projected once from the encoder
output; each decoder layer keeps a self-attention cache ``[B, L, N, H]``
written with ``lax.dynamic_update_slice``.

Shapes: ``B`` batch, ``S`` encoder length, ``T`` decoder length, ``L`` cache
length, ``D`` embed, ``N`` heads, ``H`` head dim (``d_kv``), ``F`` mlp,
``V`` vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recomp_jax.data.buckets import bucket_length
from recomp_jax.models import decoding
from recomp_jax.models import layers
from recomp_jax.pretrained.hf import TensorSource, WeightSpec, linear
from recomp_jax.pretrained.spec import ModelFamily

KV = tuple[jax.Array, jax.Array]


def ffn_activation(feed_forward_proj: str) -> tuple[str, bool]:
  """``(activation name, gated)`` for a HF ``feed_forward_proj`` such as ``'gated-gelu'``.

  Follows transformers: ``'{act}'`` or ``'gated-{act}'``, where ``'gated-gelu'``
  means the tanh approximation (``gelu_new``).
  """
  parts = feed_forward_proj.split('-')
  if len(parts) > 2 or (len(parts) == 2 and parts[0] != 'gated'):
    raise ValueError(f"T5 feed_forward_proj {feed_forward_proj!r} is malformed: expected "
                     "'{act}' or 'gated-{act}', e.g. 'relu' or 'gated-gelu'")
  name = 'gelu_new' if feed_forward_proj == 'gated-gelu' else parts[-1]
  if name not in layers.ACTIVATIONS:
    raise ValueError(f'T5 feed_forward_proj {feed_forward_proj!r} is not supported: activation '
                     f'{name!r} is not one of {sorted(layers.ACTIVATIONS)}')
  return name, len(parts) == 2


@dataclasses.dataclass(frozen=True)
class T5Config:
  """Architecture of a T5 model (the fields of a HF ``T5Config`` that matter).

  ``tie_word_embeddings`` says whether the LM head is the shared embedding and
  ``scale_decoder_outputs`` whether the decoder output is multiplied by
  ``d_model ** -0.5`` before it. Both are true for v1.0 and false for v1.1 /
  Flan. transformers>=5 records only the latter in ``config.json``; the
  checkpoint's tensors decide the former (:func:`config_from_checkpoint`).
  ``encoder_only`` models (``T5EncoderModel``) have no decoder and no head.
  """
  vocab_size: int = 32128
  d_model: int = 512
  d_kv: int = 64
  d_ff: int = 2048
  num_layers: int = 6
  num_decoder_layers: int = 6
  num_heads: int = 8
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  feed_forward_proj: str = 'relu'
  tie_word_embeddings: bool = True
  scale_decoder_outputs: bool = True
  decoder_start_token_id: int = 0
  pad_token_id: int = 0
  eos_token_id: int | tuple[int, ...] = 1
  encoder_only: bool = False

  def __post_init__(self):
    ffn_activation(self.feed_forward_proj)  # fails early with a clear message

  @property
  def activation(self) -> str:
    return ffn_activation(self.feed_forward_proj)[0]

  @property
  def is_gated(self) -> bool:
    return ffn_activation(self.feed_forward_proj)[1]

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    eos = self.eos_token_id
    return tuple(eos) if isinstance(eos, tuple) else (eos,)

  @classmethod
  def from_hf(cls, hf: dict) -> 'T5Config':
    """From a Hugging Face ``config.json`` dict (``model_type == 't5'``)."""
    defaults = cls()
    get = lambda k, default: default if hf.get(k) is None else hf[k]
    num_layers = get('num_layers', defaults.num_layers)
    tie = bool(get('tie_word_embeddings', True))
    pad = get('pad_token_id', defaults.pad_token_id)
    eos = get('eos_token_id', defaults.eos_token_id)
    architectures = hf.get('architectures') or []
    return cls(
        vocab_size=get('vocab_size', defaults.vocab_size),
        d_model=get('d_model', defaults.d_model),
        d_kv=get('d_kv', defaults.d_kv),
        d_ff=get('d_ff', defaults.d_ff),
        num_layers=num_layers,
        num_decoder_layers=get('num_decoder_layers', num_layers),
        num_heads=get('num_heads', defaults.num_heads),
        relative_attention_num_buckets=get('relative_attention_num_buckets',
                                           defaults.relative_attention_num_buckets),
        relative_attention_max_distance=get('relative_attention_max_distance',
                                            defaults.relative_attention_max_distance),
        layer_norm_epsilon=get('layer_norm_epsilon', defaults.layer_norm_epsilon),
        feed_forward_proj=get('feed_forward_proj', defaults.feed_forward_proj),
        tie_word_embeddings=tie,
        scale_decoder_outputs=bool(get('scale_decoder_outputs', tie)),
        decoder_start_token_id=get('decoder_start_token_id', pad),
        pad_token_id=pad,
        eos_token_id=tuple(eos) if isinstance(eos, (list, tuple)) else eos,
        encoder_only=architectures == ['T5EncoderModel'],
    )

  def to_hf(self) -> dict:
    """A ``config.json`` dict that transformers loads back into this architecture."""
    eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
    return {
        'model_type': 't5',
        'architectures': ['T5EncoderModel' if self.encoder_only else 'T5ForConditionalGeneration'],
        'is_encoder_decoder': not self.encoder_only,
        'vocab_size': self.vocab_size,
        'd_model': self.d_model,
        'd_kv': self.d_kv,
        'd_ff': self.d_ff,
        'num_layers': self.num_layers,
        'num_decoder_layers': self.num_decoder_layers,
        'num_heads': self.num_heads,
        'relative_attention_num_buckets': self.relative_attention_num_buckets,
        'relative_attention_max_distance': self.relative_attention_max_distance,
        'layer_norm_epsilon': self.layer_norm_epsilon,
        'feed_forward_proj': self.feed_forward_proj,
        'tie_word_embeddings': self.tie_word_embeddings,
        'scale_decoder_outputs': self.scale_decoder_outputs,
        'decoder_start_token_id': self.decoder_start_token_id,
        'pad_token_id': self.pad_token_id,
        'eos_token_id': eos,
    }


def config_from_checkpoint(config: T5Config, tensor_names: frozenset[str]) -> T5Config:
  """Settles what only the stored tensors say: an untied ``lm_head``, a missing decoder.

  transformers>=5 always writes ``tie_word_embeddings: true`` for T5 and stores
  ``lm_head.weight`` exactly when the head is untied (v1.1 / Flan). A tied
  copy stored anyway (old conversions) loads as an equal untied head, which
  computes the same; the output scaling still comes from the config.
  """
  encoder_only = not any(n.startswith('decoder.') for n in tensor_names)
  tied = not encoder_only and 'lm_head.weight' not in tensor_names
  return dataclasses.replace(config, encoder_only=encoder_only,
                             tie_word_embeddings=tied or encoder_only)


# ----------------------------------------------------------------------------- position buckets


def relative_position_bucket(relative_position: np.ndarray, *, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> np.ndarray:
  """T5 bucket of ``key_position - query_position`` (int array, any shape).

  Half the buckets are exact small distances, the rest log-spaced up to
  ``max_distance``; bidirectional buckets split the range by sign. Computed in
  float32 like the reference implementations, on the host: positions are
  static, so the table becomes a compile-time constant.
  """
  relative_position = np.asarray(relative_position, np.int64)
  bucket = np.zeros_like(relative_position)
  if bidirectional:
    num_buckets //= 2
    bucket += (relative_position > 0).astype(np.int64) * num_buckets
    distance = np.abs(relative_position)
  else:
    distance = -np.minimum(relative_position, 0)
  max_exact = num_buckets // 2
  is_small = distance < max_exact
  ratio = np.maximum(distance, max_exact).astype(np.float32) / np.float32(max_exact)
  log_scaled = (np.log(ratio) / np.float32(math.log(max_distance / max_exact))
                * np.float32(num_buckets - max_exact))
  if_large = np.minimum(max_exact + log_scaled.astype(np.int64), num_buckets - 1)
  return bucket + np.where(is_small, distance, if_large)


class RelativePositionBias(nnx.Module):
  """Learned per-head bias of each relative-position bucket: ``embedding [buckets, N]``."""

  def __init__(self, config: T5Config, *, bidirectional: bool, param_dtype: jnp.dtype,
               rngs: nnx.Rngs | None):
    self.bidirectional = bidirectional
    self.num_buckets = config.relative_attention_num_buckets
    self.max_distance = config.relative_attention_max_distance
    self.embedding = layers.param(rngs, nnx.initializers.normal(config.d_model ** -0.5),
                                  (self.num_buckets, config.num_heads), ('relpos', 'heads'),
                                  param_dtype)

  def __call__(self, query_positions: jax.Array, key_length: int) -> jax.Array:
    """``[T]`` int query positions (may be traced), keys ``0..S-1`` -> ``[1, N, T, S]`` float32."""
    span = max(int(query_positions.shape[0]), key_length)
    # Bucket of every relative position -(span-1) .. span-1, indexed by rel + span - 1.
    table = relative_position_bucket(np.arange(-(span - 1), span), bidirectional=self.bidirectional,
                                     num_buckets=self.num_buckets, max_distance=self.max_distance)
    relative = jnp.arange(key_length)[None, :] - query_positions[:, None]  # [T, S]
    buckets = jnp.asarray(table, jnp.int32)[jnp.clip(relative + span - 1, 0, 2 * span - 2)]
    values = jnp.take(self.embedding[...].astype(jnp.float32), buckets, axis=0)  # [T, S, N]
    return jnp.transpose(values, (2, 0, 1))[None]


# ----------------------------------------------------------------------------- blocks


class T5Attention(nnx.Module):
  """Multi-head attention without biases or scaling (self- or cross-attention)."""

  def __init__(self, config: T5Config, *, dtype: jnp.dtype, param_dtype: jnp.dtype,
               rngs: nnx.Rngs | None):
    d, n, h = config.d_model, config.num_heads, config.d_kv
    normal = nnx.initializers.normal
    dense = functools.partial(layers.DenseGeneral, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q = dense((d,), (n, h), axes=('embed', 'heads', 'head_dim'),
                   kernel_init=normal((d * h) ** -0.5))
    self.k = dense((d,), (n, h), axes=('embed', 'kv_heads', 'head_dim'), kernel_init=normal(d ** -0.5))
    self.v = dense((d,), (n, h), axes=('embed', 'kv_heads', 'head_dim'), kernel_init=normal(d ** -0.5))
    self.o = dense((n, h), (d,), axes=('heads', 'head_dim', 'embed'),
                   kernel_init=normal((n * h) ** -0.5))

  def project_kv(self, x: jax.Array) -> KV:
    """``[B, S, D] -> (keys, values)``, each ``[B, S, N, H]``."""
    return self.k(x), self.v(x)

  def __call__(self, x: jax.Array, keys: jax.Array, values: jax.Array, *, mask: jax.Array,
               bias: jax.Array | None = None) -> jax.Array:
    """Queries from ``x [B, T, D]`` over ``keys/values [B, S, N, H]`` -> ``[B, T, D]``.

    ``mask`` is boolean, broadcastable to ``[B, 1, T, S]``; ``bias`` to ``[B, N, T, S]``.
    """
    out = layers.dot_product_attention(self.q(x), keys, values, mask=mask, bias=bias, scale=1.0)
    return self.o(out)


class T5MLP(nnx.Module):
  """``wo(act(wi x))`` or, gated, ``wo(act(wi_0 x) * wi_1 x)``: ``[..., D] -> [..., D]``."""

  def __init__(self, config: T5Config, *, dtype: jnp.dtype, param_dtype: jnp.dtype,
               rngs: nnx.Rngs | None):
    d, f = config.d_model, config.d_ff
    self.act = layers.activation(config.activation)
    self.gated = config.is_gated
    dense_in = functools.partial(layers.DenseGeneral, (d,), (f,), axes=('embed', 'mlp'), dtype=dtype,
                                 param_dtype=param_dtype,
                                 kernel_init=nnx.initializers.normal(d ** -0.5), rngs=rngs)
    if self.gated:
      self.wi_0 = dense_in()
      self.wi_1 = dense_in()
    else:
      self.wi = dense_in()
    self.wo = layers.DenseGeneral((f,), (d,), axes=('mlp', 'embed'), dtype=dtype,
                                  param_dtype=param_dtype,
                                  kernel_init=nnx.initializers.normal(f ** -0.5), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.gated:
      hidden = self.act(self.wi_0(x)) * self.wi_1(x)
    else:
      hidden = self.act(self.wi(x))
    return self.wo(hidden)


def _norm(config: T5Config, dtype, param_dtype, rngs) -> layers.RMSNorm:
  return layers.RMSNorm(config.d_model, eps=config.layer_norm_epsilon, scale_plus_one=False,
                        dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class EncoderBlock(nnx.Module):
  """Pre-norm self-attention and MLP, each with a residual connection."""

  def __init__(self, config: T5Config, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attn_norm = _norm(config, **kw)
    self.attn = T5Attention(config, **kw)
    self.mlp_norm = _norm(config, **kw)
    self.mlp = T5MLP(config, **kw)

  def __call__(self, x: jax.Array, *, mask: jax.Array, bias: jax.Array) -> jax.Array:
    """``[B, S, D] -> [B, S, D]``; ``mask [B, 1, 1, S]``, ``bias [1, N, S, S]``."""
    h = self.attn_norm(x)
    x = x + self.attn(h, *self.attn.project_kv(h), mask=mask, bias=bias)
    return x + self.mlp(self.mlp_norm(x))


class DecoderBlock(nnx.Module):
  """Pre-norm causal self-attention, cross-attention and MLP."""

  def __init__(self, config: T5Config, *, dtype, param_dtype, rngs):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.self_attn_norm = _norm(config, **kw)
    self.self_attn = T5Attention(config, **kw)
    self.cross_attn_norm = _norm(config, **kw)
    self.cross_attn = T5Attention(config, **kw)
    self.mlp_norm = _norm(config, **kw)
    self.mlp = T5MLP(config, **kw)

  def __call__(self, x: jax.Array, cross_kv: KV, *, self_mask: jax.Array, self_bias: jax.Array,
               cross_mask: jax.Array, cache: KV | None = None,
               cache_index: jax.Array | int = 0) -> tuple[jax.Array, KV | None]:
    """``x [B, T, D] -> ([B, T, D], cache)``.

    Args:
      cross_kv: this layer's cross-attention keys/values, each ``[B, S, N, H]``.
      self_mask: ``[B or 1, 1, T, T or L]`` causal (and padding) mask.
      self_bias: ``[1, N, T, T or L]`` relative position bias.
      cross_mask: ``[B, 1, 1, S]`` encoder padding mask.
      cache: ``(keys, values)``, each ``[B, L, N, H]``; the new keys/values
        are written at ``cache_index`` and attention runs over the whole cache.
    """
    h = self.self_attn_norm(x)
    keys, values = self.self_attn.project_kv(h)
    if cache is not None:
      start = (0, cache_index, 0, 0)
      keys = jax.lax.dynamic_update_slice(cache[0], keys.astype(cache[0].dtype), start)
      values = jax.lax.dynamic_update_slice(cache[1], values.astype(cache[1].dtype), start)
      cache = (keys, values)
    x = x + self.self_attn(h, keys, values, mask=self_mask, bias=self_bias)
    x = x + self.cross_attn(self.cross_attn_norm(x), *cross_kv, mask=cross_mask)
    return x + self.mlp(self.mlp_norm(x)), cache


class T5Encoder(layers.LayerExecution, nnx.Module):
  """Encoder stack: bidirectional relative bias, blocks, final norm."""

  def __init__(self, config: T5Config, *, dtype, param_dtype, rngs):
    self.relative_bias = RelativePositionBias(config, bidirectional=True, param_dtype=param_dtype,
                                              rngs=rngs)
    self.blocks = nnx.List([EncoderBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                            for _ in range(config.num_layers)])
    self.final_norm = _norm(config, dtype, param_dtype, rngs)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """Embedded tokens ``[B, S, D]`` and ``mask [B, S]`` (1 = token) -> ``[B, S, D]``."""
    length = x.shape[1]
    bias = self.relative_bias(jnp.arange(length), length)
    key_mask = mask.astype(bool)[:, None, None, :]
    x = layers.run_layers(self.blocks, lambda block, x, _: block(x, mask=key_mask, bias=bias), x,
                          scan=self.scan_layers, remat=self.remat)
    return self.final_norm(x)


class T5Decoder(layers.LayerExecution, nnx.Module):
  """Decoder stack: causal relative bias, blocks with cross-attention, final norm."""

  def __init__(self, config: T5Config, *, dtype, param_dtype, rngs):
    self.relative_bias = RelativePositionBias(config, bidirectional=False, param_dtype=param_dtype,
                                              rngs=rngs)
    self.blocks = nnx.List([DecoderBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                            for _ in range(config.num_decoder_layers)])
    self.final_norm = _norm(config, dtype, param_dtype, rngs)

  def cross_kv(self, encoder_hidden: jax.Array) -> tuple[KV, ...]:
    """Every layer's cross-attention ``(keys, values)``, each ``[B, S, N, H]``."""
    return tuple(block.cross_attn.project_kv(encoder_hidden) for block in self.blocks)

  def __call__(self, x: jax.Array, encoder_hidden: jax.Array, encoder_mask: jax.Array, *,
               decoder_mask: jax.Array | None = None) -> jax.Array:
    """Teacher forcing: embedded tokens ``[B, T, D]`` at positions ``0..T-1`` -> final-normed ``[B, T, D]``.

    ``encoder_hidden [B, S, D]`` and ``encoder_mask [B, S]``; ``decoder_mask [B, T]``
    optionally masks padded targets. Each layer projects its own cross-attention keys and
    values inside its body, so scanned layers (``set_layer_execution``) stay one body.
    """
    length = x.shape[1]
    positions = jnp.arange(length)
    self_mask = (positions[None, :] <= positions[:, None])[None, None]
    if decoder_mask is not None:
      self_mask = jnp.logical_and(self_mask, decoder_mask.astype(bool)[:, None, None, :])
    self_bias = self.relative_bias(positions, length)
    cross_mask = encoder_mask.astype(bool)[:, None, None, :]

    def body(block, x, _):
      return block(x, block.cross_attn.project_kv(encoder_hidden), self_mask=self_mask,
                   self_bias=self_bias, cross_mask=cross_mask)[0]

    x = layers.run_layers(self.blocks, body, x, scan=self.scan_layers, remat=self.remat)
    return self.final_norm(x)

  def step(self, x: jax.Array, cross_kv: Sequence[KV], encoder_mask: jax.Array,
           cache: Sequence[KV], cache_index: jax.Array | int) -> tuple[jax.Array, tuple[KV, ...]]:
    """Cached decoding: embedded tokens ``[B, T, D]`` at ``cache_index..cache_index+T-1``.

    ``cross_kv`` and ``cache`` hold one ``(keys, values)`` per layer (``[B, S, N, H]`` /
    ``[B, L, N, H]``); the tokens attend to every cached position up to their own.
    Returns the final-normed ``[B, T, D]`` and the updated caches (the layers run as a loop).
    """
    query_positions = cache_index + jnp.arange(x.shape[1])
    key_length = cache[0][0].shape[1]
    self_mask = (jnp.arange(key_length)[None, :] <= query_positions[:, None])[None, None]
    self_bias = self.relative_bias(query_positions, key_length)
    cross_mask = encoder_mask.astype(bool)[:, None, None, :]
    new_cache = []
    for i, block in enumerate(self.blocks):
      x, layer_cache = block(x, cross_kv[i], self_mask=self_mask, self_bias=self_bias,
                             cross_mask=cross_mask, cache=cache[i], cache_index=cache_index)
      new_cache.append(layer_cache)
    return self.final_norm(x), tuple(new_cache)


# ----------------------------------------------------------------------------- model


class DecodeState(NamedTuple):
  """What incremental decoding carries between steps.

  ``self_kv``: per decoder layer ``(keys, values)``, each ``[B, L, N, H]``;
  ``cross_kv``: per decoder layer ``(keys, values)``, each ``[B, S, N, H]``
  (fixed); ``encoder_mask``: ``[B, S]``.
  """
  self_kv: tuple[KV, ...]
  cross_kv: tuple[KV, ...]
  encoder_mask: jax.Array


class T5Model(nnx.Module):
  """T5 with its LM head (``T5ForConditionalGeneration``), or the encoder alone.

  Parameters: ``shared [V, D]``, ``encoder``, ``decoder`` and, when untied,
  ``lm_head.kernel [D, V]`` (``('embed', 'vocab')``).
  """

  def __init__(self, config: T5Config, *, dtype: jnp.dtype = jnp.float32,
               param_dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None):
    self.config = config
    self.dtype = dtype
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.shared = layers.Embed(config.vocab_size, config.d_model, **kw)
    self.encoder = T5Encoder(config, **kw)
    if config.encoder_only:
      self.decoder = None
      self.lm_head = None
    else:
      self.decoder = T5Decoder(config, **kw)
      self.lm_head = None if config.tie_word_embeddings else layers.DenseGeneral(
          (config.d_model,), (config.vocab_size,), axes=('embed', 'vocab'),
          kernel_init=nnx.initializers.normal(config.d_model ** -0.5), **kw)

  def set_layer_execution(self, *, scan_layers: bool | None = None, remat: bool | None = None
                          ) -> 'T5Model':
    """Scans / rematerialises the encoder's and the decoder's layers (:func:`layers.run_layers`).

    Applies to encoding and the teacher-forced decoder (training and scoring); cached
    decoding steps keep the loop. Returns ``self``.
    """
    for stack in (self.encoder, self.decoder):
      if stack is not None:
        stack.set_layer_execution(scan_layers=scan_layers, remat=remat)
    return self

  def encode(self, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
    """``input_ids [B, S]``, ``attention_mask [B, S]`` (1 = token) -> ``[B, S, D]``."""
    return self.encoder(self.shared(input_ids), attention_mask)

  def _require_decoder(self) -> T5Decoder:
    if self.decoder is None:
      raise ValueError('this T5 model is encoder-only (T5EncoderModel): it has no decoder')
    return self.decoder

  def decode_hidden(self, decoder_input_ids: jax.Array, encoder_hidden: jax.Array,
                    encoder_mask: jax.Array, decoder_mask: jax.Array | None = None) -> jax.Array:
    """Teacher-forced decoder output before the head.

    Args:
      decoder_input_ids: ``[B, T]``, starting with ``decoder_start_token_id``.
      encoder_hidden: ``[B, S, D]`` from :meth:`encode`.
      encoder_mask: ``[B, S]``.
      decoder_mask: optional ``[B, T]`` (1 = token) for padded targets.
    Returns:
      ``[B, T, D]`` final-normed hidden states; :meth:`logits` maps them to the vocabulary.
    """
    return self._require_decoder()(self.shared(decoder_input_ids), encoder_hidden, encoder_mask,
                                   decoder_mask=decoder_mask)

  def logits(self, hidden: jax.Array) -> jax.Array:
    """Decoder hidden states ``[..., D] -> [..., V]`` float32 logits (f32 accumulation)."""
    self._require_decoder()
    if self.config.scale_decoder_outputs:
      hidden = hidden * (self.config.d_model ** -0.5)
    hidden = hidden.astype(self.dtype)
    if self.lm_head is None:
      return jnp.einsum('...d,vd->...v', hidden, self.shared.embedding[...].astype(self.dtype),
                        preferred_element_type=jnp.float32)
    return jnp.einsum('...d,dv->...v', hidden, self.lm_head.kernel[...].astype(self.dtype),
                      preferred_element_type=jnp.float32)

  def decode(self, decoder_input_ids: jax.Array, encoder_hidden: jax.Array,
             encoder_mask: jax.Array, decoder_mask: jax.Array | None = None) -> jax.Array:
    """Teacher-forced logits ``[B, T, V]`` (see :meth:`decode_hidden`)."""
    return self.logits(self.decode_hidden(decoder_input_ids, encoder_hidden, encoder_mask,
                                          decoder_mask))

  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array,
               decoder_input_ids: jax.Array, decoder_mask: jax.Array | None = None) -> jax.Array:
    """``input_ids / attention_mask [B, S]``, ``decoder_input_ids [B, T]`` -> logits ``[B, T, V]``."""
    encoder_hidden = self.encode(input_ids, attention_mask)
    return self.decode(decoder_input_ids, encoder_hidden, attention_mask, decoder_mask)

  # --- incremental decoding

  def init_decode_state(self, encoder_hidden: jax.Array, encoder_mask: jax.Array,
                        max_length: int) -> DecodeState:
    """Empty self-attention caches ``[B, max_length, N, H]`` and the cross-attention keys/values."""
    decoder = self._require_decoder()
    batch = encoder_hidden.shape[0]
    shape = (batch, max_length, self.config.num_heads, self.config.d_kv)
    empty = tuple((jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
                  for _ in decoder.blocks)
    return DecodeState(empty, decoder.cross_kv(encoder_hidden), encoder_mask)

  def decode_step(self, tokens: jax.Array, state: DecodeState,
                  position: jax.Array | int) -> tuple[jax.Array, DecodeState]:
    """Feeds ``tokens [B, T]`` at decoder positions ``position..position+T-1``.

    Returns float32 logits ``[B, T, V]`` and the state with their keys/values cached.
    """
    decoder = self._require_decoder()
    hidden, self_kv = decoder.step(self.shared(tokens), state.cross_kv, state.encoder_mask,
                                   state.self_kv, position)
    return self.logits(hidden), state._replace(self_kv=self_kv)


# ----------------------------------------------------------------------------- generation


def default_stop_mask(config: T5Config, tokenizer=None, stop_strings: Sequence[str] = ()) -> np.ndarray:
  """``[V]`` bool: the config's EOS id(s) plus tokens whose text contains a stop string."""
  if stop_strings and tokenizer is None:
    raise ValueError('stop_strings need a tokenizer to find the tokens that contain them')
  return decoding.stop_token_mask(tokenizer, config.vocab_size, stop_strings,
                                  eos_ids=config.eos_token_ids)


@functools.partial(jax.jit, static_argnames=('graphdef', 'sampling', 'pad_id'))
def _generate(graphdef: nnx.GraphDef, state: nnx.State, input_ids: jax.Array,
              attention_mask: jax.Array, stop_mask: jax.Array, rng: jax.Array, *,
              sampling: decoding.SamplingConfig, pad_id: int) -> tuple[jax.Array, jax.Array]:
  model = nnx.merge(graphdef, state)
  batch = input_ids.shape[0]
  encoder_hidden = model.encode(input_ids, attention_mask)
  decode_state = model.init_decode_state(encoder_hidden, attention_mask, sampling.max_new_tokens)
  start = jnp.full((batch, 1), model.config.decoder_start_token_id, jnp.int32)
  first_logits, decode_state = model.decode_step(start, decode_state, 0)

  def step_fn(tokens, decode_state, step):
    # New token `step` sits at decoder position step + 1 (position 0 is the start token).
    logits, decode_state = model.decode_step(tokens[:, None], decode_state, step + 1)
    return logits[:, 0], decode_state

  return decoding.decode_loop(step_fn, decode_state, first_logits[:, 0], rng=rng,
                              stop_mask=stop_mask, sampling=sampling, pad_id=pad_id)


def generate(model: T5Model, input_ids, attention_mask, *, sampling: decoding.SamplingConfig,
             stop_mask=None, rng: jax.Array | None = None, pad_id: int | None = None,
             bucket: bool = True) -> tuple[jax.Array, jax.Array]:
  """Encodes ``input_ids`` and samples up to ``sampling.max_new_tokens`` tokens, all in one jit.

  Args:
    model: a :class:`T5Model` with a decoder.
    input_ids: ``[B, S]`` int (right- or left-padded).
    attention_mask: ``[B, S]`` (1 = token).
    sampling: greedy when ``temperature == 0``; static under jit.
    stop_mask: ``[V]`` bool of tokens that end a sequence (default:
      :func:`default_stop_mask`, the EOS ids).
    rng: PRNG key for sampling (unused when greedy).
    pad_id: written after a sequence stops (default: ``config.pad_token_id``).
    bucket: right-pad ``S`` to :func:`recomp_jax.data.buckets.bucket_length` so varying input
      lengths reuse a few compiled programs (padding is masked: same result).
  Returns:
    ``tokens [B, max_new_tokens]`` int32 (without the start token; ``pad_id``
    after the stop token) and ``lengths [B]`` (stop token included).
  """
  config = model.config
  if config.encoder_only:
    raise ValueError('this T5 model is encoder-only (T5EncoderModel): it cannot generate')
  pad_id = config.pad_token_id if pad_id is None else int(pad_id)
  input_ids = jnp.asarray(input_ids, jnp.int32)
  attention_mask = jnp.asarray(attention_mask, jnp.int32)
  if bucket:
    extra = bucket_length(input_ids.shape[1]) - input_ids.shape[1]
    input_ids = jnp.pad(input_ids, ((0, 0), (0, extra)), constant_values=config.pad_token_id)
    attention_mask = jnp.pad(attention_mask, ((0, 0), (0, extra)))
  if stop_mask is None:
    stop_mask = default_stop_mask(config)
  stop_mask = jnp.asarray(stop_mask, bool)
  if stop_mask.shape != (config.vocab_size,):
    raise ValueError(f'stop_mask has shape {stop_mask.shape}, expected ({config.vocab_size},)')
  rng = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, input_ids, attention_mask, stop_mask, rng, sampling=sampling,
                   pad_id=pad_id)


# ----------------------------------------------------------------------------- checkpoints


_SHARED = 'shared.weight'
_SHARED_COPIES = ('encoder.embed_tokens.weight', 'decoder.embed_tokens.weight', 'lm_head.weight')


class _SharedEmbeddingAlias:
  """A :class:`TensorSource` view that finds ``shared.weight`` under a tied copy's name.

  Checkpoints de-duplicated by safetensors conversion may keep the embedding
  only under a tied name such as ``encoder.embed_tokens.weight`` (transformers
  re-ties it on load). ``lm_head.weight`` is the last resort: stored without
  ``shared.weight``, it can only be the tied copy.
  """

  def __init__(self, source: TensorSource):
    self._source = source
    names = set(source.names())
    self._alias = None
    if _SHARED not in names:
      self._alias = next((n for n in _SHARED_COPIES if n in names), None)

  def names(self):
    names = list(self._source.names())
    return names + [_SHARED] if self._alias else names

  def get(self, name: str):
    return self._source.get(self._alias if name == _SHARED and self._alias else name)

  def location(self, name: str) -> str:
    return self._source.location(self._alias if name == _SHARED and self._alias else name)


def weight_specs(config: T5Config) -> list[WeightSpec]:
  """Hugging Face ``T5ForConditionalGeneration`` / ``T5EncoderModel`` names of every parameter.

  The tied copies ``encoder.embed_tokens.weight`` / ``decoder.embed_tokens.weight``
  (and a tied ``lm_head.weight``) are not separate parameters here.
  """
  d, n, h, v = config.d_model, config.num_heads, config.d_kv, config.vocab_size
  specs = [WeightSpec(_SHARED, ('shared', 'embedding'))]

  def attention(hf: str, ours: tuple) -> list[WeightSpec]:
    return [linear(f'{hf}.q.weight', ours + ('q', 'kernel'), (d,), (n, h)),
            linear(f'{hf}.k.weight', ours + ('k', 'kernel'), (d,), (n, h)),
            linear(f'{hf}.v.weight', ours + ('v', 'kernel'), (d,), (n, h)),
            linear(f'{hf}.o.weight', ours + ('o', 'kernel'), (n, h), (d,))]

  def mlp(hf: str, ours: tuple) -> list[WeightSpec]:
    names = ('wi_0', 'wi_1') if config.is_gated else ('wi',)
    return ([linear(f'{hf}.{w}.weight', ours + (w, 'kernel'), (d,), (config.d_ff,)) for w in names]
            + [linear(f'{hf}.wo.weight', ours + ('wo', 'kernel'), (config.d_ff,), (d,))])

  def norm(hf: str, ours: tuple) -> WeightSpec:
    return WeightSpec(f'{hf}.weight', ours + ('scale',))

  stacks = [('encoder', config.num_layers)]
  if not config.encoder_only:
    stacks.append(('decoder', config.num_decoder_layers))
  for stack, num_layers in stacks:
    specs.append(WeightSpec(f'{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight',
                            (stack, 'relative_bias', 'embedding')))
    specs.append(norm(f'{stack}.final_layer_norm', (stack, 'final_norm')))
    for i in range(num_layers):
      hf, ours = f'{stack}.block.{i}.layer', (stack, 'blocks', i)
      if stack == 'encoder':
        specs += attention(f'{hf}.0.SelfAttention', ours + ('attn',))
        specs.append(norm(f'{hf}.0.layer_norm', ours + ('attn_norm',)))
        specs += mlp(f'{hf}.1.DenseReluDense', ours + ('mlp',))
        specs.append(norm(f'{hf}.1.layer_norm', ours + ('mlp_norm',)))
      else:
        specs += attention(f'{hf}.0.SelfAttention', ours + ('self_attn',))
        specs.append(norm(f'{hf}.0.layer_norm', ours + ('self_attn_norm',)))
        specs += attention(f'{hf}.1.EncDecAttention', ours + ('cross_attn',))
        specs.append(norm(f'{hf}.1.layer_norm', ours + ('cross_attn_norm',)))
        specs += mlp(f'{hf}.2.DenseReluDense', ours + ('mlp',))
        specs.append(norm(f'{hf}.2.layer_norm', ours + ('mlp_norm',)))
  if not config.encoder_only and not config.tie_word_embeddings:
    specs.append(linear('lm_head.weight', ('lm_head', 'kernel'), (d,), (v,)))
  return specs


def build(config: T5Config, *, dtype=jnp.float32, param_dtype=jnp.float32,
          rngs: nnx.Rngs | None) -> T5Model:
  return T5Model(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


FAMILY = ModelFamily(
    name='t5',
    config_from_hf=T5Config.from_hf,
    config_to_hf=T5Config.to_hf,
    build=build,
    weight_specs=weight_specs,
    ignore=(r'^(encoder|decoder)\.embed_tokens\.weight$',
            # transformers' own ignore list: a stray cross-attention bias in old checkpoints.
            r'^decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight$'),
    adapt_source=_SharedEmbeddingAlias,
    config_from_checkpoint=config_from_checkpoint,
)
