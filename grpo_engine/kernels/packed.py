"""A weight reordered once for the products of a decode loop, by oneDNN or by MKL: whichever the kernel plan
measured faster for its shape on this machine (kernels/select.py `measure_packing`).

Why two: both libraries reorder a weight into a blocked layout that their small-row products read faster than a plain
weight, and which is faster depends on the CPU (docs/benchmarks.md). MKL's packed layout is made for one row count: a
product with any other count runs on the plain weight instead, so a decode loop whose batch shrinks repacks its MKL
weights (packing.DecodePacks.resize). Both pack fp32 weights: the products agree with torch.mm to fp32 rounding. oneDNN
packs bf16 weights too (MKL's packed GEMM is fp32 only), for AMX or AVX512_BF16, where its packed bf16 products can beat
torch's bf16 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import onednn

KINDS = ("onednn", "mkl")
_works: dict[tuple[str, torch.dtype], bool] = {}


@dataclass(frozen=True)
class PackedWeight:
    """weight [N, K] packed for products of `rows` rows; called like F.linear without the weight. No autograd."""

    kind: str  # "onednn" | "mkl"
    data: torch.Tensor  # the opaque packed buffer, valid only while `weight` is unchanged
    weight: torch.Tensor  # [N, K]: MKL's product needs it (and uses it for any row count but `rows`)
    rows: int

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # [M, K] -> [M, N]
        if self.kind == "mkl":
            return torch.ops.mkl._mkl_linear(x, self.data, self.weight, bias, self.rows)
        return onednn.packed_linear(x, self.data, bias)


def pack(weight: torch.Tensor, rows: int, kind: str) -> PackedWeight:
    """weight [N, K] (fp32 CPU; bf16 for oneDNN) packed by `kind` for products of about `rows` rows (exactly `rows`
    for MKL)."""
    w = weight.detach()
    data = torch.ops.mkl._mkl_reorder_linear_weight(w, rows) if kind == "mkl" else onednn.pack(w, rows)
    return PackedWeight(kind, data, w, rows)


def works(kind: str, dtype: torch.dtype = torch.float32) -> bool:
    """One-time check that `kind` can pack weights of `dtype` here and its packed products match torch.mm
    (oneDNN: onednn.pack_works; MKL: fp32 only, the op exists in this torch build, e.g. not on ARM, and is right on a
    small problem)."""
    if (kind, dtype) not in _works:
        if kind == "onednn":
            _works[kind, dtype] = onednn.pack_works(dtype)
        else:
            _works[kind, dtype] = (dtype == torch.float32 and onednn.op_works() and torch.backends.mkl.is_available()
                                   and onednn.matches_mm(lambda x, w: pack(w, 3, kind)(x)))
    return _works[kind, dtype]


def available(dtype: torch.dtype = torch.float32) -> list[str]:
    """The kinds that pack weights of `dtype` here, oneDNN first; MKL is offered only beside oneDNN (GRPO_ONEDNN=0
    packs nothing)."""
    return [k for k in KINDS if works(k, dtype)] if works("onednn", dtype) else []
