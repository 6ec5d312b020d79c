"""A remote workdir mirrored on local disk: stages upload when they finish and a fresh machine
downloads them instead of recomputing; stale remote stages (and their checkpoints) are removed.

A local directory stands in for the bucket: :mod:`etils.epath` gives ``gs://`` the same
calls (``copy``, ``rglob``, ``rmtree``), and the mirror logic is what is tested here.
"""

import json
import os

import pytest

from recomp_jax import storage
from recomp_jax.stages import StageRunner


def _tree(root):
  out = {}
  for directory, _, names in os.walk(root):
    for name in names:
      full = os.path.join(directory, name)
      out[os.path.relpath(full, root)] = open(full, 'rb').read()
  return out


def _writer(text, calls):
  def fn(directory):
    calls.append(directory)
    with open(os.path.join(directory, 'out.txt'), 'w') as f:
      f.write(text)
    os.makedirs(os.path.join(directory, 'sub'), exist_ok=True)
    with open(os.path.join(directory, 'sub', 'part.jsonl'), 'w') as f:
      f.write(json.dumps({'id': 1, 'text': text}) + '\n')
    return {'chars': len(text)}
  return fn


def _refuse(directory):
  raise AssertionError(f'the stage should have been downloaded, not recomputed ({directory})')


def test_mirror_paths(tmp_path, monkeypatch):
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'cache'))
  root = storage.mirror_root('gs://bucket/runs/nq')
  assert root.startswith(str(tmp_path / 'cache' / 'recomp_jax' / 'workdirs' / 'nq-'))
  assert root != storage.mirror_root('gs://other/runs/nq')  # one mirror per remote workdir
  assert storage.mirror_root('gs://bucket/runs/nq', process_index=1) == root + '-process1'
  assert storage.mirror_root('gs://b/x', str(tmp_path / 'here')) == str(tmp_path / 'here')
  assert storage.is_remote('gs://b/x') and not storage.is_remote(str(tmp_path))
  assert storage.join('gs://b/x/', 'stages', 'a') == 'gs://b/x/stages/a'

  local = str(tmp_path / 'mirror')
  storage.register_mirror(local, 'gs://bucket/run/')
  try:
    assert storage.durable_path(os.path.join(local, 'stages', 'train', 'checkpoints')) == \
        'gs://bucket/run/stages/train/checkpoints'
    assert storage.durable_path(local) == 'gs://bucket/run'
    elsewhere = str(tmp_path / 'mirror2' / 'checkpoints')  # a sibling with the same prefix
    assert storage.durable_path(elsewhere) == elsewhere
  finally:
    storage.unregister_mirror(local)
  assert storage.durable_path(os.path.join(local, 'x')) == os.path.join(local, 'x')


def test_finished_stages_upload_and_a_fresh_mirror_downloads_them(tmp_path):
  bucket = str(tmp_path / 'bucket')
  calls = []
  first = StageRunner(str(tmp_path / 'machine1'), remote=bucket)
  assert first.run('a', {'n': 1}, _writer('alpha', calls)) == {'chars': 5}
  assert first.run('b', {'n': 2}, _writer('beta', calls), deps=('a',)) == {'chars': 4}
  with open(os.path.join(first.workdir, 'teacher_cache.sqlite'), 'wb') as f:
    f.write(b'cached responses')
  first.push_top_files()
  assert len(calls) == 2
  for name in ('a', 'b'):
    assert _tree(os.path.join(bucket, 'stages', name)) == _tree(first.stage_dir(name))
  done = json.load(open(os.path.join(bucket, 'stages', 'a', 'DONE.json')))
  assert set(done['manifest']) == {'out.txt', os.path.join('sub', 'part.jsonl')}

  # A new machine: nothing local, everything remote with the same fingerprints.
  second = StageRunner(str(tmp_path / 'machine2'), remote=bucket)
  assert second.run('a', {'n': 1}, _refuse) == {'chars': 5}
  assert second.run('b', {'n': 2}, _refuse, deps=('a',)) == {'chars': 4}
  assert second.timings == {'a': 0.0, 'b': 0.0}
  for name in ('a', 'b'):
    assert _tree(second.stage_dir(name)) == _tree(first.stage_dir(name))
  assert storage.download_top_files(bucket, second.workdir) == ['teacher_cache.sqlite']
  assert open(os.path.join(second.workdir, 'teacher_cache.sqlite'), 'rb').read() == b'cached responses'
  assert storage.download_top_files(bucket, second.workdir) == []  # a local one is kept

  # A changed input upstream reruns both stages and replaces the remote copies.
  third = StageRunner(str(tmp_path / 'machine3'), remote=bucket)
  calls.clear()
  third.run('a', {'n': 10}, _writer('gamma', calls))
  third.run('b', {'n': 2}, _writer('delta', calls), deps=('a',))
  assert len(calls) == 2
  assert open(os.path.join(bucket, 'stages', 'b', 'out.txt')).read() == 'delta'
  assert json.load(open(os.path.join(bucket, 'stages', 'a', 'DONE.json')))['fingerprint'] == \
      third.fingerprints['a']


