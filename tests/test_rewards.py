"""Rewards: rules (table-driven), totality on garbage, the lexical scorer, FENICE
(hand computation, tiny random HF models), tool terms, ToolMatch, the curriculum,
the combined reward and its batch API, and the news-world agreement check."""
import collections
import dataclasses
from collections import Counter
import json
import math
import os
import random

import numpy as np
import pytest
import hypothesis
from hypothesis import given
from hypothesis import strategies as st

import rewards as R
import sandbox
from factual_tools import claims, fenice, settings, textsplit
import newsworld
from newsworld import oracle
from helpers import DOC, load_config_file

# ---------------------------------------------------------------------------
# Numbers


@pytest.mark.parametrize("doc,summary,expected", [
    # percent spellings
    ("Sales rose 12% last year.", "Sales rose twelve percent.", 1.0),
    ("Sales rose 12% last year.", "Sales rose 12 percent.", 1.0),
    ("Sales rose 12 per cent.", "Sales rose 12%.", 1.0),
    ("Sales rose 12 percent.", "Sales rose 15%.", 0.0),
    # money: symbols, scale words, abbreviations, thousands separators
    ("Revenue was $4.2 billion.", "Revenue was 4,200,000,000 dollars.", 1.0),
    ("Revenue was $4.2 billion.", "Revenue was $4.2bn.", 1.0),
    ("Revenue was 4,200,000,000 dollars.", "Revenue was US$4.2 billion.", 1.0),
    ("Revenue was $300 million.", "Revenue was $0.3 billion.", 1.0),
    ("Revenue was $300 million.", "Revenue was $300,000.", 0.0),
    ("Revenue was $4.2 billion.", "Revenue was €4.2 billion.", 0.0),  # another currency
    ("Revenue was 4.2 billion.", "Revenue was $4.2 billion.", 1.0),  # the document may omit the unit
    ("It has $7 million.", "It has 7 million.", 1.0),  # and so may the summary
    # plain numbers
    ("It hired 1,000 people.", "It hired 1000 people.", 1.0),
    ("It hired 25 people.", "It hired twenty-five people.", 1.0),
    ("It sold 250 cars.", "It sold two hundred and fifty cars.", 1.0),
    ("Costs were 12% higher.", "It hired 12 people.", 1.0),  # a bare number may drop a unit
    ("It hired 12 people.", "Costs were 12% higher.", 0.0),  # but never invent one
    # rounding within the stated precision and the relative tolerance (5%)
    ("Revenue was $4.23 billion.", "Revenue was $4.2 billion.", 1.0),
    ("Revenue was $4.23 billion.", "Revenue was $4 billion.", 0.0),  # 5.4% off
    ("Growth was 12.4%.", "Growth was 12%.", 1.0),
    ("Growth was 3.5%.", "Growth was 4%.", 0.0),
    ("It has 3,412 staff.", "It has 3,400 staff.", 1.0),
    ("It has 3,412 staff.", "It has 3,000 staff.", 0.0),
    ("It has 96 stores.", "It has 100 stores.", 1.0),
    ("It has 96 stores.", "It has 99 stores.", 0.0),  # 99 claims precision it does not have
    # ordinals
    ("It was the 3rd quarter.", "It was the third quarter.", 1.0),
    ("It was the third quarter.", "It was the fourth quarter.", 0.0),
    ("It was the twenty-first year.", "It was the 21st year.", 1.0),
    # years and dates
    ("It happened on March 3, 2024.", "It happened on 3 March 2024.", 1.0),
    ("It happened on March 3, 2024.", "It happened on 2024-03-03.", 1.0),
    ("It happened on March 3, 2024.", "It happened in March 2024.", 1.0),
    ("It happened on March 3, 2024.", "It happened on March 5, 2024.", 0.5),  # the date fails, the year holds
    ("It happened on April 3, 2024.", "It happened on 3/4/2024.", 1.0),  # day-first reading of a slash date
    ("It was founded in 2017.", "It was founded in 2019.", 0.0),
    ("It boomed in the 1990s.", "It boomed in the 1990s.", 1.0),
    ("The meeting is at 5 p.m.", "The meeting is at 17:00.", 1.0),
    ("The meeting is at 5 p.m.", "The meeting is at 5 a.m.", 0.0),
    # nothing to check, and words that are not numbers
    ("Sales rose.", "Sales rose sharply.", 1.0),
    ("Sales rose.", "One of the stores closed for the first time.", 1.0),
    ("Sales rose.", "Prices may 5 times... no.", 0.0),  # "may" is no month, 5 is unsupported
])
def test_number_consistency(doc, summary, expected):
    assert R.rule_scores(doc, summary)["numbers"] == pytest.approx(expected)


def test_numbers_normalise_to_the_same_values():
    def values(text):
        return [(n.kind, n.value, n.currency) for n in claims.numbers(text)]
    assert values("12%") == values("12 percent") == values("twelve percent") == [("percent", 12.0, None)]
    assert values("$4.2 billion") == values("$4,200,000,000") == values("4.2bn dollars") == \
        [("money", 4.2e9, "USD")]
    assert values("3rd") == values("third") == [("ordinal", 3, None)]
    assert values("March 3, 2024") == values("3 March 2024") == values("2024-03-03") == \
        [("date", 303, None), ("year", 2024, None)]
    assert values("G7 summit") == values("one of them") == values("millions of people") == []


# ---------------------------------------------------------------------------
# Entities, length, profanity, tool format


@pytest.mark.parametrize("summary,expected", [
    ("Jane Doe said growth came from the U.S. market.", 1.0),  # a subset of "Jane K. Doe"
    ("John Roe said growth came from the market.", 0.0),
    ("Acme's revenue rose, and Dr. Smith disagreed.", 1.0),  # possessive, honorific
    ("Jane Smith disagreed.", 0.0),  # tokens from two different people
    ("Globex and Acme Corp. reported revenue in New York.", 1.0),
    ("Shares fell. Analysts were surprised.", 0.0),  # capitalised openers are not names: no name stated
    ("Quarterly revenue at Acme rose.", 1.0),  # an opener the document does not know is a word
    ("Acme and Initech merged.", 0.5),
])
def test_entity_overlap(summary, expected):
    assert R.rule_scores(DOC, summary)["entities"] == pytest.approx(expected)


def test_entities_found_by_the_heuristic():
    assert claims.entities(DOC) == [("acme", "corp"), ("jane", "k", "doe"), ("us",), ("smith",), ("new", "york"),
                               ("rival", "globex")]
    assert claims.entities("The Bank of America said so. Mr. Lee met Mayor Ruth Hale on Monday.") == [
        ("bank", "of", "america"), ("lee",), ("ruth", "hale")]


