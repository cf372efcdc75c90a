"""train(cfg): set-up (train/setup.py), then the loop: one GRPO step (train/step.py), evaluate, log,
checkpoint; stop cleanly on Ctrl-C / SIGTERM, after `stop_after` steps, or after too many non-finite updates.

Steps are counted from 1: iteration `step` makes optimizer step number `step`, and a checkpoint named step-N
holds the state after N steps.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from ..checkpoint.data_record import DATA_FILE, record_text
from ..checkpoint.rank_state import save_rank_state
from ..checkpoint.run_dir import step_dir_name, tmp_dir_for
from ..checkpoint.store import TrainerState, capture_rng, save_checkpoint
from ..checkpoint.verify import MANIFEST
from ..collect.signal_check import SignalCheckError, rng_untouched
from ..config import to_yaml
from ..eval.in_loop import EvalResult, combine_eval, evaluate_policy
from ..plan.resolved import RESOLVED_FILE
from ..rollout.sampling import NonFiniteLogits
from ..world import fail_together
from .distributed import close_world, full_state, gathered
from .metrics import sample_records
from .setup import Run, StartOptions, checked_rollout, eval_params, run_with_rollout, setup_run, split_examples
from .step import StepRecord, group_sampler, grpo_step
from .update import NonFiniteError


@dataclass
class RunResult:
    last_step: int  # optimizer steps completed
    checkpoint: Path | None  # the checkpoint written last
    stopped_by: str  # "completed" | "signal" | "stop_after"
    before: EvalResult | None = None  # held_out: the starting model on the held-out examples (not on --resume)
    after: EvalResult | None = None  # held_out: the final model on them (at every clean end)


class GracefulStop:
    """SIGINT / SIGTERM set a flag; the loop finishes the current step, checkpoints and exits cleanly."""

    def __init__(self):
        self.requested: str | None = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def train(cfg, *, resume: str | None = None, stop_after: int | None = None, overwrite: bool = False,
          allow_data_change: bool = False, command: str | None = None, check: bool = False,
          held_out: bool = False, on_before: Callable[[EvalResult], None] | None = None) -> RunResult:
    """Run (or resume) training. resume: None, "latest" or a checkpoint dir; stop_after: steps this call;
    overwrite: start over in a run_dir that holds a run, renaming the old run (checkpoint/run_dir.py);
    allow_data_change: resume on task data other than the checkpoint's; command: the user's `grpo train ...`
    (without --resume), for the command an error about a damaged checkpoint names. check: the signal check before
    step 1 (with check.enabled; not on resume): SignalCheckError when it finds no signal and check.stop is set.
    held_out: the starting and the final model on the held-out examples (RunResult.before / .after), the final one at
    every clean end (completed, --stop-after, Ctrl-C / SIGTERM); on_before: called (rank 0) with the starting figure
    as soon as it is measured, before step 1, so that the run's record holds it whatever ends the run. Neither moves
    the run's random states or prompt stream: the steps are the same with or without them."""
    run = setup_run(cfg, resume, overwrite, StartOptions(allow_data_change, command or "grpo train CONFIG"))
    stopped_by, done, before, after = "completed", run.done_steps, None, None
    with GracefulStop() as stop:
        try:
            run, before = before_first_step(run, check, held_out)
            if before is not None and on_before is not None and run.inputs.world.is_main:
                on_before(before)
            for step in range(run.done_steps + 1, cfg.schedule.steps + 1):
                try:
                    record = grpo_step(run.inputs, run.state, step, run.monitor.message)
                except (NonFiniteError, NonFiniteLogits) as e:  # weights blew up: nothing more is saved
                    raise NonFiniteError(f"step {step}: {e}. Nothing was saved after it; the last good checkpoint "
                                         f"is {last_good(run)}") from None
                if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.schedule.steps):
                    record.metrics.eval = evaluate(run).as_metrics()
                log(run, record)
                if run.state.nonfinite_in_row >= cfg.optimizer.max_nonfinite_steps:
                    raise NonFiniteError(nonfinite_message(run))
                if run.inputs.world.any(stop.requested is not None):  # every rank stops after the same step
                    stopped_by = "signal"
                elif stop_after is not None and step - run.done_steps >= stop_after:
                    stopped_by = "stop_after"
                every = cfg.checkpoint.every
                if step == cfg.schedule.steps or stopped_by != "completed" or (every and step % every == 0):
                    checkpoint(run, step)
                done = step
                if stopped_by != "completed":
                    why = stop.requested or ("a signal to another rank" if stopped_by == "signal" else "stop_after")
                    run.monitor.message(f"stopped after step {step} ({why}); "
                                        f"checkpoint: {run.last_checkpoint}")
                    break
            if held_out:
                after = held_out_result(run, "the final model")
        finally:
            run.monitor.close()
            if run.lock is not None:
                run.lock.release()
            world, last = run.inputs.world, run.last_checkpoint
            del run  # the wrapped model and its collectives' state go before the process group does
            close_world(world)
    return RunResult(done, last, stopped_by, before, after)


def before_first_step(run: Run, check: bool, held_out: bool) -> tuple[Run, EvalResult | None]:
    """A fresh run's signal check (check and check.enabled; with check.fit_length or check.fit_group_size the run comes
    back with the settings it chose), then its starting model on the held-out examples (held_out). On resume: the
    run as it is and None (its starting model is the checkpoint's, its rollout settings those its run chose)."""
    if run.resumed_from is not None:
        return run, None
    if check and run.cfg.check.enabled:
        fit = checked_rollout(run.cfg, run.inputs, len(run.eval_examples), run.inputs.policy.model.device)
        stop = not fit.report.verdict.ok and run.cfg.check.stop
        if run.inputs.world.is_main:  # when it stops, its verdict is the error's line
            for line in fit.lines()[: -1 if stop else None]:
                run.monitor.message(line)
        if stop:
            raise SignalCheckError(f"{fit.report.verdict.line()}; stopped before step 1 (to go on anyway: --no-check "
                                   f"or check.stop=false)")
        run = run_with_rollout(run, fit)
    return run, held_out_result(run, "the starting model") if held_out else None


