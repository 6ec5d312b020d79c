"""The training engine: schedule, weight-decay mask, non-finite guard, checkpoints and exact resume.

In-process tests run on one device. The kill / SIGTERM tests run
``tests/_train_worker.py`` in subprocesses on 8 fake CPU devices with a
``(2, 2, 2)`` mesh; the workers share a persistent compilation cache so only
the first one compiles.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny_models  # noqa: E402

from recomp_jax import sharding  # noqa: E402
from recomp_jax.training import losses as losses_lib  # noqa: E402
from recomp_jax.training import loop as train_lib  # noqa: E402
from recomp_jax.training import optim  # noqa: E402
from recomp_jax.training.checkpointer import Checkpointer  # noqa: E402
from recomp_jax.training.summaries import read_scalars  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_train_worker.py')


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _max_diff(a, b) -> float:
  return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.max(np.abs(x - y))), a, b)))


@pytest.fixture(scope='module')
def mesh():
  return sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])


# --------------------------------------------------------------------------- optimizer


def test_learning_rate_schedules():
  linear = optim.learning_rate_schedule(optim.OptimizerConfig(
      learning_rate=1.0, warmup_steps=10, total_steps=110, final_learning_rate_fraction=0.1))
  expected = {0: 0.0, 5: 0.5, 10: 1.0, 60: 0.55, 110: 0.1, 500: 0.1}
  for step, value in expected.items():
    assert float(linear(step)) == pytest.approx(value, abs=1e-6), step
  cosine = optim.learning_rate_schedule(optim.OptimizerConfig(
      learning_rate=2.0, warmup_steps=4, schedule='cosine'), total_steps=104)
  assert float(cosine(2)) == pytest.approx(1.0)
  assert float(cosine(4)) == pytest.approx(2.0)
  assert float(cosine(29)) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi * 0.25)), abs=1e-5)
  assert float(cosine(54)) == pytest.approx(1.0, abs=1e-5)
  assert float(cosine(104)) == pytest.approx(0.0, abs=1e-6)
  constant = optim.learning_rate_schedule(optim.OptimizerConfig(learning_rate=3.0, warmup_steps=0,
                                                                schedule='constant'))
  assert float(constant(0)) == float(constant(10_000)) == 3.0
  with pytest.raises(ValueError, match='needs total_steps'):
    optim.learning_rate_schedule(optim.OptimizerConfig())
  with pytest.raises(ValueError, match='unknown schedule'):
    optim.OptimizerConfig(schedule='step')


def test_weight_decay_mask_excludes_norms_and_biases():
  params = nnx.state(nnx.eval_shape(lambda: tiny_models.make_model(0)), nnx.Param)
  mask = optim.weight_decay_mask(params)
  assert mask['embed']['embedding'] and mask['query']['kernel'] and mask['out']['kernel']
  assert mask['wi']['kernel'] and mask['wo']['kernel']
  assert not mask['wi']['bias'] and not mask['wo']['bias']
  assert not mask['attn_norm']['scale'] and not mask['mlp_norm']['scale']
  assert not mask['final_norm']['scale'] and not mask['final_norm']['bias']

  # With zero gradients Adam's step is 0, so only decoupled weight decay moves parameters.
  tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=0.1, warmup_steps=0, total_steps=10,
                                                  weight_decay=0.5), params)
  values = jax.tree.map(lambda v: jnp.full(v.shape, 2.0, v.dtype), nnx.to_pure_dict(params))
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, values), tx.init(values), values)
  new = optax.apply_updates(values, updates)
  for decayed, (path, value) in zip(jax.tree.leaves(mask), jax.tree_util.tree_leaves_with_path(new)):
    expected = 2.0 * (1 - 0.1 * 0.5) if decayed else 2.0
    np.testing.assert_allclose(value, expected, rtol=1e-6, err_msg=jax.tree_util.keystr(path))


# --------------------------------------------------------------------------- the step


def _poisoned_loss(model, batch, rng):
  """``poison == 1``: NaN loss; ``poison == 2``: finite loss but a NaN gradient."""
  loss, aux = tiny_models.lm_loss(model, batch, rng)
  poison = batch['poison'].max()
  loss = jnp.where(poison == 1, jnp.nan, loss)
  # sqrt(offset + 0 * params) has value sqrt(offset); at offset 0 its gradient is inf * 0 = NaN.
  offset = jnp.where(poison == 2, 0.0, 1.0)
  return loss + jnp.sqrt(offset + 0.0 * jnp.sum(model.embed.embedding[...])) - jnp.sqrt(offset), aux


def _poisoned_batch(poison: int, seed: int = 0):
  data = tiny_models.token_data(8, seed=seed)
  return dict(data, poison=np.full((8,), poison, np.int32))


def test_nonfinite_update_is_skipped(mesh):
  config = optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, total_steps=20)
  state = train_lib.create_train_state(lambda: tiny_models.make_model(0), config, mesh)
  step = train_lib.make_train_step(_poisoned_loss, sharding.shardings_of(state),
                                   sharding.batch_sharding(mesh),
                                   learning_rate_fn=optim.learning_rate_schedule(config))
  shard = lambda b: sharding.shard_batch(b, mesh)  # noqa: E731
  state, metrics = step(state, shard(_poisoned_batch(0)))
  assert float(metrics['nonfinite']) == 0 and float(metrics['learning_rate']) == 0.0
  before = _host((state.params, state.opt_state))
  for expected_consecutive, poison in enumerate((1, 2), start=1):
    state, metrics = step(state, shard(_poisoned_batch(poison)))
    metrics = _host(metrics)
    assert metrics['nonfinite'] == 1 and metrics['nonfinite_consecutive'] == expected_consecutive
    # bitwise unchanged parameters and optimizer state (incl. Adam's step count)
    assert _max_diff(_host((state.params, state.opt_state)), before) == 0.0
  assert int(state.step) == 3 and int(state.nonfinite_total) == 2
  assert np.isnan(metrics['grad_norm'])
  state, metrics = step(state, shard(_poisoned_batch(0, seed=1)))
  metrics = _host(metrics)
  assert metrics['nonfinite'] == 0 and metrics['nonfinite_consecutive'] == 0
  assert metrics['nonfinite_total'] == 2
  # the schedule resumes where it stopped: the second *applied* update uses lr(1)
  assert metrics['learning_rate'] == pytest.approx(1e-2 / 2)
  assert _max_diff(_host(state.params), before[0]) > 0
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(_host(state.params)))


def test_loop_stops_after_consecutive_nonfinite(mesh, tmp_path):
  def batches():
    for i in range(100):
      yield _poisoned_batch(1 if i >= 2 else 0)

  config = dict(num_steps=50, checkpoint_every=0, progress_bar=False, max_consecutive_nonfinite=3,
                optimizer=dict(warmup_steps=1, learning_rate=1e-3))
  with pytest.raises(train_lib.NonFiniteError, match=r'3 consecutive steps .*parameters are those of step 2'):
    train_lib.train(config, lambda: tiny_models.make_model(0), _poisoned_loss, batches(),
                    workdir=tmp_path, mesh=mesh)


def test_gradient_accumulation_matches_full_batch(mesh):
  model = tiny_models.make_model(0, tiny_models.TinyConfig(dropout_rate=0.0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  batch = tiny_models.token_data(8, padded=False)

  @jax.jit
  def both(params, batch):
    full = train_lib.loss_and_grads(tiny_models.lm_loss, graphdef, params, rest, batch,
                                    jax.random.key(0))
    accumulated = train_lib.loss_and_grads(tiny_models.lm_loss, graphdef, params, rest, batch,
                                           jax.random.key(0), grad_accum_steps=4)
    return full, accumulated

  (loss, aux, _, grads), (loss4, aux4, _, grads4) = _host(both(params, batch))
  assert float(loss4) == pytest.approx(float(loss), abs=1e-6)
  assert _max_diff(grads4, grads) <= 1e-6
  assert aux4['num_tokens'] == aux['num_tokens'] == 8 * 8  # counts are summed, not averaged
  with pytest.raises(ValueError, match='not divisible'):
    train_lib.loss_and_grads(tiny_models.lm_loss, graphdef, params, rest, batch, jax.random.key(0),
                             grad_accum_steps=3)


def _uneven_batch() -> dict[str, np.ndarray]:
  """4 rows; with 2 microbatches (rows 0, 2 and rows 1, 3) one holds 2 target tokens, the other 16."""
  batch = tiny_models.token_data(4, padded=False)
  batch['mask'][[0, 2], 2:] = 0  # one target token each: like an empty summary (EOS only)
  return batch


def _without_weight(loss_fn):
  def unweighted(model, batch, rng):
    loss, aux = loss_fn(model, batch, rng)
    return loss, {k: v for k, v in aux.items() if k != losses_lib.LOSS_WEIGHT}
  return unweighted


def test_gradient_accumulation_weights_microbatches_by_their_tokens(mesh):
  """Token-mean microbatches of 2 and 16 target tokens accumulate to the whole batch's token mean."""
  model = tiny_models.make_model(0, tiny_models.TinyConfig(dropout_rate=0.0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
  batch = _uneven_batch()
  halves = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]

  def run(loss_fn, batch, accum):
    return _host(jax.jit(lambda p, b: train_lib.loss_and_grads(
        loss_fn, graphdef, p, rest, b, jax.random.key(0), grad_accum_steps=accum))(params, batch))

  loss, aux, _, grads = run(tiny_models.lm_loss, batch, 1)
  loss2, aux2, _, grads2 = run(tiny_models.lm_loss, batch, 2)
  assert float(loss2) == pytest.approx(float(loss), abs=1e-6)
  assert _max_diff(grads2, grads) <= 1e-6
  assert float(aux2['accuracy']) == pytest.approx(float(aux['accuracy']), abs=1e-6)
  assert aux2[losses_lib.LOSS_WEIGHT] == aux2['num_tokens'] == 2 + 16
  # Equal weights (a loss that does not say what it averages) give the mean of the two token
  # means instead, which here is far from the whole batch's.
  per_half = [float(run(tiny_models.lm_loss, half, 1)[0]) for half in halves]
  equal, _, _, equal_grads = run(_without_weight(tiny_models.lm_loss), batch, 2)
  assert float(equal) == pytest.approx(np.mean(per_half), abs=1e-6)
  assert abs(float(equal) - float(loss)) > 0.01
  assert _max_diff(equal_grads, grads) > 1e-3


def test_loss_evaluator_weights_batches_by_their_tokens(mesh):
  model = tiny_models.make_model(0, tiny_models.TinyConfig(dropout_rate=0.0))
  batch = _uneven_batch()
  halves = [jax.tree.map(lambda x, i=i: x[i::2], batch) for i in range(2)]
  whole = train_lib.make_loss_evaluator(tiny_models.lm_loss, lambda: iter([batch]), mesh)(model, 0)
  split = train_lib.make_loss_evaluator(tiny_models.lm_loss, lambda: iter(halves), mesh)(model, 0)
  assert split['loss'] == pytest.approx(whole['loss'], abs=1e-6)
  assert split['accuracy'] == pytest.approx(whole['accuracy'], abs=1e-6)
  assert split['num_tokens'] == whole['num_tokens'] == 18
  each = [train_lib.make_loss_evaluator(tiny_models.lm_loss, lambda h=h: iter([h]), mesh)(model, 0)['loss']
          for h in halves]
  unweighted = train_lib.make_loss_evaluator(_without_weight(tiny_models.lm_loss), lambda: iter(halves), mesh)
  assert unweighted(model, 0)['loss'] == pytest.approx(np.mean(each), abs=1e-6)
  assert abs(np.mean(each) - whole['loss']) > 0.01


def test_bf16_compute_keeps_fp32_master_weights(mesh):
  factory = lambda: tiny_models.make_model(0, dtype=jnp.bfloat16, param_dtype=jnp.float32)  # noqa: E731
  state = train_lib.create_train_state(factory, optim.OptimizerConfig(warmup_steps=0, total_steps=5), mesh)
  step = train_lib.make_train_step(tiny_models.lm_loss, sharding.shardings_of(state),
                                   sharding.batch_sharding(mesh))
  state, metrics = step(state, sharding.shard_batch(tiny_models.token_data(8), mesh))
  assert np.isfinite(float(metrics['loss']))
  dtypes = {x.dtype for x in jax.tree.leaves((state.params, state.opt_state[1][0].mu,
                                              state.opt_state[1][0].nu))}
  assert dtypes == {jnp.dtype(jnp.float32)}


# --------------------------------------------------------------------------- data and checkpoints


def test_array_iterator_is_deterministic_and_resumable():
  data = {'x': np.arange(20), 'y': np.arange(20) * 10}
  it = train_lib.ArrayIterator(data, batch_size=6, seed=3)
  assert it.batches_per_epoch == 3
  first = [next(it)['x'] for _ in range(7)]
  assert sorted(np.concatenate(first[:3]).tolist()) != list(range(18))  # shuffled...
  assert len(set(np.concatenate(first[:3]).tolist())) == 18               # ...without repeats
  assert not np.array_equal(np.concatenate(first[:3]), np.concatenate(first[3:6]))  # new epoch order
  resumed = train_lib.ArrayIterator(data, batch_size=6, seed=3)
  probe = train_lib.ArrayIterator(data, batch_size=6, seed=3)
  for _ in range(4):
    next(probe)
  resumed.set_state(probe.get_state())
  for expected in first[4:]:
    np.testing.assert_array_equal(next(resumed)['x'], expected)
  # two processes together yield the single-process global batch
  halves = [train_lib.ArrayIterator(data, 6, seed=3, process_index=i, process_count=2) for i in range(2)]
  np.testing.assert_array_equal(np.concatenate([next(h)['x'] for h in halves]), first[0])
  with pytest.raises(ValueError, match='batch_size'):
    train_lib.ArrayIterator(data, batch_size=4, seed=3).set_state(probe.get_state())
  finite = train_lib.ArrayIterator(data, 8, shuffle=False, num_epochs=1, drop_remainder=False)
  assert [len(b['x']) for b in finite] == [8, 8, 4]


def test_checkpointer_keeps_last_and_best(tmp_path):
  tree = {'w': jnp.arange(4.0), 'rng': jax.random.key(1)}
  evals = {2: 5.0, 4: 1.0, 6: 3.0, 8: None, 10: 4.0}
  with Checkpointer(tmp_path, keep_last=2, best_metric='eval/loss', best_mode='min') as ckpt:
    for step, loss in evals.items():
      ckpt.save(step, jax.tree.map(lambda x: x, tree), meta={'step': step},
                metrics=None if loss is None else {'eval/loss': loss})
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 10]       # best (4) + last two
    assert ckpt.best_step() == 4
    assert not ckpt.save(10, tree)               # an existing step is not overwritten
  restored = Checkpointer(tmp_path).restore(tree, step=4)
  assert restored.meta == {'step': 4}
  assert jax.random.key_data(restored.tree['rng']).tolist() == jax.random.key_data(tree['rng']).tolist()


