"""FILCO on the shared runner: silver contexts -> filter model, PSG model, generators -> rows.

The method (the measures, the selection rule, the prompts, the released-code variants) is
:mod:`recomp_jax.compressors.filco`; this module wires it into cached stages after the
shared head (``data -> retrieve -> candidates``), on the top ``candidates.top_docs``
passages (1: the paper's main setting; 5: its Table 5):

* ``silver``: per question of every split, the passages' sentences, the measure's score of
  each sentence (``filco.measure``; CXMI with the run's reader), ``t_silver`` and the PSG
  label of each passage (kept when one of its sentences passes the measure). Questions with
  an empty ``t_silver`` are counted per split, never dropped. Resumable per chunk;
* ``filter_seed<s>``: ``M_ctx`` fine-tuned on ``q ⊕ P -> t_silver`` (``config.filter``);
* ``psg_seed<s>``: the PSG baseline's model, fine-tuned to answer yes/no per passage;
* ``generator_{full,psg,filco}_seed<s>``: ``M_gen`` fine-tuned on ``context ⊕ q -> o``
  (``config.generator``) with the whole passages (FULL), the silver-kept passages (PSG) and
  ``t_silver`` (FILCO);
* rows: the zero-shot reader with no retrieval and with the passages, FULL, PSG (the passages
  the PSG model keeps, by default above a log-odds threshold chosen on dev: ``psg_decisions``),
  FILCO (the
  FILCO generator reading the filter model's *own* predictions), FILCO ranked (the same
  generator reading the filter model's most likely passage sentence(s),
  :func:`recomp_jax.compressors.filco.ranked_filter` and ``ranked_context``: constrained
  decoding, not in the paper),
  SILVER (the same generator reading the test ``t_silver``, made with the gold answer: an
  upper bound) and the zero-shot reader on the filter model's predictions.

Both FILCO rows are compared with every other row by the paired bootstrap.

Every trained row is evaluated once per seed (``train.seeds``) and reported as the mean.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Sequence

import ml_collections
import numpy as np

from recomp_jax.compressors import filco
from recomp_jax.compressors.filco import filter_input  # noqa: F401  (re-exported)
from recomp_jax.compressors.base import Context, Handoff, System
from recomp_jax.config_fields import Field
from recomp_jax.data.formats import iter_jsonl, read_json
from recomp_jax.data.schema import Example, FilterReport
from recomp_jax.evaluation import rows as rows_lib
from recomp_jax.evaluation.probe import QaProbe, probe_examples
from recomp_jax.evaluation.rows import Row
from recomp_jax.pipelines import defaults, shared
from recomp_jax.stages import map_resumable
from recomp_jax.reader import prompts

SILVER_CODE = shared.READER_CODE + ('recomp_jax.compressors.filco', 'recomp_jax.data')
TRAIN_CODE = ('recomp_jax.compressors.filco', 'recomp_jax.training', 'recomp_jax.models',
              'recomp_jax.pretrained', 'recomp_jax.sharding', 'recomp_jax.reader.prompts')
GENERATOR_KINDS = ('full', 'psg', 'filco')
ROW_KEYS = ('none', 'top1', 'top5', 'full', 'psg', 'trained', 'ranked', 'truncation', 'silver', 'filtered_reader')
ROW_NAMES = {
    'full': 'FULL: generator trained and tested on the whole passage(s)',
    'psg': 'PSG: passages kept by the passage-level filter, generator trained on kept passages',
    'trained': 'FILCO: filter model predictions -> generator trained on silver context',
    'ranked': "FILCO ranked: the filter model's most likely passage sentence(s) -> the FILCO generator",
    'silver': 'SILVER: the silver context (made with the gold answer) -> FILCO generator',
    'filtered_reader': 'filter model predictions -> zero-shot reader (no generator training)',
}
SPLITS = ('train', 'dev', 'test')
# ``config.filco`` fields no stage reads (the silver fingerprint leaves them out).
EVALUATION_ONLY = ('questions_per_call', 'ranked_sentences', 'ranked_empty', 'psg_decision')
PSG_DECISIONS = ('dev_threshold', 'generate')


def _model_fields(section: str, *, max_source_length: int, max_target_length: int, max_new_tokens: int
                  ) -> tuple[Field, ...]:
  """A fine-tuned model's section (``filter`` or ``generator``; read by :mod:`recomp_jax.training.finetune`)."""
  return (
      Field(f'{section}.model', '', "'' = Gemma 3 270M from PyPI (prompt masked from the loss); a T5 trains seq2seq"),
      Field(f'{section}.max_source_length', max_source_length, 'prompt tokens (longer passages lose their end, '
            'counted)', minimum=8),
      Field(f'{section}.max_target_length', max_target_length, 'target tokens in training', minimum=1),
      Field(f'{section}.max_new_tokens', max_new_tokens, 'tokens written at inference', minimum=1),
      Field(f'{section}.generate_batch_size', 8, 'rows per generation call', minimum=1),
      Field(f'{section}.epochs', -1.0, "< 0: train.epochs; else this model's own (train.num_steps > 0 still wins)"),
      Field(f'{section}.microbatch', 2, 'rows per gradient microbatch (a batch is accumulated over them)', minimum=1),
      Field(f'{section}.pack', True, 'several pairs per row, attention kept within each (decoder-only; T5 raises)'),
      Field(f'{section}.remat', True, 'recompute layer activations in the backward pass'),
      Field(f'{section}.scan_layers', True, 'one scanned layer body (remat saves memory on CPU only over it)'),
  )


