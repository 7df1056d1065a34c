"""Run pipeline stages on a Modal GPU, with a persistent volume for runs/ and out/.

    pip install modal && modal setup                  # once: the client and a token
    python launchers/modal_app.py --profile cnn_qwen3_4b --stage sft,rl_v19 --gpu A100-80GB --secret hf
    python launchers/modal_app.py --profile smollm --stage all --gpu L4            # the news-world chain, on a GPU
    python launchers/modal_app.py --profile cnn_qwen3_4b --stage sft --gpu A100-80GB:4   # SFT data-parallel, 4 GPUs
    python launchers/modal_app.py --profile cnn_qwen3_4b --stage all --dry-run     # what it would run; no modal needed
    modal volume get factual-tools-runs runs/drgrpo_v19/final ./rl_v19  # fetch a result

The container runs `python pipeline.py --profile P --only STAGES [--set ...]`
in a copy of this checkout, so a stage is exactly the command `pipeline.py`
runs here, and the chain's rules hold remotely: a stage whose output is on the
volume is skipped, an interrupted one resumes from its newest checkpoint.
runs/ and out/ live on the volume `factual-tools-runs` (committed after each
call), so stages launched one at a time build on each other. `--secret NAME`
(repeatable) attaches a Modal secret, e.g. an HF token or the teacher's API key.
The image installs requirements.txt and requirements-gpu.txt. `modal` is
imported only to launch; planning and `--dry-run` run without it.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: pipeline.py and the code it runs
sys.path.insert(0, str(ROOT))
import pipeline  # noqa: E402

REMOTE = "/root/factual-tools"
VOLUME = "factual-tools-runs"
IGNORE = [".git", "runs", "out", "wandb", "**/__pycache__", "**/*.pyc"]


def gpu_count(gpu: str) -> int:
    """Modal's GPU string names the count after a colon: "A100-80GB:4" is four."""
    kind, _, n = gpu.partition(":")
    if not kind or (n and (not n.isdigit() or int(n) < 1)):
        raise SystemExit(f"modal_app: --gpu {gpu!r}: a GPU type, optionally with a count (A100-80GB:4)")
    return int(n or 1)


def plan(profile: str, stages: str, sets: list[str], gpus: int = 1) -> list[str]:
    """The pipeline command a call runs remotely; bad stage or --set names exit naming them.
    With several GPUs the trainers run data-parallel under torchrun (`pipeline.py --nproc`)."""
    if profile not in pipeline.PROFILES:
        raise SystemExit(f"modal_app: unknown profile {profile!r}; profiles: {sorted(pipeline.PROFILES)}")
    chain = pipeline.profile_stages(profile)
    wanted = [] if stages == "all" else pipeline.stage_names(stages, chain)
    if stages != "all" and not wanted:
        names = list(dict.fromkeys(s.name for s in chain))
        raise SystemExit(f"modal_app: no stage given; stages of {profile}: {names} or all")
    pipeline.stage_overrides(sets, chain)  # checked here, applied by pipeline.py remotely
    return ["python", "pipeline.py", "--profile", profile, *(["--only", ",".join(wanted)] if wanted else []),
            *(a for item in sets for a in ("--set", item)), *(["--nproc", str(gpus)] if gpus > 1 else [])]


def gpu_requirements() -> list[str]:
    """requirements-gpu.txt's packages (its `-r requirements.txt` line is installed first)."""
    lines = (ROOT / "requirements-gpu.txt").read_text().splitlines()
    return [ln.split("#")[0].strip() for ln in lines if ln.split("#")[0].strip() and not ln.startswith("-r")]


def launch(cmd: list[str], gpu: str, secrets: list[str], timeout_h: float) -> int:  # pragma: no cover - needs Modal
    try:
        import modal
    except ImportError:
        raise SystemExit("modal_app: the Modal client is not installed: pip install modal && modal setup") from None
    app = modal.App("factual-tools")
    volume = modal.Volume.from_name(VOLUME, create_if_missing=True)
    image = (modal.Image.debian_slim(python_version="3.11")
             .pip_install_from_requirements(str(ROOT / "requirements.txt"))
             .pip_install(*gpu_requirements())
             .add_local_dir(str(ROOT), REMOTE, ignore=IGNORE))

    @app.function(image=image, gpu=gpu, volumes={"/vol": volume}, timeout=int(timeout_h * 3600),
                  secrets=[modal.Secret.from_name(s) for s in secrets], serialized=True)
    def run(argv: list[str]) -> int:
        import os

        os.chdir(REMOTE)
        for d in ("runs", "out"):  # the chain's outputs live on the volume
            os.makedirs(f"/vol/{d}", exist_ok=True)
            if not os.path.lexists(d):
                os.symlink(f"/vol/{d}", d)
        try:
            return subprocess.run(argv).returncode
        finally:
            volume.commit()

    with modal.enable_output(), app.run():
        return run.remote(cmd)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="cnn_qwen3_4b", help=f"one of {sorted(pipeline.PROFILES)}")
    ap.add_argument("--stage", default="all", help="comma-separated stage names, or all")
    ap.add_argument("--gpu", default="A100-80GB", help="a Modal GPU type: T4, L4, A10G, L40S, A100-40GB, A100-80GB, "
                                                      "H100, H200; TYPE:N for N of them (the trainers then run "
                                                      "data-parallel under torchrun)")
    ap.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                    help="an override for one stage's script, as pipeline.py takes it (repeatable)")
    ap.add_argument("--secret", action="append", default=[], help="a Modal secret to attach (repeatable)")
    ap.add_argument("--timeout-h", type=float, default=24.0, help="the container's time limit, hours")
    ap.add_argument("--dry-run", action="store_true", help="print what would run remotely; launch nothing")
    args = ap.parse_args(argv)
    cmd = plan(args.profile, args.stage, args.set, gpu_count(args.gpu))
    if args.dry_run:
        print(f"modal: gpu {args.gpu}, volume {VOLUME} at /vol (runs/, out/), secrets {args.secret or 'none'}")
        print(" ".join(cmd))
        listing = subprocess.run([sys.executable, *cmd[1:], "--dry-run"], cwd=ROOT, capture_output=True, text=True)
        print(listing.stdout, end="")
        return listing.returncode
    return launch(cmd, args.gpu, args.secret, args.timeout_h)


if __name__ == "__main__":
    raise SystemExit(main())
