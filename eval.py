"""Evaluate trained summarisers on held-out documents: quality, factuality, tool use, pass@k, speed.

    python eval.py --config configs/eval_tiny.yaml                         # CPU: the tiny RL policy, ~1 min
    python eval.py --config configs/eval_tiny.yaml model=runs/sft_tiny/final name=eval_sft
    python eval.py --config configs/eval_tiny.yaml --compare runs/sft_tiny/final runs/rl_tiny/final
    python eval.py --config configs/eval_tiny.yaml tools=none name=eval_no_tools   # decode-time ablation
    python eval.py --config configs/eval_news.yaml --compare lead-3 best-extract runs/sft_news/final

A model is a trained directory (`modeling.trained_model_config`): full weights (SFT's `final/`) or a PEFT
adapter (RL's `final/`). Documents are the leak-cluster manifest's `eval` pool (`data.py split`;
`never_touch` only when `pool=never_touch` is asked for); with `--compare A B ...` every directory
sees the same documents and seeds. Every metric is defined in `evaluate`'s docstring.

Copying baselines: the reserved names `lead-3` (the article's first three sentences) and
`best-extract` (the best whole article sentences within `reward.rules.max_words` words, chosen with
the oracle's knowledge of the key facts; news world documents only) stand in `--compare` (or `model=`)
for a model directory and give a row scored by the same figures. No model is loaded: the baseline's
text runs through the sandbox as a model's output would (`evaluation.BASELINES`); pass@k, latency and
tok/s are n/a. A reserved name always means the baseline, even where a directory so named exists
(write `./lead-3` for such a directory).

A served policy's episode log (serve.py) is read by `python monitor.py LOG`.

Ablation `tools=no_search | no_delete | none` bans the tags at decode time (`TagBan`): the model is
unchanged, it just cannot open the banned calls.

Outputs in runs/NAME/: eval.json (`models`: [{"model": DIR or baseline name, "baseline": bool, "metrics":
{...}}] in the order given, the config, the backends, the documents), report.md (a row per model or
baseline, a column per metric, plus training curves), PNG plots and samples.html (greedy episodes in
the traces' spot-check viewer).
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np

import data
import rewards
from factual_tools import common, modeling, settings, traces
from factual_tools.evaluation import (BASELINES, Config, KS, ORACLE_FREE, baseline_episodes, evaluate_baseline,
                                      evaluate_dir, load_decision_traces, load_eval_documents, missing_model_hint)


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------

PROBE = ["decision_probe_auc", "decision_probe_after_wrong", "decision_probe_after_right", "decision_probe_deletes",
         "decision_probe_keeps"]
TABLES = {
    "Quality": ["rouge1", "rouge2", "rougeL", "factuality", "fact_precision", "coverage", "key_fact_coverage",
                "rules_pass", "pass", "total", "hallucination_rate", "errors_per_summary",
                *ORACLE_FREE],  # the last need no fact table: real news too
    "Tools": ["valid_call_rate", "valid_episode_rate", "searches", "deletes", "deletes_removing_error"],
    "pass@k": [f"pass_at_{k}" for k in KS] + ["pass_sampled"],
    "Speed": ["latency_p50_ms", "latency_p95_ms", "tok_s"],
}
BARS = ["rouge1", "rougeL", "factuality", "fact_precision", "pass", "hallucination_rate", "valid_episode_rate",
        "pass_at_1"]
CURVE_KEYS = ["reward", "pass", "eval_pass", "eval_factuality", "loss", "eval_loss"]


def fmt(v) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "n/a"
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def table(results: dict[str, dict], keys: list[str]) -> str:
    rows = ["| model | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    rows += [f"| {name} | " + " | ".join(fmt(m.get(k, math.nan)) for k in keys) + " |" for name, m in results.items()]
    return "\n".join(rows)


def run_dir_of(path: str) -> Path | None:
    """The training run a model directory belongs to: the nearest ancestor (up to
    three levels: final/, checkpoints/step_N/model/) holding a metrics.jsonl."""
    for parent in list(Path(path).parents)[:3]:
        if (parent / "metrics.jsonl").exists():
            return parent
    return None


def _plot_curves(run: Path, out: Path) -> list[str]:
    import matplotlib.pyplot as plt

    records = common.read_metrics(run / "metrics.jsonl")
    keys = [k for k in CURVE_KEYS if any(isinstance(r.get(k), (int, float)) for r in records)]
    if not keys:
        return []
    fig, axes = plt.subplots(len(keys), 1, figsize=(6, 2 * len(keys)), sharex=True, squeeze=False)
    for ax, k in zip(axes[:, 0], keys):
        pts = [(r["step"], r[k]) for r in records if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker="." if len(pts) < 30 else None)
        ax.set_ylabel(k)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(str(run))
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return keys


def _plot_bars(results: dict[str, dict], out: Path) -> None:
    import matplotlib.pyplot as plt

    names = list(results)
    x = np.arange(len(BARS))
    w = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(BARS)), 3.5))
    for i, name in enumerate(names):
        vals = [results[name].get(k, math.nan) for k in BARS]
        ax.bar(x + i * w, [0 if not math.isfinite(v) else v for v in vals], w, label=name)
    ax.set_xticks(x + w * (len(names) - 1) / 2, BARS, rotation=20)
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def write_report(run_dir, results: dict[str, dict], cfg: Config, curves_from: list) -> None:
    """report.md with one table row per model per metric group, metrics.png, and a
    training curves section (curves_<run>.png) for each run in `curves_from`."""
    import matplotlib

    matplotlib.use("Agg")
    run_dir = Path(run_dir)
    backend = rewards.BACKEND_NAMES[cfg.reward.factuality]
    first = next(iter(results.values()), {})
    n_docs = int(first.get("n_docs", 0))
    lines = [f"# Evaluation: {cfg.name}", "",
             f"{n_docs} documents ({cfg.pool} pool of {cfg.split or cfg.docs}), tools={cfg.tools}, "
             f"greedy unless stated; pass@k from {cfg.n_samples} samples per document at T={cfg.temperature}.",
             f"Factuality backend: {backend}; tau {fmt(first.get('tau', math.nan))}. "
             f"Hallucination counted by: {hallucination_source(cfg, first)}.", ""]
    rules = sorted({k for m in results.values() for k in m if k.startswith("rule_") and k.endswith("_pass")})
    tables = [*TABLES.items(), ("Rules (pass rate)", rules)]
    if any("decision_probe_auc" in m for m in results.values()):
        tables.append((f"Delete decision, teacher-forced on {cfg.decision_traces} traces of {cfg.decision_corpus}",
                       PROBE))
    for title, keys in tables:
        lines += [f"## {title}", "", table(results, keys), ""]
    _plot_bars(results, run_dir / "metrics.png")
    lines += ["![metrics per model](metrics.png)", ""]
    curves = []
    for run in curves_from:
        run = Path(run)
        png = f"curves_{run.name}.png"
        keys = _plot_curves(run, run_dir / png)
        if keys:
            curves.append(f"### {run}\n\n{', '.join(keys)} per step.\n\n![{run.name}]({png})\n")
    if curves:
        lines += ["## Training curves", "", *curves]
    common.atomic_write_text(run_dir / "report.md", "\n".join(lines) + "\n")


def hallucination_source(cfg: Config, metrics: dict) -> str:
    if metrics.get("news_world"):
        return "the news world's oracle (fact table)"
    return f"{rewards.BACKEND_NAMES[cfg.reward.factuality]} claims scored below {cfg.claim_tau}"


def write_episodes(run_dir, kept: dict[str, list]) -> None:
    """episodes.jsonl: every greedy episode of each model, a line per (model, document) in
    evaluation order: the episode as the sandbox keeps it (tool calls, results, retracted
    text), its reward terms and the oracle's errors (null without a fact table). The figures'
    evidence: read the summaries behind a number, or reread them with another measure."""
    lines = [json.dumps(common.jsonable({"model": name, "doc_id": doc.id, "score": score, "errors": errors,
                                          "episode": ep.to_dict()}, nonfinite="null"), ensure_ascii=False,
                        allow_nan=False)
             for name, items in kept.items() for doc, ep, score, errors in items]
    common.atomic_write_text(Path(run_dir) / "episodes.jsonl", "".join(line + "\n" for line in lines))


def write_samples(run_dir, kept: dict[str, list], n: int) -> None:
    """samples.html: the first `n` greedy episodes of each model, oracle errors marked."""
    samples = []
    for name, items in kept.items():
        for doc, ep, score, errors in items[:n]:
            ep.meta["trace_kind"] = f"{name} | F {score['factuality']:.2f} | pass {bool(score['pass'])}"
            ep.meta["id"] = f"{name}:{doc.id}"
            samples.append((ep, None if errors is None else [f"{e['type']}: {e['error_span']}" for e in errors]))
    common.atomic_write_text(Path(run_dir) / "samples.html", traces.render_html(samples, "eval samples"))


COMPARE_HELP = ("--compare A B ...: evaluate each of these on the same documents and seeds, each a model directory, "
                "a model preset or a copying baseline's reserved name (" + ", ".join(BASELINES) + "; the name wins "
                "over a directory so named: write ./NAME for the directory)")


def split_compare(argv: list[str]) -> tuple[list[str], list[str]]:
    """(argv without `--compare DIR ...`, the directories): the config loader takes
    bare flags only, so the directories after --compare are taken out first. A
    directory may be a copying baseline's reserved name (lead-3, best-extract:
    `evaluation.BASELINES`), which means the baseline even where such a directory exists."""
    rest, dirs, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--compare":
            i += 1
            while i < len(argv) and not argv[i].startswith("-") and "=" not in argv[i]:
                dirs.append(argv[i])
                i += 1
            if not dirs:
                raise settings.ConfigError("--compare needs one or more model directories or baseline names ("
                                           + ", ".join(BASELINES) + ")")
            continue
        rest.append(argv[i])
        i += 1
    return rest, dirs


def main(cfg: Config, compare: Sequence[str] = ()) -> dict:
    """Evaluate `cfg.model`, or every directory of `compare`, and write the run's outputs.
    A copying baseline's reserved name (`BASELINES`) is evaluated as a row without a model,
    even where a directory of that name exists."""
    paths = [p if p in BASELINES else modeling.resolve_model_path(p)  # a preset: its folder
             for p in list(compare) or [cfg.model]]
    for p in paths:
        if p not in BASELINES and not Path(p).is_dir():
            raise SystemExit(missing_model_hint(p))
    docs = load_eval_documents(cfg)
    news = all(getattr(d, "facts", None) for d in docs)
    if cfg.reward.factuality == "oracle" and not news:
        raise SystemExit(f"reward.factuality=oracle needs a fact table (news world documents); {cfg.docs} has "
                         "documents without one: set reward.factuality=support (or lexical, learned, fenice)")
    try:  # the baselines' texts first (no model, seconds): one a document cannot serve stops the run here
        copied = {p: baseline_episodes(p, docs, cfg) for p in dict.fromkeys(paths) if p in BASELINES}
    except data.DataError as e:
        raise SystemExit(f"error: {e}") from None
    probe_traces = load_decision_traces(cfg)
    run = common.start_run(cfg)
    common.setup_compute(cfg.torch_threads, cfg.autocast, common.device())
    if cfg.pool != "eval":
        print(f"warning: evaluating the {cfg.pool!r} pool, reserved for the final measurement")
    backend = rewards.BACKEND_NAMES[cfg.reward.factuality]
    print(f"data: {len(docs)} documents ({cfg.pool} pool of {cfg.split or cfg.docs}); factuality: {backend}; "
          f"tools: {cfg.tools}")
    results, kept = {}, {}
    for p in paths:
        common.seed_everything(cfg.seed)
        t0 = time.perf_counter()
        kept[p] = []
        results[p] = m = (evaluate_baseline(p, docs, cfg, kept[p], copied[p]) if p in BASELINES
                          else evaluate_dir(p, docs, cfg, kept[p], probe_traces))
        shown = ("rouge1", "factuality", "fact_precision", "coverage", "key_fact_coverage", "pass",
                 "hallucination_rate", *ORACLE_FREE, "valid_call_rate", "decision_probe_auc", "latency_p50_ms")
        print(f"{p}: " + " | ".join(f"{k} {fmt(m[k])}" for k in shown if k in m)
              + f" | {time.perf_counter() - t0:.1f}s")
    models = [p for p in paths if p not in BASELINES]
    curves = list(dict.fromkeys(r for r in map(run_dir_of, models) if r is not None))
    common.atomic_write_text(run.dir / "eval.json", json.dumps(common.jsonable({
        "config": settings.config_to_dict(cfg), "factuality_backend": backend,
        "models": [{"model": p, "baseline": p in BASELINES, "metrics": m} for p, m in results.items()],
        "hallucination_source": hallucination_source(cfg, {"news_world": news}), "n_docs": len(docs),
        "doc_ids": [d.id for d in docs], "pool": cfg.pool, "curves_from": [str(c) for c in curves],
    }, nonfinite="null"), indent=1, allow_nan=False) + "\n")
    write_report(run.dir, results, cfg, curves)
    write_episodes(run.dir, kept)
    write_samples(run.dir, kept, cfg.html_samples)
    print(f"wrote {run.dir}/eval.json, report.md, metrics.png, samples.html, episodes.jsonl")
    return results


if __name__ == "__main__":
    with settings.config_errors_exit():
        if {"-h", "--help"} & set(sys.argv[1:]):
            print(COMPARE_HELP)
        _argv, _compare = split_compare(sys.argv[1:])
        _cfg, _ = settings.parse_args(Config, _argv, flags=("--compare",))
    main(_cfg, _compare)
