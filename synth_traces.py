"""Synthetic tool-use traces in four steps: draft, fact-check, inject, continue.

    python synth_traces.py --config configs/synth_newsworld.yaml           # CPU: news world, oracle teacher
    python synth_traces.py --config configs/synth_api.yaml --shard 0/4     # one of four machines
    python synth_traces.py merge out/traces/all.jsonl out/traces/api.shard*of4.jsonl
    python synth_traces.py --config configs/synth_api.yaml --shards 4 --gpus 4  # four at once here, merged

For each document, `drafter.drafts_per_doc` traces:
1. Draft a faulty summary: the news world's drafter (labelled errors), or a model under one of
   `drafter.prompts` (adversarial instructions for error diversity; the trace keeps the standard prompt).
2. Fact-check it with a teacher (`factual_tools/teachers.py`) that answers
   `{"errors": [{"error_span", "corrected_clause", "regex_key"}]}`.
3. Inject, after each wrong sentence, a search, `<delete scope="sentence"/>` and the corrected sentence,
   replayed through `sandbox.replay`, so every results block is the sandbox's (DESIGN.md section 2).
4. Continue: the drafter writes on from the edited context, which is fact-checked in turn, up to
   `drafter.max_rounds` corrections.
Plus search-only positives after `search_rate` of the correct sentences (the recipe: about 25%), so the
model also learns restraint. Output: `Episode` JSONL (`factual_tools/traces.py`), provenance in `ep.meta`.

Choices beyond the plain four steps:
- A correction replaces the whole sentence (`scope="sentence"`, DESIGN.md section 2), so the teacher is
  asked for the corrected *sentence* in `corrected_clause`.
- Search-only positives sit in the same trace as the corrections and use regex queries by default: if
  only positives used BM25, the query style would give away whether a delete follows.
- For a model drafter, positives are inserted after its continuation was generated.
"""
from __future__ import annotations

import functools
import os
import random
import re
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Sequence

from tqdm import tqdm

import data
import sandbox
from factual_tools import claims, common, modeling, settings, textsplit, traces
from factual_tools.teachers import (
    Annotation, GenerateConfig, Judge, PromptedTokenizer, TeacherConfig, load_generator, make_annotator,
    sampling_for, unique_rounds, written_text,
)
from factual_tools.traces import (
    append_traces, done_ids, flags_to_keys, merge, parse_shard, shard_of, shard_path, stable_hash,
    tfidf_for,
)

SYNTH_VERSION = 1  # version of the trace record's meta (bump when its fields change)
DELETE_TAG = '<delete scope="sentence"/>'

# Instructions appended to the drafter's user turn; "" is the plain prompt.
DEFAULT_PROMPTS = [
    "",
    "Write the summary from memory, without looking back at the article.",
    "Include every number and date from the article in the summary.",
    "Name every person and organisation involved and say what each of them did.",
    "Write three sentences quickly, and end with what is likely to happen next.",
]


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@dataclass
class DrafterConfig:
    backend: Literal["newsworld", "model"] = "newsworld"  # the news world's faulty drafter, or a model
    drafts_per_doc: int = 3  # traces per document; the filter ranks them and keeps 1-2
    clean_rate: float = 0.2  # newsworld: share of drafts without errors
    max_errors: int = 3  # newsworld: errors per draft at most (one per sentence)
    model: modeling.ModelConfig = field(default_factory=modeling.ModelConfig)  # model backend: the drafter
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))  # draft k of a doc uses one each
    max_rounds: int = 3  # model: corrections (teacher calls) per trace; errors left after are recorded
    # model: after each correction the drafter writes on from the edited context (step 4
    # above, one generation per round); false corrects every error of the first draft in one
    # pass, as the news world drafter does (one generation per trace)
    continuation: bool = True
    # model: keep a draft's first N sentences (0 = all), repeats dropped (`draft_sentences`)
    max_sentences: int = 0


