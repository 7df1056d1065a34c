"""Factuality scorers against human labels: balanced accuracy and Kendall's tau per source.

    python bench/factuality.py                                   # the shipped sample (a smoke test)
    git clone https://github.com/artidoro/frank ../frank         # FRANK (MIT licence), once
    python bench/factuality.py --convert-frank ../frank --out out/factuality/frank.jsonl
    python bench/factuality.py --data out/factuality/frank.jsonl [--scorers support learned] [--fenice]

Each record is a (document, system summary) pair with a human score and a
binary label (bench/factuality_data.py has the format). Records are split by
document into dev and test (FRANK's own validation/test split). Per scorer and
source (CNN/DM, XSum, and the news world, generated here from world seed 11,
labelled by its oracle):
- `ba`: balanced accuracy on test, the threshold tuned on dev (the one that
  maximises dev balanced accuracy);
- `tau`: Kendall's tau-b between the score and the human score on test;
- `per_s`: summaries scored per second on one core, document analysis included
  (a document is analysed once and shared by its summaries, as in RL groups).
Scorers:
- `word_overlap` (baseline): the share of a sentence's content words found in
  the document, the minimum over sentences;
- `entity_number` (baseline): the share of the summary's names and numbers
  found in the document (1 with none);
- `lexical`: the news world's claim-by-claim scorer (rewards.lexical_factuality);
- `support`: the model-free scorer for real text (rewards.support_factuality);
- `learned`: the logistic regression of factual_tools/factcheck.py (weights from --learned);
- `fenice` (with --fenice, needs its models: a GPU and a hub or local copies).
The shipped sample is 32 invented records: it proves the script runs, its
figures mean nothing. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before bench/, whose rewards.py is a benchmark, not the module
from factual_tools import claims  # noqa: E402
import rewards as R  # noqa: E402
from factual_tools import textsplit  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # appended: bench/rewards.py must not shadow rewards
import factuality_data as FD  # noqa: E402

SAMPLE = ROOT / "bench" / "data" / "factuality_sample.jsonl"
BASELINES = ("word_overlap", "entity_number")
SCORERS = BASELINES + ("lexical", "support", "learned")


def word_overlap(document: str, summary: str) -> float:
    """The issue's 30-line baseline: min over sentences of the share of content words in the document."""
    doc = {w.lower() for w in R.SUPPORT_TOKEN_RE.findall(document)}
    shares = []
    for sent in textsplit.split_sentences(summary):
        words = [w.lower() for w in R.SUPPORT_TOKEN_RE.findall(sent) if w.lower() not in R.STOPWORDS]
        if words:
            shares.append(sum(w in doc for w in words) / len(words))
    return min(shares) if shares else 0.0


def entity_number(document: str, summary: str) -> float:
    """The share of the summary's names and numbers whose text occurs in the document (1 with none)."""
    doc = document.lower()
    items = [" ".join(e) for e in claims.entities(summary)] + [n.text.lower() for n in claims.numbers(summary)]
    return sum(i in doc for i in items) / len(items) if items else 1.0


def make_scorer(name: str, learned: str):
    if name == "word_overlap":
        return word_overlap
    if name == "entity_number":
        return entity_number
    if name == "lexical":
        return R.lexical_factuality
    if name == "support":
        return R.support_factuality
    if name == "learned":
        model = R.load_learned(learned)
        return model.score
    if name == "fenice":
        f = R.fenice_for(R.FeniceConfig())
        return lambda d, s: f.score_batch([(d, s)])[0]["score"]
    raise SystemExit(f"unknown scorer {name!r} (choose from {', '.join(SCORERS + ('fenice',))})")


def newsworld_records(n_docs: int, seed: int = 11) -> list[dict]:
    """News world documents with the reference and two drafts each, labelled by the oracle; half dev, half test."""
    import newsworld
    from newsworld import oracle

    rng = random.Random(seed)
    out = []
    for i, doc in enumerate(newsworld.documents(n_docs, seed=seed)):
        for j, summary in enumerate((doc.summary, oracle.draft(doc, rng)[0], oracle.draft(doc, rng)[0])):
            human = float(oracle.oracle_fact_score(doc, summary))
            out.append({"id": f"newsworld/{doc.id}/{j}", "source": "newsworld", "split": "dev" if i % 2 else "test",
                        "doc_id": doc.id, "system": "reference" if j == 0 else "draft", "document": doc.text,
                        "summary": summary, "human": human, "label": int(human >= 1.0)})
    return out


def balanced_accuracy(labels: np.ndarray, flagged_ok: np.ndarray) -> float:
    pos, neg = labels == 1, labels == 0
    parts = [flagged_ok[pos].mean()] if pos.any() else []
    parts += [(~flagged_ok[neg]).mean()] if neg.any() else []
    return float(np.mean(parts)) if parts else float("nan")


def tune_threshold(scores: np.ndarray, labels: np.ndarray) -> float:
    """The threshold (score >= t means consistent) with the best balanced accuracy; the lowest such on ties."""
    best, best_t = -1.0, 0.0
    for t in np.unique(scores):
        b = balanced_accuracy(labels, scores >= t)
        if b > best + 1e-12:
            best, best_t = b, float(t)
    return best_t


