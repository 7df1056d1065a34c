"""The whole chain on the built-in news world, one command, CPU:

    python pipeline.py                  # SmolLM2-135M-Instruct: zero-shot -> traces -> SFT -> Dr. GRPO -> student, 1 seed
    python pipeline.py --seeds 3        # three seeds: every figure with its spread over seeds (3x the time)
    python pipeline.py --full           # + SFT without masking, the rules-only RL baseline and three ablations
    python pipeline.py --profile tiny   # the tiny 1M-parameter chain from scratch (base stage included): a fast look
    python pipeline.py --fresh          # rerun every stage, even those whose outputs exist
    python pipeline.py --only sft,rl    # just these stages, every seed (their inputs must exist)
    python pipeline.py --set sft.epochs=1 --set rl.steps=4   # a stage's key=value override, every seed
    python pipeline.py --profile cnn_qwen3_4b --dry-run       # the real-data chain for one GPU, its commands
    python pipeline.py --profile cnn_qwen3_4b --smoke         # that chain on a CPU with tiny stand-ins (minutes)

Each stage is the stage's own script run with its own config, exactly the
command the README gives for it, in a child process; this file only orders
them, skips a stage whose output already exists (an interrupted stage resumes
from its newest checkpoint: every trainer runs with resume=auto), and reads the
stages' JSON outputs into one table. To change a stage, edit its config; to
add one, add a `Stage`. The terminal shows each stage's command, progress bar,
time and result; its whole output goes to runs/pipeline/logs/STAGE.log
(`--verbose` shows it, resolved config included).

Seeds (`--seeds N`): the trace draw, SFT, RL and distillation run once per seed,
seed 0 with the configs as they are and seed k >= 1 with `seed=k` and its own
output paths (suffix `_sK`); the untrained start is shared. Every figure of the
table is then the mean over seeds with its min-max beside it, and a step from
one row to the next counts as a rise only when it is larger than both rows'
spreads.

The smollm profile (the default): the news world's documents and their
leak-cluster split; SmolLM2's zero-shot evaluation; per seed, traces from its
own drafts and from the rule-based drafter, fact-checked by the world's oracle;
the filtered corpus; error-masked LoRA SFT; Dr. GRPO; a distilled student; the
evaluation of SFT, RL and student on the whole eval pool. The tiny profile has a
base stage first (a 1M-parameter model learns to summarise from scratch, the CPU
stand-in for pretraining) and evaluates base, SFT and RL.

The headline table goes to stdout and to runs/pipeline/headline.md (with the
profile's targets and the project's milestones marked met / not met), its
figures to runs/pipeline/headline.json and a plot of them by stage to
runs/pipeline/headline.png. The news profile also writes runs/pipeline/summaries.md:
every row's summaries of the same two held-out documents, drawn at random.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import math
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from factual_tools import common

ROOT = Path(__file__).resolve().parent


@dataclass
class Stage:
    name: str
    argv: list[str]  # the script and its arguments (run with this Python, from the repo root)
    output: str  # the file or directory that exists once the stage has finished
    full_only: bool = False  # run with --full only
    checkpoints: bool = False  # resumes from its checkpoints (--fresh passes resume=none)
    seed: int | None = None  # the seed this stage runs for (None: shared by every seed)
    # a failure is reported and the chain goes on without its output (the student: a
    # failed distillation must not cost the SFT and RL rows their evaluation)
    optional: bool = False

    @property
    def label(self) -> str:
        """The name, and the seed after it for seeds >= 1 (seed 0 runs the configs as they are)."""
        return f"{self.name}[s{self.seed}]" if self.seed else self.name


def suffix(seed: int) -> str:
    """Seed 0 writes where the configs say; seed k >= 1 appends `_sK`."""
    return f"_s{seed}" if seed else ""


def seeded(seed: int, *over: str) -> list[str]:
    """The overrides that make a stage seed k's: `seed=k` and its own outputs (none for seed 0)."""
    return [f"seed={seed}", *over] if seed else []


# ---------------------------------------------------------------------------
# The news-world chains: SmolLM2 (default) and the tiny model
# ---------------------------------------------------------------------------

DOCS, SPLIT = "out/newsworld/docs.jsonl", "out/newsworld/split.json"
WORLD = [
    Stage("docs", ["-m", "newsworld", "generate", "--n", "1000", "--seed", "0", "--out", DOCS], DOCS),
    Stage("split", ["data.py", "split", "--docs", DOCS, "--out", SPLIT], SPLIT),
]


@dataclass
class Chain:
    """A news-world profile: what each stage writes per seed and what the headline reads."""
    name: str  # run-name stem: sft_NAME, rl_NAME, eval_NAME, distill_NAME
    start: tuple[str, str]  # (row label, model directory) of the untrained start, shared by every seed
    traces: str  # trace-file stem: out/traces/TRACES.jsonl (the model's drafts) and RULES.jsonl
    rules: str
    corpus: str  # out/corpus/CORPUS
    ablations: dict[str, str]  # --full: RL run name -> its config (extends the chain's RL config)
    seeds: int  # the default --seeds
    targets: Callable[[dict], list[tuple[str, str, bool | None]]]
    # the student is evaluated with SFT and RL on the whole pool (its table row and the
    # distillation table come from there); else distill.py's own comparison is read
    eval_student: bool = False

    def run(self, stage: str, seed: int) -> str:
        return f"runs/{stage}_{self.name}{suffix(seed)}"

    def sft(self, seed: int) -> str:
        return self.run("sft", seed) + "/final"

    def rl(self, seed: int) -> str:
        return self.run("rl", seed) + "/final"

    def nomask(self, seed: int) -> str:
        return self.run("sft", seed) + "_nomask/final"

    def ablation(self, name: str, seed: int) -> str:
        return f"runs/{name}{suffix(seed)}/final"

    def student(self, seed: int) -> str:
        return self.run("distill", seed) + "/final"

    def rows(self, seeds: int, full: bool) -> list[tuple[str, list[str]]]:
        """(label, model directory of each seed) of every table row."""
        ss = range(seeds)
        rows = [(self.start[0], [self.start[1]]), ("SFT (tools)", [self.sft(s) for s in ss]),
                ("Dr. GRPO", [self.rl(s) for s in ss])]
        if self.eval_student:
            rows += [("student (no tools)", [self.student(s) for s in ss])]
        if full:
            rows += [("SFT, errors not masked", [self.nomask(s) for s in ss])]
            rows += [(ablation_label(n), [self.ablation(n, s) for s in ss]) for n in self.ablations]
        return rows


def ablation_label(run_name: str) -> str:
    """rl_tiny_no_delete -> 'RL no delete'."""
    return "RL " + run_name.split("_", 2)[2].replace("_", " ")


