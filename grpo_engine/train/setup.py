"""Set-up of a training run, before step 1: everything checkable is checked before any weights are read.

Order: paths and the memory plan (arithmetic on the config), the task and its data, the warm start, the
checkpoint to resume from, the loggers; only then the tokenizer and the policy's weights. On resume the
optimizer, LR schedule, moving reference, prompt-stream position, curriculum queue and RNG states come back from the
checkpoint.
"""

from __future__ import annotations

import os
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
from ..kernels import PLAN_FILE
from ..model.config import ModelConfig
from ..model.loading import load_tokenizer, pick_device
from ..monitor import Monitor, RankMessages
from ..plan import GIB
from ..plan.from_config import check_memory_fits, config_model_shape, plan_config, planned_precision
from ..plan.precision import resolve_precision
from ..plan.resolved import Resolved, resolve_settings
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
    """A training run ready for its next step."""

    cfg: Config
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
    resolved: Resolved | None = None  # what this machine decided (cfg is resolved.config); stored as resolved.yaml


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
    check_sizes(cfg, len(eval_examples), device)  # before the run lock
    check_memory_fits(cfg)  # memory.gpu_memory_gib > 0: the planner's verdict, before any weights are read
    ckpt_root = Path(cfg.run_dir) / "checkpoints"
    resume_dir = resolve_resume(resume, ckpt_root, to_stderr, command=options.command, verify=world.is_main)
    kept = kept_precision(resume_dir, device.type) if resume_dir else None
    if resume_dir and (fitted := kept_rollout(resume_dir, cfg)).changed:
        cfg = fitted.cfg
        if world.is_main:
            to_stderr(f"resume: {fitted.describe()}, as the signal check chose for the run resumed")
    resolved = resolve_settings(cfg, device, kept)  # what this machine decides, once: later stages read only this
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
        write_run_file(cfg.run_dir, PLAN_FILE, policy.kernels.to_json(), overwrite=c.run_dir.replace_files)
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
    return Run(cfg, inputs, state, monitor, c.eval_examples, c.ckpt_root, done, c.resume_dir,
               RewardWatch(monitor.message, cfg.logging.no_signal_warn_steps), lock, c.data, c.resume_dir, resolved)


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
    return Monitor(cfg.run_dir, total_steps=cfg.schedule.steps, start_step=done, progress=cfg.logging.progress,
                   tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                   wandb_project=cfg.logging.wandb_project, config=OmegaConf.to_container(OmegaConf.structured(cfg)))


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
    setting planned against the device's memory first (check_sizes)."""
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
    inputs = replace(run.inputs, cfg=cfg, params=params)
    resolved = replace(run.resolved, config=cfg) if run.resolved is not None else None
    return replace(run, cfg=cfg, inputs=inputs, resolved=resolved)


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
    device = pick_device(cfg.model.device, 0)
    check_sizes(cfg, eval_rows, device)  # the size check `grpo train` makes, before anything is loaded or sampled
    seed_everything(cfg.seed)
    tokenizer = load_tokenizer(cfg.tokenizer.path or cfg.model.path)
    resolved = resolve_settings(cfg, device)
    cfg = resolved.config
    policy = build_policy(resolved)
    check_prompts(cfg, task, tokenizer, examples, split_examples(task, cfg, "eval_split")[:eval_rows])
    inputs = StepInputs(cfg, policy, tokenizer, task, examples, ShuffledPrompts(len(examples), cfg.seed),
                        sampling_params(cfg, tokenizer))
    return checked_rollout(cfg, inputs, eval_rows, resolved.device)


# ----------------------------------------------------------------------------------------------------
# Sizes bounded before anything is allocated: the settings that scale what a step holds (rollout.prompts_per_step,
# rollout.group_size, rollout.max_new_tokens, rollout.max_prompt_tokens, eval.max_examples, eval.max_new_tokens and
# the tool budget tools.max_tokens) are compared with the device's memory before the run lock is taken and before any
# weights are read (check_sizes).
#
# Why in integers first: `rollout.group_size=10^12` ran into the kernel's out-of-memory killer with the run lock held,
# and `rollout.prompts_per_step=10^9` ended in a MemoryError traceback from the prompt stream. What scales with those
# settings is counted in Python integers (the KV cache of the rows decoded at once, the step's padded batch, the
# held-out probe's KV cache), so no value, however absurd, allocates or overflows; only once each is within the
# device's memory does the memory planner (plan/, floats) plan the step and the probe with the weights, optimizer
# state and a micro-batch. The budget is the CUDA card's memory, or the machine's physical RAM on a CPU (swap left
# out: a step that only fits in swap does not run in any useful time).

# One padded TrainBatch token (train/batch.py): input_ids int64, completion_mask and sampler_logp fp32.
BATCH_BYTES_PER_TOKEN = 8 + 4 + 4
LOGIT_BYTES = 4 * 3  # a decode step's [rows, V] fp32 logits and two sampling buffers of that size


