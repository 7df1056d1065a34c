"""Distil a trained tool-using policy into a smaller, faster summariser.

    python distill.py --config configs/distill_tiny.yaml      # CPU: the tiny RL policy -> a 0.3M student, ~2 min
    python distill.py --config configs/distill_tiny.yaml teacher=runs/sft_tiny/final name=distill_sft
    python distill.py --config configs/distill_tiny.yaml target=both kd.weight=0   # CE only

1. The teacher (a trained directory, `modeling.trained_model_config`) writes `generate.samples_per_doc`
   episodes per training document with the sandbox in the loop, cached in the run directory;
   `generate.filter` keeps the clean ones, optionally only those that pass the reward or reach
   `generate.min_factuality`.
2. Targets (`target`): `summary` (the final summary alone, the tool trace hidden), `episode` (the
   teacher's episodes, trained as their branches like SFT, DESIGN.md section 4) or `both`.
3. The student learns them with cross-entropy on every generated token, plus token-level KD when it
   shares the teacher's vocabulary: loss = (1 - w) CE + w T^2 KL(p_T || q_T); otherwise CE only.
   With `kd.prompt` the KL covers every position of the prompt too (the document; its mean over
   those positions): a student pruned from the teacher (`keep_every`) relearns to read the article
   from about 9x the positions the summaries alone hold.
4. `compare`: teacher and student through `eval.evaluate` on the same held-out documents. The target
   on the news world: >= 3x faster at p50, factuality within 2 points.
Outputs in runs/NAME/: config.yaml, metrics.jsonl, teacher_episodes.jsonl, checkpoints (`resume=auto`
as in sft.py), final/ (the student's weights and tokenizer) and distill.json (the comparison).

Departures from the usual recipe (Hinton et al. 2015; MiniLLM/GKD use the student's own samples):
- The KL is on the teacher's sequences: sequence-level KD plus token-level KD on the same tokens.
- For the `summary` target the teacher is scored on the summary-only context, one it did not write in;
  its distribution there is still a soft target for the same tokens.
- The loss is the mean over the step's generated tokens (sft.py's normalisation), KD included.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

import rewards
import sandbox
from factual_tools import common, engine, evaluation, modeling, scoring, settings, training


@dataclass
class DistillData:
    docs: str = "out/newsworld/docs.jsonl"  # Document JSONL (fact tables for the oracle)
    split: str = "out/newsworld/split.json"  # leak-cluster manifest: train pool generates, eval pool evaluates
    max_train_docs: int = 256  # training documents the teacher writes for (0 = the whole train pool)
    max_tokens: int = 2048  # longest branch (prompt included); longer targets are skipped and counted


@dataclass
class GenerateConfig:
    temperature: float = 1.0  # teacher sampling temperature (0 = greedy)
    samples_per_doc: int = 2  # teacher episodes per training document
    max_new_tokens: int = 160  # generated tokens per episode, all turns together
    batch_size: int = 32  # rows decoded together
    # clean: valid tool use, not truncated, non-empty summary; pass / factuality: clean and
    # the reward passes / factuality >= min_factuality (scored with `reward`); none: non-empty summary
    filter: Literal["none", "clean", "pass", "factuality"] = "clean"
    min_factuality: float = 0.5


@dataclass
class KDConfig:
    weight: float = 0.5  # w in (1 - w) CE + w T^2 KL; 0 = cross-entropy only
    temperature: float = 2.0  # T, applied to both teacher and student logits
    # KD also on every position of the prompt (the document the student reads), not only on the
    # generated ids: a pruned student relearns to read and copy from the article, from about 9x
    # the positions its summaries alone hold. The KL is then the mean over all those positions.
    prompt: bool = False


@dataclass
class DistillEval:
    n_docs: int = 32  # held-out documents (eval pool of the split) for the comparison; 0 = none
    latency_docs: int = 16  # of those, timed one at a time (batch 1)
    n_samples: int = 1  # sampled rollouts per document (eval.py's pass@k; 1 keeps it cheap)
    max_new_tokens: int = 160
    factuality: rewards.Backend = "oracle"  # backend of the reported factuality

    def __post_init__(self):
        rewards.check_backend(self.factuality, "eval.factuality")


@dataclass
class Config:
    name: str = "distill"  # run name: outputs go to runs_dir/name
    runs_dir: str = "runs"
    teacher: str = "runs/rl_tiny/final"  # a trained directory: full weights or a PEFT adapter
    # the student: a tiny preset (built from scratch over the teacher's tokenizer), an HF id or a path
    student: modeling.ModelConfig = field(default_factory=lambda: modeling.ModelConfig(
        name_or_path="tiny-0.3m", lora=modeling.LoraConfig(enabled=False)))
    # > 1: the student is the teacher itself (its adapter merged) with ceil(layers / keep_every)
    # of its decoder layers kept (2: half, 1.5: two in three), evenly spaced, first and last
    # included; its weights start as the teacher's (student.name_or_path is then unused)
    keep_every: float = 0
    log: common.LogConfig = field(default_factory=common.LogConfig)  # TensorBoard / W&B besides metrics.jsonl
    target: Literal["summary", "episode", "both"] = "summary"
    data: DistillData = field(default_factory=DistillData)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    kd: KDConfig = field(default_factory=KDConfig)
    eval: DistillEval = field(default_factory=DistillEval)
    reward: rewards.RewardConfig = field(default_factory=rewards.RewardConfig)  # for generate.filter
    limits: dict[str, int] = field(default_factory=dict)  # sandbox limits (sandbox.Limits names)
    steps: int = 300  # optimizer steps
    batch_episodes: int = 16  # episodes per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine schedule ends at lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_batch_tokens: int = 16384  # tokens per forward pass inside a micro-batch
    bucket_window: int = 8  # micro-batches sorted by length together
    log_every: int = 10  # steps between step lines
    save_every: int = 100  # steps between checkpoints
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto | none | a checkpoint path
    mask_check: int = 64  # targets validated before the first step
    seed: int = 0
    torch_threads: int = 0  # CPU threads for torch (0 = its default)
    # bf16 autocast of training, teacher episodes and the comparison (weights and optimizer fp32):
    # "auto" only where the hardware multiplies bf16 natively, for a teacher wide enough
    # (common.choose_autocast)
    autocast: common.Autocast = "auto"

    def __post_init__(self):
        if not 0.0 <= self.kd.weight <= 1.0 or self.kd.temperature <= 0:
            raise settings.ConfigError("kd.weight must be in [0, 1] and kd.temperature > 0")
        if min(self.steps, self.batch_episodes, self.grad_accum, self.generate.samples_per_doc, self.log_every) < 1:
            raise settings.ConfigError("steps, batch_episodes, grad_accum, generate.samples_per_doc and log_every "
                                       "must be >= 1")
        if self.keep_every != 0 and not self.keep_every > 1:
            raise settings.ConfigError(f"keep_every={self.keep_every:g}: 0 (the student is student.name_or_path) or "
                                       "> 1 (the teacher with ceil(layers / keep_every) of its decoder layers)")


# ---------------------------------------------------------------------------
# Pure pieces (tests import these)
# ---------------------------------------------------------------------------


def summary_episode(ep: sandbox.Episode) -> sandbox.Episode:
    """A text-only episode whose only turn is `ep`'s final summary: the tool
    trace hidden. `.tokenized(tok)` gives its canonical ids (chat prompt, the
    summary encoded on its own, end-of-turn), the loss on exactly those."""
    return sandbox.Episode(ep.document, [sandbox.Turn(ep.summary)], summary=ep.summary, doc_id=ep.doc_id,
                           meta={**ep.meta, "target": "summary"})


def text_only(ep: sandbox.Episode) -> sandbox.Episode:
    """`ep` without token ids, to be tokenised canonically by another tokenizer."""
    turns = [sandbox.Turn(t.text, t.call, t.injected, t.ended) for t in ep.turns]
    return sandbox.Episode(ep.document, turns, None, ep.summary, dict(ep.flags), ep.doc_id, dict(ep.meta))


def make_targets(episodes: Sequence[sandbox.Episode], target: str, same_vocab: bool) -> list[sandbox.Episode]:
    """Training episodes for the student (not yet tokenised where text-only).
    Full episodes keep the teacher's sampled ids when the vocabularies match."""
    out = []
    for ep in episodes:
        if target in ("summary", "both"):
            out.append(summary_episode(ep))
        if target in ("episode", "both"):
            out.append(ep if same_vocab else text_only(ep))
    return out


