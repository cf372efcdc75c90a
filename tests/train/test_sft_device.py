"""The supervised warm start runs on model.device, resolved as for GRPO (auto: cuda when available); it once
loaded its model on the CPU whatever the config said."""

from pathlib import Path

import pytest
import torch

from grpo_engine.config import load_config
from grpo_engine.sft import warm_start

REPO = Path(__file__).resolve().parents[2]


class Loaded(Exception):
    """Stops run_sft once its model would be loaded (no GPU here to load it on)."""


@pytest.mark.parametrize("device, expected", [("auto", torch.device("cuda", 0)), ("cpu", torch.device("cpu"))])
def test_the_warm_start_loads_its_model_on_the_configured_device(tiny_ckpt, tmp_path, monkeypatch, device, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a machine with one GPU
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    seen = []

    def load_model(path, dtype=torch.float32, device="cpu"):
        seen.append((Path(path), torch.device(device)))
        raise Loaded

    monkeypatch.setattr(warm_start, "load_model", load_model)
    cfg = load_config(str(REPO / "configs/tiny_arithmetic.yaml"),
                      [f"model.path={tiny_ckpt}", f"run_dir={tmp_path}", f"model.device={device}",
                       "warm_start.sft.steps=1"])
    with pytest.raises(Loaded):
        warm_start.run_sft(cfg, Path(tiny_ckpt), task=None)
    assert seen == [(Path(tiny_ckpt), expected)]
