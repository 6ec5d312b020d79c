"""Gemma 1/2/3 parity with Hugging Face transformers (tiny random models) and decoding tests."""

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recomp_jax.models import gemma, gemma_decoding, generation
from recomp_jax.pretrained import export_pretrained, family_for, load_pretrained

import tiny_models  # noqa: E402  (tests/ is on sys.path under pytest)

import torch
import transformers
VOCAB = 128
SLIDING, FULL = gemma.SLIDING, gemma.FULL
NEW_TOKENS = 20

# Three generations, three attention layouts (MHA / GQA / MQA), tied and untied heads (an
# untied head keeps a tiny random Gemma 3 from repeating one token, which would make the
# generation test blind to cache bugs).
FAMILIES = {
    'gemma': ('GemmaForCausalLM', 'GemmaConfig',
              dict(num_hidden_layers=2, num_key_value_heads=4)),
    'gemma2': ('Gemma2ForCausalLM', 'Gemma2Config',
               dict(num_hidden_layers=3, num_key_value_heads=2, sliding_window=8,
                    attn_logit_softcapping=5.0, final_logit_softcapping=10.0,
                    query_pre_attn_scalar=24)),
    'gemma3': ('Gemma3ForCausalLM', 'Gemma3TextConfig',
               dict(num_hidden_layers=4, num_key_value_heads=1, sliding_window=8,
                    query_pre_attn_scalar=24, tie_word_embeddings=False, layer_types=[SLIDING, SLIDING, FULL, SLIDING],
                    rope_parameters={SLIDING: {'rope_type': 'default', 'rope_theta': 100.0},
                                     FULL: {'rope_type': 'linear', 'rope_theta': 10000.0,
                                            'factor': 2.0}})),
}


def _hf_model(name: str, seed: int = 0, **overrides):
  cls_name, config_name, kwargs = FAMILIES[name]
  kwargs = dict(kwargs, **overrides)
  torch.manual_seed(seed)
  config = getattr(transformers, config_name)(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=16,
      attn_implementation='eager', **kwargs)
  model = getattr(transformers, cls_name)(config).eval()
  with torch.no_grad():  # large enough weights for well-separated logits and varied greedy text
    for pname, p in model.named_parameters():
      p.normal_(0.0, 0.2 if 'norm' in pname else 0.1 if 'embed' in pname or 'lm_head' in pname
                else 0.3)
  return model


@pytest.fixture(scope='module', params=list(FAMILIES))
def family(request, tmp_path_factory):
  """(name, HF torch model, our Pretrained loaded from its save_pretrained directory)."""
  name = request.param
  hf = _hf_model(name)
  directory = str(tmp_path_factory.mktemp(name))
  hf.save_pretrained(directory)
  return name, hf, load_pretrained(directory)


def _batch(seed: int, length: int, pads=(0, 5, 12)):
  rng = np.random.RandomState(seed)
  mask = np.ones((len(pads), length), np.int64)
  for row, pad in enumerate(pads):
    mask[row, :pad] = 0
  ids = rng.randint(3, VOCAB, size=mask.shape) * mask  # pad id 0
  return ids, mask


# -- config -------------------------------------------------------------------

