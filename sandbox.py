"""The tool protocol (version 1): search and delete over one source document.

The single definition of how a summariser's tool calls behave, for every stage (synthetic traces,
SFT, rollouts, RL, eval); pure Python (stdlib, `regex`, `rank_bm25`), so anything can import it.

    python sandbox.py --doc examples/doc.txt --text examples/assistant.txt

replays an assistant output against a document and prints each turn, result, deletion and the summary.

The protocol is DESIGN.md section 2: `<search>QUERY</search>` (`/PATTERN/` or `/PATTERN/i` a regex,
anything else BM25 over the document's sentences) answers `<results><0>SENTENCE</0>...</results>`;
`<delete scope="sentence"/>` / `<delete scope="clause"/>` retracts the summary's last sentence / clause.

Interpretations this module fixes (where DESIGN.md is silent):
- A delete cuts the stream right after the last kept summary character; after the cut, text is
  dropped and tool blocks (the evidence) are re-appended in order, then the delete tag.
- A tool block between two pieces of text is a word boundary ("A.<search>..</results>B." is "A. B.").
- Every call counts towards the tool budget, failed ones included. Searches past `max_searches` get
  an error; a delete past `max_deletes` or any call past `max_tool_calls` ends the episode, flagged.
- Markup that is not a complete tool call is never summary text; it makes the episode invalid.
- Result sentences and error reasons have `<` and `>` replaced by `‹` and `›`.

Token exactness (DESIGN.md section 3) lives in `EpisodeBuilder`; `Episode.branches` turns an
episode into training sequences (DESIGN.md section 4).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import regex
from rank_bm25 import BM25Okapi

# split_sentences is a public entry point here (DESIGN.md section 10)
from factual_tools.textsplit import sentence_spans, split_sentences, words  # noqa: F401

PROTOCOL_VERSION = 1
EPISODE_VERSION = 1

SYSTEM_PROMPT = (  # what a chat model reads about the tools (the tiny template leaves it out: newsworld/tiny.py)
    "Summarise the article in a few factual sentences. <search>QUERY</search> finds its sentences "
    '(QUERY is /REGEX/ or keywords); <delete scope="sentence"/> or <delete scope="clause"/> '
    "retracts what you just wrote."
)

# ---------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    top_k: int = 3  # sentences per search
    result_tokens: int = 200  # budget of a whole <results> block, in the caller's length unit
    regex_timeout_s: float = 0.05  # time limit of one regex search call (compile + match)
    max_query_chars: int = 512  # longer queries are an error, not a slow search
    max_repeat_product: int = 10_000  # product of a regex's {n,m} bounds; nested counts blow up compile time
    max_searches: int = 8  # searches past this answer with an error
    max_deletes: int = 5  # the next delete call ends the episode (delete_cap)
    max_tool_calls: int = 16  # the next call of any kind ends the episode (tool_cap)

    @classmethod
    def make(cls, **kw) -> "Limits":
        names = {f.name for f in dataclasses.fields(cls)}
        for k in kw:
            if k not in names:
                import difflib

                near = difflib.get_close_matches(k, sorted(names), n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise TypeError(f"unknown sandbox limit {k!r}{hint} (valid: {', '.join(sorted(names))})")
        return cls(**kw)


# ---------------------------------------------------------------------------
# Search
# ---------------------------------------------------------------------------


def whitespace_length(text: str) -> int:
    """Default length function for the results budget: whitespace tokens."""
    return len(text.split())


def _clean(text: str) -> str:
    """`<` and `>` as `‹` and `›`, so a results block never holds markup other than its own tags."""
    return text.replace("<", "‹").replace(">", "›")


def results_block(sentences: Sequence[str]) -> str:
    return "<results>" + "".join(f"<{i}>{s}</{i}>" for i, s in enumerate(sentences)) + "</results>"


def error_block(reason: str) -> str:
    return f"<results><error>{_clean(reason)}</error></results>"


def fit_results(sentences: Sequence[str], budget: int, length_fn: Callable[[str], int]) -> tuple[str, int]:
    """The results block for `sentences` within `budget`, and how many were shortened.

    Every sentence keeps at least an ellipsis, so none is dropped silently: the
    longest ones are cut first to a common word count (water-filling), found by
    binary search. If even bare ellipses do not fit, they are returned anyway.
    """
    sentences = [_clean(s) for s in sentences]
    block = results_block(sentences)
    if not sentences or length_fn(block) <= budget:
        return block, 0
    toks = [s.split(" ") for s in sentences]

    def shortened(cap: int) -> list[str]:
        return [s if len(t) <= cap else " ".join(t[:cap]) + "…" for s, t in zip(sentences, toks)]

    lo, hi = 0, max(len(t) for t in toks) - 1  # cap=hi+1 is the full block, known too long
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if length_fn(results_block(shortened(mid))) <= budget:
            lo = mid
        else:
            hi = mid - 1
    parts = shortened(lo)
    return results_block(parts), sum(p != s for p, s in zip(parts, sentences))


@dataclass
class SearchResult:
    query: str
    mode: str  # "regex" | "bm25"
    hits: list[int]  # sentence indices, in the order shown
    error: str | None
    block: str  # the <results> block injected into the context
    shortened: int = 0  # sentences cut to fit the budget
    seconds: float = 0.0


# a counted repeat: {n}, {n,}, {n,m} and the regex module's {,m} (a missing lower bound is 0)
_REPEAT = regex.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def parse_query(query: str) -> tuple[str, str, int]:
    """('regex', pattern, flags) for /PATTERN/ or /PATTERN/i, else ('bm25', query, 0)."""
    q = query.strip()
    if len(q) >= 2 and q[0] == "/":
        if q.endswith("/i") and len(q) >= 3:
            return "regex", q[1:-2], regex.IGNORECASE
        if q.endswith("/"):
            return "regex", q[1:-1], 0
    return "bm25", q, 0


class DocIndex:
    """A document's sentences and BM25 index, built once and shared by every rollout."""

    def __init__(self, text: str):
        self.text = text
        self.spans = sentence_spans(text)
        self.sentences = [text[a:b] for a, b in self.spans]
        self.tokens = [words(s) for s in self.sentences]
        self._token_sets = [set(t) for t in self.tokens]
        # rank_bm25 divides by the mean sentence length: no words, no index.
        self._bm25 = BM25Okapi(self.tokens) if any(self.tokens) else None

    def search(self, query: str, top_k: int = 3, *, result_tokens: int = 200,
               length_fn: Callable[[str], int] | None = None, regex_timeout_s: float = 0.05,
               max_query_chars: int = 512, max_repeat_product: int = 10_000) -> SearchResult:
        t0 = time.perf_counter()
        length_fn = length_fn or whitespace_length
        mode, q, flags = parse_query(query)
        hits: list[int] = []
        error = None
        if len(query) > max_query_chars:
            error = f"query too long ({len(query)} characters, limit {max_query_chars})"
        elif not q:
            error = "empty query"
        elif mode == "regex":
            hits, error = self._regex(q, flags, top_k, regex_timeout_s, max_repeat_product)
        else:
            hits, error = self._bm25_search(q, top_k)
        if error:
            block, short = error_block(error), 0
        else:
            block, short = fit_results([self.sentences[i] for i in hits], result_tokens, length_fn)
        return SearchResult(query, mode, hits, error, block, short, time.perf_counter() - t0)

    def _regex(self, pattern: str, flags: int, top_k: int, timeout_s: float, max_repeat_product: int):
        # A full garbage collection in a process holding torch takes 50-120 ms: inside the
        # time limit it would fail a cheap search. The search allocates little, so the
        # collector waits until it is over.
        paused = gc.isenabled()
        gc.disable()
        try:
            return self._regex_timed(pattern, flags, top_k, timeout_s, max_repeat_product)
        finally:
            if paused:
                gc.enable()

    def _regex_timed(self, pattern: str, flags: int, top_k: int, timeout_s: float, max_repeat_product: int):
        deadline = time.perf_counter() + timeout_s
        # The time limit cannot interrupt compilation, and the regex module
        # expands counted repeats: (?:(?:a{255}){255}){255} compiles for ~18 s.
        # Bounding the product of all counts (nested or not) bounds that cost.
        product = 1
        for m in _REPEAT.finditer(pattern):
            product *= max([1] + [int(g) for g in m.groups() if g])
            if product > max_repeat_product:
                return [], f"bad pattern: repeat counts multiply to more than {max_repeat_product}"
        try:
            rx = regex.compile(pattern, flags)
        except Exception as e:  # regex.error, RecursionError, OverflowError, ...
            return [], f"bad pattern: {type(e).__name__}: {e}"[:200]
        hits = []
        for i, s in enumerate(self.sentences):
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return [], f"time limit ({timeout_s * 1000:.0f} ms)"
            try:
                found = rx.search(s, timeout=remaining)
            except TimeoutError:
                return [], f"time limit ({timeout_s * 1000:.0f} ms)"
            except Exception as e:
                return [], f"bad pattern: {type(e).__name__}: {e}"[:200]
            if found:
                hits.append(i)
                if len(hits) == top_k:
                    break
        return hits, None

    def _bm25_search(self, q: str, top_k: int):
        toks = words(q)
        if not toks:
            return [], "empty query"
        if self._bm25 is None:
            return [], None
        qset = set(toks)
        # A hit shares at least one word with the query; BM25 (Okapi) ranks hits.
        # rank_bm25's idf can be negative for words in most sentences, so a
        # score threshold would lose hits in short documents.
        cand = [i for i, ts in enumerate(self._token_sets) if qset & ts]
        if not cand:
            return [], None
        scores = self._bm25.get_batch_scores(toks, cand)
        order = sorted(range(len(cand)), key=lambda j: (-scores[j], cand[j]))
        return [cand[j] for j in order[:top_k]], None


