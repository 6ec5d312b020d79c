"""RECOMP abstractive on the shared runner: teacher -> critic -> train stages and the summary rows.

The method (the critic's rules, the compressor's prompt, selective augmentation, the
faithfulness aid) is :mod:`recomp_jax.compressors.abstractive`; the teacher client is
:mod:`recomp_jax.teacher`; this module wires them into cached stages after the shared head:

* ``teacher``: Table 14's prompt per question of every split (train and dev become
  training targets, test gives the zero-shot teacher row and the A.5 oracle), sent to any
  OpenAI-compatible endpoint (``teacher.base_url``) or, with none configured, to our own
  server (``python -m recomp_jax.serve``) started on 127.0.0.1 for the stage's duration.
  Responses are cached in ``{workdir}/teacher_cache.sqlite``: a killed stage loses nothing
  and a rerun (even with changed code) pays for nothing already answered;
* ``sentence_targets`` (beyond the paper, ``critic.targets='reader_sentence'``): per train
  and dev question, the candidate sentence under which the reader gives the gold answer the
  highest log-likelihood; it replaces the teacher's summary as the critic's candidate
  target (the teacher then answers the test questions only, for its row and the oracle);
* ``critic``: Fig. 7 over the train and dev summaries with the run's reader (Table 5's
  % filtered and % empty); resumable per chunk of questions;
* ``train_seed<s>``: the compressor fine-tuned on the critic's targets (Gemma: the prompt
  masked out of the loss; T5: seq2seq), the checkpoint with the lowest dev loss exported;
* rows: no retrieval, top-1, top-5, the teacher's summaries (zero-shot), the trained
  compressor per seed, a trained extractive compressor (``eval.extractive_encoder``) and
  the A.5 oracle (the teacher summary or nothing, chosen with the gold answer).

An empty compressor output means nothing is prepended: the reader sees the no-retrieval
prompt (selective augmentation).
"""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np
from absl import logging

from recomp_jax.compressors import abstractive
from recomp_jax.compressors.abstractive import Compressor, fit_documents  # noqa: F401  (re-exported)
from recomp_jax.compressors.base import Context, Handoff, System
from recomp_jax.config_fields import Field
from recomp_jax.data.schema import Example, FilterReport
from recomp_jax.evaluation import rows as rows_lib
from recomp_jax.evaluation.probe import QaProbe, probe_examples
from recomp_jax.evaluation.rows import Row
from recomp_jax.pipelines import defaults, shared
from recomp_jax.retrieval import sentence_ranking
from recomp_jax.stages import map_resumable

TEACHER_CODE = ('recomp_jax.teacher', 'recomp_jax.compressors.abstractive')
CRITIC_CODE = shared.READER_CODE + ('recomp_jax.compressors.abstractive',)
SENTENCE_TARGET_CODE = CRITIC_CODE
TRAIN_CODE = ('recomp_jax.compressors.abstractive', 'recomp_jax.training', 'recomp_jax.models',
              'recomp_jax.pretrained', 'recomp_jax.sharding')

# The abstractive system's config section (the shared one is recomp_jax.pipelines.defaults).
FIELDS = shared.teacher_fields(api='chat') + shared.TEACHER_SAMPLING_FIELDS + (
    Field('teacher.prompt', '', "'' = Table 14's prompt of config.dataset ({query}, {docs})"),
    Field('teacher.samples', 1, 'beyond the paper: samples per question, the critic keeps the best', minimum=1),
    Field('teacher.few_shot', 0, 'training-split demonstrations prepended (base-model teachers)', minimum=0),
    defaults.TOP_K_SENTENCES,
    Field('critic.both_wrong', 'drop', "examples the reader gets wrong with the summary and without retrieval: "
          "'drop' (Fig. 7) or, beyond the paper, 'loglik' (decided by the gold answer's log-likelihood)",
          choices=abstractive.BOTH_WRONG),
    Field('critic.targets', 'teacher', "what the critic judges: 'teacher' summaries (the paper) or, beyond the "
          "paper, 'reader_sentence' (the candidate sentence with the gold answer's highest log-likelihood; the "
          'teacher then summarises the test questions only)', choices=abstractive.TARGET_SOURCES),
) + shared.compressor_fields(
    model_help="'' = Gemma 3 270M from PyPI (decoder-only, prompt masked from the loss); a T5 directory or hub "
    "id trains the paper's seq2seq compressor", max_source_length=1024, max_target_length=128, max_new_tokens=128,
    target_help='summary tokens', selective=True) + (
    Field('eval.extractive_encoder', '', "an exported trained encoder (an extractive run's .../encoder_best) for "
          "the row 'extractive' ('' = no such row)"),
)

