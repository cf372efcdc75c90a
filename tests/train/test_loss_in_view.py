"""The loss in view: from `grpo_step` to the frame that back-propagates the GRPO objective is at most 6 frames.

One `grpo train` step of a tiny model is run with torch's back-propagation entry points (Tensor.backward,
torch.autograd.backward, torch.autograd.grad) wrapped: each call records the Python stack, and the test counts the
frames from `grpo_step` (0) down to the frame that made the call. Both update paths are covered: the fused LM head
(GRPO, a per-token loss) and autograd through the chunked head (GSPO, a sequence-level ratio). The frame that
back-propagates must be `grpo_loss` itself, whose source then shows the objective and its gradient.
"""

import inspect
import json
from pathlib import Path

import pytest
import torch
import yaml

import grpo_engine.train.update as update_module
from grpo_engine.cli import main
from grpo_engine.rl.losses import LossConfig, is_tokenwise, resolve

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MAX_FRAMES = 6
TORCH_DIR = str(Path(torch.__file__).parent)


def _config(tmp_path, monkeypatch) -> str:
    """tiny_arithmetic.yaml with a reward that varies between random completions (non-zero advantages), one step,
    no checkpoint, evaluation or signal check."""
    monkeypatch.syspath_prepend(str(HERE))  # reward_fns
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(8)))
    cfg = yaml.safe_load((REPO / "configs/tiny_arithmetic.yaml").read_text())
    cfg["task"] = {"name": "custom", "options": {"data_path": str(data), "reward_fn": "reward_fns:even_bytes",
                                                 "system_prompt": None, "prefill": ""}}
    cfg["schedule"]["steps"], cfg["checkpoint"]["every"] = 1, 0
    cfg["logging"]["samples_every"], cfg["check"] = 0, {"enabled": False}
    path = tmp_path / "one_step.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _caller_depth(stack: list[inspect.FrameInfo]) -> tuple[int, str]:
    """(frames from grpo_step down to the first frame outside torch and this test, that frame's function name)."""
    names = [f.function for f in stack]
    top = names.index("grpo_step")  # stack[0] is the innermost frame
    caller = next(i for i, f in enumerate(stack) if not f.filename.startswith(TORCH_DIR) and f.filename != __file__)
    return top - caller, names[caller]


@pytest.fixture
def backprop_calls(monkeypatch):
    """Every back-propagation call during a run: (depth below grpo_step, calling function)."""
    calls = []

    def recording(real):
        def wrapper(*args, **kwargs):
            stack = inspect.stack(context=0)
            if any(f.function == "grpo_step" for f in stack):
                calls.append(_caller_depth(stack[1:]))
            return real(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(torch.Tensor, "backward", recording(torch.Tensor.backward))
    monkeypatch.setattr(torch.autograd, "backward", recording(torch.autograd.backward))
    monkeypatch.setattr(torch.autograd, "grad", recording(torch.autograd.grad))
    return calls


@pytest.fixture
def loss_calls(monkeypatch):
    """Every call of the objective (rl.losses.policy_loss, as train/update.py names it): the calling function."""
    calls, real = [], update_module.policy_loss

    def wrapper(*args, **kwargs):
        calls.append(inspect.stack(context=0)[1].function)
        return real(*args, **kwargs)

    monkeypatch.setattr(update_module, "policy_loss", wrapper)
    return calls


@pytest.mark.parametrize("loss", ["grpo", "gspo"])
def test_the_loss_is_back_propagated_within_six_frames_of_grpo_step(tmp_path, monkeypatch, tiny_ckpt, loss,
                                                                     backprop_calls, loss_calls):
    assert is_tokenwise(resolve(LossConfig(loss=loss))) == (loss == "grpo")  # grpo: the fused head; gspo: autograd
    heads, real_head = [], update_module.FusedHead
    monkeypatch.setattr(update_module, "FusedHead", lambda *a, **k: heads.append(real_head(*a, **k)) or heads[-1])
    cfg = _config(tmp_path, monkeypatch)
    assert main(["train", cfg, f"model.path={tiny_ckpt}", f"run_dir={tmp_path / 'run'}",
                 f"algorithm.loss={loss}"]) == 0
    assert backprop_calls, "the step back-propagated nothing: the test proves nothing"
    assert bool(heads) == (loss == "grpo")  # the path this case is about was taken
    assert set(loss_calls) == {"grpo_loss"}  # the objective is called from grpo_loss only
    for depth, function in backprop_calls:
        assert function == "grpo_loss", f"back-propagated from {function}, not from grpo_loss"
        assert depth <= MAX_FRAMES, f"the loss is back-propagated {depth} frames below grpo_step"
