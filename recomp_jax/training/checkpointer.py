"""Training checkpoints: Orbax ``CheckpointManager`` with async saves and exact resume.

A checkpoint at step ``s`` holds two items:

* ``state`` — the training pytree (params, optimizer state, step, RNG key,
  ...), written with ``ocp.args.StandardSave`` (every process writes its own
  shards) and restored *directly into the target shardings* from an abstract
  tree of ``jax.ShapeDtypeStruct(..., sharding=...)``;
* ``meta`` — JSON (``ocp.args.JsonSave``): the data iterator's position and
  anything else small.

Retention: the last ``keep_last`` checkpoints **and** the ``keep_best`` best
by an eval metric (Orbax ``AnyPreservationPolicy(LatestN, BestN)``; the
plain ``max_to_keep`` + ``best_fn`` options would keep only the best).

Robustness: Orbax writes into a temporary directory and renames it when the
save is complete, so a half-written checkpoint is never listed. A listed
checkpoint that fails to read (a truncated or deleted file) is skipped with a
warning and the previous one is used; the unreadable ones newer than it are
deleted so the resumed run can save those steps again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import warnings
from typing import Any, Mapping

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from recomp_jax import storage

logger = logging.getLogger(__name__)


class CheckpointRestoreError(RuntimeError):
  """No checkpoint in the directory could be read."""


def _is_key(x: Any) -> bool:
  return hasattr(x, 'dtype') and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def keys_to_data(tree: Any) -> Any:
  """Typed PRNG keys -> their raw ``uint32`` data (Orbax stores plain arrays)."""
  return jax.tree.map(lambda x: jax.random.key_data(x) if _is_key(x) else x, tree)


def data_to_keys(tree: Any, like: Any) -> Any:
  """Inverse of :func:`keys_to_data`, using the key implementation of the leaves of ``like``."""

  def one(x, ref):
    if not _is_key(ref):
      return x
    impl = jax.random.key_impl(ref) if isinstance(ref, jax.Array) else getattr(ref.dtype, '_impl', None)
    return jax.random.wrap_key_data(x, impl=impl)

  return jax.tree.map(one, tree, like)


def abstract_of(tree: Any) -> Any:
  """``jax.ShapeDtypeStruct`` (with sharding) for every array leaf; typed keys as raw key data."""

  def one(x):
    sharding = getattr(x, 'sharding', None)
    if _is_key(x):
      data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
      return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=sharding)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(one, tree)


@dataclasses.dataclass
class Restored:
  """What :meth:`Checkpointer.restore` returns."""
  step: int
  tree: Any
  meta: dict


def _metric_of(name: str):
  def get(metrics: Mapping[str, Any]) -> float:
    value = metrics.get(name)
    # A checkpoint whose metric is missing or NaN never wins.
    return float('nan') if value is None else float(value)
  return get


class Checkpointer:
  """Saves and restores the training pytree plus JSON metadata, one directory per step.

  Args:
    directory: where step directories ``<step>/`` are written.
    keep_last: how many most recent checkpoints to keep.
    best_metric: metric name (as passed to :meth:`save`) that ranks checkpoints;
      ``None`` keeps only the last ``keep_last``.
    best_mode: ``'min'`` or ``'max'``.
    keep_best: how many best checkpoints to keep in addition to the last ones.
    async_save: write in a background thread (``save`` returns once the arrays
      are copied to host memory, so the caller may donate them right away).
  """

  def __init__(self, directory: str | os.PathLike, *, keep_last: int = 3,
               best_metric: str | None = None, best_mode: str = 'min', keep_best: int = 1,
               async_save: bool = True):
    if best_mode not in ('min', 'max'):
      raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
    directory = os.fspath(directory)
    self.directory = directory if storage.is_remote(directory) else os.path.abspath(directory)
    self.best_metric = best_metric
    keep: list[policies.PreservationPolicy] = [policies.LatestN(n=keep_last)]
    best_fn = None
    if best_metric is not None:
      best_fn = _metric_of(best_metric)
      keep.append(policies.BestN(get_metric_fn=self._rank_key(best_fn, best_mode),
                                 reverse=False, n=keep_best, keep_checkpoints_without_metrics=False))
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policies.AnyPreservationPolicy(keep),
        best_fn=best_fn, best_mode=best_mode,
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=True,
        create=True)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  @staticmethod
  def _rank_key(best_fn, best_mode):
    """Ascending key where larger is better and NaN is worst (BestN keeps the largest)."""
    def key(metrics):
      value = best_fn(metrics)
      if math.isnan(value):
        return -math.inf
      return value if best_mode == 'max' else -value
    return key

  # ------------------------------------------------------------------------- queries

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def best_step(self) -> int | None:
    """The best step by ``best_metric`` (the latest if no metric is tracked)."""
    return self.manager.best_step()

  # ------------------------------------------------------------------------- save / restore

  def save(self, step: int, tree: Any, *, meta: Mapping[str, Any] | None = None,
           metrics: Mapping[str, float] | None = None) -> bool:
    """Starts saving ``tree`` (any pytree of arrays) and ``meta`` (JSON) at ``step``.

    Returns False when a checkpoint for ``step`` already exists.
    """
    if step in self.manager.all_steps():
      return False
    metrics = None if metrics is None else {k: float(v) for k, v in metrics.items()}
    args = ocp.args.Composite(state=ocp.args.StandardSave(keys_to_data(tree)),
                              meta=ocp.args.JsonSave(dict(meta or {})))
    return self.manager.save(step, args=args, metrics=metrics, force=True)

  def restore(self, abstract_tree: Any, step: int | None = None) -> Restored | None:
    """Restores the newest readable checkpoint (or exactly ``step``) into ``abstract_tree``.

    Args:
      abstract_tree: the target pytree; leaves are arrays or
        ``jax.ShapeDtypeStruct`` s whose ``sharding`` says where each restored
        array goes (see :func:`abstract_of`). Typed PRNG keys are restored as
        typed keys.
      step: a specific step; no fallback when given.
    Returns:
      :class:`Restored`, or ``None`` when the directory has no checkpoint.
    Raises:
      CheckpointRestoreError: checkpoints exist but none could be read.
    """
    self.manager.reload()
    target = abstract_of(abstract_tree)
    candidates = [step] if step is not None else sorted(self.manager.all_steps(), reverse=True)
    if not candidates:
      return None
    failures = []
    for candidate in candidates:
      try:
        out = self.manager.restore(candidate, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 -- any unreadable file means: try the previous one
        failures.append(f'step {candidate}: {type(e).__name__}: {e}')
        if step is None:
          warnings.warn(f'checkpoint {storage.join(self.directory, str(candidate))} is unreadable '
                        f'({type(e).__name__}: {str(e)[:300]}); falling back to an earlier one',
                        RuntimeWarning, stacklevel=2)
        continue
      broken_newer = [s for s in self.manager.all_steps() if s > candidate]
      for bad in broken_newer:
        logger.warning('deleting unreadable checkpoint %d', bad)
        self.manager.delete(bad)
      tree = data_to_keys(out.state, abstract_tree)
      return Restored(step=candidate, tree=tree, meta=dict(out.meta or {}))
    raise CheckpointRestoreError(f'no readable checkpoint in {self.directory}:\n  ' +
                                 '\n  '.join(failures))

  def wait(self) -> None:
    """Blocks until pending async saves are committed."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()

  def __enter__(self) -> 'Checkpointer':
    return self

  def __exit__(self, *exc) -> None:
    self.close()
