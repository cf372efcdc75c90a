"""Atomic checkpoint write, retention, RNG capture, resume resolution."""

import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_engine.model.hf_io import load_model
from grpo_engine.train.checkpoint import (
    TrainerState,
    capture_rng,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    resolve_resume,
    restore_rng,
    save_checkpoint,
)


def _state(step, model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return TrainerState(step=step, data_position=step * 3, optimizer=opt.state_dict(), scheduler={}, rng=capture_rng())


def test_save_keep_last_and_load(tmp_path, tiny_ckpt):
    model = load_model(tiny_ckpt)
    root = tmp_path / "checkpoints"
    (root / ".tmp-step-000009").mkdir(parents=True)  # leftover of a crashed save
    for step in (1, 2, 3):
        save_checkpoint(root, model, _state(step, model), config_yaml="seed: 0\n", metrics_path=None,
                        tokenizer_dir=tiny_ckpt, keep_last=2)
    assert [p.name for p in list_checkpoints(root)] == ["step-000002", "step-000003"]
    assert not list(root.glob(".tmp-*"))
    latest = latest_checkpoint(root)
    assert latest.name == "step-000003" and resolve_resume("latest", root) == latest
    assert load_trainer_state(latest).data_position == 9
    hf = AutoModelForCausalLM.from_pretrained(latest / "model")
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


def test_incomplete_dirs_are_not_checkpoints(tmp_path):
    root = tmp_path / "c"
    (root / "step-000005").mkdir(parents=True)  # no trainer_state.pt
    assert latest_checkpoint(root) is None
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume("latest", root)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(root / "step-000005"), root)


def test_rng_round_trip():
    state = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])
