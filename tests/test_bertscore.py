"""Our BERTScore (Flax BERT) against the bert-score package on the same model (K-COMP's metric)."""

import bert_score
import jax.numpy as jnp
import numpy as np
import pytest

from recomp_jax.evaluation.bertscore import BertScore, greedy_match
from recomp_jax.pretrained.demo import resolve_demo_model

CANDIDATES = ['Frostbite is an injury caused by freezing of the skin.', 'Gout is arthritis.',
              'Nothing here.', 'The treatment includes rest, ice and compression of the injured area for several days.',
              'Acute myeloid leukemia (AML) is a cancer of the blood and bone marrow in which too many immature '
              'white blood cells are made; it gets worse quickly if not treated. ' * 3,
              'Symptoms of COPD include cough, wheezing and shortness of breath.']
REFERENCES = ['Frostbite is an injury to the body that is caused by freezing.', 'Gout is a common, painful form of arthritis.',
              'x', 'Treatment: rest.', 'AML is a blood cancer.',
              'COPD (chronic obstructive pulmonary disease) makes it hard to breathe. Symptoms are cough and wheezing.']


@pytest.fixture(scope='module')
def minilm():
  return resolve_demo_model('', 'encoder')


@pytest.mark.parametrize('num_layers', [None, 3])
def test_matches_the_bert_score_package_on_the_same_model(minilm, num_layers):
  ours = BertScore(minilm, num_layers=num_layers, batch_size=4).score(CANDIDATES, REFERENCES)  # two batches
  p, r, f = bert_score.score(CANDIDATES, REFERENCES, model_type=minilm, num_layers=num_layers or 6, batch_size=64)
  np.testing.assert_allclose(ours['precision'], p.numpy(), atol=2e-5)
  np.testing.assert_allclose(ours['recall'], r.numpy(), atol=2e-5)
  np.testing.assert_allclose(ours['f1'], f.numpy(), atol=2e-5)
  assert np.ptp(ours['f1']) > 0.3  # the pairs differ: the check is not of a constant


def test_empty_texts_score_zero_and_lengths_must_match(minilm):
  scorer = BertScore(minilm)
  out = scorer.score(['', 'Gout is arthritis.', '  '], ['Gout is arthritis.', '', 'x'])
  assert out['f1'].tolist() == [0.0, 0.0, 0.0] and out['precision'].tolist() == [0.0, 0.0, 0.0]
  assert scorer.score(['Gout is arthritis.'], ['Gout is arthritis.'])['f1'][0] == pytest.approx(1.0, abs=1e-5)
  with pytest.raises(ValueError, match='2 candidates for 1 references'):
    scorer.score(['a', 'b'], ['a'])


def test_greedy_match_by_hand():
  # candidate tokens e0, e1 (+ a special token that is matched but carries no weight); reference e0, (e0+e1)/|.|
  e0, e1 = np.eye(2, dtype=np.float32)
  mid = (e0 + e1) / np.sqrt(2)
  cand = jnp.asarray([[e0, e1, e1]])
  ref = jnp.asarray([[e0, mid, e0]])
  p, r, f = greedy_match(cand, jnp.asarray([[1., 1., 0.]]), jnp.asarray([[1, 1, 1]]),
                         ref, jnp.asarray([[1., 1., 0.]]), jnp.asarray([[1, 1, 0]]))  # ref's third is padding
  s = 1 / np.sqrt(2)
  assert float(p[0]) == pytest.approx((1 + s) / 2)  # e0 -> e0 (1), e1 -> mid (s); the padded e0 is never matched
  assert float(r[0]) == pytest.approx((1 + s) / 2)  # e0 -> e0 (1), mid -> e0 or e1 (s)
  assert float(f[0]) == pytest.approx((1 + s) / 2)
  _, _, f = greedy_match(cand, jnp.zeros((1, 3)), jnp.ones((1, 3)), ref, jnp.ones((1, 3)), jnp.ones((1, 3)))
  assert float(f[0]) == 0.0  # nothing weighted on one side
