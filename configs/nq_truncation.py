"""The length-matched truncation baseline on Natural Questions: the first k tokens of the top documents.

Presets (``--config=configs/nq_truncation.py:PRESET``):
  shared: ``../shared/data`` with its held-out eval set.
  demo:   offline questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).

k: ``truncation.tokens``, or with ``--config.truncation.match_results=results/X.json`` the
mean evidence tokens of that file's ``truncation.match_row`` (default ``trained``).
"""

from recomp_jax.pipelines.defaults import config_for, dataset_data, demo_data
from recomp_jax.pipelines.truncation import FIELDS


def get_config(preset: str = 'demo'):
  c = config_for('truncation', FIELDS)
  c.preset = preset
  c.workdir = f'workdirs/nq_truncation_{preset}'
  c.train.epochs = 0.0  # nothing is trained
  if preset == 'shared':
    dataset_data(c, 'nq', 'shared')
  elif preset in ('demo', 'ci'):
    demo_data(c, 'nq', (64, 16, 32) if preset == 'demo' else (4, 2, 6))
  else:
    raise ValueError(f'unknown preset {preset!r}; available: shared, demo, ci')
  return c