# FILCO's config section (the shared one is recomp_jax.pipelines.defaults).
FIELDS = (
    Field('filco.measure', 'strinc', 'the silver-context measure (NQ, TQA: strinc; HotpotQA: cxmi)',
          choices=filco.MEASURES),
    Field('filco.variant', 'paper', "'released': the authors' code (raw-substring STRINC keeping every match, "
          'character unigram F1 against every gold answer, sigmoid CXMI from probability products, a threshold '
          'that never filters, the top-1 passage for an empty filtered context)',
          choices=filco.VARIANTS),
    Field('filco.threshold', -1.0, "< 0: the measure's own lambda (lexical 0.5, cxmi 0 in log space)"),
    Field('filco.lexical_against', 'output', "'query' for fact verification (FEVER): §2.2", choices=('output', 'query')),
    Field('filco.questions_per_call', 16, 'questions per reader call of the CXMI measure', minimum=1),
    Field('filco.ranked_sentences', 1, "ranked row (beyond the paper): the filter model's most likely sentences "
          'of the passages, in reading order', minimum=1),
    Field('filco.ranked_empty', False, 'ranked row: the empty context competes too'),
    # A longer-trained filter model then does not lengthen the baseline.
    Field('filco.psg_epochs', -1.0, "the PSG passage classifier's epochs (< 0: train.epochs)"),
    Field('filco.psg_decision', 'dev_threshold', "how PSG keeps a passage: 'dev_threshold' (yes-vs-no log-odds "
          "above the dev threshold with the best keep-F1) or 'generate' (the greedy answer)", choices=PSG_DECISIONS),
    *_model_fields('filter', max_source_length=1024, max_target_length=512, max_new_tokens=512),
    *_model_fields('generator', max_source_length=1024, max_target_length=32, max_new_tokens=32),
)


def wanted_rows(config) -> list[str]:
  return shared.with_truncation(shared.requested_rows(config, ROW_KEYS))


def measure_threshold(config) -> float | None:
  """``filco.threshold`` (< 0 means the measure's own λ / the released default)."""
  return None if config.filco.threshold < 0 else float(config.filco.threshold)


# ----------------------------------------------------------------------------- silver contexts


def stage_silver(config, ctx: Context, directory: str) -> dict:
  """Silver contexts of every split (resumable per chunk of questions)."""
  f = config.filco
  reader = ctx.resources.reader if f.measure == 'cxmi' else None
  threshold = measure_threshold(config)
  summary = {'measure': f.measure, 'variant': f.variant, 'threshold': threshold,
             'top_docs': config.candidates.top_docs}

  def silver(part):
    return filco.silver_records(reader, part, top_docs=config.candidates.top_docs, measure=f.measure,
                          variant=f.variant, threshold=threshold,
                          lexical_against=f.lexical_against)

  for split in SPLITS:
    records = list(map_resumable(os.path.join(directory, f'{split}.jsonl'), ctx.examples(split), silver,
                                 chunk=f.questions_per_call, desc=f'silver {split}').values())
    report = FilterReport(f'silver_{split}')
    for r in records:
      if not any(r['sentences']):
        report.drop('no_sentence', where=r['id'])
      elif not r['output']:
        report.drop('no_answer', where=r['id'])
      elif not r['silver']:
        report.drop('no_sentence_passes_measure', where=r['id'])
      else:
        report.keep()
    report.save(os.path.join(directory, f"{split}_report.json"))
    n = max(len(records), 1)
    summary[split] = {'n': len(records), 'empty_silver': sum(not r['silver'] for r in records),
                      'empty_silver_percent': 100.0 * sum(not r['silver'] for r in records) / n,
                      'psg_kept_percent': 100.0 * float(np.mean([k for r in records for k in r['psg_keep']] or [0])),
                      'empty_reasons': dict(report.dropped)}
  return summary


def load_silver(directory: str, split: str) -> dict[str, dict]:
  """The silver stage's records of ``split`` by id; a damaged line raises ``DataError`` naming it."""
  return shared.load_labels(directory, split)


# ----------------------------------------------------------------------------- training pairs


