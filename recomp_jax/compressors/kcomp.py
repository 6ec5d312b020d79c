"""K-COMP (Knowledge-injected compressor, kcomp.txt §4.2-4.3): the training data and prompts.

A K-COMP example is ``(prompt, knowledge, summary)`` for the shared fine-tuning path's
:func:`recomp_jax.training.objectives.knowledge_injection`:

* ``prompt``: the retrieved passages and the question with each entity span masked as
  ``<ent>`` (``q_m``, §4.3);
* ``knowledge``: ``entity: description<eom>`` per entity, in question order, the description
  being the first sentence of the entity's corpus text (§4.2, after Xu et al. 2023), taken from
  the entity's "What is (are) X?" answer when it has one, and never from the question's own
  answer (:class:`Descriptions`);
* ``summary``: the target compression (the teacher's, Table 6, or a reader-chosen one).

At inference the question is not masked: the model writes entities and descriptions up to the
last ``<eom>``, then the summary; the reader sees both in Table 7's prompt (:func:`reader_prompt`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from recomp_jax.data.entities import ENT, Mention, mask
from recomp_jax.data.medquad import MedPassage
from recomp_jax.data.schema import FilterReport, Passage
from recomp_jax.data.sentences import split_sentences

EOM = '<eom>'  # ends each entity's description (§4.3)
EOM_RELEASED = '<eod>'  # the released code's name for it (kcomp.variant=released)
SPECIAL_TOKENS = (ENT, EOM)

# Table 6: the teacher sees the passages and the entities, never the question.
TEACHER_INSTRUCTION = 'Please extract the content about the entity in fewer than four sentences.'


class Descriptions:
  """The short description of each corpus title: the first sentence of its text.

  A title's passages are tried in order: those of its ``information`` answer ("What is (are)
  X?") first, then the others, each answer from its first passage on; a passage cut from the
  question's own answer (``own_ids``) is skipped, so the next passage of the document is used.

  Args:
    corpus: the corpus passages (:func:`recomp_jax.data.medquad.read_corpus`).
  """

  def __init__(self, corpus: Sequence[MedPassage]):
    by_title: dict[str, list[MedPassage]] = collections.defaultdict(list)
    for m in corpus:
      if m.passage.title.strip():
        by_title[_key(m.passage.title)].append(m)
    self._passages = {t: sorted(ms, key=lambda m: (m.qtype != 'information', m.qa_id, m.index))
                      for t, ms in by_title.items()}

  def describe(self, title: str, own_ids: Sequence[str] = ()) -> str | None:
    """The first sentence of ``title``'s first usable passage; None when it has none."""
    own = set(own_ids)
    for m in self._passages.get(_key(title), ()):
      if m.passage.id in own:
        continue
      sentences = split_sentences(m.passage.text)
      if sentences:
        return sentences[0]
    return None


def _key(title: str) -> str:
  return ' '.join(title.split()).lower()


@dataclasses.dataclass(frozen=True)
class Knowledge:
  """The entities of one question with their descriptions (``[(surface, description)]``)."""
  pairs: tuple[tuple[str, str], ...]

  def text(self, eom: str = EOM) -> str:
    """``entity: description<eom>`` per entity, in question order (the knowledge target)."""
    return ''.join(f'{surface}: {description}{eom}' for surface, description in self.pairs)


def knowledge_for(mentions: Sequence[Mention], descriptions: Descriptions, own_ids: Sequence[str],
                  report: FilterReport | None = None, where: str | None = None
                  ) -> tuple[list[Mention], Knowledge] | None:
  """The described entities of a training question and their knowledge, or None (Table 1's filter).

  An entity with no description outside the question's own answer is left out (unmasked, not in
  the knowledge) and counted (``'entity_without_description'``); a question left with no entity
  is dropped and counted (``'no_entity'``: none found; ``'no_described_entity'``: none described).
  """
  if not mentions:
    if report is not None:
      report.drop('no_entity', where)
    return None
  kept, pairs = [], []
  for m in mentions:
    description = descriptions.describe(m.title, own_ids)
    if description is None:
      if report is not None:
        report.drop('entity_without_description', where)
      continue
    kept.append(m)
    pairs.append((m.surface, description))
  if not kept:
    if report is not None:
      report.drop('no_described_entity', where)
    return None
  return kept, Knowledge(tuple(pairs))


def passages_block(passages: Sequence[Passage]) -> str:
  """The passages as ``title\\ntext`` blocks, best first (the compressor reads them in rank order)."""
  return '\n\n'.join(f'{p.title}\n{p.text}' if p.title else p.text for p in passages)


def compressor_prompt(question: str, passages: Sequence[Passage]) -> str:
  """The compressor's input: the passages, then the question (``q_m`` in training, ``q`` at
  inference); the knowledge and the summary follow it."""
  return f'Passage\n{passages_block(passages)}\n\nQuestion\n{question}\n\nKnowledge\n'


def training_example(question: str, mentions: Sequence[Mention], passages: Sequence[Passage], knowledge: Knowledge,
                     summary: str, *, eom: str = EOM) -> tuple[str, str, str]:
  """``(prompt, knowledge, summary)`` for :func:`~recomp_jax.training.objectives.knowledge_injection`."""
  return compressor_prompt(mask(question, mentions), passages), knowledge.text(eom), summary


def split_output(text: str, eom: str = EOM) -> tuple[str, str]:
  """A generated completion -> ``(knowledge, summary)``: everything up to the last ``eom``, and after it."""
  head, sep, tail = text.rpartition(eom)
  return (head + sep, tail.strip()) if sep else ('', text.strip())


def knowledge_lines(knowledge: str, eom: str = EOM) -> str:
  """``a: x<eom>b: y<eom>`` -> ``'a: x\\nb: y'`` (the reader's "Prior Knowledge" block)."""
  return '\n'.join(part.strip() for part in knowledge.split(eom) if part.strip())


def teacher_prompt(passages: Sequence[Passage], entities: Sequence[str]) -> str:
  """Table 6: the instruction, the passages and the entities (the question is left out)."""
  return (f'Instruction\n{TEACHER_INSTRUCTION}\n\nPassage\n{passages_block(passages)}\n\n'
          f'Entity\n{", ".join(entities)}\n')


def reader_prompt(question: str, summary: str, knowledge: str = '', eom: str = EOM) -> str:
  """Table 7 (K-COMP): the summary as the passage, the prior knowledge, the question; with
  ``knowledge`` '' the -Prior ablation (summary only)."""
  prior = knowledge_lines(knowledge, eom)
  block = f'Passage\n{summary}\n\n' + (f'Prior Knowledge\n{prior}\n\n' if prior else '')
  return f'{block}Questions\n{question}\n\nAnswer\n'


__all__ = ['Descriptions', 'EOM', 'EOM_RELEASED', 'Knowledge', 'SPECIAL_TOKENS', 'TEACHER_INSTRUCTION',
           'compressor_prompt', 'knowledge_for', 'knowledge_lines', 'passages_block', 'reader_prompt',
           'split_output', 'teacher_prompt', 'training_example']
