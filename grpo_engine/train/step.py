"""One GRPO step, top to bottom: prompts -> generate -> score -> advantages -> batch -> old / reference
log-probs -> mu updates -> a StepRecord.

Everything a step reads is set up once (train/setup.py) and handed in as `StepInputs`; what carries from one
step to the next besides the policy and the prompt stream is `StepState`. `train()` (train/loop.py) calls
`grpo_step` in its loop, and so do `grpo bench step` and the demo, so the step that is benchmarked is the step
that trains.

Exactness: the prompts are a function of (seed, position in the stream) and the curriculum's checkpointed
queue, the sampling seed of (seed, step, round), and every other random state is checkpointed, so a resumed CPU
run repeats the uninterrupted one bit for bit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from ..collect.curriculum import Curriculum, PoolReport
from ..collect.groups import (
    CollectedGroups,
    GroupSampler,
    ShuffledPrompts,
    coin_flip_rewards,
    collect_groups,
    generate_groups,
)
from ..config import Config
from ..monitor import StepMetrics
from ..rl.losses import resolve, zero_advantage_is_inert
from ..rollout import SamplingParams
from ..tasks.base import Example
from ..world import World
from .batch import TrainBatch, rows_with_signal, train_batch
from .distributed import gathered
from .memory import free_rollout_memory, peak_memory_mib, reset_peak_memory, update_allocations, update_allocations_rule
from .metrics import graph_metrics, merge_ranks, step_metrics, step_parts
from .policy import Policy
from .update import UpdateOutcome, UpdateSettings, update_policy


@dataclass
class StepInputs:
    """What every step reads: built once before the first step."""

    cfg: Config
    policy: Policy
    tokenizer: object
    task: object
    examples: list[Example]  # the training split
    prompts: ShuffledPrompts  # endless shuffled stream of example indices (its state is one integer)
    params: SamplingParams  # rollout sampling (G completions per prompt)
    world: World = field(default_factory=World)  # this rank among the data-parallel ranks (size 1: alone)
    curriculum: Curriculum | None = None  # curriculum.mode != none: a scored queue in front of `prompts`
    update: UpdateSettings = field(init=False)  # what the update phase reads, the loss resolved once (from cfg)

    def __post_init__(self):
        self.update = update_settings(self.cfg)


@dataclass
class StepState:
    """What carries over from one step to the next (checkpointed)."""

    nonfinite_in_row: int = 0  # consecutive updates skipped for a NaN/inf loss or gradient
    micro_tokens: int = 1024  # micro-batch token budget (halved on CUDA OOM when allowed)


@dataclass
class StepRecord:
    step: int
    metrics: StepMetrics  # one line of metrics.jsonl
    collected: CollectedGroups  # every group sampled this step (samples.jsonl reads it)
    update: UpdateOutcome


def grpo_step(inputs: StepInputs, state: StepState, step: int, message: Callable[[str], None] = print) -> StepRecord:
    """Optimizer step number `step` (1-based) of the run: sample, score, score, update; returns its record."""
    cfg, policy = inputs.cfg, inputs.policy
    t_step = time.perf_counter()
    reset_peak_memory(policy.device)

    # 1-3. this rank's share of the P prompts -> G completions each, on the policy's own weights -> rewards;
    #      with a curriculum the prompts come from its queue first, refilled from a scored pool every K steps
    stream = inputs.curriculum or inputs.prompts
    with policy.rollout_weights(), gathered(policy.model, inputs.world):
        pool = inputs.curriculum.refresh(step, policy.model) if inputs.curriculum is not None else None
        collected = collect_groups(policy.model, inputs.tokenizer, inputs.task, inputs.examples, stream,
                                   inputs.params, prompts=cfg.rollout.prompts_per_step, seed=cfg.seed, step=step,
                                   max_prompt_tokens=cfg.rollout.max_prompt_tokens,
                                   group_filter=cfg.algorithm.group_filter, world=inputs.world,
                                   sample_groups=training_group_sampler(cfg))
    if cfg.memory.empty_cache_between_phases:
        free_rollout_memory()

    # 4. rewards -> group advantages (+ semantic entropy, overlong handling) -> one right-padded batch; the
    #    loss normalisers are the step's token and sequence counts over all ranks
    batch, adv_info = train_batch(collected.groups, cfg, inputs.task, inputs.tokenizer.pad_token_id, inputs.world)
    totals = step_totals(batch, inputs.world)
    if batch is not None and cfg.memory.skip_zero_advantage and zero_advantage_is_inert(inputs.update.loss):
        batch = rows_with_signal(batch)  # rows with advantage 0 add nothing to this loss's gradient: not run

    # 5. old-policy (mu > 1) and reference (beta > 0) log-probs, only when the loss needs them
    t0 = time.perf_counter()
    policy.model.train()
    if cfg.algorithm.mu > 1 or policy.spec.reference != "none":
        reference = policy.reference.module if policy.reference is not None else None
        with gathered(policy.model, inputs.world), gathered(reference, inputs.world):  # fsdp2: gathered once
            if batch is not None:
                attach_logprobs(batch, policy, cfg, state.micro_tokens)
    time_logprobs = time.perf_counter() - t0

    # 6. mu passes over the batch, each ending in one optimizer step; then the LR schedule and the reference
    t0 = time.perf_counter()
    lr = policy.optimizer.param_groups[0]["lr"]  # the rate this step's update uses
    outcome = update_step(inputs, batch, state.micro_tokens, step, totals, message)
    state.micro_tokens = outcome.micro_tokens
    if outcome.nonfinite:
        state.nonfinite_in_row += 1
        message(f"step {step}: non-finite loss ({outcome.loss}) or grad norm ({outcome.grad_norm}); "
                f"update skipped ({state.nonfinite_in_row} in a row)")
    elif not outcome.skipped:
        state.nonfinite_in_row = 0
    time_update = time.perf_counter() - t0

    # 7. the step's record
    parts = merge_ranks(inputs.world, step_parts(collected, batch, outcome.stats, adv_info))
    m = step_metrics(step, parts, cfg.algorithm.advantage.zero_variance_tol)
    m.grad_norm, m.lr, m.skipped_update = outcome.grad_norm, lr, outcome.skipped
    m.micro_batch_tokens = state.micro_tokens
    m.time_logprobs_s, m.time_update_s = time_logprobs, time_update
    m.train_tokens_per_s = m.train_tokens * cfg.algorithm.mu / max(time_update, 1e-9)
    m.time_step_s, m.peak_mem_mib = time.perf_counter() - t_step, peak_memory_mib(policy.device)
    m.rollout = graph_metrics(inputs.world)
    curriculum_metrics(m, pool)
    return StepRecord(step, m, parts.collected, outcome)


def update_step(inputs: StepInputs, batch, micro_tokens: int, step: int, totals, message) -> UpdateOutcome:
    """update_policy (with memory.cpu_update_mmap's allocation rule on CPU; it also advances the LR schedule and
    frees the gradients), then the reference."""
    cfg, policy = inputs.cfg, inputs.policy
    with update_allocations(update_allocations_rule(cfg.memory.cpu_update_mmap, policy.device)):
        outcome = update_policy(policy.model, policy.optimizer, batch, inputs.update, micro_tokens, message,
                                inputs.world, totals, policy.scheduler)
    policy.after_update(step, updated=not outcome.skipped)
    return outcome


def group_sampler(cfg: Config) -> GroupSampler:
    """What samples and scores the run's groups: generate_groups, or with tools.enabled the multi-turn
    trajectories of collect/tool_groups.py."""
    if not cfg.tools.enabled:
        return generate_groups
    from ..collect.tool_groups import generate_tool_groups

    return partial(generate_tool_groups, tools=cfg.tools)


def training_group_sampler(cfg: Config) -> GroupSampler:
    """group_sampler, and with algorithm.random_reward its rewards replaced by seeded coin flips (the control
    experiment; the in-loop evaluation keeps group_sampler and the task's reward)."""
    sample_groups = group_sampler(cfg)
    return coin_flip_rewards(sample_groups) if cfg.algorithm.random_reward else sample_groups


def curriculum_metrics(m: StepMetrics, pool: PoolReport | None) -> None:
    """A re-scoring step's curriculum figures into its metrics line (None: no re-scoring this step)."""
    if pool is None:
        return
    m.curriculum_pool_accuracy, m.curriculum_pool_entropy = pool.accuracy, pool.entropy
    m.curriculum_queued, m.curriculum_gen_tokens, m.curriculum_time_s = pool.queued, pool.gen_tokens, pool.time_s


def attach_logprobs(batch: TrainBatch, policy: Policy, cfg: Config, micro_tokens: int) -> None:
    """Old-policy log-probs (mu > 1: the ratio of later passes) and reference log-probs (beta > 0)."""
    kw = dict(temperature=cfg.rollout.temperature, chunk_size=cfg.memory.logprob_chunk_size)
    if cfg.algorithm.mu > 1:
        batch.old_logp = policy.old_logprobs(batch, micro_tokens, **kw)
    batch.ref_logp = policy.ref_logprobs(batch, micro_tokens, **kw)


def step_totals(batch: TrainBatch | None, world: World) -> tuple[int, int] | None:
    """(active tokens, active rows) of the whole step over all ranks; None when no rank has a batch."""
    local = [1.0, batch.active_tokens(), batch.active_rows()] if batch is not None else [0.0, 0.0, 0.0]
    ranks_with_data, tokens, rows = world.sum(local)
    return (int(tokens), int(rows)) if ranks_with_data else None


def update_settings(cfg: Config) -> UpdateSettings:
    """The update step's settings; the loss is the algorithm section resolved (rl/losses.py resolve), once."""
    return UpdateSettings(loss=resolve(cfg.algorithm.policy_loss, cfg.rollout.max_new_tokens), mu=cfg.algorithm.mu,
                          grad_clip=cfg.optimizer.grad_clip,
                          temperature=cfg.rollout.temperature, chunk_size=cfg.memory.logprob_chunk_size,
                          auto_halve=cfg.memory.auto_halve_micro_batch)
