"""Checks shared by test_families.py and test_windows.py: tiny random checkpoints that transformers builds, and
parity checks of our model against transformers / PEFT on them (transformers is the reference for the math)."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch

from grpo_engine import load_model, save_model


def hf_dir_maker(tmp_path_factory, base: dict, variants: dict, norm_init: Callable[[str], tuple[float, float]]):
    """name -> a checkpoint directory written by transformers' save_pretrained: random weights, each norm weight
    drawn as center + scale * N(0, 1) with (center, scale) = norm_init(model_type), biases as 0.1 * N(0, 1), so
    each is exercised. Seeded by the variant's place in sorted(variants)."""
    transformers = pytest.importorskip("transformers")
    made = {}

    def make(name: str):
        if name not in made:
            model_type, fields = variants[name]
            cfg = transformers.AutoConfig.for_model(model_type, **{**base, **fields})
            torch.manual_seed(sorted(variants).index(name))
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
            center, scale = norm_init(model_type)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if n.endswith("norm.weight"):
                        p.copy_(center + scale * torch.randn_like(p))
                    elif n.endswith("bias"):
                        p.copy_(0.1 * torch.randn_like(p))
            made[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(made[name])
        return made[name]

    return make


def hf_load(path, dtype=torch.float32):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def padded_batch(T: int, seed: int = 0, vocab_size: int = 300):
    """3 rows of T random ids (ids >= 3: no special token), rows 1 and 2 left-padded by T // 4 and T // 2."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (3, T), generator=g)
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, : T // 4] = 0
    mask[2, : T // 2] = 0
    return ids, mask


def assert_bf16_within_bf16_rounding(path) -> None:
    """Both in bf16: ours is as far from the fp32 logits as transformers' is, and close to transformers'."""
    ids, _ = padded_batch(30, seed=1)
    with torch.no_grad():
        exact = hf_load(path)(ids).logits
        theirs = hf_load(path, torch.bfloat16)(ids).logits.float()
        ours = load_model(path, dtype=torch.bfloat16)(ids).float()
    their_err = (theirs - exact).abs().max().item()
    assert (ours - exact).abs().max().item() < 2 * their_err + 1e-3
    assert (ours - theirs).abs().max().item() < 2 * their_err + 1e-3


def assert_save_loads_in_transformers(path, out, model_type: str):
    """Our save of the checkpoint at `path` into `out`: its config.json names `model_type`, and transformers and we
    read it back to the same logits. Returns (our model, the saved config.json) for the caller's own checks."""
    ours = load_model(path)
    save_model(ours, out)
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == model_type
    theirs, back = hf_load(out), load_model(out)
    ids, _ = padded_batch(30, seed=2)
    with torch.no_grad():
        want = ours(ids)
        assert (theirs(ids).logits - want).abs().max().item() < 1e-5
        assert torch.equal(back(ids), want)
    return ours, raw


def _one_step(model, ids, opt) -> None:
    """One cross-entropy step of next-token prediction over `ids`."""
    model.train()
    torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    opt.step()
    model.eval()


def assert_lora_step_loads_in_peft(path, out, T: int):
    """The default LoRA targets, one training step on T tokens (lora_B moves off zero: the adapter changes the
    logits), and PEFT loads the saved adapter onto transformers' model to our logits. Returns the LoRA model."""
    peft = pytest.importorskip("peft")
    from grpo_engine.model.lora import LoRAConfig, apply_lora, save_adapter

    model = apply_lora(load_model(path), LoRAConfig(rank=4))
    ids, _ = padded_batch(T, seed=3)
    _one_step(model, ids, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0))
    adapter = save_adapter(model, out, base_model_name_or_path=str(path))
    theirs = peft.PeftModel.from_pretrained(hf_load(path), adapter).eval()
    with torch.no_grad():
        want = model(ids)
        assert (want - load_model(path)(ids)).abs().max().item() > 1e-4
        assert (theirs(ids).logits - want).abs().max().item() < 1e-5
    return model


def assert_full_step_loads_in_transformers(path, out, T: int) -> None:
    """A full fine-tuning step on T tokens: every weight gets a finite gradient, the step changes the logits, and
    the checkpoint saved into `out` loads in transformers to the trained logits."""
    model = load_model(path).train()
    ids, _ = padded_batch(T, seed=4)
    torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    model.eval()
    save_model(model, out)
    with torch.no_grad():
        want = model(ids)
        assert (want - load_model(path)(ids)).abs().max().item() > 1e-4
        assert (hf_load(out)(ids).logits - want).abs().max().item() < 1e-5


def assert_grpo_logprobs_equal_full_forwards(ours, theirs, batch, prompts, completions) -> None:
    """The chunked log-probs of a GRPO batch (temperature 0.7) equal a full forward's, ours and transformers', on
    each row alone."""
    from grpo_engine.train.forward import sequence_logprobs

    with torch.no_grad():
        logp, _ = sequence_logprobs(ours, batch, temperature=0.7, chunk_size=4)
        for i, (p, c) in enumerate(zip(prompts, completions)):
            ids = torch.tensor([p + c])
            for model_logits in (ours(ids), theirs(ids).logits):
                ref = torch.log_softmax(model_logits[0, :-1] / 0.7, -1).gather(-1, ids[0, 1:, None])[:, 0]
                assert (logp[i, len(p):len(p) + len(c)] - ref[len(p) - 1:]).abs().max().item() < 1e-5


def raw_config(base: dict, model_type: str, **fields) -> dict:
    """A config.json's content: `base` with the model type and `fields` over it."""
    return {"model_type": model_type, **base, **fields}


def assert_refused_in_one_line(raw: dict, needle: str) -> None:
    """config_from_hf refuses `raw` as an unsupported feature, in one line naming `needle`."""
    from grpo_engine.model.config import CheckpointError
    from grpo_engine.model.hf_io import config_from_hf

    with pytest.raises(CheckpointError, match="unsupported feature") as err:
        config_from_hf(raw)
    assert needle in str(err.value) and "\n" not in str(err.value)


def gguf_names_allowed(gguf, arch: str) -> set[str]:
    """llama.cpp's tensor names for `arch` (the gguf package's constants), with {bid} for the block number."""
    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    return {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch_id]}


def gguf_template(name: str) -> str:
    """A GGUF tensor's name as gguf_names_allowed lists it: no .weight / .bias, {bid} for the block number."""
    parts = name.rsplit(".", 1)[0].split(".")
    return ".".join("{bid}" if p.isdigit() else p for p in parts)
