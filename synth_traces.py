"""Synthetic tool-use traces in four steps: draft, fact-check, inject, continue.

    python synth_traces.py --config configs/synth_newsworld.yaml           # CPU: news world, oracle teacher
    python synth_traces.py --config configs/synth_api.yaml --shard 0/4     # one of four machines
    python synth_traces.py merge out/traces/all.jsonl out/traces/api.shard*of4.jsonl

For each document, `drafter.drafts_per_doc` traces:
1. Draft a faulty summary: the news world's drafter (labelled errors), or a
   model through the rollout engine (`hf` on CPU/GPU, `vllm` on a GPU) under
   one of `drafter.prompts`, adversarial instructions that raise error
   diversity. The trace itself keeps the standard prompt: the instruction only
   shapes the draft.
2. Fact-check it with a teacher that answers
   `{"errors": [{"error_span", "corrected_clause", "regex_key"}]}`: any
   OpenAI-compatible API (validated item by item, cached on disk by request
   hash so no call is ever paid twice, costed from a price table), a local
   model through the rollout engine, or the news world's oracle.
3. Inject, after each wrong sentence, `<search>/(regex_key)/</search>
   <delete scope="sentence"/>` and the corrected sentence. The text is run
   through `sandbox.replay`, so every results block is the sandbox's, live
   (DESIGN.md section 2), never the teacher's.
4. Continue: a model drafter writes on from the edited context (its prefix is
   forced token by token, so the sandbox answers the injected calls exactly as
   in a rollout); its continuation is fact-checked in turn, up to
   `drafter.max_rounds` corrections. The news world drafter's continuation is
   the rest of its draft, whose later errors are corrected the same way.
Plus search-only positives: after `search_rate` (0.25; 1.0 in the news-world configs) of the correct
sentences, a search whose top result is the sentence's support, and no delete,
so the model also learns restraint (the plain recipe: about 25% of correct
sentences). Optionally a reasoning judge scores each trace, citing spans; the
filter gates on it.

Output: `Episode` JSONL, one line per trace, appended per document and
flushed; a restart skips the trace ids already written (a line cut by a kill is
truncated first). `--shard i/n` takes the documents whose id hashes to i mod n;
`merge` joins shard files. `ep.meta` holds the provenance: drafter, prompt,
annotator, labels and rejected labels with reasons, error types, the
uncorrected draft, teacher tokens and cost, the trace kind, the judge's score.

Choices beyond the plain four steps:
- A correction replaces the whole sentence (`scope="sentence"`, DESIGN.md
  section 2), so the teacher is asked for the corrected *sentence* in
  `corrected_clause`.
- Search-only positives sit in the same trace as the corrections rather than
  in separate traces: the model sees searches that end in a delete and
  searches that do not, under the same query syntax. Positives use regex
  queries by default: if only positives used BM25, the query style would give
  away whether a delete follows, before the results are seen.
- For a model drafter, positives are inserted after its continuation was
  generated (text-only traces are tokenised canonically later).
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import random
import re
import sys
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Sequence

from tqdm import tqdm

import common
import settings
import modeling
import data
import newsworld
import oracle
import sandbox

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
# USD per million tokens; list prices at the time of writing: check them against your provider.
DEFAULT_PRICES = {
    "gpt-4o": {"input": 2.5, "output": 10.0},
    "gpt-4o-mini": {"input": 0.15, "output": 0.6},
    "gpt-4.1": {"input": 2.0, "output": 8.0},
    "gpt-4.1-mini": {"input": 0.4, "output": 1.6},
}


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@dataclass
class GenerateConfig:
    backend: Literal["hf", "hf_naive", "vllm"] = "hf"  # rollout engine backend
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 160  # generated tokens per draft or continuation (a forced prefix comes on top)
    batch_size: int = 32  # rows decoded together


@dataclass
class TeacherConfig:
    backend: Literal["none", "oracle", "api", "model"] = "oracle"  # who answers ("none": judge off)
    api_base: str = "http://127.0.0.1:8000/v1"  # OpenAI-compatible server, up to /v1
    api_model: str = "gpt-4o"  # model name sent with each request and looked up in prices_per_mtok
    api_key_env: str = "OPENAI_API_KEY"  # environment variable that holds the key (never the key itself)
    timeout_s: float = 60.0  # one request attempt
    retries: int = 5  # extra attempts after a 429, a 5xx or a timeout
    backoff_s: float = 1.0  # wait before the first retry; doubles per retry
    concurrency: int = 8  # requests in flight at most
    temperature: float = 0.0
    max_tokens: int = 1024  # completion tokens per request
    json_mode: bool = True  # ask for response_format={"type": "json_object"}
    # USD per million input/output tokens, per model name
    prices_per_mtok: dict[str, dict[str, float]] = field(default_factory=lambda: dict(DEFAULT_PRICES))
    cache_dir: str = "out/teacher_cache"  # one JSON file per request hash (api and model backends)
    model: modeling.ModelConfig = field(default_factory=modeling.ModelConfig)  # model backend: the local teacher
    generate: GenerateConfig = field(default_factory=lambda: GenerateConfig(temperature=0.0, max_new_tokens=512))


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


@dataclass
class Config:
    name: str = "synth"  # run name: runs/NAME/ holds the resolved config, git revision and metrics
    runs_dir: str = "runs"
    docs_path: str = "out/newsworld/docs.jsonl"  # Document JSONL (python data.py newsworld ...)
    generate_docs: int = 1000  # docs_path missing: write this many news world documents there (0: error)
    world_seed: int = 0  # seed of those documents
    out_path: str = "out/traces/newsworld.jsonl"  # Episode JSONL; a shard i/n writes NAME.shard{i}of{n}.jsonl
    seed: int = 0  # drafts, prompts and positives derive from (seed, doc id, draft number)
    limit: int | None = None  # the first N documents of this shard (--limit N)
    shard: str = "0/1"  # i/n: documents whose id hashes to i mod n (--shard i/n)
    batch_docs: int = 64  # documents per batch (teacher concurrency, drafter rollouts)
    search_rate: float = 0.25  # share of correct sentences followed by a search-only positive
    # Query style. regex / bm25 / mix: corrections search the teacher's regex keys, positives
    # use this style (see docstring). own: every search is the sentence just written, as a
    # BM25 query (corrections and positives alike), the key a policy can write itself;
    # own_words: the same without the words that hold a digit (its values).
    search_query: Literal["regex", "bm25", "mix", "own", "own_words"] = "regex"
    # teacher: the rewrite after a delete is the teacher's corrected sentence; evidence: the
    # sentence of the last search's results that states it (`evidence_correction`), so the
    # rewrite is a copy of the evidence the trace fetched
    correction: Literal["teacher", "evidence"] = "teacher"
    max_deletes: int = 5  # sandbox delete cap during replay
    limits: dict[str, int] = field(default_factory=dict)  # other sandbox limits (sandbox.Limits names), e.g. top_k
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    annotator: TeacherConfig = field(default_factory=TeacherConfig)
    judge: TeacherConfig = field(default_factory=lambda: TeacherConfig(backend="none"))


# ---------------------------------------------------------------------------
# Similarity and queries (the filter's relevance gate uses the same TF-IDF)
# ---------------------------------------------------------------------------


class Tfidf:
    """TF-IDF vectors over `sandbox.words`, with IDF from one document's sentences."""

    def __init__(self, sentences: Sequence[str]):
        n = len(sentences)
        df = Counter(w for s in sentences for w in set(sandbox.words(s)))
        self.idf = {w: math.log((1 + n) / (1 + c)) + 1.0 for w, c in df.items()}
        self.unseen = math.log(1 + n) + 1.0  # a word the document never uses weighs most

    def vector(self, text: str) -> dict[str, float]:
        return {w: c * self.idf.get(w, self.unseen) for w, c in Counter(sandbox.words(text)).items()}

    def cosine(self, a: str, b: str) -> float:
        va, vb = self.vector(a), self.vector(b)
        dot = sum(x * vb.get(w, 0.0) for w, x in va.items())
        na, nb = math.sqrt(sum(x * x for x in va.values())), math.sqrt(sum(x * x for x in vb.values()))
        return dot / (na * nb) if na and nb else 0.0


