"""The attention of a decode step (one new token per row): SDPA, or two grouped matmuls, chosen by measurement.

Why: on the CPU, SDPA with a key mask and a single query runs slower than its FLOPs warrant, and with
grouped-query attention it expands K and V to every query head. `grouped_decode_attention` views the H query
heads as [H_kv, H / H_kv] (query head h reads KV head h // (H / H_kv), as SDPA's enable_gqa does), so each KV
head is read once. Which is faster depends on the CPU and the head shape (on a 2-core AMD EPYC: 1.1-1.8x faster
at 9 / 3, 14 / 2 and 8 / 2 heads for most row and cache sizes, 0.8x at 9 / 3 heads with 32 rows and 200 cached
slots), so kernels/select.py times both at the model's shape and dtype and the plan records the winner. In bf16
the gap is wider (the same CPU: SDPA 1.6 ms against 0.19 ms at 9 / 3 heads, 32 rows, 96 slots). Same result up to
rounding.

On CUDA nothing is measured: with grouped KV heads a decode step always runs the grouped kernel
(`decode_attention_for`). SDPA with a key mask and enable_gqa has no fused CUDA kernel on the torch builds the
engine supports (flash attention takes no mask; the memory-efficient kernel has no GQA on torch 2.5), so it runs the
math kernel, which upcasts K and V and repeats them to every query head, in every layer at every step (about 0.45 GB
each per layer at 1.5B, 128 rows, 577 slots), slower than reading the weights and held in the CUDA graph's pool.
The grouped kernel reads each KV head once, in the model's dtype, in two batched GEMMs with no host sync (it is
captured in the static decode's graphs). Without grouping, SDPA's memory-efficient kernel takes the mask.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

ROWS_AND_SLOTS = ((32, 192), (64, 64))  # decode batches timed: (rows, cached slots)


def grouped_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, 1, D], k and v [B, H_kv, S, D], mask [B, 1, 1, S] bool (True = attend) -> [B, H, 1, D]."""
    B, H, _, D = q.shape
    n_kv = k.shape[1]
    scores = torch.matmul(q.reshape(B, n_kv, H // n_kv, D), k.transpose(-1, -2))  # [B, H_kv, H / H_kv, S]
    scores = scores.mul_(D**-0.5).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.promote_types(v.dtype, torch.float32)).to(v.dtype)
    return torch.matmul(probs, v).view(B, H, 1, D)


KERNELS = {"grouped": grouped_decode_attention}  # "sdpa": the model's own path (no hook)


def decode_attention_for(device_type: str, n_heads: int, n_kv: int, planned: str) -> Callable | None:
    """The attention of a model's decode steps (None: the model's SDPA): on CUDA the grouped kernel when KV heads
    are grouped and SDPA otherwise (module docstring); elsewhere the kernel plan's measured choice `planned`."""
    if device_type == "cuda":
        return grouped_decode_attention if n_kv != n_heads else None
    return KERNELS.get(planned)


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
                      "grouped": lambda q=q, k=k, v=v, m=mask: grouped_decode_attention(q, k, v, m)}, 10)
        for name, seconds in raced.items():
            times[name] += seconds
    return times
