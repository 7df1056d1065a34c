"""SFT step throughput: our deletion-aware tree step against plain causal-LM steps on the same tokens.

    python bench/sft.py [--preset tiny-1m] [--batch 16] [--reps 5] [--row-tokens 1024]
    python bench/sft.py --model smollm2-135m --batch 8 --reps 3   # the real model: LoRA as configs/sft_smollm.yaml

- `sft_step`: what sft.py does per micro-batch: build each episode's tree of
  branches, score it (`scoring.episode_logprobs`: one row per tree, the output
  head only where a generated token is predicted), backward.
- `packed_lm`: a plain packed causal-LM step on the same episodes' tokens (each
  tree's tokens back to back in rows of --row-tokens, causal attention, HF
  `labels` on the generated ids): what a generic packed SFT trainer runs, the
  cost of the same model without trees. `ratio_vs_packed_lm` (target >= 0.8).
- `packed_lm_head_at_targets`: the same rows with the output head applied only
  at the trained positions (the tightest plain limit; `ratio_vs_packed_lm_tight`).
- `bare`: every branch padded to its own row, HF `labels` (the unshared limit).
- `packed_trees_W`: the trees themselves packed first-fit into rows of W tokens
  with a block-diagonal tree mask (the packing alternative: fewer padded
  positions, but dense attention grows with W^2 on a CPU; printed to show it).
- `matmul_bound`: the linear layers of sft_step's own forward passes, forward and
  backward, alone (bench/bound.py; weight gradients too for a full fine-tune,
  input gradients only under LoRA): `ratio_sft_vs_matmul_bound`.
A model that is no tiny preset (`--model`) trains a rank-16 LoRA on every
projection, one tree per forward (max_batch_tokens 1024), as sft.py does with it.
Throughput counts trained (generated) tokens. Also: episodes/s of building
branches and validating their masks. Repetitions interleaved, medians kept. The
last line is one JSON object, `ratio_vs_packed_lm` last.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from factual_tools import modeling  # noqa: E402
import newsworld  # noqa: E402
from newsworld import oracle  # noqa: E402
from factual_tools import engine, scoring  # noqa: E402
import sandbox  # noqa: E402
from factual_tools import textsplit  # noqa: E402
from newsworld.tiny import TINY_PRESETS  # noqa: E402
import sft  # noqa: E402


def traces(n, seed=0):
    """Corrective news-world traces (a wrong sentence, a search, a delete, the fix)."""
    import random

    rng = random.Random(seed)
    out = []
    for doc in newsworld.documents(n, seed=seed):
        text, labels = oracle.draft(doc, rng, n_errors=1)
        lab = labels[0] if labels else None
        if lab:
            sents = textsplit.split_sentences(text)
            i = lab["sentence_index"]
            sents[i] += f'<search>/({lab["regex_key"]})/</search><delete scope="sentence"/> {lab["corrected_clause"]}'
            text = " ".join(sents)
        out.append(sandbox.replay(doc.text, text))
    return out


def bare_step(model, episodes):
    branches = [b for e in episodes for b in e.branches()]
    width = max(len(b.input_ids) for b in branches)
    ids = torch.zeros((len(branches), width), dtype=torch.long)
    labels = torch.full((len(branches), width), -100)
    mask = torch.zeros((len(branches), width), dtype=torch.long)
    for i, b in enumerate(branches):
        n = len(b.input_ids)
        ids[i, :n] = torch.tensor(b.input_ids)
        mask[i, :n] = 1
        labels[i, :n] = torch.tensor([t if m else -100 for t, m in zip(b.input_ids, b.loss_mask)])
    model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()


def packed_rows(trees, width):
    """Each tree's tokens back to back in rows of `width` (a tree never split), with
    labels on the ids a generated token is predicted from... as a causal LM sees them."""
    rows, cur = [], []
    for t in trees:
        trained = {n for _, _, nodes in t.targets for n in nodes}
        toks = [(i, i if k in trained else -100) for k, i in enumerate(t.ids)]
        if cur and len(cur) + len(toks) > width:
            rows.append(cur)
            cur = []
        cur += toks
    rows.append(cur)
    n = max(map(len, rows))
    ids = torch.zeros((len(rows), n), dtype=torch.long)
    labels = torch.full((len(rows), n), -100)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor([a for a, _ in r])
        labels[i, :len(r)] = torch.tensor([b for _, b in r])
    return ids, labels


def packed_lm_step(model, ids, labels):
    model(input_ids=ids, labels=labels).loss.backward()


def packed_lm_tight_step(model, ids, labels):
    h = model.get_decoder()(input_ids=ids).last_hidden_state
    keep = labels[:, 1:] != -100
    logits = model.get_output_embeddings()(h[:, :-1][keep])
    torch.nn.functional.cross_entropy(logits.float(), labels[:, 1:][keep]).backward()


def packed_trees_step(model, episodes, trees, width, n_tok):
    """The trees packed first-fit (largest first) into rows of `width`, each row
    one `scoring.TokenTree` of disjoint tries (so `tree_mask` makes its mask block
    diagonal), scored by `scoring.score_trees` itself."""
    rows = []
    for t in sorted(trees, key=lambda t: -len(t.ids)):
        for r in rows:
            if sum(len(x.ids) for x in r) + len(t.ids) <= width:
                r.append(t)
                break
        else:
            rows.append([t])
    merged = []
    for r in rows:
        m = scoring.TokenTree([], [], [], [])
        for t in r:
            o = len(m.ids)
            m.ids += t.ids
            m.parent += [p + o if p >= 0 else -1 for p in t.parent]
            m.depth += t.depth
            m.targets += [(e, ti, [n + o for n in nodes]) for e, ti, nodes in t.targets]
            m.paths += [[n + o for n in path] for path in t.paths]
        merged.append(m)
    out = [[None] * len(ep.turns) for ep in episodes]
    scoring.score_trees(model, merged, out, 1.0, next(model.parameters()).device)
    (-sum(x.sum() for turns in out for x in turns if x is not None) / n_tok).backward()
    return len(rows)


def main():
    from bound import record_forwards, replay_seconds

    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", "--model", dest="preset", default="tiny-1m",
                    help="a tiny preset (every weight trains) or another model (a LoRA on it), e.g. smollm2-135m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--row-tokens", type=int, default=1024, help="row width of the packed causal-LM step")
    args = ap.parse_args()
    tiny = args.preset in TINY_PRESETS
    model, tok = modeling.load_policy(modeling.ModelConfig(name_or_path=args.preset,
                                                       lora=modeling.LoraConfig(enabled=not tiny)))
    eps = [e.tokenized(tok) for e in traces(args.batch * 4)]
    batch = eps[:args.batch]
    n_tok = sum(sft.n_generated(e) for e in batch)
    trees = scoring.episode_trees(batch, None)
    ids, labels = packed_rows(trees, args.row_tokens)
    widths = sorted({max(len(t.ids) for t in trees), 2 * max(len(t.ids) for t in trees), args.row_tokens})
    chunk = 16384 if tiny else 1024
    with record_forwards(model) as shapes:
        sft.sequence_loss(model, batch, n_tok, chunk).backward()
    model.zero_grad()
    steps = {
        "sft_step": lambda: sft.sequence_loss(model, batch, n_tok, chunk).backward(),
        "matmul_bound": lambda: replay_seconds(model, shapes, backward="full" if tiny else "input"),
        "packed_lm": lambda: packed_lm_step(model, ids, labels),
        "packed_lm_head_at_targets": lambda: packed_lm_tight_step(model, ids, labels),
        "bare": lambda: bare_step(model, batch),
        **{f"packed_trees_{w}": (lambda w=w: packed_trees_step(model, batch, trees, w, n_tok)) for w in widths},
    }
    times = {k: [] for k in steps}
    for _ in range(args.reps):
        for k, step in steps.items():
            model.zero_grad()
            t0 = time.perf_counter()
            step()
            times[k].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    eos = engine.stop_ids(tok)
    for e in eps:
        sandbox.check_branches(e, e.branches(), tok, eos)
    mask_eps_s = len(eps) / (time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    figures = {f"tok_s_{k}": n_tok / v for k, v in med.items()}
    figures.update({
        "trained_tokens_per_step": n_tok, "tree_tokens": sum(len(t.ids) for t in trees),
        "tree_rows_padded_tokens": len(trees) * max(len(t.ids) for t in trees),
        "packed_lm_tokens": ids.numel(), "mask_build_and_check_episodes_s": mask_eps_s,
        "ratio_vs_bare": med["bare"] / med["sft_step"],
        "ratio_vs_packed_lm_tight": med["packed_lm_head_at_targets"] / med["sft_step"],
        "ratio_sft_vs_matmul_bound": med["matmul_bound"] / med["sft_step"],
        "ratio_vs_packed_lm": med["packed_lm"] / med["sft_step"],
    })
    for k, v in figures.items():
        print(f"{k:36s} {v:12.3f}")
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
