"""Rewards: the rule bundle, FENICE, a lexical factuality scorer, tool terms, the
combined reward and its curriculum (DESIGN.md section 5).

    R = gate * (w_f * F + w_r * Rules + w_pass * pass) - budget - cap_penalty + w_match * ToolMatch
    pass = F >= tau and every rule reaches its threshold
    gate = length score * repetition score, 0 for a summary that states nothing

The gate and the pass bonus close the reward's holes (a reward must not pay for
saying nothing): see `RewardConfig.gate`, and the audit table in the tests.

`F` comes from one of five backends, chosen by `RewardConfig.factuality`:
- "fenice": FENICE (Scire et al. 2024): claims from a seq2seq extractor, NLI of
  each claim against document sentences, 5-sentence chunks and the whole
  document, best alignment per claim, mean over claims. Needs torch and two HF
  models (loaded once, lazily; half precision on a GPU).
- "lexical": a model-free approximation built for the news world's errors: claims
  are the summary's sentences, each scored by its best-supporting document
  sentence on content words, entities and numbers. It is reported as
  "lexical (model-free approximation)" and is not FENICE.
- "support" (the default): a model-free scorer for real text: the share of each summary
  sentence's content words the document holds, times how many adjacent word
  pairs co-occur there; the worst sentence. Reported as SUPPORT_NAME.
- "learned": factcheck.py's logistic regression over model-free features,
  weights from `reward.learned.path`. Reported as LEARNED_NAME.
- "oracle": the built-in news world's fact table (`oracle.oracle_fact_score`, the share of
  sentences with no error; `oracle_unit="fact"`: `oracle.oracle_fact_precision`).

Entry points (DESIGN.md section 9): `rule_scores`, `lexical_factuality`, `support_factuality`, `factuality_batch`,
`score`, `score_batch`, `tool_match`, `Curriculum`, `RewardConfig`, `Scorer`.
Every rule is total: any input (empty, huge, binary junk, markup) gets a score
in [0, 1] and never raises; a summary with no words scores 0 on every rule.

The module imports numpy, `regex` (through sandbox) and the stdlib only; torch
and transformers are imported inside the FENICE code, so rewards load on a CPU
machine without vLLM or a GPU.

Where this departs from the FENICE reference code (github.com/Babelscape/FENICE)
is stated at the place it happens; in short: our sentence splitter instead of
spaCy's, premises truncated instead of claims, no-claim summaries get a defined
score, caches bounded and keyed by content instead of by batch position.
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import difflib
import functools
import hashlib
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Literal, NamedTuple, Sequence

import numpy as np

import sandbox

# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

RULES = ("length", "entities", "numbers", "repetition", "profanity", "tool_format")
LEXICAL_NAME = "lexical (model-free approximation)"
SUPPORT_NAME = "support (model-free, document-level word support)"
LEARNED_NAME = "learned (logistic regression over model-free features)"
BACKEND_NAMES = {"fenice": "fenice", "lexical": LEXICAL_NAME, "support": SUPPORT_NAME, "learned": LEARNED_NAME,
                 "oracle": "oracle (news world fact table)"}
Backend = Literal["fenice", "lexical", "support", "learned", "oracle"]  # a config's factuality key (every script)


def _rule_map(values: dict[str, float], defaults: dict[str, float], what: str) -> dict[str, float]:
    """Defaults for missing rules; an unknown rule name is an error naming the nearest one."""
    for k in values:
        if k not in defaults:
            near = difflib.get_close_matches(k, list(defaults), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(f"{what}: unknown rule {k!r} (rules: {', '.join(defaults)}){hint}")
    return {**defaults, **{k: float(v) for k, v in values.items()}}


_RULE_WEIGHTS = {r: 1.0 for r in RULES}
# Numbers, repetition, profanity and tool format are all-or-nothing facts; length
# passes half-way down its soft edge; entities leave room for the heuristic NER's noise.
_RULE_PASS = {"length": 0.5, "entities": 0.8, "numbers": 1.0, "repetition": 1.0, "profanity": 1.0,
              "tool_format": 1.0}


@dataclass
class RuleConfig:
    min_words: int = 15  # the length score is 1 from min_words to max_words
    max_words: int = 120
    soft_words: int = 15  # and falls linearly to 0 over this many words past either bound
    # repetition: 1 while at least repeat_fresh of the summary's word trigrams are distinct,
    # falling linearly to 0 at repeat_floor; times the share of distinct sentences
    repeat_fresh: float = 0.9
    repeat_floor: float = 0.5
    number_rel_tolerance: float = 0.05  # a rounded number may differ from the document's by this fraction at most
    ner: Literal["heuristic", "spacy"] = "heuristic"  # spacy must be installed when asked for
    spacy_model: str = "en_core_web_sm"  # the spaCy pipeline used when ner == "spacy"
    profanity_extra: list[str] = field(default_factory=list)  # words added to the built-in list
    weights: dict[str, float] = field(default_factory=dict)  # rule -> weight in the rules mean (default 1 each)
    pass_at: dict[str, float] = field(default_factory=dict)  # rule -> score needed to pass (defaults in _RULE_PASS)

    def __post_init__(self):
        self.weights = _rule_map(self.weights, _RULE_WEIGHTS, "rules.weights")
        self.pass_at = _rule_map(self.pass_at, _RULE_PASS, "rules.pass_at")
        if sum(self.weights.values()) <= 0:
            raise ValueError("rules.weights must have a positive sum")


@dataclass
class LexicalConfig:
    window_sentences: int = 1  # premises are single sentences, plus windows of this many (1: none)
    intrinsic_factor: float = 0.5  # per number/entity found in the document but not in the aligned premise
    extrinsic_factor: float = 0.25  # per number/entity found nowhere in the document
    negation_factor: float = 0.5  # when the claim and its aligned premise differ in negation
    max_claims: int = 64  # summary sentences scored; any past this score 0 (bounds the work on junk)


@dataclass
class SupportConfig:
    window: int = 1  # two content words co-occur when they are at most this many document sentences apart
    pair_exponent: float = 0.5  # weight of the co-occurrence share against the word share
    reduce: Literal["min", "mean"] = "min"  # over summary sentences


@dataclass
class LearnedConfig:
    path: str = "scorers/learned.json"  # shipped; rewritten by `python factcheck.py train` (see factcheck.py)


@dataclass
class FeniceConfig:
    claim_model: str = "Babelscape/t5-base-summarization-claim-extractor"  # HF id or local path (seq2seq)
    nli_model: str = "MoritzLaurer/DeBERTa-v3-large-mnli-fever-anli-ling-wanli"  # HF id or path (3-way NLI)
    contrast: Literal["entail_minus_neutral", "entail_minus_contradict"] = "entail_minus_neutral"
    chunk_sentences: int = 5  # sentences per chunk premise (sliding window)
    chunk_stride: int = 1  # sentences between chunk starts
    chunk_level: bool = True  # score claims against chunks (when the document has more than one)
    doc_level: bool = True  # score claims against the whole document (same condition)
    use_coref: bool = False  # coreference-edited premises (needs `fastcoref`)
    claim_batch_size: int = 32  # summaries per claim-extraction generate call
    claim_max_new_tokens: int = 256  # generated tokens per summary's claim list
    nli_batch_size: int = 64  # premise/claim pairs per NLI forward (sentences and chunks)
    nli_max_tokens: int = 1024  # pair length limit for sentence and chunk premises
    doc_batch_size: int = 4  # pairs per NLI forward for whole-document premises
    doc_max_tokens: int = 4096  # pair length limit for the whole-document premise
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:1", ...
    half_precision: bool = True  # bf16 (fp16 if bf16 is unsupported) on a GPU; always fp32 on CPU
    cache_documents: int = 256  # documents whose premises and alignments are kept (LRU)
    cache_claims: int = 8192  # summaries whose claims are kept (LRU)
    cache_alignments_per_doc: int = 4096  # claim alignments kept per document


@dataclass
class ToolTermsConfig:
    budget_per_call: float = 0.05  # subtracted per search and per delete call
    delete_cap_penalty: float = 0.5  # subtracted when the episode hit the delete cap
    tool_cap_penalty: float = 0.5  # subtracted when the episode hit the tool-call cap
    w_match: float = 0.0  # weight of ToolMatch against a teacher episode (drgrpo_v19 sets it)
    match_kind_weight: float = 0.5  # share of a step's agreement given for calling the same tool


@dataclass
class CurriculumConfig:
    taus: list[float] = field(default_factory=lambda: [0.5, 0.65])  # factuality thresholds, in order
    raise_pass_rate: float = 0.2  # move to the next tau once the running pass rate exceeds this
    window_samples: int = 512  # scored rollouts in the running pass rate (it must be full to raise)

    def __post_init__(self):
        if not self.taus:
            raise ValueError("curriculum.taus must not be empty")


@dataclass
class RewardConfig:
    # Backend of F. `support` by default: on human-labelled real summaries (bench/factuality.py)
    # it beats word overlap and entity/number overlap, where `lexical` loses to word overlap;
    # `lexical` is the better model-free choice on the news world's in-document swaps (name it).
    factuality: Backend = "support"
    # The oracle's unit: "sentence", the share of summary sentences with no error;
    # "fact", the share of stated names, numbers and dates it supports (fact precision).
    oracle_unit: Literal["sentence", "fact"] = "sentence"
    w_factuality: float = 0.7  # w_f
    w_rules: float = 0.3  # w_r
    # Added when the summary passes (F >= the curriculum's tau and every rule), so tau acts
    # on the reward that is optimised, not only on the reported pass rate.
    w_pass: float = 0.2
    # The gate: the content terms (w_f F + w_r Rules + w_pass pass) count times the length
    # score, the repetition score, and 0 for a summary that states nothing (no content word,
    # name or number). Every factuality backend scores the claims a summary makes
    # (precision), so without it saying little or repeating one safe sentence pays: measured
    # on the tiny CPU run, Dr. GRPO collapsed to 4-token summaries within 40 steps, then
    # found "Granite Group. Granite Group. ..." and "on on on ...".
    gate: bool = True
    rules: RuleConfig = field(default_factory=RuleConfig)
    lexical: LexicalConfig = field(default_factory=LexicalConfig)
    support: SupportConfig = field(default_factory=SupportConfig)
    learned: LearnedConfig = field(default_factory=LearnedConfig)
    fenice: FeniceConfig = field(default_factory=FeniceConfig)
    tools: ToolTermsConfig = field(default_factory=ToolTermsConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)


# ---------------------------------------------------------------------------
# Small shared pieces: input coercion, keys, a bounded LRU
# ---------------------------------------------------------------------------


def _text_of(x: Any) -> str:
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
    for sent in sandbox.split_sentences(text):
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


def _stem(t: str) -> str:
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
    return t if t in NEGATIONS else _stem(t)


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
    spans = sandbox.sentence_spans(text)
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


_DOC_CACHE = LRU(512)


def document_info(document: Any, cfg: RewardConfig | None = None) -> DocInfo:
    """The cached analysis of a document (keyed by a hash of its text and the
    settings that shape it)."""
    cfg = cfg or _DEFAULT_CFG
    text = _text_of(document)
    key = (text_key(text), cfg.rules.ner, cfg.rules.spacy_model, cfg.lexical.window_sentences)
    info = _DOC_CACHE.get(key)
    if info is None:
        info = _analyse_document(text, cfg.rules.ner, cfg.rules.spacy_model, cfg.lexical.window_sentences)
        _DOC_CACHE.put(key, info)
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


def _claim(sent: str, cfg: RuleConfig) -> Claim:
    nums = numbers(sent)
    toks = _tokens(sent)
    names = _entities_spacy(sent, cfg.spacy_model) if cfg.ner == "spacy" else _entities_heuristic(sent, toks)
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


def summary_info(summary: Any, cfg: RewardConfig | None = None) -> SummaryInfo:
    cfg = cfg or _DEFAULT_CFG
    text = _text_of(summary)
    episode = summary if isinstance(summary, sandbox.Episode) else None
    words = sandbox.words(text)
    bad = _PROFANITY | {w.lower() for w in cfg.rules.profanity_extra}
    profane = [w for w in words if w in bad]
    claims = [_claim(sent, cfg.rules) for sent in sandbox.split_sentences(text)]
    return SummaryInfo(text, len(words), claims, profane, _MARKUP_RE.findall(text), episode)


_MEMO_MAX = 50_000  # summary mentions remembered per document


def _memo(doc: DocInfo, key, compute):
    hit = doc.memo.get(key)
    if hit is None:
        if len(doc.memo) >= _MEMO_MAX:
            doc.memo.clear()
        hit = doc.memo[key] = compute()
    return hit


def _num_sentences(doc: DocInfo, num: Num, rel_tol: float) -> tuple[int, ...]:
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


def _premises_of(doc: DocInfo, key: tuple, sents: tuple[int, ...]) -> frozenset:
    """The premises holding any of `sents` (memoised with the mention `key`)."""
    return _memo(doc, ("premises",) + key, lambda: frozenset(p for i in sents for p in doc.sentence_premises[i]))


def _name_sentences(doc: DocInfo, name: tuple[str, ...]) -> tuple[int, ...]:
    def compute():
        toks = set(name)
        hits = {doc.names[k][1] for k in doc.name_index.get(name[0], ()) if toks <= doc.names[k][0]}
        if not hits:
            phrase = " " + " ".join(name) + " "
            hits = {i for i, s in enumerate(doc.sentence_words) if phrase in s}
        return tuple(sorted(hits))
    return _memo(doc, ("name", name), compute)


# ---------------------------------------------------------------------------
# Rules: each (document, summary) -> (score in [0, 1], evidence)
# ---------------------------------------------------------------------------


class RuleResult(NamedTuple):
    score: float
    evidence: Any


def rule_length(doc: DocInfo, s: SummaryInfo, cfg: RuleConfig) -> RuleResult:
    n, lo, hi, soft = s.n_words, cfg.min_words, cfg.max_words, max(1, cfg.soft_words)
    if n < lo:
        score = max(0.0, 1.0 - (lo - n) / soft)
    elif n > hi:
        score = max(0.0, 1.0 - (n - hi) / soft)
    else:
        score = 1.0
    return RuleResult(score, {"words": n, "bounds": [lo, hi]})


# Entities and numbers: the share of those stated that the document supports. Stating
# none of a kind the document has scores 0, not 1: a rule that a summary satisfies by
# saying nothing is a hole an RL policy finds within tens of steps (measured on the tiny
# run: "The. The. A." and content-free text scored near the top).

def rule_entities(doc: DocInfo, s: SummaryInfo, cfg: RuleConfig) -> RuleResult:
    names = [n for c in s.claims for n in c.names
             if not (n.weak and not _name_sentences(doc, n.tokens))]
    missing = [" ".join(n.tokens) for n in names if not _name_sentences(doc, n.tokens)]
    score = 1.0 - len(missing) / len(names) if names else float(not doc.names)
    return RuleResult(score, {"names": len(names), "unsupported": missing})


def rule_numbers(doc: DocInfo, s: SummaryInfo, cfg: RuleConfig) -> RuleResult:
    nums = [n for c in s.claims for n in c.nums]
    tol = cfg.number_rel_tolerance
    missing = [n.text for n in nums if not _num_sentences(doc, n, tol)]
    score = 1.0 - len(missing) / len(nums) if nums else float(not doc.nums)
    return RuleResult(score, {"numbers": len(nums), "unsupported": missing})


def rule_repetition(doc: DocInfo, s: SummaryInfo, cfg: RuleConfig) -> RuleResult:
    """Distinct word trigrams (a repeated phrase, "on on on") times distinct sentences
    (a repeated claim counts once: "Granite Group. Granite Group.")."""
    words = [w.lower() for w in sandbox.words(s.text)]
    grams = list(zip(words, words[1:], words[2:]))
    fresh = len(set(grams)) / len(grams) if grams else 1.0
    span = max(1e-9, cfg.repeat_fresh - cfg.repeat_floor)
    phrase = min(1.0, max(0.0, (fresh - cfg.repeat_floor) / span))
    keys = [tuple(w.lower() for w in sandbox.words(c.text)) for c in s.claims]
    keys = [k for k in keys if k]
    sentences = len(set(keys)) / len(keys) if keys else 1.0
    return RuleResult(phrase * sentences, {"distinct_trigrams": round(fresh, 4), "distinct_sentences": round(sentences, 4)})


def rule_profanity(doc: DocInfo, s: SummaryInfo, cfg: RuleConfig) -> RuleResult:
    return RuleResult(0.0 if s.profane else 1.0, {"found": s.profane})


def rule_tool_format(doc: DocInfo, s: SummaryInfo, cfg: RuleConfig) -> RuleResult:
    """Well-formed tool use, as the sandbox judged it; for a bare summary string,
    tool markup left in the text is malformed."""
    ep = s.episode
    if ep is None:
        return RuleResult(0.0 if s.markup else 1.0, {"markup": s.markup})
    errors = [f"{c.kind}: {c.error}" for c in ep.calls if not c.valid]
    junk = {k: ep.flags[k] for k in ("junk", "dangling") if ep.flags.get(k)}
    if junk:
        return RuleResult(0.0, {"errors": errors, "flags": junk})
    n = len(ep.calls)
    return RuleResult((n - len(errors)) / n if n else 1.0, {"errors": errors})


# Name -> rule: the one place that says which rules exist (and their order).
RULE_FUNCTIONS: dict[str, Callable[[DocInfo, SummaryInfo, RuleConfig], RuleResult]] = {
    "length": rule_length, "entities": rule_entities, "numbers": rule_numbers, "repetition": rule_repetition,
    "profanity": rule_profanity, "tool_format": rule_tool_format,
}
assert tuple(RULE_FUNCTIONS) == RULES


def _rules(doc: DocInfo, s: SummaryInfo, cfg: RuleConfig) -> dict[str, RuleResult]:
    if s.n_words == 0:  # nothing was said: malformed, every rule 0
        return {name: RuleResult(0.0, {"malformed": "no words"}) for name in RULE_FUNCTIONS}
    out = {}
    for name, fn in RULE_FUNCTIONS.items():
        try:
            r = fn(doc, s, cfg)
            out[name] = RuleResult(min(1.0, max(0.0, float(r.score))), r.evidence)
        except Exception as e:  # a rule is total: a bug scores 0 and says so (the tests require none)
            out[name] = RuleResult(0.0, {"error": f"{type(e).__name__}: {e}"})
    return out


def rule_details(document: Any, summary: Any, cfg: RewardConfig | None = None) -> dict[str, RuleResult]:
    """Every rule's (score, evidence) for a summary (str or sandbox.Episode)."""
    cfg = cfg or _DEFAULT_CFG
    return _rules(document_info(document, cfg), summary_info(summary, cfg), cfg.rules)


