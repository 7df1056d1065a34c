"""The rollout engine: exactness against the re-prefilling oracle, recorded
contexts, sampler log-probs reproduced by scoring, and the api backend."""
import contextlib
import time

import pytest
import torch

from factual_tools import engine, scoring
from newsworld import tiny
from helpers import DOC, bpe_tokenizer, post_server, script_ids, tiny_llama

TOK = bpe_tokenizer()
DOCS = [DOC, DOC[:420], "Globex shares fell 3.5% on Monday. Acme rose. Jane K. Doe resigned on Jan. 5, 2024."]

SCRIPTS = [
    'Acme reported revenue of $5 billion.<search>/revenue of/</search><delete scope="sentence"/> Acme grew. '
    'Jane Doe said, wrongly, Europe<search>Jane Doe</search> x<delete scope="clause"/> fine.',
    'Short one.<delete scope="sentence"/> Better.',
    None,  # free running: ragged lengths, truncation
    'A, b, c<delete scope="clause"/> d.<search>/Globex/</search> End.',
    '<search>/(a|a)+$/</search><search>acme</search>Acme grew 12%.<delete scope="sentence"/> Done.',
    '<delete scope="sentence"/>Nothing to delete first.',
]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(TOK, seed=0)


def scripted(n_rows):
    scripts = {i: script_ids(TOK, s) for i, s in enumerate(SCRIPTS * 3) if s and i < n_rows}
    return engine.ScriptedProcessor(scripts)


def run(model, backend, docs=DOCS, group=2, **kw):
    cfg = engine.SamplingConfig(backend=backend, temperature=kw.pop("temperature", 0.0), max_new_tokens=kw.pop("max_new", 90),
                           **kw)
    return engine.rollout(model, TOK, docs, group_size=group, cfg=cfg, logits_processor=scripted(len(docs) * group),
                     record_contexts=True)


def assert_same(a_eps, b_eps, tol=1e-4):
    for a, b in zip(a_eps, b_eps, strict=True):
        assert [t.ids for t in a.turns] == [t.ids for t in b.turns]
        assert [t.text for t in a.turns] == [t.text for t in b.turns]
        for ta, tb in zip(a.turns, b.turns):
            assert torch.allclose(torch.tensor(ta.logprobs), torch.tensor(tb.logprobs), atol=tol)
        assert a.summary == b.summary and a.flags == b.flags


def test_hf_equals_naive_with_searches_and_deletes(model):
    hf, naive = run(model, "hf"), run(model, "hf_naive")
    assert_same(hf, naive)
    assert sum(e.n_delete for e in hf) == 6 and sum(e.n_search for e in hf) == 5
    assert any(e.flags.get("truncated") for e in hf)  # the free-running rows
    assert hf[0].summary == "Acme grew. Jane Doe said, wrongly, fine."


def test_engine_contexts_are_the_episode_contexts(model):
    for backend in ("hf", "hf_naive"):
        for ep in run(model, backend):
            assert ep.meta["engine_contexts"] == ep.contexts()


def test_a_delete_frees_its_rows_slots_and_a_results_block_costs_only_its_row(model):
    """After a prune the row's length is its context's (no masked holes left behind), and
    the second forward of a step covers only the rows that took a multi-id chunk."""
    tok_pad = TOK.pad_token_id
    batch = engine._Batch(model, tok_pad, record=True)
    rows = [engine.Row(i, None) for i in range(3)]
    batch.prefill(rows, [[5, 6, 7], [8, 9]])
    batch.rows = rows[:2]
    before = batch.forward_tokens
    batch.extend([[10], [11, 12, 13, 14]])
    assert batch.forward_tokens - before == 2 * 1 + 1 * 3  # one decode step, then the block of row 1 alone
    assert [batch.context(0), batch.context(1)] == [[5, 6, 7, 10], [8, 9, 11, 12, 13, 14]]
    batch.retract(1, 3)
    batch.extend([[15], [16, 17]])
    assert [batch.context(0), batch.context(1)] == [[5, 6, 7, 10, 15], [8, 9, 11, 16, 17]]
    assert batch.lens == [5, 5]
    fresh = engine._Batch(model, tok_pad, record=True)  # the same contexts prefilled from scratch
    fresh.prefill(rows[:2], [batch.context(0), batch.context(1)])
    assert torch.allclose(batch.logits, fresh.logits, atol=1e-5)


def test_small_batches_and_many_documents(model):
    docs = [DOC[i * 37:i * 37 + 250] for i in range(5)]
    assert_same(run(model, "hf", docs=docs, group=3, batch_size=4), run(model, "hf_naive", docs=docs, group=3))


def test_sampling_with_temperature_matches_naive(model):
    a = run(model, "hf", temperature=1.0, top_p=0.9, seed=3)
    b = run(model, "hf_naive", temperature=1.0, top_p=0.9, seed=3)
    assert_same(a, b)


