"""CoLoR on NQ: passages compressed for long-context-LM retrieval, ORPO with a length term (color.txt).

Presets (``--config=configs/nq_color.py:PRESET``):
  paper:  Phi-3-mini compressor and LOFT-size corpora (128k tokens), which need a long-context
          reader and an accelerator; the teacher at --config.teacher.base_url.
  shared: ``../shared/data/nq``: test corpora of ~8k raw tokens over the first 300 held-out
          queries, label corpora of ~2k tokens (3 queries each), Gemma 3 270M as reader, teacher
          and compressor.
  demo:   8 of the 50 demo queries in two 1k-token corpora, 8 training queries, 4 training steps
          (the whole pipeline in minutes).
  ci:     a few queries with tiny compressors (tests set them).
"""

from recomp_jax.pipelines.color import default_config

NQ = '../shared/data/nq'


def get_config(preset: str = 'shared'):
  c = default_config()
  c.preset = preset
  c.workdir = f'workdirs/nq_color_{preset}'
  k = c.color
  k.train_path = f'{NQ}/train2105_bm25top20.jsonl.gz'
  k.test_path = '../shared/data/eval/nq_eval500_bm25top10.jsonl'
  k.corpus_path = f'{NQ}/corpus_union14924.jsonl.gz'
  c.train.warmup_steps = 0
  if preset == 'paper':
    c.compressor.model = 'microsoft/Phi-3-mini-4k-instruct'
    k.budget_tokens, k.queries_per_group = 128_000, 100
    k.max_context = 131_072
  elif preset == 'shared':
    k.max_train, k.max_dev, k.max_test = 120, 24, 300
    k.shots = 3
    k.queries_per_group, k.budget_tokens = 20, 8192
    k.label_queries_per_group, k.label_budget_tokens = 3, 2048
    c.train.epochs = 2.0
    c.train.learning_rate = 5e-6
    c.train.eval_every = 20
    c.train.checkpoint_every = 20
    c.train.eval_qa_examples = 0
  elif preset in ('demo', 'ci'):
    demo = preset == 'demo'
    if demo:  # the 50 demo questions (disjoint from the training file and eval/) as the test side
      k.test_path = f'{NQ}/demo50_bm25top5.jsonl'
      k.label_gold_at = 'end'
      c.train.learning_rate = 5e-6
    else:
      c.reader.score_batch_size = 8
    k.max_train, k.max_dev, k.max_test = (8, 2, 8) if demo else (6, 2, 4)
    k.shots = 1
    k.queries_per_group, k.budget_tokens = 4, 1024  # ci: one test corpus, each row encodes one prefix
    k.label_queries_per_group, k.label_budget_tokens = 1, 640  # ~3 passages: some candidates succeed
    k.teacher_temperatures = (0.0, 1.0)
    k.answer_tokens = 8
    c.teacher.max_tokens = 48 if demo else 24
    c.compressor.max_source_length = 256
    c.compressor.max_target_length = 64 if demo else 48
    c.compressor.max_new_tokens = 48 if demo else 24
    c.train.epochs = 0.0
    c.train.num_steps = c.train.eval_every = c.train.checkpoint_every = 4 if demo else 2
    c.train.batch_size = 2
    c.train.log_every = 1
    c.train.eval_qa_examples = 0
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared, demo, ci')
  return c
