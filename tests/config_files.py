"""The repository's config files, loaded as ``--config=configs/NAME:PRESET`` loads them."""

import os

from recomp_jax.config_fields import load_config_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def preset(name: str, preset_name: str):
  """``get_config(preset_name)`` of ``configs/<name>``, e.g. ``preset('nq_filco.py', 'ci')``."""
  return load_config_file(os.path.join(REPO, 'configs', name), preset_name)
