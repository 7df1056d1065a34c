"""The news world's tiny policies: a BPE tokenizer trained on the world and Llama models from presets.

    python -m newsworld.tiny --preset tiny-1m --out DIR [--seed S]

`modeling.resolve_model_path` builds a preset name (`tiny-1m`, ...) here on first
use, into out/models/NAME, so every script loads a tiny model through the same
from_pretrained path as a hub model. They are the fast test models and the
from-scratch CPU baseline; a real model (a preset of modeling.PRETRAINED_PRESETS
or a hub id) replaces them in every config.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import random
import re
from pathlib import Path

import sandbox
from factual_tools import common, textsplit
from factual_tools.settings import ConfigError
import newsworld

# ---------------------------------------------------------------------------
# The tiny policies: a news-world tokenizer and Llama-style models from presets
# ---------------------------------------------------------------------------
# No machine here reaches a model hub (DESIGN section 6), so the CPU default is
# a tokenizer trained on the built-in news world and a Llama model initialised
# from a preset, both written with save_pretrained: every script then loads them
# through the same from_pretrained path as a hub model.
#
# The tokenizer is byte-level BPE without a prefix space, so decoding token by
# token concatenates to the full decode (sandbox.token_bounds relies on it).
# Tool markup stays ordinary BPE text, as in real vocabularies; the corpus
# contains enough of it that `<search>` and `</search>` are a few tokens each.
# Only the chat markers are special tokens. `<|eot|>` ends a turn and is the
# eos token; padding is on the left, for batched generation.

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eot|>", "<|system|>", "<|user|>", "<|assistant|>")

# Each turn is `<|role|>content<|eot|>`; the generation prompt is `<|assistant|>`, so
# a completion is the assistant's text followed by `<|eot|>`. A system message is
# rendered as its marker alone: a tiny model is trained from scratch on the protocol
# and reads no instructions, and the tool description (87 of its tokens) was 40% of
# every news-world prompt, so of every training sequence and every prefill.
# Real chat models keep their own template and read the whole system prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'system' %}<|system|><|eot|>"
    "{% else %}<|{{ message['role'] }}|>{{ message['content'] }}<|eot|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

TOKENIZER_VOCAB = 3000     # DESIGN section 6 measured its tiny models with a 3k BPE
TOKENIZER_DOCS = 2000      # news-world documents the tokenizer is trained on
TOKENIZER_SEED = 1         # fixed: every preset and model seed shares one vocabulary
TINY_MAX_POSITIONS = 4096
TINY_MARKER = "tiny_model.json"
TINY_FORMAT = 2            # bump when the build changes, so old directories are rebuilt

# Llama shapes. tiny-1m is the CPU default (DESIGN section 6: the smallest preset
# is the one that learns within minutes on two cores); the larger ones use
# grouped-query attention as real Llama/Qwen models do, to exercise that path.
TINY_PRESETS: dict[str, dict[str, int]] = {
    "tiny-1m": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=4, intermediate_size=512),
    # a distillation student of tiny-1m (distill.py): half its width, the same depth
    "tiny-0.3m": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, intermediate_size=256),
    "tiny-8m": dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=2, intermediate_size=1024),
    "tiny-30m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=1792),
}


def _tokenizer_texts(n_docs: int, seed: int) -> list[str]:
    """News-world articles, their reference summaries, the chat prompt and tool markup.

    The markup strings are built from the documents the way traces use them: a
    summary sentence, a search (a regex on one of its phrases, or keywords), the
    results block, a delete and the rewrite.
    """
    rng = random.Random(seed)
    texts = [m["content"] for m in sandbox.prompt_messages("")]
    for doc in newsworld.documents(n_docs, seed):
        texts += [sandbox.prompt_messages(doc.text)[1]["content"], doc.summary]
        sentences = textsplit.split_sentences(doc.text) or [doc.text]
        claims = textsplit.split_sentences(doc.summary) or [doc.summary]
        claim = rng.choice(claims)
        words = claim.rstrip(".").split()
        start = rng.randrange(max(1, len(words) - 2))
        phrase = " ".join(words[start:start + rng.randint(2, 4)])
        if rng.random() < 0.5:
            query = "/" + re.escape(phrase) + "/" + rng.choice(["", "i"])
        else:
            query = " ".join(rng.sample(words, min(3, len(words))))
        hits = rng.sample(sentences, min(len(sentences), rng.randint(0, 3)))
        answer = sandbox.results_block(hits) if rng.random() < 0.9 else sandbox.error_block("no match")
        scope = rng.choice(["sentence", "clause"])
        texts.append(f"{claim}<search>{query}</search>{answer}<delete scope=\"{scope}\"/> {claim}")
    return texts


@functools.cache
def _tokenizer_json(vocab_size: int, n_docs: int, seed: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tokenizer_texts(n_docs, seed), trainer)
    return tok.to_str()


def tiny_tokenizer(vocab_size: int = TOKENIZER_VOCAB, n_docs: int = TOKENIZER_DOCS, seed: int = TOKENIZER_SEED):
    """The news-world BPE as a transformers fast tokenizer (trained once per process)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size, n_docs, seed)),
        bos_token="<|bos|>", eos_token="<|eot|>", pad_token="<|pad|>",
        extra_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        padding_side="left", clean_up_tokenization_spaces=False,
        model_max_length=TINY_MAX_POSITIONS, chat_template=CHAT_TEMPLATE)