@functools.lru_cache(maxsize=256)
def tfidf_for(document: str) -> Tfidf:
    return Tfidf(sandbox.index_for(document).sentences)


def tfidf_cosine(document: str, a: str, b: str) -> float:
    """Cosine of `a` and `b` as TF-IDF vectors, IDF from `document`'s sentences."""
    return tfidf_for(document).cosine(a, b)


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
    for w in sandbox.words(sentence):
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
            q = f"/({oracle.regex_key_for(index.sentences, target, sentence, entity_names=list(entity_names))})/"
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


def evidence_correction(document: str, query: str, corrected: str, min_cosine: float = 0.5, top_k: int = 3) -> str:
    """The result sentence of `query` closest to the teacher's `corrected` sentence
    (TF-IDF cosine), when it reaches `min_cosine`; else `corrected`. A rewrite the
    results hold verbatim is one a policy can copy from the evidence it fetched."""
    if not corrected:
        return corrected
    index = sandbox.index_for(document)
    res = index.search(query, top_k)
    best = max(((tfidf_cosine(document, corrected, index.sentences[h]), index.sentences[h]) for h in res.hits or []),
               default=(0.0, ""))
    return best[1] if best[0] >= min_cosine else corrected


def render(sentences: Sequence[str], groups: dict[int, list[dict]], query_fn: Callable[[str], str | None],
           rng: random.Random, search_rate: float, ends_trace: bool = True,
           avoid: set[int] = frozenset(), own: Callable[[str], str] | None = None,
           rewrite: Callable[[str, str], str] | None = None) -> tuple[str, list[dict]]:
    """Assistant text for consecutive summary sentences, and the corrections made.

    A sentence with labels is followed by one regex search per distinct key (two
    at most; with `own`, one BM25 search for `own(sentence)`), a sentence
    delete and its corrected sentence (the labels of one sentence share it;
    none when the teacher says drop the sentence). Another sentence gets a
    search-only positive with probability `search_rate` (`query_fn`'s query, or
    `own(sentence)`), except the last one of the trace (a trace
    never ends on a search) and those in `avoid` (known wrong, left uncorrected).
    `rewrite(query, corrected)`, if given, replaces each corrected sentence
    (`evidence_correction`: the result sentence that states it).
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
            parts.append(s + "".join(f"<search>{q}</search>" for q in queries) + DELETE_TAG
                         + (" " + fixed if fixed else ""))
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
# Teachers: an OpenAI-compatible API (cached, costed) or a local model
# ---------------------------------------------------------------------------


@dataclass
class Reply:
    text: str | None  # None: no answer (error says why)
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    cached: bool = False  # answered from the disk cache: nothing paid now


class DiskCache:
    """One JSON file per request hash, written atomically; a corrupt file is a miss."""

    def __init__(self, root: str):
        self.root = root

    def path(self, key: str) -> str:
        return os.path.join(self.root, key[:2], key + ".json")

    def get(self, key: str) -> dict | None:
        try:
            with open(self.path(key), encoding="utf-8") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            print(f"warning: teacher cache entry {self.path(key)} unreadable ({e}); asking again", file=sys.stderr)
            return None

    def put(self, key: str, record: dict) -> None:
        common.atomic_write_text(self.path(key), json.dumps(record, ensure_ascii=False))


def request_key(path: str, body: dict) -> str:
    """sha256 of the canonical request (endpoint path + JSON body, keys sorted)."""
    canon = json.dumps({"path": path, "body": body}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def price_usd(prices: dict[str, dict[str, float]], model: str, prompt_tokens: int, completion_tokens: int) -> float:
    p = prices.get(model)
    if not p:
        return 0.0
    return (prompt_tokens * p.get("input", 0.0) + completion_tokens * p.get("output", 0.0)) / 1e6


class Teacher:
    """Counters shared by the teacher backends: what was asked, paid and reused."""

    name = "teacher"

    def __init__(self):
        self._lock = threading.Lock()
        self.stats = Counter()  # requests (new), cached, prompt_tokens, completion_tokens, failed
        self.spent_usd = 0.0  # paid in this run
        self.saved_usd = 0.0  # cost of the answers read back from the cache

    def _count(self, r: Reply) -> Reply:
        with self._lock:
            if r.cached:
                self.stats["cached"] += 1
                self.saved_usd += r.cost_usd
            elif r.text is None:
                self.stats["failed"] += 1
            else:
                self.stats["requests"] += 1
                self.spent_usd += r.cost_usd
            self.stats["prompt_tokens"] += r.prompt_tokens
            self.stats["completion_tokens"] += r.completion_tokens
        return r

    def chat_many(self, requests: Sequence[tuple[list[dict], str]]) -> list[Reply]:
        """Answers to (messages, document text) requests, in order."""
        raise NotImplementedError


class ApiTeacher(Teacher):
    """Chat completions from an OpenAI-compatible server through `rollout.ApiClient`
    (retries with exponential backoff on 429/5xx/timeouts, a concurrency limit),
    with a disk cache in front: a restart or a second run never repeats a paid call."""

    def __init__(self, cfg: TeacherConfig, client=None):
        super().__init__()
        if client is None:
            import rollout  # torch comes with it: only teachers that call out pay for the import

            client = rollout.ApiClient(cfg.api_base, cfg.api_model, os.environ.get(cfg.api_key_env), cfg.timeout_s,
                                       cfg.retries, cfg.concurrency, cfg.backoff_s)
        self.cfg, self.client, self.cache = cfg, client, DiskCache(cfg.cache_dir)
        self.name = f"api:{cfg.api_model}"
        if cfg.api_model not in cfg.prices_per_mtok:
            print(f"warning: no price for {cfg.api_model!r} in prices_per_mtok: its cost is counted as 0",
                  file=sys.stderr)

    def body(self, messages: list[dict]) -> dict:
        body = {"model": self.cfg.api_model, "messages": messages, "temperature": self.cfg.temperature,
                "max_tokens": self.cfg.max_tokens}
        if self.cfg.json_mode:
            body["response_format"] = {"type": "json_object"}
        return body

    def chat(self, messages: list[dict]) -> Reply:
        import rollout

        body = self.body(messages)
        key = request_key("/chat/completions", body)
        rec = self.cache.get(key)
        cached = rec is not None
        if not cached:
            try:
                out = self.client.post("/chat/completions", body)
            except rollout.ApiError as e:  # gave up after retries, or a 4xx: nothing to cache
                return self._count(Reply(None, f"api: {e}"))
            usage = out.get("usage") or {}
            pt, ct = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
            rec = {"request": body, "response": out, "prompt_tokens": pt, "completion_tokens": ct,
                   "cost_usd": price_usd(self.cfg.prices_per_mtok, self.cfg.api_model, pt, ct), "time": time.time()}
            self.cache.put(key, rec)
        try:
            text = rec["response"]["choices"][0]["message"]["content"]
            error = None if isinstance(text, str) else "response has no message content"
        except (KeyError, IndexError, TypeError):
            text, error = None, "response has no choices[0].message.content"
        r = Reply(text if error is None else "", error, rec["prompt_tokens"], rec["completion_tokens"],
                  rec["cost_usd"], cached)
        return self._count(r)

    def chat_many(self, requests):
        # Identical requests in one batch (two drafts that came out the same) are asked once.
        keys = [request_key("/chat/completions", self.body(m)) for m, _ in requests]
        first: dict[str, int] = {}
        for i, k in enumerate(keys):
            first.setdefault(k, i)
        with ThreadPoolExecutor(max(1, self.cfg.concurrency)) as pool:
            asked = dict(zip(first.values(), pool.map(lambda i: self.chat(requests[i][0]), first.values())))
        out = []
        for i, k in enumerate(keys):
            r = asked[first[k]]
            if i != first[k] and r.text is not None:
                r = self._count(Reply(r.text, r.error, r.prompt_tokens, r.completion_tokens, r.cost_usd, True))
            out.append(r)
        return out


def _messages_key(messages: list[dict]) -> str:
    return json.dumps(messages, sort_keys=True, ensure_ascii=False)


class PromptedTokenizer:
    """The policy's tokenizer with other prompts: the rollout engine builds every
    prompt as `sandbox.prompt_ids(tokenizer, text)`, i.e. the chat template over
    `sandbox.prompt_messages(text)`; this wrapper swaps those messages for the
    ones registered for `text`, and passes everything else through."""

    def __init__(self, tokenizer, prompts: dict[str, list[dict]]):
        self._tok = tokenizer
        self._by_key = {_messages_key(sandbox.prompt_messages(t)): m for t, m in prompts.items()}

    def apply_chat_template(self, messages, *args, **kwargs):
        return self._tok.apply_chat_template(self._by_key.get(_messages_key(messages), messages), *args, **kwargs)

    def __len__(self) -> int:
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def unique_rounds(keys: Sequence[str]) -> list[list[int]]:
    """Positions grouped so that no group holds a key twice (one prompt per document text per rollout call)."""
    rounds: list[list[int]] = []
    seen: list[set[str]] = []
    for i, k in enumerate(keys):
        for r, s in zip(rounds, seen):
            if k not in s:
                r.append(i)
                s.add(k)
                break
        else:
            rounds.append([i])
            seen.append({k})
    return rounds


def _sampling(g: GenerateConfig, seed: int, extra_tokens: int = 0):
    import rollout

    return rollout.SamplingConfig(backend=g.backend, temperature=g.temperature, top_p=g.top_p,
                                  max_new_tokens=g.max_new_tokens + extra_tokens, batch_size=g.batch_size, seed=seed)


def load_generator(mcfg: modeling.ModelConfig, g: GenerateConfig):
    """(model or vLLM engine, tokenizer) for the rollout engine."""
    if g.backend == "vllm":
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(f"generate.backend='vllm' needs vLLM: {modeling.GPU_INSTALL_HINT}") from e
        path = modeling.resolve_model_path(mcfg.name_or_path)
        return LLM(model=path, enable_prefix_caching=True), modeling.load_tokenizer(path)
    return modeling.load_policy(mcfg, train=False)


def written_text(ep: sandbox.Episode) -> str:
    """What the policy wrote, tool calls included, results excluded."""
    return "".join(t.text for t in ep.turns)


class ModelTeacher(Teacher):
    """A local teacher through the rollout engine (greedy by default), cached like the API."""

    def __init__(self, cfg: TeacherConfig, model=None, tokenizer=None):
        super().__init__()
        self.cfg = cfg
        self.model, self.tok = (model, tokenizer) if model is not None else load_generator(cfg.model, cfg.generate)
        self.cache = DiskCache(cfg.cache_dir)
        self.name = f"model:{cfg.model.name_or_path}"

    def chat_many(self, requests):
        import rollout

        out: list[Reply | None] = [None] * len(requests)
        keys, todo = [], []
        for i, (messages, doc) in enumerate(requests):
            k = request_key("model", {"model": self.cfg.model.name_or_path, "adapter": self.cfg.model.adapter_path,
                                      "generate": vars(self.cfg.generate), "messages": messages})
            keys.append(k)
            rec = self.cache.get(k)
            if rec is not None:
                out[i] = self._count(Reply(rec["text"], None, rec["prompt_tokens"], rec["completion_tokens"], 0.0,
                                           True))
            else:
                todo.append(i)
        for rnd in unique_rounds([requests[i][1] for i in todo]):
            idx = [todo[j] for j in rnd]
            tok = PromptedTokenizer(self.tok, {requests[i][1]: requests[i][0] for i in idx})
            eps = rollout.rollout(self.model, tok, [sandbox.index_for(requests[i][1]) for i in idx], 1,
                                  _sampling(self.cfg.generate, 0))
            for i, ep in zip(idx, eps):
                text = written_text(ep)
                pt = len(sandbox.prompt_ids(tok, requests[i][1]))
                ct = sum(len(t.ids or []) for t in ep.turns)
                self.cache.put(keys[i], {"text": text, "prompt_tokens": pt, "completion_tokens": ct})
                out[i] = self._count(Reply(text, None, pt, ct))
        return out


def make_teacher(cfg: TeacherConfig) -> Teacher | None:
    if cfg.backend == "api":
        return ApiTeacher(cfg)
    if cfg.backend == "model":
        return ModelTeacher(cfg)
    return None


# ---------------------------------------------------------------------------
# Annotation: the teacher's JSON, validated
# ---------------------------------------------------------------------------

ANNOTATE_SYSTEM = (
    "You are a meticulous fact-checker of news summaries. You compare a summary with its source article "
    "and report every factual error in the summary, and nothing else. Answer with JSON only."
)
ANNOTATE_USER = """Article:
{document}

