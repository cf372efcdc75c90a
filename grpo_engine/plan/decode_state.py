"""The static decode's memory as the planner counts it: the state it keeps and the step's temporaries.

On CUDA (rollout.cuda_graphs on) every generate() call, single-turn or with tools, decodes on one static state per
model (rollout/static_cache.py, rollout/static_decode.py static_decoder): B rows (the bucket of the call's largest
wave: 1, 2, 4, ... then multiples of 512), S slots (longest prompt + max_new_tokens, or + tools.max_tokens for
trajectories, rounded up to a multiple of SLOT_ROUNDING) plus one scratch slot, U uniforms a row (max_new_tokens, or
tools.max_tokens). A call that does not fit the held state replaces it by the union of both sizes,
so what stays is sized by the largest call of the run, not by the rollout alone: the rollout (P x G rows, or the
whole groups that fit rollout.max_tokens_in_flight), the in-loop eval (its examples, one row each, in waves) and the
curriculum's pool scoring (chunks of P x G / samples prompts, `samples` rows each). The captured graphs share one
memory pool, which holds the largest step's temporaries: the forward's, and the sampler's for the call's filters.

The rollout's state and graphs stay across steps (re-allocating and re-capturing them each step costs seconds): the
kept state is the union of the training calls (rollout, curriculum) and of an evaluation they hold. An evaluation
they cannot hold (more rows than their bucket, longer replies) decodes under static_decode.transient_static_decode on
a state and graphs' pool of its own, beside the kept ones while it runs and freed after it: a peak of the eval phase
(`DecodePlan.eval_state`, `eval_pool`), not memory kept through the training phases (docs/memory.md).

torch is imported inside the functions (the sizes come from the rollout code itself): `grpo --help` imports the
planner without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..model.config import ModelConfig

# Bytes per element of a [rows, V] sampling step, by stage (rollout/sampling.py Sampler.__call__, fp32 logits):
TOP_K_STAGE = 1 + 4  # `logits < kth` (bool) and the masked_fill output (fp32)
MIN_P_STAGE = 1 + 4  # `logits < cut` (bool) and the masked_fill output
TOP_P_STAGE = 4 + 8 + 4 + 4 + 1 + 1 + 4  # sorted logits, order (int64), probs, mass_before (its cumsum is freed at
#                                          once), drop_sorted, drop (bool), the masked_fill output: alive at its end
TOP_P_SORT_WORKSPACE = 8 + 8 + 4 + 8  # CUDA's segmented sort of [R, V] as one full sort: (segment, index) pairs in and
#                                       out, cub's alternate keys and values; an upper bound, alive during the sort only
NORMALISER_STAGE = 4 + 4  # the full softmax's log-sum-exp over the scaled logits: `logits - top` and its exp


@dataclass(frozen=True)
class DecodeCall:
    """One kind of generate() call of a run, as the static decode sizes it."""

    name: str  # rollout | eval | curriculum
    rows: int  # rows of its largest wave (prompts in the wave x samples per prompt)
    prompt_len: int  # longest prompt, tokens
    new_tokens: int  # max_new_tokens
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def slots(self) -> int:
        return self.prompt_len + self.new_tokens


@dataclass(frozen=True)
class StateShape:
    """The static state's capacity: B rows (a bucket), S slots (rounded, without the scratch slot), U uniforms."""

    rows: int
    slots: int
    columns: int


@dataclass
class DecodePlan:
    """What the static decode keeps for a run's calls, and what an evaluation it cannot hold adds while it runs
    (bytes)."""

    calls: list[DecodeCall]
    shape: StateShape  # the kept state: the union of the training calls' sizes (an eval it holds fits in it)
    state: dict[str, int]  # the kept state's and its decoder's own tensors, by buffer
    pool: int  # the kept graphs' pool: the largest step's temporaries over the calls the kept state runs
    eval_shape: StateShape | None = None  # the evaluation's own state (None: the kept state holds the evaluation)
    eval_state: dict[str, int] = field(default_factory=dict)  # its tensors, by buffer: alive during eval only
    eval_pool: int = 0  # its graphs' pool, freed with it

    @property
    def total(self) -> int:
        return sum(self.state.values()) + self.pool

    @property
    def releasable_after_eval(self) -> int:
        """What the evaluation's own decoder adds during eval and frees after it (0: the kept state runs it)."""
        return sum(self.eval_state.values()) + self.eval_pool


