"""CPU/GPU kernel choices and memory transforms, applied to a model from outside (the model file is
architecture only): oneDNN GEMMs for fp32 CPU projections (`apply_kernels`), activation checkpointing
(`apply_activation_checkpointing`), and the GEMM the LM-head code calls (`gemm.linear`)."""

from torch import nn

from .checkpointing import apply_activation_checkpointing, checkpointed_blocks
from .onednn import OneDNNLinear


def apply_kernels(model: nn.Module) -> nn.Module:
    """Turn the nn.Linear projections of every block into OneDNNLinear (same parameters and names); on CUDA,
    in bf16, or for small weights OneDNNLinear behaves exactly as nn.Linear. Returns the model."""
    for block in model.layers:
        for module in block.modules():
            if type(module) is nn.Linear:
                module.__class__ = OneDNNLinear
    return model


__all__ = ["OneDNNLinear", "apply_activation_checkpointing", "apply_kernels", "checkpointed_blocks"]