def rule_scores(document: Any, summary: Any, cfg: RewardConfig | None = None) -> dict[str, float]:
    """Every rule's score in [0, 1] (DESIGN.md section 9)."""
    return {k: r.score for k, r in rule_details(document, summary, cfg).items()}


def rules_mean(scores: dict[str, float], cfg: RuleConfig) -> float:
    total = sum(cfg.weights.values())
    return sum(cfg.weights[k] * scores[k] for k in RULES) / total


def rules_pass(scores: dict[str, float], cfg: RuleConfig) -> dict[str, bool]:
    return {k: scores[k] >= cfg.pass_at[k] - 1e-9 for k in RULES}


# ---------------------------------------------------------------------------
# Lexical factuality (a model-free approximation of FENICE)
# ---------------------------------------------------------------------------
# Claims are the summary's sentences, each read clause by clause (a summary
# sentence often fuses two document sentences at a clause boundary: "Acme's
# revenue rose 12%, said chief executive Jane Doe"). A clause's support by a
# premise (a document sentence, or a window of `window_sentences`) is the share
# of its content words the premise holds, times `intrinsic_factor` for each of
# its numbers and names that the document states elsewhere but not in this
# premise (a swap: "Globex reported revenue of $4.2 billion" when $4.2 billion
# was Acme's), times `negation_factor` when exactly one of the two is negated.
# A clause scores its best premise; a claim the mean of its clauses (weighted
# by what each states), times `extrinsic_factor` for each number or name found
# nowhere in the document. F is the mean over claims that state anything; a
# summary that states nothing scores 0 (it must not out-score one that does).
# Known blind spots: a swap split across clauses ("Globex, the rival, made
# $4.2 billion") and paraphrase (no synonyms: "rose" does not support "grew").


