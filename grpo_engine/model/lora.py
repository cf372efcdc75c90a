"""LoRA / QLoRA adapters for `Transformer`: inject, merge (fp32 / fp64 bases), disable for the reference, export.

Design:
* `LoRALinear` replaces a targeted `nn.Linear` but keeps the base `weight` / `bias` under the SAME
  attribute names, so `hf_name_table` / `hf_state_dict` / `save_model` still see
  `layers.{i}.attn.q_proj.weight`; the adapter adds `lora_A` [r, in] and `lora_B` [out, r].
  y = base(x) + (alpha / r) * B A dropout(x).
* Merging (`merge_lora`) folds the adapter into the base weight (one matmul per projection), only where
  that is exact enough: an fp32 or fp64 base. A bf16 / fp16 base is never merged: every entry of s B A
  under half a step of W would be rounded away, so early in training (B small) the merged model would be an
  older policy than the adapters being trained. Training needs the unmerged form (gradients reach A and B
  only through the adapter path), so a merged module refuses to run a grad-enabled training forward;
  unmerging subtracts s B A again (error ~1e-7 relative in fp32).
* A low-precision base adds the adapter's output into the base product's accumulator (`torch.addmm`):
  x W^T + s B A x is rounded once, so an adapter change smaller than half a step of the output still moves
  it as often as it moves the exact result (added to y after y is rounded, every such change would be lost).
  The trainer and the sampler run this same forward.
* QLoRA: the base weight is stored in NF4 (model/nf4.py: torchao or bitsandbytes, CUDA only). An NF4
  base is never merged (re-quantising would change it); rollout runs the adapter path instead. The model
  is loaded onto the CPU and `apply_lora(model, cfg, device)` moves it to the GPU one projection at a time,
  quantizing each before the next arrives, so the GPU never holds the unquantized projections together.
* The reference policy for KL is the base model: `adapters_disabled(model)` switches every adapter off
  for the duration of a `with` block. No second copy of the weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from ..config.training import LoRAConfig
from .hf_io import hf_name_table
from .nf4 import NF4_BACKENDS, choose_nf4_backend
from .transformer import Transformer

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ENGINE_CONFIG = "grpo_lora.json"  # the engine's own LoRA settings, kept out of PEFT's adapter_config.json
PEFT_PREFIX = "base_model.model."
MERGEABLE_DTYPES = (torch.float32, torch.float64)  # bases precise enough to fold s B A into (LoRALinear.merge)


def _init_kaiming(a: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(a, a=math.sqrt(5))  # same init nn.Linear gives its weight


def _init_gaussian(a: torch.Tensor) -> None:
    nn.init.normal_(a, std=1.0 / a.shape[0])


LORA_A_INIT: dict[str, Callable[[torch.Tensor], None]] = {
    "kaiming": _init_kaiming,
    "gaussian": _init_gaussian,
}


# ----------------------------------------------------------------------------------------------------
# The adapter module


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (see module docstring)."""

    def __init__(self, base: nn.Linear, cfg: LoRAConfig):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # [out, in], frozen (same Parameter object: no copy)
        self.bias = base.bias  # [out] or None, frozen
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = dict(dtype=getattr(torch, cfg.adapter_dtype), device=base.weight.device)
        self.lora_A = nn.Parameter(torch.empty(cfg.rank, self.in_features, **kw))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, cfg.rank, **kw))  # [out, r]
        LORA_A_INIT[cfg.init](self.lora_A.data)
        self.scaling = cfg.alpha / cfg.rank
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.adapter_enabled = True
        self.merged = False
        self._nf4_forward: Callable | None = None
        self._nf4_dequantize: Callable | None = None

    @property
    def quantized(self) -> bool:
        return self._nf4_forward is not None

    def quantize_nf4(self, backend: str) -> None:
        """Replace the base weight by its NF4 form (frees the bf16/fp32 copy unless another module holds it)."""
        q, fwd, deq = NF4_BACKENDS[backend](self.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self._nf4_forward, self._nf4_dequantize = fwd, deq

    def base_weight(self) -> torch.Tensor:
        """The (dequantized) frozen base weight [out, in]."""
        return self._nf4_dequantize(self.weight) if self.quantized else self.weight

    def delta_weight(self) -> torch.Tensor:
        """(alpha / r) B A in fp32 (fp64 adapters: fp64), [out, in]."""
        dtype = torch.promote_types(self.lora_B.dtype, torch.float32)
        return (self.lora_B.to(dtype) @ self.lora_A.to(dtype)) * self.scaling

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if self.quantized:
            y = self._nf4_forward(x, self.weight)
            return y + self.bias if self.bias is not None else y
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., in] -> [..., out]
        if self.merged and self.training and torch.is_grad_enabled():
            raise RuntimeError("LoRA weights are merged: call unmerge_lora(model) before training")
        if self.merged or not self.adapter_enabled:
            return self.base_forward(x)
        h = F.linear(self.dropout(x).to(self.lora_A.dtype), self.lora_A)  # [..., r]
        delta = (F.linear(h, self.lora_B) * self.scaling).to(x.dtype)  # [..., out]
        if self.quantized or self.weight.dtype in MERGEABLE_DTYPES:
            return self.base_forward(x) + delta
        y = torch.addmm(delta.reshape(-1, self.out_features), x.reshape(-1, self.in_features), self.weight.t())
        y = y.view(delta.shape)  # x W^T + s B A x, rounded once to the low-precision dtype
        return y + self.bias if self.bias is not None else y

    @torch.no_grad()
    def merge(self) -> bool:
        """W <- W + s B A on an fp32 / fp64 base. Returns False (and does nothing) for a bf16 / fp16 base, whose
        rounding would lose every entry of s B A under half a step of W, and for an NF4 base (re-quantising
        would change it): both run the adapter path."""
        if self.merged or self.quantized or self.weight.dtype not in MERGEABLE_DTYPES:
            return False
        self.weight.add_(self.delta_weight().to(self.weight.dtype))
        self.merged = True
        return True

    @torch.no_grad()
    def unmerge(self) -> bool:
        if not self.merged:
            return False
        self.weight.sub_(self.delta_weight().to(self.weight.dtype))
        self.merged = False
        return True

    def extra_repr(self) -> str:
        quant = ", nf4" if self.quantized else ""
        r = self.lora_A.shape[0]
        return f"in={self.in_features}, out={self.out_features}, r={r}, scaling={self.scaling:g}{quant}"


