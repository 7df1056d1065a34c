"""The news world's features for the library (factual_tools/world.py), which imports this module
by name the first time a feature needs a world and never imports the world otherwise."""
from factual_tools.world import World
from newsworld import oracle, tiny, world

WORLD = World(
    name="newsworld",
    errors=oracle.oracle_errors,
    support=oracle.oracle_support,
    stated_facts=oracle.stated_facts,
    key_fact_coverage=oracle.key_fact_coverage,
    fact_precision=oracle.oracle_fact_precision,
    fact_score=oracle.oracle_fact_score,
    best_extract=oracle.best_extract,
    draft=oracle.draft,
    documents=world.documents,
    fresh_documents=world.fresh_documents,
    tiny_presets=tiny.TINY_PRESETS,
    build_tiny_model=tiny.build_tiny_model,
)
