"""Canonical records of the data pipeline, their validation, and the filter report.

Every reader turns its source format into these two records:

* :class:`Passage` -- one retrieval unit (a ~100-word Wikipedia passage, a
  HotpotQA paragraph, a corpus row), optionally with its retrieval score and the
  analysis-only flags ``has_answer`` / ``is_gold``.
* :class:`Example` -- one question with its gold answers, its retrieved passages
  ``ctxs`` in rank order (best first) and, when known, the gold passage.

``has_answer`` and ``is_gold`` exist for analysis and oracle baselines only: a
compressor or reader must never see them at inference time.

Validation errors are :class:`DataError` with the message
``'{path}:{line}: field {name!r}: {what is wrong}'`` so a bad row in a 2 GB file
is found with one ``sed -n {line}p``. Whatever a reader or a pipeline stage
drops on purpose (an invalid row under ``on_error='skip'``, a duplicate
candidate sentence, a sentence beyond the candidate cap) is counted per reason
in a :class:`FilterReport`: nothing is dropped silently.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
from typing import Any, Mapping


class DataError(ValueError):
  """A malformed record; the message names file, line and field."""

  def __init__(self, path: str | os.PathLike | None, line: int | None, field: str | None,
               message: str):
    self.path = None if path is None else os.fspath(path)
    self.line = line
    self.field = field
    path_str = self.path if self.path is not None else '<memory>'
    where = f'{path_str}:{line if line is not None else "?"}'
    what = f'field {field!r}: {message}' if field is not None else message
    super().__init__(f'{where}: {what}')


@dataclasses.dataclass(frozen=True)
class Passage:
  """One retrieval unit.

  Attributes:
    id: corpus-unique identifier (a string even when the source uses ints).
    title: Wikipedia page title ('' when the source has none).
    text: passage text.
    score: retrieval score (higher is better), None when not retrieved.
    has_answer: whether a gold answer occurs in ``text`` (analysis only).
    is_gold: whether this is (one of) the annotated gold passage(s) (analysis only).
    source: optional provenance tag of the corpus row (e.g. 'nq_gold', 'ovos').
  """
  id: str
  title: str
  text: str
  score: float | None = None
  has_answer: bool | None = None
  is_gold: bool | None = None
  source: str | None = None

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready dict in the DPR/FiD ``ctxs`` layout; None fields are left out."""
    return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class Example:
  """One question.

  Attributes:
    id: dataset-unique identifier.
    question: the question text as given (NQ questions are lower-case, no '?').
    answers: gold answer strings, at least one.
    ctxs: retrieved passages in rank order, best first (may be empty).
    gold_ctx: the annotated gold passage when the dataset has one.
    meta: free-form provenance (template, article, split, ...); never read by models.
  """
  id: str
  question: str
  answers: list[str]
  ctxs: list[Passage] = dataclasses.field(default_factory=list)
  gold_ctx: Passage | None = None
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  def to_dict(self) -> dict[str, Any]:
    """JSON-ready dict in the DPR/FiD layout read back by ``formats.read_examples``."""
    out: dict[str, Any] = {'id': self.id, 'question': self.question,
                           'answers': list(self.answers),
                           'ctxs': [c.to_dict() for c in self.ctxs]}
    if self.gold_ctx is not None:
      out['gold_ctx'] = self.gold_ctx.to_dict()
    if self.meta:
      out['meta'] = dict(self.meta)
    return out


# ----------------------------------------------------------------------------- validation


class Location:
  """Where a record came from: ``path`` and 1-based ``line`` (for error messages)."""

  __slots__ = ('path', 'line')

  def __init__(self, path: str | os.PathLike | None = None, line: int | None = None):
    self.path = path
    self.line = line

  def error(self, field: str | None, message: str) -> DataError:
    return DataError(self.path, self.line, field, message)


def require_str(obj: Mapping[str, Any], key: str, where: Location, *, prefix: str = '',
                allow_empty: bool = False) -> str:
  """``obj[key]`` as a (non-empty unless ``allow_empty``) string, else DataError."""
  name = prefix + key
  if key not in obj or obj[key] is None:
    raise where.error(name, 'missing')
  value = obj[key]
  if not isinstance(value, str):
    raise where.error(name, f'expected a string, got {type(value).__name__}')
  if not allow_empty and not value.strip():
    raise where.error(name, 'empty string')
  return value


def require_str_list(obj: Mapping[str, Any], key: str, where: Location, *,
                     prefix: str = '') -> list[str]:
  """``obj[key]`` as a non-empty list of non-empty strings, else DataError."""
  name = prefix + key
  if key not in obj or obj[key] is None:
    raise where.error(name, 'missing')
  value = obj[key]
  if not isinstance(value, list):
    raise where.error(name, f'expected a list of strings, got {type(value).__name__}')
  if not value:
    raise where.error(name, 'empty list')
  for i, item in enumerate(value):
    if not isinstance(item, str):
      raise where.error(f'{name}[{i}]', f'expected a string, got {type(item).__name__}')
    if not item.strip():
      raise where.error(f'{name}[{i}]', 'empty string')
  return list(value)


