"""End-to-end: `grpo train` on a tiny model; artifacts; exact resume (bitwise metrics on CPU)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_engine.cli import main
from grpo_engine.config import load_config
from grpo_engine.model.hf_io import load_model
from grpo_engine.train.loop import train

REPO = Path(__file__).resolve().parents[2]
CFG = str(REPO / "configs/tiny_arithmetic.yaml")
VOLATILE = ("time_", "tokens_per_s", "peak_mem")


def _metrics(run_dir):
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_train_arithmetic_artifacts(tmp_path, tiny_ckpt):
    run = tmp_path / "run"
    assert main(["train", CFG, f"model.path={tiny_ckpt}", f"run_dir={run}"]) == 0
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward_mean", "reward_std", "reward_components", "accuracy", "completion_len_mean",
                "truncation_rate", "zero_variance_frac", "entropy", "grad_norm", "lr", "gen_tokens_per_s",
                "time_generate_s", "peak_mem_mib"):
        assert key in rows[0], key
    assert set(rows[0]["reward_components"]) == {"answer", "format"}
    assert rows[0]["completion_len_max"] <= 8 and rows[0]["lr"] == 1e-3
    assert len((run / "samples.jsonl").read_text().splitlines()) >= 3
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step-000002", "step-000003"]  # keep_last=2
    final = run / "checkpoints/step-000003/model"
    hf = AutoModelForCausalLM.from_pretrained(final)
    ours = load_model(final)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_exact_resume_bitwise(tmp_path, tiny_ckpt):
    over = [f"model.path={tiny_ckpt}", "schedule.steps=4", "rollout.max_new_tokens=6", "algorithm.mu=2"]
    full = load_config(CFG, over + [f"run_dir={tmp_path / 'a'}"])
    train(full)
    split = load_config(CFG, over + [f"run_dir={tmp_path / 'b'}"])
    assert train(split, stop_after=2).stopped_by == "stop_after"
    train(split, resume="latest")
    strip = lambda rows: [{k: v for k, v in r.items() if not any(v in k for v in VOLATILE)} for r in rows]  # noqa: E731
    a, b = strip(_metrics(tmp_path / "a")), strip(_metrics(tmp_path / "b"))
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b
    wa = load_model(tmp_path / "a/checkpoints/step-000004/model").state_dict()
    wb = load_model(tmp_path / "b/checkpoints/step-000004/model").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
