"""newsworld/errors.py: each summary sentence's distance (words) back to the sentence supporting it,
in the prompt's article or in a search result, read from the context the model saw (retracted text
pruned as the sandbox prunes it); the per-model tables of an eval run directory; bad input.

One long-task article (world 0, article 0: 24 sentences, 309 words) and hand-counted words:
sentence 0 (the lead) has 29 words and 280 follow it; sentence 19 (the lead investor) has 18 and
51 follow it (12 + 14 + 9 + 16); sentence 23 (the valuation) is the last. Episodes are real: their
text is replayed through the sandbox (top_k=1, as the tiny configs set), so results blocks are the
sandbox's own."""
import json

import pytest

import data
import newsworld
import sandbox as S
from factual_tools import textsplit
from newsworld import __main__ as cli, errors as NE, oracle

DOC = newsworld.world_document(0, 0, task="long")
SS = textsplit.split_sentences(DOC.text)
LEAD, INVESTOR, VALUATION = SS[0], SS[19], SS[23]
WRONG_VALUATION = VALUATION.replace("$2.5 billion", "$79.3 million")  # the previous round's figure
MADE_UP = "The mayor opened a new bridge in Leeds."
SEARCH_INVESTOR = "<search>Pinnacle Capital led</search>"  # 3 query words; BM25's top hit is sentence 19
DELETE = '<delete scope="sentence"/>'


def records(text: str, **limits):
    return NE.sentence_records(DOC, S.replay(DOC.text, text, top_k=1, **limits))


def where(recs):
    return [(r.distance, r.source, r.bucket) for r in recs]


def test_the_hand_counts_hold_for_this_article():
    assert len(SS) == 24 and len(textsplit.words(DOC.text)) == 309
    assert (len(textsplit.words(LEAD)), len(textsplit.words(INVESTOR))) == (29, 18)
    assert "valued at $2.5 billion" in VALUATION and "Pinnacle Capital led the round" in INVESTOR
    assert [oracle.oracle_support(DOC, s) for s in (LEAD, INVESTOR, VALUATION)] == [[0], [19], [23]]
    assert [e["type"] for e in oracle.oracle_errors(DOC, WRONG_VALUATION)] == ["number_change"]


# --- distance in the article -------------------------------------------------------------


def test_a_copied_last_sentence_is_near_and_the_lead_is_far():
    assert where(records(VALUATION)) == [(0, "article", "0-50")]  # nothing follows it
    assert where(records(LEAD)) == [(280, "article", "150-300")]  # the rest of the article
    # Written second, the last sentence is as far back as the lead the model wrote before it.
    assert where(records(f"{LEAD} {VALUATION}")) == [(280, "article", "150-300"), (29, "article", "0-50")]


# --- distance in a search result ------------------------------------------------------------


def test_a_sentence_written_after_its_search_takes_the_results_distance():
    ep = S.replay(DOC.text, SEARCH_INVESTOR + INVESTOR, top_k=1)
    assert ep.turns[0].injected == f"<results><0>{INVESTOR}</0></results>"
    assert where(NE.sentence_records(DOC, ep)) == [(0, "search", "0-50")]  # not 51 + 3 + 18 back in the article


def test_text_between_the_results_and_the_sentence_counts_and_so_do_query_and_results():
    recs = records(f"{SEARCH_INVESTOR}{LEAD} {INVESTOR}")
    # The lead: 280 article words, then the query (3) and the result (18) the model saw before writing it.
    # The investor: the lead (29) stands between the result and it.
    assert where(recs) == [(301, "article", "300+"), (29, "search", "0-50")]


def test_a_search_inside_the_sentence_counts_as_seen_before_it_was_finished():
    text = "Pinnacle Capital led the round, " + SEARCH_INVESTOR + INVESTOR[len("Pinnacle Capital led the round, "):]
    recs = records(text)
    assert [r.text for r in recs] == [INVESTOR] and where(recs) == [(0, "search", "0-50")]


