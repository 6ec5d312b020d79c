"""BERT encoder (Contriever, MiniLM / sentence-transformers) in Flax NNX.

Post-LayerNorm transformer encoder with learned absolute positions and
token-type embeddings, matching Hugging Face ``BertModel`` (without its
pooler, which retrieval encoders do not use). Sentence embeddings come from
:func:`pool` (masked mean or CLS, optionally L2-normalised).

Shapes: ``B`` batch, ``T`` length, ``D`` embed, ``N`` heads, ``H`` head dim,
``F`` mlp, ``V`` vocab.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable

import jax
import jax.numpy as jnp
from flax import nnx

from recomp_jax.pretrained.spec import ModelFamily
from recomp_jax.pretrained.hf import (Array, CheckpointError, TensorSource, WeightSpec, linear,
                                       reshaped)
from recomp_jax.models import layers


@dataclasses.dataclass(frozen=True)
class BertConfig:
  """Architecture of a BERT encoder (the fields of a HF ``BertConfig`` that matter)."""
  vocab_size: int = 30522
  hidden_size: int = 768
  num_hidden_layers: int = 12
  num_attention_heads: int = 12
  intermediate_size: int = 3072
  hidden_act: str = 'gelu'
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  pad_token_id: int = 0
  hidden_dropout_prob: float = 0.1
  attention_probs_dropout_prob: float = 0.1  # kept for to_hf; not applied (see BertModel)

  def __post_init__(self):
    if self.hidden_size % self.num_attention_heads:
      raise ValueError(f'hidden_size {self.hidden_size} is not a multiple of '
                       f'num_attention_heads {self.num_attention_heads}')
    layers.activation(self.hidden_act)  # fails early on an unsupported activation

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_attention_heads

  @classmethod
  def from_hf(cls, hf: dict) -> 'BertConfig':
    """From a Hugging Face ``config.json`` dict (``model_type == 'bert'``)."""
    position_type = hf.get('position_embedding_type', 'absolute')
    if position_type != 'absolute':
      raise ValueError(f'BERT position_embedding_type {position_type!r} is not supported: only '
                       "'absolute' (learned positions) is implemented")
    if hf.get('is_decoder') or hf.get('add_cross_attention'):
      raise ValueError('BERT as a decoder (is_decoder / add_cross_attention) is not supported: '
                       'this is a bidirectional encoder')
    names = ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads',
             'intermediate_size', 'hidden_act', 'max_position_embeddings', 'type_vocab_size',
             'layer_norm_eps', 'pad_token_id', 'hidden_dropout_prob',
             'attention_probs_dropout_prob')
    kwargs = {k: hf[k] for k in names if hf.get(k) is not None}
    return cls(**kwargs)

  def to_hf(self) -> dict:
    """A ``config.json`` dict that ``transformers.BertModel`` loads into this architecture."""
    return {
        'model_type': 'bert',
        'architectures': ['BertModel'],
        **dataclasses.asdict(self),
        'position_embedding_type': 'absolute',
    }


class BertEmbeddings(nnx.Module):
  """Word + position + token-type embeddings followed by LayerNorm."""

  def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs | None):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    d = config.hidden_size
    self.word_embeddings = layers.Embed(config.vocab_size, d, axes=('vocab', 'embed'), **kw)
    self.position_embeddings = layers.Embed(config.max_position_embeddings, d,
                                            axes=('position', 'embed'), **kw)
    self.token_type_embeddings = layers.Embed(config.type_vocab_size, d,
                                              axes=('type_vocab', 'embed'), **kw)
    self.norm = layers.LayerNorm(d, eps=config.layer_norm_eps, **kw)

  def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
    """``[B, T]`` ids and token types -> ``[B, T, D]``."""
    positions = jnp.arange(input_ids.shape[1])[None, :]
    x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
    x = x + self.position_embeddings(positions)
    return self.norm(x)


class BertSelfAttention(nnx.Module):
  """Bidirectional multi-head self-attention with biased Q/K/V/output projections."""

  def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs | None):
    kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    d, n, h = config.hidden_size, config.num_attention_heads, config.head_dim
    self.scale = h**-0.5
    self.query = layers.DenseGeneral((d,), (n, h), axes=('embed', 'heads', 'head_dim'), **kw)
    self.key = layers.DenseGeneral((d,), (n, h), axes=('embed', 'kv_heads', 'head_dim'), **kw)
    self.value = layers.DenseGeneral((d,), (n, h), axes=('embed', 'kv_heads', 'head_dim'), **kw)
    self.out = layers.DenseGeneral((n, h), (d,), axes=('heads', 'head_dim', 'embed'), **kw)

  def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
    """``[B, T, D]`` with a boolean ``[B, 1, 1, T]`` key mask -> ``[B, T, D]``."""
    q, k, v = self.query(x), self.key(x), self.value(x)  # [B, T, N, H]
    return self.out(layers.dot_product_attention(q, k, v, mask=mask, scale=self.scale))


class BertMLP(nnx.Module):
  """``D -> F -> D`` feed-forward block with biases."""

  def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs | None):
    kw = dict(use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    d, f = config.hidden_size, config.intermediate_size
    self.act = layers.activation(config.hidden_act)
    self.wi = layers.DenseGeneral((d,), (f,), axes=('embed', 'mlp'), **kw)
    self.wo = layers.DenseGeneral((f,), (d,), axes=('mlp', 'embed'), **kw)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[B, T, D] -> [B, T, D]``."""
    return self.wo(self.act(self.wi(x)))