Summary:
{summary}

Find every factual error in the summary: a wrong name, number, date, a negation or a predicate the article does
not support, or a claim the article does not make. Answer with a JSON object
{{"errors": [{{"error_span": "...", "corrected_clause": "...", "regex_key": "..."}}]}} where
- error_span is the exact wrong text, copied from the summary;
- corrected_clause is the whole summary sentence that contains it, rewritten with all of its errors fixed using
  only the article ("" if the sentence should simply be dropped);
- regex_key is a Python regular expression, without slashes, that finds the article sentence which proves the
  correction; build it from words the summary sentence gets right, never from the corrected value.
Answer {{"errors": []}} if the summary has no error."""


def annotation_messages(document: str, summary: str) -> list[dict]:
    return [{"role": "system", "content": ANNOTATE_SYSTEM},
            {"role": "user", "content": ANNOTATE_USER.format(document=document, summary=summary)}]


@dataclass
class Annotation:
    labels: list[dict] = field(default_factory=list)  # valid labels, with sentence_index (and type)
    rejected: list[dict] = field(default_factory=list)  # {"item", "reason"} for each invalid item
    error: str | None = None  # the whole answer is unusable (junk): the trace is kept as "rejected"
    failed: str | None = None  # no answer (the API gave up): the document is retried on the next run
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    requests: int = 0  # new (paid) requests
    cached: int = 0  # answers read back from the cache

    def add(self, r: Reply) -> None:
        self.prompt_tokens += r.prompt_tokens
        self.completion_tokens += r.completion_tokens
        self.cost_usd += r.cost_usd
        self.requests += not r.cached and r.text is not None
        self.cached += r.cached

    def merge(self, other: "Annotation") -> None:
        """Fold a later round's answer into this one (costs add up; the first failure sticks)."""
        self.rejected += other.rejected
        self.error = self.error or other.error
        self.failed = self.failed or other.failed
        for f in ("prompt_tokens", "completion_tokens", "cost_usd", "requests", "cached"):
            setattr(self, f, getattr(self, f) + getattr(other, f))


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def parse_json(text: str):
    """JSON from a model's answer (a ```json fence around it is allowed). Raises ValueError."""
    m = _FENCE.match(text)
    return json.loads(m.group(1) if m else text)


