"""MedQuAD (K-COMP's medical QA): questions with long-form answers, and their passage corpus.

The files of ``../shared/data/medquad/`` (its README): ``corpus_medquad.jsonl.gz`` holds every
answered MedQuAD QA pair cut into ~100-word passages (``id`` ``QA_ID#k``, ``qa_id``, ``doc_id``,
``title`` = the document's focus entity, ``qtype``, ``source``, ``text``); the question files
(``train``, ``dev``, held-out ``eval/medquad_test``) hold ``id``, ``doc_id``, ``source``,
``url``, ``focus``, ``qtype``, ``question``, ``answer`` and ``own_passage_ids``: the passages cut
from the question's own answer, which retrieval must leave out (the reference would leak into
the evidence; :func:`retrieve_leaving_own_answer_out`).

MedQuAD's ids are not unique on their own: each source numbers its documents from 1 (GHR's
``0000383-1`` and MedlinePlus's ``0000383-1`` are different answers), and a document about several
focus entities (CancerGov's myeloproliferative neoplasms) repeats its QA ids once per entity. A
passage is keyed by its id and title, a question by its id and focus (:attr:`Example.id` is
``'{id}|{focus}'``). ``own_passage_ids`` lists every corpus passage *with the question's id*,
whatever its document, so leaving them all out is leak-free at the price of also leaving out the
same-numbered answers of other sources.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Sequence

from recomp_jax.data.formats import iter_jsonl
from recomp_jax.data.schema import DataError, Example, FilterReport, Location, Passage, require_str, require_str_list
from recomp_jax.retrieval.exclusion import search_excluding


@dataclasses.dataclass(frozen=True)
class MedPassage:
  """One corpus passage with the MedQuAD ids that K-COMP's descriptions need.

  Attributes:
    passage: ``Passage(id, title, text, source=...)``: what retrieval and the readers see.
    qa_id: the QA pair the passage was cut from (``id`` without ``#k``).
    doc_id: the MedQuAD document (one focus entity).
    qtype: the QA pair's question type (``information`` is the "What is (are) X?" answer).
    index: the passage's position within its answer (``k`` of ``QA_ID#k``).
  """
  passage: Passage
  qa_id: str
  doc_id: str
  qtype: str
  index: int


def read_corpus(path: str | os.PathLike) -> list[MedPassage]:
  """Every passage of ``corpus_medquad.jsonl(.gz)``, in file order.

  Raises:
    DataError: a bad row (file, line and field named), or an (id, title) seen twice.
  """
  out, seen = [], set()
  for line, rec in iter_jsonl(path):
    where = Location(path, line)
    if not isinstance(rec, dict):
      raise where.error(None, f'expected a JSON object, got {type(rec).__name__}')
    pid, title = require_str(rec, 'id', where), require_str(rec, 'title', where, allow_empty=True)
    if (pid, title) in seen:
      raise where.error('id', f'duplicate passage {pid!r} of {title!r}')
    seen.add((pid, title))
    qa_id, sep, k = pid.rpartition('#')
    if not sep or not k.isdigit():
      raise where.error('id', f"expected 'QA_ID#k', got {pid!r}")
    if require_str(rec, 'qa_id', where) != qa_id:
      raise where.error('qa_id', f'{rec["qa_id"]!r} does not match the id {pid!r}')
    passage = Passage(id=pid, title=title, text=require_str(rec, 'text', where),
                      source=require_str(rec, 'source', where))
    out.append(MedPassage(passage, qa_id, require_str(rec, 'doc_id', where), require_str(rec, 'qtype', where), int(k)))
  return out


def read_questions(path: str | os.PathLike, *, max_examples: int = 0) -> list[Example]:
  """The questions of a MedQuAD split (file order: a seeded shuffle, so any prefix is a sample).

  Each :class:`Example` (id ``'{id}|{focus}'``) has the long-form ``answer`` as its one reference,
  no retrieved passages, and in ``meta`` ``qa_id``, ``doc_id``, ``focus``, ``qtype``, ``source``
  and ``own_passage_ids``.

  Raises:
    DataError: a bad row (file, line and field named), or an (id, focus) seen twice.
  """
  out, seen = [], set()
  for line, rec in iter_jsonl(path):
    where = Location(path, line)
    if not isinstance(rec, dict):
      raise where.error(None, f'expected a JSON object, got {type(rec).__name__}')
    qa_id, focus = require_str(rec, 'id', where), require_str(rec, 'focus', where, allow_empty=True)
    qid = f'{qa_id}|{focus}'
    if qid in seen:
      raise where.error('id', f'duplicate question {qa_id!r} about {focus!r}')
    seen.add(qid)
    own = require_str_list(rec, 'own_passage_ids', where)
    meta = {'qa_id': qa_id, 'doc_id': require_str(rec, 'doc_id', where), 'focus': focus,
            'qtype': require_str(rec, 'qtype', where), 'source': require_str(rec, 'source', where),
            'own_passage_ids': own}
    out.append(Example(id=qid, question=require_str(rec, 'question', where), answers=[require_str(rec, 'answer', where)],
                       meta=meta))
    if max_examples and len(out) >= max_examples:
      break
  return out


def retrieve_leaving_own_answer_out(search: Callable[[str, int], Sequence[Passage]], examples: Sequence[Example],
                                    k: int, report: FilterReport | None = None, *,
                                    leave_out_verbatim: bool = True,
                                    rerank: Callable[[str, list[Passage]], list[Passage]] | None = None,
                                    depth: int = 0) -> list[Example]:
  """Each example with its ``k`` best passages, none of them cut from its own answer: every passage
  whose id is in ``own_passage_ids`` is left out, as ``../shared/data``'s README defines it.

  Beyond that rule (``leave_out_verbatim``), a passage whose whole text occurs in the reference
  answer is left out too: MedQuAD's answers to sibling questions of one document share paragraphs
  (CancerGov's treatment and clinical-trial answers), so about 1% of the questions would otherwise
  read a verbatim piece of their reference under another QA pair's id.

  Args:
    search: ``(query, depth) -> passages`` best first (``BM25Index.search``).
    examples: from :func:`read_questions` (``meta['own_passage_ids']``).
    k: passages per question.
    report: counts the left-out passages that ranked above the last one kept: by id
      (``'own_id_passage'``) and, of the others, by text (``'verbatim_in_reference'``).
    leave_out_verbatim: also leave out passages whose text occurs in the reference.
    rerank: ``(query, pool) -> pool reordered``: ``search`` fills a pool of ``depth`` passages
      (the left-out ones excluded) and the ``k`` best of its new order are kept (K-COMP §4.1:
      Contriever's passages re-ranked by BM25).
    depth: the pool's size with ``rerank`` (at least ``k``).

  Raises:
    DataError: an example without ``own_passage_ids`` (nothing would say what to leave out).
  """
  out = []
  for e in examples:
    if 'own_passage_ids' not in e.meta:
      raise DataError(None, None, 'own_passage_ids', f'question {e.id!r} has no own_passage_ids')
    own, reference = set(e.meta['own_passage_ids']), e.answers[0]

    def excluded(p: Passage, own=own, reference=reference) -> bool:
      return p.id in own or (leave_out_verbatim and p.text in reference)

    if rerank is None:
      kept, removed = search_excluding(search, e.question, k, excluded)
    else:
      pool, removed = search_excluding(search, e.question, max(depth, k), excluded)
      kept = rerank(e.question, pool)[:k]
    by_id = sum(p.id in own for p in removed)
    if report is not None and by_id:
      report.drop('own_id_passage', e.id, n=by_id)
    if report is not None and len(removed) > by_id:
      report.drop('verbatim_in_reference', e.id, n=len(removed) - by_id)
    out.append(dataclasses.replace(e, ctxs=kept))
  return out


__all__ = ['MedPassage', 'read_corpus', 'read_questions', 'retrieve_leaving_own_answer_out']
