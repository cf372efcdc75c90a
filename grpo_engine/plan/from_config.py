"""The memory planner driven by a training config: `grpo plan CONFIG` and the pre-flight check of `grpo train`.

memory.py knows knobs (PlanInput), not configs; this module is the one place that says which config field
decides which knob, so `grpo plan CONFIG` and the check `grpo train` runs before loading the model
plan exactly the same thing. The planner predicts GPU memory, so it plans for a CUDA card, in the dtype the
trainer will load there (`precision_choice`, the run's own answer): this machine's card when it has one, else a card
with native bf16 (memory.precision=auto plans bf16 then; plan an older card with memory.precision=fp32). A config
resolved for a CPU (plan/resolved.py) carries its CPU's answer in memory.precision, and is planned in it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from ..config import Config, ConfigError
from ..model.config import ModelConfig
from .device_defaults import CPU_LOGPROB_CHUNK, CPU_MICRO_BATCH_TOKENS, MemoryChoice, memory_choice, micro_batch_rows
from .memory import MemoryPlan, PlanInput, fits, lora_target_shapes, param_counts, plan_memory
from .policy_spec import policy_spec, sharding
from .precision import PrecisionChoice, choose_precision, planned_card_native_bf16
from .shapes import MODEL_SHAPES, model_shape
from .suggest import suggest

SIZE_LIMIT = 2**32  # the most rows, tokens or examples a size setting is planned at (no card holds a step of more)
SIZE_SETTINGS = ("rollout.prompts_per_step", "rollout.group_size", "rollout.max_prompt_tokens",
                 "rollout.max_new_tokens", "eval.max_examples", "eval.max_new_tokens", "curriculum.samples",
                 "curriculum.max_new_tokens", "lora.rank")


def shown(n: int) -> str:
    """An integer for a one-line error: 1,234,567 up to 10^18, then its leading digits and exponent."""
    digits = str(n)
    return f"{n:,}" if n < 10**18 else f"{digits[0]}.{digits[1:3]}e+{len(digits) - 1}"


def unplannable(cfg: Config) -> str | None:
    """The refusal of a size setting beyond SIZE_LIMIT (None: all are plannable): the planner counts bytes in floats,
    and products of such values overflow them (memory.micro_batch_tokens and rollout.max_tokens_in_flight mean 'all
    at once' when large: they are capped by the step's rows instead)."""
    for name in SIZE_SETTINGS:
        if (value := getattr(getattr(cfg, name.split(".")[0]), name.split(".")[1])) > SIZE_LIMIT:
            return f"{name}={shown(value)} is more than any card holds (the planner counts sizes up to " \
                   f"{SIZE_LIMIT:,}): lower {name}"
    return None


def check_sizes_plannable(cfg: Config) -> None:
    if (refusal := unplannable(cfg)) is not None:
        raise ConfigError(refusal)


def check_lora_rank(knobs: PlanInput, model: ModelConfig) -> None:
    """A LoRA update B @ A of a [in, out] projection has rank at most min(in, out): lora.rank above the largest such
    bound of the targeted projections adds adapter weights and memory but no expressiveness."""
    if knobs.mode == "full":
        return
    bound = max(min(shape) for shape in lora_target_shapes(model, knobs.lora_targets))
    if knobs.lora_rank > bound:
        raise ConfigError(f"lora.rank={shown(knobs.lora_rank)} is above {bound}, the highest rank an update of the "
                          f"targeted projections ({', '.join(knobs.lora_targets)}) can have: set lora.rank <= {bound} "
                          f"(or full fine-tuning: lora.enabled=false)")


def decode_call_knobs(cfg: Config) -> dict:
    """The PlanInput fields of the run's other generate() calls and of the sampling filters: the evaluations (the
    held-out one `grpo train` runs before step 1 and after the last, at rollout.max_new_tokens, and with
    eval.every > 0 the in-loop one at eval.max_new_tokens: eval.max_examples examples, one row each) and the
    curriculum's pool scoring (chunks of P x G / samples prompts). The signal check samples P prompts at a time:
    the rollout's rows."""
    r, e, c = cfg.rollout, cfg.eval, cfg.curriculum
    tools = cfg.tools.max_tokens if cfg.tools.enabled else 0  # a trajectory's tokens: its rows decode all together
    return dict(max_tokens_in_flight=0 if tools else r.max_tokens_in_flight, temperature=r.temperature,
                top_k=r.top_k, top_p=r.top_p, min_p=r.min_p, eval_examples=e.max_examples,
                eval_new_tokens=tools or max(r.max_new_tokens, e.max_new_tokens if e.every else 0),
                eval_temperature=e.temperature,
                curriculum_prompts=max(1, r.prompts_per_step * r.group_size // c.samples) if c.mode != "none" else 0,
                curriculum_samples=c.samples, curriculum_new_tokens=c.max_new_tokens or r.max_new_tokens)


def static_decode_planned(cfg: Config) -> bool:
    """Whether the run decodes on a kept static state (rollout/static_decode.py graphs_for) on the planned CUDA card:
    rollout.cuda_graphs auto or on, and for auto no FSDP2 units (FSDP2, asked for or chosen by
    distributed.strategy=auto as the run chooses it, policy_spec.sharding, decodes eagerly on a state of each call's
    own, planned as the rollout's KV cache; `on` is refused there at the first rollout). Tool rollouts too: their
    state holds P x G rows x (prompt + tools.max_tokens) slots (plan_input_from_config)."""
    r = cfg.rollout
    fsdp2 = sharding(cfg, lambda: param_counts(config_model_shape(cfg))[0]) == "fsdp2"
    return r.cuda_graphs != "off" and not (fsdp2 and r.cuda_graphs == "auto")


def precision_choice(cfg: Config, device, kept: str | None = None,
                     native: Callable[[], bool] | None = None) -> PrecisionChoice:
    """memory.precision for a run of `cfg` on `device` (plan/precision.py choose_precision): `kept` (a resumed run's)
    when the config leaves it to the engine, else chosen for the model's MLP shape (no shape readable: None).
    native: whether the CUDA card has native bf16 (None: ask the card; plan/precision.py planned_card_native_bf16:
    this machine's card, or one with it where there is none)."""
    if kept is not None and cfg.memory.precision == "auto":
        return PrecisionChoice(kept, "kept from the checkpoint resumed")
    if cfg.memory.precision != "auto" or str(device).split(":")[0] != "cpu":  # no measurement, no shape needed
        return choose_precision(cfg.memory.precision, device, native=native)
    shape = shape_or_none(cfg)  # None: too little known for a CPU's bf16
    mlp = (shape.hidden_size, shape.intermediate_size) if shape is not None else None
    stochastic = cfg.optimizer.master_weights and cfg.optimizer.bf16_rounding == "stochastic"
    return choose_precision(cfg.memory.precision, device, mlp, trains_weights=policy_spec(cfg).mode == "full",
                            rounds_stochastically=stochastic)


def plan_input_from_config(cfg: Config, bf16_native: bool | None = None) -> PlanInput:
    """The planner's knobs for one step of `cfg`. Lengths are the caps (rollout.max_prompt_tokens,
    rollout.max_new_tokens), so the plan is the worst step, not the average one; a training micro-batch
    holds memory.micro_batch_tokens // (prompt + completion) rows of that worst length (at least one)."""

    check_sizes_plannable(cfg)
    r, m = cfg.rollout, cfg.memory
    spec = policy_spec(cfg)  # the trainer's own decision: full / LoRA / QLoRA and where the reference lives
    completion = cfg.tools.max_tokens if cfg.tools.enabled else r.max_new_tokens  # a trajectory: all its turns
    slots = r.max_prompt_tokens + completion
    return PlanInput(
        prompts_per_step=r.prompts_per_step, group_size=r.group_size,
        prompt_len=r.max_prompt_tokens, completion_len=completion,
        mode=spec.mode, lora_rank=cfg.lora.rank, lora_targets=list(cfg.lora.target_modules),
        precision=precision_choice(cfg, "cuda", native=planned_card_native_bf16 if bf16_native is None
                                   else lambda: bf16_native).precision,  # the planned card's (module docstring)
        optimizer=cfg.optimizer.name, master_weights=cfg.optimizer.master_weights,
        activation_checkpointing=m.activation_checkpointing, checkpoint_every=m.checkpoint_every,
        micro_batch_rows=micro_batch_rows(m.micro_batch_tokens or CPU_MICRO_BATCH_TOKENS, slots),
        logprob_chunk=m.logprob_chunk_size or CPU_LOGPROB_CHUNK,
        rollout_rows_in_flight=in_flight(cfg, r.prompts_per_step, r.group_size, slots) if r.max_tokens_in_flight
        else 0, reference=spec.reference,  # 0: every row at once
        static_decode=static_decode_planned(cfg),
        **decode_call_knobs(cfg),
    )


def in_flight(cfg: Config, prompts: int, group: int, slots: int) -> int:
    """Rows decoded at once (rollout/generate.py rows_in_flight); trajectories with tools decode all rows together."""
    from ..rollout.generate import rows_in_flight

    return rows_in_flight(prompts, group, slots, 0 if cfg.tools.enabled else cfg.rollout.max_tokens_in_flight)


def config_model_shape(cfg: Config, shape: str | None = None) -> ModelConfig:
    """The policy's shape: `shape` (a MODEL_SHAPES name or an HF dir) when given, else the tiny warm-start
    model's, else model.path/config.json (only that file is read, never the weights)."""
    if shape:
        return model_shape(shape)
    t = cfg.warm_start.tiny
    if t.arch:
        from ..model.tiny import tiny_config

        return tiny_config(t.arch, **t.shape())
    path = Path(cfg.model.path)
    if cfg.model.path and ((path / "config.json").is_file() or (path.suffix == ".gguf" and path.is_file())):
        return model_shape(str(path))
    name = path.name.lower()
    guess = next((s for s in MODEL_SHAPES if name.startswith(s)), None)
    hint = f"--model {guess}" if guess else f"--model with one of {', '.join(MODEL_SHAPES)} or an HF dir"
    raise ConfigError(f"model.path={cfg.model.path!r} has no config.json to read the model shape from "
                      f"(not downloaded yet?): download it, or plan with {hint}")


def shape_or_none(cfg: Config, shape: str | None = None) -> ModelConfig | None:
    """config_model_shape, or None where the config names none to read (the model's load reports that itself)."""
    try:
        return config_model_shape(cfg, shape)
    except (OSError, ValueError):  # ConfigError, CheckpointError included
        return None


def config_memory_choice(cfg: Config, card_gib: float | None, shape: str | None = None) -> MemoryChoice:
    """The memory settings `cfg` runs with on a card of card_gib GiB (None: on a CPU, activation checkpointing in
    cfg's precision as resolved, else as planned); plan/device_defaults.py. Sizes no card holds get the CPU
    defaults: the size check (plan/sizes.py) refuses them next."""
    if card_gib is not None and not unplannable(cfg):
        return memory_choice(config_model_shape(cfg, shape), plan_input_from_config(cfg), cfg.memory, card_gib)
    auto = cfg.memory.activation_checkpointing == "auto" and not unplannable(cfg)
    model = shape_or_none(cfg, shape) if auto else None
    native = True if cfg.memory.precision != "auto" else None  # a CPU's bf16 is no card's to refuse
    knobs = plan_input_from_config(cfg, native) if model is not None else None
    return memory_choice(model, knobs, cfg.memory, None)


def plan_config(cfg: Config, shape: str | None = None, card_gib: float | None = None,
                **knob_overrides) -> MemoryPlan:
    """The plan of one step of `cfg` on a card of card_gib (default memory.gpu_memory_gib): the memory settings
    left to the engine are chosen for that card as a CUDA run on it chooses them; without a card, at the CPU
    defaults."""
    card = card_gib if card_gib is not None else (cfg.memory.gpu_memory_gib or None)
    knobs = plan_input_from_config(cfg)
    model = config_model_shape(cfg, shape)
    check_lora_rank(knobs, model)
    choice = config_memory_choice(cfg, card, shape).knobs(knobs.prompt_len + knobs.completion_len)
    return plan_memory(model, dataclasses.replace(knobs, **{**choice, **knob_overrides}))


def check_memory_fits(cfg: Config) -> None:
    """Pre-flight check of `grpo train`: with memory.gpu_memory_gib > 0, a config the planner predicts will
    not fit that card fails now, with the plan and the changes that would make it fit, instead of after the
    model load and the first rollout. Runs whenever the field is set, on any device: the number describes
    the card the config is meant for, and the check is arithmetic on the config and config.json."""
    card = cfg.memory.gpu_memory_gib
    if card <= 0:
        return
    plan = plan_config(cfg)
    if fits(plan, card):
        return
    tips = "\n".join(f"  - {s}" for s in suggest(plan, card))
    raise ConfigError(
        f"memory.gpu_memory_gib={card:g}: the planned peak of one step is {plan.total_gib:.2f} GiB "
        f"({plan.peak_phase} phase), more than the {card:g} GiB card. Changes that lower it:\n{tips}\n"
        f"(see `grpo plan CONFIG` for the per-phase plan; set memory.gpu_memory_gib=0 to skip this check)")