def chain_stages(c: Chain, seeds: int, cfg: dict[str, str], base: list[Stage]) -> list[Stage]:
    """The chain `c` for `seeds` seeds: the world, `base` (shared), then each seed's
    traces, corpus, SFT, RL and distillation and their evaluation. `cfg` names each
    stage's config file."""
    stages = [*WORLD, *base]
    for s in range(seeds):
        x = suffix(s)
        traces, rules = f"out/traces/{c.traces}{x}.jsonl", f"out/traces/{c.rules}{x}.jsonl"
        corpus = f"out/corpus/{c.corpus}{x}"
        corpus_over = [f"traces=[{traces},{rules}]", f"out_dir={corpus}"] if s else []
        data_over = [f"data.train={corpus}/train.jsonl", f"data.eval={corpus}/eval.jsonl"] if s else []
        # seed 0's evaluation holds the untrained start too, unless a stage of `base` evaluates it
        start = [c.start[1]] if s == 0 and not any(st.output.endswith("eval.json") for st in base) else []
        evals = [*start, c.sft(s), c.rl(s), *([c.student(s)] if c.eval_student else [])]
        stages += [
            Stage("traces", ["synth_traces.py", "--config", cfg["traces"], *seeded(s, f"out_path={traces}")], traces,
                  seed=s),
            Stage("traces_rules", ["synth_traces.py", "--config", cfg["traces_rules"], *seeded(s, f"out_path={rules}")],
                  rules, seed=s),
            Stage("corpus", ["filter_traces.py", "--config", cfg["corpus"], *corpus_over], f"{corpus}/train.jsonl",
                  seed=s),
            Stage("sft", ["sft.py", "--config", cfg["sft"], *seeded(s, f"name=sft_{c.name}{x}", *data_over)],
                  c.sft(s), checkpoints=True, seed=s),
            Stage("sft_nomask", ["sft.py", "--config", cfg["sft"], f"name=sft_{c.name}{x}_nomask", "mask_retracted=false",
                                 *seeded(s, *data_over)], c.nomask(s), full_only=True, checkpoints=True, seed=s),
            Stage("rl", ["rl.py", "--config", cfg["rl"], *seeded(s, f"name=rl_{c.name}{x}", f"init={c.sft(s)}")],
                  c.rl(s), checkpoints=True, seed=s),
            *[Stage(n, ["rl.py", "--config", ablation, *seeded(s, f"name={n}{x}", f"init={c.sft(s)}")],
                    c.ablation(n, s), full_only=True, checkpoints=True, seed=s) for n, ablation in c.ablations.items()],
            Stage("distill", ["distill.py", "--config", cfg["distill"],
                              *seeded(s, f"name=distill_{c.name}{x}", f"teacher={c.rl(s)}")],
                  f"{c.run('distill', s)}/distill.json", checkpoints=True, seed=s, optional=True),
            Stage("eval", ["eval.py", "--config", cfg["eval"], *seeded(s, f"name=eval_{c.name}{x}"), "--compare",
                           *evals], f"{c.run('eval', s)}/eval.json", seed=s),
            *full_evals(c, s, cfg["eval"]),
        ]
    return stages


def ablation_tools(run_name: str) -> str:
    """The eval.py `tools` an ablation is measured with: the tool its RL run was trained
    without is banned at decode time too (rl_smollm_no_delete -> no_delete); any other
    run keeps every tool."""
    return next((t for t in ("no_delete", "no_search") if run_name.endswith(t)), "all")


def full_evals(c: Chain, seed: int, config: str) -> list[Stage]:
    """--full's evaluations of seed `seed`: SFT without masking and the ablations, one
    eval.py call per decode-time tool setting (eval_full: every tool; eval_full_no_delete,
    eval_full_no_search: the ablations trained without that tool)."""
    by_tools: dict[str, list[str]] = {"all": [c.nomask(seed)]}
    for n in c.ablations:
        by_tools.setdefault(ablation_tools(n), []).append(c.ablation(n, seed))
    stages = []
    for tools, models in by_tools.items():
        tail = "" if tools == "all" else f"_{tools}"
        run = f"{c.run('eval', seed)}_full{tail}"
        stages.append(Stage(f"eval_full{tail}", ["eval.py", "--config", config, f"name={Path(run).name}",
                                                 *seeded(seed), *([f"tools={tools}"] if tail else []),
                                                 "--compare", *models],
                            f"{run}/eval.json", full_only=True, seed=seed))
    return stages


# Fact precision counts the facts a summary states and hallucination the summaries with an
# error, so a policy that says nothing scores 100% and 0% on them. Past this share of
# summaries stating no name, number or date, a target on either is not met.
MAX_NO_FACT = 0.05


def _silent(m: dict) -> bool:
    x = m.get("no_fact_rate")
    return not _missing(x) and x > MAX_NO_FACT


def _stated(ok: bool | str | None, *rows: dict) -> bool | str | None:
    """A precision or hallucination verdict, false when a row states too little to judge."""
    return False if isinstance(ok, bool) and any(_silent(m) for m in rows) else ok


def _said(m: dict, key: str) -> str:
    """A row's figure, with the share stating no fact when that share voids it."""
    return _pct(m.get(key)) + (f" ({_pct(m['no_fact_rate'])} state no fact)" if _silent(m) else "")


def _tiny_targets(fig: dict) -> list[tuple[str, str, bool | None]]:
    base, sft, rl = rows = fig["start"], fig["sft"], fig["rl"]
    fp = [m.get("fact_precision") for m in rows]
    hall = [m.get("hallucination_rate") for m in rows]
    return [
        ("fact precision rises: base < SFT < Dr. GRPO", " -> ".join(_said(m, "fact_precision") for m in rows),
         _stated(_rising(*fp), *rows)),
        ("hallucination falls with it", " -> ".join(_said(m, "hallucination_rate") for m in rows),
         _stated(_rising(*[-h if not _missing(h) else h for h in hall]), *rows)),
        ("tool AUC >= 0.75 after SFT", _num(sft.get("tool_auc"), "{:.2f}"), _ge(sft.get("tool_auc"), 0.75)),
        ("tool AUC >= 0.85 after Dr. GRPO", _num(rl.get("tool_auc"), "{:.2f}"), _ge(rl.get("tool_auc"), 0.85)),
        ("searches return the sentence holding the fact >= 80% (Dr. GRPO)", _pct(rl.get("search_found_fact")),
         _ge(rl.get("search_found_fact"), 0.80)),
        ("evidence use >= 90% after Dr. GRPO", _pct(rl.get("evidence_use")), _ge(rl.get("evidence_use"), 0.90)),
    ]


def _smollm_targets(fig: dict) -> list[tuple[str, str, bool | None]]:
    zs, sft, rl = rows = fig["start"], fig["sft"], fig["rl"]
    per = fig["per_seed"]
    steps = [_step_up(per["start"], per["sft"], "fact_precision"), _step_up(per["sft"], per["rl"], "fact_precision")]
    rises = _spread_judged(None if None in steps else all(steps), per["sft"], per["rl"])  # zero-shot: one greedy row
    return [
        ("fact precision rises zero-shot -> SFT -> Dr. GRPO, each step beyond the seed spread",
         " -> ".join(_said(m, "fact_precision") for m in rows), _stated(rises, *rows)),
        ("fact precision >= 95% after Dr. GRPO", _said(rl, "fact_precision"),
         _stated(_ge(rl.get("fact_precision"), 0.95), rl)),
        ("hallucination <= 30% after Dr. GRPO", _said(rl, "hallucination_rate"),
         _stated(_ge(-rl.get("hallucination_rate", math.nan), -0.30), rl)),
        ("searches return the sentence holding the checked fact >= 90% (Dr. GRPO)", _pct(rl.get("search_found_fact")),
         _ge(rl.get("search_found_fact"), 0.90)),
        ("evidence use >= 90% after Dr. GRPO", _seed_cell([m.get("evidence_use") for m in per["rl"]], "pct"),
         _ge(rl.get("evidence_use"), 0.90)),
        ("tool AUC >= 0.80 after SFT", _num(sft.get("tool_auc"), "{:.2f}"), _ge(sft.get("tool_auc"), 0.80)),
        ("tool AUC >= 0.90 after Dr. GRPO", _num(rl.get("tool_auc"), "{:.2f}"), _ge(rl.get("tool_auc"), 0.90)),
    ]


TINY = Chain("tiny", ("base (no tools)", "runs/base_tiny/final"), "newsworld", "rules", "newsworld",
             {"rl_tiny_rules_only": "configs/ablation_rules_only.yaml",
              "rl_tiny_no_delete": "configs/ablation_no_delete.yaml",
              "rl_tiny_no_search": "configs/ablation_no_search.yaml",
              "rl_tiny_no_budget": "configs/ablation_no_budget.yaml"}, seeds=1, targets=_tiny_targets)
