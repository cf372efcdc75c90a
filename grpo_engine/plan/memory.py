"""Memory planner: predict peak GPU memory of one GRPO step, phase by phase, before buying the OOM.

A step has four phases whose footprints differ (see docs/memory.md):
  rollout    weights + resident optimizer state + KV cache for all rows + prefill/decode transients (on CUDA the
             static decode state and its graphs' pool instead, kept through every phase: plan/decode_state.py;
             with an evaluation, a fifth phase: its prompts' prefill, and when it is larger than the rollout its own
             decode state, freed after it)
  scoring    old/reference log-probs, no grad: weights + one micro-batch's forward transients
  training   weights + gradients + optimizer state + saved activations of one micro-batch + backward
             transients + log-prob chunk buffers
  optimizer  weights + gradients + state + the update's temporaries
The peak is the largest phase plus allocator fragmentation plus the CUDA context. Every term is a formula
of the model shape and the knobs, written next to the code that the term counts, so a wrong prediction
points at one line. The activation term counts the tensors autograd saves in OUR transformer.py (checked
against measured CPU memory in tests/plan/test_plan.py).

Assumptions (stated, so they can be checked): attention uses a fused SDPA kernel (flash / memory-efficient:
no [T, T] score matrix is stored); rollout prefills each prompt once and shares its KV across the G
completions; decode keeps rows x (prompt + completion) KV slots preallocated; log-probs are computed in
chunks of `logprob_chunk` tokens with only one chunk's [chunk, V] fp32 buffers alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config.training import LORA_TARGETS as ALL_LINEAR
from ..model.config import ModelConfig
from .decode_state import DecodeCall, DecodePlan, decode_plan, kv_state_bytes, sampler_step_bytes

GIB = 1024**3
MIB = 1024**2
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# 4-bit codes + an int8 scale per 64-block + an fp32 factor per 256 blocks (double quantization)
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
ADAM8BIT_BYTES_PER_PARAM = 2 + 2 * 4 / 256  # two 8-bit moments + an fp32 scale per 256-block each


@dataclass
class PlanInput:
    """The knobs that decide GPU memory for one GRPO step."""

    prompts_per_step: int = field(default=8, metadata={"help": "P: prompts drawn per step"})
    group_size: int = field(default=8, metadata={"help": "G: completions per prompt"})
    prompt_len: int = field(default=256, metadata={"help": "longest prompt in tokens"})
    completion_len: int = field(default=512, metadata={"help": "max new tokens per completion"})
    mode: str = field(default="full", metadata={"help": "full | lora | qlora (NF4 base)"})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank r"})
    lora_targets: list[str] = field(
        default_factory=lambda: list(ALL_LINEAR), metadata={"help": "LoRA target projections"}
    )
    precision: str = field(default="bf16", metadata={"help": "weights dtype: fp32 | bf16"})
    optimizer: str = field(
        default="adamw", metadata={"help": "adamw | adamw_fused | adamw_offload | adamw_8bit"}
    )
    master_weights: bool = field(default=True, metadata={"help": "fp32 master copy for bf16 params"})
    activation_checkpointing: str = field(default="none", metadata={"help": "auto | none | all | every_k"})
    checkpoint_every: int = field(default=2, metadata={"help": "k for every_k"})
    micro_batch_rows: int = field(default=4, metadata={"help": "completions per training micro-batch"})
    logprob_chunk: int = field(default=1024, metadata={"help": "tokens per log-prob chunk"})
    rollout_rows_in_flight: int = field(default=0, metadata={"help": "rows decoded at once (0 = all P*G)"})
    reference: str = field(default="none", metadata={"help": "KL ref: none | gpu_copy | cpu | adapters"})
    static_decode: bool = field(default=True, metadata={
        "help": "rollout.cuda_graphs on: the static decode state (KV cache of a batch bucket, captured graphs) "
                "stays allocated through every phase"})
    max_tokens_in_flight: int = field(default=0, metadata={
        "help": "rollout.max_tokens_in_flight (0 = one wave a call): static decode's waves of short prompts hold "
                "up to this // (1 + new tokens) rows"})
    temperature: float = field(default=1.0, metadata={"help": "rollout sampling temperature (0 = greedy)"})
    top_k: int = field(default=0, metadata={"help": "rollout top-k filter (0 = off)"})
    top_p: float = field(default=1.0, metadata={"help": "rollout top-p filter (1 = off): its sort's temporaries"})
    min_p: float = field(default=0.0, metadata={"help": "rollout min-p filter (0 = off)"})
    eval_examples: int = field(default=0, metadata={
        "help": "examples an evaluation decodes, one row each (0 = no evaluation on the card)"})
    eval_new_tokens: int = field(default=256, metadata={"help": "the evaluations' longest max_new_tokens"})
    eval_temperature: float = field(default=0.0, metadata={"help": "the evaluations' temperature (0 = greedy)"})
    curriculum_prompts: int = field(default=0, metadata={
        "help": "prompts the curriculum's pool scoring generates at once (0 = no curriculum)"})
    curriculum_samples: int = field(default=4, metadata={"help": "completions per scored prompt"})
    curriculum_new_tokens: int = field(default=0, metadata={
        "help": "the curriculum scoring's max new tokens (0 = completion_len)"})
    cuda_context_gib: float = field(default=0.5, metadata={"help": "CUDA context + kernels, outside torch"})
    fragmentation: float = field(default=0.10, metadata={"help": "allocator slack as a fraction of the peak"})

    def __post_init__(self) -> None:
        choices = {
            "mode": ("full", "lora", "qlora"),
            "precision": tuple(DTYPE_BYTES),
            "optimizer": ("adamw", "adamw_fused", "adamw_offload", "adamw_8bit"),
            "activation_checkpointing": ("auto", "none", "all", "every_k"),
            "reference": ("none", "gpu_copy", "cpu", "adapters"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"plan {name}={getattr(self, name)!r}; choose from {', '.join(allowed)}")
        for name in ("prompts_per_step", "group_size", "prompt_len", "completion_len", "micro_batch_rows",
                     "logprob_chunk", "lora_rank", "checkpoint_every", "eval_new_tokens", "curriculum_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"plan {name}={getattr(self, name)} must be >= 1")
        for name in ("max_tokens_in_flight", "eval_examples", "curriculum_prompts", "curriculum_new_tokens",
                     "temperature", "eval_temperature", "top_k", "min_p"):
            if getattr(self, name) < 0:
                raise ValueError(f"plan {name}={getattr(self, name)} must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"plan top_p={self.top_p} must be in (0, 1] (1 = off)")
        if self.reference == "adapters" and self.mode == "full":
            raise ValueError("reference=adapters needs mode=lora or qlora (full fine-tuning has no adapters)")


@dataclass
class Phase:
    """One phase's live GPU memory, by named component (bytes)."""

    name: str
    components: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.components.values())


