"""Workdir-cached, resumable pipeline stages.

Each stage writes into ``{workdir}/stages/{name}/`` and ends by writing
``DONE.json``: its fingerprint, wall time, a summary and a manifest (size and
sha256 of every file it wrote). A stage's fingerprint covers

* its ``inputs`` (the config fields it reads, file content hashes from
  :func:`file_fingerprint`),
* the fingerprints of the stages it reads from (``deps``), so a changed data file
  reruns everything downstream, and
* the code hash of the modules it runs (``code``), so a changed reader, prompt or
  loss reruns the stage. The code hash reads each file's syntax tree without its
  docstrings (:func:`module_code_hash`): an edit to a comment, a docstring or the
  layout keeps every finished stage (a results file's ``source_hash`` stays exact).

A rerun skips a finished stage whose fingerprint matches and whose files still match
the manifest; a damaged or missing file is named in a warning and the stage is
recomputed (a ``resumable`` stage keeps its directory and continues from the intact
records; any other starts afresh). It reruns when asked (``force``) or when its
fingerprint changed, and otherwise continues an unfinished one: per-example work is
appended to a :class:`ResumableJsonl` so a killed stage loses at most the record
being written.

Multi-process runs share one work directory (Orbax checkpoints are collective), and
process 0 owns it: it decides whether a stage runs, prepares and finishes its
directory and writes every file, while the other processes compute alongside it
(a stage that uses the sharded models is a collective) and write nothing. A stage
that is not a collective (``collective=False``: data preparation, calls to a teacher
API) runs on process 0 alone while the others wait for it. After a stage that grew the resident
set the allocator hands its kept pages back (:func:`recomp_jax.allocator.release_if_grown`), and
a process near the kernel's cap on memory mappings drops its compiled functions
(:func:`recomp_jax.allocator.drop_compiled_near_map_limit`: past the cap, XLA's CPU compiler
crashes). ``DONE.json`` records the stage's peak resident set.

A remote workdir (``gs://``; :mod:`recomp_jax.storage`) is mirrored: stages compute in a
local directory, process 0 uploads each finished stage (``DONE.json`` last) and the files at
the workdir's top level (the teacher cache), a rerun on a fresh machine downloads the finished
stages whose fingerprint matches, a stage whose fingerprint changed is deleted remotely too
(its checkpoints must not be resumed), and in a multi-process run the other processes
download each stage into their own mirror once process 0 has uploaded it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import shutil
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

from absl import logging

from recomp_jax import allocator, sharding, storage


def fingerprint(obj: Any) -> str:
  """A stable hash of a JSON-serialisable description of a stage's inputs."""
  return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sha256_file(path: str, *, chunk: int = 1 << 20) -> str:
  """Hex sha256 of a file's bytes."""
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(chunk), b''):
      digest.update(block)
  return digest.hexdigest()


_FULL_HASH_LIMIT = 256 << 20  # files above this are fingerprinted by size + head/tail


def file_fingerprint(path: str) -> dict:
  """A content fingerprint of a data file or a model (file or directory).

  Files up to 256 MiB are hashed in full (sha256); larger ones (model weights) by their
  size and the sha256 of their first and last MiB, which changes whenever a checkpoint
  is replaced. A directory is the fingerprint of each file in it, by relative path.
  """
  path = os.path.abspath(os.path.expanduser(path))
  if os.path.isdir(path):
    out = {}
    for root, _, files in sorted(os.walk(path)):
      for name in sorted(files):
        full = os.path.join(root, name)
        out[os.path.relpath(full, path)] = file_fingerprint(full)['sha256']
    return {'path': path, 'sha256': fingerprint(out)}
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path}: no such file or directory')
  size = os.path.getsize(path)
  if size <= _FULL_HASH_LIMIT:
    return {'path': path, 'sha256': sha256_file(path)}
  digest = hashlib.sha256(str(size).encode())
  with open(path, 'rb') as f:
    digest.update(f.read(1 << 20))
    f.seek(size - (1 << 20))
    digest.update(f.read(1 << 20))
  return {'path': path, 'sha256': 'head-tail:' + digest.hexdigest()}


@functools.lru_cache(maxsize=None)
def module_source_hash(module_name: str) -> str:
  """sha256 of a module's exact source bytes (a package: every ``.py`` file under it): the
  provenance of a results file. Stage fingerprints use :func:`module_code_hash` instead."""
  digest = hashlib.sha256()
  package = importlib.import_module(module_name).__file__.endswith('__init__.py')
  for name, path in _module_files(module_name):
    if package:
      digest.update(name.encode())
    with open(path, 'rb') as f:
      digest.update(f.read())
  return digest.hexdigest()


