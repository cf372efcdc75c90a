"""The signal check before training (collect/signal_check.py, `grpo check`, `grpo train`'s default), and `grpo
train`'s before / after on held-out examples with its random-reward control."""

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_e2e import CFG, VOLATILE, _metrics, custom_task_config

from grpo_engine.cli import main
from grpo_engine.collect.groups import Group
from grpo_engine.collect.signal_check import (
    SignalReport,
    SignalStats,
    fit_length,
    rng_untouched,
    signal_stats,
    verdict,
)
from grpo_engine.config import ConfigError, load_config
from grpo_engine.model.loading import load_model
from grpo_engine.tasks.base import Example, RewardResult
from grpo_engine.train.loop import train


def stats(**kw) -> SignalStats:
    """Figures of 16 groups x 8 replies; `kw` overrides."""
    base = dict(groups=16, group_size=8, rewards=[0.0] * 128, spread_share=0.0, truncation_rate=0.0,
                extracted_rate=1.0, accuracy=0.0, max_new_tokens=16)
    return SignalStats(**{**base, **kw})


# ------------------------------------------------------------------------------------ verdicts, synthetic figures
def test_signal_present_is_ok_and_notes_a_high_truncation_rate():
    v = verdict(stats(spread_share=0.25, accuracy=0.1, rewards=[1.0] * 13 + [0.0] * 115, truncation_rate=0.3))
    assert v.ok and v.level == "ok" and v.cause is None
    assert v.notes == ["30% of replies cut at rollout.max_new_tokens=16"]


def test_truncated_replies_name_max_new_tokens():
    v = verdict(stats(truncation_rate=0.805, extracted_rate=0.1))  # the 16-token case: 80.5% cut, 0% right
    assert v.level == "none"
    assert "80% of replies were cut at rollout.max_new_tokens=16" in v.cause  # 80.5% rounds half to even
    assert v.fix == "raise rollout.max_new_tokens (e.g. 64)"


def test_a_cascade_that_misses_the_finished_replies_too_names_the_extractor_not_the_length():
    # SmolLM2-135M-Instruct on word problems with extractors=[answer_tag]: 30% cut at 96 tokens, no answer found in
    # any reply, also in those that ended: a longer cap would not help
    v = verdict(stats(truncation_rate=0.305, extracted_rate=0.0, finished_extracted_rate=0.0, max_new_tokens=96))
    assert v.level == "none" and "extractor found an answer in only 0%" in v.cause
    assert v.notes == ["30% of replies cut at rollout.max_new_tokens=96"]
    v = verdict(stats(truncation_rate=0.805, extracted_rate=0.1, finished_extracted_rate=0.0))  # most replies cut:
    assert "cut at rollout.max_new_tokens=16" in v.cause  # the few that ended early say little


def test_answers_the_extractor_cannot_find_name_the_instruction_and_extractors():
    v = verdict(stats(extracted_rate=0.2))
    assert v.level == "none" and "extractor found an answer in only 20%" in v.cause
    assert "task.options.instruction" in v.fix and "task.options.extractors" in v.fix


def test_all_correct_groups_ask_for_harder_data():
    v = verdict(stats(rewards=[1.0] * 128, accuracy=1.0, all_correct_share=1.0))
    assert v.level == "none" and "100% of groups are all correct" in v.cause and "harder data" in v.fix


def test_a_reward_blind_to_correctness_names_the_weights():
    v = verdict(stats(accuracy=0.3, correct_spread_share=0.5))
    assert "correctness differs in 50% of groups" in v.cause and "answer_weight" in v.fix


def test_never_correct_and_a_constant_reward():
    assert "no reply was correct" in verdict(stats()).cause
    v = verdict(stats(extracted_rate=None, accuracy=None, rewards=[0.5] * 128))  # a bare reward_fn
    assert "every group's rewards are equal (0.5 x128)" in v.cause and "reward function" in v.fix


def test_failed_rewards_come_first():
    v = verdict(stats(error_rate=0.9, first_error="RuntimeError: boom", truncation_rate=0.9))
    assert "90% of rewards failed (RuntimeError: boom)" in v.cause and "reward_fn" in v.fix


