"""Token-budget micro-batches and the rollout batch record."""

import torch

from grpo_engine.config.training import lr_factor
from grpo_engine.train.batch import build_train_batch, micro_batches


def test_micro_batches_respect_budget_and_cover_rows():
    lengths = [5, 12, 3, 12, 7, 1, 30]
    groups = micro_batches(lengths, token_budget=24)
    # sorted longest first: 30 | 12,12 | 7,5,3 | 1  -> hand-packed: [30] alone (over budget),
    # [12,12]=24, [7,5,3]=21, then 1 joins: 7*4=28 > 24 -> new group
    assert groups == [[6], [1, 3], [4, 0, 2], [5]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))


def test_build_train_batch_layout():
    batch = build_train_batch(
        prompt_ids=[[1, 2], [3]], completion_ids=[[4, 5, 6], [7]], sampler_logprobs=[[-1.0, -2.0, -3.0], [-0.5]],
        advantages=torch.tensor([1.0, -1.0]), completion_keep=[True, False], pad_id=0,
    )
    assert batch.input_ids.tolist() == [[1, 2, 4, 5, 6], [3, 7, 0, 0, 0]]
    assert batch.completion_mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 0]]
    assert batch.sampler_logp.tolist() == [[0, 0, -1, -2, -3], [0, -0.5, 0, 0, 0]]
    assert batch.active_tokens() == 3
    sub = batch.select(torch.tensor([1]))
    assert sub.input_ids.tolist() == [[3, 7]] and sub.lengths.tolist() == [2]


def test_lr_schedule_hand_values():
    kw = dict(total=10, warmup=2, min_ratio=0.1)
    assert [lr_factor(s, kind="constant", **kw) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    # cosine after warmup: progress = (s-2)/8; s=6 -> 0.5 -> 0.1 + 0.9*0.5*(1+cos(pi/2)) = 0.55
    assert abs(lr_factor(6, kind="cosine", **kw) - 0.55) < 1e-12
    assert abs(lr_factor(2, kind="cosine", **kw) - 1.0) < 1e-12
