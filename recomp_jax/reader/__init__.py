"""The reader LM: one facade for log-likelihood, greedy answers and exact match (Gemma or T5).

``reader.py`` holds :class:`Reader`; ``prompts.py`` the reader prompt protocol; ``scoring.py``
the sharded jitted log-likelihood functions behind :meth:`Reader.loglik`.
"""

from recomp_jax.reader.reader import Reader

__all__ = ['Reader']
