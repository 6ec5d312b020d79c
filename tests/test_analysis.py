"""Per-question analysis of a run's workdir (recomp_jax.evaluation.analysis) on a hand-made workdir."""

import json
import os

import pytest

from recomp_jax.evaluation import analysis

QUESTIONS = [  # id, answers, top-1 document, candidate sentences
    ('q0', ['Paris'], 'Paris is the capital of France.', ['Paris is the capital.', 'France is big.']),
    ('q1', ['1969'], 'The moon is far.', ['Apollo 11 landed in 1969.', 'The moon is far.']),
    ('q2', ['Everest'], 'K2 is high.', ['K2 is high.', 'Nothing here.']),
]
# row -> [(evidence, em)] per question
ROWS = {
    'top1': [(QUESTIONS[0][2], 1.0), (QUESTIONS[1][2], 0.0), (QUESTIONS[2][2], 0.0)],
    'trained@0': [('Paris is the capital.', 0.0), ('Apollo 11 landed in 1969.', 1.0), ('K2 is high.', 1.0)],
}


def _write(path, records):
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)


@pytest.fixture
def workdir(tmp_path):
  stages = tmp_path / 'stages'
  _write(str(stages / 'retrieve' / 'test.jsonl'),
         [{'id': i, 'question': '?', 'answers': a, 'ctxs': [{'title': '', 'text': doc}]} for i, a, doc, _ in QUESTIONS])
  _write(str(stages / 'candidates' / 'test.jsonl'), [{'id': i, 'candidates': c} for i, _, _, c in QUESTIONS])
  _write(str(tmp_path / 'predictions.jsonl'),
         [{'row': row, 'id': q[0], 'prediction': '', 'em': em, 'f1': em, 'tokens': 1, 'evidence': ev}
          for row, per_q in ROWS.items() for q, (ev, em) in zip(QUESTIONS, per_q)])
  return str(tmp_path)


def test_selection_and_reading_failures_are_separated(workdir):
  result = analysis.analyse(workdir)
  assert result['n'] == 3
  assert result['answer_in_top1_document'] == pytest.approx(1 / 3)
  assert result['answer_in_some_candidate'] == pytest.approx(2 / 3)  # nothing mentions Everest
  rows = {r['row']: r for r in result['rows']}
  trained = rows['trained@0']
  assert trained['answer_in_evidence'] == pytest.approx(2 / 3)
  assert trained['em_with_answer'] == pytest.approx(0.5)   # q0 read wrongly, q1 right
  assert trained['em_without_answer'] == pytest.approx(1.0)  # q2 right without the answer
  assert (trained['wins'], trained['losses']) == (2, 1)
  assert rows['top1']['em_with_answer'] == 1.0 and (rows['top1']['wins'], rows['top1']['losses']) == (0, 0)
  table = analysis.markdown(result)
  assert '| trained@0 | 3 | 66.7 | 50.0 | 100.0 | 2 | 1 |' in table


def test_bad_workdirs_are_one_clear_error(workdir, tmp_path, capsys):
  assert analysis.main([workdir, '--baseline', 'oracle']) == 2
  assert "no 'oracle' row" in capsys.readouterr().err
  with open(os.path.join(workdir, 'predictions.jsonl'), 'a') as f:
    f.write('{"row": \n')
  assert analysis.main([workdir]) == 2
  assert 'predictions.jsonl:7' in capsys.readouterr().err
  assert analysis.main([str(tmp_path / 'missing')]) == 2
