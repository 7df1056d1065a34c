"""Rollout throughput with tools, against plain decoding and re-prefilling.

    python bench/rollout.py [--presets tiny-1m tiny-8m] [--new-tokens 256] [--reps 3]

For each tiny preset: 8 rows (2 news-world documents of 600-800 tokens x 4
rollouts), each writing --new-tokens tokens with about three tool events (a
regex search, a sentence delete, a BM25 search, a clause delete), scripted
through a logits processor so every backend writes the same tokens:
- `plain`: a bare batched decode loop, no tools, HF's DynamicCache (what a
  generic loop costs: the limit);
- `hf`: the engine, ragged KV cache kept across tool calls;
- `hf_naive`: the engine re-prefilling every context after any tool event;
- `hf_no_tools`: the engine writing the same number of tokens with no tool
  event (so `ratio_vs_engine_no_tools` is the tools' own cost, apart from the
  cache the engine uses and the plain loop does not).
Throughput counts generated tokens; the results blocks the tools add are extra
work the tool runs do and the plain run does not. Targets: `ratio_vs_plain` >=
0.90 and `ratio_vs_naive` >= 5, printed last for the least favourable preset.
Then scoring: forward+backward of `episode_logprobs` on the
hf episodes, one tree pass per episode vs one pass per branch (target >= 1.5x,
with equal log-probs). Repetitions are interleaved and the median kept: the
machine is shared and noisy. The last line is one JSON object.
"""
import argparse
import json
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import modeling  # noqa: E402
import newsworld  # noqa: E402
import rollout as R  # noqa: E402
import sandbox  # noqa: E402
import textsplit  # noqa: E402


def long_documents(tokenizer, n, lo=600, hi=800):
    """News-world articles joined until each document has lo..hi tokens."""
    docs, parts, i = [], [], 0
    world = newsworld.documents(10_000, seed=11)
    while len(docs) < n:
        d = next(world)
        i += 1
        parts.append(d)
        text = "\n\n".join(p.text for p in parts)
        k = len(tokenizer.encode(text, add_special_tokens=False))
        if k >= lo:
            if k <= hi:
                docs.append((text, parts))
            parts = []
    return docs


def script_text(parts, row, tokenizer, n_tokens, tools=True):
    """About three tool events, at a row-dependent place, padded with the
    article's own sentences to n_tokens (`tools=False`: the same text, no events)."""
    ref = textsplit.split_sentences(" ".join(p.summary for p in parts))
    index = sandbox.DocIndex("\n\n".join(p.text for p in parts))
    lead = " ".join(ref[: 1 + row % 3])
    first = ref[0]
    key = re.escape(" ".join(first.split()[:3]))
    events = (f" {first.replace('.', ', reportedly.', 1)}<search>/{key}/</search><delete scope=\"sentence\"/>"
              f" {first} {ref[1] if len(ref) > 1 else first}<search>{' '.join(textsplit.words(first)[:4])}</search>"
              f" {ref[-1][:-1]}, as expected by most analysts<delete scope=\"clause\"/> at last.")
    filler = " ".join(index.sentences)
    text = lead + (events if tools else "") + " " + filler
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    ids = R.ScriptedProcessor.ids_for(encode, text)
    while len(ids) < n_tokens:
        text += " " + filler
        ids = R.ScriptedProcessor.ids_for(encode, text)
    return ids[:n_tokens]


@torch.no_grad()
def plain_decode(model, tokenizer, docs, group, n_new):
    """The limit: prefill each prompt once, expand to the group, decode n_new greedy tokens."""
    from transformers import DynamicCache

    prompts = [sandbox.prompt_ids(tokenizer, d) for d, _ in docs]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]
    cache.batch_repeat_interleave(group)
    mask, logits, pos = mask.repeat_interleave(group, 0), logits.repeat_interleave(group, 0), pos[:, -1:]
    pos = pos.repeat_interleave(group, 0)
    for _ in range(n_new):
        tok, _ = R.sample(logits, 0.0, 1.0, None)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        pos = pos + 1
        logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]
    return len(prompts) * group * n_new


