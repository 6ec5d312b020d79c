"""The training loop: one jitted, sharded train step and a resumable loop around it.

Contract for the loss::

    loss_fn(model: nnx.Module, batch, rng: jax.Array | None) -> (loss [], aux {name: []})

a pure function of its arguments (the model is rebuilt from the train state
inside the step). ``rng`` is a fresh key per step (and per microbatch); it is
``None`` in evaluation, meaning "deterministic, no dropout". ``aux`` holds
scalar metrics; an ``aux['num_tokens']`` (summed over microbatches, like every
``num_*`` key) gives the loop its tokens/s. A loss that is a mean over items
(target tokens, sequences) says how many in ``aux[LOSS_WEIGHT]``
(:data:`recomp_jax.training.losses.LOSS_WEIGHT`): microbatches and evaluation
batches are then combined weighted by it, so that a token-mean loss accumulated
over microbatches is the token mean of the whole batch, gradient included (with
equal weights, a microbatch of two one-token targets would count as much as one
of two 48-token targets). The other aux metrics are averaged with the same
weights; without the key every microbatch and batch weighs the same.

Pieces, usable on their own:

* :class:`TrainState` — graphdef + params + model state + optimizer state +
  step + RNG key (+ non-finite counters), a pytree whose static part is the
  graphdef and the optax transformation;
* :func:`create_train_state` — sharded (or abstract, for restoring) state from
  a model factory or a concrete model;
* :func:`make_train_step` — ``jax.jit(step, in_shardings, out_shardings,
  donate_argnums=0)``: gradient accumulation, global-norm clipping, AdamW, and
  skipping of updates whose loss or gradient is not finite;
* :func:`make_loss_evaluator` — an ``eval_fn`` averaging ``loss_fn`` over
  held-out batches;
* :class:`ArrayIterator` (from :mod:`recomp_jax.data.iterators`, re-exported) — a
  deterministic, epoch-shuffled iterator over in-memory arrays implementing the
  :class:`ResumableIterator` protocol;
* :func:`train` — the loop: checkpoints (async, last-K + best, exact resume
  of step / params / optimizer / RNG / data position), TensorBoard, tqdm,
  evaluation, SIGTERM (preemption) handling and the non-finite guard.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from recomp_jax import allocator, storage
from recomp_jax import sharding as sharding_lib
from recomp_jax.data.iterators import ArrayIterator, EpochBatchPosition, epoch_order  # noqa: F401 (re-exported)
from recomp_jax.training.checkpointer import Checkpointer
from recomp_jax.training.losses import LOSS_WEIGHT
from recomp_jax.training.optim import OptimizerConfig, applied_updates, learning_rate_schedule, make_optimizer
from recomp_jax.training.summaries import MeanAccumulator, MetricWriter, format_metrics

logger = logging.getLogger(__name__)

LossFn = Callable[[nnx.Module, Any, jax.Array | None], tuple[jax.Array, Mapping[str, jax.Array]]]
EvalFn = Callable[[nnx.Module, int], Mapping[str, float]]


class NonFiniteError(FloatingPointError):
  """Too many consecutive steps had a non-finite loss or gradient."""


# --------------------------------------------------------------------------- config


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything the loop needs besides the model, the loss and the data.

  Attributes:
    num_steps: optimizer steps of the whole run (resumed runs continue to it).
    seed: base RNG key for initialisation and per-step randomness.
    log_every: steps between TensorBoard / progress-bar updates.
    eval_every: steps between evaluations (0: only at the end).
    checkpoint_every: steps between checkpoints (0: only at the end and on
      preemption).
    keep_checkpoints: how many most recent checkpoints are kept.
    best_metric: eval metric (``'eval/<name>'``) ranking checkpoints; the
      ``keep_best`` best are kept in addition to the recent ones. A checkpoint
      is written at every evaluation when it is set.
    best_mode: ``'min'`` or ``'max'``.
    keep_best: how many best checkpoints to keep.
    async_checkpointing: write checkpoints in a background thread.
    max_consecutive_nonfinite: stop with :class:`NonFiniteError` after this
      many skipped updates in a row.
    progress_bar: show tqdm (process 0 only).
    profile_steps: trace this many steps with the JAX profiler, starting after the
      first (compiling) step of the run, into ``workdir/tensorboard`` (TensorBoard's
      profile tab, with ``tensorboard-plugin-profile``); process 0 only; 0: off.
    mesh: ``data`` / ``fsdp`` / ``tensor`` sizes (-1 = fill).
    optimizer: :class:`recomp_jax.training.optim.OptimizerConfig`.
  """
  num_steps: int = 1000
  seed: int = 0
  log_every: int = 50
  eval_every: int = 0
  checkpoint_every: int = 1000
  keep_checkpoints: int = 3
  best_metric: str | None = None
  best_mode: str = 'min'
  keep_best: int = 1
  async_checkpointing: bool = True
  max_consecutive_nonfinite: int = 10
  progress_bar: bool = True
  profile_steps: int = 0
  mesh: sharding_lib.MeshConfig = sharding_lib.MeshConfig()
  optimizer: OptimizerConfig = OptimizerConfig()

  @classmethod
  def from_config(cls, config: Any) -> 'TrainConfig':
    """From a ``TrainConfig``, a (nested) mapping or an ``ml_collections.ConfigDict``."""
    if isinstance(config, cls):
      return config
    items = dict(config) if isinstance(config, Mapping) else dict(config.items())
    unknown = set(items) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f'unknown train options {sorted(unknown)}')
    mesh = items.get('mesh', sharding_lib.MeshConfig())
    if not isinstance(mesh, sharding_lib.MeshConfig):
      mesh = sharding_lib.MeshConfig(**{k: int(sharding_lib.config_value(mesh, k, d))
                                       for k, d in dataclasses.asdict(sharding_lib.MeshConfig()).items()})
    items['mesh'] = mesh
    items['optimizer'] = OptimizerConfig.from_config(items.get('optimizer'))
    return cls(**items)


