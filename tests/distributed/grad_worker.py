"""`torchrun --nproc_per_node 2 grad_worker.py CKPT OUT`: one update on a fixed batch split over the ranks,
for ddp and fsdp2 and three loss aggregations; rank 0 writes the full gradients to OUT/<strategy>-<loss>.pt.
tests/distributed/test_distributed.py compares them with one process on the whole batch."""

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from grpo_engine.model.loading import load_model
from grpo_engine.train.distributed import shard_model
from grpo_engine.train.update import update_policy
from grpo_engine.world import World

sys.path.insert(0, str(Path(__file__).parent))
from batches import LOSSES, rank_rows, settings, whole_batch  # noqa: E402

ckpt, out = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
full = whole_batch()
totals = (full.active_tokens(), full.active_rows())
for strategy in ("ddp", "fsdp2"):
    for loss in LOSSES:
        world = World(rank, size, rank, strategy)
        model = shard_model(load_model(ckpt).train(), world)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        local = full.select(torch.tensor(rank_rows(rank, size)))
        update_policy(model, optimizer, local, settings(loss), micro_tokens=40, world=world, totals=totals,
                      keep_grads=True)
        named = {n: (p.grad.full_tensor() if strategy == "fsdp2" else p.grad).cpu()
                 for n, p in model.named_parameters()}
        if rank == 0:
            torch.save(named, out / f"{strategy}-{loss}.pt")
        del model, optimizer, named
        gc.collect()  # no DDP/FSDP state (and its gloo work) left for interpreter teardown
        dist.barrier()
dist.destroy_process_group()
