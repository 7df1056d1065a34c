"""Dr. GRPO with the tool sandbox in the loop: the policy writes summaries, searches
and deletes while it samples, and learns from group-relative rewards.

    python rl.py --config configs/tiny.yaml                # CPU: the tiny SFT policy, news world, minutes
    python rl.py --config configs/drgrpo_v19.yaml          # one GPU: 4B in 4-bit + LoRA, Unsloth + vLLM
    python rl.py --config configs/drgrpo_v19.yaml --plan   # its VRAM plan per stage; loads nothing

One step (DESIGN.md sections 4, 5, 7): G = `group_size` rollouts for each of
`prompts_per_step` documents; rewards (`rewards.Scorer`, the curriculum of
tau advancing on the pass rate); advantages A = R - mean(R of the group), no
std division (Dr. GRPO, Liu et al. 2025); mask validation; PPO-clip on every
generated token of every branch, in the context it was sampled in, summed and
divided by the constant n_rollouts x max_new_tokens; a log line, held-out
evaluation and an atomic checkpoint (`resume=auto`).

Reading one step, in the order `main` runs it:
- rollouts: `rollout_step` -> engine.rollout (batched decoding; each tool call is run
  by sandbox.EpisodeBuilder, which keeps the context token-exact);
- rewards: `score_step` -> rewards.Scorer.score_batch, then `turn_advantages` here;
- loss and update: `update_batches` and `update` here. The log-probs of every generated
  token under its own context come from scoring.py (a group's rollouts as one token
  tree); the optimizer step is training.apply_gradients, the one sft.py takes.

Where this departs from Dr. GRPO and PPO as published:
- Old log-probs are the sampler's own when mu == 1 and the sampler is the trainer
  (the ratio is then 1 and the loss the plain policy gradient); otherwise the
  first inner epoch's, detached. vLLM samples get truncated importance sampling,
  min(p_trainer / p_vllm, tis_cap) (Yao et al. 2025).
- The clip range may be asymmetric (`clip_low`, `clip_high`: DAPO's clip-higher).
- KL is the k3 estimator in the loss (GRPO), not a reward penalty; the reference
  is the starting policy (the adapter disabled, a frozen copy, or a frozen copy
  of an `init` adapter).
- mu inner epochs are mu optimizer steps over the whole batch.
- An on-policy guard: a step whose trainer and sampler log-probs differ by more
  than `max_logprob_gap` nats per token aborts before updating.
- Groups whose every token has advantage 0 are not scored when beta == 0.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import torch
from tqdm import tqdm

import rewards
import sandbox
from factual_tools import common, engine, evaluation, modeling, scoring, settings, training, vram
from factual_tools.training import DocumentData, load_documents


@dataclass
class RLEval:
    every: int = 25  # steps between held-out evaluations (0 = at the start and the end only)
    n_docs: int = 32  # held-out documents, greedy rollouts
    max_new_tokens: int = 160
    factuality: str = ""  # backend of held-out scoring ("" = reward.factuality; e.g. oracle to check a lexical proxy)
    sample_every: int = 10  # steps between sample episodes written to samples.jsonl (0 = never)
    # An eval metric (e.g. eval_fact_precision, eval_total): `final` holds the weights of the
    # evaluated step (after step 0) where it was highest, not the last step's (HF Trainer's
    # load_best_model_at_end); best/ holds them during the run, best.json says which step.
    keep_best: str = ""
    n_samples: int = 4  # episodes written each time


@dataclass
class PlanConfig:
    model: str = ""  # the planner's model shape: a configs/models/ name or a config.json ("" = model.name_or_path)
    prompt_len: int = 1024  # prompt tokens a rollout starts from (data.max_prompt_tokens when set)
    injected_tokens: int = 400  # results-block tokens a rollout's context holds (2 searches of 200)
    gpus: int = 1  # data-parallel GPUs the plan is for (torchrun --nproc_per_node): the figures are per GPU


@dataclass
class Config:
    name: str = "rl"  # run name: outputs go to runs_dir/name
    runs_dir: str = "runs"
    init: str = ""  # start from this directory (an SFT run's final/): full weights (LoRA on top), or an adapter
    model: modeling.ModelConfig = field(default_factory=modeling.ModelConfig)
    data: DocumentData = field(default_factory=DocumentData)
    sampling: engine.SamplingConfig = field(default_factory=engine.SamplingConfig)
    limits: dict[str, int] = field(default_factory=dict)  # sandbox limits (sandbox.Limits names)
    # Decode-time tool ban, as eval.py's `tools` (evaluation.TOOLS_BANNED): "none" keeps <search and
    # <delete out of every rollout and held-out episode (the tool-free control); the reward is unchanged
    tools: Literal["all", "no_search", "no_delete", "none"] = "all"
    reward: rewards.RewardConfig = field(default_factory=rewards.RewardConfig)
    eval: RLEval = field(default_factory=RLEval)
    log: common.LogConfig = field(default_factory=common.LogConfig)  # TensorBoard / W&B besides metrics.jsonl
    plan: PlanConfig = field(default_factory=PlanConfig)
    steps: int = 200  # RL steps (rollout batches)
    prompts_per_step: int = 4  # documents per step
    group_size: int = 8  # G: rollouts per document
    micro_groups: int = 1  # groups per forward/backward pass (gradients accumulate over a step)
    mu: int = 1  # inner epochs: optimizer steps per batch of rollouts
    lr: float = 1e-5
    min_lr_ratio: float = 1.0  # the cosine schedule ends at lr * min_lr_ratio (1 = constant after warm-up)
    warmup_steps: int = 0
    weight_decay: float = 0.0
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"  # adamw_8bit: bitsandbytes' 8-bit states
    max_grad_norm: float = 1.0
    clip_low: float = 0.2  # ratio clipped below at 1 - clip_low
    clip_high: float = 0.2  # and above at 1 + clip_high
    beta: float = 0.0  # weight of the k3 KL to the reference policy (0: no reference pass)
    tis_cap: float = 2.0  # truncated importance-sampling weight cap (sampler != trainer only)
    advantage: Literal["outcome", "turn"] = "outcome"  # turn: + per-step ToolMatch credit on call turns
    turn_credit: float = 1.0  # scale of that per-step credit
    # Tokens of text a later delete in the same rollout retracted (Turn.masked): "all"
    # trains them with the episode's advantage like every other token; "negative" only
    # when it is negative (a rollout that did well is not reinforced for the wrong
    # sentence it wrote before correcting it; one that did badly is still pushed away
    # from it); "none" never (SFT's error masking, on policy).
    retracted_credit: Literal["all", "negative", "none"] = "all"
    # group: one tree per group sharing its prompt; tree: one per episode (both need sdpa or eager
    # attention); branch: plain padded sequences (any attention, e.g. Unsloth's)
    score_method: Literal["group", "tree", "branch"] = "group"
    # tokens per forward pass inside a micro-batch; under group scoring also the most nodes of one
    # group tree: a larger group is scored and backpropagated in parts (micro_batches)
    max_batch_tokens: int = 16384
    max_logprob_gap: float = 0.5  # abort when trainer and sampler log-probs differ by more (mean |.|, nats)
    save_every: int = 1  # steps between checkpoints (1: a kill loses at most the current step)
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto | none | a checkpoint path
    seed: int = 0
    torch_threads: int = 0  # CPU threads for torch (0 = its default)
    # bf16 autocast of rollouts and updates (weights and optimizer fp32): "auto" only where the
    # hardware multiplies bf16 natively, for a model wide enough (common.choose_autocast);
    # "none" / "bf16" force it
    autocast: common.Autocast = "auto"

    def __post_init__(self):
        if self.group_size < 2:
            raise settings.ConfigError(f"group_size must be >= 2 (a group of one has no baseline), got {self.group_size}")
        if min(self.prompts_per_step, self.micro_groups, self.mu) < 1:
            raise settings.ConfigError("prompts_per_step, micro_groups and mu must be >= 1")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0 and self.beta >= 0 and self.tis_cap > 0):
            raise settings.ConfigError("need 0 <= clip_low < 1, clip_high >= 0, beta >= 0, tis_cap > 0")
        modeling.check_score_method(self.model.backend, self.score_method)
        if self.tools != "all" and self.sampling.backend not in ("hf", "hf_naive"):
            raise settings.ConfigError(f"tools={self.tools} bans tool tags with a logits processor, which only the "
                                       f"hf and hf_naive samplers take, not sampling.backend="
                                       f"{self.sampling.backend}: set sampling.backend=hf, or tools=all")


# ---------------------------------------------------------------------------
# Pure pieces (tests import these)
# ---------------------------------------------------------------------------


def step_documents(n_docs: int, k: int, seed: int, step: int) -> list[int]:
    """Indices of the `k` documents of `step`: consecutive slices of a seeded
    permutation per epoch, so the data cursor is the step number itself."""
    out = []
    for j in range(step * k, step * k + k):
        epoch, i = divmod(j, n_docs)
        order = list(range(n_docs))
        random.Random(f"{seed}:{epoch}").shuffle(order)
        out.append(order[i])
    return out


def rank_seed(seed: int, rank: int) -> int:
    """Rank `rank`'s sampler seed under torchrun (rank 0's is the config's: one process is unchanged)."""
    return seed + 1_000_003 * rank