@dataclass
class Config:
    name: str = "synth"  # run name: runs/NAME/ holds the resolved config, git revision and metrics
    runs_dir: str = "runs"
    docs_path: str = "out/newsworld/docs.jsonl"  # Document JSONL (python -m newsworld generate ...)
    generate_docs: int = 1000  # docs_path missing: write this many news world documents there (0: error)
    world_seed: int = 0  # seed of those documents
    out_path: str = "out/traces/newsworld.jsonl"  # Episode JSONL; a shard i/n writes NAME.shard{i}of{n}.jsonl
    seed: int = 0  # drafts, prompts and positives derive from (seed, doc id, draft number)
    limit: int | None = None  # the first N documents of this shard (--limit N)
    # a leak-cluster manifest (`data.py split`): only its train pool is drafted ("" = every document);
    # the filter drops traces of held-out documents anyway, so drafting them is wasted work
    split: str = ""
    shard: str = "0/1"  # i/n: documents whose id hashes to i mod n (--shard i/n)
    batch_docs: int = 64  # documents per batch (teacher concurrency, drafter rollouts)
    search_rate: float = 0.25  # share of correct sentences followed by a search-only positive
    # share of corrected sentences checked in turn (own-sentence styles): the policy writes
    # such copies of the article itself, and must learn that a check they pass keeps them
    recheck_rate: float = 0.0
    # Query style. regex / bm25 / mix: corrections search the teacher's regex keys, positives
    # use this style (see docstring). own: every search is the sentence just written, as a
    # BM25 query (corrections and positives alike), the key a policy can write itself;
    # own_words: the same without the words that hold a digit (its values); key: its first
    # eight content words (`key_query`), the same check in a third of the generated tokens.
    search_query: Literal["regex", "bm25", "mix", "own", "own_words", "key"] = "regex"
    # teacher: the rewrite after a delete is the teacher's corrected sentence; evidence: the
    # sentence of the last search's results that states it (`evidence_correction`), so the
    # rewrite is a copy of the evidence the trace fetched
    correction: Literal["teacher", "evidence"] = "teacher"
    max_deletes: int = 5  # sandbox delete cap during replay
    limits: dict[str, int] = field(default_factory=dict)  # other sandbox limits (sandbox.Limits names), e.g. top_k
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    annotator: TeacherConfig = field(default_factory=TeacherConfig)
    # optional reasoning judge: scores each trace, citing spans (filter_traces.py: `judge_min`)
    judge: TeacherConfig = field(default_factory=lambda: TeacherConfig(backend="none"))


# ---------------------------------------------------------------------------
# Similarity and queries (the filter's relevance gate uses the same TF-IDF)
# ---------------------------------------------------------------------------


def support_of(document: str, sentence: str) -> int | None:
    """Index of the document sentence most similar to `sentence` (its support), None if none shares a word."""
    tf = tfidf_for(document)
    sims = [tf.cosine(sentence, s) for s in sandbox.index_for(document).sentences]
    best = max(range(len(sims)), key=lambda i: (sims[i], -i), default=None)
    return best if best is not None and sims[best] > 0 else None


def bm25_query(document: str, sentence: str, target: int, max_words: int = 6) -> str | None:
    """The fewest rarest words of `sentence` (also in the target) whose BM25 top hit is the target."""
    index, tf = sandbox.index_for(document), tfidf_for(document)
    tgt = set(index.tokens[target])
    seen, cand = set(), []
    for w in textsplit.words(sentence):
        if w in tgt and w not in seen:
            seen.add(w)
            cand.append(w)
    cand.sort(key=lambda w: -tf.idf.get(w, tf.unseen))  # stable: ties keep sentence order
    for n in range(2, min(max_words, len(cand)) + 1):
        q = " ".join(cand[:n])
        hits = index.search(q).hits
        if hits and hits[0] == target:
            return q
    return None


def support_query(document: str, sentence: str, style: str, rng: random.Random,
                  entity_names: Iterable[str] = ()) -> str | None:
    """A query (the text between <search> tags) whose top result supports `sentence`, or None."""
    target = support_of(document, sentence)
    if target is None:
        return None
    index = sandbox.index_for(document)
    styles = ["regex", "bm25"] if style == "regex" else ["bm25", "regex"]
    if style == "mix" and rng.random() < 0.5:
        styles.reverse()
    for s in styles if style == "mix" else styles[:1]:
        if s == "regex":
            q = f"/({claims.regex_key_for(index.sentences, target, sentence, entity_names=list(entity_names))})/"
        else:
            q = bm25_query(document, sentence, target)
        if q:
            res = index.search(q)
            if not res.error and res.hits and res.hits[0] == target:
                return q
    return None


