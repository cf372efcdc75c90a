"""The policy being trained and everything that moves with it: weights, optimizer, LR schedule, reference.

`policy_spec(cfg)` is the ONE place that decides how the policy is held -- full fine-tuning, LoRA or QLoRA;
no reference (beta = 0), the base model under the adapters (LoRA: adapters switched off, no copy), a parked
CPU copy, or a copy on the policy's device -- and whether that reference moves (hard_reset / mixin) so that
checkpoints must carry it. `build_policy` makes a `Policy` from that decision; the memory planner reads the
same spec, so what is planned is what runs.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ..config import Config
from ..config.algorithm import ReferenceConfig
from ..kernels import (
    PLAN_FILE,
    KernelPlan,
    apply_kernels,
    bf16_ratio,
    choose_plan,
    cpu_model,
    load_plan,
    measured_here,
)
from ..model.loading import load_model
from ..model.lora import adapters_disabled, apply_lora, load_adapter
from ..plan.policy_spec import PolicySpec, policy_spec
from ..plan.resolved import Resolved
from ..world import World
from .batch import TrainBatch
from .distributed import shard_model
from .forward import batch_logprobs
from .memory import apply_memory_config, torch_dtype
from .optim import build_optimizer, make_scheduler


class Policy:
    """The trained model with its optimizer, LR scheduler and (optional) KL reference."""

    def __init__(self, model, optimizer, scheduler, reference: Reference | None, spec: PolicySpec,
                 kernel_plan: KernelPlan):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.reference, self.spec, self.kernel_plan = reference, spec, kernel_plan

    @property
    def device(self) -> torch.device:
        return self.model.device

    def rollout_weights(self):
        """Context in which the policy generates: its weights as the trainer runs them, LoRA adapters unmerged
        (model/lora.py: the adapter path, inside the CUDA graph on CUDA, where an optimizer step writes A and B in
        place). Merging is never worth it here: into a bf16 / fp16 base it rounds away every change under half a
        step of W, so the rollout would sample an older policy than the one being trained; an fp32 base would be
        restored by subtraction, whose rounding would drift the frozen weights over a long run."""
        return contextlib.nullcontext(self.model)

    def old_logprobs(self, batch: TrainBatch, budget: int, *, temperature: float, chunk_size: int):
        """[B, T] log-probs of the policy as it is now (the behaviour policy of mu > 1 passes)."""
        return batch_logprobs(self.model, batch, budget, temperature=temperature, chunk_size=chunk_size)

    def ref_logprobs(self, batch: TrainBatch, budget: int, *, temperature: float, chunk_size: int):
        """[B, T] log-probs of the reference policy, or None without a KL term."""
        if self.spec.reference == "none":
            return None
        if self.spec.reference == "adapters":
            with adapters_disabled(self.model):
                return batch_logprobs(self.model, batch, budget, temperature=temperature, chunk_size=chunk_size)
        self.reference.before_pass(self.device)
        try:
            return batch_logprobs(self.reference.module, batch, budget, temperature=temperature,
                                  chunk_size=chunk_size)
        finally:
            self.reference.after_pass()

    def after_update(self, step: int, updated: bool) -> None:
        """A moving reference follows the policy on its schedule when the policy was updated (the LR schedule
        advances in train/update.py, beside the optimizer step)."""
        if updated and self.reference is not None:
            self.reference.on_step(step, self.model)

    def kernel_files(self) -> dict[str, str]:
        """The kernel plan's record, a checkpoint's file (kernels.json) for an exact resume on this machine."""
        return {PLAN_FILE: self.kernel_plan.to_json()}

    def state_dict(self) -> dict:
        """What besides the weights an exact resume needs from the policy."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
        if self.spec.reference_moves:
            state["reference"] = self.reference.module.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.spec.reference_moves and "reference" in state:
            self.reference.module.load_state_dict(state["reference"])