def test_spacy_ner_is_used_only_when_asked(monkeypatch):
    import sys
    import types

    class Ent:
        def __init__(self, text, label, start):
            self.text, self.label_, self.start_char, self.end_char = text, label, start, start + len(text)

    calls = []

    def load(name, disable=()):
        calls.append(name)
        return lambda text: types.SimpleNamespace(
            ents=[Ent("Initech", "ORG", text.find("Initech"))] if "Initech" in text else [])

    monkeypatch.setitem(sys.modules, "spacy", types.SimpleNamespace(load=load))
    monkeypatch.setattr(claims, "_spacy_pipelines", {})
    cfg = R.RewardConfig(rules=R.RuleConfig(ner="spacy", spacy_model="fake_model"))
    assert R.rule_scores(DOC, "Initech reported revenue.", cfg)["entities"] == 0.0
    assert calls == ["fake_model"]
    assert R.rule_scores(DOC, "Initech reported revenue.")["entities"] == 0.0  # heuristic: a weak opener, no name
    assert calls == ["fake_model"]


def test_spacy_missing_gives_an_install_hint(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "spacy", None)
    monkeypatch.setattr(claims, "_spacy_pipelines", {})
    with pytest.raises(ImportError, match="pip install spacy"):
        R.rule_scores(DOC, "Acme rose.", R.RewardConfig(rules=R.RuleConfig(ner="spacy")))


@pytest.mark.parametrize("n_words,expected", [
    (0, 0.0), (5, 1 - 10 / 15), (14, 1 - 1 / 15), (15, 1.0), (60, 1.0), (120, 1.0), (127, 1 - 7 / 15),
    (135, 0.0), (400, 0.0),
])
def test_length_has_soft_edges(n_words, expected):
    summary = " ".join(["word"] * n_words)
    assert R.rule_scores(DOC, summary)["length"] == pytest.approx(expected)


@pytest.mark.parametrize("summary,expected", [
    ("Acme had a fucking good year.", 0.0),
    ("Acme had a SHITTY year.", 0.0),  # case-insensitive
    ("Officials in Scunthorpe assess the class of cockpit shitake.", 1.0),  # whole words only
    ("Dick Cheney visited Acme.", 1.0),
    ("Acme had a good year.", 1.0),
])
def test_profanity(summary, expected):
    assert R.rule_scores(DOC, summary)["profanity"] == expected


def test_profanity_extra_words():
    cfg = R.RewardConfig(rules=R.RuleConfig(profanity_extra=["Darn"]))
    assert R.rule_scores(DOC, "Acme had a darn good year.", cfg)["profanity"] == 0.0
    assert R.rule_details(DOC, "Acme had a darn good year.", cfg)["profanity"].evidence == {"found": ["darn"]}


@pytest.mark.parametrize("text,expected", [
    ('Acme made $5 billion.<search>/revenue of/</search><delete scope="sentence"/> Acme made $4.2 billion.', 1.0),
    ('Acme made $4.2 billion.<search>revenue</search><search>/rev(/</search>', 1.0),  # a bad regex is well formed
    ('Acme made $5 billion.<delete scope="word"/>Acme made $4.2 billion.<search>revenue</search>', 0.5),
    ("Acme made money <results>x</results> ok.", 0.0),  # stray markup
    ("Acme made money.", 1.0),
])
def test_tool_format_from_the_episode(text, expected):
    ep = sandbox.replay(DOC, text)
    assert R.rule_scores(DOC, ep)["tool_format"] == expected


def test_tool_format_of_a_bare_summary_string():
    assert R.rule_scores(DOC, "Acme made money.")["tool_format"] == 1.0
    assert R.rule_scores(DOC, "Acme made <search>money</search>.")["tool_format"] == 0.0


def test_rule_evidence_names_what_failed():
    d = R.rule_details(DOC, "Acme reported revenue of $4.5 billion in 2023, said John Roe.")
    assert d["numbers"].evidence["unsupported"] == ["$4.5 billion", "2023"]
    assert d["entities"].evidence["unsupported"] == ["john roe"]
    assert d["length"].evidence["words"] == 11


# ---------------------------------------------------------------------------
# Totality: any input scores in [0, 1], never raises


GARBAGE = [
    "", " ", "\n\n\t", ".", "...", "\x00\x01\x02", "🙂" * 50, "שלום עולם. مرحبا بالعالم.", "\ud800 lone surrogate",
    "<search>", "</results><results>", '<delete scope="x"/>', "<p>html <b>markup</b></p>", "$$$ %%% ,,, 1,,,2",
    "1" * 5000, "9" * 400 + "%", "a" * 100_000, "Aa. " * 20_000, "March 99, 99999", "12/45/2024", "$.5bn",
    "one one one one", "twenty-first twenty-first", "\u200b\u200b", None, 42, b"bytes", ["a list"], 3.5,
]


@pytest.mark.parametrize("garbage", GARBAGE, ids=range(len(GARBAGE)))
def test_every_rule_and_score_is_total(garbage):
    for doc, summary in ((DOC, garbage), (garbage, "Acme reported revenue of $4.2 billion."), (garbage, garbage)):
        details = R.rule_details(doc, summary)
        assert set(details) == set(R.RULES)
        for name, r in details.items():
            assert 0.0 <= r.score <= 1.0, name
            assert "error" not in (r.evidence or {}), (name, r.evidence)
        assert 0.0 <= R.lexical_factuality(doc, summary) <= 1.0
        out = R.score(doc, summary)
        assert math.isfinite(out["total"]) and isinstance(out["pass"], bool)


def test_a_summary_without_words_scores_zero_everywhere():
    for empty in ("", "   ", "...", None):
        assert R.rule_scores(DOC, empty) == {k: 0.0 for k in R.RULES}
        assert R.lexical_factuality(DOC, empty) == 0.0


@hypothesis.settings(max_examples=150, deadline=None)
@given(doc=st.text(max_size=300), summary=st.text(max_size=300))
def test_rules_are_total_on_random_text(doc, summary):
    for r in R.rule_details(doc, summary).values():
        assert 0.0 <= r.score <= 1.0 and "error" not in (r.evidence or {})
    assert 0.0 <= R.lexical_factuality(doc, summary) <= 1.0


@hypothesis.settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(["12", "%", "$", "4.2", "billion", "bn", "March", "3", ",", "2024", "-", "/",
                                 "third", "twenty", "one", "hundred", "and", "percent", " ", ".", "p.m.", ":",
                                 "30", "US$", "1,000", "'s", "s", "th"]), max_size=30))
def test_number_parser_is_total_on_number_soup(parts):
    text = "".join(parts)
    for n in claims.numbers(text):
        assert n.kind in claims._SUPPORTERS and math.isfinite(n.value)
    assert 0.0 <= R.rule_scores(text, text)["numbers"] <= 1.0


# ---------------------------------------------------------------------------
# Lexical factuality


@pytest.mark.parametrize("summary,lo,hi", [
    ("Acme Corp. reported revenue of $4.2 billion, up 12 percent.", 0.99, 1.0),
    # two document sentences fused at a clause boundary: still supported
    ("Acme Corp. reported revenue of $4.2 billion on March 3, 2024, said chief executive Jane K. Doe.", 0.99, 1.0),
    ("Globex reported revenue of $4.2 billion.", 0.4, 0.6),  # intrinsic swap
    ("Acme Corp. reported revenue of $3.1 billion and Globex reported revenue of $4.2 billion.", 0.4, 0.6),
    ("Acme reported revenue of $9 billion.", 0.0, 0.3),  # extrinsic number
    ("Shares fell 3.5% in London.", 0.0, 0.3),  # extrinsic place
    ("Chief executive Jane K. Doe said the U.S. market did not drive growth.", 0.0, 0.6),  # negation
    ("It was so.", 0.0, 0.0),  # states nothing
])
def test_lexical_factuality(summary, lo, hi):
    assert lo <= R.lexical_factuality(DOC, summary) <= hi


