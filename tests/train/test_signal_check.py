"""The signal check before training (collect/signal_check.py, `grpo check`, `grpo train`'s default), and `grpo
train`'s before / after on held-out examples with its random-reward control."""

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_e2e import CFG, VOLATILE, _metrics, custom_task_config

from grpo_engine.cli import main
from grpo_engine.collect.groups import Group, prompt_seed
from grpo_engine.collect.signal_check import (
    CheckSettings,
    LengthFit,
    RolloutFit,
    SignalReport,
    SignalStats,
    fit_group_size,
    fit_length,
    grow_groups,
    rng_untouched,
    signal_stats,
    verdict,
)
from grpo_engine.config import ConfigError, load_config
from grpo_engine.model.loading import load_model
from grpo_engine.rollout import SamplingParams
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


def test_rare_right_replies_name_the_group_size():
    v = verdict(stats(spread_share=1 / 16, accuracy=0.01, correct_spread_share=1 / 16))
    assert v.level == "weak" and v.cause == "rewards differ in only 6% of groups (1.0% of replies correct)"
    assert "raise rollout.group_size (check.fit_group_size chooses it)" in v.fix


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


# --------------------------------------------------------------------------- check.fit_group_size, synthetic
def spread_by_group(spread: dict[int, float], **kw):
    """A check whose groups of G replies have a spread in the share spread[G]; records the (G, P) it was run at.
    check_at(g, p) is the check at g; grow(report, p) the check at twice report's group size."""
    asked = []

    def check_at(g: int, p: int) -> SignalReport:
        asked.append((g, p))
        s = stats(group_size=g, spread_share=spread[g], accuracy=0.02, **kw)
        return SignalReport(s, verdict(s))

    def grow(report: SignalReport, p: int) -> SignalReport:  # the same prompts had report's spread before
        grown = check_at(2 * report.stats.group_size, p)
        return SignalReport(replace(grown.stats, spread_before=report.stats.spread_share), grown.verdict)

    check_at.grow = grow
    return check_at, asked


def test_fit_group_size_doubles_the_group_and_halves_the_prompts_while_the_signal_is_too_little():
    # rare right replies: a group of G has a spread with probability 1 - p^G - (1-p)^G, about G p for small p
    check_at, asked = spread_by_group({8: 0.02, 16: 0.04, 32: 0.08}, groups=64)  # 5% at least is enough
    fit = fit_group_size(check_at.grow, check_at(8, 8), 8, 32, 1, lambda g, p: True)
    assert asked == [(8, 8), (16, 4), (32, 2)] and (fit.group_size, fit.prompts, fit.stopped) == (32, 2, "")
    assert fit.tried()[0] == ("signal check: 2% of groups with a reward spread at rollout.group_size=8: sampling "
                              "again at 16 (check.fit_group_size)")
    assert fit.choice() == ["check.fit_group_size: rollout.group_size 8 -> 32, rollout.prompts_per_step -> 2 (8% of "
                            "groups with a spread; 3 checks, 0.0 s)"]


def test_fit_group_size_stops_at_the_limit_the_prompts_the_ranks_or_the_memory():
    rare = {4: 0.01, 8: 0.02, 16: 0.04, 32: 0.06}  # of 64 groups: too little (under 5%) up to G = 16
    for prompts, limit, ranks, fits, want, stopped in [
            (8, 32, 1, lambda g, p: True, (32, 1), ""),
            (8, 16, 1, lambda g, p: True, (16, 2), "check.group_size_limit=16"),
            (2, 32, 1, lambda g, p: True, (8, 1), "rollout.prompts_per_step=1 cannot halve"),
            (8, 32, 4, lambda g, p: True, (8, 4), "rollout.prompts_per_step=4 cannot halve"),  # 2 prompts, 4 ranks
            (8, 32, 1, lambda g, p: g <= 8, (8, 4), "rollout.group_size=16 would not fit the device's memory")]:
        check_at, asked = spread_by_group(rare, groups=64)
        fit = fit_group_size(check_at.grow, check_at(4, prompts), prompts, limit, ranks, fits)
        assert ((fit.group_size, fit.prompts), fit.stopped) == (want, stopped)
        assert asked[-1] == want and all(g * p == 4 * prompts for g, p in asked)  # as many replies per step


