"""Tiny policies, policy loading (LoRA, bitsandbytes, the reference view) and the memory planner.

One tiny-1m model is built per module, through the `python -m newsworld.tiny` command line, and
every model test loads it back through from_pretrained as a script would.
"""
import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import sandbox
from factual_tools import modeling, vram
from factual_tools.common import count_parameters
from factual_tools.modeling import LoraConfig, ModelConfig, frozen_copy, load_policy, reference_model
from factual_tools.settings import ConfigError, load_config
from factual_tools.vram import ModelShape, PlanConfig, load_model_config, plan_memory
from newsworld import tiny
from newsworld.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "examples" / "doc.txt").read_text(encoding="utf-8").strip()
TRACE = (ROOT / "examples" / "assistant.txt").read_text(encoding="utf-8").strip()
MARKUP = (
    'Acme reported revenue of $5 billion.<search>/revenue of \\$4\\.2 billion/</search>'
    "<results><0>Acme Corp. reported revenue of $4.2 billion.</0><1>Shares fell 3.5%.</1></results>"
    '<delete scope="sentence"/> Acme reported revenue of $4.2 billion.'
    "<search>Jane Doe growth</search><results><error>bad pattern: ‹x›</error></results>"
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "tiny-1m"
    run = subprocess.run([sys.executable, "-m", "newsworld.tiny", "--preset", "tiny-1m",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("tiny-1m (seed 0): ") and str(out) in run.stdout
    return out


@pytest.fixture(scope="module")
def tok(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


def _ids(batch: int = 2, length: int = 24, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(len(tiny.SPECIAL_TOKENS), 500, (batch, length), generator=g)


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def test_saved_tokenizer_is_the_trained_one(tiny_dir, tok):
    fresh = tiny.tiny_tokenizer()  # trained again in this process; the CLI trained it in another
    assert tok.get_vocab() == fresh.get_vocab()
    assert tok.backend_tokenizer.to_str() == fresh.backend_tokenizer.to_str()
    assert tok.chat_template == fresh.chat_template == tiny.CHAT_TEMPLATE
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|eot|>")
    assert tok.padding_side == "left"
    assert 1000 <= len(tok) <= tiny.TOKENIZER_VOCAB
    for text in (DOC, TRACE, MARKUP):
        assert tok.encode(text, add_special_tokens=False) == fresh.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", [DOC, TRACE, MARKUP, "  two  spaces, a tab\tand\nnewlines\n\n",
                                  "Café naïve — 5 € ‹quoted› 東京 🙂", ""])
def test_decode_inverts_encode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, clean_up_tokenization_spaces=False) == text
    assert sandbox.Codec(tok).decode(ids) == text


@pytest.mark.parametrize("text", [DOC, TRACE, MARKUP.replace("‹x›", "x")])
def test_token_by_token_decoding_concatenates_to_the_text(tok, text):
    codec = sandbox.Codec(tok)
    ids = codec.encode(text)
    assert "".join(codec.piece(i) for i in ids) == text
    decoded, bounds = sandbox.token_bounds(codec, ids)
    assert decoded == text and len(bounds) == len(ids) + 1  # every token boundary is clean


def test_token_bounds_skip_splits_inside_a_character(tok):
    codec = sandbox.Codec(tok)
    text = "Results: ‹x› and 東京."
    ids = codec.encode(text)
    decoded, bounds = sandbox.token_bounds(codec, ids)
    assert decoded == text and bounds[-1] == (len(ids), len(text))
    assert all(text[:o] == codec.decode(ids[:t]) for t, o in bounds)


def test_chat_template_and_prompt_ids(tok):
    messages = sandbox.prompt_messages(DOC)
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|bos|><|system|><|eot|><|user|>Summarise")  # the tiny template drops instructions
    assert text.endswith(DOC + "<|eot|><|assistant|>")
    ids = sandbox.prompt_ids(tok, DOC)
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.convert_tokens_to_ids("<|assistant|>")
    assert ids.count(tok.eos_token_id) == 2 and tok.decode(ids) == text
    done = tok.apply_chat_template(messages + [{"role": "assistant", "content": "A summary."}], tokenize=False)
    assert done.endswith("<|assistant|>A summary.<|eot|>")
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


@pytest.mark.parametrize("tag,max_tokens", [
    ("<search>", 3), ("</search>", 3), ("<results>", 3), ("</results>", 3), ("<0>", 3), ("</2>", 3),
    ("<error>", 3), ('<delete scope="sentence"/>', 6), ('<delete scope="clause"/>', 6),
])
def test_tool_tags_are_few_ordinary_tokens(tok, tag, max_tokens):
    ids = tok.encode(tag, add_special_tokens=False)
    assert len(ids) <= max_tokens, tok.convert_ids_to_tokens(ids)
    assert not set(ids) & set(tok.all_special_ids)  # markup is text, as in real vocabularies


# ---------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------


def test_build_save_load_forward(tiny_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size) == (128, 2, len(tok))
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (tok.pad_token_id, tok.bos_token_id,
                                                                      tok.eos_token_id)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings >= 2048
    assert cfg._attn_implementation == "sdpa"
    n = count_parameters(model)
    assert 0.5e6 < n < 1.5e6
    # the planner's parameter arithmetic agrees with the real module
    assert ModelShape.from_config(json.loads((tiny_dir / "config.json").read_text())).n_params == n

    batch = tok([DOC, "Short one."], return_tensors="pt", padding=True)
    assert (batch["input_ids"][1, 0] == tok.pad_token_id) and batch["attention_mask"][1, 0] == 0  # left padding
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape == (*batch["input_ids"].shape, len(tok))
    assert torch.isfinite(out.logits).all()


def test_same_seed_same_weights_and_reuse(tiny_dir, tmp_path):
    first = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    again = AutoModelForCausalLM.from_pretrained(build_tiny_model("tiny-1m", tmp_path / "a", seed=0)).state_dict()
    other = AutoModelForCausalLM.from_pretrained(build_tiny_model("tiny-1m", tmp_path / "b", seed=1)).state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["model.layers.0.mlp.up_proj.weight"], other["model.layers.0.mlp.up_proj.weight"])

    weights = tmp_path / "a" / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_tiny_model("tiny-1m", tmp_path / "a", seed=0) == tmp_path / "a"
    assert weights.stat().st_mtime_ns == stamp  # same preset and seed: reused, not rebuilt
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        build_tiny_model("tiny-1m", tmp_path / "c")
    with pytest.raises(ConfigError, match="tiny-8m"):
        build_tiny_model("tiny-2m", tmp_path / "d")


# ---------------------------------------------------------------------------
# Policy loading
# ---------------------------------------------------------------------------


def _lora_cfg(tiny_dir, **kw) -> ModelConfig:
    return ModelConfig(name_or_path=str(tiny_dir), lora=LoraConfig(rank=4, alpha=8), **kw)


def _train_step(model, ids) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(ids, labels=ids).loss.backward()
    opt.step()


def test_lora_trains_only_the_adapter_and_reference_is_the_base(tiny_dir):
    base = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model, tok = load_policy(_lora_cfg(tiny_dir), device_name="cpu")
    assert tok.padding_side == "left" and tok.pad_token == "<|pad|>"
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    shape = ModelShape.from_config(base.config.to_dict())
    assert count_parameters(model, trainable=True) == shape.lora_params(4, modeling.LORA_TARGETS)

    ids = _ids()
    with torch.no_grad():
        base_logits = base(ids).logits
        assert torch.allclose(model(ids).logits, base_logits, atol=1e-6)  # LoRA starts as the identity
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_step(model, ids)
    after = dict(model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before if n not in trainable)
    assert all(not torch.equal(before[n], after[n]) for n in trainable if ".lora_B." in n)

    with torch.no_grad():
        adapted = model(ids).logits
        with reference_model(model) as ref:
            reference = ref(ids).logits
        assert not torch.allclose(adapted, base_logits, atol=1e-4)
        assert torch.allclose(reference, base_logits, atol=1e-6)
        assert torch.equal(model(ids).logits, adapted)  # the adapter is back after the block


def test_top_layers_adapts_only_the_last_layers_and_training_moves_only_them(tiny_dir):
    cfg = ModelConfig(name_or_path=str(tiny_dir), lora=LoraConfig(rank=4, alpha=8, top_layers=1))
    model, _ = load_policy(cfg, device_name="cpu")
    adapted = {n.split(".layers.")[1].split(".")[0] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"1"}  # tiny-1m has layers 0 and 1: only the last is adapted
    shape = ModelShape.from_config(AutoModelForCausalLM.from_pretrained(tiny_dir).config.to_dict())
    assert count_parameters(model, trainable=True) * 2 == shape.lora_params(4, modeling.LORA_TARGETS)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    _train_step(model, _ids())
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    assert moved and all(".layers.1." in n and (".lora_A." in n or ".lora_B." in n) for n in moved)
    assert modeling.adapted_layers(LoraConfig(top_layers=0), 30) is None
    assert modeling.adapted_layers(LoraConfig(top_layers=4), 30) == [26, 27, 28, 29]
    with pytest.raises(ConfigError, match="top_layers=3: the model has 2 layers"):
        load_policy(ModelConfig(name_or_path=str(tiny_dir), lora=LoraConfig(top_layers=3)), device_name="cpu")
    with pytest.raises(ConfigError, match="top_layers"):
        ModelConfig(lora=LoraConfig(top_layers=-1))


def test_a_trained_directory_loads_as_full_weights_or_an_adapter_on_its_base(tiny_dir, tmp_path):
    model, tok = load_policy(_lora_cfg(tiny_dir), device_name="cpu")
    _train_step(model, _ids())
    model.save_pretrained(tmp_path / "adapter")
    ids = _ids(seed=1)
    with torch.no_grad():
        want = model(ids).logits
    adapter = modeling.trained_model_config(str(tmp_path / "adapter"))
    back, _ = load_policy(adapter, train=False, device_name="cpu")
    assert adapter.name_or_path == str(tiny_dir)
    assert not back.training and not any(p.requires_grad for p in back.parameters())
    assert getattr(back, "peft_config", None) is None  # frozen: the adapter is merged into its base
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, want, atol=1e-5)
    trainable, _ = load_policy(adapter, train=True, device_name="cpu")
    assert trainable.peft_config and any(p.requires_grad for p in trainable.parameters())  # training continues it
    full, _ = load_policy(modeling.trained_model_config(str(tiny_dir)), train=False, device_name="cpu")
    assert getattr(full, "peft_config", None) is None
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_policy(modeling.trained_model_config(str(tmp_path / "nowhere")))


