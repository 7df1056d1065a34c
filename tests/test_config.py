"""Tests for settings.py and common.py: strict config loading, runs, metrics, step lines, atomic writes.

The configs below use `from __future__ import annotations` on purpose: every
annotation is a string, as in the scripts, so the loader must resolve them.
"""
from __future__ import annotations

import ast
import importlib
import json
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

from helpers import script_for
from factual_tools.common import (
    atomic_dir, atomic_write_text, format_step, git_revision, jsonable, mean, MetricsWriter, read_metrics,
    save_config, seed_everything, start_run,
)
from factual_tools import settings
from factual_tools.settings import ConfigError, config_to_dict, format_config, load_config, parse_args

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    dropout: float | None = None


@dataclass
class OptimConfig:
    lr: float = 1e-4
    betas: tuple[float, ...] = (0.9, 0.999)
    schedule: Literal["cosine", "linear", "constant"] = "cosine"


@dataclass
class Config:
    name: str = "test"
    runs_dir: str = "runs"
    seed: int = 0
    steps: int = 10
    bf16: bool = False
    max_len: int | None = 512
    weights: dict[str, float] = field(default_factory=lambda: {"factuality": 1.0})
    # A group whose default differs from its class defaults: overrides must keep rank=8.
    lora: LoraConfig = field(default_factory=lambda: LoraConfig(rank=8))
    optim: OptimConfig = field(default_factory=OptimConfig)

    def __post_init__(self):
        if self.steps < 0:
            raise ValueError("steps must be >= 0")


@dataclass
class Required:
    name: str
    seed: int = 0


@dataclass
class BadUnion:
    x: int | str = 1


def yaml_file(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def load(tmp_path, yaml_text=None, cli=()):
    argv = ["--config", yaml_file(tmp_path, yaml_text)] if yaml_text is not None else []
    return load_config(Config, argv + list(cli))


# --- loading: defaults, YAML, command line, precedence ---------------------------------


def test_defaults():
    assert load_config(Config, []) == Config()
    assert load_config(Config, []).lora.rank == 8


def test_yaml_overrides(tmp_path):
    cfg = load(tmp_path, "steps: 3\nlora:\n  alpha: 4\noptim:\n  lr: 1e-4\n  schedule: linear\n")
    assert (cfg.steps, cfg.optim.schedule) == (3, "linear")
    assert cfg.lora.alpha == 4.0 and isinstance(cfg.lora.alpha, float)
    assert cfg.optim.lr == 1e-4 and isinstance(cfg.optim.lr, float)  # PyYAML gave the str "1e-4"
    assert cfg.lora.rank == 8  # untouched key of an overridden group keeps its default
    assert cfg.seed == 0


@pytest.mark.parametrize("yaml_text, cli, expected", [
    (None, [], 10),                          # default
    ("steps: 20\n", [], 20),                 # file beats default
    (None, ["steps=30"], 30),                # command line beats default
    ("steps: 20\n", ["steps=30"], 30),       # command line beats file
    ("steps: 20\n", ["steps=30", "steps=40"], 40),  # last override wins
    ("seed: 1\n", ["lora.rank=2"], 10),      # unrelated keys leave it alone
])
def test_precedence(tmp_path, yaml_text, cli, expected):
    assert load(tmp_path, yaml_text, cli).steps == expected


# --- extends: a config file built on another ----------------------------------------


def test_extends_takes_the_base_and_changes_only_what_the_file_sets(tmp_path):
    yaml_file(tmp_path, "steps: 20\nseed: 3\nlora:\n  rank: 4\n  alpha: 2\nweights: {a: 1, b: 2}\n", "base.yaml")
    cfg = load(tmp_path, "extends: base.yaml\nsteps: 30\nlora:\n  alpha: 8\nweights: {c: 3}\n")
    assert (cfg.steps, cfg.seed, cfg.lora.rank, cfg.lora.alpha) == (30, 3, 4, 8.0)
    assert cfg.weights == {"a": 1.0, "b": 2.0, "c": 3.0}  # a dict-valued key merges, as `weights.c=3` does
    # the command line still beats both files
    assert load(tmp_path, "extends: base.yaml\nsteps: 30\n", ["steps=40", "seed=5"]).steps == 40


def test_extends_chains_and_resolves_each_path_beside_its_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    yaml_file(tmp_path / "a", "steps: 1\nseed: 1\nname: root\n", "root.yaml")
    yaml_file(tmp_path / "b", "extends: ../a/root.yaml\nseed: 2\n", "mid.yaml")
    cfg = load(tmp_path, "extends: b/mid.yaml\nname: leaf\n")
    assert (cfg.steps, cfg.seed, cfg.name) == (1, 2, "leaf")


@pytest.mark.parametrize("files, needles", [
    ({"cfg.yaml": "extends: missing.yaml\n"}, ["missing.yaml", "cfg.yaml", "extends"]),
    ({"cfg.yaml": "extends: other.yaml\n", "other.yaml": "extends: cfg.yaml\n"}, ["cycle", "other.yaml"]),
    ({"cfg.yaml": "extends: [a.yaml]\n"}, ["extends", "cfg.yaml", "file name"]),
    ({"cfg.yaml": "extends: base.yaml\n", "base.yaml": "stpes: 3\n"}, ["stpes", "base.yaml", "steps"]),
])
def test_extends_errors_name_the_file(tmp_path, files, needles):
    for name, text in files.items():
        yaml_file(tmp_path, text, name)
    with pytest.raises(ConfigError) as e:
        load_config(Config, ["--config", str(tmp_path / "cfg.yaml")])
    for needle in needles:
        assert needle in str(e.value)


def test_cli_beats_yaml_in_nested_group(tmp_path):
    cfg = load(tmp_path, "lora:\n  rank: 4\n  alpha: 2\n", ["lora.rank=64"])
    assert (cfg.lora.rank, cfg.lora.alpha) == (64, 2.0)


@pytest.mark.parametrize("yaml_text, cli, expected", [
    (None, ["weights.rules=0.5"], {"factuality": 1.0, "rules": 0.5}),      # default entries kept
    ("weights: {a: 2}\n", ["weights.b=3"], {"a": 2.0, "b": 3.0}),          # file entries kept
    ("weights: {a: 2}\n", ["weights.a=3"], {"a": 3.0}),                    # one entry replaced
    (None, ["weights={a: 1}", "weights.b=2"], {"a": 1.0, "b": 2.0}),        # after a whole dict
])
def test_cli_sets_one_entry_of_a_dict_key(tmp_path, yaml_text, cli, expected):
    assert load(tmp_path, yaml_text, cli).weights == expected


def test_cli_dict_entry_value_is_type_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"'weights.a'.*float.*'x'"):
        load(tmp_path, None, ["weights.a=x"])


