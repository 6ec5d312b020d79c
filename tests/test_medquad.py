"""MedQuAD files (K-COMP's data) and leave-own-answer-out retrieval."""

import gzip
import json
import os

import pytest

from recomp_jax.data import medquad
from recomp_jax.data.schema import DataError, Example, FilterReport, Passage
from recomp_jax.retrieval.exclusion import search_excluding
from tests import config_files

SHARED = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'shared', 'data')


def _write(path, rows):
  with gzip.open(path, 'wt', encoding='utf-8') as f:
    for r in rows:
      f.write((r if isinstance(r, str) else json.dumps(r)) + '\n')
  return str(path)


def _passage(pid, title, text, doc='GHR:1'):
  return {'id': pid, 'qa_id': pid.split('#')[0], 'doc_id': doc, 'title': title, 'qtype': 'information',
          'source': doc.split(':')[0], 'text': text}


def _question(qid, focus, own, question='What is (are) X ?', answer='X is a thing.'):
  return {'id': qid, 'doc_id': 'GHR:1', 'source': 'GHR', 'url': 'u', 'focus': focus, 'qtype': 'information',
          'question': question, 'answer': answer, 'own_passage_ids': own}


def test_reading_keys_passages_by_id_and_title_and_questions_by_id_and_focus(tmp_path):
  corpus = medquad.read_corpus(_write(tmp_path / 'c.jsonl.gz', [
      _passage('1-1#0', 'Polycythemia Vera', 'a'), _passage('1-1#0', 'Primary Myelofibrosis', 'b'),
      _passage('1-1#1', 'Polycythemia Vera', 'c')]))
  assert [(m.passage.id, m.passage.title, m.qa_id, m.index) for m in corpus] == [
      ('1-1#0', 'Polycythemia Vera', '1-1', 0), ('1-1#0', 'Primary Myelofibrosis', '1-1', 0),
      ('1-1#1', 'Polycythemia Vera', '1-1', 1)]
  questions = medquad.read_questions(_write(tmp_path / 'q.jsonl.gz', [
      _question('1-1', 'Polycythemia Vera', ['1-1#0', '1-1#1']), _question('1-1', 'Primary Myelofibrosis', ['1-1#0'])]))
  assert [e.id for e in questions] == ['1-1|Polycythemia Vera', '1-1|Primary Myelofibrosis']
  assert questions[0].answers == ['X is a thing.'] and questions[0].meta['own_passage_ids'] == ['1-1#0', '1-1#1']
  assert questions[0].meta['qa_id'] == '1-1' and questions[0].ctxs == []


@pytest.mark.parametrize('rows, message', [
    ([_passage('1-1#0', 'A', 'a'), _passage('1-1#0', 'A', 'b')], "c.jsonl.gz:2: field 'id': duplicate passage '1-1#0' of 'A'"),
    ([_passage('1-1', 'A', 'a')], "c.jsonl.gz:1: field 'id': expected 'QA_ID#k', got '1-1'"),
    ([{**_passage('1-1#0', 'A', 'a'), 'qa_id': '2-1'}], "c.jsonl.gz:1: field 'qa_id': '2-1' does not match the id '1-1#0'"),
    ([{**_passage('1-1#0', 'A', 'a'), 'text': ''}], "c.jsonl.gz:1: field 'text': empty string"),
    (['[1, 2]'], 'c.jsonl.gz:1: expected a JSON object, got list'),
])
def test_bad_corpus_rows_name_file_line_and_field(tmp_path, rows, message):
  with pytest.raises(DataError) as e:
    medquad.read_corpus(_write(tmp_path / 'c.jsonl.gz', rows))
  assert message in str(e.value)


def test_bad_question_rows_name_file_line_and_field(tmp_path):
  with pytest.raises(DataError, match=r"q.jsonl.gz:2: field 'own_passage_ids': empty list"):
    medquad.read_questions(_write(tmp_path / 'q.jsonl.gz', [_question('1-1', 'A', ['1-1#0']), _question('2-1', 'A', [])]))
  with pytest.raises(DataError, match=r"q.jsonl.gz:2: field 'id': duplicate question '1-1' about 'A'"):
    medquad.read_questions(_write(tmp_path / 'q.jsonl.gz', [_question('1-1', 'A', ['1-1#0'])] * 2))


