"""memory.precision resolved for the card (plan/precision.py): bf16 only where the card has it natively, fp32 on
older cards and on CPU, bf16 refused on a card without it; the trainer and the planner get the same answer. The
CUDA queries are monkeypatched: these run on a CPU."""

import pytest
import torch

from grpo_engine.config import ConfigError, load_config
from grpo_engine.plan import precision
from grpo_engine.plan.from_config import plan_config, plan_input_from_config
from grpo_engine.train.memory import torch_dtype

CARDS = {"rtx2080": ((7, 5), "NVIDIA GeForce RTX 2080"), "t4": ((7, 5), "Tesla T4"),
         "a100": ((8, 0), "NVIDIA A100"), "rtx4090": ((8, 9), "NVIDIA GeForce RTX 4090")}


def fake_card(monkeypatch, name: str, emulation_argument: bool = True) -> None:
    """torch.cuda answers as the card `name` would: its capability, its name, is_bf16_supported with or without
    the including_emulation argument (an emulating card says True unless emulation is left out, as torch does)."""
    capability, label = CARDS[name]
    native = capability >= (8, 0)

    def with_argument(including_emulation: bool = True) -> bool:
        return native or including_emulation

    def without_argument() -> bool:
        return True  # older torch: emulated bf16 counts as supported

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: label)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", with_argument if emulation_argument else without_argument)


@pytest.mark.parametrize("emulation_argument", [True, False])
@pytest.mark.parametrize("card, auto", [("rtx2080", "fp32"), ("t4", "fp32"), ("a100", "bf16"), ("rtx4090", "bf16")])
def test_auto_is_bf16_only_on_a_card_with_native_bf16(monkeypatch, card, auto, emulation_argument):
    fake_card(monkeypatch, card, emulation_argument)
    assert precision.resolve_precision("auto", "cuda") == auto
    assert precision.resolve_precision("auto", torch.device("cuda")) == auto
    assert precision.resolve_precision("fp32", "cuda") == "fp32"
    assert torch_dtype("auto", "cuda") == {"fp32": torch.float32, "bf16": torch.bfloat16}[auto]
    assert precision.resolve_precision("auto", "cpu") == "fp32" and torch_dtype("auto", "cpu") == torch.float32


def test_bf16_on_a_card_without_it_is_refused_in_one_line_naming_the_setting(monkeypatch):
    fake_card(monkeypatch, "t4")
    with pytest.raises(ConfigError) as e:
        torch_dtype("bf16", "cuda")
    message = str(e.value)
    assert "\n" not in message and message.startswith("memory.precision=bf16: Tesla T4, compute capability 7.5")
    assert "set memory.precision=auto" in message
    fake_card(monkeypatch, "a100")
    assert torch_dtype("bf16", "cuda") == torch.bfloat16
    assert torch_dtype("bf16", "cpu") == torch.bfloat16  # a CPU run may ask for bf16 (slow, warned elsewhere)


def test_the_planner_plans_the_dtype_the_trainer_gets(monkeypatch):
    cfg = load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
                             "rollout.max_prompt_tokens=16"])
    fake_card(monkeypatch, "rtx2080")
    assert plan_input_from_config(cfg).precision == "fp32" == precision.resolve_precision("auto", "cuda")
    fp32 = plan_config(cfg, shape="qwen2.5-0.5b").phase("rollout").components["weights"]
    fake_card(monkeypatch, "rtx4090")
    assert plan_input_from_config(cfg).precision == "bf16"
    bf16 = plan_config(cfg, shape="qwen2.5-0.5b").phase("rollout").components["weights"]
    assert fp32 == 2 * bf16  # 4 bytes a weight against 2
    assert plan_input_from_config(cfg, bf16_native=False).precision == "fp32"  # the card named by the caller
    bf16_cfg = load_config(None, ["memory.precision=bf16"])
    fake_card(monkeypatch, "t4")
    with pytest.raises(ConfigError, match="^memory.precision=bf16: this card has no native bf16"):
        plan_input_from_config(bf16_cfg)


def test_without_a_card_here_the_planner_plans_a_card_with_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan_input_from_config(load_config(None, [])).precision == "bf16"
