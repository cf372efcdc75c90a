"""evaluate(): scripted completions with hand-computed pass@k / maj@k / format / length / truncation.

A fake generate returns fixed texts (byte-level tokenizer: one token per byte, +1 for the stop token), so
every aggregate below is computed by hand from the script in the test.
"""

import pytest
from references import BYTE_ARITHMETIC, R1

from grpo_engine.collect.groups import prompt_seed
from grpo_engine.eval.evaluate import EvalConfig, evaluate, report_json, report_markdown
from grpo_engine.model.loading import load_model, load_tokenizer
from grpo_engine.rollout import GenerationOutput, SamplingParams, generate
from grpo_engine.tasks import Example, make_task, render_prompt
from grpo_engine.tasks.base import RewardResult

STOP, LENGTH = "stop", "length"
# problem -> 4 samples (text, finish reason); arithmetic task: answer_tag format, answer component 0/1
SCRIPT = [
    # 2+2=4: correct, wrong, correct, untagged -> c=2; answers [4, 5, 4, None]
    [("<answer>4</answer>", STOP), ("<answer>5</answer>", STOP), ("<answer>4</answer>", STOP), ("4", STOP)],
    # 3+3=6: none correct, majority 7; last one truncated mid-tag (not formatted, no answer)
    [("<answer>7</answer>", STOP), ("<answer>7</answer>", STOP), ("<answer>8</answer>", STOP),
     ("<answer>9", LENGTH)],
    # 5+5=10: c=1 (third), majority 3 (wrong)
    [("<answer>3</answer>", STOP), ("<answer>3</answer>", STOP), ("<answer>10</answer>", STOP),
     ("<answer>3</answer>", STOP)],
]
EXAMPLES = [Example("p1", "2+2=", "4"), Example("p2", "3+3=", "6"), Example("p3", "5+5=", "10")]


