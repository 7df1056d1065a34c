"""filter_traces.py: each gate on hand-built traces, the reports, and the pipeline end to end
(news world documents -> traces -> filtered corpus -> funnel, noise measured by the oracle)."""
import csv
import io
import json
import random
from pathlib import Path

import pytest

import data
import filter_traces as ft
import sandbox
import synth_traces as st
from factual_tools import claims, settings, teachers, textsplit, traces
import newsworld
from newsworld import oracle
from helpers import DOC

WORLD = list(newsworld.documents(8, seed=5))
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEL = '<delete scope="sentence"/>'


def trace(text, document=DOC, **meta):
    ep = sandbox.replay(document, text)
    ep.doc_id, ep.meta = "d", dict(meta)
    return ep


# --- format: the five hard rejects ---------------------------------------------------------


@pytest.mark.parametrize("text, reason", [
    (f"Acme reported revenue of $5 billion.<search>/revenue of/</search>{DEL} Acme reported $4.2 billion.", None),
    (f"Acme grew. Rivals shrank.<search>/Rival/</search>{DEL}", None),  # a trailing delete is a complete act
    ("Acme grew.<search>/(unclosed/</search> It hired.", "search not answered with results"),
    ("Acme grew.<search>   </search> It hired.", "search not answered with results"),
    ("A. " * 7 + f"B.{DEL}" * 6 + " C.", "more than 5 deletes"),
    ('Acme grew.<delete scope="word"/> It hired.', "malformed delete call"),
    ("Acme grew. <results>made up</results> It hired.", "stray or dangling tool markup"),
    ("Acme grew. It hired <search>revenue", "stray or dangling tool markup"),
    (f"{DEL} Acme grew.", "delete with nothing to delete"),
    (f"Acme grew.<search>/Acme/</search>{DEL}", "empty final summary"),
    ("Acme grew. It hired.<search>revenue</search>", "ends on a search"),
])
def test_format_hard_rejects(text, reason):
    got = ft.format_problem(trace(text), max_deletes=5)
    assert (got is None) if reason is None else (got is not None and got.startswith(reason)), got


def test_format_token_budget_uses_the_policy_tokenizer():
    from helpers import bpe_tokenizer

    tok = bpe_tokenizer()
    ep = trace(f"Acme reported revenue of $5 billion.<search>/revenue of/</search>{DEL} Acme reported $4.2 billion.")
    n = ft.trace_tokens(ep, tok)
    expect = (len(sandbox.prompt_ids(tok, DOC)) + 1
              + sum(len(tok.encode(s)) for t in ep.turns for s in (t.text, t.injected) if s))
    assert n == expect
    assert ft.format_problem(ep, 5, n, n) is None
    assert ft.format_problem(ep, 5, n, n - 1).startswith("over the token budget")


# --- relevance, factuality gain, token budget ------------------------------------------------


def _corrective(doc, types=None, key=None):
    draft, labels = oracle.draft(doc, random.Random(1), n_errors=1, types=types or oracle.ERROR_TYPES)
    lab = dict(labels[0], regex_key=key or labels[0]["regex_key"])
    text, corr = st.render(textsplit.split_sentences(draft), {lab["sentence_index"]: [lab]}, lambda s: None,
                           random.Random(0), search_rate=0.0)
    ep = sandbox.replay(doc.text, text)
    ep.doc_id, ep.meta = doc.id, {"draft": draft, "corrections": corr, "id": doc.id + "#0"}
    return ep, lab


