"""Quality gates for synthetic traces, and the training corpus they leave.

    python filter_traces.py --config configs/filter_newsworld.yaml

Each trace is dropped by the first of nine gates it fails (listed in `main`),
and the reason is counted. Then: funnel.json and a printed table, and a spot check of `spot_check.n`
traces per `spot_check.per_traces` (seeded) as a self-contained HTML viewer
and a CSV to mark by hand. On the news world the oracle marks the sample (and
the whole corpus) and the noise rate is reported (the target: <= 5%).

Relevance: a rule "top-1 BM25 < 0.3 cosine" cannot be applied as written (BM25
scores are not cosines), so relevance is a TF-IDF cosine between the top result
and the correction. The factuality gain is scored by a configurable backend: the
CPU default is the lexical scorer (named as such in the funnel), the news world's
is its oracle.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import random
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from tqdm import tqdm

import data
import rewards
import sandbox
from factual_tools import common, modeling, settings, textsplit
from factual_tools.teachers import body, correction_steps, oracle_flags
from factual_tools.traces import read_traces, tfidf_for
from factual_tools.traces import render_html, shape, trace_id


@dataclass
class SplitConfig:
    manifest_path: str = "out/newsworld/split.json"  # frozen on first use, checked on every later run
    fractions: list[float] = field(default_factory=lambda: [0.8, 0.1, 0.1])  # train, eval, never-touch
    seed: int = 0
    threshold: float = 0.25  # Jaccard at which two documents share a leak cluster


@dataclass
class SpotCheckConfig:
    n: int = 100  # traces sampled per `per_traces` kept (at least one batch)
    per_traces: int = 5000
    seed: int = 0


@dataclass
class Config:
    name: str = "filter"  # run name: runs/NAME/ holds the resolved config, git revision and metrics
    runs_dir: str = "runs"
    traces: list[str] = field(default_factory=lambda: ["out/traces/newsworld.jsonl"])  # Episode JSONL inputs
    docs_path: str = "out/newsworld/docs.jsonl"  # their documents (split, oracle)
    out_dir: str = "out/corpus/newsworld"  # train.jsonl, eval.jsonl, funnel.json, spot_check.html/.csv
    tokenizer: str = "tiny-1m"  # the policy's tokenizer (HF id, path or tiny preset): budgets are in its tokens
    judge_min: float | None = None  # drop traces whose judge score is below this (None: no judge gate)
    max_deletes: int = 5
    max_tokens: int = 2048  # the trainer's sequence budget
    relevance_min: float = 0.3  # TF-IDF cosine of top result and correction
    factuality: rewards.Backend = "lexical"  # scorer of the gain (lexical sees the drafter's in-document swaps; support does not)
    gain_min: float = 0.05
    result_tokens: int = 200  # policy tokens per results block
    limits: dict[str, int] = field(default_factory=dict)  # other sandbox limits of the replay (as the synth run's)
    dedup_threshold: float = 0.9  # Jaccard of word shingles
    dedup_num_perm: int = 128  # MinHash permutations
    dedup_shingle: int = 3  # words per shingle
    keep_per_doc: int = 2  # traces kept per document by the ranking
    split: SplitConfig = field(default_factory=SplitConfig)
    spot_check: SpotCheckConfig = field(default_factory=SpotCheckConfig)

    def __post_init__(self):
        rewards.check_backend(self.factuality, "factuality")


# ---------------------------------------------------------------------------
# Gates (pure functions, one trace at a time)
# ---------------------------------------------------------------------------


def trace_tokens(ep: sandbox.Episode, tokenizer, prompt_len: int | None = None) -> int:
    """Prompt + every turn's text + every injected block + end-of-turn, in policy tokens."""
    n = prompt_len if prompt_len is not None else len(sandbox.prompt_ids(tokenizer, ep.document))
    enc = lambda s: len(tokenizer.encode(s, add_special_tokens=False)) if s else 0  # noqa: E731
    return n + sum(enc(t.text) + enc(t.injected) for t in ep.turns) + 1