LEXICAL = R.RewardConfig(factuality="lexical")  # the default is support


def test_the_default_scorer_is_support_the_one_that_holds_up_on_real_summaries():
    out = R.score(DOC, "Acme Corp. reported revenue of $4.2 billion.")
    assert R.RewardConfig().factuality == "support" and out["factuality_backend"] == R.SUPPORT_NAME


def test_lexical_is_the_mean_over_claims_and_names_itself():
    a, b = "Acme Corp. reported revenue of $4.2 billion.", "Acme reported revenue of $9 billion."
    fa, fb = R.lexical_factuality(DOC, a), R.lexical_factuality(DOC, b)
    assert R.lexical_factuality(DOC, a + " " + b) == pytest.approx((fa + fb) / 2)
    out = R.score(DOC, a, LEXICAL)
    assert out["factuality_backend"] == R.LEXICAL_NAME == "lexical (model-free approximation)"
    assert out["claims"][0]["premises"] == [textsplit.split_sentences(DOC)[0]]


def test_sentences_without_content_score_zero_and_count():
    # A tiny RL policy learnt "The. The. A. The) The." when such sentences were
    # left out of the mean: the few left scored 1.0.
    a = "Acme Corp. reported revenue of $4.2 billion."
    fa = R.lexical_factuality(DOC, a)
    assert fa > 0.9
    assert R.lexical_factuality(DOC, "The. The. A. The) The.") == 0.0
    assert R.lexical_factuality(DOC, a + " The. The.") == pytest.approx(fa / 3)
    assert claims.entities("A. The) The.") == []


def test_document_side_is_cached_by_content():
    claims.DOC_CACHE.clear()
    text = "Acme Corp. hired 12 people. " * 3
    info = R.document_info(text)
    assert R.document_info("".join(list(text))) is info  # an equal string, another object
    assert R.document_info(text + " ") is not info
    for i in range(claims.DOC_CACHE.maxsize + 5):  # bounded
        R.document_info(f"Document number {i}.")
    assert len(claims.DOC_CACHE) == claims.DOC_CACHE.maxsize


# ---------------------------------------------------------------------------
# FENICE: aggregation against a hand computation with a deterministic NLI


LONG_DOC = " ".join(f"Fact {w} is true." for w in "alpha beta gamma delta epsilon zeta eta".split())


def toy_nli(pairs):
    """Entailed when every claim word is in the premise; contradicted when the
    claim says "false"; else neutral. Probabilities are not one-hot, so the
    contrast matters."""
    out = []
    for premise, claim in pairs:
        pw, cw = set(textsplit.words(premise)), set(textsplit.words(claim))
        if "false" in cw:
            out.append([0.1, 0.2, 0.7])
        elif cw <= pw:
            out.append([0.8, 0.15, 0.05])
        else:
            share = len(cw & pw) / len(cw)
            out.append([0.3 * share, 0.6, 0.4 - 0.3 * share])
    return np.array(out)


def hand_fenice(document, claims, contrast):
    """The reference's aggregation written out: per claim the best of sentence,
    chunk and document premises, rescaled; then the mean."""
    sents = textsplit.split_sentences(document)
    chunks = [" ".join(sents[i:i + 5]) for i in range(len(sents) - 4)] if len(sents) >= 5 else [" ".join(sents)]
    premises = sents + (chunks + [document] if len(chunks) > 1 else [])
    per_claim = []
    for c in claims:
        best = -2.0
        for p in premises:
            e, n, k = toy_nli([(p, c)])[0]
            best = max(best, e - (n if contrast == "entail_minus_neutral" else k))
        per_claim.append((best + 1) / 2)
    return sum(per_claim) / len(per_claim)


@pytest.mark.parametrize("contrast", fenice.CONTRASTS)
def test_fenice_aggregation_matches_a_hand_computation(contrast):
    claims = {"S1": "Fact alpha is true. Fact beta is true.",  # entailed by sentences
              "S2": "Fact alpha and beta are true.",  # only a chunk holds both
              "S3": "Fact omega is true. Fact alpha is false."}
    calls = []
    f = R.Fenice(R.FeniceConfig(contrast=contrast), nli_fn=lambda pairs: (calls.append(len(pairs)), toy_nli(pairs))[1],
                 claim_fn=lambda summaries: [claims[s] for s in summaries])
    out = f.score_batch([(LONG_DOC, s) for s in claims])
    for (s, text), res in zip(claims.items(), out):
        expected = hand_fenice(LONG_DOC, textsplit.split_sentences(text), contrast)
        assert res["score"] == pytest.approx(expected, abs=1e-12), s
        assert [r["claim"] for r in res["claims"]] == textsplit.split_sentences(text)
    assert out[1]["claims"][0]["level"] == "chunk"
    assert out[0]["claims"][0]["level"] == "sentence"
    # the contrasts differ where a claim is contradicted: (0.1 - 0.2 + 1) / 2 or (0.1 - 0.7 + 1) / 2
    assert out[2]["claims"][1]["score"] == pytest.approx(0.45 if contrast == "entail_minus_neutral" else 0.2)


def test_fenice_short_documents_use_sentences_only_and_no_claims_is_zero():
    seen = []
    doc = "Fact alpha is true. Fact beta is true."
    f = R.Fenice(nli_fn=lambda pairs: (seen.extend(pairs), toy_nli(pairs))[1],
                 claim_fn=lambda summaries: ["" for _ in summaries])
    out = f.score_batch([(doc, "Fact alpha is true."), (doc, ""), (doc, "   ...")])
    assert {p for p, _ in seen} == set(textsplit.split_sentences(doc))  # no chunk, no document premise
    # an extractor that yields nothing: the summary's sentences are the claims
    assert out[0]["claims"][0]["claim"] == "Fact alpha is true." and out[0]["score"] == pytest.approx(0.825)
    assert out[1] == out[2] == {"score": 0.0, "claims": []}  # defined, never NaN


def test_fenice_group_shares_document_work_and_claims():
    nli_pairs, extracted = [], []
    f = R.Fenice(nli_fn=lambda pairs: (nli_pairs.extend(pairs), toy_nli(pairs))[1],
                 claim_fn=lambda summaries: (extracted.extend(summaries), list(summaries))[1])
    group = [f"Fact alpha is true. Fact {w} is true." for w in ["beta", "gamma", "beta", "delta"]] * 2
    out = f.score_batch([(LONG_DOC, s) for s in group])
    assert extracted == list(dict.fromkeys(group))  # each distinct summary extracted once
    n_premises = 7 + 3 + 1
    assert len(nli_pairs) == 4 * n_premises  # alpha, beta, gamma, delta: each claim aligned once
    assert out[0] == out[2] == out[4]
    nli_pairs.clear()
    again = f.score_batch([(LONG_DOC, "Fact gamma is true. Fact alpha is true.")])  # claims seen before
    assert nli_pairs == [] and again[0]["score"] == pytest.approx(0.825)
    assert f.stats["alignment_hits"] >= 2