def test_relevance_tfidf_cosine_between_top_result_and_correction():
    doc = WORLD[0]
    good, lab = _corrective(doc)
    assert ft.relevance(good) >= 0.3
    sents = textsplit.split_sentences(doc.text)
    worst = min(range(len(sents)), key=lambda i: traces.tfidf_for(doc.text).cosine(sents[i], lab["corrected_clause"]))
    key = claims.rx_escape(" ".join(sents[worst].split()[:5]))
    assert sandbox.DocIndex(doc.text).search(f"/({key})/").hits[0] == worst
    bad, _ = _corrective(doc, key=key)
    assert ft.relevance(bad) < 0.3
    # function words do not make a result relevant, rare words (names, numbers) do
    assert traces.tfidf_for(doc.text).cosine("the a of in to", "the a of in to and") < traces.tfidf_for(
        doc.text).cosine(sents[0], sents[0])
    only = trace(f"{sents[0]}<search>/{claims.rx_escape(sents[0].split()[0])}/</search> More.", doc.text)
    assert ft.relevance(only) is None  # nothing corrected, nothing to score


@pytest.mark.parametrize("backend", ["oracle", "lexical"])
def test_factuality_gain_keeps_real_corrections_only(backend):
    doc = WORLD[1]
    ep, lab = _corrective(doc, types=["number_change"])
    gain = ft.factuality(doc, ep.summary, backend) - ft.factuality(doc, ft.uncorrected_draft(ep), backend)
    assert gain >= 0.05
    right = textsplit.split_sentences(doc.summary)
    same = trace(f"{right[0]}<search>/{claims.rx_escape(right[0].split()[0])}/</search>{DEL} {right[0]} "
                 + " ".join(right[1:]), doc.text)
    assert ft.factuality(doc, same.summary, backend) - ft.factuality(doc, ft.uncorrected_draft(same), backend) < 0.05


def test_uncorrected_draft_without_meta_undoes_the_deletes():
    ep = trace(f"A one.<search>/Acme/</search>{DEL} A two. B three.")
    assert ft.uncorrected_draft(ep) == "A one. B three."


def test_check_balance_counts_corrections_and_search_only_checks():
    doc = "Acme rose 5%. Globex fell 3%."
    fixed = sandbox.replay(doc, 'Acme rose 9%.<search>Acme rose</search><delete scope="sentence"/> Acme rose 5%.')
    held = sandbox.replay(doc, "Globex fell 3%.<search>Globex fell</search> Acme rose 5%.<search>Acme</search>"
                         '<delete scope="sentence"/> Acme rose 5%.')
    got = ft.check_balance([fixed, held])
    assert {k: got[k] for k in ("searches", "corrections", "search_only", "search_only_share")} == {
        "searches": 3, "corrections": 2, "search_only": 1, "search_only_share": round(1 / 3, 4)}
    assert ft.check_balance([])["search_only_share"] == 0.0


def _shortcut_traces():
    """A document; a trace whose wrong sentence is checked, deleted, rewritten and checked
    again (a recheck, kept); and one whose right sentence is checked and kept."""
    doc = "Acme rose 5%. Globex fell 3%."
    recheck = sandbox.replay(doc, 'Acme rose 9%.<search>Acme rose</search><delete scope="sentence"/> Acme rose 5%.'
                                  "<search>Acme rose</search> Globex fell 3%.")
    return doc, recheck, sandbox.replay(doc, "Globex fell 3%.<search>Globex fell</search> Acme rose 5%.")


def test_check_balance_splits_checks_of_a_rewrite_from_first_checks_and_flags_the_shortcut():
    """A search of the sentence written right after a delete (a recheck) is counted apart:
    when first checks are mostly corrected and rechecks never are, the decision after a
    search follows from the position, and a policy can learn it without reading the result."""
    doc, recheck, kept = _shortcut_traces()
    # written on after a delete, but two sentences before the search: a first check of the second
    later = sandbox.replay(doc, 'Acme rose 9%.<search>Acme rose</search><delete scope="sentence"/> Acme rose 5%. '
                                "Globex fell 3%.<search>Globex fell</search>")
    got = ft.check_balance([recheck, later])
    assert (got["first_checks"], got["first_corrected"], got["rechecks"], got["rechecks_corrected"]) == (3, 2, 1, 0)
    assert got["position_predicts"] == round(3 / 4, 4)  # corrected at a first check, kept at a recheck: 3 of 4
    assert got["majority_predicts"] == round(2 / 4, 4)  # one answer for every check: 2 of 4
    assert not ft.check_balance([recheck])["shortcut"]  # two checks: too few to call
    assert ft.check_balance([recheck] * 10)["shortcut"]
    # position says "keep" wherever "keep" is the majority: it adds nothing
    assert not ft.check_balance([recheck, kept, kept] * 10)["shortcut"]
    assert ft.check_balance([])["position_predicts"] == 0.0