def format_problem(ep: sandbox.Episode, max_deletes: int = 5, n_tokens: int | None = None,
                   max_tokens: int | None = None) -> str | None:
    """The first of the five hard rejects a trace fails, or None."""
    for t in ep.turns:  # (1) every search answered by its results
        c = t.call
        if c and c.kind == "search" and c.valid and (not t.injected.startswith("<results>") or c.error):
            return f"search not answered with results ({c.error or 'no results block'})"
    if ep.n_delete > max_deletes or ep.flags.get("delete_cap") or ep.flags.get("tool_cap"):  # (2)
        return f"more than {max_deletes} deletes or a tool cap hit"
    bad = next((c for c in ep.calls if not c.valid), None)  # (3) parseable tags and scopes
    if bad:
        return f"malformed {bad.kind} call ({bad.error})"
    if ep.flags.get("junk") or ep.flags.get("dangling"):
        return "stray or dangling tool markup"
    if ep.flags.get("truncated"):
        return "truncated"
    if any(c.kind == "delete" and c.error for c in ep.calls):
        return "delete with nothing to delete"
    if n_tokens is not None and max_tokens is not None and n_tokens > max_tokens:  # (4)
        return f"over the token budget ({n_tokens} > {max_tokens})"
    if not ep.summary.strip():  # (5)
        return "empty final summary"
    live = [t for t in ep.turns if t.text.strip() or t.call]
    last = live[-1] if live else None
    if last is not None and last.call is not None and last.call.kind == "search" \
            and not last.text[last.call.end:].strip():
        return "ends on a search (a dangling tool call)"
    return None


def relevance(ep: sandbox.Episode) -> float | None:
    """How well the evidence supports the corrections: the minimum over corrections
    of the best TF-IDF cosine between a search's top-1 result and the corrected
    sentence (0 when no search before the delete found anything). None when the
    trace corrects nothing (a retraction with no rewrite is not scored).

    Why TF-IDF cosine, with IDF from the document's own sentences: a correction
    is checkable when the result carries its rare words, the names, numbers and
    dates that distinguish one sentence of the article from another. Words that
    occur in every sentence (function words, the company's name in a company
    story) weigh little, so a result that merely shares them scores low, while a
    paraphrase that carries the corrected value scores high."""
    steps, _ = correction_steps(ep)
    sims = []
    for st in steps:
        if not st["corrected"]:
            continue
        best = 0.0
        for k in st["searches"]:
            hits = ep.turns[k].call.hits or []
            if hits:
                top = sandbox.index_for(ep.document).sentences[hits[0]]
                best = max(best, tfidf_for(ep.document).cosine(top, st["corrected"]))
        sims.append(best)
    return min(sims) if sims else None


def uncorrected_draft(ep: sandbox.Episode) -> str:
    """The draft before any correction: synth stores it; otherwise the written
    text with each delete undone and the sentence written right after it (the
    correction) left out."""
    if ep.meta.get("draft") is not None:
        return ep.meta["draft"]
    parts, skip = [], False
    for t in ep.turns:
        b = body(t)
        if skip and b.strip():
            b = " ".join(textsplit.split_sentences(b)[1:])
            skip = False
        parts.append(b)
        if t.call and t.call.kind == "delete" and t.call.deleted:
            skip = True
    return " ".join(" ".join(parts).split())


def factuality(doc: data.Document | str, summary: str, backend: str = "lexical") -> float:
    """F in [0, 1] from a reward backend: lexical, support or learned (model-free),
    the news world's oracle (`oracle.oracle_fact_score`), or FENICE."""
    return rewards.factuality_batch([(doc, summary)], rewards.RewardConfig(factuality=backend))[0]


def refit_results(ep: sandbox.Episode, length_fn: Callable[[str], int], result_tokens: int,
                  max_deletes: int = 5, limits: dict | None = None) -> tuple[sandbox.Episode, int]:
    """The trace replayed with the policy's length function, and how many results blocks changed."""
    new = sandbox.replay(ep.document, ep.text, length_fn=length_fn,
                         **{**(limits or {}), "result_tokens": result_tokens, "max_deletes": max_deletes})
    new.doc_id, new.meta = ep.doc_id, ep.meta
    changed = sum(a.injected != b.injected for a, b in zip(ep.turns, new.turns))
    return new, changed


