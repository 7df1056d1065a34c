"""Shared plumbing for every script: atomic writes, data parallel, runs and metrics, seeding, checkpoints.

The bottom layer: it imports nothing of this repository but `settings` (the
config loader). Models are built and loaded in `modeling.py`, GPU memory is
planned in `vram.py`. torch is imported only inside the functions that use it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import numbers
import os
import random
import shutil
import subprocess
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np

from factual_tools import settings
from factual_tools.settings import ConfigError, config_to_dict, format_config


# ---------------------------------------------------------------------------
# Atomic writes
# ---------------------------------------------------------------------------
# A crash (or a full disk, or a kill) mid-write must leave either the old file
# or the new one, never half of one: checkpoints and configs are read back by
# `resume=auto`. Temp names start with "." and end with ".tmp" so a listing of
# checkpoints never mistakes them for complete ones.


def _temp_name(final: Path, suffix: str = ".tmp") -> Path:
    return final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}{suffix}")


def _fsync_path(path: Path, flags: int = os.O_RDONLY) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a rename durable (POSIX); a no-op where directories cannot be opened."""
    if hasattr(os, "O_DIRECTORY"):
        _fsync_path(path, os.O_RDONLY | os.O_DIRECTORY)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to a temp file in the same directory, fsync, then os.replace."""
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(final)
    # os.open with 0o666 honours the umask (mkstemp would force 0600).
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def built_before(out: str | os.PathLike, marker: str, key: str, stamp) -> bool:
    """Whether the folder `out` was built from `stamp` (its `marker` JSON file holds it under
    `key`): then a builder reuses it. A folder that holds something else and no marker is an
    error, never replaced; a missing or empty one, or another build's, is built (again)."""
    out = Path(out)
    if (out / marker).is_file():
        return json.loads((out / marker).read_text(encoding="utf-8")).get(key) == stamp
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and holds no {marker}; refusing to replace it")
    return False


@contextmanager
def atomic_dir(final_path: str | os.PathLike):
    """Yield a temp directory next to `final_path`; move it into place only on success.

    On an exception the temp directory is deleted and `final_path` is untouched.
    An existing `final_path` is renamed away, the new one renamed in, and only
    then the old one deleted, so a crash leaves a complete directory under
    either `final_path` or `.NAME.xxxx.old`, never a partial one under `final_path`.
    """
    final = Path(final_path)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_name(final)
    os.mkdir(tmp)
    try:
        yield tmp
        for p in tmp.rglob("*"):  # the contents must be on disk before the rename is
            if p.is_file():
                _fsync_path(p)
        old = None
        if final.exists():
            old = _temp_name(final, ".old")
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except BaseException:
            if old is not None:
                os.replace(old, final)
            raise
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_config(cfg: Any, path: str | os.PathLike) -> None:
    atomic_write_text(path, format_config(cfg))


# ---------------------------------------------------------------------------
# Data parallel: torchrun (or accelerate launch) on plain torch.distributed
# ---------------------------------------------------------------------------
# `torchrun --nproc_per_node N sft.py ...` starts N copies of a script; each reads
# RANK / WORLD_SIZE / LOCAL_RANK from its environment (`init_distributed`). The
# trainers then split every micro-batch across the ranks (`Dist.shard`), divide
# each rank's loss by the whole step's normaliser (tokens for SFT and distillation,
# the step's rollout count for Dr. GRPO) and sum the gradients across ranks
# (`Dist.reduce_grads`) before clipping: every rank then holds the gradient one
# process would have computed on the whole batch, and takes the same optimizer
# step. That is what DistributedDataParallel computes; it is done by hand because
# the trainers score episodes through the engine's tree scorer, several forwards
# and no-grad passes a step, which DDP's wrapper would have to see as one
# `forward` (and accumulation as `no_sync` blocks). Rank 0 alone writes logs,
# metrics, checkpoints and final/; every rank's RNG is gathered into the
# checkpoint, so `resume=auto` continues the same world size exactly.

