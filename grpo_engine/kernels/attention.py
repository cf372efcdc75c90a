"""The attention of a decode step (one new token per row) and of a forward whose gradient is taken: SDPA, or two
grouped matmuls, chosen by measurement.

Why: on the CPU, SDPA with a key mask and a single query runs slower than its FLOPs warrant, and with
grouped-query attention it expands K and V to every query head. `grouped_attention` views the H query
heads as [H_kv, H / H_kv] (query head h reads KV head h // (H / H_kv), as SDPA's enable_gqa does), so each KV
head is read once. Which is faster depends on the CPU, the head shape and the dtype (docs/benchmarks.md), so
kernels/select.py times both at the model's shape and dtype and the plan records the winner. Same result up to
rounding.

On CUDA nothing is measured: with grouped KV heads a decode step always runs the grouped kernel
(`decode_attention_for`). SDPA with a key mask and enable_gqa has no fused CUDA kernel on the torch builds the
engine supports (flash attention takes no mask; the memory-efficient kernel has no GQA on torch 2.5), so it runs the
math kernel, which upcasts K and V and repeats them to every query head, in every layer at every step (about 0.45 GB
each per layer at 1.5B, 128 rows, 577 slots), slower than reading the weights and held in the CUDA graph's pool.
The grouped kernel reads each KV head once, in the model's dtype, in two batched GEMMs with no host sync (it is
captured in the static decode's graphs); the first writes its scores in fp32 where the torch build has a bf16 GEMM
with an fp32 output (torch.bmm's out_dtype), else q and K are upcast. Its scores are fp32 on every device, as SDPA's
(grouped_attention). Without grouping, SDPA's memory-efficient kernel takes the mask. The CUDA side (the mixed
GEMM and the fused kernels' choice) has not run on a GPU yet: tests/model/test_decode_attention.py's CUDA tests
settle it.

The same grouped matmuls serve a forward whose gradient is taken (training, scoring with a gradient): on the CPU,
SDPA's backward in bf16 can run far below its FLOPs, while the grouped matmuls' autograd graph runs on the GEMMs.
The grouped kernel materialises the scores [B, H, T, S] (SDPA's flash kernel does not) and loses on long sequences,
so it runs only up to the largest (queries x keys) timed, TRAIN_SIZES; longer sequences, and forwards without a
gradient, keep SDPA. kernels/select.py times both, forward and backward, at the model's head shape and dtype and
the plan records the winner (benchmarks/attention_kernels.py prints each size).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

ROWS_AND_SLOTS = ((32, 192), (64, 64))  # decode batches timed: (rows, cached slots)
TRAIN_SIZES = ((8, 64, 96), (8, 128, 192))  # forwards with a gradient timed: (rows, queries, keys)
MAX_QUERY_KEYS = max(t * s for _, t, s in TRAIN_SIZES)  # beyond it a forward with a gradient keeps SDPA


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, H, T, D], k and v [B, H_kv, S, D], mask [B or 1, 1, T, S] bool (True = attend; None: causal, query i
    at slot S - T + i) -> [B, H, T, D]. Query head h reads KV head h // (H / H_kv), as SDPA's enable_gqa.

    The decode kernel: scores computed, scaled and normalised in (at least) fp32, as SDPA's kernels keep them. A
    bf16 model's attention logits of a few tens rounded to bf16 move by up to 1/16 each, and the rollout would
    sample from another policy than the one the trainer scores with SDPA (tests/model/test_decode_attention.py
    measures both against float64 with logits in the tens)."""
    return _grouped(q, k, v, mask, exact=True)