def test_fit_group_size_keeps_the_smaller_group_when_the_larger_has_no_more_spread():
    # prompts the model never gets right stay so at any size: 16 would only halve the prompts a step learns from
    check_at, asked = spread_by_group({8: 1 / 16, 16: 1 / 16})
    fit = fit_group_size(check_at.grow, check_at(8, 8), 8, 32, 1, lambda g, p: True)
    assert asked == [(8, 8), (16, 4)] and (fit.group_size, fit.prompts) == (8, 8)
    assert fit.report is fit.reports[0] and fit.stopped == "groups of 16 had a spread no more often (6%)"
    assert fit.choice()[0].startswith("check.fit_group_size: rollout.group_size stays 8 (6% of groups with a spread; "
                                      "groups of 16 had a spread no more often (6%); 2 checks")


@pytest.mark.parametrize("setting", [dict(truncation_rate=0.5), dict(extracted_rate=0.2), dict(error_rate=0.6)])
def test_fit_group_size_leaves_a_spread_missing_for_a_setting_and_enough_spread_alone(setting):
    check_at, asked = spread_by_group({8: 1 / 16, 16: 4 / 16}, **setting)
    fit = fit_group_size(check_at.grow, check_at(8, 8), 8, 32, 1, lambda g, p: True)  # more replies would not help
    assert (asked, fit.group_size, fit.prompts) == ([(8, 8)], 8, 8)
    assert fit.choice()[0] == "check.fit_group_size: rollout.group_size stays 8 (6% of groups with a spread)"
    for enough in (2 / 16, 0.25):  # conversions and word problems: 25%, where 8 x 8 learned more than 16 x 4
        check_at, asked = spread_by_group({8: enough})
        assert fit_group_size(check_at.grow, check_at(8, 8), 8, 32, 1, lambda g, p: True).group_size == 8


def test_grow_groups_samples_only_the_replies_a_group_lacks():
    """Half of the 8 groups of 2 grow to 4: 2 more replies each, with seeds unlike the first check's, after the
    ones they had; a prompt answered right once in 2 more replies differs."""
    def group(ex, totals, tag):
        rewards = [RewardResult(t, {"answer": t}, str(t)) for t in totals]
        return Group(ex, "p", [1], [[7]] * len(totals), [[0.0]] * len(totals), ["stop"] * len(totals),
                     [f"{tag}{i}" for i in range(len(totals))], rewards)

    examples = [Example(str(i), f"q{i}", "1") for i in range(8)]
    first = [group(ex, [0.0, 0.0], "first") for ex in examples]
    calls = []

    def more(model, tokenizer, task, exs, params, seeds, max_prompt_tokens):
        calls.append(([e.id for e in exs], params.n, seeds))
        return [group(e, [1.0, 0.0] if e.id == "0" else [0.0, 0.0], "more") for e in exs], 0

    s0 = signal_stats(first, max_new_tokens=4)
    grown = grow_groups(None, None, None, SignalReport(s0, verdict(s0), first), SamplingParams(n=4, max_new_tokens=4),
                        CheckSettings(batch=8), seed=3, max_prompt_tokens=None, sample_groups=more)
    assert [(ids, n) for ids, n, _ in calls] == [(["0", "1", "2", "3"], 2)]  # the first half, 2 replies each
    assert not set(calls[0][2]) & {prompt_seed(3, 0, 0, i) for i in range(8)}  # not the first check's seeds
    assert [g.texts for g in grown.groups] == [["first0", "first1", "more0", "more1"]] * 4
    assert (grown.stats.groups, grown.stats.group_size, grown.stats.spread_share) == (4, 4, 0.25)
    assert grown.stats.spread_before == 0.0  # the same 4 prompts at 2 replies


def test_a_grown_group_is_kept_only_when_more_of_the_same_prompts_differ():
    # grown groups never differ less often than they did: the first half of a check with 1 in 16 may have had 2 in 8
    first = stats(group_size=8, spread_share=1 / 16, accuracy=0.01)
    for before, kept in [(0.25, 8), (0.125, 16)]:
        grown = SignalReport(s := stats(groups=8, group_size=16, spread_share=0.25, accuracy=0.01,
                                        spread_before=before), verdict(s))
        fit = fit_group_size(lambda r, p, grown=grown: grown, SignalReport(first, verdict(first)), 8, 16, 1,
                             lambda g, p: True)
        assert fit.group_size == kept


