"""K-COMP on MedQuAD: a knowledge-injected Gemma compressor for long-form medical QA (kcomp.txt).

Presets (``--config=configs/medquad_kcomp.py:PRESET``; details in
``recomp_jax.pipelines.kcomp.experiment``):
  paper:  Gemma-2B compressor, the teacher at --config.teacher.base_url, roberta-large BERTScore.
  shared: ``../shared/data/medquad`` and its held-out test file (300 questions), Gemma 3 270M.
  demo:   Gemma 3 270M on a few MedQuAD training questions, tested on dev questions (minutes).
  ci:     a few questions (tests).
"""

from recomp_jax.pipelines.kcomp import experiment


def get_config(preset: str = 'shared'):
  return experiment(preset)