ROW_KEYS = ('none', 'top1', 'top5', 'teacher', 'trained', 'truncation', 'extractive', 'oracle')
ROW_NAMES = {
    'teacher': 'teacher summaries, zero-shot (same prompt)',
    'trained': 'RECOMP abstractive, trained compressor',
    'extractive': 'RECOMP extractive, trained encoder top sentence(s)',
    'oracle': 'oracle: teacher summary or nothing, chosen with the gold answer (A.5)',
}
TARGET_NAMES = {'teacher': "teacher summaries, the paper's targets",
                'reader_sentence': "the reader's best sentences as targets, beyond the paper"}
SPLITS = ('train', 'dev', 'test')


def teacher_splits(config) -> tuple[str, ...]:
  """The splits the teacher summarises: all three; with the reader's best sentences as training
  targets (``critic.targets='reader_sentence'``) only test, for the rows that read its summaries
  (teacher, A.5 oracle), and none when ``eval.rows`` asks for neither."""
  if config.critic.targets == 'teacher':
    return SPLITS
  return ('test',) if {'teacher', 'oracle'} & set(wanted_rows(config)) else ()


def wanted_rows(config) -> list[str]:
  """Row keys to evaluate: ``config.eval.rows`` ('all' or keys), minus what the run lacks."""
  keys = shared.requested_rows(config, ROW_KEYS)
  if not shared.trains(config):
    keys = [k for k in keys if k != 'trained']
  if not config.eval.extractive_encoder:
    keys = [k for k in keys if k != 'extractive']
  return shared.with_truncation(keys)


# ----------------------------------------------------------------------------- teacher


def teacher_template(config) -> str:
  """The teacher prompt: ``teacher.prompt`` or Table 14's for ``config.dataset``."""
  from recomp_jax.teacher import TEACHER_PROMPTS  # pylint: disable=import-outside-toplevel
  if config.teacher.prompt:
    return config.teacher.prompt
  if config.dataset not in TEACHER_PROMPTS:
    raise shared.PipelineError(f'no Table 14 prompt for dataset {config.dataset!r}; set teacher.prompt')
  return TEACHER_PROMPTS[config.dataset]


def answer_sentences(example: Example, top_docs: int, limit: int = 2) -> list[str]:
  """Up to ``limit`` sentences of the top documents that contain a gold answer (best document first)."""
  from recomp_jax.data.sentences import split_sentences  # pylint: disable=import-outside-toplevel
  from recomp_jax.evaluation.qa_metrics import has_answer  # pylint: disable=import-outside-toplevel
  out = []
  for passage in example.ctxs[:top_docs]:
    for sentence in split_sentences(passage.text):
      if has_answer(sentence, example.answers):
        out.append(sentence)
        if len(out) == limit:
          return out
  return out


def few_shot_block(template: str, train: Sequence[Example], k: int, *, seed: int,
                   demo_docs: int = 2) -> tuple[str, list[str]]:
  """``k`` demonstrations for a base-model teacher, from the training split only.

  A demonstration is the teacher prompt over a training question's top ``demo_docs``
  documents followed by a silver summary: the (up to two) sentences of those documents
  that contain a gold answer. Questions are visited in a seeded order and those without
  such a sentence are skipped. Returns ``(text to prepend, the demonstration ids)``.
  """
  from recomp_jax.teacher import render_prompt  # pylint: disable=import-outside-toplevel
  if k <= 0:
    return '', []
  order = np.random.default_rng(seed).permutation(len(train))
  parts, ids = [], []
  for j in order:
    e = train[int(j)]
    sentences = answer_sentences(e, demo_docs)
    if not sentences:
      continue
    docs = abstractive.documents_text(e.ctxs[:demo_docs])
    parts.append(f"{render_prompt(template, e.question, docs)} {' '.join(sentences)}\n\n")
    ids.append(e.id)
    if len(ids) == k:
      break
  return ''.join(parts), ids


