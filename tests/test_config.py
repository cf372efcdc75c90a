"""Config tree: YAML + overrides, error messages naming the field, validation, docs, every YAML under configs/."""

from pathlib import Path

import pytest

from grpo_engine.config import Config, ConfigError, check_paths, iter_config_docs, load_config, to_yaml

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_and_dotted_overrides(tmp_path):
    p = write(tmp_path, "rollout:\n  group_size: 4\nalgorithm:\n  loss: grpo\n  overlong:\n    mode: mask\n")
    cfg = load_config(p, ["algorithm.loss=dapo", "rollout.group_size=16", "optimizer.betas=[0.8,0.9]"])
    assert isinstance(cfg, Config)
    assert (cfg.rollout.group_size, cfg.algorithm.loss, cfg.algorithm.overlong.mode) == (16, "dapo", "mask")
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.rollout.max_new_tokens == 256  # default kept


def test_unknown_key_names_field_file_and_closest(tmp_path):
    p = write(tmp_path, "rollout:\n  gruop_size: 4\n")
    with pytest.raises(ConfigError, match=r"c\.yaml.*unknown config key 'rollout\.gruop_size'.*'rollout\.group_size'"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"unknown config key 'optimiser'.*did you mean 'optimizer'"):
        load_config(None, ["optimiser.lr=1"])


def test_wrong_type_names_field(tmp_path):
    p = write(tmp_path, "rollout:\n  group_size: many\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: wrong type for 'rollout\.group_size'"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"wrong type for 'optimizer\.lr'"):
        load_config(None, ["optimizer.lr=fast"])


def test_malformed_yaml_names_line(tmp_path):
    p = write(tmp_path, "rollout:\n  group_size: 4\n bad: [1, 2\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3:\d+: malformed YAML"):
        load_config(p)


def test_choices_and_ranges():
    with pytest.raises(ConfigError, match=r"schedule\.lr_schedule='cosin'.*did you mean 'cosine'"):
        load_config(None, ["schedule.lr_schedule=cosin"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size must be >= 2"):
        load_config(None, ["rollout.group_size=1"])
    with pytest.raises(ConfigError, match="override 'rollout.group_size' must look like key.sub=value"):
        load_config(None, ["rollout.group_size"])


def test_missing_model_dir_reported_before_loading(tmp_path, tiny_ckpt):
    cfg = load_config(None, [f"model.path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match=r"model\.path=.*nope.*directory does not exist"):
        check_paths(cfg)
    (tmp_path / "empty").mkdir()
    cfg = load_config(None, [f"model.path={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match="has no config.json"):
        check_paths(cfg)
    cfg = load_config(None, [f"model.path={tiny_ckpt}", f"task.data_path={tmp_path / 'missing.jsonl'}"])
    with pytest.raises(ConfigError, match=r"task\.data_path=.*does not exist"):
        check_paths(cfg)
    check_paths(load_config(None, [f"model.path={tiny_ckpt}"]))


def test_yaml_round_trip():
    cfg = load_config(None, ["rollout.group_size=6", "task.options.n_digits=3"])
    again = load_config(None, [])
    assert again != cfg
    from grpo_engine.config import config_from_yaml_text

    assert config_from_yaml_text(to_yaml(cfg)) == cfg


def test_every_field_documented():
    docs = list(iter_config_docs())
    names = [d[0] for d in docs]
    assert "rollout.group_size" in names and "algorithm.overlong.mode" in names
    assert len(names) == len(set(names))
    undocumented = [d[0] for d in docs if not d[3]]
    assert undocumented == []


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path)
