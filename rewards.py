"""Rewards: the rule bundle, the factuality backends, tool terms, the combined reward
and its curriculum (DESIGN.md section 5).

    R = gate * (w_f * F + w_r * Rules + w_pass * pass) - budget - cap_penalty
        - right_delete_penalty * right_deletes + w_match * ToolMatch
    pass = F >= tau and every rule reaches its threshold
    gate = length score * repetition score, 0 for a summary that states nothing

The gate and the pass bonus close the reward's holes (a reward must not pay for saying nothing): see
`RewardConfig.gate`, and the audit table in the tests.

`F` comes from the backend `RewardConfig.factuality` names: "fenice" (factual_tools/fenice.py; torch
and two HF models, loaded lazily), "lexical" (model-free, built for the news world's errors; not
FENICE), "support" (the default: model-free, for real text), "learned" (a logistic regression, trained
by factual_tools/factcheck.py, weights from `reward.learned.path`) or "oracle" (the fact table of the
document world, `factual_tools.world`). The backends sit in one registry (`FACTUALITY_BACKENDS`,
`register_factuality` adds one), each reported under its own name (`BACKEND_NAMES`), so an
approximation is never reported as FENICE.

Entry points (DESIGN.md section 10): `rule_scores`, `lexical_factuality`, `support_factuality`,
`factuality_batch`, `score`, `Scorer.score_batch`, `tool_match`, `Curriculum`, `RewardConfig`.
Every rule is total: any input (empty, huge, binary junk, markup) gets a score in [0, 1] and never
raises; a summary with no words scores 0 on every rule. Texts are read by factual_tools/claims.py;
torch and transformers load only inside FENICE, so rewards import on a CPU machine without vLLM or
a GPU.
"""
from __future__ import annotations

import collections
import dataclasses
import difflib
import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal, NamedTuple

import numpy as np

import sandbox
from factual_tools import claims, textsplit, world
from factual_tools.claims import (
    LRU, NEGATIONS, STOPWORDS, Claim, DocInfo, Part, SummaryInfo, name_sentences, num_sentences, premises_of,
    stem_word, text_of, text_key,
)
from factual_tools.fenice import Fenice, FeniceConfig
from factual_tools.settings import ConfigError

# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------

RULES = ("length", "entities", "numbers", "repetition", "profanity", "tool_format")
LEXICAL_NAME = "lexical (model-free approximation)"
SUPPORT_NAME = "support (model-free, document-level word support)"
LEARNED_NAME = "learned (logistic regression over model-free features)"
BACKEND_NAMES: dict[str, str] = {}  # each factuality backend's reported name (`register_factuality`)
Backend = str  # a config's factuality key: a key of FACTUALITY_BACKENDS (`check_backend`)


def check_backend(key: str, where: str) -> None:
    """Stop a config whose factuality key (`where`) names no registered backend."""
    if key not in FACTUALITY_BACKENDS:  # the registry the scorer looks the key up in
        raise ConfigError(f"{where}={key!r} is no factuality backend; registered: "
                          f"{', '.join(sorted(FACTUALITY_BACKENDS))} (rewards.register_factuality adds one)")


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
    path: str = "scorers/learned.json"  # shipped; rewritten by `python -m factual_tools.factcheck train`



@dataclass
class ToolTermsConfig:
    budget_per_call: float = 0.05  # subtracted per search and per delete call
    delete_cap_penalty: float = 0.5  # subtracted when the episode hit the delete cap
    tool_cap_penalty: float = 0.5  # subtracted when the episode hit the tool-call cap
    w_match: float = 0.0  # weight of ToolMatch against a teacher episode (drgrpo_v19 sets it)
    match_kind_weight: float = 0.5  # share of a step's agreement given for calling the same tool
    # subtracted per delete that retracted text the factuality backend finds nothing wrong in
    # (`right_deletes`): deleting a right sentence then costs more than the call. A penalty only:
    # a bonus for deleting wrong text would pay the policy for writing it first
    right_delete_penalty: float = 0.0


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
    # F times key-fact coverage: the share of the document's key facts (those its reference
    # states) that the summary states right. Every backend scores precision, so a summary
    # stating one key fact of four right scores 1.0 without it. Needs news world documents
    # (their fact tables mark the key facts).
    coverage: bool = False
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

    def __post_init__(self):
        check_backend(self.factuality, "reward.factuality")


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
             if not (n.weak and not name_sentences(doc, n.tokens))]
    missing = [" ".join(n.tokens) for n in names if not name_sentences(doc, n.tokens)]
    score = 1.0 - len(missing) / len(names) if names else float(not doc.names)
    return RuleResult(score, {"names": len(names), "unsupported": missing})