class ScriptedGenerate:
    """Stands in for rollout.generate: hands out SCRIPT rows in problem order, records what it was given."""

    def __init__(self, tok, script):
        self.tok, self.script, self.next, self.calls = tok, script, 0, []

    def __call__(self, model, prompt_ids, params, seed=0, tokenizer=None):
        self.calls.append((prompt_ids, params, seed))
        ids, reasons = [], []
        for _ in prompt_ids:
            rows = self.script[self.next]
            self.next += 1
            for text, reason in rows[: params.n]:
                stop = [self.tok.eos_token_ids[0]] if reason == STOP else []
                ids.append(self.tok.encode(text) + stop)
                reasons.append(reason)
        return GenerationOutput(ids, [[0.0] * len(r) for r in ids], reasons,
                                [i // params.n for i in range(len(ids))])


class DummyModel:
    """evaluate() only toggles train/eval mode on the model; the scripted generate never calls it."""

    training = True

    def eval(self):
        self.training = False

    def train(self, mode=True):
        self.training = mode


@pytest.fixture
def tok(tiny_ckpt):
    return load_tokenizer(tiny_ckpt)


def run(tok, task, script=SCRIPT, examples=EXAMPLES, **cfg):
    fake = ScriptedGenerate(tok, script)
    model = DummyModel()
    report = evaluate(model, tok, task, examples, EvalConfig(**{"n": 4, "ks": (1, 2, 4), **cfg}), generate=fake)
    assert model.training  # mode restored
    return report, fake


def test_aggregates_match_hand_computation(tok):
    report, fake = run(tok, make_task("arithmetic", **BYTE_ARITHMETIC), prompts_per_batch=2)
    s = report.summary
    # per problem pass@k = 1 - C(n-c, k)/C(n, k) with n=4: c=2 -> (1/2, 5/6, 1); c=0 -> 0; c=1 -> (1/4, 1/2, 1)
    assert [p.num_correct for p in report.problems] == [2, 0, 1]
    assert report.problems[0].pass_at == pytest.approx({1: 0.5, 2: 5 / 6, 4: 1.0})
    assert report.problems[2].pass_at == pytest.approx({1: 0.25, 2: 0.5, 4: 1.0})
    assert s.pass_at == pytest.approx({1: 0.75 / 3, 2: (5 / 6 + 0.5) / 3, 4: 2 / 3})
    # maj: problem 1 votes 4 (right) at every k (k=2 is a 4-vs-5 tie: first seen wins); 2 and 3 vote wrong
    assert [p.majority for p in report.problems] == ["4", "7", "3"]
    assert s.maj_at == pytest.approx({1: 1 / 3, 2: 1 / 3, 4: 1 / 3})
    # format: untagged "4" and truncated "<answer>9" are the 2 unformatted of 12
    assert s.format_rate == pytest.approx(10 / 12)
    # lengths: "<answer>d</answer>" = 18 bytes + stop = 19; "4"+stop = 2; "<answer>9" = 9 (no stop);
    # "<answer>10</answer>" + stop = 20  ->  (19*3+2) + (19*3+9) + (19*3+20) = 202 tokens over 12 samples
    assert s.mean_length == pytest.approx(202 / 12)
    assert s.truncation_rate == pytest.approx(1 / 12)
    # reward = 0.1 * format + 1.0 * correct: (0.1 * 10 + 3) / 12
    assert s.mean_reward == pytest.approx(4.0 / 12)
    assert (s.num_problems, s.samples_per_problem, s.reward_errors, report.notes) == (3, 4, 0, [])
    # batching: 2 + 1 prompts, one distinct seed per problem; prompts rendered exactly as training renders them
    assert [len(c[0]) for c in fake.calls] == [2, 1]
    seeds = [prompt_seed(0, 0, 0, i) for i in range(3)]
    assert [c[2] for c in fake.calls] == [seeds[:2], seeds[2:]] and len(set(seeds)) == 3
    task = make_task("arithmetic", **BYTE_ARITHMETIC)
    assert fake.calls[0][0][1] == tok.encode(render_prompt(task, tok, EXAMPLES[1]))
    assert fake.calls[0][1].stop_token_ids == tok.eos_token_ids


def test_a_problems_samples_do_not_depend_on_its_batch(tiny_ckpt, tok):
    """One seed per batch made every problem's samples (so its pass@k) change with prompts_per_batch (the
    --batch-prompts memory knob) and with --max-examples; each problem now samples from its own seed."""
    model, task = load_model(tiny_ckpt), make_task("arithmetic")
    examples = task.examples("test")[:3]

    def texts(exs, per_batch):
        cfg = EvalConfig(n=2, ks=(1,), max_new_tokens=6, seed=5, prompts_per_batch=per_batch)
        return [[s.text for s in p.samples] for p in evaluate(model, tok, task, exs, cfg).problems]

    full = texts(examples, 3)
    assert texts(examples, 1) == full and texts(examples[:2], 3) == full[:2]
    # reference: problem 2 sampled alone by rollout.generate with seed (5, problem index 2)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=0.6, stop_token_ids=list(tok.eos_token_ids))
    prompt = tok.encode(render_prompt(task, tok, examples[2]))
    ref = generate(model, [prompt], params, seed=[prompt_seed(5, 0, 0, 2)], tokenizer=tok)
    assert full[2] == [tok.decode(ids, skip_special_tokens=True) for ids in ref.completion_ids]


def test_prompt_includes_system_prompt_and_prefill(tok, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q?", "answer": "42"}\n')
    task = make_task("custom", data_path=str(data), **R1)
    _, fake = run(tok, task, script=[SCRIPT[0]], examples=task.examples("test"))
    text = tok.decode(fake.calls[0][0][0])
    assert text.startswith("<|im_start|>system\nA conversation between User and Assistant")
    assert text.endswith("<|im_start|>assistant\nLet me solve this step by step.\n<think>")


def test_greedy_forces_one_sample_and_says_so(tok):
    report, fake = run(tok, make_task("arithmetic", **BYTE_ARITHMETIC), temperature=0.0)
    assert fake.calls[0][1].n == 1 and fake.calls[0][1].temperature == 0.0
    assert (report.config.n, report.config.ks) == (1, (1,))
    # first sample of each problem: correct, wrong, wrong
    assert report.summary.pass_at == pytest.approx({1: 1 / 3})
    assert set(report.summary.maj_at) == {1}
    assert len(report.notes) == 1 and "greedy" in report.notes[0] and "n forced from 4 to 1" in report.notes[0]


def test_bad_config():
    with pytest.raises(ValueError, match="k=8 needs at least that many samples but n=4"):
        EvalConfig(n=4, ks=(1, 8))
    with pytest.raises(ValueError, match="temperature=-1"):
        EvalConfig(temperature=-1)
    for top_p in (0.0, 1.5, float("nan")):  # was found only by the sampler, after the model had loaded
        with pytest.raises(ValueError, match=r"top_p=.* must be in \(0, 1\]"):
            EvalConfig(top_p=top_p)


def test_max_examples_takes_the_first(tok):
    report, fake = run(tok, make_task("arithmetic", **BYTE_ARITHMETIC), max_examples=2)
    assert [p.example_id for p in report.problems] == ["p1", "p2"]


class FloatRewardTask:
    """A task whose reward is a bare float (like a custom reward_fn) or raises: no 'answer' component."""

    name = "floaty"

    def prompt(self, example):
        return make_task("arithmetic", **BYTE_ARITHMETIC).prompt(example)

    def reward(self, example, completion):
        if "boom" in completion:
            raise RuntimeError("reward crashed")
        return RewardResult(1.0, {"custom": 1.0}, None)

    def equivalent(self, a, b):
        raise RuntimeError("never reached with None answers")


def test_missing_answer_component_and_reward_errors_are_reported(tok):
    script = [[("fine", STOP), ("boom", STOP)]]
    report, _ = run(tok, FloatRewardTask(), script=script, examples=EXAMPLES[:1], n=2, ks=(1,))
    s = report.summary
    assert s.pass_at == {1: 0.0} and s.reward_errors == 1 and s.mean_reward == pytest.approx(0.5)
    assert report.problems[0].samples[1].error == "exception"
    assert len(report.notes) == 1 and "1 sample(s) got a reward without an 'answer' component" in report.notes[0]
    assert "raised or timed out" in report_markdown(report)


def test_report_json_and_markdown(tok):
    report, _ = run(tok, make_task("arithmetic", **BYTE_ARITHMETIC))
    js = report_json(report)
    assert js["task"] == "arithmetic" and js["config"]["ks"] == [1, 2, 4]
    assert js["summary"]["pass@1"] == pytest.approx(0.25) and js["summary"]["maj@4"] == pytest.approx(1 / 3)
    assert {"format_rate", "mean_length", "truncation_rate", "mean_reward", "num_problems"} <= set(js["summary"])
    p1 = js["problems"][0]
    assert p1["num_correct"] == 2 and p1["majority"] == "4" and p1["samples"][3]["answer"] is None
    assert p1["samples"][0]["components"] == {"format": 1.0, "answer": 1.0}
    md = report_markdown(report)
    lines = md.splitlines()
    assert lines[0] == ("| task | problems | n | pass@1 | pass@2 | pass@4 | maj@1 | maj@2 | maj@4 | format "
                        "| mean length | truncated | mean reward |")
    assert lines[2] == ("| arithmetic | 3 | 4 | 25.0% | 44.4% | 66.7% | 33.3% | 33.3% | 33.3% | 83.3% "
                        "| 16.8 | 8.3% | 0.333 |")
