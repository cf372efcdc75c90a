"""The training sections: optimizer, learning-rate schedule, memory options, LoRA, and the warm start."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .fields import one_of, option, require, section

UPDATE_MMAP = ("auto", "true", "false", "trim")  # memory.cpu_update_mmap (plan/device_defaults.py update_mmap_choice)

OPTIMIZERS = ("adamw", "adamw_fused", "adamw_offload", "adamw_8bit")
BF16_ROUNDINGS = ("stochastic", "nearest")  # optimizer.bf16_rounding (train/optim.py set_from_master)
PRECISIONS = ("auto", "fp32", "bf16")
CHECKPOINTING = ("auto", "none", "all", "every_k")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Phi-3's fused projections: accepted as targets, and what q / k / v and gate / up adapt there (model/lora.py)
FUSED_LORA_TARGETS = ("qkv_proj", "gate_up_proj")
LORA_INITS = ("kaiming", "gaussian")
NF4_BACKENDS = ("torchao", "bitsandbytes")
ADAPTER_DTYPES = ("float32", "bfloat16", "float16", "float64")
TINY_ARCHS = ("", "qwen2", "qwen2-tied", "qwen3", "llama3")


@dataclass(frozen=True)
class OptimizerSection:
    """AdamW, where its state lives, and what the loop does around optimizer.step(): one class from the YAML to
    build_optimizer and the update step."""

    name: str = option("adamw_fused", "adamw_fused (torch's fused kernel, CPU and CUDA; plain adamw where it has "
                                      "none) | adamw (foreach) | adamw_offload | adamw_8bit")
    lr: float = option(1e-6, "peak learning rate")
    betas: list[float] = option([0.9, 0.99], "Adam (beta1, beta2)")
    eps: float = option(1e-8, "Adam epsilon")
    weight_decay: float = option(0.0, "decoupled (AdamW) weight decay")
    master_weights: bool = option(True, "fp32 master copy + fp32 moments for bf16/fp16 params")
    bf16_rounding: str = option("stochastic", "how a bf16 weight is set from its fp32 master after each step: "
                                "rounded stochastically (updates smaller than bf16's spacing still move the weights "
                                "the model runs, on average) or to nearest", BF16_ROUNDINGS)
    pin_memory: bool = option(True, "pin offloaded CPU state for fast copies")
    strict: bool = option(False, "fail instead of falling back when the variant is unavailable")
    grad_clip: float = option(1.0, "clip the global gradient norm to this; 0 = off")
    max_nonfinite_steps: int = option(3, "stop the run after this many consecutive NaN/inf losses or gradients")

    def __post_init__(self) -> None:
        require(self.name in OPTIMIZERS, f"optimizer.name={self.name!r}; choose from {sorted(OPTIMIZERS)}")
        one_of("optimizer.bf16_rounding", self.bf16_rounding, BF16_ROUNDINGS)
        require(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas),
                f"optimizer.betas={self.betas} must be two numbers in [0, 1)")
        require(math.isfinite(self.lr) and self.lr > 0,
                f"optimizer.lr={self.lr} must be a finite number > 0 (e.g. 1e-6)")
        require(self.eps > 0 and self.weight_decay >= 0,
                f"optimizer eps={self.eps}, weight_decay={self.weight_decay}: eps must be > 0, weight_decay >= 0")
        require(self.grad_clip >= 0, "optimizer.grad_clip must be >= 0 (0 = off)")
        require(self.max_nonfinite_steps >= 1, "optimizer.max_nonfinite_steps must be >= 1")


def _constant(progress: float, min_ratio: float) -> float:
    return 1.0


def _cosine(progress: float, min_ratio: float) -> float:
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


SCHEDULES: dict[str, Callable[[float, float], float]] = {"constant": _constant, "cosine": _cosine}
LR_SCHEDULES = tuple(SCHEDULES)


def lr_factor(step: int, *, total: int, warmup: int, kind: str, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): warmup ramps 1/warmup ... 1, then the shape
    `kind` (SCHEDULES) over the remaining steps. Plain arithmetic, so GRPO's scheduler (train/optim.py) and the
    warm start's trainer (sft/trainer.py) share it."""
    if step < warmup:
        return (step + 1) / warmup
    decay_steps = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / decay_steps)
    return SCHEDULES[kind](progress, min_ratio)


@dataclass(frozen=True)
class ScheduleSection:
    steps: int = option(100, "optimizer steps of the whole run")
    warmup_steps: int = option(0, "linear warmup from 0 to lr over this many steps")
    lr_schedule: str = option("constant", "shape after warmup", LR_SCHEDULES)
    min_lr_ratio: float = option(0.0, "cosine: final lr as a fraction of the peak")

    def __post_init__(self) -> None:
        one_of("schedule.lr_schedule", self.lr_schedule, LR_SCHEDULES)
        require(self.steps >= 1, "schedule.steps must be >= 1")
        require(0 <= self.warmup_steps <= self.steps, "schedule.warmup_steps must be in [0, schedule.steps]")
        require(0 <= self.min_lr_ratio <= 1, "schedule.min_lr_ratio must be in [0, 1]")


