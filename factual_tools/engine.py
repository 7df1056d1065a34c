"""The rollout engine: a policy writes summaries while the sandbox answers its tool calls.

Backends, one protocol (`sandbox.EpisodeBuilder` decides every stop, result and
pruning; the backends only keep their model context equal to the builder's):

- `hf` (reference and CPU path): batched sampling with the KV cache kept across
  tool calls, in a ragged cache (`_RaggedCache`): row i holds its context in
  slots [0, len_i), slot = RoPE position, so a results block is appended to its
  row only and a delete just shortens its row, with no holes to mask or compact.
  All rows take their next id in one batched step; the rest of a longer chunk
  (results, a pruned tail) goes in a second forward of those rows only. Finished
  rows leave the batch. Rollouts share their document's prompt: it is prefilled
  once per document and kept once per group, each row holding only what it
  writes after it (the engine's own attention reads the prompt once for the G
  rows, with grouped KV heads read in place; see "Attention" below).
- `hf_naive`: the same protocol, re-prefilling every row's whole context after
  any tool event (what calling `generate` again after each call costs). The
  oracle for tests and the baseline of `bench/rollout.py`.
- `vllm` (GPU): multi-turn requests on token ids; prefix caching makes the
  resubmitted context cheap, a delete is a resubmission of the pruned context.
- `api`: an OpenAI-compatible server (teachers), text only; episodes are
  tokenised canonically later (`Episode.tokenized`).

Training scores what the engine wrote in factual_tools/scoring.py.

Rollouts always run under `model.eval()` and `torch.no_grad()`: dropout left on
during rollouts is a classic RL-trainer bug (the sampled data is then off-policy).
"""
from __future__ import annotations

import collections
import json
import math
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

import sandbox


@dataclass
class SamplingConfig:
    backend: Literal["hf", "hf_naive", "vllm", "api"] = "hf"
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    max_new_tokens: int = 256  # generated tokens per episode, all turns together
    max_context_tokens: int = 4096  # a row whose context would pass this ends, truncated
    batch_size: int = 64  # rows decoded together (documents x group size); larger inputs are chunked
    seed: int = 0
    # api backend
    api_base: str = "http://127.0.0.1:8000/v1"
    api_model: str = ""
    api_key_env: str = "OPENAI_API_KEY"  # name of the environment variable holding the key
    api_mode: Literal["completions", "chat"] = "completions"
    api_timeout_s: float = 60.0
    api_retries: int = 5
    api_concurrency: int = 8


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def make_generator(seed: int, device: torch.device | str | torch.nn.Module = "cpu") -> torch.Generator:
    """A seeded sampling generator on `device` (or a model's device): torch draws
    with a generator only on its own device, so a CUDA policy's logits need a CUDA
    generator. On CPU it draws what `torch.Generator().manual_seed(seed)` draws."""
    if isinstance(device, torch.nn.Module):
        device = next(device.parameters()).device
    return torch.Generator(device=device).manual_seed(seed)


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None,
           processed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next tokens and their log-probs. logits: (B, V) raw model logits.

    The log-prob is that of the policy (log_softmax(logits / T), T = 1 when
    greedy), before top-p and any logits processor: it is what the trainer
    recomputes. `processed` (default: logits) is what the choice is made from.
    """
    temp = temperature if temperature > 0 else 1.0
    logp = F.log_softmax(logits.float() / temp, dim=-1)  # (B, V)
    x = (processed if processed is not None else logits).float()
    if temperature <= 0:
        tok = x.argmax(-1)
    else:
        probs = F.softmax(x / temperature, dim=-1)
        if top_p < 1.0:
            probs = nucleus(probs, top_p)
        tok = draw(probs, generator)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def nucleus(probs: torch.Tensor, top_p: float, k: int = 256) -> torch.Tensor:
    """`probs` (B, V), each row summing to 1, with every id outside its nucleus (the
    smallest set of most probable ids holding >= top_p of the mass) set to 0.

    Sorting a whole row costs: at V = 49k a sort per row was 16% of a SmolLM2
    rollout. A row whose top `k` ids hold more than top_p already has its nucleus
    among them (every later id comes after more than top_p of the mass), so those
    are found with topk; only the other rows are sorted whole."""
    sp, si = probs.topk(min(k, probs.shape[-1]), dim=-1)  # (B, k), descending
    whole = (sp.sum(-1) <= top_p).nonzero().flatten().tolist()
    if whole:
        full_p, full_i = probs[whole].sort(-1, descending=True)
        full_p = full_p.masked_fill(full_p.cumsum(-1) - full_p > top_p, 0.0)
    sp = sp.masked_fill(sp.cumsum(-1) - sp > top_p, 0.0)  # keep the smallest prefix with mass >= top_p
    out = torch.zeros_like(probs).scatter_(-1, si, sp)
    if whole:
        out[whole] = torch.zeros_like(full_p).scatter_(-1, full_i, full_p)
    return out


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One id per row of `probs` (B, V), unnormalised, >= 0: inverse-CDF sampling, the
    first id whose cumulative mass exceeds u x total. The same distribution as
    `torch.multinomial`, at one uniform per row instead of a pass over the vocabulary
    (on a CPU, multinomial is ~18x slower at V = 4k). In float64, so u x total <
    total and an id of probability 0 is never drawn."""
    cdf = probs.double().cumsum(-1)
    where = generator.device if generator is not None else probs.device  # a resumed CPU generator draws on CPU
    u = torch.rand((probs.shape[0], 1), generator=generator, device=where, dtype=torch.float64).to(probs.device)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)


class ScriptedProcessor:
    """A logits processor that makes chosen rows write given token ids (then
    sample freely): a policy with known tool use for tests and benchmarks, or a
    forced prefix. `scripts` maps a row's index (its place in the returned
    list) to the ids it must generate, in order, across all its turns."""

    def __init__(self, scripts: dict[int, list[int]], bias: float = 1e4):
        self.scripts, self.bias = scripts, bias

    @staticmethod
    def ids_for(encode: Callable[[str], list[int]], written: str) -> list[int]:
        """Ids a policy could sample to write `written` (tool calls included, no
        results): each turn encoded on its own, as after a results block no
        token straddles a call's end."""
        ids, i = [], 0
        while i < len(written):
            end = sandbox.find_stop(written, i) or len(written)
            ids += encode(written[i:end])
            i = end
        return ids

    def __call__(self, rows, logits: torch.Tensor) -> torch.Tensor:
        for i, r in enumerate(rows):
            s = self.scripts.get(r.index)
            if s is not None and r.n_gen < len(s):
                logits[i, s[r.n_gen]] += self.bias
        return logits


