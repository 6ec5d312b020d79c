"""Workdir-cached, resumable pipeline stages.

Each stage writes into ``{workdir}/stages/{name}/`` and ends by writing
``DONE.json`` (its config fingerprint, wall time and a summary). A rerun skips a
finished stage whose fingerprint matches, reruns it when asked (``force``) or
when its inputs changed, and otherwise continues an unfinished one: per-example
work is appended to a :class:`ResumableJsonl` so a killed stage loses at most
the record being written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from typing import Any, Callable, Iterable, Iterator

from absl import logging


def fingerprint(obj: Any) -> str:
  """A stable hash of a JSON-serialisable description of a stage's inputs."""
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class ResumableJsonl:
  """An append-only JSONL file of records keyed by ``key``; survives being killed.

  Records are flushed and fsynced per :meth:`append`. On open, a truncated last
  line (a kill mid-write) is dropped and the file is cut back to the last
  complete record.
  """

  def __init__(self, path: str, key: str = 'id'):
    self.path = path
    self.key = key
    self.records: dict[str, dict] = {}
    if os.path.exists(path):
      good_bytes = 0
      with open(path, 'rb') as f:
        for raw in f:
          if not raw.endswith(b'\n'):
            break
          try:
            record = json.loads(raw)
          except json.JSONDecodeError:
            break
          self.records[str(record[key])] = record
          good_bytes += len(raw)
      if good_bytes != os.path.getsize(path):
        logging.warning('%s: dropping a partially written last record', path)
        with open(path, 'r+b') as f:
          f.truncate(good_bytes)
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    self._file = open(path, 'a', encoding='utf-8')

  def __contains__(self, key: str) -> bool:
    return str(key) in self.records

  def __len__(self) -> int:
    return len(self.records)

  def append(self, record: dict) -> None:
    self._file.write(json.dumps(record, ensure_ascii=False) + '\n')
    self._file.flush()
    os.fsync(self._file.fileno())
    self.records[str(record[self.key])] = record

  def extend(self, records: Iterable[dict]) -> None:
    for record in records:
      self.append(record)

  def close(self) -> None:
    self._file.close()


@dataclasses.dataclass
class StageRunner:
  """Runs named stages in a workdir, skipping the finished ones.

  Attributes:
    workdir: root of the run.
    force: names of stages to rerun from scratch (``'all'`` for every stage).
    timings: stage name -> seconds of this run (0 for skipped stages).
  """
  workdir: str
  force: tuple[str, ...] = ()
  timings: dict[str, float] = dataclasses.field(default_factory=dict)

  def stage_dir(self, name: str) -> str:
    return os.path.join(self.workdir, 'stages', name)

  def is_done(self, name: str, inputs: Any) -> bool:
    marker = os.path.join(self.stage_dir(name), 'DONE.json')
    if not os.path.exists(marker):
      return False
    with open(marker) as f:
      return json.load(f).get('fingerprint') == fingerprint(inputs)

  def summary(self, name: str) -> dict:
    with open(os.path.join(self.stage_dir(name), 'DONE.json')) as f:
      return json.load(f)['summary']

  def run(self, name: str, inputs: Any, fn: Callable[[str], dict]) -> dict:
    """Runs ``fn(stage_dir) -> summary`` unless the stage finished with the same ``inputs``.

    A stage whose inputs changed, or that is forced, starts from an empty directory; an
    unfinished one with the same inputs is continued (``fn`` resumes from its files).
    """
    directory = self.stage_dir(name)
    fp = fingerprint(inputs)
    forced = name in self.force or 'all' in self.force
    if not forced and self.is_done(name, inputs):
      logging.info('stage %s: done, skipped (%s)', name, directory)
      self.timings[name] = 0.0
      return self.summary(name)
    started_file = os.path.join(directory, 'STARTED.json')
    if forced or (os.path.exists(started_file) and json.load(open(started_file)).get('fingerprint') != fp):
      shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory, exist_ok=True)
    with open(started_file, 'w') as f:
      json.dump({'fingerprint': fp, 'inputs': inputs}, f, default=str, indent=2)
    logging.info('stage %s: running (%s)', name, directory)
    start = time.time()
    summary = fn(directory)
    seconds = time.time() - start
    self.timings[name] = seconds
    with open(os.path.join(directory, 'DONE.json'), 'w') as f:
      json.dump({'fingerprint': fp, 'seconds': seconds, 'summary': summary}, f, default=str, indent=2)
    logging.info('stage %s: finished in %.1fs', name, seconds)
    return summary


def batched(items: list, size: int) -> Iterator[list]:
  for i in range(0, len(items), size):
    yield items[i:i + size]