def filter_inputs(config, tokenizer, examples: Sequence[Example]) -> list[str]:
  """The filter model's inputs at inference (dev probe and test rows alike): ``q ⊕ P`` per example."""
  k, budget = config.candidates.top_docs, config.filter.max_source_length
  return [filter_input(tokenizer, e.question, e.ctxs[:k], budget)[0] for e in examples]


def kept_passages(passages, keep: Sequence[bool]) -> str:
  """The PSG context: the kept passages in the reader's document format ('' if none)."""
  return prompts.format_documents([p for p, k in zip(passages, keep) if k])


def generator_context(kind: str, example: Example, silver: dict | None, top_docs: int,
                      variant: str = 'paper') -> str:
  """The context a generator of ``kind`` trains on (silver labels, gold answers allowed; FULL
  reads the passages alone, so its ``silver`` may be None; ``variant`` as :func:`filco.filtered_context`)."""
  passages = example.ctxs[:top_docs]
  if kind == 'full':
    return prompts.format_documents(passages)
  if kind == 'psg':
    return kept_passages(passages, silver['psg_keep'])
  if kind == 'filco':
    return filco.filtered_context(silver['silver'], passages, variant)
  raise ValueError(f'unknown generator kind {kind!r}; kinds: {GENERATOR_KINDS}')


def generator_pairs(kind: str, examples: Sequence[Example], silver: dict[str, dict] | None, top_docs: int,
                    variant: str = 'paper') -> list[tuple[str, str]]:
  """``(context ⊕ q, ' o')`` per example with an output (examples without one are skipped, counted by silver).

  The output ``o`` (:func:`filco.canonical_output`) does not depend on the measure, so FULL
  needs no silver contexts (``silver=None``) and a run with another measure reuses its generator.
  """
  pairs = []
  for e in examples:
    output = filco.canonical_output(e.answers, e.ctxs[:top_docs])
    if output:
      context = generator_context(kind, e, None if silver is None else silver[e.id], top_docs, variant)
      pairs.append((filco.generator_prompt(e.question, context), prompts.answer_target(output)))
  return pairs


def filter_pairs(tokenizer, examples: Sequence[Example], silver: dict[str, dict], *, top_docs: int,
                 budget: int) -> tuple[list[tuple[str, str]], int]:
  """``(q ⊕ P, t_silver)`` per example (the empty silver context is a target too) and the cut count."""
  pairs, cut = [], 0
  for e in examples:
    prompt, truncated = filter_input(tokenizer, e.question, e.ctxs[:top_docs], budget)
    cut += truncated
    pairs.append((prompt, ' ' + silver[e.id]['silver'] if silver[e.id]['silver'] else ''))
  return pairs, cut


def psg_pairs(examples: Sequence[Example], silver: dict[str, dict], top_docs: int) -> list[tuple[str, str]]:
  """One ``(passage prompt, ' yes' | ' no')`` pair per passage."""
  return [(filco.passage_prompt(e.question, p), filco.KEEP_WORD if keep else filco.DROP_WORD)
          for e in examples for p, keep in zip(e.ctxs[:top_docs], silver[e.id]['psg_keep'])]


def training_section(config, what: str):
  """The config node a fine-tuning job trains with: ``config.generator`` for a generator,
  ``config.filter`` for the filter model, and for the PSG classifier ``config.filter`` with
  ``epochs`` taken from ``config.filco.psg_epochs``."""
  if what.startswith('generator_'):
    return config.generator
  if what == 'psg':
    return ml_collections.ConfigDict({**config.filter.to_dict(), 'epochs': config.filco.psg_epochs})
  return config.filter


def stage_finetune(config, ctx: Context, what: str, seed: int, directory: str) -> dict:
  """Fine-tunes the filter model (``what='filter'``), the PSG model (``'psg'``) or a generator
  (``'generator_<kind>'``) on the silver train/dev splits; exports the best to ``model_best``."""
  from recomp_jax.training import finetune  # pylint: disable=import-outside-toplevel
  k = config.candidates.top_docs
  section = training_section(config, what)
  extra = {}

  def pairs(tokenizer):
    out = {}
    for split in ('train', 'dev'):
      examples, silver = ctx.examples(split), silver_for(ctx, what, split)
      if what == 'filter':
        out[split], extra[f'{split}_passages_cut'] = filter_pairs(tokenizer, examples, silver, top_docs=k,
                                                                  budget=section.max_source_length)
      elif what == 'psg':
        out[split] = psg_pairs(examples, silver, k)
      else:
        out[split] = generator_pairs(what.split('_', 1)[1], examples, silver, k, config.filco.variant)
    extra['empty_targets'] = sum(not y for _, y in out['train'])
    return out['train'], out['dev']

  summary = finetune.finetune_pretrained(
      config, section, pairs, seed=seed, directory=directory, best_name='model_best',
      probe=lambda tok: training_probe(config, ctx, what, tok))
  return {**summary, **extra, 'what': what}