def stage_teacher(config, ctx: Context, directory: str) -> dict:
  """Teacher summaries (``teacher.samples`` per question) of every split -> ``{split}.jsonl``.

  Each record is ``{'id', 'samples': [text or null], 'errors': [kind or null]}``; a failed
  request (error, refusal, empty completion) is a null sample, counted in the summary.
  """
  from recomp_jax.teacher import ResponseCache, Teacher, render_prompt  # pylint: disable=import-outside-toplevel
  t = config.teacher
  template = teacher_template(config)
  splits = {s: ctx.examples(s) for s in teacher_splits(config)}
  prefix, demo_ids = few_shot_block(template, ctx.examples('train'), t.few_shot, seed=config.seed)
  k = config.candidates.top_docs
  prompts_by_split = {s: [prefix + render_prompt(template, e.question, abstractive.documents_text(e.ctxs[:k]))
                          for e in examples] for s, examples in splits.items()}
  sampling = shared.teacher_sampling(config)
  cache_path = os.path.join(ctx.runner.workdir, 'teacher_cache.sqlite')
  cache = ResponseCache(cache_path)
  missing = sum(cache.count_missing(shared.teacher_model_name(config), template, ps, sampling, t.samples)
                for ps in prompts_by_split.values())
  cache.close()
  server_args = (f'--max-queue={max(64, 4 * t.concurrency)}', '--batch-window-ms=50')
  with shared.teacher_endpoint(config, directory, start=bool(missing), server_args=server_args) as endpoint:
    prices = (t.price_input_per_million or None, t.price_output_per_million or None)
    teacher = Teacher(endpoint.model, base_url=endpoint.base_url, api_key_env=endpoint.api_key_env,
                      cache_path=cache_path, api=t.api, sampling=sampling, concurrency=t.concurrency,
                      max_retries=t.max_retries, timeout_s=t.timeout_s, prices=prices)
    summary = {'model': endpoint.model, 'local_server': endpoint.local, 'api': t.api, 'template': template,
               'few_shot_ids': demo_ids, 'uncached_at_start': int(missing), 'splits': {}}
    for split, examples in splits.items():
      completions = teacher.complete_all(template, prompts_by_split[split], samples=t.samples,
                                         desc=f'teacher {split}')
      failures: dict[str, int] = {}
      with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
        for e, samples in zip(examples, completions):
          for c in samples:
            if c.failure_kind:
              failures[c.failure_kind] = failures.get(c.failure_kind, 0) + 1
          f.write(json.dumps({'id': e.id, 'samples': [c.text for c in samples],
                              'errors': [c.error for c in samples]}, ensure_ascii=False) + '\n')
      summary['splits'][split] = {'questions': len(examples), 'requests': len(examples) * t.samples,
                                  'failed': sum(failures.values()), 'failures': failures}
    summary['accounting'] = teacher.report()
  return summary


def load_teacher(directory: str, split: str) -> dict[str, list[str | None]]:
  """The teacher stage's summary samples of ``split`` by question id (see :func:`shared.load_labels`)."""
  return {i: r['samples'] for i, r in shared.load_labels(directory, split).items()}


# ----------------------------------------------------------------------------- reader sentences


def stage_sentence_targets(config, ctx: Context, directory: str) -> dict:
  """Beyond the paper: the reader's best candidate sentence per train and dev question ->
  ``{split}.jsonl`` in the teacher stage's record format (``samples``: the sentence, or
  None for a question without candidates, which the critic then drops), with its scores
  (:func:`recomp_jax.compressors.abstractive.reader_best_sentences`)."""
  from recomp_jax.evaluation.qa_metrics import has_answer  # pylint: disable=import-outside-toplevel
  summary = {}
  for split in ('train', 'dev'):
    examples, candidates = ctx.examples(split), ctx.candidates(split)

    def choose(part):
      best = abstractive.reader_best_sentences(ctx.resources.reader, [e.question for e in part],
                                               [candidates.get(e.id, []) for e in part], [e.answers for e in part])
      return [{'samples': [b['sentence']], 'errors': [None if b['sentence'] else 'no_candidate'], **b}
              for b in best]

    records = map_resumable(os.path.join(directory, f'{split}.jsonl'), examples, choose,
                            chunk=config.reader.questions_per_call, desc=f'reader sentences {split}')
    chosen = [(e, records[e.id]) for e in examples if records[e.id]['sentence']]
    summary[split] = {
        'questions': len(examples), 'without_candidates': len(examples) - len(chosen),
        'answer_in_sentence_percent': 100.0 * float(np.mean([has_answer(r['sentence'], e.answers)
                                                             for e, r in chosen])) if chosen else 0.0,
        'above_no_retrieval_percent': 100.0 * float(np.mean([r['loglik'] >= r['none_loglik']
                                                             for _, r in chosen])) if chosen else 0.0}
    logging.info('reader sentences %s: %s', split, summary[split])
  return summary


# ----------------------------------------------------------------------------- critic