def _grouped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             exact: bool) -> torch.Tensor:
    """grouped_attention; exact=False keeps both products in the model's dtype (only the softmax in fp32)."""
    B, H, T, D = q.shape
    n_kv, S, dtype = k.shape[1], k.shape[2], v.dtype
    mask = causal_mask(T, S, q.device) if mask is None else mask
    q = q.reshape(B, n_kv, H // n_kv * T, D)  # [B, H_kv, G * T, D]: a KV head's G query heads one after another
    acc = torch.promote_types(v.dtype, torch.float32)
    mixed = exact and q.dtype != acc and not _grad_taken(q, k, v) and _mixed_gemm_works(q.device)
    if not exact or mixed or q.dtype == acc:  # model-dtype operands (fp32 out where mixed), no copies
        scores = _scores(q, k, acc if mixed else None)
    else:  # the CPU's exact path: SDPA's math in fp32 (K and V upcast, the probabilities kept in fp32)
        q, k, v = q.to(acc), k.to(acc), v.to(acc)
        scores = torch.matmul(q, k.transpose(-1, -2))
    scores = scores.view(B, n_kv, H // n_kv, T, S)  # [B, H_kv, G, T, S]
    scores = scores.mul_(D**-0.5).masked_fill_(~mask[:, :, None], float("-inf"))  # in place: autograd keeps neither
    probs = torch.softmax(scores, dim=-1, dtype=acc).to(v.dtype)  # mixed: rounded to bf16, as flash attention does
    return torch.matmul(probs.view(B, n_kv, -1, S), v).view(B, H, T, D).to(dtype)


def _grad_taken(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _scores(q: torch.Tensor, k: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    """q [B, H_kv, M, D] @ k [B, H_kv, S, D]^T -> [B, H_kv, M, S], in out_dtype through the batched GEMM that
    takes model-dtype operands and writes fp32 (K read once in its own dtype), or in the operands' dtype."""
    if out_dtype is None:
        return torch.matmul(q, k.transpose(-1, -2))
    B, n_kv, M, D = q.shape
    scores = torch.bmm(q.reshape(B * n_kv, M, D), k.reshape(B * n_kv, -1, D).transpose(-1, -2), out_dtype=out_dtype)
    return scores.view(B, n_kv, M, -1)


_MIXED_GEMM: dict[str, bool] = {}  # device type -> whether torch.bmm(bf16, bf16, out_dtype=fp32) runs there


def _mixed_gemm_works(device: torch.device) -> bool:
    """Probed once per device type, outside a CUDA graph capture (the static decode's eager warm-up runs first);
    during a capture with no answer yet: False (the upcast path, also capturable)."""
    if device.type not in _MIXED_GEMM:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        a = torch.ones(1, 2, 3, dtype=torch.bfloat16, device=device)
        try:
            works = torch.bmm(a, a.transpose(-1, -2), out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            works = False
        _MIXED_GEMM[device.type] = works
    return _MIXED_GEMM[device.type]


def grouped_training_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               mask: torch.Tensor | None) -> torch.Tensor:
    """A forward with a gradient on the CPU: the grouped matmuls up to MAX_QUERY_KEYS (queries x keys), SDPA
    beyond.

    The grouped products stay in the model's dtype here (only the softmax in fp32): this kernel is chosen over
    SDPA for its speed (bf16 GEMMs on the matrix units; fp32 copies of q, K and V would also be kept for the
    backward), and the policy the rollout samples is scored without a gradient, through SDPA, whose scores are
    fp32. So parity between sampler and trainer rests on the decode kernel, which is exact in fp32."""
    T, S = q.shape[2], k.shape[2]
    if T * S <= MAX_QUERY_KEYS:
        return _grouped(q, k, v, mask, exact=False)
    gqa = k.shape[1] != q.shape[1]
    if mask is None and S == T:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = causal_mask(T, S, q.device) if mask is None else mask
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def causal_mask(queries: int, keys: int, device: torch.device | None = None) -> torch.Tensor:
    """[1, 1, T, S] bool: query i, at slot S - T + i, sees slots up to its own."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)[None, None]


KERNELS = {"grouped": grouped_attention}  # "sdpa": the model's own path (no hook)
TRAIN_KERNELS = {"grouped": grouped_training_attention}


def decode_attention_for(device_type: str, n_heads: int, n_kv: int, planned: str) -> Callable | None:
    """The attention of a model's decode steps (None: the model's SDPA): on CUDA the grouped kernel when KV heads
    are grouped and SDPA otherwise (module docstring); elsewhere the kernel plan's measured choice `planned`."""
    if device_type == "cuda":
        return grouped_attention if n_kv != n_heads else None
    return KERNELS.get(planned)


def train_attention_for(device_type: str, planned: str) -> Callable | None:
    """The attention of a model's forwards with a gradient (None: the model's SDPA): on the CPU the kernel plan's
    measured choice `planned`; on CUDA SDPA, whose fused kernels have their own backward."""
    return None if device_type == "cuda" else TRAIN_KERNELS.get(planned)


def shape_key(n_heads: int, n_kv: int, head_dim: int, dtype: torch.dtype = torch.float32) -> str:
    """"H/Hkv/D" for fp32 activations, "H/Hkv/D bfloat16" (the dtype's name) for any other."""
    suffix = "" if dtype == torch.float32 else " " + str(dtype).removeprefix("torch.")
    return f"{n_heads}/{n_kv}/{head_dim}{suffix}"


def parse_key(key: str) -> tuple[int, int, int, torch.dtype]:
    """shape_key's inverse: (H, Hkv, D, dtype)."""
    shape, _, dtype = key.partition(" ")
    n_heads, n_kv, head_dim = (int(x) for x in shape.split("/"))
    return n_heads, n_kv, head_dim, getattr(torch, dtype) if dtype else torch.float32


def measure(n_heads: int, n_kv: int, head_dim: int, race, dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Seconds of both kernels on decode-sized inputs of `dtype` at this head shape, summed over ROWS_AND_SLOTS;
    `race` (kernels/select.py) times them in turns."""
    g = torch.Generator().manual_seed(0)
    times, gqa = {"sdpa": 0.0, "grouped": 0.0}, n_heads != n_kv
    for rows, slots in ROWS_AND_SLOTS:
        q = torch.randn(rows, n_heads, 1, head_dim, generator=g).to(dtype)
        k, v = (torch.randn(rows, n_kv, slots, head_dim, generator=g).to(dtype) for _ in range(2))
        mask = torch.rand(rows, 1, 1, slots, generator=g) > 0.1
        raced = race({"sdpa": lambda q=q, k=k, v=v, m=mask: F.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                                                           enable_gqa=gqa),
                      "grouped": lambda q=q, k=k, v=v, m=mask: grouped_attention(q, k, v, m)}, 10)
        for name, seconds in raced.items():
            times[name] += seconds
    return times


def measure_training(n_heads: int, n_kv: int, head_dim: int, race,
                     dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Seconds of a forward and backward through each kernel at TRAIN_SIZES (causal over the last T of S keys, as
    a completion after its shared prompt), in `dtype`, summed; `race` (kernels/select.py) times them in turns."""
    g = torch.Generator().manual_seed(0)
    times = dict.fromkeys(TIMED_TRAINING, 0.0)
    for rows, queries, keys in TRAIN_SIZES:
        q = torch.randn(rows, n_heads, queries, head_dim, generator=g).to(dtype).requires_grad_()
        k, v = (torch.randn(rows, n_kv, keys, head_dim, generator=g).to(dtype).requires_grad_() for _ in range(2))
        mask = causal_mask(queries, keys)
        grad = torch.randn(rows, n_heads, queries, head_dim, generator=g).to(dtype)
        inputs = (q, k, v)
        raced = race({name: partial(_forward_backward, kernel, inputs, mask, grad) for name, kernel in
                      TIMED_TRAINING.items()}, 5)
        for name, seconds in raced.items():
            times[name] += seconds
    return times


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])


TIMED_TRAINING = {"sdpa": _sdpa, **TRAIN_KERNELS}  # at TRAIN_SIZES the grouped one runs its grouped products


def _forward_backward(kernel: Callable, inputs: tuple[torch.Tensor, ...], mask: torch.Tensor,
                      grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(kernel(*inputs, mask), inputs, grad)
