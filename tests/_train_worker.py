"""A training run in its own process, for the kill / SIGTERM / resume tests of test_train.py.

    python tests/_train_worker.py --workdir W --steps 10 --checkpoint-every 3 \
        [--pause-at 7] [--devices 8 --mesh 2,2,2] --out params.npz

Prints ``STEP n`` after every step, ``PAUSED n`` when it reaches ``--pause-at``
(then sleeps until SIGTERM or SIGKILL arrives; with SIGTERM the loop saves and
stops), ``RESUMED n`` when it restarted from a checkpoint, and at the end
``DONE n`` or ``PREEMPTED n``; the final parameters go to ``--out``.
"""

import argparse
import os
import sys
import time


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--steps', type=int, default=10)
  parser.add_argument('--checkpoint-every', type=int, default=3)
  parser.add_argument('--pause-at', type=int, default=0)
  parser.add_argument('--devices', type=int, default=1)
  parser.add_argument('--mesh', default='1,1,1')
  parser.add_argument('--out', default='')
  args = parser.parse_args()

  # Must precede the first jax import.
  os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                             f' --xla_force_host_platform_device_count={args.devices}').strip()
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import jax
  jax.config.update('jax_default_matmul_precision', 'highest')
  import numpy as np

  import tiny_models
  from recomp_jax.training import loop as train_lib

  data, fsdp, tensor = (int(x) for x in args.mesh.split(','))
  config = train_lib.TrainConfig(
      num_steps=args.steps, seed=3, log_every=5, checkpoint_every=args.checkpoint_every,
      keep_checkpoints=2, progress_bar=False,
      mesh=train_lib.sharding_lib.MeshConfig(data, fsdp, tensor),
      optimizer=train_lib.OptimizerConfig(learning_rate=3e-3, warmup_steps=2, schedule='cosine',
                                          weight_decay=0.1))
  iterator = train_lib.ArrayIterator(tiny_models.token_data(48), batch_size=16, seed=5)
  checkpoint_dir = os.path.join(args.workdir, 'checkpoints')

  def report(step, state, guard):
    del state
    print(f'STEP {step}', flush=True)
    if step == args.pause_at:
      # Pause only once the newest checkpoint is committed, so the kill lands *between* saves.
      newest = (step // args.checkpoint_every) * args.checkpoint_every
      deadline = time.time() + 30
      while newest and not os.path.isdir(os.path.join(checkpoint_dir, str(newest))):
        if time.time() > deadline:
          break
        time.sleep(0.05)
      print(f'PAUSED {step}', flush=True)
      deadline = time.time() + 120
      while not guard.requested and time.time() < deadline:
        time.sleep(0.05)

  result = train_lib.train(config, lambda: tiny_models.make_model(7), tiny_models.lm_loss, iterator,
                           workdir=args.workdir, callbacks=[report])
  if result.resumed_from is not None:
    print(f'RESUMED {result.resumed_from}', flush=True)
  if args.out:
    flat = jax.tree_util.tree_flatten_with_path(jax.device_get(result.state.params))[0]
    np.savez(args.out, **{jax.tree_util.keystr(path): np.asarray(v) for path, v in flat})
  print(f'{"PREEMPTED" if result.preempted else "DONE"} {result.step}', flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main())
