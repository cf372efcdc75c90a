"""Set-up of a training run, before step 1: everything checkable is checked before any weights are read.

Order: paths and the memory plan (arithmetic on the config), the task and its data, the warm start, the
checkpoint to resume from, the loggers; only then the tokenizer and the policy's weights. On resume the
optimizer, LR schedule, moving reference, prompt-stream position, curriculum queue and RNG states come back from the
checkpoint.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from ..checkpoint.data_record import check_data, data_record
from ..checkpoint.rank_state import load_rank_state
from ..checkpoint.resume import (
    apply_learning_rate,
    check_resume_config,
    check_where_it_sits,
    kept_precision,
    kept_rollout,
    warm_started,
)
from ..checkpoint.run_dir import RunDirPlan, RunLock, checkpoint_step, plan_run_dir, step_dirs
from ..checkpoint.run_files import BEFORE_AFTER, write_run_file
from ..checkpoint.store import TrainerState, load_trainer_state, nonfinite_state, resolve_resume, restore_rng
from ..checkpoint.verify import resume_refused
from ..collect.curriculum import build_curriculum
from ..collect.groups import ShuffledPrompts, check_prompt_lengths
from ..collect.signal_check import (
    CheckSettings,
    LengthFit,
    RolloutFit,
    SignalReport,
    check_signal,
    fit_group_size,
    fit_length,
    grow_groups,
)
from ..config import Config, ConfigError, check_paths
from ..config.trust import unmarked
from ..kernels import PLAN_FILE
from ..model.loading import load_tokenizer, pick_device
from ..monitor import Monitor, RankMessages
from ..plan.from_config import check_memory_fits
from ..plan.resolved import Resolved, resolve_settings
from ..plan.sizes import check_sizes
from ..rollout import SamplingParams
from ..sft.warm_start import warm_start
from ..tasks import build_task
from ..tasks.base import Example, Task
from ..world import World, on_main_first
from .distributed import gathered, init_world
from .metrics import RewardWatch
from .policy import build_policy
from .step import StepInputs, StepState, group_sampler
from .update import weights_finite


@dataclass
class Run:
    """A training run ready for its next step. Its config is one object: resolved.config, the step's inputs.cfg."""

    resolved: Resolved  # what this machine decided, the config the run trains with; stored as resolved.yaml
    inputs: StepInputs
    state: StepState
    monitor: Monitor
    eval_examples: list[Example]  # the fixed subset of eval.max_examples (empty when eval.every = 0)
    ckpt_root: Path
    done_steps: int  # optimizer steps already taken (the resumed checkpoint's step)
    last_checkpoint: Path | None
    reward_watch: RewardWatch  # warnings on failed rewards and a run without learning signal
    lock: RunLock | None = None  # rank 0's hold on run_dir
    data: dict | None = None  # the data files the run reads, fingerprinted (rank 0; checkpoint/data_record.py)
    resumed_from: Path | None = None  # the checkpoint this run resumed from

    def __post_init__(self):
        assert self.inputs.cfg is self.resolved.config, "the step reads the config the run resolved"

    @property
    def cfg(self) -> Config:
        return self.resolved.config


@dataclass
class StartOptions:
    """How `grpo train` was asked to start: what the user allows, and the command an error tells them to run."""

    allow_data_change: bool = False  # --allow-data-change: resume on task data that differs from the checkpoint's
    command: str = "grpo train CONFIG"  # the user's command without --resume (errors name `command --resume CKPT`)


@dataclass
class _Checked:
    """What setup_run knows before it takes the run lock and reads any weights."""

    world: World
    task: Task
    train_examples: list[Example]
    eval_examples: list[Example]
    ckpt_root: Path
    resume_dir: Path | None
    saved: TrainerState | None  # the resumed checkpoint's state
    changes: list  # config keys changed on resume (check_resume_config)
    run_dir: RunDirPlan
    data: dict | None  # data_record of this run (rank 0)
    options: StartOptions