def reads_silver(what: str) -> bool:
  """Whether a training stage reads the silver stage (FULL does not: it depends on no measure)."""
  return what != 'generator_full'


def silver_for(ctx: Context, what: str, split: str) -> dict[str, dict] | None:
  """The silver records a training stage reads (None where :func:`reads_silver` says it reads none)."""
  return load_silver(ctx.stage_dir('silver'), split) if reads_silver(what) else None


def training_probe(config, ctx: Context, what: str, tokenizer):
  """The reader-EM monitor of a FILCO training stage (:mod:`recomp_jax.evaluation.probe`), or None.

  * ``filter``: the run's reader reads the filter model's context for the first dev questions
    (the zero-shot ``filtered_reader`` row, on dev).
  * ``generator_<kind>``: the generator answers from its own training context on dev (for
    ``filco`` the *silver* context, built with gold answers: the training distribution, not the
    test-time FILCO row). The generator changes every evaluation, so nothing is memoised.
  * ``psg``: none (its yes/no decisions are read through ``generator_psg``).
  """
  from recomp_jax.reader import Reader  # pylint: disable=import-outside-toplevel
  examples = probe_examples(ctx.examples('dev'), config.train.eval_qa_examples)
  if not examples or what == 'psg':
    return None
  k = config.candidates.top_docs
  if what == 'filter':
    f = config.filter
    qa = QaProbe(lambda: ctx.resources.reader, examples)
    inputs = filter_inputs(config, tokenizer, examples)
    return lambda model: qa(Reader.from_model(model, tokenizer, generate_batch_size=f.generate_batch_size,
                                              max_new_tokens=f.max_new_tokens).answer(inputs))
  kind, silver = what.split('_', 1)[1], silver_for(ctx, what, 'dev')
  contexts = [generator_context(kind, e, None if silver is None else silver[e.id], k, config.filco.variant)
              for e in examples]
  r = config.reader

  def generator_probe(model):
    reader = Reader.from_model(model, tokenizer, generate_batch_size=r.generate_batch_size,
                               max_new_tokens=r.max_new_tokens)
    return QaProbe(reader, examples, build_prompt=filco.generator_prompt)(contexts)
  return generator_probe


# ----------------------------------------------------------------------------- inference


def filter_predictions(config, model_dir: str, examples: Sequence[Example], out_path: str) -> dict[str, str]:
  """The filter model's context for every example ('' = nothing), appended to ``out_path`` (resumable)."""
  from recomp_jax.reader import Reader  # pylint: disable=import-outside-toplevel
  f = config.filter
  model = functools.cache(lambda: Reader(model_dir, generate_batch_size=f.generate_batch_size,
                                         max_new_tokens=f.max_new_tokens))

  def predict(part):
    return [{'context': text} for text in model().answer(filter_inputs(config, model().tokenizer, part))]

  records = map_resumable(out_path, examples, predict, chunk=64, desc='filter model')
  return {i: r['context'] for i, r in records.items()}


def filter_ranked(config, model_dir: str, examples: Sequence[Example], out_path: str) -> dict[str, str]:
  """The FILCO ranked context of every example (:func:`filco.ranked_context` under
  ``config.filco.ranked_sentences`` / ``ranked_empty``); the scores of every candidate are
  appended to ``out_path`` (resumable; the rule is applied on reading them)."""
  from recomp_jax.reader import Reader  # pylint: disable=import-outside-toplevel
  k = config.candidates.top_docs
  model = functools.cache(lambda: Reader(model_dir, score_batch_size=config.reader.score_batch_size))

  sentences = {e.id: filco.passage_sentences(e.ctxs[:k]) for e in examples}

  def rank(part):
    scores = filco.ranked_filter(model(), filter_inputs(config, model().tokenizer, part),
                                 [sentences[e.id] for e in part])
    return [{'loglik': s} for s in scores]

  records = map_resumable(out_path, examples, rank, chunk=64, desc='filter model, ranked')
  return {e.id: filco.ranked_context(records[e.id]['loglik'], sentences[e.id],
                                     keep=config.filco.ranked_sentences, allow_empty=config.filco.ranked_empty)
          for e in examples}


def psg_predictions(config, model_dir: str, examples: Sequence[Example], out_path: str) -> dict[str, list[bool]]:
  """The PSG model's greedy keep/drop answer for every passage of every example (resumable):
  ``filco.psg_decision='generate'``."""
  from recomp_jax.reader import Reader  # pylint: disable=import-outside-toplevel
  k = config.candidates.top_docs
  model = functools.cache(lambda: Reader(model_dir, generate_batch_size=config.filter.generate_batch_size,
                                         max_new_tokens=2))

  def decide(part):
    texts = iter(model().answer([filco.passage_prompt(e.question, p) for e in part for p in e.ctxs[:k]]))
    return [{'keep': [next(texts).lower().startswith(filco.KEEP_WORD.strip()) for _ in e.ctxs[:k]]}
            for e in part]

  records = map_resumable(out_path, examples, decide, chunk=64, desc='passage filter')
  return {i: r['keep'] for i, r in records.items()}


