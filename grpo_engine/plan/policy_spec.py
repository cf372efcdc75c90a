"""How the config asks for the policy to be held: full fine-tuning, LoRA or QLoRA, and where the KL reference
lives. One decision, read by the trainer (train/policy.py) and the memory planner alike."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import Config


@dataclass(frozen=True)
class PolicySpec:
    """How the config asks for the policy to be held (pure function of the config: no weights read)."""

    mode: str  # full | lora | qlora
    reference: str  # none | adapters (LoRA base, no copy) | cpu (parked copy) | gpu_copy (copy on the device)
    reference_moves: bool  # hard_reset / mixin: the reference changes and is saved in checkpoints


def policy_spec(cfg: Config) -> PolicySpec:
    mode = "full" if not cfg.lora.enabled else ("qlora" if cfg.lora.quantize_base == "nf4" else "lora")
    if cfg.algorithm.policy_loss.beta == 0 or cfg.reference.mode == "none":
        reference = "none"
    elif mode != "full":
        reference = "adapters"
    else:
        reference = "cpu" if cfg.reference.park_on_cpu else "gpu_copy"
    moves = reference in ("cpu", "gpu_copy") and cfg.reference.mode != "frozen"
    return PolicySpec(mode, reference, moves)
