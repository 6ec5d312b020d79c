"""Answer log-likelihood scoring with Gemma 3 270M: ours (JAX, fp32) vs the obvious HF PyTorch way.

    python benchmarks/scoring.py [--quick | --repeats N] [--cases 1,2,3]

The HF baseline holds ~9 GB of float32 logits at batch 16 (that is the point).

HF baseline: one forward pass over context + answer, ``log_softmax`` over all logits
(``[B, T, 262144]``, upcast to float32), gather at the answer positions; fp32 and bf16 weights.
Ours: :class:`recomp_jax.reader.scoring.CausalScorer` (head and log-softmax at the answer
positions only, in vocabulary chunks). Same token ids for every method.

Cases:
  1. 16 contexts of 256 tokens (BOS included) + 8-token answers;
  2. shared prefix: BOS + the protocol's 5-shot block as one prefix, 20 candidates
     ``'{sentence}\\n\\n{question}\\nAnswer:'`` (~40-token sentences) + an 8-token answer:
     ours with the prefix KV cache vs ours on the full strings vs HF on the full strings;
  3. many prompts, each with its own candidates (the FILCO ranked filter): 16 prompts of
     ~300 tokens, each followed by 5 whole outputs (~30 tokens + EOS): ours with each
     prompt encoded once (``Reader.output_loglik_per_prompt``) vs ours on the 80 full
     strings (``Reader.output_loglik``) vs HF on the full strings.

Also reported: achieved GFLOP/s (matmul FLOPs each method executes, padding included)
against a measured fp32 matmul peak (a jitted 4096^3 ``jnp.dot``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, print_table, timeit  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

TEXT = ('The Amazon River in South America is the largest river by discharge volume of water in the '
        'world, and the disputed longest river system in the world in comparison to the Nile. The '
        'headwaters of the Apurimac River on Nevado Mismi had been considered for nearly a century '
        'as the Amazon basin\'s most distant source, until a 2014 study found it to be the headwaters '
        'of the Mantaro River on the Cordillera Rumi Cruz in Peru. The Mantaro and Apurimac rivers '
        'join, and with other tributaries form the Ucayali River, which in turn meets the Maranon '
        'River upstream of Iquitos, Peru, forming what countries other than Brazil consider to be '
        'the main stem of the Amazon. ')
QUESTION = 'where does the amazon river begin'
BATCH, CONTEXT_LEN, ANSWER_LEN = 16, 256, 8
CANDIDATES, SENTENCE_LEN = 20, 40


def matmul_peak_gflops(n: int = 4096, repeats: int = 5) -> float:
  """Measured fp32 GFLOP/s of a jitted ``[n, n] @ [n, n]``."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  return 2 * n ** 3 / timeit(lambda: dot(a, b), repeats=repeats) / 1e9


def gemma_gflop(config, batch: int, length: int, head_positions: int) -> float:
  """Matmul GFLOP of a Gemma forward over ``[batch, length]`` with the head at ``head_positions``.

  Projections and MLP ``2 * params * tokens``; attention ``QK^T`` and ``PV`` over all
  ``length x length`` pairs (what both implementations compute; masks do not skip work);
  the output head ``2 * D * V`` per head position.
  """
  d, n, k, h, f = (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                   config.intermediate_size)
  per_token = 2 * (d * n * h + 2 * d * k * h + n * h * d + 3 * d * f) * config.num_layers
  attention = 4 * n * h * length * length * config.num_layers * batch
  head = 2 * d * config.vocab_size * head_positions
  return (per_token * batch * length + attention + head) / 1e9


def hf_answer_log_likelihood(model, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
                             targets: np.ndarray, target_mask: np.ndarray) -> np.ndarray:
  """The obvious way: full logits, log_softmax over the vocabulary, gather. ``[B]`` sums."""
  with torch.inference_mode():
    logits = model(input_ids=torch.from_numpy(ids).long(),
                   attention_mask=torch.from_numpy(mask).long()).logits
    log_p = torch.log_softmax(logits.float(), dim=-1)                      # [B, T, V]
    rows = torch.arange(ids.shape[0])[:, None]
    picked = log_p[rows, torch.from_numpy(positions).long(), torch.from_numpy(targets).long()]
    return (picked * torch.from_numpy(target_mask)).sum(-1).numpy()


