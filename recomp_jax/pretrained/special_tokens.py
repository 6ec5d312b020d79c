"""New special tokens for a decoder-only model: in the tokenizer and in the embedding table.

K-COMP (kcomp.txt §4.3) adds ``<ent>`` (a masked entity span) and ``<eom>`` (the end of an
entity's description). A new token gets a new row of the embedding table (the tied output head
with it, or a new column of an untied head) initialised as the mean of the existing rows, so
it starts as an average token rather than as noise at the scale of the vocabulary; the model's
config says the new vocabulary size, so :func:`recomp_jax.pretrained.export_pretrained` writes
a directory that ``transformers`` and :func:`recomp_jax.pretrained.load_pretrained` load back
with the tokens in place.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
from tokenizers import AddedToken

from recomp_jax.pretrained import Pretrained


def add_special_tokens(pretrained: Pretrained, tokenizer, tokens: Sequence[str]) -> list[int]:
  """Adds ``tokens`` to ``tokenizer`` (in place) and grows ``pretrained``'s embedding to match.

  Tokens the tokenizer already holds are kept as they are (their rows untouched), so calling it
  again on a model that has them is a no-op. The tokens are added whole (never split into
  pieces) but not as special tokens, so decoding with ``skip_special_tokens=True`` keeps them.

  Args:
    pretrained: a decoder-only model (Gemma: ``model.embedder.embedding [V, D]``, an optional
      untied ``model.lm_head.kernel [D, V]``); its ``model`` and ``config`` are updated in place.
    tokenizer: the model's Hugging Face tokenizer.
    tokens: e.g. ``('<ent>', '<eom>')``.

  Returns:
    the ids of ``tokens``, in order.
  """
  model, config = pretrained.model, pretrained.config
  if getattr(tokenizer, 'recomp_jax_shared', False):
    raise ValueError('add_special_tokens changes the tokenizer in place, and this one is shared by every '
                     'user of its directory: load it with tokenizer(fresh=True)')
  if not hasattr(model, 'embedder'):
    raise ValueError(f'add_special_tokens supports decoder-only models with an embedder, not {type(model).__name__}')
  missing = [t for t in tokens if t not in tokenizer.get_vocab()]
  if missing:
    # Atomic added tokens, but not "special": decode(skip_special_tokens=True), which every
    # generator uses to drop BOS / EOS / padding, keeps them, so a compressor's output still
    # shows where each description ends (K-COMP splits it at the last <eom>).
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in missing])
  ids = tokenizer.convert_tokens_to_ids(list(tokens))
  old = int(config.vocab_size)
  new = max(old, len(tokenizer))
  if new > old:
    table = model.embedder.embedding
    rows = jnp.broadcast_to(jnp.mean(table[...], axis=0, keepdims=True), (new - old, table.shape[1]))
    table.set_value(jnp.concatenate([table[...], rows.astype(table.dtype)], axis=0))
    if getattr(model, 'lm_head', None) is not None:
      kernel = model.lm_head.kernel
      cols = jnp.broadcast_to(jnp.mean(kernel[...], axis=1, keepdims=True), (kernel.shape[0], new - old))
      kernel.set_value(jnp.concatenate([kernel[...], cols.astype(kernel.dtype)], axis=1))
    pretrained.config = dataclasses.replace(config, vocab_size=new)
    model.config = pretrained.config
  return list(ids)


__all__ = ['add_special_tokens']
