"""One Dr. GRPO step of rl.py, broken down, and its throughput against TRL's GRPOTrainer.

    python bench/rl_step.py [--prompts 4] [--group 8] [--new-tokens 64] [--steps 3] [--reps 2]
                            [--threads 1] [--trl-python /path/to/python-with-trl]
    python bench/rl_step.py --model smollm2-135m --threads 2 --steps 2 --reps 1   # a rank-16 LoRA on the real model

Both trainers get the same policy (the tiny-1m preset, seed 0, every weight
trained; with --model, that model with a rank-16 LoRA on every projection), the
same news-world prompts (the chat prompt every stage
uses), the same G, completion limit, temperature 1, learning rate, beta = 0 and
one inner epoch, and the same cheap reward (distinct words of the completion),
so the comparison is the rollout + update machinery, not the reward. TRL runs
`GRPOTrainer(loss_type="dr_grpo", scale_rewards="none")` with HF `generate`;
rl.py runs its engine (prompt prefilled once per group, KV cache kept) and
group-tree scoring, without tools (a random policy writes no tool calls; the counts
are reported). Each side runs `--steps` measured steps after one warm-up step,
`--reps` times interleaved; medians are kept (the machine is shared).

TRL is a bench-only dependency, run in a subprocess by `--trl-python` (default:
this interpreter), e.g. a venv with the system packages plus `trl==1.16.0`
(1.14.2 also runs on this CPU stack; 1.15.0 does not). Target: rl.py's tokens
per second of rollout + update >= 1.5x TRL's. Beside it, the matmul-only bound of
our step (bench/bound.py: the linear layers of every forward pass it made, with
their backward products for the update): `ratio_vs_matmul_bound`. The last line is
one JSON object.
"""
import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
from factual_tools import modeling  # noqa: E402
import newsworld  # noqa: E402
import sandbox  # noqa: E402
from factual_tools import textsplit  # noqa: E402
from newsworld.tiny import TINY_PRESETS  # noqa: E402

LR = 1e-5


def distinct_words(text: str) -> float:
    return len(set(textsplit.words(text))) / 50


def documents(n: int) -> list:
    return list(newsworld.documents(n, seed=0))


def run_ours(args, tmp: str) -> dict:
    import torch

    import rl
    from bound import record_forwards, replay_seconds

    torch.set_num_threads(args.threads)
    path = str(modeling.resolve_model_path(args.model))
    docs_path = os.path.join(tmp, "docs.jsonl")
    data.write_jsonl(docs_path, documents(args.prompts * (args.steps + 1)))
    cfg = rl.Config(name="bench", runs_dir=tmp, resume="none", steps=args.steps + 1, prompts_per_step=args.prompts,
                    group_size=args.group, micro_groups=args.prompts, lr=LR, save_every=0, score_method=args.method,
                    model=modeling.ModelConfig(name_or_path=path, lora=modeling.LoraConfig(enabled=lora(args))),
                    data=rl.DataConfig(train=docs_path, split=""), autocast="none")
    if lora(args):
        cfg.max_batch_tokens = 2048  # a group's tree a forward, as configs/rl_smollm.yaml
    cfg.sampling.max_new_tokens = args.new_tokens
    cfg.sampling.temperature = 1.0
    cfg.eval = rl.EvalConfig(every=0, n_docs=0, sample_every=0)
    reward = lambda docs, eps: [{"total": distinct_words(e.summary)} for e in eps]  # noqa: E731
    shapes, steps = [], []
    real_load = modeling.load_policy

    def load(*a, **k):  # record every forward pass of the trained model, step by step
        model, tok = real_load(*a, **k)
        steps.append((model, record_forwards(model)))
        shapes.append(steps[-1][1].__enter__())
        return model, tok

    modeling.load_policy = load
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            every = rl.main(cfg, reward_fn=reward)["history"]
    finally:
        modeling.load_policy = real_load
        steps[0][1].__exit__(None, None, None)
    hist = every[1:]  # the first step warms up
    med = lambda k: statistics.median(h[k] for h in hist)  # noqa: E731
    # the bound of every step, warm-up included, against the time of every step
    bound_s = replay_seconds(steps[0][0], shapes[0], backward="input" if lora(args) else "full")
    all_s = sum(h["rollout_s"] + h["update_s"] for h in every)
    return {"step_s": med("rollout_s") + med("reward_s") + med("update_s"), "rollout_s": med("rollout_s"),
            "reward_s": med("reward_s"), "update_s": med("update_s"), "len": med("len"),
            "bound_ratio": bound_s / all_s,
            "search": sum(h["search"] for h in hist), "delete": sum(h["delete"] for h in hist)}


