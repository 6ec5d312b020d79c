"""One runner for every system: shared head -> the system's stages -> evaluation -> result files.

``python -m recomp_jax.main --config=configs/nq_extractive.py:PRESET`` calls :func:`run`,
which picks the system that ``config.system`` names (:data:`SYSTEMS`, imported by name as
big_vision imports its models) and drives it:

1. the head stages ``data``, ``retrieve``, ``candidates`` (:mod:`recomp_jax.pipelines.shared`);
2. the system's own cached stages (:meth:`recomp_jax.compressors.base.System.stages`);
3. ``evaluate``: the shared rows and the system's rows read by the one reader
   (:func:`recomp_jax.evaluation.rows.evaluate_rows`), resumable row by row;
4. ``results.json`` (``../shared/specs/results_schema.md``: git commit, source and data
   hashes, resolved config, rows, paired bootstrap of the trained row against every other
   row), ``predictions.jsonl`` (one line per question and row) and ``results.md``.

Every stage is cached in ``{workdir}/stages/<name>/`` (:mod:`recomp_jax.stages`):
its fingerprint covers the config fields it reads, the content hash of its input files and
the source of the modules it runs, so a changed data file, reader or prompt reruns it, and
a damaged output file is detected and recomputed. ``--config.force_stages=label,train``
reruns stages by hand.
"""

from __future__ import annotations

import importlib
import json
import os
from typing import Sequence

from recomp_jax import config_fields, sharding, storage
from recomp_jax.compressors.base import Context, System, write_export
from recomp_jax.evaluation import rows as rows_lib
from recomp_jax.pipelines import defaults, shared
from recomp_jax.stages import StageRunner, costs_table

# config.system -> 'module:class' of its System.
SYSTEMS = {
    'extractive': 'recomp_jax.pipelines.extractive:ExtractiveSystem',
    'abstractive': 'recomp_jax.pipelines.abstractive:AbstractiveSystem',
    'filco': 'recomp_jax.pipelines.filco:FilcoSystem',
    'truncation': 'recomp_jax.pipelines.truncation:TruncationSystem',
}
# config.system -> 'module:function' of a task that is not short-answer question answering (no System, no
# shared head): language modelling, and K-COMP's long-form medical QA.
TASKS = {'lm': 'recomp_jax.pipelines.lm:run', 'kcomp': 'recomp_jax.pipelines.kcomp:run',
         'color': 'recomp_jax.pipelines.color:run'}
EVAL_CODE = shared.READER_CODE + ('recomp_jax.evaluation', 'recomp_jax.retrieval', 'recomp_jax.data')


def get_system(name: str) -> System:
  """The :class:`System` that ``config.system`` names."""
  if name not in SYSTEMS:
    raise shared.PipelineError(f'config.system={name!r} is not one of {sorted(SYSTEMS) + sorted(TASKS)}')
  module_name, class_name = SYSTEMS[name].split(':')
  return getattr(importlib.import_module(module_name), class_name)()


def system_fields(name: str) -> tuple[config_fields.Field, ...]:
  """Every config field ``config.system=name`` reads: the shared section and the system's own
  (a task declares its whole set)."""
  if name in TASKS:
    return importlib.import_module(TASKS[name].split(':')[0]).FIELDS
  return defaults.SHARED_FIELDS + tuple(get_system(name).fields)


def stage_evaluate(system: System, ctx: Context, directory: str) -> dict:
  """Reader EM / F1 / tokens of every row on the test split (rows are cached as they finish)."""
  examples = ctx.examples('test')
  rows = system.rows(ctx, examples, directory)
  reader = ctx.resources.reader
  records = rows_lib.evaluate_rows(reader, examples, rows, os.path.join(directory, 'rows.jsonl'))
  summary = {'rows': {r: {f: rec[f] for f in ('n', 'em', 'f1', 'tokens', 'seconds')} for r, rec in records.items()},
             'test_questions': len(examples), **system.evaluation_summary(ctx, examples, directory)}
  cache = reader.prediction_cache
  if cache is not None:  # answers read from the cache in this process (all stages), and decoded
    summary['prediction_cache'] = {'path': cache.path, 'hits': cache.hits, 'misses': cache.misses}
  return summary