@dataclass
class MemoryPlan:
    model: ModelConfig
    knobs: PlanInput
    n_params: int  # all weights (tied embedding once)
    n_trainable: int
    phases: list[Phase]
    peak_phase: str
    peak_bytes: float  # largest phase, before fragmentation and CUDA context
    total_gib: float  # what the card must hold: peak * (1 + fragmentation) + CUDA context
    decode: DecodePlan | None = None  # the static decode's kept state and pool (None: rollout.cuda_graphs off)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)


# ----------------------------------------------------------------------------------------------------
# Parameter counts


def linear_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Projection name -> (in, out) of one layer."""
    q, kv, d, inter = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, \
        cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, inter), "up_proj": (d, inter), "down_proj": (inter, d)}


def param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(all parameters, parameters in the 7 projections of all layers)."""
    shapes = linear_shapes(cfg)
    linear = sum(i * o for i, o in shapes.values())
    q, kv = shapes["q_proj"][1], shapes["k_proj"][1]
    bias = ((q + 2 * kv if cfg.attention_bias or cfg.family.qkv_bias else 0) + (cfg.hidden_size if cfg.o_bias else 0)
            + (2 * cfg.intermediate_size + cfg.hidden_size if cfg.mlp_bias else 0))
    qk_norm = {"head": 2 * cfg.head_dim, "proj": q + kv}.get(cfg.qk_norm, 0)  # one weight per norm's width
    norms = (4 if cfg.family.norm == "sandwich" else 2) * cfg.hidden_size + qk_norm
    embed = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    total = embed + head + cfg.hidden_size + cfg.num_hidden_layers * (linear + bias + norms)
    return total, cfg.num_hidden_layers * linear