def label_problem(item, document: str, summary: str) -> tuple[str | None, dict | None]:
    """(reason, None) for an invalid teacher item, or (None, label) with its sentence_index."""
    if not isinstance(item, dict):
        return f"an error must be a JSON object, got {type(item).__name__}", None
    for k in ("error_span", "corrected_clause", "regex_key"):
        if k not in item:
            return f"missing key {k!r}", None
        if not isinstance(item[k], str):
            return f"{k} must be a string, got {type(item[k]).__name__}", None
    span, fixed, key = item["error_span"], item["corrected_clause"].strip(), item["regex_key"].strip()
    if not span.strip():
        return "error_span is empty", None
    at = summary.find(span)
    if at < 0:
        return "error_span does not occur in the summary", None
    spans = sandbox.sentence_spans(summary)
    where = [i for i, (a, b) in enumerate(spans) if a <= at < b]
    if not where or at + len(span.rstrip()) > spans[where[0]][1]:
        return "error_span crosses a sentence boundary", None
    sentence = summary[spans[where[0]][0]:spans[where[0]][1]]
    if fixed == sentence.strip():
        return "corrected_clause repeats the wrong sentence", None
    if len(key) >= 2 and key[0] == "/" and key[-1] == "/":
        key = key[1:-1]  # the teacher wrapped it in slashes itself
    if not key:
        return "regex_key is empty", None
    ep = sandbox.replay(document, f"<search>/({key})/</search>")
    call = ep.calls[0] if ep.calls else None
    if call is None or not call.valid:
        return f"regex_key is not a valid search ({call.error if call else 'no call'})", None
    if call.error:
        return f"regex_key: {call.error}", None
    if not call.hits:
        return "regex_key finds nothing in the document", None
    label = {"error_span": span, "corrected_clause": fixed, "regex_key": key,
             "type": item["type"] if isinstance(item.get("type"), str) else "unknown", "sentence_index": where[0]}
    return None, label