SMOLLM = Chain("smollm", ("zero-shot (no tools)", "out/models/smollm2-135m"), "smollm", "rules_smollm", "smollm",
               {"rl_smollm_rules_only": "configs/ablation_smollm_rules_only.yaml",
                "rl_smollm_no_delete": "configs/ablation_smollm_no_delete.yaml",
                "rl_smollm_no_search": "configs/ablation_smollm_no_search.yaml",
                "rl_smollm_no_budget": "configs/ablation_smollm_no_budget.yaml"}, seeds=1, targets=_smollm_targets,
               eval_student=True)


def tiny_stages(seeds: int = 1) -> list[Stage]:
    base = Stage("base", ["sft.py", "--config", "configs/base_tiny.yaml"], TINY.start[1], checkpoints=True)
    return chain_stages(TINY, seeds, {
        "traces": "configs/synth_newsworld.yaml", "traces_rules": "configs/synth_rules.yaml",
        "corpus": "configs/filter_newsworld.yaml", "sft": "configs/sft_tiny.yaml", "rl": "configs/tiny.yaml",
        "distill": "configs/distill_tiny.yaml", "eval": "configs/eval_tiny.yaml"}, [base])


def smollm_stages(seeds: int = 1) -> list[Stage]:
    # zero-shot: the pretrained model as it is, tools banned (it has never seen them); greedy, so shared by seeds
    zero_shot = Stage("zero_shot", ["eval.py", "--config", "configs/eval_smollm.yaml", "name=eval_smollm_zero_shot",
                                    "tools=none", "--compare", "smollm2-135m"], "runs/eval_smollm_zero_shot/eval.json")
    return chain_stages(SMOLLM, seeds, {
        "traces": "configs/synth_smollm.yaml", "traces_rules": "configs/synth_rules_smollm.yaml",
        "corpus": "configs/filter_smollm.yaml", "sft": "configs/sft_smollm.yaml", "rl": "configs/rl_smollm.yaml",
        "distill": "configs/distill_smollm.yaml", "eval": "configs/eval_smollm.yaml"}, [zero_shot])


# ---------------------------------------------------------------------------
# The long task: the roadmap's phases A-E, the control B+ and the copying baselines
# ---------------------------------------------------------------------------

LONG_DOCS, LONG_SPLIT = "out/newsworld/long.jsonl", "out/newsworld/long_split.json"
# newsworld.LONG_SPLIT_THRESHOLD: the long task's padding lines recur, so its split clusters at 0.38
LONG_WORLD = [
    Stage("docs", ["-m", "newsworld", "generate", "--n", "1000", "--seed", "0", "--task", "long", "--out", LONG_DOCS],
          LONG_DOCS),
    Stage("split", ["data.py", "split", "--docs", LONG_DOCS, "--out", LONG_SPLIT, "--threshold", "0.38"], LONG_SPLIT),
]


@dataclass(frozen=True)
class Phase:
    """A trained row of the long task's table: the stage that trains it and how it is evaluated."""
    stage: str  # pipeline stage name
    label: str  # its row in the table
    script: str
    config: str
    run: str  # run name: runs/RUN{suffix}/final
    start: str = ""  # the run it starts from ("" = the instruct model, as its config says)
    tools: str = "all"  # eval.py's decode-time tools for it: the tools it was trained with
    full_only: bool = False


NEWS_PHASES = [
    Phase("sft", "C: SFT (tools)", "sft.py", "configs/sft_news.yaml", "sft_news"),
    Phase("sft_plain", "B+ start: SFT, tools stripped", "sft.py", "configs/sft_news_plain.yaml", "sft_news_plain",
          tools="none"),
    Phase("rl", "D: Dr. GRPO (tools)", "rl.py", "configs/rl_news.yaml", "rl_news", "sft_news"),
    Phase("rl_bplus", "B+: SFT stripped -> RL (no tools)", "rl.py", "configs/rl_news_bplus.yaml", "rl_news_bplus",
          "sft_news_plain", tools="none"),
    Phase("rl_a", "A: RL, rules only (no tools)", "rl.py", "configs/rl_news_a.yaml", "rl_news_a", tools="none",
          full_only=True),
    Phase("rl_b", "B: RL + factuality (no tools)", "rl.py", "configs/rl_news_b.yaml", "rl_news_b", tools="none",
          full_only=True),
    *[Phase(f"rl_no_{t}", f"D without {t}", "rl.py", f"configs/ablation_news_no_{t}.yaml", f"rl_news_no_{t}", "sft_news",
            tools=f"no_{t}" if t != "budget" else "all", full_only=True) for t in ("delete", "search", "budget")],
]
NEWS_STUDENT = "E: student (no tools)"
NEWS_ZERO_SHOT = ("zero-shot (no tools)", "out/models/smollm2-135m")
# model names eval.py takes in place of a directory: the copying baselines, no model behind them
NEWS_BASELINES = (("copy: lead-3", "lead-3"), ("copy: best whole sentences (oracle)", "best-extract"))
NEWS_LABEL = {ph.stage: ph.label for ph in NEWS_PHASES}  # a phase's table row, by its stage
NEWS_ROWS = [*(label for label, _ in NEWS_BASELINES), NEWS_ZERO_SHOT[0],
             *(NEWS_LABEL[s] for s in ("rl_a", "rl_b", "sft_plain", "rl_bplus", "sft", "rl")), NEWS_STUDENT,
             *(NEWS_LABEL[f"rl_no_{t}"] for t in ("delete", "search", "budget"))]


def news_model(run: str, seed: int) -> str:
    return f"runs/{run}{suffix(seed)}/final"


def news_stages(seeds: int = 1) -> list[Stage]:
    """The long task's chain for `seeds` seeds: the world; the zero-shot model and the
    copying baselines (shared); per seed the rule drafter's traces, the corpus, each phase's training
    (NEWS_PHASES; --full adds A, B and D's ablations), the student and the evaluations,
    one eval.py call per decode-time tool setting."""
    zero_shot = Stage("zero_shot", ["eval.py", "--config", "configs/eval_news.yaml", "name=eval_news_zero_shot",
                                    "tools=none", "--compare", *(name for _, name in NEWS_BASELINES), "smollm2-135m"],
                      "runs/eval_news_zero_shot/eval.json")
    stages = [*LONG_WORLD, zero_shot]
    for s in range(seeds):
        x = suffix(s)
        # the rule drafter's traces only: SmolLM2's own drafts of long articles copy the lead
        # (configs/synth_rules_news.yaml); configs/synth_news.yaml still writes them on request
        rules, corpus = f"out/traces/rules_news{x}.jsonl", f"out/corpus/news{x}"
        corpus_over = [f"traces=[{rules}]", f"out_dir={corpus}"] if s else []
        data_over = [f"data.train={corpus}/train.jsonl", f"data.eval={corpus}/eval.jsonl"] if s else []
        stages += [
            Stage("traces", ["synth_traces.py", "--config", "configs/synth_rules_news.yaml",
                             *seeded(s, f"out_path={rules}")], rules, seed=s),
            Stage("corpus", ["filter_traces.py", "--config", "configs/filter_news.yaml", *corpus_over],
                  f"{corpus}/train.jsonl", seed=s),
        ]
        for ph in NEWS_PHASES:
            over = [f"name={ph.run}{x}", *([f"init={news_model(ph.start, s)}"] if ph.start else []),
                    *(data_over if ph.script == "sft.py" else [])]
            stages.append(Stage(ph.stage, [ph.script, "--config", ph.config, *seeded(s, *over)], news_model(ph.run, s),
                                full_only=ph.full_only, checkpoints=True, seed=s))
        student = f"runs/distill_news{x}"
        stages.append(Stage("distill", ["distill.py", "--config", "configs/distill_news.yaml",
                                        *seeded(s, f"name=distill_news{x}", f"teacher={news_model('rl_news', s)}")],
                            f"{student}/distill.json", checkpoints=True, seed=s, optional=True))
        by_tools: dict[str, list[Phase]] = {}
        for ph in NEWS_PHASES:
            by_tools.setdefault(ph.tools, []).append(ph)
        for tools, phases in by_tools.items():
            tail = "" if tools == "all" else "_notools" if tools == "none" else f"_{tools}"
            student_row = [f"{student}/final"] if tools == "all" else []
            for full in (False, True):
                models = [news_model(ph.run, s) for ph in phases if ph.full_only == full] + (
                    student_row if not full else [])
                name = f"eval_news{x}{tail}" + ("_full" if full else "")
                if models:
                    stages.append(Stage(f"eval{tail}" + ("_full" if full else ""),
                                        ["eval.py", "--config", "configs/eval_news.yaml", f"name={name}", *seeded(s),
                                         *([f"tools={tools}"] if tools != "all" else []), "--compare", *models],
                                        f"runs/{name}/eval.json", full_only=full, seed=s))
    return stages


