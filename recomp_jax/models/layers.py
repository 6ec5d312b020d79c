"""Shared Flax NNX building blocks for the BERT, T5 and Gemma models.

Every parameter is created through :func:`param`, which attaches *logical axis
names* (``('embed', 'mlp')``, ``('vocab', 'embed')``, ...) as the variable's
``out_sharding`` metadata. Model code never names mesh axes: the one table in
:mod:`recomp_jax.sharding` maps logical names to mesh axes.

Logical parameter axes used across the zoo:

============  ===============================================================
``vocab``      vocabulary rows of token embeddings / LM heads
``embed``      the model (residual stream) dimension
``mlp``        the feed-forward hidden dimension
``heads``      query heads
``kv_heads``   key/value heads (== heads for MHA, 1 for MQA)
``head_dim``   per-head feature dimension
``norm``       1-D scales and biases of normalisation layers
``position``   learned absolute positions (BERT)
``type_vocab`` BERT token-type embeddings
``relpos``     T5 relative-position buckets
============  ===============================================================

Shapes in docstrings use ``B`` batch, ``T`` query length, ``S`` key length,
``D`` embed, ``N`` query heads, ``K`` kv heads, ``H`` head dim, ``F`` mlp,
``V`` vocab.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Axes = tuple[str | None, ...]
Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]

default_kernel_init: Initializer = nnx.initializers.normal(stddev=0.02)


def param(rngs: nnx.Rngs | None, init: Initializer, shape: Sequence[int], axes: Axes,
          dtype: jnp.dtype = jnp.float32) -> nnx.Param:
  """Creates an ``nnx.Param`` carrying logical axis names.

  Eager sharding is off: placement is decided by :mod:`recomp_jax.sharding`
  (sharded init via ``jax.jit(..., out_shardings=...)``), never at creation.
  When ``rngs`` is None the parameter is zero-initialised (used when the
  values are about to be overwritten by a checkpoint).
  """
  shape = tuple(int(s) for s in shape)
  assert len(shape) == len(axes), (shape, axes)
  if rngs is None:
    value = jnp.zeros(shape, dtype)
  else:
    value = init(rngs.params(), shape, dtype)
  return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


class DenseGeneral(nnx.Module):
  """A dense layer contracting the trailing ``in_features`` dims of the input.

  ``kernel``: ``[*in_features, *out_features]`` with logical ``axes`` (one
  name per kernel dimension); optional ``bias``: ``[*out_features]``.

  Example: a query projection ``[B, T, D] -> [B, T, N, H]`` is
  ``DenseGeneral((D,), (N, H), axes=('embed', 'heads', 'head_dim'))``; an
  output projection ``[B, T, N, H] -> [B, T, D]`` is
  ``DenseGeneral((N, H), (D,), axes=('heads', 'head_dim', 'embed'))``.
  """

  def __init__(self, in_features: Sequence[int], out_features: Sequence[int], *, axes: Axes,
               use_bias: bool = False, dtype: jnp.dtype = jnp.float32,
               param_dtype: jnp.dtype = jnp.float32, kernel_init: Initializer = default_kernel_init,
               rngs: nnx.Rngs | None):
    self.in_features = tuple(in_features)
    self.out_features = tuple(out_features)
    self.dtype = dtype
    self.kernel = param(rngs, kernel_init, self.in_features + self.out_features, axes, param_dtype)
    if use_bias:
      bias_axes = tuple(axes[len(self.in_features):])
      self.bias = param(rngs, nnx.initializers.zeros, self.out_features, bias_axes, param_dtype)
    else:
      self.bias = None

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[..., *in_features] -> [..., *out_features]``."""
    n_in = len(self.in_features)
    kernel = self.kernel[...].astype(self.dtype)
    x = x.astype(self.dtype)
    contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    y = jax.lax.dot_general(x, kernel, (contract, ((), ())))
    if self.bias is not None:
      y = y + self.bias[...].astype(self.dtype)
    return y


