"""Checkpoints: atomic, newest-complete resume, exact restore of weights, optimizer and RNG."""
import random

import numpy as np
import pytest
import torch

from factual_tools import common


def tiny_net():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    net[0].weight.requires_grad_(False)  # frozen parameters are not checkpointed
    net.save_pretrained = lambda path: (path.mkdir(), torch.save(net.state_dict(), path / "w.pt"))
    return net


def step(net, opt):
    loss = net(torch.randn(3, 4)).pow(2).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_save_load_restores_everything(tmp_path):
    net = tiny_net()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.1)
    sched = common.cosine_schedule(opt, 2, 10)
    gen = torch.Generator().manual_seed(5)
    step(net, opt)
    sched.step()
    common.save_checkpoint(tmp_path, 1, net, opt, sched, state={"cursor": 7}, generators={"g": gen})
    after = [torch.rand(1).item(), random.random(), np.random.rand(), torch.rand(1, generator=gen).item()]
    want = {n: p.clone() for n, p in net.named_parameters()}
    step(net, opt)  # move away, then restore
    got = common.load_checkpoint(common.resolve_resume("auto", tmp_path), net, opt, sched, generators={"g": gen})
    assert got == {"step": 1, "state": {"cursor": 7}}
    for n, p in net.named_parameters():
        if p.requires_grad:
            assert torch.equal(p, want[n])
    assert [torch.rand(1).item(), random.random(), np.random.rand(), torch.rand(1, generator=gen).item()] == after
    assert sched.last_epoch == 1 and opt.state_dict()["state"]


class Payload:  # what a hostile trainer.pt could hold: an object whose unpickling runs code
    def __reduce__(self):
        return (print, ("unpickled",))


def test_checkpoints_load_with_weights_only_and_refuse_other_objects(tmp_path):
    net = tiny_net()
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.1)
    sched = common.cosine_schedule(opt, 2, 10)
    path = common.save_checkpoint(tmp_path, 1, net, opt, sched, state={"cursor": 7})
    torch.load(path / "trainer.pt", weights_only=True)  # plain data: no allowlist needed
    old = torch.load(path / "trainer.pt", weights_only=True)
    np.random.seed(3)
    old["rng"]["numpy"] = np.random.get_state()  # how older versions stored it: numpy's tuple with an array
    want = np.random.rand()
    torch.save(old, path / "trainer.pt")
    assert common.load_checkpoint(path, net, opt, sched)["state"] == {"cursor": 7}
    assert np.random.rand() == want
    torch.save({**old, "state": {"x": Payload()}}, path / "trainer.pt")
    with pytest.raises(Exception, match="[Ww]eights only load failed|Unsupported global"):
        common.load_checkpoint(path, net, opt, sched)


def test_only_complete_checkpoints_count_and_old_ones_are_pruned(tmp_path):
    net = tiny_net()
    for s in (1, 2, 3):
        common.save_checkpoint(tmp_path, s, net, keep=2)
    (tmp_path / "checkpoints" / ".step_00000004.abcd.tmp").mkdir()  # a save killed midway
    names = [p.name for p in common.list_checkpoints(tmp_path)]
    assert names == ["step_00000002", "step_00000003"]
    assert common.resolve_resume("auto", tmp_path).name == "step_00000003"
    assert common.resolve_resume("none", tmp_path) is None
    assert common.resolve_resume("auto", tmp_path / "elsewhere") is None


def test_a_failed_save_leaves_no_checkpoint(tmp_path):
    net = tiny_net()

    def boom(path):
        raise OSError("disk full")

    net.save_pretrained = boom
    with pytest.raises(OSError):
        common.save_checkpoint(tmp_path, 1, net)
    assert common.list_checkpoints(tmp_path) == []
    assert not any((tmp_path / "checkpoints").iterdir())


def test_resume_path_must_be_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        common.resolve_resume(str(tmp_path), tmp_path)


def test_cosine_schedule_shape():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = common.cosine_schedule(opt, warmup_steps=2, total_steps=10, min_ratio=0.1)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.5 and lrs[1] == 1.0
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:]))
    assert abs(lrs[10] - 0.1) < 1e-9


def test_a_built_folder_is_reused_only_when_its_marker_holds_the_same_stamp(tmp_path):
    """The model presets' builders (pretrained conversion, tiny models) reuse a folder built from the
    same stamp, rebuild another build's, and never replace a folder they did not write."""
    import json

    out = tmp_path / "m"
    assert not common.built_before(out, "built.json", "spec", {"v": 1})  # missing: build
    out.mkdir()
    assert not common.built_before(out, "built.json", "spec", {"v": 1})  # empty: build
    (out / "built.json").write_text(json.dumps({"spec": {"v": 1}}))
    assert common.built_before(out, "built.json", "spec", {"v": 1})
    assert not common.built_before(out, "built.json", "spec", {"v": 2})  # another build: rebuild
    (out / "built.json").unlink()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="holds no built.json; refusing to replace it"):
        common.built_before(out, "built.json", "spec", {"v": 1})
