"""benchmarks/gpu_check.py without a GPU: its arguments, its plan (--dry-run), the speed section's report
(ours_training against the faster transformers engine) and the whole speed section at a toy shape on the CPU."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from benchmark_scripts import BENCHMARKS


@pytest.fixture(scope="module")
def gpu_check():
    """benchmarks/gpu_check.py as a module, registered while the tests run (its dataclasses look themselves up)."""
    spec = importlib.util.spec_from_file_location("gpu_check", BENCHMARKS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("gpu_check", None)


def test_arguments_and_the_dry_run_plan(gpu_check, tmp_path, capsys):
    args = gpu_check.parse_args(["--out", str(tmp_path)])
    default = ["ours_training", "ours_training_stops", "ours_training_top_p", "hf_dynamic", "hf_static"]
    assert args.sections == ["parity", "memory", "speed"] and args.engines == default
    plan = gpu_check.run_plan(args)
    assert plan["speed_size"] == "16 prompts x 8 x 512 new tokens"
    assert plan["speed_engines"] == {s: default for s in ("qwen2.5-0.5b", "qwen2.5-1.5b")}
    assert 8 <= plan["estimated_total_minutes"] <= 11
    gpu_check.main(["--out", str(tmp_path / "dry"), "--sections", "speed", "--engines", "all", "--dry-run"])
    printed = json.loads(capsys.readouterr().out)
    assert printed["sections"] == ["speed"] and len(printed["speed_engines"]["qwen2.5-1.5b"]) == 6  # ours_eager too
    assert not (tmp_path / "dry").exists()  # a dry run runs and writes nothing
    for bad in (["--sections", "speeed"], ["--engines", "vllm"], ["--speed-shapes", "qwen9"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(["--out", str(tmp_path), *bad])


def test_speed_targets_and_their_table(gpu_check):
    runs = [
        {"shape": "a", "engine": "ours_training", "tokens_per_s": 32000.0, "seconds": 2.0, "first_call_seconds": 5.0,
         "capture_seconds": 2.5},
        {"shape": "a", "engine": "hf_dynamic", "tokens_per_s": 1500.0, "seconds": 40.0},
        {"shape": "a", "engine": "hf_static", "tokens_per_s": 2000.0, "seconds": 30.0},
        {"shape": "b", "engine": "ours_training", "tokens_per_s": 9000.0, "seconds": 7.0, "first_call_seconds": 9.0,
         "capture_seconds": 1.0},
        {"shape": "b", "engine": "hf_dynamic", "tokens_per_s": 1000.0, "seconds": 60.0},
        {"shape": "c", "engine": "hf_dynamic", "error": "RuntimeError: boom"},
    ]
    targets = gpu_check.speed_targets(runs)
    assert [(t["shape"], t["ratio"], t["met"]) for t in targets] == [("a", 16.0, True), ("b", 9.0, False)]
    md = gpu_check.markdown({"gpu": "x", "torch": "y", "date": "z",
                             "speed": {"copy_bandwidth_gb_s": 3000.0, "runs": runs, "targets": targets}})
    assert "| a | ours_training | 32000 | 2.0 (first call 5.0 s, capture 2.5 s) |" in md
    assert "| a | 32000 | 2000 | 16.0x | 15x: met |" in md and "| b | 9000 | 1000 | 9.0x | 15x: MISSED |" in md


def test_speed_section_runs_at_a_toy_shape_on_the_cpu(gpu_check, tmp_path, monkeypatch):
    """--smoke: every engine's code path at toy sizes (ours_training takes the CPU default, eager chunks)."""
    monkeypatch.setattr(gpu_check, "CACHE", tmp_path)
    sizes = gpu_check.SMOKE
    result = gpu_check.speed(True, sizes, ["qwen2.5-0.5b"], ["qwen2.5-0.5b"], ["ours_training", "hf_dynamic"])
    runs = {r["engine"]: r for r in result["runs"]}
    assert "error" not in runs["ours_training"], runs["ours_training"]
    ours = runs["ours_training"]
    assert ours["new_tokens"] == sizes.speed_prompts * sizes.group * sizes.completion and ours["tokens_per_s"] > 0
    assert ours["cuda_graphs"] == "auto" and ours["static_decode"] is False and ours["capture_seconds"] == 0.0
    assert [t["shape"] for t in result["targets"]] == ["qwen2.5-0.5b"] or "skipped" in runs["hf_dynamic"]
    if not gpu_check.transformers_installed():
        assert runs["hf_dynamic"] == {"shape": "qwen2.5-0.5b", "engine": "hf_dynamic",
                                      "skipped": "transformers not installed"}