def test_a_shortened_result_counts_only_while_it_keeps_a_long_prefix():
    ep = S.replay(DOC.text, SEARCH_INVESTOR + INVESTOR, top_k=1, result_tokens=10)
    kept = "Pinnacle Capital led the round, and Granite Group had raised…"  # cut to fit 10 whitespace tokens
    assert ep.turns[0].injected == f"<results><0>{kept}</0></results>"
    assert where(NE.sentence_records(DOC, ep)) == [(0, "search", "0-50")]
    ep = S.replay(DOC.text, SEARCH_INVESTOR + INVESTOR, top_k=1, result_tokens=4)
    assert ep.turns[0].injected == "<results><0>Pinnacle Capital led the…</0></results>"  # 4 words: too few
    assert where(NE.sentence_records(DOC, ep)) == [(51 + 3 + 4, "article", "50-150")]


def test_a_result_that_does_not_hold_the_support_is_only_distance():
    recs = records(f"{SEARCH_INVESTOR}{VALUATION}")
    assert where(recs) == [(0 + 3 + 18, "article", "0-50")]


# --- wrong sentences ------------------------------------------------------------------------


def test_a_changed_number_is_wrong_with_its_type_in_its_bucket():
    recs = records(f"{LEAD} {WRONG_VALUATION}")
    assert [(r.wrong, r.types) for r in recs] == [(False, []), (True, ["number_change"])]
    assert where(recs) == [(280, "article", "150-300"), (29, "article", "0-50")]
    made_up = records(f"{VALUATION} {MADE_UP}")[1]
    assert (made_up.wrong, made_up.types, made_up.support, made_up.bucket) == (True, ["unsupported"], [], "unsupported")
    assert made_up.distance is None and made_up.source is None


# --- retracted text ---------------------------------------------------------------------------


def test_retracted_text_is_no_summary_sentence_and_no_context():
    # Searched, wrote a wrong sentence, deleted it, wrote the right one: the results stay in the
    # context (the evidence), the 16 retracted words do not.
    ep = S.replay(DOC.text, f"{SEARCH_INVESTOR}{WRONG_VALUATION}{DELETE} {INVESTOR}", top_k=1)
    assert ep.summary == INVESTOR
    recs = NE.sentence_records(DOC, ep)
    assert [(r.text, r.wrong) for r in recs] == [(INVESTOR, False)]
    assert where(recs) == [(0, "search", "0-50")]
    # With the support only in the article: the lead (29) is before it, the retracted sentence is not.
    recs = records(f"{LEAD} {WRONG_VALUATION}{DELETE} {VALUATION}")
    assert [r.text for r in recs] == [LEAD, VALUATION]
    assert where(recs) == [(280, "article", "150-300"), (29, "article", "0-50")]


def test_the_replayed_context_is_the_sandboxs_pruned_one():
    ep = S.replay(DOC.text, f"{LEAD} {WRONG_VALUATION}{SEARCH_INVESTOR}{DELETE} {VALUATION}", top_k=1)
    context, summary = NE.replayed_context(ep)
    assert summary == ep.summary == f"{LEAD} {VALUATION}"
    # The search written after the cut is kept (with its results) before the delete tag.
    assert context == f"{LEAD}{SEARCH_INVESTOR}<results><0>{INVESTOR}</0></results>{DELETE} {VALUATION}"
    read, offsets = NE.summary_offsets(context)
    assert read == summary and context[offsets[len(LEAD) + 1]:].startswith(VALUATION)


def test_a_capped_episode_replays_to_its_own_summary():
    # The second delete is past max_deletes=1: it ends the episode unapplied, so the valuation stays.
    text = f"{WRONG_VALUATION}{DELETE} {LEAD} {VALUATION}{DELETE} {MADE_UP}"
    ep = S.replay(DOC.text, text, top_k=1, max_deletes=1)
    assert ep.flags.get("delete_cap") and ep.summary == f"{LEAD} {VALUATION}"
    assert NE.replayed_context(ep) == (f"{DELETE} {LEAD} {VALUATION}{DELETE}", ep.summary)
    assert where(NE.sentence_records(DOC, ep)) == [(280, "article", "150-300"), (29, "article", "0-50")]
    # A search past max_tool_calls is not run either; the valuation is 50 words back: the lead (29),
    # the query (3) and a result without its support (18), the first word of the next bucket.
    text = f"{LEAD}{SEARCH_INVESTOR} {VALUATION}<search>/valued at/</search> {MADE_UP}"
    ep = S.replay(DOC.text, text, top_k=1, max_tool_calls=1)
    assert ep.flags.get("tool_cap") and ep.summary == f"{LEAD} {VALUATION}"
    assert where(NE.sentence_records(DOC, ep)) == [(280, "article", "150-300"), (29 + 3 + 18, "article", "50-150")]


