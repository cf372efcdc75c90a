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
    assert all(len(c) == 5 for r in records for g in r.rollout.groups for c in g.completion_ids)
    defaults = load_config()
    assert (result["micro_batch_tokens"], result["chunk_size"], result["optimizer"]) == (
        defaults.memory.micro_batch_tokens, defaults.memory.logprob_chunk_size, defaults.optimizer.name)


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
    texts = [t for r in records for g in r.rollout.groups for t in g.texts]
    assert sum(t == "" for t in texts) >= len(texts) // 2  # the situation this guards against
    assert [r.metrics.rows for r in records] == [6, 6] and [r.metrics.train_tokens for r in records] == [24, 24]


def test_step_vs_trl_runs_our_step_on_the_cpu_like_trl(tmp_path, monkeypatch):
    """benchmarks/step_vs_trl.py compares CPU steps: TRL runs with use_cpu=True, so our child must be pinned to the
    CPU too (with model.device: auto it took a GPU where one was present and timed 1.3 s steps against TRL's 39 s)."""
    import argparse
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "step_vs_trl.py"
    spec = importlib.util.spec_from_file_location("step_vs_trl", script)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    commands = []
    monkeypatch.setattr(bench, "run_child", lambda cmd, name: commands.append(cmd) or {})
    args = argparse.Namespace(prompts=4, group=8, max_new=64, prompt_len=32, steps=3, threads=2, chunk_size=None,
                              micro_batch_tokens=None)
    bench.run_ours(args, tmp_path)
    [cmd] = commands
    assert cmd[cmd.index("step") + 1 :].count("model.device=cpu") == 1 and cmd[-1] == "model.device=cpu"