def critic_split(reader, examples: Sequence[Example], samples: dict[str, list[str | None]], out_path: str,
                 report: FilterReport, *, chunk: int = 64, both_wrong: str = 'drop') -> dict[str, dict]:
  """Fig. 7 targets for ``examples`` appended to ``out_path`` (resumes where it stopped);
  ``both_wrong`` as :func:`recomp_jax.compressors.abstractive.critic_qa`."""
  def critic(part):
    targets = abstractive.critic_qa(reader, [e.question for e in part], [e.answers for e in part],
                                    [samples[e.id] for e in part], ids=[e.id for e in part],
                                    report=FilterReport('chunk'), both_wrong=both_wrong)
    return [{'decision': t.decision, 'text': t.text, 'sample': t.sample, 'summary_em': t.summary_em,
             'none_em': t.none_em, 'teacher_failed': t.sample < 0} for t in targets]

  records = map_resumable(out_path, examples, critic, chunk=chunk, desc=f'critic {os.path.basename(out_path)}')
  for e in examples:  # the report covers resumed records too
    r = records[e.id]
    if r['decision'] == abstractive.FILTERED:
      report.drop('teacher_failed' if r['teacher_failed'] else 'both_wrong', e.id)
    else:
      report.keep()
  return records


def _targets(records: dict[str, dict]) -> list[abstractive.Target]:
  return [abstractive.Target(r['decision'], r['text'], r['sample'], r['summary_em'], r['none_em'])
          for r in records.values()]


def stage_critic(config, ctx: Context, samples_dir: str, directory: str) -> dict:
  """Fig. 7 over the candidate targets in ``samples_dir`` (the teacher stage's, or the
  ``sentence_targets`` stage's)."""
  summary = {}
  for split in ('train', 'dev'):
    report = FilterReport(f'critic/{split}')
    records = critic_split(ctx.resources.reader, ctx.examples(split), load_teacher(samples_dir, split),
                           os.path.join(directory, f'{split}.jsonl'), report,
                           both_wrong=config.critic.both_wrong)
    report.save(os.path.join(directory, f'{split}_report.json'))
    summary[split] = {**abstractive.table5(_targets(records)), 'report': report.to_dict()}
    logging.info('critic %s: %s', split, summary[split])
  return summary


def load_critic(directory: str, split: str) -> dict[str, dict]:
  """The critic stage's records of ``split`` by question id (see :func:`shared.load_labels`)."""
  return shared.load_labels(directory, split)


# ----------------------------------------------------------------------------- compressor


def train_compressor(config, model, tokenizer, train: list[tuple[str, str]], dev: list[tuple[str, str]],
                     *, seed: int, directory: str, export) -> tuple[dict, object]:
  """:func:`recomp_jax.training.finetune.finetune` of the compressor (``config.compressor``)."""
  from recomp_jax.training import finetune  # pylint: disable=import-outside-toplevel
  return finetune.finetune(config, config.compressor, model, tokenizer, train, dev, seed=seed,
                           directory=directory, export=export)


def compressor_pairs(tokenizer, examples: Sequence[Example], critic: dict[str, dict], *, top_docs: int,
                     budget: int) -> tuple[list[tuple[str, str]], int]:
  """``(prompt, target)`` per kept example (an empty target for ``'empty'``) and the number of
  prompts whose documents were cut to ``budget`` tokens."""
  pairs, cut = [], 0
  for e in examples:
    r = critic.get(e.id)
    if r is None or r['decision'] == abstractive.FILTERED:
      continue
    prompt, truncated = fit_documents(tokenizer, e.question, e.ctxs[:top_docs], budget)
    cut += truncated
    pairs.append((prompt, r['text'] if r['decision'] == abstractive.KEEP else ''))
  return pairs, cut


def stage_train(config, ctx: Context, critic_dir: str, seed: int, directory: str) -> dict:
  """Fine-tunes ``compressor.model`` on the critic's train targets; exports the best to ``compressor_best``."""
  from recomp_jax.training import finetune  # pylint: disable=import-outside-toplevel
  cut, empty = {}, {}

  def pairs(tokenizer):
    out = {}
    for split in ('train', 'dev'):
      out[split], cut[split] = compressor_pairs(tokenizer, ctx.examples(split), load_critic(critic_dir, split),
                                                top_docs=config.candidates.top_docs,
                                                budget=config.compressor.max_source_length)
    if not out['train']:
      raise shared.PipelineError(f'the critic kept no training example (see {critic_dir}/train_report.json)')
    empty['train'] = sum(not y for _, y in out['train'])
    return out['train'], out['dev']

  summary = finetune.finetune_pretrained(config, config.compressor, pairs, seed=seed, directory=directory,
                                         best_name='compressor_best', probe=lambda tok: training_probe(config, ctx, tok))
  return {**summary, 'documents_cut': cut, 'empty_targets': empty['train']}


