"""recomp_jax: Retrieve, Compress, Prepend — document compressors for retrieval-augmented LMs.

``recomp_jax.load_compressor(path).compress(questions, documents)`` runs any system's exported
compressor (:mod:`recomp_jax.inference`).
"""

__version__ = '0.1.0'


def load_compressor(path: str):
  """:func:`recomp_jax.inference.load_compressor` (imported on first use: ``import recomp_jax`` stays light)."""
  from recomp_jax import inference  # pylint: disable=import-outside-toplevel
  return inference.load_compressor(path)
