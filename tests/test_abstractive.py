"""The abstractive compressor's critic (RECOMP Fig. 7 / Fig. 3): which teacher summaries become
targets, which become the empty summary, which examples are dropped."""

import numpy as np
import pytest

from recomp_jax.compressors import abstractive
from recomp_jax.data.schema import FilterReport
from recomp_jax.evaluation import qa_metrics
from recomp_jax.reader import prompts
from tests import config_files


class LastWordReader:
  """A deterministic stand-in reader: answers with the last word of the evidence, and with
  'unknown' when there is none, except for questions ending in '!' (it knows those)."""

  def __init__(self, few_shot=prompts.FEW_SHOT_PREFIX):
    self.calls = []
    self.few_shot = few_shot

  def prompt(self, question, evidence=None):
    return prompts.build_prompt(question, evidence, few_shot=self.few_shot)

  def exact_match(self, prompt_texts, answers):
    self.calls.append(('em', len(prompt_texts)))
    predictions = []
    for p in prompt_texts:
      assert p.startswith(self.few_shot)
      body = p[len(self.few_shot):]
      evidence, _, rest = body.rpartition('\n\n')
      question = rest.split('\nAnswer:')[0]
      if question.endswith('!') and not evidence:
        predictions.append(question.rstrip('!').split()[-1])
      else:
        predictions.append(evidence.rstrip('.').split()[-1] if evidence else 'unknown')
    return {'predictions': predictions, **qa_metrics.qa_scores(predictions, answers)}

  def loglik(self, prefix, suffixes, targets):
    assert prefix == self.few_shot  # the prompts' shared prefix is the reader's own
    self.calls.append(('ll', len(suffixes)))
    # Shorter evidence = more likely; evidence naming the answer = much more likely.
    return np.array([-float(len(s)) + (100.0 if t.strip() in s else 0.0)
                     for s, t in zip(suffixes, targets)])


def test_qa_decision_follows_figure_7():
  assert abstractive.qa_decision(1, 0) == 'summary'
  assert abstractive.qa_decision(1, 1) == 'summary'  # not worse than no retrieval
  assert abstractive.qa_decision(0, 1) == 'empty'
  assert abstractive.qa_decision(0, 0) == 'filtered'
  assert abstractive.lm_decision(-2.0, -3.0) == 'summary' and abstractive.lm_decision(-4.0, -3.0) == 'empty'


def test_critic_qa_targets_samples_and_report():
  questions = ['capital of france', 'say paris!', 'capital of italy', 'x', 'capital of spain']
  answers = [['Paris'], ['paris'], ['Rome'], ['Oslo'], ['Madrid']]
  summaries = [
      ['It is Paris.'],                        # right, no-retrieval wrong -> summary
      ['Maybe Lyon.'],                         # wrong, no-retrieval right -> empty
      ['Perhaps Milan.'],                      # both wrong -> filtered
      [None],                                  # the teacher failed -> filtered, counted
      ['Long text ends Madrid.', 'Madrid.', 'Toledo.'],  # two right: the likelier (shorter) one
  ]
  reader = LastWordReader()
  report = FilterReport('critic')
  targets = abstractive.critic_qa(reader, questions, answers, summaries, report=report,
                                  ids=['a', 'b', 'c', 'd', 'e'])
  assert [t.decision for t in targets] == ['summary', 'empty', 'filtered', 'filtered', 'summary']
  assert [t.text for t in targets] == ['It is Paris.', '', '', '', 'Madrid.']
  assert targets[4].sample == 1 and targets[1].none_em == 1.0 and targets[0].summary_em == 1.0
  assert dict(report.dropped) == {'both_wrong': 1, 'teacher_failed': 1} and report.kept == 3
  assert report.samples == {'both_wrong': ['c'], 'teacher_failed': ['d']}
  assert reader.calls == [('em', 5 + 6), ('ll', 3)]  # one batched EM call; LL only where samples compete
  assert abstractive.table5(targets) == {'n': 5, 'filtered_percent': 40.0,
                                         'empty_percent': 100.0 / 3, 'kept': 3}


@pytest.mark.parametrize('few_shot', [prompts.FEW_SHOT_PREFIX, prompts.few_shot_prefix([('is it yes', 'yes')])])
def test_critic_qa_can_decide_both_wrong_examples_by_log_likelihood(few_shot):
  """``both_wrong='loglik'``: the example the paper drops is kept when the summary makes the gold
  answer likelier than no retrieval, and becomes the empty target when it makes it less likely.
  Every prompt starts with the reader's own in-context block (``data.shots``), whichever it is."""
  questions = ['capital of italy', 'capital of spain', 'capital of france']
  answers = [['Rome'], ['Madrid'], ['Paris']]
  summaries = [['Near Rome lies Milan.'], ['Toledo.'], ['It is Paris.']]
  reader = LastWordReader(few_shot)
  paper = abstractive.critic_qa(reader, questions, answers, summaries)
  assert [t.decision for t in paper] == ['filtered', 'filtered', 'summary']
  reader = LastWordReader(few_shot)
  report = FilterReport('critic')
  relaxed = abstractive.critic_qa(reader, questions, answers, summaries, both_wrong='loglik',
                                  report=report)
  # Rome is named in its summary (likelier than no retrieval); Madrid is not in 'Toledo.'.
  assert [t.decision for t in relaxed] == ['summary', 'empty', 'summary']
  assert [t.text for t in relaxed] == ['Near Rome lies Milan.', '', 'It is Paris.']
  assert report.kept == 3 and not report.dropped
  assert reader.calls[-1] == ('ll', 4)  # one batched call: 2 with summary + 2 without
  with pytest.raises(ValueError, match='both_wrong must be one of'):
    abstractive.critic_qa(reader, questions, answers, summaries, both_wrong='keep')


