"""Dr. GRPO: advantages and loss by hand, every generated token trained once,
the guards (mask validation, non-finite values, sampler/trainer gap), exact
resume after a kill, learning an easy reward, the configs and the VRAM plan."""
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import data
import rl
import sandbox as S
from factual_tools import common, engine, modeling, scoring, settings, vram
import newsworld
from newsworld import tiny
from helpers import (DOC, assert_trackers_match_metrics, bpe_tokenizer, offline_trackers, save_tiny_policy, script_ids,
                     tiny_llama)

ROOT = Path(__file__).resolve().parent.parent
TOK = bpe_tokenizer()


# ---------------------------------------------------------------------------
# Advantages and the loss, by hand
# ---------------------------------------------------------------------------


def test_group_advantages_are_centred_not_scaled():
    got = rl.group_advantages([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0], group_size=4)
    assert got == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    # GRPO would divide by the group's std: 0.5 / 0.408 = 1.22, and 0/0 for the flat group
    r = torch.tensor([1.0, 0.0, 0.5, 0.5])
    assert got[0] != pytest.approx(((r - r.mean()) / r.std())[0].item())


def test_dr_grpo_weighs_every_token_alike_unlike_length_normalised_grpo():
    # one group of two rollouts: rewards 1 and 0, so A = +0.5 and -0.5
    adv_seq = rl.group_advantages([1.0, 0.0], 2)
    logp = torch.tensor([-1.0, -2.0, -0.5, -0.5, -1.0, -3.0], requires_grad=True)
    adv = torch.tensor([adv_seq[0]] * 2 + [adv_seq[1]] * 4)
    loss = rl.dr_grpo_loss(logp, logp.detach(), adv, n_rollouts=2, max_new_tokens=4)[0]
    loss.backward()
    # ratio 1 everywhere: loss = -(sum of A over tokens) / (2 x 4) = -(2 x 0.5 - 4 x 0.5) / 8
    assert loss.item() == pytest.approx(0.125)
    assert logp.grad.tolist() == pytest.approx([-0.0625] * 2 + [0.0625] * 4)  # -A / 8, whatever the length
    # GRPO (Shao et al.): mean over each sequence's tokens, then over sequences
    lp2 = logp.detach().clone().requires_grad_(True)
    per_seq = [lp2[:2], lp2[2:]]
    grpo = -sum((torch.exp(s - s.detach()) * a).mean() for s, a in zip(per_seq, adv_seq)) / 2
    grpo.backward()
    assert lp2.grad.tolist() == pytest.approx([-0.125] * 2 + [0.0625] * 4)  # the short answer weighs double
    assert not torch.allclose(lp2.grad, logp.grad)


def test_ppo_clip_both_sides_kl_and_importance_weights():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 0.5, 1.5]))  # ratios
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, kl, clipped = rl.ppo_token_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    # -min(rA, clip(r)A): clipped at 1.2 / 0.8 where it would help the objective, never where it hurts
    assert loss.tolist() == pytest.approx([-1.2, 0.8, -0.5, 1.5])
    assert clipped.tolist() == [True, True, False, False] and kl is None
    loss_hi, _, _ = rl.ppo_token_loss(logp, old, adv, clip_low=0.2, clip_high=0.28)  # DAPO's clip-higher
    assert loss_hi[0].item() == pytest.approx(-1.28)
    ref = logp + math.log(2.0)  # ref / pi = 2 everywhere: k3 = 2 - ln 2 - 1
    w = torch.tensor([0.5, 1.0, 2.0, 1.0])
    loss_kl, kl, _ = rl.ppo_token_loss(logp, old, adv, clip_low=0.2, clip_high=0.2, ref_logp=ref, beta=0.1, is_weight=w)
    assert kl.tolist() == pytest.approx([1 - math.log(2.0)] * 4)
    assert loss_kl.tolist() == pytest.approx([a * b + 0.1 * (1 - math.log(2.0)) for a, b in
                                              zip([-1.2, 0.8, -0.5, 1.5], w.tolist())])
    _, kl0, _ = rl.ppo_token_loss(logp, old, adv, ref_logp=logp.clone(), beta=0.1)
    assert kl0.abs().max().item() == 0.0


def test_turn_level_advantages_credit_each_call_on_its_own_turn():
    a = S.replay(DOC, "Acme grew.<search>acme</search> It rose 12%.")
    b = S.replay(DOC, "Acme grew.<search>revenue</search> Wrong.<search>/Globex/</search> Fine.")
    results = [{"total": 1.0, "tool_match_steps": [1.0]}, {"total": 0.0, "tool_match_steps": [0.5, 0.0]}]
    assert [len(e.turns) for e in (a, b)] == [2, 3]
    assert rl.turn_advantages([a, b], results, 2) == [[(0.5, 0.0), (0.5, 0.0)],
                                                      [(-0.5, 0.0), (-0.5, 0.0), (-0.5, 0.0)]]
    # step values 1.0, 0.5, 0.0: group mean 0.5; only call turns get credit
    assert rl.turn_advantages([a, b], results, 2, "turn", credit=1.0) == [[(0.5, 0.5), (0.5, 0.0)],
                                                                       [(-0.5, 0.0), (-0.5, -0.5), (-0.5, 0.0)]]


