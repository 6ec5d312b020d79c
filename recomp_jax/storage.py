"""Where a run's files live: a local workdir, or a remote one (``gs://``) mirrored on local disk.

A TPU VM loses its disk when it is preempted or deleted, so on a pod the workdir belongs on
GCS (``--workdir=gs://bucket/run``). Not everything a run writes can be written there as it
is written: a resumable stage appends one record at a time to a JSONL file and fsyncs it, and a
GCS object cannot be appended to. So a remote workdir is **mirrored**:

* every stage computes in a local mirror directory (:func:`mirror_root`: under
  ``~/.cache/recomp_jax/workdirs/``, one per remote workdir and process, or the directory
  given with ``--local_workdir``);
* a finished stage is uploaded file by file, its ``DONE.json`` last, so a remote stage with a
  ``DONE.json`` is complete (:meth:`recomp_jax.stages.StageRunner` does this);
* a rerun on a fresh machine downloads each finished stage whose fingerprint matches instead
  of computing it, and checks it against the stage's manifest as it does any local stage;
* training checkpoints go straight to the remote workdir (Orbax writes ``gs://`` natively,
  :func:`durable_path`), so a preempted training stage resumes from its last checkpoint;
* the result files are uploaded at the end (``results.json``, ``results.md``,
  ``predictions.jsonl``, ``tensorboard/``).

What a preemption loses: the unfinished part of a stage that is not training (labelling or
evaluation records since the stage began), which the new machine recomputes.

Remote paths go through :mod:`etils.epath`, which reads ``gs://`` through ``tensorflow``
(the ``[tf]`` extra) or ``gcsfs`` (``pip install gcsfs`` at the version matching the installed
``fsspec``); a local directory can stand in for the remote one (tests do).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Iterable

_MIRRORS: dict[str, str] = {}  # local mirror root -> remote workdir


def is_remote(path: str) -> bool:
  """True for a URL-style path (``gs://``, ``s3://``, ...), which this process cannot append to."""
  return '://' in os.fspath(path)


def _epath(path: str):
  from etils import epath  # pylint: disable=import-outside-toplevel
  return epath.Path(path)


def _files(directory: str) -> list[tuple[tuple[str, ...], object]]:
  """``(relative path parts, epath)`` of every file under ``directory``, sorted (none if missing).

  Walks directory by directory: ``gs://`` has no recursive glob.
  """
  root = _epath(directory)
  if not root.exists():
    return []
  out = []
  for folder, _, names in root.walk():
    for name in names:
      path = folder / name
      out.append((path.relative_to(root).parts, path))
  return sorted(out, key=lambda item: item[0])


def mirror_root(remote: str, local: str | None = None, *, process_index: int = 0) -> str:
  """The local directory that mirrors ``remote``.

  Args:
    remote: the remote workdir.
    local: the directory to use (``--local_workdir``); by default
      ``~/.cache/recomp_jax/workdirs/<last part>-<hash of remote>``.
    process_index: this process; every process but 0 gets its own ``process<k>``
      subdirectory, so processes sharing one machine never write into each other's mirror.
  """
  if not local:
    tail = os.path.basename(remote.rstrip('/')) or 'run'
    digest = hashlib.sha256(remote.encode()).hexdigest()[:10]
    cache = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    local = os.path.join(cache, 'recomp_jax', 'workdirs', f'{tail}-{digest}')
  local = os.path.abspath(os.path.expanduser(local))
  return local if process_index == 0 else f'{local}-process{process_index}'


def register_mirror(local: str, remote: str) -> None:
  """Records that ``local`` mirrors ``remote``, for :func:`durable_path`."""
  _MIRRORS[os.path.abspath(local)] = remote.rstrip('/')


def unregister_mirror(local: str) -> None:
  _MIRRORS.pop(os.path.abspath(local), None)


def remote_of(local_path: str) -> str | None:
  """The remote counterpart of a path inside a registered mirror, or None."""
  path = os.path.abspath(os.fspath(local_path))
  for root, remote in sorted(_MIRRORS.items(), key=lambda kv: -len(kv[0])):
    if path == root or path.startswith(root + os.sep):
      rel = os.path.relpath(path, root)
      return remote if rel == '.' else remote + '/' + rel.replace(os.sep, '/')
  return None


def durable_path(local_path: str) -> str:
  """Where files that must survive the machine go: the remote counterpart of ``local_path``
  when it lies in a mirrored workdir (training checkpoints), else ``local_path`` itself."""
  return remote_of(local_path) or os.fspath(local_path)


def join(base: str, *parts: str) -> str:
  """``os.path.join`` for local paths, ``/``-joined for remote ones."""
  if is_remote(base):
    return '/'.join([base.rstrip('/'), *(p.strip('/') for p in parts)])
  return os.path.join(base, *parts)


def exists(path: str) -> bool:
  return _epath(path).exists() if is_remote(path) else os.path.exists(path)


def read_json_or_none(path: str) -> dict | None:
  """The JSON object at ``path``, or None when it is missing or unreadable."""
  try:
    return json.loads(_epath(path).read_text())
  except (OSError, ValueError):
    return None


def tree_size(path: str) -> int:
  """Total bytes of the files under ``path`` (0 when it does not exist)."""
  if not is_remote(path):
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, names in os.walk(path) for name in names)
  return sum(file.stat().length for _, file in _files(path))


