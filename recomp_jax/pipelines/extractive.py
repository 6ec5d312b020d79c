"""RECOMP extractive on the shared runner: label -> pairs -> train stages and the sentence rows.

The method (reader labels, pair selection, contrastive and listwise losses, ranking) is
:mod:`recomp_jax.compressors.extractive`; this module wires it into cached stages after the
shared head (:mod:`recomp_jax.pipelines.shared`) and names the rows the runner evaluates:

* ``label``: the reader's log-likelihood of the gold answer after each candidate sentence
  (RECOMP Fig. 2), plus exact match (Fig. 6) with ``label.signal='em'``; resumable per question;
* ``pairs``: the positive and hard negatives per training question (Table 5's filtering);
* ``train_<objective>_seed<seed>``: the encoder fine-tuned per seed, the best dev reranker kept;
* rows: the shared ones (none, top-1, top-5, lead, gold) and random / BM25 / off-the-shelf /
  trained / threshold sentences, BoW, heuristic NE, the LL and EM oracles.

Candidates (RECOMP §3.1, A.1): training labels and pairs use the first
``candidates.max_candidates`` (20) sentences of the top ``candidates.top_docs`` (5)
documents; at inference the compressor ranks every sentence of those documents
(``candidates.max_candidates_eval = 0``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Callable, Sequence

import numpy as np
from absl import logging

from recomp_jax import sharding
from recomp_jax.compressors import extractive
from recomp_jax.config_fields import Field
from recomp_jax.compressors.base import Context, Handoff, System
from recomp_jax.data import formats
from recomp_jax.data.schema import Example, FilterReport
from recomp_jax.evaluation import rows as rows_lib
from recomp_jax.evaluation.probe import QaProbe, probe_examples
from recomp_jax.evaluation.rows import Row
from recomp_jax.pipelines import defaults, encoder_training, shared
from recomp_jax.pipelines.shared import Resources
from recomp_jax.stages import map_resumable, read_records
from recomp_jax.reader import prompts

# Modules whose source a stage's output depends on (stage fingerprints include their hash).
LABEL_CODE = shared.READER_CODE + ('recomp_jax.compressors.extractive',)
TRAIN_CODE = ('recomp_jax.compressors.extractive', 'recomp_jax.training', 'recomp_jax.models',
              'recomp_jax.pretrained', 'recomp_jax.sharding', 'recomp_jax.pipelines.encoder_training')

# The extractive system's config section (the shared one is recomp_jax.pipelines.defaults): the
# training fields it shares with the language-modelling compressor, then its own.
FIELDS = (
    Field('label.signal', 'loglik', "the reader's label of a candidate: log-likelihood of the gold answer "
          '(Fig. 2) or exact match (Fig. 6)', choices=('loglik', 'em')),
) + encoder_training.FIELDS + (
    Field('train.compare_objective', '', 'also train this objective (row trained_compare), compared on dev',
          choices=('',) + encoder_training.OBJECTIVES),
    Field('train.compare_seeds', (0,), 'seeds of the compared objective', element=int),
    Field('eval.oracle', True, 'evaluate the log-likelihood and EM oracle rows'),
    Field('eval.oracle_em_max_candidates', 0, 'EM oracle: candidates tried per question (0 = all)', minimum=0),
    # Provence-style, beyond the paper.
    Field('eval.threshold', True, 'row trained_threshold: every sentence whose score clears a threshold '
          'tuned for reader EM on dev'),
    Field('eval.threshold_max_sentences', 3, 'trained_threshold: at most this many sentences', minimum=1),
    defaults.TOP_K_SENTENCES,
)


def default_config():
  """The extractive system's config at its defaults (configs/*_extractive.py set the presets)."""
  return defaults.config_for('extractive', FIELDS)


# ----------------------------------------------------------------------------- rows

ROW_KEYS = ('none', 'top1', 'top5', 'lead', 'random_sentence', 'bm25_sentence',
            'offtheshelf_sentence', 'bow', 'ne_capitalised', 'trained', 'trained_threshold',
            'trained_compare', 'truncation', 'oracle_ll', 'oracle_em', 'gold')
_TRAINED_ROWS = ('trained', 'trained_threshold', 'trained_compare')


