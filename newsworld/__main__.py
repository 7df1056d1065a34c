"""The news world's command line: write articles, or report on a corpus.

    python -m newsworld generate --n 1000 --seed 0 --out out/newsworld/docs.jsonl
    python -m newsworld generate --n 5 --seed 0            # to stdout
    python -m newsworld generate --n 1000 --seed 0 --task long --out out/newsworld/long.jsonl
    python -m newsworld stats out/newsworld/docs.jsonl     # counts, lengths, drafter/oracle agreement
    python -m newsworld errors runs/eval_news              # errors by type and by distance to the fact
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Callable, Sequence

import data
import newsworld
from newsworld import errors, oracle


def cmd_generate(args) -> int:
    t0 = time.perf_counter()
    docs = newsworld.documents(args.n, args.seed, start=args.start, retell_rate=args.retell_rate, task=args.task)
    if args.out == "-":
        n = 0
        for d in docs:
            sys.stdout.write(data.dumps(d) + "\n")
            n += 1
    else:
        n = data.write_jsonl(args.out, docs)
    print(f"newsworld: {n} documents (seed {args.seed}) -> {args.out} in {time.perf_counter() - t0:.2f}s",
          file=sys.stderr)
    return 0


def cmd_stats(args) -> int:
    t0 = time.perf_counter()
    report = data.LoadReport()
    docs = list(data.load_jsonl(args.path, mapping=args.map, limit=args.limit, skip_bad=args.skip_bad, report=report))
    stats = oracle.world_stats(docs, draft_seed=args.seed) if not args.no_drafts else oracle.world_stats(
        [dataclasses.replace(d, facts=[]) for d in docs])
    if report.n_bad:
        stats["skipped_lines"] = report.n_bad
    stats["seconds"] = round(time.perf_counter() - t0, 2)
    for k, v in stats.items():
        print(f"{k:>22}: {json.dumps(v)}")
    print(json.dumps(stats))
    return 0


def cmd_errors(args) -> int:
    for run in args.runs:
        breakdown = errors.write_breakdown(run)
        print(f"# Errors of {run}\n\n" + errors.markdown(breakdown))
        print(f"newsworld: wrote {run}/errors.json", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m newsworld", description="The built-in news world.")
    sub = p.add_subparsers(dest="command", required=True)

    nw = sub.add_parser("generate", help="write the news world's articles as Document JSONL")
    nw.add_argument("--n", type=int, default=1000, help="number of articles")
    nw.add_argument("--seed", type=int, default=0, help="world seed: same seed, same bytes")
    nw.add_argument("--start", type=int, default=0, help="index of the first article")
    nw.add_argument("--retell-rate", type=float, default=0.08, help="share of articles retelling an earlier event")
    nw.add_argument("--task", default="short", choices=newsworld.TASKS,
                    help="short: about 100-word articles; long: 300-420 words, a 45-word reference of 3-5 key facts")
    nw.add_argument("--out", default="-", help="output JSONL file ('-' for stdout)")

    st = sub.add_parser("stats", help="counts, length distributions, drafter/oracle agreement")
    st.add_argument("path", help="Document JSONL file")
    st.add_argument("--seed", type=int, default=0, help="drafter seed")
    st.add_argument("--no-drafts", action="store_true", help="lengths and counts only")
    st.add_argument("--map", default=None, help="field mapping for foreign JSONL, e.g. text=article")
    st.add_argument("--limit", type=int, default=None)
    st.add_argument("--skip-bad", action="store_true", help="skip (and count) malformed lines")

    er = sub.add_parser("errors", help="an evaluation's oracle errors by type and by distance (words) to the "
                                       "supporting sentence, in the article or a search result")
    er.add_argument("runs", nargs="+", metavar="RUN_DIR", help="eval.py run directory (eval.json, episodes.jsonl)")
    return p


COMMANDS: dict[str, Callable] = {"generate": cmd_generate, "stats": cmd_stats, "errors": cmd_errors}


def main(argv: Sequence[str] | None = None) -> int:
    return data.run_command(build_parser(), COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
