"""data.py: the Document record, loaders and their bad input, the leak-cluster guard and its CLI."""
import json
import os
import subprocess
import sys
import types

import pytest

import data
from data import DataError, Document, LeakError
from factual_tools import textsplit
import newsworld

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, check=True):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "data.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"data.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def write_lines(path, lines):
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else line.encode("utf-8"))
            f.write(b"\n")
    return str(path)


# --- the record -------------------------------------------------------------------


def test_jsonl_round_trip_keeps_every_field(tmp_path):
    docs = [Document("a", "Some text. More text.", summary="Text.", source="test", bucket="x", cluster="c-a",
                     facts=[{"id": "f0", "kind": "k"}], entities={"Apex Labs": "company"}, meta={"k": [1, 2]}),
            Document("b", "Ünïcode text — with a dash.")]
    path = str(tmp_path / "docs.jsonl")
    assert data.write_jsonl(path, docs) == 2
    assert data.read_documents(path) == docs
    first = json.loads(open(path, encoding="utf-8").readline())
    assert first["version"] == data.DOC_VERSION and list(first)[:3] == ["version", "id", "text"]
    assert "Ünïcode" in open(path, encoding="utf-8").read()  # written as UTF-8, not \u escapes


def test_unknown_fields_and_newer_versions_are_errors():
    with pytest.raises(DataError, match="unknown document field"):
        Document.from_json({"id": "a", "text": "x", "colour": "red"})
    with pytest.raises(DataError, match="newer"):
        Document.from_json({"version": data.DOC_VERSION + 1, "id": "a", "text": "x"})
    with pytest.raises(DataError, match="'text' must be a string"):
        Document.from_json({"id": "a", "text": None})


# --- bad input ----------------------------------------------------------------------


def test_malformed_line_names_file_and_line(tmp_path):
    good = data.dumps(Document("a", "Fine."))
    path = write_lines(tmp_path / "bad.jsonl", [good, "", '{"id": "b", "text": ', good.replace('"a"', '"c"')])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON"):
        list(data.load_jsonl(path))
    report = data.LoadReport()
    docs = list(data.load_jsonl(path, skip_bad=True, report=report))
    assert [d.id for d in docs] == ["a", "c"]
    assert (report.n_docs, report.n_bad) == (2, 1) and "bad.jsonl:3" in report.errors[0]


def test_a_json_value_that_is_not_an_object_is_malformed(tmp_path):
    path = write_lines(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match=r"list\.jsonl:1: .*JSON object"):
        list(data.load_jsonl(path))


@pytest.mark.parametrize("text", ["", "   ", "\n\t "])
def test_empty_documents_are_rejected_with_their_id(tmp_path, text):
    path = write_lines(tmp_path / "e.jsonl", [json.dumps({"id": "doc-7", "text": text})])
    with pytest.raises(DataError, match=r"e\.jsonl:1: document 'doc-7' is empty"):
        list(data.load_jsonl(path))
    foreign = write_lines(tmp_path / "f.jsonl", [json.dumps({"uid": "x9", "article": text})])
    with pytest.raises(DataError, match="'x9' is empty"):
        list(data.load_jsonl(foreign, mapping="id=uid,text=article"))
    report = data.LoadReport()
    assert list(data.load_jsonl(path, skip_bad=True, report=report)) == [] and report.n_bad == 1


