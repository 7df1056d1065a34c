"""eval.py: pass@k against enumeration, hallucination and delete counting on the
news world, ROUGE wiring, the decode-time tag ban against a policy forced to
write the tags, the script end to end (one model, --compare, bad input), and the
copying baselines scored as rows beside the models."""
import dataclasses
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import eval as E
import rewards
import sandbox as S
from factual_tools import engine, evaluation, settings, textsplit
import newsworld
from helpers import DOC, bpe_tokenizer, load_config_file, tiny_llama
from newsworld import oracle

ROOT = Path(__file__).resolve().parent.parent
TOK = bpe_tokenizer()
REQUIRED = ["rouge1", "rouge2", "rougeL", "factuality", "rules_pass", "pass", "total", "hallucination_rate", "errors_per_summary",
            "valid_call_rate", "valid_episode_rate", "searches", "deletes", "deletes_removing_error", "pass_at_1",
            "pass_at_2", "pass_at_4", "pass_at_8", "latency_p50_ms", "latency_p95_ms", "tok_s",
            *[f"rule_{r}_pass" for r in rewards.RULES], *evaluation.ORACLE_FREE]


# ---------------------------------------------------------------------------
# pass@k
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n, c, k, expected", [
    (8, 0, 1, 0.0), (8, 0, 8, 0.0), (8, 8, 1, 1.0), (8, 8, 8, 1.0),
    (4, 1, 2, 0.5),    # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 1, 1, 0.25),   # pass@1 is c/n
    (8, 5, 4, 1.0),    # k > n - c: every draw of 4 holds a pass
    (5, 2, 4, 1.0),
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_equals_enumeration_over_subsets():
    for n in range(1, 7):
        for c in range(n + 1):
            outcomes = [True] * c + [False] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert evaluation.pass_at_k(n, c, k) == pytest.approx(brute), (n, c, k)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        evaluation.pass_at_k(n, c, k)


# ---------------------------------------------------------------------------
# ROUGE, hallucinations, deletes
# ---------------------------------------------------------------------------


