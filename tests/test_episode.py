"""Episodes at the token level: exact contexts, branches, serialisation, and
property tests over random and adversarial assistant outputs."""
import math
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sandbox as S
from factual_tools import engine
from helpers import DOC, bpe_tokenizer


class VocabCodec(S.Codec):
    """Greedy longest-match over a fixed vocabulary that includes tokens which
    straddle text and markup, and one that completes a stop marker and carries
    extra text ('"/> T')."""

    VOCAB = ['"/> T', '.<', '"/>', '/>', "<search>", "</search>", "<delete", ' scope="', "sentence",
             "clause", " the", " re", "ven", "ue", "Acme", " Acme", ". ", ","]

    def __init__(self):
        super().__init__(None)
        self.vocab = self.VOCAB + [chr(i) for i in range(32, 127)] + ["\n", "…", "é", "\u2028"]
        self.index = {t: i for i, t in enumerate(self.vocab)}

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            for tok in sorted((t for t in self.vocab if text.startswith(t, i)), key=len, reverse=True)[:1]:
                out.append(self.index[tok])
                i += len(tok)
                break
            else:  # unknown character: its own id beyond the vocabulary
                out.append(10_000 + ord(text[i]))
                i += 1
        return out

    def decode(self, ids):
        return "".join(self.piece(i) for i in ids)

    def piece(self, i):
        return chr(i - 10_000) if i >= 10_000 else self.vocab[i]


EOS = 99_999


def drive(codec, written, document=DOC, prompt=(1, 2, 3), eos=True, max_new_tokens=None, whole=False,
          **limits):
    """Act as the rollout engine: feed the tokens of `written` one at a time,
    keep our own copy of the context by applying each Action, and record the
    context at the start of every turn. `whole` encodes the text in one go, so
    tokens may straddle call ends (a sampler can produce that too)."""
    ids = (codec.encode(written) if whole else engine.ScriptedProcessor.ids_for(codec.encode, written)) + ([EOS] if eos else [])
    b = S.EpisodeBuilder(document, list(prompt), codec, S.Limits.make(**limits), eos_ids=[EOS])
    ctx = list(prompt)
    seen = [list(ctx)]
    turn_ids = []
    for n, t in enumerate(ids):
        assert b.context_ids() == ctx + turn_ids  # the builder's view is the engine's
        turn_ids.append(t)
        stop = b.push(t, logprob=-0.01 * (n + 1))
        if max_new_tokens and n + 1 >= max_new_tokens and not stop:
            b.end_turn("truncated")
            break
        if stop:
            act = b.end_turn()
            ctx += turn_ids
            turn_ids = []
            if act.kind == "done":
                break
            if act.kind == "prune":
                ctx = ctx[:act.keep]
            ctx += act.ids
            seen.append(list(ctx))
    if not b.done:
        b.end_turn("truncated")
    return b.finish(), seen


WRITTEN = ('Acme reported revenue of $5 billion.<search>/revenue of/</search>'
           '<delete scope="sentence"/> Acme reported revenue of $4.2 billion. Jane Doe said, wrongly, Europe'
           '<search>Jane Doe growth</search> grew<delete scope="clause"/> the U.S. market grew.')


def test_engine_contexts_equal_episode_contexts():
    for codec in (VocabCodec(), S.Codec(bpe_tokenizer()), S.CharCodec()):
        ep, seen = drive(codec, WRITTEN)
        assert ep.contexts() == seen[:len(ep.turns)]
        assert ep.n_delete == 2 and ep.summary == (
            "Acme reported revenue of $4.2 billion. Jane Doe said, wrongly, the U.S. market grew.")


def test_context_after_delete_never_shows_retracted_text():
    codec = S.Codec(bpe_tokenizer())
    ep, seen = drive(codec, WRITTEN)
    after_first = codec.decode(seen[2][3:])
    assert "$5 billion" not in after_first
    assert after_first.startswith("<search>/revenue of/</search><results>")
    assert after_first.endswith('</results><delete scope="sentence"/>')
    after_second = codec.decode(seen[4][3:])
    assert "wrongly" in after_second and "Europe" not in after_second and " grew<" not in after_second
    assert after_second.endswith('Jane Doe said, wrongly,<search>Jane Doe growth</search>'
                                 + S.index_for(DOC).search("Jane Doe growth", length_fn=codec.length).block
                                 + '<delete scope="clause"/>')


