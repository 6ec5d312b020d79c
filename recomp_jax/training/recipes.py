"""Fine-tuning recipes shared by the compressor systems: data arrays + a loss function each.

Every recipe turns strings into fixed-shape numpy arrays for :func:`recomp_jax.training.loop.train`
(``ArrayIterator``) and gives the matching ``(model, batch, rng) -> (loss, metrics)``.

* **Prompt-masked causal-LM SFT** (:func:`causal_lm_arrays`, :func:`causal_lm_loss_fn`): a
  decoder-only model (Gemma) reads ``BOS prompt target EOS``; the loss is the cross-entropy
  of the target tokens and EOS only, the prompt is context. This is how the offline
  seq2seq compressors (RECOMP abstractive, FILCO filter and generator) train Gemma 3 270M.
  By default the output head runs only at the ``A`` positions that predict target tokens
  (``target_positions``), not at all ``L``: a compressor's prompt (~650 tokens of documents)
  is ~10x its summary, and Gemma 3's head (262k x 640) is most of its FLOPs per token.
* **Seq2seq SFT** (:func:`seq2seq_arrays`, :func:`seq2seq_loss_fn`): T5 reads the prompt
  with its encoder; the decoder is teacher-forced on ``target EOS`` after the start token.
* **Knowledge injection** (K-COMP; :func:`segmented_causal_lm_arrays`,
  :func:`knowledge_injection_loss_fn`): the target is two parts, the entities with their
  descriptions and then the summary, each token labelled with its part.
* **Preference pairs** (CoLoR's ORPO; :func:`preference_arrays`, :func:`orpo_loss_fn`): a
  chosen and a rejected response to one prompt, read in one forward pass.

An empty target is a valid example (only EOS is predicted): RECOMP's selective
augmentation teaches the compressor to say nothing. Sequences are padded to the longest
example rounded up to a length bucket, so one compiled shape serves the whole run.
Prompts longer than their budget lose their *beginning* (the instruction and the question
usually sit at the end of a prompt); targets lose their end. Both are counted.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from recomp_jax.data.buckets import TARGET_BUCKETS, bucket_length
from recomp_jax.training import losses


@dataclasses.dataclass
class TruncationReport:
  """How many prompts and targets were cut to fit (nothing is cut silently)."""
  examples: int = 0
  prompts_truncated: int = 0
  targets_truncated: int = 0


def _ids(tokenizer, texts: Sequence[str]) -> list[list[int]]:
  if not texts:
    return []
  return [list(x) for x in tokenizer(list(texts), add_special_tokens=False)['input_ids']]


def _bos_id(tokenizer) -> int | None:
  return getattr(tokenizer, 'bos_token_id', None)


def pack_first_fit(lengths: Sequence[int], width: int, target_lengths: Sequence[int] | None = None,
                   target_width: int | None = None) -> list[list[int]]:
  """Sequence indices grouped into rows of at most ``width`` tokens, first fit in order.

  With ``target_lengths``, a row also holds at most ``target_width`` target tokens, so the
  output head's ``[rows, A]`` slots stay those of one sequence per row (packing must not
  move the padding from the backbone to the head). Deterministic: sequence ``i`` goes to
  the first row with room, so rows keep the input order inside them.
  """
  targets = list(target_lengths) if target_lengths is not None else [0] * len(lengths)
  target_width = target_width if target_width is not None else max(targets, default=0)
  # A max-tree over row slots (each leaf: [free tokens, free target slots]); leaves past the
  # last open row are empty rows, so the leftmost leaf with room is the first-fit row, found
  # in about log(rows) steps instead of a scan of every row.
  size = 1
  while size < max(len(lengths), 1):
    size *= 2
  free_tokens = [width] * (2 * size)
  free_targets = [target_width] * (2 * size)
  rows: list[list[int]] = []
  for i, (n, a) in enumerate(zip(lengths, targets)):
    if n > width or a > target_width:
      raise ValueError(f'sequence {i} has {n} tokens ({a} targets), more than a row holds '
                       f'({width}, {target_width})')
    leaf = _leftmost_with_room(free_tokens, free_targets, size, n, a)
    r = leaf - size
    if r == len(rows):
      rows.append([])
    rows[r].append(i)
    free_tokens[leaf] -= n
    free_targets[leaf] -= a
    node = leaf // 2
    while node:
      free_tokens[node] = max(free_tokens[2 * node], free_tokens[2 * node + 1])
      free_targets[node] = max(free_targets[2 * node], free_targets[2 * node + 1])
      node //= 2
  return rows


def _leftmost_with_room(free_tokens: list[int], free_targets: list[int], size: int, n: int,
                        a: int) -> int:
  """The leftmost leaf of the max-tree with ``n`` free tokens and ``a`` free target slots.

  A subtree whose maxima fall short of either is skipped; both maxima sufficing does not
  promise one leaf has both, so the search backtracks (rarely: rows fill both together).
  """
  stack = [1]
  while stack:
    node = stack.pop()
    if free_tokens[node] < n or free_targets[node] < a:
      continue
    if node >= size:
      return node
    stack.append(2 * node + 1)
    stack.append(2 * node)
  raise AssertionError('no row has room; an empty row always has')


def _framing(tokenizer, *, add_bos: bool, add_eos: bool, pad_id: int | None) -> tuple[list[int], list[int], int]:
  """``(head, tail, pad)``: the BOS before and EOS after every row (empty when not added), and the pad id."""
  bos = _bos_id(tokenizer) if add_bos else None
  if add_bos and bos is None:
    raise ValueError('the tokenizer has no bos_token_id; pass add_bos=False')
  eos = tokenizer.eos_token_id if add_eos else None
  pad = pad_id if pad_id is not None else (tokenizer.pad_token_id or 0)
  return ([bos] if bos is not None else []), ([eos] if eos is not None else []), pad


def _fit_row(prompt: list[int], target_length: int, *, head: list[int], tail: list[int], max_length: int,
             max_target_length: int | None, report: TruncationReport) -> tuple[list[int], int]:
  """The one truncation rule of the causal-LM rows: the target loses its end (to
  ``max_target_length`` with EOS, and to leave a prompt token), then the prompt its beginning, so
  ``head + prompt + target + tail`` fits ``max_length``; both counted in ``report``.
  Returns ``(prompt kept, target tokens kept)``."""
  report.examples += 1
  budget = max_length - len(head) - len(tail)
  if budget < 1:
    raise ValueError(f'max_length={max_length} leaves no room for tokens')
  limit = budget - 1 if max_target_length is None else min(budget - 1, max_target_length - len(tail))
  kept = target_length
  if target_length > limit:
    report.targets_truncated += 1
    kept = max(limit, 0)
  if len(prompt) + kept > budget:
    report.prompts_truncated += 1
    prompt = prompt[len(prompt) + kept - budget:]
  return prompt, kept


def causal_lm_arrays(tokenizer, prompt_texts: Sequence[str], targets: Sequence[str], *,
                     max_length: int, add_bos: bool = True, add_eos: bool = True,
                     pad_id: int | None = None, report: TruncationReport | None = None,
                     pack: bool = False, max_target_length: int | None = None) -> dict[str, np.ndarray]:
  """Arrays for prompt-masked causal-LM fine-tuning.

  Row ``i`` is ``[BOS] prompt_i target_i [EOS]`` right-padded; position ``t`` predicts
  token ``t + 1``. With ``pack``, sequences share rows (:func:`pack_first_fit` into the
  width the longest one needs): ``N`` becomes the number of rows ``R``, a
  ``segment_ids [R, L]`` array (1, 2, ... per sequence, 0 on padding) keeps each
  sequence's attention and positions its own (:meth:`GemmaModel.hidden_states`), and the
  token-mean loss is unchanged while the padding FLOPs go (a row of a 150-token mean
  padded to 256 wastes 40%). A row's target tokens also fit the unpacked ``A``, so the
  head costs no more per row. A batch is then ``B`` rows, not ``B`` examples.

  Args:
    tokenizer: a Hugging Face tokenizer (prompt and target are tokenised separately, so
      the boundary is exact).
    prompt_texts, targets: ``N`` strings each.
    max_length: at most this many tokens per row (BOS and EOS included).
    max_target_length: at most this many target tokens, EOS included (as
      :func:`seq2seq_arrays`); longer targets lose their end (counted). None: only
      ``max_length`` bounds them. The head's ``A`` slots follow the longest target of the
      whole set, so one unbounded target (a 256-token "sentence") would make every row's
      head 8 times wider than the typical target needs.
    add_bos, add_eos: framing tokens (the tokenizer's ``bos_token_id`` / ``eos_token_id``).
    pad_id: padding id (default the tokenizer's pad id, else 0).
    report: counts truncated prompts and targets.
  Returns:
    ``input_ids [N, L]`` int32, ``attention_mask [N, L]`` int32, ``targets [N, L]`` int32
    (the next token at every position) and ``loss_mask [N, L]`` float32: 1 where the next
    token belongs to the target (or is EOS), 0 on the prompt and padding. The same targets
    compactly: ``target_positions [N, A]`` int32 (the positions predicting them, in order),
    ``target_ids [N, A]`` int32 and ``target_mask [N, A]`` float32, with ``A`` the longest
    target + EOS rounded up to a target bucket.
  """
  if len(prompt_texts) != len(targets):
    raise ValueError(f'{len(prompt_texts)} prompts for {len(targets)} targets')
  report = report if report is not None else TruncationReport()
  head, tail, pad = _framing(tokenizer, add_bos=add_bos, add_eos=add_eos, pad_id=pad_id)
  rows, starts = [], []
  for prompt, target in zip(_ids(tokenizer, prompt_texts), _ids(tokenizer, targets)):
    prompt, kept = _fit_row(prompt, len(target), head=head, tail=tail, max_length=max_length,
                            max_target_length=max_target_length, report=report)
    target = target[:kept]
    rows.append(head + prompt + target + tail)
    starts.append(len(head) + len(prompt))  # index of the first target (or EOS) token
  length = min(bucket_length(max((len(r) for r in rows), default=1)), max(max_length, 1))
  # Position t predicts row[t + 1]: a row's targets are predicted from positions start-1 ... len-2.
  first_predicting = [max(start - 1, 0) for start in starts]
  spans_alone = [len(row) - 1 - first for row, first in zip(rows, first_predicting)]
  width_alone = bucket_length(max(spans_alone, default=1), TARGET_BUCKETS)
  groups = (pack_first_fit([len(r) for r in rows], length, spans_alone, width_alone) if pack
            else [[i] for i in range(len(rows))])
  n = len(groups)
  input_ids = np.full((n, length), pad, np.int32)
  segment_ids = np.zeros((n, length), np.int32)
  next_ids = np.full((n, length), pad, np.int32)
  loss_mask = np.zeros((n, length), np.float32)
  spans: list[list[tuple[int, int]]] = []  # per row: [a, b) positions predicting a target
  for r, group in enumerate(groups):
    offset, spans_r = 0, []
    for segment, i in enumerate(group, 1):
      row = rows[i]
      end = offset + len(row)
      input_ids[r, offset:end] = row
      segment_ids[r, offset:end] = segment
      next_ids[r, offset:end - 1] = row[1:]
      a, b = offset + first_predicting[i], end - 1
      loss_mask[r, a:b] = 1.0
      spans_r.append((a, b))
      offset = end
    spans.append(spans_r)
  width = width_alone  # packed rows never hold more target tokens than one row alone would
  target_positions = np.zeros((n, width), np.int32)
  target_ids = np.full((n, width), pad, np.int32)
  target_mask = np.zeros((n, width), np.float32)
  for r, spans_r in enumerate(spans):
    positions = np.concatenate([np.arange(a, b) for a, b in spans_r]).astype(np.int32)
    target_positions[r, :len(positions)] = positions
    target_ids[r, :len(positions)] = next_ids[r, positions]
    target_mask[r, :len(positions)] = 1.0
  out = {'input_ids': input_ids, 'attention_mask': (segment_ids > 0).astype(np.int32), 'targets': next_ids,
         'loss_mask': loss_mask, 'target_positions': target_positions, 'target_ids': target_ids,
         'target_mask': target_mask}
  if pack:
    out['segment_ids'] = segment_ids
  return out


def causal_lm_loss_fn(*, label_smoothing: float = 0.0, reduction: str = 'token_mean',
                      head_on_targets_only: bool = True):
  """``(model, batch, rng) -> (loss, metrics)`` of :func:`causal_lm_arrays` batches.

  The loss is :func:`recomp_jax.training.losses.seq2seq_loss` over the target tokens.
  With ``head_on_targets_only`` (a model with ``hidden_states`` and ``logits``, i.e. a
  :class:`~recomp_jax.models.gemma.GemmaModel`) the hidden states ``[B, L, D]`` are
  gathered at ``target_positions`` to ``[B, A, D]`` before the output head, so logits are
  ``[B, A, V]``; otherwise ``model(input_ids, attention_mask) -> [B, L, V]`` and the
  ``loss_mask`` positions count. Both give the same loss. Packed batches (``segment_ids``,
  :func:`causal_lm_arrays` with ``pack``) are passed on to the model.
  """

  def loss_fn(model, batch, rng):
    del rng  # no dropout in the decoder-only recipe
    packed = {'segment_ids': batch['segment_ids']} if 'segment_ids' in batch else {}
    if head_on_targets_only:
      hidden = model.hidden_states(batch['input_ids'], batch['attention_mask'], **packed)  # [B, L, D]
      picked = jnp.take_along_axis(hidden, batch['target_positions'][..., None], axis=1)  # [B, A, D]
      return losses.seq2seq_loss(model.logits(picked), batch['target_ids'], batch['target_mask'],
                                 label_smoothing=label_smoothing, reduction=reduction)
    logits = model(batch['input_ids'], batch['attention_mask'], **packed)  # [B, L, V]
    return losses.seq2seq_loss(logits, batch['targets'], batch['loss_mask'],
                               label_smoothing=label_smoothing, reduction=reduction)

  return loss_fn


def seq2seq_arrays(tokenizer, prompt_texts: Sequence[str], targets: Sequence[str], *,
                   max_source_length: int, max_target_length: int, decoder_start_id: int,
                   pad_id: int | None = None, report: TruncationReport | None = None
                   ) -> dict[str, np.ndarray]:
  """Arrays for encoder-decoder (T5) fine-tuning.

  Returns:
    ``input_ids / attention_mask [N, S]`` (prompt + EOS, the prompt's start cut when too
    long), ``decoder_input_ids [N, T]`` (start token + target), ``targets [N, T]``
    (target + EOS) and ``loss_mask [N, T]`` float32 (1 on target and EOS tokens).
  """
  if len(prompt_texts) != len(targets):
    raise ValueError(f'{len(prompt_texts)} prompts for {len(targets)} targets')
  report = report if report is not None else TruncationReport()
  eos = tokenizer.eos_token_id
  pad = pad_id if pad_id is not None else (tokenizer.pad_token_id or 0)
  sources, labels = [], []
  for prompt, target in zip(_ids(tokenizer, prompt_texts), _ids(tokenizer, targets)):
    report.examples += 1
    if len(prompt) + 1 > max_source_length:
      report.prompts_truncated += 1
      prompt = prompt[len(prompt) + 1 - max_source_length:]
    if len(target) + 1 > max_target_length:
      report.targets_truncated += 1
      target = target[:max_target_length - 1]
    sources.append(prompt + [eos])
    labels.append(target + [eos])
  n = len(sources)
  s_len = min(bucket_length(max((len(s) for s in sources), default=1)), max_source_length)
  t_len = min(bucket_length(max((len(t) for t in labels), default=1)), max_target_length)
  out = {'input_ids': np.full((n, s_len), pad, np.int32), 'attention_mask': np.zeros((n, s_len), np.int32),
         'decoder_input_ids': np.full((n, t_len), pad, np.int32),
         'targets': np.full((n, t_len), pad, np.int32), 'loss_mask': np.zeros((n, t_len), np.float32)}
  for i, (src, lab) in enumerate(zip(sources, labels)):
    out['input_ids'][i, :len(src)] = src
    out['attention_mask'][i, :len(src)] = 1
    out['decoder_input_ids'][i, :len(lab)] = [decoder_start_id] + lab[:-1]
    out['targets'][i, :len(lab)] = lab
    out['loss_mask'][i, :len(lab)] = 1.0
  return out


def seq2seq_loss_fn(*, label_smoothing: float = 0.0, reduction: str = 'token_mean'):
  """``(model, batch, rng) -> (loss, metrics)`` of :func:`seq2seq_arrays` batches (a T5 model)."""

  def loss_fn(model, batch, rng):
    del rng
    logits = model(batch['input_ids'], batch['attention_mask'], batch['decoder_input_ids'],
                   batch['loss_mask'].astype(np.int32))  # [B, T, V]
    return losses.seq2seq_loss(logits, batch['targets'], batch['loss_mask'],
                               label_smoothing=label_smoothing, reduction=reduction)

  return loss_fn


def segmented_causal_lm_arrays(tokenizer, prompt_texts: Sequence[str], target_parts: Sequence[Sequence[str]], *,
                               max_length: int, max_target_length: int | None = None, add_bos: bool = True,
                               add_eos: bool = True, pad_id: int | None = None,
                               report: TruncationReport | None = None) -> dict[str, np.ndarray]:
  """Prompt-masked causal-LM arrays whose target is several parts, each token labelled with its part.

  Row ``i`` is ``[BOS] prompt_i part_i1 ... part_iK [EOS]``; each part is tokenised on its
  own, so its boundary is exact. The loss-carrying tokens are the parts and EOS (EOS belongs
  to the last part); the prompt never carries loss. K-COMP (:func:`knowledge_injection_loss_fn`)
  uses two parts: ``entity: description<eom>`` per entity, then the summary. Too long a
  target loses its end (the last part first), too long a prompt its beginning; both counted.

  Args:
    tokenizer: a Hugging Face tokenizer.
    prompt_texts: ``N`` prompts.
    target_parts: ``N`` sequences of ``K`` strings (the same ``K`` for every row).
    max_length: at most this many tokens per row (BOS and EOS included).
    max_target_length: at most this many target tokens (EOS included); None: ``max_length`` only.
  Returns:
    ``input_ids / attention_mask [N, L]`` int32 and the targets compactly:
    ``target_positions [N, A]`` int32 (the positions predicting them), ``target_ids [N, A]``
    int32, ``target_mask [N, A]`` float32 and ``target_segments [N, A]`` int32 (part
    ``1..K`` of each target token, 0 on padding).
  """
  if len(prompt_texts) != len(target_parts):
    raise ValueError(f'{len(prompt_texts)} prompts for {len(target_parts)} targets')
  report = report if report is not None else TruncationReport()
  head, tail, pad = _framing(tokenizer, add_bos=add_bos, add_eos=add_eos, pad_id=pad_id)
  rows, labels = [], []  # labels: the part of every token of the row (0 on BOS and the prompt)
  for prompt, parts in zip(_ids(tokenizer, prompt_texts), target_parts):
    target, part_of = [], []
    for k, ids in enumerate(_ids(tokenizer, list(parts)), 1):
      target += ids
      part_of += [k] * len(ids)
    prompt, kept = _fit_row(prompt, len(target), head=head, tail=tail, max_length=max_length,
                            max_target_length=max_target_length, report=report)
    target, part_of = target[:kept], part_of[:kept]
    last = len(parts) if parts else 1
    rows.append(head + prompt + target + tail)
    labels.append([0] * (len(head) + len(prompt)) + part_of + [last] * len(tail))
  length = min(bucket_length(max((len(r) for r in rows), default=1)), max(max_length, 1))
  spans = [sum(1 for x in lab if x) for lab in labels]  # target tokens per row
  width = bucket_length(max(spans, default=1), TARGET_BUCKETS)
  n = len(rows)
  out = {'input_ids': np.full((n, length), pad, np.int32), 'attention_mask': np.zeros((n, length), np.int32),
         'target_positions': np.zeros((n, width), np.int32), 'target_ids': np.full((n, width), pad, np.int32),
         'target_mask': np.zeros((n, width), np.float32), 'target_segments': np.zeros((n, width), np.int32)}
  for i, (row, lab) in enumerate(zip(rows, labels)):
    out['input_ids'][i, :len(row)] = row
    out['attention_mask'][i, :len(row)] = 1
    tokens = [t for t in range(len(row)) if lab[t]]  # position t - 1 predicts token t
    out['target_positions'][i, :len(tokens)] = [t - 1 for t in tokens]
    out['target_ids'][i, :len(tokens)] = [row[t] for t in tokens]
    out['target_mask'][i, :len(tokens)] = 1.0
    out['target_segments'][i, :len(tokens)] = [lab[t] for t in tokens]
  return out


def _target_hidden(model, batch, ids: str = 'input_ids', mask: str = 'attention_mask'):
  """Final hidden states at ``target_positions`` only: ``[B, A, D]`` (the head then runs on A, not L)."""
  hidden = model.hidden_states(batch[ids], batch[mask])  # [B, L, D]
  return jnp.take_along_axis(hidden, batch['target_positions'][..., None], axis=1)


def knowledge_injection_loss_fn(*, knowledge_weight: float = 1.0, summary_weight: float = 1.0,
                                reduction: str = 'token_mean'):
  """``(model, batch, rng) -> (loss, metrics)`` of :func:`segmented_causal_lm_arrays` batches with two
  parts (knowledge, summary): :func:`recomp_jax.training.losses.knowledge_injection_loss_at` with the
  head run only at the target positions."""

  def loss_fn(model, batch, rng):
    del rng
    logits = model.logits(_target_hidden(model, batch))  # [B, A, V]
    return losses.knowledge_injection_loss_at(logits, batch['target_ids'], batch['target_segments'],
                                              knowledge_weight=knowledge_weight, summary_weight=summary_weight,
                                              reduction=reduction)

  return loss_fn


def preference_arrays(tokenizer, prompt_texts: Sequence[str], chosen: Sequence[str], rejected: Sequence[str], *,
                      max_length: int, max_target_length: int | None = None,
                      report: TruncationReport | None = None) -> dict[str, np.ndarray]:
  """Chosen and rejected responses to the same prompts, as pairs of prompt-masked causal-LM rows.

  Returns the arrays of :func:`causal_lm_arrays` (unpacked) with a pair axis: ``input_ids /
  attention_mask [N, 2, L]`` and ``target_positions / target_ids / target_mask [N, 2, A]``, index
  0 the chosen response and 1 the rejected one (both padded to one shape).
  """
  if not len(prompt_texts) == len(chosen) == len(rejected):
    raise ValueError(f'{len(prompt_texts)} prompts, {len(chosen)} chosen and {len(rejected)} rejected responses')
  n = len(prompt_texts)
  both = causal_lm_arrays(tokenizer, list(prompt_texts) * 2, list(chosen) + list(rejected), max_length=max_length,
                          max_target_length=max_target_length, report=report)
  keys = ('input_ids', 'attention_mask', 'target_positions', 'target_ids', 'target_mask')
  return {k: np.stack([both[k][:n], both[k][n:]], axis=1) for k in keys}


def orpo_loss_fn(*, orpo_lambda: float, length_mode: str = 'paper'):
  """``(model, batch, rng) -> (loss, metrics)`` of :func:`preference_arrays` batches: one forward pass
  over the ``2B`` rows, the head at the target positions, then
  :func:`recomp_jax.training.losses.orpo_loss` (response lengths in tokens, EOS included). The loss
  is a mean over pairs, so its :data:`~recomp_jax.training.losses.LOSS_WEIGHT` is the pair count."""

  def loss_fn(model, batch, rng):
    del rng
    pairs = batch['input_ids'].shape[0]
    flat = {k: v.reshape((2 * pairs,) + v.shape[2:]) for k, v in batch.items()}
    log_p = losses.token_log_probs(model.logits(_target_hidden(model, flat)), flat['target_ids'])  # [2B, A]
    log_p = log_p.reshape(pairs, 2, -1)
    mask = batch['target_mask']
    loss, metrics = losses.orpo_loss(log_p[:, 0], mask[:, 0], log_p[:, 1], mask[:, 1], orpo_lambda=orpo_lambda,
                                     length_mode=length_mode)
    return loss, {**metrics, losses.LOSS_WEIGHT: jnp.asarray(pairs, jnp.float32)}

  return loss_fn


__all__ = ['TruncationReport', 'causal_lm_arrays', 'causal_lm_loss_fn', 'knowledge_injection_loss_fn',
           'orpo_loss_fn', 'pack_first_fit', 'preference_arrays', 'segmented_causal_lm_arrays', 'seq2seq_arrays',
           'seq2seq_loss_fn']
