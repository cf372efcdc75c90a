"""An evaluation's larger static decode state is transient (rollout/static_decode.py transient_static_decode): an eval
with more rows than the rollout decodes on a decoder of its own, freed when the evaluation ends; the rollout's state
and its graphs stay, and the next rollout replays them without a capture. On the CPU with the graph backend faked
(fake_graphs.FakeGraphs) for the rollout and the eval; an eager call keeps nothing (static_decode.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from fake_graphs import FakeGraphs

from grpo_engine.eval.in_loop import evaluate_policy
from grpo_engine.model.loading import load_model
from grpo_engine.rollout import SamplingParams, static_decode
from grpo_engine.rollout.generate import generate_static
from grpo_engine.rollout.static_decode import (
    TRANSIENT,
    release_static_decode,
    static_decode_stats,
    static_decoder,
    transient_static_decode,
)


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    """Every decoder made from now on captures with a fake backend (fake_graphs.FakeGraphs)."""
    monkeypatch.setattr(static_decode, "CudaGraphs", lambda device: FakeGraphs())


def test_an_eval_larger_than_the_rollout_is_freed_and_the_rollout_bucket_kept(model64, prompts, fake_cuda_graphs):
    """Rollout: 2 prompts x 2 samples (bucket 4, graphs); eval: 8 prompts x 1 (bucket 8, graphs). After the eval
    the model's decoder is the rollout's own object (4 rows, its graphs), the eval's state is freed, the next
    rollout captures nothing new, and every output equals a run without the scope."""
    release_static_decode(model64)
    rollout = SamplingParams(n=2, temperature=0.8, max_new_tokens=24)
    evaluation = SamplingParams(n=1, temperature=0.0, max_new_tokens=24)
    expected_eval = generate_static(model64, prompts, evaluation, seed=5)  # alone, eagerly: a decoder of its own
    assert static_decode_stats(model64) is None  # an eager call keeps nothing
    kept = static_decoder(model64, 4, 60, 24)
    fake = kept.backend
    first = generate_static(model64, prompts[:2], rollout, seed=3, graphs=True)
    graphs, captures = dict(kept.graphs), fake.captures
    assert graphs and captures >= 1

    with transient_static_decode():
        got_eval = generate_static(model64, prompts, evaluation, seed=5, graphs=True)
        transient = TRANSIENT.decoders[model64]
        assert transient is not kept and transient.state.rows == 8 and kept.state.rows == 4
        freed = weakref.ref(transient.state.k[0])
    del transient
    gc.collect()
    assert got_eval == expected_eval
    assert freed() is None and model64 not in TRANSIENT.decoders  # the eval bucket is gone
    assert static_decoder(model64, 4, 60, 24) is kept and kept.graphs == graphs  # the rollout's kept, graphs too
    assert static_decode_stats(model64)["rows"] == 4
    assert generate_static(model64, prompts[:2], rollout, seed=3, graphs=True) == first
    assert fake.captures == captures  # replayed, not captured again
    release_static_decode(model64)


def test_an_eval_that_fits_the_rollout_uses_the_kept_decoder(model64, prompts, fake_cuda_graphs):
    """Nothing transient when the kept state holds the eval's rows, slots and uniforms."""
    release_static_decode(model64)
    kept = static_decoder(model64, 8, 60, 24)
    with transient_static_decode():
        generate_static(model64, prompts[:3], SamplingParams(n=1, temperature=0.0, max_new_tokens=20), seed=1,
                        graphs=True)
        assert kept.graphs  # the eval ran on the kept decoder's graphs
        assert model64 not in TRANSIENT.decoders
    assert static_decoder(model64, 8, 60, 24) is kept
    release_static_decode(model64)


def test_scopes_nest_and_free_on_an_error(model64):
    release_static_decode(model64)
    with pytest.raises(RuntimeError, match="boom"), transient_static_decode():
        with transient_static_decode():
            static_decoder(model64, 16, 60, 24)
        assert TRANSIENT.decoders[model64].state.rows == 16  # the inner scope's end frees nothing yet
        raise RuntimeError("boom")
    assert TRANSIENT.depth == 0 and model64 not in TRANSIENT.decoders
    assert static_decode_stats(model64) is None  # nothing was kept for the eval's sake


def test_evaluate_policy_decodes_in_a_transient_scope(model64, monkeypatch):
    """The in-loop and the held-out evaluations (train/loop.py evaluate) sample through evaluate_policy."""
    seen = []

    def sample_groups(model, tokenizer, task, examples, params, seed, max_prompt_tokens):
        seen.append((TRANSIENT.depth, static_decode.static_decoder(model, len(examples), 60, 24)))
        raise RuntimeError("sampled")

    release_static_decode(model64)
    with pytest.raises(RuntimeError, match="sampled"):
        evaluate_policy(model64, None, None, [object()] * 32, SamplingParams(n=4), seed=0, max_prompt_tokens=36,
                        sample_groups=sample_groups)
    (depth, decoder), = seen
    assert depth == 1 and decoder.state.rows == 32
    assert model64 not in TRANSIENT.decoders and static_decode_stats(model64) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real graphs and their pool")
def test_on_cuda_the_eval_state_and_its_graphs_pool_are_freed(tiny_dir, prompts):
    """With real graphs: what the eval allocated (its state, its graphs' pool) is no longer allocated after the
    scope, and the rollout's graphs replay without a capture."""
    model = load_model(tiny_dir, dtype=torch.float32, device="cuda")
    rollout = SamplingParams(n=2, temperature=0.8, max_new_tokens=24, cuda_graphs="on")
    evaluation = SamplingParams(n=1, temperature=0.0, max_new_tokens=24, cuda_graphs="on")
    first = generate_static(model, prompts[:2], rollout, seed=3, graphs=True)
    gc.collect()
    torch.cuda.synchronize()
    before, captures = torch.cuda.memory_allocated(), static_decode_stats(model)["captures"]
    with transient_static_decode():
        generate_static(model, prompts, evaluation, seed=5, graphs=True)
        assert TRANSIENT.decoders[model].captures >= 1 and torch.cuda.memory_allocated() > before
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + 2**20
    assert generate_static(model, prompts[:2], rollout, seed=3, graphs=True) == first
    assert static_decode_stats(model)["captures"] == captures
    release_static_decode(model)
