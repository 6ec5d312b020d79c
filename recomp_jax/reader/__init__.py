"""The reader LM: one facade for log-likelihood, greedy answers and exact match (Gemma or T5).

``reader.py`` holds :class:`Reader`; ``prompts.py`` the reader prompt protocol; ``scoring.py``
the sharded jitted log-likelihood functions behind :meth:`Reader.loglik`. ``Reader`` is
imported on first use, so the prompt protocol can be read without loading JAX.
"""

__all__ = ['Reader']


def __getattr__(name):
  if name == 'Reader':
    from recomp_jax.reader.reader import Reader  # pylint: disable=import-outside-toplevel
    return Reader
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
