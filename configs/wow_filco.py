"""FILCO on Wizard of Wikipedia (KILT): the next dialogue turn, scored by unigram F1.

Silver contexts by CXMI (§4; §5's Table 4 prefers LEXICAL: --config.filco.measure=lexical)
-> filter model -> generator trained on filtered context.

Presets (``--config=configs/wow_filco.py:PRESET``):
  paper:  ``facebook/kilt_tasks`` (wow) from the hub, train / validation (KILT hides its test
          outputs), dense retrieval over --config.retrieval.corpus_path (KILT's Wikipedia
          passages), FLAN-T5-XL filter model and generator, top-1 passage.

Local KILT files (with retrieved passages in ``ctxs``, as FILCO's processed data has) read
with --config.data.source=jsonl --config.data.train_path=... --config.data.eval_path=...
(the 'kilt' flavour of ``recomp_jax.data.formats``). No offline preset: no copy of the
KILT data ships here.
"""

from recomp_jax.pipelines import defaults
from recomp_jax.pipelines.filco import default_config, paper_models


def get_config(preset: str = 'paper'):
  c = default_config()
  c.preset = preset
  c.workdir = f'workdirs/wow_filco_{preset}'
  c.filco.measure = 'cxmi'  # §4's main-table choice; Table 4 (§5) ranks LEXICAL first for WoW
  if preset == 'paper':
    defaults.dataset_data(c, 'wow', 'paper')
    paper_models(c)
    c.generator.max_target_length = c.generator.max_new_tokens = 64  # a dialogue turn
  else:
    raise ValueError(f'unknown preset {preset!r} for wow: its KILT data is on the hub only, '
                     'so only the paper preset exists')
  return c