# --------------------------------------------------------------------------- train state


@flax.struct.dataclass
class TrainState:
  """The whole training state as one pytree.

  Attributes:
    step: ``[]`` int32, steps taken (including skipped non-finite ones).
    params: pure dict of the ``nnx.Param`` values (float32 master weights).
    model_state: pure dict of the model's other variables (RNG streams, ...).
    opt_state: the optax state (moments shaped and sharded like ``params``).
    rng: typed PRNG key; step ``s`` uses ``fold_in(rng, s)``.
    nonfinite_total: ``[]`` int32, updates skipped so far.
    nonfinite_consecutive: ``[]`` int32, updates skipped in a row.
    graphdef: static NNX graph definition of the model.
    tx: static optax transformation.
  """
  step: jax.Array
  params: Any
  model_state: Any
  opt_state: optax.OptState
  rng: jax.Array
  nonfinite_total: jax.Array
  nonfinite_consecutive: jax.Array
  graphdef: nnx.GraphDef = flax.struct.field(pytree_node=False)
  tx: optax.GradientTransformation = flax.struct.field(pytree_node=False)

  def model(self) -> nnx.Module:
    """The model viewing this state's arrays (invalid once the state is donated to a step)."""
    return nnx.merge(self.graphdef, self.params, self.model_state)

  def checkpoint_tree(self) -> dict:
    """The array fields as a plain dict (what is saved)."""
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
            if f.metadata.get('pytree_node', True)}

  def replace_from_checkpoint(self, tree: Mapping[str, Any]) -> 'TrainState':
    return self.replace(**tree)


def _split(model: nnx.Module) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """``(graphdef, params, rest)`` with ``rest`` every non-``Param`` variable."""
  return nnx.split(model, nnx.Param, ...)


def _optimizer_shardings(tx: optax.GradientTransformation, abstract_opt_state: Any,
                         param_shardings: Any, mesh: Mesh) -> Any:
  """Optimizer-state shardings: parameter-shaped leaves like their parameter, the rest replicated."""
  return optax.tree_map_params(tx, lambda _, s: s, abstract_opt_state, param_shardings,
                               transform_non_params=lambda _: sharding_lib.replicated(mesh),
                               is_leaf=lambda x: isinstance(x, NamedSharding))


