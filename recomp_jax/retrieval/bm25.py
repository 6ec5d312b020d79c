"""BM25 retrieval over a passage corpus and BM25 ranking of candidate sentences.

Scores are exactly ``rank_bm25.BM25Okapi``'s (the protocol's "BM25 top sentence"
baseline uses it with lower-cased whitespace tokens and its defaults k1=1.5,
b=0.75, epsilon=0.25). ``BM25Okapi.get_scores`` loops over every document in
Python for every query token; :class:`BM25Index` instead builds BM25Okapi once,
then stores its per-(term, document) weights

    w[t, d] = idf[t] * tf[t, d] * (k1 + 1) / (tf[t, d] + k1 * (1 - b + b * len[d] / avgdl))

as an inverted index (CSR over terms), so a query's scores are one gather and one
``np.bincount``: the same numbers (up to float summation order) at corpus scale.
Repeated query tokens count repeatedly and unknown tokens score 0, as in rank_bm25.

The index is saved to / loaded from one pickle file; :meth:`BM25Index.build_or_load`
keys it by a fingerprint of the corpus and the parameters so a workdir reuses it.

Ties are broken by corpus order (the earlier passage / candidate first).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import re
from typing import Callable, Sequence

import numpy as np

from recomp_jax.data.schema import Example, Passage

_FORMAT_VERSION = 1


def whitespace_tokenize(text: str) -> list[str]:
  """The protocol's tokenizer: ``text.lower().split()``."""
  return text.lower().split()


def make_tokenizer(name: str = 'whitespace', pattern: str = r'\w+',
                   lowercase: bool = True) -> Callable[[str], list[str]]:
  """``'whitespace'`` (lower-cased ``str.split``) or ``'regex'`` (``re.findall(pattern)``)."""
  if name == 'whitespace':
    return whitespace_tokenize if lowercase else str.split
  if name == 'regex':
    compiled = re.compile(pattern)
    if lowercase:
      return lambda text: compiled.findall(text.lower())
    return compiled.findall
  raise ValueError(f"tokenizer must be 'whitespace' or 'regex', got {name!r}")


@dataclasses.dataclass(frozen=True)
class BM25Config:
  """BM25Okapi parameters and tokenisation.

  Attributes:
    k1, b, epsilon: BM25Okapi parameters (epsilon floors negative idf at
      ``epsilon * mean idf``). The shared NQ files were retrieved with k1=0.9, b=0.4.
    tokenizer: ``'whitespace'`` or ``'regex'``.
    pattern: token regex for ``'regex'``.
    lowercase: lower-case before tokenising.
    index_title: index ``'{title} {text}'`` instead of ``text`` (corpus retrieval only).
  """
  k1: float = 1.5
  b: float = 0.75
  epsilon: float = 0.25
  tokenizer: str = 'whitespace'
  pattern: str = r'\w+'
  lowercase: bool = True
  index_title: bool = True

  def make_tokenizer(self) -> Callable[[str], list[str]]:
    return make_tokenizer(self.tokenizer, self.pattern, self.lowercase)


def _okapi(tokenized: list[list[str]], config: BM25Config):
  from rank_bm25 import BM25Okapi  # pylint: disable=import-outside-toplevel
  return BM25Okapi(tokenized, k1=config.k1, b=config.b, epsilon=config.epsilon)


def corpus_fingerprint(passages: Sequence[Passage], config: BM25Config) -> str:
  """sha256 over the parameters and every passage's id, title and text."""
  h = hashlib.sha256(repr(dataclasses.astuple(config)).encode())
  for p in passages:
    for part in (p.id, p.title, p.text):
      h.update(part.encode('utf-8'))
      h.update(b'\x00')
  return h.hexdigest()


