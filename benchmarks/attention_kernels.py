"""The attention of a forward with a gradient on the CPU: SDPA against the grouped matmuls of
grpo_engine/kernels/attention.py, forward and backward, at one head shape over a few (rows, queries, keys) sizes,
in fp32 and bf16. The kernel plan makes the same comparison (at TRAIN_SIZES) to choose; this prints each size.

    python benchmarks/attention_kernels.py                       # SmolLM2-135M's heads: 9 query, 3 KV, 64 wide
    python benchmarks/attention_kernels.py --heads 14 --kv-heads 2

Each size: a completion of `queries` tokens after its shared prompt, causal over the last `queries` of `keys`
slots. Times are the best of --repeats calls, the kernels taking turns. Prints a table, then one JSON line.
Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

SIZES = ((8, 64, 96), (8, 128, 192), (8, 256, 320), (4, 512, 612), (1, 32, 32))  # (rows, queries, keys)


def time_size(args, rows: int, queries: int, keys: int, dtype) -> dict[str, float]:
    """Best seconds of forward and of backward for each kernel at one size."""
    import torch

    from grpo_engine.kernels.attention import TIMED_TRAINING, causal_mask

    g = torch.Generator().manual_seed(0)
    q = torch.randn(rows, args.heads, queries, args.head_dim, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(rows, args.kv_heads, keys, args.head_dim, generator=g).to(dtype).requires_grad_()
            for _ in range(2))
    grad = torch.randn(rows, args.heads, queries, args.head_dim, generator=g).to(dtype)
    mask = causal_mask(queries, keys)
    best = {f"{name} {part}": float("inf") for name in TIMED_TRAINING for part in ("forward", "backward")}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, kernel in TIMED_TRAINING.items():
            t0 = time.perf_counter()
            out = kernel(q, k, v, mask)
            t1 = time.perf_counter()
            torch.autograd.grad(out, (q, k, v), grad)
            t2 = time.perf_counter()
            best[f"{name} forward"] = min(best[f"{name} forward"], t1 - t0)
            best[f"{name} backward"] = min(best[f"{name} backward"], t2 - t1)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    import torch

    from grpo_engine.kernels import cpu_model

    torch.set_num_threads(args.threads)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for size in SIZES:
            t = time_size(args, *size, dtype)
            ratio = (t["grouped forward"] + t["grouped backward"]) / (t["sdpa forward"] + t["sdpa backward"])
            rows.append({"dtype": str(dtype).removeprefix("torch."), "rows": size[0], "queries": size[1],
                         "keys": size[2], **{k: v * 1e3 for k, v in t.items()}, "grouped_over_sdpa": ratio})
    print(f"{cpu_model()}, {args.threads} threads, {args.heads} / {args.kv_heads} heads of {args.head_dim}; ms")
    print(f"{'dtype':<9} {'rows x queries x keys':>22} {'SDPA fwd':>9} {'SDPA bwd':>9} {'grouped fwd':>12} "
          f"{'grouped bwd':>12} {'grouped / SDPA':>15}")
    for r in rows:
        print(f"{r['dtype']:<9} {r['rows']:>8} x {r['queries']:>4} x {r['keys']:>4} {r['sdpa forward']:9.2f} "
              f"{r['sdpa backward']:9.2f} {r['grouped forward']:12.2f} {r['grouped backward']:12.2f} "
              f"{r['grouped_over_sdpa']:14.2f}x")
    print(json.dumps({"cpu": cpu_model(), "threads": args.threads, "heads": args.heads, "kv_heads": args.kv_heads,
                      "head_dim": args.head_dim, "torch": torch.__version__, "sizes": rows}))


if __name__ == "__main__":
    main()
