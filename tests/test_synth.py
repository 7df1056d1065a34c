"""synth_traces.py: injection, positives, the teacher's JSON, the API teacher against a
local server (retries, junk, cache), resume, shards, the model drafter's plumbing."""
import json
import os
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import data
import sandbox
import synth_traces as st
from factual_tools import claims, modeling, settings, teachers, textsplit, traces
import newsworld
from newsworld import oracle

DOCS = list(newsworld.documents(12, seed=3))


def _cfg(tmp_path, *overrides):
    docs = tmp_path / "docs.jsonl"
    if not docs.exists():
        data.write_jsonl(str(docs), DOCS)
    return settings.load_config(st.Config, [f"docs_path={docs}", f"out_path={tmp_path / 'traces.jsonl'}",
                                          f"runs_dir={tmp_path / 'runs'}", "batch_docs=4", *overrides])


def test_a_split_limits_drafting_to_its_train_pool(tmp_path):
    import json

    cfg = _cfg(tmp_path, "drafter.drafts_per_doc=1")
    manifest = data.make_split(DOCS, fractions=(0.5, 0.25, 0.25))
    (tmp_path / "split.json").write_text(json.dumps(manifest))
    cfg.split = str(tmp_path / "split.json")
    st.main(cfg)
    drafted = {ep.doc_id for ep in sandbox.read_episodes(cfg.out_path)}
    train = {e["id"] for e in manifest["pools"]["train"]}
    assert drafted and drafted <= train and len(drafted) >= len(train) - 1  # a trace may be dropped, never a pool crossed
    cfg.split = str(tmp_path / "missing.json")
    with pytest.raises(SystemExit, match="data.py split"):
        st.main(cfg)


# --- building a trace ------------------------------------------------------------------


def test_injection_follows_design_and_results_are_the_sandboxes():
    doc = DOCS[0]
    draft, labels = oracle.draft(doc, random.Random(0), n_errors=2)
    text, corrections = st.render(textsplit.split_sentences(draft), st.group_labels(labels), lambda s: None,
                                  random.Random(0), search_rate=0.0)
    assert "<results>" not in text  # the teacher never writes results: replay inserts them
    for lab in labels:
        wrong = textsplit.split_sentences(draft)[lab["sentence_index"]]
        assert (f'{wrong}<search>/({lab["regex_key"]})/</search><delete scope="sentence"/> '
                f'{lab["corrected_clause"]}') in text
    ep = sandbox.replay(doc.text, text)
    assert ep.valid and ep.n_delete == 2 and ep.n_deleted == 2
    index = sandbox.DocIndex(doc.text)
    for t in ep.turns:
        if t.call and t.call.kind == "search":
            assert t.injected == index.search(t.call.arg).block
    fixed = textsplit.split_sentences(draft)
    for lab in labels:
        fixed[lab["sentence_index"]] = lab["corrected_clause"]
    assert ep.summary == " ".join(fixed)
    assert [c["corrected"] for c in corrections] == [lab["corrected_clause"] for lab in labels]
    steps, only = teachers.correction_steps(ep)
    assert [s["corrected"] for s in steps] == [lab["corrected_clause"] for lab in labels] and only == []


