"""The memory planner driven by a training config: `grpo plan CONFIG` and the pre-flight check of `grpo train`.

plan.py knows knobs (PlanInput), not configs; this module is the one place that says which config field
decides which knob, so `grpo plan configs/x.yaml` and the check `grpo train` runs before loading the model
plan exactly the same thing. The planner predicts GPU memory, so it always plans for a CUDA card:
memory.precision=auto means bf16 here, whatever device this machine has.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..config import Config, ConfigError, load_config
from ..model.transformer import ModelConfig
from .plan import MODEL_SHAPES, MemoryPlan, PlanInput, fits, format_plan, model_shape, plan_memory, suggest


def reference_knob(cfg: Config) -> str:
    """Where the KL reference lives: nothing without a KL term, the base under the adapters with LoRA,
    a parked CPU copy, or a second copy of the weights on the GPU."""
    if cfg.algorithm.beta == 0:
        return "none"
    if cfg.lora.enabled:
        return "adapters"
    return "cpu" if cfg.reference.park_on_cpu else "gpu_copy"


def training_mode(cfg: Config) -> str:
    if not cfg.lora.enabled:
        return "full"
    return "qlora" if cfg.lora.quantize_base == "nf4" else "lora"


def rollout_rows_in_flight(cfg: Config, slots: int) -> int:
    """Rows decoded at once (0 = all P x G): generate() packs whole groups of G while
    rows x (prompt + completion) stays under rollout.max_tokens_in_flight (rollout/generate.py plan_waves)."""
    r = cfg.rollout
    if r.max_tokens_in_flight == 0:
        return 0
    groups = max(1, r.max_tokens_in_flight // (r.group_size * slots))
    return min(r.prompts_per_step, groups) * r.group_size


def plan_input_from_config(cfg: Config) -> PlanInput:
    """The planner's knobs for one step of `cfg`. Lengths are the caps (rollout.max_prompt_tokens,
    rollout.max_new_tokens), so the plan is the worst step, not the average one; a training micro-batch
    holds memory.micro_batch_tokens // (prompt + completion) rows of that worst length (at least one)."""
    r, m = cfg.rollout, cfg.memory
    slots = r.max_prompt_tokens + r.max_new_tokens
    return PlanInput(
        prompts_per_step=r.prompts_per_step, group_size=r.group_size,
        prompt_len=r.max_prompt_tokens, completion_len=r.max_new_tokens,
        mode=training_mode(cfg), lora_rank=cfg.lora.rank, lora_targets=list(cfg.lora.target_modules),
        precision="bf16" if m.precision == "auto" else m.precision,
        optimizer=cfg.optimizer.name, master_weights=cfg.optimizer.master_weights,
        activation_checkpointing=m.activation_checkpointing, checkpoint_every=m.checkpoint_every,
        micro_batch_rows=max(1, m.micro_batch_tokens // slots), logprob_chunk=m.logprob_chunk_size,
        rollout_rows_in_flight=rollout_rows_in_flight(cfg, slots), reference=reference_knob(cfg),
    )


def config_model_shape(cfg: Config, shape: str | None = None) -> ModelConfig:
    """The policy's shape: `shape` (a MODEL_SHAPES name or an HF dir) when given, else the tiny warm-start
    model's, else model.path/config.json (only that file is read, never the weights)."""
    if shape:
        return model_shape(shape)
    t = cfg.warm_start.tiny
    if t.arch:
        from ..model.tiny import tiny_config

        return tiny_config(t.arch, hidden_size=t.hidden_size, num_hidden_layers=t.num_hidden_layers,
                           num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads,
                           intermediate_size=t.intermediate_size)
    path = Path(cfg.model.path)
    if cfg.model.path and (path / "config.json").is_file():
        return model_shape(str(path))
    name = path.name.lower()
    guess = next((s for s in MODEL_SHAPES if name.startswith(s)), None)
    hint = f"--model {guess}" if guess else f"--model with one of {', '.join(MODEL_SHAPES)} or an HF dir"
    raise ConfigError(f"model.path={cfg.model.path!r} has no config.json to read the model shape from "
                      f"(not downloaded yet?): download it, or plan with {hint}")


def plan_config(cfg: Config, shape: str | None = None, **knob_overrides) -> MemoryPlan:
    knobs = dataclasses.replace(plan_input_from_config(cfg), **knob_overrides)
    return plan_memory(config_model_shape(cfg, shape), knobs)


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


# ----------------------------------------------------------------------------------------------------
# Command line


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    """`grpo plan CONFIG [key=value ...] [--card GIB] [--model SHAPE_OR_DIR]`, or without a config
    `grpo plan --model qwen2.5-1.5b --mode qlora ...`. Every PlanInput field is also a flag; with a config
    the flags override the knobs derived from it (e.g. --fragmentation 0.2, which has no config field)."""
    p = subparsers.add_parser("plan", help="predict peak GPU memory of a GRPO step (from a config)")
    p.add_argument("config", nargs="?", default=None, help="training YAML config (as for `grpo train`)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. memory.micro_batch_tokens=1536")
    p.add_argument("--model", "--model-shape", dest="model", default=None,
                   help=f"model shape: an HF dir or one of {', '.join(MODEL_SHAPES)} (with a config: plan "
                        "this shape instead of model.path's, e.g. before downloading)")
    p.add_argument("--card", type=float, default=None,
                   help="GPU memory in GiB to check against (default: the config's memory.gpu_memory_gib)")
    for name, f in PlanInput.__dataclass_fields__.items():
        value = getattr(PlanInput(), name)
        flag = "--" + name.replace("_", "-")
        if isinstance(value, list):
            p.add_argument(flag, nargs="+", default=None, help=f.metadata["help"])
        elif isinstance(value, bool):
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=None,
                           help=f.metadata["help"])
        else:
            p.add_argument(flag, type=type(value), default=None, help=f.metadata["help"])
    p.set_defaults(func=run_plan)
    return p


def run_plan(args: argparse.Namespace) -> int:
    """Print the per-phase plan and, given a card, the verdict and suggestions; exit code 1 if it does not fit."""
    knobs = {n: getattr(args, n) for n in PlanInput.__dataclass_fields__ if getattr(args, n) is not None}
    card = args.card
    try:
        if args.config is not None:
            cfg = load_config(args.config, args.overrides)
            plan = plan_config(cfg, args.model, **knobs)
            card = card if card is not None else (cfg.memory.gpu_memory_gib or None)
        elif args.model is not None:
            plan = plan_memory(model_shape(args.model), PlanInput(**knobs))
        else:
            raise ValueError("give a training config (grpo plan CONFIG) or a model shape (--model)")
    except ValueError as e:  # ConfigError included: a bad config, override, shape name or knob
        print(f"grpo plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan, card))
    return 0 if card is None or fits(plan, card) else 1