def bench_preset(preset, args):
    path = modeling.resolve_model_path(preset)
    tok = modeling.load_tokenizer(path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    docs = long_documents(tok, 2)
    group = 4
    scripts = {}
    for d, (_, parts) in enumerate(docs):
        for g in range(group):
            scripts[d * group + g] = script_text(parts, d * group + g, tok, args.new_tokens)
    proc = R.ScriptedProcessor(scripts)
    no_tools = R.ScriptedProcessor({i: script_text(docs[i // group][1], i, tok, args.new_tokens, tools=False)
                                    for i in scripts})
    texts = [t for t, _ in docs]

    def run(backend, processor=proc):
        cfg = R.SamplingConfig(backend=backend, temperature=0.0, max_new_tokens=args.new_tokens)
        t0 = time.perf_counter()
        eps = R.rollout(model, tok, texts, group, cfg, logits_processor=processor)
        dt = time.perf_counter() - t0
        gen = sum(len(t.ids) for e in eps for t in e.turns)
        inj = sum(len(t.inj_ids or []) for e in eps for t in e.turns)
        return gen / dt, eps, inj

    def plain():
        t0 = time.perf_counter()
        n = plain_decode(model, tok, docs, group, args.new_tokens)
        return n / (time.perf_counter() - t0)

    res = {"plain": [], "hf": [], "hf_naive": [], "hf_no_tools": []}
    plain()
    run("hf")  # warm-up
    for _ in range(args.reps):
        res["plain"].append(plain())
        hf_rate, eps, inj = run("hf")
        res["hf"].append(hf_rate)
        res["hf_naive"].append(run("hf_naive")[0])
        res["hf_no_tools"].append(run("hf", no_tools)[0])
    events = sum(e.n_search + e.n_delete for e in eps) / len(eps)
    gen_total = sum(len(t.ids) for e in eps for t in e.turns)
    doc_tokens = [len(tok.encode(t, add_special_tokens=False)) for t in texts]

    # scoring: forward + backward over the same episodes, per branch vs one tree per episode
    with_deletes = [e for e in eps if e.n_deleted]
    times = {"branch": [], "tree": []}
    lps = {}
    for _ in range(args.reps):
        for method in ("branch", "tree"):
            model.zero_grad()
            t0 = time.perf_counter()
            out = R.episode_logprobs(model, with_deletes, method=method)
            loss = -sum(t.sum() for ep in out for t in ep)
            loss.backward()
            times[method].append(time.perf_counter() - t0)
            lps[method] = [t.detach() for ep in out for t in ep]
    diff = max((a - b).abs().max().item() for a, b in zip(lps["branch"], lps["tree"]))
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        f"{preset}_tok_s_hf": med["hf"], f"{preset}_tok_s_plain": med["plain"],
        f"{preset}_tok_s_naive": med["hf_naive"],
        f"{preset}_tok_s_engine_no_tools": med["hf_no_tools"],
        f"{preset}_ratio_vs_plain": med["hf"] / med["plain"], f"{preset}_ratio_vs_naive": med["hf"] / med["hf_naive"],
        # the tools' own cost: the same engine writing the same number of tokens without any tool event
        f"{preset}_ratio_vs_engine_no_tools": med["hf"] / med["hf_no_tools"],
        # counting the results blocks the engine had to read as well as what it wrote
        f"{preset}_processed_ratio_vs_plain": med["hf"] * (1 + inj / max(1, gen_total)) / med["plain"],
        f"{preset}_tool_events_per_rollout": events, f"{preset}_injected_tokens_per_rollout": inj / len(eps),
        f"{preset}_doc_tokens_min": min(doc_tokens), f"{preset}_doc_tokens_max": max(doc_tokens),
        f"{preset}_score_branch_s": statistics.median(times["branch"]),
        f"{preset}_score_tree_s": statistics.median(times["tree"]),
        f"{preset}_score_speedup": statistics.median(times["branch"]) / statistics.median(times["tree"]),
        f"{preset}_score_max_abs_diff": diff,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["tiny-1m", "tiny-8m"])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    figures = {}
    for preset in args.presets:
        figures.update(bench_preset(preset, args))
    for key in ("ratio_vs_plain", "ratio_vs_naive"):  # the targets, on the least favourable preset
        figures[key] = min(figures[f"{p}_{key}"] for p in args.presets)
    for k, v in figures.items():
        print(f"{k:40s} {v:12.4f}")
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