def lora_target_shapes(cfg: ModelConfig, targets) -> list[tuple[int, int]]:
    """(in, out) of each adapted projection of one layer: a family with fused projections (Phi-3) adapts one
    qkv_proj for any of q / k / v and one gate_up_proj for gate / up (model/lora.py family_targets)."""
    shapes, fam = linear_shapes(cfg), cfg.family
    groups = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    fused = {g for g in groups if (fam.fused_qkv if g == "qkv_proj" else fam.fused_gate_up)}
    out, seen = [], set()
    for t in targets:
        group = next((g for g, parts in groups.items() if t == g or t in parts), None)
        if group in fused:
            if group not in seen:
                seen.add(group)
                parts = [shapes[p] for p in groups[group]]
                out.append((parts[0][0], sum(o for _, o in parts)))
        else:
            out += [shapes[p] for p in groups[group]] if t in groups else [shapes[t]]
    return out


def lora_param_count(cfg: ModelConfig, k: PlanInput) -> int:
    shapes = lora_target_shapes(cfg, k.lora_targets)
    return cfg.num_hidden_layers * sum(k.lora_rank * (i + o) for i, o in shapes)


def targeted_linear_count(cfg: ModelConfig, k: PlanInput) -> int:
    return cfg.num_hidden_layers * sum(i * o for i, o in lora_target_shapes(cfg, k.lora_targets))


# ----------------------------------------------------------------------------------------------------
# Terms


def weight_bytes(cfg: ModelConfig, k: PlanInput) -> float:
    s = DTYPE_BYTES[k.precision]
    total, _ = param_counts(cfg)
    if k.mode == "full":
        return total * s
    adapters = lora_param_count(cfg, k) * 4  # fp32 adapters
    if k.mode == "lora":
        return total * s + adapters
    quantized = targeted_linear_count(cfg, k)
    return (total - quantized) * s + quantized * NF4_BYTES_PER_PARAM + adapters


def trainable(cfg: ModelConfig, k: PlanInput) -> tuple[int, int]:
    """(trainable parameter count, bytes per trainable element)."""
    if k.mode == "full":
        return param_counts(cfg)[0], DTYPE_BYTES[k.precision]
    return lora_param_count(cfg, k), 4


def optimizer_state_bytes(cfg: ModelConfig, k: PlanInput) -> float:
    """GPU-resident optimizer state (offload keeps all of it in CPU RAM)."""
    n, s = trainable(cfg, k)
    if k.optimizer == "adamw_offload":
        return 0.0
    if k.optimizer == "adamw_8bit":
        return n * ADAM8BIT_BYTES_PER_PARAM
    master = 4 if (s != 4 and k.master_weights) else 0
    moments = 2 * (4 if k.master_weights else s)
    return n * (moments + master)


def optimizer_temp_bytes(cfg: ModelConfig, k: PlanInput) -> float:
    """Temporaries of the update: foreach AdamW builds sqrt(v) for ALL params at once; fused and offloaded
    ones work in place or per parameter (largest parameter: the embedding or a projection)."""
    n, s = trainable(cfg, k)
    largest = cfg.vocab_size * cfg.hidden_size if k.mode == "full" else max(
        k.lora_rank * max(shape) for shape in lora_target_shapes(cfg, k.lora_targets))
    if k.optimizer == "adamw_offload":
        return largest * s  # one parameter's copy-back staging
    if k.optimizer == "adamw_fused" or (k.optimizer == "adamw" and s != 4 and k.master_weights):
        return largest * 4 * 3  # per-parameter fp32 grad, sqrt(v), denom
    if k.optimizer == "adamw_8bit":
        return largest * 4 * 2  # dequantized moments of one block group
    return n * 4  # foreach: one full-size fp32 temporary


def saved_bytes_per_token_layer(cfg: ModelConfig, k: PlanInput) -> float:
    """Bytes autograd keeps per token per transformer block (no checkpointing), from transformer.py:
    2 RMSNorms x (input, output) = 4d (the norm's own backward keeps only its input and 1/rms); q, k, v after
    RoPE and the SDPA output (saved by SDPA; o_proj's input is a view of that output, which SDPA lays out like q,
    [B, T, H, D]) = 2 q + 2 kv; MLP: gate out, up out (kept by the SwiGLU function) and their product
    (down_proj's input) = 3 inter; q/k RMSNorms (Qwen3 per head, OLMo 2 over the projection) keep their inputs,
    q + kv. Post-norm blocks (OLMo 2) keep the same 4d: each norm's input, and the block's and the MLP's input
    (kept by the projections) in place of the pre-norms' outputs. A fused gate_up_proj (Phi-3) keeps its product
    whole, the same 2 inter; a fused qkv_proj's v is a view of the whole [q | k | v] product, which SDPA keeps:
    q + kv more. Sandwich blocks (Gemma 3) keep 2d more, the inputs of the norms after each branch; GeGLU runs on
    autograd's graph, which keeps gelu(gate) too: one inter more. Multipliers keep nothing. LoRA keeps its rank-r
    intermediate per target. Small [T, 1]-like tensors (1/rms, SDPA's log-sum-exp, the RoPE tables) are left
    out. tests/plan/test_plan.py checks the count against what autograd keeps."""
    s = DTYPE_BYTES[k.precision]
    d, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    elements = 4 * d + training_attention_elements(cfg) + 3 * i + (q + kv if cfg.qk_norm else 0) \
        + (q + kv if cfg.family.fused_qkv else 0) + (2 * d if cfg.family.norm == "sandwich" else 0) \
        + (i if cfg.family.activation != "silu" else 0)
    lora = 4 * k.lora_rank * len(lora_target_shapes(cfg, k.lora_targets)) if k.mode != "full" else 0
    return elements * s + lora


