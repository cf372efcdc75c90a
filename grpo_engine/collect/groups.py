"""Group collection for a step: draw prompts, sample G completions each, score them.

Dynamic sampling (DAPO): groups whose G rewards are all equal carry no learning signal; when enabled they
are dropped and fresh prompts are generated, up to `group_filter.max_rounds` rounds in all, to refill the
P groups.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..config.algorithm import GroupFilterConfig
from ..rl.advantages import select_groups
from ..rollout import GenerationOutput, SamplingParams, generate
from ..rollout.multiturn import TrajectoryMetrics
from ..tasks.base import Example, RewardResult, render_prompt, safe_reward
from ..tasks.data import DataError
from ..world import World, fail_together


class ShuffledPrompts:
    """The prompt stream: endless shuffled example indices; its whole state is one integer (exact resume).

    Epoch e is a permutation seeded by (seed, e), so position p always maps to the same example.
    """

    def __init__(self, num_examples: int, seed: int, position: int = 0):
        if num_examples == 0:
            raise ValueError("the task's training split has no examples")
        self.n, self.seed, self.position = num_examples, seed, position
        self._epoch, self._perm = -1, None

    def next(self) -> int:
        epoch, offset = divmod(self.position, self.n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm, self._epoch = torch.randperm(self.n, generator=g).tolist(), epoch
        self.position += 1
        return self._perm[offset]


class PromptStream(Protocol):
    """Where a step draws its prompts from: ShuffledPrompts, or a curriculum's queue in front of one
    (collect/curriculum.py)."""

    def next(self) -> int: ...


@dataclass
class Group:
    """One prompt and its G scored completions."""

    example: Example
    prompt_text: str
    prompt_ids: list[int]
    completion_ids: list[list[int]]  # G rows, stop token included when it stopped
    logprobs: list[list[float]]  # G rows, sampler log-probs
    finish_reasons: list[str]  # G
    texts: list[str]  # G decoded completions
    rewards: list[RewardResult]  # G
    # multi-turn rollouts with tools (collect/tool_groups.py); None for single-turn completions
    loss_masks: list[list[int]] | None = None  # G rows aligned with completion_ids: 1 = sampled by the policy
    trajectory_metrics: list[TrajectoryMetrics] | None = None  # G: turns, tool calls / errors, token counts

    @property
    def totals(self) -> list[float]:
        return [r.total for r in self.rewards]

    def joined(self, more: Group) -> Group:
        """This group with `more`'s completions of the same prompt after its own (a larger group, without sampling
        again the completions it has)."""
        both = lambda a, b: None if a is None or b is None else a + b  # noqa: E731
        return Group(self.example, self.prompt_text, self.prompt_ids, self.completion_ids + more.completion_ids,
                     self.logprobs + more.logprobs, self.finish_reasons + more.finish_reasons,
                     self.texts + more.texts, self.rewards + more.rewards, both(self.loss_masks, more.loss_masks),
                     both(self.trajectory_metrics, more.trajectory_metrics))


# The sampler's call (rollout.generate): generate(model, prompt_ids, params, seed=..., tokenizer=...)
Generate = Callable[..., GenerationOutput]


class GroupSampler(Protocol):
    """The groups-level callable a step, the probe and the checks sample with: examples -> (their scored groups,
    generated tokens). generate_groups (single-turn), collect/tool_groups.generate_tool_groups (with tools, its
    `tools` bound), coin_flip_rewards(one of those) (the random-reward control)."""

    def __call__(self, model, tokenizer, task, examples: list[Example], params: SamplingParams,
                 seed: int | list[int], max_prompt_tokens: int | None) -> tuple[list[Group], int]: ...


REWARD_TIMEOUT_S = 5.0  # a reward that runs longer scores 0 and is counted as a timeout


def check_prompt_lengths(task, tokenizer, examples: list[Example], max_prompt_tokens: int) -> None:
    """Refuse, before step 1, a prompt of `examples` longer than rollout.max_prompt_tokens (or than the chat
    template renders), naming its row (file and line where the task read one: `task.places`), instead of the step
    that first draws it failing.

    Cheap: a prompt's tokens are at most its scaffolding's tokens (the chat template rendered around empty
    messages) plus one per byte of its text (every token covers at least one byte; two per message spare), so a
    prompt is rendered and counted only when its text is long enough to possibly exceed the cap (none in typical
    data). Cost on a 10,000-row file: docs/benchmarks.md."""
    scaffolds: dict[tuple, int] = {}
    for ex in examples:
        prompt = task.prompt(ex)
        shape = tuple(m["role"] for m in prompt.messages)
        if shape not in scaffolds:
            empty = [{**m, "content": ""} for m in prompt.messages]
            scaffolds[shape] = len(tokenizer.encode(tokenizer.apply_chat_template(empty, add_generation_prompt=True)))
        text = sum(len(m["content"].encode("utf-8")) for m in prompt.messages) + len(prompt.prefill.encode("utf-8"))
        if scaffolds[shape] + text + 2 * len(shape) + 2 <= max_prompt_tokens:
            continue
        where = getattr(task, "places", {}).get(ex.id, f"example {ex.id}")
        try:
            n = len(tokenizer.encode(render_prompt(task, tokenizer, ex)))
        except ValueError as e:  # the chat template's budget (CheckpointError): the row, not the template
            raise DataError(f"{where}: its prompt cannot be rendered ({str(e).split(': ', 1)[-1]}); shorten the "
                            f"row") from None
        if n > max_prompt_tokens:
            raise DataError(f"{where}: its prompt renders to {n:,} tokens, more than rollout.max_prompt_tokens="
                            f"{max_prompt_tokens}; shorten the row, or raise rollout.max_prompt_tokens")


def generate_groups(model, tokenizer, task, examples: list[Example], params: SamplingParams,
                    seed: int | list[int], max_prompt_tokens: int | None,
                    reward_timeout_s: float | None = None, generate: Generate = generate) -> tuple[list[Group], int]:
    """Generate params.n completions per example and score them. Returns (groups, generated tokens).

    The one generate-and-score path: training, the in-loop eval and `grpo eval` all call it, so a completion is
    rendered, decoded and scored the same way everywhere. seed: one int for the call, or one per example
    (rollout.generate); max_prompt_tokens None: no cap; generate: the sampler (tests pass a scripted one)."""
    texts = [render_prompt(task, tokenizer, ex) for ex in examples]
    prompt_ids = [tokenizer.encode(t) for t in texts]
    for ex, ids in zip(examples, prompt_ids):
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise ValueError(f"prompt of example {ex.id} has {len(ids)} tokens > rollout.max_prompt_tokens="
                             f"{max_prompt_tokens}; raise it or shorten the prompt")
    was_training = model.training
    model.eval()  # no dropout while sampling: the sampler's log-probs must match the policy
    try:
        out = generate(model, prompt_ids, params, seed=seed, tokenizer=tokenizer)
    finally:
        model.train(was_training)
    groups, G = [], params.n
    if len(out.completion_ids) != len(examples) * G:
        raise RuntimeError(f"generate returned {len(out.completion_ids)} rows for {len(examples)} prompts x n={G}")
    for p, ex in enumerate(examples):
        rows = range(p * G, (p + 1) * G)
        completions = [out.completion_ids[i] for i in rows]
        decoded = [tokenizer.decode(c, skip_special_tokens=True) for c in completions]
        timeout = REWARD_TIMEOUT_S if reward_timeout_s is None else reward_timeout_s
        rewards = [safe_reward(task, ex, text, timeout) for text in decoded]
        groups.append(Group(ex, texts[p], prompt_ids[p], completions, [out.logprobs[i] for i in rows],
                            [out.finish_reason[i] for i in rows], decoded, rewards))
    return groups, sum(len(c) for c in out.completion_ids)


def coin_flip_rewards(sample_groups: GroupSampler = generate_groups) -> GroupSampler:
    """sample_groups with every completion's reward total replaced by a coin flip, 0.0 or 1.0, drawn from its
    prompt's sampling seed and its index in the group: independent of what the completion says, reproducible,
    different for every step, round and prompt. The components stay the task's, so accuracy (the "answer"
    component) still tells the truth; dynamic sampling and the advantages see the coin. The control experiment
    of algorithm.random_reward."""

    def flipped(model, tokenizer, task, examples, params, seed, max_prompt_tokens, *args, **kwargs):
        groups, n = sample_groups(model, tokenizer, task, examples, params, seed, max_prompt_tokens, *args, **kwargs)
        seeds = [f"{seed}-{p}" for p in range(len(groups))] if isinstance(seed, int) else list(seed)
        for g, s in zip(groups, seeds):
            rng = random.Random(f"random-reward-{s}")
            g.rewards = [replace(r, total=float(rng.random() < 0.5), info={**r.info, "control": "random-reward"})
                         for r in g.rewards]
        return groups, n

    return flipped


def prompt_seed(seed: int, step: int, round_: int, prompt: int) -> int:
    """Sampling seed of one prompt's group: a pure function of (seed, step, dynamic-sampling round, the prompt's
    index among the step's global prompts), so resume is exact and the completions of a prompt do not depend
    on which other prompts share its batch (or its rank)."""
    return (seed * 1_000_003 + step * 1_009 + round_ * 101 + prompt * 7_919) % (2**63)


@dataclass
class CollectedGroups:
    """One step's groups with their rewards: what collect_groups hands to the rest of the step."""

    groups: list[Group]  # the groups to train on (<= P)
    generated: list[Group]  # every group generated this step (for metrics)
    refills: int  # extra generation rounds dynamic sampling needed
    gen_tokens: int
    time_generate_s: float