def kendall_tau(x: np.ndarray, y: np.ndarray) -> float:
    """Kendall's tau-b (ties in either variable accounted for), O(n^2): the sets are small."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 2:
        return float("nan")
    dx = np.sign(x[:, None] - x[None, :])
    dy = np.sign(y[:, None] - y[None, :])
    iu = np.triu_indices(len(x), 1)
    dx, dy = dx[iu], dy[iu]
    denom = np.sqrt((dx != 0).sum() * (dy != 0).sum())
    return float((dx * dy).sum() / denom) if denom else float("nan")


def evaluate(records: list[dict], scores: np.ndarray) -> dict:
    """Per source: ba (test, dev-tuned threshold), tau (test), threshold, counts."""
    out = {}
    for source in dict.fromkeys(r["source"] for r in records):
        idx = {s: np.array([i for i, r in enumerate(records) if r["source"] == source and r["split"] == s], int)
               for s in ("dev", "test")}
        labels = np.array([r["label"] for r in records])
        human = np.array([r["human"] for r in records])
        row = {"n_dev": len(idx["dev"]), "n_test": len(idx["test"])}
        if len(idx["dev"]) and len(idx["test"]):
            t = tune_threshold(scores[idx["dev"]], labels[idx["dev"]])
            row.update(ba=balanced_accuracy(labels[idx["test"]], scores[idx["test"]] >= t),
                       tau=kendall_tau(scores[idx["test"]], human[idx["test"]]), threshold=t)
        out[source] = row
    return out


def one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def run(records: list[dict], scorers: list[str], learned: str) -> dict:
    results = {}
    for name in scorers:
        fn = make_scorer(name, learned)
        R.SUPPORT_DOCS.clear()
        claims.DOC_CACHE.clear()
        t0 = time.perf_counter()
        scores = np.array([fn(r["document"], r["summary"]) for r in records], float)
        dt = time.perf_counter() - t0
        results[name] = {"per_s": len(records) / dt if dt else float("inf"), "sources": evaluate(records, scores)}
    return results


def table(results: dict) -> str:
    sources = list(next(iter(results.values()))["sources"])
    head = "| scorer | " + " | ".join(f"{s} ba | {s} tau" for s in sources) + " | summaries/s |"
    lines = [head, "|" + "---|" * (2 * len(sources) + 2)]
    for name, res in results.items():
        cells = []
        for s in sources:
            row = res["sources"][s]
            cells += [f"{row.get('ba', float('nan')):.3f}", f"{row.get('tau', float('nan')):.3f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {res['per_s']:,.0f} |")
    return "\n".join(lines)


def verdicts(results: dict, default: str = "support", learned: str = "learned") -> dict:
    """Whether `default` beats every baseline, and `learned` beats `default`, on every public source and figure."""
    out = {}
    public = [s for s in next(iter(results.values()))["sources"] if s != "newsworld"]
    for s in public:
        for fig in ("ba", "tau"):
            if default in results:
                d = results[default]["sources"][s].get(fig)
                base = [results[b]["sources"][s].get(fig) for b in BASELINES if b in results]
                out[f"{default}_beats_baselines_{s}_{fig}"] = bool(d is not None and base and all(d > b for b in base))
            if default in results and learned in results:
                out[f"{learned}_beats_{default}_{s}_{fig}"] = bool(
                    results[learned]["sources"][s].get(fig, -1) > results[default]["sources"][s].get(fig, 1))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--data", default=str(SAMPLE), help="records (JSONL); default: the shipped sample")
    ap.add_argument("--convert-frank", metavar="REPO", help="convert a clone of artidoro/frank to --out and stop")
    ap.add_argument("--out", default="out/factuality/frank.jsonl", help="where --convert-frank writes")
    ap.add_argument("--scorers", nargs="+", default=list(SCORERS))
    ap.add_argument("--fenice", action="store_true", help="add FENICE (its models must be loadable)")
    ap.add_argument("--learned", default=str(ROOT / R.LearnedConfig().path), help="the learned scorer weights")
    ap.add_argument("--newsworld", type=int, default=200, help="news world documents added as a source (0: none)")
    args = ap.parse_args(argv)
    if args.convert_frank:
        records = FD.convert_frank(args.convert_frank)
        FD.write(records, args.out)
        print(f"wrote {len(records)} records to {args.out}")
        return
    records = FD.load(args.data)
    if args.newsworld > 0:
        records += newsworld_records(args.newsworld)
    scorers = list(args.scorers) + (["fenice"] if args.fenice else [])
    results = run(records, scorers, args.learned)
    print(f"{args.data}: {len(records)} records; ba = balanced accuracy on test (threshold tuned on dev), "
          "tau = Kendall tau-b with the human score on test; speed on one core")
    print(table(results))
    figures = {"data": Path(args.data).name, "records": len(records),
               "scorers": {k: {"per_s": round(v["per_s"], 1), **{
                   s: {m: (round(x, 4) if isinstance(x, float) else x) for m, x in row.items()}
                   for s, row in v["sources"].items()}} for k, v in results.items()}}
    figures.update(verdicts(results))
    print(json.dumps(figures))


if __name__ == "__main__":
    one_core()  # here, not in main(): a test calling main() must not pin the whole test process
    main()
