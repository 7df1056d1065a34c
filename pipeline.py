"""The whole chain on the built-in news world, one command, CPU:

    news world -> base -> traces -> corpus -> SFT -> Dr. GRPO -> eval -> distill -> headline table

    python pipeline.py                  # the chain (about 14 minutes on two cores)
    python pipeline.py --full           # + the rules-only RL baseline, the three ablations, SFT without masking
    python pipeline.py --fresh          # rerun every stage, even those whose outputs exist
    python pipeline.py --only sft,rl    # just these stages (their inputs must exist)
    python pipeline.py --set sft.epochs=1 --set rl.steps=4   # a stage's key=value override
    python pipeline.py --profile cnn_qwen3_4b --dry-run       # the real-data chain for one GPU, its commands
    python pipeline.py --profile cnn_qwen3_4b --smoke         # that chain on a CPU with tiny stand-ins (minutes)

Each stage is the stage's own script run with its own config, exactly the
command the README gives for it, in a child process; this file only orders
them, skips a stage whose output already exists (an interrupted stage resumes
from its newest checkpoint: every trainer runs with resume=auto), and reads the
stages' JSON outputs into one table. To change a stage, edit its config; to
add one, add a `Stage`.

The stages: the news world's documents and their leak-cluster split; the base
stage (the tiny policy learns to summarise, tool-free, from freshly generated
documents: the CPU stand-in for a pretrained model); traces drafted by that
base model (its own errors) and by the rule-based drafter, fact-checked by the
world's oracle; the filtered corpus; error-masked SFT; Dr. GRPO; evaluation of
base, SFT and RL on the whole eval pool; distillation.

The headline table goes to stdout and to runs/pipeline/headline.md (with the
project's milestones and the news-world targets marked met / not met), its
figures to runs/pipeline/headline.json.
"""
from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parent


@dataclass
class Stage:
    name: str
    argv: list[str]  # the script and its arguments (run with this Python, from the repo root)
    output: str  # the file or directory that exists once the stage has finished
    full_only: bool = False  # run with --full only
    checkpoints: bool = False  # resumes from its checkpoints (--fresh passes resume=none)


DOCS, SPLIT = "out/newsworld/docs.jsonl", "out/newsworld/split.json"
BASE, SFT, RL = "runs/base_tiny/final", "runs/sft_tiny/final", "runs/rl_tiny/final"
SFT_NOMASK = "runs/sft_tiny_nomask/final"
ABLATIONS = {  # run name -> config: the --full rows of the table
    "rl_tiny_rules_only": "configs/ablation_rules_only.yaml",
    "rl_tiny_no_delete": "configs/ablation_no_delete.yaml",
    "rl_tiny_no_search": "configs/ablation_no_search.yaml",
    "rl_tiny_no_budget": "configs/ablation_no_budget.yaml",
}
STAGES = [
    Stage("docs", ["data.py", "newsworld", "--n", "1000", "--seed", "0", "--out", DOCS], DOCS),
    Stage("split", ["data.py", "split", "--docs", DOCS, "--out", SPLIT], SPLIT),
    Stage("base", ["sft.py", "--config", "configs/base_tiny.yaml"], BASE, checkpoints=True),
    Stage("traces", ["synth_traces.py", "--config", "configs/synth_newsworld.yaml"], "out/traces/newsworld.jsonl"),
    Stage("traces_rules", ["synth_traces.py", "--config", "configs/synth_rules.yaml"], "out/traces/rules.jsonl"),
    Stage("corpus", ["filter_traces.py", "--config", "configs/filter_newsworld.yaml"],
          "out/corpus/newsworld/train.jsonl"),
    Stage("sft", ["sft.py", "--config", "configs/sft_tiny.yaml"], SFT, checkpoints=True),
    Stage("sft_nomask", ["sft.py", "--config", "configs/sft_tiny.yaml", "name=sft_tiny_nomask", "mask_retracted=false"],
          SFT_NOMASK, full_only=True, checkpoints=True),
    Stage("rl", ["rl.py", "--config", "configs/tiny.yaml"], RL, checkpoints=True),
    *[Stage(name, ["rl.py", "--config", cfg], f"runs/{name}/final", full_only=True, checkpoints=True)
      for name, cfg in ABLATIONS.items()],
    Stage("eval", ["eval.py", "--config", "configs/eval_tiny.yaml", "--compare", BASE, SFT, RL],
          "runs/eval_tiny/eval.json"),
    Stage("eval_full", ["eval.py", "--config", "configs/eval_tiny.yaml", "name=eval_tiny_full", "--compare", SFT_NOMASK,
                        *[f"runs/{n}/final" for n in ABLATIONS]], "runs/eval_tiny_full/eval.json", full_only=True),
    Stage("distill", ["distill.py", "--config", "configs/distill_tiny.yaml"], "runs/distill_tiny/distill.json",
          checkpoints=True),
]

