"""Continuous evaluation of a served policy: rolling quality and latency from serve.py's episode log, with alerts.

    python monitor.py runs/serve/episodes.jsonl [--config configs/monitor.yaml] [key=value ...]

It reads the log and its rotated files (LOG.N ... LOG.1, then LOG: oldest first),
cuts the episodes into consecutive windows of `window` (counted back from the
newest, so the newest is whole), and reports per window:
pass rate (the reward's threshold and every rule), the share of summaries with
a claim the factuality backend scored unsupported (the hallucination flag),
factuality, searches and deletes per summary, the valid tool-call rate, and
latency p50/p95. Requests the server failed are logged too (their status, no
document): the share of the newest `window` requests that failed on the
server's side (5xx: an engine error, a full queue, a deadline) has its own
threshold (`max_failure_rate`), and so has the age of the newest request
(`stale_after_s`: nothing served for that long). It writes report.md,
monitor.json and monitor.png (the same figures as rolling curves over time,
thresholds dashed) to `out`, prints the table, and exits 1 when the newest
window is past a threshold (each breach on an `ALERT` line), so a cron job can
alert; 2 when there is nothing to read.

    */10 * * * *  cd factual-tools && python monitor.py runs/serve/episodes.jsonl --config configs/monitor.yaml || notify

A torn last line (the server writing it) is skipped silently; any other
unreadable line is skipped and reported by file and line.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from factual_tools import common, settings

FIGURES = ("pass", "hallucination", "factuality", "searches", "deletes", "valid_calls", "p50_ms", "p95_ms")


@dataclass
class Config:
    log: str = "runs/serve/episodes.jsonl"  # serve.py's episode log (its rotated files are read too)
    out: str = "runs/monitor"  # report.md, monitor.json, monitor.png
    window: int = 50  # episodes per window
    min_pass: float = 0.0  # alert when the newest window's pass rate is below this (0 = off)
    max_hallucination: float = 1.0  # ... its share of flagged summaries above this (1 = off)
    min_valid_calls: float = 0.0  # ... its valid tool-call rate below this (0 = off)
    max_p95_ms: float = 0.0  # ... its p95 latency above this (0 = off)
    max_failure_rate: float = 1.0  # ... the share of the newest `window` requests answered 5xx above this (1 = off)
    stale_after_s: float = 0.0  # alert when the newest request is older than this (0 = off)

    def __post_init__(self):
        if self.window < 1:
            raise settings.ConfigError("window must be >= 1")


def log_files(log: str | Path) -> list[Path]:
    """The log and its rotations, oldest first (RotatingFileHandler: LOG.1 is the newest backup)."""
    log = Path(log)
    rotated = [p for p in log.parent.glob(log.name + ".*") if p.suffix[1:].isdigit()]
    return sorted(rotated, key=lambda p: -int(p.suffix[1:])) + ([log] if log.exists() else [])


def read_log(log: str | Path) -> tuple[list[dict], list[str]]:
    """(records in order: episodes, and failed requests with their `status`; 'file:line:
    reason' for each line skipped)."""
    files = log_files(log)
    if not files:
        raise FileNotFoundError(f"{log}: no episode log (start `python serve.py --model DIR` and send it documents)")
    records, skipped = [], []
    for path in files:
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict) or "time" not in rec or ("scores" not in rec and "status" not in rec):
                    raise ValueError("not an episode record")
            except ValueError as e:
                if path == files[-1] and n == len(lines):  # no newline yet: the server is writing it
                    continue
                skipped.append(f"{path}:{n}: {str(e).splitlines()[0]}")
                continue
            records.append(rec)
    return records, skipped


def episode_figures(rec: dict) -> dict:
    calls = rec.get("tool_calls") or []
    return {"time": float(rec["time"]), "pass": float(bool(rec["scores"].get("pass"))),
            "hallucination": float(bool(rec.get("hallucination"))),
            "factuality": float(rec["scores"].get("factuality") or 0.0),
            "searches": float(sum(c.get("kind") == "search" for c in calls)),
            "deletes": float(sum(c.get("kind") == "delete" for c in calls)),
            "calls": float(len(calls)), "valid": float(sum(bool(c.get("valid")) for c in calls)),
            "latency_ms": float(rec.get("latency_ms") or math.nan)}


