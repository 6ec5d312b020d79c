"""FILCO end to end at the ci size: silver contexts, the filter model, the PSG model and three
generators (one step each), the rows and Table 3's columns.

The five fine-tuned models are a tiny random Gemma 3 with the real Gemma tokenizer: the stages,
files and rows are the same as with the 270M, at a tenth of the time (fine-tuning the real 270M is
tested by the abstractive pipeline's end-to-end test and tests/test_recipes.py). The reader (the
no-retrieval, top-k and filtered-reader rows, CXMI) is the real Gemma 3 270M."""

import json
import re
import os

import numpy as np
import pytest

from recomp_jax.data.stage_records import read_examples as shared_records
from recomp_jax.evaluation import qa_metrics, report
from recomp_jax.pipelines import runner as pipeline_runner
from recomp_jax.training.summaries import read_scalars
from tests import config_files
from tests.tiny_models import check_export_reproduces_the_trained_row, check_truncation_row

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch):
  monkeypatch.syspath_prepend(REPO)


def _config(workdir, **overrides):
  from configs.nq_filco import get_config
  config = get_config('ci')
  config.workdir = str(workdir)
  config.update_from_flattened_dict(overrides)
  return config


def _jsonl(path):
  with open(path, encoding='utf-8') as f:
    return [json.loads(line) for line in f]


