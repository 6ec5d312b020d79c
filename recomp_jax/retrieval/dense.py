"""Dense retrieval: corpus embedding with our dual encoder and exact sharded MIPS.

* :func:`embed_corpus` embeds a passage corpus with :class:`~recomp_jax.models.dual_encoder.Encoder`
  (batches split over the mesh when the encoder was placed with ``to_mesh``) and
  writes the ``[N, D]`` float32 matrix in parts of ``part_rows`` rows; a killed run
  keeps its finished parts and embeds only the rest.
* :func:`exact_top_k` is exact maximum-inner-product search as one jitted JAX
  computation. The index ``[N_pad, D]`` is split by rows over every mesh device
  (logical axis ``corpus``). Each device scans its rows in chunks of ``chunk``
  rows and keeps a running top-k (``lax.scan``: memory ``[Q, shards, chunk]``, not
  ``[Q, N]``); the per-device top-k lists (``[Q, shards * k]``) are then merged by
  one more ``top_k``. The result equals a brute-force ``argsort(q @ E.T)`` up to
  float summation order; ties go to the earlier corpus row.
* :class:`DenseIndex` holds passages + embeddings, searches strings or vectors,
  fills ``Example.ctxs`` like :class:`~recomp_jax.retrieval.bm25.BM25Index`, and is
  saved to / reused from a directory keyed by a fingerprint of the corpus, the
  passage format and the encoder's parameters (:meth:`DenseIndex.build_or_load`).

Passages are embedded as ``"{title} {text}"`` (Contriever's format) by default.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding

from recomp_jax import sharding as sharding_lib
from recomp_jax.data.schema import Example, Passage

_FORMAT_VERSION = 1
PASSAGE_FORMATS = ('title_text', 'text')


@dataclasses.dataclass(frozen=True)
class DenseConfig:
  """Dense retrieval settings.

  Attributes:
    passage_format: ``'title_text'`` (``"{title} {text}"``) or ``'text'``.
    encode_batch_size: passages per encoder call (rounded up to the batch shard count).
    part_rows: rows per saved embedding part (the unit of resume).
    query_batch: queries per search call (padded to a power of two up to this, to bound recompiles).
    chunk: corpus rows per device per scan step of the top-k.
    max_query_length: query truncation in tokens.
  """
  passage_format: str = 'title_text'
  encode_batch_size: int = 128
  part_rows: int = 16384
  query_batch: int = 256
  chunk: int = 8192
  max_query_length: int = 64

  def __post_init__(self):
    if self.passage_format not in PASSAGE_FORMATS:
      raise ValueError(f'passage_format must be one of {PASSAGE_FORMATS}, got {self.passage_format!r}')


def passage_text(p: Passage, passage_format: str = 'title_text') -> str:
  if passage_format == 'title_text' and p.title:
    return f'{p.title} {p.text}'
  return p.text


# ----------------------------------------------------------------------------- exact MIPS


def corpus_sharding(mesh: Mesh) -> NamedSharding:
  """``[N, D]`` index rows over the mesh axes of the logical ``corpus`` axis."""
  return NamedSharding(mesh, sharding_lib.logical_to_spec(('corpus', None)))


def corpus_shards(mesh: Mesh | None) -> int:
  if mesh is None:
    return 1
  members = sharding_lib.logical_to_spec(('corpus',))[0]
  members = (members,) if isinstance(members, str) else tuple(members or ())
  return int(np.prod([mesh.shape[m] for m in members])) if members else 1


def padded_rows(num_rows: int, shards: int, chunk: int, k: int) -> tuple[int, int]:
  """``(rows after padding, chunk actually used)``: a multiple of ``shards * chunk``, chunk >= k."""
  per_shard = -(-max(num_rows, 1) // shards)
  chunk = max(min(chunk, per_shard), k)
  steps = -(-per_shard // chunk)
  return shards * steps * chunk, chunk


@functools.partial(jax.jit, static_argnames=('k', 'shards', 'chunk'))
def exact_top_k(queries: jax.Array, table: jax.Array, num_valid: jax.Array, *, k: int,
                shards: int, chunk: int) -> tuple[jax.Array, jax.Array]:
  """Top-``k`` inner products of every query against the valid rows of ``table``.

  Args:
    queries: ``[Q, D]`` query embeddings (replicated).
    table: ``[N_pad, D]`` index, ``N_pad`` a multiple of ``shards * chunk``, rows
      split into ``shards`` contiguous blocks (sharded over ``corpus``).
    num_valid: scalar int, rows ``>= num_valid`` are padding and never returned.
    k: results per query (``k <= chunk``).
    shards: number of row blocks (the ``corpus`` shard count).
    chunk: rows per block per scan step.
  Returns:
    ``(scores [Q, k] float32, rows [Q, k] int32)``, best first.
  """
  n_pad, dim = table.shape
  steps = n_pad // (shards * chunk)
  num_queries = queries.shape[0]
  # Row r = (s * steps + t) * chunk + c lives on shard s: the reshape keeps shards intact.
  blocks = table.reshape(shards, steps, chunk, dim).transpose(1, 0, 2, 3)  # [steps, S, C, D]
  block_rows = ((jnp.arange(shards)[:, None] * steps)[None] + jnp.arange(steps)[:, None, None]) * chunk
  block_rows = block_rows + jnp.arange(chunk)[None, None, :]  # [steps, S, C]
  queries = queries.astype(jnp.float32)

  def step(carry, xs):
    best_scores, best_rows = carry  # [Q, S, k]
    block, rows = xs  # [S, C, D], [S, C]
    scores = jnp.einsum('qd,scd->qsc', queries, block.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jnp.where(rows[None] < num_valid, scores, -jnp.inf)
    merged_scores = jnp.concatenate([best_scores, scores], axis=-1)
    merged_rows = jnp.concatenate([best_rows, jnp.broadcast_to(rows[None], scores.shape)], axis=-1)
    top_scores, position = jax.lax.top_k(merged_scores, k)
    return (top_scores, jnp.take_along_axis(merged_rows, position, axis=-1)), None

  init = (jnp.full((num_queries, shards, k), -jnp.inf, jnp.float32),
          jnp.full((num_queries, shards, k), -1, jnp.int32))
  (scores, rows), _ = jax.lax.scan(step, init, (blocks, block_rows.astype(jnp.int32)))
  scores = scores.reshape(num_queries, shards * k)
  rows = rows.reshape(num_queries, shards * k)
  top_scores, position = jax.lax.top_k(scores, k)
  return top_scores, jnp.take_along_axis(rows, position, axis=-1)


# ----------------------------------------------------------------------------- corpus embedding


def params_fingerprint(model) -> str:
  """sha256 over every parameter's name, shape, dtype and bytes (identifies trained weights)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  h = hashlib.sha256()
  for path, value in sorted(nnx.to_flat_state(nnx.state(model, nnx.Param)),
                            key=lambda kv: tuple(map(str, kv[0]))):
    array = np.asarray(jax.device_get(value.get_value()))
    h.update(repr((tuple(map(str, path)), array.shape, str(array.dtype))).encode())
    h.update(np.ascontiguousarray(array).tobytes())
  return h.hexdigest()