def window_figures(eps: list[dict]) -> dict:
    lat = np.array([e["latency_ms"] for e in eps])
    lat = lat[np.isfinite(lat)]
    calls = sum(e["calls"] for e in eps)
    return {"start": eps[0]["time"], "end": eps[-1]["time"], "n": len(eps),
            **{k: common.mean(e[k] for e in eps) for k in ("pass", "hallucination", "factuality", "searches",
                                                           "deletes")},
            "valid_calls": sum(e["valid"] for e in eps) / calls if calls else math.nan,
            "p50_ms": float(np.percentile(lat, 50)) if lat.size else math.nan,
            "p95_ms": float(np.percentile(lat, 95)) if lat.size else math.nan}


def windows(eps: list[dict], size: int) -> list[dict]:
    """Consecutive windows of `size` episodes counted back from the newest, so the newest
    window is always whole; the oldest holds the remainder."""
    ends = list(range(len(eps), 0, -size))[::-1]
    return [window_figures(eps[max(0, e - size):e]) for e in ends]


def request_figures(records: list[dict], cfg: Config, now: float) -> dict:
    """Over every logged request (episodes and failures): the newest `window` requests'
    share answered 5xx and 4xx, and the newest request's age."""
    recent = records[-cfg.window:]
    status = [int(r.get("status", 200)) for r in recent]
    return {"requests": len(recent), "failure_rate": sum(s >= 500 for s in status) / len(recent),
            "rejected_rate": sum(400 <= s < 500 for s in status) / len(recent),
            "age_s": now - max(float(r["time"]) for r in records)}


def alerts(latest: dict | None, req: dict, cfg: Config) -> list[str]:
    """The thresholds the newest window (None: no episode in the log) is past, one line each."""
    bad = []
    if req["failure_rate"] > cfg.max_failure_rate:
        bad.append(f"failure_rate {req['failure_rate']:.4g} above max_failure_rate={cfg.max_failure_rate} "
                   f"(newest {req['requests']} requests)")
    if cfg.stale_after_s > 0 and req["age_s"] > cfg.stale_after_s:
        bad.append(f"stale: the newest request is {req['age_s']:.0f} s old, over stale_after_s={cfg.stale_after_s:g}")
    if latest is None:
        return bad
    checks = [("pass", latest["pass"] < cfg.min_pass, f"below min_pass={cfg.min_pass}"),
              ("hallucination", latest["hallucination"] > cfg.max_hallucination,
               f"above max_hallucination={cfg.max_hallucination}"),
              ("valid_calls", cfg.min_valid_calls > 0 and latest["valid_calls"] < cfg.min_valid_calls,
               f"below min_valid_calls={cfg.min_valid_calls}"),
              ("p95_ms", cfg.max_p95_ms > 0 and latest["p95_ms"] > cfg.max_p95_ms, f"above max_p95_ms={cfg.max_p95_ms}")]
    return bad + [f"{k} {latest[k]:.4g} {why} (newest {latest['n']} episodes)" for k, off, why in checks if off]


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _fmt(k: str, v: float) -> str:
    if not math.isfinite(v):
        return "n/a"
    return f"{v:.0f}" if k.endswith("_ms") else f"{v:.2f}" if k in ("searches", "deletes") else f"{100 * v:.1f}%"


def table(wins: list[dict]) -> str:
    head = ["window (UTC)", "episodes", *FIGURES]
    rows = [f"| {_when(w['start'])} .. {_when(w['end'])[11:]} | {w['n']} | "
            + " | ".join(_fmt(k, w[k]) for k in FIGURES) + " |" for w in wins]
    return "\n".join([f"| {' | '.join(head)} |", "|" + "---|" * len(head), *rows])


