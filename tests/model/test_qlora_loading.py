"""QLoRA loading: the base is quantized while it is moved to its device, one unquantized projection there at a time,
and ends with the weights and adapters that wrapping the loaded model in place gives.

NF4 needs CUDA, so a stand-in quantizer (codes on a 1/64 grid, int16, new storage) is registered as the backend,
and the "device" is the CPU: a weight not yet moved is on the meta device, as apply_lora leaves the model while
it places the weights."""

import types
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import grpo_engine.model.lora as lora_mod
import grpo_engine.train.policy as policy_mod
from grpo_engine.config.training import LORA_TARGETS
from grpo_engine.model.loading import load_model
from grpo_engine.model.lora import NF4_BACKENDS, LoRAConfig, LoRALinear, apply_lora, lora_modules
from grpo_engine.model.tiny import make_tiny_checkpoint
from grpo_engine.plan.policy_spec import PolicySpec
from grpo_engine.train.policy import policy_model

FAKE = "fake_nf4"
STEP = 1 / 64


def fake_quantize(w: torch.Tensor):
    """w [out, in] -> (int16 codes [out, in], forward, dequantize); draws no random numbers, like NF4."""
    q = torch.round(w.detach().float() / STEP).to(torch.int16)
    return q, (lambda x, qw: F.linear(x, qw.to(x.dtype) * STEP)), (lambda qw: qw.float() * STEP)


@pytest.fixture
def fake_backend(monkeypatch):
    """Register `quantize` (default fake_quantize) as the NF4 backend apply_lora picks on any device."""
    def register(quantize=fake_quantize):
        monkeypatch.setitem(NF4_BACKENDS, FAKE, quantize)
        monkeypatch.setattr(lora_mod, "choose_nf4_backend", lambda cfg, device: (FAKE, ""))
    return register


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def ckpt(request, tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), arch="qwen2", seed=0,
                                tie_word_embeddings=request.param)


QLORA = LoRAConfig(rank=4, quantize_base="nf4")


def projection_weights(model: nn.Module) -> list[tuple[nn.Module, torch.Tensor]]:
    """(module, base weight) of every targeted projection, in module order."""
    return [(m, m.weight) for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(m, (nn.Linear, LoRALinear))]


def test_each_projection_is_quantized_before_the_next_reaches_the_device(ckpt, fake_backend):
    """At every quantize call the device holds exactly one unquantized projection (the one being quantized), and
    the unquantized copies of the earlier ones are freed. Wrapping a model already on the device held all of them
    (the whole bf16 model on the GPU before the first projection was quantized)."""
    model = load_model(ckpt)  # staged on the CPU, as build_policy reads a QLoRA model
    sizes = [w.numel() * w.element_size() for _, w in projection_weights(model)]  # module order
    resident, earlier_freed, inputs = [], [], []

    def tracking(w):
        resident.append(sum(t.numel() * t.element_size() for m, t in projection_weights(model)
                            if not t.is_meta and not (isinstance(m, LoRALinear) and m.quantized)))
        earlier_freed.append(all(ref() is None for ref in inputs))
        inputs.append(weakref.ref(w))
        return fake_quantize(w)

    fake_backend(tracking)
    apply_lora(model, QLORA, "cpu")
    assert len(sizes) == 2 * 7
    assert resident == sizes  # one projection at a time: 64x64 fp32 = 16 KiB (k/v 8 KiB, MLP 32 KiB)
    assert all(earlier_freed)
    assert not any(p.is_meta for p in model.parameters())
    assert all(m.quantized for _, m in lora_modules(model))


