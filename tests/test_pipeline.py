"""pipeline.py: the headline table from hand-made stage outputs, the stage
plumbing, and the smallest setting of the whole chain end to end."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline

ROOT = Path(pipeline.__file__).resolve().parent


def _metrics(**kw) -> dict:
    base = {"valid_call_rate": 0.97, "rules_pass": 0.25, "hallucination_rate": 0.5, "pass": 0.1, "pass_at_1": 0.1,
            "pass_at_8": 0.4, "searches": 1.0, "deletes": 0.5, "rougeL": 0.3, "latency_p50_ms": 120.0,
            "factuality": 0.6, "fact_precision": 0.5, "errors_per_summary": 1.0, "tool_auc": 0.8,
            "search_found_fact": 0.9, "evidence_use": 0.95, "fam_sports_fact_precision": 0.4}
    return {**base, **kw}


def _eval_json(models: dict[str, dict]) -> dict:
    return {"models": [{"model": k, "metrics": v} for k, v in models.items()], "n_docs": 32,
            "factuality_backend": "oracle (news world fact table)"}


def _tiny(ev: dict, dist: dict | None = None, **kw):
    """The tiny chain's headline from one eval.json (model -> metrics) and one distill.json."""
    models = {m["model"]: m["metrics"] for m in ev["models"]}
    return pipeline.headline(pipeline.TINY, models, [dist] if dist else [], n_docs=ev["n_docs"],
                             backend=ev["factuality_backend"], **kw)


def test_headline_marks_each_milestone_and_target_from_its_figure():
    ev = _eval_json({pipeline.BASE: _metrics(fact_precision=0.3, hallucination_rate=0.9, valid_call_rate=float("nan")),
                     pipeline.SFT: _metrics(hallucination_rate=0.8, valid_call_rate=0.96, fact_precision=0.6),
                     pipeline.RL: _metrics(hallucination_rate=0.4, rules_pass=0.3, fact_precision=0.7, tool_auc=0.9,
                                           **{"pass": 0.65})})
    dist = {"teacher": {"latency_p50_ms": 150.0, "factuality": 0.60, "pass": 0.5},
            "student": {"latency_p50_ms": 40.0, "factuality": 0.59, "pass": 0.45}}
    md, fig = _tiny(ev, dist, seconds={"sft": 300.0, "rl": 200.0})
    m, t = fig["milestones"], fig["targets"]
    assert m["tool calls valid >= 95% (after SFT)"] is True
    assert m["M0 rule pass >= 20% (Dr. GRPO)"] is True
    hall = next(k for k in m if k.startswith("M1"))
    assert m[hall] is True and "SFT start" in hall  # 0.8 -> 0.4 is down 50%; no --full baseline
    assert m["M2 combined pass >= 60% (Dr. GRPO)"] is True
    assert m["M3 student <= 100 ms per summary, factuality within 2 points"] is True
    assert t["fact precision rises: base < SFT < Dr. GRPO"] is True and t["hallucination falls with it"] is True
    assert t["tool AUC >= 0.75 after SFT"] is True and t["tool AUC >= 0.85 after Dr. GRPO"] is True
    for figure in ("96.0%", "65.0%", "80.0% -> 40.0%", "| 40 |", "40 ms, factuality 1.0 points below the teacher",
                   "3.8x faster, factuality 1.0 points below", "total 500", "30.0% -> 60.0% -> 70.0%",
                   "| base (no tools) |", "| SFT (tools) |", "| Dr. GRPO |", "| fact precision by event family | sports |"):
        assert figure in md, figure
    assert md.count("| met |") == 12

    slow = {"teacher": dist["teacher"], "student": {**dist["student"], "factuality": 0.5}}
    ev_bad = _eval_json({pipeline.SFT: _metrics(valid_call_rate=0.5, hallucination_rate=float("nan")),
                         pipeline.RL: _metrics(rules_pass=0.1, fact_precision=0.4, tool_auc=0.5)})
    md, fig = _tiny(ev_bad, slow)
    m, t = fig["milestones"], fig["targets"]
    assert m["tool calls valid >= 95% (after SFT)"] is False
    assert m["M0 rule pass >= 20% (Dr. GRPO)"] is False
    assert m[next(k for k in m if k.startswith("M1"))] is None  # not measurable, not guessed
    assert m["M3 student <= 100 ms per summary, factuality within 2 points"] is False
    assert m["student >= 3x faster than its teacher, within 2 points (news world target)"] is False
    assert t["fact precision rises: base < SFT < Dr. GRPO"] is None  # no base row: not measured
    assert t["tool AUC >= 0.85 after Dr. GRPO"] is False
    assert "| not measured |" in md and "| not met |" in md


def test_the_student_speedup_shows_its_spread_over_seeds():
    """The speedup is the ratio of the mean p50 latencies; a student that is 7.5x faster
    than one seed's teacher and 1.6x faster than another's shows both beside it."""
    c = pipeline.SMOLLM
    models = {c.start[1]: _metrics()}
    for s, (t_ms, s_ms) in enumerate([(6000.0, 800.0), (2400.0, 1200.0), (1800.0, 1100.0)]):
        models[c.sft(s)] = _metrics()
        models[c.rl(s)] = _metrics(latency_p50_ms=t_ms, factuality=0.95)
        models[c.student(s)] = _metrics(latency_p50_ms=s_ms, factuality=0.92)
    md, fig = pipeline.headline(c, models, [], seeds=3, n_docs=103, backend="oracle")
    assert "| 3.3x faster (1.6x-7.5x by seed), factuality 3.0 points below the teacher | not met |" in md
    md, _ = pipeline.headline(c, {k: v for k, v in models.items() if not k.endswith(("_s1/final", "_s2/final"))},
                              [], seeds=1, n_docs=103, backend="oracle")
    assert "| 7.5x faster, factuality 3.0 points below the teacher |" in md  # one seed: no spread