def test_rouge_identical_disjoint_and_empty():
    same = evaluation.rouge(["Acme reported revenue of $4.2 billion."], ["Acme reported revenue of $4.2 billion."])
    assert same == pytest.approx({"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0})
    assert evaluation.rouge(["alpha beta gamma"], ["delta epsilon zeta"]) == pytest.approx(
        {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0})
    half = evaluation.rouge(["alpha beta gamma", "x"], ["alpha beta gamma", "y"])  # a mean over pairs
    assert half["rouge1"] == pytest.approx(0.5)
    assert evaluation.rouge(["reported"], ["reports"])["rouge1"] == 1.0  # stemmed
    assert all(math.isnan(v) for v in evaluation.rouge([], []).values())


def _swap_number(doc: data.Document) -> str:
    """The reference summary with the first digit of one stated fact value changed."""
    value = next(f["value"] for f in doc.facts if f.get("value") and f["value"] in doc.summary)
    m = re.search(r"\d", value)
    wrong = value[:m.start()] + str(int(m.group()) % 9 + 1) + value[m.end():]
    return doc.summary.replace(value, wrong, 1)


@pytest.mark.parametrize("backend", ["oracle", "lexical"])
def test_hallucinations_counted_by_the_oracle_on_the_news_world(backend):
    docs = list(newsworld.documents(4, seed=3))
    summaries = [d.summary for d in docs] + [_swap_number(d) for d in docs]
    docs2 = docs + docs
    cfg = E.Config(reward=rewards.RewardConfig(factuality=backend))
    scores = rewards.Scorer(cfg.reward).score_batch(list(zip(docs2, summaries)))
    counts, errors = evaluation.error_counts(docs2, summaries, scores, cfg)
    assert counts == [0] * 4 + [1] * 4  # whatever the reward backend, the oracle counts
    assert all(e[0]["type"] == "number_change" for e in errors[4:])


def test_hallucinations_without_an_oracle_use_the_backend_claims():
    doc = data.Document(id="acme", text=DOC)  # no fact table
    summaries = ["Acme Corp. reported revenue of $4.2 billion.",
                 "Acme Corp. reported revenue of $4.2 billion. Globex bought Initech for $9 trillion in Paris."]
    cfg = E.Config(reward=rewards.RewardConfig(factuality="lexical"))
    scores = rewards.Scorer(cfg.reward).score_batch([(doc, s) for s in summaries])
    counts, errors = evaluation.error_counts([doc, doc], summaries, scores, cfg)
    assert counts == [0, 1] and errors == [None, None]


def test_deletes_that_removed_an_error():
    doc = next(iter(newsworld.documents(1, seed=0)))
    first, second = textsplit.split_sentences(doc.summary)[:2]
    wrong = textsplit.split_sentences(_swap_number(doc))[0]
    assert wrong != first
    text = (f'{wrong}<search>/funding/</search><delete scope="sentence"/> {first} {second}'
            f'<delete scope="sentence"/> {second}')
    ep = S.replay(doc.text, text)
    assert [c.deleted for c in ep.calls if c.kind == "delete"] == [wrong, second]
    assert evaluation.deleted_errors(doc, ep) == [True, False]  # the wrong sentence, then a correct one


def test_sentence_events_record_each_written_sentence_and_what_followed():
    doc = next(iter(newsworld.documents(1, seed=0)))
    first, second, third = textsplit.split_sentences(doc.summary)[:3]
    wrong = textsplit.split_sentences(_swap_number(doc))[0]
    support = doc.text.split(". ")[0] + "."  # the article sentence holding the first fact
    text = (f"{wrong}<search>{wrong[:-1]}</search><delete scope=\"sentence\"/> {support} "
            f"{second}<search>{second[:-1]}</search> {third}")
    ep = S.replay(doc.text, text)
    events = evaluation.sentence_events(doc, ep)
    assert [(e["text"], e["wrong"], e["searched"], e["deleted"]) for e in events] == [
        (wrong, True, True, True), (second, False, True, False), (support, False, False, False),
        (third, False, False, False)]
    assert events[0]["found"] is True and events[0]["rewrite_wrong"] is False and events[1]["found"] is True
    stats = evaluation.tool_decision(events)
    # wrong: delete (2); right: search (1), nothing (0), nothing (0): the wrong one outranks all
    assert stats["tool_auc"] == 1.0 and stats["delete_after_wrong"] == 1.0 and stats["delete_after_right"] == 0.0
    assert stats["search_after_right"] == pytest.approx(1 / 3) and stats["evidence_use"] == 1.0
    assert stats["search_found_fact"] == 1.0 and stats["wrong_written"] == 0.25
    # the rewrite repeats the error: evidence not used
    bad = S.replay(doc.text, f"{wrong}<search>{wrong[:-1]}</search><delete scope=\"sentence\"/> {wrong}")
    assert evaluation.tool_decision(evaluation.sentence_events(doc, bad))["evidence_use"] == 0.0


def test_fact_precision_counts_what_is_stated_and_the_share_that_states_nothing():
    """An empty summary states no wrong fact: precision alone would call a policy
    that says nothing precise, so the share of summaries stating no fact sits beside it."""
    docs = list(newsworld.documents(4, seed=3))
    eps = [S.replay(d.text, t) for d, t in zip(docs, [docs[0].summary, "", "It was a day.", _swap_number(docs[3])])]
    m = evaluation.news_world_metrics(docs, eps, [[], [], [], [{"type": "number_change"}]])
    assert m["no_fact_rate"] == 0.5  # the empty summary and the one with no name, number or date
    assert 0.5 < m["fact_precision"] < 1.0  # one wrong number among what the two others state
    right = evaluation.news_world_metrics(docs[:2], eps[:2], [[], []])
    assert right["fact_precision"] == 1.0 and right["no_fact_rate"] == 0.5


# ---------------------------------------------------------------------------
# Oracle-free figures: any article with or without a fact table
# ---------------------------------------------------------------------------

ART = ("Acme Corp. cut 4200 jobs in Ohio, its chief Jane Doe said on Monday. "
       "Revenue fell 12 percent to 4.2 billion. Shares of   Acme fell 3.5% in New York.")
COPY = "Revenue fell 12 percent to 4.2 billion."


def _ep(summary: str = "", **flags) -> S.Episode:
    return S.Episode(document=ART, summary=summary, flags=flags)


@pytest.mark.parametrize("summary, expected", [
    (f"{COPY} Acme grew fast.", [True, False]),
    ("REVENUE fell  12 percent\nto 4.2 billion.", [True]),          # case and whitespace do not count
    ("Shares of Acme fell 3.5% in New York.", [True]),               # the article's own spaces either
    ("cut 4200 jobs in Ohio, its chief Jane Doe said on Monday.", [True]),  # a verbatim tail is verbatim
    ("evenue fell 12 percent to 4.2 billion.", [False]),             # a span must start on a word
    ("Revenue fell 12 percent to 4.2 billion dollars.", [False]),
    ("", []),
])
def test_copied_sentences_are_verbatim_spans_of_the_article(summary, expected):
    assert evaluation.copied_flags(ART, summary) == expected


@pytest.mark.parametrize("summary, single", [
    (COPY, True), (f"{COPY} {COPY.upper()}", True),  # one copied sentence, repeated: still one sentence's text
    (f"{COPY} Shares of Acme fell 3.5% in New York.", False), ("Revenue fell.", False),
    ("Acme grew fast.", False), ("", False),
])
def test_single_copy_is_a_summary_made_of_one_copied_sentence(summary, single):
    assert evaluation.single_copy(ART, summary) is single


@pytest.mark.parametrize("text, loops", [
    ("Acme cut jobs. Revenue fell.", False),
    ("Acme cut jobs. Revenue fell. ACME cut  jobs.", True),                         # the summary repeats
    ("Acme cut jobs.<search>Acme cut jobs</search> Acme cut jobs.", True),            # wrote the result again
    ('Acme cut jobs.<search>Acme cut jobs</search><delete scope="sentence"/> Acme cut jobs.', True),  # retracted
    ('Acme cut 900 jobs.<search>Acme cut</search><delete scope="sentence"/> Acme cut 4200 jobs.', False),
    ("Acme cut jobs. <search>Revenue fell. Acme cut jobs.", False),   # a dangling query is not prose
    ("Acme cut jobs. . .", False),                     # punctuation alone is no sentence
])
def test_an_episode_loops_when_a_sentence_it_wrote_comes_twice(text, loops):
    ep = S.replay(ART, text)
    assert evaluation.loops(ep) is loops, (evaluation.written_sentences(ep), ep.summary)


def test_written_sentences_keep_retracted_text_and_drop_tool_markup():
    ep = S.replay(ART, 'Acme cut 900 jobs.<search>Acme cut</search><delete scope="sentence"/> Acme cut 4200 jobs.')
    assert ep.summary == "Acme cut 4200 jobs."
    assert evaluation.written_sentences(ep) == ["Acme cut 900 jobs.", "Acme cut 4200 jobs."]
    ep = S.replay(ART, "Acme cut jobs.<results>Revenue fell.</results> It grew.<search>Revenue fell. It grew")
    assert evaluation.written_sentences(ep) == ["Acme cut jobs.", "It grew."]  # stray results, a dangling query


def test_stated_numbers_match_the_article_by_value():
    got = evaluation.stated_numbers(ART, "Acme cut 4,200 jobs; revenue fell 12% to $4.2 billion and shares fell 5%. "
                                         "It has five plants.")  # number words are not counted
    assert got == [("4,200", True), ("12%", True), ("$4.2 billion", True), ("5%", False)]
    assert evaluation.stated_numbers(ART, "Shares fell 3.5 percent, not 35%.") == [("3.5 percent", True),
                                                                                     ("35%", False)]
    assert evaluation.stated_numbers(ART, "") == []


def test_unsupported_names_are_capitalised_words_the_article_lacks():
    assert evaluation.unsupported_names(ART, "Acme's chief Jane Doe said Globex cut jobs in Ohio.") == ["Globex"]
    assert evaluation.unsupported_names(ART, "Mr. Smith said the U.S. Deal fell.") == ["Smith", "U.S. Deal"]
    assert evaluation.unsupported_names(ART, "Shares of Acme fell in New York on Monday.") == []
    assert evaluation.unsupported_names(ART, "Jane Doe said Acme’s jobs went.") == []  # a possessive is the name
    assert evaluation.unsupported_names(ART, "The jobs were Acme's.") == []  # before the full stop too
    assert evaluation.unsupported_names(ART, 'Jane Doe said: "In Ohio we cut jobs."') == []  # "In" is no name word
    # conservative: a lone sentence-initial word may be a plain word, so it is not judged
    assert evaluation.unsupported_names(ART, "Globex cut jobs.") == []
    assert evaluation.unsupported_names(ART, "jane doe said so.") == []  # no capitalised span, no name


def test_oracle_free_metrics_pool_sentences_and_numbers_and_count_summaries():
    eps = [_ep(f"{COPY} Acme grew fast."),                 # 1 of 2 sentences copied; numbers supported
           _ep(COPY, truncated=True),                      # a single copy, ran to the token limit
           _ep("Acme cut 5,000 jobs, 12 percent. Acme cut 5,000 jobs, 12 percent."),  # unsupported numbers, a loop
           _ep("Acme's chief Jane Doe told Globex she quit."),  # an unsupported name
           _ep("")]
    m = evaluation.oracle_free_metrics([ART] * 5, eps)
    assert set(m) == set(evaluation.ORACLE_FREE) - {"len_words"}
    assert m["copied_sentences"] == pytest.approx(2 / 6)  # pooled over sentences, not a mean of per-summary shares
    assert m["single_copy_rate"] == pytest.approx(1 / 5)
    assert m["loop_rate"] == pytest.approx(1 / 5) and m["limit_rate"] == pytest.approx(1 / 5)
    # numbers: 12 and 4.2 billion twice, then 5,000 and 12 twice: pooled, not a mean of per-summary shares
    assert m["unsupported_numbers"] == pytest.approx(2 / 8)
    assert m["unsupported_fact_rate"] == pytest.approx(2 / 5)


def test_oracle_free_metrics_are_nan_where_nothing_is_stated():
    m = evaluation.oracle_free_metrics([ART, ART], [_ep(""), _ep("Acme cut five jobs.")])
    assert math.isnan(m["unsupported_numbers"])  # no number stated: no share
    assert m["unsupported_fact_rate"] == 0.0 and m["single_copy_rate"] == 0.0 and m["copied_sentences"] == 0.0
    assert all(math.isnan(v) for v in evaluation.oracle_free_metrics([], []).values())
    assert math.isnan(evaluation.oracle_free_metrics([ART], [_ep("")])["copied_sentences"])  # no sentence
    with pytest.raises(ValueError, match="articles"):
        evaluation.oracle_free_metrics([ART], [])


@pytest.mark.parametrize("pos, neg, expected", [
    ([2, 2], [0, 1], 1.0), ([0], [2], 0.0), ([1, 1], [1, 1], 0.5), ([2, 0], [1], 0.5), ([], [1], math.nan),
])
def test_auc_by_hand(pos, neg, expected):
    got = evaluation.auc(pos, neg)
    assert (math.isnan(got) and math.isnan(expected)) or got == pytest.approx(expected)


def test_auc_equals_the_pairwise_count():
    import random

    rng = random.Random(0)
    for _ in range(20):
        pos = [rng.choice([0, 1, 2]) for _ in range(rng.randint(1, 9))]
        neg = [rng.choice([0, 1, 2]) for _ in range(rng.randint(1, 9))]
        pairs = [(a > b) + 0.5 * (a == b) for a in pos for b in neg]
        assert evaluation.auc(pos, neg) == pytest.approx(sum(pairs) / len(pairs))


# ---------------------------------------------------------------------------
# The delete decision, teacher-forced on traces
# ---------------------------------------------------------------------------

WRONG_TRACE = ('Acme reported revenue of $5 billion.<search>/revenue of/</search><delete scope="sentence"/>'
               ' Acme reported revenue of $4.2 billion.')
RIGHT_TRACE = 'Acme reported revenue of $4.2 billion.<search>/revenue of/</search> Shares fell 3.5% in New York.'


def _delete_logprob(model, ep) -> float:
    """log P(the delete call) right after the first search's results, one forward on its own."""
    ctx = ep.tokenized(TOK).contexts()[1]
    assert TOK.decode(ctx).endswith("</results>")  # the decision comes right after the search's results
    call = S.as_codec(TOK).encode(evaluation.DELETE_CALL)
    ids = torch.tensor([ctx + call])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0].float(), -1)
    return sum(lp[len(ctx) - 1 + k, c].item() for k, c in enumerate(call))