@pytest.mark.parametrize("method", ["branch", "tree"])
def test_episode_logprobs_reproduce_the_sampler(model, method):
    eps = run(model, "hf")
    with torch.no_grad():
        lps = scoring.episode_logprobs(model, eps, method=method, max_batch_tokens=3000)
    for e, ep in enumerate(eps):
        for ti, t in enumerate(ep.turns):
            assert lps[e][ti].shape == (len(t.ids),)
            assert torch.allclose(lps[e][ti], torch.tensor(t.logprobs), atol=1e-4)


def test_tree_scoring_sees_only_its_own_branch(model):
    """Letting a branch see retracted tokens must change its log-probs: the
    check has teeth."""
    eps = [e for e in run(model, "hf") if e.n_deleted >= 1][:1]
    tree = scoring.episode_trees(eps, None)[0]
    n = len(tree.ids)  # one chain over the same nodes: later tokens see the retracted ones too
    leaky = scoring.TokenTree(tree.ids, [i - 1 for i in range(n)], list(range(n)), tree.targets, [list(range(n))])
    out_ok = [[None] * len(eps[0].turns)]
    out_bad = [[None] * len(eps[0].turns)]
    with torch.no_grad():
        scoring.score_trees(model, [tree], out_ok, 1.0, "cpu")
        scoring.score_trees(model, [leaky], out_bad, 1.0, "cpu")
    last = len(eps[0].turns) - 1
    assert torch.allclose(out_ok[0][0], out_bad[0][0], atol=1e-5)  # before any delete: the same context
    assert not torch.allclose(out_ok[0][last], out_bad[0][last], atol=1e-3)
    assert torch.allclose(out_ok[0][last], torch.tensor(eps[0].turns[last].logprobs), atol=1e-4)


def test_group_tree_shares_the_prompt(model):
    eps = run(model, "hf", docs=[DOC], group=4)
    trees = scoring.episode_trees(eps, None, group=True)
    assert len(trees) == 1
    n_branch_tokens = sum(len(b.input_ids) for e in eps for b in e.branches())
    assert len(trees[0].ids) < 0.6 * n_branch_tokens
    out = [[None] * len(e.turns) for e in eps]
    with torch.no_grad():
        scoring.score_trees(model, trees, out, 1.0, "cpu")
    for e, ep in enumerate(eps):
        for ti, t in enumerate(ep.turns):
            assert torch.allclose(out[e][ti], torch.tensor(t.logprobs), atol=1e-4)


def _unblocked(blocks, t):
    """The (n_blocks * TREE_BLOCK, T) mask a TreeBlocks stands for, scattered back."""
    n = len(blocks.order)
    dense = torch.zeros(n * scoring.TREE_BLOCK, t, dtype=torch.bool)
    for part in blocks.parts:
        for i, blk in enumerate(part.rows.tolist()):
            rows = torch.arange(blk * scoring.TREE_BLOCK, (blk + 1) * scoring.TREE_BLOCK)[:, None]
            dense.index_put_((rows, part.cols[i][None]), part.mask[i, 0], accumulate=True)
    return dense


def test_tree_blocks_attend_where_the_mask_allows_and_skip_the_rest():
    """A tree's block form: each block of TREE_BLOCK query nodes reads only the key columns
    some of its nodes may see. On a group tree (a prompt, then rollouts that never see
    each other) that is a fraction of the dense (T, T) mask's work. A causal chain would
    skip less than half, and keeps the dense mask."""
    p, per, g = 100, 150, 6
    parent = list(range(-1, p - 1))
    for _ in range(g):
        parent += [p - 1] + list(range(len(parent), len(parent) + per - 1))
    depth = [0] * len(parent)
    for i, a in enumerate(parent):
        depth[i] = 0 if a < 0 else depth[a] + 1
    tree = scoring.TokenTree(list(range(len(parent))), parent, depth, [], [])
    tree.paths = [list(range(p)) + list(range(p + r * per, p + (r + 1) * per)) for r in range(g)]
    n = len(parent)
    allowed = scoring.tree_mask(tree, n)[None]
    blocks = scoring.tree_blocks(allowed)
    work = sum(part.mask.numel() for part in blocks.parts)
    assert work < 0.3 * n * n and len(blocks.parts) > 1
    assert torch.equal(_unblocked(blocks, n)[:n], allowed[0])
    chain = scoring.tree_mask(scoring.TokenTree(list(range(n)), [i - 1 for i in range(n)], list(range(n)), [], [list(range(n))]), n)
    assert scoring.tree_blocks(chain[None]) is None


def test_prefix_chunks_only_where_no_position_sees_a_later_one(monkeypatch):
    monkeypatch.setattr(scoring, "PREFIX_CHUNK", 4)
    chain = torch.ones(10, 10, dtype=torch.bool).tril()[None]
    assert scoring.prefix_chunks(chain) == [4, 8, 10]
    assert scoring.prefix_chunks(chain[:, :4, :4]) is None  # one chunk: nothing to skip
    ahead = chain.clone()
    ahead[0, 2, 7] = True  # position 2 sees position 7: its chunk would lose a key
    assert scoring.prefix_chunks(ahead) is None


