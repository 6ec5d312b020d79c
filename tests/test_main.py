"""The command line: user errors are one line and exit 2; --help lists systems, presets and fields."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _main(*args, cwd=REPO):
  env = dict(os.environ, PYTHONPATH=REPO)
  return subprocess.run([sys.executable, '-m', 'recomp_jax.main', *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def test_unknown_config_field_is_one_line_and_exit_2():
  out = _main('--config=configs/nq_extractive.py:ci', '--config.train.bacth_size=4')
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [out.stderr.strip()]
  assert 'train.bacth_size' in out.stderr and 'batch_size' in out.stderr and 'Traceback' not in out.stderr


def test_field_the_preset_ignores_is_an_error():
  out = _main('--config=configs/nq_extractive.py:shared', '--config.data.demo_train=5')
  assert out.returncode == 2 and "data.source='jsonl'" in out.stderr


def test_field_of_another_system_names_that_system():
  out = _main('--config=configs/nq_extractive.py:ci', '--config.teacher.model=x')
  assert out.returncode == 2 and 'Traceback' not in out.stderr
  assert "--config.teacher.model is a field of the abstractive system; config.system='extractive' does not read it" in out.stderr


def test_value_outside_the_fields_choices_is_one_line_naming_them(tmp_path):
  out = _main('--config=configs/nq_filco.py:ci', '--config.filco.measure=bleu', f'--workdir={tmp_path}')
  assert out.returncode == 2 and 'Traceback' not in out.stderr
  assert "config.filco.measure='bleu' is not allowed (allowed: 'strinc', 'lexical', 'cxmi')" in out.stderr


def test_unknown_preset_and_missing_config():
  out = _main('--config=configs/nq_extractive.py:nope')
  assert out.returncode == 2 and 'available: paper, shared, demo, ci, quickstart' in out.stderr
  assert _main().returncode == 2


def test_help_lists_systems_presets_and_fields():
  out = _main('--help')
  assert out.returncode == 0
  assert 'systems (config.system): abstractive, extractive, filco, truncation, color, kcomp, lm' in out.stdout
  assert 'configs/nq_color.py: paper, shared, demo, ci' in out.stdout and "--config.color.variant='paper'" in out.stdout
  assert 'configs/hotpotqa_color.py: shared, ci' in out.stdout and "--config.color.metric='r1'" in out.stdout
  assert 'configs/nq_truncation.py: shared, demo, ci' in out.stdout and '--config.truncation.tokens=48' in out.stdout
  assert 'configs/wikitext_lm.py: paper, shared, shared_abstractive, ci' in out.stdout and "--config.lm.stride=32" in out.stdout
  assert 'configs/medquad_kcomp.py: paper, shared, demo, ci' in out.stdout and "--config.kcomp.variant='paper'" in out.stdout
  assert 'configs/nq_abstractive.py: paper, shared, demo, ci' in out.stdout
  assert "--config.teacher.api='chat'" in out.stdout
  assert 'configs/nq_extractive.py: paper, shared, demo, ci, quickstart' in out.stdout
  assert '--config.candidates.max_candidates_eval=0' in out.stdout
  assert '--config.retrieval.rerank=' in out.stdout
  # generated from the typed sections: each field with its help and choices, under its owner
  assert "--config.critic.targets='teacher'  what the critic judges" in out.stdout
  assert "[one of: strinc, lexical, cxmi]" in out.stdout
  sections = [line for line in out.stdout.splitlines() if line.endswith(':') or 'fields (' in line]
  assert any(line.startswith('filco system fields') for line in sections)


def test_bad_data_row_exits_2_naming_file_and_line(tmp_path):
  bad = tmp_path / 'eval.jsonl'
  bad.write_text('{"question": "q1", "answers": ["a"], "ctxs": []}\n'
                 '{"question": "q2", "answers": 7, "ctxs": []}\n')
  out = _main('--config=configs/nq_extractive.py:shared', f'--config.data.train_path={bad}',
              f'--config.data.eval_path={bad}', '--config.data.flavour=dpr', '--config.train.epochs=0',
              f'--workdir={tmp_path / "run"}')
  assert out.returncode == 2, out.stderr[-2000:]
  assert f'{bad}:2' in out.stderr and 'answers' in out.stderr and 'Traceback' not in out.stderr


def test_unknown_system_exits_2_listing_the_systems(tmp_path):
  out = _main('--config=configs/nq_extractive.py:quickstart', '--config.system=nope', f'--workdir={tmp_path}')
  assert out.returncode == 2
  assert "config.system='nope' is not one of ['abstractive', 'extractive', 'filco', 'truncation', 'color', 'kcomp', 'lm']" in out.stderr
  assert 'Traceback' not in out.stderr
