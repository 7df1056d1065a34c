"""SFT: the branch loss by hand, batching, mask validation, a short run that
learns the tool syntax, and exact resume."""
import json

import pytest
import torch
import torch.nn.functional as F

import common
import sandbox as S
import sft
from helpers import killed_after_checkpoint, newsworld_traces


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = common.build_tiny_model("tiny-1m", tmp_path_factory.mktemp("m") / "tiny", seed=0)
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
    model, tok = common.load_policy(common.ModelConfig(name_or_path=tiny, lora=common.LoraConfig(enabled=False)))
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


def test_epoch_batches_cover_each_item_once_and_repeat_by_seed():
    lengths = [i % 7 for i in range(50)]
    a = sft.epoch_batches(50, lengths, 8, 2, seed=1, epoch=0)
    assert sorted(i for b in a for i in b) == list(range(50))
    assert a == sft.epoch_batches(50, lengths, 8, 2, seed=1, epoch=0)
    assert a != sft.epoch_batches(50, lengths, 8, 2, seed=1, epoch=1)


def test_validate_masks_catches_a_planted_off_by_one(tiny, monkeypatch):
    tok = common.load_tokenizer(tiny)
    eps = [e.tokenized(tok) for e in newsworld_traces(5, seed=2)]
    assert sft.validate_masks(eps, tok, 5) == 5
    real = S.Episode.branches

    def shifted(self, *a, **k):
        return [S.Branch(b.input_ids, [0] + b.loss_mask[:-1], b.logprobs, b.turns) for b in real(self, *a, **k)]

    monkeypatch.setattr(S.Episode, "branches", shifted)
    with pytest.raises(S.MaskError):
        sft.validate_masks(eps, tok, 5)


def cfg_for(tiny, traces, tmp_path, **over):
    cfg = sft.Config(name="t", runs_dir=str(tmp_path), model=common.ModelConfig(
        name_or_path=tiny, lora=common.LoraConfig(enabled=False)))
    cfg.data = sft.DataConfig(train=str(traces / "train.jsonl"), eval=str(traces / "eval.jsonl"))
    cfg.eval = sft.EvalConfig(every=0, n_docs=8, max_new_tokens=60)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def test_short_run_lowers_eval_loss_and_learns_tool_syntax(tiny, traces, tmp_path):
    # ~120 steps: enough for a 1M model from scratch to pick up the tool syntax
    cfg = cfg_for(tiny, traces, tmp_path, epochs=9.6, batch_episodes=8, lr=5e-3, warmup_steps=10, save_every=0)
    model, tok = common.load_policy(cfg.model)
    held = [e.tokenized(tok) for e in S.read_episodes(cfg.data.eval)]
    docs = sft.held_out_documents(held, "", 8)
    before_loss = sft.eval_loss(model, held, 16384)
    before = sft.sample_eval(model, tok, docs, cfg.reward, S.Limits(), 60)
    after = sft.main(cfg)
    assert after["eval_loss"] < 0.5 * before_loss
    assert after["sample_calls_per_episode"] >= 0.5
    assert after["sample_valid_call_rate"] >= 0.7
    assert before["sample_calls_per_episode"] <= 0.125  # the untrained model (almost) never calls a tool
    rows = [json.loads(x) for x in open(tmp_path / "t" / "metrics.jsonl")]
    assert any("loss" in r for r in rows) and (tmp_path / "t" / "final" / "config.json").exists()


def test_resume_gives_the_weights_of_an_uninterrupted_run(tiny, traces, tmp_path, monkeypatch):
    over = dict(epochs=4 * 16 / 100, batch_episodes=16, save_every=2, lr=1e-3, mask_check=4,
                eval=sft.EvalConfig(every=0, n_docs=0))
    sft.main(cfg_for(tiny, traces, tmp_path / "a", **over))
    with killed_after_checkpoint(monkeypatch, 2), pytest.raises(KeyboardInterrupt):
        sft.main(cfg_for(tiny, traces, tmp_path / "b", **over))
    sft.main(cfg_for(tiny, traces, tmp_path / "b", **over))
    from safetensors.torch import load_file

    a = load_file(str(common.list_checkpoints(tmp_path / "a" / "t")[-1] / "trainable.safetensors"))
    b = load_file(str(common.list_checkpoints(tmp_path / "b" / "t")[-1] / "trainable.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
