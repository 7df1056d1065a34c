"""The news world's fact checker and faulty drafter.

- Reading claims out of text: numbers, dates, entities (regex search keys: `claims.regex_key_for`).
- The oracle: checks ANY summary against its document's fact table and answers
  in the teacher's schema `{"error_span", "corrected_clause", "regex_key"}` plus
  type and position (`oracle_errors`), or as stated facts with their support
  (`stated_facts`, the fact precision of the evaluation).
- The faulty drafter: summaries with labelled errors (entity swap, number
  change, date change, negation, wrong predicate) in the same schema.
On real data a 1B model drafts and a large teacher annotates; here both roles
are played by code that knows the facts, so every label is checkable.

Stdlib, numpy and `data`/`newsworld`/`sandbox` only (no torch).
"""
from __future__ import annotations

import functools
import itertools
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from decimal import Decimal
from typing import Callable, Sequence

import numpy as np

from data import MONTHS, DataError, Document, seeded_rng
import sandbox
from factual_tools import claims, textsplit
from newsworld.vocab import (
    C, CONFLICT, PREDICATES, Qty, Unit, When, DraftFact, MONTH_DAYS, NEGATION, PRED_EXTRA, SHARED_NAME_WORDS,
    count, money, parse_money, percent, score, when, world_lexicon,
)
from newsworld.world import ENTITY_ATTRS, FAMILIES, Slot, choose_verbs, context_of, doc_facts, render, task_of

# ===========================================================================
# 5. Reading claims out of text: numbers, dates, entities
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
    """Dates, money, percentages, scores and counts in `text`, longest reading first, no overlaps.

    Independent of `claims.numbers` (the reward's number parser) on purpose: the oracle is
    the ground truth that evaluation scores against, and the reward is what RL optimises, so
    a parsing mistake shared by both would be rewarded and never show in the held-out
    figures. This one also reads the world's own typed values (a `When`, a unit per slot)."""
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
    for extra in PRED_EXTRA.get(pred, ()):
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
    f: DraftFact
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
        self.sentences = textsplit.split_sentences(doc.text)
        self.entities = doc.entities
        self.words = frozenset(re.findall(r"[A-Z][\w'’-]*", doc.text))
        self.facts = doc_facts(doc)
        ctx = context_of(self.family.name, task_of(doc))
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


@dataclass
class _Stated:
    """What a summary sentence states: its entity, quantity and date mentions."""
    sentence: str
    ents: list[Mention]
    qtys: list[Mention]
    dates: list[Mention]
    present: set[str]  # the document's entities it names

    @classmethod
    def of(cls, view: DocView, sentence: str) -> "_Stated":
        taken: list[tuple[int, int]] = []  # entities first: a number inside a name is not a quantity
        ents = entity_mentions(sentence, view.entities, view.words, taken)
        nums = parse_quantities(sentence, taken)
        return cls(sentence, ents, [m for m in nums if m.kind == "qty"], [m for m in nums if m.kind == "date"],
                   {m.name for m in ents if m.name})

    def val_ok(self, s: _Sig) -> bool:
        return s.qty is not None and any(qty_match(m.qty, s.qty) for m in self.qtys)

    def date_ok(self, s: _Sig) -> bool:
        return s.when is not None and any(when_match(m.when, s.when) for m in self.dates)

    def uses_predicate(self, s: _Sig) -> bool:
        """Does the sentence use `s`'s predicate, or its opposite (then a wrong_predicate of the same fact)?"""
        pred = s.f.pred
        return bool(pred) and bool(_forms_in(pred, self.sentence) or
                                   (pred in CONFLICT and _forms_in(CONFLICT[pred], self.sentence)))

    def shows(self, s: _Sig) -> bool:
        """Does the sentence visibly state `s` (so its entities, numbers and dates are allowed)?"""
        if s.qty is not None or s.when is not None:
            # Its own value or date, or its subject doing its predicate ("Tolenta lowered ...").
            return self.val_ok(s) or self.date_ok(s) or (s.subject in self.present and self.uses_predicate(s))
        return s.subject in self.present if s.subject else bool(s.ents) and set(s.ents) <= self.present