def row_name(key: str, k: int = 1, objective: str = 'contrastive', compare: str = '') -> str:
  """Display name of an evaluation row (``k`` selected sentences for the sentence rows)."""
  sentences = 'sentence' if k == 1 else f'{k} sentences'
  if key.startswith('trained_') and key not in _TRAINED_ROWS:  # trained_<objective>
    return f'RECOMP extractive, {key[len("trained_"):]} objective, top {sentences}'
  if key in rows_lib.SHARED_ROW_NAMES:
    return rows_lib.SHARED_ROW_NAMES[key]
  return {
      'random_sentence': f'random {sentences}',
      'bm25_sentence': f'BM25 top {sentences}',
      'offtheshelf_sentence': f'off-the-shelf encoder top {sentences}',
      'bow': 'BoW (top-5 documents)',
      'ne_capitalised': 'capitalised-span entities, heuristic NE (top-5 documents)',
      'trained': f'RECOMP extractive, trained encoder ({objective}) top {sentences}',
      'trained_threshold': f'RECOMP extractive ({objective}), sentences above a dev-tuned score threshold',
      'trained_compare': f'RECOMP extractive, {compare or "other"} objective, top {sentences}',
      'oracle_ll': f'oracle {sentences}: max log-likelihood of the first gold answer',
      'oracle_em': f'oracle {sentences}: reader correct for any gold answer (LL tie-break)',
  }[key]


def wanted_rows(config) -> list[str]:
  """Row keys to evaluate: ``config.eval.rows`` ('all' or keys), minus what the run lacks."""
  keys = shared.requested_rows(config, ROW_KEYS)
  if not shared.trains(config):
    keys = [k for k in keys if k not in _TRAINED_ROWS]
  if not config.eval.threshold:
    keys = [k for k in keys if k != 'trained_threshold']
  if not config.train.compare_objective:
    keys = [k for k in keys if k != 'trained_compare']
  if not config.eval.oracle:
    keys = [k for k in keys if not k.startswith('oracle')]
  return shared.with_truncation(keys)


def build_evidence(key: str, examples: Sequence[Example], candidates: Sequence[Sequence[str]], *,
                   k: int, seed: int = 0, rank: Callable | None = None,
                   loglik: Sequence[Sequence[float]] | None = None,
                   oracle_em_choice: Sequence[int] | None = None, threshold: float | None = None,
                   max_sentences: int = 3) -> list[str | None]:
  """Evidence text per example for one row (``None``: the row does not score that example).

  Args:
    key: a row key (:data:`ROW_KEYS`); for ``'trained'`` / ``'offtheshelf_sentence'``,
      ``rank(questions, candidates) -> per-question score arrays`` is the encoder's ranking.
    examples: the test questions with their retrieved documents (best first).
    candidates: per example, its candidate sentences (``'{title}: {sentence}'``).
    k: sentences kept by the sentence rows.
    seed: the random row's seed.
    loglik: per example, the reader's log-likelihood of each candidate (oracle rows).
    oracle_em_choice: per example, the index of the EM-oracle candidate (-1: none correct,
      then the max-log-likelihood one).
    threshold, max_sentences: ``'trained_threshold'``: keep the candidates scoring at least
      ``threshold`` (best first, at most ``max_sentences``; possibly none).
  """
  from recomp_jax.compressors import baselines  # pylint: disable=import-outside-toplevel
  from recomp_jax.retrieval.bm25 import top_sentences  # pylint: disable=import-outside-toplevel
  questions = [e.question for e in examples]
  if key in rows_lib.SHARED_ROW_KEYS:
    return rows_lib.shared_evidence(key, examples)
  if key == 'random_sentence':
    if k == 1:
      return baselines.random_sentences(candidates, seed, keys=[e.id for e in examples])
    out = []
    for e, c in zip(examples, candidates):
      entropy = int.from_bytes(hashlib.sha256(e.id.encode('utf-8')).digest()[:8], 'little')
      order = np.random.default_rng([seed, entropy]).permutation(len(c))[:k]
      out.append(prompts.format_sentences([c[j] for j in order]) if len(c) else '')
    return out
  if key == 'bm25_sentence':
    return [prompts.format_sentences(top_sentences(q, c, k)) if c else ''
            for q, c in zip(questions, candidates)]
  if key in ('offtheshelf_sentence', 'trained', 'trained_compare'):
    if rank is None:
      raise ValueError(f'row {key!r} needs an encoder ranking')
    return extractive.evidence_per_question(candidates, rank(questions, candidates), k)
  if key == 'trained_threshold':
    if rank is None or threshold is None:
      raise ValueError("row 'trained_threshold' needs an encoder ranking and a threshold")
    return [extractive.above_threshold(c, s, threshold, max_sentences) if c else ''
            for c, s in zip(candidates, rank(questions, candidates))]
  if key == 'bow':
    return [baselines.bow_compress(e.ctxs[:5]) for e in examples]
  if key == 'ne_capitalised':
    return [baselines.ne_compress(e.ctxs[:5]) for e in examples]
  if key == 'oracle_ll':
    if loglik is None:
      raise ValueError("row 'oracle_ll' needs the reader's log-likelihoods")
    return extractive.evidence_per_question(candidates, loglik, k)
  if key == 'oracle_em':
    if loglik is None or oracle_em_choice is None:
      raise ValueError("row 'oracle_em' needs log-likelihoods and the EM-oracle choices")
    out = []
    for c, ll, choice in zip(candidates, loglik, oracle_em_choice):
      if not c:
        out.append('')
        continue
      order = [j for j in np.argsort(-np.asarray(ll), kind='stable') if j != choice]
      picked = ([choice] if choice >= 0 else []) + order
      out.append(prompts.format_sentences([c[j] for j in picked[:k]]))
    return out
  raise ValueError(f'unknown row {key!r}')