class Embed(nnx.Module):
  """Token embedding table ``[V, D]`` (axes ``('vocab', 'embed')``).

  ``__call__`` looks rows up; ``attend`` is the tied output head
  ``[..., D] -> [..., V]``.
  """

  def __init__(self, num_embeddings: int, features: int, *, axes: Axes = ('vocab', 'embed'),
               dtype: jnp.dtype = jnp.float32, param_dtype: jnp.dtype = jnp.float32,
               rngs: nnx.Rngs | None):
    self.dtype = dtype
    self.embedding = param(rngs, nnx.initializers.normal(stddev=1.0), (num_embeddings, features),
                           axes, param_dtype)

  def __call__(self, ids: jax.Array) -> jax.Array:
    """``[...] int -> [..., D]``."""
    return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)

  def attend(self, x: jax.Array) -> jax.Array:
    """``[..., D] -> [..., V]`` logits against the embedding table."""
    return jnp.einsum('...d,vd->...v', x.astype(self.dtype), self.embedding[...].astype(self.dtype))


class RMSNorm(nnx.Module):
  """Root-mean-square norm over the last axis, computed in float32.

  ``scale_plus_one=True`` is the Gemma convention ``x * (1 + w)`` (weights
  stored as offsets from one); ``False`` is the T5 convention ``x * w``.
  """

  def __init__(self, features: int, *, eps: float = 1e-6, scale_plus_one: bool = False,
               axes: Axes = ('norm',), dtype: jnp.dtype = jnp.float32,
               param_dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None):
    self.eps = eps
    self.scale_plus_one = scale_plus_one
    self.dtype = dtype
    init = nnx.initializers.zeros if scale_plus_one else nnx.initializers.ones
    self.scale = param(rngs, init, (features,), axes, param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[..., D] -> [..., D]``."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    scale = self.scale[...].astype(jnp.float32)
    if self.scale_plus_one:
      scale = 1.0 + scale
    return (y * scale).astype(self.dtype)


class LayerNorm(nnx.Module):
  """Standard LayerNorm with scale and bias (BERT), computed in float32."""

  def __init__(self, features: int, *, eps: float = 1e-12, dtype: jnp.dtype = jnp.float32,
               param_dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None):
    self.eps = eps
    self.dtype = dtype
    self.scale = param(rngs, nnx.initializers.ones, (features,), ('norm',), param_dtype)
    self.bias = param(rngs, nnx.initializers.zeros, (features,), ('norm',), param_dtype)

  def __call__(self, x: jax.Array) -> jax.Array:
    """``[..., D] -> [..., D]``."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + self.eps)
    y = y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return y.astype(self.dtype)


def rope_inverse_frequencies(head_dim: int, base: float, scaling_factor: float = 1.0) -> np.ndarray:
  """``[H/2]`` inverse frequencies; linear RoPE scaling divides them by ``scaling_factor``."""
  exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
  return (1.0 / (base ** exponents) / scaling_factor).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array) -> jax.Array:
  """Rotary embedding, "rotate half" layout (HF Llama/Gemma, GGUF NeoX order).

  Args:
    x: ``[B, T, N, H]``.
    positions: ``[B, T]`` integer positions.
    inv_freq: ``[H/2]``.
  Returns:
    ``[B, T, N, H]`` in ``x.dtype``.
  """
  angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  x32 = x.astype(jnp.float32)
  first, second = jnp.split(x32, 2, axis=-1)
  out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
  return out.astype(x.dtype)


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array, *,
                          mask: jax.Array | None = None, bias: jax.Array | None = None,
                          scale: float = 1.0, logit_softcap: float | None = None) -> jax.Array:
  """Grouped-query attention with float32 softmax.

  Args:
    query: ``[B, T, N, H]``.
    key, value: ``[B, S, K, H]`` with ``N % K == 0`` (``K == 1`` is MQA).
    mask: boolean, broadcastable to ``[B, 1, T, S]`` (True = attend).
    bias: additive, broadcastable to ``[B, N, T, S]`` (T5 relative positions).
    scale: multiplier applied to the query.
    logit_softcap: if set, ``cap * tanh(logits / cap)`` before masking (Gemma 2).
  Returns:
    ``[B, T, N, H]``.
  """
  batch, q_len, num_heads, head_dim = query.shape
  num_kv = key.shape[2]
  groups = num_heads // num_kv
  q = (query * scale).reshape(batch, q_len, num_kv, groups, head_dim)
  logits = jnp.einsum('btkgh,bskh->bkgts', q, key, preferred_element_type=jnp.float32)
  logits = logits.reshape(batch, num_heads, q_len, key.shape[1])
  if logit_softcap is not None:
    logits = jnp.tanh(logits / logit_softcap) * logit_softcap
  if bias is not None:
    logits = logits + bias.astype(jnp.float32)
  if mask is not None:
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
  probs = probs.reshape(batch, num_kv, groups, q_len, key.shape[1])
  out = jnp.einsum('bkgts,bskh->btkgh', probs, value)
  return out.reshape(batch, q_len, num_heads, head_dim)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    'relu': jax.nn.relu,
    'gelu': lambda x: jax.nn.gelu(x, approximate=False),
    'gelu_new': lambda x: jax.nn.gelu(x, approximate=True),
    'gelu_pytorch_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'gelu_tanh': lambda x: jax.nn.gelu(x, approximate=True),
    'silu': jax.nn.silu,
}


def activation(name: str) -> Callable[[jax.Array], jax.Array]:
  """Looks an activation up by its Hugging Face config name."""
  if name not in ACTIVATIONS:
    raise ValueError(f'unsupported activation {name!r}; known: {sorted(ACTIVATIONS)}')
  return ACTIVATIONS[name]


# ----------------------------------------------------------------------------- repeated layers


def run_layers(blocks: Sequence[nnx.Module], body: Callable, carry, per_layer=None, *,
               scan: bool = False, remat: bool = False):
  """Runs ``carry = body(block, carry, x)`` over identically shaped ``blocks``.

  ``per_layer`` is a pytree whose leaves have a leading ``[L]`` axis (``x`` is its
  ``i``-th slice for block ``i``), or ``None``.

  * ``scan=False``: a Python loop (one traced copy of the body per layer).
  * ``scan=True``: one ``jax.lax.scan`` over the blocks' parameters stacked to
    ``[L, ...]`` at call time, so the compiled program holds one body whatever the depth.
    The parameters stay per layer in the module tree (checkpoints, HF export and the
    sharding rules see ``layers[i]``); the stack costs one copy of the layer weights per
    call, which is why decoding keeps the loop. This is ``nnx.scan`` written out with
    ``nnx.split`` / ``nnx.merge``: ``nnx.scan`` needs the parameters stored stacked.
  * ``remat=True``: each layer's activations are recomputed in the backward pass
    (``jax.checkpoint`` per layer) instead of kept. **On the XLA CPU backend this saves
    memory only with ``scan=True``:** its compiler drops the optimisation barriers that
    ``jax.checkpoint`` puts around the recomputation, and common-subexpression elimination
    then merges the unrolled recomputation back into the forward pass (the compiled
    program has the loop's matmuls and temporaries exactly). Inside the scan's backward
    loop the recomputation cannot merge with the forward loop, so scanned remat roughly halves
    a Gemma fine-tuning step's temporaries (``benchmarks/train_compressor.py --scan``;
    docs/performance.md).

  The body must not update module state (no dropout RNG streams, no batch statistics).
  """
  if not scan:
    step = body
    if remat:
      step = nnx.remat(body)
    for i, block in enumerate(blocks):
      x = None if per_layer is None else jax.tree.map(lambda leaf, i=i: leaf[i], per_layer)
      carry = step(block, carry, x)
    return carry
  graphdef, _ = nnx.split(blocks[0])
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[nnx.state(b) for b in blocks])

  def scan_step(carry, inputs):
    state, x = inputs
    return body(nnx.merge(graphdef, state), carry, x), None

  if remat:
    scan_step = jax.checkpoint(scan_step)
  carry, _ = jax.lax.scan(scan_step, carry, (stacked, per_layer))
  return carry


class LayerExecution:
  """Mixin for models whose repeated layers go through :func:`run_layers`.

  ``scan_layers`` and ``remat`` are plain attributes (not state): they change how the
  layers are traced, not what they compute.
  """

  scan_layers: bool = False
  remat: bool = False

  def set_layer_execution(self, *, scan_layers: bool | None = None, remat: bool | None = None):
    """Chooses how the repeated layers run (see :func:`run_layers`); returns ``self``."""
    if scan_layers is not None:
      self.scan_layers = bool(scan_layers)
    if remat is not None:
      self.remat = bool(remat)
    return self
