"""T5 (v1.0 relu + tied head, v1.1 gated-gelu + untied head) against Hugging Face PyTorch.

Tiny random ``T5ForConditionalGeneration`` models are saved with
``save_pretrained`` and loaded through our ``load_pretrained`` (so the weight
map is tested too), then compared in float32 with padding in the batch.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import torch
import transformers
from recomp_jax.models import generation, t5  # noqa: E402
from recomp_jax.pretrained import Pretrained, export_pretrained, load_pretrained  # noqa: E402

VOCAB, D_MODEL = 96, 32
TOL = 1e-4
MAX_NEW = 20

# Three encoder inputs of lengths 12, 7 and 4, right-padded with 0 (as T5's tokenizer does).
LENGTHS = np.array([12, 7, 4])
INPUT_IDS = np.array([[13, 52, 77, 40, 9, 88, 31, 64, 27, 70, 45, 1],
                      [5, 91, 36, 58, 22, 17, 1, 0, 0, 0, 0, 0],
                      [71, 11, 84, 1, 0, 0, 0, 0, 0, 0, 0, 0]])
ATTENTION_MASK = (np.arange(12)[None, :] < LENGTHS[:, None]).astype(np.int64)
DECODER_IDS = np.array([[0, 17, 45, 3, 88, 60, 21, 9, 30],
                        [0, 44, 2, 71, 19, 5, 80, 13, 62],
                        [0, 90, 33, 7, 51, 26, 12, 48, 77]])
DECODER_MASK = (np.arange(9)[None, :] < np.array([9, 6, 3])[:, None]).astype(np.int64)


def _hf_config(variant: str, **overrides):
  relu = variant == 'v1_0'
  kwargs = dict(vocab_size=VOCAB, d_model=D_MODEL, d_kv=8, d_ff=64, num_layers=3, num_decoder_layers=2,
                num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                feed_forward_proj='relu' if relu else 'gated-gelu', tie_word_embeddings=relu,
                decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
  kwargs.update(overrides)
  # transformers' generate sizes its cache by num_layers, so the encoder is the deeper stack.
  return transformers.T5Config(**kwargs)


def _hf_model(variant: str, *, untie: bool = True):
  """A seeded random HF model whose greedy output is not one repeated token.

  Random tiny T5s collapse onto a constant or self-repeating token; the weight
  tweaks make the next token depend on the input (and exercise every weight):
  random norm scales, a stronger MLP (for ReLU without its constant mean
  output direction), and random signs in the decoder's final norm so the tied
  head does not favour the token just read.
  """
  relu = variant == 'v1_0'
  torch.manual_seed(1)
  model = transformers.T5ForConditionalGeneration(_hf_config(variant)).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if 'layer_norm' in name:
        p.uniform_(0.5, 1.5)
      elif 'DenseReluDense' in name:
        p.mul_(3.0)
      if relu and name.endswith('DenseReluDense.wo.weight'):
        p.sub_(p.mean(1, keepdim=True))
    final = model.decoder.final_layer_norm.weight
    final.mul_(torch.sign(torch.randn_like(final)))
    if not relu and untie:
      # transformers>=5 ties a fresh model's head; Flan-style checkpoints store their own.
      model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, D_MODEL) * D_MODEL ** -0.5)
  return model


@dataclasses.dataclass
class Pair:
  variant: str
  hf: 'transformers.T5ForConditionalGeneration'
  ours: Pretrained
  directory: str


@pytest.fixture(scope='module', params=['v1_0', 'v1_1'])
def pair(request, tmp_path_factory) -> Pair:
  hf = _hf_model(request.param)
  directory = str(tmp_path_factory.mktemp(f't5_{request.param}'))
  hf.save_pretrained(directory)
  return Pair(request.param, hf, load_pretrained(directory), directory)


def _hf_forward(hf, decoder_mask=None):
  with torch.no_grad():
    out = hf(input_ids=torch.tensor(INPUT_IDS), attention_mask=torch.tensor(ATTENTION_MASK),
             decoder_input_ids=torch.tensor(DECODER_IDS),
             decoder_attention_mask=None if decoder_mask is None else torch.tensor(decoder_mask))
  return out.encoder_last_hidden_state.numpy(), out.logits.numpy()


# Eager calls: for models this small, op-by-op dispatch (whose compiled ops are shared by
# every model and test) costs less than compiling each model's forward.
def _encode(model, ids, mask):
  return model.encode(ids, mask)


def _forward(model, ids, mask, decoder_ids):
  return model(ids, mask, decoder_ids)


def _decode(model, decoder_ids, encoder, mask, decoder_mask=None):
  return model.decode(decoder_ids, encoder, mask, decoder_mask)


def _max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))


# ----------------------------------------------------------------------------- config


def test_config_round_trip_through_transformers():
  for variant in ('v1_0', 'v1_1'):
    hf_config = _hf_config(variant)
    ours = t5.T5Config.from_hf(hf_config.to_dict())
    assert ours.is_gated == (variant == 'v1_1')
    assert ours.activation == ('relu' if variant == 'v1_0' else 'gelu_new')
    assert ours.scale_decoder_outputs == (variant == 'v1_0')
    back = transformers.T5Config(**ours.to_hf())
    assert back.scale_decoder_outputs == ours.scale_decoder_outputs
    assert back.is_gated_act == ours.is_gated and back.dense_act_fn == ours.activation
    assert (back.num_layers, back.num_decoder_layers, back.d_kv) == (3, 2, 8)
    assert t5.T5Config.from_hf(ours.to_hf()) == ours


@pytest.mark.parametrize('proj', ['gated-swish', 'relu-gated', 'gated-gelu-new', 'tanh'])
def test_unsupported_feed_forward_proj_is_rejected(proj):
  with pytest.raises(ValueError, match='feed_forward_proj'):
    t5.T5Config.from_hf({'feed_forward_proj': proj})


def test_relative_position_buckets_match_transformers():
  bucket_fn = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
  relative = np.arange(-300, 301)[None, :] - np.arange(0, 3)[:, None]
  for bidirectional in (True, False):
    for num_buckets, max_distance in ((32, 128), (8, 16), (64, 256)):
      expected = bucket_fn(torch.tensor(relative), bidirectional=bidirectional,
                           num_buckets=num_buckets, max_distance=max_distance).numpy()
      got = t5.relative_position_bucket(relative, bidirectional=bidirectional,
                                        num_buckets=num_buckets, max_distance=max_distance)
      np.testing.assert_array_equal(got, expected)


# ----------------------------------------------------------------------------- forward parity


def test_loaded_head_layout(pair):
  config = pair.ours.config
  if pair.variant == 'v1_0':
    assert config.tie_word_embeddings and config.scale_decoder_outputs
    assert pair.ours.model.lm_head is None
  else:
    assert not config.tie_word_embeddings and not config.scale_decoder_outputs
    np.testing.assert_array_equal(np.asarray(pair.ours.model.lm_head.kernel[...]).T,
                                  pair.hf.lm_head.weight.detach().numpy())


def test_forward_matches_transformers(pair):
  model = pair.ours.model
  hf_encoder, hf_logits = _hf_forward(pair.hf)
  encoder = _encode(model, jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK))
  assert encoder.shape == (3, 12, D_MODEL)
  assert _max_diff(encoder, hf_encoder) <= TOL
  logits = _forward(model, jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK),
                    jnp.asarray(DECODER_IDS))
  assert logits.shape == (3, 9, VOCAB) and logits.dtype == jnp.float32
  assert _max_diff(logits, hf_logits) <= TOL
  assert np.abs(hf_logits).max() > 1.0  # the comparison is not between near-zero numbers

  # The head applied at chosen positions only (how target scoring uses it).
  hidden = model.decode_hidden(jnp.asarray(DECODER_IDS), encoder, jnp.asarray(ATTENTION_MASK))
  rows, cols = np.array([0, 1, 2, 2]), np.array([8, 3, 0, 5])
  assert _max_diff(model.logits(hidden[rows, cols]), hf_logits[rows, cols]) <= TOL


@pytest.mark.parametrize('scan_layers,remat', [(True, False), (True, True), (False, True)])
def test_scanned_and_rematerialised_layers_match_the_loop_and_transformers(pair, scan_layers, remat):
  """Scanned / rematerialised encoder and teacher-forced decoder: HF's logits (padded targets
  included) and the loop's gradients for every parameter."""
  _, hf_logits = _hf_forward(pair.hf, DECODER_MASK)
  loop = pair.ours.model
  other = nnx.clone(loop).set_layer_execution(scan_layers=scan_layers, remat=remat)
  args = (jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK), jnp.asarray(DECODER_IDS),
          jnp.asarray(DECODER_MASK))
  valid = DECODER_MASK.astype(bool)
  assert _max_diff(np.asarray(other(*args))[valid], hf_logits[valid]) <= TOL

  def loss(model):
    return jnp.sum(jax.nn.log_softmax(model(*args))[..., 5] * DECODER_MASK)

  grads = [jax.tree.leaves(nnx.state(jax.jit(nnx.grad(loss))(m), nnx.Param)) for m in (loop, other)]
  assert len(grads[0]) == len(grads[1]) > 10
  for a, b in zip(*grads):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-4, rtol=1e-4)
  assert not loop.encoder.scan_layers and not loop.decoder.remat


