"""`torchrun --nproc_per_node 2 rollout_fail_worker.py CKPT OUT`: a step's rollout (collect_groups with the real
sampler) and its next collective (step_totals), where rank 1's weights are NaN so its sampler raises
NonFiniteLogits. Each rank writes the error it stopped with to OUT/rank-N.txt.
tests/distributed/test_rank_failure.py reads them."""

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from grpo_engine.collect.groups import ShuffledPrompts, collect_groups
from grpo_engine.config import load_config
from grpo_engine.model.loading import load_model, load_tokenizer
from grpo_engine.train.setup import sampling_params, task_of
from grpo_engine.train.step import step_totals
from grpo_engine.world import World

ckpt, out = sys.argv[1], Path(sys.argv[2])
repo = Path(__file__).resolve().parents[2]
dist.init_process_group("gloo", timeout=timedelta(seconds=20))  # a rank left waiting fails after 20 s
rank, size = dist.get_rank(), dist.get_world_size()
cfg = load_config(str(repo / "configs/tiny_arithmetic.yaml"), [f"model.path={ckpt}", "rollout.max_new_tokens=2"])
tok, task = load_tokenizer(ckpt), task_of(cfg)
model = load_model(ckpt)
if rank == 1:
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
examples = task.examples("train")
try:
    collected = collect_groups(model, tok, task, examples, ShuffledPrompts(len(examples), 0),
                               sampling_params(cfg, tok), prompts=2, seed=0, step=1, max_prompt_tokens=512,
                               group_filter=cfg.algorithm.group_filter, world=World(rank, size, rank, "ddp"))
    step_totals(None, World(rank, size, rank, "ddp"))  # the next collective of a step
    result = "no error"
except Exception as e:
    result = f"{type(e).__name__}: {e}"
(out / f"rank-{rank}.txt").write_text(result)
os._exit(0)  # no process-group teardown: before the fix rank 0's group is broken by the timeout