def _scored_as_the_dense_mask(model, monkeypatch, path: str, chooser: str, score) -> list:
    """Score and backpropagate through `score(model)` twice: with the attention path `path`
    taken (checked with a spy), then with `chooser` returning None (the dense mask). Both
    must give the same log-probs and gradients; returns the first log-probs."""
    calls, real = [], getattr(scoring, path)

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(scoring, path, spy)
    results = []
    for taken in (True, False):
        if not taken:
            monkeypatch.setattr(scoring, chooser, lambda allowed: None)
        model.zero_grad()
        calls.clear()
        lps = score(model)
        (-sum(t.sum() for e in lps for t in e if t is not None)).backward()
        results.append((lps, [p.grad.clone() for p in model.parameters()]))
        assert bool(calls) == taken
    model.zero_grad()
    (a, ga), (b, gb) = results
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert (u is None and v is None) or torch.allclose(u, v, atol=1e-5)
    for u, v in zip(ga, gb):
        assert torch.allclose(u, v, atol=1e-5, rtol=1e-4)
    return a


def test_prefix_attention_scores_and_trains_as_the_dense_mask(model, monkeypatch):
    """Trees whose blocks skip too little (a few branches, as in SFT) are scored in query
    chunks against their key prefixes: the same log-probs and gradient as the dense mask."""
    eps = run(model, "hf", docs=[DOC[:150], DOC[:200]], group=1)
    assert sum(e.n_delete for e in eps) >= 1  # a tree, not only a chain
    monkeypatch.setattr(scoring, "PREFIX_CHUNK", 16)
    _scored_as_the_dense_mask(model, monkeypatch, "_prefix_attention", "prefix_chunks",
                              lambda m: scoring.episode_logprobs(m, eps))


def test_block_attention_scores_and_trains_as_the_dense_mask(model, monkeypatch):
    """Group trees scored through their blocks: the same log-probs and the same gradient as
    through the dense (T, T) mask, and the block path is the one taken."""
    eps = run(model, "hf", docs=[DOC[:150], DOC[:200]], group=6)
    assert sum(e.n_delete for e in eps) >= 4  # branches inside the rollouts too, not only between them
    monkeypatch.setattr(scoring, "TREE_BLOCK", 16)  # the tiny trees hold a few blocks of 16
    a = _scored_as_the_dense_mask(model, monkeypatch, "_block_attention", "tree_blocks",
                                  lambda m: scoring.group_logprobs(m, eps, group_size=6))
    for e, ep in enumerate(eps):  # and both are the sampler's
        for ti, t in enumerate(ep.turns):
            assert torch.allclose(a[e][ti].detach(), torch.tensor(t.logprobs), atol=1e-4)


def test_logprobs_are_differentiable(model):
    eps = run(model, "hf", docs=[DOC[:200]], group=1)
    lps = scoring.episode_logprobs(model, eps)
    loss = -sum(t.sum() for t in lps[0])
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad()


def test_rollouts_run_in_eval_mode_and_restore_training():
    m = tiny_llama(TOK, seed=1, dropout=0.5)
    m.train()
    a = run(m, "hf", docs=[DOC[:200]], group=2)
    b = run(m, "hf", docs=[DOC[:200]], group=2)
    assert m.training
    assert_same(a, b, tol=0)  # no dropout noise between two greedy rollouts


def test_rollouts_record_no_autograd_graph(model):
    """Every forward of a rollout runs with autograd off, a LoRA policy's folded one too."""
    for m in (model, lora_llama()):
        grad_on = []
        hook = m.get_input_embeddings().register_forward_hook(lambda *a: grad_on.append(torch.is_grad_enabled()))
        try:
            run(m, "hf", docs=[DOC[:200]], group=2, max_new=8)
        finally:
            hook.remove()
        assert grad_on and not any(grad_on)


def test_max_new_tokens_truncates(model):
    eps = run(model, "hf", max_new=10)
    assert all(sum(len(t.ids) for t in e.turns) <= 10 for e in eps)
    assert all(e.flags.get("truncated") or e.turns[-1].ended in ("eos", "cap") for e in eps)


def test_sample_top_p_keeps_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0]])
    g = torch.Generator().manual_seed(0)
    seen = {engine.sample(logits, 1.0, 0.5, g)[0].item() for _ in range(50)}
    assert seen == {0}
    tok, lp = engine.sample(logits, 0.0, 1.0, None)
    assert tok.item() == 0 and abs(lp.item() - torch.log_softmax(logits, -1)[0, 0].item()) < 1e-6



def test_grouped_kv_attention_equals_transformers_sdpa_and_is_restored(model):
    """The engine's and the scorer's attention (KV heads read in place) against
    transformers' own sdpa path (KV heads repeated), with a 4D tree-like mask."""
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # the helper model has GQA
    ids = torch.tensor([TOK.encode(DOC[:200])[:40]] * 2)
    t = ids.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    mask[20:, 10:20] = False  # a second branch that does not see a retracted span
    mask = mask[None, None].expand(2, 1, t, t)
    pos = torch.arange(t)[None].expand(2, t)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        with engine.grouped_kv_attention(model):
            assert model.config._attn_implementation == engine.GQA_ATTENTION
            got = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.allclose(got, want, atol=1e-5)


