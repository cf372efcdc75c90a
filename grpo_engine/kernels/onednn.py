"""x @ W^T through oneDNN on the CPU: `linear` for the LM head, `OneDNNLinear` for the projections.

Why: on some CPUs (seen on AMD EPYC with AVX-512, docs/benchmarks.md) torch's default fp32 GEMM (MKL) runs at
about half the rate of oneDNN's, for the LM head at decode and in the log-prob head as for the transformer's
projections and both their gradients; on others (Intel Xeon) the two are level. Both are fp32 GEMMs (no
reduced-precision math): results agree with torch.mm to fp32 rounding (~1e-6).

`torch.ops.mkldnn._linear_pointwise` is the op torch.compile's CPU backend emits for nn.Linear; it is not a
public API, so `linear` probes it once (same result as torch.mm on a small problem) and falls back to
torch.mm whenever it is missing, fails, or the inputs are not fp32 CPU tensors. GRPO_ONEDNN=0 turns it off.

Which weights use it is decided per weight shape by a measured `KernelPlan` (kernels/select.py) once one is
active; before that, by a size threshold.

`pack` reorders a weight into oneDNN's blocked layout once, so that the products of a decode loop (same weights,
a few dozen rows, every step) skip the reorder oneDNN otherwise does on every call; kernels/packing.py decides
when that pays.
"""

from __future__ import annotations

import os

import torch

_state: dict[str, bool] = {}
_active: dict[str, object] = {}  # {"plan": KernelPlan} once kernels.activate(plan) ran


def op_works() -> bool:
    """One-time check that the op exists and matches torch.mm on a small fp32 problem."""
    if "ok" not in _state:
        ok = os.environ.get("GRPO_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
        if ok:
            try:
                g = torch.Generator().manual_seed(0)
                x, w = torch.randn(3, 16, generator=g), torch.randn(40, 16, generator=g)
                y = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                ok = bool(torch.allclose(y, x @ w.t(), rtol=1e-5, atol=1e-5))
            except (RuntimeError, AttributeError):
                ok = False
        _state["ok"] = ok
    return _state["ok"]


MIN_WEIGHT_NUMEL = 1 << 18  # without a plan: below ~1 MB of weight the call overhead wins


def chosen_for(weight: torch.Tensor) -> bool:
    """The active plan's choice for this weight's shape; without a plan, a size threshold."""
    plan = active_plan()
    if plan is None:
        return weight.numel() >= MIN_WEIGHT_NUMEL
    return plan.backend(tuple(weight.shape)) == "onednn"


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `linear(x, weight)` will run on oneDNN: fp32 CPU matrices, a working op, chosen for the shape."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.dim() == weight.dim() == 2
            and op_works() and chosen_for(weight))


def active_plan():
    """The kernels.select.KernelPlan that `activate` made active, or None (the size threshold decides)."""
    return _active.get("plan")


def activate(plan) -> None:
    """Make `plan` (a kernels.select.KernelPlan, or None for the size threshold) decide every product."""
    _active["plan"] = plan


def _op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T on oneDNN, unconditionally (for measuring it)."""
    return _op(x, weight)


def pack_works() -> bool:
    """One-time check that weights can be packed (`pack`) and their products match torch.mm."""
    if "pack" not in _state:
        ok = op_works()
        if ok:
            try:
                g = torch.Generator().manual_seed(0)
                x, w = torch.randn(3, 16, generator=g), torch.randn(40, 16, generator=g)
                ok = bool(torch.allclose(packed_linear(x, pack(w, 3)), x @ w.t(), rtol=1e-5, atol=1e-5))
            except (RuntimeError, AttributeError):
                ok = False
        _state["pack"] = ok
    return _state["pack"]


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight [N, K] (fp32 CPU) -> the same values in oneDNN's blocked layout for products of about `rows` rows:
    a new opaque tensor of about the weight's size, valid only for `packed_linear` and only while the weight is
    unchanged."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) for a weight packed by `pack` -> a new [M, N] tensor. No autograd."""
    return _op(x, packed, bias)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> a new [M, N] tensor (weight may be a transposed view). No autograd."""
    if applies(x, weight):
        return _op(x, weight)
    return x @ weight.t()


class _LinearFn(torch.autograd.Function):
    """y = x W^T + b with all three products (forward, grad-input, grad-weight) on oneDNN."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # x [M, K], weight [N, K], bias [N] | None -> [M, N]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _op(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_y):  # [M, N]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = _op(grad_y, weight.t()) if need_x else None  # [M, N] @ [N, K]
        grad_w = _op(grad_y.t(), x.t()) if need_w else None  # [N, M] @ [M, K]
        grad_b = grad_y.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b


class OneDNNLinear(torch.nn.Linear):
    """nn.Linear (same parameters, state dict and LoRA targeting) whose fp32 CPU products use oneDNN when the
    weight is big enough to gain; anything else (CUDA, bf16, tiny weights, no oneDNN) is nn.Linear itself.
    `kernels.apply_kernels` turns a model's nn.Linear projections into this class in place. Inside a decode loop
    `packed` holds the weight packed by `pack` (kernels/packing.py sets and clears it), used without gradients."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        x2 = x.reshape(-1, x.shape[-1])  # [M, in]
        if self.packed is not None and not torch.is_grad_enabled():
            return packed_linear(x2, self.packed, self.bias).view(*x.shape[:-1], self.out_features)
        if not applies(x2, self.weight):
            return super().forward(x)
        return _LinearFn.apply(x2, self.weight, self.bias).view(*x.shape[:-1], self.out_features)
