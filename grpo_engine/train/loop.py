"""train(cfg): the one training loop, read top to bottom (see ARCHITECTURE.md "One training step").

    set-up (everything checkable is checked before the model loads) ->
    for each step: 1-4 prompts, generate, score, advantages -> 5 old / reference log-probs when needed ->
    6 mu micro-batched passes -> 7 optimizer step, LR schedule -> 8 log, evaluate, checkpoint.

Exactness: the data order is a function of (seed, position), the sampling seed of (seed, step, round), and
every other random state is checkpointed, so a resumed CPU run repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import math
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import Config, ConfigError, check_paths, loss_config, to_yaml
from ..model.hf_io import load_model
from ..model.lora import apply_lora, load_adapter
from ..model.tokenizer import load_tokenizer
from ..monitor import Monitor, StepMetrics
from ..tasks import make_task
from .algorithm import eval_params, make_reference_policy, rollout_batch, rollout_weights, sampling_params, step_metrics
from .checkpoint import TrainerState, capture_rng, load_trainer_state, resolve_resume, restore_rng, save_checkpoint
from .evaluation import EvalResult, evaluate_policy
from .memory import apply_memory_config, free_rollout_memory, peak_memory_mib, reset_peak_memory, torch_dtype
from .optim import build_optimizer
from .plan_config import check_memory_fits
from .rollouts import PromptSampler, collect_groups
from .schedule import make_scheduler
from .update import (
    OOM_KNOBS,
    NonFiniteError,
    UpdateStats,
    accumulate_gradients,
    batch_logprobs,
    clip_and_check,
    is_finite,
)
from .warm_start import warm_start


@dataclass
class RunResult:
    last_step: int  # optimizer steps completed
    checkpoint: Path | None  # the checkpoint written last
    stopped_by: str  # "completed" | "signal" | "stop_after"


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


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device=cuda but no CUDA device is visible; use model.device=cpu or auto")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: Config, *, resume: str | None = None, stop_after: int | None = None) -> RunResult:
    """Run (or resume) training. resume: None, "latest" or a checkpoint dir; stop_after: steps this call.

    Steps are counted from 1: iteration `step` makes optimizer step number `step`, and a checkpoint named
    step-N holds the state after N steps.
    """
    # ---- set-up: config, paths, task, data and loggers are all checked before any weights are read
    check_paths(cfg)
    check_memory_fits(cfg)  # memory.gpu_memory_gib > 0: the planner's verdict, before any weights are read
    task = build_task(cfg)
    if cfg.warm_start.tiny.arch or cfg.warm_start.sft.steps > 0:
        cfg.model.path = str(warm_start(cfg, task))  # tiny base / SFT phase, written once under run_dir
    train_examples = list(task.examples(cfg.task.train_split))
    eval_examples = list(task.examples(cfg.task.eval_split))[: cfg.eval.max_examples] if cfg.eval.every else []
    ckpt_root = Path(cfg.run_dir) / "checkpoints"
    resume_dir = resolve_resume(resume, ckpt_root)
    state = load_trainer_state(resume_dir) if resume_dir else None
    done_steps = state.step if state else 0
    monitor = Monitor(cfg.run_dir, total_steps=cfg.schedule.steps, start_step=done_steps,
                      progress=cfg.logging.progress, tensorboard=cfg.logging.tensorboard,
                      wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project, config=cfg_dict(cfg))
    device = pick_device(cfg.model.device)
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path)
    model, reference = load_policy(cfg, device, resume_dir, state)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer, device)
    scheduler = make_scheduler(optimizer, total=cfg.schedule.steps, warmup=cfg.schedule.warmup_steps,
                               kind=cfg.schedule.lr_schedule, min_ratio=cfg.schedule.min_lr_ratio)
    sampler = PromptSampler(len(train_examples), cfg.seed, state.data_position if state else 0)
    if state is not None:
        optimizer.load_state_dict(state.optimizer)
        scheduler.load_state_dict(state.scheduler)
        restore_rng(state.rng)
    params = sampling_params(cfg, tokenizer)
    run = RunState(nonfinite_in_row=state.nonfinite_in_row if state else 0,
                   micro_tokens=cfg.memory.micro_batch_tokens, last_checkpoint=resume_dir)

    def checkpoint(step: int) -> Path:
        extra = {"reference": reference.state_dict()} if reference is not None and \
            cfg.reference.mode != "frozen" else {}
        st = TrainerState(step, sampler.position, optimizer.state_dict(), scheduler.state_dict(), capture_rng(),
                          run.nonfinite_in_row, extra)
        run.last_checkpoint = save_checkpoint(
            ckpt_root, model, st, config_yaml=to_yaml(cfg), metrics_path=monitor.metrics_path,
            tokenizer_dir=cfg.tokenizer.path or cfg.model.path, keep_last=cfg.checkpoint.keep_last,
            base_model_path=cfg.model.path)
        return run.last_checkpoint

    stopped_by, resumed_at = "completed", done_steps
    with GracefulStop() as stop:
        for step in range(done_steps + 1, cfg.schedule.steps + 1):
            t_step = time.perf_counter()
            reset_peak_memory(device)

            # 1-3. prompts -> G completions each (policy weights, LoRA merged when exact) -> rewards
            with rollout_weights(cfg, model):
                rollout = collect_groups(
                    model, tokenizer, task, train_examples, sampler, params, prompts=cfg.rollout.prompts_per_step,
                    seed=cfg.seed, step=step, max_prompt_tokens=cfg.rollout.max_prompt_tokens,
                    group_filter=cfg.algorithm.group_filter)
            if cfg.memory.empty_cache_between_phases:
                free_rollout_memory()

            # 4. advantages (+ semantic entropy, overlong handling) -> one right-padded batch
            batch, adv_info = rollout_batch(rollout.groups, cfg, task, tokenizer.pad_token_id)

            # 5. old / reference log-probs, only when the loss needs them
            t0 = time.perf_counter()
            model.train()
            if batch is not None:
                attach_logprobs(batch, model, reference, cfg, run.micro_tokens, params.temperature)
            time_logprobs = time.perf_counter() - t0

            # 6-7. mu passes of micro-batched updates, each ending in one optimizer step; LR schedule
            t0 = time.perf_counter()
            outcome = update_policy(model, optimizer, batch, cfg, run, params.temperature, monitor, step)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            if reference is not None and not outcome.skipped:
                reference.on_step(step, model)
            time_update = time.perf_counter() - t0

            # 8. log, evaluate, checkpoint; stop on too many non-finite updates, a signal, or stop_after
            metrics = step_metrics(step, rollout, batch, outcome.stats, adv_info)
            metrics.grad_norm, metrics.lr, metrics.skipped_update = outcome.grad_norm, lr, outcome.skipped
            metrics.micro_batch_tokens = run.micro_tokens
            metrics.time_logprobs_s, metrics.time_update_s = time_logprobs, time_update
            metrics.train_tokens_per_s = metrics.train_tokens * cfg.algorithm.mu / max(time_update, 1e-9)
            if cfg.eval.every and (step % cfg.eval.every == 0 or step == cfg.schedule.steps):
                metrics.eval = run_eval(cfg, model, tokenizer, task, eval_examples).as_metrics()
            metrics.time_step_s = time.perf_counter() - t_step
            metrics.peak_mem_mib = peak_memory_mib(device)
            monitor.log_step(metrics)
            if cfg.logging.samples_every and step % cfg.logging.samples_every == 0:
                monitor.log_samples(sample_records(step, rollout, cfg.logging.samples_per_log))
            if run.nonfinite_in_row >= cfg.optimizer.max_nonfinite_steps:
                monitor.close()
                raise NonFiniteError(nonfinite_message(run, cfg))
            if stop.requested:
                stopped_by = "signal"
            elif stop_after is not None and step - resumed_at >= stop_after:
                stopped_by = "stop_after"
            every = cfg.checkpoint.every
            if step == cfg.schedule.steps or stopped_by != "completed" or (every and step % every == 0):
                checkpoint(step)
            done_steps = step
            if stopped_by != "completed":
                monitor.message(f"stopped after step {step} ({stop.requested or 'stop_after'}); "
                                f"checkpoint: {run.last_checkpoint}")
                break
    monitor.close()
    return RunResult(done_steps, run.last_checkpoint, stopped_by)


@dataclass
class RunState:
    """What changes across steps besides the model / optimizer / sampler."""

    nonfinite_in_row: int  # consecutive updates skipped for a NaN/inf loss or gradient
    micro_tokens: int  # current micro-batch token budget (halved on CUDA OOM when allowed)
    last_checkpoint: Path | None


def load_policy(cfg: Config, device: torch.device, resume_dir: Path | None, state: TrainerState | None):
    """The policy (weights, LoRA adapters, memory knobs) and its reference policy (None when beta == 0).

    Resuming: full fine-tuning reloads the checkpoint's weights; LoRA reloads the base from model.path and
    the adapters from the checkpoint. A frozen reference is always the weights at model.path; a reference
    that moves (hard_reset / mixin) is restored from the checkpoint.
    """
    dtype = torch_dtype(cfg.memory.precision, device)
    full_resume = resume_dir is not None and not cfg.lora.enabled
    model = load_model(resume_dir / "model" if full_resume else cfg.model.path, dtype, device)
    if cfg.lora.enabled:
        apply_lora(model, cfg.lora)
        if resume_dir is not None:
            load_adapter(model, resume_dir / "adapter")
    apply_memory_config(model, cfg.memory)
    initial = load_model(cfg.model.path, dtype, device) if full_resume and cfg.algorithm.beta > 0 else None
    reference = make_reference_policy(cfg, model, initial)
    if reference is not None and state is not None and "reference" in state.extra:
        reference.load_state_dict(state.extra["reference"])
    return model, reference


def attach_logprobs(batch, model, reference, cfg: Config, micro_tokens: int, temperature: float) -> None:
    """Old-policy log-probs (mu > 1: the ratio of later passes) and reference log-probs (beta > 0)."""
    chunk = cfg.memory.logprob_chunk_size
    if cfg.algorithm.mu > 1:
        batch.old_logp = batch_logprobs(model, batch, micro_tokens, temperature=temperature, chunk_size=chunk)
    if reference is not None:
        batch.ref_logp = reference.logprobs(model, batch, micro_tokens, temperature=temperature, chunk_size=chunk)


@dataclass
class UpdateOutcome:
    stats: UpdateStats | None  # the last pass's loss and metrics (None when there was nothing to train on)
    grad_norm: float
    skipped: bool  # no optimizer step was taken (empty batch, or a NaN/inf loss or gradient)


def update_policy(model, optimizer, batch, cfg: Config, run: RunState, temperature: float, monitor: Monitor,
                  step: int) -> UpdateOutcome:
    """mu passes over the batch, each: zero grads, accumulate micro-batches, clip, check finite, step.

    A NaN/inf loss or gradient skips the update (no optimizer step: the weights stay as they were) and is
    counted in run.nonfinite_in_row; the loop stops the run when that reaches optimizer.max_nonfinite_steps.
    """
    if batch is None:
        return UpdateOutcome(None, math.nan, True)
    loss_cfg = loss_config(cfg)
    stats, grad_norm = None, math.nan
    for _ in range(cfg.algorithm.mu):
        optimizer.zero_grad(set_to_none=True)
        stats = run_pass(model, batch, loss_cfg, cfg, run, temperature, monitor)
        grad_norm = clip_and_check(model, cfg.optimizer.grad_clip)
        if not is_finite(stats.loss, grad_norm):
            optimizer.zero_grad(set_to_none=True)
            run.nonfinite_in_row += 1
            monitor.message(f"step {step}: non-finite loss ({stats.loss}) or grad norm ({grad_norm}); "
                            f"update skipped ({run.nonfinite_in_row} in a row)")
            return UpdateOutcome(stats, grad_norm, True)
        optimizer.step()
    run.nonfinite_in_row = 0
    return UpdateOutcome(stats, grad_norm, False)


def nonfinite_message(run: RunState, cfg: Config) -> str:
    return (f"{run.nonfinite_in_row} consecutive updates had a NaN/inf loss or gradient "
            f"(optimizer.max_nonfinite_steps={cfg.optimizer.max_nonfinite_steps}); stopping. "
            f"Last good checkpoint: {run.last_checkpoint or 'none'}. Try a lower optimizer.lr, "
            f"optimizer.grad_clip, or memory.precision=fp32.")


def run_pass(model, batch, loss_cfg, cfg: Config, run: RunState, temperature: float, monitor: Monitor):
    """One forward/backward pass over the batch; on CUDA OOM optionally halve the micro-batch and retry."""
    while True:
        try:
            return accumulate_gradients(model, batch, loss_cfg, run.micro_tokens, temperature=temperature,
                                        chunk_size=cfg.memory.logprob_chunk_size)
        except torch.OutOfMemoryError as e:
            model.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            longest = int(batch.lengths.max())
            if not cfg.memory.auto_halve_micro_batch or run.micro_tokens // 2 < longest:
                raise torch.OutOfMemoryError(
                    f"out of memory in the update with memory.micro_batch_tokens={run.micro_tokens} "
                    f"(longest row {longest} tokens). Lower one of: {OOM_KNOBS}. ({e})") from e
            run.micro_tokens //= 2
            monitor.message(f"out of memory: halving memory.micro_batch_tokens to {run.micro_tokens} and retrying")


def run_eval(cfg: Config, model, tokenizer, task, examples) -> EvalResult:
    """The policy on the fixed eval subset, with the same (LoRA-merged when exact) weights as rollout."""
    with rollout_weights(cfg, model):
        return evaluate_policy(model, tokenizer, task, examples, eval_params(cfg, tokenizer), seed=cfg.seed,
                               max_prompt_tokens=cfg.rollout.max_prompt_tokens)


def build_task(cfg: Config):
    """The task; a bad task name or option is a config error (reported before the model loads)."""
    try:
        return make_task(cfg.task.name, **task_options(cfg))
    except ValueError as e:
        raise ConfigError(f"task: {e}") from None


def task_options(cfg: Config) -> dict:
    options = dict(cfg.task.options)
    if cfg.task.data_path is not None:
        options["data_path"] = cfg.task.data_path
    return options


def cfg_dict(cfg: Config) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg))


def sample_records(step: int, rollout, n: int):
    from ..monitor import Sample

    records = []
    for g in rollout.generated[:n]:
        i = 0
        r = g.rewards[i]
        records.append(Sample(step, g.prompt_text, g.texts[i], r.total, dict(r.components), r.answer,
                              g.finish_reasons[i]))
    return records


__all__ = ["RunResult", "StepMetrics", "train"]
