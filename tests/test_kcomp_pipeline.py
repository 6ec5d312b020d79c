"""K-COMP end to end on MedQuAD (``configs/medquad_kcomp.py:ci``): leave-own-answer-out retrieval,
Table 1's entity filter, reader-sentence targets, FT and K-COMP fine-tuned (a tiny random Gemma
with the real tokenizer), the long-form rows scored by BERTScore and ROUGE-L with the real Gemma 3
270M reader, the export, and a resumed run that recomputes nothing."""

import json
import os

import numpy as np
import pytest

from recomp_jax import load_compressor
from recomp_jax.compressors import kcomp
from recomp_jax.data.stage_records import read_examples
from recomp_jax.evaluation import report
from recomp_jax.evaluation.bertscore import BertScore
from recomp_jax.pipelines import kcomp as pipeline
from recomp_jax.pipelines import runner
from recomp_jax.pretrained import load_pretrained

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEDQUAD = os.path.join(os.path.dirname(REPO), 'shared', 'data', 'medquad')


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch):
  monkeypatch.syspath_prepend(REPO)
  monkeypatch.chdir(REPO)  # the presets name ../shared/data


@pytest.mark.end_to_end
@pytest.mark.parametrize('reader', ['shallow_gemma', pytest.param('gemma3_270m', marks=pytest.mark.slow)])
def test_ci_pipeline_end_to_end_and_resume(tmp_path, tiny_gemma_dir, reader, request):
  if not os.path.isdir(MEDQUAD):
    pytest.skip(f'{MEDQUAD} is absent (the shared data folder)')
  from configs.medquad_kcomp import get_config
  config = get_config('ci')
  config.workdir = str(tmp_path / 'run')
  config.compressor.model = tiny_gemma_dir
  if reader == 'shallow_gemma':  # the preset's reader is the whole Gemma 3 270M
    config.reader.model = request.getfixturevalue('shallow_gemma_dir')
  results = runner.run(config, config.workdir)
  report.validate_results(json.loads(open(os.path.join(config.workdir, 'results.json')).read()))
  rows = {r['key']: r for r in results['rows']}
  assert list(rows) == list(pipeline.ROW_KEYS)
  assert all(r['n'] == 6 for r in rows.values()) and rows['none']['tokens'] == 0
  assert results['main_metric'] == 'bertscore_f1' and results['seeds'] == [0]
  stages = os.path.join(config.workdir, 'stages')

  # Retrieval never hands a question its own answer.
  for split, n in (('train', 8), ('dev', 4), ('test', 6)):
    examples = read_examples(os.path.join(stages, pipeline.data_stage(split), f'{split}.jsonl'))
    assert len(examples) == n
    for e in examples:
      assert len(e.ctxs) == 3 and not {p.id for p in e.ctxs} & set(e.meta['own_passage_ids'])

  # Table 1: every question is kept or dropped for a reason, and the kept ones are what training reads.
  knowledge = results['stages']['knowledge']
  for split, n in (('train', 8), ('dev', 4)):
    kept = knowledge[split]['kept']
    assert kept + knowledge[split]['dropped'].get('no_entity', 0) + \
        knowledge[split]['dropped'].get('no_described_entity', 0) == n
  train_summary = results['stages']['train_kcomp_seed0']
  assert train_summary['objective'] == 'knowledge_injection' and train_summary['examples'] == knowledge['train']['kept']
  assert results['stages']['train_ft_seed0']['objective'] == 'prompt_target'
  assert results['train_questions'] == knowledge['train']['kept']

  # Reader-sentence targets: the 2 sentences of the question's passages the reader scored highest, in reading order.
  train = {e.id: e for e in read_examples(os.path.join(stages, 'data', 'train.jsonl'))}
  targets = [json.loads(line) for line in open(os.path.join(stages, 'targets', 'train.jsonl'))]
  assert len(targets) == knowledge['train']['kept']
  for t in targets:
    pool = kcomp.passage_sentences(train[t['id']].ctxs, 20)
    assert len(t['loglik']) == len(pool) > 2
    best = sorted(np.argsort(-np.asarray(t['loglik']), kind='stable')[:2])
    assert t['summary'] == ' '.join(pool[j] for j in best)

  # The exported K-COMP holds <ent> and <eom> in its tokenizer and embedding table.
  exported = load_pretrained(os.path.join(stages, 'train_kcomp_seed0', 'compressor_best'))
  vocab = exported.tokenizer().get_vocab()
  assert '<ent>' in vocab and '<eom>' in vocab and exported.config.vocab_size >= vocab['<eom>'] + 1

  # Per-question records: BERTScore recomputed from the predictions; an empty evidence reads as no retrieval.
  predictions = [json.loads(line) for line in open(os.path.join(config.workdir, 'predictions.jsonl'))]
  by_row = {}
  for p in predictions:
    by_row.setdefault(p['row'], []).append(p)
  test = read_examples(os.path.join(stages, 'test_data', 'test.jsonl'))
  references = {e.id: e.answers[0] for e in test}
  scorer = BertScore('')
  none = by_row['none']
  recomputed = scorer.score([p['prediction'] for p in none], [references[p['id']] for p in none])['f1']
  np.testing.assert_allclose(recomputed, [p['bertscore_f1'] for p in none], atol=1e-5)
  assert rows['none']['bertscore_f1'] == pytest.approx(100 * float(np.mean(recomputed)), abs=1e-3)
  assert rows['none']['bertscore_f1'] > 0  # the real reader writes text
  for row_id in ('kcomp@0', 'kcomp_no_prior@0', 'ft@0'):
    for p, q in zip(by_row[row_id], none):
      if not p['evidence']:
        assert p['prediction'] == q['prediction']
  # The truncation row reads at most K-COMP's mean evidence tokens, rounded (at least one).
  k = max(int(round(rows['kcomp']['tokens'])), 1)
  assert all(p['tokens'] <= k + 1 for p in by_row['truncation@0'])

  # The bootstrap compares K-COMP with every other row on both metrics; its delta is the paired mean.
  entries = {(e['b'], e['metric']): e for e in results['bootstrap']}
  assert set(entries) == {(key, m) for key in pipeline.ROW_KEYS if key != 'kcomp' for m in pipeline.METRICS}
  top5 = {p['id']: p['bertscore_f1'] for p in by_row['top5']}
  delta = 100 * np.mean([p['bertscore_f1'] - top5[p['id']] for p in by_row['kcomp@0']])
  assert entries[('top5', 'bertscore_f1')]['delta'] == pytest.approx(delta, abs=1e-4)

  # One inference call: the export reproduces the K-COMP row's evidence.
  compressor = load_compressor(os.path.join(config.workdir, 'compressor'))
  evidence = compressor.compress([e.question for e in test], [e.ctxs for e in test])
  assert evidence == [p['evidence'] for p in by_row['kcomp@0']]

  # A second run reuses every stage and writes the same rows.
  again = runner.run(config, config.workdir)
  assert [(r['key'], r['bertscore_f1'], r['rougeL']) for r in again['rows']] == \
      [(r['key'], r['bertscore_f1'], r['rougeL']) for r in results['rows']]
  assert all(seconds == 0.0 for seconds in again['stage_seconds'].values())

  # Another test file (here its first 4 questions) reuses every training stage, so the model chosen on
  # dev is the one evaluated; the rows no compressor changes are read from the reader's cache.
  config.kcomp.max_test = 4
  other = runner.run(config, config.workdir)
  assert {name for name, seconds in other['stage_seconds'].items() if seconds > 0} == {'test_data', 'evaluate'}
  cached = {r['key']: r['reader_answers_cached'] for r in other['rows']}
  assert cached['none'] == cached['top1'] == cached['top5'] == 4
  first = {p['id']: p['prediction'] for p in by_row['top5']}
  again_rows = [json.loads(line) for line in open(os.path.join(config.workdir, 'predictions.jsonl'))]
  assert [p['prediction'] for p in again_rows if p['row'] == 'top5'] == [first[e.id] for e in test[:4]]


