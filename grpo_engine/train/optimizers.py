"""Optimizer construction from the config's optimizer section (name -> builder)."""

from __future__ import annotations

import torch


def _adamw(params, o):
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                             foreach=False)


OPTIMIZERS = {"adamw": _adamw}


def make_optimizer(model: torch.nn.Module, o) -> torch.optim.Optimizer:
    if o.name not in OPTIMIZERS:
        raise ValueError(f"optimizer.name={o.name!r} is not one of {', '.join(OPTIMIZERS)}")
    params = [p for p in model.parameters() if p.requires_grad]
    return OPTIMIZERS[o.name](params, o)
