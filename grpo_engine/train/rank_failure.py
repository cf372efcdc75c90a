"""Failing together: an error raised on one rank in a phase every rank runs in step (the rollout, the in-loop
eval, the curriculum's scoring) reaches every rank, so all stop at once with the same message.

Why: a rank that raised alone (NaN logits in its share of the rollout, a prompt too long for
rollout.max_prompt_tokens) left the others waiting in their next collective until
distributed.timeout_minutes, and their own error then named a timeout, not the cause.
"""

from __future__ import annotations

import contextlib
import sys

from .distributed import World


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
