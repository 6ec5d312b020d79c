"""FILCO on Natural Questions: silver contexts -> filter model -> generator trained on filtered context.

Presets (``--config=configs/nq_filco.py:PRESET``; details in
``recomp_jax.pipelines.filco.experiment``):
  paper:  the hub data, FLAN-T5-XL filter model and generator, top-1 passage.
  shared: ``../shared/data`` with its held-out eval set, Gemma 3 270M filter model and generators.
  demo:   the whole pipeline offline in minutes on questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).
"""

from recomp_jax.pipelines.filco import experiment


def get_config(preset: str = 'demo'):
  return experiment('nq', preset)