def stop_ids(tokenizer) -> list[int]:
    """End-of-turn ids: eos, the model's generation-config end ids (recorded on the
    tokenizer by `modeling.load_tokenizer`), and every end-of-turn or end-of-text
    token the vocabulary has (a chat model that writes <|endoftext|> instead of
    <|im_end|> must stop there too, not run on to the token limit)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    ids.update(getattr(tokenizer, "generation_eos_ids", None) or ())
    for name in ("<|eot|>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|end_of_text|>"):
        i = tokenizer.convert_tokens_to_ids(name)
        if isinstance(i, int) and i != tokenizer.unk_token_id and i >= 0:
            ids.add(i)
    return sorted(ids)


# ---------------------------------------------------------------------------
# Attention: grouped KV heads read in place, shared prompts read once
# ---------------------------------------------------------------------------
# transformers' sdpa path copies every KV head `n_heads / n_kv_heads` times
# (repeat_kv) whenever a mask is passed, which the engine and tree scoring always
# do: on SmolLM2's shapes (9 heads, 3 KV heads) a decode step spent more time in
# that copy than in attention. torch's CPU SDPA takes `enable_gqa` with any mask
# and reads each KV head in place (equal outputs, measured). CUDA keeps
# transformers' path: its fused kernels take no mask with enable_gqa.
# During a rollout the engine also passes its cache (`ragged=`), whose rows may
# share their document's prompt (`_RaggedCache.share_prompts`): see
# `_ragged_attention`.

GQA_ATTENTION = "sdpa_gqa"
_REGISTERED: set[str] = set()


def _attention(module, query, key, value, attention_mask, *, dropout: float = 0.0, scaling=None, is_causal=None,
               ragged: "_RaggedCache | None" = None, attend: Callable | None = None, **kwargs):
    """transformers' attention-function signature: query (B, H, Q, D), key/value
    (B, H_kv, K, D), a 4D bool or additive mask; returns ((B, Q, H, D), None).
    `attend(query, key, value, mask, dropout=, scaling=) -> (B, Q, H, D)`, passed
    through the model's forward, replaces it (tree scoring's block attention)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attend is not None:
        return attend(query, key, value, attention_mask, dropout=dropout, scaling=scaling), None
    if ragged is not None and ragged.pkeys is not None:
        return _ragged_attention(module, query, key, value, attention_mask, scaling=scaling, cache=ragged, **kwargs)
    if query.device.type != "cpu" or attention_mask is None or key.shape[1] == query.shape[1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _ragged_attention(module, query, key, value, attention_mask, *, scaling, cache: "_RaggedCache", **kwargs):
    """Attention of rows whose context is their document's shared prompt (`cache.pkeys`,
    one row per document) followed by their own slots (`key`, `value`: (n, H_kv, T, D)).

    A document's rows are stacked as extra query rows against its prompt, so the
    prompt's keys and values are read once per group, not once per rollout; the two
    parts are scored, normalised by one softmax and summed (on a CPU each part goes
    through torch's fused kernel and the two are merged by their log-sum-exps): the
    same function of the same context as attention over the concatenated keys. The
    H / H_kv query heads of a KV head are stacked the same way, so no KV head is
    repeated. Rows in document order (`cache.in_order`) are stacked by a reshape alone."""
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"the hf engine's shared-prompt attention has no {name}; load the model "
                                      "with attn_implementation='eager' to decode without it")
    n, h, w, d = query.shape
    hkv = key.shape[1]
    gw = h // hkv * w
    q = query.reshape(n, hkv, gw, d)  # head j*g + i reads KV head j: rows (i, w) of KV head j
    grid, inv = cache.grid, cache.inv  # (docs, G) local row indices (n = none), (n,) place of each row in it
    nd, gm = grid.shape
    pk, pv = cache.pkeys[module.layer_idx], cache.pvalues[module.layer_idx]  # (all docs, H_kv, P, D)
    if cache.grid_docs is not None:
        pk, pv = pk.index_select(0, cache.grid_docs), pv.index_select(0, cache.grid_docs)
    plen = pk.shape[2]

    def by_doc(x):  # (n, H_kv, gw, E) -> (docs, H_kv, G * gw, E), absent rows zero
        if not cache.in_order:
            x = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])[grid.flatten()]
        return x.view(nd, gm, hkv, gw, x.shape[-1]).transpose(1, 2).reshape(nd, hkv, gm * gw, x.shape[-1])

    def by_row(x):  # the inverse of by_doc
        x = x.view(nd, hkv, gm, gw, x.shape[-1]).transpose(1, 2).reshape(nd * gm, hkv, gw, x.shape[-1])
        return x if cache.in_order else x[inv]

    scale = scaling if scaling is not None else d ** -0.5
    if q.device.type == "cpu":  # torch's fused kernel on each part, merged by their log-sum-exps
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        dt = value.dtype  # under autocast RoPE may leave the queries and keys in float32
        q, key, pk, pv = q.to(dt), key.to(dt), pk.to(dt), pv.to(dt)
        o1, l1 = flash(by_doc(q), pk, pv, attn_mask=cache.mask("prompt", dt), scale=scale)
        o1, l1 = by_row(o1), by_row(l1[..., None])
        o2, l2 = flash(q, key, value, attn_mask=cache.mask("own", dt, attention_mask, h // hkv), scale=scale)
        top = torch.maximum(l1, l2[..., None])
        a1, a2 = (l1 - top).exp(), (l2[..., None] - top).exp()
        out = ((o1 * a1 + o2 * a2) / (a1 + a2)).to(value.dtype)
        return out.reshape(n, h, w, d).transpose(1, 2).contiguous(), None  # (n, W, H, D)
    prompt = by_row(torch.matmul(by_doc(q), pk.transpose(-1, -2))) + cache.prompt_add  # (n, H_kv, gw, P)
    own = torch.matmul(q, key.transpose(-1, -2))  # (n, H_kv, gw, T)
    mask = attention_mask if w == 1 else attention_mask.repeat(1, 1, h // hkv, 1)  # (n, 1, gw, T)
    own = own.masked_fill(~mask, float("-inf"))
    probs = (torch.cat([prompt, own], -1).float() * scale).softmax(-1).to(value.dtype)
    out = by_row(torch.matmul(by_doc(probs[..., :plen]), pv)) + torch.matmul(probs[..., plen:], value)
    return out.view(n, h, w, d).transpose(1, 2).contiguous(), None  # (n, W, H, D)


def _register_attention() -> None:
    if GQA_ATTENTION in _REGISTERED:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, _attention)
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)
    _REGISTERED.add(GQA_ATTENTION)


@contextmanager
def grouped_kv_attention(model):
    """Inside the block, a model loaded with `sdpa` attends through `_attention`
    (its config is shared by every layer, and a PEFT wrapper's is its base's);
    any other implementation is left as it is. A model with gradient checkpointing
    keeps `_attention` after the block: its layers are recomputed in the backward,
    after the block, and must attend as they did (`_attention` is sdpa's function
    for every call that passes none of its own arguments)."""
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) != "sdpa":
        yield model
        return
    _register_attention()
    cfg._attn_implementation = GQA_ATTENTION
    try:
        yield model
    finally:
        if not getattr(model, "is_gradient_checkpointing", False):
            cfg._attn_implementation = "sdpa"


