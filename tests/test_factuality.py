"""The model-free support scorer, the learned scorer (factcheck.py) and the
human-label benchmark (bench/factuality.py) with its FRANK converter."""
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import rewards as R
from factual_tools import factcheck as FC, textsplit
import newsworld
from newsworld import oracle

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT / "bench"))  # appended: bench/rewards.py must not shadow rewards
import factuality_data as FD  # noqa: E402

DOC = ("Granite Group reported revenue of $4.2 billion on Tuesday. Chief executive Jane Doe said the "
       "company would open two factories in Ohio. The shares rose 12% in New York trading. "
       "Analysts had expected weaker sales after a poor winter.")


def bench():
    """bench/factuality.py as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_factuality", ROOT / "bench" / "factuality.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --- the support scorer -------------------------------------------------------------


def test_support_is_one_for_words_the_document_holds_and_ignores_case():
    s = "Granite Group reported revenue of $4.2 billion. Jane Doe said it would open two factories in Ohio."
    assert R.support_factuality(DOC, s) == 1.0
    assert R.support_factuality(DOC, s.lower()) == 1.0


def test_support_drops_for_a_word_the_document_lacks_and_names_it():
    f, details = R.support_details(DOC, "Granite Group reported revenue of $4.2 billion in Texas.")
    assert f < 1.0
    assert details[0]["unsupported"] == ["texas"]
    assert details[0]["words"] == pytest.approx(6 / 7)  # granite group report revenue 4.2 billion | texas


def test_support_joins_inflections_and_irregular_verbs():
    assert R.support_factuality(DOC, "Jane Doe says the company opens factories.") == 1.0


def test_support_pairs_catch_words_bound_across_distant_sentences():
    # every word is in the document, but "analysts" and "factories" are three sentences apart
    near = R.support_details(DOC, "Jane Doe said the company would open factories.")[1][0]
    far = R.support_details(DOC, "Analysts expected factories.")[1][0]
    assert near["pairs"] == 1.0 and far["words"] == 1.0
    assert far["pairs"] < 1.0 and far["score"] < 1.0
    wide = R.support_details(DOC, "Analysts expected factories.", R.SupportConfig(window=3))[1][0]
    assert wide["pairs"] == 1.0


def test_support_takes_the_worst_sentence_or_the_mean():
    s = "Granite Group reported revenue. Pirates stole the Moon."
    assert R.support_factuality(DOC, s) == 0.0
    assert R.support_factuality(DOC, s, R.SupportConfig(reduce="mean")) == pytest.approx(0.5)


def test_support_gives_nothing_for_saying_nothing():
    for s in ("", "The. It was.", "   "):
        assert R.support_factuality(DOC, s) == 0.0
    assert R.support_factuality("", "Granite Group reported revenue.") == 0.0


def test_support_and_learned_are_reward_backends_named_as_what_they_are():
    for backend in ("support", "learned"):
        cfg = R.RewardConfig(factuality=backend, learned=R.LearnedConfig(path=str(ROOT / "scorers/learned.json")))
        good = R.score(DOC, "Granite Group reported revenue of $4.2 billion. Shares rose 12% in New York.", cfg)
        bad = R.score(DOC, "Granite Group reported revenue of $9.9 billion. Shares fell in Paris.", cfg)
        assert good["factuality_backend"] == R.BACKEND_NAMES[backend]
        assert "model-free" in good["factuality_backend"]
        assert good["factuality"] > bad["factuality"] + 0.2


def test_learned_backend_without_weights_names_the_train_command(tmp_path):
    cfg = R.RewardConfig(factuality="learned", learned=R.LearnedConfig(path=str(tmp_path / "none.json")))
    with pytest.raises(FileNotFoundError, match="python -m factual_tools.factcheck train --out"):
        R.score(DOC, "Granite Group reported revenue.", cfg)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"features": ["x"], "mean": [0], "std": [1], "coef": [1], "bias": 0}))
    with pytest.raises(ValueError, match="not a learned scorer file"):
        R.load_learned(str(bad))


def test_reward_config_keys_for_the_new_backends_are_checked():
    from factual_tools import settings

    def build(mapping):
        flat = {}
        settings._flatten_yaml(R.RewardConfig, mapping, "", "test.yaml", flat, R.RewardConfig)
        return settings._build(R.RewardConfig, flat)

    cfg = build({"factuality": "support", "support": {"window": 2}, "learned": {"path": "w.json"}})
    assert (cfg.factuality, cfg.support.window, cfg.learned.path) == ("support", 2, "w.json")
    with pytest.raises(settings.ConfigError, match="windw"):
        build({"support": {"windw": 2}})
    with pytest.raises(settings.ConfigError, match="factuality"):
        build({"factuality": "suport"})


# --- the learned scorer ------------------------------------------------------------------


def test_fit_reaches_the_weighted_ridge_logistic_optimum():
    rng = np.random.RandomState(0)
    X = rng.randn(200, 3)
    y = 1 / (1 + np.exp(-(X @ [2.0, -1.0, 0.0]))) > rng.rand(200)
    w = rng.rand(200) + 0.5
    m = FC.fit(X, y.astype(float), w, l2=(0.0, 5.0, 5.0))
    # at the optimum the penalised gradient is zero (in the standardised space the model works in)
    Z = np.hstack([(X - m.mean) / m.std, np.ones((200, 1))])
    p = 1 / (1 + np.exp(-Z @ np.append(m.coef, m.bias)))
    grad = Z.T @ (w * (p - y)) + np.array([0.0, 5.0, 5.0, 0.0]) * np.append(m.coef, m.bias)
    assert np.abs(grad).max() < 1e-6
    assert m.coef[0] > 0 > m.coef[1]
    np.testing.assert_allclose(m.predict(X), p)


def test_fit_takes_soft_targets():
    X = np.array([[0.0], [0.0], [1.0], [1.0]])
    m = FC.fit(X, [0.25, 0.25, 0.75, 0.75], l2=0.0)
    np.testing.assert_allclose(m.predict(X), [0.25, 0.25, 0.75, 0.75], atol=1e-6)


def test_features_are_the_support_score_and_missing_words():
    s = "Granite Group reported revenue of $5.1 billion on Tuesday in Texas."
    f = R.learned_features(DOC, s)
    assert f[0] == R.support_factuality(DOC, s)
    assert f[1] == 2.0  # "5.1", "texas"
    assert R.learned_features(DOC, "Granite Group reported revenue of $4.2 billion on Tuesday.") == [1.0, 0.0, 1.0]
    assert R.learned_features(DOC, "") == [0.0, 0.0, 0.0]
    fused = R.learned_features(DOC, "Jane Doe said shares rose 12%.")  # from two adjacent sentences
    assert fused[:2] == [1.0, 0.0] and fused[2] < 1.0
    assert len(R.learned_features(DOC, s)) == len(R.LEARNED_FEATURES)


def test_support_repairs_sentence_boundaries_of_lower_cased_summaries_and_glued_documents():
    # lower-cased output: one faulty sentence must not hide in one long "sentence"
    low = "granite group reported revenue of $4.2 billion. pirates stole the moon."
    assert len(textsplit.split_sentences(low)) == 1
    assert R.repair_summary(low) == "granite group reported revenue of $4.2 billion. Pirates stole the moon."
    assert R.support_factuality(DOC, low) == 0.0  # the worst sentence, as in cased text
    assert len(R.support_details(DOC, low)[1]) == 2
    cased = "Shares rose 12%. They fell, e.g. in New York."  # cased text: "e.g. in" is no sentence end
    assert R.repair_summary(cased) == cased
    # a document whose sentences are glued ("trading.Analysts" reads as one word): repaired, it reads as clean text
    glued = DOC.replace(". ", ".")
    assert R.repair_document(glued) == DOC
    for claim in ("Analysts expected weaker sales.", "Analysts expected factories."):
        assert R.support_details(glued, claim)[1][0]["score"] == R.support_details(DOC, claim)[1][0]["score"]
    assert R.support_factuality(glued, "Analysts expected weaker sales.") == 1.0
    claim = "Analysts expected weaker sales."
    assert R.learned_features(glued, claim) == R.learned_features(DOC, claim)


def test_training_on_the_news_world_ranks_references_above_faulty_drafts(tmp_path):
    out = tmp_path / "w.json"
    FC.main(["train", "--newsworld", "40", "--out", str(out)])
    model = R.load_learned(str(out))
    assert model.meta["trained_on"] == {"newsworld": 120}
    rng = __import__("random").Random(5)
    hits = []
    for doc in newsworld.documents(20, seed=3):
        text, labels = oracle.draft(doc, rng, n_errors=2)
        hits.append(model.score(doc, doc.summary) > model.score(doc, text))
    assert sum(hits) >= 15, hits


def test_cross_validation_reads_the_dev_split_only_and_reports_both_scorers(tmp_path, capsys):
    sample = ROOT / "bench" / "data" / "factuality_sample.jsonl"
    records = [json.loads(line) for line in sample.read_text().splitlines()]
    rows = FC.dev_pairs(str(sample))
    assert len(rows) == sum(r["split"] == "dev" for r in records) == 16
    news = [(R.learned_features(d, s), t) for d, s, t in FC.newsworld_pairs(6)]
    cv = FC.cross_validate(rows, news, k=2, seeds=(0,))
    assert set(cv) == {"cnndm", "xsum"} and all(set(v) == {"support", "learned"} for v in cv.values())
    assert all(0.0 <= ba <= 1.0 and -1.0 <= tau <= 1.0 for v in cv.values() for ba, tau in v.values())
    # the test split is never read: scrambling its labels changes nothing
    scrambled = tmp_path / "scrambled.jsonl"
    scrambled.write_text("".join(json.dumps({**r, **({"human": 1.0 - r["human"], "label": 1 - r["label"]}
                                                    if r["split"] == "test" else {})}) + "\n" for r in records))
    assert FC.cross_validate(FC.dev_pairs(str(scrambled)), news, k=2, seeds=(0,)) == cv


def test_the_shipped_weights_load_and_say_what_trained_them():
    model = R.load_learned(str(ROOT / R.LearnedConfig().path))
    assert model.meta["splits_used"] == "dev only"
    assert set(model.meta["trained_on"]) >= {"newsworld"}
    assert model.coef[0] > 0  # more support, more likely consistent


# --- data: the record format and the FRANK converter ------------------------------------


def test_detokenize_undoes_ptb_tokenisation():
    assert FD.detokenize("it 's a `` test '' ( really ) . he did n't go , 5 % off $ 5") == \
        'it\'s a "test" (really). he didn\'t go, 5% off $5'


def test_load_names_the_file_line_and_field(tmp_path):
    good = json.loads((ROOT / "bench/data/factuality_sample.jsonl").read_text().splitlines()[0])
    p = tmp_path / "x.jsonl"
    p.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(SystemExit, match=r"x.jsonl:2: malformed JSON line"):
        FD.load(p)
    p.write_text(json.dumps({k: v for k, v in good.items() if k != "label"}) + "\n")
    with pytest.raises(SystemExit, match=r"x.jsonl:1: missing field\(s\) label"):
        FD.load(p)
    p.write_text(json.dumps({**good, "split": "train"}) + "\n")
    with pytest.raises(SystemExit, match="x.jsonl:1: split must be"):
        FD.load(p)
    with pytest.raises(SystemExit, match="no such file"):
        FD.load(tmp_path / "missing.jsonl")


def test_the_shipped_sample_is_well_formed_and_balanced():
    recs = FD.load(ROOT / "bench/data/factuality_sample.jsonl")
    for source in ("cnndm", "xsum"):
        for split in ("dev", "test"):
            labels = {r["label"] for r in recs if r["source"] == source and r["split"] == split}
            assert labels == {0, 1}, (source, split)
    assert all(r["label"] == int(r["human"] >= 1.0) for r in recs)
    docs = {}
    for r in recs:
        assert docs.setdefault(r["doc_id"], r["split"]) == r["split"], "a document in two splits"


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": __import__("os").environ["PATH"]})


def test_convert_frank_reads_labels_at_head_and_articles_at_the_older_commit(tmp_path):
    repo = tmp_path / "frank"
    (repo / FD.FRANK_ARTICLES_DIR).mkdir(parents=True)
    _git(repo, "init", "-q")
    art = {"article": "Gary Locke will manage Kilmarnock. He is 39.", "bart": "gary locke will manage kilmarnock 's team .",
           "Gold": "x"}
    xs = {"article": "A cyclist was hurt in Rotterdam.", "BERTS2S": "a cyclist was hurt in paris ."}
    (repo / FD.FRANK_ARTICLES_DIR / "abc.json").write_text(json.dumps(art))
    (repo / FD.FRANK_ARTICLES_DIR / "123.json").write_text(json.dumps(xs))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "articles")
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    _git(repo, "rm", "-rq", "data")
    (repo / "data").mkdir()
    (repo / FD.FRANK_LABELS).write_text(json.dumps([
        {"hash": "abc", "model_name": "bart", "dataset": "cnndm", "Factuality": "1.0", "split": "valid"},
        {"hash": "123", "model_name": "BERTS2S", "dataset": "bbc", "Factuality": "0.0", "split": "test"}]))
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "labels only")
    recs = FD.convert_frank(repo, commit)
    assert [(r["source"], r["split"], r["label"], r["summary"]) for r in recs] == [
        ("xsum", "test", 0, "a cyclist was hurt in paris."),
        ("cnndm", "dev", 1, "gary locke will manage kilmarnock's team.")]
    FD.write(recs, tmp_path / "out.jsonl")
    assert FD.load(tmp_path / "out.jsonl") == recs
    with pytest.raises(SystemExit, match="missing at"):
        FD.convert_frank(repo, "0" * 40)


# --- the benchmark --------------------------------------------------------------------


def test_balanced_accuracy_threshold_and_kendall_by_hand():
    b = bench()
    y = np.array([1, 1, 0, 0, 0])
    s = np.array([0.9, 0.4, 0.5, 0.1, 0.2])
    assert b.balanced_accuracy(y, s >= 0.45) == pytest.approx((1 / 2 + 2 / 3) / 2)
    assert b.tune_threshold(s, y) == 0.4  # the only threshold that keeps both positives: (1 + 2/3) / 2
    assert b.balanced_accuracy(y, s >= 0.4) == pytest.approx((1 + 2 / 3) / 2)
    # tau-b with ties, against a hand count: pairs (concordant - discordant) / sqrt(untied x * untied y)
    x, h = np.array([1, 2, 2, 3]), np.array([1, 1, 2, 3])
    # pairs: (0,1) x+ h0; (0,2) ++; (0,3) ++; (1,2) x0 h+; (1,3) ++; (2,3) ++ -> C=4, D=0, n_x=5, n_h=5
    assert b.kendall_tau(x, h) == pytest.approx(4 / 5)
    kendalltau = pytest.importorskip("scipy.stats").kendalltau  # a cross-check where scipy is installed

    r = np.random.RandomState(1)
    u, v = r.randint(0, 4, 50), r.rand(50)
    assert b.kendall_tau(u, v) == pytest.approx(kendalltau(u, v).statistic)


def test_the_baselines_are_what_they_say():
    b = bench()
    assert b.word_overlap(DOC, "Granite Group reported revenue. Pirates stole revenue.") == pytest.approx(1 / 3)
    assert b.entity_number(DOC, "Granite Group made $4.2 billion in Texas.") == pytest.approx(2 / 3)
    assert b.entity_number(DOC, "the company did well.") == 1.0


def test_bench_runs_on_the_shipped_sample_and_ends_with_json(capsys):
    b = bench()
    b.main(["--newsworld", "10"])
    out = capsys.readouterr().out.strip().splitlines()
    figures = json.loads(out[-1])
    assert set(figures["scorers"]) == set(b.SCORERS)
    for name, res in figures["scorers"].items():
        assert res["per_s"] > 0
        for source in ("cnndm", "xsum", "newsworld"):
            assert 0 <= res[source]["ba"] <= 1 and -1 <= res[source]["tau"] <= 1, (name, source)
    assert "support_beats_baselines_cnndm_ba" in figures
    assert any(line.startswith("| support |") for line in out)


def test_bench_separates_faithful_from_faulty_on_the_sample():
    """On the invented sample the support scorer must rank every source's faithful
    summaries above the faulty ones more often than not (a sanity floor, not a figure)."""
    b = bench()
    recs = FD.load(b.SAMPLE)
    s = np.array([R.support_factuality(r["document"], r["summary"]) for r in recs])
    res = b.evaluate(recs, s)
    for source in ("cnndm", "xsum"):
        assert res[source]["tau"] > 0, res
        assert not math.isnan(res[source]["ba"])
