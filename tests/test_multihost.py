"""Multi-host training proven on one machine: 2 processes x 4 CPU devices on loopback.

``tests/_multihost_worker.py`` trains the extractive compressor (tiny BERT dual encoder,
contrastive loss) on a ``data=2, fsdp=2, tensor=2`` mesh. Run as two processes joined by
``jax.distributed`` (a local coordinator, gloo collectives), each feeding its half of every
global batch, it must reach the parameters of the same run as one 8-device process; killed
between checkpoints and restarted, it must resume exactly, on two processes or on one.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

# gloo gives up when one process reaches a collective 30 s after the other (a fixed timeout in
# XLA's CPU client), which a busy machine can cause: scripts/test.sh runs these alone.
pytestmark = pytest.mark.alone

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, '_multihost_worker.py')
REPO = os.path.dirname(HERE)
STEPS, EVERY = 10, 3
# Cross-process all-reduces add in another order than one process does: float32 rounding only.
ATOL = 2e-5


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _env(cache_dir) -> dict:
  env = dict(os.environ)
  for key in ('XLA_FLAGS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID', 'JAX_COORDINATOR_ADDRESS'):
    env.pop(key, None)
  # The workers import the checkout under test, whatever the installed package points to.
  env['PYTHONPATH'] = os.pathsep.join(p for p in (REPO, env.get('PYTHONPATH', '')) if p)
  env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS='0',
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES='0', JAX_PLATFORMS='cpu')
  return env


class _Job:
  """``num_processes`` workers of one run, their output collected line by line."""

  def __init__(self, workdir, cache_dir, *, num_processes, out=None, pause_at=0, timeout=400):
    port = _free_port()
    self.procs, self.lines = [], []
    for pid in range(num_processes):
      cmd = [sys.executable, WORKER, '--workdir', str(workdir), '--steps', str(STEPS),
             '--checkpoint-every', str(EVERY), '--devices', str(8 // num_processes),
             '--pause-at', str(pause_at)]
      if num_processes > 1:
        cmd += ['--num-processes', str(num_processes), '--process-id', str(pid),
                '--coordinator', f'127.0.0.1:{port}']
      if out and pid == 0:
        cmd += ['--out', str(out)]
      proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=_env(cache_dir))
      self.procs.append(proc)
      self.lines.append([])
    self.readers = [threading.Thread(target=self._read, args=(i,), daemon=True)
                    for i in range(num_processes)]
    for reader in self.readers:
      reader.start()
    self.watchdog = threading.Timer(timeout, self.kill)
    self.watchdog.start()

  def _read(self, i):
    for line in self.procs[i].stdout:
      self.lines[i].append(line)

  def markers(self, i):
    return [line.strip() for line in self.lines[i]
            if line.split(' ')[0] in ('ROWS', 'STEP', 'PAUSED', 'RESUMED', 'DONE')]

  def output(self):
    return '\n'.join(f'--- process {i}\n' + ''.join(lines[-60:]) for i, lines in enumerate(self.lines))

  def kill(self):
    for proc in self.procs:
      if proc.poll() is None:
        proc.kill()

  def wait(self):
    codes = [proc.wait() for proc in self.procs]
    for reader in self.readers:
      reader.join(timeout=10)
    self.watchdog.cancel()
    return codes

  def wait_for_all(self, marker, timeout=300):
    deadline = threading.Event()
    timer = threading.Timer(timeout, deadline.set)
    timer.start()
    try:
      while not deadline.is_set():
        if all(marker in self.markers(i) for i in range(len(self.procs))):
          return True
        if any(proc.poll() is not None for proc in self.procs):
          return False
        deadline.wait(0.1)
      return False
    finally:
      timer.cancel()


def _params(path):
  return dict(np.load(path))


def _assert_close(path, reference):
  params = _params(path)
  assert params.keys() == reference.keys() and len(params) > 30
  for name in reference:
    np.testing.assert_allclose(params[name], reference[name], atol=ATOL, rtol=0, err_msg=name)


@pytest.fixture(scope='module')
def cache_dir(tmp_path_factory):
  return tmp_path_factory.mktemp('jax_cache')


@pytest.fixture(scope='module')
def single_process_params(tmp_path_factory, cache_dir):
  """One process, 8 devices, uninterrupted."""
  root = tmp_path_factory.mktemp('single')
  job = _Job(root / 'work', cache_dir, num_processes=1, out=root / 'params.npz')
  codes = job.wait()
  assert codes == [0] and job.markers(0)[-1] == f'DONE {STEPS}', job.output()
  assert job.markers(0)[0] == 'ROWS 0/1 16'
  return _params(root / 'params.npz')


@pytest.mark.slow
def test_two_processes_reach_the_single_process_parameters(tmp_path, cache_dir, single_process_params):
  job = _Job(tmp_path / 'work', cache_dir, num_processes=2, out=tmp_path / 'params.npz')
  codes = job.wait()
  assert codes == [0, 0], job.output()
  for i in range(2):
    markers = job.markers(i)
    assert markers[0] == f'ROWS {i}/2 8', job.output()  # each process feeds half of each batch
    assert markers[-1] == f'DONE {STEPS}'
  # One copy of the checkpoints, written collectively (the worker keeps the last two).
  assert sorted(int(p) for p in os.listdir(tmp_path / 'work' / 'checkpoints')) == [9, 10]
  _assert_close(tmp_path / 'params.npz', single_process_params)


def test_killing_both_processes_then_restarting_resumes_exactly(tmp_path, cache_dir, single_process_params):
  job = _Job(tmp_path / 'work', cache_dir, num_processes=2, pause_at=7)
  paused = job.wait_for_all('PAUSED 7')
  job.kill()
  job.wait()
  assert paused, job.output()
  assert {'3', '6'} <= set(os.listdir(tmp_path / 'work' / 'checkpoints'))
  # The same checkpoint, resumed on two processes and (a copy) on one process of 8 devices.
  subprocess.run(['cp', '-r', str(tmp_path / 'work'), str(tmp_path / 'work_single')], check=True)
  for workdir, processes in (('work', 2), ('work_single', 1)):
    out = tmp_path / f'{workdir}.npz'
    job = _Job(tmp_path / workdir, cache_dir, num_processes=processes, out=out)
    codes = job.wait()
    assert codes == [0] * processes, job.output()
    for i in range(processes):
      markers = job.markers(i)
      steps = [m for m in markers if m.startswith('STEP')]
      assert steps[0] == 'STEP 7' and 'RESUMED 6' in markers and markers[-1] == f'DONE {STEPS}', \
          job.output()
    _assert_close(out, single_process_params)


def test_main_refuses_a_batch_the_processes_cannot_split(tmp_path):
  """Three processes and ``train.batch_size=8``: every process stops at start-up, before any stage."""
  port = _free_port()
  procs = []
  for pid in range(3):
    env = _env(tmp_path / 'cache')
    env.update(JAX_COORDINATOR_ADDRESS=f'127.0.0.1:{port}', JAX_NUM_PROCESSES='3',
               JAX_PROCESS_ID=str(pid), XLA_FLAGS='--xla_force_host_platform_device_count=1')
    procs.append(subprocess.Popen(
        [sys.executable, '-m', 'recomp_jax.main', '--config=configs/nq_extractive.py:ci',
         f'--workdir={tmp_path / "work"}'], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True))
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=240)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
  assert [proc.returncode for proc in procs] == [2, 2, 2], '\n'.join(o[-2000:] for o in outputs)
  for output in outputs:
    assert ('3 processes cannot split the global batch: config.train.batch_size=8 '
            '(each must be a multiple of 3)') in output
  assert not os.path.exists(tmp_path / 'work' / 'stages')


def test_only_process_zero_writes_the_results(tmp_path, monkeypatch):
  """On any process but 0 the results step writes nothing (not results.json, predictions,
  results.md nor TensorBoard) and returns None; the system and context are not even read."""
  from recomp_jax import sharding
  from recomp_jax.pipelines import runner
  monkeypatch.setattr(sharding, 'is_main_process', lambda: False)
  assert runner.write_results(None, None, str(tmp_path), []) is None
  assert list(tmp_path.iterdir()) == []


STAGES_WORKER = os.path.join(HERE, '_stages_worker.py')


def _run_stages(workdir, cache_dir, *, stop_after=0, remote=None, timeout=240):
  """Both processes of ``tests/_stages_worker.py``; returns (exit codes, RESULT of each, output)."""
  port = _free_port()
  procs = [subprocess.Popen(
      [sys.executable, STAGES_WORKER, '--workdir', str(workdir), '--num-processes', '2',
       '--process-id', str(pid), '--coordinator', f'127.0.0.1:{port}', '--stop-after', str(stop_after)]
      + (['--remote', str(remote)] if remote else []),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(cache_dir))
      for pid in range(2)]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=timeout)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  results = [next((json.loads(line[len('RESULT '):]) for line in out.splitlines()
                   if line.startswith('RESULT ')), None) for out in outputs]
  return [p.returncode for p in procs], results, '\n'.join(o[-3000:] for o in outputs)


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_pipeline_stages_leave_the_files_to_process_zero(tmp_path, cache_dir):
  """Two processes run a file stage and a resumable collective stage in one work directory:
  process 0 alone runs the file stage; both compute the collective one, in step, but only
  process 0 appends its records (one line per item, never two), also after both are killed
  mid-stage and restarted; a third run skips both stages on both processes."""
  work = tmp_path / 'work'
  scores = work / 'stages' / 'score' / 'scores.jsonl'
  codes, results, output = _run_stages(work, cache_dir, stop_after=3)
  assert codes == [3, 3], output
  assert [r['id'] for r in _lines(scores)] == [0, 1, 2], output
  assert not (work / 'stages' / 'score' / 'DONE.json').exists()

  codes, results, output = _run_stages(work, cache_dir)
  assert codes == [0, 0], output
  assert [r['ran'] for r in results] == [['score'], ['score']], output  # items was done
  records = _lines(scores)
  assert [r['id'] for r in records] == list(range(8)), output
  assert all(r['gathered'] == [10 * r['id'], 10 * r['id'] + 1] for r in records)
  expected = {'items': {'items': 8}, 'score': {'records': 8, 'total': sum(20 * i + 1 for i in range(8))}}
  assert [r['summaries'] for r in results] == [expected, expected]
  assert (work / 'stages' / 'score' / 'writer.txt').read_text() == '0'
  done = json.loads((work / 'stages' / 'score' / 'DONE.json').read_text())
  assert set(done['manifest']) == {'scores.jsonl', 'writer.txt'}

  codes, results, output = _run_stages(work, cache_dir)
  assert codes == [0, 0], output
  assert [r['ran'] for r in results] == [[], []]
  assert [r['summaries'] for r in results] == [expected, expected]
  assert all(r['timings'] == {'items': 0.0, 'score': 0.0} for r in results)


@pytest.mark.slow
def test_a_remote_workdir_is_mirrored_on_every_process(tmp_path, cache_dir):
  """A remote workdir (a local directory stands in for gs://) with one local mirror per process:
  process 1 reads the file stage's output from its own mirror (downloaded once process 0 has
  uploaded it); killed and restarted on the same machines, both resume the collective stage
  from process 0's records; on fresh machines (new, empty mirrors) both skip both stages."""
  bucket, work = tmp_path / 'bucket', tmp_path / 'vm'
  codes, _, output = _run_stages(work, cache_dir, stop_after=3, remote=bucket)
  assert codes == [3, 3], output
  assert [r['id'] for r in _lines(work / 'stages' / 'score' / 'scores.jsonl')] == [0, 1, 2]
  assert (bucket / 'stages' / 'items' / 'DONE.json').exists()
  assert (bucket / 'stages' / 'score' / 'STARTED.json').exists()
  assert not (bucket / 'stages' / 'score' / 'DONE.json').exists()
  assert json.loads((tmp_path / 'vm-process1' / 'stages' / 'items' / 'items.json').read_text()) == \
      list(range(8))  # process 1 never wrote it: downloaded

  codes, results, output = _run_stages(work, cache_dir, remote=bucket)
  assert codes == [0, 0], output
  assert [r['ran'] for r in results] == [['score'], ['score']], output
  assert [r['id'] for r in _lines(bucket / 'stages' / 'score' / 'scores.jsonl')] == list(range(8))
  expected = {'items': {'items': 8}, 'score': {'records': 8, 'total': sum(20 * i + 1 for i in range(8))}}
  assert [r['summaries'] for r in results] == [expected, expected]

  codes, results, output = _run_stages(tmp_path / 'new-vm', cache_dir, remote=bucket)
  assert codes == [0, 0], output
  assert [r['ran'] for r in results] == [[], []], output
  assert [r['summaries'] for r in results] == [expected, expected]
  for process_dir in ('new-vm', 'new-vm-process1'):
    assert (tmp_path / process_dir / 'stages' / 'score' / 'scores.jsonl').read_bytes() == \
        (bucket / 'stages' / 'score' / 'scores.jsonl').read_bytes()


@pytest.mark.slow
def test_a_file_stage_runs_on_process_zero_alone(tmp_path, cache_dir):
  codes, results, output = _run_stages(tmp_path / 'work', cache_dir)
  assert codes == [0, 0], output
  assert [r['ran'] for r in results] == [['items', 'score'], ['score']], output
