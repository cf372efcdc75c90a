"""Config tree: YAML + overrides, error messages naming the field, validation, docs, every YAML under configs/."""

from pathlib import Path

import pytest

from grpo_engine.config import Config, ConfigError, check_paths, iter_config_docs, load_config, to_yaml
from grpo_engine.rl.losses import LossConfig, resolve

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_yaml_and_dotted_overrides(tmp_path):
    p = write(tmp_path, "rollout:\n  group_size: 4\nalgorithm:\n  loss: grpo\n  overlong:\n"
                        "    filter_truncated: true\n")
    cfg = load_config(p, ["algorithm.loss=dapo", "rollout.group_size=16", "optimizer.betas=[0.8,0.9]",
                          "algorithm.eps_high=0.28", "algorithm.advantage.estimator=dr_grpo"])
    assert isinstance(cfg, Config)
    a = cfg.algorithm
    assert (cfg.rollout.group_size, a.policy_loss.loss, a.overlong.filter_truncated) == (16, "dapo", True)
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.rollout.max_new_tokens == 256  # default kept
    # the algorithm section holds the rl library's LossConfig (its keys written at the algorithm level): resolved
    # once (with Dr. GRPO's normaliser defaulting to rollout.max_new_tokens) into the flat loss policy_loss reads
    loss = resolve(cfg.algorithm.policy_loss, cfg.rollout.max_new_tokens)
    assert isinstance(cfg.algorithm.policy_loss, LossConfig) and not hasattr(loss, "cfg")
    assert (loss.loss, loss.eps_high, loss.max_completion_len, loss.aggregation) == ("dapo", 0.28, 256,
                                                                                         "token-mean")
    assert cfg.algorithm.advantage.estimator == "dr_grpo"


def test_algorithm_sections_validated_by_the_rl_library(tmp_path):
    with pytest.raises(ConfigError, match=r"algorithm: unknown loss 'ppo'; choose one of"):
        load_config(None, ["algorithm.loss=ppo"])
    with pytest.raises(ConfigError, match=r"algorithm.advantage: unknown advantage estimator 'rloo'"):
        load_config(None, ["algorithm.advantage.estimator=rloo"])
    with pytest.raises(ConfigError, match=r"algorithm.semantic_entropy: unknown modulation 'cubic'"):
        load_config(None, ["algorithm.semantic_entropy.modulation=cubic"])
    with pytest.raises(ConfigError, match=r"reference: unknown reference mode 'synced'"):
        load_config(None, ["reference.mode=synced"])
    with pytest.raises(ConfigError, match=r"reference mode 'mixin' needs update_every >= 1"):
        load_config(None, ["reference.mode=mixin"])
    with pytest.raises(ConfigError, match=r"beta > 0 needs a reference policy"):
        load_config(None, ["algorithm.beta=0.1", "reference.mode=none"])
    with pytest.raises(ConfigError, match=r"with lora.enabled the reference policy is the base model"):
        load_config(None, ["algorithm.beta=0.1", "lora.enabled=true", "reference.mode=hard_reset",
                           "reference.update_every=2"])
    with pytest.raises(ConfigError, match=r"soft_punish needs 0 < cache_len <= max_len"):
        load_config(None, ["algorithm.overlong.soft_punish=true", "algorithm.overlong.cache_len=0"])
    with pytest.raises(ConfigError, match=r"optimizer.name='sgd'; choose from"):
        load_config(None, ["optimizer.name=sgd"])
    with pytest.raises(ConfigError, match=r"lora.rank must be > 0"):
        load_config(None, ["lora.rank=0"])
    with pytest.raises(ConfigError, match=r"memory.precision='fp8'"):
        load_config(None, ["memory.precision=fp8"])
    with pytest.raises(ConfigError, match=r"wrong type for 'algorithm\.eps_high'"):
        load_config(None, ["algorithm.eps_high=wide"])


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