def create_train_state(model: nnx.Module | Callable[[], nnx.Module],
                       optimizer: OptimizerConfig | optax.GradientTransformation, mesh: Mesh, *,
                       seed: int = 0, total_steps: int | None = None,
                       rules: Sequence[tuple[str, Any]] = sharding_lib.LOGICAL_AXIS_RULES,
                       abstract: bool = False) -> TrainState:
  """A sharded :class:`TrainState` on ``mesh``.

  Args:
    model: a factory ``() -> nnx.Module`` (parameters are created already
      sharded, inside one jit) or a concrete module such as
      ``load_pretrained(...).model``, whose arrays are moved onto the mesh in
      place and then owned by the state (the module must not be used after
      the first train step, which donates them).
    optimizer: an :class:`OptimizerConfig` (AdamW, see :mod:`recomp_jax.training.optim`)
      or any optax transformation.
    mesh: the device mesh.
    seed: RNG seed of ``state.rng``.
    total_steps: end of the learning-rate decay when the config leaves it unset.
    rules: logical-axis rules.
    abstract: return ``jax.ShapeDtypeStruct`` leaves (with shardings) instead
      of arrays -- the restore target when resuming; nothing is allocated.
  """
  if isinstance(model, nnx.Module):
    graphdef, params, rest = _split(model)
  else:
    graphdef, params, rest = _split(nnx.merge(*sharding_lib.abstract_model(model)))
  tx = (make_optimizer(optimizer, params, total_steps) if isinstance(optimizer, OptimizerConfig)
        else optimizer)
  param_shardings = nnx.to_pure_dict(sharding_lib.state_shardings(params, mesh, rules))
  rest_shardings = nnx.to_pure_dict(sharding_lib.state_shardings(rest, mesh, rules))
  abstract_params = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                                 nnx.to_pure_dict(params))
  opt_shardings = _optimizer_shardings(tx, jax.eval_shape(tx.init, abstract_params),
                                       param_shardings, mesh)
  scalar = sharding_lib.replicated(mesh)

  def assemble(params_dict, rest_dict):
    return TrainState(step=jnp.zeros((), jnp.int32), params=params_dict, model_state=rest_dict,
                      opt_state=tx.init(params_dict), rng=jax.random.key(seed),
                      nonfinite_total=jnp.zeros((), jnp.int32),
                      nonfinite_consecutive=jnp.zeros((), jnp.int32), graphdef=graphdef, tx=tx)

  shardings = TrainState(step=scalar, params=param_shardings, model_state=rest_shardings,
                         opt_state=opt_shardings, rng=scalar, nonfinite_total=scalar,
                         nonfinite_consecutive=scalar, graphdef=graphdef, tx=tx)

  if isinstance(model, nnx.Module):
    if abstract:
      out = jax.eval_shape(assemble, nnx.to_pure_dict(params), nnx.to_pure_dict(rest))
      return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), out, shardings)
    # Leaf-by-leaf move with donation: the module's own buffers become the state's.
    sharding_lib.place_on_mesh(model, mesh, rules)
    _, params, rest = _split(model)
    params_dict, rest_dict = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    with sharding_lib.use_mesh(mesh, rules):
      fresh = jax.jit(lambda p: assemble(p, {}).replace(params=None, model_state=None),
                      out_shardings=shardings.replace(params=None, model_state=None))(params_dict)
    return fresh.replace(params=params_dict, model_state=rest_dict)

  def init_from_factory():
    _, p, r = _split(model())
    return assemble(nnx.to_pure_dict(p), nnx.to_pure_dict(r))

  if abstract:
    out = jax.eval_shape(init_from_factory)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), out, shardings)
  with sharding_lib.use_mesh(mesh, rules):
    return jax.jit(init_from_factory, out_shardings=shardings)()


# --------------------------------------------------------------------------- the step


