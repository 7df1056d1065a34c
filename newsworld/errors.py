"""Where a policy's factual errors come from on the news world: by error type, and by how far
back in the model's context the article sentence it needed stood when it wrote the sentence.

    python -m newsworld errors runs/eval_news [RUN_DIR ...]    # prints tables, writes RUN_DIR/errors.json

The question it answers: a search injects the article's sentences right before the sentence the
policy then writes (DESIGN.md section 2); does that cut errors on facts that sit far back in the
context? A copying or no-tool policy reads every fact from the prompt's article, hundreds of words
back on the long task; a searching policy can have the fact a few words away.

Input is an eval.py run directory: `eval.json` (its `config.docs` names the documents) and
`episodes.jsonl` (a line per model and document). For each sentence of a final summary:
- wrong: any `oracle.oracle_errors` label with its sentence index; its types are those labels';
- support: `oracle.oracle_support`, the article sentences it is about (none: bucket `unsupported`);
- distance: the words between where the model began writing the sentence and the nearest earlier
  place in its context where a supporting sentence stood. In the prompt's article (which precedes
  everything generated) that is the article's words after the sentence plus the context's words
  before the summary sentence; in a search result, the context's words between the result and the
  summary sentence. A result injected inside the sentence (a mid-sentence search) counts as
  distance 0: the model saw it before it finished the sentence.

The context is the one the model saw. The episode's turns are run again through
`sandbox.EpisodeBuilder` with the stored results (no search is rerun), so a delete prunes it
exactly as it did the model's: the retracted text is gone; every tool call and result, before the
cut or between the cut and the delete, stays (the evidence). The text that survives into the final
summary was written after everything that precedes it in this final context (a delete only ever
removes the end of the summary), so a surviving sentence's context is the final context up to the
sentence: its last written occurrence. Words are `textsplit.words`, with protocol tags removed
(a search's query and its results' sentences count; `<results>`, `<0>`, the delete tag do not).
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import regex

import data
import sandbox
from factual_tools import common, textsplit
from newsworld import oracle

# Distance buckets in words: each lower bound opens a bucket that ends where the next begins.
BUCKET_STARTS = (0, 50, 150, 300)
BUCKETS = tuple(f"{a}-{b}" for a, b in zip(BUCKET_STARTS, BUCKET_STARTS[1:])) + (f"{BUCKET_STARTS[-1]}+",)
UNSUPPORTED = "unsupported"  # the sentence states nothing the article supports: no distance
UNLOCATED = "unlocated"  # the episode's replay did not give its stored summary back (should not happen)
SOURCES = ("search", "article")  # where the nearest supporting sentence stood
# A results sentence shortened to fit the block ("first words…") names an article sentence only
# when at least this many of its words are kept.
PREFIX_WORDS = 6

NO_CAP = sandbox.Limits(max_searches=10**9, max_deletes=10**9, max_tool_calls=10**9)
CAP_NOW = sandbox.Limits(max_tool_calls=0)  # the next call ends the episode, as a capped turn did
TAG = regex.compile(r"<[^<>]{0,200}>")
# What the sandbox never reads as summary text: tool blocks, an opening the token limit left
# unclosed (sandbox.DANGLING: the context ends inside it), then stray protocol tags (sandbox.MARKUP).
MARKUP = regex.compile(r"<results>.*?</results>|<search>.*?</search>|<delete\b[^<>]{0,64}/>|"
                       + sandbox.DANGLING.pattern + "|" + sandbox.MARKUP.pattern, regex.S)
RESULTS = regex.compile(r"<results>(.*?)</results>", regex.S)
ITEM = regex.compile(r"<(\d{1,3})>(.*?)</\1>", regex.S)


# ---------------------------------------------------------------------------
# The context the model saw
# ---------------------------------------------------------------------------


def replayed_context(ep: sandbox.Episode) -> tuple[str, str]:
    """(the final context after the prompt, the summary the replay gives): the episode's turns run
    again through the sandbox, one character a token, with its stored results, so deletes prune
    the text as they pruned the model's context. Caps end the replay where they ended the episode."""
    b = sandbox.EpisodeBuilder(ep.document, [], None, NO_CAP)
    for turn in ep.turns:
        if b.done:
            break
        for ch in turn.text:
            b.push(ord(ch))
        if turn.ended == "cap":
            b.limits = CAP_NOW
        b.end_turn("truncated" if turn.ended == "truncated" else None,
                   injected=turn.injected if turn.call else None)
    replayed = b.finish()
    return "".join(map(chr, b.context_ids())), replayed.summary


