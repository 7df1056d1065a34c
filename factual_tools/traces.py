"""What the trace scripts share: trace files and the TF-IDF similarity of sentences.

- Trace JSONL: appended one document at a time and flushed, so a kill leaves
  whole lines plus at most one cut line (`repair_tail` removes it and the trace
  is made again); `--shard i/n` files and `merge`.
- `tfidf_for(document).cosine`: the similarity synth_traces.py picks a search's support with
  and filter_traces.py's relevance gate checks a correction against.
"""
from __future__ import annotations

import functools
import html
import hashlib
import json
import math
import os
import re
import sys
from collections import Counter
from typing import Iterable, Sequence

import data
import sandbox
from factual_tools import common, settings, textsplit
from factual_tools.teachers import body


class Tfidf:
    """TF-IDF vectors over `textsplit.words`, with IDF from one document's sentences."""

    def __init__(self, sentences: Sequence[str]):
        n = len(sentences)
        df = Counter(w for s in sentences for w in set(textsplit.words(s)))
        self.idf = {w: math.log((1 + n) / (1 + c)) + 1.0 for w, c in df.items()}
        self.unseen = math.log(1 + n) + 1.0  # a word the document never uses weighs most

    def vector(self, text: str) -> dict[str, float]:
        return {w: c * self.idf.get(w, self.unseen) for w, c in Counter(textsplit.words(text)).items()}

    def cosine(self, a: str, b: str) -> float:
        va, vb = self.vector(a), self.vector(b)
        dot = sum(x * vb.get(w, 0.0) for w, x in va.items())
        na, nb = math.sqrt(sum(x * x for x in va.values())), math.sqrt(sum(x * x for x in vb.values()))
        return dot / (na * nb) if na and nb else 0.0


@functools.lru_cache(maxsize=256)
def tfidf_for(document: str) -> Tfidf:
    """TF-IDF vectors whose IDF comes from `document`'s sentences (cached per document):
    `tfidf_for(document).cosine(a, b)`."""
    return Tfidf(sandbox.index_for(document).sentences)


# ---------------------------------------------------------------------------
# Files: resumable output, shards, merge
# ---------------------------------------------------------------------------


def stable_hash(s: str) -> int:
    return int(hashlib.sha256(s.encode("utf-8")).hexdigest()[:12], 16)


def parse_shard(spec: str) -> tuple[int, int]:
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec)
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise settings.ConfigError(f"shard must be i/n with 0 <= i < n, got {spec!r}")
    return int(m.group(1)), int(m.group(2))


def shard_of(doc_id: str, n: int) -> int:
    return stable_hash(doc_id) % n


def shard_path(path: str, i: int, n: int) -> str:
    if n == 1:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.shard{i}of{n}{ext or '.jsonl'}"


def repair_tail(path: str) -> int:
    """Cut a last line left incomplete by a kill mid-write; returns the bytes removed."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        if size == 0:
            return 0
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return 0
        f.seek(0)
        blob = f.read()
    cut = blob.rfind(b"\n") + 1
    with open(path, "r+b") as f:
        f.truncate(cut)
    print(f"{path}: the last line was incomplete (interrupted write): removed {size - cut} bytes; "
          f"its trace will be made again", file=sys.stderr)
    return size - cut


def iter_trace_lines(path: str) -> Iterable[tuple[int, dict]]:
    """(line number, record) for each complete line; a malformed complete line is an error."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if not line.endswith("\n"):
                print(f"{path}:{n}: incomplete last line skipped (run synth_traces.py again to redo it)",
                      file=sys.stderr)
                return
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise data.DataError(f"{path}:{n}: malformed trace line: {e}") from None
            yield n, rec


def read_traces(path: str) -> list[sandbox.Episode]:
    out = []
    for n, rec in iter_trace_lines(path):
        try:
            out.append(sandbox.Episode.from_dict(rec))
        except (KeyError, TypeError, ValueError) as e:
            raise data.DataError(f"{path}:{n}: not an episode ({type(e).__name__}: {e})") from None
    return out


def done_ids(path: str) -> set[str]:
    if not os.path.exists(path):
        return set()
    repair_tail(path)
    return {rec.get("meta", {}).get("id") for _, rec in iter_trace_lines(path)} - {None}


