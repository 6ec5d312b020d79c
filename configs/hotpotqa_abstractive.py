"""RECOMP abstractive compressor on HotpotQA (teacher summaries -> critic -> fine-tuned compressor).

Presets (``--config=configs/hotpotqa_abstractive.py:PRESET``; details in
``recomp_jax.pipelines.abstractive.experiment``):
  paper:  the hub data, gpt-3.5-turbo teacher (``$OPENAI_API_KEY``), t5-large compressor; each
          question's own 10 distractor-setting paragraphs (both supporting ones among them), not
          the paper's retrieval from Wikipedia.
  shared: ``../shared/data/hotpotqa/dev500_ircot.jsonl`` (the same setting), its last 100
          questions held out, the offline teacher (our own
          server on the PyPI Gemma 3 270M) and a Gemma 3 270M compressor.
  demo:   the whole pipeline offline in minutes on questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).
"""

from recomp_jax.pipelines.abstractive import experiment


def get_config(preset: str = 'demo'):
  return experiment('hotpotqa', preset)
