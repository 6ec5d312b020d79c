"""One process of a (possibly multi-process) training run of the extractive compressor.

    python tests/_multihost_worker.py --workdir W --steps 10 --checkpoint-every 3 \
        [--num-processes 2 --process-id 0 --coordinator localhost:PORT] --devices 4 \
        [--pause-at 7] [--out params.npz]

Trains a tiny BERT dual encoder with the extractive system's contrastive loss
(``compressors.extractive.contrastive_loss_fn``) through ``training.loop.train`` on a
``data=2, fsdp=2, tensor=2`` mesh over all processes' devices. Each process feeds only its
rows of every global batch (``ArrayIterator`` with JAX's process slot); checkpoints are
written collectively by Orbax into the shared ``W/checkpoints``. Prints ``STEP n``,
``PAUSED n`` (then sleeps, waiting to be killed), ``RESUMED n`` and ``DONE n``; process 0
writes the final parameters, gathered from all processes, to ``--out``.
"""

import argparse
import os
import sys
import time

GLOBAL_BATCH = 16


def synthetic_pairs(num_examples: int = 64, slots: int = 3, seed: int = 0):
  """Token arrays in the layout of ``extractive.pair_arrays`` (slot 0 the positive)."""
  import numpy as np
  rng = np.random.RandomState(seed)
  query_ids = rng.randint(5, 99, size=(num_examples, 8)).astype(np.int32)
  passage_ids = rng.randint(5, 99, size=(num_examples, slots, 10)).astype(np.int32)
  passage_ids[:, 0, :4] = query_ids[:, :4]  # the positive shares tokens with its question
  query_mask = (np.arange(8) < rng.randint(4, 9, size=(num_examples, 1))).astype(np.int32)
  passage_mask = (np.arange(10) < rng.randint(5, 11, size=(num_examples, slots, 1))).astype(np.int32)
  return {
      'query_ids': query_ids, 'query_mask': query_mask,
      'passage_ids': passage_ids, 'passage_mask': passage_mask,
      'passage_valid': np.ones((num_examples, slots), bool),
      'query_key': np.arange(num_examples, dtype=np.int32),
      'passage_key': np.arange(num_examples * slots, dtype=np.int32).reshape(num_examples, slots) + 1000,
  }


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--checkpoint-every', type=int, default=3)
  parser.add_argument('--pause-at', type=int, default=0)
  parser.add_argument('--devices', type=int, default=8, help='CPU devices of this process')
  parser.add_argument('--num-processes', type=int, default=1)
  parser.add_argument('--process-id', type=int, default=0)
  parser.add_argument('--coordinator', default='')
  parser.add_argument('--out', default='')
  args = parser.parse_args()

  # Must precede the first jax import.
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={args.devices}').strip()
  import jax
  jax.config.update('jax_default_matmul_precision', 'highest')
  if args.num_processes > 1:
    jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                               process_id=args.process_id)
  import numpy as np
  from flax import nnx
  from jax.experimental import multihost_utils

  from recomp_jax.compressors import extractive
  from recomp_jax.models.bert import BertConfig, BertModel
  from recomp_jax.models.dual_encoder import DualEncoder
  from recomp_jax.training import loop as train_lib

  def make_model():
    config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=48, max_position_embeddings=64, type_vocab_size=2)
    return DualEncoder(BertModel(config, rngs=nnx.Rngs(7)), pooling='mean')

  config = train_lib.TrainConfig(
      num_steps=args.steps, seed=3, log_every=5, checkpoint_every=args.checkpoint_every,
      keep_checkpoints=2, progress_bar=False,
      mesh=train_lib.sharding_lib.MeshConfig(2, 2, 2),
      optimizer=train_lib.OptimizerConfig(learning_rate=3e-3, warmup_steps=2, schedule='cosine',
                                          weight_decay=0.1))
  iterator = train_lib.ArrayIterator(synthetic_pairs(), batch_size=GLOBAL_BATCH, seed=5)
  print(f'ROWS {iterator.process_index}/{iterator.process_count} '
        f'{GLOBAL_BATCH // iterator.process_count}', flush=True)
  checkpoint_dir = os.path.join(args.workdir, 'checkpoints')

  def report(step, state, guard):
    del state, guard
    print(f'STEP {step}', flush=True)
    if step == args.pause_at:
      newest = (step // args.checkpoint_every) * args.checkpoint_every
      deadline = time.time() + 60
      while newest and not os.path.isdir(os.path.join(checkpoint_dir, str(newest))):
        if time.time() > deadline:
          break
        time.sleep(0.05)
      print(f'PAUSED {step}', flush=True)
      time.sleep(300)  # until the test kills this process

  loss_fn = extractive.contrastive_loss_fn(temperature=0.1, similarity='dot')
  result = train_lib.train(config, make_model, loss_fn, iterator, workdir=args.workdir,
                           callbacks=[report])
  if result.resumed_from is not None:
    print(f'RESUMED {result.resumed_from}', flush=True)
  params = multihost_utils.process_allgather(result.state.params, tiled=True)
  if args.out and jax.process_index() == 0:
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    np.savez(args.out, **{jax.tree_util.keystr(path): np.asarray(v) for path, v in flat})
  print(f'DONE {result.step}', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
