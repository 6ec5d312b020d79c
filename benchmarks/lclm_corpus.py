"""Corpus-in-context retrieval (CoLoR's LCLM task): ours vs the obvious HF PyTorch way.

    python benchmarks/lclm_corpus.py [--sizes 2048,8192,32768] [--queries N] [--quick | --repeats N]

One corpus of NQ passages (``../shared/data/nq/corpus_union14924.jsonl.gz``, LOFT's
``ID: i | TITLE: t | CONTENT: c | END ID: i`` entries, App. A) per size, ``N`` NQ training
queries after it; every query ranks every passage by the log-likelihood of its ``ID: i |`` line
with Gemma 3 270M (the offline reader):

* ours: :meth:`recomp_jax.reader.lclm.CorpusRetriever.rank`: the corpus prefix is encoded once
  and shared by every query (the reader's prefix KV cache), each query's ID lines scored in one
  jitted call, the output head at the ID tokens only;
* HF fp32: ``AutoModelForCausalLM`` re-encoding corpus + query for every query (``use_cache``),
  then the ``N`` ID lines as one batch on that query's cache (``batch_repeat_interleave``),
  full logits and ``log_softmax`` over the vocabulary.

Same token ids for both; the largest score difference is printed with the seconds per query and
the ratio.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import demo_gemma_reader, machine_line, print_table, timeit  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

NQ = os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'shared', 'data', 'nq')
HF_ID_BATCH = 16  # ID lines per HF call (each holds a copy of the query's cache)


def corpus_of(passages, tokenizer, budget: int):
  """The first passages whose LOFT entries fit ``budget`` tokens: ``(titles, contents)``."""
  from recomp_jax.reader import lclm
  titles, contents, used = [], [], 0
  for p in passages:
    n = len(tokenizer(lclm.format_entry(len(titles), p.title, p.text) + '\n', add_special_tokens=False)['input_ids'])
    if used + n > budget:
      break
    titles.append(p.title)
    contents.append(p.text)
    used += n
  return titles, contents


def hf_rank(model, prefix: list[int], query_ids: list[list[int]], id_targets: list[list[int]]) -> np.ndarray:
  """``[Q, N]``: per query, corpus + query encoded afresh, then the ID lines on its cache."""
  out = np.zeros((len(query_ids), len(id_targets)), np.float64)
  with torch.inference_mode():
    for q, query in enumerate(query_ids):
      first = model(input_ids=torch.tensor([prefix + query]), use_cache=True)
      last = torch.log_softmax(first.logits[0, -1].float(), -1)
      for start in range(0, len(id_targets), HF_ID_BATCH):
        chunk = id_targets[start:start + HF_ID_BATCH]
        width = max(len(t) for t in chunk)
        ids = torch.tensor([t + [0] * (width - len(t)) for t in chunk])
        cache = copy.deepcopy(first.past_key_values)
        cache.batch_repeat_interleave(len(chunk))
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits  # [n, width, V]
        log_p = torch.log_softmax(logits.float(), -1)
        for i, t in enumerate(chunk):
          total = float(last[t[0]]) + sum(float(log_p[i, j - 1, t[j]]) for j in range(1, len(t)))
          out[q, start + i] = total
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--sizes', default='2048,8192,32768', help='corpus tokens, comma-separated')
  parser.add_argument('--queries', type=int, default=4, help='queries per corpus (default 4)')
  parser.add_argument('--hf-queries', type=int, default=0, help='queries HF encodes (0 = all; its seconds are per query)')
  parser.add_argument('--hf-max-tokens', type=int, default=0,
                      help='corpora above this size run ours only (0 = none): on 24 GiB HF fp32 is killed at 32k')
  parser.add_argument('--quick', action='store_true', help='1 timed repeat instead of 3')
  parser.add_argument('--repeats', type=int, default=None, help='timed repeats (median reported)')
  args = parser.parse_args()
  repeats = args.repeats or (1 if args.quick else 3)

  from transformers import AutoModelForCausalLM

  from recomp_jax.data import formats
  from recomp_jax.reader import lclm

  print(machine_line(), flush=True)
  hf_dir, tokenizer, reader = demo_gemma_reader(score_batch_size=32)
  hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  retriever = lclm.CorpusRetriever(reader, max_context=32768)
  pool = formats.read_corpus(os.path.join(NQ, 'corpus_union14924.jsonl.gz'))
  queries = [e.question for e in formats.read_examples(os.path.join(NQ, 'train2105_bm25top20.jsonl.gz'),
                                                       limit=args.queries)]
  rows = []
  for size in (int(s) for s in args.sizes.split(',')):
    titles, contents = corpus_of(pool, tokenizer, size)
    prefix = retriever.prefix_ids(titles, contents, [])
    query_ids = retriever.query_ids(queries)
    targets = retriever._id_targets(len(titles))  # pylint: disable=protected-access
    hf_n = args.hf_queries or len(queries)

    def ours(titles=titles, contents=contents):
      return retriever.rank(titles, contents, [], queries)

    def theirs(prefix=prefix, query_ids=query_ids, targets=targets, hf_n=hf_n):
      return hf_rank(hf, prefix, query_ids[:hf_n], targets)

    a = ours()
    case = f'{size} tokens, {len(titles)} passages, {len(queries)} queries'
    if args.hf_max_tokens and size > args.hf_max_tokens:
      t_ours = timeit(ours, repeats=repeats) / len(queries)
      rows.append({'case': case, 'ours': 60 / t_ours})
      print(f'{size} tokens: {len(titles)} passages, prefix {len(prefix)} tokens; ours {t_ours:.2f} s/query '
            '(HF not run: --hf-max-tokens)', flush=True)
      continue
    start = time.perf_counter()
    b = theirs()  # timed as it is (HF compiles nothing): at 32k one pass takes minutes
    t_hf = (time.perf_counter() - start) / hf_n
    agree = float(np.mean(np.argmax(a[:hf_n], -1) == np.argmax(b, -1)))
    print(f'{size} tokens: {len(titles)} passages, prefix {len(prefix)} tokens; max |ours - HF| '
          f'{np.abs(a[:hf_n] - b).max():.2e} (scores {b.min():.1f} .. {b.max():.1f}), top-1 agreement {agree:.2f}',
          flush=True)
    t_ours = timeit(ours, repeats=repeats) / len(queries)
    rows.append({'case': case, 'ours': 60 / t_ours, 'hf_fp32': 60 / t_hf})
    print(f'{size}: ours {t_ours:.2f} s/query, HF fp32 {t_hf:.2f} s/query, {t_hf / t_ours:.1f}x', flush=True)
  print_table('Gemma 3 270M corpus-in-context ranking: queries per minute', rows, 'queries/min')


if __name__ == '__main__':
  main()
