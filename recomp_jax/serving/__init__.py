"""The OpenAI-compatible server behind ``python -m recomp_jax.serve``.

``engine`` batches concurrent requests into jitted generation, ``chat`` renders chat
messages into a prompt, ``api`` is the FastAPI application (needs the ``serve`` extra).
"""
