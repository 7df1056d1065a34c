"""SFT: the branch loss by hand, batching, mask validation, a short run that
learns the tool syntax, and exact resume."""
import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import data
import sandbox as S
import sft
from factual_tools import common, modeling, scoring, settings, training
from newsworld.tiny import build_tiny_model
from helpers import assert_trackers_match_metrics, killed_after_checkpoint, newsworld_traces, offline_trackers

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = build_tiny_model("tiny-1m", tmp_path_factory.mktemp("m") / "tiny", seed=0)
    return str(path)


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("traces")
    eps = newsworld_traces(120, seed=5)
    for name, part in (("train", eps[:100]), ("eval", eps[100:])):
        with open(d / f"{name}.jsonl", "w") as f:
            for e in part:
                f.write(e.to_json() + "\n")
    return d


def test_sequence_loss_equals_a_hand_computation(tiny):
    model, tok = modeling.load_policy(modeling.ModelConfig(name_or_path=tiny, lora=modeling.LoraConfig(enabled=False)))
    ep = S.replay("Acme rose 5%. Globex fell.", 'Acme fell.<search>/Acme/</search><delete scope="sentence"/> '
                  "Acme rose 5%.").tokenized(tok)
    n = sft.n_generated(ep)
    got = sft.sequence_loss(model, [ep], n)
    total, count = 0.0, 0
    for b in ep.branches():  # each branch alone, cross-entropy on its trained positions only
        ids = torch.tensor([b.input_ids])
        logits = model(input_ids=ids).logits[0]
        for pos, m in enumerate(b.loss_mask):
            if m:
                total += F.cross_entropy(logits[pos - 1:pos], ids[0, pos:pos + 1], reduction="sum")
                count += 1
    assert count == n and len(ep.branches()) == 2
    assert torch.allclose(got, total / n, atol=1e-5)


def _hand_loss(model, ep, mask_retracted):
    total, count = 0.0, 0
    for b in ep.branches(mask_retracted=mask_retracted):
        ids = torch.tensor([b.input_ids])
        logits = model(input_ids=ids).logits[0]
        for pos, m in enumerate(b.loss_mask):
            if m:
                total += F.cross_entropy(logits[pos - 1:pos], ids[0, pos:pos + 1], reduction="sum")
                count += 1
    return total, count


WRONG = "Zanzibar Quokka fell 9%."  # words that appear nowhere else: not in the document, the query or the rewrite
MASK_DOC = "Acme rose 5%. Globex fell 3% in May."


def test_error_masking_trains_no_retracted_character(tiny):
    model, tok = modeling.load_policy(modeling.ModelConfig(name_or_path=tiny, lora=modeling.LoraConfig(enabled=False)))
    text = (f"Globex fell 3% in May. {WRONG}<search>/Acme/</search><delete scope=\"sentence\"/> Acme rose 5%. "
            f"Acme hired.<delete scope=\"clause\"/> Globex, in May, fell 3%.")
    ep = S.replay(MASK_DOC, text).tokenized(tok)
    masked = [(t, j) for t in ep.turns for j in (t.masked or ())]
    assert masked and ep.summary == "Globex fell 3% in May. Acme rose 5%. Globex, in May, fell 3%."
    # every trained id of every branch decodes to kept text or markup: no retracted word among them
    trained = "".join(tok.decode([i]) for b in ep.branches(mask_retracted=True)
                      for i, m in zip(b.input_ids, b.loss_mask) if m)
    assert not any(w in trained for w in ("Zanzibar", "Quokka", "9%", "hired"))
    assert "<search>/Acme/</search>" in trained and '<delete scope="sentence"/>' in trained and "Acme rose 5%." in trained
    # the masked ids hold exactly the retracted text (the deleted sentence and clause)
    retracted = "".join(tok.decode([t.ids[j]]) for t, j in masked)
    assert "".join(retracted.split()) == "".join((WRONG + "Acme hired.").split())
    # the loss: exactly the cross-entropy of the unmasked generated ids, branch by branch
    n = sft.n_generated(ep, mask_retracted=True)
    total, count = _hand_loss(model, ep, True)
    assert count == n == sft.n_generated(ep) - len(masked)
    assert torch.allclose(sft.sequence_loss(model, [ep], n, mask_retracted=True), total / n, atol=1e-5)
    S.check_branches(ep, ep.branches(mask_retracted=True), tok)


