"""CPU/GPU kernel choices and memory transforms, applied to a model from outside (the model file is
architecture only): oneDNN GEMMs for fp32 CPU projections and the decode-step attention (`apply_kernels`),
activation checkpointing (`apply_activation_checkpointing`), and the GEMM the LM-head code calls (`gemm.linear`)."""

import torch
from torch import nn

from .attention import KERNELS as ATTENTION_KERNELS
from .checkpointing import apply_activation_checkpointing, checkpointed_blocks
from .onednn import OneDNNLinear, activate
from .select import (
    PLAN_FILE,
    KernelPlan,
    attention_shape,
    bf16_slowdown,
    choose_plan,
    cpu_model,
    load_plan,
    measured_here,
)


def apply_kernels(model: nn.Module, plan: KernelPlan | None = None) -> nn.Module:
    """Make `plan` (default: measured or cached for this model on this machine) decide which GEMM runs each
    weight shape, which attention a decode step uses and how many threads torch uses, and turn the nn.Linear
    projections of every block into OneDNNLinear (same parameters and names), which follows the plan; on CUDA
    or in bf16 OneDNNLinear is nn.Linear itself. Returns the model."""
    plan = plan if plan is not None else choose_plan(model)
    activate(plan)
    if plan.threads != torch.get_num_threads():
        torch.set_num_threads(plan.threads)
    key = attention_shape(model)  # the head shape and dtype the plan's decode attention was timed at
    for block in model.layers:
        for module in block.modules():
            if type(module) is nn.Linear:
                module.__class__ = OneDNNLinear
        block.attn.decode_attention = ATTENTION_KERNELS.get(plan.attention.get(key, "sdpa"))
    return model


__all__ = ["PLAN_FILE", "KernelPlan", "OneDNNLinear", "activate", "apply_activation_checkpointing", "apply_kernels",
           "bf16_slowdown", "checkpointed_blocks", "choose_plan", "cpu_model", "load_plan", "measured_here"]
