"""Reading and writing Hugging Face checkpoints through per-model weight maps.

A model family describes its checkpoint layout as a list of :class:`WeightSpec`:
one Hugging Face tensor name, the attribute path of the matching NNX parameter,
and the two reshapes between them. Everything else here is generic:

* :class:`SafetensorsSource` reads ``*.safetensors`` (single file or sharded
  with ``model.safetensors.index.json``) lazily, tensor by tensor;
* :func:`load_weights` fills an abstract NNX model from a tensor source and
  raises one :class:`CheckpointError` naming the file, tensor and expected
  shape on a missing, unexpected or mis-shaped tensor;
* :func:`save_weights` writes the inverse mapping as safetensors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Callable, Iterable, Mapping, Protocol, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

Array = np.ndarray
PathEntry = str | int


class CheckpointError(ValueError):
  """A checkpoint does not match the model it is loaded into."""


def _identity(x: Array) -> Array:
  return x


@dataclasses.dataclass(frozen=True)
class WeightSpec:
  """How one Hugging Face tensor maps onto one NNX parameter.

  Attributes:
    hf_key: tensor name in the Hugging Face state dict.
    path: attribute path of the ``nnx.Param`` inside the model, e.g.
      ``('layers', 3, 'attn', 'q_proj', 'kernel')``.
    to_ours: HF array -> our array layout.
    to_hf: our array -> HF array layout (inverse of ``to_ours``).
  """
  hf_key: str
  path: tuple[PathEntry, ...]
  to_ours: Callable[[Array], Array] = _identity
  to_hf: Callable[[Array], Array] = _identity


def linear(hf_key: str, path: Sequence[PathEntry], in_shape: Sequence[int],
           out_shape: Sequence[int]) -> WeightSpec:
  """Spec for a ``torch.nn.Linear`` weight ``[out, in]`` stored as ``[*in_shape, *out_shape]``."""
  in_shape, out_shape = tuple(in_shape), tuple(out_shape)
  n_in, n_out = math.prod(in_shape), math.prod(out_shape)
  return WeightSpec(
      hf_key, tuple(path),
      to_ours=lambda w: w.reshape(n_out, n_in).T.reshape(in_shape + out_shape),
      to_hf=lambda w: w.reshape(n_in, n_out).T)


def reshaped(hf_key: str, path: Sequence[PathEntry], our_shape: Sequence[int],
             hf_shape: Sequence[int]) -> WeightSpec:
  """Spec for a tensor that only changes shape (e.g. a bias split into heads)."""
  our_shape, hf_shape = tuple(our_shape), tuple(hf_shape)
  return WeightSpec(hf_key, tuple(path), to_ours=lambda w: w.reshape(our_shape),
                    to_hf=lambda w: w.reshape(hf_shape))


def shifted(hf_key: str, path: Sequence[PathEntry], offset: float) -> WeightSpec:
  """Spec for a tensor stored with a constant offset (ours = hf + offset)."""
  return WeightSpec(hf_key, tuple(path), to_ours=lambda w: w + np.asarray(offset, w.dtype),
                    to_hf=lambda w: w - np.asarray(offset, w.dtype))


class TensorSource(Protocol):
  """Named tensors plus where each came from (for error messages)."""

  def names(self) -> Iterable[str]:
    ...

  def get(self, name: str) -> Array:
    ...

  def location(self, name: str) -> str:
    ...


class InMemorySource:
  """A :class:`TensorSource` over a dict of arrays (e.g. dequantised GGUF)."""

  def __init__(self, tensors: Mapping[str, Array], location: str):
    self._tensors = dict(tensors)
    self._location = location

  def names(self) -> Iterable[str]:
    return self._tensors.keys()

  def get(self, name: str) -> Array:
    return np.asarray(self._tensors[name])

  def location(self, name: str) -> str:
    return self._location


class SafetensorsSource:
  """Lazily reads tensors from the ``*.safetensors`` files of a directory."""

  def __init__(self, directory: str):
    from safetensors import safe_open
    self.directory = directory
    index = os.path.join(directory, 'model.safetensors.index.json')
    if os.path.exists(index):
      weight_map = _read_weight_map(index)
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(f for f in os.listdir(directory) if f.endswith('.safetensors'))
      if not files:
        raise CheckpointError(f'{directory}: no *.safetensors files (and no model.safetensors.index.json)')
      weight_map = None
    self._handles = {}
    self._file_of = {}
    for fname in files:
      path = os.path.join(directory, fname)
      if not os.path.exists(path):
        raise CheckpointError(f'{index}: lists {fname}, which does not exist')
      try:
        handle = safe_open(path, framework='flax')
      except Exception as e:  # noqa: BLE001 - SafetensorError (not a ValueError), re-raised named
        raise CheckpointError(f'{path}: truncated or corrupt safetensors file ({e})') from e
      self._handles[fname] = handle
      for key in handle.keys():
        self._file_of[key] = fname
    if weight_map is not None:
      for key, fname in weight_map.items():
        if self._file_of.get(key) != fname:
          raise CheckpointError(f'{index}: tensor {key!r} is indexed in {fname} but not stored there')

  def names(self) -> Iterable[str]:
    return self._file_of.keys()

  def get(self, name: str) -> Array:
    handle = self._handles[self._file_of[name]]
    try:
      return np.asarray(handle.get_tensor(name))
    except Exception as e:  # noqa: BLE001 - e.g. the file changed after it was opened
      raise CheckpointError(f'{self.location(name)}: tensor {name!r} cannot be read: truncated or '
                            f'corrupt safetensors file ({e})') from e

  def location(self, name: str) -> str:
    return os.path.join(self.directory, self._file_of[name])


def _read_weight_map(index: str) -> dict[str, str]:
  """The ``weight_map`` (tensor name -> file name) of a ``model.safetensors.index.json``."""
  try:
    with open(index) as f:
      weight_map = json.load(f)['weight_map']
  except json.JSONDecodeError as e:
    raise CheckpointError(f'{index}: invalid JSON at line {e.lineno}: {e.msg}') from e
  except (KeyError, TypeError) as e:
    raise CheckpointError(f'{index}: no "weight_map" object') from e
  except UnicodeDecodeError as e:
    raise CheckpointError(f'{index}: not UTF-8 text ({e})') from e
  if not isinstance(weight_map, dict) or not all(
      isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
    raise CheckpointError(f'{index}: "weight_map" must map tensor names to file names')
  return weight_map


def _get_variable(model: nnx.Module, path: Sequence[PathEntry]) -> nnx.Variable:
  node = model
  for entry in path:
    node = node[entry] if isinstance(entry, int) else getattr(node, entry)
  if not isinstance(node, nnx.Variable):
    raise TypeError(f'path {path} does not lead to an nnx.Variable but {type(node).__name__}')
  return node


def load_weights(model: nnx.Module, specs: Sequence[WeightSpec], source: TensorSource, *,
                 ignore: Sequence[str] = (), where: str = 'checkpoint') -> nnx.Module:
  """Copies tensors from ``source`` into ``model`` (concrete or from ``nnx.eval_shape``).

  Args:
    model: the NNX model whose parameters are overwritten in place.
    specs: one :class:`WeightSpec` per parameter of the model.
    source: where the tensors come from.
    ignore: regular expressions of source tensors that are allowed to be
      unused (e.g. ``'pooler\\.'`` or rotary buffers).
    where: a name for the source used in errors when a tensor is missing.
  Returns:
    ``model``, every parameter now a concrete ``jax.Array`` in its param dtype.
  Raises:
    CheckpointError: a tensor is missing, unexpected or has the wrong shape,
      or a model parameter has no spec.
  """
  available = set(source.names())
  used = set()
  assigned = set()
  for spec in specs:
    variable = _get_variable(model, spec.path)
    expected = tuple(variable.shape)
    if spec.hf_key not in available:
      raise CheckpointError(f'{where}: missing tensor {spec.hf_key!r} '
                            f'(expected for parameter {"/".join(map(str, spec.path))} of shape {expected})')
    raw = source.get(spec.hf_key)
    try:
      value = spec.to_ours(raw)
      ok = tuple(value.shape) == expected
    except ValueError:
      ok = False
    if not ok:
      expected_hf = tuple(spec.to_hf(np.zeros(expected, np.float32)).shape)
      raise CheckpointError(f'{source.location(spec.hf_key)}: tensor {spec.hf_key!r} has shape '
                            f'{tuple(raw.shape)}, expected {expected_hf}')
    variable.set_value(jnp.asarray(value, dtype=variable.dtype))
    used.add(spec.hf_key)
    assigned.add(tuple(spec.path))
  unexpected = sorted(k for k in available - used if not any(re.search(p, k) for p in ignore))
  if unexpected:
    shown = ', '.join(f'{k!r} ({source.location(k)})' for k in unexpected[:5])
    more = f' and {len(unexpected) - 5} more' if len(unexpected) > 5 else ''
    raise CheckpointError(f'unexpected tensors not used by the model: {shown}{more}')
  for path, variable in nnx.iter_graph(model):
    if isinstance(variable, nnx.Param) and tuple(path) not in assigned:
      raise CheckpointError(f'{where}: model parameter {"/".join(map(str, path))} has no weight spec')
  return model


def save_weights(model: nnx.Module, specs: Sequence[WeightSpec], out_dir: str, *,
                 dtype: np.dtype = np.float32, max_shard_bytes: int = 4 << 30) -> list[str]:
  """Writes the model's parameters under their Hugging Face names as safetensors.

  Large models are split into shards with a ``model.safetensors.index.json``.
  Returns the written file names. In a multi-process run every process must call it
  (parameters sharded across processes are gathered collectively); process 0 writes.
  """
  from safetensors.numpy import save_file

  from recomp_jax import sharding  # pylint: disable=import-outside-toplevel
  tensors = {}
  for spec in specs:
    value = sharding.host_value(_get_variable(model, spec.path).get_value()).astype(np.float32)
    tensors[spec.hf_key] = np.ascontiguousarray(spec.to_hf(value).astype(dtype))
  if not sharding.is_main_process():
    return []
  os.makedirs(out_dir, exist_ok=True)
  shards: list[dict[str, Array]] = [{}]
  size = 0
  for key, value in tensors.items():
    if size and size + value.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][key] = value
    size += value.nbytes
  if len(shards) == 1:
    save_file(shards[0], os.path.join(out_dir, 'model.safetensors'), metadata={'format': 'pt'})
    return ['model.safetensors']
  names = [f'model-{i + 1:05d}-of-{len(shards):05d}.safetensors' for i in range(len(shards))]
  weight_map = {}
  for name, shard in zip(names, shards):
    save_file(shard, os.path.join(out_dir, name), metadata={'format': 'pt'})
    weight_map.update({k: name for k in shard})
  with open(os.path.join(out_dir, 'model.safetensors.index.json'), 'w') as f:
    json.dump({'metadata': {'total_size': sum(v.nbytes for v in tensors.values())},
               'weight_map': weight_map}, f, indent=2)
  return names + ['model.safetensors.index.json']


def resolve_directory(src: str) -> str:
  """A local directory for ``src``: the path itself, or a hub snapshot for a hub id.

  Hub downloads respect ``HF_HUB_OFFLINE``; only ``config.json``, safetensors,
  tokenizer and sentence-transformers files are fetched.
  """
  if os.path.isdir(src):
    return src
  if os.path.exists(src):
    raise CheckpointError(f'{src}: not a directory (expected a Hugging Face model directory)')
  try:
    from huggingface_hub import snapshot_download
    return snapshot_download(src, allow_patterns=[
        '*.json', '*.safetensors', '*.model', '*.txt', '1_Pooling/*', '0_Transformer/*'])
  except Exception as e:  # noqa: BLE001 - re-raised with the source named
    raise CheckpointError(f'{src}: not a local directory and the hub could not provide it ({e})') from e


def read_config(directory: str) -> dict:
  """``config.json`` of a Hugging Face directory as a dict."""
  path = os.path.join(directory, 'config.json')
  if not os.path.exists(path):
    raise CheckpointError(f'{directory}: no config.json')
  with open(path) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise CheckpointError(f'{path}: invalid JSON at line {e.lineno}: {e.msg}') from e
    except UnicodeDecodeError as e:
      raise CheckpointError(f'{path}: not UTF-8 text ({e})') from e
