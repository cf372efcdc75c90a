"""A model's `kernels.weight_grads_in_place` switch: weight gradients summed over micro-batches by one accumulating
GEMM straight into .grad -- the same gradients as autograd's, only for the weights the plan marks, only inside the
switch."""

import copy

import pytest
import torch

from grpo_engine.kernels import KernelPlan, apply_activation_checkpointing, apply_kernels, onednn
from grpo_engine.kernels.select import shape_key, weight_shapes
from grpo_engine.model.loading import load_model


def _planned(model, in_place: set[str], backend: str = "onednn"):
    """Every weight on `backend`'s GEMM; the gradients of the shapes in `in_place` accumulated in place."""
    shapes = [shape_key(s) for s in weight_shapes(model)]
    grads = {k: "inplace" if k in in_place else backend for k in shapes}
    return apply_kernels(model, KernelPlan("cpu", torch.__version__, 1, dict.fromkeys(shapes, backend),
                                           weight_grad=grads))


def _two_micro_batches(model):
    """Gradient accumulation over two micro-batches of different lengths (one loss each)."""
    g = torch.Generator().manual_seed(3)
    for rows, length in ((3, 9), (2, 6)):
        ids = torch.randint(0, 256, (rows, length), generator=g)
        logits = model(ids)  # [rows, length, V]
        torch.log_softmax(logits.double(), -1)[..., :7].sum().backward()


@pytest.mark.parametrize("arch,checkpointing,backend", [("qwen2", 0, "onednn"), ("llama3", 0, "onednn"),
                                                         ("qwen2", 1, "onednn"), ("qwen2", 1, "torch")])
def test_in_place_gradients_match_float64_autograd(tiny_ckpt_factory, arch, checkpointing, backend, monkeypatch):
    """On either GEMM (qwen2: q/k/v biases). With activation checkpointing the backward's saved weight is a
    recomputed alias: the gradient must still land in the parameter's .grad."""
    model = load_model(tiny_ckpt_factory(arch))
    reference = copy.deepcopy(model).double()  # float64: nn.Linear products, autograd's accumulation
    _two_micro_batches(reference)
    model = apply_activation_checkpointing(_planned(model, {shape_key(s) for s in weight_shapes(model)}, backend),
                                           every=checkpointing).train()  # checkpointing acts in training mode
    in_place, real = [], onednn._accumulate_weight_grad
    monkeypatch.setattr(onednn, "_accumulate_weight_grad", lambda w, *a: in_place.append(w) or real(w, *a))
    with model.kernels.weight_grads_in_place():
        _two_micro_batches(model)
    assert len({id(w) for w in in_place}) == 7 * model.config.num_hidden_layers  # every projection
    got = dict(model.named_parameters())
    for name, p in reference.named_parameters():
        assert got[name].grad is not None, name
        torch.testing.assert_close(got[name].grad.double(), p.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_only_planned_weights_inside_the_context_accumulate_in_place(tiny_ckpt, monkeypatch):
    model = load_model(tiny_ckpt)
    up, q = model.layers[0].mlp.up_proj.weight, model.layers[0].attn.q_proj.weight
    assert up.shape != q.shape
    model = _planned(model, {shape_key(tuple(up.shape))})
    in_place = []
    real = onednn._accumulate_weight_grad
    monkeypatch.setattr(onednn, "_accumulate_weight_grad", lambda w, *a: in_place.append(w) or real(w, *a))
    _two_micro_batches(model)  # outside: autograd sums every weight's gradient
    assert in_place == []
    with model.kernels.weight_grads_in_place():
        _two_micro_batches(model)
    assert sum(w is up for w in in_place) == 2 and not any(w is q for w in in_place)
    assert {tuple(w.shape) for w in in_place} == {tuple(up.shape)}
    in_place.clear()
    with model.kernels.weight_grads_in_place(enabled=False):  # the trainer's switch under fsdp2
        _two_micro_batches(model)
    assert in_place == []


def test_autograd_grad_outside_the_context_still_returns_weight_gradients(tiny_ckpt):
    model = _planned(load_model(tiny_ckpt), {shape_key(s) for s in weight_shapes(load_model(tiny_ckpt))})
    w = model.layers[0].mlp.down_proj.weight
    loss = model(torch.tensor([[1, 2, 3, 4]])).square().mean()
    (grad,) = torch.autograd.grad(loss, [w])
    assert grad is not None and grad.shape == w.shape and w.grad is None


def test_two_models_in_one_process_keep_their_own_plan_and_switch(tiny_ckpt, monkeypatch):
    """The GEMM choice and the in-place switch are the model's (`model.kernels`), not the process's: a model whose
    plan puts every weight on oneDNN keeps running oneDNN after another model was given an all-torch plan, and
    entering one model's switch leaves the other's gradients to autograd."""
    shapes = [shape_key(s) for s in weight_shapes(load_model(tiny_ckpt))]
    everything = dict.fromkeys(shapes, "inplace")
    a = apply_kernels(load_model(tiny_ckpt), KernelPlan("cpu", torch.__version__, 1, dict.fromkeys(shapes, "onednn"),
                                                        weight_grad=everything))
    b = apply_kernels(load_model(tiny_ckpt), KernelPlan("cpu", torch.__version__, 1, dict.fromkeys(shapes, "torch"),
                                                        weight_grad=everything))
    assert a.kernels.gemm is not b.kernels.gemm
    assert a.kernels.weight_grads_in_place is not b.kernels.weight_grads_in_place
    products, real_op = [], onednn._op
    monkeypatch.setattr(onednn, "_op", lambda x, w, bias=None: products.append(w) or real_op(x, w, bias))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        b(ids)  # the all-torch plan: no oneDNN product
        assert products == []
        a(ids)  # applied first, still on its own plan
    assert len(products) == (7 * a.config.num_hidden_layers if onednn.op_works() else 0)
    in_place, real_acc = [], onednn._accumulate_weight_grad
    monkeypatch.setattr(onednn, "_accumulate_weight_grad", lambda w, *args: in_place.append(w) or real_acc(w, *args))
    with a.kernels.weight_grads_in_place():
        _two_micro_batches(b)  # b's switch is off: autograd's way
        assert in_place == []
        _two_micro_batches(a)
    a_weights = {id(p) for p in a.parameters()}
    assert in_place and all(id(w) in a_weights for w in in_place)
    assert all(p.grad is not None for p in b.parameters() if p.requires_grad)  # b's gradients came from autograd