def parse_annotation(text: str, document: str, summary: str) -> Annotation:
    """Validate a teacher's answer item by item: junk is rejected with a reason, never dropped silently."""
    ann = Annotation()
    try:
        obj = parse_json(text)
    except ValueError as e:
        ann.error = f"answer is not JSON ({e}): {text[:80]!r}"
        return ann
    items = obj.get("errors") if isinstance(obj, dict) else obj
    if not isinstance(items, list):
        ann.error = 'answer is not {"errors": [...]} or a JSON list'
        return ann
    for item in items:
        reason, label = label_problem(item, document, summary)
        if reason:
            ann.rejected.append({"item": item, "reason": reason})
        else:
            ann.labels.append(label)
    return ann


class OracleAnnotator:
    """The news world's oracle: checks any summary against the fact table, in the teacher's schema."""

    name = "oracle"

    def __init__(self):
        self.teacher = None

    def annotate_many(self, pairs: Sequence[tuple[data.Document, str]]) -> list[Annotation]:
        out = []
        for doc, summary in pairs:
            if not doc.facts:
                raise data.DataError(f"document {doc.id!r} has no fact table: the oracle needs news world documents")
            out.append(Annotation(labels=oracle.oracle_errors(doc, summary)))
        return out


class TeacherAnnotator:
    def __init__(self, teacher: Teacher):
        self.teacher, self.name = teacher, teacher.name

    def annotate_many(self, pairs):
        replies = self.teacher.chat_many([(annotation_messages(d.text, s), d.text) for d, s in pairs])
        out = []
        for (doc, summary), r in zip(pairs, replies):
            if r.text is None:
                ann = Annotation(failed=r.error)
            elif r.error:
                ann = Annotation(error=r.error)
            else:
                ann = parse_annotation(r.text, doc.text, summary)
            ann.add(r)
            out.append(ann)
        return out


