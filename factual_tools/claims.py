"""Reading a text for the rules and the model-free factuality scorers: numbers, names, content words.

Number mentions normalised to comparable values ("$4.2 billion", "12 percent",
"March 3"), a heuristic named-entity reader (spaCy only when installed and asked
for), and per-text analyses (the document side cached by content). `rewards.py`
builds its rules and the lexical and support scorers on these.
"""
from __future__ import annotations

import bisect
import collections
import functools
import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Sequence


import data
import sandbox
from factual_tools import textsplit


# ---------------------------------------------------------------------------
# Small shared pieces: input coercion, keys, a bounded LRU
# ---------------------------------------------------------------------------


def text_of(x: Any) -> str:
    """A document or summary as text: str, a data.Document (.text), an Episode
    (.summary). Anything else is malformed and reads as ""."""
    if isinstance(x, str):
        return x
    if isinstance(x, sandbox.Episode):
        return x.summary if isinstance(x.summary, str) else ""
    text = getattr(x, "text", None)
    return text if isinstance(text, str) else ""


def text_key(text: str) -> bytes:
    """Cache key of a text: a 128-bit hash (surrogates allowed, so never raises)."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class LRU:
    """A bounded least-recently-used map."""

    def __init__(self, maxsize: int):
        self.maxsize = max(0, int(maxsize))
        self.data: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, default=None):
        if key in self.data:
            self.data.move_to_end(key)
            return self.data[key]
        return default

    def put(self, key, value) -> None:
        if self.maxsize == 0:
            return
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.maxsize:
            self.data.popitem(last=False)

    def __contains__(self, key) -> bool:
        return key in self.data

    def __len__(self) -> int:
        return len(self.data)

    def clear(self) -> None:
        self.data.clear()


# ---------------------------------------------------------------------------
# Numbers: mentions normalised to comparable values
# ---------------------------------------------------------------------------
# Stdlib `re` rather than `regex` on these hot paths: it is about twice as fast
# for these patterns, and the rules must score >= 2,000 summaries/s on one core.

_MONTHS = {"jan": 1, "feb": 2, "mar": 3, "apr": 4, "may": 5, "jun": 6, "jul": 7, "aug": 8, "sep": 9,
           "oct": 10, "nov": 11, "dec": 12}
# Case-sensitive inside the case-insensitive pattern: "5 may" is a verb.
_MON = (r"(?-i:Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?|"
        r"Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)")
_UNITS = {w: i for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen".split())}
_TENS = {w: 10 * (i + 2) for i, w in enumerate("twenty thirty forty fifty sixty seventy eighty ninety".split())}
_SCALES = {"hundred": 100, "thousand": 1e3, "million": 1e6, "billion": 1e9, "trillion": 1e12}
_NUMBER_WORDS = {**_UNITS, **_TENS, **_SCALES, "dozen": 12}
# "first" and "second" are left out: far more often "the first time" or a unit
# of time than a rank, and a rule that flags them would punish plain English.
_ORDINAL_WORDS = {w: i + 3 for i, w in enumerate(
    "third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth fourteenth fifteenth "
    "sixteenth seventeenth eighteenth nineteenth twentieth".split())}
_ORDINAL_WORDS.update({"thirtieth": 30, "fortieth": 40, "fiftieth": 50, "sixtieth": 60, "seventieth": 70,
                       "eightieth": 80, "ninetieth": 90, "hundredth": 100})
_ORDINAL_TAILS = {"first": 1, "second": 2, **{w: v for w, v in _ORDINAL_WORDS.items() if v < 10}}
_SCALE_SUFFIX = {"thousand": 1e3, "k": 1e3, "million": 1e6, "mn": 1e6, "m": 1e6, "billion": 1e9, "bn": 1e9,
                 "b": 1e9, "trillion": 1e12, "tn": 1e12}
_CURRENCY = {"$": "USD", "us$": "USD", "usd": "USD", "dollar": "USD", "dollars": "USD", "a$": "AUD",
             "c$": "CAD", "€": "EUR", "eur": "EUR", "euro": "EUR", "euros": "EUR", "£": "GBP", "gbp": "GBP",
             "pound": "GBP", "pounds": "GBP", "¥": "JPY", "jpy": "JPY", "yen": "JPY", "yuan": "CNY"}

_WORDNUM = "|".join(sorted(_NUMBER_WORDS, key=len, reverse=True))
_NUM_RE = re.compile(
    # dates first: at a given position the leftmost alternative wins
    r"(?P<iso>(?<!\d)\d{4}-\d{2}-\d{2}(?!\d))"
    r"|(?P<slash>(?<![\d/])\d{1,2}/\d{1,2}/(?:\d{4}|\d{2})(?![\d/]))"
    rf"|\b(?P<m1>{_MON})\.?\s+(?P<d1>\d{{1,2}})(?:st|nd|rd|th)?\b(?!\.\d|,\d{{3}})(?:,?\s+(?P<y1>\d{{4}})\b)?"
    rf"|\b(?P<d2>\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?(?P<m2>{_MON})\b\.?(?:,?\s+(?P<y2>\d{{4}})\b)?"
    rf"|\b(?P<m3>{_MON})\.?,?\s+(?P<y3>\d{{4}})\b"
    # clock times
    r"|(?<![\w.:])(?P<hh>\d{1,2}):(?P<mm>\d{2})(?![\d:])(?:\s?(?P<ap1>[ap]\.?m\b\.?))?"
    r"|(?<![\w.,])(?P<hh2>\d{1,2})\s?(?P<ap2>[ap]\.m\.|[ap]m\b)"
    # numerals, with currency, scale, percent, ordinal suffix, decade
    r"|(?<![\w.,])(?P<cur>US\$|[AC]\$|\$|€|£|¥|(?:USD|EUR|GBP|JPY)\s?)?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?!,\d|\.\d)"
    r"(?:(?P<ord>st|nd|rd|th)\b|(?P<decade>')?(?P<dec>s)\b)?"
    r"(?:\s?(?P<scale>thousand|million|billion|trillion|bn|mn|tn|[mbk])\b)?"
    r"(?:\s?(?P<pct>%|per\s?cent\b|percent\b|pct\b|percentage\s+points?\b))?"
    r"(?:\s(?P<cur2>dollars?|euros?|pounds?|yen|yuan|USD|EUR|GBP)\b)?"
    # ordinal words ("twenty-first", "third")
    rf"|\b(?:(?P<otens>{'|'.join(_TENS)})[\s-])?(?P<oword>{'|'.join(sorted(_ORDINAL_WORDS, key=len, reverse=True))})\b"
    rf"|\b(?P<otens2>{'|'.join(_TENS)})[\s-](?P<otail>{'|'.join(_ORDINAL_TAILS)})\b"
    # written cardinals ("twelve percent", "three million dollars")
    rf"|\b(?P<words>(?:{_WORDNUM})(?:(?:[\s-]+|\s+and\s+)(?:{_WORDNUM}))*)\b"
    r"(?:\s?(?P<wpct>per\s?cent|percent|pct)\b)?(?:\s(?P<wcur>dollars?|euros?|pounds?)\b)?",
    re.IGNORECASE,
)
_TRAILING_ZEROS = re.compile(r"0+$")
# `re` tries every alternative of _NUM_RE at every position (~100 us a
# sentence); trying it only where a mention can start is 4x faster.
_ANCHOR_RE = re.compile(r"US\$|[AC]\$|[\d$€£¥]|\.\d|[A-Za-z]+")
_ANCHOR_WORDS = (frozenset(_NUMBER_WORDS) | frozenset(_ORDINAL_WORDS) | frozenset(_TENS)
                 | {"january", "february", "march", "april", "may", "june", "july", "august", "september",
                    "october", "november", "december", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep",
                    "sept", "oct", "nov", "dec", "usd", "eur", "gbp", "jpy"})


def _num_matches(text: str) -> list[re.Match]:
    out, pos = [], 0
    for a in _ANCHOR_RE.finditer(text):
        p, t = a.start(), a.group()
        if p < pos or (t[0].isalpha() and t.lower() not in _ANCHOR_WORDS and t not in ("US$", "A$", "C$")):
            continue
        m = _NUM_RE.match(text, p)
        if m:
            out.append(m)
            pos = m.end()
    return out


class Num(NamedTuple):
    kind: str  # percent | money | number | year | ordinal | date | time
    value: float  # the normalised value (a date: month * 100 + day, day 0 if absent)
    unit: float  # half of this is the rounding slack of the stated precision (0: exact)
    currency: str | None
    text: str
    start: int
    alt: float | None = None  # a day/month-swapped reading of a slash date


def _numeral(s: str) -> tuple[float, float]:
    """'4,200.50' -> (4200.5, 0.01): the value and the unit of its last stated digit."""
    s = s.replace(",", "")
    if "." in s:
        whole, frac = s.split(".", 1)
        return float(s), 10.0 ** -len(frac)
    z = len(s) - len(_TRAILING_ZEROS.sub("", s)) if s.strip("0") else 0
    return float(s), 10.0 ** z


def _words_value(text: str) -> tuple[float, float] | None:
    """'two hundred and fifty' -> (250, 1); None when it is not a number on its own."""
    toks = [t for t in re.split(r"[\s-]+", text.lower()) if t and t != "and"]
    if toks == ["one"] or all(t in _SCALES or t == "dozen" for t in toks):
        return None  # "one of the ..." and a bare "million" are not stated numbers
    total, current, unit = 0.0, 0.0, 1.0
    for t in toks:
        if t in _UNITS or t in _TENS:
            current += _NUMBER_WORDS[t]
            unit = 1.0
        elif t == "dozen":
            current = (current or 1) * 12
        elif t == "hundred":
            current = (current or 1) * 100
            unit = 100.0
        else:  # thousand, million, ...
            scale = _SCALES[t]
            total += (current or 1) * scale
            current, unit = 0.0, scale
    return total + current, unit


def _year_ok(y: str | None) -> bool:
    return y is not None and len(y) == 4 and 1500 <= int(y) <= 2199


def numbers(text: str) -> list[Num]:
    """Every number mention in `text`, normalised: 12% = 12 percent = twelve percent;
    $4.2 billion = 4,200,000,000 dollars = $4.2bn; 1,000 = 1000; 3rd = third;
    March 3, 2024 = 3 March 2024 = 2024-03-03 (a date plus a year mention)."""
    out: list[Num] = []
    for m in _num_matches(text):
        g = m.groupdict()
        s, t = m.start(), m.group()
        if g["iso"]:
            y, mo, d = (int(x) for x in t.split("-"))
            if 1 <= mo <= 12 and 1 <= d <= 31:
                out += [Num("date", mo * 100 + d, 0, None, t, s), Num("year", y, 0, None, t, s)]
            continue
        if g["slash"]:
            a, b, y = t.split("/")
            a, b = int(a), int(b)
            y = int(y) + (2000 if len(y) == 2 else 0)
            if 1 <= a <= 12 and 1 <= b <= 31 or 1 <= b <= 12 and 1 <= a <= 31:
                alt = b * 100 + a if 1 <= b <= 12 and 1 <= a <= 31 else None
                first = a * 100 + b if 1 <= a <= 12 else alt
                out += [Num("date", first, 0, None, t, s, alt), Num("year", y, 0, None, t, s)]
            continue
        mon = g["m1"] or g["m2"] or g["m3"]
        if mon:
            mo = _MONTHS[mon[:3].lower()]
            day = int(g["d1"] or g["d2"] or 0)
            year = g["y1"] or g["y2"] or g["y3"]
            if day > 31:
                continue
            out.append(Num("date", mo * 100 + day, 0, None, t, s))
            if _year_ok(year):
                out.append(Num("year", int(year), 0, None, year, s))
            continue
        if g["hh"] or g["hh2"]:
            h = int(g["hh"] or g["hh2"])
            mi = int(g["mm"] or 0)
            ap = (g["ap1"] or g["ap2"] or "").lower()
            if ap.startswith("p") and h < 12:
                h += 12
            elif ap.startswith("a") and h == 12:
                h = 0
            if h < 24 and mi < 60:
                out.append(Num("time", h * 60 + mi, 0, None, t, s))
            continue
        if g["num"]:
            if len(g["num"]) > 30:
                continue  # a digit run, not a stated quantity
            value, unit = _numeral(g["num"])
            cur = (g["cur"] or g["cur2"] or "").strip().lower() or None
            scale = (g["scale"] or "").lower()
            if scale in ("m", "b", "k") and not cur:
                scale = ""  # "100m sprint", "4k screen": a single letter scales money only
            if scale:
                value, unit = value * _SCALE_SUFFIX[scale], unit * _SCALE_SUFFIX[scale]
            if g["pct"]:
                out.append(Num("percent", value, unit, None, t, s))
            elif cur:
                out.append(Num("money", value, unit, _CURRENCY.get(cur, cur.upper()), t, s))
            elif g["ord"]:
                out.append(Num("ordinal", value, 0, None, t, s))
            elif g["dec"] and len(g["num"]) in (2, 4) and g["num"].isdigit():
                decade = int(g["num"]) + (1900 if len(g["num"]) == 2 else 0)
                out.append(Num("year", decade, 0, None, t, s))
            elif not scale and g["num"].isdigit() and _year_ok(g["num"]) and len(g["num"]) == 4:
                out.append(Num("year", value, 0, None, t, s))
            else:
                out.append(Num("number", value, unit, None, t, s))
            continue
        if g["oword"] or g["otail"]:
            v = _ORDINAL_WORDS.get((g["oword"] or "").lower()) or _ORDINAL_TAILS[(g["otail"] or "").lower()]
            tens = g["otens"] or g["otens2"]
            out.append(Num("ordinal", v + (_TENS[tens.lower()] if tens else 0), 0, None, t, s))
            continue
        if g["words"]:
            parsed = _words_value(g["words"])
            if parsed is None:
                continue
            value, unit = parsed
            cur = (g["wcur"] or "").lower() or None
            if g["wpct"]:
                out.append(Num("percent", value, unit, None, t, s))
            elif cur:
                out.append(Num("money", value, unit, _CURRENCY[cur], t, s))
            else:
                out.append(Num("number", value, unit, None, t, s))
    return out


def _close(a: float, unit: float, b: float, rel_tol: float) -> bool:
    """`a` (stated to precision `unit`) is `b` rounded: within half a unit and `rel_tol`."""
    diff = abs(a - b)
    if diff <= 1e-9 * max(1.0, abs(b)):
        return True
    return diff <= unit / 2 + 1e-9 * max(1.0, abs(b)) and diff <= rel_tol * abs(b)


# Which document mention kinds can support a summary mention of each kind. A bare
# number is lenient (the summary may drop the unit); a unit is never invented.
_SUPPORTERS = {"percent": ("percent",), "money": ("money", "number"), "year": ("year", "number"),
               "ordinal": ("ordinal", "number"), "number": ("number", "money", "percent", "year", "ordinal"),
               "date": ("date",), "time": ("time",)}


def supports(doc_num: Num, num: Num, rel_tol: float) -> bool:
    """Does the document mention `doc_num` support the summary mention `num`?"""
    if doc_num.kind not in _SUPPORTERS[num.kind]:
        return False
    if num.kind == "date":  # a slash date has two readings, on either side
        for mine in (num.value, num.alt):
            for theirs in (doc_num.value, doc_num.alt):
                if mine is None or theirs is None:
                    continue
                (mo, day), (dmo, dday) = divmod(int(mine), 100), divmod(int(theirs), 100)
                if dmo == mo and (day == 0 or dday == day):
                    return True
        return False
    if num.kind == "money" and doc_num.kind == "money" and num.currency != doc_num.currency:
        return False
    if num.kind in ("year", "ordinal", "time") or doc_num.kind in ("year", "ordinal"):
        return abs(num.value - doc_num.value) < 1e-9
    return _close(num.value, num.unit, doc_num.value, rel_tol)


# ---------------------------------------------------------------------------
# Entities: a heuristic NER (spaCy only when installed and asked for)
# ---------------------------------------------------------------------------
# A name is a run of capitalised tokens (with "of", "de", "&", ... inside it:
# "Bank of America"), honorifics and months dropped; a sentence-initial word
# starts a name only when it is not a common word ("The", "Shares", "After").
# Its tokens are lower-cased with periods and possessives removed ("U.S." ->
# "us", "Acme's" -> "acme"). A summary name is supported when its tokens are a
# subset of one document name's ("Jane Doe" in "Jane K. Doe"), or it occurs as
# a phrase in the document ("Acme" in "acme shares").

_TOKEN_RE = re.compile(r"[^\W_](?:[\w&'’\-]|\.(?=\w))*\.?")
_CONNECTORS = frozenset("of de la del der van von du da di al bin y &".split())
_HONORIFICS = frozenset(
    "mr mrs ms miss dr prof sir dame lord lady sen rep gov gen col lt capt sgt president chairman chairwoman "
    "chief minister judge justice rev fr st saint mayor senator governor representative".split())
_WEEKDAYS = frozenset("monday tuesday wednesday thursday friday saturday sunday".split())
_MONTH_WORDS = frozenset(
    "january february march april may june july august september october november december "
    "jan feb mar apr jun jul aug sep sept oct nov dec".split())
_NOT_NAMES = frozenset(
    "ceo cfo coo cto chief ok tv am pm gdp ipo q1 q2 q3 q4 i".split()) | _WEEKDAYS | _MONTH_WORDS

STOPWORDS = frozenset(
    "a about above after again against all also am an and any are as at be because been before being below "
    "between both but by can could did do does doing down during each few for from further had has have having "
    "he her here hers herself him himself his how i if in into is it its itself just me more most my myself "
    "now of off on once only or other our ours ourselves out over own same she should so some such than that "
    "the their theirs them themselves then there these they this those through to too under until up very was "
    "we were what when where which while who whom why will with would you your yours yourself yourselves "
    "said says say according told also since however meanwhile its it's among amid per via upon onto "
    "may might must shall".split())
# Kept apart from STOPWORDS: a negation changes what a claim says.
NEGATIONS = frozenset(
    "not no never none nobody nothing neither nor without cannot can't won't don't doesn't didn't isn't "
    "aren't wasn't weren't hasn't haven't hadn't couldn't shouldn't wouldn't".split())
# Sentence-initial capitalised words that are not names (on top of STOPWORDS).
_COMMON_OPENERS = frozenset(
    "shares analysts officials investors revenue sales profit profits prices the a an in on at after before "
    "when while as but and however meanwhile last next earlier later then also both some many most one two "
    "three if so yet for by with according this that these those his her their our its it he she they we "
    "there here what why how who where company companies government police critics experts researchers "
    "residents workers customers employees".split())


@functools.lru_cache(maxsize=1 << 16)  # tokens repeat: memoised, the hot path halves
def _norm_token(tok: str) -> str:
    t = tok.lower()
    if t.isalnum():
        return t
    t = t.replace("’", "'")
    if t.endswith("'s"):
        t = t[:-2]
    return t.replace(".", "").strip("'-")


def _tokens(sentence: str) -> list[tuple[int, int, str, str]]:
    """(start, end, token, normalised token) of each token (plain tuples: this is a hot path)."""
    return [(m.start(), m.end(), m.group(), _norm_token(m.group())) for m in _TOKEN_RE.finditer(sentence)]


class Name(NamedTuple):
    tokens: tuple[str, ...]
    start: int  # character span in its sentence
    end: int
    # A lone capitalised word opening the sentence: a name only if the document
    # knows it as one ("Globex reported"); otherwise just a word ("Quarterly").
    weak: bool = False


def _entities_heuristic(sentence: str, toks: list | None = None) -> list[Name]:
    """The names of one sentence."""
    toks = toks if toks is not None else _tokens(sentence)
    names: list[Name] = []
    run: list[str] = []
    run_start = run_end = 0
    first_start = toks[0][0] if toks else -1

    def close():
        if all(t in STOPWORDS for t in run):
            return  # "The" after a bracket or stray period is not a name
        names.append(Name(tuple(run), run_start, run_end, run_start == first_start and len(run) == 1))

    pending: list[str] = []  # connectors waiting for the next capitalised token
    prev_end = 0
    first = True
    for start, end, tok, norm in toks:
        gap_has_punct = start > prev_end and not sentence[prev_end:start].isspace()
        prev_end = end
        if run and gap_has_punct:  # punctuation between tokens ends a name
            close()
            run, pending = [], []
        is_cap = tok[0].isupper() and norm not in _NOT_NAMES
        if first:
            first = False
            if is_cap and (norm in STOPWORDS or norm in _COMMON_OPENERS):
                is_cap = False
        if is_cap and norm in _HONORIFICS and not run:
            continue  # "Dr. Jane Doe" -> ("jane", "doe")
        if is_cap and norm:
            if not run:
                run_start = start
            run += pending + [norm]
            run_end = end
            pending = []
        elif run and tok.lower() in _CONNECTORS and not pending:
            pending = [tok.lower()]
        else:
            if run:
                close()
            run, pending = [], []
    if run:
        close()
    return names


_SPACY_LABELS = frozenset("PERSON ORG GPE LOC NORP FAC EVENT PRODUCT WORK_OF_ART LAW".split())
_spacy_pipelines: dict[str, Any] = {}


def _entities_spacy(sentence: str, model: str) -> list[Name]:
    nlp = _spacy_pipelines.get(model)
    if nlp is None:
        try:
            import spacy
        except ImportError:
            raise ImportError("rules.ner='spacy' needs spaCy: pip install spacy && "
                              f"python -m spacy download {model}") from None
        nlp = _spacy_pipelines[model] = spacy.load(model, disable=["parser", "lemmatizer"])
    out = []
    for ent in nlp(sentence).ents:
        if ent.label_ in _SPACY_LABELS:
            toks = tuple(t for t in (_norm_token(x) for x in _TOKEN_RE.findall(ent.text))
                         if t and t not in _HONORIFICS)
            if toks:
                out.append(Name(toks, ent.start_char, ent.end_char))
    return out


def entities(text: str, ner: str = "heuristic", spacy_model: str = "en_core_web_sm") -> list[tuple[str, ...]]:
    """The names in `text`, each as a tuple of normalised tokens."""
    out = []
    for sent in textsplit.split_sentences(text):
        found = _entities_spacy(sent, spacy_model) if ner == "spacy" else _entities_heuristic(sent)
        out += [name.tokens for name in found]
    return out


# ---------------------------------------------------------------------------
# Document and summary analyses (the document side cached per text)
# ---------------------------------------------------------------------------

_PROFANITY = frozenset(
    "fuck fucks fucked fucker fuckers fucking fuckin motherfucker motherfuckers motherfucking shit shits "
    "shitty shitting shite bullshit horseshit asshole assholes arsehole arseholes bitch bitches bitching "
    "bastard bastards cunt cunts wanker wankers twat twats bollocks slut sluts whore whores goddamn "
    "goddamned dumbass jackass douchebag pissed piss nigger niggers nigga faggot faggots fag fags kike "
    "kikes spic spics tranny".split())
_MARKUP_RE = re.compile(r"</?\s*(?:search|results|delete|error)\b[^<>]{0,200}>|<\d{1,3}>")


def stem_word(t: str) -> str:
    """A crude suffix strip, so 'values', 'valued' and 'value' meet, as do
    'countries'/'country' and 'stopped'/'stop'. Collisions only make support lenient."""
    if len(t) <= 3:
        return t
    if t.endswith("ies") and len(t) > 4:
        return t[:-3] + "y"
    for suffix in ("ing", "ed", "es", "s", "e"):
        if t.endswith(suffix) and len(t) - len(suffix) >= 3:
            if suffix == "s" and t.endswith(("ss", "us", "is")):
                break
            t = t[:-len(suffix)]
            if len(t) >= 4 and t[-1] == t[-2] and t[-1] not in "aeiouls":
                t = t[:-1]
            break
    return t


# Words that are part of a number mention ("12 percent", "$4.2 billion", "March
# 3"): the number check covers them, so content-word recall must not.
_NUMERIC_WORDS = (frozenset(_NUMBER_WORDS) | frozenset(_ORDINAL_WORDS) | frozenset(_ORDINAL_TAILS)
                  | frozenset(_SCALE_SUFFIX) | frozenset(_CURRENCY) | _MONTH_WORDS
                  | frozenset("percent cent pct percentage point points".split()))


@functools.lru_cache(maxsize=1 << 16)
def _content_word(t: str) -> str | None:
    """A normalised token's content word: None for stopwords, numerals and number
    words (numbers are checked on their own)."""
    if not t or t in STOPWORDS or t in _NUMERIC_WORDS or t[0].isdigit():
        return None
    return t if t in NEGATIONS else stem_word(t)


@dataclass
class DocInfo:
    """Everything the rules and the lexical scorer need from one document.
    Premises are its sentences (then windows of `window_sentences`, if > 1)."""
    text: str
    sentences: list[str]
    nums: dict[str, list[tuple[float, Num, int]]]  # kind -> sorted (value, mention, sentence index)
    names: list[tuple[frozenset, int]]  # (name tokens, sentence index)
    name_index: dict[str, list[int]]  # token -> indices into `names`
    sentence_words: list[str]  # " normalised tokens " per sentence, for phrase look-ups
    premise_spans: list[tuple[int, int]]  # sentences [a, b) of each premise
    sentence_premises: list[tuple[int, ...]]  # premises that hold each sentence
    word_premises: dict[str, tuple[int, ...]]  # content word -> premises that hold it
    premise_negated: list[bool]
    memo: dict = field(default_factory=dict)  # support look-ups of summary mentions (bounded)


def _premise_spans(n: int, window: int) -> list[tuple[int, int]]:
    spans = [(i, i + 1) for i in range(n)]
    if window > 1 and n > 1:
        spans += [(i, min(n, i + window)) for i in range(max(1, n - window + 1))]
    return spans


def _analyse_document(text: str, ner: str, spacy_model: str, window: int) -> DocInfo:
    spans = textsplit.sentence_spans(text)
    sentences = [text[a:b] for a, b in spans]
    starts = [a for a, _ in spans]
    nums: dict[str, list] = collections.defaultdict(list)
    for n in numbers(text):
        nums[n.kind].append((n.value, n, max(0, bisect.bisect_right(starts, n.start) - 1)))
    for v in nums.values():
        v.sort(key=lambda x: x[0])
    names, index = [], collections.defaultdict(list)
    sentence_words, content = [], []
    for i, sent in enumerate(sentences):
        toks = _tokens(sent)
        ents = _entities_spacy(sent, spacy_model) if ner == "spacy" else _entities_heuristic(sent, toks)
        for e in ents:
            e = e.tokens
            for tok in set(e):
                index[tok].append(len(names))
            names.append((frozenset(e), i))
        sentence_words.append(" " + " ".join(t[3] for t in toks) + " ")
        content.append({w for w in map(_content_word, (t[3] for t in toks)) if w})
    pspans = _premise_spans(len(sentences), window)
    sent_prem: list[list[int]] = [[] for _ in sentences]
    word_prem: dict[str, set] = collections.defaultdict(set)
    negated = []
    for p, (a, b) in enumerate(pspans):
        neg = False
        for i in range(a, b):
            sent_prem[i].append(p)
            for w in content[i]:
                word_prem[w].add(p)
                neg = neg or w in NEGATIONS
        negated.append(neg)
    return DocInfo(text, sentences, dict(nums), names, dict(index), sentence_words, pspans,
                   [tuple(x) for x in sent_prem], {w: tuple(sorted(v)) for w, v in word_prem.items()}, negated)


DOC_CACHE = LRU(512)


def document_info(document: Any, ner: str = "heuristic", spacy_model: str = "en_core_web_sm",
                  window_sentences: int = 1) -> DocInfo:
    """The cached analysis of a document (keyed by a hash of its text and the
    settings that shape it: `rewards.document_info` passes a RewardConfig's)."""
    text = text_of(document)
    key = (text_key(text), ner, spacy_model, window_sentences)
    info = DOC_CACHE.get(key)
    if info is None:
        info = _analyse_document(text, ner, spacy_model, window_sentences)
        DOC_CACHE.put(key, info)
    return info


class Part(NamedTuple):
    """What one clause of a claim states."""
    content: list[str]  # content words (name tokens included)
    names: list[Name]
    nums: list[Num]


@dataclass
class Claim:
    """One summary sentence, as the rules and the lexical scorer see it."""
    text: str
    content: list[str]
    names: list[Name]
    nums: list[Num]
    clauses: list[Part]


# Clause boundaries: a comma, semicolon, colon or dash, a bracket, or a
# coordinating word, each followed by more text.
_CLAUSE_RE = re.compile(r"[,;:]\s+|\s+[-–—]+\s+|\s*[()]\s*|\s+(?:and|but|while|whereas)\s+(?=\w)")


def _claim(sent: str, ner: str, spacy_model: str) -> Claim:
    nums = numbers(sent)
    toks = _tokens(sent)
    names = _entities_spacy(sent, spacy_model) if ner == "spacy" else _entities_heuristic(sent, toks)
    inside = [(n.start, n.start + len(n.text)) for n in nums]
    cuts = [m.start() for m in _CLAUSE_RE.finditer(sent)
            if not any(a < m.start() < b for a, b in inside)]
    parts = [Part([], [], []) for _ in range(len(cuts) + 1)]
    content = []
    for start, _, _, norm in toks:
        w = _content_word(norm)
        if w:
            content.append(w)
            parts[bisect.bisect_right(cuts, start)].content.append(w)
    for name in names:
        parts[bisect.bisect_right(cuts, name.start)].names.append(name)
    for n in nums:
        parts[bisect.bisect_right(cuts, n.start)].nums.append(n)
    return Claim(sent, content, names, nums, [p for p in parts if p.content or p.names or p.nums])


@dataclass
class SummaryInfo:
    text: str
    n_words: int
    claims: list[Claim]
    profane: list[str]
    markup: list[str]
    episode: Any = None  # the sandbox.Episode, when one was scored


def summary_info(summary: Any, ner: str = "heuristic", spacy_model: str = "en_core_web_sm",
                 profanity_extra: Sequence[str] = ()) -> SummaryInfo:
    """A summary's claims, profanity and leftover tool markup (`rewards.summary_info`
    passes a RewardConfig's settings)."""
    text = text_of(summary)
    episode = summary if isinstance(summary, sandbox.Episode) else None
    words = textsplit.words(text)
    bad = _PROFANITY | {w.lower() for w in profanity_extra}
    profane = [w for w in words if w in bad]
    claims = [_claim(sent, ner, spacy_model) for sent in textsplit.split_sentences(text)]
    return SummaryInfo(text, len(words), claims, profane, _MARKUP_RE.findall(text), episode)


_MEMO_MAX = 50_000  # summary mentions remembered per document


def _memo(doc: DocInfo, key, compute):
    hit = doc.memo.get(key)
    if hit is None:
        if len(doc.memo) >= _MEMO_MAX:
            doc.memo.clear()
        hit = doc.memo[key] = compute()
    return hit


def num_sentences(doc: DocInfo, num: Num, rel_tol: float) -> tuple[int, ...]:
    """Sentences with a mention that supports `num` (value-indexed per kind)."""
    def compute():
        out = set()
        slack = num.unit / 2 + 1e-9 * max(1.0, abs(num.value))
        for kind in _SUPPORTERS[num.kind]:
            rows = doc.nums.get(kind)
            if not rows:
                continue
            if num.kind == "date" or kind == "date":
                cands = rows
            else:
                lo = bisect.bisect_left(rows, num.value - slack, key=lambda r: r[0])
                hi = bisect.bisect_right(rows, num.value + slack, key=lambda r: r[0])
                cands = rows[lo:hi]
            out.update(i for _, d, i in cands if supports(d, num, rel_tol))
        return tuple(sorted(out))
    return _memo(doc, ("num", num.kind, num.value, num.unit, num.currency, rel_tol), compute)


def premises_of(doc: DocInfo, key: tuple, sents: tuple[int, ...]) -> frozenset:
    """The premises holding any of `sents` (memoised with the mention `key`)."""
    return _memo(doc, ("premises",) + key, lambda: frozenset(p for i in sents for p in doc.sentence_premises[i]))


def name_sentences(doc: DocInfo, name: tuple[str, ...]) -> tuple[int, ...]:
    def compute():
        toks = set(name)
        hits = {doc.names[k][1] for k in doc.name_index.get(name[0], ()) if toks <= doc.names[k][0]}
        if not hits:
            phrase = " " + " ".join(name) + " "
            hits = {i for i, s in enumerate(doc.sentence_words) if phrase in s}
        return tuple(sorted(hits))
    return _memo(doc, ("name", name), compute)


# ---------------------------------------------------------------------------
# Search keys: a regex that finds one document sentence, built from what a writer has
# (the synthetic traces' searches and the news world's teacher labels)
# ---------------------------------------------------------------------------

def rx_escape(text: str) -> str:
    """Escape regex metacharacters only (re.escape also escapes spaces, which reads badly in a trace)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


def _key_hits(pattern: str, sentences: Sequence[str]) -> list[int]:
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
        if w.lower() not in data.STOP_WORDS and keep(w) and not any(a <= m.start() < a + len(t) for a, t, _ in anchors):
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
            hits = _key_hits(pattern, sentences)
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
