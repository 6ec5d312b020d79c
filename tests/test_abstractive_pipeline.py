"""RECOMP abstractive end to end: our server as the teacher, the critic with the real Gemma 3
270M reader, the compressor fine-tuned (Gemma 3 270M, then a tiny random T5 through the
same stages), the rows and the abstractive columns; plus the pieces on their own."""

import json
import os

import numpy as np
import pytest
from flax import nnx

from recomp_jax.data.schema import Example, Passage  # noqa: E402
from recomp_jax.evaluation import report  # noqa: E402
from recomp_jax.models import t5  # noqa: E402
from recomp_jax.pipelines import abstractive as pipeline  # noqa: E402
from recomp_jax.pipelines import runner as pipeline_runner  # noqa: E402
from recomp_jax.pipelines import shared  # noqa: E402
from recomp_jax.pretrained import Pretrained, export_pretrained  # noqa: E402
from recomp_jax.training.summaries import read_scalars  # noqa: E402
from tests.tiny_models import char_tokenizer, check_export_reproduces_the_trained_row, check_truncation_row  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _repo_on_path(monkeypatch):
  monkeypatch.syspath_prepend(REPO)


def _tiny_t5(vocab=128):
  config = t5.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                       num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                       feed_forward_proj='gated-gelu', tie_word_embeddings=False, scale_decoder_outputs=False,
                       pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
  return config, t5.T5Model(config, rngs=nnx.Rngs(0))


@pytest.fixture(scope='module')
def tiny_t5_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('t5') / 'tiny_t5')
  config, model = _tiny_t5()
  export_pretrained(Pretrained(model, config, t5.FAMILY, ''), directory, tokenizer_dir=None)
  char_tokenizer(128, seq2seq=True).save_pretrained(directory)
  return directory


def _config(workdir, **overrides):
  from configs.nq_abstractive import get_config
  config = get_config('ci')
  config.workdir = str(workdir)
  config.reader.generate_batch_size = 8
  config.update_from_flattened_dict(overrides)
  return config