def written(ep: sandbox.Episode) -> str:
    return "".join(t.text for t in ep.turns)


# A corpus whose decision after a search follows from the position, corrected at a
# first check and kept at a check of a rewrite, teaches a policy to delete the first time
# and keep the second without reading the result. Past this gain over one answer for
# every check (with at least SHORTCUT_MIN checks of each kind), the filter warns.
SHORTCUT_GAIN, SHORTCUT_MIN = 0.2, 5


def check_balance(eps: Sequence[sandbox.Episode]) -> dict:
    """The corpus's checks: searches, those a delete follows at once (corrections)
    and those the summary goes on after (search-only: the claim held), and the
    search-only share. A policy learns when not to delete from the second kind.

    Checks of a rewrite (the one sentence written right after a delete) are counted
    apart from first checks. `position_predicts` is the share of decisions that the
    check's kind alone gets right (the majority decision of each kind), against
    `majority_predicts`, one decision for all; `shortcut` when the kind adds at least
    SHORTCUT_GAIN."""
    counts = Counter()  # (recheck, corrected) -> checks
    for ep in eps:
        prev = None
        for t, nxt in zip(ep.turns, ep.turns[1:] + [None]):
            if t.call is not None and t.call.kind == "search":
                recheck = (prev is not None and prev.kind == "delete"
                           and len(textsplit.split_sentences(t.text[:t.call.start])) == 1)
                corrected = bool(nxt is not None and nxt.call is not None and nxt.call.kind == "delete"
                                 and not nxt.text[:nxt.call.start].strip())
                counts[recheck, corrected] += 1
            prev = t.call if t.call is not None else prev
    searches = sum(counts.values())
    corrections = counts[False, True] + counts[True, True]
    share = (lambda n: round(n / searches, 4) if searches else 0.0)
    by_kind = share(sum(max(counts[r, True], counts[r, False]) for r in (False, True)))
    majority = share(max(corrections, searches - corrections))
    first, rechecks = counts[False, True] + counts[False, False], counts[True, True] + counts[True, False]
    return {"searches": searches, "corrections": corrections, "search_only": searches - corrections,
            "search_only_share": share(searches - corrections),
            "first_checks": first, "first_corrected": counts[False, True],
            "rechecks": rechecks, "rechecks_corrected": counts[True, True],
            "position_predicts": by_kind, "majority_predicts": majority,
            "shortcut": min(first, rechecks) >= SHORTCUT_MIN and by_kind - majority >= SHORTCUT_GAIN}


def signals(ep: sandbox.Episode) -> dict:
    steps, _ = correction_steps(ep)
    calls = [(c.kind, c.arg) for c in ep.calls]
    return {"searched_deletes": all(st["searches"] for st in steps),
            "repeats": sum(a == b for a, b in zip(calls, calls[1:])),
            "depth": len(calls),
            "distinct_queries": len({c.arg for c in ep.calls if c.kind == "search"})}


def rank_key(ep: sandbox.Episode) -> tuple:
    s = signals(ep)
    return (s["searched_deletes"], -s["repeats"], s["depth"], s["distinct_queries"])


def select_per_doc(eps: Sequence[sandbox.Episode], keep: int) -> list[sandbox.Episode]:
    """The best `keep` traces by `rank_key`; among equals, a shape not yet kept first."""
    pool = sorted(eps, key=lambda e: (rank_key(e), trace_id(e)), reverse=True)
    chosen: list[sandbox.Episode] = []
    while pool and len(chosen) < keep:
        shapes = {shape(e) for e in chosen}
        best = max(pool, key=lambda e: (rank_key(e), shape(e) not in shapes))
        chosen.append(best)
        pool.remove(best)
    return chosen


def shingles(text: str, n: int) -> set[str]:
    w = textsplit.words(text)
    return {" ".join(w[i:i + n]) for i in range(max(1, len(w) - n + 1))}


