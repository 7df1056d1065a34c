"""An OpenAI-compatible server on 127.0.0.1 that answers from the news world's oracle.

    python -m newsworld.oracle_server --docs out/newsworld/docs.jsonl [--port 8100]
    # then api_base=http://127.0.0.1:8100/v1

It stands in for a paid teacher wherever the project talks to one, so the API
code paths run end to end on a CPU with no key and no network (the GPU chain's
`--smoke` run uses it):
- fact-checking (synth_traces.py's annotator prompt): the answer is
  `{"errors": [...]}` from `oracle.oracle_errors`, in the teacher's schema;
- the judge prompt: a full score citing the trace's first sentence;
- summarising (the sandbox's prompt, chat or completions, continued from the
  text so far): a teacher policy that writes the reference summary's first
  sentence, searches for it, and after the results finishes the summary.
It serves POST /v1/chat/completions and /v1/completions, finds the document by
its text, stops at the request's stop strings (dropping them, as servers do),
and answers 400 for a document it does not know.
"""
from __future__ import annotations

import argparse
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import data
from factual_tools import textsplit
from newsworld import oracle

JUDGE_MARK = "You grade how well a summariser used its tools"
ANNOTATE_MARK = "meticulous fact-checker"


class OracleTeacher:
    """The answers, from news world documents known by their text."""

    def __init__(self, documents):
        self.by_text = {d.text.strip(): d for d in documents}

    def find(self, text: str):
        for doc_text, doc in self.by_text.items():
            if doc_text in text:
                return doc
        raise KeyError("no known document in the request")

    def annotate(self, user: str) -> str:
        article, _, rest = user.partition("\n\nSummary:\n")
        summary = rest.split("\n\nFind every factual error", 1)[0]
        doc = self.find(article)
        keys = ("error_span", "corrected_clause", "regex_key")
        return json.dumps({"errors": [{k: e[k] for k in keys} for e in oracle.oracle_errors(doc, summary)]})

    def judge(self, user: str) -> str:
        trace = user.split("Trace (the summariser's output; <results> blocks are what its searches returned):\n", 1)[-1]
        first = textsplit.split_sentences(trace)[:1] or [trace[:40]]
        return json.dumps({"score": 1.0, "evidence": [{"span": first[0], "why": "the oracle finds no error"}]})

    def summarise(self, prompt: str, so_far: str) -> str:
        """The next round of a teacher episode: a sentence and a search for it, then the rest."""
        doc = self.find(prompt)
        sents = textsplit.split_sentences(doc.summary)
        if "<results>" not in so_far:
            key = re.escape(" ".join(sents[0].split()[:3]))
            return f"{sents[0]}<search>/{key}/</search>"
        return " " + " ".join(sents[1:]) if len(sents) > 1 else ""


def _cut(text: str, stops) -> str:
    """The text up to the first stop string, which is dropped (finish reason "stop" either way)."""
    hits = [text.find(s) for s in stops or () if s in text]
    return text[:min(hits)] if hits else text


MAX_BODY_BYTES = 16 << 20  # a request body larger than this is refused unread


def serve(documents, host: str = "127.0.0.1", port: int = 0) -> tuple[str, ThreadingHTTPServer]:
    """Start the server in a daemon thread; returns (its /v1 URL, the server: call .shutdown())."""
    teacher = OracleTeacher(documents)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code: int, body: dict) -> None:
            out = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def do_POST(self):
            try:
                n = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return self._send(400, {"error": {"message": "bad Content-Length"}})
            if not 0 <= n <= MAX_BODY_BYTES:
                return self._send(413, {"error": {"message": f"body over {MAX_BODY_BYTES} bytes"}})
            try:
                body = json.loads(self.rfile.read(n))
                if self.path.endswith("/chat/completions"):
                    msgs = body["messages"]
                    system = next((m["content"] for m in msgs if m["role"] == "system"), "")
                    user = next((m["content"] for m in msgs if m["role"] == "user"), "")
                    so_far = msgs[-1]["content"] if msgs[-1]["role"] == "assistant" else ""
                    if ANNOTATE_MARK in system:
                        text = teacher.annotate(user.removeprefix("Article:\n"))
                    elif JUDGE_MARK in system:
                        text = teacher.judge(user)
                    else:
                        text = teacher.summarise(user, so_far)
                    text = _cut(text, body.get("stop"))
                    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                elif self.path.endswith("/completions"):
                    prompt = body["prompt"]
                    head, _, so_far = prompt.rpartition("Summary: ")
                    text = _cut(teacher.summarise(head, so_far), body.get("stop"))
                    choice = {"index": 0, "text": text, "finish_reason": "stop"}
                else:
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
            except (KeyError, ValueError, TypeError, IndexError, AttributeError, RecursionError) as e:
                return self._send(400, {"error": {"message": str(e)}})
            self._send(200, {"choices": [choice], "model": body.get("model", "oracle"),
                             "usage": {"prompt_tokens": 0, "completion_tokens": len(text.split())}})

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://{host}:{httpd.server_address[1]}/v1", httpd


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", required=True, help="news world Document JSONL (python -m newsworld generate ...)")
    ap.add_argument("--port", type=int, default=8100, help="8100: not serve.py's or vLLM's 8000")
    args = ap.parse_args(argv)
    url, httpd = serve(data.read_documents(args.docs), port=args.port)
    print(f"oracle teacher at {url} (Ctrl-C stops it)")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        httpd.shutdown()


if __name__ == "__main__":
    main()
