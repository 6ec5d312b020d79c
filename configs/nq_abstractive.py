"""RECOMP abstractive compressor on Natural Questions (teacher summaries -> critic -> fine-tuned compressor).

Presets (``--config=configs/nq_abstractive.py:PRESET``):
  paper:  the hub data, gpt-3.5-turbo teacher (``$OPENAI_API_KEY``), t5-large compressor.
  shared: ``../shared/data`` with its held-out eval set, the offline teacher (our own
          server on the PyPI Gemma 3 270M) and a Gemma 3 270M compressor.
  demo:   the whole pipeline offline in minutes on questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).
"""

from recomp_jax.pipelines import defaults
from recomp_jax.pipelines.abstractive import default_config, demo_sizes, paper_models, shared_sizes


def get_config(preset: str = 'demo'):
  c = default_config()
  c.preset = preset
  c.workdir = f'workdirs/nq_abstractive_{preset}'
  if preset == 'paper':
    defaults.dataset_data(c, 'nq', 'paper')
    paper_models(c)
  elif preset == 'shared':
    defaults.dataset_data(c, 'nq', 'shared')
    shared_sizes(c)
  elif preset in ('demo', 'ci'):
    defaults.demo_data(c, 'nq', (64, 16, 32) if preset == 'demo' else (16, 8, 8))
    demo_sizes(c, preset == 'demo')
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared, demo, ci')
  return c
