"""CoLoR on NQ: passages compressed for long-context-LM retrieval, ORPO with a length term (color.txt).

Presets (``--config=configs/nq_color.py:PRESET``; details in
``recomp_jax.pipelines.color.experiment``):
  paper:  Phi-3-mini compressor, LOFT-size corpora (128k tokens), the teacher at --config.teacher.base_url.
  shared: ``../shared/data/nq`` and its held-out test file (300 queries in ~8k-token corpora), Gemma 3 270M.
  demo:   8 of the 50 demo queries, 8 training queries, 4 steps (the whole pipeline in minutes).
  ci:     a few queries (tests).
"""

from recomp_jax.pipelines.color import experiment


def get_config(preset: str = 'shared'):
  return experiment(preset)