def setup_run(cfg: Config, resume: str | None = None, overwrite: bool = False,
              options: StartOptions | None = None) -> Run:
    """resume: None, "latest" or a checkpoint directory; overwrite: start over in a run_dir that holds a run
    (the old run is renamed, checkpoint/run_dir.py). Under torchrun every rank runs this; rank 0 alone builds the
    warm start, owns the run directory, checks the checkpoint's files, config and data, and writes logs."""
    options = options or StartOptions()
    world = init_world(cfg)  # impossible layouts are config errors here, before anything is read
    check_paths(cfg)
    task = task_of(cfg)
    train_examples = split_examples(task, cfg, "train_split")
    if not train_examples:
        raise ConfigError(f"task.train_split={cfg.task.train_split!r} of task {cfg.task.name!r} has no examples: "
                          f"check task.data_path / the task's options")
    eval_examples = split_examples(task, cfg, "eval_split")[: cfg.eval.max_examples] if cfg.eval.every else []
    device = pick_device(cfg.model.device, world.local_rank)
    ckpt_root = Path(cfg.run_dir) / "checkpoints"
    resume_dir = resolve_resume(resume, ckpt_root, to_stderr, command=options.command, verify=world.is_main)
    kept = kept_precision(resume_dir, device.type) if resume_dir else None
    if resume_dir and (fitted := kept_rollout(resume_dir, cfg)).changed:
        cfg = fitted.cfg
        if world.is_main:
            to_stderr(f"resume: {fitted.describe()}, as the signal check chose for the run resumed")
    resolved = checked_settings(cfg, device, len(eval_examples), kept)  # before the run lock and any weights
    saved = load_trainer_state(resume_dir) if resume_dir else None
    if saved is not None and world.is_main and nonfinite_state(saved):
        raise resume_refused(resume_dir, f"its {nonfinite_state(saved)} holds NaN/inf", options.command)
    changes = check_resume_config(resume_dir, cfg, to_stderr) if resume_dir and world.is_main else []
    if saved is not None and world.is_main:
        check_where_it_sits(resume_dir, saved.step, cfg, to_stderr)
    data = data_record(cfg, len(train_examples)) if world.is_main else None
    if saved is not None and world.is_main:  # the data the checkpoint was trained on, or --allow-data-change
        check_data(resume_dir, data, position=saved.data_position, allow=options.allow_data_change, message=to_stderr)
    run_dir = RunDirPlan(Path(cfg.run_dir))
    if world.is_main:  # the newest step-* folder, complete or not: a later one is moved aside, never replaced
        run_dir = plan_run_dir(cfg.run_dir, resume_step=saved.step if saved else None,
                               newest_step=checkpoint_step(next(reversed(step_dirs(ckpt_root)), None)),
                               overwrite=overwrite, writes=(PLAN_FILE, *([BEFORE_AFTER] if cfg.eval.before_after
                                                                         else [])))
    checked = _Checked(world, task, train_examples, eval_examples, ckpt_root, resume_dir, saved, changes, run_dir,
                       data, options)
    lock = RunLock(cfg.run_dir).acquire() if world.is_main else None
    try:
        return _load_run(cfg, resolved, checked, lock)
    except BaseException:  # a failed load (weights, tokenizer, optimizer, Ctrl-C) leaves no stale lock behind
        if lock is not None:
            lock.release()
        raise


def checked_settings(cfg: Config, device: torch.device, eval_rows: int, kept: str | None = None) -> Resolved:
    """What this machine decides for `cfg` (resolve_settings), then the size checks on it: `grpo train` and
    `grpo check` refuse the same configs, before any weights are read."""
    resolved = resolve_settings(cfg, device, kept)
    # the memory settings resolved, on the config's own model.path (a warm start's output is not written yet)
    check_sizes(replace(cfg, memory=resolved.config.memory), eval_rows, device)
    check_memory_fits(cfg)  # the card the config names: planned as the config asks, not as this machine resolved it
    return resolved


