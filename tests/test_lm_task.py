"""The RECOMP language-modelling task: WikiText articles, 32-token windows, pooled perplexity."""

from __future__ import annotations

import gzip
import math
import os
import re

import numpy as np
import pytest

from recomp_jax.data.schema import DataError, FilterReport
from recomp_jax.data.wikitext import Article, make_windows, read_articles, read_windows, write_windows
from recomp_jax.evaluation import lm_metrics
from tests import config_files

SHARED_WIKITEXT = os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data', 'wikitext',
                               'wikitext2_test.raw')

RAW = (' = Alpha Beta = \n'
       ' Alpha Beta is a test article . It has two sentences . \n'
       ' = = Early life = = \n'
       ' Section text stays in the article . \n'
       ' = Qualified for the next round \n'
       ' = Gamma = \n'
       ' Gamma is short . \n')


def _write(tmp_path, text: str) -> str:
  path = tmp_path / 'wiki.raw'
  path.write_text(text, encoding='utf-8')
  return str(path)


def test_read_articles_splits_at_level_one_titles_only(tmp_path):
  articles = read_articles(_write(tmp_path, RAW))
  assert [(a.title, a.line) for a in articles] == [('Alpha Beta', 1), ('Gamma', 6)]
  assert articles[0].text.splitlines() == [
      'Alpha Beta is a test article . It has two sentences .', '= = Early life = =',
      'Section text stays in the article .', '= Qualified for the next round']  # a table legend, no closing " ="
  assert articles[1].text == 'Gamma is short .'


@pytest.mark.parametrize('text, line, field', [
    (' Text first . \n = A = \n b \n', 1, 'title'),
    (' = A = \n = B = \n b \n', 1, 'text'),
    (' = A = \n a \n = A = \n b \n', 3, 'title'),
    (' no heading at all \n', 1, 'title'),
])
def test_read_articles_names_file_line_and_field(tmp_path, text, line, field):
  path = _write(tmp_path, text)
  with pytest.raises(DataError) as e:
    read_articles(path)
  assert (e.value.path, e.value.line, e.value.field) == (path, line, field)
  assert str(e.value).startswith(f'{path}:{line}: field {field!r}')


@pytest.mark.skipif(not os.path.exists(SHARED_WIKITEXT), reason='needs ../shared/data')
def test_shared_wikitext2_test_has_its_62_articles():
  articles = read_articles(SHARED_WIKITEXT)
  assert len(articles) == 62
  assert articles[0].title == 'Robert Boulter' and articles[1].title == 'Du Fu'
  assert len({a.title for a in articles}) == 62


def test_windows_tile_each_article_after_its_query(gemma3_tokenizer, tmp_path):
  tok = gemma3_tokenizer
  articles = [Article('A', 'The quick brown fox jumps over the lazy dog . ' * 6, 1),
              Article('B', 'Too short .', 3),
              Article('C', 'Rivers flow to the sea and the sea feeds the clouds . ' * 5, 5)]
  report = FilterReport('windows')
  windows = make_windows(articles, tok, stride=8, query_tokens=4, max_prefix_tokens=20, report=report)
  assert report.to_dict()['dropped'] == {'article_too_short': 1}
  for index, article in ((0, articles[0]), (2, articles[2])):
    ids = tok(' ' + article.text, add_special_tokens=False)['input_ids']
    mine = [w for w in windows if w.id.startswith(f'{index}:')]
    assert [int(w.id.split(':')[1]) for w in mine] == list(range(4, len(ids), 8))
    assert sum((w.target_ids for w in mine), []) == ids[4:]  # every token after the first query, once
    for w in mine:
      start = int(w.id.split(':')[1])
      assert w.prefix_ids == ids[max(0, start - 20):start] and w.title == article.title
      assert w.query == tok.decode(ids[start - 4:start]).strip()
  sampled = make_windows(articles, tok, stride=8, query_tokens=4, max_prefix_tokens=20, max_windows=5,
                         seed=3, report=(r := FilterReport('sampled')))
  assert len(sampled) == 5 and r.to_dict()['dropped']['not_sampled'] == len(windows) - 5
  assert [w.id for w in sampled] == [w.id for w in windows if w.id in {s.id for s in sampled}]  # article order
  assert sampled == make_windows(articles, tok, stride=8, query_tokens=4, max_prefix_tokens=20,
                                 max_windows=5, seed=3)
  path = str(tmp_path / 'windows.jsonl')
  write_windows(path, sampled)
  assert read_windows(path) == sampled


