"""SFT step overhead: our deletion-aware step against a bare forward+backward.

    python bench/sft.py [--preset tiny-1m] [--batch 16] [--reps 5]

- `sft_step`: what sft.py does per micro-batch: build each episode's tree of
  branches, score it (`rollout.episode_logprobs`, output head only where a
  generated token is predicted), backward.
- `bare`: a plain causal-LM forward+backward on the same episodes' branches,
  padded, with HF `labels` masking everything but the generated ids: what a
  generic SFT trainer would run on these sequences.
Throughput counts trained (generated) tokens; the ratio is sft_step / bare
(target >= 0.9). Also: episodes/s of building branches and validating their
masks. Repetitions interleaved, medians kept. The last line is one JSON object.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import modeling  # noqa: E402
import newsworld  # noqa: E402
import oracle  # noqa: E402
import rollout  # noqa: E402
import sandbox  # noqa: E402
import textsplit  # noqa: E402
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-1m")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model, tok = modeling.load_policy(modeling.ModelConfig(name_or_path=args.preset,
                                                       lora=modeling.LoraConfig(enabled=False)))
    eps = [e.tokenized(tok) for e in traces(args.batch * 4)]
    n_tok = sum(sft.n_generated(e) for e in eps[:args.batch])
    times = {"sft_step": [], "bare": []}
    batch = eps[:args.batch]
    for _ in range(args.reps):
        model.zero_grad()
        t0 = time.perf_counter()
        sft.sequence_loss(model, batch, n_tok).backward()
        times["sft_step"].append(time.perf_counter() - t0)
        model.zero_grad()
        t0 = time.perf_counter()
        bare_step(model, batch)
        times["bare"].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    eos = rollout.stop_ids(tok)
    for e in eps:
        sandbox.check_branches(e, e.branches(), tok, eos)
    mask_eps_s = len(eps) / (time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    figures = {
        "tok_s_sft_step": n_tok / med["sft_step"], "tok_s_bare": n_tok / med["bare"],
        "overhead_ratio": med["bare"] / med["sft_step"], "trained_tokens_per_step": n_tok,
        "mask_build_and_check_episodes_s": mask_eps_s,
    }
    for k, v in figures.items():
        print(f"{k:34s} {v:12.3f}")
    print(json.dumps({k: round(v, 3) for k, v in figures.items()}))


if __name__ == "__main__":
    main()
