"""FILCO on FEVER (KILT): claims labelled SUPPORTS / REFUTES, scored by accuracy (EM of the label).

Silver contexts by LEXICAL against the claim (§2.2: the label occurs in no passage)
-> filter model -> generator trained on filtered context.

Presets (``--config=configs/fever_filco.py:PRESET``; details in
``recomp_jax.pipelines.filco.experiment``):
  paper:  ``facebook/kilt_tasks`` (fever) from the hub, train / validation (KILT hides its test
          outputs), dense retrieval over --config.retrieval.corpus_path (KILT's Wikipedia
          passages), FLAN-T5-XL filter model and generator, top-1 passage.

Local KILT files (with retrieved passages in ``ctxs``, as FILCO's processed data has) read
with --config.data.source=jsonl --config.data.train_path=... --config.data.eval_path=...
(the 'kilt' flavour of ``recomp_jax.data.formats``). No offline preset: no copy of the
KILT data ships here.
"""

from recomp_jax.pipelines.filco import experiment


def get_config(preset: str = 'paper'):
  return experiment('fever', preset)