def test_a_policy_that_states_nothing_meets_no_precision_or_hallucination_target():
    """Fact precision counts the facts stated and hallucination the summaries with an
    error: a policy that says nothing scores 100% and 0% on them. Past 5% of summaries
    stating no fact, those targets are not met, and the row says why."""
    c = pipeline.SMOLLM
    models = {c.start[1]: _metrics(fact_precision=0.78, hallucination_rate=0.8, no_fact_rate=0.0)}
    for s in range(3):
        models[c.sft(s)] = _metrics(fact_precision=0.90 + 0.001 * s, hallucination_rate=0.3, no_fact_rate=0.0)
        models[c.rl(s)] = _metrics(fact_precision=1.0, hallucination_rate=0.0, no_fact_rate=0.6)
    md, fig = pipeline.headline(c, models, [], seeds=3, n_docs=103, backend="oracle")
    t = fig["targets"]
    for name in ("fact precision >= 95% after Dr. GRPO", "hallucination <= 30% after Dr. GRPO"):
        assert t[name] is False, name
    assert t[next(k for k in t if k.startswith("fact precision rises"))] is False
    assert "100.0% (60.0% state no fact)" in md
    assert fig["milestones"][next(k for k in fig["milestones"] if k.startswith("M1"))] is False
    for s in range(3):  # a fast student that says nothing is not "within 2 points" of a teacher that says nothing
        models[c.rl(s)].update(factuality=0.0, latency_p50_ms=900.0, no_fact_rate=0.0)
        models[c.student(s)] = _metrics(factuality=0.0, latency_p50_ms=50.0, no_fact_rate=1.0)
    md, fig = pipeline.headline(c, models, [], seeds=3, n_docs=103, backend="oracle")
    speed = "student >= 3x faster than its teacher, within 2 points (news world target)"
    assert fig["milestones"][speed] is False and "the student states no fact in 100.0%" in md
    for s in range(3):
        models[c.student(s)]["no_fact_rate"] = 0.0
    assert pipeline.headline(c, models, [], seeds=3, n_docs=103, backend="oracle")[1]["milestones"][speed] is True
    for s in range(3):  # 4% state nothing: within the allowance, the figures stand
        models[c.rl(s)]["no_fact_rate"] = 0.04
    md, fig = pipeline.headline(c, models, [], seeds=3, n_docs=103, backend="oracle")
    assert fig["targets"]["fact precision >= 95% after Dr. GRPO"] is True
    assert fig["targets"]["hallucination <= 30% after Dr. GRPO"] is True
    base = _eval_json({pipeline.BASE: _metrics(fact_precision=0.3), pipeline.SFT: _metrics(fact_precision=0.6),
                       pipeline.RL: _metrics(fact_precision=0.9, hallucination_rate=0.1, no_fact_rate=0.5)})
    _, fig = _tiny(base)
    assert fig["targets"]["fact precision rises: base < SFT < Dr. GRPO"] is False
    assert fig["targets"]["hallucination falls with it"] is False


def test_full_table_compares_hallucinations_with_the_rules_only_run():
    rows = {pipeline.SFT: _metrics(hallucination_rate=0.9), pipeline.RL: _metrics(hallucination_rate=0.5)}
    full = {f"runs/{n}/final": _metrics() for n in pipeline.ABLATIONS}
    full["runs/rl_tiny_rules_only/final"] = _metrics(hallucination_rate=0.6)
    full[pipeline.SFT_NOMASK] = _metrics(fact_precision=0.2)
    md, fig = _tiny(_eval_json({**rows, **full}), full=True)
    hall = next(k for k in fig["milestones"] if k.startswith("M1"))
    assert "rules-only" in hall and fig["milestones"][hall] is False  # 0.6 -> 0.5 is down 17%
    assert all(f"| RL {n.replace('rl_tiny_', '').replace('_', ' ')} |" in md for n in pipeline.ABLATIONS)
    assert "| SFT, errors not masked | 20.0% |" in md
    assert fig["milestones"]["M3 student <= 100 ms per summary, factuality within 2 points"] is None
    md, fig = _tiny(_eval_json({**rows, **full}))  # without --full the ablation rows stay out
    assert "RL no delete" not in md and "SFT start" in next(k for k in fig["milestones"] if k.startswith("M1"))