def test_own_sentence_queries_and_evidence_rewrites():
    hits = n = 0
    for doc in DOCS:
        draft, labels = oracle.draft(doc, random.Random(1), n_errors=2)
        sentences = textsplit.split_sentences(draft)
        text, corrections = st.render(sentences, st.group_labels(labels), lambda s: None, random.Random(0),
                                      search_rate=1.0, own=st.own_query,
                                      rewrite=lambda q, c: st.evidence_correction(doc.text, q, c))
        ep = sandbox.replay(doc.text, text)
        assert ep.valid
        searches = [t for t in ep.turns if t.call and t.call.kind == "search"]
        # every search is the sentence just written, without its closing punctuation, as a BM25 query
        assert [t.call.arg for t in searches] == [st.own_query(x) for x in sentences[:-1]] + (
            [st.own_query(sentences[-1])] if len(searches) == len(sentences) else [])
        for c in corrections:  # each rewrite is a sentence of the results of the search before its delete
            n += 1
            res = sandbox.DocIndex(doc.text).search(c["keys"][0])
            if c["corrected"] in [sandbox.DocIndex(doc.text).sentences[h] for h in res.hits]:
                hits += 1
                assert oracle.oracle_errors(doc, c["corrected"]) == []
    assert n >= 20 and hits / n >= 0.8
    assert st.own_query("Acme/Globex <b> rose 5%.") == "Acme Globex b rose 5%"
    assert sandbox.parse_query(st.own_query("/Acme rose/."))[0] == "bm25"
    assert st.evidence_correction(DOCS[0].text, "zzz qqq", "A fix.") == "A fix."  # no result close to it
    assert st.evidence_correction(DOCS[0].text, "anything", "") == ""  # drop the sentence: nothing to copy


def test_key_queries_are_short_content_words_that_find_the_support():
    assert st.key_query("On May 3, 2021, Acme Corp. said it would buy Globex (a rival) for $5 billion.") == \
        "Acme Corp buy Globex rival billion"
    assert st.key_query("The deal, which was approved, closed.") == "deal approved closed"
    assert sandbox.parse_query(st.key_query("/Acme rose/."))[0] == "bm25"
    found = n = 0
    for doc in DOCS:  # the rule drafter's sentences, wrong ones included: the key is their own words
        draft, _ = oracle.draft(doc, random.Random(2), n_errors=2)
        for sent in textsplit.split_sentences(draft):
            support = oracle.oracle_support(doc, sent)
            if support:
                n += 1
                q = st.key_query(sent)
                assert len(q.split()) <= st.KEY_WORDS
                found += bool(set(sandbox.index_for(doc.text).search(q, top_k=2).hits) & set(support))
    assert n >= 20 and found / n >= 0.8


def test_a_corrected_sentence_is_rechecked_at_the_recheck_rate_and_the_check_keeps_it():
    """recheck_rate=1: every corrected sentence but the trace's last is followed by a
    search for itself whose results state it, and nothing deletes it; 0: never."""
    checked = n = 0
    for doc in DOCS:
        draft, labels = oracle.draft(doc, random.Random(1), n_errors=2)
        sentences = textsplit.split_sentences(draft)
        kw = dict(own=st.key_query, rewrite=lambda q, c: st.evidence_correction(doc.text, q, c))
        plain, _ = st.render(sentences, st.group_labels(labels), lambda s: None, random.Random(0), search_rate=0.0,
                             **kw)
        text, corrections = st.render(sentences, st.group_labels(labels), lambda s: None, random.Random(0),
                                      search_rate=0.0,
                                      recheck_rate=1.0, **kw)
        ep = sandbox.replay(doc.text, text)
        assert ep.valid and ep.summary == sandbox.replay(doc.text, plain).summary  # a recheck deletes nothing
        fixed = [c["corrected"] for c in corrections if c["corrected"]]
        last = textsplit.split_sentences(ep.summary)[-1] if ep.summary else ""
        here = 0
        for f in fixed:
            n += 1
            if f.strip() == last.strip():
                assert f"{f}<search>" not in text  # a trace never ends on a search
                continue
            assert f"{f}<search>{st.key_query(f)}</search>" in text
            here += 1
        assert text.count("<search>") == plain.count("<search>") + here  # the rechecks and nothing else
        checked += here
    assert n >= 10 and checked >= n // 2


def test_a_model_draft_keeps_its_first_sentences_and_no_repeat():
    loop = "Acme rose. Acme rose. Globex fell 2%. Acme rose. Jane Doe left. Beta won."
    assert st.draft_sentences(loop, 3) == "Acme rose. Globex fell 2%. Jane Doe left."
    assert st.draft_sentences(loop, 0) == "Acme rose. Globex fell 2%. Jane Doe left. Beta won."
    assert st.draft_sentences("Acme rose. Globex fell", 3) == "Acme rose. Globex fell"  # a cut last sentence stays


