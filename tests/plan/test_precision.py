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
    assert precision.choose_precision("auto", "cuda").precision == auto
    assert precision.choose_precision("auto", torch.device("cuda")).precision == auto
    assert precision.choose_precision("fp32", "cuda").precision == "fp32"
    chosen = precision.choose_precision("auto", "cuda").precision
    assert torch_dtype(chosen) == {"fp32": torch.float32, "bf16": torch.bfloat16}[auto]
    cpu = precision.choose_precision("auto", "cpu").precision  # no model shape: too little known for bf16
    assert cpu == "fp32" and torch_dtype(cpu) == torch.float32


def test_bf16_on_a_card_without_it_is_refused_in_one_line_naming_the_setting(monkeypatch):
    fake_card(monkeypatch, "t4")
    with pytest.raises(ConfigError) as e:
        precision.choose_precision("bf16", "cuda")
    message = str(e.value)
    assert "\n" not in message and message.startswith("memory.precision=bf16: Tesla T4, compute capability 7.5")
    assert "set memory.precision=auto" in message
    fake_card(monkeypatch, "a100")
    assert torch_dtype(precision.choose_precision("bf16", "cuda").precision) == torch.bfloat16
    assert torch_dtype(precision.choose_precision("bf16", "cpu").precision) == torch.bfloat16  # slow, warned elsewhere


def test_the_planner_plans_the_dtype_the_trainer_gets(monkeypatch):
    cfg = load_config(None, ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
                             "rollout.max_prompt_tokens=16"])
    fake_card(monkeypatch, "rtx2080")
    assert plan_input_from_config(cfg).precision == "fp32" == precision.choose_precision("auto", "cuda").precision
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


# ---- a CPU: auto is bf16 where this CPU has native bf16 dot products and measures the model's products faster

SMOLLM2_MLP = (576, 1536)  # (hidden, intermediate) of SmolLM2-135M: 884,736 weights a projection


@pytest.mark.parametrize("isa, shape, ratio, expected", [
    ("avx512_bf16", SMOLLM2_MLP, 0.55, "bf16"),  # native and measured faster
    ("amx_bf16", SMOLLM2_MLP, 0.80, "bf16"),  # at the threshold: bf16
    ("avx512_bf16", SMOLLM2_MLP, 0.81, "fp32"),  # native but not faster enough here
    (None, SMOLLM2_MLP, 0.10, "fp32"),  # no native dot products: never measured, fp32
    ("avx512_bf16", (256, 1024), 0.10, "fp32"),  # 262,144 < 2**19: a tiny model stays fp32 (tests compare fp32)
    ("avx512_bf16", None, 0.10, "fp32"),  # the model's shape unknown
])
def test_auto_on_a_cpu_is_bf16_only_where_it_pays(isa, shape, ratio, expected):
    asked = []

    def measured(hidden, intermediate):
        asked.append((hidden, intermediate))
        return ratio

    choice = precision.choose_precision("auto", "cpu", shape, ratio=measured, isa=lambda: isa)
    assert choice.precision == expected
    measures = isa is not None and shape is not None and shape[0] * shape[1] >= precision.CPU_BF16_MIN_WEIGHT
    assert asked == ([shape] if measures else [])
    if measures:
        assert f"{ratio:.2f}x the fp32 time" in choice.why and isa in choice.why
    elif isa is None:
        assert "no native bf16" in choice.why


def test_auto_weighs_full_fine_tuning_like_adapters_when_bf16_weights_round_stochastically():
    """Full fine-tuning's weights go bf16 on a CPU by the same measurement as adapters when the optimizer rounds
    them stochastically from fp32 masters; rounded to nearest they stay fp32 unmeasured (nearest rounding gives
    back a short run's small updates). On a card with native bf16 they are bf16 (memory decides there)."""
    never = lambda *a: pytest.fail("measured")  # noqa: E731
    choice = precision.choose_precision("auto", "cpu", SMOLLM2_MLP, trains_weights=True, rounds_stochastically=False,
                                        ratio=never, isa=never)
    assert choice.precision == "fp32" and "full fine-tuning" in choice.why and "nearest" in choice.why
    for ratio, expected in ((0.5, "bf16"), (0.9, "fp32")):
        choice = precision.choose_precision("auto", "cpu", SMOLLM2_MLP, trains_weights=True,
                                            ratio=lambda h, i, r=ratio: r, isa=lambda: "amx_bf16")
        assert choice.precision == expected and f"{ratio:.2f}x the fp32 time" in choice.why