def test_a_prefix_every_prompt_shares_is_computed_once_and_changes_nothing(model):
    assert engine._common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert engine._common_prefix([[1, 2, 3], [1, 2, 3]]) == 2  # each keeps one id of its own
    ids = TOK.encode(DOC)
    prompts = [ids[:40] + ids[60:70], ids[:40] + ids[80:95], ids[:40] + ids[100:101]]
    batch = engine._Batch(model, TOK.pad_token_id, record=True)
    batch.prefill([engine.Row(i, None) for i in range(3)], prompts)
    assert batch.forward_tokens == 40 + 3 * 15  # the shared 40 once, then the rest padded to 15
    assert [batch.context(i) for i in range(3)] == prompts
    for i, p in enumerate(prompts):
        alone = engine._Batch(model, TOK.pad_token_id, record=False)
        alone.prefill([engine.Row(0, None)], [p])
        assert torch.allclose(batch.logits[i], alone.logits[0], atol=1e-5)


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]


def test_width_groups_is_the_cheapest_partition_of_the_rows():
    cost = lambda lens, groups, o: sum(o + len(g) * max(lens[i] for i in g) for g in groups)
    rng = torch.Generator().manual_seed(0)
    for _ in range(40):
        n = int(torch.randint(1, 7, (1,), generator=rng))
        lens = torch.randint(1, 300, (n,), generator=rng).tolist()
        for o in (0, 48, 400):
            got = engine.width_groups(lens, o)
            assert sorted(i for g in got for i in g) == list(range(n))  # each row once
            best = min(cost(lens, p, o) for p in _partitions(list(range(n))))
            assert cost(lens, got, o) == best
    assert engine.width_groups([300, 5, 290, 6], None) == [[0, 1, 2, 3]]  # no split: one forward, in order
    assert engine.width_groups([300, 5, 290, 6], 48) == [[0, 2], [1, 3]]
    assert engine.width_groups([1] * 32, 48) == [list(range(32))]  # a decode step: one forward, in order


def test_a_prefill_of_unequal_prompts_splits_by_length_and_changes_nothing(model):
    """On a CPU, prompts of very unequal lengths go through forwards of similar
    lengths: fewer padded positions, the same logits and contexts."""
    ids = TOK.encode(DOC) * 2
    prompts = [ids[:40] + ids[40:200], ids[:40] + ids[50:52], ids[:40] + ids[60:210], ids[:40] + ids[70:73]]
    batch = engine._Batch(model, TOK.pad_token_id, record=True)
    batch.prefill([engine.Row(i, None) for i in range(4)], prompts)
    assert batch.forward_tokens == 40 + 2 * 160 + 2 * 3  # not 40 + 4 * 160 in one forward
    assert [batch.context(i) for i in range(4)] == prompts
    for i, p in enumerate(prompts):
        alone = engine._Batch(model, TOK.pad_token_id, record=False)
        alone.prefill([engine.Row(0, None)], [p])
        assert torch.allclose(batch.logits[i], alone.logits[0], atol=1e-5)
    batch.extend([[5, 6, 7, 8, 9, 10] * 20, [11], [12, 13], [14, 15] * 40])  # results blocks too
    whole = [p + c for p, c in zip(prompts, [[5, 6, 7, 8, 9, 10] * 20, [11], [12, 13], [14, 15] * 40])]
    assert [batch.context(i) for i in range(4)] == whole
    for i, p in enumerate(whole):
        alone = engine._Batch(model, TOK.pad_token_id, record=False)
        alone.prefill([engine.Row(0, None)], [p])
        assert torch.allclose(batch.logits[i], alone.logits[0], atol=1e-4)


def test_groups_keep_one_copy_of_their_prompt(model):
    """A prefill expanded to G rows keeps the prompt once per document; the rows'
    own slots hold only what they write after it."""
    batch = engine._Batch(model, TOK.pad_token_id, record=False)
    prompts = [TOK.encode(DOC)[:50], TOK.encode(DOC)[:30]]
    batch.prefill([engine.Row(i, None) for i in range(6)], prompts, expand=3)
    cache = batch.cache
    assert cache.pkeys[0].shape[0] == 2 and cache.pkeys[0].shape[2] == 50
    assert cache.base == [50, 50, 50, 30, 30, 30] and batch.lens == cache.base
    batch.extend([[7]] * 6)
    assert batch.lens == [51, 51, 51, 31, 31, 31] and cache.kv_len == 1
    with pytest.raises(AssertionError, match="shared prompt"):
        batch.retract(3, 29)


def _nucleus_by_full_sort(probs, top_p):
    sp, si = probs.sort(-1, descending=True)
    sp = sp.masked_fill(sp.cumsum(-1) - sp > top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, si, sp)


