"""RECOMP's abstractive compressor for language modelling (§3.2, Fig. 3; A.1): its training stages.

It trains on the same windows as the LM task's extractive compressor
(:mod:`recomp_jax.pipelines.lm_extractive`'s ``train_data`` stage: ovos Wikipedia summaries, never
WikiText, each window retrieving as a test window does). Stages (run by
:func:`recomp_jax.pipelines.lm.run` when the ``abstractive`` row is requested):

1. ``abs_summaries``: the candidate summaries of every training and dev window, by
   ``critic.targets``:

   * ``'teacher'`` (the paper): Table 14's four language-modelling prompts
     (:data:`recomp_jax.teacher.LM_TEACHER_PROMPTS`) over the window's top ``candidates.top_docs``
     passages, ``{query}`` being the window's query (the ``lm.query_tokens`` tokens before it),
     sent to any OpenAI-compatible endpoint (offline: our own server, ``teacher.*``), answers
     cached in ``{workdir}/teacher_cache.sqlite``; a failed request is a null summary, counted;
   * ``'reader_sentence'`` (beyond the paper, for when no teacher can summarise): the candidate
     sentence under which the reader finds the window's continuation most likely, read from the
     ``label`` stage (no new reader call): the compressor then learns a one-sentence,
     reader-distilled summary;

2. ``abs_critic``: Fig. 3, the reader's log-likelihood of the window's continuation with each
   summary prepended (:func:`recomp_jax.evaluation.lm_metrics.score_candidates`, exactly as the
   rows are scored) and without retrieval; the best summary is the target unless it scores below
   no retrieval, when the target is the empty summary (selective augmentation). Resumable;
3. ``abs_train_seed<s>``: the compressor (``compressor.model``, Gemma 3 270M offline, the prompt
   masked from the loss) fine-tuned on ``(prompt, target)`` through the shared fine-tuning path,
   with its own optimisation settings (``compressor_train.*``: the ``train.*`` section belongs to
   the extractive encoder), the checkpoint with the lowest dev loss kept as ``compressor_best``.

The compressor's prompt is the QA system's (:data:`recomp_jax.compressors.abstractive.COMPRESSOR_PROMPT`)
with the window's query as the question: the paper's LM compressor reads the input ``x``; here ``x``
is cut to the same ``lm.query_tokens`` tokens that retrieve, which keeps prompts short.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Sequence

import numpy as np
from absl import logging

from recomp_jax.compressors import abstractive
from recomp_jax.config_fields import Field
from recomp_jax.data import formats
from recomp_jax.data.schema import Passage
from recomp_jax.evaluation import lm_metrics
from recomp_jax.pipelines import shared
from recomp_jax.pipelines.lm_extractive import SPLITS, RetrievedWindow, read_retrieved
from recomp_jax.stages import map_resumable

# The compressor's optimisation: train.* is the extractive encoder's in this task (finetune reads
# config.train, so the fine-tuning stage runs on a copy of the config with these values there).
TRAIN_FIELDS = (
    Field('compressor_train.epochs', 3.0, 'abstractive compressor: training epochs', minimum=0.0),
    Field('compressor_train.num_steps', 0, 'abstractive compressor: >0 overrides epochs', minimum=0),
    Field('compressor_train.batch_size', 16, 'abstractive compressor: global batch', minimum=1),
    Field('compressor_train.learning_rate', 1e-4, 'abstractive compressor: peak learning rate', minimum=0.0),
    Field('compressor_train.warmup_steps', 10, 'abstractive compressor: linear warm-up steps', minimum=0),
    Field('compressor_train.schedule', 'linear', 'abstractive compressor: decay after warm-up',
          choices=('linear', 'cosine', 'constant')),
    Field('compressor_train.weight_decay', 0.0, 'abstractive compressor: AdamW weight decay', minimum=0.0),
    Field('compressor_train.clip_grad_norm', 1.0, 'abstractive compressor: gradient-norm clip (0 = off)', minimum=0.0),
    Field('compressor_train.log_every', 10, 'abstractive compressor: steps between loss summaries', minimum=1),
    Field('compressor_train.eval_every', 50, 'abstractive compressor: steps between dev evaluations', minimum=1),
    Field('compressor_train.checkpoint_every', 50, 'abstractive compressor: steps between checkpoints', minimum=0),
    Field('compressor_train.seeds', (0,), 'abstractive compressor: one per seed; the row averages them', element=int),
)
CRITIC_FIELDS = (
    Field('critic.targets', 'teacher', "the abstractive compressor's candidate targets: 'teacher' (Table 14's four "
          "LM prompts, the paper) or, beyond the paper, 'reader_sentence' (the candidate sentence under which the "
          "continuation is most likely, from the label stage)", choices=abstractive.TARGET_SOURCES),
)

# The task's abstractive section: the teacher endpoint and sampling fields, the compressor's (as the QA
# system's), the critic's target source and the compressor's own optimisation.
FIELDS = shared.teacher_fields(api='chat') + shared.TEACHER_SAMPLING_FIELDS + shared.compressor_fields(
    model_help="'' = Gemma 3 270M from PyPI (decoder-only, prompt masked from the loss); a T5 directory or hub "
    "id trains the paper's seq2seq compressor", max_source_length=1024, max_target_length=128, max_new_tokens=128,
    target_help='summary tokens', selective=True) + CRITIC_FIELDS + TRAIN_FIELDS


def compressor_config(config):
  """``config`` with ``train.*`` replaced by ``compressor_train.*`` (what the fine-tuning path reads)."""
  c = copy.deepcopy(config)
  for name, value in config.compressor_train.items():
    if name != 'seeds':
      c.train[name] = value
  return c


def documents(item: RetrievedWindow, config) -> list[Passage]:
  """The passages a window's summary is written from: its top ``candidates.top_docs``."""
  return list(item.ctxs[:config.candidates.top_docs])


