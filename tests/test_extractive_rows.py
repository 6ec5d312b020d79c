"""What each evaluation row reads, candidate caps, reranking of given documents and the EM oracle.

The row fixture is three hand-made questions whose right evidence for every row is known
by construction; the pipeline's row builder is asserted against it.
"""

import os

import numpy as np
import pytest

from recomp_jax.compressors import extractive
from recomp_jax.data import formats
from recomp_jax.data.schema import Example, Passage
from recomp_jax.data.sentences import build_candidates
from recomp_jax.evaluation import qa_metrics
from recomp_jax.pipelines import extractive as pipeline
from recomp_jax.pipelines import encoder_training, shared
from recomp_jax.reader import prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(os.path.dirname(REPO), 'shared', 'data')


def _doc(i, title, text, **flags):
  return Passage(f'd{i}', title, text, **flags)


# Question 0: NQ-like, documents ranked, the answer sentence is in the third document.
Q0 = Example('q0', 'what is the capital city of australia', ['Canberra'], ctxs=[
    _doc(0, 'Sydney', 'Sydney is the largest city in Australia. It hosts the opera house.'),
    _doc(1, 'Melbourne', 'Melbourne was the seat of government until 1927. It is in Victoria.'),
    _doc(2, 'Canberra', 'Canberra is the capital city of Australia. It lies in the ACT.'),
    _doc(3, 'Perth', 'Perth is on the west coast. It is isolated.'),
    _doc(4, 'Hobart', 'Hobart is in Tasmania. It is small.'),
    _doc(5, 'Darwin', 'Darwin is in the north. It is never read by any row.'),
])
# Question 1: HotpotQA-like: two supporting paragraphs flagged is_gold.
Q1 = Example('q1', 'which river flows through prague',
             ['Vltava'], ctxs=[
                 _doc(10, 'Bedrich Smetana', 'Smetana composed the Moldau. He was born in Litomysl.',
                      is_gold=True),
                 _doc(11, 'Prague', 'The Vltava river flows through Prague. Prague is old.', is_gold=True),
                 _doc(12, 'Vienna', 'The Danube flows through Vienna. Vienna has palaces.', is_gold=False),
             ])
# Question 2: gold passage known but not retrieved (NQ protocol: the gold row skips it).
Q2 = Example('q2', 'hamlet was written by whom', ['William Shakespeare'], ctxs=[
    _doc(20, 'Hamlet', 'Hamlet is a tragedy. It was written by William Shakespeare around 1600.',
         is_gold=False),
    _doc(21, 'Macbeth', 'Macbeth is another tragedy. It is short.', is_gold=False),
], gold_ctx=Passage('g2', 'Shakespeare', 'William Shakespeare wrote Hamlet.'))
EXAMPLES = [Q0, Q1, Q2]
CANDIDATES = [[c.text for c in build_candidates(e.ctxs, top_docs=5, max_candidates=None)] for e in EXAMPLES]
ANSWER_SENTENCE = ['Canberra: Canberra is the capital city of Australia.',
                   'Prague: The Vltava river flows through Prague.',
                   'Hamlet: It was written by William Shakespeare around 1600.']


def _loglik():
  """Hand-set reader log-likelihoods: the answer sentence is the most likely in each question."""
  out = []
  for cands, best in zip(CANDIDATES, ANSWER_SENTENCE):
    ll = -5.0 - np.arange(len(cands), dtype=float) * 0.1
    ll[cands.index(best)] = -0.5
    out.append(ll.tolist())
  return out


def rows(key, k=1, **kwargs):
  return pipeline.build_evidence(key, EXAMPLES, CANDIDATES, k=k, **kwargs)


def test_fixture_candidates_cover_exactly_the_top_five_documents():
  assert len(CANDIDATES[0]) == 10  # two sentences from each of the first five documents
  assert not any('Darwin' in c for c in CANDIDATES[0])


