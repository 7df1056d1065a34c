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
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))
from factuality_data import FRANK_ARTICLES_COMMIT, FRANK_LABELS, SPLITS, git, read_articles  # noqa: E402

REFERENCE = "bart_reference"  # the CNN/DM highlights as cased text (the other *_reference fields are lower-cased)


def detokenize(text: str) -> str:
    """Undo PTB-style tokenisation: "it 's a `` test '' -lrb- really -rrb- ." -> "it's a "test" (really)."."
    The references are cased, so unlike bench/factuality_data.detokenize (lower-cased system
    outputs) it also reads -LRB-, N'T and a space after a pound or euro sign."""
    t = re.sub(r"-lrb-", "(", text, flags=re.I)
    t = re.sub(r"-rrb-", ")", t, flags=re.I).replace("``", '"').replace("''", '"')
    t = re.sub(r"\s+(['’](?:s|re|ve|ll|d|m)\b|n['’]t\b)", r"\1", t, flags=re.I)
    t = re.sub(r"\s+([.,;:!?%)\]])", r"\1", t)
    t = re.sub(r"([(\[$£€])\s+", r"\1", t)
    t = re.sub(r'"\s+(.*?)\s+"', r'"\1"', t)
    return re.sub(r"\s+", " ", t).strip()


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
