"""The size check of `grpo train` and `grpo check` (`check_sizes`): a config whose planned peak exceeds the device's
memory (the CUDA card's, or physical RAM on a CPU: swap left out) is refused in one line, before the run lock and any
weights, in the precision the run resolved, with the planner's own formulas (rows_in_flight, kv_state_bytes).

Integers first: `rollout.group_size=10^12` met the out-of-memory killer with the run lock held, and
`rollout.prompts_per_step=10^9` a MemoryError in the prompt stream. What scales with the size settings (the rows
decoded at once, the padded batch, the held-out probe) is counted in Python integers, so no value allocates or
overflows; only once each is within the device's memory does the planner (floats) plan the step and the probe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from ..config import Config, ConfigError
from ..model.config import ModelConfig
from .decode_state import kv_state_bytes
from .from_config import in_flight, plan_config, precision_choice, shape_or_none, shown
from .memory import DTYPE_BYTES, GIB
from .precision import planned_card_native_bf16

# One padded TrainBatch token (train/batch.py): input_ids int64, completion_mask and sampler_logp fp32.
BATCH_BYTES_PER_TOKEN = 8 + 4 + 4
LOGIT_BYTES = 4 * 3  # a decode step's [rows, V] fp32 logits and two sampling buffers of that size


@dataclass(frozen=True)
class Term:
    """One part of the planned peak: what it is, the settings that scale it (as written), its bytes."""

    what: str
    settings: dict[str, int | str]
    nbytes: int
    fix: str = ""  # what to change; default: lower one of the settings


@dataclass(frozen=True)
class DeviceMemory:
    nbytes: int
    what: str  # "physical RAM on this machine" | "the CUDA card cuda:0"


def device_memory(device) -> DeviceMemory:
    """What the run's device holds: the card's memory on CUDA, physical RAM (no swap) on a CPU."""
    if device.type == "cuda":
        import torch

        return DeviceMemory(torch.cuda.get_device_properties(device).total_memory, f"the CUDA card {device}")
    return DeviceMemory(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical RAM on this machine")


def check_sizes(cfg: Config, eval_rows: int, device, memory: DeviceMemory | None = None,
                shape: str | None = None) -> None:
    """Refuse, in one line naming the settings and the planned vs available bytes, a config whose planned peak
    exceeds the device's memory. cfg: the config as resolved for `device` (plan/resolved.py; a memory.precision of
    auto is resolved here as the run resolves it); eval_rows: the held-out probe's prompts (0 without eval); shape:
    plan this model shape (a plan/shapes.py name or HF dir) instead of model.path's."""
    memory = memory or device_memory(device)
    worst = max(planned_sizes(cfg, eval_rows, device, memory.nbytes, shape), key=lambda t: t.nbytes)
    if worst.nbytes > memory.nbytes:
        raise ConfigError(refusal(worst, memory))


def planned_sizes(cfg: Config, eval_rows: int, device, budget: int, shape: str | None = None) -> list[Term]:
    """The terms check_sizes compares with `budget` bytes: the integer terms (scaled_terms), and once each is within
    the budget the planner's step and probe (planned_terms). With memory.gpu_memory_gib set, check_memory_fits
    judges the whole plan against the card the config names instead."""
    model = shape_or_none(cfg, shape)
    precision = precision_choice(cfg, device, native=planned_card_native_bf16).precision
    terms = scaled_terms(cfg, eval_rows, model, precision)
    if model is not None and max(t.nbytes for t in terms) <= budget and cfg.memory.gpu_memory_gib <= 0:
        terms = planned_terms(cfg, eval_rows, device, shape, budget, precision, batch=terms[1].nbytes)
    return terms


def refusal(worst: Term, memory: DeviceMemory) -> str:
    settings = ", ".join(f"{k}={shown(v) if isinstance(v, int) else v}" for k, v in worst.settings.items())
    return (f"{settings}: {worst.what} is planned at {shown(worst.nbytes)} bytes ({_gib(worst.nbytes)}), more than "
            f"the {memory.nbytes:,} bytes ({_gib(memory.nbytes)}) of {memory.what}; "
            f"{worst.fix or 'lower ' + ' or '.join(worst.settings)} (`grpo plan CONFIG` shows where the memory goes)")


def scaled_terms(cfg: Config, eval_rows: int, model: ModelConfig | None, precision: str) -> list[Term]:
    """What scales with the size settings, in Python integers, each alive at one moment of a step: the KV cache and
    logits of the rollout's rows decoded at once, the step's padded batch, the held-out probe's KV cache and logits
    (the last two need the model's shape: 0 without one)."""
    r = cfg.rollout
    slots, probe_slots = r.max_prompt_tokens + completion_cap(cfg), r.max_prompt_tokens + probe_cap(cfg)
    rows = r.prompts_per_step * r.group_size
    decoded, probed = in_flight(cfg, r.prompts_per_step, r.group_size, slots), in_flight(cfg, eval_rows, 1, probe_slots)
    rollout = probe = 0
    if model is not None:
        kv = DTYPE_BYTES[precision]
        rollout = kv_state_bytes(model, decoded, slots, kv) + decoded * model.vocab_size * LOGIT_BYTES
        probe = kv_state_bytes(model, probed, probe_slots, kv) + probed * model.vocab_size * LOGIT_BYTES
    return [Term("the rollout's KV cache", rollout_settings(cfg), rollout),
            Term("the step's padded batch", rollout_settings(cfg), rows * slots * BATCH_BYTES_PER_TOKEN),
            Term(f"the held-out probe ({eval_rows} prompts)", probe_settings(cfg), probe)]


