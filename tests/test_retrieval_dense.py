"""Dense retrieval: exact sharded MIPS against brute force, resumable corpus embedding, index reuse.

The multi-device cases need ``jax.device_count() >= 8``; on one device the
module reruns itself in a subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``.
"""

import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from recomp_jax import sharding
from recomp_jax.data.schema import Example, Passage
from recomp_jax.retrieval import dense

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multidevice import NUM_DEVICES, run_with_fake_devices  # noqa: E402


def _brute_force(queries, table, k):
  scores = queries.astype(np.float64) @ table.astype(np.float64).T
  rows = np.argsort(-scores, axis=1, kind='stable')[:, :k]
  return np.take_along_axis(scores, rows, axis=1), rows


def _random(n, q, d, seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(q, d)).astype(np.float32), rng.normal(size=(n, d)).astype(np.float32)


def _tiny_encoder():
  from recomp_jax.pretrained.demo import resolve_demo_model
  from transformers import AutoTokenizer

  from recomp_jax.models import bert
  from recomp_jax.models.dual_encoder import DualEncoder, Encoder
  cfg = bert.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)
  model = DualEncoder(bert.BertModel(cfg, rngs=nnx.Rngs(0)), pooling='mean', normalize=True)
  tokenizer = AutoTokenizer.from_pretrained(resolve_demo_model('', 'encoder'))
  return Encoder(model, tokenizer, max_length=64)


def _corpus(n=37):
  words = ('river mountain castle violin comet harbour glacier poet senate orchid lantern falcon '
           'desert engine canal meadow').split()
  rng = np.random.default_rng(1)
  return [Passage(id=f'p{i}', title=f'Title {i}', text=' '.join(rng.choice(words, size=8 + i % 5)))
          for i in range(n)]


@pytest.mark.parametrize('n,k,chunk', [(1000, 7, 64), (5, 5, 8192), (130, 1, 16)])
def test_exact_top_k_single_device_matches_brute_force(n, k, chunk):
  queries, table = _random(n, 9, 24)
  index = dense.DenseIndex([Passage(id=str(i), title='', text='') for i in range(n)], table,
                           config=dense.DenseConfig(chunk=chunk, query_batch=4))
  scores, rows = index.search_embeddings(queries, k)
  want_scores, want_rows = _brute_force(queries, table, k)
  np.testing.assert_array_equal(rows, want_rows)
  np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)


def test_padding_rows_are_never_returned():
  table = -np.ones((3, 4), np.float32)  # every real score is negative; padding rows would score 0
  index = dense.DenseIndex([Passage(id=str(i), title='', text='') for i in range(3)], table,
                           config=dense.DenseConfig(chunk=8))
  scores, rows = index.search_embeddings(np.ones((2, 4), np.float32), 10)
  assert rows.shape == (2, 3) and set(rows[0]) == {0, 1, 2}
  np.testing.assert_allclose(scores, -4.0)


def test_ties_go_to_the_earlier_row():
  table = np.ones((50, 4), np.float32)
  index = dense.DenseIndex([Passage(id=str(i), title='', text='') for i in range(50)], table,
                           config=dense.DenseConfig(chunk=8))
  _, rows = index.search_embeddings(np.ones((1, 4), np.float32), 5)
  np.testing.assert_array_equal(rows[0], [0, 1, 2, 3, 4])


