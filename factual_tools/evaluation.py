"""Evaluation shared by eval.py, the trainers' held-out passes, distillation and serving.

- Metrics: ROUGE, pass@k, the oracle's error counts and fact precision on the news
  world, tool-use figures and the tool-decision AUC (`evaluate`'s docstring defines each),
  and figures that need no fact table, for any article (`oracle_free_metrics`).
- Decoding: greedy and sampled episodes with the sandbox in the loop, with the
  decode-time tool bans of the ablations (`TagBan`).
- Loading: trained model directories and the held-out documents of a split.
- Copying baselines (`BASELINES`): lead-3 and the oracle's best whole sentences, scored
  by the same figures as a model's greedy episodes (`evaluate_baseline`), no model loaded.

eval.py (the command line, the report and the plots) is the script around this module.
"""
from __future__ import annotations

import dataclasses
import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np
import torch
from tqdm import tqdm

import data
import rewards
import sandbox
from factual_tools import claims, common, engine, modeling, settings, textsplit, world

TOOLS_BANNED = {"all": (), "no_search": ("<search", "</search"), "no_delete": ("<delete",),
                "none": ("<search", "</search", "<delete")}
KS = (1, 2, 4, 8)


@dataclass
class Config:
    name: str = "eval"  # run name: outputs go to runs_dir/name
    runs_dir: str = "runs"
    # trained directory (full weights or a PEFT adapter), a model preset, or a copying baseline's name
    # (BASELINES: lead-3, best-extract; a reserved name wins over a directory so named); --compare overrides
    model: str = "runs/rl_tiny/final"
    base: modeling.ModelConfig = field(default_factory=modeling.ModelConfig)  # dtype/quant/attention for loading
    docs: str = "out/newsworld/docs.jsonl"  # Document JSONL
    split: str = "out/newsworld/split.json"  # leak-cluster manifest ("" = every document of `docs`)
    pool: Literal["eval", "never_touch"] = "eval"  # never_touch only when explicitly asked for
    n_docs: int = 32  # the first n documents of the pool
    n_samples: int = 8  # sampled rollouts per document for pass@k (0: no sampled pass, pass@k n/a)
    temperature: float = 1.0  # of those samples
    max_new_tokens: int = 160  # per episode, all turns together
    batch_size: int = 64  # rows decoded together
    latency_docs: int = 16  # documents timed at batch 1 (0 = skip)
    tools: Literal["all", "no_search", "no_delete", "none"] = "all"  # decode-time ablation
    reward: rewards.RewardConfig = field(default_factory=lambda: rewards.RewardConfig(factuality="oracle"))
    limits: dict[str, int] = field(default_factory=dict)  # sandbox limits (sandbox.Limits names)
    claim_tau: float = 0.5  # without an oracle: a claim scored below this is unsupported
    html_samples: int = 8  # greedy episodes per model in samples.html
    seed: int = 0
    torch_threads: int = 0  # CPU threads for torch (0 = its default)
    autocast: common.Autocast = "auto"  # bf16 decoding where the hardware has it natively, per model (common.choose_autocast)
    # A trace corpus (filter_traces.py's train.jsonl): also score each model's delete decision
    # teacher-forced on its first `decision_traces` traces (decision_probe_*; see decision_probe)
    decision_corpus: str = ""
    decision_traces: int = 80

    def __post_init__(self):
        if min(self.n_docs, self.max_new_tokens, self.batch_size) < 1 or self.n_samples < 0:
            raise settings.ConfigError("n_docs, max_new_tokens and batch_size must be >= 1, n_samples >= 0")
        if self.decision_traces < 1:
            raise settings.ConfigError(f"decision_traces={self.decision_traces}: must be >= 1")
        if self.latency_docs < 0 or self.temperature <= 0:
            raise settings.ConfigError("latency_docs must be >= 0 and temperature > 0 (greedy is measured apart)")


# ---------------------------------------------------------------------------
# Pure pieces (distill.py and tests import these)
# ---------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c pass: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021), the chance that k draws without replacement hold a pass."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def rouge(preds: list[str], refs: list[str]) -> dict[str, float]:
    """Mean ROUGE-1/2/L F1 of prediction/reference pairs (rouge-score, stemmed); NaN without pairs."""
    from rouge_score import rouge_scorer

    keys = ("rouge1", "rouge2", "rougeL")
    if len(preds) != len(refs):
        raise ValueError(f"{len(preds)} predictions for {len(refs)} references")
    if not preds:
        return dict.fromkeys(keys, math.nan)
    scorer = rouge_scorer.RougeScorer(list(keys), use_stemmer=True)
    scores = [scorer.score(r, p) for p, r in zip(preds, refs)]  # score(target, prediction)
    return {k: float(np.mean([s[k].fmeasure for s in scores])) for k in keys}