def test_toolmatch_is_counted_once_and_its_credit_lands_on_the_call_tag_only():
    """v19's reward holds w_match x ToolMatch; with turn credit that term leaves the
    outcome advantage (else it is counted twice), and a call's credit goes to the tokens
    of its tag, not to the sentence written before it in the same turn."""
    eps = [S.replay(DOC, "Acme grew 12%.<search>acme</search> Fine."), S.replay(DOC, "Acme grew.")]
    results = [{"total": 0.5 + 0.25 * 1.0, "tool_match": 1.0, "tool_match_steps": [1.0]},
               {"total": 0.5 + 0.25 * 0.0, "tool_match": 0.0, "tool_match_steps": []}]
    adv = rl.turn_advantages(eps, results, 2, "turn", credit=1.0, w_match=0.25)
    assert adv == [[(0.0, 0.0), (0.0, 0.0)], [(0.0, 0.0)]]  # equal outcomes; the only call is the mean
    results[1]["tool_match_steps"] = [0.0]
    eps[1] = S.replay(DOC, "Acme grew.<search>zzz</search> Fine.")
    adv = rl.turn_advantages(eps, results, 2, "turn", credit=1.0, w_match=0.25)
    assert adv == [[(0.0, 0.5), (0.0, 0.0)], [(0.0, -0.5), (0.0, 0.0)]]
    assert rl.turn_advantages(eps, results, 2, "outcome", w_match=0.25)[0][0] == (0.125, 0.0)
    # tokens: the credit starts at the tag's first token
    tok = TOK
    for ep in eps:
        for t in ep.turns:
            t.ids = tok.encode(t.text, add_special_tokens=False)
    starts = rl.call_tag_starts(eps, tok)
    for ep, st in zip(eps, starts):
        t = ep.turns[0]
        prefix = tok.decode(t.ids[:st[0]])
        assert t.text.startswith(prefix) and len(prefix) <= t.call.start
        assert len(tok.decode(t.ids[:st[0] + 1])) > t.call.start  # the next token holds the tag's start
        assert st[1] == len(ep.turns[1].ids)
    per_token = rl.token_advantages(eps, adv, starts)
    n0 = len(eps[0].turns[0].ids)
    assert per_token[:starts[0][0]].abs().max() == 0 and (per_token[starts[0][0]:n0] == 0.5).all()
    with pytest.raises(ValueError, match="tag_starts"):
        rl.token_advantages(eps, adv)


def split_world(tmp_path):
    """200 news-world documents and their split, written to tmp_path: (docs, manifest, docs path, split path)."""
    docs = list(newsworld.documents(200, seed=0))
    manifest = data.make_split(docs, seed=0)
    docs_path, split_path = tmp_path / "docs.jsonl", tmp_path / "split.json"
    data.write_jsonl(str(docs_path), docs)
    split_path.write_text(json.dumps(manifest))
    return docs, manifest, docs_path, split_path


def test_training_documents_come_from_the_train_pool_or_a_fresh_world_never_a_held_out_cluster(tmp_path):
    docs, manifest, docs_path, split_path = split_world(tmp_path)
    pool = {p: {e["id"] for e in manifest["pools"][p]} for p in data.POOLS}
    cfg = rl.DocumentData(train=str(docs_path), split=str(split_path))
    train, held, _ = rl.load_documents(cfg)
    assert {d.id for d in train} == pool["train"] and {d.id for d in held} == pool["eval"]
    fresh = rl.DocumentData(train=str(docs_path), split=str(split_path), fresh=150, fresh_seed=0)
    train, held, how = rl.load_documents(fresh)  # the split's own world drawn again: its held-out articles skipped
    assert {d.id for d in held} == pool["eval"] and "fresh" in how
    assert not {d.id for d in train} & (pool["eval"] | pool["never_touch"]) and len(train) >= 100
    other = rl.load_documents(rl.DocumentData(train=str(docs_path), split=str(split_path), fresh=50, fresh_seed=9))[0]
    assert len(other) >= 48 and not {d.id for d in other} & {d.id for d in docs}
    with pytest.raises(SystemExit, match="data.fresh needs a split"):
        rl.load_documents(rl.DocumentData(train=str(docs_path), split="", fresh=10))


def test_the_pools_are_checked_against_the_split_content_hashes(tmp_path):
    docs, manifest, docs_path, split_path = split_world(tmp_path)
    held = next(d for d in docs if d.id in {e["id"] for e in manifest["pools"]["eval"]})
    changed = [dataclasses.replace(d, text=d.text + " Extra.") if d.id == held.id else d for d in docs]
    data.write_jsonl(str(docs_path), changed)
    with pytest.raises(SystemExit, match=rf"{held.id}.*changed since {split_path}"):
        rl.load_documents(rl.DocumentData(train=str(docs_path), split=str(split_path)))


def test_validation_documents_are_fresh_and_leave_the_eval_pool_alone(tmp_path):
    _, manifest, docs_path, split_path = split_world(tmp_path)
    held_pools = {e["id"] for p in ("eval", "never_touch") for e in manifest["pools"][p]}
    cfg = rl.DocumentData(train=str(docs_path), split=str(split_path), fresh=20, validation=30, validation_seed=0)
    train, val, how = rl.load_documents(cfg)  # the split's own world: its held-out articles are skipped
    assert 20 <= len(val) < 30 and not {d.id for d in val} & held_pools and "validation" in how
    assert not {d.id for d in val} & {d.id for d in train}
    with pytest.raises(SystemExit, match="would be training documents"):
        rl.load_documents(dataclasses.replace(cfg, fresh_seed=0))
    with pytest.raises(SystemExit, match="data.validation needs a split"):
        rl.load_documents(rl.DocumentData(train=str(docs_path), split="", validation=10))


def test_step_documents_walk_a_seeded_permutation_per_epoch():
    seen = [i for s in range(5) for i in rl.step_documents(10, 2, seed=3, step=s)]
    assert sorted(seen) == list(range(10))
    assert rl.step_documents(10, 2, 3, 7) == rl.step_documents(10, 2, 3, 7)
    assert [rl.step_documents(10, 2, 3, s) for s in range(5, 10)] != [rl.step_documents(10, 2, 3, s) for s in range(5)]


# ---------------------------------------------------------------------------
# Branches: each generated token once, in the context it was sampled in
# ---------------------------------------------------------------------------

DELETE_SCRIPT = ('Acme reported revenue of $5 billion.<search>/revenue of/</search><delete scope="sentence"/> '
                 'Acme grew.<search>Jane Doe</search> Jane Doe said, wrongly, Europe<delete scope="clause"/> fine.')


def scripted_rollout(model, scripts, docs, group=1, max_new=120):
    proc = engine.ScriptedProcessor({i: script_ids(TOK, s) for i, s in enumerate(scripts)})
    cfg = engine.SamplingConfig(temperature=1.0, max_new_tokens=max_new)
    return engine.rollout(model, TOK, docs, group, cfg, logits_processor=proc, generator=torch.Generator().manual_seed(0))