def corpus_fingerprint(passages: Sequence[Passage], passage_format: str) -> str:
  h = hashlib.sha256(f'dense-v{_FORMAT_VERSION}|{passage_format}'.encode())
  for p in passages:
    h.update(f'{p.id}\x00{p.title}\x00{p.text}\x01'.encode())
  return h.hexdigest()


def embed_corpus(encoder, passages: Sequence[Passage], directory: str,
                 config: DenseConfig = DenseConfig()) -> np.ndarray:
  """``[N, D]`` float32 passage embeddings, saved part by part under ``directory``.

  Parts are written atomically (``part-00000.npy`` ...); parts already present
  with the right shape are loaded instead of recomputed, so an interrupted run
  loses at most one part.
  """
  os.makedirs(directory, exist_ok=True)
  parts = []
  for index, start in enumerate(range(0, len(passages), config.part_rows)):
    chunk = passages[start:start + config.part_rows]
    path = os.path.join(directory, f'part-{index:05d}.npy')
    if os.path.exists(path):
      part = np.load(path)
      if part.shape == (len(chunk), encoder.dim):
        parts.append(part)
        continue
      logging.warning('%s has shape %s, expected %s; re-embedding it', path, part.shape,
                      (len(chunk), encoder.dim))
    part = encoder.encode([passage_text(p, config.passage_format) for p in chunk],
                          batch_size=config.encode_batch_size, kind='passage')
    tmp = f'{path}.tmp{os.getpid()}.npy'
    np.save(tmp, part)
    os.replace(tmp, path)
    parts.append(part)
    logging.info('embedded %d / %d passages', start + len(chunk), len(passages))
  if not parts:
    return np.zeros((0, encoder.dim), np.float32)
  return np.concatenate(parts, axis=0)


