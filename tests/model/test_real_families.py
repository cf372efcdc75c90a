"""The family parity tests on real checkpoints: every Hugging Face directory under $GRPO_TEST_MODELS (e.g. local
copies of SmolLM3-3B, granite-3.3-2b-instruct, OLMo-2-0425-1B, Phi-4-mini-instruct) against transformers.

No real checkpoint of these families is reachable from the machines the suite runs on here, so the test is
skipped unless GRPO_TEST_MODELS names a folder holding such directories (one per model, each with config.json,
safetensors and tokenizer files):  GRPO_TEST_MODELS=/models pytest tests/model/test_real_families.py
"""

import json
import os
from pathlib import Path

import pytest
import torch

from grpo_engine import load_model, load_tokenizer

ROOT = os.environ.get("GRPO_TEST_MODELS")
MODELS = sorted(p for p in Path(ROOT).iterdir() if (p / "config.json").is_file()) if ROOT else []
pytestmark = pytest.mark.skipif(not MODELS, reason="set GRPO_TEST_MODELS to a folder of local HF checkpoints")
transformers = pytest.importorskip("transformers")


def _ids(path: Path) -> torch.Tensor:
    tok = load_tokenizer(path)
    text = "Solve: a train leaves at 3 pm going 60 km/h; how far has it gone by 5:30 pm? Think step by step."
    chat = [{"role": "user", "content": text}]
    return torch.tensor([tok.encode(tok.apply_chat_template(chat) if tok.chat_template_source else text)])


@pytest.mark.parametrize("path", MODELS, ids=[p.name for p in MODELS])
def test_real_checkpoint_logits_and_greedy_tokens_match_transformers(path):
    """fp32 logits within 1e-3 of transformers' (a real model's logits reach tens: 1e-5 relative) and 24 greedy
    tokens identical."""
    from grpo_engine.rollout.generate import generate
    from grpo_engine.rollout.sampling import SamplingParams

    assert json.loads((path / "config.json").read_text())["model_type"]
    ours = load_model(path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = _ids(path)[:, : ours.config.max_position_embeddings - 24]
    with torch.no_grad():
        want = theirs(ids).logits
        assert (ours(ids) - want).abs().max().item() < 1e-3 * max(1.0, want.abs().max().item() / 10)
    ref = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, ids.shape[1]:].tolist()
    got = generate(ours, ids.tolist(), SamplingParams(temperature=0.0, max_new_tokens=24)).completion_ids[0]
    assert got == ref
