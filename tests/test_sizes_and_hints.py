"""Issue 51, items 3 and 4: sizes are bounded before anything is allocated (cases 12, 13), and every error is one line
whose hint is true: the command it suggests is run here and works (cases 11, 16, 18, 19, 20; docs/reliability.md)."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_engine.cli import main
from grpo_engine.config import load_config
from grpo_engine.plan import GIB

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "configs" / "tiny_arithmetic.yaml")


def grpo(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    return code, capsys.readouterr().err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("grpo")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def no_lock(monkeypatch):
    """Taking the run lock fails the test: a refusal must come before it (and nothing allocating runs after it)."""
    import grpo_engine.train.setup as setup

    def took_it(self):
        raise AssertionError("the run lock was taken before the sizes were checked")

    monkeypatch.setattr(setup.RunLock, "acquire", took_it)


# Cases 12 and 13 (item 3): sizes refused before the lock, in one line with the planned and available bytes -------
@pytest.mark.parametrize("overrides,named", [
    (["rollout.group_size=1000000000000"], "rollout.group_size=1,000,000,000,000"),  # case 12: the OOM killer
    (["rollout.prompts_per_step=1000000000"], "rollout.prompts_per_step=1,000,000,000"),  # case 13: MemoryError
    (["rollout.group_size=1" + "0" * 400], "rollout.group_size=1.00e+400"),  # no float could hold it
    (["rollout.max_new_tokens=100000000000"], "rollout.max_new_tokens=100,000,000,000"),
    (["rollout.max_prompt_tokens=100000000000"], "rollout.max_prompt_tokens=100,000,000,000"),
    (["eval.every=1", "eval.max_new_tokens=1000000000000"], "eval.max_examples=64"),
    (["tools.enabled=true", "tools.max_tokens=100000000000"], "tools.max_tokens=100,000,000,000"),
])
def test_sizes_beyond_this_machine_are_refused_before_the_run_lock(tiny_ckpt, tmp_path, capsys, no_lock, overrides,
                                                                   named):
    run_dir = tmp_path / "run"
    code, err = grpo(capsys, "train", TINY, f"model.path={tiny_ckpt}", f"run_dir={run_dir}", *overrides)
    line = one_error_line(err)
    ram = (line.split("more than the ")[1]).split(" bytes")[0]
    assert code == 2 and named in line and "physical RAM" in line and int(ram.replace(",", "")) > 0
    assert not run_dir.exists()  # nothing written, no lock left behind


def test_grpo_check_refuses_the_sizes_grpo_train_refuses(tiny_ckpt, capsys, monkeypatch):
    """`grpo check` runs train/setup.py checked_settings as `grpo train` does: the same one-line refusal, before the
    tokenizer or any weights are read."""
    import grpo_engine.train.setup as setup

    monkeypatch.setattr(setup, "load_tokenizer", lambda *a, **k: pytest.fail("read before the size check"))
    code, err = grpo(capsys, "check", TINY, f"model.path={tiny_ckpt}", "rollout.group_size=1000000000000")
    line = one_error_line(err)
    assert code == 2 and "rollout.group_size=1,000,000,000,000" in line and "physical RAM" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_budget_is_the_card(tiny_ckpt, tmp_path, capsys, no_lock):
    from grpo_engine.plan.sizes import device_memory

    card = torch.cuda.get_device_properties(0).total_memory
    assert device_memory(torch.device("cuda", 0)).nbytes == card
    code, err = grpo(capsys, "train", TINY, f"model.path={tiny_ckpt}", f"run_dir={tmp_path / 'run'}",
                     "model.device=cuda", "rollout.group_size=1000000000000")
    assert code == 2 and f"more than the {card:,} bytes" in one_error_line(err) and "the CUDA card cuda:0" in err


def test_the_planned_bytes_are_counted_in_integers(tiny_ckpt):
    """By hand: the KV cache and [rows, V] logits of the one group decoded at a time, the padded batch (P x G rows x
    (prompt + completion) tokens x 16 bytes), the probe's rows decoded at a time."""
    from grpo_engine.plan.from_config import config_model_shape
    from grpo_engine.plan.sizes import scaled_terms

    cfg = load_config(TINY, [f"model.path={tiny_ckpt}", "rollout.prompts_per_step=10", "rollout.group_size=1000",
                             "rollout.max_tokens_in_flight=1", "eval.max_new_tokens=20"])
    shape = json.loads((Path(tiny_ckpt) / "config.json").read_text())
    model = config_model_shape(cfg)
    kv_slot = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * shape["head_dim"] * 4  # fp32
    batch = 10 * 1000 * (128 + 8) * (8 + 4 + 4)
    decoded = 1000 * ((128 + 8) * kv_slot + shape["vocab_size"] * 12)  # one group of G rows
    probe = 1 * ((128 + 20) * kv_slot + shape["vocab_size"] * 12)  # n=1: groups of one row, one at a time
    terms = scaled_terms(cfg, 7, model, "fp32")
    assert [t.nbytes for t in terms] == [decoded, batch, probe]


