"""The one declared kernel value (model/kernels_slot.py): a model carries torch's products until kernels/ sets the
plan's, and applying kernels or activation checkpointing replaces modules without touching a parameter (same
tensors, names, state dict), so optimizer state, checkpoints and exact resume see the same model."""

import copy

import torch

from grpo_engine.kernels import KernelPlan, OneDNNLinear, apply_activation_checkpointing, apply_kernels
from grpo_engine.kernels.attention import grouped_attention, shape_key
from grpo_engine.kernels.checkpointing import CheckpointedBlock
from grpo_engine.kernels.select import shape_key as weight_key
from grpo_engine.kernels.select import weight_shapes
from grpo_engine.model.kernels_slot import TORCH_KERNELS, DecodeKernels
from grpo_engine.model.loading import load_model
from grpo_engine.model.transformer import Block


def _plan(model, attention: str = "grouped") -> KernelPlan:
    c = model.config
    key = shape_key(c.num_attention_heads, c.num_key_value_heads, c.head_dim, model.embed.weight.dtype)
    gemm = {weight_key(s): "onednn" for s in weight_shapes(model)}
    return KernelPlan("cpu", torch.__version__, torch.get_num_threads(), gemm, "test", {key: attention})


def test_a_model_carries_torchs_kernels_until_the_plan_sets_its_own(tiny_ckpt):
    model = load_model(tiny_ckpt)
    assert model.kernels is TORCH_KERNELS
    k = model.kernels
    assert (k.gemm, k.decode_attention, k.head, k.decode) == (None, None, None, DecodeKernels())
    with model.kernels.weight_grads_in_place(True):  # torch's way: a context that changes nothing
        pass
    plan = _plan(model)
    apply_kernels(model, plan)
    assert model.kernels.gemm is plan and plan.gemm == {weight_key(s): "onednn" for s in weight_shapes(model)} != {}
    assert model.kernels.decode_attention is grouped_attention
    assert all(m.kernels is model.kernels for m in model.modules() if isinstance(m, OneDNNLinear))


def test_kernels_and_checkpointing_keep_every_parameter_and_name(tiny_ckpt):
    model = load_model(tiny_ckpt)
    params = {n: p for n, p in model.named_parameters()}
    state = {k: v.data_ptr() for k, v in model.state_dict().items()}
    x = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    want = model(x)
    apply_kernels(model, _plan(model))
    apply_activation_checkpointing(model, every=2)
    got = model(x)
    assert isinstance(model.layers[0].attn.q_proj, OneDNNLinear) and isinstance(model.layers[1].mlp.up_proj,
                                                                                OneDNNLinear)
    assert [type(b) for b in model.layers] == [CheckpointedBlock if i % 2 == 0 else Block
                                               for i in range(len(model.layers))]
    assert {n: p for n, p in model.named_parameters()}.keys() == params.keys()
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    apply_activation_checkpointing(model, every=0)  # back to plain blocks, holding the same modules
    assert [type(b) for b in model.layers] == [Block] * len(model.layers)
    assert all(p is params[n] for n, p in model.named_parameters())


def test_a_deep_copy_carries_its_own_kernels(tiny_ckpt):
    """The KL reference is a deep copy: it runs the same choices on its own weights."""
    model = load_model(tiny_ckpt)
    apply_kernels(model, _plan(model))
    ref = copy.deepcopy(model)
    assert ref.kernels.decode_attention is grouped_attention
    assert ref.layers[0].attn.q_proj.weight is not model.layers[0].attn.q_proj.weight
