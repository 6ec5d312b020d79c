"""Scoring (EM/F1/has_answer/bootstrap), the protocol prompt strings, text-only baselines."""

import gzip
import json
import pathlib

import numpy as np
import pytest

from recomp_jax.compressors import baselines
from recomp_jax.data.schema import Passage
from recomp_jax.evaluation import qa_metrics
from recomp_jax.reader import prompts

SHARED = pathlib.Path(__file__).resolve().parents[1].parent / 'shared' / 'data'

# ----------------------------------------------------------------------------- EM / F1


@pytest.mark.parametrize('raw, norm', [
    ('The Quick, Brown fox!', 'quick brown fox'),
    ('  a  cat   an apple  the end ', 'cat apple end'),
    ("Alfred, Lord Tennyson", 'alfred lord tennyson'),
    ('Theatre', 'theatre'),  # 'the' only as a whole word
    ('U.S.A.', 'usa'),
    ('', ''),
])
def test_normalize_answer(raw, norm):
  assert qa_metrics.normalize_answer(raw) == norm


def test_exact_match_and_f1_squad_cases():
  em, f1 = qa_metrics.exact_match, qa_metrics.f1_score
  assert em('the Denver Broncos', ['Denver Broncos', 'Broncos']) == 1.0
  assert em('Denver Broncos!', 'denver broncos') == 1.0
  assert em('Denver', ['Denver Broncos']) == 0.0
  assert f1('Denver Broncos won', ['Denver Broncos']) == pytest.approx(0.8)  # P 2/3, R 1
  assert f1('Broncos', ['Denver Broncos', 'Broncos']) == 1.0  # max over answers
  assert f1('Santa Clara, California', ['Levi\'s Stadium', 'Santa Clara']) == pytest.approx(0.8)
  assert f1('the the the', ['a']) == 1.0  # both normalise to empty
  assert f1('', ['Denver']) == 0.0 and f1('Denver', []) == 0.0
  # repeated tokens are clipped by the gold counts
  assert f1('paris paris', ['paris']) == pytest.approx(2 * 0.5 * 1 / 1.5)
  scores = qa_metrics.qa_scores(['Denver Broncos', 'x', 'Broncos won'],
                                [['Denver Broncos'], ['y'], ['Broncos']])
  assert scores['n'] == 3 and scores['em'] == pytest.approx(100 / 3)
  assert scores['f1'] == pytest.approx(100 * (1 + 0 + 2 / 3) / 3)
  np.testing.assert_array_equal(scores['em_per_example'], [1, 0, 0])
  with pytest.raises(ValueError):
    qa_metrics.qa_scores(['a'], [])


def test_has_answer():
  ha = qa_metrics.has_answer
  assert ha("intercepted quarterback Brad Johnson's pass", ['Brad Johnson'])
  assert ha('in the northern Indian Ocean', ['the Indian Ocean'])
  assert ha('lithium-ion batteries', ['Lithium'])
  assert not ha('narrator—Orwell, writing', ['Orwell'])  # em dash is not ASCII punctuation
  assert not ha('the 2003–04 season', ['2003'])
  assert not ha('Parisian cafes', ['Paris'])  # whole tokens only
  assert ha('Paris.', 'paris') and not ha('anything', ['', 'the'])


def test_has_answer_reproduces_shared_flags():
  path = SHARED / 'nq' / 'train2105_bm25top20.jsonl.gz'
  if not path.exists():
    pytest.skip(f'real data not found: {path} (the shared data folder is absent)')
  agree = total = 0
  with gzip.open(path, 'rt', encoding='utf-8') as f:
    for line in f:
      rec = json.loads(line)
      for ctx in rec['ctxs']:
        agree += qa_metrics.has_answer(ctx['text'], rec['answers']) == ctx['has_answer']
        total += 1
  assert total == 42100 and agree == total


# ----------------------------------------------------------------------------- bootstrap