class BM25Index:
  """BM25Okapi over passages with vectorised scoring.

  Attributes:
    passages: the indexed corpus, ``N`` passages.
    config: :class:`BM25Config`.
    vocab: term -> row of the inverted index.
    term_ptr: ``[V + 1]`` int64 CSR row pointers.
    post_doc: ``[nnz]`` int32 document of each posting.
    post_weight: ``[nnz]`` float64 BM25 weight of each posting.
    fingerprint: :func:`corpus_fingerprint` of the corpus and config.
  """

  def __init__(self, passages: Sequence[Passage], config: BM25Config = BM25Config()):
    if not passages:
      raise ValueError('cannot index an empty corpus')
    self.passages = list(passages)
    self.config = config
    self.fingerprint = corpus_fingerprint(self.passages, config)
    self._tokenize = config.make_tokenizer()
    tokenized = [self._tokenize(self._doc_text(p)) for p in self.passages]
    if not any(tokenized):
      raise ValueError('every passage is empty after tokenisation')
    okapi = _okapi(tokenized, config)
    doc_len = np.asarray(okapi.doc_len, dtype=np.float64)
    norm = config.k1 * (1.0 - config.b + config.b * doc_len / okapi.avgdl)  # [N]
    postings: dict[str, tuple[list[int], list[float]]] = {}
    for d, freqs in enumerate(okapi.doc_freqs):
      for term, tf in freqs.items():
        docs, tfs = postings.setdefault(term, ([], []))
        docs.append(d)
        tfs.append(tf)
    self.vocab = {term: i for i, term in enumerate(postings)}
    counts = np.fromiter((len(v[0]) for v in postings.values()), dtype=np.int64,
                         count=len(postings))
    self.term_ptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    self.post_doc = np.fromiter((d for v in postings.values() for d in v[0]), dtype=np.int32,
                                count=int(self.term_ptr[-1]))
    tf = np.fromiter((t for v in postings.values() for t in v[1]), dtype=np.float64,
                     count=int(self.term_ptr[-1]))
    idf = np.fromiter((okapi.idf[t] for t in postings), dtype=np.float64, count=len(postings))
    idf_per_post = np.repeat(idf, counts)
    self.post_weight = idf_per_post * tf * (config.k1 + 1.0) / (tf + norm[self.post_doc])

  def _doc_text(self, p: Passage) -> str:
    return f'{p.title} {p.text}' if self.config.index_title and p.title else p.text

  def __len__(self) -> int:
    return len(self.passages)

  def scores(self, query: str) -> np.ndarray:
    """``[N]`` float64 BM25Okapi scores of every passage for ``query``."""
    rows = [self.vocab[t] for t in self._tokenize(query) if t in self.vocab]
    if not rows:
      return np.zeros(len(self.passages), dtype=np.float64)
    starts, ends = self.term_ptr[rows], self.term_ptr[np.asarray(rows) + 1]
    idx = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])
    return np.bincount(self.post_doc[idx], weights=self.post_weight[idx],
                       minlength=len(self.passages))

  def search(self, query: str, k: int = 20) -> list[Passage]:
    """Top-``k`` passages (best first) with ``score`` set; ties by corpus order."""
    if k <= 0:
      return []
    scores = self.scores(query)
    k = min(k, len(scores))
    top = np.argpartition(-scores, k - 1)[:k] if k < len(scores) else np.arange(len(scores))
    top = top[np.lexsort((top, -scores[top]))]
    return [dataclasses.replace(self.passages[i], score=float(scores[i])) for i in top]

  def search_batch(self, queries: Sequence[str], k: int = 20) -> list[list[Passage]]:
    return [self.search(q, k) for q in queries]

  def rerank(self, query: str, passages: Sequence[Passage]) -> list[Passage]:
    """``passages`` (of this index, matched by id) best BM25 score first, ``score`` set; ties keep
    their given order (a dense retriever's pool re-ranked lexically, as K-COMP §4.1 does).

    Raises:
      KeyError: a passage whose id this index does not hold.
    """
    if not hasattr(self, '_row_of'):
      self._row_of = {p.id: i for i, p in enumerate(self.passages)}  # pylint: disable=attribute-defined-outside-init
    missing = [p.id for p in passages if p.id not in self._row_of]
    if missing:
      raise KeyError(f'{len(missing)} passage(s) not in this BM25 index, e.g. {missing[0]!r}')
    scores = self.scores(query)
    values = [float(scores[self._row_of[p.id]]) for p in passages]
    order = sorted(range(len(passages)), key=lambda i: (-values[i], i))
    return [dataclasses.replace(passages[i], score=values[i]) for i in order]

  def retrieve(self, examples: Sequence[Example], k: int = 20) -> list[Example]:
    """Examples with ``ctxs`` replaced by the top-``k`` passages for their question.

    ``has_answer`` of each retrieved passage is filled with
    :func:`recomp_jax.evaluation.qa_metrics.has_answer` and ``is_gold`` by id against ``gold_ctx``
    (analysis only).
    """
    from recomp_jax.evaluation.qa_metrics import has_answer  # pylint: disable=import-outside-toplevel
    out = []
    for ex in examples:
      gold_id = ex.gold_ctx.id if ex.gold_ctx is not None else None
      ctxs = [dataclasses.replace(p, has_answer=has_answer(p.text, ex.answers),
                                  is_gold=(p.id == gold_id) if gold_id is not None else None)
              for p in self.search(ex.question, k)]
      out.append(dataclasses.replace(ex, ctxs=ctxs))
    return out

  # --------------------------------------------------------------------------- persistence

  def save(self, path: str | os.PathLike) -> None:
    """Pickles the index (passages, config, inverted arrays) to ``path`` atomically."""
    state = {'version': _FORMAT_VERSION, 'config': dataclasses.asdict(self.config),
             'fingerprint': self.fingerprint,
             'passages': [dataclasses.astuple(p) for p in self.passages],
             'vocab': list(self.vocab), 'term_ptr': self.term_ptr, 'post_doc': self.post_doc,
             'post_weight': self.post_weight}
    tmp = f'{os.fspath(path)}.tmp{os.getpid()}'
    with open(tmp, 'wb') as f:
      pickle.dump(state, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)

  @classmethod
  def load(cls, path: str | os.PathLike) -> 'BM25Index':
    with open(path, 'rb') as f:
      state = pickle.load(f)
    if state.get('version') != _FORMAT_VERSION:
      raise ValueError(f'{path}: BM25 index format {state.get("version")}, '
                       f'expected {_FORMAT_VERSION}; rebuild it')
    index = cls.__new__(cls)
    index.config = BM25Config(**state['config'])
    index._tokenize = index.config.make_tokenizer()  # pylint: disable=protected-access
    index.fingerprint = state['fingerprint']
    index.passages = [Passage(*t) for t in state['passages']]
    index.vocab = {t: i for i, t in enumerate(state['vocab'])}
    index.term_ptr = state['term_ptr']
    index.post_doc = state['post_doc']
    index.post_weight = state['post_weight']
    return index

  @classmethod
  def build_or_load(cls, passages: Sequence[Passage], workdir: str | os.PathLike,
                    config: BM25Config = BM25Config(), name: str = 'bm25') -> 'BM25Index':
    """Loads ``{workdir}/{name}-{fingerprint[:16]}.pkl`` or builds and saves it."""
    fingerprint = corpus_fingerprint(passages, config)
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, f'{name}-{fingerprint[:16]}.pkl')
    if os.path.exists(path):
      index = cls.load(path)
      if index.fingerprint == fingerprint:
        return index
    index = cls(passages, config)
    index.save(path)
    return index


