"""What a decode loop takes from kernels/ without importing it: weights packed for the loop, and the LM head's
product, read off the model (`decode_kernels(model)`).

Why handed in: whether packing a weight into a library's blocked layout pays over a decode loop, and which GEMM
runs the LM head at decode size, depend on the CPU and are measured by kernels/ (kernels.apply_kernels attaches its
choices to the model as `decode_kernels`). A model without them (CUDA, bf16, a plan that keeps everything on torch,
one never passed through apply_kernels) decodes on torch's products and packs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


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
    """kernels/'s choices for decoding a model; a field left None is torch's way. The callables take the model or
    weight as an argument (no closure over it), so a copied model (the KL reference) uses its own weights."""

    pack: Callable[[nn.Module, int, int], PackedWeights] | None = None  # (model, rows, steps) -> the loop's packs
    head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (h [A, D], W [V, D]) -> new [A, V]


NO_DECODE_KERNELS = DecodeKernels()


def decode_kernels(model: nn.Module) -> DecodeKernels:
    """The decode kernels kernels.apply_kernels attached to `model` (its `decode_kernels` attribute), or none."""
    return getattr(model, "decode_kernels", None) or NO_DECODE_KERNELS


class _Unpacked:
    """The packs of a model with nothing to pack."""

    head = None

    def resize(self, rows: int, steps_left: int) -> None:
        pass

    def release(self) -> None:
        pass


@contextmanager
def packed_for_decode(model: nn.Module, rows: int, steps: int) -> Iterator[PackedWeights]:
    """The model's weights packed (where its decode kernels say it pays) for a decode loop of `steps` steps over
    `rows` rows; unpacked on exit."""
    pack = decode_kernels(model).pack
    packs = pack(model, rows, steps) if pack is not None else _Unpacked()
    try:
        yield packs
    finally:
        packs.release()


class DecodeHead:
    """The LM head at decode: its packed weight while the loop has one, the decode kernels' product where they
    have one (oneDNN on some fp32 CPUs), else torch.mm into one reused [rows, V] logits buffer.

    Why the buffer: a fresh [rows, V] tensor per step (19 MB for 32 rows of a Qwen vocabulary) is served by
    mmap and page-faulted in on every step; on the 2-core CPU machine that halved torch.mm's throughput.
    oneDNN allocates its own output and is still about 2x faster than torch.mm into a buffer there.
    """

    def __init__(self, model: nn.Module, rows: int, packs: PackedWeights | None = None):
        self.weight, self.packs, self.rows = model.lm_head.weight, packs, rows  # [V, hidden]
        self.product = decode_kernels(model).head
        self.buf: torch.Tensor | None = None  # [rows, V], made at the first product that needs it

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, hidden] -> logits [A, V] (a view of the buffer, valid until the next call)."""
        if self.packs is not None and self.packs.head is not None:
            return self.packs.head(hidden)
        if self.product is not None:
            return self.product(hidden, self.weight)
        if self.buf is None:
            self.buf = torch.empty(self.rows, self.weight.shape[0], dtype=self.weight.dtype, device=self.weight.device)
        return torch.mm(hidden, self.weight.t(), out=self.buf[: hidden.shape[0]])
