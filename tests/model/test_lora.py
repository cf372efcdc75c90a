"""LoRA: identity at init, merge/unmerge inverses, reference = base, grads, PEFT export, QLoRA fallback."""

import json
import warnings

import pytest
import torch

from grpo_engine.config.training import LORA_TARGETS
from grpo_engine.model.hf_io import hf_name_table
from grpo_engine.model.loading import load_model, save_model
from grpo_engine.model.lora import (
    LoRAConfig,
    adapters_disabled,
    apply_lora,
    load_adapter,
    lora_merged,
    lora_state_dict,
    merge_lora,
    merged_model_state,
    save_adapter,
    unmerge_lora,
)
from grpo_engine.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="qwen2", seed=0)


def ids(B=2, T=7, seed=1):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def randomize_b(model, seed=3, std=0.05):
    """LoRA B starts at zero; give it values so the adapter actually changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("lora_B"):  # [out, r]
                p.copy_(std * torch.randn(p.shape, generator=g))


def test_b_zero_init_equals_base(ckpt):
    base = load_model(ckpt)
    x = ids()
    want = base(x)
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4, alpha=8))
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_targets_wrapped_and_only_adapters_trainable(ckpt):
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4, target_modules=["q_proj", "down_proj"]))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    want = sorted(f"layers.{i}.{m}.lora_{ab}" for i in range(2) for m in ("attn.q_proj", "mlp.down_proj")
                  for ab in "AB")
    assert trainable == want
    assert model.layers[0].attn.q_proj.lora_A.shape == (4, 64)
    assert model.layers[0].mlp.down_proj.lora_B.shape == (64, 4)


def test_gradients_reach_only_a_and_b(ckpt):
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4)).train()
    randomize_b(model)
    model(ids()).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        if "lora_" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_adapter_output_matches_explicit_formula(ckpt):
    """y = x W^T + b + (alpha/r) x A^T B^T, computed by hand in float64 for one projection."""
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4, alpha=2.0))
    randomize_b(model)
    m = model.layers[1].attn.k_proj
    x = torch.randn(3, 64, dtype=torch.float64)
    W, b, A, B = (t.detach().double() for t in (m.weight, m.bias, m.lora_A, m.lora_B))
    want = x @ W.T + b + 0.5 * (x @ A.T @ B.T)
    torch.testing.assert_close(m(x.float()).double(), want, rtol=1e-5, atol=1e-6)


def test_merged_equals_unmerged_and_unmerge_restores(ckpt):
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4)).eval()
    randomize_b(model)
    x = ids()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    unmerged = model(x)
    assert merge_lora(model) == 2 * len(LORA_TARGETS)
    torch.testing.assert_close(model(x), unmerged, rtol=1e-5, atol=1e-5)
    w = model.layers[0].attn.q_proj
    assert (w.weight - before["layers.0.attn.q_proj.weight"]).abs().max() > 1e-4  # really merged
    assert unmerge_lora(model) == 2 * len(LORA_TARGETS)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p, before[n], rtol=0, atol=1e-6)
    torch.testing.assert_close(model(x), unmerged, rtol=0, atol=1e-6)


def test_a_float64_merge_keeps_float64_precision(ckpt):
    """(bf16 / fp16 bases are never merged: tests/train/test_lora_rollout.py.)"""
    model = apply_lora(load_model(ckpt, dtype=torch.float64), LoRAConfig(rank=4, adapter_dtype="float64")).eval()
    randomize_b(model)
    x = ids()
    with torch.no_grad():
        unmerged = model(x)
        with lora_merged(model):
            assert model.layers[0].mlp.up_proj.merged
            torch.testing.assert_close(model(x), unmerged, rtol=0, atol=1e-12)


def test_merged_training_forward_is_refused(ckpt):
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4)).train()
    merge_lora(model)
    with pytest.raises(RuntimeError, match="unmerge_lora"):
        model(ids())
    with torch.no_grad():
        model(ids())  # rollout-style use is fine


def test_adapters_disabled_equals_base(ckpt):
    x = ids()
    base_logits = load_model(ckpt)(x)
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4))
    randomize_b(model)
    adapted = model(x)
    assert (adapted - base_logits).abs().max() > 1e-3
    with adapters_disabled(model):
        torch.testing.assert_close(model(x), base_logits, rtol=0, atol=0)
    torch.testing.assert_close(model(x), adapted, rtol=0, atol=0)


def test_adapters_disabled_refuses_merged(ckpt):
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4))
    merge_lora(model)
    with pytest.raises(RuntimeError, match="unmerge"), adapters_disabled(model):
        pass


def test_peft_export_names_shapes_and_roundtrip(ckpt, tmp_path):
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"])
    model = apply_lora(load_model(ckpt), cfg)
    randomize_b(model)
    out = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(ckpt))
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["target_modules"] == ["gate_proj", "q_proj", "v_proj"]
    state = lora_state_dict(model)
    hf = hf_name_table(model.config)
    want = {}
    for i in range(2):
        for ours, out_dim in (("attn.q_proj", 64), ("attn.v_proj", 32), ("mlp.gate_proj", 128)):
            stem = hf[f"layers.{i}.{ours}.weight"].removesuffix(".weight")
            want[f"base_model.model.{stem}.lora_A.weight"] = (4, 64)
            want[f"base_model.model.{stem}.lora_B.weight"] = (out_dim, 4)
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in state
    fresh = apply_lora(load_model(ckpt), cfg)
    load_adapter(fresh, out)
    x = ids()
    torch.testing.assert_close(fresh(x), model(x), rtol=0, atol=0)


def test_peft_export_loads_in_peft_if_installed(ckpt, tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4))
    randomize_b(model)
    out = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(ckpt))
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, out)
    x = ids()
    torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-4, atol=1e-4)


def test_merged_model_state_saves_a_checkpoint_equal_to_the_adapted_model(ckpt, tmp_path):
    model = apply_lora(load_model(ckpt), LoRAConfig(rank=4))
    randomize_b(model)
    x = ids()
    want = model(x)
    save_model(model, tmp_path / "merged", state_dict=merged_model_state(model))
    assert not model.layers[0].attn.q_proj.merged  # the model itself is untouched
    torch.testing.assert_close(load_model(tmp_path / "merged")(x), want, rtol=1e-5, atol=1e-5)


def test_nf4_on_cpu_falls_back_with_warning(ckpt):
    x = ids()
    want = load_model(ckpt)(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = apply_lora(load_model(ckpt), LoRAConfig(rank=4, quantize_base="nf4"))
    msgs = [str(w.message) for w in caught]
    assert any("fell back to plain LoRA" in m and "float32" in m and "CUDA" in m for m in msgs), msgs
    assert not model.layers[0].attn.q_proj.quantized
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)


def test_nf4_strict_fails_clearly(ckpt):
    """A config error (ValueError), which the CLI prints as one line: it was a RuntimeError traceback."""
    with pytest.raises(ValueError, match="lora.strict=true forbids falling back"):
        apply_lora(load_model(ckpt), LoRAConfig(rank=4, quantize_base="nf4", strict=True))


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="target_modules"):
        LoRAConfig(target_modules=["qkv"])
    with pytest.raises(ValueError, match="rank"):
        LoRAConfig(rank=0)


def test_nf4_scale_groups_divide_every_weight_s_block_count():
    """torchao needs the group of double-quantized scales to divide the weight's 64-value block count: QLoRA's 256
    for real shapes, the largest power of two that divides it otherwise; a partial block is a clear error."""
    from grpo_engine.model.nf4 import nf4_scaler_block

    assert nf4_scaler_block(1536 * 8960) == 256  # 215,040 blocks
    assert nf4_scaler_block(64 * 64) == 64  # a tiny model's projection: 64 blocks
    assert nf4_scaler_block(64 * 96) == 32  # 96 blocks
    assert nf4_scaler_block(64 * 3) == 1
    with pytest.raises(ValueError, match="quantize_base=none"):
        nf4_scaler_block(100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NF4 needs CUDA")
def test_nf4_on_cuda_close_to_dequantized_base(ckpt):
    try:
        model = apply_lora(load_model(ckpt, dtype=torch.bfloat16, device="cuda"),
                           LoRAConfig(rank=4, quantize_base="nf4", strict=True))
    except ValueError as e:  # no NF4 backend installed here
        pytest.skip(str(e))
    m = model.layers[0].mlp.up_proj
    assert m.quantized
    x = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    want = x @ m.base_weight().to(torch.bfloat16).T
    torch.testing.assert_close(m(x), want, rtol=2e-2, atol=2e-2)


def test_adapter_config_holds_only_keys_peft_knows(tmp_path, tiny_ckpt):
    """PEFT warns ("upgrade PEFT") about keys it does not know: the engine's settings live in grpo_lora.json."""
    import json

    from grpo_engine.model.loading import load_model
    from grpo_engine.model.lora import LoRAConfig, apply_lora, save_adapter

    model = apply_lora(load_model(tiny_ckpt), LoRAConfig(enabled=True, rank=4, init="gaussian"))
    out = save_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(tiny_ckpt))
    config = json.loads((out / "adapter_config.json").read_text())
    peft_keys = {"peft_type", "task_type", "base_model_name_or_path", "r", "lora_alpha", "lora_dropout",
                 "target_modules", "bias", "fan_in_fan_out", "inference_mode", "init_lora_weights",
                 "modules_to_save", "use_rslora", "use_dora"}
    assert set(config) <= peft_keys and config["r"] == 4
    assert json.loads((out / "grpo_lora.json").read_text())["init"] == "gaussian"
