"""CPU/GPU kernel choices and memory transforms, applied to a model from outside (the model file is
architecture only): oneDNN GEMMs for fp32 CPU projections and the decode-step attention, the LM head's GEMMs for
the log-prob head (rl/logprobs.py HeadGemm) and for decoding, and the weights a decode loop packs
(rollout/decode_kernels.py DecodeKernels) (`apply_kernels`); activation checkpointing
(`apply_activation_checkpointing`)."""

import torch
from torch import nn

from .attention import decode_attention_for
from .checkpointing import apply_activation_checkpointing, checkpointed_blocks
from .onednn import OneDNNLinear, activate, planned_head_gemm, weight_grads_in_place
from .packing import planned_decode_kernels
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
    or in bf16 OneDNNLinear is nn.Linear itself. The LM head's GEMMs reach the code that calls it as attributes:
    model.lm_head.head_gemm (rl.logprobs.head_gemm reads it) and model.decode_kernels (the decode loops' packing
    and head product), each None where the plan keeps torch's products; model.weight_grads_in_place is the
    context in which train/update.py's passes accumulate the planned weight gradients in place. On CUDA, decode
    steps with grouped KV heads run the grouped attention whatever the plan (kernels/attention.py). Returns the
    model."""
    plan = plan if plan is not None else choose_plan(model)
    activate(plan)
    if plan.threads != torch.get_num_threads():
        torch.set_num_threads(plan.threads)
    key, c = attention_shape(model), model.config  # key: the head shape and dtype the plan's attention was timed at
    decode_attention = decode_attention_for(model.device.type, c.num_attention_heads, c.num_key_value_heads,
                                            plan.attention.get(key, "sdpa"))
    for block in model.layers:
        for module in block.modules():
            if type(module) is nn.Linear:
                module.__class__ = OneDNNLinear
        block.attn.decode_attention = decode_attention
    model.lm_head.head_gemm = planned_head_gemm(plan, model.lm_head.weight)
    model.decode_kernels = planned_decode_kernels(plan, model)
    model.weight_grads_in_place = weight_grads_in_place  # the trainer's accumulation passes enter it
    return model


__all__ = ["PLAN_FILE", "KernelPlan", "OneDNNLinear", "activate", "apply_activation_checkpointing", "apply_kernels",
           "bf16_slowdown", "checkpointed_blocks", "choose_plan", "cpu_model", "load_plan", "measured_here"]