@pytest.mark.end_to_end
def test_ci_pipeline_end_to_end(tmp_path, tiny_gemma_dir):
  workdir = tmp_path / 'run'
  tiny = {'filter.model': tiny_gemma_dir, 'generator.model': tiny_gemma_dir, 'reader.model': tiny_gemma_dir}
  config = _config(workdir, **tiny)
  results = pipeline_runner.run(config, config.workdir)
  report.validate_results(json.loads(open(workdir / 'results.json').read()))
  rows = {r['key']: r for r in results['rows']}
  assert set(rows) == {'none', 'top1', 'top5', 'full', 'psg', 'trained', 'ranked', 'truncation', 'silver',
                       'filtered_reader'}
  assert all(r['n'] == 6 for r in rows.values()) and rows['none']['tokens'] == 0
  # Both FILCO rows against every other row, the pair of them once.
  expected_pairs = ([('trained', k) for k in rows if k != 'trained']
                    + [('ranked', k) for k in rows if k not in ('trained', 'ranked')])
  assert sorted((b['a'], b['b']) for b in results['bootstrap']) == sorted(expected_pairs)

  # Silver contexts (STRINC, paper): the first sentence of the top passage holding an answer.
  stages = workdir / 'stages'
  for split, n in (('train', 12), ('dev', 4), ('test', 6)):
    silver = _jsonl(stages / 'silver' / f'{split}.jsonl')
    answers = {r['id']: r['answers'] for r in _jsonl(stages / 'retrieve' / f'{split}.jsonl')}
    assert len(silver) == n == results['silver'][split]['n']
    assert results['silver'][split]['empty_silver'] == sum(not r['silver'] for r in silver)
    for r in silver:
      for row, scores in zip(r['sentences'], r['scores']):
        for sentence, score in zip(row, scores):
          assert score == float(qa_metrics.has_answer(sentence, answers[r['id']]))
      first = next((s for row, sc in zip(r['sentences'], r['scores']) for s, x in zip(row, sc) if x == 1.0), '')
      assert r['silver'] == first
      assert r['psg_keep'] == [any(score == 1.0 for score in row) for row in r['scores']]
  for name in ('filter_seed0', 'psg_seed0', 'generator_full_seed0', 'generator_psg_seed0', 'generator_filco_seed0'):
    assert results['stages'][name]['steps'] == 1, name
    assert os.path.exists(stages / name / 'model_best' / 'config.json'), name
    # The exported model stays; the finished stage's Orbax checkpoints (~3 GB at 270M) go.
    assert not os.path.exists(stages / name / 'checkpoints'), name
    assert results['stages'][name]['checkpoints_removed_bytes'] > 0, name
    # TensorBoard: reader EM / F1 on the dev probe (filter: the run's reader on its context;
    # generators: their own answers); the PSG model's yes/no has no probe of its own.
    scalars = read_scalars(stages / name / 'tensorboard')
    if name == 'psg_seed0':
      assert 'eval/qa_em' not in scalars and 'eval/loss' in scalars
    else:
      assert [step for step, _ in scalars['eval/qa_em']] == [1], name
    if name.startswith('generator_'):
      # A generator's probe (its only evaluation, so the exported model): its own answers on the first
      # dev questions from its training context, recomputed here with the exported model.
      from recomp_jax.compressors import filco as method
      from recomp_jax.evaluation.probe import probe_examples
      from recomp_jax.pipelines import filco as filco_pipeline
      from recomp_jax.reader import Reader
      kind = name.split('_')[1]
      dev = probe_examples(shared_records(stages / 'retrieve' / 'dev.jsonl'), config.train.eval_qa_examples)
      silver = {r['id']: r for r in _jsonl(stages / 'silver' / 'dev.jsonl')}
      contexts = [filco_pipeline.generator_context(kind, e, silver[e.id], config.candidates.top_docs,
                                                   config.filco.variant) for e in dev]
      generator = Reader(str(stages / name / 'model_best'), max_new_tokens=config.reader.max_new_tokens)
      answers = generator.answer([method.generator_prompt(e.question, c) for e, c in zip(dev, contexts)])
      expected = qa_metrics.qa_scores(answers, [e.answers for e in dev])
      assert (scalars['eval/qa_em'][0][1], scalars['eval/qa_f1'][0][1]) == (pytest.approx(expected['em']),
                                                                            pytest.approx(expected['f1'])), name

  # FILCO reads the filter model's own predictions (not the silver context); SILVER reads the silver context.
  predicted = {r['id']: r['context'] for r in _jsonl(stages / 'evaluate' / 'filter_seed0.jsonl')}
  test_silver = {r['id']: r['silver'] for r in _jsonl(stages / 'silver' / 'test.jsonl')}
  by_row = {}
  for p in _jsonl(workdir / 'predictions.jsonl'):
    by_row.setdefault(p['row'], {})[p['id']] = p
  assert {i: p['evidence'] for i, p in by_row['trained@0'].items()} == predicted
  assert {i: p['evidence'] for i, p in by_row['filtered_reader@0'].items()} == predicted
  assert {i: p['evidence'] for i, p in by_row['silver@0'].items()} == test_silver
  # The exported filter model writes those contexts through the one inference call.
  check_export_reproduces_the_trained_row(workdir, 'trained@0')
  check_truncation_row(workdir, tiny_gemma_dir, config.candidates.top_docs)  # cut to FILCO's mean tokens
  # FILCO ranked reads the filter model's most likely sentence of the top passage (by default
  # the empty context does not compete); the scores of every candidate are kept.
  test_sentences = {r['id']: r['sentences'] for r in _jsonl(stages / 'silver' / 'test.jsonl')}
  ranked = {r['id']: r for r in _jsonl(stages / 'evaluate' / 'filter_ranked_seed0.jsonl')}
  assert set(ranked) == set(by_row['ranked@0'])
  for i, r in ranked.items():
    flat = [s for row in test_sentences[i] for s in row]
    assert len(r['loglik']) == 1 + len(flat)
    expected = flat[int(np.argmax(r['loglik'][1:]))] if flat else ''
    assert by_row['ranked@0'][i]['evidence'] == expected
  # PSG (dev_threshold): the log-odds of " yes" over " no" per passage, kept at or above the
  # threshold with the best F1 against the dev split's silver labels.
  from recomp_jax.compressors.filco import keep_threshold
  from recomp_jax.reader import Reader
  margins = {r['id']: r['margin'] for r in _jsonl(stages / 'evaluate' / 'psg_seed0.jsonl')}
  dev_margins = {r['id']: r['margin'] for r in _jsonl(stages / 'evaluate' / 'psg_dev_seed0.jsonl')}
  dev_silver = {r['id']: r['psg_keep'] for r in _jsonl(stages / 'silver' / 'dev.jsonl')}
  assert set(dev_margins) == set(dev_silver)
  chosen = json.loads((stages / 'evaluate' / 'psg_threshold_seed0.json').read_text())
  flat = [(m, y) for i in dev_margins for m, y in zip(dev_margins[i], dev_silver[i])]
  assert keep_threshold(*zip(*flat)) == (chosen['threshold'], chosen['dev_f1'])
  assert chosen['dev_passages'] == len(flat) and chosen['dev_positive'] == sum(y for _, y in flat)
  keep = {i: [x >= chosen['threshold'] for x in m] for i, m in margins.items()}
  from recomp_jax.pipelines.filco import load_psg_keep
  assert load_psg_keep(str(stages / 'evaluate'), 0) == (keep, chosen)
  # The margins are whole-answer log-likelihood differences under the PSG model.
  psg_reader = Reader(str(stages / 'psg_seed0' / 'model_best'))
  retrieved = {r['id']: r for r in _jsonl(stages / 'retrieve' / 'test.jsonl')}
  first = next(iter(margins))
  from recomp_jax.compressors import filco
  from recomp_jax.data.schema import Passage
  top = retrieved[first]['ctxs'][0]
  prompt = filco.passage_prompt(retrieved[first]['question'],
                                Passage(id=str(top['id']), title=top['title'], text=top['text']))
  yes, no = psg_reader.output_loglik([prompt, prompt], [filco.KEEP_WORD, filco.DROP_WORD])
  assert margins[first][0] == pytest.approx(float(yes - no), abs=1e-3)
  (decisions,) = [t for t in results['extra_tables'] if t['title'].startswith('PSG passage decisions')]
  ((row_id, decision, threshold, dev_f1, n, *_),) = decisions['rows']
  assert (row_id, decision, n) == ('psg@0', 'dev_threshold', 6) and float(threshold) == pytest.approx(
      chosen['threshold'], abs=1e-3)
  for i, p in by_row['psg@0'].items():
    ctxs = retrieved[i]['ctxs'][:1]
    expected = '\n'.join(f"{c['title']}\n{c['text']}" for c, k in zip(ctxs, keep[i]) if k)
    assert p['evidence'] == expected
  for i, p in by_row['full@0'].items():
    top = retrieved[i]['ctxs'][0]
    assert p['evidence'] == f"{top['title']}\n{top['text']}"

  # Every fine-tune's dev evaluations (one step each here) are in the file, the kept one marked.
  (evaluations,) = [t for t in results['extra_tables'] if t['title'].startswith('Fine-tuning dev evaluations')]
  assert sorted(r[0] for r in evaluations['rows']) == sorted(
      ('filter_seed0', 'psg_seed0', 'generator_full_seed0', 'generator_psg_seed0', 'generator_filco_seed0'))
  for r in evaluations['rows']:
    assert r[1] == 1 and r[-1] == 'kept'
    assert float(r[2]) == pytest.approx(results['stages'][r[0]]['best']['metrics']['loss'], abs=1e-4)
    assert (r[4] == '-') == (r[0] == 'psg_seed0')
  (table,) = [t for t in results['extra_tables'] if t['title'].startswith('FILCO contexts')]
  cells = {r[0]: r for r in table['rows']}
  assert cells['none'][1] == '100.0' and cells['silver@0'][2] != '-'
  assert any('Silver contexts: measure strinc' in n for n in results['notes'])
  again = pipeline_runner.run(config, config.workdir)
  assert all(v == 0.0 for v in again['stage_seconds'].values()) and again['rows'] == results['rows']

  # CXMI silver contexts with the run's reader: the silver stage reruns, scores are log ratios.
  # FULL depends on no measure: its generator is reused, its row unchanged.
  cxmi = _config(workdir, **tiny, **{'filco.measure': 'cxmi', 'eval.rows': ('none', 'full', 'silver')})
  cxmi_results = pipeline_runner.run(cxmi, cxmi.workdir)
  assert cxmi_results['stage_seconds']['silver'] > 0
  assert cxmi_results['stage_seconds']['generator_full_seed0'] == 0.0
  assert cxmi_results['stage_seconds']['generator_filco_seed0'] > 0
  assert [r for r in cxmi_results['rows'] if r['key'] == 'full'] == [rows['full']]
  for r in _jsonl(stages / 'silver' / 'train.jsonl'):
    flat = [x for row in r['scores'] for x in row]
    best = max(flat, default=0.0)
    assert (r['silver'] != '') == (best > 0.0)
  assert {r['key'] for r in cxmi_results['rows']} == {'none', 'full', 'silver'}


