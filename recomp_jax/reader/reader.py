"""One :class:`Reader` that every pipeline uses to read evidence: Gemma or T5, loaded once.

A pipeline never imports a generator or a scorer: it asks the reader for

* :meth:`Reader.loglik` -- ``log p(answer | prompt)`` with a prompt prefix shared by every
  row encoded once (the prompt's few-shot block, ``few_shot``; a KV-cache prefill for Gemma,
  the full string for T5);
* :meth:`Reader.output_loglik` -- ``log p(output ⊕ EOS | prompt)``: a whole output, ended as a
  fine-tuned model ends it (ranks the outputs a model may give);
* :meth:`Reader.answer` -- greedy answers cut at the first newline (protocol post-processing);
* :meth:`Reader.exact_match` -- those answers scored against gold answers (EM / F1 per example);
* :meth:`Reader.count_tokens` -- evidence length under the reader's tokenizer.

The model class decides the path, like t5x's ``BaseModel.score_batch / predict_batch``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from recomp_jax.evaluation import qa_metrics
from recomp_jax.pretrained.demo import resolve_demo_model
from recomp_jax.reader import prediction_cache, prompts


CACHE_CHUNK = 128  # prompts decoded between two writes to the prediction cache


class Reader:
  """A reader LM (causal Gemma or encoder-decoder T5) with its tokenizer.

  Args:
    source: anything :func:`recomp_jax.pretrained.load_pretrained` reads; ``''`` is the
      demo Gemma 3 270M.
    score_batch_size: rows per compiled log-likelihood call.
    generate_batch_size: prompts per compiled generation call.
    max_new_tokens: generation limit of :meth:`answer` (the protocol's 12).
    stop_strings: generation stops at the first of these (the protocol's newline).
    few_shot: the in-context block every protocol prompt starts with (:meth:`prompt`; the NQ
      protocol's five examples by default, a dataset's own with ``data.shots='train'``).
  """

  def __init__(self, source: str = '', *, score_batch_size: int = 32, generate_batch_size: int = 8,
               max_new_tokens: int = 12, stop_strings: Sequence[str] = ('\n',),
               few_shot: str = prompts.FEW_SHOT_PREFIX):
    from recomp_jax.pretrained import load_pretrained  # pylint: disable=import-outside-toplevel
    self.source = resolve_demo_model(source, 'reader')
    pretrained = load_pretrained(self.source)
    self._setup(pretrained.model, pretrained.tokenizer(), score_batch_size=score_batch_size,
                generate_batch_size=generate_batch_size, max_new_tokens=max_new_tokens,
                stop_strings=stop_strings, few_shot=few_shot)

  @classmethod
  def from_model(cls, model, tokenizer, *, score_batch_size: int = 32, generate_batch_size: int = 8,
                 max_new_tokens: int = 12, stop_strings: Sequence[str] = ('\n',),
                 few_shot: str = prompts.FEW_SHOT_PREFIX) -> 'Reader':
    """A reader around an already loaded Gemma or T5 model and its tokenizer."""
    reader = cls.__new__(cls)
    reader.source = '<in memory>'
    reader._setup(model, tokenizer, score_batch_size=score_batch_size,
                  generate_batch_size=generate_batch_size, max_new_tokens=max_new_tokens,
                  stop_strings=stop_strings, few_shot=few_shot)
    return reader

  def prompt(self, question: str, evidence: str | None = None) -> str:
    """The protocol prompt (:func:`recomp_jax.reader.prompts.build_prompt`) with this reader's
    in-context block; ``evidence`` None or '' gives the no-evidence prompt."""
    return prompts.build_prompt(question, evidence, few_shot=self.few_shot)

  def _setup(self, model, tokenizer, *, score_batch_size, generate_batch_size, max_new_tokens,
             stop_strings, few_shot) -> None:
    self.model = model
    self.tokenizer = tokenizer
    self.score_batch_size = score_batch_size
    self.generate_batch_size = generate_batch_size
    self.max_new_tokens = max_new_tokens
    self.stop_strings = tuple(stop_strings)
    self.few_shot = few_shot
    self._scorer = None
    self._generator = None
    self.prediction_cache = None  # a PredictionCache (use_prediction_cache)

  @property
  def is_seq2seq(self) -> bool:
    from recomp_jax.models.t5 import T5Model  # pylint: disable=import-outside-toplevel
    return isinstance(self.model, T5Model)

  @property
  def scorer(self):
    if self._scorer is None:
      from recomp_jax.reader import scoring  # pylint: disable=import-outside-toplevel
      cls = scoring.Seq2SeqScorer if self.is_seq2seq else scoring.CausalScorer
      self._scorer = cls(self.model, self.tokenizer, batch_size=self.score_batch_size)
    return self._scorer

  @property
  def generator(self):
    if self._generator is None:
      from recomp_jax.models import generation  # pylint: disable=import-outside-toplevel
      cls = generation.T5Generator if self.is_seq2seq else generation.GemmaGenerator
      self._generator = cls(self.model, self.tokenizer, batch_size=self.generate_batch_size)
    return self._generator

  def loglik(self, prefix: str, suffixes: Sequence[str], targets: Sequence[str]) -> np.ndarray:
    """``[N]`` summed ``log p(target_i | prefix + suffix_i)``; the prefix is encoded once (Gemma)."""
    if self.is_seq2seq:
      return self.scorer.score([prefix + s for s in suffixes], list(targets))
    return self.scorer.score_with_shared_prefix(prefix, list(suffixes), list(targets))

  def output_loglik(self, prompt_texts: Sequence[str], outputs: Sequence[str]) -> np.ndarray:
    """``[N]`` summed ``log p(output_i ⊕ EOS | prompt_i)``: the probability that the model
    writes exactly ``output_i`` and stops (``''``: stops at once), the framing of
    :func:`recomp_jax.training.recipes.causal_lm_arrays` (BOS + prompt + output + EOS) and of
    T5's decoder labels (output + EOS)."""
    if len(prompt_texts) != len(outputs):
      raise ValueError(f'{len(prompt_texts)} prompts for {len(outputs)} outputs')
    if not prompt_texts:
      return np.zeros((0,), np.float32)
    if self.is_seq2seq:
      return self.scorer.score(list(prompt_texts), list(outputs))  # the scorer appends EOS
    prompt_ids = self.tokenizer(list(prompt_texts), add_special_tokens=True)['input_ids']
    return self.scorer.score_ids([list(ids) for ids in prompt_ids],
                                 self._whole_output_ids(outputs)).reduce('sum')

  def _whole_output_ids(self, outputs: Sequence[str]) -> list[list[int]]:
    """Each output's token ids followed by EOS (causal models: the output and its stop)."""
    eos = self.tokenizer.eos_token_id
    if eos is None:
      raise ValueError('the tokenizer has no eos_token_id: a whole output cannot be scored')
    return [list(ids) + [eos] for ids in self.tokenizer(list(outputs), add_special_tokens=False)['input_ids']]

  def output_loglik_per_prompt(self, prompt_texts: Sequence[str],
                               outputs: Sequence[Sequence[str]]) -> list[np.ndarray]:
    """:meth:`output_loglik` of many outputs per prompt: ``[len(outputs[g])]`` scores per
    prompt ``g``. A causal model encodes each prompt once and scores its outputs as
    continuations of the cached prompt (:meth:`recomp_jax.reader.scoring.CausalScorer.score_ids_with_prefixes`);
    the numbers equal :meth:`output_loglik` on the repeated prompts up to float rounding."""
    if len(prompt_texts) != len(outputs):
      raise ValueError(f'{len(prompt_texts)} prompts for {len(outputs)} output lists')
    flat = [o for group in outputs for o in group]
    if self.is_seq2seq or not flat:
      scores = self.output_loglik([p for p, group in zip(prompt_texts, outputs) for _ in group], flat)
    else:
      prompt_ids = [list(ids) for ids in self.tokenizer(list(prompt_texts), add_special_tokens=True)['input_ids']]
      owners = [g for g, group in enumerate(outputs) for _ in group]
      scores = self.scorer.score_ids_with_prefixes(prompt_ids, owners, [[] for _ in flat],
                                                   self._whole_output_ids(flat)).reduce('sum')
    bounds = np.cumsum([0] + [len(group) for group in outputs])
    return [np.asarray(scores[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]

  def answer(self, prompt_texts: Sequence[str], *, max_new_tokens: int | None = None,
             stop_strings: Sequence[str] | None = None, postprocess: bool = True) -> list[str]:
    """Greedy answers, cut at the first stop string and stripped (one per prompt).

    Args:
      prompt_texts: the prompts.
      max_new_tokens: the generation limit (default: the reader's).
      stop_strings: decoding stops at the first of these (default: the reader's).
      postprocess: the short-answer clean-up of :func:`recomp_jax.reader.prompts.postprocess_answer`
        (False: only stripped, e.g. a long-form answer).

    With a prediction cache (:meth:`use_prediction_cache`) cached prompts are not
    decoded again, each distinct missing prompt is decoded once, and new answers are stored
    every :data:`CACHE_CHUNK` prompts; other stop strings or no post-processing are cached apart.
    """
    if not prompt_texts:
      return []
    limit = max_new_tokens or self.max_new_tokens
    stops = self.stop_strings if stop_strings is None else tuple(stop_strings)
    cache = self.prediction_cache
    if cache is None:
      return self._generate_answers(list(prompt_texts), limit, stops, postprocess)
    variant = prediction_cache.decoding_variant(stops, self.stop_strings, postprocess)
    answers = cache.lookup(prompt_texts, limit, variant=variant)
    missing = list(dict.fromkeys(p for p, a in zip(prompt_texts, answers) if a is None))
    generated: dict[str, str] = {}
    for begin in range(0, len(missing), CACHE_CHUNK):
      chunk = missing[begin:begin + CACHE_CHUNK]
      chunk_answers = self._generate_answers(chunk, limit, stops, postprocess)
      cache.store(chunk, chunk_answers, limit, variant=variant)
      generated.update(zip(chunk, chunk_answers))
    return [a if a is not None else generated[p] for p, a in zip(prompt_texts, answers)]

  def _generate_answers(self, prompt_texts: list[str], max_new_tokens: int, stop_strings: tuple[str, ...],
                        postprocess: bool) -> list[str]:
    texts = self.generator(prompt_texts, max_new_tokens=max_new_tokens, stop_strings=stop_strings)
    return [prompts.postprocess_answer(t) if postprocess else t.strip() for t in texts]

  def use_prediction_cache(self, path: str, weights: dict) -> None:
    """Keeps greedy answers in the sqlite file ``path`` (:mod:`recomp_jax.reader.prediction_cache`).

    Args:
      path: the cache file; runs of the same reader may share one.
      weights: :func:`recomp_jax.stages.file_fingerprint` of this reader's weights.
    """
    self.prediction_cache = prediction_cache.PredictionCache(
        path, prediction_cache.reader_key(weights, stop_strings=list(self.stop_strings)))

  def exact_match(self, prompt_texts: Sequence[str], answers: Sequence[Sequence[str]], *,
                  max_new_tokens: int | None = None) -> dict:
    """Greedy answers scored by EM / F1: ``{'predictions', 'em', 'f1', 'n', 'em_per_example' [N],
    'f1_per_example' [N]}`` (means in percent, per-example values in {0, 1} / [0, 1])."""
    if len(prompt_texts) != len(answers):
      raise ValueError(f'{len(prompt_texts)} prompts for {len(answers)} answer lists')
    predictions = self.answer(prompt_texts, max_new_tokens=max_new_tokens)
    return {'predictions': predictions, **qa_metrics.qa_scores(predictions, answers)}

  def count_tokens(self, text: str) -> int:
    """Tokens of ``text`` under the reader's tokenizer, no special tokens (0 for '')."""
    return len(self.tokenizer(text, add_special_tokens=False)['input_ids']) if text else 0


__all__ = ['Reader']
