"""FILCO on HotpotQA: silver contexts -> filter model -> generator trained on filtered context.

Presets (``--config=configs/hotpotqa_filco.py:PRESET``; details in
``recomp_jax.pipelines.filco.experiment``):
  paper:  the hub data, FLAN-T5-XL filter model and generator, top-1 passage; each question's own
          10 distractor-setting paragraphs (both supporting ones among them), not open retrieval.
  shared: ``../shared/data/hotpotqa/dev500_ircot.jsonl`` (the same setting), its last 100
          questions held out, Gemma 3 270M filter model and generators.
  demo:   the whole pipeline offline in minutes on questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).
"""

from recomp_jax.pipelines.filco import experiment


def get_config(preset: str = 'demo'):
  return experiment('hotpotqa', preset)
