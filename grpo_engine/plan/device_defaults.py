"""Memory settings left to the engine (memory.micro_batch_tokens = 0, memory.logprob_chunk_size = 0,
memory.activation_checkpointing = auto), resolved for the device a run trains on.

Why per device: a CPU step is bound by its matrix products at any micro-batch size, and small micro-batches keep
its RSS low; a GPU step is bound by kernel launches and host work unless each forward/backward sees thousands of
tokens, and the card's memory is what limits it. So for a card (memory.gpu_memory_gib, else the CUDA device's
own memory) the planner picks the least recompute (no checkpointing, then every second block, then every block)
whose largest fitting micro-batch holds at least GPU_GOOD_TOKENS tokens, with the largest log-prob chunk that
still fits. A setting the user wrote is kept as written.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..model.config import ModelConfig
from .memory import GIB, PlanInput, plan_memory, resolve_checkpointing

CPU_MICRO_BATCH_TOKENS = 1024  # the CPU defaults (docs/benchmarks.md: larger micro-batches are no faster there)
CPU_LOGPROB_CHUNK = 256
MICRO_BATCH_CHOICES = (32768, 16384, 8192, 4096, 2048, 1024, 512)  # tokens, largest first
CHUNK_CHOICES = (4096, 2048, 1024, 512, 256)
CHECKPOINTING_CHOICES = (("none", 2), ("every_k", 2), ("all", 1))  # least recompute first: (mode, k)
GPU_GOOD_TOKENS = 4096  # a micro-batch this large keeps a GPU busy; below it, recompute is the cheaper trade
GPU_HEADROOM = 0.75  # share of the card a plan may fill: the planner's error (measured peaks up to 12% above
#                     it, docs/memory.md), what it does not count (workspaces, captured graphs), a desktop's share


def update_mmap_choice(setting: str) -> str:
    """memory.cpu_update_mmap as the update runs it: `auto` is "false", the heap. Why not mmap by default: every
    mmapped buffer is page-faulted in anew, and what that costs depends on the host: a few percent of the step on
    one, a third more update time on another, for a few percent less peak RSS (docs/memory.md)."""
    return "false" if setting == "auto" else setting


@dataclass(frozen=True)
class MemoryChoice:
    micro_batch_tokens: int
    logprob_chunk_size: int
    activation_checkpointing: str  # none | all | every_k
    checkpoint_every: int
    planned_gib: float | None = None  # the planned peak on the card, None for a CPU run
    step_gib: float | None = field(default=None, compare=False)  # the same over the step's phases: not the eval
    #                                                               phase, which none of these settings changes

    def knobs(self, slots: int) -> dict:
        """The PlanInput fields this choice sets (slots: tokens of the longest row, prompt + completion)."""
        return {"micro_batch_rows": micro_batch_rows(self.micro_batch_tokens, slots),
                "logprob_chunk": self.logprob_chunk_size,
                "activation_checkpointing": self.activation_checkpointing, "checkpoint_every": self.checkpoint_every}


def micro_batch_rows(tokens: int, slots: int) -> int:
    """Rows of the longest length (`slots` tokens) a micro-batch of `tokens` holds, at least one: the planner's
    bound on train/batch.py micro_batches, which packs a step's rows by their own lengths."""
    return max(1, tokens // slots)


def memory_choice(model: ModelConfig | None, knobs: PlanInput | None, memory, card_gib: float | None) -> MemoryChoice:
    """The memory settings of a run: `memory` is the config's memory section (0 / "auto" = left to the engine),
    `knobs` the rest of the step's plan, card_gib None for a CPU run."""
    if card_gib is None:  # the CPU defaults; checkpointing by the planner's rule (no shape known: none)
        tokens, mode = memory.micro_batch_tokens or CPU_MICRO_BATCH_TOKENS, memory.activation_checkpointing
        if mode == "auto":
            mode = resolve_checkpointing(model, knobs, tokens) if model is not None else "none"
        return MemoryChoice(tokens, memory.logprob_chunk_size or CPU_LOGPROB_CHUNK, mode, memory.checkpoint_every)
    modes = CHECKPOINTING_CHOICES if memory.activation_checkpointing == "auto" else (
        (memory.activation_checkpointing, memory.checkpoint_every),)
    good = min(GPU_GOOD_TOKENS, memory.micro_batch_tokens or MICRO_BATCH_CHOICES[0])
    best = None
    for mode, every in modes:
        found = _largest_fitting(model, knobs, memory, card_gib * GPU_HEADROOM, mode, every)
        if found is not None and (best is None or found.micro_batch_tokens > best.micro_batch_tokens):
            best = found
        if best is not None and best.micro_batch_tokens >= good:
            break
    if best is None:  # nothing fits: the leanest settings (with gpu_memory_gib set, `grpo train` then refuses)
        mode, every = modes[-1]
        best = _choice(model, knobs, memory.micro_batch_tokens or MICRO_BATCH_CHOICES[-1],
                       memory.logprob_chunk_size or CHUNK_CHOICES[-1], mode, every)
    return best


def _largest_fitting(model: ModelConfig, knobs: PlanInput, memory, budget_gib: float, mode: str,
                     every: int) -> MemoryChoice | None:
    """The largest micro-batch, then chunk, whose planned peak is within budget_gib (None if none is)."""
    for tokens in (memory.micro_batch_tokens,) if memory.micro_batch_tokens else MICRO_BATCH_CHOICES:
        for chunk in (memory.logprob_chunk_size,) if memory.logprob_chunk_size else CHUNK_CHOICES:
            choice = _choice(model, knobs, tokens, chunk, mode, every)
            if choice.step_gib <= budget_gib:  # an evaluation larger than the card is check_memory_fits' to refuse
                return choice
    return None


def _choice(model: ModelConfig, knobs: PlanInput, tokens: int, chunk: int, mode: str, every: int) -> MemoryChoice:
    choice = MemoryChoice(tokens, chunk, mode, every)
    plan = plan_memory(model, dataclasses.replace(knobs, **choice.knobs(knobs.prompt_len + knobs.completion_len)))
    step = max(p.total for p in plan.phases if p.name != "eval")
    k = plan.knobs
    return dataclasses.replace(choice, planned_gib=plan.total_gib,
                               step_gib=(step * (1 + k.fragmentation) + k.cuda_context_gib * GIB) / GIB)
