"""What the ranks must agree on, checked in one process with a stand-in for the other rank's collectives: the
step's advantages are those of one process on the whole batch; a rank without rows reports the step's loss."""

from pathlib import Path

import torch

from grpo_engine.collect.groups import Group
from grpo_engine.config import load_config
from grpo_engine.rl.advantages import compute_advantages
from grpo_engine.tasks.base import Example, RewardResult
from grpo_engine.train.batch import train_batch
from grpo_engine.world import World


class TwoRanks(World):
    """Rank `rank` of 2; the other rank's contributions to gather / sum are given up front."""

    def __init__(self, rank: int, other_gathered=None, other_sum=None):
        super().__init__(rank=rank, size=2, local_rank=rank, strategy="none")  # no real gradient sums
        self.other_gathered, self.other_sum = other_gathered, other_sum

    def gather(self, obj) -> list:
        return [obj, self.other_gathered] if self.rank == 0 else [self.other_gathered, obj]

    def sum(self, values: list[float]) -> list[float]:
        other = self.other_sum(values) if callable(self.other_sum) else self.other_sum or [0.0] * len(values)
        return [a + b for a, b in zip(values, other)]

    def max(self, value: int) -> int:
        return value


class _Task:
    @staticmethod
    def equivalent(a, b) -> bool:
        return a == b


def _groups(rewards: list[list[float]]) -> list[Group]:
    """One group per row of rewards, G completions of different lengths."""
    out = []
    for p, row in enumerate(rewards):
        comps = [[5 + g] * (1 + g) for g in range(len(row))]
        out.append(Group(Example(f"e{p}", "q", "a"), "q", [1, 2, 3], comps, [[0.0] * len(c) for c in comps],
                         ["stop"] * len(row), ["t"] * len(row),
                         [RewardResult(r, {"answer": r}, str(r)) for r in row]))
    return out


def test_batch_std_advantages_use_the_whole_steps_std():
    """estimator=batch_std: rank 0's advantages == one process's on the whole batch (not its share's std)."""
    cfg = load_config(None, ["algorithm.advantage.estimator=batch_std"])
    rewards = [[0.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [5.0, -3.0, 2.0, 9.0], [4.0, 4.0, 0.0, 8.0]]
    whole, _ = train_batch(_groups(rewards), cfg, _Task(), pad_id=0)
    other = torch.tensor(rewards[2:], dtype=torch.float64)  # rank 1's [P/2, G]
    mine, _ = train_batch(_groups(rewards[:2]), cfg, _Task(), pad_id=0, world=TwoRanks(0, other))
    assert torch.equal(mine.advantages, whole.advantages[:8])
    expected = compute_advantages(torch.tensor(rewards), cfg.algorithm.advantage).advantages[:2].flatten()
    assert torch.allclose(mine.advantages, expected)


def test_batch_std_on_a_rank_without_groups_still_joins_the_gather():
    """A rank whose groups were all filtered out (dynamic sampling) has no batch, but gives the others their std."""
    cfg = load_config(None, ["algorithm.advantage.estimator=batch_std"])
    calls = []

    class Watching(TwoRanks):
        def gather(self, obj):
            calls.append(obj)
            return super().gather(obj)

    batch, _ = train_batch([], cfg, _Task(), pad_id=0, world=Watching(1, torch.ones(1, 4, dtype=torch.float64)))
    assert batch is None and calls == [None]


def test_a_rank_without_rows_reports_a_nonfinite_step_of_the_others(tiny_ckpt, tmp_path):
    """This rank's groups all have advantage 0 (nothing to train on), the other rank's loss is NaN: the step is
    skipped on both and this rank reports the step's loss (it once failed with AttributeError on None.loss,
    leaving the other rank waiting in a collective)."""
    from grpo_engine.collect.groups import ShuffledPrompts
    from grpo_engine.config import load_config
    from grpo_engine.model.loading import load_tokenizer, pick_device
    from grpo_engine.plan.resolved import resolve_settings
    from grpo_engine.train.policy import build_policy
    from grpo_engine.train.setup import sampling_params, task_of
    from grpo_engine.train.step import StepInputs, StepState, grpo_step

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(str(repo / "configs/tiny_arithmetic.yaml"),
                      [f"model.path={tiny_ckpt}", f"run_dir={tmp_path}", "rollout.max_new_tokens=2"])
    tok, task = load_tokenizer(tiny_ckpt), task_of(cfg)
    examples = task.examples("train")

    def other_rank(values):  # step totals: 1 rank with 8 tokens in 4 rows; then its loss share: NaN
        return [1.0, 8.0, 4.0] if len(values) == 3 else [float("nan")] * len(values)

    world = TwoRanks(0, other_sum=other_rank)
    world.gather = lambda obj: [obj, obj]
    resolved = resolve_settings(cfg, pick_device("cpu"))
    cfg = resolved.config
    inputs = StepInputs(cfg, build_policy(resolved), tok, task, examples,
                     ShuffledPrompts(len(examples), cfg.seed), sampling_params(cfg, tok), world)
    before = {n: p.detach().clone() for n, p in inputs.policy.model.named_parameters()}
    # every group's rewards equal: advantage 0, no rows on this rank
    inputs.task.reward = lambda ex, text: RewardResult(0.0, {}, None)
    messages = []
    record = grpo_step(inputs, StepState(micro_tokens=256), 1, message=messages.append)
    assert record.update.skipped and record.update.nonfinite and record.update.stats is None
    assert messages == ["step 1: non-finite loss (nan) or grad norm (0.0); update skipped (1 in a row)"]
    assert all(torch.equal(p, before[n]) for n, p in inputs.policy.model.named_parameters())