def _ranker(encoder) -> Callable:
  return functools.partial(extractive.rank_candidates, encoder)


def label_split(models: Resources, examples: Sequence[Example], candidates: dict[str, list[str]],
                out_path: str, *, signal: str, questions_per_call: int) -> dict[str, dict]:
  """Reader labels for every example, appended to ``out_path`` (resumes where it stopped)."""
  def label(chunk):
    questions = [e.question for e in chunk]
    cands = [candidates[e.id] for e in chunk]
    answers = [e.answers for e in chunk]
    records = extractive.loglik_labels(models.reader, questions, cands, answers)
    if signal == 'em':
      for record, em in zip(records, extractive.em_labels(models.reader, questions, cands, answers)):
        record['em'] = em
    return records

  return map_resumable(out_path, examples, label, chunk=questions_per_call,
                       desc=f'label {os.path.basename(out_path)}')


def stage_label(config, retrieve_dir: str, cand_dir: str, models: Resources, directory: str) -> dict:
  summary = {}
  for split in ('train', 'dev'):
    examples = shared.read_examples(os.path.join(retrieve_dir, f'{split}.jsonl'))
    labels = label_split(models, examples, shared.load_candidates(cand_dir, split),
                         os.path.join(directory, f'{split}.jsonl'), signal=config.label.signal,
                         questions_per_call=config.reader.questions_per_call)
    summary[split] = len(labels)
  return summary


def stage_pairs(config, retrieve_dir: str, cand_dir: str, label_dir: str, models: Resources,
                directory: str) -> dict:
  """Positive and hard negatives per training question; filtered share reported (paper Table 5)."""
  encoder = models.encoder()
  train_length = encoder_training.train_passage_length(config, encoder)
  summary = {}
  for split in ('train', 'dev'):
    examples = shared.read_examples(os.path.join(retrieve_dir, f'{split}.jsonl'))
    candidates = shared.load_candidates(cand_dir, split)
    labels = shared.load_labels(label_dir, split)
    report = FilterReport(f'pairs/{split}')
    scores = extractive.rank_candidates(encoder, [e.question for e in examples],
                                        [candidates[e.id] for e in examples])
    written = []
    with sharding.open_on_main(os.path.join(directory, f'{split}.jsonl')) as f:
      for e, s in zip(examples, scores):
        label = labels[e.id]
        pair = extractive.select_pair(e.id, e.question, candidates[e.id], label['loglik'], s,
                                      signal=config.label.signal, em=label.get('em'),
                                      epsilon=config.label.epsilon,
                                      num_negatives=config.label.num_negatives, report=report)
        if pair is not None:
          written.append(pair)
          f.write(json.dumps(dataclasses.asdict(pair), ensure_ascii=False) + '\n')
    report.save(os.path.join(directory, f'{split}_report.json'))
    texts = [t for p in written for t in (p.positive, *p.negatives)]
    summary[split] = {**report.to_dict(),
                      'filtered_percent': 100.0 * report.total_dropped / max(report.seen, 1),
                      'train_passage_length': train_length,
                      'truncated_passages': extractive.count_truncated(encoder.tokenizer, texts, train_length),
                      'passages': len(texts)}
    logging.info('%s', report)
  return summary