def rule_numbers(doc: DocInfo, s: SummaryInfo, cfg: RuleConfig) -> RuleResult:
    nums = [n for c in s.claims for n in c.nums]
    tol = cfg.number_rel_tolerance
    missing = [n.text for n in nums if not num_sentences(doc, n, tol)]
    score = 1.0 - len(missing) / len(nums) if nums else float(not doc.nums)
    return RuleResult(score, {"numbers": len(nums), "unsupported": missing})


def rule_repetition(doc: DocInfo, s: SummaryInfo, cfg: RuleConfig) -> RuleResult:
    """Distinct word trigrams (a repeated phrase, "on on on") times distinct sentences
    (a repeated claim counts once: "Granite Group. Granite Group.")."""
    words = [w.lower() for w in textsplit.words(s.text)]
    grams = list(zip(words, words[1:], words[2:]))
    fresh = len(set(grams)) / len(grams) if grams else 1.0
    span = max(1e-9, cfg.repeat_fresh - cfg.repeat_floor)
    phrase = min(1.0, max(0.0, (fresh - cfg.repeat_floor) / span))
    keys = [tuple(w.lower() for w in textsplit.words(c.text)) for c in s.claims]
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
    """Every rule's score in [0, 1] (DESIGN.md section 10)."""
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
        sents = num_sentences(doc, n, tol)
        if sents:
            items.append(premises_of(doc, ("num", n.kind, n.value, n.unit, n.currency, tol), sents))
        else:
            extrinsic.append(n.text)
    for name in part.names:
        sents = name_sentences(doc, name.tokens)
        if sents:
            items.append(premises_of(doc, ("name", name.tokens), sents))
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
    """The lexical factuality score in [0, 1] (DESIGN.md section 10): a model-free
    approximation, reported as "lexical (model-free approximation)". Claims are the
    summary's sentences, each scored by its best-supporting document sentence on
    content words, entities and numbers."""
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

SUPPORT_TOKEN_RE = re.compile(r"[^\W_]+(?:['’.,][^\W_]+)*")
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
    return stem_word(_IRREGULAR.get(t, t))


def _support_words(sentence: str) -> list[str]:
    return [w for w in map(_support_word, SUPPORT_TOKEN_RE.findall(sentence)) if w]


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


SUPPORT_DOCS = LRU(512)


def support_document(document: Any) -> dict[str, frozenset]:
    """Content stem -> the document sentences holding it (cached per text)."""
    text = text_of(document)
    key = text_key(text)
    post = SUPPORT_DOCS.get(key)
    if post is None:
        acc = collections.defaultdict(set)
        for i, sent in enumerate(textsplit.split_sentences(repair_document(text))):
            for w in _support_words(sent):
                acc[w].add(i)
        post = {w: frozenset(v) for w, v in acc.items()}
        SUPPORT_DOCS.put(key, post)
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
    for sent in textsplit.split_sentences(repair_summary(text_of(summary))):
        found = [(w, tok) for tok in SUPPORT_TOKEN_RE.findall(sent) if (w := _support_word(tok))]
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
    """The support factuality score in [0, 1]: model-free, reported as SUPPORT_NAME.
    Per summary sentence, the share of its content words the document holds, times the
    share of adjacent word pairs that co-occur there (to `pair_exponent`); the worst
    sentence by default."""
    return support_details(document, summary, cfg)[0]