def test_scanned_layers_compile_one_layer_body():
  """Scanned, the lowered forward holds one encoder and one decoder layer body at any depth."""
  args = (jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK), jnp.asarray(DECODER_IDS))

  def matmuls(num_layers, scan):
    config = t5.T5Config.from_hf(_hf_config('v1_1', num_layers=num_layers,
                                            num_decoder_layers=num_layers).to_dict())
    model = t5.T5Model(config, rngs=nnx.Rngs(0)).set_layer_execution(scan_layers=scan)
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda state: nnx.merge(graphdef, state)(*args))
    return fn.lower(state).as_text().count('dot_general')

  assert matmuls(6, True) == matmuls(2, True) > 0
  assert matmuls(6, False) - matmuls(2, False) == 2 * (matmuls(4, False) - matmuls(2, False)) > 0


def test_padded_decoder_targets_match_transformers(pair):
  _, hf_logits = _hf_forward(pair.hf, DECODER_MASK)
  model = pair.ours.model
  encoder = _encode(model, jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK))
  logits = _decode(model, jnp.asarray(DECODER_IDS), encoder, jnp.asarray(ATTENTION_MASK),
                   jnp.asarray(DECODER_MASK))
  valid = DECODER_MASK.astype(bool)
  assert _max_diff(np.asarray(logits)[valid], hf_logits[valid]) <= TOL


