"""recomp_jax: Retrieve, Compress, Prepend — document compressors for retrieval-augmented LMs."""

__version__ = '0.1.0'