# ---------------------------------------------------------------------------
# The learned scorer: logistic regression over support features (factual_tools/factcheck.py trains it)
# ---------------------------------------------------------------------------

LEARNED_FEATURES = ("support_min", "unsupported_words", "support_same_sentence")
_SAME_SENTENCE = SupportConfig(window=0)


def learned_features(document, summary: str, support: SupportConfig | None = None) -> list[float]:
    """The feature vector of one (document, summary) pair, in LEARNED_FEATURES order: the
    support score (the worst sentence's, on text whose sentence boundaries the
    support scorer repairs), the number of the summary's content words the
    document lacks, and the support score when adjacent words must share one
    document sentence (a fused or mis-attributed claim scores lower)."""
    f_support, rows = support_details(document, summary, support)
    rows = [r for r in rows if "skipped" not in r]
    if not rows:
        return [0.0, 0.0, 0.0]
    return [f_support, float(sum(len(r["unsupported"]) for r in rows)),
            support_factuality(document, summary, _SAME_SENTENCE)]


class LearnedModel:
    """Standardised features -> logistic regression -> P(no error)."""

    def __init__(self, mean, std, coef, bias, meta=None):
        self.mean, self.std = np.asarray(mean, float), np.asarray(std, float)
        self.coef, self.bias = np.asarray(coef, float), float(bias)
        self.meta = meta or {}

    def predict(self, X) -> np.ndarray:
        z = ((np.asarray(X, float) - self.mean) / self.std) @ self.coef + self.bias
        return 1.0 / (1.0 + np.exp(-z))

    def score(self, document, summary: str) -> float:
        if not textsplit.split_sentences(summary):
            return 0.0
        return float(self.predict([learned_features(document, summary)])[0])

    def to_json(self) -> dict:
        return {"features": list(LEARNED_FEATURES), "mean": self.mean.tolist(), "std": self.std.tolist(),
                "coef": self.coef.tolist(), "bias": self.bias, "meta": self.meta}


