"""The document world: what the library asks of a world whose every fact is known.

Some features need one: the `oracle` factuality backend and key-fact coverage (rewards.py),
an evaluation's per-claim audits, the oracle teacher, generated and fresh documents
(`data.generate`, `data.fresh`, `data.validation`), the learned scorer's training pairs and
the tiny model presets. The library asks `world()` for them and imports no world itself.

The built-in news world is the `WORLD` of newsworld/hooks.py: `world()` imports the module
named `BUILTIN` the first time a feature asks and none is registered. A fork that
deletes newsworld/ keeps every other feature, and asking for a world feature then fails with
a message naming that feature. A fork with a world of its own builds a `World` from its
functions and calls `register` before the first request.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

BUILTIN = "newsworld.hooks"  # imported when a world feature is asked for and none is registered


@dataclass(frozen=True)
class World:
    """A world's functions; a document is its `data.Document` (with `.facts`)."""
    name: str
    errors: Callable[[Any, str], list[dict]]  # a summary's errors against the fact table, one label each
    support: Callable[[Any, str], Any]  # the fact a sentence is about, and whether it states it right
    stated_facts: Callable[[Any, str], Any]  # the key facts a summary states
    key_fact_coverage: Callable[[Any, str], float]  # the share of key facts a summary states right
    fact_precision: Callable[[Any, str], float]  # the share of stated names, numbers and dates supported
    fact_score: Callable[[Any, str], float]  # the share of sentences with no error
    best_extract: Callable[[Any, int], str]  # the best whole sentences within a word budget
    draft: Callable[..., tuple]  # (document, rng) -> (a faulty draft, its labelled errors, ...)
    documents: Callable[..., Iterator]  # (n, seed=, task=) -> documents
    fresh_documents: Callable[..., tuple[list, list]]  # (n, seed, guard, task) -> (documents, skipped)
    tiny_presets: Mapping[str, Any]  # tiny model presets by name
    build_tiny_model: Callable[[str, Any], Any]  # (name, directory) -> the built model's directory


_registered: World | None = None


def register(w: World) -> None:
    """Make `w` the world every feature asks."""
    global _registered
    _registered = w


def world(feature: str) -> World:
    """The registered world, importing the built-in one on first use; `feature` names what
    asked, for the message when there is none."""
    found = find()
    if found is None:
        raise SystemExit(f"{feature} needs a document world whose facts are known, and there is none: the "
                         f"built-in news world ({BUILTIN.split('.')[0]}/) is not here. Restore it, or register "
                         "a world of your own (factual_tools.world.register) before the run starts.")
    return found


def find() -> World | None:
    """The registered world, the built-in one imported on first use; None when there is none."""
    if _registered is None:
        try:
            register(importlib.import_module(BUILTIN).WORLD)
        except ModuleNotFoundError as e:
            if e.name not in (BUILTIN, BUILTIN.split(".")[0]):
                raise
    return _registered