def test_context_ids_keep_the_prefix_and_cut_evidence_from_the_left(gemma3_tokenizer):
  tok = gemma3_tokenizer
  prefix = list(range(1000, 1012))
  ids, n = lm_metrics.context_ids(tok, '', prefix, max_context_tokens=16)
  assert n == 0 and ids == [tok.bos_token_id] + prefix
  evidence = tok('Paris is the capital of France.', add_special_tokens=False)['input_ids']
  sep = tok('\n\n', add_special_tokens=False)['input_ids']
  ids, n = lm_metrics.context_ids(tok, 'Paris is the capital of France.', prefix, max_context_tokens=64)
  assert n == len(evidence) and ids == [tok.bos_token_id] + evidence + sep + prefix
  room = 1 + len(sep) + len(prefix) + 3
  ids, n = lm_metrics.context_ids(tok, 'Paris is the capital of France.', prefix, max_context_tokens=room)
  assert n == 3 and ids == [tok.bos_token_id] + evidence[-3:] + sep + prefix and len(ids) == room
  ids, n = lm_metrics.context_ids(tok, 'Paris.', prefix, max_context_tokens=1 + len(prefix))
  assert n == 0 and ids == [tok.bos_token_id] + prefix  # no room at all: nothing prepended
  with pytest.raises(ValueError, match='does not fit'):
    lm_metrics.context_ids(tok, '', prefix, max_context_tokens=len(prefix))


def test_perplexity_pools_tokens_and_bootstrap_orders_rows():
  assert lm_metrics.perplexity([-2.0, -4.0], [1, 3]) == pytest.approx(math.exp(6.0 / 4))
  with pytest.raises(ValueError):
    lm_metrics.perplexity([], [])
  rng = np.random.default_rng(0)
  tokens = np.full(200, 32)
  worse = -rng.uniform(60, 100, 200)
  better = worse + 8.0  # 0.25 nats per token better on every window
  same = lm_metrics.paired_bootstrap_perplexity(worse, worse, tokens, n_resamples=500)
  assert (same.delta, same.lo, same.hi) == (0.0, 0.0, 0.0)
  b = lm_metrics.paired_bootstrap_perplexity(better, worse, tokens, n_resamples=500, seed=1)
  assert b.delta == pytest.approx(lm_metrics.perplexity(better, tokens) - lm_metrics.perplexity(worse, tokens))
  assert b.lo <= b.delta <= b.hi < 0 and b.p_value == 0.0 and b.n == 200
  with pytest.raises(ValueError):
    lm_metrics.paired_bootstrap_perplexity(better, worse[:5], tokens)


@pytest.mark.slow  # Gemma 3 real-weight parity beyond the one fast test (test_gguf logits)
def test_real_gemma3_window_scores_match_transformers(gemma3_ours, gemma3_torch, gemma3_tokenizer):
  """Our sharded scorer's window log-likelihoods equal HF PyTorch's on real weights, and
  evidence that contains the continuation makes it far more likely (the model copies)."""
  import torch  # pylint: disable=import-outside-toplevel
  from recomp_jax.reader import Reader  # pylint: disable=import-outside-toplevel
  tok = gemma3_tokenizer
  text = ('Du Fu was a prominent Chinese poet of the Tang dynasty . Along with Li Bai , he is '
          'frequently called the greatest of the Chinese poets . His greatest ambition was to serve '
          'his country as a successful civil servant , but he proved unable to make the necessary '
          'accommodations .')
  windows = make_windows([Article('Du Fu', text, 1)], tok, stride=12, query_tokens=8, max_prefix_tokens=24)
  assert len(windows) >= 3
  reader = Reader.from_model(gemma3_ours.model, tok, score_batch_size=4)
  none = lm_metrics.score_windows(reader, windows, [''] * len(windows), max_context_tokens=64)
  copied = lm_metrics.score_windows(reader, windows, [text] * len(windows), max_context_tokens=128)
  for scores, evidence, limit in ((none, '', 64), (copied, text, 128)):
    for w, ours, n in zip(windows, scores.loglik, scores.num_tokens):
      context, _ = lm_metrics.context_ids(tok, evidence, w.prefix_ids, max_context_tokens=limit)
      ids = torch.tensor([context + w.target_ids])
      with torch.no_grad():
        log_p = torch.log_softmax(gemma3_torch(ids).logits[0].double(), dim=-1).numpy()
      reference = sum(log_p[len(context) - 1 + k, t] for k, t in enumerate(w.target_ids))
      assert n == len(w.target_ids)
      np.testing.assert_allclose(ours, reference, atol=2e-3 * n, rtol=0)
  assert copied.evidence_tokens.min() > 50 and none.evidence_tokens.max() == 0
  assert copied.perplexity < none.perplexity / 3