def _eval_fn(mesh):
  data = tiny_models.token_data(16, seed=9)
  return train_lib.make_loss_evaluator(
      tiny_models.lm_loss, lambda: train_lib.ArrayIterator(data, 8, shuffle=False, num_epochs=1), mesh)


# Orbax/tensorstore leave an asyncio callback behind when a read fails; harmless.
@pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning')
def test_corrupted_latest_checkpoint_falls_back(mesh, tmp_path):
  def config(steps):
    return dict(num_steps=steps, checkpoint_every=2, log_every=2, eval_every=3, keep_checkpoints=3,
                best_metric='eval/loss', progress_bar=False, seed=1,
                optimizer=dict(learning_rate=1e-2, warmup_steps=2, total_steps=8))

  def run(workdir, steps):
    iterator = train_lib.ArrayIterator(tiny_models.token_data(32), batch_size=8, seed=2)
    return train_lib.train(config(steps), lambda: tiny_models.make_model(0), tiny_models.lm_loss,
                           iterator, _eval_fn(mesh), workdir=workdir, mesh=mesh)

  reference = run(tmp_path / 'reference', 8)
  first = run(tmp_path / 'run', 6)
  assert first.step == 6
  ckpt_dir = tmp_path / 'run' / 'checkpoints'
  # saves at 2, 3 (eval), 4 and 6; kept: the last three + the best eval (3 or 6)
  assert sorted(int(p) for p in os.listdir(ckpt_dir)) == [3, 4, 6]
  # Truncate the array data of the newest checkpoint.
  for root, _, files in os.walk(ckpt_dir / '6' / 'state'):
    for name in files:
      if os.sep + 'd' in root:
        path = os.path.join(root, name)
        with open(path, 'r+b') as f:
          f.truncate(os.path.getsize(path) // 2)
  with pytest.warns(RuntimeWarning, match=r'(?s)checkpoints/6 is unreadable.*falling back'):
    resumed = run(tmp_path / 'run', 8)
  assert resumed.resumed_from == 4 and resumed.step == 8
  assert _max_diff(_host(resumed.state.params), _host(reference.state.params)) <= 1e-6
  assert resumed.eval_metrics['eval/loss'] == pytest.approx(reference.eval_metrics['eval/loss'], abs=1e-6)

  scalars = read_scalars(tmp_path / 'reference' / 'tensorboard')
  for tag in ('train/loss', 'train/learning_rate', 'train/grad_norm', 'train/accuracy',
              'perf/step_time_s', 'perf/examples_per_s', 'perf/tokens_per_s', 'eval/loss'):
    assert tag in scalars, (tag, sorted(scalars))
  assert [s for s, _ in scalars['train/loss']] == [2, 4, 6, 8]
  assert [s for s, _ in scalars['eval/loss']] == [3, 6, 8]
  assert scalars['train/learning_rate'][0][1] == pytest.approx(np.mean([0.0, 0.5e-2]))
  if sys.platform.startswith('linux'):  # host memory: the process's peak, logged and at evaluations
    peaks = [v for _, v in scalars['perf/host_peak_resident_gb']]
    assert len(peaks) == 4 + 3 and all(0.05 < v < 64 for v in peaks), peaks
    assert all(0 <= v <= max(peaks) for _, v in scalars['perf/eval_raised_peak_gb'])


def test_profile_steps_write_a_trace_for_tensorboard(mesh, tmp_path):
  """``profile_steps=2`` traces steps 2-3 (after the compiling step) into workdir/tensorboard."""
  config = train_lib.TrainConfig(num_steps=5, log_every=5, checkpoint_every=0, profile_steps=2,
                                 progress_bar=False, async_checkpointing=False)
  iterator = train_lib.ArrayIterator(tiny_models.token_data(32), batch_size=8, seed=2)
  result = train_lib.train(config, lambda: tiny_models.make_model(0), tiny_models.lm_loss, iterator,
                           workdir=tmp_path, mesh=mesh)
  assert result.step == 5
  traces = list((tmp_path / 'tensorboard' / 'plugins' / 'profile').glob('*/*.xplane.pb'))
  assert len(traces) == 1 and traces[0].stat().st_size > 1000, traces
  # The trace holds the jitted train step's executions.
  assert b'step' in traces[0].read_bytes()
  # Off by default: no profile directory.
  iterator = train_lib.ArrayIterator(tiny_models.token_data(32), batch_size=8, seed=2)
  train_lib.train(dataclasses.replace(config, profile_steps=0), lambda: tiny_models.make_model(0),
                  tiny_models.lm_loss, iterator, workdir=tmp_path / 'off', mesh=mesh)
  assert not (tmp_path / 'off' / 'tensorboard' / 'plugins').exists()


# --------------------------------------------------------------------------- kill / SIGTERM


def _worker_env(cache_dir: str) -> dict:
  env = dict(os.environ)
  env.pop('XLA_FLAGS', None)
  env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0', JAX_PLATFORMS='cpu')
  return env


def _run_worker(workdir, cache_dir, *, out=None, pause_at=0, send=None, timeout=300):
  """Runs the worker; with ``send`` delivers that signal once it prints ``PAUSED``."""
  cmd = [sys.executable, WORKER, '--workdir', str(workdir), '--steps', '10', '--checkpoint-every', '3',
         '--devices', '8', '--mesh', '2,2,2', '--pause-at', str(pause_at)]
  if out:
    cmd += ['--out', str(out)]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env=_worker_env(cache_dir))
  watchdog = threading.Timer(timeout, proc.kill)
  watchdog.start()
  lines = []
  try:
    for line in proc.stdout:
      lines.append(line)
      if send is not None and line.startswith('PAUSED'):
        proc.send_signal(send)
    proc.wait()
  finally:
    watchdog.cancel()
  output = ''.join(lines)
  markers = [line.strip() for line in lines
             if line.split(' ')[0] in ('STEP', 'PAUSED', 'RESUMED', 'DONE', 'PREEMPTED')]
  return proc.returncode, markers, output