# The real-data chain for one GPU (CNN/DailyMail, Qwen3-4B through Unsloth, an
# OpenAI-compatible teacher): the recipe's stages in order. `--dry-run` prints it.
CNN = "out/cnn/train.jsonl"
GPU_RUNS = {v: f"runs/{v}/final" for v in ("sft_qwen3_4b", "rejection_qwen3_4b", "teacher_sft_qwen3_4b",
                                             "kto_qwen3_4b", "drgrpo_v17", "drgrpo_v18", "drgrpo_v19")}
CNN_STAGES = [
    Stage("docs", ["data.py", "load", "--hf", "cnn_dailymail", "--split", "train",
                   "--limit", "20000", "--out", CNN], CNN),
    Stage("eval_docs", ["data.py", "load", "--hf", "cnn_dailymail", "--split", "validation",
                        "--limit", "500", "--out", "out/cnn/eval.jsonl"], "out/cnn/eval.jsonl"),
    Stage("split", ["data.py", "split", "--docs", CNN, "--out", "out/cnn/split.json"], "out/cnn/split.json"),
    Stage("traces", ["synth_traces.py", "--config", "configs/synth_api.yaml"], "out/traces/cnn.jsonl"),
    Stage("corpus", ["filter_traces.py", "--config", "configs/filter_cnn.yaml"], "out/corpus/cnn/train.jsonl"),
    Stage("sft", ["sft.py", "--config", "configs/sft_qwen3_4b.yaml"], GPU_RUNS["sft_qwen3_4b"], checkpoints=True),
    Stage("rejection", ["sft.py", "--config", "configs/rejection_qwen3_4b.yaml"], GPU_RUNS["rejection_qwen3_4b"],
          checkpoints=True),
    Stage("teacher", ["teacher_episodes.py", "--config", "configs/teacher_cnn.yaml"], "out/teacher/cnn_train.done.json"),
    Stage("teacher_sft", ["sft.py", "--config", "configs/teacher_sft_qwen3_4b.yaml"], GPU_RUNS["teacher_sft_qwen3_4b"],
          checkpoints=True),
    Stage("kto", ["sft.py", "--config", "configs/kto_qwen3_4b.yaml"], GPU_RUNS["kto_qwen3_4b"], checkpoints=True),
    *[Stage(f"rl_v{v}", ["rl.py", "--config", f"configs/drgrpo_v{v}.yaml"], GPU_RUNS[f"drgrpo_v{v}"], checkpoints=True)
      for v in (17, 18, 19)],
    Stage("eval", ["eval.py", "--config", "configs/eval_cnn.yaml", "--compare", *GPU_RUNS.values()],
          "runs/eval_cnn/eval.json"),
    Stage("distill", ["distill.py", "--config", "configs/distill_cnn.yaml"], "runs/distill_cnn/distill.json",
          checkpoints=True),
]
PROFILES = {"newsworld": STAGES, "cnn_qwen3_4b": CNN_STAGES}

# --smoke: the same chain, the same configs, on a CPU in a few minutes. Only models,
# data and step counts are overridden: every model is a tiny preset (hf backend, no
# quantisation), the news world stands in for CNN/DailyMail, the teacher is
# oracle_server.py on 127.0.0.1 ({api} below), and each training stage takes ~2 steps.
_TINY = ["model.name_or_path=tiny-1m", "model.quant=none", "model.backend=hf", "model.max_seq_len=2048"]
_TINY_RL = [*_TINY, "model.fast_inference=false", "sampling.backend=hf", "steps=2", "prompts_per_step=2",
            "group_size=2", "sampling.max_new_tokens=32", "sampling.max_context_tokens=2048", "eval.n_docs=2",
            "eval.max_new_tokens=16", "reward.factuality=lexical", "data.max_prompt_tokens=0", "save_every=0"]
_TINY_SFT = [*_TINY, "epochs=1", "data.limit=8", "data.max_tokens=2048", "batch_episodes=4", "grad_accum=1",
             "eval.every=0", "eval.sample_every=0", "eval.n_docs=2", "eval.max_new_tokens=16",
             "reward.factuality=lexical", "save_every=0", "warmup_steps=0"]
