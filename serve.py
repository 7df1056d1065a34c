"""Serve a trained policy over HTTP, with its tools running on the server.

    python serve.py --model runs/rl_tiny/final [--backend hf|vllm] [--port 8000] [key=value ...]
    curl -s localhost:8000/v1/summarize -d '{"document": "Acme said on Monday ..."}'

Endpoints:
- `POST /v1/summarize` with `{"document": "...", "id": "optional"}` returns the
  final summary, every tool call (a search's query and the sentences it
  returned; a delete's scope and the text it retracted), the reward's scores
  (each rule, factuality with its backend named, pass), the claims the backend
  found unsupported, token counts and latency. Bad input gets a 4xx with a
  one-line `{"error": ...}`: an empty, non-UTF-8, non-JSON or too deeply nested
  body (400), a missing or empty `document` or text that cannot be encoded
  (422), one over `max_document_chars` or a prompt longer than the model's
  context (413).
- `GET /health`: the model, backend, uptime, queue depth and the batcher's
  state; 503 when the batcher is stuck on one batch past `stuck_after_s`.
- `GET /metrics`: Prometheus text (requests by status, latency and batch-size
  histograms, tool calls, generated tokens, passes, unsupported-claim flags).

Episodes decode through the same engine and sandbox as training and evaluation
(`engine.rollout`, greedy; `engine.rollout_vllm` with `--backend vllm`) and
are scored by the same reward (`rewards.Scorer.score_batch`). Requests are batched: the
first waits up to `batch_wait_ms` for others, up to `batch_size` decode as one
engine batch, and requests arriving meanwhile queue for the next batch. Every
served episode and its scores go to a rotating JSONL log (`log`), which
`python monitor.py LOG` turns into a report with alerts.

Under load and faults:
- The queue is bounded (`max_queue`): past it a request answers 503 with
  Retry-After at once, and uvicorn refuses connections past `max_connections`.
- Each request has a deadline (`request_timeout_s`): past it, it answers 504,
  and a row still queued is never decoded. A client that hangs up is cancelled
  the same way.
- A batch that fails is decoded again one request at a time, so only the
  request that cannot be decoded answers 500.
- If the batcher task dies it is restarted (its in-hand requests answer 500).
  A hung engine thread cannot be restarted: `/health` then answers 503, for the
  supervisor (systemd, Kubernetes) to restart the process.
- On SIGTERM the server stops accepting, answers and logs the requests in
  flight (up to `shutdown_timeout_s`), then exits.

The server is uvicorn running a Starlette app rather than the standard
library's http.server: the batcher needs many waiting requests parked cheaply
on one event loop while a single worker thread owns the model, and uvicorn
brings the parts a long-running endpoint needs (a connection limit, keep-alive
timeouts, a strict HTTP parser, graceful shutdown on SIGTERM) where
http.server's documentation warns it is not meant for production. Both are
small, widely deployed ASGI packages (FastAPI is built on them).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import http.client
import json
import logging
import logging.handlers
import os
import re
import secrets
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import rewards
import sandbox
from factual_tools import common, engine, evaluation, modeling, settings

ROUTES = ("/v1/summarize", "/health", "/metrics")


@dataclass
class Config:
    model: str = "runs/rl_tiny/final"  # a trained directory: full weights (SFT) or a PEFT adapter (RL)
    backend: Literal["hf", "vllm"] = "hf"  # the decoding engine (vllm: GPU, pip install -r requirements-gpu.txt)
    host: str = "127.0.0.1"  # 0.0.0.0 to accept connections from other machines
    port: int = 8000  # 0 = any free port (the one chosen is printed)
    base: modeling.ModelConfig = field(default_factory=modeling.ModelConfig)  # dtype/quant/attention for loading
    max_new_tokens: int = 160  # per episode, all turns together
    limits: dict[str, int] = field(default_factory=dict)  # sandbox limits (sandbox.Limits names)
    tools: Literal["all", "no_search", "no_delete", "none"] = "all"  # decode-time tool ban (hf backend only)
    batch_size: int = 16  # requests decoded as one engine batch at most
    batch_wait_ms: float = 5.0  # how long the first request of a batch waits for others
    max_queue: int = 256  # requests waiting for a batch at most; past it a request answers 503 (Retry-After)
    request_timeout_s: float = 120.0  # unanswered by then: 504 (a row still queued is never decoded)
    stuck_after_s: float = 300.0  # /health answers 503 when one batch has decoded this long (a hung engine)
    max_connections: int = 1024  # uvicorn's limit_concurrency: connections past it answer 503
    shutdown_timeout_s: float = 30.0  # on SIGTERM, in-flight requests get this long to be answered
    max_document_chars: int = 20000  # longer documents get 413
    reward: rewards.RewardConfig = field(default_factory=lambda: rewards.RewardConfig(factuality="lexical"))
    claim_tau: float = 0.5  # a claim scored below this is flagged unsupported
    log: str = "runs/serve/episodes.jsonl"  # every served episode and its scores ("" = off)
    log_max_mb: float = 64.0  # the log rotates past this size ...
    log_backups: int = 5  # ... keeping this many old files (LOG.1 is the newest)
    # keep the documents and every text taken from them (search results, retracted text, summary,
    # claims) in the log; false: their lengths and a keyed hash of the document only
    log_documents: bool = False
    gpu_memory_utilization: float = 0.85  # vllm backend
    seed: int = 0
    torch_threads: int = 0  # CPU threads for torch (0 = its default)

    def __post_init__(self):
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.max_document_chars < 1:
            raise settings.ConfigError("batch_size, max_new_tokens and max_document_chars must be >= 1")
        if self.batch_wait_ms < 0 or self.log_max_mb <= 0 or self.log_backups < 0:
            raise settings.ConfigError("batch_wait_ms and log_backups must be >= 0, log_max_mb > 0")
        if min(self.max_queue, self.max_connections) < 1 or min(self.request_timeout_s, self.stuck_after_s,
                                                                self.shutdown_timeout_s) <= 0:
            raise settings.ConfigError("max_queue and max_connections must be >= 1; request_timeout_s, "
                                       "stuck_after_s and shutdown_timeout_s > 0")
        if self.reward.factuality == "oracle":
            raise settings.ConfigError("reward.factuality=oracle needs the news world's fact tables, which a "
                                       "served document does not have: use lexical, support or fenice")
        if self.backend == "vllm" and self.tools != "all":
            raise settings.ConfigError("tools bans work with backend=hf only (they are a logits processor)")


# ---------------------------------------------------------------------------
# Requests and responses (pure; the tests call these directly)
# ---------------------------------------------------------------------------


class BadRequest(ValueError):
    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status


def parse_request(body: bytes, max_chars: int) -> tuple[str, str | None]:
    """(document, client id or None) from a request body; BadRequest(status, one-line reason) otherwise."""
    if not body.strip():
        raise BadRequest(400, 'empty body: send a JSON object {"document": "..."}')
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"body is not UTF-8: byte {e.start} cannot be decoded") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"body is not JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise BadRequest(400, "body is nested too deeply") from None
    if not isinstance(obj, dict):
        raise BadRequest(422, f'body must be a JSON object {{"document": "..."}}, not a {type(obj).__name__}')
    unknown = sorted(set(obj) - {"document", "id"})
    if unknown:
        raise BadRequest(422, f"unknown field(s) {', '.join(map(repr, unknown))}; expected 'document' and 'id'")
    doc = obj.get("document")
    if doc is None:
        raise BadRequest(422, "missing field 'document'")
    if not isinstance(doc, str):
        raise BadRequest(422, f"field 'document' must be a string, not {type(doc).__name__}")
    if not doc.strip():
        raise BadRequest(422, "field 'document' is empty")
    if len(doc) > max_chars:
        raise BadRequest(413, f"document has {len(doc)} characters, over the limit of {max_chars} "
                              "(max_document_chars)")
    rid = obj.get("id")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest(422, f"field 'id' must be a string, not {type(rid).__name__}")
    for name, value in (("document", doc), ("id", rid or "")):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate ("\ud800") is valid JSON but not text
            raise BadRequest(422, f"field {name!r} holds a lone surrogate at character {e.start}, "
                                  "which is not text") from None
    return doc, rid


def body_limit(max_chars: int) -> int:
    """Bytes a request body may have: a document of `max_chars` characters, each
    JSON-escaped at worst (a character outside the BMP is a 12-byte surrogate pair
    escape), plus an id and the JSON around them."""
    return max_chars * 12 + 4096


def tool_calls(document: str, ep: sandbox.Episode) -> list[dict]:
    """Each call as the client sees it: a search's query and the sentences it returned, a
    delete's scope and the text it retracted, and the sandbox's error if it answered one."""
    sentences = sandbox.index_for(document).sentences
    out = []
    for c in ep.calls:
        if c.kind == "search":
            d = {"kind": "search", "query": c.arg, "results": [sentences[i] for i in c.hits or []]}
        else:
            d = {"kind": "delete", "scope": c.arg, "retracted": c.deleted}
        d["valid"] = c.valid
        if c.error:
            d["error"] = c.error
        out.append(d)
    return out


def episode_response(document: str, ep: sandbox.Episode, score: dict, tau: float) -> dict:
    """The response body of one served episode (latency and ids are added by the server)."""
    generated = sum(len(t.ids or ()) for t in ep.turns)
    injected = sum(len(t.inj_ids or ()) for t in ep.turns)
    flagged = evaluation.unsupported_claims(score, tau)  # the hallucination flags
    kept = {k: v for k, v in score.items() if k not in ("tool_match", "tool_match_steps", "claims")}
    return common.jsonable({
        "summary": ep.summary,
        "text": ep.text,  # what the policy wrote, tool calls and results blocks included
        "tool_calls": tool_calls(document, ep),
        "flags": {k: v for k, v in ep.flags.items() if v},
        "scores": kept,
        "unsupported_claims": flagged,
        "hallucination": bool(flagged),
        "tokens": {"prompt": len(ep.prompt_ids or ()), "generated": generated, "tool_results": injected},
    }, nonfinite="null")


# ---------------------------------------------------------------------------
# The engine: a batch of documents -> episodes and scores
# ---------------------------------------------------------------------------


class Engine:
    """Decodes and scores a batch of documents with the training stack's rollout and reward."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        if not Path(cfg.model).is_dir():
            raise SystemExit(evaluation.missing_model_hint(cfg.model))
        if cfg.backend == "hf":
            self.model, self.tok = evaluation.load_model(cfg.model, cfg)
            self.limits, self.greedy, self.ban = evaluation.decoding(self.tok, cfg)
            positions = getattr(self.model.config, "max_position_embeddings", None) or self.greedy.max_context_tokens
            self.context = min(self.greedy.max_context_tokens, positions)
        else:
            self._load_vllm()

    def check(self, document: str) -> None:
        """BadRequest(413) when the document's prompt leaves no room to write in the context."""
        n = len(sandbox.prompt_ids(self.tok, document))
        if n >= self.context - 1:
            raise BadRequest(413, f"the document's prompt is {n} tokens; the model's context is {self.context}")

    def _load_vllm(self) -> None:  # pragma: no cover - GPU stack
        modeling.require_package("vllm", "backend=vllm")
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        cfg = self.cfg
        mcfg = modeling.trained_model_config(cfg.model, cfg.base)
        self.tok = modeling.load_tokenizer(cfg.model)  # saved beside the weights or the adapter
        rank = 0
        if mcfg.adapter_path:
            rank = int(json.loads((Path(mcfg.adapter_path) / "adapter_config.json").read_text()).get("r", 16))
        self.model = LLM(model=modeling.resolve_model_path(mcfg.name_or_path), tokenizer=cfg.model,
                         enable_lora=bool(rank), max_lora_rank=max(rank, 8), max_model_len=mcfg.max_seq_len,
                         gpu_memory_utilization=cfg.gpu_memory_utilization, seed=cfg.seed,
                         tensor_parallel_size=mcfg.tensor_parallel_size)  # base.tensor_parallel_size
        self.lora = LoRARequest("policy", 1, mcfg.adapter_path) if rank else None
        self.limits, self.greedy, self.ban = evaluation.decoding(self.tok, cfg)
        self.context = mcfg.max_seq_len  # vLLM rejects a whole batch holding a longer prompt

    def run(self, documents: list[str]) -> list[tuple[dict, sandbox.Episode]]:
        """(response body, episode) per document, in order."""
        if self.cfg.backend == "hf":
            eps = engine.rollout(self.model, self.tok, documents, 1, self.greedy, self.limits,
                                  logits_processor=self.ban)
        else:  # pragma: no cover - GPU stack
            eps = engine.rollout_vllm(self.model, self.tok, documents, 1, self.greedy, self.limits,
                                       lora_request=self.lora)
        scores = rewards.Scorer(self.cfg.reward).score_batch(list(zip(documents, eps)))
        return [(episode_response(d, e, s, self.cfg.claim_tau), e) for d, e, s in zip(documents, eps, scores)]


