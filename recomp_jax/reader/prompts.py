"""The reader prompt of the NQ reader protocol (``specs/nq_reader_protocol.md``), exactly.

Five fixed in-context examples (other datasets draw theirs from their training questions:
``data.shots``), each ``'{question}\\nAnswer: {answer}\\n\\n'``; then
``'{evidence}\\n\\n{question}\\nAnswer:'`` with evidence or ``'{question}\\nAnswer:'``
without. The tokenizer adds BOS; nothing else is added here. RECOMP §4.2 likewise
puts the few-shot block first, then the evidence, then the question, with no
evidence for the in-context examples.

Evidence text:

* documents: ``'{title}\\n{text}'`` each, joined by ``'\\n'``, in ascending retrieval
  rank so that the best document is last, closest to the question (RECOMP §4.2,
  Si et al. 2022);
* sentences: the candidate strings (``'{title}: {sentence}'``) joined by ``'\\n'``, with
  the same best-last order; one selected sentence is the whole evidence.

Generated answers are cut at the first newline and stripped
(:func:`postprocess_answer`); an answer that starts with a newline is empty.
"""

from __future__ import annotations

import re
from typing import Sequence

from recomp_jax.data.schema import Passage

FEW_SHOT_EXAMPLES: tuple[tuple[str, str], ...] = (
    ('who won a million on deal or no deal', 'Tomorrow Rodriguez'),
    ('who is the woman washing the car in cool hand luke', 'Joy Harmon'),
    ('who is the actor that plays ragnar on vikings', 'Travis Fimmel'),
    ("who said it's better to have loved and lost", 'Alfred, Lord Tennyson'),
    ('name the first indian woman to be crowned as miss world', 'Reita Faria'),
)


def few_shot_prefix(examples: Sequence[tuple[str, str]]) -> str:
  """``(question, answer)`` pairs as the prompt's in-context block, each ``'{q}\\nAnswer: {a}\\n\\n'``."""
  return ''.join(f'{q}\nAnswer: {a}\n\n' for q, a in examples)


FEW_SHOT_PREFIX = few_shot_prefix(FEW_SHOT_EXAMPLES)


def fill(template: str, **fields: str) -> str:
  """``template`` with each ``{name}`` replaced by ``fields[name]`` in one pass: braces inside
  the inserted texts stay literal (a document containing ``{query}`` is not filled again)."""
  return re.sub(r'\{(' + '|'.join(map(re.escape, fields)) + r')\}', lambda m: fields[m.group(1)], template)


def build_prompt(question: str, evidence: str | None = None, *,
                 few_shot: str = FEW_SHOT_PREFIX) -> str:
  """The full reader prompt; ``evidence`` None or '' gives the no-evidence prompt."""
  if evidence:
    return f'{few_shot}{evidence}\n\n{question}\nAnswer:'
  return f'{few_shot}{question}\nAnswer:'


def format_documents(passages: Sequence[Passage]) -> str:
  """Documents given best first -> ``'{title}\\n{text}'`` lines, best last."""
  return '\n'.join(f'{p.title}\n{p.text}' for p in reversed(passages))


def format_sentences(sentences: Sequence[str]) -> str:
  """Selected candidate strings given best first -> joined by newlines, best last."""
  return '\n'.join(reversed(sentences))


def answer_target(answer: str) -> str:
  """The continuation scored for teacher-forced log-likelihood: ``' {answer}'``."""
  return f' {answer}'


def postprocess_answer(generated: str) -> str:
  """Cuts the generated continuation at the first newline and strips it."""
  return generated.split('\n', 1)[0].strip()
