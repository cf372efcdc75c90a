"""x @ W^T through oneDNN on the CPU: `linear` for the LM head, `OneDNNLinear` for the projections.

Why: on some CPUs (seen on AMD EPYC with AVX-512, docs/benchmarks.md) torch's default fp32 GEMM (MKL) runs at
about half the rate of oneDNN's, for the LM head at decode and in the log-prob head as for the transformer's
projections and both their gradients; on others (Intel Xeon) the two are level. Both are fp32 GEMMs (no
reduced-precision math): results agree with torch.mm to fp32 rounding (~1e-6).

`torch.ops.mkldnn._linear_pointwise` is the op torch.compile's CPU backend emits for nn.Linear; it is not a
public API, so `linear` probes it once (same result as torch.mm on a small problem) and falls back to
torch.mm whenever it is missing, fails, or the inputs are not fp32 CPU tensors. GRPO_ONEDNN=0 turns it off.

Which weights use it is decided per weight shape by the measured `KernelPlan` (kernels/select.py) that the model's
`Kernels.gemm` holds, for the forward and weight-gradient products and, apart, for the input gradient (the product
with the transposed weight, which can favour the other GEMM); without a plan, by a size threshold.

`pack` reorders a weight into oneDNN's blocked layout once, so that the products of a decode loop (same weights,
a few dozen rows, every step) skip the reorder oneDNN otherwise does on every call; kernels/packing.py decides
when that pays.

The chunked log-prob head (rl/logprobs.py) and the decode loop's LM head (rollout/decode_kernels.py) import none
of this: `planned_head_gemm` and packing.planned_decode_kernels build the products the plan chose for them, which
kernels.apply_kernels sets in the model's `Kernels` (model/kernels_slot.py).

Inside the model's `Kernels.weight_grads_in_place` switch, the weight gradient of a shape the plan marks "inplace"
is added straight into weight.grad by one GEMM with accumulation (torch's addmm_) instead of being returned to
autograd, which would allocate a fresh [out, in] gradient per micro-batch (page-faulted in on the CPU) and add it in
a second pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from ..model.kernels_slot import TORCH_KERNELS, GemmPlan, HeadGemm, Kernels

_state: dict[str, bool] = {}  # the one-time checks of what this machine's torch build runs


def op_works() -> bool:
    """One-time check that the op exists and matches torch.mm on a small fp32 problem."""
    if "ok" not in _state:
        _state["ok"] = (os.environ.get("GRPO_ONEDNN", "1") != "0" and torch.backends.mkldnn.is_available()
                        and matches_mm(_op))
    return _state["ok"]


def matches_mm(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
               dtype: torch.dtype = torch.float32) -> bool:
    """Whether product(x, w) runs and matches x @ w^T on a small problem in `dtype` (fp32, or bf16 to its rounding):
    the one-time check of an op that is not a public API (a missing op raises AttributeError, a failing one
    RuntimeError)."""
    try:
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(3, 16, generator=g).to(dtype), torch.randn(40, 16, generator=g).to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        got = product(x, w)
        return got.dtype == dtype and bool(torch.allclose(got.float(), x.float() @ w.float().t(), rtol=tol, atol=tol))
    except (RuntimeError, AttributeError):
        return False


MIN_WEIGHT_NUMEL = 1 << 18  # without a plan: below ~1 MB of weight the call overhead wins


def chosen_for(weight: torch.Tensor, plan: GemmPlan | None) -> bool:
    """The plan's choice for this weight's shape; without a plan, a size threshold."""
    if plan is None:
        return weight.numel() >= MIN_WEIGHT_NUMEL
    return plan.backend(tuple(weight.shape)) == "onednn"


def fp32_cpu_matrices(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether oneDNN's products take these: fp32 CPU matrices."""
    return x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32 and x.dim() == weight.dim() == 2


