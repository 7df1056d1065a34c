"""Small fixtures shared by tests: a byte-level BPE tokenizer trained in memory,
tiny models, and a kill at the worst moment of a run."""
import contextlib
import functools
import json
import time

DOC = (
    "Acme Corp. reported revenue of $4.2 billion on March 3, 2024, up 12% from a year earlier. "
    "Chief executive Jane K. Doe said the U.S. market drove growth. "
    "Mr. Smith, the finance chief, disagreed. He said costs rose by $300 million. "
    "Shares fell 3.5% in New York. Rival Globex reported revenue of $3.1 billion. "
    "The company employs 3,400 people in 12 countries. aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!"
)

_CORPUS = [
    DOC,
    'Acme reported revenue of $5 billion.<search>/revenue of/</search><results><0>x</0></results>'
    '<delete scope="sentence"/> Acme reported revenue of $4.2 billion.',
    'Jane Doe said growth came from Europe, not Asia<delete scope="clause"/> from the U.S. market.',
    "<search>Jane Doe growth</search><results><error>empty query</error></results>",
]


@functools.lru_cache(maxsize=None)
def bpe_tokenizer(vocab_size: int = 400):
    """A byte-level BPE (GPT-2 style pre-tokeniser) with merges across markup, so
    tokens straddle text/markup boundaries (".<", "/>") as real vocabularies do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|eot|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eot|>", pad_token="<|pad|>")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


def tiny_llama(tokenizer, seed: int = 0, hidden: int = 64, layers: int = 2, dropout: float = 0.0):
    """A randomly initialised Llama over `tokenizer`'s vocabulary (sdpa attention)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, attention_dropout=dropout)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def script_ids(tokenizer, written: str, eos: bool = True) -> list[int]:
    """Ids a policy could sample to write `written`, end-of-turn appended."""
    from factual_tools import engine

    ids = engine.ScriptedProcessor.ids_for(lambda s: tokenizer.encode(s, add_special_tokens=False), written)
    return ids + ([tokenizer.eos_token_id] if eos else [])


def newsworld_traces(n: int, seed: int = 0, search_only: float = 0.25):
    """Text-only corrective traces from the news world's faulty drafter: each
    wrong sentence is followed by a regex search for its support, a sentence
    delete and the correction; some correct sentences get a search only."""
    import random

    import newsworld
    from newsworld import oracle
    import sandbox
    from factual_tools import textsplit

    rng = random.Random(seed)
    out = []
    for doc in newsworld.documents(n, seed=seed):
        text, labels = oracle.draft(doc, rng)
        by_sentence = {lab["sentence_index"]: lab for lab in labels}
        parts = []
        for i, sent in enumerate(textsplit.split_sentences(text)):
            lab = by_sentence.get(i)
            lead = " " if parts else ""
            if lab:
                parts.append(f'{lead}{sent}<search>/({lab["regex_key"]})/</search><delete scope="sentence"/> '
                             f'{lab["corrected_clause"]}')
            elif rng.random() < search_only:
                words = " ".join(textsplit.words(sent)[:4])
                parts.append(f"{lead}{sent}<search>{words}</search>")
            else:
                parts.append(lead + sent)
        ep = sandbox.replay(doc.text, "".join(parts))
        ep.doc_id = doc.id
        out.append(ep)
    return out


def save_tiny_policy(path, tokenizer, **kw) -> str:
    """A random tiny Llama (`tiny_llama` arguments) and its tokenizer saved like any model."""
    tiny_llama(tokenizer, **{"hidden": 32, "layers": 1, **kw}).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@contextlib.contextmanager
def killed_after_checkpoint(monkeypatch, step: int):
    """Inside the block, `common.save_checkpoint` raises KeyboardInterrupt right
    after it has written `step`'s checkpoint: a kill between two steps."""
    from factual_tools import common

    real_save = common.save_checkpoint

    def save_then_die(run_dir, at, *a, **k):
        path = real_save(run_dir, at, *a, **k)
        if at == step:
            raise KeyboardInterrupt("killed")
        return path

    monkeypatch.setattr(common, "save_checkpoint", save_then_die)
    try:
        yield
    finally:
        monkeypatch.setattr(common, "save_checkpoint", real_save)


