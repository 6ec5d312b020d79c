"""K-COMP's <ent> / <eom>: added to the tokenizer and the embedding table, exported, loaded back."""

import json
import os

import numpy as np
import pytest
import torch
from flax import nnx

from recomp_jax.models import gemma
from recomp_jax.pretrained import Pretrained, export_pretrained, load_pretrained, load_tokenizer
from recomp_jax.pretrained.special_tokens import add_special_tokens


def _tiny(gemma3_hf_dir, tie=True):
  config = gemma.GemmaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                             head_dim=16, sliding_window=16, layer_types=('sliding_attention', 'full_attention'),
                             query_pre_attn_scalar=16, tie_word_embeddings=tie)
  return Pretrained(gemma.GemmaModel(config, rngs=nnx.Rngs(3)), config, gemma.FAMILY, gemma3_hf_dir)


def test_new_tokens_get_mean_rows_and_survive_export_and_load(tmp_path, gemma3_hf_dir):
  from transformers import AutoModelForCausalLM, AutoTokenizer
  for tie in (True, False):
    pretrained = _tiny(gemma3_hf_dir, tie)
    with pytest.raises(ValueError, match='shared'):
      add_special_tokens(pretrained, pretrained.tokenizer(), ('<ent>',))  # would change every user's
    tokenizer = pretrained.tokenizer(fresh=True)
    old_table = np.asarray(pretrained.model.embedder.embedding[...])
    v = old_table.shape[0]
    ids = add_special_tokens(pretrained, tokenizer, ('<ent>', '<eom>'))
    assert ids == [v, v + 1] and pretrained.config.vocab_size == v + 2 == pretrained.model.config.vocab_size
    table = np.asarray(pretrained.model.embedder.embedding[...])
    np.testing.assert_array_equal(table[:v], old_table)
    np.testing.assert_allclose(table[v:], np.broadcast_to(old_table.mean(0), (2, old_table.shape[1])), atol=1e-6)
    if not tie:  # an untied head grows a mean column; the export below is the tied Gemma 3 270M's case
      kernel = np.asarray(pretrained.model.lm_head.kernel[...])
      np.testing.assert_allclose(kernel[:, v:], np.broadcast_to(kernel[:, :v].mean(1, keepdims=True), (32, 2)), atol=1e-6)
      continue
    assert add_special_tokens(pretrained, tokenizer, ('<ent>', '<eom>')) == ids  # again: a no-op
    assert pretrained.config.vocab_size == v + 2
    text = 'What is <ent> ?<eom>'
    encoded = tokenizer(text, add_special_tokens=False)['input_ids']
    assert encoded.count(ids[0]) == 1 and encoded.count(ids[1]) == 1
    out = str(tmp_path / f'tied{tie}')
    export_pretrained(pretrained, out, tokenizer=tokenizer)
    again = load_pretrained(out)
    assert again.config.vocab_size == v + 2
    np.testing.assert_array_equal(np.asarray(again.model.embedder.embedding[...]), table)
    reloaded = AutoTokenizer.from_pretrained(out)
    assert reloaded(text, add_special_tokens=False)['input_ids'] == encoded
    # transformers reads the same model: logits over the grown vocabulary agree
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation='eager').eval()
    x = np.asarray([reloaded(text)['input_ids']])
    with torch.no_grad():
      theirs = hf(torch.tensor(x)).logits.numpy()
    ours = np.asarray(again.model(x))
    assert ours.shape[-1] == v + 2
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_tokenizers_are_shared_per_directory_and_thread_and_reread_when_rewritten(tmp_path, gemma3_hf_dir):
  import shutil
  import threading
  directory = str(tmp_path / 'tok')
  shutil.copytree(gemma3_hf_dir, directory, ignore=shutil.ignore_patterns('*.safetensors'))
  first = load_tokenizer(directory)
  assert load_tokenizer(directory) is first and load_tokenizer(directory + '/') is first
  assert load_tokenizer(directory, fresh=True) is not first
  other = []
  thread = threading.Thread(target=lambda: other.append(load_tokenizer(directory)))
  thread.start()
  thread.join()
  assert other[0] is not first  # a fast tokenizer's call sets its padding state in place
  copy = str(tmp_path / 'copy')
  shutil.copytree(directory, copy)
  assert load_tokenizer(copy) is first  # an export's copy of the same files shares it
  config = os.path.join(copy, 'tokenizer_config.json')
  with open(config, encoding='utf-8') as f:
    fields = json.load(f)
  with open(config, 'w', encoding='utf-8') as f:
    json.dump({**fields, 'model_max_length': 77}, f)
  changed = load_tokenizer(copy)
  assert changed is not first and changed.model_max_length == 77  # rewritten with new content: read again
