"""What the shared fine-tuning path trains on: an :class:`Objective` builds a batch and names its loss.

:func:`recomp_jax.training.finetune.finetune` is one path for every system (checkpoints, dev loss,
the best export, microbatches, resume); only the examples and the loss differ between systems:

=========================  ===========================  ==========================================
objective                  one example                  loss (tokens that carry it)
=========================  ===========================  ==========================================
:func:`prompt_target`      ``(prompt, target)``         causal LM or T5 seq2seq (target + EOS)
:func:`knowledge_injection`  ``(prompt, knowledge,      K-COMP (the entities with their
                           summary)``                   descriptions, then the summary + EOS)
:func:`orpo`               ``(prompt, chosen,           CoLoR's ORPO with the length term (both
                           rejected)``                  responses + EOS; SFT on the chosen)
=========================  ===========================  ==========================================

An objective's ``arrays`` returns ``[N, ...]`` arrays (``N`` training rows, ``input_ids`` and
``attention_mask`` among them) that :class:`~recomp_jax.data.iterators.ArrayIterator` batches, and
its ``loss_fn(model)`` the pure ``(model, batch, rng) -> (loss, metrics)`` the jitted step runs.
A system with another objective writes one of these, not another training loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from recomp_jax.models.t5 import T5Model
from recomp_jax.training import recipes


@dataclasses.dataclass(frozen=True)
class Objective:
  """How :func:`~recomp_jax.training.finetune.finetune` turns examples into arrays and a loss.

  Attributes:
    name: recorded in the training summary.
    arrays: ``(model, tokenizer, examples, *, max_source_length, max_target_length, report, pack)
      -> {name: [N, ...] array}``.
    loss_fn: ``model -> (model, batch, rng) -> (loss, metrics)``, jittable.
    packs: whether ``pack=True`` (several examples per row) is supported.
  """
  name: str
  arrays: Callable[..., dict[str, np.ndarray]]
  loss_fn: Callable[[Any], Callable]
  packs: bool = False


def is_seq2seq(model) -> bool:
  """Whether ``model`` is an encoder-decoder (T5) rather than a decoder-only LM."""
  return isinstance(model, T5Model)


def _decoder_only(model, name: str) -> None:
  if is_seq2seq(model):
    raise ValueError(f'the {name} objective is implemented for decoder-only models (Gemma), not T5')


def lm_arrays(model, tokenizer, prompts: Sequence[str], targets: Sequence[str], *,
              max_source_length: int, max_target_length: int, report, pack: bool = False
              ) -> dict[str, np.ndarray]:
  """Training arrays of ``(prompt, target)`` pairs: seq2seq for T5, prompt-masked causal LM for Gemma.

  ``pack``: several pairs per row (decoder-only models; :func:`recipes.causal_lm_arrays`).
  """
  if is_seq2seq(model):
    if pack:
      raise ValueError('packing is implemented for decoder-only models; set pack=False for T5')
    start = model.config.decoder_start_token_id
    return recipes.seq2seq_arrays(tokenizer, prompts, targets, max_source_length=max_source_length,
                                  max_target_length=max_target_length,
                                  decoder_start_id=0 if start is None else int(start), report=report)
  return recipes.causal_lm_arrays(tokenizer, prompts, targets, pack=pack, max_target_length=max_target_length,
                                  max_length=max_source_length + max_target_length, report=report)


def lm_loss_fn(model):
  """The loss matching :func:`lm_arrays` for ``model``."""
  return recipes.seq2seq_loss_fn() if is_seq2seq(model) else recipes.causal_lm_loss_fn()


def prompt_target() -> Objective:
  """``(prompt, target)`` pairs: RECOMP abstractive, FILCO's filter and generator."""

  def arrays(model, tokenizer, examples, **kw):
    return lm_arrays(model, tokenizer, [p for p, _ in examples], [y for _, y in examples], **kw)

  return Objective('prompt_target', arrays, lm_loss_fn, packs=True)


def knowledge_injection(*, knowledge_weight: float = 1.0, summary_weight: float = 1.0) -> Objective:
  """``(prompt, knowledge, summary)`` triples: K-COMP's ``log P(E, D | P, q_m) + log P(s | E, D, P, q_m)``.

  ``prompt`` holds the passages and the question with its entities masked, ``knowledge`` the
  ``entity: description<eom>`` parts, ``summary`` the compression. Both weights 1: the paper.
  """

  def arrays(model, tokenizer, examples, *, max_source_length, max_target_length, report, pack):
    _decoder_only(model, 'knowledge-injection')
    if pack:
      raise ValueError('the knowledge-injection objective does not pack; set pack=False')
    return recipes.segmented_causal_lm_arrays(
        tokenizer, [p for p, _, _ in examples], [(k, s) for _, k, s in examples],
        max_length=max_source_length + max_target_length, max_target_length=max_target_length, report=report)

  def loss_fn(model):
    _decoder_only(model, 'knowledge-injection')
    return recipes.knowledge_injection_loss_fn(knowledge_weight=knowledge_weight, summary_weight=summary_weight)

  return Objective('knowledge_injection', arrays, loss_fn)


def orpo(*, orpo_lambda: float, length_mode: str = 'paper') -> Objective:
  """``(prompt, chosen, rejected)`` triples: ORPO with CoLoR's length term
  (:func:`recomp_jax.training.losses.orpo_loss`; ``length_mode`` picks the paper's or the
  released code's form)."""

  def arrays(model, tokenizer, examples, *, max_source_length, max_target_length, report, pack):
    _decoder_only(model, 'ORPO')
    if pack:
      raise ValueError('the ORPO objective does not pack; set pack=False')
    return recipes.preference_arrays(tokenizer, [p for p, _, _ in examples], [c for _, c, _ in examples],
                                     [r for _, _, r in examples], max_length=max_source_length + max_target_length,
                                     max_target_length=max_target_length, report=report)

  def loss_fn(model):
    _decoder_only(model, 'ORPO')
    return recipes.orpo_loss_fn(orpo_lambda=orpo_lambda, length_mode=length_mode)

  return Objective(f'orpo_{length_mode}', arrays, loss_fn)


__all__ = ['Objective', 'is_seq2seq', 'knowledge_injection', 'lm_arrays', 'lm_loss_fn', 'orpo', 'prompt_target']