def _part_support(doc: DocInfo, part: Part, tol: float, lex: LexicalConfig) -> tuple[float, int, list[str]]:
    """(best support, its premise, the clause's extrinsic mentions). Sparse: only
    premises that share a word or a mention with the clause are visited."""
    n_premises = len(doc.premise_spans)
    extrinsic, items = [], []  # items: premises supporting each number/name the document states
    for n in part.nums:
        sents = _num_sentences(doc, n, tol)
        if sents:
            items.append(_premises_of(doc, ("num", n.kind, n.value, n.unit, n.currency, tol), sents))
        else:
            extrinsic.append(n.text)
    for name in part.names:
        sents = _name_sentences(doc, name.tokens)
        if sents:
            items.append(_premises_of(doc, ("name", name.tokens), sents))
        elif not name.weak:
            extrinsic.append(" ".join(name.tokens))
    if n_premises == 0:
        return 0.0, -1, extrinsic
    hits = collections.Counter()
    for w in part.content:
        hits.update(doc.word_premises.get(w, ()))
    negated = any(w in NEGATIONS for w in part.content)
    n_words = len(part.content)
    k = len(items)

    def support(p: int) -> float:
        recall = hits[p] / n_words if n_words else 1.0
        held = sum(p in it for it in items)
        neg = lex.negation_factor if doc.premise_negated[p] != negated else 1.0
        return recall * lex.intrinsic_factor ** (k - held) * neg

    # With content words, a premise sharing none has recall 0: only those that
    # share one can be best. Without, every premise has recall 1.
    candidates = set(hits) if n_words else set().union(*items)
    best, best_p = -1.0, -1
    for p in sorted(candidates):
        sc = support(p)
        if sc > best:
            best, best_p = sc, p
    if not n_words:
        # Without content words every premise has recall 1, so one holding none
        # of the mentions may still be the best.
        others = [p for p in range(n_premises) if p not in candidates]
        if others:
            p = next((q for q in others if doc.premise_negated[q] == negated), others[0])
            if support(p) > best:
                best, best_p = support(p), p
    if best_p < 0:
        best, best_p = 0.0, 0
    return best, best_p, extrinsic


def _claim_support(doc: DocInfo, c: Claim, cfg: RewardConfig) -> dict:
    tol, lex = cfg.rules.number_rel_tolerance, cfg.lexical
    spans = doc.premise_spans
    total = weight = 0.0
    extrinsic, premises = [], []
    for part in c.clauses:
        sc, best, ext = _part_support(doc, part, tol, lex)
        w = len(part.content) + len(part.names) + len(part.nums)
        total, weight = total + w * sc, weight + w
        extrinsic += ext
        if best >= 0:
            a, b = spans[best]
            premises.append(" ".join(doc.sentences[a:b]))
    score = (total / weight if weight else 0.0) * lex.extrinsic_factor ** len(extrinsic)
    return {"claim": c.text, "score": score, "extrinsic": extrinsic, "premises": list(dict.fromkeys(premises))}


def lexical_details(doc: DocInfo, s: SummaryInfo, cfg: RewardConfig) -> tuple[float, list[dict]]:
    """(F, one detail per summary sentence). A sentence without a content word,
    name or number states nothing the document could support: it scores 0 and
    counts in the mean (left out, "The. The. The." scored 0.9 and an RL policy
    learnt to write it)."""
    cap = max(0, cfg.lexical.max_claims)
    details = []
    for i, c in enumerate(s.claims):
        if i >= cap:
            details.append({"claim": c.text, "score": 0.0, "extrinsic": [], "premises": [], "skipped": "past max_claims"})
        elif not c.clauses:
            details.append({"claim": c.text, "score": 0.0, "extrinsic": [], "premises": [], "skipped": "no content"})
        else:
            details.append(_claim_support(doc, c, cfg))
    if not details:
        return 0.0, []
    return float(np.mean([d["score"] for d in details])), details


