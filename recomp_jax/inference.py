"""One call for every system's trained compressor: ``load_compressor(path).compress(questions, docs)``.

Every run writes ``{workdir}/compressor/compressor.json`` (:meth:`recomp_jax.compressors.base.System.export`):
the system's name and what its compressor needs at inference (the exported model, its input
budget, how many documents it reads). :func:`load_compressor` reads it and returns an object with

    compress(questions: Sequence[str], documents: Sequence[Sequence[Passage]]) -> list[str]

one evidence text per question ('' where the compressor writes nothing), the same text the run's
``trained`` row gave its reader. ``documents[i]`` are question ``i``'s retrieved passages, best
first (:class:`recomp_jax.data.schema.Passage`, or ``{'title', 'text'}`` dicts).

On the command line, over a JSONL of ``{"id", "question", "ctxs": [{"title", "text"}, ...]}``::

  python -m recomp_jax.inference --compressor=workdirs/nq_abstractive_ci/compressor \
    --input=questions.jsonl --output=evidence.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from recomp_jax.compressors.base import load_exported, read_export
from recomp_jax.data import formats
from recomp_jax.data.schema import DataError, Location, Passage
from recomp_jax.pipelines.runner import SYSTEMS, TASKS


def load_compressor(path: str):
  """The compressor exported to ``path`` (a directory holding ``compressor.json``).

  Raises:
    DataError: no ``compressor.json``, or one naming a system this package does not have.
  """
  spec = read_export(path)
  return Compressor(spec, load_exported(path, sorted(SYSTEMS) + sorted(TASKS)))


def as_passages(documents: Sequence[Any]) -> list[Passage]:
  """Passages from :class:`Passage` objects or ``{'title', 'text'}`` dicts (ids are not needed)."""
  return [d if isinstance(d, Passage) else Passage(id=str(d.get('id', i)), title=d.get('title', ''), text=d['text'])
          for i, d in enumerate(documents)]


class Compressor:
  """A loaded compressor: ``spec`` is its ``compressor.json`` (paths absolute)."""

  def __init__(self, spec: dict, inner):
    self.spec, self.system, self._inner = spec, spec['system'], inner

  def compress(self, questions: Sequence[str], documents: Sequence[Sequence[Any]]) -> list[str]:
    """One evidence text per question of its documents (best first), '' where it writes nothing."""
    if len(questions) != len(documents):
      raise ValueError(f'{len(questions)} questions for {len(documents)} document lists')
    return list(self._inner.compress(list(questions), [as_passages(d) for d in documents]))


def read_requests(path: str) -> list[tuple[str, str, list[Passage]]]:
  """``(id, question, passages)`` per line of a JSONL file; a bad record is a DataError naming its line."""
  out = []
  for lineno, record in formats.iter_jsonl(path):
    example = formats.parse_request(record, Location(path, lineno), default_id=str(lineno))
    out.append((example.id, example.question, list(example.ctxs)))
  return out


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description='Compress retrieved documents with an exported compressor.')
  parser.add_argument('--compressor', required=True, help='an exported compressor ({workdir}/compressor)')
  parser.add_argument('--input', required=True, help='JSONL: {"id", "question", "ctxs": [{"title", "text"}]}')
  parser.add_argument('--output', required=True, help='JSONL written: {"id", "evidence"} per input line')
  parser.add_argument('--batch_size', type=int, default=64, help='questions per compress call')
  args = parser.parse_args(argv)
  try:
    requests = read_requests(args.input)
    compressor = load_compressor(args.compressor)
  except DataError as err:
    print(f'error: {err}', file=sys.stderr)
    return 2
  with open(args.output, 'w', encoding='utf-8') as f:
    for start in range(0, len(requests), args.batch_size):
      part = requests[start:start + args.batch_size]
      texts = compressor.compress([q for _, q, _ in part], [d for _, _, d in part])
      for (qid, _, _), text in zip(part, texts):
        f.write(json.dumps({'id': qid, 'evidence': text}, ensure_ascii=False) + '\n')
  print(f'{len(requests)} questions compressed -> {args.output}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