# configs/ file-name prefix -> the script whose Config loads it. The longest prefix wins.
SCRIPT_FOR_PREFIX = {
    "sft_": "sft", "base_": "sft", "drgrpo_": "rl", "tiny": "rl", "rl_": "rl", "synth_": "synth_traces",
    "filter_": "filter_traces", "eval_": "eval", "distill_": "distill", "ablation_": "rl",
    "rejection_": "sft", "teacher_sft_": "sft", "kto_": "sft", "teacher_": "teacher_episodes",
    "monitor": "monitor",
}


def script_for(filename: str) -> str | None:
    matches = [p for p in SCRIPT_FOR_PREFIX if filename.startswith(p)]
    return SCRIPT_FOR_PREFIX[max(matches, key=len)] if matches else None


def load_config_file(path):
    """A configs/*.yaml file loaded by the Config of the script it belongs to."""
    import importlib
    import os

    from factual_tools import settings

    module = importlib.import_module(script_for(os.path.basename(path)))
    return settings.load_config(module.Config, ["--config", str(path)])


def post_server(answer):
    """A stand-in HTTP endpoint on 127.0.0.1, in a daemon thread: every POST's JSON
    body goes to `answer(body) -> (status, reply)`, the reply a dict (sent as JSON) or
    bytes. Returns (its /v1 URL, the server: call .shutdown())."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            status, reply = answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
            self.send_response(status)
            if not isinstance(reply, bytes):
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}/v1", httpd


def wandb_history(run_dir) -> list[dict]:
    """The history rows ({key: value}) of the offline W&B run in `run_dir`. wandb writes
    the LevelDB log format: a 7-byte file header, then 32 KiB blocks of chunks, each
    with a 7-byte header (crc32, little-endian length, type: 1 full, 2 first, 3 middle,
    4 last) around a serialised `wandb_internal_pb2.Record`. A record still being written
    (its chunk runs past the file's end) is left out; the caller polls until it lands."""
    import glob
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for path in sorted(glob.glob(f"{run_dir}/wandb/offline-run-*/run-*.wandb")):  # a resumed run adds one
        data = open(path, "rb").read()
        pos, block, record = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
            if kind == 0 or pos + 7 + length > len(data):  # wandb's service is still writing this chunk
                break
            record += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):
                rec = pb.Record()
                rec.ParseFromString(record)
                record = b""
                if rec.WhichOneof("record_type") == "history":
                    rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                 for i in rec.history.item})
    return rows


def offline_trackers(monkeypatch):
    """The LogConfig of a run writing TensorBoard events and an offline W&B run."""
    from factual_tools import common

    for k, v in (("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_CONSOLE", "off")):
        monkeypatch.setenv(k, v)
    return common.LogConfig(tensorboard=True, wandb_project="tests")


def assert_trackers_match_metrics(run_dir, keys=("loss",)) -> None:
    """TensorBoard's events and the W&B run hold the same `keys` per step as metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from factual_tools import common

    metrics = common.read_metrics(f"{run_dir}/metrics.jsonl")
    tb = EventAccumulator(f"{run_dir}/tb")
    tb.Reload()
    wants = {k: {r["step"]: r[k] for r in metrics if isinstance(r.get(k), (int, float))} for k in keys}
    deadline = time.monotonic() + 60  # wandb's service process may still be writing the run after finish()
    while True:
        wb = {(r["_step"], k): v for r in wandb_history(run_dir) for k, v in r.items()}
        if all((s, k) in wb for k, want in wants.items() for s in want) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for k, want in wants.items():
        assert want, f"no {k} in metrics.jsonl"
        got = {e.step: e.value for e in tb.Scalars(k)}
        assert got.keys() == want.keys() and all(abs(got[s] - v) < 1e-5 * max(1, abs(v)) for s, v in want.items())
        assert all(abs(wb[(s, k)] - v) < 1e-9 * max(1, abs(v)) for s, v in want.items())
