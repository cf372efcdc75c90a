"""What a decode loop takes from kernels/ without importing it: weights packed for the loop, and the LM head's
product, read off the model's `Kernels` (`model.kernels.decode`, model/kernels_slot.py DecodeKernels).

Why handed in: whether packing a weight into a library's blocked layout pays over a decode loop, and which GEMM
runs the LM head at decode size, depend on the CPU and are measured by kernels/ (kernels.apply_kernels sets its
choices in `model.kernels`). A model whose kernels keep torch's way (CUDA, bf16, a plan that keeps everything on
torch, one never passed through apply_kernels) decodes on torch's products and packs nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ..model.kernels_slot import DecodeKernels, PackedWeights
from ..model.transformer import soft_cap

__all__ = ["DecodeHead", "DecodeKernels", "PackedWeights", "packed_for_decode"]


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
    pack = model.kernels.decode.pack
    packs = pack(model, rows, steps) if pack is not None else _Unpacked()
    try:
        yield packs
    finally:
        packs.release()


class DecodeHead:
    """The LM head at decode: its packed weight while the loop has one, the decode kernels' product where they
    have one (oneDNN on some fp32 CPUs), else torch.mm into one reused [rows, V] logits buffer.

    Why the buffer: a fresh [rows, V] tensor per step (19 MB for 32 rows of a Qwen vocabulary) is served by
    mmap and page-faulted in on every step, which can halve torch.mm's throughput (docs/benchmarks.md). oneDNN
    allocates its own output and is still faster than torch.mm into a buffer where the plan chose it.
    """

    def __init__(self, model: nn.Module, rows: int, packs: PackedWeights | None = None):
        self.weight, self.packs, self.rows = model.lm_head.weight, packs, rows  # [V, hidden]
        self.product = model.kernels.decode.head
        self.softcap = model.config.final_logit_softcapping  # the model's final-logit soft-capping, or None
        self.buf: torch.Tensor | None = None  # [rows, V], made at the first product that needs it

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, hidden] -> logits [A, V] (a view of the buffer, valid until the next call), soft-capped in
        place when the model caps its logits."""
        return soft_cap(self._product(hidden), self.softcap, inplace=True)

    def _product(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packs is not None and self.packs.head is not None:
            return self.packs.head(hidden)
        if self.product is not None:
            return self.product(hidden, self.weight)
        if self.buf is None:
            self.buf = torch.empty(self.rows, self.weight.shape[0], dtype=self.weight.dtype, device=self.weight.device)
        return torch.mm(hidden, self.weight.t(), out=self.buf[: hidden.shape[0]])