def build_policy(resolved: Resolved, resume_dir: Path | None = None, world: World | None = None) -> Policy:
    """The policy of resolved.config on resolved.device: weights (the checkpoint's when resuming full
    fine-tuning; LoRA reloads the base from model.path and the adapters from the checkpoint), kernels, memory
    options, optimizer, schedule and reference. A frozen reference is always the weights at model.path; a moving
    one is restored from the checkpoint by load_state_dict. Under fsdp2 the model (and a copied reference) are
    sharded before the optimizer is built, so its state is sharded too. The settings are the ones this machine
    resolved before (plan/resolved.py: device, precision, the memory settings left to the engine)."""
    world = world or World()
    cfg, device = resolved.config, resolved.device
    spec = policy_spec(cfg)
    dtype = torch_dtype(resolved.precision)
    full_resume = resume_dir is not None and spec.mode == "full"
    model = policy_model(cfg, spec, resume_dir / "model" if full_resume else cfg.model.path, dtype, device)
    if spec.mode != "full" and resume_dir is not None:
        load_adapter(model, resume_dir / "adapter")
    if dtype == torch.bfloat16 and device.type == "cpu":
        warn_if_bf16_is_slow(model.config)
    plan = kernel_plan(model, resume_dir)
    apply_kernels(model, plan)
    apply_memory_config(model, cfg.memory)
    reference = None
    if spec.reference in ("cpu", "gpu_copy"):
        initial = load_model(cfg.model.path, dtype, device) if full_resume else model
        reference = make_reference(apply_kernels(initial, plan), cfg.reference, beta=cfg.algorithm.policy_loss.beta)
        shard_model(reference.module, world)
    shard_model(model, world)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer, device)
    s = cfg.schedule
    scheduler = make_scheduler(optimizer, total=s.steps, warmup=s.warmup_steps, kind=s.lr_schedule,
                               min_ratio=s.min_lr_ratio)
    return Policy(model, optimizer, scheduler, reference, spec, plan)


def policy_model(cfg: Config, spec: PolicySpec, path, dtype: torch.dtype, device: torch.device):
    """The model at `path` on `device`, with LoRA adapters unless spec.mode is full. A QLoRA model is read onto
    the CPU and apply_lora moves it to `device` one projection at a time, each quantized before the next is
    moved: loading then needs about the quantized model's size on the GPU, not the unquantized model's."""
    if spec.mode == "full":
        return load_model(path, dtype, device)
    model = load_model(path, dtype, torch.device("cpu") if spec.mode == "qlora" else device)
    return apply_lora(model, cfg.lora, device)


BF16_SLOWDOWN_WARN = 1.5  # bf16 products this much slower than fp32: say so


def warn_if_bf16_is_slow(config) -> None:
    """memory.precision=bf16 on a CPU: warn when this CPU's bf16 products are slower than fp32 ones (no native bf16
    dot products: a step can take many times as long as in fp32, with nothing else to show why)."""
    slowdown = bf16_ratio(config.hidden_size, config.intermediate_size)
    if slowdown > BF16_SLOWDOWN_WARN:
        warnings.warn(f"memory.precision=bf16 on {cpu_model()}: a bf16 product takes {slowdown:.1f}x as long as "
                      "in fp32 on this CPU (no native bf16 dot products); memory.precision=fp32 (the CPU default) "
                      "will train faster here", stacklevel=3)


def kernel_plan(model, resume_dir: Path | None) -> KernelPlan:
    """The checkpoint's kernel plan when resuming on the CPU and torch that measured it (same kernels and threads:
    the resumed run repeats the uninterrupted one bit for bit), else the one measured / cached for this model on
    this machine."""
    plan = load_plan(resume_dir) if resume_dir is not None else None
    if plan is not None and not measured_here(plan):
        warnings.warn(f"the checkpoint's kernel plan was measured on {plan.cpu} with torch {plan.torch}; this is "
                      f"{cpu_model()} with torch {torch.__version__}: measuring this machine's plan instead (the "
                      "resumed run will not repeat the uninterrupted one bit for bit)", stacklevel=2)
        plan = None
    return plan if plan is not None else choose_plan(model)  # apply_kernels sets its thread count


# ----------------------------------------------------------------------------------------------------
# The KL reference. Reference policy for the KL term: none, frozen copy, periodic hard reset, or TR-DPO style mix-in
# (Policy.ref_logprobs runs it between before_pass and after_pass; Policy.after_update calls on_step).
#
# Why these options: a frozen reference anchors the policy to the start (DeepSeekMath); a periodic hard
# reset lets it drift far over a long run while still keeping each stretch close (the "reference reset" of
# ProRL, Liu et al. 2025); the mix-in ref <- alpha * policy + (1 - alpha) * ref (TR-DPO, Gorbatovski et al.
# 2024) moves the anchor smoothly. Parking on CPU trades a host<->device copy per step for the reference's
# whole weight memory on a small GPU.


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


UPDATES: dict[str, Callable[[nn.Module, nn.Module, ReferenceConfig], None]] = {  # a frozen reference has none
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
        self._update = UPDATES.get(cfg.mode)

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