@functools.lru_cache(maxsize=256)
def index_for(text: str) -> DocIndex:
    """A cached `DocIndex` (bounded), for callers that hold only the text."""
    return DocIndex(text)


# ---------------------------------------------------------------------------
# Stop detection and call parsing
# ---------------------------------------------------------------------------

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
_DELETE_TAG = regex.compile(r"<delete\b[^<>]{0,64}/>")
_DELETE_STRICT = regex.compile(r'<delete\s+scope\s*=\s*"([^"<>]*)"\s*/>')
_DELETE_SCOPE = regex.compile(r"""scope\s*=\s*["']?([^"'\s/>]*)""")
# Markup of this protocol anywhere in model-written text (never summary text).
MARKUP = regex.compile(r"</?\s*(?:search|results|delete|error)\b[^<>]{0,200}>|</?\d{1,3}>")
# An opening that was never closed when the text ended.
DANGLING = regex.compile(r"<\s*(?:search|results|delete|error)\b(?![^<>]*>)[^<>]*$|<search>(?!.*</search>).*$",
                          regex.S)
_MAX_TAG = 80  # longest tail to re-scan for a stop marker


def find_stop(text: str, start: int = 0) -> int | None:
    """End offset of the first tool call that completes at or after `start`.

    A call completes with `</search>` or with the `/>` that closes `<delete ...`.
    A streaming decoder passes `start` = length of the text before its newest
    piece, so each check scans only the tail.
    """
    lo = max(0, start - _MAX_TAG)
    ends = []
    i = text.find(SEARCH_CLOSE, max(0, start - len(SEARCH_CLOSE) + 1))
    if i >= 0:
        ends.append(i + len(SEARCH_CLOSE))
    for m in _DELETE_TAG.finditer(text, lo):
        if m.end() > start:
            ends.append(m.end())
            break
    return min(ends) if ends else None