SMOKE = {  # stage -> (argv replacing the stage's, or None to keep it) and the overrides it adds
    "docs": (["data.py", "newsworld", "--n", "40", "--seed", "0", "--out", CNN], []),
    "eval_docs": (["data.py", "newsworld", "--n", "8", "--seed", "7", "--out", "out/cnn/eval.jsonl"], []),
    "traces": (None, ["drafter.backend=newsworld", "drafter.drafts_per_doc=1", "annotator.api_base={api}",
                      "annotator.api_model=oracle", "annotator.retries=0", "judge.api_base={api}",
                      "judge.api_model=oracle", "judge.retries=0", "limit=12",
                      "batch_docs=12"]),
    "corpus": (None, ["tokenizer=tiny-1m", "max_tokens=2048", "judge_min=0"]),
    "sft": (None, _TINY_SFT),
    "rejection": (None, [*_TINY_SFT, "rejection.k=2", "rejection.max_docs=2"]),
    "teacher": (None, ["sampling.api_base={api}", "sampling.api_model=oracle", "sampling.api_retries=0",
                       "data.max_docs=12", "chunk=6"]),
    "teacher_sft": (None, _TINY_SFT),
    "kto": (None, [*_TINY_SFT, "kto.min_emission_ratio=0.5"]),
    "rl_v17": (None, _TINY_RL),
    "rl_v18": (None, _TINY_RL),
    "rl_v19": (None, _TINY_RL),
    "eval": (None, ["base.quant=none", "n_docs=4", "n_samples=1", "max_new_tokens=16", "latency_docs=2",
                    "batch_size=8", "reward.factuality=lexical"]),
    "distill": (None, ["student.name_or_path=tiny-0.3m", "steps=2", "data.max_train_docs=4", "generate.filter=none",
                       "generate.max_new_tokens=16", "eval.n_docs=2", "eval.latency_docs=2", "eval.max_new_tokens=16",
                       "eval.factuality=lexical", "reward.factuality=lexical", "batch_episodes=2", "save_every=0"]),
}


def with_overrides(stage: Stage, over: list[str], argv: list[str] | None = None) -> Stage:
    """`stage` (its command replaced by `argv` if given) with key=value overrides, which
    go before eval's `--compare` list."""
    argv = list(argv or stage.argv)
    at = argv.index("--compare") if "--compare" in argv else len(argv)
    return dataclasses.replace(stage, argv=[*argv[:at], *over, *argv[at:]])


def smoke_stage(stage: Stage) -> Stage:
    """`stage` with its --smoke replacement command or overrides; "{api}" stays for the
    oracle teacher's URL, known once it is started."""
    argv, over = SMOKE.get(stage.name, (None, []))
    return with_overrides(stage, over, argv)


def selected(stage: Stage, only: list[str], full: bool) -> bool:
    """Whether this call runs `stage`: the --only list when given, else every stage but --full's."""
    return stage.name in only if only else (full or not stage.full_only)


