"""Converts any supported checkpoint into a plain Hugging Face directory.

    python -m recomp_jax.convert SRC OUT [--dtype float32|bfloat16] [--overwrite]

``SRC`` is anything :func:`recomp_jax.pretrained.load_pretrained` reads: a
Hugging Face directory, a hub id (when the hub is reachable), a
sentence-transformers directory or a ``*.gguf`` file. It is loaded into our
Flax model (so every tensor passes through our weight map and shape checks)
and written with :func:`recomp_jax.pretrained.export_pretrained`:
``config.json``, safetensors and the tokenizer, which ``transformers`` loads
with the same outputs as the source. A bad source exits with status 2 and a
message naming the offending file.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from recomp_jax.pretrained import Pretrained, export_pretrained, load_pretrained
from recomp_jax.pretrained.hf import CheckpointError

_DTYPES = {'float32': np.dtype(np.float32), 'bfloat16': np.dtype(jnp.bfloat16)}


def convert(src: str, out: str, *, dtype: str = 'float32', gguf_cache_dir: str | None = None,
            overwrite: bool = False) -> Pretrained:
  """Loads ``src`` through our model and writes it to ``out`` as a HF directory.

  Args:
    src: the source checkpoint.
    out: the output directory (created; must be empty unless ``overwrite``).
    dtype: storage dtype of the written weights (``'float32'`` or ``'bfloat16'``).
    gguf_cache_dir: cache root for GGUF conversions (see ``pretrained.gguf``).
    overwrite: allow writing into a non-empty ``out``.
  Returns:
    the loaded model (float32 parameters).
  Raises:
    CheckpointError: on an unreadable source or an unusable ``out``.
  """
  src, out = os.path.expanduser(src), os.path.expanduser(out)
  if dtype not in _DTYPES:
    raise CheckpointError(f'unsupported --dtype {dtype!r}; choose from {sorted(_DTYPES)}')
  if not os.path.exists(src) and (os.path.isabs(src) or src.startswith(('.', '~'))):
    raise CheckpointError(f'{src}: no such file or directory')
  if os.path.exists(src) and os.path.realpath(src) == os.path.realpath(out):
    raise CheckpointError(f'{out}: the output directory is the source')
  if os.path.exists(out) and not os.path.isdir(out):
    raise CheckpointError(f'{out}: exists and is not a directory')
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise CheckpointError(f'{out}: exists and is not empty (pass --overwrite to write into it)')
  pretrained = load_pretrained(src, dtype=jnp.float32, param_dtype=jnp.float32,
                              gguf_cache_dir=gguf_cache_dir)
  export_pretrained(pretrained, out, dtype=_DTYPES[dtype])
  config_path = os.path.join(out, 'config.json')
  with open(config_path) as f:
    config = json.load(f)
  config['dtype'] = dtype  # what transformers' dtype='auto' loads the weights as
  with open(config_path, 'w') as f:
    json.dump(config, f, indent=2)
  return pretrained


def _parse(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
      prog='python -m recomp_jax.convert',
      description='Convert a HF / sentence-transformers / GGUF checkpoint to a Hugging Face '
                  'directory through recomp_jax\'s Flax models.')
  parser.add_argument('src', help='HF directory, hub id, sentence-transformers directory or .gguf')
  parser.add_argument('out', help='output directory')
  parser.add_argument('--dtype', choices=sorted(_DTYPES), default='float32',
                      help='storage dtype of the written weights (default: float32)')
  parser.add_argument('--gguf-cache-dir', default=None,
                      help='where GGUF conversions are cached (default: $RECOMP_JAX_CACHE/gguf '
                           'or ~/.cache/recomp_jax/gguf)')
  parser.add_argument('--overwrite', action='store_true', help='write into a non-empty OUT')
  return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
  """CLI entry point; returns the exit status (0 ok, 2 bad input)."""
  args = _parse(argv)
  start = time.perf_counter()
  try:
    pretrained = convert(args.src, args.out, dtype=args.dtype, gguf_cache_dir=args.gguf_cache_dir,
                         overwrite=args.overwrite)
  except (CheckpointError, OSError, ValueError) as e:  # CheckpointError names the file
    print(f'error: {e}', file=sys.stderr)
    return 2
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(pretrained.model, nnx.Param)))
  print(f'wrote {pretrained.family.name} ({n_params / 1e6:.1f}M parameters, {args.dtype}) from '
        f'{args.src} to {args.out} in {time.perf_counter() - start:.1f} s')
  if pretrained.pooling is not None:
    print(f'note: the sentence-transformers pooling of {args.src} ({pretrained.pooling}) is not '
          'part of a HF model directory and was not written')
  return 0


if __name__ == '__main__':
  sys.exit(main())