# ---------------------------------------------------------------------------
# The episode log and the metrics
# ---------------------------------------------------------------------------


class PrivateRotatingFileHandler(logging.handlers.RotatingFileHandler):
    """A size-rotated log whose files only their owner can read (0600, whatever the umask)."""

    def _open(self):
        stream = open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors,
                      opener=lambda path, flags: os.open(path, flags, 0o600))
        os.chmod(self.baseFilename, 0o600)  # a file an older server left readable
        return stream


def hash_key(log_path: str | Path) -> bytes:
    """The key of the log's document hashes: random, made once beside the log (0600). A
    plain hash of a known document would tell anyone holding the log that it was sent."""
    path = Path(log_path).parent / "document_hash.key"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def episode_logger(cfg: Config) -> logging.Logger | None:
    """A logger writing one JSON line per record to `cfg.log`, rotated by size, files 0600."""
    if not cfg.log:
        return None
    Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"serve.episodes.{Path(cfg.log).resolve()}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    h = PrivateRotatingFileHandler(cfg.log, maxBytes=int(cfg.log_max_mb * 2**20), backupCount=cfg.log_backups,
                                   encoding="utf-8")
    h.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(h)
    return log


def log_head(cfg: Config) -> dict:
    """What every log line starts with: when, and which model served it."""
    return {"time": time.time(), "model": cfg.model, "backend": cfg.backend}


