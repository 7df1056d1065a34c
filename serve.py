"""Serve a trained policy over HTTP, with its tools running on the server.

    python serve.py --model runs/rl_tiny/final [--backend hf|vllm] [--port 8000] [key=value ...]
    curl -s localhost:8000/v1/summarize -d '{"document": "Acme said on Monday ..."}'

Endpoints:
- `POST /v1/summarize` with `{"document": "...", "id": "optional"}` returns the
  final summary, every tool call (a search's query and the sentences it
  returned; a delete's scope and the text it retracted), the reward's scores
  (each rule, factuality with its backend named, pass), the claims the backend
  found unsupported, token counts and latency. Bad input gets a 4xx with a
  one-line `{"error": ...}`: an empty, non-UTF-8 or non-JSON body (400), a
  missing or empty `document` (422), one over `max_document_chars` (413).
- `GET /health`: the model, backend and uptime.
- `GET /metrics`: Prometheus text (requests by status, latency and batch-size
  histograms, tool calls, generated tokens, passes, unsupported-claim flags).

Episodes decode through the same engine and sandbox as training and evaluation
(`rollout.rollout`, greedy; `rollout.rollout_vllm` with `--backend vllm`) and
are scored by the same reward (`rewards.score_batch`). Requests are batched: the
first waits up to `batch_wait_ms` for others, up to `batch_size` decode as one
engine batch, and requests arriving meanwhile queue for the next batch. Every
served episode and its scores go to a rotating JSONL log (`log`), which
`python monitor.py LOG` turns into a report with alerts.

The server is uvicorn running a Starlette app rather than the standard
library's http.server: the batcher needs many waiting requests parked cheaply
on one event loop while a single worker thread owns the model, and uvicorn
brings the parts a long-running endpoint needs (keep-alive and request
timeouts, a strict HTTP parser, graceful shutdown on SIGTERM) where
http.server's documentation warns it is not meant for production. Both are
small, widely deployed ASGI packages (FastAPI is built on them).
"""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import logging.handlers
import re
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

import common
import data
import eval as evaluation
import modeling
import rewards
import rollout
import sandbox
import settings

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
    max_document_chars: int = 20000  # longer documents get 413
    reward: rewards.RewardConfig = field(default_factory=lambda: rewards.RewardConfig(factuality="lexical"))
    claim_tau: float = 0.5  # a claim scored below this is flagged unsupported
    log: str = "runs/serve/episodes.jsonl"  # every served episode and its scores ("" = off)
    log_max_mb: float = 64.0  # the log rotates past this size ...
    log_backups: int = 5  # ... keeping this many old files (LOG.1 is the newest)
    log_documents: bool = True  # keep each request's document in the log (false: its length and hash only)
    gpu_memory_utilization: float = 0.85  # vllm backend
    seed: int = 0
    torch_threads: int = 0  # CPU threads for torch (0 = its default)

    def __post_init__(self):
        if self.batch_size < 1 or self.max_new_tokens < 1 or self.max_document_chars < 1:
            raise settings.ConfigError("batch_size, max_new_tokens and max_document_chars must be >= 1")
        if self.batch_wait_ms < 0 or self.log_max_mb <= 0 or self.log_backups < 0:
            raise settings.ConfigError("batch_wait_ms and log_backups must be >= 0, log_max_mb > 0")
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
    return doc, rid


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
        else:
            self._load_vllm()

    def _load_vllm(self) -> None:  # pragma: no cover - GPU stack
        modeling._require("vllm", "backend=vllm")
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
                         gpu_memory_utilization=cfg.gpu_memory_utilization, seed=cfg.seed)
        self.lora = LoRARequest("policy", 1, mcfg.adapter_path) if rank else None
        self.limits, self.greedy, self.ban = evaluation.decoding(self.tok, cfg)

    def run(self, documents: list[str]) -> list[tuple[dict, sandbox.Episode]]:
        """(response body, episode) per document, in order."""
        if self.cfg.backend == "hf":
            eps = rollout.rollout(self.model, self.tok, documents, 1, self.greedy, self.limits,
                                  logits_processor=self.ban)
        else:  # pragma: no cover - GPU stack
            eps = rollout.rollout_vllm(self.model, self.tok, documents, 1, self.greedy, self.limits,
                                       lora_request=self.lora)
        scores = rewards.score_batch(list(zip(documents, eps)), self.cfg.reward)
        return [(episode_response(d, e, s, self.cfg.claim_tau), e) for d, e, s in zip(documents, eps, scores)]


# ---------------------------------------------------------------------------
# The episode log and the metrics
# ---------------------------------------------------------------------------


