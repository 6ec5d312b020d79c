"""The jitted token loop shared by T5 and Gemma: sampling, stop tokens, batching of prompts.

A model provides a prefill (prompt -> cache and the logits of the first new
token) and a ``step_fn(tokens, cache, step) -> (logits, cache)``; this module
owns sampling, EOS / stop-token handling and the ``lax.while_loop`` that runs
until every sequence has stopped or ``max_new_tokens`` is reached. Nothing
here re-dispatches from Python per token.

Stop strings (e.g. ``"\\n"``) are handled with a vocabulary mask of the tokens
whose text contains one (:func:`stop_token_mask`); :func:`decode_texts`
then cuts the decoded text at the first stop string.

The model-specific cached steps live beside each model (``gemma_decoding.generate``,
``t5.generate``) and build on this module; the prompt-string generators on top of both are in
:mod:`recomp_jax.models.generation`.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


StepFn = Callable[[jax.Array, Any, jax.Array], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How the next token is chosen.

  ``temperature == 0`` is greedy (argmax); otherwise logits are divided by the
  temperature and, if ``top_p < 1``, restricted to the smallest set of tokens
  whose probability mass reaches ``top_p`` (nucleus sampling).

  ``empty_threshold > 0`` decides the first new token differently (beyond the papers; for
  models trained to answer "nothing" with an immediate stop token, like RECOMP's selective
  augmentation): a row stops at once iff the probability mass of *all* its stop tokens at
  the first step is at least ``empty_threshold`` (its most likely stop token is written);
  otherwise the first token is chosen as usual among the other tokens. Plain greedy
  compares the stop token with each other token alone, so a model that puts 35% on "stop"
  and spreads the rest over many first words outputs nothing every time; 0.5 instead
  stops where stopping is more likely than not. 0 (the default) is plain decoding.
  """
  temperature: float = 0.0
  top_p: float = 1.0
  max_new_tokens: int = 32
  empty_threshold: float = 0.0


def sample_next(logits: jax.Array, rng: jax.Array, sampling: SamplingConfig) -> jax.Array:
  """``[B, V]`` logits -> ``[B]`` int32 tokens."""
  logits = logits.astype(jnp.float32)
  if sampling.temperature == 0.0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits / sampling.temperature
  if sampling.top_p < 1.0:
    sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    # The smallest prefix whose mass reaches top_p: keep a token if the mass *before* it is < top_p.
    keep_sorted = (cumulative - jax.nn.softmax(sorted_logits, axis=-1)) < sampling.top_p
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_logits, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
  return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def nucleus_mask(probs: jax.Array, top_p: jax.Array, *, iterations: int = 30) -> jax.Array:
  """``[B, V]`` bool: each row's nucleus, the most probable tokens whose mass reaches ``top_p [B]``.

  Bisects for the largest probability threshold whose tokens still hold ``top_p`` of
  the mass (``iterations`` halvings of ``[0, max p]``: 30 resolve it to ~1e-9 of the
  top probability) instead of sorting the vocabulary, which costs far more per row on
  CPU. Rows with ``top_p >= 1`` keep every token.
  """
  top = jnp.max(probs, axis=-1)                                                  # [B]

  def body(_, bounds):
    low, high = bounds
    mid = 0.5 * (low + high)
    mass = jnp.sum(jnp.where(probs >= mid[:, None], probs, 0.0), axis=-1)
    reached = mass >= top_p
    return jnp.where(reached, mid, low), jnp.where(reached, high, mid)

  low, _ = jax.lax.fori_loop(0, iterations, body, (jnp.zeros_like(top), top))
  keep = probs >= low[:, None]
  return jnp.where((top_p >= 1.0)[:, None], True, keep)


