"""Data parallel on the CPU (gloo, 2 ranks started like torchrun starts them): a
2-rank step equals a 1-process step on the whole batch (SFT, distillation, Dr.
GRPO with scripted rollouts), advantages stay within a group, the Dr. GRPO
normaliser is the global rollout count, a killed 2-rank run resumes exactly, a
checkpoint refuses another world size, and only rank 0 writes."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import data
import distill
import rl
import sandbox as S
import sft
from factual_tools import common, engine, modeling, scoring
import newsworld
from newsworld import tiny
from helpers import DOC, bpe_tokenizer, newsworld_traces, save_tiny_policy, script_ids

TOK = bpe_tokenizer()


# ---------------------------------------------------------------------------
# Launching ranks as torchrun does (environment variables), in spawned processes
# ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    finally:
        import torch.distributed as td

        if td.is_initialized():
            td.destroy_process_group()


def launch(fn, world: int, *args) -> None:
    """Run `fn(rank, *args)` in `world` processes of one gloo group; raises if any fails."""
    mp.spawn(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=True)


def weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(common.list_checkpoints(run_dir)[-1] / "trainable.safetensors"))


def sum_rtol(n_terms: int) -> float:
    """How far a float32 sum of `n_terms` terms may move, relative to the sum of their
    magnitudes, when they are added in another order (Higham's bound, n x eps). Two
    ranks add their halves of a step's gradient in another order than one process,
    and Adam, which divides each element by its own size, passes that rounding on to
    the weights: the tolerance grows with the positions a step sums over, never with
    one CPU's kernels."""
    return n_terms * torch.finfo(torch.float32).eps


def assert_same_weights(a: dict, b: dict, rtol: float = 1e-5) -> None:
    """Every tensor within `rtol` of the other, relative to its norm (the ranks add
    their halves in another order than one process: float rounding, no more)."""
    assert a.keys() == b.keys() and a
    for k in a:
        assert (a[k] - b[k]).norm() <= rtol * a[k].norm(), (k, (a[k] - b[k]).norm() / a[k].norm())


def last_metrics(run_dir: Path) -> dict:
    return common.read_metrics(run_dir / "metrics.jsonl")[-1]


def test_shards_are_contiguous_cover_every_item_once_and_keep_rank_order():
    items = list(range(7))
    for world in (1, 2, 3, 4, 8):
        parts = [common.Dist(rank=r, world=world).shard(items) for r in range(world)]
        assert [x for p in parts for x in p] == items
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
    assert common.init_distributed() == common.SINGLE  # no torchrun environment: one process


# ---------------------------------------------------------------------------
# SFT
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("sft")
    model = tiny.build_tiny_model("tiny-1m", d / "tiny", seed=0)
    with open(d / "train.jsonl", "w") as f:
        for e in newsworld_traces(8, seed=5):
            f.write(e.to_json() + "\n")
    return str(model), str(d / "train.jsonl")


def sft_config(setup, runs_dir, **over) -> sft.Config:
    model, train = setup
    cfg = sft.Config(name="t", runs_dir=str(runs_dir), model=modeling.ModelConfig(
        name_or_path=model, lora=modeling.LoraConfig(enabled=True, rank=4, alpha=8)),
        batch_episodes=4, grad_accum=2, epochs=2, lr=1e-2, warmup_steps=0, log_every=1, save_every=1,
        mask_check=2, torch_threads=1, autocast="none")
    cfg.data = sft.SFTData(train=train, eval="")
    cfg.eval = sft.SFTEval(every=0, n_docs=0, sample_every=0)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _sft_rank(rank, setup, runs_dir, over):
    sft.main(sft_config(setup, runs_dir, **over))


def test_sft_two_ranks_take_the_step_one_process_takes_on_the_whole_batch(sft_setup, tmp_path):
    """2 steps of 2 micro-batches of 4 episodes: each rank scores half of every
    micro-batch, the loss is divided by the whole step's token count and the
    gradients are summed across ranks, so the adapter and the logged loss equal
    one process's."""
    sft.main(sft_config(sft_setup, tmp_path / "one"))
    launch(_sft_rank, 2, sft_setup, tmp_path / "two", {})
    one, two = tmp_path / "one" / "t", tmp_path / "two" / "t"
    assert_same_weights(weights(one), weights(two))
    a, b = common.read_metrics(one / "metrics.jsonl"), common.read_metrics(two / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2]  # rank 0 alone logged
    for x, y in zip(a, b):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5) and y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
    assert (two / "final" / "adapter_config.json").exists()
    trainer = torch.load(common.list_checkpoints(two)[-1] / "trainer.pt", weights_only=False)
    assert trainer["world_size"] == 2 and len(trainer["rng_ranks"]) == 2