def clean(ep: sandbox.Episode) -> bool:
    """Valid tool use, not truncated, a non-empty summary."""
    return bool(ep.summary.strip()) and ep.valid and not ep.flags.get("truncated")


def keep_episode(ep: sandbox.Episode, score: dict | None, cfg: GenerateConfig) -> bool:
    """`generate.filter` on one teacher episode (`score`: its rewards.Scorer.score_batch row)."""
    if cfg.filter == "none":
        return bool(ep.summary.strip())
    if not clean(ep):
        return False
    if cfg.filter == "pass":
        return bool(score["pass"])
    if cfg.filter == "factuality":
        return score["factuality"] >= cfg.min_factuality
    return True


def _kl_chunk(s: torch.Tensor, t: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of positions: the sum of KL(softmax(t / T) || softmax(s / T)) and
    q - p (q = softmax(s / T), p = softmax(t / T)), both in float32; the KL's gradient
    with respect to s is (q - p) / T."""
    log_q = F.log_softmax(s.float() / temperature, dim=-1)
    log_p = F.log_softmax(t.float() / temperature, dim=-1)
    p = log_p.exp()
    return (p * (log_p - log_q)).sum(), log_q.exp_().sub_(p)


class _ChunkedKD(torch.autograd.Function):
    """T^2 KL(softmax(t / T) || softmax(s / T)) summed over positions, a chunk of
    positions at a time, its gradient written in closed form: d/ds = T (q - p), with
    q = softmax(s / T) and p = softmax(t / T). Autograd through the formula keeps five
    (N, V) float32 tensors for the backward and makes a dozen passes over them: at
    SmolLM2's 49k vocabulary and 2,400 positions a step, the KD term cost more than the
    student's and the teacher's forward passes together. Here only the gradient is
    kept, in the logits' dtype."""

    @staticmethod
    def forward(ctx, s, t, temperature: float, chunk: int):
        loss = torch.zeros((), dtype=torch.float32, device=s.device)
        grad = torch.empty_like(s)
        for a in range(0, s.shape[0], chunk):
            kl, q_minus_p = _kl_chunk(s[a:a + chunk], t[a:a + chunk], temperature)
            loss += kl
            grad[a:a + chunk] = q_minus_p.mul_(temperature)
        ctx.save_for_backward(grad)
        return loss * (temperature * temperature)

    @staticmethod
    def backward(ctx, g):
        (grad,) = ctx.saved_tensors
        return grad * g.to(grad.dtype), None, None, None


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float,
            chunk: int = 256) -> torch.Tensor:
    """Sum over positions of T^2 KL(softmax(t / T) || softmax(s / T)), in float32.
    Logits (N, V) each; the T^2 keeps the gradient's scale comparable to CE's
    as T changes (Hinton et al. 2015). `chunk` positions at a time (_ChunkedKD)."""
    return _ChunkedKD.apply(student_logits, teacher_logits.detach(), temperature, chunk)


