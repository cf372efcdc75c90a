"""Bad checkpoints fail with an error that names the file or tensor, never a stack trace from deep inside."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_engine import CheckpointError, load_model
from grpo_engine.model.hf_io import config_from_hf, hf_name_table


@pytest.fixture
def ckpt(tiny_ckpt_factory, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt_factory("qwen2"), dst)
    return dst


def edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def edit_tensors(path, fn):
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        load_model(ckpt)


def test_malformed_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(ckpt)


def test_unsupported_model_type(ckpt):
    edit_config(ckpt, model_type="falcon")
    with pytest.raises(CheckpointError, match="model_type 'falcon' is not supported.*qwen2, qwen3, llama"):
        load_model(ckpt)
    edit_config(ckpt, model_type="ministral3")  # a relative of a supported family: refused with its reason
    with pytest.raises(CheckpointError, match="'ministral3' is not supported .*YaRN.*; supported: .*ministral"):
        load_model(ckpt)


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ],
)
def test_unsupported_features(ckpt, changes, needle):
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match="unsupported feature") as err:
        load_model(ckpt)
    assert needle in str(err.value)


def test_missing_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(ckpt)


def test_extra_tensor(ckpt):
    edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.9.mystery.weight", torch.zeros(2)))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.9\.mystery\.weight"):
        load_model(ckpt)


def test_shape_mismatch(ckpt):
    edit_tensors(ckpt, lambda t: t.__setitem__("model.norm.weight", torch.ones(7)))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight has shape \(7,\), config implies \(64,\)"):
        load_model(ckpt)


def test_truncated_safetensors(ckpt):
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_model(ckpt)


def test_no_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    (ckpt / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="pytorch_model.bin is not supported"):
        load_model(ckpt)


def test_shard_listed_but_missing(ckpt):
    index = {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is listed.*missing"):
        load_model(ckpt)


def test_name_table_covers_every_parameter(tiny_ckpt_factory):
    """Principle 3: every parameter is in the table and every checkpoint tensor was used."""
    for arch in ("qwen2", "qwen2-tied", "qwen3", "llama3"):
        model = load_model(tiny_ckpt_factory(arch))
        names = dict(model.named_parameters(remove_duplicate=False))
        table = hf_name_table(model.config)
        tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
        assert set(table) | tied == set(names), arch
        stored = load_file(str(tiny_ckpt_factory(arch) / "model.safetensors"))
        assert set(stored) == set(table.values()), arch


def test_config_reads_both_rope_layouts():
    base = dict(
        model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    v4 = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}})
    v5 = config_from_hf({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    assert v4.rope_theta == v5.rope_theta == 5e5
    assert v4.rope_scaling["factor"] == v5.rope_scaling["factor"] == 8.0
    assert v5.rope_scaling["rope_type"] == "llama3"
    plain = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_rope_scaling_wins_over_rope_parameters():
    """A 5.x config (rope_parameters) later given a rope_scaling, as Qwen's YaRN recipe does: transformers runs
    the rope_scaling, so we must read it too (and refuse yarn) instead of silently using rope_parameters."""
    base = dict(
        model_type="qwen2", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )
    linear = config_from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}})
    assert linear.rope_scaling == {"type": "linear", "factor": 4.0} and linear.rope_theta == 5e5
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        config_from_hf({**base, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 32768}})
    assert config_from_hf({**base, "rope_scaling": None}).rope_theta == 1e6


def test_llama3_rope_fields_checked_at_load():
    """original_max_position_embeddings defaults to max_position_embeddings (as in transformers); a missing
    factor fails at load, not as a KeyError in the first forward."""
    base = dict(
        model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
    )
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    cfg = config_from_hf({**base, "rope_parameters": rope})
    assert cfg.rope_scaling["original_max_position_embeddings"] == 256
    no_low = {k: v for k, v in rope.items() if k != "low_freq_factor"}
    with pytest.raises(CheckpointError, match="rope type 'llama3' without low_freq_factor"):
        config_from_hf({**base, "rope_parameters": no_low})


def test_qwen3_attention_bias_puts_a_bias_on_all_four_projections():
    """Qwen3 (like llama) with attention_bias has a bias on q, k, v and o_proj: read as such, not half of it."""
    from grpo_engine.model.hf_io import hf_name_table

    raw = dict(
        model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, attention_bias=True,
    )
    cfg = config_from_hf(raw)
    assert cfg.attention_bias and cfg.o_bias
    names = set(hf_name_table(cfg).values())
    assert {f"model.layers.0.self_attn.{p}_proj.bias" for p in "qkvo"} <= names


def test_tied_checkpoint_with_distinct_lm_head(tiny_ckpt_factory, tmp_path):
    """An equal lm_head copy is dropped; a different one is refused (transformers 5 would use it, untied)."""
    dst = tmp_path / "tied"
    shutil.copytree(tiny_ckpt_factory("qwen2-tied"), dst)
    edit_tensors(dst, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    model = load_model(dst)
    assert model.lm_head.weight is model.embed.weight
    edit_tensors(dst, lambda t: t["lm_head.weight"].add_(1.0))
    with pytest.raises(CheckpointError, match="tie_word_embeddings=true but lm_head.weight differs"):
        load_model(dst)


def test_old_rotary_inv_freq_buffers_are_skipped(ckpt):
    """transformers < 4.31 saved rotary_emb.inv_freq; transformers ignores them on load, so do we."""
    edit_tensors(ckpt, lambda t: t.__setitem__("model.layers.0.self_attn.rotary_emb.inv_freq", torch.ones(8)))
    load_model(ckpt)