class BertLayer(nnx.Module):
  """Post-LN block: ``x = LN(x + attn(x)); x = LN(x + mlp(x))``."""

  def __init__(self, config: BertConfig, *, dtype, param_dtype, rngs: nnx.Rngs | None):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    norm_kw = dict(eps=config.layer_norm_eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.attn = BertSelfAttention(config, **kw)
    self.attn_norm = layers.LayerNorm(config.hidden_size, **norm_kw)
    self.mlp = BertMLP(config, **kw)
    self.mlp_norm = layers.LayerNorm(config.hidden_size, **norm_kw)
    self.dropout = nnx.Dropout(config.hidden_dropout_prob)

  def __call__(self, x: jax.Array, mask: jax.Array, *, deterministic: bool = True,
               rngs: nnx.Rngs | None = None) -> jax.Array:
    """``[B, T, D]`` with a ``[B, 1, 1, T]`` key mask -> ``[B, T, D]``."""
    drop = lambda y: self.dropout(y, deterministic=deterministic, rngs=rngs)  # noqa: E731
    x = self.attn_norm(x + drop(self.attn(x, mask)))
    return self.mlp_norm(x + drop(self.mlp(x)))


class BertModel(layers.LayerExecution, nnx.Module):
  """BERT encoder returning the last hidden state.

  Dropout (``hidden_dropout_prob``, on embeddings and on both residual
  branches) is active only with ``deterministic=False`` and ``rngs`` holding a
  ``'dropout'`` stream; attention-probability dropout is not implemented.

  How the layers run (:meth:`set_layer_execution`; the parameters stay per layer, so
  checkpoints, HF export and sharding rules do not change):

  * ``scan_layers``: one ``lax.scan`` over the layers' stacked parameters, so the compiled
    program holds one layer body and compile time does not grow with depth;
  * ``remat``: each layer's activations are recomputed in the backward pass instead of
    kept (``jax.checkpoint`` per layer): training memory no longer grows with
    ``layers x batch x length`` intermediates (GELU, LayerNorm, attention probabilities),
    for about a third more compute.
  """

  def __init__(self, config: BertConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
               rngs: nnx.Rngs | None):
    kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.config = config
    self.dtype = dtype
    self.embeddings = BertEmbeddings(config, **kw)
    self.dropout = nnx.Dropout(config.hidden_dropout_prob)
    self.layers = nnx.List([BertLayer(config, **kw) for _ in range(config.num_hidden_layers)])

  def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None,
               token_type_ids: jax.Array | None = None, *, deterministic: bool = True,
               rngs: nnx.Rngs | None = None) -> jax.Array:
    """Encodes a batch.

    Args:
      input_ids: ``[B, T]`` int token ids.
      attention_mask: ``[B, T]`` (1/True = real token, 0/False = padding);
        ``None`` attends everywhere.
      token_type_ids: ``[B, T]`` segment ids; ``None`` means all zeros.
      deterministic: disables dropout (inference).
      rngs: ``nnx.Rngs`` with a ``'dropout'`` stream when not deterministic.
    Returns:
      ``[B, T, D]`` last hidden state in ``dtype`` (padding positions hold
      values too; mask them downstream).
    """
    length = input_ids.shape[1]
    if length > self.config.max_position_embeddings:
      raise ValueError(f'sequence length {length} exceeds max_position_embeddings '
                       f'{self.config.max_position_embeddings}')
    if attention_mask is None:
      attention_mask = jnp.ones(input_ids.shape, jnp.bool_)
    if token_type_ids is None:
      token_type_ids = jnp.zeros(input_ids.shape, jnp.int32)
    x = self.embeddings(input_ids, token_type_ids)
    x = self.dropout(x, deterministic=deterministic, rngs=rngs)
    mask = attention_mask.astype(jnp.bool_)[:, None, None, :]  # [B, 1, 1, S]
    if self.scan_layers and not deterministic:
      raise ValueError('scan_layers runs without dropout; pass deterministic=True')
    body = lambda layer, x, _: layer(x, mask, deterministic=deterministic, rngs=rngs)  # noqa: E731
    return layers.run_layers(self.layers, body, x, scan=self.scan_layers, remat=self.remat)


