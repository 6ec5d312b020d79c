"""CoLoR end to end on NQ (``configs/nq_color.py:ci``): corpora built within their budget with the
gold passages spread out, candidates from our own server and lead sentences, labels by the real
Gemma 3 270M reader ranking the corpus in its context (the substitution path equal to a full
re-encoding), SFT / ORPO / CoLoR fine-tuned (a tiny random Gemma with the real tokenizer, also the
teacher here), every
row evaluated, the export, and a resumed run that recomputes nothing."""

import json
import os

import numpy as np
import pytest

from recomp_jax import load_compressor
from recomp_jax.compressors import abstractive, color, extractive
from recomp_jax.compressors.base import load_exported, write_export
from recomp_jax.data import lclm as lclm_data
from recomp_jax.data.schema import DataError, Passage
from recomp_jax.evaluation import report
from recomp_jax.pipelines import color as pipeline
from recomp_jax.pipelines import runner
from recomp_jax.pretrained.demo import resolve_demo_model
from recomp_jax.reader import lclm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NQ = os.path.join(os.path.dirname(REPO), 'shared', 'data', 'nq')


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch):
  monkeypatch.syspath_prepend(REPO)
  monkeypatch.chdir(REPO)  # the presets name ../shared/data


@pytest.mark.end_to_end
@pytest.mark.parametrize('reader', ['shallow_gemma', pytest.param('gemma3_270m', marks=pytest.mark.slow)])
def test_ci_pipeline_end_to_end_and_resume(tmp_path, tiny_gemma_dir, reader, request):
  if not os.path.isdir(NQ):
    pytest.skip(f'{NQ} is absent (the shared data folder)')
  from configs.nq_color import get_config
  config = get_config('ci')
  config.workdir = str(tmp_path / 'run')
  config.compressor.model = tiny_gemma_dir
  if reader == 'shallow_gemma':  # the preset's reader is the whole Gemma 3 270M
    config.reader.model = request.getfixturevalue('shallow_gemma_dir')
  config.teacher.model = tiny_gemma_dir
  # The RECOMP rows read exported compressors; untrained ones here (MiniLM picking one sentence,
  # the tiny Gemma writing): the rows' path is what is tested, not RECOMP's quality.
  config.color.extractive_compressor = write_export(str(tmp_path / 'extractive'), extractive.export_spec(
      resolve_demo_model('', 'encoder'), k=1, top_docs=1, max_candidates=0, pooling='mean', normalize=True,
      max_length=128)).rsplit('/', 1)[0]
  config.color.abstractive_compressor = write_export(str(tmp_path / 'abstractive'), abstractive.export_spec(
      tiny_gemma_dir, top_docs=1, max_source_length=256, max_new_tokens=16, empty_threshold=0.0,
      batch_size=8)).rsplit('/', 1)[0]
  results = runner.run(config, config.workdir)
  report.validate_results(json.loads(open(os.path.join(config.workdir, 'results.json')).read()))
  rows = {r['key']: r for r in results['rows']}
  assert list(rows) == list(pipeline.ROW_KEYS)
  assert all(r['n'] == 4 for r in rows.values()) and results['main_metric'] == 'r1'
  assert rows['raw']['compression'] == pytest.approx(1.0)
  assert rows['titles']['compression'] > 2.0 and rows['titles']['prompt_tokens'] < rows['raw']['prompt_tokens']
  runs = pipeline.StageRunner(config.workdir)
  assert results['stages']['compress']['extractive']['empty'] == 0

  # RECOMP extractive: one sentence of each passage, without the title prefix its candidates carry.
  extracted = pipeline.read_records(os.path.join(config.workdir, 'stages', 'compress', 'extractive.jsonl'))
  for passage in pipeline.test_passages(runs):
    text = extracted[passage.id]['text']
    assert text and text in passage.text and not text.startswith(f'{passage.title}: ')
  assert rows['extractive']['compression'] > 1.0

  # Corpora: within budget, distinct, each query's gold passage where the group says, spread out.
  retriever = pipeline.retriever(config, pipeline.shared.Resources(config, config.workdir))
  queries = pipeline.load_queries(runs)
  for split, budget in (('test', config.color.budget_tokens), ('train', config.color.label_budget_tokens)):
    groups = pipeline.load_groups(runs, split)
    assert groups and sum(len(g.queries) for g in groups) == {'test': 4, 'train': 6}[split]
    for g in groups:
      entries = [retriever.piece(lclm.format_entry(0, p.title, p.text) + '\n') for p in g.corpus]
      assert sum(map(len, entries)) <= budget and len({p.id for p in g.corpus}) == len(g.corpus)
      positions = sorted(pos for gold in g.gold for pos in gold)
      expected = sorted(int((j + 0.5) * len(g.corpus) / len(positions)) for j in range(len(positions)))
      assert positions == expected  # evenly spaced (Fig. 4's buckets all get gold passages at scale)
      assert all(len(s) == 1 for s in g.shot_gold)

  # Labels: the raw passage's rank by substitution equals ranking the whole raw corpus.
  labels = [json.loads(line) for line in open(os.path.join(config.workdir, 'stages', 'labels', 'train.jsonl'))]
  group = pipeline.load_groups(runs, 'train')[0]
  scores = retriever.rank([p.title for p in group.corpus], [p.text for p in group.corpus],
                          pipeline.shots_of(group, queries), [queries[q] for q in group.queries])
  by_id = {r['id']: r for r in labels}
  for qid, row, gold in zip(group.queries, scores, group.gold):
    assert by_id[qid]['raw_gold_rank'] == int((row > row[gold[0]]).sum())
  assert np.ptp(scores) > 1.0  # the reader prefers some IDs

  # Pairs (Table 9): every query accounted for; chosen = the shortest success; rejected longer.
  from recomp_jax.pretrained import load_pretrained
  tokenizer = load_pretrained(tiny_gemma_dir).tokenizer()
  counts = color.PairCounts()
  with_pairs = 0
  for _, cands in pipeline.labelled_candidates(runs, 'train', tokenizer):
    pairs = color.preference_pairs(cands, counts)
    with_pairs += bool(pairs)
    for chosen, rejected in pairs:
      assert chosen.success and rejected.tokens > chosen.tokens
      assert chosen.tokens == min(c.tokens for c in cands if c.success)
  assert counts.queries == 6 == counts.no_success + counts.no_rejected + with_pairs
  assert results['stages']['train_color_seed0']['pairs']['train']['pairs'] == counts.pairs
  # color.success=no_worse keeps every first-rank success and counts as the labels stage reports.
  lenient = pipeline.labelled_candidates(runs, 'train', tokenizer, 'no_worse')
  for (_, first), (_, other) in zip(pipeline.labelled_candidates(runs, 'train', tokenizer), lenient):
    assert all(b.success for a, b in zip(first, other) if a.success)
  label_summary = results['stages']['labels']['train']
  assert label_summary['no_worse']['successes'] == sum(c.success for _, cands in lenient for c in cands)
  assert label_summary['no_worse']['successes'] >= label_summary['successes']

  # Per-query records: R@1 is the gold ranked first; the bootstrap delta is the paired mean.
  predictions = [json.loads(line) for line in open(os.path.join(config.workdir, 'predictions.jsonl'))]
  by_row = {}
  for p in predictions:
    by_row.setdefault(p['row'], []).append(p)
  assert all(p['r1'] == float(p['gold_rank'] == 0) for p in predictions)
  assert rows['raw']['r1'] == pytest.approx(100 * np.mean([p['r1'] for p in by_row['raw']]))
  entries = {e['b']: e for e in results['bootstrap']}
  assert set(entries) == set(pipeline.ROW_KEYS) - {'color'}
  raw = {p['id']: p['r1'] for p in by_row['raw']}
  assert entries['raw']['delta'] == pytest.approx(100 * np.mean([p['r1'] - raw[p['id']] for p in by_row['color@0']]))

  # The export compresses as the CoLoR row did.
  exported = load_compressor(os.path.join(config.workdir, 'compressor'))
  compressed = pipeline.read_records(os.path.join(config.workdir, 'stages', 'compress', 'color_seed0.jsonl'))
  passage = pipeline.test_passages(runs)[0]
  assert exported.compress(['q'], [[passage]]) == [f'{passage.title}: {compressed[passage.id]["text"]}']

  # A second run reuses every stage and writes the same rows.
  again = runner.run(config, config.workdir)
  assert [(r['key'], r['r1']) for r in again['rows']] == [(r['key'], r['r1']) for r in results['rows']]
  assert all(seconds == 0.0 for seconds in again['stage_seconds'].values())