# ----------------------------------------------------------------------------------------------------
# Model-level operations


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, m in model.named_modules():
        if isinstance(m, LoRALinear):
            yield name, m


def _require_lora(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    mods = list(lora_modules(model))
    if not mods:
        raise ValueError("model has no LoRA adapters: call apply_lora(model, cfg) first")
    return mods


FUSED_TARGETS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                 "up_proj": "gate_up_proj"}  # the module that holds a projection in a fused family (Phi-3)


def family_targets(cfg: LoRAConfig, model: Transformer) -> LoRAConfig:
    """cfg with its target_modules named as `model`'s family names its modules: with fused projections, one
    adapter on qkv_proj / gate_up_proj (the module PEFT adapts in that family's checkpoints) for any of its parts."""
    fam = model.config.family
    fused = {k: v for k, v in FUSED_TARGETS.items()
             if (fam.fused_qkv and v == "qkv_proj") or (fam.fused_gate_up and v == "gate_up_proj")}
    split = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    targets = []
    for name in cfg.target_modules:
        if name in split and name not in fused.values():  # a fused name on a model whose projections are apart
            targets += split[name]
        else:
            targets.append(fused.get(name, name))
    return replace(cfg, target_modules=sorted(set(targets), key=targets.index))


def apply_lora(model: Transformer, cfg: LoRAConfig, device: str | torch.device | None = None) -> Transformer:
    """Freeze every parameter, wrap the targeted projections in LoRALinear (in place), optionally NF4.

    device: where the adapted model lives (default: where it is). A model given on another device (the CPU) is
    moved there: whole when the base stays unquantized, one projection at a time with an NF4 base
    (`_adapt_quantizing`), so that loading a QLoRA model needs about its quantized size on the GPU.
    """
    if any(True for _ in lora_modules(model)):
        raise ValueError("model already has LoRA adapters; apply_lora must be called once")
    device = model.device if device is None else torch.device(device)
    cfg = family_targets(cfg, model)
    backend = _resolve_quantization(model, cfg, device)
    for p in model.parameters():
        p.requires_grad_(False)
    if backend is not None:
        _adapt_quantizing(model, cfg, backend, device)
    else:
        if model.device != device:
            model.to(device)
        targets = set(cfg.target_modules)
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if child_name in targets and isinstance(child, nn.Linear):
                    setattr(parent, child_name, LoRALinear(child, cfg))
    model.lora_config = cfg
    return model


