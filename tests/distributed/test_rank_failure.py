"""A rank that fails in the rollout stops every rank with its error (it once left the others waiting in their
next collective until distributed.timeout_minutes, failing there with a timeout that named nothing)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_engine.rollout.sampling import NonFiniteLogits
from grpo_engine.world import RankFailed, World, fail_together, rebuild_failure

HERE = Path(__file__).parent
REPO = HERE.parents[1]
NAN = "NaN or +inf logits at decode step 0: the model's weights or activations blew up"


class OtherRankFailed(World):
    """Rank 0 of 2 whose partner raised `failure` (rank, module, type, message) in the same block."""

    def __init__(self, failure):
        super().__init__(rank=0, size=2)
        self.failure, self.calls = failure, []

    def max(self, value: int) -> int:
        self.calls.append(("max", value))
        return 1

    def gather(self, obj) -> list:
        self.calls.append(("gather", obj))
        return [obj, self.failure]


def test_a_healthy_rank_raises_the_other_ranks_error():
    """Rank 0 ran its block without error; rank 1's NonFiniteLogits reaches it by type and names rank 1."""
    world = OtherRankFailed((1, NonFiniteLogits.__module__, "NonFiniteLogits", NAN))
    with pytest.raises(NonFiniteLogits) as info, fail_together(world, "rollout"):
        pass
    assert str(info.value) == f"rank 1 failed in the rollout: {NAN}"
    assert world.calls == [("max", 0), ("gather", None)]


def test_a_failing_rank_still_joins_the_agreement():
    """Rank 0 raised too: it takes part in both collectives, then raises the errors of both ranks."""
    world = OtherRankFailed((1, "builtins", "ValueError", "prompt of example 7 has 900 tokens"))
    with pytest.raises(ValueError) as info, fail_together(world, "rollout"):
        raise ValueError("prompt of example 3 has 800 tokens")
    assert str(info.value) == ("rank 0 failed in the rollout: prompt of example 3 has 800 tokens; "
                               "rank 1 failed in the rollout: prompt of example 7 has 900 tokens")
    assert world.calls == [("max", 1), ("gather", (0, "builtins", "ValueError", "prompt of example 3 has 800 tokens"))]


def test_a_type_that_needs_more_than_a_message_becomes_rank_failed():
    err = rebuild_failure([(1, "builtins", "UnicodeDecodeError", "bad byte")], "eval")
    assert type(err) is RankFailed and str(err) == "rank 1 failed in the eval: bad byte (UnicodeDecodeError)"


def test_one_process_gets_its_own_error_unchanged():
    original = NonFiniteLogits(NAN)
    with pytest.raises(NonFiniteLogits) as info, fail_together(World(), "rollout"):
        raise original
    assert info.value is original


@pytest.mark.slow
def test_nan_logits_on_one_rank_stop_both_ranks_with_its_error(tiny_ckpt, tmp_path):
    """2 gloo ranks (torchrun), rank 1's weights NaN: both ranks stop in the rollout with rank 1's
    NonFiniteLogits (rank 0 used to wait in the step's next collective until the process group's timeout)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(HERE / "rollout_fail_worker.py"), str(tiny_ckpt), str(tmp_path)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-6000:]
    expected = f"NonFiniteLogits: rank 1 failed in the rollout: {NAN}"
    assert (tmp_path / "rank-0.txt").read_text() == expected
    assert (tmp_path / "rank-1.txt").read_text() == expected