@pytest.mark.parametrize("k", [1, 3, 256])
def test_nucleus_equals_a_full_sort_whether_or_not_the_top_k_hold_it(k):
    g = torch.Generator().manual_seed(0)
    peaked = torch.randn(6, 500, generator=g) * 8  # a few ids hold the mass: the top k suffice
    flat = torch.randn(6, 500, generator=g) * 0.1  # the nucleus is hundreds of ids wide: rows sorted whole
    probs = torch.cat([peaked, flat]).softmax(-1)
    for top_p in (0.05, 0.5, 0.9, 0.99):
        got = engine.nucleus(probs, top_p, k=k)
        assert torch.equal(got > 0, _nucleus_by_full_sort(probs, top_p) > 0)
        assert torch.allclose(got, _nucleus_by_full_sort(probs, top_p))


# ---------------------------------------------------------------------------
# api backend against a local OpenAI-compatible server


class _Server:
    """Answers /v1/completions from a script; fails with 429 and 500 first."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.requests = []
        self.failures = [429, 500]
        self.url, self.httpd = post_server(self.answer)

    def answer(self, body):
        if self.failures:
            return self.failures.pop(0), b"try later"
        self.requests.append(body)
        text, reason = self.replies.pop(0)
        return 200, {"choices": [{"text": text, "finish_reason": reason}],
                     "usage": {"prompt_tokens": 10, "completion_tokens": len(text.split())}}


def test_api_backend_drives_the_sandbox():
    srv = _Server([
        ("Acme made $5 billion.<search>/revenue of/", "stop"),  # stop string stripped by the server
        ('<delete scope="sentence"', "stop"),
        (" Acme made $4.2 billion.", "stop"),
    ])
    cfg = engine.SamplingConfig(backend="api", api_base=srv.url, api_model="teacher", api_concurrency=1,
                           max_new_tokens=500)
    client = engine.ApiClient(srv.url, "teacher", retries=3, backoff_s=0.01, concurrency=1)
    try:
        [ep] = engine.rollout_api([DOC], 1, cfg, client=client)
    finally:
        srv.httpd.shutdown()
    assert [c.kind for c in ep.calls] == ["search", "delete"]
    assert ep.summary == "Acme made $4.2 billion."
    assert client.usage["retries"] == 2 and client.usage["requests"] == 3
    assert srv.requests[0]["stop"] == engine.API_STOPS
    # the second request continues from the text so far, results included
    assert srv.requests[1]["prompt"].endswith("</search>" + ep.turns[0].injected)
    # the third sees the pruned context: the retracted sentence is gone
    assert "$5 billion" not in srv.requests[2]["prompt"].split("Summary: ")[1]
    assert not ep.has_ids and ep.tokenized(TOK).has_ids


def test_api_client_gives_up_with_a_clear_error():
    srv = _Server([])
    srv.failures = [500] * 10
    client = engine.ApiClient(srv.url, "m", retries=2, backoff_s=0.01)
    try:
        with pytest.raises(engine.ApiError, match="gave up after 3 attempts"):
            client.post("/completions", {"prompt": "x"})
    finally:
        srv.httpd.shutdown()


@pytest.mark.gpu
def test_vllm_backend_agrees_with_the_trainer(tmp_path):  # pragma: no cover - needs CUDA and vLLM
    vllm = pytest.importorskip("vllm")
    from factual_tools import modeling
    import newsworld
    from transformers import AutoModelForCausalLM

    path = tiny.build_tiny_model("tiny-1m", tmp_path / "m")
    tok = modeling.load_tokenizer(path)
    llm = vllm.LLM(model=str(path), dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3,
                   logprobs_mode="processed_logprobs")
    docs = [d.text for d in newsworld.documents(4, seed=0)]
    eps = engine.rollout(llm, tok, docs, 2, engine.SamplingConfig(backend="vllm", temperature=1.0, max_new_tokens=64))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda()
    with torch.no_grad():
        lps = scoring.episode_logprobs(model, eps)
    for e, ep in enumerate(eps):
        assert ep.has_ids and len(ep.contexts()) == len(ep.turns)
        for ti, t in enumerate(ep.turns):
            assert torch.allclose(lps[e][ti].cpu(), torch.tensor(t.logprobs), atol=5e-2)


def test_stop_ids_take_the_generation_configs_end_ids_and_every_end_token(tmp_path):
    """A Qwen3-style model: eos <|im_end|>, generation config [<|im_end|>, <|endoftext|>]; a
    chat model that writes <|endoftext|> must stop there, not run on to the token limit."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from factual_tools import modeling

    vocab = {"<|im_end|>": 0, "<|endoftext|>": 1, "<|pad|>": 2, "a": 3, "b": 4, "<|special|>": 5}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<|pad|>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|pad|>",
                                  extra_special_tokens=["<|endoftext|>", "<|special|>"])
    tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    loaded = modeling.load_tokenizer(str(tmp_path))
    assert loaded.generation_eos_ids == [0, 5]
    assert engine.stop_ids(loaded) == [0, 1, 5]  # eos, <|endoftext|> by name, the config's 5
    (tmp_path / "generation_config.json").write_text("{not json")
    assert modeling.load_tokenizer(str(tmp_path)).generation_eos_ids == []
    assert modeling.generation_eos_ids(str(tmp_path / "nowhere")) == []