def test_build_or_load_reuses_and_resumes(tmp_path):
  encoder = _tiny_encoder()
  corpus = _corpus()
  config = dense.DenseConfig(part_rows=10, encode_batch_size=8)
  index = dense.DenseIndex.build_or_load(corpus, encoder, str(tmp_path), config=config)
  (directory,) = [p for p in tmp_path.iterdir() if p.name.startswith('dense-')]
  parts = sorted((directory / 'parts').iterdir())
  assert len(parts) == 4
  want = encoder.encode([f'{p.title} {p.text}' for p in corpus])
  np.testing.assert_allclose(index.embeddings, want, atol=1e-6)

  # Reuse: the saved index is loaded, nothing is re-embedded.
  calls = []
  original = encoder.encode
  encoder.encode = lambda texts, **kw: calls.append(len(texts)) or original(texts, **kw)
  again = dense.DenseIndex.build_or_load(corpus, encoder, str(tmp_path), config=config)
  np.testing.assert_array_equal(again.embeddings, index.embeddings)
  assert not [c for c in calls if c > 2]  # at most the query encodes of other code, no corpus parts

  # An interrupted build (meta.json and two parts missing) embeds only the missing parts.
  os.remove(directory / 'meta.json')
  os.remove(parts[1])
  os.remove(parts[3])
  calls.clear()
  resumed = dense.DenseIndex.build_or_load(corpus, encoder, str(tmp_path), config=config)
  assert calls == [10, 7]
  np.testing.assert_allclose(resumed.embeddings, index.embeddings, atol=1e-6)

  # Different weights -> a different index directory.
  state = nnx.state(encoder.model, nnx.Param)
  nnx.update(encoder.model, jax.tree.map(lambda x: x * 1.01, state))
  dense.DenseIndex.build_or_load(corpus, encoder, str(tmp_path), config=config)
  assert len([p for p in tmp_path.iterdir() if p.name.startswith('dense-')]) == 2


def test_retrieve_fills_ctxs_with_scores_and_flags(tmp_path):
  encoder = _tiny_encoder()
  corpus = _corpus()
  index = dense.DenseIndex.build_or_load(corpus, encoder, str(tmp_path))
  example = Example(id='q', question=corpus[5].title + ' ' + corpus[5].text, answers=[corpus[5].text.split()[0]],
                    gold_ctx=corpus[5])
  (out,) = index.retrieve(encoder, [example], k=4)
  assert len(out.ctxs) == 4
  scores = [p.score for p in out.ctxs]
  assert scores == sorted(scores, reverse=True)
  q = encoder.encode([example.question], kind='query', max_length=64)
  np.testing.assert_allclose(scores[0], float(np.max(index.embeddings @ q[0])), rtol=1e-5)
  assert out.ctxs[0].id == 'p5'  # the question is the passage's own text: cosine 1
  assert out.ctxs[0].is_gold and out.ctxs[0].has_answer
  assert [p.is_gold for p in out.ctxs].count(True) == 1


if jax.device_count() < NUM_DEVICES:

  def test_multidevice_in_subprocess():
    """Runs ``TestMultiDevice`` with 8 fake CPU devices in a fresh interpreter."""
    run_with_fake_devices(__file__, 'TestMultiDevice', timeout=600)

else:

  class TestMultiDevice:

    @pytest.fixture(scope='class')
    def mesh(self):
      return sharding.make_mesh(2, 2, 2, devices=jax.devices()[:NUM_DEVICES])

    @pytest.mark.parametrize('n,k,chunk', [(1000, 7, 16), (13, 3, 8192)])
    def test_sharded_top_k_matches_brute_force(self, mesh, n, k, chunk):
      queries, table = _random(n, 5, 16, seed=n)
      index = dense.DenseIndex([Passage(id=str(i), title='', text='') for i in range(n)], table, mesh=mesh,
                               config=dense.DenseConfig(chunk=chunk))
      placed, shards, _ = index._table(k)  # pylint: disable=protected-access
      assert shards == NUM_DEVICES
      assert len({s.device for s in placed.addressable_shards}) == NUM_DEVICES
      assert placed.addressable_shards[0].data.shape[0] == placed.shape[0] // NUM_DEVICES
      scores, rows = index.search_embeddings(queries, k)
      want_scores, want_rows = _brute_force(queries, table, k)
      np.testing.assert_array_equal(rows, want_rows)
      np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)

    def test_sharded_corpus_embedding_matches_one_device(self, mesh):
      texts = [f'{p.title} {p.text}' for p in _corpus(21)]
      want = _tiny_encoder().encode(texts, batch_size=8)
      sharded = _tiny_encoder().to_mesh(mesh)
      got = sharded.encode(texts, batch_size=8)
      np.testing.assert_allclose(got, want, atol=1e-5)
