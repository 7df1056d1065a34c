"""The vllm backend on CPU: `engine.rollout_vllm` driven by a stand-in for the
parts of vLLM it uses (`SamplingParams`, `vllm.inputs.TokensPrompt`,
`LLM.generate` and the `RequestOutput`s it returns), which samples from a tiny
HF model one token at a time. Episodes must equal the re-prefilling oracle's
(`hf_naive`) under the same script, recorded log-probs must be what the
trainer's scorer recomputes, and stop strings must end rounds as vLLM ends them."""
import sys
import types
from dataclasses import dataclass
from typing import TypedDict

import pytest
import torch
import torch.nn.functional as F

import sandbox
from factual_tools import engine, scoring
from helpers import DOC, bpe_tokenizer, script_ids, tiny_llama

TOK = bpe_tokenizer()
EOS = TOK.eos_token_id


# ---------------------------------------------------------------------------
# A CPU stand-in for vLLM's offline API (V1 engine)
#
# Structures as in vLLM: vllm/outputs.py (CompletionOutput, RequestOutput),
# vllm/logprobs.py (Logprob; a completion's `logprobs` is a list with one
# {token id: Logprob} dict per generated token: the sampled token, then the
# top `logprobs` tokens), vllm/inputs (TokensPrompt).
#
# Stopping as in the V1 engine. After each token the engine core checks, in
# this order: eos (finish_reason "stop", stop_reason None), an id of
# `stop_token_ids` (stop_reason = that id), the length cap (max_tokens or
# max_model_len: "length"); see vllm/v1/core/sched/utils.py `check_stop`. The
# detokenizer then looks for stop strings in the new text, from len(stop) - 1
# characters before it so a stop string spread over several tokens is found,
# taking the first of `stop` (in list order) that occurs (`check_stop_strings`
# in vllm/v1/engine/detokenizer.py). A match finishes the request with
# finish_reason "stop" and stop_reason the string, also when the same token
# reached max_tokens. With include_stop_str_in_output=True (what rollout_vllm
# asks for) the text is cut just after the stop string, with False just before
# it (and a stop token is then not detokenized); `token_ids` keeps every
# generated id either way, including the whole of a token that carries
# characters past the stop string.


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # the token's rank in the vocabulary, >= 1
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: int | str | None = None  # the stop string or stop token id; None at eos and length
    lora_request: object | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: object | None = None
    lora_request: object | None = None
    num_cached_tokens: int | None = None


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


@dataclass(kw_only=True)
class SamplingParams:
    """The parameters this stand-in implements, with vLLM's defaults. Any other
    keyword is a TypeError: a parameter rollout_vllm starts to pass shows up
    here instead of being silently ignored."""
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None  # log-probs of the sampled token plus this many top tokens
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):  # the checks of vLLM's SamplingParams._verify_args that apply
        if self.n != 1:
            raise ValueError("this stand-in returns one completion per prompt")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop and not all(self.stop):
            raise ValueError("stop cannot contain an empty string")


def check_stop_strings(text: str, new_chars: int, stop: list[str], include: bool) -> tuple[str, int] | None:
    """vLLM's check: (stop string, length to cut the text to or -1), or None."""
    if not new_chars or not stop:
        return None
    for s in stop:
        i = text.find(s, 1 - new_chars - len(s))
        if i == -1:
            continue
        if include:
            i += len(s)
            if i >= len(text):
                return s, -1
        return s, i
    return None


@dataclass
class Request:
    """What one request asked for (kept for the tests' checks)."""
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: object | None
    output: CompletionOutput | None = None