# ---------------------------------------------------------------------------
# Building a trace
# ---------------------------------------------------------------------------


def group_labels(labels: Sequence[dict]) -> dict[int, list[dict]]:
    groups: dict[int, list[dict]] = defaultdict(list)
    for lab in labels:
        groups[lab["sentence_index"]].append(lab)
    return dict(groups)


def own_query(sentence: str) -> str:
    """The sentence itself as a BM25 query: the key a policy can always write (it
    copies what it just wrote), never the corrected value it does not know yet.
    Slashes and angle brackets are dropped, so it never reads as a regex or markup,
    and so is the closing punctuation: "X rose." then `<search>` outside a query,
    "X rose" then `</search>` inside one, a difference a tiny model can see."""
    return " ".join(re.sub(r"[/<>]", " ", sentence).split()).rstrip(" .!?;:")


def own_words_query(sentence: str) -> str:
    """`own_query` without the words that hold a digit: the sentence's names and
    words, not its values (likely the wrong ones, and the ones a rewrite must not copy)."""
    return " ".join(w for w in own_query(sentence).split() if not any(c.isdigit() for c in w)).rstrip(" ,;:")


KEY_WORDS = 8


def key_query(sentence: str, n: int = KEY_WORDS) -> str:
    """A short BM25 key written from the sentence itself: its first `n` content words
    (no function words, no values), punctuation dropped. What the sentence shares with
    the article (its names, its predicate) in a third of the tokens: every generated
    token of a search is paid for in every rollout."""
    out = []
    for w in own_words_query(sentence).split():
        w = w.strip(",.;:'\"()[]")
        if w and w.lower() not in data.STOP_WORDS:
            out.append(w)
    return " ".join(out[:n])


def draft_sentences(text: str, n: int) -> str:
    """The first `n` sentences of a model's draft (all when n == 0), a sentence that
    repeats an earlier one dropped: a drafter that loops until its token limit gives
    a draft, not a loop, to correct."""
    kept: list[str] = []
    for s in textsplit.split_sentences(text):
        if s not in kept:
            kept.append(s)
        if n and len(kept) == n:
            break
    return " ".join(kept)


def evidence_correction(document: str, query: str, corrected: str, min_cosine: float = 0.5, top_k: int = 3) -> str:
    """The result sentence of `query` closest to the teacher's `corrected` sentence
    (TF-IDF cosine), when it reaches `min_cosine`; else `corrected`. A rewrite the
    results hold verbatim is one a policy can copy from the evidence it fetched."""
    if not corrected:
        return corrected
    index = sandbox.index_for(document)
    res = index.search(query, top_k)
    tf = tfidf_for(document)
    best = max(((tf.cosine(corrected, index.sentences[h]), index.sentences[h]) for h in res.hits or []),
               default=(0.0, ""))
    return best[1] if best[0] >= min_cosine else corrected


