"""The remote launchers (launchers/): modal_app.py plans pipeline.py's stages without importing modal,
and the Colab notebook runs top to bottom on a CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import pipeline

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "launchers"))
import modal_app  # noqa: E402

NOTEBOOK = ROOT / "launchers" / "colab.ipynb"


def test_modal_runs_the_pipelines_own_stage_commands():
    assert modal_app.plan("cnn_qwen3_4b", "sft,rl_v19", ["sft.epochs=1"]) == [
        "python", "pipeline.py", "--profile", "cnn_qwen3_4b", "--only", "sft,rl_v19", "--set", "sft.epochs=1"]
    assert modal_app.plan("tiny", "all", []) == ["python", "pipeline.py", "--profile", "tiny"]
    out = subprocess.run([sys.executable, "launchers/modal_app.py", "--stage", "sft,rl_v19", "--set", "sft.epochs=1",
                          "--gpu", "H100", "--dry-run"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    stages = {s.name: s for s in pipeline.CNN_STAGES}
    want = [" ".join(pipeline.with_overrides(stages["sft"], ["epochs=1"]).argv), " ".join(stages["rl_v19"].argv)]
    listed = [line.split(None, 2)[2] for line in out.splitlines() if line.split()[:1] in (["sft"], ["rl_v19"])]
    assert listed == want and "gpu H100" in out


def test_several_gpus_run_the_trainers_under_torchrun_and_the_rest_as_one_process():
    assert modal_app.gpu_count("A100-80GB") == 1 and modal_app.gpu_count("A100-80GB:4") == 4
    for bad in ("A100-80GB:0", "H100:x", ":2"):
        with pytest.raises(SystemExit, match="count"):
            modal_app.gpu_count(bad)
    assert modal_app.plan("cnn_qwen3_4b", "sft", [], gpus=4)[-2:] == ["--nproc", "4"]
    out = subprocess.run([sys.executable, "launchers/modal_app.py", "--stage", "sft,rl_v19,eval", "--gpu",
                          "A100-80GB:4", "--dry-run"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()[:1] in (["sft"], ["rl_v19"], ["eval"])}
    assert "--nproc 4" in out and "gpu A100-80GB:4" in out
    for name in ("sft", "rl_v19"):
        assert lines[name].split()[1:3] == ["torchrun", "--standalone"] and "--nproc_per_node=4" in lines[name]
    assert lines["eval"].split()[1] == "python"  # evaluation stays one process
    stage = next(s for s in pipeline.CNN_STAGES if s.name == "sft")
    assert pipeline.launcher(stage, 1) == ["python"]


@pytest.mark.parametrize("args, named", [
    (("nope", "all", []), "nope"), (("tiny", "sft,bogus", []), "bogus"), (("smollm", "", []), "stage"),
    (("smollm", "all", ["sft:epochs=1"]), "sft:epochs=1"),
])
def test_modal_refuses_unknown_profiles_stages_and_overrides(args, named):
    with pytest.raises(SystemExit, match=named):
        modal_app.plan(*args)


def test_planning_never_imports_modal():
    code = ("import sys; sys.path.insert(0, 'launchers'); import modal_app; modal_app.plan('smollm', 'all', []); "
            "assert 'modal' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def notebook_script() -> str:
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4 and nb["cells"]
    cells = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    for i, src in enumerate(cells):
        compile(src, f"{NOTEBOOK}:cell {i}", "exec")  # plain Python: no shell magics
    return "\n\n".join(cells)


def run_notebook(tmp_path, **env) -> str:
    script = tmp_path / "colab.py"
    script.write_text(notebook_script())
    env = {**os.environ, "COLAB_SKIP_INSTALL": "1", **{f"COLAB_{k.upper()}": v for k, v in env.items()}}
    res = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_the_notebook_plans_memory_and_lists_the_gpu_chain_on_a_cpu(tmp_path):
    out = run_notebook(tmp_path, extra="--dry-run")
    assert "smoke True" in out and "RL fits:" in out and "Qwen3-4B" in out
    assert "python sft.py --config configs/sft_qwen3_4b.yaml" in out  # the chain, with its smoke overrides
    assert "$ " + sys.executable + " pipeline.py --profile cnn_qwen3_4b --smoke --dry-run" in out


def test_the_notebook_runs_the_tiny_profiles_first_stages_for_real(tmp_path):
    out = run_notebook(tmp_path, profile="tiny", extra=f"--only docs,split --workdir {tmp_path / 'w'}")
    assert "smoke False" in out
    assert (tmp_path / "w" / "out/newsworld/docs.jsonl").exists() and (tmp_path / "w" / "out/newsworld/split.json").exists()