def error_counts(docs, summaries: list[str], scores: list[dict], cfg: Config) -> tuple[list[int], list]:
    """Unsupported claims per summary, and the oracle's error labels (None per
    summary without an oracle). On the news world (every document has a fact
    table) the oracle counts; otherwise the claims of `scores` (from
    `rewards.Scorer.score_batch`) that the backend scored below `cfg.claim_tau`."""
    if all(getattr(d, "facts", None) for d in docs):
        labelled = cfg.reward.factuality == "oracle"  # then score_batch's claims are the oracle's labels
        oracle = None if labelled else world.world("the oracle's error count")
        errors = [s["claims"] if labelled else oracle.errors(d, x) for d, x, s in zip(docs, summaries, scores)]
        return [len(e) for e in errors], errors
    counts = [len(unsupported_claims(s, cfg.claim_tau)) for s in scores]
    return counts, [None] * len(counts)


def unsupported_claims(score: dict, tau: float) -> list[str]:
    """The claims of a `rewards.score` result that its backend scored below `tau`."""
    return [c.get("claim", "") for c in score.get("claims") or [] if float(c.get("score", 1.0)) < tau]


def deleted_errors(doc, ep: sandbox.Episode, limits: dict | None = None) -> list[bool]:
    """For each delete of `ep` that retracted text: did that text hold an oracle error?

    The retracted text is the tail of the summary's last sentence at the time
    of the delete (the whole sentence, or its last clause). That summary is
    rebuilt by replaying the output up to the delete tag; the sentence is
    checked by the oracle, and the delete counts when an error span overlaps
    the retracted tail."""
    oracle = world.world("the audit of right deletes")
    out, before = [], ""
    for t in ep.turns:
        c = t.call
        if c is not None and c.kind == "delete" and c.deleted:
            summary = sandbox.replay(ep.document, before + t.text[:c.start], **(limits or {})).summary
            sentences = textsplit.split_sentences(summary)
            gone = " ".join(c.deleted.split())
            last = sentences[-1] if sentences else gone
            start = len(last) - len(gone) if last.endswith(gone) else 0
            spans = [(last.rfind(e["error_span"]), len(e["error_span"])) for e in oracle.errors(doc, last)]
            out.append(any(i >= 0 and i + n > start for i, n in spans))
        before += t.text + t.injected
    return out


def sentence_events(doc, ep: sandbox.Episode, limits: dict | None = None) -> list[dict]:
    """One record per summary sentence the policy wrote, retracted ones included,
    in the order written, with what the policy did right after it (news world):

    - `text`, `index` (its position in the summary), `wrong` (the oracle finds an error);
    - `searched`, `deleted`: a search / delete call followed it before the next sentence;
    - `found`: some search after it returned an article sentence that states the
      fact it is about (the world's `support`), None when it is about no fact;
    - `rewrite_wrong`: for a deleted sentence, whether the sentence written in its
      place is wrong (None when nothing was written there).

    A call belongs to the last sentence of the summary just before the call (the
    episode replayed up to the call); a delete retracts that sentence."""
    oracle = world.world("the per-sentence tool audit")
    events: list[dict] = []
    before = ""
    for t in ep.turns:
        c = t.call
        if c is not None:
            snapshot = textsplit.split_sentences(sandbox.replay(ep.document, before + t.text[:c.start],
                                                              **(limits or {})).summary)
            if snapshot:
                idx, text = len(snapshot) - 1, snapshot[-1]
                cur = events[-1] if events else None
                if cur is None or cur["deleted"] or (cur["index"], cur["text"]) != (idx, text):
                    cur = {"index": idx, "text": text, "searched": False, "deleted": False, "hits": []}
                    events.append(cur)
                if c.kind == "search" and c.valid:
                    cur["searched"] = True
                    cur["hits"] += c.hits or []
                elif c.kind == "delete" and c.valid and c.deleted:
                    cur["deleted"] = True
        before += t.text + t.injected
    final = textsplit.split_sentences(ep.summary)
    kept = {(e["index"], e["text"]) for e in events if not e["deleted"]}
    events += [{"index": i, "text": s, "searched": False, "deleted": False, "hits": []}
               for i, s in enumerate(final) if (i, s) not in kept]
    for e in events:
        e["wrong"] = bool(oracle.errors(doc, e["text"]))
        support = oracle.support(doc, e["text"])
        e["found"] = bool(set(support) & set(e["hits"])) if support and e["searched"] else None
    for k, e in enumerate(events):
        if e["deleted"]:
            nxt = next((x for x in events[k + 1:] if x["index"] == e["index"]), None)
            e["rewrite_wrong"] = None if nxt is None else nxt["wrong"]
    return events


def auc(scores_pos: Sequence[float], scores_neg: Sequence[float]) -> float:
    """P(a positive outscores a negative), ties counting half (the Mann-Whitney AUC); NaN if a side is empty."""
    if not scores_pos or not scores_neg:
        return math.nan
    neg = np.sort(np.asarray(scores_neg, dtype=float))
    below = np.searchsorted(neg, scores_pos, side="left")
    ties = np.searchsorted(neg, scores_pos, side="right") - below
    return float((below + 0.5 * ties).sum() / (len(scores_pos) * len(neg)))


