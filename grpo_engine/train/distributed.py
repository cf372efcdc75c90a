"""Data-parallel GRPO on torch.distributed (launched by torchrun): N ranks, one global batch, one update.

Each rank samples its share of the step's prompts with the policy's own weights, scores them and trains on
them; the loss normalisers are the WHOLE step's token / sequence counts (all-reduced), so the gradients summed
over ranks equal one process's gradient on the whole batch, and every rank takes the same optimizer step.

Two strategies (distributed.strategy):
  ddp    every rank holds the whole model; after a pass's micro-batches, every gradient is summed over ranks
         once, in flat buckets. Not torch's DistributedDataParallel wrapper: its autograd hooks never see the
         gradients the fused LM head writes into `.grad` by hand, nor the sparse embedding gradient added into
         a dense `.grad` -- exactly where a missed reduction would silently train each rank on its own data.
  fsdp2  `fully_shard` on every block and the root: weights, gradients and optimizer state are sharded. A phase
         that runs forwards (rollout, old/reference log-probs, the update) first gathers the weights once
         (`gathered`), so ranks whose completions or micro-batches differ in number never disagree on
         collectives; the update accumulates without syncing and reduce-scatters once, at a closing
         zero-loss micro-batch that every rank runs.
"""

from __future__ import annotations

import contextlib
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..config import Config, ConfigError
from ..model.loading import pick_device
from ..plan.from_config import config_model_shape
from ..plan.memory import param_counts
from ..plan.policy_spec import collective_backend, sharding
from ..world import World

BUCKET_ELEMENTS = 1 << 24  # gradients are summed in flat buckets of at most this many elements


def check_layout(cfg: Config, size: int) -> None:
    """Layouts that cannot work are config errors, reported before any process group or model exists."""
    if size == 1:
        return
    s = cfg.distributed.strategy
    if cfg.rollout.prompts_per_step % size:
        raise ConfigError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} is the global count and must "
                          f"split evenly over {size} ranks (a group never straddles ranks): make it a multiple of "
                          f"{size}")
    if s == "fsdp2" and cfg.lora.enabled:
        raise ConfigError("distributed.strategy=fsdp2 with lora.enabled: only the adapters train, so sharding buys "
                          "nothing; use distributed.strategy=ddp (auto picks it)")
    if s == "fsdp2" and cfg.optimizer.name in ("adamw_offload", "adamw_8bit"):
        raise ConfigError(f"distributed.strategy=fsdp2 shards the optimizer state itself; optimizer.name="
                          f"{cfg.optimizer.name} conflicts with it: use optimizer.name=adamw or adamw_fused")


def init_world(cfg: Config) -> World:
    """Join the process group torchrun set up (gloo on CPU, nccl on CUDA) and pick the strategy: before anything
    is read, so before Resolved (plan/resolved.py), which records the same two answers of the same functions."""
    size = int(os.environ.get("WORLD_SIZE", "1"))  # the ranks torchrun started (1 without torchrun)
    check_layout(cfg, size)
    if size == 1:
        return World()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = collective_backend(cfg.distributed.backend, pick_device(cfg.model.device, local_rank))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(minutes=cfg.distributed.timeout_minutes))
    strategy = sharding(cfg, lambda: param_counts(config_model_shape(cfg))[0], dist.get_world_size())
    return World(dist.get_rank(), dist.get_world_size(), local_rank, strategy)


def close_world(world: World) -> None:
    """Destroy the process group once nothing refers to DDP / FSDP2 state any more: a gloo rank that still holds
    them at interpreter exit aborts now and then ("terminate called without an active exception") after a
    completed run, failing it under torchrun."""
    if world.size > 1 and dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------------
# Gradients


def _buckets(tensors: list[torch.Tensor], limit: int):
    """Consecutive same-dtype groups of tensors of at most `limit` elements (one tensor may exceed it alone)."""
    bucket: list[torch.Tensor] = []
    for t in tensors:
        if bucket and (sum(b.numel() for b in bucket) + t.numel() > limit or t.dtype != bucket[0].dtype):
            yield bucket
            bucket = []
        bucket.append(t)
    if bucket:
        yield bucket


