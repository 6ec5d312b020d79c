"""Dual (bi-) encoders for dense retrieval: BERT towers + pooling.

:class:`DualEncoder` holds one shared :class:`~recomp_jax.models.bert.BertModel`
(Contriever, sentence-transformers MiniLM) or separate query and passage
towers, and pools their last hidden states into ``[B, D]`` embeddings.
:class:`Encoder` adds a tokenizer and jitted, length-bucketed batching so that
downstream code can call ``encoder.encode(texts)`` on a list of strings.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recomp_jax.data.buckets import bucket_length
from recomp_jax.pretrained import CheckpointError, Pretrained, load_pretrained
from recomp_jax.models.bert import (POOLING_MODES, BertModel, pool,
                                    pooling_from_sentence_transformers)


class DualEncoder(nnx.Module):
  """Query and passage towers with pooling into ``[B, D]`` embeddings.

  With ``passage_model=None`` the towers are one shared module (a single set
  of parameters).
  """

  def __init__(self, query_model: BertModel, passage_model: BertModel | None = None, *,
               pooling: str = 'mean', normalize: bool = False):
    if pooling not in POOLING_MODES:
      raise ValueError(f'unknown pooling mode {pooling!r}; expected one of {POOLING_MODES}')
    self.query_model = query_model
    self.passage_model = query_model if passage_model is None else passage_model
    self.pooling = pooling
    self.normalize = normalize

  @property
  def shared(self) -> bool:
    return self.passage_model is self.query_model

  def set_layer_execution(self, *, scan_layers: bool | None = None, remat: bool | None = None
                          ) -> 'DualEncoder':
    """Scanned and/or rematerialised layers in both towers (:meth:`BertModel.set_layer_execution`)."""
    for tower in {id(self.query_model): self.query_model, id(self.passage_model): self.passage_model}.values():
      tower.set_layer_execution(scan_layers=scan_layers, remat=remat)
    return self

  def _encode(self, model: BertModel, input_ids: jax.Array, attention_mask: jax.Array,
              deterministic: bool, rngs: nnx.Rngs | None) -> jax.Array:
    hidden = model(input_ids, attention_mask, deterministic=deterministic, rngs=rngs)
    return pool(hidden, attention_mask, self.pooling, self.normalize)

  def encode_queries(self, input_ids: jax.Array, attention_mask: jax.Array, *,
                     deterministic: bool = True, rngs: nnx.Rngs | None = None) -> jax.Array:
    """``[B, T]`` ids and mask -> ``[B, D]`` float32 query embeddings."""
    return self._encode(self.query_model, input_ids, attention_mask, deterministic, rngs)

  def encode_passages(self, input_ids: jax.Array, attention_mask: jax.Array, *,
                      deterministic: bool = True, rngs: nnx.Rngs | None = None) -> jax.Array:
    """``[B, T]`` ids and mask -> ``[B, D]`` float32 passage embeddings."""
    return self._encode(self.passage_model, input_ids, attention_mask, deterministic, rngs)

  @classmethod
  def from_pretrained(cls, src: str, *, passage_src: str | None = None, shared: bool = True,
                      pooling: str | None = None, normalize: bool | None = None,
                      dtype=jnp.float32, param_dtype=jnp.float32) -> 'DualEncoder':
    """Loads BERT tower(s) through :func:`recomp_jax.pretrained.load_pretrained`.

    Args:
      src: HF directory / hub id / sentence-transformers directory of the
        query tower (and of the passage tower unless ``passage_src``).
      passage_src: a different checkpoint for the passage tower (implies
        ``shared=False``).
      shared: one set of parameters for both towers; ``False`` gives two
        independent copies (e.g. to fine-tune them separately).
      pooling: ``'mean'`` or ``'cls'``; default: the sentence-transformers
        pooling config when ``src`` has one, else ``'mean'`` (Contriever).
      normalize: L2-normalise embeddings; default: whether the
        sentence-transformers pipeline has a ``Normalize`` module, else False.
      dtype, param_dtype: compute and storage dtypes.
    """
    return _load(src, passage_src=passage_src, shared=shared, pooling=pooling,
                 normalize=normalize, dtype=dtype, param_dtype=param_dtype).model


@dataclasses.dataclass
class _Loaded:
  model: DualEncoder
  query: Pretrained
  max_seq_length: int | None
  lowercase: bool


def _load_tower(src: str, dtype, param_dtype) -> Pretrained:
  pretrained = load_pretrained(src, dtype=dtype, param_dtype=param_dtype)
  if pretrained.family.name != 'bert':
    raise CheckpointError(f'{pretrained.source_dir}: a dual encoder needs a BERT checkpoint, '
                          f'got model family {pretrained.family.name!r}')
  return pretrained


def _sentence_bert_config(directory: str) -> dict:
  path = os.path.join(directory, 'sentence_bert_config.json')
  if not os.path.exists(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _load(src: str, *, passage_src: str | None = None, shared: bool = True,
          pooling: str | None = None, normalize: bool | None = None, dtype=jnp.float32,
          param_dtype=jnp.float32) -> _Loaded:
  query = _load_tower(src, dtype, param_dtype)
  if passage_src is not None:
    passage_model = _load_tower(passage_src, dtype, param_dtype).model
  elif not shared:
    passage_model = nnx.clone(query.model)
  else:
    passage_model = None
  st_mode, st_normalize = ('mean', False)
  if query.pooling is not None:
    st_mode, st_normalize = pooling_from_sentence_transformers(query.pooling)
  model = DualEncoder(query.model, passage_model,
                      pooling=st_mode if pooling is None else pooling,
                      normalize=st_normalize if normalize is None else normalize)
  st_config = _sentence_bert_config(query.source_dir)
  return _Loaded(model, query, st_config.get('max_seq_length'),
                 bool(st_config.get('do_lower_case', False)))


_IN_FLIGHT = 4  # batches queued on the device before the oldest result is fetched


@functools.partial(jax.jit, static_argnames=('graphdef', 'tower'))
def _encode_batch(graphdef, state, input_ids: jax.Array, attention_mask: jax.Array,
                  tower: str) -> jax.Array:
  """``[B, T]`` ids and mask -> ``[B, D]`` with the model rebuilt from ``(graphdef, state)``."""
  model = nnx.merge(graphdef, state)
  encode = model.encode_queries if tower == 'query' else model.encode_passages
  return encode(input_ids, attention_mask)


class Encoder:
  """Tokenizer + :class:`DualEncoder`: ``encode(list[str]) -> np.ndarray [n, D]``.

  Texts are sorted by length and batched; each batch is padded to
  ``recomp_jax.data.buckets.bucket_length`` of its longest text (capped at ``max_length``)
  and a partial last batch to a power of two, so the number of compiled
  shapes stays small. The model's current parameters are used at every call.
  """

  def __init__(self, model: DualEncoder, tokenizer, *, max_length: int | None = None,
               lowercase: bool = False):
    self.model = model
    self.tokenizer = tokenizer
    limit = model.query_model.config.max_position_embeddings
    tokenizer_limit = getattr(tokenizer, 'model_max_length', None) or limit
    self.position_limit = int(limit)
    self.max_length = int(min(max_length or tokenizer_limit, tokenizer_limit, limit))
    self.lowercase = lowercase
    pad = tokenizer.pad_token_id
    self.pad_id = model.query_model.config.pad_token_id if pad is None else int(pad)
    self.mesh = None

  def to_mesh(self, mesh) -> 'Encoder':
    """Places the model on ``mesh`` (logical-axis rules); batches are then split over ``batch``.

    Every later :meth:`encode` call pads its batches to a multiple of the batch
    shard count and ``device_put`` s them with the batch sharding, so each device
    embeds its slice of every batch.
    """
    from recomp_jax import sharding  # pylint: disable=import-outside-toplevel
    sharding.place_on_mesh(self.model, mesh, donate=False)
    self.mesh = mesh
    return self

  @classmethod
  def from_pretrained(cls, src: str, *, max_length: int | None = None, **kwargs) -> 'Encoder':
    """Loads tokenizer and :meth:`DualEncoder.from_pretrained` (``kwargs`` go there).

    ``max_length`` defaults to the sentence-transformers ``max_seq_length``
    when ``src`` has one, else the tokenizer / position limit.
    """
    loaded = _load(src, **kwargs)
    return cls(loaded.model, loaded.query.tokenizer(),
               max_length=max_length or loaded.max_seq_length, lowercase=loaded.lowercase)

  @property
  def dim(self) -> int:
    return self.model.query_model.config.hidden_size

  def tokenize(self, texts: Sequence[str], max_length: int | None = None) -> list[list[int]]:
    """Token ids (with special tokens), truncated to ``max_length``."""
    if self.lowercase:
      texts = [t.lower() for t in texts]
    return self.tokenizer(list(texts), truncation=True, max_length=max_length or self.max_length,
                          add_special_tokens=True)['input_ids']

  def encode(self, texts: Sequence[str], *, batch_size: int = 64, max_length: int | None = None,
             kind: str = 'passage') -> np.ndarray:
    """Embeds ``texts`` with the passage (default) or query tower.

    Args:
      texts: n strings.
      batch_size: rows per device call.
      max_length: truncation length in tokens (default ``self.max_length``;
        at most ``max_position_embeddings``).
      kind: ``'passage'`` or ``'query'``.
    Returns:
      ``[n, D]`` float32 numpy array, in the order of ``texts``.
    """
    if isinstance(texts, str):
      raise TypeError('encode expects a sequence of strings, not a single string')
    if kind not in ('passage', 'query'):
      raise ValueError(f"kind must be 'passage' or 'query', got {kind!r}")
    max_length = min(max_length or self.max_length, self.position_limit)
    out = np.zeros((len(texts), self.dim), np.float32)
    if not len(texts):
      return out
    ids = self.tokenize(texts, max_length)
    order = np.argsort([-len(x) for x in ids], kind='stable')  # longest first
    tower = 'query' if kind == 'query' or self.model.shared else 'passage'
    graphdef, state = nnx.split(self.model)
    shards, put = 1, (lambda x: x)
    if self.mesh is not None:
      from recomp_jax import sharding  # pylint: disable=import-outside-toplevel
      shards = sharding.batch_shards(self.mesh)
      batch_size = -(-batch_size // shards) * shards
      put = functools.partial(jax.device_put, device=sharding.batch_sharding(self.mesh))
    pending = collections.deque()
    for start in range(0, len(ids), batch_size):
      rows = order[start:start + batch_size]
      n_rows = min(batch_size, 1 << (len(rows) - 1).bit_length())  # a power of two unless full
      n_rows = -(-n_rows // shards) * shards
      length = min(bucket_length(max(len(ids[i]) for i in rows)), max_length)
      batch_ids = np.full((n_rows, length), self.pad_id, np.int32)
      batch_mask = np.zeros((n_rows, length), np.int32)
      for r, i in enumerate(rows):
        batch_ids[r, :len(ids[i])] = ids[i]
        batch_mask[r, :len(ids[i])] = 1
      pending.append((rows, _encode_batch(graphdef, state, put(batch_ids), put(batch_mask), tower)))
      while len(pending) > _IN_FLIGHT or (pending and start + batch_size >= len(ids)):
        done_rows, emb = pending.popleft()  # dispatch is async: fetch a few batches behind
        out[done_rows] = np.asarray(emb)[:len(done_rows)]
    return out

  def encode_queries(self, texts: Sequence[str], **kwargs) -> np.ndarray:
    return self.encode(texts, kind='query', **kwargs)

  def encode_passages(self, texts: Sequence[str], **kwargs) -> np.ndarray:
    return self.encode(texts, kind='passage', **kwargs)


__all__ = ['DualEncoder', 'Encoder']
