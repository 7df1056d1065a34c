"""teacher_episodes.py: teacher rollouts through the sandbox from an OpenAI-compatible
server on 127.0.0.1, resumable; rl.py names that producer when v19 lacks its episodes."""
import json

import pytest

import data
import rl
import sandbox
import teacher_episodes as T
from factual_tools import settings, textsplit
import newsworld
from newsworld import oracle
from helpers import post_server


class TeacherServer:
    """/v1/completions: a search on the first round of an episode, then a summary;
    `fail_after` requests, every later one answers 400 (a dead endpoint)."""

    def __init__(self, fail_after: int | None = None):
        self.requests, self.fail_after = [], fail_after
        self.url, self.httpd = post_server(self.answer)

    def answer(self, body):
        self.requests.append(body)
        if self.fail_after is not None and len(self.requests) > self.fail_after:
            return 400, b"bad request"
        so_far = body["prompt"].split("Summary: ", 1)[1]
        text = " The company grew." if "<results>" in so_far else "It grew.<search>/[0-9]+/"
        return 200, {"choices": [{"text": text, "finish_reason": "stop"}], "usage": {}}


@pytest.fixture
def docs(tmp_path):
    path = tmp_path / "docs.jsonl"
    data.write_jsonl(str(path), list(newsworld.documents(6, seed=0)))
    return str(path)