def test_fenice_caches_are_bounded():
    f = R.Fenice(R.FeniceConfig(cache_documents=2, cache_claims=3), nli_fn=toy_nli,
                 claim_fn=lambda summaries: list(summaries))
    for i in range(6):
        f.score_batch([(f"Doc {i} says fact {i}. And more.", f"Fact {i} claim {j}.") for j in range(2)])
    assert len(f.docs) == 2 and len(f.claims) == 3


def test_fenice_coreference_premises():
    doc = "Jane Doe founded Acme. She said sales rose."
    clusters = [[(0, 8), (23, 26)]]  # "Jane Doe" ... "She"
    f = R.Fenice(R.FeniceConfig(use_coref=True), nli_fn=toy_nli, claim_fn=lambda s: list(s),
                 coref_fn=lambda text: clusters)
    out = f.score_batch([(doc, "Jane Doe said sales rose.")])
    assert out[0]["claims"][0]["level"] == "coref"
    assert out[0]["claims"][0]["premise"] == "Jane Doe said sales rose."
    assert out[0]["score"] == pytest.approx(0.825)
    off = R.Fenice(nli_fn=toy_nli, claim_fn=lambda s: list(s)).score_batch([(doc, "Jane Doe said sales rose.")])
    assert off[0]["score"] < 0.825  # off by default


def test_nli_labels_are_read_from_the_model_config():
    assert fenice._label_columns({0: "CONTRADICTION", 1: "ENTAILMENT", 2: "NEUTRAL"}) == [1, 2, 0]
    assert fenice._label_columns({"0": "entailment", "1": "neutral", "2": "contradiction"}) == [0, 1, 2]
    with pytest.raises(ValueError, match="entailment"):
        fenice._label_columns({0: "entailment", 1: "not_entailment"})


def test_contrast_is_validated():
    with pytest.raises(ValueError, match="contrast"):
        R.Fenice(R.FeniceConfig(contrast="entail_only"))


@pytest.fixture(scope="module")
def tiny_fenice(tmp_path_factory):
    return fenice.build_tiny_fenice(str(tmp_path_factory.mktemp("fenice")), texts=[DOC])


def test_fenice_end_to_end_with_tiny_random_models(tiny_fenice):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    f = R.Fenice(tiny_fenice)
    summaries = ["Acme reported revenue of $4.2 billion. Jane Doe said growth came from the U.S.",
                 "Globex made $3.1 billion.", ""]
    out = f.score_batch([(DOC, s) for s in summaries] + [("Short doc. Two sentences.", summaries[1])])
    assert len(out) == 4
    for r in out:
        assert 0.0 <= r["score"] <= 1.0 and math.isfinite(r["score"])
    assert out[2] == {"score": 0.0, "claims": []}
    assert all(r["claims"] for i, r in enumerate(out) if i != 2)
    assert f.stats["summaries_extracted"] == 2
    # a second call over the same rollouts: no model work at all
    pairs = f.stats["nli_pairs"]
    assert f.score_batch([(DOC, summaries[0])])[0] == out[0]
    assert f.stats["nli_pairs"] == pairs
    # the NLI columns follow config.id2label (CONTRADICTION, ENTAILMENT, NEUTRAL here)
    tok = AutoTokenizer.from_pretrained(tiny_fenice.nli_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_fenice.nli_model).eval()
    premise, claim = textsplit.split_sentences(DOC)[0], "Acme reported revenue."
    with torch.no_grad():
        probs = torch.softmax(model(**tok([premise], [claim], return_tensors="pt")).logits, -1)[0].numpy()
    got = f.nli([(premise, claim)], 256, 8)[0]
    assert got == pytest.approx([probs[1], probs[2], probs[0]], abs=1e-5)


def test_fenice_with_a_bert_classifier_truncates_to_its_positions(tmp_path):
    cfg = fenice.build_tiny_fenice(str(tmp_path), nli_arch="bert", id2label={0: "entailment", 1: "neutral",
                                                                        2: "contradiction"})
    long_doc = " ".join([DOC] * 12)  # far past BERT's 128 positions in the whole-document premise
    out = R.Fenice(cfg).score_batch([(long_doc, "Acme reported revenue.")])
    assert 0.0 <= out[0]["score"] <= 1.0


def test_fenice_backend_in_the_combined_reward(tiny_fenice):
    cfg = R.RewardConfig(factuality="fenice", fenice=tiny_fenice)
    out = R.Scorer(cfg).score_batch([(DOC, "Acme reported revenue of $4.2 billion.")] * 2)
    assert out[0]["factuality_backend"] == "fenice"
    assert out[0]["factuality"] == out[1]["factuality"]
    assert R.fenice_for(tiny_fenice) is R.fenice_for(dataclasses.replace(tiny_fenice))  # loaded once


# ---------------------------------------------------------------------------
# Tool terms and ToolMatch


def call(kind, arg, deleted=None, hits=None, valid=True):
    return sandbox.Call(kind, 0, 0, arg, valid, None, deleted, hits)


def episode(*calls, flags=None, doc_id=None):
    turns = [sandbox.Turn("x", c, ended="call") for c in calls] + [sandbox.Turn("Acme made money.")]
    return sandbox.Episode(DOC, turns, summary="Acme made money.", flags=flags or {}, doc_id=doc_id)


TEACHER = episode(call("search", "/revenue of/", hits=[0, 5]),
                  call("delete", "sentence", deleted="Acme reported revenue of $5 billion."))


WRONG = 0.5 + 0.5 * 0.75  # a delete of "... $5 billion." (lexical 0.25 below support): 1 - 0.25 unsupported


@pytest.mark.parametrize("policy,score,steps", [
    (TEACHER, (1.0 + WRONG) / 2, [1.0, WRONG]),
    # different words, same sentences found: the hits agree
    (episode(call("search", "acme quarterly figures", hits=[5, 0]),
             call("delete", "sentence", deleted="Acme reported revenue of $5 billion.")), (1.0 + WRONG) / 2, [1.0, WRONG]),
    # query words half shared (revenue, of / revenue, of, acme, 2024), no hits
    (episode(call("search", "acme revenue of 2024"),
             call("delete", "clause", deleted="Acme reported revenue of $5 billion.")), (0.75 + WRONG) / 2, [0.75, WRONG]),
    # an extra search first: aligned around it, not shifted
    (episode(call("search", "unrelated words"), call("search", "/revenue of/", hits=[0, 5]),
             call("delete", "sentence", deleted="Acme reported revenue of $5 billion.")), (1 + WRONG) / 3,
     [0.0, 1.0, WRONG]),
    # deleted another unsupported sentence: as good as deleting the teacher's (it was wrong too)
    (episode(call("search", "/revenue of/", hits=[0, 5]), call("delete", "sentence", deleted="Shares fell 5.")),
     (1 + WRONG) / 2, [1.0, WRONG]),
    # deleted a supported sentence: the tool only
    (episode(call("search", "/revenue of/", hits=[0, 5]),
             call("delete", "sentence", deleted="Acme Corp. reported revenue of $4.2 billion.")), 0.75, [1.0, 0.5]),
    (episode(call("delete", "sentence", deleted="Acme Corp. reported revenue of $4.2 billion."),
             call("search", "/revenue of/")), 0.5, [0.0, 1.0]),
    (episode(), 0.0, []),
    (episode(call("search", "/revenue of/", hits=[0, 5], valid=False)), 0.0, [0.0]),
])
def test_tool_match(policy, score, steps):
    got, per_step = R.tool_match(policy, TEACHER)
    assert got == pytest.approx(score)
    assert per_step == pytest.approx(steps)


