"""RECOMP's text-only compression baselines (§4.3): BoW, named entities, random sentence.

* **BoW** -- "converts the retrieved documents to a list of ordered unigram and
  concatenates them together". Reverse-engineered exactly from RECOMP Table 12: the
  words (``\\w+`` runs, so punctuation and '@-@' vanish and 'East-SE' gives 'East',
  'SE') in order of first appearance, each kept once (case-sensitive: 'The' and 'the'
  differ, 'Sea' and 'sea' too), leaving out the NLTK English stop-word list matched
  case-sensitively (so sentence-initial 'The'/'To' stay, as in the paper's example).
  The unit test reproduces the paper's BoW line for its WikiText example word for word.
  There is no token budget in the paper (450 BoW vs 660 full tokens on NQ);
  ``max_words`` optionally truncates.
* **NE** -- "extracts a list of ordered named entities from retrieved documents and
  concatenates them". RECOMP used spaCy; spaCy models cannot be downloaded here, so
  :func:`extract_entities` is an offline heuristic recogniser: maximal runs of
  capitalised words (with initials and name particles such as 'of', 'of the', 'de',
  'van' inside, but not after a lone compass word: 'South of the Cyclades' gives
  'South' and 'Cyclades'; a capitalised stop word such as 'The' starts a new run),
  numbers (years, amounts) and month-day-year dates; leading stop words are trimmed
  ('The Sea of Crete' -> 'Sea of Crete') and a lone sentence-initial word that also
  occurs in lower case elsewhere in the text is not an entity ('Although').
  Entities are kept once, in order of first appearance, joined by spaces as in the
  paper's example. Expect it to miss lower-case entities and over-merge some spans.
* **Random** -- one candidate sentence drawn uniformly (seeded).

Documents are read in retrieval rank order, best first, each as ``'{title}\\n{text}'``
(a line break ends an entity span, so a title never merges into its text).
"""

from __future__ import annotations

import hashlib
import re
from typing import Sequence

import numpy as np

from recomp_jax.data.schema import Passage

# NLTK's English stop-word list (the 179 words of nltk.corpus.stopwords 'english').
ENGLISH_STOPWORDS = frozenset('''
i me my myself we our ours ourselves you you're you've you'll you'd your yours yourself
yourselves he him his himself she she's her hers herself it it's its itself they them their
theirs themselves what which who whom this that that'll these those am is are was were be
been being have has had having do does did doing a an the and but if or because as until
while of at by for with about against between into through during before after above below
to from up down in out on off over under again further then once here there when where why
how all any both each few more most other some such no nor not only own same so than too
very s t can will just don don't should should've now d ll m o re ve y ain aren aren't
couldn couldn't didn didn't doesn doesn't hadn hadn't hasn hasn't haven haven't isn isn't ma
mightn mightn't mustn mustn't needn needn't shan shan't shouldn shouldn't wasn wasn't weren
weren't won won't wouldn wouldn't
'''.split())

_WORD = re.compile(r'\w+')


def _documents_text(passages: Sequence[Passage], include_title: bool) -> str:
  return '\n'.join(f'{p.title}\n{p.text}' if include_title and p.title else p.text
                   for p in passages)


# ----------------------------------------------------------------------------- BoW


def bag_of_words(text: str, *, stopwords: frozenset[str] = ENGLISH_STOPWORDS,
                 max_words: int | None = None) -> str:
  """Unique non-stop-word ``\\w+`` words of ``text`` in order of first appearance."""
  seen: dict[str, None] = {}
  for word in _WORD.findall(text):
    if word in stopwords or word in seen:
      continue
    seen[word] = None
    if max_words is not None and len(seen) >= max_words:
      break
  return ' '.join(seen)


def bow_compress(passages: Sequence[Passage], *, include_title: bool = True,
                 stopwords: frozenset[str] = ENGLISH_STOPWORDS,
                 max_words: int | None = None) -> str:
  """BoW baseline over documents given best first."""
  return bag_of_words(_documents_text(passages, include_title), stopwords=stopwords,
                      max_words=max_words)


# ----------------------------------------------------------------------------- NE

_TOKEN = re.compile(r"\n|\d+(?:[.,]\d+)*|\w+(?:['’-]\w+)*|[^\w\s]")  # a newline ends a span
_PARTICLES = frozenset('of de da di del della der den du van von la le bin ibn al y'.split())
_MONTHS = frozenset('January February March April May June July August September October '
                    'November December'.split())