def psg_margins(config, model_dir: str, examples: Sequence[Example], out_path: str) -> dict[str, list[float]]:
  """``log p(' yes' ⊕ EOS | passage prompt) - log p(' no' ⊕ EOS | passage prompt)`` under the PSG
  model, ``[top_docs]`` per example (resumable; each prompt is encoded once for both answers)."""
  from recomp_jax.reader import Reader  # pylint: disable=import-outside-toplevel
  k = config.candidates.top_docs
  model = functools.cache(lambda: Reader(model_dir, score_batch_size=config.reader.score_batch_size))

  def score(part):
    texts = [filco.passage_prompt(e.question, p) for e in part for p in e.ctxs[:k]]
    logliks = iter(model().output_loglik_per_prompt(texts, [[filco.KEEP_WORD, filco.DROP_WORD]] * len(texts)))
    out = []
    for e in part:
      out.append({'margin': [float(yes - no) for yes, no in (next(logliks) for _ in e.ctxs[:k])]})
    return out

  records = map_resumable(out_path, examples, score, chunk=64, desc='passage filter, log-odds')
  return {i: r['margin'] for i, r in records.items()}


def psg_decisions(config, ctx: Context, model_dir: str, examples: Sequence[Example], directory: str,
                  seed: int) -> dict[str, list[bool]]:
  """The PSG baseline's keep/drop per passage of the test ``examples`` (``filco.psg_decision``).

  * ``'dev_threshold'`` (default): the PSG model's log-odds of " yes" over " no"
    (:func:`psg_margins`), kept at or above the threshold with the best F1 against the dev
    split's silver labels (:func:`recomp_jax.compressors.filco.keep_threshold`). The paper does not say how PSG decides; a classifier
    fine-tuned where few passages hold the output (top-5 on NQ: 20%) learns the prior and
    answers " no" to every passage, which the threshold corrects.
  * ``'generate'``: the model's greedy answer (:func:`psg_predictions`), the literal reading.

  Writes ``psg_threshold_seed<seed>.json`` (the threshold and its dev F1) in ``directory``.
  """
  if config.filco.psg_decision == 'generate':
    return psg_predictions(config, model_dir, examples, os.path.join(directory, f'psg_seed{seed}.jsonl'))
  dev = ctx.examples('dev')
  dev_silver = load_silver(ctx.stage_dir('silver'), 'dev')
  dev_margins = psg_margins(config, model_dir, dev, os.path.join(directory, f'psg_dev_seed{seed}.jsonl'))
  k = config.candidates.top_docs
  flat = [(m, keep) for e in dev for m, keep in zip(dev_margins[e.id], dev_silver[e.id]['psg_keep'][:k])]
  threshold, dev_f1 = filco.keep_threshold([m for m, _ in flat], [keep for _, keep in flat])
  psg_margins(config, model_dir, examples, os.path.join(directory, f'psg_seed{seed}.jsonl'))
  with open(os.path.join(directory, f'psg_threshold_seed{seed}.json'), 'w', encoding='utf-8') as f:
    json.dump({'threshold': threshold, 'dev_f1': dev_f1, 'dev_passages': len(flat),
               'dev_positive': sum(keep for _, keep in flat),
               'dev_kept': sum(m >= threshold for m, _ in flat)}, f, indent=2)
  keep, _ = load_psg_keep(directory, seed)
  return {e.id: keep[e.id] for e in examples}


def load_psg_keep(directory: str, seed: int) -> tuple[dict[str, list[bool]], dict | None]:
  """The PSG keep/drop per passage that :func:`psg_decisions` stored in ``directory`` for ``seed``.

  Returns ``({id: [top_docs] keep}, chosen)``: with ``'dev_threshold'`` a passage is kept when its
  stored margin is at or above the stored threshold and ``chosen`` is the threshold file's record;
  with ``'generate'`` the stored greedy answers and ``None``. ``({}, None)`` when nothing is stored.
  """
  path = os.path.join(directory, f'psg_seed{seed}.jsonl')
  if not os.path.exists(path):
    return {}, None
  records = [r for _, r in iter_jsonl(path)]
  if not records or 'margin' not in records[0]:  # 'generate' stores the answers' keep
    return {r['id']: r['keep'] for r in records}, None
  chosen = read_json(os.path.join(directory, f'psg_threshold_seed{seed}.json'))
  return {r['id']: [m >= chosen['threshold'] for m in r['margin']] for r in records}, chosen


