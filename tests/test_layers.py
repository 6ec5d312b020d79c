"""The package's import graph: lower layers never import upward, and no module cycle exists.

Every ``import`` statement of every module counts, the ones inside functions too: a
function-level import that closes a cycle is still a cycle, only a later one.
"""

import ast
import collections
import os


PACKAGE = 'recomp_jax'
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PACKAGE)
# The library layers below the systems: they never import a system's method or pipeline.
LOWER = ('models', 'pretrained', 'data', 'retrieval', 'reader', 'training', 'evaluation')
# Package-level modules the lower layers build on (stage cache, storage, mesh, allocator, provenance).
BASE = ('stages', 'storage', 'sharding', 'allocator', 'provenance')
SYSTEM_LAYERS = ('compressors', 'pipelines')


def _modules() -> dict[str, str]:
  """``{dotted module name: file}`` of every module of the package."""
  out = {}
  for directory, _, files in os.walk(ROOT):
    for name in files:
      if name.endswith('.py'):
        path = os.path.join(directory, name)
        dotted = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, '.')
        out[dotted.removesuffix('.__init__')] = path
  return out


def import_graph() -> dict[str, set[str]]:
  """``{module: modules of the package it imports}``, anywhere in its file."""
  modules = _modules()

  def resolve(name: str) -> str | None:
    while name and name not in modules:
      name = name.rpartition('.')[0]
    return name or None

  graph = collections.defaultdict(set)
  for module, path in modules.items():
    package = module if path.endswith('__init__.py') else module.rpartition('.')[0]
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ''
        if node.level:
          parts = package.split('.')[:len(package.split('.')) - node.level + 1]
          base = '.'.join(parts + ([base] if base else []))
        names = [f'{base}.{alias.name}' for alias in node.names]
      else:
        continue
      for name in names:
        target = resolve(name) if name.split('.')[0] == PACKAGE else None
        if target and target != module:
          graph[module].add(target)
    graph.setdefault(module, set())
  return dict(graph)