def make_annotator(cfg: TeacherConfig):
    if cfg.backend == "oracle":
        return OracleAnnotator()
    if cfg.backend == "none":
        raise settings.ConfigError("annotator.backend='none': the pipeline needs a fact-checker (oracle, api, model)")
    return TeacherAnnotator(make_teacher(cfg))


# ---------------------------------------------------------------------------
# The reasoning judge: a score in [0, 1] with cited spans
# ---------------------------------------------------------------------------

JUDGE_SYSTEM = ("You grade how well a summariser used its tools. You cite the trace as evidence. "
                "Answer with JSON only.")
JUDGE_USER = """Article:
{document}

Trace (the summariser's output; <results> blocks are what its searches returned):
{trace}

Grade the reasoning: did each search look for the right evidence, was each delete justified by the results, is
each correction supported, and was restraint shown where the summary was already right? Answer with a JSON object
{{"score": <number from 0 to 1>, "evidence": [{{"span": "<exact quote from the trace>", "why": "..."}}]}}
with at least one cited span."""


def judge_answer(text: str, trace: str) -> dict:
    """{"score", "evidence"} from a judge's answer, or {"score": None, "error"}; cited spans must be in the trace."""
    try:
        obj = parse_json(text)
    except ValueError as e:
        return {"score": None, "error": f"answer is not JSON ({e})"}
    if not isinstance(obj, dict):
        return {"score": None, "error": "answer is not a JSON object"}
    score, ev = obj.get("score"), obj.get("evidence")
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0 <= score <= 1:
        return {"score": None, "error": f"score must be a number in [0, 1], got {score!r}"}
    if not isinstance(ev, list) or not ev:
        return {"score": None, "error": "no evidence cited"}
    for e in ev:
        span = e.get("span") if isinstance(e, dict) else None
        if not isinstance(span, str) or not span.strip() or span not in trace:
            return {"score": None, "error": f"cited span not found in the trace: {str(span)[:60]!r}"}
    return {"score": float(score), "evidence": ev}


def body(turn: sandbox.Turn) -> str:
    """The text a turn wrote before its tool call (all of it when there is none)."""
    return turn.text[:turn.call.start] if turn.call else turn.text


def correction_steps(ep: sandbox.Episode) -> tuple[list[dict], list[int]]:
    """The corrections of a trace and its search-only searches.

    A correction is a delete with the searches right before it (back to the
    one written after the retracted sentence): {"delete": turn, "searches":
    [turns], "deleted": text, "corrected": text}. The corrected sentence is
    `meta["corrections"]` when synth recorded it, else the first sentence written
    after the delete. Every other search is a search-only one (turn indices).
    """
    turns, steps, corrective = ep.turns, [], set()
    recorded = ep.meta.get("corrections") or []
    for i, t in enumerate(turns):
        if not (t.call and t.call.kind == "delete"):
            continue
        searches, j = [], i - 1
        while not body(turns[j + 1]).strip() and j >= 0 and turns[j].call and turns[j].call.kind == "search":
            searches.insert(0, j)
            j -= 1
        if len(recorded) > len(steps):
            fixed = recorded[len(steps)]["corrected"]
        else:
            fixed = (sandbox.split_sentences(body(turns[i + 1])) or [""])[0] if i + 1 < len(turns) else ""
        steps.append({"delete": i, "searches": searches, "deleted": t.call.deleted or "", "corrected": fixed})
        corrective.update(searches)
    only = [i for i, t in enumerate(turns) if t.call and t.call.kind == "search" and i not in corrective]
    return steps, only


