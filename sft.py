"""Deletion-aware SFT on tool-use traces; rejection-sampled re-SFT; continued teacher SFT.

    python sft.py --config configs/sft_tiny.yaml          # CPU: a tiny model from scratch, minutes
    python sft.py --config configs/sft_qwen3_4b.yaml      # one GPU: LoRA on a 4-bit base (Unsloth if asked)
    python sft.py --config configs/sft_tiny.yaml mode=rejection init=runs/sft_tiny/final

Every episode is trained as its branches (DESIGN.md section 4): the loss covers
exactly the generated ids, each once, under the context it was generated in;
prompt, results and the re-encoded tail after a delete are context only. A
whole episode is scored in one pass over its tree of branches
(`rollout.episode_logprobs`), which is also what RL and distillation use, so
SFT learns exactly the conditionals that rollouts sample.

Modes (the SN15 paper's recipe):
- `sft`: the trace corpus (`data.train`).
- `rejection`: sample `rejection.k` rollouts per training document with the
  current policy, keep those that pass the reward's gate, mix them with the
  base corpus so they make `rejection.mix_ratio` of it, and train on the mix.
- `teacher`: continued SFT on teacher episodes (e.g. from the `api` backend of
  `rollout.py`), starting from `init`.
Before the first step a sample of episodes goes through mask validation
(`sandbox.check_branches`). Every `eval.every` steps: loss on the eval
episodes; every `eval.sample_every` steps and at the end: greedy rollouts on
held-out documents, reporting the share of well-formed tool calls and the final
summaries' factuality. Checkpoints follow DESIGN.md section 7 (`resume=auto`).

Departures: the loss is the mean over generated tokens of a step (the usual
SFT normalisation), not per sequence; episodes longer than `data.max_tokens`
are skipped and counted, never cut (a cut would train a dangling tool call).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tqdm import tqdm

import common
import rewards
import rollout
import sandbox


@dataclass
class DataConfig:
    train: str = "out/corpus/newsworld/train.jsonl"  # Episode JSONL (filter_traces.py output)
    eval: str = "out/corpus/newsworld/eval.jsonl"  # held-out episodes: eval loss, and their documents for sampling
    docs: str = ""  # Document JSONL with fact tables (needed for the oracle factuality backend)
    max_tokens: int = 2048  # longest branch allowed (prompt included); longer episodes are skipped
    limit: int = 0  # use only the first N training episodes (0 = all)


@dataclass
class EvalConfig:
    every: int = 50  # optimizer steps between eval-loss passes (0 = only at the end)
    sample_every: int = 0  # steps between sampled held-out generations (0 = only at the end)
    n_docs: int = 32  # held-out documents sampled
    max_new_tokens: int = 160


@dataclass
class RejectionConfig:
    k: int = 4  # rollouts per training document
    mix_ratio: float = 0.5  # share of passing rollouts in the re-SFT corpus
    max_docs: int = 256  # training documents sampled from
    temperature: float = 1.0


@dataclass
class Config:
    name: str = "sft"  # run name: outputs go to runs_dir/name
    runs_dir: str = "runs"
    mode: Literal["sft", "rejection", "teacher"] = "sft"
    init: str = ""  # start from this directory (a previous run's final/): weights, or an adapter
    model: common.ModelConfig = field(default_factory=common.ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rejection: RejectionConfig = field(default_factory=RejectionConfig)
    reward: rewards.RewardConfig = field(default_factory=rewards.RewardConfig)
    limits: dict[str, int] = field(default_factory=dict)  # sandbox limits for sampling (sandbox.Limits names)
    epochs: float = 3.0
    batch_episodes: int = 16  # episodes per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # the cosine schedule ends at lr * min_lr_ratio
    warmup_steps: int = 30
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_batch_tokens: int = 16384  # tokens per forward pass inside a micro-batch
    bucket_window: int = 8  # micro-batches sorted by length together (length bucketing)
    save_every: int = 100  # optimizer steps between checkpoints
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto | none | a checkpoint path
    mask_check: int = 64  # episodes validated before the first step
    seed: int = 0


# ---------------------------------------------------------------------------
# Pure pieces (tests import these)
# ---------------------------------------------------------------------------


def n_generated(ep: sandbox.Episode) -> int:
    return sum(len(t.ids) for t in ep.turns)


def sequence_loss(model, episodes, n_tokens: int, max_batch_tokens: int = 16384) -> torch.Tensor:
    """Sum of -log p over every generated token of `episodes`, divided by
    `n_tokens` (the step's token count, so micro-batches add up to a mean)."""
    lps = rollout.episode_logprobs(model, episodes, method="tree", max_batch_tokens=max_batch_tokens)
    total = sum(t.sum() for ep in lps for t in ep if t is not None and t.numel())
    return -total / max(1, n_tokens)


def epoch_batches(n_items: int, lengths: list[int], batch: int, window: int, seed: int, epoch: int) -> list[list[int]]:
    """Micro-batches of indices for one epoch: a seeded shuffle, then length
    bucketing inside windows of `window` batches (less padding, still mixed),
    then the batches shuffled again."""
    rng = random.Random(f"{seed}:{epoch}")
    order = list(range(n_items))
    rng.shuffle(order)
    out = []
    span = batch * max(1, window)
    for s in range(0, n_items, span):
        chunk = sorted(order[s:s + span], key=lambda i: lengths[i])
        out += [chunk[j:j + batch] for j in range(0, len(chunk), batch)]
    rng.shuffle(out)
    return out


def tokenize_episodes(episodes, tokenizer, max_tokens: int) -> tuple[list[sandbox.Episode], int]:
    """Canonical token ids for every episode; those with a branch longer than
    `max_tokens` are dropped and counted."""
    kept, skipped = [], 0
    for ep in episodes:
        t = ep.tokenized(tokenizer)
        if max(len(b.input_ids) for b in t.branches()) > max_tokens:
            skipped += 1
            continue
        kept.append(t)
    return kept, skipped


def validate_masks(episodes, tokenizer, n: int, seed: int = 0) -> int:
    """Mask validation on a seeded sample; returns how many were checked."""
    rng = random.Random(seed)
    sample = rng.sample(episodes, min(n, len(episodes)))
    eos = rollout.stop_ids(tokenizer)
    for ep in sample:
        sandbox.check_branches(ep, ep.branches(), tokenizer, eos)
    return len(sample)


@torch.no_grad()
def eval_loss(model, episodes, max_batch_tokens: int, batch: int = 16) -> float:
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(episodes), batch):
        chunk = episodes[s:s + batch]
        k = sum(n_generated(e) for e in chunk)
        total += sequence_loss(model, chunk, k, max_batch_tokens).item() * k
        n += k
    model.train(was)
    return total / max(1, n)