def same_vocabulary(teacher_tok, student_tok) -> bool:
    return teacher_tok.get_vocab() == student_tok.get_vocab()


def kd_setting(teacher_tok, student_tok, cfg: KDConfig) -> tuple[float, str]:
    """(the KD weight to use, a log line saying why)."""
    if cfg.weight <= 0:
        return 0.0, "kd: off (kd.weight=0): cross-entropy only"
    if not same_vocabulary(teacher_tok, student_tok):
        return 0.0, (f"kd: off: student and teacher vocabularies differ ({len(student_tok)} vs {len(teacher_tok)} "
                     "tokens), their logits do not correspond: cross-entropy only")
    return cfg.weight, f"kd: KL(teacher || student) at T={cfg.temperature:g}, weight {cfg.weight:g} (CE {1 - cfg.weight:g})"


def generated_logits(model, episodes: Sequence[sandbox.Episode], max_batch_tokens: int = 16384,
                     prompt: bool = False, hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, V) the logits that predict every generated id of `episodes`, (N,)
    those ids and (N,) a bool mask of the generated ones: episodes, branches and
    turns in order, each id once, under the context it was generated in. With
    `prompt`, every position of every branch instead (the prompt and injected
    results too, the mask telling them apart). Branches are right-padded
    sequences; only the needed positions go through the output head
    (`logits_to_keep`). With `hidden`, the (N, d) last hidden states of the
    decoder at those positions instead, the head left to the caller."""
    dev = next(model.parameters()).device
    branches = [b for ep in episodes for b in ep.branches()]
    chunks, cur = [], []
    for b in branches:
        if cur and max(len(x.input_ids) for x in cur + [b]) * (len(cur) + 1) > max_batch_tokens:
            chunks.append(cur)
            cur = []
        cur.append(b)
    chunks += [cur] if cur else []
    outs, targets, generated = [], [], []
    for chunk in chunks:
        width = scoring.bucketed(max(len(b.input_ids) for b in chunk), dev)  # few shapes under bf16
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        wanted = []
        for i, b in enumerate(chunk):
            ids[i, :len(b.input_ids)] = torch.tensor(b.input_ids)
            mask[i, :len(b.input_ids)] = 1
            gen = {p for _, s, e in b.turns for p in range(s - 1, e - 1)}
            wanted.append(list(range(len(b.input_ids) - 1)) if prompt else sorted(gen))
            targets += [b.input_ids[p + 1] for p in wanted[-1]]
            generated += [p in gen for p in wanted[-1]]
        keep = sorted({p for w in wanted for p in w})
        col = {p: k for k, p in enumerate(keep)}
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        inputs = dict(input_ids=ids.to(dev), attention_mask=mask.to(dev), position_ids=pos.to(dev))
        if hidden:
            out = model.get_decoder()(**inputs).last_hidden_state[:, keep]  # (B, K, d)
        else:
            out = model(**inputs, logits_to_keep=torch.tensor(keep, device=dev)).logits  # (B, K, V)
        for i, w in enumerate(wanted):
            outs.append(out[i, torch.tensor([col[p] for p in w], device=dev, dtype=torch.long)])
    return torch.cat(outs), torch.tensor(targets, device=dev), torch.tensor(generated, device=dev)


class _HeadLoss(torch.autograd.Function):
    """distill_loss's (1 - w) CE + w T^2 KL from the student's and the teacher's hidden
    states through their output heads, a chunk of positions at a time: each chunk's
    logits are made, used for the loss and its gradient (CE: softmax - one-hot; KD:
    T (q - p)), and dropped; only the gradients of the hidden states and of the head's
    weight are kept. A step's whole logits (with kd.prompt, 3,200 positions x SmolLM2's
    49k words: 0.6 GB a copy, and the logits path holds the student's, the teacher's,
    their concatenations and a gradient) never exist."""

    @staticmethod
    def forward(ctx, h, weight, teacher, labels, spec):
        """teacher: its (hidden states, head weight); labels: (targets, the generated mask); spec:
        (CE's scale, KD's scale, T, the vocabulary, positions a chunk)."""
        (h_t, weight_t), (targets, gen) = teacher, labels
        ce_scale, kd_scale, temperature, vocab, chunk = spec
        ce = torch.zeros((), dtype=torch.float32, device=h.device)
        kd = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h, grad_w = torch.empty_like(h), torch.zeros_like(weight, dtype=torch.float32)
        for a in range(0, h.shape[0], chunk):
            z = (h[a:a + chunk] @ weight.T).float()  # (c, V) in autocast's dtype, then float32
            kl, q_minus_p = _kl_chunk(z[:, :vocab], (h_t[a:a + chunk] @ weight_t.T)[:, :vocab], temperature)
            kd += kl
            dz = torch.zeros_like(z)
            dz[:, :vocab] = q_minus_p.mul_(temperature * kd_scale)
            g = gen[a:a + chunk]
            if g.any():
                rows, tg = g.nonzero()[:, 0], targets[a:a + chunk][g]
                log_s = F.log_softmax(z[rows], dim=-1)
                ce -= log_s.gather(-1, tg[:, None]).sum()
                d_ce = log_s.exp_()
                d_ce[torch.arange(len(tg), device=h.device), tg] -= 1.0
                dz[rows] += d_ce.mul_(ce_scale)
            grad_h[a:a + chunk] = dz @ weight
            grad_w += dz.T @ h[a:a + chunk]
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(ce, kd)
        kd = kd * (temperature * temperature)
        return ce * ce_scale + kd * kd_scale, ce, kd

    @staticmethod
    def backward(ctx, g, _ce, _kd):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * g.to(grad_h.dtype), grad_w * g.to(grad_w.dtype), None, None, None


def plain_heads(*models) -> bool:
    """Whether every model's logits are a bias-free linear head on its decoder's last hidden
    state (`scoring.head_is_plain`), so that _HeadLoss can apply the heads itself."""
    return all(scoring.head_is_plain(m) and m.get_output_embeddings().bias is None for m in models)


def kd_positions(ep: sandbox.Episode, prompt: bool) -> int:
    """How many positions of `ep` the KD term covers: its generated ids, or with
    `prompt` every position of every branch that predicts a next id."""
    return sum(len(b.input_ids) - 1 for b in ep.branches()) if prompt else training.n_generated(ep)


def distill_loss(student, teacher, episodes, n_tokens: int, *, kd_weight: float, temperature: float,
                 vocab: int, max_batch_tokens: int = 16384, prompt: bool = False, n_kd: int = 0,
                 fused: bool | None = None, chunk: int = 256) -> tuple[torch.Tensor, float, float]:
    """(loss, ce, kd) of a micro-batch: loss = (1 - w) ce + w kd. ce is the sum
    over its generated tokens divided by `n_tokens` (the step's count); kd the
    sum over the KD positions (`kd_positions`) divided by `n_kd` (the step's count
    of them; `n_tokens` when 0). KD compares the first `vocab` logits (heads
    padded past the vocabulary differ). `fused` (the default where both heads are
    plain, `plain_heads`): the heads applied `chunk` positions at a time (_HeadLoss);
    else the whole logits, the KD term a chunk at a time (`kd_loss`)."""
    if kd_weight <= 0:
        ce = training.sequence_loss(student, episodes, n_tokens, max_batch_tokens)
        return ce, ce.item(), math.nan
    n_kd = n_kd or n_tokens
    if fused is None:
        fused = plain_heads(student, teacher)
    if fused:
        h, targets, gen = generated_logits(student, episodes, max_batch_tokens, prompt, hidden=True)
        with torch.no_grad():
            h_t, _, _ = generated_logits(teacher, episodes, max_batch_tokens, prompt, hidden=True)
        spec = ((1 - kd_weight) / max(1, n_tokens), kd_weight / max(1, n_kd), temperature, vocab, chunk)
        loss, ce, kd = _HeadLoss.apply(h, student.get_output_embeddings().weight,
                                       (h_t, teacher.get_output_embeddings().weight.detach()), (targets, gen), spec)
        return loss, ce.item() / max(1, n_tokens), kd.item() / max(1, n_kd)
    s_logits, targets, gen = generated_logits(student, episodes, max_batch_tokens, prompt)
    with torch.no_grad():
        t_logits, _, _ = generated_logits(teacher, episodes, max_batch_tokens, prompt)
    ce = F.cross_entropy(s_logits[gen].float(), targets[gen], reduction="sum") / max(1, n_tokens)
    kd = kd_loss(s_logits[:, :vocab], t_logits[:, :vocab], temperature) / max(1, n_kd)
    return (1 - kd_weight) * ce + kd_weight * kd, ce.item(), kd.item()


# ---------------------------------------------------------------------------
# Measurement: student vs teacher (eval.py's metrics)
# ---------------------------------------------------------------------------


def eval_config(cfg: Config) -> evaluation.Config:
    """eval.py's settings for the comparison: this run's documents, split,
    limits and seed; factuality from `eval.factuality`, the rest of the reward as
    `reward`."""
    e = cfg.eval
    return evaluation.Config(name=cfg.name, runs_dir=cfg.runs_dir, docs=cfg.data.docs, split=cfg.data.split,
                             n_docs=max(1, e.n_docs), n_samples=e.n_samples, max_new_tokens=e.max_new_tokens,
                             latency_docs=e.latency_docs,
                             reward=dataclasses.replace(cfg.reward, factuality=e.factuality),
                             limits=dict(cfg.limits), seed=cfg.seed, torch_threads=cfg.torch_threads,
                             autocast=cfg.autocast)


def compare(teacher_dir: str, student_dir: str, documents, cfg: evaluation.Config) -> dict:
    """Teacher and student on the same documents through `eval.evaluate`
    (latency per summary at batch 1, tools included, greedy factuality, ...):
    both metric sets, speedup = teacher latency / student latency,
    factuality_delta_points = 100 (student - teacher), and the first summaries
    side by side."""
    out, kept = {}, {}
    for name, path in (("teacher", teacher_dir), ("student", student_dir)):
        common.seed_everything(cfg.seed)  # the same sampling draws for both, as eval.py does
        model, tok = evaluation.load_model(path, cfg)
        kept[name] = []
        with common.autocast_for(cfg.autocast, model):
            out[name] = {**evaluation.evaluate(model, tok, documents, cfg, kept[name]), "path": str(path),
                         "n_params": common.count_parameters(model)}
        del model
    t, s = out["teacher"], out["student"]
    out.update(speedup_p50=t["latency_p50_ms"] / s["latency_p50_ms"],
               speedup_p95=t["latency_p95_ms"] / s["latency_p95_ms"],
               factuality_delta_points=100 * (s["factuality"] - t["factuality"]),
               param_ratio=t["n_params"] / s["n_params"],
               factuality_backend=rewards.BACKEND_NAMES[cfg.reward.factuality],
               examples=[{"doc_id": getattr(d, "id", None), "teacher": te.summary, "student": se.summary}
                         for (d, te, *_), (_, se, *_) in list(zip(kept["teacher"], kept["student"]))[:3]])
    return out


# ---------------------------------------------------------------------------
# Teacher episodes and the student
# ---------------------------------------------------------------------------


def teacher_stamp(teacher_dir: str) -> dict:
    """What identifies a teacher for the caches built from it: its path and its
    files' modification times (a retrained teacher invalidates them)."""
    return {"teacher": teacher_dir,
            "teacher_files": {f.name: f.stat().st_mtime_ns for f in sorted(Path(teacher_dir).glob("*.*"))}}


def teacher_episodes(cfg: Config, run_dir: Path, teacher, tok, docs, limits) -> tuple[list[sandbox.Episode], dict]:
    """The kept teacher episodes and their funnel; cached in the run directory
    (reused while the settings that made them are unchanged)."""
    path, stamp_path = run_dir / "teacher_episodes.jsonl", run_dir / "teacher_episodes.json"
    stamp = {**teacher_stamp(cfg.teacher), "generate": dataclasses.asdict(cfg.generate), "docs": cfg.data.docs,
             "split": cfg.data.split, "max_train_docs": cfg.data.max_train_docs, "limits": cfg.limits,
             "seed": cfg.seed, "reward": settings.config_to_dict(cfg.reward)}
    if path.exists() and stamp_path.exists():
        saved = json.loads(stamp_path.read_text(encoding="utf-8"))
        if saved["stamp"] == stamp:
            return sandbox.read_episodes(str(path)), {**saved["funnel"], "cached": True}
    g = cfg.generate
    scfg = engine.SamplingConfig(temperature=g.temperature, max_new_tokens=g.max_new_tokens,
                                  batch_size=g.batch_size, seed=cfg.seed)
    t0 = time.perf_counter()
    eps = engine.rollout(teacher, tok, docs, g.samples_per_doc, scfg, limits,
                          generator=engine.make_generator(cfg.seed, teacher), progress="teacher summaries")
    docs_rep = [d for d in docs for _ in range(g.samples_per_doc)]
    scores = rewards.Scorer(cfg.reward).score_batch(list(zip(docs_rep, eps))) if g.filter in ("pass", "factuality") \
        else [None] * len(eps)
    kept = []
    for ep, s in zip(eps, scores):
        if s is not None:
            ep.meta["reward"] = {k: s[k] for k in ("total", "pass", "factuality", "rules")}
        if keep_episode(ep, s, g):
            kept.append(ep)
    funnel = {"documents": len(docs), "generated": len(eps), "clean": sum(map(clean, eps)), "kept": len(kept),
              "teacher_tokens_per_episode": statistics.fmean(sum(len(t.ids) for t in e.turns) for e in eps),
              "teacher_searches": sandbox.tool_stats(eps)["searches_per_episode"],
              "generate_s": time.perf_counter() - t0}
    common.atomic_write_text(path, "".join(e.to_json() + "\n" for e in kept))
    common.atomic_write_text(stamp_path, json.dumps({"stamp": stamp, "funnel": funnel}, indent=1) + "\n")
    return kept, {**funnel, "cached": False}


def kept_layers(n: int, keep_every: float) -> list[int]:
    """`ceil(n / keep_every)` decoder layers of `n`, evenly spaced, the first and the last among them."""
    k = max(2, math.ceil(n / keep_every))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def pruned_teacher(teacher_dir: str, keep_every: float, out_dir: Path, base: modeling.ModelConfig) -> Path:
    """The teacher with its adapter merged and only `kept_layers` of its decoder layers,
    saved as a plain model in `out_dir`; reused when written from the same teacher
    with the same `keep_every` (its stamp, pruned.json), built again otherwise."""
    stamp = {**teacher_stamp(teacher_dir), "keep_every": keep_every}
    stamp_path = out_dir / "pruned.json"
    if (out_dir / "config.json").exists() and stamp_path.exists() and \
            json.loads(stamp_path.read_text(encoding="utf-8")) == stamp:
        return out_dir
    import torch.nn as nn

    model, tok = modeling.load_policy(modeling.trained_model_config(teacher_dir, base), train=False)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    n = model.config.num_hidden_layers
    keep = kept_layers(n, keep_every)
    decoder = model.get_decoder()
    decoder.layers = nn.ModuleList(decoder.layers[i] for i in keep)
    for i, layer in enumerate(decoder.layers):  # each attention indexes the KV cache by its own layer number
        layer.self_attn.layer_idx = i
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    with common.atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "pruned.json").write_text(json.dumps(stamp) + "\n", encoding="utf-8")
    print(f"student: the teacher's decoder layers {keep} ({len(keep)} of {n}), its weights -> {out_dir}")
    return out_dir


