"""What differs between ranks in a checkpoint: RNG states, and under fsdp2 each rank's shard of the optimizer
state (one file per rank beside the checkpoint's trainer state)."""

from __future__ import annotations

from pathlib import Path

from ..config import ConfigError
from ..world import World
from .state_io import load_state, save_state
from .store import capture_rng, restore_rng


def rank_file(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / f"rank-{rank:03d}"


def save_rank_state(ckpt_dir: Path, world: World, policy) -> None:
    """What differs between ranks: RNG states, and under fsdp2 this rank's shard of the optimizer state."""
    state = {"rng": capture_rng()}
    if world.strategy == "fsdp2":
        state["optimizer"] = policy.optimizer.state_dict()  # DTensor states are stored as this rank's shard
    save_state(state, rank_file(ckpt_dir, world.rank))


def load_rank_state(ckpt_dir: Path, world: World, policy) -> None:
    """Restore save_rank_state's file of this rank (a run resumed on the same number of ranks)."""
    if world.size == 1:
        return
    f = rank_file(ckpt_dir, world.rank)
    if not f.with_suffix(".json").is_file():
        raise ConfigError(f"{ckpt_dir} has no state for rank {world.rank}: it was written by a run on fewer ranks; "
                          f"resume with the same number of processes")
    state = load_state(f)
    restore_rng(state["rng"])
    if "optimizer" in state:
        policy.optimizer.load_state_dict(_as_shards(state["optimizer"], policy.optimizer))


def _as_shards(saved: dict, optimizer) -> dict:
    """Stored local shards back into DTensors laid out like their parameters (fsdp2 resume)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, values in saved["state"].items():
        p = params[index]
        if not isinstance(p, DTensor):
            continue
        for key, t in values.items():
            if t.dim() > 0 and tuple(t.shape) == tuple(p.to_local().shape):
                values[key] = DTensor.from_local(t.to(p.device), p.device_mesh, p.placements, run_check=False,
                                                 shape=p.shape, stride=p.stride())
    return saved
