"""`grpo bench step --json` prints one JSON line with the step time and peak memory."""

import json

import pytest

from grpo_engine.cli import main
from grpo_engine.kernels import cpu_model


def test_bench_step_json(tiny_ckpt, capsys):
    assert main(["bench", "step", "--model", str(tiny_ckpt), "--prompts", "2", "--group", "2", "--max-new", "4",
                 "--prompt-len", "24", "--steps", "3", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    times = result["step_times"]
    assert len(times) == 3 and result["sec_per_step"] == (times[1] + times[2]) / 2  # median after the first
    assert result["peak_rss_mib"] > 10 and result["max_new_tokens"] == 4 and result["group"] == 2
    assert result["cpu"] == cpu_model()  # recorded figures name the CPU they were measured on


@pytest.fixture
def recorded_steps(monkeypatch) -> list:
    """The StepRecords of every train.step.grpo_step call the test makes (the real function runs)."""
    import grpo_engine.train.step as step_mod

    records, real = [], step_mod.grpo_step
    monkeypatch.setattr(step_mod, "grpo_step", lambda *a, **k: records.append(real(*a, **k)) or records[-1])
    return records


def test_bench_step_runs_the_trainers_step(tiny_ckpt, recorded_steps):
    """The benchmark times train.step.grpo_step itself (not a hand-assembled copy) with the config's defaults,
    and every completion has exactly --max-new tokens."""
    from grpo_engine.bench.step import bench_step
    from grpo_engine.config import load_config

    records = recorded_steps
    result = bench_step(str(tiny_ckpt), prompts=2, group=3, max_new=5, prompt_len=24, steps=2)
    assert len(records) == 2 and result["step_times"] == [r.metrics.time_step_s for r in records]
    assert all(len(c) == 5 for r in records for g in r.collected.groups for c in g.completion_ids)
    from grpo_engine.plan.from_config import config_memory_choice

    defaults = load_config()
    cpu = config_memory_choice(defaults, None)  # the settings the defaults leave to the engine, as a CPU run picks them
    assert (result["micro_batch_tokens"], result["chunk_size"], result["optimizer"]) == (
        cpu.micro_batch_tokens, cpu.logprob_chunk_size, defaults.optimizer.name)


def test_bench_step_trains_every_row_even_when_completions_decode_to_nothing(tmp_path, recorded_steps):
    """A random model whose vocabulary is larger than its byte tokenizer samples ids that decode to '', so a
    reward of the text would be equal within each group and skip_zero_advantage would drop every row: the
    benchmark would time no update. Its reward differs within every group, so all P x G rows train."""
    from grpo_engine.bench.step import bench_step
    from grpo_engine.model.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "wide", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, intermediate_size=64, vocab_size=4096)
    records = recorded_steps
    bench_step(str(ckpt), prompts=2, group=3, max_new=4, prompt_len=24, steps=2)
    texts = [t for r in records for g in r.collected.groups for t in g.texts]
    assert sum(t == "" for t in texts) >= len(texts) // 2  # the situation this guards against
    assert [r.metrics.rows for r in records] == [6, 6] and [r.metrics.train_tokens for r in records] == [24, 24]


def _step_vs_trl():
    from benchmark_scripts import load_benchmark

    return load_benchmark("step_vs_trl")


def test_step_vs_trl_runs_our_step_on_the_cpu_like_trl(tmp_path):
    """benchmarks/step_vs_trl.py compares CPU steps: TRL runs with use_cpu=True, so our child must be pinned to the
    CPU too (with model.device: auto it took a GPU where one was present and timed 1.3 s steps against TRL's 39 s)."""
    import argparse

    args = argparse.Namespace(prompts=4, group=8, max_new=64, prompt_len=32, steps=3, threads=2, chunk_size=None,
                              micro_batch_tokens=None)
    cmd = _step_vs_trl().ours_command(args, tmp_path)
    assert cmd[cmd.index("step") + 1 :].count("model.device=cpu") == 1 and cmd[-1] == "model.device=cpu"


FAKE_ENGINE = """
import sys, time
sys.path.insert(0, {repo!r})
from grpo_engine.bench.turns import StepTurns
name, log, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
turns = StepTurns.parse(sys.argv[sys.argv.index("--turn-fds") + 1])
def say(what):
    with open(log, "a") as f:
        f.write(f"{{name}} {{what}} start\\n")
    time.sleep(0.05)  # anything the other process did meanwhile would land between start and end
    with open(log, "a") as f:
        f.write(f"{{name}} {{what}} end\\n")
say("setup")
for step in range(1, steps + 1):
    turns.wait()
    say(f"step{{step}}")
say("teardown")
print('{{"engine": "' + name + '"}}')
"""


def test_step_vs_trl_alternates_the_engines_steps(tmp_path):
    """Both children live at once but never work at the same time: each one's set-up alone, then step 1 of each,
    step 2 of each, ...; the work after a child's last step (ours measures the GEMM rate there) is alone too."""
    import sys
    from pathlib import Path

    bench = _step_vs_trl()
    engine = tmp_path / "engine.py"
    engine.write_text(FAKE_ENGINE.format(repo=str(Path(__file__).resolve().parents[1])))
    log = tmp_path / "order.log"
    commands = {name: [sys.executable, str(engine), name, str(log), str(steps)]
                for name, steps in (("ours", 3), ("trl", 2))}
    results = bench.run_interleaved(commands, tmp_path)
    assert results["ours"]["engine"] == "ours" and results["trl"]["engine"] == "trl"
    lines = log.read_text().split("\n")[:-1]
    phases = [(name, what) for name, what, _ in (line.split() for line in lines[::2])]
    assert all(a.split()[:2] == b.split()[:2] and b.endswith("end") for a, b in zip(lines[::2], lines[1::2]))
    assert phases == [("ours", "setup"), ("trl", "setup"), ("ours", "step1"), ("trl", "step1"), ("ours", "step2"),
                      ("trl", "step2"), ("trl", "teardown"), ("ours", "step3"), ("ours", "teardown")]


def test_step_vs_trl_reports_a_failed_child(tmp_path):
    """A child that dies before its first step ends the run with its exit code, not a hang, and before the next
    engine's set-up (minutes for TRL) starts."""
    import sys

    import pytest

    bench = _step_vs_trl()
    failing = [sys.executable, "-c", "import sys; print('no model here', file=sys.stderr); sys.exit(3)"]
    started = tmp_path / "trl-started"
    second = [sys.executable, "-c", f"open({str(started)!r}, 'w')"]
    with pytest.raises(RuntimeError, match="exit 3"):
        bench.run_interleaved({"ours": failing, "trl": second}, tmp_path)
    assert not started.exists()


def test_paired_ratios_take_each_step_against_its_partner():
    assert _step_vs_trl().paired_ratios([2.0, 3.0, 1.0], [4.0, 6.0, 5.0]) == [0.5, 0.5, 0.2]


def test_turn_fds_are_checked():
    import pytest

    from grpo_engine.bench.turns import StepTurns, TurnError

    with pytest.raises(TurnError, match="READ,WRITE"):
        StepTurns.parse("5")
    with pytest.raises(TurnError, match="not open"):
        StepTurns.parse("999,998")


def test_bench_step_waits_for_its_turn_before_each_step(tiny_ckpt, recorded_steps):
    """before_step (the turn of benchmarks/step_vs_trl.py) runs once before each step, outside the step's time."""
    from grpo_engine.bench.step import bench_step

    seen = []
    bench_step(str(tiny_ckpt), prompts=2, group=2, max_new=3, prompt_len=24, steps=3,
               before_step=lambda: seen.append(len(recorded_steps)))
    assert seen == [0, 1, 2]


def test_floor_ratio_takes_each_step_against_the_gemm_rate_measured_around_it(tiny_ckpt):
    """The machine's speed drifts, so each step's time is set against the floor at the better of the rates read
    just before and just after it: a step twice as slow at half the rate is as far from its floor as a fast one at
    full rate, and one low reading does not lengthen a step's floor."""
    from grpo_engine.bench.floor import StepSizes, step_flops
    from grpo_engine.bench.step import bench_inputs, matmul_floor

    inputs, _ = bench_inputs(str(tiny_ckpt), prompts=2, group=3, max_new=5, prompt_len=24, steps=3)
    times = [9.0, 2.0, 4.0]
    rates = [{"torch": 50.0, "onednn": 10.0}, {"torch": 100.0, "onednn": 20.0}, {"torch": 40.0, "onednn": 50.0},
             {"torch": 30.0, "onednn": 25.0}]  # before each step, and after the last
    floor = matmul_floor(inputs, prompt_len=24, max_new=5, times=times, rates=rates)
    cfg = inputs.cfg
    flops = step_flops(inputs.policy.model.config, StepSizes(2, 3, 24, 5, shared_prompt=cfg.memory.share_prompt_forward,
                                                             fused_head=True, recompute=0.0)).total / 1e9
    assert floor["gemm_gflops_per_step"] == [100.0, 100.0, 50.0]  # step 1: 50 before it, 100 after it
    assert floor["sec_per_step_over_floor"] == pytest.approx(2.0 * 100 / flops)  # steps 2 and 3: 200 / flops
    assert floor["floor_s"] == pytest.approx((flops / 100 + flops / 50) / 2)
    assert floor["gemm_gflops"] == {"torch": 70.0, "onednn": 50.0}  # medians of the steps after the first
    with pytest.raises(ValueError, match="one before each and one after"):
        matmul_floor(inputs, prompt_len=24, max_new=5, times=times, rates=rates[:3])