def render(sentences: Sequence[str], groups: dict[int, list[dict]], query_fn: Callable[[str], str | None],
           rng: random.Random, *, search_rate: float, ends_trace: bool = True,
           avoid: set[int] = frozenset(), own: Callable[[str], str] | None = None,
           rewrite: Callable[[str, str], str] | None = None, recheck_rate: float = 0.0) -> tuple[str, list[dict]]:
    """Assistant text for consecutive summary sentences, and the corrections made.

    A sentence with labels is followed by one regex search per distinct key (two
    at most; with `own`, one BM25 search for `own(sentence)`), a sentence
    delete and its corrected sentence (the labels of one sentence share it;
    none when the teacher says drop the sentence). Another sentence gets a
    search-only positive with probability `search_rate` (`query_fn`'s query, or
    `own(sentence)`), except the last one of the trace (a trace
    never ends on a search) and those in `avoid` (known wrong, left uncorrected).
    `rewrite(query, corrected)`, if given, replaces each corrected sentence
    (`evidence_correction`: the result sentence that states it). With `own`, a
    corrected sentence is checked in turn with probability `recheck_rate` (a
    search-only positive: what its results state, it states; kept), never the last.
    """
    parts, corrections = [], []
    last = len(sentences) - 1 if ends_trace else len(sentences)
    for i, s in enumerate(sentences):
        labs = groups.get(i)
        if labs:
            keys = [own(s)] if own else list(dict.fromkeys(lab["regex_key"] for lab in labs))[:2]
            queries = keys if own else [f"/({k})/" for k in keys]
            fixed = next((lab["corrected_clause"].strip() for lab in labs if lab["corrected_clause"].strip()), "")
            if rewrite is not None:
                fixed = rewrite(queries[-1], fixed)
            recheck = ""
            if fixed and own and i < last and recheck_rate > 0 and rng.random() < recheck_rate:
                recheck = f"<search>{own(fixed)}</search>"
            parts.append(s + "".join(f"<search>{q}</search>" for q in queries) + DELETE_TAG
                         + (" " + fixed + recheck if fixed else ""))
            corrections.append({"sentence": s, "corrected": fixed, "keys": keys,
                                "types": [lab.get("type", "unknown") for lab in labs]})
        elif i < last and i not in avoid and search_rate > 0 and rng.random() < search_rate:
            q = own(s) if own else query_fn(s)
            parts.append(s + (f"<search>{q}</search>" if q else ""))
        else:
            parts.append(s)
    return " ".join(parts), corrections


def trace_kind(ep: sandbox.Episode, rejected: bool = False) -> str:
    if rejected:
        return "rejected"
    if ep.n_delete:
        return "corrective"
    return "search_only" if ep.n_search else "clean"


# ---------------------------------------------------------------------------
# Drafters
# ---------------------------------------------------------------------------


@dataclass
class Item:
    """One trace to make: draft k of a document."""
    doc: data.Document
    k: int
    seed: int

    @property
    def id(self) -> str:
        return f"{self.doc.id}#{self.k}"

    def rng(self, what: str) -> random.Random:
        return random.Random(f"{self.seed}/{self.doc.id}/{self.k}/{what}")  # str seeds hash with sha512: stable




@dataclass
class Draft:
    text: str
    labels: list[dict] = field(default_factory=list)  # the drafter's own labels (news world: exact)
    prompt_id: int | None = None


class NewsworldDrafter:
    """The news world's faulty drafter: its continuation is the rest of its draft."""

    continues = False

    def __init__(self, cfg: DrafterConfig):
        self.cfg = cfg
        self.name = "newsworld"

    def draft(self, items: Sequence[Item]) -> list[Draft]:
        from newsworld import oracle  # the built-in world's faulty drafter: only its documents get here

        out = []
        for it in items:
            if not it.doc.facts:
                raise data.DataError(f"document {it.doc.id!r} is not a news world document (no fact table); "
                                     "use drafter.backend=model")
            text, labels = oracle.draft(it.doc, it.rng("draft"), clean_rate=self.cfg.clean_rate,
                                      max_errors=self.cfg.max_errors)
            out.append(Draft(text, labels))
        return out


def forced_ids(tokenizer, text: str) -> list[int]:
    """Ids that write `text`, each tool call ending a piece, so a stop falls exactly where the call ends."""
    ids, i = [], 0
    while i < len(text):
        end = sandbox.find_stop(text, i) or len(text)
        ids += tokenizer.encode(text[i:end], add_special_tokens=False)
        i = end
    return ids


