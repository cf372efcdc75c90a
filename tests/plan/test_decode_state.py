"""The planner's static decode (plan/decode_state.py) against the decoder itself: the state's and the decoder's own
tensors byte for byte per bucket (slot rounding and the union of calls included), the sampler's live temporaries
against the documented bound, and which calls size the kept state in a config's plan."""

import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from grpo_engine.config import load_config
from grpo_engine.model.tiny import tiny_config
from grpo_engine.model.transformer import Transformer
from grpo_engine.plan.decode_state import (
    DecodeCall,
    decode_plan,
    sampler_step_bytes,
    state_bytes,
    state_shape,
)
from grpo_engine.plan.from_config import plan_config
from grpo_engine.plan.memory import plan_memory
from grpo_engine.plan.suggest import format_plan
from grpo_engine.rollout.sampling import SamplingParams, TokenSampler, work_buffer
from grpo_engine.rollout.static_decode import release_static_decode, static_decoder

BYTES = {torch.float32: 4, torch.bfloat16: 2}


def decoder_tensors(decoder) -> dict[str, int]:
    """Bytes of every tensor the decoder holds, named as plan/decode_state.py state_bytes names them; a tensor the
    planner does not know fails the test."""
    state, names = decoder.state, {"key_mask": "key mask", "uniforms": "uniforms", "hist": "hist"}
    found: dict[str, int] = {"step buffers": 0}
    for attr, value in vars(state).items():
        tensors = value if isinstance(value, list) else [value]
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            continue
        nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
        if attr in ("k", "v"):
            found["kv cache"] = found.get("kv cache", 0) + nbytes
        elif attr in ("ids", "positions", "write", "col"):
            found["step buffers"] += nbytes
        else:
            found[names[attr]] = nbytes  # KeyError: a buffer the planner does not count
    found["sampler work"] = decoder.work.untyped_storage().nbytes()
    with torch.inference_mode():  # as decoding runs; the first product makes the head's buffer
        decoder.head(torch.zeros(1, decoder.head.weight.shape[1], dtype=decoder.head.weight.dtype))
    found["logits buffer"] = decoder.head.buf.untyped_storage().nbytes()
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, prompt, new", [(1, 10, 5), (3, 40, 24), (5, 64, 1), (17, 100, 29), (64, 7, 57)])
def test_the_planned_state_is_the_decoders_own_tensors_per_bucket(rows, prompt, new, dtype):
    cfg = tiny_config(vocab_size=1500)  # two sampling blocks, the second one padded
    model = Transformer(cfg).to(dtype)
    decoder = static_decoder(model, rows, prompt + new, new)
    call = DecodeCall("rollout", rows, prompt, new)
    shape = state_shape([call])
    assert (decoder.state.rows, decoder.state.slots, decoder.state.columns) == (shape.rows, shape.slots, new)
    assert decoder_tensors(decoder) == state_bytes(cfg, shape, BYTES[dtype])
    release_static_decode(model)


def test_the_kept_state_is_the_union_of_the_calls():
    """A rollout of 6 rows x 40 slots, then an eval of 20 rows x 30 slots: the decoder keeps 32 rows (the eval's
    bucket) x 64 slots (the rollout's 40 rounded), and the planner plans exactly that."""
    cfg = tiny_config()
    model = Transformer(cfg)
    calls = [DecodeCall("rollout", 6, 30, 10), DecodeCall("eval", 20, 18, 12, temperature=0.0)]
    for c in calls:
        decoder = static_decoder(model, c.rows, c.slots, c.new_tokens)
    shape = state_shape(calls)
    assert (shape.rows, shape.slots, shape.columns) == (32, 64, 12)
    assert decoder_tensors(decoder) == state_bytes(cfg, shape, 4)
    release_static_decode(model)


class LiveBytes(TorchDispatchMode):
    """The peak bytes of tensors that ops create while inside (in-place results and `ignore`d storages, the inputs,
    are not new); a storage counts until it is freed."""

    def __init__(self, ignore: list[torch.Tensor]):
        super().__init__()
        self.seen = {t.untyped_storage().data_ptr() for t in ignore}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, n = storage.data_ptr(), storage.nbytes()
                if key in self.seen or n == 0:
                    continue
                self.seen.add(key)
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self.free, key, n)
        return out

    def free(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)


SAMPLERS = [  # temperature, top_k, top_p, min_p, logits dtype
    (1.0, 0, 1.0, 0.0, torch.float32),  # the head's logits sampled as they are: nothing [R, V] beyond them
    (0.0, 0, 1.0, 0.0, torch.bfloat16),  # greedy
    (0.7, 0, 0.9, 0.0, torch.bfloat16),  # top-p: the sort
    (1.3, 50, 0.9, 0.05, torch.float32),  # every filter
    (1.0, 20, 1.0, 0.1, torch.bfloat16),
]