def test_results_are_refitted_to_the_policy_budget_never_dropped():
    long = " ".join(f"word{i}" for i in range(120)) + "."
    doc = f"Acme grew fast. {long} Acme hired staff."
    ep = trace("Acme grew.<search>Acme word5</search> It hired.", doc)
    assert "…" not in ep.turns[0].injected
    new, changed = ft.refit_results(ep, len, 200)  # characters as the policy's "tokens"
    assert changed == 1 and len(new.turns[0].injected) <= 200 and "…" in new.turns[0].injected
    assert new.turns[0].call.hits == ep.turns[0].call.hits and new.turns[0].injected.count("</") >= 3
    assert new.meta is ep.meta and new.summary == ep.summary


# --- dedup and ranking --------------------------------------------------------------------


def test_minhash_dedup_keeps_the_first_of_near_duplicates():
    a = trace("Acme reported revenue of $4.2 billion in March. Shares fell 3.5% in New York.", id="a")
    b = trace("Acme reported revenue of $4.2 billion in March. Shares fell 3.5% in New York.", id="b")
    c = trace("Globex reported revenue of $3.1 billion. Jane Doe said the U.S. market drove growth.", id="c")
    kept, dropped = ft.dedup([a, b, c], 0.9)
    assert [e.meta["id"] for e in kept] == ["a", "c"] and dropped == {"b": "a"}


def test_ranking_prefers_structure_then_new_shapes():
    s = "Acme grew."
    ssd = trace(f"{s}<search>Acme</search><search>/grew/</search>{DEL} Acme rose. End.", id="ssd1")
    ssd2 = trace(f"{s}<search>Acme</search><search>/rose/</search>{DEL} Acme rose. End.", id="ssd2")
    sds = trace(f"{s}<search>Acme</search>{DEL} Acme rose.<search>/rose/</search> End.", id="sds")
    unsearched = trace(f"{s}{DEL} Acme rose. More.<search>x</search><search>y</search> End.", id="d")
    assert ft.rank_key(ssd) == ft.rank_key(sds) > ft.rank_key(unsearched)
    repeat = trace(f"{s}<search>Acme</search><search>Acme</search>{DEL} Acme rose. End.", id="rep")
    assert ft.signals(repeat)["repeats"] == 1 and ft.rank_key(repeat) < ft.rank_key(ssd)
    chosen = ft.select_per_doc([ssd, ssd2, unsearched, sds, repeat], 2)
    assert {ft.shape(e) for e in chosen} == {"SSD", "SDS"}
    assert [e.meta["id"] for e in ft.select_per_doc([unsearched, repeat], 1)] == ["rep"]


# --- noise marks and reports ----------------------------------------------------------------


def test_oracle_noise_reasons():
    doc = WORLD[2]
    ok, lab = _corrective(doc)
    assert ft.oracle_noise(doc, ok) == []
    draft = ok.meta["draft"]
    wrong = textsplit.split_sentences(draft)[lab["sentence_index"]]
    kept = trace(draft, doc.text, draft=draft)
    assert ft.oracle_noise(doc, kept) == ["an error is left in the summary"]
    bad_fix = trace(draft.replace(wrong, f"{wrong}<search>/x/</search>{DEL} {wrong}"), doc.text,
                    corrections=[{"corrected": wrong}])
    assert "a correction introduced an error" in ft.oracle_noise(doc, bad_fix)
    right = textsplit.split_sentences(doc.summary)
    needless = trace(f"{right[0]}<search>x</search>{DEL} {right[0]}", doc.text)
    assert ft.oracle_noise(doc, needless) == ["a delete retracted a right sentence"]
    lazy = trace(draft.replace(wrong, f"{wrong}<search>x</search>"), doc.text)
    assert "a search-only check followed a wrong sentence" in ft.oracle_noise(doc, lazy)


