"""The one sharding story: a device mesh and the table mapping logical axes to it.

Models name their parameter axes logically (see :mod:`recomp_jax.models.layers`);
:data:`LOGICAL_AXIS_RULES` is the single place that says which mesh axis each
logical name is split over. Mesh axes:

* ``data``   — pure data parallelism (parameters replicated);
* ``fsdp``   — data parallelism with parameters, gradients and optimizer
  state sharded along ``embed`` (ZeRO-3 style);
* ``tensor`` — tensor (Megatron) parallelism over ``mlp`` / ``heads`` / ``vocab``.

The batch (leading) axis of every input is split over ``('data', 'fsdp')``.

Placement helpers:

* :func:`create_sharded` — random init where every parameter is *born*
  sharded (the factory is jitted with ``out_shardings``; no full copy ever
  lives on one device);
* :func:`place_on_mesh` — moves a concrete model (e.g. from
  :func:`recomp_jax.pretrained.load_pretrained`) onto the mesh leaf by leaf;
* :func:`shard_batch` — per-host numpy batches -> global ``jax.Array`` s
  (multi-host data loading: every process passes only its own rows);
* :func:`use_mesh` — ``jax.set_mesh`` plus Flax's logical-axis rules, the
  context everything runs in; :func:`with_logical_constraint` — activation
  sharding by logical names, for model code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any, Callable, Mapping, Sequence, TypeVar

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data', 'fsdp', 'tensor')

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ('batch', ('data', 'fsdp')),
    ('length', None),
    ('corpus', ('data', 'fsdp', 'tensor')),  # rows of a dense retrieval index
    # parameters
    ('embed', 'fsdp'),
    ('mlp', 'tensor'),
    ('heads', 'tensor'),
    ('kv_heads', None),
    ('head_dim', None),
    ('vocab', 'tensor'),
    ('norm', None),
    ('position', None),
    ('type_vocab', None),
    ('relpos', None),
)


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``(data, fsdp, tensor)`` mesh with ``AxisType.Auto`` axes; one size may be -1 (fill)."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [data, fsdp, tensor]
  if sizes.count(-1) > 1:
    raise ValueError(f'at most one mesh axis may be -1, got data={data} fsdp={fsdp} tensor={tensor}')
  known = int(np.prod([s for s in sizes if s != -1]))
  if -1 in sizes:
    if len(devices) % known:
      raise ValueError(f'{len(devices)} devices are not divisible by the fixed mesh axes ({known})')
    sizes[sizes.index(-1)] = len(devices) // known
  if int(np.prod(sizes)) != len(devices):
    raise ValueError(f'mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices, '
                     f'have {len(devices)}')
  return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                       devices=devices)


def logical_to_spec(axes: Sequence[str | None] | None,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> PartitionSpec:
  """Logical axis names -> ``PartitionSpec``; a mesh axis is used at most once per spec."""
  if axes is None:
    return PartitionSpec()
  table = dict(rules)
  used: set[str] = set()
  spec = []
  for name in axes:
    target = table.get(name) if name is not None else None
    members = (target,) if isinstance(target, str) else tuple(target or ())
    if any(m in used for m in members):
      target = None
    else:
      used.update(members)
    spec.append(target)
  return PartitionSpec(*spec)


def state_shardings(state: Any, mesh: Mesh,
                    rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> Any:
  """``NamedSharding`` for every variable of an NNX state (concrete or abstract).

  Variables without logical names (RNG counters, step counts) are replicated.
  Dimensions whose size does not divide the mesh axes stay replicated.
  """

  def one(variable):
    axes = variable.get_metadata().get('out_sharding') if isinstance(variable, nnx.Variable) else None
    shape = getattr(variable, 'shape', ())
    spec = logical_to_spec(axes, rules) if axes else PartitionSpec()
    fixed = []
    for dim, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
      members = (entry,) if isinstance(entry, str) else tuple(entry or ())
      size = int(np.prod([mesh.shape[m] for m in members])) if members else 1
      fixed.append(entry if size > 1 and dim % size == 0 else None)
    return NamedSharding(mesh, PartitionSpec(*fixed))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


# --------------------------------------------------------------------------- mesh from config


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh axis sizes; one of them may be -1 (use all remaining devices)."""
  data: int = -1
  fsdp: int = 1
  tensor: int = 1


def config_value(config: Any, key: str, default: Any = None) -> Any:
  """Reads ``key`` from a dataclass, ``ml_collections.ConfigDict``, mapping or namespace."""
  if config is None:
    return default
  if isinstance(config, Mapping):
    return config.get(key, default)
  return getattr(config, key, default)


