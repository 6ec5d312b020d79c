"""FILCO on FEVER (KILT): claims labelled SUPPORTS / REFUTES, scored by accuracy (EM of the label).

Silver contexts by LEXICAL against the claim (§2.2: the label occurs in no passage)
-> filter model -> generator trained on filtered context.

Presets (``--config=configs/fever_filco.py:PRESET``):
  paper:  ``facebook/kilt_tasks`` (fever) from the hub, train / validation (KILT hides its test
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
  c.workdir = f'workdirs/fever_filco_{preset}'
  c.filco.measure = 'lexical'  # §4's main-table choice; Table 4 (§5) ranks CXMI first for FEVER
  c.filco.lexical_against = 'query'  # the output is a label, found in no passage
  if preset == 'paper':
    defaults.dataset_data(c, 'fever', 'paper')
    paper_models(c)
  else:
    raise ValueError(f'unknown preset {preset!r} for fever: its KILT data is on the hub only, '
                     'so only the paper preset exists')
  return c
