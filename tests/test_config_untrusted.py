"""Config files are untrusted input (issue 41): YAML is parsed under a budget (config/safe_yaml.py), so an alias
bomb is refused in one line within 20 s and 4 GB by every command that reads YAML, and a seeded fuzz of the
loaders ends every input in a Config or a ConfigError, never another exception."""

import random
import shutil
import time
from pathlib import Path

import pytest
from bounded import assert_refused, run_probes

from grpo_engine.config import Config, ConfigError, config_from_yaml_text, load_config, to_yaml
from grpo_engine.config.safe_yaml import MAX_YAML_NODES

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted([*(REPO / "configs").glob("*.yaml"), *(REPO / "grpo_engine" / "recipes").glob("*.yaml")])
DEMO = REPO / "grpo_engine" / "recipes" / "demo.yaml"


def alias_bomb(levels: int = 9) -> str:
    """~540 bytes that name 10^9 nodes: each anchor is a list of ten aliases of the one before."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join([*lines, f"rollout: {{group_size: *a{levels - 1}}}"]) + "\n"


def flow_bomb(levels: int = 8) -> str:
    """The same in one flow value, as a `key=value` override would carry it."""
    inner = "&b0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"
    for i in range(1, levels):
        inner += f", &b{i} [" + ", ".join([f"*b{i - 1}"] * 10) + "]"
    return f"[{inner}]"


def test_alias_bomb_is_refused_by_every_command_that_reads_yaml(tmp_path, tiny_ckpt):
    """`grpo config show`, `grpo train` and `grpo eval` on a checkpoint whose stored config.yaml is a bomb hung
    (OmegaConf expands aliases before it rejects unknown keys); an override too."""
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(alias_bomb())
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt / "model")
    (ckpt / "config.yaml").write_text(alias_bomb())
    override = f"rollout.group_size={flow_bomb()}"
    results = run_probes([["config", "show", str(bomb)], ["train", str(bomb)], ["eval", str(ckpt)],
                          ["config", "show", str(DEMO), override]], cwd=REPO)
    for result, source in zip(results, [bomb, bomb, ckpt / "config.yaml", "override"]):
        assert_refused(result, str(source), f"{MAX_YAML_NODES:,} nodes")


@pytest.mark.parametrize("text, needle", [
    ("a: &a [*a]\n", "contains it"),
    ("rollout: " + "[" * 100 + "]" * 100 + "\n", "nested too deeply"),
    ("rollout: " + "{a: " * 70 + "1" + "}" * 70 + "\n", "nested too deeply"),
])
def test_recursive_and_deeply_nested_yaml_refused(tmp_path, text, needle):
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(ConfigError, match=needle) as err:
        load_config(tmp_path / "c.yaml")
    assert str(tmp_path / "c.yaml") in str(err.value)
    with pytest.raises(ConfigError, match=needle):
        config_from_yaml_text(text, "stored config.yaml")


def test_anchors_within_the_budget_still_work(tmp_path):
    """Anchors, aliases and merge keys are YAML a user may write: only their expanded size is bounded."""
    (tmp_path / "c.yaml").write_text("task:\n  options: &opts {digits: 3, operations: [+, '*']}\n"
                                     "rollout: {temperature: &t 0.7, top_p: *t}\n"
                                     "algorithm:\n  advantage: {<<: {eps: 0.5, estimator: grpo}, eps: 0.25}\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.rollout.top_p == 0.7 and cfg.task.options["digits"] == 3 and cfg.algorithm.advantage.eps == 0.25
    cfg = load_config(DEMO)
    assert isinstance(config_from_yaml_text(to_yaml(cfg)), Config)


# ---------------------------------------------------------------------------------------------------- fuzz
HOSTILE_VALUES = ["[1, 2]", "{a: 1}", "-1", "1e400", "9" * 40, "null", "''", "!!binary aGVsbG8=",
                  "!!python/object/apply:os.system [ls]", "&x [*x]", "*undefined", "{{", ".nan", ".inf", "~", "yes",
                  "\t", "'unterminated", "[" * 300, "a: b: c", "|\n  block", "0x1F", "2001-12-14", "!!set {a}"]


def _mutants(rng: random.Random, count: int):
    """(label, bytes) inputs from the shipped configs and a stored config: truncations, byte flips, hostile
    values, renamed keys, inserted bombs and duplicate sections."""
    texts = [p.read_text() for p in CONFIGS] + [to_yaml(load_config(DEMO))]
    for i in range(count):
        text, kind = rng.choice(texts), i % 6
        lines = text.splitlines()
        at = rng.randrange(len(lines))
        if kind == 0:
            data = text.encode()[: rng.randrange(len(text))]
        elif kind == 1:
            data = bytearray(text.encode())
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = bytes(data)
        elif kind == 2 and ":" in lines[at]:
            lines[at] = lines[at].split(":", 1)[0] + ": " + rng.choice(HOSTILE_VALUES)
            data = "\n".join(lines).encode()
        elif kind == 3 and ":" in lines[at]:
            lines[at] = "".join(rng.choice("abcxyz_.") for _ in range(6)) + ":" + lines[at].split(":", 1)[1]
            data = "\n".join(lines).encode()
        elif kind == 4:
            lines.insert(at, alias_bomb(rng.randint(3, 9)) if rng.random() < 0.5 else "rollout: {group_size: 2}")
            data = "\n".join(lines).encode()
        else:
            data = (text + "\n" + rng.choice(HOSTILE_VALUES) + "\n").encode()
        yield f"{i}: kind {kind}", data


def test_config_loader_fuzz(tmp_path):
    """220 seeded inputs, each through a config file (load_config) or a stored config (config_from_yaml_text) in
    turn: each ends in a Config or a one-line ConfigError, never another exception, within 30 s in all."""
    rng, start, outcomes = random.Random(41), time.perf_counter(), {"ok": 0, "error": 0}
    path = tmp_path / "fuzz.yaml"
    for i, (label, data) in enumerate(_mutants(rng, 220)):
        path.write_bytes(data)
        try:
            cfg = load_config(path) if i % 2 else config_from_yaml_text(data.decode("utf-8", "replace"))
            assert isinstance(cfg, Config), label
            outcomes["ok"] += 1
        except ConfigError as e:
            assert "\n" not in str(e), (label, str(e))
            outcomes["error"] += 1
    assert outcomes["ok"] > 20 and outcomes["error"] > 100, outcomes  # the fuzz reaches both ends
    assert time.perf_counter() - start < 30


def test_a_large_document_is_stopped_while_it_is_composed(monkeypatch, tmp_path):
    """Counting starts before the node tree is built: a document of many plain nodes (no aliases) is stopped at
    the budget (PyYAML composes ~40,000 nodes a second), and a file over the size limit is not even read."""
    from grpo_engine.config import safe_yaml

    monkeypatch.setattr(safe_yaml, "MAX_YAML_NODES", 100)
    composed = []
    monkeypatch.setattr(safe_yaml, "_check_budget", lambda node, source: composed.append(node))
    with pytest.raises(ConfigError, match="over 100 nodes"):
        safe_yaml.load_yaml("a: [" + "1, " * 500 + "1]", "big.yaml")
    assert composed == []  # refused before the whole tree existed
    (tmp_path / "huge.yaml").write_bytes(b"a: 1\n" * (safe_yaml.MAX_YAML_CHARS // 5 + 1))
    with pytest.raises(ConfigError, match=r"huge\.yaml: .* bytes, over"):
        load_config(tmp_path / "huge.yaml")