def test_a_delete_is_graded_by_what_it_retracted_not_by_copying_the_teacher():
    """The teacher retracted its own wrong sentence. Writing that same wrong sentence and
    retracting it must not beat retracting a different unsupported one, and retracting a
    supported sentence earns only the tool's share."""
    teacher = call("delete", "sentence", deleted="Acme reported revenue of $5 billion.")
    copy = call("delete", "sentence", deleted="Acme reported revenue of $5 billion.")
    other = call("delete", "sentence", deleted="Globex hired 9,000 pilots in Peru.")
    right = call("delete", "sentence", deleted="Acme Corp. reported revenue of $4.2 billion.")
    a = {k: R.call_agreement(c, teacher, document=DOC) for k, c in (("copy", copy), ("other", other),
                                                                      ("right", right))}
    assert a["other"] >= a["copy"] > a["right"] == 0.5
    assert R.call_agreement(copy, teacher) == 1.0  # without a document: the old word overlap


def test_tool_match_without_any_calls_is_agreement():
    assert R.tool_match(episode(), episode()) == (1.0, [])
    assert R.tool_match(TEACHER, episode()) == (0.0, [0.0, 0.0])


def test_tool_match_regex_queries_compare_their_words():
    a, b = call("search", r"/revenue of \$\d+ billion/i"), call("search", "revenue billion of")
    assert R.call_agreement(a, b) == pytest.approx(1.0)


def test_budget_and_cap_penalties():
    cfg = R.ToolTermsConfig()
    assert R.tool_terms(TEACHER, cfg) == pytest.approx((0.1, 0.0))
    capped = sandbox.replay(DOC, "A. " + '<delete scope="sentence"/>B. ' * 7)
    assert capped.flags.get("delete_cap")
    budget, cap = R.tool_terms(capped, cfg)
    assert budget == pytest.approx(0.05 * capped.n_delete) and cap == 0.5
    assert R.tool_terms(episode(flags={"tool_cap": True}), R.ToolTermsConfig(tool_cap_penalty=0.3))[1] == 0.3
    assert R.tool_terms("a bare summary", cfg) == (0.0, 0.0)


def _retraction(doc, retracted: str, kept: str) -> sandbox.Episode:
    return sandbox.replay(doc.text, retracted + '<delete scope="sentence"/>' + kept)


@pytest.mark.parametrize("backend", ["oracle", "lexical", "support"])
def test_a_delete_of_a_right_sentence_costs_the_right_delete_penalty_and_of_a_wrong_one_nothing(backend):
    doc = next(iter(newsworld.documents(1, seed=0)))
    right = textsplit.split_sentences(doc.summary)[0]
    fact = oracle.stated_facts(doc, right)[0]
    wrong = right.replace(fact["text"], "Zorblax Industries" if fact["kind"] == "name" else "987654")
    assert oracle.oracle_errors(doc, wrong) and not oracle.oracle_errors(doc, right)
    cfg = R.RewardConfig(factuality=backend)
    cfg.tools.right_delete_penalty = 0.3
    bare, fixed, ritual = R.Scorer(cfg).score_batch([(doc, right), (doc, _retraction(doc, wrong, right)),
                                        (doc, _retraction(doc, right, right))])
    assert (bare["right_deletes"], fixed["right_deletes"], ritual["right_deletes"]) == (0, 0, 1)
    budget = cfg.tools.budget_per_call
    assert fixed["total"] == pytest.approx(bare["total"] - budget)  # the same summary, one call
    assert ritual["total"] == pytest.approx(bare["total"] - budget - 0.3)
    # off (the default): counted for the log, never charged
    off = R.Scorer(R.RewardConfig(factuality=backend)).score_batch([(doc, _retraction(doc, right, right))])[0]
    assert off["right_deletes"] == 1 and off["total"] == pytest.approx(bare["total"] - budget)


def test_the_right_delete_penalty_only_ever_lowers_a_reward():
    # a bonus for deleting wrong text would pay for writing it first: the term is a penalty only
    doc = next(iter(newsworld.documents(1, seed=0)))
    sents = textsplit.split_sentences(doc.summary)
    rng = random.Random(0)
    texts = []
    for _ in range(30):
        parts = [rng.choice(sents + ["Zorblax Industries lost 987654 games.", "It was a day."])
                 + rng.choice(["", '<delete scope="sentence"/>', "<search>/day/</search>"]) for _ in range(4)]
        texts.append(" ".join(parts))
    on, off = R.RewardConfig(factuality="oracle"), R.RewardConfig(factuality="oracle")
    on.tools.right_delete_penalty = 0.5
    eps = [sandbox.replay(doc.text, t) for t in texts]
    for a, b in zip(R.Scorer(on).score_batch([(doc, e) for e in eps]), R.Scorer(off).score_batch([(doc, e) for e in eps])):
        assert a["total"] == pytest.approx(b["total"] - 0.5 * a["right_deletes"])
    assert any(r["right_deletes"] for r in R.Scorer(on).score_batch([(doc, e) for e in eps]))


# ---------------------------------------------------------------------------
# Curriculum


def test_curriculum_raises_tau_once_the_window_pass_rate_exceeds_the_threshold():
    c = R.Curriculum(R.CurriculumConfig(taus=[0.5, 0.65], raise_pass_rate=0.2, window_samples=10))
    assert c.tau == 0.5 and c.pass_rate is None
    assert not c.update([False] * 8 + [True] * 2)  # 20% is not above 20%
    assert c.tau == 0.5 and c.pass_rate == pytest.approx(0.2)
    assert c.update([True])  # the window slides past a failure: 3 of the last 10
    assert c.tau == 0.65 and c.pass_rate is None  # measured afresh under the new tau
    assert c.raises == [{"seen": 11, "pass_rate": 0.3, "from": 0.5, "to": 0.65}]
    assert not c.update([True] * 50)  # the last stage stays
    assert c.tau == 0.65


def test_curriculum_raises_at_the_first_full_window_above_threshold():
    c = R.Curriculum(R.CurriculumConfig(window_samples=10))
    assert not c.update([True] * 5)  # 100%, but the window is not full yet
    assert c.update([False] * 5)  # 50% > 20% as soon as the window is full
    assert c.tau == 0.65