def test_an_empty_value_says_the_key_has_none_and_how_to_fix_it(tmp_path):
    """`model.path=` and `group_size:` with nothing after them are null; the error read "Incompatible value 'None'
    for field of type 'str'"."""
    with pytest.raises(ConfigError, match=r"override 'model\.path=': 'model\.path' has no value \(empty or null\) "
                                          r"but needs one of type str: give it \(model\.path=VALUE\)"):
        load_config(None, ["model.path="])
    p = write(tmp_path, "rollout:\n  group_size:\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: 'rollout\.group_size' has no value .* of type int"):
        load_config(p)


def test_a_list_or_number_where_a_section_belongs_names_the_key(tmp_path):
    """`task: {options: [1, 2]}` was a TypeError traceback; `rollout: 5` named the key '?'."""
    with pytest.raises(ConfigError, match=r"c\.yaml: 'task\.options' must be a mapping .*got list \[1, 2\]"):
        load_config(write(tmp_path, "task:\n  options: [1, 2]\n"))
    with pytest.raises(ConfigError, match=r"override 'rollout=5': 'rollout' must be a mapping"):
        load_config(None, ["rollout=5"])
    with pytest.raises(ConfigError, match=r"'rollout\.stop_strings' must be a list"):
        load_config(None, ["rollout.stop_strings={a: 1}"])


def test_a_section_with_every_line_commented_out_is_its_defaults(tmp_path):
    cfg = load_config(write(tmp_path, "rollout:\n#  group_size: 4\ntask:\n  options:\nseed: 3\n"))
    assert (cfg.rollout.group_size, cfg.task.options, cfg.seed) == (8, {}, 3)


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


def test_model_path_to_a_file_or_a_training_checkpoint_says_which_dir(tmp_path, tiny_ckpt):
    """A file was reported as a directory that does not exist; a step-N checkpoint as lacking config.json."""
    cfg = load_config(None, [f"model.path={tiny_ckpt / 'config.json'}"])
    with pytest.raises(ConfigError, match=r"config\.json' is a file: give the checkpoint directory that holds it"):
        check_paths(cfg)
    (tmp_path / "step-000002" / "model").mkdir(parents=True)
    (tmp_path / "step-000002" / "model" / "config.json").write_text("{}")
    cfg = load_config(None, [f"model.path={tmp_path / 'step-000002'}"])
    with pytest.raises(ConfigError, match=r"is a `grpo train` checkpoint: its weights are in .*step-000002/model"):
        check_paths(cfg)


def test_yaml_round_trip():
    cfg = load_config(None, ["rollout.group_size=6", "task.options.n_digits=3"])
    again = load_config(None, [])
    assert again != cfg
    from grpo_engine.config import config_from_yaml_text

    assert config_from_yaml_text(to_yaml(cfg)) == cfg


def test_every_field_documented():
    docs = list(iter_config_docs())
    names = [d[0] for d in docs]
    assert "rollout.group_size" in names and "algorithm.overlong.soft_punish" in names
    # embedded rl dataclasses document their fields with trailing comments; those become the help text
    helps = {d[0]: d[3] for d in docs}
    assert helps["algorithm.group_filter.tol"] == "rewards within tol of each other count as equal"
    assert len(names) == len(set(names))
    undocumented = [d[0] for d in docs if not d[3]]
    assert undocumented == []