def _optional(obj: Mapping[str, Any], key: str, types: tuple[type, ...], where: Location,
              prefix: str) -> Any:
  value = obj.get(key)
  if value is None:
    return None
  # bool is an int subclass: a score of True is as wrong as a flag of 3.
  if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
    expected = ' or '.join(t.__name__ for t in types)
    raise where.error(prefix + key, f'expected {expected}, got {type(value).__name__}')
  return value


def parse_passage(obj: Any, where: Location, *, prefix: str = '', default_id: str | None = None,
                  text_key: str = 'text') -> Passage:
  """Validates one DPR-style passage dict (``id, title, text, score, has_answer, is_gold``).

  ``title`` may be missing or empty (some corpora have none); ``text`` may not.
  ``id`` may be missing when ``default_id`` is given (gold passages often lack one).
  """
  if not isinstance(obj, Mapping):
    raise where.error(prefix.rstrip('.') or None, f'expected an object, got {type(obj).__name__}')
  text = require_str(obj, text_key, where, prefix=prefix)
  title = obj.get('title')
  if title is None:
    title = ''
  elif not isinstance(title, str):
    raise where.error(prefix + 'title', f'expected a string, got {type(title).__name__}')
  pid = obj.get('id')
  if pid is None:
    if default_id is None:
      raise where.error(prefix + 'id', 'missing')
    pid = default_id
  elif isinstance(pid, bool) or not isinstance(pid, (str, int)):
    raise where.error(prefix + 'id', f'expected a string or int, got {type(pid).__name__}')
  score = _optional(obj, 'score', (int, float), where, prefix)
  return Passage(id=str(pid), title=title, text=text,
                 score=None if score is None else float(score),
                 has_answer=_optional(obj, 'has_answer', (bool,), where, prefix),
                 is_gold=_optional(obj, 'is_gold', (bool,), where, prefix),
                 source=_optional(obj, 'source', (str,), where, prefix))


# ----------------------------------------------------------------------------- filter report


@dataclasses.dataclass
class FilterReport:
  """Counts of what a stage kept and what it dropped, per reason.

  A stage calls :meth:`keep` for every record it passes on and :meth:`drop` with a
  short reason for every record it does not. ``where`` (e.g. ``'train.jsonl:17'``)
  of the first few drops per reason are kept as samples for debugging.

  Attributes:
    stage: name of the stage ('read_examples', 'candidates', ...).
    kept: number of records passed on.
    dropped: reason -> number of records dropped.
    samples: reason -> up to ``max_samples`` locations/descriptions of drops.
  """
  stage: str
  kept: int = 0
  dropped: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  samples: dict[str, list[str]] = dataclasses.field(default_factory=dict)
  max_samples: int = 5

  def keep(self, n: int = 1) -> None:
    self.kept += n

  def drop(self, reason: str, where: str | None = None, n: int = 1) -> None:
    self.dropped[reason] += n
    if where is not None:
      bucket = self.samples.setdefault(reason, [])
      if len(bucket) < self.max_samples:
        bucket.append(where)

  @property
  def total_dropped(self) -> int:
    return sum(self.dropped.values())

  @property
  def seen(self) -> int:
    return self.kept + self.total_dropped

  def merge(self, other: 'FilterReport') -> 'FilterReport':
    """Adds ``other``'s counts into this report (in place) and returns it."""
    self.kept += other.kept
    self.dropped.update(other.dropped)
    for reason, where in other.samples.items():
      bucket = self.samples.setdefault(reason, [])
      bucket.extend(where[:max(0, self.max_samples - len(bucket))])
    return self

  def to_dict(self) -> dict[str, Any]:
    return {'stage': self.stage, 'seen': self.seen, 'kept': self.kept,
            'dropped': dict(sorted(self.dropped.items())),
            'samples': {k: list(v) for k, v in sorted(self.samples.items())}}

  def save(self, path: str | os.PathLike) -> None:
    """Writes :meth:`to_dict` as indented JSON (in a multi-process run, process 0 writes)."""
    from recomp_jax import sharding  # pylint: disable=import-outside-toplevel
    with sharding.open_on_main(os.fspath(path)) as f:
      json.dump(self.to_dict(), f, indent=2, ensure_ascii=False)
      f.write('\n')

  @classmethod
  def load(cls, path: str | os.PathLike) -> 'FilterReport':
    with open(path, encoding='utf-8') as f:
      d = json.load(f)
    return cls(stage=d['stage'], kept=d['kept'], dropped=collections.Counter(d['dropped']),
               samples={k: list(v) for k, v in d.get('samples', {}).items()})

  def __str__(self) -> str:
    lines = [f'[{self.stage}] seen {self.seen}, kept {self.kept}, dropped {self.total_dropped}']
    for reason, n in sorted(self.dropped.items(), key=lambda kv: (-kv[1], kv[0])):
      sample = self.samples.get(reason)
      lines.append(f'  {reason}: {n}' + (f'  (e.g. {", ".join(sample[:3])})' if sample else ''))
    return '\n'.join(lines)
