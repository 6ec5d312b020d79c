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

import numpy as np

from recomp_jax.data.entities import ENT, Mention, mask
from recomp_jax.data.medquad import MedPassage
from recomp_jax.data.schema import FilterReport, Passage
from recomp_jax.data.sentences import split_sentences
from recomp_jax.models import generation
from recomp_jax.pretrained import load_pretrained
from recomp_jax.training.finetune import fit_prompt

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


def prompt_text(block: str, question: str, head: str = 'Knowledge') -> str:
  """``Passage / Question / {head}`` around a passages block (:func:`passages_block`)."""
  return f'Passage\n{block}\n\nQuestion\n{question}\n\n{head}\n'


def compressor_prompt(question: str, passages: Sequence[Passage]) -> str:
  """The compressor's input: the passages, then the question (``q_m`` in training, ``q`` at
  inference); the knowledge and the summary follow it."""
  return prompt_text(passages_block(passages), question)


def fitted_prompt(tokenizer, question: str, passages: Sequence[Passage], budget: int,
                  head: str = 'Knowledge') -> tuple[str, bool]:
  """:func:`prompt_text` in at most ``budget`` tokens: the passages lose their end when too long
  (the question, after them, is kept). Returns ``(prompt, cut)``; training and inference cut alike."""
  return fit_prompt(tokenizer, lambda block: prompt_text(block, question, head), passages_block(passages), budget)


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



def ft_prompt(question: str, passages: Sequence[Passage]) -> str:
  """The FT baseline's input (the paper's key baseline: the same compressor fine-tuned on the
  summaries alone): the passages and the unmasked question, then the summary."""
  return prompt_text(passages_block(passages), question, 'Summary')


# ----------------------------------------------------------------------------- summary targets


def passage_sentences(passages: Sequence[Passage], limit: int = 0) -> list[str]:
  """The sentences of ``passages`` in reading order, each once, the first ``limit`` (0 = all)."""
  out = []
  for p in passages:
    for sentence in split_sentences(p.text):
      if sentence not in out:
        out.append(sentence)
  return out[:limit] if limit else out


def answer_head(tokenizer, answer: str, tokens: int) -> str:
  """The first ``tokens`` tokens of a long-form reference (what the sentence labels score)."""
  ids = tokenizer(answer, add_special_tokens=False)['input_ids']
  return answer if len(ids) <= tokens else tokenizer.decode(ids[:tokens])


def reader_sentence_summaries(reader, questions: Sequence[str], answers: Sequence[str],
                              passages: Sequence[Sequence[Passage]], *, sentences: int,
                              answer_tokens: int, max_candidates: int = 0) -> list[dict]:
  """Beyond the paper, a summary target for when no teacher can summarise: per question the
  ``sentences`` sentences of its passages under which the reader gives the reference answer
  (its first ``answer_tokens`` tokens) the highest log-likelihood, in reading order.

  Each sentence is read alone in Table 7's prompt (:func:`reader_prompt`, no prior knowledge).
  Only the first ``max_candidates`` sentences compete (0 = all; RECOMP's A.1 caps its labelled
  candidates at 20): the reader scores every candidate over the whole vocabulary at every
  reference token, so the cap and ``answer_tokens`` set the labelling's cost.

  Returns:
    per question ``{'summary': str ('' without sentences), 'loglik': [n_sentences], 'none_loglik'}``.
  """
  contexts, targets, owners, pools = [], [], [], []
  for i, (q, a, ps) in enumerate(zip(questions, answers, passages)):
    pool = passage_sentences(ps, max_candidates)
    pools.append(pool)
    target = ' ' + answer_head(reader.tokenizer, a, answer_tokens)
    for text in pool + ['']:  # '' last: the no-retrieval prompt
      contexts.append(reader_prompt_for_evidence(q, text))
      targets.append(target)
      owners.append(i)
  scores = reader.scorer.score(contexts, targets) if contexts else np.zeros((0,), np.float32)
  out, at = [], 0
  for pool in pools:
    values = [float(v) for v in scores[at:at + len(pool) + 1]]
    at += len(pool) + 1
    best = sorted(np.argsort(-np.asarray(values[:-1]), kind='stable')[:sentences].tolist())
    out.append({'summary': ' '.join(pool[j] for j in best), 'loglik': values[:-1], 'none_loglik': values[-1]})
  return out