def oracle_flags(doc: data.Document, sentences: Sequence[str]) -> list[bool]:
    """Whether the oracle finds an error in each sentence, in one oracle call when the joined text splits back
    into the same sentences (the oracle's per-call set-up dominates its cost)."""
    sentences = [" ".join(s.split()) for s in sentences]
    joined = " ".join(sentences)
    if sandbox.split_sentences(joined) == sentences:
        flagged = {lab["sentence_index"] for lab in oracle.oracle_errors(doc, joined)}
        return [i in flagged for i in range(len(sentences))]
    return [bool(oracle.oracle_errors(doc, s)) for s in sentences]


def oracle_judge(doc: data.Document, ep: sandbox.Episode) -> dict:
    """The news world's stand-in for the judge: the share of justified tool steps, each cited.

    A delete is justified when the retracted text had an oracle error, its
    correction when it has none, a search before a delete when it found
    something, a search-only search when the sentence before it was right."""
    checks = []  # (text the oracle checks or None, should it be wrong, verdict without text, quote, why, why not)
    steps, only = correction_steps(ep)

    def quote(k: int) -> str:
        c = ep.turns[k].call
        return ep.turns[k].text[c.start:c.end]

    for st in steps:
        checks.append((st["deleted"] or None, True, False, quote(st["delete"]),
                       "retracted a wrong sentence", "retracted a right sentence"))
        if st["corrected"]:
            checks.append((st["corrected"], False, False, st["corrected"], "correction is supported",
                           "correction is wrong"))
        for k in st["searches"]:
            checks.append((None, None, bool(ep.turns[k].call.hits), quote(k), "found evidence", "found nothing"))
    for k in only:
        sent = (sandbox.split_sentences(body(ep.turns[k])) or [""])[-1]
        checks.append((sent or None, False, False, quote(k), "checked a right sentence", "kept a wrong sentence"))
    if not checks:
        ok = not oracle.oracle_errors(doc, ep.summary)
        return {"score": float(ok), "evidence": [{"span": ep.summary[:80], "why": "no tool use; the summary is "
                                                  + ("right" if ok else "wrong")}]}
    texts = [c[0] for c in checks if c[0]]
    flags = iter(oracle_flags(doc, texts))
    verdicts = []
    for text, want_wrong, fixed, q, yes, no in checks:
        ok = next(flags) == want_wrong if text else fixed
        verdicts.append((ok, q, yes if ok else no))
    return {"score": sum(ok for ok, _, _ in verdicts) / len(verdicts),
            "evidence": [{"span": q, "why": why} for _, q, why in verdicts]}


class Judge:
    def __init__(self, cfg: TeacherConfig, teacher: Teacher | None = None):
        self.backend = cfg.backend
        self.teacher = teacher if teacher is not None else make_teacher(cfg)
        self.name = self.teacher.name if self.teacher else cfg.backend

    def judge_many(self, items: Sequence[tuple[data.Document, sandbox.Episode]]) -> list[dict]:
        if self.backend == "oracle":
            return [dict(oracle_judge(d, ep), backend="oracle") for d, ep in items]
        replies = self.teacher.chat_many([
            ([{"role": "system", "content": JUDGE_SYSTEM},
              {"role": "user", "content": JUDGE_USER.format(document=d.text, trace=ep.text)}], d.text)
            for d, ep in items])
        out = []
        for (d, ep), r in zip(items, replies):
            res = judge_answer(r.text, ep.text) if r.text else {"score": None, "error": r.error or "no answer"}
            res.update(backend=self.name, cost_usd=r.cost_usd, cached=r.cached)
            out.append(res)
        return out


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


def stable_hash(s: str) -> int:
    return int(hashlib.sha256(s.encode("utf-8")).hexdigest()[:12], 16)


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
        import rollout

        out: list[sandbox.Episode | None] = [None] * len(items)
        for rnd in unique_rounds([it.doc.text for it in items]):
            its = [items[i] for i in rnd]
            tok = PromptedTokenizer(self.tok, {it.doc.text: self.messages(it) for it in its})
            docs = [sandbox.index_for(it.doc.text) for it in its]
            self.calls += 1
            seed = self.seed * 100_003 + self.calls
            if prefixes is None:
                eps = rollout.rollout(self.model, tok, docs, 1, _sampling(self.cfg.generate, seed))
            else:
                scripts = {j: forced_ids(self.tok, prefixes[i]) for j, i in enumerate(rnd)}
                longest = max((len(s) for s in scripts.values()), default=0)
                sampling = _sampling(self.cfg.generate, seed, longest)
                if sampling.backend == "vllm":
                    eps = _continue_vllm(self.model, tok, docs, [scripts[j] for j in range(len(rnd))], sampling)
                else:
                    eps = rollout.rollout(self.model, tok, docs, 1, sampling,
                                          logits_processor=rollout.ScriptedProcessor(scripts))
            for i, ep in zip(rnd, eps):
                out[i] = ep
        return out

    def draft(self, items: Sequence[Item]) -> list[Draft]:
        # The drafter's own tool calls (if it is a tool-trained policy) are dropped: only the summary counts.
        return [Draft(ep.summary, [], self.prompt_id(it)) for it, ep in zip(items, self._generate(items, None))]

    def continue_(self, items: Sequence[Item], prefixes: Sequence[str]) -> list[tuple[str, str | None]]:
        """(continuation text, error) per item: what the drafter wrote after the forced prefix."""
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
    import rollout
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    codec, eos = sandbox.Codec(tokenizer), rollout.stop_ids(tokenizer)
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
                                 stop=rollout.API_STOPS, include_stop_str_in_output=True, stop_token_ids=eos)
                  for _, n in reqs]
        return [(list(o.outputs[0].token_ids), None, "length" if o.outputs[0].finish_reason == "length" else "stop")
                for o in llm.generate(prompts, params, use_tqdm=False)]

    live = [b for b in builders if not b.done]
    rollout._drive_multiturn(live, generate_round, sampling.max_new_tokens)
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
    own = {"own": own_query, "own_words": own_words_query}.get(cfg.search_query)
    return {"own": own, "rewrite": rewrite}