def shares_prompts(model) -> bool:
    """Whether the engine's attention (`_attention`) runs this model: it then keeps
    one copy of a group's prompt."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", GQA_ATTENTION)


# ---------------------------------------------------------------------------
# Rows and the batched KV cache
# ---------------------------------------------------------------------------


@dataclass
class Row:
    index: int  # position of this rollout in the returned list
    builder: sandbox.EpisodeBuilder
    n_gen: int = 0
    contexts: list[list[int]] = field(default_factory=list)  # recorded contexts (tests)


class _RaggedCache:
    """A KV cache with one length per row: row i holds its context in slots
    [0, len_i), and slot = RoPE position. A row appends at its own end and a
    delete truncates it, without touching the other rows: no padding holes, no
    compaction, and a step writes its new keys in place instead of copying the
    whole cache (what DynamicCache's concatenation costs every step).

    Shared prompts (`share_prompts`, after a group's prompt is prefilled once):
    the prompt's keys are kept once per document (`pkeys`, `pvalues`) and a
    row's own slots hold only what follows it, slot j at position base_i + j
    (base_i: its prompt's length). Decoding then reads a prompt once per group
    instead of once per rollout (`_ragged_attention`).

    It speaks the part of transformers' Cache protocol the attention layers use,
    `update(keys, values, layer_idx) -> (keys, values) to attend`; the engine
    sets, before each forward, which rows it covers (`rows`, None = all), the
    slot of each fed id (`slots`, (B, W)) and how many slots to read
    (`kv_len`), and passes its own 4D mask."""

    is_compileable = False

    def __init__(self, n_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.rows: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None
        self.kv_len = 0
        # shared prompts: per layer (documents, H_kv, P, D); per row its document and prompt length
        self.pkeys: list[torch.Tensor] | None = None
        self.pvalues: list[torch.Tensor] | None = None
        self.doc: list[int] = []
        self.base: list[int] = []
        self.doc_add: torch.Tensor | None = None  # (documents, P): 0 on a prompt's slots, -inf past its end
        # set per forward when prompts are shared (see `arrange`)
        self.grid = self.inv = self.grid_docs = self.prompt_add = None
        self.in_order = False  # the grid is every row in order, a document's rows together: no gather
        self.arranged: list[int] | None = None  # the rows the grid above was arranged for
        self.masks: dict = {}  # additive masks of the current forward, by part and dtype (see `mask`)

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
        bufs = []
        need = self.kv_len
        rows = self.rows if self.rows is not None else torch.arange(k.shape[0], device=k.device)
        for store, new in ((self.keys, k), (self.values, v)):
            buf = store[layer_idx]
            if buf is None or buf.shape[2] < need:  # first use, or a row outgrew the capacity
                n = new.shape[0] if buf is None else buf.shape[0]
                grown = new.new_zeros((n, new.shape[1], max(need + 64, int(need * 1.5)), new.shape[3]))
                if buf is not None:
                    grown[:, :, :buf.shape[2]] = buf
                store[layer_idx] = buf = grown
            buf[rows[:, None], :, self.slots] = new.transpose(1, 2)
            bufs.append(buf[:, :, :need] if self.rows is None else buf[self.rows, :, :need])
        return bufs[0], bufs[1]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def select_rows(self, idx: torch.Tensor, repeat: int = 1) -> None:
        """Keep the rows `idx` (in that order), each repeated `repeat` times."""
        idx = idx.repeat_interleave(repeat)
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                if buf is not None:
                    store[i] = buf.index_select(0, idx)
        if self.pkeys is not None:
            keep = idx.tolist()
            self.doc, self.base = [self.doc[i] for i in keep], [self.base[i] for i in keep]
        self.arranged = None

    def share_prompts(self, lens: list[int], expand: int) -> None:
        """After a prefill of one row per document (`lens`: the prompts' lengths):
        the prompts become the shared part, and each document gets `expand` rows
        with no slots of their own yet."""
        p = max(lens)
        self.pkeys = [k[:, :, :p].contiguous() for k in self.keys]
        self.pvalues = [v[:, :, :p].contiguous() for v in self.values]
        self.keys = [k.new_zeros((k.shape[0] * expand, k.shape[1], 64, k.shape[3])) for k in self.keys]
        self.values = [v.new_zeros((v.shape[0] * expand, v.shape[1], 64, v.shape[3])) for v in self.values]
        self.doc = [d for d in range(len(lens)) for _ in range(expand)]
        self.arranged = None
        self.base = [n for n in lens for _ in range(expand)]
        dev = self.pkeys[0].device
        self.doc_add = torch.zeros((len(lens), p), device=dev).masked_fill(
            torch.arange(p, device=dev) >= torch.tensor(lens, device=dev)[:, None], float("-inf"))

    def arrange(self, rows: list[int]) -> None:
        """Before a forward of the rows `rows` (batch indices), prompts shared: their
        documents as a grid of local row indices, one line per document. The forward's
        masks (`mask`) are made again."""
        self.masks = {}
        if rows == self.arranged:  # a decode step of the rows the last forward had: the grid stands
            return
        self.arranged = list(rows)
        dev = self.doc_add.device
        docs = [self.doc[r] for r in rows]
        lines: dict[int, list[int]] = {}
        for j, d in enumerate(docs):
            lines.setdefault(d, []).append(j)
        gm = max(map(len, lines.values()))
        grid = torch.full((len(lines), gm), len(rows), dtype=torch.long)
        inv = torch.empty(len(rows), dtype=torch.long)
        for a, line in enumerate(lines.values()):
            grid[a, :len(line)] = torch.tensor(line)
            inv[torch.tensor(line)] = a * gm + torch.arange(len(line))
        self.grid, self.inv = grid.to(dev), inv.to(dev)
        order = list(lines)  # every document, in order: the prompt buffers are read as they are
        self.grid_docs = None if order == list(range(self.doc_add.shape[0])) else torch.tensor(order, device=dev)
        self.prompt_add = self.doc_add[torch.tensor(docs, device=dev)][:, None, None]  # (n, 1, 1, P)
        self.in_order = self.grid_docs is None and grid.flatten().tolist() == list(range(len(rows)))

    def mask(self, part: str, dtype: torch.dtype, own: torch.Tensor | None = None, heads: int = 1) -> torch.Tensor:
        """An additive mask for torch's fused CPU kernel (0 where a query may attend,
        -inf elsewhere), made once per forward and dtype and read by every layer: the
        shared prompts' ("prompt", (docs, 1, 1, P)) or the rows' own slots' ("own",
        from the forward's bool mask `own`, (n, 1, W, T), its W queries stacked
        `heads` times as `_ragged_attention` stacks them)."""
        if (part, dtype) not in self.masks:
            if part == "prompt":
                add = self.doc_add if self.grid_docs is None else self.doc_add[self.grid_docs]
                m = add[:, None, None].to(dtype)
            else:
                own = own if own.shape[2] == 1 else own.repeat(1, 1, heads, 1)
                m = torch.zeros(own.shape, dtype=dtype, device=own.device).masked_fill(~own, float("-inf"))
            self.masks[part, dtype] = m
        return self.masks[part, dtype]


MIN_COMMON_PREFIX = 16  # shorter shared openings are prefilled with the rest

# A forward of chunks of unequal lengths pads each to the longest. Prompts and results
# blocks vary a lot: on SmolLM2's greedy evaluation (64 news-world documents), 31% of
# the prompts' prefill and about half of the results blocks' forwards were padding, and
# the prefill and the blocks took 70% of the time (AVX2 kernels). On a CPU a forward
# costs about its padded positions plus a fixed part (its weights read once: about 40
# positions' worth, SmolLM2 fp32), so `width_groups` cuts the rows into forwards of
# similar lengths where that is cheaper. A GPU, on which more launches may cost more
# than padding, keeps one forward: not measured there.
SPLIT_OVERHEAD = 48  # positions


def width_groups(lengths: Sequence[int], overhead: int | None) -> list[list[int]]:
    """The rows (indices into `lengths`) in the groups that minimise the sum over
    forwards of `overhead` + rows x longest length. Some cheapest partition is made
    of runs of the rows sorted longest first, so searching runs only is exact.
    `overhead` None: one group, every row in order."""
    n = len(lengths)
    if overhead is None or n < 2 or min(lengths) == max(lengths):  # equal lengths: one forward is cheapest
        return [list(range(n))]
    order = sorted(range(n), key=lambda i: -lengths[i])
    best = [0.0] + [math.inf] * n  # best[j]: the cheapest split of the first j rows of `order`
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group: order[i:j], whose longest is order[i]
            c = best[i] + overhead + (j - i) * lengths[order[i]]
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], n
    while j:
        groups.append(sorted(order[cut[j]:j]))
        j = cut[j]
    return groups[::-1]


def _common_prefix(contexts: list[list[int]]) -> int:
    """How many leading ids every context shares, leaving each at least one of its own
    (the id its next-token logits are read after)."""
    n = min(len(c) for c in contexts) - 1
    first = contexts[0]
    for k in range(max(0, n)):
        if any(c[k] != first[k] for c in contexts[1:]):
            return k
    return max(0, n)


class _Batch:
    """Active rows, their ragged cache, their lengths and the ids in their slots."""

    def __init__(self, model, pad_id: int, record: bool):
        self.model = model
        self.pad_id = pad_id
        self.record = record
        self.dev = next(model.parameters()).device
        self.cache = _RaggedCache(model.config.num_hidden_layers)
        self.lens: list[int] = []  # context length of each row
        self.ids = None  # (B, capacity) long: the id at each position, kept when recording contexts (tests)
        self.rows: list[Row] = []
        self.logits = None  # (B, V): next-token logits of every row
        self.forward_tokens = 0  # positions computed, padding included (cost accounting)

    def prefill(self, rows: list[Row], contexts: list[list[int]], expand: int = 1) -> None:
        """A fresh cache from full contexts; each context's rows are the next `expand`
        rows (a group sharing one prompt, prefilled once and kept once when the
        engine's attention runs the model)."""
        self.cache = _RaggedCache(self.model.config.num_hidden_layers)
        self.ids = None
        common = _common_prefix(contexts)
        if len(contexts) > 1 and common >= MIN_COMMON_PREFIX:
            # Every prompt opens with the same chat template and system prompt (a third of a
            # news-world prompt): computed once, copied to each row, the rest appended.
            self.lens = [0]
            self._forward(None, [contexts[0][:common]])
            self.cache.select_rows(torch.zeros(len(contexts), dtype=torch.long, device=self.dev))
            self.ids = self.ids[[0] * len(contexts)] if self.ids is not None else None
            self.lens = [common] * len(contexts)
            self.logits = self._forward(None, [c[common:] for c in contexts])
        else:
            self.lens = [0] * len(contexts)
            self.logits = self._forward(None, contexts)
        if expand > 1:
            if shares_prompts(self.model):
                self.cache.share_prompts(self.lens, expand)
            else:
                self.cache.select_rows(torch.arange(len(contexts), device=self.dev), expand)
            self.ids = self.ids.repeat_interleave(expand, 0) if self.ids is not None else None
            self.logits = self.logits.repeat_interleave(expand, 0)
            self.lens = [n for n in self.lens for _ in range(expand)]
        self.rows = rows

    def _forward(self, group: list[int] | None, chunks: list[list[int]]) -> torch.Tensor:
        """Append `chunks` to the rows `group` (None = every row, in order) and return
        each row's logits after its last id: in one forward, or on a CPU in forwards
        of rows of similar lengths (`width_groups`) once the cache holds every row."""
        overhead = SPLIT_OVERHEAD if self.dev.type == "cpu" and self.cache.keys[0] is not None else None
        parts = width_groups([len(c) for c in chunks], overhead)
        if len(parts) == 1:
            return self._forward_rows(group, chunks)
        rows = group if group is not None else list(range(len(chunks)))
        out = None
        for part in parts:
            logits = self._forward_rows([rows[i] for i in part], [chunks[i] for i in part])
            out = logits.new_empty((len(chunks), logits.shape[1])) if out is None else out
            out[torch.tensor(part, device=self.dev)] = logits
        return out

    def _forward_rows(self, group: list[int] | None, chunks: list[list[int]]) -> torch.Tensor:
        """`_forward` in one forward. Chunks are left aligned and padded to a common
        width W; a pad id lands in a slot past its row's new length, which no query
        reads before a real id overwrites it."""
        n, w = len(chunks), max(len(c) for c in chunks)
        rows = group if group is not None else list(range(n))
        cache = self.cache
        shared = cache.pkeys is not None
        lens = [self.lens[i] for i in rows]
        base = [cache.base[i] for i in rows] if shared else [0] * n
        ids = torch.tensor([list(c) + [self.pad_id] * (w - len(c)) for c in chunks], dtype=torch.long)  # one copy
        write = torch.tensor(lens, dtype=torch.long)[:, None] + torch.arange(w)  # (n, W): RoPE positions
        slots = (write - torch.tensor(base, dtype=torch.long)[:, None]).to(self.dev)  # (n, W): the row's own slots
        kv_len = max(a - b for a, b in zip(lens, base)) + w
        cache.rows = torch.tensor(group, dtype=torch.long, device=self.dev) if group is not None else None
        cache.slots, cache.kv_len = slots, kv_len
        mask = (torch.arange(kv_len, device=self.dev) <= slots[:, :, None])[:, None]  # (n, 1, W, kv_len)
        extra = {}
        if shared:
            cache.arrange(rows)
            extra["ragged"] = cache
        # the output head runs only where some row's next id is read: a prompt's or a
        # results block's logits at every position would cost a (n, W, V) product
        last = [len(c) - 1 for c in chunks]
        keep = sorted(set(last))
        with grouped_kv_attention(self.model):
            out = self.model(input_ids=ids.to(self.dev), attention_mask=mask, position_ids=write.to(self.dev),
                             past_key_values=cache, use_cache=True, logits_to_keep=torch.tensor(keep, device=self.dev),
                             **extra)
        self.forward_tokens += ids.numel()
        if self.record:
            self._note_ids(group, write, ids, max(lens) + w)
        for r, c in zip(rows, chunks):
            self.lens[r] += len(c)
        col = torch.tensor([keep.index(x) for x in last], device=self.dev)
        return out.logits[torch.arange(n, device=self.dev), col].float()  # (n, V)

    def _note_ids(self, group, write: torch.Tensor, ids: torch.Tensor, kv_len: int) -> None:
        if self.ids is None:
            self.ids = torch.full((len(self.lens), kv_len + 64), self.pad_id, dtype=torch.long)
        elif self.ids.shape[1] < kv_len:
            grown = torch.full((self.ids.shape[0], kv_len + 256), self.pad_id, dtype=torch.long)
            grown[:, :self.ids.shape[1]] = self.ids
            self.ids = grown
        rows = torch.tensor(group) if group is not None else torch.arange(self.ids.shape[0])
        self.ids[rows[:, None], write] = ids

    def extend(self, pending: list[list[int]]) -> None:
        """Feed each row its pending ids (>= 1 each). Every row's first id goes in
        one batched decode step; the rest of a longer chunk (results, a pruned
        tail) goes in a second forward of those rows only, so a results block
        costs its own row and nobody else a slot."""
        self.logits = self._forward(None, [p[:1] for p in pending])
        multi = [i for i, p in enumerate(pending) if len(p) > 1]
        if multi:
            self.logits[multi] = self._forward(multi, [pending[i][1:] for i in multi])

    def retract(self, i: int, keep: int) -> None:
        """Row i keeps the first `keep` ids of its context: later slots are free again.
        A delete retracts summary text only, never the prompt a row may share."""
        if self.cache.pkeys is not None and keep < self.cache.base[i]:
            raise AssertionError(f"row {i}: a prune to {keep} ids would cut its shared prompt "
                                 f"({self.cache.base[i]} ids)")
        self.lens[i] = min(self.lens[i], keep)

    def keep_rows(self, keep: list[int]) -> None:
        idx = torch.tensor(keep, dtype=torch.long, device=self.dev)
        self.cache.select_rows(idx)
        self.ids = self.ids[idx.cpu()] if self.ids is not None else None
        self.logits = self.logits[idx]
        self.rows = [self.rows[i] for i in keep]
        self.lens = [self.lens[i] for i in keep]

    def context(self, i: int) -> list[int]:
        """The ids row i actually conditions on: its first len_i slots."""
        return self.ids[i, :self.lens[i]].tolist()


# ---------------------------------------------------------------------------
# The hf / hf_naive engine
# ---------------------------------------------------------------------------


def _as_index(d) -> sandbox.DocIndex:
    if isinstance(d, sandbox.DocIndex):
        return d
    return sandbox.index_for(getattr(d, "text", d))


def _foldable_adapters(model) -> list:
    """The LoRA layers whose active adapters `merged_adapters` can fold into a copy of
    their weight, or [] when the model is not a LoRA model on a CPU or some active
    adapter computes what a fold would not (its layer not a plain nn.Linear, such as a
    quantised one; a variant such as DoRA; a bias on B; modules kept whole): the
    fold is all or nothing, since the adapters are switched off together."""
    if not getattr(model, "peft_config", None) or not hasattr(model, "disable_adapter"):
        return []
    if next(model.parameters()).device.type != "cpu":
        return []  # not measured on a GPU, where the copies would cost the most memory
    from peft.tuners.lora import LoraLayer

    if any(getattr(c, "modules_to_save", None) or getattr(c, "peft_type", None) != "LORA"
           for c in model.peft_config.values()):
        return []
    folds = []
    for m in model.modules():
        if not isinstance(m, LoraLayer):
            continue
        active = [a for a in m.active_adapters if a in m.scaling]  # every kind of layer keeps its scale
        if not active:
            continue
        if (type(m.get_base_layer()) is not torch.nn.Linear or m.merged
                or any(a in m.lora_variant or m.lora_bias.get(a) for a in active)):  # a variant: DoRA and others
            return []
        folds.append((m, active))
    return folds


@contextmanager
def merged_adapters(model):
    """Inside the block a LoRA model on a CPU decodes with each adapter folded into a
    copy of its layer's weight (W + scale B A) and its adapters switched off: one
    product per projection instead of three (base, A, B), and none of the adapter's
    elementwise passes (`python bench/rollout.py --model smollm2-135m` prints what it
    buys). The copies cost one more set of the adapted weights while decoding. The
    original weights are put back as they were (the same tensors, never written), so
    training goes on exactly; the sampled log-probs differ from the unfolded model's
    by rounding only (at most 6e-5 on SmolLM2's rollouts in fp32). A model that
    `_foldable_adapters` refuses decodes as it is."""
    folds = _foldable_adapters(model)
    if not folds:
        yield model
        return
    saved = []
    try:
        with torch.no_grad():
            for m, active in folds:
                base = m.get_base_layer()
                folded = base.weight + sum(m.get_delta_weight(a) for a in active)
                saved.append((base, base.weight))
                base.weight = torch.nn.Parameter(folded, requires_grad=False)
        with model.disable_adapter():
            yield model
    finally:
        for base, weight in saved:
            base.weight = weight


@torch.no_grad()
def rollout(model, tokenizer, documents: Sequence, group_size: int = 1, cfg: SamplingConfig | None = None,
            limits: sandbox.Limits | None = None, *, logits_processor: Callable | None = None,
            record_contexts: bool = False, generator: torch.Generator | None = None,
            progress: str | None = None) -> list[sandbox.Episode]:
    """`group_size` episodes per document, in document-major order.

    `documents`: texts, `DocIndex`es or records with `.text` (and `.id`).
    `logits_processor(rows, logits) -> logits` may change what is sampled (e.g.
    ban tool tags for an ablation); recorded log-probs stay the policy's.
    With `record_contexts`, each episode's `meta["engine_contexts"]` holds the
    ids the engine really conditioned each turn on (read from its cache).
    `progress` names a progress bar over the documents (hf backends; none by default).
    """
    cfg = cfg or SamplingConfig()
    if logits_processor is not None and cfg.backend not in ("hf", "hf_naive"):
        raise ValueError(f"a logits_processor needs the hf or hf_naive backend, not {cfg.backend!r}")
    if cfg.backend == "vllm":
        return rollout_vllm(model, tokenizer, documents, group_size, cfg, limits)
    if cfg.backend == "api":
        return rollout_api(documents, group_size, cfg, limits)
    if cfg.backend not in ("hf", "hf_naive"):
        raise ValueError(f"unknown backend {cfg.backend!r} (hf, hf_naive, vllm, api)")
    was_training = model.training
    model.eval()
    try:
        generator = generator or make_generator(cfg.seed, model)
        per_chunk = max(1, cfg.batch_size // group_size)
        episodes: list[sandbox.Episode] = []
        with merged_adapters(model), tqdm(total=len(documents), desc=progress, unit="doc", leave=False,
                                          disable=progress is None) as bar:
            for s in range(0, len(documents), per_chunk):
                chunk = documents[s:s + per_chunk]
                episodes += _rollout_chunk(model, tokenizer, chunk, group_size, cfg, limits,
                                           logits_processor=logits_processor, record=record_contexts,
                                           generator=generator, first_index=len(episodes))
                bar.update(len(chunk))
        return episodes
    finally:
        model.train(was_training)


def _rollout_chunk(model, tokenizer, documents, group_size, cfg, limits, *, logits_processor, record,
                   generator, first_index) -> list[sandbox.Episode]:
    codec = sandbox.Codec(tokenizer)
    eos = stop_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    prompts, rows = [], []
    for d in documents:
        index = _as_index(d)
        p = sandbox.prompt_ids(tokenizer, index.text)
        prompts.append(p)
        for _ in range(group_size):
            b = sandbox.EpisodeBuilder(index, p, codec, limits, eos_ids=eos, doc_id=getattr(d, "id", None))
            rows.append(Row(first_index + len(rows), b))
    batch = _Batch(model, pad, record)
    batch.prefill(rows, prompts, expand=group_size)
    naive = cfg.backend == "hf_naive"
    if record:
        for i, r in enumerate(batch.rows):
            r.contexts.append(batch.context(i))
    while batch.rows:
        logits = batch.logits
        processed = logits_processor(batch.rows, logits.clone()) if logits_processor else None
        toks, lps = sample(logits, cfg.temperature, cfg.top_p, generator, processed)
        toks, lps = toks.tolist(), lps.tolist()
        pending, alive, events = [], [], []
        for i, (row, tok, lp) in enumerate(zip(batch.rows, toks, lps)):
            b = row.builder
            row.n_gen += 1
            stop = b.push(tok, lp)
            if stop:
                act = b.end_turn()
            elif row.n_gen >= cfg.max_new_tokens or batch.lens[i] + 1 >= cfg.max_context_tokens:
                act = b.end_turn("truncated")
            else:
                pending.append([tok])
                alive.append(i)
                continue
            if act.kind == "done":
                continue
            if act.kind == "prune" and act.keep <= batch.lens[i]:
                batch.retract(i, act.keep)
                feed = act.ids
            else:  # the kept prefix includes the token just sampled (not yet in the cache)
                feed = [tok] + act.ids
            if row.n_gen >= cfg.max_new_tokens or batch.lens[i] + len(feed) >= cfg.max_context_tokens:
                b.end_turn("truncated")  # no room left after the tool call
                continue
            pending.append(feed)
            alive.append(i)
            events.append(len(alive) - 1)
        if not alive:
            break
        if len(alive) < len(batch.rows):
            batch.keep_rows(alive)
        if naive and events:
            contexts = [r.builder.context_ids() for r in batch.rows]
            batch.prefill(batch.rows, contexts)
        else:
            batch.extend(pending)
        if record:
            for j in events:
                batch.rows[j].contexts.append(batch.context(j))
    out = []
    for r in rows:
        ep = r.builder.finish()
        if record:
            ep.meta["engine_contexts"] = r.contexts
        out.append(ep)
    return out


@contextmanager
def timed_parts():
    """For a profile (bench/rollout.py): inside the block, the wall seconds the hf engine
    spends in each of its parts add up in the yielded Counter, by name: "forward" (a
    batched forward, attention included), "attention", "cache writes", "sampling",
    "sandbox" (the episode builders), "script (bench only)" (a ScriptedProcessor).
    Nested parts count in both. Each part is wrapped for the block only."""
    from transformers import AttentionInterface

    secs: collections.Counter = collections.Counter()

    def timed(fn, part):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                secs[part] += time.perf_counter() - t0
        return wrapper

    module = sys.modules[__name__]
    parts = [(_Batch, "_forward_rows", "forward"), (_RaggedCache, "update", "cache writes"),
             (module, "sample", "sampling"), (sandbox.EpisodeBuilder, "push", "sandbox"),
             (sandbox.EpisodeBuilder, "end_turn", "sandbox"), (ScriptedProcessor, "__call__", "script (bench only)")]
    saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in parts]
    _register_attention()
    attention = _attention  # what _register_attention put under GQA_ATTENTION
    try:
        for (owner, attr, part), (_, _, fn) in zip(parts, saved):
            setattr(owner, attr, timed(fn, part))
        AttentionInterface.register(GQA_ATTENTION, timed(attention, "attention"))
        yield secs
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)
        AttentionInterface.register(GQA_ATTENTION, attention)


# ---------------------------------------------------------------------------
# vLLM backend (GPU only)
# ---------------------------------------------------------------------------


def drive_multiturn(builders, generate_round, max_new_tokens, max_context_tokens=None, context_len=None):
    """The loop shared by request-based backends: each round, every unfinished
    episode is sent its whole context and generates until a stop; its tokens
    are pushed through the builder, which decides what follows.
    `generate_round([(builder, budget)]) -> [(ids, logprobs or None, finish)]`,
    finish "length" when the budget ran out, "stop_string" when a stop string
    ended the round, else "stop".

    A round that ends at a stop string the builder does not read as a tool call
    (a "/>" that closes no <delete .../> tag) is not a turn end: the episode is
    sent again and goes on, as the hf engines' token loop would. A context that
    reaches `max_context_tokens` ends the episode, truncated, as in the hf
    engines: the budget of a round is what is left of both limits."""
    limit = max_context_tokens if max_context_tokens else float("inf")
    ctx = context_len or (lambda b: len(b.context_ids()))  # the api backend counts characters, prompt included
    n_gen = [0] * len(builders)
    active = list(range(len(builders)))
    while active:
        budgets = [max(1, int(min(max_new_tokens - n_gen[i], limit - ctx(builders[i])))) for i in active]
        results = generate_round([(builders[i], k) for i, k in zip(active, budgets)])
        nxt = []
        for i, (ids, lps, finish) in zip(active, results):
            b = builders[i]
            stopped = False
            for tok, lp in zip(ids, lps or [None] * len(ids)):
                n_gen[i] += 1
                if b.push(tok, lp):
                    stopped = True
                    break
            out_of_room = n_gen[i] >= max_new_tokens or ctx(b) >= limit
            if stopped:
                act = b.end_turn()
            elif finish == "stop_string" and not out_of_room:
                nxt.append(i)  # a stop string that is no tool call: keep generating this turn
                continue
            else:
                act = b.end_turn("truncated")
            if act.kind == "done":
                continue
            if n_gen[i] >= max_new_tokens or ctx(b) >= limit:
                b.end_turn("truncated")  # no room left after the tool call
            else:
                nxt.append(i)
        active = nxt
    return [b.finish() for b in builders]


def rollout_vllm(llm, tokenizer, documents, group_size, cfg: SamplingConfig, limits=None, *, lora_request=None):
    """vLLM 0.32 (`LLM.generate` on token ids). Stop strings end a round at a
    tool call (the builder re-checks: "/>" alone does not close a delete tag);
    vLLM returns every generated token id and the sampled token's log-prob
    (`logprobs=0`); with prefix caching (on by default in the V1 engine) a
    resubmitted context is mostly a cache hit, and after a delete the pruned
    context is resubmitted as is.

    vLLM's log-probs are of the raw logits unless the engine is built with
    `logprobs_mode="processed_logprobs"` (then temperature is applied, as the
    trainer does; keep top_p = 1 for the two to agree exactly). The trainer
    recomputes log-probs anyway and corrects for the sampler mismatch with
    truncated importance sampling. `lora_request` (a `vllm.lora.request.LoRARequest`)
    selects the current adapter; `llm` may be Unsloth's `model.vllm_engine`."""
    try:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
    except ImportError as e:  # pragma: no cover - GPU stack
        raise ImportError("the vllm backend needs vLLM: pip install -r requirements-gpu.txt") from e
    codec = sandbox.Codec(tokenizer)
    eos = stop_ids(tokenizer)
    builders = []
    for d in documents:
        index = _as_index(d)
        p = sandbox.prompt_ids(tokenizer, index.text)
        builders += [sandbox.EpisodeBuilder(index, p, codec, limits, eos_ids=eos, doc_id=getattr(d, "id", None))
                     for _ in range(group_size)]
    seed = [cfg.seed]

    def generate_round(reqs):  # pragma: no cover - GPU stack
        prompts, params = [], []
        for b, budget in reqs:
            prompts.append(TokensPrompt(prompt_token_ids=b.context_ids()))
            seed[0] += 1
            params.append(SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=budget,
                                         stop=["</search>", "/>"], include_stop_str_in_output=True,
                                         stop_token_ids=eos, logprobs=0, seed=seed[0]))
        outs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
        res = []
        for o in outs:
            c = o.outputs[0]
            lps = [lp[tok].logprob for tok, lp in zip(c.token_ids, c.logprobs)] if c.logprobs else None
            finish = ("length" if c.finish_reason == "length"
                      else "stop_string" if isinstance(c.stop_reason, str) else "stop")
            res.append((list(c.token_ids), lps, finish))
        return res

    return drive_multiturn(builders, generate_round, cfg.max_new_tokens, cfg.max_context_tokens)


# ---------------------------------------------------------------------------
# api backend: an OpenAI-compatible server
# ---------------------------------------------------------------------------


class ApiError(RuntimeError):
    pass


def usage_tokens(response: dict) -> tuple[int, int]:
    """(prompt, completion) tokens of an API response's `usage`, each 0 when the server
    sends none, or junk."""
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}

    def count(value) -> int:
        try:
            return max(0, int(value or 0))
        except (TypeError, ValueError):
            return 0

    return count(usage.get("prompt_tokens")), count(usage.get("completion_tokens"))


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """An API answers a POST where it was sent: a redirect is refused, so the request (and
    its Authorization header) never follows it to another host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise ApiError(f"{req.full_url}: HTTP {code} redirect to {newurl} not followed")


_OPENER = urllib.request.build_opener(_NoRedirects)


class ApiClient:
    """A small OpenAI-compatible client: retries on 429/5xx/timeouts with jittered
    exponential backoff (or the server's Retry-After, up to `max_wait_s`), a
    concurrency limit, a cap on the response size, no redirects, token accounting.
    stdlib only."""

    def __init__(self, base: str, model: str, *, key: str | None = None, timeout_s: float = 60.0, retries: int = 5,
                 concurrency: int = 8, backoff_s: float = 0.5, max_response_bytes: int = 8 << 20,
                 max_wait_s: float = 60.0):
        self.base, self.model, self.key = base.rstrip("/"), model, key
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.max_response_bytes, self.max_wait_s = max_response_bytes, max_wait_s
        self._sem = threading.Semaphore(concurrency)
        self._lock = threading.Lock()
        self.usage = {"prompt_tokens": 0, "completion_tokens": 0, "requests": 0, "retries": 0}

    def _wait(self, attempt: int, retry_after: str | None) -> float:
        """Seconds before retry `attempt`: the server's Retry-After (seconds) when it
        sent one, else backoff_s * 2^(attempt-1) with full jitter; never over max_wait_s."""
        import random

        try:
            told = float(retry_after) if retry_after else None
        except ValueError:  # an HTTP date: not worth parsing, back off as usual
            told = None
        wait = told if told is not None and told >= 0 else self.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1)
        return min(wait, self.max_wait_s)

    def _read(self, resp) -> dict:
        raw = resp.read(self.max_response_bytes + 1)
        if len(raw) > self.max_response_bytes:
            raise ApiError(f"response over {self.max_response_bytes} bytes (max_response_bytes)")
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ApiError(f"response is not JSON ({type(e).__name__}: {str(e)[:100]})") from None

    def post(self, path: str, body: dict) -> dict:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        last, retry_after = None, None
        for attempt in range(self.retries + 1):
            if attempt:
                with self._lock:
                    self.usage["retries"] += 1
                time.sleep(self._wait(attempt, retry_after))
            req = urllib.request.Request(self.base + path, data=data, headers=headers, method="POST")
            try:
                with self._sem, _OPENER.open(req, timeout=self.timeout_s) as resp:
                    out = self._read(resp)
            except urllib.error.HTTPError as e:
                last, retry_after = f"HTTP {e.code}: {e.read(200)!r}", e.headers.get("Retry-After")
                if e.code == 429 or e.code >= 500:
                    continue
                raise ApiError(f"{self.base + path}: {last}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last, retry_after = f"{type(e).__name__}: {e}", None
                continue
            except ApiError as e:
                raise ApiError(f"{self.base + path}: {e}") from None
            if not isinstance(out, dict):
                raise ApiError(f"{self.base + path}: response is a JSON {type(out).__name__}, not an object")
            with self._lock:
                self.usage["requests"] += 1
                pt, ct = usage_tokens(out)
                self.usage["prompt_tokens"] += pt
                self.usage["completion_tokens"] += ct
            return out
        raise ApiError(f"{self.base + path}: gave up after {self.retries + 1} attempts ({last})")


API_STOPS = ["</search>", "/>"]


def _restore_stop(so_far: str, text: str) -> str:
    """Servers drop the stop string from the text; put back the one that ended
    the round (an open <search> or <delete ... tag), if any."""
    full = so_far + text
    if full.rfind("<search>") > full.rfind("</search>"):
        return text + "</search>"
    i = full.rfind("<delete")
    if i >= 0 and i > full.rfind(">"):
        return text + "/>"
    return text


def rollout_api(documents, group_size, cfg: SamplingConfig, limits=None, client: ApiClient | None = None):
    """Text-only episodes from an OpenAI-compatible server. `completions` mode
    sends a plain-text prompt plus the text so far; `chat` mode sends the chat
    messages with the text so far as a final assistant message to continue
    (vLLM's `continue_final_message`). Each round stops at a tool call; the
    sandbox answers and the next round continues. A request the server fails
    (after the client's retries) or answers without a choice ends that episode
    only, truncated, with the reason in `meta["api_error"]`."""
    import os

    client = client or ApiClient(cfg.api_base, cfg.api_model, key=os.environ.get(cfg.api_key_env),
                                 timeout_s=cfg.api_timeout_s, retries=cfg.api_retries, concurrency=cfg.api_concurrency)
    builders = []
    for d in documents:
        index = _as_index(d)
        builders += [sandbox.EpisodeBuilder(index, None, None, limits, doc_id=getattr(d, "id", None))
                     for _ in range(group_size)]

    errors: dict[int, str] = {}  # builder id -> why its server failed it (the episode ends there)

    def one(req):
        try:
            return ask(req)
        except (ApiError, KeyError, IndexError, TypeError, AttributeError) as e:  # this episode only
            errors[id(req[0])] = f"{type(e).__name__}: {e}"[:300]
            return [], None, "api_error"

    def ask(req):
        b, budget = req
        so_far = "".join(chr(i) for i in b.context_ids())  # character codec: ids are code points
        msgs = sandbox.prompt_messages(b.index.text)
        body = {"model": cfg.api_model, "max_tokens": max(1, budget), "temperature": cfg.temperature,
                "top_p": cfg.top_p, "stop": API_STOPS}
        if cfg.api_mode == "chat":
            body["messages"] = msgs + ([{"role": "assistant", "content": so_far}] if so_far else [])
            if so_far:
                body.update(continue_final_message=True, add_generation_prompt=False)
            out = client.post("/chat/completions", body)
            choice = out["choices"][0]
            text = (choice.get("message") or {}).get("content") or ""
        else:
            body["prompt"] = f"{msgs[0]['content']}\n\n{msgs[1]['content']}\n\nSummary: {so_far}"
            out = client.post("/completions", body)
            choice = out["choices"][0]
            text = choice.get("text") or ""
        if choice.get("finish_reason") == "stop":
            text = _restore_stop(so_far, text)
        return [ord(c) for c in text], None, "length" if choice.get("finish_reason") == "length" else "stop"

    def generate_round(reqs):
        with ThreadPoolExecutor(max(1, cfg.api_concurrency)) as pool:
            return list(pool.map(one, reqs))

    # The context guard in characters (the server's tokenizer is not at hand): about four
    # a token, the prompt's included, so a long document and its tool results end the
    # episode as truncated instead of a 400 from the server for an over-long prompt.
    prompt_chars = {id(b): len(sandbox.prompt_messages(b.index.text)[1]["content"]) + len(sandbox.SYSTEM_PROMPT)
                    for b in builders}
    eps = drive_multiturn(builders, generate_round, cfg.max_new_tokens, 4 * cfg.max_context_tokens,
                          context_len=lambda b: prompt_chars[id(b)] + len(b.context_ids()))
    for b, ep in zip(builders, eps):  # character ids are not a tokenisation: keep the text record only
        for turn in ep.turns:
            turn.ids = turn.logprobs = turn.inj_ids = turn.prune = None
        ep.prompt_ids = None
        ep.meta["api_usage"] = dict(client.usage)
        if id(b) in errors:  # ended early: the caller decides (teacher_episodes.py asks again next run)
            ep.meta["api_error"] = errors[id(b)]
    return eps
