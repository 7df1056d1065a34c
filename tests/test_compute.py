"""Compute settings chosen at run time: bf16 autocast only where the hardware
multiplies bf16 natively, said in the run log, and reaching every model call of
the trainers that ask for it."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import rl
from factual_tools import common, engine, modeling
from helpers import DOC, bpe_tokenizer, save_tiny_policy, tiny_llama
from factual_tools.settings import ConfigError


def _cpu(monkeypatch, capability, avx512_bf16=False, amx=False):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)


@pytest.mark.parametrize("capability, avx512_bf16, amx, chosen", [
    ("AVX2", False, False, False),  # a laptop or cloud VM without bf16 units: scalar bf16 GEMM, ~12x slower
    ("AVX2", True, False, False),  # units present but torch dispatches AVX2 (ATEN_CPU_CAPABILITY=avx2)
    ("AVX512", False, False, False),  # AVX512 without BF16 (Skylake-X, Cascade Lake)
    ("AVX512", True, False, True),  # AVX512-BF16 (Cooper Lake, Zen 4/5)
    ("AVX512", False, True, True),  # AMX (Sapphire Rapids)
    ("DEFAULT", False, False, False),
])
def test_auto_picks_bf16_only_with_native_units(monkeypatch, capability, avx512_bf16, amx, chosen):
    _cpu(monkeypatch, capability, avx512_bf16, amx)
    on, why = common.choose_autocast("auto", "cpu")
    assert on is chosen
    assert why.startswith(f"autocast=auto -> {'bf16' if chosen else 'fp32'}") and capability in why
    assert common.choose_autocast("none", "cpu") == (False, "autocast=none: fp32")
    forced, why = common.choose_autocast("bf16", "cpu")
    assert forced and (why == "autocast=bf16") is chosen  # forcing it where it is slow says so


def test_auto_keeps_a_narrow_model_in_fp32_on_a_bf16_cpu(monkeypatch):
    """Below BF16_MIN_HIDDEN_CPU the casts cost more than bf16 saves: auto says fp32 and
    why; a wide model, a forced bf16 and a GPU are not affected."""
    from helpers import bpe_tokenizer, tiny_llama

    _cpu(monkeypatch, "AVX512", amx=True)
    narrow = tiny_llama(bpe_tokenizer(), hidden=64)
    on, why = common.choose_autocast("auto", "cpu", common.hidden_size(narrow))
    assert not on and "hidden size 64 < 512" in why
    assert common.choose_autocast("auto", "cpu", 576)[0] and common.choose_autocast("auto", "cpu")[0]
    assert common.choose_autocast("bf16", "cpu", 64)[0]
    assert common.setup_compute(0, "auto", "cpu", narrow) is False
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA L4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a: True)
    assert common.choose_autocast("auto", "cuda", 64)[0]


def test_auto_on_cuda_follows_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA T4")
    for supported in (True, False):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, s=supported: s)
        assert common.choose_autocast("auto", "cuda")[0] is supported


def test_an_unknown_kind_is_a_config_error():
    with pytest.raises(ConfigError, match="autocast='fp16'"):
        common.choose_autocast("fp16", "cpu")


def test_the_run_log_says_what_was_chosen_and_why(monkeypatch, capsys):
    _cpu(monkeypatch, "AVX2", avx512_bf16=True)
    assert common.setup_compute(0, "auto", "cpu") is False
    out = capsys.readouterr().out
    assert "compute: cpu" in out and "autocast=auto -> fp32" in out and "torch dispatches AVX2" in out


@pytest.mark.parametrize("kind, dtypes", [("bf16", {torch.bfloat16}), ("none", {torch.float32})])
def test_rl_rolls_out_and_updates_under_the_chosen_autocast(tmp_path, monkeypatch, kind, dtypes):
    """Every projection of a rollout and of an update runs in the chosen precision."""
    policy = save_tiny_policy(tmp_path / "p", bpe_tokenizer())
    docs = tmp_path / "docs.jsonl"
    data.write_jsonl(str(docs), [data.Document(id="d0", text=DOC), data.Document(id="d1", text=DOC[:300])])
    seen = {"rollout": set(), "update": set()}
    phase = {"now": "rollout"}
    real_rollout, real_logprobs = engine.rollout, rl.logprobs

    def in_rollout(*a, **k):
        phase["now"] = "rollout"
        return real_rollout(*a, **k)

    def in_update(*a, **k):
        phase["now"] = "update"
        return real_logprobs(*a, **k)

    def hook(module, args, out):
        seen[phase["now"]].add(out.dtype)

    real_load = modeling.load_policy

    def load(*a, **k):
        model, tok = real_load(*a, **k)
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and not m.__class__.__module__.startswith("peft"):
                m.register_forward_hook(hook)
        return model, tok

    monkeypatch.setattr(engine, "rollout", in_rollout)
    monkeypatch.setattr(rl, "logprobs", in_update)
    monkeypatch.setattr(modeling, "load_policy", load)
    cfg = rl.Config(name="t", runs_dir=str(tmp_path), model=modeling.ModelConfig(name_or_path=policy),
                    data=rl.DocumentData(train=str(docs), split=""), steps=1, prompts_per_step=2, group_size=2,
                    save_every=0, autocast=kind, eval=rl.RLEval(every=0, n_docs=0, sample_every=0))
    cfg.sampling.max_new_tokens = 8
    rl.main(cfg, reward_fn=lambda d, e: [{"total": float(i % 2)} for i in range(len(e))])
    assert seen["rollout"] == dtypes and seen["update"] == dtypes


def test_frozen_weights_held_in_bf16_give_autocasts_products_and_come_back():
    """Inside `common.autocast(True, "cpu", model)` the frozen linear weights (a LoRA
    base and the tied output head) are bf16 copies: the logits are autocast's own to the
    bit, trainable weights and the embedding stay fp32, and every fp32 weight is back after."""
    from peft import LoraConfig, get_peft_model

    tok = bpe_tokenizer()
    model = get_peft_model(tiny_llama(tok), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                       init_lora_weights=False))
    model.config.tie_word_embeddings = True
    base = model.get_base_model()
    base.lm_head.weight = base.model.embed_tokens.weight  # tied, as SmolLM2's
    ids = torch.randint(4, len(tok), (2, 12))
    before = {n: p for n, p in model.named_parameters()}
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = model(ids).logits
        with common.autocast(True, "cpu", model):
            frozen = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
            assert frozen and all(w.dtype == torch.bfloat16 for w in frozen)
            assert base.lm_head.weight.dtype == torch.bfloat16 and base.model.embed_tokens.weight.dtype == torch.float32
            assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
            got = model(ids).logits
    assert torch.equal(got, want)
    assert {n: p for n, p in model.named_parameters()} == before  # the same fp32 Parameters, ties included
    assert base.lm_head.weight is base.model.embed_tokens.weight
    with common.autocast(False, "cpu", model):
        assert all(p.dtype == torch.float32 for p in model.parameters())


_FAULTS = """
import ctypes, resource, sys
from factual_tools import common
if sys.argv[1] == "keep" and not common.keep_freed_memory():
    print("not glibc"); sys.exit()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def faults(n=64 * 2**20):  # a 64 MB block written, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n); ctypes.memset(p, 1, n); libc.free(p)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(*[faults() for _ in range(4)])
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_freed_large_block_is_reused_without_faulting_in_new_pages():
    """keep_freed_memory: a 64 MB block freed and allocated again comes back from the
    heap; by default glibc maps it afresh each time (16,384 minor faults). Each case runs
    in its own process: the setting is process-wide. (torch's own 64-byte-aligned
    blocks come back from the heap only some of the time: measured, not asserted.)"""
    root = Path(__file__).resolve().parent.parent
    runs = {how: subprocess.run([sys.executable, "-c", _FAULTS, how], cwd=root, capture_output=True, text=True,
                                check=True).stdout.split() for how in ("keep", "default")}
    if runs["keep"] == ["not", "glibc"]:
        pytest.skip("not glibc")
    kept, default = ([int(x) for x in runs[how]] for how in ("keep", "default"))
    assert all(f < 1000 for f in kept[1:]), kept  # the first one grows the heap
    assert all(f > 10000 for f in default), default