def _microbatches(batch: Any, num: int, batch_axes: Any) -> Any:
  """``[B, ...] -> [num, B / num, ...]`` taking rows ``i, i + num, ...`` for microbatch ``i``.

  Strided selection keeps every microbatch spread over all batch shards (a
  device's contiguous rows split evenly), so no data moves between devices.
  """

  def one(x):
    if x.shape[0] % num:
      raise ValueError(f'batch size {x.shape[0]} is not divisible by grad_accum_steps={num}')
    x = x.reshape((x.shape[0] // num, num) + x.shape[1:])
    x = jnp.moveaxis(x, 1, 0)
    if batch_axes is not None:
      x = jax.lax.with_sharding_constraint(x, PartitionSpec(None, batch_axes))
    return x

  return jax.tree.map(one, batch)


def _is_count(name: str) -> bool:
  """Aux metrics that are summed over microbatches and batches (the rest are weighted means)."""
  return name.startswith('num_') or name == LOSS_WEIGHT


_TOTAL_WEIGHT = '_total_weight'  # the summed weights, private to _weighted_totals / _totals_to_means


def _weight_of(aux: Mapping[str, jax.Array]) -> jax.Array:
  """The weight of one (micro)batch's loss and mean metrics: ``aux[LOSS_WEIGHT]``, else 1."""
  return jnp.asarray(aux.get(LOSS_WEIGHT, 1.0), jnp.float32)


def _weighted_totals(loss: jax.Array, aux: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """``{'loss', **aux}`` of one (micro)batch, means multiplied by its weight, counts as they are.

  Sums of these over (micro)batches give, through :func:`_totals_to_means`, the loss and the
  metrics of the union of the (micro)batches.
  """
  weight = _weight_of(aux)
  out = {_TOTAL_WEIGHT: weight, 'loss': jnp.asarray(loss, jnp.float32) * weight}
  for name, value in aux.items():
    value = jnp.asarray(value, jnp.float32)
    out[name] = value if _is_count(name) else value * weight
  return out


def _divisor(total_weight: jax.Array) -> jax.Array:
  """A total weight to divide weighted sums by: 1 where it is 0 (a batch without targets),
  so its means are 0 rather than NaN."""
  return jnp.where(total_weight > 0, total_weight, 1.0)


def _totals_to_means(totals: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
  """Summed :func:`_weighted_totals` -> ``{'loss', **aux}`` as weighted means."""
  divisor = _divisor(totals[_TOTAL_WEIGHT])
  return {name: value if _is_count(name) else value / divisor
          for name, value in totals.items() if name != _TOTAL_WEIGHT}


def loss_and_grads(loss_fn: LossFn, graphdef: nnx.GraphDef, params: Any, model_state: Any,
                   batch: Any, rng: jax.Array, *, grad_accum_steps: int = 1,
                   batch_axes: Any = None) -> tuple[jax.Array, dict, Any, Any]:
  """Loss, aux metrics, updated model state and float32 gradients for one (accumulated) batch.

  With ``grad_accum_steps = k > 1`` the batch is split into ``k`` microbatches
  scanned sequentially (activations of one microbatch live at a time); losses,
  gradients and mean metrics are averaged weighted by each microbatch's
  ``aux[LOSS_WEIGHT]`` (equal weights without it), so that a token-mean loss and
  its gradient equal those of the whole batch.

  Returns:
    ``(loss [], aux {name: []}, model_state, grads like params)``.
  """

  def compute(p, state, micro, key):
    model = nnx.merge(graphdef, p, state)
    loss, aux = loss_fn(model, micro, key)
    _, _, new_state = _split(model)
    return loss.astype(jnp.float32), (dict(aux), nnx.to_pure_dict(new_state))

  grad_fn = jax.value_and_grad(compute, has_aux=True)
  if grad_accum_steps == 1:
    (loss, (aux, model_state)), grads = grad_fn(params, model_state, batch, rng)
    return loss, aux, model_state, grads

  micro = _microbatches(batch, grad_accum_steps, batch_axes)

  def body(carry, xs):
    grads_sum, state = carry
    micro_batch, index = xs
    (loss, (aux, state)), grads = grad_fn(params, state, micro_batch, jax.random.fold_in(rng, index))
    weight = _weight_of(aux)
    grads_sum = jax.tree.map(lambda a, g: a + weight * g.astype(a.dtype), grads_sum, grads)
    return (grads_sum, state), _weighted_totals(loss, aux)

  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params)
  (grads_sum, model_state), totals = jax.lax.scan(
      body, (zeros, model_state), (micro, jnp.arange(grad_accum_steps)))
  totals = jax.tree.map(lambda v: v.sum(0), totals)
  divisor = _divisor(totals[_TOTAL_WEIGHT])
  grads = jax.tree.map(lambda g, p: (g / divisor).astype(p.dtype), grads_sum, params)
  aux = _totals_to_means(totals)
  return aux.pop('loss'), aux, model_state, grads


def make_train_step(loss_fn: LossFn, state_shardings: TrainState, batch_sharding: NamedSharding, *,
                    grad_accum_steps: int = 1,
                    learning_rate_fn: optax.Schedule | None = None,
                    donate: bool = True) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
  """The jitted, sharded training step ``(state, batch) -> (state, metrics)``.

  The update is applied only when the loss and the gradient norm are finite;
  otherwise params, optimizer state and model state are kept (selected with
  ``jnp.where`` inside the jitted step, so no host round trip) and the
  non-finite counters advance.

  Args:
    loss_fn: see the module docstring.
    state_shardings: a :class:`TrainState` of ``NamedSharding`` s
      (``sharding.shardings_of(state)``); used for inputs and outputs.
    batch_sharding: sharding of every batch leaf (``sharding.batch_sharding(mesh)``).
    grad_accum_steps: microbatches per update.
    learning_rate_fn: the schedule, only to report ``learning_rate``.
    donate: donate the input state's buffers to the output.
  Returns:
    The jitted step; metrics are ``[]`` arrays: ``loss``, ``grad_norm``,
    ``learning_rate`` (if known), ``nonfinite`` (1 if skipped),
    ``nonfinite_total``, ``nonfinite_consecutive`` and the loss's aux metrics.
  """
  batch_axes = batch_sharding.spec[0] if len(batch_sharding.spec) else None

  def step(state: TrainState, batch: Any) -> tuple[TrainState, dict]:
    rng = jax.random.fold_in(state.rng, state.step)
    loss, aux, model_state, grads = loss_and_grads(
        loss_fn, state.graphdef, state.params, state.model_state, batch, rng,
        grad_accum_steps=grad_accum_steps, batch_axes=batch_axes)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)

    keep_if_finite = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    skipped = (~finite).astype(jnp.int32)
    new_state = state.replace(
        step=state.step + 1,
        params=keep_if_finite(params, state.params),
        opt_state=keep_if_finite(opt_state, state.opt_state),
        model_state=keep_if_finite(model_state, state.model_state),
        nonfinite_total=state.nonfinite_total + skipped,
        nonfinite_consecutive=jnp.where(finite, 0, state.nonfinite_consecutive + 1))
    metrics = {name: jnp.asarray(value, jnp.float32) for name, value in aux.items()}
    metrics.update(loss=loss, grad_norm=grad_norm, nonfinite=skipped,
                   nonfinite_total=new_state.nonfinite_total,
                   nonfinite_consecutive=new_state.nonfinite_consecutive)
    if learning_rate_fn is not None:
      metrics['learning_rate'] = jnp.asarray(learning_rate_fn(applied_updates(state.opt_state)),
                                             jnp.float32)
    return new_state, metrics

  return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, None), donate_argnums=0 if donate else ())