def test_spot_check_html_escapes_everything_and_strikes_deletions():
    evil_doc = "<script>alert('doc')</script> Acme grew fast. Acme hired staff."
    ep = trace(f"Acme <b>grew</b> <img src=x onerror=alert(1)>.<search>/Acme/</search>{DEL} Acme grew fast.",
               evil_doc, id="x<i>", trace_kind="corrective")
    ep.doc_id = "<d>"
    page = ft.render_html([(ep, ["an error is left in the summary"]), (ep, None)], "spot <check>")
    for raw in ("<script", "<img", "<b>", "<i>", "<d>", "<check>", "<search>", "<results>", "<delete"):
        assert raw not in page, raw
    assert "&lt;script&gt;" in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "<del class='gone'>Acme &lt;b&gt;grew&lt;/b&gt; &lt;img src=x onerror=alert(1)&gt;.</del>" in page
    assert "<span class='call'>&lt;search&gt;/Acme/&lt;/search&gt;</span>" in page
    rows = list(csv.DictReader(io.StringIO(ft.render_csv([(ep, ["x"]), (ep, [])]))))
    assert [r["oracle_noise"] for r in rows] == ["1", "0"] and rows[0]["verdict"] == ""


# --- end to end ------------------------------------------------------------------------------


def _run(tmp_path, annotator=None, n=200, synth_keys=(), filter_keys=()):
    docs = tmp_path / "docs.jsonl"
    s_cfg = settings.load_config(st.Config, ["--config", str(CONFIGS / "synth_rules.yaml"), f"docs_path={docs}",
                                           f"generate_docs={n}", f"out_path={tmp_path / 'traces.jsonl'}",
                                           f"runs_dir={tmp_path / 'runs'}", *synth_keys])
    synth = st.main(s_cfg, annotator=annotator)
    f_cfg = settings.load_config(ft.Config, ["--config", str(CONFIGS / "filter_newsworld.yaml"), f"docs_path={docs}",
                                           f"traces=[{s_cfg.out_path}]", f"out_dir={tmp_path / 'corpus'}",
                                           f"runs_dir={tmp_path / 'runs'}",
                                           f"split.manifest_path={tmp_path / 'split.json'}", *filter_keys])
    return synth, ft.main(f_cfg), f_cfg


def test_the_gates_called_one_by_one_give_mains_funnel_and_corpus(tmp_path):
    """main is load -> gates -> rank -> split -> spot check -> report, each a function a test can call."""
    _, report, cfg = _run(tmp_path, None, 60, ["drafter.drafts_per_doc=2"])
    train = (tmp_path / "corpus" / "train.jsonl").read_text()
    eps, docs, tok = ft.load_inputs(cfg)
    funnel = ft.Funnel(len(eps))
    eps = ft.gate_inputs(cfg, funnel, eps, docs)
    eps, changed = ft.gate_shape(cfg, funnel, eps, tok)
    eps = ft.rank_and_dedup(cfg, funnel, ft.gate_gain(cfg, funnel, eps, docs))
    split = ft.split_corpus(cfg, funnel, eps, docs)
    assert funnel.rows == report["gates"] and changed == report["gates"][3]["retruncated_blocks"]
    assert "".join(ep.to_json() + "\n" for ep in split["train"]) == train and split["train"]
    noise = ft.spot_check(cfg, split["train"] + split["eval"], docs)
    assert noise == report["noise"]