def summary_offsets(context: str) -> tuple[str, list[int]]:
    """The summary the sandbox reads out of `context` (markup removed, a tool block between two
    words read as a space, whitespace collapsed) and, for each of its characters, its offset in
    `context`."""
    chars: list[tuple[str, int]] = []
    pos, gap = 0, False
    for m in [*MARKUP.finditer(context), None]:
        end = m.start() if m else len(context)
        if end > pos:
            if gap and chars and not chars[-1][0].isspace() and not context[pos].isspace():
                chars.append((" ", pos))
            chars += [(context[i], i) for i in range(pos, end)]
            gap = False
        if m:
            gap, pos = gap or m.end() > m.start(), m.end()
    out, offs = [], []
    for ch, i in chars:
        if ch.isspace():
            if out and out[-1] != " ":
                out.append(" ")
                offs.append(i)
            continue
        out.append(ch)
        offs.append(i)
    if out and out[-1] == " ":
        out.pop()
        offs.pop()
    return "".join(out), offs


def context_words(text: str) -> int:
    """Words of a piece of context, protocol tags left out."""
    return len(textsplit.words(TAG.sub(" ", text)))


def result_sentences(context: str, article: list[str]) -> list[tuple[int, int, set[int]]]:
    """(start, end, article sentence indices) for every sentence of every results block in
    `context`: a sentence names the article sentences it equals, or, shortened with "…", those it
    is a prefix of when it keeps at least PREFIX_WORDS words."""
    clean = [s.replace("<", "‹").replace(">", "›") for s in article]
    out = []
    for block in RESULTS.finditer(context):
        for item in ITEM.finditer(context, block.start(1), block.end(1)):
            text = item.group(2).replace(sandbox.WORD_JOINER, "")
            hit = {i for i, s in enumerate(clean) if s == text}
            if not hit and text.endswith("…") and len(text[:-1].split()) >= PREFIX_WORDS:
                hit = {i for i, s in enumerate(clean) if s.startswith(text[:-1])}
            if hit:
                out.append((item.start(2), item.end(2), hit))
    return out


# ---------------------------------------------------------------------------
# Each summary sentence
# ---------------------------------------------------------------------------


@dataclass
class SentenceRecord:
    """One final-summary sentence: right or wrong, where its supporting fact stood."""
    text: str
    wrong: bool
    types: list[str]  # its oracle error types, one per label
    support: list[int]  # article sentence indices it is about (oracle_support)
    distance: int | None = None  # words back to the nearest supporting sentence; None: unsupported/unlocated
    source: str | None = None  # "search" | "article" | None
    bucket: str = UNSUPPORTED


def bucket_of(distance: int) -> str:
    """The BUCKETS label a distance in words falls in."""
    k = sum(distance >= a for a in BUCKET_STARTS) - 1
    return BUCKETS[max(k, 0)]


