"""RECOMP extractive pipeline: pair selection, stage caching, resume, and end-to-end runs.

Tiny random BERT and Gemma models (real tokenizers) exercise every stage fast;
one test runs the ``ci`` preset with the real MiniLM and Gemma 3 270M.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

from recomp_jax.compressors import extractive
from recomp_jax.data.schema import FilterReport
from recomp_jax.pipelines import extractive as pipeline
from recomp_jax.pipelines import runner as pipeline_runner
from recomp_jax.pipelines import shared
from recomp_jax.stages import ResumableJsonl, StageRunner, costs_table, map_resumable, read_records

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- pair selection


def test_select_pair_loglik_positive_and_hard_negatives():
  cands = ['a', 'b', 'c', 'd', 'e', 'f', 'g']
  loglik = [-5.0, -1.0, -4.0, -1.05, -6.0, -3.0, -2.0]
  enc = [0.9, 0.1, 0.8, 0.95, 0.2, 0.7, 0.3]
  pair = extractive.select_pair('q1', 'question?', cands, loglik, enc, epsilon=0.1, num_negatives=3)
  assert pair.positive == 'b'
  # 'd' is within epsilon of the positive: not a negative; the rest ordered by encoder score.
  assert pair.negatives == ('a', 'c', 'f')


def test_select_pair_drops_are_counted():
  report = FilterReport('pairs')
  assert extractive.select_pair('q', 'x', ['a', 'b'], [-1.0, -1.0], [0, 0], report=report) is None
  assert extractive.select_pair('q2', 'x', [], [], [], report=report) is None
  em_pair = extractive.select_pair('q3', 'x', ['a', 'b', 'c'], [-3.0, -1.0, -2.0], [0.1, 0.2, 0.3],
                                   signal='em', em=[1.0, 0.0, 0.0], report=report)
  assert em_pair is None  # the only correct sentence is also the least likely: no negative
  assert report.dropped['no_negative'] == 2 and report.dropped['no_candidates'] == 1
  none_correct = extractive.select_pair('q4', 'x', ['a', 'b'], [-1.0, -2.0], [0, 0], signal='em',
                                        em=[0.0, 0.0], report=report)
  assert none_correct is None and report.dropped['no_correct_candidate'] == 1


def test_select_pair_em_signal_uses_correct_sentences_only():
  pair = extractive.select_pair('q', 'x', ['a', 'b', 'c', 'd'], [-3.0, -0.5, -2.0, -4.0],
                                [0.4, 0.3, 0.2, 0.1], signal='em', em=[1.0, 0.0, 1.0, 0.0])
  # 'c' is the most likely correct sentence; 'b' is more likely but wrong -> not a positive,
  # and not a negative either (its log-likelihood is above the positive's).
  assert pair.positive == 'c' and pair.negatives == ('d',)


def test_pair_arrays_shapes_and_masks():
  from transformers import AutoTokenizer
  from recomp_jax.pretrained.demo import resolve_demo_model
  tok = AutoTokenizer.from_pretrained(resolve_demo_model('', 'encoder'))
  pairs = [extractive.TrainingPair('1', 'who', 'T: pos one', ('T: neg', 'T: neg2')),
           extractive.TrainingPair('2', 'what', 'T: pos two', ('T: neg',))]
  a = extractive.pair_arrays(pairs, tok, num_negatives=3, max_query_length=8, max_passage_length=12)
  # Padded to the longest text (not to the limits 8 / 12): '[CLS] what [SEP]' is 3 tokens.
  assert a['query_ids'].shape == (2, 3) and a['passage_ids'].shape[:2] == (2, 4)
  assert a['passage_ids'].shape[2] == a['passage_mask'].sum(-1).max() <= 12
  np.testing.assert_array_equal(a['passage_valid'], [[1, 1, 1, 0], [1, 1, 0, 0]])
  assert a['passage_key'][0, 1] == a['passage_key'][1, 1]  # same text -> same id


# ----------------------------------------------------------------------------- stages


def test_resumable_jsonl_drops_a_half_written_record(tmp_path):
  path = str(tmp_path / 'x.jsonl')
  out = ResumableJsonl(path)
  out.append({'id': 'a', 'v': 1})
  out.append({'id': 'b', 'v': 2})
  out.close()
  with open(path, 'a') as f:
    f.write('{"id": "c", "v"')  # killed mid-write
  again = ResumableJsonl(path)
  assert sorted(again.records) == ['a', 'b']
  again.append({'id': 'c', 'v': 3})
  again.close()
  with open(path) as f:
    assert [json.loads(line)['id'] for line in f] == ['a', 'b', 'c']


def test_map_resumable_computes_each_example_once_across_a_kill(tmp_path):
  """A chunk that raises (a kill) keeps the chunks before it; the rerun computes only the rest."""
  from types import SimpleNamespace
  examples = [SimpleNamespace(id=f'q{i}', v=i) for i in range(7)]
  path = str(tmp_path / 'work.jsonl')
  seen = []

  def square(part, fail_at=None):
    seen.append([e.id for e in part])
    if fail_at is not None and any(e.v == fail_at for e in part):
      raise KeyboardInterrupt
    return [{'square': e.v * e.v} for e in part]

  with pytest.raises(KeyboardInterrupt):
    map_resumable(path, examples, lambda part: square(part, fail_at=5), chunk=3, desc='square')
  assert sorted(read_records(path)) == ['q0', 'q1', 'q2']
  seen.clear()
  records = map_resumable(path, examples[::-1], square, chunk=3, desc='square')
  assert seen == [['q6', 'q5', 'q4'], ['q3']]  # the finished chunk is not recomputed
  assert list(records) == [e.id for e in examples[::-1]]  # the caller's order, resumed ones included
  assert all(records[f'q{i}'] == {'id': f'q{i}', 'square': i * i} for i in range(7))
  with pytest.raises(ValueError, match='2 records for a chunk of 3'):
    map_resumable(str(tmp_path / 'bad.jsonl'), examples, lambda part: [{}, {}], chunk=3, desc='bad')


def test_stage_runner_skips_finished_and_reruns_changed_or_forced(tmp_path):
  calls = []

  def fn(d):
    calls.append(d)
    return {'n': len(calls)}

  runner = StageRunner(str(tmp_path))
  assert runner.run('s', {'x': 1}, fn) == {'n': 1}
  assert runner.run('s', {'x': 1}, fn) == {'n': 1} and len(calls) == 1
  assert runner.run('s', {'x': 2}, fn) == {'n': 2}
  assert StageRunner(str(tmp_path), force=('s',)).run('s', {'x': 2}, fn) == {'n': 3}


def test_stage_costs_count_the_killed_attempts_a_stage_continued(tmp_path):
  """A killed attempt is counted from its start to the last file it wrote; an attempt at
  another fingerprint starts the count afresh."""
  def killed(d):
    with open(os.path.join(d, 'part.jsonl'), 'w') as f:
      f.write('{}\n')
    raise KeyboardInterrupt

  def finish(d):
    return {'parts': len(os.listdir(d))}

  def backdate_start(stage, seconds):  # as if the killed attempt had started `seconds` before its last write
    path = tmp_path / 'stages' / stage / 'STARTED.json'
    started = json.loads(path.read_text())
    started['started_at'] = os.path.getmtime(tmp_path / 'stages' / stage / 'part.jsonl') - seconds
    path.write_text(json.dumps(started))

  for seconds in (100, 50):  # two killed attempts
    with pytest.raises(KeyboardInterrupt):
      StageRunner(str(tmp_path)).run('s', {'x': 1}, killed, resumable=True)
    backdate_start('s', seconds)
  runner = StageRunner(str(tmp_path))
  assert runner.run('s', {'x': 1}, finish, resumable=True) == {'parts': 2}  # the partial file and STARTED.json
  (cost,) = runner.costs()
  assert cost['this_run'] and 150 <= cost['seconds_all_attempts'] - cost['seconds'] < 151
  again = StageRunner(str(tmp_path))
  again.run('s', {'x': 1}, finish, resumable=True)
  assert again.costs() == [{**cost, 'this_run': False}]
  table = costs_table(again.costs())
  assert table['rows'][-1][:3] == ['all stages', f"{cost['seconds'] / 60:.1f}",
                                   f"{cost['seconds_all_attempts'] / 60:.1f}"]
  with pytest.raises(KeyboardInterrupt):
    StageRunner(str(tmp_path)).run('t', {'x': 1}, killed, resumable=True)
  backdate_start('t', 100)
  fresh = StageRunner(str(tmp_path))
  fresh.run('t', {'x': 2}, finish, resumable=True)  # another fingerprint: the directory and the count restart
  assert fresh.costs()[0]['seconds_all_attempts'] == fresh.costs()[0]['seconds']


# ----------------------------------------------------------------------------- tiny models


@pytest.fixture(scope='module')
def tiny_models(tmp_path_factory, gemma3_hf_dir):
  """A tiny random BERT (MiniLM tokenizer) and a tiny random Gemma 3 (Gemma tokenizer) as HF dirs."""
  from recomp_jax.pretrained.demo import resolve_demo_model

  from recomp_jax.pretrained import Pretrained, export_pretrained
  from recomp_jax.models import bert, gemma

  root = tmp_path_factory.mktemp('tiny')
  minilm = resolve_demo_model('', 'encoder')
  bcfg = bert.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)
  bmodel = bert.BertModel(bcfg, rngs=nnx.Rngs(0))
  export_pretrained(Pretrained(bmodel, bcfg, bert.FAMILY, minilm), str(root / 'bert'), tokenizer_dir=minilm)
  gcfg = gemma.GemmaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=16, sliding_window=16,
                           layer_types=('sliding_attention', 'full_attention'), query_pre_attn_scalar=16)
  gmodel = gemma.GemmaModel(gcfg, rngs=nnx.Rngs(1))
  export_pretrained(Pretrained(gmodel, gcfg, gemma.FAMILY, gemma3_hf_dir), str(root / 'gemma'),
                    tokenizer_dir=gemma3_hf_dir)
  return str(root / 'bert'), str(root / 'gemma')


def tiny_config(workdir, tiny_models, **overrides):
  from configs.nq_extractive import get_config
  config = get_config('ci')
  config.encoder.model, config.reader.model = tiny_models
  config.encoder.normalize = False
  config.train.temperature = 1.0
  config.data.demo_train, config.data.demo_dev, config.data.demo_test = 16, 4, 4
  config.train.num_steps = 4
  config.train.batch_size = 4
  config.train.eval_every = 2
  config.train.checkpoint_every = 2
  config.reader.score_batch_size = 16
  config.reader.generate_batch_size = 4
  config.reader.max_new_tokens = 4
  config.workdir = str(workdir)
  config.update_from_flattened_dict(overrides)
  return config


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch):
  monkeypatch.syspath_prepend(REPO)


def test_pipeline_end_to_end_with_tiny_models_and_rerun_is_cached(tmp_path, tiny_models):
  config = tiny_config(tmp_path / 'run', tiny_models, **{'train.compare_objective': 'listwise',
                                                          'train.seeds': (0, 1)})
  results = pipeline_runner.run(config, config.workdir)
  rows = {r['key']: r for r in results['rows']}
  expected = {'none', 'top1', 'top5', 'lead', 'random_sentence', 'bm25_sentence',
              'offtheshelf_sentence', 'bow', 'ne_capitalised', 'trained', 'trained_threshold',
              'trained_listwise', 'truncation', 'oracle_ll', 'oracle_em'}
  assert expected <= set(rows)
  assert all(rows[k]['n'] == 4 for k in expected)
  assert rows['none']['tokens'] == 0
  assert rows['top5']['tokens'] > rows['top1']['tokens'] > 0
  assert 0 < rows['trained']['tokens'] < 0.5 * rows['top5']['tokens']
  # The EM oracle is correct wherever any candidate is: never below the LL oracle or the trained row.
  assert rows['oracle_em']['em'] >= max(rows['oracle_ll']['em'], rows['trained']['em'])
  from recomp_jax.evaluation import report
  report.validate_results(json.loads(open(os.path.join(config.workdir, 'results.json')).read()))
  assert {b['b'] for b in results['bootstrap']} == set(rows) - {'trained'}
  assert results['seeds'] == [0, 1] and results['n'] == 4 and results['train_questions'] == 16
  assert len(rows['trained']['em_per_seed']) == 2 and rows['trained_listwise']['seeds'] == [0]
  assert rows['trained']['em'] == pytest.approx(np.mean(rows['trained']['em_per_seed']))
  assert set(results['objective_comparison']) == {'contrastive', 'listwise'}
  assert any('Dev winner' in n for n in results['notes']) and any('Threshold row' in n for n in results['notes'])
  assert set(results['stages']['evaluate']['thresholds']) == {'0', '1'}
  assert len(results['git_commit']) == 40 and results['data_hashes'] == {}
  with open(os.path.join(config.workdir, 'predictions.jsonl')) as f:
    predictions = [json.loads(line) for line in f]
  assert len(predictions) == 4 * len(results['stages']['evaluate']['rows']) and {'row', 'id', 'prediction', 'em', 'evidence'} <= set(predictions[0])
  assert os.path.exists(os.path.join(config.workdir, 'results.md'))
  (analysis,) = [t for t in results['extra_tables'] if t['title'].startswith('Where the evidence fails')]
  by_row = {r[0]: r for r in analysis['rows']}
  assert set(by_row) == set(results['stages']['evaluate']['rows'])
  assert by_row['top1'][4:] == [0, 0] and by_row['none'][1] == 0.0  # no wins over itself; empty evidence
  assert os.path.isdir(os.path.join(config.workdir, 'stages', 'train_contrastive_seed0', 'encoder_best'))
  # The exported encoder gives the trained row's sentences through the one inference call.
  from tests.tiny_models import check_export_reproduces_the_trained_row, check_truncation_row
  check_export_reproduces_the_trained_row(config.workdir, 'trained@0')
  # The truncation row: the top documents cut to the trained rows' mean tokens (both seeds).
  check_truncation_row(config.workdir, tiny_models[1], config.candidates.top_docs)
  train = json.load(open(os.path.join(config.workdir, 'stages', 'train_contrastive_seed0', 'DONE.json')))['summary']
  assert train['steps'] == 4 and train['pairs'] > 0
  # TensorBoard: the reader's EM / F1 on the dev probe at every evaluation, and the results table.
  from recomp_jax.training.summaries import read_scalars, read_text
  scalars = read_scalars(os.path.join(config.workdir, 'stages', 'train_contrastive_seed0', 'tensorboard'))
  for tag in ('eval/qa_em', 'eval/qa_f1', 'eval/qa_evidence_tokens', 'eval/top1_loglik'):
    assert [step for step, _ in scalars[tag]] == [2, 4], tag
  # The probe at the kept step, recomputed: the exported encoder ranks the first dev questions'
  # candidates, the run's reader answers with the top sentences.
  from recomp_jax.evaluation import qa_metrics
  stages = os.path.join(config.workdir, 'stages')
  dev = shared.read_examples(os.path.join(stages, 'retrieve', 'dev.jsonl'))[:config.train.eval_qa_examples]
  dev_cands = [shared.load_candidates(os.path.join(stages, 'candidates'), 'dev')[e.id] for e in dev]
  resources = shared.Resources(config)
  encoder = resources.fresh_encoder(os.path.join(stages, 'train_contrastive_seed0', 'encoder_best'))
  evidence = extractive.evidence_per_question(
      dev_cands, extractive.rank_candidates(encoder, [e.question for e in dev], dev_cands), config.eval.top_k_sentences)
  answers = resources.reader.answer([resources.reader.prompt(e.question, ev) for e, ev in zip(dev, evidence)])
  expected = qa_metrics.qa_scores(answers, [e.answers for e in dev])
  at_best = {tag: dict(scalars[tag])[train['best']['step']] for tag in ('eval/qa_em', 'eval/qa_f1')}
  assert at_best == {'eval/qa_em': pytest.approx(expected['em']), 'eval/qa_f1': pytest.approx(expected['f1'])}
  assert all(v > 0 for _, v in scalars['eval/qa_evidence_tokens'])
  table = read_text(os.path.join(config.workdir, 'tensorboard', 'results'))['results/table']
  assert table == [(0, open(os.path.join(config.workdir, 'results.md')).read())]
  candidates = json.load(open(os.path.join(config.workdir, 'stages', 'candidates', 'DONE.json')))['summary']
  assert candidates['train']['cap'] == 20 and candidates['test']['cap'] == 0
  # A rerun skips every stage and reproduces the table.
  again = pipeline_runner.run(config, config.workdir)
  assert all(v == 0.0 for v in again['stage_seconds'].values())
  assert again['rows'] == results['rows']
  # Both runs report what each stage cost when it was computed, from its DONE.json.
  first_costs = {c['stage']: c for c in results['stage_costs']}
  assert list(first_costs) == list(results['stage_seconds'])
  assert all(c['this_run'] and c['seconds'] == results['stage_seconds'][name] and c['peak_resident_gb'] > 0
             for name, c in first_costs.items())
  assert [(c['stage'], c['seconds'], c['peak_resident_gb'], c['this_run']) for c in again['stage_costs']] == [
      (name, c['seconds'], c['peak_resident_gb'], False) for name, c in first_costs.items()]
  (costs,) = [t for t in again['extra_tables'] if t['title'].startswith('Stage costs')]
  assert costs['rows'][-1][:2] == ['all stages', f"{sum(c['seconds'] for c in first_costs.values()) / 60:.1f}"]
  assert '| an earlier run |' in open(os.path.join(config.workdir, 'results.md')).read()


def test_a_remote_workdir_computes_in_a_mirror_and_a_fresh_machine_downloads_it(tmp_path, tiny_models):
  """``--workdir=gs://...`` (a local directory stands in for the bucket): stages run in the local
  mirror and are uploaded as they finish, training checkpoints are written straight to the
  remote workdir, the result files are uploaded at the end, and a second machine with an empty
  mirror runs no stage and reproduces the results."""
  bucket = tmp_path / 'bucket'
  config = tiny_config(bucket, tiny_models)
  first = pipeline_runner.run(config, str(bucket), local_workdir=str(tmp_path / 'vm1'))
  train = 'stages/train_contrastive_seed0'
  assert os.listdir(bucket / train / 'checkpoints') and not (tmp_path / 'vm1' / train / 'checkpoints').exists()
  for name in ('results.json', 'results.md', 'predictions.jsonl'):
    assert (bucket / name).read_bytes() == (tmp_path / 'vm1' / name).read_bytes(), name
  assert os.listdir(bucket / 'tensorboard' / 'results')
  for stage in first['stage_seconds']:
    assert (bucket / 'stages' / stage / 'DONE.json').exists(), stage
  second = pipeline_runner.run(config, str(bucket), local_workdir=str(tmp_path / 'vm2'))
  assert all(v == 0.0 for v in second['stage_seconds'].values()), second['stage_seconds']
  assert second['rows'] == first['rows']
  assert (tmp_path / 'vm2' / train / 'encoder_best' / 'config.json').exists()


def test_dataset_shots_reach_the_reader_prompt_and_survive_a_reused_data_stage(tmp_path, tiny_models):
  """data.shots='train': the run's head draws five training questions, the shared reader's prompt
  (labels, critic, probes, rows) starts with them, and a rerun that reuses the data stage gets the
  same ones from its summary."""
  config = tiny_config(tmp_path / 'shots', tiny_models, **{'data.shots': 'train'})
  runner = StageRunner(config.workdir)
  resources = shared.Resources(config, config.workdir)
  data = shared.run_head(config, runner, resources, [])['data']
  shots = data['shots']
  train_ids = {json.loads(line)['id'] for line in open(os.path.join(runner.stage_dir('data'), 'train.jsonl'))}
  assert len(shots) == 5 and data['train'] == 16 - 5 and not {s['id'] for s in shots} & train_ids
  block = ''.join(f"{s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
  assert resources.reader.few_shot == block
  assert resources.reader.prompt('who?', 'Some evidence.') == block + 'Some evidence.\n\nwho?\nAnswer:'
  again = shared.Resources(config, config.workdir)
  assert shared.run_head(config, StageRunner(config.workdir), again, [])['data']['shots'] == shots
  assert again.few_shot == block


def test_dense_retrieve_stage_fills_ctxs_and_reuses_its_index(tmp_path, tiny_models):
  config = tiny_config(tmp_path / 'dense', tiny_models, **{'retrieval.method': 'dense'})
  runner = StageRunner(config.workdir)
  models = shared.Resources(config)  # pylint: disable=protected-access
  runner.run('data', {}, lambda d: shared.stage_data(config, d))
  summary = shared.stage_retrieve(config, runner.stage_dir('data'), str(tmp_path / 'r1'), models)
  assert summary['test']['retrieved'] == summary['test']['examples'] == 4
  test = [json.loads(line) for line in open(tmp_path / 'r1' / 'test.jsonl')]
  assert all(len(e['ctxs']) == config.retrieval.top_k for e in test)
  scores = [[c['score'] for c in e['ctxs']] for e in test]
  assert all(s == sorted(s, reverse=True) for s in scores)
  (index_dir,) = os.listdir(tmp_path / 'r1' / 'index')
  # Rerun: the saved index (same corpus + encoder weights) is loaded, the ranking is unchanged.
  mtime = os.path.getmtime(tmp_path / 'r1' / 'index' / index_dir / 'embeddings.npy')
  shared.stage_retrieve(config, runner.stage_dir('data'), str(tmp_path / 'r1'), models)
  assert os.listdir(tmp_path / 'r1' / 'index') == [index_dir]
  assert os.path.getmtime(tmp_path / 'r1' / 'index' / index_dir / 'embeddings.npy') == mtime
  again = [json.loads(line) for line in open(tmp_path / 'r1' / 'test.jsonl')]
  assert [[c['id'] for c in e['ctxs']] for e in again] == [[c['id'] for c in e['ctxs']] for e in test]


_LABEL_WORKER = r'''
import sys, time
sys.path.insert(0, {repo!r})
from recomp_jax.compressors import extractive
from recomp_jax.pipelines import extractive as pipeline
from recomp_jax.pipelines import shared
from recomp_jax.stages import StageRunner
import tests.test_extractive as t
real = extractive.loglik_labels
def paced(*a, **k):
  out = real(*a, **k)
  time.sleep(0.5)
  return out
extractive.loglik_labels = paced
config = t.tiny_config({workdir!r}, ({bert!r}, {gemma!r}))
config.reader.questions_per_call = 1
runner = StageRunner(config.workdir)
models = shared.Resources(config)
cfg = config.to_dict()
for name, fn in (('data', lambda d: shared.stage_data(config, d)),
                 ('retrieve', lambda d: shared.stage_retrieve(config, runner.stage_dir('data'), d, models)),
                 ('candidates', lambda d: shared.stage_candidates(config, runner.stage_dir('retrieve'), d))):
  runner.run(name, name, fn)
pipeline.label_split(models, shared.read_examples(runner.stage_dir('retrieve') + '/train.jsonl'),
                     shared.load_candidates(runner.stage_dir('candidates'), 'train'),
                     {out!r}, signal='loglik', questions_per_call=1)
'''


def test_killed_labelling_resumes_without_losing_scores(tmp_path, tiny_models):
  workdir = str(tmp_path / 'kill')
  out = str(tmp_path / 'labels.jsonl')
  script = tmp_path / 'worker.py'
  script.write_text(_LABEL_WORKER.format(repo=REPO, workdir=workdir, bert=tiny_models[0],
                                         gemma=tiny_models[1], out=out))
  env = dict(os.environ, PYTHONPATH=REPO)
  proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=REPO,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  deadline = time.time() + 300
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(out) and sum(1 for _ in open(out)) >= 3:
      break
    time.sleep(0.05)
  assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  with open(out) as f:
    before = {json.loads(line)['id']: line for line in f if line.endswith('\n')}
  assert 3 <= len(before) < 16

  config = tiny_config(workdir, tiny_models)
  runner = StageRunner(workdir)
  models = shared.Resources(config)
  examples = shared.read_examples(os.path.join(runner.stage_dir('retrieve'), 'train.jsonl'))
  candidates = shared.load_candidates(runner.stage_dir('candidates'), 'train')
  calls = []
  real = extractive.loglik_labels

  def counting(scorer, questions, *args, **kwargs):
    calls.extend(questions)
    return real(scorer, questions, *args, **kwargs)

  extractive.loglik_labels = counting
  try:
    labels = pipeline.label_split(models, examples, candidates, out, signal='loglik', questions_per_call=4)
  finally:
    extractive.loglik_labels = real
  assert len(labels) == len(examples) == 16
  assert len(calls) == 16 - len(before)  # finished questions are not scored again
  with open(out) as f:
    after = {json.loads(line)['id']: line for line in f}
  assert all(after[k] == v for k, v in before.items())
  # Resumed scores equal a fresh, uninterrupted labelling of the same questions.
  fresh = extractive.loglik_labels(models.reader, [e.question for e in examples[:4]],
                                   [candidates[e.id] for e in examples[:4]],
                                   [e.answers for e in examples[:4]])
  for e, record in zip(examples[:4], fresh):
    np.testing.assert_allclose(labels[e.id]['loglik'], record['loglik'], rtol=1e-5, atol=1e-4)


def test_bad_jsonl_line_names_file_line_and_field(tmp_path, tiny_models):
  bad = tmp_path / 'train.jsonl'
  bad.write_text('{"question": "q1", "answers": ["a"], "ctxs": []}\n'
                 '{"question": "q2", "answers": "not a list", "ctxs": []}\n')
  config = tiny_config(tmp_path / 'bad', tiny_models, **{'data.source': 'jsonl'})
  config.data.train_path = str(bad)
  config.data.eval_path = str(bad)
  config.data.flavour = 'dpr'
  with pytest.raises(Exception) as err:
    pipeline_runner.run(config, config.workdir)
  message = str(err.value)
  assert str(bad) in message and ':2' in message and 'answers' in message


# ----------------------------------------------------------------------------- real models


# The ci preset at a reduced size with MiniLM and the real Gemma 3 270M. The quickstart notebook
# runs it end to end (tests/test_notebooks.py passes these flags) and then calls
# check_real_model_ci_run on its workdir: the pipeline runs once, for both tests.
REAL_MODEL_CI_FLAGS = {'data.demo_train': 8, 'data.demo_dev': 4, 'data.demo_test': 8, 'train.num_steps': 2,
                       'train.batch_size': 8,
                       'eval.rows': ('none', 'top1', 'top5', 'offtheshelf_sentence', 'trained', 'oracle_ll',
                                     'oracle_em')}


def real_model_ci_flags() -> list[str]:
  """:data:`REAL_MODEL_CI_FLAGS` as ``recomp_jax.main`` flags."""
  return [f'--config.{k}={v!r}' if isinstance(v, tuple) else f'--config.{k}={v}'
          for k, v in REAL_MODEL_CI_FLAGS.items()]


def check_real_model_ci_run(workdir) -> None:
  """What ``configs/nq_extractive.py:ci`` with :data:`REAL_MODEL_CI_FLAGS` must have computed in ``workdir``."""
  from configs.nq_extractive import get_config
  config = get_config('ci')
  config.workdir = str(workdir)
  config.update_from_flattened_dict(REAL_MODEL_CI_FLAGS)
  from recomp_jax.evaluation import report
  results = json.load(open(os.path.join(config.workdir, 'results.json')))
  report.validate_results(results)
  assert results['config']['train']['num_steps'] == 2 and results['n'] == 8  # the flags reached the run
  rows = {r['key']: r for r in results['rows']}
  assert set(rows) == set(REAL_MODEL_CI_FLAGS['eval.rows'])
  # The real reader answers these questions better with the best sentence than with nothing.
  assert rows['oracle_ll']['em'] > rows['none']['em']
  assert rows['oracle_em']['em'] >= rows['oracle_ll']['em']
  assert rows['trained']['tokens'] < 0.2 * rows['top5']['tokens']
  # The exported encoder gives the trained row's sentences through the one inference call.
  from tests.tiny_models import check_export_reproduces_the_trained_row
  check_export_reproduces_the_trained_row(config.workdir, 'trained@0')
  # The TensorBoard probe at the best step is the real reader's EM / F1 on the first dev
  # questions with the exported best encoder's top sentence (recomputed here).
  from recomp_jax.reader.prompts import build_prompt
  from recomp_jax.training.summaries import read_scalars
  train_dir = os.path.join(config.workdir, 'stages', 'train_contrastive_seed0')
  best = json.load(open(os.path.join(train_dir, 'best.json')))
  scalars = {tag: dict(v) for tag, v in read_scalars(os.path.join(train_dir, 'tensorboard')).items()}
  models = shared.Resources(config)
  dev = shared.read_examples(os.path.join(config.workdir, 'stages', 'retrieve', 'dev.jsonl'))[:4]
  dev_candidates = shared.load_candidates(os.path.join(config.workdir, 'stages', 'candidates'), 'dev')
  evidence = extractive.compress(models.encoder(os.path.join(train_dir, 'encoder_best')),
                                 [e.question for e in dev], [dev_candidates[e.id] for e in dev])
  expected = models.reader.exact_match([build_prompt(e.question, ev) for e, ev in zip(dev, evidence)],
                                       [e.answers for e in dev])
  assert scalars['eval/qa_em'][best['step']] == pytest.approx(expected['em'], abs=1e-4)
  assert scalars['eval/qa_f1'][best['step']] == pytest.approx(expected['f1'], abs=1e-4)


# ----------------------------------------------------------------------------- changed and damaged inputs


def _jsonl_config(tmp_path, tiny_models, eval_lines: int):
  """A no-training run over a small DPR file (rows none + top-1) with the tiny reader."""
  from recomp_jax.data.schema import Example, Passage
  from recomp_jax.data import formats
  data = tmp_path / 'eval.jsonl'
  examples = [Example(f'e{i}', f'question {i}', [f'answer {i}'],
                      ctxs=[Passage(f'p{i}', f'Title {i}', f'Answer {i} is here. More text.')])
              for i in range(eval_lines)]
  formats.write_examples(str(data), examples)
  config = tiny_config(tmp_path / 'run', tiny_models, **{'data.source': 'jsonl'})
  config.data.train_path = str(data)
  config.data.eval_path = str(data)
  config.data.flavour = 'dpr'
  config.train.epochs = 0.0
  config.train.num_steps = 0
  config.eval.rows = ('none', 'top1', 'lead')
  config.eval.oracle = False
  return config, data


def test_changed_input_file_reruns_its_stages(tmp_path, tiny_models):
  config, data = _jsonl_config(tmp_path, tiny_models, 3)
  first = pipeline_runner.run(config, config.workdir)
  assert first['n'] == 3 and list(first['data_hashes']) == [str(data)]
  _, data = _jsonl_config(tmp_path, tiny_models, 5)  # the same path, refilled with more questions
  second = pipeline_runner.run(config, config.workdir)
  assert second['n'] == 5 and all(r['n'] == 5 for r in second['rows'])
  assert second['data_hashes'][str(data)] != first['data_hashes'][str(data)]
  assert second['stage_seconds']['data'] > 0 and second['stage_seconds']['evaluate'] > 0


def test_empty_eval_set_stops_at_the_data_stage(tmp_path, tiny_models):
  config, data = _jsonl_config(tmp_path, tiny_models, 2)
  data.write_text('')
  with pytest.raises(shared.PipelineError, match='evaluation split is empty'):
    pipeline_runner.run(config, config.workdir)
  assert not os.path.exists(os.path.join(config.workdir, 'stages', 'retrieve'))


def test_damaged_stage_output_is_detected_and_recomputed(tmp_path, tiny_models, caplog):
  config, _ = _jsonl_config(tmp_path, tiny_models, 4)
  first = pipeline_runner.run(config, config.workdir)
  rows_file = os.path.join(config.workdir, 'stages', 'evaluate', 'rows.jsonl')
  size = os.path.getsize(rows_file)
  with open(rows_file, 'r+b') as f:
    f.truncate(size - 300)  # the last row record is cut
  candidates_file = os.path.join(config.workdir, 'stages', 'candidates', 'test.jsonl')
  with open(candidates_file, 'w') as f:
    f.write('')  # a stage file emptied behind our back
  with caplog.at_level('WARNING'):
    second = pipeline_runner.run(config, config.workdir)
  warnings = ' '.join(r.getMessage() for r in caplog.records if r.levelname == 'WARNING')
  assert 'rows.jsonl' in warnings and 'candidates/test.jsonl' in warnings
  assert second['rows'] == first['rows']
  assert second['stage_seconds']['candidates'] > 0
  # The intact rows of the resumable evaluate stage were kept: only the cut one was re-read.
  assert sum(1 for _ in open(rows_file)) == 3


def test_stage_runner_chains_dependency_fingerprints(tmp_path):
  runner = StageRunner(str(tmp_path))
  calls = []
  runner.run('a', {'x': 1}, lambda d: calls.append('a') or {})
  runner.run('b', {'y': 1}, lambda d: calls.append('b') or {}, deps=('a',))
  again = StageRunner(str(tmp_path))
  again.run('a', {'x': 2}, lambda d: calls.append('a') or {})  # a's input changed ...
  again.run('b', {'y': 1}, lambda d: calls.append('b') or {}, deps=('a',))  # ... so b reruns
  assert calls == ['a', 'b', 'a', 'b']
  with pytest.raises(RuntimeError, match='dependencies'):
    StageRunner(str(tmp_path)).run('c', {}, lambda d: {}, deps=('a',))


def test_stage_fingerprint_follows_the_code_it_runs(tmp_path, monkeypatch):
  from recomp_jax import stages
  runner = StageRunner(str(tmp_path))
  calls = []
  runner.run('s', {}, lambda d: calls.append(1) or {}, code=('recomp_jax.reader.prompts',))
  runner.run('s', {}, lambda d: calls.append(1) or {}, code=('recomp_jax.reader.prompts',))
  assert len(calls) == 1
  real = stages.module_code_hash
  monkeypatch.setattr(stages, 'module_code_hash',
                      lambda name: 'edited' if name == 'recomp_jax.reader.prompts' else real(name))
  runner.run('s', {}, lambda d: calls.append(1) or {}, code=('recomp_jax.reader.prompts',))
  assert len(calls) == 2


def test_code_digest_ignores_documentation_and_layout_only():
  from recomp_jax.stages import code_digest
  source = ('"""Module doc."""\n\nX = 1\n\n\nclass A:\n  """Class doc."""\n\n  def f(self, y):\n'
            '    """Method doc."""\n    return y + X  # comment\n\n\ndef g():\n  return "not a docstring" + f"{X}"\n')
  documented = ('"""Another module doc,\nover two lines."""\n# a comment\nX = 1\nclass A:\n'
                '  """Other class doc."""\n  def f(self, y):\n    return (y +\n            X)\n'
                'def g():\n  """A docstring added."""\n  return "not a docstring" + f"{X}"\n')
  assert code_digest(documented) == code_digest(source)
  for changed in (source.replace('y + X', 'y - X'), source.replace('"not a docstring"', '"other"'),
                  source.replace('X = 1', 'X = 2'), source.replace('def g():', 'def h():')):
    assert code_digest(changed) != code_digest(source)
  # a string that is not the first statement is code, not documentation
  assert code_digest('X = 1\n"kept"\n') != code_digest('X = 1\n')