@pytest.mark.parametrize("cli, attr, expected", [
    (["name=001"], "name", "001"),                     # str keeps the raw text
    (["max_len=none"], "max_len", None),
    (["max_len=NULL"], "max_len", None),
    (["max_len=7"], "max_len", 7),
    (["lora.dropout=0.1"], "lora.dropout", 0.1),
    (["lora.targets=[a, b]"], "lora.targets", ["a", "b"]),
    (["lora.targets=[]"], "lora.targets", []),
    (["optim.betas=[0.8, 1]"], "optim.betas", (0.8, 1.0)),
    (["weights={a: 2, b: 0.5}"], "weights", {"a": 2.0, "b": 0.5}),
    (["optim.lr=3e-5"], "optim.lr", 3e-5),
    (["lora.alpha=3"], "lora.alpha", 3.0),
    (["optim.schedule=constant"], "optim.schedule", "constant"),
    *[([f"bf16={w}"], "bf16", True) for w in ("true", "True", "yes", "1", "on", "ON")],
    *[([f"bf16={w}"], "bf16", False) for w in ("false", "FALSE", "no", "0", "off")],
])
def test_cli_values_coerced_by_type(cli, attr, expected):
    value = load_config(Config, cli)
    for part in attr.split("."):
        value = getattr(value, part)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("yaml_text, attr, expected", [
    ("max_len: null\n", "max_len", None),
    ("optim:\n  lr: 1e-4\n", "optim.lr", 1e-4),
    ("optim:\n  lr: '2.5'\n", "optim.lr", 2.5),
    ("optim:\n  betas: [0.5, 0.6]\n", "optim.betas", (0.5, 0.6)),
    ("steps: '12'\n", "steps", 12),
    ("bf16: yes\n", "bf16", True),
    ("name: '001'\n", "name", "001"),
    ("weights: {x: 1}\n", "weights", {"x": 1.0}),
    ("", "steps", 10),  # an empty file is an empty mapping
])
def test_yaml_values_coerced_by_type(tmp_path, yaml_text, attr, expected):
    value = load(tmp_path, yaml_text)
    for part in attr.split("."):
        value = getattr(value, part)
    assert value == expected and type(value) is type(expected)


# --- strictness: unknown keys, wrong types, malformed arguments -------------------------