@pytest.mark.end_to_end
@pytest.mark.parametrize('compressor', ['tiny_gemma', pytest.param('gemma3_270m', marks=pytest.mark.slow)])
def test_ci_pipeline_end_to_end_then_a_t5_compressor_on_the_same_targets(tmp_path, tiny_t5_dir, compressor, request):
  """The teacher, critic and reader are the real Gemma 3 270M; the compressor is a tiny random
  Gemma with the real tokenizer (fast tier) or the real one (slow tier, with the reader-sentence
  targets too)."""
  workdir = tmp_path / 'run'
  if compressor == 'tiny_gemma':  # every model tiny and random: the fast tier runs the stages, not the models
    tiny = request.getfixturevalue('tiny_gemma_dir')
    # A random reader gets every answer wrong: the critic decides by the answer's log-likelihood.
    overrides = {'compressor.model': tiny, 'reader.model': tiny, 'teacher.model': tiny, 'critic.both_wrong': 'loglik'}
  else:
    overrides = {}
  config = _config(workdir, **overrides)
  results = pipeline_runner.run(config, config.workdir)
  report.validate_results(json.loads(open(os.path.join(config.workdir, 'results.json')).read()))
  rows = {r['key']: r for r in results['rows']}
  assert set(rows) == {'none', 'top1', 'top5', 'teacher', 'trained', 'truncation', 'oracle'}
  assert all(r['n'] == 8 for r in rows.values()) and rows['none']['tokens'] == 0
  assert 0 < rows['teacher']['tokens'] <= 24 + 1  # teacher.max_tokens (reader tokens may differ by one)
  # The teacher: one request per question of every split, all answered by our server.
  teacher = results['stages']['teacher']
  assert teacher['local_server'] and teacher['uncached_at_start'] == 16 + 8 + 8
  assert results['teacher']['requests'] == 32 and results['teacher']['ok'] + sum(results['teacher']['failures'].values()) == 32
  # Table 5 agrees with the critic's records, and targets are never a failed request.
  critic = [json.loads(line) for line in open(workdir / 'stages' / 'critic' / 'train.jsonl')]
  kept = [r for r in critic if r['decision'] != 'filtered']
  assert results['table5']['train']['kept'] == len(kept) == results['train_questions'] > 0
  assert results['table5']['train']['filtered_percent'] == pytest.approx(100 * (16 - len(kept)) / 16)
  for r in kept:
    assert (r['text'] == '') == (r['decision'] == 'empty') and not r['teacher_failed']
    if r['summary_em'] == r['none_em'] == 0:  # both wrong: decided by log-likelihood (critic.both_wrong)
      assert config.critic.both_wrong == 'loglik'
    else:
      assert r['summary_em'] >= r['none_em'] if r['decision'] == 'summary' else r['summary_em'] < r['none_em']
  train = results['stages']['train_seed0']
  assert train['steps'] == 2 and train['examples'] == len(kept) and train['best'] is not None
  assert os.path.exists(workdir / 'stages' / 'train_seed0' / 'compressor_best' / 'config.json')
  # TensorBoard: the reader's EM / F1 with the compressor's dev summaries at each evaluation.
  scalars = read_scalars(workdir / 'stages' / 'train_seed0' / 'tensorboard')
  assert [step for step, _ in scalars['eval/qa_em']] == [2] == [step for step, _ in scalars['eval/loss']]
  # The probe: the reader's EM / F1 on the first train.eval_qa_examples dev questions with the
  # summaries of the step-2 model (the only evaluation, so the exported one).
  import recomp_jax
  from recomp_jax.evaluation import qa_metrics
  from recomp_jax.reader import prompts
  dev = shared.read_examples(str(workdir / 'stages' / 'retrieve' / 'dev.jsonl'))[:config.train.eval_qa_examples]
  summaries = recomp_jax.load_compressor(str(workdir / 'compressor')).compress([e.question for e in dev],
                                                                               [e.ctxs for e in dev])
  probe_reader = shared.Resources(config).reader
  expected = qa_metrics.qa_scores(probe_reader.answer([prompts.build_prompt(e.question, s) for e, s in zip(dev, summaries)]),
                                  [e.answers for e in dev])
  assert (scalars['eval/qa_em'][0][1], scalars['eval/qa_f1'][0][1]) == (pytest.approx(expected['em']),
                                                                        pytest.approx(expected['f1']))
  assert scalars['eval/qa_evidence_tokens'][0][1] == pytest.approx(np.mean([probe_reader.count_tokens(s) for s in summaries]))
  # The oracle row prepends a teacher summary exactly where the oracle file says so.
  oracle = {json.loads(line)['id']: json.loads(line) for line in open(workdir / 'stages' / 'evaluate' / 'oracle.jsonl')}
  predictions = [json.loads(line) for line in open(workdir / 'predictions.jsonl')]
  for p in predictions:
    if p['row'] == 'oracle':
      assert p['evidence'] == (oracle[p['id']]['summary'] if oracle[p['id']]['use_summary'] else '')
  (columns,) = [t for t in results['extra_tables'] if t['title'].startswith('Abstractive columns')]
  by_row = {r[0]: r for r in columns['rows']}
  assert by_row['none'][1] == '100.0' and by_row['top5'][1] == '0.0' and by_row['teacher'][2] != '-'
  # Selective augmentation: the trained row's empty summaries against the oracle row's (A.5).
  from recomp_jax.compressors import abstractive as method
  oracle_empty = {p['id']: not p['evidence'] for p in predictions if p['row'] == 'oracle'}
  trained = [p for p in predictions if p['row'] == 'trained@0']
  expected = method.selective_augmentation_f1([not p['evidence'] for p in trained],
                                              [oracle_empty[p['id']] for p in trained])
  assert by_row['trained@0'][2:4] == [f"{expected['f1']:.2f}", f"{expected['random_f1']:.2f}"]
  assert any('Critic (Table 5)' in n for n in results['notes'])
  # The exported compressor gives the trained row's summaries through the one inference call.
  check_export_reproduces_the_trained_row(workdir, 'trained@0')
  # The truncation row: the top documents cut to the trained row's mean tokens.
  check_truncation_row(workdir, shared.Resources(config).reader.tokenizer, config.candidates.top_docs)
  # A rerun is cached end to end: no server is started, nothing is recomputed.
  again = pipeline_runner.run(config, config.workdir)
  assert all(v == 0.0 for v in again['stage_seconds'].values()) and again['rows'] == results['rows']

  # The paper's seq2seq compressor (a tiny random T5 here) on the same teacher and critic stages,
  # and the extractive row beside it (MiniLM off the shelf standing in for a trained encoder).
  from recomp_jax.pretrained.demo import resolve_demo_model
  minilm = resolve_demo_model('', 'encoder')
  t5_config = _config(workdir, **{**overrides, 'compressor.model': tiny_t5_dir, 'train.num_steps': 3,
                                  'eval.extractive_encoder': minilm})
  t5_results = pipeline_runner.run(t5_config, t5_config.workdir)
  assert t5_results['stage_seconds']['teacher'] == 0 and t5_results['stage_seconds']['critic'] == 0
  assert t5_results['stages']['train_seed0']['steps'] == 3
  t5_scalars = read_scalars(os.path.join(t5_config.workdir, 'stages', 'train_seed0', 'tensorboard'))
  assert [step for step, _ in t5_scalars['eval/qa_em']][-2:] == [2, 3]
  best = os.path.join(t5_config.workdir, 'stages', 'train_seed0', 'compressor_best')
  assert json.load(open(os.path.join(best, 'config.json')))['model_type'] == 't5'
  t5_rows = {r['key']: r for r in t5_results['rows']}
  assert t5_rows['trained']['n'] == 8
  assert all(t5_rows[k] == rows[k] for k in ('none', 'top1', 'top5', 'teacher'))
  # Those four rows and the oracle's reads (no retrieval, teacher) were answered by the first run's
  # prediction cache: nothing the first run decoded is decoded again.
  cache = t5_results['stages']['evaluate']['prediction_cache']
  assert cache['path'] == os.path.join(str(workdir), 'reader_predictions.sqlite')
  assert cache['hits'] >= 4 * 8 + 2 * 8
  # The extractive row: per question, the candidate sentence that sentence-transformers' MiniLM
  # (the reference implementation) ranks first.
  assert t5_rows['extractive']['n'] == 8 and t5_rows['extractive']['tokens'] > 0
  from sentence_transformers import SentenceTransformer
  reference = SentenceTransformer(minilm, device='cpu')
  candidates = {r['id']: r['candidates'] for r in map(json.loads, open(workdir / 'stages' / 'candidates' / 'test.jsonl'))}
  questions = {r['id']: r['question'] for r in map(json.loads, open(workdir / 'stages' / 'data' / 'test.jsonl'))}
  extractive_rows = [p for p in (json.loads(line) for line in open(os.path.join(t5_config.workdir, 'predictions.jsonl')))
                     if p['row'] == 'extractive']
  assert len(extractive_rows) == 8
  for p in extractive_rows:
    cands = candidates[p['id']]
    scores = reference.encode([questions[p['id']]]) @ reference.encode(cands).T
    assert p['evidence'] == cands[int(np.argmax(scores))]

  if compressor == 'tiny_gemma':
    return
  # Beyond the paper: the reader's best candidate sentence as the critic's candidate target
  # (critic.targets='reader_sentence'); the teacher then summarises the test questions only.
  sentence_config = _config(workdir, **{**overrides, 'compressor.model': tiny_t5_dir, 'train.num_steps': 1,
                                        'critic.targets': 'reader_sentence'})
  sentence_results = pipeline_runner.run(sentence_config, sentence_config.workdir)
  stages_dir = workdir / 'stages'
  assert os.path.exists(stages_dir / 'teacher' / 'test.jsonl')
  assert not any(os.path.exists(stages_dir / 'teacher' / f'{split}.jsonl') for split in ('train', 'dev'))
  assert sentence_results['stages']['teacher']['uncached_at_start'] == 0  # test prompts: the first run's cache
  train_candidates = shared.load_candidates(str(stages_dir / 'candidates'), 'train')
  train_examples = {e.id: e for e in shared.read_examples(str(stages_dir / 'retrieve' / 'train.jsonl'))}
  chosen = {r['id']: r for r in map(json.loads, open(stages_dir / 'sentence_targets' / 'train.jsonl'))}
  assert set(chosen) == set(train_candidates)
  from recomp_jax.compressors import extractive
  from recomp_jax.reader import prompts
  reader = shared.Resources(sentence_config).reader
  for i, r in list(chosen.items())[:4]:  # the reader's log-likelihoods, recomputed one question at a time
    cands, e = train_candidates[i], train_examples[i]
    loglik = reader.loglik(prompts.FEW_SHOT_PREFIX, [extractive.candidate_suffix(c, e.question) for c in cands],
                           [prompts.answer_target(e.answers[0])] * len(cands))
    assert r['sentence'] == cands[int(np.argmax(loglik))]
    assert r['loglik'] == pytest.approx(float(np.max(loglik)), abs=1e-3)
  critic = {r['id']: r for r in map(json.loads, open(stages_dir / 'critic' / 'train.jsonl'))}
  for i, r in critic.items():
    if r['decision'] == 'summary':
      assert r['text'] == chosen[i]['sentence']
  summary = sentence_results['stages']['sentence_targets']['train']
  assert summary['questions'] == 16 and summary['without_candidates'] == 0
  assert any('Training targets (beyond the paper)' in n for n in sentence_results['notes'])
  sentence_rows = {r['key']: r for r in sentence_results['rows']}
  assert sentence_rows['teacher'] == rows['teacher'] and sentence_rows['trained']['n'] == 8