def test_an_ablation_that_takes_a_tool_away_is_evaluated_without_it(tmp_path):
    """The no-delete and no-search RL runs are measured with that tool banned at decode
    time (eval.py tools=...), as they were trained; the rest with every tool; the
    headline reads every one of these evaluations."""
    for profile, seeds in (("smollm", 3), ("tiny", 1)):
        stages = [s for s in pipeline.profile_stages(profile, seeds) if s.full_only and s.argv[0] == "eval.py"]
        seen = {}
        for st in stages:
            tools = next((a.split("=", 1)[1] for a in st.argv if a.startswith("tools=")), "all")
            for model in st.argv[st.argv.index("--compare") + 1:]:
                assert model not in seen, model
                seen[model] = tools
            assert st.output.endswith("eval.json")
        assert len({st.output for st in stages}) == len(stages)  # each writes its own eval.json
        for model, tools in seen.items():
            want = "no_delete" if "_no_delete" in model else "no_search" if "_no_search" in model else "all"
            assert tools == want, (model, tools)
        assert sum("_nomask" in m for m in seen) == seeds and sum("rules_only" in m for m in seen) == seeds
        assert {t for t in seen.values()} == {"all", "no_delete", "no_search"}
        for st in stages:
            out = tmp_path / profile / st.output
            out.parent.mkdir(parents=True, exist_ok=True)
            models = st.argv[st.argv.index("--compare") + 1:]
            out.write_text(json.dumps(_eval_json({m: _metrics() for m in models})))
        models, _, _ = pipeline.read_outputs(stages, tmp_path / profile)
        assert set(models) == set(seen)


def test_seeds_run_each_trained_stage_once_per_seed_with_its_own_outputs():
    one, three = pipeline.profile_stages("tiny", 1), pipeline.profile_stages("tiny", 3)
    assert [s.argv for s in three if s.seed in (None, 0)] == [s.argv for s in one]  # seed 0: the configs as they are
    by = {(s.name, s.seed): s for s in three}
    assert ("base", None) in by and ("base", 1) not in by  # the untrained start is shared
    for name in ("traces", "traces_rules", "corpus", "sft", "rl", "distill", "eval"):
        outs = {by[(name, k)].output for k in range(3)}
        assert len(outs) == 3, name  # every seed writes its own
        assert "seed=2" in by[(name, 2)].argv or name == "corpus", name
    assert "init=runs/sft_tiny_s2/final" in by[("rl", 2)].argv
    assert "teacher=runs/rl_tiny_s2/final" in by[("distill", 2)].argv
    assert "traces=[out/traces/newsworld_s1.jsonl,out/traces/rules_s1.jsonl]" in by[("corpus", 1)].argv
    assert by[("eval", 1)].argv[-2:] == ["runs/sft_tiny_s1/final", "runs/rl_tiny_s1/final"]
    assert by[("eval", 0)].argv[-3:] == [pipeline.BASE, pipeline.SFT, pipeline.RL]  # seed 0 holds the base row
    smollm = {(s.name, s.seed): s for s in pipeline.profile_stages("smollm")}
    assert ("zero_shot", None) in smollm and ("eval", 0) in smollm and ("eval", 1) not in smollm  # one by default
    assert ("eval", 2) in {(s.name, s.seed) for s in pipeline.profile_stages("smollm", 3)}
    assert smollm[("eval", 0)].argv[-3:] == ["runs/sft_smollm/final", "runs/rl_smollm/final",
                                             "runs/distill_smollm/final"]
    with pytest.raises(SystemExit, match="one seed"):
        pipeline.profile_stages("cnn_qwen3_4b", 2)


def test_the_table_shows_each_figure_over_seeds_with_its_spread():
    c = pipeline.SMOLLM
    models = {c.start[1]: _metrics(fact_precision=0.78, hallucination_rate=0.8)}
    for s, (fp_sft, fp_rl) in enumerate([(0.90, 0.94), (0.92, 0.93), (0.91, 0.97)]):
        models[c.sft(s)] = _metrics(fact_precision=fp_sft)
        models[c.rl(s)] = _metrics(fact_precision=fp_rl, latency_p50_ms=300.0 + s)
        models[c.student(s)] = _metrics(latency_p50_ms=90.0, factuality=0.6 - 0.01 * s)
    md, fig = pipeline.headline(c, models, [], seeds=3, n_docs=103, backend="oracle")
    assert "| zero-shot (no tools) | 78.0% |" in md  # one figure: no spread
    assert "| SFT (tools) | 91.0% (90.0%-92.0%) |" in md and "| Dr. GRPO | 94.7% (93.0%-97.0%) |" in md
    assert "| student (no tools) |" in md and "mean over 3 seeds (min-max)" in md
    rises = next(k for k in fig["targets"] if k.startswith("fact precision rises"))
    # zero-shot -> SFT (+13 points) is beyond both spreads; SFT -> RL (+3.7) is not beyond RL's (4 points)
    assert fig["targets"][rises] is False
    assert pipeline._step_up([models[c.start[1]]], [models[c.sft(s)] for s in range(3)], "fact_precision") is True
    assert fig["student"]["latency_p50_ms"] == 90.0 and fig["teacher"]["latency_p50_ms"] == 301.0
    # distill.json names its models: text is kept from the first seed, never averaged
    assert pipeline.mean_metrics([{"f": 1.0, "model": "a"}, {"f": 3.0, "model": "b"}, {"model": "c"}]) == {
        "f": 2.0, "model": "a"}
    speed = fig["milestones"]["student >= 3x faster than its teacher, within 2 points (news world target)"]
    assert speed is True  # 301 / 90 = 3.3x, factuality 0.6 - 0.59 = 1 point