@pytest.mark.parametrize("yaml_text, cli, needles", [
    ("stesp: 3\n", [], ["'stesp'", "cfg.yaml", "did you mean 'steps'"]),
    ("lora:\n  rnak: 4\n", [], ["'lora.rnak'", "cfg.yaml", "did you mean 'lora.rank'"]),
    ("optim:\n  shedule: linear\n", [], ["'optim.shedule'", "'optim.schedule'"]),
    (None, ["stpes=3"], ["'stpes'", "command line", "did you mean 'steps'"]),
    (None, ["lora.rnak=16"], ["'lora.rnak'", "command line", "did you mean 'lora.rank'"]),
    (None, ["rank=16"], ["'rank'", "'lora.rank'"]),       # right leaf, missing group
    (None, ["lr=1e-3"], ["'lr'", "did you mean 'optim.lr'"]),  # too short for difflib alone
    (None, ["seed.x=1"], ["'seed.x'", "command line"]),   # a scalar used as a group
    (None, ["nope.rank=1"], ["'nope.rank'", "'lora.rank'"]),
])
def test_unknown_key(tmp_path, yaml_text, cli, needles):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, yaml_text, cli)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("yaml_text, cli, needles", [
    ("steps: 1.5\n", [], ["'steps'", "int", "1.5", "cfg.yaml"]),         # float for int
    (None, ["steps=1.5"], ["'steps'", "int", "'1.5'", "command line"]),
    ("steps: 2.0\n", [], ["'steps'", "int", "2.0"]),                     # even a whole float
    ("steps: true\n", [], ["'steps'", "int", "True", "bool"]),            # bool is not an int
    ("optim:\n  lr: true\n", [], ["'optim.lr'", "float", "True"]),
    ("optim:\n  lr: fast\n", [], ["'optim.lr'", "float", "'fast'"]),      # str for float
    (None, ["optim.lr=abc"], ["'optim.lr'", "float", "'abc'", "command line"]),
    ("optim:\n  schedule: step\n", [], ["'optim.schedule'", "'cosine'", "'linear'", "'step'"]),
    (None, ["optim.schedule=step"], ["'optim.schedule'", "'constant'", "'step'"]),
    ("name: 1\n", [], ["'name'", "str", "quote"]),                        # YAML int for str
    (None, ["bf16=maybe"], ["'bf16'", "bool", "'maybe'"]),
    ("lora:\n  targets: [q, 1]\n", [], ["'lora.targets[1]'", "str", "1"]),
    ("lora:\n  targets: q_proj\n", [], ["'lora.targets'", "list", "'q_proj'"]),
    (None, ["weights=[1]"], ["'weights'", "dict", "[1]"]),
    (None, ["weights={a: x}"], ["weights['a']", "float", "'x'"]),
    ("max_len: abc\n", [], ["'max_len'", "int", "'abc'"]),
    (None, ["optim.betas=[a"], ["'optim.betas'", "cannot parse"]),
    ("steps:\n  a: 1\n", [], ["'steps'", "int", "{'a': 1}"]),             # mapping for scalar
    ("lora: 3\n", [], ["'lora'", "mapping", "cfg.yaml"]),                 # scalar for group
    (None, ["lora=3"], ["'lora'", "group", "lora."]),
    ("- 1\n- 2\n", [], ["top level", "mapping"]),
    ("steps: 1\nsteps: 2\n", [], ["duplicate key 'steps'", "cfg.yaml"]),
])
def test_bad_value(tmp_path, yaml_text, cli, needles):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, yaml_text, cli)
    for needle in needles:
        assert needle in str(e.value), str(e.value)


@pytest.mark.parametrize("argv, needle", [
    (["steps"], "'steps'"),
    (["=3"], "'=3'"),
    (["--xyz"], "'--xyz'"),
    (["--plan"], "'--plan'"),   # load_config accepts no flags
    (["--config"], "needs a file name"),
    (["--config", "a.yaml", "--config", "b.yaml"], "more than once"),
    (["--config", "/nonexistent/x.yaml"], "/nonexistent/x.yaml"),
])
def test_bad_arguments(argv, needle):
    with pytest.raises(ConfigError) as e:
        load_config(Config, argv)
    assert needle in str(e.value)


def test_config_equals_form_and_flags(tmp_path):
    path = yaml_file(tmp_path, "steps: 5\n")
    cfg, flags = parse_args(Config, [f"--config={path}", "--plan", "seed=3"], flags=("--plan",))
    assert (cfg.steps, cfg.seed, flags) == (5, 3, {"--plan"})
    assert parse_args(Config, ["seed=3"], flags=("--plan",))[1] == set()


