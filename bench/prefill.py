"""The rollout engine's prefill of prompts of unequal lengths: forwards of similar lengths
(`rollout.width_groups`) against one forward padded to the longest.

    python bench/prefill.py [--model smollm2-135m] [--docs 64] [--reps 3]

`--docs` news-world articles (eval.py's documents: their prompts run from about 100
to 250 tokens for SmolLM2) are prefilled as one batch, as the engine starts an
evaluation; then each row takes a results block of 20-120 ids, as after a search.
`grouped` is the engine as it runs on a CPU; `one forward` pads every row to the
longest. The model is the preset or path given, under the CPU's autocast choice
(`autocast: auto`). Repetitions are interleaved and the median kept. Prints the
seconds of each, the padded positions each computed, the speedup (target >= 1.2x
on SmolLM2) and the largest difference between the two ways' next-token logits.
The last line is one JSON object.
"""
import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from factual_tools import common, modeling  # noqa: E402
from factual_tools import rollout as R  # noqa: E402
import newsworld  # noqa: E402
import sandbox  # noqa: E402


@torch.no_grad()
def prefill(model, tokenizer, prompts, blocks) -> tuple[float, int, torch.Tensor]:
    batch = R._Batch(model, tokenizer.pad_token_id, record=False)
    t0 = time.perf_counter()
    batch.prefill([R.Row(i, None) for i in range(len(prompts))], prompts)
    batch.extend(blocks)
    return time.perf_counter() - t0, batch.forward_tokens, batch.logits.float()


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
    prompts = [sandbox.prompt_ids(tok, d.text) for d in newsworld.documents(args.docs, seed=11)]
    rng = random.Random(0)
    blocks = [[rng.randrange(100, 1000) for _ in range(rng.randint(20, 120))] for _ in prompts]
    lens = sorted(len(p) for p in prompts)
    print(f"{len(prompts)} prompts of {lens[0]}-{lens[-1]} ids (median {lens[len(lens) // 2]}), "
          f"then a results block of 20-120 ids each")
    real = R.width_groups
    times, tokens, logits = {"grouped": [], "one forward": []}, {}, {}
    for _ in range(args.reps + 1):  # the first round warms up
        for way in times:
            R.width_groups = real if way == "grouped" else (lambda lengths, overhead: [list(range(len(lengths)))])
            amp = common.autocast(use_bf16, "cpu", model) if use_bf16 else contextlib.nullcontext()
            with amp:
                s, tokens[way], logits[way] = prefill(model, tok, prompts, blocks)
            times[way].append(s)
    R.width_groups = real
    grouped_s, one_s = (statistics.median(times[w][1:]) for w in times)
    out = {"docs": len(prompts), "one_forward_s": one_s, "grouped_s": grouped_s, "speedup": one_s / grouped_s,
           "one_forward_positions": tokens["one forward"], "grouped_positions": tokens["grouped"],
           "max_abs_diff": (logits["grouped"] - logits["one forward"]).abs().max().item()}
    print(f"prefill and results blocks: one forward {one_s:.2f} s ({out['one_forward_positions']} positions), "
          f"grouped {grouped_s:.2f} s ({out['grouped_positions']}): {out['speedup']:.2f}x (target >= 1.2x); "
          f"largest logit difference {out['max_abs_diff']:.1e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