def test_curriculum_accepts_pass_rates_and_round_trips_its_state():
    c = R.Curriculum(R.CurriculumConfig(taus=[0.5, 0.6, 0.7], window_samples=8))
    c.update(0.1, n=4)
    c.update(np.array([True, False, False]))
    state = json.loads(json.dumps(c.state_dict()))  # checkpoint-safe
    d = R.Curriculum(R.CurriculumConfig(taus=[0.5, 0.6, 0.7], window_samples=8))
    d.load_state_dict(state)
    assert (d.tau, d.pass_rate, d.seen) == (c.tau, c.pass_rate, c.seen) == (0.5, pytest.approx(1.4 / 7), 7)
    assert d.update([True]) == c.update([True]) is True  # both raise at the same rollout
    assert d.state_dict() == c.state_dict()
    with pytest.raises(ValueError, match="taus"):
        R.Curriculum(R.CurriculumConfig(taus=[0.4, 0.9])).load_state_dict(state)
    e = R.Curriculum(R.CurriculumConfig(window_samples=4, raise_pass_rate=0.9))
    e.update(np.bool_(True), n=2)
    e.update(np.float32(0.5), n=2)
    assert e.pass_rate == pytest.approx(0.75) and e.seen == 4


def test_scorer_state_holds_the_curriculum():
    s = R.Scorer(R.RewardConfig(curriculum=R.CurriculumConfig(window_samples=4)))
    s.curriculum.update([True] * 4)
    t = R.Scorer(R.RewardConfig(curriculum=R.CurriculumConfig(window_samples=4)))
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert t.curriculum.tau == 0.65
    assert t.score_batch([(DOC, "Acme made money.")])[0]["tau"] == 0.65


# ---------------------------------------------------------------------------
# The combined reward and the batch API

KEYS = ["total", "pass", "tau", "gate", "factuality", "factuality_backend", "precision", "coverage", "factuality_pass",
        "rules", "rules_pass",
        *[f"rule_{k}{p}" for k in R.RULES for p in ("", "_pass")], "budget", "cap_penalty", "right_deletes",
        "tool_match", "tool_match_steps", "n_search", "n_delete", "n_words", "claims", "evidence"]


def test_score_has_every_component_and_the_documented_total():
    ep = sandbox.replay(DOC, 'Acme reported revenue of $5 billion.<search>/revenue of/</search>'
                             '<delete scope="sentence"/> Acme Corp. reported revenue of $4.2 billion on March 3, '
                             '2024, up 12% from a year earlier, said chief executive Jane K. Doe.')
    ep.doc_id = "doc-1"
    cfg = R.RewardConfig(tools=R.ToolTermsConfig(w_match=0.2))
    out = R.Scorer(cfg).score_batch([(DOC, ep)], teacher={"doc-1": TEACHER})[0]
    assert list(out) == KEYS
    rules = R.rule_scores(DOC, ep)
    assert out["rules"] == pytest.approx(sum(rules.values()) / len(R.RULES))
    assert out["factuality"] == out["precision"] == pytest.approx(R.lexical_factuality(DOC, ep))
    assert out["coverage"] is None  # reward.coverage is off
    assert (out["n_search"], out["n_delete"], out["budget"], out["cap_penalty"]) == (1, 1, pytest.approx(0.1), 0.0)
    match, steps = R.tool_match(ep, TEACHER)
    assert out["tool_match"] == match and out["tool_match_steps"] == steps and match > 0
    assert out["gate"] == pytest.approx(rules["length"] * rules["repetition"]) and out["gate"] == 1.0
    assert out["total"] == pytest.approx(0.7 * out["factuality"] + 0.3 * out["rules"] + 0.2 * out["pass"] - 0.1
                                         + 0.2 * match)
    assert out["pass"] == (out["factuality"] >= 0.5 and out["rules_pass"])
    json.dumps(out)  # logs can write it as is


def test_pass_needs_factuality_at_tau_and_every_rule():
    good = "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier."
    assert R.score(DOC, good)["pass"]
    assert not R.score(DOC, good.replace("$4.2 billion", "$9 billion"))["pass"]  # numbers rule and F
    short = "Acme Corp. reported revenue."
    out = R.score(DOC, short)
    assert out["factuality_pass"] and not out["rule_length_pass"] and not out["pass"]
    strict = R.RewardConfig(curriculum=R.CurriculumConfig(taus=[1.01]))
    assert not R.score(DOC, good, strict)["pass"]


def test_the_gate_scales_the_content_terms_by_length_and_repetition():
    short = "Acme Corp. reported revenue."
    gated = R.score(DOC, short)
    plain = R.score(DOC, short, R.RewardConfig(gate=False))
    assert 0 < gated["rule_length"] < 1 and gated["gate"] == pytest.approx(gated["rule_length"]) and plain["gate"] == 1
    assert gated["total"] == pytest.approx(gated["rule_length"] * plain["total"])
    good = "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier."
    assert R.score(DOC, good)["total"] == pytest.approx(R.score(DOC, good, R.RewardConfig(gate=False))["total"])
    # tool terms stay outside the gate: a summary that says nothing still pays for its calls
    junk = sandbox.replay(DOC, "The. The.<search>/Acme/</search>")
    assert R.score(DOC, junk)["total"] == pytest.approx(-0.05)


def test_the_pass_bonus_carries_tau_into_the_optimised_reward():
    good = "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier."
    lo = R.RewardConfig(curriculum=R.CurriculumConfig(taus=[0.5]))
    hi = R.RewardConfig(curriculum=R.CurriculumConfig(taus=[1.01]))
    a, b = R.score(DOC, good, lo), R.score(DOC, good, hi)
    assert a["pass"] and not b["pass"] and a["total"] - b["total"] == pytest.approx(0.2)
    assert R.score(DOC, good, dataclasses.replace(lo, w_pass=0.0))["total"] == pytest.approx(b["total"])


@pytest.mark.parametrize("doc,summary,rule,expected", [
    (DOC, "Shares fell in early trading after the results.", "numbers", 0.0),  # the document has numbers
    (DOC, "Shares fell in early trading after the results.", "entities", 0.0),  # and names
    ("shares fell in early trading.", "Shares fell in early trading.", "numbers", 1.0),  # nothing to state
    ("shares fell in early trading.", "Shares fell in early trading.", "entities", 1.0),
    (DOC, "Acme Corp. reported revenue of $4.2 billion. Acme Corp. said growth came from the U.S.", "repetition",
     1.0),  # a name said twice is not repetition
    # a repeated sentence: 4 of 6 trigrams distinct ((4/6 - 0.5) / 0.4), times 1 of 2 sentences distinct
    (DOC, "Acme Corp. reported revenue. Acme Corp. reported revenue.", "repetition", pytest.approx(5 / 12 / 2)),
    (DOC, "Acme fell. Globex rose. Acme fell.", "repetition", pytest.approx(2 / 3)),  # trigrams span sentences
    (DOC, "on " * 30, "repetition", 0.0),
])
def test_rules_that_a_summary_cannot_pass_by_saying_nothing(doc, summary, rule, expected):
    assert R.rule_scores(doc, summary)[rule] == expected


def test_the_repetition_rule_catches_sentence_and_clause_loops():
    r = lambda text: R.rule_scores(DOC, text)["repetition"]  # noqa: E731
    assert r(AUDIT["faithful"]) == 1.0
    assert r(AUDIT["looped sentence"]) < 0.2  # 2 of 6 sentences distinct, and their trigrams repeat
    assert r(AUDIT["looped clause"]) < 0.2  # one sentence, its trigrams mostly repeats
    assert r("Acme rose 5%. Acme rose 5%. Globex fell.") < r("Acme rose 5%. Globex fell.") == 1.0