def test_a_figure_measured_by_only_some_seeds_says_how_many():
    c = pipeline.SMOLLM
    models = {c.start[1]: _metrics()}
    for s in range(3):
        models[c.sft(s)] = _metrics()
        models[c.rl(s)] = _metrics(evidence_use=0.97 if s == 0 else float("nan"))  # no rewrite: nothing to measure
    md, _ = pipeline.headline(c, models, [], seeds=3, n_docs=103, backend="oracle")
    rl_row = next(line for line in md.splitlines() if line.startswith("| Dr. GRPO |"))
    assert "97.0% (1 of 3 seeds)" in rl_row
    assert "| evidence use >= 90% after Dr. GRPO | 97.0% (1 of 3 seeds) | met |" in md
    assert pipeline._seed_cell([0.5, None, 0.7], "pct") == "60.0% (50.0%-70.0%; 2 of 3 seeds)"
    assert pipeline._seed_cell([0.5, 0.7], "pct") == "60.0% (50.0%-70.0%)"
    assert pipeline._seed_cell([None, None], "pct") == pipeline._cell(None, "pct")


def test_stage_names_and_overrides_are_checked(tmp_path):
    with pytest.raises(SystemExit, match="unknown stage"):
        pipeline.main(["--only", "sfft", "--workdir", str(tmp_path)])
    with pytest.raises(SystemExit, match="STAGE.KEY=VALUE"):
        pipeline.main(["--set", "sft=1", "--workdir", str(tmp_path)])
    assert {s.name for s in pipeline.STAGES} >= {"docs", "split", "base", "traces", "corpus", "sft", "rl", "eval",
                                                 "distill"}
    for s in pipeline.STAGES:
        program = ROOT / (s.argv[1] if s.argv[0] == "-m" else s.argv[0])  # a script, or a package run with -m
        assert program.exists(), s.name
        assert "--config" not in s.argv or (ROOT / s.argv[s.argv.index("--config") + 1]).exists(), s.name


def test_a_failed_student_leaves_the_rest_of_the_chain_and_its_evaluation_standing(tmp_path, monkeypatch, capsys):
    """Distillation is the one optional stage: when it fails (say no teacher episode
    passed its filter), the chain goes on, the evaluation leaves that student out and
    the end says which stage failed. Any other stage's failure still stops the chain."""
    ran = []

    def fake_run(stage, cwd, nproc=1, log=None, verbose=False):
        ran.append(stage)
        if stage.name in fail:
            raise SystemExit(f"pipeline: stage {stage.label!r} failed (exit 1)")
        out = cwd / stage.output
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix:
            out.write_text(json.dumps({"models": []}))
        else:
            out.mkdir(exist_ok=True)
        return 0.0

    monkeypatch.setattr(pipeline, "run_stage", fake_run)
    fail = {"distill"}
    pipeline.main(["--profile", "tiny", "--workdir", str(tmp_path)])
    ev = next(st for st in ran if st.name == "eval")
    assert "runs/distill_tiny/final" not in ev.argv and "runs/rl_tiny/final" in ev.argv
    assert "distill failed; its student is left out" in capsys.readouterr().out
    fail, ran[:] = {"rl"}, []
    with pytest.raises(SystemExit, match="'rl' failed"):
        pipeline.main(["--profile", "tiny", "--workdir", str(tmp_path / "b")])
    assert [st.name for st in ran][-1] == "rl"


def test_the_pipeline_keeps_every_stages_peak_memory_and_names_the_largest(tmp_path, monkeypatch, capsys):
    """Each stage's peak resident memory goes to peak_memory.json as it finishes, and the end
    names the largest; a resumed call keeps the peaks of the stages it skips."""
    sizes = {"sft": 5e9, "rl": 7.5e9}

    def fake_run(stage, cwd, nproc=1, log=None, verbose=False):
        out = cwd / stage.output
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"models": []})) if out.suffix else out.mkdir(exist_ok=True)
        pipeline.PEAK_RSS[stage.label] = int(sizes.get(stage.name, 1e9))
        return 0.0

    monkeypatch.setattr(pipeline, "run_stage", fake_run)
    pipeline.main(["--profile", "tiny", "--workdir", str(tmp_path)])
    path = tmp_path / "runs/pipeline/peak_memory.json"
    peaks = json.loads(path.read_text())
    assert peaks["rl"] == 7.5e9 and peaks["sft"] == 5e9 and len(peaks) == len(
        [s for s in pipeline.profile_stages("tiny", 1) if not s.full_only])
    assert "pipeline: peak memory 7.5 GB (rl)" in capsys.readouterr().out
    sizes["eval"] = 2e9
    (tmp_path / "runs/eval_tiny/eval.json").unlink()  # only the evaluation runs again
    pipeline.main(["--profile", "tiny", "--workdir", str(tmp_path)])
    assert json.loads(path.read_text())["rl"] == 7.5e9 and "peak memory 7.5 GB (rl)" in capsys.readouterr().out


SMALLEST = {  # seconds-scale sizes of every stage (the configs' own keys)
    "base": ["data.generate=48", "epochs=1", "eval.every=0", "eval.n_docs=2", "eval.max_new_tokens=16"],
    "traces": ["limit=24", "drafter.generate.max_new_tokens=24"],
    "traces_rules": ["limit=24"],
    "sft": ["epochs=1", "warmup_steps=1", "eval.n_docs=2", "eval.max_new_tokens=16"],
    "rl": ["steps=2", "prompts_per_step=2", "group_size=2", "micro_groups=2", "warmup_steps=0", "eval.n_docs=2",
           "eval.max_new_tokens=16", "sampling.max_new_tokens=16"],
    "eval": ["n_docs=2", "n_samples=2", "max_new_tokens=16", "latency_docs=2"],
    "distill": ["steps=3", "warmup_steps=0", "data.max_train_docs=4", "generate.max_new_tokens=16",
                "generate.filter=none", "eval.n_docs=2", "eval.latency_docs=2", "eval.max_new_tokens=16"],
}
TWO_SEEDS = [s for s in pipeline.profile_stages("tiny", 2) if not s.full_only]


