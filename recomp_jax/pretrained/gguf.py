"""Reading Gemma checkpoints from llama.cpp GGUF files.

A GGUF file holds the architecture as ``{arch}.*`` metadata, the tokenizer as
``tokenizer.ggml.*`` metadata and (often quantised) tensors under llama.cpp
names. :func:`read_gguf` turns it into what a Hugging Face checkpoint holds: a
``config.json`` dict, float32 tensors under HF names and the tokenizer
metadata. :func:`convert_to_hf_dir` writes that as a plain HF directory in a
cache, once per GGUF file, so that every later load is a safetensors load.

llama.cpp conventions undone here (the same ones ``transformers``' own GGUF
loader undoes, so the resulting state dict equals the one it builds):

* GGUF lists dimensions fastest-first (``ne[0]`` is the contiguous one);
  ``gguf.GGUFReader`` already exposes the data in NumPy (row-major) order, so
  a dequantised ``attn_q`` is ``[heads * head_dim, embed]`` like a
  ``torch.nn.Linear`` weight and needs no transpose.
* llama.cpp's Gemma converters store every RMSNorm weight as ``w + 1`` (the
  Gemma norm multiplies by ``1 + w``); we subtract 1 again.
* Gemma's q/k projections are not permuted (unlike llama.cpp's LLaMA path).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from typing import Any, NamedTuple

import numpy as np

from recomp_jax.pretrained.hf import CheckpointError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = ('gemma', 'gemma2', 'gemma3')

# Tensor types we dequantise (all with gguf's NumPy reference kernels).
SUPPORTED_TYPES = ('F32', 'F16', 'BF16', 'Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0', 'Q2_K', 'Q3_K',
                   'Q4_K', 'Q5_K', 'Q6_K', 'IQ1_S', 'IQ1_M', 'IQ2_XXS', 'IQ2_XS', 'IQ2_S', 'IQ3_XXS',
                   'IQ3_S', 'IQ4_NL', 'IQ4_XS', 'TQ1_0', 'TQ2_0', 'MXFP4')

# Bump when the conversion output changes, so that stale caches are not reused.
_CACHE_FORMAT = 1

# A converted directory: provenance and manifest (written last), and the files it cannot be loaded
# without (the tokenizer files are optional: see _save_tokenizer).
_PROVENANCE_FILE = 'gguf_source.json'
_REQUIRED_FILES = ('config.json', 'model.safetensors')

# GGUF tensor name (without ``blk.N.`` and ``.weight``) -> HF name inside ``model.layers.N.``.
_BLOCK_TENSORS = {
    'attn_q': 'self_attn.q_proj',
    'attn_k': 'self_attn.k_proj',
    'attn_v': 'self_attn.v_proj',
    'attn_output': 'self_attn.o_proj',
    'attn_q_norm': 'self_attn.q_norm',
    'attn_k_norm': 'self_attn.k_norm',
    'attn_norm': 'input_layernorm',
    'post_attention_norm': 'post_attention_layernorm',
    'ffn_norm': 'pre_feedforward_layernorm',
    'post_ffw_norm': 'post_feedforward_layernorm',
    'ffn_gate': 'mlp.gate_proj',
    'ffn_up': 'mlp.up_proj',
    'ffn_down': 'mlp.down_proj',
}
# Gemma 1 has two norms per block; llama.cpp calls the second one ``ffn_norm``.
_BLOCK_TENSORS_GEMMA1 = {k: v for k, v in _BLOCK_TENSORS.items()
                         if k not in ('attn_q_norm', 'attn_k_norm', 'post_attention_norm',
                                      'post_ffw_norm')}
_BLOCK_TENSORS_GEMMA1['ffn_norm'] = 'post_attention_layernorm'

_GLOBAL_TENSORS = {
    'token_embd': 'model.embed_tokens',
    'output_norm': 'model.norm',
    'output': 'lm_head',
}

_MODEL_TYPES = {'gemma': 'gemma', 'gemma2': 'gemma2', 'gemma3': 'gemma3_text'}
_ARCHITECTURE_CLASSES = {'gemma': 'GemmaForCausalLM', 'gemma2': 'Gemma2ForCausalLM',
                         'gemma3': 'Gemma3ForCausalLM'}


class GGUFCheckpoint(NamedTuple):
  """The contents of a GGUF file in Hugging Face terms.

  Attributes:
    config: a HF ``config.json`` dict (``model_type`` ``'gemma'``, ``'gemma2'``
      or ``'gemma3_text'``) that ``transformers`` loads.
    tensors: HF tensor name -> float32 array in HF layout.
    tokenizer: every ``tokenizer.*`` metadata field (``tokenizer.ggml.tokens``,
      ``...scores``, ``...bos_token_id``, ...), as Python values.
  """
  config: dict
  tensors: dict[str, np.ndarray]
  tokenizer: dict[str, Any]


def _open(path: str):
  from gguf import GGUFReader
  if not os.path.isfile(path):
    raise CheckpointError(f'{path}: no such GGUF file')
  try:
    return GGUFReader(path)
  # Bad magic, or a file cut inside the metadata (IndexError), inside the tensor infos or data
  # (ValueError from a short memory map), ...: gguf raises whatever NumPy does.
  except Exception as e:  # noqa: BLE001 - re-raised with the file named
    raise CheckpointError(f'{path}: truncated or corrupt GGUF file ({e})') from e


def _metadata(reader, path: str) -> dict[str, Any]:
  """Every metadata field as a Python value (strings decoded, arrays as lists)."""
  try:
    return {name: field.contents() for name, field in reader.fields.items()}
  except (ValueError, IndexError) as e:  # e.g. a string that is not UTF-8
    raise CheckpointError(f'{path}: corrupt GGUF metadata ({e})') from e


def _float(value: float) -> float:
  """A float32 metadata value as its shortest decimal (``1e-06``, not ``9.99999997e-07``)."""
  return float(str(np.float32(value)))


def hf_config_from_metadata(metadata: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]],
                            where: str = 'GGUF') -> dict:
  """Builds a HF ``config.json`` dict from GGUF metadata (``gemma``/``gemma2``/``gemma3``).

  Matches ``transformers``' own GGUF config (``modeling_gguf_pytorch_utils``)
  on every field it sets, and adds what it leaves to defaults but llama.cpp
  derives: the sliding/global ``layer_types``, per-layer-type
  ``rope_parameters`` (local base 10000, ``rope.scaling.*`` on global
  layers), ``query_pre_attn_scalar`` and the logit soft-capping values.

  Args:
    metadata: the GGUF metadata fields.
    tensor_shapes: GGUF tensor name -> shape in NumPy order (``output.weight``
      present means untied embeddings; ``token_embd.weight`` gives the
      vocabulary size when the metadata does not).
    where: the file, for error messages.
  """
  arch = metadata.get('general.architecture')
  if arch not in SUPPORTED_ARCHITECTURES:
    raise CheckpointError(f'{where}: unsupported GGUF architecture {arch!r}; '
                          f'supported: {list(SUPPORTED_ARCHITECTURES)}')

  def get(key: str, default: Any = None, required: bool = False) -> Any:
    name = f'{arch}.{key}'
    if name not in metadata:
      if required:
        raise CheckpointError(f'{where}: missing GGUF metadata {name!r}')
      return default
    return metadata[name]

  hidden = int(get('embedding_length', required=True))
  heads = int(get('attention.head_count', required=True))
  layers = int(get('block_count', required=True))
  head_dim = int(get('attention.key_length', hidden // heads))
  value_dim = int(get('attention.value_length', head_dim))
  if value_dim != head_dim:
    raise CheckpointError(f'{where}: attention.key_length {head_dim} != attention.value_length '
                          f'{value_dim}; Gemma needs equal query/key and value head sizes')
  if 'token_embd.weight' not in tensor_shapes:
    raise CheckpointError(f'{where}: missing tensor \'token_embd.weight\' (the token embedding)')
  vocab_size = get('vocab_size', tensor_shapes['token_embd.weight'][0])
  rope_theta = _float(get('rope.freq_base', 10000.0))

  config: dict[str, Any] = {
      'architectures': [_ARCHITECTURE_CLASSES[arch]],
      'model_type': _MODEL_TYPES[arch],
      'vocab_size': int(vocab_size),
      'hidden_size': hidden,
      'intermediate_size': int(get('feed_forward_length', required=True)),
      'num_hidden_layers': layers,
      'num_attention_heads': heads,
      'num_key_value_heads': int(get('attention.head_count_kv', heads)),
      'head_dim': head_dim,
      'max_position_embeddings': int(get('context_length', 8192)),
      'rms_norm_eps': _float(get('attention.layer_norm_rms_epsilon', 1e-6)),
      'tie_word_embeddings': 'output.weight' not in tensor_shapes,
      'attention_bias': False,
      'dtype': 'float32',
  }
  for gguf_key, hf_key in (('bos_token_id', 'bos_token_id'), ('eos_token_id', 'eos_token_id'),
                           ('padding_token_id', 'pad_token_id')):
    if f'tokenizer.ggml.{gguf_key}' in metadata:
      config[hf_key] = int(metadata[f'tokenizer.ggml.{gguf_key}'])

  if arch == 'gemma':
    config['hidden_act'] = 'gelu_pytorch_tanh'
    config['rope_parameters'] = {'rope_type': 'default', 'rope_theta': rope_theta}
    return config

  config['hidden_activation'] = 'gelu_pytorch_tanh'
  # llama.cpp scales queries by 1/sqrt(hidden / heads) for the 27B models
  # (Gemma 2: 46 blocks, Gemma 3: 62 blocks) and by 1/sqrt(head_dim) otherwise.
  is_27b = layers == (46 if arch == 'gemma2' else 62)
  config['query_pre_attn_scalar'] = hidden // heads if is_27b else head_dim
  config['sliding_window'] = int(get('attention.sliding_window', 4096))
  pattern = get('attention.sliding_window_pattern', 2 if arch == 'gemma2' else 6)
  if isinstance(pattern, list):  # one bool per layer: True = sliding
    if len(pattern) != layers:
      raise CheckpointError(f'{where}: {arch}.attention.sliding_window_pattern has {len(pattern)} '
                            f'entries for {layers} blocks')
    sliding = [bool(p) for p in pattern]
  else:  # every pattern-th layer is global
    sliding = [bool((i + 1) % int(pattern)) for i in range(layers)]
  config['layer_types'] = ['sliding_attention' if s else 'full_attention' for s in sliding]

  if arch == 'gemma2':
    config['rope_parameters'] = {'rope_type': 'default', 'rope_theta': rope_theta}
    config['attn_logit_softcapping'] = _float(get('attn_logit_softcapping', 50.0))
    config['final_logit_softcapping'] = _float(get('final_logit_softcapping', 30.0))
    return config

  full = {'rope_type': 'default', 'rope_theta': rope_theta}
  scaling = get('rope.scaling.type', 'none')
  if scaling == 'linear':
    full = {'rope_type': 'linear', 'rope_theta': rope_theta,
            'factor': _float(get('rope.scaling.factor', required=True))}
  elif scaling not in ('none', None):
    raise CheckpointError(f'{where}: unsupported {arch}.rope.scaling.type {scaling!r}')
  config['rope_parameters'] = {
      'full_attention': full,
      'sliding_attention': {'rope_type': 'default',
                            'rope_theta': _float(get('rope.freq_base_swa', 10000.0))},
  }
  softcap = get('final_logit_softcapping')
  config['final_logit_softcapping'] = None if softcap is None else _float(softcap)
  softcap = get('attn_logit_softcapping')
  config['attn_logit_softcapping'] = None if softcap is None else _float(softcap)
  return config


def hf_tensor_name(gguf_name: str, arch: str) -> str | None:
  """The HF name of a llama.cpp tensor name, or ``None`` when there is none."""
  stem, _, suffix = gguf_name.rpartition('.')
  if suffix != 'weight':
    return None
  if stem in _GLOBAL_TENSORS:
    return f'{_GLOBAL_TENSORS[stem]}.weight'
  m = re.fullmatch(r'blk\.(\d+)\.(\w+)', stem)
  table = _BLOCK_TENSORS_GEMMA1 if arch == 'gemma' else _BLOCK_TENSORS
  if m and m.group(2) in table:
    return f'model.layers.{m.group(1)}.{table[m.group(2)]}.weight'
  return None


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
  """HF tensor name -> shape for a Gemma ``config`` (every tensor the checkpoint must hold)."""
  d, f, v = config['hidden_size'], config['intermediate_size'], config['vocab_size']
  n, k, h = config['num_attention_heads'], config['num_key_value_heads'], config['head_dim']
  shapes = {'model.embed_tokens.weight': (v, d), 'model.norm.weight': (d,)}
  if not config['tie_word_embeddings']:
    shapes['lm_head.weight'] = (v, d)
  per_layer = {
      'self_attn.q_proj': (n * h, d), 'self_attn.k_proj': (k * h, d),
      'self_attn.v_proj': (k * h, d), 'self_attn.o_proj': (d, n * h),
      'mlp.gate_proj': (f, d), 'mlp.up_proj': (f, d), 'mlp.down_proj': (d, f),
      'input_layernorm': (d,), 'post_attention_layernorm': (d,),
  }
  if config['model_type'] != 'gemma':
    per_layer.update({'pre_feedforward_layernorm': (d,), 'post_feedforward_layernorm': (d,)})
  if config['model_type'] == 'gemma3_text':
    per_layer.update({'self_attn.q_norm': (h,), 'self_attn.k_norm': (h,)})
  for i in range(config['num_hidden_layers']):
    shapes.update({f'model.layers.{i}.{name}.weight': shape for name, shape in per_layer.items()})
  return shapes


def _dequantize(tensor, where: str) -> np.ndarray:
  """A reader tensor (of a :data:`SUPPORTED_TYPES` type) as float32 in NumPy (HF) order."""
  from gguf import dequantize
  values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
  shape = tuple(int(s) for s in reversed(tensor.shape))  # GGUF lists ne[0] (contiguous) first
  if values.shape != shape:
    raise CheckpointError(f'{where}: tensor {tensor.name!r} dequantised to {values.shape}, '
                          f'expected {shape}')
  return values


def read_gguf(path: str) -> GGUFCheckpoint:
  """Reads a Gemma GGUF file as a HF config, float32 HF tensors and tokenizer metadata.

  Raises:
    CheckpointError: naming the file (and tensor) on an unsupported
      architecture or tensor type, a tensor without a HF equivalent, or a
      missing or mis-shaped tensor.
  """
  return _read_gguf(path)[0]


def _read_gguf(path: str) -> tuple[GGUFCheckpoint, dict[str, str]]:
  """:func:`read_gguf` plus GGUF tensor name -> original type name."""
  reader = _open(path)
  metadata = _metadata(reader, path)
  tensor_shapes = {t.name: tuple(int(s) for s in reversed(t.shape)) for t in reader.tensors}
  config = hf_config_from_metadata(metadata, tensor_shapes, where=path)
  arch = metadata['general.architecture']
  shapes = expected_shapes(config)
  # Check names, shapes and types of every tensor before dequantising any.
  hf_names = {}
  for tensor in reader.tensors:
    name = hf_tensor_name(tensor.name, arch)
    if name is None or name not in shapes:
      raise CheckpointError(f'{path}: tensor {tensor.name!r} has no Hugging Face '
                            f'{config["model_type"]} equivalent')
    if tensor_shapes[tensor.name] != shapes[name]:
      raise CheckpointError(f'{path}: tensor {tensor.name!r} has shape {tensor_shapes[tensor.name]} '
                            f'(as {name!r}), expected {shapes[name]}')
    if tensor.tensor_type.name not in SUPPORTED_TYPES:
      raise CheckpointError(f'{path}: tensor {tensor.name!r} has unsupported type '
                            f'{tensor.tensor_type.name}; supported: {", ".join(SUPPORTED_TYPES)}')
    hf_names[tensor.name] = name
  missing = sorted(set(shapes) - set(hf_names.values()), key=_natural_key)
  if missing:
    more = f' and {len(missing) - 3} more' if len(missing) > 3 else ''
    raise CheckpointError(f'{path}: missing tensor(s) {", ".join(map(repr, missing[:3]))}{more} '
                          f'(GGUF names: {", ".join(_gguf_name(m, arch) for m in missing[:3])})')
  tensors: dict[str, np.ndarray] = {}
  for tensor in reader.tensors:
    name = hf_names[tensor.name]
    values = _dequantize(tensor, path)
    if name.endswith('norm.weight'):
      values -= np.float32(1.0)  # stored as 1 + w by llama.cpp's Gemma converters
    tensors[name] = values
  tokenizer = {k: v for k, v in metadata.items() if k.startswith('tokenizer.')}
  types = {t.name: t.tensor_type.name for t in reader.tensors}
  return GGUFCheckpoint(config, tensors, tokenizer), types


def _natural_key(name: str) -> list:
  return [int(p) if p.isdigit() else p for p in re.split(r'(\d+)', name)]


def _gguf_name(hf_name: str, arch: str) -> str:
  """Inverse of :func:`hf_tensor_name` (for error messages)."""
  stem = hf_name.removesuffix('.weight')
  for gguf_stem, hf_stem in _GLOBAL_TENSORS.items():
    if stem == hf_stem:
      return f'{gguf_stem}.weight'
  m = re.fullmatch(r'model\.layers\.(\d+)\.(.+)', stem)
  table = _BLOCK_TENSORS_GEMMA1 if arch == 'gemma' else _BLOCK_TENSORS
  for gguf_stem, hf_stem in table.items():
    if m and m.group(2) == hf_stem:
      return f'blk.{m.group(1)}.{gguf_stem}.weight'
  return '?'


def default_cache_root() -> str:
  """``$RECOMP_JAX_CACHE/gguf``, else ``~/.cache/recomp_jax/gguf``."""
  base = os.environ.get('RECOMP_JAX_CACHE') or os.path.join(os.path.expanduser('~'), '.cache',
                                                            'recomp_jax')
  return os.path.join(base, 'gguf')


def cache_dir_for(gguf_path: str, cache_dir: str | None = None) -> str:
  """Where :func:`convert_to_hf_dir` puts the conversion of ``gguf_path``.

  ``<cache_dir>/<file stem>-<size>-<mtime ns>-c<format>``: a rewritten GGUF
  (new size or modification time) gets a new entry.
  """
  stat = os.stat(gguf_path)
  stem = os.path.basename(gguf_path).removesuffix('.gguf')
  name = f'{stem}-{stat.st_size}-{stat.st_mtime_ns}-c{_CACHE_FORMAT}'
  return os.path.join(cache_dir or default_cache_root(), name)


def convert_to_hf_dir(gguf_path: str, cache_dir: str | None = None) -> str:
  """Converts a Gemma GGUF file to a Hugging Face directory, once; returns its path.

  The directory holds ``config.json``, ``model.safetensors`` (float32,
  dequantised), the tokenizer files and, written last, ``gguf_source.json``
  (provenance, the original tensor types and a manifest: the size and sha256
  of every other file). It is built in a temporary sibling directory and
  renamed into place, so an interrupted conversion never leaves a partial
  cache entry. An existing entry is returned without reading the GGUF once
  :func:`verify_cache_entry` finds its files with their recorded sizes; a
  damaged one (a truncated or deleted file, or no manifest) is logged as a
  warning naming the file, converted again and replaced.

  Args:
    gguf_path: the ``*.gguf`` file.
    cache_dir: the cache root (default :func:`default_cache_root`).
  """
  from safetensors.numpy import save_file
  if not os.path.isfile(gguf_path):
    raise CheckpointError(f'{gguf_path}: no such GGUF file')
  gguf_path = os.path.abspath(gguf_path)
  target = cache_dir_for(gguf_path, cache_dir)
  if os.path.isdir(target):
    damage = verify_cache_entry(target)
    if damage is None:
      return target
    logger.warning('%s: damaged GGUF conversion cache entry: %s; converting %s again', target,
                   damage, gguf_path)
  root = os.path.dirname(target)
  os.makedirs(root, exist_ok=True)
  _remove_stale_tmp_dirs(root)
  tmp = tempfile.mkdtemp(prefix=f'.{os.path.basename(target)}.tmp-', dir=root)
  os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache entry is not
  try:
    start = time.perf_counter()
    (config, tensors, _), types = _read_gguf(gguf_path)
    with open(os.path.join(tmp, 'config.json'), 'w') as f:
      json.dump(config, f, indent=2)
    save_file(tensors, os.path.join(tmp, 'model.safetensors'), metadata={'format': 'pt'})
    del tensors
    _save_tokenizer(gguf_path, tmp)
    _write_provenance(gguf_path, tmp, types)
    _install(tmp, target)
    logger.info('converted %s to %s in %.1f s', gguf_path, target, time.perf_counter() - start)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return target


def verify_cache_entry(directory: str, *, full: bool = False) -> str | None:
  """What is wrong with a :func:`convert_to_hf_dir` cache entry, or ``None`` when it is intact.

  Checks that ``gguf_source.json`` is readable, of the current cache format
  and holds a manifest listing the required files, and that every file of the
  manifest exists with its recorded size (a few ``stat`` calls: this catches
  deleted and truncated files). ``full`` also compares sha256 digests, which
  reads every file.

  Returns:
    a description naming the damaged file, or ``None``.
  """
  try:
    with open(os.path.join(directory, _PROVENANCE_FILE)) as f:
      source = json.load(f)
  except FileNotFoundError:
    return f'{_PROVENANCE_FILE} is missing'
  except (OSError, ValueError) as e:  # ValueError: invalid JSON or not UTF-8
    return f'{_PROVENANCE_FILE} is unreadable ({e})'
  if not isinstance(source, dict) or source.get('cache_format') != _CACHE_FORMAT:
    return f'{_PROVENANCE_FILE} is not of cache format {_CACHE_FORMAT}'
  files = source.get('files')
  if not isinstance(files, dict):
    return f'{_PROVENANCE_FILE} has no manifest of the converted files (an older recomp_jax wrote it)'
  for name in _REQUIRED_FILES:
    if name not in files:
      return f'{name} is not in the manifest of {_PROVENANCE_FILE}'
  for name, entry in files.items():
    if not isinstance(entry, dict) or not isinstance(entry.get('size'), int):
      return f'{_PROVENANCE_FILE} has a malformed manifest entry for {name!r}'
    path = os.path.join(directory, name)
    try:
      size = os.path.getsize(path)
    except OSError:
      return f'{name} is missing'
    if size != entry['size']:
      return f'{name} has {size} bytes, the manifest says {entry["size"]}'
    if full and _sha256(path) != entry.get('sha256'):
      return f'{name} does not match its sha256 in the manifest'
  return None


def _sha256(path: str) -> str:
  with open(path, 'rb') as f:
    return hashlib.file_digest(f, 'sha256').hexdigest()


def _install(tmp: str, target: str) -> None:
  """Renames the finished conversion ``tmp`` to ``target``, replacing a damaged entry there.

  Each rename is atomic; between the two of a replacement ``target`` is briefly
  absent (never partial). When a concurrent conversion has put an intact entry
  in place first, ``tmp`` is discarded.
  """
  try:
    os.rename(tmp, target)
    return
  except OSError:
    if not os.path.isdir(target):
      raise
  if verify_cache_entry(target) is None:  # a concurrent conversion finished first
    shutil.rmtree(tmp, ignore_errors=True)
    return
  # The damaged entry goes aside (onto an empty directory, which POSIX rename allows) under a
  # temporary name, so that _remove_stale_tmp_dirs deletes it if we are killed before rmtree.
  aside = tempfile.mkdtemp(prefix=f'.{os.path.basename(target)}.tmp-damaged-',
                           dir=os.path.dirname(target))
  os.rename(target, aside)
  try:
    os.rename(tmp, target)
  except OSError:
    if not os.path.isdir(target) or verify_cache_entry(target) is not None:
      raise
    shutil.rmtree(tmp, ignore_errors=True)  # a concurrent conversion filled the gap
  shutil.rmtree(aside, ignore_errors=True)


def _save_tokenizer(gguf_path: str, out_dir: str) -> None:
  from transformers import AutoTokenizer
  try:
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                              gguf_file=os.path.basename(gguf_path))
  except (ValueError, KeyError, OSError, NotImplementedError) as e:
    logger.warning('%s: no tokenizer could be built from the GGUF metadata (%s); the converted '
                   'directory has weights and config only', gguf_path, e)
    return
  tokenizer.save_pretrained(out_dir)


def _write_provenance(gguf_path: str, out_dir: str, types: dict[str, str]) -> None:
  """Writes ``gguf_source.json``: the GGUF's identity, tensor types and the manifest of ``out_dir``.

  Call it last: the manifest lists every file already in ``out_dir`` (relative
  path -> ``{'size', 'sha256'}``).
  """
  stat = os.stat(gguf_path)
  files = {}
  for parent, _, names in os.walk(out_dir):
    for name in sorted(names):
      path = os.path.join(parent, name)
      rel = os.path.relpath(path, out_dir)
      if rel != _PROVENANCE_FILE:
        files[rel] = {'size': os.path.getsize(path), 'sha256': _sha256(path)}
  with open(os.path.join(out_dir, _PROVENANCE_FILE), 'w') as f:
    json.dump({'path': gguf_path, 'size': stat.st_size, 'mtime_ns': stat.st_mtime_ns,
               'cache_format': _CACHE_FORMAT, 'tensor_types': types,
               'files': dict(sorted(files.items()))}, f, indent=2)


def _remove_stale_tmp_dirs(root: str, max_age_s: float = 24 * 3600) -> None:
  """Deletes temporary directories left by conversions killed more than a day ago."""
  now = time.time()
  for entry in os.scandir(root):
    if entry.name.startswith('.') and '.tmp-' in entry.name and entry.is_dir():
      if now - entry.stat().st_mtime > max_age_s:
        shutil.rmtree(entry.path, ignore_errors=True)


__all__ = ['GGUFCheckpoint', 'SUPPORTED_ARCHITECTURES', 'SUPPORTED_TYPES', 'cache_dir_for',
           'convert_to_hf_dir', 'default_cache_root', 'expected_shapes', 'hf_config_from_metadata',
           'hf_tensor_name', 'read_gguf', 'verify_cache_entry']
