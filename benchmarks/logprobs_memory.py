"""Peak memory and time of chunked vs naive token log-probs (forward + backward).

    PYTHONPATH=. python benchmarks/logprobs_memory.py --tokens 512 --hidden 64 --vocab 151936 --chunk 64

Prints one JSON line per path. CUDA: torch.cuda.max_memory_allocated; CPU: the profiler's memory timeline
(peak of live tensor bytes allocated inside the measured call).
"""

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from grpo_engine.rl.logprobs import token_logprobs


def naive_logprobs(hidden, weight, targets):
    """The textbook way: full [N, V] logits, log-softmax, gather (what chunking avoids)."""
    return torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, targets[:, None]).squeeze(1)  # [N]

def peak_bytes(fn, device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as p:
        fn()
    live = peak = 0
    for _, action, _, size in p._memory_profile().timeline:
        live += size if action.name == "CREATE" else -size if action.name == "DESTROY" else 0
        peak = max(peak, live)
    return peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    dt = getattr(torch, a.dtype)
    h = torch.randn(a.tokens, a.hidden, dtype=dt, device=a.device, requires_grad=True)
    w = torch.randn(a.vocab, a.hidden, dtype=dt, device=a.device, requires_grad=True)
    t = torch.randint(0, a.vocab, (a.tokens,), device=a.device)
    paths = {
        "chunked": lambda: torch.autograd.grad(token_logprobs(h, w, t, chunk_size=a.chunk)[0].sum(), (h, w)),
        "naive": lambda: torch.autograd.grad(naive_logprobs(h, w, t).sum(), (h, w)),
    }
    for name, fn in paths.items():
        fn()  # warm-up
        t0 = time.perf_counter()
        fn()
        if a.device == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        peak = peak_bytes(fn, a.device)
        row = {"path": name, **vars(a), "peak_extra_MiB": round(peak / 2**20, 1), "seconds": round(secs, 3)}
        print(json.dumps(row))


if __name__ == "__main__":
    main()