def test_own_article_passages_are_removed_before_the_top_k():
  from recomp_jax.data.schema import Passage  # pylint: disable=import-outside-toplevel
  from recomp_jax.data.wikitext import LMWindow  # pylint: disable=import-outside-toplevel
  from recomp_jax.pipelines.lm import retrieve_excluding_own_article  # pylint: disable=import-outside-toplevel
  ranked = [Passage('1', 'Ise-class battleship', 'a'), Passage('2', 'Fuso', 'b'),
            Passage('3', 'Ise @-@ class battleship', 'c'), Passage('4', 'Yamato', 'd'),
            Passage('5', 'Nagato', 'e')] + [Passage(str(i), f'Other {i}', 'x') for i in range(6, 40)]
  calls = []

  def search(query, depth):
    calls.append(depth)
    return ranked[:depth]

  window = LMWindow('0:32', 'Ise @-@ class battleship', [1, 2], [3], 'query')
  report = FilterReport('retrieve')
  out = retrieve_excluding_own_article(search, [window], 2, report)
  assert [p.id for p in out[0]] == ['2', '4'] and calls == [8]
  assert report.to_dict()['dropped'] == {'own_article_passage': 2}
  out = retrieve_excluding_own_article(search, [window], 3, FilterReport('r'))
  assert [p.id for p in out[0]] == ['2', '4', '5']