def _query_fn(it: Item, cfg: Config) -> Callable[[str], str | None]:
    rng = it.rng("query")
    return lambda s: support_query(it.doc.text, s, cfg.search_query, rng, it.doc.entities)


def _finish(it: Item, text: str, draft: Draft, labels: list[dict], ann: Annotation, corrections: list[dict],
            drafter, annotator, cfg: Config, extra: dict | None = None) -> sandbox.Episode:
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
            text, corrections = render(sandbox.split_sentences(d.text), group_labels(ann.labels), _query_fn(it, cfg),
                                       it.rng("positives"), cfg.search_rate, **_render_kw(it, cfg))
        traces.append(_finish(it, text, d, ann.labels, ann, corrections, drafter, annotator, cfg))
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
            n_kept = len(sandbox.split_sentences(k))  # labels on the fixed prefix were dealt with already
            groups = {j - n_kept: labs for j, labs in group_labels(ann.labels).items() if j >= n_kept}
            sentences = sandbox.split_sentences(s.open)
            if not groups or rnd == cfg.drafter.max_rounds:
                text, _ = render(sentences, {}, _query_fn(it, cfg), it.rng(f"positives{rnd}"), cfg.search_rate,
                                 avoid=set(groups), **_render_kw(it, cfg))
                s.prefix = " ".join(x for x in (s.prefix, text) if x)
                s.labels += [lab for labs in groups.values() for lab in labs]
                s.open_errors = sum(len(v) for v in groups.values())
                s.done = True
                continue
            j = min(groups)
            text, corr = render(sentences[:j + 1], {j: groups[j]}, _query_fn(it, cfg), it.rng(f"positives{rnd}"),
                                cfg.search_rate, ends_trace=False, **_render_kw(it, cfg))
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
        traces.append(_finish(it, text, d, s.labels, s.ann, s.corrections, drafter, annotator, cfg, extra))
    return traces, failed


# ---------------------------------------------------------------------------
# Files: resumable output, shards, merge
# ---------------------------------------------------------------------------


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


def merge(out: str, inputs: Sequence[str]) -> dict:
    """Join shard files: identical duplicates (same id) are kept once, conflicting ones are an error."""
    seen: dict[str, tuple[str, str]] = {}
    lines = []
    dups = 0
    for path in inputs:
        for n, rec in iter_trace_lines(path):
            tid = rec.get("meta", {}).get("id")
            if tid is None:
                raise data.DataError(f"{path}:{n}: trace without meta.id")
            canon = json.dumps(rec, sort_keys=True, ensure_ascii=False)
            if tid in seen:
                if seen[tid][0] != canon:
                    raise data.DataError(f"{path}:{n}: trace {tid!r} conflicts with the one in {seen[tid][1]}")
                dups += 1
                continue
            seen[tid] = (canon, f"{path}:{n}")
            lines.append(json.dumps(rec, ensure_ascii=False))
    common.atomic_write_text(out, "".join(x + "\n" for x in lines))
    return {"traces": len(lines), "duplicates": dups, "inputs": len(inputs)}


def load_docs(cfg: Config) -> list[data.Document]:
    if not os.path.exists(cfg.docs_path):
        if cfg.generate_docs <= 0:
            raise data.DataError(f"{cfg.docs_path} does not exist (write it with python data.py newsworld "
                                 f"--out {cfg.docs_path}, or set generate_docs)")
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
    docs = [d for d in load_docs(cfg) if shard_of(d.id, sn) == si]
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
        main(settings.load_config(Config, flags_to_keys(argv)))
    except (settings.ConfigError, data.DataError) as e:  # bad input: one line, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def flags_to_keys(argv: Sequence[str]) -> list[str]:
    """`--shard i/n` and `--limit N` (or `--shard=i/n`) as the config keys they are: `shard=i/n`, `limit=N`."""
    out, it = [], iter(argv)
    for a in it:
        flag = next((f for f in ("--shard", "--limit") if a == f or a.startswith(f + "=")), None)
        if flag is None:
            out.append(a)
        elif a == flag:
            value = next(it, None)
            if value is None:
                raise settings.ConfigError(f"{flag} needs a value")
            out.append(f"{flag[2:]}={value}")
        else:
            out.append(a[2:])
    return out


if __name__ == "__main__":
    sys.exit(cli())
