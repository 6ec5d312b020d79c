"""Command-line entry point: ``python -m recomp_jax.main --config=configs/X.py[:preset]``.

Only flags live here; ``config.system`` names the compressor system that
:func:`recomp_jax.pipelines.runner.run` drives. Any config field can be
overridden, e.g. ``--config.reader.model=/path/to/gemma --config.train.batch_size=64``.
``--help`` lists the systems, the presets of every config file and every config field.

A user error (bad data, an unknown config field, a field the chosen preset ignores, an
unreadable checkpoint) prints one ``error: ...`` line and exits with status 2. Library
log noise (Orbax checkpoint INFO lines, JAX's "Unable to initialize backend" probes) is
hidden unless ``--verbosity=1`` or higher.

Before anything else the process re-executes itself once with jemalloc preloaded when the
machine has it (:mod:`recomp_jax.allocator` says why), told to
keep freed pages for the extractive system and to return them after a second for the systems
that fine-tune Gemma (:func:`recomp_jax.allocator.jemalloc_conf_for`); ``MALLOC_CONF`` in the
environment wins, and ``RECOMP_JAX_ALLOCATOR=system`` turns the relaunch off.
"""

from __future__ import annotations

import ast
import glob
import logging as std_logging
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file('config', None, 'Experiment config file (configs/*.py[:preset]).',
                                lock_config=True)
flags.DEFINE_string('workdir', None, 'Where stages, checkpoints, summaries and results are written '
                    '(default: config.workdir); gs://... is mirrored on local disk '
                    '(recomp_jax/storage.py).')
flags.DEFINE_string('local_workdir', None, 'The local mirror of a remote --workdir (default: '
                    '~/.cache/recomp_jax/workdirs/NAME-HASH).')

_NOISY_SOURCES = (os.sep + 'orbax' + os.sep, 'xla_bridge.py')


class UserError(Exception):
  """A mistake in what the user asked for; main prints it and exits with status 2."""


class _HideLibraryNoise(std_logging.Filter):
  """Drops INFO records of Orbax, httpx and JAX's backend probing (warnings and errors pass)."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno >= std_logging.WARNING:
      return True
    if 'Unable to initialize backend' in record.getMessage() or record.name.startswith('httpx'):
      return False  # JAX's backend probes; one line per teacher request
    return not any(s in record.pathname for s in _NOISY_SOURCES)


def _user_errors() -> tuple[type[BaseException], ...]:
  from recomp_jax.pretrained.hf import CheckpointError  # pylint: disable=import-outside-toplevel
  from recomp_jax.data.schema import DataError  # pylint: disable=import-outside-toplevel
  from recomp_jax.pipelines.shared import PipelineError  # pylint: disable=import-outside-toplevel
  from recomp_jax.config_fields import ConfigError  # pylint: disable=import-outside-toplevel
  return (UserError, ConfigError, DataError, CheckpointError, PipelineError, FileNotFoundError)


# ----------------------------------------------------------------------------- argv checks


def _load_config_file(spec: str):
  from recomp_jax import config_fields  # pylint: disable=import-outside-toplevel
  path, _, preset = spec.partition(':')
  if not os.path.exists(path):
    raise UserError(f'--config={spec}: no such config file {path!r}')
  try:
    return config_fields.load_config_file(path, preset or None)
  except ValueError as e:  # unknown preset
    raise UserError(f'--config={spec}: {e}') from None


def check_overrides(argv: list[str]):
  """Unknown ``--config.X`` fields, fields of another system and fields the preset ignores
  (:attr:`recomp_jax.config_fields.Field.read_when`) are user errors.

  Returns:
    The preset's config, before the overrides (None when there is no ``--config``).
  """
  from recomp_jax import config_fields  # pylint: disable=import-outside-toplevel
  from recomp_jax.pipelines import runner  # pylint: disable=import-outside-toplevel
  spec = next((a.split('=', 1)[1] for a in argv if a.startswith('--config=')), None)
  if spec is None:
    if any(a.startswith('--config.') for a in argv) or not any(a in ('--help', '-h') for a in argv):
      raise UserError('--config=configs/FILE.py[:preset] is required (see --help)')
    return None
  config = _load_config_file(spec)
  overrides = {}
  for arg in argv:
    if arg.startswith('--config.'):
      name, _, value = arg[len('--config.'):].partition('=')
      overrides[name] = value
  system = config.get('system')
  names = sorted(runner.SYSTEMS) + sorted(runner.TASKS)
  if system not in names:
    raise UserError(f'--config={spec}: config.system={system!r} is not one of {names}')
  others = {n: runner.system_fields(n) for n in names if n != system}
  try:
    for name in overrides:
      config_fields.check_override(name, overrides, config, runner.system_fields(system), system, others)
  except config_fields.ConfigError as e:
    raise UserError(str(e)) from None
  return config


# ----------------------------------------------------------------------------- help


def _presets(path: str) -> str:
  """The presets a config file's docstring lists (lines ``  name: ...``)."""
  with open(path) as f:
    doc = ast.get_docstring(ast.parse(f.read())) or ''
  names = []
  for line in doc.splitlines():
    stripped = line.strip()
    if line.startswith('  ') and not line.startswith('    ') and ':' in stripped:
      head = stripped.split(':', 1)[0]
      if head.isidentifier():
        names.append(head)
  return ', '.join(names) or '(see the file)'