def lora(args) -> bool:
    """A tiny preset trains every weight (as the tiny pipeline does); another model a LoRA."""
    return args.model not in TINY_PRESETS


def run_trl(args, tmp: str) -> dict:
    """In this process: TRL's GRPOTrainer on the same model, prompts and shape."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    path = str(modeling.resolve_model_path(args.model))
    tok = modeling.load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    ds = Dataset.from_list([{"prompt": sandbox.prompt_messages(d.text)}
                            for d in documents(args.prompts * (args.steps + 1))])

    def reward(completions, **kw):
        return [distinct_words(c if isinstance(c, str) else c[-1]["content"]) for c in completions]

    times = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            times[-1] = time.perf_counter() - times[-1]

    targs = GRPOConfig(output_dir=tmp, loss_type="dr_grpo", scale_rewards="none", beta=0.0, num_iterations=1,
                       num_generations=args.group, per_device_train_batch_size=args.prompts * args.group,
                       gradient_accumulation_steps=1, max_completion_length=args.new_tokens, temperature=1.0,
                       learning_rate=LR, max_steps=args.steps + 1, logging_steps=1, report_to="none",
                       save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_dropout=True)
    peft_config = None
    if lora(args):
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=modeling.LORA_TARGETS, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=targs, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()], peft_config=peft_config)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.train()
    lens = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_s": statistics.median(times[1:]), "len": statistics.median(lens[1:])}


def trl_subprocess(args) -> dict | None:
    cmd = [args.trl_python, os.path.abspath(__file__), "--trl-only", "--model", args.model, "--prompts", str(args.prompts),
           "--group", str(args.group), "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    if out.returncode != 0:
        print(f"TRL run failed ({args.trl_python}):\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-1m", help="a tiny preset (every weight trains) or a model (LoRA)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run (after one warm-up step)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same for both")
    ap.add_argument("--method", choices=["group", "tree", "branch"], default="group", help="rl.py's scoring path")
    ap.add_argument("--trl-python", default=sys.executable, help="an interpreter that has trl installed")
    ap.add_argument("--trl-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_only:
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run_trl(args, tmp)))
        return

    ours, trl = [], []
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            ours.append(run_ours(args, tmp))
        got = trl_subprocess(args)
        if got is not None:
            trl.append(got)
    n_rollouts = args.prompts * args.group
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    fig = {"prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens, "threads": args.threads,
           "ours_step_s": med(ours, "step_s"), "ours_rollout_s": med(ours, "rollout_s"),
           "ours_reward_s": med(ours, "reward_s"), "ours_update_s": med(ours, "update_s"),
           "ours_len": med(ours, "len"), "ours_tool_calls": sum(r["search"] + r["delete"] for r in ours)}
    fig["ours_tok_s"] = n_rollouts * fig["ours_len"] / fig["ours_step_s"]
    # rollout and update time against their linear layers alone (reward excluded: no model runs there)
    fig["ratio_vs_matmul_bound"] = med(ours, "bound_ratio")
    if trl:
        fig.update(trl_step_s=med(trl, "step_s"), trl_len=med(trl, "len"))
        fig["trl_tok_s"] = n_rollouts * fig["trl_len"] / fig["trl_step_s"]
        fig["speedup_vs_trl"] = fig["ours_tok_s"] / fig["trl_tok_s"]
    for k, v in fig.items():
        print(f"{k:24s} {v:12.4f}" if isinstance(v, float) else f"{k:24s} {v:>12}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in fig.items()}))


if __name__ == "__main__":
    main()