# The audit table (measured with the old default config: a vague 24-word text scored
# 0.942 and passed, above a faithful summary's 0.864): every config's reward must rank a
# faithful summary above each way of saying nothing.
AUDIT = {
    "faithful": "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier. "
                "Chief executive Jane K. Doe said the U.S. market drove growth.",
    "vague": "The company reported its results for the period and said that demand for its products was strong, "
             "and its shares moved in trading on the news.",
    "one-liner": "Acme Corp reported revenue.",
    "empty": "",
    "repeated entity": "Acme Corp. " * 8,
    "no content": "The. The. A. The.",
    "one word looped": "on " * 60,
    "repeated claim": "Acme Corp. reported revenue of $4.2 billion. " * 3,
    # the zero-shot real model's habit: a faithful start, then the same sentence until the token limit
    "looped sentence": "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier. "
                       + "Chief executive Jane K. Doe said the U.S. market drove growth. " * 5,
    # and a clause repeated inside one sentence
    "looped clause": "Acme Corp. reported revenue of $4.2 billion on March 3, 2024" + ", up 12% from a year earlier" * 6
                     + ".",
}


CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def _configs_with_a_reward():
    import glob

    return [None] + [p for p in sorted(glob.glob(os.path.join(CONFIGS, "*.yaml")))
                     if hasattr(load_config_file(p), "reward")]


@pytest.mark.parametrize("path", _configs_with_a_reward(), ids=lambda p: os.path.basename(p) if p else "default")
def test_audit_table_faithful_outscores_every_way_of_saying_nothing(path):
    cfg = R.RewardConfig() if path is None else load_config_file(path).reward
    # fenice and the oracle need models or fact tables; the rules and the gate are what is audited
    cfg = dataclasses.replace(cfg, factuality="lexical", coverage=False)  # coverage: the long task's audit
    scores = {k: R.score(DOC, v, cfg)["total"] for k, v in AUDIT.items()}
    print(path, {k: round(v, 3) for k, v in scores.items()})
    for k, v in scores.items():
        if k != "faithful":
            assert scores["faithful"] > v + 0.2, (k, scores)
    assert scores["faithful"] > 0.8
    for k in ("empty", "repeated entity", "no content", "one word looped"):
        assert scores[k] == 0.0, (k, scores)


def test_delete_cap_lowers_the_reward():
    capped = sandbox.replay(DOC, "Acme Corp. reported revenue. " + '<delete scope="sentence"/>Acme. ' * 7)
    plain = sandbox.replay(DOC, "Acme Corp. reported revenue.")
    a, b = R.score(DOC, capped), R.score(DOC, plain)
    assert a["cap_penalty"] == 0.5 and a["total"] < b["total"] - 0.5


def test_score_batch_takes_documents_as_text_or_records():
    doc = next(iter(newsworld.documents(1, seed=0)))
    items = [(doc, doc.summary), (doc.text, doc.summary)]
    a, b = R.Scorer().score_batch(items)
    assert {k: v for k, v in a.items()} == b
    assert a == R.score(doc, doc.summary)


def test_oracle_backend_uses_the_fact_table():
    doc = next(iter(newsworld.documents(1, seed=0)))
    cfg = R.RewardConfig(factuality="oracle")
    out = R.score(doc, doc.summary, cfg)
    assert out["factuality"] == oracle.oracle_fact_score(doc, doc.summary) == 1.0
    assert out["factuality_backend"].startswith("oracle")
    with pytest.raises(ValueError, match="data.Document"):
        R.score(doc.text, doc.summary, cfg)


def test_oracle_unit_fact_scores_the_share_of_stated_facts_supported():
    doc = next(iter(newsworld.documents(1, seed=0)))
    first = textsplit.split_sentences(doc.summary)[0]
    facts = oracle.stated_facts(doc, first)
    assert facts and all(f["supported"] for f in facts)
    # One stated fact made up: the sentence unit gives the whole sentence 0, the fact unit
    # keeps credit for the facts that are still right.
    wrong = first.replace(facts[0]["text"], "Zorblax Industries" if facts[0]["kind"] == "name" else "987654")
    n = len(oracle.stated_facts(doc, wrong))
    by_fact = R.score(doc, wrong, R.RewardConfig(factuality="oracle", oracle_unit="fact"))["factuality"]
    by_sentence = R.score(doc, wrong, R.RewardConfig(factuality="oracle"))["factuality"]
    assert by_sentence == 0.0 and by_fact == pytest.approx(oracle.oracle_fact_precision(doc, wrong))
    assert by_fact == pytest.approx(sum(f["supported"] for f in oracle.stated_facts(doc, wrong)) / n) and 0 < by_fact < 1
    assert oracle.oracle_fact_precision(doc, "The weather was mild.") == 0.0  # states nothing checkable


def test_reward_config_loads_as_a_group_of_a_script_config():
    @dataclasses.dataclass
    class RLConfig:
        name: str = "run"
        reward: R.RewardConfig = dataclasses.field(default_factory=R.RewardConfig)

    cfg = settings.load_config(RLConfig, ["reward.factuality=fenice", "reward.tools.budget_per_call=0.1",
                                        "reward.rules.pass_at={numbers: 0.5}", "reward.curriculum.taus=[0.4, 0.6]"])
    assert cfg.reward.factuality == "fenice" and cfg.reward.tools.budget_per_call == 0.1
    assert cfg.reward.rules.pass_at["numbers"] == 0.5 and cfg.reward.rules.pass_at["length"] == 0.5
    assert cfg.reward.curriculum.taus == [0.4, 0.6]
    with pytest.raises(settings.ConfigError, match="did you mean 'reward.tools.w_match'"):
        settings.load_config(RLConfig, ["reward.tools.w_mach=1"])
    with pytest.raises(ValueError, match="did you mean 'numbers'"):
        settings.load_config(RLConfig, ["reward.rules.pass_at={number: 0.5}"])


# ---------------------------------------------------------------------------
# News world: the oracle's verdict and the lexical scorer's agree on drafts

CLAIM_FAIL = 0.75  # a summary sentence scoring below this is flagged by the lexical scorer


def agreement(n_docs=100, drafts_per_doc=4, seed=0):
    rng = random.Random(seed)
    summaries, sentences = [], []
    for doc in newsworld.documents(n_docs, seed=seed):
        for _ in range(drafts_per_doc):
            text, _ = oracle.draft(doc, rng)
            bad = {e["sentence_index"] for e in oracle.oracle_errors(doc, text)}
            claims = R.score(doc, text, LEXICAL)["claims"]
            flagged = {i for i, c in enumerate(claims) if c["score"] < CLAIM_FAIL}
            summaries.append((bool(bad), bool(flagged)))
            sentences += [(i in bad, i in flagged) for i in range(len(claims))]
    rate = lambda rows: sum(a == b for a, b in rows) / len(rows)  # noqa: E731
    return rate(summaries), rate(sentences), len(summaries)