def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model, _ = load_policy(_lora_cfg(tiny_dir, gradient_checkpointing=checkpointing), device_name="cpu")
        model.train()
        ids = _ids()
        model(ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])
    assert any(g.abs().sum() > 0 for g in grads[1].values())


def test_full_finetune_reference_needs_a_frozen_copy(tiny_dir):
    model, _ = load_policy(ModelConfig(name_or_path=str(tiny_dir), lora=LoraConfig(enabled=False)),
                           device_name="cpu")
    assert count_parameters(model, trainable=True) == count_parameters(model)
    with pytest.raises(ValueError, match="frozen_copy"):
        with reference_model(model):
            pass
    ref = frozen_copy(model)
    assert not any(p.requires_grad for p in ref.parameters())
    ids = _ids()
    with torch.no_grad():
        start = ref(ids).logits
    _train_step(model, ids)
    with torch.no_grad():
        assert torch.equal(ref(ids).logits, start)
        assert not torch.allclose(model(ids).logits, start, atol=1e-4)


def test_eval_load_is_frozen(tiny_dir):
    model, _ = load_policy(_lora_cfg(tiny_dir), train=False, device_name="cpu")
    assert not model.training and count_parameters(model, trainable=True) == 0


@pytest.mark.parametrize("quant,linear", [("4bit", "Linear4bit"), ("8bit", "Linear8bitLt")])
def test_quantised_load_on_cpu(tiny_dir, quant, linear):
    pytest.importorskip("bitsandbytes")
    full = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model, _ = load_policy(_lora_cfg(tiny_dir, quant=quant), device_name="cpu")
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.base_layer).__name__ == linear
    assert count_parameters(model) == count_parameters(full) + count_parameters(model, trainable=True)
    ids = _ids()
    with torch.no_grad():
        ref, got = full(ids).logits, model(ids).logits
    assert torch.isfinite(got).all()
    assert torch.nn.functional.cosine_similarity(ref.flatten(), got.flatten(), dim=0) > 0.95
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in trainable}
    _train_step(model, ids)
    assert all(not torch.equal(before[n], p) for n, p in model.named_parameters() if ".lora_B." in n)