def _load_run(asked: Config, resolved: Resolved, c: _Checked, lock: RunLock | None) -> Run:
    """setup_run's second half, under the run lock: the warm start of the config as `asked` (from its model.path)
    into resolved.config.model.path, then model, tokenizer, optimizer and resumed state."""
    world, saved, cfg = c.world, c.saved, resolved.config
    if warm_started(asked):  # base/, sft/ under run_dir: it is ours now
        take_run_dir(c.run_dir, lock)
        on_main_first(world, lambda: warm_start(asked, c.task))
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path)
    policy = build_policy(resolved, c.resume_dir, world)
    if saved is not None and not weights_finite(policy.model, world):  # a damaged checkpoint: never "the last good"
        raise resume_refused(c.resume_dir, "its weights hold NaN/inf", c.options.command)
    held_out = split_examples(c.task, cfg, "eval_split")[: cfg.eval.max_examples] if cfg.eval.before_after else []
    check_prompts(cfg, c.task, tokenizer, c.train_examples, [*c.eval_examples, *held_out])  # before step 1
    take_run_dir(c.run_dir, lock)  # the model and data loaded: now the run directory may change
    done = saved.step if saved else 0
    monitor = make_monitor(cfg, world, done)
    if world.is_main:
        write_run_file(cfg.run_dir, PLAN_FILE, policy.kernel_plan.to_json(), overwrite=c.run_dir.replace_files)
        if asked.memory.precision == "auto":  # the engine's choice, said once (stored in resolved.yaml)
            monitor.message(f"memory.precision {resolved.precision} ({resolved.precision_why})")
    prompts = ShuffledPrompts(len(c.train_examples), cfg.seed, saved.data_position if saved else 0)
    state = StepState(saved.nonfinite_in_row if saved else 0, resumed_micro_tokens(saved, cfg))
    if saved is not None:
        policy.load_state_dict({"optimizer": saved.optimizer, "scheduler": saved.scheduler, **saved.extra})
        apply_learning_rate(policy, cfg, c.changes if world.size == 1 else world.gather(c.changes)[0])
        restore_rng(saved.rng)
        load_rank_state(c.resume_dir, world, policy)
    params = sampling_params(cfg, tokenizer)
    curriculum = build_curriculum(cfg, prompts, tokenizer, c.task, c.train_examples, params, world,
                                  saved.curriculum if saved else None)
    inputs = StepInputs(cfg, policy, tokenizer, c.task, c.train_examples, prompts, params, world, curriculum)
    return Run(resolved, inputs, state, monitor, c.eval_examples, c.ckpt_root, done, c.resume_dir,
               RewardWatch(monitor.message, cfg.logging.no_signal_warn_steps), lock, c.data, c.resume_dir)


def check_prompts(cfg: Config, task: Task, tokenizer, train: list[Example], held_out: list[Example]) -> None:
    """Every prompt of the training split and of the held-out examples within rollout.max_prompt_tokens, before step
    1 and before the run directory changes (collect/groups.py check_prompt_lengths); tools add their declarations
    to each prompt, which the rollout checks itself."""
    if not cfg.tools.enabled:
        check_prompt_lengths(task, tokenizer, [*train, *held_out], cfg.rollout.max_prompt_tokens)


def take_run_dir(plan: RunDirPlan, lock: RunLock | None) -> None:
    """Apply the run-dir plan once (rank 0): move an old run aside, or supersede later checkpoints."""
    if lock is not None and not plan.applied:
        plan.apply(lock=lock)


def to_stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def split_examples(task, cfg: Config, split_field: str) -> list:
    """The examples of the split that cfg.task.<split_field> names; a split the task lacks is a config error that
    names the key (the task's own message says only "split must be 'train' or 'test'")."""
    try:
        return list(task.examples(getattr(cfg.task, split_field)))
    except ValueError as e:
        raise ConfigError(f"task.{split_field}={getattr(cfg.task, split_field)!r}: {e}") from None