def right_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
  length = max(len(r) for r in rows)
  ids = np.zeros((len(rows), length), np.int64)
  mask = np.zeros_like(ids)
  for i, r in enumerate(rows):
    ids[i, :len(r)], mask[i, :len(r)] = r, 1
  return ids, mask


def hf_inputs(contexts: list[list[int]], answers: list[list[int]]):
  """``(ids, mask, positions, targets, target_mask)``; answers may differ in length."""
  ids, mask = right_padded([c + a for c, a in zip(contexts, answers)])
  targets, target_mask = right_padded(answers)
  positions = np.zeros_like(targets)
  for i, (c, a) in enumerate(zip(contexts, answers)):
    positions[i, :len(a)] = len(c) - 1 + np.arange(len(a))
  return ids, mask, positions, targets, target_mask.astype(np.float32)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--quick', action='store_true', help='1 timed repeat instead of 3')
  parser.add_argument('--repeats', type=int, default=None, help='timed repeats (median reported)')
  parser.add_argument('--cases', default='1,2,3', help='comma-separated cases to run (default: all)')
  args = parser.parse_args()
  cases = {int(c) for c in args.cases.split(',')}
  repeats = args.repeats or (1 if args.quick else 3)

  from recomp_jax.pretrained.demo import resolve_demo_model
  from transformers import AutoModelForCausalLM

  from recomp_jax.pretrained import load_pretrained
  from recomp_jax.pretrained.gguf import convert_to_hf_dir

  print(machine_line(), flush=True)
  peak = matmul_peak_gflops()
  print(f'measured fp32 matmul peak (jitted 4096^3 jnp.dot): {peak:.1f} GFLOP/s', flush=True)

  gguf = resolve_demo_model('', 'reader')
  hf_dir = convert_to_hf_dir(gguf)
  pretrained = load_pretrained(hf_dir)
  model, config, tokenizer = pretrained.model, pretrained.config, pretrained.tokenizer()
  hf32 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  hf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()

  text_ids = tokenizer(TEXT * 8, add_special_tokens=False)['input_ids']
  if 1 in cases:
    case_one(model, config, tokenizer, hf32, hf16, text_ids, peak, repeats)
  if 2 in cases:
    case_two(model, tokenizer, hf32, hf16, repeats)
  if 3 in cases:
    case_three(pretrained, hf32, hf16, text_ids, repeats)


