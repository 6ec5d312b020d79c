"""CoLoR (color.txt §3.2): a passage compressor for long-context-LM retrieval, trained with
ORPO and a length regulariser on preference pairs labelled by retrieval.

* Candidates: compressions of each training passage from several generators with the paper's
  prompt (:func:`compression_prompt`), plus extractive lead sentences so that short and long
  candidates both exist (:func:`lead_candidates`).
* Labels: a candidate succeeds when the long-context reader, with that candidate in place of
  the raw passage in the corpus, ranks the query's gold passage first (:func:`succeeded`; beyond
  the paper, ``rule='no_worse'``: ranks it no lower than with the raw passage, for a reader too
  weak to rank many gold passages first).
* Pairs (:func:`preference_pairs`): chosen = the shortest successful candidate; rejected = every
  other candidate (paper). A rejected candidate not longer than the chosen one would turn the
  paper's ``(|y_l| - |y_w|)`` factor non-positive and flip (or void) the preference: such pairs
  are dropped here and counted (the loss also clamps the factor at 0,
  :func:`recomp_jax.training.losses.orpo_loss`). ``variant='released'`` follows the released
  ``7_make_orpo_dataset.py``: one pair per query, the shortest successful against the longest
  failed candidate, by character length.
* Model: a decoder-only compressor fine-tuned on ``(prompt, chosen, rejected)`` triples through
  the shared fine-tuning path (:func:`recomp_jax.training.objectives.orpo`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from recomp_jax.data.schema import Passage
from recomp_jax.data.sentences import split_sentences
from recomp_jax.models import generation
from recomp_jax.pretrained import load_pretrained

# §3.2.1: the prompt of every generator. The trailing cue tells a base (non-chat) model where
# the summary starts; chat endpoints get the same text as the user message.
COMPRESS_INSTRUCTION = 'Summarize the following content: {passage}'


def compression_prompt(passage: Passage) -> str:
  """The compressor's input for one passage (its content; the title stays in the corpus entry)."""
  return COMPRESS_INSTRUCTION.format(passage=passage.text.strip()) + '\n\nSummary:'


def lead_candidates(passage: Passage, counts: Sequence[int]) -> list[str]:
  """Extractive candidates: the passage's first ``k`` sentences for each ``k`` in ``counts``
  (distinct, and shorter than the whole passage)."""
  sentences = split_sentences(passage.text)
  out = []
  for k in counts:
    if 0 < k < len(sentences):
      text = ' '.join(sentences[:k])
      if text not in out:
        out.append(text)
  return out


SUCCESS_RULES = ('first', 'no_worse')


