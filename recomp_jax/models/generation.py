"""Prompt strings -> generated texts: :class:`GemmaGenerator` and :class:`T5Generator`.

Both run the jitted token loop of :mod:`recomp_jax.models.decoding` through the model's own
cached steps (:mod:`recomp_jax.models.gemma_decoding`, :func:`recomp_jax.models.t5.generate`).
The loop's names are re-exported here, so ``generation.SamplingConfig`` keeps working.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import numpy as np

from recomp_jax.data.buckets import bucket_length, pad_rows
from recomp_jax.models import gemma_decoding, t5
from recomp_jax.models.decoding import (  # noqa: F401  (re-exported)
    SamplingConfig,
    sample_next,
    nucleus_mask,
    inverse_cdf_sample,
    sample_rows,
    stop_token_mask,
    first_token,
    decode_loop,
    decode_texts,
    generate_texts,
    generate_in_batches,
    common_prefix_length,
    StepFn,
)


class TextGenerator:
  """Prompt strings -> generated texts for one model (base of the Gemma and T5 generators).

  A subclass says how to build its stop-token mask (:meth:`build_stop_mask`) and
  how to run one tokenised batch (:meth:`generate_batch`); batching, padding and
  cutting at stop strings are :func:`generate_texts`. Stop masks are cached per
  tuple of stop strings. ``padding_side`` None keeps the tokenizer's default.
  """

  padding_side: str | None = None

  def __init__(self, model, tokenizer, *, batch_size: int = 8):
    self.model = model
    self.tokenizer = tokenizer
    self.batch_size = batch_size
    self._stop_masks: dict[tuple[str, ...], np.ndarray] = {}

  def build_stop_mask(self, stop_strings: tuple[str, ...]) -> np.ndarray:
    """``[vocab]`` bool: tokens that end a sequence (EOS and any token completing a stop string)."""
    raise NotImplementedError

  def generate_batch(self, input_ids: np.ndarray, attention_mask: np.ndarray, rng: jax.Array, *,
                     sampling: SamplingConfig, stop_mask: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``[B, S]`` ids and mask -> ``(tokens [B, max_new_tokens], lengths [B])``."""
    raise NotImplementedError

  def stop_mask(self, stop_strings: Sequence[str]) -> np.ndarray:
    key = tuple(stop_strings)
    if key not in self._stop_masks:
      self._stop_masks[key] = self.build_stop_mask(key)
    return self._stop_masks[key]

  def __call__(self, prompts: Sequence[str], *, max_new_tokens: int = 32,
               stop_strings: Sequence[str] = ('\n',), temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, empty_threshold: float = 0.0) -> list[str]:
    """Generates one text per prompt, each cut at its first stop string (``empty_threshold``:
    :class:`SamplingConfig`)."""
    generate_batch = self._bound_generate_batch(stop_strings, temperature=temperature, top_p=top_p,
                                                max_new_tokens=max_new_tokens, empty_threshold=empty_threshold)
    return generate_texts(generate_batch, self.tokenizer, prompts, batch_size=self.batch_size,
                          stop_strings=stop_strings, seed=seed, padding_side=self.padding_side,
                          sort_by_length=temperature == 0.0)

  def _bound_generate_batch(self, stop_strings: Sequence[str], **sampling):
    """:meth:`generate_batch` as ``(ids, mask, rng) -> (tokens, lengths)`` with this call's
    :class:`SamplingConfig` fields and stop strings bound."""
    return functools.partial(self.generate_batch, sampling=SamplingConfig(**sampling),
                             stop_mask=self.stop_mask(stop_strings))


