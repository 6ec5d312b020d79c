"""Flax NNX models: BERT (contriever / MiniLM), T5 (v1.0, v1.1, Flan) and Gemma 1/2/3."""
