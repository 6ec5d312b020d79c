"""Shared test set-up: offline hub, float32 matmuls, and the real-weight fixtures.

Real-weight models are loaded once per session and shared across test files.
"""

import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')

import jax  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')