def test_the_loaded_model_has_the_weights_and_adapters_of_in_place_wrapping(ckpt, fake_backend):
    """Quantized bases = the quantizer applied to the checkpoint's weights; lora_A = plain LoRA's under the same
    seed (quantizing draws no random numbers, so wrapping in place drew these); every other weight = the
    checkpoint's; a tied head is the embedding itself; the forward is the dequantized base model's (B = 0)."""
    fake_backend()
    base = load_model(ckpt)
    torch.manual_seed(5)
    plain = apply_lora(load_model(ckpt), LoRAConfig(rank=4))
    torch.manual_seed(5)
    model = apply_lora(load_model(ckpt), QLORA, "cpu")
    for name, m in lora_modules(model):
        p, b = plain.get_submodule(name), base.get_submodule(name)
        assert m.quantized
        assert torch.equal(m.weight, fake_quantize(b.weight)[0]), name
        assert torch.equal(m.lora_A, p.lora_A) and torch.equal(m.lora_B, p.lora_B), name
        assert (m.bias is None) == (b.bias is None) and (m.bias is None or torch.equal(m.bias, b.bias)), name
    quantized = {f"{name}.weight" for name, _ in lora_modules(model)}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, t in base.named_parameters(remove_duplicate=False):
        if name not in quantized:
            assert torch.equal(params[name], t) and not params[name].requires_grad, name
    assert (model.lm_head.weight is model.embed.weight) == model.config.tie_word_embeddings
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{n}.lora_{ab}" for n, _ in lora_modules(model) for ab in "AB"}
    with torch.no_grad():
        for name, m in lora_modules(model):
            base.get_submodule(name).weight.copy_(m.base_weight())
    x = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(x), base(x), rtol=1e-6, atol=1e-6)


def test_build_policy_reads_only_a_qlora_model_onto_the_cpu(monkeypatch):
    """QLoRA: read onto the CPU, apply_lora moves it to the device; LoRA and full fine-tuning: read onto it."""
    calls = []
    monkeypatch.setattr(policy_mod, "load_model", lambda path, dtype, device: calls.append(("load", device)) or "m")
    monkeypatch.setattr(policy_mod, "apply_lora", lambda model, cfg, device: calls.append(("lora", device)) or model)
    cfg, gpu, cpu = types.SimpleNamespace(lora=QLORA), torch.device("cuda"), torch.device("cpu")
    want = {"qlora": [("load", cpu), ("lora", gpu)], "lora": [("load", gpu), ("lora", gpu)], "full": [("load", gpu)]}
    for mode, expected in want.items():
        calls.clear()
        assert policy_model(cfg, PolicySpec(mode, "adapters", False), "path", torch.bfloat16, gpu) == "m"
        assert calls == expected, mode


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NF4 needs CUDA")
def test_real_nf4_loading_equals_in_place_wrapping_with_a_lower_gpu_peak(tmp_path):
    """On CUDA with the real NF4 backend: quantizing while loading gives the weights and adapters of wrapping the
    model already on the GPU (same seed), and its allocation peak is lower (the old path held the whole bf16
    model on the GPU before its first projection was quantized)."""
    path = make_tiny_checkpoint(tmp_path / "m", arch="qwen2", seed=0, hidden_size=256, intermediate_size=1024,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    cfg = LoRAConfig(rank=4, quantize_base="nf4", strict=True)

    def loaded(staged_on_cpu: bool):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        torch.manual_seed(5)
        try:
            if staged_on_cpu:
                model = apply_lora(load_model(path, torch.bfloat16, "cpu"), cfg, "cuda")
            else:
                model = apply_lora(load_model(path, torch.bfloat16, "cuda"), cfg)
        except ValueError as e:  # no NF4 backend installed here
            pytest.skip(str(e))
        return model, torch.cuda.max_memory_allocated() - start

    old, old_peak = loaded(False)
    old_state = {n: (m.base_weight().cpu(), m.lora_A.cpu()) for n, m in lora_modules(old)}
    del old
    new, new_peak = loaded(True)
    for name, m in lora_modules(new):
        assert m.quantized and m.weight.device.type == "cuda", name
        torch.testing.assert_close(m.base_weight().cpu(), old_state[name][0], rtol=0, atol=0)
        torch.testing.assert_close(m.lora_A.cpu(), old_state[name][1], rtol=0, atol=0)
    assert new_peak < old_peak
