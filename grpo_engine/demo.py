"""`grpo demo`: the engine end to end on a laptop CPU, in minutes, with no downloads.

A tiny random byte-level model is warm-started with a supervised phase on generated 2-digit addition written
by a sloppy teacher (most of its answers forget the carry), evaluated greedily on held-out problems, trained
with GRPO against the exact answer through the same `train()` as any run, and evaluated again: the
verifiable reward corrects a mistake that the supervised data taught. The recipe is the embedded
recipes/demo.yaml (identical to configs/demo.yaml, so `grpo train configs/demo.yaml` does the same run);
key=value overrides apply to it as to any config.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .config import Config, check_paths, load_config

DEMO_RECIPE = files("grpo_engine") / "recipes" / "demo.yaml"
# A shortened run for tests and smoke checks: same code path, seconds instead of minutes.
QUICK_OVERRIDES = (
    "warm_start.tiny.hidden_size=64", "warm_start.tiny.num_hidden_layers=2", "warm_start.sft.steps=30",
    "schedule.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4", "eval.every=0",
    "eval.max_examples=16",
)


@dataclass
class HeldOut:
    """Greedy held-out results of one model."""

    accuracy: float
    format_rate: float
    mean_length: float
    num_problems: int


@dataclass
class DemoResult:
    before: HeldOut  # after the supervised warm start, before GRPO
    after: HeldOut  # after GRPO
    run_dir: Path
    plot: Path | None
    seconds: float


def held_out(model_dir: Path, cfg: Config, task) -> HeldOut:
    """Greedy accuracy / format rate / length on the first eval.max_examples of the eval split."""
    from .eval.evaluate import EvalConfig, evaluate
    from .kernels import apply_kernels
    from .model.hf_io import load_model
    from .model.tokenizer import load_tokenizer

    model, tok = apply_kernels(load_model(model_dir)), load_tokenizer(model_dir)
    examples = task.examples(cfg.task.eval_split)[: cfg.eval.max_examples]
    ecfg = EvalConfig(n=1, ks=(1,), temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens, prompts_per_batch=64)
    s = evaluate(model, tok, task, examples, ecfg).summary
    return HeldOut(s.pass_at[1], s.format_rate, s.mean_length, s.num_problems)


def run_demo(overrides: list[str] | tuple[str, ...] = (), console: Console | None = None) -> DemoResult:
    from .train.loop import train
    from .train.setup import task_of
    from .train.warm_start import warm_start

    console = console or Console()
    t0 = time.perf_counter()
    cfg = load_config(Path(str(DEMO_RECIPE)), list(overrides))
    check_paths(cfg)
    task = task_of(cfg)
    console.print(f"[bold]grpo demo[/bold]: {cfg.task.name} · tiny {cfg.warm_start.tiny.arch} model · "
                  f"run dir {cfg.run_dir}")
    with _progress(console) as bar:
        job = bar.add_task("1/3 supervised warm start", total=cfg.warm_start.sft.steps)
        policy = warm_start(cfg, task, on_sft_step=lambda step, loss: bar.update(job, completed=step + 1,
                                                                            description=f"1/3 SFT loss {loss:.3f}"))
    before = held_out(policy, cfg, task)
    console.print(f"after SFT: held-out accuracy {before.accuracy:.1%} on {before.num_problems} problems")
    console.print(f"2/3 GRPO: {cfg.schedule.steps} steps × {cfg.rollout.prompts_per_step} prompts × "
                  f"{cfg.rollout.group_size} samples")
    cfg.model.path = str(policy)
    result = train(cfg)
    console.print("3/3 held-out evaluation of the GRPO model")
    after = held_out(result.checkpoint / "model", cfg, task)
    plot = _plot(cfg.run_dir, console)
    seconds = time.perf_counter() - t0
    console.print(_table(before, after))
    console.print(f"total wall time {seconds:.0f} s · metrics {cfg.run_dir}/metrics.jsonl · plot {plot} · "
                  f"checkpoint {result.checkpoint}")
    return DemoResult(before, after, Path(cfg.run_dir), plot, seconds)


def _progress(console: Console) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                    TimeElapsedColumn(), console=console, disable=not console.is_terminal)


def _plot(run_dir: str, console: Console) -> Path | None:
    from .plot import plot_run

    try:
        return plot_run(run_dir)
    except ValueError as e:  # too few logged steps to draw (very short runs)
        console.print(f"no plot: {e}")
        return None


def _table(before: HeldOut, after: HeldOut) -> Table:
    table = Table(title=f"Held-out greedy results ({before.num_problems} problems)")
    for col in ("", "accuracy", "format rate", "mean length (tokens)"):
        table.add_column(col, justify="right")
    for name, r in (("SFT only", before), ("SFT + GRPO", after)):
        table.add_row(name, f"{r.accuracy:.1%}", f"{r.format_rate:.1%}", f"{r.mean_length:.1f}")
    table.add_row("change", _points(after.accuracy - before.accuracy),
                  _points(after.format_rate - before.format_rate), f"{after.mean_length - before.mean_length:+.1f}")
    return table


def _points(delta: float) -> str:
    """A difference of two rates in percentage points (not a relative change)."""
    return f"{100 * delta:+.1f} pts"


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="tiny model learns arithmetic on CPU: SFT warm start, then GRPO (minutes)")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the demo recipe, e.g. schedule.steps=50")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run of the same pipeline")
    p.set_defaults(func=_demo)


def _demo(args) -> int:
    run_demo([*(QUICK_OVERRIDES if args.quick else ()), *args.overrides])
    return 0