def test_selective_augmentation_f1_counts_empty_as_the_positive_class():
  predicted = [True, True, False, False, True]
  oracle = [True, False, True, False, False]
  sel = abstractive.selective_augmentation_f1(predicted, oracle)
  assert sel['precision'] == 1 / 3 and sel['recall'] == 1 / 2
  assert abs(sel['f1'] - 2 * (1 / 3) * (1 / 2) / (1 / 3 + 1 / 2)) < 1e-12
  assert sel['oracle_empty_rate'] == 0.4 == sel['random_f1']
  assert abstractive.selective_augmentation_f1([False] * 3, [False] * 3)['f1'] == 0.0


def test_faithfulness_aid_is_the_share_of_content_words_in_the_documents():
  docs = 'Paris is the capital of France. It has 2 million people.'
  assert abstractive.faithfulness_aid('The capital is Paris.', docs) == 1.0
  # content words: capital, berlin (stopwords 'the', 'is' do not count)
  assert abstractive.faithfulness_aid('The capital is Berlin.', docs) == 0.5
  assert abstractive.faithfulness_aid('', docs) is None and abstractive.faithfulness_aid('the of', docs) is None


def test_oracle_prepends_the_summary_unless_it_does_worse_than_nothing():
  assert abstractive.oracle_choice(1, 0) and abstractive.oracle_choice(1, 1) and abstractive.oracle_choice(0, 0)
  assert not abstractive.oracle_choice(0, 1)


def test_critic_lm_picks_the_prompt_whose_summary_the_reader_continues_best(gemma3_hf_dir):
  from recomp_jax.reader.reader import Reader
  reader = Reader(gemma3_hf_dir, score_batch_size=8)
  prefixes = ['The Eiffel Tower is located in the city of', 'The largest planet of the Solar System is']
  continuations = [' Paris, France.', ' Jupiter.']
  summaries = [
      ['Bananas are yellow fruit.', 'The Eiffel Tower is a wrought-iron tower in Paris, France.', None],
      ['Ice cream melts in the sun.', 'A sentence about cooking pasta.'],
  ]
  targets = abstractive.critic_lm(reader, prefixes, continuations, summaries)
  assert targets[0].decision == 'summary' and targets[0].sample == 1
  assert targets[0].text == summaries[0][1] and targets[0].summary_em > targets[0].none_em
  for t, samples, prefix, continuation in zip(targets, summaries, prefixes, continuations):
    # The chosen score is the best summary's, and matches the reader scored directly.
    direct = reader.loglik('', [f'{s}\n\n{prefix}' for s in samples if s], [continuation] * sum(map(bool, samples)))
    assert abs(t.summary_em - float(max(direct))) < 1e-3
    assert (t.decision == 'empty') == (t.summary_em < t.none_em)
  assert abstractive.critic_lm(reader, prefixes[:1], continuations[:1], [[None]])[0].decision == 'filtered'


def test_compressor_prompt_is_the_papers_and_keeps_literal_braces():
  assert abstractive.compressor_prompt('who {x}?', 'Doc {docs}') == 'Question: who {x}?\n Document: Doc {docs}\n Summary:'


def test_reader_best_sentences_pick_the_candidate_the_reader_scores_highest():
  """Beyond the paper (``critic.targets='reader_sentence'``): per question the candidate with the
  highest log-likelihood of the first gold answer; None for a question without candidates."""
  reader = LastWordReader()
  questions = ['capital of france', 'capital of italy', 'nothing retrieved']
  candidates = [['Lyon is large.', 'Paris is the capital of France.', 'Paris.'],
                ['Milan is rich.', 'Turin.'],
                []]
  answers = [['Paris', 'paris'], ['Rome'], ['x']]
  best = abstractive.reader_best_sentences(reader, questions, candidates, answers)
  # The stand-in scores -len(suffix) + 100 when the answer is in it: the shorter answer-bearing one.
  assert [b['sentence'] for b in best] == ['Paris.', 'Turin.', None]
  assert [b['candidates'] for b in best] == [3, 2, 0]
  assert best[0]['loglik'] > best[0]['none_loglik'] and best[1]['loglik'] < best[1]['none_loglik']
  assert best[2]['loglik'] is None and reader.calls == [('ll', 3 + 2 + 0 + 3)]


def test_trained_row_names_its_target_source():
  """Audit (issue 57): with reader-sentence targets the row used to read as the paper's compressor."""
  from recomp_jax.pipelines import abstractive as pipeline  # pylint: disable=import-outside-toplevel
  system, config = pipeline.AbstractiveSystem(), config_files.preset('nq_abstractive.py', 'shared')
  names = {}
  for targets in abstractive.TARGET_SOURCES:
    config.critic.targets = targets
    names[targets] = system.row_name('trained', config)
  assert names == {'teacher': "RECOMP abstractive, trained compressor (teacher summaries, the paper's targets)",
                   'reader_sentence': "RECOMP abstractive, trained compressor (the reader's best sentences as "
                                      'targets, beyond the paper)'}
  assert system.row_name('top1', config) == 'top-1 document'
