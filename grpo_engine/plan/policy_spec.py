"""How the config asks for the policy to be held: full fine-tuning, LoRA or QLoRA, where the KL reference lives,
and how it is spread over data-parallel ranks (`sharding`). One decision each, read by the trainer
(train/policy.py, train/distributed.py) and the memory planner alike."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import Config
from .precision import choose_precision, planned_card_native_bf16


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


# distributed.strategy=auto shards with FSDP2 when the weights, gradients and AdamW state of a full fine-tune would
# fill more than this share of one card
AUTO_FSDP2_SHARE = 0.85


def sharding(cfg: Config, params: Callable[[], int], ranks: int | None = None, card_bytes: int | None = None) -> str:
    """The data-parallel strategy a run of `ranks` processes uses: distributed.strategy when it names one, else
    (`auto`) none for one process, ddp when the full fine-tune's weights, gradients and AdamW state (of `params()`
    parameters, asked only then) fit AUTO_FSDP2_SHARE of a card of `card_bytes` (always ddp on the CPU, card_bytes
    None, and with LoRA: adapters are small), fsdp2 otherwise. ranks None: torchrun's WORLD_SIZE (1 without
    torchrun); card_bytes None: this machine's first CUDA card, if any. The trainer (train/distributed.py) and the
    planner (plan/from_config.py) both call it, so the plan counts the strategy the run takes."""
    if cfg.distributed.strategy != "auto":
        return cfg.distributed.strategy
    ranks = int(os.environ.get("WORLD_SIZE", "1")) if ranks is None else ranks
    if ranks == 1:
        return "none"
    if card_bytes is None and torch.cuda.is_available() and cfg.model.device != "cpu":
        card_bytes = torch.cuda.get_device_properties(0).total_memory
    if cfg.lora.enabled or card_bytes is None:
        return "ddp"
    low_precision = choose_precision(cfg.memory.precision, "cuda", native=planned_card_native_bf16).precision == "bf16"
    per_param = (2 + 2 + 12) if low_precision else (4 + 4 + 8)  # weights + grads + (master +) two moments
    return "ddp" if params() * per_param <= AUTO_FSDP2_SHARE * card_bytes else "fsdp2"


def collective_backend(setting: str, device: torch.device) -> str:
    """distributed.backend for ranks training on `device`: as written, else (`auto`) nccl on CUDA, gloo on a CPU.
    The process group is joined with it (train/distributed.py init_world) and Resolved records it."""
    if setting != "auto":
        return setting
    return "nccl" if device.type == "cuda" else "gloo"