def test_a_failing_section_leaves_the_header_its_error_and_the_later_sections(gpu_check, tmp_path, monkeypatch):
    """The header is on disk before any section runs; a section that raises records one line, the next one runs."""
    monkeypatch.setattr(gpu_check, "CACHE", tmp_path / "cache")
    out = tmp_path / "out"
    seen = {}

    def failing_parity(report, smoke, sizes):
        seen["header"] = json.loads((out / "gpu_check.json").read_text())  # already written
        report.data["parity"] = {"shape": "x", "logits": {"fp32": {"error": "x"}}}
        raise RuntimeError("capture failed\n  on this driver")

    monkeypatch.setattr(gpu_check, "parity", failing_parity)
    gpu_check.main(["--out", str(out), "--sections", "parity,speed", "--smoke", "--engines", "ours_training"])
    assert {"gpu", "torch", "cuda", "driver", "commit", "date"} <= set(seen["header"])
    assert "parity" not in seen["header"] and seen["header"]["torch"] == gpu_check.torch.__version__
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["parity"]["error"] == "RuntimeError: capture failed on this driver"  # one line
    assert report["parity"]["shape"] == "x"  # what it measured before failing stays
    assert re.fullmatch("[0-9a-f]{40}", report["commit"])  # git rev-parse HEAD (others may commit meanwhile)
    ours = report["speed"]["runs"][0]
    assert ours["engine"] == "ours_training" and ours["tokens_per_s"] > 0  # the later section ran
    assert set(report["seconds"]) == {"parity", "speed"}
    assert "error: RuntimeError: capture failed on this driver" in (out / "gpu_check.md").read_text()


def test_a_failing_measurement_records_its_error_and_the_section_goes_on(gpu_check, tmp_path, monkeypatch):
    """The parity section at a toy shape on the CPU, transformers hidden: our bf16 forward fails (injected), its rows
    say so and the rest is measured; the transformers rows are skipped; rollout.cuda_graphs=on is skipped without
    CUDA; the LoRA case (non-zero B) is measured, with the adapters' effect beside it."""
    monkeypatch.setattr(gpu_check, "CACHE", tmp_path / "cache")
    real = gpu_check.our_logits

    def our_logits(path, device, dtype, prompts):
        if dtype == gpu_check.torch.bfloat16:
            raise MemoryError("injected")
        return real(path, device, dtype, prompts)

    monkeypatch.setattr(gpu_check, "our_logits", our_logits)
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed: importing it raises
    report = gpu_check.Report(tmp_path, {"gpu": "cpu", "torch": "t", "date": "d"})
    gpu_check.parity(report, True, gpu_check.SMOKE)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    logits = saved["parity"]["logits"]
    assert logits["ours_bf16_vs_fp32"] == {"error": "MemoryError: injected"} and logits["logit_std_fp32"] > 0
    assert logits["hf_bf16_vs_fp32"] == {"skipped": "transformers not installed"}
    assert logits["ours_bf16_vs_hf_bf16"] == {"error": "MemoryError: injected"}  # the first of its two that failed
    rows = {(m["dtype"], m["cuda_graphs"], m["lora"]): m for m in saved["parity"]["mismatch"]}
    assert len(rows) == 6
    cuda = gpu_check.torch.cuda.is_available()
    for key, m in rows.items():
        if key[1] == "on" and not cuda:
            assert m["skipped"] == "rollout.cuda_graphs=on needs CUDA"
        else:
            assert "error" not in m, m
            assert m["tokens"] == gpu_check.SMOKE.prompts * gpu_check.SMOKE.group * gpu_check.SMOKE.completion
    assert rows[("fp32", "off", False)]["mean_abs"] < 1e-4  # fp32 sampler and trainer agree to rounding
    assert rows[("bf16", "off", True)]["adapter_effect_mean_abs"] > 0  # B is non-zero: the adapters act
    assert "| bf16 | off | yes |" in (tmp_path / "gpu_check.md").read_text()


