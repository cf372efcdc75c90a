"""CPU/GPU kernel choices and memory transforms, applied to a model from outside (the model file is
architecture only): oneDNN GEMMs for fp32 CPU projections and the decode-step attention, the LM head's GEMMs for
the log-prob head and for decoding, the weights a decode loop packs and the in-place weight gradients, all set in
the model's one `Kernels` value (model/kernels_slot.py) by `apply_kernels`; activation checkpointing
(`apply_activation_checkpointing`)."""

import torch

from ..model.kernels_slot import Kernels
from ..model.transformer import Transformer
from .attention import decode_attention_for, train_attention_for
from .checkpointing import apply_activation_checkpointing, checkpointed_blocks
from .onednn import OneDNNLinear, planned_head_gemm, use_onednn_projections
from .packing import planned_decode_kernels
from .select import (
    PLAN_FILE,
    KernelPlan,
    attention_shape,
    bf16_ratio,
    choose_plan,
    cpu_model,
    load_plan,
    measured_here,
)


def apply_kernels(model: Transformer, plan: KernelPlan | None = None) -> Transformer:
    """Make `plan` (default: measured or cached for this model on this machine) decide which GEMM runs each
    weight shape, which attention a decode step and a forward with a gradient use and how many threads torch uses:
    every block's nn.Linear projections are replaced by OneDNNLinear modules holding the same parameters (same
    tensors, names and state dict), which follow the plan (on CUDA or in bf16 they are nn.Linear itself), and
    `model.kernels` becomes the plan's `Kernels` (model/kernels_slot.py), which the model's decode steps and
    forwards, rl/'s log-prob head, rollout/'s decode loop and train/update.py's accumulation passes read. On CUDA,
    decode steps with grouped KV heads run the grouped attention whatever the plan, and forwards with a gradient
    SDPA (kernels/attention.py). Returns the model."""
    plan = plan if plan is not None else choose_plan(model)
    if plan.threads != torch.get_num_threads():
        torch.set_num_threads(plan.threads)
    model.kernels = planned_kernels(plan, model)
    for block in model.layers:
        use_onednn_projections(block, model.kernels)
    return model


def planned_kernels(plan: KernelPlan, model: Transformer) -> Kernels:
    """The products `plan` chose for `model` on this machine, torch's where it keeps them."""
    key, c = attention_shape(model), model.config  # key: the head shape and dtype the plan's attention was timed at
    return Kernels(
        gemm=plan,
        decode_attention=decode_attention_for(model.device.type, c.num_attention_heads, c.num_key_value_heads,
                                              plan.attention.get(key, "sdpa")),
        train_attention=train_attention_for(model.device.type, plan.train_attention.get(key, "sdpa")),
        head=planned_head_gemm(plan, model.lm_head.weight),
        decode=planned_decode_kernels(plan, model))


__all__ = ["PLAN_FILE", "KernelPlan", "OneDNNLinear", "apply_activation_checkpointing", "apply_kernels",
           "bf16_ratio", "checkpointed_blocks", "choose_plan", "cpu_model", "load_plan", "measured_here",
           "planned_kernels"]