def make_monitor(cfg: Config, world: World, done: int):
    """Rank 0 writes metrics, samples and the console; the other ranks only print their messages."""
    if not world.is_main:
        return RankMessages(world.rank)
    settings = OmegaConf.to_container(OmegaConf.structured(unmarked(cfg)))  # a stored config's marks: plain text
    return Monitor(cfg.run_dir, total_steps=cfg.schedule.steps, start_step=done, progress=cfg.logging.progress,
                   tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                   wandb_project=cfg.logging.wandb_project, config=settings)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def task_of(cfg: Config):
    """The config's task; a bad task name or option is a config error (reported before the model loads)."""
    try:
        return build_task(cfg.task.name, dict(cfg.task.options), cfg.task.data_path)
    except ValueError as e:
        hint = " (options from a config file stay when task.name changes: add task.options=null to drop them)" \
            if str(e).startswith("unknown option") and cfg.task.options else ""
        raise ConfigError(f"task: {e}{hint}") from None


def sampling_params(cfg: Config, tokenizer) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        n=r.group_size, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p,
        max_new_tokens=r.max_new_tokens, stop_token_ids=list(tokenizer.eos_token_ids),
        stop_strings=list(r.stop_strings), max_tokens_in_flight=r.max_tokens_in_flight or None,
        cuda_graphs=r.cuda_graphs,
    )


def eval_params(cfg: Config, tokenizer) -> SamplingParams:
    """Rollout sampling with the eval section's temperature (0 = greedy) and length cap, one per prompt."""
    return replace(sampling_params(cfg, tokenizer), n=1, temperature=cfg.eval.temperature,
                   max_new_tokens=cfg.eval.max_new_tokens)


def resumed_micro_tokens(saved: TrainerState | None, cfg: Config) -> int:
    """The micro-batch token budget to start from: the config's, or the halved one a resumed run had reached after a
    CUDA out-of-memory (it would otherwise run out of memory, and halve, again), whichever is smaller."""
    budget = cfg.memory.micro_batch_tokens
    return min(budget, saved.micro_tokens) if saved is not None and saved.micro_tokens > 0 else budget


def signal_of(cfg: Config, inputs: StepInputs, grow: SignalReport | None = None) -> SignalReport:
    """The signal check (collect/signal_check.py) on the policy as it is now, with cfg's rollout settings (its
    length cap and group size, which a fit may have changed from the run's) and the run's tools; `check.groups`
    prompts of the training split, `rollout.prompts_per_step` at a time. grow: a check at a smaller group size whose
    groups to grow to cfg's instead of sampling anew (grow_groups). Every rank samples the same prompts (under fsdp2
    the weights are gathered for it); no random state of the run moves."""
    r = cfg.rollout
    settings = CheckSettings(cfg.check.groups, r.prompts_per_step, cfg.check.min_spread,
                             cfg.algorithm.advantage.zero_variance_tol)
    policy, params = inputs.policy, replace(inputs.params, n=r.group_size, max_new_tokens=r.max_new_tokens)
    sampled = inputs.examples if grow is None else grow  # the training split, or the groups to grow
    check = check_signal if grow is None else grow_groups
    with policy.rollout_weights(), gathered(policy.model, inputs.world):
        return check(policy.model, inputs.tokenizer, inputs.task, sampled, params, settings, seed=cfg.seed,
                     max_prompt_tokens=r.max_prompt_tokens, sample_groups=group_sampler(cfg))