@pytest.mark.skipif(importlib.util.find_spec("unsloth") is not None, reason="unsloth is installed")
def test_unsloth_backend_says_how_to_install():
    with pytest.raises(ImportError, match="requirements-gpu.txt"):
        load_policy(ModelConfig(backend="unsloth", fast_inference=True, quant="4bit"))


def test_model_config_from_the_command_line():
    cfg = load_config(ModelConfig, ["quant=4bit", "lora.rank=8", "lora.target_modules=[q_proj, v_proj]"])
    assert (cfg.quant, cfg.lora.rank, cfg.lora.target_modules) == ("4bit", 8, ["q_proj", "v_proj"])
    with pytest.raises(ConfigError, match="backend='unsloth'"):
        load_config(ModelConfig, ["fast_inference=true"])
    with pytest.raises(ConfigError, match="LoRA only"):
        load_config(ModelConfig, ["quant=4bit", "lora.enabled=false"])
    with pytest.raises(ConfigError, match="did you mean 'lora.rank'"):
        load_config(ModelConfig, ["lora.rnak=8"])


# ---------------------------------------------------------------------------
# Memory planner
# ---------------------------------------------------------------------------

GRPO = PlanConfig(quant="4bit", lora_rank=16, batch=1, group_size=8, prompt_len=1024, completion_len=256,
                  gradient_checkpointing=True, gpu_memory_utilization=0.5)