def case_one(model, config, tokenizer, hf32, hf16, text_ids, peak, repeats):
  """16 x (256-token context + 8-token answer)."""
  from recomp_jax.reader.scoring import CausalScorer
  # --- case 1: 16 x (256-token context + 8-token answer) ------------------------------------
  contexts = [[tokenizer.bos_token_id] + text_ids[17 * i:17 * i + CONTEXT_LEN - 1] for i in range(BATCH)]
  answers = [text_ids[500 + 5 * i:500 + 5 * i + ANSWER_LEN] for i in range(BATCH)]
  assert all(len(c) == CONTEXT_LEN for c in contexts) and all(len(a) == ANSWER_LEN for a in answers)
  scorer = CausalScorer(model, tokenizer, batch_size=BATCH)
  inputs = hf_inputs(contexts, answers)

  ours = scorer.score_ids(contexts, answers).total
  reference = hf_answer_log_likelihood(hf32, *inputs)
  print(f'case 1: max |ours - HF fp32| over {BATCH} answer log-likelihoods: '
        f'{np.abs(ours - reference).max():.2e} (values {reference.min():.1f} .. {reference.max():.1f})',
        flush=True)
  t_ours = timeit(lambda: scorer.score_ids(contexts, answers).total, repeats=repeats)
  t_hf32 = timeit(lambda: hf_answer_log_likelihood(hf32, *inputs), repeats=repeats)
  t_hf16 = timeit(lambda: hf_answer_log_likelihood(hf16, *inputs), repeats=repeats)
  tokens = BATCH * (CONTEXT_LEN + ANSWER_LEN)
  case = f'{BATCH} x ({CONTEXT_LEN} context + {ANSWER_LEN} answer tokens)'
  print_table('Gemma 3 270M answer log-likelihood: examples/s',
              [{'case': case, 'ours': BATCH / t_ours, 'hf_fp32': BATCH / t_hf32,
                'hf_bf16': BATCH / t_hf16}], 'examples/s')
  print_table('Gemma 3 270M answer log-likelihood: tokens/s',
              [{'case': case, 'ours': tokens / t_ours, 'hf_fp32': tokens / t_hf32,
                'hf_bf16': tokens / t_hf16}], 'tokens/s')

  padded = scorer._length(CONTEXT_LEN + ANSWER_LEN)
  flops = {'ours fp32': (gemma_gflop(config, BATCH, padded, BATCH * scorer._slots(ANSWER_LEN)), t_ours),
           'HF fp32': (gemma_gflop(config, BATCH, CONTEXT_LEN + ANSWER_LEN, tokens), t_hf32),
           'HF bf16': (gemma_gflop(config, BATCH, CONTEXT_LEN + ANSWER_LEN, tokens), t_hf16)}
  lines = ['### Achieved matmul throughput (case 1)', '',
           f'| method | GFLOP executed | seconds | GFLOP/s | % of fp32 peak ({peak:.0f} GFLOP/s) |',
           '|---|---|---|---|---|']
  for name, (gflop, seconds) in flops.items():
    lines.append(f'| {name} | {gflop:.0f} | {seconds:.2f} | {gflop / seconds:.1f} | '
                 f'{100 * gflop / seconds / peak:.0f}% |')
  print('\n'.join(lines), flush=True)
  print(f'(ours pads {CONTEXT_LEN + ANSWER_LEN} -> {padded} tokens; the head runs at '
        f'{scorer._slots(ANSWER_LEN)} answer slots per row instead of all {CONTEXT_LEN + ANSWER_LEN} '
        'positions)', flush=True)

def case_two(model, tokenizer, hf32, hf16, repeats):
  """A shared 5-shot prefix and 20 candidate sentences."""
  from recomp_jax.reader.prompts import FEW_SHOT_PREFIX
  from recomp_jax.reader.scoring import CausalScorer
  words = TEXT.split()
  sentences = []
  for i in range(CANDIDATES):
    sentence_ids = tokenizer(' '.join(words[3 * i:] + words[:3 * i]),
                             add_special_tokens=False)['input_ids'][:SENTENCE_LEN]
    sentences.append(tokenizer.decode(sentence_ids).strip())
  suffixes = [f'{s}\n\n{QUESTION}\nAnswer:' for s in sentences]
  targets = [' the Mantaro River on the Cordillera Rumi Cruz'] * CANDIDATES
  prefix_ids = tokenizer(FEW_SHOT_PREFIX)['input_ids']
  suffix_ids = tokenizer(suffixes, add_special_tokens=False)['input_ids']
  target_ids = [t[:ANSWER_LEN] for t in tokenizer(targets, add_special_tokens=False)['input_ids']]
  full_ids = [prefix_ids + s for s in suffix_ids]
  shared_scorer = CausalScorer(model, tokenizer, batch_size=CANDIDATES)
  with_prefix = lambda: shared_scorer.score_ids_with_shared_prefix(prefix_ids, suffix_ids,
                                                                   target_ids).total
  without = lambda: shared_scorer.score_ids(full_ids, target_ids).total
  inputs2 = hf_inputs(full_ids, target_ids)
  a, b, c = with_prefix(), without(), hf_answer_log_likelihood(hf32, *inputs2)
  print(f'case 2: prefix {len(prefix_ids)} tokens, candidates {np.mean([len(s) for s in suffix_ids]):.1f} '
        f'+ {ANSWER_LEN} tokens; max |prefix cache - full strings| {np.abs(a - b).max():.2e}, '
        f'max |ours - HF fp32| {np.abs(b - c).max():.2e}', flush=True)
  t_with = timeit(with_prefix, repeats=repeats)
  t_without = timeit(without, repeats=repeats)
  t2_hf32 = timeit(lambda: hf_answer_log_likelihood(hf32, *inputs2), repeats=repeats)
  t2_hf16 = timeit(lambda: hf_answer_log_likelihood(hf16, *inputs2), repeats=repeats)
  print_table(f'Shared 5-shot prefix + {CANDIDATES} candidate sentences: candidates/s', [
      {'case': 'ours with prefix KV cache', 'ours': CANDIDATES / t_with,
       'hf_fp32': CANDIDATES / t2_hf32, 'hf_bf16': CANDIDATES / t2_hf16},
      {'case': 'ours on full strings', 'ours': CANDIDATES / t_without,
       'hf_fp32': CANDIDATES / t2_hf32, 'hf_bf16': CANDIDATES / t2_hf16},
  ], 'candidates/s')
  print(f'prefix cache vs full strings (ours): {t_without / t_with:.2f}x', flush=True)

