"""Window scoring of the RECOMP language-modelling task: ours vs the obvious HF PyTorch way.

    python benchmarks/lm_windows.py [--windows N] [--prefix TOKENS] [--quick | --repeats N]

The same WikiText-2 test windows (``../shared/data/wikitext/wikitext2_test.raw``), each with a
retrieved-looking evidence sentence prepended, scored by Gemma 3 270M (the offline reader):

* ours: :func:`recomp_jax.evaluation.lm_metrics.score_windows` (the reader's jitted sharded
  scorer: bucketed lengths, the output head and log-softmax at the 32 scored positions only);
* HF fp32 / bf16: ``AutoModelForCausalLM`` over ``BOS + evidence + prefix + window``, full logits,
  ``log_softmax`` over the vocabulary, gather at the window's tokens, 4 rows per call (the
  float32 ``[rows, T, 262144]`` logits bound the batch).

Same token ids for every method (:func:`recomp_jax.evaluation.lm_metrics.context_ids`); the
largest difference from HF fp32 is printed with the windows/s and the ratios.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import demo_gemma_reader, machine_line, print_table, timeit  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from scoring import hf_answer_log_likelihood, hf_inputs  # noqa: E402

WIKITEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'shared', 'data', 'wikitext',
                        'wikitext2_test.raw')
EVIDENCE = ('Title: River Thames. The river rises at Thames Head in Gloucestershire and flows through Oxford, '
            'Reading and London before reaching the North Sea at the Thames Estuary.')
HF_ROWS = 4


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--windows', type=int, default=32, help='windows scored (default 32)')
  parser.add_argument('--prefix', type=int, default=128, help='article tokens before each window (default 128)')
  parser.add_argument('--quick', action='store_true', help='1 timed repeat instead of 3')
  parser.add_argument('--repeats', type=int, default=None, help='timed repeats (median reported)')
  args = parser.parse_args()
  repeats = args.repeats or (1 if args.quick else 3)

  from transformers import AutoModelForCausalLM

  from recomp_jax.data import wikitext
  from recomp_jax.evaluation import lm_metrics

  print(machine_line(), flush=True)
  hf_dir, tokenizer, reader = demo_gemma_reader(score_batch_size=32)
  hf32 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  hf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()

  windows = wikitext.make_windows(wikitext.read_articles(WIKITEXT), tokenizer, stride=32, query_tokens=32,
                                  max_prefix_tokens=args.prefix, max_windows=args.windows, seed=0)
  evidence = [EVIDENCE] * len(windows)
  contexts = [lm_metrics.context_ids(tokenizer, e, w.prefix_ids, max_context_tokens=1024)[0]
              for w, e in zip(windows, evidence)]
  targets = [list(w.target_ids) for w in windows]
  batches = [hf_inputs(contexts[i:i + HF_ROWS], targets[i:i + HF_ROWS]) for i in range(0, len(windows), HF_ROWS)]

  def ours():
    return lm_metrics.score_windows(reader, windows, evidence, max_context_tokens=1024).loglik

  def hf(model):
    return np.concatenate([hf_answer_log_likelihood(model, *b) for b in batches])

  a, b = ours(), hf(hf32)
  n = len(windows)
  tokens = np.mean([len(c) + len(t) for c, t in zip(contexts, targets)])
  print(f'{n} windows of {np.mean([len(t) for t in targets]):.1f} scored tokens after {tokens:.0f}-token '
        f'sequences on average; max |ours - HF fp32| per-window log-likelihood {np.abs(a - b).max():.2e} '
        f'(values {b.min():.1f} .. {b.max():.1f})', flush=True)
  t_ours = timeit(ours, repeats=repeats)
  t_hf32 = timeit(lambda: hf(hf32), repeats=repeats)
  t_hf16 = timeit(lambda: hf(hf16), repeats=repeats)
  print_table('Gemma 3 270M LM window scoring: windows/s',
              [{'case': f'{n} windows, {args.prefix}-token prefix + evidence sentence', 'ours': n / t_ours,
                'hf_fp32': n / t_hf32, 'hf_bf16': n / t_hf16}], 'windows/s')
  print(f'ours vs HF fp32: {t_hf32 / t_ours:.2f}x; ours vs HF bf16: {t_hf16 / t_ours:.2f}x', flush=True)


if __name__ == '__main__':
  main()
