"""Readers of the QA formats RECOMP is trained and evaluated on, into :mod:`schema` records.

JSONL flavours (``.jsonl`` or ``.jsonl.gz``), detected from the first record
unless ``flavour=`` says otherwise:

=======================  ===================================================================
``'dpr'``                DPR/FiD: ``question, answers[], ctxs[{id,title,text,score,has_answer,
                         is_gold,source}], gold_ctx{title,text}`` (ctxs/gold_ctx optional);
                         the format of ``../shared/data/nq/*.jsonl*`` and ``eval/``.
``'flashrag'``           FlashRAG: ``id, question, golden_answers[]``.
``'nq_open'``            NQ-open: ``question, answer[]``.
``'triviaqa_llmfoundry'`` llm-foundry TriviaQA: ``context ("Question: ...\\nAnswer:"), answer,
                         aliases[]``; answers = answer then the aliases, de-duplicated.
``'hotpot_ircot'``       IRCoT HotpotQA: ``question_id, question_text, answers_objects[{spans}],
                         contexts[{id,title,paragraph_text,is_supporting}]``; ctxs keep the given
                         paragraph order, ``is_gold`` = ``is_supporting``, ``gold_ctx`` = the
                         first supporting paragraph (all supporting ids are in ``meta``).
``'kilt'``               KILT (FEVER, Wizard of Wikipedia, ...): ``id, input, output[{answer,
                         provenance[{title, wikipedia_id, ...}]}]``; ``input`` is the question
                         (a FEVER claim, a WoW dialogue history with turns on separate lines),
                         the answers are the outputs' non-empty ``answer`` strings (a FEVER
                         label, a WoW next turn); provenance-only outputs carry no answer.
                         Optional ``ctxs`` as in ``'dpr'`` (retrieved passages, as FILCO's
                         processed files have); ``meta.provenance_titles`` lists the gold
                         Wikipedia pages.
=======================  ===================================================================

:func:`read_hf` reads the Hugging Face ``datasets`` versions (``nq_open``,
``trivia_qa`` rc.nocontext, ``hotpot_qa`` distractor, ``kilt_tasks`` fever / wow) when
the hub is reachable;
offline it raises :class:`HubUnavailableError` saying so.

Errors name file, line and field (:class:`schema.DataError`). With
``on_error='skip'`` an invalid row is dropped instead and counted in the
:class:`schema.FilterReport` under ``'invalid: <field>'``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import zlib
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from recomp_jax.data.schema import (DataError, Example, FilterReport, Location, Passage,
                                    parse_passage, require_str, require_str_list)

FLAVOURS = ('dpr', 'flashrag', 'nq_open', 'triviaqa_llmfoundry', 'hotpot_ircot', 'kilt')


class HubUnavailableError(RuntimeError):
  """A Hugging Face ``datasets`` read failed (offline, no ``datasets``, unknown name)."""


# ----------------------------------------------------------------------------- raw JSONL


def _open_text(path: str | os.PathLike, mode: str = 'r', errors: str = 'strict') -> io.TextIOBase:
  if os.fspath(path).endswith('.gz'):
    return gzip.open(path, mode + 't', encoding='utf-8', errors=errors)
  return open(path, mode, encoding='utf-8', errors=errors)


def _undecodable(line: str) -> str | None:
  """Why a line read with ``errors='surrogateescape'`` is not UTF-8, or ``None`` when it is.

  Undecodable bytes arrive as lone surrogates (U+DC80..U+DCFF), which
  valid UTF-8 never decodes to; they do not survive a strict re-encoding.
  """
  if line.isascii():
    return None
  try:
    line.encode('utf-8')
  except UnicodeEncodeError as e:
    byte = line[e.start].encode('utf-8', 'surrogateescape')
    return f'invalid UTF-8 (byte 0x{byte.hex()} at column {e.start + 1})'
  return None


def _stem(path: str | os.PathLike) -> str:
  name = os.path.basename(os.fspath(path))
  for suffix in ('.gz', '.jsonl', '.json'):
    if name.endswith(suffix):
      name = name[:-len(suffix)]
  return name


def iter_jsonl(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
  """Yields ``(line_number, record)`` for every non-blank line (1-based numbers).

  Raises:
    DataError: a line that is not valid JSON; its message names file and line.
  """
  for _, lineno, rec in _iter_records(path, 'raise', FilterReport('iter_jsonl')):
    yield lineno, rec


def read_json(path: str | os.PathLike) -> Any:
  """The JSON value in the file ``path`` (a stage's threshold or best-checkpoint record).

  Raises:
    DataError: the file is not valid JSON; its message names file, line and column.
  """
  with open(path, encoding='utf-8') as f:
    text = f.read()
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(path, e.lineno, None, f'invalid JSON ({e.msg} at column {e.colno})') from None


def write_jsonl(path: str | os.PathLike, records: Iterable[Mapping[str, Any]]) -> int:
  """Writes dicts one per line (gzip when ``path`` ends in .gz); returns the count."""
  n = 0
  with _open_text(path, 'w') as f:
    for rec in records:
      f.write(json.dumps(rec, ensure_ascii=False))
      f.write('\n')
      n += 1
  return n


# ----------------------------------------------------------------------------- flavours


def detect_flavour(record: Mapping[str, Any], where: Location | None = None) -> str:
  """The JSONL flavour of ``record`` (one of :data:`FLAVOURS`), from its keys."""
  where = where or Location()
  if not isinstance(record, Mapping):
    raise where.error(None, f'expected a JSON object, got {type(record).__name__}')
  keys = set(record)
  if {'question_text', 'answers_objects'} <= keys:
    return 'hotpot_ircot'
  if {'input', 'output'} <= keys:
    return 'kilt'
  if 'golden_answers' in keys:
    return 'flashrag'
  if 'context' in keys and ('aliases' in keys or
                            str(record['context']).lstrip().startswith('Question:')):
    return 'triviaqa_llmfoundry'
  if 'question' in keys and ('answers' in keys or 'ctxs' in keys):
    return 'dpr'
  if 'question' in keys and 'answer' in keys:
    return 'nq_open'
  if 'text' in keys and 'question' not in keys:
    raise where.error(None, f'looks like a corpus row (keys {sorted(keys)}); use read_corpus()')
  raise where.error(None, f'cannot detect the JSONL flavour from keys {sorted(keys)}; '
                    f'pass flavour= one of {FLAVOURS}')


def _record_id(rec: Mapping[str, Any], keys: Sequence[str], where: Location,
               default: str) -> str:
  for key in keys:
    value = rec.get(key)
    if value is None:
      continue
    if isinstance(value, bool) or not isinstance(value, (str, int)):
      raise where.error(key, f'expected a string or int, got {type(value).__name__}')
    return str(value)
  return default


def _parse_ctxs(rec: Mapping[str, Any], key: str, where: Location, ex_id: str,
                text_key: str = 'text') -> list[Passage]:
  value = rec.get(key)
  if value is None:
    return []
  if not isinstance(value, list):
    raise where.error(key, f'expected a list of passages, got {type(value).__name__}')
  return [parse_passage(c, where, prefix=f'{key}[{j}].', default_id=f'{ex_id}-{key}{j}',
                        text_key=text_key) for j, c in enumerate(value)]


def _parse_dpr(rec, where, default_id):
  ex_id = _record_id(rec, ('id', 'question_id', 'qid'), where, default_id)
  question = require_str(rec, 'question', where)
  answers = require_str_list(rec, 'answers', where)
  ctxs = _parse_ctxs(rec, 'ctxs', where, ex_id)
  gold = rec.get('gold_ctx')
  gold_ctx = None if gold is None else parse_passage(gold, where, prefix='gold_ctx.',
                                                     default_id=f'{ex_id}-gold')
  meta = rec.get('meta') or {}
  if not isinstance(meta, Mapping):
    raise where.error('meta', f'expected an object, got {type(meta).__name__}')
  return Example(ex_id, question, answers, ctxs, gold_ctx, dict(meta))


def parse_request(rec: Any, where: Location, default_id: str) -> Example:
  """A question with its retrieved passages and no answers (``{"id", "question", "ctxs"}``,
  ``ctxs`` as in ``'dpr'``): a line of :mod:`recomp_jax.inference`'s command-line input."""
  if not isinstance(rec, Mapping):
    raise where.error(None, f'expected a JSON object, got {type(rec).__name__}')
  ex_id = _record_id(rec, ('id', 'question_id', 'qid'), where, default_id)
  return Example(ex_id, require_str(rec, 'question', where), [], _parse_ctxs(rec, 'ctxs', where, ex_id))


def _parse_flashrag(rec, where, default_id):
  ex_id = _record_id(rec, ('id',), where, default_id)
  meta = rec.get('metadata')
  return Example(ex_id, require_str(rec, 'question', where),
                 require_str_list(rec, 'golden_answers', where),
                 meta={'metadata': meta} if meta is not None else {})


def _parse_nq_open(rec, where, default_id):
  ex_id = _record_id(rec, ('id',), where, default_id)
  return Example(ex_id, require_str(rec, 'question', where), require_str_list(rec, 'answer', where))


_TQA_CONTEXT = re.compile(r'^\s*Question:\s*(?P<q>.*?)\s*\nAnswer:\s*$', re.DOTALL)


def _dedup(items: Iterable[str]) -> list[str]:
  return list(dict.fromkeys(items))


def _parse_triviaqa_llmfoundry(rec, where, default_id):
  ex_id = _record_id(rec, ('id', 'question_id'), where, default_id)
  context = require_str(rec, 'context', where)
  m = _TQA_CONTEXT.match(context)
  if m is None or not m.group('q'):
    raise where.error('context', 'expected "Question: ...\\nAnswer:"')
  answer = require_str(rec, 'answer', where)
  aliases = require_str_list(rec, 'aliases', where) if rec.get('aliases') else []
  return Example(ex_id, m.group('q'), _dedup([answer, *aliases]))


def _parse_hotpot_ircot(rec, where, default_id):
  ex_id = _record_id(rec, ('question_id', 'id'), where, default_id)
  question = require_str(rec, 'question_text', where)
  objs = rec.get('answers_objects')
  if not isinstance(objs, list) or not objs:
    raise where.error('answers_objects', 'expected a non-empty list')
  answers = []
  for i, obj in enumerate(objs):
    if not isinstance(obj, Mapping):
      raise where.error(f'answers_objects[{i}]', 'expected an object')
    spans = obj.get('spans') or []
    if not isinstance(spans, list) or not all(isinstance(s, str) for s in spans):
      raise where.error(f'answers_objects[{i}].spans', 'expected a list of strings')
    answers.extend(s for s in spans if s.strip())
    number = obj.get('number')
    if not spans and isinstance(number, (str, int, float)) and str(number).strip():
      answers.append(str(number).strip())
  if not answers:
    raise where.error('answers_objects', 'no answer span')
  ctxs = _parse_ctxs(rec, 'contexts', where, ex_id, text_key='paragraph_text')
  # IRCoT ids are per-question ('0'..'9'): make them corpus-unique.
  flags = []
  for j, raw in enumerate(rec.get('contexts') or []):
    flag = raw.get('is_supporting')
    if flag is not None and not isinstance(flag, bool):
      raise where.error(f'contexts[{j}].is_supporting',
                        f'expected a bool, got {type(flag).__name__}')
    flags.append(flag)
  ctxs = [Passage(f'{ex_id}-{c.id}', c.title, c.text, c.score, c.has_answer, flag, c.source)
          for c, flag in zip(ctxs, flags)]
  supporting = [c for c in ctxs if c.is_gold]
  return Example(ex_id, question, _dedup(answers), ctxs, supporting[0] if supporting else None,
                 meta={'supporting_ids': [c.id for c in supporting]})


def _parse_kilt(rec, where, default_id):
  ex_id = _record_id(rec, ('id',), where, default_id)
  question = require_str(rec, 'input', where)
  outputs = rec.get('output')
  if not isinstance(outputs, list):
    raise where.error('output', f'expected a list of outputs, got {type(outputs).__name__}')
  answers, titles = [], []
  for i, out in enumerate(outputs):
    if not isinstance(out, Mapping):
      raise where.error(f'output[{i}]', 'expected an object')
    answer = out.get('answer')
    if answer is not None and not isinstance(answer, str):
      raise where.error(f'output[{i}].answer', f'expected a string, got {type(answer).__name__}')
    if answer and answer.strip():
      answers.append(answer.strip())
    provenance = out.get('provenance') or []
    if not isinstance(provenance, list):
      raise where.error(f'output[{i}].provenance', 'expected a list')
    for j, p in enumerate(provenance):
      if not isinstance(p, Mapping):
        raise where.error(f'output[{i}].provenance[{j}]', 'expected an object')
      if isinstance(p.get('title'), str) and p['title'].strip():
        titles.append(p['title'].strip())
  if not answers:
    raise where.error('output', 'no output has a non-empty answer')
  meta = rec.get('meta') or {}
  if not isinstance(meta, Mapping):
    raise where.error('meta', f'expected an object, got {type(meta).__name__}')
  return Example(ex_id, question, _dedup(answers), _parse_ctxs(rec, 'ctxs', where, ex_id),
                 meta={**dict(meta), 'provenance_titles': _dedup(titles)})


_PARSERS: dict[str, Callable[[Mapping[str, Any], Location, str], Example]] = {
    'dpr': _parse_dpr,
    'flashrag': _parse_flashrag,
    'nq_open': _parse_nq_open,
    'triviaqa_llmfoundry': _parse_triviaqa_llmfoundry,
    'hotpot_ircot': _parse_hotpot_ircot,
    'kilt': _parse_kilt,
}


def parse_example(record: Any, flavour: str, where: Location, default_id: str) -> Example:
  """Validates one record of ``flavour`` into an :class:`Example` (DataError if malformed)."""
  if flavour not in _PARSERS:
    raise ValueError(f'unknown flavour {flavour!r}; expected one of {FLAVOURS}')
  if not isinstance(record, Mapping):
    raise where.error(None, f'expected a JSON object, got {type(record).__name__}')
  return _PARSERS[flavour](record, where, default_id)


def _check_on_error(on_error: str) -> None:
  if on_error not in ('raise', 'skip'):
    raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")


def _drop_invalid(report: FilterReport, err: DataError) -> None:
  reason = f'invalid: {err.field}' if err.field else 'invalid: record'
  report.drop(reason, where=f'{os.path.basename(err.path or "")}:{err.line}')


def read_examples(path: str | os.PathLike, flavour: str = 'auto', *, limit: int | None = None,
                  on_error: str = 'raise', report: FilterReport | None = None) -> list[Example]:
  """Reads a QA JSONL file (.jsonl or .jsonl.gz) into examples, in file order.

  Args:
    path: the file.
    flavour: one of :data:`FLAVOURS`, or ``'auto'`` to detect it from the first record.
    limit: stop after this many examples.
    on_error: ``'raise'`` a :class:`DataError` naming file/line/field, or ``'skip'`` the row
      and count it in ``report``.
    report: filled with kept/dropped counts (a fresh one is used when None).
  Returns:
    Examples whose ids are the record's own (``id``/``question_id``) or ``'{stem}-{index}'``
    with ``index`` the 0-based record number.
  """
  _check_on_error(on_error)
  report = report if report is not None else FilterReport('read_examples')
  examples: list[Example] = []
  seen_ids: dict[str, int] = {}
  stem = _stem(path)
  for index, lineno, rec in _iter_records(path, on_error, report):
    where = Location(path, lineno)
    try:
      if flavour == 'auto':
        flavour = detect_flavour(rec, where)
      ex = parse_example(rec, flavour, where, default_id=f'{stem}-{index}')
      if ex.id in seen_ids:
        raise where.error('id', f'duplicate id {ex.id!r} (first on line {seen_ids[ex.id]})')
    except DataError as err:
      if on_error == 'raise':
        raise
      _drop_invalid(report, err)
      continue
    seen_ids[ex.id] = lineno
    examples.append(ex)
    report.keep()
    if limit is not None and len(examples) >= limit:
      break
  return examples


def _numbered_lines(f, path) -> Iterator[tuple[int, str]]:
  """``(line number, line)`` of an open text file; a damaged gzip stream is a :class:`DataError`
  naming the file and the first line that could not be read (never a bare ``EOFError``)."""
  lineno = 0
  while True:
    try:
      line = f.readline()
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
      raise DataError(path, lineno + 1, None,
                      f'truncated or corrupt gzip file ({type(e).__name__}: {e}); '
                      f'{lineno} lines were readable') from None
    if not line:
      return
    lineno += 1
    yield lineno, line


def _iter_records(path, on_error: str,
                  report: FilterReport) -> Iterator[tuple[int, int, Any]]:
  """Yields ``(index, line_number, record)``; ``index`` counts non-blank lines from 0.

  A line that is not UTF-8 or not JSON raises :class:`DataError` naming file and
  line; under ``on_error='skip'`` it is dropped (and still counted by ``index``,
  so default ids do not depend on ``on_error``). Bytes that are not UTF-8 are
  read as ``surrogateescape`` surrogates, so that they are reported with the
  line they are on.
  """
  with _open_text(path, errors='surrogateescape') as f:
    index = 0
    for lineno, line in _numbered_lines(f, path):
      if not line.strip():
        continue
      index += 1
      problem = _undecodable(line)
      if problem is not None:
        if on_error == 'raise':
          raise DataError(path, lineno, None, problem)
        report.drop('invalid: utf-8', where=f'{os.path.basename(os.fspath(path))}:{lineno}')
        continue
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        if on_error == 'raise':
          raise DataError(path, lineno, None,
                          f'invalid JSON ({e.msg} at column {e.colno})') from None
        report.drop('invalid: json', where=f'{os.path.basename(os.fspath(path))}:{lineno}')
        continue
      yield index - 1, lineno, rec


def read_corpus(path: str | os.PathLike, *, limit: int | None = None, on_error: str = 'raise',
                report: FilterReport | None = None) -> list[Passage]:
  """Reads a JSONL(.gz) corpus of ``{id, title, text[, source]}`` rows into passages."""
  _check_on_error(on_error)
  report = report if report is not None else FilterReport('read_corpus')
  passages: list[Passage] = []
  seen_ids: dict[str, int] = {}
  for _, lineno, rec in _iter_records(path, on_error, report):
    where = Location(path, lineno)
    try:
      p = parse_passage(rec, where)
      if p.id in seen_ids:
        raise where.error('id', f'duplicate id {p.id!r} (first on line {seen_ids[p.id]})')
    except DataError as err:
      if on_error == 'raise':
        raise
      _drop_invalid(report, err)
      continue
    seen_ids[p.id] = lineno
    passages.append(p)
    report.keep()
    if limit is not None and len(passages) >= limit:
      break
  return passages


def write_examples(path: str | os.PathLike, examples: Iterable[Example]) -> int:
  """Writes examples in the DPR layout that ``read_examples(path)`` reads back."""
  return write_jsonl(path, (ex.to_dict() for ex in examples))


def write_corpus(path: str | os.PathLike, passages: Iterable[Passage]) -> int:
  """Writes passages as ``{id, title, text, ...}`` rows that ``read_corpus`` reads back."""
  return write_jsonl(path, (p.to_dict() for p in passages))


# ----------------------------------------------------------------------------- HF datasets

# name -> (hub path, default config)
HF_DATASETS = {
    'nq_open': ('nq_open', None),
    'trivia_qa': ('trivia_qa', 'rc.nocontext'),
    'hotpot_qa': ('hotpot_qa', 'distractor'),
    'kilt_tasks': ('facebook/kilt_tasks', None),  # config: fever, wow, ... (a KILT task)
}


def _from_hf_nq_open(row, where, default_id):
  return Example(default_id, require_str(row, 'question', where),
                 require_str_list(row, 'answer', where))


def _from_hf_trivia_qa(row, where, default_id):
  ex_id = _record_id(row, ('question_id',), where, default_id)
  ans = row.get('answer')
  if not isinstance(ans, Mapping):
    raise where.error('answer', 'expected an object with value and aliases')
  value = require_str(ans, 'value', where, prefix='answer.')
  aliases = [a for a in (ans.get('aliases') or []) if isinstance(a, str) and a.strip()]
  return Example(ex_id, require_str(row, 'question', where), _dedup([value, *aliases]))


def _from_hf_hotpot_qa(row, where, default_id):
  ex_id = _record_id(row, ('id',), where, default_id)
  context = row.get('context')
  if not isinstance(context, Mapping) or 'title' not in context or 'sentences' not in context:
    raise where.error('context', 'expected {title: [...], sentences: [[...]]}')
  support = set((row.get('supporting_facts') or {}).get('title') or [])
  ctxs = [Passage(f'{ex_id}-{j}', title, ''.join(sents), is_gold=title in support)
          for j, (title, sents) in enumerate(zip(context['title'], context['sentences']))]
  gold = [c for c in ctxs if c.is_gold]
  return Example(ex_id, require_str(row, 'question', where), [require_str(row, 'answer', where)],
                 ctxs, gold[0] if gold else None, meta={'supporting_ids': [c.id for c in gold],
                                                        'type': row.get('type'),
                                                        'level': row.get('level')})


_HF_PARSERS = {'nq_open': _from_hf_nq_open, 'trivia_qa': _from_hf_trivia_qa,
               'hotpot_qa': _from_hf_hotpot_qa, 'kilt_tasks': _parse_kilt}


def read_hf(name: str, split: str, *, config: str | None = None, limit: int | None = None,
            report: FilterReport | None = None, cache_dir: str | None = None) -> list[Example]:
  """Loads ``nq_open``, ``trivia_qa`` (rc.nocontext), ``hotpot_qa`` (distractor) or a
  ``kilt_tasks`` task (``config='fever'`` or ``'wow'``; the KILT test splits have no outputs,
  so evaluate on ``validation`` as the FILCO paper does) from the hub.

  ``datasets`` is imported lazily. Any failure to load (offline machine,
  ``HF_HUB_OFFLINE=1``, missing package) raises :class:`HubUnavailableError` with the
  cause; the JSONL files under ``../shared/data`` are the offline alternative.
  """
  if name not in HF_DATASETS:
    raise ValueError(f'unknown HF dataset {name!r}; expected one of {sorted(HF_DATASETS)}')
  hub_path, default_config = HF_DATASETS[name]
  config = config or default_config
  if name == 'kilt_tasks' and not config:
    raise ValueError("read_hf('kilt_tasks') needs config= the KILT task ('fever', 'wow', ...)")
  origin = f'hf://{hub_path}' + (f'/{config}' if config else '') + f'/{split}'
  try:
    import datasets  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise HubUnavailableError(f'{origin}: the `datasets` package is not installed') from e
  try:
    ds = datasets.load_dataset(hub_path, config, split=split, cache_dir=cache_dir)
  except Exception as e:  # offline, unknown split, hub errors: all surface the same way
    offline = os.environ.get('HF_HUB_OFFLINE', '0')
    raise HubUnavailableError(
        f'{origin}: could not load from the Hugging Face hub ({type(e).__name__}: {e}). '
        f'HF_HUB_OFFLINE={offline}; offline, use read_examples() on the JSONL files '
        f'under ../shared/data instead.') from e
  report = report if report is not None else FilterReport(f'read_hf:{name}')
  parse = _HF_PARSERS[name]
  examples = []
  for i, row in enumerate(ds):
    where = Location(origin, i + 1)
    try:
      ex = parse(row, where, f'{name}-{split}-{i}')
    except DataError as err:
      _drop_invalid(report, err)
      continue
    examples.append(ex)
    report.keep()
    if limit is not None and len(examples) >= limit:
      break
  return examples


# ----------------------------------------------------------------------------- splits


TRAIN_SUBSETS = ('first', 'shuffled')


def take_subset(examples: Sequence[Example], n: int, how: str, seed: int) -> list[Example]:
  """``n`` of ``examples`` (all of them when ``n`` is 0 or at least their number).

  ``how='first'``: the first ``n`` in file order. ``how='shuffled'``: ``n`` chosen by a
  permutation from ``numpy.random.default_rng(seed)`` and returned in file order, for files
  ordered by question type (HotpotQA's IRCoT sample puts its 80 yes/no questions after the
  first 250), where the first ``n`` would hold one type only.
  """
  if how not in TRAIN_SUBSETS:
    raise ValueError(f"data.train_subset must be one of {TRAIN_SUBSETS}, got {how!r}")
  if not n or n >= len(examples):
    return list(examples)
  if how == 'first':
    return list(examples[:n])
  chosen = np.sort(np.random.default_rng(seed).permutation(len(examples))[:n])
  return [examples[i] for i in chosen]


YES_NO_SHARE = 0.05


def draw_shots(examples: Sequence[Example], k: int, seed: int) -> tuple[list[Example], list[Example]]:
  """``k`` in-context examples drawn at random from ``examples`` (RECOMP §4.2: "five randomly
  sampled in-context examples from training set"), and the rest, both in input order.

  Beyond the paper: when yes/no answers are a question type of the split (at least
  :data:`YES_NO_SHARE` of its answers: HotpotQA's comparison questions, not a stray "No" among
  TriviaQA's) and the draw holds none, the last drawn example gives way to the first yes/no one
  in the permutation, so that the type sees its answer format demonstrated. The draw is
  ``numpy.random.default_rng(seed)``'s, so the same inputs and seed give the same shots on every
  machine.

  Raises:
    ValueError: fewer than ``k`` examples.
  """
  if len(examples) < k:
    raise ValueError(f'{k} in-context examples are drawn from the training questions, but there are '
                     f'{len(examples)}')
  order = np.random.default_rng(seed).permutation(len(examples)).tolist()
  drawn = order[:k]
  yes_no = [i for i in order if examples[i].answers[0].strip().lower() in ('yes', 'no')]
  if k and len(yes_no) >= YES_NO_SHARE * len(examples) and not any(i in yes_no for i in drawn):
    drawn[-1] = yes_no[0]
  chosen = set(drawn)
  return ([e for i, e in enumerate(examples) if i in chosen],
          [e for i, e in enumerate(examples) if i not in chosen])


def split_train_dev(examples: Sequence[Example], dev_fraction: float,
                    seed: int) -> tuple[list[Example], list[Example]]:
  """Deterministic random split; both parts keep the input order.

  ``round(len * dev_fraction)`` examples (at least one when the fraction is positive
  and there are two or more examples) go to dev, chosen by a permutation from
  ``numpy.random.default_rng(seed)``: the same inputs and seed give the same split on
  every machine.
  """
  if not 0.0 <= dev_fraction < 1.0:
    raise ValueError(f'dev_fraction must be in [0, 1), got {dev_fraction}')
  n = len(examples)
  n_dev = int(round(n * dev_fraction))
  if dev_fraction > 0 and n_dev == 0 and n > 1:
    n_dev = 1
  dev_idx = np.zeros(n, dtype=bool)
  dev_idx[np.random.default_rng(seed).permutation(n)[:n_dev]] = True
  train = [ex for ex, d in zip(examples, dev_idx) if not d]
  dev = [ex for ex, d in zip(examples, dev_idx) if d]
  return train, dev