def config(docs, tmp_path, url, **over):
    cfg = T.Config(out=str(tmp_path / "teacher.jsonl"), data=T.TeacherData(train=docs, max_docs=5), chunk=2)
    cfg.sampling.api_base, cfg.sampling.api_model, cfg.sampling.api_mode = url, "teacher-model", "completions"
    cfg.sampling.api_retries = 0
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_shards_run_at_once_and_merge_into_out_with_its_completion_mark(docs, tmp_path):
    """`--shards 2` against one endpoint: two shard processes, their merge in `out`
    (every document once), and the pipeline's completion mark once both are complete."""
    import subprocess
    import sys
    from pathlib import Path

    srv = TeacherServer()
    try:
        out = tmp_path / "teacher.jsonl"
        cmd = [sys.executable, "teacher_episodes.py", f"out={out}", f"data.train={docs}", "data.max_docs=5",
               "chunk=2", f"sampling.api_base={srv.url}", "sampling.api_model=teacher-model",
               "sampling.api_mode=completions", "sampling.api_retries=0", "--shards", "2"]
        run = subprocess.run(cmd, cwd=Path(T.__file__).parent, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        eps = sandbox.read_episodes(str(out))
        assert sorted(e.doc_id for e in eps) == sorted(d.id for d in data.read_documents(docs)[:5])
        assert json.loads(T.done_path(out).read_text())["covered"] == 5
    finally:
        srv.httpd.shutdown()


def test_teacher_episodes_go_through_the_sandbox_and_a_rerun_resumes(docs, tmp_path):
    srv = TeacherServer()
    try:
        cfg = config(docs, tmp_path, srv.url)
        assert T.main(cfg) == {"written": 5, "covered": 5, "documents": 5, "failed": 0}
        assert json.loads(T.done_path(cfg.out).read_text())["covered"] == 5  # the pipeline's completion mark
        eps = sandbox.read_episodes(cfg.out)
        assert [e.doc_id for e in eps] == [d.id for d in data.read_documents(docs)[:5]]
        for e in eps:
            assert [c.kind for c in e.calls] == ["search"] and e.calls[0].hits  # answered from the document
            assert e.summary == "It grew. The company grew." and e.meta["teacher"] == "teacher-model"
        n = len(srv.requests)
        assert T.main(cfg)["written"] == 0 and len(srv.requests) == n  # nothing asked twice
        cfg.data.max_docs = 6
        assert T.main(cfg) == {"written": 1, "covered": 6, "documents": 6, "failed": 0}
    finally:
        srv.httpd.shutdown()


def test_an_endpoint_that_dies_loses_only_the_chunk_in_flight(docs, tmp_path):
    srv = TeacherServer(fail_after=4)  # one chunk: two documents of two rounds each, then 400s
    try:
        cfg = config(docs, tmp_path, srv.url)
        with pytest.raises(SystemExit, match="every request of a chunk failed.*HTTP 400"):
            T.main(cfg)
        assert len(sandbox.read_episodes(cfg.out)) == 2  # the first chunk is on disk
        assert not T.done_path(cfg.out).exists()
    finally:
        srv.httpd.shutdown()
    with open(cfg.out, "a") as f:
        f.write('{"document": "torn')  # a kill in the middle of a write
    assert len(T.done_ids(__import__("pathlib").Path(cfg.out))) == 2
    assert len(sandbox.read_episodes(cfg.out)) == 2  # the torn line is gone
    srv = TeacherServer()
    try:
        assert T.main(config(docs, tmp_path, srv.url))["written"] == 3
    finally:
        srv.httpd.shutdown()


def test_a_document_the_endpoint_always_rejects_costs_only_itself(docs, tmp_path):
    """One document answered 400 (or with no choices) every time: the others are written, it
    is skipped and asked again on the next run; the stage is not marked complete."""
    bad = data.read_documents(docs)[1].text[:40]
    srv = TeacherServer()
    real = srv.answer

    def answer(body):
        if bad in body["prompt"]:
            srv.requests.append(body)
            return (400, b"rejected") if len(srv.requests) % 2 else (200, {"usage": {}})  # 400, or no choices
        return real(body)

    url, httpd = post_server(answer)
    try:
        cfg = config(docs, tmp_path, url)
        assert T.main(cfg) == {"written": 4, "covered": 4, "documents": 5, "failed": 1}
        assert not T.done_path(cfg.out).exists()
        assert T.main(cfg) == {"written": 0, "covered": 4, "documents": 5, "failed": 1}  # asked again, still bad
    finally:
        httpd.shutdown()
        srv.httpd.shutdown()


def test_bad_setups_fail_with_the_fix(docs, tmp_path):
    with pytest.raises(SystemExit, match="api_model is empty"):
        T.main(config(docs, tmp_path, "http://127.0.0.1:9/v1", sampling=T.engine.SamplingConfig(backend="api")))
    with pytest.raises(SystemExit, match="python data.py load"):
        T.main(config(str(tmp_path / "none.jsonl"), tmp_path, "http://127.0.0.1:9/v1"))
    assert settings.load_config(T.Config, ["--config", "configs/teacher_cnn.yaml"]).out == \
        settings.load_config(rl.Config, ["--config", "configs/drgrpo_v19.yaml"]).data.teacher


def test_v19_without_teacher_episodes_names_their_producer(tmp_path):
    cfg = settings.load_config(rl.Config, ["--config", "configs/drgrpo_v19.yaml", f"data.teacher={tmp_path}/none.jsonl"])
    with pytest.raises(SystemExit, match="python teacher_episodes.py --config configs/teacher_cnn.yaml"):
        rl.main(cfg)
    cfg = settings.load_config(rl.Config, ["--config", "configs/drgrpo_v19.yaml", "data.teacher="])
    with pytest.raises(SystemExit, match="w_match=0.3 needs teacher episodes"):
        rl.main(cfg)


def test_the_oracle_server_answers_as_a_teacher_would():
    from newsworld import oracle_server
    from factual_tools import engine
    from factual_tools import teachers

    docs = list(newsworld.documents(3, seed=4))
    url, httpd = oracle_server.serve(docs)
    try:
        client = engine.ApiClient(url, "oracle", retries=0)
        for mode in ("chat", "completions"):
            cfg = engine.SamplingConfig(backend="api", api_base=url, api_model="oracle", api_mode=mode)
            [ep] = engine.rollout_api(docs[:1], 1, cfg, client=client)
            assert [c.kind for c in ep.calls] == ["search"] and ep.calls[0].hits
            assert ep.summary == " ".join(textsplit.split_sentences(docs[0].summary))
        rng = __import__("random").Random(0)
        draft, _ = oracle.draft(docs[1], rng, n_errors=2)
        out = client.post("/chat/completions", {"model": "oracle",
                                                 "messages": teachers.annotation_messages(docs[1].text, draft)})
        got = json.loads(out["choices"][0]["message"]["content"])["errors"]
        want = oracle.oracle_errors(docs[1], draft)
        assert [e["error_span"] for e in got] == [e["error_span"] for e in want] and len(got) == 2
        with pytest.raises(engine.ApiError, match="HTTP 400"):
            client.post("/completions", {"prompt": "Summarise this article.\n\nNot a known text.\n\nSummary: "})
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", httpd.server_address[1], timeout=10)
        conn.putrequest("POST", "/v1/completions")  # a length it will never send: refused unread
        conn.putheader("Content-Length", str(oracle_server.MAX_BODY_BYTES + 1))
        conn.endheaders()
        assert conn.getresponse().status == 413
        conn.close()
        with pytest.raises(engine.ApiError, match="HTTP 400"):
            client.post("/completions", {"prompt": [[[[]]]] * 2})
    finally:
        httpd.shutdown()
