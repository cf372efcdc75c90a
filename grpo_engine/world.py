"""This process's place among the ranks (`World`: rank, size, the collectives the engine uses), and failing
together.

Failing together: an error raised on one rank in a phase every rank runs in step (the rollout, the in-loop
eval, the curriculum's scoring) reaches every rank, so all stop at once with the same message.

Why: a rank that raised alone (NaN logits in its share of the rollout, a prompt too long for
rollout.max_prompt_tokens) left the others waiting in their next collective until
distributed.timeout_minutes, and their own error then named a timeout, not the cause.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class World:
    """This process's place among the ranks (size 1: a single process, every collective a no-op)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    strategy: str = "none"  # none | ddp | fsdp2
    grad_scale: float = 1.0  # fsdp2: what the reduce-scatter's result is multiplied by to be the sum

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def max(self, value: int) -> int:
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is True on some rank: what all must act on together (a stop signal
        that reached one rank first: a rank that stopped alone would leave the others in a collective)."""
        return self.max(int(flag)) > 0

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (plain Python data between our own ranks)."""
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def my_share(self, count: int) -> range:
        """This rank's slice of `count` items split evenly in rank order (count % size == 0 is checked)."""
        per = count // self.size
        return range(self.rank * per, (self.rank + 1) * per)


def on_main_first(world: World, make):
    """Rank 0 runs `make()` (e.g. the warm start writing run_dir/base and sft/), then every other rank runs it,
    finding the result complete on disk; returns its value on every rank."""
    if world.is_main:
        value = make()
        world.barrier()
        return value
    world.barrier()
    return make()


class RankFailed(RuntimeError):
    """Another rank failed with an error whose type cannot be rebuilt here from its message alone."""


@contextlib.contextmanager
def fail_together(world: World, phase: str):
    """Run the block, then let the ranks agree (one all-reduce) on whether it raised on any of them. If it did,
    every rank raises the same error: the first failing rank's type when it can be made from a message (e.g.
    NonFiniteLogits, which the training loop reports with the last checkpoint), else RankFailed, with a message
    naming each failing rank and its error. A single process gets its error unchanged.

    The block must run no collective after the point where it may raise: a rank that raised skips it."""
    error: Exception | None = None
    try:
        yield
    except Exception as e:
        if world.size == 1:
            raise
        error = e
    if not world.any(error is not None):
        return
    mine = None if error is None else (world.rank, type(error).__module__, type(error).__qualname__, str(error))
    failures = [f for f in world.gather(mine) if f is not None]  # every rank's, in rank order
    raise rebuild_failure(failures, phase) from error


def rebuild_failure(failures: list[tuple[int, str, str, str]], phase: str) -> Exception:
    """failures: (rank, type's module, type's qualified name, message) of each failing rank -> the error to raise."""
    message = "; ".join(f"rank {rank} failed in the {phase}: {text}" for rank, _, _, text in failures)
    _, module, name, _ = failures[0]
    cls = sys.modules.get(module)  # the same program runs on every rank: the failing type's module is loaded
    for part in name.split("."):
        cls = getattr(cls, part, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(message)
        except Exception:  # a constructor that wants more than a message (e.g. UnicodeDecodeError)
            pass
    return RankFailed(f"{message} ({name})")