_COMPASS = frozenset('North South East West Northeast Northwest Southeast Southwest Northern '
                     'Southern Eastern Western Central'.split())
_SENTENCE_END = frozenset('.!?\n')
_OPENERS = frozenset('"\'“‘([')


def _is_cap(tok: str) -> bool:
  return tok[:1].isupper()


def _is_number(tok: str) -> bool:
  return tok[:1].isdigit()


def extract_entities(text: str) -> list[str]:
  """Heuristic named entities of ``text``, de-duplicated, in order of first appearance."""
  toks = _TOKEN.findall(text)
  lower_words = {t for t in toks if t[:1].islower()}
  out: dict[str, None] = {}

  def sentence_initial(i: int) -> bool:
    j = i - 1
    while j >= 0 and toks[j] in _OPENERS:
      j -= 1
    return j < 0 or toks[j] in _SENTENCE_END

  i, n = 0, len(toks)
  while i < n:
    tok = toks[i]
    if _is_number(tok):
      out.setdefault(tok)
      i += 1
      continue
    if not _is_cap(tok):
      i += 1
      continue
    start, span = i, [tok]
    i += 1
    while i < n:
      if _is_cap(toks[i]) and toks[i].lower() in ENGLISH_STOPWORDS:
        break  # 'The', 'In' start a new span
      if _is_cap(toks[i]):
        span.append(toks[i])
        i += 1
      elif toks[i] == '.' and len(span[-1]) == 1:  # an initial: 'J.'
        span[-1] += '.'
        i += 1
      elif toks[i] in _PARTICLES and i + 1 < n and not (len(span) == 1 and span[0] in _COMPASS):
        # 'of', 'of the', 'van', ... between capitalised words
        j = i
        while j < n and j - i < 2 and (toks[j] in _PARTICLES or (toks[j] == 'the' and j > i)):
          j += 1
        if j < n and _is_cap(toks[j]):
          span.extend(toks[i:j])
          i = j
        else:
          break
      else:
        break
    if span[0] in _MONTHS and i < n and _is_number(toks[i]):
      span.append(toks[i])  # 'December 2007', 'May 18' (+ ', 2018')
      i += 1
      if i + 1 < n and toks[i] == ',' and _is_number(toks[i + 1]) and len(toks[i + 1]) == 4:
        span[-1] += ','
        span.append(toks[i + 1])
        i += 2
    while span and span[0].lower() in ENGLISH_STOPWORDS:
      span = span[1:]
      start += 1
    while span and (span[-1] in _PARTICLES or span[-1] == 'the'):
      span = span[:-1]
    if not span:
      continue
    if (len(span) == 1 and sentence_initial(start) and span[0].lower() in lower_words):
      continue
    out.setdefault(' '.join(span))
  return list(out)


def ne_compress(passages: Sequence[Passage], *, include_title: bool = True, sep: str = ' ',
                max_entities: int | None = None) -> str:
  """NE baseline over documents given best first."""
  entities = extract_entities(_documents_text(passages, include_title))
  return sep.join(entities[:max_entities] if max_entities is not None else entities)


# ----------------------------------------------------------------------------- random


def random_sentence(candidates: Sequence[str], rng: np.random.Generator) -> str:
  """A uniformly drawn candidate ('' when there is none)."""
  if not candidates:
    return ''
  return candidates[int(rng.integers(len(candidates)))]


def random_sentences(candidate_lists: Sequence[Sequence[str]], seed: int,
                     keys: Sequence[str] | None = None) -> list[str]:
  """One random candidate per example, each from its own seeded generator.

  Example ``i`` draws from ``default_rng([seed, i])``, or, when ``keys`` (e.g. example
  ids) are given, from ``default_rng([seed, sha256(key)])`` so that each example keeps
  its sentence under any subset or reordering of the dataset.
  """
  if keys is not None and len(keys) != len(candidate_lists):
    raise ValueError(f'{len(keys)} keys for {len(candidate_lists)} candidate lists')
  out = []
  for i, cands in enumerate(candidate_lists):
    entropy = i if keys is None else int.from_bytes(
        hashlib.sha256(keys[i].encode('utf-8')).digest()[:8], 'little')
    out.append(random_sentence(cands, np.random.default_rng([seed, entropy])))
  return out