# ----------------------------------------------------------------------------- sentences


def sentence_scores(question: str, sentences: Sequence[str],
                    config: BM25Config = BM25Config(index_title=False)) -> np.ndarray:
  """``[S]`` BM25Okapi scores of ``sentences`` (the corpus) for ``question``.

  The statistics (idf, avgdl) are those of this candidate set alone, as in the
  protocol's baseline; rank_bm25 is called directly here (S is ~20).
  """
  if not sentences:
    return np.zeros(0, dtype=np.float64)
  tokenize = config.make_tokenizer()
  tokenized = [tokenize(s) for s in sentences]
  if not any(tokenized):
    return np.zeros(len(sentences), dtype=np.float64)
  return np.asarray(_okapi(tokenized, config).get_scores(tokenize(question)), dtype=np.float64)


def rank_sentences(question: str, sentences: Sequence[str],
                   config: BM25Config = BM25Config(index_title=False)) -> list[int]:
  """Indices of ``sentences`` by decreasing BM25 score, ties by position."""
  scores = sentence_scores(question, sentences, config)
  return np.lexsort((np.arange(len(scores)), -scores)).tolist()


def top_sentences(question: str, sentences: Sequence[str], k: int = 1,
                  config: BM25Config = BM25Config(index_title=False)) -> list[str]:
  """The protocol's "BM25 top sentence" baseline for ``k=1``: the best ``k`` candidates."""
  return [sentences[i] for i in rank_sentences(question, sentences, config)[:k]]