def sum_gradients(model: nn.Module, world: World) -> None:
    """ddp: sum every trainable parameter's .grad over ranks, once (a rank without one contributes zeros).
    With LoRA only the adapters train, so only they are summed."""
    if world.size == 1 or world.strategy != "ddp":
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in _buckets([p.grad for p in params], BUCKET_ELEMENTS):
        flat = torch.cat([g.reshape(-1) for g in bucket])  # [sum of numel]
        dist.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


# ----------------------------------------------------------------------------------------------------
# FSDP2


def fsdp_units(model: nn.Module | None) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [] if model is None else [m for m in model.modules() if isinstance(m, FSDPModule)]


def shard_model(model: nn.Module, world: World) -> nn.Module:
    """fsdp2: `fully_shard` every block, then the root (embedding, final norm, LM head). Returns the model."""
    if world.strategy != "fsdp2":
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(model.device.type, (world.size,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    world.grad_scale = _reduce_scatter_scale(mesh, model.device, world.size)
    return model


def _reduce_scatter_scale(mesh, device: torch.device, size: int) -> float:
    """What FSDP2's gradient reduction must be multiplied by to give the SUM over ranks: measured on a probe
    (some torch versions and backends average, others sum), not assumed."""
    from torch.distributed.fsdp import fully_shard

    probe = fully_shard(nn.Linear(1, size, bias=False, device=device), mesh=mesh)
    nn.init.ones_(probe.weight)
    probe(torch.ones(1, 1, device=device)).sum().backward()  # every rank's gradient: ones
    got = float(probe.weight.grad.to_local().float().mean())  # size when summed, 1 when averaged
    return size / got


@contextlib.contextmanager
def gathered(model: nn.Module | None, world: World):
    """fsdp2: the whole model unsharded once for a phase of forwards (rollout, scoring), resharded after, so
    ranks that run different numbers of forwards never wait on each other. A no-op otherwise."""
    units = fsdp_units(model) if world.strategy == "fsdp2" else []
    for m in units:
        m.set_reshard_after_forward(False)
        m.unshard()
    try:
        yield model
    finally:
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(True)


@contextlib.contextmanager
def accumulating(model: nn.Module, world: World):
    """fsdp2 update pass: weights gathered once and gradients accumulated locally over any number of
    micro-batches; on a clean exit one zero-loss micro-batch that every rank runs reduce-scatters the total,
    and the result is rescaled to the sum over ranks. A no-op otherwise."""
    units = fsdp_units(model) if world.strategy == "fsdp2" else []
    for m in units:
        m.set_reshard_after_forward(False)
        m.set_reshard_after_backward(False)
        m.set_requires_gradient_sync(False)
        m.unshard()
    closed = False
    try:
        yield model
        if units:
            for m in units:
                m.set_requires_gradient_sync(True)
            _closing_micro_batch(model)
            closed = True
    finally:
        for m in units:
            m.set_requires_gradient_sync(True)
            m.set_reshard_after_backward(True)
            m.set_reshard_after_forward(True)
            m.reshard()
    if closed and world.grad_scale != 1.0:  # now the parameters are the shards and .grad their reduced sums
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(world.grad_scale)


def _closing_micro_batch(model: nn.Module) -> None:
    """A 2-token forward through every block and the head with loss 0: its backward is what triggers FSDP2's
    reduce-scatter of the gradients accumulated so far, the same on every rank."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    hidden = model(ids, return_hidden=True)  # [1, 2, D]
    (0.0 * model.lm_head(hidden).float().sum()).backward()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our-named full (unsharded) tensors of every parameter of an fsdp2 model, on CPU; a collective."""
    return {name: p.detach().full_tensor().cpu() for name, p in model.named_parameters(remove_duplicate=False)}
