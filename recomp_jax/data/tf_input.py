"""A tf.data input path with in-graph tokenisation (the ``[tf]`` extra: tensorflow-text).

Two pieces, both optional alternatives to the Hugging Face tokenizer + numpy path:

* :class:`TfWordPiece` (BERT / MiniLM / Contriever ``vocab.txt``) and :class:`TfSentencePiece`
  (T5 ``spiece.model``, Gemma ``tokenizer.model``): tokenisers that run inside the TensorFlow
  graph and give the token ids of the Hugging Face tokenizer of the same directory (WordPiece:
  identical on 3,600 real NQ and Wikipedia texts; SentencePiece: identical except where two
  segmentations tie in unigram score, which tensorflow-text's bundled SentencePiece breaks the
  other way, about 1 text in 1,500; see ``tests/test_tf_input.py``). Called like a
  Hugging Face tokenizer (``tok(texts, padding=..., truncation=True, max_length=N,
  return_tensors='np')``), so the training-array builders take either.
* :class:`TfTokenizedBatches`: a :class:`recomp_jax.training.loop.ResumableIterator` that
  streams texts through ``tf.data`` (index shuffle, per-process slice, batch, tokenise, prefetch)
  and yields this process's numpy batches ``{'input_ids', 'attention_mask'} [local_batch, L]``.
  Its order is :class:`recomp_jax.data.iterators.ArrayIterator`'s (same seed, same permutation,
  each process its contiguous slice of every global batch), its state is ``(epoch, batch)``, so
  a resumed run continues at the same example on any process count that divides the batch.

TensorFlow is imported lazily and kept off accelerators (JAX owns them).
"""

from __future__ import annotations

import functools
import os
from typing import Any, Mapping, Sequence

import numpy as np

from recomp_jax.data import formats
from recomp_jax.data.iterators import EpochBatchPosition, epoch_order


@functools.lru_cache(maxsize=None)
def _tf():
  """``(tensorflow, tensorflow_text)``, with TensorFlow hidden from GPUs and TPUs."""
  try:
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tensorflow_text as tf_text  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError("the tf.data input path needs the [tf] extra: pip install -e '.[tf]'") from e
  try:
    tf.config.set_visible_devices([], 'GPU')
    tf.config.set_visible_devices([], 'TPU')
  except (RuntimeError, ValueError):
    pass  # already initialised or no such device type
  return tf, tf_text


def _read_json(path: str) -> dict:
  """The tokenizer's JSON config at ``path`` ({} when absent); a damaged one is a ``DataError``."""
  return formats.read_json(path) if os.path.exists(path) else {}


class _InGraphTokenizer:
  """Shared ``__call__`` (Hugging Face's calling convention) over :meth:`ragged`."""

  pad_token_id: int = 0
  model_max_length: int = 512

  def ragged(self, texts, max_length: int | None):
    """``[B, (T)]`` int32 token ids with the model's special tokens, at most ``max_length``."""
    raise NotImplementedError

  def padded(self, ragged, width: int | None):
    """``(input_ids, attention_mask)`` ``[B, width]`` tensors (``width=None``: the longest row)."""
    tf, _ = _tf()
    return (ragged.to_tensor(default_value=self.pad_token_id, shape=[None, width]),
            tf.ones_like(ragged).to_tensor(default_value=0, shape=[None, width]))

  def __call__(self, texts: Sequence[str] | str, *, padding: bool | str = 'longest',
               truncation: bool = True, max_length: int | None = None, return_tensors: str = 'np',
               add_special_tokens: bool = True) -> dict[str, np.ndarray]:
    """Hugging Face-style call: ``{'input_ids', 'attention_mask'} [B, L]`` int32 numpy.

    ``padding``: ``'longest'`` (or True) pads to the longest row, ``'max_length'`` to
    ``max_length``. Rows longer than ``max_length`` keep their first tokens and the closing
    special token, as Hugging Face truncation does.
    """
    del return_tensors
    if not add_special_tokens:
      raise ValueError('the in-graph tokenisers always add the model\'s special tokens')
    tf, _ = _tf()
    single = isinstance(texts, str)
    limit = max_length if truncation else None
    ragged = self.ragged(tf.constant([texts] if single else list(texts)), limit)
    if padding == 'max_length':
      if max_length is None:
        raise ValueError("padding='max_length' needs max_length")
      width = max_length
    else:
      width = None
    ids, mask = self.padded(ragged, width)
    return {'input_ids': ids.numpy().astype(np.int32), 'attention_mask': mask.numpy().astype(np.int32)}


