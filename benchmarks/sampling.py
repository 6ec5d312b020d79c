"""Drawing one token per row from a 262k-token vocabulary: the sampling part of a decode step.

    python benchmarks/sampling.py [--vocab 262144] [--batch 8,16] [--repeats 20]

Ours (``generation.inverse_cdf_sample``: two uniforms per row over blocked cumulative sums)
against ``jax.random.categorical`` (one Gumbel number per vocabulary entry, what the sampler
used before) and ``torch.multinomial`` (the obvious PyTorch way), on the same probabilities.
For scale, the Gemma 3 270M output head (``[B, 640] x [640, V]``) is timed too: the step's
fixed cost that sampling adds to.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, timeit  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from recomp_jax.models import generation  # noqa: E402


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--vocab', type=int, default=262144)
  parser.add_argument('--batch', default='8,16')
  parser.add_argument('--repeats', type=int, default=20)
  args = parser.parse_args()
  print(machine_line())
  print(f'vocabulary {args.vocab}, median of {args.repeats} calls after one untimed call\n')
  print('| batch | ours inverse CDF (ms) | jax.random.categorical (ms) | torch.multinomial (ms) | '
        'output head matmul (ms) | categorical / ours |')
  print('|---|---|---|---|---|---|')
  for batch in (int(b) for b in args.batch.split(',')):
    logits = jax.random.normal(jax.random.key(0), (batch, args.vocab)) * 3.0
    probs = jax.nn.softmax(logits, axis=-1)
    keys = jax.random.split(jax.random.key(1), batch)
    ours = jax.jit(generation.inverse_cdf_sample)
    gumbel = jax.jit(lambda k, lg: jax.vmap(lambda key, row: jax.random.categorical(key, row))(k, lg))
    hidden = jax.random.normal(jax.random.key(2), (batch, 640))
    weight = jax.random.normal(jax.random.key(3), (640, args.vocab))
    head = jax.jit(lambda h, w: h @ w)
    probs_torch = torch.from_numpy(np.array(probs))
    t_ours = timeit(lambda: ours(probs, keys), repeats=args.repeats)
    t_gumbel = timeit(lambda: gumbel(keys, logits), repeats=args.repeats)
    t_torch = timeit(lambda: torch.multinomial(probs_torch, 1), repeats=args.repeats)
    t_head = timeit(lambda: head(hidden, weight), repeats=args.repeats)
    print(f'| {batch} | {1e3 * t_ours:.1f} | {1e3 * t_gumbel:.1f} | {1e3 * t_torch:.1f} | {1e3 * t_head:.1f} | '
          f'{t_gumbel / t_ours:.1f}x |')


if __name__ == '__main__':
  main()
