"""Documents for the summariser: the record, loaders, leak-safe splits, and the data command line.

- `Document`, the one record every stage passes around (id, text, reference
  summary, source, bucket, leak cluster; for the news world also its fact table
  and entity table), with versioned JSONL (de)serialisation.
- Loaders: our own JSONL, foreign JSONL through a field mapping, and Hugging Face
  `datasets` by name (imported lazily; a clear error when it is missing or the
  machine is offline). All loaders stream and honour `limit`.
- The leak-cluster guard: MinHash clusters of near-duplicate documents, split whole
  into train / eval / never-touch pools, stratified by bucket, seeded, written as a
  frozen manifest whose content hashes every later reader checks (`pool_documents`).

The built-in news world (newsworld/) writes its articles in this record and
sits above this module, which imports nothing of it. The command line:

    python data.py load --jsonl raw.jsonl --map text=article,summary=highlights --out docs.jsonl
    python data.py load --hf cnn_dailymail --split validation --limit 500 --out cnn.jsonl
    python data.py split --docs out/world.jsonl --out out/split.json
    python data.py split --docs out/world.jsonl --check out/split.json

Clusters come from MinHash over normalised word shingles plus entity and number
features (robust to paraphrase and attribute reordering), since documents carry
no identifier of the event they report.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import random
import re
import sys
import unicodedata
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence


from factual_tools import textsplit

DOC_VERSION = 1  # version of the Document JSONL record
MANIFEST_VERSION = 1  # version of the split manifest


def seeded_rng(*parts) -> random.Random:
    """A private RNG keyed by `parts`; never the global one, never Python's salted hash()."""
    h = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return random.Random(int.from_bytes(h[:8], "big"))


# English month names, written out (never the locale's): the news world writes its
# dates with them, the oracle reads them back, the leak guard ignores them in names.
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September",
          "October", "November", "December"]

# Function words: dropped from shingles (the leak guard) and from search keys (the oracle).
STOP_WORDS = frozenset("""a an the of to in on at for by with from and or but as is was were be been has had have it its
this that these those which who whom their there than then also said says say about after before over into
would will could should can may more most some such not no per new did does do""".split())


class DataError(ValueError):
    """Bad input data: the message names the file, line or document at fault."""


class LeakError(RuntimeError):
    """A split whose pools share a leak cluster, or a manifest that no longer matches its documents."""


# ===========================================================================
# 1. The Document record and JSONL
# ===========================================================================


