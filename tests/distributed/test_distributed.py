"""Data-parallel GRPO on 2 CPU processes (gloo): the same gradients, rewards and weights as one process with
the whole batch, for ddp and fsdp2, and resume on 2 ranks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from batches import LOSSES, settings, whole_batch

from grpo_engine.model.loading import load_model
from grpo_engine.train.update import update_policy

HERE = Path(__file__).parent
REPO = HERE.parents[1]


def torchrun(*args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE)]), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-6000:]
    return out


@pytest.mark.slow
def test_two_ranks_give_one_process_gradients(tiny_ckpt, tmp_path):
    """(a) one update on a fixed batch split over 2 ranks == 1 process on the whole batch, to 1e-6 relative,
    with the fused LM head and shared-prompt forward (the default update path), for every aggregation."""
    torchrun(HERE / "grad_worker.py", tiny_ckpt, tmp_path)
    for loss in LOSSES:
        model = load_model(tiny_ckpt).train()
        update_policy(model, torch.optim.SGD(model.parameters(), lr=0.0), whole_batch(), settings(loss),
                      micro_tokens=40, keep_grads=True)
        ref = {n: p.grad for n, p in model.named_parameters()}
        for strategy in ("ddp", "fsdp2"):
            got = torch.load(tmp_path / f"{strategy}-{loss}.pt")
            for name, g in ref.items():
                scale = g.abs().max().clamp_min(1e-12)
                assert float((got[name] - g).abs().max() / scale) < 1e-6, (strategy, loss, name)


def _custom_config(tmp_path, reward: str = "even_bytes") -> Path:
    """tiny_arithmetic.yaml with a reward that varies between random completions (tests/train/reward_fns.py)."""
    import json

    import yaml

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"say {i}", "answer": str(i)}) + "\n" for i in range(16)))
    cfg = yaml.safe_load((REPO / "configs/tiny_arithmetic.yaml").read_text())
    cfg["task"] = {"name": "custom", "options": {"data_path": str(data), "reward_fn": f"reward_fns:{reward}",
                                                 "system_prompt": None, "prefill": ""}}
    path = tmp_path / "custom.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _train(config, args, ranks: int, tmp_path, name: str, stderr: list | None = None):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests" / "train")])}
    cmd = [sys.executable, "-m", "grpo_engine.cli", "train", str(config), f"run_dir={tmp_path / name}", *args]
    if ranks > 1:
        cmd.append(f"--nproc={ranks}")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-6000:]
    if stderr is not None:
        stderr.append(out.stderr)
    import json

    rows = [json.loads(ln) for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return rows, tmp_path / name / "checkpoints"


def _weights(ckpt: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "model" / "model.safetensors"))


def _close(a: dict, b: dict, tol: float) -> None:
    """Every tensor within `tol` relative (Frobenius norms): AdamW divides tiny gradient entries by their own
    tiny magnitudes, so elementwise the last-bit differences of a different summation order are amplified."""
    for name, t in a.items():
        err = float((t.double() - b[name].double()).norm() / b[name].double().norm().clamp_min(1e-12))
        assert err < tol, (name, err)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_torchrun_two_ranks_repeat_one_process_and_resume(tiny_ckpt, tmp_path, strategy):
    """(b) `grpo train --nproc 2` (torchrun) for 3 steps gives the same per-step rewards and final weights as one
    process with the same global batch; (c) a 2-rank run stopped after 2 steps and resumed repeats the
    uninterrupted 2-rank run."""
    config = _custom_config(tmp_path)
    args = [f"model.path={tiny_ckpt}", "schedule.steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "checkpoint.every=1", "checkpoint.keep_last=3",
            f"distributed.strategy={strategy}"]
    one, one_ckpt = _train(config, args, 1, tmp_path, "one")
    two, two_ckpt = _train(config, args, 2, tmp_path, "two")
    assert [r["reward_mean"] for r in two] == pytest.approx([r["reward_mean"] for r in one], rel=1e-5)
    assert [r["rows"] for r in two] == [r["rows"] for r in one]  # rows trained: advantage 0 is left out
    assert all(0 < r["rows"] <= 16 for r in one) and sum(r["rows"] for r in one) > 3 * 12
    _close(_weights(two_ckpt / "step-000003"), _weights(one_ckpt / "step-000003"), 1e-5)
    _train(config, args + ["schedule.steps=2"], 2, tmp_path, "resumed")
    resumed, resumed_ckpt = _train(config, args + ["--resume"], 2, tmp_path, "resumed")
    assert [r["reward_mean"] for r in resumed] == [r["reward_mean"] for r in two]
    _close(_weights(resumed_ckpt / "step-000003"), _weights(two_ckpt / "step-000003"), 1e-6)


@pytest.mark.slow
def test_a_signal_that_reaches_one_rank_stops_every_rank_after_the_same_step(tiny_ckpt, tmp_path):
    """SIGTERM on rank 1 only, during step 2: both ranks finish step 2, write its checkpoint together and exit
    cleanly (rank 1 once stopped alone and rank 0 waited in step 3's collectives until the timeout)."""
    config = _custom_config(tmp_path, "sigterm_rank_1_in_step_2")
    args = [f"model.path={tiny_ckpt}", "schedule.steps=4", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=6", "checkpoint.every=0", "distributed.timeout_minutes=1",
            "eval.before_after=false", "--no-check"]  # the reward function counts its calls from step 1
    err = []
    rows, ckpts = _train(config, args, 2, tmp_path, "signalled", err)
    assert [r["step"] for r in rows] == [1, 2]
    assert "[rank 1] stopped after step 2 (SIGTERM)" in err[0]
    assert "stopped after step 2 (a signal to another rank)" in err[0]  # rank 0's line (it was "stop_after")
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step-")) == ["step-000002"]


@pytest.mark.slow
def test_sigterm_to_the_nproc_launcher_stops_the_ranks_with_a_checkpoint(tiny_ckpt, tmp_path):
    """`grpo train --nproc 2` sent SIGTERM (a job scheduler's kill): the signal reaches the ranks, which finish
    their step, write its checkpoint and exit; torchrun then exits 0 on its own and the launcher waits for it.
    It used to die alone, leaving torchrun and the ranks training on; then torchrun got the signal, reported it
    with a traceback and exit 1, and would have killed ranks still checkpointing 30 s later."""
    import json
    import signal
    import time

    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "grpo_engine.cli", "train", str(REPO / "configs/tiny_arithmetic.yaml"),
           f"model.path={tiny_ckpt}", f"run_dir={run_dir}", "schedule.steps=500", "rollout.prompts_per_step=4",
           "rollout.group_size=4", "rollout.max_new_tokens=6", "checkpoint.every=0", "--nproc=2"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text().strip():
            assert proc.poll() is None and time.monotonic() < deadline, "no step was logged"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
        steps = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
        time.sleep(3)  # ranks left running would log more steps meanwhile
        assert [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()] == steps
        assert f"[rank 1] stopped after step {steps[-1]} (SIGTERM)" in err, err[-4000:]
        assert proc.returncode == 0 and "SignalException" not in err, err[-4000:]
        assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == [f"step-{steps[-1]:06d}"]
        assert steps[-1] < 500
    finally:
        if proc.poll() is None:
            os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", str(run_dir)], check=False)
