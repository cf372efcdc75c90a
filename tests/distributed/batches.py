"""The fixed rollout batch the distributed tests split over ranks: 4 prompts x 4 completions of different
lengths (so ranks run different numbers of micro-batches), whole groups per rank."""

import torch

from grpo_engine.config import LossConfig
from grpo_engine.rl.losses import resolve
from grpo_engine.train.batch import TrainBatch, build_train_batch
from grpo_engine.train.update import UpdateSettings

LOSSES = ("grpo", "dapo", "dr_grpo")
PROMPTS, GROUP = 4, 4


def whole_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (5 + 3 * i,), generator=g).tolist() for i in range(PROMPTS)]
    rows = PROMPTS * GROUP
    completions = [torch.randint(0, 250, (2 + (i * 7) % 9,), generator=g).tolist() for i in range(rows)]
    advantages = torch.randn(rows, generator=g)
    return build_train_batch([prompts[i // GROUP] for i in range(rows)], completions,
                               [[0.0] * len(c) for c in completions], advantages, [True] * rows, pad_id=0)


def rank_rows(rank: int, size: int) -> list[int]:
    """The rows of this rank's whole groups (a group never straddles ranks)."""
    per = PROMPTS // size * GROUP
    return list(range(rank * per, (rank + 1) * per))


def settings(loss: str) -> UpdateSettings:
    return UpdateSettings(loss=resolve(LossConfig(loss=loss, max_completion_len=16)), mu=1, grad_clip=0.0,
                          temperature=1.0, chunk_size=16, auto_halve=False)