def planned_terms(cfg: Config, eval_rows: int, device, shape: str | None, budget: int, precision: str,
                  batch: int) -> list[Term]:
    """The memory planner's peak of one step (plus the padded batch, which it does not count) and of the held-out
    probe (the weights and optimizer state stay resident while it samples)."""
    cpu = device.type != "cuda"
    card = None if cpu else budget / GIB
    common = {"precision": precision, **({"static_decode": False, "cuda_context_gib": 0.0} if cpu else {})}
    r, slots = cfg.rollout, cfg.rollout.max_prompt_tokens + completion_cap(cfg)
    planned = micro_batch_within_the_batch(cfg, r.prompts_per_step * r.group_size * slots)
    step = plan_config(planned, shape, card, completion_len=completion_cap(cfg),
                       rollout_rows_in_flight=in_flight(cfg, r.prompts_per_step, r.group_size, slots), **common)
    what, total = f"one step ({step.peak_phase} phase)", int(step.total_gib * GIB) + batch
    terms = [Term(what, rollout_settings(cfg), total) if step.peak_phase == "rollout" else Term(
        what, {"model.path": cfg.model.path or "(the warm start's)", "memory.micro_batch_tokens":
               cfg.memory.micro_batch_tokens or "auto"}, total,
        "train LoRA adapters (lora.enabled) or a smaller model, or choose optimizer.name=adamw_8bit or adamw_offload"
        if step.peak_phase == "optimizer" else
        "lower memory.micro_batch_tokens, or train LoRA adapters (lora.enabled) or a smaller model")]
    if step.peak_phase == "eval":  # the evaluation's prompts' prefill and, past the rollout's rows, its own state
        terms = [Term(what, probe_settings(cfg), total, "lower eval.max_examples (at most rollout.prompts_per_step "
                      "x group_size: the evaluation then decodes on the rollout's state)")]
    if eval_rows:
        rows = in_flight(cfg, eval_rows, 1, r.max_prompt_tokens + probe_cap(cfg))
        probe = plan_config(planned, shape, card, prompts_per_step=eval_rows, group_size=1,
                            completion_len=probe_cap(cfg), rollout_rows_in_flight=rows, **common)
        k = probe.knobs
        sampling = probe.phase("rollout").total * (1 + k.fragmentation) + k.cuda_context_gib * GIB
        terms.append(Term(f"the held-out probe ({eval_rows} prompts)", probe_settings(cfg), int(sampling)))
    return terms


def micro_batch_within_the_batch(cfg: Config, batch_tokens: int) -> Config:
    """cfg with memory.micro_batch_tokens at most the step's batch (a micro-batch never holds more than the whole
    batch): a larger budget, e.g. 10^12 to mean "all at once", is planned as the batch, not as 10^12 tokens (which
    the planner would also carry into floats that overflow)."""
    if cfg.memory.micro_batch_tokens <= batch_tokens:
        return cfg
    return replace(cfg, memory=replace(cfg.memory, micro_batch_tokens=batch_tokens))


def completion_cap(cfg: Config) -> int:
    """Tokens after the prompt in a rollout row: tools.max_tokens for trajectories, else rollout.max_new_tokens."""
    return cfg.tools.max_tokens if cfg.tools.enabled else cfg.rollout.max_new_tokens


def probe_cap(cfg: Config) -> int:
    return cfg.tools.max_tokens if cfg.tools.enabled else cfg.eval.max_new_tokens


def rollout_settings(cfg: Config) -> dict[str, int]:
    r, cap = cfg.rollout, "tools.max_tokens" if cfg.tools.enabled else "rollout.max_new_tokens"
    return {"rollout.prompts_per_step": r.prompts_per_step, "rollout.group_size": r.group_size,
            "rollout.max_prompt_tokens": r.max_prompt_tokens, cap: completion_cap(cfg)}


def probe_settings(cfg: Config) -> dict[str, int]:
    cap = "tools.max_tokens" if cfg.tools.enabled else "eval.max_new_tokens"
    return {"eval.max_examples": cfg.eval.max_examples, "rollout.max_prompt_tokens": cfg.rollout.max_prompt_tokens,
            cap: probe_cap(cfg)}


def _gib(n: int) -> str:
    """Integer division above 1 TiB: a planned size may be too large for a float."""
    return f"{n / GIB:.1f} GiB" if n < 1024 * GIB else f"{shown(n // (1024 * GIB))} TiB"