def training_attention_elements(cfg: ModelConfig) -> int:
    """Elements per token and block the training attention keeps for its backward: q, K and V after RoPE and the
    output, 2 q + 2 kv. On CUDA with grouped KV heads q is kept as its stacked copy (model/transformer.py
    grouped_sdpa; q's size, the RoPE output then freed) and K and V once per KV head, never copied per query head;
    on the CPU SDPA's enable_gqa or the grouped kernel keep the same. The masked batch's additive bias is built once
    per forward: attention_bias_bytes."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return 2 * q + 2 * kv


def attention_bias_bytes(cfg: ModelConfig, rows: int, seq: int, itemsize: int) -> float:
    """The additive bias a CUDA forward of `rows` rows of `seq` tokens builds once and every block keeps
    (model/transformer.py cuda_attention_bias): [rows, 1, G x seq, seq rounded up to 16], G = H / H_kv."""
    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    return rows * groups * seq * (-(-seq // 16) * 16) * itemsize


def layer_transient_bytes(cfg: ModelConfig, k: PlanInput, tokens: int) -> float:
    """Largest short-lived buffers while one block runs forward (or its backward): the MLP's three
    [tokens, inter] tensors and their gradients, and the NF4 weight dequantized for one matmul."""
    s = DTYPE_BYTES[k.precision]
    mlp = tokens * cfg.intermediate_size * s * 3
    dequant = cfg.hidden_size * cfg.intermediate_size * 2 if k.mode == "qlora" else 0
    return mlp + dequant


# activation_checkpointing=auto checkpoints every block when one micro-batch's saved activations would be at
# least this share of the training state that is alive anyway (weights + gradients + optimizer state), and at
# least AUTO_CHECKPOINT_MIN_BYTES (less is not worth a slower backward on any machine the engine targets).
AUTO_CHECKPOINT_SHARE = 0.25
AUTO_CHECKPOINT_MIN_BYTES = 256 * MIB


def resolve_checkpointing(cfg: ModelConfig, k: PlanInput, tokens: int) -> str:
    """The checkpointing a micro-batch of `tokens` runs with: the knob itself, or for "auto" "all" / "none" by
    AUTO_CHECKPOINT_SHARE and AUTO_CHECKPOINT_MIN_BYTES. Why a share of the state: checkpointing costs one more
    forward of the blocks, worth it where activations are a large part of the peak. SmolLM2-135M (30 blocks of
    width 576, fp32, 1,024 tokens): 1.0 GB of activations against 2.1 GB of state -> "all"; the 100M Qwen2
    shape with a 151,936 vocabulary (8 blocks of width 512): 0.25 GB against 1.6 GB -> "none" (its LM head, not
    its blocks, dominates); the tiny demo model: 104 MiB against 10 MiB -> "none" (below the floor)."""
    if k.activation_checkpointing != "auto":
        return k.activation_checkpointing
    saved = cfg.num_hidden_layers * saved_bytes_per_token_layer(cfg, k) * tokens
    n, s = trainable(cfg, k)
    state = weight_bytes(cfg, k) + n * s + optimizer_state_bytes(cfg, k)
    worth_it = saved >= AUTO_CHECKPOINT_SHARE * state and saved >= AUTO_CHECKPOINT_MIN_BYTES
    return "all" if worth_it else "none"


CHECKPOINT_MODES = ("none", "all", "every_k")  # what "auto" resolves among (resolve_checkpointing)


def checkpoint_every(mode: str, k: int) -> int:
    """k of kernels.apply_activation_checkpointing for a resolved mode: 0 = off, 1 = every block."""
    return {"none": 0, "all": 1, "every_k": k}[mode]


def activation_bytes(cfg: ModelConfig, k: PlanInput, tokens: int) -> tuple[float, float]:
    """(saved activations of all blocks, recompute buffer of one checkpointed block) for a micro-batch."""
    per_layer = saved_bytes_per_token_layer(cfg, k) * tokens
    every = checkpoint_every(resolve_checkpointing(cfg, k, tokens), k.checkpoint_every)
    layers = cfg.num_hidden_layers
    if every == 0:
        return layers * per_layer, 0.0
    checkpointed = (layers + every - 1) // every  # blocks i with i % every == 0
    block_inputs = tokens * cfg.hidden_size * DTYPE_BYTES[k.precision]
    return checkpointed * block_inputs + (layers - checkpointed) * per_layer, per_layer


def logprob_bytes(cfg: ModelConfig, k: PlanInput, tokens: int, buffers: int = 3) -> float:
    """Final hidden states [tokens, d] + one chunk's fp32 [chunk, V] buffers: logits, log-softmax and (in
    training) its gradient."""
    chunk = min(k.logprob_chunk, tokens)
    return tokens * cfg.hidden_size * DTYPE_BYTES[k.precision] + buffers * chunk * cfg.vocab_size * 4


def backward_working_set(cfg: ModelConfig, k: PlanInput, tokens: int, recompute: float) -> dict[str, float]:
    """Backward first runs through the log-prob head (chunk buffers), then through the blocks (recompute
    + gradient transients); the two are not alive together, so only the larger one counts."""
    head = logprob_bytes(cfg, k, tokens)
    blocks = recompute + layer_transient_bytes(cfg, k, tokens)
    if head >= blocks:
        return {"backward working set (log-prob chunks)": head}
    return {"backward working set (block recompute)": blocks}


def kv_cache_bytes(cfg: ModelConfig, k: PlanInput, full: bool = False) -> int:
    """The rollout rows' keys and values at prompt + completion slots, as the decode cache holds them (a sliding
    layer at most its window + CHUNK: kv_state_bytes; full=True: every slot of every layer)."""
    return kv_state_bytes(cfg, rollout_rows(k), k.prompt_len + k.completion_len, DTYPE_BYTES[k.precision],
                          rings=not full)


def decode_calls(k: PlanInput) -> list[DecodeCall]:
    """The generate() calls of a run, each at its largest wave (rollout/generate.py rows_in_flight, at one-token
    prompts: the wave that holds the most rows): the rollout's, the evaluations' (greedy by default, one row per
    example), the curriculum scoring's (the rollout's sampling, `samples` rows per prompt)."""
    from ..rollout.generate import rows_in_flight

    filters = dict(top_k=k.top_k, top_p=k.top_p, min_p=k.min_p)
    budget = k.max_tokens_in_flight
    rollout = rows_in_flight(k.prompts_per_step, k.group_size, 1 + k.completion_len, budget) if budget \
        else rollout_rows(k)
    calls = [DecodeCall("rollout", rollout, k.prompt_len, k.completion_len, k.temperature, **filters)]
    if k.eval_examples:
        rows = rows_in_flight(k.eval_examples, 1, 1 + k.eval_new_tokens, budget)
        calls.append(DecodeCall("eval", rows, k.prompt_len, k.eval_new_tokens, k.eval_temperature, **filters))
    if k.curriculum_prompts:
        new = k.curriculum_new_tokens or k.completion_len
        rows = rows_in_flight(k.curriculum_prompts, k.curriculum_samples, 1 + new, budget)
        calls.append(DecodeCall("curriculum", rows, k.prompt_len, new, k.temperature, **filters))
    return calls


def static_decode_plan(cfg: ModelConfig, k: PlanInput) -> DecodePlan:
    """The static decode state (plan/decode_state.py) kept across phases: the union of every call's rows, slots
    (rounded as the decoder rounds them) and uniforms, the decoder's [rows, V] buffers, and the captured graphs'
    pool (the largest step's temporaries: the sampler's for the configured filters, or the forward's)."""
    return decode_plan(cfg, decode_calls(k), DTYPE_BYTES[k.precision])


def dynamic_sampler_bytes(cfg: ModelConfig, k: PlanInput) -> float:
    """An eager decode's sampler at the rollout's rows: its temporaries for the filters, its work buffer and the
    LM head's [rows, V] logits buffer."""
    rollout = decode_calls(k)[0]
    s = DTYPE_BYTES[k.precision]
    return sampler_step_bytes(rollout, rollout.rows, cfg.vocab_size, s) + rollout.rows * cfg.vocab_size * (4 + s)


def rollout_rows(k: PlanInput) -> int:
    rows = k.prompts_per_step * k.group_size
    return min(rows, k.rollout_rows_in_flight) if k.rollout_rows_in_flight else rows


def reference_bytes(cfg: ModelConfig, k: PlanInput) -> float:
    if k.reference != "gpu_copy":
        return 0.0
    return param_counts(cfg)[0] * DTYPE_BYTES[k.precision]


# ----------------------------------------------------------------------------------------------------
# The plan


def plan_memory(model_cfg: ModelConfig, knobs: PlanInput) -> MemoryPlan:
    """Predict the GPU memory of each phase of one GRPO step and the peak (see module docstring)."""
    # a micro-batch beyond the step's rows (memory.micro_batch_tokens meaning 'all at once') holds the step's rows
    c, k = model_cfg, replace(knobs, micro_batch_rows=min(knobs.micro_batch_rows,
                                                          knobs.prompts_per_step * knobs.group_size))
    n_train, grad_s = trainable(c, k)
    resident = {
        "weights": weight_bytes(c, k),
        "optimizer state": optimizer_state_bytes(c, k),
        "reference copy": reference_bytes(c, k),
    }
    tokens = k.micro_batch_rows * (k.prompt_len + k.completion_len)
    saved, recompute = activation_bytes(c, k, tokens)
    rows = rollout_rows(k)
    prefill_tokens = min(k.prompts_per_step, rows) * k.prompt_len
    decode = static_decode_plan(c, k) if k.static_decode else None
    kept = {"static decode state (kept)": sum(decode.state.values()), "decode graphs' pool (kept)": decode.pool} \
        if decode else {}
    resident = {**resident, **kept}
    s = DTYPE_BYTES[k.precision]
    prefill = layer_transient_bytes(c, k, prefill_tokens) + 2 * prefill_tokens * c.hidden_size * s
    rollout = Phase("rollout", {
        **resident,
        **({} if decode else {"kv cache": kv_cache_bytes(c, k)}),
        "prefill/decode transients": prefill if decode else max(prefill, dynamic_sampler_bytes(c, k)),
    })
    scoring = Phase("scoring", {
        **resident,
        "forward transients": layer_transient_bytes(c, k, tokens) + 2 * tokens * c.hidden_size * 4,
        "log-prob chunks": logprob_bytes(c, k, tokens, buffers=2),
    })
    training = Phase("training", {
        **resident,
        "gradients": n_train * grad_s,
        "saved activations": saved,
        "attention bias": attention_bias_bytes(c, k.micro_batch_rows, k.prompt_len + k.completion_len, s),
        **backward_working_set(c, k, tokens, recompute),
    })
    optimizer = Phase("optimizer", {
        **resident,
        "gradients": n_train * grad_s,
        "update temporaries": optimizer_temp_bytes(c, k),
    })
    phases = [rollout, scoring, training, optimizer] + eval_phases(c, k, resident, decode)
    peak = max(phases, key=lambda p: p.total)
    total = peak.total * (1 + k.fragmentation) + k.cuda_context_gib * GIB
    return MemoryPlan(c, k, param_counts(c)[0], n_train, phases, peak.name, peak.total, total / GIB, decode)


def eval_phases(cfg: ModelConfig, k: PlanInput, resident: dict[str, float], decode: DecodePlan | None) -> list[Phase]:
    """The evaluations on the static decode: everything resident (the kept state included), the prefill of a wave's
    prompts (one an example, so more than the rollout's P), and when the kept state cannot hold them their own state
    and graphs' pool (static_decode.transient_static_decode), alive during eval only."""
    evals = [c for c in decode.calls if c.name == "eval"] if decode is not None else []
    if not evals:
        return []
    prompts = max(c.rows for c in evals) * k.prompt_len  # one row an example
    s = DTYPE_BYTES[k.precision]
    own = {"eval's decode state (freed after)": sum(decode.eval_state.values()),
           "eval's graphs' pool (freed after)": decode.eval_pool} if decode.eval_shape is not None else {}
    prefill = layer_transient_bytes(cfg, k, prompts) + 2 * prompts * cfg.hidden_size * s
    return [Phase("eval", {**resident, **own, "prefill transients": prefill})]


def fits(plan: MemoryPlan, card_gib: float) -> bool:
    """Whether the step's predicted peak (with fragmentation and CUDA context) fits a card of card_gib."""
    return plan.total_gib <= card_gib