def test_parity_and_mismatch_run_the_trainers_kernels(gpu_check, tmp_path, monkeypatch):
    """The logits and the mismatch decode with the kernel plan the trainer applies (build_policy: LoRA first, then
    apply_kernels), so on CUDA a decode step runs the grouped decode attention, not SDPA."""
    import grpo_engine.kernels as kernels
    from grpo_engine.bench.generate import bench_prompts
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.model.lora import lora_modules

    monkeypatch.setattr(gpu_check, "CACHE", tmp_path / "cache")
    applied, real = [], kernels.apply_kernels

    def apply_kernels(model, plan=None):
        applied.append(sum(1 for _ in lora_modules(model)))
        return real(model, plan)

    monkeypatch.setattr(kernels, "apply_kernels", apply_kernels)
    path = gpu_check.checkpoint("qwen2.5-0.5b", True)
    prompts = bench_prompts(load_tokenizer(path), gpu_check.SMOKE.prompts)
    model, _ = gpu_check.trainer_model(path, gpu_check.torch.float32, "cpu")
    planned = kernels.planned_kernels(kernels.choose_plan(model), model)
    assert applied == [0] and model.kernels.decode_attention == planned.decode_attention
    assert model.kernels.gemm.gemm == planned.gemm.gemm  # the same GEMM choices
    gpu_check.our_logits(path, "cpu", gpu_check.torch.float32, prompts)
    lora = gpu_check.MismatchCase("fp32", "off", lora=True)
    result = gpu_check.rollout_mismatch(path, "cpu", prompts, gpu_check.SMOKE, lora)
    assert applied[1] == 0 and applied[2] > 0  # the adapters are in place before the kernels, as in training
    assert result["mean_abs"] < 1e-4 and result["adapter_effect_mean_abs"] > 0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the report of a machine without CUDA")
def test_without_cuda_it_exits_cleanly_with_a_report_saying_so(gpu_check, tmp_path, capsys):
    gpu_check.main(["--out", str(tmp_path), "--sections", "parity,speed"])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["error"].startswith("no CUDA device") and "parity" not in report and report["gpu"] == "cpu"
    assert "no CUDA device" in capsys.readouterr().out


def test_the_step_sections_mfu_and_summary_by_hand(gpu_check):
    """update_mfu counts 4 N T + 2 N_trainable T + 6 L^2 d per row and layer over the update's seconds at the bf16
    peak; the `step` entry is keyed by preset file name and skips presets that failed."""
    from types import SimpleNamespace

    plan = SimpleNamespace(model=SimpleNamespace(num_hidden_layers=2, hidden_size=8), n_params=1000, n_trainable=10)
    m = SimpleNamespace(rows=4, train_tokens=40, time_update_s=2.0)
    sizes = gpu_check.Sizes(prompts=2, group=2, completion=10, prompt_len=5)
    out = gpu_check.update_mfu(plan, m, sizes)
    tokens = 40 + 2 * 5  # completions, and each of the 2 groups' prompt once
    flops = 4 * 1000 * tokens + 2 * 10 * tokens + 6 * 2 * 8 * 4 * (5 + 10) ** 2
    assert out == {"update_tokens": tokens, "update_flops": flops, "update_mfu": flops / 2.0 / 989e12}
    ok = {"config": "configs/gpu8gb_x.yaml", "sec_per_step": 3.0, "time_generate_s": 1.0, "time_logprobs_s": 0.5,
          "time_update_s": 1.5, "update_mfu": 0.2, "max_reserved_gib": 4.0, "plan_total_gib": 4.5}
    summary = gpu_check.step_summary([ok, {"config": "configs/bad.yaml", "error": "oom"}])
    assert summary == {"gpu8gb_x.yaml": {"seconds_per_step": 3.0, "generate_s": 1.0, "logprobs_s": 0.5,
                                         "update_s": 1.5, "update_mfu": 0.2, "peak_reserved_gib": 4.0,
                                         "planned_gib": 4.5}}


def test_random_checkpoints_have_peaked_logits_and_the_report_says_which_weights(gpu_check, tmp_path, monkeypatch):
    """The random checkpoint is the same draw with the final norm's weight x LOGIT_SCALE and q / k projections x
    QK_SCALE (powers of two: exact in bf16), everything else untouched; the weights entry names what is random."""
    import torch
    from safetensors.torch import load_file

    from grpo_engine.model.tiny import make_tiny_checkpoint

    monkeypatch.setattr(gpu_check, "CACHE", tmp_path / "cache")
    path = gpu_check.checkpoint("qwen2.5-0.5b", True)
    plain = make_tiny_checkpoint(tmp_path / "plain", "qwen2", tie_word_embeddings=True, attention_bias=True,
                                 max_position_embeddings=32768, dtype=torch.bfloat16, **gpu_check.SMOKE_SHAPE)
    scaled, drawn = load_file(path / "model.safetensors"), load_file(plain / "model.safetensors")
    factors = {}
    for name, t in drawn.items():
        ratio = scaled[name].float() / t.float().where(t != 0, torch.ones_like(t.float()))
        factors[name] = ratio[t != 0].unique().tolist()
    assert factors["model.norm.weight"] == [gpu_check.LOGIT_SCALE]
    assert factors["model.layers.0.self_attn.q_proj.weight"] == [gpu_check.QK_SCALE]
    assert factors["model.layers.1.self_attn.k_proj.bias"] in ([gpu_check.QK_SCALE], [])
    assert factors["model.layers.0.self_attn.v_proj.weight"] == [1.0] and factors["model.embed_tokens.weight"] == [1.0]
    assert gpu_check.weights_note()["random_weights_in"] == ["memory", "parity", "speed"]
    monkeypatch.setattr(gpu_check, "MODEL", tmp_path / "real")
    assert gpu_check.checkpoint("qwen2.5-0.5b", True) == tmp_path / "real"
    assert gpu_check.checkpoint("qwen2.5-0.5b", True, real=False) == path  # the memory presets stay random
    assert gpu_check.weights_note()["random_weights_in"] == ["memory"]