def test_tiny_spread_is_weak_and_the_threshold_is_a_setting():
    weak = stats(groups=64, spread_share=2 / 64, truncation_rate=0.5)
    assert verdict(weak).level == "weak" and "max_new_tokens" in verdict(weak).fix
    assert verdict(weak, min_spread=0.01).ok
    assert verdict(weak).line().startswith("signal check: too little learning signal: 50% of replies were cut")


def test_one_group_with_a_spread_is_weak_however_low_the_threshold():
    # word problems at 8 new tokens: every reply cut, one correct reply of 128 in one group of 16 (6.25% > 5%)
    lucky = stats(spread_share=1 / 16, truncation_rate=1.0, extracted_rate=0.3, accuracy=1 / 128, max_new_tokens=8)
    assert verdict(lucky).level == "weak" and verdict(lucky, min_spread=0.01).level == "weak"
    assert "100% of replies were cut at rollout.max_new_tokens=8" in verdict(lucky).cause
    assert verdict(stats(spread_share=2 / 16, truncation_rate=1.0, accuracy=0.02)).ok  # two groups: a signal
    assert verdict(stats(groups=1, spread_share=1.0)).ok  # a check of one group has nothing more to ask


def test_stats_of_groups_hand_counted():
    def group(totals, answers, finish):
        rewards = [RewardResult(t, {"answer": t, "format": 0.0}, a) for t, a in zip(totals, answers)]
        return Group(Example("x", "q", "1"), "p", [1], [[2]] * 2, [[0.0]] * 2, finish, ["a"] * 2, rewards)

    s = signal_stats([group([1.0, 0.0], ["1", "2"], ["stop", "length"]), group([0.0, 0.0], [None, "3"],
                                                                           ["length", "length"])], max_new_tokens=4)
    assert (s.groups, s.group_size, s.rewards) == (2, 2, [1.0, 0.0, 0.0, 0.0])
    assert s.spread_share == 0.5 and s.truncation_rate == 0.75 and s.extracted_rate == 0.75
    assert s.accuracy == 0.25 and s.correct_spread_share == 0.5 and s.all_correct_share == 0.0
    assert s.finished_extracted_rate == 1.0  # the one reply that stopped on its own has an answer
    assert s.distribution() == "0 x3, 1 x1"