@pytest.mark.parametrize("style", ["regex", "bm25"])
def test_search_only_positive_retrieves_the_support(style):
    rng = random.Random(0)
    n = 0
    for doc in DOCS:
        for sent in textsplit.split_sentences(doc.summary):
            q = st.support_query(doc.text, sent, style, rng, doc.entities)
            if q is None:
                continue
            n += 1
            assert q.startswith("/(") == (style == "regex")
            res = sandbox.DocIndex(doc.text).search(q)
            assert res.error is None and res.hits[0] == st.support_of(doc.text, sent)
    assert n >= 20


def test_positives_rate_and_never_at_the_end():
    doc = DOCS[1]
    sentences = textsplit.split_sentences(doc.summary)
    text, _ = st.render(sentences, {}, lambda s: "Q", random.Random(0), search_rate=1.0)
    assert text.count("<search>Q</search>") == len(sentences) - 1 and text.endswith(sentences[-1])
    counts = [st.render(sentences * 20, {}, lambda s: "Q", random.Random(k), search_rate=0.25)[0].count("<search>")
              for k in range(20)]
    assert 0.15 < sum(counts) / (20 * (len(sentences) * 20 - 1)) < 0.35


# --- the teacher's JSON ----------------------------------------------------------------

DOC = textsplit.split_sentences(DOCS[2].text)
SUMMARY = "Alpha is here. Beta went there."


@pytest.mark.parametrize("answer, reason", [
    ('{"errors": []}', None),
    ("```json\n{\"errors\": []}\n```", None),
    ("The summary looks fine to me.", "answer is not JSON"),
    ('{"mistakes": []}', 'answer is not {"errors"'),
    ('["x"]', "an error must be a JSON object"),
    ('[{"error_span": "Beta", "corrected_clause": "Gamma went there."}]', "missing key 'regex_key'"),
    ('[{"error_span": 3, "corrected_clause": "x", "regex_key": "y"}]', "error_span must be a string"),
    ('[{"error_span": "Delta", "corrected_clause": "x", "regex_key": "y"}]', "error_span does not occur"),
    ('[{"error_span": "here. Beta", "corrected_clause": "x", "regex_key": "y"}]', "crosses a sentence boundary"),
    ('[{"error_span": "Beta", "corrected_clause": "Beta went there.", "regex_key": "y"}]', "repeats the wrong"),
    ('[{"error_span": "Beta", "corrected_clause": "Gamma went.", "regex_key": "(unclosed"}]', "bad pattern"),
    ('[{"error_span": "Beta", "corrected_clause": "Gamma went.", "regex_key": "zzzqqq"}]', "finds nothing"),
])
def test_parse_annotation_rejects_junk_with_a_reason(answer, reason):
    ann = teachers.parse_annotation(answer, DOCS[2].text, SUMMARY)
    got = ann.error or (ann.rejected[0]["reason"] if ann.rejected else None)
    assert (got is None) if reason is None else (got is not None and reason in got), got
    assert not ann.labels


def test_parse_annotation_accepts_a_valid_label():
    word = textsplit.words(DOC[0])[0]
    ans = json.dumps({"errors": [{"error_span": "Beta", "corrected_clause": "Gamma went there.",
                                  "regex_key": f"/{word}/", "type": "entity_swap"}]})
    ann = teachers.parse_annotation(ans, DOCS[2].text, SUMMARY)
    assert ann.error is None and not ann.rejected
    assert ann.labels == [{"error_span": "Beta", "corrected_clause": "Gamma went there.", "regex_key": word,
                           "type": "entity_swap", "sentence_index": 1}]


@pytest.mark.parametrize("answer, ok", [
    ('{"score": 0.8, "evidence": [{"span": "<search>x</search>", "why": "good"}]}', True),
    ('{"score": 0.8, "evidence": [{"span": "not in the trace", "why": "?"}]}', False),
    ('{"score": 1.5, "evidence": [{"span": "A.", "why": "?"}]}', False),
    ('{"score": true, "evidence": [{"span": "A.", "why": "?"}]}', False),
    ('{"score": 0.5, "evidence": []}', False),
    ("nice trace", False),
])
def test_judge_answer_needs_cited_spans(answer, ok):
    res = teachers.judge_answer(answer, "A.<search>x</search><results></results> B.")
    assert (res["score"] is not None) == ok, res
    assert ok or res["error"]