class LLM:
    """`LLM.generate` on token-id prompts, sampled from an HF causal LM one
    token at a time (a KV cache per request, requests one after another).

    `logprobs_mode` is vLLM's engine argument: "raw_logprobs" (its default:
    log_softmax of the model's logits) or "processed_logprobs" (after
    temperature and top-p; tokens top-p drops are at -inf; greedy requests get
    the raw ones). A seeded request samples from its own generator, as in vLLM.

    `scripts` maps prompt ids (a document's prompt) to the ids the episode
    whose requests start with them must write, in order, across all its
    requests: `engine.ScriptedProcessor` for this engine, where a row is found
    by its prompt instead of its index (so one scripted episode per document).
    A scripted id is taken whatever the sampler would have chosen and is
    reported with the policy's log-prob, as vLLM reports a token a logits
    processor forced in raw_logprobs mode."""

    def __init__(self, model, tokenizer, logprobs_mode: str = "raw_logprobs",
                 scripts: dict[tuple[int, ...], list[int]] | None = None, max_model_len: int | None = None):
        assert logprobs_mode in ("raw_logprobs", "processed_logprobs")
        self.model, self.tokenizer, self.logprobs_mode = model, tokenizer, logprobs_mode
        self.scripts = {tuple(k): list(v) for k, v in (scripts or {}).items()}
        self.written = {k: 0 for k in self.scripts}  # ids each scripted episode has generated
        self.max_model_len = max_model_len or model.config.max_position_embeddings
        self.eos_token_id = tokenizer.eos_token_id
        self.generator = torch.Generator().manual_seed(1234)  # for unseeded requests
        self.requests: list[Request] = []
        self.generate_calls = 0

    def script_key(self, prompt: list[int]) -> tuple[int, ...] | None:
        keys = [k for k in self.scripts if tuple(prompt[:len(k)]) == k]
        return max(keys, key=len) if keys else None

    @torch.no_grad()
    def generate(self, prompts, sampling_params=None, use_tqdm=True, lora_request=None, priority=None):
        prompts = [prompts] if isinstance(prompts, dict) else list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("The lengths of prompts and sampling_params must be the same.")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        keys = [self.script_key(list(p["prompt_token_ids"])) for p in prompts]
        scripted = [k for k in keys if k is not None]
        if len(scripted) != len(set(scripted)):
            raise ValueError("two requests of one generate call follow the same script (one episode per document)")
        self.generate_calls += 1
        was_training = self.model.training
        self.model.eval()
        try:
            return [self._request(list(p["prompt_token_ids"]), sp, lora, key)
                    for p, sp, lora, key in zip(prompts, params, loras, keys)]
        finally:
            self.model.train(was_training)

    def _logprobs_at(self, lp: torch.Tensor, tok: int, k: int) -> dict[int, Logprob]:
        """One position of vLLM's sample log-probs: the sampled token, then the top k."""
        out = {tok: Logprob(lp[tok].item(), int((lp > lp[tok]).sum()) + 1, self.tokenizer.decode([tok]))}
        if k:
            top = lp.topk(k)
            for r, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                out[i] = Logprob(v, r, self.tokenizer.decode([i]))
        return out

    def _request(self, prompt: list[int], sp: SamplingParams, lora, key) -> RequestOutput:
        if len(prompt) > self.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(prompt)}) is longer than the maximum model "
                             f"length of {self.max_model_len}.")
        req = Request(prompt, sp, lora)
        self.requests.append(req)
        gen = torch.Generator().manual_seed(sp.seed) if sp.seed is not None else self.generator
        greedy = sp.temperature < 1e-5  # vLLM's _SAMPLING_EPS
        eos = None if sp.ignore_eos else self.eos_token_id
        script = self.scripts.get(key, [])
        done = self.written.get(key, 0)
        ids: list[int] = []
        logprobs = [] if sp.logprobs is not None else None
        cumulative = 0.0
        text, finish, stop_reason = "", None, None
        out = self.model(input_ids=torch.tensor([prompt]), use_cache=True)
        while True:
            logits = out.logits[0, -1].float()
            raw = F.log_softmax(logits, dim=-1)
            if greedy:
                processed = raw
            else:
                processed = F.log_softmax(logits / sp.temperature, dim=-1)
                if sp.top_p < 1.0:  # keep the smallest prefix of the sorted tokens with mass >= top_p
                    p, order = processed.exp().sort(descending=True)
                    drop = torch.zeros_like(processed, dtype=torch.bool)
                    drop[order] = p.cumsum(0) - p > sp.top_p
                    processed = F.log_softmax(processed.masked_fill(drop, float("-inf")), dim=-1)
            n = done + len(ids)
            if n < len(script):
                tok = script[n]
            elif greedy:
                tok = int(logits.argmax())
            else:
                tok = int(torch.multinomial(processed.exp(), 1, generator=gen))
            ids.append(tok)
            if logprobs is not None:
                lp = raw if self.logprobs_mode == "raw_logprobs" else processed
                logprobs.append(self._logprobs_at(lp, tok, sp.logprobs))
                cumulative += lp[tok].item()
            # the engine core's checks
            if tok == eos:
                finish = "stop"
            elif tok in (sp.stop_token_ids or ()):
                finish, stop_reason = "stop", tok
            elif len(prompt) + len(ids) >= self.max_model_len or (sp.max_tokens and len(ids) >= sp.max_tokens):
                finish = "length"
            # the detokenizer's: text so far, then stop strings in its new characters
            shown = ids[:-1] if finish == "stop" and not sp.include_stop_str_in_output else ids
            new_text = self.tokenizer.decode(shown, skip_special_tokens=sp.skip_special_tokens)
            new_chars, text = len(new_text) - len(text), new_text
            hit = check_stop_strings(text, new_chars, sp.stop or [], sp.include_stop_str_in_output)
            if hit:
                stop_str, cut = hit
                if cut != -1:
                    text = text[:cut]
                finish, stop_reason = "stop", stop_str
            if finish:
                break
            out = self.model(input_ids=torch.tensor([[tok]]), past_key_values=out.past_key_values, use_cache=True)
        if key is not None:
            self.written[key] = done + len(ids)
        c = CompletionOutput(0, text, ids, cumulative if logprobs is not None else None, logprobs, finish,
                             stop_reason, lora)
        req.output = c
        return RequestOutput(str(len(self.requests) - 1), None, prompt, None, [c], True, lora_request=lora,
                             num_cached_tokens=0)