def test_end_to_end_on_200_news_world_documents(tmp_path):
    synth, report, cfg = _run(tmp_path, None, 200, ["drafter.drafts_per_doc=2"])
    assert synth["traces"] == 400 and report["input"] == 400
    rows = report["gates"]
    assert [r["gate"] for r in rows] == ["documents", "annotation", "judge", "token budget", "format", "relevance",
                                         "factuality gain", "near-duplicates", "ranking", "split"]
    assert all(a["out"] == b["in"] for a, b in zip(rows, rows[1:]))
    assert report["noise"]["spot_check_n"] == 100 and report["noise"]["spot_check_rate"] <= 0.05
    assert report["noise"]["corpus_rate"] <= 0.05 and report["factuality_backend"].startswith("oracle")
    saved = json.loads((tmp_path / "corpus" / "funnel.json").read_text())
    assert saved["gates"] == rows and saved["train"] == report["train"]
    assert saved["checks"]["searches"] == saved["checks"]["corrections"] + saved["checks"]["search_only"] > 0

    manifest = json.loads((tmp_path / "split.json").read_text())
    pools = ft.pool_of(manifest)
    train = traces.read_traces(str(tmp_path / "corpus" / "train.jsonl"))
    held = traces.read_traces(str(tmp_path / "corpus" / "eval.jsonl"))
    assert len(train) == report["train"] > 0 and len(held) == report["eval"] > 0
    assert {pools[e.doc_id] for e in train} == {"train"} and {pools[e.doc_id] for e in held} == {"eval"}
    clusters = {e["id"]: e["cluster"] for p in data.POOLS for e in manifest["pools"][p]}
    assert not {clusters[e.doc_id] for e in train} & {clusters[e.doc_id] for e in held}
    per_doc = {}
    for e in train + held:
        per_doc[e.doc_id] = per_doc.get(e.doc_id, 0) + 1
        assert ft.format_problem(e) is None
    assert max(per_doc.values()) <= 2
    page = (tmp_path / "corpus" / "spot_check.html").read_text()
    assert page.count("<div class='trace'>") == 100
    assert len((tmp_path / "corpus" / "spot_check.csv").read_text().splitlines()) == 101


class _Sloppy:
    """A teacher with faults: it misses every error of one document in three, and
    for another third 'corrects' a sentence into one that keeps the error."""

    name, teacher = "sloppy", None

    def annotate_many(self, pairs):
        out = []
        for doc, summary in pairs:
            labels = oracle.oracle_errors(doc, summary)
            h = traces.stable_hash(doc.id + summary) % 3
            if h == 0:
                labels = []
            elif h == 1:
                sents = textsplit.split_sentences(summary)
                labels = [dict(lab, corrected_clause=sents[lab["sentence_index"]].rstrip(".") + " as well.")
                          for lab in labels]
            out.append(teachers.Annotation(labels=labels))
        return out


def test_gates_drop_bad_corrections_and_the_oracle_sees_missed_errors(tmp_path):
    synth, report, _ = _run(tmp_path, _Sloppy(), 60, ["drafter.drafts_per_doc=2", "judge.backend=none"],
                            ["judge_min=null"])
    gates = {r["gate"]: r for r in report["gates"]}
    assert "judge" not in gates
    assert gates["factuality gain"]["dropped"] > 0  # corrections that fix nothing do not pass
    assert report["noise"]["corpus_rate"] > 0.05  # missed errors are not a gate's business: the spot check sees them
    assert "an error is left in the summary" in report["noise"]["reasons"]


def test_report_warns_of_the_position_shortcut_on_stderr_and_saves_it(tmp_path, capsys):
    _, recheck, kept = _shortcut_traces()
    cfg = ft.Config(out_dir=str(tmp_path))
    for corpus, warned in (([recheck] * 10, True), ([recheck, kept, kept] * 10, False)):
        out = ft.report(cfg, ft.Funnel(len(corpus)), {"train": corpus, "eval": [], "never_touch": []}, None, 0, 1.0)
        err = capsys.readouterr().err
        assert ("follows from its position" in err) is warned
        assert json.loads((tmp_path / "funnel.json").read_text())["checks"]["shortcut"] is warned is out["checks"]["shortcut"]