def test_make_generator_lives_on_the_models_device_and_draws_like_the_default():
    model = tiny_llama(bpe_tokenizer())
    g = engine.make_generator(7, model)
    assert g.device == next(model.parameters()).device
    assert torch.equal(torch.rand(5, generator=g), torch.rand(5, generator=torch.Generator().manual_seed(7)))
    logits = torch.randn(4, 50)
    a = engine.sample(logits, 1.0, 1.0, engine.make_generator(3, "cpu"))
    b = engine.sample(logits, 1.0, 1.0, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.gpu
def test_sampling_cuda_logits_with_a_cuda_generator_and_with_a_resumed_cpu_one():
    logits = torch.randn(4, 50, device="cuda")
    tok, lp = engine.sample(logits, 1.0, 0.9, engine.make_generator(0, "cuda"))
    assert tok.device.type == "cuda" and lp.device.type == "cuda"
    tok_cpu, _ = engine.sample(logits, 1.0, 0.9, torch.Generator().manual_seed(0))  # a CPU state resumed on a GPU
    assert tok_cpu.device.type == "cuda"
    assert torch.equal(tok_cpu.cpu(), engine.sample(logits.cpu(), 1.0, 0.9, torch.Generator().manual_seed(0))[0])


def test_api_backend_guards_the_context_too():
    """A document whose prompt and results pass max_context_tokens (about four characters a
    token) ends the episode as truncated instead of sending the server an over-long prompt."""
    srv = _Server([("Acme made $5 billion.<search>/revenue of/", "stop"), (" More.", "stop")])
    srv.failures = []
    prompt = len(__import__("sandbox").prompt_messages(DOC)[1]["content"]) + len(S_PROMPT)
    room = (prompt + 80) // 4  # the prompt and the first round's 46 characters, not the results after them
    cfg = engine.SamplingConfig(backend="api", api_base=srv.url, api_model="teacher", api_concurrency=1,
                           max_new_tokens=500, max_context_tokens=room)
    try:
        [ep] = engine.rollout_api([DOC], 1, cfg, client=engine.ApiClient(srv.url, "teacher", retries=0))
    finally:
        srv.httpd.shutdown()
    assert ep.flags.get("truncated") and len(srv.requests) == 1
    assert srv.requests[0]["max_tokens"] <= 4 * room - prompt


S_PROMPT = __import__("sandbox").SYSTEM_PROMPT


def test_draw_samples_the_distribution_and_never_an_id_of_probability_zero(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 2.0, 0.0, 5.0, 3.0, 0.0]]).repeat(100_000, 1)  # unnormalised, zeros at both ends
    freq = torch.bincount(engine.draw(p, gen), minlength=6).double() / len(p)
    assert torch.allclose(freq, torch.tensor([0, 0.2, 0, 0.5, 0.3, 0], dtype=torch.float64), atol=0.006)
    for u in (0.0, 1 - 2 ** -53):  # the ends of torch.rand's range
        monkeypatch.setattr(torch, "rand", lambda *a, u=u, **k: torch.full(a[0], u, dtype=torch.float64))
        assert engine.draw(p[:1], gen).item() == (1 if u == 0 else 4)


def test_a_model_that_post_processes_its_logits_is_scored_through_its_own_forward():
    """Scoring applies the output head to the wanted positions only when that is what the
    model's forward does; a model that soft-caps its logits is scored through forward."""
    from transformers import LlamaForCausalLM

    class SoftCapped(LlamaForCausalLM):  # a scale before the cap, as Gemma's and Cohere's heads have
        def forward(self, *a, **k):
            out = super().forward(*a, **k)
            out.logits = 3 * torch.tanh(out.logits)
            return out

    plain = tiny_llama(TOK, seed=1)
    capped = SoftCapped(plain.config)
    capped.load_state_dict(plain.state_dict())
    eps = run(plain, "hf", docs=DOCS[:2], group=1)
    for m in (plain, capped):
        m.train()  # the check runs in eval mode whatever mode the model is in
        assert scoring.head_is_plain(m) is (m is plain)
        got = scoring.episode_logprobs(m, eps)
        want = scoring.episode_logprobs(m, eps, method="branch")  # the reference path: one sequence per branch
        for a, b in zip(got, want):
            assert all(torch.allclose(x, y, atol=1e-4) for x, y in zip(a, b) if x is not None)
    assert not torch.allclose(scoring.episode_logprobs(plain, eps)[0][0], scoring.episode_logprobs(capped, eps)[0][0])


