"""Distillation: the summary-only target and its mask, the KD loss by hand and its
vocabulary guard, the CE path against sft.py's, a run end to end from an RL-style
adapter teacher, and exact resume."""
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import data
import distill
import sandbox as S
import sft
from factual_tools import common, engine, modeling, scoring, settings
import newsworld
from newsworld import tiny
from helpers import (DOC, assert_trackers_match_metrics, bpe_tokenizer, killed_after_checkpoint, offline_trackers,
                     save_tiny_policy, tiny_llama)

ROOT = Path(__file__).resolve().parent.parent
TOK = bpe_tokenizer()
WRITTEN = ('Acme reported revenue of $5 billion.<search>/revenue of/</search><delete scope="sentence"/> '
           'Acme reported revenue of $4.2 billion.<search>Globex revenue</search> Shares fell 3.5%.')


def teacher_episode():
    ep = S.replay(DOC, WRITTEN).tokenized(TOK)
    assert ep.n_search == 2 and ep.n_deleted == 1 and len(ep.turns) == 4
    return ep


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------


def test_summary_target_is_the_final_summary_alone_and_its_mask_covers_exactly_it():
    ep = teacher_episode()
    assert ep.summary == "Acme reported revenue of $4.2 billion. Shares fell 3.5%."
    t = distill.summary_episode(ep).tokenized(TOK)
    assert [x.text for x in t.turns] == [ep.summary] and t.calls == [] and t.summary == ep.summary
    (branch,) = t.branches()
    prompt = S.prompt_ids(TOK, DOC)
    trained = [i for i, m in zip(branch.input_ids, branch.loss_mask) if m]
    assert trained == TOK.encode(ep.summary, add_special_tokens=False) + [TOK.eos_token_id]
    assert branch.input_ids == prompt + trained and branch.loss_mask == [0] * len(prompt) + [1] * len(trained)
    assert scoring.validate_masks([t], TOK, 1) == 1


def test_targets_by_mode_keep_sampled_ids_only_when_the_vocabulary_is_shared():
    ep = teacher_episode()
    assert [x.summary for x in distill.make_targets([ep], "summary", True)] == [ep.summary]
    both = distill.make_targets([ep], "both", True)
    assert len(both) == 2 and both[1] is ep  # the teacher's own ids, never re-encoded
    other = distill.make_targets([ep], "episode", False)[0]
    assert not other.has_ids and other.text == ep.text and other.summary == ep.summary
    retok = other.tokenized(bpe_tokenizer(300))  # another vocabulary: canonical ids of the same text
    assert [x.text for x in retok.turns] == [x.text for x in ep.turns] and retok.summary == ep.summary


@pytest.mark.parametrize("flt, summary, valid, truncated, score, kept", [
    ("none", "A.", False, True, None, True),
    ("none", " ", True, False, None, False),
    ("clean", "A.", True, False, None, True),
    ("clean", "A.", True, True, None, False),
    ("clean", "A.", False, False, None, False),
    ("pass", "A.", True, False, {"pass": True, "factuality": 0.1}, True),
    ("pass", "A.", True, False, {"pass": False, "factuality": 0.9}, False),
    ("pass", "A.", True, True, {"pass": True, "factuality": 0.9}, False),
    ("factuality", "A.", True, False, {"pass": False, "factuality": 0.5}, True),
    ("factuality", "A.", True, False, {"pass": True, "factuality": 0.49}, False),
])
def test_generation_filter(flt, summary, valid, truncated, score, kept):
    ep = S.Episode(DOC, [S.Turn(summary)], summary=summary,
                   flags={"truncated": truncated, **({} if valid else {"junk": 1})})
    cfg = distill.GenerateConfig(filter=flt, min_factuality=0.5)
    assert distill.keep_episode(ep, score, cfg) is kept


# ---------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------