def fake_vllm_modules() -> dict[str, types.ModuleType]:
    vllm = types.ModuleType("vllm")
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = TokensPrompt
    vllm.inputs = inputs
    vllm.LLM, vllm.SamplingParams = LLM, SamplingParams
    vllm.RequestOutput, vllm.CompletionOutput = RequestOutput, CompletionOutput
    return {"vllm": vllm, "vllm.inputs": inputs}


@pytest.fixture
def fake_vllm(monkeypatch):
    """The stand-in installed as `vllm` (and `vllm.inputs`, which rollout_vllm imports)."""
    mods = fake_vllm_modules()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["vllm"]


# ---------------------------------------------------------------------------
# Set-up: documents with one script each, run by both engines

# One episode per document (the stand-in finds a script by its prompt).
DOCS = [DOC, DOC[:300], "Globex shares fell 3.5% on Monday. Acme rose. Jane K. Doe resigned on Jan. 5, 2024.",
        DOC[37:287], DOC[74:324], DOC[111:361]]

SCRIPTS = [
    'Acme reported revenue of $5 billion.<search>/revenue of/</search><delete scope="sentence"/> Acme grew.',
    'Jane Doe said, wrongly, Europe<search>Jane Doe</search> x<delete scope="clause"/> fine.',
    None,  # free running: truncated at max_new_tokens
    'A, b, c<delete scope="clause"/> d.<search>/Globex/</search> End.',
    '<search>acme</search>Acme grew 12%.<delete scope="sentence"/> Done.',
    '<delete scope="sentence"/>Nothing to delete first.',
]


@pytest.fixture(scope="module")
def model():
    return tiny_llama(TOK, seed=0)


def tok_id(piece: str) -> int:
    [i] = TOK.encode(piece, add_special_tokens=False)
    return i


def prompt_key(doc: str) -> tuple[int, ...]:
    return tuple(sandbox.prompt_ids(TOK, doc))


def run_both(model, docs, scripts: list[list[int] | None], max_new: int = 90, **kw):
    """(vllm episodes, hf_naive episodes, the stand-in engine), greedy, one episode per document."""
    assert len(set(docs)) == len(docs)
    cfg = engine.SamplingConfig(backend="vllm", temperature=0.0, max_new_tokens=max_new, **kw)
    llm = LLM(model, TOK, scripts={prompt_key(d): s for d, s in zip(docs, scripts) if s})
    eps = engine.rollout_vllm(llm, TOK, docs, 1, cfg)
    naive_cfg = engine.SamplingConfig(backend="hf_naive", temperature=0.0, max_new_tokens=max_new, **kw)
    proc = engine.ScriptedProcessor({i: s for i, s in enumerate(scripts) if s})
    oracle = engine.rollout(model, TOK, docs, 1, naive_cfg, logits_processor=proc)
    return eps, oracle, llm