def training_probe(config, ctx: Context, tokenizer):
  """The reader-EM monitor of the compressor's training (:mod:`recomp_jax.evaluation.probe`): the
  run's reader reads the current compressor's summaries of the first dev questions (an empty
  summary is the no-evidence prompt, as in the ``trained`` row). None when switched off."""
  examples = probe_examples(ctx.examples('dev'), config.train.eval_qa_examples)
  if not examples:
    return None
  c, k = config.compressor, config.candidates.top_docs
  qa = QaProbe(lambda: ctx.resources.reader, examples)

  def compressor_probe(model):
    compressor = Compressor(model, tokenizer, max_source_length=c.max_source_length,
                            max_new_tokens=c.max_new_tokens, batch_size=c.generate_batch_size,
                            empty_threshold=c.empty_threshold)
    return qa(compressor.compress([e.question for e in examples], [e.ctxs[:k] for e in examples]))
  return compressor_probe


def compress_split(compressor: Compressor, examples: Sequence[Example], top_docs: int, out_path: str,
                   *, chunk: int = 32) -> dict[str, str]:
  """The compressor's summary of every example, appended to ``out_path`` (resumable)."""
  def summarise(part):
    texts = compressor.compress([e.question for e in part], [e.ctxs[:top_docs] for e in part])
    return [{'summary': text} for text in texts]

  records = map_resumable(out_path, examples, summarise, chunk=chunk, desc='compress')
  return {i: r['summary'] for i, r in records.items()}


# ----------------------------------------------------------------------------- the system


