"""The planner driven by a training config: knobs derived from config fields, `grpo plan CONFIG`, the
pre-flight check of `grpo train` (before any weights are read), and every GPU preset fitting its card."""

import json
import re
from pathlib import Path

import pytest

import grpo_engine.train.loop as loop
import grpo_engine.train.policy as policy_mod
import grpo_engine.train.setup as setup_mod
from grpo_engine.cli import main
from grpo_engine.config import ConfigError, load_config
from grpo_engine.plan import MODEL_SHAPES, fits, param_counts
from grpo_engine.plan.from_config import config_model_shape, plan_config, plan_input_from_config

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted((REPO / "configs").glob("gpu*gb_*.yaml"))
PRESET_NAME = re.compile(r"gpu(\d+)gb_(qwen2\.5-[\d.]+b)_(full|lora|qlora)\.yaml")

# config.json of Qwen/Qwen2.5-1.5B-Instruct (the fields our loader reads), as published on the hub
QWEN25_15B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
    "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_act": "silu",
}


def fake_checkpoint(tmp_path) -> Path:
    """A directory that passes check_paths (config.json, a .safetensors name, tokenizer.json) without
    weights: the tests below must finish before anything but config.json is read."""
    d = tmp_path / "Qwen2.5-1.5B-Instruct"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN25_15B_CONFIG))
    (d / "model.safetensors").write_bytes(b"")
    (d / "tokenizer.json").write_text("{}")
    row = json.dumps({"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"})
    for split in ("train", "test"):  # task.data_path=tmp_path: the data is read before the memory check
        (tmp_path / f"{split}.jsonl").write_text(row + "\n")
    return d


def test_knobs_derived_from_config_fields():
    cfg = load_config(None, [
        "rollout.prompts_per_step=8", "rollout.group_size=8", "rollout.max_prompt_tokens=256",
        "rollout.max_new_tokens=512", "memory.micro_batch_tokens=3000", "rollout.max_tokens_in_flight=12288",
        "lora.enabled=true", "lora.quantize_base=nf4", "lora.rank=8", "lora.target_modules=[q_proj,v_proj]",
        "memory.activation_checkpointing=every_k", "memory.checkpoint_every=3", "memory.logprob_chunk_size=512",
        "optimizer.name=adamw_8bit", "algorithm.beta=0.04"])
    k = plan_input_from_config(cfg)
    assert (k.prompts_per_step, k.group_size, k.prompt_len, k.completion_len) == (8, 8, 256, 512)
    assert k.micro_batch_rows == 3  # 3000 // (256 + 512)
    assert k.rollout_rows_in_flight == 16  # 12288 // (8 x 768) = 2 whole groups of 8
    assert (k.mode, k.lora_rank, k.lora_targets) == ("qlora", 8, ["q_proj", "v_proj"])
    assert k.precision == "bf16"  # auto plans for a CUDA card
    assert (k.activation_checkpointing, k.checkpoint_every, k.logprob_chunk) == ("every_k", 3, 512)
    assert (k.optimizer, k.reference) == ("adamw_8bit", "adapters")  # LoRA: the reference is adapters-off


@pytest.mark.parametrize("overrides, mode, reference, rows_in_flight", [
    ([], "full", "none", 0),  # beta 0: no reference at all; max_tokens_in_flight 0: all rows at once
    (["algorithm.beta=0.04"], "full", "gpu_copy", 0),
    (["algorithm.beta=0.04", "reference.park_on_cpu=true"], "full", "cpu", 0),
    (["lora.enabled=true", "memory.precision=fp32"], "lora", "none", 0),
    (["rollout.max_tokens_in_flight=100"], "full", "none", 8),  # less than one group: one group per wave
])
def test_mode_reference_and_rows(overrides, mode, reference, rows_in_flight):
    cfg = load_config(None, ["rollout.prompts_per_step=4", "rollout.group_size=8", *overrides])
    k = plan_input_from_config(cfg)
    assert (k.mode, k.reference, k.rollout_rows_in_flight) == (mode, reference, rows_in_flight)