def assert_same(a_eps, b_eps, tol=1e-4):
    for a, b in zip(a_eps, b_eps, strict=True):
        assert a.prompt_ids == b.prompt_ids
        assert [t.ids for t in a.turns] == [t.ids for t in b.turns]
        assert [(t.text, t.injected, t.ended) for t in a.turns] == [(t.text, t.injected, t.ended) for t in b.turns]
        assert [t.prune for t in a.turns] == [t.prune for t in b.turns]
        for ta, tb in zip(a.turns, b.turns):
            assert torch.allclose(torch.tensor(ta.logprobs), torch.tensor(tb.logprobs), atol=tol)
        assert [c.to_dict() for c in a.calls] == [c.to_dict() for c in b.calls]
        assert (a.summary, a.text, a.flags) == (b.summary, b.text, b.flags)
        assert (a.n_search, a.n_delete, a.n_deleted) == (b.n_search, b.n_delete, b.n_deleted)


def prompts_by_episode(llm: LLM, eps) -> list[list[list[int]]]:
    """The prompts the engine was sent for each episode, in order (found by document prompt)."""
    out = []
    for ep in eps:
        p = ep.prompt_ids
        out.append([r.prompt_token_ids for r in llm.requests if r.prompt_token_ids[:len(p)] == p])
    return out


# ---------------------------------------------------------------------------
# The stand-in itself follows vLLM's rules


def test_stand_in_stops_like_vllm(model):
    """Stop strings (one spread over tokens, one inside a token), eos, stop
    token ids and max_tokens give vLLM's text, token ids, finish and stop
    reasons; log-probs come in vLLM's format."""
    prompt = sandbox.prompt_ids(TOK, DOC[:100])
    turn = TOK.encode("Acme grew.<search>acme</search", add_special_tokens=False)
    carry = tok_id(">/")  # completes "</search>" and carries a "/" past it
    llm = LLM(model, TOK, scripts={tuple(prompt): turn + [carry] + TOK.encode(" more", add_special_tokens=False)})

    def ask(**kw):
        llm.written = {k: 0 for k in llm.written}  # replay the script from its start
        [o] = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0.0, **kw))
        return o.outputs[0]

    c = ask(stop=["</search>", "/>"], include_stop_str_in_output=True, logprobs=0, max_tokens=50)
    assert c.token_ids == turn + [carry]  # the whole stopping token
    assert c.text == "Acme grew.<search>acme</search>"  # cut after the stop string
    assert (c.finish_reason, c.stop_reason) == ("stop", "</search>")
    assert len(c.logprobs) == len(c.token_ids)
    assert all(list(d) == [t] and d[t].rank >= 1 and d[t].decoded_token == TOK.decode([t])
               for t, d in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)))

    c = ask(stop=["</search>"], include_stop_str_in_output=False, max_tokens=50)
    assert c.text == "Acme grew.<search>acme" and c.token_ids == turn + [carry] and c.logprobs is None

    n = 3
    c = ask(stop=["</search>"], max_tokens=n)
    assert (c.token_ids, c.finish_reason, c.stop_reason) == (turn[:n], "length", None)
    # a stop string reached on the max_tokens-th token: a stop, not a length cap
    c = ask(stop=["</search>"], include_stop_str_in_output=True, max_tokens=len(turn) + 1)
    assert (c.finish_reason, c.stop_reason) == ("stop", "</search>")

    c = ask(stop_token_ids=[turn[2]], logprobs=2, max_tokens=50)
    assert (c.token_ids, c.finish_reason, c.stop_reason) == (turn[:3], "stop", turn[2])
    assert all(len(d) in (3, 2) and turn_id in d for turn_id, d in zip(c.token_ids, c.logprobs))

    llm.scripts[tuple(prompt)] = turn[:2] + [EOS, 5, 6]
    c = ask(stop_token_ids=[EOS], include_stop_str_in_output=True, max_tokens=50)
    # eos is checked before the stop token ids: stop_reason None; skip_special_tokens hides it from the text
    assert (c.token_ids, c.finish_reason, c.stop_reason) == (turn[:2] + [EOS], "stop", None)
    assert c.text == TOK.decode(turn[:2])

    with pytest.raises(TypeError):
        SamplingParams(temperature=1.0, not_a_vllm_parameter=1)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


# ---------------------------------------------------------------------------
# rollout_vllm against the oracle and the scorer