GEMMA3_270M = {  # config.json of google/gemma-3-270m (transformers 4.x layout)
    'architectures': ['Gemma3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
    'attn_logit_softcapping': None, 'bos_token_id': 2, 'eos_token_id': 1,
    'final_logit_softcapping': None, 'head_dim': 256, 'hidden_activation': 'gelu_pytorch_tanh',
    'hidden_size': 640, 'intermediate_size': 2048,
    'layer_types': ([SLIDING] * 5 + [FULL]) * 3, 'max_position_embeddings': 32768,
    'model_type': 'gemma3_text', 'num_attention_heads': 4, 'num_hidden_layers': 18,
    'num_key_value_heads': 1, 'pad_token_id': 0, 'query_pre_attn_scalar': 256,
    'rms_norm_eps': 1e-06, 'rope_local_base_freq': 10000.0, 'rope_scaling': None,
    'rope_theta': 1000000.0, 'sliding_window': 512, 'tie_word_embeddings': True,
    'use_bidirectional_attention': False, 'vocab_size': 262144,
}


def test_config_gemma3_270m_v4_and_v5_layouts():
  ours = gemma.GemmaConfig.from_hf(GEMMA3_270M)
  assert ours == gemma.GemmaConfig()  # our defaults are Gemma 3 270M
  assert ours.rope_theta == 1e6 and ours.rope_local_theta == 1e4
  assert [i for i in range(18) if not ours.is_sliding(i)] == [5, 11, 17]
  assert ours.attention_scale == 1 / 16
  # transformers 5 re-serialises it with nested per-layer-type rope_parameters.
  v5 = transformers.Gemma3TextConfig.from_dict(GEMMA3_270M).to_dict()
  assert set(v5['rope_parameters']) == {SLIDING, FULL}
  assert gemma.GemmaConfig.from_hf(v5) == ours
  # Without layer_types, the 5:1 pattern comes from sliding_window_pattern.
  legacy = {k: v for k, v in GEMMA3_270M.items() if k != 'layer_types'}
  assert gemma.GemmaConfig.from_hf(dict(legacy, sliding_window_pattern=6)) == ours
  # A multimodal gemma3 config reduces to its text part.
  assert gemma.GemmaConfig.from_hf({'model_type': 'gemma3', 'text_config': v5}) == ours


def test_config_rope_variants():
  scaled = gemma.GemmaConfig.from_hf(
      dict(GEMMA3_270M, rope_scaling={'rope_type': 'linear', 'factor': 8.0}))
  assert (scaled.rope_scaling_factor, scaled.rope_local_scaling_factor) == (8.0, 1.0)
  assert transformers.Gemma3TextConfig.from_dict(scaled.to_hf()).rope_parameters[FULL]['factor'] == 8.0
  with pytest.raises(ValueError, match='unsupported RoPE type'):
    gemma.GemmaConfig.from_hf(dict(GEMMA3_270M, rope_scaling={'rope_type': 'yarn', 'factor': 4.0}))
  legacy_gemma = {'model_type': 'gemma', 'vocab_size': 64, 'hidden_size': 32,
                  'intermediate_size': 48, 'num_hidden_layers': 2, 'num_attention_heads': 2,
                  'num_key_value_heads': 1, 'head_dim': 16, 'hidden_act': 'gelu',
                  'rope_theta': 500.0}
  cfg = gemma.GemmaConfig.from_hf(legacy_gemma)
  assert cfg.hidden_activation == 'gelu_pytorch_tanh' and cfg.rope_theta == 500.0
  assert cfg.layer_types == (FULL, FULL) and cfg.attention_scale == 16 ** -0.5


@pytest.mark.parametrize('name', list(FAMILIES))
def test_config_to_hf_roundtrip(name):
  hf_config = _hf_model(name).config
  ours = gemma.GemmaConfig.from_hf(hf_config.to_dict())
  reloaded = transformers.AutoConfig.for_model(**ours.to_hf())
  assert type(reloaded) is type(hf_config)
  assert gemma.GemmaConfig.from_hf(reloaded.to_dict()) == ours


def test_weight_specs_match_hf_gemma3_270m():
  config = gemma.GemmaConfig.from_hf(GEMMA3_270M)
  with torch.device('meta'):
    hf = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig.from_dict(GEMMA3_270M))
  hf_shapes = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != 'lm_head.weight'}
  model = nnx.eval_shape(lambda: gemma.GemmaModel(config, rngs=nnx.Rngs(0)))
  specs = gemma.weight_specs(config)
  assert {s.hf_key for s in specs} == set(hf_shapes)
  for spec in specs:
    node = model
    for entry in spec.path:
      node = node[entry] if isinstance(entry, int) else getattr(node, entry)
    ours = np.broadcast_to(np.zeros((), np.float32), node.shape)
    assert spec.to_hf(ours).shape == hf_shapes[spec.hf_key], spec.hf_key
  params = [p for _, p in nnx.iter_graph(model) if isinstance(p, nnx.Param)]
  assert len(params) == len(specs)
  assert sum(int(np.prod(p.shape)) for p in params) == sum(int(np.prod(s)) for s in hf_shapes.values())
  assert family_for('gemma3_text') is gemma.FAMILY


# -- parity with transformers -----------------------------------------------------


def test_logits_and_hidden_states_match_hf(family):
  _, hf, loaded = family
  ids, mask = _batch(0, 20)
  with torch.no_grad():
    out = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), output_hidden_states=True)
  real = mask.astype(bool)
  ours_hidden = np.asarray(loaded.model.hidden_states(jnp.asarray(ids), jnp.asarray(mask)))
  ours_logits = np.asarray(loaded.model(jnp.asarray(ids), jnp.asarray(mask)))
  ref_hidden = out.hidden_states[-1].numpy()
  assert np.abs(ours_hidden - ref_hidden)[real].max() <= 1e-4
  assert np.abs(ours_logits - out.logits.numpy())[real].max() <= 1e-4
  assert np.abs(out.logits.numpy()[real]).max() > 0.5  # not a vacuous comparison


