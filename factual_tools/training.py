"""Training pieces shared by sft.py, rl.py and distill.py.

- The branch-exact SFT loss (`sequence_loss`: every generated id once, under the
  context it was generated in; the re-encoded tail after a delete is context only),
  the length-bucketed epoch batches and one optimizer step with accumulation.
- The documents RL and distillation train on (`DocumentData`, `load_documents`): a
  file, its split's pools, or fresh news-world documents guarded against the
  held-out clusters.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

import data
import sandbox
from factual_tools import common, scoring, textsplit, world


@dataclass
class DocumentData:
    train: str = "out/newsworld/docs.jsonl"  # training documents (Document JSONL)
    eval: str = ""  # held-out Document JSONL; "" = the train file's split eval pool (or none)
    split: str = "out/newsworld/split.json"  # leak-cluster manifest (`data.py split`); "" = no split
    generate: int = 0  # when `train` is missing: make this many news-world documents in memory (0 = error)
    world_seed: int = 0  # world seed of generated documents (generated eval documents use world_seed + 1)
    task: str = "short"  # the news world's task of generated and fresh documents: short | long
    # > 0: train on this many freshly generated news-world documents of `fresh_seed`
    # instead of the split's train pool (held-out documents are still its eval pool).
    # The SFT corpus was drafted from the train pool and the policy half-remembers those
    # documents, so RL on them rewards recall that does not carry to new ones. Documents
    # that near-duplicate the split's eval or never-touch pools are skipped.
    fresh: int = 0
    fresh_seed: int = 2
    # > 0: held-out evaluation during training runs on this many fresh news-world documents
    # of `validation_seed` (guarded against the held-out clusters as `fresh` is), not on the
    # split's eval pool: a choice made from it (steps, `eval.keep_best`) leaves that pool a test set.
    validation: int = 0
    validation_seed: int = 3
    max_prompt_tokens: int = 0  # documents whose prompt is longer are skipped (0 = keep all)
    teacher: str = ""  # teacher Episode JSONL for ToolMatch, matched by doc_id (teacher_episodes.py writes it)


def n_generated(ep: sandbox.Episode, mask_retracted: bool = False) -> int:
    """Generated ids of `ep` (less those holding retracted text, with `mask_retracted`)."""
    return sum(len(t.ids) - (len(t.masked or ()) if mask_retracted else 0) for t in ep.turns)


def rewrite_lengths(ep: sandbox.Episode, tokenizer) -> list[int]:
    """Per turn, how many of its leading ids write the sentence that replaces a
    deleted one: in the turn right after a successful delete, the ids up to and
    including the one that ends its first sentence; 0 in every other turn."""
    out = []
    prev = None
    for t in ep.turns:
        n = 0
        if prev is not None and prev.call is not None and prev.call.kind == "delete" and prev.call.deleted and t.ids:
            body = t.text[:t.call.start] if t.call is not None else t.text
            first = textsplit.split_sentences(body)
            if first:
                end = body.find(first[0]) + len(first[0])
                while n < len(t.ids) and len(tokenizer.decode(t.ids[:n])) < end:
                    n += 1
        out.append(n)
        prev = t
    return out


def sequence_loss(model, episodes, n_tokens: int, max_batch_tokens: int = 16384, *, mask_retracted: bool = False,
                  method: str = "tree", rewrite_weight: float = 1.0, tokenizer=None,
                  decision_weight: float = 1.0) -> torch.Tensor:
    """Sum of -log p over every generated token of `episodes`, divided by
    `n_tokens` (the step's token count, so micro-batches add up to a mean).
    With `mask_retracted`, ids holding text a later delete retracted
    (`Turn.masked`) are left out: error-masked SFT, where the wrong sentence
    before a search and delete is context, not a target. With `rewrite_weight`
    w != 1 (needs the `tokenizer`), the ids of each sentence written in place of
    a deleted one (`rewrite_lengths`) count w times; the divisor stays `n_tokens`,
    so every other id's gradient is unchanged. With `decision_weight` d != 1, the
    first id after each answered search (`sandbox.decision_turns`) counts d times, masked or not."""
    if rewrite_weight != 1.0 and tokenizer is None:
        raise ValueError("rewrite_weight needs the tokenizer (to find the rewritten sentence's ids)")
    lps = scoring.episode_logprobs(model, episodes, method=method, max_batch_tokens=max_batch_tokens)
    total = 0.0
    for ep, per_turn in zip(episodes, lps):
        lens = rewrite_lengths(ep, tokenizer) if rewrite_weight != 1.0 else [0] * len(ep.turns)
        decides = sandbox.decision_turns(ep) if decision_weight != 1.0 else [False] * len(ep.turns)
        for t, lp, n_rw, decide in zip(ep.turns, per_turn, lens, decides):
            if lp is None or not lp.numel():
                continue
            if (mask_retracted and t.masked) or n_rw or decide:
                w = torch.ones_like(lp)
                w[:n_rw] = rewrite_weight
                if mask_retracted and t.masked:
                    w[t.masked] = 0.0
                if decide:
                    w[0] = decision_weight
                lp = lp * w
            total = total + lp.sum()
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


class EpochBatches:
    """Micro-batch i of a corpus, as `epoch_batches` orders epoch i // per_epoch.
    The data cursor is the micro-batch index, so a resumed run sees the same data."""

    def __init__(self, items: Sequence, lengths: list[int], batch: int, window: int, seed: int):
        self.items, self.lengths, self.batch, self.window, self.seed = items, lengths, batch, window, seed
        self.per_epoch = math.ceil(len(items) / batch)
        self._epoch: tuple[int, list[list[int]]] | None = None

    def __call__(self, i: int) -> list:
        e, j = divmod(i, self.per_epoch)
        if self._epoch is None or self._epoch[0] != e:
            self._epoch = (e, epoch_batches(len(self.items), self.lengths, self.batch, self.window, self.seed, e))
        return [self.items[k] for k in self._epoch[1][j]]


def optimizer_step(batches: Sequence[list], loss_fn, params, opt, sched, *, max_grad_norm: float,
                   step: int, dist: common.Dist = common.SINGLE) -> tuple[float, dict[str, float], float, float]:
    """One optimizer step over micro-batches (gradient accumulation), as sft.py and
    distill.py take it: `loss_fn(micro_batch) -> (loss, {name: float})`, each loss
    already divided by the step's token count. A non-finite loss aborts before any
    update. Returns (the step's loss, its extra terms summed, the gradient norm
    before clipping, the learning rate it stepped with).

    Data parallel (`dist`): each rank takes its share of every micro-batch, and the
    gradients and figures are summed across ranks before clipping, so with the
    whole step's token count as the divisor every rank steps as one process would."""
    loss_sum, extra = 0.0, {}
    for b in batches:
        b = dist.shard(b)
        if not b:
            continue
        loss, more = loss_fn(b)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step + 1}: loss is {loss.item()} (documents "
                                     f"{[e.doc_id for e in b][:4]}); aborting before the update")
        loss.backward()
        loss_sum += loss.item()
        for k, v in more.items():
            extra[k] = extra.get(k, 0.0) + v
    if dist.world > 1:
        parts = dist.gather((loss_sum, extra))
        loss_sum = sum(x for x, _ in parts)
        extra = {k: sum(e.get(k, 0.0) for _, e in parts) for k in dict.fromkeys(k for _, e in parts for k in e)}
    lr = sched.get_last_lr()[0]
    norm = apply_gradients(params, opt, max_grad_norm=max_grad_norm, step=step, dist=dist)
    sched.step()
    return loss_sum, extra, norm, lr