def _module_files(module_name: str) -> list[tuple[str, str]]:
  """``(name relative to the package, path)`` of a module's ``.py`` files (a package: all of them)."""
  path = importlib.import_module(module_name).__file__
  if os.path.basename(path) != '__init__.py':
    return [(os.path.basename(path), path)]
  root = os.path.dirname(path)
  return [(os.path.relpath(os.path.join(d, n), root), os.path.join(d, n))
          for d, _, files in sorted(os.walk(root)) for n in sorted(files) if n.endswith('.py')]


def code_digest(source: str) -> str:
  """sha256 of what a Python source does: its syntax tree without docstrings (comments and
  layout are not in the tree), so documentation edits leave it unchanged."""
  tree = ast.parse(source)
  for node in ast.walk(tree):
    body = getattr(node, 'body', None)
    if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
        and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      node.body = body[1:]
  return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def module_code_hash(module_name: str) -> str:
  """:func:`code_digest` of a module (a package: of every ``.py`` file under it, with its name)."""
  digest = hashlib.sha256()
  for name, path in _module_files(module_name):
    with open(path, encoding='utf-8') as f:
      digest.update(f'{name}\0{code_digest(f.read())}\0'.encode())
  return digest.hexdigest()


def code_hash(modules: Sequence[str]) -> str:
  """One hash of the code of ``modules`` (names like ``'recomp_jax.reader.prompts'``)."""
  return fingerprint({m: module_code_hash(m) for m in sorted(modules)})


def fingerprint_change(old: dict | None, new: dict) -> str:
  """Why a stage's fingerprint changed, from the ``fingerprint_parts`` of both runs: the input
  fields, upstream stages and code modules that differ (a stage finished by code that recorded
  no parts: only that its fingerprint differs)."""
  if not old:
    return 'its fingerprint differs (it was finished by code that recorded no fingerprint parts)'
  reasons = []
  for part, label in (('inputs', 'input'), ('deps', 'upstream stage'), ('code', 'code of')):
    before, after = old.get(part, {}), new.get(part, {})
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
      reasons.append(f"{label} {', '.join(changed)} changed")
  return '; '.join(reasons) or 'its fingerprint differs'


def directory_manifest(directory: str, *, skip: Sequence[str] = ('DONE.json', 'STARTED.json')) -> dict:
  """``{relative path: [size, sha256]}`` of every file under ``directory``."""
  out = {}
  for root, _, files in os.walk(directory):
    for name in files:
      full = os.path.join(root, name)
      rel = os.path.relpath(full, directory)
      if rel in skip:
        continue
      out[rel] = [os.path.getsize(full), sha256_file(full)]
  return dict(sorted(out.items()))


def manifest_problems(directory: str, manifest: dict) -> list[str]:
  """Files of ``manifest`` that are missing or whose size or sha256 changed (sizes first: cheap)."""
  problems = []
  for rel, (size, digest) in manifest.items():
    full = os.path.join(directory, rel)
    if not os.path.exists(full):
      problems.append(f'{full} is missing')
    elif os.path.getsize(full) != size:
      problems.append(f'{full} has {os.path.getsize(full)} bytes, {size} when the stage finished')
  if problems:
    return problems
  for rel, (size, digest) in manifest.items():
    full = os.path.join(directory, rel)
    if sha256_file(full) != digest:
      problems.append(f'{full} changed since the stage finished (sha256 differs)')
  return problems


def _intact_records(path: str, key: str) -> tuple[dict[str, dict], int]:
  """The complete records of a JSONL file by ``key``, and the bytes they span (a truncated or
  unparsable line ends the file: a kill mid-write)."""
  records: dict[str, dict] = {}
  good_bytes = 0
  if os.path.exists(path):
    with open(path, 'rb') as f:
      for raw in f:
        if not raw.endswith(b'\n'):
          break
        try:
          record = json.loads(raw)
        except json.JSONDecodeError:
          break
        records[str(record[key])] = record
        good_bytes += len(raw)
  return records, good_bytes


def read_records(path: str, key: str = 'id') -> dict[str, dict]:
  """The intact records of a :class:`ResumableJsonl` file, read-only (on any one process)."""
  return _intact_records(path, key)[0]