@pytest.mark.parametrize("name,billions", [
    ("Llama-3.2-1B", 1.24), ("Llama-3.2-3B", 3.21), ("Llama-3.1-8B", 8.03), ("Qwen3-4B", 4.02), ("Qwen3-8B", 8.19),
])
def test_shipped_model_configs(name, billions):
    shape = load_model_config(name)
    assert shape.n_params / 1e9 == pytest.approx(billions, abs=0.01)  # the sizes the model cards state
    assert load_model_config(name.lower()) == shape
    assert "_source" in json.loads((vram.MODEL_CONFIGS_DIR / f"{name}.json").read_text())
    plan = plan_memory(dataclasses.replace(GRPO, model=name))
    assert set(plan.stages) == {"sft", "rollout", "update"}
    assert all(v >= 0 for parts in plan.stages.values() for v in parts.values())


def test_unknown_model_config_lists_the_shipped_ones():
    with pytest.raises(ConfigError, match="Qwen3-8B"):
        load_model_config("Llama-9-1B")


@pytest.mark.parametrize("stage", ["sft", "rollout", "update"])
def test_planner_is_monotonic(stage):
    hf = dataclasses.replace(GRPO, gpu_memory_utilization=0.0)  # no reservation: totals are plain sums

    def total(**change) -> float:
        return plan_memory(dataclasses.replace(hf, **change)).total_gb(stage)

    base = total()
    assert total(batch=2) > base and total(completion_len=512) > base
    assert total(quant="none") > base and total(quant="8bit") > base  # 4-bit < 8-bit < bf16
    assert total(lora_rank=64) > base and total(optimizer="adamw_8bit") < base
    assert total(quant="none", lora_rank=0) > total(quant="none")  # full fine-tune > LoRA

    def smallest_gpu(**change) -> float:  # beside vLLM: the smallest card that holds both
        return plan_memory(dataclasses.replace(GRPO, **change)).min_gpu_gb[stage]

    assert smallest_gpu(batch=2) >= smallest_gpu() and smallest_gpu(quant="none") >= smallest_gpu()
    if stage != "sft":
        assert smallest_gpu(group_size=16) > smallest_gpu()