def test_rng_untouched_restores_every_global_stream():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    want = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    with rng_untouched():
        random.random(), np.random.rand(3), torch.rand(5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == want


# ------------------------------------------------------------------------------- check.fit_length, synthetic
def cut_by_length(cut: dict[int, float]):
    """A check whose replies are cut at each length n with the share cut[n]; records the lengths it was run at."""
    asked = []

    def check_at(n: int) -> SignalReport:
        asked.append(n)
        s = stats(truncation_rate=cut[n], max_new_tokens=n, spread_share=0.5, accuracy=0.3)
        return SignalReport(s, verdict(s))

    return check_at, asked


def test_fit_length_doubles_while_a_tenth_or_more_is_cut():
    check_at, asked = cut_by_length({16: 0.805, 32: 0.40, 64: 0.10, 128: 0.02, 256: 0.0})
    fit = fit_length(check_at, 16, 512, lambda n: True)
    assert asked == [16, 32, 64, 128] and fit.length == 128 and fit.stopped == ""  # 10% cut is still too many
    lines = fit.lines()
    assert lines[0] == "signal check: 80% of replies cut at rollout.max_new_tokens=16: sampling again at 32 " \
                       "(check.fit_length)"
    assert "check.fit_length: rollout.max_new_tokens 16 -> 128 (2% of replies cut; 4 checks, 0.0 s)" in lines
    assert lines[-1] == fit.report.verdict.line() and "  replies cut at rollout.max_new_tokens=128: 2.0%" in lines


def test_fit_length_never_shortens_and_stops_at_the_limit_or_the_memory():
    check_at, asked = cut_by_length({96: 0.02})
    fit = fit_length(check_at, 96, 512, lambda n: True)
    assert (asked, fit.length) == ([96], 96) and "rollout.max_new_tokens stays 96" in fit.lines()[-2]
    check_at, asked = cut_by_length({96: 0.5, 150: 0.3})
    fit = fit_length(check_at, 96, 150, lambda n: True)  # the limit, not 192
    assert (asked, fit.length, fit.stopped) == ([96, 150], 150, "check.max_new_tokens_limit=150")
    check_at, asked = cut_by_length({96: 0.5, 192: 0.3})
    fit = fit_length(check_at, 96, 512, lambda n: n <= 200)
    assert (asked, fit.length) == ([96, 192], 192)
    assert fit.stopped == "rollout.max_new_tokens=384 would not fit the device's memory"
    assert ("(30% of replies cut; rollout.max_new_tokens=384 would not fit the device's memory; 2 checks, 0.0 s)"
            in fit.lines()[-2])


@pytest.mark.parametrize("other", [["curriculum.mode=semantic_entropy"],
                                   ["tools.enabled=true", "tools.names=[calculator]"]])
def test_fit_length_is_refused_where_the_rollout_length_is_not_the_cap(other):
    with pytest.raises(ConfigError, match="check.fit_length chooses rollout.max_new_tokens"):
        load_config(CFG, ["check.fit_length=true", *other])
    assert load_config(CFG, other).check.fit_length is False  # the same settings load without it


# ----------------------------------------------------------------------------------------- on a tiny model
def test_a_truncating_length_stops_grpo_train_before_step_1(tmp_path, tiny_ckpt, capsys):
    run_dir = tmp_path / "r"
    args = [CFG, f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "rollout.max_new_tokens=2", "check.stop=true"]
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # the report (its figures), then the one error line
    assert [ln for ln in err if ln.startswith("grpo:")] == err[-1:] and "  correct: 0.0%" in err
    assert err[-1].startswith("grpo: error: signal check: no learning signal: ")
    assert "replies were cut at rollout.max_new_tokens=2: raise rollout.max_new_tokens (e.g. 8)" in err[-1]
    assert "--no-check" in err[-1]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())  # no step ran
    assert main(["check", *args[:1], f"model.path={tiny_ckpt}", "rollout.max_new_tokens=2"]) == 2
    out = capsys.readouterr().out
    assert "replies cut at rollout.max_new_tokens=2: 9" in out and "raise rollout.max_new_tokens" in out


