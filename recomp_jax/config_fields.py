"""Typed config sections: each field's name, type, default, allowed values and one line of help.

The shared base (:data:`recomp_jax.pipelines.defaults.SHARED_FIELDS`) and each system
(``System.fields`` in ``recomp_jax/pipelines/<name>.py``) declare their fields as
:class:`Field` tuples, as MaxText's ``configs/types.py`` types its config. From them come
the ``ml_collections.ConfigDict`` a config file starts from (:func:`build`), the checks of a
finished config (:func:`check`), the "field not read" errors of a command line
(:func:`check_override`) and ``--help`` (:func:`help_lines`). A run's config holds the shared
fields and its own system's, so its results file records nothing else.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Iterable, Sequence

import ml_collections


class ConfigError(ValueError):
  """A config value that its field does not allow (the message names the field)."""


@dataclasses.dataclass(frozen=True)
class Field:
  """One config field.

  Attributes:
    name: dotted path in the config, e.g. ``'teacher.temperature'``.
    default: its value unless a preset or the command line sets another; its Python type is
      the field's type (an int field takes ints, a float field ints or floats, a tuple field a
      tuple or list of ``element`` values).
    help: one line for ``--help``.
    choices: the allowed values ('' allowed only when listed); for a tuple field, of each element.
    minimum: the smallest allowed value of a number field.
    element: the element type of a tuple field (default: that of the default's first element, else str).
    read_when: ``(switch, values)``: the field is read only when the field ``switch`` has one of
      ``values``; setting it on the command line otherwise is an error, not a silent no-op.
  """
  name: str
  default: Any
  help: str
  choices: tuple = ()
  minimum: float | None = None
  element: type | None = None
  read_when: tuple[str, tuple] | None = None

  @property
  def kind(self) -> type:
    if isinstance(self.default, bool):
      return bool
    if isinstance(self.default, (tuple, list)):
      return tuple
    return type(self.default)

  @property
  def element_kind(self) -> type:
    if self.element is not None:
      return self.element
    return type(self.default[0]) if self.default else str

  def describe(self) -> str:
    """``--config.NAME=DEFAULT  help [one of: ...]`` for ``--help``."""
    extra = f' [one of: {", ".join(map(str, self.choices))}]' if self.choices else ''
    if self.read_when:
      extra += f' (read when {self.read_when[0]} is {" or ".join(map(str, self.read_when[1]))})'
    return f'--config.{self.name}={self.default!r}  {self.help}{extra}'


def field_map(fields: Iterable[Field]) -> dict[str, Field]:
  """``{name: field}``; raises ValueError when two declarations share a name."""
  out: dict[str, Field] = {}
  for f in fields:
    if f.name in out:
      raise ValueError(f'config field {f.name!r} is declared twice')
    out[f.name] = f
  return out


def build(fields: Sequence[Field]) -> ml_collections.ConfigDict:
  """The ConfigDict holding every field at its default (nested by the dotted names)."""
  config = ml_collections.ConfigDict()
  for f in field_map(fields).values():
    node = config
    *parents, leaf = f.name.split('.')
    for part in parents:
      if part not in node:
        node[part] = ml_collections.ConfigDict()
      node = node[part]
    node[leaf] = tuple(f.default) if isinstance(f.default, list) else f.default
  return config


def leaves(config, prefix: str = '') -> dict[str, Any]:
  """``{dotted name: value}`` of every leaf of a nested config or dict."""
  out = {}
  for key in config.keys():
    value = config[key]
    if hasattr(value, 'keys'):
      out.update(leaves(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def _type_ok(value, kind: type) -> bool:
  if kind is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  if kind is int:
    return isinstance(value, int) and not isinstance(value, bool)
  return isinstance(value, kind)


def check_value(f: Field, value) -> None:
  """Raises :class:`ConfigError` when ``value`` is not of ``f``'s type, choices or range."""
  allowed = f' (allowed: {", ".join(map(repr, f.choices))})' if f.choices else ''
  if f.kind is tuple:
    if not isinstance(value, (tuple, list)):
      raise ConfigError(f'config.{f.name} must be a tuple of {f.element_kind.__name__} values, got {value!r}')
    for v in value:
      if not _type_ok(v, f.element_kind):
        raise ConfigError(f'config.{f.name}: element {v!r} is not of type {f.element_kind.__name__}')
      if f.choices and v not in f.choices:
        raise ConfigError(f'config.{f.name}: {v!r} is not allowed{allowed}')
    return
  if not _type_ok(value, f.kind):
    raise ConfigError(f'config.{f.name} must be of type {f.kind.__name__}, got {value!r}')
  if f.choices and value not in f.choices:
    raise ConfigError(f'config.{f.name}={value!r} is not allowed{allowed}')
  if f.minimum is not None and value < f.minimum:
    raise ConfigError(f'config.{f.name} must be at least {f.minimum}, got {value!r}')


def check(config, fields: Sequence[Field], owner: str) -> None:
  """Every field of ``config`` is declared in ``fields``, present, and of its type and choices.

  Args:
    config: a finished config (after the preset and any overrides).
    fields: the shared fields plus the system's own.
    owner: the system's name, for the messages.
  """
  declared = field_map(fields)
  values = leaves(config)
  extra = sorted(set(values) - set(declared))
  if extra:
    raise ConfigError(f'config field(s) {", ".join(extra)} are not declared by the shared section or the '
                      f'{owner} system\'s (recomp_jax/config_fields.py says how a system declares its fields)')
  missing = sorted(set(declared) - set(values))
  if missing:
    raise ConfigError(f'config field(s) {", ".join(missing)} of the {owner} system are missing')
  for name, f in declared.items():
    check_value(f, values[name])


def check_override(name: str, overrides: dict[str, Any], config, fields: Sequence[Field], owner: str,
                   others: dict[str, Sequence[Field]] = ()) -> None:
  """A ``--config.NAME=...`` override must name a field this system reads under this config.

  Args:
    name: the overridden field.
    overrides: every override of the command line (name -> raw string), for ``read_when`` switches.
    config: the preset's config before the overrides.
    fields: the shared fields plus the system's own.
    owner: the system's name.
    others: ``{system: fields}`` of the other systems, to say whose field an unknown name is.
  """
  declared = field_map(fields)
  if name not in declared:
    for other, other_fields in dict(others).items():
      if any(f.name == name for f in other_fields):
        raise ConfigError(f'--config.{name} is a field of the {other} system; config.system={owner!r} does not read it')
    parent = name.rsplit('.', 1)[0] if '.' in name else ''
    siblings = sorted(n for n in declared if n.rsplit('.', 1)[0] == parent) if parent else []
    raise ConfigError(f'--config.{name}: unknown config field'
                      + (f'; fields of {parent}: {", ".join(siblings)}' if siblings else ''))
  f = declared[name]
  if f.read_when:
    switch, values = f.read_when
    current = overrides.get(switch, leaves(config).get(switch))
    if current not in values:
      raise ConfigError(f'--config.{name} is ignored when {switch}={current!r} (it is read only when '
                        f'{switch} is one of {list(values)})')


def help_lines(fields: Sequence[Field], indent: str = '  ') -> list[str]:
  """One ``--config.NAME=DEFAULT  help`` line per field, in declaration order."""
  return [indent + f.describe() for f in fields]


def load_config_file(path: str, preset: str | None = None) -> ml_collections.ConfigDict:
  """``get_config(preset)`` of the config file at ``path`` (``get_config()`` when ``preset`` is None).

  How ``--config=PATH:PRESET`` reads a file, and how one config file builds on another (e.g.
  ``configs/hotpotqa_color.py`` on ``configs/nq_color.py``). Raises FileNotFoundError for a missing
  file and the file's ValueError for an unknown preset.
  """
  if not os.path.exists(path):
    raise FileNotFoundError(f'no such config file {path!r}')
  name = '_recomp_config_' + os.path.splitext(os.path.basename(path))[0]
  module_spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config() if preset is None else module.get_config(preset)


__all__ = ['ConfigError', 'Field', 'build', 'check', 'check_override', 'check_value', 'field_map', 'help_lines',
           'leaves', 'load_config_file']
