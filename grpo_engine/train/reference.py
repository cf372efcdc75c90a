"""Reference policy for the KL term: none, frozen copy, periodic hard reset, or TR-DPO style mix-in.

The trainer uses it like this:

    ref = make_reference(policy, cfg.reference, beta=cfg.loss.beta)   # None when beta == 0 or mode "none"
    ...
    if ref is not None:
        ref.before_pass(device)           # moves a CPU-parked copy to the policy's device
        with torch.no_grad():
            hidden = ref.module(ids, return_hidden=True)
        ref.after_pass()                  # parks it back on CPU (if park_on_cpu)
    ...
    optimizer.step(); ref.on_step(step, policy)   # hard reset / mix-in on their schedule

Why these options: a frozen reference anchors the policy to the start (DeepSeekMath); a periodic hard
reset lets it drift far over a long run while still keeping each stretch close (the "reference reset" of
ProRL, Liu et al. 2025); the mix-in ref <- alpha * policy + (1 - alpha) * ref (TR-DPO, Gorbatovski et al.
2024) moves the anchor smoothly. Parking on CPU trades a host<->device copy per step for the reference's
whole weight memory on a small GPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..config.algorithm import ReferenceConfig


def _no_update(ref: nn.Module, policy: nn.Module, cfg: ReferenceConfig) -> None:
    pass


@torch.no_grad()
def _hard_reset(ref: nn.Module, policy: nn.Module, cfg: ReferenceConfig) -> None:
    for r, p in _paired_tensors(ref, policy):
        r.copy_(p)  # copy_ handles the device / dtype of the reference


@torch.no_grad()
def _mixin(ref: nn.Module, policy: nn.Module, cfg: ReferenceConfig) -> None:
    a = cfg.mixin_alpha
    for r, p in _paired_tensors(ref, policy):
        if r.is_floating_point():
            r.mul_(1 - a).add_(p.to(device=r.device, dtype=r.dtype), alpha=a)
        else:
            r.copy_(p)


UPDATES: dict[str, Callable[[nn.Module, nn.Module, ReferenceConfig], None]] = {
    "frozen": _no_update,
    "hard_reset": _hard_reset,
    "mixin": _mixin,
}


def _paired_tensors(ref: nn.Module, policy: nn.Module):
    """(ref tensor, policy tensor) for every parameter and buffer, matched by name (tied weights once)."""
    pol = dict(policy.named_parameters()) | dict(policy.named_buffers())
    refs = dict(ref.named_parameters()) | dict(ref.named_buffers())
    if pol.keys() != refs.keys():
        raise ValueError(f"reference and policy have different tensors: {sorted(pol.keys() ^ refs.keys())[:5]}")
    return [(refs[k], pol[k].detach()) for k in refs]


class Reference:
    """A frozen (requires_grad=False, eval mode) copy of the policy with its update rule and placement."""

    def __init__(self, policy: nn.Module, cfg: ReferenceConfig):
        self.cfg = cfg
        self.home = torch.device("cpu") if cfg.park_on_cpu else _device_of(policy)
        self.module = _detached_copy(policy, self.home)
        self._update = UPDATES[cfg.mode]

    def before_pass(self, device: torch.device | str) -> None:
        """Put the reference on `device` for its forward pass (a no-op when it already lives there)."""
        self.module.to(device)

    def after_pass(self) -> None:
        """Send it back home (CPU when parked), freeing its device memory for the policy's pass."""
        self.module.to(self.home)

    def on_step(self, step: int, policy: nn.Module) -> bool:
        """Call after optimizer step `step` (1-based); applies the mode's update every `update_every` steps.

        Returns True when the reference changed.
        """
        if self.cfg.mode == "frozen" or step % self.cfg.update_every != 0:
            return False
        self._update(self.module, policy, self.cfg)
        return True


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _detached_copy(policy: nn.Module, device: torch.device) -> nn.Module:
    """Deep copy whose tensors are created directly on `device` (no second full copy on the GPU)."""
    memo: dict[int, object] = {}
    for p in policy.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(device, copy=True), requires_grad=False)
    for b in policy.buffers():
        memo[id(b)] = b.detach().to(device, copy=True)
    ref = copy.deepcopy(policy, memo)
    ref.eval()
    return ref


def make_reference(policy: nn.Module, cfg: ReferenceConfig, *, beta: float | None = None) -> Reference | None:
    """The reference policy, or None when no KL term is used (mode "none" or beta == 0: nothing is copied)."""
    if cfg.mode == "none" or beta == 0:
        return None
    return Reference(policy, cfg)  # ReferenceConfig checked its mode, update_every and mixin_alpha itself
