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


# What Resolved says is what runs: one test per setting left to the engine, through `grpo train`'s set-up ----------
TINY = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs" / "tiny_arithmetic.yaml")


def _set_up(tiny_ckpt, tmp_path, *overrides):
    """setup_run of the tiny config on the CPU (the lock released at once: nothing else runs)."""
    from grpo_engine.train.setup import setup_run

    run = setup_run(load_config(TINY, [f"model.path={tiny_ckpt}", f"run_dir={tmp_path / 'run'}", "model.device=auto",
                                       "logging.progress=false", *overrides]))
    if run.lock is not None:
        run.lock.release()
    return run


def test_the_device_resolved_is_the_policys(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = _set_up(tiny_ckpt, tmp_path)
    assert run.resolved.device == CPU == run.inputs.policy.device


@pytest.mark.parametrize("fast_bf16", [False, True])
def test_the_precision_resolved_is_the_weights(tiny_ckpt, tmp_path, monkeypatch, fast_bf16):
    """memory.precision=auto on a CPU: fp32 for the tiny model; bf16 where this CPU's bf16 pays (here: made to)."""
    import grpo_engine.kernels.cpu as cpu
    import grpo_engine.kernels.select as select
    from grpo_engine.plan import precision

    monkeypatch.setattr(cpu, "native_bf16_isa", lambda: "amx_bf16")
    monkeypatch.setattr(select, "bf16_ratio", lambda hidden, intermediate: 0.5 if fast_bf16 else 1.5)
    monkeypatch.setattr(precision, "CPU_BF16_MIN_WEIGHT", 1)
    run = _set_up(tiny_ckpt, tmp_path, "memory.precision=auto", "lora.enabled=true")
    want = "bf16" if fast_bf16 else "fp32"
    assert run.resolved.precision == run.cfg.memory.precision == want
    dtypes = {p.dtype for n, p in run.inputs.policy.model.named_parameters() if "lora_" not in n}
    assert dtypes == {torch.bfloat16 if fast_bf16 else torch.float32}


def test_the_micro_batch_and_chunk_resolved_are_the_steps(tiny_ckpt, tmp_path):
    run = _set_up(tiny_ckpt, tmp_path, "memory.micro_batch_tokens=0", "memory.logprob_chunk_size=0")
    m = run.resolved.config.memory
    assert (m.micro_batch_tokens, m.logprob_chunk_size) == (1024, 256)  # the CPU defaults
    assert run.state.micro_tokens == m.micro_batch_tokens  # the budget grpo_step splits the batch by
    assert run.inputs.cfg.memory.logprob_chunk_size == m.logprob_chunk_size  # attach_logprobs' chunk


@pytest.mark.parametrize("tokens, blocks", [(1024, "none"), (400_000, "all")])
def test_activation_checkpointing_resolved_is_the_models(tiny_ckpt, tmp_path, tokens, blocks):
    """auto on a CPU is decided in Resolved by the planner's rule (plan/memory.py resolve_checkpointing): the tiny
    model's 1,024-token activations are far under its floor (none); 400k tokens are over it (all)."""
    from grpo_engine.kernels import checkpointed_blocks

    run = _set_up(tiny_ckpt, tmp_path, "memory.activation_checkpointing=auto", f"memory.micro_batch_tokens={tokens}")
    assert run.resolved.config.memory.activation_checkpointing == blocks
    n = len(run.inputs.policy.model.layers)
    assert checkpointed_blocks(run.inputs.policy.model) == (list(range(n)) if blocks == "all" else [])


def test_one_config_reaches_the_step(tiny_ckpt, tmp_path):
    from grpo_engine.collect.signal_check import LengthFit, RolloutFit
    from grpo_engine.train.setup import run_with_rollout

    run = _set_up(tiny_ckpt, tmp_path)
    assert run.cfg is run.resolved.config is run.inputs.cfg
    fitted = run_with_rollout(run, RolloutFit(LengthFit(run.cfg.rollout.max_new_tokens * 2, [], fitted=True)))
    assert fitted.cfg is fitted.resolved.config is fitted.inputs.cfg
    doubled = 2 * run.cfg.rollout.max_new_tokens
    assert fitted.cfg.rollout.max_new_tokens == doubled == fitted.inputs.params.max_new_tokens


def test_cuda_graphs_resolved_is_the_rollouts_loop(tiny_ckpt, tmp_path, monkeypatch):
    """rollout.cuda_graphs=auto on a CPU: Resolved says off, and the sampler's params and loop are eager."""
    from grpo_engine.rollout.generate import choose_loop

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run = _set_up(tiny_ckpt, tmp_path, "rollout.cuda_graphs=auto")
    assert run.resolved.config.rollout.cuda_graphs == "off" == run.inputs.params.cuda_graphs
    assert choose_loop(run.inputs.policy.model, run.inputs.params) == "static"


@pytest.mark.parametrize("overrides, want", [
    (["rollout.cuda_graphs=auto"], "auto"),  # captured, with auto's eager fallback after a failed check
    (["rollout.cuda_graphs=on"], "on"),
    (["rollout.cuda_graphs=off"], "off"),
    (["rollout.cuda_graphs=auto", "distributed.strategy=fsdp2"], "off"),  # FSDP2 units decode eagerly
])
def test_cuda_graphs_on_a_card(overrides, want):
    """On a CUDA device (only its type is read) Resolved keeps what captures and turns off what cannot."""
    from grpo_engine.plan.resolved import decode_graphs

    assert decode_graphs(load_config(None, overrides), torch.device("cuda")) == want


@pytest.mark.parametrize("setting, rule", [("auto", "heap"), ("trim", "trim"), ("true", "mmap")])
def test_update_mmap_resolved_is_the_updates_rule(tiny_ckpt, tmp_path, setting, rule):
    """memory.cpu_update_mmap=auto is "false" in Resolved; the update's allocation rule reads the resolved value."""
    from grpo_engine.train.memory import update_allocations_rule

    run = _set_up(tiny_ckpt, tmp_path, f"memory.cpu_update_mmap={setting}")
    written = run.resolved.config.memory.cpu_update_mmap
    assert written == {"auto": "false"}.get(setting, setting)
    assert update_allocations_rule(run.inputs.cfg.memory.cpu_update_mmap, run.inputs.policy.device) == rule


def test_quant_backend_resolved_is_the_models(monkeypatch):
    """lora.quant_backend=auto for an NF4 base: Resolved names the backend that can run (here: bitsandbytes
    alone), and the model's loading quantizes with that one; on a CPU none can, and auto stays for its warning."""
    from grpo_engine.model import lora, nf4

    cfg = load_config(None, ["lora.enabled=true", "lora.quantize_base=nf4"])
    assert resolve_settings(cfg, CPU).config.lora.quant_backend == "auto"
    monkeypatch.setattr(nf4, "nf4_unavailable_reason", lambda b, d: None if b == "bitsandbytes" else "absent")
    resolved = resolve_settings(cfg, CPU)
    assert resolved.config.lora.quant_backend == "bitsandbytes"
    assert lora._resolve_quantization(None, resolved.config.lora, CPU) == "bitsandbytes"