def test_kd_loss_equals_a_hand_computed_kl():
    s = torch.tensor([[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]])
    t = torch.tensor([[0.0, 1.0, 3.0], [0.5, 2.0, 0.0]])
    T = 2.0
    total = 0.0
    for srow, trow in zip(s.tolist(), t.tolist()):
        zs = sum(math.exp(x / T) for x in srow)
        zt = sum(math.exp(x / T) for x in trow)
        for a, b in zip(srow, trow):
            p, q = math.exp(b / T) / zt, math.exp(a / T) / zs
            total += p * math.log(p / q)
    assert distill.kd_loss(s, t, T).item() == pytest.approx(T * T * total, rel=1e-5)
    assert total > 0.1  # the first row differs, so the check has teeth


def test_kd_loss_is_zero_for_identical_logits_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g)
    assert distill.kd_loss(x, x.clone(), 1.5).item() == pytest.approx(0.0, abs=1e-6)
    assert distill.kd_loss(x, x + 3.0, 1.5).item() == pytest.approx(0.0, abs=1e-5)  # softmax ignores a shift
    assert distill.kd_loss(x, torch.randn(5, 7, generator=g), 1.5).item() > 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kd_loss_in_chunks_gives_autograds_value_and_gradient(dtype):
    """kd_loss takes the positions a chunk at a time and writes its gradient, T (q - p),
    itself: the same loss and gradient as autograd through the whole (N, V) formula,
    for logits of either dtype and a chunk that does not divide N."""
    g = torch.Generator().manual_seed(1)
    s = (3 * torch.randn(11, 50, generator=g)).to(dtype).requires_grad_()
    t = (3 * torch.randn(11, 50, generator=g)).to(dtype)
    T = 2.0
    log_q, log_p = F.log_softmax(s.float() / T, dim=-1), F.log_softmax(t.float() / T, dim=-1)
    ref = T * T * (log_p.exp() * (log_p - log_q)).sum()
    (ref_grad,) = torch.autograd.grad(3.0 * ref, s)
    loss = distill.kd_loss(s, t, T, chunk=4)
    (3.0 * loss).backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # the gradient is stored in the logits' dtype
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref.item(), rel=1e-5)
    assert s.grad.dtype == dtype and torch.allclose(s.grad.float(), ref_grad.float(), rtol=tol, atol=tol * 1e-2)
    assert ref.item() > 1.0  # the two distributions differ


@pytest.mark.parametrize("keep_every", [0.5, 1, -2])
def test_a_keep_every_that_would_keep_every_layer_is_refused_by_name(keep_every):
    with pytest.raises(settings.ConfigError, match="keep_every"):
        distill.Config(keep_every=keep_every)
    assert distill.Config(keep_every=1.5).keep_every == 1.5 and distill.Config(keep_every=0).keep_every == 0


def test_kd_falls_back_to_cross_entropy_when_vocabularies_differ():
    cfg = distill.KDConfig(weight=0.5, temperature=2.0)
    w, why = distill.kd_setting(TOK, bpe_tokenizer(300), cfg)
    assert w == 0.0 and "vocabularies differ" in why and "cross-entropy only" in why
    w, why = distill.kd_setting(TOK, bpe_tokenizer(), cfg)
    assert w == 0.5 and "KL(teacher || student)" in why
    assert distill.kd_setting(TOK, TOK, distill.KDConfig(weight=0.0))[0] == 0.0