def test_packed_rows_give_each_sequence_its_own_states(family):
  """Three sequences packed in one row (segment ids, then padding) get the hidden states
  each gets alone in its own right-padded row: attention stays in the segment, RoPE
  positions restart, and the sliding window (8) counts only the segment's tokens. Scanned,
  rematerialised layers give the same states."""
  _, _, ours = family
  lengths = (11, 3, 13)
  rng = np.random.RandomState(3)
  seqs = [rng.randint(3, VOCAB, size=n) for n in lengths]
  width = sum(lengths) + 5
  packed_ids = np.zeros((1, width), np.int32)
  segment_ids = np.zeros((1, width), np.int32)
  start = 0
  for s, seq in enumerate(seqs, 1):
    packed_ids[0, start:start + len(seq)] = seq
    segment_ids[0, start:start + len(seq)] = s
    start += len(seq)
  packed = np.asarray(ours.model.hidden_states(jnp.asarray(packed_ids), segment_ids=jnp.asarray(segment_ids)))
  scanned = nnx.clone(ours.model).set_layer_execution(scan_layers=True, remat=True)  # the fine-tunes' setting
  np.testing.assert_allclose(np.asarray(scanned.hidden_states(jnp.asarray(packed_ids),
                                                              segment_ids=jnp.asarray(segment_ids))),
                             packed, atol=2e-5, rtol=1e-4)
  start = 0
  for seq in seqs:
    ids = np.zeros((1, 16), np.int32)
    mask = np.zeros((1, 16), np.int32)
    ids[0, :len(seq)], mask[0, :len(seq)] = seq, 1
    alone = np.asarray(ours.model.hidden_states(jnp.asarray(ids), jnp.asarray(mask)))[0, :len(seq)]
    np.testing.assert_allclose(packed[0, start:start + len(seq)], alone, atol=2e-5, rtol=1e-4)
    start += len(seq)
  unsegmented = np.asarray(ours.model.hidden_states(jnp.asarray(packed_ids), jnp.asarray(segment_ids > 0)))
  assert np.abs(unsegmented[0, lengths[0]:sum(lengths)] - packed[0, lengths[0]:sum(lengths)]).max() > 1e-2


@pytest.mark.parametrize('scan_layers,remat', [(True, False), (True, True), (False, True)])
def test_scanned_and_rematerialised_layers_match_the_loop_and_hf(family, scan_layers, remat):
  """scan_layers / remat change how the layers run, not what they compute: the same logits as
  HF (sliding and full layers mixed in one scanned body for Gemma 2/3) and the same gradients
  as the Python loop for every parameter."""
  _, hf, loaded = family
  ids, mask = _batch(5, 20)
  with torch.no_grad():
    ref = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
  loop = loaded.model
  other = nnx.clone(loop).set_layer_execution(scan_layers=scan_layers, remat=remat)
  real = mask.astype(bool)
  assert np.abs(np.asarray(other(jnp.asarray(ids), jnp.asarray(mask))) - ref)[real].max() <= 1e-4

  def loss(model):
    logits = model(jnp.asarray(ids), jnp.asarray(mask))
    return jnp.sum(jax.nn.log_softmax(logits)[..., 7] * mask)

  grads = [jax.tree.leaves(nnx.state(jax.jit(nnx.grad(loss))(m), nnx.Param)) for m in (loop, other)]
  assert len(grads[0]) == len(grads[1]) > 10
  for a, b in zip(*grads):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4, rtol=1e-4)
  assert loop.scan_layers is False and loop.remat is False  # the clone did not touch the loop model