def test_config_sections_and_rows():
  from configs.medquad_kcomp import get_config
  for preset in ('paper', 'shared', 'demo', 'ci'):
    config = get_config(preset)
    runner.config_fields.check(config, runner.system_fields('kcomp'), 'kcomp')
  config = get_config('ci')
  assert pipeline.requested_rows(config) == list(pipeline.ROW_KEYS)
  config.train.num_steps = 0
  assert pipeline.requested_rows(config) == ['none', 'top1', 'top5']  # nothing trained
  config = get_config('ci')
  config.kcomp.rows = ('top1', 'truncation')
  assert pipeline.requested_rows(config) == ['top1']  # truncation matches K-COMP's tokens
  assert pipeline.eom(config) == '<eom>'
  config.kcomp.variant = 'released'
  assert pipeline.eom(config) == '<eod>'


def test_skip_test_reads_the_test_file_past_the_skipped_questions(tmp_path):
  """``kcomp.skip_test``: the demo tests on dev questions past those training reads as dev."""
  if not os.path.isdir(MEDQUAD):
    pytest.skip(f'{MEDQUAD} is absent (the shared data folder)')
  from configs.medquad_kcomp import get_config
  from recomp_jax.data import medquad
  config = get_config('demo')
  assert config.kcomp.test_path == config.kcomp.dev_path and config.kcomp.skip_test == config.kcomp.max_dev
  config.kcomp.max_test = 3
  summary = pipeline.stage_data(config, str(tmp_path), ('test',))
  dev = medquad.read_questions(config.kcomp.dev_path, max_examples=7)
  test = read_examples(os.path.join(tmp_path, 'test.jsonl'))
  assert [e.id for e in test] == [e.id for e in dev[4:7]] and summary['test']['questions'] == 3
  assert not {e.id for e in test} & {e.id for e in dev[:config.kcomp.max_dev]}