@pytest.fixture
def graphs_on_the_cpu(monkeypatch):
    """ours_training's static decode on the CPU with the graph backend faked (tests/rollout/fake_graphs.py), as if
    on CUDA; `fault` sets what the fake does."""
    import importlib

    sys.path.insert(0, str(BENCHMARKS.parent / "tests" / "rollout"))
    from fake_graphs import FakeGraphs

    from grpo_engine.rollout import static_decode

    generate_module = importlib.import_module("grpo_engine.rollout.generate")
    monkeypatch.setattr(generate_module, "graphs_for", lambda model, choice: choice != "off")
    resolved_module = importlib.import_module("grpo_engine.plan.resolved")  # Resolved: as if on CUDA too
    monkeypatch.setattr(resolved_module, "cuda_graphs_on", lambda choice, device: choice != "off")
    monkeypatch.setattr(static_decode, "HEALTH", static_decode.GraphHealth())
    faults = {"fault": None}
    monkeypatch.setattr(static_decode, "CudaGraphs", lambda device: FakeGraphs(fault=faults["fault"]))
    yield faults
    sys.path.remove(str(BENCHMARKS.parent / "tests" / "rollout"))


def test_speed_rows_record_graphs_buckets_windows_and_fallbacks(gpu_check, tmp_path, monkeypatch, graphs_on_the_cpu):
    """At a toy shape on the CPU with faked graphs: the stops row stops rows early (mean length under the cap) and
    runs several buckets; the top-p row samples with top-p 0.9; each records its timed call's graphs, buckets,
    windows and bytes read; an out-of-memory capture is recorded with its bucket, the row still measured."""
    monkeypatch.setattr(gpu_check, "CACHE", tmp_path)
    sizes = gpu_check.Sizes(prompts=2, group=2, completion=40, prompt_len=40, speed_prompts=4)
    result = gpu_check.speed(True, sizes, ["qwen2.5-0.5b"], [], ["ours_training", "ours_training_stops",
                                                                 "ours_training_top_p"])
    runs = {r["engine"]: r for r in result["runs"]}
    plain, stops, top_p = runs["ours_training"], runs["ours_training_stops"], runs["ours_training_top_p"]
    for r in (plain, stops, top_p):
        assert "error" not in r, r
        assert r["graph_fallback"] is None and r["out_of_memory_buckets"] == {} and r["read_gb"] > 0
    assert plain["graphs_captured"] == 0 and plain["graphs_held"] >= 1  # captured in the first call, replayed
    assert plain["buckets_run"] == [8] and plain["mean_new_tokens"] == 40 and "fraction_of_hbm_bound" in plain
    assert plain["decode_steps"] == 48 and plain["windows_run"]  # 39 steps after the prefill's: 3 chunks
    assert stops["stop_tokens"] and stops["mean_new_tokens"] <= 20 and len(stops["buckets_run"]) > 1
    assert "fraction_of_hbm_bound" not in stops  # rows of other lengths: only the bytes the decode read
    assert top_p["top_p"] == 0.9 and plain["top_p"] == 1.0
    md = gpu_check.markdown({"gpu": "x", "torch": "y", "date": "z", "speed": result})
    assert "| qwen2.5-0.5b | ours_training_stops |" in md and "| none | none |" in md
    graphs_on_the_cpu["fault"] = "oom_capture"
    oom = gpu_check.speed(True, sizes, ["qwen2.5-0.5b"], [], ["ours_training"])["runs"][0]
    assert oom["out_of_memory_buckets"] == {8: "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB"}
    assert oom["graph_fallback"] is None and oom["tokens_per_s"] > 0 and oom["eager_from_bucket"] == 8