# ----------------------------------------------------------------------------- inference


class Compressor:
  """A trained K-COMP (or FT) compressor: question + passages -> ``(knowledge, summary)``.

  Greedy decoding (the paper's temperature 0.01) up to ``max_new_tokens``. K-COMP reads the
  unmasked question and writes ``entity: description<eom>`` parts, then the summary: the output
  is split at its last ``eom``. The FT baseline (``knowledge=False``) writes the summary only.
  ``compress`` returns the evidence the reader reads (:func:`evidence_text`).
  """

  def __init__(self, model, tokenizer, *, max_source_length: int, max_new_tokens: int, batch_size: int = 8,
               knowledge: bool = True, eom: str = EOM, top_docs: int | None = None, with_prior: bool = True):
    self.tokenizer = tokenizer
    self.generator = generation.GemmaGenerator(model, tokenizer, batch_size=batch_size)
    self.max_source_length, self.max_new_tokens = max_source_length, max_new_tokens
    self.knowledge, self.eom, self.top_docs, self.with_prior = knowledge, eom, top_docs, with_prior

  @classmethod
  def load(cls, directory: str, **kwargs) -> 'Compressor':
    pretrained = load_pretrained(directory)
    return cls(pretrained.model, pretrained.tokenizer(), **kwargs)

  def prompts(self, questions: Sequence[str], passages: Sequence[Sequence[Passage]]) -> list[str]:
    head = 'Knowledge' if self.knowledge else 'Summary'
    return [fitted_prompt(self.tokenizer, q, list(p)[:self.top_docs], self.max_source_length, head)[0]
            for q, p in zip(questions, passages)]

  def generate(self, questions: Sequence[str], passages: Sequence[Sequence[Passage]]) -> list[tuple[str, str]]:
    """``(knowledge, summary)`` per question (knowledge '' for the FT baseline)."""
    texts = self.generator(self.prompts(questions, passages), max_new_tokens=self.max_new_tokens, stop_strings=())
    if not self.knowledge:
      return [('', t.strip()) for t in texts]
    return [split_output(t, self.eom) for t in texts]

  def compress(self, questions: Sequence[str], passages: Sequence[Sequence[Passage]]) -> list[str]:
    return [evidence_text(summary, knowledge if self.with_prior else '', self.eom)
            for knowledge, summary in self.generate(questions, passages)]


def evidence_text(summary: str, knowledge: str = '', eom: str = EOM) -> str:
  """What the reader reads besides the question (Table 7): the summary, then the prior knowledge."""
  prior = knowledge_lines(knowledge, eom)
  return summary + (f'\n\nPrior Knowledge\n{prior}' if prior else '')


def reader_prompt_for_evidence(question: str, evidence: str) -> str:
  """Table 7's reader prompt around :func:`evidence_text` ('' = no passage: the question alone)."""
  block = f'Passage\n{evidence}\n\n' if evidence else ''
  return f'{block}Questions\n{question}\n\nAnswer\n'


def export_spec(model_dir: str, *, top_docs: int, max_source_length: int, max_new_tokens: int, batch_size: int,
                eom: str) -> dict:
  """The ``compressor.json`` fields of a trained K-COMP compressor (see :func:`load`)."""
  return {'system': 'kcomp', 'model': model_dir, 'top_docs': top_docs, 'max_source_length': max_source_length,
          'max_new_tokens': max_new_tokens, 'batch_size': batch_size, 'eom': eom}


def load(spec: dict) -> Compressor:
  """The compressor an :func:`export_spec` describes (paths already resolved)."""
  return Compressor.load(spec['model'], max_source_length=spec['max_source_length'],
                         max_new_tokens=spec['max_new_tokens'], batch_size=spec['batch_size'],
                         top_docs=spec['top_docs'], eom=spec['eom'])


__all__ = ['Compressor', 'Descriptions', 'EOM', 'EOM_RELEASED', 'Knowledge', 'SPECIAL_TOKENS', 'TEACHER_INSTRUCTION',
           'answer_head', 'compressor_prompt', 'evidence_text', 'export_spec', 'fitted_prompt', 'ft_prompt', 'knowledge_for', 'knowledge_lines', 'load', 'passage_sentences',
           'passages_block', 'prompt_text', 'reader_prompt', 'reader_prompt_for_evidence', 'reader_sentence_summaries',
           'split_output', 'teacher_prompt', 'training_example']
