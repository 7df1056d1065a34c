"""The GPU memory planner: peak memory per stage (SFT, RL rollout and update) from a model's shape.

    python -m factual_tools.vram model=Qwen3-4B quant=4bit group_size=8   # model=all: every configs/models/ shape
    python rl.py --config configs/drgrpo_v19.yaml --plan     # the plan of one RL config

Pure arithmetic, so it runs anywhere and before any download.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Literal


from factual_tools.modeling import LORA_TARGETS
from factual_tools.settings import ConfigError, config_errors_exit, load_config


# ---------------------------------------------------------------------------
# GPU memory planner (DESIGN section 9)
# ---------------------------------------------------------------------------
# Pure arithmetic on a model's shape, so it runs anywhere and before any
# download. Units: GiB (2**30 bytes) throughout; the cards are taken as 24, 48,
# 80 and 141 GiB (RTX 4090/A6000-class, L40S/A6000, A100/H100, H200).
#
# Shapes: h hidden size, L layers, n_q and n_kv attention and key/value heads, d
# head dim, I intermediate size, V vocabulary, r LoRA rank. T is the number of
# tokens in a forward/backward: SFT batch x (prompt + completion); the RL update
# batch x G x (prompt + completion), or batch x (prompt + G x completion) when the
# group is scored as one prompt-rooted tree (share_prompt, DESIGN section 4).
#
#   weights      linear layers: 2 B/param in bf16, 4.127 bits/param in 4-bit NF4
#                (4 bits + an 8-bit absmax per 64 weights + an fp32 scale per 256
#                absmax: double quantisation), ~1 B/param in 8-bit; embeddings,
#                output head and norms stay unquantised, and the HF path's
#                prepare_model_for_kbit_training casts them to fp32.
#   adapter      LoRA: sum over targeted linears of r x (in + out) params, kept in
#                fp32 (peft upcasts adapters) with an fp32 gradient and two AdamW
#                moments: 16 B/param (10 B with 8-bit Adam). Full fine-tune: a
#                gradient in the weight dtype plus the two moments for every weight.
#   activations  what autograd keeps per token and layer: both norm inputs and
#                outputs (4h), q and the attention output (2 n_q d), k and v
#                (2 n_kv d), gate, up, act(gate) and their product (4I), and the
#                LoRA bottlenecks; flash/memory-efficient SDPA keeps no T x T scores.
#                No checkpointing: T x L x that. Checkpointing: T x L x h (the layer
#                inputs) plus one layer's worth recomputed during backward.
#                Unsloth offloads the layer inputs to CPU memory.
#   logits       tokens with a loss (all of them in SFT, the completions in RL) x V
#                x 10 bytes: the bf16 head output, its fp32 copy and the fp32
#                log-softmax kept for backward. Unsloth: 4 bytes (an fp32 head
#                output whose gradient its fused loss writes in place), and RL
#                log-probs one sequence at a time (chunked_logits).
#   kv cache     L x 2 x n_kv x d x 2 bytes per token, for batch x G x (prompt +
#                completion) tokens (prompt counted once per group with share_prompt).
#   vLLM         reserves gpu_memory_utilization x the card for its weights (a bf16
#                copy; Unsloth's engine shares the trainer's), LoRA slots, KV cache
#                and a workspace (a forward of 8192 batched tokens, the sampler's
#                fp32 logits for 256 sequences, CUDA graphs). The reservation stays
#                through the update: the trainer gets the rest of the card.
#   overhead     CUDA context, cuBLAS workspaces, allocator slack: 1 GiB.
#
# A stage fits a card of C GiB if its total is at most C; with vLLM that means
# its needs fit in u x C and the trainer's in (1 - u) x C, so the smallest card is
# max(vllm / u, trainer / (1 - u)).
# Not modelled: allocator fragmentation beyond the overhead, eager attention's T x T
# scores, fp32 residual streams behind upcast norms, vLLM sleep mode.
# tests/test_models.py checks the formulas against published figures.

GPU_SIZES_GB = (24, 48, 80, 141)
MODEL_CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs" / "models"
_GIB = 2 ** 30
_NF4_BITS = 4 + 8 / 64 + 32 / (64 * 256)
_LOGIT_BYTES = 2 + 4 + 4
_LOGIT_BYTES_FUSED = 4
_VLLM_BATCHED_TOKENS, _VLLM_MAX_SEQS, _VLLM_GRAPHS_GB = 8192, 256, 0.5
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The numbers of an HF config.json that decide memory."""
    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    head_dim: int

    @classmethod
    def from_config(cls, config: dict, name: str = "") -> "ModelShape":
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [k for k in keys if k not in config]
        if missing:
            raise ConfigError(f"model config {name!r} lacks {', '.join(missing)}")
        h, n_q = config["hidden_size"], config["num_attention_heads"]
        return cls(name=name or config.get("_name_or_path", "model"), hidden_size=h,
                   num_hidden_layers=config["num_hidden_layers"], num_attention_heads=n_q,
                   num_key_value_heads=config.get("num_key_value_heads") or n_q,
                   intermediate_size=config["intermediate_size"], vocab_size=config["vocab_size"],
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                   head_dim=config.get("head_dim") or h // n_q)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer."""
        h, q, kv, i = (self.hidden_size, self.num_attention_heads * self.head_dim,
                       self.num_key_value_heads * self.head_dim, self.intermediate_size)
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    @property
    def linear_params(self) -> int:
        return self.num_hidden_layers * sum(a * b for a, b in self.linear_shapes().values())

    @property
    def other_params(self) -> int:
        """Embeddings, output head (unless tied) and norms: never quantised."""
        embed = self.vocab_size * self.hidden_size
        return embed * (1 if self.tie_word_embeddings else 2) + (2 * self.num_hidden_layers + 1) * self.hidden_size

    @property
    def n_params(self) -> int:
        return self.linear_params + self.other_params

    def lora_params(self, rank: int, targets: list[str]) -> int:
        shapes = self.linear_shapes()
        names = list(shapes) if list(targets) == ["all-linear"] else list(targets)
        unknown = [t for t in names if t not in shapes]
        if unknown:
            raise ConfigError(f"unknown LoRA target(s) {unknown}; the planner knows {list(shapes)} and 'all-linear'")
        return self.num_hidden_layers * sum(rank * sum(shapes[t]) for t in names)

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * bytes_per_value


def load_model_config(name_or_path: str) -> ModelShape:
    """A short name from configs/models/ (`Llama-3.1-8B`, case-insensitive), or an HF
    config.json (the file or its directory)."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        shipped = {p.stem.lower(): p for p in MODEL_CONFIGS_DIR.glob("*.json")}
        key = name_or_path.rsplit("/", 1)[-1].lower()
        if key not in shipped:
            raise ConfigError(f"no model config {name_or_path!r}: not a file, and not one of "
                              f"{', '.join(sorted(p.stem for p in shipped.values()))}")
        path = shipped[key]
    config = json.loads(path.read_text(encoding="utf-8"))
    return ModelShape.from_config(config, name=path.stem if path.name != "config.json" else path.parent.name)


@dataclasses.dataclass
class PlanConfig:
    model: str = "Llama-3.1-8B"         # a name in configs/models/ or an HF config.json (or its directory)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # unquantised weights, activations
    quant: Literal["none", "4bit", "8bit"] = "4bit"
    lora_rank: int = 16                 # 0: full fine-tune
    lora_targets: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
    gradient_checkpointing: bool = True
    # hf: peft's kbit preparation, checkpoints on the GPU, vLLM with its own weights;
    # unsloth: checkpoints offloaded, vLLM shares the weights, chunked logits
    backend: Literal["hf", "unsloth"] = "hf"
    batch: int = 1                      # prompts per step (SFT: sequences per micro-batch)
    group_size: int = 8                 # rollouts per prompt (RL)
    prompt_len: int = 1024              # tokens
    completion_len: int = 256           # tokens
    gpu_memory_utilization: float = 0.5  # vLLM's share of the card; 0: generate with HF instead
    chunked_logits: bool = False        # log-probs one sequence at a time (always with unsloth)
    share_prompt: bool = False          # prefix-cache the prompt and score each group as one tree
    overhead_gb: float = 1.0            # CUDA context and allocator slack
    # data parallel (torchrun): every GPU holds the model, its adapter and optimizer, and
    # its share of `batch` (rounded up); the plan is per GPU
    gpus: int = 1
    tensor_parallel: int = 1            # GPUs vLLM splits its weights and KV cache over

    @property
    def batch_per_gpu(self) -> int:
        return -(-self.batch // self.gpus)

    def __post_init__(self):
        if self.gpus < 1 or self.tensor_parallel < 1:
            raise ConfigError(f"gpus and tensor_parallel must be >= 1, got {self.gpus} and {self.tensor_parallel}")
        if self.quant != "none" and self.lora_rank == 0:
            raise ConfigError("a quantised model trains through LoRA only: set lora_rank > 0 or quant=none")
        if not 0.0 <= self.gpu_memory_utilization < 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in [0, 1), got {self.gpu_memory_utilization}")
        if min(self.batch, self.group_size, self.completion_len) < 1 or self.prompt_len < 0 or self.lora_rank < 0:
            raise ConfigError("batch, group_size and completion_len must be >= 1; prompt_len, lora_rank >= 0")


@dataclasses.dataclass
class MemoryPlan:
    config: PlanConfig
    shape: ModelShape
    stages: dict[str, dict[str, float]]  # stage -> component -> GiB, vLLM's reservation apart
    vllm: dict[str, float]               # what vLLM holds inside its reservation (empty: HF generate)
    min_gpu_gb: dict[str, float]         # stage -> smallest card it fits
    fits: dict[str, dict[int, bool]]     # stage -> card size -> fits

    def beside_vllm(self, stage: str) -> bool:
        return bool(self.vllm) and stage in ("rollout", "update")

    def total_gb(self, stage: str, gpu_gb: float | None = None) -> float:
        """The stage's peak; beside vLLM it depends on the card (`gpu_gb`) vLLM reserves a share of."""
        trainer = sum(self.stages[stage].values())
        if not self.beside_vllm(stage):
            return trainer
        if gpu_gb is None:
            raise ValueError(f"stage {stage!r} runs beside vLLM: its total depends on gpu_gb")
        return trainer + self.config.gpu_memory_utilization * gpu_gb


def plan_memory(cfg: PlanConfig, shape: ModelShape | None = None) -> MemoryPlan:
    """Peak GPU memory of the SFT step, the RL rollout and the RL update (the
    formulas above), and which of GPU_SIZES_GB each fits."""
    s = shape or load_model_config(cfg.model)
    batch = cfg.batch_per_gpu  # this GPU's share under data parallel
    unsloth = cfg.backend == "unsloth"
    ab = _DTYPE_BYTES[cfg.dtype]  # activation bytes: 4-bit matmuls compute in this dtype too
    h, n_layers, vocab = s.hidden_size, s.num_hidden_layers, s.vocab_size
    lora = s.lora_params(cfg.lora_rank, cfg.lora_targets) if cfg.lora_rank else 0

    # Weights and the trainable state
    other_bytes = 4 if cfg.quant != "none" and not unsloth else ab
    linear_bytes = {"none": ab, "4bit": _NF4_BITS / 8, "8bit": 1.0}[cfg.quant]
    weights = s.linear_params * linear_bytes + s.other_params * other_bytes
    moments = 2 if cfg.optimizer == "adamw_8bit" else 8
    adapter = lora * (4 + 4 + moments) if cfg.lora_rank else s.n_params * (ab + moments)

    # One forward + backward over `tokens`
    n_targets = len(s.linear_shapes()) if cfg.lora_targets == ["all-linear"] else len(cfg.lora_targets)
    per_layer = (4 * h + 2 * s.num_attention_heads * s.head_dim + 2 * s.num_key_value_heads * s.head_dim
                 + 4 * s.intermediate_size + cfg.lora_rank * n_targets) * ab

    def activations(tokens: int) -> float:
        if not cfg.gradient_checkpointing:
            return tokens * n_layers * per_layer
        on_gpu = 2 if unsloth else n_layers  # layer inputs; Unsloth keeps only those in flight
        return tokens * (on_gpu * h * ab + per_layer)

    def logits(loss_tokens: int, per_sequence: int, chunked: bool) -> float:
        return (per_sequence if chunked else loss_tokens) * vocab * (_LOGIT_BYTES_FUSED if unsloth else _LOGIT_BYTES)

    overhead = cfg.overhead_gb * _GIB
    seq = cfg.prompt_len + cfg.completion_len
    n_seq = batch * cfg.group_size
    group_tokens = batch * (cfg.prompt_len + cfg.group_size * cfg.completion_len)  # prompt once per group
    stages: dict[str, dict[str, float]] = {}
    stages["sft"] = {"weights": weights, "adapter": adapter, "activations": activations(batch * seq),
                     "logits": logits(batch * seq, seq, cfg.chunked_logits), "overhead": overhead}

    # RL rollout: batch x G sequences of prompt + completion
    kv = (group_tokens if cfg.share_prompt else n_seq * seq) * s.kv_bytes_per_token(2 if ab == 2 else 4)
    u = cfg.gpu_memory_utilization
    vllm: dict[str, float] = {}
    if u > 0:
        tp = cfg.tensor_parallel  # vLLM shards its weights and KV heads over tp GPUs
        vllm = {"weights": 0.0 if unsloth else s.n_params * 2 / tp,  # Unsloth's engine uses the trainer's copy
                "lora": lora * 2, "kv_cache": kv / tp,
                "workspace": (_VLLM_BATCHED_TOKENS * (2 * s.intermediate_size + 4 * h) * 2
                              + _VLLM_MAX_SEQS * vocab * 4 * 2 + _VLLM_GRAPHS_GB * _GIB)}
        stages["rollout"] = {"weights": weights, "adapter": adapter, "overhead": overhead}
    else:
        prefill_rows = batch if cfg.share_prompt else n_seq
        prefill = prefill_rows * cfg.prompt_len * (2 * s.intermediate_size + 4 * h) * ab + n_seq * vocab * 4
        stages["rollout"] = {"weights": weights, "adapter": adapter, "kv_cache": kv, "prefill": prefill,
                             "overhead": overhead}

    # RL update: score (and backpropagate through) every rollout of the step
    update = {"weights": weights, "adapter": adapter,
              "activations": activations(group_tokens if cfg.share_prompt else n_seq * seq),
              "logits": logits(n_seq * cfg.completion_len, cfg.completion_len, cfg.chunked_logits or unsloth),
              "overhead": overhead}
    if cfg.share_prompt:  # the additive 4D tree mask, T x T per prompt
        update["tree_mask"] = batch * (cfg.prompt_len + cfg.group_size * cfg.completion_len) ** 2 * ab
    stages["update"] = update

    if vllm and unsloth:  # the shared weights sit inside vLLM's reservation, not beside it
        vllm["weights"] = weights
        for name in ("rollout", "update"):
            stages[name]["weights"] = 0.0
    stages = {k: {c: b / _GIB for c, b in v.items()} for k, v in stages.items()}
    vllm = {c: b / _GIB for c, b in vllm.items()}
    plan = MemoryPlan(cfg, s, stages, vllm, {}, {})
    for name, parts in stages.items():
        trainer = sum(parts.values())
        plan.min_gpu_gb[name] = max(sum(vllm.values()) / u, trainer / (1 - u)) if plan.beside_vllm(name) else trainer
        plan.fits[name] = {g: plan.min_gpu_gb[name] <= g for g in GPU_SIZES_GB}
    return plan


def format_plan(plan: MemoryPlan) -> str:
    """A table: one row per stage, GiB per component, the smallest card, and a fit mark per card."""
    c, s = plan.config, plan.shape
    targets = "all linear" if c.lora_targets == ["all-linear"] or set(c.lora_targets) >= set(LORA_TARGETS) \
        else ",".join(c.lora_targets)
    lora = (f"LoRA r={c.lora_rank} on {targets} ({s.lora_params(c.lora_rank, c.lora_targets) / 1e6:.1f}M)"
            if c.lora_rank else "full fine-tune")
    rollout = (f"vLLM reserves {c.gpu_memory_utilization:g} of the card ({sum(plan.vllm.values()):.2f} needed)"
               if plan.vllm else "HF generate")
    if c.tensor_parallel > 1 and plan.vllm:
        rollout += f", tensor-parallel over {c.tensor_parallel} GPUs"
    per_gpu = (f"; per GPU, {c.gpus} GPUs data-parallel (batch {c.batch}: {c.batch_per_gpu} per GPU)"
               if c.gpus > 1 else "")
    lines = [f"{s.name} ({s.n_params / 1e9:.2f}B): {c.quant if c.quant != 'none' else c.dtype}, {lora}, "
             f"{c.optimizer}, {'grad ckpt' if c.gradient_checkpointing else 'no grad ckpt'}, backend {c.backend}; "
             f"batch {c.batch} x G {c.group_size}, prompt {c.prompt_len} + completion {c.completion_len}; {rollout}"
             f"{per_gpu}"]
    cols = [k for k in ("weights", "adapter", "activations", "logits", "kv_cache", "prefill", "tree_mask", "overhead")
            if any(k in v for v in plan.stages.values())]
    lines.append(f"{'GiB':<8}" + "".join(f"{k:>12}" for k in cols) + f"{'total':>8}{'+vLLM':>7}{'min GPU':>9}"
                 + "".join(f"{g:>5}" for g in GPU_SIZES_GB))
    for name, parts in plan.stages.items():
        cells = "".join(f"{parts[k]:>12.2f}" if k in parts else f"{'-':>12}" for k in cols)
        beside = f"{c.gpu_memory_utilization:>5g}xC" if plan.beside_vllm(name) else f"{'':>7}"
        marks = "".join(f"{'yes' if plan.fits[name][g] else 'no':>5}" for g in GPU_SIZES_GB)
        lines.append(f"{name:<8}{cells}{sum(parts.values()):>8.2f}{beside}{plan.min_gpu_gb[name]:>9.1f}{marks}")
    if plan.vllm:
        lines.append("vLLM holds " + ", ".join(f"{k} {v:.2f}" for k, v in plan.vllm.items())
                     + f" GiB within its {c.gpu_memory_utilization:g} x C")
    return "\n".join(lines)


def rl_plan_config(cfg, batch: int, share_prompt: bool, gpus: int = 1) -> PlanConfig:
    """The planner's view of an RL run (`rl.Config`) with `batch` groups in flight
    (over `gpus` data-parallel ranks): completions of max_new_tokens plus the results
    blocks injected into them."""
    m = cfg.model
    return PlanConfig(gpus=gpus, tensor_parallel=m.tensor_parallel_size,
        model=cfg.plan.model or m.name_or_path,
        dtype="bfloat16" if m.dtype == "auto" else m.dtype,
        quant=m.quant, lora_rank=m.lora.rank if m.lora.enabled else 0, lora_targets=list(m.lora.target_modules),
        optimizer=cfg.optimizer, gradient_checkpointing=m.gradient_checkpointing, backend=m.backend,
        batch=batch, group_size=cfg.group_size,
        prompt_len=cfg.data.max_prompt_tokens or cfg.plan.prompt_len,
        completion_len=cfg.sampling.max_new_tokens + cfg.plan.injected_tokens,
        gpu_memory_utilization=m.gpu_memory_utilization if cfg.sampling.backend == "vllm" else 0.0,
        share_prompt=share_prompt)


def rl_memory_plan(cfg) -> MemoryPlan:
    """Rollout with every group of a step in flight, update one micro-batch of
    `micro_groups` groups at a time; a stage beside vLLM fits a card C when
    vLLM's needs fit u x C and the trainer's (1 - u) x C."""
    # vLLM's prefix cache holds a group's prompt once; the hf engine expands it to G
    # cache rows. Group scoring computes the prompt once per group; tree and branch per rollout.
    # Under torchrun each rank rolls out its share of the step's groups; every rank's
    # update takes `micro_groups` of its own groups per forward/backward.
    roll = plan_memory(rl_plan_config(cfg, cfg.prompts_per_step, cfg.sampling.backend == "vllm", cfg.plan.gpus))
    upd = plan_memory(rl_plan_config(cfg, cfg.micro_groups, cfg.score_method == "group"))
    plan = dataclasses.replace(roll, stages={"rollout": roll.stages["rollout"], "update": upd.stages["update"]},
                               vllm=roll.vllm, min_gpu_gb={}, fits={})
    u = plan.config.gpu_memory_utilization
    for name, parts in plan.stages.items():
        trainer = sum(parts.values())
        need = max(sum(plan.vllm.values()) / u, trainer / (1 - u)) if plan.vllm else trainer
        plan.min_gpu_gb[name] = need
        plan.fits[name] = {g: need <= g for g in GPU_SIZES_GB}
    return plan


def format_rl_plan(cfg) -> str:
    """`rl.py --config X --plan`: the rollout and update stages of an RL config, and the cards it fits."""
    plan = rl_memory_plan(cfg)
    verdict = ", ".join(f"{g} GB {'yes' if all(f[g] for f in plan.fits.values()) else 'no'}"
                        for g in GPU_SIZES_GB)
    n = cfg.plan.gpus
    flight = (f"{cfg.prompts_per_step} groups in flight" if n == 1 else
              f"{cfg.prompts_per_step} groups a step over {n} GPUs, {plan.config.batch_per_gpu} in flight on each")
    return (f"{format_plan(plan)}\n(rollout: {flight}; update: {cfg.micro_groups} group(s) per forward/backward"
            f"{' on each GPU' if n > 1 else ''})\nRL fits{' per GPU' if n > 1 else ''}: {verdict}")


def main(argv: list[str] | None = None) -> None:
    """`[--config FILE.yaml] [key=value ...]`: the plan of one model, or of every one (model=all)."""
    with config_errors_exit():
        cfg = load_config(PlanConfig, argv)
    names = sorted(p.stem for p in MODEL_CONFIGS_DIR.glob("*.json")) if cfg.model == "all" else [cfg.model]
    print("\n\n".join(format_plan(plan_memory(dataclasses.replace(cfg, model=n))) for n in names))


if __name__ == "__main__":
    main()