class AbstractiveSystem(System):
  """RECOMP's abstractive compressor (teacher summaries -> critic -> fine-tuned LM) on the runner."""

  name = 'abstractive'
  row_keys = ROW_KEYS
  fields = FIELDS
  code = ('recomp_jax.compressors', 'recomp_jax.pipelines.abstractive')

  def validate(self, config) -> None:  # types, choices and minimums: FIELDS (recomp_jax.config_fields)
    wanted_rows(config)
    if config.compressor.empty_threshold >= 1.0:
      raise shared.PipelineError('compressor.empty_threshold must be in [0, 1) (0 = plain greedy), '
                                 f'got {config.compressor.empty_threshold!r}')
    teacher_template(config)

  def _teacher_inputs(self, config) -> dict:
    t = config.to_dict()['teacher']
    inputs = {k: v for k, v in t.items() if k not in ('concurrency', 'max_retries', 'timeout_s',
                                                      'server_max_batch', 'api_key_env')}
    if not config.teacher.base_url:
      inputs['served_weights'] = shared.model_fingerprint(config.teacher.model, 'reader')
    inputs['template'] = teacher_template(config)
    inputs['top_docs'] = config.candidates.top_docs
    if config.critic.targets != 'teacher':  # the paper's splits keep the fingerprint of earlier runs
      inputs['splits'] = list(teacher_splits(config))
    return inputs

  def stages(self, ctx: Context) -> Handoff:
    config, runner = ctx.config, ctx.runner
    train_dirs: dict[int, str] = {}
    teacher = ('teacher',) if teacher_splits(config) else ()
    if teacher:
      ctx.summaries['teacher'] = runner.run('teacher', self._teacher_inputs(config),
                                            lambda d: stage_teacher(config, ctx, d),
                                            deps=('retrieve',), code=TEACHER_CODE,
                                            collective=False)  # one process calls the teacher
    if not shared.trains(config):
      return Handoff(teacher, {'train_dirs': train_dirs})
    source = 'teacher'
    critic_inputs = shared.reader_inputs(config)
    if config.critic.both_wrong != 'drop':  # the paper's rule keeps the fingerprint of earlier runs
      critic_inputs['both_wrong'] = config.critic.both_wrong
    if config.critic.targets == 'reader_sentence':
      source = 'sentence_targets'
      critic_inputs['targets'] = config.critic.targets
      sentence_inputs = {**shared.reader_inputs(config), 'chunk': config.reader.questions_per_call}
      ctx.summaries[source] = runner.run(source, sentence_inputs,
                                         lambda d: stage_sentence_targets(config, ctx, d),
                                         deps=('candidates',), code=SENTENCE_TARGET_CODE, resumable=True)
    samples_dir = ctx.stage_dir(source)
    ctx.summaries['critic'] = runner.run('critic', critic_inputs,
                                         lambda d: stage_critic(config, ctx, samples_dir, d),
                                         deps=(source,), code=CRITIC_CODE, resumable=True)
    cfg = config.to_dict()
    from recomp_jax.training.finetune import finetune_inputs  # pylint: disable=import-outside-toplevel
    train_fields, compressor_fields = finetune_inputs(config, 'compressor')
    names = []
    for seed in config.train.seeds:
      name = f'train_seed{seed}'
      train_dirs[seed] = ctx.stage_dir(name)
      ctx.summaries[name] = runner.run(
          name, {'train': train_fields, 'compressor': compressor_fields, 'mesh': cfg['mesh'], 'seed': seed,
                 'top_docs': config.candidates.top_docs},
          lambda d, seed=seed: stage_train(config, ctx, ctx.stage_dir('critic'), seed, d),
          deps=('critic',), code=TRAIN_CODE, resumable=True)
      names.append(name)
    deps = teacher + (('sentence_targets',) if source != 'teacher' else ()) + ('critic',) + tuple(names)
    return Handoff(deps, {'train_dirs': train_dirs})

  def evaluation_inputs(self, ctx: Context) -> dict:
    c = ctx.config.compressor
    inputs = {'compressor_generation': {'max_new_tokens': c.max_new_tokens,
                                        'max_source_length': c.max_source_length}}
    if c.empty_threshold:  # plain greedy keeps the fingerprint of earlier runs
      inputs['compressor_generation']['empty_threshold'] = c.empty_threshold
    if ctx.config.eval.extractive_encoder:
      inputs['extractive_encoder'] = shared.model_fingerprint(ctx.config.eval.extractive_encoder, 'encoder')
      inputs['encoder'] = ctx.config.to_dict()['encoder']
    return inputs

  def rows(self, ctx: Context, examples: Sequence[Example], directory: str) -> list[Row]:
    config, models = ctx.config, ctx.resources
    keys = wanted_rows(config)
    k = config.candidates.top_docs
    teacher = load_teacher(ctx.stage_dir('teacher'), 'test') if 'test' in teacher_splits(config) else None
    plan = rows_lib.shared_rows(keys, examples)
    if 'teacher' in keys:
      plan.append(Row('teacher', 'teacher', lambda: [next((s for s in teacher[e.id] if s), '') for e in examples]))
    if 'trained' in keys:
      c = config.compressor
      for seed, d in sorted(ctx.outputs['train_dirs'].items()):
        def evidence(d=d, seed=seed):
          compressor = Compressor.load(os.path.join(d, 'compressor_best'), max_source_length=c.max_source_length,
                                       max_new_tokens=c.max_new_tokens, batch_size=c.generate_batch_size,
                                       empty_threshold=c.empty_threshold)
          return [compress_split(compressor, examples, k,
                                 os.path.join(directory, f'compressed_seed{seed}.jsonl'))[e.id] for e in examples]
        plan.append(Row(f'trained@{seed}', 'trained', evidence))
    if 'extractive' in keys:
      def extractive_evidence():
        candidates = ctx.candidates('test')
        cands = [candidates[e.id] for e in examples]
        encoder = models.encoder(config.eval.extractive_encoder)
        return sentence_ranking.compress(encoder, [e.question for e in examples], cands, config.eval.top_k_sentences)
      plan.append(Row('extractive', 'extractive', extractive_evidence))
    if 'oracle' in keys:
      def oracle_evidence():
        oracle = self._oracle(models.reader, examples, teacher, os.path.join(directory, 'oracle.jsonl'))
        return [oracle[e.id]['summary'] if oracle[e.id]['use_summary'] else '' for e in examples]
      plan.append(Row('oracle', 'oracle', oracle_evidence))
    return plan + shared.truncation_rows(config, keys, examples, models.reader)

  @staticmethod
  def _oracle(reader, examples: Sequence[Example], teacher: dict, path: str) -> dict[str, dict]:
    """A.5's oracle per test question (gold answers used: this row is an upper bound)."""
    def choose(part):
      targets = abstractive.critic_qa(reader, [e.question for e in part], [e.answers for e in part],
                                      [teacher[e.id] for e in part], ids=[e.id for e in part])
      records = []
      for e, target in zip(part, targets):
        summary = teacher[e.id][target.sample] if target.sample >= 0 else ''
        use = bool(summary) and abstractive.oracle_choice(target.summary_em, target.none_em)
        records.append({'summary': summary, 'use_summary': use,
                        'summary_em': target.summary_em, 'none_em': target.none_em})
      return records

    return map_resumable(path, examples, choose, chunk=64, desc='A.5 oracle')

  def export(self, ctx: Context, directory: str) -> dict | None:
    dirs = ctx.outputs['train_dirs']
    if not dirs:
      return None
    c = ctx.config.compressor
    return abstractive.export_spec(os.path.join(dirs[min(dirs)], 'compressor_best'),
                                   top_docs=ctx.config.candidates.top_docs, max_source_length=c.max_source_length,
                                   max_new_tokens=c.max_new_tokens, empty_threshold=c.empty_threshold,
                                   batch_size=c.generate_batch_size)

  def row_name(self, key: str, config) -> str:
    name = rows_lib.SHARED_ROW_NAMES.get(key) or ROW_NAMES[key]
    if key == 'trained':  # the row says what the compressor was distilled from
      name += ' (' + TARGET_NAMES[config.critic.targets] + ')'
    return name

  def trained_questions(self, ctx: Context) -> int:
    critic = ctx.summaries.get('critic', {}).get('train', {})
    return int(critic.get('kept', 0))

  def extra_tables(self, ctx: Context, records: dict[str, dict]) -> list[dict]:
    """% empty, selective-augmentation F1 against the oracle row (when evaluated: its empty evidence
    is A.5's "no summary") and the faithfulness aid per row."""
    k = ctx.config.candidates.top_docs
    documents = {e.id: abstractive.documents_text(e.ctxs[:k]) for e in ctx.examples('test')}
    oracle = records.get('oracle')
    oracle_empty = {i: not ev for i, ev in zip(oracle['ids'], oracle['evidence'])} if oracle else None
    table_rows = []
    for row_id in rows_lib.table_order(records, ROW_KEYS):
      r = records[row_id]
      ids, evidence = r['ids'], r['evidence']
      empty = [not (ev or '') for ev in evidence]
      cells = [row_id, f'{100.0 * float(np.mean(empty)):.1f}']
      if oracle_empty is not None and row_id.split('@')[0] in ('teacher', 'trained', 'oracle'):
        sel = abstractive.selective_augmentation_f1(empty, [oracle_empty[i] for i in ids])
        cells += [f"{sel['f1']:.2f}", f"{sel['random_f1']:.2f}"]
      else:
        cells += ['-', '-']
      faith = [abstractive.faithfulness_aid(ev, documents[i]) for i, ev in zip(ids, evidence) if ev]
      faith = [x for x in faith if x is not None]
      cells.append(f'{100.0 * float(np.mean(faith)):.1f}' if faith and row_id.split('@')[0] in
                   ('teacher', 'trained', 'oracle') else '-')
      table_rows.append(cells)
    return [{'title': 'Abstractive columns (test): empty evidence, selective augmentation against the '
                      'A.5 oracle ("empty" the positive class; random = empty at the oracle rate), and '
                      'the share of summary content words found in the top documents',
             'header': ['row', '% empty', 'selective-augmentation F1', 'random F1', 'content words in documents (%)'],
             'rows': table_rows}]

  def notes(self, config, summaries: dict) -> list[str]:
    notes = []
    teacher = summaries.get('teacher', {})
    if teacher:
      where = 'our own server (python -m recomp_jax.serve) on 127.0.0.1' if teacher.get('local_server') else 'the configured endpoint'
      notes.append(f"Teacher: {teacher.get('model')} via {where}, {teacher.get('api')} API, "
                   f"temperature {config.teacher.temperature}, top-p {config.teacher.top_p}, "
                   f"{config.teacher.samples} sample(s) per question; few-shot demonstrations from the training "
                   f"split: {len(teacher.get('few_shot_ids', []))} ({', '.join(teacher.get('few_shot_ids', [])) or 'none'}).")
      failed = {s: v['failed'] for s, v in teacher.get('splits', {}).items()}
      notes.append(f'Teacher requests that failed (never used as targets), per split: {failed}.')
    sentences = summaries.get('sentence_targets', {})
    if sentences:
      parts = []
      for split, v in sentences.items():
        part = (f"{split}: {v['answer_in_sentence_percent']:.0f}% contain a gold answer, "
                f"{v['above_no_retrieval_percent']:.0f}% score it above no retrieval")
        if v['without_candidates']:
          part += f", {v['without_candidates']} without candidates"
        parts.append(part)
      notes.append('Training targets (beyond the paper): per question, the candidate sentence of the top documents '
                   'under which the reader gives the gold answer the highest log-likelihood, judged by the critic '
                   f"in place of a teacher summary; {'; '.join(parts)}. "
                   + ('The teacher summarised the test questions only.' if teacher else
                      'The teacher did not run (no row evaluated reads its summaries).'))
    critic = summaries.get('critic', {})
    if critic:
      notes.append('Critic (Table 5): ' + '; '.join(
          f"{s}: {v['filtered_percent']:.0f}% filtered, {v['empty_percent']:.0f}% of kept targets empty ({v['kept']} kept)"
          for s, v in critic.items()) + '.')
    return notes

  def results_fields(self, config, summaries: dict) -> dict:
    out = {}
    if 'critic' in summaries:
      out['table5'] = {s: {k: v[k] for k in ('n', 'kept', 'filtered_percent', 'empty_percent')}
                       for s, v in summaries['critic'].items()}
    if 'teacher' in summaries:
      out['teacher'] = summaries['teacher'].get('accounting', {})
    return out


