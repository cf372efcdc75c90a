"""How much of a decode step is its matrix products? One step of R rows against a filled cache, timed whole and
as its GEMMs alone, with the products packed as `generate` packs them.

    python benchmarks/decode_overhead.py --model DIR                 # R = 32 rows, 64 cached slots
    python benchmarks/decode_overhead.py --model DIR --rows 64 --slots 256 --json

Prints the median milliseconds of: the model's decode step (embedding -> blocks -> final norm, the LM head
excluded), the same step's projections alone (every block's linears, on the packed weights where the kernel
plan packs them, inputs of the right width), the LM head alone, and the step's other work (norms, RoPE, the
cache write, attention, SwiGLU, residual adds, Python) as the difference. Run on a quiet machine: a second
busy process on a 2-core CPU makes every two-thread region wait for a scheduler tick.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def median_ms(fn, reps: int) -> float:
    for _ in range(5):
        fn()  # warm-up: first-call allocation, packing caches
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure(model_dir: str, rows: int, slots: int, reps: int) -> dict:
    from grpo_engine.kernels import apply_kernels, cpu_model, onednn
    from grpo_engine.model.loading import load_model
    from grpo_engine.rollout.decode_kernels import packed_for_decode
    from grpo_engine.rollout.static_cache import StaticDecodeState

    model = apply_kernels(load_model(model_dir).requires_grad_(True))  # trainable: packed as in a GRPO rollout
    cfg, g = model.config, torch.Generator().manual_seed(0)
    linears = [m for m in model.layers.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {n: torch.randn(rows, n, generator=g) for n in {m.in_features for m in linears}}  # [R, in]
    with torch.inference_mode(), packed_for_decode(model, rows, steps=10**6) as packs:
        state = StaticDecodeState(cfg, rows, slots, 1, torch.float32, torch.float32, torch.device("cpu"))
        for k, v in zip(state.k, state.v):
            k.normal_(generator=g), v.normal_(generator=g)
        state.key_mask.fill_(True)
        state.write.fill_(slots - 1)
        state.positions.fill_(slots)
        tokens = torch.randint(0, cfg.vocab_size, (rows, 1), generator=g)
        cache = state.view(rows)  # the decode step's view: all `slots` cached tokens and the scratch slot

        def step():  # the same slots each time: one decode step after `slots` cached tokens
            return model(tokens, state.key_mask, cache=cache, positions=state.positions, return_hidden=True)

        def gemms():
            for m in linears:
                x = inputs[m.in_features]
                if m.packed is not None:
                    m.packed(x, m.bias)
                else:
                    torch.nn.functional.linear(x, m.weight, m.bias)

        hidden = torch.randn(rows, cfg.hidden_size, generator=g)
        head_fn = (lambda: packs.head(hidden)) if packs.head is not None else (
            lambda: onednn.linear(hidden, model.lm_head.weight))
        body, products, head_ms = median_ms(step, reps), median_ms(gemms, reps), median_ms(head_fn, reps)
        packed = sum(m.packed is not None for m in linears)
        kinds = sorted({m.packed.kind for m in linears if m.packed is not None})
    return {"cpu": cpu_model(), "threads": torch.get_num_threads(), "rows": rows, "slots": slots,
            "step_ms": body, "gemms_ms": products, "other_ms": body - products, "gemm_share": products / body,
            "head_ms": head_ms, "packed_linears": packed, "pack_kinds": kinds, "linears": len(linears)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--rows", type=int, default=32, help="rows decoding together (P x G)")
    p.add_argument("--slots", type=int, default=64, help="cached slots before the step (prompt + tokens so far)")
    p.add_argument("--reps", type=int, default=40, help="timed repetitions (median)")
    p.add_argument("--json", action="store_true", help="one JSON line")
    args = p.parse_args()
    result = measure(args.model, args.rows, args.slots, args.reps)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