def test_a_delete_episodes_loss_covers_every_generated_token_once():
    model = tiny_llama(TOK, seed=0)
    (ep,) = scripted_rollout(model, [DELETE_SCRIPT], [DOC])
    branches = ep.branches()
    assert ep.n_delete == 2 and len(branches) == 3
    n = sum(len(t.ids) for t in ep.turns)
    assert sum(sum(b.loss_mask) for b in branches) == n
    lp = rl.flat(scoring.episode_logprobs(model, [ep]))
    assert lp.shape == (n,)
    assert torch.allclose(lp, rl.sampler_logprobs([ep]), atol=1e-4)  # same tokens, same order, same contexts
    adv = rl.token_advantages([ep], [[1.0] * len(ep.turns)])
    loss = rl.dr_grpo_loss(lp, lp.detach(), adv, n_rollouts=1, max_new_tokens=120)[0]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    # by hand: each branch on its own, log-probs of its masked positions only
    total = 0.0
    for b in branches:
        ids = torch.tensor([b.input_ids])
        logp = F.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        total = total + sum(logp[p - 1, b.input_ids[p]] for p, m in enumerate(b.loss_mask) if m)
    want = torch.autograd.grad(-total / 120, list(model.parameters()))
    for g, w in zip(grads, want):
        assert torch.allclose(g, w, atol=1e-6)


def test_group_scoring_equals_one_tree_per_episode():
    model = tiny_llama(TOK, seed=0)
    scripts = [DELETE_SCRIPT, 'Short one.<delete scope="sentence"/> Better.', "Acme grew.", DELETE_SCRIPT]
    eps = scripted_rollout(model, scripts, [DOC, DOC[:300]], group=2)
    per_episode = rl.flat(scoring.episode_logprobs(model, eps, method="tree"))
    grouped = rl.flat(scoring.group_logprobs(model, eps, group_size=2, max_batch_tokens=600))  # two chunks
    assert not hasattr(rl, "group_logprobs")  # the tree scorer is driven from scoring.py only
    assert grouped.shape == per_episode.shape and torch.allclose(grouped, per_episode, atol=1e-5)
    assert torch.allclose(grouped, rl.sampler_logprobs(eps), atol=1e-4)


def test_stops_end_turns_and_the_end_of_turn_token_is_trained_not_summarised():
    model = tiny_llama(TOK, seed=0)
    eps = scripted_rollout(model, [DELETE_SCRIPT, "Acme grew 12%."], [DOC, DOC[:300]])
    eot = TOK.eos_token_id
    for ep in eps:
        for t in ep.turns[:-1]:  # every turn but the last ended at its tool call's closing characters
            assert t.ended == "call" and t.text.endswith(("</search>", "/>")) and eot not in t.ids
        last = ep.turns[-1]
        assert last.ended == "eos" and last.ids[-1] == eot and "<|eot|>" not in ep.summary
        assert len(rl.token_advantages([ep], [[0.0] * len(ep.turns)])) == sum(len(t.ids) for t in ep.turns)
    assert eps[1].summary == "Acme grew 12%." and eps[0].summary == "Acme grew. Jane Doe said, wrongly, fine."
    scoring.validate_masks(eps, TOK)


# ---------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A random tiny Llama over the test tokenizer, saved like any model."""
    path = tmp_path_factory.mktemp("policy")
    return save_tiny_policy(path, TOK)


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    texts = [DOC, DOC[:300], "Acme rose 5% on Monday. Globex fell 2%. Jane K. Doe resigned.", DOC[90:]]
    data.write_jsonl(str(path), [data.Document(id=f"d{i}", text=t) for i, t in enumerate(texts)])
    return str(path)


def first_entity(text: str) -> str:
    return re.search(r"[A-Z][a-z]+", text).group()


def mention_reward(documents, episodes):
    """A deliberately easy reward: mention the document's first entity (twice for full marks)."""
    return [{"total": min(1.0, e.summary.count(first_entity(d.text)) / 2), "pass": first_entity(d.text) in e.summary}
            for d, e in zip(documents, episodes)]


def config(policy, docs, tmp_path, lora=False, **over):
    cfg = rl.Config(name="t", runs_dir=str(tmp_path), model=modeling.ModelConfig(
        name_or_path=policy, lora=modeling.LoraConfig(enabled=lora, rank=4, alpha=8)),
        data=rl.DocumentData(train=docs, split=""), steps=2, prompts_per_step=2, group_size=4, micro_groups=1, lr=1e-2)
    cfg.sampling.max_new_tokens = 16
    cfg.eval = rl.RLEval(every=0, n_docs=0, sample_every=1, n_samples=2)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def trainable(run_dir):
    from safetensors.torch import load_file

    return load_file(str(common.list_checkpoints(run_dir)[-1] / "trainable.safetensors"))


