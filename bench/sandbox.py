"""Search latency of the sandbox, against a subprocess-pool alternative.

    python bench/sandbox.py [--calls 2000]

Figures, on a 40-sentence news document (index built once):
- p50/p99 latency of one search call, regex and BM25 (target p99 <= 1 ms);
- index build time;
- the time a catastrophic pattern takes before the time limit stops it
  (target <= 60 ms with the default 50 ms limit);
- per-call overhead of the alternative, a process pool with a 0.3 s
  timeout ("ReTool style"), against calling the sandbox in process (target:
  ours >= 100x lower). Overhead is measured on a call that does no search work
  (an empty query, answered with an error block), through both paths; the full
  cost of real queries through both paths is reported beside it. The pool is
  given its best case: each worker holds the document's index already.
The last line is one JSON object of named figures.
"""
import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import sandbox  # noqa: E402

REGEX_QUERIES = [r"/revenue of \$\d+(\.\d+)? billion/", r"/Jane K\. Doe/", r"/acme corp/i", r"/\b20\d\d\b/",
                 r"/(shares|stock) (rose|fell)/i", r"/Globex.*quarter/", r"/employs \d[\d,]* people/",
                 r"/said/"]
BM25_QUERIES = ["Acme revenue billion", "Jane Doe growth market", "Globex quarter revenue",
                "shares fell New York", "employees countries", "chief executive said costs",
                "record profit dividend", "storm damage"]


def news_document(n_sentences=40):
    """A deterministic news-like document built from the bench's own templates."""
    people = ["Jane K. Doe", "Mr. Smith", "Dr. Alan Park", "Maria Lopez", "Sen. Ruth Hale"]
    orgs = ["Acme Corp.", "Globex Inc.", "Initech", "Umbrella Ltd.", "Stark Industries"]
    templates = [
        "{o} reported revenue of ${a}.{b} billion for the quarter ended March {d}, 20{y}.",
        "{p} said the U.S. market drove growth of {a}{b}% at {o}",
        "Shares of {o} fell {a}.{b}% in New York trading on Jan. {d}.",
        "{o} employs {a},{b}00 people in {d} countries, according to {p}.",
        "\"We expect costs to rise by ${a}{b}0 million,\" {p} told analysts.",
        "Rival {o} posted a loss of ${a}.{b} billion, its first since 20{y}.",
    ]
    out = []
    for i in range(n_sentences):
        t = templates[i % len(templates)]
        out.append(t.format(o=orgs[i * 7 % 5], p=people[i * 3 % 5], a=i % 9 + 1, b=i * 7 % 10, d=i % 28 + 1,
                            y=10 + i % 15).rstrip(".") + ".")
    out[17] = "The word " + "a" * 40 + "! was shouted."  # prey for the catastrophic pattern
    return " ".join(out)


_WORKER_INDEX = None


def _init_worker(text):
    global _WORKER_INDEX
    _WORKER_INDEX = sandbox.DocIndex(text)


def _worker_search(query):
    return _WORKER_INDEX.search(query).block


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def timed_calls(fn, queries, n):
    times = []
    for i in range(n):
        q = queries[i % len(queries)]
        t0 = time.perf_counter()
        fn(q)
        times.append(time.perf_counter() - t0)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--pool-calls", type=int, default=300)
    args = ap.parse_args()

    text = news_document(40)
    builds = []
    for _ in range(50):
        t0 = time.perf_counter()
        index = sandbox.DocIndex(text)
        builds.append(time.perf_counter() - t0)
    assert len(index.sentences) == 40, len(index.sentences)

    rx = timed_calls(index.search, REGEX_QUERIES, args.calls)
    bm = timed_calls(index.search, BM25_QUERIES, args.calls)
    assert all(index.search(q).error is None for q in REGEX_QUERIES + BM25_QUERIES)

    bad = []
    for _ in range(5):
        t0 = time.perf_counter()
        res = index.search("/(a|a)+$/")
        bad.append(time.perf_counter() - t0)
        assert res.error and "time limit" in res.error, res.error

    mixed = REGEX_QUERIES + BM25_QUERIES
    inproc = timed_calls(index.search, mixed, args.pool_calls)
    noop_inproc = timed_calls(index.search, [""], args.calls)
    with ProcessPoolExecutor(max_workers=2, initializer=_init_worker, initargs=(text,)) as pool:
        pool.submit(_worker_search, mixed[0]).result(timeout=5)  # warm both the pool and the import

        def via_pool(q):
            return pool.submit(_worker_search, q).result(timeout=0.3)

        pooled = timed_calls(via_pool, mixed, args.pool_calls)
        noop_pooled = timed_calls(via_pool, [""], args.pool_calls)

    ms = 1000.0
    figures = {
        "regex_p50_ms": statistics.median(rx) * ms,
        "regex_p99_ms": percentile(rx, 99) * ms,
        "bm25_p50_ms": statistics.median(bm) * ms,
        "bm25_p99_ms": percentile(bm, 99) * ms,
        "index_build_ms": statistics.median(builds) * ms,
        "catastrophic_max_ms": max(bad) * ms,
        "overhead_inprocess_ms": statistics.median(noop_inproc) * ms,
        "overhead_pool_ms": statistics.median(noop_pooled) * ms,
        "query_inprocess_mean_ms": statistics.mean(inproc) * ms,
        "query_pool_mean_ms": statistics.mean(pooled) * ms,
    }
    figures["pool_overhead_ratio"] = figures["overhead_pool_ms"] / figures["overhead_inprocess_ms"]
    figures["pool_query_ratio"] = figures["query_pool_mean_ms"] / figures["query_inprocess_mean_ms"]
    figures = {k: round(v, 4) for k, v in figures.items()}
    targets = {"regex_p99_ms": ("<=", 1.0), "bm25_p99_ms": ("<=", 1.0), "catastrophic_max_ms": ("<=", 60.0),
               "pool_overhead_ratio": (">=", 100.0)}
    for k, v in figures.items():
        line = f"{k:26s} {v:10.4f}"
        if k in targets:
            op, t = targets[k]
            ok = v <= t if op == "<=" else v >= t
            line += f"   target {op} {t}: {'met' if ok else 'NOT MET'}"
        print(line)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
