"""A checkpoint written by grpo-engine 0.1 resumes with the current code.

tests/fixtures/checkpoint_v0_1 is a run directory that commit 217f169a0e51 wrote (its README.md and make.sh say
how): GRPO on a tiny random model (base/), a custom task whose reward varies between completions (so every step
updates the weights), mu=2, stopped after step 2 with a checkpoint. Today's code resumes it to step 3 and logs what
an uninterrupted run of today's code logs. The sampler's random stream is not 0.1's (the one decode loop draws each
row's uniforms ahead, Draws.table), so today's completions, and with them its weights, are not 0.1's: the resumed
weights are compared with an uninterrupted run only where both start from the same state (the same checkpoint,
resumed twice, bit for bit), and the optimizer state is shown to be read by perturbing it (below).

Only the command line (grpo_engine.cli.main) is called and only files are read, so that moving the modules behind
it does not change what this test checks. The stored config names its paths relative to the fixture's folder
(model.path=base, run_dir=run, task data data.jsonl), so the test runs in a copy of that folder.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_engine.cli import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_v0_1"
VOLATILE = ("time_", "tokens_per_s", "peak_mem")  # metrics that measure the machine, not the run


def weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "checkpoints" / f"step-{step:06d}" / "model" / "model.safetensors")


def metrics(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not any(s in k for s in VOLATILE)} for r in rows}


def unequal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


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

    # the resume reads the whole 0.1 state: step 3 logs the keys an uninterrupted run of today's code logs, moves the
    # weights, and a second resume from the same files gives the same step 3 bit for bit
    assert sorted(metrics(run_dir)) == [1, 2, 3]
    assert metrics(run_dir)[3].keys() == metrics(fresh)[3].keys()
    resumed3 = weights(run_dir, 3)
    assert unequal(weights(run_dir, 2), resumed3), "step 3 left the weights as they were: the comparison proves nothing"
    shutil.copytree(FIXTURE / "run", fixture_dir / "again")
    assert main(["train", "train.yaml", "run_dir=again", "--resume"]) == 0
    differ = unequal(resumed3, weights(fixture_dir / "again", 3))
    assert not differ, f"two resumes of the v0.1 checkpoint differ at step 3 in {differ}"
    assert metrics(fixture_dir / "again")[3] == metrics(run_dir)[3]


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
