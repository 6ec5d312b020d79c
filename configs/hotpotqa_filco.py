"""FILCO on HotpotQA: silver contexts -> filter model -> generator trained on filtered context.

Presets (``--config=configs/hotpotqa_filco.py:PRESET``):
  paper:  the hub data, FLAN-T5-XL filter model and generator, top-1 passage; each question's own
          10 distractor-setting paragraphs (both supporting ones among them), not open retrieval.
  shared: ``../shared/data/hotpotqa/dev500_ircot.jsonl`` (the same setting), its last 100
          questions held out, Gemma 3 270M filter model and generators.
  demo:   the whole pipeline offline in minutes on questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).
"""

from recomp_jax.pipelines import defaults
from recomp_jax.pipelines.filco import default_config, demo_sizes, paper_models, shared_sizes


def get_config(preset: str = 'demo'):
  c = default_config()
  c.preset = preset
  c.workdir = f'workdirs/hotpotqa_filco_{preset}'
  c.filco.measure = 'cxmi'  # §4: STRINC for NQ and TQA, LEXICAL for FEVER, CXMI for WoW and HotpotQA
  if preset == 'paper':
    defaults.dataset_data(c, 'hotpotqa', 'paper')
    paper_models(c)
  elif preset == 'shared':
    defaults.dataset_data(c, 'hotpotqa', 'shared')
    shared_sizes(c)
  elif preset in ('demo', 'ci'):
    defaults.demo_data(c, 'hotpotqa', (64, 16, 32) if preset == 'demo' else (12, 4, 6))
    demo_sizes(c, preset == 'demo')
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared, demo, ci')
  return c