def kv_bytes_per_token(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Keys and values of one token in every layer: the one KV-cache formula (the planner's KV terms, the static
    state, the size check all multiply it)."""
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def kv_state_bytes(cfg: ModelConfig, rows: int, full: int, dtype_bytes: int, rings: bool = True) -> int:
    """Keys and values of `rows` rows of a decode cache whose full layers hold `full` slots a row: each layer's
    entries as the cache allocates them (rollout/static_cache.py layer_slots: a sliding layer at most its window +
    CHUNK; rings=False: every layer `full`, a cache without rings)."""
    from ..rollout.static_cache import layer_slots

    widths = layer_slots(cfg, full) if rings else [full] * cfg.num_hidden_layers
    return rows * sum(widths) * (kv_bytes_per_token(cfg, dtype_bytes) // cfg.num_hidden_layers)


def state_shape(calls: list[DecodeCall]) -> StateShape:
    """The union static_decoder keeps: bucket_for of the most rows, the most slots rounded up, the most uniforms."""
    from ..rollout.static_cache import bucket_for
    from ..rollout.static_decode import SLOT_ROUNDING

    slots = max(c.slots for c in calls)
    return StateShape(bucket_for(max(c.rows for c in calls)), -(-slots // SLOT_ROUNDING) * SLOT_ROUNDING,
                      max(c.new_tokens for c in calls))


def state_bytes(cfg: ModelConfig, shape: StateShape, dtype_bytes: int, sample_bytes: int = 4,
                uniform_bytes: int = 4) -> dict[str, int]:
    """The static state's tensors (static_cache.StaticDecodeState) and the decoder's two [B, V] buffers, by name:
    dtype_bytes of the weights (KV cache, LM-head logits), sample_bytes of the sampling dtype (fp32, or fp64 for
    fp64 weights), uniform_bytes of torch's default dtype (the uniforms)."""
    from ..rollout.sampling import SAMPLE_BLOCK
    from ..rollout.static_cache import CHUNK

    B, S1, U, V = shape.rows, shape.slots + 1, shape.columns, cfg.vocab_size
    return {
        "kv cache": kv_state_bytes(cfg, B, S1, dtype_bytes),
        "key mask": B * S1,  # bool
        "step buffers": 4 * B * 8,  # ids, positions [B, 1] and write, col [B]: int64
        "uniforms": B * U * uniform_bytes,
        "hist": 3 * B * (1 + CHUNK) * sample_bytes,
        "sampler work": B * (-(-V // SAMPLE_BLOCK) * SAMPLE_BLOCK) * sample_bytes,  # sampling.work_buffer
        "logits buffer": B * V * dtype_bytes,  # decode_kernels.DecodeHead's [B, V]
    }


def sampler_step_bytes(call: DecodeCall, rows: int, vocab: int, logits_bytes: int, cuda: bool = True) -> int:
    """A bound on the sampler's temporaries for one step of `rows` rows (rollout/sampling.py Sampler.__call__),
    beyond its inputs (the LM head's logits) and its preallocated work buffer.

    Per element of [rows, V]: the fp32 copy of low-precision logits (4) and the temperature-scaled logits (4; while
    dividing, both); then each filter in order, while the one before's output (4) stays alive: top-k and min-p 5,
    top-p TOP_P_STAGE (26), and on CUDA the sort's workspace first (TOP_P_SORT_WORKSPACE, 28, beside the sort's 12 B
    of outputs); after the draw, the full softmax's normaliser (8) beside the scaled and filtered logits. Greedy:
    the copy and `logits - max` with its exp. Plus the two-level draw's small [rows, block] and [rows, V / block]
    tensors. tests/plan/test_decode_state.py measures the sampler's live tensors against it."""
    from ..rollout.sampling import SAMPLE_BLOCK

    E = rows * vocab
    copy = 4 if logits_bytes != 4 else 0  # .to(fp32): a copy unless the logits are fp32 already
    if call.temperature == 0:
        peak = copy + 8
    else:
        scaled = 4 if (copy or call.temperature != 1.0) else 0  # a new tensor, or the head's logits themselves
        peak = copy + (4 if call.temperature != 1.0 else 0)  # dividing: the copy and its quotient
        live = scaled  # alive through the filters and the draw
        sorting = 4 + 8 + TOP_P_SORT_WORKSPACE if cuda else 0  # during the sort: its outputs and its workspace
        stages = [(TOP_K_STAGE, 0)] * (call.top_k > 0) + [(TOP_P_STAGE, sorting)] * (call.top_p < 1.0) \
            + [(MIN_P_STAGE, 0)] * (call.min_p > 0)  # (bytes at the stage's end, bytes during its sort)
        for i, stage in enumerate(stages):
            before = live + (4 if i else 0)  # the previous filter's output is this one's input
            peak = max(peak, before + max(stage))
        if stages:
            peak = max(peak, live + 4 + NORMALISER_STAGE)
    small = rows * (2 * SAMPLE_BLOCK + 2 * (-(-vocab // SAMPLE_BLOCK)) + 16) * 8
    return peak * E + small


def forward_step_bytes(cfg: ModelConfig, rows: int, slots: int, dtype_bytes: int) -> int:
    """A bound on one decode step's forward temporaries for `rows` rows (one token each): the MLP's three
    [rows, inter] tensors, or one layer's attention scores and weights [rows, H, 1, S + 1] in fp32 when larger, plus
    a few [rows, d] hidden states (the residual stream, a norm's output, the attention's output)."""
    mlp = 3 * rows * cfg.intermediate_size * dtype_bytes
    scores = 2 * rows * cfg.num_attention_heads * (slots + 1) * 4
    return max(mlp, scores) + 4 * rows * cfg.hidden_size * dtype_bytes


def step_pool_bytes(cfg: ModelConfig, calls: list[DecodeCall], shape: StateShape, dtype_bytes: int) -> int:
    """The graphs' shared pool: the largest step over the calls, each at its own first bucket (its largest)."""
    from ..rollout.static_cache import bucket_for

    def one(c: DecodeCall) -> int:
        b = bucket_for(c.rows)
        return max(sampler_step_bytes(c, b, cfg.vocab_size, dtype_bytes),
                   forward_step_bytes(cfg, b, shape.slots, dtype_bytes))

    return max(one(c) for c in calls)


def holds(shape: StateShape, call: DecodeCall) -> bool:
    """Whether a state of `shape` runs `call` (static_cache.StaticDecodeState.fits after static_decoder's rounding)."""
    need = state_shape([call])
    return need.rows <= shape.rows and need.slots <= shape.slots and need.columns <= shape.columns


def decode_plan(cfg: ModelConfig, calls: list[DecodeCall], dtype_bytes: int) -> DecodePlan:
    """The static decode's kept memory for the run's calls (the training calls and the evaluations they hold), and
    the state and pool of the evaluations they do not hold, which decode on their own decoder during eval only."""
    training = [c for c in calls if c.name != "eval"] or calls
    shape = state_shape(training)
    evals = [c for c in calls if c not in training]
    own = [c for c in evals if not holds(shape, c)]
    kept = [c for c in calls if c not in own]
    plan = DecodePlan(calls, shape, state_bytes(cfg, shape, dtype_bytes), step_pool_bytes(cfg, kept, shape,
                                                                                            dtype_bytes))
    if own:
        plan.eval_shape = state_shape(own)
        plan.eval_state = state_bytes(cfg, plan.eval_shape, dtype_bytes)
        plan.eval_pool = step_pool_bytes(cfg, own, plan.eval_shape, dtype_bytes)
    return plan