def succeeded(gold_rank: int, raw_gold_rank: int, rule: str = 'first') -> bool:
  """Whether a candidate succeeds, from the passages ranked above the gold with it in the corpus
  (``gold_rank``) and with the raw passage (``raw_gold_rank``).

  ``'first'`` (the paper): nothing is ranked above the gold. ``'no_worse'`` (beyond the paper):
  the compression costs the gold no rank, first or not; with a reader that rarely ranks the
  gold first (Gemma 3 270M over a few thousand tokens) the paper's rule labels almost nothing a
  success, so there is nothing to choose.
  """
  if rule == 'first':
    return gold_rank == 0
  if rule == 'no_worse':
    return gold_rank <= raw_gold_rank
  raise ValueError(f'rule must be one of {SUCCESS_RULES}, got {rule!r}')


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One labelled compression of a training passage.

  Attributes:
    text: the compression ('' is a valid, empty one).
    source: which generator wrote it (``teacher@0.7``, ``lead2``, ...).
    tokens: its length in compressor tokens (the paper's ``|y|``).
    success: it succeeded (:func:`succeeded`).
  """
  text: str
  source: str
  tokens: int
  success: bool


@dataclasses.dataclass
class PairCounts:
  """What :func:`preference_pairs` kept and dropped (Table 9 and the sign rule)."""
  queries: int = 0
  pairs: int = 0
  no_success: int = 0
  no_rejected: int = 0
  rejected_not_longer: int = 0
  empty_chosen: int = 0
  chosen_tokens: float = 0.0
  rejected_tokens: float = 0.0

  def to_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out['mean_chosen_tokens'] = self.chosen_tokens / self.pairs if self.pairs else 0.0
    out['mean_rejected_tokens'] = self.rejected_tokens / self.pairs if self.pairs else 0.0
    del out['chosen_tokens'], out['rejected_tokens']
    return out


def preference_pairs(candidates: Sequence[Candidate], counts: PairCounts, *, variant: str = 'paper'
                     ) -> list[tuple[Candidate, Candidate]]:
  """``(chosen, rejected)`` pairs of one query's candidates (see the module docstring).

  ``variant='paper'``: chosen = the shortest successful (in tokens); each other candidate is a
  rejected one, except those not longer than the chosen (dropped, counted in
  ``counts.rejected_not_longer``). ``variant='released'``: the shortest successful against the
  longest failed, by characters (no pair when nothing failed).
  """
  if variant not in ('paper', 'released'):
    raise ValueError(f"variant must be 'paper' or 'released', got {variant!r}")
  counts.queries += 1
  won = [c for c in candidates if c.success]
  if not won:
    counts.no_success += 1
    return []
  if variant == 'released':
    chosen = min(won, key=lambda c: len(c.text))
    failed = [c for c in candidates if not c.success]
    if not failed:
      counts.no_rejected += 1
      return []
    pairs = [(chosen, max(failed, key=lambda c: len(c.text)))]
  else:
    chosen = min(won, key=lambda c: (c.tokens, len(c.text)))
    others = [c for c in candidates if c is not chosen]
    longer = [c for c in others if c.tokens > chosen.tokens]
    counts.rejected_not_longer += len(others) - len(longer)
    if not longer:
      counts.no_rejected += 1
      return []
    pairs = [(chosen, c) for c in longer]
  counts.pairs += len(pairs)
  counts.empty_chosen += not chosen.text.strip()  # a lenient rule may choose the empty compression
  counts.chosen_tokens += sum(w.tokens for w, _ in pairs)
  counts.rejected_tokens += sum(r.tokens for _, r in pairs)
  return pairs


class Compressor:
  """A trained CoLoR (or SFT / ORPO) compressor: passage -> compressed content, greedy."""

  def __init__(self, model, tokenizer, *, max_new_tokens: int, batch_size: int = 8):
    self.tokenizer = tokenizer
    self.generator = generation.GemmaGenerator(model, tokenizer, batch_size=batch_size)
    self.max_new_tokens = max_new_tokens

  @classmethod
  def load(cls, directory: str, **kwargs) -> 'Compressor':
    pretrained = load_pretrained(directory)
    return cls(pretrained.model, pretrained.tokenizer(), **kwargs)

  def compress_passages(self, passages: Sequence[Passage]) -> list[str]:
    """Compressed content per passage (a summary cut at a blank line; '' is kept as empty)."""
    texts = self.generator([compression_prompt(p) for p in passages], max_new_tokens=self.max_new_tokens,
                           stop_strings=('\n\n',))
    return [t.strip() for t in texts]

  def compress(self, questions: Sequence[str], passages: Sequence[Sequence[Passage]]) -> list[str]:
    """The :mod:`recomp_jax.inference` interface: per question its passages compressed (CoLoR reads
    no question), each as ``title: compression``, joined by blank lines."""
    del questions
    flat = [p for ps in passages for p in ps]
    texts = iter(self.compress_passages(flat))
    return ['\n\n'.join(f'{p.title}: {next(texts)}' if p.title else next(texts) for p in ps) for ps in passages]


def export_spec(model_dir: str, *, max_new_tokens: int, batch_size: int) -> dict:
  """The ``compressor.json`` fields of a trained CoLoR compressor (see :func:`load`)."""
  return {'system': 'color', 'model': model_dir, 'max_new_tokens': max_new_tokens, 'batch_size': batch_size}


def load(spec: dict) -> Compressor:
  """The compressor an :func:`export_spec` describes (paths already resolved)."""
  return Compressor.load(spec['model'], max_new_tokens=spec['max_new_tokens'], batch_size=spec['batch_size'])


__all__ = ['COMPRESS_INSTRUCTION', 'Candidate', 'Compressor', 'PairCounts', 'SUCCESS_RULES', 'compression_prompt',
           'export_spec', 'lead_candidates', 'load', 'preference_pairs', 'succeeded']