def test_oracle_judge_flags_a_needless_delete():
    doc = DOCS[0]
    right = textsplit.split_sentences(doc.summary)
    good = sandbox.replay(doc.text, " ".join(right))
    assert teachers.oracle_judge(doc, good)["score"] == 1.0
    bad = sandbox.replay(doc.text, f"{right[0]}<search>{textsplit.words(right[0])[0]}</search>"
                                   f"<delete scope=\"sentence\"/> {right[0]} " + " ".join(right[1:]))
    verdict = teachers.oracle_judge(doc, bad)
    assert verdict["score"] < 1 and any(e["why"] == "retracted a right sentence" for e in verdict["evidence"])
    assert all(e["span"] in bad.text for e in verdict["evidence"])


# --- the api teacher against a local OpenAI-compatible server ----------------------------


class _Server:
    """Answers valid JSON (the oracle's labels plus one bogus item), junk, 429 and 500, in turn."""
    MODES = ["ok", "junk", 429, 500]

    def __init__(self, docs):
        self.docs = {d.text: d for d in docs}
        self.log = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                mode = server.MODES[len(server.log) % len(server.MODES)]
                server.log.append(body)
                if mode in (429, 500):
                    self.send_response(mode)
                    self.end_headers()
                    self.wfile.write(b'{"error": "try later"}')
                    return
                content = "Sure! Here are the errors you asked for." if mode == "junk" else server.answer(body)
                out = json.dumps({"choices": [{"message": {"role": "assistant", "content": content},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 1000, "completion_tokens": 100}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def answer(self, body):
        user = body["messages"][-1]["content"]
        article = user.split("Article:\n", 1)[1].split("\n\nSummary:\n", 1)[0]
        summary = user.split("\n\nSummary:\n", 1)[1].split("\n\nFind every", 1)[0]
        labels = oracle.oracle_errors(self.docs[article], summary)
        items = [{k: lab[k] for k in ("error_span", "corrected_clause", "regex_key")} for lab in labels]
        items.append({"error_span": "a span that is nowhere", "corrected_clause": "x", "regex_key": "x"})
        return json.dumps({"errors": items})

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_api_teacher_retries_rejects_junk_and_never_pays_twice(tmp_path):
    server = _Server(DOCS)
    try:
        keys = ["annotator.backend=api", f"annotator.api_base={server.base}", "annotator.api_model=gpt-4o",
                "annotator.concurrency=1", "annotator.backoff_s=0.01", "annotator.retries=3",
                f"annotator.cache_dir={tmp_path / 'cache'}", "annotator.api_key_env=NO_SUCH_VARIABLE_SET",
                "drafter.drafts_per_doc=1", "limit=3", "shard=0/1"]
        cfg = _cfg(tmp_path, *keys)
        ann = teachers.make_annotator(cfg.annotator)
        summary = st.main(cfg, annotator=ann)
        assert len(server.log) == 5  # ok, junk, then 429 and 500 retried before an ok
        assert ann.teacher.client.usage["retries"] == 2
        assert summary["traces"] == 3 and summary["kinds"].get("rejected") == 1 and summary["failed"] == 0
        eps = traces.read_traces(cfg.out_path)
        junk = [e for e in eps if e.meta["trace_kind"] == "rejected"]
        assert junk[0].meta["annotation_error"].startswith("answer is not JSON")
        assert junk[0].summary == " ".join(junk[0].meta["draft"].split()) and junk[0].n_search == 0
        for e in eps:
            if e.meta["trace_kind"] != "rejected":
                assert [r["reason"] for r in e.meta["rejected_labels"]] == ["error_span does not occur in the summary"]
                assert e.meta["labels"] == [dict(lab, type="unknown") for lab in e.meta["labels"]]
        cost = (1000 * 2.5 + 100 * 10.0) / 1e6
        assert all(e.meta["teacher"]["cost_usd"] == pytest.approx(cost) for e in eps)
        assert summary["cost_usd"] == pytest.approx(3 * cost, abs=1e-4) and summary["teacher_requests"] == 3
        assert len(os.listdir(tmp_path / "cache")) >= 1

        again = st.main(settings.load_config(st.Config, [*keys, f"docs_path={cfg.docs_path}",
                                                        f"out_path={tmp_path / 'again.jsonl'}",
                                                        f"runs_dir={tmp_path / 'runs'}"]))
        assert len(server.log) == 5, "a second run must not repeat a paid request"
        assert again["teacher_requests"] == 0 and again["teacher_cached"] == 3 and again["cost_usd"] == 0
        assert again["cost_cached_usd"] == pytest.approx(3 * cost, abs=1e-4)
        assert [e.summary for e in traces.read_traces(str(tmp_path / "again.jsonl"))] == [e.summary for e in eps]
    finally:
        server.close()


def _teacher_endpoint(answers):
    """An OpenAI-compatible stand-in: each request's user message names the reply it gets
    from `answers` (content, finish_reason); returns (base URL, the server, asked messages)."""
    from helpers import post_server

    asked = []

    def answer(body):
        msg = body["messages"][-1]["content"]
        asked.append(msg)
        content, reason = answers[msg]
        return 200, {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": reason}],
                     "usage": {"prompt_tokens": 100, "completion_tokens": 10}}

    url, httpd = post_server(answer)
    return url, httpd, asked


def test_the_teacher_caches_complete_answers_only_per_server_and_stops_at_its_spend_cap(tmp_path):
    answers = {"a": ('{"ok": 1}', "stop"), "b": ('{"ok": 2}', "stop"), "c": ('{"ok": 3}', "stop"),
               "cut": ('{"ok":', "length"), "empty": ("", "stop")}
    url, httpd, asked = _teacher_endpoint(answers)
    url2, httpd2, asked2 = _teacher_endpoint(answers)
    ask = lambda t, m: t.chat([{"role": "user", "content": m}])  # noqa: E731
    cfg = teachers.TeacherConfig(backend="api", api_base=url, cache_dir=str(tmp_path / "cache"), retries=0,
                                 api_key_env="NO_SUCH_VARIABLE_SET", max_paid_calls=4)
    try:
        t = teachers.ApiTeacher(cfg)
        assert ask(t, "a").text == '{"ok": 1}' and ask(t, "a").cached  # asked once, then from the cache
        for bad in ("cut", "empty"):  # paid, answered with an error, never cached
            r = ask(t, bad)
            assert r.text is None and "api:" in r.error and not r.cached
        assert ask(t, "b").text == '{"ok": 2}' and asked == ["a", "cut", "empty", "b"]
        with pytest.raises(teachers.SpendCapReached, match="max_paid_calls=4"):
            ask(t, "c")  # a fifth paid call: the run stops before making it
        assert asked == ["a", "cut", "empty", "b"]
        again = teachers.ApiTeacher(cfg)  # a rerun pays nothing twice
        assert ask(again, "a").cached and ask(again, "b").cached and asked == ["a", "cut", "empty", "b"]
        assert ask(again, "cut").text is None and asked[-1] == "cut"  # not cached: asked (and paid) again
        import dataclasses

        other = teachers.ApiTeacher(dataclasses.replace(cfg, api_base=url2, max_paid_calls=0))
        assert not ask(other, "a").cached and asked2 == ["a"]  # the same model name on another server
        legacy = teachers.ApiTeacher(dataclasses.replace(cfg, max_paid_calls=0, cache_dir=str(tmp_path / "old")))
        body = legacy.body([{"role": "user", "content": "c"}])
        legacy.cache.put(teachers.request_key("/chat/completions", body), {  # keyed as older versions did
            "request": body, "response": {"choices": [{"message": {"content": "old"}, "finish_reason": "stop"}]},
            "prompt_tokens": 1, "completion_tokens": 1, "cost_usd": 0.0})
        assert ask(legacy, "c").text == "old" and asked.count("c") == 0  # found, not paid again
    finally:
        httpd.shutdown()
        httpd2.shutdown()


def test_api_failure_is_retried_on_the_next_run_not_written(tmp_path):
    # Nothing listens on this port: every attempt fails, the trace is not written, and the run goes on.
    cfg = _cfg(tmp_path, "annotator.backend=api", "annotator.api_base=http://127.0.0.1:9/v1",
               "annotator.retries=1", "annotator.backoff_s=0.01", "annotator.timeout_s=2",
               f"annotator.cache_dir={tmp_path / 'cache'}", "drafter.drafts_per_doc=1", "limit=2")
    summary = st.main(cfg)
    assert summary["traces"] == 0 and summary["failed"] == 2
    assert not os.path.exists(tmp_path / "cache") or not os.listdir(tmp_path / "cache")


# --- resume, limit, shards, merge --------------------------------------------------------


class _Dies:
    """An annotator that is killed on its second batch."""

    def __init__(self):
        self.inner, self.calls, self.name, self.teacher = teachers.OracleAnnotator(), 0, "oracle", None

    def annotate_many(self, pairs):
        self.calls += 1
        if self.calls == 2:
            raise KeyboardInterrupt("killed")
        return self.inner.annotate_many(pairs)


def test_resume_after_a_kill_loses_nothing_and_duplicates_nothing(tmp_path, capsys):
    full = _cfg(tmp_path, "drafter.drafts_per_doc=2", f"out_path={tmp_path / 'full.jsonl'}")
    st.main(full)
    reference = open(full.out_path, encoding="utf-8").read()
    lines = reference.splitlines(keepends=True)
    assert len(lines) == 24

    cfg = _cfg(tmp_path, "drafter.drafts_per_doc=2")
    with pytest.raises(KeyboardInterrupt):
        st.main(cfg, annotator=_Dies())
    got = open(cfg.out_path, encoding="utf-8").read().splitlines(keepends=True)
    assert got == lines[:8]  # the first batch (4 documents), whole
    with open(cfg.out_path, "a", encoding="utf-8") as f:  # and a line cut by the kill
        f.write(lines[8][:100])
    summary = st.main(cfg)
    assert "incomplete" in capsys.readouterr().err
    assert summary["traces"] == 16
    assert open(cfg.out_path, encoding="utf-8").read() == reference
    assert st.main(cfg)["traces"] == 0  # all done: nothing is made twice


def test_limit_then_all_and_shards_merge_to_the_same_traces(tmp_path):
    ref = _cfg(tmp_path, f"out_path={tmp_path / 'ref.jsonl'}")
    st.main(ref)
    ref_lines = sorted(open(ref.out_path, encoding="utf-8").read().splitlines())

    cfg = _cfg(tmp_path)
    assert st.main(settings.load_config(st.Config, st.flags_to_keys(
        [f"docs_path={cfg.docs_path}", f"out_path={cfg.out_path}", f"runs_dir={tmp_path / 'runs'}",
         "--limit", "5"])))["documents"] == 5
    st.main(cfg)
    assert sorted(open(cfg.out_path, encoding="utf-8").read().splitlines()) == ref_lines

    parts = []
    for i in range(3):
        c = _cfg(tmp_path, f"out_path={tmp_path / 'sh.jsonl'}", *st.flags_to_keys([f"--shard={i}/3"]))
        st.main(c)
        parts.append(traces.shard_path(c.out_path, i, 3))
        assert parts[-1].endswith(f"sh.shard{i}of3.jsonl")
    merged = str(tmp_path / "merged.jsonl")
    assert st.cli(["merge", merged, *parts, parts[0]]) == 0  # a file twice: identical duplicates collapse
    assert sorted(open(merged, encoding="utf-8").read().splitlines()) == ref_lines

    bad = tmp_path / "bad.jsonl"
    rec = json.loads(ref_lines[0])
    rec["summary"] = "something else"
    bad.write_text(json.dumps(rec) + "\n", encoding="utf-8")
    with pytest.raises(data.DataError, match="conflicts"):
        traces.merge(str(tmp_path / "m2.jsonl"), [merged, str(bad)])


def test_shards_run_at_once_and_merge_into_the_output(tmp_path):
    """`--shards 2`: both shard processes run at once, then their merge is out_path; it
    holds the traces one process writes. Bad counts are one-line errors."""
    ref = _cfg(tmp_path, f"out_path={tmp_path / 'ref.jsonl'}")
    st.main(ref)
    args = [f"docs_path={tmp_path / 'docs.jsonl'}", f"out_path={tmp_path / 'two.jsonl'}",
            f"runs_dir={tmp_path / 'runs'}", "batch_docs=4"]
    assert st.cli([*args, "--shards", "2"]) == 0
    got = sorted(open(tmp_path / "two.jsonl", encoding="utf-8").read().splitlines())
    assert got == sorted(open(ref.out_path, encoding="utf-8").read().splitlines())
    for i in range(2):
        assert os.path.exists(tmp_path / f"two.shard{i}of2.jsonl")
    assert traces.pop_shards(["--shards=4", "a=1", "--gpus", "2"]) == (["a=1"], 4, 2)
    for bad in (["--shards", "x"], ["--shards"], ["--shards", "0"]):
        with pytest.raises(settings.ConfigError, match="shards"):
            traces.pop_shards(bad)


def test_shard_parsing_and_flags():
    assert traces.parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "1", "a/b", "-1/2"):
        with pytest.raises(settings.ConfigError):
            traces.parse_shard(bad)
    assert st.flags_to_keys(["--shard", "0/2", "--limit=7", "seed=1"]) == ["shard=0/2", "limit=7", "seed=1"]
    assert sorted({traces.shard_of(d.id, 3) for d in DOCS}) == [0, 1, 2]


def test_newsworld_run_records_provenance(tmp_path):
    cfg = _cfg(tmp_path, "judge.backend=oracle", "limit=6")
    summary = st.main(cfg)
    eps = traces.read_traces(cfg.out_path)
    assert summary["traces"] == len(eps) == 18
    kinds = {e.meta["trace_kind"] for e in eps}
    assert "corrective" in kinds
    for e in eps:
        m = e.meta
        assert e.doc_id == m["id"].split("#")[0] and m["drafter"] == "newsworld" and m["annotator"] == "oracle"
        assert m["draft"] and "judge" in m and 0 <= m["judge"]["score"] <= 1
        assert m["trace_kind"] == st.trace_kind(e)
        assert set(m["error_types"]) <= set(oracle.ERROR_TYPES)
        assert e.valid and e.summary and not oracle.oracle_errors(DOCS[[d.id for d in DOCS].index(e.doc_id)],
                                                                e.summary)


# --- model drafter and model teacher (tiny model: plumbing, not quality) ---------------------


@pytest.fixture(scope="module")
def tiny():
    mcfg = modeling.ModelConfig(name_or_path="tiny-1m")
    return modeling.load_policy(mcfg, train=False)


def test_prompted_tokenizer_swaps_the_prompt(tiny):
    _, tok = tiny
    doc = DOCS[0].text
    msgs = sandbox.prompt_messages(doc)
    msgs[-1] = dict(msgs[-1], content=msgs[-1]["content"] + "\n\nInclude every number.")
    wrapped = teachers.PromptedTokenizer(tok, {doc: msgs})
    assert "Include every number." in tok.decode(sandbox.prompt_ids(wrapped, doc))
    assert sandbox.prompt_ids(wrapped, DOCS[1].text) == sandbox.prompt_ids(tok, DOCS[1].text)
    assert wrapped.eos_token_id == tok.eos_token_id and len(wrapped) == len(tok)


class _FlagFirst:
    """A stub teacher: the first sentence of a document's first summary is wrong."""

    name, teacher = "stub", None

    def __init__(self):
        self.seen = set()

    def annotate_many(self, pairs):
        out = []
        for doc, summary in pairs:
            sents = textsplit.split_sentences(summary)
            labels = []
            if sents and doc.id not in self.seen:
                first = textsplit.split_sentences(doc.text)[0]
                labels = [{"error_span": sents[0][:3], "corrected_clause": first, "type": "entity_swap",
                           "regex_key": claims.rx_escape(" ".join(first.split()[:3])), "sentence_index": 0}]
            self.seen.add(doc.id)
            out.append(teachers.Annotation(labels=labels))
        return out


def test_model_drafter_continues_from_the_edited_context(tmp_path, tiny):
    model, tok = tiny
    cfg = _cfg(tmp_path, "drafter.backend=model", "drafter.drafts_per_doc=2", "limit=1",
               "drafter.generate.max_new_tokens=24", "drafter.max_rounds=2", "search_rate=0")
    drafter = st.ModelDrafter(cfg.drafter, cfg.seed, model, tok)
    summary = st.main(cfg, drafter=drafter, annotator=_FlagFirst())
    eps = traces.read_traces(cfg.out_path)
    assert summary["traces"] == len(eps) == 2
    fixed = [e for e in eps if e.meta["corrections"]]
    assert fixed, "the stub teacher flags every first draft"
    for e in eps:
        assert e.meta["drafter"] == "model:tiny-1m" and e.meta["prompt_id"] in range(len(cfg.drafter.prompts))
        assert e.meta["continuation_note"] is None
    for e in fixed:
        c = e.meta["corrections"][0]
        wrote = teachers.written_text(e)
        head = f'{c["sentence"]}<search>/({c["keys"][0]})/</search>{st.DELETE_TAG} {c["corrected"]}'
        assert wrote.startswith(head)
        search = e.turns[0]
        assert search.injected == sandbox.DocIndex(e.document).search(search.call.arg).block
        assert e.summary.startswith(c["corrected"]) and e.n_deleted == 1


def test_model_teacher_junk_is_rejected_and_cached(tmp_path, tiny):
    model, tok = tiny
    tcfg = settings.load_config(teachers.TeacherConfig, ["backend=model", f"cache_dir={tmp_path}",
                                                 "generate.max_new_tokens=12"])
    ann = teachers.TeacherAnnotator(teachers.ModelTeacher(tcfg, model, tok))
    first = ann.annotate_many([(DOCS[0], DOCS[0].summary), (DOCS[1], DOCS[1].summary)])
    assert all(a.error and "not JSON" in a.error and not a.labels for a in first)
    again = ann.annotate_many([(DOCS[0], DOCS[0].summary)])
    assert ann.teacher.stats["cached"] == 1 and again[0].error == first[0].error


class _FakeClient:
    def __init__(self):
        self.calls = 0

    def post(self, path, body):
        self.calls += 1
        return {"choices": [{"message": {"content": '{"errors": []}'}}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2}}


def test_identical_requests_are_paid_once(tmp_path):
    tcfg = settings.load_config(teachers.TeacherConfig, ["backend=api", "api_model=gpt-4o-mini", f"cache_dir={tmp_path}"])
    client = _FakeClient()
    ann = teachers.TeacherAnnotator(teachers.ApiTeacher(tcfg, client=client))
    pair = (DOCS[0], DOCS[0].summary)
    got = ann.annotate_many([pair, pair, (DOCS[1], DOCS[1].summary), pair])
    assert client.calls == 2 and [a.requests for a in got] == [1, 0, 1, 0] and [a.cached for a in got] == [0, 1, 0, 1]
    assert ann.teacher.spent_usd == pytest.approx(2 * (10 * 0.15 + 2 * 0.6) / 1e6)
    assert teachers.request_key("/chat/completions", {"a": 1, "b": [2]}) == teachers.request_key("/chat/completions",
                                                                                    {"b": [2], "a": 1})
    ann.annotate_many([pair])
    assert client.calls == 2 and ann.teacher.stats["cached"] == 3