def test_a_damaged_local_stage_is_restored_from_the_remote_copy(tmp_path):
  bucket = str(tmp_path / 'bucket')
  runner = StageRunner(str(tmp_path / 'local'), remote=bucket)
  runner.run('a', {'n': 1}, _writer('alpha', []))
  with open(os.path.join(runner.stage_dir('a'), 'out.txt'), 'w') as f:
    f.write('alphx')  # same size, other bytes
  again = StageRunner(str(tmp_path / 'local'), remote=bucket)
  assert again.run('a', {'n': 1}, _refuse) == {'chars': 5}
  assert open(os.path.join(again.stage_dir('a'), 'out.txt')).read() == 'alpha'


def test_an_unfinished_remote_stage_keeps_its_checkpoints_only_for_the_same_fingerprint(tmp_path):
  bucket = str(tmp_path / 'bucket')
  killed = StageRunner(str(tmp_path / 'machine1'), remote=bucket)
  local = str(tmp_path / 'machine1')
  storage.register_mirror(local, bucket)

  def train_then_die(directory):
    checkpoints = storage.durable_path(os.path.join(directory, 'checkpoints'))
    os.makedirs(os.path.join(checkpoints, '25'))
    with open(os.path.join(checkpoints, '25', 'state'), 'w') as f:
      f.write('step 25')
    raise KeyboardInterrupt  # the VM is preempted

  try:
    with pytest.raises(KeyboardInterrupt):
      killed.run('train', {'lr': 1e-4}, train_then_die)
  finally:
    storage.unregister_mirror(local)
  remote_checkpoint = os.path.join(bucket, 'stages', 'train', 'checkpoints', '25', 'state')
  assert os.path.exists(remote_checkpoint)  # written straight to the remote workdir
  assert not os.path.exists(os.path.join(local, 'stages', 'train', 'checkpoints'))
  assert json.load(open(os.path.join(bucket, 'stages', 'train', 'STARTED.json')))['fingerprint'] == \
      killed.fingerprints['train']

  seen = []
  resumed = StageRunner(str(tmp_path / 'machine2'), remote=bucket)
  resumed.run('train', {'lr': 1e-4}, lambda d: seen.append(os.path.exists(remote_checkpoint)) or {})
  assert seen == [True]  # same fingerprint: the new machine resumes from the remote checkpoint

  changed = StageRunner(str(tmp_path / 'machine3'), remote=bucket)
  os.makedirs(os.path.dirname(remote_checkpoint), exist_ok=True)
  open(remote_checkpoint, 'w').write('a checkpoint of lr=1e-4')
  os.remove(os.path.join(bucket, 'stages', 'train', 'DONE.json'))
  changed.run('train', {'lr': 3e-4}, lambda d: seen.append(os.path.exists(remote_checkpoint)) or {})
  assert seen == [True, False]  # another fingerprint: the old run's checkpoints are gone
