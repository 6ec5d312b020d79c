"""FILCO's contexts on the dev split of a finished run: which rule the ranked row should use.

    python scripts/filco_dev_contexts.py --workdir=workdirs/nq_filco_shared [--config=configs/nq_filco.py:shared]

Reads the run's trained filter model, FILCO and FULL generators (their stages must be done)
and, on the *dev* questions only (the held-out eval is never used to choose a rule), prints
per context: the FILCO generator's EM / F1, the share of contexts holding a gold answer and
the context tokens; the FULL generator on the whole passages is the reference. Contexts:
silver (made with the gold answer), the filter model's free decoding (the paper), and the
ranked rule (:func:`recomp_jax.compressors.filco.ranked_context`) for 1-3 sentences, with and
without the empty context competing. The ranked scores are cached in the work directory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True)
  parser.add_argument('--config', default='configs/nq_filco.py:shared')
  parser.add_argument('--seed', type=int, default=0)
  args = parser.parse_args(argv)

  from recomp_jax.compressors import filco
  from recomp_jax.evaluation import qa_metrics
  from recomp_jax.main import _load_config_file  # the entry point's loader: path[:preset], clear errors
  from recomp_jax.pipelines import filco as pipeline
  from recomp_jax.pipelines import shared
  from recomp_jax.reader import Reader, prompts

  config = _load_config_file(os.path.join(REPO, args.config))
  stages = os.path.join(args.workdir, 'stages')
  needed = [f'{name}_seed{args.seed}' for name in ('filter', 'generator_filco', 'generator_full')]
  missing = [n for n in needed if not os.path.exists(os.path.join(stages, n, 'DONE.json'))]
  if missing:
    raise SystemExit(f'{args.workdir}: stages not finished: {", ".join(missing)}')
  examples = shared.read_examples(os.path.join(stages, 'retrieve', 'dev.jsonl'))
  silver = pipeline.load_silver(os.path.join(stages, 'silver'), 'dev')
  k = config.candidates.top_docs
  sentences = [filco.passage_sentences(e.ctxs[:k]) for e in examples]
  answers = [e.answers for e in examples]

  cache = os.path.join(args.workdir, f'dev_filter_seed{args.seed}.json')
  if os.path.exists(cache):
    with open(cache, encoding='utf-8') as f:
      cached = json.load(f)
  else:
    model = Reader(os.path.join(stages, needed[0], 'model_best'), score_batch_size=config.reader.score_batch_size,
                   generate_batch_size=config.filter.generate_batch_size, max_new_tokens=config.filter.max_new_tokens)
    inputs = pipeline.filter_inputs(config, model.tokenizer, examples)
    cached = {'generated': model.answer(inputs),
              'loglik': filco.ranked_filter(model, inputs, sentences)}
    with open(cache, 'w', encoding='utf-8') as f:
      json.dump(cached, f)
    del model

  contexts = {'silver (gold answer used)': [silver[e.id]['silver'] for e in examples],
              'free decoding (paper)': cached['generated']}
  for keep in (1, 2, 3):
    for allow_empty in (True, False):
      name = f'ranked, {keep} sentence(s)' + (', empty competes' if allow_empty else '')
      contexts[name] = [filco.ranked_context(ll, s, keep=keep, allow_empty=allow_empty)
                        for ll, s in zip(cached['loglik'], sentences)]

  def row(reader, name, ctx):
    scores = reader.exact_match([filco.generator_prompt(e.question, c) for e, c in zip(examples, ctx)], answers)
    kept = 100 * np.mean([bool(c) and qa_metrics.has_answer(c, a) for c, a in zip(ctx, answers)])
    tokens = np.mean([reader.count_tokens(c) for c in ctx])
    return f'| {name} | {scores["em"]:.1f} | {scores["f1"]:.1f} | {kept:.1f} | {tokens:.1f} |'

  r = config.reader
  lines = []
  generator = Reader(os.path.join(stages, needed[1], 'model_best'), generate_batch_size=r.generate_batch_size,
                     max_new_tokens=r.max_new_tokens)
  lines += [row(generator, f'FILCO generator, {name}', ctx) for name, ctx in contexts.items()]
  del generator
  full = Reader(os.path.join(stages, needed[2], 'model_best'), generate_batch_size=r.generate_batch_size,
                max_new_tokens=r.max_new_tokens)
  lines.append(row(full, 'FULL generator, whole passage(s)', [prompts.format_documents(e.ctxs[:k]) for e in examples]))
  commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=REPO, capture_output=True, text=True,
                          check=False).stdout.strip()
  print(f'{len(examples)} dev questions of {args.workdir} (config {args.config}, code {commit}):\n')
  print('| context | EM | F1 | answer in context (%) | context tokens |\n|---|---|---|---|---|')
  print('\n'.join(lines))
  return 0


if __name__ == '__main__':
  sys.exit(main())
