"""One process of a multi-process run of two pipeline stages (``StageRunner``).

    python tests/_stages_worker.py --workdir W --num-processes 2 --process-id I \
        --coordinator 127.0.0.1:PORT [--stop-after N] [--remote R]

``items`` is a file stage (``collective=False``: process 0 alone writes ``items.json``);
``score`` is a resumable collective stage: for every item, all processes join one
all-gather (as a stage that scores with the sharded reader does), and the result goes to
a ``ResumableJsonl``. With ``--stop-after N`` every process exits abruptly after N
records, as a killed run does. Prints one ``RESULT {json}`` line: which stage functions
ran here, the summaries and the timings. With ``--remote R`` the workdir is the remote one
``R`` (:mod:`recomp_jax.storage`) and ``W`` its local mirror (``W-process1`` on process 1).
"""

import argparse
import json
import os


def main() -> int:
  parser = argparse.ArgumentParser()
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--num-processes', type=int, required=True)
  parser.add_argument('--process-id', type=int, required=True)
  parser.add_argument('--coordinator', required=True)
  parser.add_argument('--stop-after', type=int, default=0)
  parser.add_argument('--remote', default=None)
  args = parser.parse_args()
  os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=1'
  import jax
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                             process_id=args.process_id)
  import numpy as np
  from jax.experimental import multihost_utils

  from recomp_jax import sharding, storage
  from recomp_jax.stages import ResumableJsonl, StageRunner

  if args.remote:
    runner = StageRunner(storage.mirror_root(args.remote, args.workdir,
                                             process_index=jax.process_index()), remote=args.remote)
  else:
    runner = StageRunner(args.workdir)
  ran = []

  def items_stage(directory):
    ran.append('items')
    with open(os.path.join(directory, 'items.json'), 'w') as f:
      json.dump(list(range(8)), f)
    return {'items': 8}

  def score_stage(directory):
    ran.append('score')
    with open(os.path.join(runner.stage_dir('items'), 'items.json')) as f:
      items = json.load(f)
    out = ResumableJsonl(os.path.join(directory, 'scores.jsonl'))
    for item in items:
      if item in out:
        continue
      gathered = multihost_utils.process_allgather(np.int32(item * 10 + jax.process_index()))
      out.append({'id': item, 'gathered': [int(x) for x in np.ravel(gathered)]})
      if args.stop_after and len(out) == args.stop_after:
        os._exit(3)  # killed mid-stage
    out.close()
    with sharding.open_on_main(os.path.join(directory, 'writer.txt')) as f:
      f.write(str(jax.process_index()))
    return {'records': len(out), 'total': sum(sum(r['gathered']) for r in out.records.values())}

  summaries = {'items': runner.run('items', {'n': 8}, items_stage, collective=False)}
  summaries['score'] = runner.run('score', {}, score_stage, deps=('items',), resumable=True)
  print('RESULT ' + json.dumps({'process': jax.process_index(), 'ran': ran, 'summaries': summaries,
                                'timings': runner.timings}), flush=True)
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
