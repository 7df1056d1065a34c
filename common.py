"""Shared plumbing for every script: atomic writes, strict configs, runs, logging, seeding, models.

Sections: atomic writes; config loading; runs, step lines and metrics; seeding;
devices; the tiny policies (news-world tokenizer, Llama presets); policy loading
(HF + PEFT, bitsandbytes, Unsloth/vLLM); the GPU memory planner; the command line:

    python common.py tiny-model --preset tiny-1m --out DIR [--seed S]
    python common.py plan model=Llama-3.1-8B quant=4bit group_size=8 [key=value ...]

Why the config loader is hand-written rather than TrlParser, OmegaConf or Hydra:
TrlParser/HfArgumentParser are flat (no nested groups set as `lora.rank=16`);
OmegaConf merges silently add a typo'd key unless struct mode is on, never say
"did you mean", and add a dependency (Hydra more so). The section below (under
300 lines) does exactly what DESIGN section 7 asks: defaults < `--config FILE.yaml` <
`key.sub=value`, and every unknown key or wrong type is an error naming the key,
where it came from and the nearest valid key. A config file may start from another
(`extends: tiny.yaml`) and set only what differs.

torch, transformers and peft are imported only inside the functions that use
them, so importing the config loader stays fast (tests, `--help`, the memory
planner); bitsandbytes, Unsloth and vLLM only when a config asks for them.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import hashlib
import json
import math
import numbers
import os
import random
import shutil
import subprocess
import sys
import types
import typing
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
import yaml

# ---------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------
# A crash (or a full disk, or a kill) mid-write must leave either the old file
# or the new one, never half of one: checkpoints and configs are read back by
# `resume=auto`. Temp names start with "." and end with ".tmp" so a listing of
# checkpoints never mistakes them for complete ones.


def _temp_name(final: Path, suffix: str = ".tmp") -> Path:
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}{suffix}")


def _fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    if hasattr(os, "O_DIRECTORY"):
        _fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to a temp file in the same directory, fsync, then os.replace."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(final)
    # os.open with 0o666 honours the umask (mkstemp would force 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


@contextmanager
def atomic_dir(final_path: str | os.PathLike):
    """Yield a temp directory next to `final_path`; move it into place only on success.

    On an exception the temp directory is deleted and `final_path` is untouched.
    An existing `final_path` is renamed away, the new one renamed in, and only
    then the old one deleted, so a crash leaves a complete directory under
    either `final_path` or `.NAME.xxxx.old`, never a partial one under `final_path`.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(final)
    os.mkdir(tmp)
    try:
        yield tmp
        for p in tmp.rglob("*"):  # the contents must be on disk before the rename is
            if p.is_file():
                _fsync_path(p)
        old = None
        if final.exists():
            old = _temp_name(final, ".old")
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            if old is not None:
                os.replace(old, final)
            raise
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------
# Config loading
# ---------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config file or command-line override that does not fit the script's Config."""


