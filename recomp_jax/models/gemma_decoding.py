"""Compiled prefill, decode steps and text generation for :mod:`recomp_jax.models.gemma`.

:func:`generate` runs prompt prefill and the whole token loop
(:func:`recomp_jax.models.generation.decode_loop`) inside one ``jax.jit``: the model
crosses the boundary as ``nnx.split`` state (its graph definition is a static
argument), sampling settings are static, and prompts are left-padded to a
length bucket so different prompt lengths share compilations. Nothing returns
to the host between tokens.

:func:`prefill` / :func:`decode_step` are the same cached steps compiled on
their own (cache donated), for scorers that encode a shared prefix once and
continue it many times; :class:`recomp_jax.models.generation.GemmaGenerator` goes from
prompt strings to texts.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recomp_jax.data.buckets import bucket_length
from recomp_jax.models import generation
from recomp_jax.models.gemma import DecodeCache, GemmaModel


# XLA:CPU's default copy insertion copies every loop-carried buffer that is both read and
# updated in one iteration (the whole KV cache, every token); region analysis orders the
# reads before the in-place update instead. Other backends ignore the option.
_LOOP_OPTIONS = {'xla_cpu_copy_insertion_use_region_analysis': True}


@functools.partial(jax.jit, static_argnames=('graphdef', 'sampling', 'pad_id'),
                   compiler_options=_LOOP_OPTIONS)
def _generate(graphdef, state, input_ids, attention_mask, rng, stop_mask, *, sampling, pad_id):
  model = nnx.merge(graphdef, state)
  batch, prompt_len = input_ids.shape
  cache = model.init_cache(batch, prompt_len + sampling.max_new_tokens)
  first_logits, cache = model.prefill(input_ids, attention_mask, cache)
  step = lambda tokens, cache, _: model.decode_step(tokens, cache)
  return generation.decode_loop(step, cache, first_logits, rng=rng, stop_mask=stop_mask,
                              sampling=sampling, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=('graphdef', 'capacity', 'ring_slack'))
def _encode_prefix(graphdef, state, prefix_ids, prefix_mask, *, capacity, ring_slack):
  model = nnx.merge(graphdef, state)
  cache = model.init_cache(prefix_ids.shape[0], capacity, ring_slack=ring_slack)
  return model.prefill(prefix_ids, prefix_mask, cache)[1]


@functools.partial(jax.jit, static_argnames=('graphdef', 'sampling', 'pad_id'),
                   compiler_options=_LOOP_OPTIONS)
def _generate_from_prefix(graphdef, state, prefix, input_ids, attention_mask, rng, stop_mask, *,
                          sampling, pad_id):
  model = nnx.merge(graphdef, state)
  first_logits, cache = model.prefill(input_ids, attention_mask, prefix.tile(input_ids.shape[0]))
  step = lambda tokens, cache, _: model.decode_step(tokens, cache)
  return generation.decode_loop(step, cache, first_logits, rng=rng, stop_mask=stop_mask,
                                sampling=sampling, pad_id=pad_id)


def left_pad(input_ids: np.ndarray, attention_mask: np.ndarray, length: int,
             pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """Adds padding on the left of ``[B, T]`` ids / mask up to ``[B, length]``."""
  input_ids, attention_mask = np.asarray(input_ids), np.asarray(attention_mask)
  extra = length - input_ids.shape[1]
  if extra < 0:
    raise ValueError(f'prompt length {input_ids.shape[1]} exceeds {length}')
  return (np.pad(input_ids, ((0, 0), (extra, 0)), constant_values=pad_id),
          np.pad(attention_mask, ((0, 0), (extra, 0)), constant_values=0))


def eos_stop_mask(model: GemmaModel, extra_ids: Sequence[int] = ()) -> np.ndarray:
  """``[V]`` bool marking the config's EOS ids (and ``extra_ids``)."""
  mask = np.zeros((model.config.vocab_size,), bool)
  for i in (*model.config.eos_token_id, *extra_ids):
    if i is not None and 0 <= i < mask.size:
      mask[i] = True
  return mask


def generate(model: GemmaModel, input_ids, attention_mask=None, *,
             sampling: generation.SamplingConfig, stop_mask=None, rng: jax.Array | None = None,
             pad_id: int | None = None) -> tuple[jax.Array, jax.Array]:
  """Generates continuations of left-padded prompts.

  Args:
    model: a :class:`GemmaModel` (any dtype).
    input_ids: ``[B, T]`` left-padded prompt ids.
    attention_mask: ``[B, T]`` 1 = real token (default: all ones).
    sampling: greedy / temperature / top-p and ``max_new_tokens``.
    stop_mask: ``[V]`` bool tokens that end a sequence (default: the config's EOS).
    rng: PRNG key for sampling (default ``jax.random.key(0)``).
    pad_id: written after a sequence stops (default: the config's pad id).
  Returns:
    ``tokens [B, max_new_tokens]`` int32 and ``lengths [B]`` (stop token included).
  """
  input_ids = np.asarray(input_ids)
  if attention_mask is None:
    attention_mask = np.ones(input_ids.shape, np.int32)
  pad_id = model.config.pad_token_id if pad_id is None else pad_id
  pad_id = 0 if pad_id is None else int(pad_id)
  ids, mask = left_pad(input_ids, attention_mask, bucket_length(input_ids.shape[1]),
                       pad_id)
  if stop_mask is None:
    stop_mask = eos_stop_mask(model)
  rng = jax.random.key(0) if rng is None else rng
  graphdef, state = nnx.split(model)
  return _generate(graphdef, state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32), rng,
                   jnp.asarray(stop_mask, bool), sampling=sampling, pad_id=pad_id)


