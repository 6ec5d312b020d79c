"""The reader's prediction cache: answers equal fresh decoding, repeats are not decoded again,
and any change to the weights, the generation limit or the stop strings misses.

A tiny random Gemma 3 is saved by transformers and read through :class:`Reader` as a run
reads its reader; with a character-level tokenizer and short prompts its greedy answers differ
per prompt.
"""

from __future__ import annotations

import os

import ml_collections
import numpy as np
import pytest

from recomp_jax.pipelines import shared
from recomp_jax.stages import file_fingerprint
from recomp_jax.reader import Reader
from recomp_jax.reader.prediction_cache import PredictionCache, reader_key

import tiny_models  # noqa: E402  (tests/ is on sys.path under pytest)

import torch
import transformers
VOCAB = 128
QUESTIONS = ['who wrote it', 'where is the moon', 'when did it end', 'what is blue', 'why not', 'how far']


def _save_gemma(directory: str, seed: int) -> str:
  torch.manual_seed(seed)
  config = transformers.Gemma3TextConfig(
      vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, head_dim=16,
      num_hidden_layers=2, num_key_value_heads=2, sliding_window=64, query_pre_attn_scalar=16,
      attn_implementation='eager', bos_token_id=2, eos_token_id=1, pad_token_id=0)
  hf = transformers.Gemma3ForCausalLM(config).eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      p.normal_(0.0, 0.2 if 'norm' in name else 0.3)
  hf.save_pretrained(directory)
  tiny_models.char_tokenizer(VOCAB).save_pretrained(directory)
  return directory


@pytest.fixture(scope='module')
def gemma_dirs(tmp_path_factory):
  """Two tiny Gemma 3 checkpoints with different weights."""
  return (_save_gemma(str(tmp_path_factory.mktemp('gemma_a')), 0),
          _save_gemma(str(tmp_path_factory.mktemp('gemma_b')), 1))


class _CountingGenerator:
  """Wraps a reader's generator and records the prompts it is asked to decode."""

  def __init__(self, generator):
    self.generator = generator
    self.calls: list[list[str]] = []

  def __call__(self, prompts, **kwargs):
    self.calls.append(list(prompts))
    return self.generator(prompts, **kwargs)


def _reader(directory: str, cache_path: str | None, **kwargs) -> tuple[Reader, _CountingGenerator]:
  reader = Reader(directory, generate_batch_size=4, max_new_tokens=6, **kwargs)
  counter = _CountingGenerator(reader.generator)
  reader._generator = counter  # pylint: disable=protected-access
  if cache_path:
    reader.use_prediction_cache(cache_path, file_fingerprint(directory))
  return reader, counter


def test_cached_answers_equal_fresh_decoding_and_are_not_decoded_again(gemma_dirs, tmp_path):
  prompts = list(QUESTIONS)
  fresh, _ = _reader(gemma_dirs[0], None)
  expected = fresh.answer(prompts)
  assert len(set(expected)) > 2  # the answers depend on the prompt: a wrong lookup would show

  path = str(tmp_path / 'cache.sqlite')
  reader, counter = _reader(gemma_dirs[0], path)
  assert reader.answer(prompts[:4] + prompts[:2]) == expected[:4] + expected[:2]
  assert counter.calls == [prompts[:4]]  # each distinct prompt decoded once
  assert reader.answer(prompts) == expected
  assert counter.calls[1:] == [prompts[4:]]  # only the two new prompts
  assert reader.answer(prompts[::-1]) == expected[::-1]
  assert len(counter.calls) == 2
  cache = reader.prediction_cache
  assert (cache.hits, cache.misses, len(cache)) == (0 + 4 + 6, 6 + 2 + 0, 6)

  again, counter = _reader(gemma_dirs[0], path)  # a new process on the same file
  scored = again.exact_match(prompts, [[a or 'x'] for a in expected])
  assert scored['predictions'] == expected and counter.calls == []
  np.testing.assert_array_equal(scored['em_per_example'], [1.0 if a else 0.0 for a in expected])


def test_other_weights_limit_or_stop_strings_miss(gemma_dirs, tmp_path):
  prompts = QUESTIONS[:3]
  path = str(tmp_path / 'cache.sqlite')
  first, _ = _reader(gemma_dirs[0], path)
  first.answer(prompts)

  other, counter = _reader(gemma_dirs[1], path)
  assert other.answer(prompts) == _reader(gemma_dirs[1], None)[0].answer(prompts)
  assert counter.calls == [prompts]
  assert other.answer(prompts) != first.answer(prompts)  # the weights matter, so the miss mattered

  same, counter = _reader(gemma_dirs[0], path)
  short = same.answer(prompts, max_new_tokens=2)
  assert counter.calls == [prompts] and short == _reader(gemma_dirs[0], None)[0].answer(prompts, max_new_tokens=2)
  assert short != first.answer(prompts)
  stops, counter = _reader(gemma_dirs[0], path, stop_strings=('\n', 'e'))
  stops.answer(prompts)
  assert counter.calls == [prompts]


