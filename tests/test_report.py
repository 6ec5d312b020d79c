"""recomp_jax.evaluation.report: results.json validation, markdown tables, README blocks, command line."""

import copy
import json
import pathlib
import subprocess
import sys

import pytest

from recomp_jax.evaluation import ledger, report

REPO = pathlib.Path(__file__).resolve().parents[1]

TRAINED_LINE = ('| **RECOMP extractive (trained)** | **500** | **19.6 ± 0.6** | **27.7** | '
                '**41.0** | **0.076** |')


def _results(**overrides) -> dict:
  results = {
      'system': 'extractive', 'dataset': 'nq', 'preset': 'shared',
      'git_commit': '0123456789abcdef0123456789abcdef01234567', 'dirty': False,
      'source_hash': 'abc', 'data_hashes': {'train.jsonl': 'f00'}, 'versions': {'jax': '0'},
      'config': {'seed': 0}, 'train_questions': 720, 'seeds': [0, 1], 'n': 500,
      'rows': [
          {'key': 'none', 'name': 'none', 'em': 3.2, 'f1': 7.0, 'tokens': 0.0, 'n': 500},
          {'key': 'top1', 'name': 'top-1 document', 'em': 17.6, 'f1': 25.5, 'tokens': 111.0,
           'n': 500, 'recall': 61.0},
          {'key': 'top5', 'name': 'top-5 documents', 'em': 6.8, 'f1': 13.3, 'tokens': 540.0,
           'n': 500},
          # sample std of [19.2, 20.0] is 0.566 (population std would be 0.4)
          {'key': 'trained', 'name': 'RECOMP extractive (trained)', 'em': 19.6, 'f1': 27.7,
           'tokens': 41.0, 'n': 500, 'em_per_seed': [19.2, 20.0]},
      ],
      'bootstrap': [{'a': 'trained', 'b': 'top1', 'metric': 'em', 'delta': 2.0, 'lo': -1.0,
                     'hi': 5.0}],
  }
  results.update(overrides)
  return results


def _write(path: pathlib.Path, results: dict) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(results), encoding='utf-8')
  return path


# ----------------------------------------------------------------------------- load_results


def test_load_results_round_trip(tmp_path):
  path = _write(tmp_path / 'r.json', _results())
  assert report.load_results(path) == _results()


@pytest.mark.parametrize('mutate, field', [
    (lambda r: r.pop('source_hash'), 'source_hash'),
    (lambda r: r.update(dirty='no'), 'dirty'),
    (lambda r: r.update(n=500.0), 'n'),
    (lambda r: r.update(seeds=[0, 'a']), 'seeds'),
    (lambda r: r['rows'][1].pop('f1'), 'rows[1].f1'),
    (lambda r: r['rows'][0].update(tokens='many'), 'rows[0].tokens'),
    (lambda r: r['rows'][3].update(em_per_seed=[1.0, None]), 'rows[3].em_per_seed'),
    (lambda r: r['rows'][2].update(key='top1'), 'rows[2].key'),
    (lambda r: r['bootstrap'][0].pop('hi'), 'bootstrap[0].hi'),
    (lambda r: r.update(notes='one note'), 'notes'),
])
def test_load_results_names_the_bad_field(tmp_path, mutate, field):
  results = _results()
  mutate(results)
  path = _write(tmp_path / 'r.json', results)
  with pytest.raises(ValueError) as e:
    report.load_results(path)
  assert str(e.value).startswith(f'{path}: field {field!r}: ')


def test_load_results_invalid_json(tmp_path):
  path = tmp_path / 'r.json'
  path.write_text('{"system": ', encoding='utf-8')
  with pytest.raises(ValueError, match='not valid JSON'):
    report.load_results(path)


# ----------------------------------------------------------------------------- markdown


