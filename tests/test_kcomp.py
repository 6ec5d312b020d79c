"""K-COMP's training data (kcomp.txt §4.2-4.3): descriptions, knowledge targets, masks, prompts."""

import os

import pytest

from recomp_jax.compressors import kcomp
from recomp_jax.data.entities import Gazetteer
from recomp_jax.data.medquad import MedPassage
from recomp_jax.data.schema import FilterReport, Passage


def _m(pid, title, text, qtype='information'):
  qa_id, _, k = pid.partition('#')
  return MedPassage(Passage(pid, title, text), qa_id, 'GHR:1', qtype, int(k))


CORPUS = [
    _m('2-1#0', 'Frostbite', 'Frostbite can damage the skin. It needs care.', qtype='treatment'),
    _m('1-1#0', 'Frostbite', 'Frostbite is an injury caused by freezing. It affects the toes.'),
    _m('1-1#1', 'Frostbite', 'Seek medical care.'),
    _m('3-1#0', 'Gout', 'Gout is a form of arthritis. It is painful.'),
    _m('4-1#0', 'Kuru', '   '),
]


def test_descriptions_prefer_the_information_answer_and_skip_the_questions_own():
  d = kcomp.Descriptions(CORPUS)
  assert d.describe('frostbite') == 'Frostbite is an injury caused by freezing.'
  assert d.describe('Frostbite', own_ids=['1-1#0']) == 'Seek medical care.'  # the document's next passage
  assert d.describe('Frostbite', own_ids=['1-1#0', '1-1#1']) == 'Frostbite can damage the skin.'
  assert d.describe('Gout', own_ids=['3-1#0']) is None and d.describe('Kuru') is None and d.describe('Flu') is None


def test_knowledge_masks_and_targets_in_question_order():
  d, g = kcomp.Descriptions(CORPUS), Gazetteer(['Frostbite', 'Gout'])
  q = 'Is gout worse than frostbite ?'
  kept, knowledge = kcomp.knowledge_for(g.find(q), d, own_ids=[])
  assert knowledge.text() == ('gout: Gout is a form of arthritis.<eom>'
                              'frostbite: Frostbite is an injury caused by freezing.<eom>')
  assert knowledge.text(kcomp.EOM_RELEASED).endswith('freezing.<eod>')
  prompt, target, summary = kcomp.training_example(q, kept, [Passage('p', 'T', 'text')], knowledge, 'A summary.')
  assert prompt == 'Passage\nT\ntext\n\nQuestion\nIs <ent> worse than <ent> ?\n\nKnowledge\n'
  assert (target, summary) == (knowledge.text(), 'A summary.')


def test_undescribed_entities_stay_unmasked_and_questions_without_any_are_counted():
  d, g = kcomp.Descriptions(CORPUS), Gazetteer(['Frostbite', 'Gout', 'Kuru'])
  report = FilterReport('train')
  q = 'Is kuru like frostbite ?'
  kept, knowledge = kcomp.knowledge_for(g.find(q), d, own_ids=[], report=report, where='q1')
  assert [m.surface for m in kept] == ['frostbite'] and report.dropped['entity_without_description'] == 1
  assert kcomp.training_example(q, kept, [], knowledge, '')[0].endswith('Is kuru like <ent> ?\n\nKnowledge\n')
  assert kcomp.knowledge_for(g.find('What is kuru ?'), d, [], report, 'q2') is None
  assert kcomp.knowledge_for(g.find('No entity at all'), d, [], report, 'q3') is None
  assert (report.dropped['no_described_entity'], report.dropped['no_entity']) == (1, 1)


def test_generated_output_splits_at_the_last_eom_and_reads_as_prior_knowledge():
  out = 'gout: arthritis.<eom>frostbite: freezing.<eom> The summary.'
  knowledge, summary = kcomp.split_output(out)
  assert (knowledge, summary) == ('gout: arthritis.<eom>frostbite: freezing.<eom>', 'The summary.')
  assert kcomp.split_output('no knowledge written') == ('', 'no knowledge written')
  assert kcomp.reader_prompt('Q?', summary, knowledge) == (
      'Passage\nThe summary.\n\nPrior Knowledge\ngout: arthritis.\nfrostbite: freezing.\n\nQuestions\nQ?\n\nAnswer\n')
  assert kcomp.reader_prompt('Q?', 'S.') == 'Passage\nS.\n\nQuestions\nQ?\n\nAnswer\n'  # -Prior
  assert 'Q?' not in kcomp.teacher_prompt([Passage('p', 'T', 'x')], ['gout'])  # Table 6: no question


def test_medquad_training_questions_mostly_keep_a_described_entity():
  shared = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'shared', 'data')
  corpus_path = os.path.join(shared, 'medquad', 'corpus_medquad.jsonl.gz')
  if not os.path.exists(corpus_path):
    pytest.skip('../shared/data/medquad is absent')
  from recomp_jax.data import medquad
  corpus = medquad.read_corpus(corpus_path)
  d, g = kcomp.Descriptions(corpus), Gazetteer(m.passage.title for m in corpus)
  dev = medquad.read_questions(os.path.join(shared, 'medquad', 'dev.jsonl.gz'))
  report = FilterReport('dev')
  kept = [kcomp.knowledge_for(g.find(e.question), d, e.meta['own_passage_ids'], report, e.id) for e in dev]
  assert sum(k is not None for k in kept) > 0.8 * len(dev)
  from recomp_jax.data.sentences import split_sentences
  firsts = {}
  for m in corpus:
    sentences = split_sentences(m.passage.text)
    if sentences:
      firsts.setdefault(sentences[0], set()).add((m.passage.id, ' '.join(m.passage.title.split()).lower()))
  for e, k in zip(dev, kept):
    if k is not None:  # the first sentence of a passage of the entity that is not the question's own
      own = set(e.meta['own_passage_ids'])
      for (mention, (_, description)) in zip(k[0], k[1].pairs):
        title = ' '.join(mention.title.split()).lower()
        assert any(pid not in own and t == title for pid, t in firsts[description]), (e.id, description)
