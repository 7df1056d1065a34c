"""Rollout throughput with tools, against plain decoding, HF `generate`, re-prefilling and the matmul bound.

    python bench/rollout.py [--presets tiny-1m tiny-8m] [--new-tokens 256] [--reps 3]
    python bench/rollout.py --model smollm2-135m [--reps 3] [--news-length]   # the real model's shapes

Tiny presets: 8 rows (2 news-world documents of 600-800 tokens x 4 rollouts),
each writing --new-tokens tokens. `--model`: 32 rows (4 news-world documents of
about 240 prompt tokens x G 8), 96 tokens each: an RL step's shape. Every row
has about four tool events (a regex search, a sentence delete, a BM25 search, a
clause delete), scripted through a logits processor so every backend writes
the same tokens:
- `plain`: a bare batched decode loop, no tools, HF's DynamicCache (what a
  generic loop costs: the limit);
- `generate` (with --model): HF `generate` on the same prompts, forced to write
  the same number of tokens, no tools;
- `hf`: the engine, ragged KV cache kept across tool calls;
- `hf_naive`: the engine re-prefilling every context after any tool event;
- `hf_no_tools`: the engine writing the same number of tokens with no tool
  event (so `ratio_vs_engine_no_tools` is the tools' own cost);
- `matmul_bound`: the linear layers of the engine's own forward passes, alone
  (bench/bound.py): `ratio_vs_matmul_bound` is how close the engine comes to it;
- with --model, where the CPU has native bf16 (or with --bf16), the engine under
  bf16 autocast beside fp32 (`ratio_bf16_vs_fp32`): what `autocast: auto` buys,
  and its own bound ratio (`bf16_ratio_vs_matmul_bound`, the products in bf16);
- with --model, the engine on the model with a rank-16 LoRA on every projection,
  its adapter folded into the weights while decoding (the engine's default on a
  CPU) against computed beside them (`lora_fold_speedup`);
- with --model, a profile: one more run with each part of the engine timed
  (`*_share_*`, fractions of its wall time): the linear layers (the bound's
  replay), attention over the ragged cache, the rest of the forward (norms,
  RoPE, embeddings, cache writes), sampling, the sandbox, the bench's own
  scripting processor, and the decode loop's Python (what no part covers);
- `--news-length`: the same with 4 documents of about 600 tokens (`@600`), the
  long task's prompt length, where attention over the prompt weighs more.
Throughput counts generated tokens; the results blocks the tools add are extra
work the tool runs do and the plain run does not. Targets: tiny presets
`ratio_vs_plain` >= 0.90 and `ratio_vs_naive` >= 5; --model `ratio_vs_generate`
>= 2 and `ratio_vs_matmul_bound` >= 0.70. Then scoring: forward+backward of
`episode_logprobs` on the hf episodes, one tree pass per episode vs one pass per
branch (target >= 1.5x, with equal log-probs). Repetitions are interleaved and
the median kept: the machine is shared and noisy. The last line is one JSON object.
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
from factual_tools import modeling  # noqa: E402
import newsworld  # noqa: E402
from factual_tools import engine, scoring  # noqa: E402
import sandbox  # noqa: E402
from factual_tools import textsplit  # noqa: E402


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
    ids = engine.ScriptedProcessor.ids_for(encode, text)
    while len(ids) < n_tokens:
        text += " " + filler
        ids = engine.ScriptedProcessor.ids_for(encode, text)
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
        tok, _ = engine.sample(logits, 0.0, 1.0, None)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        pos = pos + 1
        logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=pos, past_key_values=cache).logits[:, -1]
    return len(prompts) * group * n_new


def news_documents(n):
    """n news-world articles as they are (about 240 prompt tokens for SmolLM2): an RL step's documents."""
    return [(d.text, [d]) for d in newsworld.documents(n, seed=11)]