def test_render_markdown_exact_tables():
  md = report.render_markdown(_results(), source='results/nq_extractive_shared.json')
  lines = md.split('\n')
  assert lines[0] == (
      'Run: `extractive` on `nq` (preset `shared`), trained on 720 questions, seeds 0, 1 '
      '(rows with per-seed results show mean ± sample std over seeds), evaluated on 500 '
      'questions, main metric EM, code `0123456789`, results '
      '`results/nq_extractive_shared.json`.')
  table = lines[lines.index('| evidence | n | EM | F1 | evidence tokens | tokens / top-5 |'):]
  assert table[:6] == [
      '| evidence | n | EM | F1 | evidence tokens | tokens / top-5 |',
      '|---|---|---|---|---|---|',
      '| none | 500 | 3.2 | 7.0 | 0.0 | 0.000 |',
      '| top-1 document | 500 | 17.6 | 25.5 | 111.0 | 0.206 |',
      '| top-5 documents | 500 | 6.8 | 13.3 | 540.0 | 1.000 |',
      TRAINED_LINE,
  ]
  assert 'Paired bootstrap of a − b, 95% interval (EM is the main metric on `nq`):' in lines
  assert lines[-4:] == [
      '| comparison | metric | diff | 95% CI |',
      '|---|---|---|---|',
      '| RECOMP extractive (trained) − top-1 document | EM | +2.0 | [-1.0, +5.0] |',
      '',
  ]
  assert md.endswith('|\n') and not md.endswith('\n\n')
  assert 'recall' not in md and '61.0' not in md  # unknown row fields are ignored


def test_render_markdown_is_deterministic_and_sections_are_separated():
  md = report.render_markdown(_results())
  assert md == report.render_markdown(copy.deepcopy(_results()))
  assert 'results `' not in md  # no source given
  blocks = md.rstrip('\n').split('\n\n')
  assert len(blocks) == 4  # run line, rows table, bootstrap title, bootstrap table
  assert blocks[3].split('\n')[0] == '| comparison | metric | diff | 95% CI |'


def test_render_markdown_hotpotqa_dirty_no_top5_notes_and_extra_tables():
  results = _results(
      dataset='hotpotqa', dirty=True, seeds=[3], train_questions=0,
      rows=[
          {'key': 'top1', 'name': 'top-1 document', 'em': 20.0, 'f1': 30.04, 'tokens': 120.0,
           'n': 200},
          {'key': 'trained', 'name': 'trained | top-2', 'em': 21.0, 'f1': 31.25, 'tokens': 50.0,
           'n': 200, 'em_per_seed': [21.0]},
      ],
      bootstrap=[{'a': 'trained', 'b': 'top1', 'metric': 'f1', 'delta': 1.21, 'lo': 0.04,
                  'hi': 2.46},
                 {'a': 'trained', 'b': 'gold', 'metric': 'f1', 'delta': -0.04, 'lo': -3.0,
                  'hi': 1.0}],
      notes=['Reader: Gemma 3 270M.', 'Oracle rows omitted.'],
      extra_tables=[{'title': 'Retrieval recall', 'header': ['k', 'recall@k'],
                     'rows': [[1, 45.25], [5, '71.30%']]}])
  md = report.render_markdown(results)
  lines = md.split('\n')
  assert lines[0] == ('Run: `extractive` on `hotpotqa` (preset `shared`), no training questions, '
                      'seed 3, evaluated on 500 questions, main metric F1, code `0123456789` '
                      '(dirty).')
  assert '| top-1 document | 200 | 20.0 | 30.0 | 120.0 | - |' in lines
  # one seed: no ±; '|' in a name is escaped
  assert r'| **trained \| top-2** | **200** | **21.0** | **31.2** | **50.0** | **-** |' in lines
  assert 'Paired bootstrap of a − b, 95% interval (F1 is the main metric on `hotpotqa`):' in lines
  assert r'| trained \| top-2 − top-1 document | F1 | +1.2 | [+0.0, +2.5] |' in lines
  assert r'| trained \| top-2 − gold | F1 | -0.0 | [-3.0, +1.0] |' in lines  # unknown row: key
  i = lines.index('**Retrieval recall**')
  assert lines[i:i + 6] == ['**Retrieval recall**', '', '| k | recall@k |', '|---|---|',
                            '| 1 | 45.2 |', '| 5 | 71.30% |']
  assert md.endswith('\n\n- Reader: Gemma 3 270M.\n- Oracle rows omitted.\n')
  assert md.index('**Retrieval recall**') < md.index('- Reader:')


