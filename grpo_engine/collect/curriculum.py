"""Curriculum: every K steps, score a pool of prompts with the policy, then serve the ones worth training on.

A re-scoring (curriculum.every steps apart, the first at step 1) draws curriculum.pool_size prompts (the ones
still queued from the previous pool first, then fresh ones from the prompt stream), samples curriculum.samples
completions of each with the policy's own sampler, and scores every prompt by
    accuracy  the fraction of its samples the task marks correct (RewardResult.correct), and
    entropy   the semantic entropy of their final answers / log(samples), in [0, 1] (rl.semantic_entropy).
The mode then fills the queue that the step's prompts are drawn from before the plain stream:
    semantic_entropy  every pooled prompt, easy -> hard by difficulty = w entropy + (1 - w) (1 - accuracy):
                      answers the model agrees on and gets right first, ones it scatters over or misses last;
    accuracy_band     only the pooled prompts with band_low <= accuracy <= band_high: DAPO's dynamic sampling
                      (drop groups whose rewards are all equal) decided before generating the training groups,
                      so neither solved nor hopeless prompts cost a rollout. None in the band: the plain stream.
Pooled prompts that are not queued are skipped: the stream has moved past them.

Exactness: the pool comes from the prompt stream (a function of (seed, position)), the scoring completions
are seeded by (seed, step, pool position), and the state (the queue of example indices and the next
re-scoring step) is plain integers stored in the checkpoint's trainer state, so a resumed CPU run repeats the
uninterrupted one bit for bit. Under torchrun every rank scores every size-th pooled prompt and the scores are
gathered, so every rank queues the same prompts and draws the same global prompts from the stream.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from ..config import Config
from ..config.curriculum import CurriculumSection
from ..rl.semantic_entropy import curriculum_order, difficulty_scores
from ..rollout import SamplingParams
from ..tasks.base import Example
from ..world import World, fail_together
from .groups import ShuffledPrompts, generate_groups


@dataclass
class PoolScores:
    """One re-scoring's measurements, one entry per pooled prompt in pool order."""

    indices: list[int]  # [N] example index of each pooled prompt
    accuracy: list[float]  # [N] fraction of its samples the task marks correct
    entropy: list[float]  # [N] semantic entropy of its sampled answers / log(samples), in [0, 1]


def difficulty(scores: PoolScores, entropy_weight: float) -> list[float]:
    """[N] w x entropy + (1 - w) x (1 - accuracy), in [0, 1]: accuracy alone cannot tell a prompt the model
    answers consistently wrong (entropy 0) from one it guesses at, entropy alone cannot tell consistently right
    from consistently wrong; the mix ranks both."""
    w = entropy_weight
    return [w * e + (1 - w) * (1 - a) for a, e in zip(scores.accuracy, scores.entropy)]


def easy_to_hard(scores: PoolScores, entropy_weight: float) -> list[int]:
    """Example indices of the whole pool, easiest first; ties keep pool order (curriculum_order is stable)."""
    return [scores.indices[i] for i in curriculum_order(difficulty(scores, entropy_weight))]


def in_band(scores: PoolScores, low: float, high: float) -> list[int]:
    """Example indices of the pooled prompts with low <= accuracy <= high, in pool order."""
    return [i for i, a in zip(scores.indices, scores.accuracy) if low <= a <= high]


def select(scores: PoolScores, cfg: CurriculumSection) -> list[int]:
    """The queue a re-scoring leaves: the example indices to serve next, in order."""
    if cfg.mode == "semantic_entropy":
        return easy_to_hard(scores, cfg.entropy_weight)
    if cfg.mode == "accuracy_band":
        return in_band(scores, cfg.band_low, cfg.band_high)
    raise ValueError(f"curriculum.mode={cfg.mode!r} selects nothing")


def pool_seed(seed: int, step: int, position: int) -> int:
    """Sampling seed of one pooled prompt: a pure function of (seed, step, pool position), offset so that it
    does not coincide with the training groups' seeds (rollouts.prompt_seed) of the same step."""
    return (seed * 1_000_003 + step * 1_009 + position * 7_919 + 0x5EED_C0FFEE) % (2**63)


@dataclass
class PoolReport:
    """What one re-scoring logs (StepMetrics.curriculum_*)."""

    accuracy: float  # mean accuracy over the pool
    entropy: float  # mean normalised semantic entropy over the pool
    queued: int  # prompts queued to be served
    gen_tokens: int  # completion tokens the scoring generated (all ranks)
    time_s: float


