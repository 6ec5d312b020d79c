"""Offline sentence splitting, candidate-sentence sets, and passage chunking.

Candidate sentences (RECOMP §3.1 and A.1; ``specs/nq_reader_protocol.md``):

1. the top ``top_docs`` (5) retrieved documents are each split into sentences with
   the protocol's regex :data:`SENTENCE_SPLIT_REGEX` -- ``(?<=[.!?])\\s+(?=[A-Z0-9])``,
   a split after ``.``/``!``/``?`` and whitespace, before a capital or a digit
   (RECOMP used NLTK; the protocol fixes this regex so results are reproducible
   without NLTK data);
2. every sentence is written ``'{title}: {sentence}'`` (the Wikipedia title is
   prepended for decontextualisation, RECOMP §3.1);
3. candidates are ordered by document rank, then reading order;
4. identical candidate strings are kept once (``'duplicate_candidate'`` in the report);
5. the first ``max_candidates`` (RECOMP: 20) are kept, the rest counted as
   ``'over_candidate_cap'``; pass ``max_candidates=None`` for all of them.

Chunking (RECOMP §4.1-4.2: "articles are truncated into non-overlapping documents of
100 words") splits articles on whitespace into consecutive ``words_per_passage``-word
passages.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

from recomp_jax.data.schema import FilterReport, Passage

SENTENCE_SPLIT_REGEX = r'(?<=[.!?])\s+(?=[A-Z0-9])'
_DEFAULT_SPLITTER = re.compile(SENTENCE_SPLIT_REGEX)


def split_sentences(text: str, pattern: str | re.Pattern = SENTENCE_SPLIT_REGEX) -> list[str]:
  """Splits ``text`` at the protocol regex; pieces are stripped, empty pieces dropped.

  >>> split_sentences('It rains. 3 cats ran! ok? Yes.')
  ['It rains.', '3 cats ran! ok?', 'Yes.']
  """
  splitter = _DEFAULT_SPLITTER if pattern == SENTENCE_SPLIT_REGEX else re.compile(pattern)
  return [s.strip() for s in splitter.split(text) if s.strip()]


def format_candidate(title: str, sentence: str) -> str:
  """``'{title}: {sentence}'`` (just the sentence when there is no title)."""
  return f'{title}: {sentence}' if title else sentence


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One candidate sentence.

  Attributes:
    text: the candidate as the compressor and the reader see it, ``'{title}: {sentence}'``.
    sentence: the bare sentence.
    title: title of the document it came from.
    passage_id: id of that document.
    doc_rank: 0-based rank of that document among the retrieved ones.
    sent_index: 0-based position of the sentence in that document.
  """
  text: str
  sentence: str
  title: str
  passage_id: str
  doc_rank: int
  sent_index: int


def build_candidates(ctxs: Sequence[Passage], *, top_docs: int = 5,
                     max_candidates: int | None = 20, dedup: bool = True,
                     pattern: str | re.Pattern = SENTENCE_SPLIT_REGEX,
                     report: FilterReport | None = None) -> list[Candidate]:
  """Candidate sentences of the top ``top_docs`` passages (see the module docstring).

  Args:
    ctxs: retrieved passages in rank order, best first.
    top_docs: how many of the first passages to split.
    max_candidates: keep at most this many candidates (None: all).
    dedup: drop candidates whose text equals an earlier candidate's.
    pattern: sentence-split regex.
    report: counts kept candidates and the drops (``'duplicate_candidate'``,
      ``'over_candidate_cap'``).
  Returns:
    Candidates in document-rank then reading order.
  """
  out: list[Candidate] = []
  seen: set[str] = set()
  for rank, ctx in enumerate(ctxs[:top_docs]):
    for j, sent in enumerate(split_sentences(ctx.text, pattern)):
      cand = Candidate(format_candidate(ctx.title, sent), sent, ctx.title, ctx.id, rank, j)
      if dedup and cand.text in seen:
        if report is not None:
          report.drop('duplicate_candidate', where=f'{ctx.id}#{j}')
        continue
      if max_candidates is not None and len(out) >= max_candidates:
        if report is not None:
          report.drop('over_candidate_cap', where=f'{ctx.id}#{j}')
        continue
      seen.add(cand.text)
      out.append(cand)
      if report is not None:
        report.keep()
  return out


def candidate_texts(ctxs: Sequence[Passage], **kwargs) -> list[str]:
  """``[c.text for c in build_candidates(ctxs, **kwargs)]``."""
  return [c.text for c in build_candidates(ctxs, **kwargs)]


# ----------------------------------------------------------------------------- chunking


def chunk_words(text: str, words_per_passage: int = 100, *,
                min_tail_words: int = 0) -> list[str]:
  """Splits ``text`` on whitespace into consecutive non-overlapping word windows.

  Words are re-joined with single spaces. A last window shorter than
  ``min_tail_words`` is appended to the previous one (0 keeps it on its own, as DPR).
  """
  if words_per_passage <= 0:
    raise ValueError(f'words_per_passage must be positive, got {words_per_passage}')
  words = text.split()
  chunks = [words[i:i + words_per_passage] for i in range(0, len(words), words_per_passage)]
  if len(chunks) > 1 and len(chunks[-1]) < min_tail_words:
    chunks[-2].extend(chunks.pop())
  return [' '.join(c) for c in chunks]


def build_corpus(articles: Iterable[tuple[str, str]], *, words_per_passage: int = 100,
                 min_tail_words: int = 0, id_prefix: str = 'doc', source: str | None = None,
                 report: FilterReport | None = None) -> list[Passage]:
  """Chunks ``(title, text)`` articles into passages ``'{id_prefix}-{article}-{chunk}'``.

  Articles with no words are dropped and counted as ``'empty_article'``.
  """
  passages = []
  for a, (title, text) in enumerate(articles):
    chunks = chunk_words(text, words_per_passage, min_tail_words=min_tail_words)
    if not chunks:
      if report is not None:
        report.drop('empty_article', where=title)
      continue
    for c, chunk in enumerate(chunks):
      passages.append(Passage(f'{id_prefix}-{a}-{c}', title, chunk, source=source))
    if report is not None:
      report.keep(len(chunks))
  return passages