@pytest.mark.parametrize("max_new", [90, 16])
def test_scripted_vllm_rollout_equals_hf_naive(model, fake_vllm, max_new):
    """The same script through both engines gives the same episodes: token
    ids, texts, tool calls, prunes, summaries, log-probs. With 16 tokens every
    script is cut short, some inside a tool call."""
    scripts = [script_ids(TOK, s) if s else None for s in SCRIPTS]
    eps, oracle, llm = run_both(model, DOCS, scripts, max_new=max_new)
    assert_same(eps, oracle)
    assert all(sum(len(t.ids) for t in e.turns) <= max_new for e in eps)
    # each round was sent exactly the builder's context of its turn (after a delete: the pruned one);
    # a turn without ids is the truncation right after a tool call, when no budget was left to ask
    assert prompts_by_episode(llm, eps) == [[c for c, t in zip(e.contexts(), e.turns) if t.ids] for e in eps]
    # every request asked for what rollout_vllm documents
    for r in llm.requests:
        sp = r.params
        assert (sp.stop, sp.include_stop_str_in_output, sp.logprobs) == (["</search>", "/>"], True, 0)
        assert sp.stop_token_ids == engine.stop_ids(TOK) and 1 <= sp.max_tokens <= max_new
    assert len({r.params.seed for r in llm.requests}) == len(llm.requests)
    if max_new == 90:
        assert sum(e.n_search for e in eps) == 4 and sum(e.n_delete for e in eps) == 5
        assert sum(e.n_deleted for e in eps) == 4  # the delete before any text deletes nothing
        assert eps[0].summary == "Acme grew." and eps[1].summary == "Jane Doe said, wrongly, fine."
        assert eps[2].flags.get("truncated") and not any(e.flags.get("truncated") for e in eps[:2])
        assert any(t.prune for e in eps for t in e.turns)
    else:
        assert all(e.flags.get("truncated") for e in eps)


def test_vllm_logprobs_reproduce_the_scorer(model, fake_vllm):
    """Recorded log-probs (vLLM's raw ones, greedy) are what episode_logprobs
    recomputes from the episodes, sampled tokens and scripted ones alike."""
    scripts = [script_ids(TOK, s) if s else None for s in SCRIPTS]
    llm = LLM(model, TOK, scripts={prompt_key(d): s for d, s in zip(DOCS, scripts) if s})
    eps = engine.rollout_vllm(llm, TOK, DOCS, 1, engine.SamplingConfig(backend="vllm", temperature=0.0, max_new_tokens=90))
    with torch.no_grad():
        lps = scoring.episode_logprobs(model, eps)
    n_free = 0
    for e, ep in enumerate(eps):
        n_script = len(scripts[e] or [])
        k = 0
        for ti, t in enumerate(ep.turns):
            assert torch.allclose(lps[e][ti], torch.tensor(t.logprobs), atol=1e-4)
            n_free += sum(1 for j in range(len(t.ids)) if k + j >= n_script)
            k += len(t.ids)
    assert n_free >= 80  # the free-running episode's tokens, all sampled


@pytest.mark.parametrize("mode, score_t", [("processed_logprobs", 0.7), ("raw_logprobs", 1.0)])
def test_sampling_with_temperature(model, fake_vllm, mode, score_t):
    """Sampling at T = 0.7 with groups: the recorded log-probs are the
    trainer's at T = 0.7 when the engine reports processed log-probs, and of
    the raw logits (T = 1) by default, as rollout_vllm's docstring says. The
    same seed gives the same episodes; another seed other ones."""
    docs = [DOC[:300], DOC[150:450]]
    cfg = engine.SamplingConfig(backend="vllm", temperature=0.7, max_new_tokens=40, seed=5)
    eps = engine.rollout_vllm(LLM(model, TOK, logprobs_mode=mode), TOK, docs, 2, cfg)
    assert len(eps) == 4 and [e.document for e in eps] == [docs[0], docs[0], docs[1], docs[1]]
    with torch.no_grad():
        lps = scoring.episode_logprobs(model, eps, temperature=score_t)
        other = scoring.episode_logprobs(model, eps, temperature=1.7 - score_t)
    for e, ep in enumerate(eps):
        for ti, t in enumerate(ep.turns):
            assert torch.allclose(lps[e][ti], torch.tensor(t.logprobs), atol=1e-4)
    assert not all(torch.allclose(other[e][ti], torch.tensor(t.logprobs), atol=1e-2)
                   for e, ep in enumerate(eps) for ti, t in enumerate(ep.turns))
    again = engine.rollout_vllm(LLM(model, TOK, logprobs_mode=mode), TOK, docs, 2, cfg)
    assert [[t.ids for t in e.turns] for e in again] == [[t.ids for t in e.turns] for e in eps]
    reseeded = engine.rollout_vllm(LLM(model, TOK, logprobs_mode=mode), TOK, docs, 2,
                              engine.SamplingConfig(backend="vllm", temperature=0.7, max_new_tokens=40, seed=6))
    assert [[t.ids for t in e.turns] for e in reseeded] != [[t.ids for t in e.turns] for e in eps]
    # the two rollouts of a document are sampled independently
    assert [t.ids for t in eps[0].turns] != [t.ids for t in eps[1].turns]