def _read_pairs(path: str) -> list[extractive.TrainingPair]:
  return [extractive.TrainingPair(r['id'], r['question'], r['positive'], tuple(r['negatives']))
          for _, r in formats.iter_jsonl(path)]


def _listwise_examples(retrieve_dir: str, cand_dir: str, label_dir: str, split: str,
                       report: FilterReport) -> list[extractive.ListwiseExample]:
  examples = shared.read_examples(os.path.join(retrieve_dir, f'{split}.jsonl'))
  candidates = shared.load_candidates(cand_dir, split)
  labels = shared.load_labels(label_dir, split)
  out = []
  for e in examples:
    cands = candidates[e.id]
    if len(cands) < 2:
      report.drop('fewer_than_two_candidates', e.id)
      continue
    report.keep()
    out.append(extractive.ListwiseExample(e.id, e.question, tuple(cands), tuple(labels[e.id]['loglik'])))
  return out


def stage_train(config, seed: int, retrieve_dir: str, cand_dir: str, label_dir: str, pairs_dir: str,
                models: Resources, directory: str, objective: str = 'contrastive') -> dict:
  """Fine-tunes the encoder with ``objective`` and ``seed``; the best dev reranker is exported.

  ``'contrastive'``: the paper's pairs (positive + hard negatives, in-batch negatives);
  ``'listwise'``: KL to the reader's softmax over each question's candidates.
  """
  t = config.train
  base = models.fresh_encoder()  # trained in place: never the cached off-the-shelf one
  base.model.set_layer_execution(scan_layers=config.encoder.scan_layers, remat=config.encoder.remat)
  train_length = encoder_training.train_passage_length(config, base)
  tokenizer = encoder_training.training_tokenizer(config, base)
  if objective == 'contrastive':
    pairs = _read_pairs(os.path.join(pairs_dir, 'train.jsonl'))
    if not pairs:
      raise shared.PipelineError(f'no training pairs in {pairs_dir}/train.jsonl (see train_report.json there)')
    arrays = extractive.pair_arrays(pairs, tokenizer, num_negatives=config.label.num_negatives,
                                    max_query_length=config.encoder.max_query_length,
                                    max_passage_length=train_length)
    loss_fn = extractive.contrastive_loss_fn(temperature=t.temperature, similarity=t.similarity)
  elif objective == 'listwise':
    report = FilterReport('listwise/train')
    pairs = _listwise_examples(retrieve_dir, cand_dir, label_dir, 'train', report)
    report.save(os.path.join(directory, 'listwise_report.json'))
    if not pairs:
      raise shared.PipelineError('no training question has two or more candidates (listwise objective)')
    arrays = extractive.listwise_arrays(pairs, tokenizer, max_candidates=t.listwise_candidates,
                                        max_query_length=config.encoder.max_query_length,
                                        max_passage_length=train_length)
    loss_fn = extractive.listwise_loss_fn(temperature=t.temperature,
                                          teacher_temperature=t.teacher_temperature,
                                          similarity=t.similarity)
  else:
    raise shared.PipelineError(f"train.objective must be 'contrastive' or 'listwise', got {objective!r}")
  dev = shared.read_examples(os.path.join(retrieve_dir, 'dev.jsonl'))
  dev_candidates = shared.load_candidates(cand_dir, 'dev')
  dev_labels = shared.load_labels(label_dir, 'dev')
  dev_cands = [dev_candidates[e.id] for e in dev]
  probe = QaProbe(lambda: models.reader, probe_examples(dev, t.eval_qa_examples))

  def monitor(scores):
    if not len(probe):
      return {}
    return probe(extractive.evidence_per_question(dev_cands[:len(probe)], scores[:len(probe)],
                                                  config.eval.top_k_sentences))

  summary = encoder_training.train_encoder(config, seed, base, arrays, loss_fn, len(pairs), [e.question for e in dev], dev_cands,
                          [dev_labels[e.id]['loglik'] for e in dev], directory, monitor=monitor)
  return {'objective': objective, 'train_passage_length': train_length, **summary}