def _tiny_compressor(kind: str):
  """``(char tokenizer, untrained model)`` of a tiny T5 or Gemma compressor."""
  if kind == 't5':
    return char_tokenizer(128, seq2seq=True), _tiny_t5()[1]
  from tests.test_recipes import _gemma
  return char_tokenizer(128), _gemma()


@pytest.mark.parametrize('kind', ['t5', 'gemma'])
def test_empty_targets_train_the_compressor_to_say_nothing(tmp_path, kind):
  """Selective augmentation: trained on empty targets only, the compressor ends at once."""
  tokenizer, model = _tiny_compressor(kind)
  config = _config(tmp_path, **{'train.num_steps': 30, 'train.batch_size': 4, 'train.learning_rate': 1e-2,
                                'train.warmup_steps': 1, 'train.eval_every': 10, 'train.checkpoint_every': 0,
                                'compressor.max_source_length': 96, 'compressor.max_target_length': 16})
  pairs = [(f'Question: q{i}?\n Document: doc {i}\n Summary:', '') for i in range(8)]
  exported = []
  summary, model = pipeline.train_compressor(config, model, tokenizer, pairs, pairs[:4], seed=0,
                                             directory=str(tmp_path / 'train'), export=lambda m: exported.append(1))
  assert summary['steps'] == 30 and exported and summary['best']['metrics']['loss'] < 0.1
  evaluations = summary['evaluations']  # every dev evaluation is in the summary, not only the best
  assert [e['step'] for e in evaluations] == [10, 20, 30]
  losses = [e['metrics']['loss'] for e in evaluations]
  assert summary['best']['metrics']['loss'] == min(losses)
  assert {e['step']: e['metrics']['loss'] for e in evaluations}[summary['best']['step']] == min(losses)
  compressor = pipeline.Compressor(model, tokenizer, max_source_length=96, max_new_tokens=8, batch_size=4)
  docs = [[Passage(id='1', title='T', text='some text')]] * 3
  assert compressor.compress(['a?', 'b?', 'c?'], docs) == ['', '', '']