def dedup(eps: Sequence[sandbox.Episode], threshold: float = 0.9, num_perm: int = 128, shingle: int = 3
          ) -> tuple[list[sandbox.Episode], dict[str, str]]:
    """Keep the first of each group of near-duplicates (pass them best first).
    Returns (kept, {dropped id: id of the trace it duplicates})."""
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
    sketches, kept, dropped = {}, [], {}
    for k, ep in enumerate(eps):
        mh = MinHash(num_perm=num_perm, seed=1)
        mh.update_batch([s.encode("utf-8") for s in sorted(shingles(written(ep), shingle))])
        dup = next((o for o in sorted(lsh.query(mh)) if mh.jaccard(sketches[o]) >= threshold), None)
        if dup is not None:
            dropped[trace_id(ep)] = dup
            continue
        key = f"{trace_id(ep)}@{k}"  # ids should be unique; the position keeps LSH keys unique regardless
        lsh.insert(key, mh)
        sketches[key] = mh
        kept.append(ep)
    return kept, {k: v.rsplit("@", 1)[0] for k, v in dropped.items()}


def oracle_noise(doc: data.Document, ep: sandbox.Episode) -> list[str]:
    """Why a news world trace is noise by its oracle ([] when clean): the final
    summary still has an error (left, or introduced by a correction), a delete
    retracted a right sentence, or a search-only check followed a wrong one."""
    reasons = []
    steps, only = correction_steps(ep)
    final = textsplit.split_sentences(ep.summary)
    fixes = {" ".join(st["corrected"].split()) for st in steps if st["corrected"]}
    for sent, bad in zip(final, oracle_flags(doc, final)):
        if bad:
            reasons.append("a correction introduced an error" if " ".join(sent.split()) in fixes
                           else "an error is left in the summary")
    deleted = [st["deleted"] for st in steps if st["deleted"]]
    if deleted and not all(oracle_flags(doc, deleted)):
        reasons.append("a delete retracted a right sentence")
    before = [(textsplit.split_sentences(body(ep.turns[k])) or [""])[-1] for k in only]
    before = [s for s in before if s]
    if before and any(oracle_flags(doc, before)):
        reasons.append("a search-only check followed a wrong sentence")
    return sorted(set(reasons))


def drafter_disagrees(ep: sandbox.Episode) -> list[str]:
    """An independent check on the news world, against the drafter's exact labels
    (it knows which sentences it broke): a broken sentence is still in the final
    summary verbatim, or a sentence it did not break was deleted."""
    labels = ep.meta.get("drafter_labels")
    if labels is None:
        return []
    norm = lambda s: " ".join(s.split())  # noqa: E731
    draft = [norm(s) for s in textsplit.split_sentences(ep.meta.get("draft") or "")]
    broken = {draft[lab["sentence_index"]] for lab in labels if lab["sentence_index"] < len(draft)}
    reasons = []
    if broken & {norm(s) for s in textsplit.split_sentences(ep.summary)}:
        reasons.append("a sentence the drafter broke is kept")
    if any(norm(st["deleted"]) not in broken for st in correction_steps(ep)[0] if st["deleted"]):
        reasons.append("a sentence the drafter did not break was deleted")
    return reasons


# ---------------------------------------------------------------------------
# Reports: funnel table, spot-check viewer and CSV
# ---------------------------------------------------------------------------


class Funnel:
    def __init__(self, n: int):
        self.rows: list[dict] = []
        self.n = n

    def gate(self, name: str, eps: list, keep: Callable[[sandbox.Episode], str | None]) -> list:
        """Apply a gate: `keep(ep)` returns a drop reason or None."""
        out, reasons = [], Counter()
        for ep in tqdm(eps, desc=name, unit="trace", leave=False, file=sys.stderr, mininterval=1.0):
            why = keep(ep)
            if why is None:
                out.append(ep)
            else:
                reasons[why] += 1
        return self.record(name, len(eps), out, reasons)

    def record(self, name: str, n_in: int, out: list, reasons: Counter, **extra) -> list:
        self.rows.append({"gate": name, "in": n_in, "out": len(out), "dropped": n_in - len(out),
                          "reasons": dict(reasons.most_common()), **extra})
        return out

    def table(self) -> str:
        lines = [f"{'gate':<16}{'in':>8}{'out':>8}{'dropped':>9}  reasons"]
        for r in self.rows:
            why = "; ".join(f"{k} {v}" for k, v in list(r["reasons"].items())[:4])
            lines.append(f"{r['gate']:<16}{r['in']:>8}{r['out']:>8}{r['dropped']:>9}  {why}")
        return "\n".join(lines)


