"""K-COMP on MedQuAD: a knowledge-injected Gemma compressor for long-form medical QA (kcomp.txt).

Presets (``--config=configs/medquad_kcomp.py:PRESET``):
  paper:  Gemma-2B compressor, MedQuAD from the given files (MASH-QA, BioASQ and MedCorp files
          with ``kcomp.question_format`` / ``kcomp.corpus_format`` and their paths), Contriever's 15
          passages re-ranked by BM25, roberta-large BERTScore at layer 17, the teacher at
          --config.teacher.base_url.
  shared: ``../shared/data/medquad``: the first 100 training and 16 dev questions, the first 300
          held-out test questions (the file is a seeded shuffle), BM25 top-5, Gemma 3 270M
          compressor and reader, reader-sentence targets, the new tokens' rows at 100x the
          learning rate (chosen on dev), 2 epochs, the baseline rows' reader answers read from
          ``results/artifacts`` (run from the repository root): one session on 2 CPU cores.
  demo:   Gemma 3 270M on 24 training questions, tested on 12 MedQuAD dev questions (never the
          held-out file): the whole pipeline in minutes.
  ci:     a few questions with tiny models (tests set them).
"""

from recomp_jax.pipelines.kcomp import default_config

MEDQUAD = '../shared/data/medquad'
ANSWERS = 'results/artifacts'


def get_config(preset: str = 'shared'):
  c = default_config()
  c.preset = preset
  c.workdir = f'workdirs/medquad_kcomp_{preset}'
  k = c.kcomp
  k.corpus_path = f'{MEDQUAD}/corpus_medquad.jsonl.gz'
  k.train_path, k.dev_path = f'{MEDQUAD}/train.jsonl.gz', f'{MEDQUAD}/dev.jsonl.gz'
  k.test_path = '../shared/data/eval/medquad_test.jsonl.gz'
  c.train.warmup_steps = 0
  if preset == 'paper':
    c.compressor.model = 'google/gemma-2b'
    c.kcomp.targets = 'teacher'
    c.kcomp.bertscore_model, c.kcomp.bertscore_layers = 'roberta-large', 17
    k.retriever, k.dense_model, k.dense_depth = 'dense_bm25', 'facebook/contriever', 15  # §4.1, Fig. 2
    c.train.batch_size = 16
  elif preset == 'shared':
    # Sized for one session on 2 CPU cores (docs/results/kcomp.md has the stage times).
    k.max_train, k.max_dev, k.max_test = 100, 16, 300
    k.top_docs = 5
    # Chosen on MedQuAD dev (results/dev/): at 1 and 10 the compressor never writes <eom> in 20
    # steps, so it has no prior knowledge to give; at 100 it does and the dev loss is lowest.
    k.new_token_lr_scale = 100.0
    c.compressor.max_source_length = 512
    c.compressor.max_target_length = 160
    c.compressor.max_new_tokens = 128
    c.reader.max_new_tokens = 64
    # The baseline rows' answers (no compressor changes them) are committed, so a run on a fresh
    # machine decodes only the compressors' rows; a reader whose code or weights differ misses them.
    c.reader.prediction_seed = (f'{ANSWERS}/medquad_kcomp_shared_reader_answers/answers.jsonl.gz',)
    c.train.epochs = 2.0
    c.train.batch_size = 8
    c.train.warmup_steps = 1  # 3% of ~22 steps
    c.train.eval_every = 10
    c.train.checkpoint_every = 10
    c.train.eval_qa_examples = 0
  elif preset == 'demo':
    # Its test questions are MedQuAD dev questions past the four it trains with as dev, so the
    # demo never reads the held-out file.
    k.max_train, k.max_dev = 24, 4
    k.test_path, k.skip_test, k.max_test = k.dev_path, 4, 12
    k.top_docs = 3
    k.new_token_lr_scale = 100.0
    c.compressor.max_source_length = 384
    c.compressor.max_target_length = 128
    c.compressor.max_new_tokens = 96
    c.reader.max_new_tokens = 48
    c.train.epochs = 1.0
    c.train.batch_size = 4
    c.train.warmup_steps = 1
    c.train.eval_every = 5
    c.train.checkpoint_every = 5
    c.train.log_every = 1
    c.train.eval_qa_examples = 0
  elif preset == 'ci':
    k.max_train, k.max_dev, k.max_test = 8, 4, 6
    k.top_docs = 3
    c.compressor.max_source_length = 256
    c.compressor.max_target_length = 64
    c.compressor.max_new_tokens = 24
    c.reader.max_new_tokens = 16
    c.reader.score_batch_size = 8
    c.train.epochs = 0.0
    c.train.num_steps = 2
    c.train.batch_size = 4
    c.train.eval_every = 2
    c.train.checkpoint_every = 2
    c.train.log_every = 1
    c.train.eval_qa_examples = 0
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared, demo, ci')
  return c