# ----------------------------------------------------------------------------- candidate summaries


def stage_summaries(config, data_dir: str, label_dir: str, workdir: str, directory: str) -> dict:
  """Candidate summaries of every train and dev window -> ``{split}.jsonl`` records
  ``{'id', 'samples': [text or null], 'errors': [kind or null]}`` (reader-sentence records
  also carry ``'loglik'``: the samples' scores, already computed by the label stage)."""
  summary = {'targets': config.critic.targets}
  items = {s: read_retrieved(os.path.join(data_dir, f'{s}.jsonl')) for s in SPLITS}
  if config.critic.targets == 'reader_sentence':
    for split in SPLITS:
      labels = {r['id']: r for _, r in formats.iter_jsonl(os.path.join(label_dir, f'{split}.jsonl'))}
      empty = 0
      with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
        for item in items[split]:
          r = labels[item.id]
          if r['candidates']:
            best = int(np.argmax(r['loglik']))
            record = {'samples': [r['candidates'][best]], 'errors': [None], 'loglik': [r['loglik'][best]]}
          else:
            empty += 1
            record = {'samples': [None], 'errors': ['no_candidate'], 'loglik': [None]}
          f.write(json.dumps({'id': item.id, **record}, ensure_ascii=False) + '\n')
      summary[split] = {'windows': len(items[split]), 'without_candidates': empty}
    return summary
  from recomp_jax.teacher import LM_TEACHER_PROMPTS, ResponseCache, Teacher, render_prompt  # pylint: disable=import-outside-toplevel
  t = config.teacher
  sampling = shared.teacher_sampling(config)
  cache_path = os.path.join(workdir, 'teacher_cache.sqlite')
  prompts = {(s, j): [render_prompt(template, it.window.query, abstractive.documents_text(documents(it, config)))
                      for it in items[s]]
             for s in SPLITS for j, template in enumerate(LM_TEACHER_PROMPTS)}
  cache = ResponseCache(cache_path)
  missing = sum(cache.count_missing(shared.teacher_model_name(config), LM_TEACHER_PROMPTS[j], ps, sampling)
                for (_, j), ps in prompts.items())
  cache.close()
  with shared.teacher_endpoint(config, directory, start=bool(missing)) as endpoint:
    teacher = Teacher(endpoint.model, base_url=endpoint.base_url, api_key_env=endpoint.api_key_env,
                      cache_path=cache_path, api=t.api, sampling=sampling, concurrency=t.concurrency,
                      max_retries=t.max_retries, timeout_s=t.timeout_s,
                      prices=(t.price_input_per_million or None, t.price_output_per_million or None))
    answers = {key: teacher.complete_all(LM_TEACHER_PROMPTS[key[1]], ps, samples=1,
                                         desc=f'teacher {key[0]} prompt {key[1]}')
               for key, ps in prompts.items()}
    summary['accounting'] = teacher.report()
  summary.update(model=endpoint.model, local_server=endpoint.local, uncached_at_start=int(missing))
  for split in SPLITS:
    failures: dict[str, int] = {}
    with open(os.path.join(directory, f'{split}.jsonl'), 'w', encoding='utf-8') as f:
      for i, item in enumerate(items[split]):
        completions = [answers[(split, j)][i][0] for j in range(len(LM_TEACHER_PROMPTS))]
        for c in completions:
          if c.failure_kind:
            failures[c.failure_kind] = failures.get(c.failure_kind, 0) + 1
        f.write(json.dumps({'id': item.id, 'samples': [c.text.strip() if c.text else None for c in completions],
                            'errors': [c.error for c in completions]}, ensure_ascii=False) + '\n')
    summary[split] = {'windows': len(items[split]), 'requests': len(items[split]) * len(LM_TEACHER_PROMPTS),
                      'failed': sum(failures.values()), 'failures': failures}
  return summary


