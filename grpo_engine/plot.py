"""PNG curves of a run: `grpo plot RUN_DIR` reads RUN_DIR/metrics.jsonl and writes RUN_DIR/curves.png.

Each panel names the metrics it draws; a panel whose metrics the run never logged, or logged as 0 throughout
(e.g. KL when beta = 0), is left out rather than drawn empty. Per-step curves are drawn faintly under their
moving average, since a step's reward over a few dozen samples is noisy. Held-out evaluation points
(logged every eval interval) are drawn as markers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from .checkpoint.disk import removed_on_failure
from .checkpoint.run_dir import parse_line
from .checkpoint.run_files import run_file


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # metrics.jsonl keys drawn in this panel, each as its own line
    ylabel: str


PANELS = (
    Panel("Reward (training samples)", ("reward_mean",), "mean total reward"),
    Panel("Accuracy", ("accuracy", "eval/accuracy"), "fraction correct"),
    Panel("Completion length", ("completion_len_mean", "completion_len_max", "eval/length_mean"), "tokens"),
    Panel("KL to reference", ("kl",), "nats / token"),
    Panel("Policy entropy", ("entropy",), "nats / token"),
    Panel("Semantic entropy", ("semantic_entropy",), "nats (mean over groups)"),
    Panel("Sampler / trainer mismatch", ("mismatch_mean_abs", "mismatch_max_abs"), "|log pi_train - log pi_sampler|"),
    Panel("Mismatch KL(sampler || trainer), k3", ("mismatch_k3",), "nats / token"),
    Panel("Rollout correction", ("rollout_correction_frac",), "fraction of tokens capped / masked"),
    Panel("Throughput", ("gen_tokens_per_s", "train_tokens_per_s"), "tokens / s"),
)


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl rows; a torn last line (a run killed mid-write) is skipped, not fatal."""
    return [row for line in path.read_text().splitlines() if (row := parse_line(line)) is not None]


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric, skipping rows without it and non-finite values."""
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(row.get("step", len(xs)))
            ys.append(v)
    return xs, ys


def moving_average(ys: list[float], frac: float = 0.05) -> list[float]:
    """Trailing mean over a window of ~5% of the run (at least 1 point), same length as ys."""
    w = max(1, round(len(ys) * frac))
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y - (ys[i - w] if i >= w else 0.0)
        out.append(total / min(i + 1, w))
    return out


def plot_path(run_dir: Path, out: str | Path | None, overwrite: bool) -> Path:
    """Where the PNG goes: RUN_DIR/curves.png (grpo plot's own file, redrawn each time), also when --out names it in
    another spelling, or --out elsewhere, which must not name an existing file unless `overwrite` (it replaced
    whatever was there)."""
    own = run_dir / "curves.png"
    if out is None:
        return own
    path = Path(out)
    if path.is_dir():  # --out a folder: the default name inside it (not a sibling FOLDER.png)
        path = path / "curves.png"
    elif not path.suffix:  # matplotlib appends .png itself: the path it really writes
        path = path.with_suffix(".png")
    if same_file(path, own):
        return own
    if path.exists() and not overwrite:
        raise ValueError(f"--out {path} exists; name another file, or pass --overwrite to replace it")
    return path


def same_file(path: Path, own: Path) -> bool:
    """Whether `path` names `own` however it is spelled: relative, with `.` or `..`, through a link to its folder,
    in another case on a disk that ignores case. Its folder is compared as a file (os.path.samefile), not as text;
    the name by text, or as a file when both exist (a link at either name is compared as the link, not its target)."""
    try:
        if not os.path.samefile(path.parent, own.parent):
            return False
    except OSError:  # a folder that does not exist is not the run directory
        return False
    if path.name == own.name:
        return True
    try:
        return os.path.samestat(os.lstat(path), os.lstat(own))
    except OSError:
        return False


def _save(fig, run_dir: Path, out: Path, overwrite: bool) -> None:
    """The PNG whole or not at all: a full disk or a signal midway leaves the old PNG, no half-written one.
    RUN_DIR/curves.png is the engine's own file (checkpoint/run_files.py): a curves.png it did not draw (yours, or
    a link) is replaced only with --overwrite, and a link is replaced, never written through."""
    if out == run_dir / "curves.png":
        with run_file(run_dir, out.name, overwrite=overwrite) as tmp:
            fig.savefig(tmp, dpi=110, format="png")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    with removed_on_failure(tmp):
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, out)


def plot_run(run_dir: str | Path, out: str | Path | None = None, overwrite: bool = False) -> Path:
    """Draw the panels that have data into one PNG; returns its path. The PNG is written whole or not at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"{metrics} not found: pass the run directory that `grpo train` wrote")
    out = plot_path(run_dir, out, overwrite)
    rows = read_metrics(metrics)
    panels = [p for p in PANELS if any(any(series(rows, k)[1]) for k in p.keys)]  # skip never-logged / all-zero
    if not panels:
        raise ValueError(f"{metrics} has no plottable metrics (keys seen: {sorted({k for r in rows for k in r})[:12]})")
    cols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.2 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for key in panel.keys:
            xs, ys = series(rows, key)
            if not xs:
                continue
            if key.startswith("eval/"):  # held-out points: few, exact, drawn as markers
                ax.plot(xs, ys, "o-", label=key, markersize=4)
            else:  # per-step values are noisy: faint raw curve under its moving average
                line = ax.plot(xs, ys, "-", alpha=0.25, linewidth=0.8)[0]
                ax.plot(xs, moving_average(ys), "-", color=line.get_color(), label=key)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"grpo-engine run: {run_dir.name}")
    fig.tight_layout()
    try:
        _save(fig, run_dir, out, overwrite)
    finally:
        plt.close(fig)
    return out
