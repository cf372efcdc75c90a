"""The weights' dtype a run gets: `memory.precision` resolved for a device. One function decides it
(`choose_precision`; for a config, plan/from_config.py precision_choice reads the model's shape for it): the run
(plan/resolved.py), the planner (plan/from_config.py), the size check (plan/sizes.py), `grpo bench` and the resume
check (checkpoint/resume.py) all ask it, so what the planner plans is what the trainer loads.

Why a card check: bf16 halves the weights and runs at full speed only on cards that compute it natively (compute
capability 8.0 and later: Ampere, Ada, Hopper). An RTX 20xx or a T4 (7.5) emulates it, several times slower, and
torch.cuda.is_bf16_supported() answers True there unless told to leave emulation out. On such a card `auto` is
fp32, not fp16: fp16 would need loss scaling, which the engine does not do (its range would underflow small
gradients). An explicit `bf16` on such a card is refused, in one line naming the setting.

On a CPU, `auto` is bf16 where it pays (`choose_precision`): the CPU computes bf16 dot products natively (AMX,
AVX512_BF16), the model's block products are big enough for their speed to matter (CPU_BF16_MIN_WEIGHT: a tiny
model's step is bound by everything around its products, and the tests' float64/fp32 comparisons keep their models
tiny), and this machine measures them faster in bf16 (kernels/select.py bf16_ratio, cached per CPU and torch).
Adapters (LoRA / QLoRA) and their optimizer stay fp32 over a bf16 base. Full fine-tuning goes bf16 by the same
measurement only where the optimizer sets each bf16 weight from its fp32 master by stochastic rounding
(optimizer.master_weights, optimizer.bf16_rounding=stochastic, the defaults): a CPU run is short (tens of steps) at
a small learning rate, Adam moves a weight by about lr a step, 2e-4 over 20 steps at 1e-5, which is one bf16
rounding step of a weight of 0.05, so rounded to nearest most bf16 weights move by zero or one step and the update's
direction drowns in rounding (docs/benchmarks.md); rounded stochastically each weight the model runs is its master
in expectation. Elsewhere fp32: without native dot products bf16 is converted in software, several times
slower. On a GPU `auto` is bf16 for full fine-tuning too: there memory decides.

torch is imported inside the functions: `grpo --help` imports the planner without torch.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from ..config import ConfigError

NATIVE_BF16_CAPABILITY = (8, 0)  # Ampere: the first compute capability with bf16 tensor cores
CPU_BF16_MIN_WEIGHT = 2**19  # elements of a block's MLP weight from which a CPU's bf16 products may pay
CPU_BF16_PAYS = 0.8  # bf16 product seconds over fp32 at most this for `auto` to choose bf16 on a CPU


@dataclass(frozen=True)
class PrecisionChoice:
    """memory.precision as resolved for a run, and why: printed once and stored in resolved.yaml."""

    precision: str  # fp32 | bf16
    why: str


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


def choose_precision(setting: str, device, shape: tuple[int, int] | None = None, trains_weights: bool = False,
                     rounds_stochastically: bool = True, ratio: Callable[[int, int], float] | None = None,
                     isa: Callable[[], str | None] | None = None,
                     native: Callable[[], bool] | None = None) -> PrecisionChoice:
    """memory.precision ("auto" | "fp32" | "bf16") on `device` for a model whose MLP weight is `shape` = (hidden,
    intermediate) (None: not known), with the reason. trains_weights: full fine-tuning (the weights themselves are
    trained, not adapters); rounds_stochastically: bf16 weights would be set from fp32 masters by stochastic
    rounding (optimizer master_weights and bf16_rounding=stochastic). CUDA: auto is bf16 where the card has it
    natively (`native`: the card's answer, default native_bf16 of `device`), else fp32; bf16 on a card without it
    raises ConfigError. CPU: a value written is kept; `auto` asks `isa` (the CPU's native bf16 instruction set or
    None; default kernels/cpu.py native_bf16_isa) and `ratio` (bf16 over fp32 seconds of the model's products;
    default measured here)."""
    if setting not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision {setting!r}; choose from auto, bf16, fp32")
    if str(device).split(":")[0] == "cuda":
        return _on_card(setting, device, native)
    if setting != "auto":
        return PrecisionChoice(setting, "set in the config")
    return _on_cpu(shape, trains_weights, rounds_stochastically, ratio, isa)


def _on_card(setting: str, device, native: Callable[[], bool] | None) -> PrecisionChoice:
    if setting == "fp32":
        return PrecisionChoice("fp32", "set in the config")
    if native() if native is not None else native_bf16(device):
        return PrecisionChoice("bf16", "set in the config" if setting == "bf16" else "auto: native bf16 on this card")
    if setting == "auto":
        return PrecisionChoice("fp32", "auto: no native bf16 on this card")
    card = card_name(device) if native is None else "this card"
    raise ConfigError(f"memory.precision=bf16: {card} has no native bf16 (compute capability 8.0+ needed); "
                      f"set memory.precision=auto (fp32 on this card) or fp32")


def _on_cpu(shape: tuple[int, int] | None, trains_weights: bool, rounds_stochastically: bool,
            ratio: Callable[[int, int], float] | None, isa: Callable[[], str | None] | None) -> PrecisionChoice:
    """`auto` on a CPU (the module docstring says why)."""
    from ..kernels.cpu import native_bf16_isa
    from ..kernels.select import bf16_ratio

    if trains_weights and not rounds_stochastically:
        return PrecisionChoice("fp32", "auto: full fine-tuning with bf16 weights rounded to nearest keeps fp32 on a "
                                       "CPU (a CPU run's few steps at a small learning rate move most bf16 weights by "
                                       "zero or one rounding step)")
    isa = (isa or native_bf16_isa)()
    if isa is None:
        return PrecisionChoice("fp32", "auto: this CPU has no native bf16 dot products (AVX512_BF16 or AMX)")
    if shape is None or shape[0] * shape[1] < CPU_BF16_MIN_WEIGHT:
        return PrecisionChoice("fp32", "auto: the model's products are too small for bf16 to pay on a CPU")
    r = (ratio or bf16_ratio)(*shape)
    chosen = "bf16" if r <= CPU_BF16_PAYS else "fp32"
    return PrecisionChoice(chosen, f"auto: {isa} on this CPU; the model's products take {r:.2f}x the fp32 time in "
                                   f"bf16 ({'at most' if chosen == 'bf16' else 'more than'} {CPU_BF16_PAYS})")


def planned_card_native_bf16() -> bool:
    """The planner's card: this machine's CUDA card when it has one, else one with native bf16 (the cards the
    presets are written for; plan an older card with memory.precision=fp32)."""
    import torch

    return native_bf16() if torch.cuda.is_available() else True