def test_error_masking_off_trains_every_generated_id_as_before(tiny):
    model, tok = modeling.load_policy(modeling.ModelConfig(name_or_path=tiny, lora=modeling.LoraConfig(enabled=False)))
    ep = S.replay(MASK_DOC, f"{WRONG}<search>/Acme/</search><delete scope=\"sentence\"/> Acme rose 5%.").tokenized(tok)
    plain = ep.branches()
    assert [b.loss_mask for b in ep.branches(mask_retracted=False)] == [b.loss_mask for b in plain]
    assert sum(sum(b.loss_mask) for b in plain) == sft.n_generated(ep)
    n = sft.n_generated(ep)
    total, count = _hand_loss(model, ep, False)
    assert count == n
    assert torch.allclose(sft.sequence_loss(model, [ep], n), total / n, atol=1e-5)
    trained = "".join(tok.decode([i]) for b in plain for i, m in zip(b.input_ids, b.loss_mask) if m)
    assert "Zanzibar" in trained  # without masking the error is a target


def test_rewrite_weight_counts_the_rewritten_sentence_w_times_and_nothing_else(tiny):
    model, tok = modeling.load_policy(modeling.ModelConfig(name_or_path=tiny, lora=modeling.LoraConfig(enabled=False)))
    text = (f"{WRONG}<search>/Acme/</search><delete scope=\"sentence\"/> Acme rose 5%. Globex fell 3% in May."
            "<search>/Globex/</search> Globex fell.")
    ep = S.replay(MASK_DOC, text).tokenized(tok)
    lens = training.rewrite_lengths(ep, tok)
    # only the turn after the delete has a rewrite, and its ids are exactly the rewritten sentence
    (k, n), = [(k, n) for k, n in enumerate(lens) if n]
    assert ep.turns[k - 1].call.kind == "delete"
    assert tok.decode(ep.turns[k].ids[:n]).strip() == "Acme rose 5%."
    base = sft.n_generated(ep, mask_retracted=True)
    plain = sft.sequence_loss(model, [ep], base, mask_retracted=True)
    assert torch.equal(plain, sft.sequence_loss(model, [ep], base, mask_retracted=True, rewrite_weight=1.0, tokenizer=tok))
    # by hand: the rewrite's ids once more per extra weight, every other trained id as before
    lp = sft.scoring.episode_logprobs(model, [ep])[0][k][:n]
    got = sft.sequence_loss(model, [ep], base, mask_retracted=True, rewrite_weight=4.0, tokenizer=tok)
    assert torch.allclose(got, plain - 3.0 * lp.sum() / base, atol=1e-5)
    with pytest.raises(ValueError, match="tokenizer"):
        sft.sequence_loss(model, [ep], base, rewrite_weight=2.0)
    with pytest.raises(settings.ConfigError, match="rewrite_weight"):
        sft.Config(rewrite_weight=-1.0)


def test_decision_weight_counts_the_first_id_after_each_search_d_times_masked_or_not(tiny):
    """A check kept (its next sentence wrong, so error masking hides it) and a check
    followed by a delete: the first id after each results block is the decision."""
    model, tok = modeling.load_policy(modeling.ModelConfig(name_or_path=tiny, lora=modeling.LoraConfig(enabled=False)))
    text = (f"Acme rose 5%.<search>Acme rose</search> {WRONG}<search>/Acme/</search><delete scope=\"sentence\"/>"
            " Acme rose 5%.")
    ep = S.replay(MASK_DOC, text).tokenized(tok)
    decides = S.decision_turns(ep)
    assert decides == [False, True, True, False]  # after the first search, after the second, not after the delete
    assert ep.turns[1].masked and 0 in ep.turns[1].masked  # "keep" begins the wrong sentence: masked...
    assert ep.turns[2].text.startswith("<delete")
    base = sft.n_generated(ep, mask_retracted=True)
    plain = sft.sequence_loss(model, [ep], base, mask_retracted=True)
    assert torch.equal(plain, sft.sequence_loss(model, [ep], base, mask_retracted=True, decision_weight=1.0))
    lp = sft.scoring.episode_logprobs(model, [ep])[0]
    got = sft.sequence_loss(model, [ep], base, mask_retracted=True, decision_weight=5.0)
    # ...and trained 5 times with the weight; the delete's first id once more per extra weight (4 more)
    assert torch.allclose(got, plain - (5.0 * lp[1][0] + 4.0 * lp[2][0]) / base, atol=1e-5)
    with pytest.raises(settings.ConfigError, match="decision_weight"):
        sft.Config(decision_weight=-1.0)