def test_scanned_layers_compile_one_layer_body():
  """With scan_layers the lowered forward holds one layer body whatever the depth."""
  ids, mask = _batch(6, 12)

  def matmuls(num_layers, scan):
    config = gemma.GemmaConfig.from_hf(_hf_model('gemma3').config.to_dict())
    config = gemma.GemmaConfig.from_hf(dict(config.to_hf(), num_hidden_layers=num_layers,
                                            layer_types=[SLIDING, FULL] * (num_layers // 2)))
    model = gemma.GemmaModel(config, rngs=nnx.Rngs(0)).set_layer_execution(scan_layers=scan)
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state: nnx.merge(graphdef, state)(jnp.asarray(ids), jnp.asarray(mask)))
    return fn.lower(state).as_text().count('dot_general')

  assert matmuls(8, True) == matmuls(2, True) > 0
  assert matmuls(8, False) - matmuls(2, False) == 3 * (matmuls(4, False) - matmuls(2, False)) > 0


def test_remat_saves_training_memory_over_scanned_layers():
  """The fine-tunes' setting (remat over scanned layers) reserves far fewer compiled temporaries
  for a gradient than the layer loop. In the loop, XLA's CPU compiler merges remat's
  recomputation back into the forward pass, so remat alone saves nothing there
  (:func:`recomp_jax.models.layers.run_layers`)."""
  config = gemma.GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_layers=8,
                             num_heads=4, num_kv_heads=1, head_dim=16, sliding_window=64,
                             query_pre_attn_scalar=16)
  ids = jnp.ones((2, 512), jnp.int32)

  def temporaries(scan, remat):
    model = gemma.GemmaModel(config, rngs=nnx.Rngs(0)).set_layer_execution(scan_layers=scan, remat=remat)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
      return jnp.mean(nnx.merge(graphdef, p, rest).hidden_states(ids, jnp.ones_like(ids)) ** 2)
    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

  loop = temporaries(False, False)
  assert temporaries(True, True) < 0.5 * loop
  if jax.default_backend() == 'cpu':
    assert temporaries(False, True) > 0.9 * loop  # XLA CPU: remat in the unrolled loop is undone


def test_greedy_generation_matches_hf(family):
  name, hf, loaded = family
  ids, mask = _batch(1, 11, pads=(0, 5, 8))  # prompts of 11, 6 and 3 tokens
  with torch.no_grad():
    ref = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), do_sample=False,
                      max_new_tokens=NEW_TOKENS, pad_token_id=0, eos_token_id=1)
  ref = ref[:, ids.shape[1]:].numpy()
  ref = np.pad(ref, ((0, 0), (0, NEW_TOKENS - ref.shape[1])))  # HF stops once all rows ended
  tokens, lengths = gemma_decoding.generate(
      loaded.model, ids, mask, sampling=generation.SamplingConfig(max_new_tokens=NEW_TOKENS),
      pad_id=0)
  np.testing.assert_array_equal(np.asarray(tokens), ref)
  assert len(np.unique(ref)) >= 8  # not a degenerate repetition
  ended = ref == 1
  expected_lengths = np.where(ended.any(1), ended.argmax(1) + 1, NEW_TOKENS)
  np.testing.assert_array_equal(np.asarray(lengths), expected_lengths)
  if name == 'gemma3':
    assert ids.shape[1] + NEW_TOKENS > hf.config.sliding_window  # the ring buffer wrapped


@pytest.mark.parametrize('chunks', [(10, 6), (3, 12)])
def test_cached_steps_match_uncached_forward(family, chunks):
  """Chunked prefill (fresh, then appended; chunks longer than the ring) + decode steps."""
  name, _, loaded = family
  if name == 'gemma' and chunks[0] < 10:
    pytest.skip('the second split targets ring buffers; Gemma 1 has none')
  model = loaded.model
  ids, mask = _batch(2, 20)
  full = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))
  cache = model.init_cache(3, 24)
  outputs, start = [], 0
  for size in chunks:
    hidden, cache = model.prefill(jnp.asarray(ids[:, start:start + size]),
                                  jnp.asarray(mask[:, start:start + size]), cache,
                                  return_hidden=True)
    outputs.append(np.asarray(model.logits(hidden)))
    start += size
  for t in range(start, 20):
    logits, cache = model.decode_step(jnp.asarray(ids[:, t]), cache)
    outputs.append(np.asarray(logits)[:, None])
  cached = np.concatenate(outputs, axis=1)
  real = mask.astype(bool)
  assert np.abs(cached - full)[real].max() <= 1e-4
  assert int(cache.length) == 20
  np.testing.assert_array_equal(np.asarray(cache.next_position), mask.sum(1))


@pytest.mark.parametrize('chunk', [6, 10, 40])
def test_prefill_in_chunks_equals_one_prefill(family, chunk):
  """A long prompt prefilled 6 tokens at a time (first chunk 5, pads inside it; chunks shorter
  than the window of 8, the whole prompt longer than it) leaves the last hidden state and a cache
  that continue as one prefill's do; a chunk over the prompt is one prefill."""
  _, _, loaded = family
  model = loaded.model
  ids, mask = _batch(7, 23, pads=(0, 3))
  ids, mask = jnp.asarray(ids), jnp.asarray(mask)
  hidden, whole = model.prefill(ids, mask, model.init_cache(2, 26), return_hidden=True)
  last, chunked = jax.jit(functools.partial(model.prefill_in_chunks, chunk=chunk))(ids, mask, model.init_cache(2, 26))
  assert np.abs(np.asarray(last) - np.asarray(hidden[:, -1])).max() <= 1e-4
  tokens = jnp.asarray([5, 9])
  for _ in range(3):
    ref, whole = model.decode_step(tokens, whole)
    ours, chunked = model.decode_step(tokens, chunked)
    assert np.abs(np.asarray(ours) - np.asarray(ref)).max() <= 1e-4
    tokens = jnp.argmax(ref, -1)
  assert int(chunked.length) == 26