# ----------------------------------------------------------------------------- the index


class DenseIndex:
  """Passages + their embeddings, searched exactly on a mesh (or the default device)."""

  def __init__(self, passages: Sequence[Passage], embeddings: np.ndarray, *, mesh: Mesh | None = None,
               config: DenseConfig = DenseConfig(), fingerprint: str = ''):
    embeddings = np.asarray(embeddings, np.float32)
    if embeddings.ndim != 2 or embeddings.shape[0] != len(passages):
      raise ValueError(f'embeddings must be [{len(passages)}, D], got {embeddings.shape}')
    self.passages = list(passages)
    self.embeddings = embeddings
    self.mesh = mesh
    self.config = config
    self.fingerprint = fingerprint
    self._device_tables: dict[int, tuple[jax.Array, int]] = {}

  def __len__(self) -> int:
    return len(self.passages)

  def _table(self, k: int) -> tuple[jax.Array, int, int]:
    shards = corpus_shards(self.mesh)
    n_pad, chunk = padded_rows(len(self), shards, self.config.chunk, k)
    if chunk not in self._device_tables:
      table = np.zeros((n_pad, self.embeddings.shape[1]), np.float32)
      table[:len(self)] = self.embeddings
      placed = (jax.device_put(table, corpus_sharding(self.mesh)) if self.mesh is not None
                else jnp.asarray(table))
      self._device_tables = {chunk: (placed, shards)}  # keep one copy on device
    table, shards = self._device_tables[chunk]
    return table, shards, chunk

  def search_embeddings(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``[Q, D]`` query embeddings -> ``(scores [Q, k], rows [Q, k])`` numpy, best first."""
    queries = np.asarray(queries, np.float32)
    k = min(k, len(self))
    if k <= 0 or not len(queries):
      return np.zeros((len(queries), max(k, 0)), np.float32), np.zeros((len(queries), max(k, 0)), np.int32)
    table, shards, chunk = self._table(k)
    num_valid = jnp.int32(len(self))
    out_scores, out_rows = [], []
    step = self.config.query_batch
    for start in range(0, len(queries), step):
      block = queries[start:start + step]
      rows = min(step, 1 << (len(block) - 1).bit_length())
      padded = np.zeros((rows, queries.shape[1]), np.float32)
      padded[:len(block)] = block
      scores, ids = exact_top_k(padded, table, num_valid, k=k, shards=shards, chunk=chunk)
      out_scores.append(np.asarray(scores)[:len(block)])
      out_rows.append(np.asarray(ids)[:len(block)])
    return np.concatenate(out_scores), np.concatenate(out_rows)

  def search_batch(self, encoder, queries: Sequence[str], k: int = 20) -> list[list[Passage]]:
    """Top-``k`` passages (with ``score``) for every query string."""
    embedded = encoder.encode(list(queries), kind='query', max_length=self.config.max_query_length)
    scores, rows = self.search_embeddings(embedded, k)
    return [[dataclasses.replace(self.passages[r], score=float(s)) for s, r in zip(srow, rrow)]
            for srow, rrow in zip(scores, rows)]

  def retrieve(self, encoder, examples: Sequence[Example], k: int = 20) -> list[Example]:
    """Examples with ``ctxs`` replaced by their top-``k`` passages (``has_answer``/``is_gold`` filled)."""
    from recomp_jax.evaluation.qa_metrics import has_answer  # pylint: disable=import-outside-toplevel
    found = self.search_batch(encoder, [e.question for e in examples], k)
    out = []
    for ex, ctxs in zip(examples, found):
      gold_id = ex.gold_ctx.id if ex.gold_ctx is not None else None
      ctxs = [dataclasses.replace(p, has_answer=has_answer(p.text, ex.answers),
                                  is_gold=(p.id == gold_id) if gold_id is not None else None)
              for p in ctxs]
      out.append(dataclasses.replace(ex, ctxs=ctxs))
    return out

  # --------------------------------------------------------------------------- persistence

  def save(self, directory: str) -> None:
    """Writes ``embeddings.npy``, ``passages.jsonl`` and ``meta.json`` (last, as the commit mark)."""
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f'embeddings.tmp{os.getpid()}.npy')
    np.save(tmp, self.embeddings)
    os.replace(tmp, os.path.join(directory, 'embeddings.npy'))
    tmp = os.path.join(directory, f'passages.jsonl.tmp{os.getpid()}')
    with open(tmp, 'w', encoding='utf-8') as f:
      for p in self.passages:
        f.write(json.dumps(dataclasses.asdict(p), ensure_ascii=False) + '\n')
    os.replace(tmp, os.path.join(directory, 'passages.jsonl'))
    meta = {'version': _FORMAT_VERSION, 'fingerprint': self.fingerprint,
            'rows': len(self), 'dim': int(self.embeddings.shape[1]),
            'config': dataclasses.asdict(self.config)}
    with open(os.path.join(directory, 'meta.json'), 'w') as f:
      json.dump(meta, f, indent=2)

  @classmethod
  def load(cls, directory: str, *, mesh: Mesh | None = None) -> 'DenseIndex':
    meta_path = os.path.join(directory, 'meta.json')
    with open(meta_path) as f:
      meta = json.load(f)
    if meta.get('version') != _FORMAT_VERSION:
      raise ValueError(f'{meta_path}: dense index format {meta.get("version")}, '
                       f'expected {_FORMAT_VERSION}; rebuild it')
    embeddings = np.load(os.path.join(directory, 'embeddings.npy'))
    with open(os.path.join(directory, 'passages.jsonl'), encoding='utf-8') as f:
      passages = [Passage(**json.loads(line)) for line in f]
    if embeddings.shape != (meta['rows'], meta['dim']) or len(passages) != meta['rows']:
      raise ValueError(f'{directory}: embeddings {embeddings.shape} / {len(passages)} passages do not '
                       f'match meta.json ({meta["rows"]} x {meta["dim"]}); rebuild it')
    return cls(passages, embeddings, mesh=mesh, config=DenseConfig(**meta['config']),
               fingerprint=meta['fingerprint'])

  @classmethod
  def build_or_load(cls, passages: Sequence[Passage], encoder, workdir: str, *,
                    config: DenseConfig = DenseConfig(), mesh: Mesh | None = None,
                    name: str = 'dense') -> 'DenseIndex':
    """Loads ``{workdir}/{name}-{fingerprint[:16]}`` or embeds the corpus (resumably) and saves it.

    The fingerprint covers the corpus, the passage format, the encoder's
    parameters and its truncation length, so a fine-tuned encoder never reuses
    an index built by another.
    """
    h = hashlib.sha256()
    for part in (corpus_fingerprint(passages, config.passage_format), params_fingerprint(encoder.model),
                 str(encoder.max_length), str(encoder.lowercase)):
      h.update(part.encode())
    fingerprint = h.hexdigest()
    directory = os.path.join(workdir, f'{name}-{fingerprint[:16]}')
    if os.path.exists(os.path.join(directory, 'meta.json')):
      index = cls.load(directory, mesh=mesh)
      if index.fingerprint == fingerprint:
        logging.info('reusing dense index %s (%d passages)', directory, len(index))
        return index
    embeddings = embed_corpus(encoder, passages, os.path.join(directory, 'parts'), config)
    index = cls(passages, embeddings, mesh=mesh, config=config, fingerprint=fingerprint)
    index.save(directory)
    return index


__all__ = ['DenseConfig', 'DenseIndex', 'corpus_sharding', 'embed_corpus', 'exact_top_k',
           'padded_rows', 'passage_text']