@pytest.mark.parametrize('kind', ['t5', 'gemma'])
def test_empty_threshold_lets_a_compressor_trained_on_some_empty_targets_write(tmp_path, kind):
  """A third of the targets empty, the rest six words with six first letters: greedy decoding
  stops at once on every question (stopping, ~1/3, beats each letter, ~1/9), the paper's
  failure for a weak compressor; ``empty_threshold=0.5`` writes a word, and a threshold
  below the stop mass empties it again."""
  tokenizer, model = _tiny_compressor(kind)
  config = _config(tmp_path, **{'train.num_steps': 40, 'train.batch_size': 9, 'train.learning_rate': 1e-2,
                                'train.warmup_steps': 1, 'train.eval_every': 40, 'train.checkpoint_every': 0,
                                'compressor.max_source_length': 96, 'compressor.max_target_length': 16,
                                'compressor.microbatch': 9})
  words = ['alpha', 'bravo', 'charlie', 'delta', 'echo', 'foxtrot']
  prompt = 'Question: q?\n Document: doc\n Summary:'
  pairs = [(prompt, target) for target in ['', '', ''] + words]
  _, model = pipeline.train_compressor(config, model, tokenizer, pairs, pairs, seed=0,
                                       directory=str(tmp_path / 'train'), export=lambda m: None)
  docs = [[Passage(id='1', title='T', text='doc')]] * 2

  def compress(threshold):
    return pipeline.Compressor(model, tokenizer, max_source_length=96, max_new_tokens=8, batch_size=2,
                               empty_threshold=threshold).compress(['q?', 'q?'], docs)
  assert compress(0.0) == ['', '']
  written = compress(0.5)
  assert all(text and text[0] in 'abcdef' for text in written), written
  assert compress(0.2) == ['', '']


