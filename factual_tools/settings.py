"""Strict configs: defaults < `--config FILE.yaml` < `key.sub=value`, for every script.

Each script declares one dataclass `Config` (groups are nested dataclasses) and
calls `load_config(Config)`. Every unknown key or wrong type is an error naming
the key, where it came from and the nearest valid key. A config file may start
from another (`extends: tiny.yaml`) and set only what differs.

Why hand-written rather than TrlParser, OmegaConf or Hydra: TrlParser and
HfArgumentParser are flat (no nested groups set as `lora.rank=16`); OmegaConf
merges silently add a typo'd key unless struct mode is on, never say "did you
mean", and add a dependency (Hydra more so).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
import types
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Union

import yaml


# ---------------------------------------------------------------------------
# Config loading
# ---------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config file or command-line override that does not fit the script's Config."""


# `--verbose`, which every script accepts: print the resolved config at the start of a
# run (it is always written to the run's config.yaml). Set by parse_args.
verbose = False


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
                               f"[key.sub=value ...] {' '.join((*flags, '[--verbose]'))}", "keys [default]:"]
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
    other `-x`/`--xyz` is an error but `--verbose` (every script's: sets `verbose`).
    `-h`/`--help` prints every key and exits.
    """
    global verbose
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
        elif arg == "--verbose":
            verbose = True
        elif arg.startswith("-"):
            known = ", ".join(("--config", *flags, "--verbose"))
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


def flags_as_overrides(argv: list[str], flags: dict[str, str]) -> list[str]:
    """Valued flags (`--model DIR` or `--model=DIR`) as the key=value overrides
    `parse_args` reads: `flags` maps each flag to its config key."""
    out, it = [], iter(argv)
    for a in it:
        name, eq, value = a.partition("=")
        if name in flags:
            value = value if eq else next(it, None)
            if value is None:
                raise ConfigError(f"{name} needs a value")
            out.append(f"{flags[name]}={value}")
        else:
            out.append(a)
    return out


@contextmanager
def config_errors_exit(*also: type[Exception]):
    """For a script's `__main__`: a ConfigError (or one of the bad-input errors
    `also` names, e.g. data.DataError) inside the block exits with one line,
    `error: ...`, instead of a traceback.

        with settings.config_errors_exit():
            cfg = settings.load_config(Config)
    """
    try:
        yield
    except (ConfigError, *also) as e:
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