def test_keep_best_makes_final_the_best_evaluated_step_not_the_last(policy, docs, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    totals = iter([0.9, 0.2, 0.7, 0.3, 0.1])  # steps 0 (never a candidate), 1, 2, 3, 4
    real = rl.rewards.Scorer.score_batch  # the held-out evaluation's: training takes reward_fn

    def scripted(self, items, *a, **k):
        t = next(totals)
        return [{**s, "total": t} for s in real(self, items, *a, **k)]

    monkeypatch.setattr(rl.rewards.Scorer, "score_batch", scripted)
    cfg = config(policy, docs, tmp_path, steps=4, save_every=1, keep_checkpoints=10)
    cfg.data.eval = docs
    cfg.eval = rl.RLEval(every=1, n_docs=2, sample_every=0, keep_best="eval_total")
    rl.main(cfg, reward_fn=spread_reward)  # every step updates, so steps 2 and 4 differ
    run = tmp_path / "t"
    assert json.loads((run / "best.json").read_text()) == {"metric": "eval_total", "value": 0.7, "step": 2}
    final = load_file(str(run / "final" / "model.safetensors"))
    at = {s: load_file(str(run / "checkpoints" / f"step_{s:08d}" / "trainable.safetensors")) for s in (2, 4)}
    name = next(k for k in at[2] if k.endswith("q_proj.weight"))
    key = next(k for k in final if k.endswith(name.split("model.", 1)[-1]))
    assert torch.equal(final[key], at[2][name]) and not torch.equal(final[key], at[4][name])
    cfg.eval.keep_best = "eval_nonsense"
    totals = iter([0.5] * 10)
    with pytest.raises(SystemExit, match="not an eval metric"):
        rl.main(dataclasses.replace(cfg, name="u"), reward_fn=mention_reward)


def test_resume_after_a_kill_ends_where_an_uninterrupted_run_ends(policy, docs, tmp_path):
    full = rl.main(config(policy, docs, tmp_path / "a", steps=4), reward_fn=mention_reward)

    calls = []

    def killed_in_step_3(documents, episodes):  # the process dies mid-step 3, after checkpoint 2
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt("kill")
        return mention_reward(documents, episodes)

    cfg = config(policy, docs, tmp_path / "b", steps=4)
    with pytest.raises(KeyboardInterrupt):
        rl.main(cfg, reward_fn=killed_in_step_3)
    run_b = tmp_path / "b" / "t"
    assert common.list_checkpoints(run_b)[-1].name == "step_00000002"
    (run_b / "checkpoints" / ".step_00000003.dead.tmp").mkdir()  # a save the kill cut short
    resumed = rl.main(cfg, reward_fn=mention_reward)
    a, b = trainable(tmp_path / "a" / "t"), trainable(run_b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [h["reward"] for h in resumed["history"]] == [h["reward"] for h in full["history"][2:]]
    steps = [r["step"] for r in common.read_metrics(run_b / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]  # nothing logged twice
    assert [json.loads(x)["step"] for x in (run_b / "samples.jsonl").read_text().splitlines()] == [1, 1, 2, 2, 3, 3, 4, 4]


def tool_reward(documents, episodes):
    """Distinct totals within a group, and a ToolMatch value per call for turn credit."""
    return [{"total": len(e.summary) / 100 + 0.01 * i,
             "tool_match_steps": [(0.3 * i + 0.1 * k) % 1 for k in range(e.n_search + e.n_delete)]}
            for i, e in enumerate(episodes)]


SCRIPTS = [DELETE_SCRIPT, "Acme grew.<search>Jane Doe</search> Jane Doe resigned.",
           "Revenue fell.<delete scope=\"sentence\"/> Acme rose.", "Globex fell 2%."]


@pytest.mark.parametrize("advantage, micro_groups, vllm_shift, max_batch_tokens, checkpointing", [
    ("outcome", 1, None, 16384, False), ("outcome", 2, None, 16384, False), ("turn", 1, None, 16384, False),
    ("outcome", 2, None, 300, False),  # group trees split into parts of a rollout or two (micro_batches)
    ("outcome", 2, None, 16384, True),  # layers recomputed in the backward, through the same tree attention
    ("outcome", 1, -0.1, 16384, False), ("outcome", 1, -0.4, 16384, False),  # the vLLM path: IS weight
])                                                                            # exp(0.1); exp(0.4) capped at 1.2
def test_the_update_is_the_gradient_of_the_hand_computed_dr_grpo_loss(policy, docs, tmp_path, monkeypatch,
                                                                      advantage, micro_groups, vllm_shift,
                                                                      max_batch_tokens, checkpointing):
    """rl.main's own gradient, just before the optimizer step, against one computed
    here from its rollouts (scripted, so they search and delete): A = R - mean(R of
    the group), plus with advantage=turn the call's ToolMatch value minus the group's
    mean on each call turn; the ratio to the sampler's log-probs; every generated token
    summed and divided by n_rollouts x max_new_tokens. A token mean, a per-sequence
    mean, std-scaled advantages or outcome-only credit give another gradient. On the
    vLLM path (a sampler whose log-probs are off by `vllm_shift`) every token's loss
    is weighted by min(p_trainer / p_sampler, tis_cap): truncated importance sampling."""
    seen, checked, max_new, G = {}, [], 120, 4
    real_rollout, real_logprobs, real_clip = engine.rollout, rl.logprobs, torch.nn.utils.clip_grad_norm_

    def scripted(model, tok, documents, group, scfg, limits, generator=None):
        seen["tok"] = tok
        proc = engine.ScriptedProcessor({i: script_ids(tok, SCRIPTS[i % len(SCRIPTS)]) for i in range(len(documents) * group)})
        eps = real_rollout(model, tok, documents, group, scfg, limits, generator=generator, logits_processor=proc)
        with torch.no_grad():  # the sampler's log-probs without the script's bias: those of the policy itself
            for ep, lps in zip(eps, scoring.episode_logprobs(model, eps, method="branch")):
                for t, lp in zip(ep.turns, lps):
                    t.logprobs = lp.tolist() if lp is not None else []
        return eps

    def spy_logprobs(model, episodes, cfg, temperature, group=None):
        seen["model"] = model
        seen.setdefault("eps", []).extend(episodes)
        seen.setdefault("passes", []).append(len(episodes))
        return real_logprobs(model, episodes, cfg, temperature, group)

    def check_then_clip(params, max_norm, *args, **kwargs):
        params, eps, model = list(params), seen.pop("eps"), seen["model"]
        got = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        results = tool_reward(None, eps)
        r = torch.tensor([x["total"] for x in results], dtype=torch.float64).view(-1, G)
        base = (r - r.mean(1, keepdim=True)).flatten().tolist()
        logp = scoring.episode_logprobs(model, eps, method="branch")
        loss, n_calls = 0.0, 0
        for e, ep in enumerate(eps):
            group = results[e // G * G:e // G * G + G]
            pooled = [x for res in group for x in res["tool_match_steps"]]
            j = 0
            for t, lp in zip(ep.turns, logp[e]):
                a = torch.full((len(t.ids),), base[e], dtype=torch.float64)
                if advantage == "turn" and t.call is not None:
                    # the credit from the first token whose text reaches the tag's first character
                    k = next(k for k in range(len(t.ids)) if len(seen["tok"].decode(t.ids[:k + 1])) > t.call.start)
                    a[k:] += results[e]["tool_match_steps"][j] - sum(pooled) / len(pooled)
                    j += 1
                n_calls += t.call is not None
                if lp is not None and lp.numel():
                    sampler = torch.tensor(t.logprobs)
                    a = a.to(lp.dtype)
                    if vllm_shift is None:  # the sampler is the policy: its log-probs are the old ones
                        loss = loss - (a * torch.exp(lp - sampler)).sum()
                    else:  # old = the trainer's first pass; IS weight to the sampler, capped
                        w = torch.exp(lp.detach() - sampler).clamp(max=1.2)
                        loss = loss - (a * w * torch.exp(lp - lp.detach())).sum()
        (loss / (len(eps) * max_new)).backward()
        for p, g in zip(params, got):
            torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-8)
            p.grad = g
        checked.append((len(eps), n_calls))
        return real_clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(engine, "rollout", scripted)
    monkeypatch.setattr(rl, "logprobs", spy_logprobs)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", check_then_clip)
    cfg = config(policy, docs, tmp_path, steps=2, micro_groups=micro_groups, save_every=0, advantage=advantage,
                 sampling=engine.SamplingConfig(max_new_tokens=max_new), lora=vllm_shift is not None, tis_cap=1.2,
                 autocast="none", max_batch_tokens=max_batch_tokens)  # the gradient computed here is fp32's;
    # `auto` may pick bf16 on this CPU
    cfg.model.gradient_checkpointing = checkpointing
    if vllm_shift is not None:
        fake_vllm(monkeypatch, vllm_shift)  # its rollouts come from the scripted engine.rollout above
        cfg.sampling.backend = "vllm"
    rl.main(cfg, reward_fn=tool_reward)
    assert [n for n, _ in checked] == [8, 8] and all(c >= 8 for _, c in checked)  # every rollout, calls included
    whole = 2 * 8 // (4 * micro_groups)  # passes of whole groups in two steps
    assert len(seen["passes"]) == whole if max_batch_tokens > 1000 else len(seen["passes"]) > whole


def test_step_figures_reach_tensorboard_and_wandb(policy, docs, tmp_path, monkeypatch):
    cfg = config(policy, docs, tmp_path, steps=3, save_every=0, log=offline_trackers(monkeypatch))
    rl.main(cfg, reward_fn=mention_reward)
    assert_trackers_match_metrics(tmp_path / "t", keys=("reward", "grad_norm", "len"))


def test_one_step_through_the_named_functions_is_the_step_main_takes(policy, docs, tmp_path):
    """main reads as set-up, then rollout -> score -> update -> log: the same calls made by hand
    give main's first step exactly (every logged figure but the timings), and leave the step
    counter, the curriculum and the optimizer where main leaves them."""
    def spread(documents, episodes):  # rewards that differ within a group, so the step moves the weights
        return [{"total": len(e.summary) % 7 / 7, "pass": len(e.summary) % 2 == 0} for e in episodes]

    ran = rl.main(config(policy, docs, tmp_path / "main", steps=1, save_every=1), reward_fn=spread)
    t = rl.setup(config(policy, docs, tmp_path / "hand", steps=1, save_every=1), custom_reward=True)
    assert t.step == 0 and len(t.train_docs) == 4
    docs_, eps = rl.rollout_step(t)
    assert len(docs_) == 2 and len(eps) == 2 * 4  # prompts_per_step documents, each with its group
    results, step_eps, turn_adv = rl.score_step(t, docs_, eps, spread)
    assert len(results) == len(step_eps) == len(turn_adv) == 8
    batches = rl.update_batches(t, eps, turn_adv)
    upd = rl.update(t, batches, len(step_eps))
    after = trainable(tmp_path / "main" / "t")  # main's weights after its step, which moved them
    assert ran["history"][0]["grad_norm"] > 0 and upd["grad_norm"] > 0
    assert all(torch.equal(p.detach(), after[n]) for n, p in t.model.named_parameters() if p.requires_grad)
    fields = rl.step_fields(t, step_eps, batches, upd, (0.0, 1.0, 2.0, 3.0))
    timing = {"rollout_s", "reward_s", "update_s", "tok_s"}
    want = {k: v for k, v in ran["history"][0].items() if k not in timing}
    got = {k: v for k, v in fields.items() if k not in timing}
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] or (math.isnan(got[k]) and math.isnan(want[k])) for k in want), (got, want)
    assert fields["rollout_s"] == 1.0 and fields["update_s"] == 1.0


def test_learns_an_easy_reward_within_a_bounded_number_of_steps(policy, docs, tmp_path):
    cfg = config(policy, docs, tmp_path, steps=30, group_size=8, save_every=0, sampling=engine.SamplingConfig(
        max_new_tokens=24), autocast="none")  # fp32: the sampler's log-probs are the trainer's to 1e-3
    cfg.eval.sample_every = 0
    hist = rl.main(cfg, reward_fn=mention_reward)["history"]
    first = sum(h["reward"] for h in hist[:5]) / 5
    last = sum(h["reward"] for h in hist[-5:]) / 5
    assert first < 0.2 and last > 0.6, [round(h["reward"], 2) for h in hist]
    assert all(h["gap"] < 1e-3 for h in hist if not math.isnan(h["gap"]))  # sampler log-probs = trainer's


def test_mask_validation_guards_every_update(policy, docs, tmp_path, monkeypatch):
    checked = []
    real = S.check_branches
    monkeypatch.setattr(S, "check_branches", lambda ep, *a, **k: (checked.append(ep), real(ep, *a, **k)))
    rl.main(config(policy, docs, tmp_path / "ok", save_every=0), reward_fn=mention_reward)
    assert len(checked) == 2 * 2 * 4  # every episode of every step

    def drifted(ep, branches, *a, **k):
        raise S.MaskError("trained positions drifted")

    monkeypatch.setattr(S, "check_branches", drifted)
    cfg = config(policy, docs, tmp_path / "bad")
    with pytest.raises(S.MaskError):
        rl.main(cfg, reward_fn=mention_reward)
    assert not common.list_checkpoints(tmp_path / "bad" / "t")  # nothing was updated or saved


def test_a_non_finite_reward_aborts_with_the_documents_named(policy, docs, tmp_path):
    def nan_reward(documents, episodes):
        return [{"total": math.nan if i == 5 else 0.0} for i in range(len(episodes))]

    with pytest.raises(FloatingPointError, match=r"step 1: non-finite reward for documents \[\('d"):
        rl.main(config(policy, docs, tmp_path), reward_fn=nan_reward)


def spread_reward(documents, episodes):
    """Rewards that always differ within a group, so every step updates."""
    return [{"total": i % 4 / 4} for i in range(len(episodes))]


def test_kl_to_the_reference_and_inner_epochs(policy, docs, tmp_path):
    for lora in (True, False):  # reference: adapter disabled / a frozen copy of the initial weights
        # One inner epoch: the KL logged is the policy's before the step's update. In step 1
        # the policy is its reference; in step 2 it has moved away from the frozen start. A
        # reference taken from the current weights would read 0 in step 2 as well.
        cfg = config(policy, docs, tmp_path / f"kl{lora}", lora=lora, beta=0.1, mu=1, steps=2)
        hist = rl.main(cfg, reward_fn=spread_reward)["history"]
        assert hist[0]["kl"] < 1e-7 < 1e-5 < hist[1]["kl"], [h["kl"] for h in hist]
        cfg = config(policy, docs, tmp_path / str(lora), lora=lora, beta=0.1, mu=2, steps=2)
        hist = rl.main(cfg, reward_fn=spread_reward)["history"]
        assert hist[0]["kl"] > 1e-5  # the second inner epoch scores an updated policy
        trainer = torch.load(common.list_checkpoints(tmp_path / str(lora) / "t")[-1] / "trainer.pt", weights_only=False)
        assert {int(s["step"]) for s in trainer["optimizer"]["state"].values()} == {4}  # mu optimizer steps a step
        assert all(h["gap"] < 1e-3 for h in hist)  # the no-grad pass scores what the sampler sampled


def fake_vllm(monkeypatch, shift):
    """The vLLM path on a CPU: the hf engine stands in for vLLM, and its recorded
    log-probs are moved by `shift` nats, as a different sampler's would be."""
    real_load, requests = modeling.load_from_init, []

    def load(*args, **kwargs):
        model, tok = real_load(*args, **kwargs)
        model.vllm_engine = types.SimpleNamespace(policy=model)  # not a submodule
        model.load_lora = lambda path, load_tensors=False: requests.append((path, load_tensors)) or "lora"
        return model, tok

    def rollout_vllm(llm, tok, docs, group, cfg, limits, lora_request=None):
        eps = engine.rollout(llm.policy, tok, docs, group, engine.SamplingConfig(temperature=cfg.temperature,
                                                                max_new_tokens=cfg.max_new_tokens, seed=cfg.seed),
                        limits)
        for e in eps:
            for t in e.turns:
                t.logprobs = [x + shift for x in t.logprobs]
        return eps

    monkeypatch.setattr(modeling, "load_from_init", load)
    monkeypatch.setattr(engine, "rollout_vllm", rollout_vllm)
    return requests


def test_vllm_path_refreshes_the_adapter_and_corrects_the_sampler_mismatch(policy, docs, tmp_path, monkeypatch):
    requests = fake_vllm(monkeypatch, 0.05)
    cfg = config(policy, docs, tmp_path / "ok", lora=True, save_every=0)
    cfg.sampling.backend = "vllm"
    hist = rl.main(cfg, reward_fn=spread_reward)["history"]
    assert len(requests) == 2 and all(lt for _, lt in requests)  # a fresh LoRA request before every step
    assert all(abs(h["gap"] - 0.05) < 1e-3 for h in hist)
    requests = fake_vllm(monkeypatch, 1.0)
    with pytest.raises(RuntimeError, match="differ by 1.0"):
        rl.main(config(policy, docs, tmp_path / "bad", lora=True, sampling=engine.SamplingConfig(
            backend="vllm", max_new_tokens=16)), reward_fn=spread_reward)


def pushed_to_tools(monkeypatch):
    """Rollouts of a policy pushed to write SCRIPTS (searches and deletes, row by row);
    the logits processor rl.py passes (its tool ban) acts after the push."""
    real = engine.rollout

    def pushed(model, tok, documents, group, scfg, limits, generator=None, logits_processor=None):
        push = engine.ScriptedProcessor({i: script_ids(tok, SCRIPTS[i % len(SCRIPTS)]) for i in range(len(documents) * group)})
        both = push if logits_processor is None else lambda rows, logits: logits_processor(rows, push(rows, logits))
        return real(model, tok, documents, group, scfg, limits, generator=generator, logits_processor=both)

    monkeypatch.setattr(engine, "rollout", pushed)


@pytest.mark.parametrize("tools", ["all", "none", "no_search"])
def test_the_tools_setting_bans_tool_calls_from_rollouts_and_the_held_out_evaluation(policy, docs, tmp_path,
                                                                                      monkeypatch, tools):
    """tools=none (the tool-free control): however hard the policy is pushed toward its tools,
    no rollout of a step and no held-out episode opens <search or <delete; the reward and the
    update run as usual. tools=all lets the same push through; no_search bans searches only."""
    pushed_to_tools(monkeypatch)
    seen = []

    def reward(documents, episodes):
        seen.extend(episodes)
        return spread_reward(documents, episodes)

    cfg = config(policy, docs, tmp_path, steps=1, save_every=0, tools=tools, sampling=engine.SamplingConfig(
        max_new_tokens=120))
    cfg.data.eval = docs
    cfg.eval = rl.RLEval(every=0, n_docs=2, sample_every=0, max_new_tokens=120)
    out = rl.main(cfg, reward_fn=reward)
    assert len(seen) == 8 and all(e.summary.strip() for e in seen)
    searches, deletes = sum(e.n_search for e in seen), sum(e.n_delete for e in seen)
    texts = "".join(e.text for e in seen)
    ev = out["eval"]
    if tools == "all":
        assert searches and deletes and ev["eval_searches"] > 0 and ev["eval_deletes"] > 0
    elif tools == "none":
        assert searches == deletes == 0 and "<search" not in texts and "<delete" not in texts
        assert ev["eval_searches"] == ev["eval_deletes"] == 0 and out["history"][0]["search"] == 0
    else:
        assert searches == 0 and deletes > 0 and "<search" not in texts and ev["eval_searches"] == 0
    saved = settings.load_config(rl.Config, ["--config", str(tmp_path / "t" / "config.yaml")])
    assert saved.tools == tools


# ---------------------------------------------------------------------------
# Configs and the plan
# ---------------------------------------------------------------------------


def flat_keys(d, prefix=""):
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):  # an empty map (limits: {}) holds no key
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def load(name, *over):
    return settings.load_config(rl.Config, ["--config", str(ROOT / "configs" / name), *over])


