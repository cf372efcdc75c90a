"""The policy being trained and everything that moves with it: weights, optimizer, LR schedule, reference.

`policy_spec(cfg)` is the ONE place that decides how the policy is held -- full fine-tuning, LoRA or QLoRA;
no reference (beta = 0), the base model under the adapters (LoRA: adapters switched off, no copy), a parked
CPU copy, or a copy on the policy's device -- and whether that reference moves (hard_reset / mixin) so that
checkpoints must carry it. `build_policy` makes a `Policy` from that decision; the memory planner reads the
same spec, so what is planned is what runs.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from ..config import Config
from ..kernels import KernelPlan, apply_kernels, bf16_slowdown, choose_plan, cpu_model, load_plan, measured_here
from ..model.loading import load_model
from ..model.lora import adapters_disabled, apply_lora, load_adapter, lora_merged, lora_modules
from ..plan.memory import resolve_checkpointing
from ..plan.policy_spec import PolicySpec, policy_spec
from ..world import World
from .batching import RolloutBatch
from .distributed import shard_model
from .memory import apply_memory_config, torch_dtype
from .optim import build_optimizer, make_scheduler
from .reference import Reference, make_reference
from .update import batch_logprobs


class Policy:
    """The trained model with its optimizer, LR scheduler and (optional) KL reference."""

    def __init__(self, model, optimizer, scheduler, reference: Reference | None, spec: PolicySpec,
                 kernels: KernelPlan):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.reference, self.spec, self.kernels = reference, spec, kernels

    @property
    def device(self) -> torch.device:
        return self.model.device

    def rollout_weights(self):
        """Context in which the policy generates: LoRA adapters merged into the weights when unmerging restores
        them bit for bit (low-precision bases, whose original weight is parked and copied back). An fp32 base
        would be restored by subtraction, whose rounding would drift the frozen weights over a long run, so it
        decodes through the adapter path instead (same function, one extra small matmul per projection)."""
        low_precision = next(self.model.parameters()).dtype != torch.float32
        if self.spec.mode != "full" and low_precision and any(True for _ in lora_modules(self.model)):
            return lora_merged(self.model)
        return contextlib.nullcontext(self.model)

    def old_logprobs(self, batch: RolloutBatch, budget: int, *, temperature: float, chunk_size: int):
        """[B, T] log-probs of the policy as it is now (the behaviour policy of mu > 1 passes)."""
        return batch_logprobs(self.model, batch, budget, temperature=temperature, chunk_size=chunk_size)

    def ref_logprobs(self, batch: RolloutBatch, budget: int, *, temperature: float, chunk_size: int):
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
        """Advance the LR schedule; a moving reference follows the policy on its schedule when it was updated.

        The schedule counts steps, updated or not (a step whose groups were all filtered still uses up its
        learning rate), so the first step may advance it before any optimizer.step(): torch's warning about that
        order is expected here and silenced."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            self.scheduler.step()
        if updated and self.reference is not None:
            self.reference.on_step(step, self.model)

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


def build_policy(cfg: Config, device: torch.device, resume_dir: Path | None = None,
                 world: World | None = None) -> Policy:
    """The policy of `cfg` on `device`: weights (the checkpoint's when resuming full fine-tuning; LoRA reloads
    the base from model.path and the adapters from the checkpoint), kernels, memory options, optimizer,
    schedule and reference. A frozen reference is always the weights at model.path; a moving one is restored
    from the checkpoint by load_state_dict. Under fsdp2 the model (and a copied reference) are sharded before
    the optimizer is built, so its state is sharded too."""
    world = world or World()
    spec = policy_spec(cfg)
    dtype = torch_dtype(cfg.memory.precision, device)
    full_resume = resume_dir is not None and spec.mode == "full"
    model = policy_model(cfg, spec, resume_dir / "model" if full_resume else cfg.model.path, dtype, device)
    if spec.mode != "full" and resume_dir is not None:
        load_adapter(model, resume_dir / "adapter")
    if dtype == torch.bfloat16 and device.type == "cpu":
        warn_if_bf16_is_slow(model.config)
    kernels = kernel_plan(model, resume_dir)
    apply_kernels(model, kernels)
    apply_memory_config(model, replace(cfg.memory, activation_checkpointing=checkpointing_for(cfg, model, dtype)))
    reference = None
    if spec.reference in ("cpu", "gpu_copy"):
        initial = load_model(cfg.model.path, dtype, device) if full_resume else model
        reference = make_reference(apply_kernels(initial, kernels), cfg.reference, beta=cfg.algorithm.beta)
        shard_model(reference.module, world)
    shard_model(model, world)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer, device)
    s = cfg.schedule
    scheduler = make_scheduler(optimizer, total=s.steps, warmup=s.warmup_steps, kind=s.lr_schedule,
                               min_ratio=s.min_lr_ratio)
    return Policy(model, optimizer, scheduler, reference, spec, kernels)


def policy_model(cfg: Config, spec: PolicySpec, path, dtype: torch.dtype, device: torch.device):
    """The model at `path` on `device`, with LoRA adapters unless spec.mode is full. A QLoRA model is read onto
    the CPU and apply_lora moves it to `device` one projection at a time, each quantized before the next is
    moved: loading then needs about the quantized model's size on the GPU, not the unquantized model's."""
    if spec.mode == "full":
        return load_model(path, dtype, device)
    model = load_model(path, dtype, torch.device("cpu") if spec.mode == "qlora" else device)
    return apply_lora(model, cfg.lora, device)


def checkpointing_for(cfg: Config, model, dtype: torch.dtype) -> str:
    """memory.activation_checkpointing with "auto" resolved for this model (plan.memory.resolve_checkpointing:
    every block when a full micro-batch's activations would be a large share of the training state). A pure
    function of the config and the model's shape, so a resumed run resolves it the same way."""
    from ..plan.from_config import plan_input_from_config  # plan.from_config imports this module

    knobs = replace(plan_input_from_config(cfg), precision="bf16" if dtype == torch.bfloat16 else "fp32")
    return resolve_checkpointing(model.config, knobs, cfg.memory.micro_batch_tokens)


BF16_SLOWDOWN_WARN = 1.5  # bf16 products this much slower than fp32: say so


def warn_if_bf16_is_slow(config) -> None:
    """memory.precision=bf16 on a CPU: warn when this CPU's bf16 products are slower than fp32 ones (no native bf16
    dot products: a step can take many times as long as in fp32, with nothing else to show why)."""
    slowdown = bf16_slowdown(config.hidden_size, config.intermediate_size)
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
