"""Every notebook in notebooks/ runs top to bottom on CPU at the ``ci`` size (papermill).

A cell that raises fails the test (papermill stops at the first error and names the cell);
the notebook's own assertions (results table read back, the exported Hugging Face encoder
matching our JAX encoder) therefore run here too.
"""

import json
import pathlib

import pytest

import papermill
REPO = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((REPO / 'notebooks').glob('*.ipynb'))
PARAMETERS = {
    'quickstart.ipynb': {'PRESET': 'ci', 'SHOW_TENSORBOARD': False, 'INSTALL': True},
    'abstractive.ipynb': {'PRESET': 'ci', 'INSTALL': True},
}
# What each executed notebook must have printed, and the files it must have written.
EXPECTED = {
    'quickstart.ipynb': (['trained compressor: EM', 'max |JAX - transformers|'],
                         ['results.json', 'exported_encoder/config.json']),
    'abstractive.ipynb': (['serving [\'teacher\']', 'trained compressor: EM', 'server stopped'],
                          ['results.json', 'stages/teacher/DONE.json']),
}


def test_every_notebook_has_ci_parameters():
  assert [p.name for p in NOTEBOOKS] == sorted(PARAMETERS) == sorted(EXPECTED)
  for path in NOTEBOOKS:
    cells = json.loads(path.read_text())['cells']
    tagged = [c for c in cells if 'parameters' in c.get('metadata', {}).get('tags', [])]
    assert len(tagged) == 1, path
    for name in PARAMETERS[path.name]:
      assert f'{name} = ' in ''.join(tagged[0]['source']), (path.name, name)
    assert all(not c.get('outputs') for c in cells if c['cell_type'] == 'code'), \
        f'{path.name}: commit notebooks without outputs'


# quickstart runs the extractive pipeline, like the other end_to_end tests. abstractive keeps its
# model server up beside a real Gemma 3 270M fine-tune; beside a busy worker that came within
# 1.7 GB of the 24, so it runs alone after the parallel tests.
NOTEBOOK_MARKS = {'quickstart.ipynb': [pytest.mark.end_to_end],
                  'abstractive.ipynb': [pytest.mark.alone, pytest.mark.slow]}


def _extra_parameters(name: str) -> dict:
  """quickstart's run is also the extractive pipeline's real-model test: the notebook runs the
  pipeline with that test's flags and the test's checks read its workdir (one run, both tests)."""
  if name == 'quickstart.ipynb':
    from tests.test_extractive import real_model_ci_flags
    return {'FLAGS': real_model_ci_flags()}
  return {}


def _check_workdir(name: str, workdir) -> None:
  if name == 'quickstart.ipynb':
    from tests.test_extractive import check_real_model_ci_run
    check_real_model_ci_run(workdir)


@pytest.mark.parametrize('path', [pytest.param(p, marks=NOTEBOOK_MARKS[p.name]) for p in NOTEBOOKS],
                         ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, tmp_path, monkeypatch):
  workdir = tmp_path / 'work'
  output = tmp_path / path.name
  monkeypatch.setenv('HF_HUB_OFFLINE', '1')  # the kernel inherits it: no network in CI
  papermill.execute_notebook(str(path), str(output), cwd=str(path.parent),
                             parameters={**PARAMETERS[path.name], 'WORKDIR': str(workdir),
                                         **_extra_parameters(path.name)},
                             kernel_name='python3', progress_bar=False, execution_timeout=1500)
  executed = json.loads(output.read_text())
  text = ''.join(''.join(o.get('text', '')) for c in executed['cells'] for o in c.get('outputs', []))
  printed, written = EXPECTED[path.name]
  for line in printed:
    assert line in text, (path.name, line)
  for name in written:
    assert (workdir / name).exists(), (path.name, name)
  results = json.loads((workdir / 'results.json').read_text())
  assert results['preset'] == 'ci' and {r['key'] for r in results['rows']} >= {'trained', 'top1'}
  _check_workdir(path.name, workdir)