@pytest.mark.parametrize("name, change", [
    ("ablation_no_delete.yaml", {"limits.max_deletes": 0}),
    ("ablation_no_search.yaml", {"limits.max_searches": 0}),
    ("ablation_no_budget.yaml", {"reward.tools.budget_per_call": 0.0}),
    ("ablation_rules_only.yaml", {"reward.w_factuality": 0.0, "reward.w_rules": 1.0}),
])
def test_each_ablation_is_the_tiny_config_plus_its_stated_change(name, change):
    base, abl = flat_keys(settings.config_to_dict(load("tiny.yaml"))), flat_keys(settings.config_to_dict(load(name)))
    diff = {k for k in base.keys() | abl.keys() if base.get(k, "missing") != abl.get(k, "missing")}
    assert diff == {"name", *change} and {k: abl[k] for k in change} == change
    # a delta, not a copy: the file extends tiny.yaml and sets only the run name and the change
    text = (ROOT / "configs" / name).read_text()
    assert "extends: tiny.yaml" in text
    assert sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")) <= 8


def test_v17_v18_v19_step_by_step():
    v17, v18, v19 = (flat_keys(settings.config_to_dict(load(f"drgrpo_v{v}.yaml"))) for v in (17, 18, 19))
    changed = lambda a, b: {k for k in a if a[k] != b[k]} - {"name"}  # noqa: E731
    # the recipe's three knobs for v18 (samples per problem, learning rate, KL anchor), and for
    # v19 its blended reward (with the teacher episodes it needs), the step cap and the context
    # (with the model length and the KV cache share it takes)
    assert changed(v17, v18) == {"group_size", "lr", "beta"}
    assert changed(v18, v19) == {"reward.tools.w_match", "data.teacher", "limits.max_tool_calls",
                                 "sampling.max_context_tokens", "model.max_seq_len", "model.gpu_memory_utilization",
                                 "plan.injected_tokens"}
    assert v19["advantage"] == "outcome" and v19["sampling.max_new_tokens"] == v18["sampling.max_new_tokens"]
    assert v19["sampling.max_context_tokens"] > v18["sampling.max_context_tokens"]
    assert v17["reward.tools.w_match"] == v18["reward.tools.w_match"] == 0 < v19["reward.tools.w_match"]
    for v in (v17, v18, v19):
        assert v["model.backend"] == "unsloth" and v["model.fast_inference"] and v["sampling.backend"] == "vllm"
        assert v["model.quant"] == "4bit" and v["reward.factuality"] == "fenice"