def test_the_cli_reports_a_config_error_in_one_line():
    for args, says in ((["--config", "nope.yaml"], "error: cannot read config file nope.yaml"),
                       (["--config", "configs/sft_tiny.yaml", "rewrite_weight=-1"], "error: rewrite_weight=-1.0")):
        out = subprocess.run([sys.executable, "sft.py", *args], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode != 0 and says in out.stderr and "Traceback" not in out.stderr


def test_a_plain_mask_check_rejects_a_masked_branch_without_masked_ids(tiny):
    tok = modeling.load_tokenizer(tiny)
    ep = S.replay(MASK_DOC, "Acme rose 5%.<search>/Acme/</search> Globex fell 3% in May.").tokenized(tok)
    (b, *_), = [ep.branches()]
    bad = S.Branch(b.input_ids, [0 if i == b.turns[0][1] else m for i, m in enumerate(b.loss_mask)], b.logprobs, b.turns)
    with pytest.raises(S.MaskError):  # a dropped id that no delete retracted is a mask bug, not masking
        S.check_branches(ep, [bad], tok)


def test_epoch_batches_cover_each_item_once_and_repeat_by_seed():
    lengths = [i % 7 for i in range(50)]
    a = training.epoch_batches(50, lengths, 8, 2, seed=1, epoch=0)
    assert sorted(i for b in a for i in b) == list(range(50))
    assert a == training.epoch_batches(50, lengths, 8, 2, seed=1, epoch=0)
    assert a != training.epoch_batches(50, lengths, 8, 2, seed=1, epoch=1)


def test_epoch_batches_by_index_walk_the_epochs_in_order():
    items, lengths = list("abcdefghij"), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    cursor = sft.EpochBatches(items, lengths, batch=4, window=1, seed=7)
    assert cursor.per_epoch == 3
    for e in (0, 1):
        want = training.epoch_batches(10, lengths, 4, 1, 7, e)
        assert [cursor(e * 3 + j) for j in range(3)] == [[items[k] for k in b] for b in want]
    assert cursor(1) == [items[k] for k in training.epoch_batches(10, lengths, 4, 1, 7, 0)[1]]  # back to epoch 0


def test_optimizer_step_accumulates_and_a_non_finite_loss_updates_nothing():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([w], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    batches = [[S.Episode(document="d", doc_id="a")], [S.Episode(document="d", doc_id="b")]]
    loss, terms, norm, lr = sft.optimizer_step(batches, lambda b: ((w ** 2).sum() / 2, {"x": 1.0}), [w], opt,
                                               sched, max_grad_norm=100.0, step=0)
    assert loss == pytest.approx(5.0) and terms == {"x": 2.0} and lr == 0.5
    assert norm == pytest.approx(2 * 5 ** 0.5)  # two micro-batches' gradients added: 2w
    assert torch.allclose(w.detach(), torch.tensor([0.0, 0.0]))  # w - 0.5 * 2w
    before = w.detach().clone()
    with pytest.raises(FloatingPointError, match=r"step 4: loss is nan \(documents \['a'\]\)"):
        sft.optimizer_step(batches, lambda b: (w.sum() * float("nan"), {}), [w], opt, sched, max_grad_norm=1.0, step=3)
    assert torch.equal(w.detach(), before)


def test_validate_masks_catches_a_planted_off_by_one(tiny, monkeypatch):
    """One mask validator serves SFT and distillation (a seeded sample) and RL (every
    rollout, before every update): scoring.validate_masks."""
    tok = modeling.load_tokenizer(tiny)
    eps = [e.tokenized(tok) for e in newsworld_traces(5, seed=2)]
    assert scoring.validate_masks(eps, tok, 5) == 5
    assert scoring.validate_masks(eps, tok, 3) == 3
    assert scoring.validate_masks(eps, tok) == 5  # no sample size: every episode
    assert not hasattr(sft, "validate_masks")
    real = S.Episode.branches
    checked = []

    def shifted(self, *a, **k):
        checked.append(self)
        return [S.Branch(b.input_ids, [0] + b.loss_mask[:-1], b.logprobs, b.turns) for b in real(self, *a, **k)]

    monkeypatch.setattr(S.Episode, "branches", shifted)
    with pytest.raises(S.MaskError):
        scoring.validate_masks(eps, tok, 5)
    with pytest.raises(S.MaskError):
        scoring.validate_masks(eps[1:], tok)
    assert checked[-1] is eps[1]  # every episode, in order: the first one already fails


def cfg_for(tiny, traces, tmp_path, **over):
    cfg = sft.Config(name="t", runs_dir=str(tmp_path), model=modeling.ModelConfig(
        name_or_path=tiny, lora=modeling.LoraConfig(enabled=False)))
    cfg.data = sft.SFTData(train=str(traces / "train.jsonl"), eval=str(traces / "eval.jsonl"))
    cfg.eval = sft.SFTEval(every=0, n_docs=8, max_new_tokens=60)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_sft_and_rl_start_from_init_the_same_way(tiny, traces, tmp_path):
    """One init-to-adapter loader (modeling.load_from_init) serves sft.py and rl.py: a
    missing init names the key in both (SFT once fell through to loading it as a model
    name) and full weights become the base; that an adapter directory is continued, and
    kept as the reference, is tests/test_rl.py's reference-adapter test."""
    import rl

    cfg = cfg_for(tiny, traces, tmp_path, init=str(tmp_path / "nope"))
    with pytest.raises(SystemExit, match=r"init=.*nope does not exist"):
        sft.main(cfg)
    rl_cfg = rl.Config(init=str(tmp_path / "nope"), runs_dir=str(tmp_path / "rl_runs"))
    with pytest.raises(SystemExit, match=r"init=.*nope does not exist"):
        rl.main(rl_cfg)
    full = cfg_for(tiny, traces, tmp_path, init=tiny)
    model, _ = modeling.load_from_init(full.model, full.init)  # full weights: the base itself
    base, _ = modeling.load_policy(modeling.ModelConfig(name_or_path=tiny, lora=modeling.LoraConfig(enabled=False)),
                                   train=False)
    assert torch.equal(model.get_input_embeddings().weight, base.get_input_embeddings().weight)


def test_held_out_documents_take_the_first_n_and_name_a_missing_docs_file(tmp_path):
    eps = [S.replay(f"Doc {i}. Acme rose.", "Acme rose.") for i in (0, 0, 1, 2)]
    for ep, i in zip(eps, (0, 0, 1, 2)):
        ep.doc_id = f"d{i}"
    assert [d.id for d in sft.held_out_documents(eps, "", 2)] == ["d0", "d1"]
    assert sft.held_out_documents(eps, "", 0) == [] and sft.held_out_documents([], "", 5) == []
    assert sft.held_out_documents(eps, str(tmp_path / "none.jsonl"), 0) == []  # nothing asked: the file is not read
    with pytest.raises(SystemExit, match=r"data.docs=.*none.jsonl: no such file.*python -m newsworld generate"):
        sft.held_out_documents(eps, str(tmp_path / "none.jsonl"), 2)
    data.write_jsonl(str(tmp_path / "docs.jsonl"), [data.Document(id="d1", text="Doc 1. Acme rose.", summary="s")])
    got = sft.held_out_documents(eps, str(tmp_path / "docs.jsonl"), 3)
    assert [type(d).__name__ for d in got] == ["_Doc", "Document", "_Doc"] and got[1].summary == "s"


@pytest.mark.slow
def test_short_run_lowers_eval_loss_and_learns_tool_syntax(tiny, traces, tmp_path):
    # ~120 steps: enough for a 1M model from scratch to pick up the tool syntax
    cfg = cfg_for(tiny, traces, tmp_path, epochs=9.6, batch_episodes=8, lr=5e-3, warmup_steps=10, save_every=0)
    model, tok = modeling.load_policy(cfg.model)
    held = [e.tokenized(tok) for e in S.read_episodes(cfg.data.eval)]
    docs = sft.held_out_documents(held, "", 8)
    before_loss = sft.eval_loss(model, held, 16384)
    before = sft.sample_eval(model, tok, docs, dataclasses.replace(cfg, eval=sft.SFTEval(max_new_tokens=60)))
    after = sft.main(cfg)
    calls = lambda ev: ev["eval_searches"] + ev["eval_deletes"]  # noqa: E731
    assert after["eval_loss"] < 0.5 * before_loss
    assert calls(after) >= 0.5
    assert after["eval_valid_call_rate"] >= 0.7
    assert calls(before) <= 0.125  # the untrained model (almost) never calls a tool
    rows = [json.loads(x) for x in open(tmp_path / "t" / "metrics.jsonl")]
    assert any("loss" in r for r in rows) and (tmp_path / "t" / "final" / "config.json").exists()


def test_a_resumed_run_continues_its_tensorboard_and_wandb_logs(tiny, traces, tmp_path, monkeypatch):
    over = dict(epochs=4 * 16 / 100, batch_episodes=16, save_every=2, log_every=1, mask_check=4,
                log=offline_trackers(monkeypatch),
                eval=sft.SFTEval(every=0, n_docs=0))
    with killed_after_checkpoint(monkeypatch, 2), pytest.raises(KeyboardInterrupt):
        sft.main(cfg_for(tiny, traces, tmp_path, **over))
    sft.main(cfg_for(tiny, traces, tmp_path, **over))
    run = tmp_path / "t"
    assert [r["step"] for r in common.read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    assert_trackers_match_metrics(run, keys=("loss", "grad_norm", "eval_loss"))
    assert len({p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")}) == 1  # one W&B run id


@pytest.mark.slow
def test_resume_gives_the_weights_of_an_uninterrupted_run(tiny, traces, tmp_path, monkeypatch):
    over = dict(epochs=4 * 16 / 100, batch_episodes=16, save_every=2, lr=1e-3, mask_check=4,
                eval=sft.SFTEval(every=0, n_docs=0))
    sft.main(cfg_for(tiny, traces, tmp_path / "a", **over))
    with killed_after_checkpoint(monkeypatch, 2), pytest.raises(KeyboardInterrupt):
        sft.main(cfg_for(tiny, traces, tmp_path / "b", **over))
    with open(tmp_path / "b" / "t" / "metrics.jsonl", "a") as f:  # a step logged after the last checkpoint
        f.write(json.dumps({"step": 3, "loss": 9.0}) + "\n")
    sft.main(cfg_for(tiny, traces, tmp_path / "b", **over))
    steps = lambda run: [r["step"] for r in common.read_metrics(run / "metrics.jsonl")]  # noqa: E731
    assert steps(tmp_path / "b" / "t") == steps(tmp_path / "a" / "t")  # the stale line is gone, nothing twice
    assert 9.0 not in [r.get("loss") for r in common.read_metrics(tmp_path / "b" / "t" / "metrics.jsonl")]
    from safetensors.torch import load_file

    a = load_file(str(common.list_checkpoints(tmp_path / "a" / "t")[-1] / "trainable.safetensors"))
    b = load_file(str(common.list_checkpoints(tmp_path / "b" / "t")[-1] / "trainable.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_strip_tools_keeps_only_the_final_summary_of_each_trace(tiny):
    """B+'s corpus: a trace that searched, read results, deleted and rewrote becomes one
    tool-free turn, its final summary, on the same document; an empty one is dropped."""
    text = (f"Globex fell 3% in May. {WRONG}<search>/Acme/</search><delete scope=\"sentence\"/> Acme rose 5%.")
    trace = S.replay(MASK_DOC, text)
    trace.doc_id, trace.meta = "d7", {"drafter": "oracle"}
    assert trace.n_search == trace.n_delete == 1 and "<results>" in trace.text
    empty = S.replay(MASK_DOC, f'{WRONG}<delete scope="sentence"/>')
    assert empty.summary == ""
    (ep,), dropped = sft.strip_tools([trace, empty])
    assert dropped == 1
    assert len(ep.turns) == 1 and not ep.calls and ep.valid
    assert ep.text == ep.summary == trace.summary == "Globex fell 3% in May. Acme rose 5%."
    assert (ep.document, ep.doc_id, ep.meta) == (MASK_DOC, "d7", {"drafter": "oracle"})
    assert not any(w in ep.text for w in ("<search", "<results", "<delete", "Zanzibar"))
    tok = modeling.load_tokenizer(tiny)
    before, after = trace.tokenized(tok), ep.tokenized(tok)
    assert sft.n_generated(after) < sft.n_generated(before, mask_retracted=True) < sft.n_generated(before)
    assert after.turns[0].ended == "eos" and len(after.branches()) == 1
    S.check_branches(after, after.branches(), tok)


def test_the_base_stage_names_the_missing_documents_and_how_to_make_them(tmp_path):
    cfg = sft.SFTData(generate=10, docs=str(tmp_path / "docs.jsonl"), split=str(tmp_path / "split.json"))
    with pytest.raises(SystemExit, match=r"docs.jsonl .*python -m newsworld generate .*python data.py split"):
        sft.base_data(cfg, None, 4)


# --- rejection and teacher modes ---------------------------------------------------------


def test_rejection_keeps_the_whole_base_corpus_and_repeats_the_passing_rollouts():
    base, passed = [f"b{i}" for i in range(10)], ["p0", "p1", "p2"]
    mixed = sft.mix_rejection(base, passed, 0.5, seed=0)
    assert mixed[:10] == base  # never cut (it used to shrink to the number of passing rollouts)
    assert len(mixed) == 20 and sorted(set(mixed[10:])) == passed
    assert all(3 <= mixed[10:].count(p) <= 4 for p in passed)  # as even as possible
    assert len(sft.mix_rejection(base, passed, 0.3, seed=0)) == 10 + 4  # 10 x 0.3 / 0.7 = 4.3
    assert sft.mix_rejection(base, passed, 0.0) == base + passed
    assert sft.mix_rejection(base, [], 0.5) == base
    assert sft.mix_rejection(base, passed, 0.1) == base + passed  # fewer than once is once


def test_teacher_buckets_are_upsampled_to_the_largest():
    eps = ([S.replay(DOC_T, "Acme grew.") for _ in range(5)]
           + [S.replay(DOC_T, "Acme grew.<search>acme</search> Ok.") for _ in range(2)]
           + [S.replay(DOC_T, 'Bad.<delete scope="sentence"/> Acme grew.')])
    out = sft.upsample_buckets(eps, "tools", seed=1)
    counts = {b: sum(sft.bucket_of(e, "tools") == b for e in out) for b in ("none", "search", "delete")}
    assert counts == {"none": 5, "search": 5, "delete": 5}
    assert sft.upsample_buckets(eps, "none") == eps
    for e, b in zip(eps, ["x"] * 3 + ["y"] * 5):
        e.meta = {"bucket": b}
    assert len(sft.upsample_buckets(eps[:8], "meta")) == 10


DOC_T = ("Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier. "
         "Chief executive Jane K. Doe said the U.S. market drove growth. Shares fell 3.5% in New York.")


def test_teacher_corpus_keeps_only_valid_passing_episodes(tmp_path):
    import rewards

    good = S.replay(DOC_T, "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year "
                           "earlier. Chief executive Jane K. Doe said the U.S. market drove growth. Shares fell "
                           "3.5% in New York.")
    wrong = S.replay(DOC_T, "Globex reported revenue of $9.9 billion on May 1, 2021, down 40%. Its chief "
                            "executive John Roe said Europe drove the fall. Shares rose 8% in Paris.")
    bad_call = S.replay(DOC_T, good.summary + "<search>")  # dangling call: not valid
    cfg = sft.Config(reward=rewards.RewardConfig(factuality="lexical"), teacher=sft.TeacherConfig(bucket="none"))
    assert rewards.score(DOC_T, good, cfg.reward)["pass"] and not rewards.score(DOC_T, wrong, cfg.reward)["pass"]
    assert sft.teacher_corpus([good, wrong, bad_call], cfg) == [good]
    cfg.teacher.strict = False
    assert len(sft.teacher_corpus([good, wrong, bad_call], cfg)) == 3
    cfg.teacher.strict = True
    with pytest.raises(SystemExit, match="no teacher episode passes"):
        sft.teacher_corpus([wrong], cfg)


def test_rejection_teacher_and_stripped_corpora_train_on_what_they_say(tiny, traces, tmp_path, monkeypatch, capsys):
    """mode=rejection: the trained corpus is the whole base plus passing rollouts;
    mode=teacher: only the passing teacher episodes, bucket-balanced; data.strip_tools:
    every training and eval episode is its trace's final summary alone."""
    seen = {}

    def spy_validate(train, tok, n, seed=0, mask_retracted=False):
        seen["train"] = list(train)
        return 0

    # every second rollout "passes": the random tiny policy would pass none
    real_score = sft.rewards.Scorer.score_batch

    def fake_score(self, items, cfg=None, teacher=None):
        return [dict(r, **{"pass": i % 2 == 0}) for i, r in enumerate(real_score(self, items, cfg))]

    monkeypatch.setattr(sft.scoring, "validate_masks", spy_validate)
    monkeypatch.setattr(sft.rewards.Scorer, "score_batch", fake_score)
    monkeypatch.setattr(S.Episode, "valid", property(lambda self: True))
    base = S.read_episodes(str(traces / "train.jsonl"))
    cfg = cfg_for(tiny, traces, tmp_path / "rej", mode="rejection", epochs=0.01, save_every=0,
                  rejection=sft.RejectionConfig(k=2, max_docs=4, mix_ratio=0.5))
    cfg.eval.max_new_tokens = 8
    sft.main(cfg)
    docs = {e.document for e in base}
    rollouts = [e for e in seen["train"] if e.meta.get("trace_kind") is None and e.document in docs
                and not any(e.summary == b.summary and e.document == b.document for b in base)]
    assert len(seen["train"]) == 2 * len(base)  # 100 base + 4 passing rollouts repeated to 100
    assert len(rollouts) == len(base)

    cfg = cfg_for(tiny, traces, tmp_path / "teach", mode="teacher", epochs=0.01, save_every=0)
    sft.main(cfg)
    kept = base[::2]
    buckets = {}
    for e in kept:
        buckets[sft.bucket_of(e, "tools")] = buckets.get(sft.bucket_of(e, "tools"), 0) + 1
    assert len(seen["train"]) == max(buckets.values()) * len(buckets)

    held = S.read_episodes(str(traces / "eval.jsonl"))
    real_eval_loss = sft.eval_loss
    monkeypatch.setattr(sft, "eval_loss", lambda model, eps, *a, **k: seen.update(held=list(eps))
                        or real_eval_loss(model, eps, *a, **k))
    cfg = cfg_for(tiny, traces, tmp_path / "strip", epochs=0.01, save_every=0)
    cfg.data.strip_tools = True
    cfg.eval.max_new_tokens = 8
    capsys.readouterr()
    out = sft.main(cfg)
    for got, want in ((seen["train"], base), (seen["held"], held)):
        assert [(e.doc_id, e.text) for e in got] == [(e.doc_id, e.summary) for e in want if e.summary]
        assert all(len(e.turns) == 1 and not e.calls and e.has_ids for e in got)
    assert any(e.calls for e in base) and math.isfinite(out["eval_loss"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("data.strip_tools"))
    before, after = map(int, re.search(r"(\d+) -> (\d+) target tokens", line).groups())
    assert f"{len(base)} -> {len(seen['train'])} training episodes" in line and after < before


# --- KTO -------------------------------------------------------------------------------


def test_kto_loss_matches_a_hand_computation():
    policy = torch.tensor([-10.0, -12.0, -9.0, -20.0])
    reference = torch.tensor([-11.0, -11.0, -9.5, -18.0])
    desirable = torch.tensor([True, True, False, False])
    losses, z = sft.kto_loss(policy, reference, desirable, beta=0.5, w_desirable=1.0, w_undesirable=2.0)
    r = [1.0, -1.0, 0.5, -2.0]
    z_hand = max(0.0, sum(r) / 4)  # -0.375 -> 0
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    want = [1 - sig(0.5 * (r[0] - z_hand)), 1 - sig(0.5 * (r[1] - z_hand)),
            2 * (1 - sig(0.5 * (z_hand - r[2]))), 2 * (1 - sig(0.5 * (z_hand - r[3])))]
    assert z.item() == z_hand
    assert losses.tolist() == pytest.approx(want)
    # z is the batch's mean log-ratio when positive, and carries no gradient
    p = torch.tensor([-8.0, -8.0], requires_grad=True)
    losses, z = sft.kto_loss(p, torch.tensor([-10.0, -9.0]), torch.tensor([True, False]), beta=1.0)
    assert z.item() == 1.5 and not z.requires_grad
    losses.sum().backward()
    assert p.grad[0] < 0 < p.grad[1]  # raise the desirable episode's log-prob, lower the undesirable one's


def test_kto_mode_prefers_the_desirable_episodes_and_its_guard_stops_it(tiny, traces, tmp_path, monkeypatch):
    base = S.read_episodes(str(traces / "train.jsonl"))[:16]
    monkeypatch.setattr(sft, "kto_labels", lambda eps, cfg: [i % 2 == 0 for i in range(len(eps))])
    cfg = cfg_for(tiny, traces, tmp_path / "kto", mode="kto", epochs=4, batch_episodes=8, lr=5e-3,
                  save_every=0, kto=sft.KTOConfig(beta=0.5, min_emission_ratio=0.0))
    cfg.data.limit = 16
    model0, tok = modeling.load_policy(cfg.model)
    eps = [e.tokenized(tok) for e in base]
    with torch.no_grad():
        before = sft.episode_logprob_sums(model0, eps)
    sft.main(cfg)
    model1, _ = modeling.load_policy(modeling.ModelConfig(name_or_path=str(tmp_path / "kto" / "t" / "final"),
                                                      lora=modeling.LoraConfig(enabled=False)))
    with torch.no_grad():
        after = sft.episode_logprob_sums(model1, eps)
    moved = after - before
    assert moved[0::2].mean() > moved[1::2].mean() + 1.0  # desirable up against undesirable

    # the guard: emission falls from 1.0 to 0.5 after the first check -> stop at that step
    emissions = iter([1.0, 0.5, 0.5, 0.5])
    real = sft.sample_eval
    monkeypatch.setattr(sft, "sample_eval", lambda *a, **k: {**real(*a, **k), "eval_emission": next(emissions)})
    cfg = cfg_for(tiny, traces, tmp_path / "guard", mode="kto", epochs=4, batch_episodes=8, save_every=0,
                  kto=sft.KTOConfig(min_emission_ratio=0.9))
    cfg.data.limit = 16
    cfg.eval.sample_every = 2
    cfg.eval.n_docs = 2
    sft.main(cfg)
    steps = [r["step"] for r in common.read_metrics(tmp_path / "guard" / "t" / "metrics.jsonl") if "eval_emission" in r]
    assert steps[0] == 2 and max(steps) == 2  # checked at step 2, stopped there (then the final evaluation)