def episode_logger(cfg: Config) -> logging.Logger | None:
    """A logger writing one JSON line per record to `cfg.log`, rotated by size."""
    if not cfg.log:
        return None
    Path(cfg.log).parent.mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"serve.episodes.{Path(cfg.log).resolve()}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    h = logging.handlers.RotatingFileHandler(cfg.log, maxBytes=int(cfg.log_max_mb * 2**20),
                                             backupCount=cfg.log_backups, encoding="utf-8")
    h.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(h)
    return log


def log_record(cfg: Config, document: str, response: dict) -> dict:
    """The log line of one served episode: the response, the document (or its hash) and the time."""
    doc = {"document": document} if cfg.log_documents else {"document_sha": data.content_hash(document)}
    return {"time": time.time(), "model": cfg.model, "backend": cfg.backend, **doc, "n_chars": len(document),
            **response}


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
    """Collects requests into engine batches; one worker thread owns the engine."""

    def __init__(self, engine: Engine, cfg: Config, metrics: Metrics):
        self.engine, self.cfg, self.metrics = engine, cfg, metrics
        self.queue: asyncio.Queue = asyncio.Queue()
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="engine")

    async def submit(self, document: str) -> dict:
        fut = asyncio.get_running_loop().create_future()
        self.queue.put_nowait((document, fut))
        self.metrics.queue.set(self.queue.qsize())
        return await fut

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
        return [(d, f) for d, f in batch if not f.cancelled()]  # a client that hung up is not decoded

    def _work(self, documents: list[str]) -> list[dict]:
        t0 = time.perf_counter()
        out = [r for r, _ in self.engine.run(documents)]
        engine_ms = (time.perf_counter() - t0) * 1e3
        for r in out:
            r["engine_ms"] = round(engine_ms, 2)
            r["batch_size"] = len(documents)
        return out

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._next_batch()
            if not batch:
                continue
            self.metrics.batch.observe(len(batch))
            try:
                results = await loop.run_in_executor(self.worker, self._work, [d for d, _ in batch])
            except Exception as e:  # the engine failed on this batch: its requests get 500, the server goes on
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(e)
                continue
            for (_, fut), r in zip(batch, results):
                if not fut.done():
                    fut.set_result(r)


def make_app(cfg: Config, engine: Engine):
    """The Starlette app serving `engine` (started and stopped with the app)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    metrics, log = Metrics(), episode_logger(cfg)
    state: dict = {}
    started = time.time()
    body_limit = cfg.max_document_chars * 4 + 4096  # a document at the limit, in UTF-8, plus the JSON around it

    def error(status: int, reason: str) -> JSONResponse:
        metrics.requests.labels(str(status)).inc()
        return JSONResponse({"error": reason}, status_code=status)

    async def summarize(request):
        t0 = time.perf_counter()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > body_limit:
                return error(413, f"body over {body_limit} bytes (max_document_chars={cfg.max_document_chars})")
        try:
            document, rid = parse_request(bytes(body), cfg.max_document_chars)
        except BadRequest as e:
            return error(e.status, str(e))
        try:
            response = await state["batcher"].submit(document)
        except Exception as e:
            return error(500, f"engine error: {type(e).__name__}: {e}".splitlines()[0])
        response = {"id": rid or uuid.uuid4().hex, **response,
                    "latency_ms": round((time.perf_counter() - t0) * 1e3, 2)}
        metrics.latency.observe(response["latency_ms"] / 1e3)
        metrics.requests.labels("200").inc()
        metrics.episode(response)
        if log is not None:
            log.info(json.dumps(log_record(cfg, document, response), allow_nan=False))
        return JSONResponse(response)

    async def health(request):
        return JSONResponse({"status": "ok", "model": cfg.model, "backend": cfg.backend,
                             "factuality": rewards.BACKEND_NAMES[cfg.reward.factuality],
                             "uptime_s": round(time.time() - started, 1)})

    async def prometheus(request):
        body, kind = metrics.text()
        return Response(body, media_type=kind)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state["batcher"] = batcher = Batcher(engine, cfg, metrics)
        task = asyncio.create_task(batcher.run())
        try:
            yield
        finally:
            task.cancel()
            batcher.worker.shutdown(wait=False, cancel_futures=True)

    return Starlette(routes=[Route("/v1/summarize", summarize, methods=["POST"]), Route("/health", health),
                             Route("/metrics", prometheus)], lifespan=lifespan)


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
    server = uvicorn.Server(uvicorn.Config(make_app(cfg, engine), log_level="warning", access_log=False))
    print(f"serving {cfg.model} ({cfg.backend}; factuality: {rewards.BACKEND_NAMES[cfg.reward.factuality]}) "
          f"on http://{host}:{port}  (log: {cfg.log or 'off'})", flush=True)
    server.run(sockets=[sock])


if __name__ == "__main__":
    with settings.config_errors_exit():
        _cfg = settings.load_config(Config, settings.flags_as_overrides(sys.argv[1:], FLAGS))
    main(_cfg)