def psg_decision_counts(config, ctx: Context, directory: str, seeds: Sequence[int]) -> list[dict]:
  """Per seed, the PSG decisions on the test passages (read from the evaluate stage's
  ``directory``) counted against their silver keep labels."""
  silver = load_silver(ctx.stage_dir('silver'), 'test')
  k = config.candidates.top_docs
  out = []
  for seed in seeds:
    keep, chosen = load_psg_keep(directory, seed)
    if not keep:
      continue
    decided = [(d, label) for i, decisions in keep.items()
               for d, label in zip(decisions, silver[i]['psg_keep'][:k])]
    out.append({'seed': seed, 'decision': config.filco.psg_decision,
                'threshold': None if chosen is None else chosen['threshold'],
                'dev_f1': None if chosen is None else chosen['dev_f1'], 'passages': len(decided),
                'kept': sum(d for d, _ in decided), 'true_positive': sum(d and label for d, label in decided),
                'positive': sum(label for _, label in decided)})
  return out


def psg_decision_table(decisions: Sequence[dict]) -> list[dict]:
  """The extra table of :func:`psg_decision_counts` (``[]`` when no PSG row ran)."""
  table_rows = []
  for d in decisions:
    n, kept, true_pos, positive = d['passages'], d['kept'], d['true_positive'], d['positive']
    threshold = '-' if d['threshold'] is None else f"{d['threshold']:.3f}"
    dev_f1 = '-' if d['dev_f1'] is None else f"{100.0 * d['dev_f1']:.1f}"
    table_rows.append([f"psg@{d['seed']}", d['decision'], threshold, dev_f1, n,
                       f'{100.0 * positive / max(n, 1):.1f}', f'{100.0 * kept / max(n, 1):.1f}',
                       f'{100.0 * true_pos / kept:.1f}' if kept else '-',
                       f'{100.0 * true_pos / positive:.1f}' if positive else '-'])
  if not table_rows:
    return []
  return [{'title': 'PSG passage decisions on the test passages against their silver keep labels '
                    '(dev_threshold: the log-odds of " yes" over " no" against the threshold with the '
                    'best F1 on dev; generate: the greedy answer)',
           'header': ['row', 'decision', 'threshold', 'dev F1 (%)', 'test passages', 'silver keep (%)',
                      'kept (%)', 'precision (%)', 'recall (%)'],
           'rows': table_rows}]


def generator_reader(config, model_dir: str):
  """A fine-tuned generator as a :class:`recomp_jax.reader.Reader` (greedy, cut at a newline)."""
  from recomp_jax.reader import Reader  # pylint: disable=import-outside-toplevel
  r = config.reader
  return Reader(model_dir, score_batch_size=r.score_batch_size, generate_batch_size=r.generate_batch_size,
                max_new_tokens=r.max_new_tokens)


# ----------------------------------------------------------------------------- the system