def test_rollout_dispatches_and_lora_request_reaches_generate(model, fake_vllm):
    cfg = engine.SamplingConfig(backend="vllm", temperature=0.0, max_new_tokens=6)
    adapter = object()  # stands for a vllm.lora.request.LoRARequest
    llm = LLM(model, TOK)
    direct = engine.rollout_vllm(llm, TOK, [DOC[:200]], 2, cfg, lora_request=adapter)
    assert llm.requests and all(r.lora_request is adapter for r in llm.requests)
    via = engine.rollout(LLM(model, TOK), TOK, [DOC[:200]], 2, cfg)
    assert_same(direct, via, tol=0)
    with pytest.raises(ValueError, match="logits_processor"):
        engine.rollout(LLM(model, TOK), TOK, [DOC[:200]], 1, cfg, logits_processor=engine.ScriptedProcessor({}))


# ---------------------------------------------------------------------------
# Stop strings: inside a token, and "/>" that closes no delete


def test_stop_string_inside_a_token(model, fake_vllm):
    """A token that completes a stop string and carries characters past it
    ('>/' after '</search', or after '"/' for a delete's '/>'): vLLM ends the
    round there and returns the whole token (its text is cut after the stop
    string); rollout_vllm reads token ids only, so the episode is the
    oracle's, the carried '/' included in the turn's text."""
    enc = lambda s: TOK.encode(s, add_special_tokens=False)  # noqa: E731
    carry = tok_id(">/")
    scripts = [
        enc("Acme reported revenue of $5 billion.<search>/revenue of/</search") + [carry]
        + enc(" Acme grew.") + [EOS],
        enc('Short one. Bad one.<delete scope="sentence') + [tok_id('"/'), carry] + enc(" Better.") + [EOS],
    ]
    docs = [DOC, DOC[:300]]
    eps, oracle, llm = run_both(model, docs, scripts)
    assert_same(eps, oracle)
    first = [next(r for r in llm.requests if r.prompt_token_ids == list(prompt_key(d))) for d in docs]
    assert [r.output.stop_reason for r in first] == ["</search>", "/>"]
    assert [r.output.token_ids[-1] for r in first] == [carry, carry]
    assert first[0].output.text.endswith("</search>") and first[1].output.text.endswith('"/>')
    assert eps[0].turns[0].text.endswith("</search>/") and eps[0].calls[0].kind == "search"
    assert eps[1].turns[0].text.endswith('"/>/') and eps[1].n_deleted == 1
    assert eps[1].summary.startswith("Short one.") and "Bad one" not in eps[1].summary


@pytest.mark.parametrize("written", [
    "Acme grew 12%/> and more. Done.",  # in summary text
    "<search>revenue/>of</search> Acme grew.",  # in a search query
])
def test_lone_close_does_not_end_the_episode(model, fake_vllm, written):
    """vLLM stops every round at "/>"; one that closes no <delete .../> tag must not end the
    episode (the hf engines keep generating), so the round is resubmitted and goes on."""
    eps, oracle, _ = run_both(model, [DOC], [script_ids(TOK, written)])
    assert "".join(t.text for t in oracle[0].turns) == written  # the oracle wrote the whole script
    assert_same(eps, oracle)


@pytest.mark.parametrize("room", [
    6,  # mid-text, before any call
    30,  # room for the search call, not for its results
    0,  # a prompt that already fills the context: one token, then truncated
])
def test_max_context_tokens_truncates_like_hf(model, fake_vllm, room):
    """A context that reaches max_context_tokens ends the row, truncated, as the hf engines do
    (on vLLM a context past max_model_len would make generate raise)."""
    limit = len(prompt_key(DOC)) + room
    eps, oracle, llm = run_both(model, [DOC], [script_ids(TOK, SCRIPTS[0])], max_context_tokens=limit)
    assert oracle[0].flags.get("truncated")
    assert_same(eps, oracle)
    assert all(len(r.prompt_token_ids) + r.params.max_tokens <= max(limit, len(r.prompt_token_ids) + 1)
               for r in llm.requests)