def apply_gradients(params, opt, *, max_grad_norm: float, step: int, dist: common.Dist = common.SINGLE) -> float:
    """The optimizer step every trainer takes after its backward passes (rl.update, optimizer_step):
    the gradients summed across ranks, clipped to `max_grad_norm`, applied and cleared. A non-finite
    norm aborts before the update. Returns the norm before clipping."""
    dist.reduce_grads(params)  # every rank now holds the whole step's gradient
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    if not torch.isfinite(norm):
        raise FloatingPointError(f"step {step + 1}: gradient norm is {norm.item()}; aborting before the update")
    opt.step()
    opt.zero_grad(set_to_none=True)
    return norm.item()


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


def load_documents(cfg: DocumentData) -> tuple[list, list, str]:
    """(train, eval, how they were obtained); generated and fresh documents are the world's."""
    path = Path(cfg.train)
    if path.exists():
        docs, how = data.read_documents(cfg.train), f"{cfg.train}"
    elif cfg.generate:
        docs = list(world.world("data.generate").documents(cfg.generate, seed=cfg.world_seed, task=cfg.task))
        how = f"{cfg.train} missing: {cfg.generate} news-world documents generated in memory (seed {cfg.world_seed})"
    else:
        raise SystemExit(f"data.train={cfg.train}: no such file (write one with `python -m newsworld generate "
                         f"--n 1000 --seed 0 --out {cfg.train}`, or set data.generate=N)")
    held = data.read_documents(cfg.eval) if cfg.eval else None
    if cfg.split and Path(cfg.split).exists():
        try:  # the split's pools, each document checked against the content hash the split froze
            manifest = data.read_manifest(cfg.split)
            train = data.pool_documents(docs, manifest, "train", cfg.split)
            held = data.pool_documents(held if held is not None else docs, manifest, "eval", cfg.split)
        except (data.DataError, data.LeakError) as e:
            raise SystemExit(f"error: {e}") from None
        if docs and not train:
            raise SystemExit(f"no document of {cfg.train} is in the train pool of {cfg.split}: "
                             "a split of other documents? (data.split='' uses them all)")
        how += f", split {cfg.split}"
        if cfg.validation and cfg.fresh and cfg.validation_seed == cfg.fresh_seed:
            raise SystemExit(f"data.validation_seed={cfg.validation_seed} is data.fresh_seed: validation documents "
                             "would be training documents")
        if cfg.validation:
            held, skipped = world.world("data.validation").fresh_documents(
                cfg.validation, cfg.validation_seed, data.held_out_guard(docs, manifest, cfg.split), cfg.task)
            how += (f"; held-out: {len(held)} fresh validation documents (world seed {cfg.validation_seed}; "
                    f"{len(skipped)} near-duplicates of held-out clusters skipped), not the eval pool")
        if cfg.fresh:
            train, skipped = world.world("data.fresh").fresh_documents(
                cfg.fresh, cfg.fresh_seed, data.held_out_guard(docs, manifest, cfg.split), cfg.task)
            how += (f"; training on {len(train)} fresh news-world documents (world seed {cfg.fresh_seed}; "
                    f"{len(skipped)} near-duplicates of held-out clusters skipped)")
    elif cfg.fresh or cfg.validation:
        raise SystemExit(f"data.{'fresh' if cfg.fresh else 'validation'} needs a split (data.split): its eval and "
                         "never-touch pools are what the fresh documents must not duplicate")
    else:
        train = docs
        if held is None and not path.exists():
            n_held = max(1, cfg.generate // 10)
            held = list(world.world("data.generate").documents(n_held, seed=cfg.world_seed + 1, task=cfg.task))
    return train, held or [], how