def test_lexical_agrees_with_the_oracle_on_drafter_errors():
    per_summary, per_sentence, n = agreement()
    print(f"oracle/lexical agreement on {n} drafts: {per_summary:.3f} per summary, {per_sentence:.3f} per sentence")
    assert per_summary >= 0.8 and per_sentence >= 0.8


# The long task's audit (configs/rl_news.yaml): on news-length articles a faithful fused
# summary must outscore every way of copying or saying little, under every config whose
# reward counts key-fact coverage, and only it passes.
def _coverage_configs():
    """Configs whose F counts coverage. Phase A (rl_news_a.yaml) is left out: the roadmap's
    rules-only baseline pays a copied lead as much as a faithful summary, which is what M1 measures."""
    rewards = {p: load_config_file(p).reward for p in _configs_with_a_reward() if p}
    return [p for p, r in rewards.items() if r.coverage and r.w_factuality > 0]


def _long_audit(doc):
    lead = textsplit.split_sentences(doc.text)[0]
    return {
        "lead sentence": lead,
        "lead repeated": f"{lead} {lead}",
        # the ritual the short world paid for: copy, search it, delete it, write it again
        "copy, search, rewrite": sandbox.replay(doc.text, f'{lead}<search>{lead}</search><delete scope="sentence"/>'
                                                          f"{lead}"),
        "lead-3": textsplit.lead(doc.text, 3),
        "best whole sentences": oracle.best_extract(doc, 45),
        "vague": "The company announced an important development that drew a mixed reaction from observers, "
                 "and more details about what it means are expected to be published in the coming weeks.",
    }


def test_the_long_task_has_configs_with_coverage():
    assert any(p.endswith("rl_news.yaml") for p in _coverage_configs())


@pytest.mark.parametrize("path", _coverage_configs(), ids=os.path.basename)
def test_long_task_audit_faithful_fused_summary_beats_every_copy(path):
    cfg = load_config_file(path).reward
    docs = list(newsworld.documents(40, 0, task="long"))
    passes, margins = Counter(), collections.defaultdict(list)
    for doc in docs:
        faithful = R.score(doc, doc.summary, cfg)
        assert faithful["coverage"] == 1.0 and faithful["factuality"] == 1.0, faithful
        passes["faithful"] += faithful["pass"]
        for k, text in _long_audit(doc).items():
            got = R.score(doc, text, cfg)
            assert faithful["total"] > got["total"], (doc.id, k, got["total"], faithful["total"])
            margins[k].append(faithful["total"] - got["total"])
            passes[k] += got["pass"]
    # the heuristic name and number rules fail a few references (a name run on: "Freya Torres of University of Marlow")
    assert passes.pop("faithful") / len(docs) >= 0.9
    # a copy passes on few documents: M2 (a combined pass of 60%) stays out of reach
    assert all(n / len(docs) < 0.2 for n in passes.values()), passes
    assert passes["lead repeated"] == passes["copy, search, rewrite"] == passes["vague"] == 0, passes
    assert all(sum(m) / len(m) > 0.25 for m in margins.values()), {k: sum(m) / len(m) for k, m in margins.items()}


def test_coverage_scales_factuality_and_needs_fact_tables():
    doc = next(newsworld.documents(1, 0, task="long"))
    cfg = R.RewardConfig(factuality="oracle", oracle_unit="fact", coverage=True)
    lead = textsplit.split_sentences(doc.text)[0]
    got = R.score(doc, lead, cfg)
    assert got["precision"] == 1.0 and 0 < got["coverage"] < 1
    assert got["factuality"] == pytest.approx(got["precision"] * got["coverage"])
    assert R.factuality_batch([(doc, lead)], cfg) == [pytest.approx(got["factuality"])]
    plain = R.score(doc, lead, dataclasses.replace(cfg, coverage=False))
    assert plain["factuality"] == 1.0 and plain["coverage"] is None
    with pytest.raises(ValueError, match="reward.coverage needs news world documents"):
        R.score(doc.text, lead, dataclasses.replace(cfg, factuality="lexical"))


# What each long-task config may change in the reward that every phase shares (rl_news.yaml's).
# A and B start from the instruct model (about 147 words): their training length rule reaches
# that far, or every reward of theirs is zero (docs/long_task.md, phases A, B and E).
_PHASE_REWARD_CHANGES = {"rl_news_a.yaml": {"w_factuality", "w_rules", "rules"},  # phase A: the rules alone
                         "rl_news_b.yaml": {"rules"},
                         "ablation_news_no_budget.yaml": {"tools"}}


def test_phases_a_and_b_grade_the_instruct_models_length_and_change_nothing_else_of_the_rules():
    """A summary of the zero-shot length (about 147 words) scores 0 under D's reward and
    above 0 under A's and B's, so their groups have a reward to compare; only the soft edge
    differs, so the budget a pass needs stays D's (and evaluation, eval_news.yaml, is D's)."""
    d = load_config_file(os.path.join(CONFIGS, "rl_news.yaml")).reward
    doc = next(newsworld.documents(1, 0, task="long"))
    long = " ".join(doc.text.split()[:147])
    assert R.score(doc, long, d)["total"] == 0.0
    for name in ("rl_news_a.yaml", "rl_news_b.yaml"):
        own = load_config_file(os.path.join(CONFIGS, name)).reward
        changed = {k for k, v in dataclasses.asdict(own.rules).items() if dataclasses.asdict(d.rules)[k] != v}
        assert changed == {"soft_words"}, (name, changed)
        got = R.score(doc, long, own)
        assert got["total"] > 0.0 and not got["pass"], (name, got["total"])
        assert R.score(doc, doc.summary, own)["total"] > got["total"], name


@pytest.mark.parametrize("path", [p for p in _configs_with_a_reward() if p and "news" in os.path.basename(p)
                                  and os.path.basename(p).startswith(("rl_", "ablation_", "eval_"))],
                         ids=os.path.basename)
def test_every_long_task_phase_shares_one_reward(path):
    shared = dataclasses.asdict(load_config_file(os.path.join(os.path.dirname(path), "rl_news.yaml")).reward)
    own = dataclasses.asdict(load_config_file(path).reward)
    changed = {k for k in shared if shared[k] != own[k]}
    assert changed == _PHASE_REWARD_CHANGES.get(os.path.basename(path), set()), changed


def test_a_registered_factuality_backend_needs_no_edit_of_the_library(monkeypatch):
    """A fork adds its own scorer under a new key; configs accept it and the reward uses it."""
    monkeypatch.setattr(R, "FACTUALITY_BACKENDS", dict(R.FACTUALITY_BACKENDS))
    monkeypatch.setattr(R, "BACKEND_NAMES", dict(R.BACKEND_NAMES))
    R.register_factuality("half", "always one half", lambda scorer, docs, summaries, infos, cfg: [
        (0.5, None) for _ in summaries])
    cfg = R.RewardConfig(factuality="half")
    (row,) = R.Scorer(cfg).score_batch([("Acme grew 5% in 2020.", "Acme grew 5% in 2020.")])
    assert row["factuality"] == 0.5 and row["factuality_backend"] == "always one half"
    with pytest.raises(ValueError, match=r"reward.factuality='suport'.*fenice, half, learned, lexical, oracle, "
                                         r"support.*register_factuality"):
        R.RewardConfig(factuality="suport")
