"""The library the scripts at the repository root share.

Lower modules first (a module imports only those above it in this list, and the
root's shared modules `sandbox`, `data` and `rewards` where they sit between):
- `settings.py`: typed configs from YAML and key=value overrides, with clear errors.
- `world.py`: what the library asks of a document world whose facts are known.
- `textsplit.py`: sentence and clause splitting.
- `common.py`: run directories, logging, checkpoints, seeds, devices, autocast.
- `claims.py`: what a summary states (names, numbers, dates) and what supports it.
- `modeling.py`: model presets, policy loading (HF + PEFT, bitsandbytes, Unsloth, vLLM).
- `fenice.py`: the FENICE factuality metric (claims + NLI over document sentences).
- `vram.py`: memory estimates before a GPU run (`python -m factual_tools.vram ...`).
- `engine.py`: generation with the tool sandbox in the loop (the rollout backends).
- `scoring.py`: the log-probs of generated tokens under their own contexts (token trees).
- `factcheck.py`: the learned factuality scorer (`python -m factual_tools.factcheck ...`).
- `teachers.py`, `traces.py`: fact-checking teachers and tool-use traces from drafts.
- `evaluation.py`, `training.py`: what the evaluation and training scripts share.
"""