def test_render_markdown_without_bootstrap_entries():
  md = report.render_markdown(_results(bootstrap=[]))
  assert 'Paired bootstrap' not in md and '95% CI' not in md


def _lm_results(**overrides) -> dict:
  rows = [{'key': 'none', 'name': 'no retrieval', 'ppl': 25.62, 'tokens': 0.0, 'n': 6, 'with_evidence_pct': 0.0},
          {'key': 'top1', 'name': 'top-1 passage', 'ppl': 28.915, 'tokens': 115.0, 'n': 6,
           'with_evidence_pct': 100.0}]
  return _results(system='lm', dataset='wikitext', train_questions=0, seeds=[], n=6, rows=rows,
                  bootstrap=[{'a': 'top1', 'b': 'none', 'metric': 'ppl', 'delta': 3.3, 'lo': 1.6, 'hi': 5.6}],
                  **overrides)


def test_language_modelling_results_carry_perplexity(tmp_path):
  assert report.main_metric('wikitext') == 'ppl'
  assert report.load_results(_write(tmp_path / 'lm.json', _lm_results())) == _lm_results()
  md = report.render_markdown(_lm_results())
  assert 'evaluated on 6 windows, main metric PPL' in md
  assert '| evidence | windows | perplexity | evidence tokens | windows with evidence (%) | tokens / top-1 |' in md
  assert '| top-1 passage | 6 | 28.91 | 115.0 | 100.0 | 1.000 |' in md
  assert 'PPL is the main metric on `wikitext`, lower is better' in md
  bad = _lm_results()
  del bad['rows'][1]['ppl']
  with pytest.raises(ValueError, match=r"field 'rows\[1\]\.ppl': missing"):
    report.load_results(_write(tmp_path / 'bad.json', bad))
  qa = _results()
  del qa['rows'][0]['em']  # a question-answering file still needs EM / F1
  with pytest.raises(ValueError, match=r"field 'rows\[0\]\.em': missing"):
    report.load_results(_write(tmp_path / 'qa.json', qa))


# ----------------------------------------------------------------------------- README blocks

README_TEMPLATE = """# project

Intro.

<!-- report: results/nq_extractive_shared.json -->
{body}<!-- /report -->

Between.

```markdown
<!-- report: results/documented_only.json -->
<!-- /report -->
```

<!-- report: results/hotpotqa_extractive_shared.json -->
<!-- /report -->
Tail.
"""


def _repo(tmp_path) -> pathlib.Path:
  _write(tmp_path / 'results' / 'nq_extractive_shared.json', _results())
  _write(tmp_path / 'results' / 'hotpotqa_extractive_shared.json', _results(dataset='hotpotqa'))
  readme = tmp_path / 'README.md'
  readme.write_text(README_TEMPLATE.format(body='| stale | table |\n'), encoding='utf-8')
  return readme


def test_update_and_check_round_trip(tmp_path):
  readme = _repo(tmp_path)
  assert report.check_readme(readme, root=tmp_path) == [
      'results/nq_extractive_shared.json', 'results/hotpotqa_extractive_shared.json']
  assert report.update_readme(readme, root=tmp_path) is True
  assert report.check_readme(readme, root=tmp_path) == []
  assert report.update_readme(readme, root=tmp_path) is False
  body = report.render_markdown(_results(), source='results/nq_extractive_shared.json')
  text = readme.read_text(encoding='utf-8')
  assert ('<!-- report: results/nq_extractive_shared.json -->\n' + body + '<!-- /report -->\n'
          '\nBetween.') in text
  assert text.startswith('# project\n\nIntro.\n\n') and text.endswith('<!-- /report -->\nTail.\n')
  assert '<!-- report: results/documented_only.json -->\n<!-- /report -->' in text  # fenced
  assert '| stale | table |' not in text

  # a changed results file makes its block (only) stale again
  _write(tmp_path / 'results' / 'hotpotqa_extractive_shared.json',
         _results(dataset='hotpotqa', n=499))
  assert report.check_readme(readme, root=tmp_path) == ['results/hotpotqa_extractive_shared.json']