@dataclass
class Document:
    id: str  # stable id, e.g. "nw-0-000042"
    text: str  # the source article
    summary: str = ""  # reference summary ("" when unknown)
    source: str = ""  # where it came from: "newsworld", a dataset name, a file name
    bucket: str = ""  # stratum for splits: the event family in the news world
    cluster: str | None = None  # leak cluster id, filled by the split step
    facts: list[dict] = field(default_factory=list)  # news world fact table (see `Fact`)
    entities: dict[str, str] = field(default_factory=dict)  # news world: entity name -> type
    meta: dict = field(default_factory=dict)  # anything else (news world: event id, summary units)

    def to_json(self) -> dict:
        return {"version": DOC_VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> "Document":
        """Parse one record; unknown fields and newer versions are errors, not silently dropped."""
        if not isinstance(d, dict):
            raise DataError(f"a document must be a JSON object, got {type(d).__name__}")
        d = dict(d)
        version = d.pop("version", DOC_VERSION)
        if not isinstance(version, int) or version > DOC_VERSION:
            raise DataError(f"document version {version!r} is newer than this code ({DOC_VERSION})")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise DataError(f"unknown document field(s) {unknown} (known: {sorted(names)})")
        for k in ("id", "text"):
            if not isinstance(d.get(k), str):
                raise DataError(f"document field {k!r} must be a string, got {d.get(k)!r:.60}")
        doc = cls(**d)
        check_document(doc)
        return doc


def check_document(doc: Document) -> None:
    """Reject documents no stage can use: no id, or empty / whitespace-only text."""
    if not doc.id or not str(doc.id).strip():
        raise DataError("document without an id")
    if not doc.text or not doc.text.strip():
        raise DataError(f"document {doc.id!r} is empty (no text)")


def dumps(doc: Document) -> str:
    """One JSONL line (no newline). Field order is fixed, so output is byte-stable."""
    return json.dumps(doc.to_json(), ensure_ascii=False)


def write_jsonl(path: str, docs: Iterable[Document]) -> int:
    """Write documents to `path` (atomically: temp file then rename). Returns the count."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    n = 0
    with open(tmp, "w", encoding="utf-8", newline="\n") as f:
        for doc in docs:
            f.write(dumps(doc) + "\n")
            n += 1
    os.replace(tmp, path)
    return n


@dataclass
class LoadReport:
    """What a loader read: filled in as the stream is consumed."""
    source: str = ""
    n_lines: int = 0  # non-blank input lines / records seen
    n_docs: int = 0  # documents yielded
    n_bad: int = 0  # records skipped (only with skip_bad=True)
    errors: list[str] = field(default_factory=list)  # the first few skip reasons

    def skip(self, msg: str) -> None:
        self.n_bad += 1
        if len(self.errors) < 20:
            self.errors.append(msg)


def jsonl_records(path: str, report: LoadReport | None = None, skip_bad: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, parsed object) for each non-blank line, with errors that name file and line."""
    report = report if report is not None else LoadReport()
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                msg = (f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                       f"re-encode the file as UTF-8")
                if not skip_bad:
                    raise DataError(msg) from None
                report.n_lines += 1
                report.skip(msg)
                continue
            if not line.strip():
                continue
            report.n_lines += 1
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
            except ValueError as e:
                msg = f"{path}:{lineno}: malformed JSON line: {e}"
                if not skip_bad:
                    raise DataError(msg) from None
                report.skip(msg)
                continue
            yield lineno, obj


def _get_path(obj: dict, dotted: str):
    """obj["a"]["b"] for "a.b"; None when any step is missing."""
    cur = obj
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


# Fields a mapping may fill. Lists (CNN/DM highlights in some dumps) are joined.
MAPPABLE = ("id", "text", "summary", "bucket", "source")


def parse_mapping(spec: str | dict | None) -> dict[str, str] | None:
    """'text=article,summary=highlights' (or a dict) -> {'text': 'article', 'summary': 'highlights'}."""
    if spec is None or isinstance(spec, dict):
        mapping = spec
    else:
        mapping = {}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            if "=" not in part:
                raise DataError(f"bad field mapping {part!r}: write ours=theirs, e.g. text=article")
            ours, theirs = (s.strip() for s in part.split("=", 1))
            mapping[ours] = theirs
    if mapping is not None:
        bad = sorted(set(mapping) - set(MAPPABLE))
        if bad:
            raise DataError(f"cannot map field(s) {bad}; mappable: {list(MAPPABLE)}")
        if "text" not in mapping:
            raise DataError("a field mapping must say where the text is, e.g. text=article")
    return mapping


def _as_text(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, list):
        return "\n".join(str(x) for x in v)
    return str(v)


def record_to_document(rec: dict, mapping: dict[str, str], default_id: str, source: str) -> Document:
    """A foreign record through a field mapping (ours -> theirs). Missing id: `default_id`."""
    vals = {k: _as_text(_get_path(rec, theirs)) for k, theirs in mapping.items()}
    text = vals.get("text")
    doc_id = vals.get("id") or default_id
    if text is None:
        raise DataError(f"document {doc_id!r} has no field {mapping['text']!r} (mapped to text)")
    return Document(id=doc_id, text=text, summary=vals.get("summary") or "",
                    source=vals.get("source") or source, bucket=vals.get("bucket") or "")


def load_jsonl(path: str, mapping: str | dict | None = None, limit: int | None = None,
               skip_bad: bool = False, report: LoadReport | None = None) -> Iterator[Document]:
    """Stream documents from a JSONL file.

    `mapping=None` reads our own `Document` records; a mapping such as
    `{"text": "article", "summary": "highlights", "id": "id"}` (or the string
    "text=article,summary=highlights") reads foreign records, dotted names reach
    into nested objects. Malformed lines, non-UTF-8 lines and empty documents
    raise a `DataError` naming file, line and id; with `skip_bad=True` they are
    skipped and counted in `report`.
    """
    mapping = parse_mapping(mapping)
    report = report if report is not None else LoadReport()
    report.source = path
    stem = os.path.splitext(os.path.basename(path))[0]
    if limit is not None and limit <= 0:
        return
    for lineno, rec in jsonl_records(path, report, skip_bad):
        try:
            if mapping is None:
                doc = Document.from_json(rec)
            else:
                doc = record_to_document(rec, mapping, f"{stem}-{lineno}", os.path.basename(path))
                check_document(doc)
        except (DataError, TypeError) as e:
            msg = f"{path}:{lineno}: {e}"
            if not skip_bad:
                raise DataError(msg) from None
            report.skip(msg)
            continue
        report.n_docs += 1
        yield doc
        if limit is not None and report.n_docs >= limit:
            return  # before reading on: a bad line past the limit is none of our business


def read_documents(path: str, limit: int | None = None) -> list[Document]:
    """All of our own Document records in `path` (strict)."""
    return list(load_jsonl(path, limit=limit))


# Known Hugging Face datasets: config and field mapping (ours -> theirs).
HF_PRESETS = {
    "cnn_dailymail": {"config": "3.0.0", "mapping": {"id": "id", "text": "article", "summary": "highlights"}},
    "abisee/cnn_dailymail": {"config": "3.0.0", "mapping": {"id": "id", "text": "article", "summary": "highlights"}},
    "xsum": {"config": None, "mapping": {"id": "id", "text": "document", "summary": "summary"}},
    "EdinburghNLP/xsum": {"config": None, "mapping": {"id": "id", "text": "document", "summary": "summary"}},
}


def load_hf(name: str, config: str | None = None, split: str = "train", *, mapping: str | dict | None = None,
            limit: int | None = None, streaming: bool = True, skip_bad: bool = False,
            report: LoadReport | None = None) -> Iterator[Document]:
    """Stream documents from a Hugging Face dataset (e.g. cnn_dailymail 3.0.0: article/highlights).

    `datasets` is imported here, not at module level, so the rest of the
    project never needs it. Missing package or no network (no local cache) is a
    `DataError` that says what to do.
    """
    preset = HF_PRESETS.get(name, {})
    config = config if config is not None else preset.get("config")
    mapping = parse_mapping(mapping if mapping is not None else preset.get("mapping"))
    if mapping is None:
        raise DataError(f"no field mapping for dataset {name!r}: pass one, e.g. text=article,summary=highlights")
    try:
        import datasets  # optional: only this loader needs it
    except ImportError as e:
        raise DataError(f"loading {name!r} needs the `datasets` package (pip install datasets): {e}") from None
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=streaming)
    except Exception as e:  # ConnectionError, OfflineModeIsEnabled, DatasetNotFoundError, ...
        raise DataError(
            f"could not load dataset {name!r} (config {config!r}, split {split!r}): {type(e).__name__}: {e}. "
            f"Offline machines need the dataset in the local cache (HF_DATASETS_OFFLINE=1) or a JSONL export "
            f"loaded with --jsonl and --map") from e
    report = report if report is not None else LoadReport()
    report.source = f"hf:{name}"
    if limit is not None and limit <= 0:
        return
    for i, rec in enumerate(ds):
        report.n_lines += 1
        try:
            doc = record_to_document(dict(rec), mapping, f"{name.split('/')[-1]}-{split}-{i}", name)
            check_document(doc)
        except DataError as e:
            if not skip_bad:
                raise DataError(f"{name} [{split} #{i}]: {e}") from None
            report.skip(f"{name} [{split} #{i}]: {e}")
            continue
        report.n_docs += 1
        yield doc
        if limit is not None and report.n_docs >= limit:
            return  # a streamed dataset is not read past the limit