class ResumableJsonl:
  """An append-only JSONL file of records keyed by ``key``; survives being killed.

  Records are flushed and fsynced per :meth:`append`. On open, a truncated last
  line (a kill mid-write) is dropped and the file is cut back to the last
  complete record.
  """

  def __init__(self, path: str, key: str = 'id'):
    self.path = path
    self.key = key
    self._writer = sharding.is_main_process()
    self.records, good_bytes = _intact_records(path, key)
    if os.path.exists(path):
      if good_bytes != os.path.getsize(path) and self._writer:
        logging.warning('%s: dropping a partially written last record', path)
        with open(path, 'r+b') as f:
          f.truncate(good_bytes)
    self._file = None
    if self._writer:
      os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
      self._file = open(path, 'a', encoding='utf-8')
    # Every process must resume from the same records before process 0 appends more: so every
    # process opens it, in the same order (a read on one process alone: read_records). The tag
    # names the stage and file only: each process may have its own mirror of a remote workdir.
    sharding.sync_processes('resumable ' + '/'.join(os.path.abspath(path).split(os.sep)[-2:]))

  def __contains__(self, key: str) -> bool:
    return str(key) in self.records

  def __len__(self) -> int:
    return len(self.records)

  def append(self, record: dict) -> None:
    """Adds ``record``; process 0 writes it through to disk, the others keep it in memory."""
    if self._file is not None:
      self._file.write(json.dumps(record, ensure_ascii=False) + '\n')
      self._file.flush()
      os.fsync(self._file.fileno())
    self.records[str(record[self.key])] = record

  def extend(self, records: Iterable[dict]) -> None:
    for record in records:
      self.append(record)

  def close(self) -> None:
    if self._file is not None:
      self._file.close()


def map_resumable(path: str, examples: Sequence, compute: Callable[[list], Sequence[dict]], *,
                  chunk: int, desc: str) -> dict[str, dict]:
  """Per-example work that survives being killed: ``compute`` over the examples not yet in ``path``.

  ``compute(part)`` returns one record (a dict) per example of ``part``, in order. Each is
  stored under its example's ``id`` and appended to the :class:`ResumableJsonl` at ``path``
  as soon as its chunk of ``chunk`` examples finishes, so a killed run resumes after the last
  finished chunk and computes nothing twice. A progress bar named ``desc`` counts the work.

  Returns:
    ``{example.id: record}`` for every example, in the order of ``examples``, resumed records
    included.
  """
  out = ResumableJsonl(path)
  todo = [e for e in examples if e.id not in out]
  if todo and len(out):
    logging.info('%s: %d records already in %s, %d to go', desc, len(out), path, len(todo))
  with progress(len(todo), desc) as bar:
    for part in batched(todo, chunk):
      records = list(compute(part))
      if len(records) != len(part):
        raise ValueError(f'{desc}: {len(records)} records for a chunk of {len(part)} examples')
      for e, record in zip(part, records):
        out.append({'id': e.id, **record})
      bar.update(len(part))
  out.close()
  return {e.id: out.records[e.id] for e in examples}


def unfinished_attempts_seconds(directory: str, started: dict) -> float:
  """Seconds spent by the killed attempts at a stage that a new attempt continues.

  ``started`` is the ``STARTED.json`` the last attempt wrote: its ``started_at`` and the
  ``earlier_seconds`` of the attempts before it. The last attempt is counted from its start to
  the newest file it left in ``directory``, so the time after its last write is not counted
  (a lower bound). 0 without a ``started_at`` (older code).
  """
  earlier = float(started.get('earlier_seconds', 0.0))
  start = started.get('started_at')
  if start is None:
    return earlier
  newest = max((os.path.getmtime(os.path.join(root, n)) for root, _, files in os.walk(directory)
                for n in files if n != 'STARTED.json'), default=start)
  return earlier + max(0.0, newest - start)


def costs_table(costs: Sequence[dict]) -> dict:
  """An extra table of :meth:`StageRunner.costs`: every stage's minutes (the attempt that
  finished it, and all attempts, killed ones included) and peak resident memory, and the totals."""
  rows = [[c['stage'], f"{c['seconds'] / 60:.1f}", f"{c['seconds_all_attempts'] / 60:.1f}",
           '-' if c['peak_resident_gb'] is None else f"{c['peak_resident_gb']:.1f}",
           'this run' if c['this_run'] else 'an earlier run'] for c in costs]
  rows.append(['all stages', f"{sum(c['seconds'] for c in costs) / 60:.1f}",
               f"{sum(c['seconds_all_attempts'] for c in costs) / 60:.1f}", '-', '-'])
  return {'title': 'Stage costs (minutes of the attempt that finished each stage, and of all its attempts)',
          'header': ['stage', 'minutes', 'minutes, all attempts', 'peak resident (GB)', 'finished in'], 'rows': rows}


