"""THE model file: one decoder-only transformer for every family of model/config.py's FAMILIES (Qwen2 / Qwen2.5,
Qwen3, Llama 3.x, SmolLM3, Granite, OLMo 2, Phi-3 / Phi-4-mini, Gemma 3, Mistral, Ministral).

The families differ only by their `Family` row (norm placement, q/k norm width, fused projections) and
`ModelConfig` numbers (biases, explicit head_dim, rope scaling and layers, multipliers, tied embeddings), never by
subclasses or copies of the block. Attention goes through
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

    A cache that keeps a sliding layer's keys its own way (the decode cache's rings by position,
    rollout/static_cache.py) also has `ring_masks(positions, masks)`: called once a forward, before the layers, with
    the queries' positions [B, T] and the slot masks by window (None: the full layers'); it returns the masks of the
    windows whose layers it keeps so, over what its update returns for them (and learns where their keys go).
    """

    start: int  # slots before this forward's first token

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


# ----------------------------------------------------------------------------------------------------
# RoPE


def rope_inv_freq(cfg: ModelConfig, device: torch.device | None = None, long: bool = False,
                  theta: float | None = None, scaled: bool = True) -> torch.Tensor:
    """Inverse frequencies [rotary_dim/2] in fp32, with the config's rope scaling applied (scaled=False: none).

    long: longrope's long factors (else its short ones); `rope_row_inv_freq` chooses per row.
    theta: another base than cfg.rope_theta (Gemma 3's sliding layers)."""
    d = cfg.rotary_dim
    scaling, kind = (cfg.rope_scaling or {}, rope_kind(cfg.rope_scaling)) if scaled else ({}, "default")
    theta = cfg.rope_theta if theta is None else theta
    base = theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)  # [d/2]
    if kind == "longrope":  # per-frequency divisors
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32, device=device)
        return 1.0 / (factors * base)
    inv_freq = 1.0 / base
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
    raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: default, linear, llama3, longrope")


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor cos and sin are multiplied by: longrope's attention_factor, when not given
    sqrt(1 + ln(s) / ln(original context)) for s = factor or max_position_embeddings / original (1 when s <= 1)."""
    scaling = cfg.rope_scaling or {}
    if rope_kind(scaling) != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_switch(cfg: ModelConfig) -> int | None:
    """The length past which a longrope row takes its long factors (None for other ropes): a row's keys
    computed before it passes are stale after (the decode loop prefills the row again, the training forward runs
    it whole: rollout/static_decode.py passes_rope_switch, train/forward.py)."""
    if rope_kind(cfg.rope_scaling) != "longrope":
        return None
    return int(cfg.rope_scaling["original_max_position_embeddings"])


def rope_row_inv_freq(cfg: ModelConfig, positions: torch.Tensor) -> torch.Tensor:
    """The inverse frequencies for positions [B, T]: [R/2], or for longrope [B, 1, R/2], each row's long factors
    once it runs past the original context (its largest position + 1 over original_max_position_embeddings).

    transformers decides once per forward for the whole batch; per row, a row's log-probs do not depend on the
    rows batched with it (the sampler's batch and the trainer's differ), and equal transformers' for the row alone.
    A cache keeps the keys written before a row's switch, as transformers' does."""
    if rope_kind(cfg.rope_scaling) != "longrope":
        return rope_inv_freq(cfg, positions.device)
    long = positions.amax(-1) + 1 > cfg.rope_scaling["original_max_position_embeddings"]  # [B]
    short_f, long_f = rope_inv_freq(cfg, positions.device), rope_inv_freq(cfg, positions.device, long=True)
    return torch.where(long[:, None, None], long_f, short_f)  # [B, 1, R/2]


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """positions [B, T] -> cos, sin [B, T, 1, R] (R = rotary dims; computed in fp32, times `scale`, cast like HF
    does), with the first half of sin negated: apply_rope folds rotate_half's sign into it.
    inv_freq: [R/2], or [B, 1, R/2] per row."""
    freqs = positions[..., None].float() * inv_freq  # [B, T, R/2]
    c, s = freqs.cos(), freqs.sin()
    if scale != 1.0:
        c, s = c * scale, s * scale
    cos, sin = torch.cat([c, c], dim=-1), torch.cat([-s, s], dim=-1)  # [B, T, D]
    return cos[:, :, None].to(dtype), sin[:, :, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] -> x * cos + rotate_half(x) * sin_hf, the rotate-half convention of the HF checkpoints.

    rotate_half(x) = cat(-x2, x1) is roll(x, D/2) = cat(x2, x1) with the first half's sign flipped, and that sign
    is already in `sin` (rope_cos_sin): one roll and a fused multiply-add instead of a negation, a concatenation
    and two products, in the projections' own contiguous [B, T, H, D] layout (fewer passes forward and backward).
    """
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:  # partial rotary: the first `rotary` dims turn, the rest pass through
        return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    return torch.addcmul(x * cos, x.roll(rotary // 2, -1), sin).to(x.dtype)  # fp32 cos: rotated in fp32 (OLMo 2)


# ----------------------------------------------------------------------------------------------------
# Blocks


def _rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_fp32: bool = False,
                      offset: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """((offset + weight) * x / rms(x), 1 / rms(x) [..., 1]) as the HF reference computes it: normalised in (at
    least) fp32 and cast back before the weight (after it with weight_fp32, OLMo 2's and Gemma's order, where
    Gemma's offset + weight is summed in fp32); float64 stays float64, so exactness tests keep their precision."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [..., 1]
    if weight_fp32:
        w = weight.to(xf.dtype) + offset if offset else weight
        return (w * (xf * rstd)).to(x.dtype), rstd
    return (weight + offset if offset else weight) * (xf * rstd).to(x.dtype), rstd


class _RMSNormFn(torch.autograd.Function):
    """RMSNorm keeping only x and 1/rms for backward (autograd's graph of the same expression also keeps the
    normalised x, in fp32 for bf16 inputs): one [tokens, d] tensor less per norm."""

    @staticmethod
    def forward(ctx, x, weight, eps, weight_fp32, offset):  # x [..., d], weight [d]
        y, rstd = _rms_norm_forward(x, weight, eps, weight_fp32, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return y

    @staticmethod
    def backward(ctx, grad_y):  # [..., d]; in-place steps keep at most three [..., d] temporaries alive
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(rstd.dtype) * rstd  # [..., d], recomputed
        grad_w = None
        if ctx.needs_input_grad[1]:  # d (offset + w) / dw = 1
            grad_w = (grad_y * xhat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0)
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = weight.to(rstd.dtype) + ctx.offset if ctx.offset else weight
            g = (grad_y * w).to(rstd.dtype)  # d loss / d xhat
            # d xhat_i / d x_j = rstd (delta_ij - xhat_i xhat_j / d)
            m = (g * xhat).mean(-1, keepdim=True)  # [..., 1]
            grad_x = g.sub_(xhat.mul_(m)).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_fp32: bool = False,
             offset: float = 0.0) -> torch.Tensor:
    """(offset + weight) * x / rms(x); through _RMSNormFn only when a gradient is to be taken."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNormFn.apply(x, weight, eps, weight_fp32, offset)
    return _rms_norm_forward(x, weight, eps, weight_fp32, offset)[0]


class RMSNorm(nn.Module):
    """RMSNorm whose weight w scales as (offset + w): offset 1 for Gemma, whose checkpoints store w - 1 (its
    weights start at zero); the stored value is the parameter, so checkpoints and adapters keep their numbers."""

    def __init__(self, dim: int, eps: float, weight_fp32: bool = False, offset: float = 0.0):
        super().__init__()
        self.eps, self.weight_fp32, self.offset = eps, weight_fp32, offset
        self.weight = nn.Parameter(torch.ones(dim) - offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.weight_fp32, self.offset)


def _norm(cfg: ModelConfig, dim: int) -> RMSNorm:
    return RMSNorm(dim, cfg.rms_norm_eps, cfg.family.norm_weight_fp32, cfg.family.norm_offset)


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


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up (Gemma's gelu_pytorch_tanh), through autograd's graph."""
    return F.gelu(gate, approximate="tanh") * up


ACTIVATIONS = {"silu": swiglu, "gelu_tanh": geglu}  # Family.activation -> the gated product


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        fam = cfg.family
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.q_dim, self.kv_dim = q_dim, kv_dim
        bias = cfg.attention_bias or fam.qkv_bias
        self.fused = fam.fused_qkv
        if fam.fused_qkv:
            self.qkv_proj = nn.Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=bias)  # [q | k | v] rows
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=bias)
            self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias)
            self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)
        self.qk_norm = fam.qk_norm
        q_width, k_width = (q_dim, kv_dim) if fam.qk_norm == "proj" else (self.head_dim, self.head_dim)
        self.q_norm = _norm(cfg, q_width) if fam.qk_norm else None
        self.k_norm = _norm(cfg, k_width) if fam.qk_norm else None
        self.rope = cfg.uses_rope(layer)
        # SDPA's and the kernels' scale is 1/sqrt(D): another scale s is folded into q as s * sqrt(D)
        m = cfg.attention_multiplier
        self.q_scale = None if m is None or m == self.head_dim ** -0.5 else m * math.sqrt(self.head_dim)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q [B, T, H*D], k, v [B, T, Hkv*D] (views of one product when fused)."""
        if self.fused:
            return self.qkv_proj(x).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x, cos, sin, mask, cache: KVCacheLike | None, layer: int,
                kernels: Kernels = TORCH_KERNELS) -> torch.Tensor:
        """kernels: the model's; its decode_attention runs a decode step, its train_attention a forward of more
        than one token whose gradient is taken, each instead of SDPA when set."""
        B, T, _ = x.shape
        q, k, v = self._project(x)
        if self.qk_norm == "proj":  # over the whole projection, before the split into heads
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.n_heads, self.head_dim)  # [B, T, H, D]
        k = k.view(B, T, self.n_kv, self.head_dim)  # [B, T, Hkv, D]
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.q_scale is not None:
            q = q * self.q_scale
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D], [B, Hkv, T, D]
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
    (plan/memory.py training_attention_elements). Counted on CPU tensors; which kernel SDPA runs on CUDA is untested
    on a GPU (tests/model/test_grouped_sdpa.py's CUDA test settles it)."""
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


def window_mask(mask: torch.Tensor | None, positions: torch.Tensor, key_pos: torch.Tensor | None, S: int,
                window: int) -> torch.Tensor | None:
    """The mask of a sliding layer: `mask` (bool [B or 1, 1, T, S], [T, S], or None: causal over T = S slots)
    with each query at position p seeing only keys at positions q with p - window < q (transformers' sliding
    window). positions [B, T] are the queries'; key_pos [B, S] the keys' (None: slot j is position j). `mask`
    itself when no key can be `window` positions away (S <= window: positions count valid slots)."""
    if window >= S:
        return mask
    T = positions.shape[1]
    if key_pos is None:
        key_pos = torch.arange(S, device=positions.device).expand(positions.shape[0], S)
    near = (positions[:, :, None] - key_pos[:, None, :]) < window  # [B, T, S]
    if mask is None:
        mask = torch.ones(T, S, dtype=torch.bool, device=positions.device).tril(S - T)
    if mask.dim() == 2:
        mask = mask[None, None]
    return mask & near[:, None]


def soft_cap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma's final-logit soft-capping), logits unchanged for None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)) with act = the family's activation (silu: SwiGLU)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, inter, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.fused = cfg.family.fused_gate_up
        if self.fused:
            self.gate_up_proj = nn.Linear(d, 2 * inter, bias=bias)  # [gate | up] rows
        else:
            self.gate_proj = nn.Linear(d, inter, bias=bias)
            self.up_proj = nn.Linear(d, inter, bias=bias)
        self.down_proj = nn.Linear(inter, d, bias=bias)
        self.act = ACTIVATIONS[cfg.family.activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [..., inter] each
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.act(gate, up))


class Block(nn.Module):
    """One layer, pre-, post- or sandwich-normed by the family (model/config.py Family); each branch times the
    residual multiplier before its residual add. `window`: the layer's sliding window (None: full attention), which
    picks its mask and rope in Transformer.forward."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        norm = cfg.family.norm
        self.post_norm = norm == "post"
        self.window = cfg.window(layer)
        self.residual_multiplier = cfg.residual_multiplier
        self.attn_norm = _norm(cfg, cfg.hidden_size)
        self.attn_out_norm = _norm(cfg, cfg.hidden_size) if norm == "sandwich" else None
        self.attn = Attention(cfg, layer)
        self.mlp_norm = _norm(cfg, cfg.hidden_size)
        self.mlp_out_norm = _norm(cfg, cfg.hidden_size) if norm == "sandwich" else None
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, layer, kernels=TORCH_KERNELS):
        if self.post_norm:
            h = self.attn_norm(self.attn(x, cos, sin, mask, cache, layer, kernels))
        else:
            h = self.attn(self.attn_norm(x), cos, sin, mask, cache, layer, kernels)
            if self.attn_out_norm is not None:
                h = self.attn_out_norm(h)
        x = x + self._scaled(h)
        if self.post_norm:
            h = self.mlp_norm(self.mlp(x))
        else:
            h = self.mlp(self.mlp_norm(x))
            if self.mlp_out_norm is not None:
                h = self.mlp_out_norm(h)
        return x + self._scaled(h)

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.residual_multiplier == 1.0 else h * self.residual_multiplier


# ----------------------------------------------------------------------------------------------------
# The model


class Transformer(nn.Module):
    """Embedding (x embedding_multiplier) -> N blocks -> final RMSNorm (/ logits_scaling) -> LM head (tied to the
    embedding when configured).

    The logit scale is applied to the final hidden state, before the head: every reader of the head (the chunked
    log-probs, the fused head, the decode loop, SFT) multiplies `return_hidden=True`'s output by the head's
    weight and so gets the family's logits without knowing the family.

    Kernel choices and activation checkpointing are applied from outside (grpo_engine/kernels/): `kernels` holds
    the products other than torch's that the model and the code running it use (model/kernels_slot.py; torch's
    everywhere until kernels.apply_kernels sets it).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.windows = sorted({cfg.window(i) for i in range(cfg.num_hidden_layers)} - {None})  # one mask each
        self.norm = _norm(cfg, cfg.hidden_size)
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
        mask = key_pos = None
        if attention_mask is not None:
            mask, derived, key_pos = self._attention_mask(attention_mask.bool(), start, T)
            positions = derived if positions is None else positions
        elif cache is not None and start > 0:
            mask = torch.ones(T, start + T, dtype=torch.bool, device=input_ids.device).tril(start)
        if positions is None:
            positions = torch.arange(start, start + T, device=input_ids.device).expand(B, T)
        cfg = self.config
        x = self.embed(input_ids)  # [B, T, hidden]
        if cfg.family.embed_scale_sqrt:  # the factor rounded to the model's dtype first, as Gemma's reference
            x = x * float(torch.tensor(cfg.hidden_size**0.5, dtype=x.dtype))  # a host scalar: no copy per step
        if cfg.embedding_multiplier != 1.0:
            x = x * cfg.embedding_multiplier
        masks = {None: mask}  # window -> the mask of its layers (one per layer kind)
        for window in self.windows:
            masks[window] = window_mask(mask, positions, key_pos, start + T, window)
        ring_masks = getattr(cache, "ring_masks", None) if self.windows else None
        if ring_masks is not None:  # sliding layers the cache keeps in rings: their masks over its rings
            masks.update(ring_masks(positions, masks))
        if T > 1 and any(m is not None and m.is_cuda for m in masks.values()):
            groups = cfg.num_attention_heads // cfg.num_key_value_heads
            masks = {w: m if m is None else cuda_attention_bias(m.expand(B, 1, T, m.shape[-1]), x.dtype, groups)
                     for w, m in masks.items()}
        ropes = self._rope(positions, x.dtype)
        for i, block in enumerate(self.layers):
            cos, sin = ropes[block.window is not None and cfg.rope_local_theta is not None]
            x = block(x, cos, sin, masks[block.window], cache, i, self.kernels)
        if cache is not None:
            cache.start = start + T
        x = self.norm(x)
        if cfg.logits_scaling != 1.0:
            x = x / cfg.logits_scaling  # logits = head(x) / s, for every reader of the head
        return x if return_hidden else self.logits(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states (`return_hidden=True`'s): [..., D] -> [..., V], soft-capped when
        the family caps its logits (the chunked heads of rl/logprobs.py and the decode head cap their own)."""
        return soft_cap(self.lm_head(hidden), self.config.final_logit_softcapping)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin [B, T, 1, R] of the full-attention layers (key False) and, when they have their own rope
        (Gemma 3's rope_local_base_freq, unscaled), of the sliding ones (key True)."""
        cfg = self.config
        rope_dtype = torch.promote_types(dtype, torch.float32) if cfg.family.rope_fp32 else dtype
        full = rope_cos_sin(rope_row_inv_freq(cfg, positions), positions, rope_dtype, rope_attention_factor(cfg))
        if cfg.rope_local_theta is None:
            return {False: full}
        local = rope_cos_sin(rope_inv_freq(cfg, positions.device, theta=cfg.rope_local_theta, scaled=False),
                             positions, rope_dtype)
        return {False: full, True: local}

    @staticmethod
    def _attention_mask(key_mask: torch.Tensor, start: int, T: int):
        """key_mask [B, S] (S = start + T) -> SDPA bool mask [B, 1, T, S], positions [B, T] and the position of
        every slot [B, S] (a window counts positions, not slots: left padding and holes are not distance).

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
        key_pos = (key_mask.long().cumsum(-1) - 1).clamp(min=0)  # [B, S]: valid slots before each
        return mask[:, None], key_pos[:, start:], key_pos

    def num_parameters(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