def run(config, workdir: str, *, local_workdir: str | None = None) -> dict | None:
  """Runs (or resumes) the whole pipeline of ``config.system``; writes and returns the results
  (process 0 only: :func:`write_results`).

  Args:
    config: the experiment.
    workdir: where the run's files go: a local directory, or a remote one (``gs://...``),
      which is mirrored on local disk (:mod:`recomp_jax.storage`).
    local_workdir: the local mirror of a remote ``workdir`` (default: under
      ``~/.cache/recomp_jax/workdirs``); given with a local ``workdir``, that directory is
      treated as the remote one.
  """
  config_fields.check(config, system_fields(config.system), config.system)
  if config.system in TASKS:  # not question answering: its own stages (pipelines/lm.py)
    if storage.is_remote(workdir) or local_workdir:
      raise shared.PipelineError(f'config.system={config.system!r} runs in a local workdir only')
    module_name, function_name = TASKS[config.system].split(':')
    return getattr(importlib.import_module(module_name), function_name)(config, workdir)
  system = get_system(config.system)
  system.validate(config)
  remote = None
  if storage.is_remote(workdir) or local_workdir:
    remote = workdir
    workdir = storage.mirror_root(remote, local_workdir, process_index=sharding.process_index())
    storage.register_mirror(workdir, remote)
    if sharding.is_main_process():
      storage.download_top_files(remote, workdir)
  os.makedirs(workdir, exist_ok=True)
  force = tuple(s for s in str(config.force_stages).split(',') if s)
  runner = StageRunner(workdir, force=force, remote=remote)
  ctx = Context(config, runner, shared.Resources(config, workdir))
  data_files = shared.input_files(config)
  ctx.summaries.update(shared.run_head(config, runner, ctx.resources, data_files))
  handoff = system.stages(ctx)
  ctx.outputs.update(handoff.outputs)
  deps = handoff.deps
  ctx.summaries['evaluate'] = runner.run(
      'evaluate', {**shared.reader_inputs(config), 'eval': config.to_dict()['eval'], 'seed': config.seed,
                   **system.evaluation_inputs(ctx)},
      lambda d: stage_evaluate(system, ctx, d),
      deps=('candidates',) + tuple(deps), code=EVAL_CODE + tuple(system.code), resumable=True)
  results = write_results(system, ctx, workdir, data_files)
  export_compressor(system, ctx, os.path.join(workdir, 'compressor'))
  if remote is not None and sharding.is_main_process():
    runner.push_top_files()
    storage.upload_tree(os.path.join(workdir, 'tensorboard'), storage.join(remote, 'tensorboard'))
    print(f'results uploaded to {remote}', flush=True)
  return results


def export_compressor(system: System, ctx: Context, directory: str) -> str | None:
  """Writes the run's compressor (:meth:`System.export`) as ``directory/compressor.json`` for
  :func:`recomp_jax.load_compressor` (process 0); returns its path, or None when there is none."""
  if not sharding.is_main_process():
    return None
  spec = system.export(ctx, directory)
  if spec is None:
    return None
  path = write_export(directory, spec)
  print(f'compressor: {directory} (recomp_jax.load_compressor)', flush=True)
  return path


def evaluations_table(summaries: dict) -> list[dict]:
  """An extra table of every fine-tuning stage's dev evaluations (``summary['evaluations']``,
  :func:`recomp_jax.training.finetune.finetune`): step, dev loss (token mean), token accuracy,
  the reader probe's EM / F1 where the stage has one, and which step was kept (lowest dev loss).
  ``[]`` when no stage logged any (e.g. an extractive run, or results of older code)."""
  table_rows = []
  for name, summary in summaries.items():
    if not isinstance(summary, dict) or not summary.get('evaluations'):
      continue
    best = (summary.get('best') or {}).get('step')
    for e in summary['evaluations']:
      cells = [f'{e["metrics"][key]:{spec}}' if key in e['metrics'] else '-'
               for key, spec in (('loss', '.4f'), ('accuracy', '.4f'), ('qa_em', '.1f'), ('qa_f1', '.1f'))]
      table_rows.append([name, e['step'], *cells, 'kept' if e['step'] == best else ''])
  if not table_rows:
    return []
  return [{'title': 'Fine-tuning dev evaluations (every evaluation of each stage; the kept step has the '
                    'lowest dev loss, the probe only monitors)',
           'header': ['stage', 'step', 'dev loss', 'dev token accuracy', 'probe EM', 'probe F1', 'checkpoint'],
           'rows': table_rows}]