def test_config_sections_and_rows():
  from configs.nq_color import get_config
  for preset in ('paper', 'shared', 'ci'):
    runner.config_fields.check(get_config(preset), runner.system_fields('color'), 'color')
  config = get_config('ci')
  recomp = [k for k in pipeline.ROW_KEYS if k not in pipeline.RECOMP]
  assert pipeline.requested_rows(config) == recomp  # no exported RECOMP compressor: left out, and said
  assert pipeline.left_out_rows(config) == ['extractive', 'abstractive']
  config.color.extractive_compressor = '/nonexistent'
  assert pipeline.requested_rows(config)[:5] == ['raw', 'titles', 'truncation', 'teacher', 'extractive']
  with pytest.raises(pipeline.shared.PipelineError, match='/nonexistent: no compressor.json'):
    pipeline.validate(config)
  config = get_config('ci')
  config.train.num_steps = 0
  assert pipeline.requested_rows(config) == ['raw', 'titles', 'teacher', 'bm25', 'dense']
  config = get_config('ci')
  config.color.rows = ('raw', 'truncation')
  assert pipeline.requested_rows(config) == ['raw']  # truncation matches CoLoR's tokens


def test_recomp_rows_read_their_own_exports(tmp_path):
  assert pipeline.without_title('Paris: It is big.\nParis: It is old.', 'Paris') == 'It is big. It is old.'
  assert pipeline.without_title('Lyon: a river town.', 'Paris') == 'Lyon: a river town.'
  assert pipeline.without_title('x: y\n', '') == 'x: y'
  directory = os.path.dirname(write_export(str(tmp_path / 'e'), extractive.export_spec(
      str(tmp_path), k=1, top_docs=1, max_candidates=0, pooling='mean', normalize=True, max_length=0)))
  with pytest.raises(DataError, match="compressor.json:1: field 'system': 'extractive' is not one of abstractive"):
    load_exported(directory, ('abstractive',))