def test_reader_key_ignores_the_path_and_follows_content_and_code(gemma_dirs, tmp_path):
  weights = file_fingerprint(gemma_dirs[0])
  moved = dict(weights, path='/elsewhere')
  assert reader_key(weights, stop_strings=['\n']) == reader_key(moved, stop_strings=['\n'])
  assert reader_key(weights, stop_strings=['\n']) != reader_key(file_fingerprint(gemma_dirs[1]), stop_strings=['\n'])
  assert reader_key(weights, stop_strings=['\n']) != reader_key(weights, stop_strings=['\n', '.'])
  assert reader_key(weights, code=('recomp_jax.reader',)) != reader_key(weights, code=('recomp_jax.models',))

  cache = PredictionCache(str(tmp_path / 'c.sqlite'), 'k')
  cache.store(['a', 'b'], ['', 'B'], 12)
  assert cache.lookup(['b', 'a', 'c'], 12) == ['B', '', None]  # an empty answer is an answer
  assert cache.lookup(['a'], 6) == [None]
  with pytest.raises(ValueError, match='2 prompts for 1 answers'):
    cache.store(['a', 'b'], ['x'], 12)


def test_run_resources_cache_in_the_workdir_unless_off(gemma_dirs, tmp_path):
  def config(setting):
    c = ml_collections.ConfigDict()
    c.reader = ml_collections.ConfigDict({'model': gemma_dirs[0], 'score_batch_size': 4, 'generate_batch_size': 4,
                                          'max_new_tokens': 6, 'prediction_cache': setting})
    return c

  workdir = str(tmp_path / 'run')
  os.makedirs(workdir)
  reader = shared.Resources(config(''), workdir).reader
  assert reader.prediction_cache.path == os.path.join(workdir, 'reader_predictions.sqlite')
  reader.answer(QUESTIONS[:1])
  assert os.path.exists(os.path.join(workdir, 'reader_predictions.sqlite'))
  shared_file = str(tmp_path / 'shared.sqlite')
  assert shared.Resources(config(shared_file), workdir).reader.prediction_cache.path == shared_file
  assert shared.Resources(config('off'), workdir).reader.prediction_cache is None
  assert shared.Resources(config(''), None).reader.prediction_cache is None


def test_other_decoding_is_cached_apart_and_equals_fresh_decoding(gemma_dirs, tmp_path):
  prompts = QUESTIONS[:4]
  fresh, _ = _reader(gemma_dirs[0], None)
  long_form = fresh.answer(prompts, stop_strings=('e',), postprocess=False)
  raw = fresh.generator(prompts, max_new_tokens=6, stop_strings=('e',))
  assert long_form == [t.strip() for t in raw]
  default = fresh.answer(prompts)

  reader, counter = _reader(gemma_dirs[0], str(tmp_path / 'cache.sqlite'))
  assert reader.answer(prompts) == default
  assert reader.answer(prompts, stop_strings=('e',), postprocess=False) == long_form
  assert counter.calls == [prompts, prompts]  # the variant did not read the default's answers
  assert reader.answer(prompts, stop_strings=('e',), postprocess=False) == long_form
  assert reader.answer(prompts, stop_strings=('e',)) == fresh.answer(prompts, stop_strings=('e',))
  assert len(counter.calls) == 3  # the repeat hit; post-processing is a variant of its own


def test_exported_answers_seed_a_fresh_cache(gemma_dirs, tmp_path):
  from recomp_jax.reader.prediction_cache import export_answers  # pylint: disable=import-outside-toplevel
  prompts = QUESTIONS
  first, _ = _reader(gemma_dirs[0], str(tmp_path / 'run1.sqlite'))
  expected = first.answer(prompts)
  long_form = first.answer(prompts[:2], stop_strings=('e',), postprocess=False)
  out = str(tmp_path / 'answers.jsonl.gz')
  assert export_answers(str(tmp_path / 'run1.sqlite'), out) == len(prompts) + 2
  with open(out, 'rb') as f:
    exported = f.read()
  export_answers(str(tmp_path / 'run1.sqlite'), out)
  with open(out, 'rb') as f:
    assert f.read() == exported  # the same answers, the same bytes

  second, counter = _reader(gemma_dirs[0], str(tmp_path / 'run2.sqlite'))
  assert second.prediction_cache.seed(out) == {'read': len(prompts) + 2, 'added': len(prompts) + 2}
  assert second.prediction_cache.seed(out)['added'] == 0
  assert second.answer(prompts) == expected
  assert second.answer(prompts[:2], stop_strings=('e',), postprocess=False) == long_form
  assert counter.calls == []
  other, counter = _reader(gemma_dirs[1], str(tmp_path / 'run3.sqlite'))
  other.prediction_cache.seed(out)
  other.answer(prompts)
  assert counter.calls == [prompts]  # other weights never read the seeded answers

  import gzip  # pylint: disable=import-outside-toplevel
  bad = str(tmp_path / 'bad.jsonl.gz')
  with gzip.open(bad, 'wt') as f:
    f.write('{"reader": "k", "max_new_tokens": 6, "prompt_sha": "s", "answer": "a"}\n{"reader": "k"}\n')
  with pytest.raises(ValueError, match=r'bad\.jsonl\.gz:2: .*prompt_sha'):
    other.prediction_cache.seed(bad)
  with gzip.open(bad, 'wt') as f:
    f.write('{"reader": "k", "max_new_tokens": 6, "prompt_sha": "s", "answer": null}\n')
  with pytest.raises(ValueError, match=r'bad\.jsonl\.gz:1: .*NoneType'):
    other.prediction_cache.seed(bad)