def test_a_call_completed_by_the_last_token_of_a_truncated_episode_is_not_run():
    b = S.EpisodeBuilder(DOC.text, [], None)
    for ch in f"{LEAD}{DELETE}":
        b.push(ord(ch))
    b.end_turn("truncated")  # the token limit: the delete is recorded, not applied
    ep = b.finish()
    assert ep.summary == LEAD and ep.turns[0].call.kind == "delete"
    assert NE.replayed_context(ep)[1] == LEAD and where(NE.sentence_records(DOC, ep)) == [(280, "article", "150-300")]


def test_a_search_left_open_at_the_token_limit_is_no_summary_text():
    # The limit cut the key: the sandbox drops the open tag and its words from the summary (dangling).
    b = S.EpisodeBuilder(DOC.text, [], None)
    for ch in f"{LEAD}<search>Pinnacle Capital led":
        b.push(ord(ch))
    b.end_turn("truncated")
    ep = b.finish()
    assert ep.flags.get("dangling") and ep.summary == LEAD
    assert where(NE.sentence_records(DOC, ep)) == [(280, "article", "150-300")]  # located, not "unlocated"


# --- a run directory --------------------------------------------------------------------------


def write_run(root, episodes: dict[str, list[str]], baselines=()):
    """An eval.py-like run directory: eval.json naming docs.jsonl, a line per (model, episode)."""
    data.write_jsonl(str(root / "docs.jsonl"), [DOC])
    run = root / "run"
    run.mkdir()
    (run / "eval.json").write_text(json.dumps({"config": {"docs": str(root / "docs.jsonl")},
                                               "models": [{"model": m, "baseline": m in baselines, "metrics": {}}
                                                          for m in episodes]}))
    lines = []
    for model, texts in episodes.items():
        for text in texts:
            ep = S.replay(DOC.text, text, top_k=1)
            ep.doc_id = DOC.id
            lines.append(json.dumps({"model": model, "doc_id": DOC.id, "score": {"pass": 0.0},
                                     "errors": oracle.oracle_errors(DOC, ep.summary), "episode": ep.to_dict()}))
    (run / "episodes.jsonl").write_text("".join(line + "\n" for line in lines))
    return run


POLICY = (f"{SEARCH_INVESTOR}{LEAD} {INVESTOR}"                       # 301 back in the article; 29 after its result
          f"<search>/valued at/</search>{WRONG_VALUATION}"            # wrong, its support just injected
          f" {MADE_UP}<search>/Leeds/</search>{DELETE} {MADE_UP}")    # retracted once, then written again
COPIER = f"{LEAD} {WRONG_VALUATION}"                                   # 280; wrong, 29 back


