"""Scoring a tree, forward and backward, with the attention `scoring.score_trees` picks on a CPU
against the dense tree mask.

    python bench/tree_attention.py [--model smollm2-135m] [--prompt 256] [--group 8] [--rollout 370] [--reps 3]
    python bench/tree_attention.py --group 1 --rollout 480     # an SFT episode's shape

The tree is an RL step's group as rl.py scores it: a `--prompt`-token prompt, then
`--group` rollouts of `--rollout` nodes each (generated tokens and the search
results injected between them), each with one retracted branch of a sixth of its
length (a delete: the rollout goes on from where the branch started). With
`--group 1` it is an SFT episode's shape. score_trees attends in blocks
(`scoring.tree_blocks`) where they skip at least half the dense mask's work (a
group), else in query chunks against their key prefixes (`scoring.prefix_chunks`:
an SFT episode). Token ids are random; the attention's cost depends on the tree's
shape only. The model is the preset or path given, with a rank-16 LoRA on every
projection as in RL, and the CPU's autocast choice (`autocast: auto`). Both ways
score the same tree with the same weights; repetitions are interleaved and the
median kept. Prints the seconds of each, the speedup (target >= 1.5x for blocks on
an RL group of SmolLM2, >= 1.1x for prefix chunks on an SFT episode) and the
largest log-prob difference (under bf16 autocast, beside bf16's own difference
from fp32). The last line is one JSON object.
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
from factual_tools import scoring  # noqa: E402


def group_tree(prompt: int, group: int, rollout: int, vocab: int, seed: int = 0) -> scoring.TokenTree:
    """A prompt chain, then `group` rollouts, each with one abandoned branch; nodes in path order."""
    g = torch.Generator().manual_seed(seed)
    ids, parent, depth, paths, targets = [], [], [], [], []

    def chain(start: int, n: int) -> list[int]:
        nodes = []
        for _ in range(n):
            parent.append(start)
            depth.append(0 if start < 0 else depth[start] + 1)
            ids.append(int(torch.randint(vocab, (1,), generator=g)))
            start = len(ids) - 1
            nodes.append(start)
        return nodes

    root = chain(-1, prompt)
    retracted = rollout // 6
    for e in range(group):
        head = chain(root[-1], (rollout - retracted) // 2)
        dead = chain(head[-1], retracted)  # written, then deleted
        paths.append(root + head + dead)
        tail = chain(head[-1], rollout - retracted - len(head))
        paths.append(root + head + tail)
        targets.append((e, 0, head + tail))
    return scoring.TokenTree(ids, parent, depth, targets, paths)


def score(model, tree: scoring.TokenTree, group: int, amp) -> tuple[float, torch.Tensor]:
    out = [[None] for _ in range(group)]
    model.zero_grad()
    t0 = time.perf_counter()
    with amp:
        scoring.score_trees(model, [tree], out, 1.0, "cpu")
    loss = -sum(t[0].sum() for t in out)
    loss.backward()
    return time.perf_counter() - t0, torch.cat([t[0].detach().float() for t in out])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="a model preset or path (tiny-8m for a quick look)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--rollout", type=int, default=370, help="nodes per rollout, retracted branch included")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = modeling.ModelConfig(name_or_path=args.model, lora=modeling.LoraConfig(enabled=True))
    model, _ = modeling.load_policy(cfg, train=True, device_name="cpu")
    use_bf16, why = common.choose_autocast("auto", "cpu", common.hidden_size(model))
    print(f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, {why}")
    tree = group_tree(args.prompt, args.group, args.rollout, model.config.vocab_size)
    allowed = scoring.tree_mask(tree, len(tree.ids))[None]
    blocks = scoring.tree_blocks(allowed)
    if blocks is not None:
        path, share = "blocks", sum(p.mask.numel() for p in blocks.parts) / allowed.numel()
    else:
        ends = scoring.prefix_chunks(allowed)
        path = "prefix chunks" if ends else "dense"
        share = sum((e - s) * e for s, e in zip([0] + ends[:-1], ends)) / allowed.numel() if ends else 1.0
    print(f"tree: {len(tree.ids)} nodes; score_trees attends in {path}, {share:.0%} of the dense mask's attention")
    real = scoring.tree_blocks, scoring.prefix_chunks
    times, lps = {"ours": [], "dense": []}, {}
    for _ in range(args.reps + 1):  # the first round warms up
        for way in ("ours", "dense"):
            scoring.tree_blocks, scoring.prefix_chunks = real if way == "ours" else (lambda allowed: None,) * 2
            amp = common.autocast(use_bf16, "cpu", model) if use_bf16 else contextlib.nullcontext()
            s, lps[way] = score(model, tree, args.group, amp)
            times[way].append(s)
    ours_s, dense_s = (statistics.median(times[w][1:]) for w in ("ours", "dense"))
    out = {"nodes": len(tree.ids), "path": path, "share": share, "dense_s": dense_s, "ours_s": ours_s,
           "speedup": dense_s / ours_s, "max_abs_diff": (lps["ours"] - lps["dense"]).abs().max().item()}
    print(f"forward+backward: dense mask {dense_s:.2f} s, {path} {ours_s:.2f} s: {out['speedup']:.2f}x "
          f"(target >= 1.5x blocks, >= 1.1x prefix chunks); largest log-prob difference {out['max_abs_diff']:.1e}")
    if use_bf16:  # bf16's own rounding, for scale: the dense mask in fp32 against bf16
        scoring.tree_blocks, scoring.prefix_chunks = (lambda allowed: None,) * 2
        out["bf16_vs_fp32_diff"] = (score(model, tree, args.group, contextlib.nullcontext())[1]
                                    - lps["dense"]).abs().max().item()
        print(f"  (bf16 against fp32, both dense: {out['bf16_vs_fp32_diff']:.1e})")
    scoring.tree_blocks, scoring.prefix_chunks = real
    print(json.dumps(out))


if __name__ == "__main__":
    main()