class GemmaGenerator(TextGenerator):
  """Gemma: prompt strings -> texts with :mod:`recomp_jax.models.gemma_decoding`.

  Prompts are tokenised with the tokenizer's defaults (BOS for Gemma),
  left-padded and run in batches of ``batch_size`` (the last batch is padded
  with repeats, so every batch reuses one compilation per length bucket); greedy
  decoding batches prompts of similar length together (:func:`generate_in_batches`).

  When all prompts of a call start with the same ``min_shared_prefix`` tokens or
  more (the reader protocol's few-shot block), making up at least ``min_shared_fraction``
  of the average prompt, that prefix is prefilled once per batch instead of once per
  row (:func:`~recomp_jax.models.gemma_decoding.generate_from_prefix`); the split is
  made on the token ids of the whole prompts, so the model reads exactly the tokens of
  the full path. Below that fraction the full path is faster: the continuation then
  also attends over the prefix cache's slots, which for long prompts with a short shared
  prefix (top-5 documents after the few-shot block) costs more than the prefix saves
  (docs/performance.md has the measurement).
  ``min_shared_prefix=0`` turns sharing off.
  """

  padding_side = 'left'

  def __init__(self, model, tokenizer, *, batch_size: int = 8, min_shared_prefix: int = 32,
               min_shared_fraction: float = 0.25):
    super().__init__(model, tokenizer, batch_size=batch_size)
    pad = tokenizer.pad_token_id
    self.pad_id = int(pad if pad is not None else (model.config.pad_token_id or 0))
    self.min_shared_prefix = min_shared_prefix
    self.min_shared_fraction = min_shared_fraction

  def build_stop_mask(self, stop_strings: tuple[str, ...]) -> np.ndarray:
    eos = [*self.model.config.eos_token_id, self.tokenizer.eos_token_id]
    return stop_token_mask(self.tokenizer, self.model.config.vocab_size, stop_strings, eos_ids=eos)

  def generate_batch(self, input_ids, attention_mask, rng, *, sampling, stop_mask):
    return gemma_decoding.generate(self.model, input_ids, attention_mask, sampling=sampling, stop_mask=stop_mask,
                    rng=rng, pad_id=self.pad_id)

  def __call__(self, prompts: Sequence[str], *, max_new_tokens: int = 32,
               stop_strings: Sequence[str] = ('\n',), temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, empty_threshold: float = 0.0) -> list[str]:
    kwargs = dict(max_new_tokens=max_new_tokens, stop_strings=stop_strings,
                  temperature=temperature, top_p=top_p, seed=seed, empty_threshold=empty_threshold)
    if self.min_shared_prefix <= 0 or len(prompts) < 2:
      return super().__call__(prompts, **kwargs)
    rows = self.tokenizer(list(prompts))['input_ids']
    shared = common_prefix_length(rows)
    average = sum(map(len, rows)) / len(rows)
    if shared < self.min_shared_prefix or shared < self.min_shared_fraction * average:
      generate_batch = self._bound_generate_batch(stop_strings, temperature=temperature, top_p=top_p,
                                                  max_new_tokens=max_new_tokens, empty_threshold=empty_threshold)
      return generate_in_batches(generate_batch, self._left_padded, self.tokenizer, rows,
                                 batch_size=self.batch_size, stop_strings=stop_strings, seed=seed,
                                 sort_by_length=temperature == 0.0)
    return self.generate_with_prefix(rows[0][:shared], [r[shared:] for r in rows], **kwargs)

  def _left_padded(self, rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    return pad_rows(rows, bucket_length(max(map(len, rows))), self.pad_id, left=True)

  def generate_with_prefix(self, prefix_ids: Sequence[int], continuations: Sequence[Sequence[int]],
                           *, max_new_tokens: int = 32, stop_strings: Sequence[str] = ('\n',),
                           temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                           empty_threshold: float = 0.0) -> list[str]:
    """Texts generated after ``prefix_ids + continuation`` for each continuation (token ids)."""
    if not continuations:
      return []
    if min(map(len, continuations)) < 1:
      raise ValueError('every continuation needs at least one token after the shared prefix')
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              empty_threshold=empty_threshold)
    stop_mask = self.stop_mask(stop_strings)

    def generate_batch(ids, mask, rng):
      return gemma_decoding.generate_from_prefix(self.model, list(prefix_ids), ids, mask,
                                                 sampling=sampling, stop_mask=stop_mask, rng=rng,
                                                 pad_id=self.pad_id)

    return generate_in_batches(generate_batch, self._left_padded, self.tokenizer, list(continuations),
                               batch_size=self.batch_size, stop_strings=stop_strings, seed=seed,
                               sort_by_length=temperature == 0.0)


class T5Generator(TextGenerator):
  """Prompt strings -> greedy (or sampled) texts with :func:`recomp_jax.models.t5.generate`.

  Same call signature as :class:`GemmaGenerator`: prompts are tokenised
  with special tokens, right-padded and run in batches of ``batch_size`` (the
  last one filled with repeats), texts cut at the first stop string.
  """

  def build_stop_mask(self, stop_strings: tuple[str, ...]) -> np.ndarray:
    return t5.default_stop_mask(self.model.config, self.tokenizer, stop_strings)

  def generate_batch(self, input_ids, attention_mask, rng, *, sampling, stop_mask):
    return t5.generate(self.model, input_ids, attention_mask, sampling=sampling, stop_mask=stop_mask,
                       rng=rng)
