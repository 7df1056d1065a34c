"""serve.py: request checking, the response of a served episode, and a live server
on 127.0.0.1 under 16 concurrent clients mixing good and bad requests."""
import json
import re
import subprocess
import threading
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import monitor
import newsworld
import rewards
import rollout
import sandbox
import serve
import settings
from helpers import DOC, bpe_tokenizer, save_tiny_policy, script_ids, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 3000
BAD = [  # (body, expected status, a word the reason must contain)
    (b"", 400, "empty"),
    (b"   \n", 400, "empty"),
    (b"\xff\xfe{\"document\": \"x\"}", 400, "UTF-8"),
    (b"{\"document\": ", 400, "not JSON"),
    (b"[1, 2]", 422, "object"),
    (b"{\"text\": \"Acme said so.\"}", 422, "'text'"),
    (b"{\"id\": \"a\"}", 422, "missing"),
    (b"{\"document\": 7}", 422, "string"),
    (b"{\"document\": \"  \"}", 422, "empty"),
    (json.dumps({"document": "Acme said so. " * 300}).encode(), 413, "limit"),
]


@pytest.mark.parametrize("body,status,word", BAD)
def test_bad_requests_get_their_status_and_a_one_line_reason(body, status, word):
    with pytest.raises(serve.BadRequest) as e:
        serve.parse_request(body, LIMIT)
    assert e.value.status == status
    assert word in str(e.value) and "\n" not in str(e.value)


def test_a_good_request_gives_its_document_and_id():
    assert serve.parse_request(json.dumps({"document": "Acme said so.", "id": "r1"}).encode(), LIMIT) == \
        ("Acme said so.", "r1")
    assert serve.parse_request("{\"document\": \"Zoë won.\"}".encode(), LIMIT) == ("Zoë won.", None)


def test_the_response_shows_each_search_result_and_what_each_delete_retracted():
    tok = bpe_tokenizer()
    model = tiny_llama(tok)
    wrong = "Acme bought Beta for 9 million."
    written = f"{wrong}<search>Globex</search><delete scope=\"sentence\"/> Acme bought Beta."
    cfg = rollout.SamplingConfig(temperature=0.0, max_new_tokens=64)
    (ep,) = rollout.rollout(model, tok, [DOC], 1, cfg, logits_processor=rollout.ScriptedProcessor(
        {0: script_ids(tok, written)}))
    score = rewards.score(DOC, ep, rewards.RewardConfig(factuality="lexical"))
    r = serve.episode_response(DOC, ep, score, tau=0.5)
    search, delete = r["tool_calls"]
    index = sandbox.index_for(DOC)
    assert search["kind"] == "search" and search["query"] == "Globex" and search["results"]
    assert search["results"] == [index.sentences[i] for i in ep.calls[0].hits]
    assert delete == {"kind": "delete", "scope": "sentence", "retracted": wrong, "valid": True}
    assert r["summary"] == ep.summary == "Acme bought Beta."
    assert r["scores"]["factuality_backend"] == rewards.BACKEND_NAMES["lexical"]
    assert r["tokens"]["generated"] == sum(len(t.ids) for t in ep.turns) and r["tokens"]["tool_results"] > 0
    assert r["hallucination"] == bool(r["unsupported_claims"])
    json.dumps(r, allow_nan=False)


def test_flags_become_key_value_overrides_and_the_oracle_is_refused():
    assert settings.flags_as_overrides(["--model", "m", "--port=0", "batch_size=4"], serve.FLAGS) == \
        ["model=m", "port=0", "batch_size=4"]
    with pytest.raises(settings.ConfigError, match="--model needs a value"):
        settings.flags_as_overrides(["--model"], serve.FLAGS)
    with pytest.raises(settings.ConfigError, match="oracle"):
        settings.load_config(serve.Config, ["reward.factuality=oracle"])