def test_shared_prefix_cache_reuse(family):
  """One prefix encoded once, tiled and continued with left-padded chunks (pads mid-sequence)."""
  _, _, loaded = family
  model = loaded.model
  prefix, _ = _batch(3, 9, pads=(0,))
  cont, cont_mask = _batch(4, 7, pads=(0, 2, 5))
  base = model.init_cache(1, 16)
  _, base = gemma_decoding.prefill(model, prefix, np.ones_like(prefix), base)
  results = []
  for _ in range(2):  # the prefix cache survives being continued (copy before donation)
    tiled = gemma_decoding.copy_cache(base).take(jnp.zeros((3,), jnp.int32))
    hidden, _ = gemma_decoding.prefill(model, cont, cont_mask, tiled, return_hidden=True)
    results.append(np.asarray(hidden))
  ids = np.concatenate([np.repeat(prefix, 3, 0), cont], axis=1)
  mask = np.concatenate([np.ones((3, 9), np.int64), cont_mask], axis=1)
  ref = np.asarray(model.hidden_states(jnp.asarray(ids), jnp.asarray(mask)))[:, 9:]
  real = cont_mask.astype(bool)
  assert np.abs(results[0] - ref)[real].max() <= 1e-4
  np.testing.assert_array_equal(results[0], results[1])


def test_generation_from_a_shared_prefix_matches_full_prompts(family):
  """Prefix prefilled once, continuations of 2..12 tokens left-padded after it: the padding
  between prefix and continuation (up to 14 indices, more than the window of 8) must change
  no token, so windows count positions and the ring keeps the slack."""
  _, _, loaded = family
  model = loaded.model
  rng = np.random.RandomState(5)
  prefix = rng.randint(3, VOCAB, size=9).tolist()
  continuations = [rng.randint(3, VOCAB, size=n).tolist() for n in (2, 12, 7)]
  sampling = generation.SamplingConfig(max_new_tokens=NEW_TOKENS)
  full = [prefix + c for c in continuations]
  ids, mask = _batch(0, max(map(len, full)), pads=[max(map(len, full)) - len(r) for r in full])
  for i, row in enumerate(full):
    ids[i, len(ids[i]) - len(row):] = row
  expected, expected_lengths = gemma_decoding.generate(model, ids, mask, sampling=sampling, pad_id=0)
  cont_ids = np.zeros((3, 16), np.int64)
  cont_mask = np.zeros((3, 16), np.int64)
  for i, row in enumerate(continuations):
    cont_ids[i, 16 - len(row):], cont_mask[i, 16 - len(row):] = row, 1
  tokens, lengths = gemma_decoding.generate_from_prefix(
      model, prefix, cont_ids, cont_mask, sampling=sampling, stop_mask=gemma_decoding.eos_stop_mask(model),
      rng=jax.random.key(0), pad_id=0)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected))
  np.testing.assert_array_equal(np.asarray(lengths), np.asarray(expected_lengths))
  assert len(np.unique(np.asarray(expected))) >= 8