def test_help_lists_keys(capsys):
    with pytest.raises(SystemExit) as e:
        load_config(Config, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "lora.rank: int [8]" in out and "optim.schedule: one of" in out


def test_post_init_sees_final_values():
    with pytest.raises(ValueError, match="steps must be"):
        load_config(Config, ["steps=-1"])


def test_required_key():
    with pytest.raises(ConfigError, match="missing required key.*name"):
        load_config(Required, [])
    assert load_config(Required, ["name=x"]) == Required(name="x")


def test_unsupported_annotation_is_a_programming_error():
    with pytest.raises(TypeError, match="unsupported|unions"):
        load_config(BadUnion, ["x=2"])


def test_argv_defaults_to_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prog", "steps=4"])
    assert load_config(Config).steps == 4


# --- saving and round trip --------------------------------------------------------------


def test_round_trip(tmp_path):
    cfg = load_config(Config, ["name=001", "optim.lr=1e-5", "optim.betas=[0.5, 0.7]",
                               "max_len=none", "weights={a: 0.25}", "lora.targets=[x]",
                               "bf16=yes", "lora.dropout=0.05"])
    path = tmp_path / "out" / "config.yaml"
    save_config(cfg, path)
    assert load_config(Config, ["--config", str(path)]) == cfg
    assert config_to_dict(cfg)["optim"]["betas"] == [0.5, 0.7]  # plain list, not tuple
    assert format_config(cfg) == path.read_text()


# --- runs, step lines, metrics ----------------------------------------------------------


def test_start_run(tmp_path, capsys, monkeypatch):
    cfg = load_config(Config, ["name=exp1", f"runs_dir={tmp_path / 'runs'}", "steps=3"])
    run = start_run(cfg)
    assert run.dir == tmp_path / "runs" / "exp1"
    assert load_config(Config, ["--config", str(run.dir / "config.yaml")]) == cfg
    rev = (run.dir / "git.txt").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{40}( dirty)?|unknown", rev), rev
    out = capsys.readouterr().out
    # the resolved config goes to the run folder, the terminal gets its path
    assert "steps: 3" not in out and str(run.dir / "config.yaml") in out
    monkeypatch.setattr(settings, "verbose", False)
    assert load_config(Config, ["steps=3", "--verbose"]).steps == 3
    assert settings.verbose  # every script takes --verbose: then the config is printed, once
    start_run(cfg)
    assert capsys.readouterr().out.count("steps: 3") == 1
    line = run.log(1, 3, {"loss": 0.5, "len": 12}, 0.25)
    assert line == "step 1/3 | loss 0.5 | len 12 | 0.2s"
    assert line in capsys.readouterr().out
    assert read_metrics(run.dir / "metrics.jsonl") == [
        {"step": 1, "loss": 0.5, "len": 12, "time_s": 0.25}]


def test_a_tracker_whose_package_is_missing_is_a_config_error_naming_the_key(tmp_path, monkeypatch):
    import importlib.util

    from factual_tools import common

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    import rl

    with pytest.raises(ConfigError, match=r"log.wandb_project needs the `wandb` package.*pip install wandb"):
        load_config(rl.Config, ["log.wandb_project=p"])  # at load time, before any model
    assert common.tracker_sinks(common.LogConfig(), tmp_path, "n", {}) == []  # nothing asked, nothing imported


@pytest.mark.parametrize("name", ["", ".", "..", "a/../..", "/abs"])
def test_start_run_rejects_bad_names(tmp_path, name):
    with pytest.raises(ConfigError):
        start_run(Config(name=name, runs_dir=str(tmp_path)))


def test_git_revision_outside_a_repo(tmp_path):
    assert git_revision(tmp_path) == "unknown"


def test_format_step_exact():
    fields = {"reward": 0.41, "pass": 0.18, "kl": 0.0021, "len": 63}
    assert format_step(42, 500, fields, 8.1) == \
        "step 42/500 | reward 0.41 | pass 0.18 | kl 2.1e-03 | len 63 | 8.1s"


@pytest.mark.parametrize("value, text", [
    (0, "0"), (0.0, "0"), (63, "63"), (np.int64(7), "7"), (0.123456, "0.123"),
    (-0.005, "-5e-03"), (0.01, "0.01"), (1.23456e-5, "1.23e-05"), (12.3456, "12.3"),
    (1234.5, "1.23e+03"), (float("nan"), "nan"), (np.float32(0.5), "0.5"),
    (True, "True"), ("abc", "abc"),
])
def test_format_step_values(value, text):
    assert format_step(1, None, {"x": value}, 0.0) == f"step 1 | x {text} | 0.0s"


def test_config_errors_exit_turns_bad_input_into_one_line():
    from factual_tools.settings import config_errors_exit

    with pytest.raises(SystemExit, match=r"^error: key 'x'"):
        with config_errors_exit():
            raise ConfigError("key 'x' is unknown")
    with pytest.raises(SystemExit, match=r"^error: docs.jsonl:3: bad line"):
        with config_errors_exit(KeyError, ValueError):
            raise ValueError("docs.jsonl:3: bad line")
    with pytest.raises(RuntimeError):  # anything else is a bug: its traceback stays
        with config_errors_exit(ValueError):
            raise RuntimeError("boom")


def test_one_jsonable_for_metrics_and_reports():
    value = {"a": math.nan, 1: [np.float32(0.5), -math.inf], "x": np.arange(2)}
    assert jsonable(value) == {"a": "nan", "1": [0.5, "-inf"], "x": [0, 1]}
    assert jsonable(value, nonfinite="null") == {"a": None, "1": [0.5, None], "x": [0, 1]}
    json.dumps(jsonable(value, nonfinite="null"), allow_nan=False)


def test_mean_skips_what_was_not_measured():
    assert mean([1, None, 2, math.nan, True]) == pytest.approx(4 / 3)
    assert math.isnan(mean([])) and math.isnan(mean([None, math.nan]))
    assert isinstance(mean(x for x in [1, 2]), float)


def test_metrics_round_trip(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    writer = MetricsWriter(path)
    writer.write(step=1, loss=0.5, kl=np.float32(0.25), name="a", hist=[1, 2])
    writer.write(step=2, loss=float("nan"), kl=float("inf"), grad=-math.inf)
    lines = path.read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # strict JSON: no bare NaN/Infinity
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    first, second = read_metrics(path)
    assert first == {"step": 1, "loss": 0.5, "kl": 0.25, "name": "a", "hist": [1, 2]}
    assert math.isnan(second["loss"]) and second["kl"] == math.inf and second["grad"] == -math.inf


def test_read_metrics_names_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "loss": \n{"step": 3}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2")):
        read_metrics(path)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2")):
        read_metrics(path)


# --- atomic writes ----------------------------------------------------------------------


def test_atomic_write_text_replaces_and_leaves_no_temp(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    atomic_write_text(path, "one")
    atomic_write_text(path, "two")
    assert path.read_text() == "two"
    assert os.listdir(path.parent) == ["f.txt"]


def test_atomic_dir_failure_leaves_nothing(tmp_path):
    final = tmp_path / "ckpt"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as d:
            (d / "weights.bin").write_bytes(b"x")
            raise RuntimeError("crash mid-save")
    assert os.listdir(tmp_path) == []


def test_atomic_dir_failure_keeps_existing(tmp_path):
    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "old.bin").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as d:
            (d / "new.bin").write_text("new")
            raise RuntimeError
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(final) == ["old.bin"]


def test_atomic_dir_replaces_existing(tmp_path):
    final = tmp_path / "ckpt"
    final.mkdir()
    (final / "old.bin").write_text("old")
    with atomic_dir(final) as d:
        assert d.parent == tmp_path and d != final
        assert not (final / "new.bin").exists()  # nothing visible before the block ends
        (d / "new.bin").write_text("new")
    assert os.listdir(tmp_path) == ["ckpt"] and os.listdir(final) == ["new.bin"]


# --- seeding and import cost ------------------------------------------------------------


def test_seed_everything_repeats():
    import random
    import torch

    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(1))

    seed_everything(123)
    first = draw()
    seed_everything(123)
    assert draw() == first
    seed_everything(124)
    assert draw() != first


def test_shared_modules_import_without_torch():
    code = ("import sys, data, newsworld, sandbox; from factual_tools import common, settings, vram, modeling; "
            "from newsworld import oracle; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


# --- the layout: scripts at the root, the library below them, the news world apart -------

SHARED = {"sandbox", "data", "rewards"}  # root modules the library shares: a fork edits them
SCRIPTS = {"synth_traces", "filter_traces", "sft", "rl", "eval", "distill", "teacher_episodes", "serve", "monitor",
           "pipeline"}
# The library's layers, lowest first: a module imports, at module level, only modules of the
# layers below it. The root's shared modules sit between library layers.
LAYERS = [
    {"factual_tools.settings", "factual_tools.textsplit", "factual_tools.world"},
    {"factual_tools.common", "sandbox", "data"},
    {"factual_tools.claims", "factual_tools.modeling"},
    {"factual_tools.fenice", "factual_tools.vram", "factual_tools.engine"},
    {"rewards", "factual_tools.scoring"},
    {"factual_tools.factcheck", "factual_tools.teachers", "factual_tools.evaluation", "factual_tools.training"},
    {"factual_tools.traces"},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, tuple[set[str], set[str]]]:
    """{module: (modules it imports at module level, those it imports inside functions)} over the
    root, factual_tools/ and newsworld/. A submodule import counts its package too (Python runs
    the package's __init__ first)."""
    import ast

    paths = [*ROOT.glob("*.py"), *ROOT.glob("factual_tools/*.py"), *ROOT.glob("newsworld/*.py")]
    ours = {module_name(p) for p in paths}

    def targets(node, importer: str) -> set[str]:
        out = set()
        if isinstance(node, ast.Import):
            out = {a.name for a in node.names if a.name in ours}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out = {m for m in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if m in ours}
        packages = {t.rpartition(".")[0] for t in out} - {importer.rpartition(".")[0], importer}
        return out | (packages & ours)

    graph = {}
    for p in paths:
        tree, me = ast.parse(p.read_text()), module_name(p)
        top = set().union(*(targets(n, me) for n in tree.body))
        inner = set().union(*(targets(n, me) for n in ast.walk(tree))) - top
        graph[me] = (top - {me}, inner - {me})
    return graph


def test_the_root_holds_the_scripts_and_the_shared_modules():
    assert {p.stem for p in ROOT.glob("*.py")} == SCRIPTS | SHARED and len(SCRIPTS | SHARED) <= 14
    library = {module_name(p) for p in ROOT.glob("factual_tools/*.py")} - {"factual_tools"}
    assert library | SHARED == set().union(*LAYERS), "a new library module needs its place in LAYERS"


def test_the_library_imports_only_the_layers_below_it():
    graph = import_graph()
    for i, layer in enumerate(LAYERS):
        below = set().union(*LAYERS[:i]) | {"factual_tools"}
        for name in layer:
            assert graph[name][0] <= below, (name, sorted(graph[name][0] - below))


def test_no_script_imports_another_script():
    for name, (top, inner) in import_graph().items():
        assert not (top | inner) & SCRIPTS, (name, sorted((top | inner) & SCRIPTS))


def test_the_news_world_is_one_folder_the_rest_imports_only_inside_functions():
    """A fork that drops the world deletes newsworld/: nothing else imports it at module level,
    and the world imports the library and the shared modules, never a script."""
    graph = import_graph()
    world = {m for m in graph if m.split(".")[0] == "newsworld"}
    for name, (top, inner) in graph.items():
        if name in world:
            assert not (top | inner) & SCRIPTS, name
        else:
            assert not top & world, (name, sorted(top & world))



def test_the_library_never_imports_the_news_world():
    """The library and the shared modules ask factual_tools.world for a world feature and import
    no world, not even inside a function: the world registers itself (newsworld/hooks.py)."""
    graph = import_graph()
    library = set().union(*LAYERS)
    world = {m for m in graph if m.split(".")[0] == "newsworld"}
    found = {name: sorted((top | inner) & world) for name, (top, inner) in graph.items()
             if name in library and (top | inner) & world}
    assert not found, found


def test_without_the_world_its_features_name_themselves_and_the_rest_runs(tmp_path, monkeypatch):
    """A fork that deleted newsworld/: a world feature fails naming what asked, a preset name that
    is not a path passes through, and documents from a file load."""
    import data
    from factual_tools import modeling, training, world

    monkeypatch.setattr(world, "BUILTIN", "no_world_here.hooks")
    monkeypatch.setattr(world, "_registered", None)
    assert world.find() is None
    with pytest.raises(SystemExit, match=r"reward\.coverage needs a document world.*no_world_here/"):
        world.world("reward.coverage")
    assert modeling.resolve_model_path("tiny-1m") == "tiny-1m"
    doc = data.Document(id="d1", text="Acme sold 3 mills. Its chief said so.", summary="Acme sold 3 mills.")
    data.write_jsonl(str(tmp_path / "docs.jsonl"), [doc])
    train, held, _ = training.load_documents(training.DocumentData(train=str(tmp_path / "docs.jsonl"), split=""))
    assert [d.id for d in train] == ["d1"] and held == []
    with pytest.raises(SystemExit, match="data.generate needs a document world"):
        training.load_documents(training.DocumentData(train=str(tmp_path / "none.jsonl"), split="", generate=4))


def test_a_registered_world_is_the_one_the_oracle_backend_asks(monkeypatch):
    import dataclasses

    import data
    import rewards
    from factual_tools import world

    builtin = world.world("this test")
    stub = dataclasses.replace(builtin, name="stub", fact_score=lambda d, s: 0.25, errors=lambda d, s: [])
    monkeypatch.setattr(world, "_registered", stub)
    doc = data.Document(id="d1", text="Acme sold 3 mills.", summary="Acme sold 3 mills.", facts=[{"x": 1}])
    cfg = rewards.RewardConfig(factuality="oracle", oracle_unit="sentence")
    assert rewards.Scorer(cfg).score_batch([(doc, "Acme sold 3 mills.")])[0]["factuality"] == 0.25

def test_there_is_no_import_cycle_even_through_imports_inside_functions():
    graph = {m: top | inner for m, (top, inner) in import_graph().items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, " -> ".join([*path, m, n])
            if n not in state:
                visit(n, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])


def test_no_private_name_is_used_from_another_file():
    import ast

    paths = [*ROOT.glob("*.py"), *ROOT.glob("factual_tools/*.py"), *ROOT.glob("newsworld/*.py"),
             *ROOT.glob("launchers/*.py"), *ROOT.glob("bench/*.py")]
    ours = set(import_graph())
    crossings = []
    for p in paths:
        tree = ast.parse(p.read_text())
        alias = {}
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                alias.update({a.asname or a.name: a.name for a in n.names if a.name in ours})
            elif isinstance(n, ast.ImportFrom) and n.module in ours | {"factual_tools", "newsworld"}:
                for a in n.names:
                    if f"{n.module}.{a.name}" in ours:
                        alias[a.asname or a.name] = f"{n.module}.{a.name}"
                    elif a.name.startswith("_") and not a.name.startswith("__"):
                        crossings.append(f"{p.name}:{n.lineno} {n.module}.{a.name}")
        crossings += [f"{p.name}:{n.lineno} {n.value.id}.{n.attr}" for n in ast.walk(tree)
                      if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in alias
                      and n.attr.startswith("_") and not n.attr.startswith("__")]
    assert not crossings, crossings


def _forwards(fn: ast.FunctionDef, local: set[str], modules: set[str]) -> bool:
    """Whether `fn`'s body (its docstring aside) is only `return f(...)` of a function of this
    project whose arguments are its own parameters, their attributes, constants, comparisons of
    those, or calls of this project's functions on them: nothing computed, only passed on."""
    body = fn.body[1:] if fn.body and isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value,
                                                                                      ast.Constant) else fn.body
    if fn.decorator_list or len(body) != 1 or not isinstance(body[0], ast.Return) \
            or not isinstance(body[0].value, ast.Call):
        return False
    params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs} - {"self", "cls"}

    def ours(f) -> bool:
        if isinstance(f, ast.Name):
            return f.id in local
        return isinstance(f, ast.Attribute) and (isinstance(f.value, ast.Name) and f.value.id in modules
                                                 or isinstance(f.value, ast.Call) and passed_on(f.value))

    def simple(a) -> bool:
        a = a.value if isinstance(a, ast.Starred) else a
        if isinstance(a, ast.Name):
            return a.id in params
        if isinstance(a, ast.Attribute):
            return simple(a.value)
        if isinstance(a, ast.Compare):
            return simple(a.left) and all(simple(c) or isinstance(c, ast.Constant) for c in a.comparators)
        return isinstance(a, ast.Constant) or isinstance(a, ast.Call) and passed_on(a)

    def passed_on(call: ast.Call) -> bool:
        return ours(call.func) and all(simple(a) for a in [*call.args, *(k.value for k in call.keywords)])

    used = {n.id for n in ast.walk(body[0].value) if isinstance(n, ast.Name)}
    return bool(params) and params <= used and passed_on(body[0].value)