def test_fit_documents_cuts_the_documents_not_the_question():
  tokenizer = char_tokenizer(128)
  passages = [Passage(id=str(i), title=f'T{i}', text='word ' * 40) for i in range(3)]
  prompt, cut = pipeline.fit_documents(tokenizer, 'who wrote it?', passages, 120)
  assert cut and prompt.startswith('Question: who wrote it?\n Document: T0\n') and prompt.endswith('\n Summary:')
  assert len(tokenizer(prompt, add_special_tokens=False)['input_ids']) <= 120
  short, cut = pipeline.fit_documents(tokenizer, 'q?', passages[:1], 1000)
  assert not cut and short == 'Question: q?\n Document: T0\n' + 'word ' * 40 + '\n Summary:'


def test_few_shot_demonstrations_come_from_training_questions_with_an_answer_sentence():
  def example(i, answer_in_docs):
    text = f'The answer is Alpha{i}. Other words.' if answer_in_docs else 'Nothing useful here.'
    return Example(id=f'q{i}', question=f'question {i}?', answers=[f'Alpha{i}'],
                   ctxs=[Passage(id=f'p{i}', title=f'Doc{i}', text=text)])
  train = [example(i, i % 2 == 0) for i in range(6)]
  block, ids = pipeline.few_shot_block('Q: {query} D: {docs} S:', train, 2, seed=0)
  assert len(ids) == 2 and all(int(i[1:]) % 2 == 0 for i in ids)
  for i in ids:
    assert f'Q: question {i[1:]}? D: Doc{i[1:]}\nThe answer is Alpha{i[1:]}. Other words. S: The answer is Alpha{i[1:]}.\n\n' in block
  assert pipeline.few_shot_block('{query}{docs}', train, 0, seed=0) == ('', [])


def test_the_teacher_summarises_only_what_a_row_or_the_critic_reads():
  """Paper targets: every split. Reader-sentence targets: the test split for the teacher and A.5
  oracle rows, and no teacher stage at all when ``eval.rows`` asks for neither."""
  from configs.nq_abstractive import get_config
  config = get_config('shared')
  assert config.critic.targets == 'reader_sentence' and pipeline.teacher_splits(config) == ('test',)
  config.eval.rows = ('none', 'top1', 'top5', 'trained', 'truncation')
  assert pipeline.teacher_splits(config) == ()
  config.eval.rows = ('trained', 'oracle')
  assert pipeline.teacher_splits(config) == ('test',)
  config.critic.targets = 'teacher'
  config.eval.rows = ('none',)
  assert pipeline.teacher_splits(config) == ('train', 'dev', 'test')
