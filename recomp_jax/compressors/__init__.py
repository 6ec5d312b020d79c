"""Compressor systems: the method of each (labels, training data, loss, ``compress``) and the
:class:`~recomp_jax.compressors.base.System` protocol the shared runner drives.

``base.py``        System (stages, rows, names) and the Context a system's stages see
``extractive.py``  RECOMP extractive: reader labels, pairs, contrastive / listwise losses, compress
``baselines.py``   BoW, heuristic capitalised-span entities, random sentence
"""