def test_non_utf8_bytes_are_a_clear_error(tmp_path):
    path = write_lines(tmp_path / "latin1.jsonl", [data.dumps(Document("a", "ok")),
                                                   '{"id": "b", "text": "caf\xe9"}'.encode("latin-1")])
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not valid UTF-8 \(byte 0xe9"):
        list(data.load_jsonl(path))
    report = data.LoadReport()
    assert [d.id for d in data.load_jsonl(path, skip_bad=True, report=report)] == ["a"] and report.n_bad == 1


# --- loaders ------------------------------------------------------------------------


def test_field_mapping_loader(tmp_path):
    recs = [{"uid": "n1", "body": {"article": "First article. It has two sentences."}, "highlights": ["One.", "Two."]},
            {"body": {"article": "Second article."}, "highlights": "Only one."},
            {"uid": "n3", "body": {"article": "Third."}, "highlights": "x"}]
    path = write_lines(tmp_path / "cnn.jsonl", [json.dumps(r) for r in recs])
    docs = list(data.load_jsonl(path, mapping="id=uid, text=body.article, summary=highlights", limit=2))
    assert [d.id for d in docs] == ["n1", "cnn-2"]  # a missing id falls back to file stem and line
    with open(path, "a") as f:
        f.write("not json\n")  # past the limit: never read
    assert len(list(data.load_jsonl(path, mapping="text=body.article", limit=3))) == 3
    assert list(data.load_jsonl(path, mapping="text=body.article", limit=0)) == []
    assert docs[0].text == "First article. It has two sentences." and docs[0].summary == "One.\nTwo."
    assert docs[0].source == "cnn.jsonl"
    with pytest.raises(DataError, match="no field 'text'"):
        list(data.load_jsonl(path, mapping={"text": "text"}))


@pytest.mark.parametrize("spec, msg", [("article", "write ours=theirs"), ("summary=highlights", "where the text is"),
                                       ("text=a,colour=b", "cannot map")])
def test_bad_field_mappings(spec, msg):
    with pytest.raises(DataError, match=msg):
        data.parse_mapping(spec)


def test_hf_loader_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DataError, match="pip install datasets"):
        list(data.load_hf("cnn_dailymail"))


