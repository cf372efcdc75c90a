"""`grpo bench generate` runs end to end on a tiny checkpoint and prints one JSON line with tokens_per_s."""

from __future__ import annotations

import json

from grpo_engine.cli import main
from grpo_engine.kernels import cpu_model


def test_bench_generate_json_line(tiny_dir, capsys):
    main(["bench", "generate", "--model", str(tiny_dir), "--prompts", "2", "--group", "2", "--max-new", "5",
          "--ignore-eos", "--json", "--device", "cpu"])
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    result = json.loads(line)
    assert result["tokens_per_s"] > 0 and result["new_tokens"] == 2 * 2 * 5
    assert result["cpu"] == cpu_model()  # recorded figures name the CPU they were measured on
    assert result["cuda_graphs"] is False and result["cuda_graphs_fallback"] is None  # the CPU decodes eagerly


def test_bench_reports_a_capture_check_fallback_as_no_graphs():
    """After a failed capture check `auto` decodes eagerly: the benchmark says graphs did not run, and why."""
    from grpo_engine.bench.generate import graphs_report

    cause = "the replayed chunk's tokens differ from the eager chunk's"
    assert graphs_report(True, {"fallback": cause, "capture_seconds": 0.5}) == {
        "cuda_graphs": False, "cuda_graphs_fallback": cause, "capture_seconds": 0.5}
    assert graphs_report(True, {"fallback": None, "capture_seconds": 0.5})["cuda_graphs"] is True
    assert graphs_report(False, None) == {"cuda_graphs": False, "cuda_graphs_fallback": None, "capture_seconds": 0.0}


def test_decode_overhead_benchmark_times_every_projection(tiny_dir):
    """benchmarks/decode_overhead.py: the GEMMs it times alone are every block projection of the model (7 a
    layer)."""
    from benchmark_scripts import load_benchmark

    bench = load_benchmark("decode_overhead")
    r = bench.measure(str(tiny_dir), rows=3, slots=5, reps=2)
    assert r["linears"] == 7 * 2 and 0 <= r["packed_linears"] <= r["linears"]  # the tiny model: 2 layers
    assert r["step_ms"] > 0 and r["gemms_ms"] > 0 and r["head_ms"] > 0
    assert r["cpu"] == cpu_model()
