"""Typed config sections (recomp_jax/config_fields.py): build, check, overrides, help."""

import pytest

from recomp_jax import config_fields
from recomp_jax.config_fields import ConfigError, Field

FIELDS = (
    Field('seed', 0, 'the seed'),
    Field('data.source', 'jsonl', 'where from', choices=('jsonl', 'demo')),
    Field('data.demo_train', 0, 'demo questions', minimum=0, read_when=('data.source', ('demo',))),
    Field('train.learning_rate', 1e-5, 'peak rate', minimum=0.0),
    Field('eval.rows', ('all',), 'rows', element=str, choices=('all', 'none', 'top1')),
    Field('train.seeds', (0,), 'seeds', element=int),
)


def test_build_nests_the_dotted_names_at_their_defaults():
  c = config_fields.build(FIELDS)
  assert c.data.source == 'jsonl' and c.train.seeds == (0,) and c.eval.rows == ('all',)
  assert config_fields.leaves(c) == {f.name: f.default for f in FIELDS}
  config_fields.check(c, FIELDS, 'toy')
  with pytest.raises(ValueError, match="'seed' is declared twice"):
    config_fields.build(FIELDS + (Field('seed', 1, 'again'),))


@pytest.mark.parametrize('name,value,message', [
    ('data.source', 'hub', "config.data.source='hub' is not allowed (allowed: 'jsonl', 'demo')"),
    ('data.demo_train', -1, 'config.data.demo_train must be at least 0, got -1'),
    ('seed', 1.5, 'config.seed must be of type int, got 1.5'),
    ('seed', True, 'config.seed must be of type int, got True'),
    ('eval.rows', ('none', 'gold'), "config.eval.rows: 'gold' is not allowed"),
    ('train.seeds', (0, 'a'), "config.train.seeds: element 'a' is not of type int"),
    ('train.seeds', 3, 'config.train.seeds must be a tuple of int values, got 3'),
])
def test_check_names_the_field_and_what_it_allows(name, value, message):
  c = config_fields.build(FIELDS)
  node = c
  *parents, leaf = name.split('.')
  for part in parents:
    node = node[part]
  with node.ignore_type():
    node[leaf] = value
  with pytest.raises(ConfigError) as e:
    config_fields.check(c, FIELDS, 'toy')
  assert message in str(e.value)


def test_an_int_is_a_float_fields_value_and_undeclared_or_missing_fields_fail():
  c = config_fields.build(FIELDS)
  config_fields.check_value(FIELDS[3], 1)  # an int learning rate is fine
  c.data.extra = 1
  with pytest.raises(ConfigError, match=r'data\.extra are not declared .* toy system'):
    config_fields.check(c, FIELDS, 'toy')
  with pytest.raises(ConfigError, match=r'train\.seeds of the toy system are missing'):
    config_fields.check(config_fields.build(FIELDS[:-1]), FIELDS, 'toy')


def test_overrides_unknown_other_systems_and_ignored_fields():
  c = config_fields.build(FIELDS)
  others = {'abstractive': (Field('teacher.model', '', 'the teacher'),)}
  config_fields.check_override('seed', {}, c, FIELDS, 'toy', others)
  with pytest.raises(ConfigError, match='unknown config field; fields of data: data.demo_train, data.source'):
    config_fields.check_override('data.sorce', {}, c, FIELDS, 'toy', others)
  with pytest.raises(ConfigError, match="a field of the abstractive system; config.system='toy' does not read it"):
    config_fields.check_override('teacher.model', {}, c, FIELDS, 'toy', others)
  with pytest.raises(ConfigError, match=r"ignored when data.source='jsonl'"):
    config_fields.check_override('data.demo_train', {}, c, FIELDS, 'toy', others)
  # the switch set on the same command line counts
  config_fields.check_override('data.demo_train', {'data.source': 'demo'}, c, FIELDS, 'toy', others)


def test_help_lines_carry_default_help_choices_and_switch():
  lines = config_fields.help_lines(FIELDS)
  assert lines[1] == "  --config.data.source='jsonl'  where from [one of: jsonl, demo]"
  assert lines[2] == '  --config.data.demo_train=0  demo questions (read when data.source is demo)'