def test_hf_loader_offline_is_a_clear_error(monkeypatch):
    def load_dataset(*a, **k):
        raise ConnectionError("Couldn't reach 'cnn_dailymail' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(DataError, match=r"could not load dataset 'cnn_dailymail' \(config '3.0.0'.*Offline"):
        list(data.load_hf("cnn_dailymail", split="validation"))


def test_hf_loader_maps_presets_and_limits(monkeypatch):
    seen = {}

    def load_dataset(name, config, split, streaming):
        seen.update(name=name, config=config, split=split, streaming=streaming)
        return iter([{"id": f"h{i}", "article": f"Article {i}.", "highlights": f"Summary {i}."} for i in range(10)])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    report = data.LoadReport()
    docs = list(data.load_hf("cnn_dailymail", split="test", limit=3, report=report))
    assert seen == {"name": "cnn_dailymail", "config": "3.0.0", "split": "test", "streaming": True}
    assert [(d.id, d.text, d.summary, d.source) for d in docs][0] == ("h0", "Article 0.", "Summary 0.", "cnn_dailymail")
    assert len(docs) == 3 and report.n_docs == 3
    with pytest.raises(DataError, match="no field mapping"):
        list(data.load_hf("some/unknown_dataset"))


def test_cli_load_converts_with_mapping_limit_and_skips(tmp_path):
    src = write_lines(tmp_path / "raw.jsonl", ['{"article": "A.", "highlights": "a"}', "not json",
                                               '{"article": "B.", "highlights": "b"}', '{"article": "C."}'])
    out = str(tmp_path / "docs.jsonl")
    proc = run_cli("load", "--jsonl", src, "--map", "text=article,summary=highlights", "--limit", "2",
                   "--skip-bad", "--out", out)
    assert [d.text for d in data.read_documents(out)] == ["A.", "B."]
    assert "1 bad records skipped" in proc.stderr and "raw.jsonl:2" in proc.stderr
    proc = run_cli("load", "--jsonl", src, "--map", "text=article", "--out", out, check=False)
    assert proc.returncode == 1 and "raw.jsonl:2: malformed JSON" in proc.stderr


# --- leak-cluster guard -------------------------------------------------------------

STORY = [
    "Harbor Freight Lines agreed to buy Bluewater Shipping for $2.3 billion on March 4, 2024.",
    "The deal, which Harbor Freight expects to close in June 2025, values Bluewater at 14 times earnings.",
    "Bluewater Shipping employs 4,200 people and operates 61 vessels from its base in Port Mara.",
    "Chief executive Selma Okonjo said the combined fleet would serve routes across the Baltic.",
    "Shares of Bluewater Shipping rose 18% on the news, while Harbor Freight shares fell 2%.",
    "Regulators in the Baltic region are expected to review the transaction.",
]
# Same facts: clauses reordered, sentences in another order, synonyms swapped.
PARAPHRASE = [
    "On March 4, 2024, Harbor Freight Lines agreed to acquire Bluewater Shipping for $2.3 billion.",
    "Shares of Bluewater Shipping climbed 18% on the news, while Harbor Freight shares fell 2%.",
    "Operating 61 vessels from its base in Port Mara, Bluewater Shipping employs 4,200 people.",
    "The deal values Bluewater at 14 times earnings, and Harbor Freight expects it to close in June 2025.",
    "Selma Okonjo, the chief executive, said the combined fleet would serve routes across the Baltic.",
    "Regulators in the Baltic region are expected to examine the transaction.",
]
# Same template, different facts: must not merge.
OTHER_DEAL = [
    "Northgate Rail agreed to buy Cedar Transit for $640 million on October 19, 2021.",
    "The deal, which Northgate expects to close in January 2022, values Cedar at 9 times earnings.",
    "Cedar Transit employs 1,150 people and operates 214 buses from its base in Elmwood.",
    "Chief executive Tomas Reyna said the combined network would serve routes across the valley.",
    "Shares of Cedar Transit rose 7% on the news, while Northgate shares fell 1%.",
    "Regulators in the valley region are expected to review the transaction.",
]
UNRELATED = [
    "Heavy rain flooded parts of Lindenfield on Tuesday, forcing 900 residents from their homes.",
    "The river rose more than two metres overnight, the Lindenfield water authority said.",
    "Volunteers filled sandbags while schools across the district stayed closed.",
    "Forecasters expect the rain to ease by the weekend.",
]


def make_docs():
    return [Document("orig", " ".join(STORY), bucket="deal"), Document("para", " ".join(PARAPHRASE), bucket="deal"),
            Document("other", " ".join(OTHER_DEAL), bucket="deal"), Document("rain", " ".join(UNRELATED), bucket="weather")]


def test_paraphrased_and_reordered_near_duplicates_share_a_cluster():
    clusters = data.cluster_documents(make_docs())
    assert clusters["orig"] == clusters["para"] == "c-orig"
    assert len({clusters["orig"], clusters["other"], clusters["rain"]}) == 3
    # A mere sentence shuffle of a document, and an exact copy, join it too.
    shuffled = Document("shuf", " ".join(reversed(STORY)))
    copy = Document("copy", " ".join(STORY))
    clusters = data.cluster_documents(make_docs() + [shuffled, copy])
    assert clusters["shuf"] == clusters["copy"] == clusters["orig"]


def test_news_world_retellings_are_clustered_and_different_events_are_not():
    docs = list(newsworld.documents(400, 0))
    clusters = data.cluster_documents(docs)
    by_event = {}
    for d in docs:
        by_event.setdefault(d.meta["event"], set()).add(clusters[d.id])
    retold = [e for e in by_event if sum(d.meta["event"] == e for d in docs) > 1]
    assert len(retold) >= 10
    assert all(len(cs) == 1 for cs in by_event.values())  # no retold event is split
    assert len(set(clusters.values())) >= 0.97 * len(by_event)  # and different events are rarely merged


def test_duplicate_ids_are_rejected():
    with pytest.raises(DataError, match="duplicate document ids"):
        data.cluster_documents([Document("a", "x y z"), Document("a", "p q r")])


def small_world():
    return list(newsworld.documents(300, 1))


def test_split_is_seeded_stratified_and_whole_clusters():
    docs = small_world()
    m1, m2 = data.make_split(docs, seed=3), data.make_split(docs, seed=3)
    assert json.dumps(m1) == json.dumps(m2)
    assert json.dumps(data.make_split(docs, seed=4)["pools"]) != json.dumps(m1["pools"])
    counts = m1["counts"]
    assert sum(counts.values()) == len(docs)
    assert 0.74 <= counts["train"] / len(docs) <= 0.86 and counts["eval"] >= 20 and counts["never_touch"] >= 20
    buckets = {d.bucket for d in docs}
    for pool in ("eval", "never_touch"):  # stratified: every bucket is represented
        assert {e["bucket"] for e in m1["pools"][pool]} == buckets
    entry = {e["id"]: e for p in data.POOLS for e in m1["pools"][p]}
    assert entry[docs[0].id]["sha256"] == data.content_hash(docs[0].text)
    assert data.check_split(m1, docs)["documents"] == len(docs)


def test_check_split_fails_loudly_on_a_planted_leak():
    docs = small_world()
    manifest = data.make_split(docs, seed=0)
    # 1. A document moved to another pool, cluster label kept: its cluster now spans two pools.
    moved = json.loads(json.dumps(manifest))
    by_cluster = {}
    for p in data.POOLS:
        for e in moved["pools"][p]:
            by_cluster.setdefault(e["cluster"], []).append((p, e))
    cluster, members = next((c, m) for c, m in by_cluster.items() if len(m) > 1 and m[0][0] == "train")
    moved["pools"]["train"].remove(members[0][1])
    moved["pools"]["eval"].append(members[0][1])
    with pytest.raises(LeakError, match=rf"cluster '{cluster}' spans pools \['train', 'eval'\]"):
        data.check_split(moved)
    # 2. A paraphrase of a training document filed under eval with a fresh cluster id:
    #    the manifest looks clean, re-clustering the documents finds the leak.
    train_doc = next(d for d in docs if any(e["id"] == d.id for e in manifest["pools"]["train"]))
    sentences = textsplit.split_sentences(train_doc.text)
    twin = Document("planted-twin", " ".join(reversed(sentences)), bucket=train_doc.bucket)
    planted = json.loads(json.dumps(manifest))
    planted["pools"]["eval"].append({"id": twin.id, "sha256": data.content_hash(twin.text), "cluster": "c-new",
                                     "bucket": twin.bucket})
    data.check_split(planted)  # the labels alone cannot see it
    with pytest.raises(LeakError, match=r"near-duplicate cluster .* spans pools \['train', 'eval'\]"):
        data.check_split(planted, docs + [twin])


def test_pool_documents_keep_file_order_and_check_content_hashes():
    docs = small_world()
    manifest = data.make_split(docs, seed=0)
    evals = data.pool_documents(docs, manifest, "eval")
    assert [d.id for d in evals] == [d.id for d in docs if d.id in {e["id"] for e in manifest["pools"]["eval"]}]
    both = data.pool_documents(docs, manifest, ("eval", "never_touch"))
    assert len(both) == manifest["counts"]["eval"] + manifest["counts"]["never_touch"]
    changed = [Document(d.id, d.text + " Updated.") if d.id == evals[0].id else d for d in docs]
    with pytest.raises(LeakError, match=rf"{evals[0].id} changed since split.json was frozen"):
        data.pool_documents(changed, manifest, "eval", "split.json")


def test_read_manifest_names_the_file_when_missing_or_malformed(tmp_path):
    with pytest.raises(DataError, match=r"nope.json does not exist .*data.py split"):
        data.read_manifest(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text('{"version": 1}')
    with pytest.raises(DataError, match="bad.json: not a split manifest"):
        data.read_manifest(str(bad))


def test_leak_guard_catches_a_generated_twin_of_a_held_out_document():
    docs = small_world()
    manifest = data.make_split(docs, seed=0)
    held = data.pool_documents(docs, manifest, ("eval", "never_touch"))
    guard = data.LeakGuard(held, **manifest["clustering"])
    twin = Document("fresh-1", " ".join(reversed(textsplit.split_sentences(held[3].text))))
    assert guard.match(twin) == held[3].id  # a retelling of a held-out event is kept out
    assert guard.match(held[0]) == held[0].id
    train = data.pool_documents(docs, manifest, "train")
    fresh = list(newsworld.documents(200, seed=7))  # another world: its events are new
    assert sum(guard.match(d) is not None for d in fresh) <= 4
    # it agrees with the clustering: a training document never shares a cluster with a held-out one
    assert all(guard.match(d) is None for d in train)


def test_fresh_documents_skip_what_the_held_out_guard_matches():
    docs = small_world()
    manifest = data.make_split(docs, seed=0)
    guard = data.held_out_guard(docs, manifest)
    held = data.pool_documents(docs, manifest, ("eval", "never_touch"))
    assert guard.match(held[0]) == held[0].id  # the split's held-out pools, both of them
    # The world the split came from, drawn again: its held-out articles are skipped, the rest kept.
    kept, skipped = newsworld.fresh_documents(len(docs), 1, guard)
    held_ids = {d.id for d in held}
    assert held_ids <= set(skipped) and not held_ids & {d.id for d in kept}
    assert [d.id for d in kept] == [d.id for d in docs if d.id not in set(skipped)]
    assert newsworld.fresh_documents(5, 1) == (docs[:5], [])  # no guard: every article, in order


def test_check_split_detects_changed_and_unknown_documents():
    docs = small_world()
    manifest = data.make_split(docs, seed=0)
    changed = [Document(d.id, d.text + " Updated.", bucket=d.bucket) if i == 5 else d for i, d in enumerate(docs)]
    with pytest.raises(LeakError, match=rf"{docs[5].id}' changed since the split was frozen"):
        data.check_split(manifest, changed)
    with pytest.raises(LeakError, match="not in the frozen manifest"):
        data.check_split(manifest, docs + [Document("new", "A new text.")])
    with pytest.raises(ValueError, match="fractions"):
        data.make_split(docs, fractions=(0.8, 0.3, 0.1))


def test_cli_missing_input_is_one_error_line_naming_the_file(tmp_path):
    missing = str(tmp_path / "missing.jsonl")
    for args in (("split", "--docs", missing, "--out", str(tmp_path / "s.json")),
                 ("load", "--jsonl", missing, "--out", str(tmp_path / "o.jsonl"))):
        proc = run_cli(*args, check=False)
        assert proc.returncode == 1 and proc.stderr.startswith("error: "), proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert "missing.jsonl" in proc.stderr
    assert not os.path.exists(tmp_path / "s.json") and not os.path.exists(tmp_path / "o.jsonl")


def test_cli_split_freezes_the_manifest_and_checks_it(tmp_path):
    world = str(tmp_path / "world.jsonl")
    subprocess.run([sys.executable, "-m", "newsworld", "generate", "--n", "120", "--seed", "2", "--out", world],
                   cwd=ROOT, check=True, capture_output=True, timeout=120)
    manifest = str(tmp_path / "split.json")
    run_cli("split", "--docs", world, "--out", manifest, "--docs-out", str(tmp_path / "clustered.jsonl"))
    frozen = open(manifest, "rb").read()
    assert json.loads(frozen)["version"] == data.MANIFEST_VERSION
    assert all(d.cluster for d in data.read_documents(str(tmp_path / "clustered.jsonl")))
    proc = run_cli("split", "--docs", world, "--out", manifest, "--seed", "9", check=False)
    assert proc.returncode == 1 and "frozen" in proc.stderr and open(manifest, "rb").read() == frozen
    assert "split check passed" in run_cli("split", "--docs", world, "--check", manifest).stdout
    leaky = json.loads(frozen)
    leaky["pools"]["eval"].append(leaky["pools"]["train"].pop())
    leaky["pools"]["train"].append(dict(leaky["pools"]["eval"][-1], id="dup-id"))
    json.dump(leaky, open(tmp_path / "leaky.json", "w"))
    proc = run_cli("split", "--docs", world, "--check", str(tmp_path / "leaky.json"), check=False)
    assert proc.returncode == 2 and "leak" in proc.stderr
    run_cli("split", "--docs", world, "--out", manifest, "--seed", "9", "--force")
    assert open(manifest, "rb").read() != frozen