@functools.lru_cache(maxsize=8)
def load_learned(path: str) -> LearnedModel:
    """The weights at `path`; a missing or foreign file is an error naming the train command."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no learned scorer here; train one with `python -m "
                                f"factual_tools.factcheck train --out {path}` (reward.learned.path names it)")
    try:
        d = json.loads(p.read_text())
        if d["features"] != list(LEARNED_FEATURES):
            raise ValueError(f"its features {d['features']} are not this version's {list(LEARNED_FEATURES)}")
        return LearnedModel(d["mean"], d["std"], d["coef"], d["bias"], d.get("meta"))
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a learned scorer file ({e}); retrain with "
                         f"`python -m factual_tools.factcheck train --out {path}`") from None


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
    return frozenset(textsplit.words(q))


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


def right_deletes(document: Any, episode: Any, factuality: str) -> int:
    """How many deletes of `episode` retracted text with nothing wrong in it: by the
    news world's oracle (no error in it) under the "oracle" backend, else by the
    model-free check of `_unsupported` (less than half unsupported). Text that states
    nothing has nothing wrong in it: deleting it removes no error either."""
    if not isinstance(episode, sandbox.Episode):
        return 0
    gone = [c.deleted for c in episode.calls if c.kind == "delete" and c.valid and c.deleted]
    if factuality == "oracle" and hasattr(document, "facts"):
        news = world.world("the oracle's right-delete check")
        return sum(not news.errors(document, t) for t in gone)
    text = text_of(document)
    return sum(_unsupported(text, t) < 0.5 for t in gone)


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
        a, b = frozenset(textsplit.words(call.deleted or "")), frozenset(textsplit.words(teacher.deleted or ""))
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
        return {"stage": int(self.stage), "window": [float(x) for x in self.window], "raises": list(self.raises),
                "seen": int(self.seen), "taus": [float(t) for t in self.cfg.taus]}

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


# ---------------------------------------------------------------------------
# Factuality backends: one registry, each reported under its own name
# ---------------------------------------------------------------------------


# key -> score(scorer, documents, summaries, document infos, cfg): one (F in [0, 1], details) per
# summary (details: the claims or labels behind F, or None); its reported name is BACKEND_NAMES[key]
FACTUALITY_BACKENDS: dict[str, Callable[..., list[tuple[float, Any]]]] = {}


def register_factuality(key: str, name: str, score: Callable[..., list[tuple[float, Any]]]) -> None:
    """Add a factuality backend under `key` (a config's `reward.factuality`, checked against the
    registered keys when the config is built), reported as `name`."""
    FACTUALITY_BACKENDS[key] = score
    BACKEND_NAMES[key] = name


def _oracle_factuality(scorer, docs, summaries, infos, cfg) -> list[tuple[float, Any]]:
    news = world.world("factuality='oracle'")  # the world's fact table decides
    out = []
    for d, s in zip(docs, summaries):
        if not hasattr(d, "facts"):
            raise ValueError("factuality='oracle' needs data.Document items (with their fact table), "
                             f"got {type(d).__name__}")
        score = news.fact_precision if cfg.oracle_unit == "fact" else news.fact_score
        out.append((float(score(d, s.text)), news.errors(d, s.text)))
    return out


register_factuality("lexical", LEXICAL_NAME, lambda scorer, docs, summaries, infos, cfg: [
    lexical_details(d, s, cfg) for d, s in zip(infos, summaries)])
register_factuality("support", SUPPORT_NAME, lambda scorer, docs, summaries, infos, cfg: [
    support_details(d, s.text, cfg.support) for d, s in zip(docs, summaries)])
register_factuality("learned", LEARNED_NAME, lambda scorer, docs, summaries, infos, cfg: [
    (model.score(d, s.text), None) for model in (load_learned(cfg.learned.path),) for d, s in zip(docs, summaries)])
register_factuality("fenice", "fenice", lambda scorer, docs, summaries, infos, cfg: [
    (r["score"], r["claims"]) for r in scorer.fenice(cfg.fenice).score_batch([(text_of(d), s.text)
                                                                               for d, s in zip(docs, summaries)])])
register_factuality("oracle", "oracle (news world fact table)", _oracle_factuality)


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
        if cfg.factuality not in FACTUALITY_BACKENDS:
            raise ValueError(f"unknown factuality backend {cfg.factuality!r} ({', '.join(FACTUALITY_BACKENDS)})")
        return FACTUALITY_BACKENDS[cfg.factuality](self, docs, summaries, infos, cfg)

    @staticmethod
    def coverage(docs: list, summaries: list, cfg: RewardConfig) -> list[float | None]:
        """Key-fact coverage per summary under `cfg.coverage` (None per summary without it)."""
        if not cfg.coverage:
            return [None] * len(docs)
        news = world.world("reward.coverage")  # the key facts are the world's fact table's
        for d in docs:
            if not getattr(d, "facts", None):
                raise ValueError("reward.coverage needs news world documents with a fact table; "
                                 f"document {getattr(d, 'id', '?')!r} has none (set reward.coverage=false)")
        return [news.key_fact_coverage(d, s.text) for d, s in zip(docs, summaries)]

    def score_batch(self, items: Iterable[tuple[Any, Any]], cfg: RewardConfig | None = None,
                    teacher: dict | None = None) -> list[dict]:
        """Score (document, episode or summary) pairs under `cfg` (default: the scorer's),
        at the curriculum's tau. A document is a str or a data.Document (the oracle backend
        needs the latter); `teacher` maps a document id (the episode's `doc_id`, else the
        Document's `id`) to a teacher Episode for ToolMatch. FENICE's models load once
        (`fenice_for` shares them across scorers).
        Each result holds every component: total, pass, tau, factuality (+ backend
        name, pass; `precision` is F before key-fact `coverage`, None without
        reward.coverage), rules (weighted mean, pass), rule_<name> and rule_<name>_pass,
        budget, cap_penalty, tool_match (None without a teacher) and its per-step
        values, n_search, n_delete, n_words, per-claim details and rule evidence."""
        cfg = cfg or self.cfg
        items = list(items)
        docs = [d for d, _ in items]
        infos = [document_info(d, cfg) for d in docs]
        summaries = [summary_info(s, cfg) for _, s in items]
        facts = self.factuality(docs, summaries, infos, cfg)
        coverage = self.coverage(docs, summaries, cfg)
        tau = self.curriculum.tau
        out = []
        for (doc, ep), info, s, (f, claim_scores), cov in zip(items, infos, summaries, facts, coverage):
            f = min(1.0, max(0.0, float(f))) if math.isfinite(f) else 0.0
            precision, f = f, f * (1.0 if cov is None else cov)
            rules = _rules(info, s, cfg.rules)
            scores = {k: r.score for k, r in rules.items()}
            passed = rules_pass(scores, cfg.rules)
            rmean = rules_mean(scores, cfg.rules)
            budget, cap = tool_terms(s.episode, cfg.tools)
            n_right_del = right_deletes(doc, s.episode, cfg.factuality)
            match, steps = None, []
            t_ep = teacher.get(_doc_id(doc, ep)) if teacher else None
            if t_ep is not None and s.episode is not None:
                match, steps = tool_match(s.episode, t_ep, cfg.tools)
            ok = f >= tau and all(passed.values())
            g = content_gate(s, scores) if cfg.gate else 1.0
            total = (g * (cfg.w_factuality * f + cfg.w_rules * rmean + cfg.w_pass * ok) - budget - cap
                     - cfg.tools.right_delete_penalty * n_right_del + cfg.tools.w_match * (match or 0.0))
            row = {"total": total, "pass": ok, "tau": tau, "gate": g,
                   "factuality": f, "factuality_backend": BACKEND_NAMES[cfg.factuality],
                   "precision": precision, "coverage": cov,
                   "factuality_pass": f >= tau, "rules": rmean, "rules_pass": all(passed.values())}
            for k in RULES:
                row[f"rule_{k}"] = scores[k]
                row[f"rule_{k}_pass"] = passed[k]
            row.update({"budget": budget, "cap_penalty": cap, "right_deletes": n_right_del,
                        "tool_match": match, "tool_match_steps": steps,
                        "n_search": s.episode.n_search if s.episode else 0,
                        "n_delete": s.episode.n_delete if s.episode else 0, "n_words": s.n_words,
                        "claims": claim_scores, "evidence": {k: r.evidence for k, r in rules.items()}})
            out.append(row)
        return out


_DEFAULT_CFG = RewardConfig()


def document_info(document: Any, cfg: RewardConfig | None = None) -> DocInfo:
    """`claims.document_info` under a reward config's settings (cached per text and settings)."""
    cfg = cfg or _DEFAULT_CFG
    return claims.document_info(document, cfg.rules.ner, cfg.rules.spacy_model, cfg.lexical.window_sentences)


def summary_info(summary: Any, cfg: RewardConfig | None = None) -> SummaryInfo:
    """`claims.summary_info` under a reward config's settings."""
    cfg = cfg or _DEFAULT_CFG
    return claims.summary_info(summary, cfg.rules.ner, cfg.rules.spacy_model, cfg.rules.profanity_extra)


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
        summaries, infos = [SummaryInfo(text_of(s), 0, [], [], []) for _, s in items], [None] * len(docs)
    facts = Scorer(cfg).factuality(docs, summaries, infos, cfg)
    coverage = Scorer.coverage(docs, summaries, cfg)
    return [float(f) * (1.0 if c is None else c) for (f, _), c in zip(facts, coverage)]


def score(document: Any, episode_or_summary: Any, cfg: RewardConfig | None = None) -> dict:
    """One (document, episode or summary) pair (DESIGN.md section 10), at the first tau of
    `cfg`'s curriculum; see Scorer.score_batch."""
    return Scorer(cfg).score_batch([(document, episode_or_summary)])[0]