@pytest.mark.parametrize("temperature, top_k, top_p, min_p, dtype", SAMPLERS)
def test_the_samplers_temporaries_stay_within_the_documented_bound(temperature, top_k, top_p, min_p, dtype):
    """On the CPU (no CUDA sort workspace) the bound is the peak of the sampler's live tensors up to its small
    [R, block] ones: it may not be exceeded, and it may not be loose by more than those."""
    rows, vocab = 16, 5000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    work = work_buffer(rows, vocab, torch.float32, "cpu")
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    uniforms = torch.rand(rows, 1, generator=torch.Generator().manual_seed(1))
    sample = TokenSampler(params, work=work)
    with LiveBytes([logits, work, uniforms]) as live:
        sample(logits, None, uniforms)
    call = DecodeCall("rollout", rows, 1, 1, temperature, top_k, top_p, min_p)
    bound = sampler_step_bytes(call, rows, vocab, BYTES[dtype], cuda=False)
    small = sampler_step_bytes(DecodeCall("x", rows, 1, 1, 1.0), rows, vocab, 4, cuda=False)  # the [R, block] part
    assert bound - small <= live.peak <= bound, (live.peak, bound - small, bound)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the sort's workspace is CUDA's")
@pytest.mark.parametrize("temperature, top_k, top_p, min_p, dtype", SAMPLERS)
def test_the_samplers_cuda_memory_stays_within_the_bound(temperature, top_k, top_p, min_p, dtype):
    rows, vocab = 64, 151936
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    work = work_buffer(rows, vocab, torch.float32, "cuda")
    logits = (torch.randn(rows, vocab, device="cuda") * 3).to(dtype)
    uniforms = torch.rand(rows, 1, device="cuda")
    sample = TokenSampler(params, work=work)
    sample(logits, None, uniforms)  # library handles and workspaces made once, as a graph's warm-up does
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    sample(logits, None, uniforms)
    torch.cuda.synchronize()
    call = DecodeCall("rollout", rows, 1, 1, temperature, top_k, top_p, min_p)
    assert torch.cuda.max_memory_allocated() - base <= sampler_step_bytes(call, rows, vocab, BYTES[dtype])


def test_rows_in_flight_at_one_token_prompts_bounds_every_wave_generate_makes():
    from grpo_engine.rollout.generate import plan_waves, rows_in_flight

    def wave_rows(prompts, samples, new_tokens, budget):  # the planner's bound: a wave of one-token prompts
        return rows_in_flight(prompts, samples, 1 + new_tokens, budget)

    for budget in (0, 700, 2000):
        params = SamplingParams(n=4, max_new_tokens=20, max_tokens_in_flight=budget or None)
        for lengths in ([1] * 30, [5, 90, 7, 3] * 5, [50] * 9):
            most = max(len(w) for w in plan_waves(lengths, params)) * 4
            assert most <= wave_rows(len(lengths), 4, 20, budget)
        assert wave_rows(30, 4, 20, budget) == max(len(w) for w in plan_waves([1] * 30, params)) * 4  # attained


def plan_of(*overrides):
    cfg = load_config(None, ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_prompt_tokens=100",
                             "rollout.max_new_tokens=50", "eval.max_examples=8", *overrides])
    return plan_config(cfg, shape="qwen2.5-0.5b")


def test_the_plan_keeps_the_training_calls_and_plans_a_larger_eval_as_an_eval_phase():
    small = plan_of()  # eval: 8 rows <= the rollout's 16: the kept state runs it
    assert [(c.name, c.rows) for c in small.decode.calls] == [("rollout", 16), ("eval", 8)]
    assert (small.decode.shape.rows, small.decode.shape.slots) == (16, 192)  # 150 slots rounded up to 64s
    assert small.decode.eval_shape is None and small.decode.releasable_after_eval == 0
    assert [p.name for p in small.phases] == ["rollout", "scoring", "training", "optimizer", "eval"]
    ev = small.phase("eval").components  # the kept state runs it: nothing of its own, its 8 prompts' prefill
    assert "eval's decode state (freed after)" not in ev and ev["prefill transients"] > 0
    assert plan_memory(small.model, replace(small.knobs, eval_examples=0)).phases[-1].name == "optimizer"  # none
    large = plan_of("eval.max_examples=100", "eval.every=10", "eval.max_new_tokens=200", "lora.enabled=true")
    d = large.decode
    assert (d.shape.rows, d.shape.slots, d.shape.columns) == (16, 192, 50)  # the rollout's alone
    assert (d.eval_shape.rows, d.eval_shape.slots, d.eval_shape.columns) == (128, 320, 200)
    rollout_only = decode_plan(large.model, d.calls[:1], 2)  # bf16: the planned card has it
    assert d.total == rollout_only.total and d.state == small.decode.state  # LoRA changes no decode state
    eval_only = decode_plan(large.model, [replace(d.calls[1], name="rollout")], 2)  # the eval's own decoder
    assert d.eval_state == eval_only.state and d.releasable_after_eval == eval_only.total
    for phase in ("rollout", "scoring", "training", "optimizer"):  # kept: the rollout's state only
        assert large.phase(phase).components["static decode state (kept)"] == sum(d.state.values())
    ev = large.phase("eval").components
    assert ev["static decode state (kept)"] == sum(d.state.values())  # beside the kept one while it runs
    assert ev["eval's decode state (freed after)"] + ev["eval's graphs' pool (freed after)"] == eval_only.total
    assert large.phase("eval").total > large.phase("rollout").total and large.peak_phase == "eval"
    text = format_plan(large, card_gib=large.total_gib - 0.5)
    assert "static decode state kept: 16 rows x 192 slots" in text
    assert (f"the evaluation's larger call decodes on its own state, 128 rows x 320 slots: "
            f"{d.releasable_after_eval / 2**30:.2f} GiB during eval, freed after it") in text
    assert "evaluate as many examples as the rollout has rows (eval.max_examples = P x G)" in text
    assert "the evaluation's larger call" not in format_plan(plan_of("eval.max_examples=2"))
    curriculum = plan_of("curriculum.mode=semantic_entropy", "curriculum.samples=2")
    assert ("curriculum", 16) in [(c.name, c.rows) for c in curriculum.decode.calls]  # 8 prompts x 2 samples