def test_the_tools_setting_names_a_bad_value_and_a_sampler_that_cannot_ban():
    with pytest.raises(settings.ConfigError, match=r"'tools'.*'all', 'no_search', 'no_delete', 'none'.*'nonee'"):
        load("tiny.yaml", "tools=nonee")
    assert load("tiny.yaml", "tools=none").tools == "none" and load("tiny.yaml").tools == "all"
    with pytest.raises(settings.ConfigError, match=r"tools=none.*sampling.backend=vllm"):
        load("drgrpo_v19.yaml", "tools=none")  # vLLM takes no logits processor here


def test_plan_prints_the_components_and_v19_fits_24_gb_without_loading_anything():
    code = ("import sys, rl; from factual_tools import settings, vram; "
            "cfg = settings.load_config(rl.Config, ['--config', 'configs/drgrpo_v19.yaml']); "
            "print(vram.format_rl_plan(cfg)); print('transformers loaded:', 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "RL fits: 24 GB yes" in out and "transformers loaded: False" in out
    for part in ("weights", "adapter", "activations", "logits", "kv_cache", "rollout", "update"):
        assert part in out
    cli = subprocess.run([sys.executable, "rl.py", "--config", "configs/drgrpo_v17.yaml", "--plan"], cwd=ROOT,
                         capture_output=True, text=True)
    assert cli.returncode == 0 and "RL fits:" in cli.stdout
    bad = subprocess.run([sys.executable, "rl.py", "--config", "configs/drgrpo_v17.yaml", "--plan", "group_sise=4"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode != 0 and "did you mean 'group_size'" in bad.stderr and "Traceback" not in bad.stderr


def test_the_plan_for_several_gpus_is_per_gpu_with_each_ranks_share_of_the_groups():
    """`--plan plan.gpus=4`: each GPU rolls out 2 of v19's 8 groups a step (the others run on
    the other ranks) and updates its own micro-groups; the weights are on every GPU."""
    one = settings.load_config(rl.Config, ["--config", "configs/drgrpo_v19.yaml", "prompts_per_step=8"])
    four = settings.load_config(rl.Config, ["--config", "configs/drgrpo_v19.yaml", "prompts_per_step=8",
                                            "plan.gpus=4"])
    p1, p4 = vram.rl_memory_plan(one), vram.rl_memory_plan(four)
    assert p4.stages["update"] == p1.stages["update"] and p4.stages["rollout"]["weights"] == p1.stages["rollout"]["weights"]
    assert p4.vllm["kv_cache"] == pytest.approx(p1.vllm["kv_cache"] / 4)  # 2 groups' KV cache of 8
    text = vram.format_rl_plan(four)
    assert "8 groups a step over 4 GPUs, 2 in flight on each" in text and "RL fits per GPU:" in text
    with pytest.raises(settings.ConfigError, match="fast_inference"):
        settings.load_config(rl.Config, ["--config", "configs/drgrpo_v19.yaml", "model.tensor_parallel_size=2"])


@pytest.fixture(scope="module")
def tiny_sft(tmp_path_factory):
    """Stands in for runs/sft_tiny/final: a full tiny-1m model saved with save_pretrained."""
    return str(tiny.build_tiny_model("tiny-1m", tmp_path_factory.mktemp("sft") / "final", seed=0))


def test_the_tiny_config_runs_two_steps(tiny_sft, tmp_path):
    docs = list(newsworld.documents(60, seed=0))
    data.write_jsonl(str(tmp_path / "docs.jsonl"), docs)
    (tmp_path / "split.json").write_text(json.dumps(data.make_split(docs, seed=0)))
    cfg = load("tiny.yaml", f"init={tiny_sft}", f"runs_dir={tmp_path}", "steps=2", "prompts_per_step=2",
               "group_size=4", "sampling.max_new_tokens=32", "eval.n_docs=2", "eval.max_new_tokens=16",
               f"data.train={tmp_path}/docs.jsonl", f"data.split={tmp_path}/split.json", "data.fresh=20")
    out = rl.main(cfg)
    assert out["step"] == 2 and len(out["history"]) == 2 and "eval_pass" in out["eval"]
    run = tmp_path / "rl_tiny"
    assert (run / "final" / "adapter_config.json").exists()
    assert common.load_checkpoint(common.resolve_resume("auto", run), *modeling.load_policy(
        modeling.ModelConfig(name_or_path=tiny_sft, lora=cfg.model.lora))[:1])["state"]["scorer"]["curriculum"]
    with pytest.raises(SystemExit, match="sft.py --config configs/sft_tiny.yaml"):
        rl.main(load("tiny.yaml", f"init={tmp_path}/nowhere", f"runs_dir={tmp_path}/x"))


@pytest.mark.gpu
def test_unsloth_vllm_runs_two_steps(tmp_path):
    """One GPU: drgrpo_v19's stack (Unsloth 4-bit LoRA, colocated vLLM, refreshed
    adapter per step), shrunk to two small steps on news-world documents."""
    pytest.importorskip("unsloth")
    pytest.importorskip("vllm")
    model = os.environ.get("RL_GPU_MODEL", "unsloth/Qwen3-4B-Instruct-2507-bnb-4bit")
    cfg = load("drgrpo_v19.yaml", "init=", f"model.name_or_path={model}", f"runs_dir={tmp_path}", "steps=2",
               "prompts_per_step=2", "group_size=4", "sampling.max_new_tokens=64", "eval.n_docs=0",
               f"data.train={tmp_path}/missing.jsonl", "data.generate=8", "data.split=", "data.eval=",
               "data.teacher=", "reward.factuality=lexical", "reward.tools.w_match=0")
    out = rl.main(cfg)
    assert out["step"] == 2 and all(h["gap"] < cfg.max_logprob_gap for h in out["history"])


def test_rl_from_an_sft_adapter_anchors_the_kl_on_that_adapter_not_on_the_base(policy, docs, tmp_path):
    """v17-v19 start from an SFT adapter and continue it. The reference must be the
    starting policy (base + SFT adapter), so the KL of step 1 (one inner epoch, before
    any update) is 0; with "adapter disabled" as the reference it is the SFT-vs-base gap."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(policy)
    sft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in sft.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5)  # an SFT adapter that moved the policy well away from the base
    sft.save_pretrained(tmp_path / "sft_adapter")
    TOK.save_pretrained(tmp_path / "sft_adapter")
    cfg = config(policy, docs, tmp_path / "run", lora=True, beta=0.1, mu=1, steps=2,
                 init=str(tmp_path / "sft_adapter"))
    model, tok = modeling.load_from_init(cfg.model, cfg.init, reference=cfg.beta > 0)
    assert common.REFERENCE_ADAPTER in model.peft_config
    eps = engine.rollout(model, tok, [DOC], 2, engine.SamplingConfig(max_new_tokens=12, temperature=1.0), S.Limits())
    with torch.no_grad():
        now = rl.logprobs(model, eps, cfg, 1.0)
        with modeling.reference_model(model):
            ref = rl.logprobs(model, eps, cfg, 1.0)
        with model.disable_adapter():
            bare = rl.logprobs(model, eps, cfg, 1.0)
    assert torch.allclose(now, ref, atol=1e-6)
    assert (now - bare).abs().max() > 0.05  # the base model is far from the SFT policy
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(common.REFERENCE_ADAPTER not in n for n in trainable)

    hist = rl.main(cfg, reward_fn=spread_reward)["history"]
    assert hist[0]["kl"] < 1e-7 < 1e-5 < hist[1]["kl"], [h["kl"] for h in hist]
    final = tmp_path / "run" / "t" / "final"
    assert not (final / common.REFERENCE_ADAPTER).exists()  # the frozen copy is not saved
    assert (final / "adapter_config.json").exists()


def test_retracted_tokens_can_be_left_out_of_the_positive_credit():
    """A rollout that wrote a wrong sentence, searched, deleted and rewrote: with
    retracted_credit=negative its retracted tokens get no positive advantage (the
    correction is reinforced, the error is not); negative advantages still reach them."""
    builder_ep = engine.rollout(tiny_llama(TOK), TOK, [DOC], 1, engine.SamplingConfig(max_new_tokens=60),
                           S.Limits(), logits_processor=engine.ScriptedProcessor({0: script_ids(TOK, DELETE_SCRIPT)}))[0]
    ep = builder_ep
    assert any(t.masked for t in ep.turns)
    mask = rl.retracted_mask([ep])
    assert mask.sum().item() == sum(len(t.masked or ()) for t in ep.turns)
    assert len(mask) == sum(len(t.ids) for t in ep.turns)
    pos, neg = torch.full((len(mask),), 0.5), torch.full((len(mask),), -0.5)
    assert torch.equal(rl.apply_retracted_credit(pos, mask, "all"), pos)
    got = rl.apply_retracted_credit(pos, mask, "negative")
    assert (got[mask] == 0).all() and (got[~mask] == 0.5).all()
    assert torch.equal(rl.apply_retracted_credit(neg, mask, "negative"), neg)
    assert (rl.apply_retracted_credit(neg, mask, "none")[mask] == 0).all()


def test_a_step_logs_how_many_right_sentences_its_rollouts_deleted():
    import rewards
    import sandbox

    doc = next(iter(newsworld.documents(1, seed=0)))
    right = doc.summary.split(". ")[0] + "."
    ep = sandbox.replay(doc.text, right + '<delete scope="sentence"/>' + right)
    for t in ep.turns:
        t.ids = [0] * len(t.text)
    result = rewards.Scorer(rewards.RewardConfig(factuality="oracle")).score_batch([(doc, ep)])[0]
    assert rl.episode_figures(ep, result)["right_deletes"] == 1
