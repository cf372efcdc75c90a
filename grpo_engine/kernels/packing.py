"""Weights packed once for a decode loop: oneDNN's or MKL's blocked layout (kernels/packed.py), made per generate()
call and dropped after it.

Why: a decode step multiplies a few dozen rows by every weight of the model, and a oneDNN product on a plain weight
first reorders that weight into its blocked layout, on every call. Over a decode loop the weights do not change, so
reordering each one once per loop saves that work on every step (docs/benchmarks.md). Packing costs about one weight
copy of time and memory, so the kernel plan (select.py) measures, per weight shape, from how many decode steps it pays,
and a weight is packed only for loops at least that long, by the kind whose packed product was faster. The packed
product is timed against the weight's own GEMM, whichever it is: a weight that runs on torch's GEMM in training (where
oneDNN is no faster, as on some Intel Xeon parts) is still packed for decoding where a packed product beats torch's at
decode size.

Memory: the packed copies live only during generation, and only weights that require gradients are packed: in
training their gradients, freed before the rollout, are at least as large as the copies, so packing does not
raise a step's peak. Frozen weights (LoRA bases, a reference model, a model loaded for `grpo eval`) are never
packed, so an inference-only process keeps one copy of its weights.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from ..model.kernels_slot import DecodeKernels
from . import onednn, packed
from .packed import PackedWeight
from .select import KernelPlan, packing_key


def _pack_if_pays(weight: torch.Tensor, rows: int, steps: int, plan: KernelPlan) -> PackedWeight | None:
    """`weight` packed for `rows` rows by the kind `plan` chose, when packing it pays within `steps` decode steps
    (the plan's steps for its shape, 0 = never); else None."""
    if not (weight.requires_grad and weight.device.type == "cpu" and weight.dim() == 2):
        return None
    shape, dtype = tuple(weight.shape), weight.dtype
    after, kind = plan.decode_packing.get(packing_key(shape, dtype), 0), plan.pack_kind(shape, dtype)
    return packed.pack(weight, rows, kind) if 0 < after <= steps and packed.works(kind, dtype) else None


class DecodePacks:
    """The packed weights of one decode loop: each planned projection's `packed` attribute and the LM head's.

    resize() follows the loop's batch when finished rows leave it: MKL's layout holds for one row count only, so
    its weights are repacked for the new count while enough steps remain for that to pay, and otherwise dropped
    (their products go back to the plan's GEMM); oneDNN's serve any row count and stay. Made by the decode loop
    (rollout/decode_kernels.py) through the `pack` of the DecodeKernels that planned_decode_kernels made."""

    def __init__(self, model: nn.Module, rows: int, steps: int, plan: KernelPlan):
        self.plan = plan
        self.modules: list[onednn.OneDNNLinear] = []
        for m in model.modules():
            p = _pack_if_pays(m.weight, rows, steps, plan) if isinstance(m, onednn.OneDNNLinear) else None
            if p is not None:
                m.packed = p
                self.modules.append(m)
        head = model.lm_head
        self.head_weight = head.weight if isinstance(head, nn.Linear) and head.bias is None else None  # [V, hidden]
        self.head = _pack_if_pays(self.head_weight, rows, steps, plan) if self.head_weight is not None else None

    def resize(self, rows: int, steps_left: int) -> None:
        """The batch now has `rows` rows and at most `steps_left` decode steps to go."""
        for m in self.modules:
            m.packed = _repacked(m.packed, m.weight, rows, steps_left, self.plan)
        self.modules = [m for m in self.modules if m.packed is not None]
        self.head = _repacked(self.head, self.head_weight, rows, steps_left, self.plan)

    def release(self) -> None:
        for m in self.modules:
            m.packed = None
        self.modules, self.head = [], None


def _repacked(p: PackedWeight | None, weight: torch.Tensor, rows: int, steps_left: int,
              plan: KernelPlan) -> PackedWeight | None:
    """p, or for an MKL pack of another row count: `weight` packed for `rows` if that pays in `steps_left` steps."""
    if p is None or p.kind != "mkl" or p.rows == rows:
        return p
    return _pack_if_pays(weight, rows, steps_left, plan)


def planned_decode_kernels(plan: KernelPlan, model: nn.Module) -> DecodeKernels:
    """What a decode loop of `model` takes from `plan` (rollout/decode_kernels.py): packing where the plan has a
    weight that packing pays for, and oneDNN's product for the LM head at decode where the plan runs the head's
    weight on oneDNN (an fp32 CPU matrix, the op working here); torch's way (`DecodeKernels()`) when neither.
    kernels.apply_kernels sets it as `model.kernels.decode`."""
    head = model.lm_head
    w = head.weight if isinstance(head, nn.Linear) else None  # [V, hidden]
    on_onednn = (w is not None and onednn.fp32_cpu_matrices(w, w) and onednn.op_works()
                 and plan.backend(tuple(w.shape)) == "onednn")
    pack = partial(DecodePacks, plan=plan) if any(v > 0 for v in plan.decode_packing.values()) else None
    return DecodeKernels(pack=pack, head=onednn.fp32_linear if on_onednn else None)