def test_an_explicit_precision_on_a_cpu_is_not_measured():
    never = lambda *a: pytest.fail("measured")  # noqa: E731
    for setting in ("fp32", "bf16"):
        choice = precision.choose_precision(setting, "cpu", SMOLLM2_MLP, ratio=never, isa=never)
        assert (choice.precision, choice.why) == (setting, "set in the config")


def test_native_bf16_isa_reads_the_first_cpus_flags():
    from grpo_engine.kernels.cpu import native_bf16_isa

    def info(flags):
        return f"processor\t: 0\nmodel name\t: X\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: amx_bf16\n"

    assert native_bf16_isa(info("fpu avx2 avx512f avx512_bf16")) == "avx512_bf16"
    assert native_bf16_isa(info("avx512_bf16 amx_tile amx_bf16")) == "amx_bf16"  # AMX first: the faster one
    assert native_bf16_isa(info("fpu avx2 avx512f")) is None  # the second processor's flags are not read
    assert native_bf16_isa("") is None


def test_the_bf16_ratio_is_measured_once_per_cpu_and_shape(monkeypatch, tmp_path):
    """bf16 seconds over the faster fp32 GEMM's, both MLP shapes summed; cached, so every run of a model on this
    machine chooses the same precision."""
    from grpo_engine.kernels import select

    monkeypatch.setenv("GRPO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(select.thread_choice, "others_busy", lambda: False)
    timed = []
    monkeypatch.setattr(select, "measure_shape", lambda o, i: (timed.append(("fp32", o, i)),
                                                               {"torch": 3.0, "onednn": 2.0})[1])
    monkeypatch.setattr(select, "measure_bf16_shape", lambda o, i: (timed.append(("bf16", o, i)), 1.5)[1])
    assert select.bf16_ratio(64, 256) == pytest.approx((1.5 + 1.5) / (2.0 + 2.0))
    assert sorted(timed) == [("bf16", 64, 256), ("bf16", 256, 64), ("fp32", 64, 256), ("fp32", 256, 64)]
    assert select.bf16_ratio(64, 256) == pytest.approx(0.75) and len(timed) == 4  # from the cache
    select.bf16_ratio(64, 128)
    assert len(timed) == 8  # another shape: measured


def test_a_resumed_run_keeps_its_precision(tmp_path):
    """The checkpoint's resolved precision, not a new measurement, when the config leaves it to the engine; a
    checkpoint whose stored config still says auto trained in fp32 on a CPU."""
    from grpo_engine.checkpoint.resume import kept_precision
    from grpo_engine.plan.resolved import resolve_settings

    ckpt = tmp_path / "step-000002"
    ckpt.mkdir()
    for stored, kept in (("bf16", "bf16"), ("fp32", "fp32"), ("auto", "fp32")):
        (ckpt / "config.yaml").write_text(f"memory:\n  precision: {stored}\n")
        assert kept_precision(ckpt, "cpu") == kept
        resolved = resolve_settings(load_config(None, []), torch.device("cpu"), kept)
        assert resolved.precision == resolved.config.memory.precision == kept
        assert resolved.precision_why == "kept from the checkpoint resumed"
    assert kept_precision(ckpt, "cuda") is None  # stored auto on CUDA: the card answers as it did
    explicit = resolve_settings(load_config(None, ["memory.precision=fp32"]), torch.device("cpu"), "bf16")
    assert explicit.precision == "fp32"  # a value the user wrote is what runs (the resume check compares it)