def test_hotpotqa_corpora_hold_both_supporting_paragraphs_and_f1_at_2(tmp_path, tiny_gemma_dir):
  path = os.path.join(os.path.dirname(REPO), 'shared', 'data', 'hotpotqa', 'dev500_ircot.jsonl')
  if not os.path.exists(path):
    pytest.skip(f'{path} is absent (the shared data folder)')
  from configs.hotpotqa_color import get_config
  config = get_config('ci')
  config.reader.model = tiny_gemma_dir  # the Gemma 3 tokenizer is what the corpora are counted in
  config.train.num_steps = 0  # the data stage alone: no training split
  runs = pipeline.StageRunner(str(tmp_path))
  summary = runs.run('data', {}, lambda d: pipeline.stage_data(config, pipeline.shared.Resources(config, str(tmp_path)), d))
  from recomp_jax.data import formats
  file_ids = [e.id for e in formats.read_examples(path, limit=204)]
  groups = pipeline.load_groups(runs, 'test')
  assert [q for g in groups for q in g.queries] == file_ids[200:204]
  assert summary['shots'] == file_ids[:1] and summary['test']['queries'] == 4
  for g in groups:
    for gold in g.gold:
      assert len(gold) == 2 and len({g.corpus[i].title for i in gold}) == 2
    assert all(len(s) == 2 for s in g.shot_gold)
  config.color.skip_test = 0
  with pytest.raises(pipeline.shared.PipelineError, match='few-shot examples .* would be test queries'):
    pipeline.stage_data(config, pipeline.shared.Resources(config, str(tmp_path)), str(tmp_path))


def test_aggregate_and_bootstrap_on_f1_at_2():
  def record(row, f1):
    return {'row': row, 'ids': ['a', 'b'], 'r1': [1.0, 0.0], 'f1_at_2': f1, 'passage_tokens': 10.0, 'prompt_tokens': [5, 5],
            'gold_rank': [0, 3], 'bucket': [0, 4], 'r1_greedy': [], 'f1_at_2_greedy': [], 'invalid_ids': []}
  records = {'raw': record('raw', [1.0, 0.5]), 'color@0': record('color@0', [0.5, 0.0]),
             'color@1': record('color@1', [1.0, 0.0])}
  rows, per_query = pipeline.aggregate(records, 10.0, 'f1_at_2')
  by_key = {r['key']: r for r in rows}
  assert by_key['raw']['f1_at_2'] == pytest.approx(75.0) and by_key['color']['f1_at_2'] == pytest.approx(37.5)
  assert by_key['color']['r1'] == pytest.approx(50.0)
  (entry,) = pipeline.bootstrap(per_query, 0, 'f1_at_2')
  assert entry['metric'] == 'f1_at_2' and entry['delta'] == pytest.approx(37.5 - 75.0)
  assert lclm.f1_at_k([3, 1], (1, 3), 2) == 1.0 and lclm.f1_at_k([3, 0], (1, 3), 2) == 0.5


