"""Tiny fp32 checkpoints shared by the rollout tests (written once per session, milliseconds to load)."""

from __future__ import annotations

import pytest
import torch

from grpo_engine.model.loading import load_model, load_tokenizer
from grpo_engine.model.tiny import make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("rollout_tiny"), "qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    return load_model(tiny_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_tok(tiny_dir):
    return load_tokenizer(tiny_dir)


@pytest.fixture(scope="session")
def mixed_prompts(tiny_tok):
    """Three prompts of different lengths (9, 3 and 13 tokens): left padding is exercised."""
    return [tiny_tok.encode(s) for s in ("What is 2", "Hi!", "<|im_start|>user\nSolve x")]


@pytest.fixture(scope="module")
def model64(tiny_dir):
    """The tiny model in float64, one per test module: a module's static decoders (attached to the model) are its
    own."""
    return load_model(tiny_dir, dtype=torch.float64)


@pytest.fixture(scope="module")
def prompts(tiny_tok):
    """Eight prompts of 3 to 13 tokens: rows finish at different steps, so the static decode steps down buckets."""
    return [tiny_tok.encode(s) for s in ("What is 2", "Hi!", "<|im_start|>user\nSolve x", "abc", "Tell me",
                                        "7 * 8 =", "Once upon", "xyz!?")]


@pytest.fixture(autouse=True)
def _fresh_graph_health(monkeypatch):
    """Each test starts with this process's capture checks unrun (a fallback is process-wide: static_decode.HEALTH)."""
    from grpo_engine.rollout import static_decode

    monkeypatch.setattr(static_decode, "HEALTH", static_decode.GraphHealth())


@pytest.fixture
def eager_decoders(monkeypatch):
    """The decoders eager generate() calls make (freed when a call ends, so not in static_decode_stats)."""
    import importlib

    generate_module = importlib.import_module("grpo_engine.rollout.generate")  # the module, not the function
    made = []
    real = generate_module.eager_decoder
    monkeypatch.setattr(generate_module, "eager_decoder", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    return made
