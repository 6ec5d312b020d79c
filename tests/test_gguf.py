"""GGUF reading: synthetic files (fast, every error path) and the real Gemma 3 270M Q4_K_M file.

The real-file tests compare against ``transformers``' own GGUF loader
(``from_pretrained(..., gguf_file=...)``), which dequantises with the same
``gguf`` kernels: our renamed tensors must equal its state dict exactly, our
config must build the same architecture, and our Flax Gemma 3 must reproduce
its logits and greedy continuation.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

import torch
import gguf
from gguf import GGMLQuantizationType as Q  # noqa: E402

from recomp_jax.pretrained import CheckpointError  # noqa: E402
from recomp_jax.pretrained import gguf as gguf_reader  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Synthetic GGUF files
# --------------------------------------------------------------------------------------------------

TINY = dict(layers=2, d=64, f=128, n=2, k=1, h=32, vocab=64)

_NORMS = {
    'gemma': ('attn_norm', 'ffn_norm'),
    'gemma2': ('attn_norm', 'post_attention_norm', 'ffn_norm', 'post_ffw_norm'),
    'gemma3': ('attn_norm', 'post_attention_norm', 'ffn_norm', 'post_ffw_norm'),
}


def write_tiny_gguf(path: str, arch: str = 'gemma3', *, drop: tuple[str, ...] = (),
                    types: dict[str, Q] | None = None, rope_scaling: float | None = None,
                    with_tokenizer: bool = True, untied: bool = False,
                    reshape: dict[str, tuple[int, ...]] | None = None) -> dict[str, np.ndarray]:
  """Writes a tiny Gemma GGUF like llama.cpp would; returns the float tensors written.

  Linear weights are Q8_0 (``attn_v`` F16), norms F32 stored as ``1 + w``
  (llama.cpp's Gemma convention); ``types`` overrides a tensor's type,
  ``drop`` leaves tensors out.
  """
  c = TINY
  rng = np.random.default_rng(0)
  w = gguf.GGUFWriter(path, arch)
  w.add_context_length(128)
  w.add_embedding_length(c['d'])
  w.add_block_count(c['layers'])
  w.add_feed_forward_length(c['f'])
  w.add_head_count(c['n'])
  w.add_head_count_kv(c['k'])
  w.add_key_length(c['h'])
  w.add_value_length(c['h'])
  w.add_layer_norm_rms_eps(1e-6)
  w.add_rope_freq_base(1e6 if arch == 'gemma3' else 1e4)
  if arch != 'gemma':
    w.add_sliding_window(16)
  if arch == 'gemma2':
    w.add_attn_logit_softcapping(50.0)
    w.add_final_logit_softcapping(30.0)
  if rope_scaling is not None:
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(rope_scaling)
  if with_tokenizer:
    tokens = ['<pad>', '<eos>', '<bos>', '<unk>'] + [f'▁w{i}' for i in range(c['vocab'] - 4)]
    w.add_tokenizer_model('llama')
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(c['vocab'] - 4)])
    w.add_token_types([3, 3, 3, 2] + [1] * (c['vocab'] - 4))
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)

  shapes = {'token_embd.weight': (c['vocab'], c['d']), 'output_norm.weight': (c['d'],)}
  if untied:
    shapes['output.weight'] = (c['vocab'], c['d'])
  for i in range(c['layers']):
    shapes.update({
        f'blk.{i}.attn_q.weight': (c['n'] * c['h'], c['d']),
        f'blk.{i}.attn_k.weight': (c['k'] * c['h'], c['d']),
        f'blk.{i}.attn_v.weight': (c['k'] * c['h'], c['d']),
        f'blk.{i}.attn_output.weight': (c['d'], c['n'] * c['h']),
        f'blk.{i}.ffn_gate.weight': (c['f'], c['d']),
        f'blk.{i}.ffn_up.weight': (c['f'], c['d']),
        f'blk.{i}.ffn_down.weight': (c['d'], c['f']),
    })
    shapes.update({f'blk.{i}.{norm}.weight': (c['d'],) for norm in _NORMS[arch]})
    if arch == 'gemma3':
      shapes.update({f'blk.{i}.attn_q_norm.weight': (c['h'],),
                     f'blk.{i}.attn_k_norm.weight': (c['h'],)})
  shapes.update(reshape or {})
  written = {}
  for name, shape in shapes.items():
    x = rng.standard_normal(shape).astype(np.float32)
    kind = (types or {}).get(name)
    if kind is None:
      kind = Q.F32 if name.endswith('norm.weight') else Q.F16 if '.attn_v.' in name else Q.Q8_0
    if name.endswith('norm.weight'):
      x = x * 0.1 + 1.0  # a Gemma norm weight w stored as 1 + w
    written[name] = x
    if name in drop:
      continue
    if kind == Q.F32:
      w.add_tensor(name, x)
    elif kind == Q.F16:
      w.add_tensor(name, x.astype(np.float16))
    elif kind == Q.I32:
      w.add_tensor(name, x.astype(np.int32))
    else:
      w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return written


@pytest.fixture(scope='module')
def tiny_gguf(tmp_path_factory) -> tuple[str, dict[str, np.ndarray]]:
  path = str(tmp_path_factory.mktemp('gguf') / 'tiny-gemma3.gguf')
  return path, write_tiny_gguf(path)


def test_supported_types_dequantize():
  """Every type we claim to support has a gguf dequantisation kernel (one 256-wide row)."""
  for name in gguf_reader.SUPPORTED_TYPES:
    kind = Q[name]
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    data = np.zeros((1, 256 // block * nbytes), np.uint8)
    out = gguf.quants.dequantize(data, kind)
    assert out.shape == (1, 256) and out.dtype == np.float32, name


def test_tiny_read_renames_dequantises_and_unshifts(tiny_gguf):
  path, written = tiny_gguf
  config, tensors, tokenizer = gguf_reader.read_gguf(path)
  c = TINY
  assert config['model_type'] == 'gemma3_text'
  assert (config['hidden_size'], config['intermediate_size'], config['num_hidden_layers'],
          config['num_attention_heads'], config['num_key_value_heads'], config['head_dim'],
          config['vocab_size']) == (c['d'], c['f'], c['layers'], c['n'], c['k'], c['h'], c['vocab'])
  assert config['tie_word_embeddings'] is True
  assert config['rope_parameters'] == {
      'full_attention': {'rope_type': 'default', 'rope_theta': 1e6},
      'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}
  assert config['rms_norm_eps'] == 1e-6 and config['sliding_window'] == 16
  assert tokenizer['tokenizer.ggml.tokens'][:3] == ['<pad>', '<eos>', '<bos>']
  assert tokenizer['tokenizer.ggml.bos_token_id'] == 2

  pairs = {
      'token_embd.weight': 'model.embed_tokens.weight',
      'output_norm.weight': 'model.norm.weight',
      'blk.1.attn_q.weight': 'model.layers.1.self_attn.q_proj.weight',
      'blk.1.attn_k.weight': 'model.layers.1.self_attn.k_proj.weight',
      'blk.1.attn_v.weight': 'model.layers.1.self_attn.v_proj.weight',
      'blk.1.attn_output.weight': 'model.layers.1.self_attn.o_proj.weight',
      'blk.1.attn_q_norm.weight': 'model.layers.1.self_attn.q_norm.weight',
      'blk.1.attn_k_norm.weight': 'model.layers.1.self_attn.k_norm.weight',
      'blk.1.attn_norm.weight': 'model.layers.1.input_layernorm.weight',
      'blk.1.post_attention_norm.weight': 'model.layers.1.post_attention_layernorm.weight',
      'blk.1.ffn_norm.weight': 'model.layers.1.pre_feedforward_layernorm.weight',
      'blk.1.post_ffw_norm.weight': 'model.layers.1.post_feedforward_layernorm.weight',
      'blk.1.ffn_gate.weight': 'model.layers.1.mlp.gate_proj.weight',
      'blk.1.ffn_up.weight': 'model.layers.1.mlp.up_proj.weight',
      'blk.1.ffn_down.weight': 'model.layers.1.mlp.down_proj.weight',
  }
  assert len(tensors) == len(written) == 2 + 2 * 13
  for gguf_name, hf_name in pairs.items():
    ours, x = tensors[hf_name], written[gguf_name]
    assert ours.dtype == np.float32 and ours.shape == x.shape, hf_name
    if gguf_name.endswith('norm.weight'):  # F32, stored as 1 + w
      np.testing.assert_array_equal(ours, x - np.float32(1.0))
    elif '.attn_v.' in gguf_name:  # F16
      np.testing.assert_array_equal(ours, x.astype(np.float16).astype(np.float32))
    else:  # Q8_0: exactly gguf's dequantisation, within one quantisation step of the original
      reference = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0)
      np.testing.assert_array_equal(ours, reference)
      # Half a step per 32-wide block, plus the float16 rounding of the block scale (127 * 2^-11).
      step = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True) / 127
      assert np.all(np.abs(ours - x).reshape(-1, 32) <= step * (0.5 + 127 * 2.0**-11))


@pytest.mark.parametrize('arch', ['gemma', 'gemma2', 'gemma3'])
def test_tiny_converted_dir_loads_in_transformers(arch, tmp_path):
  """The converted directory is a complete HF checkpoint: no missing / unexpected tensors."""
  from transformers import AutoConfig, AutoModelForCausalLM
  path = str(tmp_path / f'tiny-{arch}.gguf')
  written = write_tiny_gguf(path, arch, untied=arch == 'gemma2')
  out = gguf_reader.convert_to_hf_dir(path, cache_dir=str(tmp_path / 'cache'))
  config = AutoConfig.from_pretrained(out)
  assert config.model_type == {'gemma': 'gemma', 'gemma2': 'gemma2', 'gemma3': 'gemma3_text'}[arch]
  model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                     output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys'] and not info['mismatched_keys']
  state = model.state_dict()
  # Gemma 1 names its second norm post_attention_layernorm, Gemma 2/3 pre_feedforward_layernorm.
  second_norm = 'post_attention_layernorm' if arch == 'gemma' else 'pre_feedforward_layernorm'
  np.testing.assert_array_equal(state[f'model.layers.0.{second_norm}.weight'].numpy(),
                                written['blk.0.ffn_norm.weight'] - np.float32(1.0))
  if arch == 'gemma2':
    assert config.attn_logit_softcapping == 50.0 and config.final_logit_softcapping == 30.0
    assert config.layer_types == ['sliding_attention', 'full_attention']
    assert not config.tie_word_embeddings
    assert not np.array_equal(state['lm_head.weight'].numpy(),
                              state['model.embed_tokens.weight'].numpy())
  with open(os.path.join(out, 'gguf_source.json')) as f:
    assert json.load(f)['tensor_types']['blk.0.attn_q.weight'] == 'Q8_0'


def test_tiny_matches_transformers_gguf_loader(tiny_gguf):
  """Same state dict and architecture as transformers' GGUF path on a synthetic file."""
  from transformers import AutoModelForCausalLM, Gemma3TextConfig
  path, _ = tiny_gguf
  config, tensors, _ = gguf_reader.read_gguf(path)
  theirs = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                gguf_file=os.path.basename(path),
                                                dtype=torch.float32)
  state = {k: v.numpy() for k, v in theirs.state_dict().items()}
  assert set(state) - {'lm_head.weight'} == set(tensors)
  for name, value in tensors.items():
    np.testing.assert_array_equal(value, state[name], err_msg=name)
  # transformers leaves query_pre_attn_scalar at its default 256; llama.cpp (and we) use head_dim
  # (32 here). The real 270M file has head_dim 256, where both agree.
  assert config['query_pre_attn_scalar'] == TINY['h']
  _assert_same_architecture(Gemma3TextConfig(**config), theirs.config,
                            skip=('query_pre_attn_scalar',))