def test_the_model_and_a_micro_batch_beyond_the_batch(tiny_ckpt, tmp_path):
    """A model too large for the budget names what to change; a micro-batch budget larger than the step's batch (10^12
    meaning "all at once", or 10^400) is planned as the batch, as the trainer packs it, not refused or overflowed."""
    from grpo_engine.plan.sizes import DeviceMemory, check_sizes

    for tokens in (10**12, 10**400):
        check_sizes(load_config(TINY, [f"model.path={tiny_ckpt}", f"memory.micro_batch_tokens={tokens}"]), 0,
                    torch.device("cpu"), DeviceMemory(GIB, "1 GiB"))
    cfg = load_config(TINY, [f"model.path={_smollm2_shape(tmp_path)}"])
    with pytest.raises(ValueError, match=r"^model.path=.*smollm2-shape, memory.micro_batch_tokens=256: one step "
                                         r"\((training|optimizer) phase\) is planned at .* bytes .*, more than the "
                                         r"268,435,456 bytes \(0.2 GiB\) of 256 MiB; .*LoRA adapters"):
        check_sizes(cfg, 0, torch.device("cpu"), DeviceMemory(256 * 2**20, "256 MiB"))


def _smollm2_shape(tmp_path) -> Path:
    """SmolLM2-135M-Instruct's shape (its published config.json numbers; no weights): the real demos' model."""
    d = tmp_path / "smollm2-shape"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True}))
    return d


def test_a_cpu_run_whose_auto_is_bf16_is_sized_in_bf16(tiny_ckpt, tmp_path, monkeypatch):
    """On a CPU whose `auto` resolves to bf16 (native bf16, the model's products measured faster), `grpo train`'s size
    check plans the step in bf16, as it runs: a machine between the bf16 and the fp32 peak is not refused."""
    import grpo_engine.kernels.cpu as cpu
    import grpo_engine.kernels.select as select
    import grpo_engine.plan.sizes as sizes
    import grpo_engine.train.setup as setup

    monkeypatch.setattr(cpu, "native_bf16_isa", lambda: "amx_bf16")
    monkeypatch.setattr(select, "bf16_ratio", lambda hidden, intermediate: 0.5)
    model = _smollm2_shape(tmp_path)
    (model / "model.safetensors").touch()  # never read: the check comes before any weights
    overrides = [f"model.path={model}", f"tokenizer.path={tiny_ckpt}", f"run_dir={tmp_path / 'run'}",
                 "lora.enabled=true"]
    peak = {p: max(t.nbytes for t in sizes.planned_sizes(load_config(TINY, [*overrides, f"memory.precision={p}"]), 0,
                                                         torch.device("cpu"), 2**60)) for p in ("fp32", "bf16")}
    assert peak["bf16"] < peak["fp32"]
    between = sizes.DeviceMemory((peak["bf16"] + peak["fp32"]) // 2, "physical RAM on this machine")
    monkeypatch.setattr(sizes, "device_memory", lambda device: between)

    class Checked(Exception):  # the sizes passed: the run lock is next
        pass

    def acquire(self):
        raise Checked

    monkeypatch.setattr(setup.RunLock, "acquire", acquire)
    with pytest.raises(Checked):
        setup.setup_run(load_config(TINY, [*overrides, "memory.precision=auto"]))
    with pytest.raises(ValueError, match="more than the .* bytes .* of physical RAM on this machine"):  # in fp32
        setup.setup_run(load_config(TINY, [*overrides, "memory.precision=fp32"]))


def test_the_shipped_configs_and_demos_pass_on_a_24_gb_machine(tiny_ckpt, tmp_path):
    """The check refuses nothing a user is told to run: each configs/*.yaml and demo recipe fits 24 GiB (the GPU
    presets: a 24 GiB card, planned at their model's shape; the CPU ones: 24 GiB of RAM)."""
    from grpo_engine.plan.sizes import DeviceMemory, check_sizes

    smollm2 = _smollm2_shape(tmp_path)
    yamls = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "grpo_engine" / "recipes").glob("*.yaml"))
    assert len(yamls) >= 8
    for path in yamls:
        cfg = load_config(path, [])
        gpu = path.name.startswith("gpu")
        shape = re.match(r"qwen2\.5-\d+(\.\d+)?b", Path(cfg.model.path).name.lower()).group(0) if gpu else None
        if not gpu and not cfg.warm_start.tiny.arch:
            cfg = load_config(path, [f"model.path={tiny_ckpt if path.name.startswith('tiny') else smollm2}"])
        device = torch.device("cuda" if gpu else "cpu")
        check_sizes(cfg, cfg.eval.max_examples if cfg.eval.every else 0, device, DeviceMemory(24 * GIB, "24 GiB"),
                    shape=shape)


