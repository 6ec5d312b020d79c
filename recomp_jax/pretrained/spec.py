"""What a model family tells the generic loader (a leaf: imports no model module).

Each family module (``recomp_jax.models.bert`` / ``t5`` / ``gemma``) builds a
:class:`ModelFamily` named ``FAMILY``; :func:`family_for` finds it by HF ``model_type``
through :data:`FAMILY_MODULES`, importing the model module only when asked, so the
models depend on this module and never the other way round.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Sequence

from flax import nnx

from recomp_jax.pretrained.hf import CheckpointError, TensorSource, WeightSpec


@dataclasses.dataclass(frozen=True)
class ModelFamily:
  """What the generic loader needs to know about one model family.

  Attributes:
    name: family name (``'bert'``, ``'t5'``, ``'gemma'``).
    config_from_hf: HF ``config.json`` dict -> our frozen config dataclass.
    config_to_hf: our config -> a ``config.json`` dict that transformers loads.
    build: ``(config, *, dtype, param_dtype, rngs) -> nnx.Module``.
    weight_specs: ``config -> list[WeightSpec]`` covering every parameter.
    ignore: regexes of HF tensors that may be present but are unused.
    adapt_source: optional ``TensorSource -> TensorSource`` view applied
      before loading (e.g. accepting both ``'bert.'``-prefixed and bare names).
    config_from_checkpoint: optional ``(config, tensor names) -> config`` for
      settings only the stored tensors reveal (T5: whether ``lm_head.weight``
      is stored, which configs written by transformers>=5 no longer record).
  """
  name: str
  config_from_hf: Callable[[dict], Any]
  config_to_hf: Callable[[Any], dict]
  build: Callable[..., nnx.Module]
  weight_specs: Callable[[Any], Sequence[WeightSpec]]
  ignore: Sequence[str] = ()
  adapt_source: Callable[[TensorSource], TensorSource] | None = None
  config_from_checkpoint: Callable[[Any, frozenset[str]], Any] | None = None


FAMILY_MODULES = {
    'bert': 'recomp_jax.models.bert',
    't5': 'recomp_jax.models.t5',
    'gemma': 'recomp_jax.models.gemma',
    'gemma2': 'recomp_jax.models.gemma',
    'gemma3': 'recomp_jax.models.gemma',
    'gemma3_text': 'recomp_jax.models.gemma',
}


def family_for(model_type: str, where: str = 'config.json') -> ModelFamily:
  """The :class:`ModelFamily` serving a HF ``model_type``."""
  if model_type not in FAMILY_MODULES:
    raise CheckpointError(f'{where}: unsupported model_type {model_type!r}; '
                          f'supported: {sorted(FAMILY_MODULES)}')
  return importlib.import_module(FAMILY_MODULES[model_type]).FAMILY