def test_paired_bootstrap_basic():
  a = np.array([1, 1, 0, 1, 0, 1, 1, 0, 1, 1], dtype=float)
  b = np.array([0, 1, 0, 0, 0, 1, 0, 0, 1, 0], dtype=float)
  r = qa_metrics.paired_bootstrap(a, b, n_resamples=5000, seed=0)
  assert r.diff == pytest.approx(0.4) and r.low <= r.diff <= r.high
  assert r.low > 0 and r.p_value < 0.05
  assert qa_metrics.paired_bootstrap(a, b, n_resamples=5000, seed=0) == r
  f1_a, f1_b = np.random.default_rng(0).random((2, 10))  # continuous scores
  by_seed = [qa_metrics.paired_bootstrap(f1_a, f1_b, n_resamples=2000, seed=s) for s in range(3)]
  assert len({r.low for r in by_seed}) == 3  # the seed drives the resampling
  same = qa_metrics.paired_bootstrap(a, a, n_resamples=100)
  assert (same.diff, same.low, same.high, same.p_value) == (0.0, 0.0, 0.0, 1.0)
  # chunking does not change the draws' distribution shape: bounds stay close
  r2 = qa_metrics.paired_bootstrap(a, b, n_resamples=5000, seed=0, chunk=333)
  assert abs(r2.low - r.low) <= 0.1 and abs(r2.high - r.high) <= 0.1
  with pytest.raises(ValueError):
    qa_metrics.paired_bootstrap(a, b[:3])


def test_paired_bootstrap_covers_true_difference():
  """Two correlated Bernoulli systems with a known EM gap of 0.08."""
  rng = np.random.default_rng(123)
  n, trials, true_diff = 400, 200, 0.08
  covered = 0
  for t in range(trials):
    u = rng.random(n)
    a = (u < 0.40).astype(float)  # system A correct w.p. 0.40
    b = (u < 0.32).astype(float)  # system B correct w.p. 0.32, nested in A's successes
    flip = rng.random(n) < 0.1  # some independent noise, same marginal shift for both
    a[flip], b[flip] = (rng.random(flip.sum()) < 0.40), (rng.random(flip.sum()) < 0.32)
    r = qa_metrics.paired_bootstrap(a, b, n_resamples=1000, seed=t)
    covered += r.covers(true_diff)
  # nominal 95%; with 200 trials the observed rate is within ~3 standard errors
  assert 0.90 <= covered / trials <= 0.99


def test_token_helpers():
  assert qa_metrics.mean_tokens([10, 20, 30]) == 20.0 and qa_metrics.mean_tokens([]) == 0.0
  assert qa_metrics.token_ratio([37, 38], [660, 640]) == pytest.approx(75 / 1300)
  assert qa_metrics.token_ratio([1], [0]) == 0.0
  with pytest.raises(ValueError):
    qa_metrics.token_ratio([1, 2], [3])


# ----------------------------------------------------------------------------- prompts

EXPECTED_FEW_SHOT = (
    'who won a million on deal or no deal\nAnswer: Tomorrow Rodriguez\n\n'
    'who is the woman washing the car in cool hand luke\nAnswer: Joy Harmon\n\n'
    'who is the actor that plays ragnar on vikings\nAnswer: Travis Fimmel\n\n'
    "who said it's better to have loved and lost\nAnswer: Alfred, Lord Tennyson\n\n"
    'name the first indian woman to be crowned as miss world\nAnswer: Reita Faria\n\n')


def test_prompt_strings_exact():
  assert prompts.FEW_SHOT_PREFIX == EXPECTED_FEW_SHOT
  q = 'who got the first nobel prize in physics'
  assert prompts.build_prompt(q) == EXPECTED_FEW_SHOT + q + '\nAnswer:'
  assert prompts.build_prompt(q, '') == prompts.build_prompt(q)
  ev = 'Nobel Prize: The first prize went to Wilhelm Röntgen.'
  assert prompts.build_prompt(q, ev) == EXPECTED_FEW_SHOT + ev + '\n\n' + q + '\nAnswer:'


