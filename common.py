"""Shared plumbing for every script: atomic writes, strict configs, runs, logging, seeding.

Sections: atomic writes; config loading; runs, step lines and metrics; seeding.

Why the config loader is hand-written rather than TrlParser, OmegaConf or Hydra:
TrlParser/HfArgumentParser are flat (no nested groups set as `lora.rank=16`);
OmegaConf merges silently add a typo'd key unless struct mode is on, never say
"did you mean", and add a dependency (Hydra more so). The section below (under
300 lines) does exactly what DESIGN section 7 asks: defaults < `--config FILE.yaml` <
`key.sub=value`, and every unknown key or wrong type is an error naming the key,
where it came from and the nearest valid key.

torch is imported only inside `seed_everything`, so importing the config
loader stays fast (tests, `--help`, the memory planner).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
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
    tp = root
    for name in key.split("."):
        if not _is_group(tp) or name not in {f.name for f in _fields(tp)}:
            raise _unknown(root, key, "command line")
        tp = _hints(tp)[name]
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
        try:
            data = yaml.load(Path(config_file).read_text(encoding="utf-8"), Loader=_StrictLoader)
        except OSError as e:
            raise ConfigError(f"cannot read config file {config_file}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {config_file} is not valid YAML: {e}") from None
        _flatten_yaml(cls, {} if data is None else data, "", config_file, flat, cls)
    for key, raw in overrides:
        _set_cli(cls, key, raw, flat)
    return _build(cls, flat), present


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


def _jsonable(v: Any) -> Any:
    """NaN and +-inf become the strings "nan", "inf", "-inf": strict JSON has no
    such numbers, and null would hide a diverged loss. read_metrics turns them back."""
    if isinstance(v, np.ndarray):
        v = v.tolist()
    elif isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


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
        line = json.dumps(_jsonable({"step": step, **fields}), allow_nan=False)
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
