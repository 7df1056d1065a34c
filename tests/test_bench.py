"""The benches' own logic: bench/rl_step.py's planned tool use, which both trainers must follow
to the token for their comparison to mean anything."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from factual_tools import engine
from helpers import DOC, bpe_tokenizer, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import rl_step  # noqa: E402

TOK = bpe_tokenizer()


def test_spaced_puts_every_call_between_sampled_tokens_and_counts_exactly():
    turns = rl_step.spaced(20, [[7, 8, 9], [4]])
    assert [x for t in turns for x in t].count(None) == 16 and sum(map(len, turns)) == 20
    assert [t[-3:] for t in turns[:1]] == [[7, 8, 9]] and turns[1][-1] == 4
    assert all(x is None for x in turns[-1])  # the last turn has no call
    with pytest.raises(SystemExit, match="no room"):
        rl_step.spaced(5, [[1, 2], [3, 4]])


def test_the_engine_plan_makes_every_row_call_its_searches_and_write_exactly_n_tokens():
    model = tiny_llama(TOK, seed=0)
    encode = lambda s: TOK.encode(s, add_special_tokens=False)  # noqa: E731
    calls = [encode("<search>/Acme/</search>"), encode("<search>revenue</search>")]
    plan = rl_step.EnginePlan(rl_step.spaced(40, calls), engine.stop_ids(TOK))
    cfg = engine.SamplingConfig(temperature=1.0, max_new_tokens=100)
    eps = engine.rollout(model, TOK, [DOC], 4, cfg, logits_processor=plan, generator=torch.Generator().manual_seed(0))
    assert [e.n_search for e in eps] == [2, 2, 2, 2]
    assert [sum(len(t.ids) for t in e.turns) for e in eps] == [41] * 4  # 40 written, then the end of turn
    assert len({e.summary for e in eps}) > 1  # what lies between the calls is sampled


def test_the_turn_plan_finds_its_turn_and_place_in_every_context_trl_sends():
    """TRL re-sends prompt + completion + tool result to `generate` after each call: the plan
    reads the turn from the count of turn openings (id 1 here) and the place from the last one."""
    start, header = 1, 3  # an assistant turn opens with [1, 9, 9]
    plan = rl_step.TurnPlan([[None, 20], [21, None]], stops=[2, 3], start_id=start, prompt_starts=3, header=header)
    prompt = [1, 5, 1, 6, 1, 9, 9]

    def chosen(row):
        scores = plan(torch.tensor([row]), torch.zeros(1, 30))[0]
        return ("ban", scores.isinf().nonzero()[:, 0].tolist()) if scores.isinf().any() else int(scores.argmax())

    assert chosen(prompt) == ("ban", [2, 3])  # turn 0, place 0: sampled, stop tokens banned
    assert chosen(prompt + [17]) == 20  # turn 0, place 1: the call
    assert chosen(prompt + [17, 20]) == 2  # then the end of the turn
    after_tool = prompt + [17, 20, 2, 1, 4, 4, 2, 1, 9, 9]  # the tool's turn, then the assistant's again
    assert chosen(after_tool) == 21
    assert chosen(after_tool + [21]) == ("ban", [2, 3])
    assert chosen(after_tool + [21, 11]) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)  # 90 s alone on two cores; a slower CI machine took over 300
def test_rl_step_with_a_real_model_runs_its_planned_tool_calls():
    """Without TRL the bench still runs rl.py's side, and every rollout makes the planned calls
    (searches only; with deletes, two of each)."""
    out = subprocess.run([sys.executable, "bench/rl_step.py", "--model", "smollm2-135m", "--prompts", "1", "--group",
                          "2", "--new-tokens", "48", "--tool-calls", "2", "--steps", "1", "--reps", "1",
                          "--threads", "1", "--trl-python", "/nonexistent/python"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    fig = json.loads(out.stdout.strip().splitlines()[-1])
    assert fig["ours_calls"] == 2 and fig["ours_delete_calls"] >= 2
    assert all(0 < fig[k] < 2 for k in ("ratio_vs_matmul_bound", "rollout_ratio_vs_bound", "update_ratio_vs_bound"))
    assert "trl_step_s" not in fig and "no trl" in out.stderr