def lexical_factuality(document: Any, summary: Any, cfg: RewardConfig | None = None) -> float:
    """The lexical factuality score in [0, 1] (DESIGN.md section 9): a model-free
    approximation, reported as "lexical (model-free approximation)"."""
    cfg = cfg or _DEFAULT_CFG
    return lexical_details(document_info(document, cfg), summary_info(summary, cfg), cfg)[0]



# ---------------------------------------------------------------------------
# Support factuality (model-free, for real text)
# ---------------------------------------------------------------------------
# Measured on FRANK's human labels (bench/factuality.py), what separates a
# faithful system summary from one with an error is mostly whether its words
# are in the document at all, not which single sentence holds them: summaries
# of real news fuse several sentences, and the best-premise alignment the
# lexical scorer uses (built for the news world's swaps) loses to a plain
# word-overlap baseline there. So a summary sentence scores
#     share of its content words whose stem the document holds
#   x (share of adjacent content-word pairs that co-occur within `window`
#      document sentences) ** pair_exponent
# (the pairs catch a right word bound to the wrong thing: "the 39-year-old was
# sacked" when the document sacked someone else), and F is the minimum over
# sentences (one wrong sentence makes the summary wrong). Case is ignored, so
# lower-cased system output scores like cased text, and sentence boundaries
# the splitter would miss in it are repaired first. Numbers are words here:
# "4.2" must appear as written ("4.2 billion" vs "4,200 million" does not meet).

_SUPPORT_TOKEN_RE = re.compile(r"[^\W_]+(?:['’.,][^\W_]+)*")
# Irregular forms the suffix stripper cannot join ("said" / "says").
_IRREGULAR = {
    "said": "say", "says": "say", "won": "win", "wins": "win", "lost": "lose", "loses": "lose", "made": "make",
    "took": "take", "taken": "take", "gave": "give", "given": "give", "went": "go", "gone": "go", "came": "come",
    "found": "find", "told": "tell", "left": "leave", "held": "hold", "paid": "pay", "met": "meet",
    "became": "become", "began": "begin", "begun": "begin", "brought": "bring", "bought": "buy",
    "thought": "think", "sold": "sell", "spent": "spend", "led": "lead", "fell": "fall", "fallen": "fall",
    "rose": "rise", "risen": "rise", "ran": "run", "saw": "see", "seen": "see", "got": "get", "kept": "keep",
    "knew": "know", "known": "know", "felt": "feel", "built": "build", "struck": "strike", "shot": "shoot",
    "men": "man", "women": "woman", "children": "child", "people": "person"}


@functools.lru_cache(maxsize=1 << 16)
def _support_word(tok: str) -> str | None:
    t = tok.lower().replace("’", "'")
    if t.endswith("'s"):
        t = t[:-2]
    if t in STOPWORDS:
        return None
    return _stem(_IRREGULAR.get(t, t))


def _support_words(sentence: str) -> list[str]:
    return [w for w in map(_support_word, _SUPPORT_TOKEN_RE.findall(sentence)) if w]


# Sentence boundaries the splitter would miss, repaired before splitting (measured on
# FRANK's dev half: without it the worst-sentence minimum did nothing on CNN/DM, whose
# system summaries are lower-cased, and XSum articles read as one long sentence):
# a sentence end glued to the next sentence ("community.Dr Venter") in a document,
_GLUED = re.compile(r"([a-z0-9][.!?][\"'”’)]?)([A-Z])")
# and in a summary none of whose sentences starts upper-case, lower-case sentence starts.
_LOWER_START = re.compile(r"([.!?][\"'”’)]*\s+)([a-z])")
_UPPER_START = re.compile(r"[.!?][\"'”’)]*\s+[A-Z]")


def repair_document(text: str) -> str:
    """`text` with a space between sentences glued together."""
    return _GLUED.sub(r"\1 \2", text)


def repair_summary(summary: str) -> str:
    """A summary with no sentence starting upper-case (lower-cased system output)
    gets its sentence starts capitalised, so the splitter sees them; others stay
    as they are. Support ignores case, so only the sentence boundaries change."""
    if _UPPER_START.search(summary):
        return summary
    return _LOWER_START.sub(lambda m: m.group(1) + m.group(2).upper(), summary)


_SUPPORT_DOCS = LRU(512)


def support_document(document: Any) -> dict[str, frozenset]:
    """Content stem -> the document sentences holding it (cached per text)."""
    text = _text_of(document)
    key = text_key(text)
    post = _SUPPORT_DOCS.get(key)
    if post is None:
        acc = collections.defaultdict(set)
        for i, sent in enumerate(sandbox.split_sentences(repair_document(text))):
            for w in _support_words(sent):
                acc[w].add(i)
        post = {w: frozenset(v) for w, v in acc.items()}
        _SUPPORT_DOCS.put(key, post)
    return post


def _near(a: frozenset, b: frozenset, window: int) -> bool:
    if a & b:
        return True
    return window > 0 and any(i + d in b for i in a for d in range(-window, window + 1) if d)


def support_details(document: Any, summary: Any, cfg: SupportConfig | None = None) -> tuple[float, list[dict]]:
    """(F, one detail per summary sentence: its score, word share, pair share and
    the words the document lacks). A sentence with no content word scores 0, as
    does a summary with none."""
    cfg = cfg or SupportConfig()
    post = support_document(document)
    details = []
    for sent in sandbox.split_sentences(repair_summary(_text_of(summary))):
        found = [(w, tok) for tok in _SUPPORT_TOKEN_RE.findall(sent) if (w := _support_word(tok))]
        words = [w for w, _ in found]
        if not words:
            details.append({"claim": sent, "score": 0.0, "words": 0.0, "pairs": 0.0, "unsupported": [],
                            "skipped": "no content"})
            continue
        held = [post.get(w) for w in words]
        word_share = sum(h is not None for h in held) / len(words)
        pairs = list(zip(held, held[1:]))
        pair_share = (sum(a is not None and b is not None and _near(a, b, cfg.window) for a, b in pairs)
                      / len(pairs)) if pairs else word_share
        details.append({"claim": sent, "score": word_share * pair_share ** cfg.pair_exponent,
                        "words": word_share, "pairs": pair_share,
                        "unsupported": [tok.lower() for (_, tok), h in zip(found, held) if h is None]})
    if not details:
        return 0.0, []
    scores = [d["score"] for d in details]
    return float(min(scores) if cfg.reduce == "min" else sum(scores) / len(scores)), details


def support_factuality(document: Any, summary: Any, cfg: SupportConfig | None = None) -> float:
    """The support factuality score in [0, 1]: model-free, reported as SUPPORT_NAME."""
    return support_details(document, summary, cfg)[0]


# ---------------------------------------------------------------------------
# FENICE
# ---------------------------------------------------------------------------
# The reference (github.com/Babelscape/FENICE, metric/FENICE.py) per summary:
# claims = the extractor's output split into sentences, de-duplicated; for each
# claim, NLI against every document sentence, every sliding 5-sentence chunk
# (stride 1) and the whole document, the last two only when the document has
# more than one chunk; the claim's score is its best alignment over all of
# them; the summary's score the mean over claims.
#
# The contrast. The reference code scores a pair P(entail) - P(neutral); the
# paper describes P(entail) - P(contradict). We default to the code's: (1) the
# released metric's published numbers come from it, so ours stay comparable;
# (2) under a max over premises, P(entail) - P(contradict) lets any premise the
# claim has nothing to do with (neutral: 0) hide both a contradiction and an
# invented fact, so every non-entailed claim lands near 0.5 after rescaling and
# an invented claim would pass the curriculum's first tau (0.50). With the
# code's contrast an unsupported claim scores near 0. Its known flaw: a
# contradicted claim (0) scores above an unsupported one (-1); both stay far
# below an entailed one. `fenice.contrast` selects the paper's instead. Either
# contrast lies in [-1, 1] and is rescaled by (x + 1) / 2 to [0, 1].

CONTRASTS = ("entail_minus_neutral", "entail_minus_contradict")
_PRONOUNS = frozenset(
    "i me my mine myself you your yours yourself he him his himself she her hers herself it its itself we us "
    "our ours ourselves they them their theirs themselves this that these those who whom whose which what "
    "one ones someone somebody everyone everybody".split())