def _fitting(view: DocView, st: _Stated) -> list[tuple[float, _Sig]]:
    """The facts whose cue words all occur in the sentence, each scored by how well the sentence matches it."""
    fitting = []
    for s in view.sigs:
        if not all(any(_cue_rx(p).search(st.sentence) for p in group) for group in s.cues):
            continue
        score = len(s.cues) + 3 * len(set(s.ents) & st.present) + 3 * st.val_ok(s) + 2 * st.date_ok(s)
        score += st.uses_predicate(s)
        fitting.append((score + 0.5 * bool(s.d.get("key")), s))
    return fitting


def _check_sentence(view: DocView, sentence: str) -> tuple[_Sig | None, list[_Err]]:
    """The fact a summary sentence most likely states, and what in the sentence contradicts the facts."""
    st = _Stated.of(view, sentence)
    fitting = _fitting(view, st)
    whole = _Err("unsupported", 0, len(sentence), False, "", None)
    if not fitting:
        return None, [whole]
    anchor = max(fitting, key=lambda t: t[0])[1]  # first of equals: document order
    if (anchor.qty is not None or anchor.when is not None) and not (st.ents or st.qtys or st.dates):
        return anchor, [whole]  # names the topic but states nothing checkable about it
    # The anchor, and the facts the sentence evidently combines with it (same subject or one it names).
    accepted = [anchor] + [s for _, s in fitting if s is not anchor and st.shows(s) and
                           (s.subject in st.present or s.subject == anchor.subject)]
    return anchor, (_element_errors(view, st, accepted, anchor) + _negation_errors(st, accepted, anchor) +
                    _predicate_errors(st, accepted))


def _error_at(kind: str, m: Mention, intrinsic: bool, accepted: list[_Sig], anchor: _Sig,
              fix: Callable[[_Sig], str | None]) -> _Err:
    """The error at mention `m`: its fix from the first accepted fact that offers one, else no fix (the anchor's)."""
    for s in accepted:
        repl = fix(s)
        if repl is not None:
            return _Err(kind, m.start, m.end, intrinsic, repl, s)
    return _Err(kind, m.start, m.end, intrinsic, None, anchor)


def _element_errors(view: DocView, st: _Stated, accepted: list[_Sig], anchor: _Sig) -> list[_Err]:
    """Every entity, number and date the sentence states that no accepted fact holds, in that order."""
    ok_ents = {e for s in accepted for e in s.ents}
    errors: list[_Err] = []
    for m in st.ents:
        if m.name is not None and m.in_doc and m.name in ok_ents:
            continue

        def swap(s: _Sig, m: Mention = m) -> str | None:  # the fact's own entity of the mention's type
            cand = [e for e in s.ents if e not in st.present and view.entities.get(e) == m.etype]
            return cand[0] if cand and m.etype is not None else None
        errors.append(_error_at("entity_swap", m, bool(m.name and m.in_doc), accepted, anchor, swap))
    for m in st.qtys:
        if any(val_ok_one(m.qty, s) for s in accepted):
            continue

        def value(s: _Sig, m: Mention = m) -> str | None:  # the fact's own value of the same class
            same_class = s.qty is not None and _qclass(s.qty) == _qclass(m.qty)
            return s.f.value.text if same_class and not st.val_ok(s) else None
        errors.append(_error_at("number_change", m, any(val_ok_one(m.qty, s) for s in view.sigs), accepted, anchor,
                                value))
    for m in st.dates:
        if any(when_ok_one(m.when, s) for s in accepted):
            continue

        def date(s: _Sig, m: Mention = m) -> str | None:  # the fact's own date, written as the mention is
            return _when_as(s.when, _when_kind(m.when)) if s.when is not None and not st.date_ok(s) else None
        errors.append(_error_at("date_change", m, any(when_ok_one(m.when, s) for s in view.sigs), accepted, anchor,
                                date))
    return errors