def test_the_breakdown_of_a_run_by_bucket_source_and_type(tmp_path):
    run = write_run(tmp_path, {"copier": [COPIER], "policy": [POLICY]}, baselines={"copier"})
    got = NE.error_breakdown(run)
    assert list(got) == ["copier", "policy"]
    c, p = got["copier"], got["policy"]
    assert (c["baseline"], c["episodes"], c["sentences"], c["wrong"]) == (True, 1, 2, 1)
    assert (p["baseline"], p["episodes"], p["sentences"], p["wrong"]) == (False, 1, 4, 2)  # MADE_UP counted once
    n = {m: {b: t["buckets"][b]["sentences"] for b in t["buckets"]} for m, t in got.items()}
    assert n["copier"] == {"0-50": 1, "50-150": 0, "150-300": 1, "300+": 0, "unsupported": 0, "unlocated": 0}
    assert n["policy"] == {"0-50": 2, "50-150": 0, "150-300": 0, "300+": 1, "unsupported": 1, "unlocated": 0}
    share = {m: {b: t["buckets"][b]["wrong_share"] for b in NE.BUCKETS} for m, t in got.items()}
    assert share["copier"] == {"0-50": 1.0, "50-150": None, "150-300": 0.0, "300+": None}
    assert share["policy"] == {"0-50": 0.5, "50-150": None, "150-300": None, "300+": 0.0}
    assert p["buckets"]["unsupported"]["wrong_share"] == 1.0
    assert c["source"] == {"search": {"sentences": 0, "wrong": 0, "wrong_share": None},
                           "article": {"sentences": 2, "wrong": 1, "wrong_share": 0.5}}
    assert p["source"] == {"search": {"sentences": 2, "wrong": 1, "wrong_share": 0.5},
                           "article": {"sentences": 1, "wrong": 0, "wrong_share": 0.0}}
    assert c["error_counts"]["number_change"] == 1 and sum(c["error_counts"].values()) == 1
    assert p["error_counts"]["number_change"] == 1 and p["error_counts"]["unsupported"] == 1
    assert sum(p["error_counts"].values()) == 2
    assert c["errors_per_100_sentences"]["number_change"] == 50.0 and c["errors_per_100_sentences"]["all"] == 50.0
    assert p["errors_per_100_sentences"]["unsupported"] == 25.0 and p["errors_per_100_sentences"]["all"] == 50.0
    assert p["errors_per_100_sentences"]["entity_swap"] == 0.0


def test_the_markdown_has_a_table_per_measure_and_a_row_per_model(tmp_path):
    md = NE.markdown(NE.error_breakdown(write_run(tmp_path, {"copier": [COPIER], "policy": [POLICY]})))
    tables = {s.split("\n", 1)[0]: s for s in md.split("## ")[1:]}
    assert len(tables) == 5
    wrong = tables["Wrong share per distance bucket"]
    assert "| model | 0-50 | 50-150 | 150-300 | 300+ | unsupported |" in wrong
    assert "| copier | 1 | n/a | 0 | n/a | n/a |" in wrong and "| policy | 0.5 | n/a | n/a | 0 | 1 |" in wrong
    source = next(t for k, t in tables.items() if k.startswith("Wrong share by where"))
    assert "| copier | n/a (0) | 0.5 (2) |" in source and "| policy | 0.5 (2) | 0 (1) |" in source


def test_the_command_prints_the_tables_and_writes_errors_json(tmp_path, capsys):
    run = write_run(tmp_path, {"copier": [COPIER, LEAD]})
    assert cli.main(["errors", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"# Errors of {run}" in out and "| copier | 1 | 0 | 2 | 0 | 0 |" in out  # sentences per bucket
    assert json.loads((run / "errors.json").read_text()) == json.loads(json.dumps(NE.error_breakdown(run)))


# --- bad input --------------------------------------------------------------------------------


def test_a_malformed_line_is_named_by_file_and_line(tmp_path, capsys):
    run = write_run(tmp_path, {"copier": [COPIER]})
    good = (run / "episodes.jsonl").read_text()
    (run / "episodes.jsonl").write_text(good + '{"model": "copier", "doc_id": \n')
    with pytest.raises(data.DataError, match=r"episodes\.jsonl:2: malformed JSON"):
        NE.error_breakdown(run)
    (run / "episodes.jsonl").write_text(good + json.dumps({"model": "copier", "doc_id": DOC.id}) + "\n")
    with pytest.raises(data.DataError, match=r"episodes\.jsonl:2: not an episode row"):
        NE.error_breakdown(run)
    assert cli.main(["errors", str(run)]) == 1  # the command: one line, exit status 1
    assert "episodes.jsonl:2" in capsys.readouterr().err and not (run / "errors.json").exists()


def test_an_unknown_document_and_a_missing_file_are_named(tmp_path):
    run = write_run(tmp_path, {"copier": [COPIER]})
    row = json.loads((run / "episodes.jsonl").read_text())
    (run / "episodes.jsonl").write_text(json.dumps(row | {"doc_id": "nw-9-999999"}) + "\n")
    with pytest.raises(data.DataError, match=r"episodes\.jsonl:1: document 'nw-9-999999' is not in .*docs\.jsonl"):
        NE.error_breakdown(run)
    (run / "episodes.jsonl").unlink()
    with pytest.raises(data.DataError, match=r"episodes\.jsonl: no such file"):
        NE.error_breakdown(run)
