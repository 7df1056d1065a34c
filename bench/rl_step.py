"""One Dr. GRPO step of rl.py, broken down, against TRL's GRPOTrainer: on a tiny model, and on SmolLM2 with tools.

    python bench/rl_step.py [--prompts 4] [--group 8] [--new-tokens 64] [--steps 3] [--reps 2]
                            [--threads 1] [--trl-python /path/to/python-with-trl]
    python bench/rl_step.py --model smollm2-135m --threads 2 --trl-python /path/to/python-with-trl

Both trainers get the same policy, the same news-world documents, the same G,
completion limit, temperature 1, learning rate, beta = 0, one inner epoch,
gradient checkpointing (`--checkpointing`, on by default: TRL's GRPOConfig
default, and configs/rl_smollm.yaml's) and the same cheap reward (distinct
words of the completion), so the comparison is the rollout + update
machinery, not the reward. TRL runs
`GRPOTrainer(loss_type="dr_grpo", scale_rewards="none")` with HF `generate`;
rl.py runs its engine (prompt prefilled once per group, KV cache kept across
tool calls) and group-tree scoring. Each side runs `--steps` measured steps
after one warm-up step, `--reps` times interleaved; medians are kept (the
machine is shared).

A tiny preset (the default, tiny-1m): every weight trains, no tools (a random
policy writes no tool calls; the counts are reported). Target: rl.py's tokens
per second of rollout + update >= 3x TRL's.

`--model` (e.g. smollm2-135m): a rank-16 LoRA on every projection, and tool
calls on both sides, against TRL's own tool loop (`GRPOTrainer(environment_factory=...)`,
whose transformers path re-sends the whole context to `generate` after each
tool result).
- The same tool: `search` over the row's article, answered by the sandbox's
  own index and results block. TRL has no retraction, so the comparison is
  search only; rl.py's figures with deletes (two searches, two deletes a row)
  are printed beside it (`ours_delete_*`).
- The same chat template: SmolLM2's own template has no tool format, and TRL
  parses tool calls only through a template it knows, so both sides render
  the same prompt (system, tools schema, article) with TRL's Qwen2.5 template
  (read from the TRL interpreter), whose `<|im_start|>` turns SmolLM2 shares.
  The tool calls are each side's own syntax: `<search>Q</search>` for rl.py,
  `<tool_call>{"name": "search", ...}</tool_call>` for TRL.
- The same tool use: a base model calls no tool, so a logits processor makes
  every row write --tool-calls searches with the same queries at evenly spaced
  places, samples the tokens between them (stop tokens banned), and ends each
  row after exactly --new-tokens written tokens; TRL's token limit is raised by
  the tool results it counts in it. Tokens per second count written tokens.
Target: rl.py's step at least 3x faster than TRL's (`speedup_vs_trl`).

TRL is a bench-only dependency, run in a subprocess by `--trl-python` (default:
this interpreter), e.g. a venv with the system packages plus `trl==1.16.0`.
Beside it, the matmul-only bound of our step (bench/bound.py: the linear layers
of every forward pass it made, with their backward products for the update):
`ratio_vs_matmul_bound`, and the rollout's and the update's apart (`rollout_ratio_vs_bound`,
`update_ratio_vs_bound`). The last line is one JSON object.
"""
import argparse
import contextlib
import functools
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
from factual_tools import engine, evaluation  # noqa: E402
from factual_tools import textsplit  # noqa: E402
from newsworld.tiny import TINY_PRESETS  # noqa: E402

LR = 1e-5


def distinct_words(text: str) -> float:
    return len(set(textsplit.words(text))) / 50


def documents(n: int) -> list:
    return list(newsworld.documents(n, seed=0))


TOOL_QUERIES = ("/the/", "/said/", "/, /", "/[0-9]/")  # regex searches; the same on both sides, row by row
DELETES = ('<delete scope="sentence"/>', '<delete scope="clause"/>')
TOOL_SYSTEM = "Summarise the article in a few factual sentences. The search tool finds its sentences."
BAN = -float("inf")