__all__ = ['AbstractiveSystem', 'Compressor', 'FIELDS', 'ROW_KEYS', 'default_config', 'demo_sizes', 'offline_teacher', 'paper_models', 'shared_sizes', 'compress_split', 'compressor_pairs', 'critic_split',
           'few_shot_block', 'fit_documents', 'stage_critic', 'stage_sentence_targets', 'stage_teacher', 'stage_train',
           'teacher_splits', 'train_compressor', 'wanted_rows']


# ----------------------------------------------------------------------------- config


def default_config():
  """The abstractive system at the paper's training setting (A.2: batch 16, lr 1e-5, 1000 warm-up
  steps, 3 epochs); the teacher samples at temperature 0.7, top-p 1 (§4.1)."""
  c = defaults.config_for('abstractive', FIELDS)
  c.train.batch_size = 16
  c.train.learning_rate = 1e-5
  return c


def offline_teacher(c, max_tokens: int = 64) -> None:
  """The teacher without an API: our server on the PyPI Gemma 3 270M, a *base* model with no
  chat format, so Table 14's prompt is sent as a plain completion, cut at a blank line."""
  c.teacher.base_url = ''
  c.teacher.model = ''
  c.teacher.api = 'completions'
  c.teacher.stop = ('\n\n',)
  c.teacher.max_tokens = max_tokens