class ModelDrafter:
    """A model through the rollout engine; `continue_` writes on from an edited context."""

    continues = True

    def __init__(self, cfg: DrafterConfig, seed: int = 0, model=None, tokenizer=None):
        self.cfg, self.seed = cfg, seed
        self.model, self.tok = (model, tokenizer) if model is not None else load_generator(cfg.model, cfg.generate)
        self.name = f"model:{cfg.model.name_or_path}"
        self.prompts = cfg.prompts or [""]
        self.calls = 0

    def prompt_id(self, it: Item) -> int:
        return (stable_hash(it.doc.id) + it.k) % len(self.prompts)

    def messages(self, it: Item) -> list[dict]:
        msgs = sandbox.prompt_messages(it.doc.text)
        extra = self.prompts[self.prompt_id(it)]
        if extra:
            msgs[-1] = dict(msgs[-1], content=f"{msgs[-1]['content']}\n\n{extra}")
        return msgs

    def _generate(self, items: Sequence[Item], prefixes: Sequence[str] | None) -> list[sandbox.Episode]:
        from factual_tools import engine

        out: list[sandbox.Episode | None] = [None] * len(items)
        for rnd in unique_rounds([it.doc.text for it in items]):
            its = [items[i] for i in rnd]
            tok = PromptedTokenizer(self.tok, {it.doc.text: self.messages(it) for it in its})
            docs = [sandbox.index_for(it.doc.text) for it in its]
            self.calls += 1
            seed = self.seed * 100_003 + self.calls
            if prefixes is None:
                with common.autocast_for(self.cfg.generate.autocast, self.model):
                    eps = engine.rollout(self.model, tok, docs, 1, sampling_for(self.cfg.generate, seed))
            else:
                scripts = {j: forced_ids(self.tok, prefixes[i]) for j, i in enumerate(rnd)}
                longest = max((len(s) for s in scripts.values()), default=0)
                sampling = sampling_for(self.cfg.generate, seed, longest)
                if sampling.backend == "vllm":
                    eps = _continue_vllm(self.model, tok, docs, [scripts[j] for j in range(len(rnd))], sampling)
                else:
                    with common.autocast_for(self.cfg.generate.autocast, self.model):
                        eps = engine.rollout(self.model, tok, docs, 1, sampling,
                                              logits_processor=engine.ScriptedProcessor(scripts))
            for i, ep in zip(rnd, eps):
                out[i] = ep
        return out

    def draft(self, items: Sequence[Item]) -> list[Draft]:
        # The drafter's own tool calls (if it is a tool-trained policy) are dropped: only the summary counts.
        return [Draft(draft_sentences(ep.summary, self.cfg.max_sentences), [], self.prompt_id(it))
                for it, ep in zip(items, self._generate(items, None))]

    def continue_(self, items: Sequence[Item], prefixes: Sequence[str]) -> list[tuple[str, str | None]]:
        """(continuation text, error) per item: what the drafter wrote after the forced prefix.
        The prefix is forced token by token, so the sandbox answers its injected calls exactly as in a rollout."""
        out = []
        for prefix, ep in zip(prefixes, self._generate(items, prefixes)):
            text = written_text(ep)
            if not text.startswith(prefix):
                out.append(("", "the forced prefix did not decode back to itself"))
            else:
                out.append((text[len(prefix):], None))
        return out


def _continue_vllm(llm, tokenizer, docs, scripts, sampling):  # pragma: no cover - GPU stack
    """vLLM continuation: the builder is driven through the forced prefix first
    (the sandbox answers its calls), then vLLM generates from its context."""
    from factual_tools import engine
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    codec, eos = sandbox.Codec(tokenizer), engine.stop_ids(tokenizer)
    builders = []
    for d, ids in zip(docs, scripts):
        b = sandbox.EpisodeBuilder(d, sandbox.prompt_ids(tokenizer, d.text), codec, eos_ids=eos)
        for t in ids:
            if b.push(t) and b.end_turn().kind == "done":
                break
        builders.append(b)

    def generate_round(reqs):
        prompts = [TokensPrompt(prompt_token_ids=b.context_ids()) for b, _ in reqs]
        params = [SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=max(1, n),
                                 stop=engine.API_STOPS, include_stop_str_in_output=True, stop_token_ids=eos)
                  for _, n in reqs]
        return [(list(o.outputs[0].token_ids), None, "length" if o.outputs[0].finish_reason == "length" else "stop")
                for o in llm.generate(prompts, params, use_tqdm=False)]

    live = [b for b in builders if not b.done]
    engine.drive_multiturn(live, generate_round, sampling.max_new_tokens)
    return [b.finish() for b in builders]


def make_drafter(cfg: Config):
    if cfg.drafter.backend == "newsworld":
        return NewsworldDrafter(cfg.drafter)
    return ModelDrafter(cfg.drafter, cfg.seed)


# ---------------------------------------------------------------------------
# The pipeline for a batch of items
# ---------------------------------------------------------------------------