# ----------------------------------------------------------------------------- critic


def stage_critic(config, reader, data_dir: str, summaries_dir: str, directory: str) -> dict:
  """Fig. 3 per train and dev window -> ``{split}.jsonl`` (``decision``, ``text``, ``sample``,
  ``summary_loglik``, ``none_loglik``); % empty and % filtered per split (Table 5)."""
  summary = {}
  max_context = config.lm.max_context_tokens
  for split in SPLITS:
    items = read_retrieved(os.path.join(data_dir, f'{split}.jsonl'))
    samples = {r['id']: r for _, r in formats.iter_jsonl(os.path.join(summaries_dir, f'{split}.jsonl'))}

    def critic(part, samples=samples):
      windows = [it.window for it in part]
      none = lm_metrics.score_windows(reader, windows, [''] * len(part), max_context_tokens=max_context).loglik
      known = [samples[it.id].get('loglik') or [None] * len(samples[it.id]['samples']) for it in part]
      todo = [[s if s and known[i][j] is None else '' for j, s in enumerate(samples[it.id]['samples'])]
              for i, it in enumerate(part)]
      need = [i for i, t in enumerate(todo) if any(todo[i])]
      if need:
        scored = lm_metrics.score_candidates(reader, [windows[i] for i in need], [todo[i] for i in need],
                                             max_context_tokens=max_context)
        for i, s in zip(need, scored):
          known[i] = [float(s.loglik[j]) if todo[i][j] else known[i][j] for j in range(len(todo[i]))]
      out = []
      for it, scores, n in zip(part, known, none):
        target = abstractive.critic_lm_scored(samples[it.id]['samples'], scores, float(n))
        out.append({'decision': target.decision, 'text': target.text, 'sample': target.sample,
                    'summary_loglik': target.summary_em, 'none_loglik': target.none_em})
      return out

    records = map_resumable(os.path.join(directory, f'{split}.jsonl'), items, critic,
                            chunk=config.reader.questions_per_call, desc=f'critic {split}')
    decisions = [r['decision'] for r in records.values()]
    n = max(len(decisions), 1)
    summary[split] = {'windows': len(decisions),
                      'empty_percent': 100.0 * decisions.count(abstractive.EMPTY) / n,
                      'filtered_percent': 100.0 * decisions.count(abstractive.FILTERED) / n,
                      'samples_chosen': {str(k): v for k, v in sorted(
                          _count(r['sample'] for r in records.values() if r['decision'] == abstractive.KEEP).items())}}
    logging.info('LM critic %s: %s', split, summary[split])
  return summary


