"""Plant one-line bugs in the training core and check that the suite catches each.

    python tests/mutants.py                 # every mutant (about 10 minutes on two cores)
    python tests/mutants.py --only loss     # mutants whose name contains "loss"
    python tests/mutants.py --list

Each mutant is one exact text replacement in one file and the test files that
should catch it. The repository's tracked files are copied to a temporary
directory once; every mutant is applied there, its tests run with `pytest -x`,
and the file is restored, so the working tree is never touched. A mutant is
caught when its tests fail; the first failing test is reported. The script exits
1 if any mutant survives, or if the unmutated tests do not pass to begin with.

Add a mutant whenever a bug slips past the suite: the list is the record of
what the tests are known to guard.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RL, SANDBOX, SFT, DATA = "tests/test_rl.py", "tests/test_sandbox.py", "tests/test_sft.py", "tests/test_data.py"
GRAD = "tests/test_rl.py::test_the_update_is_the_gradient_of_the_hand_computed_dr_grpo_loss"
DIST = "tests/test_distributed.py"
BLOCKS = "tests/test_rollout.py::test_block_attention_scores_and_trains_as_the_dense_mask"
PREFIX = "tests/test_rollout.py::test_prefix_attention_scores_and_trains_as_the_dense_mask"
WIDTHS = "tests/test_rollout.py::test_a_prefill_of_unequal_prompts_splits_by_length_and_changes_nothing"

# (name, file, old text, new text, tests that should catch it)
MUTANTS = [
    ("loss: token mean instead of Dr. GRPO's constant", "rl.py",
     "return tok_loss.sum() / (n_rollouts * max_new_tokens), kl, clipped",
     "return tok_loss.sum() / max(1, tok_loss.numel()), kl, clipped", [RL]),
    ("loss: per-sequence mean (GRPO's length normaliser)", "rl.py",
     "                out += [a] * n\n",
     "                out += [a / sum(len(u.ids) for u in ep.turns)] * n\n", [RL]),
    ("advantages: scaled by the group's std (GRPO)", "rl.py",
     "return (r - r.mean(1, keepdim=True)).flatten().tolist()",
     "return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).flatten().tolist()", [RL]),
    ("advantages: not centred on the group mean", "rl.py",
     "return (r - r.mean(1, keepdim=True)).flatten().tolist()", "return r.flatten().tolist()", [RL]),
    ("rl.main ignores advantage=turn", "rl.py",
     "turn_adv = turn_advantages(eps, results, G, cfg.advantage, cfg.turn_credit, cfg.reward.tools.w_match)",
     'turn_adv = turn_advantages(eps, results, G, "outcome", cfg.turn_credit, cfg.reward.tools.w_match)', [GRAD]),
    ("data parallel: Dr. GRPO's constant counts the rank's rollouts, not the step's", "rl.py",
     "upd = update(trainer, batches, len(step_figures))", "upd = update(trainer, batches, len(eps))", [DIST]),
    ("data parallel: gradients not summed across ranks (RL's and SFT's step)", "factual_tools/training.py",
     "    dist.reduce_grads(params)  # every rank now holds the whole step's gradient\n", "", [DIST]),
    ("data parallel: a resumed rank takes rank 0's sampler state", "factual_tools/common.py",
     'set_rng_state(trainer["rng_ranks"][dist.rank] if "rng_ranks" in trainer else trainer["rng"], generators)',
     'set_rng_state(trainer["rng"], generators)', [DIST]),
    ("RL trains on every document, eval pool included", "factual_tools/training.py",
     'train = data.pool_documents(docs, manifest, "train", cfg.split)', "train = list(docs)", [RL]),
    ("truncated importance sampling off", "rl.py",
     'is_w = torch.exp(b.old_logprobs - b.sampler_logprobs).clamp(max=cfg.tis_cap).nan_to_num(1.0)', "is_w = None", [RL]),
    ("truncated importance sampling without its cap", "rl.py",
     'is_w = torch.exp(b.old_logprobs - b.sampler_logprobs).clamp(max=cfg.tis_cap).nan_to_num(1.0)',
     'is_w = torch.exp(b.old_logprobs - b.sampler_logprobs).nan_to_num(1.0)', [GRAD]),
    ("KL reference of a full fine-tune: the current weights", "rl.py",
     "b.ref_logprobs = logprobs(trainer.model if trainer.lora else trainer.ref_copy, mb, cfg,",
     "b.ref_logprobs = logprobs(trainer.model, mb, cfg,", [RL]),
    ("SFT trains the retracted tokens", "sandbox.py",
     "masked = set(t.masked or ()) if mask_retracted else ()", "masked = ()", [SFT]),
    ("regex time limit tripled", "sandbox.py",
     "length_fn: Callable[[str], int] | None = None, regex_timeout_s: float = 0.05,",
     "length_fn: Callable[[str], int] | None = None, regex_timeout_s: float = 0.15,", [SANDBOX]),
    ("regex time limit removed", "sandbox.py",
     "found = rx.search(s, timeout=remaining)", "found = rx.search(s)", [SANDBOX]),
    ("split: a document changed since the split is still taken", "data.py",
     'if content_hash(d.text) != entries[d.id]["sha256"]:', "if False:", [DATA]),
    ("tree blocks: a block reads every column it gathered, masked or not", "factual_tools/scoring.py",
     "attn_mask=part.mask, dropout_p=dropout,", "attn_mask=None, dropout_p=dropout,", [BLOCKS]),
    ("tree blocks: the parts' outputs left in part order", "factual_tools/scoring.py",
     "out = torch.cat(outs)[blocks.order]", "out = torch.cat(outs)", [BLOCKS]),
    ("prefix chunks: a chunk reads only its own keys, not the prefix before it", "factual_tools/scoring.py",
     "query[:, :, s:e], key[:, :, :e], value[:, :, :e],", "query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],",
     [PREFIX]),
    ("width groups: a split forward's logits land on the wrong rows", "factual_tools/engine.py",
     "out[torch.tensor(part, device=self.dev)] = logits", "out[torch.tensor(sorted(part)[::-1], device=self.dev)] = logits",
     [WIDTHS]),
    ("shared prompts: rows kept in another order read the last forward's grid", "factual_tools/engine.py",
     "[self.base[i] for i in keep]\n        self.arranged = None\n", "[self.base[i] for i in keep]\n",
     ["tests/test_rollout.py::test_the_shared_prompt_grid_is_arranged_again_after_the_rows_change"]),
    ("shared prompts: a full grid of rows out of document order attends without its gather",
     "factual_tools/engine.py",
     "self.in_order = self.grid_docs is None and grid.flatten().tolist() == list(range(len(rows)))",
     "self.in_order = grid.numel() == len(rows)",
     ["tests/test_rollout.py::test_shared_prompt_attention_equals_attention_over_each_rows_whole_context"]),
    ("rollouts: decoding records an autograd graph", "factual_tools/engine.py",
     "@torch.no_grad()\ndef rollout(", "def rollout(",
     ["tests/test_rollout.py::test_rollouts_record_no_autograd_graph"]),
    ("folded adapters: the original weights are not put back after decoding", "factual_tools/engine.py",
     "        for base, weight in saved:\n            base.weight = weight\n", "        saved.clear()\n",
     ["tests/test_rollout.py::test_a_lora_policy_decodes_with_its_adapter_folded_in_and_gets_its_weights_back"]),
]


def copy_tree(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, dst / f)


def run_tests(cwd: Path, tests: list[str], timeout_s: int) -> tuple[int, str]:
    # every test of the files, the slow tier too (pytest.ini deselects it by default)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
           f"--timeout={timeout_s}", *tests]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    return proc.returncode, proc.stdout + proc.stderr


def first_failure(output: str) -> str:
    m = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    return m.group(1) if m else "(no test named: " + output.strip().splitlines()[-1][:80] + ")"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="run the mutants whose name contains this text")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--timeout", type=int, default=120, help="per-test limit in seconds (a hang counts as caught)")
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if args.only.lower() in m[0].lower()]
    if args.list:
        for name, path, *_ in chosen:
            print(f"{name}  ({path})")
        return 0
    if not chosen:
        print(f"no mutant matches {args.only!r}")
        return 1
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        work = Path(tmp)
        copy_tree(work)
        for name, path, old, _, _ in chosen:  # a stale mutant is an error, not a pass
            n = (work / path).read_text(encoding="utf-8").count(old)
            if n != 1:
                print(f"mutant {name!r}: its text occurs {n} times in {path} (must be once); update tests/mutants.py")
                return 1
        baseline = sorted({t for *_, tests in chosen for t in tests})
        rc, out = run_tests(work, baseline, args.timeout)
        if rc != 0:
            print(f"the unmutated tests fail ({first_failure(out)}): fix them first")
            return 1
        rows, survived = [], 0
        for name, path, old, new, tests in chosen:
            original = (work / path).read_text(encoding="utf-8")
            (work / path).write_text(original.replace(old, new), encoding="utf-8")
            t0 = time.perf_counter()
            try:
                rc, out = run_tests(work, tests, args.timeout)
            finally:
                (work / path).write_text(original, encoding="utf-8")
            caught = rc != 0
            survived += not caught
            rows.append((name, first_failure(out) if caught else "SURVIVED", time.perf_counter() - t0))
            print(f"{'caught  ' if caught else 'SURVIVED'} {name} ({rows[-1][2]:.0f}s)", flush=True)
    print("\n| mutation | caught by | s |\n|---|---|---|")
    for name, by, s in rows:
        print(f"| {name} | {by} | {s:.0f} |")
    print(f"\n{len(rows) - survived} of {len(rows)} caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