def test_model_shape_from_config_json_or_override(tmp_path):
    ckpt = fake_checkpoint(tmp_path)
    shape = config_model_shape(load_config(None, [f"model.path={ckpt}"]))
    assert param_counts(shape) == param_counts(MODEL_SHAPES["qwen2.5-1.5b"])
    assert round(param_counts(shape)[0] / 1e9, 2) == 1.54
    missing = load_config(None, [f"model.path={tmp_path / 'models/Qwen2.5-3B-Instruct'}"])
    with pytest.raises(ConfigError, match=r"has no config.json .*plan with --model qwen2.5-3b"):
        config_model_shape(missing)
    assert config_model_shape(missing, "qwen2.5-3b") is MODEL_SHAPES["qwen2.5-3b"]
    tiny = load_config(None, ["warm_start.tiny.arch=qwen2", "warm_start.tiny.hidden_size=128"])
    assert config_model_shape(tiny).hidden_size == 128  # the warm-start model is built, never downloaded


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_fits_its_card(path):
    card, shape, mode = PRESET_NAME.fullmatch(path.name).groups()
    cfg = load_config(path)
    assert cfg.memory.gpu_memory_gib == float(card), "the card in the file name and memory.gpu_memory_gib differ"
    r = cfg.rollout
    assert (r.prompts_per_step, r.group_size, r.max_new_tokens) == (8, 8, 512)
    assert Path(cfg.model.path).name.lower().startswith(shape)
    plan = plan_config(cfg, shape)  # the weights are not on this machine: the published shape
    assert plan.knobs.mode == mode
    assert fits(plan, float(card)), f"{path.name}: {plan.total_gib:.2f} GiB > {card} GiB"
    # the header states the planned peak; keep it equal to what the planner says now
    stated = re.search(r"Planned peak .*?: ([\d.]+) GiB \((\w+) phase\)", path.read_text())
    assert stated, f"{path.name}: header lacks the 'Planned peak ...: X GiB (phase phase)' line"
    assert (float(stated.group(1)), stated.group(2)) == (round(plan.total_gib, 2), plan.peak_phase)


def test_every_card_has_a_preset():
    cards = {PRESET_NAME.fullmatch(p.name).group(1) for p in PRESETS}
    assert cards == {"8", "12", "24"} and len(PRESETS) == 4