# Case 11: --model without --real --------------------------------------------------------------------------------
def test_demo_model_without_real_is_refused_and_the_hint_works(tiny_ckpt, tmp_path, capsys):
    run_dir = tmp_path / "demo"
    code, err = grpo(capsys, "demo", "--model", tiny_ckpt, "--quick", f"run_dir={run_dir}")
    line = one_error_line(err)
    assert code == 2 and "add --real" in line and str(tiny_ckpt) in line and not run_dir.exists()
    code, err = grpo(capsys, "demo", "--real", "--model", tiny_ckpt, "--quick", f"run_dir={run_dir}")
    assert code == 0, err
    assert str(tiny_ckpt) in (run_dir / "checkpoints" / "step-000001" / "config.yaml").read_text()


# Case 16: non-finite weights in eval, generate and export -------------------------------------------------------
@pytest.fixture
def nan_run(tiny_ckpt, tmp_path, capsys):
    """A run of two checkpoints whose newest holds NaN weights and a manifest that vouches for them (a run that
    diverged at its last step: the manifest says what was written, not that it is sound)."""
    from grpo_engine.checkpoint.verify import write_manifest

    run_dir = tmp_path / "run"
    code, err = grpo(capsys, "train", TINY, f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=2")
    assert code == 0, err
    step2 = run_dir / "checkpoints" / "step-000002"
    weights = step2 / "model" / "model.safetensors"
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name][0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    write_manifest(step2)
    return run_dir, name


@pytest.mark.parametrize("command", ["eval", "generate", "export"])
def test_nan_weights_are_refused_in_one_line_naming_an_earlier_checkpoint(nan_run, tmp_path, capsys, command):
    run_dir, name = nan_run
    extra = {"eval": ["--n", "1", "--max-examples", "2", "--max-new", "4"], "generate": ["1+1=", "--max-new", "4"],
             "export": [tmp_path / "m.gguf"]}[command]
    code, err = grpo(capsys, command, run_dir / "checkpoints" / "step-000002", *extra)
    line = one_error_line(err)
    assert code == 2 and "NaN/inf" in line and name in line, err
    assert line.endswith(f"pass an earlier checkpoint instead, e.g. {run_dir / 'checkpoints' / 'step-000001'}")
    assert not (tmp_path / "m.gguf").exists()
    code, err = grpo(capsys, command, run_dir / "checkpoints" / "step-000001", *extra)  # the hint, run
    assert code == 0, err


def test_nonfinite_tensor_finds_nan_and_inf_and_passes_huge_finite_values():
    from grpo_engine.model.finite import nonfinite_tensor

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    with torch.no_grad():
        model[0].weight.fill_(3e38)  # finite, but its norm overflows fp32
    assert nonfinite_tensor(model) is None
    with torch.no_grad():
        model[1].bias[1] = float("-inf")
    assert nonfinite_tensor(model) == "1.bias"
    with torch.no_grad():
        model[0].weight[2, 2] = float("nan")
    assert nonfinite_tensor(model) == "0.weight"


# Case 18: the hint after a disk-full first checkpoint --------------------------------------------------------------
def _disk_full_at_save(monkeypatch, failing_call: int):
    """hf_io's writer fails with ENOSPC on its `failing_call`-th call (as safetensors reports it)."""
    from safetensors import SafetensorError

    import grpo_engine.model.hf_io as hf_io

    real, calls = hf_io.save_file, []

    def save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == failing_call:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(hf_io, "save_file", save)
    return lambda: monkeypatch.setattr(hf_io, "save_file", real)


@pytest.mark.parametrize("failing_call,flag", [(1, "--overwrite"), (2, "--resume")])
def test_after_a_full_disk_the_hinted_flag_continues_the_run(tiny_ckpt, tmp_path, capsys, monkeypatch, failing_call,
                                                             flag):
    """The first checkpoint failing left no checkpoint, and `--resume` (the old hint) failed with 'no complete
    checkpoint'; the second failing leaves step 1, and --resume continues from it."""
    run_dir = tmp_path / "run"
    argv = ["train", TINY, f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=2"]
    restore = _disk_full_at_save(monkeypatch, failing_call)
    code, err = grpo(capsys, *argv)
    line = one_error_line(err)
    assert code == 2 and "free some space" in line and flag in line, line
    assert ("continue with --resume" in line) == (flag == "--resume")
    restore()
    code, err = grpo(capsys, *argv, flag)  # the hint, run
    assert code == 0, err
    assert (run_dir / "checkpoints" / "step-000002" / "manifest.json").is_file()


# Case 19: a malformed kernels.json that its manifest lists ------------------------------------------------------
def test_a_malformed_kernel_plan_is_measured_again_with_one_warning(tiny_ckpt, tmp_path, capsys):
    """The refusal said 'delete it to measure again', and then the manifest refused the checkpoint for the missing
    file. The plan is only timings: it is measured again, with a warning naming the file."""
    from grpo_engine.checkpoint.verify import write_manifest

    run_dir = tmp_path / "run"
    argv = ["train", TINY, f"model.path={tiny_ckpt}", f"run_dir={run_dir}"]
    assert grpo(capsys, *argv, "schedule.steps=1")[0] == 0
    step1 = run_dir / "checkpoints" / "step-000001"
    (step1 / "kernels.json").write_text(json.dumps({"cpu": "x"}))  # JSON, not a plan this version reads
    write_manifest(step1)  # listed: deleting it would be refused as a missing file
    with pytest.warns(UserWarning, match=re.escape(f"{step1 / 'kernels.json'}: not a kernel plan")):
        code, err = grpo(capsys, *argv, "schedule.steps=2", "--resume")
    assert code == 0, err
    assert "delete it" not in err and (run_dir / "checkpoints" / "step-000002" / "kernels.json").is_file()


# Case 20: run_dir=. ------------------------------------------------------------------------------------------------
def test_run_dir_dot_trains_and_overwrite_there_is_one_line_whose_hint_works(tiny_ckpt, tmp_path, capsys,
                                                                             monkeypatch):
    here = tmp_path / "myrun"
    here.mkdir()
    monkeypatch.chdir(here)
    argv = ["train", TINY, f"model.path={tiny_ckpt}", "schedule.steps=1"]
    assert grpo(capsys, *argv, "run_dir=.")[0] == 0
    code, err = grpo(capsys, *argv, "run_dir=.", "--overwrite")
    line = one_error_line(err)
    assert code == 2 and "empty name" not in line and "run_dir=myrun" in line, line
    assert (here / "checkpoints" / "step-000001").is_dir()  # nothing moved
    monkeypatch.chdir(tmp_path)  # the hint: from its parent, run_dir=myrun
    code, err = grpo(capsys, *argv, "run_dir=myrun", "--overwrite")
    assert code == 0, err
    assert [p.name.split(".prev-")[0] for p in tmp_path.glob("myrun.prev-*")] == ["myrun"]
    assert (here / "checkpoints" / "step-000001").is_dir()
    shutil.rmtree(here)


def test_the_out_of_memory_hint_names_settings_a_config_accepts():
    """Following the out-of-memory hint: every `key=value` it names loads as an override."""
    from grpo_engine.train.update import OOM_KNOBS

    pairs = re.findall(r"([a-z_]+\.[a-z_]+)=([a-z_0-9]+)", OOM_KNOBS)
    assert pairs, OOM_KNOBS
    for key, value in pairs:
        load_config(None, [f"{key}={value}"])
