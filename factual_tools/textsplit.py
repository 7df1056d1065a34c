"""Words and sentences, as the tool protocol counts them: `words`, `sentence_spans`, `split_sentences`.

One sentence splitter for every stage (the sandbox's search index and deletes,
the rewards, the news world's oracle), so a "sentence" means the same thing
everywhere. Abbreviations, initials and decimals do not end a sentence; list
items and blank lines do. Stdlib and `regex` only.
"""
from __future__ import annotations

import regex


# ---------------------------------------------------------------------------
# Words and sentences
# ---------------------------------------------------------------------------

_WORD_RE = regex.compile(r"\w+(?:[.,'’]\w+)*")


def words(text: str) -> list[str]:
    """The lower-cased word tokeniser used everywhere (BM25, rewards, filters).

    Keeps numbers with inner separators whole ("4.2", "3,400") and contractions.
    """
    return _WORD_RE.findall(text.lower())


# Words whose trailing period is not a sentence end.
_ABBREV = frozenset(
    "mr mrs ms dr prof sen rep gov gen lt col capt sgt cpl maj adm cmdr rev hon pres supt st jr sr mt ft "
    "vs etc approx dept est fig al jan feb mar apr jun jul aug sep sept oct nov dec e.g i.e a.m p.m".split()
)
# Words whose period may or may not end a sentence: it does when a typical
# sentence opener follows ("... joined Acme Inc. The company ...").
_MAYBE_END = frozenset("inc corp co ltd llc plc bros u.s u.k u.n e.u d.c".split())
_OPENERS = frozenset(
    "the a an it its he she they we i this that these those his her their our in on at but and however "
    "shares analysts officials meanwhile after before when while there as for by with according last next "
    "earlier later then also both some many most one two if so yet".split()
)
# One run of terminators, matched only from its first character and never given
# back: the older `(?:\.\.\.|…|[.!?])+` backtracked exponentially on a run of dots
# that no space follows (a sampled policy wrote one: 50 dots took 84 s).
_TERMINATOR = regex.compile(r"(?<![.!?…])[.!?…]++[\"'”’)\]»]*+(?=\s|$)")
_BLOCK_BREAK = regex.compile(r"\n[ \t]*\n\s*|\n(?=[ \t]*(?:[-*•▪]|\d{1,2}[.)])\s)")
_PREV_WORD = regex.compile(r"([\w&'’-]+(?:\.[\w&'’-]+)*)$")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the sentences of `text`, whitespace excluded.

    Handles abbreviations (Mr., Dr., Jan.), initials (J. K. Rowling), decimals and
    money ($4.2 billion), initialisms and corporate suffixes (U.S., Inc.) that may
    or may not end a sentence, closing quotes and brackets after the period,
    ellipses, blank lines and bullets. Unfinished trailing text is a sentence.
    """
    spans: list[tuple[int, int]] = []
    start = 0
    for brk in list(_BLOCK_BREAK.finditer(text)) + [None]:
        end = brk.start() if brk else len(text)
        _split_block(text, start, end, spans)
        start = brk.end() if brk else len(text)
    return spans


def _split_block(text: str, start: int, end: int, spans: list[tuple[int, int]]) -> None:
    pos = start
    for m in _TERMINATOR.finditer(text, start, end):
        j = m.end()
        while j < end and text[j].isspace():
            j += 1
        if j < end and not _is_boundary(text, m, j):
            continue
        _add_span(text, pos, m.end(), spans)
        pos = m.end()
    _add_span(text, pos, end, spans)


def _is_boundary(text: str, m: "regex.Match", nxt: int) -> bool:
    c = text[nxt]
    if c.islower() or c in ",;:":
        return False
    if m.group().rstrip("\"'”’)]»") != ".":
        return True  # '!', '?', ellipsis followed by a capital
    w = _PREV_WORD.search(text, max(0, m.start() - 40), m.start())
    if not w:
        return True
    word = w.group(1)
    low = word.lower()
    if len(word) == 1 and word.isupper():
        return False  # an initial
    if low == "no":
        return not c.isdigit()
    if low in _ABBREV:
        return False
    if low in _MAYBE_END:
        nw = regex.match(r"\w+", text[nxt:nxt + 30])
        return bool(nw) and nw.group().lower() in _OPENERS
    return True


def _add_span(text: str, a: int, b: int, spans: list[tuple[int, int]]) -> None:
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    if b > a:
        spans.append((a, b))


def split_sentences(text: str) -> list[str]:
    """The sentences of `text` (see `sentence_spans`)."""
    return [text[a:b] for a, b in sentence_spans(text)]


def lead(text: str, n: int = 3) -> str:
    """The first `n` sentences of `text`: the copying baseline lead-n."""
    return " ".join(split_sentences(text)[:n])