def _layer(module: str) -> str:
  parts = module.split('.')
  return parts[1] if len(parts) > 1 else ''


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
  """Every import from a lower or base layer into a system layer, and from a method into a pipeline."""
  bad = []
  for module, targets in sorted(graph.items()):
    layer = _layer(module)
    for target in sorted(targets):
      to = _layer(target)
      if layer in LOWER + BASE and to in SYSTEM_LAYERS:
        bad.append(f'{module} -> {target}')
      elif layer == 'compressors' and to == 'pipelines':
        bad.append(f'{module} -> {target}')
  return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan, iterative)."""
  index, low, on_stack, stack, found = {}, {}, set(), [], []
  counter = 0
  for start in sorted(graph):
    if start in index:
      continue
    work = [(start, iter(sorted(graph[start])))]
    index[start] = low[start] = counter
    counter += 1
    stack.append(start)
    on_stack.add(start)
    while work:
      node, children = work[-1]
      child = next(children, None)
      if child is not None:
        if child not in index:
          index[child] = low[child] = counter
          counter += 1
          stack.append(child)
          on_stack.add(child)
          work.append((child, iter(sorted(graph.get(child, ())))))
        elif child in on_stack:
          low[node] = min(low[node], index[child])
        continue
      work.pop()
      if work:
        low[work[-1][0]] = min(low[work[-1][0]], low[node])
      if low[node] == index[node]:
        component = []
        while True:
          member = stack.pop()
          on_stack.discard(member)
          component.append(member)
          if member == node:
            break
        if len(component) > 1:
          found.append(sorted(component))
  return found


def test_no_lower_layer_imports_a_system_layer():
  assert upward_edges(import_graph()) == []


def test_the_package_has_no_import_cycle():
  assert cycles(import_graph()) == []


def system_of(module: str, systems: set[str]) -> str | None:
  """The system whose pipeline ``module`` is: ``pipelines.<name>`` and ``pipelines.<name>_*``."""
  if not module.startswith(f'{PACKAGE}.pipelines.'):
    return None
  leaf = module.rpartition('.')[2]
  return next((s for s in systems if leaf == s or leaf.startswith(f'{s}_')), None)


def system_edges(graph: dict[str, set[str]], systems: set[str]) -> list[str]:
  """Every import from one system's pipeline into another's: ``pipelines.<name>`` and
  ``pipelines.<name>_*`` are system ``name``'s modules; what two systems share lives in a module of
  neither (``shared``, ``defaults``, ``encoder_training``)."""
  bad = []
  for module, targets in sorted(graph.items()):
    own = system_of(module, systems)
    for target in sorted(targets):
      other = system_of(target, systems)
      if own and other and other != own:
        bad.append(f'{module} -> {target}')
  return bad


def _registered_systems() -> set[str]:
  from recomp_jax.pipelines import runner  # the registry: config.system -> its module
  return {entry.split(':')[0].rpartition('.')[2] for entry in {**runner.SYSTEMS, **runner.TASKS}.values()}


def test_no_system_imports_another():
  systems = _registered_systems()
  assert {'extractive', 'abstractive', 'filco', 'truncation', 'lm', 'kcomp', 'color'} <= systems
  assert system_edges(import_graph(), systems) == []


# RECOMP's two compressors serve its two tasks: QA (the extractive and abstractive systems) and
# language modelling (the lm task, §4.1), so the lm task reads RECOMP's method modules.
METHODS_OF = {'lm': {'extractive', 'abstractive'}}
SHARED_METHODS = {'base', 'baselines'}  # the export format and the untrained baselines


def method_edges(graph: dict[str, set[str]], systems: set[str]) -> list[str]:
  """Every import of another system's method module (``compressors.<name>``) by a system's pipeline."""
  bad = []
  for module, targets in sorted(graph.items()):
    own = system_of(module, systems)
    if own is None:
      continue
    allowed = {own} | SHARED_METHODS | METHODS_OF.get(own, set())
    for target in sorted(targets):
      if target.startswith(f'{PACKAGE}.compressors.') and target.rpartition('.')[2] not in allowed:
        bad.append(f'{module} -> {target}')
  return bad


def test_no_pipeline_reads_another_systems_method():
  systems = _registered_systems()
  assert method_edges(import_graph(), systems) == []
  assert method_edges({'recomp_jax.pipelines.filco': {'recomp_jax.compressors.extractive'},
                       'recomp_jax.pipelines.lm_extractive': {'recomp_jax.compressors.extractive'}},
                      systems) == ['recomp_jax.pipelines.filco -> recomp_jax.compressors.extractive']


def test_the_checks_catch_an_upward_edge_and_a_cycle():
  graph = {'recomp_jax.training.finetune': {'recomp_jax.pipelines.shared'},
           'recomp_jax.pipelines.shared': {'recomp_jax.pipelines.runner'},
           'recomp_jax.pipelines.runner': {'recomp_jax.pipelines.shared'},
           'recomp_jax.compressors.base': {'recomp_jax.pipelines.shared'}}
  assert upward_edges(graph) == ['recomp_jax.compressors.base -> recomp_jax.pipelines.shared',
                                 'recomp_jax.training.finetune -> recomp_jax.pipelines.shared']
  assert cycles(graph) == [['recomp_jax.pipelines.runner', 'recomp_jax.pipelines.shared']]
  graph = {'recomp_jax.pipelines.lm_extractive': {'recomp_jax.pipelines.extractive',
                                                  'recomp_jax.pipelines.lm', 'recomp_jax.pipelines.shared'}}
  assert system_edges(graph, {'lm', 'extractive'}) == [
      'recomp_jax.pipelines.lm_extractive -> recomp_jax.pipelines.extractive']


def test_the_graph_sees_imports_inside_functions():
  # the runner imports the report module only inside run()
  graph = import_graph()
  assert 'recomp_jax.evaluation.report' in graph['recomp_jax.pipelines.runner']