def test_document_rows_put_the_best_document_last():
  assert rows('none') == ['', '', '']
  assert rows('top1')[0] == 'Sydney\nSydney is the largest city in Australia. It hosts the opera house.'
  top5 = rows('top5')[0].split('\n')
  assert top5[::2] == ['Hobart', 'Perth', 'Canberra', 'Melbourne', 'Sydney'] and 'Darwin' not in top5


def test_lead_sentence_row_is_the_first_sentence_of_the_top_document():
  assert rows('lead') == ['Sydney: Sydney is the largest city in Australia.',
                          'Bedrich Smetana: Smetana composed the Moldau.',
                          'Hamlet: Hamlet is a tragedy.']


def test_bm25_sentence_row_picks_the_lexical_match():
  assert rows('bm25_sentence') == ANSWER_SENTENCE


def test_encoder_rows_rank_with_the_given_encoder():
  from recomp_jax.pretrained.demo import resolve_demo_model
  from recomp_jax.models.dual_encoder import Encoder
  encoder = Encoder.from_pretrained(resolve_demo_model('', 'encoder'), normalize=True)
  rank = lambda qs, cs: extractive.rank_candidates(encoder, qs, cs)  # noqa: E731
  for key in ('offtheshelf_sentence', 'trained'):
    assert rows(key, rank=rank)[0] == ANSWER_SENTENCE[0]
  with pytest.raises(ValueError, match='encoder'):
    rows('trained')
  # compress(): the same ranking as the trained row, '' for a question without candidates.
  questions = [e.question for e in EXAMPLES]
  assert extractive.compress(encoder, questions, CANDIDATES, k=1) == rows('trained', rank=rank)
  assert extractive.compress(encoder, questions[:1], [[]], k=1) == ['']


def test_oracle_rows_follow_the_reader_labels():
  loglik = _loglik()
  assert rows('oracle_ll', loglik=loglik) == ANSWER_SENTENCE
  # EM oracle: the chosen candidate (the reader was correct with it), or max-LL when none was.
  choice = [CANDIDATES[0].index('Perth: It is isolated.'), -1, 0]
  em_rows = rows('oracle_em', loglik=loglik, oracle_em_choice=choice)
  assert em_rows == ['Perth: It is isolated.', ANSWER_SENTENCE[1], CANDIDATES[2][0]]
  # k = 2: the choice, then the most likely other candidate; best last.
  two = rows('oracle_em', k=2, loglik=loglik, oracle_em_choice=choice)[0]
  assert two == prompts.format_sentences(['Perth: It is isolated.', ANSWER_SENTENCE[0]])


def test_gold_row_uses_every_supporting_passage_and_skips_unretrieved_gold():
  gold = rows('gold')
  assert gold[0] is None  # Q0 has neither flags nor a gold passage
  assert gold[1] == prompts.format_documents(Q1.ctxs[:2])  # both supporting paragraphs
  assert gold[2] is None  # flagged, but the gold passage was not retrieved
  unflagged = Example('u', 'q', ['a'], ctxs=[Passage('p', 'T', 't')], gold_ctx=Q2.gold_ctx)
  assert pipeline.build_evidence('gold', [unflagged], [[]], k=1) == [
      prompts.format_documents([Q2.gold_ctx])]


def test_random_row_is_stable_under_reordering():
  a = rows('random_sentence', seed=3)
  b = pipeline.build_evidence('random_sentence', EXAMPLES[::-1], CANDIDATES[::-1], k=1, seed=3)
  assert a == b[::-1] and all(x in c for x, c in zip(a, CANDIDATES))
  two = rows('random_sentence', k=2, seed=3)
  assert all(len(x.split('\n')) == 2 for x in two)


def test_row_names_say_what_the_heuristics_are():
  assert 'heuristic' in pipeline.row_name('ne_capitalised') and 'capitalised' in pipeline.row_name('ne_capitalised')
  assert pipeline.row_name('bm25_sentence', 2) == 'BM25 top 2 sentences'


# ----------------------------------------------------------------------------- candidates and reranking


