"""A training step updates every weight in place: each parameter's and buffer's storage (data_ptr) is the same after
update_policy + optimizer_step as before, for each optimizer the engine builds. The CUDA graphs of the static decode
read the weights at those addresses (rollout/static_decode.py model_signature): a step that moved one would make
every graph replay stale weights or be captured again every step."""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo_engine.config.training import LoRAConfig, OptimizerSection
from grpo_engine.model.loading import load_model
from grpo_engine.model.lora import apply_lora
from grpo_engine.rl.losses import LossConfig, resolve
from grpo_engine.rollout.static_decode import model_signature
from grpo_engine.train.batch import build_train_batch
from grpo_engine.train.optim import build_optimizer
from grpo_engine.train.update import UpdateSettings, update_policy


def _batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 5, 4, 2)]
    comps = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (6, 2, 5, 4)]
    adv = torch.tensor([1.0, -0.5, 0.25, -1.5])
    return build_train_batch(prompts, comps, [[-5.0] * len(c) for c in comps], adv, [True] * 4, pad_id=0)


def _storage(model) -> dict[str, int]:
    """name -> data_ptr of every parameter and buffer."""
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    return {name: t.data_ptr() for name, t in tensors.items()}


def _step(model, optimizer) -> None:
    settings = UpdateSettings(loss=resolve(LossConfig(loss="grpo")), mu=2, grad_clip=1.0, temperature=1.0, chunk_size=8,
                              auto_halve=False)
    outcome = update_policy(model, optimizer, _batch(model.config.vocab_size), settings, 4096)
    assert not outcome.skipped


def _eight_bit(params, package: str):
    """An 8-bit AdamW from `package` over `params` on the CPU, or a skip saying why there is none here."""
    pytest.importorskip(package, reason=f"{package} is not installed: no 8-bit optimizer to check on this CPU")
    if package == "bitsandbytes":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=1e-2)
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=1e-2)


CASES = {  # name -> (model dtype, LoRA, optimizer.name or 8-bit package, master_weights)
    "adamw": (torch.float32, False, "adamw", True),
    "adamw_fused": (torch.float32, False, "adamw_fused", True),
    "adamw_offload": (torch.float32, False, "adamw_offload", True),
    "adamw_offload_bf16": (torch.bfloat16, False, "adamw_offload", True),
    "adamw_master_weights_bf16": (torch.bfloat16, False, "adamw", True),
    "adamw_bf16_no_master": (torch.bfloat16, False, "adamw_fused", False),
    "lora": (torch.float32, True, "adamw_fused", True),
    "lora_bf16": (torch.bfloat16, True, "adamw_offload", True),
    "adamw_8bit_bitsandbytes": (torch.float32, False, "bitsandbytes", True),
    "adamw_8bit_torchao": (torch.float32, False, "torchao", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_training_step_keeps_every_parameter_and_buffer_where_it_was(tiny_ckpt, case):
    dtype, lora, optimizer_name, master = CASES[case]
    model = load_model(tiny_ckpt, dtype=dtype)
    if lora:
        model = apply_lora(model, LoRAConfig(rank=4))
    trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters
    if optimizer_name in ("bitsandbytes", "torchao"):
        optimizer = _eight_bit(trainable, optimizer_name)
    else:
        cfg = OptimizerSection(name=optimizer_name, lr=1e-2, master_weights=master, pin_memory=False)
        optimizer = build_optimizer(trainable, cfg, "cpu")
    _check_in_place(model, optimizer, trainable)


def _check_in_place(model, optimizer, trainable) -> None:
    before, signature = _storage(model), model_signature(model)
    values = [p.detach().clone() for p in trainable]
    _step(model, optimizer)
    _step(model, optimizer)  # the first step made the optimizer's state: the second runs with it
    assert _storage(model) == before
    assert model_signature(model) == signature  # the static decode keeps its graphs
    assert all(not torch.equal(p, v) for p, v in zip(trainable, values) if p.dim() == 2)  # the step did update


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["adamw_fused", "adamw_offload", "adamw_8bit"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_cuda_training_step_keeps_every_parameter_and_buffer_where_it_was(tiny_ckpt, name, lora):
    """bf16 on CUDA, as the engine trains there: the offloaded AdamW with pinned state, the 8-bit AdamW the engine
    builds (torchao or bitsandbytes; plain AdamW where neither is installed)."""
    model = load_model(tiny_ckpt, dtype=torch.bfloat16, device="cuda")
    if lora:
        model = apply_lora(model, LoRAConfig(rank=4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an 8-bit fallback says so
        optimizer = build_optimizer(trainable, OptimizerSection(name=name, lr=1e-2), "cuda")
    _check_in_place(model, optimizer, trainable)