def tool_decision(events: Sequence[dict]) -> dict[str, float]:
    """The tool decision over written sentences: search and delete rates after a
    wrong vs a right sentence, the AUC of the decision (0 nothing, 1 search only,
    2 delete) as a detector of wrong sentences, how often a search found the
    sentence stating the fact it checks, and evidence use: after such a search,
    how often the sentence written in place of a deleted one is right."""
    wrong = [e for e in events if e["wrong"]]
    right = [e for e in events if not e["wrong"]]
    score = lambda e: 2.0 if e["deleted"] else 1.0 if e["searched"] else 0.0  # noqa: E731
    used = [not e["rewrite_wrong"] for e in events
            if e["deleted"] and e["found"] and e.get("rewrite_wrong") is not None]
    return {
        "tool_auc": auc([score(e) for e in wrong], [score(e) for e in right]),
        "search_after_wrong": common.mean(e["searched"] for e in wrong),
        "search_after_right": common.mean(e["searched"] for e in right),
        "delete_after_wrong": common.mean(e["deleted"] for e in wrong),
        "delete_after_right": common.mean(e["deleted"] for e in right),
        "search_found_fact": common.mean(e["found"] for e in events if e["found"] is not None),
        "evidence_use": common.mean(used),
        "sentences_written": float(len(events)),
        "wrong_written": common.mean(e["wrong"] for e in events),
    }


def news_world_metrics(docs, eps: Sequence[sandbox.Episode], errors: Sequence[list], limits: dict | None = None
                       ) -> dict[str, float]:
    """The oracle's view of greedy episodes: fact precision (supported names,
    numbers and dates over those stated), the share of summaries stating none
    (`no_fact_rate`), key-fact coverage (the world's `key_fact_coverage`: the share of the
    reference's key facts a summary states right, averaged; whatever `reward.coverage`
    says), the tool decision (`tool_decision`),
    and fact precision and hallucination rate per event family (`fam_<family>_...`)."""
    oracle = world.world("the news-world metrics")
    stated = [oracle.stated_facts(d, e.summary) for d, e in zip(docs, eps)]
    out = {"fact_precision": common.mean(f["supported"] for fs in stated for f in fs),
           "facts_stated": common.mean(len(fs) for fs in stated),
           # a summary stating nothing has no wrong fact: precision must be read beside this share
           "no_fact_rate": common.mean(not fs for fs in stated),
           "key_fact_coverage": common.mean(oracle.key_fact_coverage(d, e.summary) for d, e in zip(docs, eps))}
    out.update(tool_decision([ev for d, e in zip(docs, eps) for ev in sentence_events(d, e, limits)]))
    for fam in sorted({d.bucket for d in docs}):
        idx = [i for i, d in enumerate(docs) if d.bucket == fam]
        out[f"fam_{fam}_fact_precision"] = common.mean(f["supported"] for i in idx for f in stated[i])
        out[f"fam_{fam}_hallucination"] = common.mean(bool(errors[i]) for i in idx)
    return out


# ---------------------------------------------------------------------------
# Oracle-free figures: text in, numbers out, for any article (real news included)
# ---------------------------------------------------------------------------

ORACLE_FREE = ("len_words", "copied_sentences", "single_copy_rate", "loop_rate", "limit_rate", "unsupported_numbers",
               "unsupported_fact_rate")  # the figures `greedy_eval` reports without a fact table
# Tool markup and what it encloses (a query, a results block), complete or cut off by the end of
# the text: none of it is prose the policy wrote.
TOOL_MARKUP = re.compile(r"<(search|results)\b[^<>]*>.*?(?:</\1\s*>|\Z)|</?\s*(?:search|results|delete|error)\b[^<>]*>",
                         re.S)


def normalise_sentence(sentence: str) -> str:
    """A sentence as the oracle-free figures compare it: case-folded, whitespace runs one space."""
    return " ".join(sentence.split()).casefold()


def copied_flags(article: str, summary: str) -> list[bool]:
    """For each sentence of `summary` (`textsplit.split_sentences`): does it stand verbatim in
    `article`? Both normalised (`normalise_sentence`), the sentence must occur in the article
    as a span that starts and ends on word boundaries ("evenue fell." is not a copy of
    "Revenue fell."). A verbatim tail of a longer article sentence counts as copied."""
    art = normalise_sentence(article)
    return [re.search(rf"(?<!\w){re.escape(normalise_sentence(s))}(?!\w)", art) is not None
            for s in textsplit.split_sentences(summary)]


def single_copy(article: str, summary: str) -> bool:
    """Is `summary` one article sentence copied whole: all its sentences the same normalised
    sentence (once, or repeated), and that sentence copied (`copied_flags`)? False when empty."""
    sentences = {normalise_sentence(s) for s in textsplit.split_sentences(summary)}
    return len(sentences) == 1 and all(copied_flags(article, summary))


def written_sentences(ep: sandbox.Episode) -> list[str]:
    """The sentences the policy wrote over all turns, in order, retracted ones included:
    each turn's text without its call and without any other tool markup (`TOOL_MARKUP`),
    split on its own (a call ends a turn, so no sentence runs across one)."""
    out = []
    for t in ep.turns:
        c = t.call
        prose = t.text[:c.start] + " " + t.text[c.end:] if c is not None else t.text
        out += textsplit.split_sentences(TOOL_MARKUP.sub(" ", prose))
    return out


