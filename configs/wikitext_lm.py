"""RECOMP language modelling on WikiText: perplexity with retrieved evidence prepended every 32 tokens.

Presets (``--config=configs/wikitext_lm.py:PRESET``; details in
``recomp_jax.pipelines.lm.experiment``):
  paper:  WikiText-103 test from the hub, BM25 over the DPR Wikipedia passages you give
          (``--config.retrieval.corpus_path``).
  shared: ``../shared/data``'s WikiText-2 test (400 windows), BM25 over the ovos Wikipedia
          summaries and the NQ passage corpus.
  shared_abstractive: :shared's windows and labels, with the abstractive compressor's row.
  ci:     6 windows (tests).

What a window is: ``lm.stride`` (32) scored tokens; its retrieval query is the ``lm.query_tokens``
(32) tokens *before* it, so the first 32 tokens of every article are never scored. The window's
own article is left out of retrieval by title (passages titled as the article are removed), where
the paper removes the articles that contain the input. The trained compressors (extractive:
``trained``; abstractive: ``abstractive``, not in ``:shared``'s rows yet) learn from windows of the
ovos Wikipedia summaries (test articles' titles removed), never from WikiText.

  python -m recomp_jax.main --config=configs/wikitext_lm.py:shared
"""

from recomp_jax.pipelines.lm import experiment


def get_config(preset: str = 'shared'):
  return experiment(preset)
