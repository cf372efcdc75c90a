"""`evaluate` with tools: each sample is a scored trajectory of a scripted policy, with its tool-call counts and
the policy's own token count; the arithmetic task's named operands reach the calculator."""

from __future__ import annotations

import pytest
from test_multiturn import CALL, ScriptedModel, script_policy

from grpo_engine.config.tools import ToolsSection
from grpo_engine.eval.evaluate import EvalConfig, evaluate, report_json, report_markdown
from grpo_engine.tasks import make_task

NAMED = dict(template="a={a} b={b} a{op}b=", instruction="", digits=3, operations=["*"], full_width=True,
             named_operands=True, format="bare_number", extractors=["last_number"], n_train=10, n_test=5)


def test_evaluate_with_tools_scores_whole_trajectories(tiny_tok):
    task = make_task("arithmetic", **NAMED)
    right, head, typo = task.examples("test")[:3]
    scripts = {right.question: [CALL.format(name="calculator", expr="a*b"), f"{right.a * right.b}<|im_end|>"],
               head.question: ["12345<|im_end|>"],  # answers in its head, wrongly
               typo.question: [CALL.format(name="calculator", expr="a*c"), "7<|im_end|>"]}  # a failed call
    model = ScriptedModel(272, script_policy(tiny_tok, scripts))
    tools = ToolsSection(enabled=True, names=["calculator"], max_turns=2, max_tokens=200, format="undeclared")
    cfg = EvalConfig(n=1, ks=(1,), temperature=0.0, max_new_tokens=96, prompts_per_batch=2)
    report = evaluate(model, tiny_tok, task, [right, head, typo], cfg, tools=tools)

    samples = [p.samples[0] for p in report.problems]
    assert [s.correct for s in samples] == [True, False, False]
    assert [(s.tool_calls, s.tool_errors) for s in samples] == [(1, 0), (0, 0), (1, 1)]
    policy_tokens = [sum(len(tiny_tok.encode(turn)) for turn in scripts[q]) for q in scripts]
    assert [s.num_tokens for s in samples] == policy_tokens  # the tool's tokens are not the policy's
    assert f"<tool_response>\n{right.a * right.b}\n</tool_response>" in samples[0].text.replace("\r", "")
    assert "unknown name 'c' (known names: a, b)" in samples[2].text
    s = report.summary
    assert (s.pass_at[1], s.tool_call_rate, s.tool_errors) == (pytest.approx(1 / 3), pytest.approx(2 / 3), 1)
    assert report_json(report)["summary"]["tool_call_rate"] == pytest.approx(2 / 3)
    assert "| tool calls | tool errors |" in report_markdown(report)

    single = evaluate(model, tiny_tok, task, [head], cfg)  # without tools: one turn, no tool fields
    assert single.summary.tool_call_rate is None and single.problems[0].samples[0].tool_calls is None
