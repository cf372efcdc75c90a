"""`Kernels`: every product a model runs other than torch's own, in one typed value the model carries
(`Transformer.kernels`), with torch's products as the default.

Why one value: which GEMM, attention or packing is fastest depends on the machine and is measured by kernels/
(a `KernelPlan`), while the code that runs the products (the model's decode steps, rl/logprobs.py's chunked head,
rollout/'s decode loop, train/update.py's accumulation passes) sits left of kernels/ in the layer order and may
not import it. kernels.apply_kernels builds this value from the plan and sets `model.kernels`; the readers read
`model.kernels.<field>` and need no check whether a model went through apply_kernels: a model that did not carries
`Kernels()`, torch's products everywhere. The callables take the model or weight as an argument (no closure over
it), so a deep copy of the model (the KL reference) runs them on its own weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (grad_w [V, D], gz [n, V], h [n, D]) -> None: grad_w += gz^T h in place
Accumulate = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
# (q [B, H, 1, D], k, v [B, Hkv, S, D], mask [B, 1, 1, S] bool) -> [B, H, 1, D]: a decode step's attention
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# (q [B, H, T, D], k, v [B, Hkv, S, D], mask [B or 1, 1, T, S] bool, None: causal) -> [B, H, T, D]: the attention
# of a forward whose gradient is taken
TrainAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class HeadGemm:
    """The products of rl/logprobs.py's chunked head to run on a GEMM other than torch's; a field left None is
    torch's. `accepts` says which inputs the products take (oneDNN's: fp32 CPU matrices); other inputs run torch's
    products."""

    logits: Product | None = None  # (h [n, D], W [V, D]) -> a new [n, V] = h W^T; None: torch.mm into a reused buffer
    grad_input: Product | None = None  # (gz [n, V], W [V, D]) -> a new [n, D] = gz W; None: torch.mm
    grad_weight: Accumulate | None = None  # the weight gradient added into an fp32 grad_w; None: torch's addmm_
    accepts: Callable[[torch.Tensor, torch.Tensor], bool] | None = None  # (hidden, W) -> usable; None: any inputs


class PackedWeights(Protocol):
    """The weights one decode loop packed (kernels/packing.py DecodePacks): while it lasts, the packed
    projections serve their products without gradients, and `head` (None: not packed) the LM head's."""

    head: Callable[[torch.Tensor], torch.Tensor] | None  # hidden [A, D] -> logits [A, V]

    def resize(self, rows: int, steps_left: int) -> None:
        """The loop's batch now has `rows` rows and at most `steps_left` decode steps to go."""

    def release(self) -> None:
        """Unpack everything: the projections go back to their plain weights."""


@dataclass(frozen=True)
class DecodeKernels:
    """What a decode loop (rollout/decode_kernels.py) runs other than torch's products; a field left None is
    torch's way."""

    pack: Callable[[nn.Module, int, int], PackedWeights] | None = None  # (model, rows, steps) -> the loop's packs
    head: Product | None = None  # (h [A, D], W [V, D]) -> new [A, V]: the LM head at decode


class GemmPlan(Protocol):
    """Which GEMM runs each projection weight's products, by the weight's shape (kernels/select.py KernelPlan)."""

    def backend(self, weight_shape: tuple[int, ...]) -> str:
        """"onednn" | "torch": the forward's and the weight gradient's GEMM."""

    def grad_input_backend(self, weight_shape: tuple[int, ...]) -> str:
        """"onednn" | "torch": the GEMM of the gradient with respect to the input."""

    def grad_in_place(self, weight_shape: tuple[int, ...]) -> bool:
        """Whether the weight gradient is added straight into .grad (inside `WeightGradSwitch`)."""


class WeightGradSwitch:
    """One model's switch for in-place weight gradients: inside `switch(enabled)` the projections add the gradients
    of the weights their GemmPlan marks straight into .grad (kernels/onednn.py); outside, and with enabled=False
    (sharded training, which reduces gradients from autograd's hooks), autograd returns every weight gradient."""

    def __init__(self) -> None:
        self.enabled = False

    @contextlib.contextmanager
    def __call__(self, enabled: bool = True) -> Iterator[None]:
        before, self.enabled = self.enabled, enabled
        try:
            yield
        finally:
            self.enabled = before


@dataclass(frozen=True)
class Kernels:
    """The products a model runs, as kernels/ chose them for this machine (`Kernels()`: torch's everywhere).

    gemm: the GEMM each projection weight's products run on, by its shape: the KernelPlan (kernels/select.py)
        that the OneDNNLinear projections apply_kernels puts in place of the blocks' nn.Linear read through this
        value (kernels/onednn.py); None: torch's.
    decode_attention: the attention of a decode step (one new token per row), None for SDPA.
    train_attention: the attention of a forward of more than one token whose gradient is taken, None for SDPA.
    head: the chunked log-prob head's products (rl/logprobs.py), None for torch's.
    decode: the decode loop's packing and LM-head product.
    weight_grads_in_place: this model's switch, entered by the trainer's accumulation passes, inside which its
        projections add the planned weight gradients straight into .grad (enabled=False: autograd's way, as
        sharded training needs). Two models carry two switches, as they carry two plans.
    """

    gemm: GemmPlan | None = None
    decode_attention: DecodeAttention | None = None
    train_attention: TrainAttention | None = None
    head: HeadGemm | None = None
    decode: DecodeKernels = DecodeKernels()
    weight_grads_in_place: WeightGradSwitch = field(default_factory=WeightGradSwitch)


TORCH_KERNELS = Kernels()