# ===========================================================================
# 8. The leak-cluster guard
# ===========================================================================
#
# Near-duplicates (a retold event, a paraphrase, the same facts with clauses
# reordered) must never sit on both sides of a train/eval split. Documents are
# MinHashed over two kinds of features:
# - word 3-shingles of the normalised text (lower case, numbers -> "#", stop
#   words dropped), which survive reordering of whole clauses and most synonym
#   swaps (a swap breaks only the shingles around it);
# - the document's entity and number set (capitalised names, the numbers as
#   written), repeated `entity_weight` times, so two articles about the same
#   facts match even when every sentence is paraphrased, and two articles that
#   share a template but not their facts do not.
# Clusters are the connected components of the pairs whose Jaccard similarity
# reaches `threshold` (MinHash LSH proposes the pairs). On the news world, with
# these defaults, retold events score 0.29-0.8 and different events of the same
# family at most about 0.2.

POOLS = ("train", "eval", "never_touch")
_NAME_SPAN = re.compile(r"[A-Z][\w'’-]*(?:\s+(?:of\s+)?[A-Z][\w'’-]*)*")
_NUMBER_TOKEN = re.compile(r"\d[\d,.]*\d|\d")
_MONTH_SET = frozenset(MONTHS)


def normalise_text(text: str) -> str:
    """The text a content hash covers: Unicode NFC, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def content_hash(text: str) -> str:
    return hashlib.sha256(normalise_text(text).encode("utf-8")).hexdigest()


def doc_features(text: str, shingle: int = 3, entity_weight: int = 8) -> set[str]:
    """MinHash features of a document: content-word shingles plus weighted entity and number features."""
    toks = ["#" if any(c.isdigit() for c in w) else w for w in textsplit.words(text)]
    content = [w for w in toks if w not in STOP_WORDS]
    feats = {" ".join(content[i:i + shingle]) for i in range(max(1, len(content) - shingle + 1))}
    names = set()
    for sent in textsplit.split_sentences(text):
        for m in _NAME_SPAN.finditer(sent):
            words = m.group().split()
            while words and (words[0].lower() in STOP_WORDS or words[0] in _MONTH_SET or words[0] in ("We", "I")):
                words = words[1:]  # "On April", "The Securities Commission": openers are not the name
            if not words or (len(words) == 1 and m.start() == 0 and m.group() == words[0]):
                continue  # nothing left, or a capitalised sentence opener
            names.add("e:" + " ".join(words).lower())
    # Numbers of three or more digits (amounts, counts, years): small ones recur everywhere.
    names |= {"n:" + n for n in (x.replace(",", "") for x in _NUMBER_TOKEN.findall(text)) if len(n) >= 3}
    feats |= {f"{x}#{k}" for x in names for k in range(entity_weight)}
    return feats


@dataclass(frozen=True)
class ClusterConfig:
    threshold: float = 0.25  # Jaccard similarity at which two documents are near-duplicates
    num_perm: int = 128  # MinHash permutations
    shingle: int = 3  # words per shingle
    entity_weight: int = 8  # copies of each entity/number feature


def cluster_documents(docs: Sequence[Document], threshold: float = 0.25, num_perm: int = 128, shingle: int = 3,
                      entity_weight: int = 8) -> dict[str, str]:
    """doc id -> cluster id ("c-" + the smallest member id). Deterministic; ids must be unique.

    MinHash LSH (at a lower threshold, so few true pairs are missed) proposes
    candidate pairs; a pair joins a cluster when the exact Jaccard similarity of
    its feature sets reaches `threshold`. Features are recomputed for candidates
    only, so memory stays at one sketch per document.
    """
    from datasketch import MinHash, MinHashLSH

    ids = [d.id for d in docs]
    dup = [k for k, n in Counter(ids).items() if n > 1]
    if dup:
        raise DataError(f"duplicate document ids: {dup[:5]}")
    text = {d.id: d.text for d in docs}
    lsh = MinHashLSH(threshold=max(0.05, 0.7 * threshold), num_perm=num_perm)
    sketches = {}
    for d in docs:
        mh = MinHash(num_perm=num_perm, seed=1)
        mh.update_batch([f.encode("utf-8") for f in sorted(doc_features(d.text, shingle, entity_weight))])
        sketches[d.id] = mh
        lsh.insert(d.id, mh)

    @functools.lru_cache(maxsize=4096)
    def feats(i: str) -> frozenset[str]:
        return frozenset(doc_features(text[i], shingle, entity_weight))

    parent = {i: i for i in ids}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i in ids:
        for j in sorted(lsh.query(sketches[i])):
            if j <= i or root(i) == root(j):
                continue
            fi, fj = feats(i), feats(j)
            if len(fi & fj) >= threshold * len(fi | fj):
                a, b = sorted((root(i), root(j)))
                parent[b] = a  # the smaller id becomes the root
    members: dict[str, list[str]] = defaultdict(list)
    for i in ids:
        members[root(i)].append(i)
    return {i: "c-" + min(members[root(i)]) for i in ids}


def read_manifest(path: str) -> dict:
    """A split manifest (`data.py split --out`); a missing or malformed file is a DataError naming it."""
    if not os.path.exists(path):
        raise DataError(f"split manifest {path} does not exist (make one with `python data.py split --docs "
                        f"DOCS --out {path}`)")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
        manifest["pools"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DataError(f"{path}: not a split manifest ({type(e).__name__}: {e})") from None
    return manifest


def pool_documents(docs: Sequence[Document], manifest: dict, pools: str | Sequence[str],
                   where: str = "the manifest") -> list[Document]:
    """The documents of `pools` (one name or several), in the order of `docs`,
    each checked against the manifest's content hash: a document changed since
    the split was frozen is not the one the split put there (LeakError)."""
    wanted = (pools,) if isinstance(pools, str) else tuple(pools)
    entries = {e["id"]: e for p in wanted for e in manifest["pools"].get(p, [])}
    out = [d for d in docs if d.id in entries]
    for d in out:
        if content_hash(d.text) != entries[d.id]["sha256"]:
            raise LeakError(f"document {d.id} changed since {where} was frozen (content hash differs)")
    return out


def held_out_guard(docs: Sequence[Document], manifest: dict, where: str = "the manifest") -> "LeakGuard":
    """A LeakGuard over the eval and never-touch pools of a split, with the split's
    own clustering parameters: what new training documents must not duplicate."""
    held = pool_documents(docs, manifest, ("eval", "never_touch"), where)
    return LeakGuard(held, **manifest.get("clustering", {}))


class LeakGuard:
    """Near-duplicate test of new documents against a fixed set (held-out pools):
    the same features, LSH and exact-Jaccard threshold as `cluster_documents`,
    so a generated document that would have joined a held-out cluster is caught.

        guard = LeakGuard(eval_and_never_touch_docs, **manifest["clustering"])
        guard.match(doc)  # the held document id it duplicates, or None
    """

    def __init__(self, held: Sequence[Document], threshold: float = 0.25, num_perm: int = 128, shingle: int = 3,
                 entity_weight: int = 8):
        from datasketch import MinHashLSH

        self.threshold, self.num_perm, self.shingle, self.entity_weight = threshold, num_perm, shingle, entity_weight
        self.lsh = MinHashLSH(threshold=max(0.05, 0.7 * threshold), num_perm=num_perm)
        self.features: dict[str, frozenset[str]] = {}
        for d in held:
            feats = frozenset(doc_features(d.text, shingle, entity_weight))
            self.features[d.id] = feats
            self.lsh.insert(d.id, self._sketch(feats))

    def _sketch(self, feats):
        from datasketch import MinHash

        mh = MinHash(num_perm=self.num_perm, seed=1)
        mh.update_batch([f.encode("utf-8") for f in sorted(feats)])
        return mh

    def match(self, doc: Document) -> str | None:
        feats = frozenset(doc_features(doc.text, self.shingle, self.entity_weight))
        for j in sorted(self.lsh.query(self._sketch(feats))):
            other = self.features[j]
            if len(feats & other) >= self.threshold * len(feats | other):
                return j
        return None


def make_split(docs: Sequence[Document], fractions: Sequence[float] = (0.8, 0.1, 0.1), seed: int = 0,
               *, threshold: float = 0.25, num_perm: int = 128, shingle: int = 3, entity_weight: int = 8) -> dict:
    """Split whole leak clusters into train / eval / never-touch pools, stratified by bucket, seeded.

    Within each bucket, clusters are shuffled (seeded) and each goes to the pool
    furthest below its share of the bucket's documents. The manifest lists, per
    pool, each document's id, sha256 of its normalised text, cluster and bucket.
    """
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(f"fractions must be three non-negative shares summing to 1, got {fractions}")
    clusters = cluster_documents(docs, threshold, num_perm, shingle, entity_weight)
    by_cluster: dict[str, list[Document]] = defaultdict(list)
    for d in docs:
        by_cluster[clusters[d.id]].append(d)
    by_bucket: dict[str, list[str]] = defaultdict(list)
    for c, members in by_cluster.items():
        buckets = Counter(d.bucket for d in members)
        bucket = min(buckets, key=lambda b: (-buckets[b], b))  # majority, ties by name
        by_bucket[bucket].append(c)
    pools: dict[str, list[dict]] = {p: [] for p in POOLS}
    for bucket in sorted(by_bucket):
        cids = sorted(by_bucket[bucket])
        seeded_rng(seed, "split", bucket).shuffle(cids)
        total = sum(len(by_cluster[c]) for c in cids)
        filled = dict.fromkeys(POOLS, 0)
        for c in cids:
            pool = max(POOLS, key=lambda p: (fractions[POOLS.index(p)] * total - filled[p], -POOLS.index(p)))
            filled[pool] += len(by_cluster[c])
            pools[pool] += [{"id": d.id, "sha256": content_hash(d.text), "cluster": c, "bucket": d.bucket}
                            for d in by_cluster[c]]
    for p in POOLS:
        pools[p].sort(key=lambda e: e["id"])
    return {
        "version": MANIFEST_VERSION,
        "seed": seed,
        "fractions": dict(zip(POOLS, fractions)),
        "clustering": dataclasses.asdict(ClusterConfig(threshold, num_perm, shingle, entity_weight)),
        "counts": {p: len(pools[p]) for p in POOLS},
        "clusters": len(by_cluster),
        "pools": pools,
    }


def check_split(manifest: dict, docs: Sequence[Document] | None = None) -> dict:
    """Verify a frozen split; raise `LeakError` naming the cluster and pools at fault.

    Checks: each id in one pool; each cluster in one pool; and, given the
    documents, that every document is in the manifest with an unchanged content
    hash and that re-clustering them (with the manifest's settings) puts no two
    near-duplicates in different pools, which catches a leak the manifest's own
    cluster labels hide. Returns counts.
    """
    if manifest.get("version") != MANIFEST_VERSION:
        raise LeakError(f"manifest version {manifest.get('version')!r}, expected {MANIFEST_VERSION}")
    pool_of: dict[str, str] = {}
    cluster_pools: dict[str, set[str]] = defaultdict(set)
    entry: dict[str, dict] = {}
    for pool in POOLS:
        for e in manifest["pools"].get(pool, []):
            if e["id"] in pool_of:
                raise LeakError(f"leak: document {e['id']!r} is in pools {pool_of[e['id']]!r} and {pool!r}")
            pool_of[e["id"]] = pool
            entry[e["id"]] = e
            cluster_pools[e["cluster"]].add(pool)
    for c, ps in sorted(cluster_pools.items()):
        if len(ps) > 1:
            ids = sorted(i for i, e in entry.items() if e["cluster"] == c)
            raise LeakError(f"leak: cluster {c!r} spans pools {sorted(ps, key=POOLS.index)} (ids {ids[:6]})")
    result = {"documents": len(pool_of), "clusters": len(cluster_pools),
              "pools": {p: sum(v == p for v in pool_of.values()) for p in POOLS}}
    if docs is None:
        return result
    for d in docs:
        if d.id not in entry:
            raise LeakError(f"document {d.id!r} is not in the frozen manifest; re-split with --force to add it")
        if content_hash(d.text) != entry[d.id]["sha256"]:
            raise LeakError(f"document {d.id!r} changed since the split was frozen (content hash differs)")
    cfg = manifest.get("clustering", {})
    recomputed = cluster_documents(docs, **cfg)
    groups: dict[str, list[str]] = defaultdict(list)
    for i, c in recomputed.items():
        groups[c].append(i)
    for c, ids in sorted(groups.items()):
        ps = sorted({pool_of[i] for i in ids}, key=POOLS.index)
        if len(ps) > 1:
            where = {p: [i for i in sorted(ids) if pool_of[i] == p][:3] for p in ps}
            raise LeakError(f"leak: near-duplicate cluster {c!r} spans pools {ps}: {where}")
    result["checked_documents"] = len(docs)
    return result


# ===========================================================================
# 10. Command line
# ===========================================================================


def _cmd_load(args) -> int:
    report = LoadReport()
    if args.hf:
        docs = load_hf(args.hf, config=args.config, split=args.split, mapping=args.map, limit=args.limit,
                       skip_bad=args.skip_bad, report=report)
    else:
        docs = load_jsonl(args.jsonl, mapping=args.map, limit=args.limit, skip_bad=args.skip_bad, report=report)
    n = write_jsonl(args.out, docs)
    print(f"load: {n} documents from {report.source} -> {args.out} ({report.n_bad} bad records skipped)",
          file=sys.stderr)
    for msg in report.errors[:5]:
        print(f"  skipped {msg}", file=sys.stderr)
    return 0


def _cmd_split(args) -> int:
    docs = read_documents(args.docs)
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            manifest = json.load(f)
        result = check_split(manifest, docs)
        print(f"split check passed: {json.dumps(result)}")
        return 0
    if not args.out:
        raise DataError("split needs --out MANIFEST (to freeze a split) or --check MANIFEST (to verify one)")
    if os.path.exists(args.out) and not args.force:
        raise DataError(f"{args.out} exists: a split is frozen once written (pass --force to replace it)")
    fractions = tuple(float(x) for x in args.fractions.split(","))
    manifest = make_split(docs, fractions, seed=args.seed, threshold=args.threshold, num_perm=args.num_perm,
                          shingle=args.shingle)
    check_split(manifest, docs)
    tmp = f"{args.out}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    if args.docs_out:
        cluster = {e["id"]: e["cluster"] for p in POOLS for e in manifest["pools"][p]}
        write_jsonl(args.docs_out, (dataclasses.replace(d, cluster=cluster[d.id]) for d in docs))
    print(f"split: {manifest['counts']} in {manifest['clusters']} clusters -> {args.out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The CLI. A new command adds a subparser here and a handler to COMMANDS."""
    p = argparse.ArgumentParser(prog="data.py", description="Documents: loaders and leak-guarded splits.")
    sub = p.add_subparsers(dest="command", required=True)

    ld = sub.add_parser("load", help="convert JSONL (with a field mapping) or a HF dataset to Document JSONL")
    src = ld.add_mutually_exclusive_group(required=True)
    src.add_argument("--jsonl", help="input JSONL file")
    src.add_argument("--hf", help="Hugging Face dataset name, e.g. cnn_dailymail")
    ld.add_argument("--map", default=None, help="ours=theirs pairs: text=article,summary=highlights,id=id")
    ld.add_argument("--config", default=None, help="HF dataset config (cnn_dailymail: 3.0.0)")
    ld.add_argument("--split", default="train", help="HF dataset split")
    ld.add_argument("--limit", type=int, default=None, help="stop after this many documents")
    ld.add_argument("--skip-bad", action="store_true", help="skip (and count) malformed records")
    ld.add_argument("--out", required=True, help="output JSONL file")

    sp = sub.add_parser("split", help="freeze (or --check) a leak-cluster-guarded train/eval/never-touch split")
    sp.add_argument("--docs", required=True, help="Document JSONL file")
    sp.add_argument("--out", help="manifest to write (refuses to overwrite without --force)")
    sp.add_argument("--check", help="verify this manifest against --docs instead")
    sp.add_argument("--force", action="store_true", help="replace an existing manifest")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--fractions", default="0.8,0.1,0.1", help="train,eval,never_touch shares")
    sp.add_argument("--threshold", type=float, default=ClusterConfig.threshold)
    sp.add_argument("--num-perm", type=int, default=ClusterConfig.num_perm)
    sp.add_argument("--shingle", type=int, default=ClusterConfig.shingle)
    sp.add_argument("--docs-out", help="also write the documents with their cluster ids filled in")
    return p


COMMANDS: dict[str, Callable] = {"load": _cmd_load, "split": _cmd_split}


def run_command(parser: argparse.ArgumentParser, commands: dict[str, Callable], argv: Sequence[str] | None) -> int:
    """Parse `argv` and run the chosen subcommand's handler. Bad input (a DataError, a
    file that cannot be read) is one line "error: ..." and exit status 1; a leak between
    split pools is exit status 2. Shared by this CLI and `python -m newsworld`."""
    args = parser.parse_args(argv)
    try:
        return commands[args.command](args)
    except (DataError, LeakError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, LeakError) else 1
    except OSError as e:
        print(f"error: {e.filename}: {e.strerror}" if e.filename else f"error: {e}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser(), COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