def episode_figures(ep: sandbox.Episode, result: dict) -> dict:
    """What a step's log needs of one rollout, small enough to gather from every rank:
    its reward terms, tool use, generated tokens and the sampler's log-probs summed."""
    known = [x for turn in ep.turns for x in (turn.logprobs or []) if not math.isnan(x)]
    terms = ("total", "pass", "factuality", "rules", "budget", "cap_penalty", "tool_match", "right_deletes")
    return {**{k: result[k] for k in terms if k in result},
            "n_search": ep.n_search, "n_delete": ep.n_delete, "valid": bool(ep.valid),
            "tokens": sum(len(turn.ids) for turn in ep.turns), "nll": -sum(known), "n_lp": len(known)}


def group_advantages(rewards_: Sequence[float], group_size: int) -> list[float]:
    """A_i = R_i - mean(R of i's group) (Dr. GRPO: no std normalisation).
    Rewards are in document-major order, `group_size` per document."""
    r = torch.tensor(rewards_, dtype=torch.float64).view(-1, group_size)  # (docs, G)
    return (r - r.mean(1, keepdim=True)).flatten().tolist()


def turn_advantages(episodes: Sequence[sandbox.Episode], results: Sequence[dict], group_size: int,
                    mode: str = "outcome", credit: float = 1.0, w_match: float = 0.0) -> list[list[tuple[float, float]]]:
    """Per episode, per turn: (the advantage of every token of the turn, the credit
    added on the tokens of the tool call's tag only).

    `outcome`: every turn gets its episode's group advantage, credit 0. `turn`:
    the group advantage is of the reward without its ToolMatch term (`w_match` x
    `results[i]["tool_match"]`: ToolMatch is counted once, as per-step credit), and
    a turn that ended in a tool call gets credit x (s - b) on its call tag: s is
    that call's per-step ToolMatch value (`results[i]["tool_match_steps"]`, one per
    call in order), b the mean step value over every call of the group (0 if
    none). Only the tag: a search that matches the teacher must not also
    reinforce the (perhaps wrong) sentence written before it in the same turn."""
    def outcome(r: dict) -> float:
        return r["total"] - (w_match * (r.get("tool_match") or 0.0) if mode == "turn" else 0.0)

    base = group_advantages([outcome(r) for r in results], group_size)
    out = []
    for g in range(0, len(episodes), group_size):
        steps = [list(results[i].get("tool_match_steps") or []) for i in range(g, g + group_size)]
        pooled = [s for st in steps for s in st]
        mean = sum(pooled) / len(pooled) if pooled else 0.0
        for i, st in zip(range(g, g + group_size), steps):
            ep, adv, k = episodes[i], [], 0
            for turn in ep.turns:
                c = 0.0
                if mode == "turn" and turn.call is not None:
                    c = credit * ((st[k] if k < len(st) else 0.0) - mean)
                    k += 1
                adv.append((base[i], c))
            out.append(adv)
    return out