def _negation_errors(st: _Stated, accepted: list[_Sig], anchor: _Sig) -> list[_Err]:
    """A negation the anchor fact does not have, or one it has that the sentence lacks."""
    neg = NEGATION.search(st.sentence)
    if neg and anchor.f.polarity and all(s.f.polarity for s in accepted):
        affirmative, span = False, (neg.start(), neg.end())  # the negated form of the predicate is wrong
    elif not neg and not anchor.f.polarity:
        affirmative, span = True, (0, len(st.sentence))  # the affirmative form is wrong
    else:
        return []
    forms = [x for x in _forms_in(anchor.f.pred, st.sentence) if bool(x[2]) == affirmative] if anchor.f.pred else []
    if forms:
        form, fix, _ = forms[0]
        a = _cue_rx(form).search(st.sentence).start()
        return [_Err("negation", a, a + len(form), True, fix, anchor)]
    return [_Err("negation", span[0], span[1], True, None, anchor)]


def _predicate_errors(st: _Stated, accepted: list[_Sig]) -> list[_Err]:
    """An accepted fact's opposite predicate in place of its own ("fell" for "rose")."""
    errors = []
    for s in accepted:
        if s.f.pred in CONFLICT and not _forms_in(s.f.pred, st.sentence):
            wrong = _forms_in(CONFLICT[s.f.pred], st.sentence)
            if wrong:
                form, _, affirmative = wrong[0]
                idx = [p if affirmative else n for p, n in PREDICATES[CONFLICT[s.f.pred]]].index(form) \
                    if form not in PRED_EXTRA.get(CONFLICT[s.f.pred], ()) else 0
                own = PREDICATES[s.f.pred][idx % len(PREDICATES[s.f.pred])]
                fix = own[0] if affirmative else own[1]
                a = _cue_rx(form).search(st.sentence).start()
                errors.append(_Err("wrong_predicate", a, a + len(form), True, fix, s))
    return errors


def val_ok_one(q: Qty, s: _Sig) -> bool:
    return s.qty is not None and qty_match(q, s.qty)


def when_ok_one(w: When, s: _Sig) -> bool:
    return s.when is not None and when_match(w, s.when)


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
    for idx, sentence in enumerate(textsplit.split_sentences(summary)):
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
                key = claims.regex_key_for(view.sentences, target, sentence, span, view.entities, hide=e.repl or "")
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
    for idx, sentence in enumerate(textsplit.split_sentences(summary)):
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


def key_facts_stated(doc: Document, summary: str) -> dict[str, bool]:
    """Each key fact of `doc` (role -> stated): true when a summary sentence with no oracle
    error states its value and its date, or, for a fact with neither, names the entities
    the reference names for it. A sentence with an error states nothing right: its subject,
    polarity or predicate may be the wrong part ("Rival Co raised $398 million")."""
    view = DocView(doc)
    keys = [s for s in view.sigs if s.d.get("key")]
    found: dict[str, set[str]] = {s.role: set() for s in keys}
    for sentence in textsplit.split_sentences(summary):
        if _check_sentence(view, sentence)[1]:
            continue
        st = _Stated.of(view, sentence)
        ok = st.qtys + st.dates + st.ents
        for s in keys:
            if s.qty is not None and any(m.qty is not None and qty_match(m.qty, s.qty) for m in ok):
                found[s.role].add("value")
            if s.when is not None and any(m.when is not None and when_match(m.when, s.when) for m in ok):
                found[s.role].add("date")
            found[s.role] |= {m.name for m in ok if m.name in s.ents}
    out = {}
    for s in keys:
        if s.qty is not None or s.when is not None:
            need = {k for k, x in (("value", s.qty), ("date", s.when)) if x is not None}
        else:
            need = {e for e in s.ents if e in doc.summary} or set(s.ents[:1])
        out[s.role] = need <= found[s.role]
    return out


def key_fact_coverage(doc: Document, summary: str) -> float:
    """Share of `doc`'s key facts (those its reference states) that `summary` states right
    (`key_facts_stated`), in [0, 1]; 0.0 for a document with no key fact."""
    stated = key_facts_stated(doc, summary)
    return sum(stated.values()) / len(stated) if stated else 0.0


def best_extract(doc: Document, budget: int, most: int = 3) -> str:
    """The copying baseline with the oracle's knowledge: the set of at most `most` whole
    article sentences, each stating a key fact, within `budget` words, whose key-fact
    coverage is highest (ties: fewer words, then article order). "" when none fits."""
    sentences = textsplit.split_sentences(doc.text)
    holding = sorted({d["sentence"] for d in doc.facts if d.get("key")})
    best, best_key = "", (0.0, 0)
    for k in range(1, most + 1):
        for chosen in itertools.combinations(holding, k):
            text = " ".join(sentences[i] for i in chosen)
            words = len(textsplit.words(text))
            if words > budget:
                continue
            key = (key_fact_coverage(doc, text), -words)
            if key > best_key:
                best, best_key = text, key
    return best


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
    return claims.rx_escape(names[0] if names else (words[0] if words else sentence.strip()[:20]))