@pytest.mark.skipif(not os.path.exists(SHARED_WIKITEXT), reason='needs ../shared/data')
@pytest.mark.end_to_end
@pytest.mark.parametrize('reader', ['tiny_gemma', pytest.param('gemma3_270m', marks=pytest.mark.slow)])
def test_ci_pipeline_end_to_end_and_resumes(tmp_path, gemma3_gguf_path, tiny_gemma_dir, reader):
  """configs/wikitext_lm.py:ci: windows -> BM25 (own article removed) -> every row's perplexity
  -> a results file in the schema; a second run reuses every stage and gives the same file. The
  abstractive compressor (and the teacher of its paper path) is a tiny random Gemma with the real
  tokenizer; so is the reader in the fast tier (it runs the stages, not the models), the real
  Gemma 3 270M (the preset's) in the slow tier."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel
  from recomp_jax.data.wikitext import read_windows, title_key  # pylint: disable=import-outside-toplevel
  from recomp_jax.evaluation import report  # pylint: disable=import-outside-toplevel
  from recomp_jax.pipelines import runner  # pylint: disable=import-outside-toplevel
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location('wikitext_lm', os.path.join(repo, 'configs', 'wikitext_lm.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config('ci')
  config.lm.wikitext_path = os.path.abspath(SHARED_WIKITEXT)
  config.compressor.model = tiny_gemma_dir
  if reader == 'tiny_gemma':
    config.reader.model = tiny_gemma_dir
  workdir = str(tmp_path / 'run')
  results = runner.run(config, workdir)
  assert report.load_results(os.path.join(workdir, 'results.json'))['system'] == 'lm'
  rows = {r['key']: r for r in results['rows']}
  assert list(rows) == ['none', 'top1', 'top5', 'bm25_sentence', 'offtheshelf_sentence', 'trained', 'abstractive',
                        'oracle_ll']
  assert all(r['n'] == 6 and r['scored_tokens'] == 6 * 32 for r in rows.values())
  assert rows['none']['tokens'] == 0
  assert rows['top5']['tokens'] > rows['top1']['tokens'] > rows['bm25_sentence']['tokens'] > 0
  # (a random reader's perplexity is astronomical but finite)
  assert all(1.0 < r['ppl'] < (1e4 if reader == 'gemma3_270m' else np.inf) for r in rows.values())
  records = {}
  with open(os.path.join(workdir, 'predictions.jsonl'), encoding='utf-8') as f:
    for line in f:
      p = json.loads(line)
      records.setdefault(p['row'], {})[p['id']] = p
  for window_id, oracle in records['oracle_ll'].items():  # every candidate competes in the oracle
    for key in ('bm25_sentence', 'offtheshelf_sentence', 'trained'):
      assert oracle['loglik'] >= records[key][window_id]['loglik']
  assert rows['oracle_ll']['ppl'] <= min(rows[k]['ppl'] for k in ('bm25_sentence', 'offtheshelf_sentence', 'trained'))
  # a sentence row's score read from the candidate table is the score of its evidence scored alone
  from recomp_jax.pipelines import shared  # pylint: disable=import-outside-toplevel
  reader = shared.Resources(config).reader
  windows_by_id = {w.id: w for w in read_windows(os.path.join(workdir, 'stages', 'windows', 'windows.jsonl'))}
  trained = records['trained']
  alone = lm_metrics.score_windows(reader, [windows_by_id[i] for i in trained], [p['evidence'] for p in trained.values()],
                                   max_context_tokens=config.lm.max_context_tokens)
  np.testing.assert_allclose(alone.loglik, [p['loglik'] for p in trained.values()], rtol=1e-4, atol=1e-3)
  # the trained row's training: ovos windows only, split by article, labels over the capped candidates
  stages = os.path.join(workdir, 'stages')
  train_titles = {json.loads(line)['window']['title'] for line in open(os.path.join(stages, 'train_data', 'train.jsonl'))}
  dev_titles = {json.loads(line)['window']['title'] for line in open(os.path.join(stages, 'train_data', 'dev.jsonl'))}
  test_titles = {title_key(w.title) for w in windows_by_id.values()}
  assert train_titles and dev_titles and not train_titles & dev_titles
  assert not {title_key(t) for t in train_titles | dev_titles} & test_titles
  labels = [json.loads(line) for line in open(os.path.join(stages, 'label', 'train.jsonl'))]
  assert len(labels) == 24 and all(0 < len(r['candidates']) == len(r['loglik']) <= 8 for r in labels)
  pairs = [json.loads(line) for line in open(os.path.join(stages, 'pairs', 'train.jsonl'))]
  by_id = {r['id']: r for r in labels}
  for p in pairs:  # the positive is the reader's best candidate; every negative scores below it
    ll = dict(zip(by_id[p['id']]['candidates'], by_id[p['id']]['loglik']))
    assert ll[p['positive']] == max(ll.values()) and all(ll[n] < ll[p['positive']] for n in p['negatives'])
  assert results['train_questions'] == len(pairs) > 0 and results['seeds'] == [0]
  # the reader scores, exported without text, are read back instead of scored (no reader at all)
  from recomp_jax.pipelines import lm_abstractive, lm_extractive  # pylint: disable=import-outside-toplevel
  from recomp_jax.pipelines.lm import read_retrieved  # pylint: disable=import-outside-toplevel
  artifact = str(tmp_path / 'artifact')
  assert lm_extractive.export_artifact(workdir, artifact) == {'train': 24, 'dev': 8, 'test': 6}
  assert 'candidates' not in json.loads(gzip.open(os.path.join(artifact, 'train.jsonl.gz'), 'rt').readline())
  config.lm.label_artifact = artifact
  settings = json.load(open(os.path.join(stages, 'label', 'settings.json')))
  for name in ('relabel', 'rescore', 'other'):
    os.makedirs(tmp_path / name)
  summary = lm_extractive.stage_label(config, None, os.path.join(stages, 'train_data'), str(tmp_path / 'relabel'),
                                      settings)
  assert summary['train'] == {'windows': 24, 'from_artifact': 24, 'candidates': sum(len(r['loglik']) for r in labels)}
  again_labels = [json.loads(line) for line in open(tmp_path / 'relabel' / 'train.jsonl')]
  assert again_labels == labels
  retrieved_by_id = read_retrieved(os.path.join(stages, 'retrieve', 'retrieved.jsonl'))
  summary = lm_extractive.stage_candidate_scores(config, None, list(windows_by_id.values()), retrieved_by_id,
                                                 str(tmp_path / 'rescore'), settings)
  assert summary['from_artifact'] == 6
  with pytest.raises(Exception, match='computed under other settings'):
    lm_extractive.stage_label(config, None, os.path.join(stages, 'train_data'), str(tmp_path / 'other'),
                              {**settings, 'reader': 'another'})
  config.lm.label_artifact = ''
  # the listwise objective (beyond the paper) trains from the same labels
  config.train.objective, config.train.num_steps = 'listwise', 2
  os.makedirs(tmp_path / 'listwise')
  summary = lm_extractive.stage_train(config, 0, shared.Resources(config), os.path.join(stages, 'train_data'),
                                      os.path.join(stages, 'label'), os.path.join(stages, 'pairs'),
                                      str(tmp_path / 'listwise'))
  assert summary['objective'] == 'listwise' and summary['steps'] == 2 and summary['best']['step'] == 2
  assert summary['pairs'] == sum(len(r['candidates']) > 1 for r in labels)
  config.train.objective, config.train.num_steps = 'contrastive', 0
  windows = read_windows(os.path.join(workdir, 'stages', 'windows', 'windows.jsonl'))
  retrieved = [json.loads(line) for line in open(os.path.join(workdir, 'stages', 'retrieve', 'retrieved.jsonl'))]
  for w, r in zip(windows, retrieved):
    assert len(r['ctxs']) == 5 and all(title_key(p['title']) != title_key(w.title) for p in r['ctxs'])
  # the abstractive compressor: Fig. 3's critic over the reader's best sentences (the label stage's)
  critic = [json.loads(line) for line in open(os.path.join(stages, 'abs_critic', 'train.jsonl'))]
  assert [r['id'] for r in critic] == [r['id'] for r in labels]
  for r in critic:
    label = by_id[r['id']]
    best = int(np.argmax(label['loglik']))
    assert r['summary_loglik'] == pytest.approx(label['loglik'][best], rel=1e-4, abs=1e-3)  # scored as the labels
    keep = r['summary_loglik'] >= r['none_loglik']
    assert r['decision'] == ('summary' if keep else 'empty') and r['text'] == (label['candidates'][best] if keep else '')
  abs_train = results['stages']['abs_train_seed0']
  assert abs_train['examples'] == 24 and abs_train['empty_targets'] == sum(r['decision'] == 'empty' for r in critic)
  assert abs_train['steps'] == 4 and abs_train['best']['step'] in (2, 4)
  summaries = [json.loads(line)['summary'] for line in open(os.path.join(stages, 'evaluate', 'summaries_seed0.jsonl'))]
  assert len(summaries) == 6 and [p['evidence'] for p in records['abstractive'].values()] == summaries
  assert rows['abstractive']['empty_pct'] == pytest.approx(100.0 * sum(not t for t in summaries) / 6)
  abstractive_alone = lm_metrics.score_windows(reader, list(windows_by_id.values()), summaries,
                                               max_context_tokens=config.lm.max_context_tokens)
  np.testing.assert_allclose(abstractive_alone.loglik, [p['loglik'] for p in records['abstractive'].values()],
                             rtol=1e-4, atol=1e-3)
  assert any('Trained abstractive compressor' in n for n in results['notes'])
  # the paper's targets: Table 14's four LM prompts to a teacher (our server on the tiny model)
  config.critic.targets, config.teacher.model, config.teacher.max_tokens = 'teacher', tiny_gemma_dir, 12
  config.lm.train_windows, config.lm.dev_windows = 24, 8
  for name in ('teacher_summaries', 'teacher_critic'):
    os.makedirs(tmp_path / name)
  summary = lm_abstractive.stage_summaries(config, os.path.join(stages, 'train_data'), '', str(tmp_path),
                                           str(tmp_path / 'teacher_summaries'))
  assert summary['local_server'] and summary['uncached_at_start'] == (24 + 8) * 4
  assert summary['train']['requests'] == 24 * 4 and summary['dev']['requests'] == 8 * 4
  samples = [json.loads(line) for line in open(tmp_path / 'teacher_summaries' / 'dev.jsonl')]
  assert len(samples) == 8 and all(len(r['samples']) == 4 for r in samples)
  lm_abstractive.stage_critic(config, reader, os.path.join(stages, 'train_data'), str(tmp_path / 'teacher_summaries'),
                              str(tmp_path / 'teacher_critic'))
  for r, s in zip((json.loads(line) for line in open(tmp_path / 'teacher_critic' / 'dev.jsonl')), samples):
    texts = [t for t in s['samples'] if t]
    assert r['decision'] == ('filtered' if not texts else 'summary' if r['summary_loglik'] >= r['none_loglik'] else 'empty')
    assert r['decision'] != 'summary' or r['text'] == s['samples'][r['sample']]
  config.critic.targets = 'reader_sentence'
  compared = {(b['a'], b['b']) for b in results['bootstrap']}
  assert ('oracle_ll', 'none') in compared and ('top1', 'none') in compared and ('oracle_ll', 'top1') in compared
  assert ('trained', 'offtheshelf_sentence') in compared and ('trained', 'bm25_sentence') in compared
  assert ('abstractive', 'trained') in compared and ('abstractive', 'offtheshelf_sentence') in compared
  assert ('none', 'top1') not in compared and len(compared) == len(results['bootstrap']) == 7 + 6 + 4
  text = report.render_markdown(results)
  assert '| evidence | windows | perplexity |' in text and 'evaluated on 6 windows' in text
  again = runner.run(config, workdir)
  assert again['rows'] == results['rows'] and set(again['stage_seconds'].values()) == {0.0}
  assert [c['stage'] for c in again['stage_costs'] if not c['this_run']] == list(again['stage_seconds'])


@pytest.mark.parametrize('field, value, message', [
    ('lm.corpus', 'bing', "config.lm.corpus='bing' is not allowed (allowed: 'ovos', 'file', 'ovos+file')"),
    ('lm.corpus', 'file', 'retrieval.corpus_path is empty'),
    ('lm.wikitext_path', '/nonexistent/wiki.raw', '/nonexistent/wiki.raw: no such file (lm.wikitext_path)'),
    ('lm.max_prefix_tokens', 600, 'must fit in lm.max_context_tokens (512)'),
    ('lm.rows', ('none', 'gold'), "config.lm.rows: 'gold' is not allowed"),
])
def test_bad_lm_settings_fail_before_any_work(tmp_path, field, value, message):
  from recomp_jax.pipelines import runner, shared  # pylint: disable=import-outside-toplevel
  config = config_files.preset('wikitext_lm.py', 'ci')
  config.lm.wikitext_path = str(_write(tmp_path, RAW))
  section, name = field.split('.')
  config[section][name] = value
  from recomp_jax.config_fields import ConfigError  # pylint: disable=import-outside-toplevel
  with pytest.raises((shared.PipelineError, ConfigError), match=re.escape(message)):
    runner.run(config, str(tmp_path / 'run'))
  assert not os.path.exists(tmp_path / 'run' / 'stages')


def test_abstractive_compressor_config_takes_its_own_train_section_from_a_locked_config():
  """The fine-tuning path reads ``train.*``; the LM task's abstractive compressor trains with
  ``compressor_train.*`` on a copy, and the command line's config is locked (no new field)."""
  from recomp_jax.pipelines import lm_abstractive  # pylint: disable=import-outside-toplevel
  config = config_files.preset('wikitext_lm.py', 'shared_abstractive')
  config.lock()
  c = lm_abstractive.compressor_config(config)
  assert (c.train.learning_rate, c.train.batch_size, c.train.epochs) == (1e-4, 16, 1.0)
  assert (config.train.learning_rate, config.train.batch_size) == (2e-5, 32)  # the encoder's, untouched
  assert c.train.seeds == config.train.seeds and c.compressor_train.seeds == (0,)