def test_evidence_formatting_best_last():
  docs = [Passage('1', 'Best', 'best text'), Passage('2', 'Second', 'second text'),
          Passage('3', 'Third', 'third text')]
  assert prompts.format_documents(docs) == ('Third\nthird text\nSecond\nsecond text\n'
                                            'Best\nbest text')
  assert prompts.format_documents(docs[:1]) == 'Best\nbest text'
  assert prompts.format_sentences(['T: best.']) == 'T: best.'
  assert prompts.format_sentences(['T: best.', 'U: second.']) == 'U: second.\nT: best.'
  assert prompts.answer_target('Joy Harmon') == ' Joy Harmon'


def test_postprocess_answer():
  assert prompts.postprocess_answer(' Wilhelm Röntgen\n\nwho is') == 'Wilhelm Röntgen'
  assert prompts.postprocess_answer('\nWilhelm') == ''  # starts with a newline: empty
  assert prompts.postprocess_answer('  1901  ') == '1901'


# ----------------------------------------------------------------------------- baselines

# RECOMP Table 12 (WikiText example): the input x, then the top-1 document as printed.
PAPER_X = ('present in most of the Mediterranean Sea, only missing from the section east of '
           'Crete, and along only the north @-@ west coast of the Black Sea')
PAPER_DOC = (
    'Sea of Crete” Sea of Crete The Sea of Crete (, ””Kritiko Pelagos””) or Cretan Sea, is a '
    'sea, part of the Aegean Sea, located in its Southern extremity. The sea stretches to the '
    'North of the island of Crete, East of the islands of Kythera and Antikythera, South of the '
    'Cyclades, and West of the Dodecanese islands of Rhodes, Karpathos and Kassos. The bounding '
    'sea to the West is the Ionian Sea. To the Northwest is the Myrtoan Sea, a subdivision of '
    'the Mediterranean Sea that lies between the Cyclades and Peloponnese. To the East-SE is '
    'the rest of the Mediterranean Sea,')
PAPER_BOW = (
    'present Mediterranean Sea missing section east Crete along north west coast Black The '
    'Kritiko Pelagos Cretan sea part Aegean located Southern extremity stretches North island '
    'East islands Kythera Antikythera South Cyclades West Dodecanese Rhodes Karpathos Kassos '
    'bounding Ionian To Northwest Myrtoan subdivision lies Peloponnese SE rest')
# The paper's spaCy NE output for the same input (an unordered set in the paper).
PAPER_NE = {'Kythera', 'the Aegean Sea', 'the Ionian Sea', 'Crete', 'Southern', 'South',
            'Rhodes', 'the Myrtoan Sea', 'Cretan Sea', 'Antikythera', 'Dodecanese', 'Kassos',
            'Karpathos', 'West', 'the Black Sea', 'Sea of Crete', 'Peloponnese',
            'the Mediterranean Sea', 'Cyclades'}


def test_bow_reproduces_paper_example():
  assert baselines.bag_of_words(PAPER_X + ' ' + PAPER_DOC) == PAPER_BOW
  assert baselines.bag_of_words(PAPER_X, max_words=3) == 'present Mediterranean Sea'
  assert len(baselines.ENGLISH_STOPWORDS) == 179


def test_bow_compress_documents():
  docs = [Passage('1', 'Dune', 'Dune is a novel by Frank Herbert.'),
          Passage('2', 'Frank Herbert', 'Frank Herbert wrote Dune in 1965.')]
  assert baselines.bow_compress(docs) == 'Dune novel Frank Herbert wrote 1965'
  assert baselines.bow_compress(docs, include_title=False) == 'Dune novel Frank Herbert wrote 1965'
  assert baselines.bow_compress(docs[1:]) == 'Frank Herbert wrote Dune 1965'