def test_missing_block_file_is_an_error_naming_it(tmp_path):
  readme = _repo(tmp_path)
  (tmp_path / 'results' / 'hotpotqa_extractive_shared.json').unlink()
  before = readme.read_text(encoding='utf-8')
  for fn in (report.check_readme, report.update_readme):
    with pytest.raises(ValueError, match='results/hotpotqa_extractive_shared.json not found'):
      fn(readme, root=tmp_path)
  assert readme.read_text(encoding='utf-8') == before  # nothing half-written


@pytest.mark.parametrize('text, message', [
    ('<!-- report: a.json -->\nbody\n', 'is not closed'),
    ('<!-- /report -->\n', 'without an opening'),
    ('<!-- report: a.json -->\n<!-- report: b.json -->\n<!-- /report -->\n', 'opened inside'),
])
def test_malformed_blocks(tmp_path, text, message):
  readme = tmp_path / 'README.md'
  readme.write_text(text, encoding='utf-8')
  with pytest.raises(ValueError, match=message):
    report.check_readme(readme, root=tmp_path)


def _pages_with_blocks() -> list[pathlib.Path]:
  pages = [REPO / 'README.md'] + sorted((REPO / 'docs').glob('**/*.md'))
  return [p for p in pages if report.find_blocks(p.read_text(encoding='utf-8').splitlines(), p)]


def test_repository_readme_and_docs_blocks_are_current():
  """README and every docs page with a report block, its paths relative to its own directory (the
  command line's default root, so `report --check docs/results/filco.md` agrees). The ledger page
  reads the git history: in a shallow clone (or a tarball) it cannot be checked and is left out."""
  pages = _pages_with_blocks()
  if not ledger.history_available(REPO / 'results'):
    pages = [p for p in pages if 'report: ledger' not in p.read_text(encoding='utf-8')]
  names = {p.relative_to(REPO).as_posix() for p in pages}
  assert {'README.md', 'docs/results/extractive.md', 'docs/results/abstractive.md',
          'docs/results/filco.md'} <= names
  assert 'docs/protocol.md' in names or not ledger.history_available(REPO / 'results')
  stale = {p.relative_to(REPO).as_posix(): report.check_readme(p, root=p.parent) for p in pages}
  assert stale == {name: [] for name in names}


def _git(directory, *args):
  subprocess.run(['git', '-C', str(directory), *args], check=True, capture_output=True)


def test_ledger_lists_every_version_in_the_history_and_the_working_tree(tmp_path):
  """A file overwritten by a rerun keeps its earlier run in the ledger; a deleted file's run too;
  an uncommitted file is listed; a shallow clone is refused by name."""
  repo = tmp_path / 'repo'
  results = repo / 'results'
  _git(tmp_path, 'init', '-q', str(repo))
  for key, value in (('user.email', 't@example.com'), ('user.name', 't'), ('commit.gpgsign', 'false')):
    _git(repo, 'config', key, value)
  eval_path = {'data': {'eval_path': '../shared/data/eval/nq_eval500_bm25top10.jsonl'}}
  _write(results / 'nq.json', _results(config=eval_path, n=150))
  _write(results / 'old.json', _results(dataset='hotpotqa', config={'data': {'eval_path': 'h.jsonl'}}))
  _write(results / 'artifacts' / 'x.json', {'not': 'a results file'})
  _git(repo, 'add', '-A')
  _git(repo, 'commit', '-qm', 'first runs')
  rerun = _results(config=eval_path, n=500)
  rerun['rows'][3]['em'] = 21.0
  _write(results / 'nq.json', rerun)
  (results / 'old.json').unlink()
  _git(repo, 'add', '-A')
  _git(repo, 'commit', '-qm', 'rerun')
  _write(results / 'new.json', _results(system='kcomp', git_commit='f' * 40, dirty=True))  # no 'kcomp' row
  entries = ledger.entries(results, report.ledger_score)
  got = sorted((e.path, e.status, e.n, e.held_out, e.score, e.code) for e in entries)
  assert got == [('new.json', 'current', 500, False, '?', 'ffffffffff+dirty'),
                 ('nq.json', 'current', 500, True, 'EM 21.0 (trained)', '0123456789'),
                 ('nq.json', 'overwritten', 150, True, 'EM 19.6 (trained)', '0123456789'),
                 ('old.json', 'deleted', 500, False, 'F1 27.7 (trained)', '0123456789')]
  assert all(e.code_date == '?' for e in entries)  # those commits are not in this history
  text = ledger.table(results, report.ledger_score, link_prefix='../results/')
  assert text.startswith('**4 evaluations in 3 results files (2 of them overwritten or deleted since); '
                         '2 on a held-out `eval/` file**')
  assert '[nq.json](../results/nq.json) | current' in text and '| old.json | deleted |' in text
  shallow = tmp_path / 'shallow'
  _git(tmp_path, 'clone', '-q', '--depth', '1', f'file://{repo}', str(shallow))
  with pytest.raises(ledger.LedgerUnavailable, match='not a full git clone'):
    ledger.entries(shallow / 'results', report.ledger_score)