def test_search_excluding_widens_until_k_survive_and_counts_what_it_left_out():
  ranked = [Passage(str(i), 't', f'p{i}') for i in range(40)]
  calls = []

  def search(query, depth):
    calls.append(depth)
    return ranked[:depth]

  kept, removed = search_excluding(search, 'q', 3, lambda p: int(p.id) < 12)  # the 12 best are excluded
  assert [p.id for p in kept] == ['12', '13', '14'] and removed == ranked[:12] and calls == [12, 48]
  kept, removed = search_excluding(search, 'q', 3, lambda p: p.id in ('1', '30'))
  assert [p.id for p in kept] == ['0', '2', '3'] and removed == [ranked[1]]  # '30' ranked below the last kept
  kept, removed = search_excluding(lambda q, d: ranked[:5], 'q', 3, lambda p: int(p.id) < 4)
  assert [p.id for p in kept] == ['4'] and len(removed) == 4  # the corpus ran out


def test_leave_own_answer_out_on_fixture_passages():
  own = Passage('7-1#0', 'Frostbite', 'frostbite is an injury caused by freezing')
  same_id_other_source = Passage('7-1#1', 'Fragile X', 'frostbite freezing freezing')
  sibling = Passage('7-2#0', 'Frostbite', 'what is frostbite: warm the skin')  # verbatim in the answer
  rest = [Passage(f'{i}-1#0', 'Other', f'freezing injury {i}') for i in range(1, 6)]
  corpus = [own, same_id_other_source, sibling] + rest
  from recomp_jax.retrieval.bm25 import BM25Index
  index = BM25Index(corpus)
  example = Example(
      id='7-1|Frostbite', question='what is frostbite freezing injury', answers=['... what is frostbite: warm the skin ...'],
      meta={'focus': 'Frostbite', 'own_passage_ids': ['7-1#0', '7-1#1']})
  report = FilterReport('retrieve')
  (out,) = medquad.retrieve_leaving_own_answer_out(index.search, [example], 3, report)
  assert [p.id for p in out.ctxs] == [p.id for p in index.search(example.question, 8) if p.id[:3] not in ('7-1', '7-2')][:3]
  assert report.dropped['own_id_passage'] == 2 and report.dropped['verbatim_in_reference'] == 1
  (plain,) = medquad.retrieve_leaving_own_answer_out(index.search, [example], 3, leave_out_verbatim=False)
  assert sibling.id in [p.id for p in plain.ctxs]  # the README's rule alone lets the sibling through
  with pytest.raises(DataError, match="question 'x' has no own_passage_ids"):
    medquad.retrieve_leaving_own_answer_out(index.search, [Example(
        id='x', question='q', answers=['a'])], 3)


def test_dense_pool_reranked_by_bm25_leaves_own_answer_out():
  """K-COMP §4.1: the dense retriever's ``depth`` passages (own answer and verbatim pieces left out,
  counted) re-ranked by BM25, the ``k`` best kept; with the real MiniLM on fixture passages."""
  from recomp_jax.models.dual_encoder import Encoder
  from recomp_jax.pretrained.demo import resolve_demo_model
  from recomp_jax.retrieval.bm25 import BM25Index
  from recomp_jax.retrieval.dense import DenseIndex
  own = Passage('7-1#0', 'Frostbite', 'frostbite is an injury caused by freezing of the skin')
  sibling = Passage('7-2#0', 'Frostbite', 'what is frostbite: warm the skin')  # verbatim in the answer
  rest = [Passage('1-1#0', 'Hypothermia', 'hypothermia: the body loses heat faster than it makes it'),
          Passage('2-1#0', 'Chilblains', 'chilblains are small itchy swellings after cold exposure'),
          Passage('3-1#0', 'Asthma', 'asthma narrows the airways of the lungs'),
          Passage('4-1#0', 'Trench foot', 'trench foot follows long exposure of the feet to cold and wet'),
          Passage('5-1#0', 'Sunburn', 'sunburn is skin damage from ultraviolet light'),
          Passage('6-1#0', 'Frost injury', 'frostbite frostbite freezing injury of the fingers')]
  corpus = [own, sibling] + rest
  encoder = Encoder.from_pretrained(resolve_demo_model('', 'encoder'))
  dense = DenseIndex(corpus, encoder.encode([f'{p.title} {p.text}' for p in corpus]))
  bm25 = BM25Index(corpus)
  example = Example(id='7-1|Frostbite', question='what is frostbite, a freezing injury of the skin?',
                    answers=['... what is frostbite: warm the skin ...'],
                    meta={'focus': 'Frostbite', 'own_passage_ids': ['7-1#0']})

  def search(query, depth):
    return dense.search_batch(encoder, [query], depth)[0]

  report = FilterReport('retrieve')
  (out,) = medquad.retrieve_leaving_own_answer_out(search, [example], 2, report, rerank=bm25.rerank, depth=4)
  pool = [p for p in search(example.question, 8) if p.id not in ('7-1#0', '7-2#0')][:4]
  scores = bm25.scores(example.question)
  row = {p.id: i for i, p in enumerate(corpus)}
  expected = sorted(pool, key=lambda p: -scores[row[p.id]])[:2]
  assert [p.id for p in out.ctxs] == [p.id for p in expected]
  assert [p.score for p in out.ctxs] == [float(scores[row[p.id]]) for p in expected]
  assert out.ctxs[0].id == '6-1#0'  # the lexical match wins the pool, whatever its dense rank
  assert sum(report.dropped.values()) == report.dropped['own_id_passage'] + report.dropped.get('verbatim_in_reference', 0)
  assert report.dropped['own_id_passage'] == 1  # the own answer is the dense retriever's best
  with pytest.raises(KeyError, match='not in this BM25 index'):
    bm25.rerank('q', [Passage('nope', '', 'text')])