def _post(port: int, path: str, body: bytes | None = None) -> tuple[int, dict | str, float]:
    t0 = time.perf_counter()
    status, answer = serve.call(port, path, body, timeout=120)
    return status, answer, time.perf_counter() - t0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`python serve.py` on 127.0.0.1 (any free port) with a tiny policy; the log rotates at 64 KB."""
    tmp = tmp_path_factory.mktemp("serve")
    model = save_tiny_policy(tmp / "policy", bpe_tokenizer())
    log = tmp / "episodes.jsonl"
    proc, port = serve.spawn(["--model", model, "--port", "0", "max_new_tokens=32", f"max_document_chars={LIMIT}",
                              f"log={log}", "log_max_mb=0.0625", "log_backups=20", "torch_threads=1"], cwd=ROOT)
    yield port, log
    proc.terminate()  # uvicorn shuts down gracefully, then re-raises SIGTERM: exit -15
    assert proc.wait(timeout=30) in (0, -15)


def test_200_requests_from_16_clients_each_get_their_answer_and_none_is_lost(server):
    port, log = server
    docs = [d.text for d in newsworld.documents(20, seed=3)]
    jobs = []
    for i in range(200):
        if i % 5 == 4:
            body, status, _ = BAD[(i // 5) % len(BAD)]
            jobs.append((body, status, None))
        else:
            jobs.append((json.dumps({"document": docs[i % len(docs)], "id": f"r{i}"}).encode(), 200, f"r{i}"))
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda job: _post(port, "/v1/summarize", job[0]), jobs))
    assert len(answers) == 200
    good = []
    for (_, status, rid), (got, body, seconds) in zip(jobs, answers):
        assert got == status, body
        if status == 200:
            assert body["id"] == rid and isinstance(body["summary"], str) and body["tokens"]["generated"] > 0
            assert set(body["scores"]) >= {"total", "pass", "factuality", "factuality_backend", "rules"}
            good.append((seconds, body["batch_size"]))
        else:
            assert set(body) == {"error"} and "\n" not in body["error"]
    lat = np.array([s for s, _ in good]) * 1e3
    print(f"\nserve: {len(good)} summaries, 16 clients: p50 {np.percentile(lat, 50):.0f} ms, "
          f"p95 {np.percentile(lat, 95):.0f} ms, mean engine batch {np.mean([b for _, b in good]):.1f}")
    assert max(b for _, b in good) > 1  # concurrent requests shared engine batches

    assert _post(port, "/health")[:2][0] == 200  # still serving after the bad ones
    metrics = _post(port, "/metrics")[1]
    assert re.search(r'summarize_requests_total\{status="200"\} 160\.0', metrics)
    assert sum(float(v) for v in re.findall(r'summarize_requests_total\{status="4\d\d"\} (\S+)', metrics)) == 40
    logged = [json.loads(line) for p in sorted(log.parent.glob(log.name + "*")) for line in p.open()]
    assert list(log.parent.glob(log.name + ".*")) and len(logged) == 160  # rotated, none lost
    assert sorted(r["id"] for r in logged) == sorted(rid for _, s, rid in jobs if s == 200)


def test_the_monitor_reads_every_rotated_file_and_alerts_past_a_threshold(server, tmp_path):
    """After the 16-client run: monitor.py over the rotated log sees all 160 episodes, oldest first,
    and exits 1 with an ALERT line once a threshold is crossed (0 when none is)."""
    _, log = server
    assert len(monitor.log_files(log)) > 2
    records, skipped = monitor.read_log(log)
    assert len(records) == 160 and not skipped
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)
    calm = subprocess.run([sys.executable, "eval.py", "--from-log", str(log), f"out={tmp_path / 'a'}", "window=40"],
                          cwd=ROOT, capture_output=True, text=True)
    assert calm.returncode == 0, calm.stderr
    assert "No threshold crossed" in calm.stdout and (tmp_path / "a" / "monitor.png").stat().st_size > 10_000
    report = json.loads((tmp_path / "a" / "monitor.json").read_text())
    assert [w["n"] for w in report["windows"]] == [40] * 4 and report["episodes"] == 160
    alarm = subprocess.run([sys.executable, "monitor.py", str(log), f"out={tmp_path / 'b'}", "max_p95_ms=1",
                            "min_pass=1.0"], cwd=ROOT, capture_output=True, text=True)
    assert alarm.returncode == 1
    newest = json.loads((tmp_path / "b" / "monitor.json").read_text())["windows"][-1]
    assert newest["pass"] < 1.0 and "ALERT: pass" in alarm.stdout and "ALERT: p95_ms" in alarm.stdout


def test_the_monitor_skips_a_torn_last_line_quietly_and_reports_any_other_bad_line(tmp_path):
    log = tmp_path / "episodes.jsonl"
    rec = {"time": 1.0, "scores": {"pass": True, "factuality": 0.9}, "hallucination": False,
           "tool_calls": [{"kind": "search", "valid": True}], "latency_ms": 50.0}
    (tmp_path / "episodes.jsonl.1").write_text(json.dumps(rec) + "\n{oops\n" + json.dumps({**rec, "time": 2.0}) + "\n")
    log.write_text(json.dumps({**rec, "time": 3.0}) + "\n" + json.dumps(rec)[:20])
    records, skipped = monitor.read_log(log)
    assert [r["time"] for r in records] == [1.0, 2.0, 3.0]
    assert len(skipped) == 1 and skipped[0].startswith(f"{tmp_path / 'episodes.jsonl.1'}:2:")
    assert monitor.cli([str(tmp_path / "none.jsonl")]) == 2


def test_monitor_windows_cover_every_episode_and_the_newest_is_full():
    eps = [{"time": float(i), "pass": float(i >= 7), "hallucination": 0.0, "factuality": 1.0, "searches": 1.0,
            "deletes": 0.0, "calls": 1.0, "valid": 1.0, "latency_ms": 10.0 * i} for i in range(10)]
    wins = monitor.windows(eps, 4)
    assert [(w["start"], w["end"], w["n"]) for w in wins] == [(0, 1, 2), (2, 5, 4), (6, 9, 4)]
    assert wins[-1]["pass"] == 0.75 and wins[0]["p95_ms"] == 9.5
    assert monitor.alerts(wins[-1], monitor.Config(min_pass=0.8)) == \
        ["pass 0.75 below min_pass=0.8 (newest 4 episodes)"]
    assert monitor.alerts(wins[-1], monitor.Config(min_pass=0.7)) == []


def test_an_engine_failure_answers_500_and_the_server_goes_on(tmp_path):
    """The server in this process (uvicorn in a thread): a batch whose decoding raises
    answers its requests 500 with the reason, and the next request is served."""
    import uvicorn

    cfg = serve.Config(model=save_tiny_policy(tmp_path / "policy", bpe_tokenizer()), log="", max_new_tokens=8)
    engine = serve.Engine(cfg)
    real = engine.run

    def run(documents):
        if any("BOOM" in d for d in documents):
            raise RuntimeError("CUDA out of memory\nsecond line")
        return real(documents)

    engine.run = run
    server = uvicorn.Server(uvicorn.Config(serve.make_app(cfg, engine), log_level="warning"))
    sock = serve.listening_socket("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        port = sock.getsockname()[1]
        status, body, _ = _post(port, "/v1/summarize", json.dumps({"document": "BOOM. Acme said so."}).encode())
        assert status == 500 and body == {"error": "engine error: RuntimeError: CUDA out of memory"}
        status, body, _ = _post(port, "/v1/summarize", json.dumps({"document": DOC}).encode())
        assert status == 200 and body["tokens"]["generated"] > 0
    finally:
        server.should_exit = True
        thread.join(timeout=30)
