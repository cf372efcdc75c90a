"""The static decode on CUDA: its chunks captured as CUDA graphs give the eager chunks' results, read the tokens
back once per CHUNK steps (counted with torch.profiler), and stay valid across in-place weight updates, re-capturing
when what they baked in changes (LoRA merged). rollout.cuda_graphs=on throughout, so a failed capture check fails
the test instead of falling back. Skipped without CUDA; tests/rollout/test_static_decode.py runs the same code
eagerly on the CPU, tests/rollout/test_graph_check.py the capture check with a fake graph backend."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from grpo_engine.model.loading import load_model
from grpo_engine.rollout import SamplingParams, generate
from grpo_engine.rollout.generate import generate_static
from grpo_engine.rollout.static_cache import CHUNK
from grpo_engine.rollout.static_decode import release_static_decode, static_decode_stats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STOPS = [5, 9, 17, *range(100, 112)]


def test_graphs_equal_eager_chunks_and_replay_without_capturing(tiny_dir, mixed_prompts):
    model = load_model(tiny_dir, dtype=torch.float32, device="cuda")
    params = SamplingParams(n=4, temperature=0.9, top_p=0.9, max_new_tokens=40, stop_token_ids=STOPS,
                            cuda_graphs="on")
    eager = generate_static(model, mixed_prompts, params, seed=[1, 2, 3], graphs=False)
    graphed = generate_static(model, mixed_prompts, params, seed=[1, 2, 3], graphs=True)
    assert "stop" in graphed.finish_reason and len({len(c) for c in graphed.completion_ids}) > 2
    assert graphed.completion_ids == eager.completion_ids and graphed.finish_reason == eager.finish_reason
    for a, b in zip(graphed.logprobs + graphed.filtered_logprobs, eager.logprobs + eager.filtered_logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-6, rtol=0)
    stats = static_decode_stats(model)
    assert stats["captures"] >= 2  # the first bucket and at least one smaller one as rows finished
    again = generate(model, mixed_prompts, params, seed=[1, 2, 3])  # auto on CUDA: the same graphs, replayed
    assert again == graphed and static_decode_stats(model)["captures"] == stats["captures"]
    greedy = replace(params, temperature=0.0)
    assert generate(model, mixed_prompts, greedy).completion_ids == generate(
        model, mixed_prompts, replace(greedy, cuda_graphs="off")).completion_ids  # the eager chunks' tokens
    release_static_decode(model)


def test_at_most_one_device_to_host_sync_per_chunk(tiny_dir, mixed_prompts):
    """128 decode steps after the first token: 8 chunks, so at most 8 device-to-host copies, and no more stream
    syncs than those plus the prefill's few host-to-device copies (prompt ids, masks, row indices)."""
    from torch.profiler import ProfilerActivity, profile

    model = load_model(tiny_dir, dtype=torch.bfloat16, device="cuda")
    params = SamplingParams(n=8, max_new_tokens=1 + 8 * CHUNK, cuda_graphs="on")  # bf16: the check's 1e-3
    generate(model, mixed_prompts, params, seed=0)  # captures the graph
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        out = generate(model, mixed_prompts, params, seed=0)
    assert [len(c) for c in out.completion_ids] == [1 + 8 * CHUNK] * 24
    names = [e.name for e in prof.events()]
    device_to_host = [n for n in names if "DtoH" in n or "Device -> Pageable" in n]
    syncs = [n for n in names if n in ("cudaStreamSynchronize", "cudaDeviceSynchronize")]
    assert len(syncs) >= 8, "the profiler saw no syncs: is CUPTI there?"
    assert len(device_to_host) <= 8, device_to_host
    assert len(syncs) <= 8 + 8, syncs  # + the prefill's few pageable host-to-device copies, the profiler's own
    assert static_decode_stats(model)["captures"] == 1
    release_static_decode(model)


def test_graphs_stay_valid_across_optimizer_steps_and_follow_lora_merges(tiny_dir, mixed_prompts):
    """LoRA adapters run inside the graph; an optimizer step writes them in place, so the graphs replay with the
    new weights (same tokens as eager chunks) and nothing is re-captured; merging the adapters (a switch
    the graph baked in) re-captures."""
    from grpo_engine.model.lora import LoRAConfig, apply_lora, lora_merged

    model = apply_lora(load_model(tiny_dir, dtype=torch.float32, device="cuda"), LoRAConfig(rank=4))
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=24, cuda_graphs="on")
    first = generate(model, mixed_prompts, params)
    captures = static_decode_stats(model)["captures"]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)  # the adapters
    ids = torch.tensor([mixed_prompts[2]], device="cuda")
    for _ in range(3):
        model(ids)[0, -1].logsumexp(-1).backward()
        optimizer.step()
        optimizer.zero_grad()
    after = generate(model, mixed_prompts, params)
    assert static_decode_stats(model)["captures"] == captures
    assert after.completion_ids == generate(model, mixed_prompts, replace(params, cuda_graphs="off")).completion_ids
    assert after.completion_ids != first.completion_ids or after.logprobs != first.logprobs
    with lora_merged(model):
        merged = generate(model, mixed_prompts, params)
    assert static_decode_stats(model)["captures"] > captures
    assert merged.completion_ids == after.completion_ids
    release_static_decode(model)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_a_model_on_the_second_gpu_is_captured_there(tiny_dir, mixed_prompts):
    """cuda:0 current, the model on cuda:1: the capture and its replays run on cuda:1 (an empty graph captured on
    cuda:0 would fail the check and raise under `on`); tokens equal the eager chunks'."""
    torch.cuda.set_device(0)
    model = load_model(tiny_dir, dtype=torch.float32, device="cuda:1")
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=40, stop_token_ids=STOPS, cuda_graphs="on")
    out = generate(model, mixed_prompts, params)
    assert static_decode_stats(model)["captures"] >= 1 and static_decode_stats(model)["fallback"] is None
    assert out.completion_ids == generate(model, mixed_prompts, replace(params, cuda_graphs="off")).completion_ids
    release_static_decode(model)