@dataclass
class Call:
    kind: str  # "search" | "delete"
    start: int  # span of the call's markup in the turn text
    end: int
    arg: str | None  # the query, or the scope
    valid: bool  # well formed (syntax only: a bad regex is a valid call that errs)
    error: str | None = None  # what the sandbox answered, if it was an error
    deleted: str | None = None  # for a delete: the summary text it retracted
    hits: list[int] | None = None  # for a search: indices of the sentences it returned

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def parse_call(text: str, end: int) -> Call:
    """The call whose markup ends at `end` (as found by `find_stop`)."""
    if text.endswith(SEARCH_CLOSE, 0, end):
        close = end - len(SEARCH_CLOSE)
        open_ = text.rfind(SEARCH_OPEN, 0, close)
        if open_ < 0:
            return Call("search", close, end, None, False, "malformed search: </search> without <search>")
        query = text[open_ + len(SEARCH_OPEN):close]
        if MARKUP.search(query):
            return Call("search", open_, end, query, False, "malformed search: markup inside the query")
        return Call("search", open_, end, query, True)
    m = None
    for m in _DELETE_TAG.finditer(text, max(0, end - _MAX_TAG), end):
        pass
    assert m is not None and m.end() == end, "parse_call needs the end of a call"
    tag = m.group()
    strict = _DELETE_STRICT.fullmatch(tag)
    if strict:
        scope = strict.group(1)
        if scope in ("sentence", "clause"):
            return Call("delete", m.start(), end, scope, True)
        return Call("delete", m.start(), end, scope, False, f"unknown scope {scope!r} (use sentence or clause)")
    loose = _DELETE_SCOPE.search(tag)
    scope = loose.group(1) if loose else None
    return Call("delete", m.start(), end, scope, False, 'malformed delete: write <delete scope="sentence"/>')


# ---------------------------------------------------------------------------
# Tokenisers
# ---------------------------------------------------------------------------


WORD_JOINER = "\u2060"  # invisible; breaks a special-token string into plain text


def added_token_strings(tok) -> tuple[str, ...]:
    """The strings `tok` reads as one added token whatever surrounds them (<|im_end|>, <|eot|>, ...)."""
    found = {getattr(t, "content", t) for t in (getattr(tok, "added_tokens_decoder", None) or {}).values()}
    found |= set(getattr(tok, "all_special_tokens", None) or ())
    return tuple(sorted(t for t in found if isinstance(t, str) and len(t) >= 2))