def remove_tree(path: str) -> None:
  """Deletes a directory tree, local or remote; a missing one is fine."""
  if not is_remote(path):
    shutil.rmtree(path, ignore_errors=True)
    return
  root = _epath(path)
  if root.exists():
    root.rmtree()


def upload(local_dir: str, remote_dir: str, files: Iterable[str]) -> int:
  """Copies ``files`` (paths relative to ``local_dir``) to ``remote_dir`` in the given order;
  returns the bytes copied."""
  copied = 0
  remote = _epath(remote_dir)
  for rel in files:
    source = os.path.join(local_dir, rel)
    target = remote / rel.replace(os.sep, '/')
    target.parent.mkdir(parents=True, exist_ok=True)
    _epath(source).copy(target, overwrite=True)
    copied += os.path.getsize(source)
  return copied


def upload_tree(local_dir: str, remote_dir: str, *, last: Iterable[str] = ()) -> int:
  """Copies every file under ``local_dir`` to ``remote_dir``, the files named in ``last`` after
  all others (a completion marker); returns the bytes copied."""
  last = [rel for rel in last if os.path.exists(os.path.join(local_dir, rel))]
  files = []
  for root, _, names in os.walk(local_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), local_dir)
      if rel not in last:
        files.append(rel)
  return upload(local_dir, remote_dir, sorted(files) + last)


def download_tree(remote_dir: str, local_dir: str, *, skip: Iterable[str] = ()) -> int:
  """Replaces ``local_dir`` with a copy of ``remote_dir`` (minus the top-level entries in
  ``skip``); returns the bytes copied."""
  shutil.rmtree(local_dir, ignore_errors=True)
  os.makedirs(local_dir, exist_ok=True)
  skip = set(skip)
  copied = 0
  for parts, path in _files(remote_dir):
    if parts[0] in skip:
      continue
    target = os.path.join(local_dir, *parts)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    path.copy(_epath(target), overwrite=True)
    copied += os.path.getsize(target)
  return copied


def download_top_files(remote_dir: str, local_dir: str) -> list[str]:
  """Copies the files at the top of ``remote_dir`` that ``local_dir`` lacks (the teacher cache
  of a run resumed on a fresh machine); returns their names."""
  remote = _epath(remote_dir)
  if not remote.exists():
    return []
  os.makedirs(local_dir, exist_ok=True)
  copied = []
  for path in sorted(remote.iterdir()):
    target = os.path.join(local_dir, path.name)
    if path.is_file() and not os.path.exists(target):
      path.copy(_epath(target))
      copied.append(path.name)
  return copied


__all__ = ['download_top_files', 'download_tree', 'durable_path', 'exists', 'is_remote', 'join', 'mirror_root',
           'read_json_or_none', 'register_mirror', 'remote_of', 'remove_tree', 'tree_size',
           'unregister_mirror', 'upload', 'upload_tree']
