"""Teacher episodes for v19's ToolMatch reward and for continued teacher SFT.

    python teacher_episodes.py --config configs/teacher_cnn.yaml        # an OpenAI-compatible endpoint
    python teacher_episodes.py --config configs/teacher_cnn.yaml sampling.backend=hf model.name_or_path=DIR
    python teacher_episodes.py --config configs/teacher_cnn.yaml --shards 4 --gpus 4   # 4 at once, merged

A teacher (a strong model behind an OpenAI-compatible server, e.g. vLLM's or a
hosted API: `sampling.backend=api`; or a local HF model: `hf`) writes one
episode per training document through the same sandbox the policy uses:
its searches are answered from the document and its deletes retract text. Each
episode is appended to `out` as Episode JSON with its `doc_id`, the key rl.py
(`data.teacher`) and sft.py (`mode=teacher`) match documents by.

Resumable: documents whose episode is already in `out` are skipped, and
episodes are appended a chunk at a time, so an interrupted run (or an API
outage after the client's retries) loses at most the chunk in flight. The
documents are the train pool of `data.split` when given (never a held-out
cluster), else all of `data.train`, up to `data.max_docs`.
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

import data
import sandbox
from factual_tools import common, engine, modeling, settings, traces

PRODUCER = "python teacher_episodes.py --config configs/teacher_cnn.yaml"


@dataclass
class TeacherData:
    train: str = "out/cnn/train.jsonl"  # Document JSONL (python data.py load ...)
    split: str = ""  # a split manifest: only its train pool is used
    max_docs: int = 2000  # documents rolled out (the first ones, in file order)


@dataclass
class Config:
    name: str = "teacher"
    runs_dir: str = "runs"
    out: str = "out/teacher/cnn_train.jsonl"
    model: modeling.ModelConfig = field(default_factory=modeling.ModelConfig)  # the hf backend's teacher
    data: TeacherData = field(default_factory=TeacherData)
    sampling: engine.SamplingConfig = field(default_factory=lambda: engine.SamplingConfig(
        backend="api", temperature=0.0, max_new_tokens=512))
    limits: dict[str, int] = field(default_factory=dict)  # sandbox limits (sandbox.Limits names)
    chunk: int = 16  # documents per rollout call (and per append to `out`)
    seed: int = 0
    shard: str = "0/1"  # i/n: the documents whose id hashes to i mod n, written to OUT.shard{i}of{n}.jsonl


def documents(cfg: TeacherData) -> list:
    if not Path(cfg.train).exists():
        raise SystemExit(f"data.train={cfg.train} does not exist: write it with `python data.py load ...` "
                         "(or `python -m newsworld generate ...`)")
    docs = data.read_documents(cfg.train)
    if cfg.split:
        manifest = data.read_manifest(cfg.split)
        docs = data.pool_documents(docs, manifest, "train", cfg.split)
    return docs[:cfg.max_docs] if cfg.max_docs else docs


def done_ids(path: Path) -> set[str]:
    """doc_ids already written; a torn last line (a kill mid-write) is dropped."""
    if not path.exists():
        return set()
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    good, ids = [], set()
    for i, line in enumerate(lines, 1):
        try:
            ids.add(json.loads(line)["doc_id"])
            good.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            if i < len(lines):
                raise SystemExit(f"{path}:{i}: not an episode line; fix or remove it (later lines are kept)")
            print(f"{path}: dropping a torn last line")
    if len(good) < len(lines) or (good and not good[-1].endswith("\n")):
        common.atomic_write_text(str(path), "".join(x if x.endswith("\n") else x + "\n" for x in good))
    return ids


def main(cfg: Config) -> dict:
    si, sn = traces.parse_shard(cfg.shard)
    docs = [d for d in documents(cfg.data) if traces.shard_of(d.id, sn) == si]
    out = Path(traces.shard_path(cfg.out, si, sn))
    out.parent.mkdir(parents=True, exist_ok=True)
    have = done_ids(out)
    todo = [d for d in docs if d.id not in have]
    model = tok = None
    if cfg.sampling.backend in ("hf", "hf_naive", "vllm"):
        model, tok = modeling.load_policy(cfg.model, train=False)
    elif cfg.sampling.backend == "api" and not cfg.sampling.api_model:
        raise SystemExit("sampling.api_model is empty: name the teacher model the endpoint serves")
    limits = sandbox.Limits.make(**cfg.limits)
    print(f"teacher: {len(docs)} documents, {len(docs) - len(todo)} already in {out}; "
          f"backend {cfg.sampling.backend}" + (f" ({cfg.sampling.api_model} at {cfg.sampling.api_base})"
                                               if cfg.sampling.backend == "api" else ""))
    gen = engine.make_generator(cfg.seed, model) if model is not None else None
    written = calls = skipped = 0
    with tqdm(total=len(todo), desc="teacher", unit="doc") as bar:
        for s in range(0, len(todo), max(1, cfg.chunk)):
            chunk = todo[s:s + cfg.chunk]
            if model is not None and cfg.sampling.backend == "vllm":
                eps = engine.rollout_vllm(model.vllm_engine, tok, chunk, 1, cfg.sampling, limits)
            elif model is not None:
                eps = engine.rollout(model, tok, chunk, 1, cfg.sampling, limits, generator=gen)
            else:
                eps = engine.rollout_api(chunk, 1, cfg.sampling, limits)
            failed = [(d, ep) for d, ep in zip(chunk, eps) if ep.meta.get("api_error")]
            if len(chunk) > 1 and len(failed) == len(chunk):  # several documents: the endpoint, not one document
                raise SystemExit(f"teacher: every request of a chunk failed ({failed[0][1].meta['api_error']}); "
                                 f"is {cfg.sampling.api_base} up? {written} episodes written this run, a rerun "
                                 "goes on from there")
            for d, ep in failed:  # not written: the next run asks for this document again
                tqdm.write(f"teacher: {d.id}: {ep.meta['api_error']} (skipped; a rerun asks again)")
            with out.open("a", encoding="utf-8") as f:
                for d, ep in zip(chunk, eps):
                    if ep.meta.get("api_error"):
                        continue
                    ep.doc_id = d.id
                    ep.meta = {**ep.meta, "teacher": cfg.sampling.api_model or cfg.model.name_or_path}
                    f.write(ep.to_json() + "\n")
                f.flush()
                os.fsync(f.fileno())
            written += len(eps) - len(failed)
            skipped += len(failed)
            calls += sum(len(e.calls) for e in eps if not e.meta.get("api_error"))
            bar.update(len(chunk))
    total = len(have) + written
    print(f"teacher: wrote {written} episodes ({calls} tool calls); {total}/{len(docs)} documents covered in {out}"
          + (f"; {skipped} failed (run again to ask for them)" if skipped else ""))
    summary = {"written": written, "covered": total, "documents": len(docs), "failed": skipped}
    if total >= len(docs):  # the pipeline's mark that this stage is complete
        common.atomic_write_text(str(done_path(out)), json.dumps(summary) + "\n")
    return summary


def done_path(out: str | Path) -> Path:
    """Written once every document has its episode: out/teacher/cnn_train.jsonl -> cnn_train.done.json."""
    return Path(out).with_suffix(".done.json")


def run_shards(cfg: Config, argv: list[str], n: int, gpus: int) -> dict:
    """`--shards N`: the N shards at once on this machine, then their merge into `out`
    (complete once every shard is)."""
    res, parts = traces.run_shards(__file__, argv, n, gpus, out=cfg.out, key=lambda rec: rec.get("doc_id"),
                                   what="teacher episode")
    print(f"teacher: {res['traces']} episodes from {n} shards -> {cfg.out}")
    if all(done_path(p).exists() for p in parts):
        common.atomic_write_text(str(done_path(cfg.out)), json.dumps({"covered": res["traces"], "shards": n}) + "\n")
    return res


if __name__ == "__main__":
    with settings.config_errors_exit():
        _argv, _n, _gpus = traces.pop_shards(sys.argv[1:])
        _cfg = settings.load_config(Config, traces.flags_to_keys(_argv))
    if _n > 1:
        run_shards(_cfg, _argv, _n, _gpus)
    else:
        main(_cfg)