# ---------------------------------------------------------------------------
# Dr. GRPO
# ---------------------------------------------------------------------------

RL_SCRIPTS = ['Acme grew.<search>Jane Doe</search> Jane Doe resigned.',
              'Revenue fell.<delete scope="sentence"/> Acme rose.', "Globex fell 2%.",
              "Acme reported revenue of $4.2 billion."]
REAL_ROLLOUT = engine.rollout


def scripted_rollout(model, tok, documents, group, scfg, limits, generator=None):
    """Rollouts that depend on the document and the row in its group only, not on the
    batch they are drawn in: a 2-rank run sees the groups one process sees."""
    rows = {r: script_ids(tok, RL_SCRIPTS[(int(documents[r // group].id[1:]) + r % group) % len(RL_SCRIPTS)])
            for r in range(len(documents) * group)}
    eps = REAL_ROLLOUT(model, tok, documents, group, scfg, limits, generator=generator,
                       logits_processor=engine.ScriptedProcessor(rows))
    with torch.no_grad():  # the sampler's log-probs without the script's bias: the policy's own
        for ep, lps in zip(eps, scoring.episode_logprobs(model, eps, method="branch")):
            for t, lp in zip(ep.turns, lps):
                t.logprobs = lp.tolist() if lp is not None else []
    return eps


def content_reward(documents, episodes):
    """A reward of the rollout's own text (so the same on any rank), distinct within a group."""
    return [{"total": len(e.summary) / 100 + 0.1 * e.n_search + 0.05 * e.n_delete, "pass": e.n_search > 0}
            for e in episodes]


@pytest.fixture(scope="module")
def rl_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("rl")
    policy = save_tiny_policy(d / "policy", TOK)
    texts = [DOC, DOC[:300], "Acme rose 5% on Monday. Globex fell 2%. Jane K. Doe resigned.", DOC[90:]]
    data.write_jsonl(str(d / "docs.jsonl"), [data.Document(id=f"d{i}", text=t) for i, t in enumerate(texts)])
    return policy, str(d / "docs.jsonl")


def rl_config(setup, runs_dir, **over) -> rl.Config:
    policy, docs = setup
    cfg = rl.Config(name="t", runs_dir=str(runs_dir), model=modeling.ModelConfig(
        name_or_path=policy, lora=modeling.LoraConfig(enabled=False)),
        data=rl.DocumentData(train=docs, split=""), steps=2, prompts_per_step=2, group_size=4, micro_groups=1,
        lr=1e-2, torch_threads=1, autocast="none", keep_checkpoints=10)
    cfg.sampling.max_new_tokens = 40
    cfg.eval = rl.RLEval(every=0, n_docs=0, sample_every=1, n_samples=2)
    for k, v in over.items():
        setattr(cfg, k, v)
    return cfg


def _rl_rank(rank, setup, runs_dir, over):
    engine.rollout = scripted_rollout
    rl.main(rl_config(setup, runs_dir, **over), reward_fn=content_reward)


def test_rl_two_ranks_take_the_step_one_process_takes(rl_setup, tmp_path, monkeypatch):
    """Each rank rolls out one document's whole group of 4; advantages are centred
    within each group, and the Dr. GRPO constant is the step's 8 rollouts, not a
    rank's 4 (a local count doubles the gradient: the logged norm shows it, though
    Adam's step would hide it). Weights, gradient norms and the step figures equal
    one process's, and the curriculum saw every rollout of the step."""
    monkeypatch.setattr(engine, "rollout", scripted_rollout)
    rl.main(rl_config(rl_setup, tmp_path / "one"), reward_fn=content_reward)
    launch(_rl_rank, 2, rl_setup, tmp_path / "two", {})
    one, two = tmp_path / "one" / "t", tmp_path / "two" / "t"
    assert_same_weights(weights(one), weights(two))
    a, b = common.read_metrics(one / "metrics.jsonl"), common.read_metrics(two / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b):
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)
        for k in ("reward", "pass", "len", "search", "delete", "valid", "entropy", "gap", "clip"):
            assert y[k] == pytest.approx(x[k], rel=1e-5, abs=1e-7), k
    assert x["search"] > 0 and x["delete"] > 0  # the scripts' calls were made
    trainer = lambda d: torch.load(common.list_checkpoints(d)[-1] / "trainer.pt", weights_only=False)  # noqa: E731
    assert trainer(two)["state"]["scorer"] == trainer(one)["state"]["scorer"]  # curriculum: the whole step's passes
    samples = [json.loads(x) for x in (two / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 1, 2, 2]  # rank 0's alone


# ---------------------------------------------------------------------------
# Kill and resume, world size, who writes
# ---------------------------------------------------------------------------


def _record_writes(log: Path, under: Path) -> None:
    """Record every file this process opens for writing, and every directory it
    makes or renames, under `under` (an audit hook: it sees torch.save, json dumps,
    atomic writes and checkpoints' directories alike), one JSON line each, in `log`."""
    under, out = str(under), open(log, "a")

    def hook(event, args):
        if event == "open" and args and isinstance(args[0], (str, os.PathLike)):
            path, mode = os.fspath(args[0]), args[1] or "r"
            if path.startswith(under) and any(c in str(mode) for c in "wax+"):
                out.write(json.dumps({"event": "open", "path": path, "mode": str(mode)}) + "\n")
                out.flush()
        elif event in ("os.mkdir", "os.rename", "os.replace", "os.remove", "shutil.rmtree") and args:
            path = os.fspath(args[0]) if isinstance(args[0], (str, os.PathLike)) else ""
            if path.startswith(under):
                out.write(json.dumps({"event": event, "path": path}) + "\n")
                out.flush()

    sys.addaudithook(hook)


def _rl_sampled_rank(rank, setup, runs_dir, over, kill_after, writes):
    if writes:
        _record_writes(Path(writes) / f"rank{rank}.jsonl", Path(runs_dir))
    if kill_after:
        real = common.save_checkpoint

        def save_then_die(run_dir, step, *a, **k):  # every rank dies right after checkpoint `kill_after`
            out = real(run_dir, step, *a, **k)
            if step == kill_after:
                raise RuntimeError(f"killed after step {step}")  # (spawn ignores KeyboardInterrupt)
            return out

        common.save_checkpoint = save_then_die
    rl.main(rl_config(setup, runs_dir, **over), reward_fn=content_reward)


def test_a_killed_two_rank_run_resumes_to_the_weights_of_an_uninterrupted_one(rl_setup, tmp_path):
    """Sampled rollouts (each rank its own sampler seed), 3 steps; the killed run dies
    after checkpoint 2 and resumes from it: each rank takes back its own sampler
    state, so steps 3 match and so do the weights. Rank 0 alone wrote into the run
    directory (it evaluates too), no file was written twice, and a checkpoint of 2
    ranks refuses to resume in 1 process, naming both sizes."""
    over = {"steps": 3, "sampling": engine.SamplingConfig(temperature=1.0, max_new_tokens=24)}
    docs = rl_setup[1]
    full_over = {**over, "eval": rl.RLEval(every=2, n_docs=1, sample_every=1, n_samples=2),
                 "data": rl.DocumentData(train=docs, eval=docs, split="")}
    writes = tmp_path / "writes"
    writes.mkdir()
    launch(_rl_sampled_rank, 2, rl_setup, tmp_path / "a", full_over, 0, str(writes))
    with pytest.raises(Exception, match="killed after step 2"):
        launch(_rl_sampled_rank, 2, rl_setup, tmp_path / "b", over, 2, "")
    run_b = tmp_path / "b" / "t"
    assert common.list_checkpoints(run_b)[-1].name == "step_00000002"
    launch(_rl_sampled_rank, 2, rl_setup, tmp_path / "b", over, 0, "")
    a, b = weights(tmp_path / "a" / "t"), weights(run_b)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (common.read_metrics(d / "metrics.jsonl") for d in (tmp_path / "a" / "t", run_b))
    assert [r["step"] for r in rb] == [1, 2, 3]  # nothing logged twice
    assert [r["reward"] for r in rb] == [r["reward"] for r in ra if "reward" in r]
    assert any("eval_total" in r for r in ra)  # rank 0 evaluated while rank 1 waited

    rank0, rank1 = ([json.loads(x) for x in (writes / f"rank{r}.jsonl").read_text().splitlines()] for r in (0, 1))
    assert rank1 == []  # rank 1 wrote nothing
    opened = [w["path"] for w in rank0 if w["event"] == "open" and "a" not in w["mode"]]
    assert len(opened) == len(set(opened)) and any("step_00000003" in w["path"] for w in rank0)

    with pytest.raises(ValueError, match=r"2 process\(es\), this run has 1"):
        rl.main(rl_config(rl_setup, tmp_path / "b", steps=4), reward_fn=content_reward)


# ---------------------------------------------------------------------------
# Distillation
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def distill_setup(tmp_path_factory):
    """A tiny teacher and six news-world documents, three of them to distil on."""
    d = tmp_path_factory.mktemp("distill")
    docs = list(newsworld.documents(6, seed=3))
    data.write_jsonl(str(d / "docs.jsonl"), docs)
    entry = {x.id: {"id": x.id, "sha256": data.content_hash(x.text)} for x in docs}
    pools = {"train": [entry[x.id] for x in docs[:3]], "eval": [entry[x.id] for x in docs[3:]], "never_touch": []}
    (d / "split.json").write_text(json.dumps({"version": 1, "pools": pools}))
    return save_tiny_policy(d / "teacher", TOK), str(d)


def distill_config(setup, runs_dir) -> distill.Config:
    teacher, world = setup
    cfg = distill.Config(name="t", runs_dir=str(runs_dir), teacher=teacher, steps=2, batch_episodes=3, grad_accum=2,
                         lr=1e-2, warmup_steps=0, log_every=1, save_every=1, mask_check=2, torch_threads=1,
                         autocast="none", target="both")
    cfg.data = distill.DistillData(docs=f"{world}/docs.jsonl", split=f"{world}/split.json")
    cfg.generate = distill.GenerateConfig(samples_per_doc=2, max_new_tokens=12, filter="none")
    cfg.eval = distill.DistillEval(n_docs=0)
    return cfg


def _distill_rank(rank, setup, runs_dir):
    distill.main(distill_config(setup, runs_dir))


def test_distill_two_ranks_take_the_step_one_process_takes(distill_setup, tmp_path):
    """Rank 0 generates the teacher episodes and the student's initial weights, the
    other rank reads them; then each trains on half of every micro-batch, and the
    student, the loss and its CE and KD terms equal one process's."""
    distill.main(distill_config(distill_setup, tmp_path / "one"))
    launch(_distill_rank, 2, distill_setup, tmp_path / "two")
    one, two = tmp_path / "one" / "t", tmp_path / "two" / "t"
    assert (two / "teacher_episodes.jsonl").read_text() == (one / "teacher_episodes.jsonl").read_text()
    # every position of every branch (the KD term covers the prompt too) bounds what a step sums over
    positions = sum(len(b.input_ids) for ep in S.read_episodes(str(one / "teacher_episodes.jsonl"))
                    for b in ep.branches())
    assert_same_weights(weights(one), weights(two), rtol=sum_rtol(positions))
    for x, y in zip(*(common.read_metrics(d / "metrics.jsonl") for d in (one, two))):
        for k in ("loss", "ce", "kd", "grad_norm"):
            assert y[k] == pytest.approx(x[k], rel=1e-5), k
    assert (two / "final" / "config.json").exists() and (two / "distill.json").exists()


LAUNCHERS = {
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"],
    # accelerate's multi-GPU launcher is torchrun's; it starts CPU processes as well
    "accelerate": [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(_free_port())],  # not its fixed default, 29500
}


def test_kto_refuses_to_run_data_parallel(sft_setup, tmp_path, monkeypatch):
    monkeypatch.setattr(common, "init_distributed", lambda: common.Dist(rank=0, world=2))
    with pytest.raises(SystemExit, match="mode=kto runs as one process"):
        sft.main(sft_config(sft_setup, tmp_path, mode="kto"))


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_torchrun_and_accelerate_launch_run_the_script_as_it_is(sft_setup, tmp_path, launcher):
    """The README's commands: torchrun (here `python -m torch.distributed.run`, the same
    launcher) or `accelerate launch` starts two copies of sft.py, which find their
    ranks in the environment; one step line per step, from rank 0, and one final/."""
    model, train = sft_setup
    cmd = [*LAUNCHERS[launcher], "sft.py",
           "--config", "configs/sft_tiny.yaml", "init=", f"model.name_or_path={model}", f"data.train={train}",
           "data.eval=", "data.docs=", "eval.every=0", "eval.n_docs=0", "epochs=1", "batch_episodes=4", "save_every=1",
           "log_every=1", "rewrite_weight=1", "autocast=none", f"runs_dir={tmp_path}", "name=cli"]
    out = subprocess.run(cmd, cwd=Path(sft.__file__).parent, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("step 2/2 |") == 1 and out.stdout.count("mask validation") == 1  # rank 0 prints
    assert [r["step"] for r in common.read_metrics(tmp_path / "cli" / "metrics.jsonl")] == [1, 2]
    assert (tmp_path / "cli" / "final" / "config.json").exists()
