"""RECOMP language modelling on WikiText: perplexity with retrieved evidence prepended every 32 tokens.

Presets (``--config=configs/wikitext_lm.py:PRESET``; details in
``recomp_jax.pipelines.lm.experiment``):
  paper:  WikiText-103 test from the hub, BM25 over the DPR Wikipedia passages you give
          (``--config.retrieval.corpus_path``).
  shared: ``../shared/data``'s WikiText-2 test (400 windows), BM25 over the ovos Wikipedia
          summaries and the NQ passage corpus.
  ci:     6 windows (tests).
"""

from recomp_jax.pipelines.lm import experiment


def get_config(preset: str = 'shared'):
  return experiment(preset)