def test_preference_pairs_paper_and_released():
  cands = [color.Candidate('a b c d e f', 'teacher@0.7', 6, True), color.Candidate('a b', 'lead1', 2, False),
           color.Candidate('a b c', 'teacher@0.0', 3, True), color.Candidate('a b c d e f g h', 'lead2', 8, False)]
  counts = color.PairCounts()
  pairs = color.preference_pairs(cands, counts)
  assert [(w.source, r.source) for w, r in pairs] == [('teacher@0.0', 'teacher@0.7'), ('teacher@0.0', 'lead2')]
  assert counts.rejected_not_longer == 1 and counts.pairs == 2  # the short failed lead1 would flip the sign
  released = color.preference_pairs(cands, color.PairCounts(), variant='released')
  assert [(w.source, r.source) for w, r in released] == [('teacher@0.0', 'lead2')]
  none = color.PairCounts()
  assert color.preference_pairs([color.Candidate('x', 'lead1', 1, False)], none) == [] and none.no_success == 1


def test_corpus_prompt_and_parsing():
  titles = ['A', 'B', 'C']
  text = lclm.prefix_text(titles, ['one', None, 'three'], [('q1', (2,))])
  assert 'ID: 0 | TITLE: A | CONTENT: one | END ID: 0\nID: 1 | TITLE: B | END ID: 1\n' in text
  assert 'query: q1\nThe following documents can help answer the query:\nID: 2 | TITLE: C\n' in text
  assert lclm.parse_ids('ID: 2 | TITLE: C\nID: 7 | TITLE: ?\nID: 2 | x', 3) == ([2], 1)
  assert lclm.f1_at_k([1, 4], [1, 2], 2) == pytest.approx(0.5) and lclm.recall_at_1([], [0]) == 0.0


def test_label_corpora_gold_spread_or_last():
  pool = [Passage(f'p{i}', f't{i}', 'x ' * (5 + i % 7)) for i in range(60)]
  queries = [lclm_data.Query(f'q{k}', f'query {k}', (Passage('', f'gold{k}', f'gold text {k}'),), ()) for k in range(4)]
  shots = [lclm_data.Query('s', 'shot', (Passage('', 'shotgold', 'shot text'),), ())]
  count = lambda p: len(p.text.split()) + 4  # noqa: E731
  for gold_at in ('spread', 'end'):
    groups = lclm_data.build_groups(queries, shots, pool, split='train', queries_per_group=2, budget_tokens=80,
                                    count_tokens=count, seed=3, gold_at=gold_at)
    assert len(groups) == 2
    for g in groups:
      n = len(g.corpus)
      assert sum(count(p) for p in g.corpus) <= 80 and n > 6
      positions = sorted(p for gold in g.gold for p in gold)
      assert {g.corpus[p].title for p in positions} == {f'gold{q[1:]}' for q in g.queries}
      if gold_at == 'end':
        assert positions == [n - 2, n - 1]
      else:
        assert positions == [int(0.25 * n), int(0.75 * n)]
      assert g.corpus[g.shot_gold[0][0]].title == 'shotgold'
  with pytest.raises(ValueError, match='gold_at'):
    lclm_data.build_groups(queries, shots, pool, split='train', queries_per_group=2, budget_tokens=80,
                           count_tokens=count, seed=3, gold_at='middle')


def test_success_rules_from_gold_ranks():
  # first: nothing above the gold (the paper); no_worse: no rank lost against the raw passage.
  assert color.succeeded(0, 3) and not color.succeeded(1, 3)
  assert color.succeeded(3, 3, 'no_worse') and color.succeeded(0, 3, 'no_worse')
  assert not color.succeeded(4, 3, 'no_worse') and not color.succeeded(1, 0, 'no_worse')
  with pytest.raises(ValueError, match='rule must be one of'):
    color.succeeded(0, 0, 'top5')
  # With the weak reader's ranks, no_worse gives the shortest no-loss candidate as the chosen one.
  cands = [color.Candidate(t, s, n, color.succeeded(g, 2, 'no_worse'))
           for t, s, n, g in (('a b c d', 'teacher@0.0', 4, 2), ('a', 'lead1', 1, 5), ('a b', 'lead2', 2, 1))]
  counts = color.PairCounts()
  pairs = color.preference_pairs(cands, counts)
  assert [(w.source, r.source) for w, r in pairs] == [('lead2', 'teacher@0.0')] and counts.rejected_not_longer == 1