def held_out_documents(episodes, docs_path: str, n: int) -> list:
    """The documents behind held-out episodes (Document records when a docs
    file is given, so the oracle can grade), first `n` distinct ones."""
    by_id = {}
    if docs_path:
        import data

        by_id = {d.id: d for d in data.read_documents(docs_path)}
    seen, out = set(), []
    for ep in episodes:
        key = ep.doc_id or ep.document
        if key in seen:
            continue
        seen.add(key)
        out.append(by_id.get(ep.doc_id) or _Doc(ep.doc_id, ep.document))
        if len(out) == n:
            break
    return out


@dataclass
class _Doc:
    id: str | None
    text: str


def sample_eval(model, tokenizer, documents, reward_cfg, limits: sandbox.Limits, max_new_tokens: int,
                seed: int = 0) -> dict:
    """Greedy rollouts on held-out documents: tool-call validity, tool use, and
    the reward's factuality of the final summaries."""
    if not documents:
        return {}
    cfg = rollout.SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens, seed=seed)
    eps = rollout.rollout(model, tokenizer, documents, 1, cfg, limits)
    scores = rewards.score_batch(list(zip(documents, eps)), reward_cfg)
    out = {f"sample_{k}": v for k, v in sandbox.tool_stats(eps).items()}
    out["sample_factuality"] = sum(s["factuality"] for s in scores) / len(scores)
    out["sample_pass"] = sum(bool(s["pass"]) for s in scores) / len(scores)
    out["sample_len_words"] = sum(len(e.summary.split()) for e in eps) / len(eps)
    return out


def rejection_corpus(model, tokenizer, base, cfg: Config, limits, generator) -> list[sandbox.Episode]:
    """Rollouts of the current policy that pass the reward, mixed with the base
    corpus so they are `mix_ratio` of the result."""
    docs = held_out_documents(base, cfg.data.docs, cfg.rejection.max_docs)
    scfg = rollout.SamplingConfig(temperature=cfg.rejection.temperature, max_new_tokens=cfg.eval.max_new_tokens,
                                  seed=cfg.seed)
    eps = rollout.rollout(model, tokenizer, docs, cfg.rejection.k, scfg, limits, generator=generator)
    docs_rep = [d for d in docs for _ in range(cfg.rejection.k)]
    scores = rewards.score_batch(list(zip(docs_rep, eps)), cfg.reward)
    passed = [e for e, s in zip(eps, scores) if s["pass"] and e.valid]
    ratio = cfg.rejection.mix_ratio
    n_base = len(base) if ratio <= 0 else min(len(base), round(len(passed) * (1 - ratio) / max(ratio, 1e-9)))
    rng = random.Random(cfg.seed)
    mixed = passed + rng.sample(base, n_base)
    print(f"rejection: {len(passed)}/{len(eps)} rollouts passed; corpus {len(passed)} + {n_base} base episodes")
    if not passed:
        print("rejection: no rollout passed; training on the base corpus alone")
        return base
    return mixed


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def load_model(cfg: Config):
    mcfg = cfg.model
    if cfg.init:
        init = Path(cfg.init)
        if (init / "adapter_config.json").exists():
            mcfg = dataclasses.replace(mcfg, adapter_path=str(init))
        else:
            mcfg = dataclasses.replace(mcfg, name_or_path=str(init))
    return common.load_policy(mcfg, train=True)