def repeats_sentence(sentences: Sequence[str]) -> bool:
    """Does some normalised sentence come twice or more? Sentences without a word
    (stray punctuation) are left out."""
    keys = [normalise_sentence(s) for s in sentences if textsplit.words(s)]
    return len(set(keys)) < len(keys)


def loops(ep: sandbox.Episode) -> bool:
    """An episode loops when the same normalised sentence (`normalise_sentence`, sentences
    with at least one word) comes twice or more in its final summary, or in what it wrote
    over all turns, retracted text included (`written_sentences`). The second part catches
    the search loop: a sentence written, searched, and written again from the results, with
    or without a delete in between (writing the same sentence after deleting it changes
    nothing either). A deleted sentence rewritten differently is no loop."""
    return repeats_sentence(textsplit.split_sentences(ep.summary)) or repeats_sentence(written_sentences(ep))


def stated_numbers(article: str, summary: str, rel_tol: float = 0.05) -> list[tuple[str, bool]]:
    """(mention, supported) for each number `summary` states in digits (number words are left
    out): plain numbers with thousands commas and decimals, percentages, money, years, dates
    and times, parsed and normalised by `claims.numbers` ("4,200" = 4200, "12%" = "12 percent",
    "$4.2 billion" = 4,200,000,000). Supported when the article states the same value
    (`claims.num_sentences`: a bare article number supports money, "$4.2 billion" is backed by
    "4.2 billion"; a value rounded at the summary's stated precision and within `rel_tol` is
    the same value, as in the rewards' number rule)."""
    doc = claims.document_info(article)
    return [(n.text, bool(claims.num_sentences(doc, n, rel_tol)))
            for n in claims.numbers(summary) if any(ch.isdigit() for ch in n.text)]


def unsupported_names(article: str, summary: str) -> list[str]:
    """The names of `summary` the article lacks, as written in the summary. Names are
    `claims.summary_info`'s (runs of capitalised words, honorifics, months, weekdays and
    sentence-initial common words left out). Conservative: a lone capitalised word opening
    a sentence may be a plain word and is not judged; a name is unsupported when one of its
    capitalised words, possessive 's and trailing periods stripped and stopwords ("The")
    skipped, is not a case-sensitive substring of the article."""
    out = []
    for c in claims.summary_info(summary).claims:
        for name in c.names:
            if name.weak:
                continue
            span = c.text[name.start:name.end]
            words = [re.sub(r"['’]s$", "", w.rstrip(".")) for w in span.split()]
            if any(w[:1].isupper() and w.lower() not in claims.STOPWORDS and w not in article for w in words):
                out.append(span)
    return out


def oracle_free_metrics(articles: Sequence[str], episodes: Sequence[sandbox.Episode], rel_tol: float = 0.05
                        ) -> dict[str, float]:
    """Figures that need only the article text and the episodes (final summaries `ep.summary`):

    - `copied_sentences`: the share of summary sentences that stand verbatim in the article
      (`copied_flags`), pooled over the sentences of every summary;
    - `single_copy_rate`: the share of summaries that are one copied article sentence, once or
      repeated (`single_copy`);
    - `loop_rate`: the share of episodes that loop (`loops`: a sentence repeated in the summary,
      or written twice over the turns, retracted text included);
    - `limit_rate`: the share of episodes that ran to the token limit (`flags["truncated"]`);
    - `unsupported_numbers`: the share of the numbers stated in digits, pooled over every
      summary, whose value the article does not state (`stated_numbers`, within `rel_tol`);
    - `unsupported_fact_rate`: the share of summaries stating at least one unsupported number
      or one name the article lacks (`unsupported_names`).

    Every summary counts in the per-summary shares, an empty one included (it copies, loops
    and misstates nothing). NaN where there is nothing to count: no episodes, no summary
    sentence, no number stated."""
    if len(articles) != len(episodes):
        raise ValueError(f"{len(articles)} articles for {len(episodes)} episodes")
    summaries = [e.summary for e in episodes]
    numbers = [stated_numbers(a, s, rel_tol) for a, s in zip(articles, summaries)]
    return {
        "copied_sentences": common.mean(f for a, s in zip(articles, summaries) for f in copied_flags(a, s)),
        "single_copy_rate": common.mean(single_copy(a, s) for a, s in zip(articles, summaries)),
        "loop_rate": common.mean(loops(e) for e in episodes),
        "limit_rate": common.mean(bool(e.flags.get("truncated")) for e in episodes),
        "unsupported_numbers": common.mean(not ok for ns in numbers for _, ok in ns),
        "unsupported_fact_rate": common.mean(any(not ok for _, ok in ns) or bool(unsupported_names(a, s))
                                             for a, s, ns in zip(articles, summaries, numbers)),
    }