def test_check_and_held_out_leave_the_run_bit_identical(tmp_path, tiny_ckpt, monkeypatch, capsys):
    """grpo train with the check (and before / after), with --no-check, and the bare library train(): the same
    metrics and weights, and the check ran (with a varying reward it finds a signal and goes on)."""
    custom = custom_task_config(tmp_path, monkeypatch)
    over = [f"model.path={tiny_ckpt}", "schedule.steps=2", "rollout.max_new_tokens=6", "algorithm.mu=2",
            "check.groups=3", "algorithm.group_filter.enabled=true"]
    assert main(["train", custom, *over, f"run_dir={tmp_path / 'a'}"]) == 0
    out = capsys.readouterr()
    assert "signal check: 3 prompts x 4 replies" in out.out + out.err
    assert "signal check: learning signal present" in out.out + out.err
    assert main(["train", custom, *over, f"run_dir={tmp_path / 'b'}", "--no-check"]) == 0
    assert "signal check" not in "".join(capsys.readouterr())
    train(load_config(custom, over + [f"run_dir={tmp_path / 'c'}"]))
    strip = lambda rows: [{k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in rows]  # noqa: E731
    a, b, c = (strip(_metrics(tmp_path / x)) for x in "abc")
    assert len(a) == 2 and a == b == c
    weights = [load_model(tmp_path / x / "checkpoints/step-000002/model").state_dict() for x in "abc"]
    assert all(torch.equal(weights[0][k], w[k]) for w in weights[1:] for k in weights[0])


def test_before_after_json_and_the_random_reward_control(tmp_path, tiny_ckpt, capsys):
    run_dir = tmp_path / "r"
    args = ["train", CFG, f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "eval.max_examples=4",
            "eval.max_new_tokens=300", "rollout.max_new_tokens=5", "schedule.steps=2"]  # 300 > the model's 64
    assert main([*args, "--no-check"]) == 0
    assert "Held-out greedy results (4 problems)" in capsys.readouterr().out
    got = json.loads((run_dir / "before_after.json").read_text())
    assert set(got["before"]) == set(got["after"]) == {"accuracy", "format_rate", "mean_length"}
    assert got["problems"] == 4 and got["control"] is None and got["seconds"] > 0
    assert 1 <= got["before"]["mean_length"] <= 5 and 0 <= got["after"]["accuracy"] <= 1  # rollout's cap
    assert main([*args, "--control", "random-reward", "--no-check"]) == 0
    control = Path(f"{run_dir}-random-reward")
    assert json.loads((control / "before_after.json").read_text())["control"] == "random-reward"
    stored = yaml.safe_load((control / "checkpoints/step-000002/config.yaml").read_text())
    assert stored["algorithm"]["random_reward"] is True and stored["run_dir"] == str(control)
    assert json.loads((run_dir / "before_after.json").read_text()) == got  # the main run untouched
    assert main([*args, "schedule.steps=3", "--resume"]) == 0  # resumed: the run's start stays its `before`
    resumed = json.loads((run_dir / "before_after.json").read_text())
    assert resumed["before"] == got["before"]


def test_no_tools_control_needs_a_run_with_tools(tmp_path, tiny_ckpt, capsys):
    assert main(["train", CFG, f"model.path={tiny_ckpt}", f"run_dir={tmp_path}", "--control", "no-tools"]) == 2
    assert "tools.enabled" in capsys.readouterr().err


@pytest.mark.parametrize("both", [True, False])
def test_the_two_data_path_spellings_are_one_setting(tmp_path, both):
    from grpo_engine.tasks import build_task

    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for p in (a, b):
        p.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(30)))
    if both:
        task = build_task("custom", {"data_path": str(a)}, str(a))
        assert len(task.examples("train")) == 27
        with pytest.raises(ValueError, match="name two files: they are one setting"):
            build_task("custom", {"data_path": str(a)}, str(b))
    else:
        assert build_task("custom", {}, str(a)).options.data_path == str(a)


def test_fit_length_trains_at_the_length_found_and_a_resume_keeps_it(tmp_path, tiny_ckpt, capsys):
    """The tiny random model's replies run on: the fit doubles 2 -> 4 -> 8 (the limit), and the run is the run
    with rollout.max_new_tokens=8 set, bit for bit; the checkpoint stores 8, and --resume goes on at 8."""
    over = [f"model.path={tiny_ckpt}", "schedule.steps=2", "check.stop=false", "check.groups=2"]
    fitted = [*over, f"run_dir={tmp_path / 'a'}", "rollout.max_new_tokens=2", "check.fit_length=true",
              "check.max_new_tokens_limit=8"]
    assert main(["train", CFG, *fitted]) == 0
    out = "".join(capsys.readouterr())
    assert "cut at rollout.max_new_tokens=2: sampling again at 4 (check.fit_length)" in out
    assert "check.fit_length: rollout.max_new_tokens 2 -> 8 (" in out
    assert "check.max_new_tokens_limit=8; 3 checks, " in out
    assert main(["train", CFG, *over, f"run_dir={tmp_path / 'b'}", "rollout.max_new_tokens=8", "--no-check"]) == 0
    strip = lambda rows: [{k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in rows]  # noqa: E731
    a, b = strip(_metrics(tmp_path / "a")), strip(_metrics(tmp_path / "b"))
    assert a == b and max(r["completion_len_mean"] for r in a) > 2
    stored = yaml.safe_load((tmp_path / "a/checkpoints/step-000002/config.yaml").read_text())
    assert stored["rollout"]["max_new_tokens"] == 8
    capsys.readouterr()
    assert main(["train", CFG, *[f for f in fitted if f != "schedule.steps=2"], "schedule.steps=3", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "resume: rollout.max_new_tokens 8, as check.fit_length chose it" in err
    assert "rollout.max_new_tokens 8 -> 2" not in err and "signal check" not in err
    resumed = yaml.safe_load((tmp_path / "a/checkpoints/step-000003/config.yaml").read_text())
    assert resumed["rollout"]["max_new_tokens"] == 8