def help_text() -> str:
  """Usage, the systems, every config file's presets and every config field with its help
  (generated from the typed sections: :mod:`recomp_jax.config_fields`)."""
  from recomp_jax import config_fields  # pylint: disable=import-outside-toplevel
  from recomp_jax.pipelines import runner  # pylint: disable=import-outside-toplevel
  from recomp_jax.pipelines.defaults import SHARED_FIELDS  # pylint: disable=import-outside-toplevel
  lines = ['usage: python -m recomp_jax.main --config=configs/FILE.py[:preset] [--config.FIELD=VALUE ...]',
           '                                  [--workdir=DIR|gs://BUCKET/DIR] [--local_workdir=DIR]',
           '                                  [--verbosity=1]', '',
           'systems (config.system): ' + ', '.join(sorted(runner.SYSTEMS) + sorted(runner.TASKS)), '',
           'config files and presets:']
  for path in sorted(glob.glob(os.path.join('configs', '*.py'))):
    lines.append(f'  {path}: {_presets(path)}')
  lines += ['', 'shared config fields (every system; presets change some defaults):']
  lines += config_fields.help_lines(SHARED_FIELDS)
  shared_names = {f.name for f in SHARED_FIELDS}
  for name in sorted(runner.SYSTEMS) + sorted(runner.TASKS):
    own = [f for f in runner.system_fields(name) if f.name not in shared_names]
    if name in runner.TASKS:
      read = {f.name.split('.')[0] for f in runner.system_fields(name) if f.name in shared_names and '.' in f.name}
      lines += ['', f'{name} task fields (of the shared ones it reads only {", ".join(sorted(read))} and the '
                'top-level fields):']
    else:
      lines += ['', f'{name} system fields (its rows, eval.rows: {", ".join(runner.get_system(name).row_keys)}):']
    lines += config_fields.help_lines(own)
  lines += ['', 'Results go to WORKDIR/results.json, results.md and predictions.jsonl.']
  return '\n'.join(lines)


# ----------------------------------------------------------------------------- main


def _batch_size_fields(config, prefix: str = 'config') -> dict[str, int]:
  """Every ``batch_size`` field of a nested config (``{'config.train.batch_size': 64, ...}``):
  global training batch sizes, of which each process feeds ``batch_size / process_count`` rows."""
  fields = {}
  for key, value in config.items():
    if key == 'batch_size' and isinstance(value, int):
      fields[f'{prefix}.{key}'] = value
    elif hasattr(value, 'items'):
      fields.update(_batch_size_fields(value, f'{prefix}.{key}'))
  return fields


def _check_process_count_divides_batches(config) -> None:
  """Raises :class:`UserError` at start-up when the processes cannot split a training batch."""
  import jax  # pylint: disable=import-outside-toplevel
  count = jax.process_count()
  wrong = {f: v for f, v in _batch_size_fields(config).items() if v % count}
  if wrong:
    raise UserError(f'{count} processes cannot split the global batch: '
                    + ', '.join(f'{f}={v}' for f, v in wrong.items())
                    + f' (each must be a multiple of {count})')


def main(argv):
  del argv
  if flags.FLAGS.verbosity < 1:
    logging.get_absl_handler().addFilter(_HideLibraryNoise())
    for name in ('jax._src.xla_bridge', 'orbax', 'absl'):
      std_logging.getLogger(name).addFilter(_HideLibraryNoise())
  config = flags.FLAGS.config
  workdir = flags.FLAGS.workdir or config.get('workdir') or os.path.join('workdirs', config.system)
  from recomp_jax import sharding  # pylint: disable=import-outside-toplevel
  sharding.maybe_initialize_distributed()
  from recomp_jax import allocator  # pylint: disable=import-outside-toplevel
  logging.info('system %s, workdir %s, %s', config.system, workdir, allocator.describe())
  try:
    _check_process_count_divides_batches(config)
    from recomp_jax.pipelines import runner  # pylint: disable=import-outside-toplevel
    runner.run(config, workdir, local_workdir=flags.FLAGS.local_workdir)
  except _user_errors() as e:
    print(f'error: {e}', file=sys.stderr, flush=True)
    sys.exit(2)


def run(argv: list[str] | None = None) -> None:
  """Checks the command line, then runs :func:`main` under absl."""
  from_command_line = argv is None
  argv = list(sys.argv if argv is None else argv)
  if any(a in ('--help', '-h', '--helpshort') for a in argv[1:]):
    print(help_text())
    sys.exit(0)
  try:
    config = check_overrides(argv[1:])
    if from_command_line:  # once, before JAX allocates anything (the new process checks again)
      from recomp_jax import allocator  # pylint: disable=import-outside-toplevel
      allocator.relaunch_with_allocator(
          allocator.jemalloc_conf_for(config.get('system') if config is not None else None))
  except (UserError, FileNotFoundError) as e:
    print(f'error: {e}', file=sys.stderr)
    sys.exit(2)
  app.run(main, argv=argv)


if __name__ == '__main__':
  run()
