"""Every experiment config loads in each preset; the offline presets build their data splits."""

import importlib.util
import json
import os

import pytest

from recomp_jax.reader import prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), 'shared', 'data')

PRESETS = {
    'nq_extractive.py': ('paper', 'shared', 'demo', 'ci', 'quickstart'),
    'tqa_extractive.py': ('paper', 'shared'),
    'hotpotqa_extractive.py': ('paper', 'shared'),
    'fever_filco.py': ('paper',),
    'wow_filco.py': ('paper',),
    'wikitext_lm.py': ('paper', 'shared', 'ci'),
    'nq_truncation.py': ('shared', 'demo', 'ci'),
    'nq_color.py': ('paper', 'shared', 'demo', 'ci'),
    'hotpotqa_color.py': ('shared', 'ci'),
}


def _load(name):
  spec = importlib.util.spec_from_file_location(name[:-3], os.path.join(REPO, 'configs', name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.parametrize('name', sorted(PRESETS))
def test_every_preset_loads_and_unknown_presets_fail(name):
  module = _load(name)
  for preset in PRESETS[name]:
    config = module.get_config(preset)
    assert config.workdir or preset == 'paper'
    if config.system == 'extractive':
      assert config.eval.top_k_sentences == (2 if name.startswith('hotpot') else 1)
  with pytest.raises(ValueError, match='unknown preset'):
    module.get_config('nope')


@pytest.mark.parametrize('name,n_eval', [('tqa_extractive.py', 500), ('hotpotqa_extractive.py', 100)])
def test_shared_presets_hold_out_the_tail_of_their_file(tmp_path, name, n_eval):
  config = _load(name).get_config('shared')
  path = os.path.join(REPO, config.data.train_path)
  if not os.path.exists(path):
    pytest.skip(f'{path} not found (../shared/data is absent)')
  from recomp_jax.pipelines import shared
  old = os.getcwd()
  os.chdir(REPO)
  try:
    summary = shared.stage_data(config, str(tmp_path))
  finally:
    os.chdir(old)
  assert summary['test'] == n_eval
  ids = {split: [json.loads(line)['id'] for line in open(tmp_path / f'{split}.jsonl')]
         for split in ('train', 'dev', 'test')}
  assert not set(ids['test']) & (set(ids['train']) | set(ids['dev']))
  total = sum(1 for _ in open(path))
  # The reader's five in-context examples are the dataset's own training questions (data.shots),
  # in no split; HotpotQA's include a yes/no question.
  shots = summary['shots']
  assert config.data.shots == 'train' and len(shots) == 5
  assert not {s['id'] for s in shots} & (set(ids['train']) | set(ids['dev']) | set(ids['test']))
  assert len(ids['train']) + len(ids['dev']) + len(ids['test']) + len(shots) == total
  assert any(s['answer'].lower() in ('yes', 'no') for s in shots) == name.startswith('hotpot')
  resources = shared.Resources(config)
  resources.use_shots(shots)
  assert resources.few_shot == ''.join(f"{s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
  resources.use_shots(None)
  assert resources.few_shot == prompts.FEW_SHOT_PREFIX
  # A run testing on fewer questions (the last few of the tail) still trains on none of the tail,
  # a shuffled training draw included (audit: the tail used to move with max_eval).
  config.data.max_eval, config.data.train_subset = n_eval // 5, 'shuffled'
  smaller = tmp_path / 'smaller'
  smaller.mkdir()
  os.chdir(REPO)
  try:
    summary = shared.stage_data(config, str(smaller))
  finally:
    os.chdir(old)
  seen = {split: [json.loads(line)['id'] for line in open(smaller / f'{split}.jsonl')] for split in ('train', 'dev', 'test')}
  assert seen['test'] == ids['test'][-(n_eval // 5):]
  assert not (set(seen['train']) | set(seen['dev'])) & set(ids['test'])
  assert len(seen['train']) + len(seen['dev']) + len(summary['shots']) == total - n_eval
  config.data.max_eval = n_eval + 1
  os.chdir(REPO)
  try:
    with pytest.raises(shared.PipelineError, match='over data.holdout_size'):
      shared.stage_data(config, str(smaller))
  finally:
    os.chdir(old)


@pytest.mark.parametrize('name,measure,against,metric', [('fever_filco.py', 'lexical', 'query', 'em'),
                                                         ('wow_filco.py', 'cxmi', 'output', 'f1')])
def test_kilt_filco_presets_read_the_hub_task(name, measure, against, metric):
  from recomp_jax.evaluation.report import main_metric
  config = _load(name).get_config('paper')
  assert (config.data.source, config.data.hf_name, config.data.hf_config) == ('hf', 'kilt_tasks', name[:-9])
  assert config.data.hf_eval_split == 'validation' and config.retrieval.method == 'dense'
  assert (config.filco.measure, config.filco.lexical_against) == (measure, against)
  assert main_metric(config.dataset) == metric
  with pytest.raises(ValueError, match='hub only'):
    _load(name).get_config('shared')


def _flat(tree, prefix=''):
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(_flat(value, f'{prefix}{key}.'))
    else:
      out[prefix + key] = list(value) if isinstance(value, tuple) else value
  return out


def test_abstractive_shared_preset_is_the_committed_reader_sentence_run():
  """README says `configs/nq_abstractive.py:shared` runs the committed reader-sentence result
  again: every config field that run recorded equals today's preset (fields added since are
  not in the file, so they cannot be compared)."""
  path = os.path.join(REPO, 'results', 'nq_abstractive_shared_reader_sentence.json')
  recorded = _flat(json.load(open(path))['config'])
  preset = _flat(_load('nq_abstractive.py').get_config('shared').to_dict())
  differing = {k: (recorded[k], preset[k]) for k in recorded.keys() & preset.keys() if recorded[k] != preset[k]}
  assert not differing
  assert recorded['critic.targets'] == 'reader_sentence' and recorded['data.max_train'] == 200


@pytest.mark.parametrize('name', sorted(n for n in os.listdir(os.path.join(REPO, 'configs')) if n.endswith('.py')))
def test_every_config_file_loads_every_preset_its_docstring_lists(name):
  from recomp_jax.main import _presets
  from recomp_jax.pipelines.runner import SYSTEMS, TASKS
  presets = _presets(os.path.join(REPO, 'configs', name)).split(', ')
  assert presets and presets != ['(see the file)'], f'{name}: its docstring lists no preset'
  from recomp_jax import config_fields
  from recomp_jax.pipelines.runner import system_fields
  for preset in presets:
    config = _load(name).get_config(preset)
    assert config.system in {**SYSTEMS, **TASKS} and config.preset == preset
    # typed: every field declared by the shared section or the system's own, of its type and choices
    config_fields.check(config, system_fields(config.system), config.system)
    assert set(config_fields.leaves(config)) == {f.name for f in system_fields(config.system)}


def test_every_presets_reader_answer_seed_is_a_committed_artefact(tmp_path):
  """A preset's ``reader.prediction_seed`` names a file under ``results/artifacts`` whose hash is the
  one its ``settings.json`` records and whose every line a cache accepts (run from the repository root)."""
  import glob
  import hashlib
  import gzip
  from recomp_jax.reader.prediction_cache import PredictionCache, answer_key
  seen = 0
  for path in sorted(glob.glob(os.path.join(REPO, 'configs', '*.py'))):
    module = _load(os.path.basename(path))
    presets = PRESETS.get(os.path.basename(path)) or ('shared',)
    for preset in presets:
      try:
        config = module.get_config(preset)
      except ValueError:
        continue
      for seed in config.reader.get('prediction_seed', ()):
        seen += 1
        assert seed.startswith('results/artifacts/'), (path, preset, seed)
        full = os.path.join(REPO, seed)
        settings = json.load(open(os.path.join(os.path.dirname(full), 'settings.json')))
        assert hashlib.sha256(open(full, 'rb').read()).hexdigest() == settings['sha256'], seed
        assert os.path.exists(os.path.join(os.path.dirname(full), 'NOTICE')), seed
        counts = PredictionCache(str(tmp_path / f'{seen}.sqlite'), 'any').seed(full)
        assert counts['read'] == counts['added'] == settings['answers'], seed
        # The answers are stored under today's reader key: code on the answer path that changed
        # (recomp_jax.models, ...) makes a seeded run decode everything again, silently.
        key = answer_key(settings['reader'], reader_stops=settings['reader_stops'], stops=settings['answer_stop'],
                         postprocess=settings['postprocess'])
        assert settings['reader_key'] == key, (
            f'{seed}: its answers are keyed {settings["reader_key"][:16]}, the reader code now gives {key[:16]}. If the '
            'change leaves the answers as they are (decode a sample of the prompts again to show it), run '
            f'`python -m recomp_jax.reader.prediction_cache rekey {seed} {settings["reader_key"]} {key}` and update '
            'settings.json (reader_key, sha256, what was checked); otherwise decode them again')
        with gzip.open(full, 'rt', encoding='utf-8') as f:
          assert {json.loads(line)['reader'] for line in f} == {key}, seed
  assert seen >= 1  # K-COMP :shared reads one