@dataclass(frozen=True)
class MemorySection:
    """How weights and activations are held during training, and micro-batching: one class from the YAML to
    apply_memory_config and the update step."""

    precision: str = option("auto", "weights dtype: auto (bf16 on a CUDA card with native bf16, compute "
                                            "capability 8.0+; fp32 on older cards, not fp16, which would need loss "
                                            "scaling the engine does not do; on a CPU bf16 for adapter training "
                                            "(LoRA) where the CPU has native bf16 dot products (AVX512_BF16, AMX) "
                                            "and measures the model's products faster in bf16, else fp32; the "
                                            "choice and why are printed and kept on resume) | fp32 | bf16 (refused "
                                            "on a card without native bf16)")
    activation_checkpointing: str = option(
        "auto", "auto (CPU: every block when one micro-batch's activations would be >= 1/4 of weights + gradients + "
                "optimizer state and >= 256 MiB, else none; CUDA: the least recompute the memory planner predicts "
                "fits the card with micro-batches of 4,096+ tokens) | none | all (every block) | every_k (every k-th "
                "block)")
    checkpoint_every: int = option(2, "k for activation_checkpointing=every_k")
    empty_cache_between_phases: bool = option(True, "gc + torch.cuda.empty_cache() between rollout and training")
    allow_tf32: bool = option(True, "TF32 matmuls for fp32 weights on Ampere+ GPUs")
    micro_batch_tokens: int = option(0, "token budget of one forward/backward micro-batch: padded rows x length, "
                                        "or with share_prompt_forward prompts x prompt length + rows x completion "
                                        "length. 0 = auto: 1024 on CPU; on CUDA the largest the memory planner "
                                        "predicts fits the card (memory.gpu_memory_gib, else the device's memory)")
    auto_halve_micro_batch: bool = option(False, "on CUDA out-of-memory halve micro_batch_tokens and retry the step")
    logprob_chunk_size: int = option(0, "tokens per chunk when computing log-probs from hidden states. 0 = auto: "
                                        "256 on CPU; on CUDA the largest that fits the card, as micro_batch_tokens")
    share_prompt_forward: bool = option(True, "run each prompt once per group in the update forward, its "
                                              "completions attending to its keys/values (same numbers as false, "
                                              "less compute)")
    skip_zero_advantage: bool = option(True, "leave rows whose advantage is 0 out of the update when the loss gives "
                                             "them no gradient (beta = 0, entropy_coef = 0, no top-entropy mask): the "
                                             "same update, less compute; the update's metrics then cover the rows "
                                             "trained")
    cpu_update_mmap: str = option("auto", "CPU with glibc: true: during the update, allocations of 1 MiB and "
                                          "more are mmapped and returned to the OS when freed (a flat peak RSS "
                                          "instead of heap fragmentation; costs page faults: 5-45% more update "
                                          "time, by host); trim: the heap, its freed pages released at the "
                                          "update's start and end (half of true's RSS saving at the heap's speed); "
                                          "auto = false: the heap (why: plan/device_defaults.py update_mmap_choice)",
                                  choices=UPDATE_MMAP)
    gpu_memory_gib: float = option(0.0, "GPU memory of the target card; > 0: `grpo train` refuses, before loading "
                                        "the model, a config the memory planner predicts will not fit; 0 = no check")

    def __post_init__(self) -> None:
        require(self.precision in PRECISIONS,
                f"memory.precision={self.precision!r}; choose from {', '.join(PRECISIONS)}")
        require(self.activation_checkpointing in CHECKPOINTING,
                f"memory.activation_checkpointing={self.activation_checkpointing!r}; choose from {list(CHECKPOINTING)}")
        require(self.checkpoint_every >= 1, f"memory.checkpoint_every={self.checkpoint_every} must be >= 1")
        require(self.micro_batch_tokens >= 0, "memory.micro_batch_tokens must be >= 1, or 0 for auto")
        require(self.logprob_chunk_size >= 0, "memory.logprob_chunk_size must be >= 1, or 0 for auto")
        require(self.gpu_memory_gib >= 0, "memory.gpu_memory_gib must be >= 0 (0 = no memory pre-flight check)")
        mmap = str(self.cpu_update_mmap).lower()  # YAML's true / false arrive as "True" / "False"
        object.__setattr__(self, "cpu_update_mmap", mmap)  # a frozen section normalizes its own field
        one_of("memory.cpu_update_mmap", self.cpu_update_mmap, UPDATE_MMAP)


@dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the targeted projections; the rest of the model is frozen."""

    enabled: bool = option(False, "train LoRA adapters instead of all weights")
    rank: int = option(16, "adapter rank r")
    alpha: float = option(32.0, "scale numerator: the update is (alpha / r) B A x")
    dropout: float = option(0.0, "dropout on the adapter input during training")
    target_modules: list[str] = option(
        list(LORA_TARGETS), "projections to adapt: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj; a "
        "model with fused projections (Phi-3) adapts qkv_proj for any of q/k/v, gate_up_proj for gate or up")
    init: str = option("kaiming", "lora_A init: kaiming (uniform) | gaussian")
    adapter_dtype: str = option("float32", "dtype of lora_A / lora_B (fp32 keeps small updates exact)")
    quantize_base: str = option("none", "none | nf4 (QLoRA: 4-bit base, CUDA only)")
    quant_backend: str = option("auto", "auto | torchao | bitsandbytes (for nf4)")
    strict: bool = option(False, "fail instead of falling back to plain LoRA when nf4 is unavailable")

    def __post_init__(self) -> None:
        require(self.rank > 0, f"lora.rank must be > 0, got {self.rank}")
        require(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}")
        bad = sorted(set(self.target_modules) - set(LORA_TARGETS + FUSED_LORA_TARGETS))
        require(not bad and bool(self.target_modules),
                f"lora.target_modules {bad or '[]'} invalid; choose from {list(LORA_TARGETS + FUSED_LORA_TARGETS)}")
        require(self.init in LORA_INITS, f"lora.init={self.init!r}; choose from {sorted(LORA_INITS)}")
        require(self.quantize_base in ("none", "nf4"), f"lora.quantize_base={self.quantize_base!r}; choose none or nf4")
        require(self.quant_backend in ("auto", *NF4_BACKENDS),
                f"lora.quant_backend={self.quant_backend!r}; choose {', '.join(['auto', *NF4_BACKENDS])}")
        require(self.adapter_dtype in ADAPTER_DTYPES,
                f"lora.adapter_dtype={self.adapter_dtype!r} is not one of {', '.join(ADAPTER_DTYPES)}")


@dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-start settings."""

    steps: int = option(0, "optimizer steps of supervised training; 0 = no SFT phase")
    batch_size: int = option(32, "(prompt, completion) pairs per step")
    lr: float = option(3e-3, "peak AdamW learning rate (linear warmup, cosine decay)")
    warmup_steps: int = option(20, "linear warmup steps")
    weight_decay: float = option(0.0, "AdamW weight decay")
    adam_beta2: float = option(0.95, "AdamW beta2; < 0.999 so the large format-learning gradients of the first "
                                     "steps do not damp later updates for long")
    seed: int = option(0, "seed for batch order")
    examples: int = option(0, "train on the first N examples of the task's training split (0: all of it); a short "
                              "cold start of a real model needs only steps x batch_size of them")
    own_answers: bool = option(False, "examples the task's teacher answers without a tool get the model's own greedy "
                                      "reply (before the warm start, same prompt) as their target: the warm start "
                                      "teaches the calls and leaves the model's other answers as they were")
    top_layers: int = option(0, "train only the last N transformer blocks and the final norm (0: every weight); the "
                                "embeddings and the blocks below stay as they were: a cold start that teaches a "
                                "format without disturbing what the lower layers compute (and a cheaper backward)")

    def __post_init__(self) -> None:
        require(self.steps >= 0 and self.batch_size >= 1, "warm_start.sft: steps must be >= 0, batch_size >= 1")
        require(self.examples >= 0, f"warm_start.sft.examples={self.examples} must be >= 0 (0: all)")
        require(self.top_layers >= 0, f"warm_start.sft.top_layers={self.top_layers} must be >= 0 (0: all)")
        require(math.isfinite(self.lr) and self.lr > 0, f"warm_start.sft.lr={self.lr} must be finite and > 0")
        require(self.warmup_steps >= 0 and 0 <= self.adam_beta2 < 1,
                "warm_start.sft: warmup_steps must be >= 0 and adam_beta2 in [0, 1)")


@dataclass(frozen=True)
class TinyModelSection:
    arch: str = option("", "build a random tiny model of this family in run_dir/base ('' = start from model.path)",
                       TINY_ARCHS)
    hidden_size: int = option(256, "tiny model width")
    num_hidden_layers: int = option(4, "tiny model depth")
    num_attention_heads: int = option(4, "tiny model attention heads")
    num_key_value_heads: int = option(2, "tiny model key/value heads (grouped-query attention)")
    intermediate_size: int = option(512, "tiny model SwiGLU width")
    rope_theta: float | None = option(None, "tiny model RoPE base; None: the family's (lower: sharper relative "
                                            "positions, which a tiny model copying numbers needs)")
    seed: int = option(0, "seed of the tiny model's random weights")

    def shape(self) -> dict:
        """The model-config overrides of tiny_config / make_tiny_checkpoint."""
        return {"hidden_size": self.hidden_size, "num_hidden_layers": self.num_hidden_layers,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "intermediate_size": self.intermediate_size,
                **({"rope_theta": self.rope_theta} if self.rope_theta is not None else {})}

    def __post_init__(self) -> None:
        one_of("warm_start.tiny.arch", self.arch, TINY_ARCHS)


@dataclass(frozen=True)
class WarmStartSection:
    tiny: TinyModelSection = section(TinyModelSection, "optional tiny random base model (CPU demo, tests)")
    sft: SFTConfig = section(SFTConfig, "supervised warm start on the task's reference completions; steps=0: off")
