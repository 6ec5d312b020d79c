"""Retrieval: BM25 over a passage corpus and over candidate sentences."""

from recomp_jax.retrieval.bm25 import (BM25Config, BM25Index, corpus_fingerprint, make_tokenizer,
                                       rank_sentences, sentence_scores, top_sentences,
                                       whitespace_tokenize)

__all__ = ['BM25Config', 'BM25Index', 'corpus_fingerprint', 'make_tokenizer', 'rank_sentences',
           'sentence_scores', 'top_sentences', 'whitespace_tokenize']