# The tiny chain with one seed, as the README's stage table gives it.
STAGES = tiny_stages(1)
BASE, SFT, RL = TINY.start[1], TINY.sft(0), TINY.rl(0)
SFT_NOMASK = TINY.nomask(0)
ABLATIONS = TINY.ablations

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
CHAINS = {"smollm": SMOLLM, "tiny": TINY}
PROFILES: dict[str, Callable[[int], list[Stage]]] = {
    "news": news_stages, "smollm": smollm_stages, "tiny": tiny_stages, "cnn_qwen3_4b": lambda seeds: list(CNN_STAGES)}
SEEDED = ("news", *CHAINS)  # the profiles that take --seeds


def profile_stages(profile: str, seeds: int | None = None) -> list[Stage]:
    """The stages of `profile` for `seeds` seeds (default: the profile's own count)."""
    if profile not in PROFILES:
        raise SystemExit(f"pipeline: unknown profile {profile!r}; profiles: {sorted(PROFILES)}")
    chain = CHAINS.get(profile)
    n = seeds if seeds is not None else (chain.seeds if chain else 1)
    if n < 1 or (profile not in SEEDED and n != 1):
        raise SystemExit(f"pipeline: --seeds {n}: " + ("must be >= 1" if n < 1 else
                                                         f"the {profile} profile runs one seed"))
    return PROFILES[profile](n)


# --smoke: the same chain, the same configs, on a CPU in a few minutes. Only models,
# data and step counts are overridden: every model is a tiny preset (hf backend, no
# quantisation), the news world stands in for CNN/DailyMail, the teacher is
# newsworld/oracle_server.py on 127.0.0.1 ({api} below), and each training stage takes ~2 steps.
_TINY = ["model.name_or_path=tiny-1m", "model.quant=none", "model.backend=hf", "model.max_seq_len=2048"]
_TINY_RL = [*_TINY, "model.fast_inference=false", "sampling.backend=hf", "steps=2", "prompts_per_step=2",
            "group_size=2", "sampling.max_new_tokens=32", "sampling.max_context_tokens=2048", "eval.n_docs=2",
            "eval.max_new_tokens=16", "reward.factuality=lexical", "data.max_prompt_tokens=0", "save_every=0"]
_TINY_SFT = [*_TINY, "epochs=1", "data.limit=8", "data.max_tokens=2048", "batch_episodes=4", "grad_accum=1",
             "eval.every=0", "eval.sample_every=0", "eval.n_docs=2", "eval.max_new_tokens=16",
             "reward.factuality=lexical", "save_every=0", "warmup_steps=0"]
SMOKE = {  # stage -> (argv replacing the stage's, or None to keep it) and the overrides it adds
    "docs": (["-m", "newsworld", "generate", "--n", "40", "--seed", "0", "--out", CNN], []),
    "eval_docs": (["-m", "newsworld", "generate", "--n", "8", "--seed", "7", "--out", "out/cnn/eval.jsonl"], []),
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


def without_failed(stage: Stage, failed: list[Stage]) -> Stage:
    """`stage` without the `--compare` entries that failed optional stages would have
    written (a student whose distillation failed)."""
    gone = [str(Path(f.output).parent) for f in failed]
    if "--compare" not in stage.argv or not gone:
        return stage
    at = stage.argv.index("--compare") + 1
    keep = [a for a in stage.argv[at:] if not any(a == g or a.startswith(g + "/") for g in gone)]
    return dataclasses.replace(stage, argv=[*stage.argv[:at], *keep])


def smoke_stage(stage: Stage) -> Stage:
    """`stage` with its --smoke replacement command or overrides; "{api}" stays for the
    oracle teacher's URL, known once it is started."""
    argv, over = SMOKE.get(stage.name, (None, []))
    return with_overrides(stage, over, argv)


def selected(stage: Stage, only: list[str], full: bool) -> bool:
    """Whether this call runs `stage`: the --only list when given, else every stage but --full's."""
    return stage.name in only if only else (full or not stage.full_only)


# The trainers run data-parallel under torchrun (`--nproc N`); every other stage is one process.
DATA_PARALLEL = ("sft.py", "rl.py", "distill.py")


def launcher(stage: Stage, nproc: int = 1) -> list[str]:
    """How a stage's script is started: `python`, or torchrun with `nproc` ranks on
    this machine for a trainer (`python -m torch.distributed.run` is torchrun)."""
    if nproc > 1 and stage.argv[0] in DATA_PARALLEL:
        return ["torchrun", "--standalone", f"--nproc_per_node={nproc}"]
    return ["python"]


# The stages whose script reads its config through factual_tools.settings (and so takes --verbose).
CONFIGURED = ("synth_traces.py", "filter_traces.py", "sft.py", "rl.py", "eval.py", "distill.py",
              "teacher_episodes.py")


def run_stage(stage: Stage, cwd: Path, nproc: int = 1, log: Path | None = None, verbose: bool = False) -> float:
    """Run one stage in `cwd` (its outputs land there); returns its wall-clock
    seconds. Its standard output goes to `log` (the terminal keeps its progress bars,
    warnings and errors, which go to standard error), or to the terminal as well with
    `verbose`, which also makes the script print its resolved config. A failing stage
    stops the pipeline with the command to rerun it and the end of its log."""
    script, *rest = stage.argv
    rest = [str(ROOT / a) if a.startswith("configs/") else a for a in rest]
    if verbose and script in CONFIGURED:
        rest.append("--verbose")
    how = launcher(stage, nproc)
    start = [sys.executable] if how == ["python"] else [sys.executable, "-m", "torch.distributed.run", *how[1:]]
    # a script at the root, or `-m PACKAGE` (the news world's command line) found through PYTHONPATH
    cmd = [*start, "-m", *rest] if script == "-m" else [*start, str(ROOT / script), *rest]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if not verbose:  # the stage's own progress bar only, not the libraries' bars for loading weights
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    shown = " ".join([*how, *stage.argv])
    print(f"\n=== {stage.label}: {shown}", flush=True)
    t0 = time.perf_counter()
    if log is None or verbose:
        rc = wait_for(subprocess.Popen(cmd, cwd=cwd, env=env), stage.label)
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w", encoding="utf-8") as f:
            rc = wait_for(subprocess.Popen(cmd, cwd=cwd, env=env, stdout=f), stage.label)
    if rc != 0:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-15:]) \
            if log is not None and log.exists() and not verbose else ""
        raise SystemExit((f"{tail}pipeline: the end of its output above; all of it in {log}\n" if tail else "")
                         + f"pipeline: stage {stage.label!r} failed (exit {rc}); rerun it alone with\n"
                         f"  {shown}\nthen `python pipeline.py` continues from there")
    if not (cwd / stage.output).exists():
        raise SystemExit(f"pipeline: stage {stage.label!r} finished but did not write {stage.output}")
    return time.perf_counter() - t0


