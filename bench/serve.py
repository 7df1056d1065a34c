"""Latency and throughput of serve.py, one client vs many (what request batching buys).

    python bench/serve.py [--model runs/rl_tiny/final] [--n 64] [--clients 1 16] [--log runs/serve/episodes.jsonl]

Starts `python serve.py --model MODEL --port 0` (greedy, tools on, the lexical
factuality backend), warms it up with one request, then for each client count
sends the same --n held-out news-world documents (the split's eval pool when
out/newsworld exists, else freshly generated ones) from that many concurrent
clients, and reports per-request latency p50/p95 (queueing included), mean
engine batch and summaries per second. Every episode lands in --log, so
`python monitor.py LOG` reports on the run afterwards. The last line is one
JSON object; `batching_speedup` is the throughput at the largest client count
over that at the smallest.
"""
import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import newsworld  # noqa: E402
import serve  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def documents(n: int) -> list[str]:
    docs, split = ROOT / "out/newsworld/docs.jsonl", ROOT / "out/newsworld/split.json"
    if docs.exists() and split.exists():
        pool = data.pool_documents(data.read_documents(str(docs)), data.read_manifest(str(split)), "eval")
    else:
        pool = list(newsworld.documents(n, seed=7))
    return [d.text for d in pool[:n]]


def load(port: int, texts: list[str], clients: int) -> dict:
    def one(text: str) -> tuple[float, int]:
        t0 = time.perf_counter()
        status, body = serve.call(port, body=json.dumps({"document": text}).encode())
        if status != 200:
            raise RuntimeError(f"status {status}: {body}")
        return time.perf_counter() - t0, body["batch_size"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        got = list(pool.map(one, texts))
    wall = time.perf_counter() - t0
    lat = np.array([s for s, _ in got]) * 1e3
    return {"p50_ms": float(np.percentile(lat, 50)), "p95_ms": float(np.percentile(lat, 95)),
            "mean_batch": float(np.mean([b for _, b in got])), "summaries_per_s": len(texts) / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="runs/rl_tiny/final")
    ap.add_argument("--n", type=int, default=64, help="requests per client count")
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--log", default="runs/serve/episodes.jsonl")
    ap.add_argument("--threads", type=int, default=0, help="torch threads of the server (0 = its default)")
    args = ap.parse_args()
    texts = documents(args.n)
    proc, port = serve.spawn(["--model", args.model, "--port", "0", f"log={args.log}",
                              f"torch_threads={args.threads}", f"batch_size={max(args.clients)}"], cwd=ROOT)
    try:
        serve.call(port, body=json.dumps({"document": texts[0]}).encode())  # warm-up
        figures = {}
        for c in args.clients:
            r = load(port, texts, c)
            print(f"{c:3d} clients: p50 {r['p50_ms']:7.1f} ms  p95 {r['p95_ms']:7.1f} ms  mean batch "
                  f"{r['mean_batch']:5.1f}  {r['summaries_per_s']:6.2f} summaries/s", flush=True)
            figures.update({f"c{c}_{k}": v for k, v in r.items()})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lo, hi = min(args.clients), max(args.clients)
    figures["batching_speedup"] = figures[f"c{hi}_summaries_per_s"] / figures[f"c{lo}_summaries_per_s"]
    print(json.dumps({"model": args.model, "n": len(texts), **{k: round(v, 3) for k, v in figures.items()}}))


if __name__ == "__main__":
    main()