@dataclass
class PoolScorer:
    """Scores pooled prompts with the policy's own sampler: the rollout settings, `samples` completions each."""

    tokenizer: object
    task: object
    examples: list[Example]  # the training split
    params: SamplingParams  # rollout sampling with n = curriculum.samples
    seed: int
    max_prompt_tokens: int
    chunk_prompts: int  # prompts generated at once: no more rows than a training step's P x G
    world: World

    def score(self, model, pool: list[int], step: int) -> tuple[PoolScores, int]:
        """(scores of the pool [N], completion tokens generated on all ranks). This rank scores every
        size-th pooled prompt; every rank returns the whole pool's scores."""
        mine = list(range(self.world.rank, len(pool), self.world.size))
        local: list[tuple[int, float, float]] = []  # (pool position, accuracy, entropy)
        tokens = 0
        with fail_together(self.world, "curriculum's scoring"):  # one rank's error stops every rank
            for start in range(0, len(mine), self.chunk_prompts):
                part = mine[start : start + self.chunk_prompts]
                groups, n = generate_groups(model, self.tokenizer, self.task,
                                            [self.examples[pool[i]] for i in part], self.params,
                                            [pool_seed(self.seed, step, i) for i in part], self.max_prompt_tokens)
                entropy = difficulty_scores([[r.answer for r in g.rewards] for g in groups], self.task.equivalent)
                local += [(i, statistics.fmean(r.correct for r in g.rewards), e)
                          for i, g, e in zip(part, groups, entropy)]
                tokens += n
        gathered = self.world.gather((local, tokens))
        rows = sorted(row for rank_rows, _ in gathered for row in rank_rows)  # pool order
        return PoolScores([pool[i] for i, _, _ in rows], [a for _, a, _ in rows], [e for _, _, e in rows]), \
            sum(t for _, t in gathered)


class Curriculum:
    """The prompt stream with a queue in front: `next()` serves the queued pool prompts first, then the plain
    stream; `refresh(step, model)` re-scores a pool when one is due and refills the queue."""

    def __init__(self, cfg: CurriculumSection, stream: ShuffledPrompts, scorer: PoolScorer, state: dict | None = None):
        self.cfg, self.stream, self.scorer = cfg, stream, scorer
        state = state or {}
        self.queue: list[int] = [int(i) for i in state.get("queue", [])]  # example indices still to serve
        self.next_rescore: int = int(state.get("next_rescore", 1))  # the step of the next re-scoring

    @property
    def position(self) -> int:
        """The plain stream's position (the checkpoint's data_position)."""
        return self.stream.position

    def next(self) -> int:
        return self.queue.pop(0) if self.queue else self.stream.next()

    def refresh(self, step: int, model) -> PoolReport | None:
        """At a due step: pool = the prompts still queued + fresh ones from the stream (pool_size in all),
        score it with the policy, queue what the mode selects. None when no re-scoring is due."""
        if step < self.next_rescore:
            return None
        t0 = time.perf_counter()
        fresh = max(0, self.cfg.pool_size - len(self.queue))
        pool = self.queue + [self.stream.next() for _ in range(fresh)]
        scores, tokens = self.scorer.score(model, pool, step)
        self.queue = select(scores, self.cfg)
        self.next_rescore = step + self.cfg.every
        return PoolReport(statistics.fmean(scores.accuracy), statistics.fmean(scores.entropy), len(self.queue),
                          tokens, time.perf_counter() - t0)

    def state_dict(self) -> dict:
        """JSON-friendly state for the trainer state (checkpoint/store.py)."""
        return {"queue": list(self.queue), "next_rescore": self.next_rescore}


def build_curriculum(cfg: Config, stream: ShuffledPrompts, tokenizer, task, examples: list[Example],
                     params: SamplingParams, world: World, state: dict | None = None) -> Curriculum | None:
    """The run's curriculum (None for curriculum.mode=none), restored from a checkpoint's `state`."""
    c = cfg.curriculum
    if c.mode == "none":
        return None
    scoring = replace(params, n=c.samples, max_new_tokens=c.max_new_tokens or params.max_new_tokens)
    chunk = max(1, cfg.rollout.prompts_per_step * cfg.rollout.group_size // c.samples)
    scorer = PoolScorer(tokenizer, task, examples, scoring, cfg.seed, cfg.rollout.max_prompt_tokens, chunk, world)
    return Curriculum(c, stream, scorer, state)