def sentence_records(doc: data.Document, ep: sandbox.Episode) -> list[SentenceRecord]:
    """A record per sentence of `ep.summary` (see the module docstring for the distance).

    A replay that does not give the stored summary back (the protocol changed since the
    evaluation) places no sentence: its supported sentences are counted `unlocated`, not guessed."""
    summary = ep.summary
    labels = oracle.oracle_errors(doc, summary)
    context, replayed = replayed_context(ep)
    read, offs = summary_offsets(context)
    located = replayed == summary and read == summary
    spans = textsplit.sentence_spans(doc.text)
    article = [doc.text[a:b] for a, b in spans]
    after = [len(textsplit.words(doc.text[b:])) for _, b in spans]  # article words after each sentence
    results = result_sentences(context, article) if located else []
    out = []
    for k, (a, b) in enumerate(textsplit.sentence_spans(summary)):  # the oracle's sentence indices
        text = summary[a:b]
        types = [e["type"] for e in labels if e["sentence_index"] == k]
        rec = SentenceRecord(text, bool(types), types, oracle.oracle_support(doc, text))
        out.append(rec)
        if not rec.support:
            continue
        if not located:
            rec.bucket = UNLOCATED
            continue
        start, end = offs[a], offs[b - 1] + 1
        before = context_words(context[:start])
        # (distance, tie-break: a search result wins, source)
        best = min(((after[i] + before, 1, "article") for i in rec.support if i < len(after)),
                   default=(None, 2, None))  # an index past the article: a fact table of another text
        for r0, r1, hit in results:
            if r0 < end and hit & set(rec.support):
                near = (context_words(context[r1:start]) if r1 <= start else 0, 0, "search")
                best = near if best[0] is None else min(best, near)
        rec.distance, _, rec.source = best
        rec.bucket = UNLOCATED if rec.distance is None else bucket_of(rec.distance)
    return out


# ---------------------------------------------------------------------------
# A run directory
# ---------------------------------------------------------------------------


@dataclass
class ModelTally:
    """The counts behind one model's tables."""
    baseline: bool = False
    episodes: int = 0
    sentences: int = 0
    wrong: int = 0
    by_bucket: Counter = field(default_factory=Counter)
    wrong_by_bucket: Counter = field(default_factory=Counter)
    by_source: Counter = field(default_factory=Counter)
    wrong_by_source: Counter = field(default_factory=Counter)
    types: Counter = field(default_factory=Counter)

    def add(self, records: list[SentenceRecord]) -> None:
        self.episodes += 1
        for r in records:
            self.sentences += 1
            self.wrong += r.wrong
            self.by_bucket[r.bucket] += 1
            self.wrong_by_bucket[r.bucket] += r.wrong
            if r.source:
                self.by_source[r.source] += 1
                self.wrong_by_source[r.source] += r.wrong
            self.types.update(r.types)

    def tables(self) -> dict:
        def share(k: int, n: int) -> float | None:
            return k / n if n else None

        def cells(n: Counter, k: Counter, keys) -> dict:
            return {b: {"sentences": n[b], "wrong": k[b], "wrong_share": share(k[b], n[b])} for b in keys}

        per100 = (lambda c: 100 * c / self.sentences) if self.sentences else (lambda c: None)
        types = [*oracle.ERROR_TYPES, UNSUPPORTED, *sorted(set(self.types) - {*oracle.ERROR_TYPES, UNSUPPORTED})]
        return {
            "baseline": self.baseline, "episodes": self.episodes, "sentences": self.sentences, "wrong": self.wrong,
            "wrong_share": share(self.wrong, self.sentences),
            "buckets": cells(self.by_bucket, self.wrong_by_bucket, [*BUCKETS, UNSUPPORTED, UNLOCATED]),
            "source": cells(self.by_source, self.wrong_by_source, SOURCES),
            "error_counts": {t: self.types[t] for t in types},
            "errors_per_100_sentences": {t: per100(self.types[t]) for t in types} | {"all": per100(
                sum(self.types.values()))},
        }