def test_planner_components():
    plan = plan_memory(GRPO)
    no_ckpt = plan_memory(dataclasses.replace(GRPO, gradient_checkpointing=False))
    assert no_ckpt.stages["update"]["activations"] > 5 * plan.stages["update"]["activations"]
    bf16 = plan_memory(dataclasses.replace(GRPO, quant="none"))
    assert plan.stages["sft"]["weights"] < 0.6 * bf16.stages["sft"]["weights"]
    assert plan.stages["update"]["logits"] > plan_memory(dataclasses.replace(GRPO, chunked_logits=True)).stages[
        "update"]["logits"]
    tree = plan_memory(dataclasses.replace(GRPO, share_prompt=True))
    assert tree.stages["update"]["activations"] < 0.5 * plan.stages["update"]["activations"]
    assert tree.vllm["kv_cache"] < 0.5 * plan.vllm["kv_cache"]
    assert plan.vllm["kv_cache"] > plan_memory(dataclasses.replace(GRPO, group_size=4)).vllm["kv_cache"]
    # beside vLLM the trainer gets (1 - u) of the card; without vLLM there is no reservation
    assert plan.total_gb("update", 80) == pytest.approx(sum(plan.stages["update"].values()) + 40)
    hf = plan_memory(dataclasses.replace(GRPO, gpu_memory_utilization=0.0))
    assert not hf.vllm and hf.total_gb("rollout") == pytest.approx(sum(hf.stages["rollout"].values()))
    assert hf.stages["rollout"]["kv_cache"] == pytest.approx(plan.vllm["kv_cache"])
    for name in plan.stages:
        assert plan.fits[name] == {g: plan.min_gpu_gb[name] <= g for g in vram.GPU_SIZES_GB}
    with pytest.raises(ConfigError):
        PlanConfig(quant="4bit", lora_rank=0)


def test_the_plan_is_per_gpu_when_ranks_share_the_batch_and_vllm_splits_over_tensor_parallel_gpus():
    """Data parallel: every GPU holds the weights, the adapter and its optimizer, and
    its share of the batch (rounded up). Tensor parallel: vLLM's weights and KV cache
    are split across the GPUs."""
    one = plan_memory(dataclasses.replace(GRPO, batch=8))
    four = plan_memory(dataclasses.replace(GRPO, batch=8, gpus=4))
    two_each = plan_memory(dataclasses.replace(GRPO, batch=2))
    for stage in ("sft", "rollout", "update"):
        assert four.stages[stage] == two_each.stages[stage]
        assert four.stages[stage]["weights"] == one.stages[stage]["weights"]
    assert plan_memory(dataclasses.replace(GRPO, batch=3, gpus=2)).stages == plan_memory(
        dataclasses.replace(GRPO, batch=2)).stages  # 3 prompts on 2 GPUs: 2 on the busier one
    tp = plan_memory(dataclasses.replace(GRPO, tensor_parallel=2))
    assert tp.vllm["weights"] == pytest.approx(plan_memory(GRPO).vllm["weights"] / 2)
    assert tp.vllm["kv_cache"] == pytest.approx(plan_memory(GRPO).vllm["kv_cache"] / 2)
    text = vram.format_plan(four)
    assert "per GPU, 4 GPUs data-parallel (batch 8: 2 per GPU)" in text
    with pytest.raises(ConfigError, match="gpus"):
        PlanConfig(gpus=0)


def test_a_vllm_teacher_is_split_over_tensor_parallel_gpus(monkeypatch):
    """model.tensor_parallel_size reaches vLLM's engine (a stand-in module records it)."""
    import types

    from factual_tools import teachers

    made = {}
    fake = types.ModuleType("vllm")
    fake.LLM = lambda **kw: made.update(kw) or "engine"
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setattr(modeling, "load_tokenizer", lambda path: "tok")
    mcfg = ModelConfig(name_or_path="some/model", tensor_parallel_size=4)
    assert teachers.load_generator(mcfg, teachers.GenerateConfig(backend="vllm")) == ("engine", "tok")
    assert made["tensor_parallel_size"] == 4
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        ModelConfig(tensor_parallel_size=0)