@functools.lru_cache(maxsize=32)
def _added_token_re(tokens: tuple[str, ...]):
    return regex.compile("|".join(map(regex.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None


def inert(tok, text: str) -> str:
    """`text` with every added-token string broken by a word joiner after its first character.

    Outside text (a document, the search results quoted from it) is templated and
    encoded with special tokens parsed, so a document holding
    `<|im_end|><|im_start|>assistant` would otherwise forge a turn boundary. Text
    without such strings (every news-world document) is returned unchanged."""
    return _broken(_added_token_re(added_token_strings(tok)) if tok is not None and text else None, text)


def _broken(rx, text: str) -> str:
    """`text` with every match of `rx` broken by a word joiner after its first character."""
    while rx is not None and rx.search(text):  # again only where two strings overlapped
        text = rx.sub(lambda m: m[0][0] + WORD_JOINER + m[0][1:], text)
    return text


class Codec:
    """The few tokenizer operations the protocol needs, around an HF tokenizer.

    `piece(id)` (the text of one token, cached) is only used to spot stop markers
    while streaming; exact text and token boundaries come from `decode`.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}
        self._backend = plain_backend(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(map(int, ids)), skip_special_tokens=False)  # numpy or tensor ids too
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def piece(self, i: int) -> str:
        s = self._pieces.get(i)
        if s is None:
            s = self._pieces[i] = self.decode([i])
        return s

    def length(self, text: str) -> int:
        return len(self.encode(text))

    def inert(self, text: str) -> str:
        """`inert(tokenizer, text)`, the tokenizer's strings looked up once."""
        if self.tokenizer is None or not text:
            return text
        if not hasattr(self, "_inert_re"):
            self._inert_re = _added_token_re(added_token_strings(self.tokenizer))
        return _broken(self._inert_re, text)


class CharCodec(Codec):
    """One token per character: text-level replay runs through the same machinery."""

    def __init__(self):
        super().__init__(None)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(map(chr, ids))

    def piece(self, i: int) -> str:
        return chr(i)


def plain_backend(tokenizer):
    """The tokenizers-library object behind an HF fast tokenizer whose Python decode adds
    nothing to it when no special token is skipped and no space is cleaned up (None for any
    other): the same text without the wrapper's per-call conversion of the ids, which took
    a third of a tiny model's rollout time in the tokenizer (decoded once per token)."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:
        return None
    kind = type(tokenizer)
    plain = (isinstance(tokenizer, PreTrainedTokenizerFast) and kind.decode is PreTrainedTokenizerBase.decode
             and kind._decode is PreTrainedTokenizerFast._decode)
    return getattr(tokenizer, "backend_tokenizer", None) if plain else None


def as_codec(tok) -> Codec:
    if tok is None:
        return CharCodec()
    return tok if isinstance(tok, Codec) else Codec(tok)


def token_bounds(codec: Codec, ids: Sequence[int]) -> tuple[str, list[tuple[int, int]]]:
    """The text of `ids` and its clean token boundaries [(token index, char offset)].

    A boundary is clean when the ids before it decode to a prefix of the text
    (a token ending inside a multi-byte character gives none). Fast path: the
    pieces concatenate to the text (byte-level BPE); otherwise prefix decoding.
    """
    text = codec.decode(ids)
    pieces = [codec.piece(i) for i in ids]
    bounds = [(0, 0)]
    if "".join(pieces) == text and "\ufffd" not in text:
        off = 0
        for t, p in enumerate(pieces, 1):
            off += len(p)
            bounds.append((t, off))
        return text, bounds
    for t in range(1, len(ids) + 1):
        pre = codec.decode(ids[:t])
        if not pre.endswith("\ufffd") and text.startswith(pre) and len(pre) >= bounds[-1][1]:
            bounds.append((t, len(pre)))
    if bounds[-1] != (len(ids), len(text)):
        bounds.append((len(ids), len(text)))
    return text, bounds


# ---------------------------------------------------------------------------
# The token stream of one branch, and how a delete prunes it
# ---------------------------------------------------------------------------

TEXT, CALL, JUNK, INJ, PROMPT = "text", "call", "junk", "inj", "prompt"


@dataclass
class _Seg:
    """A run of ids in the current context with its text, character classes and
    clean token boundaries. Prompt, injected and re-encoded segments are atomic
    (boundaries only at their ends)."""
    ids: list[int]
    text: str
    cls: list[tuple[int, int, str]]  # (start, end, class) covering text
    bounds: list[tuple[int, int]]
    origin: tuple[int, int] | None = None  # (turn, offset in its text) of text[0], for generated text

    @classmethod
    def atomic(cls, ids, text, label=None, spans=None, origin=None) -> "_Seg":
        spans = spans if spans is not None else [(0, len(text), label)]
        return cls(list(ids), text, spans, [(0, 0), (len(ids), len(text))], origin)


def _shifted(origin: tuple[int, int] | None, by: int) -> tuple[int, int] | None:
    return None if origin is None else (origin[0], origin[1] + by)


def _classes_between(spans, a: int, b: int) -> list[tuple[int, int, str]]:
    """`spans` restricted to [a, b) and shifted to start at 0."""
    out = []
    for s, e, c in spans:
        s2, e2 = max(s, a), min(e, b)
        if s2 < e2:
            out.append((s2 - a, e2 - a, c))
    return out


def _sub(seg: _Seg, t1: int, o1: int, t2: int, o2: int) -> _Seg:
    """Tokens t1..t2 of `seg` (characters o1..o2), verbatim."""
    inner = [(t - t1, o - o1) for t, o in seg.bounds if t1 <= t <= t2 and o1 <= o <= o2]
    return _Seg(seg.ids[t1:t2], seg.text[o1:o2], _classes_between(seg.cls, o1, o2), inner, _shifted(seg.origin, o1))


def _reencode(codec: Codec, seg: _Seg, a: int, b: int) -> _Seg:
    text = seg.text[a:b]
    return _Seg.atomic(codec.encode(text), text, spans=_classes_between(seg.cls, a, b),
                       origin=_shifted(seg.origin, a))


def _last_bound(seg: _Seg, o: int) -> tuple[int, int]:
    """The last clean token boundary at or before character o."""
    best = (0, 0)
    for t, off in seg.bounds:
        if off <= o and t >= best[0]:
            best = (t, off)
    return best


def _slice(codec: Codec, seg: _Seg, a: int, b: int) -> list[_Seg]:
    """Characters [a, b) of `seg` as segments: the tokens wholly inside are kept
    verbatim, partial tokens at the edges are re-encoded (context only)."""
    if a >= b:
        return []
    if a == 0 and b == len(seg.text):
        return [seg]
    left = next(((t, o) for t, o in seg.bounds if o >= a), None)
    right = _last_bound(seg, b)
    if left is None or left[1] >= right[1]:
        return [_reencode(codec, seg, a, b)]
    out = [_reencode(codec, seg, a, left[1])] if a < left[1] else []
    out.append(_sub(seg, *left, *right))
    if right[1] < b:
        out.append(_reencode(codec, seg, right[1], b))
    return out


class _Stream:
    """The current context of one rollout as segments (prompt first)."""

    def __init__(self, prompt: _Seg):
        self.segs = [prompt]

    def append(self, seg: _Seg) -> None:
        self.segs.append(seg)

    def ids(self) -> list[int]:
        return [i for s in self.segs for i in s.ids]

    def summary_runs(self, until: tuple[int, int] | None = None) -> tuple[str, list[tuple[int, int, int, int]]]:
        """The summary so far (up to stream position `until`, if given), and runs
        (summary start, summary end, seg, char) mapping it back to the stream.
        Any markup between two text runs reads as a space."""
        parts: list[str] = []
        runs = []
        n = 0
        gap = False
        for k, seg in enumerate(self.segs):
            if until and k > until[0]:
                break
            for s, e, c in seg.cls:
                if until and k == until[0]:
                    e = min(e, until[1])
                if c != TEXT:
                    gap = gap or e > s
                    continue
                piece = seg.text[s:e]
                if not piece:
                    continue
                if gap and parts and not parts[-1][-1:].isspace() and not piece[:1].isspace():
                    parts.append(" ")
                    n += 1
                runs.append((n, n + len(piece), k, s))
                parts.append(piece)
                n += len(piece)
                gap = False
        return "".join(parts), runs

    def retracted(self, cut: tuple[int, int], tag_seg: int, tag_start: int) -> list[tuple[int, int, int]]:
        """(turn, start, end): the generated summary text between the cut and the
        delete tag, as character ranges of the turns that wrote it."""
        k, o = cut
        out = []
        for j in range(k, tag_seg + 1):
            seg = self.segs[j]
            if seg.origin is None:
                continue
            lo = o if j == k else 0
            hi = tag_start if j == tag_seg else len(seg.text)
            for s, e, c in seg.cls:
                a, b = max(s, lo), min(e, hi)
                if c == TEXT and a < b:
                    out.append((seg.origin[0], seg.origin[1] + a, seg.origin[1] + b))
        return out

    def prune(self, codec: Codec, cut: tuple[int, int], tag_seg: int, tag_start: int) -> tuple[int, list[int]]:
        """Cut the stream at (seg, char); after the cut keep only the evidence
        (tool calls and results, in order), then the delete tag (segment
        `tag_seg` from `tag_start` to its end, the stopping token's extra text
        included). The policy never sees the retracted text again, but keeps what it searched for.

        Returns (ids kept from the old stream, ids appended after them)."""
        k, o = cut
        old = self.segs
        head = old[:k]
        keep = sum(len(s.ids) for s in head)
        tail: list[_Seg] = []
        if o > 0:
            t, off = _last_bound(old[k], o)
            if t > 0:
                head.append(_sub(old[k], 0, 0, t, off))
            keep += t
            if off < o:
                tail.append(_reencode(codec, old[k], off, o))
        for j in range(k, tag_seg + 1):
            seg = old[j]
            lo = o if j == k else 0
            hi = tag_start if j == tag_seg else len(seg.text)
            for s, e, c in seg.cls:
                if c in (CALL, INJ):
                    tail += _slice(codec, seg, max(s, lo), min(e, hi))
        tail += _slice(codec, old[tag_seg], tag_start, len(old[tag_seg].text))
        self.segs = head + tail
        return keep, [i for s in tail for i in s.ids]


def _clause_cut(s: str, a: int, b: int) -> int | None:
    """Offset just after the last clause boundary of s[a:b] that has words after it."""
    best = None
    for m in regex.finditer(r"[,;:](?=\s)|[—–]|\s-(?=\s)", s[a:b]):
        after = s[a + m.end():b]
        if regex.search(r"\w", after):
            best = a + m.end()
    return best


# ---------------------------------------------------------------------------
# Episodes
# ---------------------------------------------------------------------------


@dataclass
class Turn:
    """One generation turn: what the policy wrote until it stopped, and the answer.

    `text` is the generated text (end-of-turn token excluded), `call` the tool
    call that ended it (None for end-of-turn or truncation), `injected` the text
    appended after it (a results or error block; "" after a successful delete).
    Token fields are present for sampled episodes: `ids` (end-of-turn id
    included), sampler `logprobs`, `inj_ids`, for a delete `prune` = (ids of
    the old context kept, ids appended after them), and `masked`: indices of
    the ids that hold text a later delete retracted (error-masked training
    leaves them out of the loss; see `Episode.branches`).
    """
    text: str
    call: Call | None = None
    injected: str = ""
    ended: str = "eos"  # "call" | "eos" | "truncated" | "cap"
    ids: list[int] | None = None
    logprobs: list[float] | None = None
    inj_ids: list[int] | None = None
    prune: tuple[int, list[int]] | None = None
    masked: list[int] | None = None

    def to_dict(self) -> dict:
        d = {"text": self.text, "call": self.call.to_dict() if self.call else None,
             "injected": self.injected, "ended": self.ended}
        if self.ids is not None:
            d.update(ids=self.ids, logprobs=self.logprobs, inj_ids=self.inj_ids,
                     prune=[self.prune[0], self.prune[1]] if self.prune else None, masked=self.masked)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Turn":
        call = Call(**d["call"]) if d.get("call") else None
        prune = d.get("prune")
        return cls(d["text"], call, d.get("injected", ""), d.get("ended", "eos"), d.get("ids"),
                   d.get("logprobs"), d.get("inj_ids"), (prune[0], list(prune[1])) if prune else None,
                   d.get("masked"))


@dataclass
class Branch:
    """One training sequence: generated ids have loss_mask 1, everything else 0.
    `turns` maps back: (turn index, start, end) of that turn's generated ids."""
    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]  # sampler log-probs at generated positions, nan elsewhere
    turns: list[tuple[int, int, int]]


@dataclass
class Episode:
    document: str
    turns: list[Turn] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    summary: str = ""
    flags: dict = field(default_factory=dict)  # truncated, delete_cap, tool_cap, dangling, junk
    doc_id: str | None = None
    meta: dict = field(default_factory=dict)  # provenance (drafter, annotator, cost, ...)

    @property
    def calls(self) -> list[Call]:
        return [t.call for t in self.turns if t.call]

    @property
    def n_search(self) -> int:
        return sum(c.kind == "search" for c in self.calls)

    @property
    def n_delete(self) -> int:
        return sum(c.kind == "delete" for c in self.calls)

    @property
    def n_deleted(self) -> int:
        """Deletes that retracted something."""
        return sum(c.kind == "delete" and c.valid and not c.error for c in self.calls)

    @property
    def valid(self) -> bool:
        """Well-formed tool use: every call well formed, no stray or dangling markup."""
        return all(c.valid for c in self.calls) and not self.flags.get("junk") and not self.flags.get("dangling")

    @property
    def has_ids(self) -> bool:
        return self.prompt_ids is not None and all(t.ids is not None for t in self.turns)

    @property
    def text(self) -> str:
        """The assistant output as the policy wrote it, results included."""
        return "".join(t.text + t.injected for t in self.turns)

    # -- token views -------------------------------------------------------

    def tokenized(self, tokenizer, eos_id: int | None = None) -> "Episode":
        """This episode with token ids: itself if it has them (sampled ids are
        never re-encoded), else the canonical tokenisation of its text: the prompt
        from the chat template, each turn's text encoded on its own (its summary
        text and its call markup apart), the stored
        results encoded on their own, deletes pruned by the same `EpisodeBuilder`
        the rollout engine uses, end-of-turn appended to a finished last turn."""
        if self.has_ids:
            return self
        codec = as_codec(tokenizer)
        if eos_id is None:
            eos_id = getattr(tokenizer, "eos_token_id", None)
        prompt = self.prompt_ids if self.prompt_ids is not None else prompt_ids(tokenizer, self.document)
        b = EpisodeBuilder(self.document, prompt, codec, eos_ids=[eos_id] if eos_id is not None else [],
                           doc_id=self.doc_id)
        for turn in self.turns:
            # The summary text and the call markup are encoded apart, so no id holds
            # both (a merged ".<" would tie the search decision to the sentence before it,
            # and error masking, which drops retracted text, would drop the markup with it).
            cut = turn.call.start if turn.call else len(turn.text)
            ids = codec.encode(turn.text[:cut]) + codec.encode(turn.text[cut:])
            if turn.ended == "eos" and eos_id is not None:
                ids.append(eos_id)
            for i in ids:
                b.push(i)
            b.end_turn("truncated" if turn.ended == "truncated" else None,
                       injected=turn.injected if turn.call else None)
        ep = b.finish()
        ep.meta = dict(self.meta)
        return ep

    def contexts(self) -> list[list[int]]:
        """The context ids each turn was generated under (needs token ids)."""
        assert self.has_ids, "contexts() needs a tokenized episode (see tokenized())"
        ctx = list(self.prompt_ids)
        out = []
        for t in self.turns:
            out.append(ctx)
            stream = ctx + t.ids + (t.inj_ids or [])
            ctx = stream[:t.prune[0]] + t.prune[1] if t.prune else stream
        return out

    def branches(self, tokenizer=None, eos_id: int | None = None, mask_retracted: bool = False) -> list[Branch]:
        """Training sequences (DESIGN.md section 4): consecutive turns whose
        contexts extend each other form one branch; a delete starts a new branch
        whose prefix is the pruned context. Each generated id has loss mask 1 in
        exactly the branch it was generated in; with `mask_retracted`, 0 where
        it holds text a later delete retracted (`Turn.masked`): the error is
        context for the search and delete after it, not a target."""
        ep = self.tokenized(tokenizer, eos_id) if not self.has_ids else self
        out: list[Branch] = []
        cur: Branch | None = None
        for i, (ctx, t) in enumerate(zip(ep.contexts(), ep.turns)):
            if cur is None or cur.input_ids != ctx:
                cur = Branch(list(ctx), [0] * len(ctx), [math.nan] * len(ctx), [])
                out.append(cur)
            start = len(cur.input_ids)
            lp = t.logprobs if t.logprobs is not None else [math.nan] * len(t.ids)
            cur.input_ids += t.ids
            masked = set(t.masked or ()) if mask_retracted else ()
            cur.loss_mask += [0 if j in masked else 1 for j in range(len(t.ids))]
            cur.logprobs += list(lp)
            cur.turns.append((i, start, start + len(t.ids)))
            inj = t.inj_ids or []
            cur.input_ids += inj
            cur.loss_mask += [0] * len(inj)
            cur.logprobs += [math.nan] * len(inj)
        for b in out:  # nothing after the last generated id is ever trained on
            end = b.turns[-1][2] if b.turns else 0
            del b.input_ids[end:], b.loss_mask[end:], b.logprobs[end:]
        return [b for b in out if b.turns]

    # -- serialisation -----------------------------------------------------

    def to_dict(self) -> dict:
        return {"version": EPISODE_VERSION, "doc_id": self.doc_id, "document": self.document,
                "prompt_ids": self.prompt_ids, "turns": [t.to_dict() for t in self.turns],
                "summary": self.summary, "flags": self.flags, "meta": self.meta,
                "n_search": self.n_search, "n_delete": self.n_delete, "valid": self.valid}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False)

    @classmethod
    def from_dict(cls, d: dict) -> "Episode":
        v = d.get("version")
        if v != EPISODE_VERSION:
            raise ValueError(f"episode version {v!r} is not supported (expected {EPISODE_VERSION})")
        return cls(d["document"], [Turn.from_dict(t) for t in d["turns"]], d.get("prompt_ids"),
                   d.get("summary", ""), d.get("flags", {}), d.get("doc_id"), d.get("meta", {}))

    @classmethod
    def from_json(cls, s: str | dict) -> "Episode":
        return cls.from_dict(json.loads(s) if isinstance(s, str) else s)


class MaskError(ValueError):
    """Loss-mask positions that are not exactly the assistant's generated text."""


def check_branches(ep: Episode, branches: list[Branch], tokenizer, eos_ids: Iterable[int] = ()) -> None:
    """Mask validation (a classic silent bug: loss masks drifting past assistant
    boundaries). Every run of loss-mask-1 positions must be exactly one turn's
    generated ids and decode to that turn's text: a shift by one position pulls
    in a prompt, results or re-encoded id and changes the text. Raises
    `MaskError` naming the episode, branch and turn."""
    codec = as_codec(tokenizer)
    eos = set(eos_ids) | ({tokenizer.eos_token_id} if getattr(tokenizer, "eos_token_id", None) is not None else set())
    name = ep.doc_id or "episode"
    for bi, b in enumerate(branches):
        runs, start = [], None
        for pos, m in enumerate(b.loss_mask + [0]):
            if m and start is None:
                start = pos
            elif not m and start is not None:
                runs.append((start, pos))
                start = None
        spans = [(s, e) for _, s, e in b.turns if e > s]
        if runs != spans:
            # Error masking (`branches(mask_retracted=True)`) leaves out exactly the masked ids.
            want = {s + j for ti, s, e in b.turns for j in range(e - s) if j not in set(ep.turns[ti].masked or ())}
            got = {p for p, m in enumerate(b.loss_mask) if m}
            masked_run = want == got and any(ep.turns[ti].masked for ti, _, _ in b.turns)
            if not masked_run:
                raise MaskError(f"{name} branch {bi}: trained positions {runs[:4]} are not the turns' generated "
                                f"ids {spans[:4]}")
        for ti, s, e in b.turns:
            ids = [i for i in b.input_ids[s:e] if i not in eos]
            text = codec.decode(ids)
            turn = ep.turns[ti]
            if text != turn.text:
                raise MaskError(f"{name} branch {bi} turn {ti}: trained ids decode to {text[:80]!r}, "
                                f"the turn wrote {turn.text[:80]!r}")
            if any(i in eos for i in b.input_ids[s:e - 1]):
                raise MaskError(f"{name} branch {bi} turn {ti}: end-of-turn inside the trained ids")


def read_episodes(path: str, skip_bad: bool = False) -> list[Episode]:
    """Episodes from a JSONL file; a malformed line is an error naming the file
    and line (with `skip_bad`, it is skipped and counted in the returned list's
    `.skipped` attribute)."""
    out = _EpisodeList()
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Episode.from_json(line))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                if not skip_bad:
                    raise ValueError(f"{path}:{n}: not an episode ({type(e).__name__}: {e})") from None
                out.skipped += 1
    return out