def log_record(cfg: Config, document: str, response: dict, key: bytes | None = None) -> dict:
    """The log line of one served episode: the time, the response and the document. With
    `log_documents` false, no text from the document is kept: the document becomes its
    keyed hash (HMAC-SHA256 under `key`), and search results, retracted text, the summary,
    the whole written text and the unsupported claims their lengths and counts (what
    monitor.py reads stays)."""
    head = {**log_head(cfg), "n_chars": len(document)}
    if cfg.log_documents:
        return {**head, "document": document, **response}
    calls = []
    for c in response["tool_calls"]:
        kept = {k: c[k] for k in ("kind", "scope", "valid", "error") if k in c}
        if c["kind"] == "search":
            kept.update(query_chars=len(c["query"]), n_results=len(c["results"]))
        else:
            kept["retracted_chars"] = len(c.get("retracted") or "")
        calls.append(kept)
    hidden = {"summary", "text", "tool_calls", "unsupported_claims"}
    return {**head, "document_hmac": hmac.new(key or b"", document.encode("utf-8"), hashlib.sha256).hexdigest(),
            **{k: v for k, v in response.items() if k not in hidden}, "summary_chars": len(response["summary"]),
            "text_chars": len(response.get("text") or ""), "tool_calls": calls,
            "n_unsupported_claims": len(response.get("unsupported_claims") or [])}


