"""End-to-end: `grpo train` on a tiny model (arithmetic, countdown, LoRA); artifacts; exact resume."""

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from grpo_engine.cli import main
from grpo_engine.config import load_config
from grpo_engine.model.loading import load_model
from grpo_engine.model.lora import LoRAConfig, apply_lora, load_adapter
from grpo_engine.train.loop import train

REPO = Path(__file__).resolve().parents[2]
CFG = str(REPO / "configs/tiny_arithmetic.yaml")
HERE = Path(__file__).resolve().parent
VOLATILE = ("time_", "tokens_per_s", "peak_mem")


def _metrics(run_dir):
    return [json.loads(ln) for ln in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def custom_task_config(tmp_path, monkeypatch) -> str:
    """tiny_arithmetic.yaml with a custom task whose reward (reward_fns.even_bytes) varies between random
    completions, so advantages are non-zero. Returns the YAML path."""
    monkeypatch.syspath_prepend(str(HERE))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(8)))
    cfg = yaml.safe_load(Path(CFG).read_text())
    cfg["task"] = {"name": "custom", "options": {"data_path": str(data), "reward_fn": "reward_fns:even_bytes",
                                                 "system_prompt": None, "prefill": ""}}
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
def test_grpo_train_arithmetic_artifacts(tmp_path, tiny_ckpt):
    run_dir = tmp_path / "run"
    assert main(["train", CFG, f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "eval.every=2",
                 "eval.max_examples=3", "eval.max_new_tokens=4"]) == 0
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("reward_mean", "reward_std", "reward_components", "accuracy", "completion_len_mean",
                "truncation_rate", "zero_variance_frac", "semantic_entropy", "entropy", "grad_norm", "lr",
                "gen_tokens_per_s", "time_generate_s", "peak_mem_mib", "clip_frac_low", "ratio_mean"):
        assert key in rows[0], key
    assert set(rows[0]["reward_components"]) == {"answer", "format"}
    assert rows[0]["completion_len_max"] <= 8 and rows[0]["lr"] == 1e-3
    # semantic entropy of G=4 answers lies in [0, log 4]; accuracy is a fraction
    assert all(0.0 <= r["semantic_entropy"] <= math.log(4) + 1e-6 for r in rows)
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    # eval every 2 steps and after the last one, on the fixed subset; greedy 4-token completions
    assert ["eval/accuracy" in r for r in rows] == [False, True, True]
    for r in rows[1:]:
        assert 0.0 <= r["eval/accuracy"] <= 1.0 and 0.0 <= r["eval/format_rate"] <= 1.0
        assert 1.0 <= r["eval/length_mean"] <= 4.0
    assert len((run_dir / "samples.jsonl").read_text().splitlines()) >= 3
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-000002", "step-000003"]  # keep_last=2
    final = run_dir / "checkpoints/step-000003/model"
    hf = AutoModelForCausalLM.from_pretrained(final)
    ours = load_model(final)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    torch.testing.assert_close(hf(ids).logits, ours(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_grpo_train_countdown_artifacts(tmp_path, tiny_ckpt):
    run_dir = tmp_path / "run"
    assert main(["train", str(REPO / "configs/tiny_countdown.yaml"), f"model.path={tiny_ckpt}",
                 f"run_dir={run_dir}"]) == 0
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert set(rows[0]["reward_components"]) == {"answer", "format"}
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["refills"] in (0, 1) for r in rows)
    assert all(0.0 <= r["semantic_entropy"] <= math.log(4) + 1e-6 for r in rows if r["semantic_entropy"] is not None)
    assert (run_dir / "checkpoints/step-000002/model/model.safetensors").is_file()
    assert "countdown" in (run_dir / "checkpoints/step-000002/config.yaml").read_text()


@pytest.mark.slow
def test_exact_resume_bitwise_with_varying_rewards(tmp_path, tiny_ckpt, monkeypatch):
    over = [f"model.path={tiny_ckpt}", "schedule.steps=3", "rollout.max_new_tokens=6", "algorithm.mu=2"]
    custom = custom_task_config(tmp_path, monkeypatch)
    full = load_config(custom, over + [f"run_dir={tmp_path / 'a'}"])
    train(full)
    split = load_config(custom, over + [f"run_dir={tmp_path / 'b'}"])
    assert train(split, stop_after=2).stopped_by == "stop_after"
    assert train(split, resume="latest").stopped_by == "completed"
    strip = lambda rows: [{k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in rows]  # noqa: E731
    a, b = strip(_metrics(tmp_path / "a")), strip(_metrics(tmp_path / "b"))
    assert [r["step"] for r in b] == [1, 2, 3]
    assert a == b
    # the rewards varied, so every step trained on non-zero advantages ...
    assert all(r["reward_std"] > 0 and r["zero_variance_frac"] < 1 and not r["skipped_update"] for r in a)
    # ... and the weights moved: the loss reported is the one of the 2nd pass (mu=2), evaluated after the 1st
    # optimizer step. On the 1st pass the ratio is 1 and the GRPO loss is -mean(A) = 0 (advantages are
    # group-centred); after a step along its gradient the clipped surrogate must have improved: loss < 0.
    assert all(r["loss"] < -1e-4 for r in a), [r["loss"] for r in a]
    assert all(r["ratio_max"] > 1.0 for r in a)
    wa = load_model(tmp_path / "a/checkpoints/step-000003/model").state_dict()
    wb = load_model(tmp_path / "b/checkpoints/step-000003/model").state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_kl_reference_and_lora_checkpoint(tmp_path, tiny_ckpt, monkeypatch, lora):
    """beta > 0: the reference is the initial policy (full: frozen copy; LoRA: adapters disabled)."""
    run_dir = tmp_path / "run"
    over = [f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=2", "algorithm.beta=0.1"]
    if lora:
        over += ["lora.enabled=true", "lora.rank=4", "lora.alpha=8", "optimizer.lr=1e-2"]
    train(load_config(custom_task_config(tmp_path, monkeypatch), over))
    rows = _metrics(run_dir)
    # step 1 trains the initial policy, identical to the reference (LoRA B starts at 0): KL exactly 0;
    # step 2's policy has moved: KL > 0
    assert rows[0]["kl"] == 0.0 and rows[1]["kl"] > 0.0
    ckpt = run_dir / "checkpoints/step-000002"
    if lora:
        assert (ckpt / "adapter/adapter_config.json").is_file()
        model = load_model(tiny_ckpt)
        apply_lora(model, LoRAConfig(enabled=True, rank=4, alpha=8))
        load_adapter(model, ckpt / "adapter")
        merged = AutoModelForCausalLM.from_pretrained(ckpt / "model")  # adapters merged into the base
        ids = torch.tensor([[5, 6, 7, 8, 9]])
        with torch.no_grad():
            torch.testing.assert_close(merged(ids).logits, model.eval()(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_grpo_raises_a_learnable_reward(tmp_path, tiny_ckpt, monkeypatch):
    """The whole loop (sampling, advantages, loss sign, optimizer) must climb a reward it can learn: the
    fraction of even-code-point characters, at most ~0.5 for the random tiny model, rises by > 0.2 in 25 steps."""
    over = [f"model.path={tiny_ckpt}", f"run_dir={tmp_path / 'r'}", "schedule.steps=25", "rollout.prompts_per_step=4",
            "rollout.group_size=8", "rollout.max_new_tokens=8", "optimizer.lr=1e-2", "checkpoint.every=0",
            "logging.samples_every=0"]
    train(load_config(custom_task_config(tmp_path, monkeypatch), over))
    rewards = [r["reward_mean"] for r in _metrics(tmp_path / "r")]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.6, first  # the random model: no more than about half its bytes are even
    assert last > first + 0.2, (first, last)


@pytest.mark.slow
def test_shared_prompt_forward_matches_plain_in_the_loop(tmp_path, tiny_ckpt, monkeypatch):
    """memory.share_prompt_forward on / off: the same first step (mu=2 so old log-probs and a ratio are involved,
    beta > 0 so reference log-probs too), up to fp32 rounding; and the shared path really ran."""
    from grpo_engine.train import forward as update

    calls = []
    real = update.shared_prompt_hidden
    monkeypatch.setattr(update, "shared_prompt_hidden", lambda *a: calls.append(1) or real(*a))
    custom = custom_task_config(tmp_path, monkeypatch)
    over = [f"model.path={tiny_ckpt}", "schedule.steps=1", "rollout.max_new_tokens=6", "algorithm.mu=2",
            "algorithm.beta=0.1", "checkpoint.every=0"]
    rows = {}
    for share in ("true", "false"):
        before = len(calls)
        train(load_config(custom, over + [f"run_dir={tmp_path / share}", f"memory.share_prompt_forward={share}"]))
        assert (len(calls) > before) == (share == "true")
        rows[share] = _metrics(tmp_path / share)[0]
    on, off = rows["true"], rows["false"]
    assert on["reward_mean"] == off["reward_mean"] and on["train_tokens"] == off["train_tokens"]
    for key in ("loss", "grad_norm", "kl", "entropy", "ratio_mean", "ratio_max"):
        assert on[key] == pytest.approx(off[key], rel=1e-4, abs=1e-6), key
    assert off["loss"] < -1e-4 and off["kl"] > 0  # the second pass moved away from the old / reference policy


@pytest.mark.slow
@pytest.mark.parametrize("mu", [1, 2])
def test_mismatch_metrics_and_rollout_correction_in_the_loop(tmp_path, tiny_ckpt, monkeypatch, mu):
    """metrics.jsonl carries the sampler/trainer mismatch of every step. In fp32 on the CPU the sampler's (full,
    temperature-scaled) log-probs and the trainer's agree to float rounding, so TIS with C = 2 caps nothing,
    and the plot draws the mismatch panels."""
    from grpo_engine.plot import plot_run

    run_dir = tmp_path / "r"
    over = [f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=2", "rollout.max_new_tokens=6",
            "rollout.temperature=0.8", "rollout.top_k=5", f"algorithm.mu={mu}", "algorithm.rollout_correction=tis",
            "checkpoint.every=0"]
    train(load_config(custom_task_config(tmp_path, monkeypatch), over))
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert 0 < r["mismatch_mean_abs"] <= r["mismatch_max_abs"] < 1e-4, r
        assert 0 <= r["mismatch_k3"] < 1e-8 and r["rollout_correction_frac"] == 0.0
    assert plot_run(run_dir).stat().st_size > 5000


@pytest.mark.slow
def test_skipping_zero_advantage_rows_trains_the_same_weights(tmp_path, tiny_ckpt, monkeypatch):
    """memory.skip_zero_advantage on / off: the same rewards every step and the same weights after 3 steps (to fp32
    summation order), with fewer rows run when some advantage is exactly 0."""
    custom = custom_task_config(tmp_path, monkeypatch)
    over = [f"model.path={tiny_ckpt}", "schedule.steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "checkpoint.every=3", "logging.samples_every=0"]
    rows, weights = {}, {}
    for skip in ("true", "false"):
        train(load_config(custom, over + [f"run_dir={tmp_path / skip}", f"memory.skip_zero_advantage={skip}"]))
        rows[skip] = _metrics(tmp_path / skip)
        weights[skip] = load_model(tmp_path / skip / "checkpoints/step-000003/model").state_dict()
    assert [r["reward_mean"] for r in rows["true"]] == [r["reward_mean"] for r in rows["false"]]
    assert [r["rows"] for r in rows["false"]] == [16, 16, 16] and sum(r["rows"] for r in rows["true"]) < 48
    for name, w in weights["false"].items():
        err = float((weights["true"][name].double() - w.double()).norm() / w.double().norm().clamp_min(1e-12))
        assert err < 1e-5, (name, err)


@pytest.mark.slow
def test_auto_precision_on_a_cpu_is_chosen_said_stored_and_kept_on_resume(tmp_path, tiny_ckpt, monkeypatch, capsys):
    """memory.precision=auto for a LoRA run where this CPU's bf16 pays (faked: native bf16, products at 0.5x, no
    size floor) holds the base in bf16, says so once with its reason, and stores it; a resume keeps bf16 although
    the CPU now measures bf16 slower (2.0x): the checkpoint's precision, not a new measurement. Full fine-tuning
    is bf16 there too, unless its bf16 weights would be rounded to nearest."""
    from grpo_engine.kernels import cpu, select
    from grpo_engine.plan import precision
    from grpo_engine.plan.resolved import resolve_settings
    from grpo_engine.train import setup

    monkeypatch.setattr(precision, "CPU_BF16_MIN_WEIGHT", 0)
    monkeypatch.setattr(cpu, "native_bf16_isa", lambda: "avx512_bf16")
    monkeypatch.setattr(select, "bf16_ratio", lambda hidden, inter: 0.5)
    built, build = [], setup.build_policy
    monkeypatch.setattr(setup, "build_policy", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    over = [f"model.path={tiny_ckpt}", "schedule.steps=2", "rollout.max_new_tokens=6", "memory.precision=auto",
            "lora.enabled=true", f"run_dir={tmp_path / 'r'}", "checkpoint.every=1", "checkpoint.keep_last=2"]
    cfg = load_config(CFG, over)
    assert train(cfg, stop_after=1).stopped_by == "stop_after"
    said = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("memory.precision")]
    assert said == ["memory.precision bf16 (auto: avx512_bf16 on this CPU; the model's products take 0.50x the fp32 "
                    "time in bf16 (at most 0.8))"]
    stored = yaml.safe_load((tmp_path / "r/checkpoints/step-000001/resolved.yaml").read_text())
    assert stored["machine"]["precision"] == stored["config"]["memory"]["precision"] == "bf16"
    monkeypatch.setattr(select, "bf16_ratio", lambda hidden, inter: 2.0)  # what this CPU would now choose: fp32
    assert train(cfg, resume="latest").stopped_by == "completed"
    step2 = yaml.safe_load((tmp_path / "r/checkpoints/step-000002/resolved.yaml").read_text())
    assert (step2["machine"]["precision"], step2["machine"]["precision_why"]) == ("bf16",
                                                                                 "kept from the checkpoint resumed")
    for policy in built:  # the first run's and the resumed one's: the base in bf16, the adapters in fp32
        dtypes = {n: p.dtype for n, p in policy.model.named_parameters()}
        assert {d for n, d in dtypes.items() if "lora_" not in n} == {torch.bfloat16}
        assert {d for n, d in dtypes.items() if "lora_" in n} == {torch.float32}
    monkeypatch.setattr(select, "bf16_ratio", lambda hidden, inter: 0.5)
    full = [f"model.path={tiny_ckpt}", "memory.precision=auto", f"run_dir={tmp_path / 'f'}"]
    # full fine-tuning: bf16 where it pays and the weights round stochastically from fp32 masters, else fp32
    assert resolve_settings(load_config(CFG, full), torch.device("cpu")).precision == "bf16"
    nearest = load_config(CFG, [*full, "optimizer.bf16_rounding=nearest"])
    assert resolve_settings(nearest, torch.device("cpu")).precision == "fp32"
