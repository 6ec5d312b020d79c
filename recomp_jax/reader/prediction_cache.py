"""A persistent cache of the reader's greedy answers, so a rerun reads each prompt once.

An evaluation reads the same prompts over and over: the rows no compressor changes (no
retrieval, top-1, top-5, the teacher's summaries) are identical in every run on the same
questions, the A.5 oracle reads the no-retrieval and teacher prompts again, and every
question a compressor leaves empty is the no-retrieval prompt (docs/performance.md says how
much of an evaluation that is).

:class:`PredictionCache` keeps ``prompt -> answer`` in sqlite under a *reader key*: a hash of
the reader's weights (their content, not their path), the source of the code that turns
weights and a prompt into an answer (:data:`READER_CODE`: the model zoo, the loaders, the
reader) and the stop strings; each answer also records its generation limit. A change to
any of them misses, so a stale answer is never returned. :meth:`Reader.answer <recomp_jax.reader.Reader.answer>`
looks prompts up, generates only the missing ones (each distinct prompt once) and stores
them chunk by chunk, so a killed evaluation keeps what it generated.

Greedy decoding is deterministic, but the batch a prompt is decoded in (its padding) could
move a logit by float rounding and, rarely, flip a token; a cached answer is the one the
prompt got the first time it was read. On NQ eval500 the 293 questions a compressor left
empty, decoded in other batches, gave the no-retrieval row's answers on all 293.
"""

from __future__ import annotations

import hashlib
import sqlite3
import threading
from typing import Sequence

from recomp_jax.stages import code_hash, fingerprint

# The code between a reader's weights and its answer; its source is part of the reader key.
READER_CODE = ('recomp_jax.reader', 'recomp_jax.models', 'recomp_jax.pretrained')


def _sha(text: str) -> str:
  return hashlib.sha256(text.encode('utf-8')).hexdigest()


def reader_key(weights: dict, *, code: Sequence[str] = READER_CODE, **generation) -> str:
  """The key of one reader's answers.

  Args:
    weights: :func:`recomp_jax.stages.file_fingerprint` of the reader's weights
      (its ``path`` is ignored: the same weights elsewhere are the same reader), or a hub id.
    code: modules whose source (docstrings and comments aside) the answers depend on.
    generation: what else decides the answer (``stop_strings``; the generation limit is
      per answer, :meth:`PredictionCache.lookup`).
  """
  content = {k: v for k, v in weights.items() if k != 'path'}
  return fingerprint({'weights': content, 'code': code_hash(tuple(code)), 'generation': generation})


class PredictionCache:
  """``(prompt, max_new_tokens) -> answer`` of one reader in a sqlite file that many runs may share.

  Args:
    path: the sqlite file (created if missing).
    key: :func:`reader_key` of the reader whose answers these are.
  """

  def __init__(self, path: str, key: str):
    self.path, self.key = path, key
    self._lock = threading.Lock()
    self._db = sqlite3.connect(path, check_same_thread=False, timeout=60.0)
    with self._db:
      self._db.execute('CREATE TABLE IF NOT EXISTS answers (reader TEXT NOT NULL, max_new_tokens INTEGER NOT NULL, '
                       'prompt_sha TEXT NOT NULL, answer TEXT NOT NULL, '
                       'PRIMARY KEY (reader, max_new_tokens, prompt_sha))')
    self.hits = 0
    self.misses = 0

  def lookup(self, prompts: Sequence[str], max_new_tokens: int) -> list[str | None]:
    """The cached answer of each prompt at this generation limit, ``None`` where there is none;
    counts hits and misses."""
    shas = [_sha(p) for p in prompts]
    found: dict[str, str] = {}
    with self._lock:
      for begin in range(0, len(shas), 500):
        chunk = list(set(shas[begin:begin + 500]))
        marks = ','.join('?' * len(chunk))
        query = ('SELECT prompt_sha, answer FROM answers WHERE reader = ? AND max_new_tokens = ? '
                 f'AND prompt_sha IN ({marks})')
        found.update(self._db.execute(query, [self.key, int(max_new_tokens), *chunk]).fetchall())
    out = [found.get(s) for s in shas]
    hits = sum(a is not None for a in out)
    self.hits += hits
    self.misses += len(out) - hits
    return out

  def store(self, prompts: Sequence[str], answers: Sequence[str], max_new_tokens: int) -> None:
    """Records ``answers[i]`` as the answer to ``prompts[i]`` at this limit (one transaction)."""
    if len(prompts) != len(answers):
      raise ValueError(f'{len(prompts)} prompts for {len(answers)} answers')
    with self._lock, self._db:
      self._db.executemany('INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?)',
                           [(self.key, int(max_new_tokens), _sha(p), a) for p, a in zip(prompts, answers)])

  def __len__(self) -> int:
    """Answers held for this reader key."""
    with self._lock:
      return self._db.execute('SELECT COUNT(*) FROM answers WHERE reader = ?', [self.key]).fetchone()[0]

  def close(self) -> None:
    self._db.close()


__all__ = ['READER_CODE', 'PredictionCache', 'reader_key']