class TagBan:
    """`engine.rollout` logits processor that keeps banned tag openings out of the text.

    A token is banned when, appended to what the row has written, it would
    complete a banned opening (`<search`, `</search`, `<delete`) or extend a
    started one to two or more of its characters: so `<` alone may still be
    written, `<s` (in one token or two) may not, and neither may any token that
    carries the whole opening. That depends only on how much of the opening the
    text already ends with, so one vocabulary mask per (tag, progress) is
    computed once and reused."""

    def __init__(self, tokenizer, tags: Sequence[str]):
        self.codec = sandbox.Codec(tokenizer)
        self.n_tokens = len(tokenizer)
        self.tags = tuple(tags)
        self.tail_tokens = 2 * max((len(t) for t in self.tags), default=1)  # >= 1 character per token
        self._masks: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def banned(tag: str, written: str, piece: str) -> bool:
        """Would writing `piece` after `written` complete or extend an opening of `tag`?"""
        if not piece:
            return False
        text = written[-len(tag):] + piece
        if tag in text[max(0, len(text) - len(piece) - len(tag) + 1):]:
            return True
        return any(text.endswith(tag[:m]) for m in range(2, len(tag)))

    @staticmethod
    def progress(tag: str, text: str) -> int:
        """Length of the longest proper prefix of `tag` that `text` ends with."""
        return next((j for j in range(len(tag) - 1, 0, -1) if text.endswith(tag[:j])), 0)

    def mask(self, states: tuple[int, ...], vocab: int, device) -> torch.Tensor:
        key = (states, vocab)
        if key not in self._masks:
            m = torch.zeros(vocab, dtype=torch.bool)
            for tag, j in zip(self.tags, states):
                sub = (tag, j, vocab)
                if sub not in self._masks:
                    self._masks[sub] = torch.tensor([i < self.n_tokens and self.banned(tag, tag[:j], self.codec.piece(i))
                                                     for i in range(vocab)], dtype=torch.bool)
                m |= self._masks[sub]
            self._masks[key] = m
        return self._masks[key].to(device)

    def __call__(self, rows, logits: torch.Tensor) -> torch.Tensor:
        for i, row in enumerate(rows):
            tail = "".join(self.codec.piece(t) for t in row.builder.context_ids()[-self.tail_tokens:])
            states = tuple(self.progress(tag, tail) for tag in self.tags)
            logits[i, self.mask(states, logits.shape[-1], logits.device)] = -math.inf
        return logits


def tool_processor(tokenizer, tools: str) -> TagBan | None:
    """The decode-time ablation of `tools` (None when every tool is allowed)."""
    return TagBan(tokenizer, TOOLS_BANNED[tools]) if TOOLS_BANNED[tools] else None


# ---------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------


WARM_UP_TOKENS = 16  # the latency's untimed warm-up (a whole SFT summary: 7.9 s at batch 1, AVX2 kernels)


def decoding(tokenizer, cfg: Config) -> tuple[sandbox.Limits, engine.SamplingConfig, TagBan | None]:
    """What an evaluation decodes under: the sandbox limits, the greedy sampling
    settings and the decode-time tool ban (None when every tool is allowed)."""
    greedy = engine.SamplingConfig(temperature=0.0, max_new_tokens=cfg.max_new_tokens, batch_size=cfg.batch_size,
                                    seed=cfg.seed)
    return sandbox.Limits.make(**cfg.limits), greedy, tool_processor(tokenizer, cfg.tools)


def greedy_eval(model, tokenizer, documents, cfg: Config, generate=None,
                setup: tuple | None = None) -> tuple[dict, list, list, list]:
    """Greedy rollouts of `documents` and their figures, as (figures, episodes,
    scores, oracle errors or None per document): the held-out evaluation that
    sft.py and rl.py log during training, and the first part of `evaluate`.
    `generate(documents)`, if given, makes the episodes instead of the hf rollouts
    (rl.py: its own sampler, which may be vLLM, under its sampling settings).
    `setup` is `decoding(tokenizer, cfg)` when the caller already has it."""
    docs = list(documents)
    if not docs:
        raise ValueError("no documents to evaluate")
    if generate is not None:
        eps = generate(docs)
    else:
        limits, greedy, ban = setup or decoding(tokenizer, cfg)
        eps = engine.rollout(model, tokenizer, docs, 1, greedy, limits, logits_processor=ban, progress="greedy")
    news = all(getattr(d, "facts", None) for d in docs)
    out: dict[str, float] = {}
    scores = rewards.Scorer(cfg.reward).score_batch(list(zip(docs, eps)))
    pairs = [(e.summary, d.summary) for d, e in zip(docs, eps) if getattr(d, "summary", "")]
    out.update(rouge([p for p, _ in pairs], [r for _, r in pairs]))
    for k in ("factuality", "pass", "total", "rules", "rules_pass"):
        out[k] = common.mean(float(s[k]) for s in scores)
    out["coverage"] = common.mean(s.get("coverage") for s in scores)  # the reward's; NaN with reward.coverage off
    for k in scores[0]:
        if k.startswith("rule_") and k.endswith("_pass"):
            out[k] = common.mean(float(s[k]) for s in scores)
    counts, errors = error_counts(docs, [e.summary for e in eps], scores, cfg)
    out["hallucination_rate"] = common.mean(c > 0 for c in counts)
    out["errors_per_summary"] = common.mean(counts)
    ts = sandbox.tool_stats(eps)
    out.update(valid_call_rate=ts["valid_call_rate"], valid_episode_rate=ts["valid_episode_rate"],
               searches=ts["searches_per_episode"], deletes=ts["deletes_per_episode"])
    hits = [h for d, e in zip(docs, eps) for h in deleted_errors(d, e, cfg.limits)] if news else []
    out["deletes_removing_error"] = common.mean(hits)
    if news:
        out.update(news_world_metrics(docs, eps, errors, cfg.limits))
    out["tau"] = float(scores[0]["tau"])
    out["news_world"] = float(news)
    # generated, all turns; NaN for text-only episodes (replayed text: nothing decoded, no token ids)
    out["len_tokens"] = common.mean(sum(len(t.ids) for t in e.turns) if all(t.ids is not None for t in e.turns)
                                    else None for e in eps)
    out["len_words"] = common.mean(len(e.summary.split()) for e in eps)  # of the final summary
    out["emission"] = common.mean(bool(e.summary.strip()) and not e.flags.get("truncated") for e in eps)
    out.update(oracle_free_metrics([claims.text_of(d) for d in docs], eps, cfg.reward.rules.number_rel_tolerance))
    return out, eps, scores, errors