def test_keep_threshold_maximises_keep_f1_and_prefers_fewer_kept():
  from recomp_jax.compressors.filco import keep_threshold
  # t=2: F1 2/3; t=1 keeps three (two tied at 1.0), two of them positive: F1 4/5; t=-0.5: 4/6.
  assert keep_threshold([2.0, 1.0, 1.0, -0.5, -3.0], [True, False, True, False, False]) == (1.0, 0.8)
  # t=3 and t=0 both give F1 2/3: the higher threshold keeps fewer passages.
  assert keep_threshold([3.0, 2.0, 1.0, 0.0], [True, False, False, True]) == (3.0, pytest.approx(2 / 3))
  # A classifier that says " no" to everything still ranks: the threshold follows it below 0.
  assert keep_threshold([-1.0, -2.0, -5.0, -6.0], [True, True, False, False]) == (-2.0, 1.0)
  assert keep_threshold([0.3, -0.2], [False, False]) == (0.0, None)
  with pytest.raises(ValueError, match='3 margins for 2 labels'):
    keep_threshold([1.0, 2.0, 3.0], [True, False])


def test_load_psg_keep_reads_either_decision(tmp_path):
  from recomp_jax.pipelines.filco import load_psg_keep
  assert load_psg_keep(str(tmp_path), 0) == ({}, None)
  # dev_threshold: margins at or above the stored threshold are kept.
  (tmp_path / 'psg_seed0.jsonl').write_text(
      json.dumps({'id': 'a', 'margin': [-2.5, -2.0, 0.1]}) + '\n' + json.dumps({'id': 'b', 'margin': [-3.0]}) + '\n')
  (tmp_path / 'psg_threshold_seed0.json').write_text(json.dumps({'threshold': -2.0, 'dev_f1': 0.5}))
  assert load_psg_keep(str(tmp_path), 0) == ({'a': [False, True, True], 'b': [False]},
                                             {'threshold': -2.0, 'dev_f1': 0.5})
  # generate: the stored greedy answers, no threshold.
  (tmp_path / 'psg_seed1.jsonl').write_text(json.dumps({'id': 'a', 'keep': [True, False]}) + '\n')
  assert load_psg_keep(str(tmp_path), 1) == ({'a': [True, False]}, None)