def test_named_entities():
  text = ('Barack Obama was born in Honolulu, Hawaii on August 4, 1961. The Sea of Crete is '
          'part of the Aegean Sea. He met Angela Merkel in Berlin in December 2007. Although '
          'it rained, J. R. R. Tolkien wrote about the Bank of the United States, although.')
  assert baselines.extract_entities(text) == [
      'Barack Obama', 'Honolulu', 'Hawaii', 'August 4, 1961', 'Sea of Crete', 'Aegean Sea',
      'Angela Merkel', 'Berlin', 'December 2007', 'J. R. R. Tolkien', 'Bank of the United States']
  ours = set(baselines.extract_entities(PAPER_X + '\n' + PAPER_DOC))
  paper = {e[4:] if e.startswith('the ') else e for e in PAPER_NE}
  # the heuristic recovers every spaCy entity of the paper's example (modulo 'the')
  assert paper <= ours and len(ours - paper) <= 6
  docs = [Passage('1', 'Dune', 'Dune is a novel by Frank Herbert.')]
  assert baselines.extract_entities('Dune\nDune is a novel by Frank Herbert.') == [
      'Dune', 'Frank Herbert']  # the title line does not merge into the text
  assert baselines.ne_compress(docs) == 'Dune Frank Herbert'
  assert baselines.ne_compress(docs, sep=', ', max_entities=1) == 'Dune'


def test_random_sentence_seeded():
  lists = [[f's{i}-{j}' for j in range(20)] for i in range(50)]
  first = baselines.random_sentences(lists, seed=0)
  assert first == baselines.random_sentences(lists, seed=0)
  assert first != baselines.random_sentences(lists, seed=1)
  assert all(s in c for s, c in zip(first, lists))
  assert len(set(s.split('-')[1] for s in first)) > 5  # not always the same position
  keys = [f'id{i}' for i in range(50)]
  keyed = baselines.random_sentences(lists, seed=0, keys=keys)
  rev = baselines.random_sentences(lists[::-1], seed=0, keys=keys[::-1])
  assert keyed == rev[::-1]  # keyed draws survive reordering
  assert baselines.random_sentences([[]], seed=0) == ['']
  # uniform: each of 4 candidates drawn about a quarter of the time
  draws = baselines.random_sentences([['a', 'b', 'c', 'd']] * 4000, seed=7)
  counts = np.array([draws.count(x) for x in 'abcd'])
  assert np.all(np.abs(counts - 1000) < 120)


# ----------------------------------------------------------------------------- the training probe


class _EchoReader:
  """A reader stand-in for the probe's bookkeeping: answers the prompt's last evidence word."""

  def __init__(self):
    self.calls = []

  few_shot = prompts.FEW_SHOT_PREFIX

  def prompt(self, question, evidence=None):
    return prompts.build_prompt(question, evidence, few_shot=self.few_shot)

  def answer(self, prompt_texts):
    self.calls.append(list(prompt_texts))
    return [p.split('\n\n')[-2].split()[-1] if '\n\n' in p[len(self.few_shot):] else 'none'
            for p in prompt_texts]

  def count_tokens(self, text):
    return len(text.split())


def test_qa_probe_scores_memoises_and_checks_lengths():
  from recomp_jax.data.schema import Example
  from recomp_jax.evaluation.probe import QaProbe, probe_examples
  examples = probe_examples([Example('a', 'who?', ['Paris']), Example('b', 'what?', ['blue sky']),
                             Example('c', 'ignored', ['x'])], 2)
  assert [e.id for e in examples] == ['a', 'b']
  reader = _EchoReader()
  made = []
  probe = QaProbe(lambda: made.append(1) or reader, examples)
  assert not made  # the reader is loaded at the first evaluation, not before
  first = probe(['it is Paris', 'the sky'])
  assert first['qa_em'] == 50.0 and first['qa_f1'] == pytest.approx(100 * (1 + 2 / 3) / 2)
  assert first['qa_evidence_tokens'] == 2.5 and probe.generated == 2
  second = probe(['it is Paris', 'blue'])  # one prompt unchanged: one generation
  assert probe.generated == 3 and len(reader.calls[-1]) == 1 and made == [1]
  assert second['qa_em'] == 50.0 and second['qa_f1'] == pytest.approx(100 * (1 + 2 / 3) / 2)
  assert probe(['', 'Paris'])['qa_em'] == 0.0  # '' is the no-evidence prompt
  with pytest.raises(ValueError, match='3 evidence texts for 2 probe questions'):
    probe(['a', 'b', 'c'])
  assert len(QaProbe(reader, probe_examples(examples, 0))) == 0