class FilcoSystem(System):
  """FILCO (silver contexts -> filter model -> generator trained on filtered context) on the runner."""

  name = 'filco'
  row_keys = ROW_KEYS
  fields = FIELDS
  compared_rows = ('trained', 'ranked')
  code = ('recomp_jax.compressors.filco', 'recomp_jax.pipelines.filco')

  def validate(self, config) -> None:  # types, choices and minimums: FIELDS (recomp_jax.config_fields)
    wanted_rows(config)
    if not shared.trains(config):
      raise shared.PipelineError('FILCO trains its filter model and generators: set train.epochs or train.num_steps')

  def stages(self, ctx: Context) -> Handoff:
    from recomp_jax.training.finetune import finetune_inputs  # pylint: disable=import-outside-toplevel
    config, runner = ctx.config, ctx.runner
    cfg = config.to_dict()
    # lexical_against joins the fingerprint only when set, so earlier runs keep theirs.
    silver_inputs = {'filco': {k: v for k, v in cfg['filco'].items() if k not in EVALUATION_ONLY + ('psg_epochs',)
                               and (k != 'lexical_against' or v != 'output')},
                     'top_docs': config.candidates.top_docs}
    if config.filco.measure == 'cxmi':
      silver_inputs.update(shared.reader_inputs(config))
    ctx.summaries['silver'] = runner.run('silver', silver_inputs, lambda d: stage_silver(config, ctx, d),
                                         deps=('retrieve',), code=SILVER_CODE, resumable=True)
    keys = wanted_rows(config)
    jobs = []  # FILCO's own models and FULL first: the comparison the method stands on
    if {'trained', 'ranked', 'filtered_reader'} & set(keys):
      jobs.append('filter')
    if 'full' in keys:
      jobs.append('generator_full')
    if {'trained', 'ranked', 'silver'} & set(keys):
      jobs.append('generator_filco')
    if 'psg' in keys:
      jobs += ['psg', 'generator_psg']
    model_dirs: dict[tuple[str, int], str] = {}  # (model, seed) -> its exported model
    names = []
    for seed in config.train.seeds:
      for what in jobs:
        train_fields, model_fields = finetune_inputs(config, 'generator' if what.startswith('generator_') else 'filter')
        model_fields['epochs'] = training_section(config, what).epochs
        name = f'{what}_seed{seed}'
        inputs = {'train': train_fields, 'model': model_fields, 'mesh': cfg['mesh'], 'seed': seed,
                  'top_docs': config.candidates.top_docs}
        ctx.summaries[name] = runner.run(name, inputs,
                                         lambda d, what=what, seed=seed: stage_finetune(config, ctx, what, seed, d),
                                         deps=('silver',) if reads_silver(what) else ('retrieve',),
                                         code=TRAIN_CODE, resumable=True)
        model_dirs[(what, seed)] = os.path.join(ctx.stage_dir(name), 'model_best')
        names.append(name)
    return Handoff(('silver',) + tuple(names), {'model_dirs': model_dirs})

  def evaluation_inputs(self, ctx: Context) -> dict:
    cfg = ctx.config.to_dict()
    return {'filter_generation': {k: cfg['filter'][k] for k in ('max_new_tokens', 'max_source_length')},
            'ranked': {k: cfg['filco'][k] for k in ('ranked_sentences', 'ranked_empty')},
            'psg_decision': cfg['filco']['psg_decision']}

  def rows(self, ctx: Context, examples: Sequence[Example], directory: str) -> list[Row]:
    config = ctx.config
    keys = wanted_rows(config)
    k = config.candidates.top_docs
    silver = load_silver(ctx.stage_dir('silver'), 'test')
    plan = rows_lib.shared_rows(keys, examples)
    dirs = ctx.outputs['model_dirs']
    gen = filco.generator_prompt

    def filtered(texts):  # what the generator reads of each filtered context (the released code's fallback)
      return [filco.filtered_context(t, e.ctxs[:k], config.filco.variant) for t, e in zip(texts, examples)]
    for seed in config.train.seeds:
      def reader_of(kind, seed=seed):
        return lambda: generator_reader(config, dirs[(f'generator_{kind}', seed)])

      def predicted(seed=seed):
        return filter_predictions(config, dirs[('filter', seed)], examples,
                                  os.path.join(directory, f'filter_seed{seed}.jsonl'))
      if 'full' in keys:
        plan.append(Row(f'full@{seed}', 'full', lambda: [prompts.format_documents(e.ctxs[:k]) for e in examples],
                        reader=reader_of('full'), prompt=gen))
      if 'psg' in keys:
        def psg_evidence(seed=seed):
          keep = psg_decisions(config, ctx, dirs[('psg', seed)], examples, directory, seed)
          return [kept_passages(e.ctxs[:k], keep[e.id]) for e in examples]
        plan.append(Row(f'psg@{seed}', 'psg', psg_evidence, reader=reader_of('psg'), prompt=gen))
      if 'trained' in keys:
        plan.append(Row(f'trained@{seed}', 'trained', lambda predicted=predicted: filtered([
            predicted()[e.id] for e in examples]), reader=reader_of('filco'), prompt=gen))
      if 'ranked' in keys:
        def ranked(seed=seed):
          chosen = filter_ranked(config, dirs[('filter', seed)], examples,
                                 os.path.join(directory, f'filter_ranked_seed{seed}.jsonl'))
          return filtered([chosen[e.id] for e in examples])
        plan.append(Row(f'ranked@{seed}', 'ranked', ranked, reader=reader_of('filco'), prompt=gen))
      if 'silver' in keys:
        plan.append(Row(f'silver@{seed}', 'silver', lambda: filtered([silver[e.id]['silver'] for e in examples]),
                        reader=reader_of('filco'), prompt=gen))
      if 'filtered_reader' in keys:
        plan.append(Row(f'filtered_reader@{seed}', 'filtered_reader',
                        lambda predicted=predicted: filtered([predicted()[e.id] for e in examples])))
    return plan + shared.truncation_rows(config, keys, examples, ctx.resources.reader)

  def row_name(self, key: str, config) -> str:
    return rows_lib.SHARED_ROW_NAMES.get(key) or ROW_NAMES[key]

  def trained_questions(self, ctx: Context) -> int:
    return int(ctx.summaries.get('silver', {}).get('train', {}).get('n', 0))

  def extra_tables(self, ctx: Context, records: dict[str, dict]) -> list[dict]:
    """Table 3: precision of the canonical output in each row's context, and % empty contexts."""
    silver = load_silver(ctx.stage_dir('silver'), 'test')
    table_rows = []
    for row_id in rows_lib.table_order(records, ROW_KEYS):
      r = records[row_id]
      precision = [filco.unigram_precision(ev or '', silver[i]['output']) for i, ev in zip(r['ids'], r['evidence'])
                   if silver[i]['output']]
      table_rows.append([row_id, f"{100.0 * float(np.mean([not ev for ev in r['evidence']])):.1f}",
                         f'{100.0 * float(np.mean(precision)):.1f}' if precision else '-', f"{r['tokens']:.1f}"])
    return [{'title': 'FILCO contexts (test): % empty, precision of the canonical output in the context '
                      '(Table 3: output words / context words) and context tokens',
             'header': ['row', '% empty context', 'output precision (%)', 'context tokens'],
             'rows': table_rows}] + psg_decision_table(ctx.summaries['evaluate'].get('psg_decisions', []))

  def evaluation_summary(self, ctx: Context, examples: Sequence[Example], directory: str) -> dict:
    return {'psg_decisions': psg_decision_counts(ctx.config, ctx, directory, ctx.config.train.seeds)}

  def export(self, ctx: Context, directory: str) -> dict | None:
    filters = sorted(seed for what, seed in ctx.outputs['model_dirs'] if what == 'filter')
    if not filters:
      return None
    f = ctx.config.filter
    return filco.export_spec(ctx.outputs['model_dirs'][('filter', filters[0])], top_docs=ctx.config.candidates.top_docs,
                             max_source_length=f.max_source_length, max_new_tokens=f.max_new_tokens,
                             batch_size=f.generate_batch_size)

  def notes(self, config, summaries: dict) -> list[str]:
    s = summaries.get('silver', {})
    notes = [f"Silver contexts: measure {config.filco.measure} ({config.filco.variant} variant), top "
             f"{config.candidates.top_docs} passage(s); empty silver context per split: " + ', '.join(
                 f"{split} {s[split]['empty_silver']}/{s[split]['n']}" for split in SPLITS if split in s) + '.']
    notes.append('Generators read ``context\\n\\nquestion\\nAnswer:`` (the reader protocol without its '
                 'few-shot block); the zero-shot rows use the full protocol prompt.')
    return notes

  def results_fields(self, config, summaries: dict) -> dict:
    s = summaries.get('silver', {})
    return {'silver': {split: s[split] for split in SPLITS if split in s},
            'filco': config.to_dict()['filco']}


