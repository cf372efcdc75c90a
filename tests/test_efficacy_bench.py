"""benchmarks/efficacy_vs_trl.py --real: what TRL is given comes from the real-model recipe, and the ratios
and per-seed means it reports are the ones its targets name."""

from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from grpo_engine.config import load_config
from grpo_engine.demo import REAL_RECIPE


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("efficacy_vs_trl")


def test_real_settings_are_the_recipes(bench):
    cfg = load_config(Path(str(REAL_RECIPE)))
    st = bench.grpo_settings(bench.parse_args(["--real"]))
    assert st == {"prompts": cfg.rollout.prompts_per_step, "group": cfg.rollout.group_size,
                  "max_new": cfg.rollout.max_new_tokens, "temperature": cfg.rollout.temperature,
                  "lr": cfg.optimizer.lr, "steps": cfg.schedule.steps, "betas": tuple(cfg.optimizer.betas),
                  "weight_decay": cfg.optimizer.weight_decay, "grad_clip": cfg.optimizer.grad_clip,
                  "loss_type": "grpo"}
    shorter = bench.grpo_settings(bench.parse_args(["--real", "--recipe-set", "schedule.steps=3"]))
    assert shorter["steps"] == 3


def test_a_recipe_trl_cannot_mirror_is_refused(bench):
    with pytest.raises(SystemExit, match="loss=dapo"):
        bench.grpo_settings(bench.parse_args(["--real", "--recipe-set", "algorithm.loss=dapo"]))


def test_ratios_and_seed_means(bench, capsys):
    def run(seed, ours, trl):
        results = {"ours": dict(zip(("accuracy", "grpo_wall_s", "peak_rss_mib"), ours)),
                   "trl": dict(zip(("accuracy", "grpo_wall_s", "peak_rss_mib"), trl))}
        return {"settings": {"seed": seed}, "sft_accuracy": 0.2, "results": results}

    summary = bench.over_seeds([run(0, (0.6, 100.0, 3000.0), (0.5, 400.0, 6000.0)),
                                run(1, (0.4, 140.0, 3200.0), (0.5, 400.0, 6400.0))])
    assert summary["mean"]["ours"] == {"accuracy": pytest.approx(0.5), "grpo_wall_s": 120.0, "peak_rss_mib": 3100.0}
    assert summary["time_ratio"] == pytest.approx(120 / 400)
    assert summary["rss_ratio"] == pytest.approx(3100 / 6200)
    assert summary["accuracy_delta"] == pytest.approx(0.0)
    assert summary["targets_met"] == {"accuracy_ours>=trl": True, "time_ratio<=0.5": True, "rss_ratio<=0.5": True}
    assert "peak RSS 0.500" in capsys.readouterr().out


def test_settings_trl_lacks_are_named(bench):
    """Dynamic sampling has no TRL counterpart: the report names it whenever our run uses it."""
    on = bench.ours_only(bench.parse_args(["--real", "--recipe-set", "algorithm.group_filter.enabled=true",
                                           "--recipe-set", "algorithm.group_filter.max_rounds=2"]))
    off = bench.ours_only(bench.parse_args(["--real", "--ours-set", "algorithm.group_filter.enabled=false"]))
    assert len(on) == 1 and "dynamic sampling" in on[0] and "up to 2 generation rounds" in on[0]
    assert off == [] and bench.ours_only(bench.parse_args([])) == []