def make_eval_step(loss_fn: LossFn, state_shardings: TrainState,
                   batch_sharding: NamedSharding) -> Callable[[TrainState, Any], dict]:
  """Jitted ``(state, batch) -> {'loss', **aux}`` with ``rng=None`` (deterministic)."""

  def step(state: TrainState, batch: Any) -> dict:
    loss, aux = loss_fn(state.model(), batch, None)
    return {'loss': loss.astype(jnp.float32), **{k: jnp.asarray(v, jnp.float32) for k, v in aux.items()}}

  return jax.jit(step, in_shardings=(state_shardings, batch_sharding), out_shardings=None)


def make_loss_evaluator(loss_fn: LossFn, batches: Callable[[], Iterator[Any]], mesh: Mesh) -> EvalFn:
  """An ``eval_fn(model, step)`` averaging ``loss_fn`` (with ``rng=None``) over ``batches()``.

  ``batches`` returns a fresh iterable of per-process numpy batches each
  time. Batches are weighted by their ``aux[LOSS_WEIGHT]`` (a token-mean loss is
  then the token mean of the whole set); a loss without it weighs every batch
  equally (so use equal-sized batches, e.g. ``ArrayIterator(..., num_epochs=1)``
  with ``drop_remainder=True``). ``num_*`` aux counts are summed over batches.
  """
  cache: dict[Any, Callable] = {}

  def evaluate(model: nnx.Module, step: int) -> dict[str, float]:
    del step
    graphdef, params, rest = _split(model)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    key = graphdef
    if key not in cache:
      in_shardings = (sharding_lib.shardings_of(params), sharding_lib.shardings_of(rest),
                      sharding_lib.batch_sharding(mesh))

      def weighted_metrics_of(p, r, batch):
        loss, aux = loss_fn(nnx.merge(graphdef, p, r), batch, None)
        return _weighted_totals(loss, aux)

      cache[key] = jax.jit(weighted_metrics_of, in_shardings=in_shardings)
    totals = None
    for batch in batches():  # accumulated on device: no host sync per batch
      values = cache[key](params, rest, sharding_lib.shard_batch(batch, mesh))
      totals = values if totals is None else jax.tree.map(jnp.add, totals, values)
    if totals is None:
      raise ValueError('the evaluation iterator yielded no batches')
    return {k: float(v) for k, v in jax.device_get(_totals_to_means(totals)).items()}

  return evaluate


# --------------------------------------------------------------------------- data


@runtime_checkable
class ResumableIterator(Protocol):
  """An iterator of per-process numpy batches whose position can be saved and restored.

  ``get_state()`` returns a small JSON-serialisable dict describing the
  position *after* the last batch returned; ``set_state(s)`` makes the next
  ``next()`` return what it would have returned then. The state must be the
  same on every process (it is saved once, by process 0).
  """

  def __iter__(self) -> Iterator[Any]: ...

  def __next__(self) -> Any: ...

  def get_state(self) -> dict: ...

  def set_state(self, state: Mapping[str, Any]) -> None: ...


