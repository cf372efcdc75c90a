"""benchmarks/notebook_vs_cli.py's plumbing on a tiny model for 1 step: the notebook reads the task's files when
GRPO_EXAMPLE_DATA names their folder, and the notebook and `grpo train` evaluate the same 200 held-out problems."""

import json

import pytest
from benchmark_scripts import load_benchmark

# a tiny model's settings: replies capped short, and no signal for the check to find (it reports that, runs on)
TINY = ["rollout.max_new_tokens=8", "rollout.prompts_per_step=2", "rollout.group_size=4", "check.fit_length=false",
        "check.fit_group_size=false", "check.groups=2", "check.stop=false", "lora.rank=2", "memory.precision=fp32",
        "eval.max_new_tokens=4"]


def test_the_notebook_and_the_cli_on_the_same_files(tmp_path, tiny_ckpt, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    monkeypatch.delenv("GRPO_EXAMPLE_DATA", raising=False)
    bench = load_benchmark("notebook_vs_cli")
    out = tmp_path / "result.json"
    monkeypatch.chdir(tmp_path)  # a relative --work: the notebook, run in WORK/notebook, still finds the files
    args = ["--model", str(tiny_ckpt), "--steps", "1", "--work", "work", "--json", str(out)]
    result = bench.main(args + [arg for o in TINY for arg in ("--override", o)])
    assert json.loads(out.read_text()) == result
    # the whole test file, as configs/own_task.yaml's eval.max_examples: 200 asks, in both runs
    assert result["cli"]["problems"] == result["notebook"]["problems"] == 200
    assert result["notebook"]["in_loop"]["problems"] == 200
    assert result["lift_gap_points"] == pytest.approx(
        100 * ((result["notebook"]["after"] - result["notebook"]["before"])
               - (result["cli"]["after"] - result["cli"]["before"])), abs=0.01)
    # the notebook's rows are the files' (its data cell shows the first training row), not its inline ones
    first = json.loads((tmp_path / "work/data/conversions_train.jsonl").read_text().splitlines()[0])
    nb = nbformat.read(result["notebook"]["executed"], as_version=4)
    shown = [o["data"]["text/plain"] for cell in nb.cells for o in cell.get("outputs", [])
             if "text/plain" in o.get("data", {}) and "'prompt'" in o["data"]["text/plain"]]
    assert shown and first["prompt"] in shown[0] and f"'id': '{first['id']}'" in shown[0]
    assert json.loads((tmp_path / "work/cli/metrics.jsonl").read_text().splitlines()[-1])["step"] == 1