def oracle_em_choices(models: Resources, examples: Sequence[Example], candidates: dict[str, list[str]],
                      labels: dict[str, dict], out_path: str, *, max_candidates: int = 0,
                      questions_per_call: int = 64) -> dict[str, dict]:
  """:func:`recomp_jax.compressors.extractive.oracle_em_choice` per question, resumable: records
  ``{'id', 'choice' (-1: none correct), 'tried'}`` are appended to ``out_path``; ``max_candidates``
  is recorded in the results (an approximation when > 0).
  """
  def first_correct(chunk):
    return extractive.oracle_em_choice(models.reader, chunk, candidates, labels, max_candidates=max_candidates)

  return map_resumable(out_path, examples, first_correct, chunk=questions_per_call, desc='EM oracle')


def _objective_comparison(config, summaries: dict) -> dict:
  """Best dev reranking metrics per training objective, averaged over its seeds."""
  by_objective: dict[str, list[dict]] = {}
  for name, summary in summaries.items():
    if name.startswith('train_') and isinstance(summary, dict) and summary.get('best'):
      by_objective.setdefault(summary['objective'], []).append(summary)
  if len(by_objective) < 2:
    return {}
  return {o: {'seeds': [s['seed'] for s in runs],
              'top1_is_best': float(np.mean([s['best']['metrics']['top1_is_best'] for s in runs])),
              'top1_loglik': float(np.mean([s['best']['metrics']['top1_loglik'] for s in runs]))}
          for o, runs in sorted(by_objective.items())}



# ----------------------------------------------------------------------------- the system


