"""The length-matched truncation baseline on Natural Questions: the first k tokens of the top documents.

Presets (``--config=configs/nq_truncation.py:PRESET``):
  shared: ``../shared/data`` with its held-out eval set.
  demo:   offline questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).

k: ``truncation.tokens``, or with ``--config.truncation.match_results=results/X.json`` the
mean evidence tokens of that file's ``truncation.match_row`` (default ``trained``).
"""

import ml_collections

from recomp_jax.pipelines.defaults import base_config, dataset_data, demo_data


def get_config(preset: str = 'demo'):
  c = base_config()
  c.system = 'truncation'
  c.preset = preset
  c.workdir = f'workdirs/nq_truncation_{preset}'
  c.truncation = ml_collections.ConfigDict({'tokens': 48, 'match_results': '', 'match_row': 'trained'})
  c.train.epochs = 0.0  # nothing is trained
  if preset == 'shared':
    dataset_data(c, 'nq', 'shared')
  elif preset in ('demo', 'ci'):
    demo_data(c, 'nq', (64, 16, 32) if preset == 'demo' else (4, 2, 6))
  else:
    raise ValueError(f'unknown preset {preset!r}; available: shared, demo, ci')
  return c