@pytest.mark.slow
def test_smallest_pipeline_end_to_end(tmp_path):
    args = [a for stage, kvs in SMALLEST.items() for kv in kvs for a in ("--set", f"{stage}.{kv}")]
    run = subprocess.run([sys.executable, str(ROOT / "pipeline.py"), "--profile", "tiny", "--seeds", "2",
                          "--workdir", str(tmp_path), *args],
                         capture_output=True, text=True, timeout=900, env={**os.environ,
                                                                          "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for stage in TWO_SEEDS:
        assert (tmp_path / stage.output).exists(), stage.label
    assert (tmp_path / "runs/eval_tiny/report.md").exists() and (tmp_path / "runs/distill_tiny_s1/final").is_dir()
    md = (tmp_path / "runs/pipeline/headline.md").read_text()
    fig = json.loads((tmp_path / "runs/pipeline/headline.json").read_text())
    for key in ("valid_call_rate", "rules_pass", "hallucination_rate", "pass", "pass_at_1", "pass_at_8"):
        assert key in fig["sft"] and key in fig["rl"], key
    assert len(fig["per_seed"]["sft"]) == len(fig["per_seed"]["rl"]) == 2 and len(fig["per_seed"]["start"]) == 1
    assert "latency_p50_ms" in fig["student"] and "factuality" in fig["student"]
    assert len(fig["milestones"]) == 6 and len(fig["targets"]) == 6
    assert set(fig["seconds"]) == {s.label for s in TWO_SEEDS} and "sft[s1]" in fig["seconds"]
    for key in ("fact_precision", "tool_auc", "evidence_use", "search_found_fact"):
        assert key in fig["base"] and key in fig["sft"] and key in fig["rl"], key
    for row in ("| base (no tools) |", "| SFT (tools) |", "| Dr. GRPO |", "| student (no tools) |", "M0 rule pass",
                "M1 hallucinations", "M2 combined pass", "M3 student", "fact precision rises", "Stage times",
                "mean over 2 seeds (min-max)"):
        assert row in md, row
    assert md in run.stdout

    again = subprocess.run([sys.executable, str(ROOT / "pipeline.py"), "--profile", "tiny", "--seeds", "2",
                            "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.count("exists, skipped") == len(TWO_SEEDS), again.stdout[-2000:]


def test_the_gpu_chain_dry_run_lists_the_recipe_in_order_and_every_config_loads(capsys):
    """`--profile cnn_qwen3_4b --dry-run`: data -> split -> traces -> corpus -> SFT -> rejection
    -> teacher episodes -> teacher SFT -> KTO -> v17, v18, v19 -> eval -> distill, each command
    the stage's own script and config; every config loads with its script's own Config, and
    each stage starts from the one the recipe names."""
    from factual_tools import settings
    import distill
    import eval as eval_
    import filter_traces
    import rl
    import sft
    import synth_traces
    import teacher_episodes

    pipeline.main(["--profile", "cnn_qwen3_4b", "--dry-run"])
    lines = capsys.readouterr().out.strip().splitlines()
    names = [line.split()[0] for line in lines]
    assert names == ["docs", "eval_docs", "split", "traces", "corpus", "sft", "rejection", "teacher", "teacher_sft",
                     "kto", "rl_v17", "rl_v18", "rl_v19", "eval", "distill"]
    classes = {"sft.py": sft.Config, "rl.py": rl.Config, "eval.py": eval_.Config, "distill.py": distill.Config,
               "filter_traces.py": filter_traces.Config, "teacher_episodes.py": teacher_episodes.Config,
               "synth_traces.py": synth_traces.Config}
    cfgs = {}
    for stage in pipeline.CNN_STAGES:
        script, *rest = stage.argv
        if script in classes:
            at = rest.index("--compare") if "--compare" in rest else len(rest)
            cfgs[stage.name] = settings.load_config(classes[script], rest[:at])
    assert cfgs["sft"].data.train == cfgs["corpus"].out_dir + "/train.jsonl"
    assert cfgs["rejection"].init == "runs/sft_qwen3_4b/final" and cfgs["rejection"].mode == "rejection"
    assert cfgs["teacher_sft"].init == "runs/rejection_qwen3_4b/final"
    assert cfgs["teacher_sft"].data.train == cfgs["teacher"].out == cfgs["rl_v19"].data.teacher
    assert cfgs["kto"].init == "runs/teacher_sft_qwen3_4b/final" and cfgs["kto"].kto.beta == 0.02
    for v in (17, 18, 19):
        assert cfgs[f"rl_v{v}"].init == "runs/teacher_sft_qwen3_4b/final"  # Dr. GRPO on the post-teacher-SFT policy
    assert cfgs["distill"].teacher == "runs/drgrpo_v19/final"
    assert all(getattr(c, "score_method", "branch") == "branch" for c in cfgs.values())  # Unsloth: no 4D masks
    with pytest.raises(SystemExit, match="unknown stage"):
        pipeline.main(["--profile", "cnn_qwen3_4b", "--dry-run", "--only", "base"])


@pytest.mark.slow
def test_the_gpu_chain_smoke_runs_on_a_cpu_with_the_same_configs(tmp_path):
    """`--profile cnn_qwen3_4b --smoke`: every stage of the GPU chain runs, with the GPU
    user's config and only model, data and step-count overrides (tiny presets, the news
    world, the oracle teacher on 127.0.0.1), and each stage's output is there."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "pipeline.py", "--profile", "cnn_qwen3_4b", "--smoke", "--workdir",
                          str(tmp_path)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ran = [line.split(": ", 1) for line in res.stdout.splitlines() if line.startswith("=== ")]
    gpu = {s.name: s for s in pipeline.CNN_STAGES}
    assert [name[4:] for name, _ in ran] == list(gpu)
    allowed = {"model.", "data.", "steps=", "epochs=", "eval.", "sampling.", "rejection.", "kto.", "reward.factuality=",
               "prompts_per_step=", "group_size=", "batch_", "grad_accum=", "save_every=", "warmup_steps=", "base.",
               "n_docs=", "n_samples=", "max_new_tokens=", "latency_docs=", "student.", "generate.", "annotator.",
               "judge.", "drafter.", "limit=", "tokenizer=", "max_tokens=", "judge_min=", "chunk="}
    for (name, cmd), stage in zip(ran, gpu.values()):
        args = cmd.split()[1:]
        if "--config" in stage.argv:  # the GPU user's script and config, then only allowed overrides
            n = stage.argv.index("--config") + 2
            assert args[:n] == stage.argv[:n], (name, args)
            extra = [a for a in args[n:] if a not in stage.argv]
            assert all(a.startswith(tuple(allowed)) for a in extra), (name, extra)
    for out in ("runs/drgrpo_v19/final", "runs/kto_qwen3_4b/final", "runs/eval_cnn/eval.json",
                "runs/distill_cnn/distill.json", "out/teacher/cnn_train.done.json"):
        assert (tmp_path / out).exists(), out
    # v19's ToolMatch had its teacher (a stage's own output is in its log)
    assert "teacher episodes for 12/40 training documents" in (tmp_path / "runs/pipeline/logs/rl_v19.log").read_text()


def test_a_stage_prints_to_its_log_and_the_terminal_keeps_its_progress_and_result(tmp_path, capfd):
    """A stage's standard output (its resolved config and step lines) goes to its log
    file; its standard error (progress bars, warnings) stays on the terminal; what it
    reports is the last line it printed, or an evaluation's figures per model. A
    failure shows the end of the log and the command to rerun."""
    script = tmp_path / "stage.py"
    script.write_text("import sys\nprint('config: many lines')\nprint('step 1/1 | loss 0.5')\n"
                      "print('progress 100%', file=sys.stderr)\nprint('done: loss 0.5')\n"
                      "open('out.txt', 'w').write('x')\nsys.exit(int(sys.argv[1]))\n")
    log = tmp_path / "logs" / "s.log"
    ok = pipeline.Stage("s", [str(script), "0"], "out.txt")
    assert pipeline.run_stage(ok, tmp_path, log=log) >= 0
    out, err = capfd.readouterr()
    assert "config: many lines" not in out + err and "progress 100%" in err and f"=== s: python {script} 0" in out
    assert "config: many lines" in log.read_text()
    assert pipeline.PEAK_RSS["s"] > 1e6  # the stage's peak memory, for its done line
    assert pipeline.result_lines(ok, tmp_path, log) == ["done: loss 0.5"]
    with pytest.raises(SystemExit, match=r"(?s)done: loss 0.5\n.*all of it in .*s.log.*failed \(exit 3\)"):
        pipeline.run_stage(pipeline.Stage("s", [str(script), "3"], "out.txt"), tmp_path, log=log)
    pipeline.run_stage(ok, tmp_path, log=log, verbose=True)  # --verbose: everything on the terminal
    assert "config: many lines" in capfd.readouterr().out
    ev = pipeline.Stage("eval", ["eval.py"], "eval.json")
    (tmp_path / "eval.json").write_text(json.dumps(_eval_json({"runs/rl/final": _metrics(fact_precision=0.9)})))
    assert pipeline.result_lines(ev, tmp_path, log) == [
        "runs/rl/final: fact precision 90.0%, hallucination 50.0%, combined pass 10.0%"]


def test_the_headline_plot_is_written_with_one_bar_group_per_figure(tmp_path):
    c = pipeline.SMOLLM
    models = {c.start[1]: _metrics(fact_precision=0.78)}
    for s in range(2):
        models[c.sft(s)], models[c.rl(s)] = _metrics(fact_precision=0.9 + s / 100), _metrics(fact_precision=0.95)
        models[c.student(s)] = _metrics()
    _, fig = pipeline.headline(c, models, [], seeds=2, n_docs=103, backend="oracle")
    pipeline.plot_headline(fig, tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [label for label in fig["per_seed"] if label not in ("start", "sft", "rl")] == [
        "zero-shot (no tools)", "SFT (tools)", "Dr. GRPO", "student (no tools)"]


# --- the long task: phases A-E, the control B+, the copying baselines ---------------


def test_the_news_chain_runs_the_claims_core_by_default_and_every_phase_with_full():
    core = {s.name for s in pipeline.profile_stages("news") if not s.full_only}
    full = {s.name for s in pipeline.profile_stages("news")}
    assert {"zero_shot", "traces", "corpus", "sft", "sft_plain", "rl", "rl_bplus", "distill", "eval",
            "eval_notools"} <= core
    assert {"rl_a", "rl_b", "rl_no_delete", "rl_no_search", "rl_no_budget"} <= full - core
    by = {(s.name, s.seed): s for s in pipeline.profile_stages("news", 2)}
    assert "init=runs/sft_news_plain_s1/final" in by[("rl_bplus", 1)].argv
    assert "init=runs/sft_news_s1/final" in by[("rl", 1)].argv
    assert not any(a.startswith("init=") for a in by[("rl_a", 1)].argv)  # phase A starts from the instruct model
    assert "data.train=out/corpus/news_s1/train.jsonl" in by[("sft_plain", 1)].argv
    assert "tools=none" in by[("eval_notools", 0)].argv and "tools=none" in by[("zero_shot", None)].argv
    assert by[("zero_shot", None)].argv[-3:] == ["lead-3", "best-extract", "smollm2-135m"]
    assert "tools=no_delete" in by[("eval_no_delete_full", 0)].argv
    assert by[("eval", 0)].argv[-1] == "runs/distill_news/final"
    assert "--threshold" in by[("split", None)].argv


def test_b_plus_gets_the_compute_and_reward_of_d():
    """The control differs from D in its start and its tools only: the same documents,
    group size, steps and reward."""
    import dataclasses

    from helpers import load_config_file

    d, bp = (load_config_file(ROOT / "configs" / f) for f in ("rl_news.yaml", "rl_news_bplus.yaml"))
    differ = {f.name for f in dataclasses.fields(d) if getattr(d, f.name) != getattr(bp, f.name)}
    assert differ == {"name", "init", "tools"}, differ
    assert bp.tools == "none" and d.tools == "all"
    plain = load_config_file(ROOT / "configs" / "sft_news_plain.yaml")
    tools = load_config_file(ROOT / "configs" / "sft_news.yaml")
    assert plain.data.strip_tools and plain.data.train == tools.data.train


def test_the_split_threshold_is_the_worlds():
    import newsworld

    split = next(s for s in pipeline.profile_stages("news") if s.name == "split")
    assert float(split.argv[split.argv.index("--threshold") + 1]) == newsworld.LONG_SPLIT_THRESHOLD


def _news_models(seeds: int, **rows) -> dict:
    """Eval metrics per model directory for the news chain's rows, by row label."""
    out = {}
    for label, paths in pipeline.news_rows(seeds, full=True):
        for i, p in enumerate(paths):
            if label in rows:
                m = rows[label]
                out[p] = _metrics(**(m[i] if isinstance(m, list) else m))
    return out


def test_news_headline_states_the_claim_and_the_roadmap_milestones():
    lead, best = "copy: lead-3", "copy: best whole sentences (oracle)"
    models = _news_models(
        3,
        **{lead: {"pass": 0.0}, best: {"pass": 0.02},
           "zero-shot (no tools)": {"pass": 0.05, "valid_call_rate": float("nan")},
           "A: RL, rules only (no tools)": {"rules_pass": 0.3, "hallucination_rate": 0.8},
           "B: RL + factuality (no tools)": {"hallucination_rate": 0.4},
           "B+: SFT stripped -> RL (no tools)": [{"pass": p, "hallucination_rate": h}
                                                 for p, h in ((0.30, 0.5), (0.35, 0.45), (0.32, 0.5))],
           "C: SFT (tools)": {"valid_call_rate": 0.97},
           "D: Dr. GRPO (tools)": [{"pass": p, "hallucination_rate": h, "tool_auc": 0.8, "evidence_use": 0.95}
                                   for p, h in ((0.62, 0.2), (0.65, 0.25), (0.70, 0.2))],
           "D without search": [{"pass": p} for p in (0.4, 0.45, 0.5)],
           "D without delete": [{"pass": p} for p in (0.6, 0.66, 0.72)],
           "E: student (no tools)": {"latency_p50_ms": 60.0, "factuality": 0.59}})
    md, fig = pipeline.news_headline(models, [], 3, full=True, n_docs=103, backend="oracle")
    c, m = fig["claim"], fig["milestones"]
    assert c["D beats B+ on combined pass, beyond both spreads"] is True
    assert c["D beats B+ on hallucination, beyond both spreads"] is True
    assert c["D's tool AUC >= 0.75"] is True and c["D's evidence use >= 90%"] is True
    assert c["D without search falls below D on combined pass, beyond both spreads (--full)"] is True
    assert c["D without delete falls below D on combined pass, beyond both spreads (--full)"] is False  # overlaps
    assert c["the copying baselines fail M2 (combined pass < 60%)"] is True
    assert m["M0: A's rule pass >= 20% (--full)"] is True
    assert m["M1: B's hallucinations down >= 40% vs A (--full)"] is True  # 0.8 -> 0.4
    assert m["M2: D's combined pass >= 60%"] is True
    assert m["C: tool calls valid >= 95% (after tool SFT)"] is True
    assert m["M3: E <= 100 ms per summary, factuality within 2 points of D"] is True  # 0.6 vs 0.59, 60 ms
    rows = [line.split(" | ")[0] for line in md.splitlines() if line.startswith("| ") and "%" in line]
    assert rows[:4] == [f"| {lead}", f"| {best}", "| zero-shot (no tools)", "| A: RL, rules only (no tools)"]
    assert "65.7% (62.0%-70.0%) vs 32.3% (30.0%-35.0%)" in md

    # without --full, A, B and the ablations are not measured, and a copy that passes fails the claim
    core = {k: v for k, v in models.items() if "rl_news_a" not in k and "rl_news_b/" not in k}
    core["best-extract"] = _metrics(**{"pass": 0.7})
    md, fig = pipeline.news_headline(core, [], 3, full=False, n_docs=103, backend="oracle")
    assert fig["milestones"]["M0: A's rule pass >= 20% (--full)"] is None
    assert fig["claim"]["the copying baselines fail M2 (combined pass < 60%)"] is False
    assert "| D without search |" not in md


def test_news_claim_needs_two_seeds_to_judge_beyond_the_spreads():
    # One seed has no spread, so "beyond both spreads" cannot be judged: D ahead of B+ on one
    # seed reads "one seed", not met, in the table and None in the figures.
    models = _news_models(1, **{"D: Dr. GRPO (tools)": {"pass": 0.05, "hallucination_rate": 0.10},
                                "B+: SFT stripped -> RL (no tools)": {"pass": 0.28, "hallucination_rate": 0.36},
                                "D without search": {"pass": 0.01}, "D without delete": {"pass": 0.05}})
    md, fig = pipeline.news_headline(models, [], 1, full=True, n_docs=103, backend="oracle")
    for name in ("D beats B+ on combined pass, beyond both spreads", "D beats B+ on hallucination, beyond both spreads",
                 "D without search falls below D on combined pass, beyond both spreads (--full)"):
        assert fig["claim"][name] is None
        line = next(x for x in md.splitlines() if x.startswith(f"| {name} |"))
        assert line.endswith("| one seed: not judged (--seeds 3) |"), line
    assert fig["claim"]["D's tool AUC >= 0.75"] is True  # a threshold needs no spread


def test_short_world_rise_beyond_the_seed_spread_needs_two_seeds():
    # The short world's "each step beyond the seed spread" on one trained seed has no spread
    # to be beyond: it reads "one seed", as the long task's claims do. Zero-shot is greedy and
    # shared by the seeds, so its single figure is not what makes a run one seed.
    c = pipeline.SMOLLM
    models = {c.start[1]: _metrics(fact_precision=0.78), c.sft(0): _metrics(fact_precision=0.91),
              c.rl(0): _metrics(fact_precision=0.99)}
    md, fig = pipeline.headline(c, models, [], seeds=1, n_docs=103, backend="oracle")
    rises = next(k for k in fig["targets"] if k.startswith("fact precision rises"))
    assert fig["targets"][rises] is None
    line = next(x for x in md.splitlines() if x.startswith(f"| {rises} |"))
    assert line.endswith("| one seed: not judged (--seeds 3) |"), line


def _episode(model: str, doc: str, turns: list[tuple[str, str]], passed: bool, errors=()) -> str:
    return json.dumps({"model": model, "doc_id": doc, "score": {"pass": passed, "coverage": 0.5},
                       "errors": [{"type": t, "error_span": "x"} for t in errors],
                       "episode": {"doc_id": doc, "turns": [{"text": t, "injected": i} for t, i in turns]}})


def test_quoted_summaries_show_every_row_on_the_same_random_documents(tmp_path, capsys):
    ids = [f"doc-{i}" for i in range(6)]
    tools = [("A sentence.<search>key</search>", "<results><0>A sentence.</0></results>"),
             ('<delete scope="sentence"/>', ""), (" A sentence.", "")]
    lines = [_episode("runs/d/final", d, tools, passed=d == "doc-3") for d in ids]
    lines += [_episode("runs/bp/final", d, [("Plain summary.", "")], False, ["unsupported"]) for d in ids[:5]]
    (tmp_path / "ev").mkdir()
    (tmp_path / "ev" / "episodes.jsonl").write_text("\n".join(lines) + "\n")
    rows = [("D", "runs/d/final"), ("B+", "runs/bp/final"), ("never evaluated", "runs/x/final")]
    md = pipeline.quoted_summaries([tmp_path / "ev" / "eval.json", tmp_path / "missing" / "eval.json"], rows)
    import random
    docs = random.Random(0).sample(ids[:5], 2)  # only documents every quoted row has
    assert [x[4:] for x in md.splitlines() if x.startswith("### ")] == docs
    assert md.count("- **D**: ") == 2 and md.count("- **B+**: ") == 2 and "never evaluated" not in md
    d_line = next(x for x in md.splitlines() if x.startswith("- **D**"))
    assert '"A sentence.<search>key</search><results>...</results><delete scope="sentence"/> A sentence."' in d_line
    assert "<0>" not in md  # the search results are elided
    assert "flagged: unsupported" in next(x for x in md.splitlines() if x.startswith("- **B+**"))
    assert ("(pass)" in md) == ("doc-3" in docs)
    assert pipeline.quoted_summaries([tmp_path / "missing" / "eval.json"], rows) == ""
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "episodes.jsonl").write_text(lines[0] + "\n{truncated\n")
    assert pipeline.quoted_summaries([tmp_path / "bad" / "eval.json"], rows) == ""
    assert "episodes.jsonl:2: malformed JSON line" in capsys.readouterr().out
