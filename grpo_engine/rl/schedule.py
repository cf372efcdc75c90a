"""Learning-rate schedules: linear warmup, then constant or cosine decay; chosen by name."""

from __future__ import annotations

import math
from collections.abc import Callable


def _constant(progress: float, min_ratio: float) -> float:
    return 1.0


def _cosine(progress: float, min_ratio: float) -> float:
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


SCHEDULES: dict[str, Callable[[float, float], float]] = {"constant": _constant, "cosine": _cosine}


def lr_factor(step: int, *, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): warmup ramps 1/warmup ... 1."""
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return SCHEDULES[kind](progress, min_ratio)