def alignment_scores(probs: np.ndarray, contrast: str) -> np.ndarray:
    """(N, 3) [entail, neutral, contradict] probabilities -> (N,) alignments in [0, 1]."""
    probs = np.asarray(probs, dtype=np.float64).reshape(-1, 3)
    other = probs[:, 1] if contrast == "entail_minus_neutral" else probs[:, 2]
    return np.clip((probs[:, 0] - other + 1.0) / 2.0, 0.0, 1.0)


def chunk_premises(sentences: Sequence[str], size: int, stride: int) -> list[str]:
    """Sliding windows of `size` sentences, `stride` apart; fewer sentences: one chunk of all."""
    if not sentences:
        return []
    if len(sentences) < size:
        return [" ".join(sentences)]
    return [" ".join(sentences[i:i + size]) for i in range(0, len(sentences) - size + 1, max(1, stride))]


@dataclass
class _FeniceDoc:
    text: str
    spans: list[tuple[int, int]]
    sentences: list[str]
    chunks: list[str]
    alignments: LRU  # claim -> (score, level, premise index)
    clusters: list | None = None  # coreference clusters (character spans), when used

    @property
    def wide(self) -> bool:
        """Chunk and document premises are used only past one chunk (as the reference does)."""
        return len(self.chunks) > 1


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def _label_columns(id2label: dict) -> list[int]:
    """Model output columns of [entailment, neutral, contradiction], read from the
    model's config (label orders differ between NLI checkpoints)."""
    labels = {int(i): str(lab).lower() for i, lab in id2label.items()}
    cols = []
    for want in ("entail", "neutral", "contradict"):
        hit = [i for i, lab in labels.items() if lab.startswith(want)]
        if len(hit) != 1:
            raise ValueError(f"NLI model labels {sorted(labels.values())} do not name entailment, "
                             "neutral and contradiction once each")
        cols.append(hit[0])
    return cols


def _pair_limit(model, tokenizer, wanted: int) -> int:
    """A pair-length limit the model can take: absolute position embeddings cap it;
    relative ones (DeBERTa-v3) do not, which is how the reference reads whole
    documents at 4,096 tokens."""
    c = model.config
    absolute = getattr(c, "position_biased_input", True) and \
        getattr(c, "position_embedding_type", "absolute") == "absolute"
    if not absolute:
        return wanted
    limit = getattr(c, "max_position_embeddings", None) or wanted
    if getattr(c, "model_type", "") in ("roberta", "xlm-roberta", "camembert"):
        limit -= 2  # positions start after the padding index
    return min(wanted, limit)


