"""What a compressor system supplies to the shared runner, and what the runner gives it.

The runner (:func:`recomp_jax.pipelines.runner.run`) owns everything the five systems
(RECOMP extractive and abstractive, FILCO, K-COMP, CoLoR) share: the head stages
(data -> retrieve -> candidates, :mod:`recomp_jax.pipelines.shared`), the one reader, the
evaluation of rows (:mod:`recomp_jax.evaluation.rows`) and the result files. A system is
one subclass of :class:`System` that overrides a few methods, as MaxText's post-training
hooks do for each method:

* :meth:`System.stages` -- its own cached stages (labelling, training, ...);
* :meth:`System.rows` -- the evaluation rows it reports beside the shared ones, each a
  function building evidence for the test questions (its ``compress`` at inference);
* :meth:`System.row_name`, :meth:`System.notes` -- how its rows and findings read.

The method itself -- labels, the loss, the compressor's ``compress`` -- lives in
``recomp_jax/compressors/<system>.py`` as pure functions with their own tests; the
system's pipeline module (``recomp_jax/pipelines/<system>.py``) only wires them into stages.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.util
import json
import os
from typing import Any, ClassVar, Sequence

from recomp_jax.data import formats, stage_records
from recomp_jax.data.schema import DataError, Example
from recomp_jax.evaluation.rows import Row


@dataclasses.dataclass
class Context:
  """A run as a system's stages see it.

  Attributes:
    config: the resolved ``ml_collections`` config.
    runner: the :class:`recomp_jax.stages.StageRunner` of the workdir.
    resources: the run's models (:class:`recomp_jax.pipelines.shared.Resources`).
    summaries: stage name -> summary of every stage that has run (head stages first).
    outputs: what the system's stages handed forward (:attr:`Handoff.outputs`), for its rows.
  """
  config: Any
  runner: Any
  resources: Any
  summaries: dict = dataclasses.field(default_factory=dict)
  outputs: dict = dataclasses.field(default_factory=dict)

  def stage_dir(self, name: str) -> str:
    return self.runner.stage_dir(name)

  def examples(self, split: str) -> list[Example]:
    """The ``split`` examples with their retrieved (and reranked) documents."""
    return stage_records.read_examples(os.path.join(self.stage_dir('retrieve'), f'{split}.jsonl'))

  def candidates(self, split: str) -> dict[str, list[str]]:
    """``{example id: candidate sentences}`` of ``split`` (``'dev_all'``: dev, uncapped)."""
    return stage_records.load_candidates(self.stage_dir('candidates'), split)


EXPORT_FILE = 'compressor.json'
# Fields of a compressor.json that are paths, stored relative to its directory.
EXPORT_PATHS = ('model', 'encoder', 'tokenizer')


def write_export(directory: str, spec: dict) -> str:
  """Writes ``{directory}/compressor.json`` (:func:`recomp_jax.load_compressor` reads it): the
  system's inference fields, path fields relative to ``directory``. Returns the file's path."""
  os.makedirs(directory, exist_ok=True)
  spec = {k: os.path.relpath(v, directory) if k in EXPORT_PATHS else v for k, v in spec.items()}
  path = os.path.join(directory, EXPORT_FILE)
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    json.dump(spec, f, indent=2)
  os.replace(path + '.tmp', path)
  return path


def read_export(directory: str) -> dict:
  """The fields of ``{directory}/compressor.json`` with its paths made absolute.

  Raises:
    DataError: a missing or damaged file, or one without a ``system`` field (file and line named).
  """
  path = os.path.join(directory, EXPORT_FILE)
  if not os.path.exists(path):
    raise DataError(path, None, None, 'no such file: an exported compressor directory holds one '
                    '(every run writes {workdir}/compressor/)')
  spec = formats.read_json(path)
  if not isinstance(spec, dict) or not isinstance(spec.get('system'), str):
    raise DataError(path, 1, 'system', 'missing (the system that trained the compressor)')
  return {k: os.path.normpath(os.path.join(directory, v)) if k in EXPORT_PATHS else v for k, v in spec.items()}


def load_exported(directory: str, systems: Sequence[str] | None = None):
  """The compressor exported to ``directory``: ``recomp_jax.compressors.<system>.load(spec)``, an
  object with ``compress(questions, documents) -> list[str]``.

  ``systems``: the systems accepted (None: any with a method module). A system's method module is
  found by name, so no module here imports a system.

  Raises:
    DataError: no ``compressor.json``, or one naming a system not accepted or without a module.
  """
  spec = read_export(directory)
  name = spec['system']
  known = importlib.util.find_spec(f'recomp_jax.compressors.{name}') is not None if name.isidentifier() else False
  if (systems is not None and name not in systems) or not known:
    accepted = ', '.join(systems) if systems is not None else 'the systems of recomp_jax.compressors'
    raise DataError(os.path.join(directory, EXPORT_FILE), 1, 'system', f'{name!r} is not one of {accepted}')
  return importlib.import_module(f'recomp_jax.compressors.{name}').load(spec)


@dataclasses.dataclass(frozen=True)
class Handoff:
  """What a system's :meth:`System.stages` hands to the evaluation.

  Attributes:
    deps: the stage names the evaluate stage depends on (their fingerprints enter its own).
    outputs: what the rows read from those stages (e.g. ``{'train_dirs': {seed: directory}}``);
      the runner puts it in :attr:`Context.outputs`. Nothing else travels from stages to rows.
  """
  deps: tuple[str, ...] = ()
  outputs: dict = dataclasses.field(default_factory=dict)


class System(abc.ABC):
  """One compressor system on the shared pipeline.

  Class attributes:
    name: the system's name (``config.system``, ``results.json['system']``).
    row_keys: every row key the system can report, in table order (shared keys included).
    code: modules the system's evaluation runs (their source hash enters the
      evaluate stage's fingerprint).
    compared_rows: the rows the paired bootstrap compares with every other row.
    fields: the system's own config section (:class:`recomp_jax.config_fields.Field`); the
      runner checks a config against these and the shared fields before any work.
  """

  name: ClassVar[str]
  row_keys: ClassVar[tuple[str, ...]]
  code: ClassVar[tuple[str, ...]] = ()
  fields: ClassVar[tuple] = ()
  compared_rows: ClassVar[tuple[str, ...]] = ('trained',)

  def validate(self, config) -> None:
    """Checks the config before any work (raise ``PipelineError`` with a clear message)."""

  @abc.abstractmethod
  def stages(self, ctx: Context) -> Handoff:
    """Runs the system's stages after the head; returns what the evaluation depends on and reads."""

  def evaluation_inputs(self, ctx: Context) -> dict:
    """Config values beyond ``config.eval`` and the reader that change the evaluation."""
    return {}

  @abc.abstractmethod
  def rows(self, ctx: Context, examples: Sequence[Example], directory: str) -> list[Row]:
    """The rows to evaluate on ``examples`` (the test split), in table order.

    ``directory`` is the evaluate stage's directory, for anything the rows need computed
    first (oracle labels, a tuned threshold): write it there so a resumed run reuses it.
    """

  @abc.abstractmethod
  def row_name(self, key: str, config) -> str:
    """The display name of row ``key``."""

  def output_key(self, key: str, config) -> str:
    """The key row ``key`` has in ``results.json`` (default: itself)."""
    del config
    return key

  def evaluation_summary(self, ctx: Context, examples: Sequence[Example], directory: str) -> dict:
    """Extra fields for the evaluate stage's summary. Runs inside that stage once every row is
    evaluated, so it may read what :meth:`rows` and the rows wrote into ``directory``; later
    steps (:meth:`extra_tables`, :meth:`notes`) read the summary, not those files."""
    return {}

  def trained_questions(self, ctx: Context) -> int:
    """Questions the compressor was trained on (0 if the run trains nothing)."""
    return 0

  def extra_tables(self, ctx: Context, records: dict[str, dict]) -> list[dict]:
    """Tables ``{title, header, rows}`` beyond the rows table, from the evaluated ``records``
    (row id -> its record of :func:`recomp_jax.evaluation.rows.evaluate_rows`)."""
    return []

  def export(self, ctx: Context, directory: str) -> dict | None:
    """The run's compressor for :func:`recomp_jax.load_compressor`: the fields of its
    ``compressor.json`` (paths absolute; the runner writes the file into ``directory``, where this
    method may put what the fields point to), or None when the run has no compressor to export."""
    return None

  def notes(self, config, summaries: dict) -> list[str]:
    """Sentences for the results file (dev-side choices, what was tuned where)."""
    return []

  def results_fields(self, config, summaries: dict) -> dict:
    """Extra top-level fields of ``results.json`` (beyond the schema's)."""
    return {}