@dataclasses.dataclass(frozen=True)
class Dist:
    """This process's place in a data-parallel group (rank 0 of 1 without torchrun)."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Whether this rank writes (logs, metrics, checkpoints, final/) and evaluates."""
        return self.rank == 0

    def shard(self, items) -> list:
        """This rank's contiguous share of `items` (shares differ by one at most, in
        rank order, so the shares concatenated are `items`)."""
        n = len(items)
        return list(items[n * self.rank // self.world:n * (self.rank + 1) // self.world])

    def gather(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as td

        out = [None] * self.world
        td.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as td

            td.barrier()

    def reduce_grads(self, params) -> None:
        """Sum every parameter's gradient across the ranks, in place (a rank whose
        share of the step was empty contributes zeros)."""
        if self.world == 1:
            return
        import torch
        import torch.distributed as td

        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        buckets: dict = {}
        for p in params:
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        for group in buckets.values():  # one collective per dtype and device
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            td.all_reduce(flat, op=td.ReduceOp.SUM)
            i = 0
            for p in group:
                n = p.grad.numel()
                p.grad.copy_(flat[i:i + n].view_as(p.grad))
                i += n


SINGLE = Dist()


@contextmanager
def main_first(dist: Dist):
    """Rank 0 runs the block, then the other ranks do: a block that writes a cache
    (teacher episodes, a student's initial weights) is computed once, and the other
    ranks read what rank 0 wrote."""
    if not dist.main:
        dist.barrier()
    yield
    if dist.main:
        dist.barrier()


def close_distributed(dist: Dist) -> None:
    """The end of a data-parallel run, on every rank: wait until every rank is done
    (rank 0 saves final/ and evaluates last), then take the process group down
    together. A rank that left while another still held the group could be
    aborted in gloo's teardown ("terminate called without an active exception")."""
    if dist.world == 1:
        return
    import torch.distributed as td

    if td.is_initialized():
        td.barrier()
        td.destroy_process_group()


def init_distributed() -> Dist:
    """The data-parallel group this process was launched in: under torchrun (or
    `accelerate launch`, which runs torchrun's launcher) WORLD_SIZE > 1 and the
    process group is set up here (NCCL on CUDA, each rank on GPU LOCAL_RANK; gloo
    on a CPU); otherwise one process, and nothing is set up. Ranks other than 0
    print nothing, so a run's output reads as one process's."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return SINGLE
    import builtins
    import datetime

    import torch
    import torch.distributed as td

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not td.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local)
        # rank 0 evaluates while the others wait (at the next collective, or at the end
        # in close_distributed): allow it an hour
        td.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(hours=1))
    if td.get_world_size() != world or td.get_rank() != rank:
        raise RuntimeError(f"process group is rank {td.get_rank()} of {td.get_world_size()}, "
                           f"the environment says {rank} of {world}")
    if rank != 0:
        builtins.print = lambda *a, **k: None
    return Dist(rank=rank, world=world, local_rank=local)


# ---------------------------------------------------------------------------
# Runs, step lines and metrics
# ---------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return str(v)
    if isinstance(v, numbers.Integral):
        return str(int(v))
    v = float(v)
    if v != 0 and abs(v) < 1e-2:  # 3 significant digits, trailing zeros dropped: 2.1e-03
        mantissa, exp = f"{v:.2e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{exp}"
    return f"{v:.3g}"


def format_step(step: int, total: int | None, fields: dict[str, Any], seconds: float) -> str:
    """`step 42/500 | reward 0.41 | kl 2.1e-03 | len 63 | 8.1s`, fields in dict order."""
    head = f"step {step}/{total}" if total is not None else f"step {step}"
    return " | ".join([head, *(f"{k} {_fmt(v)}" for k, v in fields.items()), f"{seconds:.1f}s"])


def jsonable(v: Any, nonfinite: Literal["string", "null"] = "string") -> Any:
    """`v` as strict JSON values: numpy scalars and arrays become Python ones, keys strings.

    Strict JSON has no NaN or +-inf. In metrics lines (`nonfinite="string"`) they become
    "nan", "inf", "-inf", which read_metrics turns back: null would hide a diverged loss.
    Reports (eval.json, distill.json) use `nonfinite="null"`: a figure that could not be
    measured (no searches, so no search rate) is missing, as every JSON reader expects.
    """
    if isinstance(v, np.ndarray):
        v = v.tolist()
    elif isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v) if nonfinite == "string" else None
    if isinstance(v, dict):
        return {str(k): jsonable(x, nonfinite) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x, nonfinite) for x in v]
    return v


def mean(xs) -> float:
    """The mean of what was measured: None and NaN entries are skipped; NaN if none is left."""
    xs = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(np.mean(xs)) if xs else math.nan


_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class MetricsWriter:
    """Append one JSON object per `write` call to a JSONL file, flushed per line.

    The file is opened per call: a crash loses at most the line being written,
    and there is no handle to close.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, step: int, **fields: Any) -> None:
        line = json.dumps(jsonable({"step": step, **fields}), allow_nan=False)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
            f.flush()


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Read a metrics JSONL back; a malformed line raises ValueError naming file and line.

    Top-level "nan"/"inf"/"-inf" strings (how MetricsWriter stores them) become floats.
    """
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed metrics line: {e}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: metrics line is not a JSON object")
            records.append({k: _NONFINITE.get(v, v) if isinstance(v, str) else v
                            for k, v in record.items()})
    return records


def git_revision(cwd: str | os.PathLike | None = None) -> str:
    """`<sha>`, `<sha> dirty`, or `unknown` (no git, not a repo); never raises."""
    cwd = cwd or Path(__file__).resolve().parent.parent  # the code's revision, not the cwd's
    def run(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    try:
        sha = run("rev-parse", "HEAD")
        return f"{sha} dirty" if run("status", "--porcelain") else sha
    except (OSError, subprocess.SubprocessError):
        return "unknown"


@dataclasses.dataclass
class LogConfig:
    """Where a trainer's step and evaluation figures go besides stdout and metrics.jsonl."""
    tensorboard: bool = False  # TensorBoard event files in the run directory's tb/ (pip install tensorboard)
    wandb_project: str = ""  # this W&B project ("" = off; pip install wandb; WANDB_MODE=offline works)

    def __post_init__(self):  # a missing package fails when the config loads, not after the model has
        import importlib.util

        for key, wanted, module in (("tensorboard", self.tensorboard, "tensorboard"),
                                    ("wandb_project", self.wandb_project, "wandb")):
            if wanted and importlib.util.find_spec(module) is None:
                raise ConfigError(f"log.{key} needs the `{module}` package, which is not installed: "
                                  f"pip install {module}")


def tracker_sinks(cfg: LogConfig, run_dir: Path, name: str, config: dict) -> list:
    """Optional TensorBoard / W&B writers for a run, each `sink(step, numeric fields)`,
    with a `.close` attribute. The packages are imported only when asked for. A
    resumed run continues the same W&B run (its id is kept in the run directory)."""
    sinks = []
    if cfg.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(str(run_dir / "tb"))

        def to_tensorboard(step: int, fields: dict) -> None:
            for k, v in fields.items():
                tb.add_scalar(k, v, step)
            tb.flush()

        to_tensorboard.close = tb.close
        sinks.append(to_tensorboard)
    if cfg.wandb_project:
        import wandb

        id_file = run_dir / "wandb_id.txt"
        if not id_file.exists():
            atomic_write_text(id_file, uuid.uuid4().hex[:12] + "\n")
        wb = wandb.init(project=cfg.wandb_project, name=name, id=id_file.read_text().strip(), config=config,
                        dir=str(run_dir), resume="allow")

        def to_wandb(step: int, fields: dict) -> None:
            wb.log(fields, step=step)

        to_wandb.close = wb.finish
        sinks.append(to_wandb)
    return sinks


@dataclasses.dataclass
class Run:
    dir: Path
    metrics: MetricsWriter | None  # None on a data-parallel rank other than 0: it writes nothing
    sinks: list = dataclasses.field(default_factory=list)  # tracker_sinks: TensorBoard, W&B

    def log(self, step: int, total: int | None, fields: dict[str, Any], seconds: float) -> str:
        """Print the step line and append the same fields (plus `time_s`) to metrics.jsonl
        and the trackers."""
        line = format_step(step, total, fields, seconds)
        if self.metrics is None:
            return line
        print(line, flush=True)
        self.metrics.write(step=step, **fields, time_s=seconds)
        self.track(step, fields)
        return line

    def track(self, step: int, fields: dict[str, Any]) -> None:
        """The finite numeric fields to the trackers (metrics.jsonl is written by the caller)."""
        numeric = {k: float(v) for k, v in fields.items()
                   if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)}
        for sink in self.sinks:
            sink(step, numeric)

    def finish(self) -> None:
        """Close the trackers (flushes TensorBoard, ends the W&B run)."""
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def start_run(cfg: Any, dist: Dist = SINGLE) -> Run:
    """Create `{runs_dir}/{name}/` with config.yaml and git.txt; print the config once
    with `--verbose` (settings.verbose), else the path of its config.yaml;
    open the trackers of `cfg.log` (a LogConfig), if the config has one.

    An existing run directory is reused (a resumed run appends to metrics.jsonl).
    Under torchrun, rank 0 does all of that and the other ranks get a Run that
    writes nothing, once the directory exists.
    """
    name = str(getattr(cfg, "name", ""))
    if not Path(name).parts or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ConfigError(f"config key 'name' must be a relative run name, got {name!r}")
    run_dir = Path(getattr(cfg, "runs_dir", "runs")) / name
    if not dist.main:
        dist.barrier()  # rank 0 has made the directory
        return Run(dir=run_dir, metrics=None)
    run = _start_run(cfg, run_dir, name)
    dist.barrier()
    return run


def _start_run(cfg: Any, run_dir: Path, name: str) -> Run:
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    atomic_write_text(run_dir / "git.txt", git_revision() + "\n")
    if settings.verbose:
        print(f"run {run_dir}\n{format_config(cfg)}", end="", flush=True)
    else:
        print(f"run {run_dir} (its resolved config: {run_dir / 'config.yaml'}; --verbose prints it)", flush=True)
    log = getattr(cfg, "log", None)
    sinks = tracker_sinks(log, run_dir, name, config_to_dict(cfg)) if isinstance(log, LogConfig) else []
    return Run(dir=run_dir, metrics=MetricsWriter(run_dir / "metrics.jsonl"), sinks=sinks)


# ---------------------------------------------------------------------------
# Seeding
# ---------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    """Seed random, numpy and torch (CPU and every CUDA device)."""
    import torch  # here, not at the top: the config loader must import without torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# ---------------------------------------------------------------------------
# Checkpoints (DESIGN 7)
# ---------------------------------------------------------------------------
# A checkpoint is a directory `RUN/checkpoints/step_00000042/` written through
# atomic_dir, so it exists whole or not at all (a SIGKILL mid-save leaves only a
# dot-named temp directory, never picked up). It holds:
#   model/                  save_pretrained output (a PEFT adapter, or the full
#                           model when training from scratch): what eval loads
#   trainable.safetensors   every parameter with requires_grad, by name: what
#                           resume loads (uniform for adapters and full models)
#   trainer.pt              optimizer, scheduler, RNG states, and the script's
#                           own state (data cursor, curriculum, step)

CHECKPOINT_PREFIX = "step_"


def rng_state(generators: dict | None = None) -> dict:
    """Every RNG a run draws from: python, numpy, torch (CPU, CUDA), and named
    torch.Generator objects of the script (e.g. the rollout sampler)."""
    import torch

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    st = {"python": random.getstate(),  # plain lists and ints, so checkpoints load with weights_only=True
          "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)], "torch": torch.get_rng_state(),
          "generators": {k: g.get_state() for k, g in (generators or {}).items()}}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict, generators: dict | None = None) -> None:
    import torch

    random.setstate(tuple(st["python"][:1]) + (tuple(st["python"][1]),) + tuple(st["python"][2:]))
    name, keys, *rest = st["numpy"]  # a list (this version) or numpy's own tuple (older checkpoints)
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
    for k, g in (generators or {}).items():
        g.set_state(st["generators"][k])