class ExtractiveSystem(System):
  """RECOMP's extractive compressor (a dual encoder over candidate sentences) on the runner."""

  name = 'extractive'
  row_keys = ROW_KEYS
  fields = FIELDS
  code = ('recomp_jax.compressors',)

  def validate(self, config) -> None:
    wanted_rows(config)

  @staticmethod
  def _encoder_inputs(config) -> dict:
    """The encoder settings that can change ranking (layer execution only matters to training)."""
    fields = {k: v for k, v in config.to_dict()['encoder'].items() if k not in ('remat', 'scan_layers')}
    return {**fields, 'weights': shared.model_fingerprint(config.encoder.model, 'encoder')}

  def stages(self, ctx: Context) -> Handoff:
    config, runner, models = ctx.config, ctx.runner, ctx.resources
    train_dirs: dict[str, dict[int, str]] = {}  # objective -> seed -> stage directory
    if not shared.trains(config):
      return Handoff((), {'train_dirs': train_dirs})
    cfg = config.to_dict()
    dirs = {n: ctx.stage_dir(n) for n in ('retrieve', 'candidates', 'label', 'pairs')}
    encoder_inputs = self._encoder_inputs(config)
    ctx.summaries['label'] = runner.run(
        'label', {**shared.reader_inputs(config), 'signal': config.label.signal},
        lambda d: stage_label(config, dirs['retrieve'], dirs['candidates'], models, d),
        deps=('candidates',), code=LABEL_CODE, resumable=True)
    ctx.summaries['pairs'] = runner.run(
        'pairs', {'label': cfg['label'], 'encoder': encoder_inputs},
        lambda d: stage_pairs(config, dirs['retrieve'], dirs['candidates'], dirs['label'], models, d),
        deps=('label',), code=TRAIN_CODE)
    runs = [(config.train.objective, seed) for seed in config.train.seeds]
    if config.train.compare_objective:
      if config.train.compare_objective == config.train.objective:
        raise shared.PipelineError('train.compare_objective must differ from train.objective')
      runs += [(config.train.compare_objective, seed) for seed in config.train.compare_seeds]
    train_fields = {k: v for k, v in cfg['train'].items()
                    if k not in ('seeds', 'objective', 'compare_objective', 'compare_seeds', 'eval_qa_examples')}
    names = []
    for objective, seed in runs:
      name = f'train_{objective}_seed{seed}'
      train_dirs.setdefault(objective, {})[seed] = ctx.stage_dir(name)
      ctx.summaries[name] = runner.run(
          name, {'train': train_fields, 'objective': objective, 'encoder': encoder_inputs,
                 'layer_execution': {'remat': config.encoder.remat, 'scan_layers': config.encoder.scan_layers},
                 'mesh': cfg['mesh'], 'seed': seed},
          lambda d, seed=seed, objective=objective: stage_train(
              config, seed, dirs['retrieve'], dirs['candidates'], dirs['label'], dirs['pairs'],
              models, d, objective=objective),
          deps=('pairs', 'label'), code=TRAIN_CODE, resumable=True)
      names.append(name)
    return Handoff(tuple(names), {'train_dirs': train_dirs})

  def evaluation_inputs(self, ctx: Context) -> dict:
    return {'encoder': self._encoder_inputs(ctx.config)}

  def rows(self, ctx: Context, examples: Sequence[Example], directory: str) -> list[Row]:
    """The evaluation plan; oracle labels, EM-oracle choices and thresholds are computed first.

    The trained compressor is evaluated once per seed (rows ``trained@{seed}``, and
    ``trained_threshold@{seed}`` / ``trained_compare@{seed}`` when enabled). The threshold
    of ``trained_threshold`` is tuned on the dev questions (uncapped candidates), never on test.
    """
    config, models = ctx.config, ctx.resources
    candidates = ctx.candidates('test')
    cands = [candidates[e.id] for e in examples]
    keys = wanted_rows(config)
    k = config.eval.top_k_sentences
    labels = None
    if any(key.startswith('oracle') for key in keys):
      labels = label_split(models, examples, candidates, os.path.join(directory, 'test_labels.jsonl'),
                           signal='loglik', questions_per_call=config.reader.questions_per_call)
    em_choice = None
    if 'oracle_em' in keys:
      choices = oracle_em_choices(models, examples, candidates, labels,
                                  os.path.join(directory, 'oracle_em.jsonl'),
                                  max_candidates=config.eval.oracle_em_max_candidates)
      em_choice = [choices[e.id]['choice'] for e in examples]
    loglik = None if labels is None else [labels[e.id]['loglik'] for e in examples]
    train_dirs = ctx.outputs['train_dirs']
    main_dirs = train_dirs.get(config.train.objective, {})
    compare_dirs = train_dirs.get(config.train.compare_objective, {}) if config.train.compare_objective else {}

    def trained_ranker(d):
      return lambda: _ranker(models.encoder(os.path.join(d, 'encoder_best')))

    thresholds = {}
    if 'trained_threshold' in keys:
      dev = ctx.examples('dev')
      dev_candidates = ctx.candidates('dev_all')
      dev_cands = [dev_candidates[e.id] for e in dev]
      for seed, d in sorted(main_dirs.items()):
        path = os.path.join(directory, f'threshold_seed{seed}.json')
        if not sharding.broadcast_from_main(os.path.exists(path)):  # tuning is a collective
          tuned = extractive.tune_threshold(models.reader, dev, dev_cands, trained_ranker(d)()([e.question for e in dev], dev_cands),
                                 max_sentences=config.eval.threshold_max_sentences)
          with sharding.open_on_main(path + '.tmp') as f:
            json.dump(tuned, f, indent=2)
          if sharding.is_main_process():
            os.replace(path + '.tmp', path)
          thresholds[seed] = json.loads(json.dumps(tuned))  # as a resumed run reads it
        else:
          thresholds[seed] = formats.read_json(path)

    def row(row_id, key, make_rank=lambda: None, threshold=None):
      return Row(row_id, key, lambda: build_evidence(
          key, examples, cands, k=k, seed=config.seed, rank=make_rank(), loglik=loglik,
          oracle_em_choice=em_choice, threshold=threshold,
          max_sentences=config.eval.threshold_max_sentences))

    plan = []
    for key in keys:
      if key == 'trained':
        plan += [row(f'trained@{seed}', key, trained_ranker(d)) for seed, d in sorted(main_dirs.items())]
      elif key == 'trained_threshold':
        plan += [row(f'trained_threshold@{seed}', key, trained_ranker(d), thresholds[seed]['threshold'])
                 for seed, d in sorted(main_dirs.items())]
      elif key == 'trained_compare':
        plan += [row(f'trained_compare@{seed}', key, trained_ranker(d)) for seed, d in sorted(compare_dirs.items())]
      elif key == 'offtheshelf_sentence':
        plan.append(row(key, key, lambda: _ranker(models.encoder())))
      elif key != rows_lib.TRUNCATION:
        plan.append(row(key, key))
    return plan + shared.truncation_rows(config, keys, examples, models.reader)

  def evaluation_summary(self, ctx: Context, examples: Sequence[Example], directory: str) -> dict:
    """The dev-tuned thresholds and the EM oracle's reach, from the files :meth:`rows` wrote."""
    candidates = ctx.candidates('test')
    counts = [len(candidates[e.id]) for e in examples]
    thresholds = {}
    for seed in sorted(ctx.outputs['train_dirs'].get(ctx.config.train.objective, {})):
      path = os.path.join(directory, f'threshold_seed{seed}.json')
      if os.path.exists(path):
        thresholds[str(seed)] = formats.read_json(path)
    summary = {'thresholds': thresholds, 'test_candidates_mean': float(np.mean(counts)) if counts else 0.0}
    oracle_em = os.path.join(directory, 'oracle_em.jsonl')
    if 'oracle_em' in wanted_rows(ctx.config) and os.path.exists(oracle_em):
      choices = read_records(oracle_em)
      summary['oracle_em_found_percent'] = 100.0 * float(np.mean([choices[e.id]['choice'] >= 0 for e in examples]))
      summary['oracle_em_max_candidates'] = int(ctx.config.eval.oracle_em_max_candidates)
    return summary

  def export(self, ctx: Context, directory: str) -> dict | None:
    dirs = ctx.outputs['train_dirs'].get(ctx.config.train.objective, {})
    if not dirs:
      return None
    config, enc = ctx.config, ctx.config.encoder
    return extractive.export_spec(os.path.join(dirs[min(dirs)], 'encoder_best'), k=config.eval.top_k_sentences,
                                  top_docs=config.candidates.top_docs,
                                  max_candidates=config.candidates.max_candidates_eval, pooling=enc.pooling,
                                  normalize=bool(enc.normalize), max_length=enc.max_passage_length)

  def row_name(self, key: str, config) -> str:
    return row_name(key, config.eval.top_k_sentences, objective=config.train.objective,
                    compare=config.train.compare_objective)

  def output_key(self, key: str, config) -> str:
    return f'trained_{config.train.compare_objective}' if key == 'trained_compare' else key

  def trained_questions(self, ctx: Context) -> int:
    return int(ctx.summaries.get('data', {}).get('train', 0)) if shared.trains(ctx.config) else 0

  def notes(self, config, summaries: dict) -> list[str]:
    notes = []
    comparison = _objective_comparison(config, summaries)
    if comparison:
      notes.append('Objectives on dev (reader-best candidate ranked first, mean over seeds; never eval): '
                   + '; '.join(f"{o}: top-1 = reader's best {100 * c['top1_is_best']:.1f}%, "
                               f"top-1 log-likelihood {c['top1_loglik']:.3f} ({len(c['seeds'])} seeds)"
                               for o, c in comparison.items())
                   + f'. Dev winner: {max(comparison, key=lambda o: comparison[o][config.train.select_metric])}.')
    for seed, t in sorted(summaries.get('evaluate', {}).get('thresholds', {}).items()):
      best = next(r for r in t['table'] if r['threshold'] == t['threshold'])
      notes.append(f'Threshold row, seed {seed}: threshold {t["threshold"]:.3f} (dev quantile {best["quantile"]}) '
                   f'chosen on dev (dev EM {best["em"]:.1f}, {best["empty_percent"]:.0f}% of dev questions '
                   'get no evidence).')
    return notes

  def results_fields(self, config, summaries: dict) -> dict:
    return {'objective_comparison': _objective_comparison(config, summaries)}