def applies(x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan | None = None) -> bool:
    """True when `linear(x, weight, plan)` will run on oneDNN: fp32 CPU matrices, a working op, chosen for the
    shape."""
    return fp32_cpu_matrices(x, weight) and op_works() and chosen_for(weight, plan)


def grad_input_applies(grad_y: torch.Tensor, weight: torch.Tensor, plan: GemmPlan | None) -> bool:
    """True when the gradient with respect to the input, grad_y [M, N] @ weight [N, K], is to run on oneDNN: as
    `applies`, with the plan's `grad_input` choice for the weight's shape (which defaults to the forward's)."""
    if plan is None:
        return applies(grad_y, weight)
    return (fp32_cpu_matrices(grad_y, weight) and op_works()
            and plan.grad_input_backend(tuple(weight.shape)) == "onednn")


def _op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T on oneDNN, unconditionally (weight may be a transposed view): for measuring it,
    and for products the plan put on oneDNN by the weight's shape as it knows it (a head's grad-input product
    gz @ W runs on W's choice, not on that of W^T's shape) on inputs checked to be fp32 CPU matrices."""
    return _op(x, weight)


def pack_works(dtype: torch.dtype = torch.float32) -> bool:
    """One-time check that weights of `dtype` can be packed (`pack`) and their products match torch.mm."""
    name = f"pack {dtype}"
    if name not in _state:
        _state[name] = op_works() and matches_mm(lambda x, w: packed_linear(x, pack(w, 3)), dtype)
    return _state[name]


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """weight [N, K] (fp32 or bf16, CPU) -> the same values in oneDNN's blocked layout for products of about `rows`
    rows: a new opaque tensor of about the weight's size, valid only for `packed_linear` and only while the weight is
    unchanged."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) for a weight packed by `pack` -> a new [M, N] tensor. No autograd."""
    return _op(x, packed, bias)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> a new [M, N] tensor, on oneDNN for fp32 CPU matrices, else torch's: for products
    the plan put on oneDNN (kernels/ checked that the op works), whatever inputs they later meet. No autograd."""
    return _op(x, weight) if fp32_cpu_matrices(x, weight) else x @ weight.t()


def _grad_input_product(grad_y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad_y [M, N] @ weight [N, K] -> a new [M, K] on oneDNN (for fp32 CPU matrices: HeadGemm.accepts)."""
    return _op(grad_y, weight.t())


HEAD_GRAD_BLOCK = 2048  # vocabulary rows per product of blocked_weight_grad: a few-MB output, heap-served


def blocked_weight_grad(grad_w: torch.Tensor, gz: torch.Tensor, h: torch.Tensor) -> None:
    """grad_w [V, D] += gz^T [V, n] @ h [n, D] on oneDNN, HEAD_GRAD_BLOCK vocabulary rows at a time (fp32 CPU).

    Why in blocks: oneDNN has no accumulating product, so each product's output is a fresh tensor added into
    grad_w. Whole, that output is as large as the head ([V, D]: 113 MB at SmolLM2's vocabulary, 311 MB at
    Qwen's), and glibc serves anything over 32 MB by mmap, page-faulting it in on every chunk; a block's output is
    a few MB, reused from the heap. Each block's rows of gz^T are copied into one contiguous [block, n] buffer
    first: oneDNN runs a column-strided operand far slower than it copies it. Whether this beats torch's addmm_
    depends on the CPU (docs/benchmarks.md): the kernel plan measures it (select.measure_head_weight_grad)."""
    vocab, rows = gz.shape[1], gz.shape[0]
    buf = torch.empty(min(HEAD_GRAD_BLOCK, vocab), rows, dtype=gz.dtype)  # [block, n]
    h_t = h.t()  # [D, n]: the product's weight operand, a view
    for v0 in range(0, vocab, HEAD_GRAD_BLOCK):
        v1 = min(v0 + HEAD_GRAD_BLOCK, vocab)
        block = buf[: v1 - v0]
        block.copy_(gz[:, v0:v1].t())  # [b, n]
        grad_w[v0:v1].add_(_op(block, h_t))  # [b, n] @ [n, D]


