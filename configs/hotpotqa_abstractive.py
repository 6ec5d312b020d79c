"""RECOMP abstractive compressor on HotpotQA (teacher summaries -> critic -> fine-tuned compressor).

Presets (``--config=configs/hotpotqa_abstractive.py:PRESET``; details in
``recomp_jax.pipelines.abstractive.experiment``):
  paper:  the hub data, gpt-3.5-turbo teacher (``$OPENAI_API_KEY``), t5-large compressor.
  shared: ``../shared/data`` with its held-out eval set, the offline teacher (our own
          server on the PyPI Gemma 3 270M) and a Gemma 3 270M compressor.
  demo:   the whole pipeline offline in minutes on questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).
"""

from recomp_jax.pipelines.abstractive import experiment


def get_config(preset: str = 'demo'):
  return experiment('hotpotqa', preset)