# ----------------------------------------------------------------------------- pooling

POOLING_MODES = ('cls', 'mean')


def pool(hidden: jax.Array, attention_mask: jax.Array, mode: str = 'mean',
         normalize: bool = False) -> jax.Array:
  """Sentence embeddings from token states, in float32.

  Args:
    hidden: ``[B, T, D]`` token states.
    attention_mask: ``[B, T]`` (nonzero = real token).
    mode: ``'mean'`` (masked mean over real tokens) or ``'cls'`` (the first
      real token, i.e. ``[CLS]`` under right padding).
    normalize: L2-normalise the result (``x / max(|x|, 1e-12)``).
  Returns:
    ``[B, D]`` float32.
  """
  hidden = hidden.astype(jnp.float32)
  mask = attention_mask.astype(jnp.float32)  # [B, T]
  if mode == 'mean':
    total = jnp.einsum('btd,bt->bd', hidden, mask)
    out = total / jnp.maximum(mask.sum(axis=1, keepdims=True), 1e-9)
  elif mode == 'cls':
    first = jnp.argmax(mask > 0, axis=1)  # [B]
    out = jnp.take_along_axis(hidden, first[:, None, None], axis=1)[:, 0]
  else:
    raise ValueError(f'unknown pooling mode {mode!r}; expected one of {POOLING_MODES}')
  if normalize:
    norm = jnp.linalg.norm(out, axis=-1, keepdims=True)
    out = out / jnp.maximum(norm, 1e-12)
  return out


_ST_LEGACY_MODES = {
    'pooling_mode_cls_token': 'cls',
    'pooling_mode_max_tokens': 'max',
    'pooling_mode_mean_tokens': 'mean',
    'pooling_mode_mean_sqrt_len_tokens': 'mean_sqrt_len_tokens',
    'pooling_mode_weightedmean_tokens': 'weightedmean',
    'pooling_mode_lasttoken': 'lasttoken',
}


def pooling_from_sentence_transformers(cfg: dict) -> tuple[str, bool]:
  """``(mode, normalize)`` from a sentence-transformers ``1_Pooling/config.json`` dict.

  Understands both the legacy boolean keys (``pooling_mode_mean_tokens``, ...)
  and the newer ``pooling_mode`` key; ``normalize`` is the flag that
  :func:`recomp_jax.pretrained.load_pretrained` adds when the pipeline has a
  ``Normalize`` module.
  """
  modes = cfg.get('pooling_mode')
  if modes is None:
    modes = [mode for key, mode in _ST_LEGACY_MODES.items() if cfg.get(key)] or ['mean']
  elif isinstance(modes, str):
    modes = [modes]
  modes = list(modes)
  if len(modes) != 1 or modes[0] not in POOLING_MODES:
    raise ValueError(f'sentence-transformers pooling {modes} is not supported; '
                     f'supported: exactly one of {POOLING_MODES}')
  return modes[0], bool(cfg.get('normalize', False))


# ----------------------------------------------------------------------------- checkpoints


