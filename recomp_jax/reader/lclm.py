"""Long-context-LM retrieval: the corpus in the reader's context (LOFT's corpus-in-context
prompting, color.txt App. A, Table 15).

The prompt is the instruction, the corpus as ``ID: i | TITLE: t | CONTENT: c | END ID: i``
entries, few-shot examples whose gold passages are in the corpus, then the query; the model
names the relevant passages as ``ID: i | TITLE: t`` lines. Two decision rules:

* ``greedy`` (the paper's): greedy generation, the IDs parsed from the lines in order; an ID
  that names no passage is a miss, counted.
* ``rank``: every passage ranked by the log-likelihood of its ``ID: i |`` line after the query,
  a full ranking, so R@k and F1@k are exact.

Everything up to the query is one token prefix per corpus, encoded once and shared by every
query that reads it (:meth:`recomp_jax.reader.scoring.CausalScorer.score_ids_after_queries`
and the generator's shared-prefix path); each query then costs its own tokens plus one short
line per passage.
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np

INSTRUCTION = (
    'You will be given a list of documents. You need to read carefully and understand all of them. Then you will '
    'be given a query, and your goal is to find all documents from the list that can help answer the query. '
    'Print out the ID and TITLE of each document.')
QUERY_HEAD = ('Which document is most relevant to answer the query? Print out the ID and TITLE of the document. '
              'If there is no perfect answer output the closest one. Do not give an empty final answer.')
ANSWER_HEAD = 'The following documents can help answer the query:'
_ID_LINE = re.compile(r'ID:\s*(\d+)')


def format_entry(position: int, title: str, content: str | None) -> str:
  """One corpus entry; ``content`` None (the titles-only row) leaves out the CONTENT field."""
  if content is None:
    return f'ID: {position} | TITLE: {title} | END ID: {position}'
  return f'ID: {position} | TITLE: {title} | CONTENT: {content} | END ID: {position}'


def answer_lines(positions: Sequence[int], titles: Sequence[str]) -> str:
  return ''.join(f'ID: {p} | TITLE: {titles[p]}\n' for p in positions)


def query_text(query: str) -> str:
  """The per-query part of the prompt (after the shared prefix)."""
  return f'query: {query}\n{ANSWER_HEAD}\n'


def prompt_pieces(titles: Sequence[str], contents: Sequence[str | None],
                  shots: Sequence[tuple[str, Sequence[int]]]) -> tuple[str, list[str], str]:
  """Everything before the query, as ``(head, entries, tail)``: the instruction, one piece per
  corpus entry (``contents[i]`` None: titles only), and the few-shot examples.

  The prompt's tokens are the concatenation of each piece's tokens (:class:`CorpusRetriever`),
  so swapping one entry's content changes that entry's tokens and nothing else.

  Args:
    titles, contents: per corpus position.
    shots: ``(query, gold positions)`` of each few-shot example.
  """
  head = f'{INSTRUCTION}\n\n'
  entries = [format_entry(i, t, c) + '\n' for i, (t, c) in enumerate(zip(titles, contents))]
  examples = ''.join(f'===== Example {k + 1} =====\n{QUERY_HEAD}\n{query_text(q)}{answer_lines(g, titles)}\n'
                     for k, (q, g) in enumerate(shots))
  tail = f"\n{examples}===== Now let's start! =====\n{QUERY_HEAD}\n"
  return head, entries, tail


def prefix_text(titles: Sequence[str], contents: Sequence[str | None],
                shots: Sequence[tuple[str, Sequence[int]]]) -> str:
  """:func:`prompt_pieces` joined: the text of everything before the query."""
  head, entries, tail = prompt_pieces(titles, contents, shots)
  return head + ''.join(entries) + tail


def id_target(position: int) -> str:
  """The ranked continuation: the ID and the separator that ends it (so ``1`` is not ``12``)."""
  return f'ID: {position} |'


def parse_ids(text: str, corpus_size: int) -> tuple[list[int], int]:
  """The distinct IDs a generation names, in order, and how many named no passage."""
  out, invalid = [], 0
  for m in _ID_LINE.finditer(text):
    i = int(m.group(1))
    if not 0 <= i < corpus_size:
      invalid += 1
    elif i not in out:
      out.append(i)
  return out, invalid


def recall_at_1(predicted: Sequence[int], gold: Sequence[int]) -> float:
  return float(bool(predicted) and predicted[0] in set(gold))


def f1_at_k(predicted: Sequence[int], gold: Sequence[int], k: int) -> float:
  """F1 of the first ``k`` predictions: precision over ``k``, recall over the gold passages."""
  hits = len(set(predicted[:k]) & set(gold))
  if not hits:
    return 0.0
  precision, recall = hits / k, hits / len(set(gold))
  return 2 * precision * recall / (precision + recall)


class CorpusRetriever:
  """A decoder-only reader retrieving from a corpus in its context.

  Args:
    reader: a :class:`recomp_jax.reader.Reader` over a decoder-only model.
    max_context: the reader's context in tokens; a corpus prompt over it is an error.
    answer_tokens: greedy tokens generated per query (room for the lines of every gold ID).

  A corpus is given as ``titles``, ``contents`` (None: titles only) and ``shots`` (see
  :func:`prompt_pieces`); its prompt's tokens are BOS and each piece's tokens in order.
  """

  def __init__(self, reader, *, max_context: int, answer_tokens: int = 24):
    if reader.is_seq2seq:
      raise ValueError('long-context retrieval needs a decoder-only reader (a Gemma model)')
    self.reader, self.tokenizer = reader, reader.tokenizer
    self.max_context, self.answer_tokens = int(max_context), int(answer_tokens)
    self.bos = list(self.tokenizer('')['input_ids'])  # the special tokens a prompt starts with
    self._pieces: dict[str, list[int]] = {}

  def piece(self, text: str) -> list[int]:
    """The tokens of one prompt piece (cached: a corpus's entries recur across rows and labels)."""
    if text not in self._pieces:
      self._pieces[text] = list(self.tokenizer(text, add_special_tokens=False)['input_ids'])
    return self._pieces[text]

  def prefix_ids(self, titles, contents, shots) -> list[int]:
    head, entries, tail = prompt_pieces(titles, contents, shots)
    ids = self.bos + self.piece(head)
    for entry in entries:
      ids += self.piece(entry)
    return ids + self.piece(tail)

  def query_ids(self, queries: Sequence[str]) -> list[list[int]]:
    return [self.piece(query_text(q)) for q in queries]

  def _check(self, prefix: int, longest_query: int, where: str) -> None:
    total = prefix + longest_query + self.answer_tokens
    if total > self.max_context:
      raise ValueError(f'{where}: the corpus prompt takes {prefix} tokens and the longest query with its answer '
                       f'{total - prefix} more: {total} tokens, over the reader context of {self.max_context} '
                       '(lower the corpus budget or raise color.max_context)')

  def _id_targets(self, corpus_size: int) -> list[list[int]]:
    return [self.piece(id_target(i)) for i in range(corpus_size)]

  def rank(self, titles, contents, shots, queries: Sequence[str], *, where: str = 'corpus') -> np.ndarray:
    """``[Q, N]`` log-likelihood of each passage's ``ID: i |`` line after each query."""
    prefix, query_ids = self.prefix_ids(titles, contents, shots), self.query_ids(queries)
    self._check(len(prefix), max((len(q) for q in query_ids), default=0), where)
    n = len(titles)
    owners = [q for q in range(len(queries)) for _ in range(n)]
    scores = self.reader.scorer.score_ids_after_queries(prefix, query_ids, owners,
                                                        self._id_targets(n) * len(queries))
    return scores.total.reshape(len(queries), n)

  def rank_with_substitutes(self, titles, contents, shots, position: int, substitutes: Sequence[str | None],
                            query: str, *, where: str = 'corpus') -> np.ndarray:
    """``[K, N]``: :meth:`rank` of one query with entry ``position``'s content replaced by each of
    ``K`` substitutes (a compression candidate). Only that entry and what follows it are encoded
    per substitute; the entries before it are encoded once."""
    head, entries, tail = prompt_pieces(titles, contents, shots)
    prefix = self.bos + self.piece(head)
    for entry in entries[:position]:
      prefix += self.piece(entry)
    rest = []
    for entry in entries[position + 1:]:
      rest += self.piece(entry)
    rest += self.piece(tail) + self.piece(query_text(query))
    extensions = [self.piece(format_entry(position, titles[position], s) + '\n') + rest for s in substitutes]
    self._check(len(prefix), max(len(e) for e in extensions), where)
    n = len(titles)
    owners = [k for k in range(len(substitutes)) for _ in range(n)]
    scores = self.reader.scorer.score_ids_after_queries(prefix, extensions, owners,
                                                        self._id_targets(n) * len(substitutes))
    return scores.total.reshape(len(substitutes), n)

  def greedy(self, titles, contents, shots, queries: Sequence[str], *, where: str = 'corpus'
             ) -> tuple[list[list[int]], list[int], list[str]]:
    """Greedy answers: per query the IDs named (in order), the count of invalid IDs, the text."""
    prefix, query_ids = self.prefix_ids(titles, contents, shots), self.query_ids(queries)
    self._check(len(prefix), max((len(q) for q in query_ids), default=0), where)
    texts = self.reader.generator.generate_with_prefix(prefix, query_ids, max_new_tokens=self.answer_tokens,
                                                        stop_strings=('\n\n', '====='))
    parsed = [parse_ids(t, len(titles)) for t in texts]
    return [p for p, _ in parsed], [n for _, n in parsed], list(texts)

  def prompt_tokens(self, titles, contents, shots, queries: Sequence[str]) -> list[int]:
    """Prompt tokens each query's retrieval reads (the corpus prefix and the query)."""
    prefix = len(self.prefix_ids(titles, contents, shots))
    return [prefix + len(q) for q in self.query_ids(queries)]


__all__ = ['ANSWER_HEAD', 'CorpusRetriever', 'INSTRUCTION', 'QUERY_HEAD', 'answer_lines', 'f1_at_k', 'format_entry',
           'id_target', 'parse_ids', 'prefix_text', 'prompt_pieces', 'query_text', 'recall_at_1']
