"""The entity gazetteer (K-COMP §4.2's keep rule without ScispaCy) and the question mask."""

import os

import pytest

from recomp_jax.data import entities
from recomp_jax.data.entities import Gazetteer, Mention

TITLES = ['Adult Acute Lymphoblastic Leukemia', 'Acute lymphoblastic leukemia (ALL)', 'Leukemia',
          'Benign rolandic epilepsy (BRE)', 'Enlarged Prostate (BPH)', 'COPD', 'Pain', '', 'Liver (Hepatocellular) Cancer']


def test_title_forms_keep_the_name_the_bare_name_and_capital_abbreviations():
  assert entities.title_forms('Benign rolandic epilepsy (BRE)') == [
      ('Benign rolandic epilepsy (BRE)', False), ('Benign rolandic epilepsy', False), ('BRE', True)]
  assert entities.title_forms('Liver (Hepatocellular) Cancer') == [
      ('Liver (Hepatocellular) Cancer', False), ('Liver Cancer', False)]
  assert entities.title_forms('COPD') == [('COPD', True)] and entities.title_forms('  ') == []


def test_longest_match_first_case_insensitive_names_and_capital_abbreviations():
  g = Gazetteer(TITLES)
  q = 'What are the symptoms of adult acute lymphoblastic leukemia and all of COPD pain?'
  assert g.find(q) == [Mention(25, 59, 'adult acute lymphoblastic leukemia', 'Adult Acute Lymphoblastic Leukemia'),
                       Mention(71, 75, 'COPD', 'COPD'), Mention(76, 80, 'pain', 'Pain')]
  # 'ALL' only in capitals; 'leukemia' alone inside a longer name is not a second mention
  assert [m.surface for m in g.find('Is ALL a leukemia?')] == ['ALL', 'leukemia']
  assert [m.title for m in g.find('How to treat BPH or an enlarged prostate')] == ['Enlarged Prostate (BPH)'] * 2
  # word boundaries: no match inside a word
  assert g.find('copdx painful leukemias') == []


def test_mask_replaces_each_mention_with_ent():
  g = Gazetteer(TITLES)
  q = 'What are the treatments for Leukemia and COPD ?'
  assert entities.mask(q, g.find(q)) == 'What are the treatments for <ent> and <ent> ?'
  assert entities.mask('No entity here', []) == 'No entity here'


def test_most_medquad_training_questions_name_a_corpus_title():
  """On the real files: the focus of nearly every question is found (Table 1 reports the rest)."""
  shared = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), 'shared', 'data')
  corpus_path = os.path.join(shared, 'medquad', 'corpus_medquad.jsonl.gz')
  if not os.path.exists(corpus_path):
    pytest.skip('../shared/data/medquad is absent')
  from recomp_jax.data import medquad
  g = Gazetteer(m.passage.title for m in medquad.read_corpus(corpus_path))
  dev = medquad.read_questions(os.path.join(shared, 'medquad', 'dev.jsonl.gz'))
  found = [g.find(e.question) for e in dev]
  with_entity = sum(bool(f) for f in found)
  assert with_entity > 0.9 * len(dev)
