"""RECOMP language modelling on WikiText: perplexity with retrieved evidence prepended every 32 tokens.

Presets (``--config=configs/wikitext_lm.py:PRESET``):
  paper:  WikiText-103 test from the hub, BM25 over the DPR Wikipedia passages you give
          (``--config.retrieval.corpus_path``: psgs_w100 as JSONL), retrieval every 32 tokens. The
          paper's readers are GPT-2 / GPT-J, which the model zoo does not hold: the reader is
          ``reader.model`` (Gemma 3 270M by default).
  shared: ``../shared/data``'s WikiText-2 test (the same articles as WikiText-103 test), 400
          windows with 128-token prefixes, BM25 over the ovos Wikipedia summaries and the NQ
          passage corpus, 12 candidate sentences per window; the trained row from 300 training
          and 60 dev windows, two seeds (top-5 is left out for time: its evidence is ~5x top-1's).
  shared_abstractive: :shared's windows, retrieval and reader labels, the abstractive row in place
          of the extractive one: reader-sentence targets, one epoch of one seed.
  ci:     6 windows of 3 articles, the trained rows from 24 training windows, the abstractive one
          on reader-sentence targets (tests).

What a window is: ``lm.stride`` (32) scored tokens; its retrieval query is the ``lm.query_tokens``
(32) tokens *before* it, so the first 32 tokens of every article are never scored. The window's
own article is left out of retrieval by title (passages titled as the article are removed), where
the paper removes the articles that contain the input. The trained compressors (extractive:
``trained``; abstractive: ``abstractive``) learn from windows of the ovos Wikipedia summaries (test
articles' titles removed; :mod:`recomp_jax.pipelines.lm_extractive`), never from WikiText.

  python -m recomp_jax.main --config=configs/wikitext_lm.py:shared
"""

from recomp_jax.pipelines import defaults
from recomp_jax.pipelines.lm import default_config


def get_config(preset: str = 'shared'):
  c = default_config()
  c.preset = preset
  c.workdir = f'workdirs/wikitext_lm_{preset}'
  if preset == 'paper':
    c.lm.hf_config = 'wikitext-103-raw-v1'
    c.lm.max_prefix_tokens = 1024 - 32
    c.train.batch_size = 64  # A.2: batch 64, learning rate 2e-5, 1000 warm-up steps, 3 epochs
  elif preset in ('shared', 'shared_abstractive', 'ci'):
    c.lm.wikitext_path = '../shared/data/wikitext/wikitext2_test.raw'
    defaults.use_minilm(c)
    if preset in ('shared', 'shared_abstractive'):
      # Sized for training and evaluation within two hours on a 2-core CPU: scoring the sentence
      # candidates (windows x candidates reader calls) is most of the work.
      c.lm.corpus = 'ovos+file'
      c.retrieval.corpus_path = '../shared/data/nq/corpus_union14924.jsonl.gz'
      c.lm.max_windows = 400
      c.lm.max_prefix_tokens = 128
      c.lm.max_candidates = 12
      c.lm.train_windows, c.lm.dev_windows = 300, 60
      # the reader's scores of the training, dev and test windows' candidates, committed (no text;
      # settings checked)
      c.lm.label_artifact = 'results/artifacts/wikitext_lm_shared_scores'
      c.lm.rows = ('none', 'top1', 'bm25_sentence', 'offtheshelf_sentence', 'trained', 'oracle_ll')
      c.train.seeds = (0, 1)
      c.train.batch_size = 32
      c.train.epochs = 10.0
      c.train.warmup_steps = 10
      c.train.eval_every = c.train.checkpoint_every = 10
      if preset == 'shared_abstractive':
        # the abstractive compressor on the same windows and labels; its candidate targets are the
        # reader's best sentences (the offline 270M teacher is weak), one epoch of one seed for time
        c.lm.rows = ('none', 'top1', 'offtheshelf_sentence', 'abstractive', 'oracle_ll')
        c.critic.targets = 'reader_sentence'
        c.compressor.max_source_length = 384
        c.compressor.max_target_length = c.compressor.max_new_tokens = 48
        c.compressor.microbatch = 4
        c.compressor_train.batch_size = 16
        c.compressor_train.epochs = 1.0
        c.compressor_train.warmup_steps = 2
        c.compressor_train.eval_every = c.compressor_train.checkpoint_every = 10
    else:
      c.lm.corpus = 'ovos'
      c.lm.max_articles = 3
      c.lm.max_windows = 6
      c.lm.max_prefix_tokens = 64
      c.lm.max_context_tokens = 512
      c.lm.max_candidates = 8
      c.lm.train_windows, c.lm.dev_windows = 24, 8
      c.reader.score_batch_size = 8
      c.train.batch_size = 8
      c.train.epochs = 2.0
      c.train.warmup_steps = 2
      c.train.eval_every = c.train.checkpoint_every = 3
      c.train.log_every = 3
      # the abstractive row: reader-sentence targets (no teacher server), a few compressor steps
      c.critic.targets = 'reader_sentence'
      c.compressor.max_source_length = 256
      c.compressor.max_target_length = c.compressor.max_new_tokens = 32
      c.compressor.microbatch = 4
      c.compressor_train.batch_size = 8
      c.compressor_train.num_steps = 4
      c.compressor_train.warmup_steps = 1
      c.compressor_train.eval_every = c.compressor_train.checkpoint_every = 2
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared, shared_abstractive, ci')
  return c
