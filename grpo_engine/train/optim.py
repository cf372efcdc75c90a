"""AdamW variants chosen by name: plain (foreach), fused, CPU-offloaded, 8-bit.

bf16 weights: we keep an fp32 MASTER copy of each bf16 parameter (plus fp32 exp_avg / exp_avg_sq) instead
of Kahan-compensated bf16 updates. Why: (1) the update is then exactly fp32 AdamW followed by one rounding
to bf16, so it is testable against torch.optim.AdamW and resumes bit-exactly; (2) with the offloaded
optimizer the master copy lives in CPU RAM and costs no GPU memory at all, which is the recipe that needs
bf16 weights most (3B full fine-tuning on 24 GB); (3) on GPU it costs 4 B/param where Kahan costs 2, but
the recipes that are GPU-memory-bound on the optimizer use offload or 8-bit state instead. Both the
GPU-resident master-weight path and the offloaded one are the same class, `OffloadedAdamW`, differing only
in `state_device`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import torch

from ..config.fields import ConfigError
from ..config.training import SCHEDULES, OptimizerSection, lr_factor

# ----------------------------------------------------------------------------------------------------
# Offloaded / master-weight AdamW


class OffloadedAdamW(torch.optim.Optimizer):
    """AdamW whose state (fp32 master, exp_avg, exp_avg_sq) lives on `state_device`, updated per parameter.

    With state_device="cpu" (default) the optimizer uses no GPU memory: for each parameter the gradient is
    copied to the CPU, the AdamW update runs there on the fp32 master copy, and the new value is copied
    back into the (bf16 or fp32) GPU parameter. The next parameter's gradient copy is started before the
    current update so the transfer overlaps CPU work. With state_device=None the state stays next to each
    parameter: fp32 master weights on the GPU for bf16 models.

    Math: torch.optim.AdamW (decoupled decay, bias correction, no amsgrad), in fp32. stochastic_rounding: a bf16
    parameter is its master rounded stochastically (set_from_master), else to nearest.
    """

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, state_device: str | None = "cpu",
                 pin_memory: bool = True, stochastic_rounding: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.state_device = None if state_device is None else torch.device(state_device)
        self.stochastic_rounding = stochastic_rounding  # bf16 parameters from their masters: set_from_master
        on_cpu = self.state_device == torch.device("cpu")
        self.pin_memory = pin_memory and torch.cuda.is_available() and on_cpu

    def _home(self, p: torch.Tensor) -> torch.device:
        return p.device if self.state_device is None else self.state_device

    def _fp32_state(self, t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=torch.float32, device=self._home(p), pin_memory=self.pin_memory)
        return out.copy_(t)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            # master is the parameter itself when it is already fp32 on the state device (no copy)
            same = p.dtype == torch.float32 and p.device == self._home(p)
            state["master"] = p.data if same else self._fp32_state(p.detach(), p)
            state["exp_avg"] = torch.zeros_like(state["master"])
            state["exp_avg_sq"] = torch.zeros_like(state["master"])
            state["step"] = 0
        return state

    def _fetch_grad(self, p: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying p.grad to the state device; returns (buffer, event to wait on or None)."""
        home = self._home(p)
        if p.grad.device == home:
            return p.grad, None
        buf = torch.empty(p.grad.shape, dtype=p.grad.dtype, device=home, pin_memory=self.pin_memory)
        buf.copy_(p.grad, non_blocking=self.pin_memory)
        if not self.pin_memory or p.grad.device.type != "cuda":
            return buf, None
        event = torch.cuda.Event()
        event.record()
        return buf, event

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            index = {id(p): k for k, p in enumerate(group["params"])}
            pending = self._fetch_grad(params[0]) if params else None
            for i, p in enumerate(params):
                grad, event = pending
                if i + 1 < len(params):  # overlap the next transfer with this update
                    pending = self._fetch_grad(params[i + 1])
                if event is not None:
                    event.synchronize()
                if grad.is_sparse:
                    raise RuntimeError("OffloadedAdamW does not support sparse gradients")
                state = self._init_state(p)
                rounding = self._rounding(p, state, index[id(p)])
                if state["master"] is not p.data and p.device == state["master"].device:
                    adamw_update_sliced(state, grad, group, p, rounding)  # a low-precision parameter beside its master
                    continue
                adamw_update(state, grad.float(), group)
                if state["master"] is not p.data:
                    # cast on the state device, then copy back (no fp32 temporary on the GPU)
                    p.copy_(set_from_master(state["master"], p.dtype, rounding), non_blocking=self.pin_memory)
        if self.pin_memory:
            torch.cuda.synchronize()  # masters must not change while copies from them are in flight
        return loss

    def _rounding(self, p: torch.Tensor, state: dict, index: int) -> int | None:
        """The draw of this step's stochastic rounding of parameter `index` (None: round to nearest), a number of
        the step and the index alone, so a resumed run rounds as the uninterrupted one."""
        if not self.stochastic_rounding or p.dtype != torch.bfloat16:
            return None
        return (state["step"] + 1) * 1_000_003 + index  # the step this update is about to make

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore param groups, and the fp32 state on its own device (torch's default would cast the
        master copy to the parameter's dtype and device, losing the fp32 precision)."""
        saved = state_dict["state"]
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, st in saved.items():
            p = params[int(idx)]
            self.state[p] = {k: v if k == "step" else self._fp32_state(v, p) for k, v in st.items()}
            if p.dtype == torch.float32 and p.device == self._home(p):  # master is the parameter itself
                p.data.copy_(self.state[p]["master"])
                self.state[p]["master"] = p.data


def adamw_update(state: dict, grad: torch.Tensor, group: dict) -> None:
    """One AdamW step on fp32 tensors, in place: state['master'], state['exp_avg'], state['exp_avg_sq']."""
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    state["step"] += 1
    t = state["step"]
    master, m, v = state["master"], state["exp_avg"], state["exp_avg_sq"]
    master.mul_(1 - lr * wd)
    m.lerp_(grad, 1 - beta1)
    v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias1, bias2 = 1 - beta1**t, 1 - beta2**t
    denom = (v.sqrt() / math.sqrt(bias2)).add_(eps)
    master.addcdiv_(m, denom, value=-lr / bias1)


UPDATE_SLICE = 1 << 22  # elements of a master updated at a time: 16 MiB of fp32 temporaries at most


ROUNDING_OFFSETS = 1 << 16  # windows of the noise pool one rounding may start at
_NOISE_POOLS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _noise_pool(device: torch.device) -> torch.Tensor:
    """[UPDATE_SLICE + ROUNDING_OFFSETS] int32 uniform in [0, 2^16), drawn once per device from a fixed seed: a
    window of it is the noise of one stochastic rounding: adding a window costs a fraction of drawing fresh noise
    for every weight each step."""
    key = (device, UPDATE_SLICE + ROUNDING_OFFSETS)
    if key not in _NOISE_POOLS:
        g = torch.Generator().manual_seed(0)
        _NOISE_POOLS[key] = torch.randint(0, 1 << 16, (key[1],), dtype=torch.int32, generator=g).to(device)
    return _NOISE_POOLS[key]


_SCRATCH: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _scratch(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """[UPDATE_SLICE] of `dtype`, one per device and dtype for the life of the process: the per-slice temporaries
    of a low-precision update (a bf16 gradient's fp32 copy, stochastic rounding's bits). Why not fresh each slice:
    under memory.cpu_update_mmap every fresh 16 MiB temporary is page-faulted in anew, about 70 of them a step at
    135M parameters (0.3 million page faults)."""
    key = (torch.device(device), dtype)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty(UPDATE_SLICE, dtype=dtype, device=device)
    return _SCRATCH[key]


def draw_number(draw: int, part: int) -> int:
    """The draw of part `part` of draw `draw`: an odd multiplier keeps distinct draws distinct modulo any power of
    two (so two steps of one parameter never start at the same window of the noise pool, within 2^16 steps)."""
    return (draw * 2_654_435_761 + part * 40_503) % (1 << 62)


def set_from_master(master: torch.Tensor, dtype: torch.dtype, rounding: int | None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `master` [*] rounded to `dtype` [*] (into `out`, contiguous, when given): to nearest (rounding None), or
    (bf16 only) stochastically with the draw numbered `rounding`: up with probability (master - below) / (above -
    below) for its two bf16 neighbours.
    Why: a CPU run's few steps at a small learning rate move a master by less than half of bf16's spacing, so
    rounding to nearest gives back the same bf16 weight and the model runs as if it had not learned; stochastic
    rounding keeps the weight the model runs equal to its master in expectation (as torchao's bf16 optimizers do).
    The draw picks each chunk's window of the noise pool, so the same draw rounds the same way (exact resume)."""
    if rounding is None:
        return master.to(dtype) if out is None else out.copy_(master)
    pool, flat, scratch = _noise_pool(master.device), master.reshape(-1), _scratch(master.device, torch.int32)
    out = torch.empty(master.shape, dtype=torch.bfloat16, device=master.device) if out is None else out
    dest = out.view(-1)
    for start in range(0, flat.numel(), UPDATE_SLICE):  # int32 temporaries of one slice at most
        n = min(UPDATE_SLICE, flat.numel() - start)
        offset = draw_number(rounding, start // UPDATE_SLICE) % ROUNDING_OFFSETS
        # bf16 is fp32's high 16 bits: add uniform noise to the low 16 and truncate (on the magnitude, sign kept)
        bits = torch.add(flat[start : start + n].view(torch.int32), pool[offset : offset + n], out=scratch[:n])
        dest[start : start + n] = bits.bitwise_and_(-(1 << 16)).view(torch.float32)  # exact: low 16 bits zero
    return out


def adamw_update_sliced(state: dict, grad: torch.Tensor, group: dict, param: torch.Tensor,
                        rounding: int | None = None) -> None:
    """adamw_update of a low-precision parameter's fp32 master from its gradient (any dtype), UPDATE_SLICE
    elements at a time, each slice's parameter then set to its master's rounding (set_from_master: stochastic
    with `rounding`, else to nearest). Slices bound the temporaries (the gradient's fp32 copy) to one slice
    instead of the largest weight (a 151,936 x 512 bf16 embedding's would be 311 MB of peak RSS), and torch's
    fused AdamW kernel, where this torch has it, updates a slice in one pass over
    memory instead of the eight of adamw_update; where it has none, adamw_update runs on the slice."""
    state["step"] += 1
    t = state["step"]
    fused = getattr(torch, "_fused_adamw_", None)
    step = torch.tensor(float(t), device=state["master"].device)  # the fused kernel's step count
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    flat = [x.view(-1) for x in (state["master"], state["exp_avg"], state["exp_avg_sq"], param.data)]
    g_flat = grad.reshape(-1)
    for start in range(0, g_flat.numel(), UPDATE_SLICE):
        master, m, v, p = (x[start : start + UPDATE_SLICE] for x in flat)
        g = g_flat[start : start + UPDATE_SLICE]  # [slice]
        if g.dtype != torch.float32 or g.device != master.device:
            g = _scratch(master.device, torch.float32)[: g.numel()].copy_(g)  # fp32
        if fused is not None:
            fused([master], [g], [m], [v], [], [step], lr=lr, beta1=beta1, beta2=beta2, weight_decay=wd, eps=eps,
                  amsgrad=False, maximize=False)
        else:
            adamw_update({"master": master, "exp_avg": m, "exp_avg_sq": v, "step": t - 1}, g, group)
        set_from_master(master, p.dtype, None if rounding is None else draw_number(rounding, start // UPDATE_SLICE),
                        out=p)  # the parameter's slice, in place


# ----------------------------------------------------------------------------------------------------
# The variants, chosen by name


def _torch_adamw(params: list, cfg: OptimizerSection, fused: bool):
    if cfg.master_weights and any(p.dtype != torch.float32 for p in params):
        # torch keeps state in the param dtype: use our fp32-master path
        return OffloadedAdamW(params, cfg.lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay, state_device=None,
                              stochastic_rounding=cfg.bf16_rounding == "stochastic")
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if fused:
        return torch.optim.AdamW(params, fused=True, **kw)
    return torch.optim.AdamW(params, foreach=True, **kw)


def build_adamw(params, cfg, device):
    return _torch_adamw(params, cfg, fused=False)


def build_adamw_fused(params, cfg, device):
    """torch's fused AdamW (CUDA and CPU kernels): no full-size temporaries, and several times faster than foreach
    on the CPU (docs/memory.md). It is also what transformers' Trainer (and so TRL) uses by default."""
    if device.type not in ("cuda", "cpu"):
        _fallback(cfg, f"adamw_fused has torch kernels for cuda and cpu, and the device is {device.type}",
                  "adamw (foreach)")
        return _torch_adamw(params, cfg, fused=False)
    return _torch_adamw(params, cfg, fused=True)


def build_adamw_offload(params, cfg, device):
    return OffloadedAdamW(params, cfg.lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay, state_device="cpu",
                          pin_memory=cfg.pin_memory, stochastic_rounding=cfg.bf16_rounding == "stochastic")


def build_adamw_8bit(params, cfg, device):
    """8-bit AdamW state from torchao (preferred) or bitsandbytes, on CUDA."""
    kw = dict(lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay)
    reasons = []
    if device.type != "cuda":
        reasons.append(f"8-bit AdamW kernels need CUDA and the device is {device.type}")
    else:
        try:
            from torchao.optim import AdamW8bit

            bf16 = any(p.dtype == torch.bfloat16 for p in params)
            return AdamW8bit(params, bf16_stochastic_round=bf16, **kw)
        except ImportError:
            reasons.append("torchao is not installed")
        try:
            import bitsandbytes as bnb

            return bnb.optim.AdamW8bit(params, **kw)
        except ImportError:
            reasons.append("bitsandbytes is not installed")
    _fallback(cfg, "; ".join(reasons) + " (pip install torchao)", "adamw with fp32 state")
    return build_adamw(params, cfg, device)


def _fallback(cfg: OptimizerSection, why: str, what: str) -> None:
    if cfg.strict:  # a ConfigError (ValueError): the CLI prints this one line, not a traceback
        raise ConfigError(f"optimizer.name={cfg.name!r} unavailable: {why}; optimizer.strict=true forbids "
                           f"falling back. Choose another optimizer.name or set strict=false")
    warnings.warn(f"optimizer {cfg.name!r} unavailable ({why}): fell back to {what}", stacklevel=3)


OPTIMIZERS: dict[str, Callable] = {
    "adamw": build_adamw,
    "adamw_fused": build_adamw_fused,
    "adamw_offload": build_adamw_offload,
    "adamw_8bit": build_adamw_8bit,
}


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimizerSection,
                    device: str | torch.device = "cpu") -> torch.optim.Optimizer:
    """The optimizer named by cfg.name over the trainable `params` (those with requires_grad)."""
    params = [p for p in params if p.requires_grad]
    if not params:
        raise ValueError("build_optimizer got no trainable parameters (is everything frozen?)")
    return OPTIMIZERS[cfg.name](params, cfg, torch.device(device))


def make_scheduler(optimizer: torch.optim.Optimizer, *, total: int, warmup: int, kind: str, min_ratio: float):
    if kind not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    fn = lambda step: lr_factor(step, total=total, warmup=warmup, kind=kind, min_ratio=min_ratio)  # noqa: E731
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)