_TRUE = {"true", "yes", "1", "on"}
_FALSE = {"false", "no", "0", "off"}
_NONE = {"none", "null", "~"}


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (PyYAML silently keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    # get_type_hints resolves string annotations (`from __future__ import annotations`).
    return typing.get_type_hints(cls)


def _fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _is_group(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _all_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in _fields(cls):
        tp = _hints(cls)[f.name]
        keys.append(prefix + f.name)
        if _is_group(tp):
            keys += _all_keys(tp, prefix + f.name + ".")
    return keys


def _unknown(root: type, key: str, source: str) -> ConfigError:
    valid = _all_keys(root)
    last = key.rsplit(".", 1)[-1]
    # The same leaf in another group (`lr` -> `optim.lr`) first, then spelling neighbours.
    near = [k for k in valid if k.rsplit(".", 1)[-1] == last]
    near += [k for k in difflib.get_close_matches(key, valid, n=3, cutoff=0.6) if k not in near]
    hint = ("; did you mean " + " or ".join(repr(k) for k in near)) if near else ""
    return ConfigError(f"unknown key {key!r} (from {source}){hint}")


def _origin(tp: Any) -> Any:
    origin = typing.get_origin(tp)
    return Union if origin is types.UnionType else origin


def _type_name(tp: Any) -> str:
    if _origin(tp) is Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    return tp.__name__ if type(tp) is type else str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check (and where lossless, convert) a YAML-typed value against annotation `tp`."""
    def fail(extra: str = "") -> ConfigError:
        return ConfigError(f"key {key!r} (from {source}): expected {_type_name(tp)}, "
                           f"got {value!r} ({type(value).__name__}){extra}")

    origin, args = _origin(tp), typing.get_args(tp)
    if origin is Union:
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1:
            raise TypeError(f"config key {key!r}: only `X | None` unions are supported, not {tp}")
        return None if value is None else _coerce(value, inner[0], key, source)
    if origin is Literal:  # the type check keeps True from passing for the choice 1
        if any(value == c and type(value) is type(c) for c in args):
            return value
        raise fail()
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise fail()
    if tp in (int, float):
        # bool is an int subclass but never a number here; an int is a fine float,
        # a float is not a fine int; numeric strings pass (PyYAML reads 1e-4 as str).
        numeric = (int,) if tp is int else (int, float)
        if isinstance(value, numeric) and not isinstance(value, bool):
            return tp(value)
        if isinstance(value, str):
            try:
                return tp(value)
            except ValueError:
                pass
        raise fail()
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail("; quote it in YAML if it is meant as text")
    if origin is list or (origin is tuple and args[1:] == (Ellipsis,)):
        if not isinstance(value, (list, tuple)):
            raise fail()
        return origin(_coerce(v, args[0], f"{key}[{i}]", source) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise fail()
        return {_coerce(k, args[0], f"{key} (a key)", source):
                _coerce(v, args[1], f"{key}[{k!r}]", source) for k, v in value.items()}
    raise TypeError(f"config key {key!r}: unsupported annotation {tp}")


def _coerce_cli(raw: str, tp: Any, key: str) -> Any:
    """Turn the raw text of `key=raw` into a value, guided by the field's type."""
    if _origin(tp) is Union and type(None) in typing.get_args(tp):
        if raw.strip().lower() in _NONE:
            return None
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    if tp is str:
        return raw  # `name=001` stays "001"
    if tp in (int, float, bool):
        return _coerce(raw, tp, key, "command line")
    if _origin(tp) is Literal:
        for choice in typing.get_args(tp):
            if raw == str(choice):
                return choice
        return _coerce(raw, tp, key, "command line")  # raises, listing the choices
    try:
        value = yaml.safe_load(raw)  # lists and dicts: `tags=[a, b]`, `w={x: 1}`
    except yaml.YAMLError as e:
        raise ConfigError(f"key {key!r} (from command line): cannot parse {raw!r}: {e}") from None
    return _coerce(value, tp, key, "command line")


def _flatten_yaml(cls: type, mapping: Any, prefix: str, source: str,
                  out: dict, root: type) -> None:
    """Check a YAML mapping against `cls` and store its leaves as {dotted key: value}."""
    if not isinstance(mapping, dict):
        where = f"group {prefix[:-1]!r}" if prefix else "the top level"
        raise ConfigError(f"{where} (from {source}) must be a mapping, got {mapping!r}")
    hints = _hints(cls)
    names = {f.name for f in _fields(cls)}
    for name, value in mapping.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise _unknown(root, key, source)
        if _is_group(hints[name]):
            _flatten_yaml(hints[name], value, key + ".", source, out, root)
        else:  # a mapping for a scalar key fails in _coerce, naming the expected type
            out[key] = _coerce(value, hints[name], key, source)


def _set_cli(root: type, key: str, raw: str, out: dict) -> None:
    tp, names = root, key.split(".")
    for i, name in enumerate(names):
        fields = {f.name: f for f in _fields(tp)} if _is_group(tp) else {}
        if name not in fields:
            raise _unknown(root, key, "command line")
        field, tp = fields[name], _hints(tp)[name]
        if _origin(tp) is dict and i == len(names) - 2:
            # `limits.top_k=1` sets one entry of a dict-valued key, keeping the others
            # (from the config file, else the field's default).
            dict_key = ".".join(names[:-1])
            current = out[dict_key] if dict_key in out else (_default(field) if _has_default(field) else {}) or {}
            k_tp, v_tp = typing.get_args(tp)
            entry = _coerce(names[-1], k_tp, f"{dict_key} (a key)", "command line")
            out[dict_key] = {**current, entry: _coerce_cli(raw, v_tp, key)}
            return
    if _is_group(tp):
        raise ConfigError(f"key {key!r} (from command line) is a group; set its keys "
                          f"one by one, e.g. {_all_keys(tp, key + '.')[0]}=...")
    out[key] = _coerce_cli(raw, tp, key)


def _has_default(f: dataclasses.Field) -> bool:
    return f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING


def _default(f: dataclasses.Field) -> Any:
    return f.default if f.default_factory is dataclasses.MISSING else f.default_factory()


def _build(cls: type, flat: dict, prefix: str = "", base: Any = None) -> Any:
    """Construct `cls` from its defaults (or `base`) plus the overridden leaves in `flat`.

    Built through __init__ (not setattr) so a Config's __post_init__ sees the final
    values, and a group's default_factory (e.g. a non-default rank) is kept.
    """
    kwargs = {}
    for f in _fields(cls):
        key, tp = prefix + f.name, _hints(cls)[f.name]
        if key in flat:
            kwargs[f.name] = flat[key]
        elif _is_group(tp) and any(k.startswith(key + ".") for k in flat):
            kwargs[f.name] = _build(tp, flat, key + ".", _default(f) if _has_default(f) else None)
    if base is not None:
        return dataclasses.replace(base, **kwargs)
    missing = [prefix + f.name for f in _fields(cls)
               if f.name not in kwargs and not _has_default(f)]
    if missing:
        raise ConfigError(f"missing required key(s): {', '.join(missing)}")
    return cls(**kwargs)


def _usage(cls: type, flags: tuple[str, ...], prefix: str = "", base: Any = None) -> str:
    """Every key with its type and effective default (a group's default_factory included)."""
    lines = [] if prefix else [f"usage: {Path(sys.argv[0]).name} [--config FILE.yaml] "
                               f"[key.sub=value ...] {' '.join(flags)}", "keys [default]:"]
    for f in _fields(cls):
        tp = _hints(cls)[f.name]
        has = base is not None or _has_default(f)
        value = getattr(base, f.name) if base is not None else _default(f) if has else None
        if _is_group(tp):
            lines.append(_usage(tp, flags, prefix + f.name + ".", value))
        else:
            shown = repr(value) if has else "required"
            lines.append(f"  {prefix}{f.name}: {_type_name(tp)} [{shown}]")
    return "\n".join(lines)


def _read_config_file(cls: type, path: str, flat: dict, chain: tuple[str, ...]) -> None:
    """Flatten one YAML file into `flat`, after the file its `extends:` names (if any).

    `extends: base.yaml` (a path beside the file) makes the file a delta: the base's
    keys first, then this file's on top, leaf by leaf. A dict-valued key (`limits`,
    `reward.rules.weights`) is merged entry by entry, as `limits.top_k=1` on the
    command line is: the file's entries replace the base's, the others stay.
    """
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_StrictLoader)
    except OSError as e:
        via = f" (extended by {chain[-1]})" if chain else ""
        raise ConfigError(f"cannot read config file {path}{via}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    data = {} if data is None else data
    if isinstance(data, dict) and "extends" in data:
        data = dict(data)
        base = data.pop("extends")
        if not isinstance(base, str) or not base:
            raise ConfigError(f"key 'extends' (from {path}) must be a config file name, got {base!r}")
        base_path = os.path.normpath(Path(path).parent / base)
        seen = [os.path.realpath(p) for p in (*chain, path)]
        if os.path.realpath(base_path) in seen:
            raise ConfigError(f"config files extend each other in a cycle: "
                              f"{' -> '.join((*chain, path, base_path))}")
        _read_config_file(cls, base_path, flat, (*chain, path))
    own: dict[str, Any] = {}
    _flatten_yaml(cls, data, "", path, own, cls)
    for key, value in own.items():
        old = flat.get(key)
        flat[key] = {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value


def parse_args(cls: type, argv: list[str] | None = None,
               flags: tuple[str, ...] = ()) -> tuple[Any, set[str]]:
    """Parse `[--config FILE] [key.sub=value ...] [FLAG ...]` into (cfg, flags present).

    `flags` are bare switches the script handles itself (e.g. `rl.py --plan`); any
    other `-x`/`--xyz` is an error. `-h`/`--help` prints every key and exits.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    args = iter(sys.argv[1:] if argv is None else argv)
    config_file, overrides, present = None, [], set()
    for arg in args:
        if arg in ("-h", "--help"):
            print(_usage(cls, flags))
            raise SystemExit(0)
        if arg == "--config" or arg.startswith("--config="):
            if config_file is not None:
                raise ConfigError("--config given more than once")
            config_file = arg[len("--config="):] if "=" in arg else next(args, None)
            if not config_file:
                raise ConfigError("--config needs a file name")
        elif arg in flags:
            present.add(arg)
        elif arg.startswith("-"):
            known = ", ".join(("--config", *flags))
            raise ConfigError(f"unknown flag {arg!r}; this script accepts {known} and key=value")
        elif "=" not in arg or arg.startswith("="):
            raise ConfigError(f"argument {arg!r} is not of the form key.sub=value")
        else:
            overrides.append(arg.split("=", 1))

    flat: dict[str, Any] = {}
    if config_file is not None:
        _read_config_file(cls, config_file, flat, ())
    for key, raw in overrides:
        _set_cli(cls, key, raw, flat)
    return _build(cls, flat), present


@contextmanager
def config_errors_exit():
    """For a script's `__main__`: a ConfigError inside the block exits with one
    line, `error: ...`, instead of a traceback.

        with common.config_errors_exit():
            cfg = common.load_config(Config)
    """
    try:
        yield
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None


def load_config(cls: type, argv: list[str] | None = None) -> Any:
    """defaults < `--config FILE.yaml` < `key.sub=value`; argv defaults to sys.argv[1:]."""
    return parse_args(cls, argv)[0]


def config_to_dict(cfg: Any) -> dict:
    """Nested plain dict; tuples become lists so the YAML stays safe_load-able."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(cfg))


def format_config(cfg: Any) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, allow_unicode=True)


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    atomic_write_text(path, format_config(cfg))


# ---------------------------------------------------------------------------
# Runs, step lines and metrics
# ---------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return str(v)
    if isinstance(v, numbers.Integral):
        return str(int(v))
    v = float(v)
    if v != 0 and abs(v) < 1e-2:  # 3 significant digits, trailing zeros dropped: 2.1e-03
        mantissa, exp = f"{v:.2e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{exp}"
    return f"{v:.3g}"


def format_step(step: int, total: int | None, fields: dict[str, Any], seconds: float) -> str:
    """`step 42/500 | reward 0.41 | kl 2.1e-03 | len 63 | 8.1s`, fields in dict order."""
    head = f"step {step}/{total}" if total is not None else f"step {step}"
    return " | ".join([head, *(f"{k} {_fmt(v)}" for k, v in fields.items()), f"{seconds:.1f}s"])


def jsonable(v: Any, nonfinite: Literal["string", "null"] = "string") -> Any:
    """`v` as strict JSON values: numpy scalars and arrays become Python ones, keys strings.

    Strict JSON has no NaN or +-inf. In metrics lines (`nonfinite="string"`) they become
    "nan", "inf", "-inf", which read_metrics turns back: null would hide a diverged loss.
    Reports (eval.json, distill.json) use `nonfinite="null"`: a figure that could not be
    measured (no searches, so no search rate) is missing, as every JSON reader expects.
    """
    if isinstance(v, np.ndarray):
        v = v.tolist()
    elif isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v) if nonfinite == "string" else None
    if isinstance(v, dict):
        return {str(k): jsonable(x, nonfinite) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x, nonfinite) for x in v]
    return v


