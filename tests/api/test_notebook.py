"""examples/own_task.ipynb runs, through nbclient on a tiny model for 2 steps (GRPO_EXAMPLE_MODEL /
GRPO_EXAMPLE_STEPS), and is the same source as examples/own_task.py: the example cannot rot."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def _make_notebook():
    spec = importlib.util.spec_from_file_location("make_notebook", EXAMPLES / "make_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_notebook_is_the_script():
    assert (EXAMPLES / "own_task.ipynb").read_text() == _make_notebook().notebook_text(), \
        "examples/own_task.ipynb is stale: python examples/make_notebook.py"


def _text(output: dict) -> str:
    if output.get("output_type") == "stream":
        return output["text"]
    return "".join(output.get("data", {}).get("text/plain", ""))


def test_the_notebook_trains_evaluates_and_exports_on_a_tiny_model(tmp_path, tiny_ckpt, monkeypatch):
    nbclient, nbformat = pytest.importorskip("nbclient"), pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("GRPO_EXAMPLE_MODEL", str(tiny_ckpt))
    monkeypatch.setenv("GRPO_EXAMPLE_STEPS", "2")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    nb = nbformat.read(EXAMPLES / "own_task.ipynb", as_version=4)
    # the tiny model's replies capped shorter than the recipe's (the same cells in seconds), and a random model has
    # no signal for the check to find: it reports that and the run goes on
    nb.cells.insert(1, nbformat.v4.new_code_cell(
        "import grpo_engine.api.trainer as t\n_init = t.GRPO.__init__\n"
        "t.GRPO.__init__ = lambda self, *a, **k: _init(self, *a, **{**k, 'rollout__max_new_tokens': 8, "
        "'rollout__prompts_per_step': 2, 'rollout__group_size': 4, 'check__fit_length': False, "
        "'check__fit_group_size': False, 'check__groups': 2, 'check__stop': False, 'eval__max_examples': 4, "
        "'lora__rank': 2, 'memory__precision': 'fp32'})"))
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [_text(o) for cell in nb.cells for o in cell.get("outputs", [])]
    text = "\n".join(outputs)
    assert "signal check" in text and "before: " in text and "2 steps (completed)" in text
    assert "step 1/2  reward" in text and "step 2/2  reward" in text  # a line per step
    assert any(o.startswith("step 2/2 [") for o in outputs)  # the bar, redrawn in place (a display)
    assert "\x1b" not in text  # no escape sequence in the cells' text
    images = [o for cell in nb.cells for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
    assert images, "curves.png shown inline"
    assert (tmp_path / "runs/own_task_python/own_task.gguf").stat().st_size > 0
    metrics = [json.loads(line) for line in (tmp_path / "runs/own_task_python/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]


REPLIES = ["7000", "7,000", "7000.0", "The answer is 7000.", "Answer: 7000", "<answer>7000</answer>",
           "\\boxed{7000}", "There are 7000 meters in 7 kilometers.", "1 km is 1000 m, so 7 km is 7000 m. Done.",
           "700", "seven thousand", "", "7000 or 700", "It is 7000 meters, not 700.", "7 kilometers = 7000 meters"]


def test_the_notebook_reward_scores_replies_as_verifier_numeric(tmp_path):
    """The reward cell's `converted` against the custom task's `verifier: numeric` (configs/own_task.yaml's): the
    same score on each reply, so the notebook and `grpo train` on the same files train and evaluate alike."""
    from grpo_engine.tasks import make_task

    source = next(cell["source"] for cell in _make_notebook().cells((EXAMPLES / "own_task.py").read_text())
                  if cell["cell_type"] == "code" and "def converted" in "".join(cell["source"]))
    scope = {}
    exec("from grpo_engine.tasks import RewardResult\n"
         "from grpo_engine.tasks.parsing import extract_answer, numeric_equal\n" + "".join(source), scope)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "How many meters are in 7 kilometers?", "answer": "7000"}) + "\n")
    task = make_task("custom", data_path=str(path), verifier="numeric", format="bare_number", format_weight=0.0)
    example = task.examples("train")[0]
    score = {"notebook": lambda reply: scope["converted"]({"answer": "7000"}, reply),
             "cli": lambda reply: task.reward(example, reply)}
    scores = [(reply, *((r.total, r.correct, r.answer) for r in (score["notebook"](reply), score["cli"](reply))))
              for reply in REPLIES]
    assert all(ours == cli for _, ours, cli in scores), [s for s in scores if s[1] != s[2]]
    assert {reply for reply, ours, _ in scores if ours[0] == 1.0} >= {"7000", "The answer is 7000.", "Answer: 7000"}
    assert {reply for reply, ours, _ in scores if ours[0] == 0.0} >= {"700", "seven thousand", ""}