SHOWN = ("loss", "total", "pass", "factuality", "fact_precision", "hallucination_rate", "tool_auc", "searches",
         "deletes", "valid_call_rate", "len_tokens")  # the figures a training run prints at each evaluation


def log_eval(run, step: int, figures: dict) -> None:
    """A training run's held-out figures: all of them to metrics.jsonl and the trackers, those in SHOWN printed."""
    run.metrics.write(step=step, **figures)
    run.track(step, figures)
    shown = {k: v for k, v in figures.items() if k.removeprefix("eval_") in SHOWN}
    print(f"eval step {step}: " + " | ".join(f"{k} {v:.4g}" for k, v in shown.items()), flush=True)


def evaluate(model, tokenizer, documents, cfg: Config, keep: list | None = None) -> dict:
    """Every metric of one model on `documents`, as a flat dict of floats (NaN
    where not computable). `keep`, if given, receives (document, greedy episode,
    score, oracle errors or None) per document, for samples and inspection.

    Per model (greedy decoding, temperature 0, unless stated):
    - ROUGE-1/2/L F1 against the reference summary (rouge-score, Porter stemmer).
    - Factuality F from `reward.factuality` (oracle | lexical | fenice, named as
      `rewards.BACKEND_NAMES` does), each rule's pass rate, pass (F >= tau and every
      rule; tau is the curriculum's first, so runs compare), mean total reward.
      `coverage`: the reward's key-fact coverage (the factor of F under
      `reward.coverage`), NaN when the reward does not count it.
    - News world (documents with a fact table): `fact_precision` and `no_fact_rate`,
      and `key_fact_coverage`, the share of the reference's key facts a summary states
      right by the oracle, whatever the reward counts (`news_world_metrics`).
    - Hallucination: a summary hallucinates when it makes at least one unsupported
      claim. On the news world (documents with a fact table) the oracle decides,
      whatever the reward backend: one error = one `oracle.oracle_errors` label (a
      wrong entity, number, date, polarity or predicate, or a sentence no fact
      supports). Elsewhere a claim is unsupported when the backend scores it below
      `claim_tau` (lexical: summary sentences; FENICE: extracted claims), so the
      rate depends on the backend and the report says which one counted.
    - Tool use: valid call rate (syntax), valid episode rate, searches and deletes
      per summary, and (news world) the share of deletes whose retracted text held
      an oracle error: the precision of the delete decision.
    - Without a fact table (any article, real news included; `oracle_free_metrics`
      defines each): `len_words` of the final summary, `copied_sentences` (the share of
      summary sentences verbatim in the article), `single_copy_rate` (summaries that are one
      copied sentence), `loop_rate` (a sentence repeated in the summary or written twice over
      the turns), `limit_rate` (episodes that ran to the token limit), `unsupported_numbers`
      (the share of numbers stated in digits whose value the article lacks) and
      `unsupported_fact_rate` (summaries with an unsupported number or name).
    - pass@k, k in 1, 2, 4, 8: the unbiased estimator 1 - C(n-c, k) / C(n, k) of
      Chen et al. (2021) from `n_samples` rollouts per document at `temperature`,
      averaged over documents. k > n is not estimable and reported as n/a.
    - Latency per summary (p50, p95, ms): wall clock of one document's whole
      episode (tools included) at batch 1, over `latency_docs` documents, after one
      short untimed warm-up; tokens/s over the same episodes.
    Metrics that cannot be computed (no calls, no oracle, no references) are NaN:
    null in eval.json, "n/a" in the report.
    """
    docs = list(documents)
    setup = decoding(tokenizer, cfg)  # one tool ban (and its mask cache) for every pass below
    limits, greedy, ban = setup
    out, eps, scores, errors = greedy_eval(model, tokenizer, docs, cfg, setup=setup)

    # -- sampled: pass@k ------------------------------------------------------
    n = cfg.n_samples
    sampled = dataclasses.replace(greedy, temperature=cfg.temperature)
    gen = engine.make_generator(cfg.seed, model)  # the same draws for every model compared
    s_eps = engine.rollout(model, tokenizer, docs, n, sampled, limits, logits_processor=ban, generator=gen,
                           progress=f"samples x{n}") if n else []
    s_scores = rewards.Scorer(cfg.reward).score_batch(list(zip([d for d in docs for _ in range(n)], s_eps)))
    passed = [sum(bool(s["pass"]) for s in s_scores[i * n:(i + 1) * n]) for i in range(len(docs))] if n else []
    for k in KS:
        out[f"pass_at_{k}"] = common.mean(pass_at_k(n, c, k) for c in passed) if k <= n else math.nan
    out["pass_sampled"] = common.mean(float(s["pass"]) for s in s_scores)

    # -- latency at batch 1 -----------------------------------------------------
    one = dataclasses.replace(greedy, batch_size=1)
    lat_docs = docs[:cfg.latency_docs]
    times, tokens = [], 0
    if lat_docs:  # the warm-up: kernels loaded, nothing timed
        warm = dataclasses.replace(one, max_new_tokens=min(WARM_UP_TOKENS, one.max_new_tokens))
        engine.rollout(model, tokenizer, lat_docs[:1], 1, warm, limits, logits_processor=ban)
    for d in tqdm(lat_docs, desc="latency", unit="doc", leave=False):
        t0 = time.perf_counter()
        (ep,) = engine.rollout(model, tokenizer, [d], 1, one, limits, logits_processor=ban)
        times.append(time.perf_counter() - t0)
        tokens += sum(len(t.ids) for t in ep.turns)
    out["latency_p50_ms"] = float(np.percentile(times, 50) * 1e3) if times else math.nan
    out["latency_p95_ms"] = float(np.percentile(times, 95) * 1e3) if times else math.nan
    out["tok_s"] = tokens / sum(times) if times else math.nan
    out["n_docs"] = float(len(docs))

    if keep is not None:
        keep += list(zip(docs, eps, scores, errors))
    return out