@dataclasses.dataclass
class StageRunner:
  """Runs named stages in a workdir, skipping the finished ones.

  Attributes:
    workdir: root of the run.
    force: names of stages to rerun from scratch (``'all'`` for every stage).
    timings: stage name -> seconds of this run (0 for skipped stages).
    earlier_seconds: stage name -> seconds spent on it by killed earlier attempts that this
      run continues (:func:`unfinished_attempts_seconds`).
    remote: the remote workdir that ``workdir`` mirrors (:mod:`recomp_jax.storage`), or None.
  """
  workdir: str
  force: tuple[str, ...] = ()
  timings: dict[str, float] = dataclasses.field(default_factory=dict)
  fingerprints: dict[str, str] = dataclasses.field(default_factory=dict)
  earlier_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
  remote: str | None = None

  def stage_dir(self, name: str) -> str:
    return os.path.join(self.workdir, 'stages', name)

  def remote_stage_dir(self, name: str) -> str:
    return storage.join(self.remote, 'stages', name)

  # ------------------------------------------------------------------------- remote mirror

  def _pull(self, name: str, directory: str, fp: str, forced: bool) -> None:
    """Process 0: a finished remote stage with this fingerprint replaces a missing or stale
    local one; a remote stage with another fingerprint (or a forced one) is deleted."""
    remote = self.remote_stage_dir(name)
    done = storage.read_json_or_none(storage.join(remote, 'DONE.json'))
    started = storage.read_json_or_none(storage.join(remote, 'STARTED.json'))
    remote_fp = (done or started or {}).get('fingerprint')
    if remote_fp is None:
      return
    if forced or remote_fp != fp:
      logging.info('stage %s: removing the remote copy of another run (%s)', name, remote)
      storage.remove_tree(remote)
      return
    if done is None:
      return  # unfinished remotely: its checkpoints (if any) are resumed where they lie
    local = self._read_done(name)
    if (local is not None and local.get('fingerprint') == fp
        and not manifest_problems(directory, local.get('manifest', {}))):
      return
    nbytes = storage.download_tree(remote, directory, skip=('checkpoints',))
    logging.info('stage %s: downloaded the finished stage from %s (%.1f MB)', name, remote, nbytes / 1e6)

  def _push(self, name: str, directory: str, *, finished: bool) -> None:
    """Process 0: uploads the stage directory (``DONE.json`` last when ``finished``) and the
    files at the top of the workdir."""
    remote = self.remote_stage_dir(name)
    if finished:
      done = storage.read_json_or_none(storage.join(remote, 'DONE.json'))
      local = self._read_done(name) or {}
      if done is not None and done.get('manifest') == local.get('manifest') \
          and done.get('fingerprint') == local.get('fingerprint'):
        return  # the remote copy is this one
    nbytes = storage.upload_tree(directory, remote, last=('DONE.json',) if finished else ())
    self.push_top_files()
    logging.info('stage %s: uploaded to %s (%.1f MB)', name, remote, nbytes / 1e6)

  def push_top_files(self, names: Sequence[str] | None = None) -> None:
    """Process 0: uploads the regular files at the top of the workdir (or those named)."""
    if self.remote is None or not sharding.is_main_process():
      return
    names = names if names is not None else sorted(
        n for n in os.listdir(self.workdir) if os.path.isfile(os.path.join(self.workdir, n)))
    storage.upload(self.workdir, self.remote, [n for n in names
                                               if os.path.isfile(os.path.join(self.workdir, n))])

  def _fetch_on_other_processes(self, name: str, directory: str) -> None:
    """Processes other than 0 (own mirrors): copy what process 0 has just uploaded."""
    if self.remote is None or sharding.is_main_process():
      return
    remote = self.remote_stage_dir(name)
    done = storage.read_json_or_none(storage.join(remote, 'DONE.json'))
    if done is not None and done == self._read_done(name) \
        and not manifest_problems(directory, done.get('manifest', {})):
      return  # this machine's mirror has it already
    storage.download_tree(remote, directory, skip=('checkpoints',))

  def stage_fingerprint(self, inputs: Any, deps: Sequence[str] = (), code: Sequence[str] = ()) -> str:
    missing = [d for d in deps if d not in self.fingerprints]
    if missing:
      raise RuntimeError(f'stage dependencies {missing} have not run in this StageRunner')
    return fingerprint({'inputs': inputs, 'deps': {d: self.fingerprints[d] for d in deps},
                        'code': code_hash(code) if code else ''})

  def fingerprint_parts(self, inputs: Any, deps: Sequence[str] = (), code: Sequence[str] = ()) -> dict:
    """What :meth:`stage_fingerprint` hashes, part by part (recorded, so a rerun can say why)."""
    return {'inputs': {k: fingerprint(v) for k, v in inputs.items()} if isinstance(inputs, dict)
            else {'': fingerprint(inputs)},
            'deps': {d: self.fingerprints[d] for d in deps},
            'code': {m: module_code_hash(m)[:16] for m in sorted(code)}}

  def _read_done(self, name: str) -> dict | None:
    marker = os.path.join(self.stage_dir(name), 'DONE.json')
    if not os.path.exists(marker):
      return None
    try:
      with open(marker) as f:
        return json.load(f)
    except (OSError, json.JSONDecodeError):
      logging.warning('stage %s: %s is unreadable; rerunning the stage', name, marker)
      return None

  def summary(self, name: str) -> dict:
    with open(os.path.join(self.stage_dir(name), 'DONE.json')) as f:
      return json.load(f)['summary']

  def costs(self) -> list[dict]:
    """What each stage this runner met cost, in the order it met them.

    One ``{'stage', 'seconds', 'seconds_all_attempts', 'peak_resident_gb', 'this_run'}`` per
    stage, as the stage's ``DONE.json`` recorded it when it finished (in this run or an
    earlier one: ``this_run`` says which): the seconds of the attempt that finished it, those
    plus the killed attempts it continued (:func:`unfinished_attempts_seconds`; stages
    finished by older code record no killed attempts), and the finishing attempt's peak
    resident set.
    """
    out = []
    for name in self.timings:
      done = self._read_done(name) or {}
      seconds = float(done.get('seconds', self.timings[name]))
      peak = done.get('peak_resident_bytes')
      out.append({'stage': name, 'seconds': seconds,
                  'seconds_all_attempts': float(done.get('seconds_all_attempts', seconds)),
                  'peak_resident_gb': None if peak is None else round(peak / 1e9, 1),
                  'this_run': self.timings[name] > 0})
    return out

  def run(self, name: str, inputs: Any, fn: Callable[[str], dict], *, deps: Sequence[str] = (),
          code: Sequence[str] = (), resumable: bool = False, collective: bool = True) -> dict:
    """Runs ``fn(stage_dir) -> summary`` unless the stage finished with the same fingerprint.

    Args:
      name: the stage (its directory is ``stages/{name}``).
      inputs: JSON-serialisable description of what the stage reads besides ``deps``.
      fn: does the work into the directory and returns a JSON-serialisable summary.
      deps: names of stages run earlier by this runner whose outputs ``fn`` reads.
      code: modules whose source the stage's result depends on.
      resumable: ``fn`` continues from intact partial files (append-only records), so a
        damaged finished stage keeps its directory instead of starting afresh.
      collective: ``fn`` runs on every process (it computes with the sharded models);
        False runs it on process 0 alone (file work, teacher API calls) while the
        others wait. The same on one process.

    A stage whose fingerprint changed, or that is forced, starts from an empty directory;
    an unfinished one with the same fingerprint is continued.
    """
    directory = self.stage_dir(name)
    fp = self.stage_fingerprint(inputs, deps, code)
    self.fingerprints[name] = fp
    main = sharding.is_main_process()
    skip = main and self._prepare(name, directory, fp, inputs, deps, code, resumable)
    many = self.remote is not None and sharding.process_count() > 1
    if main and self.remote is not None and (skip or many):
      self._push(name, directory, finished=skip)  # skip: the remote copy may lack it
    if sharding.broadcast_from_main(skip):  # process 0 has decided and prepared the directory
      if many:
        self._fetch_on_other_processes(name, directory)
      self.timings[name] = 0.0
      return self.summary(name)
    if many:
      self._fetch_on_other_processes(name, directory)  # the partial records process 0 resumes from
    if main or collective:
      logging.info('stage %s: running (%s)', name, directory)
    else:
      logging.info('stage %s: process 0 runs it; waiting', name)
    start = time.time()
    allocator.reset_peak_resident()
    resident_at_start = allocator.resident_bytes()
    summary = fn(directory) if (main or collective) else None
    peak = allocator.peak_resident_bytes()
    sharding.sync_processes(f'stage {name}: computed')  # every process's work is in the files
    seconds = time.time() - start
    self.timings[name] = seconds
    if main:
      record = {'fingerprint': fp, 'fingerprint_parts': self.fingerprint_parts(inputs, deps, code),
                'seconds': seconds,
                'seconds_all_attempts': seconds + self.earlier_seconds.get(name, 0.0),
                'peak_resident_bytes': peak, 'summary': summary, 'manifest': directory_manifest(directory)}
      tmp = os.path.join(directory, 'DONE.json.tmp')
      with open(tmp, 'w') as f:
        json.dump(record, f, default=str, indent=2)
      os.replace(tmp, os.path.join(directory, 'DONE.json'))
      if self.remote is not None:
        self._push(name, directory, finished=True)
    sharding.sync_processes(f'stage {name}: done')
    if many:
      self._fetch_on_other_processes(name, directory)
    if summary is None:
      summary = self.summary(name)
    memory = allocator.release_if_grown(resident_at_start)
    if memory is None:
      logging.info('stage %s: finished in %.1fs (peak resident %.1f GB)', name, seconds, peak / 1e9)
    else:
      logging.info('stage %s: finished in %.1fs (peak resident %.1f GB; %s: resident %.1f -> %.1f GB)', name,
                   seconds, peak / 1e9, memory['allocator'], memory['rss_before'] / 1e9, memory['rss_after'] / 1e9)
    maps = allocator.drop_compiled_near_map_limit()
    if maps['cleared']:
      logging.info('stage %s: %d of the kernel\'s %d memory mappings in use; compiled functions dropped (%d left)',
                   name, maps['maps'], maps['limit'], maps['maps_after'])
    return summary

  def _prepare(self, name: str, directory: str, fp: str, inputs: Any, deps: Sequence[str],
               code: Sequence[str], resumable: bool) -> bool:
    """Process 0's decision: True to skip the finished stage; else readies its directory."""
    forced = name in self.force or 'all' in self.force
    if self.remote is not None:
      self._pull(name, directory, fp, forced)
    done = None if forced else self._read_done(name)
    damaged = False
    if done is not None and done.get('fingerprint') == fp:
      problems = manifest_problems(directory, done.get('manifest', {}))
      if not problems:
        logging.info('stage %s: done, skipped (%s)', name, directory)
        return True
      damaged = True
      logging.warning('stage %s: damaged output, recomputing: %s', name, '; '.join(problems))
      os.remove(os.path.join(directory, 'DONE.json'))
    if done is not None and done.get('fingerprint') != fp:
      logging.warning('stage %s: the finished stage in %s is not reused: %s; recomputing', name, directory,
                      fingerprint_change(done.get('fingerprint_parts'), self.fingerprint_parts(inputs, deps, code)))
    started_file = os.path.join(directory, 'STARTED.json')
    previous = {}
    if os.path.exists(started_file):
      try:
        with open(started_file) as f:
          previous = json.load(f)
      except (OSError, json.JSONDecodeError):
        previous = {}
    cleared = forced or (damaged and not resumable) or (os.path.exists(directory) and previous.get('fingerprint') != fp)
    if cleared:
      shutil.rmtree(directory, ignore_errors=True)
    self.earlier_seconds[name] = 0.0 if cleared or damaged else unfinished_attempts_seconds(directory, previous)
    os.makedirs(directory, exist_ok=True)
    with open(started_file, 'w') as f:
      json.dump({'fingerprint': fp, 'fingerprint_parts': self.fingerprint_parts(inputs, deps, code),
                 'inputs': inputs, 'deps': list(deps), 'code': list(code),
                 'started_at': time.time(), 'earlier_seconds': self.earlier_seconds[name]}, f,
                default=str, indent=2)
    if self.remote is not None:  # marks the remote stage (and its checkpoints) as this run's
      storage.upload(directory, self.remote_stage_dir(name), ['STARTED.json'])
    return False


def progress(total: int, desc: str):
  """A tqdm bar over ``total`` items, shown on process 0 only and only when there is work."""
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, desc=desc, dynamic_ncols=True, disable=not total or not sharding.is_main_process())


def batched(items: list, size: int) -> Iterator[list]:
  for i in range(0, len(items), size):
    yield items[i:i + size]