def test_cached_steps_match_teacher_forcing(pair):
  model = pair.ours.model
  ids, mask = jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK)
  encoder = _encode(model, ids, mask)
  full = _decode(model, jnp.asarray(DECODER_IDS), encoder, mask)
  state = model.init_decode_state(encoder, mask, max_length=12)
  step = nnx.jit(lambda m, tok, s, pos: m.decode_step(tok, s, pos))
  # A two-token chunk first, then one token at a time.
  logits, state = step(model, jnp.asarray(DECODER_IDS[:, :2]), state, 0)
  chunks = [logits]
  for pos in range(2, DECODER_IDS.shape[1]):
    logits, state = step(model, jnp.asarray(DECODER_IDS[:, pos:pos + 1]), state, pos)
    chunks.append(logits)
  assert _max_diff(jnp.concatenate(chunks, axis=1), full) <= 1e-5


# ----------------------------------------------------------------------------- generation


def _hf_generate(hf, **kwargs):
  with torch.no_grad():
    out = hf.generate(input_ids=torch.tensor(INPUT_IDS), attention_mask=torch.tensor(ATTENTION_MASK),
                      do_sample=False, max_new_tokens=MAX_NEW, **kwargs)
  out = out[:, 1:].numpy()  # drop decoder_start_token_id
  return np.pad(out, ((0, 0), (0, MAX_NEW - out.shape[1])))  # HF stops early once all rows ended