def test_two_deletes_make_three_branches_and_every_generated_id_is_trained_once():
    for codec in (VocabCodec(), S.Codec(bpe_tokenizer())):
        ep, _ = drive(codec, WRITTEN)
        branches = ep.branches()
        assert len(branches) == 3
        trained = {}
        for b in branches:
            assert len(b.input_ids) == len(b.loss_mask) == len(b.logprobs)
            for ti, s, e in b.turns:
                assert b.input_ids[s:e] == ep.turns[ti].ids
                assert all(m == 1 for m in b.loss_mask[s:e])
                assert b.logprobs[s:e] == ep.turns[ti].logprobs
                trained[ti] = trained.get(ti, 0) + 1
            masked = sum(b.loss_mask)
            assert masked == sum(e - s for _, s, e in b.turns)  # nothing else has mask 1
            assert all(math.isnan(lp) for lp, m in zip(b.logprobs, b.loss_mask) if m == 0)
        assert trained == {i: 1 for i in range(len(ep.turns))}
        n_gen = sum(len(t.ids) for t in ep.turns)
        assert sum(sum(b.loss_mask) for b in branches) == n_gen


def test_injected_and_reencoded_ids_are_not_trained():
    codec = VocabCodec()
    ep, _ = drive(codec, WRITTEN)
    for b in ep.branches():
        text_of_trained = "".join(codec.piece(i) for i, m in zip(b.input_ids, b.loss_mask) if m)
        assert "<results>" not in text_of_trained


def test_stop_token_with_extra_characters_keeps_them_as_text():
    codec = VocabCodec()
    ep, seen = drive(codec, 'One. Two.<delete scope="sentence"/> Three.', whole=True)
    # '"/> T' completes the tag and carries " T": the T stays, as generated text
    assert ep.turns[0].text.endswith('"/> T')
    assert ep.summary == "One. Three."
    assert codec.decode(seen[1][3:]) == 'One.<delete scope="sentence"/> T'


def test_split_token_at_the_cut_is_reencoded():
    codec = VocabCodec()
    # ".<" straddles the end of the kept text and the search tag
    ep, seen = drive(codec, 'Keep.<search>acme</search> Drop<delete scope="sentence"/> New.', whole=True)
    ctx = seen[2][3:]
    assert codec.decode(ctx).startswith("Keep.<search>acme</search><results>")
    assert ep.turns[1].prune is not None


def test_truncation_flags_and_records_partial_turn():
    ep, _ = drive(VocabCodec(), "Acme reported a long sentence that goes on", eos=False, max_new_tokens=8)
    assert ep.flags.get("truncated") and ep.turns[-1].ended == "truncated"
    assert len(ep.turns[-1].ids) == 8


def test_json_round_trip_is_lossless():
    ep, _ = drive(S.Codec(bpe_tokenizer()), WRITTEN)
    ep.meta = {"drafter": "test", "cost_usd": 0.25}
    back = S.Episode.from_json(ep.to_json())
    assert back.to_dict() == ep.to_dict()
    assert back.contexts() == ep.contexts()
    assert [b.input_ids for b in back.branches()] == [b.input_ids for b in ep.branches()]
    text_only = S.replay(DOC, WRITTEN)
    assert S.Episode.from_json(text_only.to_json()).to_dict() == text_only.to_dict()


def test_unknown_episode_version_is_an_error():
    d = S.replay(DOC, "x").to_dict()
    d["version"] = 99
    try:
        S.Episode.from_dict(d)
    except ValueError as e:
        assert "version 99" in str(e)
    else:
        raise AssertionError("accepted an unknown version")


def test_text_only_trace_tokenizes_canonically():
    tok = bpe_tokenizer()
    ep = S.replay(DOC, WRITTEN)
    assert not ep.has_ids
    toked = ep.tokenized(tok)
    assert toked.has_ids and toked.summary == ep.summary
    assert toked.prompt_ids == S.prompt_ids(tok, DOC)
    assert [t.text for t in toked.turns] == [t.text for t in ep.turns]
    assert [t.injected for t in toked.turns] == [t.injected for t in ep.turns]
    assert toked.turns[-1].ids[-1] == tok.eos_token_id
    branches = ep.branches(tok)
    assert len(branches) == 3
    for b in branches:  # every trained id decodes to assistant text, never results or prompt
        trained = tok.decode([i for i, m in zip(b.input_ids, b.loss_mask) if m])
        assert "<results>" not in trained and "Summarise" not in trained


# ---------------------------------------------------------------------------
# Property tests

