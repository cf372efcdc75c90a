"""The planner for the windowed families: Gemma 3 270M / 1B and Ministral 8B by name (their published parameter
counts), the KV a sliding cache would keep against the full one, and the 262,144-token vocabulary: the chunked
log-prob head and the sampler's temporaries at Gemma 3 270M's head shape within the planner's figures."""

import pytest
import torch
from test_decode_state import LiveBytes

from grpo_engine.model.config import ModelConfig
from grpo_engine.plan import MODEL_SHAPES, PlanInput, kv_cache_bytes, param_counts, plan_memory
from grpo_engine.plan.decode_state import DecodeCall, sampler_step_bytes
from grpo_engine.plan.memory import logprob_bytes
from grpo_engine.plan.suggest import format_plan
from grpo_engine.rollout.static_cache import layer_slots


@pytest.mark.parametrize("name, params", [("gemma3-270m", 268_098_176), ("gemma3-1b", 999_885_952),
                                          ("ministral-8b", 8_019_808_256)])
def test_shapes_count_their_published_parameters(name, params):
    """Gemma 3's four norms per block and q/k norms per head, its tied 262k head; Ministral's untied head."""
    assert param_counts(MODEL_SHAPES[name])[0] == params


def test_sliding_kv_hand_computed():
    """Gemma 3 270M: 18 layers, 15 sliding with a window of 512, one KV head of 256. At 2,304 slots a full cache
    holds 18 x 2,304 slots per row, the decode cache 15 x 528 (the window + CHUNK's 16) + 3 x 2,304; shorter rows
    than that save nothing, and Ministral 8B's window of 32,768 saves nothing at any length the plan runs. The
    plan's line compares the kept static state's (64 rows x 2,305 slots with the scratch) with a full one's."""
    cfg, k = MODEL_SHAPES["gemma3-270m"], PlanInput(prompts_per_step=8, group_size=8, prompt_len=256,
                                                    completion_len=2048, precision="bf16")
    assert sum(layer_slots(cfg, 2304)) == 15 * 528 + 3 * 2304 and sum(layer_slots(cfg, 400)) == 18 * 400
    per_slot = 2 * 1 * 256 * 2  # k and v, one KV head of 256, bf16
    assert kv_cache_bytes(cfg, k, full=True) == 64 * 18 * 2304 * per_slot
    assert kv_cache_bytes(cfg, k) == 64 * (15 * 528 + 3 * 2304) * per_slot
    kept, full = 64 * (15 * 528 + 3 * 2305) * per_slot, 64 * 18 * 2305 * per_slot  # 0.91 and 2.53 GiB
    plan = plan_memory(cfg, k)
    assert plan.decode.state["kv cache"] == kept
    line = next(s for s in format_plan(plan).splitlines() if "sliding window" in s)
    assert "15 of 18 layers see the last 512 positions and keep at most 528 slots a row" in line
    assert f"holds {kept / 2**30:.2f} GiB, a full cache would hold {full / 2**30:.2f} GiB: 1.63 GiB less" in line
    ministral = MODEL_SHAPES["ministral-8b"]
    assert kv_cache_bytes(ministral, k) == kv_cache_bytes(ministral, k, full=True)
    assert "holds every slot" in next(s for s in format_plan(plan_memory(ministral, k)).splitlines()
                                      if "sliding window" in s)
    assert "sliding window" not in format_plan(plan_memory(MODEL_SHAPES["qwen2.5-0.5b"], k))


GEMMA_HEAD = dict(vocab_size=262144, hidden_size=640)  # Gemma 3 270M's head


def test_the_chunked_head_at_a_262k_vocabulary_stays_within_the_plan():
    """A tiny Gemma 3 body under the 270M's head: the final hidden states of 24 tokens, then the chunked log-probs
    with their gradient (the head frozen, as under LoRA): the tensors they create stay within the planner's
    log-prob figure (hidden + three [chunk, V] fp32 buffers) and hold at least one such buffer."""
    from grpo_engine.model.transformer import Transformer
    from grpo_engine.rl.logprobs import token_logprobs

    cfg = ModelConfig(**GEMMA_HEAD, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, tie_word_embeddings=True, model_type="gemma3_text",
                      sliding_window=4, layer_types=("sliding_attention",), rope_local_theta=10_000.0)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (2, 12))
    hidden = model(ids, return_hidden=True).flatten(0, 1).detach().requires_grad_()  # [24, 640] bf16
    weight, targets, chunk = model.lm_head.weight.detach(), ids.flatten(), 8
    with LiveBytes([hidden, weight, targets]) as live:
        logp, _ = token_logprobs(hidden, weight, targets, chunk_size=chunk)
        logp.sum().backward()
    plan = logprob_bytes(cfg, PlanInput(precision="bf16", logprob_chunk=chunk), tokens=24, buffers=3)
    assert chunk * cfg.vocab_size * 4 <= live.peak <= plan, (live.peak, plan)  # at least one [chunk, V] buffer


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (0, 0.95), (64, 0.9)])
def test_the_samplers_temporaries_at_a_262k_vocabulary_stay_within_the_bound(top_k, top_p):
    """Gemma's vocabulary through the sampler (bf16 logits, temperature, the filters): within the planner's bound."""
    from grpo_engine.rollout.sampling import SamplingParams, TokenSampler, work_buffer

    rows, vocab = 4, GEMMA_HEAD["vocab_size"]
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    work = work_buffer(rows, vocab, torch.float32, "cpu")
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3).to(torch.bfloat16)
    uniforms = torch.rand(rows, 1, generator=torch.Generator().manual_seed(1))
    sample = TokenSampler(params, work=work)
    with LiveBytes([logits, work, uniforms]) as live:
        sample(logits, None, uniforms)
    bound = sampler_step_bytes(DecodeCall("rollout", rows, 1, 1, 0.8, top_k, top_p, 0.0), rows, vocab, 2, cuda=False)
    assert 0 < live.peak <= bound, (live.peak, bound)
