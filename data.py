"""Documents for the summariser: records, loaders, the built-in news world, leak-safe splits.

What lives here (DESIGN.md sections 1, 6 and 9):

1. `Document`, the one record every stage passes around (id, text, reference
   summary, source, bucket, leak cluster; for the news world also its fact table
   and entity table), with versioned JSONL (de)serialisation.
2. Loaders: our own JSONL, foreign JSONL through a field mapping, and Hugging
   Face `datasets` by name (imported lazily; a clear error when it is missing or
   the machine is offline). All loaders stream and honour `limit`.
3. The news world: a seeded generator of short news articles from ten event
   families, with a fact table per article and a 2-4 sentence reference summary
   built from its key facts. Distractor sentences reuse the article's own
   entities and numbers in other roles (last year's revenue, a rival's bid), so
   careless copying errs. Article i depends only on (seed, i).
4. The faulty drafter: summaries with labelled errors (entity swap, number
   change, date change, negation, wrong predicate) in the teacher's schema
   `{"error_span", "corrected_clause", "regex_key"}` plus type and position.
5. The oracle annotator: checks ANY summary against the fact table and answers
   in the same schema, so it can grade model outputs as well as drafts.
6. The leak-cluster guard (appendix 10.4 of the SN15 paper): MinHash clusters of
   near-duplicate documents, split whole into train / eval / never-touch pools,
   stratified by bucket, seeded, written as a frozen manifest and checked.

Command line:

    python data.py newsworld --n 1000 --seed 0 --out out/world.jsonl
    python data.py stats out/world.jsonl
    python data.py load --jsonl raw.jsonl --map text=article,summary=highlights --out docs.jsonl
    python data.py load --hf cnn_dailymail --split validation --limit 500 --out cnn.jsonl
    python data.py split --docs out/world.jsonl --out out/split.json
    python data.py split --docs out/world.jsonl --check out/split.json

Where this departs from the sources: the SN15 guard clusters problems by an
identifier the subnet maintains; we have no such identifier, so clusters come
from MinHash over normalised word shingles plus entity and number features
(robust to paraphrase and attribute reordering). The plan drafts faulty
summaries with a 1B model and annotates them with GPT-4; on the news world both
roles are played by code that knows the facts, so every label is checkable.

Layering: stdlib, numpy, datasketch and `sandbox` only (no torch).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import random
import re
import sys
import time
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

import sandbox

DOC_VERSION = 1  # version of the Document JSONL record
WORLD_VERSION = 1  # version of the news world generator (bump when output bytes change)
MANIFEST_VERSION = 1  # version of the split manifest


class DataError(ValueError):
    """Bad input data: the message names the file, line or document at fault."""


class LeakError(RuntimeError):
    """A split whose pools share a leak cluster, or a manifest that no longer matches its documents."""


# ===========================================================================
# 1. The Document record and JSONL
# ===========================================================================


@dataclass
class Document:
    id: str  # stable id, e.g. "nw-0-000042"
    text: str  # the source article
    summary: str = ""  # reference summary ("" when unknown)
    source: str = ""  # where it came from: "newsworld", a dataset name, a file name
    bucket: str = ""  # stratum for splits: the event family in the news world
    cluster: str | None = None  # leak cluster id, filled by the split step
    facts: list[dict] = field(default_factory=list)  # news world fact table (see `Fact`)
    entities: dict[str, str] = field(default_factory=dict)  # news world: entity name -> type
    meta: dict = field(default_factory=dict)  # anything else (news world: event id, summary units)

    def to_json(self) -> dict:
        return {"version": DOC_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> "Document":
        """Parse one record; unknown fields and newer versions are errors, not silently dropped."""
        if not isinstance(d, dict):
            raise DataError(f"a document must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("version", DOC_VERSION)
        if not isinstance(version, int) or version > DOC_VERSION:
            raise DataError(f"document version {version!r} is newer than this code ({DOC_VERSION})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DataError(f"unknown document field(s) {unknown} (known: {sorted(names)})")
        for k in ("id", "text"):
            if not isinstance(d.get(k), str):
                raise DataError(f"document field {k!r} must be a string, got {d.get(k)!r:.60}")
        doc = cls(**d)
        check_document(doc)
        return doc


def check_document(doc: Document) -> None:
    """Reject documents no stage can use: no id, or empty / whitespace-only text."""
    if not doc.id or not str(doc.id).strip():
        raise DataError("document without an id")
    if not doc.text or not doc.text.strip():
        raise DataError(f"document {doc.id!r} is empty (no text)")


def dumps(doc: Document) -> str:
    """One JSONL line (no newline). Field order is fixed, so output is byte-stable."""
    return json.dumps(doc.to_json(), ensure_ascii=False)


def write_jsonl(path: str, docs: Iterable[Document]) -> int:
    """Write documents to `path` (atomically: temp file then rename). Returns the count."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    n = 0
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(dumps(doc) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


@dataclass
class LoadReport:
    """What a loader read: filled in as the stream is consumed."""
    source: str = ""
    n_lines: int = 0  # non-blank input lines / records seen
    n_docs: int = 0  # documents yielded
    n_bad: int = 0  # records skipped (only with skip_bad=True)
    errors: list[str] = field(default_factory=list)  # the first few skip reasons

    def skip(self, msg: str) -> None:
        self.n_bad += 1
        if len(self.errors) < 20:
            self.errors.append(msg)


def jsonl_records(path: str, report: LoadReport | None = None, skip_bad: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, parsed object) for each non-blank line, with errors that name file and line."""
    report = report if report is not None else LoadReport()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                msg = (f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                       f"re-encode the file as UTF-8")
                if not skip_bad:
                    raise DataError(msg) from None
                report.n_lines += 1
                report.skip(msg)
                continue
            if not line.strip():
                continue
            report.n_lines += 1
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            except ValueError as e:
                msg = f"{path}:{lineno}: malformed JSON line: {e}"
                if not skip_bad:
                    raise DataError(msg) from None
                report.skip(msg)
                continue
            yield lineno, obj


def _get_path(obj: dict, dotted: str):
    """obj["a"]["b"] for "a.b"; None when any step is missing."""
    cur = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


# Fields a mapping may fill. Lists (CNN/DM highlights in some dumps) are joined.
MAPPABLE = ("id", "text", "summary", "bucket", "source")


def parse_mapping(spec: str | dict | None) -> dict[str, str] | None:
    """'text=article,summary=highlights' (or a dict) -> {'text': 'article', 'summary': 'highlights'}."""
    if spec is None or isinstance(spec, dict):
        mapping = spec
    else:
        mapping = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise DataError(f"bad field mapping {part!r}: write ours=theirs, e.g. text=article")
            ours, theirs = (s.strip() for s in part.split("=", 1))
            mapping[ours] = theirs
    if mapping is not None:
        bad = sorted(set(mapping) - set(MAPPABLE))
        if bad:
            raise DataError(f"cannot map field(s) {bad}; mappable: {list(MAPPABLE)}")
        if "text" not in mapping:
            raise DataError("a field mapping must say where the text is, e.g. text=article")
    return mapping


def _as_text(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, list):
        return "\n".join(str(x) for x in v)
    return str(v)


def record_to_document(rec: dict, mapping: dict[str, str], default_id: str, source: str) -> Document:
    """A foreign record through a field mapping (ours -> theirs). Missing id: `default_id`."""
    vals = {k: _as_text(_get_path(rec, theirs)) for k, theirs in mapping.items()}
    text = vals.get("text")
    doc_id = vals.get("id") or default_id
    if text is None:
        raise DataError(f"document {doc_id!r} has no field {mapping['text']!r} (mapped to text)")
    return Document(id=doc_id, text=text, summary=vals.get("summary") or "",
                    source=vals.get("source") or source, bucket=vals.get("bucket") or "")


def load_jsonl(path: str, mapping: str | dict | None = None, limit: int | None = None,
               skip_bad: bool = False, report: LoadReport | None = None) -> Iterator[Document]:
    """Stream documents from a JSONL file.

    `mapping=None` reads our own `Document` records; a mapping such as
    `{"text": "article", "summary": "highlights", "id": "id"}` (or the string
    "text=article,summary=highlights") reads foreign records, dotted names reach
    into nested objects. Malformed lines, non-UTF-8 lines and empty documents
    raise a `DataError` naming file, line and id; with `skip_bad=True` they are
    skipped and counted in `report`.
    """
    mapping = parse_mapping(mapping)
    report = report if report is not None else LoadReport()
    report.source = path
    stem = os.path.splitext(os.path.basename(path))[0]
    if limit is not None and limit <= 0:
        return
    for lineno, rec in jsonl_records(path, report, skip_bad):
        try:
            if mapping is None:
                doc = Document.from_json(rec)
            else:
                doc = record_to_document(rec, mapping, f"{stem}-{lineno}", os.path.basename(path))
                check_document(doc)
        except (DataError, TypeError) as e:
            msg = f"{path}:{lineno}: {e}"
            if not skip_bad:
                raise DataError(msg) from None
            report.skip(msg)
            continue
        report.n_docs += 1
        yield doc
        if limit is not None and report.n_docs >= limit:
            return  # before reading on: a bad line past the limit is none of our business


def read_documents(path: str, limit: int | None = None) -> list[Document]:
    """All of our own Document records in `path` (strict)."""
    return list(load_jsonl(path, limit=limit))


# Known Hugging Face datasets: config and field mapping (ours -> theirs).
HF_PRESETS = {
    "cnn_dailymail": {"config": "3.0.0", "mapping": {"id": "id", "text": "article", "summary": "highlights"}},
    "abisee/cnn_dailymail": {"config": "3.0.0", "mapping": {"id": "id", "text": "article", "summary": "highlights"}},
    "xsum": {"config": None, "mapping": {"id": "id", "text": "document", "summary": "summary"}},
    "EdinburghNLP/xsum": {"config": None, "mapping": {"id": "id", "text": "document", "summary": "summary"}},
}


def load_hf(name: str, config: str | None = None, split: str = "train", mapping: str | dict | None = None,
            limit: int | None = None, streaming: bool = True, skip_bad: bool = False,
            report: LoadReport | None = None) -> Iterator[Document]:
    """Stream documents from a Hugging Face dataset (e.g. cnn_dailymail 3.0.0: article/highlights).

    `datasets` is imported here, not at module level, so the rest of the
    project never needs it. Missing package or no network (no local cache) is a
    `DataError` that says what to do.
    """
    preset = HF_PRESETS.get(name, {})
    config = config if config is not None else preset.get("config")
    mapping = parse_mapping(mapping if mapping is not None else preset.get("mapping"))
    if mapping is None:
        raise DataError(f"no field mapping for dataset {name!r}: pass one, e.g. text=article,summary=highlights")
    try:
        import datasets  # optional: only this loader needs it
    except ImportError as e:
        raise DataError(f"loading {name!r} needs the `datasets` package (pip install datasets): {e}") from None
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=streaming)
    except Exception as e:  # ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        raise DataError(
            f"could not load dataset {name!r} (config {config!r}, split {split!r}): {type(e).__name__}: {e}. "
            f"Offline machines need the dataset in the local cache (HF_DATASETS_OFFLINE=1) or a JSONL export "
            f"loaded with --jsonl and --map") from e
    report = report if report is not None else LoadReport()
    report.source = f"hf:{name}"
    if limit is not None and limit <= 0:
        return
    for i, rec in enumerate(ds):
        report.n_lines += 1
        try:
            doc = record_to_document(dict(rec), mapping, f"{name.split('/')[-1]}-{split}-{i}", name)
            check_document(doc)
        except DataError as e:
            if not skip_bad:
                raise DataError(f"{name} [{split} #{i}]: {e}") from None
            report.skip(f"{name} [{split} #{i}]: {e}")
            continue
        report.n_docs += 1
        yield doc
        if limit is not None and report.n_docs >= limit:
            return  # a streamed dataset is not read past the limit


# ===========================================================================
# 2. The news world: values, names and predicates
# ===========================================================================
#
# Every article is built from an *event* (entities, values, dates drawn by an
# event RNG) and a *surface* (templates, sentence order, optional clauses drawn
# by a surface RNG). A few articles retell an earlier article's event with a new
# surface: near-duplicates that the leak guard has to catch, as in real news.


def _rng(*parts) -> random.Random:
    """A private RNG keyed by `parts`; never the global one, never Python's salted hash()."""
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(h[:8], "big"))


@dataclass(frozen=True)
class Ent:
    name: str
    type: str  # person, company, city, region, team, party, court, university, journal, product, storm, agency, council, drug


@dataclass(frozen=True)
class Qty:
    text: str  # as written in the article: "$4.2 billion", "12%", "3,400 jobs", "3-1"
    amount: float | int | None  # normalised: dollars, percent points, a count; None for scores
    unit: str  # "usd", "percent", "score", "number" or the counted noun ("jobs")


@dataclass(frozen=True)
class When:
    text: str  # "March 3, 2024", "March 2024" or "2024"
    y: int
    m: int | None = None
    d: int | None = None


MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]
_MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def when(y: int, m: int | None = None, d: int | None = None) -> When:
    if m is None:
        return When(str(y), y)
    if d is None:
        return When(f"{MONTHS[m - 1]} {y}", y, m)
    return When(f"{MONTHS[m - 1]} {d}, {y}", y, m, d)


def _strip0(s: str) -> str:
    return s[:-2] if s.endswith(".0") else s


def money(amount: int) -> Qty:
    """$4.2 billion, $850 million, $12.5 million, $1,299. Amounts are whole dollars."""
    if amount >= 10**9:
        text = f"${_strip0(f'{amount / 1e9:.1f}')} billion"
    elif amount >= 10**6:
        m = amount / 1e6
        text = f"${round(m)} million" if m >= 100 else f"${_strip0(f'{m:.1f}')} million"
    else:
        text = f"${amount:,}"
    return Qty(text, parse_money(text), "usd")


def parse_money(text: str) -> int:
    m = re.fullmatch(r"\$\s?([\d,]+(?:\.\d+)?)(?:\s(million|billion|trillion))?", text.strip())
    if not m:
        raise ValueError(f"not a money amount: {text!r}")
    scale = {"million": 10**6, "billion": 10**9, "trillion": 10**12, None: 1}[m.group(2)]
    return int(Decimal(m.group(1).replace(",", "")) * scale)


def percent(p: float, style: str = "%") -> Qty:
    s = _strip0(f"{p:.1f}")
    return Qty(f"{s}%" if style == "%" else f"{s} percent", float(s), "percent")


def count(n: int, noun: str | None = None, unit: str | None = None) -> Qty:
    """3,400 jobs. `noun` is written after the number; `unit` is what is counted."""
    return Qty(f"{n:,} {noun}" if noun else f"{n:,}", n, unit or noun or "number")


def score(a: int, b: int) -> Qty:
    return Qty(f"{a}-{b}", None, "score")


# --- names -----------------------------------------------------------------
# Fixed pools (independent of the seed), so the world has one cast and the
# oracle one lexicon. Names are fictional and ASCII; several hundred of each
# kind, most of them several tokens long for a small BPE.

_FIRST = ("Maria James Aisha Chen Olga Rahul Fatima Lucas Ingrid Kwame Sofia Daniel Mei Omar Elena Tomas "
          "Priya Hannah Diego Yuki Amara Viktor Leila Samuel Nadia Felix Grace Mateo Zara Henrik Ana Marcus "
          "Ines Kofi Sara Pavel Lina Jonas Rosa Ethan Aiko Tariq Clara Bruno Esther Ivan Maya Rafael Noor "
          "Oscar Helena Idris Julia Kenji Laura Mikhail Nina Pablo Ruth Stefan Thandiwe Umar Vera Wei Ximena "
          "Yusuf Zofia Adrian Beatriz Carlos Dalia Emeka Freya Gideon Hiroshi Imani Joaquin").split()
_LAST = ("Okafor Lindqvist Moreau Tanaka Kowalski Haddad Brennan Castillo Novak Mensah Petrov Alvarez "
         "Nakamura Osei Fischer Rahman Duarte Abara Svensson Whitfield Marchetti Iqbal Volkova Adeyemi "
         "Holloway Ferreira Chowdhury Lambert Nguyen Quinlan Rossi Sato Takahashi Varga Weber Yilmaz Zhang "
         "Baptiste Carvalho Dimitrov Eriksen Gallagher Horvat Ivanova Jansen Kaur Lopez Mbeki Navarro Ortiz "
         "Reyes Schmidt Torres Valdez Achebe Bergstrom Cruz Delacroix Esposito Farouk Hussain Jovanovic "
         "Kiplagat Lachance Morales Nilsen Pereira Qureshi Romero Sokolov Thorne Umeh Vasquez Wallace "
         "Oyelaran Halvorsen Mirzaei Castellanos").split()
_ROOTS = ("Apex Borealis Cobalt Driftwood Ember Fairhaven Granite Helix Ironbridge Juniper Keystone Lumen "
          "Meridian Northwind Orion Pinnacle Quarry Redwood Summit Tidewater Umbra Vantage Westbrook Yarrow "
          "Zenith Aurora Beacon Crescent Evergreen Foxglove Harborline Indigo Kestrel Larkspur Monarch Nimbus "
          "Oakridge Polaris Quill Riverstone Sable Talon Valiant Willowmere Ashford Bramble Corvid Halcyon "
          "Solstice Tessellate").split()
_SECTORS = ("Holdings Group Systems Labs Energy Pharmaceuticals Motors Foods Airlines Networks Robotics "
            "Materials Media Logistics Semiconductors Insurance Retail Biotech Telecom Mining").split()