def main(cfg: Config) -> dict:
    run = common.start_run(cfg)
    common.seed_everything(cfg.seed)
    model, tok = load_model(cfg)
    limits = sandbox.Limits.make(**cfg.limits)
    gen = torch.Generator().manual_seed(cfg.seed)

    raw = sandbox.read_episodes(cfg.data.train)
    if cfg.data.limit:
        raw = raw[:cfg.data.limit]
    if not raw:
        raise SystemExit(f"{cfg.data.train}: no training episodes")
    train, skipped = tokenize_episodes(raw, tok, cfg.data.max_tokens)
    held = sandbox.read_episodes(cfg.data.eval) if cfg.data.eval and Path(cfg.data.eval).exists() else []
    held_eps, _ = tokenize_episodes(held, tok, cfg.data.max_tokens)
    docs = held_out_documents(held, cfg.data.docs, cfg.eval.n_docs)
    print(f"data: {len(train)} training episodes ({skipped} over {cfg.data.max_tokens} tokens skipped), "
          f"{len(held_eps)} eval episodes, {len(docs)} held-out documents")
    if cfg.mode == "rejection":
        train, _ = tokenize_episodes(rejection_corpus(model, tok, train, cfg, limits, gen), tok, cfg.data.max_tokens)
    checked = validate_masks(train, tok, cfg.mask_check, cfg.seed)
    print(f"mask validation: {checked} episodes, every trained position is assistant text")

    lengths = [max(len(b.input_ids) for b in e.branches()) for e in train]
    per_epoch = math.ceil(len(train) / cfg.batch_episodes)
    total_micro = max(1, round(cfg.epochs * per_epoch))
    total_steps = max(1, total_micro // cfg.grad_accum)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = common.cosine_schedule(opt, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    step = 0
    ckpt = common.resolve_resume(cfg.resume, run.dir)
    if ckpt is not None:
        step = common.load_checkpoint(ckpt, model, opt, sched, generators={"sample": gen})["step"]
        print(f"resumed from {ckpt} at step {step}")

    epochs: dict[int, list[list[int]]] = {}

    def micro_batch(i: int) -> list[sandbox.Episode]:
        e, j = divmod(i, per_epoch)
        if e not in epochs:
            epochs.clear()
            epochs[e] = epoch_batches(len(train), lengths, cfg.batch_episodes, cfg.bucket_window, cfg.seed, e)
        return [train[k] for k in epochs[e][j]]

    model.train()
    history: dict = {}
    bar = tqdm(total=total_steps, initial=step, desc="sft", dynamic_ncols=True)
    t_last, tok_count = time.perf_counter(), 0
    while step < total_steps:
        if cfg.eval.every and step % cfg.eval.every == 0 and held_eps:
            history = _log_eval(run, step, model, tok, held_eps, docs, cfg, limits, sample=False)
        batches = [micro_batch(step * cfg.grad_accum + a) for a in range(cfg.grad_accum)]
        n_tok = sum(n_generated(e) for b in batches for e in b)
        loss_value = 0.0
        for b in batches:
            loss = sequence_loss(model, b, n_tok, cfg.max_batch_tokens)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"step {step}: loss is {loss.item()} (episodes {[e.doc_id for e in b][:4]})")
            loss.backward()
            loss_value += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tok_count += n_tok
        bar.update(1)
        dt = time.perf_counter() - t_last
        if step % 10 == 0 or step == total_steps:
            run.log(step, total_steps, {"loss": loss_value, "lr": sched.get_last_lr()[0], "grad_norm": norm.item(),
                                        "tok_s": tok_count / dt}, dt)
            t_last, tok_count = time.perf_counter(), 0
        if cfg.eval.sample_every and step % cfg.eval.sample_every == 0 and step < total_steps:
            _log_eval(run, step, model, tok, held_eps, docs, cfg, limits, sample=True)
        if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
            common.save_checkpoint(run.dir, step, model, opt, sched, generators={"sample": gen},
                                   keep=cfg.keep_checkpoints)
    bar.close()
    common.save_checkpoint(run.dir, step, model, opt, sched, generators={"sample": gen}, keep=cfg.keep_checkpoints)
    final = run.dir / "final"
    with common.atomic_dir(final) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    history = _log_eval(run, step, model, tok, held_eps, docs, cfg, limits, sample=True)
    print("final: " + " | ".join(f"{k} {v:.4g}" for k, v in history.items() if isinstance(v, float)))
    print(f"model saved to {final}")
    return history


def _log_eval(run, step, model, tok, held_eps, docs, cfg, limits, sample: bool) -> dict:
    out = {}
    if held_eps:
        out["eval_loss"] = eval_loss(model, held_eps, cfg.max_batch_tokens)
    if sample:
        out.update(sample_eval(model, tok, docs, cfg.reward, limits, cfg.eval.max_new_tokens, cfg.seed))
        model.train()
    if out:
        run.metrics.write(step=step, **out)
        print(f"eval step {step}: " + " | ".join(f"{k} {v:.4g}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main(common.load_config(Config))