# The peak resident memory (bytes) of each stage's process, as the kernel reports it when
# the stage exits (ru_maxrss of wait4), by stage label; printed beside the stage's time.
PEAK_RSS: dict[str, int] = {}


def wait_for(proc: subprocess.Popen, label: str) -> int:
    """`proc`'s exit status once it has exited; its peak memory goes to PEAK_RSS[label]
    (where the OS has wait4; elsewhere only the status)."""
    if not hasattr(os, "wait4"):
        return proc.wait()
    try:
        _, status, usage = os.wait4(proc.pid, 0)
    except KeyboardInterrupt:
        proc.kill()
        raise
    proc.returncode = os.waitstatus_to_exitcode(status)
    PEAK_RSS[label] = usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return proc.returncode


def result_lines(stage: Stage, work: Path, log: Path) -> list[str]:
    """What a finished stage reports: an evaluation's headline figures per model, or
    the last line its script printed."""
    out = work / stage.output
    if out.name == "eval.json":
        ev = json.loads(out.read_text(encoding="utf-8"))
        return [f"{m['model']}: fact precision {_pct(m['metrics'].get('fact_precision'))}, hallucination "
                f"{_pct(m['metrics'].get('hallucination_rate'))}, combined pass {_pct(m['metrics'].get('pass'))}"
                for m in ev.get("models", [])]
    lines = log.read_text(encoding="utf-8", errors="replace").split("\n") if log.exists() else []
    return [x for x in lines if x.strip()][-1:]


def gigabytes(n: int) -> str:
    """`3.4e9` -> `3.4 GB`; below 1 GB in MB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def minutes(seconds: float) -> str:
    """`75` -> `1m15s`."""
    m, s = divmod(round(seconds), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


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


def _seed_cell(xs: list, fmt: str) -> str:
    """One seed's figure, or the mean over seeds with its min-max; a figure that only
    some seeds measured (evidence use needs a rewrite) says how many."""
    n, xs = len(xs), [x for x in xs if not _missing(x)]
    some = f"{len(xs)} of {n} seeds" if 0 < len(xs) < n else ""
    if len(xs) <= 1:
        return _cell(xs[0] if xs else None, fmt) + (f" ({some})" if some else "")
    lo, hi = (_cell(min(xs), fmt), _cell(max(xs), fmt))
    return f"{_cell(statistics.fmean(xs), fmt)} ({lo}-{hi}{'; ' + some if some else ''})"


def mean_metrics(per_seed: list[dict]) -> dict:
    """Each numeric metric's mean over the seeds that measured it (NaN where none did);
    a text entry (a model's path) is kept from the first seed that has it."""
    keys = dict.fromkeys(k for m in per_seed for k in m)
    numeric = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)  # noqa: E731
    return {k: common.mean(m.get(k) for m in per_seed if numeric(m.get(k)))
            if any(numeric(m.get(k)) for m in per_seed) else next(m[k] for m in per_seed if k in m) for k in keys}


def _step_up(a: list[dict], b: list[dict], key: str) -> bool | None:
    """Whether `key` rises from rows a to b by more than either row's spread over seeds."""
    xa, xb = [m.get(key) for m in a], [m.get(key) for m in b]
    if not xa or not xb or any(_missing(x) for x in xa + xb):
        return None
    return statistics.fmean(xb) - statistics.fmean(xa) > max(max(xa) - min(xa), max(xb) - min(xb))


def _rising(*xs) -> bool | None:
    return None if any(_missing(x) for x in xs) else all(a < b for a, b in zip(xs, xs[1:]))


def distillation(distills: list[dict], teacher_label: str) -> tuple[list[str], dict]:
    """(table lines, figures) of the teacher and student each seed measured side by side:
    the mean teacher and student, M3 (the student at most 100 ms per summary, factuality
    within 2 points of its teacher) and the speedup target, each as (verdict, shown)."""
    out = {"m3": (None, "-"), "speed": (None, "-")}
    if not distills:
        return [], out
    t = mean_metrics([d.get("teacher", {}) for d in distills])
    s = mean_metrics([d.get("student", {}) for d in distills])
    out.update(teacher=t, student=s)
    cells = lambda who, k, f: _seed_cell([d.get(who, {}).get(k) for d in distills], f)  # noqa: E731
    lines = ["", "| distillation | p50 ms per summary | factuality | combined pass |", "|---|---|---|---|"]
    for who, label in (("teacher", teacher_label), ("student", "student (no tools)")):
        lines.append(f"| {label} | {cells(who, 'latency_p50_ms', '{:.0f}')} | {cells(who, 'factuality', 'pct')} | "
                     f"{cells(who, 'pass', 'pct')} |")
    ms, t_ms = s.get("latency_p50_ms"), t.get("latency_p50_ms")
    gap = 100 * ((t.get("factuality") or 0) - (s.get("factuality") or 0))
    # a teacher or student that says nothing is "within 2 points" of the other: not a pass
    quiet = "".join(f", the {who} states no fact in {_pct(m['no_fact_rate'])}"
                    for who, m in (("teacher", t), ("student", s)) if _silent(m))
    if not _missing(ms):
        out["m3"] = (_stated(ms <= 100 and gap <= 2, t, s), f"{ms:.0f} ms, {_points(gap)}{quiet}")
    if not _missing(ms) and not _missing(t_ms) and ms:
        # the ratio of the means; with several seeds, each seed's own ratio beside it
        lat = [(d.get("teacher", {}).get("latency_p50_ms"), d.get("student", {}).get("latency_p50_ms"))
               for d in distills]
        ratios = [a / b for a, b in lat if not _missing(a) and not _missing(b) and b]
        spread = f" ({min(ratios):.1f}x-{max(ratios):.1f}x by seed)" if len(ratios) > 1 else ""
        out["speed"] = (_stated(t_ms / ms >= 3 and gap <= 2, t, s),
                        f"{t_ms / ms:.1f}x faster{spread}, {_points(gap)}{quiet}")
    return lines, out


