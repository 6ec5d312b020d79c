"""Sharding: mesh construction, logical rules, sharded init / placement, and 1-vs-8-device parity.

The multi-device tests need 8 (fake CPU) devices, which must be requested
before JAX is imported. When this pytest process has fewer, one test re-runs
this file's ``TestMultiDevice`` in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (so the rest of the
suite keeps its single device). With 8 devices already present the class
runs inline.

``ENGINE_CASES`` lists (model factory, loss, batch) triples; the parity test
is parametrized over it, so real models are added with one line each.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Callable

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_models  # noqa: E402
from multidevice import NUM_DEVICES, run_with_fake_devices  # noqa: E402

from recomp_jax import sharding  # noqa: E402
from recomp_jax.training import loop as train_lib  # noqa: E402
from recomp_jax.training.checkpointer import Checkpointer, keys_to_data  # noqa: E402
from recomp_jax.training.optim import OptimizerConfig  # noqa: E402



# --------------------------------------------------------------------------- single device


def test_make_mesh_sizes_and_errors():
  mesh = sharding.make_mesh(1, 1, -1, devices=jax.devices()[:1])
  assert dict(mesh.shape) == {'data': 1, 'fsdp': 1, 'tensor': 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match='at most one'):
    sharding.make_mesh(-1, -1, 1)
  with pytest.raises(ValueError, match='needs 2 devices'):
    sharding.make_mesh(2, 1, 1, devices=jax.devices()[:1])
  mesh = sharding.mesh_from_config({'mesh': {'data': 1, 'tensor': -1}}, devices=jax.devices()[:1])
  assert mesh.axis_names == sharding.MESH_AXES


def test_logical_rules_table():
  assert sharding.logical_to_spec(('embed', 'mlp')) == P('fsdp', 'tensor')
  assert sharding.logical_to_spec(('vocab', 'embed')) == P('tensor', 'fsdp')
  assert sharding.logical_to_spec(('norm',)) == P(None)
  # 'batch' takes fsdp, so the activation's 'embed' stays replicated (a mesh axis is used once).
  assert sharding.logical_to_spec(('batch', 'length', 'embed')) == P(('data', 'fsdp'), None, None)
  assert sharding.batch_spec() == P(('data', 'fsdp'))


def test_maybe_initialize_distributed(monkeypatch):
  for key in ('JAX_NUM_PROCESSES', 'SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE', 'TPU_WORKER_HOSTNAMES',
              'JAX_COORDINATOR_ADDRESS'):
    monkeypatch.delenv(key, raising=False)
  calls = []
  monkeypatch.setattr(jax.distributed, 'initialize', lambda *a, **k: calls.append(1))
  assert not sharding.maybe_initialize_distributed()
  monkeypatch.setenv('JAX_NUM_PROCESSES', '1')
  assert not sharding.maybe_initialize_distributed()
  monkeypatch.setenv('JAX_NUM_PROCESSES', '4')
  assert sharding.maybe_initialize_distributed() and calls == [1]
  assert sharding.is_main_process()


# --------------------------------------------------------------------------- engine cases


@dataclasses.dataclass(frozen=True)
class EngineCase:
  """A model to check the sharded engine with: factory, pure loss, and a numpy global batch."""
  name: str
  make_model: Callable[[], nnx.Module]
  loss_fn: train_lib.LossFn
  make_batch: Callable[[], Any]
  grad_accum_steps: int = 1


def _tiny_batch():
  return tiny_models.token_data(16, seed=4)


ENGINE_CASES = [
    EngineCase('tiny_lm', lambda: tiny_models.make_model(1), tiny_models.lm_loss, _tiny_batch),
    EngineCase('tiny_lm_accum2', lambda: tiny_models.make_model(1), tiny_models.lm_loss, _tiny_batch,
               grad_accum_steps=2),
]

# No clipping: after one step Adam's first moment is exactly (1 - b1) * gradient, so the
# optimizer state exposes the gradients without compiling a separate gradient function.
OPTIMIZER = OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=100, weight_decay=0.1,
                            clip_grad_norm=None)


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _max_diff(a, b) -> float:
  return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


def _one_step(case: EngineCase, mesh) -> dict:
  """Loss, gradients, new params and shardings after one train step of ``case`` on ``mesh``."""
  state = train_lib.create_train_state(case.make_model(), OPTIMIZER, mesh, seed=11)
  specs = jax.tree.map(lambda x: x.sharding.spec, state.params)
  opt_specs = jax.tree.map(lambda x: x.sharding.spec, state.opt_state)
  with sharding.use_mesh(mesh):
    step = train_lib.make_train_step(case.loss_fn, sharding.shardings_of(state),
                                     sharding.batch_sharding(mesh),
                                     grad_accum_steps=case.grad_accum_steps)
    new_state, metrics = step(state, sharding.shard_batch(case.make_batch(), mesh))
  adam = new_state.opt_state[0][0]
  grads = jax.tree.map(lambda mu: np.asarray(mu) / (1.0 - OPTIMIZER.b1), _host(adam.mu))
  return dict(grads=grads, params=_host(new_state.params), metrics=_host(metrics),
              specs=specs, opt_specs=opt_specs, state=new_state)


# --------------------------------------------------------------------------- multi-device

if jax.device_count() < NUM_DEVICES:

  def test_multidevice_suite_in_subprocess():
    """Runs ``TestMultiDevice`` with 8 fake CPU devices in a fresh interpreter."""
    run_with_fake_devices(__file__, 'TestMultiDevice')

else:

  class TestMultiDevice:
    """Needs ``jax.device_count() >= 8``."""

    @pytest.fixture(scope='class')
    def mesh(self):
      return sharding.make_mesh(2, 2, 2, devices=jax.devices()[:NUM_DEVICES])

    @pytest.fixture(scope='class')
    def single(self):
      return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])

    def test_create_sharded_params_are_born_sharded(self, mesh):
      model = sharding.create_sharded(lambda: tiny_models.make_model(2), mesh)
      kernel = model.wi.kernel.get_value()
      assert kernel.sharding.spec == P('fsdp', 'tensor')
      assert model.embed.embedding.get_value().sharding.spec == P('tensor', 'fsdp')
      assert model.attn_norm.scale.get_value().sharding.spec == P(None)
      # each device holds a quarter of the [D, F] kernel (fsdp x tensor), replicated over data
      assert kernel.addressable_shards[0].data.shape == (kernel.shape[0] // 2, kernel.shape[1] // 2)
      eager = tiny_models.make_model(2)
      np.testing.assert_allclose(np.asarray(kernel), np.asarray(eager.wi.kernel.get_value()), atol=1e-6)

    def test_place_on_mesh_and_shard_batch(self, mesh):
      model = tiny_models.make_model(3)
      expected = _host(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
      sharding.place_on_mesh(model, mesh)
      assert model.query.kernel.get_value().sharding.spec == P('fsdp', 'tensor', None)
      assert model.wo.bias.get_value().sharding.spec == P('fsdp')
      assert _max_diff(_host(nnx.to_pure_dict(nnx.state(model, nnx.Param))), expected) == 0.0
      batch = sharding.shard_batch(tiny_models.token_data(16), mesh)
      tokens = batch['tokens']
      assert tokens.shape == (16, 9) and tokens.sharding.spec == P(('data', 'fsdp'))
      assert {s.data.shape for s in tokens.addressable_shards} == {(4, 9)}

    @pytest.fixture(scope='class')
    def steps(self, mesh, single):
      """``(case name, 'one' | 'many') -> _one_step(...)``, computed once per class."""
      cache = {}

      def get(case, which):
        if (case.name, which) not in cache:
          cache[case.name, which] = _one_step(case, single if which == 'one' else mesh)
        return cache[case.name, which]

      return get

    @pytest.mark.parametrize('case', ENGINE_CASES, ids=lambda c: c.name)
    def test_train_step_matches_single_device(self, case, mesh, steps):
      one, many = steps(case, 'one'), steps(case, 'many')
      assert abs(float(one['metrics']['loss']) - float(many['metrics']['loss'])) <= 1e-5
      assert _max_diff(one['grads'], many['grads']) <= 1e-5
      assert _max_diff(one['params'], many['params']) <= 1e-5
      assert float(one['metrics']['grad_norm']) == pytest.approx(float(many['metrics']['grad_norm']),
                                                                 abs=1e-5)
      # the update moved the parameters (the comparison is not vacuous)
      assert _max_diff(many['params'], _host(nnx.to_pure_dict(nnx.state(case.make_model(), nnx.Param)))) > 1e-4
      # parameters really are sharded as the logical rules say, and Adam moments alike
      abstract = nnx.state(nnx.eval_shape(case.make_model), nnx.Param)
      expected = jax.tree.map(lambda s: s.spec, nnx.to_pure_dict(sharding.state_shardings(abstract, mesh)))
      assert many['specs'] == expected
      used = {axis for spec in jax.tree.leaves(expected, is_leaf=lambda x: isinstance(x, P))
              for entry in spec for axis in ((entry,) if isinstance(entry, str) else entry or ())}
      assert {'fsdp', 'tensor'} <= used
      adam = many['opt_specs'][0][0]
      assert adam.mu == expected and adam.nu == expected

    def test_restore_into_a_different_mesh(self, steps, tmp_path):
      case = ENGINE_CASES[0]
      state = steps(case, 'many')['state']
      saved = _host(keys_to_data(state.checkpoint_tree()))
      with Checkpointer(tmp_path / 'ckpt', async_save=False) as checkpointer:
        checkpointer.save(1, state.checkpoint_tree(), meta={'note': 'x'})
      other = sharding.make_mesh(1, 4, 2, devices=jax.devices()[:NUM_DEVICES])
      target = train_lib.create_train_state(case.make_model, OPTIMIZER, other, seed=11, abstract=True)
      restored = Checkpointer(tmp_path / 'ckpt').restore(target.checkpoint_tree())
      assert restored.step == 1 and restored.meta == {'note': 'x'}
      tree = restored.tree
      assert tree['params']['wi']['kernel'].sharding.mesh.shape == other.shape
      assert tree['params']['wi']['kernel'].sharding.spec == P('fsdp', 'tensor')
      assert jax.dtypes.issubdtype(tree['rng'].dtype, jax.dtypes.prng_key)
      assert _max_diff(_host(keys_to_data(tree)), saved) == 0.0
