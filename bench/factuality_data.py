"""Human-labelled factuality data for bench/factuality.py: the record format, a
loader that names the bad line, and the FRANK converter.

A record (one JSON object per line):
    {"id": "frank/<hash>/<system>", "source": "cnndm" | "xsum", "split": "dev" | "test",
     "doc_id": "<hash>", "system": "<summariser>", "document": "...", "summary": "...",
     "human": 0.0-1.0,      # the annotators' score (FRANK: share of sentences without an error)
     "label": 0 | 1}        # 1 = factually consistent (human == 1), 0 = at least one error

FRANK (Pagnoni et al. 2021, github.com/artidoro/frank, MIT licence) labels 2,246
system summaries of 499 CNN/DailyMail and XSum test articles, split by article
into validation (149 articles) and test (350). The labels are in
data/human_annotations.json; the articles and summaries were removed from the
repository's later commits and are read from an earlier one:

    git clone https://github.com/artidoro/frank ../frank
    python bench/factuality.py --convert-frank ../frank --out out/factuality/frank.jsonl
    python bench/factuality.py --data out/factuality/frank.jsonl

The CNN/DM systems' outputs are lower-cased and tokenised ("kilmarnock 's
manager ."); the converter joins the tokenisation back ("kilmarnock's manager.")
and keeps the case as the systems wrote it: a scorer must cope with both.
"""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

# The last commit of artidoro/frank that holds the articles with every system's summary.
FRANK_ARTICLES_COMMIT = "6308064d4b42b5e613add40bad0c425675dea01b"
FRANK_ARTICLES_DIR = "data/articles-wbertscore-json"
FRANK_LABELS = "data/human_annotations.json"
SOURCES = {"cnndm": "cnndm", "bbc": "xsum"}
SPLITS = {"valid": "dev", "test": "test"}
FIELDS = ("id", "source", "split", "doc_id", "system", "document", "summary", "human", "label")


def detokenize(text: str) -> str:
    """Undo PTB-style tokenisation: "it 's a `` test '' ( really ) ." -> "it's a "test" (really)."."""
    t = text.replace("-lrb-", "(").replace("-rrb-", ")").replace("``", '"').replace("''", '"')
    t = re.sub(r"\s+(['’](?:s|re|ve|ll|d|m)\b|n['’]t\b)", r"\1", t)
    t = re.sub(r"\s+([.,;:!?%)\]])", r"\1", t)
    t = re.sub(r"([(\[$])\s+", r"\1", t)
    t = re.sub(r'"\s+(.*?)\s+"', r'"\1"', t)
    return re.sub(r"\s+", " ", t).strip()


def git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    """`git -C repo ARGS` with `stdin`: its stdout, or an exit naming what failed."""
    try:
        res = subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True)
    except FileNotFoundError:
        raise SystemExit("reading FRANK needs git on PATH") from None
    if res.returncode:
        raise SystemExit(f"git {' '.join(args[:2])} in {repo} failed: {res.stderr.decode().strip()[-300:]}\n"
                         "is it a full clone of https://github.com/artidoro/frank (with its history)?")
    return res.stdout


def read_articles(repo: Path, hashes: list[str], commit: str = FRANK_ARTICLES_COMMIT) -> dict[str, dict]:
    """FRANK's article records of `hashes` at `commit`, in one `git cat-file --batch`."""
    spec = "".join(f"{commit}:{FRANK_ARTICLES_DIR}/{h}.json\n" for h in hashes).encode()
    raw = git(repo, "cat-file", "--batch", stdin=spec)
    out, pos = {}, 0
    for h in hashes:
        end = raw.index(b"\n", pos)
        header = raw[pos:end].decode().split()
        if header[-1] == "missing":
            raise SystemExit(f"{repo}: {FRANK_ARTICLES_DIR}/{h}.json is missing at {commit[:10]} "
                             "(a shallow clone lacks it: clone without --depth)")
        size = int(header[2])
        out[h] = json.loads(raw[end + 1:end + 1 + size])
        pos = end + 1 + size + 1
    return out


def convert_frank(repo: str | Path, articles_commit: str = FRANK_ARTICLES_COMMIT) -> list[dict]:
    """Records from a clone of artidoro/frank (labels at HEAD, articles at `articles_commit`)."""
    repo = Path(repo)
    labels = json.loads(git(repo, "show", f"HEAD:{FRANK_LABELS}"))
    articles = read_articles(repo, sorted({r["hash"] for r in labels}), articles_commit)
    out = []
    for r in labels:
        art, system = articles[r["hash"]], r["model_name"]
        if system not in art:
            raise SystemExit(f"{repo}: article {r['hash']} has no summary by {system!r}")
        human = float(r["Factuality"])
        out.append({"id": f"frank/{r['hash']}/{system}", "source": SOURCES[r["dataset"]],
                    "split": SPLITS[r["split"]], "doc_id": r["hash"], "system": system,
                    "document": art["article"].strip(), "summary": detokenize(art[system]),
                    "human": human, "label": int(human >= 1.0)})
    out.sort(key=lambda x: x["id"])
    return out


def load(path: str | Path) -> list[dict]:
    """Records from a JSONL file; a bad line raises naming the file, line and field."""
    path = Path(path)
    if not path.exists():
        raise SystemExit(f"{path}: no such file (see `python bench/factuality.py --help` for the FRANK fetch)")
    import data  # the project's JSONL reader: bad UTF-8 or JSON raise naming the file and line

    out = []
    try:
        for i, r in data.jsonl_records(str(path)):
            missing = [k for k in FIELDS if k not in r]
            if missing:
                raise SystemExit(f"{path}:{i}: missing field(s) {', '.join(missing)}")
            if r["split"] not in ("dev", "test"):
                raise SystemExit(f"{path}:{i}: split must be 'dev' or 'test', got {r['split']!r}")
            if r["label"] not in (0, 1):
                raise SystemExit(f"{path}:{i}: label must be 0 or 1, got {r['label']!r}")
            if not isinstance(r["document"], str) or not isinstance(r["summary"], str):
                raise SystemExit(f"{path}:{i}: document and summary must be strings")
            try:
                r["human"] = float(r["human"])
            except (TypeError, ValueError):
                raise SystemExit(f"{path}:{i}: human must be a number, got {r['human']!r}") from None
            out.append(r)
    except data.DataError as e:
        raise SystemExit(str(e)) from None
    if not out:
        raise SystemExit(f"{path}: no records")
    return out


def write(records: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({k: r[k] for k in FIELDS}, ensure_ascii=False) + "\n")
    tmp.replace(path)