def mesh_from_config(config: Any = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """Builds the mesh from ``config.mesh`` (or ``config`` itself) with fields ``data/fsdp/tensor``.

  Missing fields take :class:`MeshConfig` defaults (pure data parallelism).
  """
  section = config_value(config, 'mesh', None)
  section = config if section is None else section
  defaults = MeshConfig()
  sizes = {name: int(config_value(section, name, getattr(defaults, name))) for name in MESH_AXES}
  return make_mesh(**sizes, devices=devices)


# --------------------------------------------------------------------------- batches


def batch_spec(rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> PartitionSpec:
  """``PartitionSpec`` of an input's leading (batch) axis, from the logical ``batch`` rule."""
  return logical_to_spec(('batch',), rules)


def batch_sharding(mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> NamedSharding:
  """Sharding of every batch leaf: leading axis over ``('data', 'fsdp')``, the rest replicated.

  Used as a pytree *prefix* (one sharding for the whole batch) in ``jax.jit``.
  """
  return NamedSharding(mesh, batch_spec(rules))


def batch_shards(mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> int:
  """How many ways the batch axis is split (the global batch must be a multiple of it)."""
  members = batch_spec(rules)[0]
  members = (members,) if isinstance(members, str) else tuple(members or ())
  return int(np.prod([mesh.shape[m] for m in members])) if members else 1


def shard_batch(batch: Any, mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> Any:
  """Per-process numpy batch -> global ``jax.Array`` s split over the batch mesh axes.

  Every process passes only *its own* rows (``[B_local, ...]`` per leaf); the
  global batch is ``[B_local * num_processes, ...]`` (via
  ``jax.make_array_from_process_local_data``). On one host this is simply a
  sharded ``device_put``. Every leaf must have a leading batch axis.
  """
  sharding = batch_sharding(mesh, rules)

  def one(x):
    x = np.asarray(x)
    if x.ndim == 0:
      raise ValueError('every batch leaf needs a leading batch axis; got a scalar')
    return jax.make_array_from_process_local_data(sharding, x)

  return jax.tree.map(one, batch)


# --------------------------------------------------------------------------- models on the mesh

M = TypeVar('M', bound=nnx.Module)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES):
  """``jax.set_mesh(mesh)`` plus Flax's logical-axis rules.

  Under a bare ``jax.set_mesh``, ``nnx.eval_shape`` would read our logical
  names (``'embed'``, ...) as mesh axes and fail; with the rules installed it
  resolves them through :data:`LOGICAL_AXIS_RULES` (so e.g.
  ``checkpoints.load_pretrained`` works inside the context).
  """
  with jax.set_mesh(mesh), flax_spmd.logical_axis_rules(tuple(rules)):
    yield mesh


def abstract_model(model_factory: Callable[[], nnx.Module]) -> tuple[nnx.GraphDef, nnx.State]:
  """``(graphdef, state)`` of ``model_factory()`` with ``jax.ShapeDtypeStruct`` values.

  Nothing is allocated; variable metadata (logical axes) is kept. Unlike
  ``nnx.eval_shape`` this does not depend on the ambient mesh.
  """
  box = {}

  def split():
    graphdef, state = nnx.split(model_factory())
    box['graphdef'] = graphdef
    return state

  state = jax.eval_shape(split)
  return box['graphdef'], state


def create_sharded(model_factory: Callable[[], M], mesh: Mesh,
                   rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> M:
  """Runs ``model_factory`` so that every variable is created directly in its sharding.

  The factory is traced once abstractly to read the logical axes, then
  jitted with ``out_shardings`` from :func:`state_shardings`: each device
  only ever materialises its own shards.
  """
  graphdef, abstract_state = abstract_model(model_factory)
  shardings = state_shardings(abstract_state, mesh, rules)

  @functools.partial(jax.jit, out_shardings=shardings)
  def init():
    return nnx.state(model_factory())

  with use_mesh(mesh, rules):
    state = init()
  return nnx.merge(graphdef, state)


def place_on_mesh(model: M, mesh: Mesh, rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES,
                  *, donate: bool = True) -> M:
  """Moves a concrete model (e.g. a loaded checkpoint) onto ``mesh``, in place.

  Leaf by leaf ``jax.device_put`` into the logical-axis shardings; with
  ``donate`` the source buffer of each leaf is released as soon as it is
  copied, so peak memory is the model plus one parameter.
  """
  _, state = nnx.split(model)
  shardings = state_shardings(state, mesh, rules)
  flat_state = dict(nnx.to_flat_state(state))
  for path, sharding in nnx.to_flat_state(shardings):
    variable = flat_state[path]
    value = variable.get_value()
    if isinstance(value, jax.Array) and value.sharding == sharding:
      continue
    # Donating a buffer that something else still references would invalidate it; only
    # donate jax.Arrays (numpy inputs are copied anyway).
    variable.set_value(jax.device_put(value, sharding, donate=donate and isinstance(value, jax.Array)))
  return model


def shardings_of(tree: Any) -> Any:
  """The ``.sharding`` of every array leaf of ``tree`` (``None`` for non-arrays)."""
  return jax.tree.map(lambda x: getattr(x, 'sharding', None), tree)


def replicated(mesh: Mesh) -> NamedSharding:
  """A fully replicated ``NamedSharding`` on ``mesh``."""
  return NamedSharding(mesh, PartitionSpec())


# --------------------------------------------------------------------------- multi-host


def _configured_process_count() -> int:
  """Number of processes the environment announces (JAX, SLURM, Open MPI, Cloud TPU); 1 if none."""
  env = os.environ
  for key in ('JAX_NUM_PROCESSES', 'SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE'):
    if env.get(key, '').strip().isdigit():
      return int(env[key])
  hosts = env.get('TPU_WORKER_HOSTNAMES', '').strip()
  if hosts:
    return len([h for h in hosts.split(',') if h.strip()])
  if env.get('JAX_COORDINATOR_ADDRESS'):
    return 2  # a coordinator address only makes sense for a multi-process job
  return 1


def maybe_initialize_distributed() -> bool:
  """Calls ``jax.distributed.initialize()`` when the environment configures several processes.

  On Cloud TPU, SLURM or Open MPI JAX detects the job itself; elsewhere set
  ``JAX_COORDINATOR_ADDRESS=host:port``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.

  Must run before any JAX computation. Returns True if this call initialised
  the distributed runtime (False on a single process or when already done).
  """
  if jax.distributed.is_initialized() or _configured_process_count() <= 1:
    return False
  env = os.environ
  if all(env.get(k, '').strip().isdigit() for k in ('JAX_NUM_PROCESSES', 'JAX_PROCESS_ID')):
    # JAX reads only the coordinator from the environment; a hand-started job (several
    # processes on one machine, or hosts without a cluster manager) names the rest.
    jax.distributed.initialize(env.get('JAX_COORDINATOR_ADDRESS'),
                               num_processes=int(env['JAX_NUM_PROCESSES']),
                               process_id=int(env['JAX_PROCESS_ID']))
  else:
    jax.distributed.initialize()
  return True


def process_count() -> int:
  """How many processes run this program (1 unless :func:`maybe_initialize_distributed` joined more)."""
  return jax.process_count()


def process_index() -> int:
  return jax.process_index()


def is_main_process() -> bool:
  """True on process 0: the one that logs, writes TensorBoard, shows progress and writes
  every pipeline file (the others compute alongside it and write nothing)."""
  return jax.process_index() == 0


def sync_processes(tag: str) -> None:
  """Blocks until every process has reached ``sync_processes(tag)`` (no-op on one process).

  Every process must call it with the same ``tag``, in the same order.
  """
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    multihost_utils.sync_global_devices(tag)


def broadcast_from_main(flag: bool) -> bool:
  """Process 0's ``flag`` on every process; a collective, so also a barrier."""
  if jax.process_count() == 1:
    return bool(flag)
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return bool(multihost_utils.broadcast_one_to_all(np.asarray(flag, np.int32)))


def open_on_main(path: str, mode: str = 'w'):
  """``open(path, mode)`` on process 0 and ``os.devnull`` on the others: for a file that
  every process computes (a collective stage) but only process 0 writes."""
  target = path if is_main_process() else os.devnull
  return open(target, mode, encoding=None if 'b' in mode else 'utf-8')


def host_value(x: jax.Array) -> np.ndarray:
  """The whole of ``x`` as numpy on this process.

  A parameter sharded across processes is not addressable from one host: it is
  gathered with a collective, so every process must call this for the same arrays.
  """
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def with_logical_constraint(x: jax.Array, axes: Sequence[str | None],
                            rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> jax.Array:
  """Constrains an activation's sharding by logical axis names (``('batch', 'length', 'embed')``).

  A no-op when no mesh is set (``jax.set_mesh`` / :func:`use_mesh`), so model
  code can call it unconditionally. Dimensions that do not divide their mesh
  axes stay unconstrained.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  spec = []
  for dim, entry in zip(x.shape, logical_to_spec(axes, rules)):
    members = (entry,) if isinstance(entry, str) else tuple(entry or ())
    size = int(np.prod([mesh.shape[m] for m in members if m in mesh.shape])) if members else 1
    ok = members and all(m in mesh.shape for m in members) and dim % size == 0
    spec.append(entry if ok else None)
  return jax.lax.with_sharding_constraint(x, PartitionSpec(*spec))
