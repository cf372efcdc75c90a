"""benchmarks/step_vs_trl.py's TRL peers: fp32 TRL (`trl`) and TRL with GRPOConfig(bf16=True) (`trl-bf16`), each
reported against ours from the same interleaved run."""

import argparse
import json
import statistics

import pytest
from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench():
    return load_benchmark("step_vs_trl")


def _args(bench, *extra):
    return bench.parse_args(["--prompts", "2", "--group", "2", "--max-new", "3", "--steps", "3", *extra])


def test_trl_bf16_engine_starts_a_trl_child_with_bf16(bench, tmp_path):
    """The engine trl-bf16 is the TRL child with --trl-bf16, which the child reads back as bf16=True; plain trl
    stays fp32."""
    args = _args(bench)
    bf16_cmd = bench.ENGINE_COMMANDS["trl-bf16"](args, tmp_path)
    fp32_cmd = bench.ENGINE_COMMANDS["trl"](args, tmp_path)
    assert bf16_cmd == [*fp32_cmd, "--trl-bf16"] and "--trl-bf16" not in fp32_cmd
    child = bench.parse_args(bf16_cmd[2:])  # [python, script, ...]
    assert child.child == "trl" and child.trl_bf16 and not bench.parse_args(fp32_cmd[2:]).trl_bf16


def test_trl_config_sets_bf16_only_for_trl_bf16_and_keeps_fp32_weights(bench):
    fp32 = bench.trl_config_kwargs(_args(bench), "out", [0])
    bf16 = bench.trl_config_kwargs(_args(bench, "--trl-bf16"), "out", [0])
    assert (fp32["bf16"], bf16["bf16"]) == (False, True) and fp32["fp16"] is bf16["fp16"] is False
    assert {k: v for k, v in bf16.items() if k != "bf16"} == {k: v for k, v in fp32.items() if k != "bf16"}
    assert bf16["model_init_kwargs"] == {"dtype": "float32"} and bf16["use_cpu"] is True  # autocast, fp32 master


def test_trl_accepts_the_bf16_config(bench):
    trl = pytest.importorskip("trl")
    config = trl.GRPOConfig(**bench.trl_config_kwargs(_args(bench, "--trl-bf16"), "out", [0]))
    assert config.bf16 is True and config.fp16 is False


def _result(times, rss):
    return {"params": 10, "sec_per_step": statistics.median(times[1:]), "step_times": times,
            "peak_rss_mib": rss, "mean_completion_len": 3.0, "threads": 2}


def test_report_sets_ours_against_each_trl(bench, capsys):
    """Hand-computed: pairs against trl 0.5, 0.25, 0.5 -> median after the first 0.375; against trl-bf16 0.5,
    0.5, 0.75 -> 0.625, over the 0.6 target; the fp32 keys keep their names, the bf16 ones carry _trl_bf16."""
    results = {"ours": _result([4.0, 2.0, 3.0], 100.0), "trl": _result([8.0, 8.0, 6.0], 400.0),
               "trl-bf16": _result([8.0, 4.0, 4.0], 250.0)}
    summary = bench.report(_args(bench), results)
    assert summary["pair_time_ratios"] == [0.5, 0.25, 0.5] and summary["time_ratio"] == 0.375
    assert summary["pair_time_ratios_trl_bf16"] == [0.5, 0.5, 0.75] and summary["time_ratio_trl_bf16"] == 0.625
    assert summary["rss_ratio"] == 0.25 and summary["rss_ratio_trl_bf16"] == 0.4
    assert summary["min_time_ratio_trl_bf16"] == 0.5 and summary["median_time_ratio_trl_bf16"] == 2.5 / 4.0
    assert summary["targets_met"] == {"time_ratio<=0.25": False, "rss_ratio<=0.45": True,  # SMALL's targets
                                      "time_ratio_trl_bf16<=0.6": False}
    out = capsys.readouterr().out
    assert "ratios (ours / trl): time 0.375" in out and "ratios (ours / trl-bf16): time 0.625" in out
    json.dumps(summary)  # the last line of the run


def test_the_smollm2_shape_has_its_own_targets(bench):
    args = bench.parse_args(["--hidden", "576", "--layers", "30", "--heads", "9", "--kv-heads", "3",
                             "--intermediate", "1536", "--vocab", "49152"])
    summary = bench.report(args, {"ours": _result([4.0, 3.0, 3.5], 100.0), "trl": _result([8.0, 8.0, 8.0], 210.0)})
    assert summary["time_ratio"] == 0.40625 and summary["targets_met"] == {"time_ratio<=0.4": False,
                                                                         "rss_ratio<=0.5": True}


def test_report_without_trl_bf16_has_no_bf16_keys(bench):
    summary = bench.report(_args(bench), {"ours": _result([4.0, 2.0, 3.0], 100.0),
                                          "trl": _result([8.0, 8.0, 6.0], 400.0)})
    assert not [k for k in summary if k.endswith("_trl_bf16")] and len(summary["targets_met"]) == 2


def test_unknown_engine_is_one_clear_error(bench):
    with pytest.raises(SystemExit, match="give a comma list of ours, ours-fp32, ours-bf16, trl, trl-bf16"):
        bench.main(["--engines", "ours,trl-fp8"])


@pytest.mark.slow
def test_trl_bf16_child_runs_a_tiny_step(bench, tmp_path):
    """The TRL child itself, with bf16=True, on a tiny checkpoint (only where TRL is installed)."""
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    args = _args(bench, "--hidden", "64", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--intermediate",
                 "128", "--vocab", "272", "--prompt-len", "24", "--steps", "2", "--trl-bf16")
    args.model = str(bench.make_checkpoint(args, tmp_path / "model"))
    result = bench.trl_child(argparse.Namespace(**{**vars(args), "turn_fds": None}))
    assert result["engine"] == "trl-bf16" and result["bf16"] is True and len(result["step_times"]) == 2
    assert result["min_completion_len"] == 3  # every completion has --max-new tokens