def test_no_function_only_forwards_to_another():
    """A function whose whole body is `return other(its own arguments)` is a second name for one
    thing (rewards.score_batch for Scorer.score_batch, modeling.load_trained for load_policy, once):
    a reader follows one more hop for nothing. A decorator (a cache) or a computed argument is work."""
    paths = [*ROOT.glob("*.py"), *ROOT.glob("factual_tools/*.py"), *ROOT.glob("newsworld/*.py")]
    modules = {name.split(".")[-1] for name in import_graph()} | {"factual_tools", "newsworld"}
    found = []
    for p in paths:
        tree = ast.parse(p.read_text())
        aliases = {a.asname for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                   for a in n.names if a.asname and a.name.split(".")[-1] in modules}
        local = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        found += [f"{p.name}:{n.lineno} {n.name}" for n in ast.walk(tree)
                  if isinstance(n, ast.FunctionDef) and _forwards(n, local, modules | aliases)]
    assert not found, found


def test_no_function_takes_more_than_six_positional_parameters():
    """Past six, a call site reads as a row of values: the rest are keyword-only (or a dataclass)."""
    import ast

    paths = [*ROOT.glob("*.py"), *ROOT.glob("factual_tools/*.py"), *ROOT.glob("newsworld/*.py"),
             *ROOT.glob("launchers/*.py"), *ROOT.glob("bench/*.py")]
    long = [f"{p.name}:{n.lineno} {n.name}" for p in paths for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and len([a for a in n.args.posonlyargs + n.args.args if a.arg not in ("self", "cls")]) > 6]
    assert not long, long


