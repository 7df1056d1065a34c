"""Deletion-aware SFT on tool-use traces; rejection-sampled re-SFT; continued teacher SFT.

    python sft.py --config configs/sft_tiny.yaml          # CPU: a tiny model from scratch, minutes
    python sft.py --config configs/sft_qwen3_4b.yaml      # one GPU: LoRA on a 4-bit base (Unsloth if asked)
    python sft.py --config configs/sft_tiny.yaml mode=rejection init=runs/sft_tiny/final

Every episode is trained as its branches (DESIGN.md section 4): the loss covers exactly the generated
ids, each once, under the context it was generated in; prompt, results and the re-encoded tail after
a delete are context only. Scoring is `scoring.episode_logprobs`, as in RL and distillation, so SFT
learns exactly the conditionals that rollouts sample.

Modes (`mode`):
- `sft`: the trace corpus (`data.train`).
- `rejection`: rollouts of the current policy that pass the reward, added to the whole base corpus
  as `rejection.mix_ratio` of it (the recipe: 50/50).
- `teacher`: continued SFT from `init` on teacher episodes (`teacher_episodes.py`) that pass the reward.
- `kto`: KTO on episodes (`kto_loss`), desirable those that pass the reward, with the recipe's early
  stop on held-out summary emission (`kto.min_emission_ratio`).
Held-out evaluation: `evaluation.greedy_eval` (factual_tools/evaluation.py); checkpoints and
`resume=auto`: DESIGN.md section 7.

Departures: the loss is the mean over generated tokens of a step (the usual SFT normalisation), not
per sequence; episodes longer than `data.max_tokens` are skipped and counted, never cut (a cut would
train a dangling tool call).
"""
from __future__ import annotations

import collections
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

import data
import rewards
import sandbox
from factual_tools import common, engine, evaluation, modeling, scoring, settings
from factual_tools.training import EpochBatches, n_generated, optimizer_step, sequence_loss, tokenize_episodes


@dataclass
class SFTData:
    train: str = "out/corpus/newsworld/train.jsonl"  # Episode JSONL (filter_traces.py output)
    eval: str = "out/corpus/newsworld/eval.jsonl"  # held-out episodes: eval loss, and their documents for sampling
    docs: str = ""  # Document JSONL with fact tables (needed for the oracle factuality backend)
    max_tokens: int = 2048  # longest branch allowed (prompt included); longer episodes are skipped
    limit: int = 0  # use only the first N training episodes (0 = all)
    # The base stage (a CPU stand-in for pretraining): > 0 trains tool-free on this many
    # freshly generated news-world documents of `world_seed`, streamed, their reference
    # summaries the targets; `train` and `eval` are then unused.
    generate: int = 0
    world_seed: int = 1  # another world than the one data.docs was drawn from
    # With generate: the split of data.docs. Generated documents that near-duplicate its
    # eval or never-touch pools are skipped (data.LeakGuard); its eval pool is the held-out set.
    split: str = ""
    # The tool-free control: every training and eval episode becomes its final summary alone
    # (the text that survives its deletes: no tool call, no results, no retracted text), on the
    # same document; episodes whose final summary is empty are dropped (`strip_tools`).
    strip_tools: bool = False


@dataclass
class SFTEval:
    every: int = 50  # optimizer steps between eval-loss passes (0 = only at the end)
    sample_every: int = 0  # steps between sampled held-out generations (0 = only at the end)
    n_docs: int = 32  # held-out documents sampled
    max_new_tokens: int = 160


@dataclass
class RejectionConfig:
    k: int = 4  # rollouts per training document
    # Share of passing rollouts in the re-SFT corpus: the whole base corpus is kept and the
    # passing rollouts are repeated to make this share (the recipe's 50/50); 0: each once.
    mix_ratio: float = 0.5
    max_docs: int = 256  # training documents sampled from
    temperature: float = 1.0