def encode_prefix(model: GemmaModel, prefix_ids: Sequence[int], *, max_continuation: int,
                  max_new_tokens: int, pad_id: int = 0) -> DecodeCache:
  """Prefills one prompt prefix shared by many prompts into a batch-1 cache.

  Args:
    model: a :class:`GemmaModel`.
    prefix_ids: the shared prefix's token ids (BOS included), left-padded here to its bucket.
    max_continuation: the longest continuation (already bucketed) that
      :func:`generate_from_prefix` will append; it also sizes the ring slack, since
      left-padded continuations put up to that many pad indices after the prefix.
    max_new_tokens: the generation limit that will follow.
  Returns:
    the cache, sized ``bucket(len(prefix_ids)) + max_continuation + max_new_tokens``.
  """
  length = bucket_length(len(prefix_ids))
  ids, mask = left_pad(np.asarray([prefix_ids]), np.ones((1, len(prefix_ids)), np.int32), length,
                       pad_id)
  graphdef, state = nnx.split(model)
  return _encode_prefix(graphdef, state, jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32),
                        capacity=length + max_continuation + max_new_tokens,
                        ring_slack=max_continuation)


def generate_from_prefix(model: GemmaModel, prefix: DecodeCache, input_ids, attention_mask, *,
                         sampling: generation.SamplingConfig, stop_mask, rng: jax.Array,
                         pad_id: int) -> tuple[jax.Array, jax.Array]:
  """:func:`generate` for prompts that all start with the prefix encoded in ``prefix``.

  ``input_ids [B, T]`` / ``attention_mask [B, T]`` are the rest of each prompt,
  left-padded (``T`` at most the ``max_continuation`` the prefix was encoded for).
  The batch-1 prefix cache is tiled to ``B`` rows inside the jitted call, the
  continuations prefilled on it, then the same decode loop as :func:`generate` runs.
  Token for token this is :func:`generate` on the full prompts: RoPE positions
  count real tokens only and sliding windows are measured in positions, so the
  padding between prefix and continuation changes nothing.
  """
  graphdef, state = nnx.split(model)
  return _generate_from_prefix(graphdef, state, prefix, jnp.asarray(input_ids, jnp.int32),
                               jnp.asarray(attention_mask, jnp.int32), rng,
                               jnp.asarray(stop_mask, bool), sampling=sampling, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=('graphdef', 'return_hidden'), donate_argnames=('cache',))
def _prefill(graphdef, state, input_ids, attention_mask, cache, *, return_hidden):
  model = nnx.merge(graphdef, state)
  return model.prefill(input_ids, attention_mask, cache, return_hidden=return_hidden)


@functools.partial(jax.jit, static_argnames=('graphdef',), donate_argnames=('cache',))
def _decode_step(graphdef, state, tokens, cache):
  return nnx.merge(graphdef, state).decode_step(tokens, cache)


def prefill(model: GemmaModel, input_ids, attention_mask, cache: DecodeCache, *,
            return_hidden: bool = False) -> tuple[jax.Array, DecodeCache]:
  """Compiled :meth:`GemmaModel.prefill`; ``cache`` is donated (pass a copy to keep it)."""
  graphdef, state = nnx.split(model)
  return _prefill(graphdef, state, jnp.asarray(input_ids, jnp.int32),
                  jnp.asarray(attention_mask, jnp.int32), cache, return_hidden=return_hidden)


def decode_step(model: GemmaModel, tokens, cache: DecodeCache) -> tuple[jax.Array, DecodeCache]:
  """Compiled :meth:`GemmaModel.decode_step`; ``cache`` is donated."""
  graphdef, state = nnx.split(model)
  return _decode_step(graphdef, state, jnp.asarray(tokens, jnp.int32), cache)


def copy_cache(cache: DecodeCache) -> DecodeCache:
  """A copy that survives donating the original (to continue one prefix several times)."""
  return jax.tree.map(jnp.copy, cache)


__all__ = ['copy_cache', 'decode_step', 'encode_prefix', 'eos_stop_mask', 'generate',
           'generate_from_prefix', 'left_pad', 'prefill']
