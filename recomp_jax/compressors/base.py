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
import os
from typing import Any, ClassVar, Sequence

from recomp_jax.data import stage_records
from recomp_jax.data.schema import Example
from recomp_jax.evaluation.rows import Row


@dataclasses.dataclass
class Context:
  """A run as a system's stages see it.

  Attributes:
    config: the resolved ``ml_collections`` config.
    runner: the :class:`recomp_jax.stages.StageRunner` of the workdir.
    resources: the run's models (:class:`recomp_jax.pipelines.shared.Resources`).
    summaries: stage name -> summary of every stage that has run (head stages first).
  """
  config: Any
  runner: Any
  resources: Any
  summaries: dict = dataclasses.field(default_factory=dict)

  def stage_dir(self, name: str) -> str:
    return self.runner.stage_dir(name)

  def examples(self, split: str) -> list[Example]:
    """The ``split`` examples with their retrieved (and reranked) documents."""
    return stage_records.read_examples(os.path.join(self.stage_dir('retrieve'), f'{split}.jsonl'))

  def candidates(self, split: str) -> dict[str, list[str]]:
    """``{example id: candidate sentences}`` of ``split`` (``'dev_all'``: dev, uncapped)."""
    return stage_records.load_candidates(self.stage_dir('candidates'), split)


class System(abc.ABC):
  """One compressor system on the shared pipeline.

  Class attributes:
    name: the system's name (``config.system``, ``results.json['system']``).
    row_keys: every row key the system can report, in table order (shared keys included).
    code: modules the system's evaluation runs (their source hash enters the
      evaluate stage's fingerprint).
    compared_rows: the rows the paired bootstrap compares with every other row.
  """

  name: ClassVar[str]
  row_keys: ClassVar[tuple[str, ...]]
  code: ClassVar[tuple[str, ...]] = ()
  compared_rows: ClassVar[tuple[str, ...]] = ('trained',)

  def validate(self, config) -> None:
    """Checks the config before any work (raise ``PipelineError`` with a clear message)."""

  @abc.abstractmethod
  def stages(self, ctx: Context) -> tuple[str, ...]:
    """Runs the system's stages after the head; returns the names evaluation depends on."""

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

  def evaluation_summary(self, ctx: Context, examples: Sequence[Example]) -> dict:
    """Extra fields for the evaluate stage's summary (after :meth:`rows` ran)."""
    return {}

  def trained_questions(self, ctx: Context) -> int:
    """Questions the compressor was trained on (0 if the run trains nothing)."""
    return 0

  def extra_tables(self, ctx: Context, records: dict[str, dict]) -> list[dict]:
    """Tables ``{title, header, rows}`` beyond the rows table, from the evaluated ``records``
    (row id -> its record of :func:`recomp_jax.evaluation.rows.evaluate_rows`)."""
    return []

  def notes(self, config, summaries: dict) -> list[str]:
    """Sentences for the results file (dev-side choices, what was tuned where)."""
    return []

  def results_fields(self, config, summaries: dict) -> dict:
    """Extra top-level fields of ``results.json`` (beyond the schema's)."""
    return {}
