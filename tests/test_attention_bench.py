"""benchmarks/attention_kernels.py: each size times both kernels' forward and backward, in milliseconds."""

from types import SimpleNamespace

import torch
from benchmark_scripts import load_benchmark


def test_each_size_times_both_kernels_forward_and_backward():
    bench = load_benchmark("attention_kernels")
    args = SimpleNamespace(heads=4, kv_heads=2, head_dim=8, repeats=1)
    times = bench.time_size(args, 2, 3, 5, torch.float32)
    assert set(times) == {f"{k} {p}" for k in ("sdpa", "grouped") for p in ("forward", "backward")}
    assert all(0 < t < 10 for t in times.values())  # seconds: a tiny problem