def load_trainer_state(path: Path) -> dict:
    """A checkpoint's trainer.pt, loaded with weights_only=True: tensors and plain Python
    only, so a checkpoint from elsewhere cannot run code. Older checkpoints held numpy's
    RNG state as an array: numpy's array reconstruction is the one extra type allowed."""
    import torch

    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct
    with torch.serialization.safe_globals([_reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]):
        return torch.load(path, map_location="cpu", weights_only=True)


def save_checkpoint(run_dir: str | os.PathLike, step: int, model, optimizer=None, scheduler=None,
                    *, state: dict | None = None, generators: dict | None = None, keep: int = 2,
                    dist: Dist = SINGLE) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` ones.

    Under torchrun every rank calls it: each rank's RNG states are gathered and rank 0
    writes them all (`rng_ranks`) with the world size; the weights and the optimizer
    are the same on every rank. It returns once the checkpoint is complete."""
    import torch
    from safetensors.torch import save_file

    final = Path(run_dir) / "checkpoints" / f"{CHECKPOINT_PREFIX}{step:08d}"
    rngs = dist.gather(rng_state(generators))
    if dist.main:
        with atomic_dir(final) as tmp:
            save_pretrained(model, tmp / "model")
            trainable = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
            save_file(trainable, str(tmp / "trainable.safetensors"))
            torch.save({"step": step, "optimizer": optimizer.state_dict() if optimizer else None,
                        "scheduler": scheduler.state_dict() if scheduler else None,
                        "rng": rngs[0], "state": state or {}, "world_size": dist.world,
                        **({"rng_ranks": rngs} if dist.world > 1 else {})}, tmp / "trainer.pt")
        for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first (temp directories are skipped)."""
    d = Path(run_dir) / "checkpoints"
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX)
             and (p / "trainer.pt").exists()]
    return sorted(found, key=lambda p: p.name)


def resolve_resume(resume: str, run_dir: str | os.PathLike) -> Path | None:
    """`resume`: "auto" (the newest complete checkpoint of this run, if any),
    "none", or a checkpoint path."""
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(run_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / "trainer.pt").exists():
        raise FileNotFoundError(f"resume={resume}: not a complete checkpoint (no trainer.pt in it)")
    return path


def load_checkpoint(path: str | os.PathLike, model, optimizer=None, scheduler=None,
                    generators: dict | None = None, dist: Dist = SINGLE) -> dict:
    """Restore a checkpoint into live objects; returns {"step", "state"}. Each rank
    takes back its own RNG states; a checkpoint of another world size is refused
    (each rank's sampler and data share would differ from the run that wrote it)."""
    import torch
    from safetensors.torch import load_file

    path = Path(path)
    trainer = load_trainer_state(path / "trainer.pt")
    saved_world = int(trainer.get("world_size", 1))
    if saved_world != dist.world:
        raise ValueError(f"{path}: written by a run of {saved_world} process(es), this run has {dist.world}: "
                         f"resume with the same number (torchrun --nproc_per_node {saved_world}), "
                         "or start over (resume=none)")
    saved = load_file(str(path / "trainable.safetensors"))
    params = dict(model.named_parameters())
    missing = [n for n, p in params.items() if p.requires_grad and n not in saved]
    unknown = [n for n in saved if n not in params]
    if missing or unknown:
        raise ValueError(f"{path}: checkpoint does not fit the model (missing {missing[:3]}, unexpected {unknown[:3]})")
    with torch.no_grad():
        for n, t in saved.items():
            params[n].copy_(t.to(params[n].device, params[n].dtype))
    if optimizer is not None and trainer["optimizer"] is not None:
        optimizer.load_state_dict(trainer["optimizer"])
    if scheduler is not None and trainer["scheduler"] is not None:
        scheduler.load_state_dict(trainer["scheduler"])
    set_rng_state(trainer["rng_ranks"][dist.rank] if "rng_ranks" in trainer else trainer["rng"], generators)
    return {"step": trainer["step"], "state": trainer["state"]}


def trim_jsonl(path: str | os.PathLike, step: int) -> int:
    """Drop the lines of a resumed run's log past `step` (all of them when starting
    over at 0), and a torn last line; returns how many were dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            s = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            dropped += 1
            continue
        if step > 0 and s <= step:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        atomic_write_text(path, "".join(x + "\n" for x in keep))
    return dropped


def resume(run_dir: str | os.PathLike, how: str, model, optimizer=None, scheduler=None,
           *, generators: dict | None = None, logs: tuple[str, ...] = ("metrics.jsonl",),
           dist: Dist = SINGLE) -> tuple[int, dict]:
    """Every trainer's resume path: (step, the script's saved state), (0, {}) for a fresh start.

    `how` is the config's `resume` (auto: the newest complete checkpoint). The run's
    JSONL logs then lose the lines written after that checkpoint (a run killed between
    two checkpoints logged steps the resumed run logs again), or all of them when the
    run starts over at step 0.
    """
    ckpt, step, state = resolve_resume(how, run_dir), 0, {}
    if ckpt is not None:
        got = load_checkpoint(ckpt, model, optimizer, scheduler, generators=generators, dist=dist)
        step, state = got["step"], got["state"]
        print(f"resumed from {ckpt} at step {step}")
    for name in logs if dist.main else ():
        if trim_jsonl(Path(run_dir) / name, step):
            print(f"{name}: lines past step {step} dropped (written after the checkpoint resumed from)")
    return step, state


def cosine_schedule(optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warm-up then cosine decay to `min_ratio` of the peak rate."""
    import torch

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        t = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# ---------------------------------------------------------------------------
# Devices and parameter counts
# ---------------------------------------------------------------------------


def device() -> str:
    """"cuda" when a CUDA device is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# bf16 autocast is a speed setting that depends on the hardware: about 2x on a
# CPU with native bf16 matrix units (AVX512-BF16, AMX) and on a GPU, about 12x
# slower on an AVX2-only CPU, where torch falls back to a scalar bf16 GEMM
# (measured: the tiny base stage took 4.3 s a step against 0.37 s in fp32). So
# configs say `autocast: auto` and the choice is made here, at run time.
Autocast = Literal["auto", "none", "bf16"]


def native_bf16(device_type: str) -> tuple[bool, str]:
    """(whether `device_type` multiplies bf16 matrices natively, why), from what
    torch reports: on a CPU the kernels it dispatches to (`get_cpu_capability`,
    which ATEN_CPU_CAPABILITY can lower) and the bf16 units the CPU has."""
    import torch

    if device_type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return ok, f"{torch.cuda.get_device_name()}: bf16 {'supported' if ok else 'not supported'}"
    cap = torch.backends.cpu.get_cpu_capability()
    units = [name for name, probe in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
             if getattr(torch.cpu, probe, lambda: False)()]
    if cap.startswith("AVX512") and units:
        return True, f"CPU kernels {cap} with {' and '.join(units)}: native bf16 matrix units"
    why = f"CPU kernels {cap}" + (f" (the CPU has {' and '.join(units)}, but torch dispatches {cap})" if units else
                                  ", no AVX512-BF16 or AMX")
    return False, why + ": bf16 would run emulated, many times slower than fp32"


# On a CPU, below this hidden size the casts in and out of bf16 cost more than its
# products save, and oneDNN's cache of bf16 kernels grows with every new shape
# (measured on an AMX CPU: the tiny-1m base stage, hidden 128, 500 steps, 110 s and
# 3.4 GB in bf16 against 94 s and 0.7 GB in fp32; SmolLM2, hidden 576, gains 1.2-1.7x).
BF16_MIN_HIDDEN_CPU = 512


def hidden_size(model) -> int | None:
    """The width of `model`'s residual stream (None when it is not a transformers model)."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "hidden_size", None) if cfg is not None else None


def choose_autocast(kind: str, device_type: str, hidden: int | None = None) -> tuple[bool, str]:
    """(bf16 autocast on, the reason for the run log) for a config's `autocast`, on
    `device_type`, for a model of width `hidden` (None: not known yet)."""
    if kind not in ("auto", "none", "bf16"):
        raise ConfigError(f"autocast={kind!r}: expected auto, none or bf16")
    if kind == "none":
        return False, "autocast=none: fp32"
    native, why = native_bf16(device_type)
    if kind == "bf16":
        return True, "autocast=bf16" + ("" if native else f" although {why}")
    if native and device_type == "cpu" and hidden is not None and hidden < BF16_MIN_HIDDEN_CPU:
        return False, (f"autocast=auto -> fp32 (hidden size {hidden} < {BF16_MIN_HIDDEN_CPU}: at this width the "
                       f"casts cost more than bf16 saves, although {why})")
    return native, f"autocast=auto -> {'bf16' if native else 'fp32'} ({why})"


@contextlib.contextmanager
def autocast(enabled: bool, device_type: str, model=None):
    """torch.autocast in bfloat16 on `device_type` when `enabled` (weights and optimizer
    states stay fp32), else nothing. Enter it per step: leaving it clears the cache of
    cast weights, which an optimizer step makes stale. With `model`, its frozen linear
    weights are also held as bf16 copies inside the block (`frozen_linears_in_bf16`)."""
    import torch

    if not enabled:
        yield
        return
    with torch.autocast(device_type, dtype=torch.bfloat16), frozen_linears_in_bf16(model):
        yield


@contextlib.contextmanager
def frozen_linears_in_bf16(model):
    """Inside the block, every frozen fp32 linear weight of `model` (a LoRA base, every
    weight of a model being evaluated, a tied output head) is a bf16 copy; the fp32
    weights are back afterwards. autocast caches the casts of trainable weights only, so
    a frozen weight is cast again at every call: 0.5 GB read and written per decode step
    of a 135M model, more than its products take on a CPU at batch 1. The products are
    the same: autocast multiplies a linear layer in bf16 either way."""
    import torch

    swapped = []
    if model is not None and hasattr(model, "modules"):
        for m in model.modules():
            w = getattr(m, "weight", None)
            if isinstance(m, torch.nn.Linear) and isinstance(w, torch.nn.Parameter) and not w.requires_grad \
                    and w.dtype == torch.float32:
                swapped.append((m, w))
                m.weight = torch.nn.Parameter(w.detach().to(torch.bfloat16), requires_grad=False)
    try:
        yield
    finally:
        for m, w in swapped:
            m.weight = w


def autocast_for(kind: str, model):
    """The autocast a config's `kind` chooses for `model`'s device (`choose_autocast`, not
    printed), frozen weights held in bf16 while it is on; nothing for an engine that is no
    torch module (vLLM keeps its own dtype)."""
    if not hasattr(model, "parameters"):
        return autocast(False, "cpu")
    dev = next(model.parameters()).device.type
    return autocast(choose_autocast(kind, dev, hidden_size(model))[0], dev, model)


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed blocks for reuse instead of handing them back to
    the OS; returns whether it could (glibc only).

    By default glibc maps every block above 32 MB on its own and unmaps it when it is
    freed, so the next tensor of that size faults in fresh zeroed pages: a distillation
    step's logits (2,400 positions x 49k vocabulary) made 25 million page faults in 12
    steps, a quarter of the process's CPU time spent in the kernel. With no mapped blocks
    (M_MMAP_MAX = 0) and no trimming (M_TRIM_THRESHOLD at its maximum), freed memory stays
    in the heap and the next step reuses it: the peak stays what it was, and is not given
    back until the process ends, and blocks of ever-changing sizes can fragment the heap
    (RL's memory rises and falls between 8 and 19 GB within a run; held at its peak, it
    would stay there): distillation, whose big blocks are all alike, is the one stage that
    asks for it."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def setup_compute(threads: int, autocast_kind: str, device_type: str, model=None) -> bool:
    """A script's compute settings, chosen once and printed: torch's CPU threads (0 =
    its default) and bf16 autocast (`choose_autocast`, for `model`'s width when given);
    returns the latter."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    on, why = choose_autocast(autocast_kind, device_type, hidden_size(model))
    print(f"compute: {device_type}, {torch.get_num_threads()} threads, {why}", flush=True)
    return on


def count_parameters(model, trainable: bool = False) -> int:
    """Parameters of `model` (only those that require grad if `trainable`).

    bitsandbytes packs two 4-bit weights into a byte; they count at their unpacked size.
    """
    n = 0
    for p in model.parameters():
        if trainable and not p.requires_grad:
            continue
        quant_state = getattr(p, "quant_state", None)
        n += quant_state.shape.numel() if quant_state is not None else p.numel()
    return n


REFERENCE_ADAPTER = "reference"


def save_pretrained(model, path: str | os.PathLike) -> None:
    """`model.save_pretrained(path)` without the frozen reference adapter, if any."""
    names = list(getattr(model, "peft_config", None) or ())
    if REFERENCE_ADAPTER in names:
        model.save_pretrained(path, selected_adapters=[n for n in names if n != REFERENCE_ADAPTER])
    else:
        model.save_pretrained(path)


def save_final(model, tokenizer, path: str | os.PathLike, merge: bool = False) -> Path:
    """A trained model and its tokenizer, written atomically to `path` (a run's final/).

    `merge=True` folds a LoRA adapter into the weights first (in place), so the
    directory loads as a plain model, with no PEFT needed (the distilled student).
    """
    if merge and getattr(model, "peft_config", None):
        model = model.merge_and_unload()
    with atomic_dir(path) as tmp:
        save_pretrained(model, tmp)
        tokenizer.save_pretrained(tmp)
    return Path(path)