def missing_model_hint(path: str) -> str:
    rl = any(part.startswith("rl") for part in Path(path).parts)
    how = "python rl.py --config configs/tiny.yaml" if rl else "python sft.py --config configs/sft_tiny.yaml"
    return (f"model directory {path} does not exist: train it first, e.g. `{how}` (SFT runs save "
            "full weights in runs/NAME/final, RL runs an adapter)")


def load_model(path: str, cfg: Config):
    if not Path(path).is_dir():
        raise SystemExit(missing_model_hint(path))
    model, tok = modeling.load_policy(modeling.trained_model_config(path, cfg.base), train=False)
    model.eval()
    return model, tok


def evaluate_dir(path: str, documents, cfg: Config, keep: list | None = None,
                 traces: Sequence[sandbox.Episode] = ()) -> dict:
    """Load a trained directory (`modeling.trained_model_config`, eval mode) and `evaluate` it;
    with `traces`, its `decision_probe` on them too."""
    model, tok = load_model(path, cfg)
    dev = next(model.parameters()).device.type
    print(f"{path}: {common.choose_autocast(cfg.autocast, dev, common.hidden_size(model))[1]}")
    with common.autocast_for(cfg.autocast, model):
        out = evaluate(model, tok, documents, cfg, keep)
        return {**out, **decision_probe(model, tok, traces)} if traces else out


# ---------------------------------------------------------------------------
# Copying baselines: rows no model writes
# ---------------------------------------------------------------------------


def lead_3_text(doc, cfg: Config) -> str:
    """lead-3: the article's first three sentences (`textsplit.lead`), from the text alone,
    so any article has it, real news included."""
    return textsplit.lead(doc.text, 3)


def best_extract_text(doc, cfg: Config) -> str:
    """best-extract: the set of at most three whole article sentences within the eval's word
    budget (`reward.rules.max_words`) whose key-fact coverage is highest, chosen with the
    oracle's knowledge of the key facts (the world's `best_extract`). Needs the news
    world's fact table: a document without one is a `data.DataError` naming it."""
    if not getattr(doc, "facts", None):
        raise data.DataError(
            f"the baseline best-extract picks the sentences that state the key facts of a news world fact table "
            f"(within reward.rules.max_words={cfg.reward.rules.max_words} words); document "
            f"{getattr(doc, 'id', '?')!r} of {cfg.docs} has none: leave best-extract out of --compare "
            "(lead-3 needs only the text)")
    return world.world("the best-extract baseline").best_extract(doc, cfg.reward.rules.max_words)


# The copying baselines eval.py evaluates as rows beside the models: name -> function(document,
# eval Config) -> the summary text. A name here is reserved: in `--compare` (or `model=`) it means
# the baseline, even where a directory of that name exists. Its episodes are the text run
# through the sandbox (`baseline_episodes`); no model is loaded.
BASELINES: dict[str, Callable[[Any, Config], str]] = {"lead-3": lead_3_text, "best-extract": best_extract_text}
# What only decoding measures: NaN for a baseline
NOT_DECODED = (*(f"pass_at_{k}" for k in KS), "pass_sampled", "latency_p50_ms", "latency_p95_ms", "tok_s")