def test_decision_probe_scores_the_delete_call_after_each_search_under_the_traces_context():
    model = tiny_llama(TOK, seed=0).eval()
    eps = [S.replay(DOC, t) for t in (WRONG_TRACE, RIGHT_TRACE, "Shares fell 3.5% in New York.")]
    got = evaluation.decision_probe(model, TOK, eps)
    assert (got["decision_probe_deletes"], got["decision_probe_keeps"]) == (1, 1)  # no search, no decision
    wrong, right = _delete_logprob(model, eps[0]), _delete_logprob(model, eps[1])
    assert got["decision_probe_after_wrong"] == pytest.approx(wrong, abs=1e-4)
    assert got["decision_probe_after_right"] == pytest.approx(right, abs=1e-4)
    assert wrong != right and got["decision_probe_auc"] == (1.0 if wrong > right else 0.0)


def test_decision_probe_in_eval_needs_the_corpus_and_reports_it(world, tmp_path):
    root, _ = world
    corpus = tmp_path / "train.jsonl"
    corpus.write_text("".join(S.replay(DOC, t).to_json() + "\n" for t in (WRONG_TRACE, RIGHT_TRACE) * 2))
    base = ["--config", str(root / "eval.yaml"), "n_samples=0", "latency_docs=0"]
    cfg = settings.load_config(E.Config, [*base, "name=probe", f"decision_corpus={corpus}", "decision_traces=3"])
    E.main(cfg)
    m = json.loads((root / "runs" / "probe" / "eval.json").read_text())["models"][0]["metrics"]
    assert (m["decision_probe_deletes"], m["decision_probe_keeps"]) == (2, 1)  # the first 3 traces
    assert "decision_probe_auc" in (root / "runs" / "probe" / "report.md").read_text()
    missing = tmp_path / "none.jsonl"
    with pytest.raises(SystemExit, match="decision_corpus=" + re.escape(str(missing)) + ".*filter_traces.py"):
        E.main(settings.load_config(E.Config, [*base, f"decision_corpus={missing}"]))
    corpus.write_text(corpus.read_text() + "{not json\n")
    with pytest.raises(SystemExit, match=re.escape(str(corpus)) + ":5"):
        E.main(settings.load_config(E.Config, [*base, f"decision_corpus={corpus}"]))
    with pytest.raises(settings.ConfigError, match="decision_traces"):
        E.Config(decision_traces=0)