@torch.no_grad()
def generate_decode(model, tokenizer, docs, group, scripts, n_new):
    """HF `generate` on the same prompts, each row forced to write its script's first n_new ids."""
    from transformers import LogitsProcessor, LogitsProcessorList

    prompts = [sandbox.prompt_ids(tokenizer, d) for d, _ in docs for _ in range(group)]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), tokenizer.pad_token_id)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    forced = torch.tensor([scripts[i][:n_new] for i in range(len(prompts))])

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - width
            out = torch.full_like(scores, -float("inf"))
            out[torch.arange(len(out)), forced[:, step]] = 0.0
            return out

    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                         do_sample=False, logits_processor=LogitsProcessorList([Force()]),
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=None)
    return (out.shape[1] - width) * len(prompts)


def breakdown(secs, total: float, matmul: float) -> dict:
    """Shares of a profiled run's wall time (`engine.timed_parts`): the linear layers (the bound's replay), attention,
    the rest of the forward (norms, RoPE, embeddings, the cache's writes), sampling, the sandbox,
    the bench's scripting, and the Python of the decode loop (what no part covers)."""
    parts = {"matmul": matmul, "attention": secs["attention"],
             "forward_other": secs["forward"] - secs["attention"] - matmul,
             "sampling": secs["sampling"], "sandbox": secs["sandbox"], "script": secs["script (bench only)"]}
    parts["python_loop"] = total - secs["forward"] - sum(parts[k] for k in ("sampling", "sandbox", "script"))
    return {k: v / total for k, v in parts.items()}


