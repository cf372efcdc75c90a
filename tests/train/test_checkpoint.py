"""Atomic checkpoint write, retention, RNG capture, resume resolution."""

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_engine.checkpoint.run_dir import list_checkpoints
from grpo_engine.checkpoint.state_io import StateFormatError
from grpo_engine.checkpoint.store import (
    TrainerState,
    capture_rng,
    load_trainer_state,
    resolve_resume,
    restore_rng,
    save_checkpoint,
)
from grpo_engine.model.loading import load_model


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
    latest = list_checkpoints(root)[-1]
    assert latest.name == "step-000003" and resolve_resume("latest", root) == latest
    assert load_trainer_state(latest).data_position == 9
    hf = AutoModelForCausalLM.from_pretrained(latest / "model")
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


def test_incomplete_dirs_are_not_checkpoints(tmp_path):
    from grpo_engine.checkpoint.verify import CorruptCheckpointError

    root = tmp_path / "c"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume("latest", root)
    (root / "step-000005").mkdir(parents=True)  # no trainer_state.json
    assert list_checkpoints(root) == []
    # the newest step folder is damaged, not skipped (issue 41): refused, naming what is missing
    with pytest.raises(CorruptCheckpointError, match="trainer_state.json and model/config.json are missing"):
        resolve_resume("latest", root)
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        resolve_resume(str(root / "step-000005"), root)


def test_rng_round_trip():
    state = capture_rng()
    a = (random.random(), np.random.rand(), torch.rand(3))
    restore_rng(state)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_a_copy_of_a_checkpoint_is_not_listed(tmp_path, tiny_ckpt):
    """A user's backup `step-000002 copy` (or `step-000002.bak`) made every --resume fail with "invalid literal
    for int()": only step-<digits> folders are checkpoints."""
    model = load_model(tiny_ckpt)
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        save_checkpoint(root, model, _state(step, model), config_yaml="seed: 0\n", metrics_path=None,
                        tokenizer_dir=tiny_ckpt, keep_last=5)
    for name in ("step-000002 copy", "step-000002.bak", "step-"):
        shutil.copytree(root / "step-000002", root / name)
    assert [p.name for p in list_checkpoints(root)] == ["step-000001", "step-000002"]
    save_checkpoint(root, model, _state(3, model), config_yaml="seed: 0\n", metrics_path=None,
                    tokenizer_dir=tiny_ckpt, keep_last=1)  # pruning leaves the copies alone
    assert sorted(p.name for p in root.iterdir()) == ["step-", "step-000002 copy", "step-000002.bak", "step-000003"]


@pytest.mark.parametrize("structure", [[1, 2], {"step": 1}, "FIELDS+bogus"])
def test_a_trainer_state_of_another_shape_is_a_named_error(tmp_path, tiny_ckpt, structure):
    """Fields another version wrote (or a damaged structure) were a TypeError traceback."""
    model = load_model(tiny_ckpt)
    ckpt = save_checkpoint(tmp_path, model, _state(1, model), config_yaml="", metrics_path=None,
                           tokenizer_dir=tiny_ckpt, keep_last=1)
    path = ckpt / "trainer_state.json"
    tree = json.loads(path.read_text())
    path.write_text(json.dumps({**tree, "bogus": 1} if structure == "FIELDS+bogus" else structure))
    with pytest.raises(StateFormatError, match=r"trainer_state.json: not a grpo-engine trainer state.*earlier"):
        load_trainer_state(ckpt)


