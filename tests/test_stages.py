"""A finished stage that no longer matches its fingerprint says why before it is recomputed."""

import json
import os

from recomp_jax import stages
from recomp_jax.stages import StageRunner, fingerprint_change


def _warnings(monkeypatch) -> list[str]:
  seen = []
  monkeypatch.setattr(stages.logging, 'warning', lambda msg, *args: seen.append(msg % args))
  return seen


def test_a_changed_input_or_upstream_stage_is_named(tmp_path, monkeypatch):
  seen = _warnings(monkeypatch)
  runner = StageRunner(str(tmp_path))
  runner.run('data', {'n': 1}, lambda d: {'rows': 1})
  runner.run('train', {'lr': 0.1, 'steps': 3}, lambda d: {'loss': 1.0}, deps=('data',),
             code=('recomp_jax.training.losses',))
  done = json.load(open(os.path.join(tmp_path, 'stages', 'train', 'DONE.json')))
  assert set(done['fingerprint_parts']) == {'inputs', 'deps', 'code'}
  assert list(done['fingerprint_parts']['code']) == ['recomp_jax.training.losses']
  assert seen == []
  again = StageRunner(str(tmp_path))
  again.run('data', {'n': 2}, lambda d: {'rows': 2})
  again.run('train', {'lr': 0.2, 'steps': 3}, lambda d: {'loss': 0.5}, deps=('data',),
            code=('recomp_jax.training.losses',))
  assert len(seen) == 2
  assert 'input n changed' in seen[0]
  assert 'input lr changed; upstream stage data changed' in seen[1]
  assert 'steps' not in seen[1] and 'code of' not in seen[1]


def test_fingerprint_change_names_code_modules_and_old_stages():
  old = {'inputs': {'a': '1'}, 'deps': {}, 'code': {'recomp_jax.models': 'x', 'recomp_jax.reader': 'y'}}
  new = {'inputs': {'a': '1'}, 'deps': {}, 'code': {'recomp_jax.models': 'z', 'recomp_jax.reader': 'y'}}
  assert fingerprint_change(old, new) == 'code of recomp_jax.models changed'
  assert 'recorded no fingerprint parts' in fingerprint_change(None, new)
