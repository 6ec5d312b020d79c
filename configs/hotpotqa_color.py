"""CoLoR on HotpotQA: two supporting paragraphs per query, F1@2 of long-context-LM retrieval (color.txt Table 1).

Presets (``--config=configs/hotpotqa_color.py:PRESET``); the compressors train on NQ's labels as in
``configs/nq_color.py`` and read HotpotQA's test corpora:
  shared: ``../shared/data/hotpotqa/dev500_ircot.jsonl``: its first 3 questions are the few-shot
          examples, questions 200-499 the test queries (the other HotpotQA configs train on the
          first 400 and test on the last 100; CoLoR trains on none of them). A corpus holds its
          queries' supporting paragraphs, their own distractor paragraphs and random passages of
          the NQ corpus up to ~8k tokens, 10 queries per corpus.
  ci:     a few queries (tests).

  python -m recomp_jax.main --config=configs/hotpotqa_color.py:shared
"""

import os

from recomp_jax.config_fields import load_config_file

HOTPOTQA = '../shared/data/hotpotqa/dev500_ircot.jsonl'


def get_config(preset: str = 'shared'):
  c = load_config_file(os.path.join(os.path.dirname(__file__), 'nq_color.py'), preset)  # NQ's compressors
  c.dataset = 'hotpotqa'
  c.workdir = f'workdirs/hotpotqa_color_{preset}'
  k = c.color
  k.metric = 'f1_at_2'
  k.test_path = k.shots_path = HOTPOTQA
  if preset == 'shared':
    k.skip_test, k.max_test = 200, 300
    k.queries_per_group = 10  # two gold paragraphs each: 20 queries' would fill most of the 8k tokens
  elif preset == 'ci':
    k.skip_test, k.max_test = 200, 4
    k.budget_tokens = 2048
  else:
    raise ValueError(f'unknown preset {preset!r}; available: shared, ci')
  return c
