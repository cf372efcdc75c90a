"""PNG curves of a run: `grpo plot RUN_DIR` reads RUN_DIR/metrics.jsonl and writes RUN_DIR/curves.png.

Each panel names the metrics it draws; a panel whose metrics the run never logged (e.g. KL when beta = 0)
is left out rather than drawn empty. Held-out evaluation points (logged every eval interval) are drawn as
markers over the per-step training curve.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Panel:
    title: str
    keys: tuple[str, ...]  # metrics.jsonl keys drawn in this panel, each as its own line
    ylabel: str


PANELS = (
    Panel("Reward", ("reward/mean", "eval/accuracy"), "mean reward / accuracy"),
    Panel("Accuracy", ("accuracy", "eval/pass@1"), "fraction correct"),
    Panel("Completion length", ("length/mean", "length/max"), "tokens"),
    Panel("KL to reference", ("kl/mean",), "nats / token"),
    Panel("Policy entropy", ("entropy/mean",), "nats / token"),
    Panel("Semantic entropy", ("semantic_entropy/mean",), "nats"),
    Panel("Throughput", ("tokens_per_s/generate", "tokens_per_s/train"), "tokens / s"),
)


def read_metrics(path: Path) -> list[dict]:
    """metrics.jsonl rows; a torn last line (a run killed mid-write) is skipped, not fatal."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of one metric, skipping rows without it and non-finite values."""
    xs, ys = [], []
    for row in rows:
        v = row.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(row.get("step", len(xs)))
            ys.append(v)
    return xs, ys


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the panels that have data into one PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(f"{metrics} not found: pass the run directory that `grpo train` wrote")
    rows = read_metrics(metrics)
    panels = [p for p in PANELS if any(series(rows, k)[0] for k in p.keys)]
    if not panels:
        raise ValueError(f"{metrics} has no plottable metrics (keys seen: {sorted({k for r in rows for k in r})[:12]})")
    cols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.2 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for key in panel.keys:
            xs, ys = series(rows, key)
            if xs:
                style = "o-" if key.startswith("eval/") else "-"
                ax.plot(xs, ys, style, label=key, markersize=4)
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(f"grpo-engine run: {run_dir.name}")
    fig.tight_layout()
    out = Path(out) if out else run_dir / "curves.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