def _recall_table(config, summaries: dict) -> list[dict]:
  retrieve = summaries.get('retrieve', {}).get('test', {})
  k = config.candidates.top_docs
  table_rows = []
  for when in ('before_rerank', 'after_rerank'):
    if when in retrieve:
      values = retrieve[when]
      table_rows.append([when.replace('_', ' '),
                         *('-' if values.get(f'{m}@{k}') is None else f"{values[f'{m}@{k}']:.1f}"
                           for m in ('answer_recall', 'supporting_recall'))])
  if not table_rows:
    return []
  return [{'title': f'Retrieval of the test questions (first {k} documents)',
           'header': ['documents', f'answer recall@{k} (%)', f'supporting-passage recall@{k} (%)'],
           'rows': table_rows}]


def write_results(system: System, ctx: Context, workdir: str, data_files: Sequence[str]) -> dict | None:
  """Writes ``results.json`` (schema of ``../shared/specs/results_schema.md``), ``predictions.jsonl``,
  ``results.md`` and the TensorBoard results (scalars and the table as text) into ``workdir``;
  returns the results dict. In a multi-process run only process 0 writes and returns them
  (the others return None): every process holds the same evaluation records."""
  from recomp_jax import provenance  # pylint: disable=import-outside-toplevel
  if not sharding.is_main_process():
    return None
  from recomp_jax.evaluation import analysis, report  # pylint: disable=import-outside-toplevel
  from recomp_jax.stages import read_records  # pylint: disable=import-outside-toplevel
  config, summaries = ctx.config, ctx.summaries
  costs = ctx.runner.costs()
  records = read_records(os.path.join(ctx.stage_dir('evaluate'), 'rows.jsonl'), key='row')
  rows, per_example = rows_lib.aggregate_rows(
      records, system.row_keys, name=lambda key: system.row_name(key, config),
      out_key=lambda key: system.output_key(key, config))
  metric = report.main_metric(config.dataset)
  seeds = sorted(int(r.split('@')[1]) for r in records if r.startswith('trained@'))
  results = {
      'system': system.name, 'dataset': config.dataset, 'preset': config.preset,
      **provenance.git_state(), 'source_hash': provenance.source_hash(),
      'data_hashes': provenance.data_hashes(data_files), 'versions': provenance.versions(),
      'config': config.to_dict(),
      'train_questions': system.trained_questions(ctx),
      'seeds': seeds, 'n': int(summaries['evaluate']['test_questions']),
      'rows': rows, 'bootstrap': rows_lib.bootstrap_rows(per_example, metric, config.seed,
                                                          system.compared_rows),
      'main_metric': metric, 'stage_seconds': dict(ctx.runner.timings), 'stage_costs': costs,
      'stages': summaries,
      'notes': system.notes(config, summaries), **system.results_fields(config, summaries),
  }
  extra = _recall_table(config, summaries)
  with open(os.path.join(workdir, 'predictions.jsonl'), 'w', encoding='utf-8') as f:
    for row_id, r in records.items():
      for i, qid in enumerate(r['ids']):
        f.write(json.dumps({'row': row_id, 'id': qid, 'prediction': r['predictions'][i],
                            'em': r['em_per_example'][i], 'f1': r['f1_per_example'][i],
                            'tokens': r['tokens_per_example'][i], 'evidence': r['evidence'][i]},
                           ensure_ascii=False) + '\n')
  extra += system.extra_tables(ctx, records)
  if 'top1' in records:  # selection vs reading failures, per question (evaluation/analysis.py)
    extra.append(analysis.extra_table(analysis.analyse(workdir, baseline='top1')))
  extra += evaluations_table(summaries)
  extra.append(costs_table(costs))
  results['extra_tables'] = extra
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2, default=str)
  text = report.render_markdown(results, source=os.path.join(workdir, 'results.json'))
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write(text)
  from recomp_jax.training.summaries import MetricWriter  # pylint: disable=import-outside-toplevel
  writer = MetricWriter(os.path.join(workdir, 'tensorboard', 'results'))
  for r in rows:
    writer.write_scalars(0, {f"results/{r['key']}/em": r['em'], f"results/{r['key']}/f1": r['f1'],
                             f"results/{r['key']}/tokens": r['tokens']})
  writer.write_text(0, {'results/table': text})
  writer.close()
  print(text, flush=True)
  print(f'results: {os.path.join(workdir, "results.json")} (table: {os.path.join(workdir, "results.md")}, '
        f'per-question: {os.path.join(workdir, "predictions.jsonl")})', flush=True)
  return results


__all__ = ['EVAL_CODE', 'SYSTEMS', 'TASKS', 'evaluations_table', 'export_compressor', 'get_system', 'run', 'stage_evaluate',
           'system_fields',
           'write_results']