class Metrics:
    """The Prometheus series of one server (its own registry, so tests can run several)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry()
        self.requests = Counter("summarize_requests", "POST /v1/summarize by HTTP status", ["status"], registry=r)
        self.latency = Histogram("summarize_latency_seconds", "request to response, queueing included",
                                 buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.batch = Histogram("engine_batch_size", "requests per engine batch", buckets=(1, 2, 4, 8, 16, 32, 64),
                               registry=r)
        self.queue = Gauge("summarize_queue_depth", "requests waiting for a batch", registry=r)
        self.tools = Counter("tool_calls", "tool calls in served episodes", ["kind"], registry=r)
        self.tokens = Counter("generated_tokens", "tokens the policy generated", registry=r)
        self.passed = Counter("summaries_passed", "summaries passing the reward's threshold and rules", registry=r)
        self.flagged = Counter("summaries_flagged", "summaries with a claim scored unsupported", registry=r)

    def episode(self, response: dict) -> None:
        for c in response["tool_calls"]:
            self.tools.labels(c["kind"]).inc()
        self.tokens.inc(response["tokens"]["generated"])
        self.passed.inc(bool(response["scores"].get("pass")))
        self.flagged.inc(response["hallucination"])

    def text(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# ---------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------


class Batcher:
    """Collects requests into engine batches; one worker thread owns the engine.

    `submit` puts a request in the bounded queue (asyncio.QueueFull when it is
    full) and returns its future; cancelling the future before its batch starts
    keeps its row out of the batch. A batch that raises is decoded again one
    request at a time, so only the request that cannot be decoded fails."""

    def __init__(self, engine: Engine, cfg: Config, metrics: Metrics):
        self.engine, self.cfg, self.metrics = engine, cfg, metrics
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=cfg.max_queue)
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.in_hand: list = []  # the (document, future) pairs of the batch being decoded
        self.busy_since: float | None = None  # time.monotonic() when that batch started
        self.last_batch: float | None = None  # when the last batch finished
        self.restarts = 0

    def submit(self, document: str) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((document, fut))
        self.metrics.queue.set(self.queue.qsize())
        return fut

    async def _next_batch(self) -> list:
        loop = asyncio.get_running_loop()
        batch = [await self.queue.get()]
        deadline = loop.time() + self.cfg.batch_wait_ms / 1e3
        while len(batch) < self.cfg.batch_size:
            try:
                left = deadline - loop.time()
                batch.append(self.queue.get_nowait() if left <= 0 else await asyncio.wait_for(self.queue.get(), left))
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
        self.metrics.queue.set(self.queue.qsize())
        return [(d, f) for d, f in batch if not f.done()]  # past its deadline or hung up: not decoded

    def _work(self, documents: list[str]) -> list[dict]:
        t0 = time.perf_counter()
        out = [r for r, _ in self.engine.run(documents)]
        engine_ms = (time.perf_counter() - t0) * 1e3
        for r in out:
            r["engine_ms"] = round(engine_ms, 2)
            r["batch_size"] = len(documents)
        return out

    async def _decode(self, batch: list) -> None:
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self.worker, self._work, [d for d, _ in batch])
        except Exception as e:
            if len(batch) == 1:  # this request cannot be decoded: it answers 500, the server goes on
                if not batch[0][1].done():
                    batch[0][1].set_exception(e)
                return
            for one in batch:  # find the request that failed it: each alone
                if not one[1].done():
                    await self._decode([one])
            return
        for (_, fut), r in zip(batch, results):
            if not fut.done():
                fut.set_result(r)

    async def run(self) -> None:
        while True:
            batch = await self._next_batch()
            if not batch:
                continue
            self.metrics.batch.observe(len(batch))
            self.in_hand, self.busy_since = batch, time.monotonic()
            try:
                await self._decode(batch)
            finally:
                self.in_hand, self.busy_since, self.last_batch = [], None, time.monotonic()

    async def supervise(self) -> None:
        """Run the batcher, and start it again whenever it dies (its requests in hand answer 500)."""
        while True:
            task = asyncio.create_task(self.run())
            self.task = task
            try:
                await task
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # the server is stopping
                    task.cancel()
                    raise
            except Exception:
                logging.getLogger("serve").exception("the batcher died; restarting it")
            for _, fut in self.in_hand:
                if not fut.done():
                    fut.set_exception(RuntimeError("the batcher was restarted while decoding this request"))
            self.in_hand, self.busy_since = [], None
            self.restarts += 1

    def state(self) -> dict:
        """What /health reports: queue depth, the batch in hand and how long it has run, the
        last batch's age, restarts, and whether the engine looks stuck."""
        now = time.monotonic()
        running = None if self.busy_since is None else round(now - self.busy_since, 3)
        return {"queue": self.queue.qsize(), "max_queue": self.cfg.max_queue, "in_batch": len(self.in_hand),
                "batch_running_s": running,
                "last_batch_age_s": None if self.last_batch is None else round(now - self.last_batch, 3),
                "batcher_restarts": self.restarts, "stuck": running is not None and running > self.cfg.stuck_after_s}