def mean(xs) -> float:
    """The mean of what was measured: None and NaN entries are skipped; NaN if none is left."""
    xs = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else math.nan


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class MetricsWriter:
    """Append one JSON object per `write` call to a JSONL file, flushed per line.

    The file is opened per call: a crash loses at most the line being written,
    and there is no handle to close.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, **fields: Any) -> None:
        line = json.dumps(jsonable({"step": step, **fields}), allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read a metrics JSONL back; a malformed line raises ValueError naming file and line.

    Top-level "nan"/"inf"/"-inf" strings (how MetricsWriter stores them) become floats.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed metrics line: {e}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: metrics line is not a JSON object")
            records.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v
                            for k, v in record.items()})
    return records


def git_revision(cwd: str | os.PathLike | None = None) -> str:
    """`<sha>`, `<sha> dirty`, or `unknown` (no git, not a repo); never raises."""
    cwd = cwd or Path(__file__).resolve().parent  # the code's revision, not the cwd's
    def run(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        sha = run("rev-parse", "HEAD")
        return f"{sha} dirty" if run("status", "--porcelain") else sha
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclasses.dataclass
class Run:
    dir: Path
    metrics: MetricsWriter

    def log(self, step: int, total: int | None, fields: dict[str, Any], seconds: float) -> str:
        """Print the step line and append the same fields (plus `time_s`) to metrics.jsonl."""
        line = format_step(step, total, fields, seconds)
        print(line, flush=True)
        self.metrics.write(step=step, **fields, time_s=seconds)
        return line


def start_run(cfg: Any) -> Run:
    """Create `{runs_dir}/{name}/` with config.yaml and git.txt; print the config once.

    An existing run directory is reused (a resumed run appends to metrics.jsonl).
    """
    name = str(getattr(cfg, "name", ""))
    if not Path(name).parts or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ConfigError(f"config key 'name' must be a relative run name, got {name!r}")
    run_dir = Path(getattr(cfg, "runs_dir", "runs")) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    atomic_write_text(run_dir / "git.txt", git_revision() + "\n")
    print(f"run {run_dir}\n{format_config(cfg)}", end="", flush=True)
    return Run(dir=run_dir, metrics=MetricsWriter(run_dir / "metrics.jsonl"))


# ---------------------------------------------------------------------------
# Seeding
# ---------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed random, numpy and torch (CPU and every CUDA device)."""
    import torch  # here, not at the top: the config loader must import without torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# ---------------------------------------------------------------------------
# Checkpoints (DESIGN 7)
# ---------------------------------------------------------------------------
# A checkpoint is a directory `RUN/checkpoints/step_00000042/` written through
# atomic_dir, so it exists whole or not at all (a SIGKILL mid-save leaves only a
# dot-named temp directory, never picked up). It holds:
#   model/                  save_pretrained output (a PEFT adapter, or the full
#                           model when training from scratch): what eval loads
#   trainable.safetensors   every parameter with requires_grad, by name: what
#                           resume loads (uniform for adapters and full models)
#   trainer.pt              optimizer, scheduler, RNG states, and the script's
#                           own state (data cursor, curriculum, step)

CHECKPOINT_PREFIX = "step_"


def rng_state(generators: dict | None = None) -> dict:
    """Every RNG a run draws from: python, numpy, torch (CPU, CUDA), and named
    torch.Generator objects of the script (e.g. the rollout sampler)."""
    import torch

    st = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
          "generators": {k: g.get_state() for k, g in (generators or {}).items()}}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict, generators: dict | None = None) -> None:
    import torch

    random.setstate(st["python"])
    np.random.set_state(st["numpy"])
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    for k, g in (generators or {}).items():
        g.set_state(st["generators"][k])


