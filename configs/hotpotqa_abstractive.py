"""RECOMP abstractive compressor on HotpotQA (teacher summaries -> critic -> fine-tuned compressor).

Presets (``--config=configs/hotpotqa_abstractive.py:PRESET``):
  paper:  the hub data, gpt-3.5-turbo teacher (``$OPENAI_API_KEY``), t5-large compressor; each
          question's own 10 distractor-setting paragraphs (both supporting ones among them), not
          the paper's retrieval from Wikipedia.
  shared: ``../shared/data/hotpotqa/dev500_ircot.jsonl`` (the same setting), its last 100
          questions held out, the offline teacher (our own
          server on the PyPI Gemma 3 270M) and a Gemma 3 270M compressor.
  demo:   the whole pipeline offline in minutes on questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).
"""

from recomp_jax.pipelines import defaults
from recomp_jax.pipelines.abstractive import default_config, demo_sizes, paper_models, shared_sizes


def get_config(preset: str = 'demo'):
  c = default_config()
  c.preset = preset
  c.workdir = f'workdirs/hotpotqa_abstractive_{preset}'
  c.eval.top_k_sentences = 2  # both supporting facts
  if preset == 'paper':
    defaults.dataset_data(c, 'hotpotqa', 'paper')
    paper_models(c)
  elif preset == 'shared':
    defaults.dataset_data(c, 'hotpotqa', 'shared')
    shared_sizes(c)
  elif preset in ('demo', 'ci'):
    defaults.demo_data(c, 'hotpotqa', (64, 16, 32) if preset == 'demo' else (16, 8, 8))
    demo_sizes(c, preset == 'demo')
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared, demo, ci')
  return c
