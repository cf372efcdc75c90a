"""Weights packed once for a decode loop: oneDNN's blocked layout, made per generate() call and dropped after it.

Why: a decode step multiplies a few dozen rows by every weight of the model, and a oneDNN product on a plain
weight first reorders that weight into its blocked layout, on every call. Over a decode loop the weights do not
change, so reordering each one once per loop saves that work on every step: on a 2-core AMD EPYC, 1.2-1.3x on the
products of 32 rows of a 135M model and its LM head (docs/benchmarks.md). Packing costs about one weight copy of
time and memory, so the kernel plan (select.py) measures, per weight shape, from how many decode steps it pays,
and a weight is packed only for loops at least that long. The packed product is timed against the weight's own
GEMM, whichever it is: a weight that runs on torch's GEMM in training (where oneDNN is no faster, as on some
Intel Xeon parts) is still packed for decoding where the packed oneDNN product beats torch's at decode size.

Memory: the packed copies live only during generation, and only weights that require gradients are packed: in
training their gradients, freed before the rollout, are at least as large as the copies, so packing does not
raise a step's peak. Frozen weights (LoRA bases, a reference model, a model loaded for `grpo eval`) are never
packed, so an inference-only process keeps one copy of its weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from . import onednn
from .select import shape_key


def _worth_packing(weight: torch.Tensor, steps: int) -> bool:
    """Whether the active plan packs this weight for a decode loop of `steps` steps."""
    plan = onednn.active_plan()
    fp32_cpu = weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
    if plan is None or not weight.requires_grad or not fp32_cpu:
        return False
    after = plan.decode_packing.get(shape_key(tuple(weight.shape)), 0)
    return 0 < after <= steps and onednn.pack_works()


@contextmanager
def packed_for_decode(model: nn.Module, rows: int, steps: int) -> Iterator[torch.Tensor | None]:
    """Pack the model's projections (and its LM head) for a decode loop of `steps` steps over about `rows`
    rows, where the active plan says it pays. Inside the block the projections use their packed weights whenever
    gradients are off; yields the packed LM-head weight, or None. Everything is unpacked on exit."""
    layers = [m for m in model.modules() if isinstance(m, onednn.OneDNNLinear) and _worth_packing(m.weight, steps)]
    head = getattr(model, "lm_head", None)
    try:
        for m in layers:
            m.packed = onednn.pack(m.weight, rows)
        pack_head = isinstance(head, nn.Linear) and head.bias is None and _worth_packing(head.weight, steps)
        yield onednn.pack(head.weight, rows) if pack_head else None
    finally:
        for m in layers:
            m.packed = None
