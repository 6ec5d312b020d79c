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

from recomp_jax.pipelines import defaults
from recomp_jax.pipelines.extractive import default_config


def get_config(preset: str = 'paper'):
  c = default_config()
  c.preset = preset
  c.eval.top_k_sentences = 1
  if preset in ('paper', 'shared'):
    c.workdir = f'workdirs/tqa_extractive_{preset}'
    defaults.dataset_data(c, 'tqa', preset)  # TriviaQA's own in-context examples (RECOMP §4.2)
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared')
  return c