def baseline_episodes(name: str, documents, cfg: Config) -> list[sandbox.Episode]:
    """One text-only episode per document: baseline `name`'s text (`BASELINES`) replayed
    through the sandbox under the eval's limits, `doc_id` set. A `data.DataError` when the
    baseline cannot serve a document (best-extract without a fact table)."""
    out = []
    for d in documents:
        ep = sandbox.replay(d.text, BASELINES[name](d, cfg), **cfg.limits)
        ep.doc_id = d.id
        out.append(ep)
    return out


def evaluate_baseline(name: str, documents, cfg: Config, keep: list | None = None,
                      episodes: Sequence[sandbox.Episode] | None = None) -> dict:
    """`evaluate`'s figures for copying baseline `name` (`BASELINES`): its episodes
    (`baseline_episodes`, or `episodes` when the caller made them) scored by `greedy_eval`
    as a model's greedy episodes are, so every figure means what it means for a model.
    Nothing decodes: pass@k, the sampled pass, latency, tok/s (`NOT_DECODED`) and
    `len_tokens` are NaN. No model is loaded; `keep` as in `evaluate`."""
    docs = list(documents)
    made = list(episodes) if episodes is not None else baseline_episodes(name, docs, cfg)
    out, eps, scores, errors = greedy_eval(None, None, docs, cfg, generate=lambda _: made)
    out.update(dict.fromkeys(NOT_DECODED, math.nan), n_docs=float(len(docs)))
    if keep is not None:
        keep += list(zip(docs, eps, scores, errors))
    return out


DELETE_CALL = '<delete scope="sentence"/>'


def decision_probe(model, tok, traces: Sequence[sandbox.Episode]) -> dict[str, float]:
    """The delete decision teacher-forced on traces: after every search that another turn
    follows, log P(DELETE_CALL) under the context the trace gives (its canonical
    tokenisation, as SFT trains on it), and that score's AUC as a detector of the searches
    the trace deletes after (in a filtered corpus, its wrong sentences). It isolates the
    decision from the policy's own writing: near 0.5 here, the policy cannot tell a wrong
    sentence from a right one even on the traces' own; high here and low in `tool_auc`,
    it can but its rollouts do not act on it."""
    call = sandbox.as_codec(tok).encode(DELETE_CALL)
    dev = next(model.parameters()).device
    wrong, right = [], []
    with torch.no_grad():
        for ep in tqdm(traces, desc="decision probe", unit="trace", leave=False):
            te = ep.tokenized(tok)
            for ctx, nxt, decides in zip(te.contexts(), te.turns, sandbox.decision_turns(te)):
                if not decides:
                    continue
                ids = torch.tensor([ctx + call], device=dev)
                logp = torch.log_softmax(model(ids).logits[0, len(ctx) - 1:-1].float(), -1)
                score = logp.gather(1, ids[0, len(ctx):, None]).sum().item()
                deletes = nxt.call is not None and nxt.call.kind == "delete" and not nxt.text[:nxt.call.start].strip()
                (wrong if deletes else right).append(score)
    return {"decision_probe_auc": auc(wrong, right), "decision_probe_deletes": len(wrong),
            "decision_probe_keeps": len(right), "decision_probe_after_wrong": common.mean(wrong),
            "decision_probe_after_right": common.mean(right)}


def load_decision_traces(cfg: Config) -> list[sandbox.Episode]:
    """The first `decision_traces` traces of `decision_corpus` (none when it is unset)."""
    if not cfg.decision_corpus:
        return []
    if not Path(cfg.decision_corpus).exists():
        raise SystemExit(f"decision_corpus={cfg.decision_corpus}: no such file (a trace corpus, written by "
                         "`python filter_traces.py --config configs/filter_smollm.yaml`: out/corpus/smollm/train.jsonl)")
    try:
        return sandbox.read_episodes(cfg.decision_corpus)[:cfg.decision_traces]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


def load_eval_documents(cfg: Config) -> list:
    """The held-out documents: the `pool` of the split manifest, in the docs
    file's order, the first `n_docs`; every one checked against the manifest's
    content hash (a changed document is not the one the split froze)."""
    if not Path(cfg.docs).exists():
        raise SystemExit(f"docs={cfg.docs}: no such file (write it with `python synth_traces.py --config "
                         f"configs/synth_newsworld.yaml`, or `python -m newsworld generate --n 1000 --seed 0 "
                         f"--out {cfg.docs}`)")
    docs = data.read_documents(cfg.docs)
    if not cfg.split:
        return docs[:cfg.n_docs]
    if not Path(cfg.split).exists():
        raise SystemExit(f"split={cfg.split}: no such file (make it with `python data.py split --docs {cfg.docs} "
                         f"--out {cfg.split}`, or set split='' to use every document)")
    try:
        held = data.pool_documents(docs, data.read_manifest(cfg.split), cfg.pool, cfg.split)[:cfg.n_docs]
    except (data.DataError, data.LeakError) as e:
        raise SystemExit(f"error: {e}") from None
    if not held:
        raise SystemExit(f"no document of {cfg.docs} is in the {cfg.pool!r} pool of {cfg.split}: "
                         "a split of other documents?")
    return held
