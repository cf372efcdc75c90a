"""GPU path: bf16 generation runs (by default the decode in CUDA graphs), and graphs give the eager chunks' greedy
tokens.

Skipped without CUDA; CPU stays the default for the rest of the suite.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_engine.model.loading import load_model
from grpo_engine.rollout import SamplingParams, generate

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_bf16_generate_on_gpu(tiny_dir, mixed_prompts):
    model = load_model(tiny_dir, dtype=torch.bfloat16, device="cuda")
    out = generate(model, mixed_prompts, SamplingParams(n=4, max_new_tokens=16, top_p=0.9), seed=0)
    assert [len(c) for c in out.completion_ids] == [16] * 12
    assert all(math.isfinite(x) and x <= 0 for lp in out.logprobs for x in lp)
    again = generate(model, mixed_prompts, SamplingParams(n=4, max_new_tokens=16, top_p=0.9), seed=0)
    assert again.completion_ids == out.completion_ids


def test_graphs_equal_eager_greedy_on_gpu(tiny_dir, mixed_prompts):
    model = load_model(tiny_dir, dtype=torch.float32, device="cuda")
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, cuda_graphs="off")  # eager chunks
    eager = generate(model, mixed_prompts, params)
    graphs = generate(model, mixed_prompts, SamplingParams(n=2, temperature=0.0, max_new_tokens=12, cuda_graphs="on"))
    assert graphs.completion_ids == eager.completion_ids


def test_gpu_greedy_matches_cpu_greedy(tiny_dir, tiny_model, mixed_prompts):
    model = load_model(tiny_dir, dtype=torch.float32, device="cuda")
    params = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    assert generate(model, mixed_prompts, params).completion_ids == generate(
        tiny_model, mixed_prompts, params
    ).completion_ids
