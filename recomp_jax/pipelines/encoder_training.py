"""Fine-tuning RECOMP's dual encoder: what the QA and the language-modelling extractive compressors share.

Both tasks label candidate sentences with the reader, build contrastive (or listwise) arrays with
:mod:`recomp_jax.compressors.extractive` and fine-tune the off-the-shelf encoder the same way:
:func:`train_encoder`, the fields of :data:`FIELDS` (the section both read) and the tokenizer and
passage length of the training arrays. Neither system imports the other; both import this.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Sequence

from recomp_jax import sharding
from recomp_jax.compressors import extractive
from recomp_jax.config_fields import Field
from recomp_jax.data import formats
from recomp_jax.pipelines import shared
from recomp_jax.pretrained.demo import resolve_demo_model

OBJECTIVES = ('contrastive', 'listwise')

# The contrastive / listwise training section both extractive compressors read, with the encoder's
# training-only fields.
FIELDS = (
    # 64 tokens bounds training memory on one host; truncated passages are counted by the pairs stage.
    Field('encoder.train_max_passage_length', 64, 'training passage tokens (0 = as for ranking)', minimum=0),
    # Results are the same to float32 rounding; remat saves memory on CPU only with scan_layers
    # (models/layers.py run_layers says why).
    Field('encoder.remat', False, "training: recompute each layer's activations in the backward pass"),
    Field('encoder.scan_layers', False, 'training: one compiled layer body for all layers'),
    Field('encoder.tokenizer_backend', 'hf', "training arrays' tokenizer: 'hf' or in-graph 'tf' (the [tf] extra)",
          choices=('hf', 'tf')),
    Field('label.epsilon', 0.0, 'a hard negative scores at least epsilon below the positive', minimum=0.0),
    Field('label.num_negatives', 5, 'hard negatives per training pair', minimum=1),
    Field('train.temperature', 1.0, 'contrastive softmax temperature (MiniLM presets: 0.05)'),
    Field('train.similarity', 'dot', 'query-sentence score', choices=('dot', 'cosine')),
    Field('train.select_metric', 'top1_loglik', 'dev metric that picks the kept encoder'),
    Field('train.objective', 'contrastive', "'contrastive' (eq. 1: positive + hard negatives) or, beyond "
          "the paper, 'listwise' (KL to the reader's softmax over the candidates)", choices=OBJECTIVES),
    Field('train.listwise_candidates', 20, "listwise: candidates in a question's softmax", minimum=1),
    Field('train.teacher_temperature', 1.0, "listwise: temperature of the reader's log-likelihood softmax"),
)


def training_tokenizer(config, base):
  """The tokenizer of the training arrays: the encoder's own ('hf') or the in-graph one ('tf')."""
  backend = config.encoder.get('tokenizer_backend', 'hf')
  if backend == 'hf':
    return base.tokenizer
  if backend == 'tf':
    from recomp_jax.data import tf_input  # pylint: disable=import-outside-toplevel
    source = resolve_demo_model(config.encoder.model, 'encoder')
    if not os.path.isdir(source):  # a hub id: its files, from the local cache when offline
      from huggingface_hub import snapshot_download  # pylint: disable=import-outside-toplevel
      source = snapshot_download(source)
    return tf_input.load_tf_tokenizer(source)
  raise shared.PipelineError(f"encoder.tokenizer_backend must be 'hf' or 'tf', got {backend!r}")


def train_passage_length(config, encoder) -> int:
  """Passage tokens of the training arrays: ``encoder.train_max_passage_length`` bounded by the encoder's own."""
  return int(min(config.encoder.train_max_passage_length or encoder.max_length, encoder.max_length))


def train_encoder(config, seed: int, base, arrays: dict, loss_fn, n_examples: int, dev_queries: Sequence[str],
                  dev_cands: Sequence[Sequence[str]], dev_loglik: Sequence[Sequence[float]], directory: str, *,
                  monitor: Callable | None = None) -> dict:
  """Fine-tunes ``base`` (a fresh :class:`~recomp_jax.models.dual_encoder.Encoder`) on ``arrays``
  with ``loss_fn``; every ``train.eval_every`` steps the encoder reranks the dev candidates and the
  best by ``train.select_metric`` (:func:`~recomp_jax.compressors.extractive.reranked_accuracy`
  against the reader's dev labels) is exported to ``{directory}/encoder_best``. Shared by the QA
  and the language-modelling extractive compressors.

  Args:
    n_examples: training examples in ``arrays`` (epochs are counted in them).
    monitor: ``dev scores -> extra metrics`` logged at each evaluation (never selects).
  """
  from recomp_jax.training import loop as train_lib  # pylint: disable=import-outside-toplevel
  from recomp_jax.pretrained import Pretrained, export_pretrained  # pylint: disable=import-outside-toplevel
  from recomp_jax.models import bert  # pylint: disable=import-outside-toplevel
  from recomp_jax.models.dual_encoder import Encoder  # pylint: disable=import-outside-toplevel

  t = config.train
  batch_size = min(t.batch_size, n_examples)
  steps_per_epoch = max(n_examples // batch_size, 1)
  num_steps = t.num_steps or int(round(t.epochs * steps_per_epoch))
  iterator = train_lib.ArrayIterator(arrays, batch_size, seed=seed)
  best_dir = os.path.join(directory, 'encoder_best')
  best_file = os.path.join(directory, 'best.json')
  best = formats.read_json(best_file) if os.path.exists(best_file) else None
  base_metrics = extractive.reranked_accuracy(extractive.rank_candidates(base, dev_queries, dev_cands), dev_loglik)

  def eval_fn(model, step):
    nonlocal best
    encoder = Encoder(model, base.tokenizer, max_length=base.max_length)
    scores = extractive.rank_candidates(encoder, dev_queries, dev_cands)
    metrics = extractive.reranked_accuracy(scores, dev_loglik)
    key = t.select_metric
    # process 0's best.json decides, so every process joins the same collective export
    if sharding.broadcast_from_main(best is None or metrics[key] > best['metrics'][key]):
      best = {'step': step, 'metrics': metrics}
      tower = model.query_model
      source = resolve_demo_model(config.encoder.model, 'encoder')
      export_pretrained(Pretrained(tower, tower.config, bert.FAMILY, source), best_dir,
                        tokenizer_dir=source)
      with sharding.open_on_main(best_file) as f:
        json.dump(best, f)
    if monitor is not None:
      metrics.update(monitor(scores))
    return metrics

  train_config = {
      'num_steps': num_steps, 'seed': seed, 'log_every': t.log_every,
      'eval_every': t.eval_every, 'checkpoint_every': t.checkpoint_every,
      'keep_checkpoints': 2, 'best_metric': f'eval/{t.select_metric}', 'best_mode': 'max',
      'progress_bar': True, 'profile_steps': config.profile_steps, 'mesh': config.mesh.to_dict(),
      'optimizer': {'learning_rate': t.learning_rate, 'warmup_steps': min(t.warmup_steps, num_steps),
                    'schedule': t.schedule, 'weight_decay': t.weight_decay,
                    'clip_grad_norm': t.clip_grad_norm},
  }
  result = train_lib.train(train_config, base.model, loss_fn, iterator, eval_fn, workdir=directory)
  if result.preempted:
    raise SystemExit('preempted: checkpoint saved; rerun the same command to resume')
  return {'pairs': n_examples, 'steps': num_steps, 'batch_size': batch_size, 'seed': seed,
          'off_the_shelf_dev': base_metrics, 'best': best, 'final_metrics': result.metrics}