def test_resuming_another_runs_checkpoint_into_a_run_is_refused(tmp_path, tiny_ckpt):
    """`--resume A/checkpoints/step-N` with run_dir=B holding its own run mixed both runs in B's metrics.jsonl and
    pruning deleted B's checkpoints; into a new run_dir, or from B's own (or superseded) checkpoints, it resumes."""
    from grpo_engine.config import ConfigError

    model = load_model(tiny_ckpt)
    a, b, fresh = tmp_path / "a", tmp_path / "b b", tmp_path / "new"
    ckpt_a = save_checkpoint(a / "checkpoints", model, _state(4, model), config_yaml="", metrics_path=None,
                             tokenizer_dir=tiny_ckpt, keep_last=1)
    ckpt_b = save_checkpoint(b / "checkpoints", model, _state(2, model), config_yaml="", metrics_path=None,
                             tokenizer_dir=tiny_ckpt, keep_last=1)
    with pytest.raises(ConfigError, match=r"not in run_dir=.*b b.*holds a run of its own; .*choose a new run_dir"):
        resolve_resume(str(ckpt_a), b / "checkpoints")
    assert resolve_resume(str(ckpt_a), fresh / "checkpoints") == ckpt_a
    assert resolve_resume(str(ckpt_b), b / "checkpoints") == ckpt_b
    aside = shutil.copytree(ckpt_b, b / "superseded-1" / "checkpoints" / ckpt_b.name)
    assert resolve_resume(str(aside), b / "checkpoints") == aside


def test_a_kill_while_pruning_leaves_no_half_deleted_checkpoint(tmp_path, tiny_ckpt, monkeypatch):
    """Pruning deleted step-000001 in place: killed after model/ went, the folder still had trainer_state.json
    and was listed as a complete checkpoint (resume / eval then failed on its missing weights)."""
    import grpo_engine.checkpoint.store as ckpt_mod

    model = load_model(tiny_ckpt)
    root = tmp_path / "checkpoints"
    save_checkpoint(root, model, _state(1, model), config_yaml="", metrics_path=None, tokenizer_dir=tiny_ckpt,
                    keep_last=1)
    real = ckpt_mod.shutil.rmtree

    def killed_midway(path, ignore_errors=False):
        if (Path(path) / "model").is_dir():
            real(Path(path) / "model")
            raise KeyboardInterrupt  # the process dies here
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, model, _state(2, model), config_yaml="", metrics_path=None, tokenizer_dir=tiny_ckpt,
                        keep_last=1)
    monkeypatch.setattr(ckpt_mod.shutil, "rmtree", real)
    assert [p.name for p in list_checkpoints(root)] == ["step-000002"]
    save_checkpoint(root, model, _state(3, model), config_yaml="", metrics_path=None, tokenizer_dir=tiny_ckpt,
                    keep_last=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-000003"]


def test_a_warm_start_folder_it_did_not_write_is_moved_aside(tmp_path, capsys):
    """run_dir/base (or sft/) without the stage's marker is not the warm start's own: it was deleted when the
    stage was published (a user's own model in RUN_DIR/sft was lost)."""
    from grpo_engine.config import load_config
    from grpo_engine.sft.warm_start import DONE_MARKER, build_tiny_base

    run_dir = tmp_path / "r"
    (run_dir / "base").mkdir(parents=True)
    (run_dir / "base" / "notes.txt").write_text("mine")
    cfg = load_config(None, [f"run_dir={run_dir}", "warm_start.tiny.arch=qwen2"])
    assert build_tiny_base(cfg) == run_dir / "base" and (run_dir / "base" / DONE_MARKER).is_file()
    (aside,) = run_dir.glob("base.prev-*")
    assert (aside / "notes.txt").read_text() == "mine" and "nothing deleted" in capsys.readouterr().err


def test_a_halved_micro_batch_budget_is_kept_across_a_resume(tmp_path, tiny_ckpt):
    """The budget halved after a CUDA out-of-memory is stored with the checkpoint and resumed (the run would run out
    of memory and halve again), never above the config's; checkpoints without it resume with the config's."""
    from grpo_engine.config import load_config
    from grpo_engine.train.setup import resumed_micro_tokens

    model = load_model(tiny_ckpt)
    state = _state(1, model)
    state.micro_tokens = 512
    saved = save_checkpoint(tmp_path / "c", model, state, config_yaml="seed: 0\n", metrics_path=None,
                            tokenizer_dir=tiny_ckpt, keep_last=1)
    cfg = load_config(None, ["memory.micro_batch_tokens=2048"])
    assert resumed_micro_tokens(load_trainer_state(saved), cfg) == 512
    assert resumed_micro_tokens(load_trainer_state(saved), load_config(None, ["memory.micro_batch_tokens=256"])) == 256
    assert resumed_micro_tokens(_state(1, model), cfg) == 2048  # not recorded (older checkpoints)
    assert resumed_micro_tokens(None, cfg) == 2048