def plot(eps: list[dict], cfg: Config, path: Path) -> None:
    """Rolling means (over `window` episodes) against time, four panels, thresholds dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    w = min(cfg.window, len(eps))
    t = np.array([e["time"] for e in eps])
    x = mdates.date2num((t[w - 1:] * 1e3).astype("int64").astype("datetime64[ms]"))

    def rolling(k: str) -> np.ndarray:
        v = np.array([e[k] for e in eps])
        return np.convolve(v, np.ones(w) / w, mode="valid")

    lat = np.array([e["latency_ms"] for e in eps])
    lat_p = {q: np.array([np.nanpercentile(lat[i - w + 1:i + 1], q) for i in range(w - 1, len(eps))])
             for q in (50, 95)}
    fig, axes = plt.subplots(4, 1, figsize=(7, 9), sharex=True)
    panels = [("rate", [("pass", rolling("pass"), cfg.min_pass),
                        ("hallucination", rolling("hallucination"), cfg.max_hallucination)]),
              ("factuality", [("factuality", rolling("factuality"), None)]),
              ("per summary", [("searches", rolling("searches"), None), ("deletes", rolling("deletes"), None)]),
              ("latency ms", [("p50", lat_p[50], None), ("p95", lat_p[95], cfg.max_p95_ms or None)])]
    for ax, (label, series) in zip(axes, panels):
        for name, y, limit in series:
            line, = ax.plot(x, y, label=name)
            if limit is not None and 0 < limit < (1 if label == "rate" else math.inf):
                ax.axhline(limit, ls="--", color=line.get_color(), lw=1)
        ax.set_ylabel(label)
        ax.legend(fontsize=7, loc="upper left")
    locator = mdates.AutoDateLocator()
    axes[-1].xaxis.set_major_locator(locator)
    axes[-1].xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))  # seconds to months, as the span needs
    fig.suptitle(f"{cfg.log}: rolling means over {w} episodes (UTC)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(cfg: Config) -> int:
    try:
        records, skipped = read_log(cfg.log)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for s in skipped:
        print(f"warning: skipped {s}", file=sys.stderr)
    if not records:
        print(f"error: {cfg.log}: no episode records", file=sys.stderr)
        return 2
    episodes = [r for r in records if "scores" in r]
    eps = [episode_figures(r) for r in episodes]
    wins = windows(eps, cfg.window) if eps else []
    req = request_figures(records, cfg, time.time())
    bad = alerts(wins[-1] if wins else None, req, cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if eps:
        plot(eps, cfg, out / "monitor.png")
    backends = sorted({str(r["scores"].get("factuality_backend")) for r in episodes})
    span = f" from {_when(eps[0]['time'])} to {_when(eps[-1]['time'])} UTC" if eps else ""
    md = (f"# Served episodes: {len(eps)}{span}\n\n"
          f"Log: {cfg.log} ({len(log_files(cfg.log))} files); factuality: {', '.join(backends) or 'n/a'}; "
          f"windows of {cfg.window} episodes.\n\n{table(wins) if wins else 'No episode was served.'}\n\n"
          f"Newest {req['requests']} requests: {100 * req['failure_rate']:.1f}% failed on the server's side (5xx), "
          f"{100 * req['rejected_rate']:.1f}% rejected (4xx); the newest is {req['age_s']:.0f} s old.\n\n"
          + ("\n".join(f"ALERT: {a}" for a in bad) if bad else "No threshold crossed by the newest window.") + "\n")
    common.atomic_write_text(out / "report.md", md)
    common.atomic_write_text(out / "monitor.json", json.dumps(common.jsonable(
        {"log": cfg.log, "episodes": len(eps), "requests": req, "skipped_lines": skipped, "windows": wins,
         "alerts": bad, "config": settings.config_to_dict(cfg)}, nonfinite="null"), indent=1, allow_nan=False) + "\n")
    print(md + f"wrote {out}/report.md, monitor.json" + (", monitor.png" if eps else ""))
    return 1 if bad else 0


def cli(argv: list[str]) -> int:
    """`[LOG | --from-log LOG] [--config FILE] [key=value ...]`."""
    args = settings.flags_as_overrides(argv, {"--from-log": "log"})
    args = [a if "=" in a or a.startswith("-") or i and args[i - 1] == "--config" else f"log={a}"
            for i, a in enumerate(args)]
    with settings.config_errors_exit():
        cfg = settings.load_config(Config, args)
    return main(cfg)


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