def _adapt_quantizing(model: Transformer, cfg: LoRAConfig, backend: str, device: torch.device) -> None:
    """Wrap and NF4-quantize the targeted projections on `device` one at a time, then move the other weights.

    The weights are taken out of the model into `staged` (where they were, the CPU when loading) and the
    model left on the meta device, holding no memory. Each projection is then copied to `device`, wrapped
    (its lora_A drawn there, in module order: the same random numbers as wrapping a model already on `device`)
    and quantized before the next is copied, and its staged copy is dropped. The device's peak is the
    quantized model plus one unquantized projection, instead of the whole unquantized model.
    """
    targets = set(cfg.target_modules)
    detached: dict[int, torch.Tensor] = {}  # tied weights (embed / lm_head): one tensor, moved once
    staged = {name: detached.setdefault(id(p), p.detach())
              for name, p in model.named_parameters(remove_duplicate=False)}
    model.to("meta")
    parents = [(name, m) for name, m in model.named_modules()  # not the Linear modules: they would stay alive
               if any(n in targets and isinstance(c, nn.Linear) for n, c in m.named_children())]
    for parent_name, parent in parents:
        for child_name in [n for n, c in parent.named_children() if n in targets and isinstance(c, nn.Linear)]:
            _place_quantized(parent, child_name, f"{parent_name}.{child_name}", staged, cfg, backend, device)
    moved: dict[int, torch.Tensor] = {}
    for t in staged.values():
        if id(t) not in moved:  # not setdefault: that would copy a tied embedding to the device twice
            moved[id(t)] = t.to(device)
    rest = {name: moved[id(t)] for name, t in staged.items()}
    model.load_state_dict(rest, strict=False, assign=True)  # the quantized projections are already set
    model.tie_weights()


def _place_quantized(parent: nn.Module, child_name: str, prefix: str, staged: dict[str, torch.Tensor],
                     cfg: LoRAConfig, backend: str, device: torch.device) -> None:
    """parent.child_name (an nn.Linear on the meta device) <- its LoRALinear on `device` with an NF4 base.
    A function of its own so that the Linear, which holds the unquantized weight, is freed when it returns."""
    linear = getattr(parent, child_name)
    linear.weight = nn.Parameter(staged.pop(f"{prefix}.weight").to(device), requires_grad=False)  # [out, in]
    if linear.bias is not None:
        linear.bias = nn.Parameter(staged.pop(f"{prefix}.bias").to(device), requires_grad=False)  # [out]
    lora = LoRALinear(linear, cfg)
    lora.quantize_nf4(backend)
    setattr(parent, child_name, lora)


def _resolve_quantization(model: Transformer, cfg: LoRAConfig, device: torch.device) -> str | None:
    """The NF4 backend to use on `device`, or None; warns (or raises when strict) when NF4 was asked for but
    can't run."""
    if cfg.quantize_base == "none":
        return None
    backend, reasons = choose_nf4_backend(cfg, device)
    if backend is not None:
        return backend
    dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    msg = f"QLoRA NF4 base unavailable ({reasons})"
    if cfg.strict:  # a config error (ValueError): the CLI prints this one line, not a traceback
        raise ValueError(f"{msg}; lora.strict=true forbids falling back. Run on CUDA with torchao or "
                           f"bitsandbytes installed, or set lora.quantize_base=none")
    warnings.warn(f"{msg}: fell back to plain LoRA on the unquantized {dtype} base weights", stacklevel=3)
    return None


def merge_lora(model: nn.Module) -> int:
    """Fold adapters into the fp32 / fp64 base weights (LoRALinear.merge). Returns how many modules were merged."""
    return sum(m.merge() for _, m in _require_lora(model))