def oracle_fact_score(doc: Document, summary: str) -> float:
    """Share of summary sentences with no error, in [0, 1]; an empty summary scores 0.0."""
    sentences = textsplit.split_sentences(summary)
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
    return {w for w in name.replace(".", " ").split() if len(w) > 2 and w not in SHARED_NAME_WORDS}


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
            d = rng.randint(1, MONTH_DAYS[m - 1])
        new = when(y, m, d)
        if new.text != w.text:
            return new
    raise RuntimeError(f"could not change {w.text!r}")


def _mutate(view: DocView, facts: dict[str, DraftFact], unit: Unit, slots: list[Slot], rng: random.Random,
            *, types: Sequence[str], verbs: dict[str, str], dry: bool = False) -> tuple[Slot, str, str, bool] | None:
    """Pick an error for one rendered unit: (slot, wrong text, type, intrinsic), or None if none applies.

    `dry=True` only asks whether one of `types` applies (True / None).
    """
    unit_ents = {e for r in unit.roles for e in (view.sig(r).ents)}
    by_type = {
        "entity_swap": [s for s in slots if s.attr in ENTITY_ATTRS],
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
    document) and `sentence_index` (in `textsplit.split_sentences(summary)`).
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
    verbs = choose_verbs(facts, rng)
    templates = [rng.choice(u.templates) for u in units]
    rendered = [render(t, facts, verbs) for t in templates]
    if n_errors is None:
        n_errors = 0 if rng.random() < clean_rate else rng.randint(1, max(1, min(max_errors, len(units))))
    feasible = {(t, i) for i, (_, slots, _) in enumerate(rendered) for t in types
                if _mutate(view, facts, units[i], slots, rng, types=[t], verbs=verbs, dry=True)}
    sentences = [text for text, _, _ in rendered]
    labels, targets, broken = [], [], set()
    while len(labels) < n_errors:
        options = sorted({t for t, i in feasible if i not in broken}, key=types.index)
        if not options:
            break
        etype = rng.choice(options)
        i = rng.choice(sorted(i for t, i in feasible if t == etype and i not in broken))
        good, slots, _ = rendered[i]
        m = _mutate(view, facts, units[i], slots, rng, types=[etype], verbs=verbs)
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
                       "regex_key": claims.regex_key_for(view.sentences, target, bad, span, view.entities,
                                                         hide=good[slot.start:slot.end]),
                       "type": etype, "intrinsic": intrinsic, "sentence_index": i})
        targets.append(target)
    order = sorted(range(len(labels)), key=lambda k: labels[k]["sentence_index"])
    return " ".join(sentences), [labels[k] for k in order], [targets[k] for k in order]


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
    sents = [textsplit.split_sentences(d.text) for d in docs]
    out = {
        "documents": len(docs),
        "by_bucket": dict(sorted(Counter(d.bucket for d in docs).items())),
        "sentences_per_doc": _dist([len(s) for s in sents]),
        "words_per_doc": _dist([len(textsplit.words(d.text)) for d in docs]),
        "words_per_sentence": _dist([len(textsplit.words(x)) for s in sents for x in s]),
        "summary_sentences": _dist([len(textsplit.split_sentences(d.summary)) for d in docs if d.summary]),
        "summary_words": _dist([len(textsplit.words(d.summary)) for d in docs if d.summary]),
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
        text, labels, targets = draft_detailed(d, seeded_rng(draft_seed, "draft", k), clean_rate=clean_rate)
        drafts_clean += not labels
        oracle = oracle_errors(d, text)
        flagged = defaultdict(set)
        for lab in oracle:
            flagged[lab["sentence_index"]].add(lab["type"])
        injected = {lab["sentence_index"]: lab for lab in labels}
        for i in range(len(textsplit.split_sentences(text))):
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
            parts = textsplit.split_sentences(text)
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


