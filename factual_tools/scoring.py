"""Scoring: the log-probs of generated tokens under the contexts they were sampled in.

`episode_logprobs(model, episodes)` scores per branch (the reference: each branch
its own padded sequence) or per tree (fast: an episode's branches share their
common prefixes in one sequence, a 4D mask letting each token see only its own
branch). `group_logprobs` scores a GRPO group as one tree rooted at its shared
prompt. SFT, RL and distillation all score through here; the rollouts they score
come from factual_tools/engine.py, whose attention (grouped KV heads read in
place) the scorers use too.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field
from typing import Literal, Sequence

import torch
import torch.nn.functional as F

import sandbox
from factual_tools.engine import grouped_kv_attention, shares_prompts, stop_ids


def validate_masks(episodes: Sequence[sandbox.Episode], tokenizer, n: int | None = None, seed: int = 0,
                   mask_retracted: bool = False) -> int:
    """Every trained position decodes to its turn's assistant text (a loss mask that
    drifts off the assistant text trains silently on the wrong tokens); raises
    sandbox.MaskError. Every episode in order, or a seeded sample of `n` (SFT and
    distillation check a sample of their corpus once; RL checks every rollout before
    every update). Returns how many were checked."""
    sample = list(episodes) if n is None else random.Random(seed).sample(list(episodes), min(n, len(episodes)))
    eos = stop_ids(tokenizer)
    for ep in sample:
        sandbox.check_branches(ep, ep.branches(mask_retracted=mask_retracted), tokenizer, eos)
    return len(sample)


# Tree scoring's attention in blocks. A group's tree is its prompt followed by its
# rollouts, and a rollout's tokens never see another rollout's: under the dense
# (T, T) tree mask most of the attention is computed and then masked away. On a CPU
# that attention was the larger part of an RL update: SmolLM2 on a group tree of
# 3,216 nodes took 29 s forward and backward with the dense mask (AVX2 kernels).
# `tree_blocks` cuts the query nodes into blocks of TREE_BLOCK and gives each block
# only the key columns one of its nodes may see (its prompt, its own rollout);
# blocks that read about as many columns go through one attention call. The same
# attention, on that tree a sixth of the work and 1.7x faster forward and backward
# (bench/tree_attention.py). A plain causal chain (an SFT episode) would skip only
# its upper half, which torch's kernel already runs about as fast: it keeps the mask.
TREE_BLOCK = 64


@dataclass
class BlockPart:
    """Query blocks `rows` (indices into the flattened (B * n_blocks) blocks) attend to
    the flattened (B * T) key positions `cols[i]`, where `mask[i, 0]` allows."""
    rows: torch.Tensor  # (n,) long
    cols: torch.Tensor  # (n, K) long
    mask: torch.Tensor  # (n, 1, TREE_BLOCK, K) bool


@dataclass
class TreeBlocks:
    parts: list[BlockPart]
    order: torch.Tensor  # the blocks of the parts, concatenated, back in block order


def tree_blocks(allowed: torch.Tensor) -> TreeBlocks | None:
    """The block form of a batch of tree masks `allowed` (B, T, T), or None when it
    would skip less than half the dense mask's work (too little to pay for its gathers
    and calls). A block's key columns are rounded up to a multiple of 2 * TREE_BLOCK
    (few shapes, few calls)."""
    b, t, _ = allowed.shape
    nb = -(-t // TREE_BLOCK)
    rows = allowed.new_zeros((b, nb * TREE_BLOCK, t))
    rows[:, :t] = allowed
    rows[:, t:, 0] = True  # a padded row reads column 0: no row without a key
    rows = rows.view(b * nb, TREE_BLOCK, t)
    seen = rows.any(1)  # (blocks, T): the columns each block reads
    step = 2 * TREE_BLOCK
    widths = ((seen.sum(-1) + step - 1) // step * step).clamp(max=t)
    if int(widths.sum()) * TREE_BLOCK > 0.5 * b * t * t:  # a causal chain's blocks (0.55-0.6) ran no faster
        return None
    # a block's seen columns first, in order; the unseen ones that pad it to its width are masked
    cols = seen.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices
    offset = torch.arange(b * nb, device=allowed.device) // nb * t  # into the flattened (B * T) keys
    parts = []
    for w in widths.unique().tolist():
        idx = (widths == w).nonzero()[:, 0]
        c = cols[idx, :w]
        mask = rows[idx].gather(2, c[:, None].expand(-1, TREE_BLOCK, w))
        parts.append(BlockPart(idx, c + offset[idx, None], mask[:, None]))
    return TreeBlocks(parts, torch.cat([p.rows for p in parts]).argsort())


# A tree whose blocks would skip too little (an SFT episode: a chain or a few branches)
# still never lets a node see a later one, so the queries of rows [s, e) need only the
# keys [0, e). Its attention in query chunks of PREFIX_CHUNK, each against its key prefix
# (slices, nothing gathered), does about half the dense mask's work: on a 727-node tree
# forward and backward took 29.9 -> 20.7 ms (fp32, AVX2 kernels) and 28.6 -> 21.7 ms
# (bf16), and attention was 30% of an SFT step of SmolLM2 (AVX2 kernels).
PREFIX_CHUNK = 256


def prefix_chunks(allowed: torch.Tensor) -> list[int] | None:
    """The ends of the query chunks of a batch of masks `allowed` (B, T, T) when no
    position sees a later one and there are at least two chunks; else None."""
    t = allowed.shape[-1]
    if t <= PREFIX_CHUNK or bool(allowed.triu(1).any()):
        return None
    return list(range(PREFIX_CHUNK, t, PREFIX_CHUNK)) + [t]


def _prefix_attention(query, key, value, attention_mask, *, ends: list[int], dropout: float, scaling):
    """Attention in query chunks, each against the keys up to its end (`prefix_chunks`):
    query (B, H, T, D), key/value (B, H_kv, T, D); returns (B, T, H, D)."""
    gqa = query.shape[1] != key.shape[1]
    outs, s = [], 0
    for e in ends:
        outs.append(F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, :e], value[:, :, :e],
                                                   attn_mask=attention_mask[:, :, s:e, :e], dropout_p=dropout,
                                                   scale=scaling, enable_gqa=gqa))
        s = e
    return torch.cat(outs, 2).transpose(1, 2).contiguous()


def _block_attention(query, key, value, attention_mask, *, blocks: TreeBlocks, dropout: float, scaling):
    """Attention of the nodes of a batch of trees through `blocks` (on a CPU): query
    (B, H, T, D), key/value (B, H_kv, T, D); returns (B, T, H, D)."""
    b, h, t, d = query.shape
    hkv = key.shape[1]
    nb = len(blocks.order) // b
    q = F.pad(query, (0, 0, 0, nb * TREE_BLOCK - t)).view(b, h, nb, TREE_BLOCK, d).transpose(1, 2)
    q = q.reshape(b * nb, h, TREE_BLOCK, d)
    flat_k, flat_v = (x.transpose(1, 2).reshape(b * t, hkv, d) for x in (key, value))
    outs = []
    for part in blocks.parts:
        k, v = flat_k[part.cols].transpose(1, 2), flat_v[part.cols].transpose(1, 2)  # (n, H_kv, K, D)
        outs.append(F.scaled_dot_product_attention(q[part.rows], k, v, attn_mask=part.mask, dropout_p=dropout,
                                                   scale=scaling, enable_gqa=h != hkv))
    out = torch.cat(outs)[blocks.order]  # (B * nb, H, TREE_BLOCK, D)
    return out.view(b, nb, h, TREE_BLOCK, d).transpose(2, 3).reshape(b, nb * TREE_BLOCK, h, d)[:, :t].contiguous()


def _branch_list(episodes, tokenizer):
    out = []
    for e, ep in enumerate(episodes):
        for b in ep.branches(tokenizer):
            out.append((e, b))
    return out


# Under bf16 autocast on a CPU, torch multiplies through oneDNN, which builds a kernel for
# every new matrix shape and keeps it in its primitive cache (up to 1,024). Trees of every
# length made every SFT and RL step a new shape: an SFT run's memory grew by about 0.2 GB a
# step (3.3 to 4.8 GB in 7 steps of SmolLM2, two AMD EPYC cores), and capping the cache at 8
# (ONEDNN_PRIMITIVE_CACHE_CAPACITY) stopped the growth but made a step 1.5x slower, every
# kernel built again. Rounding the scored lengths up to a multiple of SHAPE_STEP keeps the
# shapes few; the padding is masked out and costs a few percent of a forward.
SHAPE_STEP = 64


def bucketed(n: int, device) -> int:
    """`n` rounded up to a multiple of SHAPE_STEP under bf16 autocast on a CPU, else `n`."""
    if torch.device(device).type == "cpu" and torch.is_autocast_enabled("cpu"):
        return -(-n // SHAPE_STEP) * SHAPE_STEP
    return n


def _selected_logprobs(model, ids, attention_mask, position_ids, *, wanted: list[list[int]], targets: list[list[int]],
                       temperature: float, **attention) -> list[torch.Tensor]:
    """log p(targets[b][j] | prefix) where the logits come from position
    wanted[b][j] of row b. Only the (row, position) pairs some row wants go
    through the output head: for SFT and RL most of a sequence is prompt, and a
    (B, T, V) logits tensor would dominate time and memory. (Indexing row by row
    made each row's backward fill a zero tensor of the whole output: 40% of an
    SFT step, measured; one gather serves every row.)"""
    dev = ids.device
    temp = temperature if temperature > 0 else 1.0
    n = sum(map(len, wanted))
    pad = [0] * (bucketed(n, dev) - n)  # row 0's first position, scored and dropped: a bucketed head shape
    rows = torch.tensor([b for b, w in enumerate(wanted) for _ in w] + pad, dtype=torch.long, device=dev)
    pos = torch.tensor([p for w in wanted for p in w] + pad, dtype=torch.long, device=dev)
    tg = torch.tensor([x for tgt in targets for x in tgt] + pad, dtype=torch.long, device=dev)
    if head_is_plain(model):  # the decoder, then the head on the wanted pairs only
        h = model.get_decoder()(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                                **attention).last_hidden_state
        logits = model.get_output_embeddings()(h[rows, pos])
    else:  # a model that post-processes its logits: every row at every position some row wants
        keep = sorted(set(pos.tolist()))
        col = torch.full((ids.shape[1],), -1, dtype=torch.long, device=dev)
        col[torch.tensor(keep, device=dev)] = torch.arange(len(keep), device=dev)
        logits = model(input_ids=ids, attention_mask=attention_mask, position_ids=position_ids,
                       logits_to_keep=torch.tensor(keep, device=dev), **attention).logits[rows, col[pos]]
    logp = F.log_softmax(logits.float() / temp, dim=-1).gather(-1, tg[:, None])[:n, 0]  # (N,)
    return list(logp.split([len(w) for w in wanted]))


def head_is_plain(model) -> bool:
    """Whether the model's logits are its output embeddings applied to its decoder's
    last hidden state (Llama, Qwen, Mistral; not a model that soft-caps or scales
    them). Checked once per model on a few positions, and remembered."""
    known = getattr(model, "_fx_plain_head", None)
    if known is None:
        known = False
        was_training = model.training
        model.eval()  # dropout would make the two paths differ
        try:
            with torch.no_grad():
                dev = next(model.parameters()).device
                ids = torch.arange(1, 9, device=dev)[None] % model.config.vocab_size
                full = model(input_ids=ids).logits
                h = model.get_decoder()(input_ids=ids).last_hidden_state
                known = bool(torch.allclose(model.get_output_embeddings()(h).float(), full.float(), atol=1e-4,
                                            rtol=1e-3))
        except (AttributeError, NotImplementedError, TypeError):
            pass
        finally:
            model.train(was_training)
        model._fx_plain_head = known
    return known


def episode_logprobs(model, episodes: Sequence[sandbox.Episode], tokenizer=None, temperature: float = 1.0,
                     method: Literal["tree", "branch"] = "tree", max_batch_tokens: int = 16384,
                     ) -> list[list[torch.Tensor]]:
    """Per episode, per turn: log-probs (tensor, differentiable when grad is on)
    of the turn's generated ids under the context they were generated in.

    `branch`: each branch is its own sequence (padded into batches).
    `tree`: the branches of an episode share their common prefixes and are
    scored in one sequence, with a 4D mask letting each token see only its own
    branch's earlier tokens and position ids reproducing each branch's
    positions. Needs an attention implementation that takes arbitrary masks
    (sdpa, eager, flex), not flash attention.
    """
    dev = next(model.parameters()).device
    out: list[list[torch.Tensor | None]] = [[None] * len(ep.turns) for ep in episodes]
    items = _branch_list(episodes, tokenizer) if method == "branch" else episode_trees(episodes, tokenizer)
    with grouped_kv_attention(model):
        for chunk in _chunks(items, max_batch_tokens, method):
            if method == "branch":
                _score_branches(model, chunk, out, temperature, dev)
            else:
                score_trees(model, chunk, out, temperature, dev)
    return out


def _chunks(items, max_tokens, method):
    chunk, longest = [], 0
    for it in items:
        n = len(it[1].input_ids) if method == "branch" else len(it.ids)
        if chunk and max(longest, n) * (len(chunk) + 1) > max_tokens:
            yield chunk
            chunk, longest = [], 0
        chunk.append(it)
        longest = max(longest, n)
    if chunk:
        yield chunk


def _score_branches(model, chunk, out, temperature, dev):
    width = max(len(b.input_ids) for _, b in chunk)
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    mask = torch.zeros((len(chunk), width), dtype=torch.long)
    wanted, targets, where = [], [], []
    for i, (e, b) in enumerate(chunk):  # right padding: positions start at 0 for every row
        ids[i, :len(b.input_ids)] = torch.tensor(b.input_ids)
        mask[i, :len(b.input_ids)] = 1
        w, tg = [], []
        for ti, s, t_end in b.turns:
            where.append((i, e, ti, len(w), len(w) + t_end - s))
            w += range(s - 1, t_end - 1)
            tg += b.input_ids[s:t_end]
        wanted.append(w)
        targets.append(tg)
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    rows = _selected_logprobs(model, ids, mask, pos, wanted=wanted, targets=targets, temperature=temperature)
    for i, e, ti, a, z in where:
        out[e][ti] = rows[i][a:z]


@dataclass
class TokenTree:
    """The branches of one or more episodes as a trie of token nodes."""
    ids: list[int]
    parent: list[int]
    depth: list[int]
    targets: list[tuple[int, int, list[int]]]  # (episode, turn, node index of each generated id)
    paths: list[list[int]] = field(default_factory=list)  # root-to-leaf nodes of every branch


def episode_trees(episodes, tokenizer, group=False) -> list[TokenTree]:
    """One trie per episode (or one per group of episodes with `group`)."""
    trees = []
    cur = None
    for e, ep in enumerate(episodes):
        if cur is None or not group:
            cur = TokenTree([], [], [], [])
            children: dict[tuple[int, int], int] = {}
            trees.append(cur)
        for b in ep.branches(tokenizer):
            node = -1
            nodes = []
            for tok in b.input_ids:
                key = (node, tok)
                nxt = children.get(key)
                if nxt is None:
                    nxt = len(cur.ids)
                    cur.ids.append(tok)
                    cur.parent.append(node)
                    cur.depth.append(0 if node < 0 else cur.depth[node] + 1)
                    children[key] = nxt
                node = nxt
                nodes.append(node)
            for ti, s, t_end in b.turns:
                cur.targets.append((e, ti, nodes[s:t_end]))
            cur.paths.append(nodes)
    return trees


def group_logprobs(model, episodes: Sequence[sandbox.Episode], group_size: int, temperature: float = 1.0,
                   max_batch_tokens: int = 16384) -> list[list[torch.Tensor]]:
    """`episode_logprobs(method="tree")`, with each group of `group_size` consecutive
    rollouts scored as one tree rooted at their shared prompt (DESIGN.md section 4):
    the prompt is computed once per group, not once per rollout (RL's
    `score_method: group`). Same output shape: per episode, per turn."""
    dev = next(model.parameters()).device
    out: list[list] = [[None] * len(ep.turns) for ep in episodes]
    trees = []
    for g in range(0, len(episodes), group_size):
        (tree,) = episode_trees(episodes[g:g + group_size], None, group=True)
        tree.targets = [(g + e, ti, nodes) for e, ti, nodes in tree.targets]  # batch-wide episode indices
        trees.append(tree)
    for chunk in _chunks(trees, max_batch_tokens, "tree"):
        score_trees(model, chunk, out, temperature, dev)
    return out


def tree_mask(tree: TokenTree, width: int) -> torch.Tensor:
    """(width, width) bool: node i sees node j iff j is i or an ancestor of i.

    Nodes are created in path order, so the nodes a branch adds are a
    contiguous block [a, b): they see the branch's shared prefix and, within
    the block, themselves and what came before (lower triangle)."""
    n = len(tree.ids)
    m = torch.zeros((width, width), dtype=torch.bool)
    done = 0
    for path in tree.paths:
        new = [k for k, node in enumerate(path) if node >= done]
        if not new:
            continue
        k0 = new[0]
        a, b = path[k0], path[-1] + 1
        assert path[k0:] == list(range(a, b)), "trie nodes must be created in path order"
        if k0:
            m[a:b, torch.tensor(path[:k0])] = True
        m[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        done = b
    idx = torch.arange(n, width)
    m[idx, idx] = True  # padding sees itself only (no fully masked rows)
    return m


def score_trees(model, chunk, out, temperature, dev):
    """One forward over the trees of `chunk` (right-padded rows, each row's attention
    mask its trie: a node sees itself and its ancestors). Writes the log-probs of every
    tree's targets into `out[episode][turn]`, differentiable."""
    width = bucketed(max(len(tree.ids) for tree in chunk), dev)
    dtype = next(model.parameters()).dtype
    if not dtype.is_floating_point:
        dtype = torch.float32
    ids = torch.zeros((len(chunk), width), dtype=torch.long)
    pos = torch.zeros((len(chunk), width), dtype=torch.long)
    masks, wanted, targets, where = [], [], [], []
    for i, tree in enumerate(chunk):
        ids[i, :len(tree.ids)] = torch.tensor(tree.ids)
        pos[i, :len(tree.ids)] = torch.tensor(tree.depth)
        masks.append(tree_mask(tree, width))
        w, tg = [], []
        for e, ti, nodes in tree.targets:
            where.append((i, e, ti, len(w), len(w) + len(nodes)))
            w += [tree.parent[n] for n in nodes]
            tg += [tree.ids[n] for n in nodes]
        wanted.append(w)
        targets.append(tg)
    allowed = torch.stack(masks).to(dev)  # (B, T, T)
    add = torch.zeros((len(chunk), 1, width, width), dtype=dtype, device=dev).masked_fill_(~allowed[:, None],
                                                                                         torch.finfo(dtype).min)
    with grouped_kv_attention(model):
        attention = {}
        if torch.device(dev).type == "cpu" and shares_prompts(model):  # a GPU keeps the dense mask: not measured
            blocks = tree_blocks(allowed)
            ends = prefix_chunks(allowed) if blocks is None else None
            if blocks is not None:
                attention = {"attend": functools.partial(_block_attention, blocks=blocks)}
            elif ends is not None:
                attention = {"attend": functools.partial(_prefix_attention, ends=ends)}
        rows = _selected_logprobs(model, ids.to(dev), add, pos.to(dev), wanted=wanted, targets=targets,
                                  temperature=temperature, **attention)
    for i, e, ti, a, z in where:
        out[e][ti] = rows[i][a:z]


