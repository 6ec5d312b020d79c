"""The one sharding story: a device mesh and the table mapping logical axes to it.

Models name their parameter axes logically (see :mod:`recomp_jax.models.layers`);
:data:`LOGICAL_AXIS_RULES` is the single place that says which mesh axis each
logical name is split over. Mesh axes:

* ``data``   — pure data parallelism (parameters replicated);
* ``fsdp``   — data parallelism with parameters, gradients and optimizer
  state sharded along ``embed`` (ZeRO-3 style);
* ``tensor`` — tensor (Megatron) parallelism over ``mlp`` / ``heads`` / ``vocab``.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ('data', 'fsdp', 'tensor')

# logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # activations
    ('batch', ('data', 'fsdp')),
    ('length', None),
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
