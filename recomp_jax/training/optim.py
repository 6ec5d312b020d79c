"""AdamW with warmup + decay, masked weight decay and global-norm clipping.

Parameters are float32 *master weights* (models are built with
``param_dtype=float32``); the forward pass may compute in bfloat16 (the
model's ``dtype``), but gradients, Adam moments and updates stay float32.

Learning-rate schedule (the Hugging Face convention): the rate used for the
``n``-th update (``n = 0, 1, ...``) rises linearly from 0 at ``n = 0`` to
``learning_rate`` at ``n = warmup_steps``, then decays (linearly or by a
cosine) to ``learning_rate * final_learning_rate_fraction`` at
``n = total_steps`` and stays there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from flax import nnx

SCHEDULES = ('linear', 'cosine', 'constant')


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Optimizer hyper-parameters.

  Attributes:
    learning_rate: peak learning rate.
    warmup_steps: linear warmup length (updates).
    total_steps: the step where decay ends; ``None`` = the run's ``num_steps``.
    schedule: decay after warmup: ``'linear'``, ``'cosine'`` or ``'constant'``.
    final_learning_rate_fraction: the final rate as a fraction of the peak.
    b1, b2, eps: Adam moments.
    weight_decay: decoupled weight decay (AdamW); not applied to norms and biases.
    clip_grad_norm: global-norm clipping threshold; ``None`` or 0 disables it.
    grad_accum_steps: microbatches per update (the step's batch is split).
    mu_dtype: dtype of Adam's first moment (``None``: the parameter dtype).
    vocab_rows: token ids whose parameters' updates are multiplied by ``vocab_rows_lr_scale``: the
      entries at those indices of every parameter with a ``'vocab'`` logical axis (the embedding
      table's rows, an untied head's columns). For tokens added to a pretrained vocabulary.
    vocab_rows_lr_scale: the multiplier (1: plain AdamW; 0 freezes those rows).
  """
  learning_rate: float = 1e-4
  warmup_steps: int = 1000
  total_steps: int | None = None
  schedule: str = 'linear'
  final_learning_rate_fraction: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-8
  weight_decay: float = 0.01
  clip_grad_norm: float | None = 1.0
  grad_accum_steps: int = 1
  mu_dtype: str | None = None
  vocab_rows: tuple[int, ...] = ()
  vocab_rows_lr_scale: float = 1.0

  def __post_init__(self):
    object.__setattr__(self, 'vocab_rows', tuple(int(i) for i in self.vocab_rows))
    if self.vocab_rows_lr_scale < 0:
      raise ValueError(f'vocab_rows_lr_scale must be >= 0, got {self.vocab_rows_lr_scale}')
    if self.schedule not in SCHEDULES:
      raise ValueError(f'unknown schedule {self.schedule!r}; known: {SCHEDULES}')
    if self.grad_accum_steps < 1:
      raise ValueError(f'grad_accum_steps must be >= 1, got {self.grad_accum_steps}')
    if self.warmup_steps < 0:
      raise ValueError(f'warmup_steps must be >= 0, got {self.warmup_steps}')

  @classmethod
  def from_config(cls, config: Any) -> 'OptimizerConfig':
    """From an ``OptimizerConfig``, a mapping or a ``ConfigDict``; unknown keys are errors."""
    if isinstance(config, cls):
      return config
    if config is None:
      return cls()
    items = dict(config) if isinstance(config, Mapping) else dict(config.items())
    unknown = set(items) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
      raise ValueError(f'unknown optimizer options {sorted(unknown)}')
    return cls(**items)


def learning_rate_schedule(config: OptimizerConfig, total_steps: int | None = None) -> optax.Schedule:
  """``update index -> learning rate`` (see the module docstring)."""
  peak = config.learning_rate
  total = config.total_steps if config.total_steps is not None else total_steps
  if total is None:
    if config.schedule != 'constant':
      raise ValueError(f'a {config.schedule!r} schedule needs total_steps')
    total = config.warmup_steps
  warmup = config.warmup_steps
  decay_steps = max(int(total) - warmup, 1)
  end = peak * config.final_learning_rate_fraction
  if config.schedule == 'linear':
    decay = optax.linear_schedule(peak, end, decay_steps)
  elif config.schedule == 'cosine':
    decay = optax.cosine_decay_schedule(peak, decay_steps, alpha=config.final_learning_rate_fraction)
  else:
    decay = optax.constant_schedule(peak)
  if warmup == 0:
    return decay
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def decays(path: tuple[Any, ...], variable: nnx.Variable) -> bool:
  """Whether a parameter gets weight decay: matrices yes; norms, biases and scalars no.

  Decided from the parameter's path (a final ``bias``) and its logical axes
  (all-``norm`` axes are normalisation scales/offsets); any parameter with
  fewer than two dimensions is excluded as well.
  """
  axes = variable.get_metadata().get('out_sharding') or ()
  name = str(path[-1]) if path else ''
  if name == 'bias' or (axes and all(a == 'norm' for a in axes)):
    return False
  return len(variable.shape) >= 2


