"""The abstractive compressor's critic (RECOMP Fig. 7 / Fig. 3): which teacher summaries become
targets, which become the empty summary, which examples are dropped."""

import numpy as np

from recomp_jax.compressors import abstractive
from recomp_jax.data.schema import FilterReport
from recomp_jax.evaluation import qa_metrics
from recomp_jax.reader import prompts


class LastWordReader:
  """A deterministic stand-in reader: answers with the last word of the evidence, and with
  'unknown' when there is none, except for questions ending in '!' (it knows those)."""

  def __init__(self):
    self.calls = []

  def exact_match(self, prompt_texts, answers):
    self.calls.append(('em', len(prompt_texts)))
    predictions = []
    for p in prompt_texts:
      body = p[len(prompts.FEW_SHOT_PREFIX):]
      evidence, _, rest = body.rpartition('\n\n')
      question = rest.split('\nAnswer:')[0]
      if question.endswith('!') and not evidence:
        predictions.append(question.rstrip('!').split()[-1])
      else:
        predictions.append(evidence.rstrip('.').split()[-1] if evidence else 'unknown')
    return {'predictions': predictions, **qa_metrics.qa_scores(predictions, answers)}

  def loglik(self, prefix, suffixes, targets):
    self.calls.append(('ll', len(suffixes)))
    return np.array([-float(len(s)) for s in suffixes])  # shorter evidence = more likely


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
