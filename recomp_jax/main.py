"""Command-line entry point: ``python -m recomp_jax.main --config=configs/X.py[:preset]``.

Only flags live here; ``config.task`` names the pipeline that runs. Overrides
work from the command line, e.g. ``--config.reader.model=/path/to/gemma``.
"""

from __future__ import annotations

import importlib
import os

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file('config', None, 'Experiment config file (configs/*.py[:preset]).',
                                lock_config=True)
flags.DEFINE_string('workdir', None, 'Where stages, checkpoints, summaries and results are written '
                    '(default: config.workdir).')
flags.mark_flags_as_required(['config'])

# config.task -> 'module:function' taking (config, workdir).
TASKS = {
    'extractive': 'recomp_jax.pipelines.extractive:run',
}


def main(argv):
  del argv
  config = flags.FLAGS.config
  workdir = flags.FLAGS.workdir or config.get('workdir') or os.path.join('workdirs', config.task)
  from recomp_jax import sharding
  sharding.maybe_initialize_distributed()
  if config.task not in TASKS:
    raise app.UsageError(f'config.task={config.task!r} is not one of {sorted(TASKS)}')
  module_name, function_name = TASKS[config.task].split(':')
  logging.info('task %s, workdir %s', config.task, workdir)
  getattr(importlib.import_module(module_name), function_name)(config, workdir)


if __name__ == '__main__':
  app.run(main)