def _count(values) -> dict:
  out: dict = {}
  for v in values:
    out[v] = out.get(v, 0) + 1
  return out


# ----------------------------------------------------------------------------- training and inference


def compressor_pairs(tokenizer, items: Sequence[RetrievedWindow], critic: dict[str, dict], config
                     ) -> tuple[list[tuple[str, str]], int]:
  """``(prompt, target)`` per window the critic kept ('' for an empty target) and how many
  prompts lost document text to ``compressor.max_source_length``."""
  pairs, cut = [], 0
  for item in items:
    r = critic.get(item.id)
    if r is None or r['decision'] == abstractive.FILTERED:
      continue
    prompt, truncated = abstractive.fit_documents(tokenizer, item.window.query, documents(item, config),
                                                  config.compressor.max_source_length)
    cut += truncated
    pairs.append((prompt, r['text'] if r['decision'] == abstractive.KEEP else ''))
  return pairs, cut


def stage_train(config, seed: int, data_dir: str, critic_dir: str, directory: str) -> dict:
  """The compressor of one seed, fine-tuned on the critic's targets; the checkpoint with the
  lowest dev loss is ``{directory}/compressor_best``."""
  from recomp_jax.training import finetune  # pylint: disable=import-outside-toplevel  (jax training stack)
  cut, empty = {}, {}

  def pairs(tokenizer):
    out = {}
    for split in SPLITS:
      critic = {r['id']: r for _, r in formats.iter_jsonl(os.path.join(critic_dir, f'{split}.jsonl'))}
      out[split], cut[split] = compressor_pairs(tokenizer, read_retrieved(os.path.join(data_dir, f'{split}.jsonl')),
                                                critic, config)
    if not out['train']:
      raise shared.PipelineError(f'the critic kept no training window (see {critic_dir})')
    empty['train'] = sum(not y for _, y in out['train'])
    return out['train'], out['dev']

  c = compressor_config(config)
  summary = finetune.finetune_pretrained(c, c.compressor, pairs, seed=seed, directory=directory,
                                         best_name='compressor_best')
  return {**summary, 'documents_cut': cut, 'empty_targets': empty['train']}


def compress_windows(compressor: abstractive.Compressor, windows, ctxs: dict[str, list[Passage]], top_docs: int,
                     out_path: str, *, chunk: int = 32) -> list[str]:
  """The compressor's summary of every window's top passages ('' = nothing prepended), appended
  to ``out_path`` as each chunk finishes (resumable)."""
  def summarise(part):
    texts = compressor.compress([w.query for w in part], [ctxs[w.id][:top_docs] for w in part])
    return [{'summary': text} for text in texts]

  records = map_resumable(out_path, windows, summarise, chunk=chunk, desc='compress windows')
  return [records[w.id]['summary'] for w in windows]


def load_compressor(config, train_dir: str) -> abstractive.Compressor:
  c = config.compressor
  return abstractive.Compressor.load(os.path.join(train_dir, 'compressor_best'), max_source_length=c.max_source_length,
                                     max_new_tokens=c.max_new_tokens, batch_size=c.generate_batch_size,
                                     empty_threshold=c.empty_threshold)


__all__ = ['CRITIC_FIELDS', 'FIELDS', 'TRAIN_FIELDS', 'compress_windows', 'compressor_config', 'compressor_pairs',
           'load_compressor', 'stage_critic', 'stage_summaries', 'stage_train']
