"""Memory knobs applied to a model, memory freed between phases, and peak-memory readers.

Every option is explicit and named (docs/memory.md gives each one's measured or predicted effect):
precision of the weights, activation checkpointing (none / every block / every k-th block), emptying the
CUDA cache between rollout and training. Peak readers report CUDA's max_memory_allocated, or on CPU the
process's peak resident set (VmHWM, resettable on Linux; ru_maxrss otherwise).
"""

from __future__ import annotations

import contextlib
import ctypes
import platform
import resource
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from ..config.training import MemorySection
from ..kernels import apply_activation_checkpointing
from ..plan.device_defaults import update_mmap_choice
from ..plan.memory import checkpoint_every

MIB = 1024**2
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}


def torch_dtype(precision: str) -> torch.dtype:
    """The weights dtype of a resolved memory.precision (plan/resolved.py: "auto" is decided there, once)."""
    if precision not in PRECISIONS:
        raise ValueError(f'memory.precision={precision!r} must be resolved first (plan.resolved.resolve_settings)')
    return PRECISIONS[precision]


def apply_memory_config(model: nn.Module, cfg: MemorySection) -> nn.Module:
    """Cast floating weights to cfg.precision (LoRA adapters keep their own dtype) and set checkpointing
    (already resolved: "auto" is decided with the model's shape, plan/resolved.py resolve_settings)."""
    if cfg.activation_checkpointing == "auto":
        raise ValueError('activation_checkpointing="auto" must be resolved first (plan.resolved.resolve_settings)')
    dtype = torch_dtype(cfg.precision)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and "lora_" not in name and p.dtype != dtype:
                p.data = p.data.to(dtype)
    apply_activation_checkpointing(model, checkpoint_every(cfg.activation_checkpointing, cfg.checkpoint_every))
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = cfg.allow_tf32
    return model


def free_rollout_memory() -> None:
    """Hand the rollout's cached CUDA blocks (KV cache, logits) back before training allocates activations.

    The tensors themselves are already freed by reference counting when the rollout returns; what stays is
    the caching allocator's reserve, which empty_cache releases. No gc.collect(): it cost ~0.2 s per step on
    the CPU demo and finds no tensors that refcounting missed. On CPU there is nothing to do.
    """
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter: requests of at least this many bytes are served by mmap
GLIBC_MMAP_MAX = 32 * MIB  # the most glibc's own sliding threshold grows to on 64-bit: restored after the update


def _glibc():
    """The C library through ctypes when it is glibc (mallopt / malloc_trim exist), else None."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL("libc.so.6")


def update_allocations_rule(setting: str, device: torch.device) -> str:
    """memory.cpu_update_mmap resolved to the update's allocation rule: "mmap" (true), "trim", or "heap" (false, auto
    as plan/device_defaults.py update_mmap_choice decides it, and every device but the CPU).

    "trim" keeps the heap and gives its
    freed pages back at the update's start and end: about half of what the heap alone gains over a long run, at
    about half of mmap's page faults and the heap's speed (the `--real` demo's recipe; docs/memory.md).
    """
    if torch.device(device).type != "cpu":
        return "heap"
    return {"true": "mmap", "trim": "trim"}.get(update_mmap_choice(setting), "heap")


@contextlib.contextmanager
def update_allocations(rule: str) -> Iterator[None]:
    """The update's CPU allocations under `rule` (update_allocations_rule). "mmap": inside, allocations of 1 MiB and
    more are mmapped, so each goes back to the OS when freed. "trim" and "mmap": freed heap pages are released on
    entry (the rollout's freed holes: decode's packed weights, kernels/packing.py, are ~one weight copy) and on
    exit (malloc_trim). "heap", or a C library that is not glibc: nothing.

    Why: glibc serves a few-MB tensor (activations, recomputed blocks, log-prob chunks) from its heap, and
    the update's changing shapes leave freed holes that later requests do not fit; the heap's resident size
    then grows step after step (~0.5 GB over 20 steps of the real-model recipe in fp32, ~1.2 GB in bf16) while
    live tensors stay the same. Under "mmap", what free heap chunks cannot serve is mmapped rather than grown into
    the heap, at the cost of page faults; on exit the threshold is fixed at glibc's own maximum.
    """
    libc = _glibc() if rule in ("mmap", "trim") else None
    if libc is None:
        yield
        return
    libc.malloc_trim(0)
    if rule == "mmap":
        libc.mallopt(M_MMAP_THRESHOLD, MIB)
    try:
        yield
    finally:
        if rule == "mmap":
            libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_MAX)
        libc.malloc_trim(0)


# ----------------------------------------------------------------------------------------------------
# Peak-memory readers


def _proc_status_kib(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _maxrss_mib() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / MIB if sys.platform == "darwin" else rss / 1024


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def reset_peak_memory(device: str | torch.device = "cpu") -> bool:
    """Start a new peak window. On CPU writes 5 to /proc/self/clear_refs (Linux); False if not resettable."""
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_memory_mib(device: str | torch.device = "cpu") -> float:
    """Peak since the last reset: CUDA max_memory_allocated, or the process's peak RSS on CPU."""
    if _is_cuda(device):
        return torch.cuda.max_memory_allocated(device) / MIB
    hwm = _proc_status_kib("VmHWM")
    return hwm / 1024 if hwm is not None else _maxrss_mib()
