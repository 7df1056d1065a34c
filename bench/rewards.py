"""Reward throughput, and what FENICE's group scoring saves.

    python bench/rewards.py [--docs 100] [--group 8]

Figures, on news world documents with faulty drafts (`oracle.draft`), scored as
an RL step sees them: groups of `--group` rollouts of one document, the
document side built once per group (its cost is included), on one CPU core:
- lexical factuality summaries/s (target >= 2,000); it is a model-free
  approximation, not FENICE;
- rule bundle summaries/s (target >= 2,000), and the whole `score_batch`;
- FENICE with tiny random models (the real loading, batching and caching
  code; its scores mean nothing): time to score a group of 8 summaries of one
  document in one call, divided by 8 separate single calls (target <= 0.35).
  Both start from empty caches for each document, as the reference (which
  shares nothing between calls) would; models are loaded once for both.
  Separate calls that keep the caches are reported beside it;
- the oracle/lexical agreement on drafter errors (a summary, or a sentence,
  flagged by both or by neither), with the lexical misses per error type.
The last line is one JSON object of named figures.
"""
import argparse
import collections
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import newsworld  # noqa: E402
from newsworld import oracle  # noqa: E402
from factual_tools import claims  # noqa: E402
from factual_tools import fenice  # noqa: E402
import rewards as R  # noqa: E402

CLAIM_FAIL = 0.75  # a summary sentence scoring below this is flagged by the lexical scorer


def one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch

    torch.set_num_threads(1)


def groups_of(n_docs: int, group: int, seed: int = 0) -> list[tuple[data.Document, list[str]]]:
    rng = random.Random(seed)
    return [(doc, [oracle.draft(doc, rng)[0] for _ in range(group)]) for doc in newsworld.documents(n_docs, seed=seed)]


def per_second(groups, fn, repeats: int = 3) -> float:
    """Best of `repeats` passes; each pass starts with an empty document cache."""
    n = sum(len(s) for _, s in groups)
    best = float("inf")
    for _ in range(repeats):
        claims.DOC_CACHE.clear()
        t0 = time.perf_counter()
        for doc, summaries in groups:
            fn(doc, summaries)
        best = min(best, time.perf_counter() - t0)
    return n / best


def fenice_ratio(groups, group: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = fenice.build_tiny_fenice(tmp, texts=[d.text for d, _ in groups[:20]])
        f = R.Fenice(cfg)
        f.score_batch([(groups[0][0].text, groups[0][1][0])])  # load and warm up both models
        t_group = t_single = t_warm = 0.0
        pairs_group = pairs_single = 0
        for doc, summaries in groups:
            f.clear_caches()
            p0, t0 = f.stats["nli_pairs"], time.perf_counter()
            f.score_batch([(doc.text, s) for s in summaries])
            t_group += time.perf_counter() - t0
            pairs_group += f.stats["nli_pairs"] - p0
            p0 = f.stats["nli_pairs"]
            for s in summaries:
                f.clear_caches()
                t0 = time.perf_counter()
                f.score_batch([(doc.text, s)])
                t_single += time.perf_counter() - t0
            pairs_single += f.stats["nli_pairs"] - p0
            f.clear_caches()
            t0 = time.perf_counter()
            for s in summaries:
                f.score_batch([(doc.text, s)])
            t_warm += time.perf_counter() - t0
    return {"fenice_group_s": t_group / len(groups), "fenice_singles_s": t_single / len(groups),
            "fenice_singles_cached_s": t_warm / len(groups), "fenice_group_ratio": t_group / t_single,
            "fenice_group_ratio_vs_cached_singles": t_group / t_warm,
            "fenice_nli_pairs_per_group": pairs_group / len(groups),
            "fenice_nli_pairs_per_8_singles": pairs_single / len(groups), "group_size": group}


def agreement(groups) -> dict:
    summaries, sentences = [], []
    missed, errors = collections.Counter(), collections.Counter()
    for doc, texts in groups:
        for text in texts:
            errs = oracle.oracle_errors(doc, text)
            bad = {e["sentence_index"] for e in errs}
            claims = R.score(doc, text)["claims"]
            flagged = {i for i, c in enumerate(claims) if c["score"] < CLAIM_FAIL}
            summaries.append(bool(bad) == bool(flagged))
            sentences += [(i in bad) == (i in flagged) for i in range(len(claims))]
            for e in errs:
                errors[e["type"]] += 1
                missed[e["type"]] += e["sentence_index"] not in flagged
    return {"agreement_per_summary": sum(summaries) / len(summaries),
            "agreement_per_sentence": sum(sentences) / len(sentences), "drafts": len(summaries),
            "lexical_missed_by_type": {k: f"{missed[k]}/{errors[k]}" for k in sorted(errors)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=100)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--fenice-docs", type=int, default=12)
    args = p.parse_args()
    one_core()
    groups = groups_of(args.docs, args.group)
    out = {
        "lexical_per_s": per_second(groups, lambda d, ss: [R.lexical_factuality(d, s) for s in ss]),
        "rules_per_s": per_second(groups, lambda d, ss: [R.rule_scores(d, s) for s in ss]),
        "score_batch_lexical_per_s": per_second(groups, lambda d, ss: R.Scorer().score_batch([(d, s) for s in ss])),
    }
    print(f"lexical factuality ({R.LEXICAL_NAME}): {out['lexical_per_s']:.0f} summaries/s (target >= 2,000)")
    print(f"rule bundle: {out['rules_per_s']:.0f} summaries/s; score_batch (rules + lexical + tool terms): "
          f"{out['score_batch_lexical_per_s']:.0f} summaries/s")
    fen = fenice_ratio(groups[:args.fenice_docs], args.group)
    out.update(fen)
    print(f"FENICE, tiny random models: a group of {args.group} in one call {fen['fenice_group_s'] * 1e3:.0f} ms, "
          f"{args.group} single calls {fen['fenice_singles_s'] * 1e3:.0f} ms: ratio {fen['fenice_group_ratio']:.3f} "
          f"(target <= 0.35); single calls keeping the caches {fen['fenice_singles_cached_s'] * 1e3:.0f} ms")
    agr = agreement(groups)
    out.update(agr)
    print(f"oracle/lexical agreement on {agr['drafts']} drafts: {agr['agreement_per_summary']:.3f} per summary, "
          f"{agr['agreement_per_sentence']:.3f} per sentence; lexical misses by type {agr['lexical_missed_by_type']}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
