"""The model keeps its rope inverse frequencies (Transformer.inv_freq): built once per (device, long / short
factors, local theta), the same bits as rope_inv_freq, and the forward's logits unchanged by the keeping."""

import pytest
import torch

from grpo_engine.model import transformer as tf
from grpo_engine.model.config import ModelConfig

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
CONFIGS = {
    "plain": ModelConfig(**SIZES),
    "longrope": ModelConfig(**SIZES, model_type="phi3", rope_scaling={
        "rope_type": "longrope", "original_max_position_embeddings": 8,
        "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 4.0, 5.0]}),
    "local theta": ModelConfig(**SIZES, rope_local_theta=500.0, sliding_window=4,
                               layer_types=("sliding_attention", "full_attention")),
}


def _model(name):
    torch.manual_seed(0)
    return tf.Transformer(CONFIGS[name]).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_frequencies_are_built_once_and_are_rope_inv_freqs(name, monkeypatch):
    model, cfg = _model(name), CONFIGS[name]
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))  # past longrope's 8: long
    with torch.no_grad():
        model(ids)
    built = []
    monkeypatch.setattr(tf, "rope_inv_freq", lambda *a, **k: built.append(a) or pytest.fail("built again"))
    with torch.no_grad():
        model(ids)
        model(ids[:, :4])  # inside longrope's original context: the short factors, kept too
    assert built == []
    monkeypatch.undo()
    cpu = torch.device("cpu")
    assert model.inv_freq(cpu) is model.inv_freq(cpu)
    assert torch.equal(model.inv_freq(cpu), tf.rope_inv_freq(cfg, cpu))
    if name == "longrope":
        assert torch.equal(model.inv_freq(cpu, long=True), tf.rope_inv_freq(cfg, cpu, long=True))
    if name == "local theta":
        want = tf.rope_inv_freq(cfg, cpu, theta=500.0, scaled=False)
        assert torch.equal(model.inv_freq(cpu, local=True), want)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_logits_are_those_of_frequencies_built_per_forward(name, monkeypatch):
    model = _model(name)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        kept = [model(ids), model(ids)]
        monkeypatch.setattr(tf.Transformer, "inv_freq", lambda self, device, long=False, local=False: (
            tf.rope_inv_freq(self.config, device, theta=self.config.rope_local_theta, scaled=False) if local
            else tf.rope_inv_freq(self.config, device, long=long)))
        fresh = model(ids)
    assert all(torch.equal(k, fresh) for k in kept)