def _render_kw(it: Item, cfg: Config) -> dict:
    """render()'s query style and rewrite for `cfg`."""
    rewrite = None
    if cfg.correction == "evidence":
        rewrite = functools.partial(evidence_correction, it.doc.text, top_k=sandbox.Limits.make(**cfg.limits).top_k)
    own = {"own": own_query, "own_words": own_words_query, "key": key_query}.get(cfg.search_query)
    return {"own": own, "rewrite": rewrite, "recheck_rate": cfg.recheck_rate}


def _query_fn(it: Item, cfg: Config) -> Callable[[str], str | None]:
    rng = it.rng("query")
    return lambda s: support_query(it.doc.text, s, cfg.search_query, rng, it.doc.entities)


def _finish(it: Item, text: str, draft: Draft, labels: list[dict], ann: Annotation, corrections: list[dict],
            *, drafter, annotator, cfg: Config, extra: dict | None = None) -> sandbox.Episode:
    ep = sandbox.replay(it.doc.text, text, **{**cfg.limits, "max_deletes": cfg.max_deletes})
    ep.doc_id = it.doc.id
    ep.meta = {
        "id": it.id, "synth_version": SYNTH_VERSION, "trace_kind": trace_kind(ep, ann.error is not None),
        "drafter": drafter.name, "prompt_id": draft.prompt_id,
        "prompt": cfg.drafter.prompts[draft.prompt_id] if draft.prompt_id is not None else None,
        "annotator": annotator.name, "draft": draft.text, "labels": labels, "drafter_labels": draft.labels,
        "rejected_labels": ann.rejected, "annotation_error": ann.error, "corrections": corrections,
        "error_types": sorted({t for c in corrections for t in c["types"]}),
        "teacher": {"cost_usd": round(ann.cost_usd, 6), "prompt_tokens": ann.prompt_tokens,
                    "completion_tokens": ann.completion_tokens, "requests": ann.requests, "cached": ann.cached},
        "open_errors": 0,
    }
    ep.meta.update(extra or {})
    return ep


def synth_batch(items: Sequence[Item], drafter, annotator, cfg: Config
                ) -> tuple[list[sandbox.Episode], list[tuple[str, str]]]:
    """Traces for `items`, and (trace id, reason) for those that got no teacher answer (retried next run)."""
    if drafter.continues and cfg.drafter.continuation:
        return _synth_iterative(items, drafter, annotator, cfg)
    drafts = drafter.draft(items)
    anns = annotator.annotate_many([(it.doc, d.text) for it, d in zip(items, drafts)])
    traces, failed = [], []
    for it, d, ann in zip(items, drafts, anns):
        if ann.failed:
            failed.append((it.id, ann.failed))
            continue
        text, corrections = d.text, []
        if ann.error is None:
            text, corrections = render(textsplit.split_sentences(d.text), group_labels(ann.labels), _query_fn(it, cfg),
                                       it.rng("positives"), search_rate=cfg.search_rate, **_render_kw(it, cfg))
        traces.append(_finish(it, text, d, ann.labels, ann, corrections, drafter=drafter, annotator=annotator, cfg=cfg))
    return traces, failed


@dataclass
class _State:
    prefix: str = ""  # assistant text fixed so far (ends with a correction)
    open: str = ""  # the drafter's text after it, not fact-checked yet
    labels: list[dict] = field(default_factory=list)
    corrections: list[dict] = field(default_factory=list)
    ann: Annotation = field(default_factory=Annotation)
    done: bool = False
    open_errors: int = 0  # errors found after the last round: recorded, not corrected
    note: str | None = None  # why a continuation is missing