def test_plan_cli_with_a_config(capsys):
    preset = str(REPO / "configs/gpu8gb_qwen2.5-1.5b_qlora.yaml")
    assert main(["plan", preset, "--model", "qwen2.5-1.5b"]) == 0
    out = capsys.readouterr().out
    assert "FITS a 8 GiB card" in out and "(qlora, bf16, adamw," in out and "P=8 G=8 prompt=512" in out
    # full fine-tuning with AdamW state on the GPU: 1.54B x (2 weights + 2 grads + 12 AdamW) B alone > 8 GiB
    assert main(["plan", preset, "lora.enabled=false", "--model", "qwen2.5-1.5b"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT a 8 GiB card" in out and "to fit 8 GiB, combine:" in out
    assert main(["plan", preset, "lora.enabled=false", "--model", "qwen2.5-1.5b", "--card", "80"]) == 0
    assert "FITS a 80 GiB card" in capsys.readouterr().out
    # a PlanInput flag overrides the derived knob (fragmentation has no config field)
    assert main(["plan", preset, "--model", "qwen2.5-1.5b", "--fragmentation", "0.2"]) == 0
    assert "+ 20% fragmentation" in capsys.readouterr().out


def test_plan_cli_errors(capsys, tmp_path):
    preset = str(REPO / "configs/gpu24gb_qwen2.5-3b_full.yaml")
    assert main(["plan", preset]) == 2  # model.path not downloaded here
    assert "plan with --model qwen2.5-3b" in capsys.readouterr().err
    assert main(["plan"]) == 2
    assert "give a training config" in capsys.readouterr().err
    assert main(["plan", preset, "rollout.group_sise=8", "--model", "qwen2.5-3b"]) == 2
    assert "did you mean 'rollout.group_size'" in capsys.readouterr().err
    # the shape-only form still works
    assert main(["plan", "--model", "qwen2.5-0.5b", "--card", "8", "--optimizer", "adamw_offload",
                 "--activation-checkpointing", "all"]) == 0


HUGE = 10**400  # no float holds it


@pytest.mark.parametrize("setting", ["rollout.group_size", "rollout.prompts_per_step", "rollout.max_new_tokens",
                                     "rollout.max_prompt_tokens", "eval.max_examples", "eval.max_new_tokens",
                                     "curriculum.max_new_tokens", "lora.rank"])
def test_plan_refuses_a_size_no_card_holds_in_one_line(capsys, setting):
    """The planner's bytes are floats: a size of 10^400 overflowed them (an OverflowError traceback)."""
    preset = str(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml")
    assert main(["plan", preset, f"{setting}={HUGE}", "--model", "qwen2.5-1.5b"]) == 2
    err = capsys.readouterr().err
    assert err == (f"grpo plan: error: {setting}=1.00e+400 is more than any card holds (the planner counts sizes up "
                   f"to 4,294,967,296): lower {setting}\n")


def test_plan_takes_a_micro_batch_beyond_the_step_as_the_step(capsys):
    """memory.micro_batch_tokens larger than the step's batch means 'all at once': planned as the step's rows."""
    preset = str(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml")
    cfg = load_config(preset, [f"memory.micro_batch_tokens={HUGE}"])
    r = cfg.rollout
    assert plan_config(cfg, "qwen2.5-1.5b").knobs.micro_batch_rows == r.prompts_per_step * r.group_size
    assert main(["plan", preset, f"memory.micro_batch_tokens={HUGE}", "--model", "qwen2.5-1.5b"]) in (0, 1)


def test_plan_refuses_a_lora_rank_above_the_projections_rank(capsys):
    """Qwen2.5-1.5B: hidden 1536, the widest min(in, out) of the targeted projections, so a rank-1536 update of
    q_proj is already full rank; k_proj alone (1536 -> 256) is full rank at 256."""
    preset = str(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml")
    assert main(["plan", preset, "lora.rank=1536", "--model", "qwen2.5-1.5b"]) in (0, 1)
    capsys.readouterr()
    assert main(["plan", preset, "lora.rank=100000000", "--model", "qwen2.5-1.5b"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo plan: error: lora.rank=100,000,000 is above 1536, the highest rank an update of the "
                          "targeted projections (") and err.endswith("set lora.rank <= 1536 (or full fine-tuning: "
                                                                     "lora.enabled=false)\n")
    assert err.count("\n") == 1
    assert main(["plan", preset, "lora.rank=257", "lora.target_modules=[k_proj]", "--model", "qwen2.5-1.5b"]) == 2
    assert "lora.rank=257 is above 256" in capsys.readouterr().err
    assert main(["plan", preset, "lora.enabled=false", "lora.rank=100000000", "--model", "qwen2.5-1.5b"]) in (0, 1)


def test_a_larger_evaluation_does_not_shrink_the_training_micro_batch():
    """The memory settings left to the engine change the step's phases, not the eval phase: an evaluation that does
    not fit the card leaves them as they are (and the size check refuses it), where the choice once fell to the
    leanest micro-batch."""
    preset = REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml"
    usual = plan_config(load_config(preset), "qwen2.5-1.5b")
    large = plan_config(load_config(preset, ["eval.max_examples=256"]), "qwen2.5-1.5b")
    assert large.peak_phase == "eval" and not fits(large, 12.0)
    assert large.knobs.micro_batch_rows == usual.knobs.micro_batch_rows == 8192 // 1024
    assert large.knobs.logprob_chunk == usual.knobs.logprob_chunk


def test_grpo_trains_size_check_names_the_evaluation_when_it_is_the_peak():
    """On a CUDA card (memory.gpu_memory_gib unset: the card's own memory), an evaluation whose own decode state and
    prefill make the eval phase the peak is refused naming eval.max_examples, not the micro-batch."""
    import torch

    cfg = load_config(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml",
                      ["eval.max_examples=256", "memory.gpu_memory_gib=0"])
    from grpo_engine.plan.sizes import DeviceMemory, check_sizes

    card = DeviceMemory(12 * 2**30, "the CUDA card cuda:0")
    with pytest.raises(ConfigError) as e:
        check_sizes(cfg, 256, torch.device("cuda"), card, shape="qwen2.5-1.5b")
    msg = str(e.value)
    assert "\n" not in msg and "one step (eval phase)" in msg and msg.startswith("eval.max_examples=256, ")
    assert "lower eval.max_examples (at most rollout.prompts_per_step x group_size" in msg


def test_plan_cli_rejects_a_card_without_memory_and_a_non_boolean(capsys):
    """--card -1 got a "DOES NOT FIT" verdict, and --master-weights maybe was read as false."""
    assert main(["plan", "--model", "qwen2.5-0.5b", "--card", "-1"]) == 2
    assert "--card -1: give the card's GPU memory in GiB (> 0)" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "qwen2.5-0.5b", "--master-weights", "maybe"])
    assert exc.value.code == 2 and "'maybe' is not a boolean" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2.5-0.5b", "--master-weights", "No"]) == 0


def _no_load(*a, **k):
    raise AssertionError("load_model called")


def test_preflight_refuses_before_loading_the_model(tmp_path, monkeypatch):
    monkeypatch.setattr(policy_mod, "load_model", _no_load)
    ckpt = fake_checkpoint(tmp_path)
    cfg = load_config(REPO / "configs/gpu8gb_qwen2.5-1.5b_qlora.yaml",
                      [f"model.path={ckpt}", f"run_dir={tmp_path / 'run'}", "lora.enabled=false",
                       f"task.data_path={tmp_path}"])
    want = plan_config(cfg)
    assert not fits(want, 8)
    with pytest.raises(ConfigError) as e:
        loop.train(cfg)
    msg = str(e.value)
    assert msg.startswith(f"memory.gpu_memory_gib=8: the planned peak of one step is {want.total_gib:.2f} GiB "
                          f"({want.peak_phase} phase), more than the 8 GiB card")
    assert "optimizer.name=adamw_offload" in msg and "to fit 8 GiB, combine:" in msg
    assert not (tmp_path / "run").exists()  # nothing written either


def test_preflight_through_grpo_train(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(policy_mod, "load_model", _no_load)
    ckpt = fake_checkpoint(tmp_path)
    rc = main(["train", str(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml"), f"model.path={ckpt}",
               f"run_dir={tmp_path / 'run'}", f"task.data_path={tmp_path}", "memory.gpu_memory_gib=6"])
    assert rc == 2
    err = capsys.readouterr().err
    # the memory settings are chosen for the 6 GiB card (the leanest, as nothing fits), and the step still does not
    want = plan_config(load_config(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml", [
        f"model.path={ckpt}", f"run_dir={tmp_path / 'run'}", f"task.data_path={tmp_path}", "memory.gpu_memory_gib=6"]))
    assert want.total_gib > 6
    assert err.startswith(f"grpo: error: memory.gpu_memory_gib=6: the planned peak of one step is "
                          f"{want.total_gib:.2f} GiB ({want.peak_phase} phase), more than the 6 GiB card"), err


def test_preflight_passes_a_config_that_fits(tmp_path, monkeypatch):
    class Reached(Exception):
        pass

    def reached(*a, **k):
        raise Reached

    monkeypatch.setattr(setup_mod, "load_tokenizer", reached)  # the first thing read after the set-up checks
    monkeypatch.setattr(policy_mod, "load_model", _no_load)
    ckpt = fake_checkpoint(tmp_path)
    data = tmp_path / "gsm8k"
    data.mkdir()
    row = {"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}
    for split in ("train", "test"):
        (data / f"{split}.jsonl").write_text(json.dumps(row) + "\n")
    cfg = load_config(REPO / "configs/gpu8gb_qwen2.5-1.5b_qlora.yaml",
                      [f"model.path={ckpt}", f"run_dir={tmp_path / 'run'}", f"task.data_path={data}",
                       "logging.progress=false"])
    with pytest.raises(Reached):  # the 4.26 GiB plan passed the 8 GiB check
        loop.train(cfg)


def test_memory_left_to_the_engine_is_chosen_per_device():
    """CPU: the CPU defaults, activation checkpointing by the planner's rule for the model (none where no shape is
    known); a card: the least recompute whose largest fitting micro-batch is 4,096+ tokens, the
    largest chunk that then fits, within GPU_HEADROOM of the card; a setting the user wrote is kept; a card too
    small for anything gets the leanest settings (and the pre-flight check refuses it)."""
    from grpo_engine.plan.device_defaults import CHECKPOINTING_CHOICES, GPU_HEADROOM
    from grpo_engine.plan.from_config import config_memory_choice

    cfg = load_config(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml")
    assert (cfg.memory.micro_batch_tokens, cfg.memory.logprob_chunk_size) == (0, 0)  # the preset leaves them
    from grpo_engine.plan.from_config import plan_input_from_config
    from grpo_engine.plan.memory import resolve_checkpointing
    from grpo_engine.plan.shapes import model_shape

    cpu = config_memory_choice(cfg, None)  # model.path not downloaded: no shape to judge
    assert (cpu.micro_batch_tokens, cpu.logprob_chunk_size, cpu.activation_checkpointing) == (1024, 256, "none")
    want = resolve_checkpointing(model_shape("qwen2.5-1.5b"), plan_input_from_config(cfg), 1024)
    assert config_memory_choice(cfg, None, "qwen2.5-1.5b").activation_checkpointing == want != "auto"
    gpu = config_memory_choice(cfg, 12.0, "qwen2.5-1.5b")
    assert gpu.planned_gib <= 12.0 * GPU_HEADROOM and gpu.micro_batch_tokens >= 4096
    cheaper = [m for m, _ in CHECKPOINTING_CHOICES[: [m for m, _ in CHECKPOINTING_CHOICES].index(
        gpu.activation_checkpointing)]]
    for mode in cheaper:  # each cheaper recompute mode fits no micro-batch of 4,096 tokens on this card
        knobs = {"activation_checkpointing": mode, "micro_batch_tokens": 4096, "logprob_chunk_size": 256}
        plan = plan_config(load_config(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml",
                                       [f"memory.{k}={v}" for k, v in knobs.items()]), "qwen2.5-1.5b", 12.0)
        assert plan.total_gib > 12.0 * GPU_HEADROOM, mode
    bigger = plan_config(load_config(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml", [
        f"memory.micro_batch_tokens={2 * gpu.micro_batch_tokens}", "memory.logprob_chunk_size=256",
        f"memory.activation_checkpointing={gpu.activation_checkpointing}"]), "qwen2.5-1.5b", 12.0)
    assert bigger.total_gib > 12.0 * GPU_HEADROOM  # the next larger micro-batch would not fit, even in small chunks
    mine = load_config(REPO / "configs/gpu12gb_qwen2.5-1.5b_lora.yaml", ["memory.micro_batch_tokens=1536"])
    assert config_memory_choice(mine, 80.0, "qwen2.5-1.5b").micro_batch_tokens == 1536  # the user's wins
    tiny_card = config_memory_choice(cfg, 1.0, "qwen2.5-1.5b")
    assert (tiny_card.micro_batch_tokens, tiny_card.activation_checkpointing) == (512, "all")