# ---------------------------------------------------------------------------
# The tag ban
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("tag, written, piece, banned", [
    ("<search", "", "<search>", True),
    ("<search", "", "x <search", True),      # the whole opening inside one token
    ("<search", "", "<s", True),             # starts it beyond "<"
    ("<search", "", "<", False),             # "<" alone is still text
    ("<search", "<", "s", True),             # continues it across tokens
    ("<search", "<", "b", False),
    ("<search", "<se", "a", True),           # any continuation of a started opening
    ("<search", "", "<sx", False),           # broken inside the token
    ("</search", "", "</", True),
    ("<delete", "the", ' <delete scope="sentence"/>', True),
    ("<delete", "", "", False),
])
def test_tag_ban_rule(tag, written, piece, banned):
    assert evaluation.TagBan.banned(tag, written, piece) is banned


def _char_ids(text: str) -> list[int]:
    """One token per character: a tag forced to span many tokens."""
    ids = [TOK.encode(c, add_special_tokens=False) for c in text]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


WRITE = ' Acme grew.<search>Acme</search> Acme fell.<delete scope="sentence"/> Acme rose.'


@pytest.mark.parametrize("tokens", ["chars", "bpe"])
def test_tag_ban_stops_a_policy_forced_to_write_tags(tokens):
    model = tiny_llama(TOK, seed=1).eval()
    script = (_char_ids(WRITE) if tokens == "chars" else
              engine.ScriptedProcessor.ids_for(lambda s: TOK.encode(s, add_special_tokens=False), WRITE))
    if tokens == "bpe":
        assert len(script) < len(WRITE)  # the tags really are merged tokens here
    force = engine.ScriptedProcessor({i: script for i in range(4)})
    cfg = engine.SamplingConfig(temperature=1.0, max_new_tokens=len(script) + 4, seed=0)
    docs = [DOC, DOC]

    def run(tools):
        ban = evaluation.tool_processor(TOK, tools)
        proc = force if ban is None else (lambda rows, logits: ban(rows, force(rows, logits)))
        return engine.rollout(model, TOK, docs, 2, cfg, logits_processor=proc, generator=torch.Generator().manual_seed(0))

    free = run("all")  # the forcing works: every episode searches and deletes
    assert all(e.n_search == 1 and e.n_delete == 1 for e in free)
    for tools, kinds in [("none", set()), ("no_search", {"delete"}), ("no_delete", {"search"})]:
        eps = run(tools)
        for e in eps:
            written = "".join(t.text for t in e.turns)
            assert {c.kind for c in e.calls} == kinds, (tools, written)
            for tag in evaluation.TOOLS_BANNED[tools]:
                assert tag not in written, (tools, written)