def append_traces(path: str, episodes: Sequence[sandbox.Episode]) -> None:
    """One write per document, flushed: a kill leaves whole lines plus at most one cut line."""
    if not episodes:
        return
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(ep.to_json() + "\n" for ep in episodes))
        f.flush()


def trace_id(rec: dict):
    return rec.get("meta", {}).get("id")


def merge(out: str, inputs: Sequence[str], key=trace_id, what: str = "trace") -> dict:
    """Join shard files: identical duplicates (the same `key`: a trace's meta.id, a teacher
    episode's doc_id) are kept once, conflicting ones are an error."""
    seen: dict[str, tuple[str, str]] = {}
    lines = []
    dups = 0
    for path in inputs:
        for n, rec in iter_trace_lines(path):
            tid = key(rec)
            if tid is None:
                raise data.DataError(f"{path}:{n}: {what} without its id")
            canon = json.dumps(rec, sort_keys=True, ensure_ascii=False)
            if tid in seen:
                if seen[tid][0] != canon:
                    raise data.DataError(f"{path}:{n}: {what} {tid!r} conflicts with the one in {seen[tid][1]}")
                dups += 1
                continue
            seen[tid] = (canon, f"{path}:{n}")
            lines.append(json.dumps(rec, ensure_ascii=False))
    common.atomic_write_text(out, "".join(x + "\n" for x in lines))
    return {"traces": len(lines), "duplicates": dups, "inputs": len(inputs)}


# ---------------------------------------------------------------------------
# Shards on one machine: `--shards N` runs `--shard i/N` for every i at once
# ---------------------------------------------------------------------------


def _flags(argv: Sequence[str], flags: Sequence[str]):
    """argv's items in order, each as (flag, value) when it is one of `flags` (`--f v`
    or `--f=v`), else (None, the item)."""
    it = iter(argv)
    for a in it:
        flag = next((f for f in flags if a == f or a.startswith(f + "=")), None)
        if flag is None:
            yield None, a
            continue
        value = next(it, None) if a == flag else a.split("=", 1)[1]
        if value is None:
            raise settings.ConfigError(f"{flag} needs a value")
        yield flag, value


def pop_shards(argv: Sequence[str]) -> tuple[list[str], int, int]:
    """(argv without them, N, G) from `--shards N` and `--gpus G` (or `--shards=N`): N
    shard processes at once, shard i on GPU i mod G alone (G = 0: no GPU is assigned)."""
    out, found = [], {"--shards": 1, "--gpus": 0}
    for flag, value in _flags(argv, tuple(found)):
        if flag is None:
            out.append(value)
        elif not value.isdigit():
            raise settings.ConfigError(f"{flag} needs a whole number, got {value!r}")
        else:
            found[flag] = int(value)
    if found["--shards"] < 1:
        raise settings.ConfigError("--shards must be >= 1")
    return out, found["--shards"], found["--gpus"]


def run_shards(script: str, argv: Sequence[str], n: int, gpus: int, *, out: str, key=trace_id,
               what: str = "trace") -> tuple[dict, list[str]]:
    """Run `python script ARGV --shard i/n` for every i < n at once, wait for all of them,
    and merge their files into `out` (`merge`, by `key`); returns (the merge's figures,
    the shard files). With `gpus`, shard i sees GPU i mod gpus alone
    (CUDA_VISIBLE_DEVICES). A failed shard keeps what it wrote (a rerun resumes it) and
    is named with its command; the others run to their end, and nothing is merged."""
    import subprocess

    procs = []
    for i in range(n):
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus else {}))
        cmd = [sys.executable, script, *argv, "--shard", f"{i}/{n}"]
        procs.append((cmd, subprocess.Popen(cmd, env=env)))
    failed = [(cmd, rc) for cmd, p in procs if (rc := p.wait()) != 0]
    if failed:
        raise SystemExit("shards failed (a rerun resumes each):\n" + "\n".join(
            f"  exit {rc}: python {' '.join(cmd[1:])}" for cmd, rc in failed))
    parts = [shard_path(out, i, n) for i in range(n)]
    return merge(out, parts, key, what), parts


def flags_to_keys(argv: Sequence[str]) -> list[str]:
    """`--shard i/n` and `--limit N` (or `--shard=i/n`) as the config keys they are: `shard=i/n`, `limit=N`."""
    return [v if f is None else f"{f[2:]}={v}" for f, v in _flags(argv, ("--shard", "--limit"))]


