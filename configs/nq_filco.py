"""FILCO on Natural Questions: silver contexts -> filter model -> generator trained on filtered context.

Presets (``--config=configs/nq_filco.py:PRESET``):
  paper:  the hub data, FLAN-T5-XL filter model and generator, top-1 passage.
  shared: ``../shared/data`` with its held-out eval set, Gemma 3 270M filter model and generators.
  demo:   the whole pipeline offline in minutes on questions made from Wikipedia summaries.
  ci:     the demo at a tiny size (tests).
"""

from recomp_jax.pipelines import defaults
from recomp_jax.pipelines.filco import default_config


def get_config(preset: str = 'demo'):
  c = default_config()
  c.preset = preset
  c.workdir = f'workdirs/nq_filco_{preset}'
  c.filco.measure = 'strinc'  # §4: STRINC for NQ and TQA, LEXICAL for FEVER, CXMI for WoW and HotpotQA
  if preset == 'paper':
    defaults.dataset_data(c, 'nq', 'paper')
    c.candidates.top_docs = 1
    c.filter.model = c.generator.model = 'google/flan-t5-xl'
    c.filter.pack = c.generator.pack = False  # T5 rows hold one pair each
  elif preset == 'shared':
    defaults.dataset_data(c, 'nq', 'shared')
    # Sized for one session on 2 CPU cores (docs/results/filco.md has the runs behind these sizes).
    c.data.max_train = 400
    c.filter.epochs = 3.0
    c.eval.rows = ('none', 'top1', 'full', 'psg', 'trained', 'ranked', 'silver', 'filtered_reader')
    c.filter.max_source_length = 320
    c.filter.max_target_length = 64
    c.filter.max_new_tokens = 64
    c.generator.max_source_length = 256
    c.generator.max_target_length = 16
    c.train.epochs = 1.0
    c.train.batch_size = 16
    c.train.warmup_steps = 10
    c.train.eval_every = 25
    c.train.checkpoint_every = 25
  elif preset in ('demo', 'ci'):
    demo = preset == 'demo'
    defaults.demo_data(c, 'nq', (64, 16, 32) if demo else (12, 4, 6))
    c.filter.max_source_length = 256 if demo else 160
    c.filter.max_target_length = 48 if demo else 24
    c.filter.max_new_tokens = 48 if demo else 12
    c.generator.max_source_length = 256 if demo else 160
    c.generator.max_target_length = 16 if demo else 8
    c.train.batch_size = 8 if demo else 4
    c.train.epochs = 2.0 if demo else 0.0
    c.train.num_steps = 0 if demo else 1
    c.train.warmup_steps = 2 if demo else 0
    c.train.eval_every = 10 if demo else 1
    c.train.checkpoint_every = 10 if demo else 1
    c.train.log_every = 5 if demo else 1
    c.train.eval_qa_examples = 16 if demo else 2
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared, demo, ci')
  return c