def test_export_roundtrip_loads_in_transformers(family, tmp_path):
  _, hf, loaded = family
  export_pretrained(loaded, str(tmp_path))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path),
                                                               attn_implementation='eager').eval()
  assert type(reloaded) is type(hf)
  ids, mask = _batch(5, 12)
  with torch.no_grad():
    a = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
    b = reloaded(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
  np.testing.assert_allclose(b, a, atol=1e-6, rtol=0)
  with open(os.path.join(str(tmp_path), 'config.json')) as f:
    assert json.load(f)['model_type'] == hf.config.model_type


def test_bidirectional_gemma3_matches_hf(tmp_path):
  """EmbeddingGemma-style: no causal mask, sliding layers see |i - j| < window // 2 + 1."""
  hf = _hf_model('gemma3', seed=2, use_bidirectional_attention=True)
  hf.save_pretrained(str(tmp_path))
  model = load_pretrained(str(tmp_path)).model
  assert model.config.use_bidirectional_attention and model.config.sliding_window == 8
  ids, mask = _batch(8, 20)
  with torch.no_grad():
    ref = hf(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
             output_hidden_states=True).hidden_states[-1].numpy()
  ours = np.asarray(model.hidden_states(jnp.asarray(ids), jnp.asarray(mask)))
  assert np.abs(ours - ref)[mask.astype(bool)].max() <= 1e-4
  with pytest.raises(ValueError, match='bidirectional'):
    model.init_cache(1, 8)


# -- decoding behaviour -------------------------------------------------------------


@pytest.fixture(scope='module')
def gemma3(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp('gemma3_only'))
  _hf_model('gemma3', seed=1).save_pretrained(directory)
  return directory


def test_sampling_is_reproducible(gemma3):
  model = load_pretrained(gemma3).model
  ids, mask = _batch(6, 11, pads=(0, 5, 8))
  sampling = generation.SamplingConfig(temperature=1.0, top_p=0.9, max_new_tokens=NEW_TOKENS)
  run = lambda seed: np.asarray(gemma_decoding.generate(
      model, ids, mask, sampling=sampling, rng=jax.random.key(seed),
      stop_mask=np.zeros(VOCAB, bool))[0])
  first = run(1)
  np.testing.assert_array_equal(first, run(1))
  assert not np.array_equal(first, run(2))
  assert first.min() >= 0 and first.max() < VOCAB


def test_bfloat16_compute(gemma3):
  f32 = load_pretrained(gemma3).model
  bf16 = load_pretrained(gemma3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16).model
  ids, mask = _batch(7, 20)
  ref = np.asarray(f32(jnp.asarray(ids), jnp.asarray(mask)))
  logits = bf16(jnp.asarray(ids), jnp.asarray(mask))
  assert logits.dtype == jnp.bfloat16
  real = mask.astype(bool)
  err = np.abs(np.asarray(logits, np.float32) - ref)[real]
  assert err.max() <= 0.1 * np.abs(ref[real]).max()
  cache = bf16.init_cache(3, 24)
  assert cache.keys[0].dtype == jnp.bfloat16
  tokens, lengths = gemma_decoding.generate(bf16, ids[:, :11], mask[:, :11],
                                            sampling=generation.SamplingConfig(max_new_tokens=8))
  assert tokens.shape == (3, 8) and np.asarray(lengths).min() >= 1
  agree = (np.asarray(tokens) == np.asarray(gemma_decoding.generate(
      f32, ids[:, :11], mask[:, :11], sampling=generation.SamplingConfig(max_new_tokens=8))[0]))
  assert agree[:, 0].all()  # the first greedy token survives bfloat16


def _char_tokenizer(seq2seq: bool = False):
  return tiny_models.char_tokenizer(VOCAB, seq2seq=seq2seq)


def test_generator_texts_match_hf_greedy(gemma3):
  tokenizer = _char_tokenizer()
  prompts = ['Hello there', 'ab', 'The quick brown']
  hf = transformers.AutoModelForCausalLM.from_pretrained(gemma3, attn_implementation='eager').eval()
  enc = tokenizer(prompts, padding=True, padding_side='left', return_tensors='pt')
  with torch.no_grad():
    out = hf.generate(**enc, do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=1)
  expected = []
  for row in out[:, enc['input_ids'].shape[1]:]:
    text = tokenizer.decode(row.tolist(), skip_special_tokens=True)
    expected.append(text.split('\n')[0])
  generator = generation.GemmaGenerator(load_pretrained(gemma3).model, tokenizer,
                                       batch_size=2)
  texts = generator(prompts, max_new_tokens=12, stop_strings=['\n'])
  assert texts == expected
  assert any(texts)


def test_generator_shares_a_common_prompt_prefix(gemma3):
  """Prompts with a common few-shot block: the generator prefills it once and gives the
  texts of the full-prompt path; a prompt that ends where the block ends still works."""
  tokenizer = _char_tokenizer()
  block = 'Q: sky colour\nA: blue\n\nQ: grass\nA: green\n\n'
  prompts = [block + q for q in ('Q: sun\nA:', 'Q: a long question about the sea\nA:', 'Q',
                                 'Q: snow\nA:', 'Q: night\nA:')]
  model = load_pretrained(gemma3).model
  shared = generation.GemmaGenerator(model, tokenizer, batch_size=2, min_shared_prefix=16)
  plain = generation.GemmaGenerator(model, tokenizer, batch_size=2, min_shared_prefix=0)
  rows = tokenizer(prompts)['input_ids']
  assert generation.common_prefix_length(rows) >= len(block)
  calls = []
  original = shared.generate_with_prefix
  shared.generate_with_prefix = lambda *a, **k: calls.append(1) or original(*a, **k)
  texts = shared(prompts, max_new_tokens=12, stop_strings=['\n'])
  assert calls and texts == plain(prompts, max_new_tokens=12, stop_strings=['\n'])
  assert len(set(texts)) >= 2


def test_greedy_generation_batches_prompts_by_length_and_returns_input_order(gemma3):
  """Greedy: prompts run in batches of similar length (each batch pads to its own bucket) and
  the texts come back in input order, each equal to the prompt generated alone."""
  tokenizer = _char_tokenizer()
  prompts = ['a much longer prompt about the weather at sea', 'ab', 'The quick brown fox jumps',
             'Hi', 'another long prompt, about mountains and snow', 'xyz q']
  generator = generation.GemmaGenerator(load_pretrained(gemma3).model, tokenizer, batch_size=2,
                                        min_shared_prefix=0)
  shapes = []
  original = generator.generate_batch
  generator.generate_batch = lambda ids, mask, rng, **kw: shapes.append(ids.shape) or original(ids, mask, rng, **kw)
  texts = generator(prompts, max_new_tokens=8, stop_strings=['\n'])
  alone = generation.GemmaGenerator(generator.model, tokenizer, batch_size=1, min_shared_prefix=0)
  assert texts == [alone([p], max_new_tokens=8, stop_strings=['\n'])[0] for p in prompts]
  # batch widths (BOS + characters) before bucketing: in input order they would be 47, 26, 46
  assert [shape[1] for shape in shapes] == [3, 26, 46]


def test_first_token_decides_empty_by_the_total_stop_mass():
  """``empty_threshold``: a row stops at once iff its stop tokens together reach the threshold;
  otherwise its first token is the best (or a sampled) non-stop token. Plain greedy compares
  each stop token with each word alone."""
  stop = np.zeros(8, bool)
  stop[[6, 7]] = True
  probs = np.array([[.09, .09, .15, .09, .09, .09, .00, .40],   # stopping 40%: the likeliest token
                    [.05, .35, .00, .00, .00, .00, .32, .28]])  # stopping 60% over two tokens
  logits = jnp.log(jnp.asarray(probs, jnp.float32) + 1e-12)
  key = jax.random.key(0)
  first = lambda **kw: np.asarray(generation.first_token(logits, key, generation.SamplingConfig(**kw), stop))
  assert first().tolist() == [7, 1]
  assert first(empty_threshold=0.5).tolist() == [2, 6]
  assert first(empty_threshold=0.3).tolist() == [7, 6]
  assert first(empty_threshold=0.7).tolist() == [2, 1]
  sampled = generation.SamplingConfig(temperature=1.0, empty_threshold=0.5)
  draws = np.asarray(jax.vmap(lambda k: generation.first_token(logits, k, sampled, stop))(
      jax.random.split(key, 300)))  # [300, 2]
  assert not stop[draws[:, 0]].any() and len(set(draws[:, 0].tolist())) >= 4
  assert (draws[:, 1] == 6).all()


def test_generator_empty_threshold_keeps_greedy_texts_or_empties_them(gemma3):
  tokenizer = _char_tokenizer()
  prompts = ['Hello there', 'ab', 'The quick brown']
  generator = generation.GemmaGenerator(load_pretrained(gemma3).model, tokenizer, batch_size=2)
  plain = generator(prompts, max_new_tokens=12, stop_strings=['\n'])
  assert all(plain)  # no row stops at once, so a high threshold changes nothing
  assert generator(prompts, max_new_tokens=12, stop_strings=['\n'], empty_threshold=0.99) == plain
  assert generator(prompts, max_new_tokens=12, stop_strings=['\n'], empty_threshold=1e-6) == ['', '', '']


def test_common_prefix_length_leaves_a_token_per_row():
  assert generation.common_prefix_length([[1, 2, 3, 4], [1, 2, 3, 5, 6]]) == 3
  assert generation.common_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2
  assert generation.common_prefix_length([[7, 2], [1, 2]]) == 0
  assert generation.common_prefix_length([]) == 0


def test_row_sampler_greedy_matches_generate_and_rows_ignore_batch_mates(gemma3):
  """Step-wise serving generation: greedy rows equal :func:`generate`; a sampled row gives the
  same tokens alone as beside other rows (each row has its own PRNG stream)."""
  model = load_pretrained(gemma3).model
  ids, mask = _batch(8, 11, pads=(0, 5, 8))
  steps, new = 4, 13
  expected = np.asarray(gemma_decoding.generate(
      model, ids, mask, sampling=generation.SamplingConfig(max_new_tokens=new),
      stop_mask=np.zeros(VOCAB, bool), pad_id=0)[0])
  ids16, mask16 = gemma_decoding.left_pad(ids, mask, 16, 0)

  def run(rows, temperature, top_p, seeds):
    sampler = gemma_decoding.RowSampler(model, ids16[rows], mask16[rows], seeds=np.array(seeds),
                                        temperature=np.array(temperature, np.float32),
                                        top_p=np.array(top_p, np.float32), max_new_tokens=new,
                                        steps=steps)
    out = [sampler.start()[:, None]]
    while sampler.generated < new:
      out.append(sampler.advance())
    return np.concatenate(out, axis=1)[:, :new]

  np.testing.assert_array_equal(run([0, 1, 2], [0.0] * 3, [1.0] * 3, [0, 1, 2]), expected)
  mixed = run([0, 1, 2], [0.0, 1.0, 1.0], [1.0, 0.8, 1.0], [5, 6, 7])
  np.testing.assert_array_equal(mixed[0], expected[0])
  alone = run([1], [1.0], [0.8], [6])
  np.testing.assert_array_equal(mixed[1], alone[0])
  assert not np.array_equal(mixed[1], expected[1]) or not np.array_equal(mixed[2], expected[2])


def test_inverse_cdf_sampling_draws_the_distribution_and_never_a_masked_token():
  rng = np.random.default_rng(0)
  vocab = 1500  # three blocks of 512, the last one part padding
  logits = rng.normal(size=vocab) * 2.0
  masked = [3, 511, 512, 700, 1499]
  logits[masked] = -np.inf
  probs = np.exp(logits - logits[np.isfinite(logits)].max())
  probs /= probs.sum()
  n = 60_000
  keys = jax.random.split(jax.random.key(0), n)
  tokens = np.asarray(generation.inverse_cdf_sample(jnp.tile(jnp.asarray(probs, jnp.float32), (n, 1)), keys))
  assert tokens.dtype == np.int32 and not np.isin(tokens, masked).any()
  counts = np.bincount(tokens, minlength=vocab)
  expected = probs * n
  big = expected >= 5  # Pearson's chi-square over the tokens drawn often enough, the rest pooled
  observed = np.append(counts[big], counts[~big].sum())
  wanted = np.append(expected[big], expected[~big].sum())
  chi2, dof = float(((observed - wanted) ** 2 / wanted).sum()), len(observed) - 1
  assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)
  shifted = np.roll(counts, 1)  # an off-by-one sampler would fail the same test badly
  assert float(((np.append(shifted[big], shifted[~big].sum()) - wanted) ** 2 / wanted).sum()) > 10 * dof
  for hot in (0, 1023, 1498):  # all mass on one token, at a block edge or the end
    one = np.zeros((4, vocab), np.float32)
    one[:, hot] = 1.0
    assert (np.asarray(generation.inverse_cdf_sample(jnp.asarray(one), keys[:4])) == hot).all()
  batch = generation.inverse_cdf_sample(jnp.tile(jnp.asarray(probs, jnp.float32), (3, 1)), keys[:3])
  alone = generation.inverse_cdf_sample(jnp.asarray(probs, jnp.float32)[None], keys[1:2])
  assert int(batch[1]) == int(alone[0])  # one stream per row