# ---------------------------------------------------------------------------
# The spot-check viewer: one self-contained HTML page of traces (filter_traces.py, eval.py)
# ---------------------------------------------------------------------------


def shape(ep: sandbox.Episode) -> str:
    """The tool-call shape: S for a search, D for a delete, in order."""
    return "".join("S" if c.kind == "search" else "D" for c in ep.calls) or "-"


def trace_id(ep: sandbox.Episode) -> str:
    """The trace's id (`meta.id`), or its document's id marked unknown."""
    return ep.meta.get("id") or f"{ep.doc_id}#?"


_CSS = """body{font:14px/1.5 system-ui,sans-serif;margin:2em auto;max-width:60em;color:#222}
.trace{border:1px solid #ccc;border-radius:6px;padding:.8em 1em;margin:1.2em 0}
.head{font-weight:600}.noise{color:#b00}.ok{color:#070}.meta{color:#666;font-size:12px}
.call{background:#e3efff;border-radius:3px;font-family:monospace}.deltag{background:#ffe3e3;font-family:monospace}
.results{background:#f2f2f2;color:#555;font-family:monospace;font-size:12px;border-radius:3px}
del.gone{color:#a00}.summary{border-left:3px solid #7a7;padding-left:.6em}details{margin:.4em 0}"""


def trace_pieces(ep: sandbox.Episode) -> list[tuple[str, str]]:
    """(kind, text) pieces in order: text, deleted (struck), call, delete, results."""
    pieces: list[list[str]] = []
    for t in ep.turns:
        b = body(t)
        if b:
            pieces.append(["text", b])
        if t.call:
            c = t.call
            if c.kind == "delete" and c.deleted:
                _strike(pieces, len("".join(c.deleted.split())))
            pieces.append(["del" if c.kind == "delete" else "call", t.text[c.start:c.end]])
            if c.end < len(t.text):
                pieces.append(["text", t.text[c.end:]])
        if t.injected:
            pieces.append(["results", t.injected])
    return [(k, v) for k, v in pieces]


def _strike(pieces: list[list[str]], n: int) -> None:
    """Mark the last `n` non-space characters of live text as deleted (splitting a piece if needed)."""
    i = len(pieces) - 1
    while n > 0 and i >= 0:
        kind, text = pieces[i]
        if kind == "text":
            cut = len(text)
            while cut > 0 and n > 0:
                cut -= 1
                n -= not text[cut].isspace()
            pieces[i:i + 1] = ([["text", text[:cut]]] if cut else []) + [["deleted", text[cut:]]]
        i -= 1


def render_html(samples: Sequence[tuple[sandbox.Episode, list[str] | None]], title: str) -> str:
    """A self-contained viewer; every piece of model or document text is HTML-escaped (it is untrusted)."""
    e = lambda s: html.escape(str(s), quote=True)  # noqa: E731
    cls = {"text": None, "deleted": "gone", "call": "call", "del": "deltag", "results": "results"}
    out = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title><style>{_CSS}</style>"
           f"</head><body><h1>{e(title)}</h1>"]
    for k, (ep, noise) in enumerate(samples, 1):
        mark = ("" if noise is None else f" <span class='noise'>noise: {e('; '.join(noise))}</span>" if noise
                else " <span class='ok'>clean (oracle)</span>")
        judge = (ep.meta.get("judge") or {}).get("score")
        out.append(f"<div class='trace'><div class='head'>{k}. {e(trace_id(ep))} &middot; "
                   f"{e(ep.meta.get('trace_kind', '?'))}{mark}</div><div class='meta'>doc {e(ep.doc_id)} &middot; "
                   f"{ep.n_search} searches, {ep.n_delete} deletes &middot; shape {e(shape(ep))} &middot; judge "
                   f"{e(judge)} &middot; types {e(', '.join(ep.meta.get('error_types') or []) or '-')}</div>")
        out.append(f"<details><summary>document</summary><p>{e(ep.document)}</p></details>")
        parts = []
        for kind, text in trace_pieces(ep):
            tag = "del" if kind == "deleted" else "span"
            parts.append(e(text) if cls[kind] is None else f"<{tag} class='{cls[kind]}'>{e(text)}</{tag}>")
        out.append(f"<p>{''.join(parts)}</p><p class='summary'>{e(ep.summary)}</p></div>")
    out.append("</body></html>")
    return "\n".join(out)
