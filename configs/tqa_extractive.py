"""RECOMP extractive compressor on TriviaQA (paper §4.2: the NQ recipe, top-1 sentence).

Presets (``--config=configs/tqa_extractive.py:PRESET``):
  paper:  for users with the hub: TriviaQA ``rc.nocontext`` from ``datasets``, dense
          retrieval with the encoder over the corpus named in
          ``--config.retrieval.corpus_path`` (a JSONL of ``id, title, text``), the
          contriever-msmarco encoder, the Gemma 3 270M reader (set ``--config.reader.model``).
  shared: offline: questions of ``../shared/data/triviaqa/llmfoundry_sm_sub.jsonl`` (a
          development file, not a held-out set) with BM25 over ``nq/corpus_union14924``; the
          last ``data.max_eval`` questions are never trained on (``data.holdout_tail``).
"""

import importlib.util
import os

_spec = importlib.util.spec_from_file_location(
    'recomp_nq_extractive', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'nq_extractive.py'))
nq_extractive = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nq_extractive)


def get_config(preset: str = 'paper'):
  c = nq_extractive.base_config()
  c.eval.top_k_sentences = 1
  if preset == 'paper':
    c.workdir = 'workdirs/tqa_extractive_paper'
    c.data.source = 'hf'
    c.data.hf_name = 'trivia_qa'
    c.data.hf_config = 'rc.nocontext'
    c.data.hf_train_split = 'train'
    c.data.hf_eval_split = 'validation'
    c.retrieval.method = 'dense'
  elif preset == 'shared':
    c.workdir = 'workdirs/tqa_extractive_shared'
    c.data.source = 'jsonl'
    c.data.train_path = '../shared/data/triviaqa/llmfoundry_sm_sub.jsonl'
    c.data.eval_path = '../shared/data/triviaqa/llmfoundry_sm_sub.jsonl'
    c.data.max_eval = 500
    c.data.holdout_tail = True
    c.retrieval.method = 'bm25'
    c.retrieval.corpus_path = '../shared/data/nq/corpus_union14924.jsonl.gz'
    nq_extractive.use_minilm(c)
    c.train.batch_size = 32
    c.train.warmup_steps = 30
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared')
  return c