def weight_specs(config: BertConfig) -> list[WeightSpec]:
  """Hugging Face ``BertModel`` tensor names (no ``'bert.'`` prefix) -> our parameters.

  Prefixed names (``BertFor*`` checkpoints) and legacy ``LayerNorm.gamma/beta``
  are accepted on load through :class:`CanonicalNames`.
  """
  d, n, h, f = (config.hidden_size, config.num_attention_heads, config.head_dim,
                config.intermediate_size)

  def norm(hf: str, path: tuple) -> list[WeightSpec]:
    return [WeightSpec(f'{hf}.weight', path + ('scale',)),
            WeightSpec(f'{hf}.bias', path + ('bias',))]

  specs = [
      WeightSpec('embeddings.word_embeddings.weight',
                 ('embeddings', 'word_embeddings', 'embedding')),
      WeightSpec('embeddings.position_embeddings.weight',
                 ('embeddings', 'position_embeddings', 'embedding')),
      WeightSpec('embeddings.token_type_embeddings.weight',
                 ('embeddings', 'token_type_embeddings', 'embedding')),
      *norm('embeddings.LayerNorm', ('embeddings', 'norm')),
  ]
  for i in range(config.num_hidden_layers):
    hf, ours = f'encoder.layer.{i}', ('layers', i)
    for name in ('query', 'key', 'value'):
      hf_attn, attn = f'{hf}.attention.self.{name}', ours + ('attn', name)
      specs += [
          linear(f'{hf_attn}.weight', attn + ('kernel',), (d,), (n, h)),
          reshaped(f'{hf_attn}.bias', attn + ('bias',), (n, h), (n * h,)),
      ]
    specs += [
        linear(f'{hf}.attention.output.dense.weight', ours + ('attn', 'out', 'kernel'), (n, h),
               (d,)),
        WeightSpec(f'{hf}.attention.output.dense.bias', ours + ('attn', 'out', 'bias')),
        *norm(f'{hf}.attention.output.LayerNorm', ours + ('attn_norm',)),
        linear(f'{hf}.intermediate.dense.weight', ours + ('mlp', 'wi', 'kernel'), (d,), (f,)),
        WeightSpec(f'{hf}.intermediate.dense.bias', ours + ('mlp', 'wi', 'bias')),
        linear(f'{hf}.output.dense.weight', ours + ('mlp', 'wo', 'kernel'), (f,), (d,)),
        WeightSpec(f'{hf}.output.dense.bias', ours + ('mlp', 'wo', 'bias')),
        *norm(f'{hf}.output.LayerNorm', ours + ('mlp_norm',)),
    ]
  return specs


def canonical_name(name: str) -> str:
  """``'bert.x.LayerNorm.gamma'`` -> ``'x.LayerNorm.weight'`` (the ``BertModel`` naming)."""
  name = name.removeprefix('bert.')
  name = re.sub(r'LayerNorm\.gamma$', 'LayerNorm.weight', name)
  return re.sub(r'LayerNorm\.beta$', 'LayerNorm.bias', name)


class CanonicalNames:
  """A view of a tensor source under :func:`canonical_name` names.

  Errors keep pointing at the stored tensor: ``location`` reports the file
  and, when renamed, the stored name.
  """

  def __init__(self, source: TensorSource):
    self._source = source
    self._stored: dict[str, str] = {}
    for name in source.names():
      canon = canonical_name(name)
      if canon in self._stored:
        raise CheckpointError(f'{source.location(name)}: tensors {self._stored[canon]!r} and '
                              f'{name!r} both stand for {canon!r}')
      self._stored[canon] = name

  def names(self) -> Iterable[str]:
    return self._stored.keys()

  def get(self, name: str) -> Array:
    return self._source.get(self._stored[name])

  def location(self, name: str) -> str:
    stored = self._stored[name]
    where = self._source.location(stored)
    return where if stored == name else f'{where} (stored as {stored!r})'


def _build(config: BertConfig, *, dtype=jnp.float32, param_dtype=jnp.float32,
           rngs: nnx.Rngs | None) -> BertModel:
  return BertModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


FAMILY = ModelFamily(
    name='bert',
    config_from_hf=BertConfig.from_hf,
    config_to_hf=BertConfig.to_hf,
    build=_build,
    weight_specs=weight_specs,
    # The HF pooler, non-persistent buffers, and task heads of BertFor* checkpoints.
    ignore=(r'^pooler\.', r'^embeddings\.(position_ids|token_type_ids)$',
            r'^(cls|classifier|qa_outputs)\.'),
    adapt_source=CanonicalNames,
)

__all__ = ['BertConfig', 'BertModel', 'CanonicalNames', 'FAMILY', 'POOLING_MODES',
           'canonical_name', 'pool', 'pooling_from_sentence_transformers', 'weight_specs']