def test_stage_readers_name_the_file_and_line_of_a_damaged_record(tmp_path):
  """A stage file cut mid-line (a disk filled, a copy stopped) is a DataError naming file and
  line, not a bare JSONDecodeError from deep inside a later stage."""
  from recomp_jax.data.schema import DataError
  from recomp_jax.pipelines.filco import load_psg_keep, load_silver
  (tmp_path / 'psg_seed0.jsonl').write_text(json.dumps({'id': 'a', 'keep': [True]}) + '\n{"id": "b", "ke\n')
  with pytest.raises(DataError, match=r'psg_seed0\.jsonl:2'):
    load_psg_keep(str(tmp_path), 0)
  (tmp_path / 'test.jsonl').write_text('\n'.join([json.dumps({'id': 'a', 'silver': ''}), '', '[1,']) + '\n')
  with pytest.raises(DataError, match=r'test\.jsonl:3'):
    load_silver(str(tmp_path), 'test')
  (tmp_path / 'dev.jsonl').write_text(json.dumps({'id': 'a', 'silver': 'x'}) + '\n\n')
  assert load_silver(str(tmp_path), 'dev') == {'a': {'id': 'a', 'silver': 'x'}}
  # the dev-threshold decision: margins per passage and the chosen threshold beside them
  (tmp_path / 'psg_seed1.jsonl').write_text(json.dumps({'id': 'a', 'margin': [-1.0, 0.5]}) + '\n')
  (tmp_path / 'psg_threshold_seed1.json').write_text('{"threshold": 0.0,\n "dev_f1": ')
  with pytest.raises(DataError, match=r'psg_threshold_seed1\.json:2: invalid JSON'):
    load_psg_keep(str(tmp_path), 1)
  (tmp_path / 'psg_threshold_seed1.json').write_text('{"threshold": 0.0}')
  assert load_psg_keep(str(tmp_path), 1) == ({'a': [False, True]}, {'threshold': 0.0})


