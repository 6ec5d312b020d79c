"""Load any supported checkpoint into our Flax models, and export it back.

Sources: a local Hugging Face directory, a hub id (when the hub is reachable),
a sentence-transformers directory, or a GGUF file. Each model family module
(``recomp_jax.models.bert`` / ``t5`` / ``gemma``) exposes a ``FAMILY``
(:class:`ModelFamily`) that knows its config and weight map; this module only
dispatches on ``model_type``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import threading
from typing import Any

import jax.numpy as jnp
from flax import nnx

from recomp_jax.pretrained.hf import (CheckpointError, InMemorySource, SafetensorsSource,
                                      TensorSource, WeightSpec, load_weights, read_config,
                                      resolve_directory, save_weights)
from recomp_jax.pretrained.demo import resolve_demo_model
from recomp_jax.pretrained.spec import ModelFamily, family_for


@dataclasses.dataclass
class Pretrained:
  """A loaded model with its config and where it came from.

  ``source_dir`` is a directory holding the tokenizer files (for GGUF: the
  conversion cache directory). ``pooling`` is the sentence-transformers pooling
  config when the source was one (``None`` otherwise).
  """
  model: nnx.Module
  config: Any
  family: ModelFamily
  source_dir: str
  pooling: dict | None = None

  def tokenizer(self, *, fresh: bool = False):
    """The model's tokenizer: shared within the thread unless ``fresh`` (see :func:`load_tokenizer`)."""
    return load_tokenizer(self.source_dir, fresh=fresh)


_TOKENIZERS: dict[tuple, Any] = {}
_FILE_DIGESTS: dict[tuple, str] = {}
_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'added_tokens.json',
                    'tokenizer.model', 'spiece.model', 'vocab.txt')


def load_tokenizer(directory: str, *, fresh: bool = False):
  """The Hugging Face tokenizer of ``directory``, built once per tokenizer content and thread.

  Building a Gemma tokenizer (262k pieces) takes about 3 s, and a pipeline's stages, readers and
  compressors ask for the same one many times, often from exported copies of one directory. The
  cache key is the tokenizer files' content (their digests, kept per file size and modification
  time), so a copy shares the tokenizer and a file rewritten with new content is read again. The
  thread id is in the key because a fast tokenizer's call sets its padding and truncation state in
  place: two threads must not share one.

  A cached tokenizer is shared: never change it (``add_tokens``, ``padding_side = ...``); ask for
  ``fresh=True`` to get a private one to change. :func:`special_tokens.add_special_tokens` refuses
  a shared one.
  """
  from transformers import AutoTokenizer  # pylint: disable=import-outside-toplevel  (heavy; first use only)
  if fresh or not os.path.isdir(directory):
    return AutoTokenizer.from_pretrained(directory)
  digests = []
  for name in _TOKENIZER_FILES:
    path = os.path.realpath(os.path.join(directory, name))
    try:
      st = os.stat(path)
    except OSError:
      continue
    stamp = (path, st.st_size, st.st_mtime_ns)
    if stamp not in _FILE_DIGESTS:
      with open(path, 'rb') as f:
        _FILE_DIGESTS[stamp] = hashlib.file_digest(f, 'sha256').hexdigest()
    digests.append((name, _FILE_DIGESTS[stamp]))
  if not digests:
    return AutoTokenizer.from_pretrained(directory)
  key = (tuple(digests), threading.get_ident())
  if key not in _TOKENIZERS:
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.recomp_jax_shared = True
    _TOKENIZERS[key] = tokenizer
  return _TOKENIZERS[key]


def build_from_source(config: Any, family: ModelFamily, source: TensorSource, *, where: str,
                      dtype=jnp.float32, param_dtype=jnp.float32) -> nnx.Module:
  """Creates ``family``'s model abstractly and fills it from ``source`` (no random init)."""
  abstract = nnx.eval_shape(lambda: family.build(config, dtype=dtype, param_dtype=param_dtype,
                                                 rngs=nnx.Rngs(0)))
  if family.adapt_source is not None:
    source = family.adapt_source(source)
  return load_weights(abstract, family.weight_specs(config), source, ignore=family.ignore,
                      where=where)