def test_tag_ban_under_evaluate_with_tools_none():
    model = tiny_llama(TOK, seed=2).eval()
    docs = [data.Document(id="acme", text=DOC)]
    cfg = E.Config(tools="none", n_samples=2, max_new_tokens=12, latency_docs=1,
                   reward=rewards.RewardConfig(factuality="lexical"))
    keep = []
    m = evaluation.evaluate(model, TOK, docs, cfg, keep)
    assert m["searches"] == 0 and m["deletes"] == 0 and math.isnan(m["valid_call_rate"])
    assert math.isnan(m["rouge1"]) and math.isnan(m["deletes_removing_error"])  # no reference, no oracle
    assert math.isnan(m["pass_at_4"]) and 0 <= m["pass_at_2"] <= 1
    assert set(REQUIRED) <= set(m) and len(keep) == 1 and keep[0][3] is None
    ep = keep[0][1]  # the oracle-free figures are the greedy episode's
    assert m["limit_rate"] == float(bool(ep.flags.get("truncated"))) and m["loop_rate"] == float(evaluation.loops(ep))
    assert m["single_copy_rate"] == float(evaluation.single_copy(DOC, ep.summary))
    assert all(0 <= m[k] <= 1 or math.isnan(m[k]) for k in evaluation.ORACLE_FREE if k != "len_words")


def test_latency_times_whole_episodes_at_batch_1_after_a_short_warm_up(monkeypatch):
    """The warm-up loads the kernels; it is not timed, so it writes a few tokens, not a
    whole summary."""
    model = tiny_llama(TOK, seed=2).eval()
    docs = [data.Document(id=f"d{i}", text=DOC) for i in range(3)]
    cfg = E.Config(tools="none", n_samples=0, max_new_tokens=40, latency_docs=2,
                   reward=rewards.RewardConfig(factuality="lexical"))
    calls, real = [], evaluation.engine.rollout

    def spy(model, tok, documents, group, scfg, *a, **k):
        calls.append((len(documents), scfg.batch_size, scfg.max_new_tokens))
        return real(model, tok, documents, group, scfg, *a, **k)

    monkeypatch.setattr(evaluation.engine, "rollout", spy)
    evaluation.evaluate(model, TOK, docs, cfg)
    single = [c for c in calls if c[1] == 1]
    assert single == [(1, 1, evaluation.WARM_UP_TOKENS), (1, 1, 40), (1, 1, 40)], calls
    assert evaluation.WARM_UP_TOKENS < 40


# ---------------------------------------------------------------------------
# The script end to end
# ---------------------------------------------------------------------------