def test_no_retrieved_passage_of_any_split_is_its_questions_own():
  """Over the real files (train, dev and the held-out test questions: an exclusion check, no
  model or metric): BM25 top-5 never holds a passage of the question's own answer, by id or by
  text (a passage cut from the reference answer)."""
  corpus_path = os.path.join(SHARED, 'medquad', 'corpus_medquad.jsonl.gz')
  if not os.path.exists(corpus_path):
    pytest.skip('../shared/data/medquad is absent')
  from recomp_jax.retrieval.bm25 import BM25Index
  corpus = medquad.read_corpus(corpus_path)
  assert len(corpus) == 31497
  index = BM25Index([m.passage for m in corpus])
  paths = {'train': os.path.join(SHARED, 'medquad', 'train.jsonl.gz'), 'dev': os.path.join(SHARED, 'medquad', 'dev.jsonl.gz'),
           'test': os.path.join(SHARED, 'eval', 'medquad_test.jsonl.gz')}
  sizes = {'train': 12250, 'dev': 1653, 'test': 1645}
  for split, path in paths.items():
    questions = medquad.read_questions(path)
    assert len(questions) == sizes[split]
    report = FilterReport(split)
    for e in medquad.retrieve_leaving_own_answer_out(index.search, questions, 5, report):
      assert len(e.ctxs) == 5
      own = set(e.meta['own_passage_ids'])
      for p in e.ctxs:
        assert p.id not in own, (split, e.id, p.id)
        assert p.text not in e.answers[0], (split, e.id, p.id)
    assert report.dropped['own_id_passage'] > 0.5 * len(questions)  # most questions' own answer ranks high


def test_kcomp_data_stage_with_the_dense_retriever(tmp_path):
  """``kcomp.retriever=dense_bm25`` in K-COMP's data stage: MiniLM's pool re-ranked by BM25, never
  the question's own passage, the corpus embeddings kept in the stage directory."""
  from recomp_jax.pipelines import kcomp as pipeline
  from recomp_jax.data.stage_records import read_examples
  topics = ['Frostbite', 'Asthma', 'Sunburn', 'Gout', 'Anemia', 'Migraine']
  corpus = [_passage(f'{i}-1#{j}', t, f'{t.lower()} note {j}: {t.lower()} affects people in many ways, part {j}',
                     doc=f'GHR:{i}') for i, t in enumerate(topics) for j in range(3)]
  questions = [_question(f'{i}-1', t, [f'{i}-1#0', f'{i}-1#1', f'{i}-1#2'], question=f'What is {t.lower()} ?',
                         answer=f'{t} is a condition.') for i, t in enumerate(topics[:3])]
  config = config_files.preset('medquad_kcomp.py', 'ci')
  k = config.kcomp
  k.corpus_path = _write(tmp_path / 'corpus.jsonl.gz', corpus)
  k.test_path = _write(tmp_path / 'test.jsonl.gz', questions)
  k.max_test, k.top_docs, k.retriever, k.dense_depth = 0, 2, 'dense_bm25', 4
  summary = pipeline.stage_data(config, str(tmp_path / 'stage'), ('test',))
  test = read_examples(str(tmp_path / 'stage' / 'test.jsonl'))
  assert summary['test']['questions'] == 3 and [len(e.ctxs) for e in test] == [2, 2, 2]
  for e in test:
    assert not {p.id for p in e.ctxs} & set(e.meta['own_passage_ids'])
    assert e.ctxs[0].score >= e.ctxs[1].score  # BM25 order
  assert summary['test']['left_out']['own_id_passage'] == 9  # each question's 3 own passages led the dense pool
  assert any(name.startswith('dense-') for name in os.listdir(tmp_path / 'stage'))