def inverse_cdf_sample(probs: jax.Array, keys: jax.Array, *, block: int = 512) -> jax.Array:
  """One token per row of ``probs [B, V]`` (rows sum to ~1) from two uniforms per row.

  ``jax.random.categorical`` draws ``V`` Gumbel numbers per row: at Gemma's 262k vocabulary
  that is a quarter of a CPU decode step at batch 8. Here a row's vocabulary is cut into
  blocks of ``block`` tokens; the first uniform picks a block by the cumulative block
  masses, the second a token by the cumulative masses inside it. Each cumulative sum runs
  over at most ``max(V / block, block)`` terms, so the drawn distribution equals ``probs``
  to float32 rounding of such short sums, and a token of probability 0 is never drawn.

  Args:
    probs: ``[B, V]`` probabilities.
    keys: ``[B]`` typed PRNG keys, one stream per row (a row's token does not depend on the
      rows beside it).
  Returns:
    ``[B]`` int32 token ids.
  """
  rows, vocab = probs.shape
  blocks = -(-vocab // block)
  grid = jnp.pad(probs, ((0, 0), (0, blocks * block - vocab))).reshape(rows, blocks, block)
  uniforms = jax.vmap(lambda key: jax.random.uniform(key, (2,)))(keys)               # [B, 2]

  def pick(masses, u):
    """``masses [B, N]``, ``u [B]`` in [0, 1) -> the first index whose cumulative mass exceeds
    ``u`` of the total, never an index of mass 0."""
    cumulative = jnp.cumsum(masses, axis=-1)
    index = jnp.sum(cumulative <= (u * cumulative[:, -1])[:, None], axis=-1)
    last_positive = masses.shape[-1] - 1 - jnp.argmax((masses > 0)[:, ::-1], axis=-1)
    return jnp.minimum(index, last_positive)

  outer = pick(grid.sum(axis=-1), uniforms[:, 0])                                     # [B]
  inner = pick(jnp.take_along_axis(grid, outer[:, None, None], axis=1)[:, 0], uniforms[:, 1])
  return (outer * block + inner).astype(jnp.int32)


def sample_rows(logits: jax.Array, keys: jax.Array, temperature: jax.Array,
                top_p: jax.Array) -> jax.Array:
  """Per-row sampling settings: ``[B, V]`` logits -> ``[B]`` int32 tokens.

  ``keys [B]`` typed PRNG keys (one stream per row, so a row's tokens do not depend on
  which other rows share its batch), ``temperature [B]`` (0 = greedy argmax) and
  ``top_p [B]``. Random draws happen only when some row samples, the nucleus search
  only when some row asks for one.
  """
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sample():
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    needs_nucleus = jnp.any((top_p < 1.0) & (temperature > 0))
    keep = jax.lax.cond(needs_nucleus,
                        lambda: nucleus_mask(jax.nn.softmax(scaled, axis=-1), top_p),
                        lambda: jnp.ones(scaled.shape, bool))
    probs = jax.nn.softmax(jnp.where(keep, scaled, -jnp.inf), axis=-1)
    sampled = inverse_cdf_sample(probs, keys)
    return jnp.where(temperature > 0, sampled, greedy)

  # An all-greedy batch skips drawing [B, V] random numbers every step.
  return jax.lax.cond(jnp.any(temperature > 0), sample, lambda: greedy)


def stop_token_mask(tokenizer, vocab_size: int, stop_strings: Sequence[str] = (),
                    eos_ids: Sequence[int] = ()) -> np.ndarray:
  """``[V]`` bool: tokens that end a sequence (EOS ids, or text containing a stop string)."""
  mask = np.zeros((vocab_size,), bool)
  for i in eos_ids:
    if i is not None and 0 <= i < vocab_size:
      mask[i] = True
  if stop_strings:
    mask |= _stop_string_mask(tokenizer, vocab_size, tuple(stop_strings))
  return mask


# Reading every piece of a 262k vocabulary as text takes ~10 s, and each generator of a process
# asks again for the same (shared) tokenizer: kept per tokenizer object while it lives.
_STOP_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _stop_string_mask(tokenizer, vocab_size: int, stop_strings: tuple[str, ...]) -> np.ndarray:
  """``[V]`` bool: the pieces whose text contains one of ``stop_strings`` (a read-only array)."""
  key = (vocab_size, len(tokenizer), stop_strings)  # len: a tokenizer that gained tokens is asked again
  try:
    masks = _STOP_MASKS.setdefault(tokenizer, {})
  except TypeError:  # not weakly referable: computed each time
    masks = {}
  if key not in masks:
    mask = np.zeros((vocab_size,), bool)
    vocab = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    for i, piece in enumerate(vocab):
      if piece is None:
        continue
      text = tokenizer.convert_tokens_to_string([piece])
      if any(s in text for s in stop_strings):
        mask[i] = True
    mask.flags.writeable = False
    masks[key] = mask
  return masks[key]


def first_token(logits: jax.Array, rng: jax.Array, sampling: SamplingConfig, stop_mask: jax.Array) -> jax.Array:
  """``[B, V]`` logits of the first new token -> ``[B]`` int32 tokens, with
  ``sampling.empty_threshold`` deciding whether a row stops at once (:class:`SamplingConfig`)."""
  if sampling.empty_threshold <= 0.0:
    return sample_next(logits, rng, sampling)
  logits = logits.astype(jnp.float32)
  log_probs = jax.nn.log_softmax(logits, axis=-1)  # [B, V]
  stop_log_mass = jax.nn.logsumexp(jnp.where(stop_mask, log_probs, -jnp.inf), axis=-1)  # [B]
  empty = stop_log_mass >= jnp.log(sampling.empty_threshold)
  best_stop = jnp.argmax(jnp.where(stop_mask, logits, -jnp.inf), axis=-1).astype(jnp.int32)
  other = sample_next(jnp.where(stop_mask, -jnp.inf, logits), rng, sampling)
  return jnp.where(empty, best_stop, other)


def decode_loop(step_fn: StepFn, cache: Any, first_logits: jax.Array, *, rng: jax.Array,
                stop_mask: jax.Array, sampling: SamplingConfig, pad_id: int) -> tuple[jax.Array, jax.Array]:
  """Samples up to ``sampling.max_new_tokens`` tokens inside one ``lax.while_loop``.

  Args:
    step_fn: ``(tokens [B], cache, step) -> (logits [B, V], cache)``; ``step``
      is the index of ``tokens`` among the new tokens (0 for the first).
    cache: the model's decoding state after the prompt.
    first_logits: ``[B, V]`` logits for the first new token.
    rng: PRNG key (unused when greedy).
    stop_mask: ``[V]`` bool, tokens that finish a sequence (kept in the output).
    sampling: temperature / top-p / length.
    pad_id: written after a sequence has finished.
  Returns:
    ``tokens [B, max_new_tokens]`` (``pad_id`` after the stop token) and
    ``lengths [B]`` (number of generated tokens, stop token included).
  """
  batch = first_logits.shape[0]
  max_new = sampling.max_new_tokens
  tokens = jnp.full((batch, max_new), pad_id, jnp.int32)
  rng, sub = jax.random.split(rng)
  first = first_token(first_logits, sub, sampling, stop_mask)
  tokens = tokens.at[:, 0].set(first)
  done = stop_mask[first]
  lengths = jnp.ones((batch,), jnp.int32)

  def cond(carry):
    step, _, _, done, _, _ = carry
    return jnp.logical_and(step < max_new, jnp.logical_not(jnp.all(done)))

  def body(carry):
    step, tokens, cache, done, lengths, rng = carry
    logits, cache = step_fn(tokens[:, step - 1], cache, step - 1)
    rng, sub = jax.random.split(rng)
    nxt = sample_next(logits, sub, sampling)
    nxt = jnp.where(done, pad_id, nxt)
    tokens = tokens.at[:, step].set(nxt)
    lengths = lengths + jnp.logical_not(done).astype(jnp.int32)
    done = jnp.logical_or(done, stop_mask[nxt])
    return step + 1, tokens, cache, done, lengths, rng

  init = (jnp.asarray(1, jnp.int32), tokens, cache, done, lengths, rng)
  _, tokens, _, _, lengths, _ = jax.lax.while_loop(cond, body, init)
  return tokens, lengths


def decode_texts(tokenizer, tokens: np.ndarray, lengths: np.ndarray,
                 stop_strings: Sequence[str] = ()) -> list[str]:
  """Detokenises generated tokens and cuts each text at its first stop string."""
  texts = []
  for row, n in zip(np.asarray(tokens), np.asarray(lengths)):
    text = tokenizer.decode(row[:int(n)].tolist(), skip_special_tokens=True)
    for s in stop_strings:
      cut = text.find(s)
      if cut >= 0:
        text = text[:cut]
    texts.append(text)
  return texts


def generate_texts(generate_batch: Callable[[np.ndarray, np.ndarray, jax.Array], tuple[jax.Array, jax.Array]],
                   tokenizer, prompts: Sequence[str], *, batch_size: int,
                   stop_strings: Sequence[str] = (), seed: int = 0,
                   padding_side: str | None = None, sort_by_length: bool = False) -> list[str]:
  """Prompt strings -> texts, for any model's ``generate_batch(ids, mask, rng) -> (tokens, lengths)``.

  Prompts are tokenised per batch with padding (``padding_side`` None keeps the
  tokenizer's default); batching and cutting are :func:`generate_in_batches`.
  """
  pad_kwargs = {} if padding_side is None else {'padding_side': padding_side}

  def encode(batch):
    enc = tokenizer(batch, padding=True, return_tensors='np', **pad_kwargs)
    return enc['input_ids'], enc['attention_mask']

  return generate_in_batches(generate_batch, encode, tokenizer, list(prompts), batch_size=batch_size,
                             stop_strings=stop_strings, seed=seed, sort_by_length=sort_by_length)


def generate_in_batches(generate_batch: Callable[[np.ndarray, np.ndarray, jax.Array], tuple[jax.Array, jax.Array]],
                        encode: Callable[[list], tuple[np.ndarray, np.ndarray]], tokenizer,
                        items: Sequence, *, batch_size: int, stop_strings: Sequence[str] = (),
                        seed: int = 0, sort_by_length: bool = False) -> list[str]:
  """Runs ``items`` (prompts, or token rows) through ``generate_batch``; texts in input order.

  Items go in batches of ``batch_size`` (a short last batch is filled with
  repeats of its last item, so one compiled batch size serves all), ``encode``
  turns a batch into ``(ids [B, T], mask [B, T])``, each batch gets its own split
  of ``jax.random.key(seed)``, and texts are cut at the first stop string.

  ``sort_by_length`` batches items of similar ``len`` (characters of a prompt, tokens of a
  row) together, so each batch pads to the length bucket of its own longest item rather than
  of the longest among random neighbours (reader prompts over top-5 documents differ by hundreds
  of tokens).
  Only for greedy decoding: a sampled text would depend on its batch's PRNG split.
  """
  order = sorted(range(len(items)), key=lambda i: len(items[i])) if sort_by_length else range(len(items))
  ordered = [items[i] for i in order]
  rng = jax.random.key(seed)
  texts: list[str] = []
  for begin in range(0, len(ordered), batch_size):
    batch = ordered[begin:begin + batch_size]
    real = len(batch)
    batch += [batch[-1]] * (batch_size - real)
    ids, mask = encode(batch)
    rng, sub = jax.random.split(rng)
    tokens, lengths = jax.device_get(generate_batch(ids, mask, sub))
    texts += decode_texts(tokenizer, tokens[:real], lengths[:real], stop_strings)
  in_input_order = [''] * len(items)
  for position, text in zip(order, texts):
    in_input_order[position] = text
  return in_input_order


def common_prefix_length(rows: Sequence[Sequence[int]]) -> int:
  """Tokens every row starts with, leaving at least one token of the shortest row."""
  if not rows:
    return 0
  shared = len(os.path.commonprefix([list(r) for r in rows]))
  return max(0, min(shared, min(len(r) for r in rows) - 1))
