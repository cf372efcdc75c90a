"""The matmul-bound floor of a GRPO step: the step's matmul FLOPs over this machine's measured GEMM rate.

On a CPU a step is close to compute-bound, so "how far from the floor" says how much time is left to win. The
FLOPs are counted from the model shape and the step's sizes (every product of the projections, the attention
and the LM head; norms, RoPE and the sampler are not matmuls and not counted). tests/test_bench_floor.py
checks the counts against torch's own FLOP counter on the real generate and update; the recomputed forward of
activation checkpointing is an estimate (the fraction of blocks checkpointed times one forward).

The rate is that of one [4096, 576] x [576, 1536] product in the step's precision, at the run's thread count, timed
in the same process as the step: in fp32 the better of torch.mm and oneDNN (the kernel plan picks between the two
for each layer); in bf16 torch.mm of bf16 tensors, the path a bf16 model's nn.Linear takes on the CPU (the kernel
plan leaves bf16 layers to nn.Linear). Each precision against its own rate: a CPU without native bf16 dot products
runs bf16 several times slower than fp32, and an fp32 rate would put such a step's floor far below anything it can
reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.config import ModelConfig
from ..plan.memory import linear_shapes

GEMM_SHAPE = (4096, 576, 1536)  # M, K, N of the product whose rate defines the floor
GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the precisions a floor's rate is measured in


@dataclass(frozen=True)
class StepSizes:
    prompts: int  # P
    group: int  # G
    prompt_len: int  # tokens per prompt, chat template included
    completion_len: int  # new tokens per completion
    shared_prompt: bool = True  # memory.share_prompt_forward: the update runs each prompt once per group
    fused_head: bool = True  # the LM head computes its gradients in the forward: 3 vocab products, not 4
    recompute: float = 0.0  # activation checkpointing: fraction of blocks whose forward runs again (all: 1)
    mu: int = 1  # update passes per step (mu > 1 adds an old-policy log-prob forward)
    reference: bool = False  # beta > 0: a reference log-prob forward


@dataclass(frozen=True)
class StepFlops:
    """Matmul FLOPs of one GRPO step by phase."""

    generate: float  # prefill + decode
    logprobs: float  # old-policy (mu > 1) and reference (beta > 0) log-prob forwards
    update: float  # mu x (training forward + backward)

    @property
    def total(self) -> float:
        return self.generate + self.logprobs + self.update


def body_flops_per_token(cfg: ModelConfig) -> float:
    """2 x the projection weights of every block: q, k, v, o and the gated MLP (gate, up, down)."""
    return 2.0 * cfg.num_hidden_layers * sum(i * o for i, o in linear_shapes(cfg).values())


def attention_flops(cfg: ModelConfig, queries: int, keys_before: int) -> float:
    """QK^T and AV of `queries` queries over `keys_before` earlier keys plus their own: 4 x heads x head_dim per
    (query, key) pair, every layer. Counted as SDPA runs them, full rectangles: a causal mask saves no products."""
    pairs = queries * (keys_before + queries)
    return 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * pairs


def head_flops_per_row(cfg: ModelConfig) -> float:
    return 2.0 * cfg.hidden_size * cfg.vocab_size


def generate_flops(cfg: ModelConfig, s: StepSizes) -> float:
    """Prefill each prompt once (logits of its last token), then G rows decode completion_len - 1 steps."""
    rows, L, T = s.prompts * s.group, s.prompt_len, s.completion_len
    prefill = s.prompts * (L * body_flops_per_token(cfg) + attention_flops(cfg, L, 0) + head_flops_per_row(cfg))
    steps = max(T - 1, 0)
    decode_attn = sum(attention_flops(cfg, 1, L + t) for t in range(steps))  # step t: the new token sees L + t
    decode = rows * (steps * (body_flops_per_token(cfg) + head_flops_per_row(cfg)) + decode_attn)
    return prefill + decode


def _forward_parts(cfg: ModelConfig, s: StepSizes) -> tuple[float, float]:
    """(body + attention, one LM-head product) FLOPs of one training forward over the step's rows."""
    rows, L, T = s.prompts * s.group, s.prompt_len, s.completion_len
    # the input is every token but the last (whose next token is not scored): L + T - 1 per row
    if s.shared_prompt:
        tokens = s.prompts * L + rows * (T - 1)
        attn = s.prompts * attention_flops(cfg, L, 0) + rows * attention_flops(cfg, T - 1, L)
    else:
        tokens = rows * (L + T - 1)
        attn = rows * attention_flops(cfg, L + T - 1, 0)
    return tokens * body_flops_per_token(cfg) + attn, rows * T * head_flops_per_row(cfg)  # head: T scored rows


def update_flops(cfg: ModelConfig, s: StepSizes) -> float:
    """mu passes of: training forward, backward (grad input + grad weight: 2x the forward's products, plus the
    recomputed forward of checkpointed blocks), and the LM head on the T scored positions of each row."""
    body, head = _forward_parts(cfg, s)
    head_products = 3 if s.fused_head else 4  # autograd's chunked head recomputes the logits for the backward
    return s.mu * ((3 + s.recompute) * body + head_products * head)


def logprob_flops(cfg: ModelConfig, s: StepSizes) -> float:
    """Forward-only log-prob passes: the old policy when mu > 1, the reference when beta > 0."""
    body, head = _forward_parts(cfg, s)
    return ((s.mu > 1) + s.reference) * (body + head)


def step_flops(cfg: ModelConfig, s: StepSizes) -> StepFlops:
    return StepFlops(generate_flops(cfg, s), logprob_flops(cfg, s), update_flops(cfg, s))


def gemm_rates(reps: int = 5, precision: str = "fp32") -> dict[str, float]:
    """GFLOP/s of GEMM_SHAPE at the current thread count, per backend a `precision` model's layers run on the CPU:
    fp32: torch.mm and (where it runs) oneDNN; bf16: torch.mm of bf16 tensors."""
    from ..kernels import onednn
    from ..kernels.select import best_time

    if precision not in GEMM_DTYPES:
        raise ValueError(f"GEMM rate precision {precision!r}; choose from {', '.join(GEMM_DTYPES)}")
    dtype = GEMM_DTYPES[precision]
    m, k, n = GEMM_SHAPE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    flops = 2.0 * m * k * n
    rates = {"torch": flops / best_time(lambda: torch.mm(x, w.t(), out=out), reps) / 1e9}
    if precision == "fp32" and onednn.op_works():
        rates["onednn"] = flops / best_time(lambda: onednn.onednn_linear(x, w), reps) / 1e9
    return rates


def gemm_rate(precision: str = "fp32", reps: int = 5) -> float:
    """The floor's rate in `precision`: GFLOP/s of its fastest backend (gemm_rates)."""
    return max(gemm_rates(reps, precision).values())


def weights_precision(model) -> str:
    """"fp32" | "bf16": the dtype of the model's floating weights, the precision its products (and floor) run in."""
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    names = {d: name for name, d in GEMM_DTYPES.items()}
    if dtype not in names:
        raise ValueError(f"weights in {dtype}: the floor has a GEMM rate for {', '.join(GEMM_DTYPES)} only; "
                         "set memory.precision to one of them")
    return names[dtype]
