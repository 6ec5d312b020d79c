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
them chunk by chunk, so a killed evaluation keeps what it generated. A caller decoding with
other stop strings or without the answer post-processing (K-COMP's long-form answers) names
that as a *variant*, which keys its answers apart.

:func:`export_answers` writes a cache's answers (prompt hashes and answers, no prompt text) to a
JSONL.gz file that can be committed as a derived artefact; ``reader.prediction_seed`` reads such
files into a run's cache before it starts, so a run on a fresh machine skips the prompts an earlier
run decoded. Answers under another reader key (other weights or reader code) are never used.

Greedy decoding is deterministic, but the batch a prompt is decoded in (its padding) could
move a logit by float rounding and, rarely, flip a token; a cached answer is the one the
prompt got the first time it was read. On NQ eval500 the 293 questions a compressor left
empty, decoded in other batches, gave the no-retrieval row's answers on all 293.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sqlite3
import threading
from typing import Sequence

from recomp_jax.stages import code_hash, fingerprint

# The code between a reader's weights and its answer; its source is part of the reader key. Only
# the answer path: an edit to this module, to scoring or to the long-context retriever leaves
# every cached (and exported) answer valid.
READER_CODE = ('recomp_jax.reader.reader', 'recomp_jax.reader.prompts', 'recomp_jax.models', 'recomp_jax.pretrained')


def _sha(text: str) -> str:
  return hashlib.sha256(text.encode('utf-8')).hexdigest()


def decoding_variant(stops: Sequence[str], reader_stops: Sequence[str], postprocess: bool) -> str:
  """The variant an answer decoded with ``stops`` / ``postprocess`` is cached under by a reader whose own
  stop strings are ``reader_stops``: '' for the reader's own decoding (stops and short-answer clean-up)."""
  own = tuple(stops) == tuple(reader_stops) and postprocess
  return '' if own else json.dumps({'stop_strings': list(stops), 'postprocess': postprocess})


def _variant_key(key: str, variant: str) -> str:
  return key if not variant else _sha(f'{key}\0{variant}')


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

  def variant_key(self, variant: str) -> str:
    """The key of this reader's answers under another decoding ``variant`` ('' = the reader's own)."""
    return _variant_key(self.key, variant)

  def lookup(self, prompts: Sequence[str], max_new_tokens: int, *, variant: str = '') -> list[str | None]:
    """The cached answer of each prompt at this generation limit (and decoding ``variant``),
    ``None`` where there is none; counts hits and misses."""
    key = self.variant_key(variant)
    shas = [_sha(p) for p in prompts]
    found: dict[str, str] = {}
    with self._lock:
      for begin in range(0, len(shas), 500):
        chunk = list(set(shas[begin:begin + 500]))
        marks = ','.join('?' * len(chunk))
        query = ('SELECT prompt_sha, answer FROM answers WHERE reader = ? AND max_new_tokens = ? '
                 f'AND prompt_sha IN ({marks})')
        found.update(self._db.execute(query, [key, int(max_new_tokens), *chunk]).fetchall())
    out = [found.get(s) for s in shas]
    hits = sum(a is not None for a in out)
    self.hits += hits
    self.misses += len(out) - hits
    return out

  def store(self, prompts: Sequence[str], answers: Sequence[str], max_new_tokens: int, *, variant: str = '') -> None:
    """Records ``answers[i]`` as the answer to ``prompts[i]`` at this limit (one transaction)."""
    if len(prompts) != len(answers):
      raise ValueError(f'{len(prompts)} prompts for {len(answers)} answers')
    key = self.variant_key(variant)
    with self._lock, self._db:
      self._db.executemany('INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?)',
                           [(key, int(max_new_tokens), _sha(p), a) for p, a in zip(prompts, answers)])

  def seed(self, path: str) -> dict:
    """Adds the answers of an :func:`export_answers` file that the cache lacks.

    Returns:
      ``{'read', 'added'}``: records in the file and those new to the cache (every reader key;
      lookups only ever read this reader's own keys).

    Raises:
      ValueError: a record without its four fields (naming the file and line).
    """
    rows = []
    with gzip.open(path, 'rt', encoding='utf-8') as f:
      for line_number, line in enumerate(f, 1):
        try:
          r = json.loads(line)
          row = (r['reader'], r['max_new_tokens'], r['prompt_sha'], r['answer'])
        except (ValueError, KeyError, TypeError) as e:
          raise ValueError(f'{path}:{line_number}: not a prediction record ({type(e).__name__}: {e}); '
                           "each line needs 'reader', 'max_new_tokens', 'prompt_sha' and 'answer'") from e
        if not all(isinstance(v, t) for v, t in zip(row, (str, int, str, str))):
          raise ValueError(f'{path}:{line_number}: a prediction record needs text reader, prompt_sha and answer '
                           f'and an integer max_new_tokens, got {[type(v).__name__ for v in row]}')
        rows.append(row)
    with self._lock, self._db:
      before = self._db.total_changes
      self._db.executemany('INSERT OR IGNORE INTO answers VALUES (?, ?, ?, ?)', rows)
      added = self._db.total_changes - before
    return {'read': len(rows), 'added': added}

  def __len__(self) -> int:
    """Answers held for this reader key."""
    with self._lock:
      return self._db.execute('SELECT COUNT(*) FROM answers WHERE reader = ?', [self.key]).fetchone()[0]

  def close(self) -> None:
    self._db.close()


def export_answers(db_path: str, out_path: str) -> int:
  """Writes every answer of the sqlite cache ``db_path`` to ``out_path`` (JSONL.gz, one
  ``{'reader', 'max_new_tokens', 'prompt_sha', 'answer'}`` per line, sorted); returns the count."""
  if not os.path.isfile(db_path):
    raise ValueError(f'{db_path}: no such prediction cache')
  db = sqlite3.connect(f'file:{db_path}?mode=ro', uri=True)
  try:
    rows = db.execute('SELECT reader, max_new_tokens, prompt_sha, answer FROM answers').fetchall()
  finally:
    db.close()
  _write_answers(out_path, rows)
  return len(rows)


def _write_answers(out_path: str, rows: Sequence[tuple[str, int, str, str]]) -> None:
  """``(reader, max_new_tokens, prompt_sha, answer)`` rows, sorted, as :func:`export_answers`'s JSONL.gz.
  mtime=0 and no file name in the header: the same answers give the same bytes, so a re-export
  does not show as a change."""
  with open(out_path, 'wb') as raw, gzip.GzipFile(filename='', fileobj=raw, mode='wb', mtime=0) as gz:
    for reader, limit, sha, answer in sorted(rows):
      gz.write((json.dumps({'reader': reader, 'max_new_tokens': limit, 'prompt_sha': sha, 'answer': answer},
                           ensure_ascii=False) + '\n').encode('utf-8'))


def answer_key(weights: dict, *, reader_stops: Sequence[str], stops: Sequence[str], postprocess: bool,
               code: Sequence[str] = READER_CODE) -> str:
  """The key an answer decoded with ``stops`` / ``postprocess`` is stored under by a reader whose own
  stop strings are ``reader_stops`` (:meth:`recomp_jax.reader.Reader.answer`'s variant key)."""
  key = reader_key(weights, code=code, stop_strings=list(reader_stops))
  return _variant_key(key, decoding_variant(stops, reader_stops, postprocess))


def rekey_answers(path: str, old_key: str, new_key: str) -> int:
  """Rewrites the :func:`export_answers` file ``path`` with ``old_key``'s answers under ``new_key``
  (same bytes otherwise); returns how many moved.

  For reader code that changed without changing what these answers are (show it by decoding a
  sample of the prompts again with the new code): otherwise a seeded run finds none of them.
  """
  with gzip.open(path, 'rt', encoding='utf-8') as f:
    records = [json.loads(line) for line in f]
  moved = sum(r['reader'] == old_key for r in records)
  _write_answers(path + '.tmp', [(new_key if r['reader'] == old_key else r['reader'], r['max_new_tokens'],
                                  r['prompt_sha'], r['answer']) for r in records])
  os.replace(path + '.tmp', path)
  return moved


def main(argv: Sequence[str] | None = None) -> None:
  """``python -m recomp_jax.reader.prediction_cache CACHE.sqlite OUT.jsonl.gz``: export a run's answers;
  ``... rekey FILE.jsonl.gz OLD_KEY NEW_KEY``: :func:`rekey_answers`."""
  import sys  # pylint: disable=import-outside-toplevel
  args = list(sys.argv[1:] if argv is None else argv)
  if len(args) == 4 and args[0] == 'rekey':
    print(f'{rekey_answers(*args[1:])} answers re-keyed in {args[1]}')
    return
  if len(args) != 2:
    raise SystemExit('usage: python -m recomp_jax.reader.prediction_cache CACHE.sqlite OUT.jsonl.gz\n'
                     '       python -m recomp_jax.reader.prediction_cache rekey FILE.jsonl.gz OLD_KEY NEW_KEY')
  print(f'{export_answers(*args)} answers -> {args[1]}')


__all__ = ['READER_CODE', 'PredictionCache', 'answer_key', 'export_answers', 'reader_key', 'rekey_answers']

if __name__ == '__main__':
  main()