def _sentence_transformers_parts(directory: str) -> tuple[str, dict | None]:
  """(transformer dir, pooling config) for a sentence-transformers directory, else (dir, None)."""
  modules_path = os.path.join(directory, 'modules.json')
  if not os.path.exists(modules_path):
    return directory, None
  with open(modules_path) as f:
    modules = json.load(f)
  transformer_dir, pooling = directory, None
  for module in modules:
    kind = module.get('type', '')
    sub = os.path.join(directory, module.get('path', ''))
    if kind.endswith('Transformer'):
      transformer_dir = sub
    elif kind.endswith('Pooling'):
      with open(os.path.join(sub, 'config.json')) as f:
        pooling = json.load(f)
    elif kind.endswith('Normalize'):
      pooling = dict(pooling or {}, normalize=True)
  return transformer_dir, pooling


def load_pretrained(src: str | os.PathLike, *, dtype=jnp.float32, param_dtype=jnp.float32,
                    gguf_cache_dir: str | None = None) -> Pretrained:
  """Loads a checkpoint from a HF directory, hub id, sentence-transformers directory or GGUF file.

  Args:
    src: the source (a ``*.gguf`` path selects the GGUF reader).
    dtype: compute dtype of the model.
    param_dtype: storage dtype of the parameters.
    gguf_cache_dir: where a converted GGUF is cached (default:
      ``$RECOMP_JAX_CACHE/gguf``, else ``~/.cache/recomp_jax/gguf``).
  """
  src = os.fspath(src)
  if src.endswith('.gguf'):
    from recomp_jax.pretrained import gguf as gguf_reader
    src = gguf_reader.convert_to_hf_dir(src, cache_dir=gguf_cache_dir)
  directory = resolve_directory(src)
  transformer_dir, pooling = _sentence_transformers_parts(directory)
  config_dict = read_config(transformer_dir)
  where = os.path.join(transformer_dir, 'config.json')
  family = family_for(config_dict.get('model_type', '<missing>'), where)
  config = family.config_from_hf(config_dict)
  source = SafetensorsSource(transformer_dir)
  if family.config_from_checkpoint is not None:
    config = family.config_from_checkpoint(config, frozenset(source.names()))
  model = build_from_source(config, family, source, where=transformer_dir, dtype=dtype,
                            param_dtype=param_dtype)
  return Pretrained(model, config, family, transformer_dir, pooling)


def export_pretrained(pretrained: Pretrained, out_dir: str, *, tokenizer_dir: str | None = None,
                      dtype=None, tokenizer=None) -> str:
  """Writes ``pretrained`` as a Hugging Face directory that ``transformers`` loads.

  Writes ``config.json``, safetensors (sharded above 4 GiB) and, when
  available, the tokenizer: ``tokenizer`` itself (e.g. one with added special tokens,
  :func:`recomp_jax.pretrained.special_tokens.add_special_tokens`), else the one in
  ``tokenizer_dir`` (default: the source dir).
  In a multi-process run every process calls it and process 0 writes.
  """
  import numpy as np

  from recomp_jax import sharding  # pylint: disable=import-outside-toplevel
  save_weights(pretrained.model, pretrained.family.weight_specs(pretrained.config), out_dir,
               dtype=np.dtype(dtype or np.float32))
  if not sharding.is_main_process():
    return out_dir
  config_dict = pretrained.family.config_to_hf(pretrained.config)
  with open(os.path.join(out_dir, 'config.json'), 'w') as f:
    json.dump(config_dict, f, indent=2)
  if tokenizer is not None:
    tokenizer.save_pretrained(out_dir)
    return out_dir
  tokenizer_dir = tokenizer_dir or pretrained.source_dir
  files = [f for f in (*_TOKENIZER_FILES, 'chat_template.jinja', 'chat_template.json')
           if tokenizer_dir and os.path.isfile(os.path.join(tokenizer_dir, f))]
  if files:  # a local tokenizer: its files as they are (building a Gemma tokenizer to save it costs ~5 s)
    if os.path.realpath(tokenizer_dir) != os.path.realpath(out_dir):
      for f in files:
        shutil.copyfile(os.path.join(tokenizer_dir, f), os.path.join(out_dir, f))
  elif tokenizer_dir:
    try:
      from transformers import AutoTokenizer
      AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out_dir)
    except (OSError, ValueError):
      pass  # no tokenizer files next to the weights: weights and config are still valid
  return out_dir


__all__ = ['CheckpointError', 'InMemorySource', 'ModelFamily', 'Pretrained', 'SafetensorsSource',
           'WeightSpec', 'build_from_source', 'export_pretrained', 'family_for', 'load_pretrained', 'load_tokenizer',
           'resolve_demo_model']