def test_rollout_fit_reads_the_length_then_the_group():
    check_at, _ = spread_by_group({8: 1 / 16, 16: 0.25})
    first = check_at(8, 8)
    length = LengthFit(96, [first], fitted=False)
    both = RolloutFit(length, fit_group_size(check_at.grow, first, 8, 32, 1, lambda g, p: True))
    lines = both.lines()
    assert lines[0].startswith("signal check: 6% of groups with a reward spread at rollout.group_size=8")
    assert lines[1] == "signal check: 16 prompts x 16 replies with the rollout's settings (0.0 s)"  # the last check
    assert lines[-2].startswith("check.fit_group_size: rollout.group_size 8 -> 16")
    assert lines[-1] == both.report.verdict.line() and both.report is both.group.reports[-1]
    assert RolloutFit(length).lines() == first.lines()  # neither fit: the one check's report


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
    assert "resume: rollout.max_new_tokens 8, as the signal check chose for the run resumed" in err
    assert "rollout.max_new_tokens 8 -> 2" not in err and "signal check:" not in err  # no check again
    resumed = yaml.safe_load((tmp_path / "a/checkpoints/step-000003/config.yaml").read_text())
    assert resumed["rollout"]["max_new_tokens"] == 8


def test_fit_group_size_trains_with_the_sizes_found_and_a_resume_keeps_them(tmp_path, tiny_ckpt, monkeypatch,
                                                                           capsys):
    """A reward one reply in eight earns, and a check that asks for a spread in 90% of its groups: too little at
    groups of 2 (25%), more at 4 among the same prompts, so the fit doubles to 4 (the limit) with 1 prompt per step;
    the run is the run with those sizes set, bit for bit, and --resume keeps them."""
    custom = yaml.safe_load(Path(custom_task_config(tmp_path, monkeypatch)).read_text())
    data = tmp_path / "prompts.jsonl"  # enough prompts for the check's 16 groups
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(64)))
    custom["task"]["options"]["data_path"] = str(data)
    custom["task"]["options"]["reward_fn"] = "reward_fns:rare_checksum"  # replies end at their first broken
    # byte (U+FFFD, which most of the random model's replies hold), so they are not cut and rarity is the cause
    (tmp_path / "rare.yaml").write_text(yaml.safe_dump(custom))
    over = [str(tmp_path / "rare.yaml"), f"model.path={tiny_ckpt}", "schedule.steps=2", "check.stop=false",
            "check.min_spread=0.9", "check.groups=16", "rollout.max_new_tokens=4", "algorithm.mu=1",
            "rollout.stop_strings=[\ufffd]"]
    fitted = [*over, f"run_dir={tmp_path / 'a'}", "rollout.prompts_per_step=2", "rollout.group_size=2",
              "check.fit_group_size=true", "check.group_size_limit=4"]
    assert main(["train", *fitted]) == 0
    out = "".join(capsys.readouterr())
    assert "at rollout.group_size=2: sampling again at 4 (check.fit_group_size)" in out
    assert "check.fit_group_size: rollout.group_size 2 -> 4, rollout.prompts_per_step -> 1 (" in out
    set_by_hand = [*over, f"run_dir={tmp_path / 'b'}", "rollout.prompts_per_step=1", "rollout.group_size=4"]
    assert main(["train", *set_by_hand, "--no-check"]) == 0
    strip = lambda rows: [{k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in rows]  # noqa: E731
    assert strip(_metrics(tmp_path / "a")) == strip(_metrics(tmp_path / "b"))
    stored = yaml.safe_load((tmp_path / "a/checkpoints/step-000002/config.yaml").read_text())["rollout"]
    assert (stored["group_size"], stored["prompts_per_step"]) == (4, 1)
    capsys.readouterr()
    assert main(["train", *[f for f in fitted if f != "schedule.steps=2"], "schedule.steps=3", "--resume"]) == 0
    err = capsys.readouterr().err
    assert "resume: rollout.group_size 4, rollout.prompts_per_step 1, as the signal check chose" in err
    resumed = yaml.safe_load((tmp_path / "a/checkpoints/step-000003/config.yaml").read_text())["rollout"]
    assert (resumed["group_size"], resumed["prompts_per_step"]) == (4, 1)
