"""THE model file: a decoder-only transformer covering Qwen2 / Qwen2.5, Qwen3 and Llama 3.x.

The architectures differ only by `ModelConfig` fields (q/k/v bias, q/k RMSNorm, explicit head_dim,
rope scaling, tied embeddings), never by subclasses. Attention goes through
`F.scaled_dot_product_attention`. The same `forward` serves three callers:

* training / scoring: no cache, causal attention, optionally `return_hidden=True` so that rl/logprobs.py
  can compute log-probs chunk by chunk without materialising [tokens, vocab] logits;
* rollout prefill and decode: a `KVCacheLike` view of the decode cache (rollout/static_cache.py) over
  preallocated key/value tensors; new keys/values are written at `cache.start` (a decode step: each row at its
  own slot and at `start`, the query's scratch slot), and a key-padding mask covers all slots;
* training with shared prompts (train/forward.py): a cache-like object that records a prompt pass's
  keys/values, then lets each completion attend to its prompt's (autograd sums the gradients back);
* parity tests: HF-style `attention_mask` [B, T] for left- or right-padded batches.

RMSNorm and SwiGLU run through two small autograd functions when gradients are taken: the same math, but they
keep less for backward than autograd's graph of the same expressions (plan/memory.py counts what they keep).

This file imports nothing from training code.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig, rope_kind
from .kernels_slot import TORCH_KERNELS, Kernels


class KVCacheLike(Protocol):
    """What the model needs from a cache: the slot count before this forward, and a per-layer update.

    `update(layer, k, v)` receives this forward's keys/values [B, H_kv, T, D] (after RoPE) and returns the
    keys/values the queries attend to, [B, H_kv, start + T, D]: the earlier slots followed by the new ones.
    The rollout's decode cache (rollout/static_cache.py) writes into preallocated buffers; the training-time prompt
    sharing (train/forward.py) concatenates a prompt pass's keys/values so gradients flow into it.
    The model sets `start = start + T` after the forward.
    """

    start: int  # slots before this forward's first token

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


# ----------------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(cfg: ModelConfig, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies [D/2] in fp32, with the config's rope scaling applied."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
    scaling, kind = cfg.rope_scaling or {}, rope_kind(cfg.rope_scaling)
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions [B, T] -> cos, sin [B, T, 1, D] (computed in fp32, cast like HF does), with the first half of
    sin negated: apply_rope folds rotate_half's sign into it."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    c, s = freqs.cos(), freqs.sin()
    cos, sin = torch.cat([c, c], dim=-1), torch.cat([-s, s], dim=-1)  # [B, T, D]
    return cos[:, :, None].to(dtype), sin[:, :, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] -> x * cos + rotate_half(x) * sin_hf, the rotate-half convention of the HF checkpoints.

    rotate_half(x) = cat(-x2, x1) is roll(x, D/2) = cat(x2, x1) with the first half's sign flipped, and that sign
    is already in `sin` (rope_cos_sin): one roll and a fused multiply-add instead of a negation, a concatenation
    and two products, in the projections' own contiguous [B, T, H, D] layout (fewer passes forward and backward).
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)


# ----------------------------------------------------------------------------------------------------
# Blocks


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * x / rms(x), 1 / rms(x) [..., 1]) as the HF reference computes it: normalised in (at least) fp32 and
    cast back before the weight; float64 stays float64, so exactness tests in float64 keep their precision."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
    return weight * (xf * rstd).to(x.dtype), rstd


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm keeping only x and 1/rms for backward (autograd's graph of the same expression also keeps the
    normalised x, in fp32 for bf16 inputs): one [tokens, d] tensor less per norm."""

    @staticmethod
    def forward(ctx, x, weight, eps):  # x [..., d], weight [d]
        y, rstd = _rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad_y):  # [..., d]; in-place steps keep at most three [..., d] temporaries alive
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd  # [..., d], recomputed
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = (grad_y * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
        grad_x = None
        if ctx.needs_input_grad[0]:
            g = (grad_y * weight).to(rstd.dtype)  # d loss / d xhat
            # d xhat_i / d x_j = rstd (delta_ij - xhat_i xhat_j / d)
            m = (g * xhat).mean(-1, keepdim=True)  # [..., 1]
            grad_x = g.sub_(xhat.mul_(m)).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x); through _RMSNormFn only when a gradient is to be taken."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(x, weight, eps)
    return _rms_norm_forward(x, weight, eps)[0]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _SwiGLUFn(torch.autograd.Function):
    """silu(gate) * up keeping only gate and up for backward (autograd's graph keeps silu(gate) too): one
    [tokens, intermediate] tensor less per block; backward recomputes silu(gate), one cheap pass."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)  # one [..., inter] allocation, not two

    @staticmethod
    def backward(ctx, grad):  # [..., inter]
        gate, up = ctx.saved_tensors
        grad_gate = grad_up = None
        if ctx.needs_input_grad[0]:
            grad_gate = grad * up
            torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)  # in place, elementwise
        if ctx.needs_input_grad[1]:
            grad_up = F.silu(gate).mul_(grad)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up; through _SwiGLUFn only when a gradient is to be taken."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SwiGLUFn.apply(gate, up)
    return F.silu(gate) * up


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos, sin, mask, cache: KVCacheLike | None, layer: int,
                kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        """kernels: the model's; its decode_attention runs a decode step, its train_attention a forward of more
        than one token whose gradient is taken, each instead of SDPA when set."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim)  # [B, T, Hkv, D]
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, H, T, D]
        k = apply_rope(k, cos, sin).transpose(1, 2)  # [B, Hkv, T, D]
        if cache is not None:
            k, v = cache.update(layer, k, v)  # [B, Hkv, start + T, D]
        gqa = self.n_kv != self.n_heads
        if T == 1 and mask is not None and kernels.decode_attention is not None:  # a decode step
            out = kernels.decode_attention(q, k, v, mask)
        elif T > 1 and kernels.train_attention is not None and q.requires_grad and torch.is_grad_enabled():
            out = kernels.train_attention(q, k, v, mask)
        elif mask is None:  # plain causal self-attention over the T tokens
            out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=gqa)
        elif gqa and T > 1 and q.is_cuda:  # the bias stacks each KV head's query heads (cuda_attention_bias)
            out = grouped_sdpa(q, k, v, mask)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype) if mask.is_floating_point()
                                                 else mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))  # [B, T, hidden]


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Masked attention with grouped KV heads on a fused kernel, without copying K and V per query head.

    q [B, H, T, D], k and v [B, H_kv, S, D], bias [B or 1, 1, G T, S] additive (cuda_attention_bias with
    groups=G = H / H_kv: the T-row mask once per query head of a KV head) -> [B, H, T, D]. Query head h reads KV
    head h // G (as enable_gqa): a KV head's G query heads go one after another along the queries, [B, H_kv, G T, D],
    so SDPA sees as many query heads as KV heads. Why: CUDA's fused kernels take no mask with enable_gqa (SDPA then
    runs its math kernel), and copying K and V to every query head ([B, H, S, D] each) keeps G copies per block for
    the backward; here autograd keeps the stacked q (q's size), K and V once, and the output
    (plan/memory.py training_attention_elements)."""
    B, H, T, D = q.shape
    n_kv = k.shape[1]
    out = F.scaled_dot_product_attention(q.reshape(B, n_kv, H // n_kv * T, D), k, v, attn_mask=bias)
    return out.view(B, H, T, D)


def cuda_attention_bias(mask: torch.Tensor, dtype: torch.dtype, groups: int = 1) -> torch.Tensor:
    """bool mask [B, 1, T, S] -> additive bias [B, 1, groups x T, S] (0 / -inf) in dtype, the T rows once per group
    (grouped_sdpa's stacked query heads), rows 16-element aligned.

    SDPA's memory-efficient CUDA kernel takes a float bias with aligned rows; given a bool or unaligned mask it
    converts and pads it in every layer, and autograd keeps each layer's copy for backward. Built once per
    forward, every layer reads (and saves) this one tensor.
    """
    B, _, T, S = mask.shape
    bias = torch.zeros(B, 1, groups * T, -(-S // 16) * 16, dtype=dtype, device=mask.device)[..., :S]
    return bias.masked_fill_(~mask.repeat(1, 1, groups, 1), float("-inf"))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))  # SwiGLU


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer, kernels=TORCH_KERNELS):
        x = x + self.attn(self.attn_norm(x), cos, sin, mask, cache, layer, kernels)
        return x + self.mlp(self.mlp_norm(x))


# ----------------------------------------------------------------------------------------------------
# The model


class Transformer(nn.Module):
    """Embedding -> N blocks -> final RMSNorm -> LM head (tied to the embedding when configured).

    Kernel choices and activation checkpointing are applied from outside (grpo_engine/kernels/): `kernels` holds
    the products other than torch's that the model and the code running it use (model/kernels_slot.py; torch's
    everywhere until kernels.apply_kernels sets it).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.kernels: Kernels = TORCH_KERNELS
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding matrix with the LM head (call again after loading with assign=True)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        cache: KVCacheLike | None = None,
        positions: torch.Tensor | None = None,
        return_hidden: bool = False,
    ) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] (or final hidden states [B, T, hidden]).

        attention_mask: key-padding mask, 1 for real tokens. Without a cache it is [B, T]; with a cache it
        covers every slot written so far including this call's, [B, cache.start + T]. None means all
        tokens are real: plain causal attention. Positions default to the count of real tokens before
        each one, so left padding gives the same positions as no padding.
        """
        B, T = input_ids.shape
        start = cache.start if cache is not None else 0
        mask = None
        if attention_mask is not None:
            mask, derived = self._attention_mask(attention_mask.bool(), start, T)
            positions = derived if positions is None else positions
        elif cache is not None and start > 0:
            mask = torch.ones(T, start + T, dtype=torch.bool, device=input_ids.device).tril(start)
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        x = self.embed(input_ids)  # [B, T, hidden]
        if mask is not None and T > 1 and mask.is_cuda:
            groups = self.config.num_attention_heads // self.config.num_key_value_heads
            mask = cuda_attention_bias(mask.expand(B, 1, T, start + T), x.dtype, groups)
        cos, sin = rope_cos_sin(rope_inv_freq(self.config, x.device), positions, x.dtype)
        for i, block in enumerate(self.layers):
            x = block(x, cos, sin, mask, cache, i, self.kernels)
        if cache is not None:
            cache.start = start + T
        x = self.norm(x)
        return x if return_hidden else self.lm_head(x)

    @staticmethod
    def _attention_mask(key_mask: torch.Tensor, start: int, T: int):
        """key_mask [B, S] (S = start + T) -> SDPA bool mask [B, 1, T, S] and positions [B, T].

        Query i sits in slot start + i and sees valid slots j <= start + i. It always sees its own slot,
        so a padding query still has one finite score (its output is garbage and ignored).
        """
        S = key_mask.shape[1]
        if start + T != S:
            raise ValueError(f"attention_mask covers {S} slots, expected cache.start + T = {start + T}")
        slots = torch.arange(S, device=key_mask.device)
        q_slots = slots[start:, None]  # [T, 1]
        causal = slots[None, :] <= q_slots  # [T, S]
        mask = (key_mask[:, None, :] & causal) | (slots[None, :] == q_slots)  # [B, T, S]
        positions = (key_mask.long().cumsum(-1) - 1).clamp(min=0)[:, start:]  # [B, T]
        return mask[:, None], positions

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
