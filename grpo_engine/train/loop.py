"""train(cfg): the one training loop, read top to bottom (see ARCHITECTURE.md "One training step").

    set-up (everything checkable is checked before the model loads) ->
    for each step: 1-4 prompts, generate, score, advantages -> 5 old / reference log-probs when needed ->
    6 mu micro-batched passes -> 7 optimizer step, LR schedule -> 8 log, evaluate, checkpoint.

Exactness: the data order is a function of (seed, position), the sampling seed of (seed, step, round), and
every other random state is checkpointed, so a resumed CPU run repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..config import Config, check_paths, to_yaml
from ..model.hf_io import load_model
from ..model.tokenizer import load_tokenizer
from ..monitor import Monitor, StepMetrics, peak_memory_mib
from ..tasks import make_task
from .algorithm import make_loss_fn, make_reference_policy, rollout_batch, sampling_params, step_metrics
from .checkpoint import TrainerState, capture_rng, load_trainer_state, resolve_resume, restore_rng, save_checkpoint
from .optimizers import make_optimizer
from .rollouts import PromptSampler, collect_groups
from .schedule import make_scheduler
from .update import OOM_KNOBS, NonFiniteError, accumulate_gradients, batch_logprobs, clip_and_check, is_finite

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """Run (or resume) training. resume: None, "latest" or a checkpoint dir; stop_after: steps this call."""
    # ---- set-up: config, paths, task, data and loggers are all checked before any weights are read
    check_paths(cfg)
    task = make_task(cfg.task.name, **task_options(cfg))
    train_examples = list(task.examples(cfg.task.train_split))
    ckpt_root = Path(cfg.run_dir) / "checkpoints"
    resume_dir = resolve_resume(resume, ckpt_root)
    state = load_trainer_state(resume_dir) if resume_dir else None
    start = state.step if state else 0
    monitor = Monitor(cfg.run_dir, total_steps=cfg.schedule.steps, start_step=start,
                      progress=cfg.logging.progress, tensorboard=cfg.logging.tensorboard,
                      wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project, config=cfg_dict(cfg))
    device = pick_device(cfg.model.device)
    seed_everything(cfg.seed)
    model = load_model(resume_dir / "model" if resume_dir else cfg.model.path, DTYPES[cfg.model.dtype], device)
    tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path)
    model.checkpoint_every = cfg.memory.activation_checkpointing
    reference = make_reference_policy(cfg, model)  # None when beta == 0
    optimizer = make_optimizer(model, cfg.optimizer)
    scheduler = make_scheduler(optimizer, total=cfg.schedule.steps, warmup=cfg.schedule.warmup_steps,
                               kind=cfg.schedule.lr_schedule, min_ratio=cfg.schedule.min_lr_ratio)
    sampler = PromptSampler(len(train_examples), cfg.seed, state.data_position if state else 0)
    if state is not None:
        optimizer.load_state_dict(state.optimizer)
        scheduler.load_state_dict(state.scheduler)
        restore_rng(state.rng)
    params = sampling_params(cfg, tokenizer)
    loss_fn = make_loss_fn(cfg)
    nonfinite_in_row = state.nonfinite_in_row if state else 0
    micro_tokens = cfg.memory.micro_batch_tokens
    last_ckpt, stopped_by, step = resume_dir, "completed", start

    def checkpoint(step: int) -> Path:
        st = TrainerState(step, sampler.position, optimizer.state_dict(), scheduler.state_dict(), capture_rng(),
                          nonfinite_in_row)
        return save_checkpoint(ckpt_root, model, st, config_yaml=to_yaml(cfg), metrics_path=monitor.metrics_path,
                               tokenizer_dir=cfg.tokenizer.path or cfg.model.path, keep_last=cfg.checkpoint.keep_last)

    with GracefulStop() as stop:
        for step in range(start, cfg.schedule.steps):
            t_step = time.perf_counter()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()

            # 1-3. prompts -> G completions each (policy weights, eval mode) -> rewards
            rollout = collect_groups(
                model, tokenizer, task, train_examples, sampler, params, prompts=cfg.rollout.prompts_per_step,
                seed=cfg.seed, step=step, max_prompt_tokens=cfg.rollout.max_prompt_tokens,
                filter_zero_variance=cfg.algorithm.dynamic_sampling.enabled,
                max_refills=cfg.algorithm.dynamic_sampling.max_refills)

            # 4. advantages (+ semantic entropy, overlong handling) -> one right-padded batch
            batch, adv_info = rollout_batch(rollout.groups, cfg, task, tokenizer.pad_token_id)

            # 5. old / reference log-probs, only when the loss needs them
            t0 = time.perf_counter()
            model.train()
            if batch is not None and cfg.algorithm.mu > 1:
                batch.old_logp = batch_logprobs(model, batch, micro_tokens, temperature=params.temperature,
                                                chunk_size=cfg.memory.logprob_chunk_size)
            if batch is not None and reference is not None:
                batch.ref_logp = reference.logprobs(batch, micro_tokens)
            time_logprobs = time.perf_counter() - t0

            # 6-7. mu passes of micro-batched updates, each ending in one optimizer step
            t0 = time.perf_counter()
            update, grad_norm, skipped = None, float("nan"), batch is None
            for _ in range(cfg.algorithm.mu if batch is not None else 0):
                optimizer.zero_grad(set_to_none=True)
                update, micro_tokens = run_pass(model, batch, loss_fn, micro_tokens, cfg, params.temperature,
                                                monitor)
                grad_norm = clip_and_check(model, cfg.optimizer.grad_clip)
                if not is_finite(update.loss, grad_norm):
                    skipped, nonfinite_in_row = True, nonfinite_in_row + 1
                    optimizer.zero_grad(set_to_none=True)
                    monitor.message(f"step {step + 1}: non-finite loss ({update.loss}) or grad norm "
                                    f"({grad_norm}); update skipped ({nonfinite_in_row} in a row)")
                    if nonfinite_in_row >= cfg.optimizer.max_nonfinite_steps:
                        monitor.close()
                        raise NonFiniteError(
                            f"{nonfinite_in_row} consecutive updates had a NaN/inf loss or gradient "
                            f"(optimizer.max_nonfinite_steps={cfg.optimizer.max_nonfinite_steps}); stopping. "
                            f"Last good checkpoint: {last_ckpt or 'none'}. Try a lower optimizer.lr, "
                            f"optimizer.grad_clip, or model.dtype=float32.")
                    break
                nonfinite_in_row = 0
                optimizer.step()
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            time_update = time.perf_counter() - t0

            # 8. log, evaluate, checkpoint
            metrics = step_metrics(step + 1, rollout, batch, update, adv_info)
            metrics.grad_norm, metrics.lr, metrics.skipped_update = grad_norm, lr, skipped
            metrics.micro_batch_tokens = micro_tokens
            metrics.time_logprobs_s, metrics.time_update_s = time_logprobs, time_update
            metrics.time_step_s = time.perf_counter() - t_step
            metrics.train_tokens_per_s = metrics.train_tokens * cfg.algorithm.mu / max(time_update, 1e-9)
            metrics.peak_mem_mib = peak_memory_mib(device)
            monitor.log_step(metrics)
            if cfg.logging.samples_every and (step + 1) % cfg.logging.samples_every == 0:
                monitor.log_samples(sample_records(step + 1, rollout, cfg.logging.samples_per_log))
            done = step + 1 == cfg.schedule.steps
            if stop.requested:
                stopped_by = "signal"
            elif stop_after is not None and step + 1 - start >= stop_after:
                stopped_by = "stop_after"
            if done or stopped_by != "completed" or (cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0):
                last_ckpt = checkpoint(step + 1)
            if stopped_by != "completed":
                monitor.message(f"stopped after step {step + 1} ({stop.requested or 'stop_after'}); "
                                f"checkpoint: {last_ckpt}")
                step += 1
                break
            step += 1
    monitor.close()
    return RunResult(step, last_ckpt, stopped_by)


def run_pass(model, batch, loss_fn, micro_tokens: int, cfg: Config, temperature: float, monitor: Monitor):
    """One forward/backward pass over the batch; on CUDA OOM optionally halve the micro-batch and retry."""
    while True:
        try:
            stats = accumulate_gradients(model, batch, loss_fn, micro_tokens, temperature=temperature,
                                         chunk_size=cfg.memory.logprob_chunk_size)
            return stats, micro_tokens
        except torch.OutOfMemoryError as e:
            model.zero_grad(set_to_none=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            longest = int(batch.lengths.max())
            if not cfg.memory.auto_halve_micro_batch or micro_tokens // 2 < longest:
                raise torch.OutOfMemoryError(
                    f"out of memory in the update with memory.micro_batch_tokens={micro_tokens} "
                    f"(longest row {longest} tokens). Lower one of: {OOM_KNOBS}. ({e})") from e
            micro_tokens //= 2
            monitor.message(f"out of memory: halving memory.micro_batch_tokens to {micro_tokens} and retrying")


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