# ----------------------------------------------------------------------------- command line


def test_cli_prints_markdown(tmp_path, capsys):
  a = _write(tmp_path / 'a.json', _results())
  b = _write(tmp_path / 'b.json', _results(dataset='hotpotqa'))
  assert report.main([str(a), str(b)]) == 0
  out = capsys.readouterr().out
  assert out == (report.render_markdown(_results(), source=str(a)) + '\n'
                 + report.render_markdown(_results(dataset='hotpotqa'), source=str(b)))
  assert TRAINED_LINE in out


def test_cli_readme_and_check_exit_codes(tmp_path, capsys):
  readme = _repo(tmp_path)
  assert report.main(['--check', str(readme)]) == 1
  out = capsys.readouterr().out
  assert f'{readme}: stale report block: results/nq_extractive_shared.json' in out
  assert f'{readme}: stale report block: results/hotpotqa_extractive_shared.json' in out
  assert report.main(['--readme', str(readme)]) == 0  # root defaults to the README's directory
  assert report.main(['--check', str(readme)]) == 0
  assert report.main(['--check', str(readme), '--root', str(tmp_path / 'results')]) == 2


def test_cli_bad_file_exits_2_with_one_error_line(tmp_path, capsys):
  results = _results()
  del results['rows'][0]['em']
  bad = _write(tmp_path / 'bad.json', results)
  assert report.main([str(bad)]) == 2
  captured = capsys.readouterr()
  assert captured.out == ''
  assert captured.err == f"error: {bad}: field 'rows[0].em': missing\n"
  assert report.main([str(tmp_path / 'absent.json')]) == 2
  assert capsys.readouterr().err.startswith('error: ')