def collect_groups(model, tokenizer, task, examples, stream: PromptStream, params: SamplingParams, *,
                   prompts: int, seed: int, step: int, max_prompt_tokens: int, group_filter: GroupFilterConfig,
                   world: World | None = None,
                   sample_groups: GroupSampler = generate_groups) -> CollectedGroups:
    """Generate this rank's groups of the step's `prompts` (the global count); with group_filter.enabled keep
    only informative groups (rewards differ), drawing fresh prompts for the missing ones, for at most
    group_filter.max_rounds rounds (rl.advantages.select_groups).

    Every rank draws the same global prompts from the stream and generates its own share of them, each
    prompt seeded by its global index: the completions of a prompt do not depend on the number of ranks.
    sample_groups: what samples and scores them (GroupSampler), e.g. collect/tool_groups.generate_tool_groups.
    """
    world = world or World()
    local = prompts // world.size
    rounds: list[list[Group]] = []
    gen_tokens, t0, selection = 0, time.perf_counter(), None
    for round_ in range(group_filter.max_rounds if group_filter.enabled else 1):
        missing = max(0, local - (selection.num_informative if selection else 0))
        need = world.max(missing)  # every rank draws (and so advances the stream) in step
        if need == 0:
            break
        drawn = [stream.next() for _ in range(need * world.size)]  # global prompt index -> example
        mine = list(world.my_share(len(drawn)))[:missing]
        with fail_together(world, "rollout"):  # NaN logits on one rank stop every rank, not only that one
            if mine:
                seeds = [prompt_seed(seed, step, round_, i) for i in mine]
                groups, n = sample_groups(model, tokenizer, task, [examples[drawn[i]] for i in mine], params,
                                          seeds, max_prompt_tokens)
                rounds.append(groups)
                gen_tokens += n
        if group_filter.enabled and rounds:
            rewards = [torch.tensor([g.totals for g in r], dtype=torch.float64) for r in rounds]  # [P_r, G] each
            selection = select_groups(rewards, local, group_filter.tol)
    generated = [g for r in rounds for g in r]
    kept = [rounds[r][p] for r, p in selection.keep] if selection is not None else generated
    return CollectedGroups(kept, generated, max(0, len(rounds) - 1), gen_tokens, time.perf_counter() - t0)
