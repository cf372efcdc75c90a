"""Settings resolved once, before the policy's weights load (plan/resolved.py), and never written back."""

import dataclasses

import pytest
import torch

from grpo_engine.config import load_config
from grpo_engine.plan.resolved import resolve_settings

CPU = torch.device("cpu")


def test_the_cpu_defaults_and_precision_are_decided_into_a_copy():
    cfg = load_config(None, ["memory.micro_batch_tokens=0", "memory.logprob_chunk_size=0"])
    resolved = resolve_settings(cfg, CPU)
    m = resolved.config.memory
    assert (m.micro_batch_tokens, m.logprob_chunk_size) == (1024, 256)  # plan/device_defaults.py's CPU values
    assert (resolved.device, resolved.precision, resolved.card_gib) == (CPU, "fp32", None)  # auto on a CPU: fp32
    assert (cfg.memory.micro_batch_tokens, cfg.memory.logprob_chunk_size) == (0, 0)  # the user's config as written
    assert resolved.config.memory.precision == "fp32" == resolved.precision  # written in: later stages read it
    assert cfg.memory.precision == "auto"  # the user's config as written
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.precision = "bf16"


def test_values_the_user_wrote_are_kept():
    m = resolve_settings(load_config(None, ["memory.micro_batch_tokens=300", "memory.logprob_chunk_size=64",
                                            "memory.precision=bf16"]), CPU)
    assert (m.config.memory.micro_batch_tokens, m.config.memory.logprob_chunk_size, m.precision) == (300, 64, "bf16")


@pytest.mark.parametrize("overrides,path", [
    ([], "/models/x"),
    (["warm_start.tiny.arch=qwen2"], "r/base"),
    (["warm_start.tiny.arch=qwen2", "warm_start.sft.steps=2"], "r/sft"),
    (["warm_start.sft.steps=2"], "r/sft"),
])
def test_the_warm_starts_output_is_fixed_up_front(overrides, path):
    """model.path is the model GRPO starts from before the warm start runs (sft/warm_start.py writes it there)."""
    cfg = load_config(None, ["model.path=/models/x", "run_dir=r", *overrides])
    assert resolve_settings(cfg, CPU).config.model.path == path and cfg.model.path == "/models/x"


def test_the_resumed_micro_batch_needs_no_policy_first():
    """resumed_micro_tokens reads the resolved memory settings: no order between it and build_policy."""
    from grpo_engine.train.setup import resumed_micro_tokens

    resolved = resolve_settings(load_config(None, ["memory.micro_batch_tokens=0"]), CPU)
    assert resumed_micro_tokens(None, resolved.config) == 1024


def test_the_warm_start_writes_where_resolve_said(tmp_path):
    """The path fixed up front is the one sft/warm_start.py returns (a tiny random base: run_dir/base)."""
    from grpo_engine.sft.warm_start import warm_start

    cfg = load_config(None, [f"run_dir={tmp_path}", "warm_start.tiny.arch=qwen2", "warm_start.tiny.hidden_size=32",
                             "warm_start.tiny.intermediate_size=64", "warm_start.tiny.num_hidden_layers=1"])
    assert str(warm_start(cfg, None)) == resolve_settings(cfg, CPU).config.model.path == str(tmp_path / "base")