def test_inference_candidates_are_uncapped_and_training_capped(tmp_path):
  from configs.nq_extractive import get_config
  config = get_config('ci')
  config.candidates.max_candidates = 4
  retrieve = tmp_path / 'retrieve'
  retrieve.mkdir()
  for split in ('train', 'dev', 'test'):
    formats.write_examples(str(retrieve / f'{split}.jsonl'), [Q0])
  out = tmp_path / 'cands'
  out.mkdir()
  summary = shared.stage_candidates(config, str(retrieve), str(out))
  assert len(shared.load_candidates(str(out), 'train')['q0']) == 4
  assert shared.load_candidates(str(out), 'test')['q0'] == CANDIDATES[0]
  assert summary['test']['questions_over_training_cap'] == 1 and summary['test']['cap'] == 0
  assert summary['train']['dropped']['over_candidate_cap'] == 6


def test_bm25_rerank_orders_given_documents_by_the_question():
  shuffled = Example('h', 'which river flows through prague', ['Vltava'],
                     ctxs=[Q1.ctxs[2], Q1.ctxs[0], Q1.ctxs[1]])
  (ranked,) = shared.rerank_documents([shuffled], 'bm25')
  assert ranked.ctxs[0].title == 'Prague'
  assert sorted(p.id for p in ranked.ctxs) == sorted(p.id for p in shuffled.ctxs)


@pytest.mark.skipif(not os.path.exists(os.path.join(SHARED, 'hotpotqa')), reason='needs ../shared/data')
def test_bm25_rerank_raises_hotpotqa_supporting_recall_at_5():
  examples = formats.read_examples(os.path.join(SHARED, 'hotpotqa', 'dev500_ircot.jsonl'))
  before = shared.retrieval_recall(examples, 5)['supporting_recall@5']
  after = shared.retrieval_recall(shared.rerank_documents(examples, 'bm25'), 5)['supporting_recall@5']
  assert before == pytest.approx(51.5, abs=0.05)  # the first 5 of 10 unranked paragraphs
  assert after > before + 20  # measured 78.9


def test_hotpotqa_configs_rerank_before_taking_the_top_five():
  from configs.hotpotqa_extractive import get_config
  for preset in ('paper', 'shared'):
    c = get_config(preset)
    assert c.retrieval.rerank == 'bm25' and c.candidates.top_docs == 5 and c.dataset == 'hotpotqa'


def test_encoder_ranks_at_its_own_limit_and_counts_truncation():
  from configs.nq_extractive import get_config
  config = get_config('demo')
  models = shared.Resources(config)  # pylint: disable=protected-access
  encoder = models.encoder()
  assert encoder.max_length == 256  # MiniLM's sentence-transformers max_seq_length, not 64
  assert encoder_training.train_passage_length(config, encoder) == 64  # training pairs: bounded memory
  config.encoder.train_max_passage_length = 0
  assert encoder_training.train_passage_length(config, encoder) == 256
  texts = ['short one', 'word ' * 100]
  assert extractive.count_truncated(encoder.tokenizer, texts, 64) == 1
  assert extractive.count_truncated(encoder.tokenizer, texts, 256) == 0


# ----------------------------------------------------------------------------- EM oracle and EM labels


class EvidenceEchoReader:
  """A deterministic stand-in reader: answers with the last word of the evidence line.

  It exists to test the oracle search and the EM labelling loops, whose results must follow
  from the reader's answers whatever reader that is.
  """

  def __init__(self):
    self.calls = []

  few_shot = prompts.FEW_SHOT_PREFIX

  def prompt(self, question, evidence=None):
    return prompts.build_prompt(question, evidence, few_shot=self.few_shot)

  def answer(self, prompt_texts, *, max_new_tokens=None):
    self.calls.append((len(prompt_texts), max_new_tokens))
    predictions = []
    for p in prompt_texts:
      body = p[len(self.few_shot):]
      evidence = body.split('\n\n')[0] if '\n\n' in body else ''
      predictions.append(evidence.rstrip('.').split()[-1] if evidence else '')
    return predictions

  def exact_match(self, prompt_texts, answers, *, max_new_tokens=None):
    predictions = self.answer(prompt_texts, max_new_tokens=max_new_tokens)
    return {'predictions': predictions, **qa_metrics.qa_scores(predictions, answers)}

  def count_tokens(self, text):
    return len(text.split())