def paper_models(c) -> None:
  """The paper's teacher and compressor: gpt-3.5-turbo (``$OPENAI_API_KEY``), t5-large."""
  c.teacher.base_url = 'https://api.openai.com/v1'
  c.teacher.model = 'gpt-3.5-turbo'
  c.compressor.model = 't5-large'
  c.compressor.max_source_length = 512


def shared_sizes(c) -> None:
  """The ``:shared`` presets' teacher, targets and training, sized for one session on 2 CPU cores."""
  # The 270M base teacher rarely stops by itself, so its cap is the compression rate: 48 tokens
  # is under 10% of the top-5 documents' reader tokens.
  offline_teacher(c, max_tokens=48)
  # The 270M base teacher cannot summarise, so the critic judges the reader's best candidate
  # sentence (beyond the paper); docs/results/abstractive.md has the paper's pipeline's flags.
  c.critic.targets = 'reader_sentence'
  c.data.max_train = 200
  c.compressor.max_target_length = 64
  c.compressor.max_new_tokens = 48
  c.train.epochs = 3.0
  c.train.learning_rate = 5e-5
  c.train.batch_size = 8
  c.train.warmup_steps = 5
  c.train.eval_every = 25
  c.train.checkpoint_every = 25


def demo_sizes(c, demo: bool) -> None:
  """The ``:demo`` presets' sizes (minutes on a fresh machine), or ``:ci``'s (tiny, for tests)."""
  offline_teacher(c, max_tokens=64 if demo else 24)
  c.compressor.max_source_length = 384 if demo else 192
  c.compressor.max_target_length = 64 if demo else 32
  c.compressor.max_new_tokens = 64 if demo else 16
  c.train.batch_size = 8 if demo else 4
  c.train.epochs = 2.0 if demo else 0.0
  c.train.num_steps = 0 if demo else 2
  c.train.warmup_steps = 5 if demo else 1
  c.train.eval_every = 10 if demo else 2
  c.train.checkpoint_every = 10 if demo else 2
  c.train.log_every = 5 if demo else 1
  c.train.eval_qa_examples = 16 if demo else 2
