"""A checkpoint written by grpo-engine 0.1 resumes bit for bit with the current code.

tests/fixtures/checkpoint_v0_1 is a run directory that commit 217f169a0e51 wrote (its README.md and make.sh say
how): GRPO on a tiny random model (base/), a custom task whose reward varies between completions (so every step
updates the weights), mu=2, stopped after step 2 with a checkpoint. Resumed to step 3 by today's code it must give
the weights that today's code gives running the same config uninterrupted, and today's code must reproduce the
fixture's step 2.

Only the command line (grpo_engine.cli.main) is called and only files are read, so that moving the modules behind
it does not change what this test checks. The stored config names its paths relative to the fixture's folder
(model.path=base, run_dir=run, task data data.jsonl), so the test runs in a copy of that folder.
"""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_engine.cli import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v0_1"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())
VOLATILE = ("time_", "tokens_per_s", "peak_mem")  # metrics that measure the machine, not the run


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "model" / "model.safetensors")


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in rows}


def sha256(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest() for k, t in sorted(tensors.items())}


def unequal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def made_here(run_dir: Path) -> bool:
    """Whether this machine is the CPU and torch the fixture was made on (the kernel plan a run of today's code
    recorded in `run` names them): only there can a run repeat the fixture's arithmetic bit for bit. Elsewhere
    torch's fp32 GEMM may take another code path (AVX2 / AVX-512) and round differently."""
    plan = run_dir / "kernels.json"
    here = json.loads(plan.read_text()) if plan.is_file() else {}
    return (here.get("cpu"), torch.__version__) == (EXPECTED["made_on"]["cpu"], EXPECTED["made_on"]["torch"])


@pytest.fixture
def fixture_dir(tmp_path, monkeypatch) -> Path:
    """A copy of the fixture as the working directory, set up as it was made."""
    work = tmp_path / "checkpoint_v0_1"
    shutil.copytree(FIXTURE, work)
    monkeypatch.chdir(work)
    monkeypatch.syspath_prepend(str(work))  # task.options.reward_fn: fixture_reward_v0_1:even_bytes
    # plain torch GEMMs on one thread, as the fixture was made: a kernel plan chosen by timing this machine could
    # differ between the resumed run and the uninterrupted one
    monkeypatch.setenv("GRPO_KERNELS", "torch")
    monkeypatch.setenv("GRPO_THREADS", "1")
    return work


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the checkpoint's kernel plan was measured on")  # another CPU than the fixture's
def test_a_v0_1_checkpoint_resumes_bit_for_bit(fixture_dir):
    run_dir, fresh = fixture_dir / "run", fixture_dir / "fresh"
    assert main(["train", "train.yaml", "--resume"]) == 0
    assert main(["train", "train.yaml", "run_dir=fresh"]) == 0

    # resumed from the 0.1 checkpoint == uninterrupted today, weights and logged step 3: bit for bit on the CPU the
    # fixture was made on; elsewhere steps 1-2 of the fresh run round differently from the fixture's, so step 3
    # agrees within that rounding (a step moves each weight by about 1e-3: lr, Adam)
    assert sorted(metrics(run_dir)) == [1, 2, 3]
    resumed3, fresh3 = weights(run_dir, 3), weights(fresh, 3)
    assert unequal(weights(run_dir, 2), resumed3), "step 3 left the weights as they were: the comparison proves nothing"
    old2, fresh2 = weights(run_dir, 2), weights(fresh, 2)
    if not made_here(fresh):
        for step, (a, b) in {2: (fresh2, old2), 3: (fresh3, resumed3)}.items():
            for k in a:
                msg = lambda m, k=k, s=step: f"step {s} {k}: {m}"  # noqa: E731
                torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5, msg=msg)
        got, want = metrics(run_dir)[3], metrics(fresh)[3]
        assert got.keys() == want.keys()
        for k, v in want.items():
            close = isinstance(v, float) and got[k] == pytest.approx(v, rel=1e-3, abs=1e-5)
            assert close or got[k] == v, f"logged {k} at step 3: {got[k]} resumed, {v} uninterrupted"
        return
    differ = unequal(resumed3, fresh3)
    assert not differ, f"step 3 resumed from the v0.1 checkpoint differs from an uninterrupted run in {differ}"
    assert metrics(run_dir)[3] == metrics(fresh)[3]
    # today's code repeats the fixture's first two steps
    differ = unequal(old2, fresh2)
    assert not differ, f"today's code no longer reproduces the v0.1 run's step 2: {differ} differ"
    # and its step 3 is the one 0.1 itself computed (expected.json, written by make.sh with the old code)
    differ = [k for k, h in sha256(resumed3).items() if h != EXPECTED["step3_model_sha256"][k]]
    assert not differ, f"step 3 resumed today differs from the one 0.1 computed in {differ}"


def _perturb_first_moments(ckpt: Path) -> int:
    """Negate every AdamW exp_avg in a checkpoint's trainer_state (a JSON structure whose tensors are references
    {"__tensor__": key} into trainer_state.safetensors). Returns how many tensors changed."""
    keys = []

    def walk(obj, name=None):
        if isinstance(obj, dict):
            if name == "exp_avg" and "__tensor__" in obj:
                keys.append(obj["__tensor__"])
            for k, v in obj.items():
                walk(v, k)
        elif isinstance(obj, list):
            for v in obj:
                walk(v, name)

    walk(json.loads((ckpt / "trainer_state.json").read_text()))
    tensors = load_file(ckpt / "trainer_state.safetensors")
    for k in keys:
        tensors[k] = -tensors[k]
    save_file(tensors, ckpt / "trainer_state.safetensors")
    return len(keys)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:the checkpoint's kernel plan was measured on")
def test_the_comparison_sees_a_perturbed_optimizer_state(fixture_dir):
    """The check above can fail: resumed with the fixture's Adam first moments negated, step 3 comes out different
    from the plain resume (which also shows that the resume reads the optimizer state from the v0.1 files)."""
    shutil.copytree(fixture_dir / "run", fixture_dir / "perturbed")
    assert _perturb_first_moments(fixture_dir / "perturbed/checkpoints/step-000002") > 0
    assert main(["train", "train.yaml", "--resume"]) == 0
    assert main(["train", "train.yaml", "run_dir=perturbed", "--resume"]) == 0
    assert unequal(weights(fixture_dir / "run", 3), weights(fixture_dir / "perturbed", 3))