def weight_decay_mask(params: nnx.State) -> dict:
  """Pure-dict tree of bools (True = decay) matching ``nnx.to_pure_dict(params)``.

  ``params`` is an ``nnx.State`` of ``nnx.Param`` variables (concrete or
  abstract); the metadata (logical axes) is what the decision reads.
  """
  flat = [(path, decays(path, variable)) for path, variable in nnx.to_flat_state(params)]
  return nnx.to_pure_dict(nnx.from_flat_state(flat))


def vocab_axes(params: nnx.State) -> dict:
  """Pure-dict tree matching ``nnx.to_pure_dict(params)``: the index of each parameter's
  ``'vocab'`` logical axis, ``-1`` where it has none."""
  def axis(variable: nnx.Variable) -> int:
    axes = tuple(variable.get_metadata().get('out_sharding') or ())
    return axes.index('vocab') if 'vocab' in axes else -1
  flat = [(path, axis(variable)) for path, variable in nnx.to_flat_state(params)]
  return nnx.to_pure_dict(nnx.from_flat_state(flat))


def scale_vocab_rows(axes: Any, rows: tuple[int, ...], scale: float) -> optax.GradientTransformation:
  """Multiplies the updates of token ``rows`` along each parameter's vocab axis by ``scale``.

  Adam's step size does not depend on the gradient's size, so a new token's embedding row
  moves by about the learning rate per step like every other entry: from the mean embedding
  that :func:`recomp_jax.pretrained.special_tokens.add_special_tokens` starts it at, a few hundred
  steps at a fine-tuning rate leave it near the mean and the model rarely writes it. Scaling its
  updates gives the new rows their own learning rate and leaves the pretrained ones as they are.
  Stateless, so checkpoints keep their layout. ``axes``: :func:`vocab_axes` of the parameters.
  """
  index = jnp.asarray(rows, jnp.int32)

  def update_fn(updates, state, params=None):
    del params

    def scaled(update, axis):
      if axis < 0:
        return update
      factor = jnp.ones((update.shape[axis],), update.dtype).at[index].set(jnp.asarray(scale, update.dtype))
      shape = [1] * update.ndim
      shape[axis] = update.shape[axis]
      return update * factor.reshape(shape)

    return jax.tree.map(scaled, updates, axes), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def make_optimizer(config: OptimizerConfig, params: nnx.State,
                   total_steps: int | None = None) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW with the schedule and the weight-decay mask, then the
  new-token rows' multiplier when ``config.vocab_rows`` is set (:func:`scale_vocab_rows`).

  ``params``: the model's ``nnx.Param`` state (abstract is fine), used for the masks.
  """
  schedule = learning_rate_schedule(config, total_steps)
  parts = []
  if config.clip_grad_norm:
    parts.append(optax.clip_by_global_norm(config.clip_grad_norm))
  parts.append(optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps,
                           weight_decay=config.weight_decay, mask=weight_decay_mask(params),
                           mu_dtype=jnp.dtype(config.mu_dtype) if config.mu_dtype else None))
  if config.vocab_rows and config.vocab_rows_lr_scale != 1.0:
    parts.append(scale_vocab_rows(vocab_axes(params), config.vocab_rows, config.vocab_rows_lr_scale))
  return optax.chain(*parts)


def applied_updates(opt_state: optax.OptState) -> jax.Array:
  """Updates applied so far: the count the learning-rate schedule is evaluated at, ``[]`` int32."""
  is_count_state = lambda x: isinstance(x, (optax.ScaleByScheduleState, optax.ScaleByAdamState))
  counts = [node for node in jax.tree.leaves(opt_state, is_leaf=is_count_state) if is_count_state(node)]
  counts.sort(key=lambda node: not isinstance(node, optax.ScaleByScheduleState))
  if not counts:
    raise ValueError('optimizer state holds no schedule or Adam step count')
  return counts[0].count
