"""The reader LM: one facade for log-likelihood, greedy answers and exact match (Gemma or T5)."""

from recomp_jax.reader.reader import Reader, resolve_demo_model

__all__ = ['Reader', 'resolve_demo_model']
