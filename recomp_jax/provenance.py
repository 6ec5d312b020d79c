"""Where a number came from: git state, package source hash, library versions, data hashes.

Every result file (``../shared/specs/results_schema.md``) records these so that a number can
be traced to a commit, a config and the exact input files.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
from typing import Sequence

from recomp_jax.stages import file_fingerprint, fingerprint, module_source_hash

PACKAGE_ROOT = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(PACKAGE_ROOT)
_VERSIONED = ('jax', 'jaxlib', 'flax', 'optax', 'orbax-checkpoint', 'numpy', 'transformers',
              'tokenizers', 'ml-collections')


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(['git', *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                         check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip()


def git_state() -> dict:
  """``{'git_commit': 40-hex sha or 'unknown', 'dirty': bool}`` of the checkout holding the package.

  ``dirty`` is true when tracked files differ from the commit (untracked files such as
  workdirs do not count).
  """
  commit = _git('rev-parse', 'HEAD')
  if not commit:
    return {'git_commit': 'unknown', 'dirty': True}
  status = _git('status', '--porcelain', '--untracked-files=no')
  return {'git_commit': commit, 'dirty': bool(status)}


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
  """sha256 of every ``.py`` file of the ``recomp_jax`` package."""
  return module_source_hash('recomp_jax')


def versions() -> dict[str, str]:
  """Python, platform and the versions of the libraries a result depends on."""
  out = {'python': platform.python_version(), 'platform': platform.platform()}
  for name in _VERSIONED:
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return out


def data_hashes(paths: Sequence[str]) -> dict[str, str]:
  """``{path as given: sha256}`` of input files (see :func:`file_fingerprint`)."""
  return {p: file_fingerprint(p)['sha256'] for p in paths if p}


__all__ = ['data_hashes', 'fingerprint', 'git_state', 'source_hash', 'versions']