@dataclass(frozen=True)
class Term:
    """One part of the planned peak: what it is, the settings that scale it (as written), its bytes."""

    what: str
    settings: dict[str, int | str]
    nbytes: int
    fix: str = ""  # what to change; default: lower one of the settings


@dataclass(frozen=True)
class DeviceMemory:
    nbytes: int
    what: str  # "physical RAM on this machine" | "the CUDA card cuda:0"


def device_memory(device: torch.device) -> DeviceMemory:
    """What the run's device holds: the card's memory on CUDA, physical RAM (no swap) on a CPU."""
    if device.type == "cuda":
        return DeviceMemory(torch.cuda.get_device_properties(device).total_memory, f"the CUDA card {device}")
    return DeviceMemory(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM on this machine")


def check_sizes(cfg: Config, eval_rows: int, device: torch.device, memory: DeviceMemory | None = None,
                shape: str | None = None) -> None:
    """Refuse, in one line naming the settings and the planned vs available bytes, a config whose planned peak
    exceeds the device's memory. eval_rows: the held-out probe's prompts (0 without eval); shape: plan this model
    shape (a plan/shapes.py name or HF dir) instead of model.path's."""
    memory = memory or device_memory(device)
    model = _model_shape(cfg, shape)
    terms = scaled_terms(cfg, eval_rows, model, device)
    bounded = max(t.nbytes for t in terms) <= memory.nbytes  # then the planner's floats are safe
    # with memory.gpu_memory_gib set, check_memory_fits judges the whole plan against the card the config names
    if model is not None and bounded and cfg.memory.gpu_memory_gib <= 0:
        terms = planned_terms(cfg, eval_rows, device, shape, memory.nbytes, batch=terms[1].nbytes)
    worst = max(terms, key=lambda t: t.nbytes)
    if worst.nbytes > memory.nbytes:
        raise ConfigError(refusal(worst, memory))


def refusal(worst: Term, memory: DeviceMemory) -> str:
    settings = ", ".join(f"{k}={_count(v) if isinstance(v, int) else v}" for k, v in worst.settings.items())
    return (f"{settings}: {worst.what} is planned at {_count(worst.nbytes)} bytes ({_gib(worst.nbytes)}), more than "
            f"the {memory.nbytes:,} bytes ({_gib(memory.nbytes)}) of {memory.what}; "
            f"{worst.fix or 'lower ' + ' or '.join(worst.settings)} (`grpo plan CONFIG` shows where the memory goes)")


def scaled_terms(cfg: Config, eval_rows: int, model: ModelConfig | None, device: torch.device) -> list[Term]:
    """What scales with the size settings, in Python integers, each alive at one moment of a step: the KV cache and
    logits of the rollout's rows decoded at once, the step's padded batch, the held-out probe's KV cache and logits
    (the last two need the model's shape: 0 without one)."""
    r = cfg.rollout
    slots, probe_slots = r.max_prompt_tokens + completion_cap(cfg), r.max_prompt_tokens + probe_cap(cfg)
    rows = r.prompts_per_step * r.group_size
    decoded, probed = in_flight(cfg, rows, r.group_size, slots), in_flight(cfg, eval_rows, 1, probe_slots)
    rollout = probe = 0
    if model is not None:
        per_slot = kv_bytes_per_slot(model, precision_on(cfg, device))
        rollout = decoded * (slots * per_slot + model.vocab_size * LOGIT_BYTES)
        probe = probed * (probe_slots * per_slot + model.vocab_size * LOGIT_BYTES)
    return [Term("the rollout's KV cache", rollout_settings(cfg), rollout),
            Term("the step's padded batch", rollout_settings(cfg), rows * slots * BATCH_BYTES_PER_TOKEN),
            Term(f"the held-out probe ({eval_rows} prompts)", probe_settings(cfg), probe)]


def planned_terms(cfg: Config, eval_rows: int, device: torch.device, shape: str | None, budget: int,
                  batch: int) -> list[Term]:
    """The memory planner's peak of one step (plus the padded batch, which it does not count) and of the held-out
    probe (the weights and optimizer state stay resident while it samples)."""
    cpu = device.type != "cuda"
    card = None if cpu else budget / GIB
    common = {"precision": precision_on(cfg, device), **({"static_decode": False, "cuda_context_gib": 0.0} if cpu
                                                         else {})}
    r, slots = cfg.rollout, cfg.rollout.max_prompt_tokens + completion_cap(cfg)
    planned = micro_batch_within_the_batch(cfg, r.prompts_per_step * r.group_size * slots)
    step = plan_config(planned, shape, card, completion_len=completion_cap(cfg),
                       rollout_rows_in_flight=in_flight(cfg, r.prompts_per_step * r.group_size, r.group_size, slots),
                       **common)
    what, total = f"one step ({step.peak_phase} phase)", int(step.total_gib * GIB) + batch
    terms = [Term(what, rollout_settings(cfg), total) if step.peak_phase == "rollout" else Term(
        what, {"model.path": cfg.model.path or "(the warm start's)", "memory.micro_batch_tokens":
               cfg.memory.micro_batch_tokens or "auto"}, total,
        "train LoRA adapters (lora.enabled) or a smaller model, or choose optimizer.name=adamw_8bit or adamw_offload"
        if step.peak_phase == "optimizer" else
        "lower memory.micro_batch_tokens, or train LoRA adapters (lora.enabled) or a smaller model")]
    if step.peak_phase == "eval":  # the evaluation's prompts' prefill and, past the rollout's rows, its own state
        terms = [Term(what, probe_settings(cfg), total, "lower eval.max_examples (at most rollout.prompts_per_step "
                      "x group_size: the evaluation then decodes on the rollout's state)")]
    if eval_rows:
        rows = in_flight(cfg, eval_rows, 1, r.max_prompt_tokens + probe_cap(cfg))
        probe = plan_config(planned, shape, card, prompts_per_step=eval_rows, group_size=1,
                            completion_len=probe_cap(cfg), rollout_rows_in_flight=rows, **common)
        k = probe.knobs
        sampling = probe.phase("rollout").total * (1 + k.fragmentation) + k.cuda_context_gib * GIB
        terms.append(Term(f"the held-out probe ({eval_rows} prompts)", probe_settings(cfg), int(sampling)))
    return terms


def micro_batch_within_the_batch(cfg: Config, batch_tokens: int) -> Config:
    """cfg with memory.micro_batch_tokens at most the step's batch (a micro-batch never holds more than the whole
    batch): a larger budget, e.g. 10^12 to mean "all at once", is planned as the batch, not as 10^12 tokens (which
    the planner would also carry into floats that overflow)."""
    if cfg.memory.micro_batch_tokens <= batch_tokens:
        return cfg
    return replace(cfg, memory=replace(cfg.memory, micro_batch_tokens=batch_tokens))


def completion_cap(cfg: Config) -> int:
    """Tokens after the prompt in a rollout row: tools.max_tokens for trajectories, else rollout.max_new_tokens."""
    return cfg.tools.max_tokens if cfg.tools.enabled else cfg.rollout.max_new_tokens


def probe_cap(cfg: Config) -> int:
    return cfg.tools.max_tokens if cfg.tools.enabled else cfg.eval.max_new_tokens


def in_flight(cfg: Config, rows: int, group: int, slots: int) -> int:
    """Rows decoded at once: all of them, or whole groups while rows x slots stays under rollout.max_tokens_in_flight
    (rollout/generate.py plan_waves; at least one group). Trajectories with tools decode all rows together."""
    cap = cfg.rollout.max_tokens_in_flight
    if cap == 0 or cfg.tools.enabled:
        return rows
    return min(rows, max(1, cap // (group * slots)) * group)


def rollout_settings(cfg: Config) -> dict[str, int]:
    r = cfg.rollout
    cap = ("tools.max_tokens", cfg.tools.max_tokens) if cfg.tools.enabled else ("rollout.max_new_tokens",
                                                                                r.max_new_tokens)
    return {"rollout.prompts_per_step": r.prompts_per_step, "rollout.group_size": r.group_size,
            "rollout.max_prompt_tokens": r.max_prompt_tokens, cap[0]: cap[1]}


def probe_settings(cfg: Config) -> dict[str, int]:
    cap = ("tools.max_tokens", cfg.tools.max_tokens) if cfg.tools.enabled else ("eval.max_new_tokens",
                                                                                cfg.eval.max_new_tokens)
    return {"eval.max_examples": cfg.eval.max_examples, "rollout.max_prompt_tokens": cfg.rollout.max_prompt_tokens,
            cap[0]: cap[1]}


def kv_bytes_per_slot(model: ModelConfig, precision: str) -> int:
    """Keys and values of one token in every layer."""
    return 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * (4 if precision == "fp32" else 2)


def precision_on(cfg: Config, device: torch.device) -> str:
    """memory.precision as the trainer resolves it on `device` (plan/precision.py)."""
    return planned_precision(cfg) if device.type == "cuda" else resolve_precision(cfg.memory.precision, "cpu")


def _model_shape(cfg: Config, shape: str | None) -> ModelConfig | None:
    """The policy's shape, or None where the config names none to read (the model load reports that itself)."""
    try:
        return config_model_shape(cfg, shape)
    except (ConfigError, ValueError, OSError):
        return None


def _gib(n: int) -> str:
    """Integer division above 1 TiB: a planned size may be too large for a float."""
    return f"{n / GIB:.1f} GiB" if n < 1024 * GIB else f"{_count(n // (1024 * GIB))} TiB"


def _count(n: int) -> str:
    """1,234,567 up to 10^18, then 1.23e+400 from the digits (an int that large has no float)."""
    if n < 10**18:
        return f"{n:,}"
    digits = str(n)
    return f"{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"