class SearchEnv:
    """TRL's environment for one rollout: `search` over that row's article, answered
    as rl.py's sandbox answers it (same index, same results block, same budget)."""

    n_calls = 0  # every search any instance answered
    _length = staticmethod(sandbox.whitespace_length)  # the results budget's unit (a method named _* is no tool)

    def reset(self, **row) -> None:
        self.index = sandbox.index_for(row["document"])

    def search(self, query: str) -> str:
        """Search the article's sentences.

        Args:
            query: a /REGEX/ or keywords.
        """
        SearchEnv.n_calls += 1
        lim = sandbox.Limits()
        return self.index.search(query, lim.top_k, result_tokens=lim.result_tokens,
                                 length_fn=self._length).block


def tool_messages(document: str) -> list[dict]:
    return [{"role": "system", "content": TOOL_SYSTEM},
            {"role": "user", "content": f"Summarise this article.\n\n{document}"}]


@functools.cache
def search_schema() -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(SearchEnv().search)


def spaced(n_tokens: int, calls: list[list[int]]) -> list[list[int | None]]:
    """Turns of a plan: sampled tokens (None) evenly spaced around the calls' ids, n_tokens in all.
    Turn k is its sampled tokens then call k; the last turn has sampled tokens only."""
    free = n_tokens - sum(len(c) for c in calls)
    if free < len(calls) + 1:
        raise SystemExit(f"--new-tokens {n_tokens} leaves no room to write between {len(calls)} tool calls")
    n = len(calls) + 1
    sizes = [free // n + (k < free % n) for k in range(n)]
    return [[None] * sizes[k] + (calls[k] if k < len(calls) else []) for k in range(n)]


class EnginePlan:
    """rl.py's side: row position (tokens written, all turns) -> forced id or None (sampled,
    stop tokens banned); the last token is the end of turn."""

    def __init__(self, turns: list[list[int | None]], stops: list[int]):
        self.plan = [x for t in turns for x in t] + [stops[0]]
        self.stops = stops

    def __call__(self, rows, logits):
        for i, r in enumerate(rows):
            want = self.plan[min(r.n_gen, len(self.plan) - 1)]
            if want is None:
                logits[i, self.stops] = BAN
            else:
                logits[i, want] += 1e4
        return logits


class TurnPlan:
    """TRL's side, for HF `generate`: each call to generate sees the whole context, so the
    turn is the count of assistant turns in it and the position the tokens since the last
    one; each turn ends with the end-of-turn token (TRL then runs the tool)."""

    def __init__(self, turns: list[list[int | None]], stops: list[int], start_id: int, prompt_starts: int,
                 header: int):
        self.turns = [t + [stops[0]] for t in turns]
        self.stops, self.start_id, self.prompt_starts, self.header = stops, start_id, prompt_starts, header

    def __call__(self, input_ids, scores):
        for b, row in enumerate(input_ids.tolist()):
            starts = [i for i, x in enumerate(row) if x == self.start_id]
            turn = self.turns[min((len(starts) - self.prompt_starts) // 2, len(self.turns) - 1)]
            want = turn[min(len(row) - starts[-1] - self.header, len(turn) - 1)]
            if want is None:
                scores[b, self.stops] = BAN
            else:
                scores[b, want] += 1e4
        return scores


def template_from(trl_python: str) -> str | None:
    """TRL's Qwen2.5 chat template, read from the interpreter that has TRL (None without one)."""
    code = "import json; from trl.chat_template_utils import qwen2_5_chat_template as t; print(json.dumps(t))"
    try:
        out = subprocess.run([trl_python, "-c", code], capture_output=True, text=True)
    except OSError:  # no such interpreter
        return None
    return json.loads(out.stdout) if out.returncode == 0 else None


def tool_prompt_ids(tok, document: str, template: str) -> list[int]:
    text = tok.apply_chat_template(tool_messages(document), tools=[search_schema()], chat_template=template,
                                   add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def run_ours(args, tmp: str, deletes: bool = False) -> dict:
    import torch

    import rl
    from bound import record_forwards, replay_seconds

    torch.set_num_threads(args.threads)
    path = str(modeling.resolve_model_path(args.model))
    docs_path = os.path.join(tmp, "docs.jsonl")
    data.write_jsonl(docs_path, documents(args.prompts * (args.steps + 1)))
    cfg = rl.Config(name="bench", runs_dir=tmp, resume="none", steps=args.steps + 1, prompts_per_step=args.prompts,
                    group_size=args.group, micro_groups=args.prompts, lr=LR, save_every=0, score_method=args.method,
                    model=modeling.ModelConfig(name_or_path=path, lora=modeling.LoraConfig(enabled=lora(args)),
                                               gradient_checkpointing=args.checkpointing == "on"),
                    data=rl.DocumentData(train=docs_path, split=""), autocast="none")
    if lora(args):
        cfg.max_batch_tokens = args.max_batch_tokens  # 16384: a group's tree a pass, as configs/rl_smollm.yaml
    cfg.sampling.max_new_tokens = args.new_tokens
    cfg.sampling.temperature = 1.0
    cfg.eval = rl.RLEval(every=0, n_docs=0, sample_every=0)
    reward = lambda docs, eps: [{"total": distinct_words(e.summary)} for e in eps]  # noqa: E731
    shapes, steps = [], []
    real_load, real_prompt, real_ban = modeling.load_policy, sandbox.prompt_ids, evaluation.tool_processor
    if args.tools:  # the tool comparison: every row's calls planned (see the docstring), TRL's template
        calls = [f"<search>{q}</search>" for q in TOOL_QUERIES[:args.tool_calls]]
        if deletes:
            calls[1::2] = DELETES[:len(calls[1::2])]

        def plan(tok, tools):
            encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
            return EnginePlan(spaced(args.new_tokens, [encode(c) for c in calls]), engine.stop_ids(tok))

        evaluation.tool_processor = plan
    if args.template:
        def prompt_ids(tokenizer, document):
            tok = tokenizer.tokenizer if isinstance(tokenizer, sandbox.Codec) else tokenizer
            return tool_prompt_ids(tok, document, args.template)

        sandbox.prompt_ids = prompt_ids

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
        modeling.load_policy, sandbox.prompt_ids, evaluation.tool_processor = real_load, real_prompt, real_ban
        steps[0][1].__exit__(None, None, None)
    hist = every[1:]  # the first step warms up
    med = lambda k: statistics.median(h[k] for h in hist)  # noqa: E731
    # the bound of every step, warm-up included, against the time of every step: the rollout's
    # forwards (no autograd) and the update's (forward and backward products) apart
    backward = "input" if lora(args) else "full"
    bound = {part: replay_seconds(steps[0][0], [s for s in shapes[0] if s[2] == (part == "update")], backward)
             for part in ("rollout", "update")}
    spent = {part: sum(h[f"{part}_s"] for h in every) for part in ("rollout", "update")}
    return {"step_s": med("rollout_s") + med("reward_s") + med("update_s"), "rollout_s": med("rollout_s"),
            "reward_s": med("reward_s"), "update_s": med("update_s"), "len": med("len"),
            "bound_ratio": sum(bound.values()) / sum(spent.values()),
            **{f"{part}_bound_ratio": bound[part] / spent[part] for part in bound},
            "calls": med("search") + med("delete")}


def lora(args) -> bool:
    """A tiny preset trains every weight (as the tiny pipeline does); another model a LoRA."""
    return args.model not in TINY_PRESETS


def run_trl(args, tmp: str) -> dict:
    """In this process: TRL's GRPOTrainer on the same model, prompts and shape (with --template: its tool loop)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, GenerationMixin, LogitsProcessorList, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    path = str(modeling.resolve_model_path(args.model))
    tok = modeling.load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    docs = documents(args.prompts * (args.steps + 1))
    rows = [{"prompt": sandbox.prompt_messages(d.text)} for d in docs]
    tools, extra = {}, 0
    if args.template:
        tok.chat_template = args.template  # TRL knows this template by its text, and parses its <tool_call>s
        encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
        SearchEnv._length = staticmethod(lambda text: len(encode(text)))  # rl.py's budget unit: tokens
        rows = [{"prompt": tool_messages(d.text), "document": d.text} for d in docs]
        calls = [encode("<tool_call>\n" + json.dumps({"name": "search", "arguments": {"query": q}}) + "\n</tool_call>")
                 for q in TOOL_QUERIES[:args.tool_calls]]
        start = tok.convert_tokens_to_ids("<|im_start|>")
        prompt = tool_prompt_ids(tok, docs[0].text, args.template)
        plan = TurnPlan(spaced(args.new_tokens, calls), engine.stop_ids(tok), start, prompt.count(start),
                        len(encode("<|im_start|>assistant\n")))
        real_generate = GenerationMixin.generate

        def generate(self, *a, **k):  # every generate call TRL makes, the tool loop's included
            k["logits_processor"] = LogitsProcessorList([plan])
            return real_generate(self, *a, **k)

        GenerationMixin.generate = generate
        tools = {"environment_factory": SearchEnv}
        extra = args.tool_calls * (sandbox.Limits().result_tokens + 40)  # TRL counts tool results in its limit
    ds = Dataset.from_list(rows)

    def reward(completions, **kw):
        return [distinct_words(c if isinstance(c, str) else " ".join(m["content"] or "" for m in c
                                                                     if m["role"] == "assistant"))
                for c in completions]

    times, gen_s, calls = [], [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            times.append(time.perf_counter())
            gen_s.append(0.0)
            calls.append(SearchEnv.n_calls)

        def on_step_end(self, *a, **k):
            times[-1] = time.perf_counter() - times[-1]
            calls[-1] = (SearchEnv.n_calls - calls[-1]) / (args.prompts * args.group)

    targs = GRPOConfig(output_dir=tmp, loss_type="dr_grpo", scale_rewards="none", beta=0.0, num_iterations=1,
                       num_generations=args.group, per_device_train_batch_size=args.prompts * args.group,
                       gradient_accumulation_steps=1, max_completion_length=args.new_tokens + extra, temperature=1.0,
                       learning_rate=LR, max_steps=args.steps + 1, logging_steps=1, report_to="none",
                       save_strategy="no", use_cpu=True, bf16=False, seed=0, disable_dropout=True,
                       gradient_checkpointing=args.checkpointing == "on")
    peft_config = None
    if lora(args):
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules=modeling.LORA_TARGETS, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=targs, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()], peft_config=peft_config, **tools)
    real_gen = trainer._generate

    def timed_generate(*a, **k):  # the rollout: generate, the tool loop, decoding
        t0 = time.perf_counter()
        out = real_gen(*a, **k)
        gen_s[-1] += time.perf_counter() - t0
        return out

    trainer._generate = timed_generate
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        trainer.train()
    logs = trainer.state.log_history
    per_step = lambda key: [h[key] for h in logs if key in h][1:]  # noqa: E731
    return {"step_s": statistics.median(times[1:]), "rollout_s": statistics.median(gen_s[1:]),
            "update_s": statistics.median(t - g for t, g in zip(times[1:], gen_s[1:])),
            "len": statistics.median(per_step("completions/mean_length")), "calls": statistics.median(calls[1:])}


def trl_subprocess(args) -> dict | None:
    cmd = [args.trl_python, os.path.abspath(__file__), "--trl-only", "--model", args.model, "--prompts", str(args.prompts),
           "--group", str(args.group), "--new-tokens", str(args.new_tokens), "--steps", str(args.steps),
           "--threads", str(args.threads), "--tool-calls", str(args.tool_calls), "--checkpointing", args.checkpointing]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    if out.returncode != 0:
        print(f"TRL run failed ({args.trl_python}):\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-1m", help="a tiny preset (every weight trains) or a model (LoRA, tools)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=None, help="written tokens a row (default 64; 128 with --model)")
    ap.add_argument("--tool-calls", type=int, default=4, choices=range(1, len(TOOL_QUERIES) + 1),
                    help="searches a row with --model")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per run (after one warm-up step)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads, the same for both")
    ap.add_argument("--checkpointing", choices=["on", "off"], default="on",
                    help="gradient checkpointing on both sides (on: TRL's GRPOConfig default and rl_smollm.yaml's)")
    ap.add_argument("--max-batch-tokens", type=int, default=16384,
                    help="with --model: rl.py's max_batch_tokens (smaller: group trees scored in parts)")
    ap.add_argument("--method", choices=["group", "tree", "branch"], default="group", help="rl.py's scoring path")
    ap.add_argument("--trl-python", default=sys.executable, help="an interpreter that has trl installed")
    ap.add_argument("--trl-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.new_tokens = args.new_tokens or (64 if args.model in TINY_PRESETS else 128)
    args.tools, args.template = lora(args), None
    if args.trl_only:
        if args.tools:
            from trl.chat_template_utils import qwen2_5_chat_template

            args.template = qwen2_5_chat_template
        with tempfile.TemporaryDirectory() as tmp:
            print(json.dumps(run_trl(args, tmp)))
        return
    if args.tools:
        args.template = template_from(args.trl_python)
        if args.template is None:
            print(f"{args.trl_python} has no trl (pass --trl-python, a Python with trl==1.16.0): rl.py alone, "
                  f"with {args.model}'s own chat template", file=sys.stderr)

    ours, dels, trl = [], [], []
    for _ in range(args.reps):  # TRL first: this process keeps the memory its own runs freed
        got = trl_subprocess(args) if args.template or not args.tools else None
        if got is not None:
            trl.append(got)
        with tempfile.TemporaryDirectory() as tmp:
            ours.append(run_ours(args, tmp))
        if args.tools:
            with tempfile.TemporaryDirectory() as tmp:
                dels.append(run_ours(args, tmp, deletes=True))
    n_rollouts = args.prompts * args.group
    med = lambda runs, k: statistics.median(r[k] for r in runs)  # noqa: E731
    fig = {"model": args.model, "prompts": args.prompts, "group": args.group, "new_tokens": args.new_tokens,
           "threads": args.threads, "checkpointing": args.checkpointing}
    sides = [("ours", ours), ("ours_delete", dels), ("trl", trl)]
    for name, runs in sides:
        if runs:
            for k in ("step_s", "rollout_s", "update_s", "len", "calls"):
                fig[f"{name}_{k}"] = med(runs, k)
            fig[f"{name}_tok_s"] = n_rollouts * fig[f"{name}_len"] / fig[f"{name}_step_s"]
    # rollout and update time against their linear layers alone (reward excluded: no model runs there)
    fig["ratio_vs_matmul_bound"] = med(ours, "bound_ratio")
    fig["rollout_ratio_vs_bound"] = med(ours, "rollout_bound_ratio")
    fig["update_ratio_vs_bound"] = med(ours, "update_bound_ratio")  # forward + backward products
    if trl:
        fig["speedup_vs_trl"] = fig["ours_tok_s"] / fig["trl_tok_s"]
        fig["speedup_target"] = 3.0
    for k, v in fig.items():
        print(f"{k:24s} {v:12.4f}" if isinstance(v, float) else f"{k:24s} {v:>12}")
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in fig.items()}))


if __name__ == "__main__":
    main()