# --------------------------------------------------------------------------- preemption


class PreemptionGuard:
  """Turns SIGTERM (TPU/VM preemption) into a flag the loop checks at step boundaries.

  On several processes JAX's own preemption service (started by
  ``jax.distributed.initialize``) catches the signal and
  ``multihost_utils.reached_preemption_sync_point`` makes every process stop
  at the same step; the Python handler is only installed on one process.
  """

  def __init__(self):
    self.requested = False
    self._previous = None
    self._installed = False

  def _handle(self, signum, frame):
    del frame
    logger.warning('received signal %d: saving at the next step boundary and stopping', signum)
    self.requested = True

  def __enter__(self) -> 'PreemptionGuard':
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._handle)
      self._installed = True
    return self

  def __exit__(self, *exc) -> None:
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous)
      self._installed = False

  def should_stop(self, step: int) -> bool:
    if self.requested:
      return True
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      try:
        return bool(multihost_utils.reached_preemption_sync_point(step))
      except RuntimeError:  # preemption service disabled
        return False
    return False


# --------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class TrainResult:
  """What :func:`train` returns."""
  state: TrainState
  step: int
  metrics: dict[str, float]
  eval_metrics: dict[str, float]
  preempted: bool = False
  resumed_from: int | None = None


Callback = Callable[[int, TrainState, 'PreemptionGuard'], None]


def _batch_size(batch: Any) -> int:
  return int(jax.tree.leaves(batch)[0].shape[0])


class _Loop:
  """Host-side bookkeeping of :func:`train`: metrics, logging, checks (one instance per run)."""

  def __init__(self, cfg: TrainConfig, writer: MetricWriter, pbar):
    self.cfg = cfg
    self.writer = writer
    self.pbar = pbar
    self.interval = MeanAccumulator()
    self.last: dict[str, float] = {}
    self.start_timer()

  def record(self, step: int, device_metrics: Mapping[str, jax.Array], examples: int) -> None:
    """Fetches one step's metrics, accumulates them, and enforces the non-finite limit."""
    host = {k: float(v) for k, v in jax.device_get(dict(device_metrics)).items()}
    self.interval.add(host)
    self.examples += examples
    self.tokens += host.get('num_tokens', 0.0)
    self.timer_steps += 1
    if host['nonfinite']:
      logger.warning('step %d: non-finite loss (%s) or gradient norm (%s); update skipped',
                     step, host['loss'], host['grad_norm'])
    if host['nonfinite_consecutive'] >= self.cfg.max_consecutive_nonfinite:
      raise NonFiniteError(
          f'{int(host["nonfinite_consecutive"])} consecutive steps (up to step {step}) had a '
          f'non-finite loss or gradient norm (last loss={host["loss"]}, grad_norm={host["grad_norm"]}); '
          f'updates were skipped, parameters are those of step {step - int(host["nonfinite_consecutive"])}. '
          f'Stopping (max_consecutive_nonfinite={self.cfg.max_consecutive_nonfinite}).')

  def start_timer(self) -> None:
    """Starts a new throughput interval."""
    self.elapsed = 0.0
    self.resumed_at: float | None = time.perf_counter()
    self.timer_steps = 0
    self.examples = 0
    self.tokens = 0.0

  def pause(self) -> None:
    """Stops the clock (evaluation and checkpointing do not count as step time)."""
    if self.resumed_at is not None:
      self.elapsed += time.perf_counter() - self.resumed_at
      self.resumed_at = None

  def resume(self) -> None:
    if self.resumed_at is None:
      self.resumed_at = time.perf_counter()

  def log(self, step: int) -> None:
    if not len(self.interval):
      return
    self.pause()
    means = self.interval.result()
    scalars = {f'train/{k}': v for k, v in means.items()
               if k not in ('nonfinite_total', 'nonfinite_consecutive')}
    scalars['train/nonfinite_total'] = means.get('nonfinite_total', 0.0)
    if self.timer_steps and self.elapsed > 0:
      scalars['perf/step_time_s'] = self.elapsed / self.timer_steps
      scalars['perf/examples_per_s'] = self.examples / self.elapsed
      if self.tokens:
        scalars['perf/tokens_per_s'] = self.tokens / self.elapsed
    scalars['perf/host_peak_resident_gb'] = allocator.peak_resident_bytes() / 1e9
    self.writer.write_scalars(step, scalars)
    self.last = dict(means)
    if self.pbar is not None:
      self.pbar.set_postfix_str(format_metrics(means, ('loss', 'grad_norm', 'learning_rate')))
    self.interval.reset()
    self.start_timer()


