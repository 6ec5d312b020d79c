"""Corpora for long-context-LM retrieval (CoLoR, color.txt §3.1 and App. A; LOFT's setup).

A *group* is a set of queries that share one corpus: the gold passages of its queries and of
the few-shot examples, plus distractors (each query's BM25 neighbours first, then random
passages) up to a token budget. The gold passages of the group's queries sit at evenly spaced
positions, so R@1 can be reported by position bucket (Fig. 4). Every row of an experiment,
raw or compressed, reads the same groups: only the passages' content changes.

Passage IDs in a prompt are positions ``0..N-1`` of the group's corpus, so an ID never leaks
anything about the passage.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from recomp_jax.data.schema import Example, FilterReport, Passage


@dataclasses.dataclass(frozen=True)
class Query:
  """One retrieval query.

  Attributes:
    id: the example id.
    text: the query (the question).
    gold: its gold passages (NQ: one; HotpotQA: the two supporting paragraphs).
    neighbours: distractor candidates in preference order (BM25 neighbours, gold removed).
  """
  id: str
  text: str
  gold: tuple[Passage, ...]
  neighbours: tuple[Passage, ...]


@dataclasses.dataclass(frozen=True)
class Group:
  """Queries sharing one corpus.

  Attributes:
    id: ``'{split}-{k}'``.
    corpus: the passages in prompt order (ID = position).
    queries: the group's query ids.
    gold: per query, the corpus positions of its gold passages.
    shots: the few-shot example ids (their gold passages are in the corpus too).
    shot_gold: per shot, the corpus positions of its gold passages.
  """
  id: str
  corpus: tuple[Passage, ...]
  queries: tuple[str, ...]
  gold: tuple[tuple[int, ...], ...]
  shots: tuple[str, ...]
  shot_gold: tuple[tuple[int, ...], ...]

  def to_dict(self) -> dict:
    return {'id': self.id, 'corpus': [p.to_dict() for p in self.corpus], 'queries': list(self.queries),
            'gold': [list(g) for g in self.gold], 'shots': list(self.shots),
            'shot_gold': [list(g) for g in self.shot_gold]}

  @classmethod
  def from_dict(cls, d: dict) -> 'Group':
    corpus = tuple(Passage(p['id'], p.get('title', ''), p['text'], p.get('score'), p.get('has_answer'),
                           p.get('is_gold'), p.get('source')) for p in d['corpus'])
    ids = [p.id for p in corpus]
    if len(set(ids)) != len(ids):
      raise ValueError(f"group {d['id']}: duplicate passage ids in its corpus")
    return cls(d['id'], corpus, tuple(d['queries']), tuple(tuple(g) for g in d['gold']), tuple(d['shots']),
               tuple(tuple(g) for g in d['shot_gold']))


def queries_from_examples(examples: Sequence[Example], report: FilterReport) -> list[Query]:
  """Gold passages and distractor candidates of each example.

  Gold: the ``is_gold`` retrieved passages (HotpotQA's supporting paragraphs, NQ's flagged
  passage) or else ``gold_ctx``. An example without any gold passage is dropped (counted).
  Distractors: the other retrieved passages in rank order, without any copy of a gold text.
  """
  out = []
  for e in examples:
    gold = [c for c in e.ctxs if c.is_gold]
    if not gold and e.gold_ctx is not None:
      gold = [e.gold_ctx]
    if not gold:
      report.drop('no_gold_passage', e.id)
      continue
    texts = {g.text.strip() for g in gold}
    neighbours = tuple(c for c in e.ctxs if not c.is_gold and c.text.strip() not in texts)
    out.append(Query(e.id, e.question, tuple(gold), neighbours))
    report.keep()
  return out


def _key(p: Passage) -> tuple[str, str]:
  return (p.title.strip(), p.text.strip())


def build_groups(queries: Sequence[Query], shots: Sequence[Query], pool: Sequence[Passage], *, split: str,
                 queries_per_group: int, budget_tokens: int, count_tokens: Callable[[Passage], int],
                 seed: int, gold_at: str = 'spread') -> list[Group]:
  """Cuts ``queries`` (in order) into groups of ``queries_per_group`` and builds each corpus.

  Each corpus holds, in this order of priority: the group's gold passages, the shots' gold
  passages, then round-robin over the queries their BM25 neighbours, then random ``pool``
  passages, while the corpus stays within ``budget_tokens`` (``count_tokens`` per entry, the
  prompt's formatting included). Passages are distinct by (title, text). The distractors are
  shuffled (seeded) and the group's gold passages placed at evenly spaced positions
  (``gold_at='spread'``) or, in seeded order, as the corpus's last entries (``gold_at='end'``:
  a label corpus whose substituted passage is last re-encodes only that entry and what follows).

  Raises:
    ValueError: when the gold passages alone exceed the budget (a clear message with both sizes).
  """
  if gold_at not in ('spread', 'end'):
    raise ValueError(f"gold_at must be 'spread' or 'end', got {gold_at!r}")
  rng = np.random.default_rng(seed)
  groups = []
  for k in range(0, len(queries), queries_per_group):
    members = list(queries[k:k + queries_per_group])
    seen: set[tuple[str, str]] = set()
    gold_passages: list[Passage] = []
    for q in members:
      for g in q.gold:
        if _key(g) not in seen:
          seen.add(_key(g))
          gold_passages.append(g)
    used = sum(count_tokens(p) for p in gold_passages)
    fixed: list[Passage] = []
    for s in shots:
      for g in s.gold:
        if _key(g) not in seen:
          seen.add(_key(g))
          fixed.append(g)
          used += count_tokens(g)
    if used > budget_tokens:
      raise ValueError(f'group {split}-{len(groups)}: its gold and few-shot passages take {used} tokens, over the '
                       f'corpus budget of {budget_tokens} (lower queries_per_group or raise the budget)')
    distractors: list[Passage] = []

    def add(p: Passage) -> bool:
      nonlocal used
      n = count_tokens(p)
      if _key(p) in seen or used + n > budget_tokens:
        return False
      seen.add(_key(p))
      distractors.append(p)
      used += n
      return True

    depth = max((len(q.neighbours) for q in members), default=0)
    for d in range(depth):
      for q in members:
        if d < len(q.neighbours):
          add(q.neighbours[d])
    for i in rng.permutation(len(pool)):
      if used >= budget_tokens:
        break
      add(pool[int(i)])
    others = fixed + distractors
    order = rng.permutation(len(others))
    others = [others[int(i)] for i in order]
    n = len(others) + len(gold_passages)
    if gold_at == 'end':
      gold_slots = list(range(n - len(gold_passages), n))
    else:
      gold_slots = [int((j + 0.5) * n / len(gold_passages)) for j in range(len(gold_passages))]
    placed = rng.permutation(len(gold_passages))
    corpus: list[Passage | None] = [None] * n
    for slot, j in zip(gold_slots, placed):
      corpus[slot] = gold_passages[int(j)]
    rest = iter(others)
    corpus = [p if p is not None else next(rest) for p in corpus]
    renamed = [dataclasses.replace(p, id=p.id or f'{split}-{len(groups)}-{i}') for i, p in enumerate(corpus)]
    position = {_key(p): i for i, p in enumerate(renamed)}
    gold = tuple(tuple(position[_key(g)] for g in q.gold) for q in members)
    ids = [p.id for p in renamed]
    if len(set(ids)) != len(ids):
      raise ValueError(f'group {split}-{len(groups)}: two different passages share an id')
    shot_gold = tuple(tuple(position[_key(g)] for g in s.gold) for s in shots)
    groups.append(Group(f'{split}-{len(groups)}', tuple(renamed), tuple(q.id for q in members), gold,
                        tuple(s.id for s in shots), shot_gold))
  return groups


def position_bucket(position: int, corpus_size: int, buckets: int = 5) -> int:
  """Which of ``buckets`` equal slices of the corpus ``position`` falls in (0 = the beginning)."""
  return min(int(buckets * position / max(corpus_size, 1)), buckets - 1)


__all__ = ['Group', 'Query', 'build_groups', 'position_bucket', 'queries_from_examples']
