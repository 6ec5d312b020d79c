"""The OpenAI-compatible server under load: ours (a real server process, the real ``openai``
client) vs HF ``generate`` on the same prompts.

    python benchmarks/serve.py [--requests 32] [--max-tokens 32] [--document-words 0]
                               [--clients 1,8,32] [--skip-hf-single]

Model: the PyPI Gemma 3 270M (fp32). Prompts: ``--requests`` different completion prompts
(~20 tokens), greedy, ``max_tokens`` new tokens each. Ours: 1 client sending them one
after another, then 8 and 32 concurrent clients (the engine batches what arrives
together). HF: ``generate`` one prompt at a time, then all prompts as one left-padded batch.
Every configuration runs once untimed first (compilation), then is timed.

``--fresh`` instead times what a fresh server's first clients see: a new server process for each
of 8 sequential and 8 concurrent clients sending their first requests, with the start-up warm-up
of ``--warmup-prompt-tokens`` (and ``--max-tokens`` new tokens) and without one (the server's
default), start-up time reported.

``--document-words N`` puts N words of document text before each prompt (the teacher
stage's shape: HotpotQA's prompts average ~700 tokens with 64 new tokens, e.g.
``--requests 16 --document-words 450 --max-tokens 64 --clients 8 --skip-hf-single``), so
prefill rather than decoding dominates.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line  # noqa: E402

import torch  # noqa: E402

TOPICS = ('the Amazon river', 'the moon landing', 'volcanoes', 'the printing press', 'honey bees',
          'the Roman empire', 'glaciers', 'the violin')


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def start_server(model_dir: str, port: int, args=('--max-batch=32',)) -> subprocess.Popen:
  import httpx
  process = subprocess.Popen([sys.executable, '-m', 'recomp_jax.serve', f'--model={model_dir}',
                              '--model-id=bench', f'--port={port}', '--max-queue=128', '--batch-window-ms=20', *args],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  for _ in range(600):
    try:
      if httpx.get(f'http://127.0.0.1:{port}/health', timeout=1).status_code == 200:
        return process
    except httpx.HTTPError:
      time.sleep(0.5)
  process.kill()
  raise RuntimeError('the server did not start')


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('--requests', type=int, default=32)
  parser.add_argument('--max-tokens', type=int, default=32)
  parser.add_argument('--document-words', type=int, default=0, help='document words before each prompt')
  parser.add_argument('--clients', default='1,8,32', help='client counts for ours (1 = sequential)')
  parser.add_argument('--skip-hf-single', action='store_true', help='no HF one-prompt-at-a-time row')
  parser.add_argument('--fresh', action='store_true', help="time a fresh server's first 8 sequential / concurrent "
                      'clients, with and without the start-up warm-up')
  parser.add_argument('--warmup-prompt-tokens', default='16', help='--fresh: the prompt lengths of the warm-up '
                      'compared with none (the default prompts are ~15 tokens: bucket 16)')
  args = parser.parse_args()
  client_counts = [int(c) for c in args.clients.split(',')]

  from recomp_jax.pretrained.demo import resolve_demo_model
  import openai
  from transformers import AutoModelForCausalLM, AutoTokenizer

  from recomp_jax.pretrained.gguf import convert_to_hf_dir

  print(machine_line(), flush=True)
  gguf = resolve_demo_model('', 'reader')
  model_dir = convert_to_hf_dir(gguf)
  prompts = [f'Here are {i % 5 + 3} facts about {TOPICS[i % len(TOPICS)]}. Fact {i % 3 + 1}:'
             for i in range(args.requests)]
  if args.document_words:
    words = ('the river rises in the northern hills and flows south through farmland towns and a '
             'wide delta where the city was founded by traders in the twelfth century').split()
    prompts = [f"Document: {' '.join(words[(i + j) % len(words)] for j in range(args.document_words))}\n{p}"
               for i, p in enumerate(prompts)]
  if args.fresh:
    fresh_servers(model_dir, prompts[:8], args)
    return
  port = _free_port()
  server = start_server(model_dir, port)
  client = openai.OpenAI(base_url=f'http://127.0.0.1:{port}/v1', api_key='none', max_retries=0,
                         timeout=1200)

  def ask(prompt):
    reply = client.completions.create(model='bench', prompt=prompt, max_tokens=args.max_tokens,
                                      temperature=0)
    return reply.choices[0].text, reply.usage.completion_tokens

  def run_ours(clients: int):
    if clients == 1:
      return [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
      return list(pool.map(ask, prompts))

  rows, texts = [], {}
  try:
    for clients in client_counts:
      run_ours(clients)  # compile the shapes this load produces
      start = time.perf_counter()
      out = run_ours(clients)
      seconds = time.perf_counter() - start
      texts[clients] = [t for t, _ in out]
      tokens = sum(n for _, n in out)
      rows.append((f'ours, {clients} client{"s" if clients > 1 else ""}'
                   f'{" (sequential)" if clients == 1 else " (concurrent)"}', seconds, tokens))
  finally:
    server.terminate()
    server.wait(timeout=30)

  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

  def hf_generate(batch):
    enc = tokenizer(batch, padding=True, padding_side='left', return_tensors='pt')
    with torch.inference_mode():
      out = hf.generate(**enc, do_sample=False, max_new_tokens=args.max_tokens,
                        pad_token_id=tokenizer.pad_token_id)
    new = out[:, enc['input_ids'].shape[1]:]
    return [tokenizer.decode(r, skip_special_tokens=True) for r in new], int(
        (new != tokenizer.pad_token_id).sum())

  singles = None
  if not args.skip_hf_single:
    hf_generate(prompts[:1])
    start = time.perf_counter()
    singles = [hf_generate([p]) for p in prompts]
    rows.append(('HF generate, one prompt at a time', time.perf_counter() - start,
                 sum(n for _, n in singles)))
  hf_generate(prompts)
  start = time.perf_counter()
  batched_texts, batched_tokens = hf_generate(prompts)
  rows.append((f'HF generate, one batch of {len(prompts)}', time.perf_counter() - start,
               batched_tokens))

  first = client_counts[0]
  same = ', '.join(f'{c} clients {sum(a == b for a, b in zip(texts[c], texts[first]))}/{len(prompts)}'
                   for c in client_counts[1:])
  hf_texts = [t for t, _ in singles] if singles is not None else batched_texts
  agree = sum(a == b for a, b in zip(texts[first], hf_texts))
  print(f'{len(prompts)} prompts ({args.document_words} document words), {args.max_tokens} new tokens each, '
        f'greedy; answers equal to those of {first} client(s): {same or "-"}; ours ({first} client(s)) == HF '
        f'{"one at a time" if singles is not None else "one batch"}: {agree}/{len(prompts)}', flush=True)
  hf_single = rows[-2][2] / rows[-2][1] if singles is not None else None
  hf_batch = rows[-1][2] / rows[-1][1]
  lines = ['### Serving: the same prompts, greedy', '',
           '| case | requests/s | completion tokens/s | vs HF one at a time | vs HF one batch |',
           '|---|---|---|---|---|']
  for name, seconds, tokens in rows:
    rate = tokens / seconds
    single = f'{rate / hf_single:.2f}x' if hf_single else '-'
    lines.append(f'| {name} | {len(prompts) / seconds:.2f} | {rate:.1f} | {single} | {rate / hf_batch:.2f}x |')
  print('\n'.join(lines), flush=True)


def fresh_servers(model_dir: str, prompts: list[str], args) -> None:
  """A new server per case; its first requests timed (compilation included, as a user sees it)."""
  import openai
  warmups = [(args.warmup_prompt_tokens, (f'--warmup-prompt-tokens={args.warmup_prompt_tokens}',
                                          f'--warmup-max-tokens={args.max_tokens}')),
             ('none', ())]
  lines = ['### A fresh server: its first requests (compilation included)', '',
           f'{len(prompts)} completion prompts, {args.max_tokens} new tokens each, greedy, --max-batch=16.', '',
           '| warm-up | start-up to /health (s) | 8 sequential (s) | 8 concurrent (s) |', '|---|---|---|---|']
  for name, flags in warmups:
    cells = []
    for clients in (1, len(prompts)):
      port = _free_port()
      start = time.perf_counter()
      server = start_server(model_dir, port, ('--max-batch=16', f'--max-new-tokens={max(args.max_tokens, 128)}',
                                              *flags))
      started = time.perf_counter() - start
      client = openai.OpenAI(base_url=f'http://127.0.0.1:{port}/v1', api_key='none', max_retries=0, timeout=1200)

      def ask(prompt, client=client):
        return client.completions.create(model='bench', prompt=prompt, max_tokens=args.max_tokens, temperature=0)

      try:
        start = time.perf_counter()
        if clients == 1:
          for p in prompts:
            ask(p)
        else:
          with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            list(pool.map(ask, prompts))
        cells.append(time.perf_counter() - start)
      finally:
        server.terminate()
        server.wait(timeout=30)
      if clients == 1:
        startup = started
    lines.append(f'| {name} | {startup:.1f} | {cells[0]:.1f} | {cells[1]:.1f} |')
    print(lines[-1], flush=True)
  print('\n'.join(lines), flush=True)


if __name__ == '__main__':
  main()