def test_answer_key_is_the_readers_and_rekeyed_answers_are_read_under_the_new_key(gemma_dirs, tmp_path):
  from recomp_jax.reader.prediction_cache import answer_key, export_answers, rekey_answers  # pylint: disable=import-outside-toplevel
  prompts = QUESTIONS[:3]
  first, _ = _reader(gemma_dirs[0], str(tmp_path / 'run1.sqlite'))
  expected = first.answer(prompts, stop_strings=('e',), postprocess=False)
  weights = file_fingerprint(gemma_dirs[0])
  key = answer_key(weights, reader_stops=first.stop_strings, stops=('e',), postprocess=False)
  assert key == first.prediction_cache.variant_key('{"stop_strings": ["e"], "postprocess": false}')
  assert answer_key(weights, reader_stops=first.stop_strings, stops=first.stop_strings, postprocess=True) == \
      first.prediction_cache.key
  out = str(tmp_path / 'answers.jsonl.gz')
  export_answers(str(tmp_path / 'run1.sqlite'), out)
  # Answers of a reader whose code key changed (here: a made-up old key) are moved to today's.
  assert rekey_answers(out, key, 'old') == 3
  second, counter = _reader(gemma_dirs[0], str(tmp_path / 'run2.sqlite'))
  second.prediction_cache.seed(out)
  assert second.answer(prompts, stop_strings=('e',), postprocess=False) == expected and counter.calls == [prompts]
  assert rekey_answers(out, 'old', key) == 3 and rekey_answers(out, 'old', key) == 0
  third, counter = _reader(gemma_dirs[0], str(tmp_path / 'run3.sqlite'))
  third.prediction_cache.seed(out)
  assert third.answer(prompts, stop_strings=('e',), postprocess=False) == expected and counter.calls == []


def test_run_resources_read_seed_files(gemma_dirs, tmp_path):
  from recomp_jax.reader.prediction_cache import export_answers  # pylint: disable=import-outside-toplevel
  first, _ = _reader(gemma_dirs[0], str(tmp_path / 'run1.sqlite'))
  expected = first.answer(QUESTIONS[:3])
  out = str(tmp_path / 'answers.jsonl.gz')
  export_answers(str(tmp_path / 'run1.sqlite'), out)
  c = ml_collections.ConfigDict()
  c.reader = ml_collections.ConfigDict({'model': gemma_dirs[0], 'score_batch_size': 4, 'generate_batch_size': 4,
                                        'max_new_tokens': 6, 'prediction_cache': '', 'prediction_seed': (out,)})
  workdir = str(tmp_path / 'run2')
  os.makedirs(workdir)
  reader = shared.Resources(c, workdir).reader
  assert len(reader.prediction_cache) == 3
  counter = _CountingGenerator(reader.generator)
  reader._generator = counter  # pylint: disable=protected-access
  assert reader.answer(QUESTIONS[:3]) == expected and counter.calls == []
  c.reader.prediction_seed = (str(tmp_path / 'missing.jsonl.gz'),)
  with pytest.raises(shared.PipelineError, match='missing.jsonl.gz: no such file'):
    _ = shared.Resources(c, str(tmp_path)).reader


def test_export_needs_an_existing_cache_and_seed_needs_a_cache(gemma_dirs, tmp_path):
  from recomp_jax.reader.prediction_cache import export_answers  # pylint: disable=import-outside-toplevel
  with pytest.raises(ValueError, match='no such prediction cache'):
    export_answers(str(tmp_path / 'typo.sqlite'), str(tmp_path / 'out.jsonl.gz'))
  assert not os.path.exists(tmp_path / 'typo.sqlite')  # nothing created by the failed export
  c = ml_collections.ConfigDict()
  c.reader = ml_collections.ConfigDict({'model': gemma_dirs[0], 'score_batch_size': 4, 'generate_batch_size': 4,
                                        'max_new_tokens': 6, 'prediction_cache': 'off',
                                        'prediction_seed': (str(tmp_path / 'answers.jsonl.gz'),)})
  with pytest.raises(shared.PipelineError, match='keeps no prediction cache'):
    _ = shared.Resources(c, str(tmp_path)).reader
