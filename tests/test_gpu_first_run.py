"""benchmarks/gpu_first_run.sh without a GPU: its dry run prints every step, runs the CPU-runnable ones and leaves
its JSON report; a full run with every GPU step stood in by a fake interpreter (canned outputs, one failing test)
leaves the report the GPU run will: the CUDA tests' counts, gpu_check's figures, the preset step's training
tokens/s, step time and peak against the plan, and a failing step recorded without stopping the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_first_run.sh"


def run(tmp_path: Path, *args: str, python: str = sys.executable, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                                      dict]:
    out = tmp_path / "measurements"
    proc = subprocess.run(["bash", str(SCRIPT), *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHON": python, "TMPDIR": str(tmp_path), **env})
    reports = sorted(out.glob("gpu_first_run_*.json"))
    assert proc.returncode == 0 and len(reports) == 1, proc.stdout + proc.stderr
    return proc, json.loads(reports[0].read_text())


def test_the_dry_run_prints_every_step_and_runs_the_cpu_ones(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "omegaconf-2.3.0-py3-none-any.whl").write_bytes(b"")
    proc, report = run(tmp_path, "--dry-run", GRPO_WHEELS=str(wheels))
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["imports", "gpu", "cuda_tests", "gpu_check_plan", "preset_step_plan", "attention_forms",
                           "gpu_check", "preset_step"]
    for name in ("cuda_tests", "attention_forms", "gpu_check", "preset_step"):
        assert steps[name]["exit"] == "not run (--dry-run: needs a GPU)" and f"== {name} (at most" in proc.stdout
    for name in ("imports", "gpu", "gpu_check_plan", "preset_step_plan"):
        assert steps[name]["exit"] == 0, steps[name]
    assert "--sections parity,speed --speed-shapes qwen2.5-1.5b" in steps["gpu_check"]["command"]
    assert "--presets configs/gpu12gb_qwen2.5-1.5b_lora.yaml" in steps["preset_step"]["command"]
    assert '"estimated_total_minutes"' in proc.stdout  # gpu_check's own plans were printed
    assert report["dry_run"] and report["wheels"] == f"--dry-run: would install 1 wheels from {wheels}"
    assert report["cuda_tests"] is None and report["preset_step"] is None and len(report["commit"]) == 40


FAKE_PYTHON = r'''#!/usr/bin/env bash
# stands in for the GPU steps: canned outputs where a GPU would write them, the real interpreter for the rest
args="$*"
out=$(printf '%s\n' "$@" | grep -A1 -x -- --out | tail -n 1)
if [[ "$args" == *"-m pytest"* ]]; then
  xml=$(printf '%s\n' "$@" | grep -- --junitxml= | cut -d= -f2)
  cat > "$xml" <<'XML'
<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0"><testcase classname="tests.a" name="ok"/>
<testcase classname="tests.model.test_x" name="test_y"><failure message="boom"/></testcase>
<testcase classname="tests.b" name="ok2"/></testsuite></testsuites>
XML
  echo "1 failed, 2 passed"; exit 1
elif [[ "$args" == *"training_attention_forms.py"* ]]; then
  echo '{"grouped_sdpa": {"ms": 1.0, "peak_mib": 10.0}}' > "$(printf '%s
' "$@" | tail -n 1)"
elif [[ "$args" == *"--sections memory"* && "$args" != *"--dry-run"* ]]; then
  mkdir -p "$out"; cat > "$out/gpu_check.json" <<'JSON'
{"memory": [{"config": "configs/gpu12gb_qwen2.5-1.5b_lora.yaml", "sec_per_step": 40.0, "time_generate_s": 20.0,
 "time_logprobs_s": 5.0, "time_update_s": 12.5, "train_tokens": 25000, "max_reserved_gib": 9.0,
 "max_allocated_gib": 8.0, "plan_total_gib": 8.84, "plan_peak_phase": "training", "update_mfu": 0.3,
 "peaks": {"training": {"allocated_gib": 8.0, "reserved_gib": 9.0}}, "plan_phases_gib": {"training": 8.1}}]}
JSON
elif [[ "$args" == *"--sections parity,speed"* && "$args" != *"--dry-run"* ]]; then
  mkdir -p "$out"; echo '{"weights": {"random_weights_in": ["memory", "parity", "speed"]}, "speed": {"runs": []}}' \
    > "$out/gpu_check.json"
else
  exec "$REAL_PYTHON" "$@"
fi
'''


def test_a_full_run_reports_each_steps_figures_and_goes_on_after_a_failure(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    proc, report = run(tmp_path, python=str(fake), REAL_PYTHON=sys.executable)
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["imports", "gpu", "cuda_tests", "attention_forms", "gpu_check", "preset_step"]
    assert steps["cuda_tests"]["exit"] == 1 and steps["gpu_check"]["exit"] == 0 and steps["preset_step"]["exit"] == 0
    assert report["cuda_tests"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 0,
                                    "failed": ["tests.model.test_x::test_y"]}
    assert report["gpu_check"]["weights"]["random_weights_in"] == ["memory", "parity", "speed"]
    assert report["training_attention_forms"] == {"grouped_sdpa": {"ms": 1.0, "peak_mib": 10.0}}
    step = report["preset_step"]
    assert step["train_tokens_per_s"] == 2000.0 and step["seconds_per_step"] == 40.0
    assert step["reserved_over_planned"] == 9.0 / 8.84 and step["planned_gib"] == 8.84
    assert "40.0 s/step, 2000 training tokens/s, peak reserved 9.00 GiB vs planned 8.84 GiB" in proc.stdout
    assert not report["dry_run"]


def test_the_three_training_attention_forms_compute_the_same(tmp_path):
    """benchmarks/training_attention_forms.py times three forms of one function: on CPU tensors they agree (float64,
    a left-padded causal mask); without CUDA the script writes that it skipped."""
    import torch
    from benchmark_scripts import load_benchmark

    from grpo_engine.model.transformer import cuda_attention_bias, grouped_sdpa

    forms = load_benchmark("training_attention_forms")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 10, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 10, 8, generator=g, dtype=torch.float64) for _ in range(2))
    real = torch.arange(10)[None, :] >= torch.tensor([[0], [3]])
    mask = ((torch.ones(10, 10, dtype=torch.bool).tril() & real[:, None, :]) | torch.eye(10, dtype=torch.bool))[:, None]
    plain, stacked = cuda_attention_bias(mask, torch.float64), cuda_attention_bias(mask, torch.float64, groups=3)
    want = grouped_sdpa(q, k, v, stacked)
    for form in (forms.repeat_kv, forms.enable_gqa):
        torch.testing.assert_close(form(q, k, v, plain), want, rtol=0, atol=1e-12)
    if not torch.cuda.is_available():
        forms.main(["--out", str(tmp_path / "forms.json")])
        assert json.loads((tmp_path / "forms.json").read_text()) == {"skipped": "no CUDA device"}
