"""Entities of a question, found with a gazetteer of corpus titles (K-COMP §4.2's keep rule).

K-COMP finds the biomedical entities of each question with ScispaCy and keeps those that match
a corpus title. ScispaCy's models do not install offline, so the default finder is the keep rule
itself: a gazetteer of the corpus titles, matched longest first, on word boundaries. A title's
name matches case-insensitively; an abbreviation (an all-capital title such as ``COPD``, or the
parenthesised capitals of ``Benign rolandic epilepsy (BRE)``) only in capitals, so ``ALL`` (the
leukemia) never matches the word "all". A title with a parenthesised part also matches without
it (``Enlarged Prostate (BPH)`` -> ``Enlarged Prostate``). :class:`SpacyEntities` is the paper's
finder for users who have a spaCy / ScispaCy model, imported lazily.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

ENT = '<ent>'  # K-COMP's mask of an entity span in the question (§4.3)

_PARENS = re.compile(r'\s*\(([^()]*)\)')
_ABBREVIATION = re.compile(r'[A-Z][A-Z0-9-]{1,9}')


@dataclasses.dataclass(frozen=True)
class Mention:
  """One entity span of a question: ``question[start:end]`` is ``surface``, naming corpus ``title``."""
  start: int
  end: int
  surface: str
  title: str


def title_forms(title: str) -> list[tuple[str, bool]]:
  """``(form, case_sensitive)`` under which a corpus title is recognised (empty for an empty title)."""
  title = ' '.join(title.split())
  if not title:
    return []
  forms = [(title, bool(_ABBREVIATION.fullmatch(title)))]
  bare = ' '.join(_PARENS.sub('', title).split())
  if bare and bare != title:
    forms.append((bare, bool(_ABBREVIATION.fullmatch(bare))))
  for inner in _PARENS.findall(title):
    if _ABBREVIATION.fullmatch(inner.strip()):
      forms.append((inner.strip(), True))
  return forms


class Gazetteer:
  """Finds corpus titles in questions: leftmost match first, the longest form at a position.

  Args:
    titles: the corpus titles (duplicates and empty titles are fine).
  """

  def __init__(self, titles: Iterable[str]):
    self._title_of: dict[tuple[str, bool], str] = {}
    for title in titles:
      for form, sensitive in title_forms(title):
        key = (form if sensitive else form.lower(), sensitive)
        self._title_of.setdefault(key, ' '.join(title.split()))
    def pattern(sensitive: bool):
      forms = sorted((f for f, s in self._title_of if s == sensitive), key=len, reverse=True)
      if not forms:
        return None
      body = '|'.join(re.escape(f) for f in forms)
      return re.compile(rf'(?<!\w)(?:{body})(?!\w)', 0 if sensitive else re.IGNORECASE)
    self._patterns = [(p, s) for p, s in ((pattern(False), False), (pattern(True), True)) if p is not None]

  def __len__(self) -> int:
    return len(self._title_of)

  def find(self, question: str) -> list[Mention]:
    """The non-overlapping mentions of ``question``, in order (``[]``: no entity)."""
    candidates = []
    for pattern, sensitive in self._patterns:
      pos = 0
      while True:  # every start position, not only non-overlapping ones of this pattern
        m = pattern.search(question, pos)
        if m is None:
          break
        key = (m.group(0) if sensitive else m.group(0).lower(), sensitive)
        candidates.append(Mention(m.start(), m.end(), m.group(0), self._title_of[key]))
        pos = m.start() + 1
    out, end = [], -1
    for c in sorted(candidates, key=lambda c: (c.start, -(c.end - c.start))):
      if c.start >= end:
        out.append(c)
        end = c.end
    return out


class SpacyEntities:
  """The paper's finder: a spaCy / ScispaCy model's entities, kept when they name a corpus title.

  Args:
    model: a spaCy model name or path (e.g. ``en_core_sci_sm``); needs ``spacy`` and the model.
    gazetteer: the corpus titles the kept entities must match (the same keep rule).
  """

  def __init__(self, model: str, gazetteer: Gazetteer):
    import spacy  # pylint: disable=import-outside-toplevel  (optional: only this finder needs it)
    self._nlp = spacy.load(model)
    self._gazetteer = gazetteer

  def find(self, question: str) -> list[Mention]:
    out = []
    for ent in self._nlp(question).ents:
      match = self._gazetteer.find(ent.text)
      if len(match) == 1 and match[0].surface == ent.text:
        out.append(Mention(ent.start_char, ent.end_char, ent.text, match[0].title))
    return out


def mask(question: str, mentions: Sequence[Mention], token: str = ENT) -> str:
  """``question`` with every mention replaced by ``token`` (K-COMP's ``q_m``)."""
  out, last = [], 0
  for m in mentions:
    out += [question[last:m.start], token]
    last = m.end
  return ''.join(out + [question[last:]])


__all__ = ['ENT', 'Gazetteer', 'Mention', 'SpacyEntities', 'mask', 'title_forms']