class TfWordPiece(_InGraphTokenizer):
  """BERT WordPiece in the TensorFlow graph, matching ``BertTokenizer(Fast)`` of the same directory.

  Basic tokenisation (lower-casing with accent stripping when ``do_lower_case``, punctuation
  and CJK splitting) and greedy longest-match WordPiece with ``##`` continuations; ``[CLS] ...
  [SEP]`` around each text.
  """

  def __init__(self, vocab_file: str, *, do_lower_case: bool = True, max_input_chars_per_word: int = 100,
               model_max_length: int = 512):
    tf, tf_text = _tf()
    with open(vocab_file, encoding='utf-8') as f:
      vocab = [line.rstrip('\n') for line in f]
    self.vocab = {token: i for i, token in enumerate(vocab)}
    for token in ('[CLS]', '[SEP]', '[PAD]', '[UNK]'):
      if token not in self.vocab:
        raise ValueError(f'{vocab_file}: no {token} token in the vocabulary')
    self.cls_id, self.sep_id = self.vocab['[CLS]'], self.vocab['[SEP]']
    self.pad_token_id, self.unk_id = self.vocab['[PAD]'], self.vocab['[UNK]']
    self.model_max_length = model_max_length
    table = tf.lookup.StaticVocabularyTable(
        tf.lookup.KeyValueTensorInitializer(tf.constant(vocab), tf.range(len(vocab), dtype=tf.int64)),
        num_oov_buckets=1)
    # Lower-casing and accent stripping happen in _normalize, as Hugging Face does them:
    # tensorflow-text's lower_case applies NFKC case folding ('ς' -> 'σ', '″' -> '′′').
    self._tokenizer = tf_text.BertTokenizer(
        table, token_out_type=tf.int64, lower_case=False, unknown_token='[UNK]',
        max_chars_per_token=max_input_chars_per_word, max_bytes_per_word=4 * max_input_chars_per_word)
    self.do_lower_case = do_lower_case

  @classmethod
  def from_pretrained(cls, directory: str) -> 'TfWordPiece':
    config = _read_json(os.path.join(directory, 'tokenizer_config.json'))
    vocab = os.path.join(directory, 'vocab.txt')
    if not os.path.exists(vocab):
      raise FileNotFoundError(f'{directory}: no vocab.txt (needed by the in-graph WordPiece tokenizer)')
    limit = config.get('model_max_length') or 512
    return cls(vocab, do_lower_case=bool(config.get('do_lower_case', True)),
               model_max_length=int(min(limit, 1 << 20)))

  def _normalize(self, texts):
    """Hugging Face's BertNormalizer: spaces (Zs) to ' ', drop control characters, NFD, strip Mn,
    lower-case."""
    tf, tf_text = _tf()
    texts = tf.strings.regex_replace(texts, r'[\t\n\r\p{Zs}]', ' ')
    texts = tf.strings.regex_replace(texts, r'[\x{0}\x{FFFD}\p{Cc}\p{Cf}\p{Co}]', '')
    if self.do_lower_case:
      texts = tf_text.normalize_utf8(texts, 'NFD')
      texts = tf.strings.regex_replace(texts, r'\p{Mn}', '')
      # Hugging Face lower-cases per character: a capital sigma is always 'σ', never final 'ς'.
      texts = tf.strings.regex_replace(texts, 'Σ', 'σ')
      texts = tf.strings.lower(texts, encoding='utf-8')
    return texts

  def ragged(self, texts, max_length: int | None):
    tf, _ = _tf()
    pieces = self._tokenizer.tokenize(self._normalize(texts)).merge_dims(-2, -1)  # [B, (words), (pieces)] -> [B, (T)]
    pieces = tf.cast(pieces, tf.int32)
    if max_length is not None:
      pieces = pieces[:, :max(max_length - 2, 0)]
    batch = tf.shape(pieces.row_lengths())[0]
    cls = tf.fill([batch, 1], self.cls_id)
    sep = tf.fill([batch, 1], self.sep_id)
    return tf.concat([tf.RaggedTensor.from_tensor(cls), pieces, tf.RaggedTensor.from_tensor(sep)], axis=1)


class TfSentencePiece(_InGraphTokenizer):
  """SentencePiece in the TensorFlow graph (T5: ``</s>`` appended; Gemma: ``<bos>`` prepended)."""

  def __init__(self, model_file: str, *, add_bos: bool, add_eos: bool, pad_token_id: int = 0,
               model_max_length: int = 512):
    tf, tf_text = _tf()
    with open(model_file, 'rb') as f:
      self._tokenizer = tf_text.SentencepieceTokenizer(model=f.read(), out_type=tf.int32)
    self.add_bos, self.add_eos = add_bos, add_eos
    self.bos_id = int(self._tokenizer.string_to_id('<bos>' if add_bos else '<s>').numpy())
    self.eos_id = int(self._tokenizer.string_to_id('</s>' if add_eos else '<eos>').numpy())
    self.pad_token_id = pad_token_id
    self.model_max_length = model_max_length

  @classmethod
  def from_pretrained(cls, directory: str) -> 'TfSentencePiece':
    """T5 (``spiece.model``: EOS appended, pad 0) or Gemma (``tokenizer.model``: BOS first)."""
    config = _read_json(os.path.join(directory, 'tokenizer_config.json'))
    for name, add_bos, add_eos in (('spiece.model', False, True), ('tokenizer.model', True, False)):
      path = os.path.join(directory, name)
      if os.path.exists(path):
        add_bos = bool(config.get('add_bos_token', add_bos))
        add_eos = bool(config.get('add_eos_token', add_eos))
        limit = int(min(config.get('model_max_length') or 512, 1 << 20))
        return cls(path, add_bos=add_bos, add_eos=add_eos, model_max_length=limit)
    raise FileNotFoundError(f'{directory}: no spiece.model or tokenizer.model (SentencePiece)')

  def ragged(self, texts, max_length: int | None):
    tf, _ = _tf()
    pieces = self._tokenizer.tokenize(texts)  # [B, (T)] int32
    special = int(self.add_bos) + int(self.add_eos)
    if max_length is not None:
      pieces = pieces[:, :max(max_length - special, 0)]
    batch = tf.shape(pieces.row_lengths())[0]
    parts = [pieces]
    if self.add_bos:
      parts.insert(0, tf.RaggedTensor.from_tensor(tf.fill([batch, 1], self.bos_id)))
    if self.add_eos:
      parts.append(tf.RaggedTensor.from_tensor(tf.fill([batch, 1], self.eos_id)))
    return tf.concat(parts, axis=1) if len(parts) > 1 else pieces


