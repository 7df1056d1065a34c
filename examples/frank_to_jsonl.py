"""Convert FRANK's CNN/DailyMail articles and their reference highlights into Document JSONL.

    git clone https://github.com/artidoro/frank ../frank        # FRANK (MIT licence), with its history
    python examples/frank_to_jsonl.py ../frank --out out/frank/cnndm.jsonl
    python eval.py --config configs/eval_smollm.yaml docs=out/frank/cnndm.jsonl split="" ...

FRANK (Pagnoni et al. 2021) annotated system summaries of 250 CNN/DM test articles (and of
XSum ones, left out here). Its labels (data/human_annotations.json) name the articles by
hash; the articles themselves were removed from the repository's later commits and are read
from an earlier one (FRANK_ARTICLES_COMMIT). Each article becomes one document with the
CNN/DM reference highlights as its summary and no fact table, so eval.py reports the figures
that need none (the evaluation module's `oracle_free_metrics`). The reference is stored
PTB-tokenised ("Locke 's first six games ."); it is joined back here.

One JSON object per line, the fields of data.py's Document: id, text, summary, source,
bucket, meta (FRANK's split, the article's URL). The output is data for measurement; it
stays out of the repository (out/ is ignored).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

FRANK_ARTICLES_COMMIT = "6308064d4b42b5e613add40bad0c425675dea01b"  # the last with the articles
FRANK_ARTICLES_DIR = "data/articles-wbertscore-json"
FRANK_LABELS = "data/human_annotations.json"
REFERENCE = "bart_reference"  # the CNN/DM highlights as cased text (the other *_reference fields are lower-cased)
SPLITS = {"valid": "dev", "test": "test"}


def detokenize(text: str) -> str:
    """Undo PTB-style tokenisation: "it 's a `` test '' -lrb- really -rrb- ." -> "it's a "test" (really)."."""
    t = re.sub(r"-lrb-", "(", text, flags=re.I)
    t = re.sub(r"-rrb-", ")", t, flags=re.I).replace("``", '"').replace("''", '"')
    t = re.sub(r"\s+(['’](?:s|re|ve|ll|d|m)\b|n['’]t\b)", r"\1", t, flags=re.I)
    t = re.sub(r"\s+([.,;:!?%)\]])", r"\1", t)
    t = re.sub(r"([(\[$£€])\s+", r"\1", t)
    t = re.sub(r'"\s+(.*?)\s+"', r'"\1"', t)
    return re.sub(r"\s+", " ", t).strip()


def git(repo: Path, *args: str, stdin: bytes | None = None) -> bytes:
    try:
        res = subprocess.run(["git", "-C", str(repo), *args], input=stdin, capture_output=True)
    except FileNotFoundError:
        raise SystemExit("git is needed on PATH") from None
    if res.returncode:
        raise SystemExit(f"git {' '.join(args[:2])} in {repo} failed: {res.stderr.decode().strip()[-300:]}\n"
                         "is it a full clone of https://github.com/artidoro/frank (with its history)?")
    return res.stdout


def read_articles(repo: Path, hashes: list[str], commit: str) -> dict[str, dict]:
    """The article records of `hashes` at `commit`, in one `git cat-file --batch`."""
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


def documents(repo: Path, commit: str = FRANK_ARTICLES_COMMIT) -> list[dict]:
    """One record per unique CNN/DM article FRANK labels, sorted by hash."""
    labels = json.loads(git(repo, "show", f"HEAD:{FRANK_LABELS}"))
    split = {r["hash"]: SPLITS.get(r["split"], r["split"]) for r in labels if r["dataset"] == "cnndm"}
    hashes = sorted(split)
    out = []
    for h, art in read_articles(repo, hashes, commit).items():
        text, ref = art.get("article", "").strip(), detokenize(art.get(REFERENCE, ""))
        if not text or not ref:
            raise SystemExit(f"{repo}: article {h} has no text or no {REFERENCE!r} at {commit[:10]}")
        out.append({"id": f"frank-cnndm-{h}", "text": text, "summary": ref, "source": "frank/cnndm",
                    "bucket": "cnndm", "meta": {"frank_split": split[h], "url": art.get("url", "")}})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("repo", help="a clone of https://github.com/artidoro/frank with its history (a bare one will do)")
    ap.add_argument("--out", default="out/frank/cnndm.jsonl", help="the Document JSONL to write")
    ap.add_argument("--commit", default=FRANK_ARTICLES_COMMIT, help="the commit that holds the articles")
    args = ap.parse_args(argv)
    docs = documents(Path(args.repo), args.commit)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    tmp.replace(out)
    words = [len(d["text"].split()) for d in docs]
    ref = [len(d["summary"].split()) for d in docs]
    print(f"wrote {len(docs)} CNN/DM articles to {out}: {sum(words) / len(words):.1f} words each on average "
          f"(min {min(words)}, max {max(words)}), references {sum(ref) / len(ref):.1f} words")


if __name__ == "__main__":
    sys.exit(main())