class _EpisodeList(list):
    skipped = 0


def decision_turns(ep: Episode) -> list[bool]:
    """Per turn, whether its first id is a decision: the turn right after a search
    that was answered (delete, or write on). SFT weighs these ids (`decision_weight`);
    eval's decision probe scores them."""
    out, prev = [], None
    for t in ep.turns:
        out.append(prev is not None and prev.call is not None and prev.call.kind == "search" and prev.call.valid)
        prev = t
    return out


def tool_stats(episodes: Sequence[Episode]) -> dict[str, float]:
    """Tool use of a set of episodes: call validity (syntax), episode validity,
    searches and deletes per episode, and errors the sandbox answered."""
    calls = [c for e in episodes for c in e.calls]
    n = max(1, len(episodes))
    return {
        "valid_call_rate": sum(c.valid for c in calls) / len(calls) if calls else float("nan"),
        "valid_episode_rate": sum(e.valid for e in episodes) / n,
        "calls_per_episode": len(calls) / n,
        "searches_per_episode": sum(e.n_search for e in episodes) / n,
        "deletes_per_episode": sum(e.n_delete for e in episodes) / n,
        "tool_error_rate": sum(bool(c.error) for c in calls) / len(calls) if calls else 0.0,
        "truncated_rate": sum(bool(e.flags.get("truncated")) for e in episodes) / n,
    }