def call_tag_starts(episodes: Sequence[sandbox.Episode], tokenizer) -> list[list[int]]:
    """Per episode, per turn: the index of the turn's first token that holds part of
    its tool call's tag (`len(ids)` for a turn without a call)."""
    codec = sandbox.Codec(tokenizer)
    out = []
    for ep in episodes:
        row = []
        for turn in ep.turns:
            n = len(turn.ids or [])
            if turn.call is None or not n:
                row.append(n)
                continue
            _, bounds = sandbox.token_bounds(codec, turn.ids)
            # the last clean boundary at or before the tag's first character
            row.append(max((k for k, off in bounds if off <= turn.call.start), default=0))
        out.append(row)
    return out


def token_advantages(episodes: Sequence[sandbox.Episode], turn_adv: Sequence[Sequence],
                     tag_starts: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
    """(T,) one advantage per generated token, episodes then turns in order (the
    order of `flat`). A turn's entry is a float (every token) or `turn_advantages`'
    (advantage, call credit) pair; the credit goes to the tokens from
    `tag_starts` on (`call_tag_starts`; needed when any credit is not 0)."""
    out = []
    for e, (ep, adv) in enumerate(zip(episodes, turn_adv)):
        for j, (turn, a) in enumerate(zip(ep.turns, adv)):
            a, c = (a if isinstance(a, tuple) else (a, 0.0))
            n = len(turn.ids)
            if c:
                if tag_starts is None:
                    raise ValueError("call credit needs tag_starts (rl.call_tag_starts)")
                k = tag_starts[e][j]
                out += [a] * k + [a + c] * (n - k)
            else:
                out += [a] * n
    return torch.tensor(out, dtype=torch.float32)


def retracted_mask(episodes: Sequence[sandbox.Episode]) -> torch.Tensor:
    """(T,) True on every generated token that holds text a later delete retracted
    (`Turn.masked`), in the order of `flat` and `token_advantages`."""
    return torch.tensor([j in masked for ep in episodes for turn in ep.turns
                         for masked in (set(turn.masked or ()),) for j in range(len(turn.ids))], dtype=torch.bool)


def apply_retracted_credit(adv: torch.Tensor, retracted: torch.Tensor, mode: str) -> torch.Tensor:
    """`adv` with retracted tokens' advantages kept ("all"), kept only where negative
    ("negative"), or zeroed ("none"): a zero advantage contributes no gradient."""
    if mode == "all":
        return adv
    drop = retracted & (adv > 0) if mode == "negative" else retracted
    return adv.masked_fill(drop.to(adv.device), 0.0)


def flat(per_turn: Sequence[Sequence[torch.Tensor | None]]) -> torch.Tensor:
    """(T,) the per-episode, per-turn tensors of `episode_logprobs`, concatenated."""
    parts = [x for ep in per_turn for x in ep if x is not None and x.numel()]
    return torch.cat(parts) if parts else torch.zeros(0)


def sampler_logprobs(episodes: Sequence[sandbox.Episode]) -> torch.Tensor:
    """(T,) the log-probs the sampler recorded (nan where it recorded none)."""
    return torch.tensor([lp for ep in episodes for turn in ep.turns
                         for lp in (turn.logprobs if turn.logprobs is not None else [math.nan] * len(turn.ids))],
                        dtype=torch.float32)


def ppo_token_loss(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, *, clip_low: float = 0.2,
                   clip_high: float = 0.2, ref_logp: torch.Tensor | None = None, beta: float = 0.0,
                   is_weight: torch.Tensor | None = None):
    """Per-token loss (T,), k3 KL (T,) or None, and the clipped mask (T,).

    loss = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) [x is_weight] + beta k3,
    r = exp(logp - old_logp). The caller sums and divides by its constant."""
    ratio = torch.exp(logp - old_logp)
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if is_weight is not None:
        pg = pg * is_weight
    clipped = ((ratio < 1 - clip_low) & (adv < 0)) | ((ratio > 1 + clip_high) & (adv > 0))
    kl = None
    if ref_logp is not None:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        pg = pg + beta * kl
    return pg, kl, clipped


def dr_grpo_loss(logp, old_logp, adv, n_rollouts: int, max_new_tokens: int, **kw):
    """(loss, k3 KL per token or None, clipped mask): the sum of the per-token losses
    over every generated token, divided by n_rollouts x max_new_tokens (the same
    constant for every sequence). The training loop calls it once per micro-batch
    with the step's n_rollouts, so the micro-batch losses add up to the step's."""
    tok_loss, kl, clipped = ppo_token_loss(logp, old_logp, adv, **kw)
    return tok_loss.sum() / (n_rollouts * max_new_tokens), kl, clipped


def logprobs(model, episodes: Sequence[sandbox.Episode], cfg: Config, temperature: float,
             group: int | None = None) -> torch.Tensor:
    """(T,) log-probs of every generated token under its own context, differentiable. Group
    scoring makes a tree of every `group` consecutive rollouts (default: the group size)."""
    if cfg.score_method == "group":
        return flat(scoring.group_logprobs(model, episodes, group or cfg.group_size, temperature,
                                           cfg.max_batch_tokens))
    return flat(scoring.episode_logprobs(model, episodes, temperature=temperature, method=cfg.score_method,
                                         max_batch_tokens=cfg.max_batch_tokens))


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def make_optimizer(cfg: Config, params):
    if cfg.optimizer == "adamw_8bit":
        modeling.require_package("bitsandbytes", "optimizer='adamw_8bit'", "pip install bitsandbytes==0.50.2")
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


TEACHER_PRODUCER = "python teacher_episodes.py --config configs/teacher_cnn.yaml"


def check_teacher(cfg: Config) -> None:
    """ToolMatch needs teacher episodes: fail before any model loads, naming their producer."""
    if cfg.data.teacher and not Path(cfg.data.teacher).exists():
        raise SystemExit(f"data.teacher={cfg.data.teacher} does not exist: the teacher episodes ToolMatch grades "
                         f"against are written by `{TEACHER_PRODUCER}` (out= sets the path)")
    if cfg.reward.tools.w_match > 0 and not cfg.data.teacher:
        raise SystemExit(f"reward.tools.w_match={cfg.reward.tools.w_match} needs teacher episodes (data.teacher); "
                         f"write them with `{TEACHER_PRODUCER}`")


# ---------------------------------------------------------------------------
# The run: set-up, then each step as rollout -> score -> update -> log
# ---------------------------------------------------------------------------


@dataclass
class Trainer:
    """Everything a step reads or changes, made once by `setup`."""
    cfg: Config
    dist: Any  # common.Dist
    run: Any  # common.Run
    model: Any
    tok: Any
    amp: Callable  # the autocast context, entered per call
    params: list
    opt: Any
    sched: Any
    scorer: rewards.Scorer
    gen: Any  # this rank's sampling generator
    train_docs: list
    eval_docs: list
    teacher: dict | None  # doc_id -> teacher episode, for ToolMatch
    ref_copy: Any  # a frozen reference when beta > 0 and the model has no adapter to disable
    samples: common.MetricsWriter | None
    limits: sandbox.Limits
    step: int = 0
    ban: Any = None  # the decode-time tool ban (evaluation.TagBan); None when every tool is allowed

    @property
    def vllm(self) -> bool:
        return self.cfg.sampling.backend == "vllm"

    @property
    def lora(self) -> bool:
        return bool(getattr(self.model, "peft_config", None))

    @property
    def best_json(self) -> Path:
        return self.run.dir / "best.json"

    @property
    def temperature(self) -> float:
        return self.cfg.sampling.temperature if self.cfg.sampling.temperature > 0 else 1.0


def training_documents(cfg: Config, tok, custom_reward: bool) -> tuple[list, list, dict | None]:
    """(training documents, held-out documents, teacher episodes by doc_id), printed with where they came from."""
    train_docs, eval_docs, how = load_documents(cfg.data)
    if cfg.data.max_prompt_tokens:
        fits = lambda d: len(sandbox.prompt_ids(tok, d.text)) <= cfg.data.max_prompt_tokens  # noqa: E731
        n0 = len(train_docs)
        train_docs, eval_docs = [d for d in train_docs if fits(d)], [d for d in eval_docs if fits(d)]
        how += f", {n0 - len(train_docs)} over {cfg.data.max_prompt_tokens} prompt tokens skipped"
    eval_docs = eval_docs[:cfg.eval.n_docs]
    if not train_docs:
        raise SystemExit(f"no training documents ({how})")
    teacher = None
    if cfg.data.teacher:
        teacher = {e.doc_id: e for e in sandbox.read_episodes(cfg.data.teacher) if e.doc_id}
        if not teacher:
            raise SystemExit(f"data.teacher={cfg.data.teacher} holds no episode with a doc_id; "
                             f"write it with `{TEACHER_PRODUCER}`")
        covered = sum(d.id in teacher for d in train_docs)
        how += f"; teacher episodes for {covered}/{len(train_docs)} training documents"
    print(f"data: {len(train_docs)} training, {len(eval_docs)} held-out documents ({how})")
    print(f"factuality: {rewards.BACKEND_NAMES[cfg.reward.factuality]}"
          + (" (custom reward_fn)" if custom_reward else "")
          + f"; held-out: {rewards.BACKEND_NAMES[cfg.eval.factuality or cfg.reward.factuality]}")
    return train_docs, eval_docs, teacher


def setup(cfg: Config, custom_reward: bool = False) -> Trainer:
    """The model, data, optimizer and scorer of a run, resumed from its newest checkpoint
    (`resume=auto`); a stale best.json of an old run in the same directory is removed."""
    if not custom_reward:
        check_teacher(cfg)
    if cfg.sampling.backend == "api":
        raise SystemExit("sampling.backend=api samples text only and cannot be trained on; use hf or vllm "
                         "(the api backend makes teacher episodes: data.teacher)")
    dist = common.init_distributed()  # torchrun: this rank rolls out its share of each step's prompts
    run = common.start_run(cfg, dist)
    dev_type = common.device()
    common.seed_everything(cfg.seed)  # the same initial weights on every rank
    # The policy from `init` (an adapter directory continues that adapter; full weights get a fresh
    # LoRA when model.lora.enabled), else model.name_or_path. With a KL term the init adapter is also
    # the reference: the KL anchors on the starting policy, not on the base model, adapter disabled.
    model, tok = modeling.load_from_init(cfg.model, cfg.init, reference=cfg.beta > 0,
                                         hint="run the SFT stage first (`python sft.py --config "
                                              "configs/sft_tiny.yaml` for the tiny config)")
    bf16 = common.setup_compute(cfg.torch_threads, cfg.autocast, dev_type, model)
    if cfg.sampling.backend == "vllm" and not hasattr(model, "vllm_engine"):
        raise SystemExit("sampling.backend=vllm needs Unsloth's engine: model.backend=unsloth, "
                         "model.fast_inference=true")
    lora = bool(getattr(model, "peft_config", None))
    ref_copy = modeling.frozen_copy(model) if cfg.beta > 0 and not lora else None  # before any resume
    gen = engine.make_generator(rank_seed(cfg.seed, dist.rank), model)  # each rank samples its own draws
    scorer = rewards.Scorer(cfg.reward)
    train_docs, eval_docs, teacher = training_documents(cfg, tok, custom_reward)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(cfg, params)
    sched = common.cosine_schedule(opt, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
    step, state = common.resume(run.dir, cfg.resume, model, opt, sched, generators={"sample": gen},
                                logs=("metrics.jsonl", "samples.jsonl"), dist=dist)
    if "scorer" in state:
        scorer.load_state_dict(state["scorer"])
        print(f"curriculum: tau {scorer.curriculum.tau}")
    samples = common.MetricsWriter(run.dir / "samples.jsonl") if dist.main else None
    trainer = Trainer(cfg=cfg, dist=dist, run=run, model=model, tok=tok,
                      amp=lambda: common.autocast(bf16, dev_type, model), params=params, opt=opt, sched=sched,
                      scorer=scorer, gen=gen, train_docs=train_docs, eval_docs=eval_docs, teacher=teacher,
                      ref_copy=ref_copy, samples=samples, limits=sandbox.Limits.make(**cfg.limits), step=step,
                      ban=evaluation.tool_processor(tok, cfg.tools))
    if trainer.ban is not None:
        print(f"tools={cfg.tools}: {', '.join(evaluation.TOOLS_BANNED[cfg.tools])} banned at decode time "
              "(rollouts and held-out evaluation)")
    if cfg.eval.keep_best and not eval_docs:
        raise SystemExit("eval.keep_best needs held-out documents (data.split's eval pool or data.validation)")
    if cfg.eval.keep_best and step == 0 and trainer.best_json.exists() and dist.main:
        trainer.best_json.unlink()  # a new run in an old directory: the old best is not a candidate
    return trainer


def sample(trainer: Trainer, documents, group: int, scfg: engine.SamplingConfig,
           generator=None) -> list[sandbox.Episode]:
    """`group` rollouts of each document under the current weights."""
    if trainer.vllm:
        # Unsloth's GRPO trainer refreshes vLLM the same way before each generation:
        # `model.load_lora(path, load_tensors=True)` builds a LoRARequest from the live
        # adapter tensors (unsloth_zoo.vllm_utils.load_lora; it writes only the adapter
        # config to `path`, once), passed on to `LLM.generate(..., lora_request=...)`.
        lora_request = trainer.model.load_lora(str(trainer.run.dir / "vllm_lora"), load_tensors=True)
        return engine.rollout_vllm(trainer.model.vllm_engine, trainer.tok, documents, group, scfg, trainer.limits,
                                    lora_request=lora_request)
    ban = {"logits_processor": trainer.ban} if trainer.ban is not None else {}  # the tool ban (Config.tools) when set
    with trainer.amp():
        return engine.rollout(trainer.model, trainer.tok, documents, group, scfg, trainer.limits, generator=generator,
                              **ban)


def evaluate(trainer: Trainer) -> dict:
    """The greedy held-out evaluation (evaluation.greedy_eval) under this run's sampler, tool ban and
    sandbox limits, scored by the configured reward (pass at the first tau, so evaluations compare across
    the curriculum); logged, and kept as best/ when `eval.keep_best` improved."""
    cfg = trainer.cfg
    ecfg = evaluation.Config(reward=dataclasses.replace(cfg.reward, factuality=cfg.eval.factuality
                                                        or cfg.reward.factuality),
                             limits=cfg.limits, max_new_tokens=cfg.eval.max_new_tokens, seed=cfg.seed,
                             tools=cfg.tools)
    greedy = dataclasses.replace(cfg.sampling, temperature=0.0, max_new_tokens=cfg.eval.max_new_tokens)
    figures = evaluation.greedy_eval(trainer.model, trainer.tok, trainer.eval_docs, ecfg, generate=lambda docs: sample(
        trainer, docs, 1, greedy, engine.make_generator(cfg.seed, trainer.model)))[0]
    out = {f"eval_{k}": v for k, v in figures.items()}
    evaluation.log_eval(trainer.run, trainer.step, out)
    if cfg.eval.keep_best:
        keep_if_best(trainer, out)
    return out


def keep_if_best(trainer: Trainer, out: dict) -> None:
    """Save the weights to best/ when `eval.keep_best` beats every earlier evaluation
    (the key is checked at step 0, which is never a candidate)."""
    key = trainer.cfg.eval.keep_best
    if key not in out:
        raise SystemExit(f"eval.keep_best={key}: not an eval metric of this run ({', '.join(sorted(out))})")
    prev = json.loads(trainer.best_json.read_text()) if trainer.best_json.exists() else None
    # NaN is no candidate; a resumed run re-evaluating a step keeps what was kept
    if trainer.step == 0 or not math.isfinite(out[key]) or (prev is not None and prev["step"] >= trainer.step):
        return
    if prev is None or out[key] > prev["value"]:
        common.save_final(trainer.model, trainer.tok, trainer.run.dir / "best")
        best = {"metric": key, "value": out[key], "step": trainer.step}
        common.atomic_write_text(trainer.best_json, json.dumps(best) + "\n")


def rollout_step(trainer: Trainer) -> tuple[list, list[sandbox.Episode]]:
    """This rank's share of the step's documents, each with its whole group of G rollouts."""
    cfg = trainer.cfg
    chosen = step_documents(len(trainer.train_docs), cfg.prompts_per_step, cfg.seed, trainer.step)
    docs = trainer.dist.shard([trainer.train_docs[i] for i in chosen])
    seed = rank_seed(cfg.sampling.seed, trainer.dist.rank) + 100_003 * trainer.step
    scfg = dataclasses.replace(cfg.sampling, seed=seed)
    return docs, sample(trainer, docs, cfg.group_size, scfg, trainer.gen) if docs else []


def score_step(trainer: Trainer, docs: list, eps: list[sandbox.Episode], reward_fn=None) -> tuple[list, list, list]:
    """(rewards of this rank's rollouts, every rank's per-rollout figures in rank order, turn advantages).
    The curriculum and the logged means see the whole step, and the loss its global rollout count."""
    G = trainer.cfg.group_size
    docs_rep = [d for d in docs for _ in range(G)]
    if not eps:  # more ranks than the step's documents: this one only joins the collectives
        results = []
    elif reward_fn is not None:
        results = reward_fn(docs_rep, eps)
    else:
        results = trainer.scorer.score_batch(list(zip(docs_rep, eps)), teacher=trainer.teacher)
    bad = [(d.id, r.get("total")) for d, r in zip(docs_rep, results) if not math.isfinite(r.get("total", math.nan))]
    if bad:
        raise FloatingPointError(f"step {trainer.step + 1}: non-finite reward for documents {bad[:4]}")
    mine = [episode_figures(ep, r) for ep, r in zip(eps, results)]
    step_figures = [x for part in trainer.dist.gather(mine) for x in part]
    if all("pass" in f for f in step_figures):
        trainer.scorer.curriculum.update([bool(f["pass"]) for f in step_figures])
    cfg = trainer.cfg
    turn_adv = turn_advantages(eps, results, G, cfg.advantage, cfg.turn_credit, cfg.reward.tools.w_match)
    return results, step_figures, turn_adv


@dataclass
class MicroBatch:
    """One forward and backward pass of the update: whole groups, or consecutive rollouts of
    one group (`rl.micro_batches`), with one entry per generated token in `flat`'s order."""
    episodes: list[sandbox.Episode]
    advantages: torch.Tensor  # (T,)
    sampler_logprobs: torch.Tensor  # (T,) what the sampler recorded, nan where it recorded none
    group: int  # rollouts per group tree when scored as groups
    ref_logprobs: torch.Tensor | None = None  # (T,) the reference policy's, when beta > 0
    old_logprobs: torch.Tensor | None = None  # (T,) the ratio's denominator, set by the update's first pass


def update_batches(trainer: Trainer, eps: list[sandbox.Episode], turn_adv: list) -> list[MicroBatch]:
    """The step's micro-batches of whole groups, with token advantages, the sampler's log-probs and,
    when beta > 0, the reference's. Groups whose every advantage is 0 are left out when beta == 0."""
    cfg, G = trainer.cfg, trainer.cfg.group_size
    scoring.validate_masks(eps, trainer.tok)  # every rollout, before every update
    keep = [i for g in range(0, len(eps), G)  # whole groups: a group tree needs all its rollouts
            if cfg.beta > 0 or any(x != 0 for a in turn_adv[g:g + G] for pair in a for x in pair)
            for i in range(g, g + G)]
    dev = next(trainer.model.parameters()).device
    batches = []
    for idx, group in micro_batches(cfg, eps, keep):
        mb = [eps[i] for i in idx]
        adv = token_advantages(mb, [turn_adv[i] for i in idx], call_tag_starts(mb, trainer.tok))
        adv = apply_retracted_credit(adv, retracted_mask(mb), cfg.retracted_credit)
        b = MicroBatch(mb, adv.to(dev), sampler_logprobs(mb).to(dev), group)
        if cfg.beta > 0:
            trainer.model.eval()
            reference = modeling.reference_model(trainer.model) if trainer.lora else contextlib.nullcontext()
            with torch.no_grad(), trainer.amp(), reference:
                b.ref_logprobs = logprobs(trainer.model if trainer.lora else trainer.ref_copy, mb, cfg,
                                          trainer.temperature, group)
        batches.append(b)
    return batches


def micro_batches(cfg: Config, eps: list[sandbox.Episode], keep: list[int]) -> list[tuple[list[int], int]]:
    """(rollout indices, rollouts per group tree) of each forward and backward pass of the update:
    `micro_groups` whole groups, or, under group scoring, a group whose tree would have more than
    `max_batch_tokens` nodes in parts of consecutive rollouts, each part's tree within it (the
    prompt again in each). A pass holds its activations until its backward, so this bounds the
    update's memory; each rollout's loss is its own, so the gradient is the same."""
    G = cfg.group_size
    out, whole = [], []
    for s in range(0, len(keep), G):
        group = keep[s:s + G]
        parts = tree_parts([eps[i] for i in group], cfg.max_batch_tokens) if cfg.score_method == "group" else [G]
        if len(parts) == 1:
            whole += group
            if len(whole) == cfg.micro_groups * G:
                out.append((whole, G))
                whole = []
            continue
        a = 0
        for n in parts:
            out.append((group[a:a + n], n))
            a += n
    return out + ([(whole, G)] if whole else [])


def tree_parts(group: list[sandbox.Episode], max_nodes: int) -> list[int]:
    """Sizes of the runs of consecutive rollouts that split `group`'s tree into trees of at most
    `max_nodes` nodes (a rollout whose own tree is larger goes alone): the prompt once, plus each
    rollout's own nodes (an upper bound: rollouts that open alike share more)."""
    sizes = [len(scoring.episode_trees([e], None)[0].ids) for e in group]
    prompt = len(group[0].prompt_ids or [])
    parts, nodes = [], 0
    for n in sizes:
        if parts and nodes + n - prompt <= max_nodes:
            parts[-1] += 1
            nodes += n - prompt
        else:
            parts.append(1)
            nodes = n
    return parts


def update(trainer: Trainer, batches: list[MicroBatch], n_rollouts: int) -> dict:
    """mu optimizer steps over the step's batches; returns the KL and clip sums, the sampler gap and the
    gradient norm. Aborts before updating on a non-finite loss or norm, or an off-policy gap."""
    cfg = trainer.cfg
    trainer.model.train()
    kl_sum, clip_n, gap_sum, gap_n, norm = 0.0, 0, 0.0, 0, 0.0
    for epoch in range(cfg.mu):
        for b in batches:
            with trainer.amp():
                logp = logprobs(trainer.model, b.episodes, cfg, trainer.temperature, b.group)
            if epoch == 0:
                # Old log-probs: the sampler's own when it is this model and mu == 1; else
                # this first pass's, detached (the same function and weights, before any update).
                b.old_logprobs = logp.detach() if cfg.mu > 1 or trainer.vllm else b.sampler_logprobs
                ok = ~torch.isnan(b.sampler_logprobs)
                gap_sum += (logp.detach()[ok] - b.sampler_logprobs[ok]).abs().sum().item()
                gap_n += int(ok.sum())
            is_w = None
            if trainer.vllm:  # truncated IS; tokens the sampler gave no log-prob for keep weight 1
                is_w = torch.exp(b.old_logprobs - b.sampler_logprobs).clamp(max=cfg.tis_cap).nan_to_num(1.0)
            # Dr. GRPO: one constant for every token of the step (every rank's rollouts),
            # whatever its sequence's length
            loss, kl, clipped = dr_grpo_loss(logp, b.old_logprobs, b.advantages, n_rollouts,
                                             cfg.sampling.max_new_tokens, clip_low=cfg.clip_low,
                                             clip_high=cfg.clip_high, ref_logp=b.ref_logprobs, beta=cfg.beta,
                                             is_weight=is_w)
            if not torch.isfinite(loss):
                names = list(dict.fromkeys(e.doc_id for e in b.episodes))[:4]
                raise FloatingPointError(f"step {trainer.step + 1}: loss is {loss.item()} (documents {names}); "
                                         "aborting before the update")
            loss.backward()
            if epoch == cfg.mu - 1:
                kl_sum += kl.sum().item() if kl is not None else 0.0
                clip_n += int(clipped.sum())
        if epoch == 0 and trainer.dist.world > 1:  # the whole step's gap, so every rank stops or none does
            gap_sum, gap_n = map(sum, zip(*trainer.dist.gather((gap_sum, gap_n))))
        gap = gap_sum / gap_n if gap_n else math.nan
        if epoch == 0 and gap_n and gap > cfg.max_logprob_gap:
            raise RuntimeError(f"step {trainer.step + 1}: trainer and sampler log-probs differ by {gap:.3f} nats per "
                               f"token (max_logprob_gap={cfg.max_logprob_gap}): the update would not be "
                               "on-policy. Check dropout, the chat template, and that the model returns the "
                               "logits asked for. Nothing was updated.")
        norm = training.apply_gradients(trainer.params, trainer.opt, max_grad_norm=cfg.max_grad_norm,
                                        step=trainer.step, dist=trainer.dist)
    return {"kl_sum": kl_sum, "clip_n": clip_n, "gap": gap, "grad_norm": norm}


def step_fields(trainer: Trainer, step_figures: list[dict], batches: list[MicroBatch], upd: dict,
                times: Sequence[float]) -> dict:
    """The step's log line: reward terms, tool use, KL, clip share, entropy, the sampler gap, timings
    (`times`: the step's start and the ends of rollout, scoring and update)."""
    t0, t1, t2, t3 = times
    mine = (sum(len(b.advantages) for b in batches), upd["kl_sum"], upd["clip_n"])
    scored, kl_sum, clip_n = map(sum, zip(*trainer.dist.gather(mine)))  # the whole step's, every rank's
    n_eps, tokens = len(step_figures), sum(f["tokens"] for f in step_figures)
    n_lp = sum(f["n_lp"] for f in step_figures)
    return {
        **{k: common.mean(f.get(key) for f in step_figures) for k, key in (
            ("reward", "total"), ("pass", "pass"))},
        "tau": trainer.scorer.curriculum.tau,
        **{k: common.mean(f.get(key) for f in step_figures) for k, key in (
            ("fact", "factuality"), ("rules", "rules"), ("budget", "budget"), ("cap", "cap_penalty"),
            ("match", "tool_match"), ("right_del", "right_deletes"))},
        "kl": kl_sum / max(1, scored) if trainer.cfg.beta > 0 else math.nan, "clip": clip_n / max(1, scored),
        # entropy: estimated as the mean negative log-prob of the sampled tokens
        "entropy": sum(f["nll"] for f in step_figures) / n_lp if n_lp else math.nan,
        "len": tokens / n_eps, "search": sum(f["n_search"] for f in step_figures) / n_eps,
        "delete": sum(f["n_delete"] for f in step_figures) / n_eps,
        "valid": sum(f["valid"] for f in step_figures) / n_eps,
        "gap": upd["gap"], "grad_norm": upd["grad_norm"], "lr": trainer.sched.get_last_lr()[0],
        "rollout_s": t1 - t0, "reward_s": t2 - t1, "update_s": t3 - t2, "tok_s": tokens / (t3 - t0),
    }


def write_samples(trainer: Trainer, eps: list[sandbox.Episode], results: list[dict]) -> None:
    """samples.jsonl: the first `eval.n_samples` rollouts of the step with their reward terms."""
    for ep, r in list(zip(eps, results))[:trainer.cfg.eval.n_samples]:
        trainer.samples.write(step=trainer.step, doc_id=ep.doc_id, reward={k: v for k, v in r.items()
                                                               if isinstance(v, (int, float, bool))},
                        summary=ep.summary, text=ep.text, n_search=ep.n_search, n_delete=ep.n_delete)


def finish(trainer: Trainer, history: list[dict], last_eval: dict) -> dict:
    """Rank 0 evaluates and saves final/ (the best evaluated step's weights with `eval.keep_best`);
    the other ranks wait in close_distributed."""
    final = trainer.run.dir / "final"
    if trainer.dist.main:
        if trainer.eval_docs:
            last_eval = evaluate(trainer)
        if trainer.cfg.eval.keep_best and trainer.best_json.exists():
            best = json.loads(trainer.best_json.read_text())
            with common.atomic_dir(final) as tmp:
                shutil.copytree(trainer.run.dir / "best", tmp, dirs_exist_ok=True)
            print(f"final: the weights of step {best['step']} ({best['metric']} {best['value']:.4g}, the best "
                  "evaluated)")
        else:
            common.save_final(trainer.model, trainer.tok, final)
    if history:
        first, last = history[0], history[-1]
        print(f"done: reward {first['reward']:.3f} -> {last['reward']:.3f}, pass {first['pass']:.3f} -> "
              f"{last['pass']:.3f} (training batches); model saved to {final}")
    trainer.run.finish()
    common.close_distributed(trainer.dist)
    return {"history": history, "eval": last_eval, "step": trainer.step}


def main(cfg: Config, reward_fn: Callable[[list, list], list[dict]] | None = None) -> dict:
    """Train; returns {"history": per-step metrics, "eval": the last held-out evaluation, "step"}.
    `reward_fn(documents, episodes) -> [{"total": ..., ...}]` replaces the configured reward."""
    trainer = setup(cfg, custom_reward=reward_fn is not None)
    history, last_eval = [], {}
    if trainer.step == 0 and trainer.eval_docs and trainer.dist.main:  # the other ranks wait at the next collective
        last_eval = evaluate(trainer)
    bar = tqdm(total=cfg.steps, initial=trainer.step, desc="rl", unit="step", dynamic_ncols=True,
               disable=not trainer.dist.main)
    while trainer.step < cfg.steps:
        t0 = time.perf_counter()
        docs, eps = rollout_step(trainer)  # G rollouts of each document, the sandbox in the loop
        t1 = time.perf_counter()
        results, step_figures, turn_adv = score_step(trainer, docs, eps, reward_fn)  # rewards, group advantages
        t2 = time.perf_counter()
        batches = update_batches(trainer, eps, turn_adv)  # token advantages, the reference's log-probs
        upd = update(trainer, batches, len(step_figures))  # the loss, backward(), the optimizer's step()
        t3 = time.perf_counter()
        fields = step_fields(trainer, step_figures, batches, upd, (t0, t1, t2, t3))  # the lr this step used
        trainer.sched.step()
        trainer.step += 1
        bar.update(1)
        trainer.run.log(trainer.step, cfg.steps, fields, t3 - t0)
        history.append(fields)
        if cfg.eval.sample_every and trainer.step % cfg.eval.sample_every == 0 and trainer.samples is not None:
            write_samples(trainer, eps, results)
        if (cfg.eval.every and trainer.step % cfg.eval.every == 0 and trainer.step < cfg.steps and trainer.eval_docs
                and trainer.dist.main):
            last_eval = evaluate(trainer)
        if cfg.save_every and (trainer.step % cfg.save_every == 0 or trainer.step == cfg.steps):
            common.save_checkpoint(trainer.run.dir, trainer.step, trainer.model, trainer.opt, trainer.sched,
                                   state={"scorer": trainer.scorer.state_dict()}, generators={"sample": trainer.gen},
                                   keep=cfg.keep_checkpoints, dist=trainer.dist)
    bar.close()
    return finish(trainer, history, last_eval)


if __name__ == "__main__":
    with settings.config_errors_exit():
        _cfg, _flags = settings.parse_args(Config, flags=("--plan",))
    if "--plan" in _flags:
        print(vram.format_rl_plan(_cfg))
    else:
        main(_cfg)