def unmerge_lora(model: nn.Module) -> int:
    """Undo merge_lora (subtraction: error ~1e-7 relative in fp32). Returns how many modules were unmerged."""
    return sum(m.unmerge() for _, m in _require_lora(model))


@contextlib.contextmanager
def lora_merged(model: nn.Module) -> Iterator[nn.Module]:
    """`with lora_merged(model): generate(...)` — merged inside, unmerged after (also on error)."""
    merge_lora(model)
    try:
        yield model
    finally:
        unmerge_lora(model)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """The reference policy: the base model, adapters switched off inside the block."""
    mods = _require_lora(model)
    if any(m.merged for _, m in mods):
        raise RuntimeError("adapters_disabled on a merged model: call unmerge_lora(model) first")
    previous = [m.adapter_enabled for _, m in mods]
    for _, m in mods:
        m.adapter_enabled = False
    try:
        yield model
    finally:
        for (_, m), was in zip(mods, previous):
            m.adapter_enabled = was


# ----------------------------------------------------------------------------------------------------
# Export: PEFT adapter layout and merged HF state


def peft_name_table(model: Transformer) -> dict[str, str]:
    """Our adapter parameter name -> PEFT tensor name, derived from the HF name table."""
    hf = hf_name_table(model.config)
    table = {}
    for name, _ in _require_lora(model):
        base = hf[f"{name}.weight"].removesuffix(".weight")  # model.layers.{i}.self_attn.q_proj
        table[f"{name}.lora_A"] = f"{PEFT_PREFIX}{base}.lora_A.weight"
        table[f"{name}.lora_B"] = f"{PEFT_PREFIX}{base}.lora_B.weight"
    return table


def lora_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT names: lora_A.weight [r, in], lora_B.weight [out, r] (CPU, contiguous)."""
    params = dict(model.named_parameters())
    return {peft: params[ours].detach().cpu().contiguous() for ours, peft in peft_name_table(model).items()}


def peft_adapter_config(cfg: LoRAConfig, base_model_name_or_path: str | None) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }


def save_adapter(model: Transformer, out_dir: str | Path, base_model_name_or_path: str | None = None) -> Path:
    """Write adapter_config.json (only keys PEFT knows) + adapter_model.safetensors in PEFT's layout, and the
    engine's full LoRA settings (init, adapter dtype, quantization) beside them in grpo_lora.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.lora_config
    save_file(lora_state_dict(model), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = peft_adapter_config(cfg, base_model_name_or_path)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    (out / ENGINE_CONFIG).write_text(json.dumps(asdict(cfg), indent=2))
    return out


def load_adapter(model: Transformer, adapter_dir: str | Path) -> None:
    """Load adapter weights written by save_adapter (or PEFT) into a model that has apply_lora'd adapters."""
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {adapter_dir} a LoRA adapter directory?")
    tensors = load_file(str(path))
    table = peft_name_table(model)
    missing = sorted(set(table.values()) - set(tensors))
    unexpected = sorted(set(tensors) - set(table.values()))
    if missing or unexpected:
        raise ValueError(f"{path}: missing {missing[:4]} unexpected {unexpected[:4]} "
                         f"(do target_modules / num layers match the model?)")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for ours, peft in table.items():
            if tensors[peft].shape != params[ours].shape:
                raise ValueError(f"{path}: {peft} has shape {tuple(tensors[peft].shape)}, "
                                 f"model expects {tuple(params[ours].shape)} (rank mismatch?)")
            params[ours].copy_(tensors[peft])


@torch.no_grad()
def merged_model_state(model: Transformer, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF-named state of base + merged adapters, without modifying the model (pass to save_model).

    NF4 bases are dequantized. dtype defaults to the embedding's dtype (the model's working dtype).
    """
    dtype = dtype or model.embed.weight.dtype
    lora_by_weight = {f"{name}.weight": m for name, m in lora_modules(model)}
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {}
    for ours, theirs in hf_name_table(model.config).items():
        m = lora_by_weight.get(ours)
        if m is None:
            t = params[ours]
        elif m.merged:
            t = m.weight
        else:
            t = m.base_weight().float() + m.delta_weight()
        state[theirs] = t.detach().to("cpu", dtype).contiguous()
    return state