def _synth_iterative(items, drafter, annotator, cfg):
    """Model drafter: fact-check, correct the first wrong sentence, let the drafter
    continue from the edited context, fact-check the continuation, and so on."""
    drafts = drafter.draft(items)
    states = [_State(open=d.text) for d in drafts]
    for rnd in range(cfg.drafter.max_rounds + 1):
        active = [i for i, s in enumerate(states) if not s.done]
        if not active:
            break
        kept = [sandbox.replay(items[i].doc.text, states[i].prefix).summary for i in active]
        full = [" ".join(x for x in (k, states[i].open.strip()) if x) for k, i in zip(kept, active)]
        anns = annotator.annotate_many([(items[i].doc, f) for i, f in zip(active, full)])
        need = []
        for i, k, ann in zip(active, kept, anns):
            s, it = states[i], items[i]
            s.ann.merge(ann)
            if ann.failed or ann.error:
                s.done = True
                continue
            n_kept = len(textsplit.split_sentences(k))  # labels on the fixed prefix were dealt with already
            groups = {j - n_kept: labs for j, labs in group_labels(ann.labels).items() if j >= n_kept}
            sentences = textsplit.split_sentences(s.open)
            if not groups or rnd == cfg.drafter.max_rounds:
                text, _ = render(sentences, {}, _query_fn(it, cfg), it.rng(f"positives{rnd}"),
                                 search_rate=cfg.search_rate, avoid=set(groups), **_render_kw(it, cfg))
                s.prefix = " ".join(x for x in (s.prefix, text) if x)
                s.labels += [lab for labs in groups.values() for lab in labs]
                s.open_errors = sum(len(v) for v in groups.values())
                s.done = True
                continue
            j = min(groups)
            text, corr = render(sentences[:j + 1], {j: groups[j]}, _query_fn(it, cfg), it.rng(f"positives{rnd}"),
                                search_rate=cfg.search_rate, ends_trace=False, **_render_kw(it, cfg))
            s.prefix = " ".join(x for x in (s.prefix, text) if x)
            s.labels += groups[j]
            s.corrections += corr
            need.append(i)
        if need:
            conts = drafter.continue_([items[i] for i in need], [states[i].prefix for i in need])
            for i, (cont, err) in zip(need, conts):
                states[i].open, states[i].note = cont, err
    traces, failed = [], []
    for it, d, s in zip(items, drafts, states):
        if s.ann.failed:
            failed.append((it.id, s.ann.failed))
            continue
        text = s.prefix if s.ann.error is None else d.text
        extra = {"open_errors": s.open_errors, "continuation_note": s.note}
        traces.append(_finish(it, text, d, s.labels, s.ann, s.corrections, drafter=drafter, annotator=annotator,
                              cfg=cfg, extra=extra))
    return traces, failed