def run_stage(stage: Stage, cwd: Path) -> float:
    """Run one stage in `cwd` (its outputs land there); returns its wall-clock
    seconds. A failing stage stops the pipeline with the command to rerun it."""
    script, *rest = stage.argv
    rest = [str(ROOT / a) if a.startswith("configs/") else a for a in rest]
    cmd = [sys.executable, str(ROOT / script), *rest]
    print(f"\n=== {stage.name}: {' '.join(['python', *stage.argv])}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=cwd)
    if rc != 0:
        raise SystemExit(f"pipeline: stage {stage.name!r} failed (exit {rc}); rerun it alone with\n"
                         f"  python {' '.join(stage.argv)}\nthen `python pipeline.py` continues from there")
    if not (cwd / stage.output).exists():
        raise SystemExit(f"pipeline: stage {stage.name!r} finished but did not write {stage.output}")
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------
# The headline table
# ---------------------------------------------------------------------------


def _missing(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _pct(x) -> str:
    return "n/a" if _missing(x) else f"{100 * x:.1f}%"


def _num(x, fmt: str = "{:.1f}") -> str:
    return "n/a" if _missing(x) else fmt.format(x)


def _ge(x, bound: float) -> bool | None:
    return None if _missing(x) else x >= bound


def _points(gap: float) -> str:
    """A teacher-minus-student factuality gap in points, in words."""
    return f"factuality {abs(gap):.1f} points {'below' if gap > 0 else 'above'} the teacher"


ROWS = [  # (label, model directory): the table's rows, --full rows after the first three
    ("base (no tools)", BASE), ("SFT (tools)", SFT), ("Dr. GRPO", RL),
    ("SFT, errors not masked", SFT_NOMASK),
    *[(name.replace("rl_tiny_", "RL ").replace("_", " "), f"runs/{name}/final") for name in ABLATIONS],
]
COLUMNS = [  # (header, metric, format)
    ("fact precision", "fact_precision", "pct"), ("hallucination", "hallucination_rate", "pct"),
    ("errors / summary", "errors_per_summary", "{:.2f}"), ("combined pass", "pass", "pct"),
    ("rule pass", "rules_pass", "pct"), ("valid calls", "valid_call_rate", "pct"),
    ("searches", "searches", "{:.2f}"), ("deletes", "deletes", "{:.2f}"), ("tool AUC", "tool_auc", "{:.2f}"),
    ("search finds the fact", "search_found_fact", "pct"), ("evidence use", "evidence_use", "pct"),
    ("pass@1 (T=1)", "pass_at_1", "pct"), ("ROUGE-L", "rougeL", "{:.3f}"), ("p50 ms", "latency_p50_ms", "{:.0f}"),
]


def _cell(x, fmt: str) -> str:
    return _pct(x) if fmt == "pct" else _num(x, fmt)


def _rising(*xs) -> bool | None:
    return None if any(_missing(x) for x in xs) else all(a < b for a, b in zip(xs, xs[1:]))


def headline(eval_json: dict, distill_json: dict | None, full_json: dict | None = None,
             seconds: dict[str, float] | None = None) -> tuple[str, dict]:
    """(markdown, figures) of the pipeline's outcome: base, SFT and Dr. GRPO (and
    with --full the baselines and ablations) on the held-out pool, the issue's
    news-world targets and the project's milestones, each marked met or not met."""
    models = {m["model"]: m["metrics"] for j in (eval_json, full_json or {}) for m in j.get("models", [])}
    base, sft, rl = models.get(BASE, {}), models.get(SFT, {}), models.get(RL, {})
    backend = eval_json.get("factuality_backend", "?")
    rows = [(label, models[path]) for label, path in ROWS if path in models]
    lines = [f"Held-out news world, {eval_json.get('n_docs', '?')} documents (the whole eval pool), greedy; "
             f"factuality: {backend}. Fact precision: the names, numbers and dates stated that the oracle "
             "supports; tool AUC: the search/delete decision as a detector of the policy's wrong sentences.", "",
             "| model | " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for label, m in rows:
        lines.append(f"| {label} | " + " | ".join(_cell(m.get(k), f) for _, k, f in COLUMNS) + " |")
    fams = sorted({k[4:-len("_fact_precision")] for m in (base, sft, rl) for k in m
                   if k.startswith("fam_") and k.endswith("_fact_precision")})
    if fams:
        lines += ["", "| fact precision by event family | " + " | ".join(fams) + " |", "|---" * (len(fams) + 1) + "|"]
        lines += [f"| {label} | " + " | ".join(_pct(m.get(f"fam_{f}_fact_precision")) for f in fams) + " |"
                  for label, m in rows[:3]]
    fig = {"base": base, "sft": sft, "rl": rl, "factuality_backend": backend,
           "rows": {label: m for label, m in rows}}
    student_ok, student_shown, speed_ok, speed_shown = None, "-", None, "-"
    if distill_json:
        t, s = distill_json.get("teacher", {}), distill_json.get("student", {})
        lines += ["", "| distillation | p50 ms per summary | factuality | combined pass |", "|---|---|---|---|",
                  f"| teacher (Dr. GRPO policy, tools) | {_num(t.get('latency_p50_ms'), '{:.0f}')} | "
                  f"{_pct(t.get('factuality'))} | {_pct(t.get('pass'))} |",
                  f"| student (no tools) | {_num(s.get('latency_p50_ms'), '{:.0f}')} | {_pct(s.get('factuality'))} | "
                  f"{_pct(s.get('pass'))} |"]
        fig["teacher"], fig["student"] = t, s
        ms, t_ms = s.get("latency_p50_ms"), t.get("latency_p50_ms")
        gap = 100 * ((t.get("factuality") or 0) - (s.get("factuality") or 0))
        if ms is not None:
            student_ok = ms <= 100 and gap <= 2
            student_shown = f"{ms:.0f} ms, {_points(gap)}"
        if ms and t_ms:
            speed_ok, speed_shown = t_ms / ms >= 3 and gap <= 2, f"{t_ms / ms:.1f}x faster, {_points(gap)}"
    fp = [m.get("fact_precision") for m in (base, sft, rl)]
    hall = [m.get("hallucination_rate") for m in (base, sft, rl)]
    targets = [
        ("fact precision rises: base < SFT < Dr. GRPO", " -> ".join(map(_pct, fp)), _rising(*fp)),
        ("hallucination falls with it", " -> ".join(map(_pct, hall)),
         _rising(*[-h if not _missing(h) else h for h in hall])),
        ("tool AUC >= 0.75 after SFT", _num(sft.get("tool_auc"), "{:.2f}"), _ge(sft.get("tool_auc"), 0.75)),
        ("tool AUC >= 0.85 after Dr. GRPO", _num(rl.get("tool_auc"), "{:.2f}"), _ge(rl.get("tool_auc"), 0.85)),
        ("searches return the sentence holding the fact >= 80% (Dr. GRPO)", _pct(rl.get("search_found_fact")),
         _ge(rl.get("search_found_fact"), 0.80)),
        ("evidence use >= 90% after Dr. GRPO", _pct(rl.get("evidence_use")), _ge(rl.get("evidence_use"), 0.90)),
    ]
    # Milestones (M0-M3, README): each with its measured value.
    rules_only = models.get("runs/rl_tiny_rules_only/final")
    base_label = "the rules-only RL baseline" if rules_only else "the SFT start (run --full for the rules-only baseline)"
    h0, h1 = (rules_only or sft).get("hallucination_rate"), rl.get("hallucination_rate")
    drop = float("nan") if _missing(h0) or _missing(h1) or not h0 else (h0 - h1) / h0
    marks = [
        ("tool calls valid >= 95% (after SFT)", _pct(sft.get("valid_call_rate")), _ge(sft.get("valid_call_rate"), 0.95)),
        ("M0 rule pass >= 20% (Dr. GRPO)", _pct(rl.get("rules_pass")), _ge(rl.get("rules_pass"), 0.20)),
        (f"M1 hallucinations down >= 40% vs {base_label}", f"{_pct(h0)} -> {_pct(h1)}", _ge(drop, 0.40)),
        ("M2 combined pass >= 60% (Dr. GRPO)", _pct(rl.get("pass")), _ge(rl.get("pass"), 0.60)),
        ("M3 student <= 100 ms per summary, factuality within 2 points", student_shown, student_ok),
        ("student >= 3x faster than its teacher, within 2 points (news world target)", speed_shown, speed_ok),
    ]
    for title, items, key in (("news-world target", targets, "targets"), ("milestone", marks, "milestones")):
        lines += ["", f"| {title} | measured | status |", "|---|---|---|"]
        for name, shown, ok in items:
            lines.append(f"| {name} | {shown} | {'not measured' if ok is None else 'met' if ok else 'not met'} |")
        fig[key] = {name: ok for name, _, ok in items}
    if seconds:
        total = sum(seconds.values())
        lines += ["", "Stage times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
                  + f"; total {total:.0f} ({total / 60:.1f} min)"]
        fig["seconds"] = seconds
    return "\n".join(lines) + "\n", fig


def stage_overrides(items: list[str], stages: list[Stage]) -> dict[str, list[str]]:
    """`--set STAGE.KEY=VALUE` items as {stage: [KEY=VALUE, ...]}; a malformed item or an
    unknown stage exits naming it and the stages."""
    names = [s.name for s in stages]
    extra: dict[str, list[str]] = {}
    for item in items:
        name, _, kv = item.partition(".")
        if "=" not in kv or name not in names:
            raise SystemExit(f"pipeline: --set {item!r}: expected STAGE.KEY=VALUE with a stage among {names}")
        extra.setdefault(name, []).append(kv)
    return extra


def stage_names(csv: str, stages: list[Stage]) -> list[str]:
    """The stage names of a comma-separated `--only` list; an unknown one exits naming it and the stages."""
    only = [s for s in csv.split(",") if s]
    unknown = set(only) - {s.name for s in stages}
    if unknown:
        raise SystemExit(f"pipeline: unknown stage(s) {sorted(unknown)}; stages: {[s.name for s in stages]}")
    return only


def main(argv: list[str] | None = None) -> dict:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="newsworld", choices=sorted(PROFILES),
                    help="newsworld: the CPU chain (default); cnn_qwen3_4b: the real-data chain for one GPU")
    ap.add_argument("--dry-run", action="store_true", help="print the profile's stage commands in order and stop")
    ap.add_argument("--smoke", action="store_true",
                    help="(cnn_qwen3_4b) the same chain on a CPU in minutes: tiny models, the news world for the "
                         "data, a local oracle teacher; in out/smoke/PROFILE unless --workdir is given")
    ap.add_argument("--full", action="store_true",
                    help="add the rules-only RL baseline, the three ablations and SFT without error masking")
    ap.add_argument("--fresh", action="store_true", help="rerun stages whose outputs exist")
    ap.add_argument("--only", default="", help="comma-separated stage names: " + ", ".join(s.name for s in STAGES))
    ap.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                    help="an override for one stage's script, e.g. sft.epochs=1 (repeatable)")
    ap.add_argument("--workdir", default=None, help="where out/ and runs/ go (default: here)")
    ap.add_argument("--out", default="runs/pipeline", help="where the headline table goes (in workdir)")
    args = ap.parse_args(argv)
    stages = PROFILES[args.profile]
    if args.smoke and args.profile == "newsworld":
        raise SystemExit("pipeline: --smoke is for a GPU profile (--profile cnn_qwen3_4b); the newsworld chain is "
                         "already the CPU one")
    if args.smoke:
        stages = [smoke_stage(st) for st in stages]
    extra = stage_overrides(args.set, stages)
    only = stage_names(args.only, stages)
    if args.dry_run:
        for stage in stages:
            if selected(stage, only, args.full):
                print(f"{stage.name:12s} python {' '.join(with_overrides(stage, extra.get(stage.name, [])).argv)}")
        return {}
    work = Path(args.workdir or (f"out/smoke/{args.profile}" if args.smoke else ".")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    server = None
    out = work / args.out
    seconds_path = out / "seconds.json"
    seconds = json.loads(seconds_path.read_text()) if seconds_path.exists() and not args.fresh else {}
    t_start = time.perf_counter()
    for stage in stages:
        if not selected(stage, only, args.full):
            continue
        if (work / stage.output).exists() and not args.fresh and stage.name not in only:
            print(f"=== {stage.name}: {stage.output} exists, skipped (--fresh reruns it)")
            continue
        if args.fresh and stage.checkpoints:  # a fresh rerun must not resume the old run
            extra.setdefault(stage.name, []).append("resume=none")
        elif args.fresh and (work / stage.output).is_file():
            # nor build on an old output: synth resumes an existing trace file, and a frozen split refuses a rewrite
            (work / stage.output).unlink()
        stage = with_overrides(stage, extra.get(stage.name, []))
        if any("{api}" in a for a in stage.argv):  # --smoke: the oracle teacher, started once the documents exist
            if server is None:
                import data
                import oracle_server

                api, server = oracle_server.serve(data.read_documents(str(work / CNN)))
            stage = dataclasses.replace(stage, argv=[a.replace("{api}", api) for a in stage.argv])
        seconds[stage.name] = run_stage(stage, work)
        common.atomic_write_text(seconds_path, json.dumps(seconds, indent=1))
    if server is not None:
        server.shutdown()
    if args.profile != "newsworld":
        report = work / "runs/eval_cnn/report.md"
        print(f"pipeline: {args.profile} done in {time.perf_counter() - t_start:.0f} s this call"
              + (f"; the evaluation is in {report.relative_to(work)}" if report.exists() else ""))
        return {}
    eval_path = work / "runs/eval_tiny/eval.json"
    if not eval_path.exists():
        print("pipeline: no evaluation yet; the headline table needs the eval stage")
        return {}
    full_path = work / "runs/eval_tiny_full/eval.json"
    distill_path = work / "runs/distill_tiny/distill.json"
    md, fig = headline(json.loads(eval_path.read_text()),
                       json.loads(distill_path.read_text()) if distill_path.exists() else None,
                       json.loads(full_path.read_text()) if args.full and full_path.exists() else None, seconds)
    common.atomic_write_text(out / "headline.md", md)
    common.atomic_write_text(out / "headline.json", json.dumps(fig, indent=1, default=str))
    print("\n" + md)
    print(f"pipeline: {time.perf_counter() - t_start:.0f} s this call; table in {args.out}/headline.md")
    return fig


if __name__ == "__main__":
    main()