def test_cli_module_entry_point(tmp_path):
  bad = _write(tmp_path / 'bad.json', {'system': 'extractive'})
  proc = subprocess.run([sys.executable, '-m', 'recomp_jax.evaluation.report', str(bad)], cwd=REPO,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 2
  assert proc.stderr.splitlines() == [f"error: {bad}: field 'dataset': missing"]
  assert 'Traceback' not in proc.stderr


# ----------------------------------------------------------------------------- tables over several files


def _filco(dataset: str, measure: str, trained: float, ranked: float, full: float, variant: str = 'paper') -> dict:
  metric = report.main_metric(dataset)
  rows = [{'key': key, 'name': key, 'em': 0.0, 'f1': 0.0, 'tokens': 1.0, 'n': 100}
          for key in ('none', 'full', 'trained', 'ranked')]
  for row, value in zip(rows[1:], (full, trained, ranked)):
    row[metric] = value
  return _results(system='filco', dataset=dataset, rows=rows, n=100, train_questions=360, seeds=[0],
                  config={'filco': {'measure': measure, 'variant': variant}, 'candidates': {'top_docs': 1}})


def test_filco_measure_table_exact():
  runs = [_filco('hotpotqa', 'cxmi', 30.25, 33.0, 35.0), _filco('nq', 'strinc', 29.6, 36.8, 40.4),
          _filco('nq', 'lexical', 20.0, 21.0, 40.4, variant='released')]
  text = report.filco_measure_table(runs, ['h.json', 'n.json', 'l.json'])
  lines = text.splitlines()
  assert lines[2:8] == [
      '| measure | NQ (EM) | HotpotQA (F1) |',
      '|---|---|---|',
      '| STRINC | 29.6 / 36.8 (FULL 40.4) | not run |',
      '| LEXICAL | not run | not run |',
      '| CXMI | not run | 30.2 / 33.0 (FULL 35.0) |',
      '| LEXICAL (released code) | 20.0 / 21.0 (FULL 40.4) | not run |',
  ]
  assert lines[9].startswith('- NQ, STRINC: `n.json` (preset `shared`, 360 training questions, 100 test')
  assert lines[10].startswith('- NQ, LEXICAL (released code): `l.json`')
  assert lines[11].startswith('- HotpotQA, CXMI: `h.json`') and len(lines) == 12


def test_filco_measure_order_is_the_compressors_measures():
  from recomp_jax.compressors import filco
  assert report.FILCO_MEASURE_ORDER == filco.MEASURES


def test_filco_measure_table_rejects_other_systems_and_shared_cells():
  with pytest.raises(ValueError, match='x.json: the filco-measures table takes FILCO runs'):
    report.filco_measure_table([_results()], ['x.json'])
  with pytest.raises(ValueError, match='b.json and a.json both fill the strinc x nq cell'):
    report.filco_measure_table([_filco('nq', 'strinc', 1, 2, 3), _filco('nq', 'strinc', 1, 2, 3)],
                               ['a.json', 'b.json'])


def test_multi_file_block_round_trip_and_errors(tmp_path):
  _write(tmp_path / 'results' / 'nq.json', _filco('nq', 'strinc', 29.6, 36.8, 40.4))
  _write(tmp_path / 'results' / 'hp.json', _filco('hotpotqa', 'cxmi', 30.0, 33.0, 35.0))
  readme = tmp_path / 'README.md'
  spec = 'filco-measures results/nq.json results/hp.json'
  readme.write_text(f'# p\n\n<!-- report: {spec} -->\nold\n<!-- /report -->\n', encoding='utf-8')
  assert report.check_readme(readme, root=tmp_path) == [spec]
  assert report.update_readme(readme, root=tmp_path) is True
  assert report.check_readme(readme, root=tmp_path) == []
  runs = [report.load_results(tmp_path / 'results' / f) for f in ('nq.json', 'hp.json')]
  assert report.filco_measure_table(runs, ['results/nq.json', 'results/hp.json']) in readme.read_text()

  readme.write_text('<!-- report: filco-measures results/nq.json results/gone.json -->\n<!-- /report -->\n')
  with pytest.raises(ValueError, match='README.md:1: report block file results/gone.json not found'):
    report.check_readme(readme, root=tmp_path)
  readme.write_text('<!-- report: no-such-table results/nq.json -->\n<!-- /report -->\n')
  with pytest.raises(ValueError, match="unknown report table 'no-such-table'"):
    report.check_readme(readme, root=tmp_path)


# ----------------------------------------------------------------------------- the summary table

SUMMARY_HEADER_LINE = ('| system | dataset | metric | n | seeds | score | tokens | strongest baseline | its score | '
                       'its tokens | score − baseline [95% CI] | results |')


def _summary_filco() -> dict:
  """A FILCO file whose best rows are its own ranked row, the oracle-like SILVER and FULL, in that order."""
  rows = [{'key': key, 'name': name, 'em': 0.0, 'f1': f1, 'tokens': tokens, 'n': 100}
          for key, name, f1, tokens in (
              ('none', 'no retrieval', 36.02, 0.0), ('full', 'FULL: generator on the whole passage', 45.33, 107.34),
              ('psg', 'PSG: kept passages', 41.2, 90.0), ('trained', 'FILCO: filter model predictions', 36.81, 11.64),
              ('ranked', 'FILCO ranked', 47.0, 33.4), ('silver', 'SILVER: the silver context', 60.0, 22.8),
              ('filtered_reader', 'filter model predictions -> zero-shot reader', 50.0, 11.64))]
  # only the reverse pair (full − trained) is recorded: the table negates it and swaps the bounds
  bootstrap = [{'a': 'full', 'b': 'trained', 'metric': 'f1', 'delta': 8.52, 'lo': -4.6, 'hi': 21.5},
               {'a': 'trained', 'b': 'full', 'metric': 'em', 'delta': 1.0, 'lo': 0.0, 'hi': 2.0}]
  return _results(system='filco', dataset='hotpotqa', n=100, seeds=[0], rows=rows, bootstrap=bootstrap)


def test_summary_table_exact():
  extractive = _results()
  extractive['rows'].append({'key': 'oracle_ll', 'name': 'oracle', 'em': 40.0, 'f1': 50.0, 'tokens': 30.0,
                             'n': 500})  # an oracle is never the baseline
  extractive['rows'].append({'key': 'gold', 'name': 'gold passage(s)', 'em': 30.0, 'f1': 40.0, 'tokens': 200.0,
                             'n': 500})
  no_pair = _results(dataset='tqa', n=200, seeds=[0, 1, 2], bootstrap=[])
  text = report.summary_table([extractive, _summary_filco(), no_pair],
                              ['results/nq_extractive_shared.json', 'results/hotpotqa_filco_shared.json',
                               'results/tqa.json'])
  lines = text.splitlines()
  assert lines[0].startswith('**Each system against its strongest baseline') and lines[1] == ''
  assert lines[2:] == [
      SUMMARY_HEADER_LINE,
      '|---|---|---|---|---|---|---|---|---|---|---|---|',
      '| RECOMP extractive | NQ | EM | 500 | 2 | 19.6 ± 0.6 | 41.0 | top-1 document | 17.6 | 111.0 | '
      '+2.0 [-1.0, +5.0] | [extractive](docs/results/extractive.md) ([json](results/nq_extractive_shared.json)) |',
      # not ranked / filtered_reader (FILCO's own rows) nor SILVER: FULL, named up to its colon
      '| FILCO | HotpotQA | F1 | 100 | 1 | 36.8 | 11.6 | FULL | 45.3 | 107.3 | -8.5 [-21.5, +4.6] | '
      '[filco](docs/results/filco.md) ([json](results/hotpotqa_filco_shared.json)) |',
      '| RECOMP extractive | TQA | EM | 200 | 3 | 19.6 ± 0.6 | 41.0 | top-1 document | 17.6 | 111.0 | - | '
      '[extractive](docs/results/extractive.md) ([json](results/tqa.json)) |',
  ]
  assert text.endswith('|\n') and 'd1ace75' not in text and '0123456789' not in text  # no commit in the table


def test_summary_table_main_metric_field_truncation_and_perplexity():
  # a file's own main_metric wins over its dataset's; the truncation baseline is judged by 'truncated'
  rows = [{'key': 'none', 'name': 'no retrieval', 'em': 3.2, 'f1': 30.0, 'tokens': 0.0, 'n': 50},
          {'key': 'top5', 'name': 'top-5 documents', 'em': 6.8, 'f1': 13.3, 'tokens': 540.0, 'n': 50},
          {'key': 'truncated', 'name': 'first 40 tokens', 'em': 9.0, 'f1': 14.0, 'tokens': 40.0, 'n': 50}]
  truncation = _results(system='truncation', main_metric='em', n=50, seeds=[], rows=rows,
                        bootstrap=[{'a': 'truncated', 'b': 'top5', 'metric': 'em', 'delta': 2.2, 'lo': 0.4, 'hi': 4.0}])
  assert report.summary_row(truncation, '../../results/t.json') == [
      'truncation', 'NQ', 'EM', '50', '0', '9.0', '40.0', 'top-5 documents', '6.8', '540.0', '+2.2 [+0.4, +4.0]',
      '[truncation](../../docs/results/truncation.md) ([json](../../results/t.json))']
  # perplexity: lower is better, two decimals
  lm = _lm_results()
  lm['rows'].append({'key': 'trained', 'name': 'trained', 'ppl': 24.0, 'tokens': 30.0, 'n': 6})
  assert report.strongest_baseline(lm)['key'] == 'none'
  assert report.summary_row(lm, 'results/lm.json')[2:11] == ['PPL', '6', '0', '24.00', '30.0', 'no retrieval',
                                                             '25.62', '0.0', '-']


def test_summary_row_of_an_lm_file_without_the_extractive_row_is_the_abstractive_one():
  lm = _lm_results()
  lm['rows'].append({'key': 'abstractive', 'name': 'abstractive', 'ppl': 25.0, 'tokens': 20.0, 'n': 6})
  lm['stages'] = {'windows': {}, 'abs_train_seed0': {}, 'evaluate': {}}  # seeds not recorded: the stages say 1
  assert report.main_row_key(lm) == 'abstractive'
  assert report.summary_row(lm, 'results/lm.json')[:8] == ['LM task, abstractive', 'WikiText-2', 'PPL', '6', '1',
                                                          '25.00', '20.0', 'no retrieval']
  # beside the extractive row, the abstractive one is the system's own, never its baseline
  lm['rows'].append({'key': 'trained', 'name': 'trained', 'ppl': 26.0, 'tokens': 30.0, 'n': 6})
  assert report.main_row_key(lm) == 'trained' and report.strongest_baseline(lm)['key'] == 'none'
  assert report.summary_row(lm, 'results/lm.json')[0] == 'LM task, extractive'


def test_summary_table_errors_name_the_file():
  with pytest.raises(ValueError, match="x.json: the summary table needs a 'trained' row"):
    report.summary_table([_results(rows=_results()['rows'][:3])], ['x.json'])
  only_trained = _results(rows=[_results()['rows'][3]])
  with pytest.raises(ValueError, match='y.json: no baseline row'):
    report.summary_table([only_trained], ['y.json'])


def test_summary_block_round_trip(tmp_path):
  _write(tmp_path / 'results' / 'nq.json', _results())
  _write(tmp_path / 'results' / 'hp.json', _summary_filco())
  readme = tmp_path / 'README.md'
  spec = 'summary results/nq.json results/hp.json'
  readme.write_text(f'# p\n\n<!-- report: {spec} -->\n<!-- /report -->\n', encoding='utf-8')
  assert report.check_readme(readme, root=tmp_path) == [spec]
  assert report.main(['--readme', str(readme)]) == 0
  assert report.main(['--check', str(readme)]) == 0
  text = readme.read_text(encoding='utf-8')
  assert SUMMARY_HEADER_LINE in text and '([json](results/hp.json)) |\n<!-- /report -->\n' in text


def test_summary_rows_of_the_committed_files():
  sources = ['results/nq_extractive_shared.json', 'results/tqa_filco_shared.json']
  rows = [report.summary_row(report.load_results(REPO / s), s) for s in sources]
  assert rows == [
      ['RECOMP extractive', 'NQ', 'EM', '500', '3', '19.6 ± 0.5', '40.1', 'top-1 document', '17.6', '111.1',
       '+2.0 [-0.9, +4.9]', '[extractive](docs/results/extractive.md) ([json](results/nq_extractive_shared.json))'],
      ['FILCO', 'TQA', 'EM', '300', '1', '15.3', '0.0', 'no retrieval', '16.7', '0.0', '-1.3 [-5.0, +2.0]',
       '[filco](docs/results/filco.md) ([json](results/tqa_filco_shared.json))'],
  ]


def test_readme_summary_links_exist():
  """Every results page and file README's summary table links to is in the repository."""
  blocks = [b for b in report.find_blocks((REPO / 'README.md').read_text(encoding='utf-8').splitlines())
            if b.path.startswith('summary ')]
  assert len(blocks) == 1
  sources = blocks[0].path.split(' ')[1:]
  pages = {report.results_page(report.load_results(REPO / s), s) for s in sources}
  assert pages == {'docs/results/extractive.md', 'docs/results/abstractive.md', 'docs/results/filco.md',
                   'docs/results/truncation.md', 'docs/results/kcomp.md', 'docs/results/lm.md'}
  assert all((REPO / p).is_file() for p in pages | set(sources))