def load_tf_tokenizer(directory: str) -> _InGraphTokenizer:
  """The in-graph tokenizer for a model directory: WordPiece (``vocab.txt``) or SentencePiece."""
  if os.path.exists(os.path.join(directory, 'vocab.txt')):
    return TfWordPiece.from_pretrained(directory)
  return TfSentencePiece.from_pretrained(directory)


class TfTokenizedBatches(EpochBatchPosition):
  """This process's tokenised batches of ``texts`` from a ``tf.data`` pipeline (resumable).

  Args:
    texts: the examples' texts (one per example).
    tokenizer: a :class:`TfWordPiece` or :class:`TfSentencePiece`.
    batch_size: global batch size (divisible by ``process_count``).
    max_length: every batch is padded to this length (one compiled shape).
    seed, shuffle: as :class:`recomp_jax.data.iterators.ArrayIterator` (same order).
    process_index, process_count: this process's slot (default: JAX's).
  Yields:
    ``{'input_ids', 'attention_mask'} [batch_size / process_count, max_length]`` int32 and
    ``'index' [local]`` int64, the examples' positions in ``texts``.
  """

  def __init__(self, texts: Sequence[str], tokenizer: _InGraphTokenizer, batch_size: int, *,
               max_length: int, seed: int = 0, shuffle: bool = True, process_index: int | None = None,
               process_count: int | None = None, prefetch: int = 2):
    if process_index is None or process_count is None:
      import jax  # pylint: disable=import-outside-toplevel
      process_index = jax.process_index() if process_index is None else process_index
      process_count = jax.process_count() if process_count is None else process_count
    if batch_size % process_count:
      raise ValueError(f'global batch size {batch_size} is not divisible by {process_count} processes')
    if batch_size > len(texts):
      raise ValueError(f'batch size {batch_size} exceeds the {len(texts)} examples')
    self.texts = list(texts)
    self.tokenizer = tokenizer
    self.batch_size, self.max_length = batch_size, max_length
    self.seed, self.shuffle = seed, shuffle
    self.process_index, self.process_count = process_index, process_count
    self.local = batch_size // process_count
    self.prefetch = prefetch
    self.num_examples = len(self.texts)
    self.batches_per_epoch = self.num_examples // batch_size
    self.epoch = self.batch = 0
    self._stream = None

  def _local_order(self, epoch: int) -> np.ndarray:
    """``[batches, local]``: the example indices this process reads in ``epoch``."""
    order = epoch_order(self.seed, epoch, self.num_examples, self.shuffle)
    full = order[:self.batches_per_epoch * self.batch_size].reshape(self.batches_per_epoch, self.batch_size)
    start = self.process_index * self.local
    return full[:, start:start + self.local]

  def _dataset(self, epoch: int, first_batch: int):
    tf, _ = _tf()
    texts = tf.constant(self.texts)
    indices = self._local_order(epoch)[first_batch:]
    tokenizer, length = self.tokenizer, self.max_length

    def tokenize(index):
      ids, mask = tokenizer.padded(tokenizer.ragged(tf.gather(texts, index), length), length)
      return {'input_ids': ids, 'attention_mask': mask, 'index': index}

    return (tf.data.Dataset.from_tensor_slices(indices.astype(np.int64))
            .map(tokenize, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
            .prefetch(self.prefetch))

  def __iter__(self) -> 'TfTokenizedBatches':
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self.batch >= self.batches_per_epoch:
      self.epoch, self.batch, self._stream = self.epoch + 1, 0, None
    if self._stream is None:
      self._stream = iter(self._dataset(self.epoch, self.batch).as_numpy_iterator())
    out = next(self._stream)
    self.batch += 1
    return {'input_ids': out['input_ids'].astype(np.int32),
            'attention_mask': out['attention_mask'].astype(np.int32), 'index': out['index']}

  def set_state(self, state: Mapping[str, Any]) -> None:
    super().set_state(state)
    self._stream = None


__all__ = ['TfSentencePiece', 'TfTokenizedBatches', 'TfWordPiece', 'load_tf_tokenizer']