def test_distill_loss_ce_is_sfts_and_kd_against_itself_is_zero():
    student = tiny_llama(TOK, seed=1, hidden=32, layers=1).eval()
    teacher = tiny_llama(TOK, seed=2, hidden=32, layers=1).eval()
    eps = [teacher_episode(), distill.summary_episode(teacher_episode()).tokenized(TOK)]
    n = sum(sft.n_generated(e) for e in eps)
    ce_sft = sft.sequence_loss(student, eps, n).item()
    loss0, ce0, _ = distill.distill_loss(student, teacher, eps, n, kd_weight=0.0, temperature=2.0, vocab=len(TOK))
    assert loss0.item() == pytest.approx(ce_sft, abs=1e-6)  # KD off: sft.sequence_loss itself
    loss, ce, kd = distill.distill_loss(student, teacher, eps, n, kd_weight=0.5, temperature=2.0, vocab=len(TOK),
                                        max_batch_tokens=300)
    assert ce == pytest.approx(ce_sft, abs=1e-4)  # branch logits here, the tree path in sft: same numbers
    assert kd > 0 and loss.item() == pytest.approx(0.5 * ce + 0.5 * kd, rel=1e-5)
    loss, ce, kd = distill.distill_loss(student, student, eps, n, kd_weight=0.5, temperature=2.0, vocab=len(TOK))
    assert kd == pytest.approx(0.0, abs=1e-6) and loss.item() == pytest.approx(0.5 * ce, rel=1e-5)
    logits, targets, gen = distill.generated_logits(student, eps)
    assert logits.shape == (n, len(TOK)) and targets.tolist() == [i for e in eps for t in e.turns for i in t.ids]
    assert gen.all()