@pytest.mark.parametrize("path", sorted([*(REPO / "configs").glob("*.yaml"),
                                         *(REPO / "grpo_engine" / "recipes").glob("*.yaml")]), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    load_config(path)


def test_config_choices_are_the_library_tables():
    """config/ validates names without importing the library: its choice lists must be the tables' keys."""
    from importlib import import_module

    from grpo_engine.config import algorithm as A
    from grpo_engine.config import training as T
    from grpo_engine.model import lora
    from grpo_engine.plan import memory as plan_memory
    from grpo_engine.rl import advantages, correction, losses
    from grpo_engine.train import memory, optim
    from grpo_engine.train import policy as reference

    semantic_entropy = import_module("grpo_engine.rl.semantic_entropy")  # the package re-exports a function

    # reference modes: "none" and "frozen" have no update rule, the others one each
    pairs = [(A.LOSSES, losses.PRESETS), (A.RATIO_LEVELS, losses.RATIOS), (A.AGGREGATIONS, losses.AGGREGATIONS),
             (A.KL_ESTIMATORS, losses.KL_ESTIMATORS), (A.ADVANTAGE_ESTIMATORS, advantages.ESTIMATORS),
             (A.ROLLOUT_CORRECTIONS, correction.CORRECTIONS), (A.CORRECTION_LEVELS, correction.LEVELS),
             (A.MODULATIONS, semantic_entropy.MODULATIONS), (A.REFERENCE_MODES, ["none", "frozen", *reference.UPDATES]),
             (T.OPTIMIZERS, optim.OPTIMIZERS),
             (tuple(c for c in T.CHECKPOINTING if c != "auto"), plan_memory.CHECKPOINT_MODES),
             (T.LORA_INITS, lora.LORA_A_INIT),
             (T.NF4_BACKENDS, lora.NF4_BACKENDS),
             (tuple(p for p in T.PRECISIONS if p != "auto"), memory.PRECISIONS)]
    for names, table in pairs:
        assert sorted(names) == sorted(table), (names, sorted(table))


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path):
    """YAML keeps the last of two equal keys: a second `rollout:` section silently dropped the first one's."""
    text = "rollout:\n  group_size: 4\nseed: 1\nrollout:\n  max_new_tokens: 8\n"
    with pytest.raises(ConfigError, match=r"c\.yaml:4:1: .*key 'rollout' appears twice \(first on line 1\)"):
        load_config(write(tmp_path, text))
    nested = "rollout:\n  group_size: 4\n  group_size: 8\n"
    with pytest.raises(ConfigError, match=r"key 'group_size' appears twice \(first on line 2\)"):
        load_config(write(tmp_path, nested))
    anchors = "base: &b {group_size: 4}\n"  # an anchor merged and then overridden is not a duplicate
    with pytest.raises(ConfigError, match="unknown"):  # (base is no config section, but it parsed)
        load_config(write(tmp_path, anchors + "rollout:\n  <<: *b\n  group_size: 6\n"))


def test_null_empties_a_free_mapping_but_not_a_section(tmp_path):
    """Overrides merge into task.options, so switching task.name on the command line kept the file's options of
    the old task (an "unknown option" error for the new one): `task.options=null` empties them first."""
    path = write(tmp_path, "task:\n  name: arithmetic\n  options: {digits: 2, n_train: 64}\n")
    cfg = load_config(path, ["task.name=countdown", "task.options=null", "task.options.n_train=5"])
    assert (cfg.task.name, cfg.task.options) == ("countdown", {"n_train": 5})
    assert load_config(path, ["task.options.n_test=3"]).task.options == {"digits": 2, "n_train": 64, "n_test": 3}
    with pytest.raises(ConfigError, match="'rollout' must be a mapping"):
        load_config(path, ["rollout=null"])
    from grpo_engine.train.setup import task_of

    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['digits'\].*add task.options=null"):
        task_of(load_config(path, ["task.name=countdown"]))


def test_the_loss_keys_stay_at_the_algorithm_level():
    """AlgorithmSection holds the LossConfig (`policy_loss`), but users, stored configs and `grpo config show` write
    its keys as algorithm.beta: both forms load, the written one is the user's, and unknown keys are named so."""
    import yaml

    from grpo_engine.config import config_from_yaml_text

    cfg = load_config(None, ["algorithm.beta=0.04", "algorithm.loss=dapo"])
    assert (cfg.algorithm.policy_loss.beta, cfg.algorithm.policy_loss.loss) == (0.04, "dapo")
    stored = yaml.safe_load(to_yaml(cfg))["algorithm"]
    assert "policy_loss" not in stored and (stored["beta"], stored["loss"], stored["mu"]) == (0.04, "dapo", 1)
    assert config_from_yaml_text(to_yaml(cfg)) == cfg
    assert config_from_yaml_text("algorithm:\n  policy_loss:\n    beta: 0.04\n    loss: dapo\n") == cfg
    with pytest.raises(ConfigError, match=r"unknown config key 'algorithm\.betta' \(did you mean 'algorithm\.beta'"):
        load_config(None, ["algorithm.betta=0.1"])