def test_the_planned_eval_state_is_the_transient_decoders_own_tensors():
    """A rollout of 6 rows x 40 slots kept, then an eval of 20 rows x 30 slots in transient_static_decode: the
    kept decoder stays the rollout's (8 rows x 64 slots), the eval's own is 32 rows x 64 slots, each equal to
    the planner's bytes; after the scope only the rollout's remains."""
    from grpo_engine.rollout.static_decode import TRANSIENT, transient_static_decode

    cfg = tiny_config()
    model = Transformer(cfg)
    rollout, ev = DecodeCall("rollout", 6, 30, 10), DecodeCall("eval", 20, 18, 12, temperature=0.0)
    plan = decode_plan(cfg, [rollout, ev], 4)
    kept = static_decoder(model, rollout.rows, rollout.slots, rollout.new_tokens)
    with transient_static_decode():
        own = static_decoder(model, ev.rows, ev.slots, ev.new_tokens)
        assert own is not kept and TRANSIENT.decoders[model] is own
        assert (own.state.rows, own.state.slots, own.state.columns) == (32, 64, 12) == tuple(vars(plan.eval_shape)
                                                                                            .values())
        assert decoder_tensors(own) == plan.eval_state
    assert (kept.state.rows, kept.state.slots) == (plan.shape.rows, plan.shape.slots) == (8, 64)
    assert decoder_tensors(kept) == plan.state and model not in TRANSIENT.decoders
    assert static_decoder(model, rollout.rows, rollout.slots, rollout.new_tokens) is kept
    release_static_decode(model)


def test_top_p_plans_its_sort():
    """bf16 logits at temperature 1 with top-p: the fp32 copy (4 B an element), then during the sort its outputs
    (12) and CUDA's workspace (28): 44 B = 11 x rows x V x 4 B, where 3 x was planned for any filter."""
    top_p = plan_of("rollout.top_p=0.9")
    rows, vocab = 16, 151936
    small = sampler_step_bytes(DecodeCall("x", rows, 1, 1, 1.0), rows, vocab, 4)
    assert top_p.decode.pool == sampler_step_bytes(top_p.decode.calls[0], rows, vocab, 2) == 44 * rows * vocab + small


def test_fsdp2_plans_no_static_decode_state_under_auto():
    """rollout.cuda_graphs=auto makes no static state for a model with FSDP2 units (graphs_for): the plan counts the
    rollout's KV cache of an eager decode instead, as a run with cuda_graphs=off does."""
    fsdp2 = plan_of("distributed.strategy=fsdp2")
    off = plan_of("rollout.cuda_graphs=off")
    assert fsdp2.decode is None and "static decode state (kept)" not in fsdp2.phase("training").components
    assert fsdp2.phase("rollout").components == off.phase("rollout").components
    assert plan_of().decode is not None and plan_of("distributed.strategy=ddp").decode is not None


def test_a_tool_run_is_planned_with_its_kept_state():
    """With tools the rollout decodes on the kept static state too (CUDA graphs under auto, rollout/generate.py
    choose_loop): the plan counts its P x G rows x (prompt + tools.max_tokens) slots and tools.max_tokens uniforms
    (the decoder's rows x (longest prompt + budget), rollout/generate.py _decode_waves), kept through training; the
    evaluation's trajectories run at the same budget."""
    tools = plan_of("tools.enabled=true", "tools.max_tokens=300")
    assert [(c.name, c.rows, c.prompt_len, c.new_tokens) for c in tools.decode.calls] == [
        ("rollout", 16, 100, 300), ("eval", 8, 100, 300)]
    shape = tools.decode.shape
    assert (shape.rows, shape.slots, shape.columns) == (16, 448, 300)  # 400 slots rounded up to 64s
    assert "static decode state (kept)" in tools.phase("training").components
    assert plan_of("tools.enabled=true", "rollout.cuda_graphs=off").decode is None