def prompt_messages(document: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Summarise this article.\n\n{document}"}]


def prompt_ids(tokenizer, document: str) -> list[int]:
    """The chat-formatted prompt ids every stage uses (generation prompt added)."""
    tok = tokenizer.tokenizer if isinstance(tokenizer, Codec) else tokenizer
    messages = prompt_messages(inert(tok, document))  # a forged turn boundary stays text
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------------------
# The builder: one rollout, one token at a time
# ---------------------------------------------------------------------------


@dataclass
class Action:
    """What the engine does after a turn: `append` ids; `prune`: keep the first
    `keep` ids of the current context and append `ids`; `done`: stop the row."""
    kind: str
    ids: list[int] = field(default_factory=list)
    keep: int = 0


class EpisodeBuilder:
    """Runs one episode through the sandbox, driven one generated token at a time.

        b = EpisodeBuilder(doc, prompt_ids, tokenizer, limits=..., eos_ids=[eos])
        for each sampled token:  if b.push(tok, logprob): action = b.end_turn()
        at the token limit:      b.end_turn("truncated")
        b.finish() -> Episode

    `b.context_ids()` is the context the next token is conditioned on; the engine
    keeps its KV cache equal to it by applying each Action.
    """

    def __init__(self, document: str | DocIndex, prompt_ids: Sequence[int] | None = None, tokenizer=None,
                 limits: Limits | None = None, *, length_fn: Callable[[str], int] | None = None,
                 eos_ids: Iterable[int] = (), doc_id: str | None = None, prompt_text: str = ""):
        self.index = document if isinstance(document, DocIndex) else index_for(document)
        self.codec = as_codec(tokenizer)
        self.limits = limits or Limits()
        self.length_fn = length_fn or (whitespace_length if isinstance(self.codec, CharCodec) else self.codec.length)
        self.eos_ids = set(eos_ids)
        prompt = list(prompt_ids) if prompt_ids is not None else self.codec.encode(prompt_text)
        self.stream = _Stream(_Seg.atomic(prompt, prompt_text, PROMPT))
        self.episode = Episode(self.index.text, [], prompt, doc_id=doc_id)
        self.done = False
        self._ids: list[int] = []
        self._lps: list[float] = []
        self._tail = ""
        self._stopped = False
        self._bounds: list[list[tuple[int, int]]] = []  # clean token boundaries of each turn's ids

    # streaming -----------------------------------------------------------

    def push(self, token_id: int, logprob: float | None = None) -> bool:
        """Add one generated token; True when the turn should end (end-of-turn
        token, or a tool call just completed)."""
        self._ids.append(token_id)
        if logprob is not None:
            self._lps.append(float(logprob))
        if token_id in self.eos_ids:
            self._stopped = True
            return True
        piece = self.codec.piece(token_id)
        start = len(self._tail)
        self._tail += piece
        if not self._stopped and find_stop(self._tail, start) is not None:
            self._stopped = True
        if len(self._tail) > 4 * _MAX_TAG:
            self._tail = self._tail[-2 * _MAX_TAG:]
        return self._stopped

    def context_ids(self) -> list[int]:
        return self.stream.ids() + self._ids

    # turn end --------------------------------------------------------------

    def end_turn(self, reason: str | None = None, injected: str | None = None) -> Action:
        """Close the current turn and run its tool call.

        `reason` overrides how the turn ended ("truncated" at the token limit);
        `injected` replays a stored results block instead of searching (used by
        canonical tokenisation of text-only traces)."""
        assert not self.done, "the episode is finished"
        ids, lps = self._ids, self._lps
        self._ids, self._lps, self._tail, self._stopped = [], [], "", False
        eos = bool(ids) and ids[-1] in self.eos_ids
        text, bounds = token_bounds(self.codec, ids[:-1] if eos else ids)
        if eos:
            bounds.append((len(ids), len(text)))
        stop = None if eos else find_stop(text)
        call = parse_call(text, stop) if stop is not None else None
        truncated = reason == "truncated"
        ended = "truncated" if truncated else "call" if call else "eos"
        ep = self.episode
        seg = _Seg(list(ids), text, self._classes(text, call, final=call is None), bounds, (len(ep.turns), 0))
        turn = Turn(text, call, "", ended, list(ids), lps if len(lps) == len(ids) else None, [], None)
        self._bounds.append(bounds)
        ep.turns.append(turn)
        self.stream.append(seg)
        if call is None or truncated:  # out of tokens: a completed call is recorded, not run
            self.done = True
            if truncated:
                ep.flags["truncated"] = True
            return self._finish_action()
        n_calls = len(ep.calls)
        if n_calls > self.limits.max_tool_calls:
            return self._cap(turn, "tool_cap")
        if call.kind == "delete" and ep.n_delete > self.limits.max_deletes:
            return self._cap(turn, "delete_cap")
        if call.kind == "delete" and call.valid:
            keep_new = self._delete(call, len(self.stream.segs) - 1)
            if keep_new is not None:
                turn.prune = keep_new
                turn.inj_ids = []
                return Action("prune", list(keep_new[1]), keep_new[0])
        if call.kind == "search" and call.valid and injected is None:
            if ep.n_search > self.limits.max_searches:
                call.error = f"search limit reached ({self.limits.max_searches})"
                injected = error_block(call.error)
            else:
                lim = self.limits
                res = self.index.search(call.arg, lim.top_k, result_tokens=lim.result_tokens, length_fn=self.length_fn,
                                        regex_timeout_s=lim.regex_timeout_s, max_query_chars=lim.max_query_chars,
                                        max_repeat_product=lim.max_repeat_product)
                call.error, call.hits = res.error, res.hits
                injected = res.block
        elif injected is None:
            injected = error_block(call.error or "malformed call")
        elif call.kind == "search" and injected.startswith("<results><error>"):
            call.error = call.error or injected[len("<results><error>"):-len("</error></results>")]
        injected = self.codec.inert(injected)  # results quote the document: its special-token strings stay text
        inj_ids = self.codec.encode(injected)
        turn.injected, turn.inj_ids = injected, inj_ids
        self.stream.append(_Seg.atomic(inj_ids, injected, INJ))
        return Action("append", inj_ids)

    def _cap(self, turn: Turn, flag: str) -> Action:
        turn.ended = "cap"
        self.episode.flags[flag] = True
        self.done = True
        return self._finish_action()

    def _finish_action(self) -> Action:
        self.episode.summary = self.summary()
        return Action("done")

    def _classes(self, text: str, call: Call | None, final: bool) -> list[tuple[int, int, str]]:
        """Character classes of a turn's text: summary text, the call, junk markup."""
        spans: list[tuple[int, int, str]] = []
        body_end = call.start if call else len(text)
        pos = 0
        junk = list(MARKUP.finditer(text, 0, body_end))
        if final:
            d = DANGLING.search(text, 0, body_end)
            if d:
                junk = [m for m in junk if m.start() < d.start()] + [d]
                self.episode.flags["dangling"] = True
        for m in junk:
            if m.start() < pos:
                continue
            if m.start() > pos:
                spans.append((pos, m.start(), TEXT))
            spans.append((m.start(), m.end(), JUNK))
            self.episode.flags["junk"] = self.episode.flags.get("junk", 0) + 1
            pos = m.end()
        if body_end > pos:
            spans.append((pos, body_end, TEXT))
        if call:
            spans.append((call.start, call.end, CALL))
            if call.end < len(text):
                spans.append((call.end, len(text), TEXT))  # extra characters of the stopping token
        return spans

    def _delete(self, call: Call, tag_seg: int) -> tuple[int, list[int]] | None:
        """Apply a delete; None (and an error on the call) if there is nothing to delete."""
        # The summary before the tag (the stopping token may carry text after it).
        summary, runs = self.stream.summary_runs(until=(tag_seg, call.start))
        sentences = sentence_spans(summary)
        if not sentences:
            call.error = "nothing to delete"
            return None
        a, b = sentences[-1]
        c = _clause_cut(summary, a, b) if call.arg == "clause" else None
        if c is None:
            # A sentence delete also drops the whitespace before the sentence, so the cut usually falls on a
            # token boundary of space-prefixed BPE vocabularies; a clause cut keeps its punctuation ("In 2019,").
            c = len(summary[:a].rstrip())
        call.deleted = summary[c:].strip()
        cut = self._locate(c, runs)
        for t, a, b in self.stream.retracted(cut, tag_seg, call.start):
            self._mask(t, a, b)
        return self.stream.prune(self.codec, cut, tag_seg, call.start)

    def _mask(self, t: int, a: int, b: int) -> None:
        """Mark the ids of turn t that hold any of its characters a..b-1 (a token
        between two clean boundaries counts as a whole)."""
        turn = self.episode.turns[t]
        hit = set(turn.masked or ())
        bounds = self._bounds[t]
        for (t0, o0), (t1, o1) in zip(bounds, bounds[1:]):
            if o0 < b and a < o1:
                hit.update(range(t0, t1))
        turn.masked = sorted(hit)

    def _locate(self, c: int, runs) -> tuple[int, int]:
        """Stream position (seg, char) just after summary character c-1."""
        if c == 0:
            return (1, 0)  # right after the prompt
        for s0, s1, k, ch in runs:
            if s0 < c <= s1:
                return (k, ch + (c - s0))
        # c fell on a separator space between runs: cut after the previous run
        prev = [r for r in runs if r[1] <= c][-1]
        return (prev[2], prev[3] + (prev[1] - prev[0]))

    # results ---------------------------------------------------------------

    def summary(self) -> str:
        text, _ = self.stream.summary_runs()
        # Markup can still form across turns ("<" carried by a stopping token,
        # then "search>"): it is never summary text, and it is a format error.
        clean = DANGLING.sub(" ", MARKUP.sub(" ", text))
        if clean != text:
            self.episode.flags["junk"] = self.episode.flags.get("junk", 0) + 1
        return " ".join(clean.split())

    def finish(self) -> Episode:
        """The finished episode (an unfinished turn ends as if at end-of-turn)."""
        if not self.done:
            self.end_turn("eos")
        return self.episode


# ---------------------------------------------------------------------------
# Replay of a complete assistant output
# ---------------------------------------------------------------------------

_STALE = regex.compile(r"\s*<results>.*?</results>", regex.S)


def replay(document: str, assistant_text: str, length_fn: Callable[[str], int] | None = None,
           **limits) -> Episode:
    """Run a complete assistant output through the sandbox in order, as if the
    tools had answered live. Results blocks the text carries right after a call
    (stale or absent) are replaced by live ones. Returns a text-only Episode."""
    lim = Limits.make(**limits)
    b = EpisodeBuilder(document, [], None, lim, length_fn=length_fn)
    i, n = 0, len(assistant_text)
    while i < n and not b.done:
        if b.push(ord(assistant_text[i])):
            i += 1
            b.end_turn()
            m = _STALE.match(assistant_text, i)
            if m:
                i = m.end()
            continue
        i += 1
    ep = b.finish()
    for t in ep.turns:  # character ids are not a tokenisation: keep the text record only
        t.ids = t.logprobs = t.inj_ids = t.prune = t.masked = None
    ep.prompt_ids = None
    return ep


def describe(ep: Episode) -> str:
    """A human-readable account of an episode."""
    lines = []
    for i, t in enumerate(ep.turns):
        lines.append(f"--- turn {i} ({t.ended})")
        lines.append(f"  wrote: {t.text!r}")
        if t.call:
            c = t.call
            state = "ok" if c.valid and not c.error else f"error: {c.error}"
            lines.append(f"  call: {c.kind} {c.arg!r} [{state}]")
        if t.injected:
            lines.append(f"  results: {t.injected}")
    lines.append(f"=== summary ({ep.n_search} searches, {ep.n_delete} deletes, valid={ep.valid}, "
                 f"flags={ep.flags or '{}'})")
    lines.append(ep.summary)
    return "\n".join(lines)


def _read_document(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        raw = f.read()
    if path.endswith((".json", ".jsonl")):
        line = raw.strip().splitlines()[0] if raw.strip() else ""
        try:
            return json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SystemExit(f"{path}:1: expected a JSON object with a 'text' field ({e})")
    return raw


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="Replay an assistant output against a document.")
    p.add_argument("--doc", required=True, help="document: a text file, or JSON/JSONL with a 'text' field")
    p.add_argument("--text", required=True, help="assistant output (with tool calls) as a text file")
    p.add_argument("--json", action="store_true", help="print the episode as JSON instead")
    for f in dataclasses.fields(Limits):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    args = p.parse_args(argv)
    doc = _read_document(args.doc)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    ep = replay(doc, text, **{f.name: getattr(args, f.name) for f in dataclasses.fields(Limits)})
    print(ep.to_json() if args.json else describe(ep))


if __name__ == "__main__":
    main()