async def _disconnected(request) -> None:
    """Returns when the client hangs up (the body has been read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def make_app(cfg: Config, engine: Engine):
    """The Starlette app serving `engine` (started and stopped with the app)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    metrics, log = Metrics(), episode_logger(cfg)
    key = hash_key(cfg.log) if log is not None and not cfg.log_documents else None
    state: dict = {}
    started = time.time()
    limit = body_limit(cfg.max_document_chars)

    def failed(status: int, reason: str = "") -> None:
        """Count a request that got no summary, and log it (its status and reason: no document)."""
        metrics.requests.labels(str(status)).inc()
        if log is not None:
            log.info(json.dumps({**log_head(cfg), "status": status, "error": reason[:300]}))

    def error(status: int, reason: str, headers: dict | None = None) -> JSONResponse:
        failed(status, reason)
        return JSONResponse({"error": reason}, status_code=status, headers=headers)

    async def summarize(request):
        t0 = time.perf_counter()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                return error(413, f"body over {limit} bytes (max_document_chars={cfg.max_document_chars})")
        try:
            document, rid = parse_request(bytes(body), cfg.max_document_chars)
            engine.check(document)
        except BadRequest as e:
            return error(e.status, str(e))
        batcher: Batcher = state["batcher"]
        try:
            fut = batcher.submit(document)
        except asyncio.QueueFull:
            return error(503, f"busy: {cfg.max_queue} requests are waiting (max_queue); retry later",
                         headers={"Retry-After": "1"})
        hangup = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait([fut, hangup], timeout=cfg.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
        if not fut.done():
            fut.cancel()  # still queued: never decoded; decoding: its answer is dropped
            if hangup.done() and not hangup.cancelled():
                failed(499, "the client hung up")  # nginx's code for a request its client closed
                return Response(status_code=499)
            return error(504, f"no answer within {cfg.request_timeout_s:g} s (request_timeout_s)")
        try:
            response = fut.result()
        except Exception as e:
            return error(500, f"engine error: {type(e).__name__}: {e}".splitlines()[0])
        response = {"id": rid or uuid.uuid4().hex, **response,
                    "latency_ms": round((time.perf_counter() - t0) * 1e3, 2)}
        metrics.latency.observe(response["latency_ms"] / 1e3)
        metrics.requests.labels("200").inc()
        metrics.episode(response)
        if log is not None:
            log.info(json.dumps(log_record(cfg, document, response, key), allow_nan=False))
        return JSONResponse(response)

    async def health(request):
        b: Batcher = state["batcher"]
        st = b.state()
        ok = not st["stuck"] and not state["supervisor"].done()
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": cfg.model, "backend": cfg.backend,
                             "factuality": rewards.BACKEND_NAMES[cfg.reward.factuality],
                             "uptime_s": round(time.time() - started, 1), **st}, status_code=200 if ok else 503)

    async def prometheus(request):
        body, kind = metrics.text()
        return Response(body, media_type=kind)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["batcher"] = batcher = Batcher(engine, cfg, metrics)
        state["supervisor"] = task = asyncio.create_task(batcher.supervise())
        try:
            yield
        finally:  # uvicorn has answered the requests in flight (up to shutdown_timeout_s) before this
            task.cancel()
            batcher.worker.shutdown(wait=False, cancel_futures=True)

    app = Starlette(routes=[Route("/v1/summarize", summarize, methods=["POST"]), Route("/health", health),
                            Route("/metrics", prometheus)], lifespan=lifespan)
    app.state.serve = state  # the batcher, for tests and debugging
    return app