GREEDY = generation.SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)


def test_greedy_generation_matches_transformers(pair):
  expected = _hf_generate(pair.hf)
  tokens, lengths = t5.generate(pair.ours.model, INPUT_IDS, ATTENTION_MASK, sampling=GREEDY,
                                stop_mask=t5.default_stop_mask(pair.ours.config))
  tokens, lengths = np.asarray(tokens), np.asarray(lengths)
  assert tokens.shape == (3, MAX_NEW)
  np.testing.assert_array_equal(lengths, [MAX_NEW] * 3)  # no EOS in these 20 tokens
  assert len(np.unique(tokens)) >= 10, tokens  # a non-degenerate model
  np.testing.assert_array_equal(tokens, expected)


def test_generation_stops_like_transformers(pair):
  tokens, _ = t5.generate(pair.ours.model, INPUT_IDS, ATTENTION_MASK, sampling=GREEDY)
  stop = int(np.asarray(tokens)[0, 5])  # a token that row 0 produces mid-sequence
  stop_mask = np.zeros(VOCAB, bool)
  stop_mask[stop] = True
  got, lengths = t5.generate(pair.ours.model, INPUT_IDS, ATTENTION_MASK, sampling=GREEDY,
                             stop_mask=stop_mask)
  got, lengths = np.asarray(got), np.asarray(lengths)
  assert lengths[0] <= 6 and got[0, lengths[0] - 1] == stop
  for row, n in zip(got, lengths):
    assert (row[n:] == 0).all()
  np.testing.assert_array_equal(got, _hf_generate(pair.hf, eos_token_id=stop))


def test_sampling_is_reproducible_and_bounded(pair):
  if pair.variant != 'v1_1':
    pytest.skip('one variant is enough')
  sampling = generation.SamplingConfig(temperature=0.8, top_p=0.9, max_new_tokens=12)
  run = lambda seed: t5.generate(pair.ours.model, INPUT_IDS, ATTENTION_MASK, sampling=sampling,
                                 rng=jax.random.key(seed))
  tokens_a, lengths_a = map(np.asarray, run(0))
  tokens_b, lengths_b = map(np.asarray, run(0))
  tokens_c, _ = map(np.asarray, run(1))
  assert tokens_a.shape == (3, 12)
  assert ((lengths_a >= 1) & (lengths_a <= 12)).all()
  assert ((tokens_a >= 0) & (tokens_a < VOCAB)).all()
  np.testing.assert_array_equal(tokens_a, tokens_b)
  np.testing.assert_array_equal(lengths_a, lengths_b)
  assert (tokens_a != tokens_c).any()


# ----------------------------------------------------------------------------- checkpoints


def test_export_round_trip(pair, tmp_path):
  out = export_pretrained(pair.ours, str(tmp_path / 'export'))
  reloaded = transformers.T5ForConditionalGeneration.from_pretrained(out).eval()
  hf_encoder, hf_logits = _hf_forward(reloaded)
  _, original_logits = _hf_forward(pair.hf)
  assert _max_diff(hf_logits, original_logits) == 0.0
  ours = _forward(pair.ours.model, jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK),
                  jnp.asarray(DECODER_IDS))
  assert _max_diff(ours, hf_logits) <= TOL
  again = load_pretrained(out)
  assert again.config == pair.ours.config


def test_transformers5_tied_unscaled_checkpoint(tmp_path):
  """A fresh gated-gelu model saved by transformers>=5: tied head, no scaling, no lm_head tensor."""
  hf = _hf_model('v1_1', untie=False)
  hf.save_pretrained(str(tmp_path))
  loaded = load_pretrained(str(tmp_path))
  assert loaded.config.tie_word_embeddings and not loaded.config.scale_decoder_outputs
  _, hf_logits = _hf_forward(hf)
  logits = _forward(loaded.model, jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK),
                    jnp.asarray(DECODER_IDS))
  assert _max_diff(logits, hf_logits) <= TOL


