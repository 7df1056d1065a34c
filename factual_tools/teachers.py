"""The models around a synthetic trace: the fact-checking teacher, its validated answer, the judge.

- Teachers: any OpenAI-compatible API (validated item by item, cached on disk by
  request hash so no call is ever paid twice, costed from a price table), or a
  local model through the rollout engine, cached the same way.
- Annotation: the teacher's JSON (`{"errors": [{"error_span", "corrected_clause",
  "regex_key"}]}`) validated against the document and the summary; junk answers
  are rejected with a reason, never trusted. The news world's oracle answers in
  the same schema (`OracleAnnotator`).
- The reasoning judge: a score in [0, 1] for a whole trace, with cited spans
  (the oracle's on the news world, a teacher's otherwise).
`synth_traces.py` runs them; `filter_traces.py` gates on the judge's score.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, Sequence


import data
import sandbox
from factual_tools import common, modeling, settings, textsplit, world

# USD per million tokens; list prices at the time of writing: check them against your provider.
DEFAULT_PRICES = {
    "gpt-4o": {"input": 2.5, "output": 10.0},
    "gpt-4o-mini": {"input": 0.15, "output": 0.6},
    "gpt-4.1": {"input": 2.0, "output": 8.0},
    "gpt-4.1-mini": {"input": 0.4, "output": 1.6},
}


@dataclass
class GenerateConfig:
    backend: Literal["hf", "hf_naive", "vllm"] = "hf"  # rollout engine backend
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 160  # generated tokens per draft or continuation (a forced prefix comes on top)
    batch_size: int = 32  # rows decoded together
    autocast: common.Autocast = "auto"  # hf backends: bf16 only where the hardware has it natively


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
    max_paid_calls: int = 0  # stop the run before the API call past this many new (paid) ones (0 = no cap)
    max_response_mb: float = 8.0  # a larger API response is refused
    model: modeling.ModelConfig = field(default_factory=modeling.ModelConfig)  # model backend: the local teacher
    generate: GenerateConfig = field(default_factory=lambda: GenerateConfig(temperature=0.0, max_new_tokens=512))


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


def request_key(path: str, body: dict, base: str | None = None) -> str:
    """sha256 of the canonical request (the server's base URL, the endpoint path and the
    JSON body, keys sorted): the same model name on another server is another answer."""
    req = {"path": path, "body": body} if base is None else {"base": base.rstrip("/"), "path": path, "body": body}
    canon = json.dumps(req, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


class SpendCapReached(SystemExit):
    """The run stopped before paying for more than `max_paid_calls` API calls. Every answer
    paid so far is in the cache: a rerun (with a higher cap) pays for none of them again."""


def complete_answer(response) -> tuple[str | None, str | None]:
    """(the text of a chat completion, None), or (None, why it is not a complete answer):
    no choices[0].message.content, an empty one, or one cut at max_tokens."""
    try:
        choice = response["choices"][0]
        text = choice["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None, "response has no choices[0].message.content"
    if not isinstance(text, str) or not text.strip():
        return None, "response has an empty message content"
    if choice.get("finish_reason") == "length":
        return None, "response was cut at max_tokens (finish_reason=length)"
    return text, None


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
    """Chat completions from an OpenAI-compatible server through `engine.ApiClient`
    (retries with exponential backoff on 429/5xx/timeouts, a concurrency limit),
    with a disk cache in front: a restart or a second run never repeats a paid call."""

    def __init__(self, cfg: TeacherConfig, client=None):
        super().__init__()
        if client is None:
            from factual_tools import engine  # torch comes with it: only teachers that call out pay for the import

            client = engine.ApiClient(cfg.api_base, cfg.api_model, key=os.environ.get(cfg.api_key_env),
                                       timeout_s=cfg.timeout_s, retries=cfg.retries, concurrency=cfg.concurrency,
                                       backoff_s=cfg.backoff_s, max_response_bytes=int(cfg.max_response_mb * 2**20))
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

    def _cached(self, body: dict) -> tuple[str, dict | None]:
        """(the cache key, the cached record or None). A record written before keys held
        the base URL is found under its old key and moved to the new one; an incomplete
        answer an older version cached counts as none."""
        key = request_key("/chat/completions", body, self.cfg.api_base)
        rec = self.cache.get(key)
        if rec is None:
            old = self.cache.get(request_key("/chat/completions", body))
            if old is not None:
                self.cache.put(key, old)
                rec = old
        if rec is not None and complete_answer(rec.get("response"))[1] is not None:
            rec = None  # an older version kept a truncated or empty answer: ask again
        return key, rec

    def _pay(self) -> None:
        """Count one new API call; stop the run instead when it would pass max_paid_calls."""
        with self._lock:
            if self.cfg.max_paid_calls and self.stats["paid_calls"] >= self.cfg.max_paid_calls:
                raise SpendCapReached(
                    f"teacher: max_paid_calls={self.cfg.max_paid_calls} reached (${self.spent_usd:.4f} spent); "
                    "every answer so far is cached: rerun with a higher cap to go on, paying for none twice")
            self.stats["paid_calls"] += 1

    def chat(self, messages: list[dict]) -> Reply:
        from factual_tools import engine

        body = self.body(messages)
        key, rec = self._cached(body)
        cached = rec is not None
        if not cached:
            self._pay()
            try:
                out = self.client.post("/chat/completions", body)
            except engine.ApiError as e:  # gave up after retries, a 4xx, junk: nothing to cache
                return self._count(Reply(None, f"api: {e}"))
            pt, ct = engine.usage_tokens(out)
            rec = {"request": body, "base": self.cfg.api_base, "response": out, "prompt_tokens": pt,
                   "completion_tokens": ct, "cost_usd": price_usd(self.cfg.prices_per_mtok, self.cfg.api_model, pt, ct),
                   "time": time.time()}
            text, error = complete_answer(out)
            if error is not None:  # paid, but not an answer to keep: asked again next time
                with self._lock:
                    self.spent_usd += rec["cost_usd"]
                return self._count(Reply(None, f"api: {error}", pt, ct))
            self.cache.put(key, rec)
        text, error = complete_answer(rec["response"])
        r = Reply(text if error is None else "", error, rec["prompt_tokens"], rec["completion_tokens"],
                  rec["cost_usd"], cached)
        return self._count(r)

    def chat_many(self, requests):
        # Identical requests in one batch (two drafts that came out the same) are asked once.
        keys = [request_key("/chat/completions", self.body(m), self.cfg.api_base) for m, _ in requests]
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


def sampling_for(g: GenerateConfig, seed: int, extra_tokens: int = 0):
    from factual_tools import engine

    return engine.SamplingConfig(backend=g.backend, temperature=g.temperature, top_p=g.top_p,
                                  max_new_tokens=g.max_new_tokens + extra_tokens, batch_size=g.batch_size, seed=seed)


def load_generator(mcfg: modeling.ModelConfig, g: GenerateConfig):
    """(model or vLLM engine, tokenizer) for the rollout engine."""
    if g.backend == "vllm":
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(f"generate.backend='vllm' needs vLLM: {modeling.GPU_INSTALL_HINT}") from e
        path = modeling.resolve_model_path(mcfg.name_or_path)
        return (LLM(model=path, enable_prefix_caching=True, tensor_parallel_size=mcfg.tensor_parallel_size),
                modeling.load_tokenizer(path))
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
        from factual_tools import engine

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
            with common.autocast_for(self.cfg.generate.autocast, self.model):
                eps = engine.rollout(self.model, tok, [sandbox.index_for(requests[i][1]) for i in idx], 1,
                                      sampling_for(self.cfg.generate, 0))
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
    spans = textsplit.sentence_spans(summary)
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
        oracle = world.world("the oracle teacher")
        out = []
        for doc, summary in pairs:
            if not doc.facts:
                raise data.DataError(f"document {doc.id!r} has no fact table: the oracle needs news world documents")
            out.append(Annotation(labels=oracle.errors(doc, summary)))
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
            fixed = (textsplit.split_sentences(body(turns[i + 1])) or [""])[0] if i + 1 < len(turns) else ""
        steps.append({"delete": i, "searches": searches, "deleted": t.call.deleted or "", "corrected": fixed})
        corrective.update(searches)
    only = [i for i, t in enumerate(turns) if t.call and t.call.kind == "search" and i not in corrective]
    return steps, only


def oracle_flags(doc: data.Document, sentences: Sequence[str]) -> list[bool]:
    """Whether the oracle finds an error in each sentence, in one oracle call when the joined text splits back
    into the same sentences (the oracle's per-call set-up dominates its cost)."""
    oracle = world.world("the oracle's sentence flags")
    sentences = [" ".join(s.split()) for s in sentences]
    joined = " ".join(sentences)
    if textsplit.split_sentences(joined) == sentences:
        flagged = {lab["sentence_index"] for lab in oracle.errors(doc, joined)}
        return [i in flagged for i in range(len(sentences))]
    return [bool(oracle.errors(doc, s)) for s in sentences]


def oracle_judge(doc: data.Document, ep: sandbox.Episode) -> dict:
    """The news world's stand-in for the judge: the share of justified tool steps, each cited.

    A delete is justified when the retracted text had an oracle error, its
    correction when it has none, a search before a delete when it found
    something, a search-only search when the sentence before it was right."""
    oracle = world.world("the oracle judge")
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
        sent = (textsplit.split_sentences(body(ep.turns[k])) or [""])[-1]
        checks.append((sent or None, False, False, quote(k), "checked a right sentence", "kept a wrong sentence"))
    if not checks:
        ok = not oracle.errors(doc, ep.summary)
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
