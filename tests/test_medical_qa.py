"""K-COMP's ``:paper`` data readers on small hand-written fixtures in each publisher's format:
MASH-QA (SQuAD v2 JSON, multi-span answers), BioASQ (training JSON) and MedCorp (MedRAG chunks)."""

import gzip
import json

import pytest

from recomp_jax.compressors import kcomp
from recomp_jax.data import medical_qa
from recomp_jax.data.schema import DataError, FilterReport
from tests import config_files

CONTEXT = ('Gout is a form of arthritis. It causes sudden pain in the joints. '
           'Uric acid crystals build up in a joint. Drinking water may help.')


def _mashqa(path, qas):
  path.write_text(json.dumps({'version': 'v2.0', 'data': [
      {'title': 'gout', 'paragraphs': [{'context': CONTEXT, 'qas': qas}]}]}))
  return str(path)


def _span(text):
  return {'text': text, 'answer_start': CONTEXT.index(text)}


def test_mashqa_joins_the_answer_spans_in_document_order_and_counts_unanswered(tmp_path):
  path = _mashqa(tmp_path / 'val_webmd_squad_v2_consec.json', [
      {'id': 'q1', 'question': 'What causes gout pain?', 'is_impossible': False,
       'answers': [_span('Uric acid crystals build up in a joint.'), _span('It causes sudden pain in the joints.')]},
      {'id': 'q2', 'question': 'Is gout curable?', 'is_impossible': True, 'answers': []},
      {'id': 'q3', 'question': 'What is gout?', 'answers': [_span('Gout is a form of arthritis.')]}])
  report = FilterReport('read')
  out = medical_qa.read_mashqa(path, report=report)
  assert [e.id for e in out] == ['q1', 'q3']
  assert out[0].answers == ['It causes sudden pain in the joints. Uric acid crystals build up in a joint.']
  assert out[0].meta == {'source': 'mashqa', 'own_passage_ids': [], 'title': 'gout'} and out[0].ctxs == []
  assert report.to_dict()['dropped'] == {'no_answer': 1}
  assert [e.id for e in medical_qa.read_mashqa(path, max_examples=1)] == ['q1']


@pytest.mark.parametrize('qas,message', [
    ([{'id': 'q1', 'question': 'x?', 'answers': [{'text': 'Gout', 'answer_start': 5}]}],
     r"data\[0\]\.paragraphs\[0\]\.qas\[0\]\.answers\[0\]\.answer_start': 5 does not point at the answer"),
    ([{'id': 'q1', 'answers': []}], r"data\[0\]\.paragraphs\[0\]\.qas\[0\]\.question': missing"),
    ([{'id': 'q1', 'question': 'a?', 'answers': []}, {'id': 'q1', 'question': 'b?', 'answers': []}],
     "duplicate question id 'q1'"),
])
def test_mashqa_errors_name_the_file_and_json_path(tmp_path, qas, message):
  path = _mashqa(tmp_path / 'bad.json', qas)
  with pytest.raises(DataError, match=message) as info:
    medical_qa.read_mashqa(path)
  assert 'bad.json' in str(info.value)


def test_bioasq_takes_the_first_ideal_answer(tmp_path):
  path = tmp_path / 'BioASQ-training.json'
  path.write_text(json.dumps({'questions': [
      {'id': 'b1', 'body': 'What is the function of BRCA1?', 'type': 'summary',
       'ideal_answer': ['BRCA1 repairs damaged DNA.', 'It is a tumour suppressor.'], 'documents': [], 'snippets': []},
      {'id': 'b2', 'body': 'Is aspirin an NSAID?', 'type': 'yesno', 'ideal_answer': 'Yes, aspirin is an NSAID.'},
      {'id': 'b3', 'body': 'List three statins.', 'type': 'list'}]}))
  report = FilterReport('read')
  out = medical_qa.read_bioasq(str(path), report=report)
  assert [(e.id, e.answers[0], e.meta['qtype']) for e in out] == [
      ('b1', 'BRCA1 repairs damaged DNA.', 'summary'), ('b2', 'Yes, aspirin is an NSAID.', 'yesno')]
  assert report.to_dict()['dropped'] == {'no_ideal_answer': 1}
  path.write_text(json.dumps({'questions': [{'id': 'b1', 'body': 'q', 'ideal_answer': [3]}]}))
  with pytest.raises(DataError, match=r"questions\[0\]\.ideal_answer': expected a string or a list of strings"):
    medical_qa.read_bioasq(str(path))


def test_medcorp_snippets_describe_their_title_from_its_first_snippet(tmp_path):
  path = tmp_path / 'chunk.jsonl.gz'
  rows = [{'id': 'wiki_0', 'title': 'Gout', 'content': 'Gout is a form of inflammatory arthritis. It hurts.',
           'contents': 'Gout. Gout is a form of inflammatory arthritis. It hurts.'},
          {'id': 'wiki_1', 'title': 'Gout', 'content': 'Treatment includes rest. Colchicine helps.'},
          {'id': 'wiki_2', 'title': 'Statin', 'content': 'Statins lower cholesterol. They are common.'}]
  with gzip.open(path, 'wt') as f:
    f.write('\n'.join(json.dumps(r) for r in rows) + '\n')
  corpus = medical_qa.read_medcorp(str(path))
  assert [(m.passage.id, m.passage.title, m.index) for m in corpus] == [('wiki_0', 'Gout', 0), ('wiki_1', 'Gout', 1),
                                                                       ('wiki_2', 'Statin', 0)]
  descriptions = kcomp.Descriptions(corpus)
  assert descriptions.describe('Gout') == 'Gout is a form of inflammatory arthritis.'
  with gzip.open(path, 'wt') as f:
    f.write(json.dumps(rows[0]) + '\n' + json.dumps(rows[0]) + '\n')
  with pytest.raises(DataError, match=r"chunk\.jsonl\.gz:2: field 'id': duplicate snippet 'wiki_0'"):
    medical_qa.read_medcorp(str(path))


def test_kcomp_data_stage_reads_mashqa_questions_over_a_medcorp_corpus(tmp_path):
  from recomp_jax.data.stage_records import read_examples
  from recomp_jax.pipelines import kcomp as pipeline
  corpus = tmp_path / 'chunk.jsonl'
  corpus.write_text('\n'.join(json.dumps({'id': f'c{i}', 'title': t, 'content': text}) for i, (t, text) in enumerate([
      ('Gout', 'Gout is a form of arthritis with sudden joint pain.'), ('Gout', 'Uric acid crystals cause gout.'),
      ('Statin', 'Statins lower cholesterol.'), ('Asthma', 'Asthma narrows the airways.')])) + '\n')
  questions = _mashqa(tmp_path / 'test.json', [
      {'id': 'q1', 'question': 'What causes gout pain?', 'answers': [_span('Uric acid crystals build up in a joint.')]},
      {'id': 'q2', 'question': 'Is gout curable?', 'answers': []}])
  config = config_files.preset('medquad_kcomp.py', 'ci')
  k = config.kcomp
  k.corpus_path, k.corpus_format, k.test_path, k.question_format = str(corpus), 'medcorp', questions, 'mashqa'
  k.max_test, k.top_docs = 0, 2
  summary = pipeline.stage_data(config, str(tmp_path / 'stage'), ('test',))
  (e,) = read_examples(str(tmp_path / 'stage' / 'test.jsonl'))
  assert e.id == 'q1' and [p.title for p in e.ctxs] == ['Gout', 'Gout']
  assert summary['test']['dropped_on_read'] == {'no_answer': 1} and summary['test']['entities']['kept'] == 1