class Fenice:
    """FENICE, loaded once and fast inside an RL loop.

    Unlike the reference, which loads both models on every `score_batch` call and
    keys its caches by batch position (so nothing is shared between calls), this
    keeps the models, batches claim extraction over the unique summaries of a
    call and NLI over all their (premise, claim) pairs, and caches by content:
    per document (LRU, `cache_documents`) its sentences, chunks and every claim
    alignment computed against it; per summary text its claims (LRU). The G
    rollouts of one document share the document side and any claim they have
    in common.

    NLI cross-encoders read premise and claim together, so no premise encoding
    can be reused across claims; what is reused is everything document-side
    that does not involve the claim.

    `nli_fn(pairs) -> (N, 3)` [entail, neutral, contradict] probabilities,
    `claim_fn(summaries) -> list of generated claim texts` and `coref_fn(text)
    -> clusters` replace the models (tests, other backends).
    """

    def __init__(self, cfg: FeniceConfig | None = None, nli_fn: Callable | None = None,
                 claim_fn: Callable | None = None, coref_fn: Callable | None = None):
        self.cfg = cfg or FeniceConfig()
        if self.cfg.contrast not in CONTRASTS:
            raise ValueError(f"fenice.contrast must be one of {CONTRASTS}, got {self.cfg.contrast!r}")
        self._nli_fn, self._claim_fn, self._coref_fn = nli_fn, claim_fn, coref_fn
        self._hf_nli: Callable | None = None  # (pairs, max_tokens, batch_size) -> probs, when no nli_fn
        self.docs = LRU(self.cfg.cache_documents)
        self.claims = LRU(self.cfg.cache_claims)
        self.stats: collections.Counter = collections.Counter()  # pairs, summaries extracted, cache hits

    def clear_caches(self) -> None:
        self.docs.clear()
        self.claims.clear()

    # -- models (loaded on first use) --------------------------------------

    def _load_nli(self):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = _device(self.cfg.device)
        dtype = torch.float32
        if device.startswith("cuda") and self.cfg.half_precision:
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        tok = AutoTokenizer.from_pretrained(self.cfg.nli_model)
        model = AutoModelForSequenceClassification.from_pretrained(self.cfg.nli_model, dtype=dtype)
        model.to(device).eval()
        cols = _label_columns(model.config.id2label)
        limits = {self.cfg.nli_max_tokens: _pair_limit(model, tok, self.cfg.nli_max_tokens),
                  self.cfg.doc_max_tokens: _pair_limit(model, tok, self.cfg.doc_max_tokens)}

        def nli(pairs, max_tokens, batch_size):
            out = np.zeros((len(pairs), 3))
            # Longest first: similar lengths share a batch (little padding), and an
            # out-of-memory batch fails at once rather than at the end.
            order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
            limit = limits.get(max_tokens, max_tokens)
            for k in range(0, len(order), batch_size):
                idx = order[k:k + batch_size]
                prem, hyp = [pairs[i][0] for i in idx], [pairs[i][1] for i in idx]
                # The premise is truncated, never the claim: a cut claim is another
                # claim. (The reference truncates the longer of the two.)
                try:
                    enc = tok(prem, hyp, padding=True, truncation="only_first", max_length=limit,
                              return_tensors="pt")
                except Exception:  # a claim longer than the limit on its own
                    enc = tok(prem, hyp, padding=True, truncation="longest_first", max_length=limit,
                              return_tensors="pt")
                enc = {k2: v.to(device) for k2, v in enc.items()}
                with torch.inference_mode():
                    logits = model(**enc).logits.float()
                out[idx] = torch.softmax(logits, dim=-1)[:, cols].cpu().numpy()
            return out

        return nli

    def _load_extractor(self):
        import torch
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        device = _device(self.cfg.device)
        dtype = torch.float32
        # T5 overflows in fp16; it runs in bf16 where the GPU has it, else fp32.
        if device.startswith("cuda") and self.cfg.half_precision and torch.cuda.is_bf16_supported():
            dtype = torch.bfloat16
        tok = AutoTokenizer.from_pretrained(self.cfg.claim_model)
        model = AutoModelForSeq2SeqLM.from_pretrained(self.cfg.claim_model, dtype=dtype)
        model.to(device).eval()

        def extract(summaries):
            out = []
            for k in range(0, len(summaries), self.cfg.claim_batch_size):
                batch = list(summaries[k:k + self.cfg.claim_batch_size])
                enc = tok(batch, padding=True, truncation=True, max_length=512, return_tensors="pt").to(device)
                with torch.inference_mode():
                    # Greedy (no sampling): a reward must not be random.
                    gen = model.generate(**enc, max_new_tokens=self.cfg.claim_max_new_tokens, do_sample=False)
                out += tok.batch_decode(gen, skip_special_tokens=True)
            return out

        return extract

    def _load_coref(self):
        try:
            from fastcoref import FCoref
        except ImportError:
            raise ImportError("fenice.use_coref=true needs fastcoref: pip install fastcoref") from None
        model = FCoref(device=_device(self.cfg.device), enable_progress_bar=False)
        return lambda text: model.predict(texts=[text])[0].get_clusters(as_strings=False)

    def nli(self, pairs: list[tuple[str, str]], max_tokens: int, batch_size: int) -> np.ndarray:
        if not pairs:
            return np.zeros((0, 3))
        self.stats["nli_pairs"] += len(pairs)
        if self._nli_fn is not None:
            return np.asarray(self._nli_fn(pairs), dtype=np.float64).reshape(-1, 3)
        if self._hf_nli is None:
            self._hf_nli = self._load_nli()
        return np.asarray(self._hf_nli(pairs, max_tokens, batch_size), dtype=np.float64).reshape(-1, 3)

    # -- document and summary sides ------------------------------------------

    def _doc(self, text: str) -> _FeniceDoc:
        key = text_key(text)
        doc = self.docs.get(key)
        if doc is None:
            # Deviation: sentences come from sandbox.split_sentences (the splitter
            # the search tool uses) rather than spaCy's; the chunks follow.
            spans = sandbox.sentence_spans(text)
            sents = [text[a:b] for a, b in spans]
            doc = _FeniceDoc(text, spans, sents, chunk_premises(sents, self.cfg.chunk_sentences,
                                                                  self.cfg.chunk_stride),
                             LRU(self.cfg.cache_alignments_per_doc))
            self.docs.put(key, doc)
        else:
            self.stats["doc_hits"] += 1
        return doc

    def claims_of(self, summaries: Sequence[str]) -> list[list[str]]:
        """Claims per summary: the extractor's output split into sentences and
        de-duplicated, as in the reference. Deviations: a summary for which the
        extractor yields nothing is scored on its own sentences (the reference
        falls back to the whole summary only for a cache miss, and gives NaN for
        an empty claim list); a summary with no words has no claims."""
        out: dict[str, list[str]] = {}
        todo = []
        for s in dict.fromkeys(summaries):
            cached = self.claims.get(s)
            if cached is not None:
                out[s] = cached
                self.stats["claim_hits"] += 1
            elif not sandbox.words(s):
                out[s] = []
            else:
                todo.append(s)
        if todo:
            if self._claim_fn is None:
                self._claim_fn = self._load_extractor()
            self.stats["summaries_extracted"] += len(todo)
            for s, generated in zip(todo, self._claim_fn(todo)):
                claims = list(dict.fromkeys(c.strip() for c in sandbox.split_sentences(generated or "")
                                            if sandbox.words(c)))
                out[s] = claims or [c for c in sandbox.split_sentences(s) if sandbox.words(c)]
                self.claims.put(s, out[s])
        return [out[s] for s in summaries]

    # -- alignment ---------------------------------------------------------

    def _coref_variants(self, doc: _FeniceDoc, i: int) -> list[str]:
        """Versions of sentence i with a mention replaced by another, non-pronoun
        mention of its coreference cluster ("She said ..." -> "Jane Doe said ...")."""
        if doc.clusters is None:
            if self._coref_fn is None:
                self._coref_fn = self._load_coref()
            doc.clusters = [list(map(tuple, c)) for c in self._coref_fn(doc.text)]
        a, b = doc.spans[i]
        sentence = doc.text[a:b]
        out = set()
        for cluster in doc.clusters:
            inside = [(x, y) for x, y in cluster if a <= x and y <= b]
            if not inside:
                continue
            here = {doc.text[x:y] for x, y in inside}
            others = {doc.text[x:y] for x, y in cluster} - here
            others = {o for o in others if o.lower() not in _PRONOUNS}
            for x, y in inside:
                for o in sorted(others):
                    out.add(sentence[:x - a] + o + sentence[y - a:])
        return sorted(out)

    def _align(self, pending: list[tuple[_FeniceDoc, str]]) -> list[tuple[float, str, int]]:
        """Best (score, level, premise index) of each (document, claim)."""
        cfg = self.cfg
        pairs, owners, dpairs, downers = [], [], [], []
        for k, (doc, claim) in enumerate(pending):
            for i, s in enumerate(doc.sentences):
                pairs.append((s, claim))
                owners.append((k, "sentence", i))
            if doc.wide and cfg.chunk_level:
                for i, c in enumerate(doc.chunks):
                    pairs.append((c, claim))
                    owners.append((k, "chunk", i))
            if doc.wide and cfg.doc_level:
                dpairs.append((doc.text, claim))
                downers.append((k, "document", 0))
        best: list[tuple[float, str, int]] = [(0.0, "none", -1)] * len(pending)
        best_sentence = [(-1.0, -1)] * len(pending)
        for ps, os_, limit, bs in ((pairs, owners, cfg.nli_max_tokens, cfg.nli_batch_size),
                                   (dpairs, downers, cfg.doc_max_tokens, cfg.doc_batch_size)):
            scores = alignment_scores(self.nli(ps, limit, bs), cfg.contrast)
            for (k, level, i), sc in zip(os_, scores):
                if sc > best[k][0] or best[k][2] < 0:
                    best[k] = (float(sc), level, i)
                if level == "sentence" and sc > best_sentence[k][0]:
                    best_sentence[k] = (float(sc), i)
        if cfg.use_coref:
            cpairs, cowners = [], []
            for k, (doc, claim) in enumerate(pending):
                if best_sentence[k][1] >= 0:
                    for j, v in enumerate(self._coref_variants(doc, best_sentence[k][1])):
                        cpairs.append((v, claim))
                        cowners.append((k, v))
            scores = alignment_scores(self.nli(cpairs, cfg.nli_max_tokens, cfg.nli_batch_size), cfg.contrast)
            for (k, v), sc in zip(cowners, scores):
                if sc > best[k][0]:
                    best[k] = (float(sc), "coref:" + v, best_sentence[k][1])
        return best

    def score_batch(self, pairs: Sequence[tuple[str, str]]) -> list[dict]:
        """[(document text, summary text)] -> [{"score", "claims": [{claim, score, level, premise}]}]."""
        docs = [self._doc(d) for d, _ in pairs]
        claims = self.claims_of([s for _, s in pairs])
        todo: dict[tuple[int, str], tuple[_FeniceDoc, str]] = {}
        for doc, cl in zip(docs, claims):
            for c in cl:
                if c in doc.alignments:
                    self.stats["alignment_hits"] += 1
                else:
                    todo.setdefault((id(doc), c), (doc, c))
        fresh = dict(zip(todo, self._align(list(todo.values()))))
        for (_, c), (doc, _) in zip(fresh, todo.values()):
            doc.alignments.put(c, fresh[(id(doc), c)])
        out = []
        for doc, cl in zip(docs, claims):
            rows = []
            for c in cl:
                sc, level, i = fresh.get((id(doc), c)) or doc.alignments.get(c)
                if level.startswith("coref:"):
                    premise, level = level[len("coref:"):], "coref"
                else:
                    premise = {"sentence": doc.sentences, "chunk": doc.chunks}.get(level, [doc.text])[i] \
                        if i >= 0 else ""
                rows.append({"claim": c, "score": sc, "level": level, "premise": premise})
            # No claims (no words): 0, defined, never NaN; nothing was stated.
            score = float(np.mean([r["score"] for r in rows])) if rows else 0.0
            out.append({"score": score, "claims": rows})
        return out


_TINY_CORPUS = (
    "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier. "
    "Chief executive Jane K. Doe said the U.S. market drove growth. Shares fell 3.5% in New York. "
    "Rival Globex reported revenue of $3.1 billion. The company employs 3,400 people in 12 countries. "
    "The council approved a plan for a new rail line. The court ruled against the firm in a patent case.")


