"""Compiled prefill, decode steps and text generation for :mod:`recomp_jax.models.gemma`.

:func:`generate` runs prompt prefill and the whole token loop
(:func:`recomp_jax.models.decoding.decode_loop`) inside one ``jax.jit``: the model
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
from recomp_jax.models import decoding
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
  return decoding.decode_loop(step, cache, first_logits, rng=rng, stop_mask=stop_mask,
                              sampling=sampling, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=('graphdef', 'sampling', 'pad_id'),
                   compiler_options=_LOOP_OPTIONS)
def _generate_from_prefix(graphdef, state, prefix_ids, prefix_mask, input_ids, attention_mask, rng,
                          stop_mask, *, sampling, pad_id):
  model = nnx.merge(graphdef, state)
  batch, chunk = input_ids.shape
  capacity = prefix_ids.shape[1] + chunk + sampling.max_new_tokens
  prefix = model.init_cache(1, capacity, ring_slack=chunk)
  _, prefix = model.prefill_in_chunks(prefix_ids, prefix_mask, prefix)  # a long corpus: chunk by chunk
  first_logits, cache = model.prefill(input_ids, attention_mask, prefix.take(jnp.zeros((batch,), jnp.int32)))
  step = lambda tokens, cache, _: model.decode_step(tokens, cache)
  return decoding.decode_loop(step, cache, first_logits, rng=rng, stop_mask=stop_mask,
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
             sampling: decoding.SamplingConfig, stop_mask=None, rng: jax.Array | None = None,
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


def generate_from_prefix(model: GemmaModel, prefix_ids: Sequence[int], input_ids, attention_mask, *,
                         sampling: decoding.SamplingConfig, stop_mask, rng: jax.Array,
                         pad_id: int) -> tuple[jax.Array, jax.Array]:
  """:func:`generate` for prompts that all start with ``prefix_ids``, prefilled once.

  Args:
    prefix_ids: the shared prefix's token ids (BOS included); left-padded here to its bucket.
    input_ids, attention_mask: ``[B, T]`` the rest of each prompt, left-padded (``T`` a bucket).

  Inside one jitted call the prefix is prefilled at batch 1, its cache tiled to ``B``
  rows, the continuations prefilled on it and the decode loop of :func:`generate` run
  (one compilation per continuation bucket, as :func:`generate` has one per prompt
  bucket). Token for token this is :func:`generate` on the full prompts: RoPE positions
  count real tokens only, sliding windows are measured in positions, and the ring
  buffers get ``T`` slots of slack for the padding between prefix and continuation.
  """
  length = bucket_length(len(prefix_ids))
  ids, mask = left_pad(np.asarray([prefix_ids]), np.ones((1, len(prefix_ids)), np.int32), length,
                       pad_id)
  graphdef, state = nnx.split(model)
  return _generate_from_prefix(graphdef, state, jnp.asarray(ids, jnp.int32),
                               jnp.asarray(mask, jnp.int32), jnp.asarray(input_ids, jnp.int32),
                               jnp.asarray(attention_mask, jnp.int32), rng,
                               jnp.asarray(stop_mask, bool), sampling=sampling, pad_id=pad_id)


@functools.partial(jax.jit, static_argnames=('graphdef', 'capacity'))
def _prefill_and_sample(graphdef, state, input_ids, attention_mask, keys, temperature, top_p, *,
                        capacity):
  model = nnx.merge(graphdef, state)
  cache = model.init_cache(input_ids.shape[0], capacity)
  logits, cache = model.prefill(input_ids, attention_mask, cache)
  step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, 0)
  return decoding.sample_rows(logits, step_keys, temperature, top_p), cache


@functools.partial(jax.jit, static_argnames=('graphdef', 'steps'), donate_argnames=('cache',),
                   compiler_options=_LOOP_OPTIONS)
def _decode_and_sample(graphdef, state, cache, tokens, first_step, keys, temperature, top_p, *,
                       steps):
  model = nnx.merge(graphdef, state)

  def body(i, carry):
    tokens, cache, out = carry
    logits, cache = model.decode_step(tokens, cache)
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, first_step + i)
    tokens = decoding.sample_rows(logits, step_keys, temperature, top_p)
    return tokens, cache, out.at[:, i].set(tokens)

  out = jnp.zeros((tokens.shape[0], steps), jnp.int32)
  _, cache, out = jax.lax.fori_loop(0, steps, body, (tokens, cache, out))
  return out, cache


class RowSampler:
  """Step-wise generation with per-row sampling settings, for a server that streams.

  :func:`generate` runs the whole token loop in one call; a server must hand tokens
  to clients as they come and drop rows whose client left, so here the prompt
  prefill (:meth:`start`) and each run of ``steps`` decode steps (:meth:`advance`)
  are separate jitted calls (the cache donated between them), each row with its own
  temperature, top-p and PRNG stream (``fold_in(key(seed), token index)``: a row's
  tokens do not depend on its batch-mates). The caller decides when a row is done.

  Args:
    model: a causal :class:`GemmaModel`.
    input_ids, attention_mask: ``[B, T]`` left-padded prompts (``T`` a length bucket).
    seeds: ``[B]`` uint32; temperature, top_p: ``[B]`` float32.
    max_new_tokens: the most tokens any row will take (sizes the cache).
    steps: decode steps per :meth:`advance`.
  """

  def __init__(self, model: GemmaModel, input_ids: np.ndarray, attention_mask: np.ndarray, *,
               seeds: np.ndarray, temperature: np.ndarray, top_p: np.ndarray,
               max_new_tokens: int, steps: int = 8):
    self.graphdef, self.state = nnx.split(model)
    self.steps = steps
    self.room = bucket_length(max_new_tokens + steps)  # cache slots for new tokens
    self.keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    self.temperature = jnp.asarray(temperature, jnp.float32)
    self.top_p = jnp.asarray(top_p, jnp.float32)
    self._ids = jnp.asarray(input_ids, jnp.int32)
    self._mask = jnp.asarray(attention_mask, jnp.int32)
    self._cache = None
    self._last = None
    self.generated = 0

  def start(self) -> np.ndarray:
    """Prefills the prompts; returns the first new token of each row ``[B]``."""
    tokens, self._cache = _prefill_and_sample(self.graphdef, self.state, self._ids, self._mask,
                                              self.keys, self.temperature, self.top_p,
                                              capacity=self._ids.shape[1] + self.room)
    self._last = tokens
    self.generated = 1
    return np.asarray(tokens)

  def advance(self) -> np.ndarray:
    """Runs ``steps`` more decode steps; returns their tokens ``[B, steps]``."""
    if self.generated - 1 + self.steps > self.room:
      raise ValueError(f'the cache holds {self.room} new tokens')
    out, self._cache = _decode_and_sample(self.graphdef, self.state, self._cache, self._last,
                                          jnp.asarray(self.generated, jnp.int32), self.keys,
                                          self.temperature, self.top_p, steps=self.steps)
    self._last = out[:, -1]
    self.generated += self.steps
    return np.asarray(out)


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


__all__ = ['RowSampler', 'copy_cache', 'decode_step', 'eos_stop_mask', 'generate',
           'generate_from_prefix', 'left_pad', 'prefill']