def bench_engine(model_name, args, docs, group, n_new, real, *, name=None):
    """Figures of one model (keys start with `name`, default the model's): tiny presets on long
    documents, --model on an RL step's shape (`real`)."""
    from factual_tools import common
    from bound import record_forwards, replay_seconds

    name = name or model_name
    path = modeling.resolve_model_path(model_name)
    tok = modeling.load_tokenizer(path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()
    scripts = {}
    for d, (_, parts) in enumerate(docs):
        for g in range(group):
            scripts[d * group + g] = script_text(parts, d * group + g, tok, n_new)
    proc = engine.ScriptedProcessor(scripts)
    no_tools_scripts = {i: script_text(docs[i // group][1], i, tok, n_new, tools=False) for i in scripts}
    no_tools = engine.ScriptedProcessor(no_tools_scripts)
    texts = [t for t, _ in docs]

    def run(backend, processor=proc, bf16=False):
        cfg = engine.SamplingConfig(backend=backend, temperature=0.0, max_new_tokens=n_new, batch_size=len(scripts))
        with common.autocast(bf16, "cpu"):
            t0 = time.perf_counter()
            eps = engine.rollout(model, tok, texts, group, cfg, logits_processor=processor)
            dt = time.perf_counter() - t0
        gen = sum(len(t.ids) for e in eps for t in e.turns)
        inj = sum(len(t.inj_ids or []) for e in eps for t in e.turns)
        return gen / dt, eps, inj

    def plain():
        t0 = time.perf_counter()
        n = plain_decode(model, tok, docs, group, n_new)
        return n / (time.perf_counter() - t0)

    def generate():
        t0 = time.perf_counter()
        n = generate_decode(model, tok, docs, group, no_tools_scripts, n_new)
        return n / (time.perf_counter() - t0)

    bf16 = real and (args.bf16 or common.native_bf16("cpu")[0])
    res = {"plain": [], "hf": [], "hf_naive": [], "hf_no_tools": [], "bound": []}
    if real:
        res["generate"] = []
    if bf16:
        res["hf_bf16"] = []
    plain()
    run("hf")  # warm-up
    for _ in range(args.reps):
        res["plain"].append(plain())
        if real:
            res["generate"].append(generate())
        with record_forwards(model) as shapes:
            t0 = time.perf_counter()
            hf_rate, eps, inj = run("hf")
        res["hf"].append(hf_rate)
        gen = sum(len(t.ids) for e in eps for t in e.turns)
        res["bound"].append(gen / replay_seconds(model, shapes))  # tokens/s if only the products ran
        res["hf_naive"].append(run("hf_naive")[0])
        res["hf_no_tools"].append(run("hf", no_tools)[0])
        if bf16:
            res["hf_bf16"].append(run("hf", bf16=True)[0])
    events = sum(e.n_search + e.n_delete for e in eps) / len(eps)
    gen_total = sum(len(t.ids) for e in eps for t in e.turns)
    profile = {}
    if real:  # one more run, each part timed, in fp32 (and bf16): where the time goes
        for kind in ["fp32"] + (["bf16"] if bf16 else []):
            on = kind == "bf16"
            with engine.timed_parts() as secs, record_forwards(model) as shapes:
                t0 = time.perf_counter()
                run("hf", bf16=on)
                total = time.perf_counter() - t0
            matmul = replay_seconds(model, shapes, dtype=torch.bfloat16 if on else None)
            profile.update({f"{name}_{kind}_share_{k}": v for k, v in breakdown(secs, total, matmul).items()})
            if on:  # the same tokens, so the same products, as the timed bf16 runs
                profile[f"{name}_bf16_ratio_vs_matmul_bound"] = statistics.median(res["hf_bf16"]) * matmul / gen_total
    doc_tokens = [len(tok.encode(t, add_special_tokens=False)) for t in texts]

    # scoring: forward + backward over the same episodes, per branch vs one tree per episode
    # (a real model: 4 of them, every weight trainable, so its activations fit in memory)
    with_deletes = [e for e in eps if e.n_deleted][:4 if real else None]
    if with_deletes:
        scoring = score_trees_vs_branches(model, with_deletes, args.reps, name)
    else:
        scoring = {}
        print(f"{name}: no rollout deleted anything in {n_new} tokens, so tree and per-branch scoring are not "
              f"compared (raise --new-tokens)", file=sys.stderr)
    if real:  # last, since it puts an adapter on the model: what folding it in buys (engine.merged_adapters)
        profile.update(lora_fold(model, tok, texts, group, proc, n_new, reps=args.reps, name=name))
    med = {k: statistics.median(v) for k, v in res.items()}
    out = {
        f"{name}_tok_s_hf": med["hf"], f"{name}_tok_s_plain": med["plain"],
        f"{name}_tok_s_naive": med["hf_naive"],
        f"{name}_tok_s_engine_no_tools": med["hf_no_tools"],
        f"{name}_tok_s_matmul_bound": med["bound"],
        f"{name}_ratio_vs_plain": med["hf"] / med["plain"], f"{name}_ratio_vs_naive": med["hf"] / med["hf_naive"],
        # the tools' own cost: the same engine writing the same number of tokens without any tool event
        f"{name}_ratio_vs_engine_no_tools": med["hf"] / med["hf_no_tools"],
        f"{name}_ratio_vs_matmul_bound": med["hf"] / med["bound"],
        # counting the results blocks the engine had to read as well as what it wrote
        f"{name}_processed_ratio_vs_plain": med["hf"] * (1 + inj / max(1, gen_total)) / med["plain"],
        f"{name}_rows": len(eps), f"{name}_new_tokens": n_new,
        f"{name}_tool_events_per_rollout": events, f"{name}_injected_tokens_per_rollout": inj / len(eps),
        f"{name}_doc_tokens_min": min(doc_tokens), f"{name}_doc_tokens_max": max(doc_tokens),
        **scoring, **profile,
    }
    if real:
        out[f"{name}_tok_s_generate"] = med["generate"]
        out[f"{name}_ratio_vs_generate"] = med["hf"] / med["generate"]
    if bf16:
        out[f"{name}_tok_s_hf_bf16"] = med["hf_bf16"]
        out[f"{name}_ratio_bf16_vs_fp32"] = med["hf_bf16"] / med["hf"]
    return out


def lora_fold(model, tok, texts, group, proc, n_new, *, reps: int, name: str) -> dict:
    """The engine on `model` with a rank-16 LoRA on every projection (as configs/rl_smollm.yaml
    trains it; B drawn, so the adapter changes the model), its adapter folded into the
    weights while decoding (the engine's default on a CPU) against computed beside them."""
    import contextlib
    import peft

    lora = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                        task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    cfg = engine.SamplingConfig(backend="hf", temperature=0.0, max_new_tokens=n_new, batch_size=len(texts) * group)
    times = {"folded": [], "beside": []}
    saved = engine.merged_adapters
    try:
        for rep in range(reps + 1):  # the first round warms up
            for kind in times:
                engine.merged_adapters = saved if kind == "folded" else contextlib.nullcontext
                t0 = time.perf_counter()
                eps = engine.rollout(lora, tok, texts, group, cfg, logits_processor=proc)
                if rep:
                    times[kind].append(sum(len(t.ids) for e in eps for t in e.turns) / (time.perf_counter() - t0))
    finally:
        engine.merged_adapters = saved
    folded, beside = statistics.median(times["folded"]), statistics.median(times["beside"])
    return {f"{name}_tok_s_lora_folded": folded, f"{name}_tok_s_lora_beside": beside,
            f"{name}_lora_fold_speedup": folded / beside}


def score_trees_vs_branches(model, episodes, reps: int, name: str) -> dict:
    """Seconds to score `episodes` forward and backward one row per branch and one tree per
    episode (medians of `reps`), the speedup, and the largest log-prob difference."""
    times = {"branch": [], "tree": []}
    lps = {}
    for _ in range(reps):
        for method in ("branch", "tree"):
            model.zero_grad()
            t0 = time.perf_counter()
            out = scoring.episode_logprobs(model, episodes, method=method)
            loss = -sum(t.sum() for ep in out for t in ep)
            loss.backward()
            times[method].append(time.perf_counter() - t0)
            lps[method] = [t.detach() for ep in out for t in ep]
    diff = max((a - b).abs().max().item() for a, b in zip(lps["branch"], lps["tree"]))
    branch, tree = statistics.median(times["branch"]), statistics.median(times["tree"])
    return {f"{name}_score_branch_s": branch, f"{name}_score_tree_s": tree, f"{name}_score_speedup": branch / tree,
            f"{name}_score_max_abs_diff": diff}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="*", default=None, help="tiny presets on long documents (default: tiny-1m "
                    "tiny-8m, none when --model is given)")
    ap.add_argument("--model", action="append", default=[], help="a model on an RL step's shape, e.g. smollm2-135m")
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens per row for the tiny presets")
    ap.add_argument("--model-new-tokens", type=int, default=96, help="tokens per row for --model")
    ap.add_argument("--news-length", action="store_true", help="with --model, also 4 documents of about 600 "
                    "tokens (the long task's prompts)")
    ap.add_argument("--bf16", action="store_true", help="time bf16 autocast with --model even without native bf16")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    presets = args.presets if args.presets is not None else ([] if args.model else ["tiny-1m", "tiny-8m"])
    torch.manual_seed(0)
    figures = {}
    for preset in presets:
        tok = modeling.load_tokenizer(modeling.resolve_model_path(preset))
        figures.update(bench_engine(preset, args, long_documents(tok, 2), 4, args.new_tokens, real=False))
    for name in args.model:
        figures.update(bench_engine(name, args, news_documents(4), 8, args.model_new_tokens, real=True))
        if args.news_length:  # the long task's prompts: articles joined to about 600 tokens
            tok = modeling.load_tokenizer(modeling.resolve_model_path(name))
            figures.update(bench_engine(name, args, long_documents(tok, 4, 520, 620), 8, args.model_new_tokens,
                                        real=True, name=f"{name}@600"))
    if presets:  # the targets, on the least favourable preset
        for key in ("ratio_vs_plain", "ratio_vs_naive"):
            figures[key] = min(figures[f"{p}_{key}"] for p in presets)
    if args.model:
        labels = args.model + ([f"{m}@600" for m in args.model] if args.news_length else [])
        for key in ("ratio_vs_generate", "ratio_vs_matmul_bound", "bf16_ratio_vs_matmul_bound", "score_speedup"):
            values = [figures[f"{m}_{key}"] for m in labels if f"{m}_{key}" in figures]
            if values:
                figures[key] = min(values)
        figures["matmul_bound_target"] = 0.70
    for k, v in figures.items():
        print(f"{k:44s} {v:12.4f}")
    print(json.dumps({k: round(v, 4) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
