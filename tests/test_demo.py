"""The demo: its recipe stays in sync with configs/demo.yaml, and a shortened run works end to end."""

import json
from pathlib import Path

import pytest

from grpo_engine.config import load_config
from grpo_engine.demo import DEMO_RECIPE, QUICK_OVERRIDES, run_demo

REPO = Path(__file__).resolve().parents[1]


def test_configs_demo_is_the_embedded_recipe():
    assert (REPO / "configs" / "demo.yaml").read_text() == Path(str(DEMO_RECIPE)).read_text()
    cfg = load_config(REPO / "configs" / "demo.yaml")
    assert cfg.warm_start.tiny.arch and cfg.warm_start.sft.steps > 0 and cfg.eval.max_examples >= 200


@pytest.mark.slow
def test_quick_demo_end_to_end(tmp_path):
    result = run_demo([*QUICK_OVERRIDES, f"run_dir={tmp_path / 'demo'}"])
    run = tmp_path / "demo"
    for sub in ("base", "sft"):
        assert (run / sub / ".complete").exists() and (run / sub / "model.safetensors").exists()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert result.before.num_problems == result.after.num_problems == 16
    for r in (result.before, result.after):
        assert 0.0 <= r.accuracy <= 1.0 and 0.0 <= r.format_rate <= 1.0 and r.mean_length > 0
    assert result.plot is not None and result.plot.read_bytes()[:4] == b"\x89PNG"
