"""RECOMP extractive compressor on TriviaQA (paper §4.2: the NQ recipe, top-1 sentence).

Presets (``--config=configs/tqa_extractive.py:PRESET``):
  paper:  for users with the hub: TriviaQA ``rc.nocontext`` from ``datasets``, dense
          retrieval with the encoder over the corpus named in
          ``--config.retrieval.corpus_path`` (a JSONL of ``id, title, text``), the
          contriever-msmarco encoder, the Gemma 3 270M reader (set ``--config.reader.model``).
  shared: offline: questions of ``../shared/data/triviaqa/llmfoundry_sm_sub.jsonl`` (a
          development file, not a held-out set) with BM25 over ``nq/corpus_union14924``; its
          last 500 questions are never trained on (``data.holdout_size``), the test split is the
          last ``data.max_eval`` of them.
"""

from recomp_jax.pipelines.defaults import offline_holdout
from recomp_jax.pipelines.extractive import default_config


def get_config(preset: str = 'paper'):
  c = default_config()
  c.dataset = 'tqa'
  c.data.shots = 'train'  # the reader's in-context examples: TriviaQA's own (RECOMP §4.2)
  c.preset = preset
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
    offline_holdout(c, '../shared/data/triviaqa/llmfoundry_sm_sub.jsonl', n_eval=500)
    c.retrieval.method = 'bm25'
    c.retrieval.corpus_path = '../shared/data/nq/corpus_union14924.jsonl.gz'
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared')
  return c