def planned_head_gemm(plan, weight: torch.Tensor) -> HeadGemm | None:
    """The chunked log-prob head's GEMMs for the LM head `weight` [V, D] under `plan` (a KernelPlan): oneDNN's
    forward where the plan's `logprob_head` choice for the shape is oneDNN, oneDNN's input gradient where its
    `grad_input` choice is; None (torch's products) where neither is, the weight is no fp32 CPU matrix, or the op
    does not work here. kernels.apply_kernels sets it as `model.kernels.head`."""
    if plan is None or not (fp32_cpu_matrices(weight, weight) and op_works()):
        return None
    shape = tuple(weight.shape)
    logits = onednn_linear if plan.logprob_head_backend(shape) == "onednn" else None
    grad_input = _grad_input_product if plan.grad_input_backend(shape) == "onednn" else None
    grad_weight = blocked_weight_grad if plan.head_weight_grad_backend(shape) == "blocked" else None
    if logits is None and grad_input is None and grad_weight is None:
        return None
    return HeadGemm(logits, grad_input, accepts=fp32_cpu_matrices, grad_weight=grad_weight)


def linear(x: torch.Tensor, weight: torch.Tensor, plan: GemmPlan | None = None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T -> a new [M, N] tensor (weight may be a transposed view). No autograd."""
    if applies(x, weight, plan):
        return _op(x, weight)
    return x @ weight.t()


def _grad_in_place(weight: torch.Tensor | None, kernels: Kernels) -> bool:
    """Whether this weight's gradient goes straight into weight.grad: inside the model's switch
    (`kernels.weight_grads_in_place`), for a shape its plan marks "inplace". None: not a trainable parameter.

    For the trainer's gradient-accumulation passes only: autograd hooks on those weights do not fire and
    torch.autograd.grad gets no weight gradient, so sharded training (FSDP2), which reduces gradients from
    hooks, must not enable it; the engine's own data parallelism sums .grad after the pass and may."""
    plan = kernels.gemm
    if not kernels.weight_grads_in_place.enabled or plan is None or weight is None:
        return False
    if not plan.grad_in_place(tuple(weight.shape)):
        return False
    g = weight.grad
    return g is None or (g.layout == torch.strided and g.dtype == weight.dtype and g.is_contiguous())


def _accumulate_weight_grad(weight: torch.Tensor, grad_y: torch.Tensor, x: torch.Tensor) -> None:
    """weight.grad += grad_y^T x ([N, M] @ [M, K]), or = when there is none yet."""
    if weight.grad is None:
        weight.grad = torch.mm(grad_y.t(), x)
    else:
        weight.grad.addmm_(grad_y.t(), x)


def product(x: torch.Tensor, weight: torch.Tensor, on_onednn: bool) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T on oneDNN or torch's GEMM (either may be a transposed view): the products of a
    weight on the backend chosen for it (also how kernels/select.py times them)."""
    return _op(x, weight) if on_onednn else torch.mm(x, weight.t())


class _LinearFn(torch.autograd.Function):
    """y = x W^T + b with the forward and weight-gradient products on oneDNN (on_onednn) or torch's GEMM, the
    input-gradient product on the one `grad_input_applies` names; the weight gradient straight into weight.grad
    instead where the model's switch and plan say so (`_grad_in_place`, asked at the backward)."""

    @staticmethod
    def forward(ctx, x, weight, bias, on_onednn, grad_input_on_onednn, kernels):  # x [M, K], weight [N, K], bias [N]
        ctx.save_for_backward(x, weight)
        ctx.has_bias, ctx.on_onednn, ctx.grad_input_on_onednn = bias is not None, on_onednn, grad_input_on_onednn
        ctx.kernels = kernels
        # the parameter itself: what saved_tensors gives back under activation checkpointing is a detached
        # recomputed alias, whose .grad is not the parameter's
        ctx.param = weight if weight.is_leaf and weight.requires_grad else None
        return _op(x, weight, bias) if on_onednn else torch.nn.functional.linear(x, weight, bias)  # [M, N]

    @staticmethod
    def backward(ctx, grad_y):  # [M, N]
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = product(grad_y, weight.t(), ctx.grad_input_on_onednn) if need_x else None  # [M, N] @ [N, K]
        grad_w = None
        if need_w and _grad_in_place(ctx.param, ctx.kernels):
            _accumulate_weight_grad(ctx.param, grad_y, x)
        elif need_w:
            grad_w = product(grad_y.t(), x.t(), ctx.on_onednn)  # [N, M] @ [M, K]
        grad_b = grad_y.sum(0) if ctx.has_bias and need_b else None
        return grad_x, grad_w, grad_b, None, None, None


class OneDNNLinear(torch.nn.Linear):
    """nn.Linear (same parameters, state dict and LoRA targeting) whose fp32 CPU products use oneDNN where its
    model's plan chooses it, and whose training weight gradient accumulates in place where that plan and the model's
    switch say so (on either GEMM); anything else (CUDA, bf16, no oneDNN) is nn.Linear itself. `kernels` is its
    model's `Kernels` (the same value as `model.kernels`): `kernels.apply_kernels` puts one in place of each of a
    model's nn.Linear projections (`use_onednn_projections`). Inside a decode loop `packed` holds the weight packed
    by oneDNN or MKL (kernels/packing.py sets and clears it), used without gradients."""

    kernels: Kernels = TORCH_KERNELS  # its model's (holding / use_onednn_projections set it)
    packed: Callable[..., torch.Tensor] | None = None  # a kernels/packed.py PackedWeight: x [M, K] -> [M, N]

    @classmethod
    def holding(cls, linear: torch.nn.Linear, kernels: Kernels) -> OneDNNLinear:
        """A OneDNNLinear holding `linear`'s own parameters: the same tensors (nothing copied or allocated), so
        names, state dicts, optimizer state and storage stay as they were."""
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                     dtype=linear.weight.dtype)
        module.kernels = kernels
        module.weight = linear.weight
        if linear.bias is not None:
            module.bias = linear.bias
        return module.train(linear.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        x2 = x.reshape(-1, x.shape[-1])  # [M, in]
        if self.packed is not None and not torch.is_grad_enabled():
            return self.packed(x2, self.bias).view(*x.shape[:-1], self.out_features)
        plan = self.kernels.gemm
        on_onednn = applies(x2, self.weight, plan)
        grad_input_on_onednn = torch.is_grad_enabled() and grad_input_applies(x2, self.weight, plan)
        if not (on_onednn or grad_input_on_onednn or self._torch_grad_in_place(x2)):
            return super().forward(x)  # every product on torch's GEMM: nn.Linear's own autograd
        y = _LinearFn.apply(x2, self.weight, self.bias, on_onednn, grad_input_on_onednn, self.kernels)  # [M, out]
        return y.view(*x.shape[:-1], self.out_features)

    def _torch_grad_in_place(self, x2: torch.Tensor) -> bool:
        """A product on torch's GEMM whose weight gradient is to be accumulated in place (fp32 CPU training)."""
        w = self.weight
        return (torch.is_grad_enabled() and w.requires_grad and fp32_cpu_matrices(x2, w)
                and _grad_in_place(w, self.kernels))


def use_onednn_projections(module: torch.nn.Module, kernels: Kernels) -> None:
    """Replace every plain nn.Linear inside `module` by a OneDNNLinear holding the same parameters (`holding`) and
    following `kernels`, the model's; the OneDNNLinear already there follow `kernels` from now on."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, OneDNNLinear.holding(child, kernels))
            elif isinstance(child, OneDNNLinear):
                child.kernels = kernels
