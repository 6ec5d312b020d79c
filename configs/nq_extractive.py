"""RECOMP extractive compressor on Natural Questions.

Presets (``--config=configs/nq_extractive.py:PRESET``):
  paper:  the paper's NQ setting for users with the hub: contriever-msmarco
          encoder, NQ-open from ``datasets`` with dense retrieval over a corpus you
          name in ``--config.retrieval.corpus_path``, a Gemma reader.
  shared: trains on ``../shared/data/nq/train2105_bm25top20.jsonl.gz`` (dev split
          carved out) and evaluates on the held-out ``../shared/data/eval/nq_eval500``
          with the Gemma 3 270M reader (NQ reader protocol).
  demo:   the whole pipeline offline on a fresh machine in minutes: MiniLM encoder,
          Gemma 3 270M reader, questions made from ovos Wikipedia summaries.
  ci:     the demo at a tiny size (tests).
  quickstart: a two-minute look: the demo data, no training, five rows.
"""

import ml_collections

from recomp_jax.pipelines import defaults
from recomp_jax.pipelines.defaults import use_minilm
from recomp_jax.pipelines.extractive import default_config


def get_config(preset: str = 'demo') -> ml_collections.ConfigDict:
  c = default_config()
  c.dataset = 'nq'
  c.preset = preset
  if preset == 'paper':
    defaults.dataset_data(c, 'nq', preset)  # dense: the encoder over --config.retrieval.corpus_path
    c.retrieval.top_k = 5
    c.eval.rows = ('all',)
  elif preset == 'shared':
    c.workdir = 'workdirs/nq_extractive_shared'
    defaults.dataset_data(c, 'nq', preset)
    c.train.batch_size = 32
    c.train.warmup_steps = 30
    c.train.eval_every = 25
    c.train.checkpoint_every = 25
  elif preset in ('demo', 'ci'):
    c.workdir = f'workdirs/nq_extractive_{preset}'
    c.data.source = 'demo'
    c.retrieval.corpus_path = ''  # the demo corpus written by the data stage
    use_minilm(c)
    c.data.demo_train, c.data.demo_dev, c.data.demo_test = (96, 24, 40) if preset == 'demo' else (24, 8, 8)
    c.train.batch_size = 16 if preset == 'demo' else 8
    c.train.epochs = 2.0
    c.train.warmup_steps = 5
    c.train.eval_every = 10 if preset == 'demo' else 2
    c.train.checkpoint_every = 10 if preset == 'demo' else 2
    c.train.log_every = 5
    c.train.eval_qa_examples = 16 if preset == 'demo' else 4
    c.eval.oracle_em_max_candidates = 5  # bounds the EM-oracle generations of the smoke test
    if preset == 'demo':  # the random-sentence, BoW and NE baselines run in :shared, not here
      c.eval.rows = ('none', 'top1', 'top5', 'lead', 'bm25_sentence', 'offtheshelf_sentence',
                     'trained', 'trained_threshold', 'trained_compare', 'oracle_ll', 'oracle_em',
                     'gold')
  elif preset == 'quickstart':
    c.workdir = 'workdirs/nq_quickstart'
    c.data.source = 'demo'
    use_minilm(c)
    c.data.demo_train, c.data.demo_dev, c.data.demo_test = 0, 0, 48
    c.train.epochs = 0.0
    c.eval.oracle = False
    c.eval.rows = ('none', 'top1', 'top5', 'lead', 'bm25_sentence', 'offtheshelf_sentence')
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared, demo, ci, quickstart')
  return c
