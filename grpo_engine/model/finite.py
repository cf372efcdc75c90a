"""Weights checked for NaN/inf once loaded, before `grpo eval`, `grpo generate` or `grpo export` uses them.

Why: `grpo train --resume` refuses a checkpoint whose weights hold NaN/inf in one line, but eval sampled from such
weights until the sampler's own guard stopped it with a NonFiniteLogits traceback, and generate and export used
them without a word (an exported .gguf of NaNs). One fused norm per tensor list finds them at a fraction of the
load's cost; a norm that is inf only because finite values overflow fp32 is confirmed tensor by tensor.
"""

from __future__ import annotations

import re
from itertools import chain
from pathlib import Path

import torch
from torch import nn

from .config import CheckpointError

STEP_DIR = re.compile(r"step-(\d+)")


def nonfinite_tensor(model: nn.Module) -> str | None:
    """The name of the first floating-point parameter or buffer holding NaN/inf, or None when all are finite."""
    named = [(n, t.detach()) for n, t in chain(model.named_parameters(), model.named_buffers())
             if t.is_floating_point() and t.numel()]
    if not named:
        return None
    norms = torch.stack([n.float() for n in torch._foreach_norm([t for _, t in named])])  # [tensors]
    suspects = (~torch.isfinite(norms)).nonzero().flatten().tolist()  # one host sync
    return next((named[i][0] for i in suspects if not bool(torch.isfinite(named[i][1]).all())), None)


def refuse_nonfinite(model: nn.Module, source: str | Path) -> None:
    """CheckpointError (one line, exit 2) when the weights loaded from `source` hold NaN/inf, naming the tensor and,
    for a checkpoint of a run, the newest earlier checkpoint to pass instead."""
    name = nonfinite_tensor(model)
    if name is None:
        return
    earlier = earlier_checkpoint(Path(source))
    fix = f"pass an earlier checkpoint instead, e.g. {earlier}" if earlier else \
        "pass a checkpoint or model whose weights are finite"
    raise CheckpointError(f"{source}: its weights hold NaN/inf ({name}): nothing was used; {fix}")


def earlier_checkpoint(source: Path) -> Path | None:
    """For RUN/checkpoints/step-N(/model): the newest RUN/checkpoints/step-M with M < N, else None."""
    step = source.parent if source.name == "model" else source
    match = STEP_DIR.fullmatch(step.name)
    if match is None or not step.parent.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in step.parent.iterdir()
             if p.is_dir() and (m := STEP_DIR.fullmatch(p.name)) and int(m.group(1)) < int(match.group(1))]
    return max(found)[1] if found else None