class _Hostile:
    """An endpoint on 127.0.0.1 answering by path: a redirect to another host, an oversized
    body, deep nesting, a JSON array, and a 429 with Retry-After before an answer. Records
    the Authorization header of every request it receives."""

    def __init__(self, other_port: int = 0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.auth, self.hits = [], {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.auth.append(self.headers.get("Authorization"))
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.auth.append(self.headers.get("Authorization"))
                path = self.path.rsplit("/", 1)[-1]
                outer.hits[path] = outer.hits.get(path, 0) + 1
                headers, status = {}, 200
                if path == "redirect":  # urllib follows a 302 after a POST as a GET, headers and all
                    status, body = 302, b""
                    headers["Location"] = f"http://localhost:{other_port}/v1/steal"
                elif path == "big":
                    body = b'{"x": "' + b"a" * 2_000_000 + b'"}'
                elif path == "nested":
                    body = b"[" * 5000 + b"]" * 5000
                elif path == "array":
                    body = b"[1, 2]"
                elif path == "busy" and outer.hits[path] == 1:
                    status, body = 429, b"{}"
                    headers["Retry-After"] = "0"
                else:
                    body = b'{"ok": true}'
                self.send_response(status)
                for k, v in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


def test_api_client_refuses_redirects_oversized_and_malformed_answers():
    other = _Hostile()  # "another host": localhost, not 127.0.0.1
    srv = _Hostile(other.port)
    client = engine.ApiClient(f"http://127.0.0.1:{srv.port}/v1", "m", key="secret", retries=2, backoff_s=5.0,
                         max_response_bytes=1 << 20)
    try:
        with pytest.raises(engine.ApiError, match="redirect to http://localhost"):
            client.post("/redirect", {})
        assert other.auth == [] and srv.auth == ["Bearer secret"]  # the key never left for the other host
        with pytest.raises(engine.ApiError, match="over 1048576 bytes"):
            client.post("/big", {})
        with pytest.raises(engine.ApiError, match="not JSON.*RecursionError"):
            client.post("/nested", {})
        with pytest.raises(engine.ApiError, match="a JSON list, not an object"):
            client.post("/array", {})
        t0 = time.perf_counter()
        assert client.post("/busy", {}) == {"ok": True}  # Retry-After: 0, not the 5 s backoff
        assert time.perf_counter() - t0 < 2 and client.usage["retries"] == 1
    finally:
        srv.httpd.shutdown()
        other.httpd.shutdown()


def test_bf16_scoring_on_a_cpu_rounds_its_shapes_up_and_scores_the_same(model, monkeypatch):
    """Under bf16 autocast on a CPU every scored width and head batch is a multiple of
    SHAPE_STEP (oneDNN builds and keeps a kernel per shape); the padding is masked out:
    the log-probs are those of the unpadded forward. Without autocast nothing is padded."""
    eps = run(model, "hf")
    with torch.no_grad():
        scoring.episode_logprobs(model, eps[:1])  # the once-per-model head check runs its own short forwards
    widths, real = [], model.get_decoder().forward

    def spy(*a, **k):
        widths.append(k["input_ids"].shape[1])
        return real(*a, **k)

    monkeypatch.setattr(model.get_decoder(), "forward", spy)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        padded = scoring.episode_logprobs(model, eps, method="tree")
        monkeypatch.setattr(scoring, "SHAPE_STEP", 1)
        plain = scoring.episode_logprobs(model, eps, method="tree")
    assert widths and all(w % 64 == 0 for w in widths[:len(widths) // 2]), widths
    assert any(w % 64 for w in widths[len(widths) // 2:])  # the check has teeth: real widths are ragged
    for a, b in zip(padded, plain):
        for x, y in zip(a, b):
            assert x.shape == y.shape and torch.allclose(x.float(), y.float(), atol=2e-2)
    widths.clear()
    with torch.no_grad():
        scoring.episode_logprobs(model, eps, method="tree")
    assert any(w % 64 for w in widths)  # fp32: nothing padded


def test_timed_parts_times_the_engine_parts_and_restores_them(model):
    """bench/rollout.py's profile: every part the engine ran has time, attention is inside the
    forward, and after the block the engine runs its own functions again, untimed."""
    before = (engine.sample, engine.ScriptedProcessor.__call__)
    with engine.timed_parts() as secs:
        eps = run(model, "hf")
    assert sum(e.n_search for e in eps) == 5  # the scripted tool calls ran through the timed sandbox
    for part in ("forward", "attention", "cache writes", "sampling", "sandbox", "script (bench only)"):
        assert secs[part] > 0, part
    assert secs["attention"] < secs["forward"]
    assert (engine.sample, engine.ScriptedProcessor.__call__) == before
    with engine.timed_parts() as again:
        pass
    run(model, "hf")
    assert sum(again.values()) == 0


def test_the_shared_prompt_grid_is_arranged_again_after_the_rows_change():
    """A decode step of the same rows reuses the last forward's grid; rows kept in another
    order (the same count) are other documents' rows, and get their own grid."""
    def cache_of(lens, expand):
        cache = engine._RaggedCache(1)
        cache.keys = cache.values = [torch.zeros((len(lens), 1, max(lens), 2))]
        cache.share_prompts(lens, expand)
        return cache

    cache = cache_of([3, 5], 2)  # rows 0, 1 of document 0; rows 2, 3 of document 1
    cache.arrange([0, 1, 2, 3])
    cache.select_rows(torch.tensor([2, 0, 3, 1]))  # documents 1, 0, 1, 0
    cache.arrange([0, 1, 2, 3])
    fresh = cache_of([3, 5], 2)
    fresh.select_rows(torch.tensor([2, 0, 3, 1]))
    fresh.arrange([0, 1, 2, 3])
    for name in ("grid", "inv", "prompt_add"):
        assert torch.equal(getattr(cache, name), getattr(fresh, name)), name


def lora_llama(seed: int = 0, **lora):
    """tiny_llama with a LoRA adapter whose B is not zero (a fresh one would change nothing)."""
    import peft

    model = peft.get_peft_model(tiny_llama(TOK, seed=seed), peft.LoraConfig(
        r=4, lora_alpha=8, **{"target_modules": "all-linear", **lora}))
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_embedding_B" in name:
                p.normal_(0, 0.3)
    return model


def adapter_calls(model):
    """A Counter of the LoRA A modules' forwards (it counts while the hooks stay)."""
    import collections

    calls = collections.Counter()
    for name, m in model.named_modules():
        if name.endswith("lora_A.default") or name.endswith("lora_embedding_A"):
            m.register_forward_hook(lambda *a: calls.update(["A"]))
    return calls


@pytest.mark.parametrize("lora, folded", [({}, True), ({"use_dora": True}, False),
                                          ({"target_modules": ["q_proj", "embed_tokens"]}, False)])
def test_a_lora_policy_decodes_with_its_adapter_folded_in_and_gets_its_weights_back(monkeypatch, lora, folded):
    """The fold (`merged_adapters`) writes what the adapter computing beside its base writes,
    keeps the adapter off while decoding, and leaves every parameter the same tensor with the
    same values; DoRA and an adapter on an embedding are not folded, and decode as they are."""
    model = lora_llama(**lora)
    ids = torch.tensor([TOK.encode(DOC)[:20]])
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    calls = adapter_calls(model)
    eps = run(model, "hf")
    assert (calls["A"] == 0) == folded, calls
    with monkeypatch.context() as m:
        m.setattr(engine, "merged_adapters", contextlib.nullcontext)
        plain = run(model, "hf")
    assert calls["A"] > 0
    assert_same(eps, plain)
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for n, (p, value) in before.items():
        assert after[n] is p and torch.equal(p, value), n
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits)  # the adapter is on again
    assert model.training


def test_the_shared_prompt_attention_gathers_only_when_some_documents_rows_are_missing(model):
    """A forward of every row, each document's G rows together, attends without a gather;
    a forward of some rows only (rows ended, a results block) through one; both equal
    re-prefilling."""
    seen = []
    arrange = engine._RaggedCache.arrange

    def spy(self, rows):
        arrange(self, rows)
        seen.append(self.in_order)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine._RaggedCache, "arrange", spy)
        hf = run(model, "hf", group=3)
    assert True in seen and False in seen  # some rows finish early or write a results block
    assert_same(hf, run(model, "hf_naive", group=3))


@pytest.mark.parametrize("order", [[0, 1, 2, 3], [2, 0, 3, 1], [0, 1, 2]])
def test_shared_prompt_attention_equals_attention_over_each_rows_whole_context(order):
    """`_ragged_attention` on rows in document order (no gather), interleaved (a full grid
    out of order) and with a document short of a row: each row's output is attention over
    its prompt's keys followed by its own unmasked slots, 4 query heads on 2 KV heads."""
    torch.manual_seed(0)
    lens, h, hkv, d, w, t = [3, 5], 4, 2, 8, 2, 6
    cache = engine._RaggedCache(1)
    cache.keys = cache.values = [torch.zeros((2, hkv, 5, d))]
    cache.share_prompts(lens, 2)  # rows 0, 1 of document 0; rows 2, 3 of document 1
    cache.pkeys, cache.pvalues = [torch.randn(2, hkv, 5, d)], [torch.randn(2, hkv, 5, d)]
    cache.select_rows(torch.tensor(order))
    cache.arrange(list(range(len(order))))
    n = len(order)
    q, k, v = torch.randn(n, h, w, d), torch.randn(n, hkv, t, d), torch.randn(n, hkv, t, d)
    mask = torch.rand(n, 1, w, t) > 0.4
    mask[..., 0] = True
    out, _ = engine._ragged_attention(type("Layer", (), {"layer_idx": 0}), q, k, v, mask, scaling=0.3, cache=cache)
    for r in range(n):
        doc, base = cache.doc[r], cache.base[r]
        for head in range(h):
            kv = head // (h // hkv)
            for i in range(w):
                keys = torch.cat([cache.pkeys[0][doc, kv, :base], k[r, kv][mask[r, 0, i]]])
                vals = torch.cat([cache.pvalues[0][doc, kv, :base], v[r, kv][mask[r, 0, i]]])
                want = ((keys @ q[r, head, i]) * 0.3).softmax(-1) @ vals
                assert torch.allclose(out[r, i, head], want, atol=1e-5), (r, head, i)
