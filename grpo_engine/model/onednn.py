"""x @ W^T through oneDNN on the CPU, for the two places where one matmul dominates: the LM head.

Why: on this project's CPU machine (AMD EPYC, AVX-512) torch's default fp32 GEMM (MKL) runs at about half the
rate of oneDNN's for the LM head's shapes -- [32, 512] x [512, 151,936] at decode: 45 ms vs 21 ms per step;
[256, 151,936] x [151,936, 512] (a gradient in the log-prob head): 219 ms vs 99 ms (docs/benchmarks.md).
Both are fp32 GEMMs (no reduced-precision math): results agree with torch.mm to fp32 rounding (~1e-6).

`torch.ops.mkldnn._linear_pointwise` is the op torch.compile's CPU backend emits for nn.Linear; it is not a
public API, so `linear` probes it once (same result as torch.mm on a small problem) and falls back to
torch.mm whenever it is missing, fails, or the inputs are not fp32 CPU tensors. Set GRPO_ONEDNN=0 to turn it
off (e.g. to compare).
"""

from __future__ import annotations

import os

import torch

_state: dict[str, bool] = {}


def _onednn_works() -> bool:
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


MIN_WEIGHT_NUMEL = 1 << 20  # below ~4 MB of weight the call overhead wins (tiny models: torch.mm is faster)


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `linear(x, weight)` will run on oneDNN: fp32 CPU matrices, a big weight, a working op."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.dim() == weight.dim() == 2
            and weight.numel() >= MIN_WEIGHT_NUMEL and _onednn_works())


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> a new [M, N] tensor (weight may be a transposed view). No autograd."""
    if applies(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return x @ weight.t()
