"""Run monitoring: console progress bar, metrics.jsonl, samples.jsonl, optional TensorBoard / wandb.

metrics.jsonl is always written, one JSON object per optimizer step with the fixed keys of `StepMetrics`
(plus per-component reward statistics), so plots and tests can rely on the schema.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class StepMetrics:
    step: int
    loss: float = math.nan
    reward_mean: float = math.nan
    reward_std: float = math.nan
    reward_components: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> {mean, std}
    accuracy: float = math.nan
    completion_len_mean: float = math.nan
    completion_len_max: int = 0
    truncation_rate: float = math.nan
    zero_variance_frac: float = math.nan
    zero_variance_groups: int = 0  # groups whose rewards were all equal: no learning signal from them
    reward_errors: int = 0  # rewards that raised (scored 0)
    reward_timeouts: int = 0  # rewards that ran past their time limit (scored 0)
    reward_nonfinite: int = 0  # rewards that returned NaN / inf (scored 0)
    semantic_entropy: float = math.nan
    kl: float = math.nan
    entropy: float = math.nan
    clip_frac_low: float = math.nan
    clip_frac_high: float = math.nan
    ratio_mean: float = math.nan
    ratio_max: float = math.nan
    # sampler vs trainer log-probs of the completion tokens (rl/correction.py): |log pi_train - log pi_sampler|
    mismatch_mean_abs: float = math.nan  # its mean over tokens
    mismatch_max_abs: float = math.nan  # its max
    mismatch_k3: float = math.nan  # k3 estimate of KL(pi_sampler || pi_train), nats per token
    rollout_correction_frac: float = math.nan  # tokens capped (tis) or masked (mis) by algorithm.rollout_correction
    grad_norm: float = math.nan
    lr: float = math.nan
    skipped_update: bool = False
    refills: int = 0
    rows: int = 0
    train_tokens: int = 0
    gen_tokens: int = 0
    gen_tokens_per_s: float = math.nan
    train_tokens_per_s: float = math.nan
    time_generate_s: float = 0.0
    time_logprobs_s: float = 0.0
    time_update_s: float = 0.0
    time_step_s: float = 0.0
    peak_mem_mib: float = math.nan
    micro_batch_tokens: int = 0
    # curriculum (collect/curriculum.py): set on the steps that re-score a pool, NaN / 0 on the others
    curriculum_pool_accuracy: float = math.nan  # mean accuracy of the pooled prompts' samples
    curriculum_pool_entropy: float = math.nan  # mean semantic entropy / log(samples) of the pooled prompts
    curriculum_queued: int = 0  # pooled prompts queued to be served next
    curriculum_gen_tokens: int = 0  # completion tokens the scoring generated
    curriculum_time_s: float = 0.0
    eval: dict[str, float] = field(default_factory=dict)  # "eval/accuracy", ... on evaluation steps only
    # tools.enabled only (empty otherwise): "tool_calls", "tool_errors", "turns", means per trajectory
    tools: dict[str, float] = field(default_factory=dict)
    # the decode's CUDA graphs, once a capture was checked (empty on a CPU): "rollout/cuda_graphs_fallback" is 1
    # when a failed capture check made the rollout decode eagerly (rollout/static_decode.py)
    rollout: dict[str, float] = field(default_factory=dict)

    def flat(self) -> dict:
        """The record as metrics.jsonl stores it: the eval figures as top-level "eval/..." keys, and the tool and
        rollout figures (when there are any) as top-level keys."""
        record = dataclasses.asdict(self)
        nested = ("eval", "tools", "rollout")
        return {**{k: v for k, v in record.items() if k not in nested}, **self.tools, **self.rollout, **self.eval}

    def to_json(self) -> str:
        def clean(v):
            if isinstance(v, float) and not math.isfinite(v):
                return None  # strict JSON: NaN/inf become null
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return v

        return json.dumps({k: clean(v) for k, v in self.flat().items()})


@dataclass
class Sample:
    step: int
    prompt: str
    completion: str
    reward: float
    components: dict[str, float]
    answer: str | None
    finish_reason: str
    error: str | None = None  # why the reward failed ("exception: ...", "timeout: ..."), None when it did not


def headline(m: StepMetrics) -> str:
    """The numbers a person watches a run by: reward, accuracy (left out when NaN: the task has no answer check) and
    completion length."""
    acc = "" if m.accuracy != m.accuracy else f"  acc {m.accuracy:.2f}"
    return f"reward {m.reward_mean:.3f}{acc}  len {m.completion_len_mean:.0f}"


def step_line(m: StepMetrics, total: int, seconds: float) -> str:
    """The line printed per step where no terminal redraws a bar (a log, Jupyter): the headline, the sampler's speed
    and the seconds since the run started."""
    return f"step {m.step}/{total}  {headline(m)}  gen {m.gen_tokens_per_s:.0f} tok/s  {seconds:.0f} s"


class _Console:
    """rich progress bar with the headline numbers; off when stdout is not a terminal."""

    def __init__(self, total: int, start: int):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress(
            TextColumn("step {task.completed}/{task.total}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        )
        self.task = self.progress.add_task("train", total=total, completed=start, info="")
        self.progress.start()

    def update(self, m: StepMetrics) -> None:
        info = f"{headline(m)}  gen {m.gen_tokens_per_s:.0f} tok/s  train {m.train_tokens_per_s:.0f} tok/s"
        self.progress.update(self.task, completed=m.step, info=info)

    def close(self) -> None:
        self.progress.stop()


class _PlainLines:
    """The console when stdout is not a terminal (a log file, CI, nohup): one plain line per step, or per
    `every_s` seconds when steps are faster, so a long run never goes silent."""

    def __init__(self, total: int, every_s: float = 10.0):
        self.total, self.every_s = total, every_s
        self.start = time.monotonic()
        self.last = -float("inf")

    def update(self, m: StepMetrics) -> None:
        now = time.monotonic()
        if now - self.last < self.every_s and m.step != self.total:
            return
        self.last = now
        print(step_line(m, self.total, now - self.start), flush=True)

    def close(self) -> None:
        pass


class _NotebookLines:
    """The console in Jupyter: a progress bar redrawn in place in the cell's output (an IPython display, no escape
    sequences) and every step's line below it."""

    def __init__(self, total: int, start: int):
        from IPython.display import display

        self.total, self.start = total, time.monotonic()
        self.handle = display({"text/plain": self._bar(start, "")}, raw=True, display_id=True)

    def _bar(self, step: int, info: str, width: int = 30) -> str:
        done = round(width * step / max(1, self.total))
        return f"step {step}/{self.total} [{'#' * done}{'.' * (width - done)}] {time.monotonic() - self.start:.0f} s" \
               f"{'  ' + info if info else ''}"

    def update(self, m: StepMetrics) -> None:
        print(step_line(m, self.total, time.monotonic() - self.start), flush=True)
        self.handle.update({"text/plain": self._bar(m.step, headline(m))}, raw=True)

    def close(self) -> None:
        pass


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (IPython's ZMQ shell): its stdout is no terminal, yet a person
    watches it."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def console_for(total: int, start: int):
    """rich's bar on a terminal, a bar and a line per step in Jupyter, plain lines elsewhere (a log keeps no escape
    sequences)."""
    if sys.stdout.isatty():
        return _Console(total, start)
    return _NotebookLines(total, start) if in_notebook() else _PlainLines(total)


class Monitor:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        total_steps: int,
        start_step: int,
        progress: bool,
        tensorboard: bool,
        wandb: bool,
        wandb_project: str,
        config: dict,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.samples_path = self.run_dir / "samples.jsonl"
        self._truncate_metrics_after(start_step)
        if not progress:
            self.console = None
        else:
            self.console = console_for(total_steps, start_step)
        self.tb = _open_tensorboard(self.run_dir) if tensorboard else None
        self.wandb = _open_wandb(wandb_project, config, self.run_dir) if wandb else None

    def _truncate_metrics_after(self, step: int) -> None:
        """Keep the lines of steps up to `step`; later ones (a run stopped between checkpoints: the resumed run
        writes those steps again) move to RUN_DIR/superseded-<UTC time>/, since a config changed on resume makes
        the new lines differ. A torn last line (a crash or a full disk mid-write) is dropped with one warning
        instead of blocking the run; any other unreadable line (a note someone added) moves to the same folder,
        with one warning."""
        from .checkpoint.run_dir import split_jsonl, superseded_dir, unreadable_to

        dest = superseded_dir(self.run_dir)
        for path in (self.metrics_path, self.samples_path):
            moved, torn, unreadable = split_jsonl(path, dest / path.name, step)
            if torn:
                print(f"warning: {path}: dropped its torn (half-written) last line", file=sys.stderr)
            if unreadable:
                print(f"warning: {path}: {unreadable} unreadable line(s) (not a JSON record with a step) moved to "
                      f"{unreadable_to(dest / path.name)}", file=sys.stderr)
            if moved:
                print(f"resuming after step {step}: {path.name}'s later lines moved to {dest}", file=sys.stderr)

    def log_step(self, m: StepMetrics) -> None:
        with self.metrics_path.open("a") as f:
            f.write(m.to_json() + "\n")
        scalars = {k: v for k, v in m.flat().items() if isinstance(v, (int, float)) and k != "step"}
        for name, stats in m.reward_components.items():
            for stat, v in stats.items():
                scalars[f"reward/{name}/{stat}"] = v
        if self.tb is not None:
            for k, v in scalars.items():
                if v is not None and math.isfinite(float(v)):
                    self.tb.add_scalar(k, float(v), m.step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=m.step)
        if self.console is not None:
            self.console.update(m)

    def log_samples(self, samples: list[Sample]) -> None:
        with self.samples_path.open("a") as f:
            for s in samples:
                f.write(json.dumps(dataclasses.asdict(s)) + "\n")

    def message(self, text: str) -> None:
        """A line for the person watching (stderr, above the progress bar)."""
        if isinstance(self.console, _Console):
            self.console.progress.console.print(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.console is not None:
            self.console.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class RankMessages:
    """The Monitor of a rank other than 0 under torchrun: rank 0 logs the step; this one only prints its own
    messages (prefixed with its rank)."""

    metrics_path = None

    def __init__(self, rank: int):
        self.rank = rank

    def log_step(self, m: StepMetrics) -> None:
        pass

    def log_samples(self, samples: list[Sample]) -> None:
        pass

    def message(self, text: str) -> None:
        print(f"[rank {self.rank}] {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def _open_tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise RuntimeError(
            "logging.tensorboard=true but the `tensorboard` package is not installed: "
            "pip install 'grpo-engine[tensorboard]' or set logging.tensorboard=false"
        ) from e
    return SummaryWriter(log_dir=str(run_dir / "tensorboard"))


def _open_wandb(project: str, config: dict, run_dir: Path):
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError(
            "logging.wandb=true but the `wandb` package is not installed: "
            "pip install 'grpo-engine[wandb]' or set logging.wandb=false"
        ) from e
    return wandb.init(project=project, config=config, dir=str(run_dir))
