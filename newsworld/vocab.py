"""The news world's vocabulary: values, names, predicates, and the parts an event family is built from.

Values (money, percentages, counts, scores, dates) with their surface forms;
the fixed cast of people, companies, places and institutions; predicate classes
with their affirmative and negated forms and the conflicting class; and the
declarative building blocks of an event family (`DraftFact`, `Sent`, `Unit`, `Family`,
`S`, `U`, `C`, `Values`). `world.py` defines the ten families and generates
articles from them; `oracle.py` reads values and names back out of text.
"""
from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Callable

from data import MONTHS, seeded_rng

WORLD_VERSION = 1  # version of the news world generator (bump when output bytes change)


# ===========================================================================
# 2. The news world: values, names and predicates
# ===========================================================================
#
# Every article is built from an *event* (entities, values, dates drawn by an
# event RNG) and a *surface* (templates, sentence order, optional clauses drawn
# by a surface RNG). A few articles retell an earlier article's event with a new
# surface: near-duplicates that the leak guard has to catch, as in real news.


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


MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


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
    r = seeded_rng("newsworld-cast", WORLD_VERSION)

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
            ws = {w for w in name.replace(".", " ").split() if len(w) > 2 and w not in SHARED_NAME_WORDS}
            if not ws & self.used_words:
                self.used_words |= ws
                return Ent(name, POOL_TYPE.get(pool, pool))
        raise RuntimeError(f"cast pool {pool!r} exhausted")  # cannot happen with pools this size


# Words many names share; sharing them does not make two names confusable.
SHARED_NAME_WORDS = frozenset("University State Institute Technology District Court Appeals Supreme City Council "
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
PRED_EXTRA = {"rise": ("up",), "fall": ("down",)}
NEGATION = re.compile(r"\b(?:not|never|no longer)\b|n't\b", re.I)


def verb(pred: str, polarity: bool, rng: random.Random) -> str:
    past, neg = rng.choice(PREDICATES[pred])
    return past if polarity else neg


# ===========================================================================
# 3. The news world: event families
# ===========================================================================
#
# A family is declarative: a `make(rng)` that draws an event (role -> `DraftFact`), the
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
class DraftFact:
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
    make: Callable[[random.Random], dict[str, DraftFact]]
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


class Values:
    """Draws an event's numbers and dates; no two with the same text, so every role is identifiable."""

    def __init__(self, r: random.Random):
        self.r = r
        self.seen: set[str] = set()
        self.pct_style = "%" if r.random() < 0.7 else "percent"

    def distinct(self, make: Callable[[], Qty | When]):
        """`make()` drawn again until its text is new to this event."""
        for _ in range(100):
            q = make()
            if q.text not in self.seen:
                self.seen.add(q.text)
                return q
        raise RuntimeError("could not draw a distinct value")  # cannot happen with these ranges

    def big_money(self, lo_b: float = 1.2, hi_b: float = 48.0) -> Qty:
        r = self.r
        return self.distinct(lambda: money(r.randint(int(lo_b * 10), int(hi_b * 10)) * 10**8) if r.random() < 0.6
                         else money(r.randint(12, 98) * 10 * 10**6))

    def millions(self, lo: int, hi: int) -> Qty:
        r = self.r
        return self.distinct(lambda: money(r.randint(lo * 10, hi * 10) * 10**5 if r.random() < 0.3
                                       else r.randint(lo, hi) * 10**6))

    def near(self, q: Qty, lo: float, hi: float) -> Qty:
        r = self.r
        return self.distinct(lambda: money(int(round(q.amount * r.uniform(lo, hi)))))

    def dollars(self, lo: int, hi: int) -> Qty:
        r = self.r
        return self.distinct(lambda: money(r.randint(lo // 100, hi // 100) * 100 - 1))

    def pct(self, lo: float, hi: float) -> Qty:
        r = self.r
        return self.distinct(lambda: percent(r.randint(int(lo * 10), int(hi * 10)) / 10 if r.random() < 0.3
                                         else r.randint(int(lo), int(hi)), self.pct_style))

    def count(self, lo: int, hi: int, noun: str | None, unit: str | None = None, step: int = 10) -> Qty:
        r = self.r
        return self.distinct(lambda: count(r.randint(lo // step, hi // step) * step, noun, unit))

    def small(self, lo: int, hi: int, noun: str) -> Qty:
        r = self.r
        return self.distinct(lambda: count(r.randint(lo, hi), noun))

    def date(self, y: int, m: int | None = None, day: bool = True) -> When:
        r = self.r
        return self.distinct(lambda: when(y, m or r.randint(1, 12), r.randint(1, 28) if day else None))

    def year(self, lo: int, hi: int) -> When:
        r = self.r
        return self.distinct(lambda: when(r.randint(lo, hi)))