def test_every_planted_bug_of_the_mutation_runner_still_finds_its_line():
    """tests/mutants.py plants each bug by replacing one exact text in one file: a move or an edit
    that loses the text would silently turn the mutant off, so every text must occur exactly once."""
    sys.path.insert(0, str(ROOT / "tests"))
    import mutants

    counts = {m[0]: (ROOT / m[1]).read_text().count(m[2]) if (ROOT / m[1]).exists() else -1 for m in mutants.MUTANTS}
    assert counts and all(n == 1 for n in counts.values()), {k: n for k, n in counts.items() if n != 1}


# --- every config file loads -----------------------------------------------------------

@pytest.mark.parametrize("filename, script", [
    ("sft_warmup.yaml", "sft"), ("drgrpo_v17.yaml", "rl"), ("tiny.yaml", "rl"),
    ("tiny_cpu.yaml", "rl"), ("eval_heldout.yaml", "eval"), ("notes.yaml", None),
    ("rl_smollm.yaml", "rl"), ("base_tiny.yaml", "sft"),
])
def test_script_for(filename, script):
    assert script_for(filename) == script


def test_every_config_file_loads():
    failures = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        script = script_for(path.name)
        if script is None:
            failures.append(f"{path.name}: no script for this name; add its prefix to "
                            f"SCRIPT_FOR_PREFIX in tests/helpers.py")
            continue
        try:
            module = importlib.import_module(script)
        except ModuleNotFoundError as e:
            if e.name != script:
                raise
            failures.append(f"{path.name}: its script {script}.py does not exist")
            continue
        try:
            load_config(module.Config, ["--config", str(path)])
        except ConfigError as e:
            failures.append(f"{path.name}: {e}")
    assert not failures, "\n".join(failures)