def _save_model(path: Path, seed: int) -> str:
    model = tiny_llama(TOK, seed=seed)
    model.save_pretrained(path)
    TOK.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny model directory and twenty news-world documents with a split."""
    root = tmp_path_factory.mktemp("eval")
    docs = list(newsworld.documents(20, seed=5))
    data.write_jsonl(str(root / "docs.jsonl"), docs)
    manifest = data.make_split(docs, (0.5, 0.3, 0.2))
    assert manifest["counts"]["eval"] >= 3
    (root / "split.json").write_text(json.dumps(manifest))
    cfg = (f"runs_dir: {root / 'runs'}\nmodel: {_save_model(root / 'model_a', 0)}\ndocs: {root / 'docs.jsonl'}\n"
           f"split: {root / 'split.json'}\nn_docs: 3\nn_samples: 2\nmax_new_tokens: 24\nlatency_docs: 2\n"
           "html_samples: 2\ntorch_threads: 1\nreward:\n  factuality: oracle\n")
    (root / "eval.yaml").write_text(cfg)
    return root, manifest


def test_main_writes_every_metric_report_plots_and_samples(world, capsys):
    root, manifest = world
    cfg = settings.load_config(E.Config, ["--config", str(root / "eval.yaml"), "name=one"])
    E.main(cfg)
    printed = capsys.readouterr().out
    assert all(f"{k} " in printed for k in evaluation.ORACLE_FREE)  # the model's line shows them
    out = root / "runs" / "one"
    got = json.loads((out / "eval.json").read_text())
    assert [x["model"] for x in got["models"]] == [cfg.model]
    m = got["models"][0]["metrics"]
    assert set(REQUIRED) <= set(m), set(REQUIRED) - set(m)
    eval_ids = [e["id"] for e in manifest["pools"]["eval"]]
    assert got["doc_ids"] == [d.id for d in data.read_documents(str(root / "docs.jsonl")) if d.id in eval_ids][:3]
    assert got["n_docs"] == 3 and got["factuality_backend"] == rewards.BACKEND_NAMES["oracle"]
    assert m["pass_at_4"] is None and m["pass_at_8"] is None  # k > n_samples: n/a, not a number
    assert m["pass_at_1"] == pytest.approx(m["pass_sampled"])  # unbiased pass@1 is the sampled pass rate
    assert 0 <= m["hallucination_rate"] <= 1 and m["latency_p95_ms"] >= m["latency_p50_ms"] > 0
    report = (out / "report.md").read_text()
    assert "| model | rouge1 |" in report and "n/a" in report and rewards.BACKEND_NAMES["oracle"] in report
    quality = report.split("## Quality")[1].split("##")[0]
    assert all(f" {k} |" in quality for k in evaluation.ORACLE_FREE)
    assert (out / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "samples.html").read_text()
    assert html.count("class='trace'") == 2  # html_samples per model
    assert html.count("clean (oracle)") + html.count("class='noise'") == 2  # each marked by the oracle
    rows = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert [(r["model"], r["doc_id"]) for r in rows] == [(cfg.model, i) for i in got["doc_ids"]]  # every document
    docs = {d.id: d for d in data.read_documents(str(root / "docs.jsonl"))}
    for r in rows:
        ep = S.Episode.from_dict(r["episode"])  # the episode itself, tool calls and all
        assert ep.doc_id == r["doc_id"] and ep.document == docs[r["doc_id"]].text
        assert r["errors"] == oracle.oracle_errors(docs[r["doc_id"]], ep.summary)  # the oracle's reading
        assert {"total", "pass", "factuality"} <= set(r["score"])  # the reward terms the figures average
    assert m["pass"] == pytest.approx(sum(r["score"]["pass"] for r in rows) / len(rows))  # the figure's rows


def test_no_samples_skips_the_sampled_pass_and_reports_pass_at_k_as_na(world, monkeypatch):
    root, _ = world
    calls = []
    real = evaluation.engine.rollout
    monkeypatch.setattr(evaluation.engine, "rollout", lambda *a, **k: calls.append(k.get("progress") or "") or real(*a, **k))
    cfg = settings.load_config(E.Config, ["--config", str(root / "eval.yaml"), "name=greedy_only", "n_samples=0"])
    E.main(cfg)
    m = json.loads((root / "runs" / "greedy_only" / "eval.json").read_text())["models"][0]["metrics"]
    assert not any(c.startswith("samples") for c in calls) and calls  # the greedy pass ran, no sampled one
    assert all(m[f"pass_at_{k}"] is None for k in E.KS) and m["fact_precision"] is not None
    with pytest.raises(settings.ConfigError, match="n_samples >= 0"):
        E.Config(n_samples=-1)


def test_compare_evaluates_each_directory_on_the_same_documents_and_seeds(world):
    root, _ = world
    a = str(root / "model_a")
    b = _save_model(root / "model_b", 1)
    c = str(root / "model_a_copy")
    shutil.copytree(a, c, dirs_exist_ok=True)
    proc = subprocess.run([sys.executable, "eval.py", "--config", str(root / "eval.yaml"), "name=cmp", "latency_docs=1",
                           "--compare", a, b, c], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads((root / "runs" / "cmp" / "eval.json").read_text())
    assert [x["model"] for x in got["models"]] == [a, b, c]
    ma, mc = got["models"][0]["metrics"], got["models"][2]["metrics"]
    for k in REQUIRED:
        if not k.startswith(("latency", "tok_s")):
            assert ma[k] == mc[k], k  # same weights, same documents and seeds: same numbers
    report = (root / "runs" / "cmp" / "report.md").read_text()
    quality = report.split("## Quality")[1].split("##")[0]
    assert all(f"| {p} |" in quality for p in (a, b, c))  # one table, a row per model


def test_shipped_config():
    cfg = settings.load_config(E.Config, ["--config", str(ROOT / "configs" / "eval_tiny.yaml")])
    assert (cfg.model, cfg.docs, cfg.split, cfg.pool) == (
        "runs/rl_tiny/final", "out/newsworld/docs.jsonl", "out/newsworld/split.json", "eval")
    assert (cfg.reward.factuality, cfg.n_docs, cfg.n_samples, cfg.max_new_tokens, cfg.latency_docs,
            cfg.torch_threads) == ("oracle", 1000, 4, 160, 16, 0)


def test_split_compare_takes_the_directories_out():
    assert E.split_compare(["--config", "x.yaml", "--compare", "A", "B", "n_docs=3"]) == (
        ["--config", "x.yaml", "n_docs=3"], ["A", "B"])
    with pytest.raises(settings.ConfigError, match="--compare needs"):
        E.split_compare(["--compare", "--config", "x.yaml"])


def test_bad_input_names_the_path_and_the_command(world, tmp_path):
    root, _ = world
    base = ["--config", str(root / "eval.yaml"), f"runs_dir={tmp_path}"]
    missing = tmp_path / "runs" / "sft_nope" / "final"
    with pytest.raises(SystemExit, match=re.escape(str(missing)) + ".*sft.py --config configs/sft_tiny.yaml"):
        E.main(settings.load_config(E.Config, [*base, f"model={missing}"]))
    with pytest.raises(SystemExit, match="rl.py --config"):
        E.main(settings.load_config(E.Config, [*base, "model=runs/rl_nope/final"]))
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path / "no.jsonl")) + ".*python -m newsworld generate"):
        E.main(settings.load_config(E.Config, [*base, f"docs={tmp_path / 'no.jsonl'}"]))
    with pytest.raises(SystemExit, match=re.escape(str(tmp_path / "no.json")) + ".*data.py split"):
        E.main(settings.load_config(E.Config, [*base, f"split={tmp_path / 'no.json'}"]))
    real = tmp_path / "real.jsonl"  # real news: a reference summary, no fact table
    data.write_jsonl(str(real), [data.Document(id="acme", text=DOC, summary="Acme reported revenue.")])
    with pytest.raises(SystemExit, match="factuality=oracle needs a fact table.*reward.factuality=support"):
        E.main(settings.load_config(E.Config, [*base, f"docs={real}", "split="]))
    with pytest.raises(SystemExit, match="never_touch"):  # an empty pool is an error, not an empty table
        E.main(settings.load_config(E.Config, [*base, "pool=never_touch", f"split={_empty_pool(root, tmp_path)}"]))


def _empty_pool(root: Path, tmp_path: Path) -> str:
    manifest = json.loads((root / "split.json").read_text())
    manifest["pools"]["never_touch"] = []
    path = tmp_path / "split_empty.json"
    path.write_text(json.dumps(manifest))
    return str(path)


# ---------------------------------------------------------------------------
# Key-fact coverage on the long task
# ---------------------------------------------------------------------------

NEWS_CFG = ROOT / "configs" / "eval_news.yaml"


@pytest.fixture(scope="module")
def long_docs():
    return list(newsworld.documents(6, 0, task="long"))


def _replayed(texts):
    return lambda docs: [S.replay(d.text, t) for d, t in zip(docs, texts)]


def test_coverage_from_the_reward_and_key_fact_coverage_from_the_oracle_whatever_the_reward(long_docs):
    cfg = load_config_file(NEWS_CFG)
    texts = [textsplit.lead(d.text, 3) for d in long_docs]
    want = sum(oracle.key_fact_coverage(d, t) for d, t in zip(long_docs, texts)) / len(texts)
    assert 0 < want < 1
    on = evaluation.greedy_eval(None, None, long_docs, cfg, generate=_replayed(texts))[0]
    assert on["coverage"] == pytest.approx(want) and on["key_fact_coverage"] == pytest.approx(want)
    off = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, coverage=False))
    got = evaluation.greedy_eval(None, None, long_docs, off, generate=_replayed(texts))[0]
    assert math.isnan(got["coverage"]) and got["key_fact_coverage"] == pytest.approx(want)
    assert got["pass"] >= on["pass"]  # F without coverage is precision alone


# ---------------------------------------------------------------------------
# Copying baselines: rows no model writes, scored as a model's are
# ---------------------------------------------------------------------------

NOT_DECODED = ("pass_at_1", "pass_at_2", "pass_at_4", "pass_at_8", "pass_sampled", "latency_p50_ms", "latency_p95_ms",
               "tok_s", "len_tokens")


@pytest.fixture
def no_model(monkeypatch):
    """Loading or decoding a model fails the test: a baseline does neither."""
    def refuse(*a, **k):
        raise AssertionError("a copying baseline loaded or ran a model")

    monkeypatch.setattr(evaluation, "load_model", refuse)
    monkeypatch.setattr(evaluation.modeling, "load_policy", refuse)
    monkeypatch.setattr(evaluation.engine, "rollout", refuse)


def test_copying_baselines_are_scored_as_a_model_is_without_one(long_docs, no_model):
    cfg = load_config_file(NEWS_CFG)
    assert cfg.reward.rules.max_words == 45 and cfg.reward.coverage  # the long task's reward
    rows, kept = {}, {}
    for name, make in (("lead-3", lambda d: textsplit.lead(d.text, 3)), ("best-extract", lambda d: oracle.best_extract(d, 45))):
        kept[name] = keep = []
        rows[name] = m = evaluation.evaluate_baseline(name, long_docs, cfg, keep)
        assert set(REQUIRED) <= set(m), set(REQUIRED) - set(m)
        texts = [make(d) for d in long_docs]
        assert [ep.summary for _, ep, _, _ in keep] == texts  # the baseline's text through the sandbox
        assert [ep.doc_id for _, ep, _, _ in keep] == [d.id for d in long_docs]
        # every greedy figure is the one a model writing these texts would get
        same = evaluation.greedy_eval(None, None, long_docs, cfg, generate=_replayed(texts))[0]
        assert same.keys() <= m.keys() and {k: m[k] for k in same} == pytest.approx(same, nan_ok=True)
        assert all(math.isnan(m[k]) for k in NOT_DECODED), {k: m[k] for k in NOT_DECODED}  # nothing decodes
        assert m["copied_sentences"] == 1.0 and m["fact_precision"] > 0.9 and m["searches"] == 0
        assert m["n_docs"] == 6 and 0 < m["rouge1"] < 1
    lead, best = rows["lead-3"], rows["best-extract"]
    assert lead["pass"] == 0 and lead["len_words"] > 45 and lead["rule_length_pass"] < 1  # over the budget
    assert all(len(textsplit.words(ep.summary)) <= 45 for _, ep, _, _ in kept["best-extract"])  # the budget
    assert 0 < best["coverage"] < 1 and best["coverage"] == pytest.approx(best["key_fact_coverage"])
    assert best["key_fact_coverage"] > lead["key_fact_coverage"]  # the oracle's choice covers more
    assert best["pass"] < 0.6 and lead["pass"] < 0.6  # copying falls below the M2 bar


def test_best_extract_takes_the_word_budget_from_the_reward_rules(long_docs):
    cfg = load_config_file(NEWS_CFG)
    short = dataclasses.replace(cfg, reward=dataclasses.replace(
        cfg.reward, rules=dataclasses.replace(cfg.reward.rules, max_words=30)))
    at45 = [evaluation.BASELINES["best-extract"](d, cfg) for d in long_docs]
    at30 = [evaluation.BASELINES["best-extract"](d, short) for d in long_docs]
    assert at45 == [oracle.best_extract(d, 45) for d in long_docs]
    assert all(len(textsplit.words(t)) <= 30 for t in at30) and at30 != at45


def test_best_extract_needs_a_fact_table_lead_3_only_the_text(tmp_path, no_model):
    real = data.Document(id="acme", text=DOC, summary="Acme reported revenue of $4.2 billion.")  # no fact table
    cfg = load_config_file(NEWS_CFG)
    assert evaluation.BASELINES["lead-3"](real, cfg) == textsplit.lead(real.text, 3) == " ".join(
        textsplit.split_sentences(DOC)[:3])
    with pytest.raises(data.DataError, match="best-extract.*'acme'.*lead-3"):
        evaluation.BASELINES["best-extract"](real, cfg)
    path = tmp_path / "real.jsonl"
    data.write_jsonl(str(path), [real])
    base = ["--config", str(NEWS_CFG), f"runs_dir={tmp_path / 'runs'}", f"docs={path}", "split=", "n_samples=0",
            "latency_docs=0", "reward.factuality=lexical", "reward.coverage=false"]
    with pytest.raises(SystemExit, match="best-extract.*'acme'.*" + re.escape(str(path))):
        E.main(settings.load_config(E.Config, [*base, "name=no_facts"]), ["lead-3", "best-extract"])
    assert not (tmp_path / "runs" / "no_facts").exists()  # stopped before the run began
    m = E.main(settings.load_config(E.Config, [*base, "name=lead"]), ["lead-3"])["lead-3"]
    assert m["news_world"] == 0 and m["copied_sentences"] == 1.0 and m["rouge1"] > 0
    assert math.isnan(m["coverage"]) and "key_fact_coverage" not in m  # no fact table, no key facts


def test_main_compares_baselines_beside_a_model_and_reserved_names_win(world, long_docs, tmp_path, monkeypatch,
                                                                        capsys):
    root, _ = world
    path = tmp_path / "long.jsonl"
    data.write_jsonl(str(path), long_docs)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(root / "model_a", tmp_path / "lead-3")  # a model so named: the reserved name means the baseline,
    model = "./lead-3"                                        # the path the directory
    loaded, real = [], evaluation.load_model
    monkeypatch.setattr(evaluation, "load_model", lambda p, cfg: loaded.append(p) or real(p, cfg))
    cfg = settings.load_config(E.Config, [
        "--config", str(NEWS_CFG), f"runs_dir={tmp_path / 'runs'}", "name=baselines", f"docs={path}", "split=",
        "n_samples=0", "latency_docs=0", "max_new_tokens=8", "torch_threads=1"])
    E.main(cfg, ["lead-3", "best-extract", model])
    assert loaded == [model]  # only the model directory was loaded
    printed = capsys.readouterr().out
    for name in ("lead-3", "best-extract"):
        line = next(x for x in printed.splitlines() if x.startswith(f"{name}: "))
        assert all(f" {k} " in f" {line}" for k in ("fact_precision", "coverage", "key_fact_coverage", "pass",
                                                      *evaluation.ORACLE_FREE)), line
    got = json.loads((tmp_path / "runs" / "baselines" / "eval.json").read_text())
    assert [x["model"] for x in got["models"]] == ["lead-3", "best-extract", model]
    assert [x["baseline"] for x in got["models"]] == [True, True, False]
    lead, best, tiny = (x["metrics"] for x in got["models"])
    for m in (lead, best):
        assert set(REQUIRED) <= set(m) and all(m[k] is None for k in NOT_DECODED)  # n/a, not a number
    assert lead["pass"] == 0 and lead["len_words"] > 45 and best["len_words"] <= 45 and best["coverage"] < 1
    assert tiny["len_tokens"] > 0 and tiny["key_fact_coverage"] is not None
    report = (tmp_path / "runs" / "baselines" / "report.md").read_text()
    quality = report.split("## Quality")[1].split("##")[0]
    assert all(f"| {p} |" in quality for p in ("lead-3", "best-extract", model))
    assert all(f" {k} |" in quality for k in ("fact_precision", "coverage", "key_fact_coverage"))
    assert all(name in E.__doc__ and name in E.split_compare.__doc__ for name in evaluation.BASELINES)