def build_tiny_fenice(out_dir: str, nli_arch: Literal["deberta-v2", "bert"] = "deberta-v2",
                      id2label: dict[int, str] | None = None, seed: int = 0,
                      texts: Sequence[str] = (), vocab_size: int = 4000) -> FeniceConfig:
    """Save a randomly initialised claim extractor (T5) and NLI classifier, with
    byte-level BPE tokenizers trained on `texts`, under `out_dir`, and return a
    FeniceConfig that uses them on the CPU. For tests and benchmarks: it runs
    the real loading, batching and caching code without a network; its scores
    mean nothing. `id2label` defaults to a non-standard order, so a caller that
    assumes one is caught. Trained on a few documents, the default vocabulary
    cuts news text into ~1.3 tokens a word, as the real models' vocabularies
    do, so sequence lengths (and what batching can save) are realistic."""
    import os

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import (BertConfig, BertForSequenceClassification, DebertaV2Config,
                              DebertaV2ForSequenceClassification, PreTrainedTokenizerFast, T5Config,
                              T5ForConditionalGeneration)

    def bpe(specials: list[str], template: Callable) -> Tokenizer:
        tok = Tokenizer(models.BPE(unk_token=specials[-1]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator([_TINY_CORPUS, *texts] * 4, trainer)
        tok.post_processor = template(tok)
        return tok

    torch.manual_seed(seed)
    claims_dir, nli_dir = os.path.join(out_dir, "claims"), os.path.join(out_dir, "nli")
    t5tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe(["<pad>", "</s>", "<unk>"], lambda t: processors.TemplateProcessing(
            single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)])),
        pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    t5 = T5ForConditionalGeneration(T5Config(
        vocab_size=len(t5tok), d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    t5.save_pretrained(claims_dir)
    t5tok.save_pretrained(claims_dir)
    nlitok = PreTrainedTokenizerFast(
        tokenizer_object=bpe(["[PAD]", "[CLS]", "[SEP]", "[UNK]"], lambda t: processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 1), ("[SEP]", 2)])),
        pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", unk_token="[UNK]")
    id2label = id2label or {0: "CONTRADICTION", 1: "ENTAILMENT", 2: "NEUTRAL"}
    common = dict(vocab_size=len(nlitok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, num_labels=len(id2label), id2label=id2label,
                  label2id={v: k for k, v in id2label.items()}, pad_token_id=0)
    if nli_arch == "bert":
        nli = BertForSequenceClassification(BertConfig(max_position_embeddings=128, **common))
    else:  # the reference NLI model's family: relative positions, any length
        nli = DebertaV2ForSequenceClassification(DebertaV2Config(
            relative_attention=True, position_biased_input=False, pos_att_type=["p2c", "c2p"],
            max_relative_positions=64, type_vocab_size=0, **common))
    nli.save_pretrained(nli_dir)
    nlitok.save_pretrained(nli_dir)
    return FeniceConfig(claim_model=claims_dir, nli_model=nli_dir, device="cpu", claim_max_new_tokens=16,
                        nli_max_tokens=256, doc_max_tokens=1024)


# ---------------------------------------------------------------------------
# Tool terms: budget, caps, ToolMatch (the v19 reward)
# ---------------------------------------------------------------------------


def tool_terms(episode: Any, cfg: ToolTermsConfig) -> tuple[float, float]:
    """(budget, cap_penalty), both subtracted from the reward; 0 for a bare summary."""
    if not isinstance(episode, sandbox.Episode):
        return 0.0, 0.0
    budget = cfg.budget_per_call * (episode.n_search + episode.n_delete)
    cap = cfg.delete_cap_penalty * bool(episode.flags.get("delete_cap")) + \
        cfg.tool_cap_penalty * bool(episode.flags.get("tool_cap"))
    return budget, cap


_ESCAPE_RE = re.compile(r"\\[A-Za-z]")


def _query_words(query: str | None) -> frozenset:
    if not query:
        return frozenset()
    mode, q, _ = sandbox.parse_query(query)
    if mode == "regex":
        q = _ESCAPE_RE.sub(" ", q)  # \d, \b, \s are syntax, not words
    return frozenset(sandbox.words(q))


def _jaccard(a: frozenset | set, b: frozenset | set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


@functools.lru_cache(maxsize=1024)
def _unsupported(document: str, retracted: str) -> float:
    """How unsupported by `document` a retracted text is, 1 - the lower of the lexical and
    support scores; 0 for words that state nothing. Cached: ToolMatch's alignment grades
    each policy delete against every teacher delete."""
    if not _support_words(retracted):
        return 0.0
    return 1.0 - min(lexical_factuality(document, retracted), support_factuality(document, retracted))


def call_agreement(call: sandbox.Call, teacher: sandbox.Call, kind_weight: float = 0.5,
                   document: str | None = None) -> float:
    """Agreement of one policy call with one teacher call, in [0, 1]: `kind_weight`
    for the same tool, the rest for what it did. Searches: overlap of query words,
    or of the sentences returned when that is higher (two queries that find the
    same evidence agree). Deletes: how unsupported by `document` the retracted
    text was (1 - the lower of the lexical and support scores), not its overlap
    with what the teacher retracted: grading by overlap paid the policy most for
    first writing the teacher's wrong sentence. Without a document, the overlap."""
    if call.kind != teacher.kind or not call.valid:
        return 0.0
    if call.kind == "search":
        overlap = _jaccard(_query_words(call.arg), _query_words(teacher.arg))
        if call.hits and teacher.hits:
            overlap = max(overlap, _jaccard(set(call.hits), set(teacher.hits)))
    elif document is not None:
        overlap = _unsupported(document, call.deleted or "")
    else:
        a, b = frozenset(sandbox.words(call.deleted or "")), frozenset(sandbox.words(teacher.deleted or ""))
        overlap = _jaccard(a, b) if a or b else float(call.arg == teacher.arg)
    return kind_weight + (1.0 - kind_weight) * overlap


def tool_match(episode: sandbox.Episode, teacher_episode: sandbox.Episode,
               cfg: ToolTermsConfig | None = None) -> tuple[float, list[float]]:
    """ToolMatch: per-step agreement of the policy's tool calls with a teacher
    episode for the same document (`call_agreement`: a delete is graded by how
    unsupported what it retracted was). Calls are aligned in order (a monotone
    alignment maximising total agreement, so one extra or missing call does not
    shift every later step). Returns (score, per_step): per_step[i] is the
    agreement of `episode.calls[i]` with its aligned teacher call (0 if none),
    for turn-level credit; score = sum(per_step) / max(#policy calls, #teacher
    calls), and 1.0 when neither calls a tool."""
    kw = (cfg or ToolTermsConfig()).match_kind_weight
    mine = episode.calls if isinstance(episode, sandbox.Episode) else []
    theirs = teacher_episode.calls if isinstance(teacher_episode, sandbox.Episode) else []
    m, n = len(mine), len(theirs)
    if m == 0 and n == 0:
        return 1.0, []
    doc = episode.document if isinstance(episode, sandbox.Episode) else None
    sim = [[call_agreement(a, b, kw, doc) for b in theirs] for a in mine]
    dp = np.zeros((m + 1, n + 1))
    for i in range(1, m + 1):
        for j in range(1, n + 1):
            dp[i, j] = max(dp[i - 1, j], dp[i, j - 1], dp[i - 1, j - 1] + sim[i - 1][j - 1])
    per_step = [0.0] * m
    i, j = m, n
    while i > 0 and j > 0:
        if sim[i - 1][j - 1] > 0 and dp[i, j] == dp[i - 1, j - 1] + sim[i - 1][j - 1]:
            per_step[i - 1] = sim[i - 1][j - 1]
            i, j = i - 1, j - 1
        elif dp[i, j] == dp[i - 1, j]:
            i -= 1
        else:
            j -= 1
    return float(sum(per_step) / max(m, n)), per_step


# ---------------------------------------------------------------------------
# Curriculum of the factuality threshold tau
# ---------------------------------------------------------------------------


class Curriculum:
    """tau = taus[stage]; the stage advances once the running pass rate over the
    last `window_samples` scored rollouts exceeds `raise_pass_rate` (the window
    must be full, and is emptied on a raise: the rate under the new tau is
    measured afresh). It never goes back. Its state goes into checkpoints."""

    def __init__(self, cfg: CurriculumConfig | None = None):
        self.cfg = cfg or CurriculumConfig()
        self.stage = 0
        self.window: collections.deque = collections.deque(maxlen=max(1, self.cfg.window_samples))
        self.raises: list[dict] = []  # when each raise happened
        self.seen = 0  # rollouts counted so far

    @property
    def tau(self) -> float:
        return float(self.cfg.taus[self.stage])

    @property
    def pass_rate(self) -> float | None:
        return float(np.mean(self.window)) if self.window else None

    def update(self, passes: float | Iterable[bool], n: int = 1) -> bool:
        """Count a batch of pass flags, or a pass rate over `n` rollouts. True if tau rose."""
        if isinstance(passes, (bool, np.bool_)):
            values = [float(passes)] * max(0, int(n))
        elif isinstance(passes, (int, float, np.floating, np.integer)):
            values = [min(1.0, max(0.0, float(passes)))] * max(0, int(n))
        else:
            values = [float(bool(p)) for p in passes]
        self.window.extend(values)
        self.seen += len(values)
        if (self.stage + 1 < len(self.cfg.taus) and len(self.window) == self.window.maxlen
                and self.pass_rate > self.cfg.raise_pass_rate):
            self.raises.append({"seen": self.seen, "pass_rate": self.pass_rate,
                                "from": self.tau, "to": float(self.cfg.taus[self.stage + 1])})
            self.stage += 1
            self.window.clear()
            return True
        return False

    def state_dict(self) -> dict:
        return {"stage": self.stage, "window": list(self.window), "raises": list(self.raises),
                "seen": self.seen, "taus": list(self.cfg.taus)}

    def load_state_dict(self, state: dict) -> None:
        if list(state.get("taus", self.cfg.taus)) != list(self.cfg.taus):
            raise ValueError(f"curriculum state was saved with taus {state['taus']}, "
                             f"this config has {self.cfg.taus}")
        self.stage = int(state["stage"])
        self.window.clear()
        self.window.extend(float(x) for x in state["window"])
        self.raises = list(state.get("raises", []))
        self.seen = int(state.get("seen", 0))


# ---------------------------------------------------------------------------
# The combined reward and the batch API
# ---------------------------------------------------------------------------

_FENICE_INSTANCES: dict[tuple, Fenice] = {}


def fenice_for(cfg: FeniceConfig) -> Fenice:
    """One Fenice (models and caches) per model/device setting, shared by every caller."""
    key = tuple(sorted(dataclasses.asdict(cfg).items()))
    if key not in _FENICE_INSTANCES:
        _FENICE_INSTANCES[key] = Fenice(cfg)
    return _FENICE_INSTANCES[key]


def _doc_id(document: Any, episode: Any) -> str | None:
    for v in (getattr(episode, "doc_id", None), getattr(document, "id", None), getattr(document, "doc_id", None)):
        if isinstance(v, str) and v:
            return v
    return None


class Scorer:
    """Holds what outlives one batch: the curriculum (its tau decides "pass") and
    the FENICE models and caches. `score_batch` does not advance the curriculum:
    the trainer calls `scorer.curriculum.update(...)` (eval never does)."""

    def __init__(self, cfg: RewardConfig | None = None, curriculum: Curriculum | None = None,
                 fenice: Fenice | None = None):
        self.cfg = cfg or RewardConfig()
        self.curriculum = curriculum or Curriculum(self.cfg.curriculum)
        self._fenice = fenice

    def fenice(self, cfg: FeniceConfig) -> Fenice:
        if self._fenice is None or self._fenice.cfg != cfg:
            self._fenice = fenice_for(cfg)
        return self._fenice

    def state_dict(self) -> dict:
        return {"curriculum": self.curriculum.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.curriculum.load_state_dict(state["curriculum"])

    def factuality(self, docs: list, summaries: list, infos: list, cfg: RewardConfig) -> list[tuple[float, Any]]:
        if cfg.factuality == "lexical":
            return [lexical_details(d, s, cfg) for d, s in zip(infos, summaries)]
        if cfg.factuality == "support":
            return [support_details(d, s.text, cfg.support) for d, s in zip(docs, summaries)]
        if cfg.factuality == "learned":
            import factcheck  # the learned scorer's features and weights; imported only for this backend

            model = factcheck.load(cfg.learned.path)
            return [(model.score(d, s.text), None) for d, s in zip(docs, summaries)]
        if cfg.factuality == "fenice":
            res = self.fenice(cfg.fenice).score_batch([(_text_of(d), s.text) for d, s in zip(docs, summaries)])
            return [(r["score"], r["claims"]) for r in res]
        if cfg.factuality == "oracle":
            import oracle  # the news world's fact checker; imported only for this backend

            out = []
            for d, s in zip(docs, summaries):
                if not hasattr(d, "facts"):
                    raise ValueError("factuality='oracle' needs data.Document items (with their fact table), "
                                     f"got {type(d).__name__}")
                score = oracle.oracle_fact_precision if cfg.oracle_unit == "fact" else oracle.oracle_fact_score
                out.append((float(score(d, s.text)), oracle.oracle_errors(d, s.text)))
            return out
        raise ValueError(f"unknown factuality backend {cfg.factuality!r} (fenice, lexical, support, learned, oracle)")

    def score_batch(self, items: Iterable[tuple[Any, Any]], cfg: RewardConfig | None = None,
                    teacher: dict | None = None) -> list[dict]:
        cfg = cfg or self.cfg
        items = list(items)
        docs = [d for d, _ in items]
        infos = [document_info(d, cfg) for d in docs]
        summaries = [summary_info(s, cfg) for _, s in items]
        facts = self.factuality(docs, summaries, infos, cfg)
        tau = self.curriculum.tau
        out = []
        for (doc, ep), info, s, (f, claims) in zip(items, infos, summaries, facts):
            f = min(1.0, max(0.0, float(f))) if math.isfinite(f) else 0.0
            rules = _rules(info, s, cfg.rules)
            scores = {k: r.score for k, r in rules.items()}
            passed = rules_pass(scores, cfg.rules)
            rmean = rules_mean(scores, cfg.rules)
            budget, cap = tool_terms(s.episode, cfg.tools)
            match, steps = None, []
            t_ep = teacher.get(_doc_id(doc, ep)) if teacher else None
            if t_ep is not None and s.episode is not None:
                match, steps = tool_match(s.episode, t_ep, cfg.tools)
            ok = f >= tau and all(passed.values())
            g = content_gate(s, scores) if cfg.gate else 1.0
            total = (g * (cfg.w_factuality * f + cfg.w_rules * rmean + cfg.w_pass * ok) - budget - cap
                     + cfg.tools.w_match * (match or 0.0))
            row = {"total": total, "pass": ok, "tau": tau, "gate": g,
                   "factuality": f, "factuality_backend": BACKEND_NAMES[cfg.factuality],
                   "factuality_pass": f >= tau, "rules": rmean, "rules_pass": all(passed.values())}
            for k in RULES:
                row[f"rule_{k}"] = scores[k]
                row[f"rule_{k}_pass"] = passed[k]
            row.update({"budget": budget, "cap_penalty": cap, "tool_match": match, "tool_match_steps": steps,
                        "n_search": s.episode.n_search if s.episode else 0,
                        "n_delete": s.episode.n_delete if s.episode else 0, "n_words": s.n_words,
                        "claims": claims, "evidence": {k: r.evidence for k, r in rules.items()}})
            out.append(row)
        return out


_DEFAULT_CFG = RewardConfig()


def content_gate(s: SummaryInfo, scores: dict[str, float]) -> float:
    """The length score times the repetition score, 0 when no claim states a
    content word, name or number (RewardConfig.gate)."""
    says = any(c.clauses for c in s.claims)
    return scores["length"] * scores["repetition"] if says else 0.0


def factuality_batch(items: Iterable[tuple[Any, Any]], cfg: RewardConfig | None = None) -> list[float]:
    """F alone for (document, summary) pairs, from `cfg.factuality`'s backend."""
    cfg = cfg or _DEFAULT_CFG
    items = list(items)
    docs = [d for d, _ in items]
    if cfg.factuality == "lexical":  # the only backend that reads the analyses
        summaries, infos = [summary_info(s, cfg) for _, s in items], [document_info(d, cfg) for d in docs]
    else:
        summaries, infos = [SummaryInfo(_text_of(s), 0, [], [], []) for _, s in items], [None] * len(docs)
    return [float(f) for f, _ in Scorer(cfg).factuality(docs, summaries, infos, cfg)]


def score_batch(items: Iterable[tuple[Any, Any]], cfg: RewardConfig | None = None, scorer: Scorer | None = None,
                teacher: dict | None = None) -> list[dict]:
    """Score (document, episode or summary) pairs. A document is a str or a
    data.Document (the oracle backend needs the latter); `teacher` maps a
    document id (the episode's `doc_id`, else the Document's `id`) to a teacher
    Episode for ToolMatch. Without a `scorer`, tau is `cfg.curriculum.taus[0]`
    (models are still loaded once: `fenice_for` shares them); with one, its
    curriculum decides tau.
    Each result holds every component: total, pass, tau, factuality (+ backend
    name, pass), rules (weighted mean, pass), rule_<name> and rule_<name>_pass,
    budget, cap_penalty, tool_match (None without a teacher) and its per-step
    values, n_search, n_delete, n_words, per-claim details and rule evidence."""
    return (scorer or Scorer(cfg or _DEFAULT_CFG)).score_batch(items, cfg, teacher)


def score(document: Any, episode_or_summary: Any, cfg: RewardConfig | None = None) -> dict:
    """One (document, episode or summary) pair (DESIGN.md section 9); see score_batch."""
    return score_batch([(document, episode_or_summary)], cfg)[0]