def test_bad_config_is_refused_before_any_work(tmp_path):
  """Checked against FILCO's typed section (recomp_jax.config_fields) before any stage runs."""
  from recomp_jax.config_fields import ConfigError
  for field, value, message in (('filco.measure', 'bleu', "config.filco.measure='bleu' is not allowed"),
                                ('filco.variant', 'github', "config.filco.variant='github' is not allowed"),
                                ('filco.psg_decision', 'argmax', "config.filco.psg_decision='argmax' is not allowed"),
                                ('filco.ranked_sentences', 0, 'config.filco.ranked_sentences must be at least 1'),
                                ('data.train_subset', 'random', "config.data.train_subset='random' is not allowed")):
    with pytest.raises(ConfigError, match=re.escape(message)):
      pipeline_runner.run(_config(tmp_path, **{field: value}), str(tmp_path))
  assert not os.path.exists(tmp_path / 'stages')


def test_filter_epochs_do_not_reach_the_psg_classifier_or_its_fingerprint():
  """`filter.epochs` trains the filter model only; the PSG classifier, which shares
  config.filter's other fields, trains `filco.psg_epochs` (default: train.epochs)."""
  from recomp_jax.pipelines.filco import training_section
  from recomp_jax.training.finetune import section_epochs
  config = config_files.preset('nq_filco.py', 'shared')
  assert config.filter.epochs == 3.0 and config.train.epochs == 1.0
  assert section_epochs(config, training_section(config, 'filter')) == 3.0
  assert section_epochs(config, training_section(config, 'psg')) == 1.0
  assert section_epochs(config, training_section(config, 'generator_full')) == 1.0
  config.filco.psg_epochs = 2.0
  psg = training_section(config, 'psg')
  assert section_epochs(config, psg) == 2.0 and config.filter.epochs == 3.0
  assert psg.max_source_length == config.filter.max_source_length


def test_evaluations_table_lists_every_evaluation_and_marks_the_kept_step():
  summaries = {
      'data': {},
      'filter_seed0': {'best': {'step': 25}, 'evaluations': [
          {'step': 25, 'metrics': {'loss': 0.0857, 'accuracy': 0.98, 'qa_em': 6.25, 'qa_f1': 10.9}},
          {'step': 50, 'metrics': {'loss': 0.0877, 'accuracy': 0.9815, 'qa_em': 9.375, 'qa_f1': 13.2}}]},
      'psg_seed0': {'best': {'step': 22}, 'evaluations': [{'step': 22, 'metrics': {'loss': 0.3032}}]},
      'evaluate': {'rows': {}},
  }
  (table,) = pipeline_runner.evaluations_table(summaries)
  assert table['rows'] == [['filter_seed0', 25, '0.0857', '0.9800', '6.2', '10.9', 'kept'],
                           ['filter_seed0', 50, '0.0877', '0.9815', '9.4', '13.2', ''],
                           ['psg_seed0', 22, '0.3032', '-', '-', '-', 'kept']]
  assert pipeline_runner.evaluations_table({'data': {}, 'train_seed0': {'steps': 3}}) == []