def checked_rollout(cfg: Config, inputs: StepInputs, eval_rows: int, device: torch.device) -> RolloutFit:
    """The signal check at the run's rollout settings; with check.fit_length, at the longer caps it leads to
    (collect/signal_check.py fit_length), then with check.fit_group_size at the larger groups (fit_group_size), each
    setting planned against the device's memory first (plan/sizes.py check_sizes)."""
    def fits(**changes) -> bool:
        try:
            check_sizes(with_rollout(cfg, **changes), eval_rows, device)
        except ConfigError:
            return False
        return True

    c = cfg.check
    if c.fit_length:
        length = fit_length(lambda n: signal_of(with_rollout(cfg, max_new_tokens=n), inputs),
                            cfg.rollout.max_new_tokens, c.max_new_tokens_limit, lambda n: fits(max_new_tokens=n))
    else:
        length = LengthFit(cfg.rollout.max_new_tokens, [signal_of(cfg, inputs)], fitted=False)
    if not c.fit_group_size:
        return RolloutFit(length)
    cfg = with_rollout(cfg, max_new_tokens=length.length)

    def grow(report: SignalReport, p: int) -> SignalReport:
        return signal_of(with_rollout(cfg, group_size=2 * report.stats.group_size, prompts_per_step=p), inputs, report)

    group = fit_group_size(grow, length.report, cfg.rollout.prompts_per_step, c.group_size_limit, inputs.world.size,
                           lambda g, p: fits(max_new_tokens=length.length, group_size=g, prompts_per_step=p))
    return RolloutFit(length, group)


def with_rollout(cfg: Config, **changes) -> Config:
    """cfg with the rollout settings `changes` (max_new_tokens, group_size, prompts_per_step) replaced."""
    return replace(cfg, rollout=replace(cfg.rollout, **changes))


def run_with_rollout(run: Run, fit: RolloutFit) -> Run:
    """`run` with the rollout settings the check chose from step 1 on: its config (stored with every checkpoint, so
    a resume keeps them), the rollout's sampling and the settings derived from the config (the loss's length
    normaliser, overlong shaping: StepInputs rebuilds them)."""
    changes = {"max_new_tokens": fit.max_new_tokens}
    if fit.group is not None:
        changes.update(group_size=fit.group.group_size, prompts_per_step=fit.group.prompts)
    cfg = with_rollout(run.cfg, **changes)
    params = replace(run.inputs.params, n=cfg.rollout.group_size, max_new_tokens=cfg.rollout.max_new_tokens)
    return replace(run, resolved=replace(run.resolved, config=cfg), inputs=replace(run.inputs, cfg=cfg, params=params))


def check_config(cfg: Config) -> RolloutFit:
    """`grpo check CONFIG`: the signal check of the model at model.path with the config's settings, as `grpo train`
    runs it before step 1 (with check.fit_length or check.fit_group_size, at each setting it tries), without a run
    directory. A config with a warm start is checked by `grpo train` after it."""
    if warm_started(cfg):
        raise ConfigError("grpo check samples model.path as it is, but this config warm-starts (warm_start.*): "
                          "`grpo train` runs the check after the warm start (check.enabled, --no-check)")
    check_paths(cfg)
    task = task_of(cfg)
    examples = split_examples(task, cfg, "train_split")
    if not examples:
        raise ConfigError(f"task.train_split={cfg.task.train_split!r} of task {cfg.task.name!r} has no examples")
    eval_rows = len(split_examples(task, cfg, "eval_split")[: cfg.eval.max_examples]) if cfg.eval.every else 0
    resolved = checked_settings(cfg, pick_device(cfg.model.device, 0), eval_rows)  # as `grpo train` checks it
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path)
    cfg = resolved.config
    policy = build_policy(resolved)
    check_prompts(cfg, task, tokenizer, examples, split_examples(task, cfg, "eval_split")[:eval_rows])
    inputs = StepInputs(cfg, policy, tokenizer, task, examples, ShuffledPrompts(len(examples), cfg.seed),
                        sampling_params(cfg, tokenizer))
    return checked_rollout(cfg, inputs, eval_rows, resolved.device)