def _generalise(reason: str) -> str:
    """A reason without its particulars ("over the token budget (2100 > 2048)"), so the funnel groups them."""
    return reason.split(" (")[0]


CSV_FIELDS = ["n", "trace_id", "doc_id", "kind", "n_search", "n_delete", "judge", "summary", "draft",
              "oracle_noise", "oracle_reasons", "verdict", "notes"]


def render_csv(samples: Sequence[tuple[sandbox.Episode, list[str] | None]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for k, (ep, noise) in enumerate(samples, 1):
        w.writerow({"n": k, "trace_id": trace_id(ep), "doc_id": ep.doc_id, "kind": ep.meta.get("trace_kind", ""),
                    "n_search": ep.n_search, "n_delete": ep.n_delete,
                    "judge": (ep.meta.get("judge") or {}).get("score"), "summary": ep.summary,
                    "draft": ep.meta.get("draft", ""), "oracle_noise": "" if noise is None else int(bool(noise)),
                    "oracle_reasons": "; ".join(noise or []), "verdict": "", "notes": ""})
    return buf.getvalue()


# ---------------------------------------------------------------------------
# Split
# ---------------------------------------------------------------------------


def load_manifest(cfg: SplitConfig, docs: Sequence[data.Document]) -> dict:
    """The frozen split: made (and written) on first use, checked against the documents after."""
    if os.path.exists(cfg.manifest_path):
        with open(cfg.manifest_path, encoding="utf-8") as f:
            manifest = json.load(f)
        data.check_split(manifest, docs)
        return manifest
    manifest = data.make_split(docs, tuple(cfg.fractions), seed=cfg.seed, threshold=cfg.threshold)
    data.check_split(manifest, docs)
    common.atomic_write_text(cfg.manifest_path, json.dumps(manifest, indent=1) + "\n")
    print(f"split: {manifest['counts']} in {manifest['clusters']} clusters, frozen -> {cfg.manifest_path}",
          file=sys.stderr)
    return manifest


def pool_of(manifest: dict) -> dict[str, str]:
    return {e["id"]: p for p in data.POOLS for e in manifest["pools"][p]}


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def load_inputs(cfg: Config) -> tuple[list[sandbox.Episode], dict[str, data.Document], Any]:
    """(the traces of every file, the documents by id, the policy tokenizer); a missing file is an error."""
    for path in [*cfg.traces, cfg.docs_path]:
        if not os.path.exists(path):
            raise data.DataError(f"{path} does not exist (make it with synth_traces.py first)")
    eps = [ep for path in cfg.traces for ep in read_traces(path)]
    docs = {d.id: d for d in data.read_documents(cfg.docs_path)}
    print(f"filter: {len(eps)} traces from {len(cfg.traces)} file(s), {len(docs)} documents", flush=True)
    return eps, docs, modeling.load_tokenizer(cfg.tokenizer)


def gate_inputs(cfg: Config, funnel: Funnel, eps: list, docs: dict) -> list[sandbox.Episode]:
    """Gates 1-2: the trace's document is known and unchanged, the teacher's answer was valid, the
    judge's score reaches `judge_min`."""
    def known(ep):
        d = docs.get(ep.doc_id)
        if d is None:
            return "document not in docs_path"
        return None if d.text == ep.document else "document text differs from docs_path"

    eps = funnel.gate("documents", eps, known)
    eps = funnel.gate("annotation", eps, lambda ep: "teacher answer rejected: " + _generalise(
        ep.meta["annotation_error"]) if ep.meta.get("annotation_error") else None)
    if cfg.judge_min is not None:
        def judged(ep):
            s = (ep.meta.get("judge") or {}).get("score")
            return "no judge score" if s is None else f"judge score < {cfg.judge_min}" if s < cfg.judge_min else None
        eps = funnel.gate("judge", eps, judged)
    return eps


def gate_shape(cfg: Config, funnel: Funnel, eps: list, tok) -> tuple[list[sandbox.Episode], int]:
    """Gates 3-5: results re-fitted to the token budget (nothing dropped; returns how many blocks were
    re-truncated), the five format rejects, the relevance of the evidence to each correction."""
    length_fn = lambda s: len(tok.encode(s, add_special_tokens=False))  # noqa: E731
    refit, changed = [], 0
    for ep in tqdm(eps, desc="token budget", unit="trace", leave=False, file=sys.stderr, mininterval=1.0):
        new, n = refit_results(ep, length_fn, cfg.result_tokens, cfg.max_deletes, cfg.limits)
        refit.append(new)
        changed += n
    eps = funnel.record("token budget", len(eps), refit, Counter(), retruncated_blocks=changed)

    prompt_len: dict[str, int] = {}

    def fmt(ep):
        if ep.doc_id not in prompt_len:
            prompt_len[ep.doc_id] = len(sandbox.prompt_ids(tok, ep.document))
        why = format_problem(ep, cfg.max_deletes, trace_tokens(ep, tok, prompt_len[ep.doc_id]), cfg.max_tokens)
        return _generalise(why) if why else None

    eps = funnel.gate("format", eps, fmt)

    def relevant(ep):
        r = relevance(ep)
        return f"top result supports the correction < {cfg.relevance_min}" if r is not None and \
            r < cfg.relevance_min else None

    return funnel.gate("relevance", eps, relevant), changed


def gate_gain(cfg: Config, funnel: Funnel, eps: list, docs: dict) -> list[sandbox.Episode]:
    """Gate 6: a corrective trace is kept when its corrections raised factuality by `gain_min` and it
    left no error the teacher found uncorrected (the gain is written to the trace's meta)."""
    corrective = [ep for ep in eps if ep.n_deleted]
    backend = rewards.RewardConfig(factuality=cfg.factuality)
    finals = rewards.factuality_batch([(docs[ep.doc_id], ep.summary) for ep in corrective], backend)
    drafts = rewards.factuality_batch([(docs[ep.doc_id], uncorrected_draft(ep)) for ep in corrective], backend)
    gain = {id(ep): f - d for ep, f, d in zip(corrective, finals, drafts)}
    for ep in corrective:
        ep.meta["factuality_gain"] = round(gain[id(ep)], 4)

    def gained(ep):
        if ep.meta.get("open_errors"):
            return "errors found but left uncorrected"
        g = gain.get(id(ep))
        return f"factuality gain < {cfg.gain_min}" if g is not None and g < cfg.gain_min else None

    return funnel.gate("factuality gain", eps, gained)


def rank_and_dedup(cfg: Config, funnel: Funnel, eps: list) -> list[sandbox.Episode]:
    """Gates 7-8: near-duplicates out (the better-ranked stays), then at most `keep_per_doc` a document."""
    ranked = sorted(eps, key=lambda e: (rank_key(e), trace_id(e)), reverse=True)
    kept, dups = dedup(ranked, cfg.dedup_threshold, cfg.dedup_num_perm, cfg.dedup_shingle)
    eps = funnel.record("near-duplicates", len(eps), kept, Counter({"near-duplicate": len(dups)} if dups else {}))
    by_doc = defaultdict(list)
    for ep in eps:
        by_doc[ep.doc_id].append(ep)
    selected = [e for d in sorted(by_doc) for e in select_per_doc(by_doc[d], cfg.keep_per_doc)]
    return funnel.record("ranking", len(eps), selected,
                         Counter({f"beyond {cfg.keep_per_doc} per document": len(eps) - len(selected)}
                                 if len(eps) > len(selected) else {}))


def split_corpus(cfg: Config, funnel: Funnel, eps: list, docs: dict) -> dict[str, list[sandbox.Episode]]:
    """Gate 9: the traces by the split's pool (never-touch withheld), train.jsonl and eval.jsonl written."""
    manifest = load_manifest(cfg.split, list(docs.values()))
    pools = pool_of(manifest)
    split = {p: [ep for ep in eps if pools.get(ep.doc_id) == p] for p in data.POOLS}
    missing = [ep for ep in eps if ep.doc_id not in pools]
    reasons = Counter({"never-touch document (withheld)": len(split["never_touch"])})
    if missing:
        reasons["document not in the split manifest"] = len(missing)
    funnel.record("split", len(eps), split["train"] + split["eval"], +reasons,
                  train=len(split["train"]), eval=len(split["eval"]))
    leak = {ep.doc_id for ep in split["train"]} & {i for i, p in pools.items() if p != "train"}
    assert not leak, f"leak: training traces of held-out documents {sorted(leak)[:5]}"
    os.makedirs(cfg.out_dir, exist_ok=True)
    for p in ("train", "eval"):
        common.atomic_write_text(os.path.join(cfg.out_dir, f"{p}.jsonl"),
                                 "".join(ep.to_json() + "\n" for ep in split[p]))
    return split


def spot_check(cfg: Config, corpus: list, docs: dict) -> dict | None:
    """spot_check.html/.csv: a seeded sample of the corpus, each marked with what the oracle finds wrong on
    news-world documents; returns the oracle's noise figures there (None elsewhere)."""
    sc = cfg.spot_check
    n_sample = min(len(corpus), sc.n * max(1, math.ceil(len(corpus) / sc.per_traces)))
    sample = random.Random(sc.seed).sample(corpus, n_sample)
    world = all(docs[ep.doc_id].facts for ep in corpus) and bool(corpus)
    marks = [oracle_noise(docs[ep.doc_id], ep) if world else None for ep in sample]
    noise = None
    if world:
        every = [oracle_noise(docs[ep.doc_id], ep) for ep in tqdm(corpus, desc="oracle", unit="trace", leave=False,
                                                                  file=sys.stderr, mininterval=1.0)]
        noise = {"spot_check_rate": round(sum(bool(m) for m in marks) / max(1, len(marks)), 4),
                 "spot_check_n": len(marks), "corpus_rate": round(sum(map(bool, every)) / max(1, len(every)), 4),
                 "corpus_n": len(every), "reasons": dict(Counter(r for m in every for r in m).most_common()),
                 "drafter_disagreement_rate": round(sum(map(bool, map(drafter_disagrees, corpus)))
                                                    / max(1, len(corpus)), 4)}
    title = f"Spot check: {len(sample)} of {len(corpus)} traces (seed {sc.seed})"
    common.atomic_write_text(os.path.join(cfg.out_dir, "spot_check.html"), render_html(list(zip(sample, marks)),
                                                                                       title))
    common.atomic_write_text(os.path.join(cfg.out_dir, "spot_check.csv"), render_csv(list(zip(sample, marks))))
    return noise


def report(cfg: Config, funnel: Funnel, split: dict, noise: dict | None, changed: int, secs: float) -> dict:
    """funnel.json and the printed funnel table and summary line."""
    corpus = split["train"] + split["eval"]
    kinds = Counter(ep.meta.get("trace_kind", "?") for ep in corpus)
    balance = check_balance(corpus)
    out = {"input": funnel.n, "gates": funnel.rows, "train": len(split["train"]), "eval": len(split["eval"]),
           "withheld_never_touch": len(split["never_touch"]), "kinds": dict(kinds),
           "checks": balance, "factuality_backend": rewards.BACKEND_NAMES[cfg.factuality],
           "relevance_min": cfg.relevance_min, "gain_min": cfg.gain_min, "noise": noise,
           "manifest": cfg.split.manifest_path, "seconds": round(secs, 2),
           "traces_per_s": round(funnel.n / max(secs, 1e-9), 1)}
    common.atomic_write_text(os.path.join(cfg.out_dir, "funnel.json"), json.dumps(out, indent=1) + "\n")
    print(funnel.table())
    line = (f"filter: {funnel.n} traces -> train {len(split['train'])}, eval {len(split['eval'])}, withheld "
            f"{len(split['never_touch'])} | kinds {dict(kinds)} | checks {balance['searches']}: "
            f"{balance['corrections']} corrections, {balance['search_only']} search-only "
            f"({balance['search_only_share']:.0%}) | re-truncated results {changed}")
    if noise:
        line += (f" | oracle noise {noise['spot_check_rate']:.1%} of {noise['spot_check_n']} sampled, "
                 f"{noise['corpus_rate']:.1%} of the corpus")
    print(f"{line} | {secs:.1f}s -> {cfg.out_dir}", flush=True)
    if balance["shortcut"]:
        print(f"filter: warning: the decision after a search follows from its position: first checks "
              f"{balance['first_corrected']}/{balance['first_checks']} corrected, checks of a rewrite "
              f"{balance['rechecks_corrected']}/{balance['rechecks']}; the position alone gets "
              f"{balance['position_predicts']:.0%} of decisions right, one answer for all "
              f"{balance['majority_predicts']:.0%}. A policy trained on it deletes at the first check "
              f"without reading the result (synth_traces.py's recheck_rate sets how often a rewrite is checked)",
              file=sys.stderr, flush=True)
    return out


def main(cfg: Config) -> dict:
    """Filter `cfg.traces` into the corpus; returns the funnel.

    Each trace is dropped by the first gate it fails, and the reason is counted:
    1. annotation: the teacher's answer was junk (synth keeps such traces as
       "rejected", with the reason).
    2. judge: the reasoning judge's score is below `judge_min` (the judge decides
       which traces are eligible at all).
    3. token budget: every results block is re-fitted to `result_tokens` policy
       tokens by replaying the trace with the policy tokenizer's length (sentences
       are shortened with an ellipsis, never dropped; the count is reported). No
       trace is dropped here.
    4. format, five hard rejects:
       (1) every <search> is answered by its results (no tool error);
       (2) at most `max_deletes` deletes, and no cap was hit;
       (3) parseable tags and scopes: no malformed call, no stray or dangling
           markup, every delete retracted something;
       (4) the trace fits the trainer's budget: prompt + every turn + every result
           under the policy tokenizer <= `max_tokens` (an upper bound of the
           longest training branch);
       (5) it ends with a non-empty summary and never on a search. A trailing
           delete is allowed: retracting an unsupported last sentence is complete.
    5. relevance: a corrective trace is dropped when, for one of its corrections,
       the best top-1 result of the searches before the delete has TF-IDF cosine
       < `relevance_min` with the corrected sentence (see `relevance`).
    6. factuality gain: a corrective trace is kept only if F(final summary) -
       F(uncorrected draft) >= `gain_min` (F: lexical | oracle | fenice, through
       `rewards` and `data`), and no error the teacher found was left uncorrected.
    7. near-duplicates: MinHash LSH over word 3-shingles of the written trace
       (results excluded: they follow from document and query), Jaccard >=
       `dedup_threshold`; of two near-duplicates the better-ranked one stays.
    8. ranking: at most `keep_per_doc` traces per document, by structural signals
       (every delete searched first, no repeated identical call, tool-call depth,
       distinct queries); ties go to a tool-call shape not yet kept.
    9. split: the leak-cluster-guarded manifest of `data.make_split` (frozen on
       first use, checked after): train.jsonl and eval.jsonl; traces of
       never-touch documents are withheld entirely.
    """
    t0 = time.perf_counter()
    eps, docs, tok = load_inputs(cfg)
    run = common.start_run(cfg)
    funnel = Funnel(len(eps))
    eps = gate_inputs(cfg, funnel, eps, docs)
    eps, changed = gate_shape(cfg, funnel, eps, tok)
    eps = gate_gain(cfg, funnel, eps, docs)
    eps = rank_and_dedup(cfg, funnel, eps)
    split = split_corpus(cfg, funnel, eps, docs)
    noise = spot_check(cfg, split["train"] + split["eval"], docs)
    secs = time.perf_counter() - t0
    out = report(cfg, funnel, split, noise, changed, secs)
    run.metrics.write(0, input=funnel.n, train=len(split["train"]), eval=len(split["eval"]),
                      noise=noise["spot_check_rate"] if noise else None, seconds=secs)
    return out


if __name__ == "__main__":
    with settings.config_errors_exit(data.DataError, data.LeakError):  # bad input: one line, not a traceback
        main(settings.load_config(Config))