# ----------------------------------------------------------------------------- config

def default_config() -> ml_collections.ConfigDict:
  """FILCO's setting (§4.1): the top-1 passage, 3 epochs, learning rate 5e-5, batch 32,
  inputs up to 1024 tokens, filtered context up to 512, greedy decoding."""
  c = defaults.config_for('filco', FIELDS)
  c.candidates.top_docs = 1  # 1: the paper's main setting; 5: its Table 5
  c.train.batch_size = 32
  c.train.learning_rate = 5e-5
  c.train.warmup_steps = 0
  return c


def paper_models(c) -> None:
  """The paper's filter model and generator: FLAN-T5-XL over the top-1 passage."""
  c.candidates.top_docs = 1
  c.filter.model = c.generator.model = 'google/flan-t5-xl'
  c.filter.pack = c.generator.pack = False  # T5 rows hold one pair each


def shared_sizes(c) -> None:
  """The ``:shared`` presets' rows and fine-tunes, sized for one session on 2 CPU cores
  (docs/results/filco.md has the runs behind these sizes)."""
  c.data.max_train = 400
  c.filter.epochs = 3.0
  c.eval.rows = ('none', 'top1', 'full', 'psg', 'trained', 'ranked', 'silver', 'filtered_reader')
  c.filter.max_source_length = 320
  c.filter.max_target_length = 64
  c.filter.max_new_tokens = 64
  c.generator.max_source_length = 256
  c.generator.max_target_length = 16
  c.train.epochs = 1.0
  c.train.batch_size = 16
  c.train.warmup_steps = 10
  c.train.eval_every = 25
  c.train.checkpoint_every = 25


def demo_sizes(c, demo: bool) -> None:
  """The ``:demo`` presets' sizes (minutes on a fresh machine), or ``:ci``'s (tiny, for tests)."""
  c.filter.max_source_length = 256 if demo else 160
  c.filter.max_target_length = 48 if demo else 24
  c.filter.max_new_tokens = 48 if demo else 12
  c.generator.max_source_length = 256 if demo else 160
  c.generator.max_target_length = 16 if demo else 8
  c.train.batch_size = 8 if demo else 4
  c.train.epochs = 2.0 if demo else 0.0
  c.train.num_steps = 0 if demo else 1
  c.train.warmup_steps = 2 if demo else 0
  c.train.eval_every = 10 if demo else 1
  c.train.checkpoint_every = 10 if demo else 1
  c.train.log_every = 5 if demo else 1
  c.train.eval_qa_examples = 16 if demo else 2


__all__ = ['FilcoSystem', 'demo_sizes', 'paper_models', 'shared_sizes', 'PSG_DECISIONS', 'ROW_KEYS', 'filter_pairs', 'filter_predictions', 'filter_ranked',
           'generator_pairs', 'load_psg_keep', 'psg_decision_counts', 'psg_decisions', 'psg_margins', 'psg_pairs',
           'psg_predictions', 'stage_finetune', 'stage_silver']
