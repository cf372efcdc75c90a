"""Numerical parity with transformers (the oracle) on tiny random checkpoints of each family."""

import json

import pytest
import torch

from grpo_engine import load_model, save_model

transformers = pytest.importorskip("transformers")

ARCHS = ["qwen2", "qwen2-tied", "qwen3", "llama3"]


def hf_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def batch_with_padding(vocab: int, seed: int = 0):
    """Three rows of lengths 20, 15 and 9, left-padded, and the HF attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 20), generator=g)
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, :11] = 0
    return ids, mask


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(tiny_ckpt_factory, arch):
    path = tiny_ckpt_factory(arch, max_position_embeddings=128)
    ours, theirs = load_model(path), hf_load(path)
    ids, mask = batch_with_padding(ours.config.vocab_size)
    with torch.no_grad():
        full_ours, full_theirs = ours(ids), theirs(ids).logits
        pad_ours, pad_theirs = ours(ids, mask), theirs(ids, attention_mask=mask).logits
    assert (full_ours - full_theirs).abs().max().item() < 1e-4
    real = mask.bool()
    assert (pad_ours[real] - pad_theirs[real]).abs().max().item() < 1e-4


@pytest.mark.parametrize("arch", ["qwen2", "llama3"])
def test_left_padding_equals_unpadded_rows(tiny_ckpt_factory, arch):
    """Each padded row's logits equal that row run alone without padding."""
    model = load_model(tiny_ckpt_factory(arch))
    ids, mask = batch_with_padding(model.config.vocab_size, seed=1)
    with torch.no_grad():
        padded = model(ids, mask)
        for row in range(3):
            real = mask[row].bool()
            alone = model(ids[row, real][None])[0]
            assert (padded[row, real] - alone).abs().max().item() < 1e-4


def test_llama3_rope_scaling_is_exercised(tiny_ckpt_factory):
    """The llama3 scaling must change some frequencies of the tiny config (else parity proves nothing)."""
    from grpo_engine.model.transformer import rope_inv_freq

    cfg = load_model(tiny_ckpt_factory("llama3")).config
    scaled = rope_inv_freq(cfg)
    cfg.rope_scaling = None
    plain = rope_inv_freq(cfg)
    changed = (scaled != plain).sum().item()
    assert 0 < changed < plain.numel()


@pytest.mark.parametrize("arch", ARCHS)
def test_our_save_loads_in_transformers(tiny_ckpt_factory, tmp_path, arch):
    src = tiny_ckpt_factory(arch)
    ours = load_model(src)
    save_model(ours, tmp_path / "saved", tokenizer_dir=src)
    theirs = hf_load(tmp_path / "saved")
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4
    assert (tmp_path / "saved" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "saved" / "generation_config.json").read_text())["eos_token_id"]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_transformers_save_loads_in_ours(tiny_ckpt_factory, tmp_path, arch):
    """A directory written by transformers' save_pretrained (its own config layout) loads in ours."""
    theirs = hf_load(tiny_ckpt_factory(arch))
    theirs.save_pretrained(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "rope_parameters" in raw or "rope_theta" in raw
    ours = load_model(tmp_path / "hf")
    ids = torch.randint(0, ours.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4


def test_sharded_round_trip(tiny_ckpt_factory, tmp_path):
    src = tiny_ckpt_factory("qwen2")
    model = load_model(src)
    save_model(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard_files = set(index["weight_map"].values())
    assert len(shard_files) > 2
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    back = load_model(tmp_path / "sharded")
    for (name, a), (_, b) in zip(model.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), name
    theirs = hf_load(tmp_path / "sharded")  # transformers reads our index too
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (model(ids) - theirs(ids).logits).abs().max().item() < 1e-4


def test_load_dtype_and_tied_weights(tiny_ckpt_factory):
    model = load_model(tiny_ckpt_factory("qwen2-tied"), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.embed.weight
    assert not any(p.is_meta for p in model.parameters())


def test_rope_scaling_added_to_a_transformers_5_config(tiny_ckpt_factory, tmp_path):
    """save_pretrained writes rope_parameters; a rope_scaling added afterwards is what transformers runs."""
    theirs = hf_load(tiny_ckpt_factory("llama3"))
    theirs.save_pretrained(tmp_path / "hf")
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw.update(rope_theta=500000.0, rope_scaling={"rope_type": "linear", "factor": 4.0})
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    ours, theirs = load_model(tmp_path / "hf"), hf_load(tmp_path / "hf")
    assert ours.config.rope_scaling["rope_type"] == "linear"
    ids = torch.randint(0, ours.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4
