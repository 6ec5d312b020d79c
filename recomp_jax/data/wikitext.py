"""WikiText for the RECOMP language-modelling task: articles, and windows scored every 32 tokens.

RECOMP §4.1 evaluates perplexity on WikiText-103 the way In-Context RALM does (Ram et al.,
2023): the text of an article is read left to right, and every ``stride`` (32) tokens the
last ``query_tokens`` (32) tokens form a retrieval query; the retrieved (or compressed)
evidence is prepended to the prefix, and the next ``stride`` tokens are scored.

:func:`read_articles` reads the raw release (``wiki.test.raw``, or ``../shared/data``'s
``wikitext2_test.raw`` with its blank lines removed): an article starts at a level-1 heading
``" = Title = "``; section headings (``" = = Section = = "``) stay in its text, as in the
release. :func:`make_windows` cuts articles into :class:`LMWindow` records under the reader's
tokenizer, so the scored tokens are exactly the reader's own.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Iterable, Sequence

import numpy as np

from recomp_jax.data.schema import DataError, FilterReport

_TITLE = re.compile(r'^ ?= (?!=)(.*?[^=]) = ?$')


@dataclasses.dataclass(frozen=True)
class Article:
  """One WikiText article: its title, its text (heading line excluded) and its heading's line."""
  title: str
  text: str
  line: int


@dataclasses.dataclass(frozen=True)
class LMWindow:
  """``stride`` tokens of an article to score, with what precedes them.

  Attributes:
    id: ``'{article index}:{first scored token}'``.
    title: the article's title (retrieval leaves out this article's own passages).
    prefix_ids: ``[P]`` reader token ids before the scored tokens (no BOS), at most
      ``max_prefix_tokens`` of them, ending right before ``target_ids``.
    target_ids: ``[S]`` the scored token ids (``S <= stride``).
    query: the text of the last ``query_tokens`` prefix tokens (the retrieval query).
  """
  id: str
  title: str
  prefix_ids: list[int]
  target_ids: list[int]
  query: str

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


def read_articles(path: str | os.PathLike) -> list[Article]:
  """The articles of a raw WikiText file, in file order (see :func:`parse_articles`)."""
  with open(path, encoding='utf-8') as f:
    return parse_articles(f, path)


def read_hf_articles(name: str = 'wikitext', config: str = 'wikitext-103-raw-v1',
                     split: str = 'test') -> list[Article]:
  """The articles of a Hugging Face ``datasets`` WikiText split (one row per raw line; the
  ``[hf]`` extra's ``datasets``, imported here only)."""
  import datasets  # pylint: disable=import-outside-toplevel
  rows = datasets.load_dataset(name, config, split=split)
  return parse_articles((row['text'] for row in rows), f'hf:{name}/{config}:{split}')


def parse_articles(lines: Iterable[str], path: str | os.PathLike) -> list[Article]:
  """Articles from raw WikiText lines: each starts at a ``" = Title = "`` line; blank lines are
  skipped; ``path`` names the source in errors.

  Raises:
    DataError: text before the first title, a title with no text, or a repeated title
      (``path:line``).
  """
  articles: list[Article] = []
  title, start, body = None, 0, []
  seen: dict[str, int] = {}

  def close(end_line: int) -> None:
    if not body:
      raise DataError(path, start, 'text', f'article {title!r} has no text before line {end_line}')
    articles.append(Article(title, '\n'.join(body), start))

  number = 0
  for number, raw in enumerate(lines, 1):
    line = raw.rstrip('\n')
    match = _TITLE.match(line)
    if match:
      if title is not None:
        close(number)
      title, start, body = match.group(1).strip(), number, []
      if title in seen:
        raise DataError(path, number, 'title', f'{title!r} already started an article at line {seen[title]}')
      seen[title] = number
    elif line.strip():
      if title is None:
        raise DataError(path, number, 'title', 'text before the first " = Title = " heading')
      body.append(line.strip())
  if title is None:
    raise DataError(path, None, 'title', 'no " = Title = " heading: not a raw WikiText file')
  close(number + 1)
  return articles


def make_windows(articles: Sequence[Article], tokenizer, *, stride: int = 32, query_tokens: int = 32,
                 max_prefix_tokens: int = 512, max_windows: int = 0, seed: int = 0,
                 report: FilterReport | None = None) -> list[LMWindow]:
  """Cuts each article into windows of ``stride`` scored tokens (In-Context RALM's retrieval stride).

  The first window of an article starts after its first ``query_tokens`` tokens (a query
  needs them); the last may be shorter than ``stride``. With ``max_windows > 0``, that many
  windows are drawn uniformly at random (``seed``) from all of them and returned in article
  order; the others are counted in ``report`` (reason ``'not_sampled'``), as are articles
  too short to hold one window (``'article_too_short'``).

  Args:
    articles: from :func:`read_articles`.
    tokenizer: the reader's (a Hugging Face tokenizer); articles are encoded without special
      tokens, ``text`` with a leading space as it follows the title in the stream.
  """
  if stride < 1 or query_tokens < 1 or max_prefix_tokens < query_tokens:
    raise ValueError(f'need stride >= 1, query_tokens >= 1 and max_prefix_tokens >= query_tokens; '
                     f'got {stride}, {query_tokens}, {max_prefix_tokens}')
  windows = []
  for index, article in enumerate(articles):
    ids = list(tokenizer(' ' + article.text, add_special_tokens=False)['input_ids'])
    if len(ids) <= query_tokens:
      if report is not None:
        report.drop('article_too_short', article.title)
      continue
    for start in range(query_tokens, len(ids), stride):
      windows.append((index, article.title, ids, start))
  if max_windows and len(windows) > max_windows:
    keep = np.sort(np.random.default_rng(seed).choice(len(windows), max_windows, replace=False))
    if report is not None:
      kept = set(keep.tolist())
      for i, (_, title, _, start) in enumerate(windows):
        if i not in kept:
          report.drop('not_sampled', f'{title}:{start}')
    windows = [windows[i] for i in keep]
  out = []
  for index, title, ids, start in windows:
    prefix = ids[max(0, start - max_prefix_tokens):start]
    out.append(LMWindow(id=f'{index}:{start}', title=title, prefix_ids=prefix,
                        target_ids=ids[start:start + stride],
                        query=tokenizer.decode(ids[start - query_tokens:start]).strip()))
  return out


def title_key(title: str) -> str:
  """A title reduced to its lower-cased letters and digits, so WikiText's ``"Ise @-@ class
  battleship"`` and Wikipedia's ``"Ise-class battleship"`` compare equal."""
  return ''.join(ch for ch in title.lower() if ch.isalnum())


def write_windows(path: str, windows: Sequence[LMWindow]) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    for w in windows:
      f.write(json.dumps(w.to_dict(), ensure_ascii=False) + '\n')


def read_windows(path: str) -> list[LMWindow]:
  """Windows written by :func:`write_windows` (``DataError`` names the line of a bad one)."""
  out = []
  with open(path, encoding='utf-8') as f:
    for number, line in enumerate(f, 1):
      try:
        out.append(LMWindow(**json.loads(line)))
      except (TypeError, ValueError) as e:
        raise DataError(path, number, None, f'not an LM window: {e}') from e
  return out


__all__ = ['Article', 'LMWindow', 'make_windows', 'parse_articles', 'read_articles', 'read_hf_articles',
           'read_windows', 'title_key', 'write_windows']