@pytest.fixture(scope='module')
def worker_cache(tmp_path_factory):
  return str(tmp_path_factory.mktemp('jax_cache'))


@pytest.fixture(scope='module')
def reference_params(tmp_path_factory, worker_cache):
  """Parameters of an uninterrupted 10-step run."""
  root = tmp_path_factory.mktemp('reference')
  code, markers, output = _run_worker(root / 'work', worker_cache, out=root / 'params.npz')
  assert code == 0 and markers[-1] == 'DONE 10', output[-4000:]
  return dict(np.load(root / 'params.npz'))


def _assert_same_params(path, reference):
  params = dict(np.load(path))
  assert params.keys() == reference.keys()
  for name in reference:
    np.testing.assert_allclose(params[name], reference[name], atol=1e-6, rtol=0, err_msg=name)


def test_sigkill_between_checkpoints_then_resume_is_exact(tmp_path, worker_cache, reference_params):
  code, markers, output = _run_worker(tmp_path / 'work', worker_cache, pause_at=7, send=signal.SIGKILL)
  assert code == -signal.SIGKILL and 'PAUSED 7' in markers, output[-4000:]
  assert {'3', '6'} <= set(os.listdir(tmp_path / 'work' / 'checkpoints'))
  code, markers, output = _run_worker(tmp_path / 'work', worker_cache, out=tmp_path / 'params.npz')
  assert code == 0 and markers[0] == 'STEP 7' and 'RESUMED 6' in markers, output[-4000:]
  assert markers[-1] == 'DONE 10'
  _assert_same_params(tmp_path / 'params.npz', reference_params)


def test_sigterm_saves_at_step_boundary_and_exits(tmp_path, worker_cache, reference_params):
  code, markers, output = _run_worker(tmp_path / 'work', worker_cache, pause_at=4, send=signal.SIGTERM)
  assert code == 0 and markers[-1] == 'PREEMPTED 4', output[-4000:]
  assert 'STEP 5' not in markers
  assert '4' in os.listdir(tmp_path / 'work' / 'checkpoints')
  code, markers, output = _run_worker(tmp_path / 'work', worker_cache, out=tmp_path / 'params.npz')
  assert code == 0 and markers[0] == 'STEP 5' and 'RESUMED 4' in markers, output[-4000:]
  _assert_same_params(tmp_path / 'params.npz', reference_params)