class _Profiler:
  """Traces steps ``first + 1 .. first + num_steps`` (1-based ``done`` counts) into ``logdir``."""

  def __init__(self, logdir: str, first: int, num_steps: int, enabled: bool):
    self.logdir, self.start_after, self.stop_at = logdir, first + 1, first + 1 + num_steps
    self.enabled = enabled and num_steps > 0
    self.active = False

  def after_step(self, done: int, state: Any) -> None:
    if not self.enabled:
      return
    if done == self.start_after and not self.active:
      jax.block_until_ready(state)
      jax.profiler.start_trace(self.logdir)
      self.active = True
      logger.info('profiling steps %d-%d into %s', done + 1, self.stop_at, self.logdir)
    elif done == self.stop_at and self.active:
      self.stop(state)

  def stop(self, state: Any) -> None:
    if self.active:
      jax.block_until_ready(state)
      jax.profiler.stop_trace()
      self.active = False


def _due(step: int, every: int) -> bool:
  return every > 0 and step % every == 0


def train(config: TrainConfig | Mapping[str, Any] | Any,
          model: nnx.Module | Callable[[], nnx.Module], loss_fn: LossFn,
          train_iter: Iterator[Any], eval_fn: EvalFn | None = None, *, workdir: str | os.PathLike,
          mesh: Mesh | None = None, callbacks: Sequence[Callback] = ()) -> TrainResult:
  """Trains ``model`` to ``config.num_steps``, resuming from ``workdir`` if it holds checkpoints.

  Args:
    config: :class:`TrainConfig` (or a mapping / ``ConfigDict`` with its fields).
    model: a factory ``() -> nnx.Module`` (sharded random init) or a concrete
      model, e.g. ``load_pretrained(...).model`` (placed on the mesh).
    loss_fn: ``(model, batch, rng) -> (loss, aux)``, see the module docstring.
    train_iter: per-process numpy batches; if it implements
      :class:`ResumableIterator` its position is checkpointed and restored.
    eval_fn: ``(model, step) -> {name: value}``, run every ``eval_every``
      steps and at the end; logged and ranked as ``eval/<name>``.
    workdir: checkpoints go to ``workdir/checkpoints``, TensorBoard events to
      ``workdir/tensorboard``.
    mesh: the mesh (default: from ``config.mesh``).
    callbacks: ``fn(step, state, guard)`` called after each step (``step`` =
      steps done); ``state`` must not be kept.
  Returns:
    :class:`TrainResult`; ``preempted`` is True when SIGTERM stopped the run
    after saving.
  Raises:
    NonFiniteError: ``max_consecutive_nonfinite`` skipped updates in a row.
  """
  cfg = TrainConfig.from_config(config)
  sharding_lib.maybe_initialize_distributed()
  mesh = mesh if mesh is not None else sharding_lib.mesh_from_config(cfg)
  main = sharding_lib.is_main_process()
  workdir = os.path.abspath(os.fspath(workdir))
  resumable = isinstance(train_iter, ResumableIterator)
  schedule = (learning_rate_schedule(cfg.optimizer, cfg.num_steps)
              if isinstance(cfg.optimizer, OptimizerConfig) else None)

  checkpointer = Checkpointer(storage.durable_path(os.path.join(workdir, 'checkpoints')), keep_last=cfg.keep_checkpoints,
                              best_metric=cfg.best_metric, best_mode=cfg.best_mode,
                              keep_best=cfg.keep_best, async_save=cfg.async_checkpointing)
  writer = MetricWriter(os.path.join(workdir, 'tensorboard'), enabled=main)
  pbar = profiler = None
  try:
    with sharding_lib.use_mesh(mesh):
      resumed_from = None
      if checkpointer.latest_step() is not None:
        abstract = create_train_state(model, cfg.optimizer, mesh, seed=cfg.seed,
                                      total_steps=cfg.num_steps, abstract=True)
        restored = checkpointer.restore(abstract.checkpoint_tree())
        state = abstract.replace_from_checkpoint(restored.tree)
        resumed_from = restored.step
        if resumable and 'data' in restored.meta:
          train_iter.set_state(restored.meta['data'])
        logger.info('resumed from %s at step %d', checkpointer.directory, restored.step)
      else:
        state = create_train_state(model, cfg.optimizer, mesh, seed=cfg.seed,
                                   total_steps=cfg.num_steps)
      shardings = sharding_lib.shardings_of(state)
      step_fn = make_train_step(loss_fn, shardings, sharding_lib.batch_sharding(mesh),
                                grad_accum_steps=cfg.optimizer.grad_accum_steps,
                                learning_rate_fn=schedule)
      start = int(jax.device_get(state.step))
      if main and cfg.progress_bar:
        from tqdm.auto import tqdm
        pbar = tqdm(total=cfg.num_steps, initial=start, desc='train', dynamic_ncols=True)
      loop = _Loop(cfg, writer, pbar)
      profiler = _Profiler(os.path.join(workdir, 'tensorboard'), start, cfg.profile_steps, main)
      eval_metrics: dict[str, float] = {}
      last_saved = resumed_from
      pending: tuple[int, Any, int] | None = None  # metrics of the previous step, fetched one step late

      def save(step: int, metrics: Mapping[str, float] | None) -> None:
        nonlocal last_saved
        if last_saved == step:
          return
        began = time.perf_counter()
        meta = {'step': step, 'data': train_iter.get_state() if resumable else None}
        checkpointer.save(step, state.checkpoint_tree(), meta=meta, metrics=metrics)
        last_saved = step
        writer.write_scalars(step, {'perf/checkpoint_seconds': time.perf_counter() - began})

      def run_eval(step: int) -> dict[str, float]:
        began = time.perf_counter()
        peak_before, resident_before = allocator.peak_resident_bytes(), allocator.resident_bytes()
        values = {f'eval/{k}': float(v) for k, v in eval_fn(state.model(), step).items()}
        # the process's peak after the evaluation: above peak_before when the evaluation set it
        peak = allocator.peak_resident_bytes()
        # Evaluation (dev loss, generation for the probe) has other shapes than the step: hand
        # its freed pages back rather than keep both working sets (allocator.py says why).
        allocator.release_if_grown(resident_before)
        writer.write_scalars(step, {**values, 'perf/eval_seconds': time.perf_counter() - began,
                                    'perf/host_peak_resident_gb': peak / 1e9,
                                    'perf/eval_raised_peak_gb': max(peak - peak_before, 0) / 1e9})
        logger.info('step %d: %s (%.1fs)', step, format_metrics(values), time.perf_counter() - began)
        return values

      with PreemptionGuard() as guard:
        for step in range(start, cfg.num_steps):
          try:
            host_batch = next(train_iter)
          except StopIteration:
            raise RuntimeError(f'the training iterator was exhausted at step {step} '
                               f'(num_steps={cfg.num_steps})') from None
          batch = sharding_lib.shard_batch(host_batch, mesh)
          state, metrics = step_fn(state, batch)
          done = step + 1
          # The previous step's metrics are fetched while this one runs (one step of lag
          # keeps the device busy); the first step is waited for so compilation is not timed.
          if pending is not None:
            loop.record(*pending)
          pending = (done, metrics, _batch_size(batch))
          if step == start:
            loop.record(*pending)
            pending = None
            loop.start_timer()
          if pbar is not None:
            pbar.update(1)
          profiler.after_step(done, state)
          for callback in callbacks:
            callback(done, state, guard)

          is_last = done == cfg.num_steps
          evaluate = eval_fn is not None and (_due(done, cfg.eval_every) or is_last)
          checkpoint = (_due(done, cfg.checkpoint_every) or is_last
                        or (evaluate and cfg.best_metric is not None))
          if _due(done, cfg.log_every) or is_last or evaluate or checkpoint:
            if pending is not None:
              loop.record(*pending)
              pending = None
          if _due(done, cfg.log_every) or is_last:
            loop.log(done)
          loop.pause()
          if evaluate:
            eval_metrics = run_eval(done)
          if checkpoint:
            save(done, eval_metrics if evaluate else None)
          loop.resume()
          if guard.should_stop(done):
            if pending is not None:
              loop.record(*pending)
              pending = None
            save(done, None)
            checkpointer.wait()
            logger.warning('preempted: saved step %d in %s', done, checkpointer.directory)
            return TrainResult(state, done, loop.last, eval_metrics, preempted=True,
                               resumed_from=resumed_from)
      if pending is not None:
        loop.record(*pending)
      checkpointer.wait()
      return TrainResult(state, int(jax.device_get(state.step)), loop.last, eval_metrics,
                         resumed_from=resumed_from)
  finally:
    if profiler is not None:
      profiler.stop(None)  # a run shorter than the traced window still leaves its trace
    if pbar is not None:
      pbar.close()
    writer.close()
    checkpointer.close()