def test_embedding_stored_under_a_tied_name(pair, tmp_path):
  from safetensors.numpy import load_file, save_file
  tensors = load_file(f'{pair.directory}/model.safetensors')
  tensors['encoder.embed_tokens.weight'] = tensors.pop('shared.weight')
  save_file(tensors, str(tmp_path / 'model.safetensors'), metadata={'format': 'pt'})
  (tmp_path / 'config.json').write_text(open(f'{pair.directory}/config.json').read())
  loaded = load_pretrained(str(tmp_path))
  np.testing.assert_array_equal(np.asarray(loaded.model.shared.embedding[...]),
                                np.asarray(pair.ours.model.shared.embedding[...]))
  assert loaded.config == pair.ours.config


def test_encoder_only_checkpoint(tmp_path):
  torch.manual_seed(3)
  hf = transformers.T5EncoderModel(_hf_config('v1_1')).eval()
  hf.save_pretrained(str(tmp_path))
  loaded = load_pretrained(str(tmp_path))
  assert loaded.config.encoder_only and loaded.model.decoder is None
  with torch.no_grad():
    expected = hf(input_ids=torch.tensor(INPUT_IDS),
                  attention_mask=torch.tensor(ATTENTION_MASK)).last_hidden_state.numpy()
  got = _encode(loaded.model, jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK))
  assert _max_diff(got, expected) <= TOL
  exported = export_pretrained(loaded, str(tmp_path / 'export'))
  assert transformers.AutoConfig.from_pretrained(exported).architectures == ['T5EncoderModel']


def test_parameters_carry_logical_axes(pair):
  vocabulary = {'vocab', 'embed', 'mlp', 'heads', 'kv_heads', 'head_dim', 'norm', 'relpos'}
  params = nnx.state(pair.ours.model, nnx.Param)
  axes = {}
  for path, variable in nnx.to_flat_state(params):
    names = variable.get_metadata()['out_sharding']
    assert len(names) == variable.get_value().ndim and set(names) <= vocabulary, (path, names)
    axes[path] = names
  assert axes[('shared', 'embedding')] == ('vocab', 'embed')
  assert axes[('encoder', 'relative_bias', 'embedding')] == ('relpos', 'heads')
  assert axes[('decoder', 'blocks', 0, 'cross_attn', 'q', 'kernel')] == ('embed', 'heads', 'head_dim')
  mlp_in = 'wi' if pair.variant == 'v1_0' else 'wi_0'
  assert axes[('encoder', 'blocks', 1, 'mlp', mlp_in, 'kernel')] == ('embed', 'mlp')
  assert axes[('encoder', 'blocks', 1, 'mlp', 'wo', 'kernel')] == ('mlp', 'embed')
  if pair.variant == 'v1_1':
    assert axes[('lm_head', 'kernel')] == ('embed', 'vocab')


def test_bfloat16_compute(pair):
  if pair.variant != 'v1_1':
    pytest.skip('one variant is enough')
  bf16 = load_pretrained(pair.directory, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
  ids, mask = jnp.asarray(INPUT_IDS), jnp.asarray(ATTENTION_MASK)
  encoder = _encode(bf16.model, ids, mask)
  assert encoder.dtype == jnp.bfloat16
  logits = _decode(bf16.model, jnp.asarray(DECODER_IDS), encoder, mask)
  reference = _forward(pair.ours.model, ids, mask, jnp.asarray(DECODER_IDS))
  assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
  assert _max_diff(logits, reference) < 0.1 * float(jnp.abs(reference).max())
  agree = np.mean(np.argmax(np.asarray(logits), -1) == np.argmax(np.asarray(reference), -1))
  assert agree >= 0.8
  tokens, lengths = t5.generate(bf16.model, INPUT_IDS, ATTENTION_MASK,
                                sampling=generation.SamplingConfig(max_new_tokens=6))
  assert tokens.shape == (3, 6) and ((np.asarray(lengths) >= 1) & (np.asarray(lengths) <= 6)).all()