def load_docs(cfg: Config) -> list[data.Document]:
    if not os.path.exists(cfg.docs_path):
        if cfg.generate_docs <= 0:
            raise data.DataError(f"{cfg.docs_path} does not exist (write it with python -m newsworld generate "
                                 f"--out {cfg.docs_path}, or set generate_docs)")
        import newsworld  # generate_docs > 0: the built-in world writes them

        n = data.write_jsonl(cfg.docs_path, newsworld.documents(cfg.generate_docs, cfg.world_seed))
        print(f"wrote {n} news world documents (seed {cfg.world_seed}) -> {cfg.docs_path}", file=sys.stderr)
    return data.read_documents(cfg.docs_path)


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def main(cfg: Config, drafter=None, annotator=None, judge=None) -> dict:
    """Run the pipeline; `drafter`/`annotator`/`judge` override the configured ones (tests)."""
    t0 = time.perf_counter()
    si, sn = parse_shard(cfg.shard)
    run = common.start_run(cfg)
    docs = load_docs(cfg)
    if cfg.split:
        try:
            docs = data.pool_documents(docs, data.read_manifest(cfg.split), "train", cfg.split)
        except (data.DataError, data.LeakError, OSError) as e:
            raise SystemExit(f"split={cfg.split}: {e} (make it with `python data.py split --docs {cfg.docs_path} "
                             f"--out {cfg.split}`, or set split='')") from None
    docs = [d for d in docs if shard_of(d.id, sn) == si]
    docs = docs[:cfg.limit] if cfg.limit is not None else docs
    out = shard_path(cfg.out_path, si, sn)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    done = done_ids(out)
    todo = [(d, [Item(d, k, cfg.seed) for k in range(cfg.drafter.drafts_per_doc)]) for d in docs]
    todo = [(d, [it for it in its if it.id not in done]) for d, its in todo]
    todo = [(d, its) for d, its in todo if its]
    print(f"synth: {len(docs)} documents in shard {si}/{sn}, {len(done)} traces already in {out}, "
          f"{sum(len(its) for _, its in todo)} to make", flush=True)
    drafter = drafter or make_drafter(cfg)
    annotator = annotator or make_annotator(cfg.annotator)
    judge = judge if judge is not None else (Judge(cfg.judge) if cfg.judge.backend != "none" else None)
    stats, kinds, failed_all = Counter(), Counter(), []
    bar = tqdm(total=len(todo), unit="doc", desc="synth", dynamic_ncols=True, file=sys.stderr)
    for b in range(0, len(todo), cfg.batch_docs):
        batch = todo[b:b + cfg.batch_docs]
        items = [it for _, its in batch for it in its]
        traces, failed = synth_batch(items, drafter, annotator, cfg)
        failed_all += failed
        if judge is not None and traces:
            by_id = {d.id: d for d, _ in batch}
            for ep, verdict in zip(traces, judge.judge_many([(by_id[ep.doc_id], ep) for ep in traces])):
                ep.meta["judge"] = verdict
        by_doc = defaultdict(list)
        for ep in traces:
            by_doc[ep.doc_id].append(ep)
            kinds[ep.meta["trace_kind"]] += 1
            stats["labels"] += len(ep.meta["labels"])
            stats["rejected_labels"] += len(ep.meta["rejected_labels"])
            stats["corrections"] += len(ep.meta["corrections"])
            stats["searches"] += ep.n_search
        for d, _ in batch:
            append_traces(out, by_doc.get(d.id, []))
        stats["traces"] += len(traces)
        bar.update(len(batch))
        bar.set_postfix(traces=stats["traces"], failed=len(failed_all))
    bar.close()
    secs = time.perf_counter() - t0
    teachers = [t for t in (getattr(annotator, "teacher", None), judge.teacher if judge else None) if t]
    spent = sum(t.spent_usd for t in teachers)
    saved = sum(t.saved_usd for t in teachers)
    requests = sum(t.stats["requests"] for t in teachers)
    cached = sum(t.stats["cached"] for t in teachers)
    summary = {"documents": len(todo), "traces": stats["traces"], "kinds": dict(kinds), "labels": stats["labels"],
               "rejected_labels": stats["rejected_labels"], "corrections": stats["corrections"],
               "searches": stats["searches"], "failed": len(failed_all), "teacher_requests": requests,
               "teacher_cached": cached, "cost_usd": round(spent, 4), "cost_cached_usd": round(saved, 4),
               "seconds": round(secs, 2), "traces_per_s": round(stats["traces"] / max(secs, 1e-9), 1),
               "out": out}
    print(f"synth: {len(todo)} docs | {stats['traces']} traces "
          f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items())) or 'none'}) | labels {stats['labels']} "
          f"(rejected {stats['rejected_labels']}) | failed {len(failed_all)} | teacher {requests} requests, "
          f"{cached} cached, ${spent:.4f} spent, ${saved:.4f} reused | {summary['traces_per_s']} traces/s | "
          f"{secs:.1f}s -> {out}", flush=True)
    for tid, why in failed_all[:5]:
        print(f"  no answer for {tid}: {why} (retried on the next run)", file=sys.stderr)
    run.metrics.write(0, **{k: v for k, v in summary.items() if k != "kinds"}, **{f"kind_{k}": v
                                                                                for k, v in kinds.items()})
    return summary


def cli(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        if len(argv) < 3:
            print("usage: python synth_traces.py merge OUT IN1 [IN2 ...]", file=sys.stderr)
            return 2
        try:
            res = merge(argv[1], argv[2:])
        except data.DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"merge: {res['traces']} traces from {res['inputs']} files ({res['duplicates']} duplicates dropped) "
              f"-> {argv[1]}")
        return 0
    try:
        argv, n, gpus = traces.pop_shards(argv)
        cfg = settings.load_config(Config, flags_to_keys(argv))
        if n == 1:
            main(cfg)
            return 0
        # --shards N: the N shards at once on this machine, then their merge into out_path
        res, _ = traces.run_shards(__file__, argv, n, gpus, out=cfg.out_path)
        print(f"merge: {res['traces']} traces from {n} shards -> {cfg.out_path}")
    except (settings.ConfigError, data.DataError) as e:  # bad input: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
