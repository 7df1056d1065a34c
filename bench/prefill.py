"""The rollout engine's prefill of prompts of unequal lengths: forwards of similar lengths
(`engine.width_groups`) against one forward padded to the longest.

    python bench/prefill.py [--model smollm2-135m] [--docs 64] [--reps 3]

`--docs` news-world articles (eval.py's documents: their prompts run from about 100
to 250 tokens for SmolLM2) are prefilled as one batch, as the engine starts an
evaluation, and each row writes its first token (greedy). `grouped` is the engine
as it runs on a CPU; `one forward` pads every row to the longest. The model is the
preset or path given, under the CPU's autocast choice (`autocast: auto`).
Repetitions are interleaved and the median kept. Prints the seconds of each, the
positions each forward computes (past the prompts' shared opening), the speedup
(target >= 1.2x on SmolLM2) and the largest difference between the two ways'
first-token log-probs. The last line is one JSON object.
"""
import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from factual_tools import common, modeling  # noqa: E402
from factual_tools import engine  # noqa: E402
import newsworld  # noqa: E402
import sandbox  # noqa: E402


def prefill(model, tokenizer, docs) -> tuple[float, torch.Tensor]:
    cfg = engine.SamplingConfig(temperature=0.0, max_new_tokens=1, batch_size=len(docs))
    t0 = time.perf_counter()
    eps = engine.rollout(model, tokenizer, docs, 1, cfg)
    return time.perf_counter() - t0, torch.tensor([ep.turns[0].logprobs[0] for ep in eps])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="a model preset or path (tiny-8m for a quick look)")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    model, tok = modeling.load_policy(modeling.ModelConfig(name_or_path=args.model), train=False, device_name="cpu")
    model.eval()
    use_bf16, why = common.choose_autocast("auto", "cpu", common.hidden_size(model))
    print(f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {why}")
    docs = [d.text for d in newsworld.documents(args.docs, seed=11)]
    prompts = [sandbox.prompt_ids(tok, d) for d in docs]
    shared = next(i for i in range(min(map(len, prompts))) if len({p[i] for p in prompts}) > 1)
    lens = [len(p) - shared for p in prompts]
    groups = engine.width_groups(lens, engine.SPLIT_OVERHEAD if shared >= engine.MIN_COMMON_PREFIX else None)  # as the engine cuts
    positions = {"one forward": len(lens) * max(lens), "grouped": sum(len(g) * max(lens[i] for i in g) for g in groups)}
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} ids, "
          f"the first {shared} shared")
    real = engine.width_groups
    times, lps = {"grouped": [], "one forward": []}, {}
    for _ in range(args.reps + 1):  # the first round warms up
        for way in times:
            engine.width_groups = real if way == "grouped" else (lambda lengths, overhead: [list(range(len(lengths)))])
            amp = common.autocast(use_bf16, "cpu", model) if use_bf16 else contextlib.nullcontext()
            with amp:
                s, lps[way] = prefill(model, tok, docs)
            times[way].append(s)
    engine.width_groups = real
    grouped_s, one_s = (statistics.median(times[w][1:]) for w in times)
    out = {"docs": len(prompts), "one_forward_s": one_s, "grouped_s": grouped_s, "speedup": one_s / grouped_s,
           "one_forward_positions": positions["one forward"], "grouped_positions": positions["grouped"],
           "max_abs_diff": (lps["grouped"] - lps["one forward"]).abs().max().item()}
    print(f"prefill: one forward {one_s:.2f} s ({out['one_forward_positions']} positions), grouped "
          f"{grouped_s:.2f} s ({out['grouped_positions']}): {out['speedup']:.2f}x (target >= 1.2x); "
          f"largest first-token log-prob difference {out['max_abs_diff']:.1e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