_FIRMS = "Capital Securities Partners Advisors Ventures".split()
_PLACE_PRE = "Port North South East West New Lake Fort Mount Glen".split()
_PLACE_BASE = ("Alder Brook Carver Dunmore Elmstead Fairfield Greyhaven Hollis Ivybridge Kingsley Larchmont "
               "Marlow Norbury Oakham Pembrook Quincy Rosedale Stanton Thornbury Upton Verity Whitby Yardley "
               "Ashby Bexley Calder Denholm Easton Farrow Gilmore Harwick Inglewood Kessling Linford Moorcroft "
               "Netherby Orrington Penhallow Redmere Saltash").split()
_REGIONS = ("Calvaria Norland Estmere Valdoria Ostrava Brenland Caldera Dunmark Elvaria Farhold Greymoor "
            "Hestia Istria Jorvale Kalmera Lorensa Marrowind Nordhaven Oberland Pellamar Quessa Rovania "
            "Sarentine Talmora Ulmstead Verano Westmarch Yselda Zarkova Amberly").split()
_MASCOTS = "Falcons Rovers Comets Wolves Titans Harriers Rangers Mariners Pilots Stags Lions Hornets".split()
_PARTIES = ["Progressive Alliance", "Civic Union", "Green Renewal Party", "Liberty Coalition", "Labour Front",
            "National Reform Party", "Democratic Forum", "People's Movement", "Unity Party", "Centre League",
            "Citizens' Party", "Rural Alliance", "Social Democrats", "Freedom Bloc"]
_JOURNALS = ["Journal of Clinical Insight", "Annals of Applied Ecology", "Review of Materials Science",
             "Bulletin of Public Health", "Journal of Cardiac Research", "Archives of Neurology Reports",
             "Journal of Sleep Studies", "Annals of Infectious Disease", "Review of Nutrition Science",
             "Journal of Metabolic Health", "Letters in Oncology", "Journal of Respiratory Care",
             "Annals of Paediatric Medicine", "Journal of Vision Research", "Review of Genetic Medicine",
             "Journal of Renal Medicine"]
_AGENCIES = ["Emergency Management Agency", "National Weather Bureau", "Competition Authority",
             "Securities Commission", "Health Research Council", "Civil Protection Office",
             "Transport Safety Board", "Consumer Protection Board", "Science Foundation",
             "Disaster Relief Service", "Energy Regulatory Office", "Medical Research Fund",
             "Markets Authority", "Coastal Guard Service", "Infrastructure Bank"]
_BRANDS = "Vela Orbit Pulse Quanta Lyra Nova Flux Echo Aria Zephyr Sonata Prism".split()
_MODELS = "Pro Air Max Mini Go Ultra Edge Plus".split()
_SYLL_A = "Vel Cor Zan Tri Max Lor Ben Dex Ful Ser Pra Qui Tol Nex Ram".split()
_SYLL_B = "azine itrex omab ivir aprin oxil umide enta".split()
_STORM_KIND = ["Storm", "Hurricane", "Cyclone", "Typhoon"]


def _unique(rng: random.Random, make: Callable[[], str], n: int) -> list[str]:
    out, seen = [], set()
    while len(out) < n:
        s = make()
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


@functools.lru_cache(maxsize=1)
def pools() -> dict[str, tuple[str, ...]]:
    """The world's cast by pool name (a pool's entities share a type, see `POOL_TYPE`)."""
    r = _rng("newsworld-cast", WORLD_VERSION)

    def person() -> str:
        mid = f" {r.choice('ABCDEFGHJKLMNPRSTW')}." if r.random() < 0.3 else ""
        return f"{r.choice(_FIRST)}{mid} {r.choice(_LAST)}"

    cities = [b for b in _PLACE_BASE] + _unique(r, lambda: f"{r.choice(_PLACE_PRE)} {r.choice(_PLACE_BASE)}", 200)
    return {
        "person": tuple(_unique(r, person, 900)),
        "company": tuple(_unique(r, lambda: f"{r.choice(_ROOTS)} {r.choice(_SECTORS)}", 420)),
        "firm": tuple(_unique(r, lambda: f"{r.choice(_ROOTS)} {r.choice(_FIRMS)}", 120)),
        "city": tuple(cities),
        "region": tuple(_REGIONS),
        "team": tuple(_unique(r, lambda: f"{r.choice(_PLACE_BASE)} {r.choice(_MASCOTS)}", 240)),
        "party": tuple(_PARTIES),
        "court": tuple(_unique(r, lambda: r.choice([f"{r.choice(_PLACE_BASE)} District Court",
                                                     f"{r.choice(_REGIONS)} Court of Appeals",
                                                     f"{r.choice(_REGIONS)} Supreme Court"]), 90)),
        "university": tuple(_unique(r, lambda: r.choice([f"University of {r.choice(_PLACE_BASE)}",
                                                          f"{r.choice(_ROOTS)} Institute of Technology",
                                                          f"{r.choice(_PLACE_BASE)} State University"]), 120)),
        "journal": tuple(_JOURNALS),
        "product": tuple(_unique(r, lambda: f"{r.choice(_BRANDS)} {r.choice(_MODELS)}", 80)),
        "storm": tuple(_unique(r, lambda: f"{r.choice(_STORM_KIND)} {r.choice(_FIRST)}", 160)),
        "agency": tuple(_AGENCIES),
        "council": tuple(f"{b} City Council" for b in _PLACE_BASE),
        "drug": tuple(_unique(r, lambda: f"{r.choice(_SYLL_A)}{r.choice(_SYLL_B)}", 90)),
    }


POOL_TYPE = {"firm": "company"}  # pools whose entities share another pool's type


@functools.lru_cache(maxsize=1)
def world_lexicon() -> dict[str, str]:
    """Every name in the world's cast -> its entity type (for spotting extrinsic entities)."""
    lex = {}
    for pool, names in pools().items():
        for n in names:
            lex.setdefault(n, POOL_TYPE.get(pool, pool))
    return lex