def _leaves(data: dict, prefix: str = ""):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _resolved(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = cfg.get(part, "(unset)") if isinstance(cfg, dict) else getattr(cfg, part)
    return cfg


def test_a_config_that_extends_another_sets_only_what_differs():
    """A delta config (`extends:`) that repeats its base's value hides what the variant changes:
    the drgrpo_v17 -> v18 -> v19 recipe reads as three short files, each setting what it changes."""
    import yaml

    repeated, deltas = [], set()
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict) or "extends" not in data:
            continue
        deltas.add(path.name)
        module = importlib.import_module(script_for(path.name))
        base = load_config(module.Config, ["--config", str(path.parent / data["extends"])])
        mine = load_config(module.Config, ["--config", str(path)])
        repeated += [f"{path.name}: {key}={_resolved(mine, key)!r} is its base's value"
                     for key, _ in _leaves({k: v for k, v in data.items() if k != "extends"})
                     if _resolved(base, key) == _resolved(mine, key)]
    assert {"drgrpo_v18.yaml", "drgrpo_v19.yaml"} <= deltas
    assert not repeated, "\n".join(repeated)


def test_unsloth_configs_score_branch_by_branch():
    """Unsloth's fused attention takes no 4D masks: tree (and group-tree) scoring cannot run
    there, so a config that asks for it fails at load time, naming the key; the shipped GPU
    configs score by branch."""
    from factual_tools import settings
    import rl
    import sft

    assert settings.load_config(sft.Config, ["--config", "configs/sft_qwen3_4b.yaml"]).score_method == "branch"
    for v in (17, 18, 19):
        assert settings.load_config(rl.Config, ["--config", f"configs/drgrpo_v{v}.yaml"]).score_method == "branch"
    with pytest.raises(settings.ConfigError, match="score_method=branch"):
        settings.load_config(sft.Config, ["--config", "configs/sft_qwen3_4b.yaml", "score_method=tree"])
    with pytest.raises(settings.ConfigError, match="score_method=branch"):
        settings.load_config(rl.Config, ["--config", "configs/drgrpo_v19.yaml", "score_method=group"])
    assert settings.load_config(sft.Config, ["--config", "configs/sft_tiny.yaml"]).score_method == "tree"


