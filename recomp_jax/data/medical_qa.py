"""K-COMP's other medical data (its ``:paper`` preset): MASH-QA and BioASQ questions, the MedCorp corpus.

The paper (kcomp.txt §4.1, §5.1) retrieves from MedCorp (MedRAG's Wikipedia, PubMed, StatPearls
and textbook chunks) and tests on MedQuAD, MASH-QA and BioASQ with their long-form answers; the
gold passages MASH-QA and BioASQ ship are not read. None of them is on PyPI, so these readers take
the files as their authors publish them:

- MASH-QA (Zhu et al. 2020, ``mingzhu0527/MASHQA``): SQuAD v2 JSON
  (``{train,val,test}_webmd_squad_v2_*.json``): ``data[].paragraphs[].{context, qas[]}``, each
  question with several answer spans of its WebMD document. The reference answer is the spans
  in document order, joined by spaces.
- BioASQ (``BioASQ-training*.json``): ``{"questions": [{"id", "body", "type", "ideal_answer"}]}``;
  the reference is the first ideal answer (a string or a list of strings).
- MedCorp (the hub's ``MedRAG/{wikipedia,pubmed,statpearls,textbooks}``, ``chunk/*.jsonl``): one
  snippet per line with ``id``, ``title`` and ``content`` (``contents`` = title + content, unused).

Questions carry ``meta['own_passage_ids'] = []``: their answers were not cut into the corpus, so
retrieval has nothing of theirs to leave out. Questions without an answer are dropped and counted.
"""

from __future__ import annotations

import collections
import os
from typing import Any

from recomp_jax.data.formats import iter_jsonl, read_json
from recomp_jax.data.medquad import MedPassage
from recomp_jax.data.schema import Example, FilterReport, Location, Passage, require_str


def _limit(out: list[Example], max_examples: int) -> list[Example]:
  return out[:max_examples] if max_examples else out


def read_mashqa(path: str | os.PathLike, *, max_examples: int = 0, report: FilterReport | None = None
                ) -> list[Example]:
  """MASH-QA questions (SQuAD v2 JSON) with their multi-span answers as one long-form reference.

  Raises:
    DataError: a malformed entry, named by file and JSON path (``data[i].paragraphs[j].qas[k].field``),
      or a question id seen twice.
  """
  where = Location(path)
  out, seen = [], set()
  for i, article in enumerate(_list(read_json(path), 'data', '', where)):
    for j, paragraph in enumerate(_list(article, 'paragraphs', f'data[{i}].', where)):
      context = require_str(paragraph, 'context', where, prefix=f'data[{i}].paragraphs[{j}].')
      for k, qa in enumerate(_list(paragraph, 'qas', f'data[{i}].paragraphs[{j}].', where)):
        at = f'data[{i}].paragraphs[{j}].qas[{k}].'
        qid, question = require_str(qa, 'id', where, prefix=at), require_str(qa, 'question', where, prefix=at)
        if qid in seen:
          raise where.error(at + 'id', f'duplicate question id {qid!r}')
        seen.add(qid)
        spans = []
        for n, answer in enumerate(qa.get('answers') or []):
          text = require_str(answer, 'text', where, prefix=f'{at}answers[{n}].')
          start = answer.get('answer_start')
          if not isinstance(start, int) or context[start:start + len(text)] != text:
            raise where.error(f'{at}answers[{n}].answer_start', f'{start!r} does not point at the answer text')
          spans.append((start, text.strip()))
        if not spans:
          if report is not None:
            report.drop('no_answer', qid)
          continue
        if report is not None:
          report.keep()
        reference = ' '.join(text for _, text in sorted(spans))
        out.append(Example(id=qid, question=question, answers=[reference],
                           meta={'source': 'mashqa', 'own_passage_ids': [], 'title': str(article.get('title', ''))}))
  return _limit(out, max_examples)


def read_bioasq(path: str | os.PathLike, *, max_examples: int = 0, report: FilterReport | None = None
                ) -> list[Example]:
  """BioASQ questions with their first ideal answer as the long-form reference.

  Raises:
    DataError: a malformed entry (file and ``questions[i].field``), or a question id seen twice.
  """
  where = Location(path)
  out, seen = [], set()
  for i, q in enumerate(_list(read_json(path), 'questions', '', where)):
    at = f'questions[{i}].'
    qid, body = require_str(q, 'id', where, prefix=at), require_str(q, 'body', where, prefix=at)
    if qid in seen:
      raise where.error(at + 'id', f'duplicate question id {qid!r}')
    seen.add(qid)
    ideal = q.get('ideal_answer')
    answers = [ideal] if isinstance(ideal, str) else ideal if isinstance(ideal, list) else []
    if not all(isinstance(a, str) for a in answers):
      raise where.error(at + 'ideal_answer', 'expected a string or a list of strings')
    answers = [a.strip() for a in answers if a.strip()]
    if not answers:
      if report is not None:
        report.drop('no_ideal_answer', qid)
      continue
    if report is not None:
      report.keep()
    out.append(Example(id=qid, question=body, answers=[answers[0]],
                       meta={'source': 'bioasq', 'own_passage_ids': [], 'qtype': str(q.get('type', ''))}))
  return _limit(out, max_examples)


def read_medcorp(path: str | os.PathLike) -> list[MedPassage]:
  """MedCorp snippets (``id``, ``title``, ``content`` per line) as :class:`MedPassage` records.

  A title's snippets keep their file order (``index``), so its first snippet is the one whose first
  sentence describes the title (kcomp.txt §4.2), as MedQuAD's "What is (are) X?" answer is.

  Raises:
    DataError: a bad row (file, line and field named), or an id seen twice.
  """
  out, seen = [], set()
  per_title: collections.Counter = collections.Counter()
  for line, rec in iter_jsonl(path):
    where = Location(path, line)
    if not isinstance(rec, dict):
      raise where.error(None, f'expected a JSON object, got {type(rec).__name__}')
    pid = require_str(rec, 'id', where)
    if pid in seen:
      raise where.error('id', f'duplicate snippet {pid!r}')
    seen.add(pid)
    title = require_str(rec, 'title', where, allow_empty=True)
    passage = Passage(id=pid, title=title, text=require_str(rec, 'content', where), source='medcorp')
    out.append(MedPassage(passage, qa_id=title, doc_id=title, qtype='', index=per_title[title]))
    per_title[title] += 1
  return out


def _list(obj: Any, key: str, prefix: str, where: Location) -> list:
  """``obj[key]`` as a list, else a DataError naming the file and the JSON path."""
  value = obj.get(key) if isinstance(obj, dict) else None
  if not isinstance(value, list):
    raise where.error(prefix + key, f'expected a list, got {type(value).__name__}')
  return value


__all__ = ['read_bioasq', 'read_mashqa', 'read_medcorp']
