"""The test-set ledger: every evaluation a results file under ``results/`` records, ever.

``../shared/data/README.md`` allows one look at a held-out file, at the end; a reviewer can only
trust that if every look is listed. The list is built from the results files in the working tree
and from every version of them in the git history (an overwritten or deleted file's earlier
runs too), so a rerun that overwrote a file cannot hide the run before it. A run whose results
file was never committed is not seen: that is the limit of a ledger built from git.

One entry per distinct (file, content): the run's code commit and its date, the system and
preset, the test file, whether it is held out (under ``eval/``), the number of test questions
(windows for the LM task) and the main row's score. ``docs/protocol.md`` carries the table in a
report block (``<!-- report: ledger ../results -->``), kept current by ``report --check``.

Only the standard library and ``git`` are used; the main row's score is written by the caller's
function (``report`` passes its own, so this module imports nothing of the package).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import subprocess
from typing import Callable

HELD_OUT_DIR = '/eval/'
# The config field naming each system's test file, in the order they are looked for.
TEST_FILE_FIELDS = (('data', 'eval_path'), ('kcomp', 'test_path'), ('color', 'test_path'), ('lm', 'wikitext_path'))


class LedgerUnavailable(ValueError):
  """The results directory has no full git history to read."""


@dataclasses.dataclass(frozen=True)
class Entry:
  """One evaluation recorded by one version of one results file."""
  path: str         # the results file, relative to the results directory
  status: str       # 'current' (the working tree's), 'overwritten' or 'deleted'
  code: str         # the run's code commit (10 hex digits, '+dirty' when uncommitted changes ran)
  code_date: str    # that commit's date (YYYY-MM-DD), '?' when it is not in this history
  system: str
  preset: str
  test_file: str
  held_out: bool
  n: int
  score: str        # the main row's main metric, e.g. 'EM 19.6 (trained)'


def _git(directory: pathlib.Path, *args: str) -> str:
  return subprocess.run(['git', '-C', str(directory), *args], check=True, capture_output=True,
                        text=True).stdout


def history_available(results_dir: os.PathLike | str) -> bool:
  """Whether ``results_dir`` lies in a git work tree with its full history (not a shallow clone)."""
  try:
    return _git(pathlib.Path(results_dir), 'rev-parse', '--is-shallow-repository').strip() == 'false'
  except (OSError, subprocess.CalledProcessError):
    return False


def test_file(results: dict) -> str:
  """The test file a results file's config names ('' when none)."""
  config = results.get('config') or {}
  for section, field in TEST_FILE_FIELDS:
    value = (config.get(section) or {}).get(field)
    if value:
      return str(value)
  return ''


def _entry(path: str, status: str, results: dict, dates: dict[str, str], score: Callable[[dict], str]) -> Entry:
  commit = str(results.get('git_commit') or '')
  code = commit[:10] + ('+dirty' if results.get('dirty') else '') if commit else '?'
  name = test_file(results)
  return Entry(path=path, status=status, code=code, code_date=dates.get(commit, '?'),
               system=str(results.get('system', '?')), preset=str(results.get('preset', '?')),
               test_file=name.replace('../shared/data/', ''), held_out=HELD_OUT_DIR in name,
               n=int(results.get('n') or 0), score=score(results))


def _versions(results_dir: pathlib.Path) -> list[tuple[str, bytes]]:
  """``(name, content)`` of every version of ``results_dir/*.json`` committed to the history."""
  top = pathlib.Path(_git(results_dir, 'rev-parse', '--show-toplevel').strip())
  prefix = results_dir.resolve().relative_to(top.resolve()).as_posix()
  log = _git(results_dir, 'log', '--format=commit %H', '--name-status', '--no-renames', '--', '.')
  versions, commit = [], None
  for line in log.splitlines():
    if line.startswith('commit '):
      commit = line.split()[1]
      continue
    parts = line.split('\t')
    if len(parts) != 2 or parts[0] not in ('A', 'M'):
      continue
    rel = parts[1][len(prefix) + 1:] if prefix not in ('', '.') else parts[1]
    if '/' in rel or not rel.endswith('.json'):
      continue
    content = subprocess.run(['git', '-C', str(top), 'show', f'{commit}:{parts[1]}'], check=True,
                             capture_output=True).stdout
    versions.append((rel, content))
  return versions


def entries(results_dir: os.PathLike | str, score: Callable[[dict], str]) -> list[Entry]:
  """Every evaluation recorded in ``results_dir/*.json``, now or in its git history; ``score`` writes
  a results file's main row (a file of an older schema included).

  Raises :class:`LedgerUnavailable` outside a full git clone (a shallow one lacks the history).
  """
  results_dir = pathlib.Path(results_dir)
  if not history_available(results_dir):
    raise LedgerUnavailable(f'{results_dir}: the ledger reads the git history of the results files; '
                            'this is not a full git clone')
  current = {p.name: p.read_bytes() for p in sorted(results_dir.glob('*.json'))}
  seen = {(name, hashlib.sha256(content).hexdigest()) for name, content in current.items()}
  found = [(name, 'current', content) for name, content in current.items()]
  for name, content in _versions(results_dir):
    key = (name, hashlib.sha256(content).hexdigest())
    if key not in seen:
      seen.add(key)
      found.append((name, 'overwritten' if name in current else 'deleted', content))
  parsed = [(name, status, json.loads(content)) for name, status, content in found]
  commits = sorted({str(r.get('git_commit')) for _, _, r in parsed if r.get('git_commit')})
  dates = {}
  for commit in commits:
    try:
      dates[commit] = _git(results_dir, 'show', '-s', '--format=%cs', commit).strip()
    except subprocess.CalledProcessError:
      pass  # a commit of another history: its date is unknown here
  out = [_entry(name, status, r, dates, score) for name, status, r in parsed]
  return sorted(out, key=lambda e: (e.code_date, e.code, e.path, e.status))


def table(results_dir: os.PathLike | str, score: Callable[[dict], str], link_prefix: str = '') -> str:
  """The ledger as markdown: a count line and one table row per :class:`Entry`."""
  rows = entries(results_dir, score)
  held = [e for e in rows if e.held_out]
  lines = [f'**{len(rows)} evaluations in {len({e.path for e in rows})} results files '
           f'({sum(e.status != "current" for e in rows)} of them overwritten or deleted since); '
           f'{len(held)} on a held-out `eval/` file**', '',
           '| code commit | date | results file | status | system | preset | test file | in `eval/` | n | main row |',
           '|---|---|---|---|---|---|---|---|---|---|']
  for e in rows:
    name = f'[{e.path}]({link_prefix}{e.path})' if e.status == 'current' else e.path
    lines.append(f'| `{e.code}` | {e.code_date} | {name} | {e.status} | {e.system} | {e.preset} | '
                 f'{e.test_file} | {"yes" if e.held_out else "no"} | {e.n} | {e.score} |')
  return '\n'.join(lines) + '\n'
