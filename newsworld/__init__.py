"""The built-in news world: synthetic news articles whose facts are known, so every
stage of the pipeline runs, and is checked, on a CPU with no data to download.

    python -m newsworld generate --n 1000 --seed 0 --out out/newsworld/docs.jsonl
    python -m newsworld stats out/newsworld/docs.jsonl

- `world.py`: the seeded generator (ten event families, a fact table per article,
  reference summaries); article i depends only on (seed, i).
- `vocab.py`: its names, values and family building blocks.
- `oracle.py`: checks any summary against the fact table (the evaluation's ground
  truth, the `oracle` reward and teacher) and drafts summaries with labelled errors.
- `oracle_server.py`: the oracle behind an OpenAI-style chat endpoint, a stand-in
  teacher for the API path.
- `tiny.py`: a BPE tokenizer trained on the world and tiny Llama presets (tiny-1m, ...).
- `__main__.py`: the command line above.

- `hooks.py`: the world's features as the library asks for them (`factual_tools.world`).

The world is built on the library: it imports the root's `data` and `sandbox` and
factual_tools' text modules (`textsplit`, `claims`, `common`). The library and the
shared root modules never import it: they ask `factual_tools.world`, which loads
`hooks.py` by name when a world feature (a tiny preset, the oracle backend, a
generated corpus) is first asked for. A fork with its own data deletes this folder
and the configs that name the world; a world feature then names itself in an error.
"""
from newsworld.vocab import WORLD_VERSION, money
from newsworld.world import FAMILIES, LONG_SPLIT_THRESHOLD, TASKS, documents, fresh_documents, world_document

__all__ = ["FAMILIES", "LONG_SPLIT_THRESHOLD", "TASKS", "WORLD_VERSION", "documents", "fresh_documents", "money", "world_document"]
