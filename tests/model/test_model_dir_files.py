"""Issue 51: what a model directory named by a config (model.path, tokenizer.path) may hold. Only regular files are
read (a FIFO in place of a model file would hang the loader: refused by a stat); a plain Hugging Face directory,
which has no manifest, still reads its shard index (a checkpoint refuses one its manifest does not list:
tests/checkpoint/test_checkpoint_trust.py)."""

import os
import shutil
from pathlib import Path

import pytest
import torch
from tasks.test_untrusted_data import returns_within

from grpo_engine.config import ConfigError, check_paths, load_config
from grpo_engine.model.config import CheckpointError
from grpo_engine.model.hf_io import INDEX_FILE, save_hf_model
from grpo_engine.model.loading import load_model, load_tokenizer


def test_a_plain_hf_directory_still_reads_its_shard_index(tiny_ckpt, tmp_path):
    model = load_model(tiny_ckpt)
    sharded = save_hf_model(model, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    assert (sharded / INDEX_FILE).is_file() and len(list(sharded.glob("model-*.safetensors"))) > 1
    again = load_model(sharded)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                                  "chat_template.jinja"])
def test_a_fifo_in_a_model_directory_is_refused_without_waiting(tiny_ckpt, tmp_path, name):
    model_dir = shutil.copytree(tiny_ckpt, tmp_path / "m")
    if (model_dir / name).exists():
        (model_dir / name).unlink()
    os.mkfifo(model_dir / name)  # opened, it would wait for a writer forever
    load = load_model if name in ("config.json", "model.safetensors") else load_tokenizer
    done, error = returns_within(20, lambda: load(model_dir))
    assert done and isinstance(error, CheckpointError), error
    assert f"{model_dir / name} is a FIFO (named pipe), not a regular file" in str(error)


def test_model_and_tokenizer_paths_that_name_devices_are_refused(tiny_ckpt, tmp_path):
    cfg = Path(__file__).resolve().parents[2] / "configs" / "tiny_arithmetic.yaml"
    gguf = tmp_path / "m.gguf"
    gguf.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match=r"model.path='.*m.gguf' \(-> /dev/zero\) is a character device"):
        check_paths(load_config(cfg, [f"model.path={gguf}"]))
    with pytest.raises(ConfigError, match=r"model.path='/dev/null' is a character device, not a regular file or a "):
        check_paths(load_config(cfg, ["model.path=/dev/null"]))
    fifo = tmp_path / "tok"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"tokenizer.path='.*tok' is a FIFO \(named pipe\), not a regular file or"):
        check_paths(load_config(cfg, [f"model.path={tiny_ckpt}", f"tokenizer.path={fifo}"]))
    data = tmp_path / "d.jsonl"
    os.mkfifo(data)
    with pytest.raises(ConfigError, match=r"task.data_path='.*d.jsonl' is a FIFO"):
        check_paths(load_config(cfg, [f"model.path={tiny_ckpt}", f"task.data_path={data}"]))