def held_out_result(run: Run, which: str) -> EvalResult:
    """The policy on the first eval.max_examples of task.eval_split (the in-loop evaluation's examples, whether or not
    eval.every is set) at eval.temperature (0: greedy) and rollout.max_new_tokens, as `grpo demo` does: the length
    the run trains its replies to fit (and fits the model's context, which eval.max_new_tokens need not)."""
    examples = split_examples(run.inputs.task, run.cfg, "eval_split")[: run.cfg.eval.max_examples]
    if run.inputs.world.is_main:
        run.monitor.message(f"held-out evaluation of {which}: {len(examples)} problems of task.eval_split="
                            f"{run.cfg.task.eval_split!r}")
    with rng_untouched():
        return evaluate(run, examples, run.cfg.rollout.max_new_tokens)


def evaluate(run: Run, examples: list | None = None, max_new_tokens: int | None = None) -> EvalResult:
    """The policy on the fixed eval subset (or `examples`, replies capped at `max_new_tokens` instead of
    eval.max_new_tokens), with the same (LoRA-merged when exact) weights as rollout; under torchrun each rank
    evaluates every size-th example and the results are combined."""
    cfg, inputs, world = run.cfg, run.inputs, run.inputs.world
    mine = (run.eval_examples if examples is None else examples)[world.rank :: world.size]
    params = eval_params(cfg, inputs.tokenizer)
    with inputs.policy.rollout_weights(), gathered(inputs.policy.model, world), fail_together(world, "eval"):
        result = evaluate_policy(inputs.policy.model, inputs.tokenizer, inputs.task, mine,
                                 replace(params, max_new_tokens=max_new_tokens or params.max_new_tokens), seed=cfg.seed,
                                 max_prompt_tokens=cfg.rollout.max_prompt_tokens,
                                 sample_groups=group_sampler(cfg)) if mine else None
    return combine_eval([r for r in world.gather(result) if r is not None])


def log(run: Run, record: StepRecord) -> None:
    run.monitor.log_step(record.metrics)
    run.reward_watch(record.metrics, record.collected)
    every = run.cfg.logging.samples_every
    if every and record.step % every == 0:
        run.monitor.log_samples(sample_records(record.step, record.collected, run.cfg.logging.samples_per_log))


def checkpoint(run: Run, step: int) -> Path:
    """Write checkpoints/step-N (atomically) with everything an exact resume needs. Under torchrun rank 0
    writes the model (gathered from the shards under fsdp2) and the shared state, every rank its own state
    into the same temp directory, and rank 0 publishes it."""
    cfg, inputs, world = run.cfg, run.inputs, run.inputs.world
    full = full_state(inputs.policy.model) if world.strategy == "fsdp2" else None  # a collective

    def add_rank_states(tmp: Path) -> None:
        world.barrier()  # rank 0's temp directory exists
        if world.size > 1:
            save_rank_state(tmp, world, inputs.policy)
        world.barrier()  # every rank's file is in it

    if not world.is_main:
        add_rank_states(tmp_dir_for(run.ckpt_root, step))
        world.barrier()  # published
        run.last_checkpoint = run.ckpt_root / step_dir_name(step)
        return run.last_checkpoint
    policy_state = inputs.policy.state_dict()
    files = {**inputs.policy.kernel_files(), **({DATA_FILE: record_text(run.data)} if run.data is not None else {}),
             RESOLVED_FILE: run.resolved.to_yaml()}
    extra = {"reference": policy_state["reference"]} if "reference" in policy_state else {}
    curriculum = inputs.curriculum.state_dict() if inputs.curriculum is not None else {}
    state = TrainerState(step, inputs.prompts.position, policy_state["optimizer"], policy_state["scheduler"],
                         capture_rng(), run.state.nonfinite_in_row, extra, curriculum, run.state.micro_tokens)
    run.last_checkpoint = save_checkpoint(
        run.ckpt_root, inputs.policy.model, state, config_yaml=to_yaml(cfg), metrics_path=run.monitor.metrics_path,
        tokenizer_dir=cfg.tokenizer.path or cfg.model.path, keep_last=cfg.checkpoint.keep_last,
        base_model_path=cfg.model.path, extra_files=files, full_state=full,
        before_publish=add_rank_states)
    world.barrier()
    return run.last_checkpoint


def nonfinite_message(run: Run) -> str:
    limit = run.cfg.optimizer.max_nonfinite_steps
    return (f"{run.state.nonfinite_in_row} consecutive updates had a NaN/inf loss or gradient "
            f"(optimizer.max_nonfinite_steps={limit}); stopping. Last good checkpoint: "
            f"{last_good(run)}. Try a lower optimizer.lr, optimizer.grad_clip, or "
            f"memory.precision=fp32.")


def last_good(run: Run) -> str:
    """The checkpoint a message may call the last good one: the newest this run wrote, else the one it resumed from
    (its files matched its manifest and its weights and optimizer state were finite when loaded; one written before
    manifests is said to be unverified)."""
    last = run.last_checkpoint
    if last is None:
        return "none"
    if last == run.resumed_from and not (last / MANIFEST).is_file():
        return f"{last} (resumed from, unverified: it has no {MANIFEST})"
    return str(last)


__all__ = ["RunResult", "train"]