def test_kd_on_the_prompt_covers_every_position_and_leaves_the_cross_entropy_alone():
    student = tiny_llama(TOK, seed=1, hidden=32, layers=1).eval()
    teacher = tiny_llama(TOK, seed=2, hidden=32, layers=1).eval()
    eps = [distill.summary_episode(teacher_episode()).tokenized(TOK), teacher_episode()]
    n = sum(sft.n_generated(e) for e in eps)
    branches = [b for e in eps for b in e.branches()]
    n_all = sum(distill.kd_positions(e, True) for e in eps)
    assert n_all == sum(len(b.input_ids) - 1 for b in branches) > 3 * n  # the document dwarfs the summary
    assert [distill.kd_positions(e, False) for e in eps] == [sft.n_generated(e) for e in eps]
    gen_logits, gen_targets, _ = distill.generated_logits(student, eps, max_batch_tokens=300)
    logits, targets, gen = distill.generated_logits(student, eps, max_batch_tokens=300, prompt=True)
    assert logits.shape == (n_all, len(TOK)) and int(gen.sum()) == n
    assert targets.tolist() == [i for b in branches for i in b.input_ids[1:]]
    assert torch.equal(targets[gen], gen_targets)  # the generated ids among them, in order
    assert torch.allclose(logits[gen], gen_logits, atol=1e-5)
    _, ce, _ = distill.distill_loss(student, teacher, eps, n, kd_weight=0.5, temperature=2.0, vocab=len(TOK))
    loss, ce_p, kd = distill.distill_loss(student, teacher, eps, n, kd_weight=0.5, temperature=2.0, vocab=len(TOK),
                                          prompt=True, n_kd=n_all)
    assert ce_p == pytest.approx(ce, rel=1e-5)  # cross-entropy stays on the generated ids
    with torch.no_grad():
        t_logits, _, _ = distill.generated_logits(teacher, eps, prompt=True)
    assert kd == pytest.approx(distill.kd_loss(logits, t_logits, 2.0).item() / n_all, rel=1e-4)
    assert loss.item() == pytest.approx(0.5 * ce + 0.5 * kd, rel=1e-5)
    _, _, kd_self = distill.distill_loss(student, student, eps, n, kd_weight=0.5, temperature=2.0, vocab=len(TOK),
                                         prompt=True, n_kd=n_all)
    assert kd_self == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("prompt", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_the_head_a_chunk_at_a_time_gives_the_logits_paths_loss_and_gradient(prompt, tied):
    """With plain heads, distill_loss takes the decoders' hidden states and applies both heads a
    chunk of positions at a time (never the (N, V) logits), writing the gradients itself: the
    same loss, CE and KD, and the same gradient on every student weight, as autograd through
    the whole logits. The heads have rows past the vocabulary (padding: CE sees them, KD not),
    the chunk does not divide the positions, and a tied head takes the embedding's gradient too."""
    student = tiny_llama(TOK, seed=1, hidden=32, layers=1)
    teacher = tiny_llama(TOK, seed=2, hidden=32, layers=1).eval()
    for m, seed in ((student, 3), (teacher, 4)):  # 5 padding rows past the vocabulary
        m.resize_token_embeddings(len(TOK) + 5)
        torch.manual_seed(seed)
        m.get_output_embeddings().weight.data.normal_(0, 0.3)
        if tied:
            m.get_output_embeddings().weight = m.get_input_embeddings().weight
    student.eval()  # no dropout: the two paths must see the same network
    eps = [distill.summary_episode(teacher_episode()).tokenized(TOK), teacher_episode()]
    n = sum(sft.n_generated(e) for e in eps)
    n_kd = sum(distill.kd_positions(e, prompt) for e in eps)
    kw = dict(kd_weight=0.3, temperature=2.0, vocab=len(TOK), max_batch_tokens=300, prompt=prompt, n_kd=n_kd)

    def loss_and_grads(fused: bool):
        student.zero_grad()
        loss, ce, kd = distill.distill_loss(student, teacher, eps, n, fused=fused, chunk=7, **kw)
        (2.0 * loss).backward()
        return loss.item(), ce, kd, {k: p.grad.clone() for k, p in student.named_parameters()}

    ref, got = loss_and_grads(False), loss_and_grads(True)
    assert got[:3] == pytest.approx(ref[:3], rel=1e-5)
    assert ref[1] > 0.1 and ref[2] > 0.01  # both terms are there to get wrong
    for k, g in ref[3].items():
        assert torch.allclose(got[3][k], g, rtol=1e-4, atol=1e-6), k
        assert g.abs().sum() > 0, k  # every weight is reached, the head included
    assert distill.distill_loss(student, teacher, eps, n, **kw)[0].item() == pytest.approx(ref[0], rel=1e-5)


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Six news-world documents and a split: three to generate on, three held out."""
    d = tmp_path_factory.mktemp("world")
    docs = list(newsworld.documents(6, seed=3))
    data.write_jsonl(str(d / "docs.jsonl"), docs)
    ids = [x.id for x in docs]
    entry = {x.id: {"id": x.id, "sha256": data.content_hash(x.text)} for x in docs}
    pools = {"train": [entry[i] for i in ids[:3]], "eval": [entry[i] for i in ids[3:]], "never_touch": []}
    (d / "split.json").write_text(json.dumps({"version": 1, "pools": pools}))
    return d


@pytest.fixture(scope="module")
def full_teacher(tmp_path_factory):
    path = tmp_path_factory.mktemp("teacher_full")
    return save_tiny_policy(path, TOK)


@pytest.fixture(scope="module")
def adapter_teacher(full_teacher, tmp_path_factory):
    """What rl.py saves: a LoRA adapter whose config names its base directory."""
    import peft
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(full_teacher)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    path = tmp_path_factory.mktemp("teacher_adapter")
    model.save_pretrained(path)
    TOK.save_pretrained(path)
    assert json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"] == full_teacher
    return str(path)


def config(teacher, world, runs_dir, **over):
    cfg = distill.Config(name="t", runs_dir=str(runs_dir), teacher=teacher, steps=5, batch_episodes=2,
                         warmup_steps=1, log_every=1, save_every=0, mask_check=4, torch_threads=1)
    cfg.data = distill.DistillData(docs=str(world / "docs.jsonl"), split=str(world / "split.json"))
    # a random teacher rarely ends before its token limit: keep its truncated episodes
    cfg.generate = distill.GenerateConfig(samples_per_doc=2, max_new_tokens=12, filter="none")
    cfg.eval = distill.DistillEval(n_docs=2, latency_docs=2, n_samples=1, max_new_tokens=12, factuality="oracle")
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_end_to_end_from_an_adapter_teacher(adapter_teacher, world, tmp_path, monkeypatch):
    report = distill.main(config(adapter_teacher, world, tmp_path, target="both", log=offline_trackers(monkeypatch)))
    run = tmp_path / "t"
    assert_trackers_match_metrics(run, keys=("loss", "kd", "ce"))
    final = run / "final"
    assert (final / "config.json").exists() and not (final / "adapter_config.json").exists()  # full weights
    model, tok = modeling.load_policy(modeling.trained_model_config(str(final)), train=False)
    assert tok.get_vocab() == TOK.get_vocab() and model.config.hidden_size == 64  # tiny-0.3m over the teacher's vocab
    ep = engine.rollout(model, tok, [DOC], 1, engine.SamplingConfig(temperature=0.0, max_new_tokens=8))[0]
    assert 0 < sum(len(t.ids) for t in ep.turns) <= 8
    saved = json.loads((run / "distill.json").read_text())
    for who in ("teacher", "student"):
        for key in ("latency_p50_ms", "latency_p95_ms", "factuality", "hallucination_rate", "tok_s", "n_params"):
            assert math.isfinite(saved[who][key]), (who, key)
    assert saved["param_ratio"] == pytest.approx(saved["teacher"]["n_params"] / saved["student"]["n_params"])
    for key in ("speedup_p50", "speedup_p95", "factuality_delta_points", "param_ratio"):
        assert math.isfinite(saved[key]) and saved[key] == pytest.approx(report[key])
    assert saved["speedup_p50"] == pytest.approx(
        saved["teacher"]["latency_p50_ms"] / saved["student"]["latency_p50_ms"])
    assert saved["teacher"]["n_docs"] == saved["student"]["n_docs"] == 2 and len(saved["examples"]) == 2
    assert saved["kd_weight"] == 0.5  # same vocabulary: KD on
    assert saved["teacher_episodes"]["generated"] == 3 * 2 and saved["targets"] == 2 * saved["teacher_episodes"]["kept"]
    rows = common.read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and all(math.isfinite(r["kd"]) for r in rows)


@pytest.mark.parametrize("n, every, kept", [(30, 2, [0, 2, 4, 6, 8, 10, 12, 14, 17, 19, 21, 23, 25, 27, 29]),
                                             (4, 2, [0, 3]), (5, 2, [0, 2, 4]), (2, 2, [0, 1]), (8, 4, [0, 7]),
                                             (6, 1.5, [0, 2, 3, 5]), (30, 1.5, [0, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15,
                                                                               17, 18, 20, 21, 23, 24, 26, 27, 29])])
def test_kept_layers_are_evenly_spaced_with_the_first_and_last(n, every, kept):
    assert distill.kept_layers(n, every) == kept


def test_a_pruned_teacher_student_keeps_its_layers_weights_and_merged_adapter(world, tmp_path):
    """keep_every=2 on a 4-layer adapter teacher: the student is layers 0 and 3 of the
    merged teacher, weight for weight, and distillation trains it from there."""
    import peft
    from transformers import AutoModelForCausalLM

    base_dir = save_tiny_policy(tmp_path / "base4", TOK, layers=4)
    teacher = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    teacher.save_pretrained(tmp_path / "teacher")
    TOK.save_pretrained(tmp_path / "teacher")
    merged = teacher.merge_and_unload().state_dict()
    cfg = config(str(tmp_path / "teacher"), world, tmp_path / "runs", keep_every=2, steps=2)
    distill.main(cfg)
    init = tmp_path / "runs" / "t" / "student_init"
    student = AutoModelForCausalLM.from_pretrained(init).state_dict()
    assert AutoModelForCausalLM.from_pretrained(init).config.num_hidden_layers == 2
    for new, old in ((0, 0), (1, 3)):
        for k, v in student.items():
            if k.startswith(f"model.layers.{new}."):
                assert torch.equal(v, merged[k.replace(f"layers.{new}.", f"layers.{old}.")]), k
    assert torch.equal(student["model.embed_tokens.weight"], merged["model.embed_tokens.weight"])
    final, _ = modeling.load_policy(modeling.trained_model_config(str(tmp_path / "runs" / "t" / "final")), train=False)
    assert final.config.num_hidden_layers == 2
    ep = engine.rollout(final, TOK, [DOC], 1, engine.SamplingConfig(temperature=0.0, max_new_tokens=6))[0]  # the KV cache
    assert 0 < sum(len(t.ids) for t in ep.turns) <= 6  # indexes the kept layers 0 and 1
    base = modeling.ModelConfig()
    assert distill.pruned_teacher(str(tmp_path / "teacher"), 2, init, base) == init  # the same request: reused
    assert AutoModelForCausalLM.from_pretrained(init).config.num_hidden_layers == 2
    distill.pruned_teacher(str(tmp_path / "teacher"), 1.5, init, base)  # other layers: built again, not reused
    student = AutoModelForCausalLM.from_pretrained(init)
    assert student.config.num_hidden_layers == 3 and torch.equal(
        student.state_dict()["model.layers.1.self_attn.q_proj.weight"], merged["model.layers.2.self_attn.q_proj.weight"])


def test_resume_gives_the_weights_of_an_uninterrupted_run(full_teacher, world, tmp_path, monkeypatch):
    over = dict(steps=4, save_every=2, eval=distill.DistillEval(n_docs=0))
    distill.main(config(full_teacher, world, tmp_path / "a", **over))
    with killed_after_checkpoint(monkeypatch, 2), pytest.raises(KeyboardInterrupt):
        distill.main(config(full_teacher, world, tmp_path / "b", **over))
    resumed = distill.main(config(full_teacher, world, tmp_path / "b", **over))
    assert resumed["teacher_episodes"]["cached"]  # the same teacher episodes, not sampled again
    from safetensors.torch import load_file

    for rel in ("final/model.safetensors", None):
        if rel is None:
            a, b = (load_file(str(common.list_checkpoints(tmp_path / r / "t")[-1] / "trainable.safetensors"))
                    for r in ("a", "b"))
        else:
            a, b = load_file(str(tmp_path / "a" / "t" / rel)), load_file(str(tmp_path / "b" / "t" / rel))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["step"] for r in common.read_metrics(tmp_path / "b" / "t" / "metrics.jsonl")] == [1, 2, 3, 4]


def test_vocabulary_mismatch_trains_with_cross_entropy_and_says_so(full_teacher, world, tmp_path, capsys):
    other = tmp_path / "other_student"
    tiny_llama(bpe_tokenizer(300), seed=0, hidden=32, layers=1).save_pretrained(other)
    bpe_tokenizer(300).save_pretrained(other)
    cfg = config(full_teacher, world, tmp_path, steps=2, target="episode", eval=distill.DistillEval(n_docs=0),
                 student=modeling.ModelConfig(name_or_path=str(other), lora=modeling.LoraConfig(enabled=False)))
    report = distill.main(cfg)
    assert report["kd_weight"] == 0.0 and "vocabularies differ" in capsys.readouterr().out
    rows = common.read_metrics(tmp_path / "t" / "metrics.jsonl")
    assert all(math.isnan(r["kd"]) and math.isfinite(r["ce"]) for r in rows)
    assert json.loads((tmp_path / "t" / "distill.json").read_text())["last"]["kd"] is None


def test_the_tiny_config_loads():
    cfg = settings.load_config(distill.Config, ["--config", str(ROOT / "configs" / "distill_tiny.yaml")])
    assert cfg.student.name_or_path in tiny.TINY_PRESETS and cfg.eval.factuality == "oracle"
    assert cfg.torch_threads == 0 and not cfg.student.lora.enabled
