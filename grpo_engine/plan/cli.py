"""`grpo plan CONFIG [key=value ...] [--card GIB] [--model SHAPE_OR_DIR]`: the per-phase memory plan of a step.

Registering the parser imports nothing heavy (`grpo --help` loads no torch); running it does.
"""

from __future__ import annotations

import argparse
import sys

from ..config import load_config
from .memory import PlanInput, fits, plan_memory
from .shapes import MODEL_SHAPES, model_shape
from .suggest import format_plan


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
            p.add_argument(flag, type=_yes_no, default=None, help=f.metadata["help"])
        else:
            p.add_argument(flag, type=type(value), default=None, help=f.metadata["help"])
    p.set_defaults(func=run_plan)
    return p


def _yes_no(text: str) -> bool:
    """A boolean flag's value; anything else is an error, not silently false ("maybe")."""
    value = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a boolean: use true or false")
    return value


def run_plan(args: argparse.Namespace) -> int:
    """Print the per-phase plan and, given a card, the verdict and suggestions; exit code 1 if it does not fit."""
    knobs = {n: getattr(args, n) for n in PlanInput.__dataclass_fields__ if getattr(args, n) is not None}
    card = args.card
    from .from_config import plan_config  # imports the trainer's policy decision (torch): only when run

    try:
        if card is not None and not card > 0:  # a -1 GiB card once got a verdict ("DOES NOT FIT") and exit 1
            raise ValueError(f"--card {card:g}: give the card's GPU memory in GiB (> 0)")
        if args.config is not None:
            cfg = load_config(args.config, args.overrides)
            card = card if card is not None else (cfg.memory.gpu_memory_gib or None)
            plan = plan_config(cfg, args.model, card, **knobs)
        elif args.model is not None:
            plan = plan_memory(model_shape(args.model), PlanInput(**knobs))
        else:
            raise ValueError("give a training config (grpo plan CONFIG) or a model shape (--model)")
    except ValueError as e:  # ConfigError included: a bad config, override, shape name or knob
        print(f"grpo plan: error: {e}", file=sys.stderr)
        return 2
    print(format_plan(plan, card))
    return 0 if card is None or fits(plan, card) else 1