def case_three(pretrained, hf32, hf16, text_ids, repeats):
  """16 prompts of ~300 tokens, 5 whole outputs (+ EOS) each: the FILCO ranked filter's shape."""
  from recomp_jax.compressors.filco import filter_prompt
  from recomp_jax.reader import Reader
  tokenizer = pretrained.tokenizer()
  prompts_n, outputs_n = 16, 5
  reader = Reader.from_model(pretrained.model, tokenizer, score_batch_size=32)
  passage = tokenizer.decode(text_ids[:260])
  sentences = [s.strip() + '.' for s in TEXT.split('. ') if s.strip()]
  prompts_text = [filter_prompt(f'{QUESTION} ({i})', passage) for i in range(prompts_n)]
  outputs = [[''] + [' ' + sentences[(i + j) % len(sentences)] for j in range(outputs_n - 1)]
             for i in range(prompts_n)]
  flat_prompts = [p for p, group in zip(prompts_text, outputs) for _ in group]
  flat_outputs = [o for group in outputs for o in group]
  prompt_ids = [tokenizer(p)['input_ids'] for p in flat_prompts]
  output_ids = [tokenizer(o, add_special_tokens=False)['input_ids'] + [tokenizer.eos_token_id]
                for o in flat_outputs]
  # HF holds [rows, T, 262144] float32 logits and their log-softmax: 4 rows keep that near 3 GB
  hf_batches = [hf_inputs(prompt_ids[i:i + 4], output_ids[i:i + 4]) for i in range(0, len(prompt_ids), 4)]

  def per_prompt():
    return np.concatenate(reader.output_loglik_per_prompt(prompts_text, outputs))

  def pairs():
    return reader.output_loglik(flat_prompts, flat_outputs)

  def hf(model):
    return np.concatenate([hf_answer_log_likelihood(model, *b) for b in hf_batches])

  a, b, c = per_prompt(), pairs(), hf(hf32)
  n = len(flat_outputs)
  print(f'case 3: {prompts_n} prompts of {np.mean([len(p) for p in prompt_ids]):.0f} tokens, {outputs_n} '
        f'outputs each of {np.mean([len(o) for o in output_ids]):.1f} tokens (EOS included); '
        f'max |per prompt - pairs| {np.abs(a - b).max():.2e}, max |ours - HF fp32| {np.abs(b - c).max():.2e}',
        flush=True)
  t_grouped = timeit(per_prompt, repeats=repeats)
  t_pairs = timeit(pairs, repeats=repeats)
  t_hf32 = timeit(lambda: hf(hf32), repeats=repeats)
  t_hf16 = timeit(lambda: hf(hf16), repeats=repeats)
  print_table(f'{prompts_n} prompts x {outputs_n} whole outputs (the FILCO ranked filter): outputs/s', [
      {'case': 'ours, each prompt encoded once', 'ours': n / t_grouped, 'hf_fp32': n / t_hf32,
       'hf_bf16': n / t_hf16},
      {'case': 'ours on full strings', 'ours': n / t_pairs, 'hf_fp32': n / t_hf32, 'hf_bf16': n / t_hf16},
  ], 'outputs/s')
  print(f'each prompt encoded once vs full strings (ours): {t_pairs / t_grouped:.2f}x', flush=True)

if __name__ == '__main__':
  main()