def test_nucleus_mask_keeps_the_smallest_set_reaching_top_p():
  rng = np.random.RandomState(0)
  logits = rng.normal(size=(4, 50)).astype(np.float32) * 3
  probs = np.asarray(jax.nn.softmax(jnp.asarray(logits), axis=-1))
  top_p = np.array([0.5, 0.9, 1.0, 0.01], np.float32)
  mask = np.asarray(generation.nucleus_mask(jnp.asarray(probs), jnp.asarray(top_p)))
  for row in range(4):
    order = np.argsort(-probs[row])
    before = np.cumsum(probs[row][order]) - probs[row][order]
    expected = np.zeros(50, bool)
    expected[order[before < top_p[row]]] = True
    np.testing.assert_array_equal(mask[row], expected)
  assert mask[2].all() and mask[3].sum() == 1


def test_stop_token_mask_marks_the_pieces_holding_a_stop_string_and_is_kept_per_tokenizer():
  from recomp_jax.models.decoding import stop_token_mask
  from recomp_jax.pretrained import load_tokenizer, resolve_demo_model
  tokenizer = load_tokenizer(resolve_demo_model('', 'encoder'), fresh=True)  # BERT: 30k pieces
  vocab = len(tokenizer)
  texts = [tokenizer.convert_tokens_to_string([p]) for p in tokenizer.convert_ids_to_tokens(list(range(vocab)))]
  commas = np.array([',' in t for t in texts])
  assert 2 <= commas.sum() < 100
  np.testing.assert_array_equal(stop_token_mask(tokenizer, vocab, (',',)), commas)
  with_eos = stop_token_mask(tokenizer, vocab, (',',), eos_ids=(5,))  # the kept mask, plus EOS
  np.testing.assert_array_equal(with_eos, commas | (np.arange(vocab) == 5))
  np.testing.assert_array_equal(stop_token_mask(tokenizer, vocab, (',',)), commas)  # the kept one unchanged
  tokenizer.add_tokens(['zz,zz'])
  grown = stop_token_mask(tokenizer, vocab + 1, (',',))
  assert grown[vocab] and (grown[:vocab] == commas).all()
