"""The weights' dtype a run gets: `memory.precision` resolved for a device. One function decides it
(`resolve_precision`); the trainer (train/memory.py), the resume check (checkpoint/resume.py) and the planner
(plan/from_config.py) all ask it, so what the planner plans is what the trainer loads.

Why a card check: bf16 halves the weights and runs at full speed only on cards that compute it natively (compute
capability 8.0 and later: Ampere, Ada, Hopper). An RTX 20xx or a T4 (7.5) emulates it, several times slower, and
torch.cuda.is_bf16_supported() answers True there unless told to leave emulation out. On such a card `auto` is
fp32, not fp16: fp16 would need loss scaling, which the engine does not do (its range would underflow small
gradients). An explicit `bf16` on such a card is refused, in one line naming the setting.

torch is imported inside the functions: `grpo --help` imports the planner without torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from ..config import ConfigError

NATIVE_BF16_CAPABILITY = (8, 0)  # Ampere: the first compute capability with bf16 tensor cores


def native_bf16(device=None) -> bool:
    """Whether the CUDA device (None: the current one) computes bf16 natively, emulation left out:
    torch.cuda.is_bf16_supported(including_emulation=False) where torch has that argument, else compute
    capability >= 8.0."""
    import torch

    supported = torch.cuda.is_bf16_supported
    if "including_emulation" in inspect.signature(supported).parameters:
        index = None if device is None else torch.device(device).index
        if index is None:  # the current device: the one is_bf16_supported asks
            return bool(supported(including_emulation=False))
        with torch.cuda.device(index):
            return bool(supported(including_emulation=False))
    return tuple(torch.cuda.get_device_capability(device)) >= NATIVE_BF16_CAPABILITY


def card_name(device=None) -> str:
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)}, compute capability {major}.{minor}"


def resolve_precision(setting: str, device, native: Callable[[], bool] | None = None) -> str:
    """memory.precision ("auto" | "fp32" | "bf16") on `device` -> "fp32" | "bf16".

    CPU: auto is fp32 (bf16 matmuls are slow there and tests compare numbers in fp32). CUDA: auto is bf16 where the
    card has it natively, else fp32; bf16 on a card without it raises ConfigError. `native`: the card's answer
    (default native_bf16 of `device`), asked only on CUDA."""
    if setting not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision {setting!r}; choose from auto, bf16, fp32")
    if str(device).split(":")[0] != "cuda" or setting == "fp32":
        return "fp32" if setting == "auto" else setting
    has_bf16 = native() if native is not None else native_bf16(device)
    if has_bf16:
        return "bf16"
    if setting == "auto":
        return "fp32"
    card = card_name(device) if native is None else "this card"
    raise ConfigError(f"memory.precision=bf16: {card} has no native bf16 (compute capability 8.0+ needed); "
                      f"set memory.precision=auto (fp32 on this card) or fp32")


def planned_card_native_bf16() -> bool:
    """The planner's card: this machine's CUDA card when it has one, else one with native bf16 (the cards the
    presets are written for; plan an older card with memory.precision=fp32)."""
    import torch

    return native_bf16() if torch.cuda.is_available() else True