def uvicorn_config(app, cfg: Config):
    """uvicorn's settings for `app`: a connection limit, the graceful shutdown, no access log."""
    import uvicorn

    return uvicorn.Config(app, log_level="warning", access_log=False, limit_concurrency=cfg.max_connections,
                          timeout_graceful_shutdown=cfg.shutdown_timeout_s)


def listening_socket(host: str, port: int) -> socket.socket:
    """Bound and listening before the model server starts, so the printed port already accepts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {e.strerror} (another server there? try --port 0)")
    sock.listen(2048)
    return sock


def spawn(args: list[str], cwd: str | Path | None = None) -> tuple[subprocess.Popen, int]:
    """`python serve.py ARGS` in a child process; returns it and its port once it accepts
    connections (pass `--port 0` for any free one). Stop it with `.terminate()`."""
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        m = re.search(r" on http://[^ ]*:(\d+) ", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining its output
            return proc, int(m.group(1))
    raise RuntimeError(f"serve.py exited with {proc.wait()} before serving:\n{''.join(seen[-20:])}")


def call(port: int, path: str = "/v1/summarize", body: bytes | None = None, host: str = "127.0.0.1",
         timeout: float = 300) -> tuple[int, dict | str]:
    """One request to a server (POST when `body` is given): (status, JSON body or text)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET" if body is None else "POST", path, body=body,
                     headers={} if body is None else {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read().decode("utf-8")
    finally:
        conn.close()
    return resp.status, json.loads(raw) if "json" in resp.getheader("Content-Type", "") else raw


FLAGS = {"--model": "model", "--backend": "backend", "--port": "port", "--host": "host"}


def main(cfg: Config) -> None:
    import uvicorn

    if cfg.torch_threads:
        import torch

        torch.set_num_threads(cfg.torch_threads)
    common.seed_everything(cfg.seed)
    engine = Engine(cfg)
    sock = listening_socket(cfg.host, cfg.port)
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn_config(make_app(cfg, engine), cfg))
    print(f"serving {cfg.model} ({cfg.backend}; factuality: {rewards.BACKEND_NAMES[cfg.reward.factuality]}) "
          f"on http://{host}:{port}  (log: {cfg.log or 'off'})", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    with settings.config_errors_exit():
        _cfg = settings.load_config(Config, settings.flags_as_overrides(sys.argv[1:], FLAGS))
    main(_cfg)