def headline(chain: Chain, models: dict[str, dict], distills: list[dict], seeds: int = 1, *, full: bool = False,
             seconds: dict[str, float] | None = None, n_docs=None, backend: str = "?") -> tuple[str, dict]:
    """(markdown, figures) of a news-world chain's outcome: its rows (the untrained
    start, SFT, Dr. GRPO and, with --full, the baselines and ablations) on the
    held-out pool, each the mean over seeds with its min-max, the chain's targets and
    the project's milestones marked met or not met. `models` maps a model directory
    to its eval.py metrics; `distills` holds each seed's distill.json."""
    rows = [(label, [models[p] for p in paths if p in models]) for label, paths in chain.rows(seeds, full)]
    rows = [(label, per) for label, per in rows if per]
    by_label = dict(rows)
    start, sft, rl = (by_label.get(k, []) for k in (chain.start[0], "SFT (tools)", "Dr. GRPO"))
    spread = f", mean over {seeds} seeds (min-max)" if seeds > 1 else ""
    lines = [f"Held-out news world, {n_docs or '?'} documents (the whole eval pool), greedy{spread}; "
             f"factuality: {backend}. Fact precision: the names, numbers and dates stated that the oracle "
             "supports; tool AUC: the search/delete decision as a detector of the policy's wrong sentences.", "",
             "| model | " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for label, per in rows:
        lines.append(f"| {label} | " + " | ".join(_seed_cell([m.get(k) for m in per], f) for _, k, f in COLUMNS) + " |")
    mean = {label: mean_metrics(per) for label, per in rows}
    base_m, sft_m, rl_m = (mean.get(k, {}) for k in (chain.start[0], "SFT (tools)", "Dr. GRPO"))
    fams = sorted({k[4:-len("_fact_precision")] for m in (base_m, sft_m, rl_m) for k in m
                   if k.startswith("fam_") and k.endswith("_fact_precision")})
    if fams:
        lines += ["", "| fact precision by event family | " + " | ".join(fams) + " |", "|---" * (len(fams) + 1) + "|"]
        lines += [f"| {label} | " + " | ".join(_pct(mean[label].get(f"fam_{f}_fact_precision")) for f in fams) + " |"
                  for label, _ in rows[:3]]
    fig = {"start": base_m, "sft": sft_m, "rl": rl_m, "factuality_backend": backend, "seeds": seeds,
           "rows": mean, "per_seed": {"start": start, "sft": sft, "rl": rl, **{k: v for k, v in rows}}}
    # the tiny chain's table names its start "base"
    fig["base"] = base_m
    if chain.eval_student:  # teacher and student measured side by side on the whole pool
        distills = [{"teacher": models[chain.rl(s)], "student": models[chain.student(s)]} for s in range(seeds)
                    if chain.rl(s) in models and chain.student(s) in models]
    table, marks = distillation(distills, "teacher (Dr. GRPO policy, tools)")
    lines += table
    if distills:
        fig["teacher"], fig["student"] = marks["teacher"], marks["student"]
    (student_ok, student_shown), (speed_ok, speed_shown) = marks["m3"], marks["speed"]
    targets = chain.targets(fig)
    # Milestones (M0-M3, README): each with its measured value.
    rules_only = [m for label, m in mean.items() if label == "RL rules only"]
    base_label = ("the rules-only RL baseline" if rules_only else
                  "the SFT start (run --full for the rules-only baseline)")
    h0, h1 = (rules_only[0] if rules_only else sft_m).get("hallucination_rate"), rl_m.get("hallucination_rate")
    drop = float("nan") if _missing(h0) or _missing(h1) or not h0 else (h0 - h1) / h0
    marks = [
        ("tool calls valid >= 95% (after SFT)", _pct(sft_m.get("valid_call_rate")),
         _ge(sft_m.get("valid_call_rate"), 0.95)),
        ("M0 rule pass >= 20% (Dr. GRPO)", _pct(rl_m.get("rules_pass")), _ge(rl_m.get("rules_pass"), 0.20)),
        (f"M1 hallucinations down >= 40% vs {base_label}", f"{_pct(h0)} -> {_said(rl_m, 'hallucination_rate')}",
         _stated(_ge(drop, 0.40), rl_m)),
        ("M2 combined pass >= 60% (Dr. GRPO)", _pct(rl_m.get("pass")), _ge(rl_m.get("pass"), 0.60)),
        ("M3 student <= 100 ms per summary, factuality within 2 points", student_shown, student_ok),
        ("student >= 3x faster than its teacher, within 2 points (news world target)", speed_shown, speed_ok),
    ]
    lines += verdicts(fig, (("news-world target", targets, "targets"), ("milestone", marks, "milestones")), seconds)
    return "\n".join(lines) + "\n", fig


def verdicts(fig: dict, tables: tuple, seconds: dict[str, float] | None) -> list[str]:
    """The lines of each (title, [(name, shown, verdict)], key) table, marked met, not met,
    not measured or, for a verdict given as text (ONE_SEED), that text (the verdicts go into
    fig[key], text as None), then the stage times."""
    lines = []
    for title, items, key in tables:
        lines += ["", f"| {title} | measured | status |", "|---|---|---|"]
        for name, shown, ok in items:
            status = ok if isinstance(ok, str) else "not measured" if ok is None else "met" if ok else "not met"
            lines.append(f"| {name} | {shown} | {status} |")
        fig[key] = {name: None if isinstance(ok, str) else ok for name, _, ok in items}
    if seconds:
        total = sum(seconds.values())
        lines += ["", "Stage times (s): " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
                  + f"; total {total:.0f} ({total / 60:.1f} min)"]
        fig["seconds"] = seconds
    return lines


NEWS_COLUMNS = [  # (header, metric, format): the long task's table
    ("fact precision", "fact_precision", "pct"), ("key-fact coverage", "key_fact_coverage", "pct"),
    ("hallucination", "hallucination_rate", "pct"), ("combined pass", "pass", "pct"),
    ("rule pass", "rules_pass", "pct"), ("words", "len_words", "{:.0f}"),
    ("copied sentences", "copied_sentences", "pct"), ("valid calls", "valid_call_rate", "pct"),
    ("searches", "searches", "{:.2f}"), ("deletes", "deletes", "{:.2f}"), ("tool AUC", "tool_auc", "{:.2f}"),
    ("evidence use", "evidence_use", "pct"), ("ROUGE-L", "rougeL", "{:.3f}"), ("p50 ms", "latency_p50_ms", "{:.0f}"),
]


def news_rows(seeds: int, full: bool) -> list[tuple[str, list[str]]]:
    """(label, model of each seed) of the long task's table, in NEWS_ROWS order."""
    paths = {label: [name] for label, name in NEWS_BASELINES}
    paths[NEWS_ZERO_SHOT[0]] = [NEWS_ZERO_SHOT[1]]
    paths.update({ph.label: [news_model(ph.run, s) for s in range(seeds)] for ph in NEWS_PHASES
                  if full or not ph.full_only})
    paths[NEWS_STUDENT] = [news_model("distill_news", s) for s in range(seeds)]
    return [(label, paths[label]) for label in NEWS_ROWS if label in paths]


ONE_SEED = "one seed: not judged (--seeds 3)"  # the verdict of a comparison that needs a spread


def _beats(per: dict, a: str, b: str, key: str, lower: bool = False) -> tuple[str, bool | str | None]:
    """Row a against row b on `key` over seeds: (shown, a better beyond both spreads), or
    ONE_SEED where a row has one seed, so no spread to be beyond."""
    xa, xb = per.get(a, []), per.get(b, [])
    sign = -1 if lower else 1
    ok = _step_up([{key: sign * m.get(key, math.nan)} for m in xb], [{key: sign * m.get(key, math.nan)} for m in xa],
                  key) if xa and xb else None
    fmt = lambda rows: _seed_cell([m.get(key) for m in rows], "pct")  # noqa: E731
    return f"{fmt(xa)} vs {fmt(xb)}", _spread_judged(ok, xa, xb)


def _spread_judged(ok: bool | None, *rows: list) -> bool | str | None:
    """A verdict "beyond the spread over seeds", or ONE_SEED where a trained row has one seed."""
    return ONE_SEED if ok is not None and min(map(len, rows)) < 2 else ok


def news_headline(models: dict[str, dict], distills: list[dict], seeds: int = 1, *, full: bool = False,
                  seconds: dict[str, float] | None = None, n_docs=None, backend: str = "?") -> tuple[str, dict]:
    """(markdown, figures) of the long task: the copying baselines, zero-shot, the roadmap's
    phases (A and B with --full), the control B+ and D's ablations on the held-out pool, each
    the mean over seeds with its min-max; the claim (D against B+ and its ablations) and the
    roadmap's milestones M0-M3 against the baselines it names, marked met or not met."""
    rows = [(label, [models[p] for p in paths if p in models]) for label, paths in news_rows(seeds, full)]
    per = {label: ms for label, ms in rows if ms}
    spread = f", mean over {seeds} seeds (min-max)" if seeds > 1 else ""
    lines = [f"Held-out news world, long task, {n_docs or '?'} documents (the whole eval pool), greedy{spread}; "
             f"factuality: {backend}. Key-fact coverage: the reference's key facts stated right; combined pass: "
             "fact precision x coverage >= 0.7 and every rule, the 45-word budget among them.", "",
             "| model | " + " | ".join(h for h, _, _ in NEWS_COLUMNS) + " |", "|---" * (len(NEWS_COLUMNS) + 1) + "|"]
    for label, ms in per.items():
        lines.append(f"| {label} | " + " | ".join(_seed_cell([m.get(k) for m in ms], f) for _, k, f in NEWS_COLUMNS)
                     + " |")
    mean = {label: mean_metrics(ms) for label, ms in per.items()}
    A, B, Bp, C, D = (mean.get(NEWS_LABEL[s], {}) for s in ("rl_a", "rl_b", "rl_bplus", "sft", "rl"))
    fig = {"factuality_backend": backend, "seeds": seeds, "rows": mean, "per_seed": per}
    student = [{"teacher": models[news_model("rl_news", s)], "student": models[news_model("distill_news", s)]}
               for s in range(seeds) if news_model("rl_news", s) in models and news_model("distill_news", s) in models]
    table, marks = distillation(student, "teacher (D, tools)")
    lines += table
    d_label, bp_label = NEWS_LABEL["rl"], NEWS_LABEL["rl_bplus"]
    pass_shown, pass_ok = _beats(per, d_label, bp_label, "pass")
    hall_shown, hall_ok = _beats(per, d_label, bp_label, "hallucination_rate", lower=True)
    claim = [
        ("D beats B+ on combined pass, beyond both spreads", pass_shown, pass_ok),
        ("D beats B+ on hallucination, beyond both spreads", hall_shown, _stated(hall_ok, D, Bp)),
        ("D's tool AUC >= 0.75", _seed_cell([m.get("tool_auc") for m in per.get(d_label, [])], "{:.2f}"),
         _ge(D.get("tool_auc"), 0.75)),
        ("D's evidence use >= 90%", _seed_cell([m.get("evidence_use") for m in per.get(d_label, [])], "pct"),
         _ge(D.get("evidence_use"), 0.90)),
    ]
    for t in ("search", "delete"):
        shown, ok = _beats(per, d_label, NEWS_LABEL[f"rl_no_{t}"], "pass")
        claim.append((f"D without {t} falls below D on combined pass, beyond both spreads (--full)", shown, ok))
    copies = [mean.get(label, {}).get("pass") for label, _ in NEWS_BASELINES]
    claim.append(("the copying baselines fail M2 (combined pass < 60%)", " and ".join(_pct(x) for x in copies),
                  None if any(_missing(x) for x in copies) else all(x < 0.60 for x in copies)))
    h0, h1 = A.get("hallucination_rate"), B.get("hallucination_rate")
    drop = math.nan if _missing(h0) or _missing(h1) or not h0 else (h0 - h1) / h0
    (m3_ok, m3_shown), _ = marks["m3"], marks["speed"]
    milestones = [
        ("C: tool calls valid >= 95% (after tool SFT)", _pct(C.get("valid_call_rate")),
         _ge(C.get("valid_call_rate"), 0.95)),
        ("M0: A's rule pass >= 20% (--full)", _pct(A.get("rules_pass")), _ge(A.get("rules_pass"), 0.20)),
        ("M1: B's hallucinations down >= 40% vs A (--full)", f"{_pct(h0)} -> {_said(B, 'hallucination_rate')}",
         _stated(_ge(drop, 0.40), B)),
        ("M2: D's combined pass >= 60%", _pct(D.get("pass")), _ge(D.get("pass"), 0.60)),
        ("M3: E <= 100 ms per summary, factuality within 2 points of D", m3_shown, m3_ok),
    ]
    lines += verdicts(fig, (("claim: checking pays", claim, "claim"), ("roadmap milestone", milestones, "milestones")),
                      seconds)
    return "\n".join(lines) + "\n", fig


PLOTTED = (("fact precision", "fact_precision"), ("hallucination", "hallucination_rate"), ("combined pass", "pass"))


def plot_headline(fig: dict, path: Path) -> None:
    """The headline figures by stage (the table's rows), one bar group per figure, each
    bar the mean over seeds with its min-max as an error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(label, per) for label, per in fig["per_seed"].items() if label not in ("start", "sft", "rl") and per]
    width = 0.8 / max(1, len(rows))
    f, ax = plt.subplots(figsize=(7.5, 3.6), dpi=120)
    for i, (label, per) in enumerate(rows):
        stats = []
        for _, key in PLOTTED:
            xs = [100 * m[key] for m in per if not _missing(m.get(key))]
            stats.append((statistics.fmean(xs), min(xs), max(xs)) if xs else (math.nan, math.nan, math.nan))
        x = [j + (i - (len(rows) - 1) / 2) * width for j in range(len(PLOTTED))]
        mean = [m for m, _, _ in stats]
        err = [[m - lo for m, lo, _ in stats], [hi - m for m, _, hi in stats]]
        ax.bar(x, mean, width, yerr=err if fig.get("seeds", 1) > 1 else None, capsize=3, label=label)
    ax.set_xticks(range(len(PLOTTED)), [name for name, _ in PLOTTED])
    ax.set_ylabel("% of held-out summaries / facts")
    ax.set_ylim(0, 105)
    seeds = fig.get("seeds", 1)
    ax.set_title(f"held-out news world, {seeds} seed{'s' if seeds > 1 else ''}"
                 + (" (bars: mean, whiskers: min-max)" if seeds > 1 else ""), fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper center", ncol=min(len(rows), 4), bbox_to_anchor=(0.5, -0.1))
    f.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    f.savefig(path)
    plt.close(f)


def read_outputs(stages: list[Stage], work: Path) -> tuple[dict[str, dict], list[dict], dict]:
    """(model directory -> metrics, each seed's distill.json, the first eval.json) from
    the eval and distill stages of `stages` that have finished in `work`."""
    models, distills, first = {}, [], {}
    for st in stages:
        path = work / st.output
        if not path.is_file():
            continue
        if Path(st.output).name == "eval.json":
            ev = json.loads(path.read_text())
            first = first or ev
            models.update({m["model"]: m["metrics"] for m in ev.get("models", [])})
        elif st.name == "distill":
            distills.append(json.loads(path.read_text()))
    return models, distills, first


def quoted_summaries(evals: list[Path], rows: list[tuple[str, str]], n: int = 2, seed: int = 0) -> str:
    """Markdown: what each (label, model) row wrote on `n` documents drawn with
    random.Random(seed) from those every row was evaluated on (the episodes.jsonl beside each
    eval.json of `evals`), tool calls as written and search results elided, with the verdict.
    The same documents for every row, to read side by side; "" when no row was evaluated."""
    import data

    episodes: dict[str, dict[str, dict]] = {}
    for path in (p.parent / "episodes.jsonl" for p in evals):
        if not path.is_file():
            continue
        try:
            rows_here = [r for _, r in data.jsonl_records(str(path))]
        except data.DataError as e:  # the table does not need it: name the file and line, quote the others
            print(f"pipeline: {e}; its summaries are not quoted")
            continue
        for r in rows_here:
            episodes.setdefault(r["model"], {})[r["doc_id"]] = r
    quoted = [(label, episodes[model]) for label, model in rows if model in episodes]
    if not quoted:
        return ""
    common_docs = sorted(set.intersection(*(set(by_doc) for _, by_doc in quoted)))
    docs = random.Random(seed).sample(common_docs, min(n, len(common_docs)))
    lines = [f"Summaries as written on {len(docs)} held-out documents (random.Random({seed}) over the eval pool), "
             "the first seed of each row; search results elided.", ""]
    for doc in docs:
        lines += [f"### {doc}", ""]
        for label, by_doc in quoted:
            r = by_doc[doc]
            text = "".join(t["text"] + ("<results>...</results>" if t.get("injected") else "")
                           for t in r["episode"]["turns"])
            flagged = ", ".join(e["type"] for e in r.get("errors") or [])
            verdict = "pass" if r["score"]["pass"] else f"coverage {r['score']['coverage']:.2f}" + (
                f", flagged: {flagged}" if flagged else "")
            lines.append(f'- **{label}**: "{text.strip()}" ({verdict})')
        lines.append("")
    return "\n".join(lines)


def stage_overrides(items: list[str], stages: list[Stage]) -> dict[str, list[str]]:
    """`--set STAGE.KEY=VALUE` items as {stage: [KEY=VALUE, ...]}; a malformed item or an
    unknown stage exits naming it and the stages."""
    names = list(dict.fromkeys(s.name for s in stages))
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
    names = list(dict.fromkeys(s.name for s in stages))
    unknown = set(only) - set(names)
    if unknown:
        raise SystemExit(f"pipeline: unknown stage(s) {sorted(unknown)}; stages: {names}")
    return only


def main(argv: list[str] | None = None) -> dict:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="smollm", choices=sorted(PROFILES),
                    help="smollm: the news-world chain with SmolLM2-135M-Instruct (default); tiny: the same chain with "
                         "a 1M-parameter model from scratch; cnn_qwen3_4b: the real-data chain for one GPU")
    ap.add_argument("--seeds", type=int, default=None,
                    help="seeds of the trace draw, SFT, RL and distillation (default 1; 3 gives the table with "
                         "each figure's spread over seeds)")
    ap.add_argument("--verbose", action="store_true",
                    help="show each stage's whole output, its resolved config first (by default its output goes "
                         "to runs/pipeline/logs/STAGE.log and the terminal shows the command, progress and result)")
    ap.add_argument("--dry-run", action="store_true", help="print the profile's stage commands in order and stop")
    ap.add_argument("--smoke", action="store_true",
                    help="(cnn_qwen3_4b) the same chain on a CPU in minutes: tiny models, the news world for the "
                         "data, a local oracle teacher; in out/smoke/PROFILE unless --workdir is given")
    ap.add_argument("--full", action="store_true",
                    help="add the rules-only RL baseline, the three ablations and SFT without error masking")
    ap.add_argument("--fresh", action="store_true", help="rerun stages whose outputs exist")
    ap.add_argument("--only", default="", help="comma-separated stage names (every seed of each)")
    ap.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                    help="an override for one stage's script (every seed), e.g. sft.epochs=1 (repeatable)")
    ap.add_argument("--nproc", type=int, default=1,
                    help="GPUs (or CPU processes) for the trainers: SFT, RL and distillation run under torchrun "
                         "with this many data-parallel ranks; the other stages are one process")
    ap.add_argument("--workdir", default=None, help="where out/ and runs/ go (default: here)")
    ap.add_argument("--out", default="runs/pipeline", help="where the headline table goes (in workdir)")
    args = ap.parse_args(argv)
    if args.nproc < 1:
        raise SystemExit(f"pipeline: --nproc must be >= 1, got {args.nproc}")
    stages = profile_stages(args.profile, args.seeds)
    if args.smoke and args.profile != "cnn_qwen3_4b":
        raise SystemExit(f"pipeline: --smoke is for a GPU profile (--profile cnn_qwen3_4b); the {args.profile} chain "
                         "already runs on a CPU")
    if args.smoke:
        stages = [smoke_stage(st) for st in stages]
    extra = stage_overrides(args.set, stages)
    only = stage_names(args.only, stages)
    if args.dry_run:
        for stage in stages:
            if selected(stage, only, args.full):
                print(f"{stage.label:24s} {' '.join(launcher(stage, args.nproc))} "
                      f"{' '.join(with_overrides(stage, extra.get(stage.name, [])).argv)}")
        return {}
    work = Path(args.workdir or (f"out/smoke/{args.profile}" if args.smoke else ".")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    server = None
    out = work / args.out
    seconds_path = out / "seconds.json"
    seconds = json.loads(seconds_path.read_text()) if seconds_path.exists() and not args.fresh else {}
    peaks_path = out / "peak_memory.json"  # bytes, by stage: a resumed run still knows the skipped stages'
    peaks = json.loads(peaks_path.read_text()) if peaks_path.exists() and not args.fresh else {}
    t_start = time.perf_counter()
    failed: list[Stage] = []  # optional stages that failed in this call
    for stage in stages:
        if not selected(stage, only, args.full):
            continue
        if (work / stage.output).exists() and not args.fresh and stage.name not in only:
            print(f"=== {stage.label}: {stage.output} exists, skipped (--fresh reruns it)")
            continue
        over = list(extra.get(stage.name, []))
        if args.fresh and stage.checkpoints:  # a fresh rerun must not resume the old run
            over.append("resume=none")
        elif args.fresh and (work / stage.output).is_file():
            # nor build on an old output: synth resumes an existing trace file, and a frozen split refuses a rewrite
            (work / stage.output).unlink()
        stage = with_overrides(stage, over)
        stage = without_failed(stage, failed)
        if any("{api}" in a for a in stage.argv):  # --smoke: the oracle teacher, started once the documents exist
            if server is None:
                import data
                from newsworld import oracle_server

                api, server = oracle_server.serve(data.read_documents(str(work / CNN)))
            stage = dataclasses.replace(stage, argv=[a.replace("{api}", api) for a in stage.argv])
        log = out / "logs" / f"{stage.label}.log"
        try:
            seconds[stage.label] = run_stage(stage, work, args.nproc, log, args.verbose)
        except SystemExit as e:
            if not stage.optional:
                raise
            print(f"{e}\npipeline: {stage.label} is optional: the chain goes on without it", flush=True)
            failed.append(stage)
            continue
        common.atomic_write_text(seconds_path, json.dumps(seconds, indent=1))
        peak = PEAK_RSS.get(stage.label)
        if peak:
            peaks[stage.label] = peak
            common.atomic_write_text(peaks_path, json.dumps(peaks, indent=1))
        print(f"    done in {minutes(seconds[stage.label])}" + (f", peak memory {gigabytes(peak)}" if peak else "")
              + ("" if args.verbose else f"; its output: {log.relative_to(work)}"), flush=True)
        for line in ([] if args.verbose else result_lines(stage, work, log)):
            print(f"    {line}", flush=True)
    if server is not None:
        server.shutdown()
    if peaks:
        label = max(peaks, key=peaks.get)
        print(f"pipeline: peak memory {gigabytes(peaks[label])} ({label}); every stage's in "
              f"{peaks_path.relative_to(work)}", flush=True)
    for stage in failed:
        print(f"pipeline: {stage.label} failed; its student is left out of the table (rerun it alone with "
              f"`{' '.join([*launcher(stage, args.nproc), *stage.argv])}`, then `python pipeline.py` again)")
    chain = CHAINS.get(args.profile)
    if chain is None and args.profile != "news":
        report = work / "runs/eval_cnn/report.md"
        print(f"pipeline: {args.profile} done in {time.perf_counter() - t_start:.0f} s this call"
              + (f"; the evaluation is in {report.relative_to(work)}" if report.exists() else ""))
        return {}
    models, distills, first = read_outputs([s for s in stages if args.full or not s.full_only], work)
    if not models:
        print("pipeline: no evaluation yet; the headline table needs the eval stages")
        return {}
    seeds = max(s.seed for s in stages if s.seed is not None) + 1
    table = functools.partial(headline, chain) if chain is not None else news_headline
    md, fig = table(models, distills, seeds, full=args.full, seconds=seconds, n_docs=first.get("n_docs"),
                    backend=first.get("factuality_backend", "?"))
    common.atomic_write_text(out / "headline.md", md)
    common.atomic_write_text(out / "headline.json", json.dumps(fig, indent=1, default=str))
    plot_headline(fig, out / "headline.png")
    quotes = "" if chain is not None else quoted_summaries(
        [work / s.output for s in stages if Path(s.output).name == "eval.json"],
        [(label, paths[0]) for label, paths in news_rows(seeds, args.full)])
    if quotes:
        common.atomic_write_text(out / "summaries.md", quotes)
    print("\n" + md)
    print(f"pipeline: {minutes(time.perf_counter() - t_start)} this call; table in {args.out}/headline.md, "
          f"plot in {args.out}/headline.png" + (f", two summaries of each row in {args.out}/summaries.md"
                                                if quotes else ""))
    return fig


if __name__ == "__main__":
    main()