class Cast:
    """Draws an event's entities: distinct names, no two sharing a word (no 'Apex Labs' next to 'Apex Media')."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used_words: set[str] = set()

    def take(self, pool: str) -> Ent:
        names = pools()[pool]
        for _ in range(200):
            name = self.rng.choice(names)
            ws = {w for w in name.replace(".", " ").split() if len(w) > 2 and w not in _SHARED_NAME_WORDS}
            if not ws & self.used_words:
                self.used_words |= ws
                return Ent(name, POOL_TYPE.get(pool, pool))
        raise RuntimeError(f"cast pool {pool!r} exhausted")  # cannot happen with pools this size


# Words many names share; sharing them does not make two names confusable.
_SHARED_NAME_WORDS = frozenset("University State Institute Technology District Court Appeals Supreme City Council "
                               "Storm Hurricane Cyclone Typhoon Journal Annals Review Bulletin Archives Letters "
                               "Research Medicine Science Health".split())


# --- predicates -------------------------------------------------------------
# A predicate class has surface forms (affirmative, negated); a conflicting
# class gives the "wrong predicate" error (rose -> fell). The oracle spots a
# class by these forms (plus a few detection-only words).

PREDICATES: dict[str, list[tuple[str, str]]] = {
    "rise": [("rose", "did not rise"), ("climbed", "did not climb"), ("grew", "did not grow"),
             ("increased", "did not increase")],
    "fall": [("fell", "did not fall"), ("declined", "did not decline"), ("dropped", "did not drop"),
             ("slipped", "did not slip")],
    "buy": [("agreed to acquire", "did not agree to acquire"), ("agreed to buy", "did not agree to buy")],
    "sell": [("agreed to sell", "did not agree to sell"), ("agreed to divest", "did not agree to divest")],
    "win": [("won", "did not win")],
    "lose": [("lost", "did not lose")],
    "beat": [("beat", "did not beat"), ("defeated", "did not defeat")],
    "lose_to": [("lost to", "did not lose to"), ("fell to", "did not fall to")],
    "rule_for": [("ruled in favour of", "did not rule in favour of"), ("sided with", "did not side with")],
    "rule_against": [("ruled against", "did not rule against")],
    "launch": [("launched", "did not launch"), ("unveiled", "did not unveil")],
    "cancel": [("cancelled", "did not cancel"), ("scrapped", "did not scrap")],
    "reduce": [("reduced", "did not reduce"), ("lowered", "did not lower")],
    "increase": [("increased", "did not increase"), ("raised", "did not raise")],
    "cut": [("will cut", "will not cut"), ("plans to cut", "does not plan to cut")],
    "add": [("will add", "will not add"), ("plans to add", "does not plan to add")],
    "approve": [("approved", "did not approve"), ("backed", "did not back")],
    "reject": [("rejected", "did not reject"), ("voted down", "did not vote down")],
    "appeal": [("will appeal", "will not appeal"), ("plans to appeal", "does not plan to appeal")],
    "kill": [("killed", "did not kill"), ("claimed the lives of", "did not claim the lives of")],
    "hit": [("hit", "did not hit"), ("struck", "did not strike")],
    "require": [("requires", "does not require"), ("needs", "does not need")],
    "play": [("played", "did not play")],
    "raise": [("raised", "did not raise"), ("secured", "did not secure")],
}
CONFLICT = {"rise": "fall", "fall": "rise", "buy": "sell", "sell": "buy", "win": "lose", "lose": "win",
            "beat": "lose_to", "lose_to": "beat", "rule_for": "rule_against", "rule_against": "rule_for",
            "launch": "cancel", "cancel": "launch", "reduce": "increase", "increase": "reduce",
            "cut": "add", "add": "cut", "approve": "reject", "reject": "approve"}
# Extra words that signal a class without being a verb form the generator writes.
_PRED_EXTRA = {"rise": ("up",), "fall": ("down",)}
_NEGATION = re.compile(r"\b(?:not|never|no longer)\b|n't\b", re.I)


def verb(pred: str, polarity: bool, rng: random.Random) -> str:
    past, neg = rng.choice(PREDICATES[pred])
    return past if polarity else neg


# ===========================================================================
# 3. The news world: event families
# ===========================================================================
#
# A family is declarative: a `make(rng)` that draws an event (role -> `_F`), the
# cue words that identify each role's claim in any sentence, article sentence
# specs and summary units. Templates use `{role.attr}` slots (attr: subj, obj,
# other, value, date, verb, or an extra such as office) and optional clauses
# `[role: text]` that state another role when included.
#
# Cue discipline (what keeps the oracle exact): a distractor that shares a
# subject and a unit with a key fact carries a cue group of its own ("a year
# earlier", "rival", "previous round") that no summary unit uses, so a summary
# sentence that copies the distractor's number is still read as a claim about
# the key fact, and flagged.


@dataclass
class _F:
    """A fact while an event is being drawn (serialised as a fact-table dict)."""
    subj: Ent | None
    obj: Ent | None = None
    other: Ent | None = None
    value: Qty | None = None
    date: When | None = None
    pred: str | None = None  # predicate class (PREDICATES), written through {role.verb}
    polarity: bool = True  # False: the article states the negation ("will not appeal")
    extra: dict = field(default_factory=dict)  # plain-text attributes, not checked (office, project)


@dataclass(frozen=True)
class Sent:
    roles: tuple[str, ...]  # the roles this sentence states (optional clauses may add more)
    templates: tuple[str, ...]
    distractor: bool = False  # reuses the event's entities/numbers in another role


@dataclass(frozen=True)
class Unit:
    name: str
    roles: tuple[str, ...]
    templates: tuple[str, ...]


@dataclass(frozen=True)
class Family:
    name: str
    make: Callable[[random.Random], dict[str, _F]]
    cues: dict[str, tuple[tuple[str, ...], ...]]  # role -> groups; each group must be matched
    lead: tuple[Sent, ...]  # one of these opens the article
    body: tuple[Sent, ...]
    units: tuple[Unit, ...]  # units[0] opens every summary


def S(roles: str, *templates: str, distractor: bool = False) -> Sent:
    return Sent(tuple(roles.split()), templates, distractor)


def U(name: str, roles: str, *templates: str) -> Unit:
    return Unit(name, tuple(roles.split()), templates)


def C(*groups: str) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(g.split("|")) for g in groups)


class _Vals:
    """Draws an event's numbers and dates; no two with the same text, so every role is identifiable."""

    def __init__(self, r: random.Random):
        self.r = r
        self.seen: set[str] = set()
        self.pct_style = "%" if r.random() < 0.7 else "percent"

    def _new(self, make: Callable[[], Qty | When]):
        for _ in range(100):
            q = make()
            if q.text not in self.seen:
                self.seen.add(q.text)
                return q
        raise RuntimeError("could not draw a distinct value")  # cannot happen with these ranges

    def big_money(self, lo_b: float = 1.2, hi_b: float = 48.0) -> Qty:
        r = self.r
        return self._new(lambda: money(r.randint(int(lo_b * 10), int(hi_b * 10)) * 10**8) if r.random() < 0.6
                         else money(r.randint(12, 98) * 10 * 10**6))

    def millions(self, lo: int, hi: int) -> Qty:
        r = self.r
        return self._new(lambda: money(r.randint(lo * 10, hi * 10) * 10**5 if r.random() < 0.3
                                       else r.randint(lo, hi) * 10**6))

    def near(self, q: Qty, lo: float, hi: float) -> Qty:
        r = self.r
        return self._new(lambda: money(int(round(q.amount * r.uniform(lo, hi)))))

    def dollars(self, lo: int, hi: int) -> Qty:
        r = self.r
        return self._new(lambda: money(r.randint(lo // 100, hi // 100) * 100 - 1))

    def pct(self, lo: float, hi: float) -> Qty:
        r = self.r
        return self._new(lambda: percent(r.randint(int(lo * 10), int(hi * 10)) / 10 if r.random() < 0.3
                                         else r.randint(int(lo), int(hi)), self.pct_style))

    def count(self, lo: int, hi: int, noun: str | None, unit: str | None = None, step: int = 10) -> Qty:
        r = self.r
        return self._new(lambda: count(r.randint(lo // step, hi // step) * step, noun, unit))

    def small(self, lo: int, hi: int, noun: str) -> Qty:
        r = self.r
        return self._new(lambda: count(r.randint(lo, hi), noun))

    def date(self, y: int, m: int | None = None, day: bool = True) -> When:
        r = self.r
        return self._new(lambda: when(y, m or r.randint(1, 12), r.randint(1, 28) if day else None))

    def year(self, lo: int, hi: int) -> When:
        r = self.r
        return self._new(lambda: when(r.randint(lo, hi)))


# --- earnings --------------------------------------------------------------

def _make_earnings(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    c, rival, ceo, an, bank, city = (cast.take(p) for p in ("company", "company", "person", "person", "firm", "city"))
    y = r.randint(2016, 2029)
    qm, qd = r.choice([(3, 31), (6, 30), (9, 30), (12, 31)])
    rev = v.big_money()
    growth = v.pct(2, 28)
    up = r.random() < 0.75
    exact = rev.amount / (1 + growth.amount / 100 if up else 1 - growth.amount / 100)
    tries = iter(range(1000))
    # The exact prior can print like a value already drawn (same rounded text):
    # then a value within 3% keeps the story coherent and every value distinct.
    prior = v._new(lambda: money(int(round(exact if next(tries) == 0 else exact * r.uniform(0.97, 1.03)))))
    return {
        "rev": _F(c, value=rev, date=v._new(lambda: when(y, qm, qd))),
        "growth": _F(c, value=growth, pred="rise" if up else "fall"),
        "prior": _F(c, value=prior, date=v._new(lambda: when(y - 1, qm, qd))),
        "est": _F(c, value=v.near(rev, 0.9, 1.1)),
        "rival": _F(rival, value=v.near(rev, 0.4, 1.6)),
        "profit": _F(c, value=v.near(rev, 0.04, 0.2)),
        "guidance": _F(c, value=v.near(rev, 3.6, 4.6), date=v._new(lambda: when(y + 1))),
        "jobs": _F(c, value=v.count(200, 6000, "jobs"), pred="cut" if r.random() < 0.6 else "add"),
        "shares": _F(c, value=v.pct(1, 15), pred=r.choice(["rise", "fall"])),
        "ceo": _F(ceo, obj=c),
        "analyst": _F(an, obj=bank),
        "hq": _F(c, obj=city),
        "founded": _F(c, date=v.year(1990, 2012)),
    }


EARNINGS = Family(
    "earnings", _make_earnings,
    cues={
        "rev": C("revenue|sales", "quarter|quarterly|period|three months"),
        "growth": C("revenue|sales"),
        "prior": C("revenue|sales", "a year earlier|a year ago|previous year"),
        "est": C("analysts", "expected"),
        "rival": C("rival"),
        "profit": C("net profit|net income"),
        "guidance": C("expects|outlook"),
        "jobs": C("jobs"),
        "shares": C("shares"),
        "ceo": C("chief executive"),
        "analyst": C("analyst"),
        "hq": C("based|headquartered"),
        "founded": C("founded"),
    },
    lead=(
        S("rev growth",
          "{rev.subj}[hq:, which is based in {hq.obj},] reported revenue of {rev.value} for the quarter ended "
          "{rev.date}, as sales {growth.verb} {growth.value}.",
          "Revenue at {rev.subj} {growth.verb} {growth.value} to {rev.value} in the quarter ended {rev.date}"
          "[hq:, the {hq.obj}-based company said].",
          "In the three months to {rev.date}, sales at {rev.subj} {growth.verb} {growth.value} to {rev.value}."),
    ),
    body=(
        S("profit", "{profit.subj} said net profit came to {profit.value}.",
          "Net profit reached {profit.value}, the company said."),
        S("prior", "A year earlier, {prior.subj} had reported revenue of {prior.value} for the quarter ended "
                   "{prior.date}.",
          "That compares with revenue of {prior.value} in the quarter ended {prior.date}, a year earlier.",
          distractor=True),
        S("est", "Analysts had expected revenue of {est.value}.",
          "The result compared with the {est.value} that analysts had expected.", distractor=True),
        S("rival", "Rival {rival.subj} reported revenue of {rival.value} for the same period.",
          "{rival.subj}, its closest rival, posted revenue of {rival.value} last week.", distractor=True),
        S("jobs", "{jobs.subj} {jobs.verb} {jobs.value} over the next two years.",
          "{jobs.subj} also said it {jobs.verb} {jobs.value}."),
        S("shares", "Shares of {shares.subj} {shares.verb} {shares.value} in early trading.",
          "{shares.subj} shares {shares.verb} {shares.value} after the results were published."),
        S("guidance", "{guidance.subj} expects revenue of {guidance.value} for {guidance.date}.",
          "For {guidance.date}, the company expects revenue of about {guidance.value}."),
        S("ceo", "\"Demand was strong in every region,\" said {ceo.subj}, chief executive of {ceo.obj}.",
          "{ceo.subj}, the chief executive of {ceo.obj}, said the company would keep investing in new products."),
        S("analyst", "{analyst.subj}, an analyst at {analyst.obj}, said the results were better than many "
                     "investors had feared."),
        S("founded", "{founded.subj} was founded in {founded.date}[hq: and is based in {hq.obj}].",
          "Founded in {founded.date}, {founded.subj} makes most of its money abroad."),
    ),
    units=(
        U("lead", "rev growth",
          "{rev.subj} reported revenue of {rev.value} for the quarter ended {rev.date}, as sales {growth.verb} "
          "{growth.value}.",
          "Revenue at {rev.subj} {growth.verb} {growth.value} to {rev.value} in the quarter ended {rev.date}.",
          "Quarterly revenue at {rev.subj} {growth.verb} {growth.value} to {rev.value} in the period ended "
          "{rev.date}."),
        U("profit", "profit", "{profit.subj} reported a net profit of {profit.value}.",
          "Net profit at {profit.subj} came to {profit.value}."),
        U("jobs", "jobs", "{jobs.subj} {jobs.verb} {jobs.value} over the next two years.",
          "{jobs.subj} said it {jobs.verb} {jobs.value}."),
        U("guidance", "guidance", "{guidance.subj} expects revenue of {guidance.value} for {guidance.date}.",
          "For {guidance.date}, {guidance.subj} expects revenue of about {guidance.value}."),
        U("shares", "shares", "Shares of {shares.subj} {shares.verb} {shares.value} after the report.",
          "{shares.subj} shares {shares.verb} {shares.value} after the results."),
    ),
)


# --- acquisitions ----------------------------------------------------------

def _make_acquisition(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    a, t, bidder, past_t = (cast.take("company") for _ in range(4))
    ceo_a, ceo_t, agency, city = cast.take("person"), cast.take("person"), cast.take("agency"), cast.take("city")
    y = r.randint(2016, 2029)
    price = v.big_money(1.5, 60)
    return {
        "deal": _F(a, obj=t, value=price, date=v.date(y), pred="buy"),
        "premium": _F(a, obj=t, value=v.pct(12, 60)),
        "close": _F(a, obj=t, date=v._new(lambda: when(y + 1, r.randint(1, 12)))),
        "staff": _F(t, value=v.count(800, 40000, "employees")),
        "bid": _F(bidder, obj=t, value=v.near(price, 0.7, 0.95), date=v._new(lambda: when(y - 1, r.randint(1, 12)))),
        "past": _F(a, obj=past_t, value=v.near(price, 0.1, 0.6), date=v.year(y - 8, y - 2)),
        "reg": _F(a, obj=agency, pred="require", polarity=r.random() < 0.6),
        "ceo_a": _F(ceo_a, obj=a),
        "ceo_t": _F(ceo_t, obj=t),
        "hq": _F(t, obj=city),
        "shares_t": _F(t, value=v.pct(5, 40), pred="rise"),
    }


ACQUISITION = Family(
    "acquisition", _make_acquisition,
    cues={
        "deal": C("acquire|buy|sell|divest"),
        "premium": C("premium"),
        "close": C("close"),
        "staff": C("employees"),
        "bid": C("bid|offered"),
        "past": C("previously"),
        "reg": C("approval"),
        "ceo_a": C("chief executive"),
        "ceo_t": C("founded|founder"),
        "hq": C("based|headquartered"),
        "shares_t": C("shares"),
    },
    lead=(
        S("deal", "{deal.subj} {deal.verb} {deal.obj}[hq:, which is based in {hq.obj},] for {deal.value} on "
                  "{deal.date}.",
          "On {deal.date}, {deal.subj} {deal.verb} {deal.obj} for {deal.value}[hq:, adding a business based in "
          "{hq.obj}]."),
    ),
    body=(
        S("premium", "The price is a premium of {premium.value} to the last closing price of {premium.obj}.",
          "{premium.subj} is paying a premium of {premium.value} for {premium.obj}."),
        S("close", "The deal for {close.obj} is expected to close in {close.date}.",
          "{close.subj} expects the purchase of {close.obj} to close in {close.date}."),
        S("staff", "{staff.subj} employs {staff.value}[hq: and is based in {hq.obj}].",
          "The deal brings {staff.value} from {staff.subj} into the group."),
        S("bid", "{bid.subj} had made a rival bid of {bid.value} for {bid.obj} in {bid.date}.",
          "In {bid.date}, {bid.subj} offered {bid.value} for {bid.obj}, a bid that was turned down.",
          distractor=True),
        S("past", "{past.subj} previously bought {past.obj} for {past.value} in {past.date}.",
          "In {past.date}, {past.subj} had previously paid {past.value} for {past.obj}.", distractor=True),
        S("reg", "The deal {reg.verb} approval from the {reg.obj}.",
          "The transaction {reg.verb} the approval of the {reg.obj}."),
        S("ceo_a", "\"This is a natural fit for both companies,\" said {ceo_a.subj}, chief executive of {ceo_a.obj}.",
          "{ceo_a.subj}, chief executive of {ceo_a.obj}, called the deal a natural fit."),
        S("ceo_t", "{ceo_t.subj}, who founded {ceo_t.obj}, will stay on to run the business.",
          "{ceo_t.obj} founder {ceo_t.subj} is expected to stay on."),
        S("shares_t", "Shares of {shares_t.subj} {shares_t.verb} {shares_t.value} on the news.",
          "{shares_t.subj} shares {shares_t.verb} {shares_t.value} after the announcement."),
    ),
    units=(
        U("lead", "deal", "{deal.subj} {deal.verb} {deal.obj} for {deal.value} on {deal.date}.",
          "On {deal.date}, {deal.subj} {deal.verb} {deal.obj} for {deal.value}."),
        U("premium", "premium", "{premium.subj} is paying a premium of {premium.value} for {premium.obj}."),
        U("close", "close", "The deal for {close.obj} is expected to close in {close.date}."),
        U("staff", "staff", "{staff.subj} employs {staff.value}."),
        U("reg", "reg", "The deal {reg.verb} approval from the {reg.obj}."),
        U("shares_t", "shares_t", "Shares of {shares_t.subj} {shares_t.verb} {shares_t.value} on the news."),
    ),
)


# --- elections -------------------------------------------------------------

def _make_election(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    w, loser, prev = cast.take("person"), cast.take("person"), cast.take("person")
    party_w, party_l = cast.take("party"), cast.take("party")
    place = cast.take("city") if r.random() < 0.6 else cast.take("region")
    office = f"{'mayor' if place.type == 'city' else 'governor'} of {place.name}"
    y = r.randint(2016, 2030)
    share_w = v.pct(41, 68)
    return {
        "win": _F(w, obj=place, value=share_w, date=v.date(y), pred="win", extra={"office": office}),
        "votes": _F(w, value=v.count(12000, 900000, "votes", step=1)),
        "loser": _F(loser, obj=party_l, value=v.pct(20, min(40.0, share_w.amount - 1))),
        "turnout": _F(place, value=v.pct(35, 80)),
        "party": _F(w, obj=party_w),
        "prev": _F(prev, obj=place, date=v.year(y - 16, y - 5)),
        "prior": _F(loser, value=v.pct(25, 60), date=v._new(lambda: when(y - 4))),
        "pledge": _F(w, value=v.count(1000, 50000, "new homes", "homes", step=100)),
        "sworn": _F(w, date=v.date(y)),
    }


ELECTION = Family(
    "election", _make_election,
    cues={
        "win": C("race|election"),
        "votes": C("votes"),
        "loser": C("second|runner-up"),
        "turnout": C("turnout"),
        "party": C("candidate"),
        "prev": C("held"),
        "prior": C("previous election"),
        "pledge": C("pledged|promised"),
        "sworn": C("sworn"),
    },
    lead=(
        S("win", "{win.subj} {win.verb} the race for {win.office} on {win.date} with {win.value} of the vote.",
          "{win.subj}[party:, the {party.obj} candidate,] {win.verb} the election for {win.office} on {win.date}, "
          "taking {win.value} of the vote."),
    ),
    body=(
        S("votes", "{votes.subj} received {votes.value}, according to official results.",
          "Official results gave {votes.subj} {votes.value}."),
        S("loser", "{loser.subj} of the {loser.obj} finished second with {loser.value}.",
          "The runner-up, {loser.subj} of the {loser.obj}, took {loser.value}."),
        S("turnout", "Turnout in {turnout.subj} was {turnout.value}, election officials said.",
          "Officials put turnout in {turnout.subj} at {turnout.value}."),
        S("party", "{party.subj} ran as the {party.obj} candidate."),
        S("prev", "{prev.subj}, who had held the post since {prev.date}, is retiring.",
          "The post had been held by {prev.subj} since {prev.date}."),
        S("prior", "In the previous election, in {prior.date}, {prior.subj} won {prior.value} of the vote.",
          "{prior.subj} had taken {prior.value} in the previous election in {prior.date}.", distractor=True),
        S("pledge", "During the campaign, {pledge.subj} promised to build {pledge.value}.",
          "{pledge.subj} has pledged to build {pledge.value}."),
        S("sworn", "{sworn.subj} will be sworn in on {sworn.date}.",
          "{sworn.subj} is due to be sworn in on {sworn.date}."),
    ),
    units=(
        U("lead", "win",
          "{win.subj} {win.verb} the race for {win.office} on {win.date} with {win.value} of the vote.",
          "On {win.date}, {win.subj} {win.verb} the election for {win.office} with {win.value} of the vote."),
        U("loser", "loser", "{loser.subj} finished second with {loser.value}."),
        U("votes", "votes", "{votes.subj} received {votes.value}."),
        U("turnout", "turnout", "Turnout in {turnout.subj} was {turnout.value}."),
        U("pledge", "pledge", "{pledge.subj} has pledged to build {pledge.value}."),
        U("sworn", "sworn", "{sworn.subj} will be sworn in on {sworn.date}."),
    ),
)


# --- sports results ----------------------------------------------------------

def _make_sports(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    home, away = cast.take("team"), cast.take("team")
    star, hurt, coach, venue = cast.take("person"), cast.take("person"), cast.take("person"), cast.take("city")
    y = r.randint(2016, 2030)
    if r.random() < 0.5:  # football
        h = r.randint(2, 5)
        res, prev = score(h, r.randint(0, h - 1)), score(r.randint(3, 5), r.randint(0, 2))
        scored = count(r.randint(2, min(h, 3)), "goals")
    else:  # basketball
        h = r.randint(85, 130)
        res, prev = score(h, h - r.randint(1, 20)), score(r.randint(100, 125), r.randint(80, 99))
        scored = count(r.randint(18, 45), "points")
    return {
        "result": _F(home, obj=away, value=res, date=v.date(y), pred="beat"),
        "scorer": _F(star, obj=home, value=scored),
        "crowd": _F(home, value=v.count(8000, 80000, None, "spectators")),
        "venue": _F(home, obj=venue),
        "season": _F(home, value=v.small(5, 30, "wins")),
        "prev": _F(away, obj=home, value=prev, date=v._new(lambda: when(y - 1))),
        "coach": _F(coach, obj=home),
        "injury": _F(hurt, obj=away, pred="play", polarity=False),
    }


SPORTS = Family(
    "sports", _make_sports,
    cues={
        "result": C("beat|defeat|defeated|lost to|fell to|lose to|fall to"),
        "scorer": C("scored"),
        "crowd": C("crowd"),
        "venue": C("played in|hosted"),
        "season": C("this season"),
        "prev": C("previous meeting"),
        "coach": C("coach|coaches"),
        "injury": C("injury"),
    },
    lead=(
        S("result", "{result.subj} {result.verb} {result.obj} {result.value} on {result.date}[venue:, in a game "
                    "played in {venue.obj}].",
          "On {result.date}, {result.subj} {result.verb} {result.obj} {result.value}."),
    ),
    body=(
        S("scorer", "{scorer.subj} scored {scorer.value} for {scorer.obj}.",
          "{scorer.obj} were led by {scorer.subj}, who scored {scorer.value}."),
        S("crowd", "A crowd of {crowd.value} watched the game.", "The game drew a crowd of {crowd.value}."),
        S("venue", "{venue.subj} hosted the game in {venue.obj}.", "The game was played in {venue.obj}."),
        S("season", "The result gives {season.subj} {season.value} this season.",
          "{season.subj} now have {season.value} this season."),
        S("prev", "{prev.subj} had won the previous meeting {prev.value} in {prev.date}.",
          "In the previous meeting, in {prev.date}, {prev.subj} beat {prev.obj} {prev.value}.", distractor=True),
        S("coach", "\"We showed real belief tonight,\" said {coach.subj}, the coach of {coach.obj}.",
          "{coach.subj}, who coaches {coach.obj}, praised the defence."),
        S("injury", "{injury.subj} {injury.verb} for {injury.obj} because of an injury.",
          "{injury.obj} were without {injury.subj}, who {injury.verb} because of an injury."),
    ),
    units=(
        U("lead", "result", "{result.subj} {result.verb} {result.obj} {result.value} on {result.date}.",
          "On {result.date}, {result.subj} {result.verb} {result.obj} {result.value}."),
        U("scorer", "scorer", "{scorer.subj} scored {scorer.value} for {scorer.obj}."),
        U("crowd", "crowd", "A crowd of {crowd.value} watched the game."),
        U("season", "season", "{season.subj} now have {season.value} this season."),
        U("injury", "injury", "{injury.subj} {injury.verb} for {injury.obj} because of an injury."),
    ),
)


# --- court rulings -----------------------------------------------------------

def _make_court(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    court, plaintiff, defendant, judge = cast.take("court"), cast.take("company"), cast.take("company"), cast.take("person")
    y = r.randint(2016, 2030)
    damages = v.millions(5, 900)
    return {
        "ruling": _F(court, obj=plaintiff, other=defendant, date=v.date(y),
                     pred="rule_for" if r.random() < 0.8 else "rule_against"),
        "damages": _F(defendant, obj=plaintiff, value=damages),
        "judge": _F(judge, obj=court),
        "appeal": _F(defendant, pred="appeal", polarity=r.random() < 0.6),
        "lower": _F(plaintiff, value=v.near(damages, 0.3, 0.8), date=v.year(y - 5, y - 1)),
        "sought": _F(plaintiff, value=v.near(damages, 1.5, 4.0)),
        "filed": _F(plaintiff, obj=defendant, date=v.year(y - 9, y - 2)),
        "patents": _F(plaintiff, value=v.small(2, 40, "patents")),
    }


COURT = Family(
    "court", _make_court,
    cues={
        "ruling": C("ruled|sided|rule|side"),
        "damages": C("damages"),
        "judge": C("judge"),
        "appeal": C("appeal"),
        "lower": C("lower court"),
        "sought": C("sought|asked for"),
        "filed": C("filed"),
        "patents": C("patents"),
    },
    lead=(
        S("ruling", "{ruling.subj} {ruling.verb} {ruling.obj} in its case against {ruling.other} on {ruling.date}.",
          "On {ruling.date}, {ruling.subj} {ruling.verb} {ruling.obj} in a dispute with {ruling.other}."),
    ),
    body=(
        S("damages", "{damages.subj} was ordered to pay {damages.value} in damages to {damages.obj}.",
          "The court ordered {damages.subj} to pay {damages.obj} {damages.value} in damages."),
        S("judge", "Judge {judge.subj} wrote the decision for {judge.obj}.",
          "The decision was written by Judge {judge.subj} of {judge.obj}."),
        S("appeal", "{appeal.subj} said it {appeal.verb} the decision.",
          "{appeal.subj} {appeal.verb} the decision, a spokesperson said."),
        S("lower", "A lower court had awarded {lower.subj} {lower.value} in {lower.date}.",
          "In {lower.date}, a lower court had awarded {lower.value} to {lower.subj}.", distractor=True),
        S("sought", "{sought.subj} had sought {sought.value}.",
          "{sought.subj} had asked for {sought.value} in the lawsuit.", distractor=True),
        S("filed", "{filed.subj} filed the lawsuit against {filed.obj} in {filed.date}.",
          "The lawsuit was filed by {filed.subj} against {filed.obj} in {filed.date}."),
        S("patents", "The case concerned {patents.value} held by {patents.subj}.",
          "At issue were {patents.value} owned by {patents.subj}."),
    ),
    units=(
        U("lead", "ruling",
          "{ruling.subj} {ruling.verb} {ruling.obj} in its case against {ruling.other} on {ruling.date}.",
          "On {ruling.date}, {ruling.subj} {ruling.verb} {ruling.obj} in its dispute with {ruling.other}."),
        U("damages", "damages", "{damages.subj} was ordered to pay {damages.value} in damages to {damages.obj}."),
        U("appeal", "appeal", "{appeal.subj} said it {appeal.verb} the decision."),
        U("filed", "filed", "{filed.subj} filed the lawsuit against {filed.obj} in {filed.date}."),
        U("patents", "patents", "The case concerned {patents.value} held by {patents.subj}."),
    ),
)


# --- storms ------------------------------------------------------------------

def _make_storm(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    storm, old_storm, city, official, agency = (cast.take(p) for p in ("storm", "storm", "city", "person", "agency"))
    y = r.randint(2016, 2030)
    deaths = v.small(3, 180, "people")
    return {
        "hit": _F(storm, obj=city, value=v.count(80, 180, "mph", step=5), date=v.date(y), pred="hit"),
        "deaths": _F(storm, value=deaths, pred="kill"),
        "evac": _F(storm, obj=city, value=v.count(2000, 250000, "residents", step=100)),
        "damage": _F(storm, value=v.big_money(0.1, 12) if r.random() < 0.5 else v.millions(20, 900)),
        "power": _F(storm, value=v.count(10000, 900000, "homes", step=100)),
        "official": _F(official, obj=agency),
        "past": _F(old_storm, value=v.small(5, 400, "people"), date=v.year(1990, y - 3)),
        "aid": _F(agency, value=v.millions(5, 500)),
    }


STORM = Family(
    "storm", _make_storm,
    cues={
        "hit": C("hit|struck|strike|winds"),
        "deaths": C("killed|kill|killing|dead|lives"),
        "evac": C("evacuated"),
        "damage": C("damage"),
        "power": C("power"),
        "official": C("director"),
        "past": C("since"),
        "aid": C("aid"),
    },
    lead=(
        S("hit", "{hit.subj} {hit.verb} {hit.obj} on {hit.date} with winds of {hit.value}.",
          "With winds of {hit.value}, {hit.subj} {hit.verb} {hit.obj} on {hit.date}."),
    ),
    body=(
        S("deaths", "The storm {deaths.verb} {deaths.value}, officials said.",
          "Officials said {deaths.subj} {deaths.verb} {deaths.value}."),
        S("evac", "More than {evac.value} were evacuated from {evac.obj}.",
          "Authorities evacuated {evac.value} from {evac.obj} before the storm arrived."),
        S("damage", "Insurers put the damage at {damage.value}.",
          "{damage.subj} caused an estimated {damage.value} in damage."),
        S("power", "About {power.value} were left without power.",
          "Power was knocked out to {power.value} across the region."),
        S("official", "{official.subj}, director of the {official.obj}, said rescue teams were working through "
                      "the night."),
        S("past", "It was the deadliest storm in the region since {past.date}, when {past.subj} killed {past.value}.",
          "{past.subj} killed {past.value} in {past.date}, the worst toll in the region since records began.",
          distractor=True),
        S("aid", "The {aid.subj} released {aid.value} in emergency aid.",
          "Emergency aid of {aid.value} was approved by the {aid.subj}."),
    ),
    units=(
        U("lead", "hit", "{hit.subj} {hit.verb} {hit.obj} on {hit.date} with winds of {hit.value}.",
          "On {hit.date}, {hit.subj} {hit.verb} {hit.obj} with winds of {hit.value}."),
        U("deaths", "deaths", "{deaths.subj} {deaths.verb} {deaths.value}.", "The storm {deaths.verb} {deaths.value}."),
        U("evac", "evac", "More than {evac.value} were evacuated from {evac.obj}."),
        U("damage", "damage", "{damage.subj} caused an estimated {damage.value} in damage."),
        U("power", "power", "About {power.value} were left without power."),
    ),
)


# --- product launches ----------------------------------------------------------

def _make_launch(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    c, product, rival, rival_product, ceo, city = (cast.take(p) for p in
                                                   ("company", "product", "company", "product", "person", "city"))
    y = r.randint(2016, 2030)
    m = r.randint(1, 10)
    return {
        "launch": _F(c, obj=product, date=v.date(y, m), pred="launch"),
        "price": _F(product, value=v.dollars(200, 2000)),
        "orders": _F(c, value=v.count(20000, 2000000, "orders", step=1000)),
        "battery": _F(product, value=v.small(8, 40, "hours")),
        "rival": _F(rival, obj=rival_product, value=v.dollars(200, 2000)),
        "prev": _F(c, value=v.dollars(200, 2000), date=v.year(y - 4, y - 1)),
        "ceo": _F(ceo, obj=c),
        "ship": _F(product, date=v.date(y, m + r.randint(1, 2))),
        "factory": _F(c, obj=city),
    }


LAUNCH = Family(
    "launch", _make_launch,
    cues={
        "launch": C("launched|unveiled|cancelled|scrapped|launch|unveil|cancel|scrap"),
        "price": C("costs|priced"),
        "orders": C("orders"),
        "battery": C("battery"),
        "rival": C("rival"),
        "prev": C("previous model"),
        "ceo": C("chief executive"),
        "ship": C("on sale"),
        "factory": C("plant|factory"),
    },
    lead=(
        S("launch", "{launch.subj} {launch.verb} the {launch.obj} on {launch.date}[price:, priced at {price.value}].",
          "On {launch.date}, {launch.subj} {launch.verb} its new {launch.obj}[factory:, which is built at a plant in "
          "{factory.obj}]."),
    ),
    body=(
        S("price", "The {price.subj} costs {price.value}.", "The {price.subj} is priced at {price.value}."),
        S("orders", "{orders.subj} said it had received {orders.value} in the first week.",
          "The company has taken {orders.value} so far."),
        S("battery", "The {battery.subj} offers {battery.value} of battery life.",
          "Battery life on the {battery.subj} reaches {battery.value}."),
        S("rival", "Rival {rival.subj} sells its {rival.obj} for {rival.value}.",
          "The {rival.obj} from rival {rival.subj} sells for {rival.value}.", distractor=True),
        S("prev", "The previous model, released by {prev.subj} in {prev.date}, cost {prev.value}.",
          "In {prev.date}, the previous model from {prev.subj} sold for {prev.value}.", distractor=True),
        S("ceo", "\"This is the best device we have ever made,\" said {ceo.subj}, chief executive of {ceo.obj}.",
          "{ceo.subj}, chief executive of {ceo.obj}, called it the company's most important product."),
        S("ship", "The {ship.subj} goes on sale on {ship.date}.", "The {ship.subj} will be on sale from {ship.date}."),
        S("factory", "{factory.subj} builds the device at a plant in {factory.obj}."),
    ),
    units=(
        U("lead", "launch", "{launch.subj} {launch.verb} the {launch.obj} on {launch.date}.",
          "On {launch.date}, {launch.subj} {launch.verb} the {launch.obj}."),
        U("price", "price", "The {price.subj} costs {price.value}."),
        U("orders", "orders", "{orders.subj} has received {orders.value}."),
        U("battery", "battery", "The {battery.subj} offers {battery.value} of battery life."),
        U("ship", "ship", "The {ship.subj} goes on sale on {ship.date}."),
    ),
)


# --- research findings ------------------------------------------------------------

_CONDITIONS = ["heart disease", "migraine", "type 2 diabetes", "asthma attacks", "stroke", "kidney failure",
               "severe influenza", "liver disease", "hip fractures", "memory loss"]


def _make_research(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    univ, lead, journal, drug, funder = (cast.take(p) for p in ("university", "person", "journal", "drug", "agency"))
    cond = r.choice(_CONDITIONS).replace("type 2 ", "")  # no stray digits in the condition
    y = r.randint(2016, 2030)
    return {
        "study": _F(univ, obj=journal, date=v.date(y)),
        "finding": _F(drug, value=v.pct(10, 60), pred="reduce" if r.random() < 0.8 else "increase",
                      extra={"condition": cond}),
        "people": _F(univ, value=v.count(200, 12000, "participants")),
        "months": _F(univ, value=v.small(6, 36, "months")),
        "lead": _F(lead, obj=univ),
        "earlier": _F(None, value=v.pct(5, 45), date=v.year(y - 10, y - 2), extra={"condition": cond}),
        "funding": _F(funder, value=v.millions(2, 90)),
        "side": _F(drug, value=v.pct(2, 20)),
    }


RESEARCH = Family(
    "research", _make_research,
    cues={
        "study": C("study"),
        "finding": C("risk"),
        "people": C("participants"),
        "months": C("months"),
        "lead": C("led"),
        "earlier": C("earlier study"),
        "funding": C("funded|grant"),
        "side": C("side effects"),
    },
    lead=(
        S("study finding",
          "A study by researchers at {study.subj}, published in the {study.obj} on {study.date}, found that "
          "{finding.subj} {finding.verb} the risk of {finding.condition} by {finding.value}.",
          "{finding.subj} {finding.verb} the risk of {finding.condition} by {finding.value}, according to a study "
          "by {study.subj} published in the {study.obj} on {study.date}."),
    ),
    body=(
        S("people months", "The trial followed {people.value} for {months.value}.",
          "Researchers tracked {people.value} over {months.value}."),
        S("lead", "The research was led by Dr. {lead.subj} of {lead.obj}.",
          "Dr. {lead.subj}, who led the team at {lead.obj}, called the result encouraging."),
        S("earlier", "An earlier study in {earlier.date} had found a {earlier.value} lower risk of "
                     "{earlier.condition}.",
          "In {earlier.date}, an earlier study had reported a risk reduction of {earlier.value}.", distractor=True),
        S("funding", "The work was funded by a {funding.value} grant from the {funding.subj}.",
          "The {funding.subj} funded the trial with a grant of {funding.value}."),
        S("side", "About {side.value} of participants taking {side.subj} reported mild side effects.",
          "Mild side effects were reported by {side.value} of those taking {side.subj}.", distractor=True),
    ),
    units=(
        U("lead", "study finding",
          "A study by {study.subj} published in the {study.obj} on {study.date} found that {finding.subj} "
          "{finding.verb} the risk of {finding.condition} by {finding.value}.",
          "{finding.subj} {finding.verb} the risk of {finding.condition} by {finding.value}, according to a study by "
          "{study.subj} published on {study.date}."),
        U("people", "people months", "The trial followed {people.value} for {months.value}."),
        U("lead_researcher", "lead", "The research was led by Dr. {lead.subj} of {lead.obj}."),
        U("funding", "funding", "The work was funded by a {funding.value} grant from the {funding.subj}."),
    ),
)


# --- funding rounds ------------------------------------------------------------

def _make_funding(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    startup, investor, investor2, founder, city = (cast.take(p) for p in ("company", "firm", "firm", "person", "city"))
    y = r.randint(2016, 2030)
    amount = v.millions(5, 400)
    return {
        "round": _F(startup, value=amount, date=v.date(y), pred="raise"),
        "investor": _F(investor, obj=startup),
        "investor2": _F(investor2, obj=startup),
        "valuation": _F(startup, value=v.near(amount, 5, 12)),
        "prev": _F(startup, value=v.near(amount, 0.15, 0.6), date=v.year(y - 3, y - 1)),
        "hires": _F(startup, value=v.count(20, 500, "engineers")),
        "founder": _F(founder, obj=startup, date=v.year(2005, y - 2)),
        "customers": _F(startup, value=v.count(200, 90000, "customers")),
        "hq": _F(startup, obj=city),
    }


FUNDING = Family(
    "funding", _make_funding,
    cues={
        "round": C("raised|secured|raise|secure"),
        "investor": C("led"),
        "investor2": C("took part|taking part"),
        "valuation": C("values|valued"),
        "prev": C("previous round"),
        "hires": C("hire"),
        "founder": C("founded"),
        "customers": C("customers"),
        "hq": C("based|headquartered"),
    },
    lead=(
        S("round", "{round.subj}[hq:, a start-up based in {hq.obj},] {round.verb} {round.value} in new funding on "
                   "{round.date}.",
          "On {round.date}, {round.subj} {round.verb} {round.value} in new funding[investor: in a round led by "
          "{investor.subj}]."),
    ),
    body=(
        S("investor", "The round was led by {investor.subj}[investor2:, with {investor2.subj} also taking part].",
          "{investor.subj} led the round."),
        S("investor2", "{investor2.subj} also took part in the round."),
        S("valuation", "The deal values {valuation.subj} at {valuation.value}.",
          "{valuation.subj} is now valued at {valuation.value}."),
        S("prev", "{prev.subj} had raised {prev.value} in its previous round in {prev.date}.",
          "In its previous round, in {prev.date}, {prev.subj} raised {prev.value}.", distractor=True),
        S("hires", "{hires.subj} plans to hire {hires.value} over the next year.",
          "The money will help {hires.subj} hire {hires.value}."),
        S("founder", "{founder.subj} founded {founder.obj} in {founder.date}.",
          "{founder.obj} was founded in {founder.date} by {founder.subj}."),
        S("customers", "{customers.subj} says it has {customers.value}.",
          "The company now has {customers.value}, according to {customers.subj}."),
    ),
    units=(
        U("lead", "round", "{round.subj} {round.verb} {round.value} in new funding on {round.date}.",
          "On {round.date}, {round.subj} {round.verb} {round.value} in new funding."),
        U("investor", "investor", "The round was led by {investor.subj}."),
        U("valuation", "valuation", "The deal values {valuation.subj} at {valuation.value}."),
        U("hires", "hires", "{hires.subj} plans to hire {hires.value}."),
        U("founder", "founder", "{founder.subj} founded {founder.obj} in {founder.date}."),
    ),
)


# --- city councils ---------------------------------------------------------------

_PROJECTS = ["bridge", "light rail line", "water treatment plant", "sports arena", "hospital wing", "ferry terminal",
             "library", "flood barrier", "bus depot", "concert hall"]


def _make_council(r: random.Random) -> dict[str, _F]:
    cast, v = Cast(r), _Vals(r)
    council, mayor, builder = cast.take("council"), cast.take("person"), cast.take("company")
    project = r.choice(_PROJECTS)
    y = r.randint(2016, 2028)
    budget = v.big_money(0.2, 6) if r.random() < 0.4 else v.millions(20, 900)
    yes = r.randint(5, 11)
    return {
        "vote": _F(council, value=budget, date=v.date(y), pred="approve" if r.random() < 0.8 else "reject",
                   extra={"project": project}),
        "tally": _F(council, value=score(yes, r.randint(1, yes - 1))),
        "done": _F(council, date=v.year(y + 2, y + 6), extra={"project": project}),
        "jobs": _F(council, value=v.count(100, 5000, "jobs")),
        "mayor": _F(mayor, obj=council),
        "prior": _F(council, value=v.near(budget, 0.4, 0.9), date=v.year(y - 12, y - 2)),
        "builder": _F(builder, extra={"project": project}),
        "serve": _F(council, value=v.count(5000, 400000, "residents", step=100), extra={"project": project}),
    }


COUNCIL = Family(
    "council", _make_council,
    cues={
        "vote": C("approved|backed|rejected|voted down|approve|back|reject|vote down"),
        "tally": C("measure"),
        "done": C("completed|finished"),
        "jobs": C("jobs"),
        "mayor": C("mayor"),
        "prior": C("similar plan"),
        "builder": C("contract"),
        "serve": C("serve"),
    },
    lead=(
        S("vote", "{vote.subj} {vote.verb} a {vote.value} plan to build a new {vote.project} on {vote.date}.",
          "On {vote.date}, {vote.subj} {vote.verb} plans for a new {vote.project} costing {vote.value}."),
    ),
    body=(
        S("tally", "Members of {tally.subj} voted {tally.value} on the measure.",
          "The vote on the measure in {tally.subj} was {tally.value}."),
        S("done", "The {done.project} is expected to be completed in {done.date}.",
          "Work on the {done.project} should be finished by {done.date}."),
        S("jobs", "The project is expected to create {jobs.value}.",
          "Building it will create {jobs.value}, according to {jobs.subj}."),
        S("mayor", "Mayor {mayor.subj} called the decision a turning point for the city.",
          "\"This is a turning point for the city,\" said Mayor {mayor.subj}."),
        S("prior", "A similar plan costing {prior.value} was shelved by {prior.subj} in {prior.date}.",
          "In {prior.date}, a similar plan costing {prior.value} was shelved.", distractor=True),
        S("builder", "{builder.subj} won the contract to build the {builder.project}.",
          "The contract to build the {builder.project} went to {builder.subj}."),
        S("serve", "The {serve.project} will serve about {serve.value}.",
          "Officials say the {serve.project} will serve {serve.value}."),
    ),
    units=(
        U("lead", "vote", "{vote.subj} {vote.verb} a {vote.value} plan to build a new {vote.project} on {vote.date}.",
          "On {vote.date}, {vote.subj} {vote.verb} a {vote.value} plan for a new {vote.project}."),
        U("tally", "tally", "Members of {tally.subj} voted {tally.value} on the measure."),
        U("done", "done", "The {done.project} is expected to be completed in {done.date}."),
        U("jobs", "jobs", "The project is expected to create {jobs.value}."),
        U("builder", "builder", "{builder.subj} won the contract to build the {builder.project}."),
    ),
)

FAMILIES: dict[str, Family] = {f.name: f for f in (EARNINGS, ACQUISITION, ELECTION, SPORTS, COURT, STORM, LAUNCH,
                                                   RESEARCH, FUNDING, COUNCIL)}

# Context sentences: no entity, number or date, each identified by one phrase. They
# lengthen articles (up to 14 sentences) and give summaries something to ignore.
CONTEXT: dict[str, tuple[tuple[str, str], ...]] = {
    "earnings": (("before markets opened", "The figures were released before markets opened."),
                 ("raw materials", "Higher costs of raw materials weighed on margins."),
                 ("new markets", "The company has been expanding into new markets to rely less on a few large "
                                 "customers.")),
    "acquisition": (("investment banks", "Both companies were advised by several investment banks."),
                    ("integration", "Integration of the two businesses is expected to take some time."),
                    ("consolidation", "The industry has seen a wave of consolidation in recent years.")),
    "election": (("campaign focused", "The campaign focused on housing, transport and public safety."),
                 ("polls had suggested", "Polls had suggested a much closer contest."),
                 ("concession speech", "The defeated candidate made a concession speech late in the evening.")),
    "sports": (("second half", "Both sides created chances in a lively second half."),
               ("best defences", "The game had been billed as a test of the league's two best defences."),
               ("final whistle", "Fans stayed long after the final whistle.")),
    "court": (("closely watched", "The case had been closely watched by the industry."),
              ("hearing lasted", "The hearing lasted three weeks."),
              ("legal experts", "Legal experts said the decision could shape similar disputes.")),
    "storm": (("schools and offices", "Schools and offices across the area were closed."),
              ("shelters", "Emergency shelters were opened in sports halls and churches."),
              ("forecasters", "Forecasters warned of more heavy rain in the coming days.")),
    "launch": (("improved camera", "The device has a larger screen and an improved camera."),
               ("early reviewers", "Early reviewers praised its design."),
               ("supply chain", "The company said its supply chain was ready for strong demand.")),
    "research": (("placebo", "Half of the volunteers received a placebo."),
                 ("larger trials", "The authors said larger trials were needed."),
                 ("mechanism", "The mechanism behind the effect remains unclear.")),
    "funding": (("helps shops", "The start-up sells software that helps shops manage stock."),
                ("poured money", "Investors have poured money into the sector this year."),
                ("profitable", "The company hopes to become profitable within three years.")),
    "council": (("public consultation", "A public consultation drew hundreds of comments."),
                ("congestion", "Residents have long complained about congestion in the area."),
                ("opponents", "Opponents argued that the money should be spent on schools.")),
}


# ===========================================================================
# 4. The news world: rendering and generation
# ===========================================================================

_SLOT = re.compile(r"\{(\w+)\.(\w+)\}")
_OPTIONAL = re.compile(r"\[(\w+):([^\]]*)\]")
_ENTITY_ATTRS = ("subj", "obj", "other")


@dataclass(frozen=True)
class Slot:
    role: str
    attr: str  # subj | obj | other | value | date | verb | an extra
    start: int
    end: int


def slot_text(f: _F, attr: str, verb_text: str | None = None) -> str:
    if attr in _ENTITY_ATTRS:
        ent = getattr(f, attr)
        if ent is None:
            raise KeyError(f"template uses {attr} of a fact that has none")
        return ent.name
    if attr == "value":
        return f.value.text
    if attr == "date":
        return f.date.text
    if attr == "verb":
        return verb_text
    return f.extra[attr]


def render(template: str, facts: dict[str, _F], verbs: dict[str, str],
           include: Callable[[str], bool] = lambda role: False,
           override: dict[tuple[str, str], str] | None = None) -> tuple[str, list[Slot], list[str]]:
    """Fill a template: (text, slots with their character spans, roles of the optional clauses kept).

    `verbs` maps role -> the verb phrase to write; `override` replaces a slot's
    text (the drafter's errors), so the drafter knows exactly where it erred.
    """
    kept: list[str] = []

    def optional(m: re.Match) -> str:
        role = m.group(1)
        if role in facts and include(role):
            kept.append(role)
            return m.group(2)
        return ""

    t = _OPTIONAL.sub(optional, template)
    out, slots, pos, n = [], [], 0, 0
    for m in _SLOT.finditer(t):
        lit = t[pos:m.start()]
        out.append(lit)
        n += len(lit)
        role, attr = m.group(1), m.group(2)
        text = (override or {}).get((role, attr))
        if text is None:
            text = slot_text(facts[role], attr, verbs.get(role))
        slots.append(Slot(role, attr, n, n + len(text)))
        out.append(text)
        n += len(text)
        pos = m.end()
    out.append(t[pos:])
    return "".join(out), slots, kept


def _choose_verbs(facts: dict[str, _F], rng: random.Random) -> dict[str, str]:
    return {role: verb(f.pred, f.polarity, rng) for role, f in facts.items() if f.pred}


def _event_of(seed: int, i: int, retell_rate: float) -> int:
    """The event article i reports: its own, or (sometimes) an earlier article's, retold."""
    while i > 0:
        r = _rng(seed, "retell", i)
        if r.random() >= retell_rate:
            break
        i = r.randrange(i)
    return i


def world_document(seed: int, i: int, retell_rate: float = 0.08) -> Document:
    """Article i of the world `seed`: depends only on (seed, i), never on how many are generated."""
    event = _event_of(seed, i, retell_rate)
    er = _rng(seed, "event", event)
    family = FAMILIES[er.choice(sorted(FAMILIES))]
    facts = family.make(er)
    context = CONTEXT[family.name]
    for k, (_, sentence) in enumerate(context):
        facts[f"ctx{k}"] = _F(None, extra={"text": sentence})

    sr = _rng(seed, "surface", i)
    # The summary: the lead unit plus one to three others; their roles are the key facts.
    units = [family.units[0]] + sr.sample(family.units[1:], min(len(family.units) - 1, sr.choice([1, 2, 2, 3])))
    key_roles = {role for u in units for role in u.roles}
    # The article: the lead, the sentences that state key facts, then distractors
    # first (careless copying should have something to err on) and the rest.
    lead = family.lead[0]
    body = list(family.body) + [Sent((f"ctx{k}",), ("{ctx%d.text}" % k,)) for k in range(len(context))]
    need = [s for s in body if set(s.roles) & key_roles]
    rest = [s for s in body if s not in need]
    sr.shuffle(rest)
    rest.sort(key=lambda s: not s.distractor)
    n_sent = sr.randint(6, 14)
    chosen = need + rest[:max(0, n_sent - 1 - len(need))]
    sr.shuffle(chosen)

    verbs = _choose_verbs(facts, sr)
    sentences, stated = [], {}
    for idx, spec in enumerate([lead] + chosen):
        text, _, kept = render(sr.choice(spec.templates), facts, verbs, include=lambda role: sr.random() < 0.5)
        sentences.append(text)
        for role in list(spec.roles) + kept:
            stated.setdefault(role, idx)

    order = sorted(stated, key=lambda role: (stated[role], list(facts).index(role)))
    table = [fact_to_dict(f"f{k}", family.name, role, facts[role], stated[role], role in key_roles)
             for k, role in enumerate(order)]
    entities: dict[str, str] = {}
    for role in order:
        for attr in _ENTITY_ATTRS:
            ent = getattr(facts[role], attr)
            if ent is not None:
                entities.setdefault(ent.name, ent.type)
    summary_verbs = _choose_verbs(facts, sr)
    summary = " ".join(render(sr.choice(u.templates), facts, summary_verbs)[0] for u in units)
    return Document(id=f"nw-{seed}-{i:06d}", text=" ".join(sentences), summary=summary, source="newsworld",
                    bucket=family.name, facts=table, entities=entities,
                    meta={"world": WORLD_VERSION, "event": f"{seed}-{event}", "units": [u.name for u in units]})


def newsworld(n: int, seed: int = 0, start: int = 0, retell_rate: float = 0.08) -> Iterator[Document]:
    """Articles start .. start+n-1 of the world `seed` (a stream; byte-identical across runs)."""
    for i in range(start, start + n):
        yield world_document(seed, i, retell_rate)


# --- fact tables -----------------------------------------------------------------

def fact_to_dict(fid: str, family: str, role: str, f: _F, sentence: int, key: bool) -> dict:
    return {
        "id": fid,
        "kind": f"{family}.{role}",
        "subject": f.subj.name if f.subj else None,
        "object": f.obj.name if f.obj else None,
        "other": f.other.name if f.other else None,
        "value": f.value.text if f.value else None,
        "unit": f.value.unit if f.value else None,
        "amount": f.value.amount if f.value else None,
        "date": f.date.text if f.date else None,
        "predicate": f.pred,
        "polarity": f.polarity,
        "sentence": sentence,  # index of the (first) article sentence that states it
        "key": key,  # stated by the reference summary
        "extra": f.extra,
    }


def fact_from_dict(d: dict, entities: dict[str, str]) -> _F:
    def ent(name):
        return Ent(name, entities.get(name, "unknown")) if name else None

    value = Qty(d["value"], d["amount"], d["unit"]) if d.get("value") is not None else None
    date = parse_when(d["date"]) if d.get("date") else None
    return _F(ent(d.get("subject")), ent(d.get("object")), ent(d.get("other")), value, date,
              d.get("predicate"), d.get("polarity", True), dict(d.get("extra") or {}))


def doc_facts(doc: Document) -> dict[str, tuple[dict, _F]]:
    """role -> (fact dict, fact) for a news world document."""
    if not doc.facts:
        raise DataError(f"document {doc.id!r} has no fact table (only news world documents do)")
    return {d["kind"].split(".", 1)[1]: (d, fact_from_dict(d, doc.entities)) for d in doc.facts}


def parse_when(text: str) -> When:
    m = re.fullmatch(rf"({'|'.join(MONTHS)}) (\d{{1,2}}), (\d{{4}})", text)
    if m:
        return When(text, int(m.group(3)), MONTHS.index(m.group(1)) + 1, int(m.group(2)))
    m = re.fullmatch(rf"({'|'.join(MONTHS)}) (\d{{4}})", text)
    if m:
        return When(text, int(m.group(2)), MONTHS.index(m.group(1)) + 1)
    if re.fullmatch(r"\d{4}", text):
        return When(text, int(text))
    raise ValueError(f"not a date: {text!r}")


# ===========================================================================
# 5. Reading claims out of text: numbers, dates, entities; regex keys
# ===========================================================================

_MONTH_ALT = "|".join(MONTHS)
_DATE_PATTERNS = (
    (re.compile(rf"\b({_MONTH_ALT}) (\d{{1,2}}), (\d{{4}})\b", re.I), "ymd"),
    (re.compile(rf"\b({_MONTH_ALT}) (\d{{4}})\b", re.I), "ym"),
    (re.compile(rf"\b({_MONTH_ALT}) (\d{{1,2}})\b", re.I), "md"),
    (re.compile(r"(?<![\d,.$])\b(1[89]\d\d|20\d\d)\b(?![.,]\d|\s?%| percent)"), "y"),
)
_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"  # 3,400 / 12 / 4.2 (a trailing comma is punctuation)
_MONEY_RE = re.compile(rf"\$\s?{_NUM}(?:\s(?:million|billion|trillion)\b)?")
_PCT_RE = re.compile(rf"\b{_NUM}(?:\s?%|\s(?:percent|per cent)\b)")
_SCORE_RE = re.compile(r"\b\d{1,3}-\d{1,3}\b")
_COUNT_RE = re.compile(rf"\b({_NUM})(?:\s(million|billion)\b)?(?:\s((?:new\s)?[a-z]+))?")
# Nouns a count may carry; a count's unit is its noun ("3,400 jobs"), else "number".
COUNT_NOUNS = frozenset("jobs employees votes homes people residents participants months hours orders engineers "
                        "customers patents goals points wins mph spectators fans workers staff dollars".split())
_UNIT_GROUPS = ({"people", "residents"}, {"spectators", "fans", "people"}, {"employees", "staff", "workers"})


@dataclass
class Mention:
    """A checkable element of a sentence: an entity, a quantity or a date, with its span."""
    kind: str  # "entity" | "qty" | "date"
    text: str
    start: int
    end: int
    name: str | None = None  # entity: canonical name (None: an unknown capitalised name)
    etype: str | None = None  # entity type
    in_doc: bool = True  # entity: named in the document
    qty: Qty | None = None
    when: When | None = None


def _overlaps(a: int, b: int, taken: list[tuple[int, int]]) -> bool:
    return any(a < y and x < b for x, y in taken)


def parse_quantities(text: str, taken: list[tuple[int, int]] | None = None) -> list[Mention]:
    """Dates, money, percentages, scores and counts in `text`, longest reading first, no overlaps."""
    taken = taken if taken is not None else []
    out: list[Mention] = []

    def add(m: re.Match, mention: Mention) -> None:
        taken.append((m.start(), m.end()))
        out.append(mention)

    for rx, kind in _DATE_PATTERNS:
        for m in rx.finditer(text):
            if _overlaps(m.start(), m.end(), taken):
                continue
            g = m.groups()
            if kind == "ymd":
                w = When(m.group(), int(g[2]), MONTHS.index(g[0].capitalize()) + 1, int(g[1]))
            elif kind == "ym":
                w = When(m.group(), int(g[1]), MONTHS.index(g[0].capitalize()) + 1)
            elif kind == "md":
                if not 1 <= int(g[1]) <= 31:
                    continue
                w = When(m.group(), None, MONTHS.index(g[0].capitalize()) + 1, int(g[1]))
            else:
                w = When(m.group(), int(g[0]))
            add(m, Mention("date", m.group(), m.start(), m.end(), when=w))
    for m in _MONEY_RE.finditer(text):
        if not _overlaps(m.start(), m.end(), taken):
            add(m, Mention("qty", m.group(), m.start(), m.end(), qty=Qty(m.group(), parse_money(m.group()), "usd")))
    for m in _PCT_RE.finditer(text):
        if not _overlaps(m.start(), m.end(), taken):
            num = re.match(_NUM, m.group()).group().replace(",", "")
            add(m, Mention("qty", m.group(), m.start(), m.end(), qty=Qty(m.group(), float(num), "percent")))
    for m in _SCORE_RE.finditer(text):
        if not _overlaps(m.start(), m.end(), taken):
            add(m, Mention("qty", m.group(), m.start(), m.end(), qty=Qty(m.group(), None, "score")))
    for m in _COUNT_RE.finditer(text):
        num_end = m.end(2) if m.group(2) else m.end(1)
        if _overlaps(m.start(), num_end, taken):
            continue
        scale = {"million": 10**6, "billion": 10**9, None: 1}[m.group(2)]
        amount = Decimal(m.group(1).replace(",", "")) * scale
        amount = int(amount) if amount == int(amount) else float(amount)
        noun = m.group(3)
        with_noun = bool(noun) and noun.split()[-1] in COUNT_NOUNS and not _overlaps(m.start(), m.end(), taken)
        end = m.end() if with_noun else num_end
        span = text[m.start():end]
        taken.append((m.start(), end))
        unit = noun.split()[-1] if with_noun else "number"
        out.append(Mention("qty", span, m.start(), end, qty=Qty(span, amount, "usd" if unit == "dollars" else unit)))
    return sorted(out, key=lambda x: x.start)


def qty_match(q: Qty, f: Qty) -> bool:
    """Same claim? Money and percentages by amount, scores by text, counts by amount and a compatible noun."""
    if q.unit == "usd" or f.unit == "usd":
        return q.unit == f.unit and q.amount == f.amount
    if q.unit == "percent" or f.unit == "percent":
        return q.unit == f.unit and abs(q.amount - f.amount) < 1e-9
    if q.unit == "score" or f.unit == "score":
        return q.unit == f.unit and q.text.replace(" ", "") == f.text.replace(" ", "")
    if q.amount != f.amount:
        return False
    return "number" in (q.unit, f.unit) or q.unit == f.unit or any({q.unit, f.unit} <= g for g in _UNIT_GROUPS)


def when_match(w: When, f: When) -> bool:
    """Every part the sentence states (year, month, day) is stated by the fact and equal."""
    return all(getattr(w, k) is None or getattr(w, k) == getattr(f, k) for k in ("y", "m", "d"))


# --- entities -----------------------------------------------------------------------

_CAP_SPAN = re.compile(r"[A-Z][\w'’-]*\.?(?:\s+(?:(?:of|the)\s+)?[A-Z][\w'’-]*\.?)*")
_CAP_TOKEN = re.compile(r"[A-Z][\w'’-]*")
_CAP_OK = frozenset(MONTHS) | frozenset("Dr Mr Mrs Ms Prof Judge Mayor I The A An In On It Its".split())


@functools.lru_cache(maxsize=1)
def _lexicon_first_words() -> frozenset[str]:
    return frozenset(n.split()[0] for n in world_lexicon())


def entity_mentions(text: str, doc_entities: dict[str, str], doc_words: frozenset[str],
                    taken: list[tuple[int, int]] | None = None) -> list[Mention]:
    """Entities in `text`: the document's own (in_doc), other names of the world, unknown capitalised names.

    Unknown capitalised words count only when the document never uses them and
    they do not open the sentence (a sentence-initial word is capitalised anyway).
    """
    taken = taken if taken is not None else []
    out: list[Mention] = []
    for name in sorted(doc_entities, key=len, reverse=True):
        for m in re.finditer(rf"(?<![\w]){re.escape(name)}(?![\w])", text):
            if not _overlaps(m.start(), m.end(), taken):
                taken.append((m.start(), m.end()))
                out.append(Mention("entity", name, m.start(), m.end(), name, doc_entities[name], True))
    lex, firsts = world_lexicon(), _lexicon_first_words()
    for span in _CAP_SPAN.finditer(text):
        toks = [(span.start() + t.start(), span.start() + t.end()) for t in re.finditer(r"\S+", span.group())]
        i = 0
        while i < len(toks):
            hit = None
            if text[toks[i][0]:toks[i][1]].rstrip(".") in firsts:
                for j in range(len(toks), i, -1):  # longest name first
                    a, b = toks[i][0], toks[j - 1][1]
                    for end in ((b, b - 1) if text[b - 1] == "." else (b,)):
                        if text[a:end] in lex and not _overlaps(a, end, taken):
                            hit = (j, a, end)
                            break
                    if hit:
                        break
            if hit is None:
                i += 1
                continue
            i, a, b = hit
            name = text[a:b]
            taken.append((a, b))
            out.append(Mention("entity", name, a, b, name, lex[name], name in doc_entities))
    # Unknown capitalised words: a run of them is one name. A sentence opener is
    # capitalised anyway, so it counts only as the first word of a longer run, or
    # of a name whose next word is known ("Northwind Group ..." in an article about
    # Granite Group: a made-up company, not an ordinary opening word).
    run: list[re.Match] = []

    def flush(name_goes_on: bool = False) -> None:
        if run and not (len(run) == 1 and opener(run[0]) and not name_goes_on):
            a, b = run[0].start(), run[-1].end()
            out.append(Mention("entity", text[a:b], a, b, None, None, False))
            taken.append((a, b))
        run.clear()

    def opener(m: re.Match) -> bool:
        return text[:m.start()].strip(" \"'“‘(") == ""

    for m in _CAP_TOKEN.finditer(text):
        known = (_overlaps(m.start(), m.end(), taken) or m.group() in doc_words or m.group() in _CAP_OK)
        if known or (run and text[run[-1].end():m.start()].strip()):
            adjacent = bool(run) and text[run[-1].end():m.start()] == " " and m.group() not in _CAP_OK
            flush(name_goes_on=known and adjacent)
        if not known:
            run.append(m)
    flush()
    return sorted(out, key=lambda x: x.start)


# --- regex keys -------------------------------------------------------------------------

_STOP = frozenset("""a an the of to in on at for by with from and or but as is was were be been has had have it its
this that these those which who whom their there than then also said says say about after before over into
would will could should can may more most some such not no per new did does do""".split())


def rx_escape(text: str) -> str:
    """Escape regex metacharacters only (re.escape also escapes spaces, which reads badly in a trace)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


def _regex_hits(pattern: str, sentences: Sequence[str]) -> list[int]:
    rx = re.compile(pattern)
    return [i for i, s in enumerate(sentences) if rx.search(s)]


def _key_anchors(tgt: str, entity_names: Iterable[str], keep: Callable[[str], bool],
                 entity_ok: Callable[[str], bool]) -> list[tuple[int, str, bool]]:
    """(position in target, text, is entity) for the target's names and words that `keep` accepts."""
    anchors: list[tuple[int, str, bool]] = []
    for name in entity_names:
        if entity_ok(name):
            anchors += [(m.start(), name, True) for m in re.finditer(rx_escape(name), tgt)]
    for m in re.finditer(r"[A-Za-z][A-Za-z'-]{2,}|\d[\d,.]*\d{2}", tgt):  # short numbers match too much
        w = m.group()
        if w.lower() not in _STOP and keep(w) and not any(a <= m.start() < a + len(t) for a, t, _ in anchors):
            anchors.append((m.start(), w, False))
    return sorted(anchors)


def regex_key_for(sentences: Sequence[str], target: int, written: str, avoid: str = "",
                  entity_names: Iterable[str] = (), hide: str = "") -> str:
    """A specific regex (no slashes) that finds article sentence `target`, built from what the writer has.

    The writer of a faulty sentence knows its correct parts, not the correct
    value, so the key is made of entity names, numbers and content words that
    the written sentence shares with the target, minus the erroneous span
    `avoid` (for a wrong number only its digits: "jobs" in "1,044 jobs" is
    still right). A single anchor if it finds only the target, else two anchors
    `A.*B` in target order. Preference: the target is the first hit, then fewest
    hits, then keys with an entity. If no shared anchor puts the target first
    (the sentence paraphrases the article), the target's own words are used too,
    except those of `hide` (the correct value: a key must not give it away).
    Metacharacters are escaped.
    """
    tgt = sentences[target]
    entity_names = list(entity_names)
    if avoid and re.search(r"\d", avoid):
        avoid_tokens = [t for t in avoid.split() if re.search(r"\d", t)]
    else:
        avoid_tokens = [avoid] if avoid else []
    seen = written
    for t in avoid_tokens:
        seen = seen.replace(t, " ")
    seen_words = set(re.findall(r"[a-z0-9][a-z0-9'-]*", seen.lower()))
    hidden = set(re.findall(r"[a-z0-9][a-z0-9,.'-]*", hide.lower()))

    def shared(word: str) -> bool:
        w = word.lower()
        if w in seen_words:
            return True
        return len(w) >= 4 and any(len(s) >= 4 and (s.startswith(w) or w.startswith(s)) for s in seen_words)

    best = None

    def search(anchors: list[tuple[int, str, bool]], unshared: bool) -> None:
        def consider(pattern: str, has_entity: bool) -> None:
            nonlocal best
            hits = _regex_hits(pattern, sentences)
            if target in hits:
                chars = len(re.sub(r"\\.|\.\*", "x", pattern))  # anchor characters, unescaped
                rank = (hits[0] != target, unshared, len(hits), not has_entity, -min(chars, 24), len(pattern))
                if best is None or rank < best[0]:
                    best = (rank, pattern)

        for _, text, is_ent in anchors:
            consider(rx_escape(text), is_ent)
        if best is None or best[0][:4] != (False, unshared, 1, False):
            for x in range(len(anchors)):
                for y in range(x + 1, len(anchors)):
                    (pa, ta, ea), (pb, tb, eb) = anchors[x], anchors[y]
                    if pa + len(ta) <= pb:
                        consider(f"{rx_escape(ta)}.*{rx_escape(tb)}", ea or eb)

    search(_key_anchors(tgt, entity_names, shared, lambda n: n in seen), False)
    if best is None or best[0][0]:
        search(_key_anchors(tgt, entity_names, lambda w: w.lower() not in hidden and w.strip(",.") not in hide,
                            lambda n: n not in hide), True)
    if best is not None:
        return best[1]
    return rx_escape(" ".join(tgt.split()[:6]))  # cannot happen: the target's own words find it


# ===========================================================================
# 6. The oracle annotator
# ===========================================================================

ERROR_TYPES = ("entity_swap", "number_change", "date_change", "negation", "wrong_predicate")
LABEL_KEYS = ("error_span", "corrected_clause", "regex_key", "type", "intrinsic", "sentence_index")


@functools.lru_cache(maxsize=4096)
def _cue_rx(phrase: str) -> re.Pattern:
    return re.compile(rf"\b{re.escape(phrase)}\b", re.I)


def _forms_in(pred: str, text: str) -> list[tuple[str, str, bool]]:
    """(form found, its counterpart of opposite polarity, is_affirmative) for `pred`'s forms in text."""
    found = []
    for past, neg in PREDICATES[pred]:
        if _cue_rx(neg).search(text):
            found.append((neg, past, False))
        elif _cue_rx(past).search(text):
            found.append((past, neg, True))
    for extra in _PRED_EXTRA.get(pred, ()):
        if _cue_rx(extra).search(text):
            found.append((extra, extra, True))
    return found


def _qclass(q: Qty) -> str:
    return q.unit if q.unit in ("usd", "percent", "score") else "count"


def _when_kind(w: When) -> str:
    return ("y" if w.y is not None else "") + ("m" if w.m is not None else "") + ("d" if w.d is not None else "")


def _when_as(w: When, kind: str) -> str | None:
    """`w` written with the parts of `kind` ("ymd", "ym", "md", "y"), if it has them."""
    if any(getattr(w, {"y": "y", "m": "m", "d": "d"}[k]) is None for k in kind):
        return None
    if kind == "ymd":
        return f"{MONTHS[w.m - 1]} {w.d}, {w.y}"
    if kind == "ym":
        return f"{MONTHS[w.m - 1]} {w.y}"
    if kind == "md":
        return f"{MONTHS[w.m - 1]} {w.d}"
    return str(w.y)


@dataclass
class _Sig:
    """A fact as the oracle sees it."""
    d: dict
    role: str
    f: _F
    cues: tuple[tuple[str, ...], ...]
    ents: tuple[str, ...]
    qty: Qty | None
    when: When | None

    @property
    def subject(self) -> str | None:
        return self.f.subj.name if self.f.subj else None


class DocView:
    """What the drafter and the oracle need of a news world document, computed once."""

    def __init__(self, doc: Document):
        self.doc = doc
        self.family = FAMILIES.get(doc.bucket)
        if self.family is None or not doc.facts:
            raise DataError(f"document {doc.id!r} is not a news world document (no fact table)")
        self.sentences = sandbox.split_sentences(doc.text)
        self.entities = doc.entities
        self.words = frozenset(re.findall(r"[A-Z][\w'’-]*", doc.text))
        self.facts = doc_facts(doc)
        ctx = CONTEXT[self.family.name]
        self.sigs: list[_Sig] = []
        for role, (d, f) in self.facts.items():
            cues = self.family.cues[role] if role in self.family.cues else C(ctx[int(role[3:])][0])
            qty = None
            if f.value is not None:
                qs = [m.qty for m in parse_quantities(f.value.text) if m.kind == "qty"]
                qty = qs[0] if qs else None
                if qty is not None and _qclass(qty) == "count" and qty.unit == "number":
                    qty = Qty(qty.text, qty.amount, f.value.unit)
            ents = tuple(e.name for e in (f.subj, f.obj, f.other) if e is not None)
            self.sigs.append(_Sig(d, role, f, cues, ents, qty, f.date))

    def sig(self, role: str) -> _Sig:
        return next(s for s in self.sigs if s.role == role)


@dataclass
class _Err:
    type: str
    start: int
    end: int
    intrinsic: bool
    repl: str | None  # minimal fix for the span, if known
    target: _Sig | None  # the fact whose supporting sentence shows the truth


def _check_sentence(view: DocView, sentence: str) -> tuple[_Sig | None, list[_Err]]:
    """The fact a summary sentence most likely states, and what in the sentence contradicts the facts."""
    taken: list[tuple[int, int]] = []
    ents = entity_mentions(sentence, view.entities, view.words, taken)
    nums = parse_quantities(sentence, taken)
    qtys = [m for m in nums if m.kind == "qty"]
    dates = [m for m in nums if m.kind == "date"]
    present = {m.name for m in ents if m.name}

    def val_ok(s: _Sig) -> bool:
        return s.qty is not None and any(qty_match(m.qty, s.qty) for m in qtys)

    def date_ok(s: _Sig) -> bool:
        return s.when is not None and any(when_match(m.when, s.when) for m in dates)

    fitting = []
    for s in view.sigs:
        if not all(any(_cue_rx(p).search(sentence) for p in group) for group in s.cues):
            continue
        score = len(s.cues) + 3 * len(set(s.ents) & present) + 3 * val_ok(s) + 2 * date_ok(s)
        if s.f.pred and (_forms_in(s.f.pred, sentence) or
                         (s.f.pred in CONFLICT and _forms_in(CONFLICT[s.f.pred], sentence))):
            score += 1
        fitting.append((score + 0.5 * bool(s.d.get("key")), s))
    whole = _Err("unsupported", 0, len(sentence), False, "", None)
    if not fitting:
        return None, [whole]
    anchor = max(fitting, key=lambda t: t[0])[1]  # first of equals: document order
    has_elements = anchor.qty is not None or anchor.when is not None
    if has_elements and not (ents or qtys or dates):
        return anchor, [whole]  # names the topic but states nothing checkable about it

    def evidence(s: _Sig) -> bool:
        """Does the sentence visibly state `s` too (so its entities, numbers and dates are allowed)?"""
        if s.qty is not None or s.when is not None:
            if val_ok(s) or date_ok(s):
                return True
            # Its subject doing its predicate ("Tolenta lowered ...") states it even without the number.
            return s.subject in present and bool(s.f.pred) and bool(
                _forms_in(s.f.pred, sentence) or (s.f.pred in CONFLICT and _forms_in(CONFLICT[s.f.pred], sentence)))
        return s.subject in present if s.subject else bool(s.ents) and set(s.ents) <= present

    accepted = [anchor] + [s for _, s in fitting if s is not anchor and evidence(s) and
                           (s.subject in present or s.subject == anchor.subject)]
    ok_ents = {e for s in accepted for e in s.ents}
    errors: list[_Err] = []

    for m in ents:
        if m.name is not None and m.in_doc and m.name in ok_ents:
            continue
        repl, target = None, None
        for s in accepted:
            cand = [e for e in s.ents if e not in present and (m.etype is None or view.entities.get(e) == m.etype)]
            if cand and m.etype is not None:
                repl, target = cand[0], s
                break
        errors.append(_Err("entity_swap", m.start, m.end, bool(m.name and m.in_doc), repl, target or anchor))

    for m in qtys:
        if any(val_ok_one(m.qty, s) for s in accepted):
            continue
        repl, target = None, None
        for s in accepted:
            if s.qty is not None and _qclass(s.qty) == _qclass(m.qty) and not val_ok(s):
                repl, target = s.f.value.text, s
                break
        intrinsic = any(val_ok_one(m.qty, s) for s in view.sigs)
        errors.append(_Err("number_change", m.start, m.end, intrinsic, repl, target or anchor))

    for m in dates:
        if any(s.when is not None and when_match(m.when, s.when) for s in accepted):
            continue
        repl, target = None, None
        for s in accepted:
            if s.when is not None and not date_ok(s) and _when_as(s.when, _when_kind(m.when)):
                repl, target = _when_as(s.when, _when_kind(m.when)), s
                break
        intrinsic = any(s.when is not None and when_match(m.when, s.when) for s in view.sigs)
        errors.append(_Err("date_change", m.start, m.end, intrinsic, repl, target or anchor))

    neg = _NEGATION.search(sentence)
    if neg and anchor.f.polarity and all(s.f.polarity for s in accepted):
        forms = [x for x in _forms_in(anchor.f.pred, sentence) if not x[2]] if anchor.f.pred else []
        if forms:
            form, fix, _ = forms[0]
            a = _cue_rx(form).search(sentence).start()
            errors.append(_Err("negation", a, a + len(form), True, fix, anchor))
        else:
            errors.append(_Err("negation", neg.start(), neg.end(), True, None, anchor))
    elif not neg and not anchor.f.polarity:
        forms = [x for x in _forms_in(anchor.f.pred, sentence) if x[2]] if anchor.f.pred else []
        if forms:
            form, fix, _ = forms[0]
            a = _cue_rx(form).search(sentence).start()
            errors.append(_Err("negation", a, a + len(form), True, fix, anchor))
        else:
            errors.append(_Err("negation", 0, len(sentence), True, None, anchor))

    for s in accepted:
        if s.f.pred in CONFLICT and not _forms_in(s.f.pred, sentence):
            wrong = _forms_in(CONFLICT[s.f.pred], sentence)
            if wrong:
                form, _, affirmative = wrong[0]
                idx = [p if affirmative else n for p, n in PREDICATES[CONFLICT[s.f.pred]]].index(form) \
                    if form not in _PRED_EXTRA.get(CONFLICT[s.f.pred], ()) else 0
                own = PREDICATES[s.f.pred][idx % len(PREDICATES[s.f.pred])]
                fix = own[0] if affirmative else own[1]
                a = _cue_rx(form).search(sentence).start()
                errors.append(_Err("wrong_predicate", a, a + len(form), True, fix, s))
    return anchor, errors


def val_ok_one(q: Qty, s: _Sig) -> bool:
    return s.qty is not None and qty_match(q, s.qty)


def _corrected(view: DocView, sentence: str, anchor: _Sig | None, errors: list[_Err]) -> str:
    """The sentence with every error fixed: minimal edits if they check out, else the supporting sentence."""
    if anchor is None or any(e.type == "unsupported" for e in errors):
        return ""
    if all(e.repl is not None for e in errors):
        fixed = sentence
        for e in sorted(errors, key=lambda e: e.start, reverse=True):
            fixed = fixed[:e.start] + e.repl + fixed[e.end:]
        if not _check_sentence(view, fixed)[1]:
            return fixed
    support = view.sentences[anchor.d["sentence"]]
    if not _check_sentence(view, support)[1]:
        return support
    return ""


def oracle_errors(doc: Document, summary: str) -> list[dict]:
    """Every error in `summary` (any text, not only drafts), in the teacher's schema plus type.

    Each summary sentence is matched to the fact it most likely states: facts
    whose cue words all occur compete on shared entities (x3), numbers (x3),
    dates (x2), cue groups and predicate words; key facts win ties. Then every
    entity, number and date in the sentence must belong to that fact or to a
    fact it evidently combines with (same subject, its own value or date
    present); a negation must match the fact's polarity and a predicate must not
    be the fact's opposite. A sentence that matches no fact is `unsupported`
    (extrinsic) and its correction is the empty string (drop it). Labels of one
    sentence share one `corrected_clause`: the whole sentence with all its errors
    fixed (minimal edits when they check out, else the article's supporting
    sentence).

    Known blind spots (the oracle reads claims, it does not understand text):
    - Omissions are never errors; only what a sentence states is checked.
    - Role swaps between entities of the same fact ("B bought A" for "A bought
      B") pass, as do two values of one fact swapped inside a sentence.
    - A true statement of a distractor fact without its distinguishing cue (last
      year's revenue without "a year earlier") is read as a claim about the key
      fact and flagged.
    - Predicates outside the lexicon ("soared", "failed to") are not read;
      negation is only "not", "never", "no longer" and "n't".
    - Numbers written as words ("three") and relative dates ("last year") are
      not read; a bare number matches any count with the same value.
    - An unknown capitalised word that opens a sentence is not checked.
    - A sentence that combines facts about different subjects may lose the
      second fact's support and be flagged.
    """
    view = DocView(doc)
    labels = []
    for idx, sentence in enumerate(sandbox.split_sentences(summary)):
        anchor, errors = _check_sentence(view, sentence)
        if not errors:
            continue
        fixed = _corrected(view, sentence, anchor, errors)
        for e in sorted(errors, key=lambda e: e.start):
            span = sentence[e.start:e.end]
            if e.type == "unsupported":
                key = _unsupported_key(sentence)
            else:
                target = (e.target or anchor).d["sentence"]
                key = regex_key_for(view.sentences, target, sentence, span, view.entities, hide=e.repl or "")
            labels.append({"error_span": span, "corrected_clause": fixed, "regex_key": key, "type": e.type,
                           "intrinsic": e.intrinsic, "sentence_index": idx})
    return labels


def stated_facts(doc: Document, summary: str) -> list[dict]:
    """Every name, number and date `summary` states, and whether the oracle finds
    it supported: one dict per mention (sentence index, kind, text, supported). A
    mention is unsupported when an oracle error covers it or its whole sentence
    states nothing the article supports. Fact precision is the supported share."""
    view = DocView(doc)
    out = []
    for idx, sentence in enumerate(sandbox.split_sentences(summary)):
        taken: list[tuple[int, int]] = []
        mentions = [("name", m.start, m.end) for m in entity_mentions(sentence, view.entities, view.words, taken)]
        mentions += [(m.kind, m.start, m.end) for m in parse_quantities(sentence, taken)]
        _, errors = _check_sentence(view, sentence)
        whole = any(e.type == "unsupported" for e in errors)
        for kind, a, b in sorted(mentions, key=lambda m: m[1]):
            bad = whole or any(e.start < b and a < e.end for e in errors if e.type != "negation")
            out.append({"sentence": idx, "kind": "number" if kind == "qty" else kind, "text": sentence[a:b],
                        "supported": not bad})
    return out


def oracle_support(doc: Document, sentence: str) -> list[int]:
    """Indices of the article sentences that state the facts `sentence` is about
    (the fact it most likely states, and the facts its errors should have taken
    their values from); empty when it states nothing the article supports."""
    view = DocView(doc)
    anchor, errors = _check_sentence(view, sentence)
    if anchor is None:
        return []
    facts = [anchor] + [e.target for e in errors if e.target is not None]
    return sorted({s.d["sentence"] for s in facts})


def _unsupported_key(sentence: str) -> str:
    """A search for the claim's most specific word: it shows the article has no support for it."""
    names = re.findall(r"[A-Z][\w'-]+(?:\s[A-Z][\w'-]+)*", sentence[1:])
    words = sorted(re.findall(r"[A-Za-z][A-Za-z'-]{3,}", sentence), key=len, reverse=True)
    return rx_escape(names[0] if names else (words[0] if words else sentence.strip()[:20]))


def oracle_fact_score(doc: Document, summary: str) -> float:
    """Share of summary sentences with no error, in [0, 1]; an empty summary scores 0.0."""
    sentences = sandbox.split_sentences(summary)
    if not sentences:
        return 0.0
    view = DocView(doc)
    return sum(not _check_sentence(view, s)[1] for s in sentences) / len(sentences)


def oracle_fact_precision(doc: Document, summary: str) -> float:
    """Share of the names, numbers and dates `summary` states that the oracle
    supports (`stated_facts`), in [0, 1]; a summary that states none scores 0.0."""
    facts = stated_facts(doc, summary)
    return sum(f["supported"] for f in facts) / len(facts) if facts else 0.0


# ===========================================================================
# 7. The faulty drafter
# ===========================================================================
#
# The drafter writes the document's summary units (in freshly drawn paraphrases)
# and breaks some sentences, one error per sentence, by overriding one slot. It
# knows the slot it broke, so each label is exact: the span, the correct
# sentence, the fact whose supporting sentence the regex key must find.


@functools.lru_cache(maxsize=1)
def _names_by_type() -> dict[str, tuple[str, ...]]:
    by: dict[str, list[str]] = defaultdict(list)
    for name, t in world_lexicon().items():
        by[t].append(name)
    return {t: tuple(v) for t, v in by.items()}


def _name_words(name: str) -> set[str]:
    return {w for w in name.replace(".", " ").split() if len(w) > 2 and w not in _SHARED_NAME_WORDS}


def _swap_entity(view: DocView, name: str, unit_ents: set[str], rng: random.Random,
                 want_intrinsic: bool) -> tuple[str, bool] | None:
    etype = view.entities.get(name)
    inside = [n for n, t in view.entities.items() if t == etype and n not in unit_ents]
    if inside and want_intrinsic:
        return rng.choice(inside), True
    doc_words = set().union(*(_name_words(n) for n in view.entities))
    outside = [n for n in _names_by_type().get(etype, ()) if n not in view.entities and not _name_words(n) & doc_words]
    if outside:
        return rng.choice(outside), False
    return (rng.choice(inside), True) if inside else None


def _other_qty(q: Qty, rng: random.Random) -> Qty:
    """A plausible but different value in the same format (extrinsic number change)."""
    for _ in range(50):
        factor = rng.uniform(0.5, 0.9) if rng.random() < 0.5 else rng.uniform(1.1, 1.9)
        if q.unit == "usd":
            new = money(int(round(q.amount * factor)))
            if q.text.endswith("99") and q.amount < 10**5:  # keep shop-price style
                new = money(max(99, int(round(q.amount * factor / 100)) * 100 - 1))
        elif q.unit == "percent":
            decimals = 1 if "." in q.text else 0
            val = round(max(1.0, q.amount * factor), decimals)
            new = percent(val, "%" if q.text.endswith("%") else "percent")
        elif q.unit == "score":
            a, b = (int(x) for x in q.text.split("-"))
            if rng.random() < 0.5:
                a = max(0, a + rng.choice([-2, -1, 1, 2]))
            else:
                b = max(0, b + rng.choice([-2, -1, 1, 2]))
            new = score(a, b)
        else:
            noun = q.text.split(" ", 1)[1] if " " in q.text else None
            n = int(q.amount)
            if n < 50:
                m = max(2, n + rng.choice([-3, -2, -1, 1, 2, 3]))  # plural nouns
            else:
                step = 10 ** max(0, len(str(n)) - 3)
                m = max(step, int(round(n * factor / step)) * step)
            new = count(m, noun, q.unit)
        if new.text != q.text and not qty_match(new, q):
            return new
    raise RuntimeError(f"could not change {q.text!r}")


def _other_when(w: When, rng: random.Random) -> When:
    for _ in range(50):
        y, m, d = w.y, w.m, w.d
        part = rng.choice([p for p in ("y", "m", "d") if getattr(w, p) is not None])
        if part == "y":
            y = y + rng.choice([-3, -2, -1, 1, 2, 3])
        elif part == "m":
            m = (m - 1 + rng.randint(1, 11)) % 12 + 1
        else:
            d = rng.randint(1, _MONTH_DAYS[m - 1])
        new = when(y, m, d)
        if new.text != w.text:
            return new
    raise RuntimeError(f"could not change {w.text!r}")


def _mutate(view: DocView, facts: dict[str, _F], unit: Unit, slots: list[Slot], rng: random.Random,
            types: Sequence[str], verbs: dict[str, str], dry: bool = False) -> tuple[Slot, str, str, bool] | None:
    """Pick an error for one rendered unit: (slot, wrong text, type, intrinsic), or None if none applies.

    `dry=True` only asks whether one of `types` applies (True / None).
    """
    unit_ents = {e for r in unit.roles for e in (view.sig(r).ents)}
    by_type = {
        "entity_swap": [s for s in slots if s.attr in _ENTITY_ATTRS],
        "number_change": [s for s in slots if s.attr == "value"],
        "date_change": [s for s in slots if s.attr == "date"],
        "negation": [s for s in slots if s.attr == "verb"],
        "wrong_predicate": [s for s in slots if s.attr == "verb" and facts[s.role].pred in CONFLICT],
    }
    options = [t for t in types if by_type.get(t)]
    if dry:
        return True if options else None
    rng.shuffle(options)
    for etype in options:
        slot = rng.choice(by_type[etype])
        f = facts[slot.role]
        others = [s for s in view.sigs if s.role not in unit.roles]
        if etype == "entity_swap":
            got = _swap_entity(view, getattr(f, slot.attr).name, unit_ents, rng, rng.random() < 0.5)
            if got:
                return slot, got[0], etype, got[1]
        elif etype == "number_change":
            inside = [s.f.value for s in others if s.qty is not None and _qclass(s.qty) == _qclass(f.value)
                      and (s.f.value.unit == f.value.unit or _qclass(s.qty) != "count")
                      and not qty_match(s.qty, f.value)]
            new = rng.choice(inside) if inside and rng.random() < 0.5 else _other_qty(f.value, rng)
            return slot, new.text, etype, any(s.qty is not None and qty_match(new, s.qty) for s in view.sigs)
        elif etype == "date_change":
            kind = _when_kind(f.date)
            inside = [s.when for s in others if s.when is not None and _when_kind(s.when) == kind
                      and s.when.text != f.date.text]
            new = rng.choice(inside) if inside and rng.random() < 0.5 else _other_when(f.date, rng)
            return slot, new.text, etype, any(s.when is not None and s.when.text == new.text for s in view.sigs)
        elif etype == "negation":
            pair = next(p for p in PREDICATES[f.pred] if verbs[slot.role] in p)
            return slot, pair[1] if f.polarity else pair[0], etype, True
        elif etype == "wrong_predicate":
            idx = next(i for i, p in enumerate(PREDICATES[f.pred]) if verbs[slot.role] in p)
            wrong = PREDICATES[CONFLICT[f.pred]][idx % len(PREDICATES[CONFLICT[f.pred]])]
            return slot, wrong[0] if f.polarity else wrong[1], etype, True
    return None


def draft(doc: Document, rng: random.Random, n_errors: int | None = None, clean_rate: float = 0.2,
          max_errors: int = 3, types: Sequence[str] = ERROR_TYPES) -> tuple[str, list[dict]]:
    """A summary of a news world document with labelled errors: (text, labels).

    The summary states the document's key facts (its reference units, each in a
    freshly drawn paraphrase). `n_errors=None` draws the count: none with
    probability `clean_rate`, else 1..`max_errors`; at most one per sentence.
    Each label: `error_span` (exact substring of the sentence), `corrected_clause`
    (the whole corrected sentence, to write after `<delete scope="sentence"/>`),
    `regex_key` (finds the supporting sentence, built from the sentence's correct
    parts), `type`, `intrinsic` (the wrong value or entity occurs in the
    document) and `sentence_index` (in `sandbox.split_sentences(summary)`).
    """
    text, labels, _ = draft_detailed(doc, rng, n_errors, clean_rate, max_errors, types)
    return text, labels


def draft_detailed(doc: Document, rng: random.Random, n_errors: int | None = None, clean_rate: float = 0.2,
                   max_errors: int = 3, types: Sequence[str] = ERROR_TYPES) -> tuple[str, list[dict], list[int]]:
    """`draft`, plus the supporting article sentence of each label (what its regex key must find).

    The error type is drawn first (uniformly among the types some unbroken
    sentence can carry), then the sentence: every sentence names an entity, so
    drawing the sentence first would make most errors entity swaps.
    """
    view = DocView(doc)
    facts = {role: f for role, (_, f) in view.facts.items()}
    by_name = {u.name: u for u in view.family.units}
    units = [by_name[name] for name in doc.meta["units"]]
    verbs = _choose_verbs(facts, rng)
    templates = [rng.choice(u.templates) for u in units]
    rendered = [render(t, facts, verbs) for t in templates]
    if n_errors is None:
        n_errors = 0 if rng.random() < clean_rate else rng.randint(1, max(1, min(max_errors, len(units))))
    feasible = {(t, i) for i, (_, slots, _) in enumerate(rendered) for t in types
                if _mutate(view, facts, units[i], slots, rng, [t], verbs, dry=True)}
    sentences = [text for text, _, _ in rendered]
    labels, targets, broken = [], [], set()
    while len(labels) < n_errors:
        options = sorted({t for t, i in feasible if i not in broken}, key=types.index)
        if not options:
            break
        etype = rng.choice(options)
        i = rng.choice(sorted(i for t, i in feasible if t == etype and i not in broken))
        good, slots, _ = rendered[i]
        m = _mutate(view, facts, units[i], slots, rng, [etype], verbs)
        if m is None:  # no entity of that type to swap in after all
            feasible.discard((etype, i))
            continue
        slot, wrong, etype, intrinsic = m
        bad, bad_slots, _ = render(templates[i], facts, verbs, override={(slot.role, slot.attr): wrong})
        at = next(s for s in bad_slots if (s.role, s.attr) == (slot.role, slot.attr))
        span = bad[at.start:at.end]
        target = view.sig(slot.role).d["sentence"]
        sentences[i] = bad
        broken.add(i)
        labels.append({"error_span": span, "corrected_clause": good,
                       "regex_key": regex_key_for(view.sentences, target, bad, span, view.entities,
                                                  hide=good[slot.start:slot.end]),
                       "type": etype, "intrinsic": intrinsic, "sentence_index": i})
        targets.append(target)
    order = sorted(range(len(labels)), key=lambda k: labels[k]["sentence_index"])
    return " ".join(sentences), [labels[k] for k in order], [targets[k] for k in order]


# ===========================================================================
# 8. The leak-cluster guard (SN15 appendix 10.4)
# ===========================================================================
#
# Near-duplicates (a retold event, a paraphrase, the same facts with clauses
# reordered) must never sit on both sides of a train/eval split. Documents are
# MinHashed over two kinds of features:
# - word 3-shingles of the normalised text (lower case, numbers -> "#", stop
#   words dropped), which survive reordering of whole clauses and most synonym
#   swaps (a swap breaks only the shingles around it);
# - the document's entity and number set (capitalised names, the numbers as
#   written), repeated `entity_weight` times, so two articles about the same
#   facts match even when every sentence is paraphrased, and two articles that
#   share a template but not their facts do not.
# Clusters are the connected components of the pairs whose Jaccard similarity
# reaches `threshold` (MinHash LSH proposes the pairs). On the news world, with
# these defaults, retold events score 0.29-0.8 and different events of the same
# family at most about 0.2.

POOLS = ("train", "eval", "never_touch")
_NAME_SPAN = re.compile(r"[A-Z][\w'’-]*(?:\s+(?:of\s+)?[A-Z][\w'’-]*)*")
_NUMBER_TOKEN = re.compile(r"\d[\d,.]*\d|\d")
_MONTH_SET = frozenset(MONTHS)


def normalise_text(text: str) -> str:
    """The text a content hash covers: Unicode NFC, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def content_hash(text: str) -> str:
    return hashlib.sha256(normalise_text(text).encode("utf-8")).hexdigest()


def doc_features(text: str, shingle: int = 3, entity_weight: int = 8) -> set[str]:
    """MinHash features of a document: content-word shingles plus weighted entity and number features."""
    toks = ["#" if any(c.isdigit() for c in w) else w for w in sandbox.words(text)]
    content = [w for w in toks if w not in _STOP]
    feats = {" ".join(content[i:i + shingle]) for i in range(max(1, len(content) - shingle + 1))}
    names = set()
    for sent in sandbox.split_sentences(text):
        for m in _NAME_SPAN.finditer(sent):
            words = m.group().split()
            while words and (words[0].lower() in _STOP or words[0] in _MONTH_SET or words[0] in ("We", "I")):
                words = words[1:]  # "On April", "The Securities Commission": openers are not the name
            if not words or (len(words) == 1 and m.start() == 0 and m.group() == words[0]):
                continue  # nothing left, or a capitalised sentence opener
            names.add("e:" + " ".join(words).lower())
    # Numbers of three or more digits (amounts, counts, years): small ones recur everywhere.
    names |= {"n:" + n for n in (x.replace(",", "") for x in _NUMBER_TOKEN.findall(text)) if len(n) >= 3}
    feats |= {f"{x}#{k}" for x in names for k in range(entity_weight)}
    return feats


@dataclass(frozen=True)
class ClusterConfig:
    threshold: float = 0.25  # Jaccard similarity at which two documents are near-duplicates
    num_perm: int = 128  # MinHash permutations
    shingle: int = 3  # words per shingle
    entity_weight: int = 8  # copies of each entity/number feature


def cluster_documents(docs: Sequence[Document], threshold: float = 0.25, num_perm: int = 128, shingle: int = 3,
                      entity_weight: int = 8) -> dict[str, str]:
    """doc id -> cluster id ("c-" + the smallest member id). Deterministic; ids must be unique.

    MinHash LSH (at a lower threshold, so few true pairs are missed) proposes
    candidate pairs; a pair joins a cluster when the exact Jaccard similarity of
    its feature sets reaches `threshold`. Features are recomputed for candidates
    only, so memory stays at one sketch per document.
    """
    from datasketch import MinHash, MinHashLSH

    ids = [d.id for d in docs]
    dup = [k for k, n in Counter(ids).items() if n > 1]
    if dup:
        raise DataError(f"duplicate document ids: {dup[:5]}")
    text = {d.id: d.text for d in docs}
    lsh = MinHashLSH(threshold=max(0.05, 0.7 * threshold), num_perm=num_perm)
    sketches = {}
    for d in docs:
        mh = MinHash(num_perm=num_perm, seed=1)
        mh.update_batch([f.encode("utf-8") for f in sorted(doc_features(d.text, shingle, entity_weight))])
        sketches[d.id] = mh
        lsh.insert(d.id, mh)

    @functools.lru_cache(maxsize=4096)
    def feats(i: str) -> frozenset[str]:
        return frozenset(doc_features(text[i], shingle, entity_weight))

    parent = {i: i for i in ids}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i in ids:
        for j in sorted(lsh.query(sketches[i])):
            if j <= i or root(i) == root(j):
                continue
            fi, fj = feats(i), feats(j)
            if len(fi & fj) >= threshold * len(fi | fj):
                a, b = sorted((root(i), root(j)))
                parent[b] = a  # the smaller id becomes the root
    members: dict[str, list[str]] = defaultdict(list)
    for i in ids:
        members[root(i)].append(i)
    return {i: "c-" + min(members[root(i)]) for i in ids}


def read_manifest(path: str) -> dict:
    """A split manifest (`data.py split --out`); a missing or malformed file is a DataError naming it."""
    if not os.path.exists(path):
        raise DataError(f"split manifest {path} does not exist (make one with `python data.py split --docs "
                        f"DOCS --out {path}`)")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        manifest["pools"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a split manifest ({type(e).__name__}: {e})") from None
    return manifest


def pool_documents(docs: Sequence[Document], manifest: dict, pools: str | Sequence[str],
                   where: str = "the manifest") -> list[Document]:
    """The documents of `pools` (one name or several), in the order of `docs`,
    each checked against the manifest's content hash: a document changed since
    the split was frozen is not the one the split put there (LeakError)."""
    wanted = (pools,) if isinstance(pools, str) else tuple(pools)
    entries = {e["id"]: e for p in wanted for e in manifest["pools"].get(p, [])}
    out = [d for d in docs if d.id in entries]
    for d in out:
        if content_hash(d.text) != entries[d.id]["sha256"]:
            raise LeakError(f"document {d.id} changed since {where} was frozen (content hash differs)")
    return out


def held_out_guard(docs: Sequence[Document], manifest: dict, where: str = "the manifest") -> "LeakGuard":
    """A LeakGuard over the eval and never-touch pools of a split, with the split's
    own clustering parameters: what new training documents must not duplicate."""
    held = pool_documents(docs, manifest, ("eval", "never_touch"), where)
    return LeakGuard(held, **manifest.get("clustering", {}))


def fresh_documents(n: int | Iterable[int], seed: int, guard: "LeakGuard | None" = None
                    ) -> tuple[list[Document], list[str]]:
    """(documents, ids skipped): articles 0..n-1 (or the indices `n`) of the world
    `seed`, less those `guard` finds in a held-out cluster."""
    kept, skipped = [], []
    for i in (range(n) if isinstance(n, int) else n):
        doc = world_document(seed, i)
        if guard is not None and guard.match(doc) is not None:
            skipped.append(doc.id)
        else:
            kept.append(doc)
    return kept, skipped


class LeakGuard:
    """Near-duplicate test of new documents against a fixed set (held-out pools):
    the same features, LSH and exact-Jaccard threshold as `cluster_documents`,
    so a generated document that would have joined a held-out cluster is caught.

        guard = LeakGuard(eval_and_never_touch_docs, **manifest["clustering"])
        guard.match(doc)  # the held document id it duplicates, or None
    """

    def __init__(self, held: Sequence[Document], threshold: float = 0.25, num_perm: int = 128, shingle: int = 3,
                 entity_weight: int = 8):
        from datasketch import MinHashLSH

        self.threshold, self.num_perm, self.shingle, self.entity_weight = threshold, num_perm, shingle, entity_weight
        self.lsh = MinHashLSH(threshold=max(0.05, 0.7 * threshold), num_perm=num_perm)
        self.features: dict[str, frozenset[str]] = {}
        for d in held:
            feats = frozenset(doc_features(d.text, shingle, entity_weight))
            self.features[d.id] = feats
            self.lsh.insert(d.id, self._sketch(feats))

    def _sketch(self, feats):
        from datasketch import MinHash

        mh = MinHash(num_perm=self.num_perm, seed=1)
        mh.update_batch([f.encode("utf-8") for f in sorted(feats)])
        return mh

    def match(self, doc: Document) -> str | None:
        feats = frozenset(doc_features(doc.text, self.shingle, self.entity_weight))
        for j in sorted(self.lsh.query(self._sketch(feats))):
            other = self.features[j]
            if len(feats & other) >= self.threshold * len(feats | other):
                return j
        return None


def make_split(docs: Sequence[Document], fractions: Sequence[float] = (0.8, 0.1, 0.1), seed: int = 0,
               threshold: float = 0.25, num_perm: int = 128, shingle: int = 3, entity_weight: int = 8) -> dict:
    """Split whole leak clusters into train / eval / never-touch pools, stratified by bucket, seeded.

    Within each bucket, clusters are shuffled (seeded) and each goes to the pool
    furthest below its share of the bucket's documents. The manifest lists, per
    pool, each document's id, sha256 of its normalised text, cluster and bucket.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"fractions must be three non-negative shares summing to 1, got {fractions}")
    clusters = cluster_documents(docs, threshold, num_perm, shingle, entity_weight)
    by_cluster: dict[str, list[Document]] = defaultdict(list)
    for d in docs:
        by_cluster[clusters[d.id]].append(d)
    by_bucket: dict[str, list[str]] = defaultdict(list)
    for c, members in by_cluster.items():
        buckets = Counter(d.bucket for d in members)
        bucket = min(buckets, key=lambda b: (-buckets[b], b))  # majority, ties by name
        by_bucket[bucket].append(c)
    pools: dict[str, list[dict]] = {p: [] for p in POOLS}
    for bucket in sorted(by_bucket):
        cids = sorted(by_bucket[bucket])
        _rng(seed, "split", bucket).shuffle(cids)
        total = sum(len(by_cluster[c]) for c in cids)
        filled = dict.fromkeys(POOLS, 0)
        for c in cids:
            pool = max(POOLS, key=lambda p: (fractions[POOLS.index(p)] * total - filled[p], -POOLS.index(p)))
            filled[pool] += len(by_cluster[c])
            pools[pool] += [{"id": d.id, "sha256": content_hash(d.text), "cluster": c, "bucket": d.bucket}
                            for d in by_cluster[c]]
    for p in POOLS:
        pools[p].sort(key=lambda e: e["id"])
    return {
        "version": MANIFEST_VERSION,
        "seed": seed,
        "fractions": dict(zip(POOLS, fractions)),
        "clustering": dataclasses.asdict(ClusterConfig(threshold, num_perm, shingle, entity_weight)),
        "counts": {p: len(pools[p]) for p in POOLS},
        "clusters": len(by_cluster),
        "pools": pools,
    }


def check_split(manifest: dict, docs: Sequence[Document] | None = None) -> dict:
    """Verify a frozen split; raise `LeakError` naming the cluster and pools at fault.

    Checks: each id in one pool; each cluster in one pool; and, given the
    documents, that every document is in the manifest with an unchanged content
    hash and that re-clustering them (with the manifest's settings) puts no two
    near-duplicates in different pools, which catches a leak the manifest's own
    cluster labels hide. Returns counts.
    """
    if manifest.get("version") != MANIFEST_VERSION:
        raise LeakError(f"manifest version {manifest.get('version')!r}, expected {MANIFEST_VERSION}")
    pool_of: dict[str, str] = {}
    cluster_pools: dict[str, set[str]] = defaultdict(set)
    entry: dict[str, dict] = {}
    for pool in POOLS:
        for e in manifest["pools"].get(pool, []):
            if e["id"] in pool_of:
                raise LeakError(f"leak: document {e['id']!r} is in pools {pool_of[e['id']]!r} and {pool!r}")
            pool_of[e["id"]] = pool
            entry[e["id"]] = e
            cluster_pools[e["cluster"]].add(pool)
    for c, ps in sorted(cluster_pools.items()):
        if len(ps) > 1:
            ids = sorted(i for i, e in entry.items() if e["cluster"] == c)
            raise LeakError(f"leak: cluster {c!r} spans pools {sorted(ps, key=POOLS.index)} (ids {ids[:6]})")
    result = {"documents": len(pool_of), "clusters": len(cluster_pools),
              "pools": {p: sum(v == p for v in pool_of.values()) for p in POOLS}}
    if docs is None:
        return result
    for d in docs:
        if d.id not in entry:
            raise LeakError(f"document {d.id!r} is not in the frozen manifest; re-split with --force to add it")
        if content_hash(d.text) != entry[d.id]["sha256"]:
            raise LeakError(f"document {d.id!r} changed since the split was frozen (content hash differs)")
    cfg = manifest.get("clustering", {})
    recomputed = cluster_documents(docs, **cfg)
    groups: dict[str, list[str]] = defaultdict(list)
    for i, c in recomputed.items():
        groups[c].append(i)
    for c, ids in sorted(groups.items()):
        ps = sorted({pool_of[i] for i in ids}, key=POOLS.index)
        if len(ps) > 1:
            where = {p: [i for i in sorted(ids) if pool_of[i] == p][:3] for p in ps}
            raise LeakError(f"leak: near-duplicate cluster {c!r} spans pools {ps}: {where}")
    result["checked_documents"] = len(docs)
    return result


# ===========================================================================
# 9. Statistics
# ===========================================================================


def _dist(xs: Sequence[float]) -> dict:
    if not len(xs):
        return {}
    a = np.asarray(xs, dtype=float)
    p = np.percentile(a, [10, 50, 90])
    return {"min": float(a.min()), "p10": float(p[0]), "p50": float(p[1]), "p90": float(p[2]),
            "max": float(a.max()), "mean": round(float(a.mean()), 2)}


def world_stats(docs: Sequence[Document], draft_seed: int = 0, clean_rate: float = 0.2) -> dict:
    """Counts and length distributions; for news world documents also drafts and drafter/oracle agreement."""
    sents = [sandbox.split_sentences(d.text) for d in docs]
    out = {
        "documents": len(docs),
        "by_bucket": dict(sorted(Counter(d.bucket for d in docs).items())),
        "sentences_per_doc": _dist([len(s) for s in sents]),
        "words_per_doc": _dist([len(sandbox.words(d.text)) for d in docs]),
        "words_per_sentence": _dist([len(sandbox.words(x)) for s in sents for x in s]),
        "summary_sentences": _dist([len(sandbox.split_sentences(d.summary)) for d in docs if d.summary]),
        "summary_words": _dist([len(sandbox.words(d.summary)) for d in docs if d.summary]),
    }
    world = [d for d in docs if d.facts and d.bucket in FAMILIES]
    if not world:
        return out
    out["facts_per_doc"] = _dist([len(d.facts) for d in world])
    out["key_facts_per_doc"] = _dist([sum(f["key"] for f in d.facts) for d in world])
    out["distinct_events"] = len({d.meta.get("event") for d in world})
    types, intrinsic = Counter(), Counter()
    n_err = found_sent = found_type = false_alarm = clean_sents = 0
    ref_flagged = fixed = key_first = key_hit = drafts_clean = 0
    for k, d in enumerate(world):
        if oracle_errors(d, d.summary):
            ref_flagged += 1
        text, labels, targets = draft_detailed(d, _rng(draft_seed, "draft", k), clean_rate=clean_rate)
        drafts_clean += not labels
        oracle = oracle_errors(d, text)
        flagged = defaultdict(set)
        for lab in oracle:
            flagged[lab["sentence_index"]].add(lab["type"])
        injected = {lab["sentence_index"]: lab for lab in labels}
        for i in range(len(sandbox.split_sentences(text))):
            if i not in injected:
                clean_sents += 1
                false_alarm += bool(flagged.get(i))
        index = sandbox.DocIndex(d.text)
        for lab, tgt in zip(labels, targets):
            n_err += 1
            types[lab["type"]] += 1
            intrinsic[lab["type"]] += lab["intrinsic"]
            found_sent += bool(flagged.get(lab["sentence_index"]))
            found_type += lab["type"] in flagged.get(lab["sentence_index"], ())
            hits = index.search(f"/({lab['regex_key']})/").hits
            key_hit += tgt in hits
            key_first += bool(hits) and hits[0] == tgt
        if labels:
            parts = sandbox.split_sentences(text)
            for lab in labels:
                parts[lab["sentence_index"]] = lab["corrected_clause"]
            fixed += not oracle_errors(d, " ".join(p for p in parts if p))
    drafts_with_errors = len(world) - drafts_clean
    out["drafts"] = {
        "errors": n_err,
        "by_type": dict(sorted(types.items())),
        "intrinsic_by_type": dict(sorted(intrinsic.items())),
        "clean_drafts": drafts_clean,
    }
    out["agreement"] = {
        "oracle_recall_sentence": round(found_sent / max(1, n_err), 4),
        "oracle_recall_type": round(found_type / max(1, n_err), 4),
        "oracle_false_alarm_rate": round(false_alarm / max(1, clean_sents), 4),
        "references_flagged": ref_flagged,
        "drafts_fixed_by_corrections": round(fixed / max(1, drafts_with_errors), 4),
        "regex_key_hits_support": round(key_hit / max(1, n_err), 4),
        "regex_key_first_hit_support": round(key_first / max(1, n_err), 4),
    }
    return out


# ===========================================================================
# 10. Command line
# ===========================================================================


def _cmd_newsworld(args) -> int:
    t0 = time.perf_counter()
    docs = newsworld(args.n, args.seed, start=args.start, retell_rate=args.retell_rate)
    if args.out == "-":
        n = 0
        for d in docs:
            sys.stdout.write(dumps(d) + "\n")
            n += 1
    else:
        n = write_jsonl(args.out, docs)
    print(f"newsworld: {n} documents (seed {args.seed}) -> {args.out} in {time.perf_counter() - t0:.2f}s",
          file=sys.stderr)
    return 0


def _cmd_stats(args) -> int:
    t0 = time.perf_counter()
    report = LoadReport()
    docs = list(load_jsonl(args.path, mapping=args.map, limit=args.limit, skip_bad=args.skip_bad, report=report))
    stats = world_stats(docs, draft_seed=args.seed) if not args.no_drafts else world_stats(
        [dataclasses.replace(d, facts=[]) for d in docs])
    if report.n_bad:
        stats["skipped_lines"] = report.n_bad
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    for k, v in stats.items():
        print(f"{k:>22}: {json.dumps(v)}")
    print(json.dumps(stats))
    return 0


def _cmd_load(args) -> int:
    report = LoadReport()
    if args.hf:
        docs = load_hf(args.hf, config=args.config, split=args.split, mapping=args.map, limit=args.limit,
                       skip_bad=args.skip_bad, report=report)
    else:
        docs = load_jsonl(args.jsonl, mapping=args.map, limit=args.limit, skip_bad=args.skip_bad, report=report)
    n = write_jsonl(args.out, docs)
    print(f"load: {n} documents from {report.source} -> {args.out} ({report.n_bad} bad records skipped)",
          file=sys.stderr)
    for msg in report.errors[:5]:
        print(f"  skipped {msg}", file=sys.stderr)
    return 0


def _cmd_split(args) -> int:
    docs = read_documents(args.docs)
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            manifest = json.load(f)
        result = check_split(manifest, docs)
        print(f"split check passed: {json.dumps(result)}")
        return 0
    if not args.out:
        raise DataError("split needs --out MANIFEST (to freeze a split) or --check MANIFEST (to verify one)")
    if os.path.exists(args.out) and not args.force:
        raise DataError(f"{args.out} exists: a split is frozen once written (pass --force to replace it)")
    fractions = tuple(float(x) for x in args.fractions.split(","))
    manifest = make_split(docs, fractions, seed=args.seed, threshold=args.threshold, num_perm=args.num_perm,
                          shingle=args.shingle)
    check_split(manifest, docs)
    tmp = f"{args.out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    if args.docs_out:
        cluster = {e["id"]: e["cluster"] for p in POOLS for e in manifest["pools"][p]}
        write_jsonl(args.docs_out, (dataclasses.replace(d, cluster=cluster[d.id]) for d in docs))
    print(f"split: {manifest['counts']} in {manifest['clusters']} clusters -> {args.out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The CLI. A new command adds a subparser here and a handler to COMMANDS."""
    p = argparse.ArgumentParser(prog="data.py", description="Documents: the news world, loaders, stats, splits.")
    sub = p.add_subparsers(dest="command", required=True)

    nw = sub.add_parser("newsworld", help="write the built-in news world as Document JSONL")
    nw.add_argument("--n", type=int, default=1000, help="number of articles")
    nw.add_argument("--seed", type=int, default=0, help="world seed: same seed, same bytes")
    nw.add_argument("--start", type=int, default=0, help="index of the first article")
    nw.add_argument("--retell-rate", type=float, default=0.08, help="share of articles retelling an earlier event")
    nw.add_argument("--out", default="-", help="output JSONL file ('-' for stdout)")

    st = sub.add_parser("stats", help="counts, length distributions, drafter/oracle agreement")
    st.add_argument("path", help="Document JSONL file")
    st.add_argument("--seed", type=int, default=0, help="drafter seed")
    st.add_argument("--no-drafts", action="store_true", help="lengths and counts only")
    st.add_argument("--map", default=None, help="field mapping for foreign JSONL, e.g. text=article")
    st.add_argument("--limit", type=int, default=None)
    st.add_argument("--skip-bad", action="store_true", help="skip (and count) malformed lines")

    ld = sub.add_parser("load", help="convert JSONL (with a field mapping) or a HF dataset to Document JSONL")
    src = ld.add_mutually_exclusive_group(required=True)
    src.add_argument("--jsonl", help="input JSONL file")
    src.add_argument("--hf", help="Hugging Face dataset name, e.g. cnn_dailymail")
    ld.add_argument("--map", default=None, help="ours=theirs pairs: text=article,summary=highlights,id=id")
    ld.add_argument("--config", default=None, help="HF dataset config (cnn_dailymail: 3.0.0)")
    ld.add_argument("--split", default="train", help="HF dataset split")
    ld.add_argument("--limit", type=int, default=None, help="stop after this many documents")
    ld.add_argument("--skip-bad", action="store_true", help="skip (and count) malformed records")
    ld.add_argument("--out", required=True, help="output JSONL file")

    sp = sub.add_parser("split", help="freeze (or --check) a leak-cluster-guarded train/eval/never-touch split")
    sp.add_argument("--docs", required=True, help="Document JSONL file")
    sp.add_argument("--out", help="manifest to write (refuses to overwrite without --force)")
    sp.add_argument("--check", help="verify this manifest against --docs instead")
    sp.add_argument("--force", action="store_true", help="replace an existing manifest")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--fractions", default="0.8,0.1,0.1", help="train,eval,never_touch shares")
    sp.add_argument("--threshold", type=float, default=ClusterConfig.threshold)
    sp.add_argument("--num-perm", type=int, default=ClusterConfig.num_perm)
    sp.add_argument("--shingle", type=int, default=ClusterConfig.shingle)
    sp.add_argument("--docs-out", help="also write the documents with their cluster ids filled in")
    return p


COMMANDS: dict[str, Callable] = {"newsworld": _cmd_newsworld, "stats": _cmd_stats, "load": _cmd_load,
                                 "split": _cmd_split}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (DataError, LeakError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, LeakError) else 1


if __name__ == "__main__":
    sys.exit(main())