def test_gemma3_linear_rope_scaling_applies_to_global_layers(tmp_path):
  from transformers import Gemma3TextConfig
  path = str(tmp_path / 'scaled.gguf')
  write_tiny_gguf(path, rope_scaling=8.0, with_tokenizer=False)
  config, _, _ = gguf_reader.read_gguf(path)
  assert config['rope_parameters'] == {
      'full_attention': {'rope_type': 'linear', 'rope_theta': 1e6, 'factor': 8.0},
      'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}
  assert Gemma3TextConfig(**config).rope_parameters['full_attention']['factor'] == 8.0


def test_unsupported_tensor_type_names_file_tensor_and_type(tmp_path):
  path = str(tmp_path / 'int.gguf')
  write_tiny_gguf(path, types={'blk.1.ffn_up.weight': Q.I32}, with_tokenizer=False)
  with pytest.raises(CheckpointError) as e:
    gguf_reader.read_gguf(path)
  assert path in str(e.value) and 'blk.1.ffn_up.weight' in str(e.value) and 'I32' in str(e.value)


def test_missing_tensor_names_file_and_both_names(tmp_path):
  path = str(tmp_path / 'missing.gguf')
  write_tiny_gguf(path, drop=('blk.1.ffn_up.weight',), with_tokenizer=False)
  with pytest.raises(CheckpointError) as e:
    gguf_reader.read_gguf(path)
  message = str(e.value)
  assert path in message and 'model.layers.1.mlp.up_proj.weight' in message
  assert 'blk.1.ffn_up.weight' in message


def test_mis_shaped_tensor_names_file_tensor_and_shapes(tmp_path):
  path = str(tmp_path / 'shape.gguf')
  write_tiny_gguf(path, reshape={'blk.0.attn_k.weight': (64, 64)}, with_tokenizer=False)
  with pytest.raises(CheckpointError) as e:
    gguf_reader.read_gguf(path)
  assert path in str(e.value) and 'blk.0.attn_k.weight' in str(e.value)
  assert '(64, 64)' in str(e.value) and '(32, 64)' in str(e.value)


def test_other_bad_files(tmp_path):
  not_gguf = tmp_path / 'garbage.gguf'
  not_gguf.write_bytes(b'not a gguf file at all' * 10)
  with pytest.raises(CheckpointError, match='garbage.gguf'):
    gguf_reader.read_gguf(str(not_gguf))
  with pytest.raises(CheckpointError, match='no such GGUF file'):
    gguf_reader.convert_to_hf_dir(str(tmp_path / 'absent.gguf'))
  path = str(tmp_path / 'llama.gguf')
  w = gguf.GGUFWriter(path, 'llama')
  w.add_tensor('token_embd.weight', np.zeros((4, 4), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(CheckpointError, match="unsupported GGUF architecture 'llama'"):
    gguf_reader.read_gguf(path)


def test_cache_is_atomic_and_reused(tiny_gguf, tmp_path, monkeypatch):
  path, _ = tiny_gguf
  cache = str(tmp_path / 'cache')

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  # An interruption after the weights were written leaves neither an entry nor a temporary dir.
  monkeypatch.setattr(gguf_reader, '_save_tokenizer', interrupted)
  with pytest.raises(KeyboardInterrupt):
    gguf_reader.convert_to_hf_dir(path, cache_dir=cache)
  assert os.listdir(cache) == []
  monkeypatch.undo()

  out = gguf_reader.convert_to_hf_dir(path, cache_dir=cache)
  assert out == gguf_reader.cache_dir_for(path, cache) and os.listdir(cache) == [os.path.basename(out)]
  assert {'config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json',
          'gguf_source.json'} <= set(os.listdir(out))
  weights = os.path.join(out, 'model.safetensors')
  mtime = os.stat(weights).st_mtime_ns

  def must_not_read(*args, **kwargs):
    raise AssertionError('the GGUF was read again')

  monkeypatch.setattr(gguf_reader, '_read_gguf', must_not_read)
  assert gguf_reader.convert_to_hf_dir(path, cache_dir=cache) == out
  assert os.stat(weights).st_mtime_ns == mtime
  # A rewritten GGUF (new mtime) is a new cache entry.
  os.utime(path, ns=(mtime + 10**9, mtime + 10**9))
  assert gguf_reader.cache_dir_for(path, cache) != out


def test_cache_manifest_records_sizes_and_digests(tiny_gguf, tmp_path):
  import hashlib
  path, _ = tiny_gguf
  out = gguf_reader.convert_to_hf_dir(path, cache_dir=str(tmp_path / 'cache'))
  with open(os.path.join(out, 'gguf_source.json')) as f:
    files = json.load(f)['files']
  assert set(files) == set(os.listdir(out)) - {'gguf_source.json'}
  for name, entry in files.items():
    with open(os.path.join(out, name), 'rb') as f:
      data = f.read()
    assert entry == {'size': len(data), 'sha256': hashlib.sha256(data).hexdigest()}, name
  assert gguf_reader.verify_cache_entry(out) is None
  assert gguf_reader.verify_cache_entry(out, full=True) is None
  # Same size, other bytes: only the digests see it.
  weights = os.path.join(out, 'model.safetensors')
  with open(weights, 'r+b') as f:
    f.seek(-4, os.SEEK_END)
    f.write(b'\x00\x00\xc0\x7f')  # a float32 NaN
  assert gguf_reader.verify_cache_entry(out) is None
  assert 'model.safetensors' in gguf_reader.verify_cache_entry(out, full=True)


@pytest.mark.parametrize('damage', ['truncated_weights', 'deleted_config', 'no_manifest'])
def test_damaged_cache_is_reconverted_with_a_warning(damage, tiny_gguf, tmp_path, caplog):
  """A damaged cache entry is logged (naming the file), converted again and loads the same weights."""
  import jax
  from flax import nnx

  from recomp_jax.pretrained import load_pretrained
  path, _ = tiny_gguf
  cache = str(tmp_path / 'cache')
  original = load_pretrained(path, gguf_cache_dir=cache)
  out = gguf_reader.cache_dir_for(path, cache)
  damaged = {'truncated_weights': 'model.safetensors', 'deleted_config': 'config.json',
             'no_manifest': 'gguf_source.json'}[damage]
  if damage == 'truncated_weights':
    with open(os.path.join(out, damaged), 'r+b') as f:
      f.truncate(os.path.getsize(os.path.join(out, damaged)) // 2)
  elif damage == 'deleted_config':
    os.remove(os.path.join(out, damaged))
  else:  # an entry written before manifests existed
    with open(os.path.join(out, damaged)) as f:
      source = json.load(f)
    source.pop('files', None)
    with open(os.path.join(out, damaged), 'w') as f:
      json.dump(source, f)

  with caplog.at_level('WARNING', logger=gguf_reader.__name__):
    reloaded = load_pretrained(path, gguf_cache_dir=cache)
  warnings = [r.getMessage() for r in caplog.records if r.levelname == 'WARNING']
  assert len(warnings) == 1 and out in warnings[0] and damaged in warnings[0], warnings
  assert 'converting' in warnings[0]
  assert gguf_reader.verify_cache_entry(out, full=True) is None
  assert os.listdir(cache) == [os.path.basename(out)]  # replaced in place, nothing left aside
  ours = jax.tree.leaves(nnx.state(reloaded.model, nnx.Param))
  theirs = jax.tree.leaves(nnx.state(original.model, nnx.Param))
  assert len(ours) == len(theirs)
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  caplog.clear()
  with caplog.at_level('WARNING', logger=gguf_reader.__name__):
    assert gguf_reader.convert_to_hf_dir(path, cache_dir=cache) == out  # intact again: a hit
  assert not caplog.records


# --------------------------------------------------------------------------------------------------
# The real Gemma 3 270M GGUF
# --------------------------------------------------------------------------------------------------

ARCHITECTURE_FIELDS = (
    'model_type', 'vocab_size', 'hidden_size', 'intermediate_size', 'num_hidden_layers',
    'num_attention_heads', 'num_key_value_heads', 'head_dim', 'max_position_embeddings',
    'hidden_activation', 'query_pre_attn_scalar', 'sliding_window', 'layer_types',
    'rope_parameters', 'final_logit_softcapping', 'attn_logit_softcapping', 'tie_word_embeddings',
    'attention_bias', 'use_bidirectional_attention', 'bos_token_id', 'eos_token_id', 'pad_token_id')


def _assert_same_architecture(ours, theirs, skip=()):
  for field in set(ARCHITECTURE_FIELDS) - set(skip):
    assert getattr(ours, field) == getattr(theirs, field), field
  assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps, rel=1e-6)


@pytest.mark.slow  # Gemma 3 real-weight parity beyond the one fast test (test_gguf logits)
def test_real_tensors_equal_transformers_state_dict(gemma3_hf_dir, gemma3_torch):
  """(a) Every dequantised, renamed tensor equals transformers' (independent of our model).

  Our tensors are read from the conversion cache, which holds exactly what
  :func:`read_gguf` returned (the cache key includes the conversion format);
  reading the GGUF a second time here would add half a minute. The
  synthetic-file tests compare :func:`read_gguf` itself with transformers.
  """
  from safetensors import safe_open
  state = gemma3_torch.state_dict()
  with open(os.path.join(gemma3_hf_dir, 'config.json')) as f:
    assert json.load(f)['tie_word_embeddings']
  with open(os.path.join(gemma3_hf_dir, 'gguf_source.json')) as f:
    source = json.load(f)
  assert source['cache_format'] == gguf_reader._CACHE_FORMAT
  assert {'Q4_K', 'Q5_0', 'Q6_K', 'Q8_0', 'F32'} == set(source['tensor_types'].values())
  with safe_open(os.path.join(gemma3_hf_dir, 'model.safetensors'), framework='numpy') as f:
    names = set(f.keys())
    assert len(names) == len(source['tensor_types']) == 236
    assert names == set(state) - {'lm_head.weight'}
    for name in names:
      ours, theirs = f.get_tensor(name), state[name].numpy()
      assert ours.dtype == np.float32 and ours.shape == theirs.shape, name
      np.testing.assert_array_equal(ours, theirs, err_msg=name)
    np.testing.assert_array_equal(f.get_tensor('model.embed_tokens.weight'),
                                  state['lm_head.weight'].numpy())


def test_real_config_builds_transformers_architecture(gemma3_hf_dir, gemma3_torch):
  """(b) Our config.json loads in transformers as the architecture its GGUF loader builds."""
  from transformers import AutoConfig
  ours = AutoConfig.from_pretrained(gemma3_hf_dir)
  _assert_same_architecture(ours, gemma3_torch.config)
  assert ours.layer_types.count('full_attention') == 3  # 5 local : 1 global over 18 layers
  assert ours.rope_parameters['sliding_attention']['rope_theta'] == 10000.0


def test_real_second_conversion_is_the_cache(gemma3_gguf_path, gemma3_hf_dir, monkeypatch):
  """(d) The second call neither reads the GGUF nor rewrites the cache."""
  weights = os.path.join(gemma3_hf_dir, 'model.safetensors')
  mtime = os.stat(weights).st_mtime_ns

  def must_not_read(*args, **kwargs):
    raise AssertionError('the GGUF was read again')

  monkeypatch.setattr(gguf_reader, '_read_gguf', must_not_read)
  start = time.perf_counter()
  assert gguf_reader.convert_to_hf_dir(gemma3_gguf_path) == gemma3_hf_dir
  elapsed = time.perf_counter() - start
  print(f'second convert_to_hf_dir: {elapsed * 1e3:.2f} ms')
  assert elapsed < 0.5
  assert os.stat(weights).st_mtime_ns == mtime


# (e) Our Flax Gemma 3 against HF PyTorch, both from the same GGUF.

PROMPTS = ('Question: What is the capital of France?\nAnswer:',
           'The quick brown fox jumps over the lazy dog. In a distant galaxy, astronomers found')


def test_real_logits_match_transformers(gemma3_ours, gemma3_torch, gemma3_tokenizer):
  """fp32 logits within 1e-3 at every real position of a left-padded batch of 2."""
  import jax.numpy as jnp
  from flax import nnx
  batch = gemma3_tokenizer(list(PROMPTS), padding=True, padding_side='left', return_tensors='np')
  tokens, mask = batch['input_ids'], batch['attention_mask']
  assert mask[0].sum() < mask[1].sum() and mask[0, 0] == 0  # the first prompt really is padded
  forward = nnx.jit(lambda model, ids, mask: model(ids, mask))
  logits = np.asarray(forward(gemma3_ours.model, jnp.asarray(tokens), jnp.asarray(mask)))
  for i, prompt in enumerate(PROMPTS):
    ids = gemma3_tokenizer(prompt, return_tensors='pt')['input_ids']
    with torch.no_grad():
      reference = gemma3_torch(ids).logits[0].numpy()
    ours = logits[i][mask[i].astype(bool)]
    assert ours.shape == reference.shape
    diff = float(np.abs(ours - reference).max())
    print(f'prompt {i}: {ours.shape[0]} tokens, max |logit diff| {diff:.2e}')
    assert diff <= 1e-3
    np.testing.assert_array_equal(ours.argmax(-1), reference.argmax(-1))


@pytest.mark.slow  # Gemma 3 real-weight parity beyond the one fast test (test_gguf logits)
def test_real_greedy_continuation_matches_transformers(gemma3_ours, gemma3_torch, gemma3_tokenizer):
  """The greedy 20-token continuation equals transformers' ``generate`` (same EOS handling)."""
  from recomp_jax.models import generation
  from recomp_jax.models import gemma_decoding
  prompt = PROMPTS[0]
  ids = gemma3_tokenizer(prompt, return_tensors='np')['input_ids']
  with torch.no_grad():
    reference = gemma3_torch.generate(torch.from_numpy(ids), max_new_tokens=20, do_sample=False,
                                      top_k=None, top_p=None)[0, ids.shape[1]:].numpy()
  tokens, lengths = gemma_decoding.generate(
      gemma3_ours.model, ids, sampling=generation.SamplingConfig(max_new_tokens=20))
  tokens, length = np.asarray(tokens)[0], int(np.asarray(lengths)[0])
  print(f'continuation: {gemma3_tokenizer.decode(tokens[:length])!r}')
  eos = gemma3_torch.config.eos_token_id
  eos = {eos} if isinstance(eos, int) else set(eos)
  if length < 20:  # both stopped at the same EOS (transformers pads after it)
    assert tokens[length - 1] in eos
  else:
    assert len(reference) == 20
  np.testing.assert_array_equal(tokens[:length], reference[:length])
