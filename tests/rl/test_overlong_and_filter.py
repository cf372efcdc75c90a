"""Overlong handling (DAPO) and dynamic-sampling group selection."""

import pytest
import torch

from grpo_engine.rl.advantages import overlong_keep_mask, select_groups, soft_overlong_penalty


def test_soft_overlong_penalty_hand_computed():
    # L_max = 20, L_cache = 4: no penalty up to 16, then -(L - 16) / 4, and -1 past 20
    lengths = torch.tensor([0, 10, 16, 17, 18, 20, 21, 100])
    expect = torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
    torch.testing.assert_close(soft_overlong_penalty(lengths, max_len=20, cache_len=4), expect)
    with pytest.raises(ValueError, match="cache_len"):
        soft_overlong_penalty(lengths, max_len=20, cache_len=0)


def test_overlong_keep_mask():
    assert overlong_keep_mask(["stop", "length", "stop"]).tolist() == [True, False, True]
    with pytest.raises(ValueError, match="finish_reason"):
        overlong_keep_mask(["eos"])


def test_select_until_target():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [float("nan"), 1.0, 1.0], [float("nan"), 0.0, 1.0]])
    assert select_groups([r], target_groups=4).keep == [(0, 1), (0, 3)]  # informative: two finite rewards differ
    assert select_groups([torch.tensor([[0.0, 0.05]])], target_groups=1, tol=0.1).keep == []
    round0 = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])  # only group 1 informative
    round1 = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.5, 1.0]])  # groups 0 and 2 informative
    sel = select_groups([round0], target_groups=2)
    assert sel.keep == [(0, 1)] and sel.num_informative == 1
    sel = select_groups([round0, round1], target_groups=2)
    assert sel.keep == [(0, 1), (1, 0)] and sel.num_informative == 3
