"""NF4 storage of a frozen base weight for QLoRA: the torchao and bitsandbytes backends (CUDA only, imported lazily).

Each backend maps a weight [out, in] to (quantized weight, forward fn (x, qw) -> x @ W^T, dequantize fn qw -> W).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ..config.training import LoRAConfig

NF4_BLOCK = 64  # weights per 4-bit block, each with its own absmax scale (QLoRA's block size)


def nf4_scaler_block(numel: int) -> int:
    """Blocks per group of the double-quantized scales for a weight of `numel` values.

    QLoRA groups 256 block scales; torchao needs the group to divide the weight's block count, which a small or
    oddly shaped weight (64 x 64: 64 blocks) does not give. Then the largest power of two that divides it.
    """
    if numel % NF4_BLOCK:
        raise ValueError(
            f"NF4 quantizes blocks of {NF4_BLOCK} values; a weight of {numel} values has a partial block. "
            "Set lora.quantize_base=none (plain LoRA) for this model."
        )
    return math.gcd(numel // NF4_BLOCK, 256)


def _nf4_torchao(w: torch.Tensor):
    try:  # torchao >= 0.15 keeps NF4 under quantization/
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4, to_nf4
    except ImportError:
        from torchao.dtypes.nf4tensor import linear_nf4, to_nf4

    q = to_nf4(w.detach().to(torch.bfloat16), block_size=NF4_BLOCK, scaler_block_size=nf4_scaler_block(w.numel()))
    return q, lambda x, qw: linear_nf4(x, qw), lambda qw: qw.get_original_weight()


def _nf4_bitsandbytes(w: torch.Tensor):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    q, state = bnbf.quantize_4bit(w.detach().to(torch.bfloat16), blocksize=NF4_BLOCK, quant_type="nf4",
                                  compress_statistics=True)
    return (
        q,
        lambda x, qw: bnb.matmul_4bit(x, qw.t(), quant_state=state),
        lambda qw: bnbf.dequantize_4bit(qw, state),
    )


NF4_BACKENDS: dict[str, Callable] = {"torchao": _nf4_torchao, "bitsandbytes": _nf4_bitsandbytes}


def nf4_unavailable_reason(backend: str, device: torch.device) -> str | None:
    """None when `backend` can quantize on `device`; otherwise why not (names the missing piece)."""
    if device.type != "cuda":
        return f"NF4 needs a CUDA device, the model is on {device.type}"
    try:
        __import__(backend)  # each backend is named for the package it needs
    except ImportError:
        return f"{backend} is not installed (pip install {backend})"
    return None


def choose_nf4_backend(cfg: LoRAConfig, device: torch.device) -> tuple[str | None, str]:
    """(backend name or None, reasons it could not be used) for cfg.quant_backend on `device`."""
    names = list(NF4_BACKENDS) if cfg.quant_backend == "auto" else [cfg.quant_backend]
    reasons = []
    for name in names:
        why = nf4_unavailable_reason(name, device)
        if why is None:
            return name, ""
        reasons.append(f"{name}: {why}")
    return None, "; ".join(reasons)