def read_run(run_dir) -> tuple[dict, dict[str, data.Document], Path]:
    """(eval.json, its documents by id, the episodes.jsonl path), with errors that name the file."""
    run = Path(run_dir)
    meta_path, episodes = run / "eval.json", run / "episodes.jsonl"
    for p in (meta_path, episodes):
        if not p.is_file():
            raise data.DataError(f"{p}: no such file (not an eval.py run directory, or one from before eval.py "
                                 "wrote episodes.jsonl: evaluate again)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        docs_path = meta["config"]["docs"]
    except (ValueError, KeyError, TypeError) as e:
        raise data.DataError(f"{meta_path}: not an eval.py result with config.docs ({e!r})") from None
    if not Path(docs_path).is_file():
        raise data.DataError(f"{meta_path}: config.docs={docs_path}: no such file (run from the directory "
                             "eval.py ran in)")
    return meta, {d.id: d for d in data.read_documents(docs_path)}, episodes


def error_breakdown(run_dir) -> dict[str, dict]:
    """{model: its tables} for an eval.py run directory, in eval.json's model order: sentences and
    wrong share per distance bucket (plus `unsupported`), per source of the nearest supporting
    sentence (a search result or only the article), and oracle errors by type (counts, and per 100
    summary sentences)."""
    meta, docs, path = read_run(run_dir)
    tally = {m["model"]: ModelTally(baseline=bool(m.get("baseline"))) for m in meta.get("models", [])}
    for lineno, row in data.jsonl_records(str(path)):
        where = f"{path}:{lineno}"
        try:
            model, doc_id = str(row["model"]), row["doc_id"]
            ep = sandbox.Episode.from_dict(row["episode"])
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise data.DataError(f"{where}: not an episode row of eval.py ({e!r})") from None
        doc = docs.get(doc_id)
        if doc is None:
            raise data.DataError(f"{where}: document {doc_id!r} is not in {meta['config']['docs']}")
        if not doc.facts:
            raise data.DataError(f"{where}: document {doc_id!r} has no fact table: the error analysis "
                                 "needs the news world's oracle")
        if ep.document != doc.text:
            raise data.DataError(f"{where}: the episode's article is not document {doc_id!r} of "
                                 f"{meta['config']['docs']} (was the file regenerated after the evaluation?)")
        tally.setdefault(model, ModelTally()).add(sentence_records(doc, ep))
    return {m: t.tables() for m, t in tally.items() if t.episodes}


def write_breakdown(run_dir) -> dict[str, dict]:
    """`error_breakdown(run_dir)`, also written to RUN_DIR/errors.json."""
    out = error_breakdown(run_dir)
    common.atomic_write_text(Path(run_dir) / "errors.json", json.dumps(out, indent=1) + "\n")
    return out


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def fmt(v) -> str:
    return "n/a" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def markdown_table(rows: dict[str, list], columns: list[str]) -> str:
    lines = ["| model | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {name} | " + " | ".join(map(fmt, cells)) + " |" for name, cells in rows.items()]
    return "\n".join(lines)


def markdown(breakdown: dict[str, dict]) -> str:
    """One table per measure, a row per model."""
    b = breakdown
    buckets = [*BUCKETS, UNSUPPORTED] + ([UNLOCATED] if any(t["buckets"][UNLOCATED]["sentences"]
                                                             for t in b.values()) else [])
    types = list(next(iter(b.values()))["errors_per_100_sentences"]) if b else []
    sections = [
        ("Summary sentences per distance to the supporting sentence (words)",
         {m: [t["buckets"][k]["sentences"] for k in buckets] for m, t in b.items()}, buckets),
        ("Wrong share per distance bucket",
         {m: [t["buckets"][k]["wrong_share"] for k in buckets] for m, t in b.items()}, buckets),
        ("Wrong share by where the nearest supporting sentence stood (sentences)",
         {m: [f"{fmt(t['source'][s]['wrong_share'])} ({t['source'][s]['sentences']})" for s in SOURCES]
          for m, t in b.items()}, ["in a search result", "only in the article"]),
        ("Oracle errors per 100 summary sentences, by type",
         {m: [t["errors_per_100_sentences"].get(k) for k in types] for m, t in b.items()}, types),
        ("Totals", {m: [t["episodes"], t["sentences"], t["wrong_share"]] for m, t in b.items()},
         ["episodes", "sentences", "wrong share"]),
    ]
    return "\n\n".join(f"## {title}\n\n{markdown_table(rows, cols)}" for title, rows, cols in sections) + "\n"