def save_checkpoint(run_dir: str | os.PathLike, step: int, model, optimizer=None, scheduler=None,
                    state: dict | None = None, generators: dict | None = None, keep: int = 2) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` ones."""
    import torch
    from safetensors.torch import save_file

    final = Path(run_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"
    with atomic_dir(final) as tmp:
        save_pretrained(model, tmp / "model")
        trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
        save_file(trainable, str(tmp / "trainable.safetensors"))
        torch.save({"step": step, "optimizer": optimizer.state_dict() if optimizer else None,
                    "scheduler": scheduler.state_dict() if scheduler else None,
                    "rng": rng_state(generators), "state": state or {}}, tmp / "trainer.pt")
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp directories are skipped)."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and (p / "trainer.pt").exists()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """`resume`: "auto" (the newest complete checkpoint of this run, if any),
    "none", or a checkpoint path."""
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "trainer.pt").exists():
        raise FileNotFoundError(f"resume={resume}: not a complete checkpoint (no trainer.pt in it)")
    return path


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, scheduler=None,
                    generators: dict | None = None) -> dict:
    """Restore a checkpoint into live objects; returns {"step", "state"}."""
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    saved = load_file(str(path / "trainable.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in saved]
    unknown = [n for n in saved if n not in params]
    if missing or unknown:
        raise ValueError(f"{path}: checkpoint does not fit the model (missing {missing[:3]}, unexpected {unknown[:3]})")
    with torch.no_grad():
        for n, t in saved.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))
    trainer = torch.load(path / "trainer.pt", map_location="cpu", weights_only=False)
    if optimizer is not None and trainer["optimizer"] is not None:
        optimizer.load_state_dict(trainer["optimizer"])
    if scheduler is not None and trainer["scheduler"] is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    set_rng_state(trainer["rng"], generators)
    return {"step": trainer["step"], "state": trainer["state"]}


def trim_jsonl(path: str | os.PathLike, step: int) -> int:
    """Drop the lines of a resumed run's log past `step` (all of them when starting
    over at 0), and a torn last line; returns how many were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            s = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            dropped += 1
            continue
        if step > 0 and s <= step:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(x + "\n" for x in keep))
    return dropped


def resume(run_dir: str | os.PathLike, how: str, model, optimizer=None, scheduler=None,
           generators: dict | None = None, logs: tuple[str, ...] = ("metrics.jsonl",)) -> tuple[int, dict]:
    """Every trainer's resume path: (step, the script's saved state), (0, {}) for a fresh start.

    `how` is the config's `resume` (auto: the newest complete checkpoint). The run's
    JSONL logs then lose the lines written after that checkpoint (a run killed between
    two checkpoints logged steps the resumed run logs again), or all of them when the
    run starts over at step 0.
    """
    ckpt, step, state = resolve_resume(how, run_dir), 0, {}
    if ckpt is not None:
        got = load_checkpoint(ckpt, model, optimizer, scheduler, generators=generators)
        step, state = got["step"], got["state"]
        print(f"resumed from {ckpt} at step {step}")
    for name in logs:
        if trim_jsonl(Path(run_dir) / name, step):
            print(f"{name}: lines past step {step} dropped (written after the checkpoint resumed from)")
    return step, state


def cosine_schedule(optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warm-up then cosine decay to `min_ratio` of the peak rate."""
    import torch

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------
# Devices and parameter counts
# ---------------------------------------------------------------------------


def device() -> str:
    """"cuda" when a CUDA device is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def count_parameters(model, trainable: bool = False) -> int:
    """Parameters of `model` (only those that require grad if `trainable`).

    bitsandbytes packs two 4-bit weights into a byte; they count at their unpacked size.
    """
    n = 0
    for p in model.parameters():
        if trainable and not p.requires_grad:
            continue
        quant_state = getattr(p, "quant_state", None)
        n += quant_state.shape.numel() if quant_state is not None else p.numel()
    return n


# ---------------------------------------------------------------------------
# The tiny policies: a news-world tokenizer and Llama-style models from presets
# ---------------------------------------------------------------------------
# No machine here reaches a model hub (DESIGN section 6), so the CPU default is
# a tokenizer trained on the built-in news world and a Llama model initialised
# from a preset, both written with save_pretrained: every script then loads them
# through the same from_pretrained path as a hub model.
#
# The tokenizer is byte-level BPE without a prefix space, so decoding token by
# token concatenates to the full decode (sandbox.token_bounds relies on it).
# Tool markup stays ordinary BPE text, as in real vocabularies; the corpus
# contains enough of it that `<search>` and `</search>` are a few tokens each.
# Only the chat markers are special tokens. `<|eot|>` ends a turn and is the
# eos token; padding is on the left, for batched generation.

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>")

# Each turn is `<|role|>content<|eot|>`; the generation prompt is `<|assistant|>`, so
# a completion is the assistant's text followed by `<|eot|>`. A system message is
# rendered as its marker alone: a tiny model is trained from scratch on the protocol
# and reads no instructions, and the tool description (87 of its tokens) was 40% of
# every news-world prompt, so of every training sequence and every prefill.
# Real chat models keep their own template and read the whole system prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'system' %}<|system|><|eot|>"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|eot|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TOKENIZER_VOCAB = 3000     # DESIGN section 6 measured its tiny models with a 3k BPE
TOKENIZER_DOCS = 2000      # news-world documents the tokenizer is trained on
TOKENIZER_SEED = 1         # fixed: every preset and model seed shares one vocabulary
TINY_MAX_POSITIONS = 4096
TINY_MARKER = "tiny_model.json"
TINY_FORMAT = 2            # bump when the build changes, so old directories are rebuilt

# Llama shapes. tiny-1m is the CPU default (DESIGN section 6: the smallest preset
# is the one that learns within minutes on two cores); the larger ones use
# grouped-query attention as real Llama/Qwen models do, to exercise that path.
TINY_PRESETS: dict[str, dict[str, int]] = {
    "tiny-1m": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, intermediate_size=512),
    # a distillation student of tiny-1m (distill.py): half its width, the same depth
    "tiny-0.3m": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=256),
    "tiny-8m": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=1024),
    "tiny-30m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=1792),
}


def _tokenizer_texts(n_docs: int, seed: int) -> list[str]:
    """News-world articles, their reference summaries, the chat prompt and tool markup.

    The markup strings are built from the documents the way traces use them: a
    summary sentence, a search (a regex on one of its phrases, or keywords), the
    results block, a delete and the rewrite.
    """
    import re

    import newsworld
    from sandbox import error_block, prompt_messages, results_block, split_sentences

    rng = random.Random(seed)
    texts = [m["content"] for m in prompt_messages("")]
    for doc in newsworld.documents(n_docs, seed):
        texts += [prompt_messages(doc.text)[1]["content"], doc.summary]
        sentences = split_sentences(doc.text) or [doc.text]
        claims = split_sentences(doc.summary) or [doc.summary]
        claim = rng.choice(claims)
        words = claim.rstrip(".").split()
        start = rng.randrange(max(1, len(words) - 2))
        phrase = " ".join(words[start:start + rng.randint(2, 4)])
        if rng.random() < 0.5:
            query = "/" + re.escape(phrase) + "/" + rng.choice(["", "i"])
        else:
            query = " ".join(rng.sample(words, min(3, len(words))))
        hits = rng.sample(sentences, min(len(sentences), rng.randint(0, 3)))
        answer = results_block(hits) if rng.random() < 0.9 else error_block("no match")
        scope = rng.choice(["sentence", "clause"])
        texts.append(f"{claim}<search>{query}</search>{answer}<delete scope=\"{scope}\"/> {claim}")
    return texts


@functools.cache
def _tokenizer_json(vocab_size: int, n_docs: int, seed: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tokenizer_texts(n_docs, seed), trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB, n_docs: int = TOKENIZER_DOCS, seed: int = TOKENIZER_SEED):
    """The news-world BPE as a transformers fast tokenizer (trained once per process)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size, n_docs, seed)),
        bos_token="<|bos|>", eos_token="<|eot|>", pad_token="<|pad|>",
        extra_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        padding_side="left", clean_up_tokenization_spaces=False,
        model_max_length=TINY_MAX_POSITIONS, chat_template=CHAT_TEMPLATE)


def _tiny_spec(preset: str, seed: int) -> dict:
    """Everything a build depends on; a directory built from another spec is rebuilt."""
    import newsworld

    if preset not in TINY_PRESETS:
        raise ConfigError(f"unknown tiny preset {preset!r}; choose one of {', '.join(TINY_PRESETS)}")
    return {"format": TINY_FORMAT, "preset": preset, "seed": seed, "shape": TINY_PRESETS[preset],
            "tokenizer": {"vocab_size": TOKENIZER_VOCAB, "n_docs": TOKENIZER_DOCS, "seed": TOKENIZER_SEED,
                          "world": newsworld.WORLD_VERSION}}


def build_tiny_model(preset: str, out_dir: str | os.PathLike, seed: int = 0, tokenizer=None) -> Path:
    """Write a freshly initialised tiny Llama and its tokenizer to `out_dir`; return the path.

    Same preset and seed give the same weights. `tokenizer` (default: the tiny
    tokenizer trained on the news world) sets the vocabulary, e.g. a distillation
    student's over its teacher's. A directory already built with the same preset,
    seed, tokenizer and build format is reused as it is (its `tiny_model.json`
    says so). The build happens in a temp directory moved into place at the end,
    so an interrupted build never leaves a half-written model.
    """
    spec = _tiny_spec(preset, seed)
    if tokenizer is not None:
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
        spec["tokenizer"] = {"vocab_sha256": hashlib.sha256(vocab.encode("utf-8")).hexdigest()}
    out = Path(out_dir)
    marker = out / TINY_MARKER
    if marker.is_file():
        if json.loads(marker.read_text(encoding="utf-8")).get("spec") == spec:
            return out
    elif out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and holds no {TINY_MARKER}; refusing to replace it")

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=TINY_MAX_POSITIONS, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        attn_implementation="sdpa", **TINY_PRESETS[preset])
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        atomic_write_text(Path(tmp) / TINY_MARKER, json.dumps(
            {"spec": spec, "n_params": count_parameters(model), "vocab_size": len(tok)}, indent=2) + "\n")
    return out


TINY_MODELS_DIR = Path("out") / "models"


def resolve_model_path(name_or_path: str) -> str:
    """A tiny preset name (`tiny-1m`) that is not an existing path is built into
    `out/models/NAME` on first use; anything else (hub id, directory) passes through."""
    if name_or_path in TINY_PRESETS and not Path(name_or_path).exists():
        return str(build_tiny_model(name_or_path, TINY_MODELS_DIR / name_or_path))
    return name_or_path


# ---------------------------------------------------------------------------
# Policy loading: HF + PEFT (reference path), bitsandbytes, Unsloth (+ vLLM)
# ---------------------------------------------------------------------------
# The reference path (torch, transformers, peft) runs everywhere; bitsandbytes,
# Unsloth and vLLM are imported only in the branch that asks for them
# (DESIGN section 8), and a missing one raises an ImportError that says how to
# install it. The reference policy of RL is the same model with its adapter
# disabled (`reference_model`), so it costs no second copy of the weights.

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPU_INSTALL_HINT = "pip install -r requirements-gpu.txt"


@dataclasses.dataclass
class LoraConfig:
    enabled: bool = True     # False: full fine-tune (quant must be none; reference needs frozen_copy)
    rank: int = 16
    alpha: int = 32          # the update is scaled by alpha / rank
    dropout: float = 0.0
    # module names; ["all-linear"] means every linear layer but the output head
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))


@dataclasses.dataclass
class ModelConfig:
    # HF hub id, local directory, or a tiny preset name (built into out/models/ on first use)
    name_or_path: str = "tiny-1m"
    adapter_path: str | None = None      # a saved PEFT adapter to load on top (resume, eval)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    quant: Literal["none", "4bit", "8bit"] = "none"  # bitsandbytes; 4bit is NF4 with double quantisation
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False
    backend: Literal["hf", "unsloth"] = "hf"
    fast_inference: bool = False         # Unsloth's colocated vLLM engine (backend=unsloth only)
    max_seq_len: int = 2048              # prompt + completion; Unsloth/vLLM size their buffers by it
    # the tree-mask scoring path (DESIGN section 4) needs sdpa or eager, not flash attention
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    gpu_memory_utilization: float = 0.5  # share of the GPU vLLM reserves (fast_inference)

    def __post_init__(self):
        if self.fast_inference and self.backend != "unsloth":
            raise ConfigError("model.fast_inference needs model.backend='unsloth' (vLLM runs inside Unsloth)")
        if self.quant != "none" and not self.lora.enabled:
            raise ConfigError(f"model.quant={self.quant!r} trains through LoRA only; "
                              "set model.lora.enabled=true or model.quant=none")
        if not 0.0 < self.gpu_memory_utilization < 1.0:
            raise ConfigError(f"model.gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")
        if self.lora.enabled and self.lora.rank < 1:
            raise ConfigError(f"model.lora.rank must be >= 1, got {self.lora.rank}")


def resolve_dtype(name: str, device_name: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device_name.startswith("cuda") else torch.float32
    return getattr(torch, name)


def load_tokenizer(name_or_path: str):
    """AutoTokenizer with left padding and a pad token (eos when the model has none,
    as Llama 3 does; loss masks come from the episode, never from pad ids)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.generation_eos_ids = generation_eos_ids(path)
    return tok


def generation_eos_ids(name_or_path: str) -> list[int]:
    """The end ids of a model's generation config (`eos_token_id`, an int or a
    list: Qwen3's is [<|im_end|>, <|endoftext|>]); [] when it has none or it
    cannot be read (a hub id with no local copy)."""
    local = Path(name_or_path) / "generation_config.json"
    try:
        if local.exists():
            eos = json.loads(local.read_text()).get("eos_token_id")
        else:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(name_or_path).eos_token_id
    except Exception:  # no generation config is not an error: the tokenizer's ids remain
        return []
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return sorted({int(i) for i in eos if isinstance(i, int) and i >= 0})


def _require(module: str, why: str, hint: str = GPU_INSTALL_HINT) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{why} needs the `{module}` package, which is not installed: {hint}")


def _bnb_config(quant: str, compute_dtype):
    _require("bitsandbytes", f"model.quant={quant!r}", "pip install bitsandbytes==0.50.2")
    from transformers import BitsAndBytesConfig

    if quant == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def _peft_lora(cfg: LoraConfig):
    import peft

    targets = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                           target_modules=targets, bias="none", task_type="CAUSAL_LM")


def load_policy(cfg: ModelConfig, train: bool = True, device_name: str | None = None):
    """(model, tokenizer) for `cfg`: the model on `device_name` (default: `device()`).

    train=True: quantised models go through peft's prepare_model_for_kbit_training,
    gradient checkpointing is enabled if asked, LoRA is attached (or the saved
    adapter loaded as trainable), and the model is in train mode. Without LoRA
    every weight trains (full fine-tune). train=False: everything frozen, eval mode.
    """
    if cfg.backend == "unsloth":
        return _load_unsloth(cfg, train)
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(cfg.name_or_path)
    dev = device_name or device()
    dtype = resolve_dtype(cfg.dtype, dev)
    tok = load_tokenizer(path)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": cfg.attn_implementation}
    if cfg.quant != "none":
        kwargs["quantization_config"] = _bnb_config(cfg.quant, dtype)
        kwargs["device_map"] = {"": dev}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if cfg.quant == "none":
        model.to(dev)
    checkpointing = {"use_reentrant": False}
    if train and cfg.quant != "none":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=checkpointing)
    elif train and cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    if cfg.adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, cfg.adapter_path, is_trainable=train)
    elif train and cfg.lora.enabled:
        from peft import get_peft_model

        model = get_peft_model(model, _peft_lora(cfg.lora))
    if train:
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    return model, tok


def trained_model_config(path: str, base: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig that loads a trained directory: full weights (an SFT or
    distilled `final/`) load as the model; a PEFT adapter (an RL `final/`) loads
    on top of the base its adapter_config.json names. `base` supplies the rest
    (dtype, quantisation, attention)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such model directory")
    base = base or ModelConfig()
    adapter = p / "adapter_config.json"
    if not adapter.exists():
        return dataclasses.replace(base, name_or_path=str(p), adapter_path=None)
    name = json.loads(adapter.read_text()).get("base_model_name_or_path")
    if not name:
        raise ValueError(f"{adapter}: no base_model_name_or_path; cannot tell which model the adapter is for")
    return dataclasses.replace(base, name_or_path=name, adapter_path=str(p))


def load_trained(path: str, train: bool = False, base: ModelConfig | None = None, device_name: str | None = None):
    """(model, tokenizer) from a trained directory (see `trained_model_config`)."""
    return load_policy(trained_model_config(path, base), train=train, device_name=device_name)


def _load_unsloth(cfg: ModelConfig, train: bool):
    """Unsloth's FastLanguageModel (argument names as in Unsloth's GRPO notebooks);
    with fast_inference its vLLM engine shares the weights (`model.fast_generate`)."""
    _require("unsloth", "model.backend='unsloth'")
    if cfg.fast_inference:
        _require("vllm", "model.fast_inference=true")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("model.backend='unsloth' needs a CUDA GPU; use model.backend=hf on a CPU")
    from unsloth import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(
        model_name=cfg.adapter_path or resolve_model_path(cfg.name_or_path),  # an adapter dir names its base
        max_seq_length=cfg.max_seq_len,
        dtype=None if cfg.dtype == "auto" else getattr(torch, cfg.dtype),
        load_in_4bit=cfg.quant == "4bit",
        load_in_8bit=cfg.quant == "8bit",
        full_finetuning=not cfg.lora.enabled,
        fast_inference=cfg.fast_inference,
        max_lora_rank=cfg.lora.rank,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
    )
    if train and cfg.lora.enabled and cfg.adapter_path is None:
        model = FastLanguageModel.get_peft_model(
            model, r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=LORA_TARGETS if cfg.lora.target_modules == ["all-linear"] else list(cfg.lora.target_modules),
            bias="none",
            # "unsloth" offloads the checkpoints to CPU memory (the planner's backend=unsloth)
            use_gradient_checkpointing="unsloth" if cfg.gradient_checkpointing else False,
            random_state=torch.initial_seed() % 2**32)
    if not train:
        FastLanguageModel.for_inference(model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.generation_eos_ids = generation_eos_ids(resolve_model_path(cfg.name_or_path))
    return model, tok


def check_score_method(backend: str, method: str, key: str = "score_method") -> None:
    """Tree scoring (one sequence per episode or group with a 4D mask) needs an
    attention that takes arbitrary masks (sdpa, eager); Unsloth's fused kernels
    take none, so an Unsloth model must score branch by branch."""
    if backend == "unsloth" and method in ("tree", "group"):
        raise ConfigError(f"{key}={method!r} needs arbitrary 4D attention masks, which model.backend='unsloth' "
                          f"does not take: set {key}=branch")


@contextmanager
def reference_model(model):
    """The reference policy, inside the block: the frozen `REFERENCE_ADAPTER`
    when the model carries one (`add_reference_adapter`: training continues an
    adapter, so the starting policy is base + that adapter as loaded), else
    `model` with its LoRA adapter disabled (the init weights, when training
    put a fresh adapter on them).

        with torch.no_grad(), reference_model(policy) as ref:
            ref_logits = ref(input_ids).logits

    No second copy of the base weights. A model without an adapter (full
    fine-tune) has no such view: keep `frozen_copy(model)` from before training.
    """
    if not getattr(model, "peft_config", None) or not hasattr(model, "disable_adapter"):
        raise ValueError("reference_model needs a PEFT (LoRA) model; a fully fine-tuned policy needs "
                         "a frozen copy of its initial weights: ref = frozen_copy(model) before training")
    if REFERENCE_ADAPTER in model.peft_config:
        active = model.active_adapter
        model.set_adapter(REFERENCE_ADAPTER, inference_mode=True)
        try:
            yield model
        finally:
            model.set_adapter(active)  # trainable again; the reference frozen
        return
    with model.disable_adapter():
        yield model


REFERENCE_ADAPTER = "reference"


def add_reference_adapter(model, adapter_dir: str | os.PathLike) -> None:
    """Load `adapter_dir` a second time, frozen, as the reference policy of a run
    that continues that adapter (RL from an SFT adapter: the KL anchors on the
    SFT policy, not on the base model). The trained adapter stays active."""
    active = model.active_adapter
    model.load_adapter(str(adapter_dir), adapter_name=REFERENCE_ADAPTER, is_trainable=False)
    model.set_adapter(active)


def save_pretrained(model, path: str | os.PathLike) -> None:
    """`model.save_pretrained(path)` without the frozen reference adapter, if any."""
    names = list(getattr(model, "peft_config", None) or ())
    if REFERENCE_ADAPTER in names:
        model.save_pretrained(path, selected_adapters=[n for n in names if n != REFERENCE_ADAPTER])
    else:
        model.save_pretrained(path)


def save_final(model, tokenizer, path: str | os.PathLike, merge: bool = False) -> Path:
    """A trained model and its tokenizer, written atomically to `path` (a run's final/).

    `merge=True` folds a LoRA adapter into the weights first (in place), so the
    directory loads as a plain model, with no PEFT needed (the distilled student).
    """
    if merge and getattr(model, "peft_config", None):
        model = model.merge_and_unload()
    with atomic_dir(path) as tmp:
        save_pretrained(model, tmp)
        tokenizer.save_pretrained(tmp)
    return Path(path)


def frozen_copy(model):
    """A deep copy with every parameter frozen, in eval mode: the reference policy of a full fine-tune."""
    import copy

    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


# ---------------------------------------------------------------------------
# GPU memory planner (DESIGN section 8)
# ---------------------------------------------------------------------------
# Pure arithmetic on a model's shape, so it runs anywhere and before any
# download. Units: GiB (2**30 bytes) throughout; the cards are taken as 24, 48,
# 80 and 141 GiB (RTX 4090/A6000-class, L40S/A6000, A100/H100, H200).
#
# Shapes: h hidden size, L layers, n_q and n_kv attention and key/value heads, d
# head dim, I intermediate size, V vocabulary, r LoRA rank. T is the number of
# tokens in a forward/backward: SFT batch x (prompt + completion); the RL update
# batch x G x (prompt + completion), or batch x (prompt + G x completion) when the
# group is scored as one prompt-rooted tree (share_prompt, DESIGN section 4).
#
#   weights      linear layers: 2 B/param in bf16, 4.127 bits/param in 4-bit NF4
#                (4 bits + an 8-bit absmax per 64 weights + an fp32 scale per 256
#                absmax: double quantisation), ~1 B/param in 8-bit; embeddings,
#                output head and norms stay unquantised, and the HF path's
#                prepare_model_for_kbit_training casts them to fp32.
#   adapter      LoRA: sum over targeted linears of r x (in + out) params, kept in
#                fp32 (peft upcasts adapters) with an fp32 gradient and two AdamW
#                moments: 16 B/param (10 B with 8-bit Adam). Full fine-tune: a
#                gradient in the weight dtype plus the two moments for every weight.
#   activations  what autograd keeps per token and layer: both norm inputs and
#                outputs (4h), q and the attention output (2 n_q d), k and v
#                (2 n_kv d), gate, up, act(gate) and their product (4I), and the
#                LoRA bottlenecks; flash/memory-efficient SDPA keeps no T x T scores.
#                No checkpointing: T x L x that. Checkpointing: T x L x h (the layer
#                inputs) plus one layer's worth recomputed during backward.
#                Unsloth offloads the layer inputs to CPU memory.
#   logits       tokens with a loss (all of them in SFT, the completions in RL) x V
#                x 10 bytes: the bf16 head output, its fp32 copy and the fp32
#                log-softmax kept for backward. Unsloth: 4 bytes (an fp32 head
#                output whose gradient its fused loss writes in place), and RL
#                log-probs one sequence at a time (chunked_logits).
#   kv cache     L x 2 x n_kv x d x 2 bytes per token, for batch x G x (prompt +
#                completion) tokens (prompt counted once per group with share_prompt).
#   vLLM         reserves gpu_memory_utilization x the card for its weights (a bf16
#                copy; Unsloth's engine shares the trainer's), LoRA slots, KV cache
#                and a workspace (a forward of 8192 batched tokens, the sampler's
#                fp32 logits for 256 sequences, CUDA graphs). The reservation stays
#                through the update: the trainer gets the rest of the card.
#   overhead     CUDA context, cuBLAS workspaces, allocator slack: 1 GiB.
#
# A stage fits a card of C GiB if its total is at most C; with vLLM that means
# its needs fit in u x C and the trainer's in (1 - u) x C, so the smallest card is
# max(vllm / u, trainer / (1 - u)).
# Not modelled: allocator fragmentation beyond the overhead, eager attention's T x T
# scores, fp32 residual streams behind upcast norms, vLLM sleep mode.
# tests/test_models.py checks the formulas against published figures.

GPU_SIZES_GB = (24, 48, 80, 141)
MODEL_CONFIGS_DIR = Path(__file__).resolve().parent / "configs" / "models"
_GIB = 2 ** 30
_NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)
_LOGIT_BYTES = 2 + 4 + 4
_LOGIT_BYTES_FUSED = 4
_VLLM_BATCHED_TOKENS, _VLLM_MAX_SEQS, _VLLM_GRAPHS_GB = 8192, 256, 0.5
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The numbers of an HF config.json that decide memory."""
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int

    @classmethod
    def from_config(cls, config: dict, name: str = "") -> "ModelShape":
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in keys if k not in config]
        if missing:
            raise ConfigError(f"model config {name!r} lacks {', '.join(missing)}")
        h, n_q = config["hidden_size"], config["num_attention_heads"]
        return cls(name=name or config.get("_name_or_path", "model"), hidden_size=h,
                   num_hidden_layers=config["num_hidden_layers"], num_attention_heads=n_q,
                   num_key_value_heads=config.get("num_key_value_heads") or n_q,
                   intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   head_dim=config.get("head_dim") or h // n_q)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer."""
        h, q, kv, i = (self.hidden_size, self.num_attention_heads * self.head_dim,
                       self.num_key_value_heads * self.head_dim, self.intermediate_size)
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        return self.num_hidden_layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def other_params(self) -> int:
        """Embeddings, output head (unless tied) and norms: never quantised."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + (2 * self.num_hidden_layers + 1) * self.hidden_size

    @property
    def n_params(self) -> int:
        return self.linear_params + self.other_params

    def lora_params(self, rank: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        names = list(shapes) if list(targets) == ["all-linear"] else list(targets)
        unknown = [t for t in names if t not in shapes]
        if unknown:
            raise ConfigError(f"unknown LoRA target(s) {unknown}; the planner knows {list(shapes)} and 'all-linear'")
        return self.num_hidden_layers * sum(rank * sum(shapes[t]) for t in names)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * bytes_per_value


def load_model_config(name_or_path: str) -> ModelShape:
    """A short name from configs/models/ (`Llama-3.1-8B`, case-insensitive), or an HF
    config.json (the file or its directory)."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        shipped = {p.stem.lower(): p for p in MODEL_CONFIGS_DIR.glob("*.json")}
        key = name_or_path.rsplit("/", 1)[-1].lower()
        if key not in shipped:
            raise ConfigError(f"no model config {name_or_path!r}: not a file, and not one of "
                              f"{', '.join(sorted(p.stem for p in shipped.values()))}")
        path = shipped[key]
    config = json.loads(path.read_text(encoding="utf-8"))
    return ModelShape.from_config(config, name=path.stem if path.name != "config.json" else path.parent.name)


@dataclasses.dataclass
class PlanConfig:
    model: str = "Llama-3.1-8B"         # a name in configs/models/ or an HF config.json (or its directory)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # unquantised weights, activations
    quant: Literal["none", "4bit", "8bit"] = "4bit"
    lora_rank: int = 16                 # 0: full fine-tune
    lora_targets: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
    gradient_checkpointing: bool = True
    # hf: peft's kbit preparation, checkpoints on the GPU, vLLM with its own weights;
    # unsloth: checkpoints offloaded, vLLM shares the weights, chunked logits
    backend: Literal["hf", "unsloth"] = "hf"
    batch: int = 1                      # prompts per step (SFT: sequences per micro-batch)
    group_size: int = 8                 # rollouts per prompt (RL)
    prompt_len: int = 1024              # tokens
    completion_len: int = 256           # tokens
    gpu_memory_utilization: float = 0.5  # vLLM's share of the card; 0: generate with HF instead
    chunked_logits: bool = False        # log-probs one sequence at a time (always with unsloth)
    share_prompt: bool = False          # prefix-cache the prompt and score each group as one tree
    overhead_gb: float = 1.0            # CUDA context and allocator slack

    def __post_init__(self):
        if self.quant != "none" and self.lora_rank == 0:
            raise ConfigError("a quantised model trains through LoRA only: set lora_rank > 0 or quant=none")
        if not 0.0 <= self.gpu_memory_utilization < 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in [0, 1), got {self.gpu_memory_utilization}")
        if min(self.batch, self.group_size, self.completion_len) < 1 or self.prompt_len < 0 or self.lora_rank < 0:
            raise ConfigError("batch, group_size and completion_len must be >= 1; prompt_len, lora_rank >= 0")


@dataclasses.dataclass
class MemoryPlan:
    config: PlanConfig
    shape: ModelShape
    stages: dict[str, dict[str, float]]  # stage -> component -> GiB, vLLM's reservation apart
    vllm: dict[str, float]               # what vLLM holds inside its reservation (empty: HF generate)
    min_gpu_gb: dict[str, float]         # stage -> smallest card it fits
    fits: dict[str, dict[int, bool]]     # stage -> card size -> fits

    def beside_vllm(self, stage: str) -> bool:
        return bool(self.vllm) and stage in ("rollout", "update")

    def total_gb(self, stage: str, gpu_gb: float | None = None) -> float:
        """The stage's peak; beside vLLM it depends on the card (`gpu_gb`) vLLM reserves a share of."""
        trainer = sum(self.stages[stage].values())
        if not self.beside_vllm(stage):
            return trainer
        if gpu_gb is None:
            raise ValueError(f"stage {stage!r} runs beside vLLM: its total depends on gpu_gb")
        return trainer + self.config.gpu_memory_utilization * gpu_gb


def plan_memory(cfg: PlanConfig, shape: ModelShape | None = None) -> MemoryPlan:
    """Peak GPU memory of the SFT step, the RL rollout and the RL update (the
    formulas above), and which of GPU_SIZES_GB each fits."""
    s = shape or load_model_config(cfg.model)
    unsloth = cfg.backend == "unsloth"
    ab = _DTYPE_BYTES[cfg.dtype]  # activation bytes: 4-bit matmuls compute in this dtype too
    h, n_layers, vocab = s.hidden_size, s.num_hidden_layers, s.vocab_size
    lora = s.lora_params(cfg.lora_rank, cfg.lora_targets) if cfg.lora_rank else 0

    # Weights and the trainable state
    other_bytes = 4 if cfg.quant != "none" and not unsloth else ab
    linear_bytes = {"none": ab, "4bit": _NF4_BITS / 8, "8bit": 1.0}[cfg.quant]
    weights = s.linear_params * linear_bytes + s.other_params * other_bytes
    moments = 2 if cfg.optimizer == "adamw_8bit" else 8
    adapter = lora * (4 + 4 + moments) if cfg.lora_rank else s.n_params * (ab + moments)

    # One forward + backward over `tokens`
    n_targets = len(s.linear_shapes()) if cfg.lora_targets == ["all-linear"] else len(cfg.lora_targets)
    per_layer = (4 * h + 2 * s.num_attention_heads * s.head_dim + 2 * s.num_key_value_heads * s.head_dim
                 + 4 * s.intermediate_size + cfg.lora_rank * n_targets) * ab

    def activations(tokens: int) -> float:
        if not cfg.gradient_checkpointing:
            return tokens * n_layers * per_layer
        on_gpu = 2 if unsloth else n_layers  # layer inputs; Unsloth keeps only those in flight
        return tokens * (on_gpu * h * ab + per_layer)

    def logits(loss_tokens: int, per_sequence: int, chunked: bool) -> float:
        return (per_sequence if chunked else loss_tokens) * vocab * (_LOGIT_BYTES_FUSED if unsloth else _LOGIT_BYTES)

    overhead = cfg.overhead_gb * _GIB
    seq = cfg.prompt_len + cfg.completion_len
    n_seq = cfg.batch * cfg.group_size
    group_tokens = cfg.batch * (cfg.prompt_len + cfg.group_size * cfg.completion_len)  # prompt once per group
    stages: dict[str, dict[str, float]] = {}
    stages["sft"] = {"weights": weights, "adapter": adapter, "activations": activations(cfg.batch * seq),
                     "logits": logits(cfg.batch * seq, seq, cfg.chunked_logits), "overhead": overhead}

    # RL rollout: batch x G sequences of prompt + completion
    kv = (group_tokens if cfg.share_prompt else n_seq * seq) * s.kv_bytes_per_token(2 if ab == 2 else 4)
    u = cfg.gpu_memory_utilization
    vllm: dict[str, float] = {}
    if u > 0:
        vllm = {"weights": 0.0 if unsloth else s.n_params * 2,  # Unsloth's engine uses the trainer's copy
                "lora": lora * 2, "kv_cache": kv,
                "workspace": (_VLLM_BATCHED_TOKENS * (2 * s.intermediate_size + 4 * h) * 2
                              + _VLLM_MAX_SEQS * vocab * 4 * 2 + _VLLM_GRAPHS_GB * _GIB)}
        stages["rollout"] = {"weights": weights, "adapter": adapter, "overhead": overhead}
    else:
        prefill_rows = cfg.batch if cfg.share_prompt else n_seq
        prefill = prefill_rows * cfg.prompt_len * (2 * s.intermediate_size + 4 * h) * ab + n_seq * vocab * 4
        stages["rollout"] = {"weights": weights, "adapter": adapter, "kv_cache": kv, "prefill": prefill,
                             "overhead": overhead}

    # RL update: score (and backpropagate through) every rollout of the step
    update = {"weights": weights, "adapter": adapter,
              "activations": activations(group_tokens if cfg.share_prompt else n_seq * seq),
              "logits": logits(n_seq * cfg.completion_len, cfg.completion_len, cfg.chunked_logits or unsloth),
              "overhead": overhead}
    if cfg.share_prompt:  # the additive 4D tree mask, T x T per prompt
        update["tree_mask"] = cfg.batch * (cfg.prompt_len + cfg.group_size * cfg.completion_len) ** 2 * ab
    stages["update"] = update

    if vllm and unsloth:  # the shared weights sit inside vLLM's reservation, not beside it
        vllm["weights"] = weights
        for name in ("rollout", "update"):
            stages[name]["weights"] = 0.0
    stages = {k: {c: b / _GIB for c, b in v.items()} for k, v in stages.items()}
    vllm = {c: b / _GIB for c, b in vllm.items()}
    plan = MemoryPlan(cfg, s, stages, vllm, {}, {})
    for name, parts in stages.items():
        trainer = sum(parts.values())
        plan.min_gpu_gb[name] = max(sum(vllm.values()) / u, trainer / (1 - u)) if plan.beside_vllm(name) else trainer
        plan.fits[name] = {g: plan.min_gpu_gb[name] <= g for g in GPU_SIZES_GB}
    return plan


def format_plan(plan: MemoryPlan) -> str:
    """A table: one row per stage, GiB per component, the smallest card, and a fit mark per card."""
    c, s = plan.config, plan.shape
    targets = "all linear" if c.lora_targets == ["all-linear"] or set(c.lora_targets) >= set(LORA_TARGETS) \
        else ",".join(c.lora_targets)
    lora = (f"LoRA r={c.lora_rank} on {targets} ({s.lora_params(c.lora_rank, c.lora_targets) / 1e6:.1f}M)"
            if c.lora_rank else "full fine-tune")
    rollout = (f"vLLM reserves {c.gpu_memory_utilization:g} of the card ({sum(plan.vllm.values()):.2f} needed)"
               if plan.vllm else "HF generate")
    lines = [f"{s.name} ({s.n_params / 1e9:.2f}B): {c.quant if c.quant != 'none' else c.dtype}, {lora}, "
             f"{c.optimizer}, {'grad ckpt' if c.gradient_checkpointing else 'no grad ckpt'}, backend {c.backend}; "
             f"batch {c.batch} x G {c.group_size}, prompt {c.prompt_len} + completion {c.completion_len}; {rollout}"]
    cols = [k for k in ("weights", "adapter", "activations", "logits", "kv_cache", "prefill", "tree_mask", "overhead")
            if any(k in v for v in plan.stages.values())]
    lines.append(f"{'GiB':<8}" + "".join(f"{k:>12}" for k in cols) + f"{'total':>8}{'+vLLM':>7}{'min GPU':>9}"
                 + "".join(f"{g:>5}" for g in GPU_SIZES_GB))
    for name, parts in plan.stages.items():
        cells = "".join(f"{parts[k]:>12.2f}" if k in parts else f"{'-':>12}" for k in cols)
        beside = f"{c.gpu_memory_utilization:>5g}xC" if plan.beside_vllm(name) else f"{'':>7}"
        marks = "".join(f"{'yes' if plan.fits[name][g] else 'no':>5}" for g in GPU_SIZES_GB)
        lines.append(f"{name:<8}{cells}{sum(parts.values()):>8.2f}{beside}{plan.min_gpu_gb[name]:>9.1f}{marks}")
    if plan.vllm:
        lines.append("vLLM holds " + ", ".join(f"{k} {v:.2f}" for k, v in plan.vllm.items())
                     + f" GiB within its {c.gpu_memory_utilization:g} x C")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Command line: tiny models and memory plans
# ---------------------------------------------------------------------------

_USAGE = """usage:
  python common.py tiny-model --preset tiny-1m --out DIR [--seed S]
      build a tiny Llama policy and its news-world tokenizer (save_pretrained format)
  python common.py plan [--config FILE.yaml] [key=value ...]
      peak GPU memory per stage, e.g. plan model=Qwen3-8B quant=4bit group_size=8;
      model=all plans every config in configs/models/; plan --help lists the keys"""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "tiny-model":
        import argparse

        parser = argparse.ArgumentParser(prog="common.py tiny-model", description="Build a tiny Llama policy.")
        parser.add_argument("--preset", choices=list(TINY_PRESETS), default="tiny-1m")
        parser.add_argument("--out", required=True, help="directory to write (reused if already built)")
        parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
        args = parser.parse_args(rest)
        path = build_tiny_model(args.preset, args.out, args.seed)
        info = json.loads((path / TINY_MARKER).read_text(encoding="utf-8"))
        print(f"{args.preset} (seed {args.seed}): {info['n_params']:,} parameters, "
              f"vocabulary {info['vocab_size']} -> {path}")
    elif command == "plan":
        try:
            cfg = load_config(PlanConfig, rest)
            names = sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.json")) if cfg.model == "all" else [cfg.model]
            print("\n\n".join(format_plan(plan_memory(dataclasses.replace(cfg, model=n))) for n in names))
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
    else:
        print(_USAGE, file=sys.stderr)
        raise SystemExit(0 if command in ("-h", "--help") else 2)


if __name__ == "__main__":
    main()