def _tiny_spec(preset: str, seed: int) -> dict:
    """Everything a build depends on; a directory built from another spec is rebuilt."""
    if preset not in TINY_PRESETS:
        raise ConfigError(f"unknown tiny preset {preset!r}; choose one of {', '.join(TINY_PRESETS)}")
    return {"format": TINY_FORMAT, "preset": preset, "seed": seed, "shape": TINY_PRESETS[preset],
            "tokenizer": {"vocab_size": TOKENIZER_VOCAB, "n_docs": TOKENIZER_DOCS, "seed": TOKENIZER_SEED,
                          "world": newsworld.WORLD_VERSION}}


def build_tiny_model(preset: str, out_dir: str | os.PathLike, seed: int = 0, tokenizer=None) -> Path:
    """Write a freshly initialised tiny Llama and its tokenizer to `out_dir`; return the path.

    Same preset and seed give the same weights. `tokenizer` (default: the tiny
    tokenizer trained on the news world) sets the vocabulary, e.g. a distillation
    student's over its teacher's. A directory already built with the same preset,
    seed, tokenizer and build format is reused as it is (its `tiny_model.json`
    says so). The build happens in a temp directory moved into place at the end,
    so an interrupted build never leaves a half-written model.
    """
    spec = _tiny_spec(preset, seed)
    if tokenizer is not None:
        vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
        spec["tokenizer"] = {"vocab_sha256": hashlib.sha256(vocab.encode("utf-8")).hexdigest()}
    out = Path(out_dir)
    if common.built_before(out, TINY_MARKER, "spec", spec):
        return out

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tokenizer if tokenizer is not None else tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), max_position_embeddings=TINY_MAX_POSITIONS, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        attn_implementation="sdpa", **TINY_PRESETS[preset])
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream is left as it was
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    with common.atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        common.atomic_write_text(Path(tmp) / TINY_MARKER, json.dumps(
            {"spec": spec, "n_params": common.count_parameters(model), "vocab_size": len(tok)}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m newsworld.tiny", description="Build a tiny Llama policy and its "
                                     "news-world tokenizer (save_pretrained format).")
    parser.add_argument("--preset", choices=list(TINY_PRESETS), default="tiny-1m")
    parser.add_argument("--out", required=True, help="directory to write (reused if already built)")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.preset, args.out, args.seed)
    info = json.loads((path / TINY_MARKER).read_text(encoding="utf-8"))
    print(f"{args.preset} (seed {args.seed}): {info['n_params']:,} parameters, "
          f"vocabulary {info['vocab_size']} -> {path}")


if __name__ == "__main__":
    main()