FRAGMENTS = st.sampled_from([
    "Acme reported revenue. ", "Jane K. Doe said, ", "growth rose 12%", " $4.2 billion", ". ", ", ", " - ",
    "<search>", "</search>", "<search>/revenue/</search>", "<search>/(a|a)+$/</search>",
    "<search>/[/</search>", "<search>" + "x" * 10_000 + "</search>", "<search>Globex revenue</search>",
    '<delete scope="sentence"/>', '<delete scope="clause"/>', '<delete scope="word"/>', "<delete/>",
    "<delete scope=\"sentence\">", "<results>", "</results>", "<results><0>stale</0></results>",
    "<0>", "</1>", "<sea", "rch>", "/>", "<", ">", "é", "漢字", "\u2028", "\n\n", "\x00", "🙂",
    "<search>/(?:(?:a{255}){255}){255}/</search>",
])
TEXTS = st.lists(FRAGMENTS | st.text(max_size=12), max_size=25).map("".join)


def no_markup(summary):
    return S.MARKUP.search(summary) is None and "<search" not in summary and "<delete" not in summary


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS)
def test_replay_never_raises_and_summary_has_no_markup(text):
    t0 = time.perf_counter()
    ep = S.replay(DOC, text)
    elapsed = time.perf_counter() - t0
    assert no_markup(ep.summary)
    assert ep.summary == " ".join(ep.summary.split())
    assert elapsed < 0.5 + 0.15 * len(ep.calls)  # every call is bounded
    assert len(ep.calls) <= S.Limits().max_tool_calls + 1
    assert S.Episode.from_json(ep.to_json()).to_dict() == ep.to_dict()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(TEXTS, st.sampled_from(["vocab", "bpe"]), st.booleans())
def test_token_level_invariants_on_random_outputs(text, which, whole):
    codec = VocabCodec() if which == "vocab" else S.Codec(bpe_tokenizer())
    ep, seen = drive(codec, text, whole=whole)
    assert ep.contexts() == seen[:len(ep.turns)]
    assert no_markup(ep.summary)
    branches = ep.branches()
    assert sum(sum(b.loss_mask) for b in branches) == sum(len(t.ids) for t in ep.turns)
    assert sorted(ti for b in branches for ti, _, _ in b.turns) == list(range(len(ep.turns)))
    assert S.Episode.from_json(ep.to_json()).contexts() == ep.contexts()


def test_mask_validation_accepts_real_branches_and_catches_an_off_by_one():
    tok = bpe_tokenizer()
    ep = S.replay(DOC, WRITTEN).tokenized(tok)
    branches = ep.branches()
    S.check_branches(ep, branches, tok)
    shifted = [S.Branch(b.input_ids, [0] + b.loss_mask[:-1], b.logprobs, b.turns) for b in branches]
    with pytest.raises(S.MaskError, match="trained positions"):
        S.check_branches(ep, shifted, tok)
    # shift the recorded spans as well: the decoded text no longer matches the turn
    both = [S.Branch(b.input_ids + [0], [0] + b.loss_mask, b.logprobs, [(t, s + 1, e + 1) for t, s, e in b.turns])
            for b in branches]
    with pytest.raises(S.MaskError, match="decode to"):
        S.check_branches(ep, both, tok)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 399), max_size=40))
def test_codec_decodes_as_the_tokenizer_does_without_its_python_wrapper(ids):
    """The codec decodes every run of ids (split multi-byte characters and special tokens included) to
    the tokenizer's own text, through the tokenizers library: the wrapper's per-call conversion was a
    third of a tiny rollout's tokenizer time."""
    tok = bpe_tokenizer()  # shared by the whole session: patched for this check only
    codec = S.Codec(tok)
    want = tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    tok.decode = lambda *a, **k: pytest.fail("the codec went through the Python decode")
    try:
        assert codec.decode(ids) == want
        assert codec.decode(torch.tensor(ids, dtype=torch.long)) == want  # ids as a tensor, as the wrapper took them
    finally:
        del tok.decode


def test_codec_keeps_a_tokenizer_whose_own_decode_changes_the_text():
    from transformers import PreTrainedTokenizerFast

    class Shouting(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs):
            return super()._decode(token_ids, **kwargs).upper()

    base = bpe_tokenizer()
    tok = Shouting(tokenizer_object=base.backend_tokenizer, eos_token="<|eot|>", pad_token="<|pad|>")
    ids = base.encode("Acme reported revenue", add_special_tokens=False)
    assert S.Codec(tok).decode(ids) == "ACME REPORTED REVENUE"
