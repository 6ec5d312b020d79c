"""Retrieval that leaves out the passages a query must not see, counted.

Two tasks need it: the LM task drops passages of the window's own article (they would hand the
model its own continuation, as RECOMP §4.1 removes them), and MedQuAD (K-COMP) drops the
question's own answer (``own_passage_ids``: the reference would leak into the evidence). In both
the best ``k`` *other* passages are wanted, so the search is widened until ``k`` survive.
"""

from __future__ import annotations

from typing import Callable, Sequence

from recomp_jax.data.schema import Passage


def search_excluding(search: Callable[[str, int], Sequence[Passage]], query: str, k: int,
                     excluded: Callable[[Passage], bool]) -> tuple[list[Passage], list[Passage]]:
  """The ``k`` best passages for ``query`` that ``excluded`` does not reject.

  Args:
    search: ``(query, depth) -> passages`` best first (e.g. ``BM25Index.search``).
    query: the query text.
    k: passages wanted.
    excluded: true for a passage the query must not see.

  Returns:
    ``(passages, removed)``: at most ``k`` passages best first (fewer only when the corpus runs
    out), and the excluded passages that ranked above the last one kept (what was left out).
  """
  depth = 4 * k
  while True:
    hits = list(search(query, depth))
    kept = [p for p in hits if not excluded(p)]
    if len(kept) >= k or len(hits) < depth:
      break
    depth *= 4
  cut = hits.index(kept[k - 1]) + 1 if len(kept) >= k else len(hits)
  return kept[:k], [p for p in hits[:cut] if excluded(p)]


__all__ = ['search_excluding']