def test_the_public_entry_points_named_in_the_design_note_exist():
    """DESIGN.md's "Public entry points" section promises names that tests, benches
    and forks call; one that moved without an alias (sandbox.split_sentences once did)
    breaks them silently."""
    text = (ROOT / "DESIGN.md").read_text()
    section = text[text.index("## 10. Public entry points"):]
    section = section[:section.index("\n## ", 1)] if "\n## " in section[1:] else section
    names = sorted(set(re.findall(r"`([a-z_]+)\.([A-Za-z_]+)", section)))
    modules = {"sandbox", "rewards"}
    checked = [(m, n) for m, n in names if m in modules]
    assert len(checked) >= 6, checked  # the section names at least these; a parse that finds none is a bug
    missing = [f"{m}.{n}" for m, n in checked if not hasattr(importlib.import_module(m), n)]
    assert not missing, f"DESIGN.md names public entry points that do not exist: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ["bench/sft.py", "--batch", "2", "--reps", "1"],
    ["bench/rl_step.py", "--steps", "1", "--reps", "1"],
    ["bench/rollout.py", "--presets", "tiny-1m", "--reps", "1", "--new-tokens", "128"],
    ["bench/rollout.py", "--presets", "tiny-1m", "--reps", "1", "--new-tokens", "32"],  # too short to delete
    ["bench/sandbox.py", "--calls", "50"],
    ["bench/rewards.py", "--docs", "5"],
    ["bench/tree_attention.py", "--model", "tiny-1m", "--prompt", "32", "--group", "4", "--rollout", "60",
     "--reps", "1"],
    ["bench/tree_attention.py", "--model", "tiny-1m", "--prompt", "32", "--group", "1", "--rollout", "300",
     "--reps", "1"],  # an SFT episode's shape: prefix chunks
    ["bench/prefill.py", "--model", "tiny-1m", "--docs", "8", "--reps", "1"],
])
def test_every_bench_runs_at_its_smallest_size_and_ends_with_a_json_line(argv):
    """A bench is a script nobody runs in the suite otherwise: a renamed import breaks it silently."""
    out = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    assert isinstance(json.loads(out.stdout.strip().splitlines()[-1]), dict)