class _Holder:
  def __init__(self, reader):
    self.reader = reader


def test_em_oracle_takes_the_most_likely_correct_candidate_and_resumes(tmp_path):
  candidates = {'a': ['T: it is Paris.', 'T: maybe Lyon.', 'T: surely Paris.', 'T: Nice.'],
                'b': ['T: Rome.', 'T: Milan.'],
                'c': ['T: Oslo.'] * 3 + ['T: Bergen.']}
  labels = {'a': {'loglik': [-3.0, -1.0, -2.0, -4.0]},  # LL order: Lyon, surely Paris, it is Paris, Nice
            'b': {'loglik': [-1.0, -2.0]},
            'c': {'loglik': [-1.0, -2.0, -3.0, -4.0]}}
  examples = [Example('a', 'capital of france', ['Paris']), Example('b', 'x', ['Turin']),
              Example('c', 'y', ['Bergen'])]
  reader = EvidenceEchoReader()
  out = str(tmp_path / 'oracle.jsonl')
  choices = pipeline.oracle_em_choices(_Holder(reader), examples, candidates, labels, out)
  assert choices['a'] == {'id': 'a', 'choice': 2, 'tried': 2}  # 'surely Paris' beats 'it is Paris'
  assert choices['b']['choice'] == -1 and choices['b']['tried'] == 2
  assert choices['c']['choice'] == 3
  bounded = pipeline.oracle_em_choices(_Holder(reader), examples, candidates, labels,
                                       str(tmp_path / 'bounded.jsonl'), max_candidates=2)
  assert bounded['c']['choice'] == -1 and bounded['c']['tried'] == 2
  calls = len(reader.calls)
  again = pipeline.oracle_em_choices(_Holder(reader), examples, candidates, labels, out)
  assert again == choices and len(reader.calls) == calls  # finished questions are not read again


def test_threshold_tuning_answers_each_distinct_prompt_once():
  examples = [Example('a', 'capital of france', ['Paris']), Example('b', 'x', ['Turin']),
              Example('c', 'y', ['Bergen'])]
  candidates = [['T: it is Paris.', 'T: Lyon.'], ['T: Rome.', 'T: Turin.'], ['T: Oslo.']]
  scores = [np.array([0.9, 0.2]), np.array([0.3, 0.8]), np.array([0.5])]
  reader = EvidenceEchoReader()
  tuned = extractive.tune_threshold(reader, examples, candidates, scores, max_sentences=1,
                                  quantiles=(0.1, 0.5, 0.9))
  # thresholds 0.56 and 0.8 keep Paris and Turin (EM 66.7), 0.88 only Paris (33.3)
  assert [round(r['em'], 1) for r in tuned['table']] == [66.7, 66.7, 33.3]
  assert [round(r['empty_percent'], 1) for r in tuned['table']] == [33.3, 33.3, 66.7]
  assert tuned['threshold'] == tuned['table'][0]['threshold']  # tie: the first, same tokens
  assert reader.calls == [(4, None)]  # one call, 4 distinct prompts out of 9


def test_em_labels_use_the_configured_generation_limit():
  reader = EvidenceEchoReader()
  em = extractive.em_labels(reader, ['capital of france'], [['T: Paris.', 'T: Lyon.']], [['Paris']],
                            max_new_tokens=7)
  assert em == [[1.0, 0.0]] and reader.calls == [(2, 7)]


def test_f1_of_empty_prediction_against_empty_gold_is_one():
  assert qa_metrics.f1_score('', ['']) == 1.0
  assert qa_metrics.f1_score('', ['Paris']) == 0.0