@dataclass
class KTOConfig:
    # KTO (Ethayarajh et al. 2024) on whole episodes: desirable = valid and passing the
    # reward, undesirable = the rest. The recipe's stage 4: beta 0.02, one epoch.
    beta: float = 0.02
    desirable_weight: float = 1.0  # lambda_D
    undesirable_weight: float = 1.0  # lambda_U (TRL: keep lambda_D n_D / (lambda_U n_U) in [1, 4/3])
    # The recipe's early-stop guard: stop the moment the share of held-out greedy episodes
    # that emit a summary (non-empty, not truncated) falls below this share of its value
    # before training (checked every eval.sample_every steps; 0: off).
    min_emission_ratio: float = 0.9


@dataclass
class TeacherConfig:
    # Keep only teacher episodes that are valid and pass the reward (F >= tau and every
    # rule): the recipe's production-strict filter of the teacher's rollouts.
    strict: bool = True
    # Up-sample every bucket to the largest one (the recipe matched its rarest intent
    # bucket to the commonest): "tools" buckets by the tools an episode used (none,
    # search only, delete), "meta" by Episode.meta["bucket"], "none" leaves counts alone.
    bucket: Literal["none", "tools", "meta"] = "tools"


@dataclass
class Config:
    name: str = "sft"  # run name: outputs go to runs_dir/name
    runs_dir: str = "runs"
    mode: Literal["sft", "rejection", "teacher", "kto"] = "sft"
    log: common.LogConfig = field(default_factory=common.LogConfig)  # TensorBoard / W&B besides metrics.jsonl
    init: str = ""  # start from this directory (a previous run's final/): weights, or an adapter
    model: modeling.ModelConfig = field(default_factory=modeling.ModelConfig)
    data: SFTData = field(default_factory=SFTData)
    eval: SFTEval = field(default_factory=SFTEval)
    rejection: RejectionConfig = field(default_factory=RejectionConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    kto: KTOConfig = field(default_factory=KTOConfig)
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
    # Error masking: ids holding text that a later delete retracted get no loss (the wrong
    # sentence is context for the search and delete after it). Off trains every generated id,
    # the errors included: then the policy learns to write them (63% of the news-world
    # corpus's final sentences are corrections).
    mask_retracted: bool = True
    # Evidence-copy weight: the ids of the sentence written in place of a deleted one (the
    # turn right after a delete, to the end of its first sentence: in the news-world traces
    # a copy of the search result) count this many times in the loss. A from-scratch tiny
    # model copies the result's words but keeps its own values at 1; real models need no
    # help (1.0 is plain SFT).
    rewrite_weight: float = 1.0
    # Decision weight: the first id written after a search's results (write on, or delete) counts
    # this many times, and is trained even when error masking hides the text it begins (a check
    # of a right sentence followed by a wrong one must still teach "keep"). 1.0: plain SFT. At 1.0
    # SmolLM2 learnt the prior, not the decision: on its own training traces it gave P(delete)
    # 0.66 after checks that keep and 0.71 after checks that delete.
    decision_weight: float = 1.0
    # tree: an episode's branches in one sequence with a 4D mask (sdpa/eager attention);
    # branch: each branch its own sequence (any attention implementation, e.g. Unsloth's)
    score_method: Literal["tree", "branch"] = "tree"
    # bf16 autocast of forward and backward, weights and optimizer in fp32: "auto" turns it on
    # only where the hardware multiplies bf16 natively and, on a CPU, for a model 512 wide or
    # more (common.choose_autocast; many times slower on an AVX2-only CPU); "none" / "bf16" force it
    autocast: common.Autocast = "auto"
    torch_threads: int = 0  # CPU threads for torch (0 = its default); 1 when other jobs share the cores
    log_every: int = 10  # steps between step lines
    save_every: int = 100  # optimizer steps between checkpoints
    keep_checkpoints: int = 2
    resume: str = "auto"  # auto | none | a checkpoint path
    mask_check: int = 64  # episodes validated before the first step
    seed: int = 0

    def __post_init__(self):
        modeling.check_score_method(self.model.backend, self.score_method)
        if not self.rewrite_weight >= 0:
            raise settings.ConfigError(f"rewrite_weight={self.rewrite_weight}: must be >= 0 (1 is plain SFT)")
        if not self.decision_weight >= 0:
            raise settings.ConfigError(f"decision_weight={self.decision_weight}: must be >= 0 (1 is plain SFT)")
        if self.log_every < 1:
            raise settings.ConfigError(f"log_every={self.log_every}: must be >= 1")
        if self.data.strip_tools and self.data.generate:
            raise settings.ConfigError("data.strip_tools strips a trace corpus (data.train); the base stage "
                                       "(data.generate) trains on tool-free reference summaries already")
        if self.data.strip_tools and self.mode == "rejection":
            raise settings.ConfigError("data.strip_tools with mode=rejection would mix a stripped corpus with the "
                                       "policy's tool rollouts; strip_tools takes mode=sft, teacher or kto")


# ---------------------------------------------------------------------------
# Pure pieces (tests import these)
# ---------------------------------------------------------------------------


def episode_logprob_sums(model, episodes, max_batch_tokens: int = 16384, method: str = "tree") -> torch.Tensor:
    """(B,) log p(episode): the sum over its generated ids under the contexts they were
    generated in (branch-exact, as SFT scores them)."""
    lps = scoring.episode_logprobs(model, episodes, method=method, max_batch_tokens=max_batch_tokens)
    dev = next(model.parameters()).device
    return torch.stack([sum((lp.float().sum() for lp in per_turn if lp is not None and lp.numel()),
                            torch.zeros((), device=dev)) for per_turn in lps])


def kto_loss(policy: torch.Tensor, reference: torch.Tensor, desirable: torch.Tensor, beta: float,
             w_desirable: float = 1.0, w_undesirable: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """KTO's per-example losses (B,) and the reference point z.

    r = log pi(y|x) - log pi_ref(y|x); z = max(0, mean r) over the batch, no gradient;
    desirable: w_D (1 - sigmoid(beta (r - z))), undesirable: w_U (1 - sigmoid(beta (z - r))).
    Departure from TRL's KTOTrainer: z is estimated from the batch's own episodes, not from
    mismatched (prompt, completion) pairs: a tool episode's completion holds its own
    document's search results, so it is no completion of another prompt."""
    r = policy - reference
    z = r.detach().mean().clamp(min=0)
    d = desirable.to(r.dtype)
    losses = d * w_desirable * (1 - torch.sigmoid(beta * (r - z))) + \
        (1 - d) * w_undesirable * (1 - torch.sigmoid(beta * (z - r)))
    return losses, z


def kto_step_loss(model, ref_copy, episodes: list, labels: dict, cfg: Config, n_step: int) -> torch.Tensor:
    """A micro-batch's share of the step's mean KTO loss (`n_step` episodes in the step).
    The reference: `ref_copy` (a full fine-tune), else the model under
    `modeling.reference_model` (the starting adapter, or the base with a fresh one)."""
    policy = episode_logprob_sums(model, episodes, cfg.max_batch_tokens, cfg.score_method)
    with torch.no_grad():
        was = model.training
        model.eval()
        if ref_copy is not None:
            reference = episode_logprob_sums(ref_copy, episodes, cfg.max_batch_tokens, cfg.score_method)
        else:
            with modeling.reference_model(model):
                reference = episode_logprob_sums(model, episodes, cfg.max_batch_tokens, cfg.score_method)
        model.train(was)
    desirable = torch.tensor([labels[id(e)] for e in episodes], device=policy.device)
    losses, _ = kto_loss(policy, reference, desirable, cfg.kto.beta, cfg.kto.desirable_weight,
                         cfg.kto.undesirable_weight)
    return losses.sum() / n_step


def documents_of(episodes: list, docs_path: str) -> list:
    """Each episode's document: the record of `docs_path` with its doc_id when given
    (the oracle grades with its fact table), else the episode's own text."""
    by_id = {}
    if docs_path:
        by_id = {d.id: d for d in data.read_documents(docs_path)}
    return [by_id.get(e.doc_id) if e.doc_id in by_id else _Doc(e.doc_id, e.document) for e in episodes]


def kto_labels(episodes: list, cfg: Config) -> list[bool]:
    """Desirable: a valid episode that passes the reward."""
    good = set(map(id, passing(episodes, documents_of(episodes, cfg.data.docs), cfg.reward)))
    return [id(e) in good for e in episodes]


@torch.no_grad()
def eval_loss(model, episodes, max_batch_tokens: int, batch: int = 16, mask_retracted: bool = False,
              method: str = "tree") -> float:
    was = model.training
    model.eval()
    total, n = 0.0, 0
    for s in range(0, len(episodes), batch):
        chunk = episodes[s:s + batch]
        k = sum(n_generated(e, mask_retracted) for e in chunk)
        total += sequence_loss(model, chunk, k, max_batch_tokens, mask_retracted=mask_retracted,
                               method=method).item() * k
        n += k
    model.train(was)
    return total / max(1, n)


def held_out_documents(episodes, docs_path: str, n: int) -> list:
    """The documents behind held-out episodes (Document records when a docs
    file is given, so the oracle can grade), first `n` distinct ones (0: none)."""
    if n <= 0 or not episodes:
        return []
    by_id = {}
    if docs_path:
        if not Path(docs_path).exists():
            raise SystemExit(f"data.docs={docs_path}: no such file; the held-out episodes' documents (their fact "
                             f"tables) are read from it: `python -m newsworld generate --n 1000 --seed 0 --out "
                             f"{docs_path}` writes the news world's, or set data.docs=''")
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


def sample_eval(model, tokenizer, documents, cfg: Config) -> dict:
    """The greedy held-out evaluation (`evaluation.greedy_eval`) of `documents` under
    this run's reward and sandbox limits, its figures prefixed `eval_` as in rl.py."""
    if not documents:
        return {}
    ecfg = evaluation.Config(reward=cfg.reward, limits=cfg.limits, max_new_tokens=cfg.eval.max_new_tokens,
                             seed=cfg.seed)
    return {f"eval_{k}": v for k, v in evaluation.greedy_eval(model, tokenizer, documents, ecfg)[0].items()}


def summary_episode(document: str, summary: str, doc_id: str | None) -> sandbox.Episode:
    """A tool-free episode of `document` whose one turn is `summary`."""
    ep = sandbox.replay(document, summary)
    ep.doc_id = doc_id
    return ep


def reference_episodes(docs, tokenizer) -> list[sandbox.Episode]:
    """Each document's reference summary as a tool-free episode, tokenised: the base stage's corpus."""
    return [summary_episode(d.text, d.summary, d.id).tokenized(tokenizer) for d in docs]


def strip_tools(episodes) -> tuple[list[sandbox.Episode], int]:
    """Each trace as a tool-free episode whose one turn is its final summary (`ep.summary`:
    no tool call, no results, no retracted text), on the same document, doc_id and meta:
    the corpus of the tool-free control. Returns (those episodes, how many were dropped
    because their final summary is empty)."""
    out = []
    for ep in episodes:
        if not ep.summary.strip():
            continue
        plain = summary_episode(ep.document, ep.summary, ep.doc_id)
        if plain.calls or len(plain.turns) != 1:
            raise ValueError(f"episode {ep.doc_id}: its final summary replays as {len(plain.turns)} turns "
                             f"with {len(plain.calls)} tool calls, not one plain turn: {ep.summary[:80]!r}")
        plain.meta = dict(ep.meta)
        out.append(plain)
    return out, len(episodes) - len(out)


def stripped_corpus(train: list, held: list, tokenizer, mask_retracted: bool) -> tuple[list, list]:
    """`strip_tools` on the training and eval episodes, with one line saying what remains."""
    (train2, dropped), (held2, held_dropped) = strip_tools(train), strip_tools(held)
    targets = lambda eps: sum(n_generated(e.tokenized(tokenizer), mask_retracted) for e in eps)  # noqa: E731
    print(f"data.strip_tools: every episode is its final summary alone (no tool call, results or retracted text): "
          f"{len(train)} -> {len(train2)} training episodes ({dropped} with an empty final summary dropped), "
          f"{targets(train)} -> {targets(train2)} target tokens; {len(held)} -> {len(held2)} eval episodes "
          f"({held_dropped} dropped)")
    return train2, held2


class WorldStream:
    """The base stage's training data: micro-batch m holds the generated documents
    m*B .. m*B+B-1 of the world `cfg.world_seed` (cycling over `cfg.generate`), less
    those `guard` finds in a held-out cluster. A document depends only on (seed,
    index), so the cursor is the micro-batch index and a resumed run sees the same data."""

    def __init__(self, cfg: SFTData, batch: int, guard=None):
        self.cfg, self.batch, self.guard = cfg, batch, guard
        self.skipped: set[str] = set()

    def documents(self, m: int) -> list:
        import newsworld

        indices = (j % self.cfg.generate for j in range(m * self.batch, (m + 1) * self.batch))
        out, skipped = newsworld.fresh_documents(indices, self.cfg.world_seed, self.guard)
        self.skipped.update(skipped)
        return out

    def episodes(self, m: int, tokenizer) -> list[sandbox.Episode]:
        return reference_episodes(self.documents(m), tokenizer)


def base_data(cfg: SFTData, tokenizer, n_eval: int) -> tuple[object, list[sandbox.Episode], list]:
    """(guard, held-out episodes, held-out documents) of the base stage: the eval pool
    of `cfg.split` over `cfg.docs` (their reference summaries give the eval loss), and
    a guard holding its eval and never-touch pools."""
    if not (cfg.docs and cfg.split):
        return None, [], []
    for path in (cfg.docs, cfg.split):
        if not Path(path).exists():
            raise SystemExit(f"data.generate needs {path} (the documents and split whose held-out pools stay out "
                             f"of the stream): run `python -m newsworld generate --n 1000 --seed 0 --out {cfg.docs}` "
                             f"and `python data.py split --docs {cfg.docs} --out {cfg.split}` (the pipeline's docs "
                             "and split stages), or set data.split=''")
    try:
        docs, manifest = data.read_documents(cfg.docs), data.read_manifest(cfg.split)
        guard = data.held_out_guard(docs, manifest, cfg.split)
        evals = data.pool_documents(docs, manifest, "eval", cfg.split)[:n_eval]
    except (data.DataError, data.LeakError) as e:
        raise SystemExit(f"error: {e}") from None
    return guard, reference_episodes(evals, tokenizer), evals


def mix_rejection(base: list, passed: list, ratio: float, seed: int = 0) -> list:
    """The whole base corpus plus the passing rollouts, repeated (each as evenly as
    possible, the remainder drawn at random) until they are `ratio` of the result;
    `ratio` <= 0: each once. The base is never cut: the recipe concatenates."""
    if not passed:
        return list(base)
    if ratio <= 0 or not base:
        return list(base) + list(passed)
    want = max(len(passed), round(len(base) * ratio / (1 - ratio))) if ratio < 1 else len(passed)
    reps, extra = divmod(want, len(passed))
    rng = random.Random(seed)
    return list(base) + list(passed) * reps + rng.sample(list(passed), extra)


def passing(episodes: list, docs: list, reward: rewards.RewardConfig) -> list:
    """The episodes that are valid and pass the reward (scored against `docs`, one per episode)."""
    scores = rewards.Scorer(reward).score_batch(list(zip(docs, episodes)))
    return [e for e, s in zip(episodes, scores) if s["pass"] and e.valid]


def bucket_of(ep: sandbox.Episode, how: str) -> str:
    if how == "meta":
        return str(ep.meta.get("bucket", ""))
    return "delete" if ep.n_delete else "search" if ep.n_search else "none"


def upsample_buckets(episodes: list, how: str, seed: int = 0) -> list:
    """Every bucket repeated (then topped up at random) to the size of the largest."""
    if how == "none" or not episodes:
        return list(episodes)
    buckets: dict[str, list] = {}
    for ep in episodes:
        buckets.setdefault(bucket_of(ep, how), []).append(ep)
    top = max(len(b) for b in buckets.values())
    rng, out = random.Random(seed), []
    for b in buckets.values():
        reps, extra = divmod(top, len(b))
        out += b * reps + rng.sample(b, extra)
    return out


def rejection_corpus(model, tokenizer, base, cfg: Config, limits, generator) -> list[sandbox.Episode]:
    """Rollouts of the current policy on training documents that pass the reward,
    added to the whole base corpus (`mix_rejection`)."""
    docs = held_out_documents(base, cfg.data.docs, cfg.rejection.max_docs)
    scfg = engine.SamplingConfig(temperature=cfg.rejection.temperature, max_new_tokens=cfg.eval.max_new_tokens,
                                  seed=cfg.seed)
    eps = engine.rollout(model, tokenizer, docs, cfg.rejection.k, scfg, limits, generator=generator)
    passed = passing(eps, [d for d in docs for _ in range(cfg.rejection.k)], cfg.reward)
    mixed = mix_rejection(base, passed, cfg.rejection.mix_ratio, cfg.seed)
    print(f"rejection: {len(passed)}/{len(eps)} rollouts passed; corpus {len(base)} base episodes + "
          f"{len(mixed) - len(base)} passing ones")
    if not passed:
        print("rejection: no rollout passed; training on the base corpus alone")
    return mixed


def teacher_corpus(episodes: list, cfg: Config) -> list[sandbox.Episode]:
    """Teacher episodes for continued SFT: the valid ones that pass the reward
    (`teacher.strict`), each bucket up-sampled to the largest (`teacher.bucket`)."""
    kept = episodes
    if cfg.teacher.strict:
        kept = passing(episodes, documents_of(episodes, cfg.data.docs), cfg.reward)
    out = upsample_buckets(kept, cfg.teacher.bucket, cfg.seed)
    counts = collections.Counter(bucket_of(e, cfg.teacher.bucket) for e in kept)
    print(f"teacher: {len(kept)}/{len(episodes)} episodes kept" + (" (valid and passing)" if cfg.teacher.strict else "")
          + f"; buckets {dict(counts)} -> {len(out)} episodes")
    if not kept:
        raise SystemExit(f"{cfg.data.train}: no teacher episode passes the reward; nothing to train on "
                         "(teacher.strict=false trains on all of them)")
    return out


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def episode_corpus(cfg: Config, tok) -> tuple[list, list, list, WorldStream | None]:
    """(training episodes, held-out episodes, held-out documents, the base stage's stream or None):
    a stream of generated news-world documents (`data.generate`, the base stage) or the episode
    files `data.train` and `data.eval`, tokenised; tools stripped with `data.strip_tools`."""
    if cfg.data.generate:
        if cfg.mode != "sft":
            raise SystemExit(f"data.generate (the base stage) trains mode=sft, not mode={cfg.mode}")
        guard, held_eps, docs = base_data(cfg.data, tok, max(cfg.eval.n_docs, 64))
        docs = docs[:cfg.eval.n_docs]
        stream = WorldStream(cfg.data, cfg.batch_episodes, guard)
        print(f"data: a stream of {cfg.data.generate} generated news-world documents (world {cfg.data.world_seed})"
              + (f", held-out clusters of {cfg.data.split} kept out" if guard else "")
              + f"; {len(held_eps)} eval episodes, {len(docs)} held-out documents")
        return stream.episodes(0, tok), held_eps, docs, stream
    raw = sandbox.read_episodes(cfg.data.train)
    if cfg.data.limit:
        raw = raw[:cfg.data.limit]
    if not raw:
        raise SystemExit(f"{cfg.data.train}: no training episodes")
    held = sandbox.read_episodes(cfg.data.eval) if cfg.data.eval and Path(cfg.data.eval).exists() else []
    if cfg.data.strip_tools:
        raw, held = stripped_corpus(raw, held, tok, cfg.mask_retracted)
        if not raw:
            raise SystemExit(f"{cfg.data.train}: every final summary is empty; nothing to train on stripped")
    train, skipped = tokenize_episodes(raw, tok, cfg.data.max_tokens)
    held_eps, _ = tokenize_episodes(held, tok, cfg.data.max_tokens)
    docs = held_out_documents(held, cfg.data.docs, cfg.eval.n_docs)
    print(f"data: {len(train)} training episodes ({skipped} over {cfg.data.max_tokens} tokens skipped), "
          f"{len(held_eps)} eval episodes, {len(docs)} held-out documents")
    return train, held_eps, docs, None


def mode_corpus(cfg: Config, train: list, model, tok, *, dist, amp, limits, generator) -> list:
    """What `mode` trains on: the corpus (sft, kto), the policy's own passing rollouts beside it
    (rejection: each rank samples its share of the documents), the teacher's episodes (teacher)."""
    if cfg.mode == "rejection":
        with amp():
            mine = rejection_corpus(model, tok, dist.shard(train), cfg, limits, generator)
        passed = [e for part in dist.gather(mine) for e in part]
        return tokenize_episodes(passed, tok, cfg.data.max_tokens)[0]
    if cfg.mode == "teacher":
        return teacher_corpus(train, cfg)
    return train


def kto_setup(cfg: Config, train: list, model) -> tuple[dict, Any]:
    """(desirable or not, by episode id; the frozen reference of a full fine-tune, else None: an
    adapter's reference is the starting adapter, loaded beside it)."""
    desirable = kto_labels(train, cfg)
    n_d = sum(desirable)
    print(f"kto: {n_d} desirable, {len(train) - n_d} undesirable episodes (valid and passing the reward or not)")
    if n_d in (0, len(train)):
        print("kto: warning: one class only; KTO then pushes every episode the same way")
    ref_copy = modeling.frozen_copy(model) if not getattr(model, "peft_config", None) else None
    return {id(e): d for e, d in zip(train, desirable)}, ref_copy


def kto_emission_baseline(cfg: Config, state: dict, model, tok, docs: list, amp) -> tuple[float | None, dict]:
    """The KTO guard's baseline: the summary emission of the policy before KTO, kept in checkpoints
    so a resumed run compares alike; (None, state) when the guard is off."""
    if cfg.mode != "kto" or not cfg.kto.min_emission_ratio or not docs:
        return None, state
    emission0 = state.get("kto_emission0")
    if emission0 is None:  # (KTO runs as one process)
        with amp():
            emission0 = sample_eval(model, tok, docs, cfg)["eval_emission"]
        model.train()
    print(f"kto: summary emission before training {emission0:.3f}; early stop below "
          f"{cfg.kto.min_emission_ratio * emission0:.3f}")
    return emission0, {"kto_emission0": emission0}


def main(cfg: Config) -> dict:
    dist = common.init_distributed()  # torchrun: this rank's share of every batch (common.Dist)
    if dist.world > 1 and cfg.mode == "kto":
        raise SystemExit("mode=kto runs as one process: its reference point z is the mean over a whole "
                         "micro-batch, which no rank sees under torchrun; start it with python, not torchrun")
    run = common.start_run(cfg, dist)
    dev = common.device()
    common.seed_everything(cfg.seed)
    # the model from `init` (an adapter is continued, full weights get a fresh LoRA when
    # model.lora.enabled), else model.name_or_path; for KTO the starting adapter is also the reference
    model, tok = modeling.load_from_init(cfg.model, cfg.init, reference=cfg.mode == "kto",
                                         hint="train it first, or set init to a previous run's final/")
    bf16 = common.setup_compute(cfg.torch_threads, cfg.autocast, dev, model)
    amp = lambda: common.autocast(bf16, dev, model)  # noqa: E731  (entered per step: see common.autocast)
    gen = engine.make_generator(cfg.seed, model)
    train, held_eps, docs, stream = episode_corpus(cfg, tok)
    train = mode_corpus(cfg, train, model, tok, dist=dist, amp=amp, limits=sandbox.Limits.make(**cfg.limits),
                        generator=gen)
    labels, ref_copy = kto_setup(cfg, train, model) if cfg.mode == "kto" else ({}, None)
    checked = scoring.validate_masks(train, tok, cfg.mask_check, cfg.seed, cfg.mask_retracted)
    print(f"mask validation: {checked} episodes, every trained position is assistant text")

    per_epoch = math.ceil((cfg.data.generate if stream else len(train)) / cfg.batch_episodes)
    total_steps = max(1, max(1, round(cfg.epochs * per_epoch)) // cfg.grad_accum)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = common.cosine_schedule(opt, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    step, state = common.resume(run.dir, cfg.resume, model, opt, sched, generators={"sample": gen}, dist=dist)
    emission0, state = kto_emission_baseline(cfg, state, model, tok, docs, amp)
    lengths = [max(len(b.input_ids) for b in e.branches()) for e in train]
    corpus = EpochBatches(train, lengths, cfg.batch_episodes, cfg.bucket_window, cfg.seed)

    model.train()
    history: dict = {}
    bar = tqdm(total=total_steps, initial=step, desc="sft", dynamic_ncols=True, disable=not dist.main)
    t_last, tok_count = time.perf_counter(), 0
    while step < total_steps:
        if cfg.eval.every and step % cfg.eval.every == 0 and held_eps and dist.main:  # rank 0 evaluates
            history = _log_eval(run, step, model, tok, held_eps, docs, cfg=cfg, amp=amp, sample=False)
        batches = [stream.episodes(i, tok) if stream is not None else corpus(i)
                   for i in range(step * cfg.grad_accum, (step + 1) * cfg.grad_accum)]
        n_tok = sum(n_generated(e, cfg.mask_retracted) for b in batches for e in b)
        n_eps = sum(len(b) for b in batches)

        def loss_fn(b: list[sandbox.Episode]) -> tuple[torch.Tensor, dict]:  # each divided by the step's count
            with amp():
                if cfg.mode == "kto":
                    return kto_step_loss(model, ref_copy, b, labels, cfg, n_eps), {}
                return sequence_loss(model, b, n_tok, cfg.max_batch_tokens, mask_retracted=cfg.mask_retracted,
                                     method=cfg.score_method, rewrite_weight=cfg.rewrite_weight, tokenizer=tok,
                                     decision_weight=cfg.decision_weight), {}

        loss_value, _, norm, lr = optimizer_step(batches, loss_fn, params, opt, sched,
                                                 max_grad_norm=cfg.max_grad_norm, step=step, dist=dist)
        step += 1
        tok_count += n_tok
        bar.update(1)
        dt = time.perf_counter() - t_last
        if step % cfg.log_every == 0 or step == total_steps:
            run.log(step, total_steps, {"loss": loss_value, "lr": lr, "grad_norm": norm, "tok_s": tok_count / dt}, dt)
            t_last, tok_count = time.perf_counter(), 0
        if cfg.eval.sample_every and step % cfg.eval.sample_every == 0 and step < total_steps:
            ev = _log_eval(run, step, model, tok, held_eps, docs, cfg=cfg, amp=amp, sample=True) if dist.main else {}
            low = emission0 is not None and "eval_emission" in ev
            if low and ev["eval_emission"] < cfg.kto.min_emission_ratio * emission0:
                print(f"kto: early stop at step {step}: summary emission {ev['eval_emission']:.3f} < "
                      f"{cfg.kto.min_emission_ratio} x {emission0:.3f} before training")
                break
        if cfg.save_every and step % cfg.save_every == 0 and step < total_steps:
            common.save_checkpoint(run.dir, step, model, opt, sched, state=state, generators={"sample": gen},
                                   keep=cfg.keep_checkpoints, dist=dist)
    bar.close()
    if stream is not None and stream.skipped:
        print(f"leak guard: {len(stream.skipped)} generated documents near-duplicate a held-out one and were skipped")
    common.save_checkpoint(run.dir, step, model, opt, sched, state=state, generators={"sample": gen},
                           keep=cfg.keep_checkpoints, dist=dist)
    if dist.main:  # the other ranks wait in close_distributed
        final = common.save_final(model, tok, run.dir / "final")
        history = _log_eval(run, step, model, tok, held_eps, docs, cfg=cfg, amp=amp, sample=True)
        print(f"model saved to {final}")
    run.finish()
    common.close_distributed(dist)
    return history


def _log_eval(run, step, model, tok, held_eps, docs, *, cfg, amp, sample: bool) -> dict:
    with amp():
        out = _eval_figures(model, tok, held_eps, docs, cfg, sample)
    if out:
        evaluation.log_eval(run, step, out)
    return out


def _eval_figures(model, tok, held_eps, docs, cfg, sample: bool) -> dict:
    out = {}
    if held_eps:
        out["eval_loss"] = eval_loss(model, held_eps, cfg.max_batch_tokens, mask_retracted=cfg.mask_retracted,
                                     method=cfg.score_method)
    if sample:
        out.update(sample_eval(model, tok, docs, cfg))
        model.train()
    return out


if __name__ == "__main__":
    with settings.config_errors_exit():
        _cfg = settings.load_config(Config)
    main(_cfg)
