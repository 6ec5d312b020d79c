"""FILCO CXMI labelling throughput: ours (sharded JAX scorer, few-shot prefix cached) vs HF PyTorch.

    python benchmarks/cxmi.py [--questions 16] [--quick]

Both compute, for every sentence t of a question's passages, the two log-likelihoods of
CXMI = log p(o | t ⊕ q) - log p(o | q) with the Gemma 3 270M reader on the reader protocol's
prompt (5-shot prefix + sentence + question, ``recomp_jax.reader.prompts``).

Ours: ``compressors.filco.cxmi_scores`` (one ``extractive.loglik_labels`` call: the few-shot
prefix encoded once, head and log-softmax at the answer positions only, bucketed batches).
HF: the obvious way, per question, the full prompt + answer of every sentence and of the
no-context prompt in right-padded batches, full logits, ``log_softmax`` over the vocabulary,
gather (``benchmarks/scoring.py``); fp32 and bf16 weights.

Data: questions made from the offline Wikipedia summaries (``recomp_jax.data.demo_qa``), each
with its gold passage and the next two corpus passages (FILCO's top-1 passage, made longer).
Reported: sentences/s and the largest CXMI difference to HF fp32.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, print_table, timeit  # noqa: E402
from scoring import right_padded  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402


def hf_logliks(model, rows: list[tuple[list[int], list[int]]]) -> list[float]:
  """The obvious way, for answers of different lengths: full logits, log_softmax, gather."""
  ids, mask = right_padded([prompt + target for prompt, target in rows])
  with torch.inference_mode():
    logits = model(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    log_p = torch.log_softmax(logits.float(), dim=-1)  # [B, T, V]
  out = []
  for b, (prompt, target) in enumerate(rows):
    positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(target))
    out.append(float(log_p[b, positions, torch.tensor(target)].sum()))
  return out


def hf_cxmi(model, tokenizer, questions, sentences, outputs, batch_size: int) -> list[np.ndarray]:
  """Per question ``[S]`` CXMI from full-logit HF forwards (the no-context prompt last)."""
  from recomp_jax.reader import prompts
  rows, owners = [], []
  for i, (question, sents, output) in enumerate(zip(questions, sentences, outputs)):
    target = tokenizer(prompts.answer_target(output), add_special_tokens=False)['input_ids']
    for prompt in [prompts.build_prompt(question, s) for s in sents] + [prompts.build_prompt(question)]:
      rows.append((tokenizer(prompt)['input_ids'], target))
      owners.append(i)
  values = []
  for start in range(0, len(rows), batch_size):
    values.extend(hf_logliks(model, rows[start:start + batch_size]))
  out, k = [], 0
  for sents in sentences:
    ll = np.asarray(values[k:k + len(sents) + 1])
    out.append(ll[:-1] - ll[-1])
    k += len(sents) + 1
  return out


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--questions', type=int, default=16)
  parser.add_argument('--batch-size', type=int, default=8, help='HF batch (full logits are large)')
  parser.add_argument('--quick', action='store_true', help='1 timed repeat instead of 3')
  args = parser.parse_args()
  repeats = 1 if args.quick else 3

  from recomp_jax.pretrained.demo import resolve_demo_model
  from transformers import AutoModelForCausalLM, AutoTokenizer

  from recomp_jax.compressors import filco
  from recomp_jax.data.demo_qa import build_demo_dataset
  from recomp_jax.pretrained.gguf import convert_to_hf_dir
  from recomp_jax.reader.reader import Reader

  print(machine_line(), flush=True)
  data = build_demo_dataset(n_train=args.questions, n_dev=1, n_test=1, seed=0)
  corpus = data.corpus
  examples = data.train[:args.questions]
  questions, sentences, outputs = [], [], []
  for j, ex in enumerate(examples):
    passages = [ex.gold_ctx] + corpus[7 * j:7 * j + 2]
    questions.append(ex.question)
    sentences.append([s for row in filco.passage_sentences(passages) for s in row])
    outputs.append(filco.canonical_output(ex.answers, passages))
  total = sum(len(s) for s in sentences)
  print(f'{len(questions)} questions, {total} sentences ({total / len(questions):.1f} per question)',
        flush=True)

  gguf = resolve_demo_model('', 'reader')
  hf_dir = convert_to_hf_dir(gguf)
  reader = Reader(hf_dir, score_batch_size=32)
  tokenizer = AutoTokenizer.from_pretrained(hf_dir)
  hf32 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  hf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()

  ours_fn = lambda: filco.cxmi_scores(reader, questions, [[s] for s in sentences], outputs)
  ours = [np.asarray(q[0]) for q in ours_fn()]
  reference = hf_cxmi(hf32, tokenizer, questions, sentences, outputs, args.batch_size)
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, reference))
  spread = np.concatenate(reference)
  print(f'max |CXMI ours - HF fp32| = {diff:.2e} nats (CXMI range {spread.min():.2f} .. '
        f'{spread.max():.2f}); same best sentence for '
        f'{sum(int(np.argmax(a) == np.argmax(b)) for a, b in zip(ours, reference))}/{len(ours)} questions',
        flush=True)
  t_ours = timeit(ours_fn, repeats=repeats)
  t_hf32 = timeit(lambda: hf_cxmi(hf32, tokenizer, questions, sentences, outputs, args.batch_size),
                  warmup=0, repeats=repeats)
  t_hf16 = timeit(lambda: hf_cxmi(hf16, tokenizer, questions, sentences, outputs, args.batch_size),
                  warmup=0, repeats=repeats)
  print_table('FILCO CXMI labelling with Gemma 3 270M: sentences/s', [
      {'case': f'{len(questions)} questions x {total / len(questions):.1f} sentences, 5-shot prompt',
       'ours': total / t_ours, 'hf_fp32': total / t_hf32, 'hf_bf16': total / t_hf16}], 'sentences/s')


if __name__ == '__main__':
  main()