# Unsloth's long-context GRPO post (unsloth.ai/blog/grpo, 20 Feb 2025), "GRPO VRAM
# breakdown" for Llama 3.1 8B, 8 generations of 20K tokens: TRL + FA2 needs 78.3 GB
# for the GRPO loss (the fp32 logits), Unsloth 9.8 GB (one generation at a time);
# inference (vLLM's own weights) 16 GB for TRL and 0 GB for Unsloth (shared); the
# KV cache for 20K context 2.5 GB. Tolerance: 2% on the KV cache and logits (the
# same arithmetic, so only rounding), 10% on the weights (the post's 16 GB is
# 8.03B x 2 bytes in decimal GB; the planner counts GiB).
BLOG = PlanConfig(model="Llama-3.1-8B", quant="4bit", lora_rank=16, batch=1, group_size=8, prompt_len=0,
                  completion_len=20 * 1024, gpu_memory_utilization=0.5)


def test_planner_matches_unsloth_grpo_post():
    trl = plan_memory(dataclasses.replace(BLOG, backend="hf"))
    unsloth = plan_memory(dataclasses.replace(BLOG, backend="unsloth"))
    # The post counts one fp32 copy (4 of the planner's 10 bytes per logit: bf16 head output, fp32 copy,
    # fp32 log-softmax kept for backward).
    assert trl.stages["update"]["logits"] * 4 / vram._LOGIT_BYTES == pytest.approx(78.3, rel=0.02)
    assert unsloth.stages["update"]["logits"] == pytest.approx(9.8, rel=0.02)
    assert trl.vllm["weights"] == pytest.approx(16, rel=0.10)
    assert unsloth.stages["update"]["weights"] == 0  # the engine's copy is the trainer's
    one_sequence = plan_memory(dataclasses.replace(BLOG, group_size=1, gpu_memory_utilization=0.0))
    assert one_sequence.stages["rollout"]["kv_cache"] == pytest.approx(2.5, rel=0.02)


# LLaMA-Factory's measured peak memory (github.com/hiyouga/LLaMA-Factory wiki,
# "Performance comparison", April 2024): LLaMA2-7B, 4-bit QLoRA, LoRA rank 8 on all
# modules, batch size 1, one A100 40GB, GB by sequence length, for HF + FlashAttention-2
# and for Unsloth + FA2 (gradient checkpointing on, LLaMA-Factory's default).
# Tolerance: 20% of the measured figure at every length.
LLAMA2_7B = ModelShape.from_config(dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                        num_key_value_heads=32, intermediate_size=11008, vocab_size=32000,
                                        tie_word_embeddings=False), "Llama-2-7B")
MEASURED = {
    "hf": {1024: 6, 2048: 7, 4096: 9, 8192: 12, 16384: 19, 32768: 32},
    "unsloth": {1024: 5, 2048: 6, 4096: 7, 8192: 8, 16384: 10, 32768: 16, 65536: 25, 100000: 37},
}


@pytest.mark.parametrize("backend,seq_len,measured_gb",
                         [(b, n, gb) for b, table in MEASURED.items() for n, gb in table.items()])
def test_planner_matches_llama_factory_measurements(backend, seq_len, measured_gb):
    cfg = PlanConfig(model="Llama-2-7B", quant="4bit", lora_rank=8, batch=1, prompt_len=seq_len - 1,
                     completion_len=1, gradient_checkpointing=True, backend=backend, gpu_memory_utilization=0.0)
    assert plan_memory(cfg, LLAMA2_7B).total_gb("sft") == pytest.approx(measured_gb, rel=0.20)


def test_plan_command_prints_every_shipped_model(capsys):
    vram.main(["model=all", "backend=unsloth"])
    out = capsys.readouterr().out
    for name in ("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B", "Qwen3-4B", "Qwen3-8B"):
        assert name in out
    assert out.count("\nupdate ") == 5