def load_student(cfg: Config, run_dir: Path, teacher_tok):
    """A tiny preset becomes a fresh Llama of that shape over the teacher's
    tokenizer (so logits correspond and KD applies), seeded, written to
    run_dir/student_init and loaded from there like any model; with `keep_every`
    the student is the pruned teacher (`pruned_teacher`); anything else loads as it is."""
    mcfg = cfg.student
    if cfg.keep_every > 1:
        init = pruned_teacher(cfg.teacher, cfg.keep_every, run_dir / "student_init", mcfg)
        mcfg = dataclasses.replace(mcfg, name_or_path=str(init), adapter_path=None)
    elif mcfg.name_or_path.startswith("tiny-") and not Path(mcfg.name_or_path).exists():
        from newsworld import tiny  # a tiny preset: the built-in world builds it over the teacher's vocabulary

        init = tiny.build_tiny_model(mcfg.name_or_path, run_dir / "student_init", cfg.seed, tokenizer=teacher_tok)
        mcfg = dataclasses.replace(mcfg, name_or_path=str(init))
    return modeling.load_policy(mcfg, train=True)


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def main(cfg: Config) -> dict:
    dist = common.init_distributed()  # torchrun: this rank's share of every batch (common.Dist)
    run = common.start_run(cfg, dist)
    dev = common.device()
    common.seed_everything(cfg.seed)
    limits = sandbox.Limits.make(**cfg.limits)

    # -- documents, teacher, teacher episodes -----------------------------------
    if not Path(cfg.data.docs).exists():
        raise SystemExit(f"data.docs={cfg.data.docs}: no such file (write it with `python -m newsworld generate "
                         f"--n 1000 --seed 0 --out {cfg.data.docs}` and split it with `python data.py split`)")
    train_docs, _, how = training.load_documents(training.DocumentData(train=cfg.data.docs, split=cfg.data.split))
    if cfg.data.max_train_docs:
        train_docs = train_docs[:cfg.data.max_train_docs]
    if not train_docs:
        raise SystemExit(f"no training documents ({how})")
    ecfg = eval_config(cfg)
    eval_docs = evaluation.load_eval_documents(ecfg) if cfg.eval.n_docs else []
    print(f"data: {len(train_docs)} training, {len(eval_docs)} held-out documents ({how})")
    if not Path(cfg.teacher).exists():
        raise SystemExit(f"teacher={cfg.teacher} does not exist: train it first (sft.py or rl.py)")
    teacher, t_tok = modeling.load_policy(modeling.trained_model_config(cfg.teacher), train=False)
    bf16 = common.setup_compute(cfg.torch_threads, cfg.autocast, dev, teacher)  # the teacher's width decides
    if dev == "cpu" and common.keep_freed_memory():  # each step's logits reuse the last step's pages
        print("memory: freed blocks kept for reuse (glibc)")
    with common.autocast(bf16, dev, teacher), common.main_first(dist):  # rank 0 generates, the others read its cache
        episodes, funnel = teacher_episodes(cfg, run.dir, teacher, t_tok, train_docs, limits)
    print(f"teacher episodes: {funnel['kept']}/{funnel['generated']} kept (filter {cfg.generate.filter}; "
          f"{funnel['clean']} clean), {funnel['teacher_tokens_per_episode']:.0f} tokens and "
          f"{funnel['teacher_searches']:.2f} searches each" + (" (cached)" if funnel["cached"] else
                                                                f", {funnel['generate_s']:.1f}s"))
    if not episodes:
        raise SystemExit("no teacher episode passed generate.filter: loosen it (generate.filter=none)")

    # -- student, targets -------------------------------------------------------
    with common.main_first(dist):  # rank 0 writes student_init, the others load it
        model, tok = load_student(cfg, run.dir, t_tok)
    kd_weight, why = kd_setting(t_tok, tok, cfg.kd)
    print(why)
    if kd_weight <= 0:
        teacher = None  # not needed until the comparison, which loads it again
    same = same_vocabulary(t_tok, tok)
    train, skipped = training.tokenize_episodes(make_targets(episodes, cfg.target, same), tok, cfg.data.max_tokens)
    if not train:
        raise SystemExit(f"every target is longer than data.max_tokens={cfg.data.max_tokens}")
    checked = scoring.validate_masks(train, tok, cfg.mask_check, cfg.seed)
    print(f"targets ({cfg.target}): {len(train)} ({skipped} over {cfg.data.max_tokens} tokens skipped), "
          f"{statistics.fmean(map(training.n_generated, train)):.0f} generated tokens each; "
          f"mask validation on {checked}; student {common.count_parameters(model):,} parameters, "
          f"teacher {common.count_parameters(teacher) if teacher is not None else '-'}")

    # -- optimiser, resume --------------------------------------------------------
    lengths = [max(len(b.input_ids) for b in e.branches()) for e in train]
    micro_batch = training.EpochBatches(train, lengths, cfg.batch_episodes, cfg.bucket_window, cfg.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = common.cosine_schedule(opt, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    step, _ = common.resume(run.dir, cfg.resume, model, opt, sched, dist=dist)

    # -- the loop ----------------------------------------------------------------
    model.train()
    vocab = len(tok)
    bar = tqdm(total=cfg.steps, initial=step, desc="distill", dynamic_ncols=True, disable=not dist.main)
    t_last, tok_count, last = time.perf_counter(), 0, {}
    while step < cfg.steps:
        batches = [micro_batch(step * cfg.grad_accum + a) for a in range(cfg.grad_accum)]
        n_tok = sum(training.n_generated(e) for b in batches for e in b)
        n_kd = sum(kd_positions(e, cfg.kd.prompt) for b in batches for e in b)

        def loss_fn(b: list[sandbox.Episode]) -> tuple[torch.Tensor, dict]:
            with common.autocast(bf16, dev, teacher):
                loss, ce, kd = distill_loss(model, teacher, b, n_tok, kd_weight=kd_weight,
                                            temperature=cfg.kd.temperature, vocab=vocab,
                                            max_batch_tokens=cfg.max_batch_tokens, prompt=cfg.kd.prompt, n_kd=n_kd)
            return loss, {"ce": ce, "kd": kd}

        loss_sum, terms, norm, lr = training.optimizer_step(batches, loss_fn, params, opt, sched,
                                                            max_grad_norm=cfg.max_grad_norm,
                                                            step=step, dist=dist)
        step += 1
        tok_count += n_tok
        bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            dt = time.perf_counter() - t_last
            last = {"loss": loss_sum, "ce": terms["ce"], "kd": terms["kd"], "lr": lr, "grad_norm": norm,
                    "tok_s": tok_count / dt}
            run.log(step, cfg.steps, last, dt)
            t_last, tok_count = time.perf_counter(), 0
        if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
            common.save_checkpoint(run.dir, step, model, opt, sched, keep=cfg.keep_checkpoints, dist=dist)
    bar.close()
    if not dist.main:  # rank 0 saves the student and compares it with its teacher, then joins here
        common.close_distributed(dist)
        return {}

    # -- final student, comparison -----------------------------------------------
    final = common.save_final(model, tok, run.dir / "final", merge=True)  # full weights
    print(f"student saved to {final}")
    teacher = model = None  # freed before the comparison loads both again
    report = {"teacher_path": cfg.teacher, "student_path": str(final), "target": cfg.target,
              "kd_weight": kd_weight, "kd": why, "teacher_episodes": funnel, "targets": len(train),
              "steps": step, "last": last}
    if eval_docs:
        report.update(compare(cfg.teacher, str(final), eval_docs, ecfg))
        for name in ("teacher", "student"):
            f = report[name]
            print(f"{name}: latency p50 {f['latency_p50_ms']:.1f} ms (p95 {f['latency_p95_ms']:.1f}), "
                  f"{f['searches']:.2f} searches, factuality {f['factuality']:.3f}, pass {f['pass']:.3f}, "
                  f"hallucination {f['hallucination_rate']:.3f}, rougeL {f['rougeL']:.3f}, "
                  f"{f['n_params']:,} parameters")
        print(f"speedup {report['speedup_p50']:.2f}x at p50 ({report['speedup_p95']:.2f}x at p95), factuality "
              f"{report['factuality_delta_points']:+.1f} points ({report['factuality_backend']}) on "
              f"{len(eval_docs)} held-out documents; the target is >= 3x and within 2 points")
        run.track(step, {f"{name}_{k}": v for name in ("teacher", "student") for k, v in report[name].items()})
    common.atomic_write_text(run.dir / "distill.json", json.dumps(common.jsonable(report, nonfinite="null"),
                                                                   indent=1, allow_nan=False) + "\n")
    run.finish()
    common.close_distributed(dist)
    return report


if __name__ == "__main__":
    with settings.config_errors_exit():
        _cfg = settings.load_config(Config)
    main(_cfg)
